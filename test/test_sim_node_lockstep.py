"""``sim_node`` in ``clock:=lockstep``, in-process: the node's real simulation loop (``SimNode._run``) with its
publishers replaced by recorders and a stand-in policy that answers each published camera frame at once, stamping its
trajectory with the sim clock it last saw (as ``oxygen_node`` with ``use_sim_time`` does).  No DDS traffic: the node
lives in its own rclpy context and nothing subscribes.  Checked: a trajectory stamped at step t takes effect at step
t + d exactly (not a step later), the policy gets frames only when its previous trajectory's delay has passed - then
the newest frame, with its capture stamp - and the same cycle table as the in-process evaluator
(``test_episode_timing.py``)."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import require_ros

require_ros()
pytest.importorskip("mujoco", reason="the simulation needs mujoco (requirements.txt)")
pytest.importorskip("gym_aloha", reason="the simulation needs gym-aloha (requirements.txt)")

import oxygen_ros.sim  # noqa: F401,E402 - MUJOCO_GL before mujoco

from oxygen_ros.sim.scene import CONTROL_DT, JOINTS, START_POSE  # noqa: E402

EPOCH_NS = 1_000_000_000_000
DT_NS = int(round(CONTROL_DT * 1e9))


class Recorder:
    def __init__(self, on_publish=None):
        self.msgs, self.on_publish = [], on_publish

    def publish(self, msg):
        self.msgs.append(msg)
        if self.on_publish is not None:
            self.on_publish(msg)


def _ns(stamp) -> int:
    return int(stamp.sec) * 1_000_000_000 + int(stamp.nanosec)


def _step(ns) -> int:
    return int(round((ns - EPOCH_NS) / DT_NS))


def run_lockstep(delay: int, camera_rate_hz: float, steps: int):
    """Run the node's loop for ``steps`` control steps; returns (calls: [(clock step, frame step)], executed
    command per step)."""
    import rclpy
    from rclpy.parameter import Parameter
    from trajectory_msgs.msg import JointTrajectory, JointTrajectoryPoint

    from oxygen_ros.ros.messages import time_msg
    from oxygen_ros.ros.sim_node import SimNode

    ctx = rclpy.Context()
    ctx.init()
    node = SimNode(context=ctx, parameter_overrides=[
        Parameter("clock", value="lockstep"), Parameter("delay_steps", value=delay),
        Parameter("camera_rate_hz", value=camera_rate_hz), Parameter("camera_size", value=8),
        Parameter("text_targets", value=False), Parameter("episodes", value=1), Parameter("lockstep_timeout_s",
                                                                                          value=5.0)])
    clock = Recorder()
    calls, executed = [], []

    def policy(img):                        # answers the base camera's frame at once
        k = len(calls)
        now_ns = _ns(clock.msgs[-1].clock)
        calls.append((_step(now_ns), _step(_ns(img.header.stamp))))
        row = START_POSE.copy()
        row[0] += 0.01 * (k + 1)
        msg = JointTrajectory()
        msg.header.stamp = time_msg(now_ns)
        msg.joint_names = list(JOINTS)
        msg.points = [JointTrajectoryPoint(positions=[float(v) for v in row])]
        node._on_trajectory(msg)

    def on_exec(msg):
        executed.append((_step(_ns(msg.header.stamp)), np.array(msg.position)))
        if len(executed) >= steps:
            node.stop.set()

    try:
        node.pub_cams = [Recorder(policy), Recorder(), Recorder()]
        node.pub_exec = Recorder(on_exec)
        node.pub_clock = clock
        for name in ("pub_joints", "pub_instr", "pub_status", "pub_text", "pub_diag"):
            setattr(node, name, Recorder())
        node._run()                                             # the simulation thread's loop, here, to its end
    finally:
        node.destroy_node()
        ctx.try_shutdown()
    assert [s for s, _ in executed] == list(range(len(executed)))
    return calls, [int(round((c[0] - START_POSE[0]) / 0.01)) for _, c in executed]


@pytest.mark.parametrize("delay,rate,asked,frames", [
    (7, 10.0, [0, 7, 14, 21, 28, 35], [0, 5, 10, 20, 25, 35]),      # delay > camera period (5 steps)
    (3, 10.0, [0, 5, 10, 15, 20, 25, 30, 35], [0, 5, 10, 15, 20, 25, 30, 35]),
    (0, 12.5, [0, 4, 8, 12, 16, 20, 24, 28, 32, 36], [0, 4, 8, 12, 16, 20, 24, 28, 32, 36]),
])
def test_lockstep_trajectories_take_effect_d_steps_after_their_stamp(delay, rate, asked, frames):
    n = 40
    calls, source = run_lockstep(delay, rate, n)
    assert [c[0] for c in calls] == asked                   # the clock when each frame reached the policy
    assert [c[1] for c in calls] == frames                  # that frame's capture stamp
    expect = []
    for s in range(n):
        ready = [k + 1 for k, a in enumerate(asked) if a + delay <= s]
        expect.append(ready[-1] if ready else 0)
    assert source == expect                                 # call k's trajectory from step asked[k] + d exactly
