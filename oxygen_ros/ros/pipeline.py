"""One frame's path through the node, without ROS: inputs -> observation -> ``Engine.cycle`` -> action chunk buffer
and language outputs.

This file owns what happens in one inference cycle and what the node does with its results, so that the lifecycle
node (``ros/node.py``, live DDS, ROS clock) and ``oxygen bag-eval`` (a recorded bag, bag time) run the very same
logic.  ``Pipeline(settings, outputs, clock_ns=..., logger=...)`` builds the engine (``engine_factory``), the
``InputState`` (callbacks store inputs there), the ``ChunkBuffer`` (sampled by the control loop) and the
``RequestTracker`` (tokens, answers, memory entries -> ``outputs``).  ``step(now_ns)`` runs one cycle:
take the newest inputs, submit queued conversation prompts (with their request ids and, with
``conversation_memory_entries``, the newest memory entries as context), skip the frame (no new chunk) if the primary
camera's newest frame is older than ``max_observation_age_s`` or the joint state older than ``max_state_age_s``
(stale), convert and resize each camera's frame **in isolation** (a frame that fails masks only its own slot for
this cycle; only the primary camera can skip a cycle), schedule memory / subtask requests on the given clock, build
the ``Observation`` and call ``engine.cycle``; the engine calls back ``_on_actions`` (chunk -> buffer, at once,
before any language work), ``_on_token`` and ``_on_finished``.  Actions on their way to the buffer
(``ros/action_space.py``): masked columns of ``delta_action_mask`` get the joint state of this cycle's
``Observation`` added (the state the model saw, taken with the frame), then ``action_limits_*`` clip (clipped rows
counted: ``actions_clipped_rows``) and the buffer applies ``action_max_step_change`` to the rows that will be executed
(``actions_step_limited_rows``), ramping from what the robot executes - the plans sent before, or, when nothing was sent
yet (a new node), the newest joint state matched to the action columns by name.  With ``chunking: rtc`` each cycle first
takes the buffer's ``snapshot`` (what the robot executes from now on, converted back to the engine's output space
relative to the NEW observation's state) and passes ``engine.cycle(obs, rtc=RTCRequest(...))``; ``d`` is
``rtc_delay_steps`` or, when 0, the p90 of the recent snapshot -> chunk-ready latencies in control steps (rounded up),
and ``s`` is ``rtc_execution_horizon`` or, when 0, the p50 interval between chunks in control steps; the chunk is
installed on the snapshot's time origin (see ``ros/control.py``).  Other modes call ``engine.cycle(obs)`` exactly as
before.  A failing cycle is counted, logged and skipped; the pipeline keeps serving.  ``watch(now_ns)`` (also called
while no frame arrives) logs inputs that went silent or came back.  ``sample(now_ns)`` is what the control loop
publishes; ``submit`` / ``cancel`` (thread-safe) serve the action server too.
"""
from __future__ import annotations

import collections
import math
import threading
import time
import traceback
from typing import Callable

import numpy as np

from ..engine.requests import RTCRequest
from . import diagnostics as diag
from .action_space import ActionSpace, ActionSpaceError
from .control import ChunkBuffer, ControlSample, RTCSnapshot
from .engine_factory import BuiltEngine, build_engine
from .images import ImageError, image_to_rgb8
from .inputs import Freshness, InputState, RequestIds
from .language import ChunkOut, Outputs, RequestTracker
from .memory_log import MemoryLog
from .memory_store import MemoryQuery
from .parameters import SLOT_NAMES, ConfigureError, Settings

__all__ = ["Pipeline", "Every"]


class Every:
    """A periodic schedule on an external clock (ns): ``due(now)`` is True at the first call and then once per
    ``interval_s``.  ``interval_s <= 0`` = never."""

    def __init__(self, interval_s: float):
        self.interval_ns = int(float(interval_s) * 1e9)
        self._last: int | None = None

    def due(self, now_ns: int) -> bool:
        if self.interval_ns <= 0:
            return False
        if self._last is None or now_ns - self._last >= self.interval_ns:
            self._last = now_ns
            return True
        return False


class Pipeline:
    def __init__(self, settings: Settings, outputs: Outputs, *, clock_ns: Callable[[], int], logger,
                 counters: diag.Counters | None = None,
                 engine_factory: Callable[..., BuiltEngine] = build_engine):
        self.settings = s = settings
        self.out = outputs
        self.clock_ns = clock_ns
        self.logger = logger
        self.counters = counters or diag.Counters()
        self.report = diag.Reporter(self.counters, logger, clock=lambda: clock_ns() / 1e9)   # throttled on our clock
        built = engine_factory(s, on_actions=self._on_actions, on_token=self._on_token,
                               on_finished=self._on_finished)
        self.engine = built.engine
        self.info = built.info
        self.action_dims, self.horizon = int(built.action_dims), int(built.horizon)
        self.max_requests = int(built.max_requests)     # the engine's batch capacity (Converse goal limit)
        self.action_names = s.action_names
        from oxygen_ros.model.processing import resize_with_pad, unusable_image_reason  # noqa: PLC0415

        size = int(built.image_size)
        self._resize = lambda img: resize_with_pad(img, size, size)
        self.new_request_id = RequestIds()           # ids of every request this pipeline submits
        self.inputs = InputState(s, self.report, built.state_dim_max,
                                 image_check=lambda h, w: unusable_image_reason(h, w, size),
                                 on_prompt_event=self._prompt_event, new_request_id=self.new_request_id)
        t0 = clock_ns()
        self._camera_watch = [Freshness(self.report, f"camera_silent.{SLOT_NAMES[i]}", f"camera {topic!r}",
                                        s.max_observation_age_s, started_ns=t0) if topic else None
                              for i, topic in enumerate(s.slot_topics)]
        self._state_required = bool(s.state_names)      # a policy with named state joints cannot act without them
        self._state_watch = Freshness(self.report, "state_silent", "joint_states", s.state_age_limit_s,
                                      started_ns=t0)
        self.last_chunk_ns: int | None = None           # when the last valid chunk was produced (clock ns)
        try:
            self.space = ActionSpace.build(self.action_dims, delta_action_mask=s.delta_action_mask,
                                           limits_min=s.action_limits_min, limits_max=s.action_limits_max,
                                           max_step_change=s.action_max_step_change,
                                           state_dim=len(s.state_names) if s.state_names else None)
        except ActionSpaceError as exc:
            raise ConfigureError(str(exc)) from exc
        self.step_dt = 1.0 / s.control_rate_hz
        # action column -> joint state entry of the same name (-1: none), for the step limit's anchor when the buffer
        # knows no plan (after a start or activate): only by name, a positional guess could anchor to another joint
        names = s.action_names if len(s.action_names) == self.action_dims else []
        self._hold_index = np.array([s.state_names.index(n) if n in s.state_names else -1 for n in names], int)
        self.buffer = ChunkBuffer(self.step_dt, blend_steps=s.blend_steps, stale_behavior=s.stale_behavior,
                                  time_origin=s.chunk_time_origin, chunking=s.chunking,
                                  step_limit=self.space.limit_steps if self.space.max_step is not None else None)
        # per cycle: the Observation's joint state and the RTC snapshot (read back by _on_actions)
        self._cycle_state: np.ndarray | None = None
        self._cycle_snap: RTCSnapshot | None = None
        self._cycle_t0_ns = 0                            # when the cycle's engine call started (clock ns)
        self.chunk_delay_s: collections.deque = collections.deque(maxlen=50)     # engine call start -> chunk ready
        self.chunk_interval_s: collections.deque = collections.deque(maxlen=50)  # between consecutive chunks
        self.rtc_ms: collections.deque = collections.deque(maxlen=200)           # engine-reported RTC cost
        self.rtc_last: tuple[int, int] = (0, 0)          # (d, s) of the last RTC request
        self.rtc_guided = 0                              # chunks the engine reports as guided
        self.memory = MemoryLog(s.memory_db, self.report)
        self.requests = RequestTracker(outputs, self.report, clock_ns, memory=self.memory,
                                       frame_info=self._frame_info, default_memory_prompt=s.memory_prompt)
        self._memory_every = Every(s.memory_interval_s)
        self._subtask_every = Every(s.subtask_interval_s if s.subtask_enabled else 0.0)
        self._lock = threading.Lock()
        self._frames: collections.OrderedDict = collections.OrderedDict()   # engine frame_index -> (cap ns, id)
        self._cycle_frame = (0, "")                    # (capture ns, frame_id) of the cycle running now
        self._inject: collections.deque = collections.deque(maxlen=16)
        # statistics for /diagnostics
        self.cycle_meter = diag.RateMeter(2.0)
        self.chunk_meter = diag.RateMeter(2.0)
        self.token_meter = diag.RateMeter(2.0)
        self.cycle_ms: collections.deque = collections.deque(maxlen=200)
        self.wait_ms: collections.deque = collections.deque(maxlen=200)    # frame capture -> cycle start
        self.cycles = 0
        self.cycle_errors = 0
        self.deadline_misses = 0

    # ---------------------------------------------------------------------------------------------- the cycle
    def step(self, now_ns: int | None = None) -> str:
        """One inference cycle at ``now_ns`` (default: the clock). Returns "ran", "stale" or "error"."""
        try:
            return self._step(self.clock_ns() if now_ns is None else now_ns)
        except Exception as exc:  # noqa: BLE001 - a failed cycle is skipped; the node keeps serving
            self.cycle_errors += 1
            self.report.event("cycle_errors", f"inference cycle failed and was skipped: {type(exc).__name__}: {exc}",
                              level="error")
            if self.cycle_errors == 1:
                self.logger.error(traceback.format_exc())
            return "error"

    def _step(self, now: int) -> str:
        from oxygen_ros.model.processing import Observation  # noqa: PLC0415 - torch is loaded with the engine

        s = self.settings
        inp = self.inputs.take()
        for p in inp.prompts:          # queued in the engine even if this frame is skipped
            self.submit("conversation", p.text, request_id=p.request_id)
        camera_stale, state_stale = self._freshness(inp.frames, inp.joint, now)
        if camera_stale:
            self.report.count("cycle_skipped_stale")
            return "stale"
        if state_stale:
            self.report.count("cycle_skipped_state_stale")
            return "stale"
        prim = inp.frames[self.inputs.primary_slot]
        self.wait_ms.append(prim.age_ns(now) / 1e6)
        frame_id = prim.msg.header.frame_id or ("camera_" + SLOT_NAMES[self.inputs.primary_slot])
        max_age_ns = int(s.max_observation_age_s * 1e9)
        images = [None, None, None]
        for slot, fr in enumerate(inp.frames):
            if fr is None or fr.age_ns(now) > max_age_ns:
                continue                   # a silent camera is masked (Freshness logs it)
            images[slot] = self._slot_image(slot, fr)
            if images[slot] is None and slot == self.inputs.primary_slot:
                self.report.count("cycle_skipped_primary_image")
                return "error"
        state = None if inp.joint is None else inp.joint.position
        if state is None:
            self.report.count("state_missing")
            if self.space.has_delta:
                self.report.event("cycle_skipped_no_state", "delta_action_mask is set but no joint state was "
                                  "received: delta actions cannot be made absolute; cycle skipped")
                return "stale"
        if self._memory_every.due(now):
            self.submit("memory", s.memory_prompt)
        if inp.instruction and self._subtask_every.due(now):
            self.submit("subtask", inp.instruction)
        self._cycle_frame = (prim.capture_ns, frame_id)
        obs = Observation(images=images, state=state, prompt=inp.instruction, stamp=prim.capture_ns / 1e9)
        if self._injected("cycle_exception"):
            raise RuntimeError("injected fault (debug_fault_injection)")
        self._cycle_state = None if state is None else np.array(state, dtype=np.float32)
        kw = {}
        self._cycle_t0_ns = self.clock_ns()
        self._cycle_snap = None
        if s.chunking == "rtc":
            kw["rtc"] = self._rtc_request(self._cycle_t0_ns, self._cycle_state)
        t0 = time.perf_counter()
        stats = self.engine.cycle(obs, **kw)
        self.cycles += 1
        self.cycle_meter.tick()
        self.cycle_ms.append((time.perf_counter() - t0) * 1e3)
        if isinstance(stats, dict) and stats.get("deadline_missed"):
            self.deadline_misses += 1
        return "ran"

    # ---------------------------------------------------------------------------------------------- RTC
    def rtc_delay_steps(self) -> int:
        """d: ``rtc_delay_steps``, or the p90 of the recent engine-call -> chunk-ready latencies in control steps
        (rounded up; 0 before any chunk), at most H."""
        if self.settings.rtc_delay_steps > 0:
            return min(int(self.settings.rtc_delay_steps), self.horizon)
        if not self.chunk_delay_s:
            return 0
        p90 = float(np.percentile(np.asarray(self.chunk_delay_s), 90))
        return min(self.horizon, max(0, math.ceil(p90 / self.step_dt - 1e-9)))

    def rtc_execution_horizon(self, d: int) -> int:
        """s: ``rtc_execution_horizon``, or the p50 interval between chunks in control steps (rounded up); in
        [max(d, 1), H]."""
        s = int(self.settings.rtc_execution_horizon)
        if s <= 0:
            s = (math.ceil(float(np.percentile(np.asarray(self.chunk_interval_s), 50)) / self.step_dt - 1e-9)
                 if self.chunk_interval_s else self.horizon)
        return int(min(self.horizon, max(s, d, 1)))

    def _rtc_request(self, now_ns: int, state) -> RTCRequest:
        """The rows the robot executes from ``now_ns`` on (the new chunk's time origin), in the engine's output space
        relative to ``state`` (this cycle's observation), with d and s."""
        snap = self.buffer.snapshot(now_ns / 1e9)
        d = self.rtc_delay_steps()
        ex = self.rtc_execution_horizon(d)
        beta = float(self.settings.rtc_max_guidance_weight)
        self.rtc_last = (d, ex)
        if snap is None or (self.space.has_delta and state is None):
            return RTCRequest(np.zeros((0, self.action_dims), np.float32), d, ex, beta)
        self._cycle_snap = snap
        prev = self.space.to_delta(snap.rows[:self.horizon], state)
        return RTCRequest(np.ascontiguousarray(prev, dtype=np.float32), d, ex, beta)

    def _slot_image(self, slot: int, fr):
        """The model-ready RGB image (resized with pad) of one camera's frame, or None (counted, logged per slot)
        if it cannot be converted: only this slot is masked for this cycle."""
        name = SLOT_NAMES[slot]
        try:
            if self._injected(f"image_exception:{slot}"):
                raise RuntimeError("injected image fault (debug_fault_injection)")
            return self._resize(image_to_rgb8(fr.msg))
        except Exception as exc:  # noqa: BLE001 - one bad camera must never stop the actions of the others
            what = ("the cycle is skipped (primary camera)" if slot == self.inputs.primary_slot
                    else "this camera is masked for this cycle")
            self.report.event(f"camera_failed.{name}", f"camera {self.settings.slot_topics[slot]!r}: frame cannot "
                                                       f"be used ({type(exc).__name__}: {exc}); {what}")
            return None

    def _freshness(self, frames: list, joint, now: int) -> tuple[bool, bool]:
        """(primary camera stale, joint state stale) at ``now``; logs every input that went silent / came back."""
        stale = [w.update(None if fr is None else fr.age_ns(now), now,
                          "no new action chunks (check the camera driver and topic remaps; if frames do arrive, "
                          "check clock sync or set stamp_source: receive)" if i == self.inputs.primary_slot
                          else "its slot is masked: the model runs without this camera")
                 if w is not None else False
                 for i, (w, fr) in enumerate(zip(self._camera_watch, frames))]
        state_stale = False
        if self._state_required or joint is not None:
            state_stale = self._state_watch.update(None if joint is None else now - joint.recv_ns, now,
                                                   "no new action chunks (is the joint state publisher running?)")
        return stale[self.inputs.primary_slot], state_stale

    def watch(self, now_ns: int | None = None) -> tuple[bool, bool]:
        """Freshness of the inputs without running a cycle (the node calls this while no frame arrives)."""
        now = self.clock_ns() if now_ns is None else now_ns
        try:
            return self._freshness(self.inputs.newest_frames(), self.inputs.newest_joint(), now)
        except Exception as exc:  # noqa: BLE001 - watching must never stop the inference thread
            self.report.log("watch", f"input watch failed: {exc}", level="error")
            return False, False

    def submit(self, kind: str, text: str, *, request_id: int | None = None, **options) -> int | None:
        """Queue a language request in the engine (thread-safe); returns its id, or None if the engine refused it
        (then its end, finish_reason "rejected", is published).  ``options``: max_new_tokens, temperature, top_p."""
        rid = self.new_request_id() if request_id is None else int(request_id)
        self.requests.register(rid, kind, text)
        kw = {k: v for k, v in options.items() if v is not None}
        if kind == "conversation" and self.settings.conversation_memory_entries > 0:
            kw["context"] = self._memory_context(int(self.settings.conversation_memory_entries))
        try:
            self.engine.submit(kind=kind, prompt=text, request_id=rid, **kw)
        except Exception as exc:  # noqa: BLE001 - engine refuses (bad prompt, bad option, id in use)
            self.report.event("request_rejected", f"{kind} request rejected: {exc}")
            self.requests.end(rid, kind, text, "rejected", f"{type(exc).__name__}: {exc}")
            return None
        return rid

    def _memory_context(self, n: int) -> tuple:
        """The texts of the newest ``n`` memory entries, oldest first."""
        try:
            return tuple(e.text for e in reversed(self.memory.query(MemoryQuery(limit=n))))
        except Exception as exc:  # noqa: BLE001 - no context rather than no answer
            self.report.log("memory_context", f"memory context unavailable: {exc}")
            return ()

    def cancel(self, request_id: int) -> bool:
        """Ask the engine to stop a request (thread-safe; see Engine.cancel)."""
        cancel = getattr(self.engine, "cancel", None)
        return bool(cancel(request_id)) if cancel is not None else False

    def _prompt_event(self, p, event: str, detail: str) -> None:
        if event == "accepted":
            self.requests.register(p.request_id, "conversation", p.text)
        else:
            self.requests.end(p.request_id, "conversation", p.text, event, detail)

    def inject(self, fault: str) -> None:
        """Tests only (``debug_fault_injection``): make the next cycle fail in a named way (``cycle_exception``,
        ``image_exception:<slot>``, ``chunk_nonfinite``: the engine's next chunk comes back as NaN), or make the memory
        database refuse every write (``memory_db_fail``) / work again (``memory_db_ok``)."""
        fault = fault.strip()
        if fault in ("memory_db_fail", "memory_db_ok"):
            self.memory.fail_writes(fault == "memory_db_fail")
            return
        self._inject.append(fault)

    def _injected(self, fault: str) -> bool:
        """Whether the oldest injected fault is ``fault`` (then it is consumed)."""
        if self._inject and self._inject[0] == fault:
            self._inject.popleft()
            return True
        return False

    # ---------------------------------------------------------------------------------------------- engine callbacks
    def _on_actions(self, res) -> None:
        now_ns = self.clock_ns()
        cap_ns, frame_id = self._cycle_frame
        if not cap_ns:
            cap_ns = int(round(res.stamp * 1e9))
        actions = np.asarray(res.actions, dtype=np.float32)
        if self._injected("chunk_nonfinite"):
            actions = np.full_like(actions, np.nan)
        if actions.ndim != 2 or not np.all(np.isfinite(actions)):
            self.report.event("chunk_invalid", f"engine returned an invalid chunk (shape {actions.shape}, finite "
                                               f"{bool(np.all(np.isfinite(actions)))}); dropped", level="error")
            return
        try:
            actions = self.space.to_absolute(actions, self._cycle_state)
        except ValueError as exc:
            self.report.event("chunk_invalid", f"action chunk dropped: {exc}", level="error")
            return
        actions, clipped = self.space.clip(actions)
        if clipped:
            self.report.count("actions_clipped_rows", clipped)
            self.report.log("actions_clipped", f"{clipped} of {len(actions)} action rows clipped to "
                                               "action_limits_min/max", period_s=10.0)
        with self._lock:
            self._frames[res.frame_index] = (cap_ns, frame_id)
            while len(self._frames) > 4096:
                self._frames.popitem(last=False)
        snap, self._cycle_snap = self._cycle_snap, None
        info = self.buffer.push(actions, chunk_id=res.chunk_id, frame_index=res.frame_index,
                                capture_time=cap_ns / 1e9, ready_time=now_ns / 1e9, latency_ms=res.latency_ms,
                                capture_ns=cap_ns, frame_id=frame_id,
                                rtc_origin=None if snap is None else snap.origin, hold=self._hold_position())
        if info.step_limited_rows:
            self.report.count("actions_step_limited_rows", info.step_limited_rows)
            self.report.log("actions_step_limited", f"{info.step_limited_rows} action rows limited by "
                                                    "action_max_step_change", period_s=10.0)
        if self._cycle_t0_ns:
            self.chunk_delay_s.append(max(0.0, (now_ns - self._cycle_t0_ns) / 1e9))
        if self.last_chunk_ns is not None:
            self.chunk_interval_s.append(max(0.0, (now_ns - self.last_chunk_ns) / 1e9))
        if res.guided:
            self.rtc_guided += 1
            self.rtc_ms.append(float(res.rtc_ms))
        self.chunk_meter.tick()
        self.last_chunk_ns = now_ns
        self.out.chunk(ChunkOut(res.frame_index, res.chunk_id, actions, cap_ns, now_ns, res.latency_ms, frame_id,
                                self.buffer.view(now_ns / 1e9)))

    def _hold_position(self) -> np.ndarray | None:
        """[A] the newest joint state in action columns (NaN where no state joint has the column's name), or None:
        what the robot executes now when the buffer has sent it no plan yet."""
        joint = self.inputs.newest_joint()
        if joint is None or not (self._hold_index >= 0).any():
            return None
        pos = np.asarray(joint.position, dtype=np.float64)
        ok = (self._hold_index >= 0) & (self._hold_index < len(pos))
        return np.where(ok, pos[np.where(ok, self._hold_index, 0)], np.nan)

    def _on_token(self, ev) -> None:
        self.token_meter.tick()
        self.requests.on_token(ev)

    def _on_finished(self, res) -> None:
        self.requests.on_finished(res)

    def _frame_info(self, frame_index: int) -> tuple:
        """(capture ns, frame_id) of an engine frame (recorded from its ActionResult), for memory entries."""
        with self._lock:
            return self._frames.get(frame_index, (0, self._cycle_frame[1]))

    # ---------------------------------------------------------------------------------------------- control side
    def sample(self, now_ns: int) -> ControlSample | None:
        """The not-yet-executed remainder of the newest chunk at ``now_ns`` (None = publish nothing)."""
        return self.buffer.sample(now_ns / 1e9)

    # ---------------------------------------------------------------------------------------------- lifecycle
    def reset_io(self) -> None:
        """Forget received inputs and the current chunk (on activate); what was sent stays known to the step limit
        (the controller holds the last trajectory's end while the node is inactive)."""
        self.inputs.clear()
        self.buffer.clear()
        now = self.clock_ns()
        for w in [*self._camera_watch, self._state_watch]:
            if w is not None:
                w.restart(now)

    def close(self) -> None:
        self.requests.clear()
        self.memory.close()
        self.engine = None

    def engine_metrics(self) -> dict:
        eng = self.engine
        if eng is None or not hasattr(eng, "metrics"):
            return {}
        try:
            return dict(eng.metrics())
        except Exception as exc:  # noqa: BLE001
            self.report.log("engine_metrics", f"engine.metrics() failed: {exc}", period_s=10.0)
            return {}
