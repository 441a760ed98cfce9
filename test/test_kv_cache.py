"""Tests of kv/cache.py on the real (tiny, random-weight) model: the manager stores only a prefix's valid tokens with
their positions (masked camera slots cost nothing), the shared prefix KV is bit-identical before and after action
sampling and decoding (decode writes only request-private slots), batched paged decode reproduces a full recompute,
decoding in chunks of k (N not divisible by k) batched with requests at other steps gives the same tokens and logits
as one uninterrupted decode, admission waits / rejects with a reason when the pool or batch is full (first in, first
out: no later, smaller request overtakes one waiting for memory), reference counts free a frame prefix only with its
last reader, and check_invariants() holds throughout and catches corruption."""
import pytest
import torch

from oxygen_ros.engine.requests import LanguageRequest
from oxygen_ros.kv.cache import KVCacheManager
from oxygen_ros.kv.pool import KVPool
from oxygen_ros.model import build_model, get_config
from oxygen_ros.model.pi05 import DecodeBatch


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model():
    cfg = get_config("tiny", vision={"image_size": 64, "patch_size": 16}, max_token_len=24)
    return build_model(cfg, seed=0)


def _inputs(cfg, seed=0, cam_mask=(True, True, True), n_tokens=10, batch=1):
    g = torch.Generator().manual_seed(seed)
    S = cfg.image_size
    images = torch.rand(batch, cfg.num_cameras, 3, S, S, generator=g) * 2 - 1
    im = torch.tensor([cam_mask] * batch)
    toks = torch.randint(3, cfg.vocab_size, (batch, cfg.max_token_len), generator=g)
    tm = torch.zeros(batch, cfg.max_token_len, dtype=torch.bool)
    tm[:, :n_tokens] = True
    return images, im, toks, tm


def _manager(cfg, num_blocks=64, block_size=4, max_batch=8):
    return KVCacheManager(KVPool.from_config(cfg, num_blocks=num_blocks, block_size=block_size), max_batch=max_batch)


def _decode(model, kv, rows, steps):
    """Run a plan to its end; returns per row the list of (token, logits)."""
    plan = kv.plan_decode(rows, steps)
    ids = torch.tensor([st.last_token for st in rows])
    logits = {st.request_id: [] for st in rows}
    while plan.active:
        act = list(plan.active)
        pos, w, r, m = kv.step_tensors(plan)
        out = model.decode(DecodeBatch(ids, pos, w, r, m), kv.pool)
        for j, a in enumerate(act):
            logits[rows[a].request_id].append(out.logits[j])
        kv.commit_step(plan, out.next_ids.tolist())
        kv.check_invariants()
        if plan.active != act:
            ids = out.next_ids[[act.index(a) for a in plan.active]]
        else:
            ids = out.next_ids
    return logits


def _admit(kv, fp, n_new, first, **kw):
    req = LanguageRequest("subtask", "", n_new)
    return kv.admit(req, fp, shared_len=kw.pop("shared_len", fp.length), first_token=first, max_new_tokens=n_new,
                    eos_token_id=kw.pop("eos", None), **kw)


def test_store_only_valid_tokens_with_positions(model):
    cfg = model.cfg
    images, im, toks, tm = _inputs(cfg, cam_mask=(True, False, True), n_tokens=7)
    pre = model.prefill(images, im, toks, tm)
    kv = _manager(cfg)
    fp = kv.store_prefix(pre, 0, frame_index=3, image_positions=cfg.num_image_tokens)
    n_img = 2 * cfg.image_tokens_per_camera
    assert fp.length == n_img + 7 == int(pre.mask.sum()) and fp.image_length == n_img
    assert fp.positions.tolist() == list(range(fp.length)) and fp.next_position == int(pre.next_position[0])
    valid = pre.mask[0].nonzero().squeeze(1)
    for l in range(cfg.num_layers):
        assert torch.equal(kv.pool.k[l][fp.slots], pre.k[l][0, valid])
        assert torch.equal(kv.pool.v[l][fp.slots], pre.v[l][0, valid])
    assert kv.pool.used_blocks == kv.pool.blocks_for(fp.length)
    img_only = kv.store_prefix(pre, 0, frame_index=3, stop=cfg.num_image_tokens, image_positions=cfg.num_image_tokens)
    assert img_only.length == img_only.image_length == n_img
    kv.release(fp)
    kv.release(img_only)
    assert kv.pool.used_blocks == 0 and not kv.prefixes
    kv.check_invariants(idle=True)


def test_paged_decode_matches_full_recompute_and_prefix_is_read_only(model):
    cfg = model.cfg
    assert cfg.prefix_attention == "image_isolated"     # prompt tokens are causal: a recompute is a valid reference
    images, im, toks, tm = _inputs(cfg, seed=1, cam_mask=(True, True, False), n_tokens=9)
    pre = model.prefill(images, im, toks, tm, want_logits=True)
    dense_k = [k.clone() for k in pre.k]
    kv = _manager(cfg)
    fp = kv.store_prefix(pre, 0, frame_index=0, image_positions=cfg.num_image_tokens)
    pool_k = [kv.pool.k[l][fp.slots].clone() for l in range(cfg.num_layers)]
    pool_v = [kv.pool.v[l][fp.slots].clone() for l in range(cfg.num_layers)]
    model.sample_actions(pre, torch.randn(1, cfg.action_horizon, cfg.action_dim))
    first = int(pre.last_logits[0].argmax())
    st = _admit(kv, fp, 6, first)
    kv.release(fp)
    logits = _decode(model, kv, [st], [5])[st.request_id]
    assert st.finished and st.finish_reason == "length" and len(st.generated) == 6
    # the shared prefix, dense and pooled, is bit-identical after actions and decoding
    for l in range(cfg.num_layers):
        assert torch.equal(pre.k[l], dense_k[l])
    fp2 = kv.store_prefix(pre, 0, frame_index=0, image_positions=cfg.num_image_tokens)
    seq = toks[0, :9].tolist()
    for i, tok in enumerate(st.generated[:-1]):
        seq.append(tok)
        t = torch.tensor([seq + [0] * (cfg.max_token_len - len(seq))])
        m = torch.zeros_like(t, dtype=torch.bool)
        m[0, :len(seq)] = True
        ref = model.prefill(images, im, t, m, want_logits=True).last_logits[0]
        torch.testing.assert_close(logits[i], ref, rtol=1e-4, atol=1e-4)
        assert int(ref.argmax()) == st.generated[i + 1]
    kv.release(fp2)
    kv.check_invariants(idle=True)
    assert kv.pool.used_blocks == 0 and kv.reserved_blocks == 0

    # pooled prefix slots are not written by decoding readers (three rows at different steps)
    kv2 = _manager(cfg)
    fp3 = kv2.store_prefix(pre, 0, frame_index=0, image_positions=cfg.num_image_tokens)
    before = [kv2.pool.k[l][fp3.slots].clone() for l in range(cfg.num_layers)]
    rows = [_admit(kv2, fp3, 8, first) for _ in range(3)]
    _decode(model, kv2, rows, [7, 3, 5])
    for l in range(cfg.num_layers):
        assert torch.equal(kv2.pool.k[l][fp3.slots], before[l])
        assert torch.equal(pool_k[l], before[l])
        assert torch.equal(kv2.pool.v[l][fp3.slots], pool_v[l])
    assert rows[0].finished and fp3.refcount == 3      # the creator + two unfinished readers
    kv2.check_invariants()
    for st in rows:
        kv2.finish(st, "length")
    kv2.release(fp3)
    assert kv2.pool.used_blocks == 0 and not kv2.prefixes and not kv2.requests


def test_chunked_batched_decode_equals_uninterrupted(model):
    """N=7 in chunks of k=3 (7 % 3 != 0), rows joining at different frames, different prompt lengths."""
    cfg = model.cfg
    N, k = 7, 3
    pres = [model.prefill(*_inputs(cfg, seed=10 + i, n_tokens=4 + 3 * i,
                                   cam_mask=(True, i != 1, True)), want_logits=True) for i in range(3)]
    # reference: each alone, uninterrupted
    ref = []
    for pre in pres:
        kv = _manager(cfg)
        fp = kv.store_prefix(pre, 0, frame_index=0, image_positions=cfg.num_image_tokens)
        st = _admit(kv, fp, N, int(pre.last_logits[0].argmax()))
        kv.release(fp)
        logits = _decode(model, kv, [st], [N - 1])[st.request_id]
        ref.append((st.generated, torch.stack(logits)))
        assert kv.pool.used_blocks == 0
    # cross-frame continuous batching: one arrival per "frame", k tokens per row per frame
    kv = _manager(cfg, num_blocks=80)
    states, frame, logits = [], 0, {}
    while frame < 3 or kv.requests:
        kv.begin_cycle()
        if frame < 3:
            pre = pres[frame]
            fp = kv.store_prefix(pre, 0, frame_index=frame, image_positions=cfg.num_image_tokens)
            st = _admit(kv, fp, N, int(pre.last_logits[0].argmax()), frame_index=frame)
            kv.release(fp)
            states.append(st)
        rows = list(kv.requests.values())
        steps = [min(k - st.tokens_this_cycle, st.tokens_left) for st in rows]
        out = _decode(model, kv, [r for r, s in zip(rows, steps) if s > 0], [s for s in steps if s > 0])
        for rid, rows_logits in out.items():
            logits.setdefault(rid, []).extend(rows_logits)
        kv.check_invariants(idle=True)
        frame += 1
    for st, (ids, ref_logits) in zip(states, ref):     # same tokens, and logits to fp32 rounding (<= 1e-5 relative)
        assert st.generated == ids
        got = torch.stack(logits[st.request_id])
        assert got.shape == ref_logits.shape
        assert float((got - ref_logits).abs().max()) <= 1e-5 * float(ref_logits.abs().max())
    assert frame == 2 + -(-N // k)               # the last arrival finishes ceil(N/k) frames after it arrived
    assert kv.pool.used_blocks == 0 and kv.reserved_blocks == 0 and not kv.prefixes


def test_private_prompt_on_shared_image_prefix(model):
    """image_isolated: a different prompt extends the frame's image KV; only its prompt tokens are private."""
    cfg = model.cfg
    images, im, toks, tm = _inputs(cfg, seed=3, n_tokens=8)
    pre = model.prefill(images, im, toks, tm)
    kv = _manager(cfg)
    fp = kv.store_prefix(pre, 0, frame_index=0, image_positions=cfg.num_image_tokens)
    img = model.prefill_images(images, im)
    q = torch.tensor([[2, 50, 60, 70, 80, 0], [2, 90, 91, 0, 0, 0]])
    ext = model.extend_prefix(img, q, q != 0, want_logits=True)
    rows = [kv.admit(LanguageRequest("conversation", "q", 5), fp, shared_len=fp.image_length,
                     first_token=int(ext.last_logits[j].argmax()), max_new_tokens=5, eos_token_id=None,
                     private_prompt=(ext, j, cfg.num_image_tokens)) for j in range(2)]
    kv.release(fp)
    assert [r.prompt_len for r in rows] == [5, 3] and [r.next_position for r in rows] == \
        [fp.image_length + 5, fp.image_length + 3]
    out = _decode(model, kv, rows, [4, 4])
    for j, st in enumerate(rows):           # same as a full image_isolated prefill of images + that prompt
        t = torch.zeros(1, cfg.max_token_len, dtype=torch.long)
        n = int((q[j] != 0).sum())
        seq = q[j, :n].tolist() + st.generated[:-1]
        t[0, :len(seq)] = torch.tensor(seq)
        ref = model.prefill(images, im, t, t != 0, want_logits=True)
        torch.testing.assert_close(out[st.request_id][-1], ref.last_logits[0], rtol=1e-4, atol=1e-4)
    assert kv.pool.used_blocks == 0


def test_admission_capacity_reservations_and_refcounts(model):
    cfg = model.cfg
    pre = model.prefill(*_inputs(cfg, seed=4, n_tokens=6), want_logits=True)
    n = int(pre.mask.sum())
    bs = 4
    prefix_blocks = -(-n // bs)
    kv = _manager(cfg, num_blocks=prefix_blocks + 4, block_size=bs, max_batch=3)
    need = kv.request_blocks(0, 9)                       # 8 written tokens -> 2 blocks
    assert need == 2
    d = kv.plan_admission([need, need, need, 100], shared_prefix_blocks=prefix_blocks)
    assert d[0] is None and d[1] is None
    assert d[2] == ("wait", "kv_full")
    assert d[3][0] == "reject" and d[3][1].startswith("too_large")
    fp = kv.store_prefix(pre, 0, frame_index=0, image_positions=cfg.num_image_tokens)
    a = _admit(kv, fp, 9, 5)
    b = _admit(kv, fp, 9, 5)
    kv.release(fp)
    assert fp.refcount == 2 and kv.reserved_blocks == 4 and kv.available_blocks == 0
    assert kv.plan_admission([1]) == [("wait", "kv_full")]
    with pytest.raises(RuntimeError):
        _admit(kv, fp, 9, 5)                              # no capacity left: admit refuses
    _decode(model, kv, [a, b], [3, 8])                    # reservations turn into blocks, never beyond the pool
    assert b.finished and not a.finished and fp.refcount == 1 and kv.prefixes
    kv.check_invariants(idle=True)
    kv.finish(a, "length")
    assert not kv.prefixes and kv.pool.used_blocks == 0 and kv.reserved_blocks == 0
    kv.check_invariants(idle=True)
    # batch limit
    kv3 = _manager(cfg, num_blocks=200, max_batch=2)
    fp = kv3.store_prefix(pre, 0, frame_index=0)
    _admit(kv3, fp, 3, 5)
    _admit(kv3, fp, 3, 5)
    kv3.release(fp)
    assert kv3.plan_admission([1, 1]) == [("wait", "batch_full"), ("wait", "queued_behind")]


def test_admission_does_not_let_a_smaller_request_overtake(model):
    """FIFO: once a candidate waits for memory, every later one waits too, even one that would fit; a candidate too
    large for the whole pool is rejected and does not block the queue."""
    cfg = model.cfg
    kv = _manager(cfg, num_blocks=12, block_size=4)
    held = kv.pool.allocate(4)                         # memory held by others: 8 blocks available
    assert kv.plan_admission([6, 2], shared_prefix_blocks=3) == [("wait", "kv_full"), ("wait", "queued_behind")]
    assert kv.plan_admission([2, 6, 1], shared_prefix_blocks=3) == [None, ("wait", "kv_full"),
                                                                     ("wait", "queued_behind")]
    assert kv.plan_admission([7, 4, 1]) == [None, ("wait", "kv_full"), ("wait", "queued_behind")]
    too_big, small = kv.plan_admission([40, 2], shared_prefix_blocks=3)
    assert too_big[0] == "reject" and too_big[1].startswith("too_large") and small is None
    kv.pool.free(held)
    assert kv.plan_admission([6, 2], shared_prefix_blocks=3) == [None, None]


def test_invariants_catch_corruption(model):
    cfg = model.cfg
    pre = model.prefill(*_inputs(cfg, seed=5), want_logits=True)
    kv = _manager(cfg)
    fp = kv.store_prefix(pre, 0, frame_index=0)
    st = _admit(kv, fp, 6, 5)
    kv.plan_decode([st], [2])
    kv.check_invariants()
    with pytest.raises(AssertionError):
        kv.check_invariants(idle=True)                    # the creator still holds its reference
    kv.release(fp)
    kv.check_invariants(idle=True)
    st.blocks.append(fp.blocks[0])                        # a block owned twice
    with pytest.raises(AssertionError):
        kv.check_invariants()
    st.blocks.pop()
    leaked = kv.pool.allocate(1)                          # allocated but owned by nobody
    with pytest.raises(AssertionError):
        kv.check_invariants()
    kv.pool.free(leaked)
    kv.reserved_blocks += 1
    with pytest.raises(AssertionError):
        kv.check_invariants()
    kv.reserved_blocks -= 1
    kv.finish(st, "length")
    kv.check_invariants(idle=True)
    assert kv.pool.used_blocks == 0
