"""Self-consistency of the pi0.5 model's cached primitives against a plain reference.

This file owns the numerical contract of ``oxygen_ros/model/pi05.py``: a naive, non-cached reference written here
(SigLIP, RMSNorm/adaRMSNorm, complex-form RoPE, eager softmax attention with repeated KV heads and an explicit
per-token mask over one [images | prompt | generated | actions] sequence; it reads the model's weights but none of its
forward code) must agree with prefill + sample_actions (fp32, <= 1e-5 relative) in both prefix-attention modes,
with cached greedy decoding token for token, and with masked camera slots / prompt padding (pitfall D); the prefix
KV must stay bit-identical through sample_actions and decode (pitfall A); batched decode of rows with different
prefixes, steps and frames must equal decoding each row alone; in ``image_isolated`` mode the image KV must not depend
on the prompt and ``extend_prefix(prefill_images)`` must equal ``prefill``.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

IMG, TXT, GEN, ACT = 0, 1, 2, 3


def _lin(x, m):
    return F.linear(x, m.weight, m.bias)


def siglip(model, pixels):
    """pixels [n, 3, S, S] -> projected image features [n, N, W]."""
    vm = model.paligemma_with_expert.paligemma.model.vision_tower.vision_model
    cfg = model.cfg.vision
    x = F.conv2d(pixels, vm.embeddings.patch_embedding.weight, vm.embeddings.patch_embedding.bias,
                 stride=cfg.patch_size)
    x = x.flatten(2).transpose(1, 2) + vm.embeddings.position_embedding.weight
    nh, hd = cfg.num_heads, cfg.width // cfg.num_heads
    for layer in vm.encoder.layers:
        h = F.layer_norm(x, (cfg.width,), layer.layer_norm1.weight, layer.layer_norm1.bias, cfg.layer_norm_eps)
        a = layer.self_attn
        n, T, _ = h.shape
        q = _lin(h, a.q_proj).view(n, T, nh, hd).transpose(1, 2)
        k = _lin(h, a.k_proj).view(n, T, nh, hd).transpose(1, 2)
        v = _lin(h, a.v_proj).view(n, T, nh, hd).transpose(1, 2)
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd), dim=-1)
        x = x + _lin((att @ v).transpose(1, 2).reshape(n, T, -1), a.out_proj)
        h = F.layer_norm(x, (cfg.width,), layer.layer_norm2.weight, layer.layer_norm2.bias, cfg.layer_norm_eps)
        x = x + _lin(F.gelu(_lin(h, layer.mlp.fc1), approximate="tanh"), layer.mlp.fc2)
    x = F.layer_norm(x, (cfg.width,), vm.post_layernorm.weight, vm.post_layernorm.bias, cfg.layer_norm_eps)
    return _lin(x, model.paligemma_with_expert.paligemma.model.multi_modal_projector.linear)


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


def time_cond(model, t):
    We = model.cfg.expert.width
    frac = torch.linspace(0, 1, We // 2, dtype=torch.float64)
    period = 4e-3 * (4.0 / 4e-3) ** frac
    ang = 2 * math.pi / period * t
    emb = torch.cat([torch.sin(ang), torch.cos(ang)]).float()
    return F.silu(_lin(F.silu(_lin(emb, model.time_mlp_in)), model.time_mlp_out))


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
    W = cfg.vlm.width
    img = siglip(model, images)                                                  # [C, N, W]
    emb = model.paligemma_with_expert.paligemma.model.language_model.embed_tokens.weight
    all_tok = torch.cat([tokens, torch.tensor(list(gen_tokens), dtype=torch.long)])
    txt = emb[all_tok] * math.sqrt(W)
    x_vlm = torch.cat([img.reshape(C * N, W), txt])
    types = [IMG] * (C * N) + [TXT] * len(tokens) + [GEN] * len(gen_tokens)
    valid = [bool(image_masks[c]) for c in range(C) for _ in range(N)] + [bool(v) for v in token_masks] + \
        [True] * len(gen_tokens)
    Tv = len(types)
    H = 0
    if x_t is not None:
        H = x_t.shape[0]
        types += [ACT] * H
        valid += [True] * H
        cond = time_cond(model, t)
        x_exp = _lin(x_t, model.action_in_proj)
    vt = torch.tensor(valid)
    pos = torch.cumsum(vt.long(), 0) - 1
    mask = build_mask(types, valid, mode)
    Hq, Hkv, D = cfg.vlm.num_heads, cfg.vlm.num_kv_heads, cfg.vlm.head_dim
    pwe = model.paligemma_with_expert
    lm, ex = pwe.paligemma.model.language_model, pwe.gemma_expert.model
    prefix_k = []

    def ada(norm, x):
        mod = _lin(cond, norm.dense)
        s, b, g = mod.chunk(3)
        return rms(x) * (1 + s) + b, g

    for l in range(cfg.num_layers):
        L1, L2 = lm.layers[l], ex.layers[l]
        hv = rms(x_vlm) * (1 + L1.input_layernorm.weight)
        q = [L1.self_attn.q_proj(hv)]
        k = [L1.self_attn.k_proj(hv)]
        v = [L1.self_attn.v_proj(hv)]
        if H:
            he, g_att = ada(L2.input_layernorm, x_exp)
            q.append(L2.self_attn.q_proj(he))
            k.append(L2.self_attn.k_proj(he))
            v.append(L2.self_attn.v_proj(he))
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
        x_vlm = x_vlm + L1.self_attn.o_proj(out[:Tv])
        h = rms(x_vlm) * (1 + L1.post_attention_layernorm.weight)
        x_vlm = x_vlm + L1.mlp.down_proj(F.gelu(L1.mlp.gate_proj(h), approximate="tanh") * L1.mlp.up_proj(h))
        if H:
            x_exp = x_exp + g_att * L2.self_attn.o_proj(out[Tv:])
            h, g_mlp = ada(L2.post_attention_layernorm, x_exp)
            x_exp = x_exp + g_mlp * L2.mlp.down_proj(F.gelu(L2.mlp.gate_proj(h), approximate="tanh")
                                                       * L2.mlp.up_proj(h))
    logits = (rms(x_vlm) * (1 + lm.norm.weight)) @ emb.T
    vel = None
    if H:
        h, _ = ada(ex.norm, x_exp)
        vel = _lin(h, model.action_out_proj)
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


# ======================================================================================================================
# Tests
# ======================================================================================================================
import pytest  # noqa: E402

from oxygen_ros.model import DecodeBatch, SamplingParams, build_model, get_config  # noqa: E402

torch.set_num_threads(min(2, torch.get_num_threads()))
L = 16          # prompt length used in these tests
S_STEPS = 4


def rel_err(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


@pytest.fixture(scope="module", params=["image_isolated", "upstream"])
def model(request):
    return build_model(get_config("tiny", prefix_attention=request.param), seed=1)


@pytest.fixture(scope="module")
def iso_model():
    return build_model(get_config("tiny"), seed=2)


def make_inputs(cfg, B=1, seed=0, cams=None, lens=None):
    g = torch.Generator().manual_seed(seed)
    S = cfg.image_size
    images = torch.rand(B, cfg.num_cameras, 3, S, S, generator=g) * 2 - 1
    image_masks = torch.ones(B, cfg.num_cameras, dtype=torch.bool) if cams is None else torch.tensor(cams)
    tokens = torch.randint(3, cfg.vocab_size, (B, L), generator=g)
    lens = lens or [L] * B
    token_masks = torch.arange(L)[None] < torch.tensor(lens)[:, None]
    tokens = torch.where(token_masks, tokens, 0)
    return images, image_masks, tokens, token_masks


class FlatKV:
    """A real flat slot buffer (as the engine's pool): k[l], v[l] = [num_slots, Hkv, D]."""

    def __init__(self, cfg, num_slots):
        self.k = [torch.zeros(num_slots, cfg.num_kv_heads, cfg.head_dim) for _ in range(cfg.num_layers)]
        self.v = [torch.zeros(num_slots, cfg.num_kv_heads, cfg.head_dim) for _ in range(cfg.num_layers)]

    def put(self, prefix, row, slots):
        for l in range(len(self.k)):
            self.k[l][slots] = prefix.k[l][row]
            self.v[l][slots] = prefix.v[l][row]


def greedy_cached(model, prefix, row, n, kv=None, slots=None):
    """Decode n greedy tokens for one row of ``prefix`` through model.decode and a flat buffer."""
    cfg = model.cfg
    P = prefix.length
    if kv is None:
        kv = FlatKV(cfg, P + n + 3)
        slots = torch.arange(P + n)
    kv.put(prefix, row, slots[:P])
    ids = [int(prefix.last_logits[row].argmax())]
    logits = [prefix.last_logits[row]]
    read = list(slots[:P].tolist())
    rmask = prefix.mask[row].tolist()
    for i in range(n - 1):
        ws = int(slots[P + i])
        read.append(ws)
        rmask.append(True)
        out = model.decode(DecodeBatch(torch.tensor([ids[-1]]), prefix.next_position[row:row + 1] + i,
                                       torch.tensor([ws]), torch.tensor([read]), torch.tensor([rmask])), kv)
        ids.append(int(out.next_ids[0]))
        logits.append(out.logits[0])
    return ids, torch.stack(logits)


# ---- actions -----------------------------------------------------------------------------------------------------

def test_prefill_then_denoise_equals_joint_reference(model):
    cfg = model.cfg
    images, im, tokens, tm = make_inputs(cfg, B=2, seed=3, lens=[L, 9])
    noise = torch.randn(2, cfg.action_horizon, cfg.action_dim, generator=torch.Generator().manual_seed(4))
    prefix = model.prefill(images, im, tokens, tm)
    acts = model.sample_actions(prefix, noise, num_steps=S_STEPS)
    for b in range(2):
        ref = reference_actions(model, images[b], im[b], tokens[b], tm[b], noise[b], S_STEPS)
        assert rel_err(acts[b], ref) <= 1e-5, rel_err(acts[b], ref)
    # the joint one-pass forward (both towers in one attention) gives the reference velocity too
    t = torch.tensor([0.7, 0.3])
    vel = model(images, im, tokens, tm, noise, t)
    for b in range(2):
        _, ref_v, _ = joint_forward(model, images[b], im[b], tokens[b], tm[b], x_t=noise[b], t=float(t[b]))
        assert rel_err(vel[b], ref_v) <= 1e-5


def test_actions_depend_on_the_inputs(model):
    """Guards against a degenerate model/test: different images or noise must give different actions."""
    cfg = model.cfg
    images, im, tokens, tm = make_inputs(cfg, seed=5)
    noise = torch.randn(1, cfg.action_horizon, cfg.action_dim)
    a1 = model.sample_actions(model.prefill(images, im, tokens, tm), noise, num_steps=2)
    a2 = model.sample_actions(model.prefill(-images, im, tokens, tm), noise, num_steps=2)
    a3 = model.sample_actions(model.prefill(images, im, tokens, tm), noise + 0.5, num_steps=2)
    assert (a1 - a2).abs().max() > 1e-4 and (a1 - a3).abs().max() > 1e-4


def test_prefix_kv_read_only(model):
    cfg = model.cfg
    images, im, tokens, tm = make_inputs(cfg, seed=6)
    prefix = model.prefill(images, im, tokens, tm, want_logits=True)
    k0 = [k.clone() for k in prefix.k]
    v0 = [v.clone() for v in prefix.v]
    model.sample_actions(prefix, torch.randn(1, cfg.action_horizon, cfg.action_dim))
    assert all(torch.equal(a, b) for a, b in zip(k0 + v0, prefix.k + prefix.v))
    greedy_cached(model, prefix, 0, 4)
    assert all(torch.equal(a, b) for a, b in zip(k0 + v0, prefix.k + prefix.v))


def test_prefix_batch1_broadcasts_to_noise_batch(iso_model):
    cfg = iso_model.cfg
    images, im, tokens, tm = make_inputs(cfg, seed=7)
    prefix = iso_model.prefill(images, im, tokens, tm)
    noise = torch.randn(3, cfg.action_horizon, cfg.action_dim)
    acts = iso_model.sample_actions(prefix, noise, num_steps=2)
    for b in range(3):
        one = iso_model.sample_actions(prefix, noise[b:b + 1], num_steps=2)
        assert torch.allclose(acts[b], one[0], rtol=0, atol=1e-5)


# ---- decoding ----------------------------------------------------------------------------------------------------

def test_cached_greedy_decode_equals_full_recompute(model):
    cfg = model.cfg
    images, im, tokens, tm = make_inputs(cfg, seed=8, lens=[11])
    prefix = model.prefill(images, im, tokens, tm, want_logits=True)
    ids, logits = greedy_cached(model, prefix, 0, 6)
    ref_ids, ref_logits = reference_greedy(model, images[0], im[0], tokens[0], tm[0], 6)
    assert ids == ref_ids
    assert rel_err(logits, ref_logits) <= 1e-5


def test_masked_camera_and_padding(model):
    """Pitfall D: with a masked camera slot and right padding the first token comes from the last valid position,
    and masked tokens neither attend nor are attended."""
    cfg = model.cfg
    images, im, tokens, tm = make_inputs(cfg, seed=9, cams=[[True, False, True]], lens=[7])
    prefix = model.prefill(images, im, tokens, tm, want_logits=True)
    ref_logits, _, ref_k = joint_forward(model, images[0], im[0], tokens[0], tm[0])
    N = cfg.image_tokens_per_camera
    last_valid = 3 * N + 7 - 1
    assert int(prefix.next_position[0]) == 2 * N + 7
    assert rel_err(prefix.last_logits[0], ref_logits[last_valid]) <= 1e-5
    # the reference's image features of the masked camera are real (not zeros): equality shows they are masked out
    valid = prefix.mask[0]
    for l in range(cfg.num_layers):
        assert rel_err(prefix.k[l][0][valid], ref_k[l][valid]) <= 1e-5
    # changing what sits under the masks (masked camera pixels, padding token ids) changes nothing valid
    images2, tokens2 = images.clone(), tokens.clone()
    images2[0, 1] = torch.rand_like(images2[0, 1])
    tokens2[0, 7:] = torch.randint(3, cfg.vocab_size, (L - 7,))
    prefix2 = model.prefill(images2, im, tokens2, tm, want_logits=True)
    assert torch.equal(prefix.last_logits, prefix2.last_logits)
    for l in range(cfg.num_layers):
        assert torch.equal(prefix.k[l][0][valid], prefix2.k[l][0][valid])
    noise = torch.randn(1, cfg.action_horizon, cfg.action_dim)
    assert torch.equal(model.sample_actions(prefix, noise, 2), model.sample_actions(prefix2, noise, 2))
    ids1, _ = greedy_cached(model, prefix, 0, 4)
    ids2, _ = greedy_cached(model, prefix2, 0, 4)
    ref_ids, _ = reference_greedy(model, images[0], im[0], tokens[0], tm[0], 4)
    assert ids1 == ids2 == ref_ids
    # the same prompt without padding gives the same first-token logits (padding is not "the last position")
    prefix3 = model.prefill(images, im, tokens[:, :7], tm[:, :7], want_logits=True)
    assert rel_err(prefix3.last_logits[0], prefix.last_logits[0]) <= 1e-5


def test_batched_decode_equals_rows_alone(iso_model):
    """Rows from different frames, prompt lengths and steps, scattered non-contiguous slots, one batched call per
    step; each row must get exactly what it gets decoded alone."""
    model, cfg = iso_model, iso_model.cfg
    frames = [make_inputs(cfg, seed=s, lens=[n], cams=[c])
              for s, n, c in ((10, 16, [True, True, True]), (11, 5, [True, False, True]), (12, 9, [False, True, True]))]
    prefixes = [model.prefill(*f, want_logits=True) for f in frames]
    start_steps = [0, 3, 5]          # rows are at different decode steps when they meet
    k_steps = 4
    total = max(start_steps) + k_steps
    P = prefixes[0].length
    # alone: each row decoded uninterrupted
    alone = [greedy_cached(model, p, 0, s0 + k_steps + 1) for p, s0 in zip(prefixes, start_steps)]
    # together: a shared pool with shuffled slots; first bring each row to its start step alone, then batch
    n_slots = 3 * (P + total + 2)
    perm = torch.randperm(n_slots, generator=torch.Generator().manual_seed(0))
    kv = FlatKV(cfg, n_slots)
    rows = []
    for r, (p, s0) in enumerate(zip(prefixes, start_steps)):
        slots = perm[r * (P + total + 2):(r + 1) * (P + total + 2)]
        ids, _ = greedy_cached(model, p, 0, s0 + 1, kv=kv, slots=slots)
        rows.append(dict(slots=slots, ids=ids, read=slots[:P + s0].tolist(), mask=p.mask[0].tolist() + [True] * s0,
                         pos=int(p.next_position[0]) + s0))
    for _ in range(k_steps):
        T = max(len(r["read"]) + 1 for r in rows)
        tok, pos, ws, rs, rm = [], [], [], [], []
        for r in rows:
            w = int(r["slots"][len(r["read"])])
            read = r["read"] + [w]
            tok.append(r["ids"][-1])
            pos.append(r["pos"])
            ws.append(w)
            rs.append(read + [0] * (T - len(read)))
            rm.append(r["mask"] + [True] + [False] * (T - len(read)))
        out = model.decode(DecodeBatch(torch.tensor(tok), torch.tensor(pos), torch.tensor(ws), torch.tensor(rs),
                                       torch.tensor(rm)), kv)
        for b, r in enumerate(rows):
            r["read"].append(ws[b])
            r["mask"].append(True)
            r["pos"] += 1
            r["ids"].append(int(out.next_ids[b]))
            ref_logit = alone[b][1][len(r["ids"]) - 1]
            assert torch.allclose(out.logits[b], ref_logit, rtol=0, atol=1e-4 * float(ref_logit.abs().max()))
    for r, (ids, _) in zip(rows, alone):
        assert r["ids"] == ids


def test_decode_writes_only_the_new_slot(iso_model):
    cfg = iso_model.cfg
    prefix = iso_model.prefill(*make_inputs(cfg, seed=13), want_logits=True)
    P = prefix.length
    kv = FlatKV(cfg, P + 4)
    kv.put(prefix, 0, torch.arange(P))
    for l in range(cfg.num_layers):
        kv.k[l][P:] = 7.0
        kv.v[l][P:] = 7.0
    before = [t.clone() for t in kv.k + kv.v]
    rmask = torch.tensor([prefix.mask[0].tolist() + [False, True]])
    iso_model.decode(DecodeBatch(torch.tensor([5]), prefix.next_position, torch.tensor([P + 1]),
                                 torch.arange(P + 2)[None], rmask), kv)
    for a, b in zip(before, kv.k + kv.v):
        changed = (a != b).any(dim=(1, 2)).nonzero().flatten().tolist()
        assert changed == [P + 1]


def test_seeded_sampling_is_reproducible_and_batch_independent(iso_model):
    cfg = iso_model.cfg
    prefix = iso_model.prefill(*make_inputs(cfg, seed=14), want_logits=True)
    P = prefix.length

    def run(batch_rows, sp):
        kv = FlatKV(cfg, P + 2)
        kv.put(prefix, 0, torch.arange(P))
        B = batch_rows
        out = iso_model.decode(DecodeBatch(torch.full((B,), 9), prefix.next_position.expand(B),
                                           torch.full((B,), P), torch.arange(P + 1)[None].expand(B, -1),
                                           torch.tensor([prefix.mask[0].tolist() + [True]]).expand(B, -1), sp), kv)
        return out.next_ids.tolist()

    hot = SamplingParams(temperature=5.0, top_p=1.0, seed=123)
    a = run(1, [hot])
    b = run(3, [SamplingParams(), hot, SamplingParams(temperature=5.0, seed=7)])
    assert b[1] == a[0]
    greedy = run(1, None)
    assert b[0] == greedy[0]
    assert run(1, [SamplingParams(temperature=5.0, top_p=1e-9, seed=5)]) == greedy
    draws = {run(1, [SamplingParams(temperature=50.0, seed=s)])[0] for s in range(12)}
    assert len(draws) > 3                       # sampling really samples


# ---- image_isolated ----------------------------------------------------------------------------------------------

def test_image_kv_independent_of_prompt_only_in_isolated_mode():
    for mode in ("image_isolated", "upstream"):
        m = build_model(get_config("tiny", prefix_attention=mode), seed=3)
        images, im, tokens, tm = make_inputs(m.cfg, seed=15)
        _, _, tokens2, tm2 = make_inputs(m.cfg, seed=16, lens=[12])
        p1, p2 = m.prefill(images, im, tokens, tm), m.prefill(images, im, tokens2, tm2)
        n_img = m.cfg.num_image_tokens
        same = all(torch.equal(a[:, :n_img], b[:, :n_img]) for a, b in zip(p1.k + p1.v, p2.k + p2.v))
        assert same == (mode == "image_isolated"), mode


def test_extend_prefix_equals_prefill(iso_model):
    cfg = iso_model.cfg
    images, im, _, _ = make_inputs(cfg, seed=17, cams=[[True, False, True]])
    _, _, tokens, tm = make_inputs(cfg, B=2, seed=18, lens=[16, 6])
    img_prefix = iso_model.prefill_images(images, im)
    ext = iso_model.extend_prefix(img_prefix, tokens, tm, want_logits=True)      # batch 1 -> 2 prompts
    full = iso_model.prefill(images.expand(2, -1, -1, -1, -1), im.expand(2, -1), tokens, tm, want_logits=True)
    assert ext.length == full.length and torch.equal(ext.mask, full.mask)
    assert torch.equal(ext.positions, full.positions) and torch.equal(ext.next_position, full.next_position)
    for a, b in zip(ext.k + ext.v, full.k + full.v):
        assert rel_err(a[full.mask], b[full.mask]) <= 1e-5
    assert rel_err(ext.last_logits, full.last_logits) <= 1e-5
    assert img_prefix.batch_size == 1             # input prefix untouched
    noise = torch.randn(2, cfg.action_horizon, cfg.action_dim)
    assert rel_err(iso_model.sample_actions(ext, noise, 2), iso_model.sample_actions(full, noise, 2)) <= 1e-5


def test_extend_prefix_refused_in_upstream_mode():
    m = build_model(get_config("tiny", prefix_attention="upstream"))
    images, im, tokens, tm = make_inputs(m.cfg)
    with pytest.raises(ValueError, match="image_isolated"):
        m.prefill_images(images, im)
    with pytest.raises(ValueError, match="image_isolated"):
        m.extend_prefix(m.prefill(images, im, tokens, tm), tokens, tm)


def test_degenerate_masks_stay_finite(iso_model):
    """All cameras masked and no prompt tokens in one row, a decode row that sees only its own token: no NaN/inf."""
    cfg = iso_model.cfg
    images, _, tokens, _ = make_inputs(cfg, B=2, seed=19)
    im = torch.tensor([[False, False, False], [True, True, True]])
    tm = torch.zeros(2, L, dtype=torch.bool)
    prefix = iso_model.prefill(images, im, tokens, tm, want_logits=True)
    assert prefix.next_position.tolist() == [0, cfg.num_image_tokens]
    assert all(torch.isfinite(k).all() for k in prefix.k + prefix.v) and torch.isfinite(prefix.last_logits).all()
    acts = iso_model.sample_actions(prefix, torch.randn(2, cfg.action_horizon, cfg.action_dim), num_steps=2)
    assert torch.isfinite(acts).all()
    kv = FlatKV(cfg, 4)
    out = iso_model.decode(DecodeBatch(torch.tensor([5]), torch.tensor([0]), torch.tensor([2]),
                                       torch.tensor([[0, 1, 2]]), torch.tensor([[False, False, True]])), kv)
    assert torch.isfinite(out.logits).all()


def test_sample_tokens_distribution_and_top_p():
    from oxygen_ros.model.pi05 import sample_tokens
    logits = torch.log(torch.tensor([[0.05, 0.7, 0.25, 0.0]]))            # token 3 has probability 0
    picks = torch.stack([sample_tokens(logits, [SamplingParams(temperature=1.0, seed=s)], torch.tensor([0]))
                         for s in range(3000)])
    freq = torch.bincount(picks.flatten(), minlength=4).double() / 3000
    assert torch.allclose(freq, torch.tensor([0.05, 0.7, 0.25, 0.0], dtype=torch.float64), atol=0.03), freq
    nucleus = torch.stack([sample_tokens(logits, [SamplingParams(temperature=1.0, top_p=0.8, seed=s)],
                                         torch.tensor([0])) for s in range(500)])
    assert set(nucleus.flatten().tolist()) == {1, 2}                     # 0.7 + 0.25 covers 0.8; 0.05 is cut
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    a = [int(sample_tokens(logits, [SamplingParams(1.0, generator=g1)], torch.tensor([0]))) for _ in range(20)]
    b = [int(sample_tokens(logits, [SamplingParams(1.0, generator=g2)], torch.tensor([0]))) for _ in range(20)]
    assert a == b and len(set(a)) > 1


def test_vlm_tower_matches_transformers_gemma(iso_model):
    """Independent of our reference: with every camera masked, the prefix is a plain causal Gemma over the prompt, so
    prefill + cached decode must give transformers' own GemmaForCausalLM logits (RoPE, norms, GQA, tied head)."""
    from transformers import GemmaConfig, GemmaForCausalLM
    cfg, g = iso_model.cfg, iso_model.cfg.vlm
    hf = GemmaForCausalLM(GemmaConfig(
        vocab_size=cfg.vocab_size, hidden_size=g.width, intermediate_size=g.mlp_dim, num_hidden_layers=g.depth,
        num_attention_heads=g.num_heads, num_key_value_heads=g.num_kv_heads, head_dim=g.head_dim,
        hidden_activation="gelu_pytorch_tanh", rms_norm_eps=g.rms_norm_eps, max_position_embeddings=512,
        tie_word_embeddings=True)).eval()
    sd = {"model." + k: v for k, v in iso_model.vlm.state_dict().items()}
    sd["lm_head.weight"] = iso_model.vlm.embed_tokens.weight
    hf.load_state_dict(sd, strict=True)
    images, _, tokens, tm = make_inputs(cfg, seed=20, lens=[10])
    prefix = iso_model.prefill(images, torch.zeros(1, 3, dtype=torch.bool), tokens, tm, want_logits=True)
    ids, logits = greedy_cached(iso_model, prefix, 0, 4)
    seq = torch.cat([tokens[0, :10], torch.tensor(ids[:-1])])[None]
    with torch.no_grad():
        ref = hf(input_ids=seq).logits[0, 9:]                                  # logits that chose ids[0..3]
    assert rel_err(logits, ref) <= 1e-5
    assert ids == ref.argmax(-1).tolist()


def test_prefix_select_and_expand(iso_model):
    cfg = iso_model.cfg
    prefix = iso_model.prefill(*make_inputs(cfg, B=3, seed=21, lens=[16, 4, 9]), want_logits=True)
    one = prefix.select([1])
    assert one.batch_size == 1 and one.length == prefix.length and int(one.next_position) == cfg.num_image_tokens + 4
    assert torch.equal(one.k[0][0], prefix.k[0][1]) and torch.equal(one.last_logits[0], prefix.last_logits[1])
    assert one.k[0].data_ptr() != prefix.k[0].data_ptr()          # a copy
    ex = one.expand(4)
    assert ex.batch_size == 4 and ex.k[0].data_ptr() == one.k[0].data_ptr()   # views
    assert prefix.nbytes() == 2 * cfg.num_layers * 3 * prefix.length * cfg.num_kv_heads * cfg.head_dim * 4
    with pytest.raises(ValueError):
        prefix.expand(5)
