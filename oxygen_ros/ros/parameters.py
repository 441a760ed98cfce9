"""The node's parameters: one table (name, type, default, description, range or choices), and ``Settings``, a
validated, typed snapshot of their values.

This file owns what can be configured and how a value is checked.  The lifecycle node declares every entry of
``PARAMETERS`` with a ``ParameterDescriptor`` (``descriptor``) and reads a ``Settings`` at *configure*; the offline
tools (``oxygen bag-eval``) build the same ``Settings`` from a ROS parameter YAML plus ``name:=value`` overrides
(``load_params_file``, ``parse_overrides``), so both run with identical values and the same validation.  No rclpy at
import time (``descriptor`` imports the ROS message types lazily).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import yaml

__all__ = ["PARAMETERS", "ConfigureError", "Settings", "descriptor", "load_params_file", "parse_overrides",
           "ros_args", "user_args", "refuse_stray_args", "package_config",
           "BOOL", "INT", "DOUBLE", "STRING", "STRING_ARRAY", "INT_ARRAY", "DOUBLE_ARRAY", "SLOT_NAMES",
           "OUTPUTS", "CHUNKING"]

# rcl_interfaces/ParameterType values (kept as plain ints so this table needs no ROS import)
BOOL, INT, DOUBLE, STRING, STRING_ARRAY = 1, 2, 3, 4, 9
INT_ARRAY, DOUBLE_ARRAY = 7, 8     # declared with dynamic typing: an empty default has no element type in ROS
SLOT_NAMES = ("base", "left_wrist", "right_wrist")
OUTPUTS = ("action_chunk", "joint_trajectory")
CHUNKING = ("blend", "none", "rtc")

# name: (type, default, description, range (lo, hi) or choices tuple or None)
PARAMETERS: dict[str, tuple] = {
    "autostart": (BOOL, True, "Run configure + activate at start (false: wait for a lifecycle manager).", None),
    "checkpoint": (STRING, "", "pi0.5 checkpoint directory (openpi/LeRobot safetensors + norm stats); "
                               "`demo` = the shipped simulation policy; empty = random weights of `preset`.", None),
    "preset": (STRING, "tiny", "Model architecture when no checkpoint is given.",
               ("tiny", "bench-cpu", "demo", "pi05")),
    "device": (STRING, "auto", "Torch device: auto (cuda when available, else cpu), cpu, cuda or cuda:N.", None),
    "torch_threads": (INT, 1, "Torch intra-op CPU threads; 0 = torch's default (all cores). 1 keeps the control "
                              "thread responsive and avoids OpenMP oversubscription on shared CPUs.", (0, 1024)),
    "dtype": (STRING, "", "Weights/compute dtype; empty = the preset's or checkpoint's.",
              ("", "float32", "bfloat16", "float16")),
    "prefix_attention": (STRING, "", "Prefix attention; empty = model default.", ("", "image_isolated", "upstream")),
    "horizon": (INT, 0, "Action horizon H (rows per chunk); 0 = the model's.", (0, 1000)),
    "denoise_steps": (INT, 0, "Flow-matching Euler steps; 0 = the model's.", (0, 100)),
    "seed": (INT, 0, "Seed for random weights and action noise.", (0, 2**31 - 1)),
    "engine_mode": (STRING, "oxygen", "Engine scheduling mode.", ("oxygen", "shared", "isolated")),
    "compile": (STRING, "auto", "Hot path execution: auto (CUDA: cudagraphs, the fastest measured; else none), none "
                                "(eager), inductor (torch.compile, CPU/GPU), cudagraphs (GPU: inductor in CUDA graphs "
                                "per shape bucket), inductor-graphs (GPU: autotuned inductor in the package's own CUDA "
                                "graphs). Graphs are built at configure; a compile failure falls back to eager with a "
                                "warning.", ("auto", "none", "inductor", "cudagraphs", "inductor-graphs")),
    "decode_k": (INT, 5, "Language tokens per request per cycle (oxygen mode).", (1, 256)),
    "adaptive_k": (BOOL, False, "Deadline-aware k from the frame period (needs frame_rate_hz > 0).", None),
    "max_new_tokens": (INT, 32, "Max generated tokens per language request.", (1, 4096)),
    "temperature": (DOUBLE, 0.0, "Language sampling temperature; 0 = greedy.", (0.0, 10.0)),
    "top_p": (DOUBLE, 1.0, "Nucleus sampling threshold (with temperature > 0).", (0.0, 1.0)),
    "kv_budget_mb": (DOUBLE, 0.0, "KV pool size in MiB; 0 = the engine's default.", (0.0, 1.0e6)),
    "max_wait_cycles": (INT, 0, "Reject a language request that waited this many cycles for KV/batch capacity; "
                                "0 = wait (the engine's bounded queue drops the oldest).", (0, 1_000_000)),
    "control_rate_hz": (DOUBLE, 70.0, "action_chunk publication rate.", (1.0, 1000.0)),
    "frame_rate_hz": (DOUBLE, 15.0, "Max inference cycles per second; 0 = one per new frame.", (0.0, 1000.0)),
    "max_observation_age_s": (DOUBLE, 0.5, "Frames older than this are not used; no new chunks, diagnostics ERROR.",
                              (0.001, 1.0e6)),
    "max_state_age_s": (DOUBLE, 0.0, "joint_states older than this are not used (no new chunks, diagnostics "
                                     "ERROR); 0 = max_observation_age_s.", (0.0, 1.0e6)),
    "stale_behavior": (STRING, "stop", "When the newest chunk is used up: stop publishing, or hold the last action.",
                       ("stop", "hold")),
    "chunk_time_origin": (STRING, "arrival", "Row 0 of a chunk is for the first tick after it is ready (arrival) or "
                                             "for the observation's capture time (capture).", ("arrival", "capture")),
    "blend_steps": (INT, 0, "Rows cross-faded from the previous chunk's remainder into a new chunk "
                            "(chunking: blend).", (0, 1000)),
    "chunking": (STRING, "blend", "How a new chunk takes over from the previous one: blend (cross-fade blend_steps "
                                  "rows; blend_steps 0 = switch at once, as before), none (switch at once), rtc "
                                  "(real-time chunking: the engine freezes the first d rows to what the robot "
                                  "executes while it infers and guides the overlap toward the previous chunk).",
                 CHUNKING),
    "rtc_execution_horizon": (INT, 0, "RTC: rows the robot executes of each chunk before the next one takes over "
                                      "(end of the soft guidance mask); 0 = measured (p50 of the interval between "
                                      "chunks, in control steps).", (0, 1000)),
    "rtc_max_guidance_weight": (DOUBLE, 10.0, "RTC: clip of the guidance weight (beta).", (0.0, 1.0e6)),
    "rtc_delay_steps": (INT, 0, "RTC: frozen rows d (control steps executed while a chunk is inferred); 0 = "
                                "measured (p90 of recent snapshot->chunk latencies, in control steps, rounded "
                                "up).", (0, 1000)),
    "delta_action_mask": (INT_ARRAY, [], "Per action column: 1/true = the model outputs a delta relative to the "
                                         "joint state at the observation's capture time (openpi DeltaActions), "
                                         "0/false = absolute; columns past the end are absolute; [] = all "
                                         "absolute.", None),
    "action_limits_min": (DOUBLE_ARRAY, [], "Per-column lower bound of published actions (clipped rows are "
                                            "counted); [] = none.", None),
    "action_limits_max": (DOUBLE_ARRAY, [], "Per-column upper bound of published actions; [] = none.", None),
    "action_max_step_change": (DOUBLE_ARRAY, [], "Largest change of an action column from one control step to the "
                                                 "next (also across chunk switches): one value for all columns or "
                                                 "one per column (0 = unlimited); [] = off.", None),
    "outputs": (STRING_ARRAY, ["action_chunk"], "Action outputs: action_chunk (the remainder at control_rate_hz) "
                                                "and/or joint_trajectory (trajectory_msgs/JointTrajectory once per "
                                                "new chunk, for ros2_control's joint_trajectory_controller).",
                None),
    "stamp_source": (STRING, "header", "Observation capture time: header.stamp, or arrival time.",
                     ("header", "receive")),
    "camera_topics": (STRING_ARRAY, ["camera/base/image_raw", "camera/left_wrist/image_raw",
                                     "camera/right_wrist/image_raw"],
                      "Camera topics for the model's slots (base, left wrist, right wrist); '' = empty slot.", None),
    "camera_qos": (STRING, "sensor_data", "Camera subscription QoS.", ("sensor_data", "reliable")),
    "state_joint_names": (STRING_ARRAY, [""], "Order of the state vector taken from joint_states; [''] = message "
                                              "order.", None),
    "action_joint_names": (STRING_ARRAY, [""], "Names of the published action columns (sets their number); "
                                               "[''] = all model action dimensions, unnamed.", None),
    "default_instruction": (STRING, "", "Task prompt used until the first `instruction` message.", None),
    "max_prompt_chars": (INT, 1000, "Longer prompts/instructions are truncated (counted).", (1, 1_000_000)),
    "prompt_queue_size": (INT, 32, "Conversation prompts waiting for the engine; oldest dropped when full.",
                          (1, 100_000)),
    "conversation_memory_entries": (INT, 0, "Newest memory entries prepended to each conversation prompt as context "
                                            "('Earlier you saw: ...'; oldest left out first when the prompt is too "
                                            "long); 0 = none.", (0, 100)),
    "converse_max_goals": (INT, 0, "Converse action goals in flight at once; more are rejected. 0 = the engine's "
                                   "batch capacity.", (0, 1024)),
    "memory_interval_s": (DOUBLE, 5.0, "One memory (scene description) request every N seconds; 0 = off.",
                          (0.0, 1.0e6)),
    "memory_prompt": (STRING, "Describe the scene in one sentence.", "Prompt of memory requests.", None),
    "memory_db": (STRING, "~/.ros/oxygen_ros/memory.db", "SQLite file for memory entries; '' = not stored.", None),
    "subtask_enabled": (BOOL, False, "Also run subtask-prediction requests on the current instruction.", None),
    "subtask_interval_s": (DOUBLE, 1.0, "Seconds between subtask requests.", (0.05, 1.0e6)),
    "diagnostics_period_s": (DOUBLE, 1.0, "Period of /diagnostics.", (0.05, 3600.0)),
    "debug_fault_injection": (BOOL, False, "Tests only: enable the ~/inject_fault topic.", None),
}

_PY_TYPES = {BOOL: bool, INT: int, DOUBLE: float, STRING: str, STRING_ARRAY: list, INT_ARRAY: list,
             DOUBLE_ARRAY: list}
_NUMBER = (int, float)


class ConfigureError(RuntimeError):
    """A parameter combination the node cannot run with (the message says which and why)."""


def descriptor(name: str, spec: tuple | None = None):
    """The rcl_interfaces ParameterDescriptor of a parameter (description, range or choices)."""
    from rcl_interfaces.msg import FloatingPointRange, IntegerRange, ParameterDescriptor  # noqa: PLC0415

    typ, _default, text, rng = spec or PARAMETERS[name]
    d = ParameterDescriptor(name=name, type=typ, description=text)
    if typ in (INT_ARRAY, DOUBLE_ARRAY):
        d.dynamic_typing = True      # [] has no element type; [1, 0] / [true, false] / [0.5] all accepted
    if isinstance(rng, tuple) and rng and isinstance(rng[0], str):
        d.additional_constraints = "one of: " + ", ".join(repr(c) for c in rng)
    elif rng is not None and typ == DOUBLE:
        d.floating_point_range = [FloatingPointRange(from_value=float(rng[0]), to_value=float(rng[1]), step=0.0)]
    elif rng is not None and typ == INT:
        d.integer_range = [IntegerRange(from_value=int(rng[0]), to_value=int(rng[1]), step=1)]
    return d


def check_value(name: str, value) -> str | None:
    """Why ``value`` is not acceptable for ``name`` (type, choices, range), or None."""
    spec = PARAMETERS.get(name)
    if spec is None:
        return f"unknown parameter {name!r}"
    typ, _default, _text, rng = spec
    want = _PY_TYPES[typ]
    if typ == DOUBLE and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if typ in (INT_ARRAY, DOUBLE_ARRAY) and (isinstance(value, tuple) or hasattr(value, "tolist")):
        value = list(value.tolist() if hasattr(value, "tolist") else value)
    if not isinstance(value, want) or (typ == INT and isinstance(value, bool)):
        return f"{name} must be a {want.__name__}, got {type(value).__name__} {value!r}"
    if typ == INT_ARRAY and not all(isinstance(x, bool) or isinstance(x, int) and x in (0, 1) for x in value):
        return f"{name} entries must be 0/1 or true/false, got {value!r}"
    if typ == DOUBLE_ARRAY:
        if not all(isinstance(x, _NUMBER) and not isinstance(x, bool) for x in value):
            return f"{name} entries must be numbers, got {value!r}"
        if any(x != x for x in value):
            return f"{name} contains NaN"
    if isinstance(rng, tuple) and rng and isinstance(rng[0], str):
        if value not in rng:
            return f"{name} must be one of {list(rng)}, got {value!r}"
    elif rng is not None and not (rng[0] <= value <= rng[1]):
        return f"{name} must be in [{rng[0]}, {rng[1]}], got {value!r}"
    if name == "outputs":
        bad = [o for o in value if o not in OUTPUTS]
        if bad or not value or len(set(value)) != len(value):
            return f"outputs must be a non-empty list of distinct entries of {list(OUTPUTS)}, got {value!r}"
    if name == "camera_topics" and len(value) > 3:
        return f"camera_topics has {len(value)} entries; the model has 3 camera slots"
    return None


@dataclass(frozen=True)
class Settings:
    """Every parameter's value (attribute access: ``settings.control_rate_hz``), validated, plus derived views."""
    values: dict

    @staticmethod
    def from_values(values: dict | None = None) -> "Settings":
        """Defaults overridden by ``values`` (None entries = default); raises ConfigureError on a bad value or an
        inconsistent combination."""
        out = {}
        for name, spec in PARAMETERS.items():
            v = (values or {}).get(name)
            if v is None:
                v = spec[1]
            if spec[0] == DOUBLE and isinstance(v, int) and not isinstance(v, bool):
                v = float(v)
            if spec[0] == STRING_ARRAY:
                v = [str(x) for x in v]
            if spec[0] in (INT_ARRAY, DOUBLE_ARRAY) and not isinstance(v, list):
                v = list(v.tolist() if hasattr(v, "tolist") else v)
            why = check_value(name, v)
            if why:
                raise ConfigureError(f"parameter {why}")
            if spec[0] == INT_ARRAY:
                v = [bool(x) for x in v]
            elif spec[0] == DOUBLE_ARRAY:
                v = [float(x) for x in v]
            out[name] = v
        unknown = set(values or {}) - set(PARAMETERS) - {"use_sim_time"}
        if unknown:
            raise ConfigureError(f"unknown parameter(s): {sorted(unknown)}")
        s = Settings(out)
        s._check_combination()
        return s

    def __getattr__(self, name):
        try:
            return self.values[name]
        except KeyError:
            raise AttributeError(name) from None

    def replace(self, **kw) -> "Settings":
        return Settings.from_values({**self.values, **kw})

    # ---- derived --------------------------------------------------------------------------------------------------
    @property
    def slot_topics(self) -> list[str]:
        """The three camera slots' topics ('' = masked slot)."""
        return (list(self.camera_topics) + ["", "", ""])[:3]

    @property
    def primary_slot(self) -> int:
        """The first non-empty slot: its frames trigger inference (normally the base camera)."""
        return next(i for i, t in enumerate(self.slot_topics) if t)

    @staticmethod
    def _names(v: list) -> list[str]:
        return [] if all(x == "" for x in v) else list(v)

    @property
    def state_age_limit_s(self) -> float:
        return float(self.max_state_age_s or self.max_observation_age_s)

    @property
    def state_names(self) -> list[str]:
        return self._names(self.state_joint_names)

    @property
    def action_names(self) -> list[str]:
        return self._names(self.action_joint_names)

    @property
    def publish_action_chunk(self) -> bool:
        return "action_chunk" in self.outputs

    @property
    def publish_joint_trajectory(self) -> bool:
        return "joint_trajectory" in self.outputs

    def _check_combination(self) -> None:
        if not any(self.slot_topics):
            raise ConfigureError("camera_topics has no non-empty entry; at least one camera is needed")
        if self.adaptive_k and self.frame_rate_hz <= 0:
            raise ConfigureError("adaptive_k needs frame_rate_hz > 0 (the cycle deadline)")
        if len(set(self.state_names)) != len(self.state_names):
            raise ConfigureError("state_joint_names has duplicates")
        if len(set(self.action_names)) != len(self.action_names):
            raise ConfigureError("action_joint_names has duplicates")
        if self.blend_steps > 0 and self.chunking != "blend":
            raise ConfigureError(f"blend_steps {self.blend_steps} needs chunking: blend (chunking is "
                                 f"{self.chunking!r}); set blend_steps: 0")
        if "joint_trajectory" in self.outputs and not self.action_names:
            raise ConfigureError("outputs has joint_trajectory, which needs action_joint_names (the trajectory's "
                                 "joint_names)")
        n = len(self.action_names)
        for key in ("action_limits_min", "action_limits_max"):
            if n and self.values[key] and len(self.values[key]) != n:
                raise ConfigureError(f"{key} has {len(self.values[key])} entries but action_joint_names has {n}")
        step = self.action_max_step_change
        if n and len(step) not in (0, 1, n):
            raise ConfigureError(f"action_max_step_change has {len(step)} entries: give 1 (all columns) or {n} "
                                 "(one per action_joint_names entry)")
        if any(x < 0 for x in step):
            raise ConfigureError("action_max_step_change entries must be >= 0 (0 = unlimited)")
        if n and len(self.delta_action_mask) > n:
            raise ConfigureError(f"delta_action_mask has {len(self.delta_action_mask)} entries but "
                                 f"action_joint_names has {n}")
        lo, hi = self.action_limits_min, self.action_limits_max
        if lo and hi and len(lo) == len(hi):
            bad = [i for i, (a, b) in enumerate(zip(lo, hi)) if a > b]
            if bad:
                raise ConfigureError(f"action_limits_min[{bad[0]}] = {lo[bad[0]]} > action_limits_max[{bad[0]}] = "
                                     f"{hi[bad[0]]}")


def load_params_file(path: str | os.PathLike, node_name: str = "oxygen_node") -> dict:
    """The ``ros__parameters`` of a ROS 2 parameter YAML that apply to ``node_name`` (``/**`` first, then the node's
    own section, as ROS applies them)."""
    with open(path) as f:
        doc = yaml.safe_load(f) or {}
    out: dict = {}
    for key in ("/**", node_name, "/" + node_name):
        sec = doc.get(key)
        if isinstance(sec, dict):
            out.update(sec.get("ros__parameters") or {})
    return out


def package_config(name: str) -> Path:
    """``config/<name>`` of the package: the source checkout's, else the installed share directory's."""
    here = Path(__file__).resolve().parents[2] / "config" / name
    if here.is_file():
        return here
    from ament_index_python.packages import get_package_share_directory  # noqa: PLC0415
    return Path(get_package_share_directory("oxygen_ros")) / "config" / name


def refuse_stray_args(prog: str, argv: list) -> bool:
    """A ROS node's command line with arguments outside ``--ros-args`` other than -h (``user_args``): print a usage
    error (stderr) and return True (the caller exits 2) - rcl would ignore them and start the node."""
    stray = [a for a in user_args(argv) if a not in ("-h", "--help")]
    if stray:
        import sys  # noqa: PLC0415
        print(f"usage: {prog} [--help] [--ros-args [--params-file FILE] [-p name:=value] [-r from:=to] ...]\n"
              f"{prog}: error: unrecognized arguments: {' '.join(stray)} (settings are ROS parameters: "
              "--ros-args -p name:=value)", file=sys.stderr)
    return bool(stray)


def ros_args(argv: list) -> list:
    """Command-line arguments for ``rclpy.init``: ``-p name:=`` (an empty value, which rcl cannot parse) becomes
    ``-p name:=''`` (the empty string), so ``-p memory_db:=`` means "not stored" as the parameter table says."""
    out, in_ros = [], False
    for i, a in enumerate(argv):
        if a == "--ros-args":
            in_ros = True
        elif a == "--":
            in_ros = False
        prev = argv[i - 1] if i else ""
        if in_ros and prev in ("-p", "--param") and a.endswith(":=") and len(a) > 2:
            a += "''"
        out.append(a)
    return out


def parse_overrides(items) -> dict:
    """``["name:=value", ...]`` (values in YAML syntax, as ``-p`` takes them) -> dict."""
    out = {}
    for it in items or ():
        if ":=" not in it:
            raise ConfigureError(f"override {it!r} is not name:=value")
        name, raw = it.split(":=", 1)
        out[name.strip()] = yaml.safe_load(raw) if raw.strip() else ""
    return out


def user_args(argv: list) -> list:
    """The arguments of ``argv`` (``argv[0]`` = the program) outside ``--ros-args ... [--]``: the node takes none but
    ``-h`` / ``--help`` (every setting is a ROS parameter), so anything else is a usage error (rcl ignores them)."""
    out, in_ros = [], False
    for a in argv[1:]:
        if a == "--ros-args":
            in_ros = True
        elif a == "--" and in_ros:
            in_ros = False
        elif not in_ros:
            out.append(a)
    return out
