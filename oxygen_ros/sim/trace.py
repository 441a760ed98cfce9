"""Where and why an episode fails: a per-step trace of the task's progress, its summary, and plots across episodes.

This file owns the diagnosis of closed-loop episodes (``oxygen sim-eval --trace``).  ``EpisodeTracer(sim, spec)``
is an ``on_step`` hook of ``sim/episode.py``; at every control step it records the distance from the task's gripper
(the named arm; transfer: the right arm until the cube is lifted, then the left) to the target cube, the arm's joint
speed, the gripper opening, the cube's height and the *phase* the world is in.  Phases are read with the scripted
expert's own state-driven decision (``Expert.goals`` on the measured world, never a clock), mapped onto each task's
ordered milestones (``MILESTONES``): reach = approach, at the cube, touching; pick = approach, at the cube, holding,
lifted; transfer = approach, at the cube, holding, carried to the meeting point, the left gripper coming in, closing,
holding it, alone.  ``summary()`` gives the furthest milestone reached, the distance at start / minimum / end, and the
*stalls*: stretches longer than ``STALL_S`` where the arm stands still (its fastest joint under ``STILL_RAD_S``) while
the task is unfinished, each with the milestone it stalled at and the distance there.  ``plot_traces`` draws distance
over time for every episode (successes and failures apart, stalls marked) and a histogram of the milestones reached.
Pure numpy + the simulation; matplotlib only in ``plot_traces``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .expert import MEET, Expert
from .scene import ARM_OFFSET, CONTROL_DT, AlohaScene
from .tasks import TaskSpec

__all__ = ["MILESTONES", "STALL_S", "STILL_RAD_S", "EpisodeTracer", "plot_traces"]

STALL_S = 0.3                     # standing still this long while unfinished = a stall
STILL_RAD_S = 0.05                # the arm's fastest joint below this = standing still
MILESTONES = {
    "reach": ("approach", "at cube", "touching"),
    "pick": ("approach", "at cube", "holding", "lifted"),
    "transfer": ("approach", "at cube", "holding", "at meeting point", "left coming in", "left closing",
                 "left holding", "left alone"),
}
_PICK = {"approach": 0, "close": 1, "touch": 2, "lift": 2}
_TRANSFER_LEFT = {"approach": 4, "close": 5, "keep": 6}


@dataclass
class EpisodeTracer:
    sim: AlohaScene
    spec: TaskSpec
    every: int = 1                                   # record every n-th step (1 = all)
    t: list = field(default_factory=list)
    dist: list = field(default_factory=list)         # m, the acting gripper's grip site to the cube's centre
    speed: list = field(default_factory=list)        # rad/s, the acting arm's fastest joint
    opening: list = field(default_factory=list)      # the acting gripper's opening (0 closed .. 1 open)
    cube_z: list = field(default_factory=list)       # m
    milestone: list = field(default_factory=list)    # index into MILESTONES[task]
    success: bool = False

    def __post_init__(self):
        self._expert = Expert(self.sim, self.spec)
        self._prev: np.ndarray | None = None
        self._n = 0

    def _milestone(self, w, goals) -> int:
        task = self.spec.task
        if task == "reach":
            return _PICK[goals[self.spec.arm].phase]
        if task == "pick":
            m = _PICK[goals[self.spec.arm].phase]
            return 3 if m == 2 and w.lifted else m
        left, right = goals["left"].phase, goals["right"].phase
        if right == "back off":
            return 7
        if left in _TRANSFER_LEFT:
            return _TRANSFER_LEFT[left]
        if right == "carry":
            return 3 if np.linalg.norm(w.arms["right"].pos - MEET) < 0.03 else 2
        return _PICK[right]

    def on_step(self, t: float, state, cmd, monitor) -> None:
        """``sim/episode.py`` hook: called with the state before each control step's command."""
        state = np.asarray(state, dtype=np.float64)
        w = self._expert.world()
        goals = self._expert.goals(w)
        arm = self.spec.arm
        if self.spec.task == "transfer" and w.lifted:
            arm = "left"
        off = ARM_OFFSET[arm]
        v = 0.0 if self._prev is None else float(np.abs(state[off:off + 6] - self._prev[off:off + 6]).max()) / CONTROL_DT
        self._prev = state
        self.success = self.success or bool(monitor.success)
        self._n += 1
        if (self._n - 1) % self.every:
            return
        self.t.append(float(t))
        self.dist.append(float(np.linalg.norm(w.arms[arm].pos - w.cube)))
        self.speed.append(v)
        self.opening.append(float(state[off + 6]))
        self.cube_z.append(float(w.cube[2]))
        self.milestone.append(self._milestone(w, goals))

    # ---- summary ---------------------------------------------------------------------------------------------------
    def stalls(self) -> list[dict]:
        """Stretches of at least ``STALL_S`` with the acting arm still, before success."""
        out, start = [], None
        dt = CONTROL_DT * self.every
        names = MILESTONES[self.spec.task]
        for k, v in enumerate(self.speed + [np.inf]):
            still = v < STILL_RAD_S and k > 0
            if still and start is None:
                start = k
            elif not still and start is not None:
                if (k - start) * dt >= STALL_S - 1e-9:
                    i = start
                    out.append({"t": self.t[i], "duration_s": round((k - start) * dt, 3),
                                "milestone": names[self.milestone[i]], "dist": round(self.dist[i], 4)})
                start = None
        if self.success and out:                       # standing still after success is not a stall
            out = [s for s in out if s["t"] < self.t[-1] - s["duration_s"]]
        return out

    def summary(self, success: bool | None = None) -> dict:
        """``success``: the episode's outcome (``EpisodeResult.success``).  ``on_step`` sees each step *before* it runs,
        so the step that completes the task is never traced; a successful episode has reached its task's last
        milestone by definition (reach: the named gripper touches the cube - a finger from the side counts, whatever
        the expert's phase reads; pick: lifted; transfer: the left gripper alone)."""
        names = MILESTONES[self.spec.task]
        if success is not None:
            self.success = bool(success)
        if not self.t:
            return {"milestone": names[-1 if self.success else 0],
                    "milestone_index": len(names) - 1 if self.success else 0, "stalls": []}
        reached = len(names) - 1 if self.success else int(max(self.milestone))
        return {"milestone": names[reached], "milestone_index": reached,
                "dist_start": round(self.dist[0], 4), "dist_min": round(float(min(self.dist)), 4),
                "dist_end": round(self.dist[-1], 4), "stalls": self.stalls(),
                "still_s": round(sum(s["duration_s"] for s in self.stalls()), 3)}

    def series(self, every_s: float = 0.1) -> dict:
        """The trace downsampled to one point per ``every_s`` (for results files and plots)."""
        k = max(1, int(round(every_s / (CONTROL_DT * self.every))))
        return {"t": self.t[::k], "dist": [round(x, 4) for x in self.dist[::k]],
                "milestone": self.milestone[::k], "speed": [round(x, 3) for x in self.speed[::k]]}


def plot_traces(episodes: list[dict], path) -> str | None:
    """Distance over time (one line per episode; failures red, successes green; stalls as dots) and the milestones
    reached per task.  ``episodes``: dicts with task, success, trace (``series()``) and trace_summary."""
    eps = [e for e in episodes if e.get("trace")]
    if not eps:
        return None
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    tasks = sorted({e["task"] for e in eps}, key=list(MILESTONES).index)
    fig, axes = plt.subplots(2, len(tasks), figsize=(5 * len(tasks), 7), squeeze=False)
    for j, task in enumerate(tasks):
        te = [e for e in eps if e["task"] == task]
        ax = axes[0, j]
        for e in te:
            tr = e["trace"]
            ax.plot(tr["t"], tr["dist"], color="tab:green" if e["success"] else "tab:red", alpha=0.35, lw=1)
            for s in e.get("trace_summary", {}).get("stalls", []):
                ax.plot([s["t"]], [s["dist"]], "k.", ms=4)
        ax.set_title(f"{task}: {sum(e['success'] for e in te)}/{len(te)} succeed (black: stalls)")
        ax.set_xlabel("sim time (s)")
        ax.set_ylabel("gripper to cube (m)")
        ax.grid(alpha=0.3)
        names = MILESTONES[task]
        counts = np.bincount([e["trace_summary"]["milestone_index"] for e in te], minlength=len(names))
        ax = axes[1, j]
        ax.barh(range(len(names)), counts, color="tab:blue")
        ax.set_yticks(range(len(names)), names)
        ax.set_xlabel("episodes whose furthest milestone this is")
        ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    out = f"{path}_traces.png"
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out
