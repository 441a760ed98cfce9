"""``oxygen_node``: the lifecycle node around the engine (parameters, subscriptions, timers, publishers, threads).

This file owns the ROS shell. Lifecycle: *configure* loads the model (``load_checkpoint(checkpoint)`` when the
``checkpoint`` parameter is set, else random weights of ``preset``), builds the ``Processor`` and the ``Engine``
(which preallocates the KV pool) and opens the memory database; *activate* starts the inference thread, the control
timer and the lifecycle publishers; *deactivate* stops them; *cleanup* frees the engine and model. With ``autostart``
(default) the node runs configure + activate itself; if configure fails there (missing/corrupt checkpoint, bad
parameter) it logs why, publishes one ERROR diagnostic and exits with status 2 (so ``ros2 launch`` reports the
death); without autostart it stays unconfigured, reports ERROR on ``/diagnostics`` and a lifecycle manager may retry.
Threads: input callbacks only validate and store the latest message per input (no queues, except the bounded
conversation-prompt queue); a dedicated inference thread waits for a new frame from the first camera slot, builds an
``Observation`` and calls ``engine.cycle``; engine callbacks push chunks into ``ChunkBuffer`` and publish tokens; the
control loop samples the buffer at ``control_rate_hz`` in its own thread with absolute (steady-clock) deadlines, so
it never waits for inference or for the executor (with ``use_sim_time`` it is a ROS timer on the simulated clock
instead, in its own callback group of a MultiThreadedExecutor). Bad input is counted per reason (``/diagnostics``,
``inputs``) and logged with ``throttle_duration_sec``; an exception inside a cycle skips that cycle. SIGINT/SIGTERM
stop everything within a few seconds. Run as ``oxygen_node`` / ``oxygen node`` / ``ros2 run oxygen_ros oxygen_node``
/ ``python -m oxygen_ros.ros.node``.
"""
from __future__ import annotations

import collections
import os
import re
import sys
import threading
import time
import traceback

import numpy as np
import rclpy
from rcl_interfaces.msg import FloatingPointRange, IntegerRange, ParameterDescriptor, ParameterType
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup
from rclpy.executors import ExternalShutdownException, MultiThreadedExecutor
from rclpy.lifecycle import LifecycleNode, LifecycleState, TransitionCallbackReturn
from rclpy.qos import QoSProfile, ReliabilityPolicy, HistoryPolicy, qos_profile_sensor_data
from builtin_interfaces.msg import Time as TimeMsg
from diagnostic_msgs.msg import DiagnosticArray
from sensor_msgs.msg import Image, JointState
from std_msgs.msg import String

from oxygen_ros.msg import ActionChunk, LanguageToken, MemoryEntry

from . import diagnostics as diag
from .control import ChunkBuffer
from .images import ImageError, image_to_rgb8, validate_image
from .memory_store import MemoryStore

__all__ = ["OxygenNode", "main", "PARAMETERS"]

NODE_NAME = "oxygen_node"
_S, _D, _I, _B, _SA = (ParameterType.PARAMETER_STRING, ParameterType.PARAMETER_DOUBLE,
                       ParameterType.PARAMETER_INTEGER, ParameterType.PARAMETER_BOOL,
                       ParameterType.PARAMETER_STRING_ARRAY)
_SLOT_NAMES = ("base", "left_wrist", "right_wrist")
_ENGINE_METRICS_RESET_S = 600.0     # the engine keeps per-cycle records; bound them in a long-running node

# name: (type, default, description, range (lo, hi) or choices tuple or None, read_only)
PARAMETERS: dict[str, tuple] = {
    "autostart": (_B, True, "Run configure + activate at start (false: wait for a lifecycle manager).", None),
    "checkpoint": (_S, "", "pi0.5 checkpoint directory (openpi/LeRobot safetensors + norm stats); "
                          "empty = random weights of `preset`.", None),
    "preset": (_S, "tiny", "Model architecture when no checkpoint is given.", ("tiny", "bench-cpu", "pi05")),
    "device": (_S, "cpu", "Torch device: cpu, cuda, cuda:N or auto.", None),
    "torch_threads": (_I, 1, "Torch intra-op CPU threads; 0 = torch's default (all cores). 1 keeps the control "
                             "thread responsive and avoids OpenMP oversubscription on shared CPUs.", (0, 1024)),
    "dtype": (_S, "", "Weights/compute dtype; empty = the preset's or checkpoint's.",
              ("", "float32", "bfloat16", "float16")),
    "prefix_attention": (_S, "", "Prefix attention; empty = model default.", ("", "image_isolated", "upstream")),
    "horizon": (_I, 0, "Action horizon H (rows per chunk); 0 = the model's.", (0, 1000)),
    "denoise_steps": (_I, 0, "Flow-matching Euler steps; 0 = the model's.", (0, 100)),
    "seed": (_I, 0, "Seed for random weights and action noise.", (0, 2**31 - 1)),
    "engine_mode": (_S, "oxygen", "Engine scheduling mode.", ("oxygen", "shared", "isolated")),
    "decode_k": (_I, 5, "Language tokens per request per cycle (oxygen mode).", (1, 256)),
    "adaptive_k": (_B, False, "Deadline-aware k from the frame period (needs frame_rate_hz > 0).", None),
    "max_new_tokens": (_I, 32, "Max generated tokens per language request.", (1, 4096)),
    "temperature": (_D, 0.0, "Language sampling temperature; 0 = greedy.", (0.0, 10.0)),
    "top_p": (_D, 1.0, "Nucleus sampling threshold (with temperature > 0).", (0.0, 1.0)),
    "kv_budget_mb": (_D, 0.0, "KV pool size in MiB; 0 = the engine's default.", (0.0, 1.0e6)),
    "max_wait_cycles": (_I, 0, "Reject a language request that waited this many cycles for KV/batch capacity; "
                               "0 = wait (the engine's bounded queue drops the oldest).", (0, 1_000_000)),
    "control_rate_hz": (_D, 70.0, "action_chunk publication rate.", (1.0, 1000.0)),
    "frame_rate_hz": (_D, 15.0, "Max inference cycles per second; 0 = one per new frame.", (0.0, 1000.0)),
    "max_observation_age_s": (_D, 0.5, "Frames older than this are not used; no new chunks, diagnostics ERROR.",
                              (0.001, 1.0e6)),
    "stale_behavior": (_S, "stop", "When the newest chunk is used up: stop publishing, or hold the last action.",
                       ("stop", "hold")),
    "chunk_time_origin": (_S, "arrival", "Row 0 of a chunk is for the first tick after it is ready (arrival) or for "
                                         "the observation's capture time (capture).", ("arrival", "capture")),
    "blend_steps": (_I, 0, "Rows cross-faded from the previous chunk's remainder into a new chunk.", (0, 1000)),
    "stamp_source": (_S, "header", "Observation capture time: header.stamp, or arrival time.",
                     ("header", "receive")),
    "camera_topics": (_SA, ["camera/base/image_raw", "camera/left_wrist/image_raw", "camera/right_wrist/image_raw"],
                      "Camera topics for the model's slots (base, left wrist, right wrist); '' = empty slot.", None),
    "camera_qos": (_S, "sensor_data", "Camera subscription QoS.", ("sensor_data", "reliable")),
    "state_joint_names": (_SA, [""], "Order of the state vector taken from joint_states; [''] = message order.",
                          None),
    "action_joint_names": (_SA, [""], "Names of the published action columns (sets their number); "
                                      "[''] = all model action dimensions, unnamed.", None),
    "default_instruction": (_S, "", "Task prompt used until the first `instruction` message.", None),
    "max_prompt_chars": (_I, 1000, "Longer prompts/instructions are truncated (counted).", (1, 1_000_000)),
    "prompt_queue_size": (_I, 32, "Conversation prompts waiting for the engine; oldest dropped when full.",
                          (1, 100_000)),
    "memory_interval_s": (_D, 5.0, "One memory (scene description) request every N seconds; 0 = off.",
                          (0.0, 1.0e6)),
    "memory_prompt": (_S, "Describe the scene in one sentence.", "Prompt of memory requests.", None),
    "memory_db": (_S, "~/.ros/oxygen_ros/memory.db", "SQLite file for memory entries; '' = not stored.", None),
    "subtask_enabled": (_B, False, "Also run subtask-prediction requests on the current instruction.", None),
    "subtask_interval_s": (_D, 1.0, "Seconds between subtask requests.", (0.05, 1.0e6)),
    "diagnostics_period_s": (_D, 1.0, "Period of /diagnostics.", (0.05, 3600.0)),
    "debug_fault_injection": (_B, False, "Tests only: enable the ~/inject_fault topic.", None),
}


def _descriptor(name: str, spec: tuple) -> ParameterDescriptor:
    typ, default, text, rng = spec[:4]
    d = ParameterDescriptor(name=name, type=typ, description=text)
    if isinstance(rng, tuple) and rng and isinstance(rng[0], str):
        d.additional_constraints = "one of: " + ", ".join(repr(c) for c in rng)
    elif rng is not None and typ == _D:
        d.floating_point_range = [FloatingPointRange(from_value=float(rng[0]), to_value=float(rng[1]), step=0.0)]
    elif rng is not None and typ == _I:
        d.integer_range = [IntegerRange(from_value=int(rng[0]), to_value=int(rng[1]), step=1)]
    return d


def _stamp_ns(stamp) -> int:
    return int(stamp.sec) * 1_000_000_000 + int(stamp.nanosec)


def _time_msg(ns: int) -> TimeMsg:
    return TimeMsg(sec=int(ns // 1_000_000_000), nanosec=int(ns % 1_000_000_000))


class ConfigureError(RuntimeError):
    pass


class OxygenNode(LifecycleNode):
    """The OxyGen lifecycle node.  ``engine_factory(node) -> engine`` replaces model/engine construction (tests)."""

    def __init__(self, *, engine_factory=None, **kwargs):
        super().__init__(NODE_NAME, **kwargs)
        self._engine_factory = engine_factory
        for name, spec in PARAMETERS.items():
            self.declare_parameter(name, spec[1], _descriptor(name, spec))
        self.add_on_set_parameters_callback(self._on_set_parameters)

        self.counters = diag.Counters()
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._state = "unconfigured"
        self.configure_error = ""
        self.engine = None
        self.model_info = ""
        self._memory: MemoryStore | None = None
        self._next_memory_id = 1
        self._infer_thread: threading.Thread | None = None
        self._running = False
        self._stop_evt = threading.Event()
        self._t_start = time.monotonic()
        self._latest: list = [None, None, None]    # per slot: (msg, capture_ns, recv_ns) or None
        self._primary_slot = 0
        self._primary_seq = 0                      # increments with each new primary frame
        self._joint = None                         # (np.ndarray, stamp_ns)
        self._instruction = ""
        self._prompts: collections.deque = collections.deque()
        self._inject: collections.deque = collections.deque(maxlen=16)
        self._frame_stamp: collections.OrderedDict = collections.OrderedDict()   # Observation.stamp -> exact ns
        self._chunk_stamp: dict[int, int] = {}
        self._frame_cap: collections.OrderedDict = collections.OrderedDict()   # engine frame_index -> capture ns
        self._requests: dict[int, dict] = {}
        self._last_memory_t = None
        self._last_subtask_t = None
        self._control_meter = diag.RateMeter(2.0)
        self._cycle_meter = diag.RateMeter(2.0)
        self._chunk_meter = diag.RateMeter(2.0)
        self._token_meter = diag.RateMeter(2.0)
        self._cycle_ms: collections.deque = collections.deque(maxlen=200)
        self._wait_ms: collections.deque = collections.deque(maxlen=200)   # frame capture -> cycle start
        self._deadline_misses = 0
        self._cycles = 0
        self._cycle_errors = 0
        self._cycle_errors_prev = 0
        self._published_chunks = 0
        self._held = 0
        self._last_engine_metrics: dict = {}
        self._last_metrics_reset = time.monotonic()
        self._subs = []
        self._control_timer = None
        self._control_thread: threading.Thread | None = None
        self.control_late_ticks = 0
        self._buffer: ChunkBuffer | None = None
        self._state_dim_max: int | None = None
        self._frame_id = "camera_base"             # header.frame_id of the newest primary-camera frame used

        self._cb_inputs = MutuallyExclusiveCallbackGroup()
        self._cb_control = MutuallyExclusiveCallbackGroup()
        self._cb_diag = MutuallyExclusiveCallbackGroup()
        # /diagnostics is a plain publisher: it also reports an unconfigured or failed node.
        self._diag_pub = self.create_publisher(DiagnosticArray, "/diagnostics", 10)
        self._diag_timer = self.create_timer(self.p("diagnostics_period_s"), self._publish_diagnostics,
                                             callback_group=self._cb_diag)
        self._pub_actions = self.create_lifecycle_publisher(ActionChunk, "action_chunk", 10)
        self._pub_tokens = self.create_lifecycle_publisher(LanguageToken, "language/tokens", 100)
        self._pub_response = self.create_lifecycle_publisher(String, "conversation/response", 10)
        self._pub_memory = self.create_lifecycle_publisher(MemoryEntry, "memory/entries", 10)

    # ------------------------------------------------------------------------------------------------ parameters
    def p(self, name: str):
        try:
            v = self.get_parameter(name).value
        except Exception:  # noqa: BLE001 - ParameterUninitializedException (e.g. `[]` in YAML)
            v = None
        if v is None:
            v = PARAMETERS[name][1]
        if PARAMETERS[name][0] == _SA:
            v = [str(x) for x in v]
        return v

    def _names(self, name: str) -> list[str]:
        v = [x for x in self.p(name)]
        return [] if all(x == "" for x in v) else v

    def _on_set_parameters(self, params):
        from rcl_interfaces.msg import SetParametersResult  # noqa: PLC0415
        for prm in params:
            spec = PARAMETERS.get(prm.name)
            if spec is None:
                continue
            rng = spec[3]
            if isinstance(rng, tuple) and rng and isinstance(rng[0], str) and prm.value not in rng:
                return SetParametersResult(successful=False,
                                           reason=f"{prm.name} must be one of {rng}, got {prm.value!r}")
            if prm.name == "camera_topics" and len(prm.value) > 3:
                return SetParametersResult(successful=False, reason="camera_topics has at most 3 entries")
            if self._state in ("inactive", "active"):
                self.get_logger().warning(f"parameter {prm.name} changed while {self._state}: takes effect after "
                                          "cleanup + configure", throttle_duration_sec=5.0)
        return SetParametersResult(successful=True)

    # ------------------------------------------------------------------------------------------------ lifecycle
    def on_configure(self, state: LifecycleState) -> TransitionCallbackReturn:
        t = time.monotonic()
        try:
            self._configure()
        except Exception as exc:  # noqa: BLE001 - every failure becomes a clear FAILURE
            self.configure_error = f"{type(exc).__name__}: {exc}"
            self.get_logger().error(f"configure failed: {self.configure_error}")
            if not isinstance(exc, ConfigureError) and os.environ.get("OXYGEN_DEBUG"):
                self.get_logger().error(traceback.format_exc())
            self._teardown_engine()
            return TransitionCallbackReturn.FAILURE
        self.configure_error = ""
        self._state = "inactive"
        self.get_logger().info(f"configured in {time.monotonic() - t:.1f} s: {self.model_info}")
        return super().on_configure(state)

    def on_activate(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._buffer.clear()
        self._create_io()
        self._running = True
        self._stop_evt.clear()
        self._infer_thread = threading.Thread(target=self._inference_loop, name="oxygen-inference", daemon=True)
        self._infer_thread.start()
        if self.get_parameter("use_sim_time").value:
            self._control_timer = self.create_timer(1.0 / self.p("control_rate_hz"), self._control_tick,
                                                    callback_group=self._cb_control)
        else:
            self._control_thread = threading.Thread(target=self._control_loop, name="oxygen-control", daemon=True)
            self._control_thread.start()
        self._state = "active"
        self.get_logger().info(
            f"active: {len([s for s in self._slot_topics if s])} camera(s), control {self.p('control_rate_hz'):g} Hz, "
            f"publishing action_chunk, language/tokens, conversation/response, memory/entries")
        return super().on_activate(state)

    def on_deactivate(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._stop_activity()
        self._state = "inactive"
        return super().on_deactivate(state)

    def on_cleanup(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._stop_activity()
        self._teardown_engine()
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
        self._teardown_engine()
        self._state = "finalized" if self._state != "unconfigured" else self._state

    def _stop_activity(self, timeout: float = 3.0) -> None:
        self._stop_evt.set()
        with self._cond:
            self._running = False
            self._cond.notify_all()
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

    def _teardown_engine(self) -> None:
        self.engine = None
        with self._lock:
            self._requests.clear()
            self._prompts.clear()
        if self._memory is not None:
            self._memory.close()
            self._memory = None
        try:
            import gc  # noqa: PLC0415
            gc.collect()
        except Exception:  # noqa: BLE001
            pass

    # ------------------------------------------------------------------------------------------------ configure
    def _configure(self) -> None:
        for name, spec in PARAMETERS.items():
            rng = spec[3]
            if isinstance(rng, tuple) and rng and isinstance(rng[0], str) and self.p(name) not in rng:
                raise ConfigureError(f"parameter {name} must be one of {list(rng)}, got {self.p(name)!r}")
        topics = self.p("camera_topics")
        if len(topics) > 3:
            raise ConfigureError(f"camera_topics has {len(topics)} entries; the model has 3 camera slots")
        self._slot_topics = (list(topics) + ["", "", ""])[:3]
        if not any(self._slot_topics):
            raise ConfigureError("camera_topics has no non-empty entry; at least one camera is needed")
        self._primary_slot = next(i for i, t in enumerate(self._slot_topics) if t)
        if self.p("adaptive_k") and self.p("frame_rate_hz") <= 0:
            raise ConfigureError("adaptive_k needs frame_rate_hz > 0 (the cycle deadline)")
        self._state_names = self._names("state_joint_names")
        self._action_names = self._names("action_joint_names")
        self._state_index = {n: i for i, n in enumerate(self._state_names)}
        if len(self._state_index) != len(self._state_names):
            raise ConfigureError("state_joint_names has duplicates")

        if self._engine_factory is not None:
            self.engine = self._engine_factory(self)
            self.model_info = getattr(self.engine, "info", "custom engine")
        else:
            self.engine = self._build_engine()
        self._robot_dim = int(self._action_dims)

        self._buffer = ChunkBuffer(1.0 / self.p("control_rate_hz"), blend_steps=self.p("blend_steps"),
                                   stale_behavior=self.p("stale_behavior"), time_origin=self.p("chunk_time_origin"))
        db = self.p("memory_db")
        if db:
            self._memory = MemoryStore(db)
            self.get_logger().info(f"memory entries -> {self._memory.path} ({self._memory.count()} stored)")
        self._next_memory_id = (self._memory.last_id() + 1) if self._memory else self._next_memory_id

    def _build_engine(self):
        # Imported here so that `--help`, parameter listing and diagnostics need no torch.
        import torch  # noqa: PLC0415
        from oxygen_ros.engine.engine import Engine, EngineConfig  # noqa: PLC0415
        from oxygen_ros.model import (Processor, SamplingParams, build_model, get_config,  # noqa: PLC0415
                                      load_checkpoint, load_tokenizer)

        if int(self.p("torch_threads")) > 0:
            torch.set_num_threads(int(self.p("torch_threads")))
        device = self.p("device")
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigureError(f"device {device!r} requested but CUDA is not available")
        dtype = self.p("dtype") or None
        overrides = {}
        if self.p("prefix_attention"):
            overrides["prefix_attention"] = self.p("prefix_attention")
        if self.p("horizon") > 0:
            overrides["action_horizon"] = int(self.p("horizon"))
        if self.p("denoise_steps") > 0:
            overrides["num_denoise_steps"] = int(self.p("denoise_steps"))
        ckpt = os.path.expanduser(self.p("checkpoint"))
        seed = int(self.p("seed"))
        norm_stats = None
        if ckpt:
            from oxygen_ros.model.checkpoint import CheckpointError  # noqa: PLC0415
            try:
                pol = load_checkpoint(ckpt, device=device, dtype=dtype, **overrides)
            except CheckpointError as exc:
                raise ConfigureError(f"cannot load checkpoint {ckpt!r}: {exc}") from exc
            model, cfg, norm_stats, tok = pol.model, pol.cfg, pol.norm_stats, pol.tokenizer
            self.model_info = f"checkpoint {ckpt} ({cfg.name}, H={cfg.action_horizon}, {cfg.dtype}, {device})"
        else:
            try:
                cfg = get_config(self.p("preset"), **overrides)
            except ValueError as exc:
                raise ConfigureError(str(exc)) from exc
            model = build_model(cfg, device=device, dtype=dtype, seed=seed)
            cfg = model.cfg
            tok = load_tokenizer(cfg)
            self.model_info = (f"RANDOM weights, preset {cfg.name} (H={cfg.action_horizon}, {cfg.dtype}, {device}): "
                               "actions and text are meaningless; set `checkpoint` for a real model")
        ns_dims = norm_stats.action_dim if norm_stats is not None else None
        if self._action_names:
            if len(self._action_names) > cfg.action_dim:
                raise ConfigureError(f"action_joint_names has {len(self._action_names)} names, more than the "
                                     f"model's action_dim {cfg.action_dim}")
            if ns_dims is not None and len(self._action_names) > ns_dims:
                raise ConfigureError(f"action_joint_names has {len(self._action_names)} names but the checkpoint's "
                                     f"norm stats cover {ns_dims} action dimensions")
            action_dims = len(self._action_names)
        else:
            action_dims = ns_dims or cfg.action_dim
        if self._state_names and len(self._state_names) > cfg.action_dim:
            raise ConfigureError(f"state_joint_names has {len(self._state_names)} names, more than the model's "
                                 f"state size {cfg.action_dim}")
        self._state_dim_max = cfg.action_dim
        processor = Processor(cfg, tok, norm_stats, action_dims=action_dims)
        self._action_dims = processor.action_dims
        self._horizon = cfg.action_horizon
        rate = float(self.p("frame_rate_hz"))
        mem_int = float(self.p("memory_interval_s"))
        ec = EngineConfig(
            mode=self.p("engine_mode"),
            decode_k="adaptive" if self.p("adaptive_k") else int(self.p("decode_k")),
            max_new_tokens=int(self.p("max_new_tokens")),
            target_period_s=(1.0 / rate) if rate > 0 else None,
            kv_budget_mb=float(self.p("kv_budget_mb")) or None,
            denoise_steps=int(self.p("denoise_steps")) or None,
            seed=seed,
            memory_interval_s=mem_int if mem_int > 0 else None,
            max_wait_frames=int(self.p("max_wait_cycles")) or None,
            sampling=(SamplingParams(temperature=float(self.p("temperature")), top_p=float(self.p("top_p")))
                      if self.p("temperature") > 0 else None),
            memory_prompt=self.p("memory_prompt"),
        )
        engine = Engine(model, processor, ec, on_actions=self._on_actions, on_token=self._on_token,
                        on_finished=self._on_finished)
        self.model_info += f"; engine {ec.mode}, k={ec.decode_k}, KV {engine.pool.capacity_bytes / 2**20:.1f} MiB"
        return engine

    # ------------------------------------------------------------------------------------------------ inputs
    def _create_io(self) -> None:
        qos = qos_profile_sensor_data if self.p("camera_qos") == "sensor_data" else \
            QoSProfile(depth=5, reliability=ReliabilityPolicy.RELIABLE, history=HistoryPolicy.KEEP_LAST)
        self._latest = [None, None, None]
        for slot, topic in enumerate(self._slot_topics):
            if topic:
                self._subs.append(self.create_subscription(
                    Image, topic, lambda m, s=slot: self._on_image(s, m), qos, callback_group=self._cb_inputs))
        self._subs.append(self.create_subscription(JointState, "joint_states", self._on_joint_state, 10,
                                                   callback_group=self._cb_inputs))
        self._subs.append(self.create_subscription(String, "instruction", self._on_instruction, 10,
                                                   callback_group=self._cb_inputs))
        self._subs.append(self.create_subscription(String, "conversation/prompt", self._on_prompt, 1000,
                                                   callback_group=self._cb_inputs))
        if self.p("debug_fault_injection"):
            self._subs.append(self.create_subscription(String, "~/inject_fault", self._on_inject, 10,
                                                       callback_group=self._cb_inputs))

    def _reject(self, reason: str, text: str) -> None:
        self.counters.inc(f"rejected.{reason}")
        self.get_logger().warning(f"rejected input ({reason}): {text}", throttle_duration_sec=2.0)

    def _now_ns(self) -> int:
        return self.get_clock().now().nanoseconds

    def _on_image(self, slot: int, msg: Image) -> None:
        self.counters.inc("frames_received")
        try:
            validate_image(msg)
        except ImageError as exc:
            self._reject(f"image_{exc.reason}", f"{self._slot_topics[slot]}: {exc}")
            return
        now = self._now_ns()
        cap = _stamp_ns(msg.header.stamp) if self.p("stamp_source") == "header" else 0
        with self._cond:
            self._latest[slot] = (msg, cap or now, now)
            if slot == self._primary_slot:
                self._primary_seq += 1
                self._cond.notify_all()

    def _on_joint_state(self, msg: JointState) -> None:
        self.counters.inc("joint_states_received")
        pos = np.asarray(msg.position, dtype=np.float64)
        if self._state_names:
            if len(msg.name) != len(pos):
                self._reject("joint_size", f"{len(msg.name)} names but {len(pos)} positions")
                return
            idx = {n: i for i, n in enumerate(msg.name)}
            missing = [n for n in self._state_names if n not in idx]
            if missing:
                unknown = [n for n in msg.name if n not in self._state_index]
                self._reject("joint_names", f"missing {missing[:4]}{'...' if len(missing) > 4 else ''}"
                                            f"{f'; unknown {unknown[:4]}' if unknown else ''}")
                return
            vec = pos[[idx[n] for n in self._state_names]]
        else:
            if len(pos) == 0:
                self._reject("joint_size", "empty position vector")
                return
            vec = pos
        if self._state_dim_max and len(vec) > self._state_dim_max:
            self._reject("joint_size", f"{len(vec)} joint positions, more than the model's state size "
                                       f"{self._state_dim_max} (set state_joint_names)")
            return
        if not np.all(np.isfinite(vec)):
            self._reject("joint_nonfinite", "NaN/inf in joint positions")
            return
        with self._lock:
            self._joint = (vec.astype(np.float32), self._now_ns())

    def _clip_prompt(self, text: str, what: str) -> str | None:
        text = text.strip()
        if not text:
            self._reject(f"{what}_empty", f"empty {what}")
            return None
        limit = int(self.p("max_prompt_chars"))
        if len(text) > limit:
            self.counters.inc("prompt_truncated")
            self.get_logger().warning(f"{what} of {len(text)} characters truncated to {limit}",
                                      throttle_duration_sec=2.0)
            text = text[:limit]
        return text

    def _on_instruction(self, msg: String) -> None:
        self.counters.inc("instructions_received")
        text = self._clip_prompt(msg.data, "instruction")
        if text is not None:
            with self._lock:
                if text != self._instruction:
                    self.get_logger().info(f"instruction: {text[:200]!r}")
                self._instruction = text

    def _on_prompt(self, msg: String) -> None:
        self.counters.inc("prompts_received")
        text = self._clip_prompt(msg.data, "prompt")
        if text is None:
            return
        with self._cond:
            self._prompts.append(text)
            while len(self._prompts) > int(self.p("prompt_queue_size")):
                self._prompts.popleft()
                self.counters.inc("prompt_dropped")
                self.get_logger().warning("conversation prompt queue full: oldest prompt dropped",
                                          throttle_duration_sec=2.0)

    def _on_inject(self, msg: String) -> None:
        self._inject.append(msg.data.strip())

    # ------------------------------------------------------------------------------------------------ inference
    def _inference_loop(self) -> None:
        from oxygen_ros.model.processing import Observation  # noqa: PLC0415 - torch is loaded by configure anyway

        self._Observation = Observation
        seen_seq = 0
        last_cycle = 0.0
        log = self.get_logger()
        while True:
            with self._cond:
                self._cond.wait_for(lambda: not self._running or self._primary_seq != seen_seq, timeout=0.2)
                if not self._running:
                    return
                if self._primary_seq == seen_seq:
                    continue
            rate = float(self.p("frame_rate_hz"))
            if rate > 0:
                wait = last_cycle + 1.0 / rate - time.monotonic()
                if wait > 0 and self._stop_evt.wait(wait):
                    return
            with self._lock:
                seen_seq = self._primary_seq
                latest = list(self._latest)
                joint = self._joint
                instruction = self._instruction or self.p("default_instruction")
                prompts = [self._prompts.popleft() for _ in range(min(4, len(self._prompts)))]
            last_cycle = time.monotonic()
            try:
                self._run_cycle(latest, joint, instruction, prompts)
            except Exception as exc:  # noqa: BLE001 - a failed cycle is skipped; the node keeps serving
                self._cycle_errors += 1
                self.counters.inc("cycle_errors")
                log.error(f"inference cycle failed and was skipped: {type(exc).__name__}: {exc}",
                          throttle_duration_sec=2.0)
                if self._cycle_errors == 1:
                    log.error(traceback.format_exc())

    def _run_cycle(self, latest, joint, instruction: str, prompts: list[str]) -> None:
        Observation = self._Observation  # noqa: N806
        for text in prompts:           # queued in the engine even if this frame is skipped
            self._submit("conversation", text)
        now = self._now_ns()
        max_age_ns = int(self.p("max_observation_age_s") * 1e9)
        prim = latest[self._primary_slot]
        if prim is None or now - prim[1] > max_age_ns:
            self.counters.inc("cycle_skipped_stale")
            age = "none" if prim is None else f"{(now - prim[1]) / 1e9:.3f} s"
            self.get_logger().warning(f"newest frame is older than max_observation_age_s (age {age}): no inference "
                                      "(if frames do arrive, check clock sync or set stamp_source: receive)",
                                      throttle_duration_sec=2.0)
            return
        self._wait_ms.append((now - prim[1]) / 1e6)
        self._frame_id = prim[0].header.frame_id or ("camera_" + _SLOT_NAMES[self._primary_slot])
        images = [None, None, None]
        for slot, item in enumerate(latest):
            if item is None or now - item[1] > max_age_ns:
                continue
            try:
                images[slot] = image_to_rgb8(item[0])
            except ImageError as exc:      # validated already; only reachable via cv_bridge failures
                self._reject(f"image_{exc.reason}", str(exc))
                if slot == self._primary_slot:
                    return
        state = None
        if joint is not None:
            state = joint[0]
        else:
            self.counters.inc("state_missing")
        engine = self.engine
        if self.p("subtask_enabled") and instruction:
            t = time.monotonic()
            if self._last_subtask_t is None or t - self._last_subtask_t >= self.p("subtask_interval_s"):
                self._last_subtask_t = t
                self._submit("subtask", instruction)
        cap_ns = prim[1]
        stamp = cap_ns / 1e9
        with self._lock:
            self._frame_stamp[stamp] = cap_ns
            while len(self._frame_stamp) > 64:
                self._frame_stamp.popitem(last=False)
        obs = Observation(images=images, state=state, prompt=instruction, stamp=stamp)
        if self._inject:
            fault = self._inject.popleft()
            if fault == "cycle_exception":
                raise RuntimeError("injected fault (debug_fault_injection)")
        t0 = time.perf_counter()
        stats = engine.cycle(obs)
        dt = time.perf_counter() - t0
        self._cycles += 1
        self._cycle_meter.tick()
        self._cycle_ms.append(dt * 1e3)
        if isinstance(stats, dict) and stats.get("deadline_missed"):
            self._deadline_misses += 1
        if time.monotonic() - self._last_metrics_reset > _ENGINE_METRICS_RESET_S and hasattr(engine, "reset_metrics"):
            self._last_engine_metrics = self._engine_metrics()
            engine.reset_metrics()
            self._last_metrics_reset = time.monotonic()

    def _submit(self, kind: str, text: str) -> None:
        try:
            rid = self.engine.submit(kind=kind, prompt=text)
        except Exception as exc:  # noqa: BLE001 - engine refuses (bad prompt, full)
            self.counters.inc("request_rejected")
            self.get_logger().warning(f"{kind} request rejected: {exc}", throttle_duration_sec=2.0)
            return
        if isinstance(rid, int):
            with self._lock:
                self._requests.setdefault(rid, {"kind": kind, "texts": [], "n": 0, "final": None, "result": None})

    # ------------------------------------------------------------------------------------------------ engine callbacks
    def _on_actions(self, res) -> None:
        now_ns = self._now_ns()
        with self._lock:
            cap_ns = self._frame_stamp.get(res.stamp)
        if cap_ns is None:
            cap_ns = int(round(res.stamp * 1e9))
        actions = np.asarray(res.actions, dtype=np.float32)
        if actions.ndim != 2 or not np.all(np.isfinite(actions)):
            self.counters.inc("chunk_invalid")
            self.get_logger().error(f"engine returned an invalid chunk (shape {actions.shape}, finite "
                                    f"{bool(np.all(np.isfinite(actions)))}); dropped", throttle_duration_sec=2.0)
            return
        with self._lock:
            self._chunk_stamp[res.chunk_id] = cap_ns
            self._frame_cap[res.frame_index] = cap_ns
            while len(self._frame_cap) > 4096:
                self._frame_cap.popitem(last=False)
            for old in [c for c in self._chunk_stamp if c < res.chunk_id - 32]:
                del self._chunk_stamp[old]
        self._buffer.push(actions, chunk_id=res.chunk_id, frame_index=res.frame_index, capture_time=cap_ns / 1e9,
                          ready_time=now_ns / 1e9, latency_ms=res.latency_ms)
        self._chunk_meter.tick()

    def _req(self, rid: int, kind: str) -> dict:
        return self._requests.setdefault(rid, {"kind": kind, "texts": [], "n": 0, "final": None, "result": None})

    def _token_msg(self, rid, kind, frame_index, index, token_id, text, final, reason, stamp_s) -> LanguageToken:
        m = LanguageToken()
        m.header.stamp = _time_msg(int(stamp_s * 1e9)) if stamp_s else self.get_clock().now().to_msg()
        m.request_id = int(rid)
        m.task = kind
        m.frame_index = max(0, int(frame_index))
        m.index = int(index)
        m.token_id = int(token_id)
        m.text = text
        m.is_final = bool(final)
        m.finish_reason = reason
        return m

    def _on_token(self, ev) -> None:
        self._token_meter.tick()
        with self._lock:
            r = self._req(ev.request_id, ev.kind)
            r["frame_index"] = ev.frame_index
            if ev.is_final:
                r["final"] = ev
                ready = r["result"] is not None
            else:
                r["texts"].append(ev.text)
                r["n"] = ev.index + 1
                ready = False
        if not ev.is_final:
            self._pub_tokens.publish(self._token_msg(ev.request_id, ev.kind, ev.frame_index, ev.index, ev.token_id,
                                                     ev.text, False, "", ev.stamp))
        elif ready:
            self._finalize(ev.request_id)

    def _on_finished(self, res) -> None:
        with self._lock:
            r = self._req(res.request_id, res.kind)
            r["result"] = res
            ready = r["final"] is not None or res.finish_reason not in ("eos", "length")
        if res.finish_reason in ("rejected", "dropped", "error"):
            key = {"rejected": "request_rejected", "dropped": "prompt_dropped", "error": "request_error"}
            self.counters.inc(key[res.finish_reason])
            detail = (getattr(res, "detail", "") or "").lower()
            if res.finish_reason == "rejected" and ("kv" in detail or "too_large" in detail):
                self.counters.inc("kv_full")
            self.get_logger().warning(f"{res.kind} request {res.request_id} {res.finish_reason}: "
                                      f"{getattr(res, 'detail', '')}", throttle_duration_sec=2.0)
        if ready:
            self._finalize(res.request_id)

    def _finalize(self, rid: int) -> None:
        with self._lock:
            r = self._requests.pop(rid, None)
        if r is None:
            return
        res, ev = r["result"], r["final"]
        reason = res.finish_reason if res is not None else "eos"
        kind = res.kind if res is not None else r["kind"]
        frame_index = r.get("frame_index", getattr(res, "frame_index", 0))
        if ev is not None:
            r["texts"].append(ev.text)
            final = self._token_msg(rid, kind, frame_index, ev.index, ev.token_id, ev.text, True, reason, ev.stamp)
        else:   # never produced a final token (rejected / dropped / error): an empty final marker
            final = self._token_msg(rid, kind, frame_index, r["n"], -1, "", True, reason, 0.0)
        self._pub_tokens.publish(final)
        text = "".join(r["texts"])
        if kind == "conversation" and reason in ("eos", "length"):     # failures end with the final token only
            self._pub_response.publish(String(data=text))
            self.counters.inc("responses")
        elif kind == "memory" and reason in ("eos", "length"):
            self._store_memory(rid, res, text, frame_index)

    def _store_memory(self, rid: int, res, text: str, frame_index: int) -> None:
        cap_ns = self._frame_capture_ns(frame_index)
        m = MemoryEntry()
        m.header.stamp = _time_msg(cap_ns) if cap_ns else self.get_clock().now().to_msg()
        m.header.frame_id = self._frame_id
        m.frame_index = max(0, int(frame_index))
        m.text = text
        m.source_prompt = getattr(res, "prompt", "") or self.p("memory_prompt")
        m.request_id = int(rid)
        m.num_tokens = len(getattr(res, "token_ids", []) or [])
        try:
            if self._memory is not None:
                m.entry_id = self._memory.add(text=m.text, source_prompt=m.source_prompt, frame_index=m.frame_index,
                                              request_id=m.request_id, num_tokens=m.num_tokens,
                                              stamp_sec=m.header.stamp.sec, stamp_nanosec=m.header.stamp.nanosec,
                                              frame_id=m.header.frame_id)
            else:
                m.entry_id = self._next_memory_id
                self._next_memory_id += 1
        except Exception as exc:  # noqa: BLE001 - a full disk must not stop the robot
            self.counters.inc("memory_db_errors")
            self.get_logger().error(f"memory entry not stored: {exc}", throttle_duration_sec=5.0)
            m.entry_id = 0
        self._pub_memory.publish(m)
        self.counters.inc("memory_entries")

    def _frame_capture_ns(self, frame_index: int) -> int | None:
        """Capture time of an engine frame (recorded from its ActionResult), for memory entries."""
        with self._lock:
            return self._frame_cap.get(frame_index)

    # ------------------------------------------------------------------------------------------------ control
    def _control_loop(self) -> None:
        period = 1.0 / float(self.p("control_rate_hz"))
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
                self.counters.inc("control_errors")
                self.get_logger().error(f"control tick failed: {exc}", throttle_duration_sec=2.0)

    def _control_tick(self) -> None:
        if self._state != "active" or self._buffer is None:
            return
        now_ns = self._now_ns()
        s = self._buffer.sample(now_ns / 1e9)
        if s is None:
            return
        with self._lock:
            cap_ns = self._chunk_stamp.get(s.chunk_id, int(round(s.capture_time * 1e9)))
        m = ActionChunk()
        m.header.stamp = _time_msg(cap_ns)
        m.header.frame_id = self._frame_id
        m.frame_index = int(s.frame_index)
        m.chunk_id = int(s.chunk_id)
        m.start_time = _time_msg(now_ns)
        m.step_dt = 1.0 / float(self.p("control_rate_hz"))
        m.horizon = int(s.actions.shape[0])
        m.action_dim = int(s.actions.shape[1])
        m.joint_names = list(self._action_names) if len(self._action_names) == s.actions.shape[1] else []
        m.actions = s.actions.reshape(-1).astype(np.float32).tolist()
        m.inference_latency_ms = float(s.latency_ms)
        m.observation_age_s = float((now_ns - cap_ns) / 1e9)
        m.blended = bool(s.blended)
        self._pub_actions.publish(m)
        self._published_chunks += 1
        if s.held:
            self._held += 1
        self._control_meter.tick()

    # ------------------------------------------------------------------------------------------------ diagnostics
    def _engine_metrics(self) -> dict:
        eng = self.engine
        if eng is None or not hasattr(eng, "metrics"):
            return {}
        try:
            return dict(eng.metrics())
        except Exception as exc:  # noqa: BLE001
            self.get_logger().warning(f"engine.metrics() failed: {exc}", throttle_duration_sec=10.0)
            return {}

    def snapshot(self) -> dict:
        """Everything /diagnostics reports, as a flat dict (also used by tests and tools)."""
        now_ns = self._now_ns()
        with self._lock:
            prim = self._latest[self._primary_slot] if self._latest else None
            queue = len(self._prompts)
            active_req = len(self._requests)
        age = None if prim is None else (now_ns - prim[1]) / 1e9
        max_age = float(self.p("max_observation_age_s"))
        em = self._engine_metrics()
        cyc = sorted(self._cycle_ms)
        wait = sorted(self._wait_ms)
        cap = em.get("kv_bytes_capacity") or 0
        used = em.get("kv_bytes_in_use") or 0
        err_delta = self._cycle_errors - self._cycle_errors_prev
        self._cycle_errors_prev = self._cycle_errors
        return {
            "state": self._state, "configure_error": self.configure_error, "model": self.model_info,
            "engine_mode": self.p("engine_mode"),
            "control_rate_hz": float(self.p("control_rate_hz")),
            "control_rate_measured_hz": self._control_meter.rate(),
            "chunks_published": self._published_chunks, "held_messages": self._held,
            "inference_rate_hz": self._cycle_meter.rate(),
            "action_frequency_hz": self._chunk_meter.rate() * getattr(self, "_horizon", 0),
            "chunk_rate_hz": self._chunk_meter.rate(),
            "cycle_latency_ms_p50": cyc[len(cyc) // 2] if cyc else 0.0,
            "cycle_latency_ms_p99": cyc[min(len(cyc) - 1, int(len(cyc) * 0.99))] if cyc else 0.0,
            "frame_age_at_cycle_ms_p50": wait[len(wait) // 2] if wait else 0.0,
            "observation_age_s": age, "max_observation_age_s": max_age,
            "stale": self._state == "active" and (age is None and time.monotonic() - self._t_start > 30.0
                                                  or age is not None and age > max_age),
            "stale_behavior": self.p("stale_behavior"),
            "cycles": self._cycles, "cycle_errors": self._cycle_errors, "cycle_errors_delta": err_delta,
            "deadline_misses": self._deadline_misses,
            "tokens_per_s": self._token_meter.rate(),
            "active_requests": em.get("kv_active_requests", active_req),
            "prompt_queue": queue + int(em.get("pending", 0) or 0),
            "kv_used_fraction": (used / cap) if cap else 0.0, "kv_used_bytes": used, "kv_capacity_bytes": cap,
            "counters": self.counters.snapshot(), "uptime_s": time.monotonic() - self._t_start,
            "engine": {k: v for k, v in em.items() if k.startswith("kv_") or k.startswith("requests_")
                       or k in ("frames", "tokens_total", "deadline_misses", "k_mean", "ttft_ms_p50",
                                "action_latency_ms_p50", "cycle_ms_p50", "cycle_ms_p99")},
        }

    def _publish_diagnostics(self) -> None:
        try:
            s = self.snapshot()
            s["counters_delta"] = self.counters.delta()
            arr = diag.to_msg(diag.build_statuses(s), stamp=self.get_clock().now().to_msg())
            self._diag_pub.publish(arr)
        except Exception as exc:  # noqa: BLE001 - diagnostics must never take the node down
            self.get_logger().error(f"diagnostics failed: {exc}", throttle_duration_sec=10.0)


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


def main(argv=None, engine_factory=None) -> int:
    """Entry point of ``oxygen_node`` / ``oxygen node``.  ``argv``: ROS arguments (``--ros-args ...``)."""
    args = list(sys.argv if argv is None else ["oxygen_node", *argv])
    if any(a in ("-h", "--help") for a in args[1:]) and "--ros-args" not in args:
        print(__doc__.strip())
        print("\nparameters (config/oxygen.yaml):")
        for name, spec in PARAMETERS.items():
            print(f"  {name:24s} {spec[1]!r:40.40s} {spec[2]}")
        return 0
    _throttle_python_logging()
    # The control thread must get the GIL promptly while the inference thread runs Python between torch ops:
    # a 1 ms switch interval (default 5 ms) bounds how long it waits for it.
    sys.setswitchinterval(0.001)
    rclpy.init(args=args)
    try:
        node = OxygenNode(engine_factory=engine_factory)
    except Exception as exc:  # noqa: BLE001 - e.g. a parameter outside its declared range
        print(f"oxygen_node: cannot start: {type(exc).__name__}: {exc}", file=sys.stderr)
        rclpy.try_shutdown()
        return 2
    executor = MultiThreadedExecutor(num_threads=2)
    executor.add_node(node)
    rc = 0
    try:
        if node.p("autostart"):
            node.trigger_configure()
            if node._state != "inactive":
                node.get_logger().fatal(f"autostart: configure failed ({node.configure_error}); exiting with status 2")
                node._publish_diagnostics()
                time.sleep(0.2)
                return 2
            node.trigger_activate()
        executor.spin()
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    finally:
        t = time.monotonic()
        node.stop_all()
        executor.shutdown(timeout_sec=1.0)
        node.destroy_node()
        rclpy.try_shutdown()
        if os.environ.get("OXYGEN_DEBUG"):
            print(f"oxygen_node: shut down in {time.monotonic() - t:.2f} s", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
