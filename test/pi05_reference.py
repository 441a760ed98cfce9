"""An independent, naive reference of the pi0.5 architecture as specified (``/work/shared/reference/pi05.md``,
``ARCHITECTURE.md``), for the numerical tests of ``oxygen_ros/model/pi05.py``.

It reads the model's *weights* (``model.state_dict()``, by openpi's names: the model's fused Q/K/V and gate/up
matrices show there as openpi's separate tensors) but none of its forward code: SigLIP with
``F.layer_norm`` / eager softmax attention, RMSNorm ``x / sqrt(mean(x^2) + eps) * (1 + w)``, adaRMSNorm (scale, shift,
gate), RoPE written with complex numbers (the model uses the rotate-half form), eager attention over one
[images | prompt | generated | actions] sequence with repeated KV heads and an explicit per-token mask built from a
table of (query type, key type) rules, the sin/cos time embedding, and Euler denoising / greedy decoding by full
recomputation (no KV cache).  One row at a time (no batch dim).  Shapes: C cameras, N image tokens per camera,
T sequence length, H action horizon, A action dim, V vocab, Hq/Hkv query/KV heads, D head dim, NL layers.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F

IMG, TXT, GEN, ACT = 0, 1, 2, 3


class Weights:
    """openpi-named weights: ``Weights(model)["...layers.0.self_attn.q_proj"]`` -> a module-like view with
    ``.weight`` / ``.bias`` (None when absent), read from ``model.state_dict(keep_vars=True)`` (so that gradients
    flow to the model's parameters, e.g. in the gradient tests)."""

    def __init__(self, model):
        self.sd = model.state_dict(keep_vars=True)

    def __getitem__(self, name):
        return SimpleNamespace(weight=self.sd.get(name + ".weight"), bias=self.sd.get(name + ".bias"))


def _lin(x, m):
    return F.linear(x, m.weight, m.bias)


def siglip(model, pixels, W=None):
    """pixels [n, 3, S, S] -> projected image features [n, N, W]."""
    W = W or Weights(model)
    vm = "paligemma_with_expert.paligemma.model.vision_tower.vision_model."
    cfg = model.cfg.vision
    pe = W[vm + "embeddings.patch_embedding"]
    x = F.conv2d(pixels, pe.weight, pe.bias, stride=cfg.patch_size)
    x = x.flatten(2).transpose(1, 2) + W[vm + "embeddings.position_embedding"].weight
    nh, hd = cfg.num_heads, cfg.width // cfg.num_heads

    def ln(name, x):
        return F.layer_norm(x, (cfg.width,), W[name].weight, W[name].bias, cfg.layer_norm_eps)

    for i in range(cfg.depth):
        p = f"{vm}encoder.layers.{i}."
        h = ln(p + "layer_norm1", x)
        n, T, _ = h.shape
        q = _lin(h, W[p + "self_attn.q_proj"]).view(n, T, nh, hd).transpose(1, 2)
        k = _lin(h, W[p + "self_attn.k_proj"]).view(n, T, nh, hd).transpose(1, 2)
        v = _lin(h, W[p + "self_attn.v_proj"]).view(n, T, nh, hd).transpose(1, 2)
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd), dim=-1)
        x = x + _lin((att @ v).transpose(1, 2).reshape(n, T, -1), W[p + "self_attn.out_proj"])
        h = ln(p + "layer_norm2", x)
        x = x + _lin(F.gelu(_lin(h, W[p + "mlp.fc1"]), approximate="tanh"), W[p + "mlp.fc2"])
    x = ln(vm + "post_layernorm", x)
    return _lin(x, W["paligemma_with_expert.paligemma.model.multi_modal_projector.linear"])


def rms(x, eps=1e-6):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def rope(x, pos, theta=10000.0):
    """x [T, h, D], pos [T]: rotate pairs (i, i + D/2) by pos * theta^(-2i/D), written with complex numbers."""
    D = x.shape[-1]
    freq = theta ** (-torch.arange(0, D // 2, dtype=torch.float64) * 2 / D)
    ang = pos.double()[:, None] * freq[None]                                         # [T, D/2]
    z = torch.complex(x[..., : D // 2].double(), x[..., D // 2:].double()) * torch.polar(
        torch.ones_like(ang), ang)[:, None, :]
    return torch.cat([z.real, z.imag], dim=-1).to(x.dtype)


def time_cond(model, t, W=None):
    W = W or Weights(model)
    We = model.cfg.expert.width
    frac = torch.linspace(0, 1, We // 2, dtype=torch.float64)
    period = 4e-3 * (4.0 / 4e-3) ** frac
    ang = 2 * math.pi / period * t
    emb = torch.cat([torch.sin(ang), torch.cos(ang)]).float()
    return F.silu(_lin(F.silu(_lin(emb, W["time_mlp_in"])), W["time_mlp_out"]))


def build_mask(types, valid, mode):
    """types/valid [T] -> allowed [T, T] (query i, key j) by the rules of ARCHITECTURE.md, as a table of
    (query type, key type) -> rule, applied to every pair."""
    t = torch.tensor(types)
    ok = torch.tensor(valid)
    i = torch.arange(len(types))[:, None]
    j = torch.arange(len(types))[None, :]
    ti, tj = t[:, None], t[None, :]
    before = j <= i
    rules = {   # (query, key): allowed?
        (IMG, IMG): torch.ones_like(before),
        (IMG, TXT): torch.ones_like(before) if mode == "upstream" else torch.zeros_like(before),
        (TXT, IMG): torch.ones_like(before),
        (TXT, TXT): torch.ones_like(before) if mode == "upstream" else before,
        (GEN, IMG): torch.ones_like(before), (GEN, TXT): torch.ones_like(before), (GEN, GEN): before,
        (ACT, IMG): torch.ones_like(before), (ACT, TXT): torch.ones_like(before), (ACT, ACT): torch.ones_like(before),
    }
    m = torch.zeros(len(types), len(types), dtype=torch.bool)
    for (a, b), rule in rules.items():
        m |= (ti == a) & (tj == b) & rule
    m &= ok[:, None] & ok[None, :]
    m |= torch.eye(len(types), dtype=torch.bool) & ~ok[:, None]     # keep the softmax defined; output unused
    return m


def joint_forward(model, images, image_masks, tokens, token_masks, gen_tokens=(), x_t=None, t=None, mode=None):
    """One row (no batch dim): images [C,3,S,S], image_masks [C], tokens [L], token_masks [L], gen_tokens list of
    generated ids, x_t [H, A] noisy actions at time t.  Returns (logits at every VLM position [T_vlm, V],
    velocity [H, A] or None, per-layer K of the prefix [NL, P, Hkv, D])."""
    cfg = model.cfg
    mode = mode or cfg.prefix_attention
    C, N = cfg.num_cameras, cfg.image_tokens_per_camera
    Wd = cfg.vlm.width
    W = Weights(model)
    img = siglip(model, images, W)                                               # [C, N, W]
    lm, ex = "paligemma_with_expert.paligemma.model.language_model.", "paligemma_with_expert.gemma_expert.model."
    emb = W[lm + "embed_tokens"].weight
    all_tok = torch.cat([tokens, torch.tensor(list(gen_tokens), dtype=torch.long)])
    txt = emb[all_tok] * math.sqrt(Wd)
    x_vlm = torch.cat([img.reshape(C * N, Wd), txt])
    types = [IMG] * (C * N) + [TXT] * len(tokens) + [GEN] * len(gen_tokens)
    valid = [bool(image_masks[c]) for c in range(C) for _ in range(N)] + [bool(v) for v in token_masks] + \
        [True] * len(gen_tokens)
    Tv = len(types)
    H = 0
    if x_t is not None:
        H = x_t.shape[0]
        types += [ACT] * H
        valid += [True] * H
        cond = time_cond(model, t, W)
        x_exp = _lin(x_t, W["action_in_proj"])
    vt = torch.tensor(valid)
    pos = torch.cumsum(vt.long(), 0) - 1
    mask = build_mask(types, valid, mode)
    Hq, Hkv, D = cfg.vlm.num_heads, cfg.vlm.num_kv_heads, cfg.vlm.head_dim
    prefix_k = []

    def ada(norm, x):
        mod = _lin(cond, W[norm + ".dense"])
        s, b, g = mod.chunk(3)
        return rms(x) * (1 + s) + b, g

    for l in range(cfg.num_layers):
        L1, L2 = f"{lm}layers.{l}.", f"{ex}layers.{l}."
        hv = rms(x_vlm) * (1 + W[L1 + "input_layernorm"].weight)
        q = [_lin(hv, W[L1 + "self_attn.q_proj"])]
        k = [_lin(hv, W[L1 + "self_attn.k_proj"])]
        v = [_lin(hv, W[L1 + "self_attn.v_proj"])]
        if H:
            he, g_att = ada(L2 + "input_layernorm", x_exp)
            q.append(_lin(he, W[L2 + "self_attn.q_proj"]))
            k.append(_lin(he, W[L2 + "self_attn.k_proj"]))
            v.append(_lin(he, W[L2 + "self_attn.v_proj"]))
        T = Tv + H
        q = rope(torch.cat(q).view(T, Hq, D), pos)
        k = rope(torch.cat(k).view(T, Hkv, D), pos)
        v = torch.cat(v).view(T, Hkv, D)
        prefix_k.append(k[: C * N + len(tokens)])
        k_rep = k.repeat_interleave(Hq // Hkv, dim=1)                             # [T, Hq, D]
        v_rep = v.repeat_interleave(Hq // Hkv, dim=1)
        scores = torch.einsum("thd,shd->hts", q, k_rep) / math.sqrt(D)
        scores = scores.masked_fill(~mask[None], float("-inf"))
        out = torch.einsum("hts,shd->thd", torch.softmax(scores, -1), v_rep).reshape(T, Hq * D)
        def mlp(p, h):
            return _lin(F.gelu(_lin(h, W[p + "mlp.gate_proj"]), approximate="tanh") * _lin(h, W[p + "mlp.up_proj"]),
                        W[p + "mlp.down_proj"])

        x_vlm = x_vlm + _lin(out[:Tv], W[L1 + "self_attn.o_proj"])
        h = rms(x_vlm) * (1 + W[L1 + "post_attention_layernorm"].weight)
        x_vlm = x_vlm + mlp(L1, h)
        if H:
            x_exp = x_exp + g_att * _lin(out[Tv:], W[L2 + "self_attn.o_proj"])
            h, g_mlp = ada(L2 + "post_attention_layernorm", x_exp)
            x_exp = x_exp + g_mlp * mlp(L2, h)
    logits = (rms(x_vlm) * (1 + W[lm + "norm"].weight)) @ emb.T
    vel = None
    if H:
        h, _ = ada(ex + "norm", x_exp)
        vel = _lin(h, W["action_out_proj"])
    return logits, vel, torch.stack(prefix_k)


def reference_actions(model, images, image_masks, tokens, token_masks, noise, num_steps, mode=None):
    """Euler from t=1 to 0 where every step recomputes the whole [prefix | suffix] sequence."""
    x = noise.clone()
    dt = -1.0 / num_steps
    t = 1.0
    for _ in range(num_steps):
        _, vel, _ = joint_forward(model, images, image_masks, tokens, token_masks, x_t=x, t=t, mode=mode)
        x = x + dt * vel
        t += dt
    return x


def reference_greedy(model, images, image_masks, tokens, token_masks, n, mode=None):
    """Greedy decoding by full recomputation: returns (ids [n], logits [n, V])."""
    ids, logits = [], []
    last_valid = None
    for _ in range(n):
        lg, _, _ = joint_forward(model, images, image_masks, tokens, token_masks, gen_tokens=ids, mode=mode)
        if not ids:
            C, N = model.cfg.num_cameras, model.cfg.image_tokens_per_camera
            valid = [bool(image_masks[c]) for c in range(C) for _ in range(N)] + [bool(v) for v in token_masks]
            last_valid = max(i for i, v in enumerate(valid) if v)
            row = lg[last_valid]
        else:
            row = lg[-1]
        logits.append(row)
        ids.append(int(row.argmax()))
    return ids, torch.stack(logits)
