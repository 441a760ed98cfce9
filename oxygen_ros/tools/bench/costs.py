"""Component costs and the ideal speedup they imply.

This file owns the cost model of ``oxygen bench``: ``measure_components`` times the primitives the engine composes
(one prefill, one action sampling, one batched decode step per batch size) in interleaved rounds, ``combine_costs``
pools the samples of the measurements before and after the runs, and ``ideal`` derives the frame times of isolated /
shared / oxygen with no scheduling overhead at all, ``steady_state_schedule`` giving oxygen's decode batch sizes by
the engine's scheduling rule.
"""
from __future__ import annotations

import math
import time
from typing import Optional

import numpy as np
import torch

from ...engine.requests import LanguageRequest
from ...kv.cache import KVCacheManager
from ...kv.pool import KVPool
from ...model import Observation
from ...model.compiled import CompiledModel
from ...model.pi05 import DecodeBatch


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _median_time(fn, reps: int, device) -> float:
    ts = []
    for _ in range(reps):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


@torch.no_grad()
def measure_components(model, processor, obs: Observation, N: int, S: int, batch_sizes, reps: int = 5,
                       block_size: int = 16, num_blocks: Optional[int] = None, pool: Optional[KVPool] = None) -> dict:
    """Median costs (seconds) of the primitives the engine composes: one prefill (batch 1, with logits), one action
    sampling of S steps (and per step), one batched decode step at each batch size (an int n means 1..n) reading a
    real frame prefix plus ~N/2 private tokens (index building included, as the engine pays it). The samples are
    taken in rounds (prefill, actions, one decode step per batch size, repeated) so that load bursts on a shared
    machine spread over all components alike; raw samples are kept for combine_costs().  ``pool``: a free KV pool
    to use (a compiled run's: its decode graphs are built for it), else one of ``num_blocks`` is made."""
    if isinstance(batch_sizes, int):
        batch_sizes = range(1, batch_sizes + 1)
    batch_sizes = sorted(set(int(b) for b in batch_sizes if b >= 1))
    dev = next(model.parameters()).device
    cfg = model.cfg
    mi = processor.prepare(obs)
    images, im, toks, tm = (mi.images.to(dev), mi.image_masks.to(dev), mi.tokens.to(dev), mi.token_masks.to(dev))
    pre = model.prefill(images, im, toks, tm, want_logits=True)
    noise = torch.randn((1, cfg.action_horizon, cfg.action_dim), generator=torch.Generator().manual_seed(0)).to(dev)
    model.sample_actions(pre, noise, S)
    meas = max(reps, 8)
    warm = max(2, N // 2 - meas // 2)
    total = sum(batch_sizes)
    need = len(batch_sizes) * (pool_blocks(cfg, block_size) + 1) + total * (-(-(warm + meas + 2) // block_size) + 1) + 8
    num_blocks = pool.num_blocks if pool is not None else num_blocks
    if num_blocks is not None and num_blocks < need:
        raise ValueError(f"measure_components needs {need} KV blocks, got {num_blocks}")
    if pool is None:
        pool = KVPool.from_config(cfg, num_blocks=num_blocks or need, block_size=block_size, dtype=model.dtype,
                                  device=dev)
    if isinstance(model, CompiledModel):
        model.warmup(pool)          # cudagraphs: decode graphs are per pool (a no-op for inductor's shape-keyed ones)
    kv = KVCacheManager(pool, max_batch=total)
    plans = {}
    for b in batch_sizes:
        fp = kv.store_prefix(pre, 0, frame_index=0, image_positions=cfg.num_image_tokens)
        rows = [kv.admit(LanguageRequest("subtask", "", warm + meas + 2), fp, shared_len=fp.length, first_token=5,
                         max_new_tokens=warm + meas + 2, eos_token_id=None) for _ in range(b)]
        kv.release(fp)
        plans[b] = [kv.plan_decode(rows, [warm + meas] * b), torch.full((b,), 5, dtype=torch.long, device=dev), rows]

    def step(b):
        plan, ids, _ = plans[b]
        sync(dev)
        t = time.perf_counter()
        pos, w, r, m = kv.step_tensors(plan)
        out = model.decode(DecodeBatch(ids, pos, w, r, m), pool)
        nxt = out.next_ids.tolist()
        dt = time.perf_counter() - t
        kv.commit_step(plan, nxt)
        plans[b][1] = out.next_ids
        return dt

    for b in batch_sizes:                      # private KV grows to ~N/2 tokens before timing (untimed warm-up)
        for _ in range(warm):
            step(b)
    samples = {"prefill_s": [], "actions_s": [], "decode_step_s": {b: [] for b in batch_sizes}}
    for _ in range(meas):
        samples["prefill_s"].append(
            _median_time(lambda: model.prefill(images, im, toks, tm, want_logits=True), 1, dev))
        samples["actions_s"].append(_median_time(lambda: model.sample_actions(pre, noise, S), 1, dev))
        for b in batch_sizes:
            samples["decode_step_s"][b].append(step(b))
    for b in batch_sizes:
        for st in plans[b][2]:
            kv.finish(st, "length")
    kv.check_invariants(idle=True)
    out = _costs_from_samples(samples, S)
    out.update({"samples": samples, "prefix_valid_tokens": int(pre.mask[0].sum()), "prefix_positions": pre.length})
    return out


def _costs_from_samples(samples: dict, S: int) -> dict:
    med = lambda xs: float(np.median(xs))  # noqa: E731
    return {"prefill_s": med(samples["prefill_s"]), "actions_s": med(samples["actions_s"]),
            "denoise_step_s": med(samples["actions_s"]) / S,
            "decode_step_s": {b: med(v) for b, v in samples["decode_step_s"].items()}}


def combine_costs(a: dict, b: dict, S: int) -> dict:
    """Medians over the samples of both measurements (before and after the runs)."""
    sa, sb = a["samples"], b["samples"]
    pooled = {"prefill_s": sa["prefill_s"] + sb["prefill_s"], "actions_s": sa["actions_s"] + sb["actions_s"],
              "decode_step_s": {k: sa["decode_step_s"][k] + sb["decode_step_s"][k] for k in sa["decode_step_s"]}}
    out = dict(a)
    out.update(_costs_from_samples(pooled, S))
    out["samples"] = pooled
    return out


def costs_ms(c: dict) -> dict:
    return {"prefill_ms": c["prefill_s"] * 1e3, "actions_ms": c["actions_s"] * 1e3,
            "decode_step_ms": {b: v * 1e3 for b, v in c["decode_step_s"].items()}}


def pool_blocks(cfg, block_size):
    return -(-cfg.prefix_len // block_size)


def steady_state_schedule(N: int, k: int, frames: Optional[int] = None) -> list:
    """Batch size of each decode call of one steady-state oxygen cycle (one arrival per frame, N tokens each, k tokens
    per request per cycle, token 0 from the prefill), by running the engine's scheduling rule."""
    frames = frames or 3 * math.ceil(N / k) + 3
    active, last = [], []
    for _ in range(frames):
        active.append({"left": N - 1, "this": 1})           # token 0 comes from the prefix logits
        steps = [min(k - r["this"], r["left"]) for r in active]
        last = [sum(1 for s in steps if s > i) for i in range(max(steps, default=0))]
        for r, s in zip(active, steps):
            r["left"] -= max(s, 0)
            r["this"] = 0
        active = [r for r in active if r["left"] > 0]
    return last


def decode_cost(costs: dict, b: int) -> float:
    """Decode step cost at batch b: measured, else linear between the nearest measured sizes (or extrapolated)."""
    d = costs["decode_step_s"]
    if b in d:
        return d[b]
    bs = sorted(d)
    lower = [x for x in bs if x < b]
    upper = [x for x in bs if x > b]
    if lower and upper:
        lo, hi = lower[-1], upper[0]
    elif len(bs) == 1:
        return d[bs[0]]
    else:
        lo, hi = (bs[-2], bs[-1]) if lower else (bs[0], bs[1])
    return d[lo] + (d[hi] - d[lo]) * (b - lo) / (hi - lo)


def ideal(costs: dict, N: int, k: int) -> dict:
    """Frame times the component costs imply (no scheduling overhead at all) and the implied speedups."""
    P, A, d1 = costs["prefill_s"], costs["actions_s"], decode_cost(costs, 1)
    iso = 2 * P + A + (N - 1) * d1
    shared = P + A + (N - 1) * d1
    sched = steady_state_schedule(N, k)
    oxy = P + A + sum(decode_cost(costs, b) for b in sched)
    return {"isolated_frame_s": iso, "shared_frame_s": shared, "oxygen_frame_s": oxy,
            "oxygen_schedule": sched, "speedup_oxygen_vs_isolated": iso / oxy,
            "speedup_shared_vs_isolated": iso / shared}
