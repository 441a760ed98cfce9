"""``ros/lockstep.py`` ``PipelinePolicy``: the node's own pipeline (tiny random-weight model) on the simulated clock,
driven with hand-made observations whose capture time, state time and ready time all differ: every trajectory is
stamped the modelled ready time ``ready_t`` (the chunk arrives after the delay, not at the cycle's start or a step
later), and every answer and memory entry names the capture time of the frame the model read (not the cycle's start
or a later frame), per episode from a fresh pipeline."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import require_ros

require_ros()

from oxygen_ros.sim.episode import SimObservation  # noqa: E402
from oxygen_ros.sim.scene import CONTROL_DT, JOINTS, START_POSE  # noqa: E402
from oxygen_ros.sim.tasks import MEMORY_PROMPT, QUESTIONS, draw_task  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def policy():
    from oxygen_ros.ros.lockstep import LanguageLoad, PipelinePolicy, sim_settings
    pol = PipelinePolicy(sim_settings(None, {"preset": "tiny", "max_new_tokens": 6, "decode_k": 3}),
                         language=LanguageLoad(question_every_s=0.3, memory_every_s=0.5, questions=QUESTIONS[:2]))
    yield pol
    pol.close()


def _obs(t, state_t, k):
    g = np.random.default_rng(k)
    images = [g.integers(0, 255, (16, 16, 3), dtype=np.uint8) for _ in range(3)]
    return SimObservation(t, images, START_POSE + 0.01 * k, "touch the red cube with the left gripper", state_t)


# (frame capture t, cycle start = state time, ready time): the policy busy past the next frame, like d > period
CYCLES = [(0.0, 0.0, 0.14), (0.1, 0.14, 0.28), (0.2, 0.28, 0.42), (0.4, 0.42, 0.56), (0.5, 0.56, 0.7),
          (0.6, 0.7, 0.84), (0.8, 0.84, 0.98), (0.9, 0.98, 1.12), (1.1, 1.12, 1.26), (1.2, 1.26, 1.40)]


def test_trajectories_are_stamped_at_the_ready_time_and_language_names_the_frame_read(policy):
    policy.reset(draw_task("reach", 0), None)
    starts = []
    for k, (t, st, ready) in enumerate(CYCLES):
        trs = policy.act(_obs(t, st, k), ready)
        assert len(trs) == 1, k
        tr = trs[0]
        assert tuple(tr.joint_names) == JOINTS and np.all(np.isfinite(tr.positions))
        assert tr.times[0] == 0.0 and tr.times[1] == pytest.approx(CONTROL_DT)
        starts.append(tr.start)
    assert starts == pytest.approx([c[2] for c in CYCLES], abs=1e-9)
    log = policy.language_log
    kinds = [e["kind"] for e in log]
    assert "conversation" in kinds and "memory" in kinds, log
    captures = {round(c[0], 6) for c in CYCLES}
    for e in log:
        assert round(e["frame_t"], 6) in captures, e                # a frame's capture time, never a cycle start
    conv = [e for e in log if e["kind"] == "conversation"]
    # a question every 0.3 s of sim time goes in at the first cycle starting at or after it, and reads that frame
    asked = [next(c[0] for c in CYCLES if c[1] >= q - 1e-9) for q in (0.0, 0.3, 0.6, 0.9, 1.2)]
    assert asked == [0.0, 0.4, 0.6, 0.9, 1.2]
    assert [e["frame_t"] for e in conv] == pytest.approx(asked[:len(conv)])
    assert [e["prompt"] for e in conv] == [QUESTIONS[i % 2] for i in range(len(conv))]
    mem = [e for e in log if e["kind"] == "memory"]
    assert all(e["prompt"] == MEMORY_PROMPT for e in mem)
    # a memory request every 0.5 s on the pipeline's clock (the cycles' starts): cycles at 0, 0.56 and 1.12 s
    assert [e["frame_t"] for e in mem] == pytest.approx([0.0, 0.5, 1.1])


def test_each_episode_starts_a_fresh_clock(policy):
    """A second episode's first trajectory is stamped its own ready time (a clock left at the last episode's
    1.4 s would stamp it there)."""
    for spec in (draw_task("reach", 1), draw_task("pick", 2)):
        policy.reset(spec, None)
        (tr,) = policy.act(_obs(0.0, 0.0, 0), 0.06)
        assert tr.start == pytest.approx(0.06, abs=1e-9)
        assert policy.language_log == []
