"""Decode budget per cycle: how many tokens each active language request may decode in this frame. `FixedK` is the
paper's offline k. `AdaptiveK` is deadline-aware: it keeps exponential moving averages of the measured component
costs (prefill, action sampling, one batched decode step per batch size) and, once the frame's prefill, actions and
admissions are done, picks the largest k whose predicted decode time still fits the target period, never less than
`k_min` (>= 1) so language keeps progressing. Both count deadline misses (cycle longer than the target period).
"""
from __future__ import annotations

import math
from typing import Optional


class _Ema:
    def __init__(self, alpha: float):
        self.alpha, self.value, self.n = alpha, None, 0

    def add(self, x: float) -> None:
        self.value = x if self.value is None else (1 - self.alpha) * self.value + self.alpha * x
        self.n += 1


class DecodeBudget:
    adaptive = False

    def __init__(self, target_period_s: Optional[float] = None, alpha: float = 0.3):
        self.target_period_s = target_period_s
        self.alpha = alpha
        self.prefill = _Ema(alpha)
        self.actions = _Ema(alpha)
        self.overhead = _Ema(alpha)             # cycle time not explained by measured components
        self.step: dict[int, _Ema] = {}         # batch size -> decode step cost
        self.cycles = 0
        self.deadline_misses = 0
        self.last_k = 0

    # ---------------------------------------------------------------- observations
    def observe_prefill(self, seconds: float) -> None:
        self.prefill.add(seconds)

    def observe_actions(self, seconds: float) -> None:
        self.actions.add(seconds)

    def observe_step(self, batch_size: int, seconds: float) -> None:
        ema = self.step.get(batch_size)
        if ema is None:
            ema = self.step[int(batch_size)] = _Ema(self.alpha)
        ema.add(seconds)

    def end_cycle(self, duration_s: float, explained_s: float = 0.0) -> bool:
        """Record a finished cycle; returns True when it missed the target period."""
        self.cycles += 1
        self.overhead.add(max(0.0, duration_s - explained_s))
        missed = self.target_period_s is not None and duration_s > self.target_period_s
        self.deadline_misses += int(missed)
        return missed

    # ---------------------------------------------------------------- cost model
    def step_cost(self, batch_size: int) -> Optional[float]:
        """EMA cost of one decode step at this batch size; linear inter/extrapolation from measured sizes."""
        if batch_size in self.step and self.step[batch_size].value is not None:
            return self.step[batch_size].value
        known = sorted((b, e.value) for b, e in self.step.items() if e.value is not None)
        if not known:
            return None
        if len(known) == 1:
            b0, c0 = known[0]
            return c0 * max(1.0, batch_size / b0) if batch_size > b0 else c0
        lo = [kv for kv in known if kv[0] < batch_size]
        hi = [kv for kv in known if kv[0] > batch_size]
        if lo and hi:
            (b0, c0), (b1, c1) = lo[-1], hi[0]
        elif hi:
            (b0, c0), (b1, c1) = hi[0], hi[1]
        else:
            (b0, c0), (b1, c1) = lo[-2], lo[-1]
        c = c0 + (c1 - c0) * (batch_size - b0) / (b1 - b0)
        return max(c, min(c0, c1) if batch_size > b0 else 0.0, 1e-6)

    def predict_cycle(self, batch_size: int, k: int) -> Optional[float]:
        parts = [self.prefill.value, self.actions.value, self.step_cost(batch_size)]
        if any(p is None for p in parts):
            return None
        return parts[0] + parts[1] + k * parts[2] + (self.overhead.value or 0.0)

    def tokens_this_cycle(self, batch_size: int, elapsed_s: float) -> int:
        raise NotImplementedError

    def state(self) -> dict:
        d = {"budget_adaptive": self.adaptive, "budget_last_k": self.last_k,
             "deadline_misses": self.deadline_misses, "budget_cycles": self.cycles,
             "target_period_s": self.target_period_s}
        for name, e in (("prefill", self.prefill), ("actions", self.actions), ("overhead", self.overhead)):
            d[f"ema_{name}_ms"] = None if e.value is None else e.value * 1e3
        for b in sorted(self.step):
            if self.step[b].value is not None:
                d[f"ema_decode_step_b{b}_ms"] = self.step[b].value * 1e3
        return d


class FixedK(DecodeBudget):
    """The paper's fixed k tokens per request per frame."""

    def __init__(self, k: int, target_period_s: Optional[float] = None, alpha: float = 0.3):
        super().__init__(target_period_s, alpha)
        if int(k) < 1:
            raise ValueError("k must be >= 1")
        self.k = int(k)

    def tokens_this_cycle(self, batch_size: int, elapsed_s: float) -> int:
        self.last_k = self.k
        return self.k


class AdaptiveK(DecodeBudget):
    """Largest k that fits the rest of the period: k = floor((target - elapsed - overhead) / step_cost(B)),
    clamped to [k_min, k_max]; `k_init` until a step cost has been measured."""
    adaptive = True

    def __init__(self, target_period_s: float, k_min: int = 1, k_max: int = 64, k_init: int = 1,
                 alpha: float = 0.3, margin: float = 0.05):
        if not target_period_s or target_period_s <= 0:
            raise ValueError("adaptive k needs target_period_s > 0")
        super().__init__(target_period_s, alpha)
        self.k_min, self.k_max, self.k_init, self.margin = max(1, int(k_min)), int(k_max), int(k_init), margin

    def tokens_this_cycle(self, batch_size: int, elapsed_s: float) -> int:
        cost = self.step_cost(max(1, batch_size))
        if cost is None:
            k = self.k_init
        else:
            left = self.target_period_s * (1 - self.margin) - elapsed_s - (self.overhead.value or 0.0)
            k = math.floor(left / cost) if left > 0 else 0
        k = max(self.k_min, min(self.k_max, k))
        self.last_k = k
        return k


def make_budget(decode_k, target_period_s: Optional[float] = None, **kw) -> DecodeBudget:
    """`decode_k` is an int (fixed) or "adaptive" (needs target_period_s)."""
    if isinstance(decode_k, str):
        if decode_k == "adaptive":
            return AdaptiveK(target_period_s, **kw)
        decode_k = int(decode_k)
    return FixedK(decode_k, target_period_s)
