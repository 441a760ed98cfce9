"""The simulation core (``oxygen_ros/sim``) and its lockstep runner: scenes from seeds, each task's success detector on
constructed positive and negative states, the ground-truth texts, the execution rule (``sim/execution.py``), the
scripted expert succeeding through the node's own action path (``ros/lockstep.py``: pipeline, chunk buffer,
trajectory, executor), lockstep determinism, and ``oxygen sim-record``'s bag read back by the training loader.
MuJoCo renders headless (EGL); cameras are kept small here for speed."""
from __future__ import annotations

import numpy as np
import pytest

import oxygen_ros.sim  # noqa: F401,E402 - sets MUJOCO_GL=egl before mujoco is imported

pytest.importorskip("mujoco", reason="the simulation needs mujoco (requirements.txt)")
pytest.importorskip("gym_aloha", reason="the simulation needs gym-aloha (requirements.txt)")

from oxygen_ros.sim.episode import EpisodeConfig, run_episode  # noqa: E402
from oxygen_ros.sim.execution import Trajectory, TrajectoryExecutor, TrajectoryRejected  # noqa: E402
from oxygen_ros.sim.scene import CUBE_HALF, JOINTS, START_POSE, AlohaScene, Cube, SceneSpec  # noqa: E402
from oxygen_ros.sim.tasks import (QUESTIONS, TASKS, TaskMonitor, draw_task, memory_text,  # noqa: E402
                                  scene_answers)
from sim_states import pose_gripper_at as _pose_gripper_at, set_cube as _set_cube  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def sim():
    s = AlohaScene((24, 24))
    yield s
    s.close()


def test_joint_layout_is_gym_alohas():
    from gym_aloha.constants import JOINTS as GYM
    assert list(JOINTS) == list(GYM)


# ---------------------------------------------------------------------------------------------------- scenes
def test_a_seed_draws_the_same_scene_and_seeds_differ():
    for task in TASKS:
        assert draw_task(task, 7) == draw_task(task, 7)
        specs = {draw_task(task, s).scene for s in range(20)}
        assert len(specs) == 20, f"{task}: seeds drew identical scenes"
        n = {len(draw_task(task, s).scene.cubes) for s in range(40)}
        assert n == {1, 2, 3}, f"{task}: cube counts {n}"
    with pytest.raises(ValueError, match="unknown task"):
        draw_task("juggle", 0)


def test_cubes_rest_where_the_scene_says_and_unused_ones_are_parked(sim):
    spec = SceneSpec((Cube("red", 0.1, 0.5, 0.3), Cube("blue", -0.1, 0.6)))
    sim.reset(spec)
    for _ in range(25):
        sim.step(START_POSE)
    assert np.allclose(sim.cube_pos(0), [0.1, 0.5, CUBE_HALF], atol=2e-3)
    assert np.allclose(sim.cube_pos(1), [-0.1, 0.6, CUBE_HALF], atol=2e-3)
    assert sim.cube_pos(2)[1] > 2.5                      # parked, out of view
    assert sim.model.geom_rgba[sim.cube_geom[2]][3] == 0
    imgs = sim.render()
    assert len(imgs) == 3 and all(im.shape == (24, 24, 3) and im.dtype == np.uint8 for im in imgs)
    with pytest.raises(ValueError, match="distinct"):
        SceneSpec((Cube("red", 0, 0.5), Cube("red", 0.1, 0.5)))
    with pytest.raises(ValueError, match="unknown camera"):
        AlohaScene((24, 24), cameras=("top", "ceiling"))


# ---------------------------------------------------------------------------------------------------- detectors
def test_reach_fires_on_the_named_grippers_contact_with_the_named_cube_only(sim):
    spec = draw_task("reach", 3)
    sim.reset(spec.scene)
    i = spec.target_index
    mon = TaskMonitor(sim, spec)
    assert not mon.update()                                 # start pose: nothing touches the cube
    cube = sim.cube_pos(i)
    _pose_gripper_at(sim, spec.arm, cube, 0.0)              # fingers closed through the cube: in contact
    assert mon.update()
    other = "left" if spec.arm == "right" else "right"
    sim.reset(spec.scene)
    mon = TaskMonitor(sim, spec)
    _pose_gripper_at(sim, other, sim.cube_pos(i), 0.0)      # the wrong gripper touching it: no success
    assert not mon.update()


def test_pick_needs_a_held_cube_five_cm_up_for_half_a_second(sim):
    spec = draw_task("pick", 2)
    i = spec.target_index
    finger = sim.finger_geoms["left"][0]

    def run(height, seconds, held=True):
        sim.reset(spec.scene)
        mon = TaskMonitor(sim, spec)
        c = sim.cube_pos(i)
        for _ in range(int(round(seconds / 0.02))):
            _set_cube(sim, i, (c[0], c[1], CUBE_HALF + height))
            if held:                                        # the cube in a finger: held, at the finger's height
                f = sim.data.geom_xpos[finger]
                _set_cube(sim, i, (f[0], f[1], f[2]))
            sim.steps += 1
            mon.update()
        return mon.success

    sim.reset(spec.scene)
    z = sim.data.geom_xpos[finger][2]
    assert z - CUBE_HALF > 0.06, z                          # the finger is high enough for a lift
    assert run(0.06, 0.6)
    assert not run(0.06, 0.4)                               # not long enough
    assert not run(0.06, 0.6, held=False)                   # up there but touching no finger: knocked up or propped
    assert not run(0.04, 1.0, held=False)                   # not high enough


def test_transfer_success_is_the_left_gripper_alone_holding_it_and_gym_alohas_reward_four_is_kept(sim):
    spec = draw_task("transfer", 1)
    i = spec.target_index
    mid = np.array([0.0, 0.5, 0.25])

    def hold(seconds, right_too=False):
        sim.reset(spec.scene)
        mon = TaskMonitor(sim, spec)
        mon.update()
        assert mon.reward == 0 and not mon.gym_success
        _pose_gripper_at(sim, "left", mid, 0.0)
        if right_too:                                       # the right gripper's fingers still on it
            _pose_gripper_at(sim, "right", mid + np.array([0.0, 0.0, 0.01]), 0.0)
        for _ in range(int(round(seconds / 0.02))):
            _set_cube(sim, i, mid)                          # held by the left fingers, in the air
            sim.steps += 1
            mon.update()
        return mon

    mon = hold(0.1)
    assert mon.reward == 4 and mon.gym_success and not mon.success      # gym-aloha's fires at once; strict waits
    mon = hold(0.6)
    assert mon.success and mon.gym_success and mon.success_time > mon.gym_success_time
    mon = hold(0.6, right_too=True)
    assert mon.gym_success and not mon.success                          # not alone: a hand-over still in progress
    sim.reset(spec.scene)
    mon = TaskMonitor(sim, spec)
    c = sim.cube_pos(i)
    _set_cube(sim, i, (c[0], c[1], CUBE_HALF - 1e-3))          # resting on the table (as physics leaves it)
    _pose_gripper_at(sim, "left", c, 0.0)                     # touching it, but the cube is on the table
    mon.update()
    assert mon.reward == 3 and not mon.success and not mon.gym_success


# ---------------------------------------------------------------------------------------------------- texts
def test_answers_and_memory_follow_the_physics_state(sim):
    spec = SceneSpec((Cube("red", -0.12, 0.5), Cube("blue", 0.12, 0.5), Cube("green", 0.0, 0.65)))
    sim.reset(spec)
    a = scene_answers(sim)
    assert set(a) == set(QUESTIONS)
    assert a["How many cubes are on the table?"] == "three"
    assert a["What colour is the cube nearest the left arm?"] == "red"
    assert a["What colour is the cube nearest the right arm?"] == "blue"
    assert a["Which cube are you holding?"] == "none"
    assert memory_text(sim) == "a red cube, a green cube and a blue cube on the table"
    mid = np.array([0.12, 0.5, 0.15])                        # lift the blue cube into the right gripper
    _pose_gripper_at(sim, "right", mid, 0.0)
    _set_cube(sim, 1, mid)
    a = scene_answers(sim)
    assert a["How many cubes are on the table?"] == "two"
    assert a["Which cube are you holding?"] == "the blue cube"
    assert memory_text(sim) == "a red cube and a green cube on the table; the right gripper holds the blue cube"


# ---------------------------------------------------------------------------------------------------- execution
def _tr(start, rows, names=("a", "b"), dt=0.1):
    rows = np.asarray(rows, float)
    return Trajectory(start, tuple(names), np.arange(len(rows)) * dt, rows)


def test_executor_runs_the_newest_trajectory_from_its_stamp_with_interpolation():
    ex = TrajectoryExecutor(("a", "b"), [0.0, 0.0])
    assert np.allclose(ex.command(0.0), [0, 0])             # nothing started: hold
    ex.submit(_tr(0.1, [[1, 1], [2, 2], [3, 3]]))
    assert np.allclose(ex.command(0.05), [0, 0])            # before its stamp
    assert np.allclose(ex.command(0.15), [1.5, 1.5])        # linear between points
    ex.submit(_tr(0.3, [[10, 10], [20, 20]]))               # starts later: the first keeps running until then
    assert np.allclose(ex.command(0.25), [2.5, 2.5])
    assert np.allclose(ex.command(0.35), [15, 15])
    assert np.allclose(ex.command(1.0), [20, 20])           # after the end: the last point held
    assert ex.idle_for(1.0) == pytest.approx(0.6)
    ex.submit(_tr(1.1, [[5, 6]], names=("b", "a")))         # joint order by name
    assert np.allclose(ex.command(1.2), [6, 5])


@pytest.mark.parametrize("bad,reason", [
    (_tr(0.0, [[1, 1]], names=("a", "c")), "unknown_joint"),
    (_tr(0.0, [[1]], names=("a",)), "missing_joint"),
    (_tr(0.0, [[1, 1, 1]]), "wrong_length"),
    (_tr(0.0, [[np.nan, 1]]), "not_finite"),
    (Trajectory(0.0, ("a", "b"), np.array([0.0, 0.0]), np.zeros((2, 2))), "bad_times"),
    (Trajectory(0.0, ("a", "b"), np.array([0.0, 0.1]), np.array([[1, 2], [3]], dtype=object)), "wrong_length"),
    (Trajectory(0.0, ("a", "b"), np.zeros(0), np.zeros((0, 2))), "empty"),
])
def test_executor_rejects_and_counts_bad_trajectories_and_keeps_holding(bad, reason):
    ex = TrajectoryExecutor(("a", "b"), [0.5, 0.5])
    with pytest.raises(TrajectoryRejected) as e:
        ex.submit(bad)
    assert e.value.reason == reason and ex.rejected[reason] == 1
    assert np.allclose(ex.command(0.5), [0.5, 0.5])


# ---------------------------------------------------------------------------------------------------- the expert
@pytest.fixture(scope="module")
def expert_policy():
    from oxygen_ros.ros.lockstep import PipelinePolicy, sim_settings
    pol = PipelinePolicy(sim_settings(None, {"delta_action_mask": []}), expert=True, horizon=20)
    yield pol
    pol.close()


@pytest.mark.parametrize("task,seeds,delay", [("reach", range(10), 0), ("pick", range(10), 5),
                                               ("transfer", range(10), 2)])
def test_the_expert_succeeds_through_the_nodes_action_path(sim, expert_policy, task, seeds, delay):
    ok = [run_episode(sim, draw_task(task, s), expert_policy,
                      EpisodeConfig(delay_steps=delay, camera_every=10)).success for s in seeds]
    assert sum(ok) >= 9, f"{task}: the expert succeeded on {sum(ok)} of {len(ok)} seeds"


def test_lockstep_is_deterministic(sim, expert_policy):
    from oxygen_ros.ros.lockstep import PipelinePolicy, sim_settings
    a = run_episode(sim, draw_task("pick", 4), expert_policy, EpisodeConfig(delay_steps=3, time_limit_s=1.5))
    b = run_episode(sim, draw_task("pick", 4), expert_policy, EpisodeConfig(delay_steps=3, time_limit_s=1.5))
    assert np.array_equal(np.array(a.actions), np.array(b.actions))
    # random weights, delta actions
    rnd = PipelinePolicy(sim_settings(None, {"preset": "tiny", "device": "cpu"}), horizon=10)
    try:
        c = run_episode(sim, draw_task("reach", 1), rnd, EpisodeConfig(delay_steps=2, time_limit_s=1.0))
        run_episode(sim, draw_task("reach", 5), rnd, EpisodeConfig(time_limit_s=0.4))     # something in between
        d = run_episode(sim, draw_task("reach", 1), rnd, EpisodeConfig(delay_steps=2, time_limit_s=1.0))
    finally:
        rnd.close()
    assert len(c.chunk_times) > 3
    assert np.array_equal(np.array(c.actions), np.array(d.actions))
    assert not np.allclose(np.array(c.actions)[-1], np.array(c.actions)[0])      # the random policy did move


def test_a_chunk_takes_effect_after_the_modelled_delay(sim, expert_policy):
    r = run_episode(sim, draw_task("reach", 0), expert_policy, EpisodeConfig(delay_steps=4, time_limit_s=0.5))
    a = np.array(r.actions)
    assert np.allclose(a[:4], a[0])                          # the first chunk is ready at step 4: hold until then
    assert not np.allclose(a[5], a[0])
    assert r.chunk_times[0] == (0.0, pytest.approx(0.08))


# ---------------------------------------------------------------------------------------------------- sim-record
def test_sim_record_writes_the_episode_bag_the_trainer_reads(tmp_path):
    import json
    from oxygen_ros.ros.lockstep import default_sim_params
    from oxygen_ros.tools.sim.record import main as record
    from oxygen_ros.tools.train import robot_layout
    from oxygen_ros.train.data import TopicMap, load_episodes
    out = tmp_path / "bag"
    assert record(["--out", str(out), "--task", "reach", "--seeds", "0:2", "--camera-size", "16", "--quiet"]) == 0
    summary = json.loads((out / "episodes.json").read_text())
    assert summary["recorded"] == 2 and not (tmp_path / "bag.partial").exists()
    tm = TopicMap.from_layout(robot_layout(default_sim_params()))
    eps = load_episodes([out], tm)
    assert [e.meta["seed"] for e in eps] == [0, 1] and all(e.meta["success"] for e in eps)
    for e, s in zip(eps, summary["episodes"]):
        assert e.images.shape[1:] == (3, 16, 16, 3) and e.image_mask.all()
        assert e.num_frames == s["frames"]
        assert len(e.actions) == pytest.approx((s["end_ns"] - s["start_ns"]) / 2e7, abs=1)
        kinds = {k for f in e.texts for (k, _, _) in f}
        assert kinds == {"conversation", "memory"}
        assert e.instruction[0] == draw_task("reach", e.meta["seed"]).instruction
    with pytest.raises(SystemExit) as ex:
        record(["--out", str(tmp_path / "x"), "--task", "juggle"])
    assert ex.value.code == 2
    with pytest.raises(SystemExit):
        record(["--out", str(out), "--task", "reach", "--seeds", "0:1"])      # exists, no --overwrite


def test_the_summary_keeps_cells_and_episode_scalars_and_leaves_out_per_episode_lists():
    """summary.json (what bench/results/ keeps of a sim-eval run): the cells exactly, one row of scalars and small
    dicts per episode, every per-episode list left out and named."""
    from oxygen_ros.tools.sim.report import summary
    cells = [{"name": "oxygen-blend-0ms-none", "aggregate": {"tasks": {"reach": {"n": 2, "success": 1}}}}]
    eps = [{"cell": "oxygen-blend-0ms-none", "task": "reach", "seed": i, "success": bool(i), "success_time": None,
            "rejected": {"stale": i}, "switch_jumps": [0.1] * 500, "inside_steps": [0.01] * 5000, "answers": []}
           for i in range(2)]
    doc = {"config": {"policy": "expert"}, "hardware": {"cpu": "x"}, "wall_s": 1.5, "cells": cells, "plots": [],
           "episodes": eps}
    s = summary(doc)
    assert {k: s[k] for k in ("config", "hardware", "wall_s", "cells", "plots")} == \
        {k: doc[k] for k in ("config", "hardware", "wall_s", "cells", "plots")}
    assert s["episodes"] == [{"cell": "oxygen-blend-0ms-none", "task": "reach", "seed": i, "success": bool(i),
                              "success_time": None, "rejected": {"stale": i}} for i in range(2)]
    assert s["left_out"] == ["answers", "inside_steps", "switch_jumps"]
    assert len(eps[0]["switch_jumps"]) == 500                      # the input document is not changed


def test_a_grid_option_meant_for_one_chunking_mode_does_not_break_the_others(tmp_path):
    """``-p blend_steps:=N`` over a none / blend / rtc grid: the node refuses blend_steps without blend, so the grid
    gives it to the blend cells only - every cell runs (it once marked the none and rtc cells incomplete)."""
    import json

    from oxygen_ros.tools.sim import eval as sim_eval
    from oxygen_ros.tools.sim.report import summary
    out = tmp_path / "grid"
    rc = sim_eval.main(["--policy", "expert", "--task", "reach", "--seeds", "0:1", "--chunking", "none,blend,rtc",
                        "-p", "blend_steps:=3", "--no-video", "--quiet", "--out", str(out)])
    assert rc == 0
    doc = json.loads((out / "results.json").read_text())
    cells = doc["cells"]
    assert json.loads((out / "summary.json").read_text()) == json.loads(json.dumps(summary(doc)))
    assert {c["chunking"] for c in cells} == {"none", "blend", "rtc"}
    assert all(c["aggregate"]["incomplete"] == 0 and c["aggregate"]["tasks"]["reach"]["n"] == 1 for c in cells), \
        [(c["name"], c["aggregate"]["incomplete"]) for c in cells]
