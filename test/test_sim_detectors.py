"""The success detectors of ``sim/tasks.py`` on constructed states of the real scene (gripper poses by IK, cubes set
by qpos, contacts from ``mj_forward``; time advanced by counting control steps, no physics), in the cases a change is
likely to break: ``reach`` with a cube of another colour and with the other arm, and with one finger; ``pick`` with a
drop and re-lift (the hold timer restarts), held but not 5 cm up, held by the other arm's finger, propped on the
gripper's body (no finger); ``transfer`` through gym-aloha's reward stages 1 / 2 / 4, a handover dropped after the
left gripper's first touch (success latches at that touch, as gym-aloha's max reward does), a cube dropped before the
left gripper touches it (3 at most), gym-aloha's finger rule, and a cube of another colour.  The stricter transfer
detector is tested with its own code."""
from __future__ import annotations

import numpy as np
import pytest

import oxygen_ros.sim  # noqa: F401 - MUJOCO_GL before mujoco

pytest.importorskip("mujoco", reason="the simulation needs mujoco (requirements.txt)")
pytest.importorskip("gym_aloha", reason="the simulation needs gym-aloha (requirements.txt)")

from oxygen_ros.sim.scene import CONTROL_DT, CUBE_HALF, AlohaScene, Cube, SceneSpec  # noqa: E402
from oxygen_ros.sim.tasks import HOLD_S, LIFT, TIME_LIMIT_S, TaskMonitor, TaskSpec  # noqa: E402
from sim_states import contacts_of, cube_on_one_finger, pose_gripper_at, set_cube  # noqa: E402

SCENE = SceneSpec((Cube("red", -0.1, 0.5), Cube("blue", 0.1, 0.5)))
AIR = np.array([0.0, 0.5, 0.25])            # a point both grippers reach, well above the table


@pytest.fixture(scope="module")
def sim():
    s = AlohaScene((8, 8))
    yield s
    s.close()


def _spec(task, target, arm, scene=SCENE):
    return TaskSpec(task, 0, scene, target, arm, f"{task} {target} {arm}", TIME_LIMIT_S[task])


def _monitor(sim, spec):
    sim.reset(spec.scene)
    return TaskMonitor(sim, spec)


def _tick(sim, mon) -> bool:
    """One control step of time (the state is whatever the test set) and the monitor's update."""
    sim.steps += 1
    return mon.update()


def _away(sim):
    """Both grippers open, high up and apart (touching nothing)."""
    pose_gripper_at(sim, "left", (-0.2, 0.5, 0.3), 1.0)
    pose_gripper_at(sim, "right", (0.2, 0.5, 0.3), 1.0)


# ---------------------------------------------------------------------------------------------------- reach
@pytest.mark.parametrize("target,arm", [("red", "left"), ("blue", "right"), ("blue", "left"), ("red", "right")])
def test_reach_needs_the_named_arm_on_the_named_cube(sim, target, arm):
    spec = _spec("reach", target, arm)
    i, j = SCENE.cube(target), 1 - SCENE.cube(target)
    other = "right" if arm == "left" else "left"
    mon = _monitor(sim, spec)
    pose_gripper_at(sim, arm, sim.cube_pos(j), 0.0)             # the named arm on the other colour
    assert not _tick(sim, mon)
    mon = _monitor(sim, spec)
    pose_gripper_at(sim, other, sim.cube_pos(i), 0.0)           # the other arm on the named colour
    assert not _tick(sim, mon)
    mon = _monitor(sim, spec)
    pose_gripper_at(sim, arm, sim.cube_pos(i), 0.0)             # the named arm on the named colour
    assert _tick(sim, mon) and mon.success_time == pytest.approx(CONTROL_DT)


@pytest.mark.parametrize("finger", [0, 1])
def test_reach_counts_either_finger_of_the_named_gripper(sim, finger):
    spec = _spec("reach", "red", "left")
    mon = _monitor(sim, spec)
    cube_on_one_finger(sim, "left", finger, SCENE.cube("red"), AIR)
    assert _tick(sim, mon)
    mon = _monitor(sim, spec)
    cube_on_one_finger(sim, "right", finger, SCENE.cube("red"), AIR)
    assert not _tick(sim, mon)


def test_reach_success_latches_with_its_first_time(sim):
    spec = _spec("reach", "red", "left")
    mon = _monitor(sim, spec)
    assert not _tick(sim, mon)
    pose_gripper_at(sim, "left", sim.cube_pos(0), 0.0)
    assert _tick(sim, mon)                                       # step 2: first contact
    assert _tick(sim, mon)                                       # step 3: still touching
    _away(sim)
    assert _tick(sim, mon) and mon.success_time == pytest.approx(2 * CONTROL_DT)


# ---------------------------------------------------------------------------------------------------- pick
def _held(sim, i, arm="left", height=0.2):
    """Cube ``i`` closed in ``arm``'s gripper at ``height`` (centre above the table)."""
    p = np.array([SCENE.cubes[i].x, SCENE.cubes[i].y, height])
    pose_gripper_at(sim, arm, p, 0.0)
    set_cube(sim, i, p)


def _dropped(sim, i):
    _away(sim)
    set_cube(sim, i, (SCENE.cubes[i].x, SCENE.cubes[i].y, CUBE_HALF))


def test_pick_hold_timer_restarts_after_a_drop_and_re_lift(sim):
    spec = _spec("pick", "red", "left")
    mon = _monitor(sim, spec)
    hold = int(round(HOLD_S / CONTROL_DT))                       # 25 steps
    _held(sim, 0)
    for _ in range(15):                                          # steps 1..15 held (0.28 s since the lift)
        assert not _tick(sim, mon)
    _dropped(sim, 0)
    assert not _tick(sim, mon)                                   # step 16: dropped
    _held(sim, 0)
    for _ in range(hold):                                        # steps 17..41: 0.48 s since the re-lift
        assert not _tick(sim, mon)
    assert _tick(sim, mon)                                       # step 42: 0.5 s since the re-lift (step 17)
    assert mon.success_time == pytest.approx(42 * CONTROL_DT)


def test_pick_needs_the_hold_without_interruption_by_a_short_touch_loss(sim):
    spec = _spec("pick", "red", "left")
    mon = _monitor(sim, spec)
    _held(sim, 0)
    for _ in range(20):
        _tick(sim, mon)
    _away(sim)
    set_cube(sim, 0, (-0.1, 0.5, 0.2))                           # still up, but for one step in no finger
    assert not contacts_of(sim, sim.cube_geom[0])
    assert not _tick(sim, mon)
    _held(sim, 0)
    for _ in range(int(round(HOLD_S / CONTROL_DT))):
        assert not _tick(sim, mon)
    assert _tick(sim, mon)


@pytest.mark.parametrize("dz,ok", [(LIFT - 0.002, False), (LIFT + 0.002, True)])
def test_pick_needs_five_cm_even_when_held(sim, dz, ok):
    spec = _spec("pick", "red", "left")
    mon = _monitor(sim, spec)
    _held(sim, 0, height=mon.rest_z + dz)
    fired = [_tick(sim, mon) for _ in range(int(round(HOLD_S / CONTROL_DT)) + 3)]
    assert any(fired) == ok


def test_pick_counts_a_finger_of_either_gripper_and_nothing_else(sim):
    spec = _spec("pick", "red", "left")                          # the red cube lies on the left
    n = int(round(HOLD_S / CONTROL_DT)) + 1
    mon = _monitor(sim, spec)
    cube_on_one_finger(sim, "right", 1, 0, AIR)                  # one finger of the other gripper: held
    assert [_tick(sim, mon) for _ in range(n)][-1]
    mon = _monitor(sim, spec)
    gripper = sim.model.geom("vx300s_left/7_gripper").id         # propped on the gripper's body, no finger
    set_cube(sim, 0, sim.data.geom_xpos[gripper])
    touching = contacts_of(sim, sim.cube_geom[0])
    assert touching and not any("finger" in t for t in touching)
    assert not any(_tick(sim, mon) for _ in range(n))
    mon = _monitor(sim, spec)
    _held(sim, 1)                                                # the blue cube held up: not the named one
    assert not any(_tick(sim, mon) for _ in range(n))


# ---------------------------------------------------------------------------------------------------- transfer
TSCENE = SceneSpec((Cube("blue", 0.1, 0.5), Cube("red", -0.1, 0.55)))


def _tspec():
    return _spec("transfer", "blue", "right", TSCENE)


def _on_table(sim, i=0):
    c = TSCENE.cubes[i]
    set_cube(sim, i, (c.x, c.y, CUBE_HALF - 1e-3))               # resting on the table (as physics leaves it)


def test_transfer_follows_gym_alohas_reward_stages_and_gym_success_latches_at_the_left_grippers_first_touch(sim):
    """gym-aloha's definition (``gym_success``) fires at the first left touch off the table; the strict success (the
    left gripper alone holding it for 0.5 s) does not, and a drop right after the touch never makes it one."""
    spec = _tspec()
    mon = _monitor(sim, spec)
    _on_table(sim)
    stages = []
    _tick(sim, mon)
    stages.append(mon.reward)                                    # 0: nothing touches it
    pose_gripper_at(sim, "right", (0.1, 0.5, CUBE_HALF), 0.0)    # right fingers around it, on the table
    _tick(sim, mon)
    stages.append(mon.reward)                                    # 1
    _away(sim)
    pose_gripper_at(sim, "right", AIR, 0.0)                      # lifted by the right gripper
    set_cube(sim, 0, AIR)
    _tick(sim, mon)
    stages.append(mon.reward)                                    # 2
    assert not mon.success
    pose_gripper_at(sim, "left", AIR, 0.0)                       # the handover: both grippers hold it in the air
    assert not _tick(sim, mon) and mon.gym_success
    stages.append(mon.reward)                                    # 4: gym-aloha's success (step 4)
    t_touch = sim.time
    pose_gripper_at(sim, "right", AIR, 1.0)                      # the right one lets go: the left holds it alone
    _tick(sim, mon)
    stages.append(mon.reward)                                    # 4
    _away(sim)                                                   # ... and dropped right after the first touch
    _on_table(sim)
    _tick(sim, mon)
    stages.append(mon.reward)                                    # 0 again
    assert stages == [0, 1, 2, 4, 4, 0]
    assert mon.gym_success and mon.gym_success_time == pytest.approx(t_touch) and mon.max_reward == 4
    assert not mon.success                                       # never held alone for 0.5 s


def test_transfer_dropped_before_the_left_touch_is_not_a_success(sim):
    spec = _tspec()
    mon = _monitor(sim, spec)
    pose_gripper_at(sim, "right", AIR, 0.0)
    set_cube(sim, 0, AIR)
    _tick(sim, mon)
    assert mon.reward == 2
    _away(sim)
    _on_table(sim)                                               # dropped
    _tick(sim, mon)
    assert mon.reward == 0
    pose_gripper_at(sim, "left", (0.1, 0.5, CUBE_HALF), 0.0)     # the left gripper closes on it on the table
    _tick(sim, mon)
    assert mon.reward == 3 and not mon.success and not mon.gym_success and mon.max_reward == 3


def test_transfer_counts_gym_alohas_fingers_and_the_named_cube_only(sim):
    spec = _tspec()
    # gym-aloha: the right gripper's right finger, the left gripper's left finger
    for arm, finger, reward in (("right", 1, 2), ("right", 0, 0), ("left", 0, 4), ("left", 1, 0)):
        mon = _monitor(sim, spec)
        cube_on_one_finger(sim, arm, finger, 0, AIR)
        _tick(sim, mon)
        assert mon.reward == reward, (arm, finger)
    mon = _monitor(sim, spec)
    pose_gripper_at(sim, "left", AIR, 0.0)                       # the red cube in the left gripper, in the air
    set_cube(sim, 1, AIR)
    _tick(sim, mon)
    assert mon.reward == 0 and not mon.success and not mon.gym_success
