"""The action-chunk buffer that the node's control timer samples at ``control_rate_hz``.

This file owns the timing semantics of published actions; it is pure Python/numpy (no rclpy) and unit-tested
alone.  A chunk ``actions[H, A]`` computed from an observation captured at ``capture_time`` becomes available at
``ready_time``.  Row ``i`` is meant for time ``origin + i * step_dt``, where ``origin`` is ``ready_time``
(``time_origin="arrival"``, the openpi behaviour: the robot starts a chunk when it gets it, row 0 at the first tick)
or ``capture_time`` (``time_origin="capture"``: rows that inference latency already made past are skipped).  Each
``sample(now)`` returns the rows not yet executed at ``now`` (the *remainder*), or ``None``.  When a new chunk
arrives while the previous one still has rows left, the first ``blend_steps`` overlapping rows are a linear
cross-fade from the old remainder to the new chunk (weights (j+1)/(n+1)); the result is fixed at arrival, so all
later samples are consistent.  When the remainder is used up: ``stale_behavior="stop"`` returns ``None`` (the node
publishes nothing), ``"hold"`` returns one row repeating the last executed action, flagged ``held``.  The buffer
never decides staleness of observations itself: the node stops feeding it chunks from frames older than
``max_observation_age_s``; ``observation_age(now)`` reports the age of the newest chunk's frame.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import numpy as np

__all__ = ["ChunkBuffer", "ControlSample"]


@dataclass
class ControlSample:
    actions: np.ndarray        # [n, A] float32, row 0 = the action for this tick
    chunk_id: int
    frame_index: int
    capture_time: float        # seconds, the observation's capture time (header.stamp of the message)
    latency_ms: float
    blended: bool              # rows come from a cross-fade of the previous remainder into this chunk
    held: bool                 # chunk used up; ``actions`` repeats the last action (stale_behavior="hold")
    index: int                 # row of the (effective) chunk that ``actions[0]`` is
    capture_ns: int = 0        # the observation's exact capture time in ns, as given to ``push``
    frame_id: str = ""         # the observation's camera frame id, as given to ``push``


@dataclass
class _Chunk:
    actions: np.ndarray
    chunk_id: int
    frame_index: int
    capture_time: float
    ready_time: float
    origin: float
    latency_ms: float
    capture_ns: int = 0
    frame_id: str = ""
    blend_end: int = 0         # rows [.., blend_end) of this chunk are cross-faded with the previous remainder


class ChunkBuffer:
    """Thread-safe: ``push`` from the inference thread, ``sample`` from the control timer."""

    def __init__(self, step_dt: float, *, blend_steps: int = 0, stale_behavior: str = "stop",
                 time_origin: str = "arrival"):
        if not step_dt > 0:
            raise ValueError("step_dt must be > 0")
        if stale_behavior not in ("stop", "hold"):
            raise ValueError(f"stale_behavior must be 'stop' or 'hold', got {stale_behavior!r}")
        if time_origin not in ("arrival", "capture"):
            raise ValueError(f"time_origin must be 'arrival' or 'capture', got {time_origin!r}")
        self.step_dt = float(step_dt)
        self.blend_steps = max(0, int(blend_steps))
        self.stale_behavior = stale_behavior
        self.time_origin = time_origin
        self._lock = threading.Lock()
        self._chunk: _Chunk | None = None
        self._last_action: np.ndarray | None = None
        self._last_sample: ControlSample | None = None
        self.chunks_pushed = 0
        self.chunks_blended = 0
        self.chunks_expired_on_arrival = 0

    # -- helpers ------------------------------------------------------------------------------------------------
    def _index_at(self, ch: _Chunk, t: float) -> int:
        # Row whose time slot contains t; a small epsilon keeps ticks that land exactly on a slot stable.
        return max(0, int(math.floor((t - ch.origin) / self.step_dt + 1e-6)))

    # -- API ----------------------------------------------------------------------------------------------------
    def push(self, actions, *, chunk_id: int, frame_index: int, capture_time: float, ready_time: float,
             latency_ms: float = 0.0, capture_ns: int | None = None, frame_id: str = "") -> None:
        a = np.asarray(actions, dtype=np.float32)
        if a.ndim != 2 or a.shape[0] == 0:
            raise ValueError(f"actions must be [H, A] with H > 0, got {a.shape}")
        origin = ready_time if self.time_origin == "arrival" else capture_time
        new = _Chunk(a.copy(), int(chunk_id), int(frame_index), float(capture_time), float(ready_time),
                     float(origin), float(latency_ms),
                     int(round(capture_time * 1e9)) if capture_ns is None else int(capture_ns), str(frame_id))
        with self._lock:
            self.chunks_pushed += 1
            old = self._chunk
            k_new = self._index_at(new, ready_time)
            if k_new >= len(new.actions):
                self.chunks_expired_on_arrival += 1
            if old is not None and self.blend_steps > 0:
                k_old = self._index_at(old, ready_time)
                rem_old = old.actions[k_old:]
                n = min(self.blend_steps, len(rem_old), len(new.actions) - k_new)
                if n > 0:
                    w = (np.arange(1, n + 1, dtype=np.float32) / (n + 1))[:, None]
                    new.actions[k_new:k_new + n] = (1.0 - w) * rem_old[:n] + w * new.actions[k_new:k_new + n]
                    new.blend_end = k_new + n
                    self.chunks_blended += 1
            self._chunk = new

    def sample(self, now: float) -> ControlSample | None:
        with self._lock:
            ch = self._chunk
            if ch is None:
                return None
            k = self._index_at(ch, now)
            if k < len(ch.actions):
                rows = ch.actions[k:]
                self._last_action = rows[0].copy()
                s = ControlSample(rows.copy(), ch.chunk_id, ch.frame_index, ch.capture_time, ch.latency_ms,
                                  k < ch.blend_end, False, k, ch.capture_ns, ch.frame_id)
                self._last_sample = s
                return s
            if self.stale_behavior == "stop":
                return None
            last = self._last_action if self._last_action is not None else ch.actions[-1]
            return ControlSample(last[None, :].copy(), ch.chunk_id, ch.frame_index, ch.capture_time,
                                 ch.latency_ms, False, True, len(ch.actions), ch.capture_ns, ch.frame_id)

    def observation_age(self, now: float) -> float | None:
        """Age of the newest chunk's observation at ``now`` (None before the first chunk)."""
        with self._lock:
            return None if self._chunk is None else now - self._chunk.capture_time

    def remaining(self, now: float) -> int:
        with self._lock:
            ch = self._chunk
            return 0 if ch is None else max(0, len(ch.actions) - self._index_at(ch, now))

    def clear(self) -> None:
        with self._lock:
            self._chunk = None
            self._last_action = None
            self._last_sample = None
