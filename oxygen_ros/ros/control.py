"""The action-chunk buffer that the node's control timer samples at ``control_rate_hz``.

This file owns the timing semantics of published actions; it is pure Python/numpy (no rclpy) and unit-tested
alone.  A chunk ``actions[H, A]`` computed from an observation captured at ``capture_time`` becomes available at
``ready_time``.  Row ``i`` is meant for time ``origin + i * step_dt``.  Each ``sample(now)`` returns the rows not yet
executed at ``now`` (the *remainder*: rows from ``index_at(now)`` on), or ``None``.  When the remainder is used up:
``stale_behavior="stop"`` returns ``None`` (the node publishes nothing), ``"hold"`` returns one row repeating the last
executed action, flagged ``held``.  How a new chunk takes over from the previous one (``chunking``):

* ``"blend"`` (default) / ``"none"``: ``origin`` is ``ready_time`` (``time_origin="arrival"``, the openpi behaviour:
  the robot starts a chunk when it gets it, row 0 at the first tick) or ``capture_time`` (``time_origin="capture"``:
  rows that inference latency already made past are skipped).  With ``"blend"`` and ``blend_steps > 0``, when a new
  chunk arrives while the previous one still has rows left, the first ``blend_steps`` overlapping rows are a linear
  cross-fade from the old remainder to the new chunk (weights (j+1)/(n+1)); ``"none"`` never blends.
* ``"rtc"`` (real-time chunking): before inference starts, ``snapshot(t_s)`` returns the rows of the current chunk
  that the robot will execute from ``t_s`` on (``prev_actions``: row ``i`` = the action for the new chunk's row
  ``i``) and the new chunk's time origin: the start of the current chunk's row slot that contains ``t_s``, so the
  new chunk's rows lie on the same time grid as the old one's (new row ``i`` <-> old row ``k_s + i`` exactly, for
  any tick phase).  The engine freezes the new chunk's first ``d`` rows to those rows and guides the overlap toward
  them.  ``push(..., rtc_origin=origin)`` installs the new chunk with that origin: at its arrival the robot is at
  row ``k = index_at(ready_time)`` (``k`` ~ ``d`` when ``d`` was estimated well); rows ``[0, k)`` were executed from
  the old chunk while inferring (they are skipped, counted in ``rtc_rows_skipped``), and the next tick continues at
  new row ``k``, which the engine made equal (``k < d``) or close (the guided overlap) to the old plan's row for that
  slot, so the executed stream is continuous.  Without a snapshot (first chunk, the previous one used up) the chunk
  starts as with ``time_origin``.

Whatever the mode, the result is fixed at arrival, so all later samples are consistent; with a ``step_limit``
(``ActionSpace.limit_steps``) the rows from ``index_at(ready_time)`` on are then limited step by step starting from
the last executed action and anchored to what the robot executes around the new chunk's first due time
(``_limit_references``): the previous plans, each held at its end once used up, so the per-step change limit holds
across chunk switches and after any gap (no chunk for a while, dropped chunks, stale inputs, ``clear`` on activate)
alike - for the ``action_chunk`` stream and for a joint_trajectory_controller, which switches to a new trajectory at
its stamp and interpolates between points; a buffer that has sent nothing yet (a new node) anchors to ``hold``, the
robot's joint state.  The buffer never decides
staleness of observations itself: the node stops feeding it chunks from frames older than
``max_observation_age_s``; ``observation_age(now)`` reports the age of the newest chunk's frame.
"""
from __future__ import annotations

import collections
import math
import threading
from dataclasses import dataclass

import numpy as np

__all__ = ["ChunkBuffer", "ControlSample", "ChunkView", "RTCSnapshot", "PushInfo", "CHUNKING_MODES"]

CHUNKING_MODES = ("blend", "none", "rtc")


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
    start: float = 0.0         # when it takes over: its first executed row's due time (the trajectory's stamp), or
                               # its arrival when that is later (rtc: the stamp may lie up to a step in the past)


@dataclass(frozen=True)
class RTCSnapshot:
    """What the robot will execute from the snapshot time on, for the next chunk's real-time chunking."""
    origin: float              # the new chunk's time origin (start of the current chunk's slot containing t_s)
    rows: np.ndarray           # [n, A] float32: the current chunk's rows from that slot on (n >= 1)
    chunk_id: int              # the chunk they come from
    index: int                 # the current chunk's row at the snapshot (rows = its actions[index:])


@dataclass(frozen=True)
class PushInfo:
    """What ``push`` did with a chunk."""
    index: int                 # the row the robot continues at (index_at(ready_time))
    rtc: bool                  # installed with a snapshot's origin
    blended_rows: int          # rows cross-faded with the previous remainder
    step_limited_rows: int     # rows the per-step change limit moved
    expired: bool              # no row left at arrival


@dataclass(frozen=True)
class ChunkView:
    """The current chunk's remaining rows at a time, without consuming anything (e.g. for JointTrajectory)."""
    rows: np.ndarray           # [n, A] float32, row 0 = the row whose slot contains ``now``
    index: int
    first_due: float           # when row 0 is due (origin + index * step_dt), seconds
    chunk_id: int
    frame_index: int
    capture_ns: int
    frame_id: str


class ChunkBuffer:
    """Thread-safe: ``push`` from the inference thread, ``sample`` from the control timer."""

    def __init__(self, step_dt: float, *, blend_steps: int = 0, stale_behavior: str = "stop",
                 time_origin: str = "arrival", chunking: str = "blend", step_limit=None):
        if not step_dt > 0:
            raise ValueError("step_dt must be > 0")
        if stale_behavior not in ("stop", "hold"):
            raise ValueError(f"stale_behavior must be 'stop' or 'hold', got {stale_behavior!r}")
        if time_origin not in ("arrival", "capture"):
            raise ValueError(f"time_origin must be 'arrival' or 'capture', got {time_origin!r}")
        if chunking not in CHUNKING_MODES:
            raise ValueError(f"chunking must be one of {CHUNKING_MODES}, got {chunking!r}")
        self.step_dt = float(step_dt)
        self.chunking = chunking
        self.blend_steps = max(0, int(blend_steps)) if chunking == "blend" else 0
        self.step_limit = step_limit        # (rows, prev_row or None) -> (rows, rows changed), or None
        self.stale_behavior = stale_behavior
        self.time_origin = time_origin
        self._lock = threading.Lock()
        self._chunk: _Chunk | None = None
        self._recent: collections.deque = collections.deque(maxlen=4)   # the chunks before, newest last
        self._last_action: np.ndarray | None = None
        self._last_sample: ControlSample | None = None
        self.chunks_pushed = 0
        self.chunks_blended = 0
        self.chunks_expired_on_arrival = 0
        self.chunks_rtc = 0                 # chunks installed on a snapshot's time origin
        self.rtc_rows_skipped = 0           # rows of those executed from the previous chunk while inferring
        self.step_limited_rows = 0

    # -- helpers ------------------------------------------------------------------------------------------------
    def _index_at(self, ch: _Chunk, t: float) -> int:
        # Row whose time slot contains t; a small epsilon keeps ticks that land exactly on a slot stable.
        return max(0, int(math.floor((t - ch.origin) / self.step_dt + 1e-6)))

    def _plan_at(self, ch: _Chunk, t: float) -> np.ndarray:
        """A chunk's plan at time t as a trajectory consumer executes it: its rows on their time grid, linearly
        interpolated, the first / last row held before / after."""
        x = (t - ch.origin) / self.step_dt
        n = len(ch.actions)
        if x <= 0:
            return ch.actions[0].astype(np.float64)
        if x >= n - 1:
            return ch.actions[-1].astype(np.float64)
        j = int(math.floor(x))
        u = x - j
        return (1 - u) * ch.actions[j].astype(np.float64) + u * ch.actions[j + 1].astype(np.float64)

    def _limit_references(self, old: _Chunk | None, t0: float, t_switch: float, hold=None):
        """What a new chunk whose first executed row is due at ``t0`` must stay within the step limit of, so that
        the executed command changes by at most the limit per control step whichever consumer executes it: the
        ``action_chunk`` stream (``prev``: the action executed last) and a joint_trajectory_controller, which
        switches to the new trajectory at ``t_switch`` (its stamp t0, or its arrival when that is later: rtc stamps
        may lie up to a step in the past) and interpolates between points at any phase. The controller's command
        over one control period then compares the new plan at t with what it executed at s = t - step_dt, for s in
        [t0 - step_dt, t_switch]; both are piecewise linear, so it suffices to bound the difference at the
        breakpoints s (t0 - step_dt, t0, t_switch, the executed plans' row times and switches, both sides of a
        switch): at each, the new rows around s + step_dt are anchored to what was executed at s. Row 0 is also kept
        within the limit of the previous plan at t0 itself (what the robot was doing at the switch).
        One rule whatever came before: the executed plans are the previous chunks, each held at its last row once
        used up (after any gap - no new chunk, dropped chunks, stale inputs, ``clear`` on a deactivate / activate -
        the robot holds that end, so the new chunk ramps away from it), or, when the buffer knows no plan (its first
        chunk: a new node), ``hold``: what the robot executes now (the newest joint state in action columns, NaN =
        unknown column), held forever; with neither the first chunk is not anchored. Returns (prev, anchors) for
        ``ActionSpace.limit_steps``."""
        chunks = [*self._recent, *([old] if old is not None else [])]
        if not chunks:
            if hold is None:
                return self._last_action, ()
            h = np.asarray(hold, dtype=np.float32).reshape(1, -1)
            chunks = [_Chunk(h, -1, -1, t0, t0, t0, 0.0, start=-math.inf)]     # the robot holding ``hold``
        dt = self.step_dt
        breaks = [t0 - dt, t0, t_switch]
        for c in chunks:                              # the executed plans' own row times in the window
            j0 = math.floor((t0 - dt - c.origin) / dt)
            breaks += [c.origin + j * dt for j in range(j0, j0 + 4) if t0 - dt < c.origin + j * dt < t_switch]
            if t0 - dt < c.start <= t_switch:         # a switch: the command jumps there (both sides count)
                breaks += [c.start - 1e-7, c.start]

        def executed(t: float) -> np.ndarray:         # the newest chunk that had started by t (the controller's)
            for c in reversed(chunks):
                if c.start <= t:
                    return self._plan_at(c, t)
            return self._plan_at(chunks[0], t)

        anchors = [(0, executed(t0))]
        for s_ in breaks:
            x = (s_ + dt - t0) / dt                   # position of s + dt among the new rows
            ref = executed(s_)
            for k in sorted({math.floor(x + 1e-6), math.ceil(x - 1e-6)}):
                if k >= 0:
                    anchors.append((k, ref))
        prev = self._last_action if self._last_action is not None else executed(t0 - dt)
        return prev, tuple(anchors)

    # -- API ----------------------------------------------------------------------------------------------------
    def snapshot(self, now: float) -> RTCSnapshot | None:
        """For ``chunking="rtc"``: the rows the robot executes from ``now`` on and the next chunk's time origin, or
        None (no chunk, or its remainder is used up: the next chunk then starts without real-time chunking)."""
        v = self.view(now)
        return None if v is None else RTCSnapshot(v.first_due, v.rows, v.chunk_id, v.index)

    def push(self, actions, *, chunk_id: int, frame_index: int, capture_time: float, ready_time: float,
             latency_ms: float = 0.0, capture_ns: int | None = None, frame_id: str = "",
             rtc_origin: float | None = None, hold=None) -> PushInfo:
        """Install a new chunk; ``rtc_origin``: the origin of the ``snapshot`` taken before inferring it (used with
        ``chunking="rtc"``; ignored otherwise); ``hold``: [A] what the robot executes now, used by the step limit
        only when the buffer knows no plan of its own (see ``_limit_references``)."""
        a = np.asarray(actions, dtype=np.float32)
        if a.ndim != 2 or a.shape[0] == 0:
            raise ValueError(f"actions must be [H, A] with H > 0, got {a.shape}")
        rtc = self.chunking == "rtc" and rtc_origin is not None
        if rtc:
            origin = float(rtc_origin)
        else:
            origin = ready_time if self.time_origin == "arrival" else capture_time
        new = _Chunk(a.copy(), int(chunk_id), int(frame_index), float(capture_time), float(ready_time),
                     float(origin), float(latency_ms),
                     int(round(capture_time * 1e9)) if capture_ns is None else int(capture_ns), str(frame_id))
        blended = limited = 0
        with self._lock:
            self.chunks_pushed += 1
            old = self._chunk
            k_new = self._index_at(new, ready_time)
            expired = k_new >= len(new.actions)
            if expired:
                self.chunks_expired_on_arrival += 1
            if rtc:
                self.chunks_rtc += 1
                self.rtc_rows_skipped += min(k_new, len(new.actions))
            if old is not None and self.blend_steps > 0:
                k_old = self._index_at(old, ready_time)
                rem_old = old.actions[k_old:]
                n = min(self.blend_steps, len(rem_old), len(new.actions) - k_new)
                if n > 0:
                    w = (np.arange(1, n + 1, dtype=np.float32) / (n + 1))[:, None]
                    new.actions[k_new:k_new + n] = (1.0 - w) * rem_old[:n] + w * new.actions[k_new:k_new + n]
                    new.blend_end = k_new + n
                    self.chunks_blended += 1
                    blended = n
            if self.step_limit is not None and not expired:
                prev, anchors = self._limit_references(old, new.origin + k_new * self.step_dt,
                                                       max(new.origin + k_new * self.step_dt, float(ready_time)),
                                                       hold)
                rows, limited = self.step_limit(new.actions[k_new:], prev, anchors)
                new.actions[k_new:] = rows
                self.step_limited_rows += limited
            new.start = max(new.origin + k_new * self.step_dt, float(ready_time))   # a controller has it from then
            if old is not None:
                self._recent.append(old)
            self._chunk = new
        return PushInfo(k_new, rtc, blended, limited, expired)

    def view(self, now: float) -> ChunkView | None:
        """The current chunk's rows from the one for ``now`` on (None if none is left); consumes nothing."""
        with self._lock:
            ch = self._chunk
            if ch is None:
                return None
            k = self._index_at(ch, now)
            if k >= len(ch.actions):
                return None
            return ChunkView(ch.actions[k:].copy(), k, ch.origin + k * self.step_dt, ch.chunk_id, ch.frame_index,
                             ch.capture_ns, ch.frame_id)

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
        """Forget the current chunk (nothing more is sampled, viewed or snapshot) and the last sampled action.  What
        was sent stays known to the step limit: a joint_trajectory_controller runs the last trajectory to its end and
        holds it, so the next chunk still ramps from there (``_limit_references``)."""
        with self._lock:
            if self._chunk is not None:
                self._recent.append(self._chunk)
            self._chunk = None
            self._last_action = None
            self._last_sample = None
