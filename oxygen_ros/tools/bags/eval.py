"""``oxygen bag-eval BAG``: run a recorded bag through the node's own inference path, offline and deterministically,
and record every output in a bag.

This file owns the offline driver.  It builds the node's ``Pipeline`` (``ros/pipeline.py``: the same Processor,
Engine, chunk buffer, stale check and memory schedule as ``oxygen_node``) from the same parameter table and
validation (``--params`` YAML + ``-p name:=value`` -> ``Settings``), reads the bag with rosbags, and replays it on
*bag time*: every message is handed to ``pipeline.inputs`` at its recorded (log) time, on the topics the node would
subscribe to (``camera_topics``, ``joint_states``, ``instruction``, ``conversation/prompt``, resolved with
``--namespace`` / ``--remap`` like the node's names), and ``pipeline.step(t)`` runs when the node's inference thread
would start a cycle (``InferenceSchedule``).  Inference is instantaneous in bag time: a chunk is ready at its
cycle's start, and tokens, answers and memory entries are stamped with the bag time of the cycle that produced them.
Outputs go through the node's message builders (``ros/messages.py``) into an ``OutputBag`` (``tools/bags/output.py``):
``action_chunk`` once per new chunk (what the control loop publishes at its first tick after the chunk arrives: the
buffer's remainder at the ready time, blending and ``chunk_time_origin`` applied), ``language/tokens``,
``conversation/response``, ``memory/entries``.  Wall-clock values never enter the bag (``inference_latency_ms`` is
written as 0; the measured timings are in ``summary.json``), the memory database is off (entry ids count from 1),
request ids count from 1 per engine and the global torch RNG is seeded with ``seed``, so two runs with the same bag,
parameters and code give byte-identical bags on one machine.  ``adaptive_k`` is refused: it picks k from measured
cycle times.  ``BagEval.run()`` returns the summary (frames, cycles, chunks, answers, timing of each stage); ``main``
is the command line (``run_command``: the same, leaving the process's logging alone).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from oxygen_ros.ros.parameters import ConfigureError, Settings, load_params_file, parse_overrides

from .output import OutputBag
from .topic_names import TopicNames

__all__ = ["InferenceSchedule", "EvalOptions", "BagEval", "settings_for_eval", "run_command", "main"]

_INPUT_TYPES = {"image": "sensor_msgs/msg/Image", "joint_states": "sensor_msgs/msg/JointState",
                "instruction": "std_msgs/msg/String", "prompt": "std_msgs/msg/String"}


class InferenceSchedule:
    """When the node's inference thread starts a cycle, on bag time with instantaneous inference: once a new
    primary-camera frame has arrived and at least ``1 / rate_hz`` after the previous cycle's start (``rate_hz`` 0 or
    ``every_frame``: at each new primary frame).  A cycle at time T sees every message recorded at or before T, so
    the other cameras' frames of the same instant are included."""

    def __init__(self, rate_hz: float, every_frame: bool = False):
        self.period_ns = 0 if every_frame or rate_hz <= 0 else int(round(1e9 / rate_hz))
        self._last: int | None = None
        self._pending: int | None = None

    def on_primary(self, t_ns: int) -> None:
        if self._pending is None:
            self._pending = t_ns if self._last is None else max(t_ns, self._last + self.period_ns)

    def due_before(self, t_ns: int) -> int | None:
        """The start of a cycle that must run before a message recorded at ``t_ns`` is delivered, or None."""
        if self._pending is not None and self._pending < t_ns:
            return self._take()
        return None

    def flush(self) -> int | None:
        """The cycle still pending at the end of the bag, or None."""
        return self._take() if self._pending is not None else None

    def _take(self) -> int:
        t, self._pending, self._last = self._pending, None, self._pending
        return t


@dataclass
class EvalOptions:
    bag: str
    out: str
    params_file: str | None = None           # None = the shipped config/oxygen.yaml
    overrides: dict = field(default_factory=dict)
    namespace: str = "/"
    remaps: list = field(default_factory=list)
    storage: str = "mcap"
    every_frame: bool = False
    start_s: float = 0.0                     # from the bag's start
    duration_s: float | None = None
    overwrite: bool = False


def settings_for_eval(params_file: str | None, overrides: dict) -> tuple[Settings, list[str]]:
    """The node's ``Settings`` for an offline run (YAML + overrides, the node's validation) and notes on what
    bag-eval changed.  Raises ``ConfigureError``."""
    from oxygen_ros.tools.harness import default_params_file  # noqa: PLC0415

    values = load_params_file(params_file or default_params_file())
    values.update(overrides)
    notes = []
    if values.get("adaptive_k"):
        raise ConfigureError("adaptive_k chooses k from measured cycle times, so its outputs are not reproducible; "
                             "bag-eval refuses it (set -p adaptive_k:=false and a fixed decode_k)")
    if values.get("memory_db"):
        notes.append(f"memory_db {values['memory_db']!r} not used: entries are only written to the output bag "
                     "(entry ids count from 1)")
    values["memory_db"] = ""
    return Settings.from_values(values), notes


class _BagOutputs:
    """The pipeline's ``Outputs`` sink: records -> the node's messages -> ``OutputBag``, logged at bag time."""

    def __init__(self, bag: OutputBag, clock_ns: Callable[[], int], step_dt: float):
        from std_msgs.msg import String  # noqa: PLC0415

        from oxygen_ros.ros import messages  # noqa: PLC0415

        self.bag, self.clock_ns, self.step_dt = bag, clock_ns, step_dt
        self._messages, self._String = messages, String
        self.pipeline = None                 # set once built: a chunk message is the buffer's view at ready time
        self.latency_ms: list[float] = []    # measured, per chunk (summary only)
        self.chunks_expired = 0              # chunks with no row left at their ready time (chunk_time_origin)
        self.write_s = 0.0

    def _write(self, output: str, stamp_ns: int, msg) -> None:
        t = time.perf_counter()
        self.bag.write(output, stamp_ns, msg)
        self.write_s += time.perf_counter() - t

    def chunk(self, c) -> None:
        self.latency_ms.append(float(c.latency_ms))
        s = self.pipeline.sample(c.ready_ns)
        if s is None:
            self.chunks_expired += 1
            return
        s = dataclasses.replace(s, latency_ms=0.0)         # wall-clock: never in the bag
        self._write("action_chunk", c.ready_ns, self._messages.action_chunk(
            s, now_ns=c.ready_ns, step_dt=self.step_dt, joint_names=self.pipeline.action_names))

    def token(self, t) -> None:
        self._write("language/tokens", self.clock_ns(), self._messages.language_token(t))

    def response(self, r) -> None:
        self._write("conversation/response", self.clock_ns(), self._String(data=r.text))

    def memory(self, m) -> None:
        self._write("memory/entries", self.clock_ns(), self._messages.memory_entry(m))


class _BagClock:
    """The pipeline's clock: the bag time the replay has reached (ns)."""

    def __init__(self):
        self.ns = 0

    def __call__(self) -> int:
        return self.ns


class _Loop:
    """Counts and times the replay loop: cycles by outcome, delivered messages, the bag time span."""

    def __init__(self, pipeline, clock: _BagClock):
        self.pipeline, self.clock = pipeline, clock
        self.steps = {"ran": 0, "stale": 0, "error": 0}
        self.messages = 0
        self.first_ns: int | None = None
        self.last_ns: int | None = None
        self.read_s = self.step_s = 0.0

    def delivered(self, t_ns: int) -> None:
        self.clock.ns = max(self.clock.ns, t_ns)
        self.messages += 1
        self.first_ns = t_ns if self.first_ns is None else self.first_ns
        self.last_ns = t_ns

    def step(self, t_ns: int) -> None:
        self.clock.ns = t_ns
        t0 = time.perf_counter()
        self.steps[self.pipeline.step(t_ns)] += 1
        self.step_s += time.perf_counter() - t0


class BagEval:
    """One offline evaluation: ``BagEval(options).run() -> summary dict`` (also written to ``OUT/summary.json``)."""

    def __init__(self, options: EvalOptions, logger: logging.Logger | None = None):
        self.o = options
        self.log = logger or logging.getLogger("oxygen.bag_eval")
        self.settings, self.notes = settings_for_eval(options.params_file, options.overrides)
        self.names = TopicNames(options.namespace, list(options.remaps))
        self.clock = _BagClock()

    # ------------------------------------------------------------------------------------------------ inputs
    def _input_topics(self, connections) -> dict:
        """bag topic -> [(kind, slot)] for the node's inputs present in the bag (names resolved as the node does,
        types checked).  Raises ConfigureError when the primary camera is missing."""
        s = self.settings
        wanted = [(rel, "image", slot) for slot, rel in enumerate(s.slot_topics) if rel]
        wanted += [("joint_states", "joint_states", None), ("instruction", "instruction", None),
                   ("conversation/prompt", "prompt", None)]
        types = {c.topic: c.msgtype for c in connections}
        self.input_topics = {rel: self.names.resolve(rel) for rel, _, _ in wanted}
        plan: dict[str, list] = {}
        for rel, kind, slot in wanted:
            topic = self.input_topics[rel]
            if topic not in types:
                continue
            if types[topic] != _INPUT_TYPES[kind]:
                raise ConfigureError(f"bag topic {topic} is {types[topic]}, the node expects {_INPUT_TYPES[kind]}")
            plan.setdefault(topic, []).append((kind, slot))
        primary = self.input_topics[s.slot_topics[s.primary_slot]]
        if primary not in types:
            raise ConfigureError(f"the primary camera topic {primary} is not in the bag (topics: {sorted(types)}); "
                                 "set camera_topics, --namespace or --remap")
        return plan

    @staticmethod
    def _handlers(plan: dict, inputs, schedule: InferenceSchedule) -> dict:
        """bag topic -> [handler(msg, t_ns)]: the node's subscription callbacks, on bag time."""
        def image(slot):
            def on_image(m, t):
                if inputs.on_image(slot, m, t) and slot == inputs.primary_slot:
                    schedule.on_primary(t)
            return on_image
        make = {"image": image, "joint_states": lambda _: inputs.on_joint_state,
                "instruction": lambda _: (lambda m, t: inputs.on_instruction(m.data)),
                "prompt": lambda _: (lambda m, t: inputs.on_prompt(m.data, t))}
        return {topic: [make[kind](slot) for kind, slot in uses] for topic, uses in plan.items()}

    # ------------------------------------------------------------------------------------------------ the run
    def run(self) -> dict:
        import torch  # noqa: PLC0415
        from rosbags.rosbag2 import Reader  # noqa: PLC0415

        from oxygen_ros.ros.pipeline import Pipeline  # noqa: PLC0415

        from oxygen_ros.bags.types import typestore  # noqa: PLC0415

        o, s = self.o, self.settings
        with Reader(Path(o.bag)) as reader:
            plan = self._input_topics(reader.connections)
            t_begin = time.perf_counter()
            out = Path(o.out)
            bag = OutputBag(out, self.names, storage=o.storage, overwrite=o.overwrite)
            sink = _BagOutputs(bag, self.clock, 1.0 / s.control_rate_hz)
            try:
                pipeline = Pipeline(s, sink, clock_ns=self.clock, logger=self.log)
                sink.pipeline = pipeline
                torch.manual_seed(int(s.seed))               # language sampling (temperature > 0) draws from it
                t_built = time.perf_counter()
                schedule = InferenceSchedule(s.frame_rate_hz, o.every_frame)
                handlers = self._handlers(plan, pipeline.inputs, schedule)
                loop = _Loop(pipeline, self.clock)
                ts = typestore()
                start = reader.start_time + int(o.start_s * 1e9)
                stop = None if o.duration_s is None else start + int(o.duration_s * 1e9)
                conns = [c for c in reader.connections if c.topic in handlers]
                t_read = time.perf_counter()
                for c, t_ns, raw in reader.messages(connections=conns, start=start, stop=stop):
                    due = schedule.due_before(t_ns)
                    if due is not None:
                        loop.read_s += time.perf_counter() - t_read
                        loop.step(due)
                        t_read = time.perf_counter()
                    msg = ts.deserialize_cdr(raw, c.msgtype)
                    loop.delivered(t_ns)
                    for handler in handlers[c.topic]:
                        handler(msg, t_ns)
                loop.read_s += time.perf_counter() - t_read
                due = schedule.flush()
                if due is not None:
                    loop.step(due)
                t_end = time.perf_counter()
                summary = self._summary(pipeline, sink, loop, t_built - t_begin, t_end - t_built)
                pipeline.close()
            finally:
                bag.close()
        (out / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
        return summary

    def _summary(self, pipeline, sink: _BagOutputs, loop: _Loop, build_s: float, loop_s: float) -> dict:
        from oxygen_ros.engine.metrics import percentile  # noqa: PLC0415

        em = pipeline.engine_metrics()
        counters = pipeline.counters.snapshot()
        bag_s = (loop.last_ns - loop.first_ns) / 1e9 if loop.first_ns is not None else 0.0
        cycles = loop.steps["ran"]
        lat = sink.latency_ms
        return {
            "bag": str(self.o.bag), "out": str(self.o.out), "model": pipeline.info,
            "parameters": dict(self.settings.values), "overrides": dict(self.o.overrides), "notes": self.notes,
            "schedule": "every primary frame" if self.o.every_frame or self.settings.frame_rate_hz <= 0
                        else f"frame_rate_hz {self.settings.frame_rate_hz:g} of bag time",
            "input_topics": self.input_topics, "output_topics": dict(sink.bag.topics),
            "bag_seconds": bag_s, "input_messages": loop.messages,
            "primary_frames": pipeline.inputs.primary_seq,
            "cycles": cycles, "cycles_stale": loop.steps["stale"], "cycles_failed": loop.steps["error"],
            "chunks": sink.bag.counts["action_chunk"], "chunks_expired_at_arrival": sink.chunks_expired,
            "tokens": sink.bag.counts["language/tokens"], "answers": sink.bag.counts["conversation/response"],
            "memory_entries": sink.bag.counts["memory/entries"],
            "requests_unfinished": pipeline.requests.active(),
            "requests": {k[len("requests_"):]: v for k, v in em.items() if k.startswith("requests_")},
            "counters": counters,
            "timing": {
                "build_s": build_s,                       # model + engine + KV pool
                "loop_s": loop_s,                         # reading + every cycle + writing
                "read_s": loop.read_s,                    # bag reading + deserialisation + input validation
                "cycles_s": loop.step_s - sink.write_s,   # pipeline.step (image conversion + Engine.cycle) ...
                "write_s": sink.write_s,                  # ... less message building + serialisation + bag writes
                "frames_per_s": cycles / loop_s if loop_s > 0 else None,
                "realtime_factor": bag_s / loop_s if loop_s > 0 else None,
                "cycle_ms_p50": em.get("cycle_ms_p50"), "cycle_ms_p99": em.get("cycle_ms_p99"),
                "prefill_ms_per_frame": em.get("prefill_ms_per_frame"),
                "actions_ms_per_frame": em.get("actions_ms_per_frame"),
                "decode_ms_per_frame": em.get("decode_ms_per_frame"),
                "other_ms_per_frame": em.get("other_ms_per_frame"),
                "chunk_latency_ms_p50": percentile(lat, 50), "chunk_latency_ms_p99": percentile(lat, 99),
            },
        }


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="oxygen bag-eval", description=(
        "Run a recorded bag through the node's inference path (same parameters, Processor, Engine, chunk/stale/"
        "memory logic) offline on bag time and write every output to a bag plus summary.json. Deterministic: the "
        "same bag, parameters and code give byte-identical output bags on one machine."))
    p.add_argument("bag", help="input rosbag2 directory")
    p.add_argument("--params", default=None, help="ROS parameter YAML (default: the shipped config/oxygen.yaml)")
    p.add_argument("-p", "--param", action="append", default=[], metavar="NAME:=VALUE",
                   help="override a node parameter (YAML value), repeatable")
    p.add_argument("--out", default="out/bag_eval", help="output bag directory (default: %(default)s)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    p.add_argument("--storage", choices=("mcap", "sqlite3"), default="mcap")
    p.add_argument("--namespace", default="/", help="the node's namespace (its relative topics resolve in it)")
    p.add_argument("-r", "--remap", action="append", default=[], metavar="FROM:=TO",
                   help="a ROS remap rule as given to the node (e.g. camera/base/image_raw:=/cam0/image), repeatable")
    p.add_argument("--every-frame", action="store_true",
                   help="a cycle at every primary-camera frame (default: at most frame_rate_hz of bag time, like "
                        "the node)")
    p.add_argument("--start", type=float, default=0.0, help="skip this many seconds of the bag")
    p.add_argument("--duration", type=float, default=None, help="evaluate this many seconds of the bag")
    p.add_argument("--quiet", action="store_true", help="no notes, no result lines, warnings only")
    return p


def run_command(argv) -> tuple[int, dict | None]:
    """``oxygen bag-eval`` without touching the process's logging set-up: (exit status, summary or None)."""
    a = _parser().parse_args(argv)
    if not (Path(a.bag) / "metadata.yaml").is_file():
        print(f"oxygen bag-eval: {a.bag} is not a rosbag2 directory (no metadata.yaml)", file=sys.stderr)
        return 2, None
    try:
        ev = BagEval(EvalOptions(a.bag, a.out, a.params, parse_overrides(a.param), a.namespace, a.remap, a.storage,
                                 a.every_frame, a.start, a.duration, a.overwrite))
        for n in ev.notes if not a.quiet else ():
            print(f"note: {n}", file=sys.stderr)
        s = ev.run()
    except (ConfigureError, FileExistsError, ValueError) as exc:
        print(f"oxygen bag-eval: {exc}", file=sys.stderr)
        return 2, None
    if not a.quiet:
        t = s["timing"]
        print(f"{s['bag']}: {s['bag_seconds']:.1f} s of bag, {s['cycles']} cycles ({s['cycles_stale']} stale, "
              f"{s['cycles_failed']} failed), {s['chunks']} chunks, {s['tokens']} tokens, {s['answers']} answers, "
              f"{s['memory_entries']} memory entries, {s['requests_unfinished']} requests unfinished at the end")
        print(f"{t['frames_per_s']:.1f} frames/s ({t['realtime_factor']:.2f}x real time; model build "
              f"{t['build_s']:.1f} s, cycles {t['cycles_s']:.1f} s, read {t['read_s']:.2f} s, write "
              f"{t['write_s']:.2f} s) -> {s['out']} (+ summary.json)")
    return 0, s


def main(argv=None) -> int:
    quiet = "--quiet" in (sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.WARNING if quiet else logging.INFO, format="[%(levelname)s] %(message)s")
    from oxygen_ros.ros.node import _throttle_python_logging  # noqa: PLC0415 - the node's log throttling, as is
    _throttle_python_logging()
    return run_command(sys.argv[1:] if argv is None else argv)[0]


if __name__ == "__main__":
    sys.exit(main())
