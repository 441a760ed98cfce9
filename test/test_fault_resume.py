"""Resuming after a fault without a jump (issue 28), in closed loop: the scripted expert as the engine through the
node's own input path, pipeline, chunk buffer and JointTrajectory output (``ros/lockstep.py``, sim time, in-process,
deterministic), ``action_max_step_change`` set, one fault for 1 s of sim time in the middle of a ``reach`` or ``pick``
episode: the base camera silent, ``joint_states`` silent, the engine returning non-finite chunks, the node
deactivated and activated again.  The robot holds during the fault; when actions resume they must ramp from where it
holds: no non-finite command reaches the robot, no executed step (consecutive commands of ``EpisodeResult.actions``,
the joint_trajectory_controller's output at 50 Hz) exceeds the limit, the robot rejects nothing, and at 0.05 rad per
step the task still succeeds (at 0.01 the arm is too slow for the task's time limit; only the limit is checked).
Before the fix the first trajectory after each fault jumped 0.33-0.47 rad at 0.05 and up to 1.3 rad at 0.01."""
from __future__ import annotations

import numpy as np
import pytest

import oxygen_ros.sim  # noqa: F401 - sets MUJOCO_GL=egl before mujoco is imported

pytest.importorskip("mujoco", reason="the simulation needs mujoco (requirements.txt)")
pytest.importorskip("gym_aloha", reason="the simulation needs gym-aloha (requirements.txt)")

from oxygen_ros.ros.lockstep import Fault, PipelinePolicy, sim_settings  # noqa: E402
from oxygen_ros.sim.episode import EpisodeConfig, run_episode  # noqa: E402
from oxygen_ros.sim.scene import CONTROL_DT, AlohaScene  # noqa: E402
from oxygen_ros.sim.tasks import draw_task  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

KINDS = ["camera", "joint_states", "engine_nonfinite", "inactive"]
WINDOW = {"reach": (0.4, 1.4), "pick": (0.4, 1.4)}     # during the approach, well before the task ends (the
                                                       # state-driven expert reaches the cube in ~1-2 s)
EPS = 1e-6                                             # float32 rows


@pytest.fixture(scope="module")
def sim():
    s = AlohaScene((24, 24))
    yield s
    s.close()


def _run(sim, task: str, seed: int, kind: str, limit: float, time_limit_s: float | None = None):
    start, end = WINDOW[task]
    pol = PipelinePolicy(sim_settings(None, {"delta_action_mask": [], "action_max_step_change": [limit]}),
                         expert=True, horizon=20, faults=(Fault(kind, start, end),))
    try:
        r = run_episode(sim, draw_task(task, seed), pol, EpisodeConfig(delay_steps=2, camera_every=5,
                                                                      time_limit_s=time_limit_s))
        counters = pol.pipeline.counters.snapshot()
    finally:
        pol.close()
    return r, counters


def _check(r, counters, kind: str, limit: float, task: str) -> float:
    a = np.array(r.actions)
    assert np.all(np.isfinite(a)), "a non-finite command reached the robot"
    assert r.rejected == {}, r.rejected
    steps = np.abs(np.diff(a, axis=0)).max(axis=1)                # [T-1] largest joint change per control step
    worst = int(steps.argmax())
    assert steps[worst] <= limit + EPS, \
        f"{kind}: an executed step of {steps[worst]:.4f} > {limit} at t = {(worst + 1) * CONTROL_DT:.2f} s"
    # the fault happened and the robot held through it, then the limiter ramped away from the held position
    end = int(round(WINDOW[task][1] / CONTROL_DT))
    # (a stale input stops new chunks after its age limit, 0.5 s; the last chunk then runs out)
    assert np.all(steps[end - 5:end] == 0), f"{kind}: the robot did not hold during the fault"
    ramp = steps[end:end + 25]
    assert np.count_nonzero(np.abs(ramp - limit) <= EPS) >= 2, f"{kind}: no ramp at the limit after the fault"
    if kind == "engine_nonfinite":
        assert counters.get("chunk_invalid", 0) >= 5, counters
    if kind in ("camera", "joint_states"):
        assert counters.get("cycle_skipped_stale" if kind == "camera" else "cycle_skipped_state_stale", 0) >= 3
    return float(steps.max())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("task,seed", [("reach", 0), ("reach", 3), ("pick", 1), ("pick", 4)])
def test_actions_resume_within_the_step_limit_and_the_task_succeeds(sim, task, seed, kind):
    r, counters = _run(sim, task, seed, kind, 0.05)
    _check(r, counters, kind, 0.05, task)
    assert r.success, f"{task} seed {seed} after {kind}: failed ({r.to_dict()})"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("task", ["reach", "pick"])
def test_a_tight_limit_still_holds_after_each_fault(sim, task, kind):
    r, counters = _run(sim, task, 2, kind, 0.01, time_limit_s=WINDOW[task][1] + 1.0)    # the fault and the ramp
    _check(r, counters, kind, 0.01, task)
