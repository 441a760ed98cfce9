"""The pi0.5 network and its KV-cache primitives, in one readable file (gpt-fast style); its blocks are in
``layers.py``.

``Pi05Model`` = SigLIP vision tower + projector + Gemma VLM + Gemma action expert with adaRMSNorm (Mixture of
Transformers: per layer each tower computes its own Q/K/V - one fused matrix per tower - they are concatenated along
the sequence, RoPE'd with shared position ids, attend in one ``scaled_dot_product_attention``, and are split back to
each tower's own o_proj / MLP / norms).  Its ``state_dict()`` keys, shapes and dtypes reproduce openpi's PyTorch pi0.5
exactly (see ``test/data/pi05_openpi_state_dict.tsv``; the fused matrices show as openpi's separate tensors).  The
engine drives it through explicit, stateless primitives: ``prefill`` / ``prefill_images`` / ``extend_prefix`` build
a dense prefix KV (``Prefix``), ``sample_actions`` runs S Euler steps of the expert that *read* the prefix KV and never
write it (positions, attention bias, RoPE tables, time embeddings and every adaRMSNorm modulation are computed once
per call for all S steps), and ``decode`` computes one token for B rows whose K/V live in a caller-owned flat slot
pool (``kv.k[l]`` / ``kv.v[l]``: ``[num_slots, Hkv, D]``), writing only the new token's K/V.  Shapes: B batch,
C cameras, N image tokens per camera, P prefix length, L prompt length, H action horizon, A action dim, W width,
Hq query heads, Hkv KV heads, D head dim, NL layers, V vocab, S denoise steps.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import SiglipVisionConfig

from .config import Pi05Config
from .layers import (AdaRMSNorm, GemmaTowerModel, RMSNorm, SiglipVisionTransformer, UnusedLMHead, apply_rope,
                     attention, attention_bias, cast, rope_frequencies, rope_tables)
from .sampling import SamplerInputs, SamplingParams, sample_rows, sample_tokens  # noqa: F401 - re-exported

# ------------------------------------------------------------------------------------------------------------------
# Engine-facing data types (contract: ARCHITECTURE.md "Contract: model")
# ------------------------------------------------------------------------------------------------------------------


@dataclass
class Prefix:
    """Dense prefix KV as returned by prefill; never written by sample_actions / decode."""
    k: list[Tensor]                 # NL x [B, P, Hkv, D]  (keys after RoPE)
    v: list[Tensor]                 # NL x [B, P, Hkv, D]
    mask: Tensor                    # [B, P] bool, True = valid token
    positions: Tensor               # [B, P] long, RoPE positions (cumsum(mask) - 1)
    next_position: Tensor           # [B] long, number of valid tokens = position of the first generated token
    last_logits: Tensor | None = None   # [B, V] fp32 logits at the last *valid* position

    @property
    def batch_size(self) -> int:
        return self.mask.shape[0]

    @property
    def length(self) -> int:
        return self.mask.shape[1]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def select(self, rows: Tensor | list[int] | int) -> "Prefix":
        """Rows of the batch (a copy), e.g. ``prefix.select([0])``."""
        if isinstance(rows, int):
            rows = [rows]
        idx = torch.as_tensor(rows, dtype=torch.long, device=self.mask.device)
        return Prefix([k[idx] for k in self.k], [v[idx] for v in self.v], self.mask[idx], self.positions[idx],
                      self.next_position[idx], None if self.last_logits is None else self.last_logits[idx])

    def head(self, stop: int) -> "Prefix":
        """The first ``stop`` dense positions (views), e.g. the image part of an image_isolated prefix."""
        mask = self.mask[:, :stop]
        return Prefix([k[:, :stop] for k in self.k], [v[:, :stop] for v in self.v], mask, self.positions[:, :stop],
                      mask.sum(dim=1), None)

    def expand(self, batch: int) -> "Prefix":
        """Broadcast a batch-1 prefix to ``batch`` rows (views, no copy)."""
        if self.batch_size == batch:
            return self
        if self.batch_size != 1:
            raise ValueError(f"cannot broadcast a prefix of batch {self.batch_size} to {batch}")
        ex = lambda t: t.expand(batch, *t.shape[1:])  # noqa: E731
        return Prefix([ex(k) for k in self.k], [ex(v) for v in self.v], ex(self.mask), ex(self.positions),
                      ex(self.next_position), None if self.last_logits is None else ex(self.last_logits))


@dataclass
class DecodeBatch:
    token_ids: Tensor               # [B] long, the previous token of each row (its K/V is computed and written now)
    positions: Tensor               # [B] long, RoPE position of that token
    write_slots: Tensor             # [B] long, flat slot where its K/V goes
    read_slots: Tensor              # [B, T] long, flat slots the row attends to, in position order, incl. write_slots
    read_mask: Tensor               # [B, T] bool, False = padding
    sampling: list[SamplingParams] | None = None   # None = greedy for all rows


@dataclass
class DecodeOutput:
    next_ids: Tensor                # [B] long
    logits: Tensor                  # [B, V] fp32


# ------------------------------------------------------------------------------------------------------------------
# dtype plan: bf16 everywhere except these (openpi keeps them fp32)
# ------------------------------------------------------------------------------------------------------------------

_FP32_TOP = ("action_in_proj.", "action_out_proj.", "time_mlp_in.", "time_mlp_out.")


def keeps_fp32(name: str) -> bool:
    """True for the parameters openpi keeps in float32: SigLIP patch/position embeddings, all Gemma (ada)RMS norms,
    the action projections and the time MLP."""
    if name.startswith(_FP32_TOP):
        return True
    if "vision_model.embeddings." in name:
        return True
    if "vision_model" in name:
        return False                 # SigLIP LayerNorms stay in the model dtype (as in openpi)
    return "layernorm" in name or name.endswith("model.norm.weight") or ".model.norm.dense." in name


def _siglip_config(cfg: Pi05Config) -> SiglipVisionConfig:
    v = cfg.vision
    return SiglipVisionConfig(hidden_size=v.width, num_hidden_layers=v.depth, num_attention_heads=v.num_heads,
                              intermediate_size=v.mlp_dim, patch_size=v.patch_size, image_size=v.image_size,
                              hidden_act="gelu_pytorch_tanh", layer_norm_eps=v.layer_norm_eps, vision_use_head=False)


def _norm(norm: nn.Module, x: Tensor, mod) -> tuple[Tensor, Tensor | None]:
    if isinstance(norm, AdaRMSNorm):
        return norm(x, mod)
    return norm(x), None


# ------------------------------------------------------------------------------------------------------------------
# The model
# ------------------------------------------------------------------------------------------------------------------


def sincos_2d(n: int, width: int) -> Tensor:
    """[n, width] 2-D sin-cos position code of a square g x g patch grid (n = g*g; rows then columns, each a
    quarter of the width); N(0, 1/width) when n is not a square or width not a multiple of 4."""
    g = int(round(n ** 0.5))
    if g * g != n or width % 4:
        return torch.randn(n, width) * width ** -0.5
    q = width // 4
    omega = 1.0 / (10000.0 ** (torch.arange(q, dtype=torch.float32) / q))
    yy, xx = torch.meshgrid(torch.arange(g, dtype=torch.float32), torch.arange(g, dtype=torch.float32), indexing="ij")
    oy, ox = yy.reshape(-1, 1) * omega, xx.reshape(-1, 1) * omega                     # [n, q]
    return torch.cat([oy.sin(), oy.cos(), ox.sin(), ox.cos()], 1)


class Pi05Model(nn.Module):
    def __init__(self, cfg: Pi05Config):
        super().__init__()
        self.cfg = cfg
        self._rope_freqs: dict = {}                         # device -> rope_frequencies (not state: derived)
        We = cfg.expert.width
        pwe = nn.Module()                                   # paligemma_with_expert
        pwe.paligemma = nn.Module()
        pwe.paligemma.model = nn.Module()
        pwe.paligemma.model.vision_tower = nn.Module()
        pwe.paligemma.model.vision_tower.vision_model = SiglipVisionTransformer(_siglip_config(cfg))
        pwe.paligemma.model.multi_modal_projector = nn.Module()
        pwe.paligemma.model.multi_modal_projector.linear = nn.Linear(cfg.vision.width, cfg.vlm.width)
        pwe.paligemma.model.language_model = GemmaTowerModel(cfg.vlm, cfg.vocab_size, None)
        pwe.paligemma.lm_head = nn.Linear(cfg.vlm.width, cfg.vocab_size, bias=False)
        pwe.gemma_expert = nn.Module()
        pwe.gemma_expert.model = GemmaTowerModel(cfg.expert, None, We)
        pwe.gemma_expert.lm_head = UnusedLMHead(We, cfg.vocab_size)     # key compatibility only, no memory
        self.paligemma_with_expert = pwe
        self.action_in_proj = nn.Linear(cfg.action_dim, We)
        self.action_out_proj = nn.Linear(We, cfg.action_dim)
        self.time_mlp_in = nn.Linear(We, We)
        self.time_mlp_out = nn.Linear(We, We)
        self._init_weights()
        self.tie_weights()
        self.apply_dtype_plan(cfg.torch_dtype)

    # ---- structure helpers ---------------------------------------------------------------------------------------
    @property
    def vision(self) -> SiglipVisionTransformer:
        return self.paligemma_with_expert.paligemma.model.vision_tower.vision_model

    @property
    def projector(self) -> nn.Linear:
        return self.paligemma_with_expert.paligemma.model.multi_modal_projector.linear

    @property
    def vlm(self) -> GemmaTowerModel:
        return self.paligemma_with_expert.paligemma.model.language_model

    @property
    def expert(self) -> GemmaTowerModel:
        return self.paligemma_with_expert.gemma_expert.model

    @property
    def lm_head(self) -> nn.Linear:
        return self.paligemma_with_expert.paligemma.lm_head

    @property
    def dtype(self) -> torch.dtype:
        return self.vlm.layers[0].self_attn.qkv_weight.dtype

    @property
    def device(self) -> torch.device:
        return self.vlm.embed_tokens.weight.device

    def tie_weights(self) -> None:
        """lm_head and embed_tokens are the same Parameter (state_dict lists both keys, as openpi's module does)."""
        self.lm_head.weight = self.vlm.embed_tokens.weight

    def apply_dtype_plan(self, dtype: torch.dtype) -> None:
        """Cast every parameter to ``dtype`` except those openpi keeps in fp32 (``keeps_fp32``)."""
        for name, p in self.named_parameters():           # dedups the tied pair: it is cast once
            if not name.endswith("gemma_expert.lm_head.weight"):
                p.data = p.data.to(torch.float32 if keeps_fp32(name) else dtype)
        self.paligemma_with_expert.gemma_expert.lm_head._apply(lambda t: t.to(dtype))

    @torch.no_grad()
    def _init_weights(self) -> None:
        # Random-init for the small presets: torch defaults for Linear/Conv/LayerNorm, Gemma norms 0 (i.e. scale 1),
        # adaRMS gate bias 1 so the expert's residual branches are alive, and token embeddings N(0, 0.02) (Gemma's
        # initializer_range).  With torch's N(0, 1) embeddings x sqrt(W) the input token dominates the residual stream
        # and the tied head echoes the last prompt token forever, even when sampling at temperature 1.
        for m in self.modules():
            if isinstance(m, AdaRMSNorm):
                w = m.dense.bias.shape[0] // 3
                m.dense.bias.zero_()
                m.dense.bias[2 * w:].fill_(1.0)
                m.dense.weight.mul_(0.5)
            elif isinstance(m, RMSNorm):
                m.weight.zero_()
        self.paligemma_with_expert.paligemma.model.language_model.embed_tokens.weight.normal_(0.0, 0.02)
        # SigLIP's patch embedding: lecun-normal, bias 0 (HF's _init_weights); the learned position table starts as
        # a 2-D sin-cos pattern (ViT/MAE).  torch's defaults (a 0.02-wide patch kernel under an N(0, 1) table) bury
        # the image under the position code: on the demo's 96 px scenes a tower so initialised had not learned to
        # tell whether a cube is in the image after 600 steps; this one locates cubes to ~1 cm in 1,000.
        emb = self.vision.embeddings
        w = emb.patch_embedding.weight
        w.normal_(0.0, w[0].numel() ** -0.5)
        emb.patch_embedding.bias.zero_()
        emb.position_embedding.weight.copy_(sincos_2d(*emb.position_embedding.weight.shape))

    def rope(self, positions: Tensor, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
        """positions [B, T] -> RoPE tables (cos, sin) [B, T, 1, D] (``layers.rope_tables``), once per call.  The
        frequencies are kept per device (eagerly; a compiled graph computes them inline, inductor folds them)."""
        compiling = torch.compiler.is_compiling()
        freqs = None if compiling else self._rope_freqs.get(positions.device)
        if freqs is None:
            freqs = rope_frequencies(self.cfg.head_dim, self.cfg.rope_theta, positions.device)
            if not compiling:
                self._rope_freqs[positions.device] = freqs
        return rope_tables(positions, freqs, dtype or self.dtype)

    # ---- embeddings ----------------------------------------------------------------------------------------------
    def embed_images(self, images: Tensor, image_masks: Tensor) -> Tensor:
        """images [B, C, 3, S, S] in [-1, 1], image_masks [B, C] -> [B, C*N, W] (not scaled).  Masked camera slots are
        not run through the vision tower: their features are zeros and attention masks them out anyway."""
        B, C = images.shape[:2]
        N = self.cfg.image_tokens_per_camera
        flat = images.reshape(B * C, *images.shape[2:])
        if torch.compiler.is_compiling():        # static shapes: run every slot, zero the masked ones (no nonzero())
            feats = cast(self.projector(self.vision(flat, self.dtype)), self.dtype)          # [B*C, N, W]
            return torch.where(image_masks.reshape(B * C, 1, 1), feats, 0).view(B, C * N, -1)
        valid = image_masks.reshape(B * C).nonzero().squeeze(1)
        out = torch.zeros(B * C, N, self.cfg.vlm.width, dtype=self.dtype, device=images.device)
        if valid.numel():
            feats = self.vision(flat.index_select(0, valid), self.dtype)       # [n, N, Wv]
            out[valid] = cast(self.projector(feats), self.dtype)
        return out.view(B, C * N, -1)

    def embed_tokens(self, tokens: Tensor) -> Tensor:
        """tokens [B, L] -> [B, L, W], scaled by sqrt(W) (Gemma)."""
        x = self.vlm.embed_tokens(tokens)
        return cast(x * math.sqrt(x.shape[-1]), self.dtype)

    def time_condition(self, t: Tensor) -> Tensor:
        """t [B] in [0, 1] -> adaRMS condition [B, We]:
        sin/cos embedding (periods 4e-3 .. 4) -> time_mlp_in -> swish -> time_mlp_out -> swish.  ``sample_actions``
        calls it once for its S times (t [S])."""
        We = self.cfg.expert.width
        frac = torch.linspace(0.0, 1.0, We // 2, dtype=torch.float64, device=t.device)
        period = self.cfg.time_min_period * (self.cfg.time_max_period / self.cfg.time_min_period) ** frac
        ang = (1.0 / period * 2 * math.pi)[None, :] * t.double()[:, None]       # [B, We/2] (openpi's op order)
        emb = torch.cat([torch.sin(ang), torch.cos(ang)], dim=1).float()
        w = self.time_mlp_in.weight.dtype
        h = F.silu(self.time_mlp_in(cast(emb, w)))
        return F.silu(self.time_mlp_out(h))

    # ---- the joint MoT layer stack -------------------------------------------------------------------------------
    def _layers(self, x_vlm: Tensor | None, x_exp: Tensor | None, mods: list | None, rope: tuple[Tensor, Tensor],
                mask: Tensor, past_k: list[Tensor] | None = None, past_v: list[Tensor] | None = None,
                keep_kv: bool = False, kv_hook=None):
        """Run all layers over the tokens of the present towers.
        x_vlm [B, Tv, Wv] | None, x_exp [B, Te, We] | None, mods = the expert's adaRMS modulations
        (``GemmaTowerModel.modulations``: 2 per layer, the final norm's last) when x_exp is given,
        rope = (cos, sin) of ``rope`` for the positions [B, Tv+Te], mask [B, Tv+Te, Sp+Tv+Te] bool (Sp = past
        length) or a prepared ``attention_bias``, past_k/v NL x [B, Sp, Hkv, D] (read only).
        kv_hook(l, k, v) -> (k_all, v_all) replaces the past concat (decode, sample_actions).
        Returns x_vlm, x_exp, new_k, new_v (NL x [B, Tv+Te, Hkv, D] if keep_kv)."""
        cfg = self.cfg
        Hq, Hkv, D = cfg.vlm.num_heads, cfg.num_kv_heads, cfg.head_dim
        towers = [i for i, x in enumerate((x_vlm, x_exp)) if x is not None]
        none = [(None, None)] * cfg.num_layers
        tower_mods = (none, none if mods is None else [mods[2 * l: 2 * l + 2] for l in range(cfg.num_layers)])
        xs = [x_vlm, x_exp]
        cos, sin = rope
        bias = attention_bias(mask, Hq, Hkv, cos.dtype) if mask.dtype == torch.bool else mask
        new_k, new_v = [], []
        for l in range(cfg.num_layers):
            layers = (self.vlm.layers[l], self.expert.layers[l])
            qkv, gates, lens = [], [None, None], []
            for i in towers:
                h, gates[i] = _norm(layers[i].input_layernorm, xs[i], tower_mods[i][l][0])
                qkv.append(F.linear(h, layers[i].self_attn.qkv_weight))            # [B, T_i, (Hq + 2 Hkv) D]
                lens.append(h.shape[1])
            qkv = qkv[0] if len(qkv) == 1 else torch.cat(qkv, dim=1)             # [B, T, (Hq + 2 Hkv) D]
            qk, v = qkv.split([(Hq + Hkv) * D, Hkv * D], dim=-1)
            qk = apply_rope(qk.unflatten(-1, (Hq + Hkv, D)), cos, sin)            # [B, T, Hq + Hkv, D]
            q, k = qk.split([Hq, Hkv], dim=2)
            v = v.unflatten(-1, (Hkv, D))
            if keep_kv:                                 # compact copies: the prefix outlives this call
                new_k.append(k.contiguous())
                new_v.append(v.contiguous())
            if kv_hook is not None:
                k_all, v_all = kv_hook(l, k, v)
            elif past_k is not None:
                k_all = torch.cat([cast(past_k[l], k.dtype), k], dim=1)
                v_all = torch.cat([cast(past_v[l], v.dtype), v], dim=1)
            else:
                k_all, v_all = k, v
            a = attention(q, k_all, v_all, bias)                                # [B, T, Hq*D]
            for i, o in zip(towers, a.split(lens, dim=1)):
                layer = layers[i]
                o = layer.self_attn.o_proj(cast(o, layer.self_attn.o_proj.weight.dtype))
                x = xs[i] + o if gates[i] is None else torch.addcmul(xs[i], gates[i], o)
                h, gate = _norm(layer.post_attention_layernorm, x, tower_mods[i][l][1])
                m = layer.mlp(cast(h, layer.mlp.gate_up_weight.dtype))
                xs[i] = x + m if gate is None else torch.addcmul(x, gate, m)
        return xs[0], xs[1], new_k, new_v

    def _logits(self, h: Tensor) -> Tensor:
        # h [B, W] -> fp32 logits [B, V] through the final norm and the tied LM head
        h = self.vlm.norm(h)
        return cast(F.linear(cast(h, self.lm_head.weight.dtype), self.lm_head.weight), torch.float32)

    # ---- masks ---------------------------------------------------------------------------------------------------
    def prefix_attention_mask(self, image_masks: Tensor, token_masks: Tensor) -> Tensor:
        """[B, C] + [B, L] -> [B, P, P] bool.  upstream: every valid token sees every valid token.  image_isolated:
        image tokens see valid image tokens only; prompt tokens see valid image tokens and earlier valid prompt
        tokens.  Invalid tokens see only themselves (no empty softmax rows) and are seen by nobody."""
        N = self.cfg.image_tokens_per_camera
        img_valid = image_masks.bool().repeat_interleave(N, dim=1)                # [B, C*N]
        valid = torch.cat([img_valid, token_masks.bool()], dim=1)                 # [B, P]
        P = valid.shape[1]
        both = valid[:, :, None] & valid[:, None, :]
        if self.cfg.prefix_attention == "upstream":
            m = both
        else:
            is_img = torch.zeros(P, dtype=torch.bool, device=valid.device)
            is_img[: img_valid.shape[1]] = True
            idx = torch.arange(P, device=valid.device)
            allowed = is_img[None, :] | (~is_img[:, None] & (idx[None, :] <= idx[:, None]))   # [P, P]
            m = both & allowed[None]
        eye = torch.eye(P, dtype=torch.bool, device=valid.device)
        return m | (eye[None] & ~valid[:, :, None])

    # ---- primitives ------------------------------------------------------------------------------------------------
    def _finish_prefix(self, k, v, mask, positions, h, want_logits, fallback_logits=None) -> Prefix:
        last_logits = None
        if want_logits:
            if h is None:
                last_logits = fallback_logits
            else:
                T = h.shape[1]
                local_mask = mask[:, -T:]
                idx = torch.arange(T, device=mask.device)
                last = torch.where(local_mask, idx, -1).max(dim=-1).values                  # [B]
                any_valid = last >= 0
                hl = h[torch.arange(h.shape[0], device=h.device), last.clamp(min=0)]    # [B, W]
                last_logits = self._logits(hl)
                if fallback_logits is not None:               # rows without a valid token keep the old logits
                    last_logits = torch.where(any_valid[:, None], last_logits, fallback_logits)
        next_position = mask.sum(dim=1)
        return Prefix(k, v, mask, positions, next_position, last_logits)

    @torch.no_grad()
    def prefill(self, images: Tensor, image_masks: Tensor, tokens: Tensor, token_masks: Tensor,
                want_logits: bool = False) -> Prefix:
        """images [B, C, 3, S, S] in [-1,1], image_masks [B, C] bool, tokens [B, L] long, token_masks [B, L] bool ->
        Prefix with P = C*N + L (order: camera 0 .. C-1 image tokens, then the prompt)."""
        image_masks, token_masks = image_masks.bool(), token_masks.bool()
        x = torch.cat([self.embed_images(images, image_masks), self.embed_tokens(tokens)], dim=1)   # [B, P, W]
        N = self.cfg.image_tokens_per_camera
        valid = torch.cat([image_masks.repeat_interleave(N, dim=1), token_masks], dim=1)            # [B, P]
        positions = valid.long().cumsum(dim=1) - 1
        mask = self.prefix_attention_mask(image_masks, token_masks)
        h, _, k, v = self._layers(x, None, None, self.rope(positions), mask, keep_kv=True)
        return self._finish_prefix(k, v, valid, positions, h if want_logits else None, want_logits)

    @torch.no_grad()
    def prefill_images(self, images: Tensor, image_masks: Tensor) -> Prefix:
        """Image-only prefix (P = C*N) for image_isolated mode; extend it with prompts via ``extend_prefix``."""
        if self.cfg.prefix_attention != "image_isolated":
            raise ValueError("prefill_images/extend_prefix need cfg.prefix_attention == 'image_isolated' "
                             "(in 'upstream' mode image tokens attend to the prompt)")
        B = images.shape[0]
        empty = torch.zeros(B, 0, dtype=torch.long, device=images.device)
        return self.prefill(images, image_masks, empty, empty.bool())

    @torch.no_grad()
    def extend_prefix(self, prefix: Prefix, tokens: Tensor, token_masks: Tensor, want_logits: bool = False) -> Prefix:
        """Prompt tokens [B2, L] on top of an existing prefix (batch 1 broadcasts to B2): they attend the valid prefix
        and earlier valid prompt tokens (causal), exactly as prompt tokens do in image_isolated prefill.  Returns the
        concatenated prefix [B2, P + L]; the input prefix is not modified."""
        if self.cfg.prefix_attention != "image_isolated":
            raise ValueError("extend_prefix needs cfg.prefix_attention == 'image_isolated'")
        B2, L = tokens.shape
        prefix = prefix.expand(B2)
        token_masks = token_masks.bool()
        positions = prefix.next_position[:, None] + token_masks.long().cumsum(dim=1) - 1      # [B2, L]
        idx = torch.arange(L, device=tokens.device)
        causal = (idx[None, :] <= idx[:, None])[None] & token_masks[:, None, :] & token_masks[:, :, None]
        causal = causal | (torch.eye(L, dtype=torch.bool, device=tokens.device)[None] & ~token_masks[:, :, None])
        old = prefix.mask[:, None, :] & token_masks[:, :, None]                                  # [B2, L, P]
        mask = torch.cat([old, causal], dim=2)                                                   # [B2, L, P+L]
        h, _, k, v = self._layers(self.embed_tokens(tokens), None, None, self.rope(positions), mask,
                                  past_k=prefix.k, past_v=prefix.v, keep_kv=True)
        k = [torch.cat([cast(pk, nk.dtype), nk], dim=1) for pk, nk in zip(prefix.k, k)]
        v = [torch.cat([cast(pv, nv.dtype), nv], dim=1) for pv, nv in zip(prefix.v, v)]
        mask_all = torch.cat([prefix.mask, token_masks], dim=1)
        pos_all = torch.cat([prefix.positions, positions], dim=1)
        out = self._finish_prefix(k, v, mask_all, pos_all, h if want_logits else None, want_logits,
                                  fallback_logits=prefix.last_logits)
        return out

    @torch.no_grad()
    def sample_actions(self, prefix: Prefix, noise: Tensor, num_steps: int | None = None, step=None) -> Tensor:
        """noise [B, H, A] -> actions [B, H, A] (fp32) by S Euler steps from t=1 to t=0 (dt = -1/S, x += dt * v).
        The H action tokens attend the valid prefix and each other; their positions continue at next_position.
        The prefix KV is only read (a batch-1 prefix broadcasts to B).  Everything that does not depend on x - the
        positions, attention bias and RoPE tables, the S time conditions and every adaRMSNorm's modulation for them
        - is computed once here; a step (``denoise_step``, or ``step``: e.g. that method compiled alone, see
        model/compiled.py's inductor-graphs) is the layers' matrix work and elementwise ops only (no host reads)."""
        S = num_steps or self.cfg.num_denoise_steps
        B, H, _ = noise.shape
        prefix = prefix.expand(B)
        positions, bias = self.action_attention(prefix, H)
        rope = self.rope(positions)
        # per-layer [prefix | suffix] K/V buffers: the prefix is copied in once per call (not per step) and only the
        # suffix part is rewritten each step; the caller's prefix tensors are never written.
        P = prefix.length
        kbuf = [torch.cat([cast(k, self.dtype), k.new_empty(B, H, *k.shape[2:], dtype=self.dtype)], 1)
                for k in prefix.k]
        vbuf = [torch.cat([cast(v, self.dtype), v.new_empty(B, H, *v.shape[2:], dtype=self.dtype)], 1)
                for v in prefix.v]
        step = step or self.denoise_step
        dt = -1.0 / S
        t = 1.0 + dt * torch.arange(S, dtype=torch.float64, device=noise.device)     # [S]: 1, 1 - 1/S, ..., 1/S
        mods = self.expert.modulations(self.time_condition(t.float()), self.dtype)    # 2 NL + 1 x 3 x [S, 1, We]
        per_step = list(zip(*[zip(*(m.unbind(0) for m in mod)) for mod in mods]))    # S x (2 NL + 1) x 3 x [1, We]
        x = cast(noise, torch.float32)
        for s in range(S):
            x = step(x, per_step[s], rope, bias, kbuf, vbuf, P, dt)
        return x

    def denoise_step(self, x: Tensor, mods, rope: tuple[Tensor, Tensor], bias: Tensor, kbuf: list[Tensor],
                     vbuf: list[Tensor], prefix_len: int, dt: float) -> Tensor:
        """One Euler step of ``sample_actions``: x [B, H, A] fp32 -> x + dt * v(x), with the step's modulations,
        the call's RoPE tables and bias; the H action tokens' K/V go to ``kbuf[l][:, prefix_len:]`` /
        ``vbuf[l][:, prefix_len:]`` (the call's [prefix | suffix] buffers NL x [B, P+H, Hkv, D]), which are read
        whole.  A pure tensor function of its inputs (what inductor-graphs compiles once and replays S times)."""
        def kv_hook(l, k, v):
            kbuf[l][:, prefix_len:] = k
            vbuf[l][:, prefix_len:] = v
            return kbuf[l], vbuf[l]

        return x + dt * self._velocity(x, mods, rope, bias, kv_hook=kv_hook)

    def action_attention(self, prefix: Prefix, H: int) -> tuple[Tensor, Tensor]:
        """For H action tokens on ``prefix`` (batch B): their positions [B, H] (continuing at next_position) and the
        attention bias of ``attention_bias`` for [B, H, P+H] (the valid prefix and every action token), built once per
        sampling call and shared by all denoise steps."""
        B = prefix.batch_size
        dev = prefix.mask.device
        positions = prefix.next_position[:, None] + torch.arange(H, device=dev)[None]                # [B, H]
        mask = torch.cat([prefix.mask[:, None, :].expand(B, H, prefix.length),
                          torch.ones(B, H, H, dtype=torch.bool, device=dev)], dim=2)                 # [B, H, P+H]
        return positions, attention_bias(mask, self.cfg.vlm.num_heads, self.cfg.num_kv_heads, self.dtype)

    def velocity(self, prefix: Prefix, x_t: Tensor, t: Tensor, positions: Tensor | None = None,
                 mask: Tensor | None = None, kv_hook=None) -> Tensor:
        """One denoise step: x_t [B, H, A] at times t [B] -> velocity [B, H, A] fp32 (prefix read-only);
        ``positions`` / ``mask`` (e.g. the bias of ``action_attention``) default to ``action_attention``'s."""
        B, H, _ = x_t.shape
        prefix = prefix.expand(B)
        if positions is None or mask is None:
            positions, mask = self.action_attention(prefix, H)
        mods = self.expert.modulations(self.time_condition(t), self.dtype)                      # [B, 1, We]
        return self._velocity(x_t, mods, self.rope(positions), mask, prefix.k, prefix.v, kv_hook)

    def _velocity(self, x_t: Tensor, mods, rope, mask: Tensor, past_k=None, past_v=None, kv_hook=None) -> Tensor:
        # x_t [B, H, A] -> velocity [B, H, A] fp32 with precomputed modulations / RoPE tables / mask or bias, over the
        # prefix K/V past_k / past_v (or what kv_hook returns)
        x = cast(self.action_in_proj(cast(x_t, self.action_in_proj.weight.dtype)), self.dtype)   # [B, H, We]
        _, h, _, _ = self._layers(None, x, mods, rope, mask, past_k=past_k, past_v=past_v, kv_hook=kv_hook)
        h, _ = self.expert.norm(h, mods[-1])
        return cast(self.action_out_proj(cast(h, self.action_out_proj.weight.dtype)), torch.float32)

    @torch.no_grad()
    def decode(self, batch: DecodeBatch, kv) -> DecodeOutput:
        """One token for B rows.  Computes the K/V of ``batch.token_ids`` at ``batch.positions``, writes them to
        ``kv.k[l][write_slots]`` / ``kv.v[l][write_slots]`` (the only write), gathers ``read_slots`` (which include
        the write slot) and attends with ``read_mask``.
        Returns the next ids (greedy or ``sampling``) and fp32 logits."""
        sampler = SamplerInputs.build(batch.sampling, batch.positions)
        ids, logits = self.decode_step(batch.token_ids, batch.positions, batch.write_slots, batch.read_slots,
                                       batch.read_mask, kv.k, kv.v, sampler)
        return DecodeOutput(ids, logits)

    def decode_step(self, token_ids: Tensor, positions: Tensor, write_slots: Tensor, read_slots: Tensor,
                    read_mask: Tensor, k_pool: list[Tensor], v_pool: list[Tensor],
                    sampler: SamplerInputs | None = None) -> tuple[Tensor, Tensor]:
        """``decode`` as a pure tensor function (what ``model/compiled.py`` compiles): token_ids / positions /
        write_slots [B] long, read_slots [B, T] long, read_mask [B, T] bool, k_pool / v_pool NL x [num_slots, Hkv, D]
        (written in place at write_slots) -> (next ids [B] long, logits [B, V] fp32).  No host reads."""
        x = self.embed_tokens(token_ids[:, None])                                             # [B, 1, W]
        mask = read_mask.bool()[:, None, :]                                                   # [B, 1, T]
        rs_flat = read_slots.reshape(-1)                           # index_select is ~3x faster than kl[rs] on CPU

        def kv_hook(l, k, v):                                   # k/v [B, 1, Hkv, D]
            kl, vl = k_pool[l], v_pool[l]
            kl.index_copy_(0, write_slots, cast(k[:, 0], kl.dtype))
            vl.index_copy_(0, write_slots, cast(v[:, 0], vl.dtype))
            shape = (*read_slots.shape, *kl.shape[1:])            # [B, T, Hkv, D]
            return (cast(kl.index_select(0, rs_flat).view(shape), k.dtype),
                    cast(vl.index_select(0, rs_flat).view(shape), v.dtype))

        h, _, _, _ = self._layers(x, None, None, self.rope(positions[:, None]), mask, kv_hook=kv_hook)
        logits = self._logits(h[:, 0])
        return sample_rows(logits, sampler), logits

    # ---- joint forward (openpi-style: every segment in one pass; what training runs) --------------------------------
    def forward(self, images: Tensor, image_masks: Tensor, tokens: Tensor, token_masks: Tensor, x_t: Tensor,
                t: Tensor) -> Tensor:
        """One joint MoT pass over [prefix | suffix] with the full block mask -> velocity [B, H, A] fp32."""
        return self.forward_train(images, image_masks, tokens, token_masks, x_t, t)[0]

    def forward_train(self, images: Tensor, image_masks: Tensor, tokens: Tensor, token_masks: Tensor, x_t: Tensor,
                      t: Tensor, text_tokens: Tensor | None = None, text_masks: Tensor | None = None,
                      return_hidden: bool = False):
        """The training pass, with exactly the attention the engine uses at inference, in one forward over
        [image tokens | action prompt (tokens, L) | text (text_tokens, Lt) | action tokens (x_t, H)]:
        image and action-prompt tokens as in ``prefill`` (``prefix_attention_mask``); the action tokens see the valid
        image and action-prompt tokens and each other (``sample_actions``); the text - a language prompt followed by
        its answer - sees the valid image tokens and its own earlier tokens, never the action prompt, at positions
        continuing after the image tokens (``prefill_images`` + ``extend_prefix`` + ``decode``, how the engine shares
        one image prefix between tasks).  Nothing attends to the text.  Returns (velocity [B, H, A] fp32, text
        logits [B, Lt, V] fp32 or None): logits at text position j predict text token j + 1; ``return_hidden``
        appends the action expert's final hidden state [B, H, We] (after its final norm: what ``action_out_proj``
        reads; training's auxiliary target, ``train/target_aux.py``)."""
        image_masks, token_masks = image_masks.bool(), token_masks.bool()
        B, H, _ = x_t.shape
        dev = x_t.device
        N = self.cfg.image_tokens_per_camera
        img_valid = image_masks.repeat_interleave(N, dim=1)                                 # [B, C*N]
        valid = torch.cat([img_valid, token_masks], dim=1)                                 # [B, Pp]
        Pp = valid.shape[1]
        parts = [self.embed_images(images, image_masks), self.embed_tokens(tokens)]
        pre_pos = valid.long().cumsum(dim=1) - 1
        Lt = 0
        if text_tokens is not None:
            if self.cfg.prefix_attention != "image_isolated":
                raise ValueError("text targets need prefix_attention 'image_isolated' (the image prefix shared by "
                                 "every task)")
            text_masks = text_masks.bool()
            Lt = text_tokens.shape[1]
            parts.append(self.embed_tokens(text_tokens))
            text_pos = img_valid.sum(1, keepdim=True) + text_masks.long().cumsum(dim=1) - 1        # [B, Lt]
        suf_pos = valid.sum(1, keepdim=True) + torch.arange(H, device=dev)[None]
        positions = torch.cat([pre_pos] + ([text_pos] if Lt else []) + [suf_pos], dim=1)
        T = Pp + Lt + H
        S = Pp + Lt                                                                        # suffix start
        mask = torch.zeros(B, T, T, dtype=torch.bool, device=dev)
        mask[:, :Pp, :Pp] = self.prefix_attention_mask(image_masks, token_masks)
        if Lt:
            CN = img_valid.shape[1]
            idx = torch.arange(Lt, device=dev)
            causal = (idx[None, :] <= idx[:, None])[None] & text_masks[:, None, :] & text_masks[:, :, None]
            causal = causal | (torch.eye(Lt, dtype=torch.bool, device=dev)[None] & ~text_masks[:, :, None])
            mask[:, Pp:S, :CN] = img_valid[:, None, :] & text_masks[:, :, None]
            mask[:, Pp:S, Pp:S] = causal
        mask[:, S:, :Pp] = valid[:, None, :]
        mask[:, S:, S:] = True
        mods = self.expert.modulations(self.time_condition(t), self.dtype)                      # [B, 1, We]
        x_suf = cast(self.action_in_proj(cast(x_t, self.action_in_proj.weight.dtype)), self.dtype)
        h_vlm, h, _, _ = self._layers(torch.cat(parts, dim=1), x_suf, mods, self.rope(positions), mask)
        h, _ = self.expert.norm(h, mods[-1])
        velocity = self.action_out_proj(cast(h, self.action_out_proj.weight.dtype)).float()
        logits = self._logits(h_vlm[:, Pp:S]) if Lt else None
        return (velocity, logits, h) if return_hidden else (velocity, logits)


def build_model(cfg: Pi05Config, device: str | torch.device = "cpu", dtype: torch.dtype | str | None = None,
                seed: int = 0) -> Pi05Model:
    """A randomly initialised model (deterministic for a seed and device) in eval mode.  ``dtype`` overrides
    cfg.dtype.  On an accelerator the weights are created there, directly in the compute dtype (a 3B-parameter pi05
    is neither built in fp32 nor on the CPU first); the fp32 parameters of the dtype plan are then upcast."""
    if dtype is not None:
        cfg = cfg.replace(dtype=str(dtype))          # "bfloat16" | "bf16" | torch.bfloat16 ...
    dev = torch.device(device)
    default = torch.get_default_dtype()
    try:
        with torch.device(dev):
            torch.manual_seed(seed)
            if dev.type != "cpu":
                torch.set_default_dtype(cfg.torch_dtype)
            model = Pi05Model(cfg)
    finally:
        torch.set_default_dtype(default)
    model.requires_grad_(False)
    return model.to(dev).eval()
