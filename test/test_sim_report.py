"""The reported numbers of ``tools/sim/report.py`` against references written apart from it: ``wilson()`` against
published values (Newcombe 1998, Stat. Med. 17:857, table I, method 3) and against the score test inverted
numerically (scipy's root finder and normal quantile), at 0/n, n/n and k/n; ``episode_measures`` on a hand-built
``EpisodeResult``: switch jumps at known steps (each step's change distinct, so one step off shows), an answer
scored against the frame the model read (not a later one), memory texts naming a subset, a superset or a reordering
of the cubes; ``aggregate`` counting crashed episodes apart."""
from __future__ import annotations

import math

import numpy as np
import pytest

from oxygen_ros.sim.episode import EpisodeConfig, EpisodeResult
from oxygen_ros.sim.tasks import QUESTIONS, draw_task
from oxygen_ros.tools.sim.report import aggregate, episode_measures, wilson

# Newcombe (1998), table I: 95 % Wilson score interval (method 3), to 4 decimals
PUBLISHED = {(81, 263): (0.2553, 0.3662), (15, 148): (0.0624, 0.1605), (0, 20): (0.0000, 0.1611),
             (1, 29): (0.0061, 0.1718)}


@pytest.mark.parametrize("k,n", sorted(PUBLISHED))
def test_wilson_matches_published_values(k, n):
    lo, hi = wilson(k, n)
    assert (round(lo, 4), round(hi, 4)) == PUBLISHED[(k, n)]


def _score_test_bounds(k, n, z):
    """The Wilson interval by definition: the p0 whose score test |k/n - p0| <= z sqrt(p0 (1 - p0) / n) accepts;
    its ends found by bisection of the test statistic (no closed form)."""
    from scipy.optimize import brentq
    p = k / n
    f = lambda p0: (p - p0) ** 2 - z * z * p0 * (1 - p0) / n  # noqa: E731 - <= 0 inside the interval
    inner = min(max(p, 1e-12), 1 - 1e-12)                       # strictly inside (f < 0), also at p = 0 or 1
    lo = 0.0 if k == 0 else brentq(f, 1e-15, inner)
    hi = 1.0 if k == n else brentq(f, inner, 1 - 1e-15)
    return lo, hi


@pytest.mark.parametrize("k,n", [(0, 1), (0, 5), (0, 20), (20, 20), (100, 100), (1, 1), (3, 10), (5, 20),
                                 (19, 20), (1, 100), (50, 100), (7, 13)])
def test_wilson_is_the_inverted_score_test_at_95_percent(k, n):
    from scipy.stats import norm
    z95 = norm.ppf(0.975)
    assert abs(z95 - 1.96) < 1e-4                                  # the default z is the 95 % quantile
    lo, hi = wilson(k, n)
    rlo, rhi = _score_test_bounds(k, n, 1.96)
    assert lo == pytest.approx(rlo, abs=1e-9) and hi == pytest.approx(rhi, abs=1e-9)
    assert 0.0 <= lo < k / n + 1e-12 and k / n - 1e-12 < hi <= 1.0 and hi - lo > 0.01   # never zero-width
    if k == 0:
        assert lo == 0.0 and hi == pytest.approx(1.96 ** 2 / (n + 1.96 ** 2))
    if k == n:
        assert hi == 1.0 and lo == pytest.approx(n / (n + 1.96 ** 2))
    # another z: the same definition
    lo99, hi99 = wilson(k, n, z=2.576)
    assert (lo99, hi99) == pytest.approx(_score_test_bounds(k, n, 2.576), abs=1e-9)
    assert lo99 <= lo and hi99 >= hi


def test_wilson_without_episodes_is_the_whole_range():
    assert wilson(0, 0) == (0.0, 1.0)


# ---------------------------------------------------------------------------------------------------- episodes
Q = QUESTIONS[0]                                    # "How many cubes are on the table?"
GT = {0: ({Q: "two"}, "a red cube and a blue cube on the table"),                 # frame at 0.0 s
      100: ({Q: "one"}, "a red cube on the table; the left gripper holds the blue cube"),   # frame at 0.1 s
      200: ({Q: "one"}, "a red cube on the table; the left gripper holds the blue cube")}


def _result(actions, switch_steps):
    r = EpisodeResult(draw_task("reach", 0), EpisodeConfig())
    r.actions = [np.asarray(a, float) for a in actions]
    r.switch_steps = list(switch_steps)
    r.frames_gt = dict(GT)
    r.chunk_times = [(0.0, 0.02), (0.06, 0.08)]
    r.duration_s = 0.02 * len(actions)
    return r


def test_switch_jumps_are_the_change_into_the_switch_step():
    # step k -> k+1 changes (max over joints): 0.1, 0.2, 5.0, 0.3, 0.4, 7.0, 0.5 ; switches at steps 3 and 6
    changes = [0.1, 0.2, 5.0, 0.3, 0.4, 7.0, 0.5]
    a = [np.zeros(3)]
    for k, c in enumerate(changes):
        nxt = a[-1].copy()
        nxt[k % 3] += c if k % 2 else -c                         # on one joint, either sign
        nxt[(k + 1) % 3] += 0.5 * c                              # a smaller change on another
        a.append(nxt)
    m = episode_measures(_result(a, [3, 6]), [], horizon=10)
    assert m["switch_jumps"] == pytest.approx([5.0, 7.0])
    assert m["inside_steps"] == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5])
    assert m["chunks"] == 2 and m["horizon"] == 10
    m0 = episode_measures(_result(a, [0]), [], horizon=10)      # a takeover at step 0 has no step into it
    assert m0["switch_jumps"] == [] and len(m0["inside_steps"]) == 7


def _answer(text, frame_t, t):
    return {"kind": "conversation", "prompt": Q, "text": text, "finish_reason": "eos", "frame_t": frame_t, "t": t}


def _memory(text, frame_t):
    return {"kind": "memory", "prompt": "Describe the scene in one sentence.", "text": text, "finish_reason": "",
            "frame_t": frame_t, "t": None}


def test_an_answer_is_scored_against_the_frame_the_model_read():
    log = [_answer(" Two. ", 0.0, 0.1),          # read the frame at 0.0 (two cubes), finished at 0.1 (one cube)
           _answer("one", 0.0, 0.1),             # right for the later frame only: wrong
           _answer("one", 0.1, 0.2),
           _answer("one", 0.3, 0.4),             # a frame without ground truth: not scored
           _answer("one", None, 0.4)]
    m = episode_measures(_result([np.zeros(2)] * 3, []), log, horizon=4)
    assert [(a["a"], a["gt"], a["ok"], a["frame_t"]) for a in m["answers"]] == [
        (" Two. ", "two", True, 0.0), ("one", "two", False, 0.0), ("one", "one", True, 0.1)]


@pytest.mark.parametrize("text,objects_ok,exact", [
    ("a red cube and a blue cube on the table", True, True),
    ("A red cube and a blue cube on the table.", True, True),
    ("a blue cube and a red cube on the table", True, False),        # both cubes named, other words
    ("a red cube on the table", False, False),                       # a subset of the cubes: wrong
    ("a blue cube on the table", False, False),
    ("a red cube, a blue cube and a green cube on the table", False, False),   # a superset: wrong
    ("no cubes on the table", False, False),
])
def test_a_memory_entry_names_the_right_objects_only_with_exactly_the_frames_cubes(text, objects_ok, exact):
    m = episode_measures(_result([np.zeros(2)] * 3, []), [_memory(text, 0.0)], horizon=4)
    (e,) = m["memories"]
    assert (e["objects_ok"], e["exact"], e["gt"]) == (objects_ok, exact, GT[0][1])


def test_a_memory_entry_is_scored_against_its_own_frame():
    held = "a red cube on the table; the left gripper holds the blue cube"
    m = episode_measures(_result([np.zeros(2)] * 3, []), [_memory(held, 0.1), _memory(held, 0.0)], horizon=4)
    assert [e["exact"] for e in m["memories"]] == [True, False]
    assert [e["objects_ok"] for e in m["memories"]] == [True, True]   # the same colours, held or not


def test_aggregate_counts_crashed_episodes_apart_and_uses_wilson():
    def ep(success, error=""):
        return {"task": "reach", "seed": 0, "success": success, "success_time": 1.0 if success else None,
                "duration_s": 2.0, "chunks": 10, "horizon": 5, "switch_jumps": [0.5], "inside_steps": [0.1, 0.3],
                "answers": [{"q": "a?", "ok": True}, {"q": "b?", "ok": False}], "memories": [],
                "rejected": {"not_finite": 1},
                "error": error}
    eps = [ep(True), ep(True), ep(False), ep(False, error="boom")]
    a = aggregate(eps)
    t = a["tasks"]["reach"]
    assert (t["n"], t["success"], t["rate"]) == (3, 2, pytest.approx(2 / 3))
    assert t["ci95"] == list(wilson(2, 3)) and len(t["incomplete"]) == 1
    assert a["incomplete"] == 1 and a["rejected_trajectories"] == 3
    assert a["action_hz"] == pytest.approx(5 * 30 / 6.0) and a["cycles_per_s"] == pytest.approx(30 / 6.0)
    assert a["smoothness"]["switch_p50"] == 0.5 and a["smoothness"]["inside_p50"] == pytest.approx(0.2)
    assert a["answers"] == {"n": 6, "exact": 0.5, "by_question": {"a?": {"n": 3, "exact": 1.0},
                                                                   "b?": {"n": 3, "exact": 0.0}}}
    assert math.isclose(a["smoothness"]["ratio_p50"], 2.5)


def test_aggregate_reports_gym_alohas_transfer_definition_beside_the_strict_one():
    def ep(success, gym):
        return {"task": "transfer", "seed": 0, "success": success, "gym_success": gym,
                "success_time": 3.0 if success else None, "duration_s": 8.0, "chunks": 10, "horizon": 5,
                "switch_jumps": [], "inside_steps": [], "answers": [], "memories": [], "rejected": {}, "error": ""}
    t = aggregate([ep(True, True), ep(False, True), ep(False, False)])["tasks"]["transfer"]
    assert (t["success"], t["gym_aloha"]["success"]) == (1, 2)
    assert t["gym_aloha"]["ci95"] == list(wilson(2, 3))
    assert "gym_aloha" not in aggregate([dict(ep(True, True), task="pick")])["tasks"]["pick"]


def test_aggregate_pools_the_realtime_chunks_latency_and_observation_age_of_completed_episodes():
    """Realtime episodes carry each chunk's engine latency and observation age (the node's ActionChunk fields); the
    cell reports their p50 / p95 over every chunk of its completed episodes - a crashed episode's chunks are left out,
    and a lockstep cell (no such lists) gets no such keys."""
    def ep(lat, age, error=""):
        return {"task": "reach", "seed": 0, "success": False, "success_time": None, "duration_s": 2.0, "chunks": 3,
                "horizon": 5, "switch_jumps": [], "inside_steps": [], "answers": [], "memories": [], "rejected": {},
                "error": error, "chunk_latency_ms": lat, "chunk_obs_age_s": age, "plan_age_s": age + age}
    a = aggregate([ep([100.0, 200.0], [0.1, 0.3]), ep([300.0], [0.2]), ep([9999.0], [9.0], error="boom")])
    assert a["chunk_latency_ms"]["n"] == 3 and a["chunk_latency_ms"]["p50"] == pytest.approx(200.0)
    assert a["chunk_obs_age_s"]["n"] == 3 and a["chunk_obs_age_s"]["p50"] == pytest.approx(0.2)
    assert a["chunk_latency_ms"]["p95"] < 9999.0 and a["plan_age_s"]["n"] == 6
    lockstep = {k: v for k, v in ep([], []).items() if not k.startswith("chunk_")}
    b = aggregate([lockstep])
    assert "chunk_latency_ms" not in b and "chunk_obs_age_s" not in b and "plan_age_s" not in b
