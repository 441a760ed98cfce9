"""A training target on the plan itself: where the planned chunk puts each gripper, in metres.

Why (``checkpoints/demo/README.md``, stage 7): the action expert's hidden state holds the named cube's place (a
linear read-out gives its x with r +0.97 at the start pose), yet the plans' first chunk follows the cube only along
the table (y) and not across it (x, how far the arm reaches).  The flow loss is a mean squared error on normalised
joint deltas; in those units the joints that set the reach's extension (shoulder, elbow) move little in an
episode's first chunks (label std 0.2 against the waist's 1.6), so what they get wrong costs the loss little - and
centimetres at the gripper.  This target measures the plan where the task is decided: the grip site of each arm,
through the arm's forward kinematics, for the denoiser's estimate of the clean chunk, against the label's.

This file owns two objects:

* ``ArmKinematics`` - both ViperX arms' forward kinematics in torch, read from the MuJoCo model (the bodies from the
  world to each ``<arm>_grip`` site: their fixed offsets and the six hinge joints, with MuJoCo's own conventions:
  a hinge turns about its axis through its anchor by qpos - qpos0).  ``grip(q [..., 14]) -> [..., 2, 3]``, the
  state's layout (per arm six joints, then the gripper).  Differentiable; equal to ``mj_kinematics`` (tested).
* ``PlanTarget`` - ``loss(x0_hat, actions, state, valid, denom)``: the squared distance in units of ``scale`` metres
  (5 cm) between the grip sites of the predicted and the labelled chunk at every valid row, summed over both arms,
  divided by ``denom`` (the flow loss's row count, so distributed ranks average to the global mean).  Chunks are in
  the model's normalised output space: they are mapped back through the checkpoint's quantile statistics and, for
  the delta columns, added to the frame's true state.

``losses.pi05_loss`` forms x0_hat = x_t - t * v (the flow's estimate of the clean chunk; at t near 1 the plan's
mean) and adds ``plan_weight`` times this loss (``oxygen train --plan-weight``).  Training only: nothing of it is in
the checkpoint or at inference.
"""
from __future__ import annotations

import numpy as np
import torch

from ..sim.scene import ARM_JOINTS, ARM_OFFSET

__all__ = ["ArmKinematics", "PlanTarget"]


def _quat_to_mat(q) -> np.ndarray:
    w, x, y, z = (float(v) for v in q)
    return np.array([[1 - 2 * (y * y + z * z), 2 * (x * y - z * w), 2 * (x * z + y * w)],
                     [2 * (x * y + z * w), 1 - 2 * (x * x + z * z), 2 * (y * z - x * w)],
                     [2 * (x * z - y * w), 2 * (y * z + x * w), 1 - 2 * (x * x + y * y)]])


def _axis_rotation(axis: torch.Tensor, angle: torch.Tensor) -> torch.Tensor:
    """Rotation matrices [..., 3, 3] about the unit ``axis`` [3] by ``angle`` [...] (Rodrigues)."""
    k = axis
    K = torch.tensor([[0.0, -float(k[2]), float(k[1])], [float(k[2]), 0.0, -float(k[0])],
                      [-float(k[1]), float(k[0]), 0.0]], dtype=angle.dtype, device=angle.device)
    s, c = torch.sin(angle)[..., None, None], torch.cos(angle)[..., None, None]
    eye = torch.eye(3, dtype=angle.dtype, device=angle.device)
    return eye + s * K + (1 - c) * (K @ K)


class ArmKinematics:
    """Forward kinematics of both arms' grip sites, from the MuJoCo model of ``sim.scene.AlohaScene``."""

    def __init__(self, model=None):
        if model is None:
            from oxygen_ros.sim.scene import AlohaScene  # noqa: PLC0415  (needs mujoco and gym-aloha's assets)
            scene = AlohaScene(camera_size=(8, 8))
            model = scene.model
            scene.close()
        self.chains = {arm: self._chain(model, arm) for arm in ARM_OFFSET}

    @staticmethod
    def _chain(m, arm: str) -> dict:
        """The bodies from the world to the arm's grip site: per body (pos [3], rot [3, 3], joints), joints as
        (state column, axis [3], anchor [3], qpos0); and the site's offset in its body."""
        column = {int(m.joint(f"vx300s_{arm}/{j}").id): ARM_OFFSET[arm] + i for i, j in enumerate(ARM_JOINTS)}
        site = m.site(f"{arm}_grip")
        bodies, b = [], int(site.bodyid[0])
        while b != 0:
            bodies.append(b)
            b = int(m.body_parentid[b])
        chain = []
        for b in reversed(bodies):
            joints = []
            for j in range(int(m.body_jntadr[b]), int(m.body_jntadr[b]) + int(m.body_jntnum[b])):
                if j not in column or int(m.jnt_type[j]) != 3:          # 3 = mjJNT_HINGE
                    raise ValueError(f"{arm} arm: joint {m.joint(j).name!r} on the grip site's chain is not one "
                                     "of the arm's six hinges")
                joints.append((column[j], torch.tensor(m.jnt_axis[j], dtype=torch.float64),
                               torch.tensor(m.jnt_pos[j], dtype=torch.float64),
                               float(m.qpos0[m.jnt_qposadr[j]])))
            chain.append((torch.tensor(m.body_pos[b], dtype=torch.float64),
                          torch.tensor(_quat_to_mat(m.body_quat[b]), dtype=torch.float64), joints))
        if sorted(c for _p, _r, js in chain for c, *_ in js) != sorted(column.values()):
            raise ValueError(f"{arm} arm: the grip site's chain does not hold the arm's six joints")
        return {"bodies": chain, "site": torch.tensor(m.site_pos[site.id], dtype=torch.float64)}

    def grip(self, q: torch.Tensor) -> torch.Tensor:
        """Grip site positions [..., 2, 3] (left, right; metres, world frame) for states ``q`` [..., >= 14]."""
        return torch.stack([self._site(q, self.chains[arm]) for arm in ARM_OFFSET], dim=-2)

    @staticmethod
    def _site(q: torch.Tensor, chain: dict) -> torch.Tensor:
        dt, dev = q.dtype, q.device
        shape = q.shape[:-1]
        p = torch.zeros(*shape, 3, dtype=dt, device=dev)
        R = torch.eye(3, dtype=dt, device=dev).expand(*shape, 3, 3)
        for pos, rot, joints in chain["bodies"]:
            p = p + R @ pos.to(dev, dt)
            R = R @ rot.to(dev, dt)
            for col, axis, anchor, q0 in joints:
                a = anchor.to(dev, dt)
                anchor_w = p + R @ a
                R = R @ _axis_rotation(axis, q[..., col] - q0)
                p = anchor_w - R @ a
        return p + R @ chain["site"].to(dev, dt)


class PlanTarget:
    """The grip-site distance between a predicted and a labelled chunk (see the module docstring)."""

    def __init__(self, norm_stats, delta_mask, kinematics: ArmKinematics | None = None, scale: float = 0.05):
        s = norm_stats.actions                   # the inverse of NormStats.normalize_actions on these columns
        if s is None or s.q01 is None or s.q99 is None or len(s.q01) < 14:
            raise ValueError("the plan target needs the actions' q01 / q99 statistics for the 14 ALOHA columns")
        q01, q99 = np.asarray(s.q01, np.float64), np.asarray(s.q99, np.float64)
        self.q01 = torch.from_numpy(q01).float()                                        # [n]
        self.span = torch.from_numpy(q99 - q01 + 1e-6).float()                          # [n] = q99 - q01 + 1e-6
        dm = np.zeros(14, bool)
        d = np.asarray(delta_mask, bool)[:14]
        dm[:len(d)] = d
        self.delta = torch.from_numpy(dm)
        self.fk = kinematics or ArmKinematics()
        self.scale = float(scale)

    def absolute(self, chunk: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """Normalised chunk [B, H, >= 14] + state [B, >= 14] -> absolute joint targets [B, H, 14]."""
        x = chunk[..., :14].float()
        raw = (x + 1) / 2 * self.span[:14].to(x) + self.q01[:14].to(x)
        return torch.where(self.delta.to(x.device), raw + state[:, None, :14].float(), raw)

    def loss(self, x0_hat: torch.Tensor, actions: torch.Tensor, state: torch.Tensor, valid: torch.Tensor,
             denom: float | torch.Tensor | None = None) -> torch.Tensor:
        """Sum over valid rows [B, H] of the squared grip-site distance (both arms, in ``scale`` units) / ``denom``
        (default: the valid rows here)."""
        with torch.autocast(x0_hat.device.type, enabled=False):      # millimetres at half a metre: not in bf16
            with torch.no_grad():
                want = self.fk.grip(self.absolute(actions, state))                      # [B, H, 2, 3]
            got = self.fk.grip(self.absolute(x0_hat, state))
        se = ((got - want) / self.scale).pow(2).sum(dim=(-1, -2))                       # [B, H]
        w = valid.float()
        d = w.sum().clamp(min=1.0) if denom is None else denom
        return (se * w).sum() / d

