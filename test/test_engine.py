"""Tests of engine/engine.py (with requests.py, budget.py, metrics.py) on the real tiny model, CPU, behaviour only
(never timing): isolated, shared and oxygen give the same action chunks (one per frame, in order) and, for every
request, the same tokens and the same decode logits (fp32, <= 1e-5 relative; masked camera slots, arrivals at
different frames, different prompt lengths and kinds, N not divisible by k, early EOS, greedy and seeded sampling,
both prefix-attention modes); oxygen's batched decode equals the naive reference of ``pi05_reference.py``; continuous
batching runs at batch ceil(N/k), finishes each request ceil(N/k) frames after arrival with the tokens and logits of an
uninterrupted decode; finished requests emit and write nothing; oxygen prefills once per frame and isolated at least
twice; in every cycle the action chunk is published before any language work; capacity limits queue (first in,
first out, also behind a request waiting for memory) or reject requests without touching actions and usage returns to
zero; submit() is thread-safe with a bounded queue; a failing cycle frees what it allocated; adaptive k keeps
language progressing and counts deadline misses; metrics are a flat JSON dict; KV use is flat over 1,000 frames and
its peak stays within 1.2x the live tokens."""
import json
import math
import threading

import numpy as np
import pytest
import torch

from oxygen_ros.engine.engine import Engine, EngineConfig
from oxygen_ros.model import Observation, Processor, build_model, get_config, load_tokenizer
from oxygen_ros.model.pi05 import SamplingParams
from pi05_reference import reference_greedy


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def small_cfg(**kw):
    base = dict(vision={"image_size": 64, "patch_size": 16}, max_token_len=64, num_denoise_steps=3)
    base.update(kw)
    return get_config("tiny", **base)


@pytest.fixture(scope="module")
def setup():
    cfg = small_cfg()
    model = build_model(cfg, seed=0)
    return model, Processor(cfg, load_tokenizer(cfg))


@pytest.fixture(scope="module")
def setup_upstream():
    cfg = small_cfg(prefix_attention="upstream")
    model = build_model(cfg, seed=1)
    return model, Processor(cfg, load_tokenizer(cfg))


def frames(cfg, n, seed=0, masked=None):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        imgs = [rng.integers(0, 256, (cfg.image_size, cfg.image_size, 3), dtype=np.uint8)
                for _ in range(cfg.num_cameras)]
        if masked and i in masked:
            imgs[masked[i]] = None
        out.append(Observation(images=imgs, state=rng.uniform(-1, 1, 2), prompt="stack it", stamp=float(i)))
    return out


def noises(cfg, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, cfg.action_horizon, cfg.action_dim, generator=g) for _ in range(n)]


class Run:
    """Drives an engine over frames with a submission schedule and records everything it emits: ``log`` holds
    ("cycle", i) before each cycle and ("action", frame) / ("token", rid) / ("finished", rid) in emission order;
    ``progress`` holds per cycle the tokens generated so far by each in-flight request at the cycle's start and when
    its action chunk was published; ``logits`` the decode logits of each request's tokens 1.. (``DecodeSpy``)."""

    def __init__(self, model, proc, schedule, obs, nz, drain=True, **cfg):
        self.log, self.actions, self.results, self.tokens, self.stats, self.progress = [], [], {}, {}, [], []
        self.spy = DecodeSpy(model)
        self.eng = Engine(self.spy, proc, EngineConfig(**cfg), on_actions=self._act, on_token=self._tok,
                          on_finished=self._fin)
        self.ids, self.cycle = [], 0
        for i, (o, n) in enumerate(zip(obs, nz)):
            for sub in schedule.get(i, []):
                self.ids.append(self.eng.submit(*sub))
            self._step(o, n)
        while drain and (self.eng.kv.num_active or self.eng.pending()):
            self._step(obs[-1], None)

    def _generated(self):
        return {rid: len(st.generated) for rid, st in self.eng.kv.requests.items()}

    def _step(self, o, n):
        self.log.append(("cycle", self.cycle))
        self.progress.append({"start": self._generated()})
        self.stats.append(self.eng.cycle(o, noise=n))
        self.eng.kv.check_invariants(idle=True)
        self.cycle += 1

    def _act(self, a):
        self.log.append(("action", a.frame_index))
        self.actions.append(a)
        self.progress[-1]["at_actions"] = self._generated()

    def _tok(self, t):
        self.log.append(("token", t.request_id))
        self.tokens.setdefault(t.request_id, []).append(t)
        self.spy.attribute(t)

    def _fin(self, r):
        self.log.append(("finished", r.request_id))
        self.results[r.request_id] = (r, self.cycle)

    def cycles(self):
        """The log split per cycle (markers removed)."""
        out = []
        for e in self.log:
            if e[0] == "cycle":
                out.append([])
            else:
                out[-1].append(e)
        return out

    def carried_tokens(self, i):
        """Token events of cycle i from requests already in flight when it started."""
        carried = set(self.progress[i]["start"])
        return [e for e in self.cycles()[i] if e[0] == "token" and e[1] in carried]

    def outputs(self):
        return [(self.results[i][0].token_ids, self.results[i][0].finish_reason) for i in self.ids]

    def logits(self):
        """Per request in submission order: its decode logits [n_tokens - 1, V] (tokens 1..; token 0 comes from the
        prefill)."""
        return [torch.stack(self.spy.logits[i]) if self.spy.logits.get(i) else None for i in self.ids]


class DecodeSpy:
    """Wraps the model (the engine sees the same object otherwise): keeps the logits rows of each ``decode`` call and
    hands them to the token events that follow, in order.  The engine streams one event per decoded row, in batch
    order, before its next decode call; a row left unclaimed, a claim with no row, or a greedy row whose argmax is
    not the streamed token fails the test."""

    def __init__(self, model):
        self._model = model
        self._rows = []
        self.logits = {}

    def __getattr__(self, name):
        return getattr(self._model, name)

    def decode(self, batch, kv):
        assert not self._rows, f"{len(self._rows)} decoded rows were never streamed"
        out = self._model.decode(batch, kv)
        greedy = [sp is None or sp.temperature <= 0 for sp in (batch.sampling or [None] * len(batch.token_ids))]
        self._rows = list(zip(out.logits.clone(), greedy))
        return out

    def attribute(self, ev):
        if ev.index == 0:
            return                       # token 0 is chosen from the prefill's logits, not by decode
        assert self._rows, f"token {ev.index} of request {ev.request_id} without a decoded row"
        row, greedy = self._rows.pop(0)
        assert not greedy or int(row.argmax()) == ev.token_id
        self.logits.setdefault(ev.request_id, []).append(row)


SCHEDULE = {0: [("subtask", "", 7)], 1: [("conversation", "what is on the table?", 5)],
            2: [("subtask", "", 7), ("memory", "the red cup", 4)], 4: [("conversation", "go left", 7)],
            5: [("subtask", "", 2)]}


def rel_err(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


def _assert_same(runs, n_frames):
    """Every run published one chunk per frame, in order, with the same actions, and gave every request the same
    tokens, finish reason and decode logits (fp32, <= 1e-5 relative: a row decoded at a wrong position or against a
    wrong read mask moves the logits even where the argmax survives)."""
    base = runs[0]
    for r in runs[1:]:
        assert [a.frame_index for a in r.actions[:n_frames]] == [a.frame_index for a in base.actions[:n_frames]] \
            == list(range(n_frames))
        for a, b in zip(base.actions[:n_frames], r.actions[:n_frames]):
            assert a.actions.shape == b.actions.shape
            np.testing.assert_allclose(b.actions, a.actions, rtol=1e-5, atol=1e-6)
        assert r.outputs() == base.outputs()
        for i, (la, lb) in enumerate(zip(base.logits(), r.logits())):
            assert (la is None) == (lb is None), i
            if la is not None:
                assert la.shape == lb.shape and rel_err(lb, la) <= 1e-5, (i, rel_err(lb, la))


@pytest.mark.parametrize("sampling", [None, SamplingParams(temperature=20.0, seed=11)], ids=["greedy", "sampled"])
def test_modes_agree_image_isolated(setup, sampling):
    model, proc = setup
    cfg = model.cfg
    obs, nz = frames(cfg, 6, masked={2: 1, 4: 0}), noises(cfg, 6)
    runs = [Run(model, proc, SCHEDULE, obs, nz, mode=m, decode_k=3, sampling=sampling, kv_block_size=8)
            for m in ("isolated", "shared", "oxygen")]
    _assert_same(runs, 6)
    outs = runs[0].outputs()
    assert [len(t) for t, _ in outs] == [7, 5, 7, 4, 7, 2] and all(r == "length" for _, r in outs)
    if sampling is not None:
        assert len({t for toks, _ in outs for t in toks}) > 10          # real, varied tokens
    iso, sh, ox = (r.stats for r in runs)
    assert [s["prefills"] for s in ox[:6]] == [1] * 6
    assert [s["prompt_extends"] for s in ox[:6]] == [0, 1, 1, 0, 1, 0]   # other prompts extend the image KV
    assert all(s["prefills"] >= 2 for i, s in enumerate(iso[:6]) if SCHEDULE.get(i))
    assert [s["prefills"] for s in sh[:6]] == [1] * 6
    for r in runs:
        assert r.eng.pool.used_blocks == 0 and r.eng.kv.reserved_blocks == 0 and not r.eng.kv.prefixes


def test_modes_agree_upstream(setup_upstream):
    model, proc = setup_upstream
    cfg = model.cfg
    obs, nz = frames(cfg, 6, seed=3, masked={1: 2}), noises(cfg, 6, seed=3)
    runs = [Run(model, proc, SCHEDULE, obs, nz, mode=m, decode_k=2, kv_block_size=8,
                sampling=SamplingParams(temperature=20.0, seed=5)) for m in ("isolated", "shared", "oxygen")]
    _assert_same(runs, 6)
    ox = runs[2].stats
    # subtask shares the frame prefix; other prompts need their own (batched) prefill in upstream mode
    assert [s["prefills"] for s in ox[:6]] == [1, 2, 2, 1, 2, 1]
    assert all(s["prompt_extends"] == 0 for s in ox)


def test_early_eos_and_finished_requests_are_silent(setup):
    model, proc = setup
    cfg = model.cfg
    sp = SamplingParams(temperature=20.0, seed=3)
    sched = {i: [("subtask", "", 9)] if i % 2 == 0 else [("conversation", "q" * (1 + 3 * i), 9)] for i in range(6)}
    obs, nz = frames(cfg, 6, seed=7), noises(cfg, 6, seed=7)
    ref = Run(model, proc, sched, obs, nz, mode="oxygen", decode_k=4, sampling=sp).outputs()
    # an EOS id that some requests produce mid-way (index >= 2) -> they must stop right there
    cands = [toks[2] for toks, _ in ref if toks[2] not in toks[:2]]
    assert cands, ref
    eos = cands[0]
    expect = []
    for toks, _ in ref:
        cut = toks.index(eos) if eos in toks else None
        expect.append((toks[:cut + 1], "eos") if cut is not None else (toks, "length"))
    assert any(r == "eos" and len(t) < 9 for t, r in expect)
    runs = [Run(model, proc, sched, obs, nz, mode=m, decode_k=4, sampling=sp, eos_token_id=eos)
            for m in ("isolated", "shared", "oxygen")]
    _assert_same(runs, 6)
    assert runs[2].outputs() == expect
    for r in runs:
        # each request streamed exactly its tokens, once, final flag on the last, nothing after finishing
        for rid in r.ids:
            res, _ = r.results[rid]
            ev = r.tokens[rid]
            assert [e.index for e in ev] == list(range(len(res.token_ids)))
            assert [e.token_id for e in ev] == res.token_ids
            assert [e.is_final for e in ev] == [False] * (len(ev) - 1) + [True]
            last_tok = max(i for i, x in enumerate(r.log) if x == ("token", rid))
            assert r.log.index(("finished", rid)) > last_tok
            assert ("token", rid) not in r.log[r.log.index(("finished", rid)):]
        # no finished row ever entered a decode batch (so none wrote KV): rows decoded == tokens after token 0
        decoded_rows = sum(s["decode_rows"] for s in r.stats)
        assert decoded_rows == sum(len(res.token_ids) - 1 for res, _ in r.results.values())
        assert r.eng.pool.used_blocks == 0


@pytest.mark.parametrize("N,k", [(7, 3), (6, 3), (5, 1)])
def test_continuous_batching_invariants(setup, N, k):
    model, proc = setup
    cfg = model.cfg
    F = 9
    obs, nz = frames(cfg, F, seed=2), noises(cfg, F, seed=2)
    sched = {i: [("subtask", "", N)] for i in range(F)}
    run = Run(model, proc, sched, obs, nz, drain=False, mode="oxygen", decode_k=k)
    frames_per_req = math.ceil(N / k)
    for j, rid in enumerate(run.ids):
        if rid in run.results:
            res, cyc = run.results[rid]
            assert res.frame_index == j and res.finish_reason == "length" and len(res.token_ids) == N
            assert cyc == j + frames_per_req - 1         # finished during cycle j + ceil(N/k) - 1
    done = [j for j, rid in enumerate(run.ids) if rid in run.results]
    assert done == list(range(F - frames_per_req + 1))
    steady = run.stats[frames_per_req:]
    # batch N/k: every request in flight decodes together (with k=1 the newest one's token is its prefill token)
    assert all(s["batch_size_max"] == (frames_per_req if k > 1 else frames_per_req - 1) for s in steady)
    assert all(s["tokens"] == N for s in steady)           # N tokens decoded per frame in steady state
    assert all(s["active_requests"] == frames_per_req - 1 for s in steady)
    assert all(s["prefills"] == 1 for s in run.stats)
    # chunked across frames and batched with other requests = decoded alone, uninterrupted: tokens and logits
    alone = Run(model, proc, sched, obs, nz, drain=False, mode="shared")
    for rid, logits, rid_alone, logits_alone in zip(run.ids, run.logits(), alone.ids, alone.logits()):
        if rid in run.results:
            assert run.results[rid][0].token_ids == alone.results[rid_alone][0].token_ids
            assert logits.shape == (N - 1, cfg.vocab_size) and rel_err(logits, logits_alone) <= 1e-5
    iso = Run(model, proc, sched, obs[:3], nz[:3], mode="isolated", decode_k=k)
    assert all(s["prefills"] == 2 for s in iso.stats) and all(s["decode_steps"] == N - 1 for s in iso.stats)


def test_batched_decode_equals_the_naive_reference(setup):
    """oxygen's chunked, batched decode (rows of different frames, kinds, prompt lengths and steps; a masked camera;
    private prompts on the shared image KV) gives every request the tokens and logits of the naive reference: a full
    recompute of [its frame's images | its prompt | its generated tokens], no cache, none of the engine's code."""
    model, proc = setup
    cfg = model.cfg
    obs, nz = frames(cfg, 3, seed=12, masked={1: 2}), noises(cfg, 3, seed=12)
    sched = {0: [("subtask", "", 6), ("conversation", "what is red?", 5)],
             1: [("memory", "the cup", 6), ("subtask", "", 4)], 2: [("conversation", "go", 5)]}
    run = Run(model, proc, sched, obs, nz, mode="oxygen", decode_k=2)
    assert max(s["batch_size_max"] for s in run.stats) >= 3          # rows of several frames decoded together
    for rid, logits in zip(run.ids, run.logits()):
        res = run.results[rid][0]
        mi = proc.prepare(obs[res.frame_index])
        if res.kind == "subtask":                                     # reads the frame's own action prompt
            tokens, tmask = mi.tokens[0], mi.token_masks[0]
        else:
            toks, mask, _ = proc.encode_prompt(res.kind, res.prompt)
            tokens = toks[0][mask[0]]
            tmask = torch.ones_like(tokens, dtype=torch.bool)
        ref_ids, ref_logits = reference_greedy(model, mi.images[0], mi.image_masks[0], tokens, tmask,
                                               len(res.token_ids))
        assert res.token_ids == ref_ids, res.kind
        assert rel_err(logits, ref_logits[1:]) <= 1e-5, (res.kind, rel_err(logits, ref_logits[1:]))


def test_actions_published_before_language_work_in_every_cycle(setup):
    """In every cycle (not only the first), with requests of earlier frames in flight, the frame's chunk is the first
    thing emitted and no request has decoded a token of this cycle when it is published."""
    model, proc = setup
    cfg = model.cfg
    F = 6
    obs, nz = frames(cfg, F, seed=4), noises(cfg, F, seed=4)
    sched = {i: [("subtask", "", 6), ("conversation", "hi", 6)] for i in range(F)}
    for mode in ("isolated", "shared", "oxygen"):
        run = Run(model, proc, sched, obs, nz, mode=mode, decode_k=2)
        for i, events in enumerate(run.cycles()):
            assert [e[0] for e in events].count("action") == 1 and events[0][0] == "action", (mode, i, events[:3])
            p = run.progress[i]
            assert p["at_actions"] == p["start"], (mode, i)           # nothing decoded before the chunk
        if mode == "oxygen":          # N=6, k=2: each request spans 3 frames, so earlier frames' requests are in flight
            carried = [p["start"] for p in run.progress[1:F]]
            assert all(len(c) >= 2 for c in carried), carried
            assert all(run.carried_tokens(i) for i in range(1, F))       # ...and they do decode after the chunk
        for a, s in zip(run.actions, run.stats):
            assert a.actions.shape == (cfg.action_horizon, proc.action_dims)
            assert 0 < a.latency_ms <= s["duration_s"] * 1e3
        assert [a.chunk_id for a in run.actions] == list(range(run.cycle))
        assert [a.stamp for a in run.actions] == [float(i) for i in range(F)] + [float(F - 1)] * (run.cycle - F)


def test_capacity_queues_and_rejects_without_touching_actions(setup):
    model, proc = setup
    cfg = model.cfg
    F = 5
    obs, nz = frames(cfg, F, seed=5), noises(cfg, F, seed=5)
    alone = Run(model, proc, {}, obs, nz, mode="oxygen")
    # room for the frame prefixes of ~2 requests only
    n_prefix = math.ceil((3 * cfg.image_tokens_per_camera + 40) / 8)
    sched = {i: [("subtask", "", 10)] for i in range(F)}
    sched[1] = sched[1] + [("conversation", "too long", 100_000)]
    run = Run(model, proc, sched, obs, nz, mode="oxygen", decode_k=2, kv_block_size=8,
              kv_num_blocks=2 * n_prefix + 6, max_batch=2)
    for a, b in zip(alone.actions, run.actions[:F]):
        np.testing.assert_array_equal(a.actions, b.actions)
    outs = [run.results[i][0] for i in run.ids]
    rejected = [r for r in outs if r.finish_reason == "rejected"]
    assert len(rejected) == 1 and rejected[0].detail.startswith("too_large") and rejected[0].frame_index == -1
    served = [r for r in outs if r.finish_reason == "length"]
    assert len(served) == F and all(len(r.token_ids) == 10 for r in served)
    assert max(s["active_requests"] for s in run.stats) <= 2
    assert any(s["pending"] > 0 for s in run.stats)               # some requests had to wait
    waited = [r.frame_index for r in served]
    assert waited != list(range(F)) and waited == sorted(waited)  # FIFO, bound to a later frame
    m = run.eng.metrics()
    assert m["requests_rejected"] == 1 and m["kv_bytes_in_use"] == 0 and m["kv_blocks_reserved"] == 0
    assert m["kv_bytes_peak"] <= m["kv_bytes_capacity"]
    # max_wait_frames: a request that cannot be admitted in time is rejected with the reason
    run2 = Run(model, proc, {0: [("subtask", "", 30), ("subtask", "", 3)]}, obs[:2], nz[:2], mode="oxygen",
               max_batch=1, max_wait_frames=1)
    r2 = run2.results[run2.ids[1]][0]
    assert r2.finish_reason == "rejected" and r2.detail.startswith("max_wait")


def test_admission_stays_in_order_behind_a_request_waiting_for_memory(setup):
    """A big request that must wait for KV memory holds back a later, smaller one that would fit (no overtaking);
    once memory is free both are admitted in submission order."""
    model, proc = setup
    cfg = model.cfg
    obs, nz = frames(cfg, 8, seed=11), noises(cfg, 8, seed=11)
    bs, k = 8, 4
    blocks = lambda n: -(-n // bs)                                          # noqa: E731
    P = blocks(cfg.num_image_tokens + int(proc.prepare(obs[0]).token_masks.sum()))   # one frame prefix
    NA, NB, NC = 17, 41, 9
    a, b, c = blocks(NA - 1), blocks(NB - 1), blocks(NC - 1)                # private blocks (N - 1 written tokens)
    total = 2 * P + a + c            # while A lives: room for a 2nd frame prefix + C exactly, not for B (b > c)
    assert b > c and P + b <= total
    sched = {0: [("subtask", "", NA)], 1: [("subtask", "", NB), ("subtask", "", NC)]}
    run = Run(model, proc, sched, obs, nz, mode="oxygen", decode_k=k, kv_block_size=bs, kv_num_blocks=total)
    (ra, _), (rb, _), (rc, _) = (run.results[i] for i in run.ids)
    assert [r.finish_reason for r in (ra, rb, rc)] == ["length"] * 3 and len(rb.token_ids) == NB
    a_done = run.results[run.ids[0]][1]                                     # the cycle in which A finished
    assert run.stats[1]["pending"] == 2                                     # B waited (kv_full) and C behind it
    assert rb.frame_index == rc.frame_index == a_done + 1                   # C did not overtake B
    id_b, id_c = run.ids[1:]
    assert run.log.index(("token", id_b)) < run.log.index(("token", id_c))   # admitted B first: its token 0 first
    assert run.eng.pool.used_blocks == 0


def test_submit_is_thread_safe_and_bounded(setup):
    model, proc = setup
    cfg = model.cfg
    results = []
    eng = Engine(model, proc, EngineConfig(mode="oxygen", decode_k=2, max_new_tokens=3, max_pending=4),
                 on_finished=results.append)
    obs = frames(cfg, 1, seed=6)[0]
    ids, stop = [], threading.Event()

    def producer():
        for i in range(120):
            ids.append(eng.submit("conversation" if i % 3 else "subtask", f"question {i}"))
        stop.set()

    th = threading.Thread(target=producer)
    th.start()
    n = 0
    while not stop.is_set() or eng.kv.num_active or eng.pending():
        eng.cycle(obs)
        n += 1
        assert n < 500
    th.join()
    eng.cycle(obs)                                     # report drops that happened after the last cycle
    eng.kv.check_invariants(idle=True)
    assert len(set(ids)) == 120
    got = {r.request_id: r for r in results}
    assert set(got) == set(ids)                        # every request accounted for exactly once
    reasons = {r.finish_reason for r in got.values()}
    assert reasons <= {"length", "eos", "dropped"}
    m = eng.metrics()
    assert m["requests_submitted"] == 120
    assert m["requests_dropped"] == sum(r.finish_reason == "dropped" for r in got.values())
    assert eng.pool.used_blocks == 0


def test_failed_cycle_frees_its_allocations(setup):
    model, proc = setup
    cfg = model.cfg
    obs, nz = frames(cfg, 6, seed=8), noises(cfg, 6, seed=8)
    seen, results = [], []

    def on_token(ev):
        seen.append(ev)
        if len(seen) == 9:
            raise RuntimeError("subscriber failed")

    eng = Engine(model, proc, EngineConfig(mode="oxygen", decode_k=3, max_new_tokens=6),
                 on_token=on_token, on_finished=results.append)
    raised = 0
    for i in range(4):
        eng.submit("subtask")
        eng.submit("conversation", "why?")
        try:
            eng.cycle(obs[i], noise=nz[i])
        except RuntimeError:
            raised += 1
        eng.kv.check_invariants(idle=True)
    assert raised == 1
    assert any(r.finish_reason == "error" for r in results)
    # a bad observation fails before anything is allocated; its pending requests are kept for the next cycle
    eng.submit("memory", "kept")
    bad = Observation(images=[None], prompt="x")
    with pytest.raises(ValueError):
        eng.cycle(bad)
    eng.kv.check_invariants(idle=True)
    assert eng.pending() == 1
    eng.drain(obs[5])
    eng.kv.check_invariants(idle=True)
    assert eng.pool.used_blocks == 0 and eng.kv.reserved_blocks == 0 and not eng.kv.prefixes
    assert any(r.prompt == "kept" and r.finish_reason == "length" for r in results)
    assert eng.metrics()["requests_cycle_errors"] == 2


def test_adaptive_k(setup):
    model, proc = setup
    cfg = model.cfg
    F = 5
    obs, nz = frames(cfg, F, seed=9), noises(cfg, F, seed=9)
    sched = {i: [("subtask", "", 6)] for i in range(F)}
    tight = Run(model, proc, sched, obs, nz, drain=False, mode="oxygen", decode_k="adaptive", target_period_s=1e-6)
    assert all(s["k"] == 1 for s in tight.stats)                    # always >= 1 step: language keeps moving
    assert all(s["deadline_missed"] for s in tight.stats)
    assert tight.eng.metrics()["deadline_misses"] == F
    loose = Run(model, proc, sched, obs, nz, drain=False, mode="oxygen", decode_k="adaptive", target_period_s=1e3)
    assert loose.eng.metrics()["deadline_misses"] == 0
    assert all(loose.results[rid][1] == j for j, rid in enumerate(loose.ids)
               if j > 0)                                            # once costs are known, done in its frame
    ref = Run(model, proc, sched, obs, nz, mode="shared")
    assert [o for o in loose.outputs()] == ref.outputs()           # same tokens whatever k was chosen
    with pytest.raises(ValueError):
        EngineConfig(decode_k="adaptive")


def test_metrics_flat_json(setup):
    model, proc = setup
    cfg = model.cfg
    obs, nz = frames(cfg, 4, seed=10), noises(cfg, 4, seed=10)
    run = Run(model, proc, {i: [("subtask", "", 4)] for i in range(4)}, obs, nz, mode="oxygen", decode_k=2,
              target_period_s=10.0)
    m = run.eng.metrics()
    json.dumps(m)
    assert all(not isinstance(v, (dict, list)) for v in m.values())
    for key in ("action_hz", "tokens_per_s", "tokens_per_s_total", "cycle_ms_p50", "cycle_ms_p90", "cycle_ms_p99",
                "action_latency_ms_p50", "ttft_ms_p50", "completion_ms_p50", "prefills_per_frame", "batch_size_mean",
                "kv_bytes_in_use", "kv_bytes_peak", "deadline_misses", "requests_finished"):
        assert key in m and m[key] is not None, key
    assert m["frames"] == run.cycle and m["requests_finished"] == 4 and m["tokens_total"] == 16
    assert m["action_hz"] == pytest.approx(cfg.action_horizon * m["frames"] / m["total_time_s"])
    run.eng.reset_metrics()
    assert run.eng.metrics()["frames"] == 0


def test_kv_use_flat_over_1000_frames():
    cfg = get_config("tiny", vision={"image_size": 32, "patch_size": 16}, vlm={"depth": 1}, expert={"depth": 1},
                     max_token_len=32, num_denoise_steps=1)
    model = build_model(cfg, seed=2)
    proc = Processor(cfg, load_tokenizer(cfg))
    rng = np.random.default_rng(0)
    obs = Observation(images=[rng.integers(0, 256, (32, 32, 3), dtype=np.uint8) for _ in range(3)], prompt="go")
    eng = Engine(model, proc, EngineConfig(mode="oxygen", decode_k=2, max_new_tokens=7, kv_block_size=4))
    used, peaks = [], []
    for i in range(1000):
        eng.submit("subtask")
        if i % 10 == 0:
            eng.submit("conversation", "x" * (i % 7))
        eng.cycle(obs)
        used.append(eng.pool.used_blocks)
        peaks.append(eng.pool.peak_used_blocks)
    eng.kv.check_invariants(idle=True)
    assert max(used[100:]) == max(used[20:100])                   # no growth after warm-up
    assert peaks[-1] == peaks[100]
    assert eng.pool.peak_tokens <= 1.2 * eng.kv.peak_live_tokens
    same = Engine(model, proc, EngineConfig(kv_block_size=4, max_new_tokens=7))
    assert eng.pool.num_blocks == same.pool.num_blocks                # preallocated, never grown
    eng.drain(obs)
    assert eng.pool.used_blocks == 0
