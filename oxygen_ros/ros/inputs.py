"""What the node has received: the newest frame of each camera slot, the newest joint state, the instruction and the
bounded queue of conversation prompts.

This file owns input validation and the "latest value" semantics, without rclpy: the ROS callbacks (and
``oxygen bag-eval``, with bag time as the clock) hand it messages (duck-typed ``sensor_msgs/Image``,
``sensor_msgs/JointState``, plain strings) together with the current time in ns; the inference thread takes one
consistent ``CycleInputs`` per cycle.  A bad input is rejected with a reason (``Reporter.reject``: counted as
``rejected.<reason>``, logged per reason) and never replaces the previous good value; that includes frames whose
header is consistent but which the model cannot use (a 1000x2 strip shrinks to nothing in resize-with-pad).
A camera whose ``header.stamp`` is ahead of this node's clock (more than ``FUTURE_TOLERANCE_S``) is counted
(``future_stamps``, "check clock sync") and its frames' age is judged by their receive time instead, so clock skew
cannot make stale frames look fresh.  ``Freshness`` watches one input's age and logs once when it goes silent, while
it stays silent (every ``repeat_s``) and when it comes back.  Every conversation prompt gets its request id when it
arrives; ``on_prompt_event(prompt, event, detail)`` hears that it was "accepted", or that it was "rejected" (empty)
or "dropped" (queue full), so the request's end is published even though it never ran.  Thread-safe: callbacks and
the inference thread may run concurrently; ``wait_primary`` lets the inference thread sleep until a new frame of the
primary (first configured) camera arrives.
"""
from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field
from typing import Callable

import numpy as np


from .diagnostics import Reporter
from .images import ImageError, validate_image
from .parameters import Settings

__all__ = ["Frame", "JointSample", "Prompt", "CycleInputs", "InputState", "Freshness", "stamp_ns",
           "FUTURE_TOLERANCE_S"]

# A header stamp further than this ahead of the receiving node's clock is a clock-sync problem, not latency.
FUTURE_TOLERANCE_S = 0.05


def stamp_ns(stamp) -> int:
    """builtin_interfaces/Time (rclpy or rosbags) -> integer ns."""
    return int(stamp.sec) * 1_000_000_000 + int(stamp.nanosec)


class RequestIds:
    """Thread-safe request ids 1, 2, ... (one allocator per pipeline, so a rerun of a bag numbers requests alike)."""

    def __init__(self):
        self._next = 1
        self._lock = threading.Lock()

    def __call__(self) -> int:
        with self._lock:
            rid, self._next = self._next, self._next + 1
            return rid


@dataclass(frozen=True)
class Frame:
    msg: object                  # the sensor_msgs/Image as received (converted to RGB only when a cycle uses it)
    capture_ns: int              # header.stamp (stamp_source: header) or receive time; what outputs are stamped with
    recv_ns: int
    age_ref_ns: int = 0          # the time its age is measured from: capture_ns, or recv_ns when stamped in the future

    def age_ns(self, now_ns: int) -> int:
        return now_ns - (self.age_ref_ns or self.capture_ns)


@dataclass(frozen=True)
class JointSample:
    position: np.ndarray         # [n] float32, ordered by state_joint_names
    recv_ns: int


@dataclass(frozen=True)
class Prompt:
    text: str
    recv_ns: int
    request_id: int = 0          # allocated on arrival (the pipeline's new_request_id), carried into engine.submit


@dataclass
class CycleInputs:
    """One consistent view of the inputs, taken by the inference thread at the start of a cycle."""
    frames: list                 # per slot: Frame | None
    joint: JointSample | None
    instruction: str
    prompts: list = field(default_factory=list)     # conversation prompts taken from the queue (<= 4 per cycle)
    primary_seq: int = 0


class InputState:
    def __init__(self, settings: Settings, report: Reporter, state_dim_max: int | None = None,
                 image_check: Callable[[int, int], str | None] | None = None,
                 on_prompt_event=lambda prompt, event, detail: None, new_request_id=None):
        self.settings = settings
        self.report = report
        self.on_prompt_event = on_prompt_event
        self.new_request_id = new_request_id or RequestIds()
        self.state_dim_max = state_dim_max
        self.image_check = image_check           # (height, width) -> why the model cannot use such a frame, or None
        self.future_max_s = 0.0                  # largest future offset of a header stamp seen (clock skew)
        self.primary_slot = settings.primary_slot
        self._state_names = settings.state_names
        self._state_index = {n: i for i, n in enumerate(self._state_names)}
        self._cond = threading.Condition()
        self._frames: list = [None, None, None]
        self._primary_seq = 0
        self._joint: JointSample | None = None
        self._instruction = ""
        self._prompts: collections.deque = collections.deque()

    # ---------------------------------------------------------------------------------------------- callbacks
    def on_image(self, slot: int, msg, now_ns: int) -> bool:
        """Store the newest frame of ``slot`` if its header is consistent with its data; returns whether stored."""
        self.report.count("frames_received")
        topic = self.settings.slot_topics[slot]
        try:
            validate_image(msg)
        except ImageError as exc:
            self.report.reject(f"image_{exc.reason}", f"{topic}: {exc}")
            return False
        why = self.image_check and self.image_check(int(msg.height), int(msg.width))
        if why:
            self.report.reject("image_aspect", f"{topic}: {why}")
            return False
        cap = (stamp_ns(msg.header.stamp) if self.settings.stamp_source == "header" else 0) or now_ns
        ref = cap
        ahead = (cap - now_ns) / 1e9
        if ahead > FUTURE_TOLERANCE_S:
            ref = now_ns
            self.future_max_s = max(self.future_max_s, ahead)
            self.report.event("future_stamps", f"{topic}: header.stamp is {ahead:.3f} s ahead of this node's clock: "
                                               "check clock sync (chrony/NTP) between the camera host and this one; "
                                               "the receive time is used to judge the frame's age")
        with self._cond:
            self._frames[slot] = Frame(msg, cap, now_ns, ref)
            if slot == self.primary_slot:
                self._primary_seq += 1
                self._cond.notify_all()
        return True

    def on_joint_state(self, msg, now_ns: int) -> bool:
        self.report.count("joint_states_received")
        pos = np.asarray(msg.position, dtype=np.float64)
        names = list(msg.name)
        if self._state_names:
            if len(names) != len(pos):
                self.report.reject("joint_size", f"{len(names)} names but {len(pos)} positions")
                return False
            idx = {n: i for i, n in enumerate(names)}
            missing = [n for n in self._state_names if n not in idx]
            if missing:
                unknown = [n for n in names if n not in self._state_index]
                self.report.reject("joint_names", f"missing {missing[:4]}{'...' if len(missing) > 4 else ''}"
                                                  f"{f'; unknown {unknown[:4]}' if unknown else ''}")
                return False
            vec = pos[[idx[n] for n in self._state_names]]
        else:
            if len(pos) == 0:
                self.report.reject("joint_size", "empty position vector")
                return False
            vec = pos
        if self.state_dim_max and len(vec) > self.state_dim_max:
            self.report.reject("joint_size", f"{len(vec)} joint positions, more than the model's state size "
                                             f"{self.state_dim_max} (set state_joint_names)")
            return False
        if not np.all(np.isfinite(vec)):
            self.report.reject("joint_nonfinite", "NaN/inf in joint positions")
            return False
        with self._cond:
            self._joint = JointSample(vec.astype(np.float32), now_ns)
        return True

    def _clip(self, text: str, what: str) -> str | None:
        text = text.strip()
        if not text:
            self.report.reject(f"{what}_empty", f"empty {what}")
            return None
        limit = int(self.settings.max_prompt_chars)
        if len(text) > limit:
            self.report.event("prompt_truncated", f"{what} of {len(text)} characters truncated to {limit}")
            text = text[:limit]
        return text

    def on_instruction(self, text: str) -> str | None:
        """The manipulation task; returns the new instruction when it changed (for a log line), else None."""
        self.report.count("instructions_received")
        text = self._clip(text, "instruction")
        if text is None:
            return None
        with self._cond:
            changed = text != self._instruction
            self._instruction = text
        return text if changed else None

    def on_prompt(self, text: str, now_ns: int) -> bool:
        """Queue a conversation prompt with a new request id (the oldest is dropped when the queue is full); returns
        whether queued."""
        self.report.count("prompts_received")
        clipped = self._clip(text, "prompt")
        if clipped is None:
            self.on_prompt_event(Prompt(text, now_ns, self.new_request_id()), "rejected", "empty prompt")
            return False
        p = Prompt(clipped, now_ns, self.new_request_id())
        self.on_prompt_event(p, "accepted", "")
        dropped = []
        with self._cond:
            self._prompts.append(p)
            while len(self._prompts) > int(self.settings.prompt_queue_size):
                dropped.append(self._prompts.popleft())
        for old in dropped:
            self.report.event("prompt_dropped", "conversation prompt queue full: oldest prompt dropped")
            self.on_prompt_event(old, "dropped", f"node prompt queue full (prompt_queue_size "
                                                 f"{self.settings.prompt_queue_size})")
        return True

    # ---------------------------------------------------------------------------------------------- inference side
    @property
    def primary_seq(self) -> int:
        with self._cond:
            return self._primary_seq

    def wait_primary(self, seen_seq: int, timeout: float, stop=lambda: False) -> bool:
        """Block until a primary frame newer than ``seen_seq`` arrived (True) or ``timeout``/``stop()`` (False)."""
        with self._cond:
            self._cond.wait_for(lambda: stop() or self._primary_seq != seen_seq, timeout=timeout)
            return self._primary_seq != seen_seq and not stop()

    def wake(self) -> None:
        """Wake ``wait_primary`` (e.g. on shutdown)."""
        with self._cond:
            self._cond.notify_all()

    def take(self, max_prompts: int = 4) -> CycleInputs:
        """The newest frames, joint state and instruction, and up to ``max_prompts`` queued prompts (removed)."""
        with self._cond:
            prompts = [self._prompts.popleft() for _ in range(min(max_prompts, len(self._prompts)))]
            return CycleInputs(list(self._frames), self._joint,
                               self._instruction or self.settings.default_instruction, prompts, self._primary_seq)

    def newest_primary(self) -> Frame | None:
        with self._cond:
            return self._frames[self.primary_slot]

    def newest_frames(self) -> list:
        with self._cond:
            return list(self._frames)

    def newest_joint(self) -> JointSample | None:
        with self._cond:
            return self._joint

    def queued_prompts(self) -> int:
        with self._cond:
            return len(self._prompts)

    def clear(self) -> None:
        with self._cond:
            self._frames = [None, None, None]
            self._joint = None
            self._prompts.clear()


class Freshness:
    """Watches one input's age against ``max_age_s`` and reports transitions: when it goes silent (a WARN log line and
    one ``<key>`` count per episode), while it stays silent (a reminder every ``repeat_s``) and when it is back (an
    info line)."""

    def __init__(self, report: Reporter, key: str, what: str, max_age_s: float, repeat_s: float = 5.0,
                 started_ns: int = 0):
        self.report, self.key, self.what = report, key, what
        self.max_age_ns = int(max_age_s * 1e9)
        self.repeat_s = repeat_s
        self.started_ns = started_ns             # before any sample, silence counts from here (start-up grace)
        self.silent_since_ns: int | None = None

    def update(self, age_ns: int | None, now_ns: int, consequence: str) -> bool:
        """``age_ns`` of the newest sample (None = none yet); returns True while it is too old."""
        if not self.started_ns:               # a simulated clock that had not started (time 0) when we began
            self.started_ns = now_ns
        stale = age_ns is None or age_ns > self.max_age_ns
        in_grace = age_ns is None and now_ns - self.started_ns <= self.max_age_ns
        if stale and not in_grace:
            if self.silent_since_ns is None:
                self.silent_since_ns = self.started_ns if age_ns is None else now_ns - age_ns
                self.report.count(self.key)
            age = "no message yet" if age_ns is None else f"newest is {age_ns / 1e9:.2f} s old"
            self.report.log(self.key, f"{self.what}: {age} (limit {self.max_age_ns / 1e9:g} s): {consequence}",
                            period_s=self.repeat_s)
        elif not stale and self.silent_since_ns is not None:
            gap = (now_ns - self.silent_since_ns) / 1e9
            self.silent_since_ns = None
            self.report.log(self.key + ".back", f"{self.what}: receiving again after {gap:.1f} s", level="info",
                            period_s=0.0)
        return stale

    def restart(self, now_ns: int) -> None:
        """Forget the current episode; silence counts from ``now_ns`` (e.g. on activation)."""
        self.started_ns, self.silent_since_ns = now_ns, None
