"""Constructed simulation states for detector and ground-truth tests: put a gripper or a cube where a test wants it,
kinematically (qpos + ``mj_forward``; no physics step), so contacts are exactly what the test built."""
from __future__ import annotations

import numpy as np


def pose_gripper_at(sim, arm: str, pos, grip: float) -> None:
    """Put ``arm``'s grip site at ``pos`` (pointing down) and its fingers at ``grip`` (0 closed .. 1 open)."""
    import mujoco

    from oxygen_ros.sim.ik import ArmIK, down_rotation
    from oxygen_ros.sim.scene import START_POSE, gripper_to_finger
    off = 0 if arm == "left" else 7
    q = ArmIK(sim, arm).solve(START_POSE[off:off + 6], np.asarray(pos, float), down_rotation(np.pi / 2))
    sim.data.qpos[sim.arm_qpos[arm]] = q
    f = float(gripper_to_finger(grip))
    sim.data.qpos[sim.finger_qpos[arm]] = f
    sim.data.qpos[sim.finger_qpos[arm] + 1] = -f
    mujoco.mj_forward(sim.model, sim.data)


def set_cube(sim, i: int, pos) -> None:
    """Cube ``i``'s centre at ``pos``, unrotated, at rest."""
    import mujoco
    q = sim.cube_qpos[i]
    sim.data.qpos[q:q + 3] = pos
    sim.data.qpos[q + 3:q + 7] = (1, 0, 0, 0)
    sim.data.qvel[sim.cube_qvel[i]:sim.cube_qvel[i] + 6] = 0
    mujoco.mj_forward(sim.model, sim.data)


def contacts_of(sim, geom: int) -> set:
    """Names of the geoms touching ``geom`` now."""
    names = set()
    for a, b in sim.contacts():
        if geom in (a, b):
            other = b if a == geom else a
            names.add(sim.model.geom(other).name or f"geom{other}")
    return names


def cube_on_one_finger(sim, arm: str, finger: int, i: int, pos) -> None:
    """``arm``'s open gripper at ``pos`` and cube ``i`` against one finger only (0: the gripper's left finger,
    1: its right one; ``sim.finger_geoms[arm][finger]``), nothing else touching it when ``pos`` is in the air."""
    pose_gripper_at(sim, arm, pos, 1.0)
    set_cube(sim, i, np.asarray(pos, float) + (0.0, 0.03 if finger == 0 else -0.03, 0.0))
