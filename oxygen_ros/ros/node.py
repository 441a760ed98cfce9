"""``oxygen_node``: the lifecycle node, a thin ROS shell around ``Pipeline`` (``ros/pipeline.py``).

This file owns the ROS side: parameter declaration (the table is ``ros/parameters.py``), subscriptions, publishers,
QoS, the two threads and the lifecycle.  *configure* reads a ``Settings`` and builds the ``Pipeline`` (model, engine
with its preallocated KV pool, memory database); *activate* creates the subscriptions, starts the inference thread and
the control loop and activates the publishers; *deactivate* stops them; *cleanup* frees the pipeline.  With
``autostart`` (default) the node configures and activates itself; if configure fails (missing/corrupt checkpoint, bad
parameter) it logs why, publishes one ERROR diagnostic and exits with status 2; without autostart it stays
unconfigured, reports ERROR on ``/diagnostics`` and a lifecycle manager may retry.
One frame's path: ``_on_image`` hands the message to ``pipeline.inputs`` (validate, keep the newest per slot) -> the
inference thread (``_inference_loop``) waits for a new primary-camera frame (at most ``frame_rate_hz``) and calls
``pipeline.step`` -> ``Engine.cycle`` -> the chunk lands in the ``ChunkBuffer`` -> the control loop
(``_control_loop``: steady-clock absolute deadlines in its own thread, never waiting for inference or the executor;
with ``use_sim_time`` a ROS timer on the simulated clock) publishes ``action_chunk`` at ``control_rate_hz`` (and, with
``outputs: [.., joint_trajectory]``, each new chunk once as ``joint_trajectory``, from the inference thread); tokens,
answers and memory entries reach ``_Publishers`` through the pipeline's ``RequestTracker``.  While active the node also
serves the ``converse`` action (``converse_server.py``) and the ``memory/query`` / ``memory/clear`` services
(``memory_services.py``).
Run as ``oxygen_node`` / ``oxygen node`` / ``ros2 run oxygen_ros oxygen_node`` / ``python -m oxygen_ros.ros.node``.
"""
from __future__ import annotations

import gc
import os
import re
import signal
import sys
import threading
import time
import traceback

import rclpy
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup
from rclpy.executors import ExternalShutdownException, MultiThreadedExecutor
from rclpy.lifecycle import LifecycleNode, LifecycleState, TransitionCallbackReturn
from rclpy.qos import HistoryPolicy, QoSProfile, ReliabilityPolicy, qos_profile_sensor_data
from rclpy.signals import SignalHandlerOptions
from diagnostic_msgs.msg import DiagnosticArray
from sensor_msgs.msg import Image, JointState
from std_msgs.msg import String
from trajectory_msgs.msg import JointTrajectory

from oxygen_ros.msg import ActionChunk, ConversationResponse, LanguageToken, MemoryEntry

from . import diagnostics as diag
from . import messages
from .converse_server import ConverseServer
from .engine_factory import build_engine
from .language import ChunkOut, MemoryOut, ResponseOut, TokenOut
from .memory_services import MemoryServices
from .parameters import (PARAMETERS, SLOT_NAMES, STRING_ARRAY, ConfigureError, Settings, check_value, descriptor,
                         ros_args, refuse_stray_args)
from .pipeline import Pipeline

__all__ = ["OxygenNode", "main", "PARAMETERS"]

NODE_NAME = "oxygen_node"


class _Publishers:
    """The pipeline's ``Outputs``: records -> messages on the node's lifecycle publishers."""

    def __init__(self, node: "OxygenNode"):
        self.node = node
        self.actions = node.create_lifecycle_publisher(ActionChunk, "action_chunk", 10)
        self.trajectory = None          # created at configure when outputs has joint_trajectory
        self.tokens = node.create_lifecycle_publisher(LanguageToken, "language/tokens", 100)
        self.response_text = node.create_lifecycle_publisher(String, "conversation/response", 10)
        self.results = node.create_lifecycle_publisher(ConversationResponse, "conversation/result", 100)
        self.memory_entries = node.create_lifecycle_publisher(MemoryEntry, "memory/entries", 10)
        self.converse: ConverseServer | None = None       # set while active: goals' streams
        self.closed = False

    def close(self) -> None:
        """Shutdown has begun: drop every later message (threads may still be finishing a cycle)."""
        self.closed = True

    def publish(self, pub, msg) -> None:
        if self.closed:
            return
        try:
            pub.publish(msg)
        except Exception:  # noqa: BLE001 - the context may be going away under a late publish
            if not self.closed:
                raise

    def token(self, t: TokenOut) -> None:
        self.publish(self.tokens, messages.language_token(t))
        if self.converse is not None and not self.closed:
            self.converse.on_token(t)

    def response(self, r: ResponseOut) -> None:
        self.publish(self.results, messages.conversation_response(r))
        if r.completed:
            self.publish(self.response_text, String(data=r.text))
        if self.converse is not None and not self.closed:
            self.converse.on_response(r)

    def memory(self, m: MemoryOut) -> None:
        self.publish(self.memory_entries, messages.memory_entry(m))

    def open_trajectory(self, on: bool) -> None:
        """Create (or destroy) the ``joint_trajectory`` publisher (configure / cleanup)."""
        if on and self.trajectory is None:
            self.trajectory = self.node.create_lifecycle_publisher(JointTrajectory, "joint_trajectory", 10)
        elif not on and self.trajectory is not None:
            self.node.destroy_lifecycle_publisher(self.trajectory)
            self.trajectory = None

    def chunk(self, c: ChunkOut) -> None:
        # action_chunk: the control loop publishes the buffer's remainder at control_rate_hz.  joint_trajectory: the
        # chunk as the buffer holds it at the moment of publication (not at its ready time: the GIL or a busy core
        # can delay this thread), so header.stamp - the start of the row slot containing now - is at most one
        # control step before the publish call, whatever happened since the chunk was ready.
        st = self.node.settings
        if self.trajectory is None or c.view is None or st is None or self.node.pipeline is None:
            return
        view = self.node.pipeline.buffer.view(self.node._now_ns() / 1e9)
        if view is not None and view.chunk_id == c.chunk_id:
            self.publish(self.trajectory, messages.joint_trajectory(
                view, step_dt=1.0 / st.control_rate_hz, joint_names=st.action_names))
        else:                                         # used up (or replaced) before it could be published
            self.node.report.count("trajectory_not_published")


class OxygenNode(LifecycleNode):
    """The OxyGen lifecycle node.  ``engine_factory(settings, on_actions=, on_token=, on_finished=) -> BuiltEngine``
    replaces model/engine construction (tests)."""

    def __init__(self, *, engine_factory=None, **kwargs):
        super().__init__(NODE_NAME, **kwargs)
        self._engine_factory = engine_factory or build_engine
        for name, spec in PARAMETERS.items():
            self.declare_parameter(name, spec[1], descriptor(name, spec))
        self.add_on_set_parameters_callback(self._on_set_parameters)

        self.counters = diag.Counters()
        self.report = diag.Reporter(self.counters, self.get_logger())
        self._state = "unconfigured"
        self.configure_error = ""
        self.model_info = ""
        self.settings: Settings | None = None
        self.pipeline: Pipeline | None = None
        self._running = False
        self._stop_evt = threading.Event()
        self._t_start = time.monotonic()
        self._subs = []
        self._infer_thread: threading.Thread | None = None
        self._control_thread: threading.Thread | None = None
        self._control_timer = None
        self._control_meter = diag.RateMeter(2.0)
        self._memory_services: MemoryServices | None = None
        self.control_late_ticks = 0
        self._published_chunks = 0
        self._held = 0
        self._cycle_errors_prev = 0
        self._t_active = time.monotonic()

        self._cb_inputs = MutuallyExclusiveCallbackGroup()
        self._cb_control = MutuallyExclusiveCallbackGroup()
        self._cb_diag = MutuallyExclusiveCallbackGroup()
        # /diagnostics is a plain publisher: it also reports an unconfigured or failed node.
        self._diag_pub = self.create_publisher(DiagnosticArray, "/diagnostics", 10)
        self._diag_timer = self.create_timer(self.p("diagnostics_period_s"), self._publish_diagnostics,
                                             callback_group=self._cb_diag)
        self.pub = _Publishers(self)

    # ------------------------------------------------------------------------------------------------ parameters
    def p(self, name: str):
        try:
            v = self.get_parameter(name).value
        except Exception:  # noqa: BLE001 - ParameterUninitializedException (e.g. `[]` in YAML)
            v = None
        if v is None:
            v = PARAMETERS[name][1]
        if PARAMETERS[name][0] == STRING_ARRAY:
            v = [str(x) for x in v]
        return v

    def _on_set_parameters(self, params):
        from rcl_interfaces.msg import SetParametersResult  # noqa: PLC0415
        for prm in params:
            if prm.name not in PARAMETERS:
                continue
            why = check_value(prm.name, prm.value)
            if why:
                return SetParametersResult(successful=False, reason=why)
            if self._state in ("inactive", "active"):
                self.report.log(f"param_change.{prm.name}", f"parameter {prm.name} changed while {self._state}: "
                                "takes effect after cleanup + configure", period_s=5.0)
        return SetParametersResult(successful=True)

    # ------------------------------------------------------------------------------------------------ lifecycle
    def on_configure(self, state: LifecycleState) -> TransitionCallbackReturn:
        t = time.monotonic()
        self.get_logger().info("configuring: loading the model and building the engine")
        try:
            self.settings = Settings.from_values({name: self.p(name) for name in PARAMETERS})
            self.pipeline = Pipeline(self.settings, self.pub, clock_ns=self._now_ns, logger=self.get_logger(),
                                     counters=self.counters, engine_factory=self._engine_factory)
            self.model_info = self.pipeline.info
            self.pub.open_trajectory(self.settings.publish_joint_trajectory)
            mem = self.pipeline.memory
            if mem.path:
                self.get_logger().info(f"memory entries -> {mem.path} ({mem.count()} stored, {mem.state})")
        except Exception as exc:  # noqa: BLE001 - every failure becomes a clear FAILURE
            self.configure_error = f"{type(exc).__name__}: {exc}"
            self.get_logger().error(f"configure failed: {self.configure_error}")
            if not isinstance(exc, ConfigureError) and os.environ.get("OXYGEN_DEBUG"):
                self.get_logger().error(traceback.format_exc())
            self._teardown_pipeline()
            return TransitionCallbackReturn.FAILURE
        self.configure_error = ""
        self._state = "inactive"
        self.get_logger().info(f"configured in {time.monotonic() - t:.1f} s: {self.model_info}")
        return super().on_configure(state)

    def on_activate(self, state: LifecycleState) -> TransitionCallbackReturn:
        self.pipeline.reset_io()
        self._create_subscriptions()
        pl = self.pipeline
        self.pub.converse = ConverseServer(self, pl, self.report,
                                           max_goals=self.settings.converse_max_goals or pl.max_requests)
        self._memory_services = MemoryServices(self, pl.memory, self.report)
        self._running = True
        self._stop_evt.clear()
        self._infer_thread = threading.Thread(target=self._inference_loop, name="oxygen-inference", daemon=True)
        self._infer_thread.start()
        if self.get_parameter("use_sim_time").value:
            self._control_timer = self.create_timer(1.0 / self.settings.control_rate_hz, self._control_tick,
                                                    callback_group=self._cb_control)
        else:
            self._control_thread = threading.Thread(target=self._control_loop, name="oxygen-control", daemon=True)
            self._control_thread.start()
        self._state = "active"
        self._t_active = time.monotonic()
        self.get_logger().info(
            f"active: {len([t for t in self.settings.slot_topics if t])} camera(s), control "
            f"{self.settings.control_rate_hz:g} Hz, publishing {', '.join(self.settings.outputs)}, language/tokens, "
            "conversation/response, "
            "conversation/result, memory/entries; serving converse, memory/query, memory/clear")
        return super().on_activate(state)

    def on_deactivate(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._stop_activity()
        self._state = "inactive"
        return super().on_deactivate(state)

    def on_cleanup(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._stop_activity()
        self._teardown_pipeline()
        self._state = "unconfigured"
        return super().on_cleanup(state)

    def on_shutdown(self, state: LifecycleState) -> TransitionCallbackReturn:
        self.stop_all()
        return super().on_shutdown(state)

    def on_error(self, state: LifecycleState) -> TransitionCallbackReturn:
        self.stop_all()
        self._state = "unconfigured"
        super().on_error(state)
        return TransitionCallbackReturn.SUCCESS     # recover to unconfigured

    def stop_all(self, timeout: float = 3.0) -> None:
        """Stop threads and timers and close the database (idempotent; used on shutdown)."""
        self._stop_activity(timeout)
        self._teardown_pipeline()
        self._state = "finalized" if self._state != "unconfigured" else self._state

    def _stop_activity(self, timeout: float = 3.0) -> None:
        self._stop_evt.set()
        self._running = False
        if self.pipeline is not None:
            self.pipeline.inputs.wake()
        if self._control_timer is not None:
            self.destroy_timer(self._control_timer)
            self._control_timer = None
        ct, self._control_thread = self._control_thread, None
        if ct is not None and ct is not threading.current_thread():
            ct.join(1.0)
        th, self._infer_thread = self._infer_thread, None
        if th is not None and th is not threading.current_thread():
            th.join(timeout)
            if th.is_alive():
                self.get_logger().warning(f"inference thread still busy after {timeout:.1f} s; leaving it (daemon)")
        for s in self._subs:
            self.destroy_subscription(s)
        self._subs = []
        conv, self.pub.converse = self.pub.converse, None
        if conv is not None:
            conv.destroy()
        srv, self._memory_services = self._memory_services, None
        if srv is not None:
            srv.destroy()

    def _teardown_pipeline(self) -> None:
        pl, self.pipeline = self.pipeline, None
        try:
            self.pub.open_trajectory(False)
        except Exception:  # noqa: BLE001 - the context may already be gone at shutdown
            pass
        if pl is not None:
            pl.close()
        gc.collect()

    # ------------------------------------------------------------------------------------------------ inputs
    def _create_subscriptions(self) -> None:
        s, inputs = self.settings, self.pipeline.inputs
        qos = qos_profile_sensor_data if s.camera_qos == "sensor_data" else \
            QoSProfile(depth=5, reliability=ReliabilityPolicy.RELIABLE, history=HistoryPolicy.KEEP_LAST)
        for slot, topic in enumerate(s.slot_topics):
            if topic:
                self._subs.append(self.create_subscription(
                    Image, topic, lambda m, i=slot: inputs.on_image(i, m, self._now_ns()), qos,
                    callback_group=self._cb_inputs))
        self._subs.append(self.create_subscription(
            JointState, "joint_states", lambda m: inputs.on_joint_state(m, self._now_ns()), 10,
            callback_group=self._cb_inputs))
        self._subs.append(self.create_subscription(String, "instruction", self._on_instruction, 10,
                                                   callback_group=self._cb_inputs))
        self._subs.append(self.create_subscription(
            String, "conversation/prompt", lambda m: inputs.on_prompt(m.data, self._now_ns()), 1000,
            callback_group=self._cb_inputs))
        if s.debug_fault_injection:
            self._subs.append(self.create_subscription(String, "~/inject_fault",
                                                       lambda m: self.pipeline.inject(m.data), 10,
                                                       callback_group=self._cb_inputs))

    def _on_instruction(self, msg: String) -> None:
        changed = self.pipeline.inputs.on_instruction(msg.data)
        if changed is not None:
            self.get_logger().info(f"instruction: {changed[:200]!r}")

    def _now_ns(self) -> int:
        return self.get_clock().now().nanoseconds

    # ------------------------------------------------------------------------------------------------ inference
    def _inference_loop(self) -> None:
        pl = self.pipeline
        rate = float(self.settings.frame_rate_hz)
        seen_seq, last_cycle = 0, 0.0
        while self._running:
            if not pl.inputs.wait_primary(seen_seq, 0.2, stop=lambda: not self._running):
                pl.watch()                 # no new frame: still notice (and log) inputs that went silent
                continue
            if rate > 0:
                wait = last_cycle + 1.0 / rate - time.monotonic()
                if wait > 0 and self._stop_evt.wait(wait):
                    return
            seen_seq = pl.inputs.primary_seq
            last_cycle = time.monotonic()
            pl.step()

    # ------------------------------------------------------------------------------------------------ control
    def _control_loop(self) -> None:
        period = 1.0 / float(self.settings.control_rate_hz)
        next_t = time.monotonic()
        while self._running:
            next_t += period
            delay = next_t - time.monotonic()
            if delay > 0:
                if self._stop_evt.wait(delay):
                    return
            elif delay < -period:          # more than one tick late (overload): skip the missed ticks
                missed = int(-delay / period)
                self.control_late_ticks += missed
                next_t += missed * period
            try:
                self._control_tick()
            except Exception as exc:  # noqa: BLE001 - the control loop must survive anything
                self.report.event("control_errors", f"control tick failed: {exc}", level="error")

    def _control_tick(self) -> None:
        pl = self.pipeline
        if self._state != "active" or pl is None:
            return
        now_ns = self._now_ns()
        s = pl.sample(now_ns)
        if s is None or not self.settings.publish_action_chunk:
            return
        self.pub.publish(self.pub.actions, messages.action_chunk(
            s, now_ns=now_ns, step_dt=1.0 / self.settings.control_rate_hz, joint_names=pl.action_names))
        self._published_chunks += 1
        if s.held:
            self._held += 1
        self._control_meter.tick()

    # ------------------------------------------------------------------------------------------------ diagnostics
    def snapshot(self) -> dict:
        """Everything /diagnostics reports, as a flat dict (also used by tests and tools)."""
        now_ns = self._now_ns()
        pl = self.pipeline
        prim = pl.inputs.newest_primary() if pl is not None else None
        age = None if prim is None else prim.age_ns(now_ns) / 1e9
        max_age = float(self.p("max_observation_age_s"))
        joint = pl.inputs.newest_joint() if pl is not None else None
        state_age = None if joint is None else (now_ns - joint.recv_ns) / 1e9
        max_state_age = self.settings.state_age_limit_s if self.settings else 0.0
        state_required = bool(self.settings and self.settings.state_names)
        active = self._state == "active"
        active_s = time.monotonic() - self._t_active if active else 0.0
        last_chunk = pl.last_chunk_ns if pl is not None else None
        masked = []
        if pl is not None and active:
            for slot, fr in enumerate(pl.inputs.newest_frames()):
                topic = self.settings.slot_topics[slot]
                if topic and slot != pl.inputs.primary_slot and (
                        fr is None and active_s > max_age or fr is not None and fr.age_ns(now_ns) / 1e9 > max_age):
                    masked.append(SLOT_NAMES[slot])
        em = pl.engine_metrics() if pl is not None else {}
        cyc = sorted(pl.cycle_ms) if pl is not None else []
        wait = sorted(pl.wait_ms) if pl is not None else []
        cap = em.get("kv_bytes_capacity") or 0
        used = em.get("kv_bytes_in_use") or 0
        errors = pl.cycle_errors if pl is not None else 0
        err_delta = errors - self._cycle_errors_prev
        self._cycle_errors_prev = errors
        return {
            "state": self._state, "configure_error": self.configure_error, "model": self.model_info,
            "engine_mode": self.p("engine_mode"),
            "control_rate_hz": float(self.p("control_rate_hz")),
            "control_rate_measured_hz": self._control_meter.rate(),
            "chunks_published": self._published_chunks, "held_messages": self._held,
            "inference_rate_hz": pl.cycle_meter.rate() if pl else 0.0,
            "action_frequency_hz": (pl.chunk_meter.rate() * pl.horizon) if pl else 0.0,
            "chunk_rate_hz": pl.chunk_meter.rate() if pl else 0.0,
            "cycle_latency_ms_p50": cyc[len(cyc) // 2] if cyc else 0.0,
            "cycle_latency_ms_p99": cyc[min(len(cyc) - 1, int(len(cyc) * 0.99))] if cyc else 0.0,
            "frame_age_at_cycle_ms_p50": wait[len(wait) // 2] if wait else 0.0,
            "observation_age_s": age, "max_observation_age_s": max_age,
            "stale": self._state == "active" and (age is None and time.monotonic() - self._t_start > 30.0
                                                  or age is not None and age > max_age),
            "stale_behavior": self.p("stale_behavior"),
            "chunking": self.p("chunking"),
            **({"rtc_delay_steps": pl.rtc_last[0], "rtc_execution_horizon": pl.rtc_last[1],
                "rtc_chunks": pl.buffer.chunks_rtc, "rtc_rows_skipped": pl.buffer.rtc_rows_skipped,
                "rtc_guided": pl.rtc_guided,
                "rtc_ms_p50": float(sorted(pl.rtc_ms)[len(pl.rtc_ms) // 2]) if pl.rtc_ms else 0.0}
               if pl is not None and self.p("chunking") == "rtc" else {}),
            "state_age_s": state_age, "max_state_age_s": max_state_age,
            "state_stale": active and (state_age is not None and state_age > max_state_age
                                       or state_age is None and state_required and active_s > max_state_age),
            "no_chunk_s": None if not active else ((now_ns - last_chunk) / 1e9 if last_chunk else active_s),
            "active_s": active_s,
            "future_stamp_max_s": pl.inputs.future_max_s if pl is not None else 0.0,
            "cameras_masked": masked,
            "cycles": pl.cycles if pl else 0, "cycle_errors": errors, "cycle_errors_delta": err_delta,
            "deadline_misses": pl.deadline_misses if pl else 0,
            "tokens_per_s": pl.token_meter.rate() if pl else 0.0,
            "active_requests": em.get("kv_active_requests", pl.requests.active() if pl else 0),
            "prompt_queue": (pl.inputs.queued_prompts() if pl else 0) + int(em.get("pending", 0) or 0),
            "kv_used_fraction": (used / cap) if cap else 0.0, "kv_used_bytes": used, "kv_capacity_bytes": cap,
            "counters": self.counters.snapshot(), "uptime_s": time.monotonic() - self._t_start,
            "memory": pl.memory.status() if pl is not None else None,
            "engine": {k: v for k, v in em.items() if k.startswith("kv_") or k.startswith("requests_")
                       or k in ("frames", "tokens_total", "deadline_misses", "k_mean", "ttft_ms_p50",
                                "action_latency_ms_p50", "cycle_ms_p50", "cycle_ms_p99", "compile", "compile_s",
                                "compile_eager_calls", "compile_graphs", "device", "dtype")},
        }

    def _publish_diagnostics(self) -> None:
        try:
            if self.pipeline is not None:
                self.pipeline.memory.flush()        # entries kept while the memory database failed
            s = self.snapshot()
            s["counters_delta"] = self.counters.delta()
            arr = diag.to_msg(diag.build_statuses(s), stamp=self.get_clock().now().to_msg())
            self.pub.publish(self._diag_pub, arr)
        except Exception as exc:  # noqa: BLE001 - diagnostics must never take the node down
            self.report.log("diagnostics", f"diagnostics failed: {exc}", level="error", period_s=10.0)


# ---------------------------------------------------------------------------------------------------------------------
class _ThrottleLogFilter:
    """Rate-limits repeated Python ``logging``/``warnings`` messages from the model/engine layers (e.g. a prompt
    truncation warning on every cycle): the same message (digits ignored, first 80 characters) at most once per
    ``period_s``."""

    def __init__(self, period_s: float = 10.0):
        self.period_s = period_s
        self._last: dict[str, float] = {}

    def filter(self, record) -> bool:
        key = re.sub(r"\d+", "#", str(record.getMessage()))[:80]
        now = time.monotonic()
        if now - self._last.get(key, -1e9) < self.period_s:
            return False
        self._last[key] = now
        if len(self._last) > 1000:
            self._last.clear()
        return True


def _throttle_python_logging() -> None:
    import logging  # noqa: PLC0415

    logging.captureWarnings(True)               # warnings.warn -> logging "py.warnings", throttled below
    f = _ThrottleLogFilter()
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(level=logging.WARNING, format="[%(levelname)s] [%(name)s]: %(message)s")
    for h in root.handlers:
        h.addFilter(f)


class _ShutdownRequest:
    """SIGINT / SIGTERM handler: the first signal asks for an orderly shutdown; any further signal while it runs
    (``ros2 launch`` sends SIGINT twice, supervisors escalate to SIGTERM) is noted and ignored, so shutdown is never
    interrupted half-way (no KeyboardInterrupt inside cleanup, no rclpy context torn down under running threads).

    The handler takes no lock and does no I/O.  Python runs it in the main thread between two bytecodes, and that can
    be inside a ``with lock:`` of the main thread's own.  It used to set a ``threading.Event`` while the main thread
    polled the same Event with ``wait(0.05)``.  That pattern hung a plain rclpy test process for good beside a CPU hog:
    its main thread sat in the handler, waiting for the Event's lock that its own interrupted ``wait`` held.  So the
    handler only sets attributes, and the main thread polls ``requested``."""

    def __init__(self):
        self.requested = False
        self.signals: list[int] = []
        self.t_first = 0.0

    def __call__(self, signum, frame) -> None:
        self.signals.append(signum)
        if not self.requested:
            self.t_first = time.monotonic()
            self.requested = True

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self)


def _hard_exit(code: int) -> None:
    """Exit now, without waiting for (or finalising under) a thread still inside torch code."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv=None, engine_factory=None) -> int:
    """Entry point of ``oxygen_node`` / ``oxygen node``.  ``argv``: ROS arguments (``--ros-args ...``)."""
    args = list(sys.argv if argv is None else ["oxygen_node", *argv])
    if refuse_stray_args("oxygen_node", args):
        return 2
    if any(a in ("-h", "--help") for a in args[1:]) and "--ros-args" not in args:
        print(__doc__.strip())
        print("\nparameters (config/oxygen.yaml):")
        for name, spec in PARAMETERS.items():
            print(f"  {name:24s} {spec[1]!r:40.40s} {spec[2]}")
        return 0
    shutdown = _ShutdownRequest()
    shutdown.install()                 # before anything slow, so an early signal is an orderly shutdown too
    _throttle_python_logging()
    # The control thread must get the GIL promptly while the inference thread runs Python between torch ops:
    # a 1 ms switch interval (default 5 ms) bounds how long it waits for it.
    sys.setswitchinterval(0.001)
    try:
        rclpy.init(args=ros_args(args), signal_handler_options=SignalHandlerOptions.NO)
        node = OxygenNode(engine_factory=engine_factory)
    except Exception as exc:  # noqa: BLE001 - bad --ros-args, a parameter outside its declared range, ...
        print(f"oxygen_node: cannot start: {type(exc).__name__}: {exc}", file=sys.stderr)
        rclpy.try_shutdown()
        return 2
    executor = MultiThreadedExecutor(num_threads=2)
    executor.add_node(node)
    log = node.get_logger()
    if node.p("autostart"):
        # configure in a worker so that a signal during a long model load is still answered within seconds
        worker = threading.Thread(target=node.trigger_configure, name="oxygen-configure", daemon=True)
        worker.start()
        while worker.is_alive() and not shutdown.requested:
            worker.join(0.05)
        if worker.is_alive():          # a signal while the model is still loading: nothing runs yet, just leave
            log.info("shutdown requested during configure: exiting")
            rclpy.try_shutdown()
            _hard_exit(0)
            return 0
        if node._state != "inactive":
            log.fatal(f"autostart: configure failed ({node.configure_error}); exiting with status 2")
            node._publish_diagnostics()
            time.sleep(0.2)
            node.destroy_node()
            rclpy.try_shutdown()
            _hard_exit(2)
            return 2
        if not shutdown.requested:
            node.trigger_activate()
    try:
        while not shutdown.requested and rclpy.ok():
            executor.spin_once(timeout_sec=0.1)
    except ExternalShutdownException:
        pass
    t = time.monotonic()
    node.pub.close()                   # from here on nothing is published (threads may still finish a cycle)
    node.stop_all()
    executor.shutdown(timeout_sec=1.0)
    node.destroy_node()
    rclpy.try_shutdown()
    if os.environ.get("OXYGEN_DEBUG"):
        print(f"oxygen_node: signal(s) {shutdown.signals}; loop left {t - shutdown.t_first:.2f} s after the first, "
              f"shut down in {time.monotonic() - t:.2f} s", file=sys.stderr)
    # Everything the node owns is closed now (threads joined, database closed, node destroyed, context shut down).
    # Finalise the DDS participant explicitly -- the context is destroyed once nothing uses it, so drop the node and
    # the executor first -- so that it announces the node's leave to the graph at once, then skip the interpreter's
    # finalisation: tearing down torch/transformers takes ~1.5 s here (more with CUDA) and, if a long cycle outlived
    # the join timeout, finalising under that thread could crash.  Measured: exit 0.5-0.7 s after SIGINT, gone from
    # the graph at once (a hard exit without the explicit destroy left it listed for its 20 s lease).
    del node, executor
    gc.collect()
    rclpy.utilities.get_default_context().destroy()
    _hard_exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
