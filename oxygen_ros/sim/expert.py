"""The scripted expert: per task, a timed plan of gripper poses for each arm, turned into joint targets by inverse
kinematics, served as action chunks.

This file owns how the expert moves.  ``Expert(sim, spec)`` plans at the episode's start from the scene (cube pose,
task, arm): each arm gets ``Waypoint`` s (time, grip-site position, gripper rotation, gripper opening) - approach
above the cube, descend, close, lift (pick), touch (reach), or gym-aloha's hand-over (transfer: the right arm picks
from above and turns the cube sideways at the meeting point in front of the arms, the left arm comes in horizontally
with its fingers closing vertically, closes, the right arm lets go and backs off, as ACT's scripted policy does).
``chunk(t0, H)`` returns the H x 14 action rows for times t0, t0 + dt, ...: poses interpolated between waypoints
(positions linearly, rotations by slerp, the gripper linearly), each arm's joints by ``ArmIK`` warm-started from the
arm's *current* joints (so every chunk is re-solved from the measured state), an arm without a plan holding its start
pose.  Until the grasp begins the cube's waypoints follow the cube's current pose, so a nudged cube is still caught.
The plan depends only on the scene and the clock, never on randomness, so similar scenes give similar motions (a
small policy can imitate it); ``noise`` > 0 adds a seeded, smooth detour on the way to the cube (the policy then
sees recoveries).  The grasp direction is the cube face normal closest to the arm's natural closing direction.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .ik import ArmIK, down_rotation, gripper_frame
from .scene import CONTROL_DT, CUBE_HALF, START_POSE, AlohaScene
from .tasks import TaskSpec

__all__ = ["Expert", "Waypoint", "ArmPlan"]

OPEN, CLOSED = 1.0, 0.0
APPROACH_Z = 0.10                  # above the cube's centre before descending
GRASP_Z = -0.015                      # grip site height above the cube's centre when closing
LIFT_Z = 0.15
REACH_Z = 0.015                    # reach: grip site this far above the cube's centre, fingers around its top
MEET = np.array([0.0, 0.5, 0.25])  # transfer: where the cube is handed over (gym-aloha / ACT's meet point)
TILT = np.deg2rad(60.0)            # transfer: the right gripper's tilt from pointing down at the meeting point


@dataclass
class Waypoint:
    t: float                       # seconds from the episode start
    pos: np.ndarray                # [3] grip site, world
    R: np.ndarray                  # [3, 3] gripper rotation, world
    grip: float                    # 0 closed .. 1 open


def _quat(R: np.ndarray) -> np.ndarray:
    import mujoco  # noqa: PLC0415
    q = np.empty(4)
    mujoco.mju_mat2Quat(q, np.ascontiguousarray(R).reshape(-1))
    return q


def _slerp_R(Ra: np.ndarray, Rb: np.ndarray, u: float) -> np.ndarray:
    import mujoco  # noqa: PLC0415
    qa, qb = _quat(Ra), _quat(Rb)
    if qa @ qb < 0:
        qb = -qb
    dot = float(np.clip(qa @ qb, -1.0, 1.0))
    if dot > 0.9995:
        q = qa + u * (qb - qa)
    else:
        th = np.arccos(dot)
        q = (np.sin((1 - u) * th) * qa + np.sin(u * th) * qb) / np.sin(th)
    q /= np.linalg.norm(q)
    R = np.empty(9)
    mujoco.mju_quat2Mat(R, q)
    return R.reshape(3, 3)


class ArmPlan:
    """Waypoints of one arm; ``at(t)`` interpolates (before the first / after the last: that waypoint)."""

    def __init__(self, waypoints: list[Waypoint]):
        self.w = sorted(waypoints, key=lambda p: p.t)

    def at(self, t: float) -> tuple[np.ndarray, np.ndarray, float]:
        w = self.w
        if t <= w[0].t:
            return w[0].pos, w[0].R, w[0].grip
        for a, b in zip(w, w[1:]):
            if t <= b.t:
                u = (t - a.t) / max(b.t - a.t, 1e-9)
                u = u * u * (3 - 2 * u)                         # smoothstep: zero velocity at each waypoint
                return a.pos + u * (b.pos - a.pos), _slerp_R(a.R, b.R, u), a.grip + u * (b.grip - a.grip)
        return w[-1].pos, w[-1].R, w[-1].grip


def _grasp_yaw(cube_yaw: float, base_xy: np.ndarray, cube_xy: np.ndarray) -> float:
    """The closing direction (yaw, mod pi) among the cube's face normals nearest the arm's natural one (perpendicular
    to the line from the arm's base to the cube)."""
    phi = float(np.arctan2(cube_xy[1] - base_xy[1], cube_xy[0] - base_xy[0]))
    natural = phi + np.pi / 2
    cands = [cube_yaw + k * np.pi / 2 for k in range(-4, 5)]
    return min(cands, key=lambda y: abs(np.angle(np.exp(1j * (y - natural)))))


class Expert:
    def __init__(self, sim: AlohaScene, spec: TaskSpec, noise: float = 0.0, seed: int | None = None):
        self.sim, self.spec = sim, spec
        self.ik = {a: ArmIK(sim, a) for a in ("left", "right")}
        self.noise = float(noise)
        self._rng = np.random.default_rng(spec.seed if seed is None else seed)
        self._detour = {a: self._rng.normal(0.0, 1.0, size=3) for a in ("left", "right")}
        self.t_grasp = 0.0
        self.plans: dict[str, ArmPlan] = {}
        self.replan()

    # ---- planning --------------------------------------------------------------------------------------------------
    def _start(self, arm: str) -> Waypoint:
        q = START_POSE[0:6] if arm == "left" else START_POSE[7:13]
        p, R = self.ik[arm].forward(q)
        return Waypoint(0.0, p, R, float(START_POSE[6 if arm == "left" else 13]))

    def _detoured(self, arm: str, p: np.ndarray) -> np.ndarray:
        if self.noise <= 0:
            return p
        d = self._detour[arm] * self.noise
        return p + np.array([d[0], d[1], abs(d[2])])

    def replan(self) -> None:
        """(Re)build the plans from the cube's current pose (called at start and while the cube may still move)."""
        sim, spec = self.sim, self.spec
        i = spec.target_index
        cube = sim.cube_pos(i)
        cube[2] = CUBE_HALF
        yaw_c = sim.cube_yaw(i)
        arm = spec.arm
        yaw = _grasp_yaw(yaw_c, sim.arm_base[arm][:2], cube[:2])
        down = down_rotation(yaw)
        start = {a: self._start(a) for a in ("left", "right")}
        up = np.array([0.0, 0.0, 1.0])
        plans = {}
        if spec.task in ("reach", "pick"):
            above = cube + up * APPROACH_Z
            w = [start[arm],
                 Waypoint(0.6, self._detoured(arm, 0.5 * (start[arm].pos + above) + up * 0.05), down, OPEN),
                 Waypoint(1.2, above, down, OPEN),
                 Waypoint(1.8, cube + up * (REACH_Z if spec.task == "reach" else GRASP_Z), down, OPEN)]
            if spec.task == "reach":
                w += [Waypoint(2.3, w[-1].pos, down, 0.3)]
                self.t_grasp = 1.8
            else:
                w += [Waypoint(2.3, w[-1].pos, down, CLOSED),
                      Waypoint(3.1, cube + up * LIFT_Z, down, CLOSED)]
                self.t_grasp = 1.8
            plans[arm] = ArmPlan(w)
        else:                                                        # transfer: right picks, hands over to left
            above = cube + up * APPROACH_Z
            closing = down[:, 1]
            # tilted toward the left arm by a pure rotation about the closing axis, by TILT from pointing down (not
            # all the way to horizontal: there the forearm roll and the wrist rotate line up, a singularity the IK
            # would cross with a fast 3-rad flip that throws the cube, as ACT's scripted policy also avoids)
            toward = np.array([-closing[1], closing[0], 0.0])
            toward = toward if toward[0] < 0 else -toward
            tip = np.cos(TILT) * np.array([0.0, 0.0, -1.0]) + np.sin(TILT) * toward
            side = gripper_frame(tip, closing)
            across = np.cross(tip, closing)                  # the held cube's third face normal
            meet = MEET.copy()
            plans["right"] = ArmPlan([
                start["right"],
                Waypoint(0.6, self._detoured("right", 0.5 * (start["right"].pos + above) + up * 0.05), down, OPEN),
                Waypoint(1.2, above, down, OPEN),
                Waypoint(1.8, cube + up * GRASP_Z, down, OPEN),
                Waypoint(2.3, cube + up * GRASP_Z, down, CLOSED),
                Waypoint(2.8, cube + up * LIFT_Z, down, CLOSED),
                Waypoint(3.8, meet, side, CLOSED),
                Waypoint(5.0, meet, side, CLOSED),
                Waypoint(5.4, meet, side, OPEN),
                Waypoint(6.0, meet - tip * 0.10 + up * 0.02, side, OPEN)])
            vert = gripper_frame(-tip, across)               # facing the right gripper's tips, closing on free faces
            plans["left"] = ArmPlan([
                start["left"],
                Waypoint(2.8, start["left"].pos, start["left"].R, OPEN),
                Waypoint(3.8, meet + tip * 0.12, vert, OPEN),
                Waypoint(4.4, meet + tip * 0.005, vert, OPEN),
                Waypoint(4.9, meet + tip * 0.005, vert, CLOSED),
                Waypoint(5.4, meet + tip * 0.005, vert, CLOSED),
                Waypoint(6.2, meet + tip * 0.08 - up * 0.02, vert, CLOSED)])
            self.t_grasp = 1.8
        self.plans = plans

    # ---- acting ----------------------------------------------------------------------------------------------------
    def chunk(self, t0: float, horizon: int, dt: float = CONTROL_DT) -> np.ndarray:
        """Action rows [horizon, 14] for times t0 + i * dt (episode time)."""
        if t0 < self.t_grasp:
            self.replan()
        state = self.sim.state()
        out = np.tile(START_POSE, (horizon, 1))
        for arm, off in (("left", 0), ("right", 7)):
            plan = self.plans.get(arm)
            if plan is None:
                continue
            q = state[off:off + 6].copy()
            for i in range(horizon):
                pos, R, grip = plan.at(t0 + i * dt)
                q = self.ik[arm].solve(q, pos, R)
                out[i, off:off + 6] = q
                out[i, off + 6] = grip
        return out


class ExpertEngine:
    """The expert behind the node's engine interface, so that its chunks travel the policy's own action path
    (``ros/pipeline.py``: action space, chunk buffer, chunking, limits, trajectory building).  ``cycle(observation)``
    plans H rows for the times the chunk's rows will be executed - from ``ready_time()`` (episode seconds, the
    simulated moment the chunk becomes ready: capture + the modelled inference delay) on - from the privileged sim
    state, and hands them to ``on_actions`` as ``engine/engine.py`` does.  It answers no language requests
    (``submit`` raises; the pipeline reports them rejected)."""

    def __init__(self, expert: Expert, horizon: int, ready_time, *, on_actions, on_token=None, on_finished=None):
        from oxygen_ros.engine.requests import ActionResult  # noqa: PLC0415 - ROS-free, torch-free dataclass

        self._ActionResult = ActionResult
        self.expert, self.horizon, self.ready_time = expert, int(horizon), ready_time
        self.on_actions = on_actions
        self.frame_index = 0
        self.chunks = 0

    def cycle(self, observation, rtc=None) -> dict:
        rows = self.expert.chunk(float(self.ready_time()), self.horizon).astype(np.float32)
        fi = self.frame_index
        self.frame_index += 1
        self.chunks += 1
        self.on_actions(self._ActionResult(fi, fi, float(observation.stamp), rows, 0.0))
        return {"frame_index": fi}

    def submit(self, kind: str, prompt: str = "", *args, **kwargs) -> int:
        raise ValueError("the scripted expert answers no language requests")

    def cancel(self, request_id: int) -> bool:
        return False

    def metrics(self) -> dict:
        return {"mode": "expert", "chunks": self.chunks}
