"""The building blocks of ``pi05.py``, written for few, large kernels: fused projections (Q/K/V in one matrix,
gate/up in one matrix, SigLIP's q/k/v in one matrix) that still save and load as openpi's separate tensors, Gemma's
RMSNorm and the expert's adaRMSNorm on ``F.rms_norm`` (the modulation of every adaRMSNorm computed once per call, not
per layer and step), the SigLIP encoder layer, RoPE with the rotate-half sign folded into the sine table, and
grouped-query attention through one ``F.scaled_dot_product_attention`` with an additive bias built once per call.
Shapes: B batch, T query tokens, S key tokens, W width, Hq query heads, Hkv KV heads, G = Hq / Hkv, D head dim.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import SiglipVisionConfig
from transformers.models.siglip.modeling_siglip import SiglipVisionEmbeddings

from .config import GemmaConfig


def cast(x: Tensor, dtype: torch.dtype) -> Tensor:
    """``x.to(dtype)`` without a dispatcher call when it is already ``dtype`` (eager: one operator less per use)."""
    return x if x.dtype == dtype else x.to(dtype)


# ------------------------------------------------------------------------------------------------------------------
# Fused projections with openpi's key layout
# ------------------------------------------------------------------------------------------------------------------


class FusedParams(nn.Module):
    """Base of a module that keeps projections of one input, which openpi stores as separate tensors, stacked along
    dim 0 in one parameter (one GEMM instead of two or three).  ``state_dict()`` shows openpi's tensors (views of the
    stacked parameter, under openpi's names, in openpi's order) and ``load_state_dict()`` stacks openpi's tensors, so
    checkpoints keep openpi's layout while the forward, the optimiser and DDP see one parameter (gradients flow to
    it as to any parameter)."""

    def __init__(self):
        super().__init__()
        self._stacked: dict[str, list[tuple[str, int]]] = {}    # parameter -> [(openpi key, rows)], stacking order
        self._key_order: list[str] = []                          # openpi keys of the stacked parameters, file order

    def stack(self, name: str, parts: dict[str, Tensor]) -> None:
        """Register parameter ``name`` = cat(parts) (openpi key -> freshly initialised tensor, in stacking order)."""
        self.register_parameter(name, nn.Parameter(torch.cat(list(parts.values()))))
        self._stacked[name] = [(key, t.shape[0]) for key, t in parts.items()]
        self._key_order += list(parts)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        views = {}
        for name, parts in self._stacked.items():
            p = self._parameters[name]
            p = p if keep_vars else p.detach()
            views.update(zip((key for key, _ in parts), p.split([rows for _, rows in parts])))
        for key in self._key_order:
            destination[prefix + key] = views[key]

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        for name, parts in self._stacked.items():
            keys = [prefix + key for key, _ in parts]
            if not any(k in state_dict for k in keys):
                continue                                 # the stacked name itself, or missing (reported below)
            want = self._parameters[name].shape[1:]
            absent = [k for k in keys if k not in state_dict]
            bad = [f"size mismatch for {k}: copying a param with shape {tuple(state_dict[k].shape)} from checkpoint, "
                   f"the shape in current model is {(rows, *want)}"
                   for k, (_, rows) in zip(keys, parts)
                   if k in state_dict and tuple(state_dict[k].shape) != (rows, *want)]
            missing_keys += absent
            error_msgs += bad
            tensors = [state_dict.pop(k) for k in keys if k in state_dict]
            if not absent and not bad:
                state_dict[prefix + name] = torch.cat(tensors)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)


def _linears(in_features: int, outs: dict[str, int], bias: bool) -> dict[str, nn.Linear]:
    # separate nn.Linear created in openpi's order: a seeded random init draws the same numbers as the unfused model
    return {name: nn.Linear(in_features, n, bias=bias) for name, n in outs.items()}


class GemmaAttention(FusedParams):
    """One tower's attention projections: ``qkv_weight`` [(Hq + 2 Hkv) D, W] (openpi: q_proj, k_proj, v_proj) and
    ``o_proj``.  The attention itself is joint over both towers (``Pi05Model._layers``)."""

    def __init__(self, g: GemmaConfig):
        super().__init__()
        lin = _linears(g.width, {"q_proj": g.num_heads * g.head_dim, "k_proj": g.num_kv_heads * g.head_dim,
                                 "v_proj": g.num_kv_heads * g.head_dim}, bias=False)
        self.stack("qkv_weight", {f"{n}.weight": m.weight for n, m in lin.items()})
        self.o_proj = nn.Linear(g.num_heads * g.head_dim, g.width, bias=False)


class GemmaMLP(FusedParams):
    """GeGLU MLP: ``gate_up_weight`` [2 M, W] (openpi: gate_proj, up_proj) -> gelu_tanh(gate) * up -> down_proj."""

    def __init__(self, width: int, mlp_dim: int):
        super().__init__()
        lin = _linears(width, {"gate_proj": mlp_dim, "up_proj": mlp_dim}, bias=False)
        self.stack("gate_up_weight", {f"{n}.weight": m.weight for n, m in lin.items()})
        self.down_proj = nn.Linear(mlp_dim, width, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = F.linear(x, self.gate_up_weight).chunk(2, dim=-1)           # [..., M] each
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


# ------------------------------------------------------------------------------------------------------------------
# Norms
# ------------------------------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """Gemma's RMSNorm: y = x / rms(x) * (1 + w) in fp32, cast back to x's dtype (w starts at 0)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: Tensor) -> Tensor:
        y = F.rms_norm(cast(x, torch.float32), (x.shape[-1],), 1.0 + cast(self.weight, torch.float32), self.eps)
        return cast(y, x.dtype)


class AdaRMSNorm(nn.Module):
    """adaRMSNorm: cond [..., Wc] -> dense -> (scale, shift, gate) each [..., W]; y = rms(x) * (1 + scale) + shift,
    and the caller applies the gated residual x + gate * f(y).  ``modulation`` depends on the condition only, so
    ``sample_actions`` computes it for all S steps at once; ``forward`` applies a precomputed one."""

    def __init__(self, dim: int, cond_dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.dense = nn.Linear(cond_dim, 3 * dim)

    def modulation(self, cond: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
        """cond [..., Wc] -> (1 + scale [..., 1, W] fp32, shift [..., 1, W] fp32, gate [..., 1, W] in ``dtype``);
        the 1 is the token axis."""
        mod = self.dense(cast(cond, self.dense.weight.dtype)).float()[..., None, :]   # [..., 1, 3W]
        scale, shift, gate = mod.chunk(3, dim=-1)
        return 1 + scale, shift, cast(gate, dtype)

    def forward(self, x: Tensor, mod: tuple[Tensor, Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        scale1, shift, gate = mod
        xn = F.rms_norm(cast(x, torch.float32), (x.shape[-1],), eps=self.eps)
        return cast(torch.addcmul(shift, xn, scale1), x.dtype), gate


# ------------------------------------------------------------------------------------------------------------------
# Gemma towers
# ------------------------------------------------------------------------------------------------------------------


class GemmaLayer(nn.Module):
    def __init__(self, g: GemmaConfig, cond_dim: int | None):
        super().__init__()
        self.self_attn = GemmaAttention(g)
        self.mlp = GemmaMLP(g.width, g.mlp_dim)
        if g.adarms:
            self.input_layernorm = AdaRMSNorm(g.width, cond_dim, g.rms_norm_eps)
            self.post_attention_layernorm = AdaRMSNorm(g.width, cond_dim, g.rms_norm_eps)
        else:
            self.input_layernorm = RMSNorm(g.width, g.rms_norm_eps)
            self.post_attention_layernorm = RMSNorm(g.width, g.rms_norm_eps)


class GemmaTowerModel(nn.Module):
    """``language_model`` (with embed_tokens) or ``gemma_expert.model`` (without)."""

    def __init__(self, g: GemmaConfig, vocab_size: int | None, cond_dim: int | None):
        super().__init__()
        if vocab_size is not None:
            self.embed_tokens = nn.Embedding(vocab_size, g.width)
        self.layers = nn.ModuleList([GemmaLayer(g, cond_dim) for _ in range(g.depth)])
        self.norm = AdaRMSNorm(g.width, cond_dim, g.rms_norm_eps) if g.adarms else RMSNorm(g.width, g.rms_norm_eps)

    def modulations(self, cond: Tensor, dtype: torch.dtype) -> list[tuple[Tensor, Tensor, Tensor]]:
        """Every adaRMSNorm's modulation for ``cond`` [..., Wc]: [layer 0 input, layer 0 post, ..., final norm]."""
        norms = [n for layer in self.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
        return [n.modulation(cond, dtype) for n in norms + [self.norm]]


class UnusedLMHead(nn.Module):
    """``gemma_expert.lm_head``: present in openpi's state_dict, unused by pi0.5.  Its ``weight`` has the real shape
    [V, We] but is a zero-stride view of a single zero, so it costs no memory on any device; loading checks its
    shape and ignores its values."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(()).expand(out_features, in_features), requires_grad=False)

    def _apply(self, fn, recurse=True):                  # .to(device / dtype) converts one element, not V x We
        shape = self.weight.shape
        self.weight = nn.Parameter(fn(self.weight.detach().new_zeros(())).expand(shape), requires_grad=False)
        return self

    def reset(self, device: torch.device | str) -> None:
        """Re-create the zero view on ``device`` (e.g. after loading into a meta-device model)."""
        w = self.weight
        self.weight = nn.Parameter(torch.zeros((), dtype=w.dtype, device=device).expand(w.shape), requires_grad=False)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        w = state_dict.get(prefix + "weight")
        if w is not None and tuple(w.shape) != tuple(self.weight.shape):
            error_msgs.append(f"size mismatch for {prefix}weight: {tuple(w.shape)} vs {tuple(self.weight.shape)}")


# ------------------------------------------------------------------------------------------------------------------
# SigLIP
# ------------------------------------------------------------------------------------------------------------------


class SiglipAttention(FusedParams):
    """``qkv_weight`` [3 Wv, Wv] / ``qkv_bias`` [3 Wv] (openpi / transformers: k_proj, v_proj, q_proj) + out_proj."""

    def __init__(self, width: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        lin = _linears(width, {"k_proj": width, "v_proj": width, "q_proj": width}, bias=True)   # transformers' order
        order = ("q_proj", "k_proj", "v_proj")
        self.stack("qkv_weight", {f"{n}.weight": lin[n].weight for n in order})
        self.stack("qkv_bias", {f"{n}.bias": lin[n].bias for n in order})
        self._key_order = [f"{n}.{p}" for n in lin for p in ("weight", "bias")]               # the file's order
        self.out_proj = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        n, T, W = x.shape
        qkv = F.linear(x, self.qkv_weight, self.qkv_bias).view(n, T, 3, self.num_heads, W // self.num_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)                                     # 3 x [n, Hv, T, Dv]
        o = F.scaled_dot_product_attention(q, k, v)                              # scale Dv^-0.5
        return self.out_proj(o.transpose(1, 2).reshape(n, T, W))


class SiglipMLP(nn.Module):
    def __init__(self, width: int, mlp_dim: int):
        super().__init__()
        self.fc1 = nn.Linear(width, mlp_dim)
        self.fc2 = nn.Linear(mlp_dim, width)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class SiglipLayer(nn.Module):
    """Pre-LayerNorm transformer block (keys layer_norm1 / self_attn / layer_norm2 / mlp, as transformers')."""

    def __init__(self, width: int, num_heads: int, mlp_dim: int, eps: float):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(width, eps=eps)
        self.self_attn = SiglipAttention(width, num_heads)
        self.layer_norm2 = nn.LayerNorm(width, eps=eps)
        self.mlp = SiglipMLP(width, mlp_dim)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class SiglipVisionTransformer(nn.Module):
    """SigLIP without pooling head (keys: embeddings / encoder.layers / post_layernorm)."""

    def __init__(self, vcfg: SiglipVisionConfig):
        super().__init__()
        self.embeddings = SiglipVisionEmbeddings(vcfg)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList([
            SiglipLayer(vcfg.hidden_size, vcfg.num_attention_heads, vcfg.intermediate_size, vcfg.layer_norm_eps)
            for _ in range(vcfg.num_hidden_layers)])
        self.post_layernorm = nn.LayerNorm(vcfg.hidden_size, eps=vcfg.layer_norm_eps)

    def forward(self, pixels: Tensor, dtype: torch.dtype) -> Tensor:
        # pixels [n, 3, 224, 224] in [-1, 1] -> [n, N, Wv]
        emb = self.embeddings
        x = emb.patch_embedding(cast(pixels, emb.patch_embedding.weight.dtype))   # [n, Wv, 16, 16] fp32
        x = x.flatten(2).transpose(1, 2) + emb.position_embedding.weight[None]    # [n, N, Wv]
        x = cast(x, dtype)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


# ------------------------------------------------------------------------------------------------------------------
# RoPE and attention
# ------------------------------------------------------------------------------------------------------------------


def rope_frequencies(head_dim: int, theta: float, device: torch.device | str | None = None) -> Tensor:
    """[D] fp32: the inverse frequencies theta^(-2i/D) of pairs (i, i + D/2), the first half negated (sin(-f) =
    -sin(f) puts rotate-half's sign into the sine table)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    return torch.cat([-inv, inv])


def rope_tables(positions: Tensor, freqs: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """positions [B, T], freqs of ``rope_frequencies`` -> (cos, sin) [B, T, 1, D] for ``apply_rope``.  Built once
    per call, shared by all layers (and denoise steps)."""
    ang = positions.clamp(min=0).float()[..., None, None] * freqs                            # [B, T, 1, D]
    return cast(ang.cos(), dtype), cast(ang.sin(), dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE (HF Gemma's convention): x [B, T, h, D] -> x * cos + [x2, x1] * sin with the signed sine of
    ``rope_tables`` (= [x1 cos - x2 sin, x2 cos + x1 sin])."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)


def attention_bias(mask: Tensor, num_heads: int, num_kv_heads: int, dtype: torch.dtype) -> Tensor:
    """Boolean mask [B, T, S] (True = attend; every row needs one True) -> additive bias [B, 1, T*G, S] in the
    layout ``attention`` uses (the G = Hq/Hkv query heads of a KV head folded into the query length, query-major).
    Built once per call and shared by all layers (and all denoise steps)."""
    B, T, S = mask.shape
    G = num_heads // num_kv_heads
    bias = torch.zeros(B, T, 1, S, dtype=dtype, device=mask.device).masked_fill_(~mask[:, :, None],
                                                                                  torch.finfo(dtype).min)
    return bias.expand(B, T, G, S).reshape(B, 1, T * G, S)


def attention(q: Tensor, k: Tensor, v: Tensor, bias: Tensor) -> Tensor:
    """Grouped-query attention, scale D^-0.5, one ``F.scaled_dot_product_attention``: q [B, T, Hq, D], k/v
    [B, S, Hkv, D], bias from ``attention_bias`` -> [B, T, Hq*D].  The G query heads of a KV head are folded into
    the query length (SDPA sees [B, Hkv, T*G, D] against [B, Hkv, S, D]), so the KV heads are never repeated in
    memory and every SDPA backend applies; with one KV head (every preset) the folds are views."""
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    q = q.reshape(B, T, Hkv, G, D).transpose(1, 2).reshape(B, Hkv, T * G, D)
    o = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=bias, scale=D ** -0.5)
    return o.view(B, Hkv, T, G, D).transpose(1, 2).reshape(B, T, Hq * D)
