"""A policy node killed and restarted while the simulated robot holds (issue 28), as processes over DDS: ``sim_node``
(lockstep clock: sim time waits at each camera frame for the policy, or moves on after ``lockstep_timeout_s``) and
``oxygen_node`` (the shipped demo policy, ``config/sim_aloha.yaml``, ``action_max_step_change: [0.05]``).

The node is SIGKILLed mid-episode; the robot runs the last trajectory out and holds its end; a new node process
starts, knowing nothing of what was sent before but the robot's ``joint_states``.  Its first trajectory must start
within the limit of the joint state it saw and ramp from there: the first point within 0.05 rad of that joint state,
the first executed step within 0.05 rad plus the robot's own tracking offset (held command - measured position, which
no node can see), every later step of that trajectory within 0.05 rad, nothing non-finite executed, nothing rejected.
No rate or latency is asserted; every wait is for an event, with a generous timeout; both processes are stopped and
nothing the test started survives it."""
from __future__ import annotations

import math
import signal

import numpy as np
import pytest

import oxygen_ros.sim  # noqa: F401 - MUJOCO_GL before mujoco

pytest.importorskip("mujoco", reason="the simulation needs mujoco (requirements.txt)")

from conftest import REPO, require_ros  # noqa: E402
from oxygen_ros.tools.harness import NodeProcess  # noqa: E402

require_ros()
from diagnostic_msgs.msg import DiagnosticArray  # noqa: E402
from sensor_msgs.msg import JointState  # noqa: E402
from trajectory_msgs.msg import JointTrajectory  # noqa: E402

from oxygen_ros.sim.scene import CONTROL_DT, JOINTS  # noqa: E402

LIMIT = 0.05
EPS = 1e-6
UP_TIMEOUT_S = 120.0      # a node's start (model build) on a loaded 2-core machine
# transfer: the longest episode (8 s), so the restart happens in the episode the robot holds in (sim time moves on
# 0.1 s per lockstep_timeout_s while no policy answers)
SIM = {"task": "transfer", "seed": 0, "clock": "lockstep", "lockstep_timeout_s": 1.0, "text_targets": False}
NODE = {"checkpoint": "demo", "use_sim_time": True, "action_max_step_change": [LIMIT],
        "outputs": ["joint_trajectory"], "memory_interval_s": 0.0, "memory_db": ""}


def _ns(stamp) -> int:
    return int(stamp.sec) * 1_000_000_000 + int(stamp.nanosec)


def _policy(tmp_path) -> NodeProcess:
    return NodeProcess(tmp_path / "oxygen_node.log", NODE, REPO / "config" / "sim_aloha.yaml", append=True,
                       cwd=str(REPO))


def test_a_restarted_node_ramps_from_where_the_robot_holds(ros, process_watch, tmp_path):
    trajs = ros.collect(JointTrajectory, "/joint_trajectory", qos=50, keep=2000)
    cmds = ros.collect(JointState, "/executed_action", qos=200, keep=20000)
    states = ros.collect(JointState, "/joint_states", qos=200, keep=20000)
    diags = ros.collect(DiagnosticArray, "/diagnostics", qos=20, keep=50)
    sim = node = None
    try:
        sim = NodeProcess(tmp_path / "sim_node.log", SIM, module="oxygen_ros.ros.sim_node")
        node = _policy(tmp_path)
        assert ros.wait_for(lambda: len(trajs) >= 8, UP_TIMEOUT_S), node.tail() + sim.tail()
        node.stop(signal.SIGKILL)                              # killed: no shutdown of any kind

        def held(steps: int) -> bool:                          # the newest trajectory ran out some steps ago
            last = trajs[-1][1]
            end_ns = _ns(last.header.stamp) + _ns(last.points[-1].time_from_start)
            return _ns(cmds[-1][1].header.stamp) >= end_ns + steps * CONTROL_DT * 1e9
        assert ros.wait_for(lambda: held(5), 60.0), sim.tail()
        n_old = len(trajs)                                     # (any message of the killed node has arrived by now)
        node = _policy(tmp_path)                               # a new process: nothing of the old one survives
        assert ros.wait_for(lambda: len(trajs) >= n_old + 3, UP_TIMEOUT_S), node.tail() + sim.tail()
        first = trajs[n_old][1]
        t1 = _ns(first.header.stamp)
        assert ros.wait_for(lambda: _ns(cmds[-1][1].header.stamp) >= t1 + 10 * CONTROL_DT * 1e9, 60.0)
        executed = {_ns(m.header.stamp): np.asarray(m.position, dtype=np.float64) for _, m in list(cmds)}
        measured = {_ns(m.header.stamp): np.asarray(m.position, dtype=np.float64) for _, m in list(states)}
        later = [_ns(m.header.stamp) for _, m in list(trajs)[n_old + 1:]]
        rejected = next((int(kv.value) for _, d in reversed(list(diags)) for st in d.status
                         if st.name.startswith("oxygen_sim") for kv in st.values
                         if kv.key == "trajectories_rejected"), None)
    finally:
        for c in (trajs, cmds, states, diags):
            ros.uncollect(c)
        for p in (node, sim):
            if p is not None:
                p.stop()
    assert not process_watch.wait_gone(10.0), "a process outlived the test"
    assert all(np.all(np.isfinite(p)) for p in executed.values()), "a non-finite command was executed"
    assert rejected == 0, f"the robot rejected {rejected} trajector(ies)"
    assert list(first.joint_names) == list(JOINTS)
    step_ns = int(round(CONTROL_DT * 1e9))
    before = [executed.get(t1 - k * step_ns) for k in range(1, 6)]
    assert all(b is not None for b in before) and t1 in measured and t1 in executed, "steps around the restart missing"
    assert all(np.array_equal(b, before[0]) for b in before), "the robot was not holding before the restart"
    hold_cmd, q = before[0], measured[t1]                     # what the robot held; the joint state the node saw
    p0 = np.asarray(first.points[0].positions)
    assert np.all(np.abs(p0 - q) <= LIMIT + EPS), f"first point vs joint state: {np.round(p0 - q, 4)}"
    jump = np.abs(executed[t1] - hold_cmd)
    offset = np.abs(hold_cmd - q)                              # the robot's tracking offset, invisible to the node
    assert np.all(jump <= LIMIT + offset + EPS), f"first step {np.round(jump, 4)}, offset {np.round(offset, 4)}"
    # the ramp: every step while the first trajectory runs (until the next one takes over)
    t_end = min([t for t in later if t > t1] + [t1 + len(first.points) * step_ns])
    ts = [t for t in sorted(executed) if t1 <= t <= t_end]
    steps = [float(np.max(np.abs(executed[b] - executed[a]))) for a, b in zip(ts, ts[1:]) if b - a == step_ns]
    assert len(steps) >= 3 and max(steps) <= LIMIT + EPS, steps
    assert not math.isclose(float(np.max(np.abs(p0 - hold_cmd))), 0.0), "the new plan did not move: nothing checked"
