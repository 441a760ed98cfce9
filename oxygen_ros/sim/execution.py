"""The robot side of the action path: how the simulated robot executes the trajectories a policy sends, the way
ros2_control's joint_trajectory_controller does.

This file owns the execution rule, once, for every runner (the lockstep evaluator and the ROS ``sim_node``):
``TrajectoryExecutor.submit(Trajectory)`` validates a trajectory (joint names known and each once, as many
positions as names in every point, finite values, strictly increasing times) and queues it; a bad one raises
``TrajectoryRejected`` with the reason, is counted in ``rejected`` (by reason) and never executed - the robot keeps
doing what it did.  ``command(t)`` is the joint target at time ``t``: the newest trajectory whose start
(``header.stamp``) is at or before ``t`` (a newer one waiting for its start leaves the current one running; once it
starts, older ones are dropped); between points linear interpolation (position by position); before its first point
(a first ``time_from_start`` > 0) from the command at the switch to that point, as the controller does; after its last
point that point is held; before any trajectory has started, the hold position (the robot's state at ``reset``).
``idle_for(t)`` is how long the robot has been holding a finished trajectory (or waiting for a first one): the
runners call the policy stale past a limit.  Pure numpy.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass

import numpy as np

__all__ = ["Trajectory", "TrajectoryRejected", "TrajectoryExecutor"]


class TrajectoryRejected(ValueError):
    """A trajectory that must not be executed; ``reason`` is a short key (counted), the message says why."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Trajectory:
    start: float                  # seconds (sim time): header.stamp
    joint_names: tuple            # the columns of ``positions``
    times: np.ndarray             # [n] seconds from start (time_from_start)
    positions: np.ndarray         # [n, len(joint_names)]


@dataclass
class _Active:
    start: float
    times: np.ndarray             # [n]
    positions: np.ndarray         # [n, J] in the executor's joint order
    from_pos: np.ndarray | None = None   # the command when it took over (for a first point after its start)


class TrajectoryExecutor:
    def __init__(self, joint_names, hold):
        self.joint_names = tuple(joint_names)
        self._index = {n: i for i, n in enumerate(self.joint_names)}
        self.rejected: collections.Counter = collections.Counter()
        self.accepted = 0
        self.reset(hold)

    def reset(self, hold) -> None:
        """Forget every trajectory; hold ``hold`` (the robot's state now) until one starts."""
        h = np.asarray(hold, dtype=np.float64)
        if h.shape != (len(self.joint_names),):
            raise ValueError(f"hold must have {len(self.joint_names)} values, got shape {h.shape}")
        self.hold = h.copy()
        self._active: _Active | None = None
        self._queue: list[_Active] = []          # submitted, not started yet (submission order)
        self._last_cmd = self.hold.copy()
        self._since = None                       # when the robot started holding (set at the first idle_for)
        self.switches = 0                        # trajectories that have taken over so far

    # ---- input ---------------------------------------------------------------------------------------------------
    def validate(self, tr: Trajectory) -> _Active:
        names = list(tr.joint_names)
        unknown = [n for n in names if n not in self._index]
        if unknown:
            raise TrajectoryRejected("unknown_joint", f"unknown joint name(s) {unknown[:4]}; this robot has "
                                                      f"{list(self.joint_names)}")
        if len(set(names)) != len(names):
            raise TrajectoryRejected("duplicate_joint", f"joint names repeat: {names}")
        if set(names) != set(self.joint_names):
            missing = [n for n in self.joint_names if n not in names]
            raise TrajectoryRejected("missing_joint", f"trajectory lacks joint(s) {missing[:4]}")
        times = np.asarray(tr.times, dtype=np.float64).reshape(-1)
        if times.size == 0:
            raise TrajectoryRejected("empty", "trajectory has no points")
        try:
            pos = np.asarray(tr.positions, dtype=np.float64)
        except (TypeError, ValueError) as exc:          # ragged rows
            raise TrajectoryRejected("wrong_length", f"points have different numbers of positions ({exc})") from exc
        if pos.ndim != 2 or pos.shape != (times.size, len(names)):
            raise TrajectoryRejected("wrong_length", f"expected {times.size} points x {len(names)} positions, got "
                                                     f"shape {list(pos.shape)}")
        if not (np.all(np.isfinite(pos)) and np.all(np.isfinite(times)) and np.isfinite(tr.start)):
            raise TrajectoryRejected("not_finite", "trajectory contains NaN or inf")
        if times[0] < 0 or np.any(np.diff(times) <= 0):
            raise TrajectoryRejected("bad_times", "time_from_start must be >= 0 and strictly increasing")
        order = [names.index(n) for n in self.joint_names]
        return _Active(float(tr.start), times, pos[:, order])

    def submit(self, tr: Trajectory) -> None:
        try:
            act = self.validate(tr)
        except TrajectoryRejected as exc:
            self.rejected[exc.reason] += 1
            raise
        self.accepted += 1
        self._queue.append(act)

    # ---- output --------------------------------------------------------------------------------------------------
    def _switch(self, t: float) -> None:
        started = [k for k, a in enumerate(self._queue) if a.start <= t + 1e-9]
        if not started:
            return
        k = started[-1]                          # the newest submission that has started; older ones are dropped
        newest, self._queue = self._queue[k], self._queue[k + 1:]
        newest.from_pos = self._last_cmd.copy()
        self._active = newest
        self.switches += 1

    def command(self, t: float) -> np.ndarray:
        """The joint target at time ``t`` (call with non-decreasing t)."""
        self._switch(t)
        a = self._active
        if a is None:
            cmd = self.hold
        else:
            tau = t - a.start
            if tau >= a.times[-1]:
                cmd = a.positions[-1]
            elif tau < a.times[0]:
                u = tau / a.times[0] if a.times[0] > 0 else 1.0
                cmd = a.from_pos + max(0.0, u) * (a.positions[0] - a.from_pos)
            else:
                j = int(np.searchsorted(a.times, tau, side="right")) - 1
                u = (tau - a.times[j]) / (a.times[j + 1] - a.times[j])
                cmd = a.positions[j] + u * (a.positions[j + 1] - a.positions[j])
        self._last_cmd = np.array(cmd, dtype=np.float64)
        return self._last_cmd.copy()

    def idle_for(self, t: float) -> float:
        """Seconds the robot has been holding at ``t``: past the active trajectory's last point, or since the first
        ``idle_for`` call without any trajectory (0 while a trajectory runs)."""
        a = self._active
        if a is not None:
            self._since = None
            return max(0.0, t - (a.start + float(a.times[-1])))
        if self._since is None:
            self._since = t
        return t - self._since

    @property
    def pending(self) -> int:
        return len(self._queue)
