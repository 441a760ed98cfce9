"""The scripted expert: a state-driven feedback controller that can label any state of the simulation.

This file owns how the expert moves.  ``Expert(sim, spec)`` reads the world *now* (each arm's grip-site pose from its
measured joints, its gripper opening, which fingers touch the task's cube, the cube's pose) and decides every arm's
goal from that alone - never from the episode clock - so the same observation always gets the same label and a state
off the expert's own path (a policy's, a perturbed one) gets the chunk a good operator would command from there
(DAgger).  Per task, in priority order (``_goals``):

* ``reach``: touching the cube with the named gripper -> stay, fingers half closed; at the touch point (grip site
  ``REACH_Z`` above the cube's centre, pointing down, fingers across the cube's faces) -> close to ``G_TOUCH``;
  else approach it (gripper open).
* ``pick``: holding the cube (both fingers on it) -> lift to ``LIFT_Z``; at the grasp point -> close; else approach.
* ``transfer`` (gym-aloha's hand-over, as ACT's scripted policy does it): the left gripper holds the cube and the
  right one is open -> the right backs off, the left keeps it; the left holds it -> the right opens; the right holds
  the lifted cube -> it carries it to ``MEET``, turning it sideways (``TILT``), while the left waits at its
  pre-grasp point and, once the cube is there, moves in along the cube's free axis and closes; the right holds it
  low -> lift; otherwise the right picks it (as ``pick``) and the left waits at its start pose, open.

An approach moves the grip site toward a *shaped* target: the goal raised by up to ``APPROACH_Z`` in proportion to
the remaining horizontal distance (a steep funnel), so the arm comes down onto the cube along a smooth curve
without stopping at intermediate points; speed is capped at ``SPEED`` and falls near the goal (distance / ``SETTLE_S``),
rotation at ``TURN``.  The fingers close across the arm's natural direction while the grip site is far from the
cube and turn to the cube's faces only within ``ALIGN_FROM`` -> ``ALIGN_AT`` of it (the face follows the cube's yaw mod
90 degrees, which the wrist cameras show from close up and the top camera barely does).  "At" a point means within
``AT`` (wider once the fingers have started to close, so a cube nudged by the closing fingers does not reopen them).
``chunk(H)`` decides the goals once from the measured world (a phase
changes only when the robot is seen to be there: never on a prediction) and moves toward them kinematically for H
rows (an approach re-shaped from each row's position, a held cube moving with its gripper), starting ``LEAD``
control steps ahead of the measured pose (the position servos trail their commands by a few steps), each row's
poses turned into joints by ``ArmIK`` warm-started from the previous row.  An arm with nothing to do returns to its start pose at ``JOINT_SPEED``.
``ExpertEngine`` serves the chunks through the node's engine slot; with ``noise`` > 0 it adds a seeded, smooth
perturbation of the arm joints to what is *executed* (DART-style: the robot strays, the expert corrects, and a
recorder labels each frame with the clean ``chunk``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .ik import ArmIK, _rotvec, down_rotation, gripper_frame
from .scene import ARM_OFFSET, ARMS, CONTROL_DT, CUBE_HALF, START_POSE, AlohaScene
from .tasks import TaskSpec

__all__ = ["Expert", "ExpertEngine", "Goal", "ArmState", "World", "Perturbation"]

SPEED = 0.30                       # m/s: grip-site speed cap
TURN = 2.5                         # rad/s: gripper rotation cap
SETTLE_S = 0.12                    # near a goal the speed is distance / SETTLE_S (no overshoot, no stop-and-go)
JOINT_SPEED = 1.0                  # rad/s: an idle arm returning to its start pose
LEAD = 3                           # control steps the first row leads the measured pose (servo tracking lag)
AT = 0.01                          # m: at a point (fingers open)
AT_CLOSING = 0.025                 # m: at a point once the fingers are closing
APPROACH_Z = 0.10                  # max height of the approach funnel above the goal ...
FUNNEL = 4.0                       # ... which is FUNNEL x the horizontal distance from it (a steep funnel: the
                                   # fingers come down around the cube only once they are over it)
HELD_DIST = 0.03                   # m: a cube this close to the grip site is between the finger pads
FAR_FROM, FAR_FULL = 0.45, 0.62    # m from the arm's base: beyond FAR_FROM the gripper tilts outward, FAR_TILT at
FAR_TILT = np.deg2rad(40.0)        # FAR_FULL (reach's far arm: the cube across the table)
ALIGN_FROM, ALIGN_AT = 0.08, 0.03  # m, grip site to cube (horizontal): farther than ALIGN_FROM the fingers close across
                                   # the arm's natural direction; within ALIGN_AT across the cube's faces; turned in
                                   # between.  The face depends on the cube's yaw mod 90 deg, which the top camera
                                   # barely shows (a 6 px cube) and the wrist cameras show from close up: turning early
                                   # made the first chunks a function of what the policy could not see (the card).
GRASP_Z = 0.0                      # grip site height above the cube's centre when closing (pick, transfer): the
                                   # lowest the finger tips allow (they touch the table with the site at ~1.9 cm)
REACH_Z = 0.015                    # reach: grip site this far above the cube's centre, fingers around its top
LIFT_Z = 0.15                      # lift the cube's centre this far above its resting height
LIFTED = 0.03                      # the cube counts as lifted this far above its resting height
G_OPEN, G_CLOSED, G_TOUCH = 1.0, 0.0, 0.3
OPENED = 0.85                      # gripper opening at which it counts as open
HOLD_OPENING = 0.62                # a gripper closing on a 4 cm cube stops at ~0.60 (empty: ~0.10)
GRIP_RATE = 0.12                   # per control step, the opening moves this fraction toward its command
MEET = np.array([0.0, 0.5, 0.25])  # transfer: where the cube is handed over (gym-aloha / ACT's meet point)
TILT = np.deg2rad(60.0)            # transfer: the right gripper's tilt from pointing down at the meeting point
MEET_TOL = 0.03                    # m: the right gripper is at the meeting point (the IK's compromise between
MEET_TURN_TOL = 0.35               # rad: ... position and turn may leave it a little off both)
PRE_HANDOVER = 0.07                # m: the left gripper waits this far out along the right gripper's axis (further
                                   # out its wrist would reach its limit) and comes in along that axis ...
HANDOVER_IN = 0.005                # m: ... closing with its grip site this far out
HANDOVER_FUNNEL = 1.5              # a wider funnel than from above: the left arm rarely gets exactly onto the axis
HANDOVER_AT = 0.02                 # m: ... nor exactly to the grasp point (its wrist near its limit); the open
                                   # fingers straddle the cube from this close
BACK_OFF = 0.10                    # m: after the hand-over the right gripper backs off along its axis


@dataclass
class ArmState:
    pos: np.ndarray                # [3] grip site, world
    R: np.ndarray                  # [3, 3] gripper rotation
    opening: float                 # 0 closed .. 1 open (the state's gripper column)
    holding: bool                  # both fingers touch the task's cube
    touching: bool                 # at least one finger touches it
    q: np.ndarray                  # [6] arm joints


@dataclass
class World:
    arms: dict                     # "left" / "right" -> ArmState
    cube: np.ndarray               # [3] the task's cube centre
    cube_yaw: float
    rest_z: float = CUBE_HALF      # the cube's centre height when resting on the table

    @property
    def lifted(self) -> bool:
        return float(self.cube[2]) > self.rest_z + LIFTED

    def copy(self) -> "World":
        arms = {a: ArmState(s.pos.copy(), s.R.copy(), s.opening, s.holding, s.touching, s.q.copy())
                for a, s in self.arms.items()}
        return World(arms, self.cube.copy(), self.cube_yaw, self.rest_z)


@dataclass
class Goal:
    phase: str                     # a name for traces and tests
    grip: float                    # gripper command
    pos: np.ndarray | None = None  # [3] grip-site target (already shaped); None = joint-space goal ``q``
    R: np.ndarray | None = None    # [3, 3]
    q: np.ndarray | None = None    # [6] joints (an idle arm's start pose)
    cone: tuple | None = None      # (goal point, axis, height): ``pos`` is re-shaped from the arm's position each row

    def target(self, pos: np.ndarray) -> np.ndarray:
        return _cone(pos, *self.cone) if self.cone is not None else self.pos


def _rotate_toward(R: np.ndarray, R_goal: np.ndarray, max_angle: float) -> np.ndarray:
    """R turned toward R_goal by at most ``max_angle`` (rad) about the shortest axis."""
    rv = _rotvec(R_goal @ R.T)
    ang = float(np.linalg.norm(rv))
    if ang <= max_angle:
        return R_goal.copy()
    k = rv / ang
    a = max_angle
    K = np.array([[0, -k[2], k[1]], [k[2], 0, -k[0]], [-k[1], k[0], 0]])
    return (np.eye(3) + np.sin(a) * K + (1 - np.cos(a)) * K @ K) @ R


def _angle(Ra: np.ndarray, Rb: np.ndarray) -> float:
    return float(np.linalg.norm(_rotvec(Rb @ Ra.T)))


def _natural_yaw(base_xy: np.ndarray, cube_xy: np.ndarray) -> float:
    """The arm's natural closing direction (yaw): perpendicular to the line from its base to the cube."""
    return float(np.arctan2(cube_xy[1] - base_xy[1], cube_xy[0] - base_xy[0])) + np.pi / 2


def _grasp_yaw(cube_yaw: float, base_xy: np.ndarray, cube_xy: np.ndarray) -> float:
    """The closing direction (yaw, mod pi) among the cube's face normals nearest the arm's natural one (perpendicular
    to the line from the arm's base to the cube)."""
    natural = _natural_yaw(base_xy, cube_xy)
    cands = [cube_yaw + k * np.pi / 2 for k in range(-4, 5)]
    return min(cands, key=lambda y: abs(np.angle(np.exp(1j * (y - natural)))))


def _cone(pos: np.ndarray, goal: np.ndarray, axis: np.ndarray, height: float, funnel: float = FUNNEL) -> np.ndarray:
    """The shaped approach target: ``goal`` moved out along ``axis`` by ``funnel`` x the distance from ``pos`` to the
    line through ``goal`` along ``axis`` (at most ``height``): the arm arrives along the axis, on a curve, without
    stopping."""
    d = pos - goal
    off = float(np.linalg.norm(d - axis * (d @ axis)))
    return goal + axis * min(height, funnel * off)


class Expert:
    def __init__(self, sim: AlohaScene, spec: TaskSpec, noise: float = 0.0, seed: int | None = None):
        self.sim, self.spec = sim, spec
        self.ik = {a: ArmIK(sim, a) for a in ARMS}
        self.noise = float(noise)                    # kept for ExpertEngine's perturbation (the labels are clean)
        self.seed = spec.seed if seed is None else int(seed)
        self.i = spec.target_index
        self.start_q = {"left": START_POSE[0:6].copy(), "right": START_POSE[7:13].copy()}
        self.last_phases: dict = {}
        self._transfer_frames()

    # ---- the world, read from the simulation -----------------------------------------------------------------------
    def world(self) -> World:
        sim, i = self.sim, self.i
        state = sim.state()
        contacts = sim.contacts()
        g = sim.cube_geom[i]
        arms = {}
        for a, off in ARM_OFFSET.items():
            q = state[off:off + 6].copy()
            p, R = self.ik[a].forward(q)
            fl, fr = sim.finger_geoms[a]
            tl, tr = sim.touching(g, fl, contacts), sim.touching(g, fr, contacts)
            opening = float(state[off + 6])
            between = float(np.linalg.norm(p - sim.cube_pos(i))) < HELD_DIST     # the cube between the pads
            holding = between and ((tl and tr) or ((tl or tr) and opening < HOLD_OPENING + 0.1))
            arms[a] = ArmState(p, R, opening, holding, tl or tr, q)
        return World(arms, sim.cube_pos(i), sim.cube_yaw(i))

    # ---- decisions -------------------------------------------------------------------------------------------------
    def _down(self, w: World, arm: str) -> np.ndarray:
        """Pointing down at the cube, fingers across two faces once near it (``ALIGN_AT``; across the arm's natural
        direction while far, ``ALIGN_FROM``); a cube far from the arm's base is approached with the gripper tilted
        outward about its closing axis (up to ``FAR_TILT``), or the wrist could not reach it."""
        base = self.sim.arm_base[arm][:2]
        natural = _natural_yaw(base, w.cube[:2])
        face = _grasp_yaw(w.cube_yaw, base, w.cube[:2])
        near = float(np.linalg.norm(w.arms[arm].pos[:2] - w.cube[:2]))
        k = float(np.clip((ALIGN_FROM - near) / (ALIGN_FROM - ALIGN_AT), 0.0, 1.0))
        R = down_rotation(natural + k * float(np.angle(np.exp(1j * (face - natural)))))
        out = w.cube[:2] - base
        d = float(np.linalg.norm(out))
        tilt = FAR_TILT * float(np.clip((d - FAR_FROM) / (FAR_FULL - FAR_FROM), 0.0, 1.0))
        if tilt <= 0.0:
            return R
        fwd = np.cos(tilt) * np.array([0.0, 0.0, -1.0]) + np.sin(tilt) * np.array([out[0], out[1], 0.0]) / d
        return gripper_frame(fwd, R[:, 1])

    def _idle(self, arm: str, grip: float = G_OPEN) -> Goal:
        return Goal("idle", grip, q=self.start_q[arm])

    def _at(self, s: ArmState, point: np.ndarray) -> bool:
        return float(np.linalg.norm(s.pos - point)) < (AT if s.opening > OPENED else AT_CLOSING)

    def _pick_goal(self, w: World, arm: str, point_z: float, close_to: float) -> Goal:
        """Approach a point ``point_z`` above the cube's centre from above and close the gripper to ``close_to``
        there; once holding, lift."""
        s = w.arms[arm]
        R = self._down(w, arm)
        if s.holding and close_to == G_CLOSED:
            lift = np.array([s.pos[0], s.pos[1], w.rest_z + LIFT_Z + point_z])
            return Goal("lift", G_CLOSED, lift, R)
        point = w.cube + np.array([0.0, 0.0, point_z])
        if self._at(s, point):
            return Goal("close", close_to, point, R)
        return Goal("approach", G_OPEN, point, R, cone=(point, np.array([0.0, 0.0, 1.0]), APPROACH_Z))

    def _transfer_frames(self) -> None:
        """The hand-over geometry (as ACT's scripted policy, in the arms' common plane y = 0.5 where both reach it
        exactly): the right gripper at ``MEET`` closing along world y (the sign nearest its grasp's closing axis, so
        the wrist turns the least), tilted by ``TILT`` from pointing down toward the left arm; the left gripper facing
        its tips, closing on the cube's free faces."""
        if self.spec.task != "transfer":
            return
        cube = self.spec.scene.cubes[self.i]
        yaw = _grasp_yaw(cube.yaw, self.sim.arm_base["right"][:2], np.array([cube.x, cube.y]))
        closing = np.array([0.0, 1.0 if np.sin(yaw) >= 0 else -1.0, 0.0])
        self.tip = np.cos(TILT) * np.array([0.0, 0.0, -1.0]) + np.sin(TILT) * np.array([-1.0, 0.0, 0.0])
        self.side = gripper_frame(self.tip, closing)
        self.vert = gripper_frame(-self.tip, np.cross(self.tip, closing))
        self.grasp_l, self.pre_l = self._handover(MEET)      # where the left waits, and keeps the cube

    def _handover(self, cube: np.ndarray) -> tuple:
        """(grasp point, pre-grasp point) of the left gripper for the cube held by the right gripper (turned as
        ``side``): facing the right gripper's tips, closing on the cube's free faces, coming in along the axis."""
        grasp = cube + self.tip * HANDOVER_IN
        return grasp, grasp + self.tip * PRE_HANDOVER

    def _transfer_goals(self, w: World) -> dict:
        r, l = w.arms["right"], w.arms["left"]
        up = np.array([0.0, 0.0, 1.0])
        if l.holding and r.opening > OPENED:
            return {"right": Goal("back off", G_OPEN, MEET - self.tip * BACK_OFF + up * 0.02, self.side),
                    "left": Goal("keep", G_CLOSED, self.grasp_l, self.vert)}
        if l.holding:
            return {"right": Goal("release", G_OPEN, MEET.copy(), self.side),
                    "left": Goal("keep", G_CLOSED, self.grasp_l, self.vert)}
        if r.holding and w.lifted:
            right = Goal("carry", G_CLOSED, MEET.copy(), self.side)
            there = np.linalg.norm(r.pos - MEET) < MEET_TOL and _angle(r.R, self.side) < MEET_TURN_TOL
            if not there:
                return {"right": right, "left": Goal("wait", G_OPEN, self.pre_l, self.vert)}
            grasp, _ = self._handover(w.cube)
            if np.linalg.norm(l.pos - grasp) < (HANDOVER_AT if l.opening > OPENED else AT_CLOSING):
                return {"right": right, "left": Goal("close", G_CLOSED, grasp, self.vert)}
            return {"right": right, "left": Goal("approach", G_OPEN, grasp, self.vert,
                                                  cone=(grasp, self.tip, PRE_HANDOVER, HANDOVER_FUNNEL))}
        if r.holding:
            return {"right": self._pick_goal(w, "right", GRASP_Z, G_CLOSED),
                    "left": Goal("wait", G_OPEN, self.pre_l, self.vert)}
        return {"right": self._pick_goal(w, "right", GRASP_Z, G_CLOSED), "left": self._idle("left")}

    def goals(self, w: World) -> dict:
        """arm -> Goal for the world ``w``: the expert's whole decision, a function of ``w`` only."""
        task, arm = self.spec.task, self.spec.arm
        other = "left" if arm == "right" else "right"
        if task == "transfer":
            return self._transfer_goals(w)
        if task == "reach":
            s = w.arms[arm]
            if s.touching:
                g = Goal("touch", G_TOUCH, w.cube + np.array([0.0, 0.0, REACH_Z]), self._down(w, arm))
            else:
                g = self._pick_goal(w, arm, REACH_Z, G_TOUCH)
        else:
            g = self._pick_goal(w, arm, GRASP_Z, G_CLOSED)
        return {arm: g, other: self._idle(other)}

    # ---- the kinematic roll-out -> a chunk -------------------------------------------------------------------------
    @staticmethod
    def _advance(w: World, goals: dict, dt: float) -> None:
        """One control step of the world as the expert expects it: each arm's grip site moves toward its goal (speed
        and turn limits; an approach re-shaped from where the arm is), a held cube with it."""
        for a, g in goals.items():
            s = w.arms[a]
            if g.pos is None:
                continue
            carried = w.cube - s.pos if s.holding else None
            d = g.target(s.pos) - s.pos
            dist = float(np.linalg.norm(d))
            if dist > 1e-9:
                s.pos = s.pos + d / dist * min(dist, min(SPEED, dist / SETTLE_S) * dt)
            s.R = _rotate_toward(s.R, g.R, TURN * dt)
            if carried is not None:
                w.cube = s.pos + carried

    def chunk(self, horizon: int, ahead_steps: int = 0, dt: float = CONTROL_DT) -> np.ndarray:
        """Action rows [horizon, 14] for the control steps from ``ahead_steps`` on (0 = the next step), from the
        simulation's state now."""
        w = self.world()
        out = np.tile(START_POSE, (horizon, 1))
        q = {a: w.arms[a].q.copy() for a in ARMS}
        skip = LEAD + int(ahead_steps)
        goals = self.goals(w)                      # decided once, from the measured world (never from a prediction)
        self.last_phases = {a: g.phase for a, g in goals.items()}
        for i in range(skip + horizon):
            self._advance(w, goals, dt)
            for a, off in ARM_OFFSET.items():
                g = goals[a]
                if g.q is not None:                             # joint-space goal: bounded joint speed
                    step = np.clip(g.q - q[a], -JOINT_SPEED * dt, JOINT_SPEED * dt)
                    q[a] = q[a] + step
                    w.arms[a].pos, w.arms[a].R = self.ik[a].forward(q[a])
                else:                                           # warm-started from the previous row: one branch
                    q[a] = self.ik[a].solve(q[a], w.arms[a].pos, w.arms[a].R)
                if i >= skip:
                    out[i - skip, off:off + 6] = q[a]
                    out[i - skip, off + 6] = g.grip
        return out

    def phases(self) -> dict:
        """arm -> the phase the expert is in now (for traces)."""
        return {a: g.phase for a, g in self.goals(self.world()).items()}


class Perturbation:
    """A seeded, smooth offset of the 12 arm joints over time (sum of three sines per joint, amplitude ``scale``
    rad, 0.2-0.8 Hz), zero for the grippers: what DART-style data collection adds to the expert's executed
    commands."""

    def __init__(self, scale: float, seed: int):
        rng = np.random.default_rng(np.random.SeedSequence([abs(int(seed)), 7]))
        self.scale = float(scale)
        self.amp = rng.normal(0.0, 1.0 / np.sqrt(3.0), size=(3, 14))
        self.amp[:, [6, 13]] = 0.0
        self.freq = rng.uniform(0.2, 0.8, size=(3, 14))
        self.phase = rng.uniform(0.0, 2 * np.pi, size=(3, 14))

    def __call__(self, t) -> np.ndarray:
        t = np.asarray(t, dtype=np.float64)[..., None, None]
        return self.scale * np.sum(self.amp * np.sin(2 * np.pi * self.freq * t + self.phase), axis=-2)


class ExpertEngine:
    """The expert behind the node's engine interface, so that its chunks travel the policy's own action path
    (``ros/pipeline.py``: action space, chunk buffer, chunking, limits, trajectory building).  ``cycle(observation)``
    plans H rows for the control steps the chunk will be executed - from ``ready_time()`` (episode seconds, the
    simulated moment the chunk becomes ready: capture + the modelled inference delay) on - from the privileged sim
    state, adds the perturbation when ``expert.noise`` > 0, and hands them to ``on_actions`` as
    ``engine/engine.py`` does.  It answers no language requests (``submit`` raises; the pipeline reports them
    rejected)."""

    def __init__(self, expert: Expert, horizon: int, ready_time, *, on_actions, on_token=None, on_finished=None):
        from oxygen_ros.engine.requests import ActionResult  # noqa: PLC0415 - ROS-free, torch-free dataclass

        self._ActionResult = ActionResult
        self.expert, self.horizon, self.ready_time = expert, int(horizon), ready_time
        self.on_actions = on_actions
        self.perturb = Perturbation(expert.noise, expert.seed) if expert.noise > 0 else None
        self.frame_index = 0
        self.chunks = 0

    def cycle(self, observation, rtc=None) -> dict:
        ready = float(self.ready_time())
        now = self.expert.sim.time
        ahead = max(0, int(round((ready - now) / CONTROL_DT)))
        rows = self.expert.chunk(self.horizon, ahead)
        if self.perturb is not None:
            rows = rows + self.perturb(ready + CONTROL_DT * np.arange(self.horizon))
        fi = self.frame_index
        self.frame_index += 1
        self.chunks += 1
        self.on_actions(self._ActionResult(fi, fi, float(observation.stamp), rows.astype(np.float32), 0.0))
        return {"frame_index": fi}

    def submit(self, kind: str, prompt: str = "", *args, **kwargs) -> int:
        raise ValueError("the scripted expert answers no language requests")

    def cancel(self, request_id: int) -> bool:
        return False

    def metrics(self) -> dict:
        return {"mode": "expert", "chunks": self.chunks}
