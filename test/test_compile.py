"""Tests of model/compiled.py and ``EngineConfig.compile``: the ``inductor`` engine gives the same action chunks
(fp32, <= 1e-5) and the same tokens and decode logits as the eager engine, in isolated / shared / oxygen and both
prefix-attention modes, with masked cameras, N not divisible by k, requests finishing early (length 2 of 7), batch
sizes crossing bucket boundaries (3 rows run in the 4-row graph, 1 and 2 in their own), greedy and seeded sampling;
every graph compiles with ``fullgraph=True`` (a graph break is a compile error, reported in ``compile_error``) and,
once warmed, no call of a run falls back to eager (``eager_calls`` stays empty: the shapes really are static); the
padding rules (prompt to the fixed length, batch to the bucket, reads to max_context) are exact for the valid rows;
a model that cannot be compiled falls back to eager with a warning and still serves; ``compile: none`` is the model
itself.  The graphs are compiled once per test session (small ``tiny`` variant; the wrapper is cached on the model and
shared by every engine over it), which keeps this file to a few minutes on 2 CPU cores.
"""
import numpy as np
import pytest
import torch

from oxygen_ros.engine.engine import Engine, EngineConfig
from oxygen_ros.kv.pool import KVPool
from oxygen_ros.model import Processor, build_model, load_tokenizer
from oxygen_ros.model.compiled import CompiledModel, batch_buckets, resolve_compile, resolve_device
from oxygen_ros.model.pi05 import DecodeBatch, SamplingParams
from test_engine import SCHEDULE, Run, _assert_same, frames, noises, small_cfg

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_BATCH = 4
NUM_BLOCKS = 160
BLOCK = 8
SAMPLED = SamplingParams(temperature=20.0, seed=11)
SCHED = {**SCHEDULE, 3: [("memory", "a blue box", 6)]}     # up to 3 and 4 rows in flight at once


def _warmed(model, proc, sampled=False):
    """The session's compiled wrapper for ``model``, built the way an engine builds it (compile_model caches it on the
    model, so every engine below with the same shapes gets this one) and warmed once."""
    eng = Engine(model, proc, EngineConfig(compile="inductor", max_batch=MAX_BATCH, kv_block_size=BLOCK,
                                           kv_num_blocks=NUM_BLOCKS, sampling=SAMPLED if sampled else None))
    st = eng.warmup()
    cm = eng.model
    assert isinstance(cm, CompiledModel) and st["compile_error"] == "" and cm.mode == "inductor"
    return cm


@pytest.fixture(scope="session")
def iso():
    cfg = small_cfg()
    model = build_model(cfg, seed=0)
    proc = Processor(cfg, load_tokenizer(cfg))
    return model, proc, _warmed(model, proc, sampled=True)


@pytest.fixture(scope="session")
def upstream():
    cfg = small_cfg(prefix_attention="upstream")
    model = build_model(cfg, seed=1)
    proc = Processor(cfg, load_tokenizer(cfg))
    return model, proc, _warmed(model, proc)


def _runs(model, proc, cm, mode, sampling=None, n=6):
    cfg = model.cfg
    obs, nz = frames(cfg, n, masked={2: 1, 4: 0}), noises(cfg, n)
    common = dict(mode=mode, decode_k=3, sampling=sampling, kv_block_size=BLOCK, kv_num_blocks=NUM_BLOCKS,
                  max_batch=MAX_BATCH)
    before = dict(cm.eager_calls)
    eager = Run(model, proc, SCHED, obs, nz, **common)
    compiled = Run(cm, proc, SCHED, obs, nz, **common)
    assert cm.eager_calls == before, f"calls fell back to eager: {cm.eager_calls}"
    return eager, compiled


@pytest.mark.parametrize("mode", ["isolated", "shared", "oxygen"])
def test_compiled_equals_eager_image_isolated(iso, mode):
    model, proc, cm = iso
    eager, compiled = _runs(model, proc, cm, mode)
    _assert_same([eager, compiled], 6)
    outs = compiled.outputs()
    assert [len(t) for t, _ in outs] == [7, 5, 7, 4, 6, 7, 2]
    sizes = {s["batch_size_max"] for s in compiled.stats}
    if mode == "oxygen":
        assert 3 in sizes, sizes                     # a 3-row batch ran in the 4-row graph


@pytest.mark.parametrize("mode", ["isolated", "shared", "oxygen"])
def test_compiled_equals_eager_upstream(upstream, mode):
    model, proc, cm = upstream
    eager, compiled = _runs(model, proc, cm, mode)
    _assert_same([eager, compiled], 6)


def test_compiled_seeded_sampling_equals_eager(iso):
    model, proc, cm = iso
    eager, compiled = _runs(model, proc, cm, "oxygen", sampling=SAMPLED)
    _assert_same([eager, compiled], 6)
    assert any(len(set(t)) > 1 for t, _ in compiled.outputs())          # really sampled, not greedy


def test_graph_keys_cover_buckets(iso, upstream):
    _, _, cm = iso
    keys = set(cm._graphs)
    T = cm.max_context
    assert {("decode", b, T, "any") for b in (1, 2, 4)} <= keys         # inductor: one set for every pool
    assert {("decode_sampled", b, T, "any") for b in (1, 2, 4)} <= keys
    assert {("extend", b, cm.cfg.max_token_len) for b in (1, 2, 4)} <= keys
    assert ("actions", cm.cfg.prefix_len, cm.S) in keys
    _, _, cu = upstream
    assert {("prefill", b, cu.cfg.max_token_len) for b in (1, 2, 4)} <= set(cu._graphs)
    assert batch_buckets(6) == (1, 2, 4, 6) and batch_buckets(16) == (1, 2, 4, 8, 16) and batch_buckets(1) == (1,)


def test_padding_is_exact_for_valid_rows(iso):
    """A decode whose context is longer than max_context, and one more row than the largest bucket, run eagerly
    (counted) and agree; a padded decode writes only the real rows' slots."""
    model, _, cm = iso
    pool = KVPool.from_config(model.cfg, num_blocks=NUM_BLOCKS, block_size=BLOCK, dtype=model.dtype)
    g = torch.Generator().manual_seed(0)
    for t in pool.k + pool.v:
        t.copy_(torch.randn(t.shape, generator=g))
    B, T = 3, 40
    batch = DecodeBatch(torch.tensor([5, 6, 7]), torch.tensor([40, 41, 42]), torch.tensor([900, 901, 902]),
                        torch.randint(0, 800, (B, T), generator=g), torch.rand(B, T, generator=g) < 0.8)
    batch.read_slots[:, -1] = batch.write_slots
    batch.read_mask[:, -1] = True
    snapshot = [t.clone() for t in pool.k]
    ref = model.decode(batch, pool)
    after_eager = [t.clone() for t in pool.k]
    for t, s in zip(pool.k, snapshot):
        t.copy_(s)
    n0 = sum(cm.eager_calls.values())
    out = cm.decode(batch, pool)
    assert sum(cm.eager_calls.values()) == n0            # ran in the 4-row graph
    assert torch.equal(out.next_ids, ref.next_ids)
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-5, atol=1e-5)
    for a, b in zip(pool.k, after_eager):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)        # same writes, nothing else touched
    long = DecodeBatch(batch.token_ids, batch.positions, batch.write_slots,
                       torch.zeros(B, cm.max_context + 1, dtype=torch.long), torch.ones(B, cm.max_context + 1,
                                                                                     dtype=torch.bool))
    cm.decode(long, pool)
    assert sum(cm.eager_calls.values()) == n0 + 1


def test_engine_compile_setting_and_fallback(iso):
    """compile='inductor' through EngineConfig: warmup() reuses the session's graphs; a model that cannot be traced
    (a layer with a graph break, here a hook: an error under fullgraph=True) falls back to eager with a warning and
    the engine still serves, with the same chunks as eager."""
    model, proc, cm = iso
    cfg = model.cfg
    eng = Engine(model, proc, EngineConfig(compile="inductor", max_batch=MAX_BATCH, kv_block_size=BLOCK,
                                           kv_num_blocks=NUM_BLOCKS, sampling=SAMPLED))
    assert eng.model is cm
    st = eng.warmup()
    assert st["compile"] == "inductor" and st["compile_graphs"] == len(cm._graphs) and st["compile_error"] == ""
    assert Engine(model, proc, EngineConfig()).model is model         # compile: none = the model itself

    bcfg = small_cfg(max_token_len=48)       # own shapes: graphs of same-shaped models are shared (params are inputs)
    broken, bproc = build_model(bcfg, seed=0), Processor(bcfg, load_tokenizer(bcfg))
    h = broken.vision.register_forward_pre_hook(lambda mod, args: torch._dynamo.graph_break())
    eng2 = Engine(broken, bproc, EngineConfig(compile="inductor", max_batch=2, kv_block_size=BLOCK,
                                             kv_num_blocks=NUM_BLOCKS))
    with pytest.warns(UserWarning, match="running eagerly"):
        st2 = eng2.warmup()
    assert st2["compile"] == "none" and st2["compile_requested"] == "inductor" and st2["compile_error"]
    got = []
    eng2.on_actions = got.append
    obs, nz = frames(bcfg, 2), noises(bcfg, 2)
    for o, n in zip(obs, nz):
        eng2.cycle(o, noise=n)
    h.remove()
    ref = []
    eng3 = Engine(broken, bproc, EngineConfig(max_batch=2, kv_block_size=BLOCK, kv_num_blocks=NUM_BLOCKS),
                  on_actions=ref.append)
    for o, n in zip(obs, nz):
        eng3.cycle(o, noise=n)
    for a, b in zip(got, ref):
        np.testing.assert_array_equal(a.actions, b.actions)
    assert eng2.metrics()["compile"] == "none"


def test_denoise_step_compiles_alone_and_equals_eager(iso):
    """inductor-graphs compiles one denoise step (fullgraph, one graph for every step) and captures the S-step call
    around it on a GPU; here the same step compiled with inductor and run S times by sample_actions gives the eager
    chunk, and a second call reuses the graph (no recompilation for new step inputs)."""
    model, proc, _ = iso
    cfg = model.cfg
    step = torch.compile(model.denoise_step, fullgraph=True, dynamic=False)
    mi = proc.prepare(frames(cfg, 1)[0])
    graphs = []
    with torch.no_grad():
        prefix = model.prefill(mi.images, mi.image_masks, mi.tokens, mi.token_masks)
        for noise in noises(cfg, 2, seed=5):
            a, b = model.sample_actions(prefix, noise, step=step), model.sample_actions(prefix, noise)
            assert float((a - b).abs().max() / b.abs().max()) <= 1e-5
            graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    assert graphs[0] == graphs[1]                    # the second call's S steps compiled nothing new


@pytest.mark.parametrize("mode", ["cudagraphs", "inductor-graphs"])
def test_graph_modes_on_cpu_use_inductor(mode):
    cfg = small_cfg()
    model = build_model(cfg, seed=3)
    with pytest.warns(UserWarning, match="needs a CUDA device"):
        cm = CompiledModel(model, mode, max_batch=1)
    assert cm.mode == "inductor" and cm.requested == mode
    with pytest.raises(ValueError):
        EngineConfig(compile="tensorrt")


def test_auto_resolves_to_cuda_and_cudagraphs_only_where_cuda_is(iso, monkeypatch):
    """``device: auto`` / ``compile: auto``: CUDA and its fastest measured path (cudagraphs) when CUDA is there, the
    CPU and eager otherwise; an engine built with compile='auto' on the CPU is the model itself (no graphs)."""
    assert resolve_compile("auto", "cuda") == resolve_compile("auto", "cuda:1") == "cudagraphs"
    assert resolve_compile("auto", "cpu") == "none"
    assert resolve_compile("inductor", "cuda") == "inductor" and resolve_device("cpu") == "cpu"
    with pytest.raises(ValueError, match="compile"):
        resolve_compile("tensorrt", "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == resolve_device("") == "cpu" and resolve_compile("auto", "auto") == "none"
    model, proc, _ = iso
    eng = Engine(model, proc, EngineConfig(compile="auto", max_batch=MAX_BATCH, kv_block_size=BLOCK,
                                           kv_num_blocks=NUM_BLOCKS))
    assert eng.model is model and eng.metrics()["compile"] == "none"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == "cuda" and resolve_compile("auto", "auto") == "cudagraphs"


def test_node_parameter_compile_is_validated():
    from oxygen_ros.ros.parameters import PARAMETERS, ConfigureError, Settings
    assert Settings.from_values({}).compile == "auto"                 # CUDA: cudagraphs, else eager (see README)
    assert Settings.from_values({"compile": "inductor"}).compile == "inductor"
    assert PARAMETERS["compile"][3] == ("auto", "none", "inductor", "cudagraphs", "inductor-graphs")
    with pytest.raises(ConfigureError, match="compile"):
        Settings.from_values({"compile": "tensorrt"})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (a GPU check; runs on a lent device)")
@pytest.mark.parametrize("mode", ["cudagraphs", "inductor-graphs"])
def test_cuda_graph_frame_has_no_host_sync_and_equals_eager(mode):
    """On a GPU, a warmed frame's model calls - prefill, the S-step sample_actions (one graph) and a batched decode
    step - replay their CUDA graphs without one host synchronisation (``torch.cuda.set_sync_debug_mode("error")``
    raises on any), and give the eager model's actions and logits.  The engine itself reads back what it must hand
    to the host once per frame and per decode step (the chunk, the next token ids); this covers everything between."""
    from oxygen_ros.engine.requests import LanguageRequest
    from oxygen_ros.kv.cache import KVCacheManager
    cfg = small_cfg()
    model = build_model(cfg, device="cuda", seed=0)
    proc = Processor(cfg, load_tokenizer(cfg))
    eng = Engine(model, proc, EngineConfig(compile=mode, max_batch=MAX_BATCH, kv_block_size=BLOCK,
                                           kv_num_blocks=NUM_BLOCKS))
    st = eng.warmup()
    assert st["compile"] == mode and st["compile_error"] == "" and st["compile_graphs"] > 0
    cm = eng.model
    mi = proc.prepare(frames(cfg, 1)[0])
    args = [t.to("cuda") for t in (mi.images, mi.image_masks, mi.tokens, mi.token_masks)]
    noise = noises(cfg, 1)[0].to("cuda")
    pre = cm.prefill(*args, want_logits=True)
    kv = KVCacheManager(eng.pool, max_batch=MAX_BATCH)
    fp = kv.store_prefix(pre, 0, frame_index=0, image_positions=cfg.num_image_tokens)
    rows = [kv.admit(LanguageRequest("subtask", "", 4), fp, shared_len=fp.length, first_token=5, max_new_tokens=4,
                     eos_token_id=None) for _ in range(3)]
    pos, w, r, m = kv.step_tensors(kv.plan_decode(rows, [1] * 3))
    batch = DecodeBatch(torch.full((3,), 5, dtype=torch.long, device="cuda"), pos, w, r, m)
    cm.sample_actions(pre, noise)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        pre2 = cm.prefill(*args, want_logits=True)
        actions = cm.sample_actions(pre2, noise)
        out = cm.decode(batch, eng.pool)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert cm.eager_calls == {}
    ref = model.sample_actions(model.prefill(*args, want_logits=True), noise)
    assert float((actions - ref).abs().max() / ref.abs().max()) < 1e-4
    assert torch.allclose(pre2.last_logits, pre.last_logits, atol=1e-5) and out.next_ids.shape == (3,)
