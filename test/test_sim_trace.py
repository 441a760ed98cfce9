"""The failure tracer (``sim/trace.py``, ``oxygen sim-eval --trace``): per episode, the acting gripper's distance to the
cube, the furthest milestone (read with the expert's state-driven phase decision) and the stalls (the arm still for
>= ``STALL_S`` while the task is unfinished).  Real episodes on the simulation (``sim/episode.run_episode``, 16 px
cameras) with three small policies written here: the expert's chunks executed as trajectories, an arm that holds its
start pose, and one that goes to the cube and stops above it."""
from __future__ import annotations

import json

import numpy as np
import pytest

import oxygen_ros.sim  # noqa: F401 - sets MUJOCO_GL=egl before mujoco is imported

pytest.importorskip("mujoco", reason="the simulation needs mujoco (requirements.txt)")
pytest.importorskip("gym_aloha", reason="the simulation needs gym-aloha (requirements.txt)")

from oxygen_ros.sim.episode import EpisodeConfig, run_episode  # noqa: E402
from oxygen_ros.sim.execution import Trajectory  # noqa: E402
from oxygen_ros.sim.expert import Expert  # noqa: E402
from oxygen_ros.sim.scene import CONTROL_DT, JOINTS, AlohaScene  # noqa: E402
from oxygen_ros.sim.tasks import draw_task  # noqa: E402
from oxygen_ros.sim.trace import MILESTONES, STALL_S, EpisodeTracer, plot_traces  # noqa: E402


@pytest.fixture(scope="module")
def sim():
    s = AlohaScene((16, 16))
    yield s
    s.close()


def _traj(rows, t) -> list:
    rows = np.asarray(rows, float)
    return [Trajectory(t, tuple(JOINTS), np.arange(len(rows)) * CONTROL_DT, rows)]


class _ExpertPolicy:
    """The expert's chunk from the world at each camera frame, executed as a trajectory (no model)."""

    def __init__(self, stop_above: bool = False):
        self.stop_above = stop_above
        self.sim = self.expert = None

    def reset(self, spec, sim):
        self.sim, self.expert, self.hold = sim, Expert(sim, spec), None

    def act(self, obs, ready_t):
        if self.hold is not None:
            return _traj([self.hold], ready_t)
        rows = self.expert.chunk(20)
        if self.stop_above and self.expert.last_phases[self.expert.spec.arm] != "approach":
            self.hold = np.asarray(obs.state, float).copy()      # at the cube: freeze there, forever
            return _traj([self.hold], ready_t)
        return _traj(rows, ready_t)


class _HoldPolicy:
    """Never moves: commands the start state, every frame the same (commanding each frame's *measured* state would
    ratchet the arm down: it sags under gravity below its command)."""

    def reset(self, spec, sim):
        self.start = np.asarray(sim.state(), float).copy()

    def act(self, obs, ready_t):
        return _traj([self.start], ready_t)


def _traced(sim, task, seed, policy, **cfg):
    spec = draw_task(task, seed)
    tracer = EpisodeTracer(sim, spec)
    res = run_episode(sim, spec, policy, EpisodeConfig(**cfg), on_step=tracer.on_step)
    return res, tracer, tracer.summary(res.success)


@pytest.mark.parametrize("task,seed", [("reach", 1), ("pick", 2)])
def test_the_experts_episode_reaches_the_last_milestone_without_stalls(sim, task, seed):
    res, tracer, s = _traced(sim, task, seed, _ExpertPolicy())
    assert res.success
    names = MILESTONES[task]
    assert s["milestone"] == names[-1] and s["milestone_index"] == len(names) - 1
    assert s["stalls"] == [] and s["still_s"] == 0
    assert s["dist_min"] < 0.03 < s["dist_start"]                       # it came down onto the cube
    assert len(tracer.t) == len(tracer.dist) == len(tracer.milestone) == len(tracer.speed)
    assert max(tracer.milestone) >= 1                                     # the trace itself passed the approach
    assert max(tracer.milestone[:5]) == 0                                  # it starts at the approach


def test_an_arm_that_never_moves_stalls_for_the_whole_episode_at_the_approach(sim):
    res, tracer, s = _traced(sim, "reach", 3, _HoldPolicy())
    assert not res.success
    assert s["milestone"] == "approach" and s["milestone_index"] == 0
    assert len(s["stalls"]) == 1                                          # one stretch, start to time limit
    stall = s["stalls"][0]
    assert stall["milestone"] == "approach"
    assert stall["t"] < 0.5                                               # from the start, once settled ...
    assert stall["t"] + stall["duration_s"] == pytest.approx(res.duration_s, abs=2 * CONTROL_DT)   # ... to the end
    assert s["still_s"] == stall["duration_s"]
    assert abs(s["dist_end"] - s["dist_start"]) < 0.01                    # settling under gravity: millimetres


def test_an_arm_that_stops_at_the_cube_stalls_there_and_its_phase_is_past_the_approach(sim):
    res, tracer, s = _traced(sim, "pick", 4, _ExpertPolicy(stop_above=True))
    assert not res.success
    assert s["milestone_index"] >= 1                                      # got to the cube ...
    stalls = [x for x in s["stalls"] if x["duration_s"] >= STALL_S]
    assert stalls and stalls[-1]["milestone"] != "approach"               # ... and stood still there
    assert stalls[-1]["dist"] < 0.05
    assert s["dist_end"] < 0.05


def test_standing_still_after_success_is_not_a_stall(sim):
    """The recorder's tail: the episode runs on after the touch, the expert's arm holds - no stall reported."""
    res, tracer, s = _traced(sim, "reach", 1, _ExpertPolicy(stop_above=False), tail_s=1.0)
    assert res.success
    assert s["stalls"] == []


def test_a_success_the_trace_never_saw_still_counts_as_the_last_milestone(sim):
    """``on_step`` sees each step before it runs: the step that completes a reach (a finger touching the cube from
    the side, whatever the expert's phase reads) is not traced; the outcome passed to ``summary`` decides."""
    spec = draw_task("reach", 1)
    sim.reset(spec.scene)
    tracer = EpisodeTracer(sim, spec)
    tracer.on_step(0.0, sim.state(), sim.state(), type("M", (), {"success": False})())
    assert tracer.summary()["milestone"] == "approach"
    assert tracer.summary(success=True)["milestone"] == "touching"
    empty = EpisodeTracer(sim, spec)
    assert empty.summary(success=True)["milestone_index"] == len(MILESTONES["reach"]) - 1
    assert empty.summary(success=False)["milestone_index"] == 0


def test_series_and_plot_from_real_traces(sim, tmp_path):
    eps = []
    for task, seed, pol in [("reach", 1, _ExpertPolicy()), ("reach", 3, _HoldPolicy())]:
        res, tracer, s = _traced(sim, task, seed, pol)
        ser = tracer.series(0.1)
        assert len(ser["t"]) == len(ser["dist"]) == len(ser["milestone"]) == len(ser["speed"])
        assert ser["t"][1] - ser["t"][0] == pytest.approx(0.1)
        eps.append({"task": task, "success": res.success, "trace": ser, "trace_summary": s})
    json.dumps(eps)                                                      # what results.json holds
    out = plot_traces(eps, tmp_path / "results")
    assert out and (tmp_path / "results_traces.png").stat().st_size > 5000
    assert plot_traces([{"task": "reach", "success": False}], tmp_path / "none") is None
