"""`python -m oxygen_ros.tools.bench` (`oxygen bench`): isolated vs shared vs oxygen on one model and one seeded
input stream, back to back in one process. It builds the preset's model (random weights, seeded), synthetic frames
(random images, seeded state and noise) and a language arrival schedule (one request per frame by default; Poisson
arrivals and mixed lengths optional), measures the component costs (prefill, action sampling / denoise step, one
batched decode step per batch size), derives the ideal oxygen-over-isolated speedup they imply, runs each mode with
warm-up excluded, checks that the modes produced the same action chunks and the same tokens, and writes a table,
JSON (with the hardware named) and a PNG (action Hz vs tokens/s per mode, and the k/N sweep when run).
With ``--compile inductor|cudagraphs`` every measurement is taken twice in the same run, eager and compiled, on the
same model and inputs: component costs per step side by side, each mode eager and compiled (interleaved frame by
frame), the compile time per graph, and the dispatched operators per denoise / decode step from the profiler (the
launch-overhead proxy: on a GPU also the CUDA kernels launched); ``--bf16-check`` reports the action difference bf16 vs
fp32 on the same inputs (tiny dims) so a GPU's tolerance is known before one is used.  Imports no ROS.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import socket
import subprocess
import sys
import time
from typing import Optional

# On a CPU shared with other processes, OpenMP's default spin-waiting makes every parallel region wait for
# descheduled threads (measured here: a 220 ms prefill took 4 s). Passive waiting must be chosen before torch loads
# libgomp; an explicit setting by the user wins. Recorded in the results (hardware.omp_wait_policy).
_OMP_PRESET = "OMP_WAIT_POLICY" in os.environ
_TORCH_PRELOADED = "torch" in sys.modules
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from ..engine.engine import Engine, EngineConfig  # noqa: E402
from ..engine.metrics import percentile
from ..engine.requests import LanguageRequest
from ..kv.cache import KVCacheManager
from ..kv.pool import KVPool
from ..model import ByteTokenizer, Observation, Processor, build_model, get_config, load_tokenizer
from ..model.compiled import CompiledModel
from ..model.pi05 import DecodeBatch

PROMPT = "pick up the red block"
QUESTIONS = ["what do you see?", "where is the red block?", "is the gripper open?", "what is next?"]


# ---------------------------------------------------------------------------------------------------------- inputs
def make_frames(cfg, n: int, seed: int, state_dim: int = 7, masked_camera: Optional[int] = None) -> list:
    rng = np.random.default_rng(seed)
    S = cfg.image_size
    frames = []
    for i in range(n):
        imgs = [rng.integers(0, 256, (S, S, 3), dtype=np.uint8) for _ in range(cfg.num_cameras)]
        if masked_camera is not None:
            imgs[masked_camera] = None
        frames.append(Observation(images=imgs, state=rng.uniform(-1, 1, state_dim).astype(np.float32),
                                  prompt=PROMPT, stamp=float(i) / 10.0, frame_index=i))
    return frames


def make_noise(cfg, n: int, seed: int) -> list:
    g = torch.Generator().manual_seed(seed + 1)
    return [torch.randn((1, cfg.action_horizon, cfg.action_dim), generator=g) for _ in range(n)]


def make_arrivals(n: int, seed: int, N: int, arrivals: str = "per-frame", mixed_lengths: bool = False,
                  kinds=("subtask",), rate: float = 1.0) -> list:
    """Per frame, a list of (kind, prompt, max_new_tokens)."""
    rng = np.random.default_rng(seed + 2)
    out, j = [], 0
    for _ in range(n):
        m = 1 if arrivals == "per-frame" else int(rng.poisson(rate))
        row = []
        for _ in range(m):
            kind = kinds[j % len(kinds)]
            prompt = "" if kind == "subtask" else QUESTIONS[j % len(QUESTIONS)]
            n_new = int(rng.integers(max(1, N // 3), 2 * N + 1)) if mixed_lengths else N
            row.append((kind, prompt, n_new))
            j += 1
        out.append(row)
    return out


# ---------------------------------------------------------------------------------------------------------- timing
def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _median_time(fn, reps: int, device) -> float:
    ts = []
    for _ in range(reps):
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


@torch.no_grad()
def measure_components(model, processor, obs: Observation, N: int, S: int, batch_sizes, reps: int = 5,
                       block_size: int = 16, num_blocks: Optional[int] = None) -> dict:
    """Median costs (seconds) of the primitives the engine composes: one prefill (batch 1, with logits), one action
    sampling of S steps (and per step), one batched decode step at each batch size (an int n means 1..n) reading a
    real frame prefix plus ~N/2 private tokens (index building included, as the engine pays it). The samples are
    taken in rounds (prefill, actions, one decode step per batch size, repeated) so that load bursts on a shared
    machine spread over all components alike; raw samples are kept for combine_costs()."""
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
    if num_blocks is not None and num_blocks < need:
        raise ValueError(f"measure_components needs {need} KV blocks, got {num_blocks}")
    pool = KVPool.from_config(cfg, num_blocks=num_blocks or need, block_size=block_size, dtype=model.dtype, device=dev)
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
        _sync(dev)
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


def _ms(c: dict) -> dict:
    return {"prefill_ms": c["prefill_s"] * 1e3, "actions_ms": c["actions_s"] * 1e3,
            "decode_step_ms": {b: v * 1e3 for b, v in c["decode_step_s"].items()}}


def pool_blocks(cfg, block_size):
    return -(-cfg.prefix_len // block_size)


# ---------------------------------------------------------------------------------------------------------- ideal
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


# ---------------------------------------------------------------------------------------------------------- runs
class _Run:
    """One engine configuration under test, with what it emitted during the timed frames."""

    def __init__(self, model, processor, mode, arrivals, *, N, k, S, target_period_s=None, block_size=16,
                 warmup=None, compile="none", shapes=None):
        self.arrivals, self.warmup = arrivals, warmup
        max_rows = max(16, max(len(a) for a in arrivals) * (math.ceil(2 * N / (1 if k == "adaptive" else k)) + 2))
        shapes = dict(shapes or {})          # one KV pool shape and compile shapes for every engine of a run
        self.eng = Engine(model, processor, EngineConfig(
            mode=mode, decode_k=k, max_new_tokens=N, denoise_steps=S, max_batch=shapes.pop("max_batch", max_rows),
            max_pending=10_000, kv_block_size=block_size, target_period_s=target_period_s, k_max=max(64, 2 * N),
            compile=compile, **shapes))
        self.eng.warmup()                    # compile: graphs built before any frame (a no-op for none)
        self.actions, self.order, self.texts = [], [], {}
        # request latencies on this engine's own clock (sum of its frame times), so that interleaving with the
        # other modes does not count their frames: submit / first token / finish times in "busy seconds"
        self.busy, self._t0 = 0.0, None
        self.submitted, self.first, self.done = {}, {}, {}

    def _now(self) -> float:
        return self.busy + (time.perf_counter() - self._t0 if self._t0 is not None else 0.0)

    def _on_token(self, ev):
        if ev.index == 0 and ev.request_id in self.submitted:
            self.first[ev.request_id] = self._now()

    def _on_finished(self, r):
        self.texts[r.request_id] = r.token_ids
        if r.request_id in self.submitted:
            self.done[r.request_id] = self._now()

    def warm(self, frames, noise, n):
        for i in range(n):
            for kind, prompt, n_new in self.arrivals[i % len(self.arrivals)]:
                self.eng.submit(kind, prompt, n_new)
            self.eng.cycle(frames[i % len(frames)], noise=noise[i % len(noise)])
        self.eng.reset_metrics()          # in flight requests stay: timing starts in the mode's steady state
        self.eng.on_actions = self.actions.append
        self.eng.on_finished = self._on_finished
        self.eng.on_token = self._on_token

    def frame(self, i, obs, nz):
        for kind, prompt, n_new in self.arrivals[i]:
            rid = self.eng.submit(kind, prompt, n_new)
            self.order.append(rid)
            self.submitted[rid] = self.busy
        self._t0 = time.perf_counter()
        self.eng.cycle(obs, noise=nz)
        self.busy += time.perf_counter() - self._t0
        self._t0 = None

    def finish(self, frames) -> dict:
        eng = self.eng
        m = eng.metrics()
        # the paper's action frequency is H x frames / total time of a back-to-back run = H x frames / sum of frame
        # times; the sum is used so that interleaved runs are measured the same way
        busy = m.get("busy_time_s") or 0.0
        m["action_hz_wall"] = m.get("action_hz")
        m["action_hz"] = m.get("action_hz_busy")
        m["tokens_per_s_total"] = m["tokens_total"] / busy if busy else None
        eng.on_actions = None
        eng.drain(frames[-1])           # (drain cycles are not timed: requests finishing there get no latency)
        for name, src in (("ttft_ms", self.first), ("completion_ms", self.done)):
            xs = [src[r] - self.submitted[r] for r in self.order if r in src]
            for q in (50, 90, 99):
                v = percentile(xs, q)
                m[f"{name}_p{q}"] = None if v is None else v * 1e3
            m[f"{name}_mean"] = float(np.mean(xs)) * 1e3 if xs else None
        m["latency_clock"] = "engine busy time (sum of this mode's frame times since submission)"
        eng.kv.check_invariants(idle=True)
        m["kv_peak_over_live"] = (eng.pool.peak_tokens / eng.kv.peak_live_tokens) if eng.kv.peak_live_tokens else None
        m["kv_bytes_after_drain"] = eng.pool.used_bytes
        return {"metrics": m, "actions": np.stack([a.actions for a in self.actions]),
                "tokens": [self.texts.get(r) for r in self.order]}


def run_all(model, processor, specs: dict, frames: list, noise: list, *, warmup: int, interleave: bool = True,
            log=None) -> dict:
    """specs: name -> dict(mode, arrivals, N, k, S, target_period_s, block_size). Each run gets warm-up frames (untimed;
    they also fill oxygen's pipeline, so timing starts in steady state) and then the same timed frames.
    interleave=True runs the modes frame by frame in rotating order, so that the load of a shared machine falls on
    all of them alike; False runs them back to back."""
    runs = {name: _Run(model, processor, **sp) for name, sp in specs.items()}
    for r in runs.values():
        r.warm(frames, noise, warmup if r.warmup is None else r.warmup)
    names = list(runs)
    if interleave:
        for i, (obs, nz) in enumerate(zip(frames, noise)):
            for j in range(len(names)):
                runs[names[(i + j) % len(names)]].frame(i, obs, nz)
    else:
        for name in names:
            t = time.perf_counter()
            for i, (obs, nz) in enumerate(zip(frames, noise)):
                runs[name].frame(i, obs, nz)
            if log:
                log(f"{name} done in {time.perf_counter() - t:.1f}s")
    return {name: r.finish(frames) for name, r in runs.items()}


def run_mode(model, processor, mode: str, frames: list, noise: list, arrivals: list, *, N: int, k, S: int,
             warmup: int, target_period_s: Optional[float] = None, block_size: int = 16) -> dict:
    """One mode alone (warm-up, then the timed frames)."""
    spec = dict(mode=mode, arrivals=arrivals, N=N, k=k, S=S, target_period_s=target_period_s, block_size=block_size)
    return run_all(model, processor, {mode: spec}, frames, noise, warmup=warmup, interleave=False)[mode]


# ---------------------------------------------------------------------------------------------------------- compile
_VIEW_OPS = {"aten::as_strided", "aten::view", "aten::expand", "aten::transpose", "aten::resolve_conj",
             "aten::empty", "aten::reshape", "aten::permute", "aten::t", "aten::slice", "aten::select",
             "aten::unsqueeze", "aten::squeeze", "aten::detach", "aten::alias", "aten::_unsafe_view",
             "aten::lift_fresh", "aten::empty_strided", "aten::_reshape_alias", "aten::resolve_neg",
             "aten::unflatten", "aten::split", "aten::chunk", "aten::narrow", "aten::contiguous"}


def op_counts(fn, device) -> dict:
    """Operators one call of ``fn`` dispatches, from the profiler: ``ops`` = leaf ATen operators that compute (views
    and allocations left out); on CUDA also ``kernels`` = device kernels launched.  Eager: every tensor op is one;
    compiled: the fused kernels replace them (on CPU inductor's C++ kernels are not dispatcher ops, so what is left is
    the matmuls / attention it calls out to) - the launch-overhead proxy."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.device(device).type == "cuda" else [])
    fn()
    _sync(device)
    with profile(activities=acts) as prof:
        fn()
        _sync(device)
    ev = prof.events()
    ops = sum(1 for e in ev if e.name.startswith("aten::") and not e.cpu_children and e.name not in _VIEW_OPS)
    out = {"ops": ops}
    if torch.device(device).type == "cuda":
        out["kernels"] = sum(1 for e in ev if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA)
    return out


@torch.no_grad()
def step_op_counts(model, processor, obs, S: int, batch: int, num_blocks: Optional[int] = None,
                   block_size: int = 16) -> dict:
    """op_counts of one denoise step (one S-step sample_actions / S) and of one decode step at ``batch`` rows."""
    dev = next(model.parameters()).device
    cfg = model.cfg
    mi = processor.prepare(obs)
    args = (mi.images.to(dev), mi.image_masks.to(dev), mi.tokens.to(dev), mi.token_masks.to(dev))
    pre = model.prefill(*args, want_logits=True)
    noise = torch.zeros((1, cfg.action_horizon, cfg.action_dim), device=dev)
    den = op_counts(lambda: model.sample_actions(pre, noise, S), dev)
    pool = KVPool.from_config(cfg, num_blocks=num_blocks or (pool_blocks(cfg, block_size) + batch * 4 + 4),
                              block_size=block_size, dtype=model.dtype, device=dev)   # the run's pool: graphs reused
    if isinstance(model, CompiledModel):
        model.warmup(pool)
    kv = KVCacheManager(pool, max_batch=batch)
    fp = kv.store_prefix(pre, 0, frame_index=0, image_positions=cfg.num_image_tokens)
    rows = [kv.admit(LanguageRequest("subtask", "", 8), fp, shared_len=fp.length, first_token=5, max_new_tokens=8,
                     eos_token_id=None) for _ in range(batch)]
    kv.release(fp)
    plan = kv.plan_decode(rows, [1] * batch)
    pos, w, r, m = kv.step_tensors(plan)
    ids = torch.full((batch,), 5, dtype=torch.long, device=dev)
    dec = op_counts(lambda: model.decode(DecodeBatch(ids, pos, w, r, m), pool), dev)
    for st in rows:
        kv.finish(st, "length")
    return {"denoise_step": {k: v / S for k, v in den.items()}, f"decode_step_b{batch}": dec}


@torch.no_grad()
def bf16_check(preset: str = "tiny", seed: int = 0, S: int = 10) -> dict:
    """Action chunk of the same random-weight model, inputs and noise in bf16 vs fp32 (CPU): the tolerance a GPU's
    bf16 run should be judged by."""
    res = {}
    acts = {}
    for dt in ("float32", "bfloat16"):
        cfg = get_config(preset, num_denoise_steps=S)
        model = build_model(cfg, dtype=dt, seed=seed)
        proc = Processor(model.cfg, load_tokenizer(model.cfg))
        obs = make_frames(model.cfg, 1, seed)[0]
        mi = proc.prepare(obs)
        pre = model.prefill(mi.images, mi.image_masks, mi.tokens, mi.token_masks)
        acts[dt] = model.sample_actions(pre, make_noise(model.cfg, 1, seed)[0], S).float()
    a, b = acts["float32"], acts["bfloat16"]
    res = {"preset": preset, "max_abs_diff": float((a - b).abs().max()), "mean_abs_diff": float((a - b).abs().mean()),
           "max_rel_diff": float((a - b).abs().max() / a.abs().max().clamp(min=1e-12)),
           "action_abs_max_fp32": float(a.abs().max())}
    return res


def components_table(eager: dict, comp: dict, ops: Optional[dict], mode: str) -> str:
    rows = [("prefill", eager["prefill_s"], comp["prefill_s"]),
            ("denoise step", eager["denoise_step_s"], comp["denoise_step_s"])]
    rows += [(f"decode step b{b}", eager["decode_step_s"][b], comp["decode_step_s"][b])
             for b in sorted(eager["decode_step_s"])]
    lines = [f"{'component':18s} {'eager ms':>9s} {mode + ' ms':>14s} {'speedup':>8s}"]
    for name, e, c in rows:
        lines.append(f"{name:18s} {e * 1e3:9.3f} {c * 1e3:14.3f} {e / c:7.2f}x")
    if ops:
        for name in ops["eager"]:
            e, c = ops["eager"][name], ops["compiled"][name]
            extra = "".join(f", {k}: {e[k]:.0f} -> {c[k]:.0f}" for k in e if k != "ops")
            lines.append(f"ops per {name}: {e['ops']:.0f} eager -> {c['ops']:.0f} {mode}{extra}")
    return "\n".join(lines)


def compile_shapes(cfg, a, arrivals, k_num: int) -> dict:
    """Engine settings shared by every engine of a compiled run (so that all use the same graphs): batch buckets,
    the largest batch, the KV pool size and the decode context the graphs are built for."""
    Ns = [a.N] + ([int(x) for x in a.sweep_n.split(",")] if a.sweep else [])
    ks = [k_num] + ([int(x) for x in a.sweep_k.split(",")] if a.sweep else [])
    n_max = max(Ns) * (2 if a.mixed_lengths else 1)
    per_frame = max(1, max(len(r) for r in arrivals))
    max_batch = max(16, per_frame * (math.ceil(2 * n_max / min(ks)) + 2))
    per_prefix = pool_blocks(cfg, a.block_size)
    per_req = -(-(cfg.max_token_len + n_max) // a.block_size)
    num_blocks = (max_batch + 2) * per_prefix + max_batch * per_req + 64
    return {"max_batch": max_batch, "kv_num_blocks": num_blocks,
            "compile_batch_sizes": tuple(int(x) for x in a.compile_batch_sizes.split(",")),
            "compile_max_context": cfg.num_image_tokens + cfg.max_token_len + n_max + 16}


def compile_summary(results: dict, eager: dict, comp: dict, mode: str) -> dict:
    """Compiled over eager: component speedups and, per engine mode run both ways, frame time speedup; and the
    compiled oxygen over compiled isolated action Hz."""
    out = {"compiled_denoise_step_speedup": eager["denoise_step_s"] / comp["denoise_step_s"],
           "compiled_prefill_speedup": eager["prefill_s"] / comp["prefill_s"]}
    for b in sorted(eager["decode_step_s"]):
        out[f"compiled_decode_b{b}_speedup"] = eager["decode_step_s"][b] / comp["decode_step_s"][b]
    for name in ("isolated", "shared", "oxygen"):
        e, c = results.get(name), results.get(f"{name}+{mode}")
        if e and c:
            out[f"compiled_{name}_frame_speedup"] = e["metrics"]["cycle_ms_mean"] / c["metrics"]["cycle_ms_mean"]
    ci, co = results.get(f"isolated+{mode}"), results.get(f"oxygen+{mode}")
    if ci and co:
        out["compiled_oxygen_vs_isolated_hz"] = co["metrics"]["action_hz"] / ci["metrics"]["action_hz"]
        out["compiled_oxygen_action_hz"] = co["metrics"]["action_hz"]
        out["compiled_oxygen_tokens_per_s"] = co["metrics"]["tokens_per_s"]
        out["compiled_oxygen_frame_ms"] = co["metrics"]["cycle_ms_mean"]
    return out


# ---------------------------------------------------------------------------------------------------------- report
def hardware(device) -> dict:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    hw = {"host": socket.gethostname(), "cpu": cpu, "cpu_count": os.cpu_count(),
          "torch_threads": torch.get_num_threads(),
          "torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
          "device": str(device), "device_name": cpu,
          "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY") + ("" if not _TORCH_PRELOADED or _OMP_PRESET
                                                                  else " (set after torch was loaded: not in effect)")}
    if torch.device(device).type == "cuda":
        hw["device_name"] = torch.cuda.get_device_name(torch.device(device))
    try:
        hw["load_avg"] = os.getloadavg()
    except OSError:
        pass
    try:
        hw["git_commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                          cwd=os.path.dirname(__file__), timeout=5).stdout.strip()
    except Exception:
        pass
    return hw


def _fmt(x, nd=1):
    return "-" if x is None else f"{x:.{nd}f}"


def table(results: dict, base: str = "isolated") -> str:
    cols = ["mode", "frame ms", "action Hz", "tok/s", "tok/s tot", "cyc p50", "cyc p90", "cyc p99", "act lat p50",
            "ttft p50", "done p50", "prefill/f", "batch", "KV peak MB", "x Hz", "x tok/s", "| prefill", "actions",
            "decode", "other ms"]
    rows = []
    b = results.get(base, {}).get("metrics")
    for name, r in results.items():
        m = r["metrics"]
        xs = [None, None]
        if b and b.get("action_hz") and m.get("action_hz"):
            xs = [m["action_hz"] / b["action_hz"],
                  (m["tokens_per_s"] or 0) / b["tokens_per_s"] if b.get("tokens_per_s") else None]
        rows.append([name, _fmt(m.get("cycle_ms_mean")), _fmt(m.get("action_hz")), _fmt(m.get("tokens_per_s")),
                     _fmt(m.get("tokens_per_s_total")), _fmt(m.get("cycle_ms_p50")), _fmt(m.get("cycle_ms_p90")),
                     _fmt(m.get("cycle_ms_p99")), _fmt(m.get("action_latency_ms_p50")), _fmt(m.get("ttft_ms_p50")),
                     _fmt(m.get("completion_ms_p50")),
                     _fmt(m.get("prefills_per_frame"), 2), _fmt(m.get("batch_size_mean"), 2),
                     _fmt((m.get("kv_bytes_peak") or 0) / 2 ** 20, 2), _fmt(xs[0], 2), _fmt(xs[1], 2),
                     "| " + _fmt(m.get("prefill_ms_per_frame")), _fmt(m.get("actions_ms_per_frame")),
                     _fmt(m.get("decode_ms_per_frame")), _fmt(m.get("other_ms_per_frame"))])
    w = [max(len(str(c)), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    line = lambda r: "  ".join(str(x).rjust(w[i]) if i else str(x).ljust(w[i]) for i, x in enumerate(r))  # noqa: E731
    return "\n".join([line(cols), line(["-" * x for x in w])] + [line(r) for r in rows])


def plot(path: str, results: dict, sweep: Optional[list], title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    n = 2 if sweep else 1
    fig, axes = plt.subplots(1, n, figsize=(6.5 * n, 5))
    axes = np.atleast_1d(axes)
    ax = axes[0]
    for name, r in results.items():
        m = r["metrics"]
        ax.scatter(m["tokens_per_s"], m["action_hz"], s=60)
        ax.annotate(name, (m["tokens_per_s"], m["action_hz"]), textcoords="offset points", xytext=(6, 4))
    ax.set_xlabel("language tokens/s (mean over frames)")
    ax.set_ylabel("action frequency (Hz) = H x frames / time")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    if sweep:
        ax = axes[1]
        for i, N in enumerate(sorted({s["N"] for s in sweep})):
            pts = sorted((s["k"], s["speedup_hz"], s["ideal_speedup"]) for s in sweep if s["N"] == N)
            color = f"C{i}"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=color, label=f"N={N} measured")
            ax.plot([p[0] for p in pts], [p[2] for p in pts], "x--", color=color, alpha=0.5, label=f"N={N} ideal")
        ax.set_xlabel("k (tokens per request per frame)")
        ax.set_ylabel("oxygen / isolated action frequency")
        ax.set_title("k/N sweep", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    return x


def compare(results: dict, base: str = "isolated") -> dict:
    """Max relative action difference and token equality of each mode against `base`."""
    out = {}
    if base not in results:
        return out
    a0, t0 = results[base]["actions"], results[base]["tokens"]
    for name, r in results.items():
        if name == base or name.endswith("N=k") or r["actions"].shape != a0.shape:
            continue
        rel = float(np.max(np.abs(r["actions"] - a0)) / max(1e-12, float(np.max(np.abs(a0)))))
        same = sum(1 for x, y in zip(r["tokens"], t0) if x is not None and x == y)
        out[name] = {"actions_max_rel_diff": rel, "requests_same_tokens": same, "requests": len(t0)}
    return out


# ---------------------------------------------------------------------------------------------------------- main
def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="oxygen bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="bench-cpu")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: the preset's)")
    p.add_argument("--modes", default="isolated,shared,oxygen")
    p.add_argument("--frames", type=int, default=50)
    p.add_argument("--decode-tokens", "-N", type=int, default=30, dest="N")
    p.add_argument("--k", default="5", help="tokens per request per frame, or 'adaptive'")
    p.add_argument("--target-period-ms", type=float, default=None,
                   help="cycle deadline for --k adaptive (default: the ideal oxygen frame time)")
    p.add_argument("--denoise-steps", "-S", type=int, default=10, dest="S")
    p.add_argument("--horizon", type=int, default=None,
                   help="action horizon H (default: the preset's; bench-cpu has 10 like the paper, pi05 has 50)")
    p.add_argument("--arrivals", choices=("per-frame", "poisson"), default="per-frame")
    p.add_argument("--rate", type=float, default=1.0, help="mean arrivals per frame for --arrivals poisson")
    p.add_argument("--mixed-lengths", action="store_true", help="max_new_tokens uniform in [N/3, 2N] per request")
    p.add_argument("--kinds", default="subtask", help="request kinds, cycled: subtask,conversation,memory")
    p.add_argument("--masked-camera", type=int, default=None, help="leave this camera slot empty")
    p.add_argument("--warmup", type=int, default=None, help="untimed warm-up frames per mode (default 2*ceil(N/k)+2)")
    p.add_argument("--sequential", action="store_true",
                   help="run the modes back to back (default: interleaved frame by frame, rotating order)")
    p.add_argument("--no-shared-nk", action="store_true", help="skip the shared run with N=k (batching bound)")
    p.add_argument("--sweep", action="store_true", help="also run the k/N grid (oxygen vs isolated)")
    p.add_argument("--sweep-n", default="10,30,50")
    p.add_argument("--sweep-k", default="1,5,10")
    p.add_argument("--sweep-frames", type=int, default=12)
    p.add_argument("--reps", type=int, default=5, help="repetitions per component cost")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--compile", default="none", choices=("none", "inductor", "cudagraphs"),
                   help="also run every measurement compiled (side by side with eager, same model and inputs)")
    p.add_argument("--compile-batch-sizes", default="1,2,4,8,16",
                   help="decode / prompt batch buckets that get a graph (larger batches run in the next bucket)")
    p.add_argument("--no-eager", action="store_true", help="with --compile: skip the eager engine runs (components "
                   "are still measured both ways)")
    p.add_argument("--no-ops", action="store_true", help="with --compile: skip the profiler operator counts")
    p.add_argument("--bf16-check", action="store_true", help="report bf16 vs fp32 actions on the tiny preset (CPU)")
    p.add_argument("--out", default=None, help="output directory (default bench/results/<timestamp>-<host>)")
    return p.parse_args(argv)


def run(argv=None) -> dict:
    """The benchmark; returns its results document (what results.json holds)."""
    a = parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    k = "adaptive" if a.k == "adaptive" else int(a.k)
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    kinds = tuple(x.strip() for x in a.kinds.split(",") if x.strip())
    over = {"num_denoise_steps": a.S}
    if a.horizon:
        over["action_horizon"] = a.horizon
    cfg = get_config(a.preset, **over)
    dtype = a.dtype or cfg.dtype
    model = build_model(cfg, device=a.device, dtype=dtype, seed=a.seed)
    cfg = model.cfg
    try:
        tokenizer = load_tokenizer(cfg)
    except FileNotFoundError:      # random weights: text is meaningless anyway; bytes keep the prompt lengths honest
        tokenizer = ByteTokenizer(cfg.vocab_size, pad_id=cfg.pad_id, eos_id=cfg.eos_id, bos_id=cfg.bos_id)
        print(f"[bench] no SentencePiece file for {cfg.name}: using the byte tokenizer (random weights)", flush=True)
    processor = Processor(cfg, tokenizer)
    k_num = 1 if k == "adaptive" else k
    warmup = a.warmup if a.warmup is not None else 2 * math.ceil(a.N / k_num) + 2
    frames = make_frames(cfg, a.frames, a.seed, masked_camera=a.masked_camera)
    noise = make_noise(cfg, a.frames, a.seed)
    arrivals = make_arrivals(a.frames, a.seed, a.N, a.arrivals, a.mixed_lengths, kinds, a.rate)
    out_dir = a.out or os.path.join("bench", "results",
                                    _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d-%H%M%S") + "-" +
                                    socket.gethostname())
    os.makedirs(out_dir, exist_ok=True)
    print(f"[bench] preset={a.preset} device={a.device} dtype={dtype} H={cfg.action_horizon} S={a.S} N={a.N} "
          f"k={k} frames={a.frames} warmup={warmup} arrivals={a.arrivals} kinds={','.join(kinds)}", flush=True)

    try:
        load = os.getloadavg()[0]
        if load > 0.5 * (os.cpu_count() or 1) and torch.device(a.device).type == "cpu":
            print(f"[bench] warning: load average {load:.2f} on {os.cpu_count()} CPUs: other processes compete for "
                  "the CPU; timings will be noisy (modes are interleaved to share the noise)", flush=True)
    except OSError:
        pass
    t = time.perf_counter()
    max_b = set(range(1, max(8, math.ceil(a.N / k_num) + 2) + 1))
    if a.sweep:                    # the batch sizes the sweep's steady states use, so its ideal is measured too
        for n_ in a.sweep_n.split(","):
            for k_ in a.sweep_k.split(","):
                max_b |= set(steady_state_schedule(int(n_), int(k_)))
    compiled = a.compile != "none"
    shapes, cm, compile_info, ops = None, None, None, None
    if compiled:                   # one pool shape and one set of graphs for every engine and measurement of the run
        shapes = compile_shapes(cfg, a, arrivals, k_num)
        probe = Engine(model, processor, EngineConfig(max_new_tokens=a.N, denoise_steps=a.S, compile=a.compile,
                                                      kv_block_size=a.block_size, **shapes))
        tc = time.perf_counter()
        compile_info = probe.warmup()
        cm = probe.model
        compile_info["graphs"] = dict(cm.report.graphs)
        print(f"[bench] compile={compile_info['compile']} (asked {a.compile}): {len(compile_info['graphs'])} graphs "
              f"in {time.perf_counter() - tc:.1f}s {compile_info['compile_error']}", flush=True)
        del probe
    mc = dict(reps=a.reps, block_size=a.block_size, num_blocks=shapes and shapes["kv_num_blocks"])
    costs = measure_components(model, processor, frames[0], a.N, a.S, max_b, **mc)
    costs_before = costs
    costs_c_before = measure_components(cm, processor, frames[0], a.N, a.S, max_b, **mc) if compiled else None
    if compiled and not a.no_ops:
        bo = 6 if 6 in max_b else max(max_b)
        ops = {"eager": step_op_counts(model, processor, frames[0], a.S, bo, shapes["kv_num_blocks"], a.block_size),
               "compiled": step_op_counts(cm, processor, frames[0], a.S, bo, shapes["kv_num_blocks"], a.block_size)}
    ideal_k = k_num
    ide = ideal(costs, a.N, ideal_k)
    print(f"[bench] components ({time.perf_counter() - t:.1f}s): prefill {costs['prefill_s'] * 1e3:.1f} ms, "
          f"actions {costs['actions_s'] * 1e3:.1f} ms ({costs['denoise_step_s'] * 1e3:.2f} ms/step), decode step "
          + ", ".join(f"b{b} {v * 1e3:.2f}" for b, v in costs["decode_step_s"].items()) + " ms", flush=True)
    print(f"[bench] ideal frame: isolated {ide['isolated_frame_s'] * 1e3:.1f} ms, shared "
          f"{ide['shared_frame_s'] * 1e3:.1f} ms, oxygen {ide['oxygen_frame_s'] * 1e3:.1f} ms -> ideal speedup "
          f"{ide['speedup_oxygen_vs_isolated']:.2f}x", flush=True)
    target = (a.target_period_ms / 1e3) if a.target_period_ms else (ide["oxygen_frame_s"] if k == "adaptive" else None)

    # isolated / shared carry nothing across frames: a few warm-up frames suffice; oxygen needs its pipeline filled
    short = warmup if a.warmup is not None else 3
    specs = {}
    for mode in modes:
        sp = dict(mode=mode, arrivals=arrivals, N=a.N, k=k, S=a.S, target_period_s=target, block_size=a.block_size,
                  warmup=warmup if mode == "oxygen" else short, shapes=shapes)
        if not (compiled and a.no_eager):
            specs[mode] = sp
        if compiled:
            specs[f"{mode}+{a.compile}"] = dict(sp, compile=a.compile)
    if not a.no_shared_nk and "oxygen" in modes and k != "adaptive":
        arr_k = [[(kd, p, min(n, k)) for kd, p, n in row] for row in arrivals]
        specs["shared_N=k"] = dict(mode="shared", arrivals=arr_k, N=k, k=k, S=a.S, block_size=a.block_size,
                                   warmup=short, shapes=shapes, compile=a.compile)
    t = time.perf_counter()
    results = run_all(model, processor, specs, frames, noise, warmup=warmup, interleave=not a.sequential,
                      log=lambda msg: print(f"[bench] {msg}", flush=True))
    print(f"[bench] runs done in {time.perf_counter() - t:.1f}s ("
          f"{'back to back' if a.sequential else 'interleaved frame by frame'})", flush=True)
    for name, r in results.items():
        m = r["metrics"]
        print(f"[bench] {name}: {m['action_hz']:.1f} Hz, {m['tokens_per_s']:.1f} tok/s, frame "
              f"{m['cycle_ms_mean']:.1f} ms", flush=True)

    # component costs once more after the runs; the ideal uses the medians over both measurements' samples
    costs_after = measure_components(model, processor, frames[0], a.N, a.S, max_b, **mc)
    costs = combine_costs(costs_before, costs_after, a.S)
    costs_c = None
    if compiled:
        costs_c = combine_costs(costs_c_before, measure_components(cm, processor, frames[0], a.N, a.S, max_b, **mc),
                                a.S)
        summary_c = compile_summary(results, costs, costs_c, a.compile)
        print("\n" + components_table(costs, costs_c, ops, a.compile), flush=True)
    ide = ideal(costs, a.N, ideal_k)
    print(f"[bench] components after the runs: prefill {costs_after['prefill_s'] * 1e3:.1f} ms, actions "
          f"{costs_after['actions_s'] * 1e3:.1f} ms, decode step "
          + ", ".join(f"b{b} {v * 1e3:.2f}" for b, v in costs_after["decode_step_s"].items()) + " ms; ideal speedup "
          f"from both: {ide['speedup_oxygen_vs_isolated']:.2f}x", flush=True)
    summary = {}
    if "isolated" in results and "oxygen" in results:
        mi, mo = results["isolated"]["metrics"], results["oxygen"]["metrics"]
        sp_hz = mo["action_hz"] / mi["action_hz"]
        sp_tok = mo["tokens_per_s"] / mi["tokens_per_s"] if mi["tokens_per_s"] else None
        summary = {"speedup_action_hz": sp_hz, "speedup_tokens_per_s": sp_tok,
                   "ideal_speedup": ide["speedup_oxygen_vs_isolated"],
                   "pct_of_ideal_hz": 100 * sp_hz / ide["speedup_oxygen_vs_isolated"],
                   "pct_of_ideal_tokens": None if sp_tok is None else 100 * sp_tok / ide["speedup_oxygen_vs_isolated"],
                   "oxygen_frame_ms": mo["cycle_ms_mean"], "ideal_oxygen_frame_ms": ide["oxygen_frame_s"] * 1e3,
                   "isolated_frame_ms": mi["cycle_ms_mean"], "ideal_isolated_frame_ms": ide["isolated_frame_s"] * 1e3}
        # the same ideal from the component times measured inside the runs themselves (prefill + actions + decode
        # per frame, i.e. the frame time minus everything else): what is left is scheduling overhead
        comp = lambda m: m["prefill_ms_per_frame"] + m["actions_ms_per_frame"] + m["decode_ms_per_frame"]  # noqa
        summary["ideal_speedup_in_run"] = comp(mi) / comp(mo)
        summary["pct_of_in_run_ideal_hz"] = 100 * sp_hz / summary["ideal_speedup_in_run"]
        summary["oxygen_other_ms_per_frame"] = mo["other_ms_per_frame"]
        summary["isolated_other_ms_per_frame"] = mi["other_ms_per_frame"]
        if "shared_N=k" in results:
            fs = results["shared_N=k"]["metrics"]["cycle_ms_mean"]
            summary["shared_N=k_frame_ms"] = fs
            summary["oxygen_frame_over_shared_N=k"] = mo["cycle_ms_mean"] / fs

    if compiled:
        summary.update(summary_c)
    bf16 = bf16_check(seed=a.seed) if a.bf16_check else None
    if bf16:
        print(f"[bench] bf16 vs fp32 actions ({bf16['preset']}): max abs diff {bf16['max_abs_diff']:.3e}, max rel "
              f"{bf16['max_rel_diff']:.3e}", flush=True)
    sweep = None
    if a.sweep:
        sweep = run_sweep(model, processor, cfg, a, costs, shapes)

    eq = compare(results)
    tab = table(results)
    print()
    print(tab)
    print()
    for key, v in summary.items():
        print(f"  {key:32s} {v:.3f}" if isinstance(v, float) else f"  {key:32s} {v}")
    for name, c in eq.items():
        print(f"  {name} vs isolated: actions max rel diff {c['actions_max_rel_diff']:.2e}, "
              f"{c['requests_same_tokens']}/{c['requests']} requests with identical tokens")
    if sweep:
        print("\n  k/N sweep (oxygen / isolated action Hz; ideal):")
        for s in sweep:
            print(f"    N={s['N']:3d} k={s['k']:3d}: {s['speedup_hz']:.2f}x (ideal {s['ideal_speedup']:.2f}x)")

    doc = {"args": vars(a), "config": cfg.to_dict(), "hardware": hardware(a.device),
           "component_costs_before": _ms(costs_before), "component_costs_after": _ms(costs_after),
           "component_costs": {"prefill_ms": costs["prefill_s"] * 1e3, "actions_ms": costs["actions_s"] * 1e3,
                               "denoise_step_ms": costs["denoise_step_s"] * 1e3,
                               "decode_step_ms": {b: v * 1e3 for b, v in costs["decode_step_s"].items()},
                               "prefix_valid_tokens": costs["prefix_valid_tokens"],
                               "prefix_positions": costs["prefix_positions"]},
           "ideal": {**{kk: (v * 1e3 if kk.endswith("_s") else v) for kk, v in ide.items()}},
           "summary": summary, "equivalence": eq, "compile": compile_info, "op_counts": ops, "bf16_vs_fp32": bf16,
           "component_costs_compiled": None if costs_c is None else {
               "prefill_ms": costs_c["prefill_s"] * 1e3, "actions_ms": costs_c["actions_s"] * 1e3,
               "denoise_step_ms": costs_c["denoise_step_s"] * 1e3,
               "decode_step_ms": {b: v * 1e3 for b, v in costs_c["decode_step_s"].items()}},
           "components_table": None if costs_c is None else components_table(costs, costs_c, ops, a.compile),
           "modes": {name: r["metrics"] for name, r in results.items()}, "sweep": sweep, "table": tab}
    doc["ideal"] = {kk.replace("_s", "_ms") if kk.endswith("_s") else kk: v for kk, v in doc["ideal"].items()}
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(_jsonable(doc), f, indent=1)
    with open(os.path.join(out_dir, "table.txt"), "w") as f:
        f.write(tab + "\n")
    title = (f"{a.preset} {a.device} {dtype}, H={cfg.action_horizon} S={a.S} N={a.N} k={k}, {a.frames} frames")
    plot(os.path.join(out_dir, "results.png"), {n: r for n, r in results.items()}, sweep, title)
    print(f"\n[bench] wrote {out_dir}/results.json, table.txt, results.png")
    doc["out_dir"] = out_dir
    return doc


def run_sweep(model, processor, cfg, a, costs, shapes=None) -> list:
    Ns = [int(x) for x in a.sweep_n.split(",")]
    ks = [int(x) for x in a.sweep_k.split(",")]
    n = a.sweep_frames
    frames, noise = make_frames(cfg, n, a.seed), make_noise(cfg, n, a.seed)
    out = []
    for N in Ns:
        arr = make_arrivals(n, a.seed, N)
        c = dict(compile=a.compile, shapes=shapes)        # the sweep runs compiled when --compile is given
        specs = {"isolated": dict(mode="isolated", arrivals=arr, N=N, k=1, S=a.S, block_size=a.block_size,
                                  warmup=2, **c)}
        for k in ks:
            specs[f"oxygen_k{k}"] = dict(mode="oxygen", arrivals=arr, N=N, k=k, S=a.S, block_size=a.block_size,
                                         warmup=math.ceil(N / k) + 1, **c)
        res = run_all(model, processor, specs, frames, noise, warmup=2, interleave=not a.sequential)
        iso = res["isolated"]["metrics"]
        for k in ks:
            ox = res[f"oxygen_k{k}"]["metrics"]
            ide = ideal(costs, N, k)
            row = {"N": N, "k": k, "isolated_hz": iso["action_hz"], "oxygen_hz": ox["action_hz"],
                   "isolated_tok_s": iso["tokens_per_s"], "oxygen_tok_s": ox["tokens_per_s"],
                   "speedup_hz": ox["action_hz"] / iso["action_hz"],
                   "speedup_tok_s": ox["tokens_per_s"] / iso["tokens_per_s"] if iso["tokens_per_s"] else None,
                   "ideal_speedup": ide["speedup_oxygen_vs_isolated"]}
            print(f"[bench] sweep N={N} k={k}: {row['speedup_hz']:.2f}x (ideal {row['ideal_speedup']:.2f}x)",
                  flush=True)
            out.append(row)
    return out


def main(argv=None) -> int:
    """``oxygen bench``: exit status 0 after a run (``run`` returns the results)."""
    run(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
