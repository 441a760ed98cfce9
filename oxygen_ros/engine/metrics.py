"""Run metrics, as the OxyGen paper defines them plus what a deployment needs: action frequency = H x frames / total
time; language throughput = mean over frames of (tokens decoded in the frame / frame time) (the paper's) and total
tokens / total time; per-cycle latency and action latency (frame in -> chunk out) percentiles; time to first token
and completion latency per request; prefills per frame; active batch size; KV bytes in use and peak; deadline misses.
`Metrics.summary()` is a flat JSON-serialisable dict. Recording is cheap (append to bounded deques: a long-running
node keeps the last `window` cycles and requests, so its memory stays flat; totals since the last reset are kept as
counters); nothing here times itself.
"""
from __future__ import annotations

import collections
import math
import threading
from dataclasses import dataclass


def percentile(xs, q: float):
    """Linear-interpolated percentile (q in [0, 100]); None for an empty list."""
    if not xs:
        return None
    s = sorted(xs)
    if len(s) == 1:
        return float(s[0])
    pos = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return float(s[lo] + (s[hi] - s[lo]) * (pos - lo))


def _mean(xs):
    return float(sum(xs) / len(xs)) if xs else None


@dataclass
class CycleRecord:
    frame_index: int
    t_start: float               # perf_counter at frame in
    duration_s: float
    action_latency_s: float
    tokens: int                  # language tokens produced in this cycle (all requests)
    prefills: int                # full prefills (images + prompt) run in this cycle
    prompt_extends: int          # extend_prefix calls (prompt-only prefills on a frame's image KV)
    decode_steps: int            # batched decode calls
    batch_sizes: list            # rows per decode call
    active_requests: int         # requests in flight after the cycle
    admitted: int
    k: int
    deadline_missed: bool
    kv_bytes_in_use: int
    kv_live_tokens: int
    prefill_s: float = 0.0       # time in prefill / extend_prefix calls
    actions_s: float = 0.0       # time sampling (and un-normalising) the action chunk
    decode_s: float = 0.0        # time in batched decode calls


class Metrics:
    def __init__(self, action_horizon: int, window: int = 4096):
        self.H = int(action_horizon)
        self.window = int(window)             # cycles / requests kept for the rates and percentiles
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        w = self.window
        with getattr(self, "_lock", threading.Lock()):
            self.cycles: collections.deque[CycleRecord] = collections.deque(maxlen=w)
            self.ttft_s: collections.deque[float] = collections.deque(maxlen=w)
            self.completion_s: collections.deque[float] = collections.deque(maxlen=w)
            self.request_tokens: collections.deque[int] = collections.deque(maxlen=w)
            self.frames_total = 0
            self.tokens_total = 0
            self.counts = {"submitted": 0, "finished": 0, "finished_eos": 0, "finished_length": 0, "rejected": 0,
                           "dropped": 0, "errors": 0, "truncated_prompts": 0, "cycle_errors": 0}

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counts[name] = self.counts.get(name, 0) + n

    def add_cycle(self, rec: CycleRecord) -> None:
        with self._lock:
            self.cycles.append(rec)
            self.frames_total += 1
            self.tokens_total += rec.tokens

    def add_request(self, ttft_s, completion_s, n_tokens: int, reason: str) -> None:
        with self._lock:
            if ttft_s is not None:
                self.ttft_s.append(ttft_s)
            if completion_s is not None:
                self.completion_s.append(completion_s)
            self.request_tokens.append(n_tokens)
            self.counts["finished"] += 1
            key = f"finished_{reason}"
            self.counts[key] = self.counts.get(key, 0) + 1

    def summary(self, extra: dict | None = None) -> dict:
        with self._lock:
            cyc = list(self.cycles)
            ttft, comp, counts = list(self.ttft_s), list(self.completion_s), dict(self.counts)
        with self._lock:
            totals = {"frames_since_reset": self.frames_total, "tokens_since_reset": self.tokens_total}
        out: dict = {"frames": len(cyc), "action_horizon": self.H, **totals}
        if cyc:
            total = (cyc[-1].t_start + cyc[-1].duration_s) - cyc[0].t_start
            busy = sum(c.duration_s for c in cyc)
            tokens = sum(c.tokens for c in cyc)
            dur = [c.duration_s for c in cyc]
            lat = [c.action_latency_s for c in cyc]
            bs = [b for c in cyc for b in c.batch_sizes]
            out.update({
                "total_time_s": total, "busy_time_s": busy,
                "action_hz": self.H * len(cyc) / total if total > 0 else None,
                "action_hz_busy": self.H * len(cyc) / busy if busy > 0 else None,
                "frame_hz": len(cyc) / total if total > 0 else None,
                "tokens_total": tokens,
                "tokens_per_s": _mean([c.tokens / c.duration_s for c in cyc if c.duration_s > 0]),
                "tokens_per_s_total": tokens / total if total > 0 else None,
                "cycle_ms_mean": _mean(dur) * 1e3,
                "cycle_ms_p50": percentile(dur, 50) * 1e3, "cycle_ms_p90": percentile(dur, 90) * 1e3,
                "cycle_ms_p99": percentile(dur, 99) * 1e3, "cycle_ms_max": max(dur) * 1e3,
                "action_latency_ms_p50": percentile(lat, 50) * 1e3, "action_latency_ms_p90": percentile(lat, 90) * 1e3,
                "action_latency_ms_p99": percentile(lat, 99) * 1e3,
                "prefill_ms_per_frame": _mean([c.prefill_s for c in cyc]) * 1e3,
                "actions_ms_per_frame": _mean([c.actions_s for c in cyc]) * 1e3,
                "decode_ms_per_frame": _mean([c.decode_s for c in cyc]) * 1e3,
                "other_ms_per_frame": _mean([c.duration_s - c.prefill_s - c.actions_s - c.decode_s for c in cyc]) * 1e3,
                "prefills_per_frame": _mean([c.prefills for c in cyc]),
                "prompt_extends_per_frame": _mean([c.prompt_extends for c in cyc]),
                "decode_steps_per_frame": _mean([c.decode_steps for c in cyc]),
                "tokens_per_frame": tokens / len(cyc),
                "batch_size_mean": _mean(bs), "batch_size_max": max(bs) if bs else 0,
                "active_requests_mean": _mean([c.active_requests for c in cyc]),
                "k_mean": _mean([c.k for c in cyc]),
                "deadline_misses": sum(c.deadline_missed for c in cyc),
                "kv_bytes_in_use_max": max(c.kv_bytes_in_use for c in cyc),
                "kv_bytes_in_use_last": cyc[-1].kv_bytes_in_use,
            })
        for name, xs in (("ttft_ms", ttft), ("completion_ms", comp)):
            for q in (50, 90, 99):
                v = percentile(xs, q)
                out[f"{name}_p{q}"] = None if v is None else v * 1e3
            out[f"{name}_mean"] = None if not xs else _mean(xs) * 1e3
        out.update({f"requests_{k}": v for k, v in counts.items()})
        if extra:
            out.update(extra)
        return out
