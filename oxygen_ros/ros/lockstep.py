"""The node's policy side driven in-process on simulated time: what ``oxygen sim-eval`` and ``oxygen sim-record``
run in lockstep.

This file owns the adapter between the simulation's episode loop (``sim/episode.py``, which asks a ``Policy`` for
trajectories) and the node's own code: ``PipelinePolicy`` builds the node's ``Pipeline`` (``ros/pipeline.py``:
engine, action space, chunk buffer, chunking, limits) from the node's ``Settings`` and turns every new chunk into the
node's ``joint_trajectory`` message (``ros/messages.py``), read back by the executor exactly as ``sim_node`` reads it
from DDS (``ros/sim_io.py``).  Nothing of the policy side is re-implemented here; only the clock is simulated:
``act(obs, ready_t)`` feeds the cameras' frames (stamped with their capture time), the newest joint state and the
instruction into ``pipeline.inputs`` as the node's subscriptions would, runs ``pipeline.step`` at the cycle's start
and makes the engine's chunk arrive at ``ready_t`` (the modelled inference delay: the pipeline's clock jumps there
when the engine calls back ``on_actions``), so the trajectory's stamp is ``ready_t``.  Every episode gets a fresh
pipeline and engine (same model object): request ids, frame indices and the action-noise generator restart, so an
episode does not depend on the ones before it.  ``LanguageLoad`` asks scene questions on the ``conversation/prompt``
path and memory requests every ``memory_every_s`` (the node's ``memory_interval_s``); ``language_log`` lists every
answer and memory entry with the capture time of the frame it read, for scoring against the ground truth.
The scripted expert enters through the same ``engine_factory`` slot as a model (``sim.expert.ExpertEngine``).
``faults``: ``Fault`` windows of sim time in which one input or the engine goes wrong the way it would on a robot (a
camera or ``joint_states`` silent, the engine returning NaN chunks: the pipeline's ``chunk_nonfinite`` injection,
the node deactivated and activated again), for the closed-loop fault tests.
Sim time t (episode seconds) maps to clock ``EPOCH_NS + t`` so no stamp is zero.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from oxygen_ros.sim.episode import SimObservation
from oxygen_ros.sim.scene import CAMERAS, CONTROL_DT, JOINTS

from . import messages
from .engine_factory import BuiltEngine, build_engine
from .language import ChunkOut, MemoryOut, ResponseOut, TokenOut
from .parameters import ConfigureError, Settings, load_params_file, package_config
from .sim_io import camera_msg, joint_state_msg, trajectory_from_msg

__all__ = ["EPOCH_NS", "Fault", "LanguageLoad", "PipelinePolicy", "sim_settings", "default_sim_params"]

EPOCH_NS = 1_000_000_000_000          # episode time 0 = 1000 s on the pipeline's clock


def default_sim_params() -> Path:
    """config/sim_aloha.yaml (source checkout, else the installed share directory)."""
    return package_config("sim_aloha.yaml")


def sim_settings(params_file: str | None = None, overrides: dict | None = None) -> Settings:
    """The node's ``Settings`` for a simulated run: the YAML (default config/sim_aloha.yaml) + overrides, checked
    like the node checks them; the memory database off, adaptive k refused (not reproducible)."""
    values = load_params_file(params_file or default_sim_params())
    values.update(overrides or {})
    if values.get("adaptive_k"):
        raise ConfigureError("adaptive_k picks k from measured cycle times; lockstep runs refuse it")
    values["memory_db"] = ""
    return Settings.from_values(values)


@dataclass(frozen=True)
class LanguageLoad:
    """Language requests during an episode (sim time): one scene question every ``question_every_s`` (cycling through
    ``questions``), one memory request every ``memory_every_s``; 0 = none."""
    question_every_s: float = 0.0
    memory_every_s: float = 0.0
    questions: tuple = ()

    @staticmethod
    def parse_periods(text: str) -> tuple[float, float]:
        """A load label 'none' | 'q<s>' | 'm<s>' | 'q<s>m<s>' -> (question_every_s, memory_every_s); ValueError."""
        import re  # noqa: PLC0415

        t = text.strip().lower()
        if t == "none":
            return 0.0, 0.0
        m = re.fullmatch(r"(?:q(\d+(?:\.\d+)?))?(?:m(\d+(?:\.\d+)?))?", t)
        if not m or not (m.group(1) or m.group(2)):
            raise ValueError(f"language load must be none, q<s>, m<s> or q<s>m<s> (e.g. q1m2), got {text!r}")
        q, mm = float(m.group(1) or 0), float(m.group(2) or 0)
        if (m.group(1) and q <= 0) or (m.group(2) and mm <= 0):
            raise ValueError(f"language load periods must be > 0, got {text!r}")
        return q, mm

    @property
    def active(self) -> bool:
        return self.question_every_s > 0 or self.memory_every_s > 0

    def label(self) -> str:
        if not self.active:
            return "none"
        q = f"q/{self.question_every_s:g}s" if self.question_every_s > 0 else ""
        m = f"mem/{self.memory_every_s:g}s" if self.memory_every_s > 0 else ""
        return "+".join(x for x in (q, m) if x)


@dataclass(frozen=True)
class Fault:
    """One fault during the sim-time window [start_s, end_s) of an episode.  ``kind``: ``camera`` (the primary camera's
    frames captured in the window never arrive), ``joint_states`` (no joint state arrives), ``engine_nonfinite``
    (every chunk of a cycle started in the window comes back non-finite: ``Pipeline.inject("chunk_nonfinite")``),
    ``inactive`` (the node deactivated: no input taken, no cycle run, nothing published; at the first cycle after
    the window it is activated again: ``Pipeline.reset_io``, as ``on_activate`` does)."""
    kind: str
    start_s: float
    end_s: float

    KINDS = ("camera", "joint_states", "engine_nonfinite", "inactive")

    def __post_init__(self):
        if self.kind not in self.KINDS:
            raise ValueError(f"fault kind must be one of {self.KINDS}, got {self.kind!r}")

    def covers(self, t: float) -> bool:
        return self.start_s <= t < self.end_s


class _Clock:
    def __init__(self):
        self.ns = EPOCH_NS

    def __call__(self) -> int:
        return self.ns


@dataclass
class _Collected:
    trajectories: list = field(default_factory=list)       # JointTrajectory messages not yet handed out
    frames: dict = field(default_factory=dict)             # engine frame index -> capture ns
    responses: list = field(default_factory=list)
    memories: list = field(default_factory=list)
    tokens: int = 0


class _Outputs:
    """The pipeline's ``Outputs``: chunks become the node's JointTrajectory (as ``node.py`` publishes them)."""

    def __init__(self, settings: Settings, sink: _Collected):
        self.settings, self.sink = settings, sink

    def chunk(self, c: ChunkOut) -> None:
        self.sink.frames[c.frame_index] = c.capture_ns
        if c.view is not None:
            self.sink.trajectories.append(messages.joint_trajectory(
                c.view, step_dt=1.0 / self.settings.control_rate_hz, joint_names=self.settings.action_names))

    def token(self, t: TokenOut) -> None:
        self.sink.tokens += 1

    def response(self, r: ResponseOut) -> None:
        self.sink.responses.append(r)

    def memory(self, m: MemoryOut) -> None:
        self.sink.memories.append(m)


class _ReusingFactory:
    """``build_engine`` once (the model is loaded or built once per process), then a fresh ``Engine`` on the same
    model and processor for every episode."""

    def __init__(self):
        self._first: BuiltEngine | None = None

    def __call__(self, settings: Settings, *, on_actions, on_token, on_finished) -> BuiltEngine:
        if self._first is None:
            self._first = build_engine(settings, on_actions=on_actions, on_token=on_token, on_finished=on_finished)
            return self._first
        from oxygen_ros.engine.engine import Engine  # noqa: PLC0415

        e = self._first.engine
        engine = Engine(e.model, e.processor, e.config, on_actions=on_actions, on_token=on_token,
                        on_finished=on_finished)
        b = self._first
        return BuiltEngine(engine, b.info, b.action_dims, b.horizon, b.state_dim_max, b.image_size, b.max_requests)


class PipelinePolicy:
    """``sim.episode.Policy`` backed by the node's ``Pipeline``.  ``expert=True``: the scripted expert instead of a
    model (``settings`` should then have absolute actions: ``delta_action_mask: []``), planning ``horizon`` rows."""

    def __init__(self, settings: Settings, *, expert: bool = False, expert_noise: float = 0.0,
                 horizon: int | None = None, language: LanguageLoad = LanguageLoad(), faults=(), logger=None):
        if settings.control_rate_hz != 1.0 / CONTROL_DT:
            raise ConfigureError(f"control_rate_hz must be the simulation's {1.0 / CONTROL_DT:g} Hz, got "
                                 f"{settings.control_rate_hz:g}")
        if list(settings.action_names) != list(JOINTS) or list(settings.state_names) != list(JOINTS):
            raise ConfigureError("state_joint_names and action_joint_names must be the simulated robot's 14 joints "
                                 f"{list(JOINTS)} (config/sim_aloha.yaml)")
        if "joint_trajectory" not in settings.outputs:
            raise ConfigureError("the simulation executes joint_trajectory: add it to `outputs`")
        self.settings = settings
        self.expert = expert
        self.expert_noise = float(expert_noise)
        self._expert_horizon = int(horizon or settings.horizon or 20)
        self.language = language
        self.faults = tuple(faults)
        self.logger = logger or logging.getLogger("oxygen.lockstep")
        self._factory = _ReusingFactory()
        self.pipeline = None
        self.clock = _Clock()
        self._ready_ns = EPOCH_NS
        self.language_log: list[dict] = []
        self.cycle_outcomes: dict = {}

    @property
    def horizon(self) -> int:
        """Rows per chunk: the model's (the expert's ``horizon``)."""
        return self.pipeline.horizon if self.pipeline is not None else self._expert_horizon

    # ---- episode ---------------------------------------------------------------------------------------------------
    def reset(self, spec, sim) -> None:
        from .pipeline import Pipeline  # noqa: PLC0415 - loads torch (engine) only when used

        self._finish_episode()
        self.clock.ns = EPOCH_NS
        self.sink = _Collected()
        self.spec, self.sim = spec, sim
        self.language_log = []
        self.cycle_outcomes = {"ran": 0, "stale": 0, "error": 0}
        self._next_question = 0.0 if self.language.question_every_s > 0 else None
        self._question_i = 0
        self._instruction_sent = False
        self._inactive = False
        factory = self._expert_factory if self.expert else self._factory
        # memory requests only as the language load asks (the node's memory_interval_s, on sim time)
        settings = self.settings.replace(memory_interval_s=float(self.language.memory_every_s))
        self.pipeline = Pipeline(settings, _Outputs(self.settings, self.sink), clock_ns=self.clock,
                                 logger=self.logger, engine_factory=self._delayed(factory))
        self.pipeline.reset_io()

    def _delayed(self, factory):
        """Wrap an engine factory so that the engine's chunk arrives at the modelled ready time."""
        def make(settings, *, on_actions, on_token, on_finished):
            def arrive(res):
                self.clock.ns = max(self.clock.ns, self._ready_ns)
                on_actions(res)
            return factory(settings, on_actions=arrive, on_token=on_token, on_finished=on_finished)
        return make

    def _expert_factory(self, settings, *, on_actions, on_token, on_finished) -> BuiltEngine:
        from oxygen_ros.sim.expert import Expert, ExpertEngine  # noqa: PLC0415

        engine = ExpertEngine(Expert(self.sim, self.spec, noise=self.expert_noise), self._expert_horizon,
                              lambda: (self._ready_ns - EPOCH_NS) / 1e9, on_actions=on_actions)
        h, w = self.sim.camera_size
        return BuiltEngine(engine, "scripted expert", len(JOINTS), self._expert_horizon, len(JOINTS), max(h, w), 1)

    def act(self, obs: SimObservation, ready_t: float) -> list:
        p = self.pipeline
        now = EPOCH_NS + int(round((obs.state_t if obs.state_t >= 0 else obs.t) * 1e9))
        cap = EPOCH_NS + int(round(obs.t * 1e9))
        self.clock.ns = now
        self._ready_ns = EPOCH_NS + int(round(ready_t * 1e9))
        t = (now - EPOCH_NS) / 1e9
        down = {f.kind for f in self.faults if f.covers(t)}
        if "inactive" in down:               # deactivated: no subscription, no cycle, nothing published
            self._inactive = True
            return []
        if self._inactive:                   # activated again
            self._inactive = False
            p.reset_io()
        for slot, (cam, img) in enumerate(zip(CAMERAS, obs.images)):
            if slot < len(self.settings.slot_topics) and self.settings.slot_topics[slot]:
                if not (slot == p.inputs.primary_slot and any(f.kind == "camera" and f.covers(obs.t)
                                                              for f in self.faults)):
                    p.inputs.on_image(slot, camera_msg(img, cap, cam), now)
        if "joint_states" not in down:
            p.inputs.on_joint_state(joint_state_msg(JOINTS, obs.state, now), now)
        if "engine_nonfinite" in down:
            p.inject("chunk_nonfinite")
        if not self._instruction_sent:
            p.inputs.on_instruction(obs.instruction)
            self._instruction_sent = True
        while self._next_question is not None and self._next_question <= t + 1e-9:
            qs = self.language.questions
            p.inputs.on_prompt(qs[self._question_i % len(qs)], now)
            self._question_i += 1
            self._next_question += self.language.question_every_s
        outcome = p.step(now)
        self.cycle_outcomes[outcome] = self.cycle_outcomes.get(outcome, 0) + 1
        self._log_language()
        out = [trajectory_from_msg(m, EPOCH_NS / 1e9) for m in self.sink.trajectories]
        self.sink.trajectories.clear()
        return out

    # ---- language --------------------------------------------------------------------------------------------------
    def _capture_t(self, frame_index: int) -> float | None:
        ns = self.sink.frames.get(frame_index)
        return None if ns is None else (ns - EPOCH_NS) / 1e9

    def _log_language(self) -> None:
        for r in self.sink.responses:
            self.language_log.append({"kind": "conversation", "prompt": r.prompt, "text": r.text,
                                      "finish_reason": r.finish_reason, "frame_t": self._capture_t(r.frame_index),
                                      "t": (r.stamp_ns - EPOCH_NS) / 1e9})
        for m in self.sink.memories:
            self.language_log.append({"kind": "memory", "prompt": m.source_prompt, "text": m.text,
                                      "finish_reason": "", "frame_t": (m.stamp_ns - EPOCH_NS) / 1e9,
                                      "t": None})
        self.sink.responses.clear()
        self.sink.memories.clear()

    def _finish_episode(self) -> None:
        if self.pipeline is not None:
            self.pipeline.close()
            self.pipeline = None

    def close(self) -> None:
        self._finish_episode()

    def engine_metrics(self) -> dict:
        return {} if self.pipeline is None else self.pipeline.engine_metrics()
