"""The task family: what a seed draws (scene, target, arm, instruction), when a task has succeeded, and the
ground-truth texts (scene questions with their answers, memory descriptions) computed from the physics state.

This file owns the meaning of an episode.  ``draw_task(task, seed)`` is a pure function of its arguments (the same
seed always gives the same ``TaskSpec``; a test checks seeds differ).  Tasks:

* ``reach``: "touch the red cube with the left gripper" - colour and arm vary; success: a contact between one of that
  gripper's two fingers and that cube.
* ``pick``: "pick up the blue cube" - success: that cube's centre at least ``LIFT`` (5 cm) above its resting height,
  touching a gripper finger (held, not knocked up or propped on an arm), for ``HOLD_S`` (0.5 s) without interruption.  The arm is not named; the expert uses the arm on the cube's side.
* ``transfer``: gym-aloha's transfer-cube task - the right arm picks the cube (on the right half of the table, in
  gym-aloha's x/y range) and hands it to the left arm.  Success (strict): the left gripper *alone* holds the cube off
  the table - both left fingers on it, no right finger, no table contact - for ``HOLD_S`` without interruption.
  gym-aloha's own definition (reward 4: the left gripper's left finger touches the cube while the cube does not touch
  the table, which already fires mid-hand-over) is reported beside it as ``gym_success`` for comparison with others.

Scenes hold 1-3 cubes of distinct colours (red, green, blue, yellow), at least ``MIN_GAP`` apart so an open gripper
around one cube never touches another, yaw within +-45 degrees (a cube looks the same every 90 degrees).
``TaskMonitor`` follows an episode step by step (the pick hold timer) and reports success and gym-aloha's reward
stages.  ``scene_answers`` / ``memory_text`` give the exact strings a policy must produce (see ``QUESTIONS``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from .scene import COLOURS, CUBE_HALF, MAX_CUBES, AlohaScene, Cube, SceneSpec

__all__ = ["TASKS", "TIME_LIMIT_S", "QUESTIONS", "MEMORY_PROMPT", "TaskSpec", "draw_task", "TaskMonitor",
           "scene_facts", "scene_answers", "memory_text", "number_word", "LOCATE_GRID", "locate_question",
           "cube_locations", "located_instruction", "named_colour", "parse_cell"]

TASKS = ("reach", "pick", "transfer")
TIME_LIMIT_S = {"reach": 4.0, "pick": 6.0, "transfer": 8.0}
LIFT = 0.05                       # pick: the cube's centre this far above its resting height ...
HOLD_S = 0.5                      # ... for this long
MIN_GAP = 0.11                    # cube centres at least this far apart (m)
# where cubes are drawn (world x, y; the table top is z = 0, the arms' bases at x = -/+0.469, y = 0.5)
REGION = {"reach": ((-0.15, 0.15), (0.42, 0.66)), "pick": ((-0.15, 0.15), (0.42, 0.66))}
TRANSFER_TARGET = ((0.0, 0.2), (0.4, 0.6))          # gym-aloha's sample_box_pose range
TRANSFER_OTHERS = ((-0.2, -0.06), (0.42, 0.66))
MEMORY_PROMPT = "Describe the scene in one sentence."   # = the node's default memory_prompt
QUESTIONS = ("How many cubes are on the table?",
             "What colour is the cube nearest the left arm?",
             "What colour is the cube nearest the right arm?",
             "Which cube are you holding?")
_WORDS = ("zero", "one", "two", "three", "four")


def number_word(n: int) -> str:
    return _WORDS[n] if 0 <= n < len(_WORDS) else str(n)


@dataclass(frozen=True)
class TaskSpec:
    task: str
    seed: int
    scene: SceneSpec
    target: str                   # colour of the cube the task is about
    arm: str                      # the arm that acts first (reach: the named one; pick: the cube's side;
                                  # transfer: right)
    instruction: str
    time_limit_s: float

    @property
    def target_index(self) -> int:
        return self.scene.cube(self.target)


def _place(rng, n: int, region, taken: list) -> list:
    (x0, x1), (y0, y1) = region
    out = []
    for _ in range(n):
        for _attempt in range(1000):
            p = np.array([rng.uniform(x0, x1), rng.uniform(y0, y1)])
            if all(np.linalg.norm(p - q) >= MIN_GAP for q in taken + out):
                out.append(p)
                break
        else:                                                      # pragma: no cover - the regions are roomy
            raise RuntimeError("could not place the cubes")
    return out


def draw_task(task: str, seed: int) -> TaskSpec:
    """The episode a (task, seed) pair stands for; ValueError for an unknown task."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; known: {list(TASKS)}")
    seed = int(seed)
    rng = np.random.default_rng(np.random.SeedSequence([abs(seed), int(seed < 0), TASKS.index(task)]))
    n = int(rng.integers(1, MAX_CUBES + 1))
    colours = [str(c) for c in rng.permutation(sorted(COLOURS))[:n]]
    if task == "transfer":
        pos = _place(rng, 1, TRANSFER_TARGET, []) + _place(rng, n - 1, TRANSFER_OTHERS, [])
    else:
        pos = _place(rng, n, REGION[task], [])
    yaws = rng.uniform(-np.pi / 4, np.pi / 4, size=n)
    scene = SceneSpec(tuple(Cube(c, float(p[0]), float(p[1]), float(y)) for c, p, y in zip(colours, pos, yaws)))
    target = colours[0] if task == "transfer" else colours[int(rng.integers(n))]
    if task == "reach":
        arm = ("left", "right")[int(rng.integers(2))]
        instruction = f"touch the {target} cube with the {arm} gripper"
    elif task == "pick":
        arm = "left" if scene.cubes[scene.cube(target)].x < 0 else "right"
        instruction = f"pick up the {target} cube"
    else:
        arm = "right"
        instruction = f"transfer the {target} cube from the right arm to the left arm"
    return TaskSpec(task, seed, scene, target, arm, instruction, TIME_LIMIT_S[task])


# ------------------------------------------------------------------------------------------------------------------
# ground truth from the physics state
# ------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SceneFacts:
    """What is true of the scene now, from the physics state."""
    on_table: tuple[str, ...]             # colours of the cubes resting on the table, left to right (world x)
    held: dict                            # arm -> colour of the cube that gripper holds
    nearest: dict                         # arm -> colour of the cube nearest that arm's base


def scene_facts(sim: AlohaScene) -> SceneFacts:
    spec = sim.spec
    contacts = sim.contacts()
    held = {}
    for arm in ("left", "right"):
        fl, fr = sim.finger_geoms[arm]
        for i, c in enumerate(spec.cubes):
            g = sim.cube_geom[i]
            if (sim.touching(g, fl, contacts) and sim.touching(g, fr, contacts)
                    and sim.cube_pos(i)[2] > CUBE_HALF + 0.01):
                held[arm] = c.colour
    held_colours = set(held.values())
    resting = [(sim.cube_pos(i)[0], c.colour) for i, c in enumerate(spec.cubes)
               if c.colour not in held_colours and sim.cube_pos(i)[2] < CUBE_HALF + 0.01]
    nearest = {}
    for arm in ("left", "right"):
        base = sim.arm_base[arm][:2]
        d = [(float(np.linalg.norm(sim.cube_pos(i)[:2] - base)), i) for i in range(len(spec.cubes))]
        nearest[arm] = spec.cubes[min(d)[1]].colour
    return SceneFacts(tuple(c for _, c in sorted(resting)), held, nearest)


def scene_answers(sim: AlohaScene, facts: SceneFacts | None = None) -> dict:
    """question -> ground-truth answer (every entry of ``QUESTIONS``)."""
    f = facts or scene_facts(sim)
    holding = sorted(set(f.held.values()))
    return {QUESTIONS[0]: number_word(len(f.on_table)),
            QUESTIONS[1]: f.nearest["left"],
            QUESTIONS[2]: f.nearest["right"],
            QUESTIONS[3]: f"the {holding[0]} cube" if holding else "none"}


LOCATE_GRID = 8                   # the top camera's image as 8 x 8 cells for "where is ..." answers


def locate_question(colour: str) -> str:
    return f"Where is the {colour} cube?"


def located_instruction(instruction: str, cell: str) -> str:
    """The instruction with the named cube's cell appended - "touch the red cube with the left gripper (row 3 column
    5)": the input of the localisation-conditioning experiment (``oxygen train --locate-in-instruction``, ``oxygen
    sim-eval --locate-prompt``), where the action expert reads the cube's place as text instead of binding the colour
    to pixels itself."""
    return f"{instruction} ({cell})"


def named_colour(instruction: str) -> str | None:
    """The colour of the cube an instruction names ("pick up the red cube" -> "red"), None if it names none."""
    m = re.search(r"\bthe (\w+) cube\b", instruction)
    return m.group(1) if m else None


def parse_cell(text: str | None) -> tuple[int, int] | None:
    """(row, column) of a "row R column C" answer (``cube_locations``' format; surrounding blanks allowed), None for
    anything else ("not in view", a model's malformed text, None)."""
    m = re.fullmatch(r"\s*row (\d+) column (\d+)\s*", text or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def cube_locations(sim: AlohaScene) -> dict:
    """question -> answer for every cube of the scene: the cell of the top camera's image its centre is in,
    "row R column C" (1..LOCATE_GRID, from the top-left), or "not in view".  Training-only text targets (what
    grounding the cubes in the image means, said in words, as pi0.5 co-trains on localisation); not part of
    ``QUESTIONS``, so never scored."""
    h, w = sim.camera_size
    out = {}
    for i, c in enumerate(sim.spec.cubes):
        u, v, seen = sim.project(sim.cube_pos(i), "top")
        out[locate_question(c.colour)] = (f"row {int(v * LOCATE_GRID / h) + 1} column {int(u * LOCATE_GRID / w) + 1}"
                                          if seen else "not in view")
    return out


def _listing(colours) -> str:
    items = [f"a {c} cube" for c in colours]
    if not items:
        return "no cubes"
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def memory_text(sim: AlohaScene, facts: SceneFacts | None = None) -> str:
    """e.g. "a red cube and a blue cube on the table; the left gripper holds the green cube"."""
    f = facts or scene_facts(sim)
    text = f"{_listing(f.on_table)} on the table"
    for arm in ("left", "right"):
        if arm in f.held:
            text += f"; the {arm} gripper holds the {f.held[arm]} cube"
    return text


# ------------------------------------------------------------------------------------------------------------------
# success
# ------------------------------------------------------------------------------------------------------------------
class TaskMonitor:
    """Call ``update()`` after every control step; ``success`` latches when the task's detector fires
    (``gym_success``: transfer's gym-aloha definition, latched likewise; for reach / pick the same as ``success``)."""

    def __init__(self, sim: AlohaScene, spec: TaskSpec):
        self.sim, self.spec = sim, spec
        self.i = spec.target_index
        self.success = False
        self.success_time: float | None = None
        self.reward = 0                   # transfer: gym-aloha's 0..4 stage now; max_reward: the best so far
        self.max_reward = 0
        self._lifted_since: float | None = None
        self._held_since: float | None = None
        self.rest_z = CUBE_HALF
        self.gym_success = False
        self.gym_success_time: float | None = None

    def update(self) -> bool:
        t = self.sim.time
        fire = getattr(self, f"_{self.spec.task}")(t)
        if fire and not self.success:
            self.success, self.success_time = True, t
        gym = self.reward == 4 if self.spec.task == "transfer" else self.success
        if gym and not self.gym_success:
            self.gym_success, self.gym_success_time = True, t
        return self.success

    def _reach(self, t: float) -> bool:
        c = self.sim.contacts()
        g = self.sim.cube_geom[self.i]
        return any(self.sim.touching(g, f, c) for f in self.sim.finger_geoms[self.spec.arm])

    def _pick(self, t: float) -> bool:
        c = self.sim.contacts()
        g = self.sim.cube_geom[self.i]
        held = any(self.sim.touching(g, f, c) for fs in self.sim.finger_geoms.values() for f in fs)
        if held and self.sim.cube_pos(self.i)[2] >= self.rest_z + LIFT:
            if self._lifted_since is None:
                self._lifted_since = t
            return t - self._lifted_since >= HOLD_S - 1e-9
        self._lifted_since = None
        return False

    def _transfer(self, t: float) -> bool:
        c = self.sim.contacts()
        g = self.sim.cube_geom[self.i]
        touch_left = self.sim.touching(g, self.sim.finger_geoms["left"][0], c)
        touch_right = self.sim.touching(g, self.sim.finger_geoms["right"][1], c)
        touch_table = self.sim.touching(g, self.sim.table_geom, c)
        r = 0
        if touch_right:
            r = 2 if not touch_table else 1
        if touch_left:
            r = 4 if not touch_table else 3
        self.reward = r
        self.max_reward = max(self.max_reward, r)
        left = self.sim.finger_geoms["left"]
        alone = (all(self.sim.touching(g, f, c) for f in left) and not touch_table
                 and not any(self.sim.touching(g, f, c) for f in self.sim.finger_geoms["right"]))
        if not alone:
            self._held_since = None
            return False
        if self._held_since is None:
            self._held_since = t
        return t - self._held_since >= HOLD_S - 1e-9

