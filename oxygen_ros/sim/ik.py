"""Inverse kinematics of one ViperX arm on the MuJoCo model: damped least squares on the grip site's Jacobian.

This file owns one job: joint angles that put an arm's grip site (``AlohaScene.grip_site``, between the finger pads) at
a position with the gripper frame at a given rotation (``gripper_frame``: the gripper's forward axis and the fingers'
closing axis in world coordinates; ``down_rotation(yaw)``: pointing straight down).  It works on its own ``MjData``
(the simulation's state is never touched): ``ArmIK(scene, arm).solve(q0, pos, R)`` iterates
dq = J^T (J J^T + lambda^2 I)^-1 e from ``q0`` over the arm's six joints, with e = (position error, weighted
orientation error as a rotation vector), steps clamped to ``max_step`` rad (so the solution stays on the branch it
starts on: warm-start from the arm's current joints) and the joint ranges enforced after each step.
"""
from __future__ import annotations

import mujoco
import numpy as np

__all__ = ["ArmIK", "down_rotation", "gripper_frame"]


def gripper_frame(forward, closing) -> np.ndarray:
    """World rotation [3, 3] of a gripper whose x axis (forward, from wrist to finger tips) is ``forward`` and whose
    y axis (the fingers' closing direction) is ``closing`` (made orthogonal to ``forward``)."""
    x = np.asarray(forward, dtype=np.float64)
    x = x / np.linalg.norm(x)
    y = np.asarray(closing, dtype=np.float64)
    y = y - x * (x @ y)
    y = y / np.linalg.norm(y)
    return np.stack([x, y, np.cross(x, y)], axis=1)        # columns = the frame's axes in world coordinates


def down_rotation(yaw: float) -> np.ndarray:
    """The gripper pointing straight down (forward = -z), fingers closing along (cos yaw, sin yaw, 0)."""
    return gripper_frame((0.0, 0.0, -1.0), (np.cos(yaw), np.sin(yaw), 0.0))


def _rotvec(R: np.ndarray) -> np.ndarray:
    """Rotation matrix -> rotation vector (axis * angle)."""
    q = np.empty(4)
    mujoco.mju_mat2Quat(q, R.reshape(-1))
    if q[0] < 0:
        q = -q
    s = np.linalg.norm(q[1:])
    if s < 1e-12:
        return np.zeros(3)
    return q[1:] / s * 2.0 * np.arctan2(s, q[0])


class ArmIK:
    def __init__(self, scene, arm: str, damping: float = 0.03, orientation_weight: float = 0.3,
                 max_step: float = 0.1, roll_weight: float = 0.01):
        self.scene, self.arm = scene, arm
        self.model = scene.model
        self.data = mujoco.MjData(self.model)
        self.qadr = scene.arm_qpos[arm]
        self.dofs = scene.arm_dofs[arm]
        self.site = scene.grip_site[arm]
        jids = [self.model.dof_jntid[d] for d in self.dofs]
        self.low = self.model.jnt_range[jids, 0]
        self.high = self.model.jnt_range[jids, 1]
        self.damping = damping
        self.w_rot = orientation_weight
        self.max_step = max_step
        self.roll_weight = roll_weight
        self._jp = np.zeros((3, self.model.nv))
        self._jr = np.zeros((3, self.model.nv))

    def forward(self, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Grip site position [3] and rotation [3, 3] for arm joints ``q`` [6]."""
        self.data.qpos[self.qadr] = q
        mujoco.mj_kinematics(self.model, self.data)
        return self.data.site_xpos[self.site].copy(), self.data.site_xmat[self.site].reshape(3, 3).copy()

    def solve(self, q0, pos, target_R: np.ndarray, iters: int = 100, tol: float = 1e-4) -> np.ndarray:
        """Arm joints [6] putting the grip site at ``pos`` [3] with rotation ``target_R`` [3, 3], from ``q0`` [6]."""
        q = np.array(q0, dtype=np.float64)
        lam2 = self.damping ** 2
        for _ in range(iters):
            p, R = self.forward(q)
            e = np.concatenate([np.asarray(pos) - p, self.w_rot * _rotvec(target_R @ R.T)])
            if np.linalg.norm(e[:3]) < tol and np.linalg.norm(e[3:]) < tol:
                break
            mujoco.mj_comPos(self.model, self.data)
            mujoco.mj_jacSite(self.model, self.data, self._jp, self._jr, self.site)
            J = np.concatenate([self._jp[:, self.dofs], self.w_rot * self._jr[:, self.dofs]])      # [6, 6]
            # damped least squares plus a pull of the forearm roll toward 0: the wrist has two branches (roll 0 or
            # +-pi); without the pull, passing the wrist singularity (wrist angle 0, on the way from the start pose
            # to pointing down) lands on either, and the solution would depend on the warm start
            A = J.T @ J + lam2 * np.eye(6)
            A[3, 3] += self.roll_weight
            dq = np.linalg.solve(A, J.T @ e - self.roll_weight * np.eye(6)[3] * q[3])
            n = np.abs(dq).max()
            if n < 1e-6:                                      # converged (with the roll pull: a compromise)
                break
            if n > self.max_step:                             # small steps keep it on the branch it started on
                dq *= self.max_step / n
            q = np.clip(q + dq, self.low, self.high)
        return q
