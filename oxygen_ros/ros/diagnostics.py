"""Diagnostics for ``/diagnostics``: node counters + engine metrics -> levelled statuses.

This file owns what the node reports and when it is OK/WARN/ERROR.  ``RateMeter`` counts events in a sliding
window (Hz); ``Counters`` is a thread-safe bag of named counters (rejected inputs by reason, cycle errors, ...);
``Reporter`` counts an event and logs it, throttled per reason (concurrent faults never hide each other).
``build_statuses(snapshot)`` is a pure function from a flat dict the node assembles each period to a list of
``Status(name, level, message, values)``; ``to_msg`` turns them into a ``diagnostic_msgs/DiagnosticArray`` (the only
ROS import, done lazily).  Status names are ``oxygen_node: control``, ``: inference``, ``: language``, ``: inputs``;
every key/value is also listed in the README.  Levels:
control ERROR when the node is not active, the newest primary-camera frame is older than ``max_observation_age_s``
(cameras stopped), the joint state is older than ``max_state_age_s`` (or none arrived while state joints are
configured), or no valid chunk was produced for ``CHUNK_GRACE_S`` (or 3x the p99 cycle latency, if longer) while
active (e.g. every chunk non-finite); WARN when the measured control rate is below 80% of the configured rate, or
when action rows were clipped to ``action_limits_*`` or moved by ``action_max_step_change`` during the last period
(``actions_clipped_rows`` / ``actions_step_limited_rows``, totals in the values, with the chunking mode and RTC's
d, s, chunks switched and rows skipped).
inference ERROR when configure failed; WARN when cycles failed or chunks were invalid during the last period.
language WARN when prompts were dropped/truncated/rejected (or converse goals rejected) during the last period.
inputs WARN when inputs were rejected, a camera frame failed, a header stamp was in the future (clock skew) during
the last period, or a non-primary camera is silent (masked); the totals stay in the values.  memory
(``memory_status``): WARN while the memory database fails or after a corrupt one was replaced, ERROR when entries
were lost.
"""
from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field

__all__ = ["OK", "WARN", "ERROR", "STALE", "RateMeter", "Counters", "Reporter", "Status", "build_statuses",
           "to_msg", "HARDWARE_ID"]

OK, WARN, ERROR, STALE = 0, 1, 2, 3
HARDWARE_ID = "oxygen_ros"
CHUNK_GRACE_S = 10.0        # no valid action chunk for this long while active (and cycles run) -> ERROR


class RateMeter:
    """Events per second over a sliding window (thread-safe)."""

    def __init__(self, window_s: float = 2.0):
        self.window_s = float(window_s)
        self._t: collections.deque[float] = collections.deque()
        self._lock = threading.Lock()
        self.total = 0

    def tick(self, now: float | None = None, n: int = 1) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            for _ in range(n):
                self._t.append(now)
            self.total += n
            self._trim(now)

    def _trim(self, now: float) -> None:
        lo = now - self.window_s
        while self._t and self._t[0] < lo:
            self._t.popleft()

    def rate(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        with self._lock:
            self._trim(now)
            return len(self._t) / self.window_s


class Counters:
    """Named monotonically increasing counters; ``delta()`` gives increments since the previous call."""

    def __init__(self):
        self._c: dict[str, int] = collections.defaultdict(int)
        self._prev: dict[str, int] = {}
        self._lock = threading.Lock()

    def inc(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._c[key] += n

    def get(self, key: str) -> int:
        with self._lock:
            return self._c.get(key, 0)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._c)

    def delta(self) -> dict[str, int]:
        with self._lock:
            d = {k: v - self._prev.get(k, 0) for k, v in self._c.items()}
            self._prev = dict(self._c)
            return d


class Reporter:
    """Counts events in ``Counters`` and logs them through any logger with ``info``/``warning``/``error`` methods
    (an rclpy logger or a ``logging.Logger``), at most once per ``period_s`` **per key**: two faults that happen at
    the same time are both logged.  Suppressed repeats are counted and reported with the next line of that key."""

    def __init__(self, counters: Counters, logger, period_s: float = 2.0, clock=time.monotonic):
        self.counters, self.logger, self.period_s, self._clock = counters, logger, float(period_s), clock
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = collections.defaultdict(int)
        self._lock = threading.Lock()

    def count(self, key: str, n: int = 1) -> None:
        self.counters.inc(key, n)

    def log(self, key: str, text: str, level: str = "warning", period_s: float | None = None) -> bool:
        """Log ``text`` unless ``key`` was logged less than ``period_s`` ago; returns whether it was logged."""
        now = self._clock()
        period = self.period_s if period_s is None else period_s
        with self._lock:
            if now - self._last.get(key, -1e18) < period:
                self._suppressed[key] += 1
                return False
            self._last[key] = now
            n = self._suppressed.pop(key, 0)
        if n:
            text += f" (+{n} more since the last report)"
        # one call site per severity: rclpy loggers refuse a severity change at the same call site
        if level == "error":
            self.logger.error(text)
        elif level == "info":
            self.logger.info(text)
        else:
            self.logger.warning(text)
        return True

    def event(self, key: str, text: str, level: str = "warning", period_s: float | None = None) -> None:
        """Count ``key`` once and log ``text`` (throttled per key)."""
        self.counters.inc(key)
        self.log(key, text, level, period_s)

    def reject(self, reason: str, text: str) -> None:
        """A rejected input: counted as ``rejected.<reason>``, logged per reason."""
        self.event(f"rejected.{reason}", f"rejected input ({reason}): {text}")


@dataclass
class Status:
    name: str
    level: int
    message: str
    values: dict = field(default_factory=dict)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _worst(*levels: int) -> int:
    return max(levels) if levels else OK


def build_statuses(s: dict) -> list[Status]:
    """``s`` keys (all optional): state, configure_error, control_rate_hz (configured), control_rate_measured_hz,
    chunks_published, inference_rate_hz, action_frequency_hz, cycle_latency_ms_p50/p99, observation_age_s,
    max_observation_age_s, stale, cycles, cycle_errors, cycle_errors_delta, deadline_misses, tokens_per_s,
    state_age_s, max_state_age_s, state_stale, no_chunk_s (seconds without a valid chunk), active_s (seconds since
    activation), future_stamp_max_s, cameras_masked (silent non-primary slots),
    active_requests, prompt_queue, kv_used_fraction, kv_used_bytes, kv_capacity_bytes, counters (dict),
    counters_delta (dict), engine (dict of engine metrics, reported under ``engine.``), uptime_s."""
    state = s.get("state", "unconfigured")
    counters = s.get("counters", {}) or {}
    delta = s.get("counters_delta", {}) or {}
    out: list[Status] = []

    # control -----------------------------------------------------------------------------------------------------
    target = float(s.get("control_rate_hz", 0.0) or 0.0)
    grace = max(CHUNK_GRACE_S, 3.0 * float(s.get("cycle_latency_ms_p99", 0.0) or 0.0) / 1e3)
    measured = float(s.get("control_rate_measured_hz", 0.0) or 0.0)
    age = s.get("observation_age_s")
    max_age = float(s.get("max_observation_age_s", 0.0) or 0.0)
    vals = {"state": state, "control_rate_hz": target, "control_rate_measured_hz": measured,
            "chunks_published": s.get("chunks_published", 0), "held_messages": s.get("held_messages", 0),
            "observation_age_s": -1.0 if age is None else float(age), "max_observation_age_s": max_age,
            "action_frequency_hz": float(s.get("action_frequency_hz", 0.0) or 0.0),
            "stale_behavior": s.get("stale_behavior", ""),
            "state_age_s": -1.0 if s.get("state_age_s") is None else float(s["state_age_s"]),
            "max_state_age_s": float(s.get("max_state_age_s", 0.0) or 0.0),
            "chunk_invalid": counters.get("chunk_invalid", 0),
            "seconds_since_last_chunk": -1.0 if s.get("no_chunk_s") is None else float(s["no_chunk_s"]),
            "actions_clipped_rows": counters.get("actions_clipped_rows", 0),
            "actions_step_limited_rows": counters.get("actions_step_limited_rows", 0)}
    for k in ("chunking", "rtc_delay_steps", "rtc_execution_horizon", "rtc_chunks", "rtc_rows_skipped",
              "rtc_guided", "rtc_ms_p50"):
        if k in s:
            vals[k] = s[k]
    limited = {k: delta.get(k, 0) for k in ("actions_clipped_rows", "actions_step_limited_rows") if delta.get(k, 0)}
    if state != "active":
        lvl, msg = ERROR, f"node is {state}"
        if s.get("configure_error"):
            msg += f": {s['configure_error']}"
    elif age is None:
        lvl, msg = (ERROR if s.get("stale") else WARN), "no camera frame received yet"
    elif s.get("stale"):
        lvl, msg = ERROR, (f"observation too old ({vals['observation_age_s']:.2f} s > {max_age:.2f} s): "
                           "cameras stopped? no new action chunks")
    elif s.get("state_stale"):
        st_age = s.get("state_age_s")
        lvl, msg = ERROR, ("no joint_states received" if st_age is None else
                           f"joint_states too old ({st_age:.2f} s > {float(s.get('max_state_age_s', 0)):.2f} s)") + \
            ": no new action chunks"
    elif s.get("no_chunk_s") is not None and s["no_chunk_s"] > grace and (s.get("active_s") or 0) > grace:
        lvl, msg = ERROR, (f"no valid action chunk for {s['no_chunk_s']:.0f} s "
                           f"({counters.get('chunk_invalid', 0)} invalid chunks dropped: non-finite model output?)")
    elif target > 0 and measured < 0.8 * target:
        lvl, msg = WARN, f"control rate {measured:.1f} Hz below 80% of {target:.1f} Hz"
    elif limited:
        lvl, msg = WARN, "actions limited: " + ", ".join(f"{k} +{v}" for k, v in limited.items())
    else:
        lvl, msg = OK, f"publishing at {measured:.1f} Hz"
    out.append(Status("oxygen_node: control", lvl, msg, vals))

    # inference ---------------------------------------------------------------------------------------------------
    vals = {"inference_rate_hz": float(s.get("inference_rate_hz", 0.0) or 0.0),
            "cycles": s.get("cycles", 0), "cycle_errors": s.get("cycle_errors", 0),
            "cycles_skipped_stale": counters.get("cycle_skipped_stale", 0),
            "cycles_skipped_state_stale": counters.get("cycle_skipped_state_stale", 0),
            "cycles_skipped_primary_image": counters.get("cycle_skipped_primary_image", 0),
            "chunk_invalid": counters.get("chunk_invalid", 0),
            "cycle_latency_ms_p50": s.get("cycle_latency_ms_p50", 0.0),
            "cycle_latency_ms_p99": s.get("cycle_latency_ms_p99", 0.0),
            "frame_age_at_cycle_ms_p50": s.get("frame_age_at_cycle_ms_p50", 0.0),
            "deadline_misses": s.get("deadline_misses", 0), "uptime_s": s.get("uptime_s", 0.0),
            "model": s.get("model", ""), "engine_mode": s.get("engine_mode", "")}
    for k, v in sorted((s.get("engine") or {}).items()):
        if isinstance(v, (int, float, str, bool)):
            vals[f"engine.{k}"] = v
    if s.get("configure_error"):
        lvl, msg = ERROR, f"configure failed: {s['configure_error']}"
    elif state != "active":
        lvl, msg = WARN, f"node is {state}"
    elif s.get("cycle_errors_delta", 0):
        lvl, msg = WARN, f"{s['cycle_errors_delta']} inference cycle(s) failed and were skipped"
    elif delta.get("chunk_invalid", 0):
        lvl, msg = WARN, f"{delta['chunk_invalid']} action chunk(s) were invalid (non-finite) and dropped"
    else:
        lvl, msg = OK, f"{vals['inference_rate_hz']:.1f} cycles/s"
    out.append(Status("oxygen_node: inference", lvl, msg, vals))

    # language ----------------------------------------------------------------------------------------------------
    lang_keys = ("prompt_dropped", "prompt_truncated", "request_rejected", "kv_full")
    vals = {"tokens_per_s": float(s.get("tokens_per_s", 0.0) or 0.0),
            "active_requests": s.get("active_requests", 0), "prompt_queue": s.get("prompt_queue", 0),
            "kv_used_fraction": float(s.get("kv_used_fraction", 0.0) or 0.0),
            "kv_used_bytes": s.get("kv_used_bytes", 0), "kv_capacity_bytes": s.get("kv_capacity_bytes", 0),
            "responses": counters.get("responses", 0), "memory_entries": counters.get("memory_entries", 0)}
    lang_keys += tuple(sorted(k for k in counters if k.startswith(("converse_rejected.", "request_cancelled"))))
    for k in lang_keys:
        vals[k] = counters.get(k, 0)
    vals["converse_goals"] = counters.get("converse_goals", 0)
    recent = {k: delta.get(k, 0) for k in lang_keys if delta.get(k, 0) and k != "request_cancelled"}
    if recent:
        lvl, msg = WARN, ", ".join(f"{k} +{v}" for k, v in recent.items())
    else:
        lvl, msg = OK, f"{vals['tokens_per_s']:.1f} tokens/s, {vals['active_requests']} active"
    out.append(Status("oxygen_node: language", lvl, msg, vals))

    # inputs ------------------------------------------------------------------------------------------------------
    vals = {k: v for k, v in sorted(counters.items())
            if k.startswith(("rejected.", "camera_failed.", "camera_silent."))}
    vals["rejected_total"] = sum(v for k, v in counters.items() if k.startswith("rejected."))
    for k in ("frames_received", "joint_states_received", "prompts_received", "instructions_received",
              "future_stamps", "state_silent"):
        vals[k] = counters.get(k, 0)
    vals["future_stamp_max_s"] = float(s.get("future_stamp_max_s", 0.0) or 0.0)
    silent = sorted(s.get("cameras_masked") or [])
    vals["cameras_masked"] = ",".join(silent)
    problems = []
    recent = {k: v for k, v in delta.items() if k.startswith("rejected.") and v}
    if recent:
        problems.append("rejected: " + ", ".join(f"{k[len('rejected.'):]} +{v}" for k, v in sorted(recent.items())))
    failed = {k: v for k, v in delta.items() if k.startswith("camera_failed.") and v}
    if failed:
        problems.append("unusable frames: " + ", ".join(f"{k[len('camera_failed.'):]} +{v}"
                                                         for k, v in sorted(failed.items())))
    if delta.get("future_stamps", 0):
        problems.append(f"{delta['future_stamps']} frame(s) stamped up to {vals['future_stamp_max_s']:.2f} s in the "
                        "future: check clock sync")
    if silent:
        problems.append(f"camera(s) silent, masked: {', '.join(silent)}")
    lvl, msg = (WARN, "; ".join(problems)) if problems else (OK, "inputs ok")
    out.append(Status("oxygen_node: inputs", lvl, msg, vals))
    if s.get("memory") is not None:
        out.append(memory_status(s["memory"], int(delta.get("memory_lost", 0) or 0)))
    return out


def memory_status(m: dict, lost_recently: int = 0) -> Status:
    """``oxygen_node: memory`` from ``MemoryLog.status()``: OK while entries are stored (or memory_db is ""); WARN
    while the database fails or cannot be opened (entries wait in memory) and after a corrupt file was moved aside;
    ERROR when entries were lost from a full backlog during the last period.  Every message names the file."""
    vals = {k: m.get(k, "") for k in ("path", "state", "entries_in_db", "stored_this_run", "backlog", "backlog_max",
                                      "write_errors", "lost", "last_error", "moved_aside")}
    path, state = m.get("path", ""), m.get("state", "")
    if state == "off":
        lvl, msg = OK, "memory_db is '': memory entries are published, not stored"
    elif state == "ok" and not m.get("moved_aside"):
        lvl, msg = OK, f"{m.get('entries_in_db', 0)} entries in {path}"
    elif state == "ok":
        lvl, msg = WARN, (f"memory DB {path} was corrupt: moved to {m['moved_aside']}; new database "
                          f"({m.get('entries_in_db', 0)} entries)")
    else:
        what = "cannot be opened" if state == "unavailable" else "write failing"
        lvl, msg = WARN, (f"memory DB {path} {what} ({m.get('last_error', '')}): {m.get('backlog', 0)} entries "
                          f"waiting in memory, {m.get('write_errors', 0)} write errors, {m.get('lost', 0)} lost")
    if lost_recently:
        lvl, msg = ERROR, f"{lost_recently} memory entries lost (backlog full): " + msg
    return Status("oxygen_node: memory", lvl, msg, vals)


def overall_level(statuses: list[Status]) -> int:
    return _worst(*(st.level for st in statuses))


def to_msg(statuses: list[Status], stamp=None):
    """DiagnosticArray with one DiagnosticStatus per Status (values as strings)."""
    from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue  # noqa: PLC0415

    arr = DiagnosticArray()
    if stamp is not None:
        arr.header.stamp = stamp
    for st in statuses:
        d = DiagnosticStatus()
        d.level = bytes([st.level])
        d.name = st.name
        d.message = st.message
        d.hardware_id = HARDWARE_ID
        d.values = [KeyValue(key=str(k), value=_fmt(v)) for k, v in st.values.items()]
        arr.status.append(d)
    return arr
