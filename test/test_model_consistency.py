"""Self-consistency of the pi0.5 model's cached primitives against the naive reference in ``pi05_reference.py``.

This file owns the numerical contract of ``oxygen_ros/model/pi05.py``.  Its models get random values in every
parameter that the default init leaves neutral (``model_fixtures.randomize_parameters``: norm scales, LayerNorms,
adaRMS biases), checked by a test, so that a wrong norm wired into a layer changes the numbers; and every parameter
must reach the outputs (a gradient test), so that a module left out of the forward is found even where values would
hide it.  The reference (it reads the model's weights but none of its forward code) must agree with prefill +
sample_actions (fp32, <= 1e-5 relative) in both prefix-attention modes, with cached greedy decoding token for token
and logit for logit, with masked camera slots / prompt padding (pitfall D), with batched decode of rows from
different frames, prompt lengths and steps, with a non-default head layout, and on degenerate (all-masked) rows; the
prefix KV must stay bit-identical through sample_actions and decode (pitfall A); in ``image_isolated`` mode the image
KV must not depend on the prompt and ``extend_prefix(prefill_images)`` must equal ``prefill``; the VLM tower must
equal transformers' own ``GemmaForCausalLM``.
"""
from __future__ import annotations

import copy

import pytest
import torch

from model_fixtures import neutral_parameters, randomize_parameters
from oxygen_ros.model import DecodeBatch, SamplingParams, build_model, get_config
from oxygen_ros.model.pi05 import Pi05Model
from pi05_reference import joint_forward, reference_actions, reference_greedy

torch.set_num_threads(min(2, torch.get_num_threads()))
L = 16          # prompt length used in these tests
S_STEPS = 4


def rel_err(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


def random_model(seed, **cfg):
    """A tiny model whose every parameter holds a random, non-neutral value."""
    return randomize_parameters(build_model(get_config("tiny", **cfg), seed=seed), seed=seed)


@pytest.fixture(scope="module", params=["image_isolated", "upstream"])
def model(request):
    return random_model(1, prefix_attention=request.param)


@pytest.fixture(scope="module")
def iso_model():
    return random_model(2)


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


# ---- the fixtures exercise every parameter --------------------------------------------------------------------

def test_fixture_models_hold_no_neutral_parameter(model, iso_model):
    """No parameter of the models below is (piecewise) constant or a copy of another one, so exchanging two norms
    (or any two same-shaped modules) changes the numbers the reference comparisons look at."""
    assert neutral_parameters(model) == [] and neutral_parameters(iso_model) == []
    # the check itself finds what it is for: a neutral norm, and two interchangeable modules
    m = random_model(4)
    lm = m.vlm
    lm.layers[1].input_layernorm.weight.data.zero_()
    lm.norm.weight.data.copy_(lm.layers[0].post_attention_layernorm.weight)
    found = neutral_parameters(m)
    assert found == ["paligemma_with_expert.paligemma.model.language_model.layers.1.input_layernorm.weight",
                     "paligemma_with_expert.paligemma.model.language_model.norm.weight == "
                     "paligemma_with_expert.paligemma.model.language_model.layers.0.post_attention_layernorm.weight"]


def test_every_parameter_reaches_the_outputs():
    """Every parameter but the unused expert lm_head gets a non-zero gradient from the prefill logits + the velocity:
    a module that the forward leaves out (a norm replaced by another layer's, a skipped final norm) is found whatever
    its values."""
    m = random_model(5)
    cfg = m.cfg
    names, params = zip(*[(n, p) for n, p in m.named_parameters() if not n.endswith("gemma_expert.lm_head.weight")])
    images, im, tokens, tm = make_inputs(cfg, seed=22, lens=[9])
    noise = torch.randn(1, cfg.action_horizon, cfg.action_dim, generator=torch.Generator().manual_seed(23))
    g = torch.Generator().manual_seed(24)
    try:
        for p in params:
            p.requires_grad_(True)
        with torch.enable_grad():
            prefix = Pi05Model.prefill.__wrapped__(m, images, im, tokens, tm, want_logits=True)   # without no_grad
            vel = m(images, im, tokens, tm, noise, torch.tensor([0.6]))
            loss = (prefix.last_logits * torch.randn(prefix.last_logits.shape, generator=g)).sum() + \
                (vel * torch.randn(vel.shape, generator=g)).sum()
            grads = torch.autograd.grad(loss, params, allow_unused=True)
    finally:
        m.requires_grad_(False)
    dead = [n for n, gr in zip(names, grads) if gr is None or not bool(gr.abs().max() > 0)]
    assert dead == []
    assert len(names) == len(list(m.parameters())) - 1
    # and per openpi tensor: every part of a fused Q/K/V or gate/up matrix gets a gradient of its own (the model's
    # state_dict of the gradients shows them under openpi's names)
    g_model = copy.deepcopy(m)
    params = dict(g_model.named_parameters())
    with torch.no_grad():
        for n, gr in zip(names, grads):
            params[n].copy_(gr)
    dead_parts = [k for k, t in g_model.state_dict().items()
                  if not k.endswith("gemma_expert.lm_head.weight") and not bool(t.abs().max() > 0)]
    assert dead_parts == []


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


def test_batched_decode_equals_rows_alone_and_the_reference(iso_model):
    """Rows from different frames, prompt lengths and steps, scattered non-contiguous slots, one batched call per
    step; each row must get what it gets decoded alone, and what the naive reference computes for it."""
    model, cfg = iso_model, iso_model.cfg
    frames = [make_inputs(cfg, seed=s, lens=[n], cams=[c])
              for s, n, c in ((10, 16, [True, True, True]), (11, 5, [True, False, True]), (12, 9, [False, True, True]))]
    prefixes = [model.prefill(*f, want_logits=True) for f in frames]
    start_steps = [0, 3, 5]          # rows are at different decode steps when they meet
    k_steps = 4
    total = max(start_steps) + k_steps
    P = prefixes[0].length
    # alone: each row decoded uninterrupted; and the reference's full recompute of each row
    alone = [greedy_cached(model, p, 0, s0 + k_steps + 1) for p, s0 in zip(prefixes, start_steps)]
    refs = [reference_greedy(model, f[0][0], f[1][0], f[2][0], f[3][0], s0 + k_steps + 1)
            for f, s0 in zip(frames, start_steps)]
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
            step = len(r["ids"]) - 1
            assert rel_err(out.logits[b], alone[b][1][step]) <= 1e-5
            assert rel_err(out.logits[b], refs[b][1][step]) <= 1e-5
    for r, (ids, _), (ref_ids, _) in zip(rows, alone, refs):
        assert r["ids"] == ids == ref_ids


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
        m = random_model(3, prefix_attention=mode)
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


def test_degenerate_masks_match_the_reference(iso_model):
    """All cameras masked and no prompt tokens in one row, a decode row that sees only its own token: finite, and the
    reference's values (the actions attend only to themselves; the lone token is a one-token sequence at position 0)."""
    cfg = iso_model.cfg
    images, _, tokens, _ = make_inputs(cfg, B=2, seed=19)
    im = torch.tensor([[False, False, False], [True, True, True]])
    tm = torch.zeros(2, L, dtype=torch.bool)
    prefix = iso_model.prefill(images, im, tokens, tm, want_logits=True)
    assert prefix.next_position.tolist() == [0, cfg.num_image_tokens]
    assert all(torch.isfinite(k).all() for k in prefix.k + prefix.v) and torch.isfinite(prefix.last_logits).all()
    noise = torch.randn(2, cfg.action_horizon, cfg.action_dim, generator=torch.Generator().manual_seed(25))
    acts = iso_model.sample_actions(prefix, noise, num_steps=2)
    for b in range(2):
        assert rel_err(acts[b], reference_actions(iso_model, images[b], im[b], tokens[b], tm[b], noise[b], 2)) <= 1e-5
    kv = FlatKV(cfg, 4)
    out = iso_model.decode(DecodeBatch(torch.tensor([5]), torch.tensor([0]), torch.tensor([2]),
                                       torch.tensor([[0, 1, 2]]), torch.tensor([[False, False, True]])), kv)
    ref, _, _ = joint_forward(iso_model, images[0], im[0], tokens[0], tm[0], gen_tokens=[5])
    assert torch.isfinite(out.logits).all() and rel_err(out.logits[0], ref[-1]) <= 1e-5


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
