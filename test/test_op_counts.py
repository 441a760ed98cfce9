"""Operator counts of the eager hot path as a regression test: the ATen operators one prefill, one denoise step and
one batch-6 decode step dispatch (``oxygen bench``'s ``op_counts``, from the profiler, on the CPU) for the ``tiny``
and ``bench-cpu`` presets, against the bounds recorded here when the fused path landed (issue 27).  ``calls`` counts
the operators the Python code issues (one ``linear`` per fused Q/K/V or gate/up matrix, one
``scaled_dot_product_attention`` per layer, one ``rms_norm`` per norm, no mask or table rebuilt per layer or step);
``ops`` counts leaf operators (what composites such as ``rms_norm`` expand to on this CPU).  A change that splits a
fused kernel, rebuilds something per layer or step, or adds a host-side op fails here with the counts it found; a
change that lowers them should lower the bounds.  A denoise step is measured as the difference between an S = 3 and
an S = 2 ``sample_actions`` (the per-call set-up - bias, RoPE tables, time conditions, modulations - cancels).  The
counts do not depend on timing; they change with the model code and, for ``ops``, with torch's composite operators
(recorded on torch 2.13).
"""
import pytest
import torch

from oxygen_ros.engine.requests import LanguageRequest
from oxygen_ros.kv.cache import KVCacheManager
from oxygen_ros.kv.pool import KVPool
from oxygen_ros.model import DecodeBatch, build_model, get_config
from oxygen_ros.tools.bench.compiled import op_counts

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# preset -> primitive -> (max calls, max ops); before the fused path (commit b221c14): tiny denoise step 168 calls /
# 163.6 ops, decode b6 138 / 118, prefill 189 / 182; bench-cpu 394 / 373, 346 / 286, 389 / 364.
BOUNDS = {
    "tiny": {"denoise_step": (42, 72), "decode_step_b6": (55, 77), "prefill": (107, 144)},
    "bench-cpu": {"denoise_step": (114, 188), "decode_step_b6": (135, 189), "prefill": (191, 286)},
}
BATCH = 6


def counts(preset: str) -> dict:
    cfg = get_config(preset)
    model = build_model(cfg, seed=0)
    g = torch.Generator().manual_seed(0)
    S, L = cfg.image_size, cfg.max_token_len
    args = (torch.rand(1, cfg.num_cameras, 3, S, S, generator=g) * 2 - 1, torch.ones(1, cfg.num_cameras, dtype=bool),
            torch.randint(3, cfg.vocab_size, (1, L), generator=g), torch.arange(L)[None] < L - 7)
    noise = torch.randn(1, cfg.action_horizon, cfg.action_dim, generator=g)
    with torch.no_grad():
        out = {"prefill": op_counts(lambda: model.prefill(*args, want_logits=True), "cpu")}
        prefix = model.prefill(*args, want_logits=True)
        three, two = (op_counts(lambda s=s: model.sample_actions(prefix, noise, s), "cpu") for s in (3, 2))
        out["denoise_step"] = {k: three[k] - two[k] for k in three}
        pool = KVPool.from_config(cfg, num_blocks=-(-prefix.length // 16) + BATCH + 4, block_size=16)
        kv = KVCacheManager(pool, max_batch=BATCH)
        fp = kv.store_prefix(prefix, 0, frame_index=0, image_positions=cfg.num_image_tokens)
        rows = [kv.admit(LanguageRequest("subtask", "", 4), fp, shared_len=fp.length, first_token=5,
                         max_new_tokens=4, eos_token_id=None) for _ in range(BATCH)]
        pos, w, r, m = kv.step_tensors(kv.plan_decode(rows, [1] * BATCH))
        batch = DecodeBatch(torch.full((BATCH,), 5), pos, w, r, m)
        out[f"decode_step_b{BATCH}"] = op_counts(lambda: model.decode(batch, pool), "cpu")
    return out


@pytest.mark.parametrize("preset", sorted(BOUNDS))
def test_eager_operator_counts_stay_within_the_recorded_bounds(preset):
    found = counts(preset)
    over = {name: (found[name]["calls"], found[name]["ops"], bound) for name, bound in BOUNDS[preset].items()
            if found[name]["calls"] > bound[0] or found[name]["ops"] > bound[1]}
    assert not over, f"{preset}: (calls, ops, recorded bound) per primitive: {over}; all counts: {found}"
    assert all(found[name]["calls"] > 0 and found[name]["ops"] > 0 for name in BOUNDS[preset])
