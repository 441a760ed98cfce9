"""The engine runs of ``oxygen bench``: each mode (isolated / shared / oxygen, eager or compiled) on the same frames
and arrivals, interleaved frame by frame so that a shared machine's load falls on all alike; the equivalence check
(same chunks, same tokens as isolated) and the k/N sweep.

This file owns what a run measures: ``_Run`` keeps one engine with its emitted actions, tokens and request latencies
on its own clock (the sum of its frame times, so interleaving does not count the other modes' frames); ``run_all``
warms every run up and drives the timed frames; ``compare`` checks the modes against ``isolated``; ``run_sweep``
runs the k/N grid of oxygen against isolated with the ideal speedup beside each point.
"""
from __future__ import annotations

import math
import time

import numpy as np

from ...engine.engine import Engine, EngineConfig
from ...engine.metrics import percentile
from .costs import ideal
from .inputs import make_arrivals, make_frames, make_noise


class _Run:
    """One engine configuration under test, with what it emitted during the timed frames."""

    def __init__(self, model, processor, mode, arrivals, *, N, k, S, target_period_s=None, block_size=16,
                 warmup=None, compile="none", shapes=None, frames=None, pool=None):
        self.arrivals, self.warmup, self.frames = arrivals, warmup, frames   # frames: timed frames (None = all)
        max_rows = max(16, max(len(a) for a in arrivals) * (math.ceil(2 * N / (1 if k == "adaptive" else k)) + 2))
        shapes = dict(shapes or {})          # one KV pool shape and compile shapes for every engine of a run
        self.eng = Engine(model, processor, EngineConfig(
            mode=mode, decode_k=k, max_new_tokens=N, denoise_steps=S, max_batch=shapes.pop("max_batch", max_rows),
            max_pending=10_000, kv_block_size=block_size, target_period_s=target_period_s, k_max=max(64, 2 * N),
            compile=compile, **shapes), pool=pool)
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
    """specs: name -> dict(mode, arrivals, N, k, S, target_period_s, block_size, [frames, pool, compile, shapes]).
    Each run gets warm-up frames (untimed; they also fill oxygen's pipeline, so timing starts in steady state) and
    then the same timed frames (the first ``frames`` of them when a spec gives fewer, e.g. a slow eager reference).
    ``pool``: a free KV pool for the run's engine (compiled runs reuse pools, and with them their decode graphs).
    interleave=True runs the modes frame by frame in rotating order, so that the load of a shared machine falls on
    all of them alike; False runs them back to back."""
    runs = {name: _Run(model, processor, **sp) for name, sp in specs.items()}
    for r in runs.values():
        r.warm(frames, noise, warmup if r.warmup is None else r.warmup)
    names = list(runs)
    def timed(r, i):
        return r.frames is None or i < r.frames

    if interleave:
        for i, (obs, nz) in enumerate(zip(frames, noise)):
            for j in range(len(names)):
                r = runs[names[(i + j) % len(names)]]
                if timed(r, i):
                    r.frame(i, obs, nz)
    else:
        for name in names:
            t = time.perf_counter()
            for i, (obs, nz) in enumerate(zip(frames, noise)):
                if timed(runs[name], i):
                    runs[name].frame(i, obs, nz)
            if log:
                log(f"{name} done in {time.perf_counter() - t:.1f}s")
    return {name: r.finish(frames) for name, r in runs.items()}


def compare(results: dict, base: str = "isolated") -> dict:
    """Max relative action difference and token equality of each mode against `base`, over the frames and requests
    both ran (a run with fewer timed frames is compared on those)."""
    out = {}
    if base not in results:
        return out
    a0, t0 = results[base]["actions"], results[base]["tokens"]
    for name, r in results.items():
        a1, t1 = r["actions"], r["tokens"]
        if name == base or name.endswith("N=k") or a1.shape[1:] != a0.shape[1:]:
            continue
        n, m = min(len(a0), len(a1)), min(len(t0), len(t1))
        rel = float(np.max(np.abs(a1[:n] - a0[:n])) / max(1e-12, float(np.max(np.abs(a0[:n])))))
        same = sum(1 for x, y in zip(t1[:m], t0[:m]) if x is not None and x == y)
        out[name] = {"actions_max_rel_diff": rel, "requests_same_tokens": same, "requests": m, "frames": n}
    return out


def run_sweep(model, processor, cfg, a, costs, shapes=None, pools=None) -> list:
    """The k/N grid: for each N of ``a.sweep_n``, isolated and oxygen at each k of ``a.sweep_k`` on
    ``a.sweep_frames`` frames (``a``: the command's arguments), with the ideal speedup of ``costs`` beside each;
    compiled when ``a.compile`` is set, the engines then on ``pools(i)`` (free pools whose graphs exist)."""
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
        if pools is not None and a.compile != "none":
            for i, sp in enumerate(specs.values()):
                sp["pool"] = pools(i)
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
