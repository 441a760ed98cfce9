"""The execution rule of ``sim/execution.py`` (ros2_control's joint_trajectory_controller) on hand-built trajectories:
the takeover exactly at the stamp (also when the stamp and the step time differ by float rounding), the ramp from the
last command to a first point later than the stamp, every interpolation boundary (non-uniform times, exactly at each
point, the last point held), the newest started trajectory winning and older queued ones dropped, ``idle_for``, and
``inf`` / ``-inf`` / NaN in positions, times or the stamp rejected, counted and never executed (the running
trajectory keeps running).  Pure numpy: no simulation."""
from __future__ import annotations

import numpy as np
import pytest

from oxygen_ros.sim.execution import Trajectory, TrajectoryExecutor, TrajectoryRejected

NAMES = ("a", "b")


def _tr(start, times, rows, names=NAMES):
    return Trajectory(start, tuple(names), np.asarray(times, float), np.asarray(rows, float))


def _ex(hold=(0.0, 0.0)):
    return TrajectoryExecutor(NAMES, list(hold))


# ---------------------------------------------------------------------------------------------------- the stamp
def test_a_trajectory_takes_over_exactly_at_its_stamp():
    ex = _ex()
    ex.submit(_tr(0.1, [0.0, 0.1], [[1, 1], [3, 3]]))
    assert np.array_equal(ex.command(0.08), [0, 0])            # one step before: the hold
    assert ex.switches == 0 and ex.pending == 1
    assert np.allclose(ex.command(0.1), [1, 1])                 # at the stamp: its first point, not a step later
    assert ex.switches == 1 and ex.pending == 0
    assert np.allclose(ex.command(0.12), [1.4, 1.4])


def test_the_stamp_counts_when_float_rounding_puts_the_step_time_a_hair_before_it():
    stamp = 0.1 + 0.2                                           # 0.30000000000000004
    t = 15 * 0.02                                               # 0.3: the control step at that stamp
    assert t < stamp
    ex = _ex()
    ex.submit(_tr(stamp, [0.0, 0.2], [[5, 5], [7, 7]]))
    assert np.allclose(ex.command(t), [5, 5])


# ---------------------------------------------------------------------------------------------------- the ramp
def test_a_first_point_after_the_stamp_is_reached_by_a_ramp_from_the_last_command():
    ex = _ex()
    ex.submit(_tr(0.0, [0.0, 1.0], [[0, 0], [10, 20]]))         # a moving trajectory
    assert np.allclose(ex.command(0.08), [0.8, 1.6])            # the last command before the switch
    ex.submit(_tr(0.1, [0.1, 0.2], [[4, 4], [6, 6]]))           # first point 0.1 s after its stamp
    # at the stamp the ramp starts at the last command; it reaches the first point at stamp + 0.1, linearly
    assert np.allclose(ex.command(0.1), [0.8, 1.6])
    assert np.allclose(ex.command(0.125), [0.8 + 0.25 * 3.2, 1.6 + 0.25 * 2.4])
    assert np.allclose(ex.command(0.15), [2.4, 2.8])
    assert np.allclose(ex.command(0.2), [4, 4])                 # the first point, exactly on time
    assert np.allclose(ex.command(0.25), [5, 5])                # then the trajectory's own interpolation
    assert np.allclose(ex.command(0.3), [6, 6])


def test_the_ramp_of_a_first_trajectory_starts_at_the_hold_position():
    ex = _ex(hold=(2.0, -2.0))
    ex.submit(_tr(0.0, [0.2], [[4, 0]]))
    assert np.allclose(ex.command(0.0), [2, -2])
    assert np.allclose(ex.command(0.1), [3, -1])
    assert np.allclose(ex.command(0.2), [4, 0])
    assert np.allclose(ex.command(0.5), [4, 0])


# ---------------------------------------------------------------------------------------------------- interpolation
def test_interpolation_at_every_boundary_with_non_uniform_times():
    ex = _ex()
    times = [0.0, 0.1, 0.3, 0.35]
    rows = [[0, 10], [1, 8], [5, 0], [6, 1]]
    ex.submit(_tr(1.0, times, rows))
    for tau, row in zip(times, rows):                          # exactly at each point: that point
        assert np.allclose(ex.command(1.0 + tau), row), tau
    ex = _ex()
    ex.submit(_tr(1.0, times, rows))
    expect = {0.05: [0.5, 9], 0.15: [2, 6], 0.25: [4, 2], 0.325: [5.5, 0.5], 0.35: [6, 1], 0.5: [6, 1], 2.0: [6, 1]}
    for tau, row in expect.items():                            # between points: linear in that segment's own span
        assert np.allclose(ex.command(1.0 + tau), row), tau
    assert ex.idle_for(3.0) == pytest.approx(3.0 - 1.35)        # holding the last point since start + last time


def test_a_single_point_trajectory_holds_that_point_from_its_stamp():
    ex = _ex()
    ex.submit(_tr(0.2, [0.0], [[3, 4]]))
    assert np.allclose(ex.command(0.2), [3, 4])
    assert np.allclose(ex.command(0.9), [3, 4])


def test_idle_for_counts_from_the_last_point_and_from_the_first_call_without_a_trajectory():
    ex = _ex()
    assert ex.idle_for(0.4) == 0.0                             # waiting for a first trajectory: counts from here
    assert ex.idle_for(0.7) == pytest.approx(0.3)
    ex.submit(_tr(1.0, [0.0, 0.2], [[1, 1], [2, 2]]))
    ex.command(1.0)
    assert ex.idle_for(1.1) == 0.0                             # running
    assert ex.idle_for(1.5) == pytest.approx(0.3)              # past its last point (1.2)


# ---------------------------------------------------------------------------------------------------- which one runs
def test_the_newest_started_submission_wins_and_older_queued_ones_are_dropped():
    ex = _ex()
    ex.submit(_tr(0.1, [0.0], [[1, 1]]))
    ex.submit(_tr(0.1, [0.0], [[2, 2]]))                        # same stamp, submitted later: this one
    assert np.allclose(ex.command(0.1), [2, 2])
    ex.submit(_tr(0.5, [0.0], [[3, 3]]))                        # waits for its stamp ...
    ex.submit(_tr(0.3, [0.0], [[4, 4]]))                        # ... a newer one starting earlier drops it
    assert np.allclose(ex.command(0.2), [2, 2])                 # before either starts: the running one continues
    assert ex.pending == 2
    assert np.allclose(ex.command(0.3), [4, 4])
    assert ex.pending == 0
    assert np.allclose(ex.command(0.6), [4, 4])                 # the dropped one never runs
    assert ex.switches == 2


# ---------------------------------------------------------------------------------------------------- not finite
BAD = [
    ("nan position", dict(rows=[[0, 0], [np.nan, 1]])),
    ("inf position", dict(rows=[[0, 0], [np.inf, 1]])),
    ("-inf position", dict(rows=[[-np.inf, 0], [1, 1]])),
    ("nan time", dict(times=[0.0, np.nan])),
    ("inf time", dict(times=[0.0, np.inf])),
    ("-inf time", dict(times=[-np.inf, 0.1])),
    ("nan start", dict(start=np.nan)),
    ("inf start", dict(start=np.inf)),
    ("-inf start", dict(start=-np.inf)),
]


@pytest.mark.parametrize("what,kw", BAD, ids=[b[0] for b in BAD])
def test_non_finite_values_are_rejected_counted_and_never_executed(what, kw):
    ex = _ex()
    ex.submit(_tr(0.0, [0.0, 1.0], [[0, 0], [1, 1]]))          # running
    assert np.allclose(ex.command(0.5), [0.5, 0.5])
    bad = dict(start=0.6, times=[0.0, 0.1], rows=[[9, 9], [9, 9]])
    bad.update(kw)
    with pytest.raises(TrajectoryRejected) as e:
        ex.submit(_tr(bad["start"], bad["times"], bad["rows"]))
    assert e.value.reason == "not_finite"
    assert ex.rejected == {"not_finite": 1} and ex.accepted == 1 and ex.pending == 0
    for t in (0.6, 0.7, 0.8):                                   # the running trajectory continues, finite
        c = ex.command(t)
        assert np.all(np.isfinite(c)) and np.allclose(c, [t, t])
    assert ex.switches == 1
