"""The simulated robot: gym-aloha's bimanual ViperX model (two 6-DoF arms with parallel grippers) on its table, with
up to three coloured cubes, rendered headless with fast settings.

This file owns the MuJoCo model and everything that maps it to the robot's interface.  ``AlohaScene`` loads
gym-aloha's ``bimanual_viperx_transfer_cube.xml`` (the package is a dependency; its files are read where it is
installed, never copied) with ``mujoco.MjSpec``, removes the shipped red box and its keyframe, and adds
``MAX_CUBES`` cube bodies with free joints plus a grip site at each gripper's finger centre.  One model serves every
episode: ``reset(scene)`` colours and places the cubes a ``SceneSpec`` names and *parks* the others (invisible, no
collisions, gravity compensated, so they stay put), which keeps one compiled model and one renderer for a whole run.
The robot's interface is the 14-dim layout of ``JOINTS`` (gym-aloha's order: per arm six joint angles in rad and a
normalised gripper opening, 0 = closed ... 1 = open, gym-aloha's puppet-gripper normalisation); ``step(action)``
runs one control step (``CONTROL_DT`` = 20 ms, ALOHA's 50 Hz) as the model's timestep x ``substeps`` physics
steps.  Cameras: ``top`` (the node's base slot), ``left_wrist``, ``right_wrist``, rendered by one
``mujoco.Renderer`` at a chosen size with shadows and off-screen anti-aliasing off (set before the renderer exists:
about 5 ms per image instead of 40-120 ms, see the README's simulation section).  ``MUJOCO_GL`` defaults to ``egl``
(headless); set it before anything imports mujoco to choose otherwise.
"""
from __future__ import annotations

import os

os.environ.setdefault("MUJOCO_GL", "egl")

from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import mujoco  # noqa: E402
import numpy as np  # noqa: E402

__all__ = ["JOINTS", "ARMS", "ARM_JOINTS", "ARM_OFFSET", "CAMERAS", "COLOURS", "CUBE_HALF", "MAX_CUBES", "CONTROL_DT",
           "START_POSE", "Cube", "SceneSpec",
           "AlohaScene", "aloha_assets", "gripper_to_finger", "finger_to_gripper"]

# The 14-dim state / action layout (gym_aloha.constants.JOINTS, repeated here so the robot interface is readable in
# one place; a test checks it equals gym-aloha's).
JOINTS = ("left_arm_waist", "left_arm_shoulder", "left_arm_elbow", "left_arm_forearm_roll", "left_arm_wrist_angle",
          "left_arm_wrist_rotate", "left_arm_gripper",
          "right_arm_waist", "right_arm_shoulder", "right_arm_elbow", "right_arm_forearm_roll",
          "right_arm_wrist_angle", "right_arm_wrist_rotate", "right_arm_gripper")
ARMS = ("left", "right")
ARM_JOINTS = ("waist", "shoulder", "elbow", "forearm_roll", "wrist_angle", "wrist_rotate")   # per arm, JOINTS' order
ARM_OFFSET = {"left": 0, "right": 7}                     # where each arm's six joints start in JOINTS (gripper: + 6)
CAMERAS = ("top", "left_wrist", "right_wrist")          # = the node's camera slots base, left wrist, right wrist
COLOURS = {"red": (0.85, 0.12, 0.10), "green": (0.10, 0.65, 0.15), "blue": (0.12, 0.25, 0.90),
           "yellow": (0.95, 0.80, 0.10)}
CUBE_HALF = 0.02                                         # 4 cm cubes, gym-aloha's box
MAX_CUBES = 3
CONTROL_DT = 0.02                                        # 50 Hz
# gym-aloha's START_ARM_POSE in our 14-dim layout (grippers: finger 0.02239 -> normalised)
_START_ARM = (0.0, -0.96, 1.16, 0.0, -0.3, 0.0)
# gym-aloha's puppet gripper normalisation: finger joint position <-> 0 (closed) .. 1 (open)
_FINGER_CLOSE, _FINGER_OPEN = 0.01844, 0.05800
TOP_FOVY = 36.0
_PARK = np.array([0.0, 3.0, -1.0])                       # where unused cubes wait (out of every camera's view)


def finger_to_gripper(x):
    return (np.asarray(x, dtype=np.float64) - _FINGER_CLOSE) / (_FINGER_OPEN - _FINGER_CLOSE)


def gripper_to_finger(g):
    return np.asarray(g, dtype=np.float64) * (_FINGER_OPEN - _FINGER_CLOSE) + _FINGER_CLOSE


START_POSE = np.array(_START_ARM + (float(finger_to_gripper(0.02239)),) + _START_ARM
                      + (float(finger_to_gripper(0.02239)),))


def aloha_assets() -> Path:
    """gym-aloha's assets folder (where the package is installed)."""
    try:
        import gym_aloha  # noqa: PLC0415
    except ImportError as exc:                                  # pragma: no cover - dependency missing
        raise ImportError("the simulation needs gym-aloha (pip install gym-aloha==0.1.5)") from exc
    return Path(gym_aloha.__file__).resolve().parent / "assets"


@dataclass(frozen=True)
class Cube:
    colour: str                  # a key of COLOURS
    x: float                     # centre on the table, world frame (m); the table top is z = 0
    y: float
    yaw: float = 0.0             # rotation about z (rad)


@dataclass(frozen=True)
class SceneSpec:
    """What a seed drew: the cubes on the table (1..MAX_CUBES, distinct colours)."""
    cubes: tuple[Cube, ...]

    def __post_init__(self):
        if not 1 <= len(self.cubes) <= MAX_CUBES:
            raise ValueError(f"a scene has 1..{MAX_CUBES} cubes, got {len(self.cubes)}")
        colours = [c.colour for c in self.cubes]
        unknown = sorted(set(colours) - set(COLOURS))
        if unknown:
            raise ValueError(f"unknown cube colour(s) {unknown}; known: {sorted(COLOURS)}")
        if len(set(colours)) != len(colours):
            raise ValueError(f"cube colours must be distinct, got {colours}")

    def cube(self, colour: str) -> int:
        """Index of the cube of that colour (ValueError if the scene has none)."""
        for i, c in enumerate(self.cubes):
            if c.colour == colour:
                return i
        raise ValueError(f"the scene has no {colour} cube")


class AlohaScene:
    """The ALOHA model with ``MAX_CUBES`` cube slots; ``reset(spec)`` starts an episode, ``step(action)`` advances one
    control step, ``state()`` / ``render()`` observe it."""

    def __init__(self, camera_size: tuple[int, int] = (96, 96), cameras=CAMERAS):
        unknown = [c for c in cameras if c not in CAMERAS]
        if unknown:
            raise ValueError(f"unknown camera(s) {unknown}; known: {list(CAMERAS)}")
        h, w = (int(v) for v in camera_size)
        if h < 8 or w < 8:
            raise ValueError(f"camera size must be at least 8x8, got {h}x{w}")
        self.cameras = tuple(cameras)
        self.camera_size = (h, w)
        self.model = self._build()
        m = self.model
        m.light_castshadow[:] = 0                       # before the Renderer exists (it reads them at creation)
        m.vis.quality.offsamples = 0
        m.vis.global_.offwidth = max(m.vis.global_.offwidth, w)
        m.vis.global_.offheight = max(m.vis.global_.offheight, h)
        self.data = mujoco.MjData(m)
        self.substeps = max(1, int(round(CONTROL_DT / m.opt.timestep)))
        self._renderer: mujoco.Renderer | None = None
        # ids the rest of the simulation reads
        self.cube_body = [m.body(f"cube{i}").id for i in range(MAX_CUBES)]
        self.cube_geom = [m.geom(f"cube{i}").id for i in range(MAX_CUBES)]
        self.cube_qpos = [m.jnt_qposadr[m.joint(f"cube{i}").id] for i in range(MAX_CUBES)]
        self.cube_qvel = [m.jnt_dofadr[m.joint(f"cube{i}").id] for i in range(MAX_CUBES)]
        self.table_geom = m.geom("table").id
        self.finger_geoms = {a: (m.geom(f"vx300s_{a}/10_left_gripper_finger").id,
                                 m.geom(f"vx300s_{a}/10_right_gripper_finger").id) for a in ARMS}
        self.grip_site = {a: m.site(f"{a}_grip").id for a in ARMS}
        self.arm_qpos = {a: np.array([m.jnt_qposadr[m.joint(f"vx300s_{a}/{j}").id] for j in ARM_JOINTS])
                         for a in ARMS}
        self.arm_dofs = {a: np.array([m.jnt_dofadr[m.joint(f"vx300s_{a}/{j}").id] for j in ARM_JOINTS])
                         for a in ARMS}
        self.finger_qpos = {a: m.jnt_qposadr[m.joint(f"vx300s_{a}/left_finger").id] for a in ARMS}
        self.arm_base = {a: np.array(m.body(f"vx300s_{a}").pos) for a in ARMS}
        self.ctrl_low, self.ctrl_high = m.actuator_ctrlrange[:, 0].copy(), m.actuator_ctrlrange[:, 1].copy()
        self.spec: SceneSpec | None = None
        self.steps = 0

    # ---- model -----------------------------------------------------------------------------------------------------
    @staticmethod
    def _build() -> mujoco.MjModel:
        spec = mujoco.MjSpec.from_file(str(aloha_assets() / "bimanual_viperx_transfer_cube.xml"))
        spec.delete(spec.body("box"))                       # the shipped red box ...
        for key in list(spec.keys):                          # ... and the keyframe whose qpos included it
            spec.delete(key)
        for i in range(MAX_CUBES):
            b = spec.worldbody.add_body(name=f"cube{i}", pos=list(_PARK), mass=0.05, inertia=[0.002] * 3,
                                        explicitinertial=True, ipos=[0, 0, 0])
            b.add_freejoint(name=f"cube{i}")
            b.add_geom(name=f"cube{i}", type=mujoco.mjtGeom.mjGEOM_BOX, size=[CUBE_HALF] * 3, rgba=[1, 1, 1, 1],
                       condim=4, friction=[1, 0.005, 1e-4], solimp=[2, 1, 0.01, 0.5, 2], solref=[0.01, 1])
        # gym-aloha's top camera sees the whole room (fovy 78) for 480x640 images; at the model's small square input a
        # cube would be 2-3 px.  Same camera, narrowed to where the cubes lie (a 4 cm cube ~ 6-7 px at 96 px).
        spec.camera("top").fovy = TOP_FOVY
        for arm in ARMS:                                     # between the finger pads, on the gripper's axis
            spec.body(f"vx300s_{arm}/gripper_link").add_site(name=f"{arm}_grip", pos=[0.135, 0, 0],
                                                              size=[0.004] * 3, rgba=[0, 0, 0, 0])
        return spec.compile()

    # ---- episode ---------------------------------------------------------------------------------------------------
    def reset(self, spec: SceneSpec, arm_pose=None) -> None:
        """Arms at gym-aloha's start pose (or ``arm_pose``, 14-dim), the spec's cubes resting on the table, the others
        parked; time 0."""
        m, d = self.model, self.data
        mujoco.mj_resetData(m, d)
        self.spec = spec
        self.steps = 0
        self.unstable = False
        pose = START_POSE if arm_pose is None else np.asarray(arm_pose, dtype=np.float64)
        ctrl = self.action_to_ctrl(pose)
        for a, off in (("left", 0), ("right", 8)):
            d.qpos[self.arm_qpos[a]] = ctrl[off:off + 6]
            d.qpos[self.finger_qpos[a]] = ctrl[off + 6]
            d.qpos[self.finger_qpos[a] + 1] = ctrl[off + 7]
        d.ctrl[:] = ctrl
        for i in range(MAX_CUBES):
            q, g, b = self.cube_qpos[i], self.cube_geom[i], self.cube_body[i]
            if i < len(spec.cubes):
                c = spec.cubes[i]
                d.qpos[q:q + 3] = (c.x, c.y, CUBE_HALF)
                d.qpos[q + 3:q + 7] = (np.cos(c.yaw / 2), 0.0, 0.0, np.sin(c.yaw / 2))
                m.geom_rgba[g] = (*COLOURS[c.colour], 1.0)
                m.geom_contype[g] = m.geom_conaffinity[g] = 1
                m.body_gravcomp[b] = 0.0
            else:
                d.qpos[q:q + 3] = _PARK + (0.1 * i, 0.0, 0.0)
                d.qpos[q + 3:q + 7] = (1.0, 0.0, 0.0, 0.0)
                m.geom_rgba[g] = (0.0, 0.0, 0.0, 0.0)
                m.geom_contype[g] = m.geom_conaffinity[g] = 0
                m.body_gravcomp[b] = 1.0
        mujoco.mj_forward(m, d)

    @property
    def time(self) -> float:
        """Sim seconds since reset (control steps x CONTROL_DT, exact)."""
        return self.steps * CONTROL_DT

    def action_to_ctrl(self, action) -> np.ndarray:
        """14-dim action -> the 16 actuator targets (each gripper drives two fingers), clipped to the ctrl ranges."""
        a = np.asarray(action, dtype=np.float64)
        if a.shape != (14,):
            raise ValueError(f"action must have 14 values, got shape {a.shape}")
        if not np.all(np.isfinite(a)):
            raise ValueError("action contains NaN or inf")
        fl, fr = gripper_to_finger(a[6]), gripper_to_finger(a[13])
        ctrl = np.concatenate([a[0:6], [fl, -fl], a[7:13], [fr, -fr]])
        return np.clip(ctrl, self.ctrl_low, self.ctrl_high)

    def step(self, action) -> None:
        """One control step: the actuators' targets from ``action`` (14), then ``substeps`` physics steps.  If the
        physics diverge (MuJoCo's bad-acceleration warning: it then resets the state by itself), ``unstable`` is
        set; the episode runners end the episode as failed."""
        self.data.ctrl[:] = self.action_to_ctrl(action)
        mujoco.mj_step(self.model, self.data, nstep=self.substeps)
        self.steps += 1
        if self.data.warning[mujoco.mjtWarning.mjWARN_BADQACC].number > 0:
            self.unstable = True

    unstable: bool = False

    # ---- observation -----------------------------------------------------------------------------------------------
    def state(self) -> np.ndarray:
        """The 14-dim measured state: joint angles and normalised gripper openings."""
        q = self.data.qpos
        out = np.empty(14)
        for a, off in ARM_OFFSET.items():
            out[off:off + 6] = q[self.arm_qpos[a]]
            out[off + 6] = finger_to_gripper(q[self.finger_qpos[a]])
        return out

    def render(self) -> list[np.ndarray]:
        """One uint8 [h, w, 3] RGB image per camera, in ``self.cameras`` order."""
        if self._renderer is None:
            h, w = self.camera_size
            self._renderer = mujoco.Renderer(self.model, height=h, width=w)
        out = []
        for cam in self.cameras:
            self._renderer.update_scene(self.data, camera=cam)
            out.append(self._renderer.render().copy())
        return out

    def project(self, point, camera: str = "top") -> tuple[float, float, bool]:
        """(u, v, in_view): the pixel where world ``point`` appears in ``camera``'s image at ``camera_size``
        (u = column, v = row, from the top-left corner; the pinhole model MuJoCo renders with)."""
        m, d = self.model, self.data
        cid = m.camera(camera).id
        h, w = self.camera_size
        rel = d.cam_xmat[cid].reshape(3, 3).T @ (np.asarray(point, dtype=np.float64) - d.cam_xpos[cid])
        if rel[2] >= -1e-9:                                  # behind the camera (it looks along its -z axis)
            return float("nan"), float("nan"), False
        f = 0.5 * h / np.tan(np.deg2rad(m.cam_fovy[cid]) / 2)
        u, v = w / 2 + f * rel[0] / -rel[2], h / 2 - f * rel[1] / -rel[2]
        return float(u), float(v), bool(0 <= u < w and 0 <= v < h)

    def close(self) -> None:
        if self._renderer is not None:
            self._renderer.close()
            self._renderer = None

    # ---- physics queries (ground truth for tasks) ------------------------------------------------------------------
    def cube_pos(self, i: int) -> np.ndarray:
        return self.data.xpos[self.cube_body[i]].copy()

    def cube_yaw(self, i: int) -> float:
        w, x, y, z = self.data.xquat[self.cube_body[i]]
        return float(np.arctan2(2 * (w * z + x * y), 1 - 2 * (y * y + z * z)))

    def grip_pos(self, arm: str) -> np.ndarray:
        return self.data.site_xpos[self.grip_site[arm]].copy()

    def contacts(self) -> set[tuple[int, int]]:
        """Geom id pairs in contact now (each pair sorted)."""
        d = self.data
        return {tuple(sorted((int(d.contact[i].geom1), int(d.contact[i].geom2)))) for i in range(d.ncon)}

    def touching(self, geom_a: int, geom_b: int, contacts=None) -> bool:
        return tuple(sorted((geom_a, geom_b))) in (self.contacts() if contacts is None else contacts)
