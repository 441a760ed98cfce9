"""``action_max_step_change`` as a joint_trajectory_controller sees it (issue: the limit held against the last
``action_chunk`` row, but a controller switches to a new trajectory at its stamp, where the previous trajectory may
already be a step further).  A consumer emulating the controller - the newest JointTrajectory from its
``header.stamp`` on, linear interpolation between points, sampled on a fine grid at arbitrary phase - must see no change
above the limit over any control period, across switches and inside trajectories, under each chunking mode; and each
new trajectory's first point must be within the limit of the previous trajectory at the same time.  Chunks are random
walks with steps far above the limit, pushed at random times against a control timer of random phase, so the limiter
binds at nearly every switch.  Between them come gaps (issue 28): a pause in which the previous chunk is used up and
the robot holds its end (an input gone stale), chunks dropped (invalid engine output: the timer runs, nothing is
pushed), a deactivate / activate (``clear``) and a node restart (a new buffer, knowing only the robot's position: its
joint state, ``push(hold=...)``); the first trajectory after each must ramp from what the robot holds.  The robot
holds its start position before the first trajectory, so the very first one is checked too."""
from __future__ import annotations

import numpy as np
import pytest

from oxygen_ros.ros.action_space import ActionSpace
from oxygen_ros.ros.control import ChunkBuffer

messages = pytest.importorskip("oxygen_ros.ros.messages", reason="ROS message types (trajectory_msgs) not installed")

DT = 0.02                 # 50 Hz control
H = 12
LIMIT = 0.01
DIMS = 3


def _ns(t) -> int:
    return int(t.sec) * 1_000_000_000 + int(t.nanosec)


class Controller:
    """joint_trajectory_controller's rule on the messages the node publishes; ``hold``: the position before any."""

    def __init__(self, hold):
        self.hold = np.asarray(hold, dtype=np.float64)
        self.trajs: list = []                      # (start s, times [n], positions [n, A]) in arrival order

    def receive(self, m) -> None:
        start = _ns(m.header.stamp) / 1e9
        times = np.array([_ns(p.time_from_start) / 1e9 for p in m.points])
        self.trajs.append((start, times, np.array([p.positions for p in m.points])))

    def command(self, t: float, arrived: int) -> np.ndarray | None:
        """The command at t using the first ``arrived`` trajectories (newest started one wins)."""
        cands = [tr for tr in self.trajs[:arrived] if tr[0] <= t + 1e-12]
        if not cands:
            return self.hold.copy()
        start, times, pos = cands[-1]
        tau = t - start
        return np.array([np.interp(tau, times, pos[:, j]) for j in range(pos.shape[1])])


GAPS = ("used_up", "dropped", "clear", "restart")


@pytest.mark.parametrize("chunking", ["none", "blend", "rtc"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_controller_sees_no_step_above_the_limit(chunking, seed):
    rng = np.random.default_rng(seed)
    space = ActionSpace.build(DIMS, max_step_change=[LIMIT])

    def new_buffer() -> ChunkBuffer:
        return ChunkBuffer(DT, chunking=chunking, blend_steps=3 if chunking == "blend" else 0,
                           step_limit=space.limit_steps)
    buf = new_buffer()
    level = rng.normal(0, 0.5, DIMS)
    ctl = Controller(level + 0.3)                    # the robot's start: far from the first plan
    phase = rng.uniform(0, DT)
    tick = phase
    t = 0.0
    arrivals = []                                   # (arrival time, trajectory index)
    gaps = dict.fromkeys(GAPS, 0)
    for k in range(90):
        gap = rng.choice(GAPS) if k > 0 and rng.random() < 0.3 else None
        pause = rng.uniform(H * DT, 3 * H * DT) if gap else 0.0     # long enough for the last chunk to run out
        t_start = t + pause + rng.uniform(0.0, 3 * DT)              # inference starts
        latency = rng.uniform(0.3, 4.0) * DT
        ready = t_start + latency
        while tick < ready:                          # the node's control timer keeps executing
            buf.sample(tick)
            tick += DT
        level = level + rng.normal(0, 0.2, DIMS)     # chunk-to-chunk jumps ~20x the limit
        if gap is not None:
            gaps[str(gap)] += 1
            level = level + rng.normal(0, 0.5, DIMS)   # the plan moved on while the robot held
        if gap == "dropped":                         # the engine's chunk was invalid: nothing pushed
            t = ready
            continue
        if gap == "clear":                           # deactivate / activate (Pipeline.reset_io)
            buf.clear()
        if gap == "restart":                         # a new node: it knows only the joint state
            buf = new_buffer()
        snap = buf.snapshot(t_start) if chunking == "rtc" else None
        rows = level + np.cumsum(rng.normal(0, 0.05, (H, DIMS)), axis=0)
        buf.push(rows.astype(np.float32), chunk_id=k, frame_index=k, capture_time=t_start, ready_time=ready,
                 rtc_origin=None if snap is None else snap.origin, hold=ctl.command(ready, len(ctl.trajs)))
        v = buf.view(ready)
        if v is not None:
            ctl.receive(messages.joint_trajectory(v, step_dt=DT, joint_names=[f"j{i}" for i in range(DIMS)]))
            arrivals.append((ready, len(ctl.trajs)))
        t = ready
    assert len(ctl.trajs) > 50 and all(n >= 3 for n in gaps.values()), gaps
    # the first point of each trajectory vs what the robot executed at the same time (the previous trajectory, or
    # the hold before the first)
    for i in range(len(ctl.trajs)):
        start = ctl.trajs[i][0]
        prev = ctl.command(start, i)
        assert np.max(np.abs(ctl.trajs[i][2][0] - prev)) <= LIMIT + 1e-6, (i, chunking)
    # a fine sampling grid at an arbitrary phase, from before the first trajectory on: the command over every control
    # period
    grid = np.arange(ctl.trajs[0][0] - 2 * DT, arrivals[-1][0] + H * DT, DT / 7) + rng.uniform(0, DT / 7)
    worst = 0.0
    for tt in grid:
        n = sum(1 for a, _ in arrivals if a <= tt)               # trajectories the controller has by then
        a, b = ctl.command(tt - DT, n), ctl.command(tt, n)
        worst = max(worst, float(np.max(np.abs(b - a))))
    assert worst <= LIMIT * (1 + 1e-4) + 1e-6, f"{chunking}: a controller step of {worst:.4f} > {LIMIT}"
