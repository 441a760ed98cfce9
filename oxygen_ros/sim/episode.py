"""One closed-loop episode in lockstep: the simulation, a policy and the execution rule on one simulated clock.

This file owns the order of events in simulated time, deterministic by construction.  Control steps of ``CONTROL_DT``
advance one at a time; at step t (seconds ``t = step * CONTROL_DT``):

1. every ``camera_every`` steps the cameras are rendered (the newest frame; its stamp is t) and the ground truth of
   that moment is recorded (scene answers, memory text) for scoring language outputs;
2. if the policy is free (its previous chunk is ready: t >= busy_until) and a frame newer than the one it last used
   exists, the policy is asked: ``policy.act(obs, ready_t)`` with ``ready_t = t + delay_steps * CONTROL_DT``, the
   modelled inference delay d; it returns the trajectories to execute, stamped (start) at ``ready_t`` or later, and
   the policy is busy until ``ready_t`` (the node's inference thread starts its next cycle at the newest frame once
   the previous cycle has ended);
3. the trajectories are handed to the ``TrajectoryExecutor`` (rejected ones counted; the robot holds) and the
   command for t is taken from it (a trajectory stamped ``ready_t`` takes effect at step t + d);
4. the command is recorded as the executed action and the physics advance one control step; the task monitor updates.

The episode ends at the time limit, or ``tail_s`` after success when ``stop_on_success``.  The same seed, policy and d
give the same episode bit for bit (no wall clock enters).  ``EpisodeResult`` holds the executed actions and states
per step, success and its time, the policy's stale periods, rejected trajectories and the per-frame ground truth;
``on_step`` / ``on_frame`` hooks let recorders (``oxygen sim-record``) and video writers watch without changing it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np

from .execution import Trajectory, TrajectoryExecutor, TrajectoryRejected
from .scene import CONTROL_DT, JOINTS, AlohaScene
from .tasks import TaskMonitor, TaskSpec, memory_text, scene_answers, scene_facts

__all__ = ["SimObservation", "Policy", "EpisodeConfig", "EpisodeResult", "run_episode"]


@dataclass
class SimObservation:
    t: float                      # episode seconds at the cameras' capture
    images: list                  # uint8 [h, w, 3] per camera (AlohaScene.cameras order)
    state: np.ndarray             # [14] the newest joint state (at state_t)
    instruction: str
    state_t: float = -1.0         # episode seconds of ``state`` (the cycle's start; -1 = t)


class Policy(Protocol):
    def reset(self, spec: TaskSpec, sim: AlohaScene) -> None: ...
    def act(self, obs: SimObservation, ready_t: float) -> list[Trajectory]: ...


@dataclass(frozen=True)
class EpisodeConfig:
    delay_steps: int = 0          # d: control steps from an observation to its chunk taking effect
    camera_every: int = 5         # render every n control steps (5 = 10 Hz at 50 Hz control)
    stop_on_success: bool = True
    tail_s: float = 0.0           # keep running this long after success (recording)
    stale_limit_s: float = 0.5    # the robot holding for longer than this = the policy is stale
    time_limit_s: float | None = None   # default: the task's


@dataclass
class EpisodeResult:
    spec: TaskSpec
    config: EpisodeConfig
    success: bool = False
    success_time: float | None = None
    duration_s: float = 0.0
    actions: list = field(default_factory=list)        # executed command per control step [14]
    states: list = field(default_factory=list)         # state at each control step, before its command [14]
    chunk_times: list = field(default_factory=list)    # (asked at t, ready_t) per policy call
    switch_steps: list = field(default_factory=list)   # steps at which a new trajectory took over from another
    frames_gt: dict = field(default_factory=dict)      # frame stamp (episode s, rounded to ms) -> (answers, memory)
    rejected: dict = field(default_factory=dict)       # reason -> count
    stale_steps: int = 0
    max_reward: int = 0
    gym_success: bool = False                          # transfer: gym-aloha's definition (else = success)
    error: str = ""
    error_kind: str = ""                               # e.g. "physics unstable" (an outcome, not a crash)

    def to_dict(self) -> dict:
        return {"task": self.spec.task, "seed": self.spec.seed, "instruction": self.spec.instruction,
                "success": self.success, "success_time": self.success_time, "duration_s": self.duration_s,
                "steps": len(self.actions), "policy_calls": len(self.chunk_times), "rejected": dict(self.rejected),
                "stale_steps": self.stale_steps, "max_reward": self.max_reward, "gym_success": self.gym_success,
                "error": self.error,
                "ended": self.error_kind or ("success" if self.success else "timeout")}


def frame_key(t: float) -> int:
    """The key of a frame stamp in ``EpisodeResult.frames_gt`` (ms)."""
    return int(round(t * 1000))


def run_episode(sim: AlohaScene, spec: TaskSpec, policy: Policy, config: EpisodeConfig = EpisodeConfig(), *,
                on_frame: Callable | None = None, on_step: Callable | None = None) -> EpisodeResult:
    d = int(config.delay_steps)
    if d < 0 or config.camera_every < 1:
        raise ValueError("delay_steps must be >= 0 and camera_every >= 1")
    sim.reset(spec.scene)
    monitor = TaskMonitor(sim, spec)
    executor = TrajectoryExecutor(JOINTS, sim.state())
    policy.reset(spec, sim)
    res = EpisodeResult(spec, config)
    limit = spec.time_limit_s if config.time_limit_s is None else float(config.time_limit_s)
    n_steps = int(round(limit / CONTROL_DT))
    frame: SimObservation | None = None
    used_t = None
    busy_until = -1.0
    for step in range(n_steps):
        t = step * CONTROL_DT
        state = sim.state()
        if step % config.camera_every == 0:
            facts = scene_facts(sim)
            frame = SimObservation(t, sim.render(), state, spec.instruction, t)
            res.frames_gt[frame_key(t)] = (scene_answers(sim, facts), memory_text(sim, facts))
            if on_frame is not None:
                on_frame(frame, res.frames_gt[frame_key(t)])
        if frame is not None and t >= busy_until - 1e-9 and frame.t != used_t:
            ready_t = t + d * CONTROL_DT
            obs = SimObservation(frame.t, frame.images, state, spec.instruction, t)
            for tr in policy.act(obs, ready_t):
                try:
                    executor.submit(tr)
                except TrajectoryRejected:
                    pass                                   # counted by the executor; the robot keeps going
            res.chunk_times.append((t, ready_t))
            used_t, busy_until = frame.t, ready_t
        switches = executor.switches
        cmd = executor.command(t)
        if executor.switches != switches and switches > 0:
            res.switch_steps.append(step)
        if executor.idle_for(t) > config.stale_limit_s:
            res.stale_steps += 1
        res.states.append(state)
        res.actions.append(cmd)
        if on_step is not None:
            on_step(t, state, cmd, monitor)
        sim.step(cmd)
        if sim.unstable:                      # the commands made the physics diverge: a failed episode, said so
            res.error_kind = "physics unstable"
            break
        monitor.update()
        if monitor.success and config.stop_on_success and sim.time >= monitor.success_time + config.tail_s - 1e-9:
            break
    res.success, res.success_time = monitor.success, monitor.success_time
    res.max_reward = monitor.max_reward
    res.gym_success = monitor.gym_success
    res.duration_s = sim.time
    res.rejected = dict(executor.rejected)
    return res
