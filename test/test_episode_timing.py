"""The order of events of ``sim/episode.py``'s lockstep loop, counted on the real simulation with a stub policy (the
``Policy`` protocol is the seam): with a delay longer than the camera period the policy is asked only once its
previous chunk is ready (never while it is still "computing"), always with the newest frame, whose capture time (not
the step it is asked at) is the observation's stamp; each chunk takes effect exactly at the step it was stamped for;
``switch_steps`` names the steps where a trajectory took over from another; ground truth is kept per rendered frame."""
from __future__ import annotations

import numpy as np
import pytest

import oxygen_ros.sim  # noqa: F401 - MUJOCO_GL before mujoco

pytest.importorskip("mujoco", reason="the simulation needs mujoco (requirements.txt)")
pytest.importorskip("gym_aloha", reason="the simulation needs gym-aloha (requirements.txt)")

from oxygen_ros.sim.episode import EpisodeConfig, frame_key, run_episode  # noqa: E402
from oxygen_ros.sim.execution import Trajectory  # noqa: E402
from oxygen_ros.sim.scene import CONTROL_DT, JOINTS, START_POSE, AlohaScene  # noqa: E402
from oxygen_ros.sim.tasks import draw_task  # noqa: E402


class CountingPolicy:
    """Records every call; answers with a one-point trajectory stamped ``ready_t`` whose left waist is
    START_POSE's + 0.01 x (call number + 1), so each executed command names the call it came from."""

    def __init__(self):
        self.calls = []                         # (step asked, obs.t, obs.state_t, ready_t)

    def reset(self, spec, sim):
        self.calls = []

    def act(self, obs, ready_t):
        k = len(self.calls)
        self.calls.append((obs.state_t, obs.t, ready_t))
        row = START_POSE.copy()
        row[0] += 0.01 * (k + 1)
        return [Trajectory(ready_t, JOINTS, np.zeros(1), row[None])]


@pytest.fixture(scope="module")
def sim():
    s = AlohaScene((8, 8))
    yield s
    s.close()


def _step(t):
    return int(round(t / CONTROL_DT))


def _source(actions):
    """Per step: 0 = the hold (no chunk yet), k = the k-th call's chunk."""
    a = np.asarray(actions)
    return [int(round((row[0] - START_POSE[0]) / 0.01)) for row in a]


@pytest.mark.parametrize("delay,every,asked,frames", [
    # delay 7 > camera period 5: asked at 0; frame 5 arrives while busy until 7 -> asked at 7 with frame 5; frame 10
    # while busy until 14 -> asked at 14 with frame 10; ...
    (7, 5, [0, 7, 14, 21, 28, 35], [0, 5, 10, 20, 25, 35]),
    # delay 3 < camera period 5: asked at every frame
    (3, 5, [0, 5, 10, 15, 20, 25, 30, 35], [0, 5, 10, 15, 20, 25, 30, 35]),
    # delay 0: asked at the frame, effective at once
    (0, 4, [0, 4, 8, 12, 16, 20, 24, 28, 32, 36], [0, 4, 8, 12, 16, 20, 24, 28, 32, 36]),
    # delay 10 = two camera periods
    (10, 5, [0, 10, 20, 30], [0, 10, 20, 30]),
])
def test_the_policy_is_asked_when_free_with_the_newest_frame_and_its_chunk_starts_at_t_plus_d(sim, delay, every,
                                                                                               asked, frames):
    pol = CountingPolicy()
    res = run_episode(sim, draw_task("reach", 0), pol,
                      EpisodeConfig(delay_steps=delay, camera_every=every, time_limit_s=0.8))
    n = _step(0.8)
    assert len(res.actions) == n and len(res.states) == n
    assert [_step(c[0]) for c in pol.calls] == asked                     # when asked (the cycle's start)
    assert [_step(c[1]) for c in pol.calls] == frames                    # which frame it read (capture time)
    assert [_step(c[2]) for c in pol.calls] == [s + delay for s in asked]
    assert res.chunk_times == [(c[0], c[2]) for c in pol.calls]
    assert all(c[0] == pytest.approx(s * CONTROL_DT) for c, s in zip(pol.calls, asked))
    # the executed command per step: the newest chunk whose ready step has come, from that step exactly
    src = _source(res.actions)
    expect = []
    for s in range(n):
        ready = [k + 1 for k, a in enumerate(asked) if a + delay <= s]
        expect.append(ready[-1] if ready else 0)
    assert src == expect
    # a switch is a takeover from another trajectory: every ready step but the first (that one takes over the hold)
    assert res.switch_steps == [a + delay for a in asked[1:] if a + delay < n]
    # ground truth recorded at every rendered frame, keyed by its capture time
    assert sorted(res.frames_gt) == [frame_key(s * CONTROL_DT) for s in range(0, n, every)]
    assert res.to_dict()["policy_calls"] == len(asked)


def test_the_observation_carries_the_newest_state_at_the_cycle_start(sim):
    """The frame is the one captured at step 5, the state the one measured at step 7 (when the cycle starts)."""
    seen = []

    class Pol(CountingPolicy):
        def act(self, obs, ready_t):
            seen.append((obs.t, obs.state_t, obs.state.copy(), obs.instruction))
            return super().act(obs, ready_t)

    spec = draw_task("reach", 0)
    res = run_episode(sim, spec, Pol(), EpisodeConfig(delay_steps=7, camera_every=5, time_limit_s=0.4))
    t, st, state, instr = seen[1]
    assert (_step(t), _step(st)) == (5, 7)
    assert np.array_equal(state, res.states[7]) and not np.array_equal(state, res.states[5])
    assert instr == spec.instruction
