"""The ``joint_trajectory`` output of ``oxygen_node`` over real DDS (a separate node process fed by ``oxygen replay``,
as in ``test_node.py``), with ``outputs: [action_chunk, joint_trajectory]`` and action limits: every
``trajectory_msgs/JointTrajectory`` has ``joint_names`` = ``action_joint_names``, one point per row from the current
row on with ``time_from_start = i * step_dt``, positions equal to the rows the control loop then publishes on
``action_chunk`` (same node clock: the action_chunk published at ``start_time`` carries the trajectory's points from
``floor((start_time - header.stamp) / step_dt)`` on), velocities = finite differences of the positions (central
inside, one-sided at the ends), ``header.stamp`` = when the first point is due (at most one step before the first
action_chunk tick of that chunk), and positions inside the limits.  A second node with the default outputs has no
``joint_trajectory`` publisher."""
from __future__ import annotations

import time

import numpy as np
import pytest

from conftest import TIMING_GROUP, NodeProcess, require_ros

require_ros()

from trajectory_msgs.msg import JointTrajectory  # noqa: E402

from oxygen_ros.msg import ActionChunk  # noqa: E402
from oxygen_ros.tools.bags.replay import JOINT_NAMES  # noqa: E402

from test_node import BASE_PARAMS, STARTUP_S, Env, stamp_ns  # noqa: E402

pytestmark = pytest.mark.xdist_group(TIMING_GROUP)     # node / player / launch processes: one worker

RATE = 70.0
STEP_NS = int(round(1e9 / RATE))
LIMIT = 0.6


def _dur_ns(d) -> int:
    return d.sec * 1_000_000_000 + d.nanosec


@pytest.fixture(scope="module")
def traj_env(ros, tmp_path_factory, synthetic_bag):
    e = Env(ros, tmp_path_factory.mktemp("traj"), synthetic_bag,
            params={"outputs": ["action_chunk", "joint_trajectory"], "memory_interval_s": 0.0,
                    "subtask_enabled": False, "action_limits_min": [-LIMIT] * len(JOINT_NAMES),
                    "action_limits_max": [LIMIT] * len(JOINT_NAMES)})
    e.traj = e.collect(JointTrajectory, "joint_trajectory", qos=100, keep=500)
    e.start_node("traj_node")
    e.start_replay()
    e.wait_chunks()
    yield e
    e.close()


def _chunk_rows_checked(trajs, chunks, check: bool) -> int:
    """For each trajectory (not the first or last received), the action_chunk messages of its chunk: each must
    publish exactly the trajectory's points from the row whose slot contains its tick (asserted when ``check``);
    returns how many messages were compared."""
    matched = 0
    for t in trajs[1:-1]:
        n = len(t.points)
        pos = np.array([p.positions for p in t.points])
        t0 = stamp_ns(t.header.stamp)
        # the action_chunk messages of this chunk: the first tick at/after the slot after the first point's, and
        # every later one with the same chunk_id
        later = sorted((m for m in chunks if stamp_ns(m.start_time) >= t0 + STEP_NS),
                       key=lambda m: stamp_ns(m.start_time))
        if not later:
            continue
        cid = later[0].chunk_id
        # header.stamp = when the first point is due: every action_chunk tick of this chunk (at any delay of the
        # control thread - no timing bound, it was flaky under load) publishes exactly the trajectory's points from
        # the row whose slot contains the tick, counted from the stamp
        for m in (m for m in later if m.chunk_id == cid):
            if check:
                off = int(np.floor((stamp_ns(m.start_time) - t0) / STEP_NS + 1e-6))
                rows = np.asarray(m.actions, np.float32).reshape(m.horizon, m.action_dim)
                assert off + m.horizon == n, (off, m.horizon, n)
                np.testing.assert_array_equal(rows, pos[off:].astype(np.float32))
            matched += 1
    return matched


def test_joint_trajectory_contents(traj_env):
    e = traj_env
    # counted events, not a window of time: 8 trajectories and 10 action_chunk messages of their chunks
    assert e.ros.wait_for(lambda: len(e.traj) >= 8 and _chunk_rows_checked(
        [m for _, m in list(e.traj)], [m for _, m in list(e.chunks)], check=False) >= 10, 90), \
        f"{len(e.traj)} trajectories (one per new chunk):\n" + e.node.log()[-2000:]
    trajs = [m for _, m in list(e.traj)]
    chunks = [m for _, m in list(e.chunks)]
    for t in trajs[1:-1]:
        assert list(t.joint_names) == list(JOINT_NAMES)
        n = len(t.points)
        assert 1 <= n <= BASE_PARAMS["horizon"]
        pos = np.array([p.positions for p in t.points])
        vel = np.array([p.velocities for p in t.points])
        assert pos.shape == (n, len(JOINT_NAMES)) and vel.shape == pos.shape
        assert [_dur_ns(p.time_from_start) for p in t.points] == [i * STEP_NS for i in range(n)]
        assert np.all(np.abs(pos) <= LIMIT + 1e-6)
        want = np.zeros_like(pos)
        if n >= 2:
            dt = STEP_NS / 1e9
            want[1:-1] = (pos[2:] - pos[:-2]) / (2 * dt)
            want[0], want[-1] = (pos[1] - pos[0]) / dt, (pos[-1] - pos[-2]) / dt
        np.testing.assert_allclose(vel, want, rtol=1e-6, atol=1e-6)
    assert _chunk_rows_checked(trajs, chunks, check=True) >= 10


def test_no_trajectory_publisher_by_default(ros, tmp_path):
    node = NodeProcess(tmp_path / "default.log", {**BASE_PARAMS, "memory_db": "", "memory_interval_s": 0.0},
                       namespace="/plain")
    try:
        def topics():
            if ("oxygen_node", "/plain") not in ros.node.get_node_names_and_namespaces():
                return set()
            return {name for name, _ in ros.node.get_publisher_names_and_types_by_node("oxygen_node", "/plain")}
        # configured and active (outputs' publishers are made at configure) and its publishers discovered
        ok = ros.wait_for(lambda: not node.alive() or ("active:" in node.log() and "/plain/action_chunk" in topics()),
                          STARTUP_S)
        assert ok and node.alive(), node.log()[-2000:]
        time.sleep(1.0)                     # any other publisher of the node is discovered by now
        topics = topics()
        assert "/plain/action_chunk" in topics and "/plain/joint_trajectory" not in topics, topics
    finally:
        node.stop()
