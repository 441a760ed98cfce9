"""``oxygen train --focus`` (``oxygen_ros/train/focus.py``): which frames are 'start' and 'grasp' frames on
hand-built episodes, the draw probabilities the weights give, and the option's parsing.  The trainer's use of them on
real episode bags (draws and the per-group validation loss) is in test_train.py."""
from __future__ import annotations

import numpy as np
import pytest

from oxygen_ros.train.data import Episode
from oxygen_ros.train.focus import (GRASP_WINDOW_S, START_S, column_ranges, describe_groups, frame_groups,
                                    parse_focus, sampling_probabilities)

A = 3                                   # columns: an arm joint (delta), a gripper (absolute), a constant absolute one
ABSOLUTE = np.array([False, True, True])


def _episode(seconds=2.0, rate=10.0, close_at=None, reopen_at=None, labelled=True, control=50.0) -> Episode:
    """An episode at ``rate`` Hz frames whose gripper command (column 1) is 1 (open) until ``close_at`` s, 0 after
    (1 again from ``reopen_at``); column 2 is constant.  Labels: each frame's chunk holds the command in force at the
    frame (as the state-driven expert labels); unlabelled: the executed actions carry it."""
    F = int(seconds * rate)
    frame_ns = (np.arange(F) * 1e9 / rate).astype(np.int64) + 5_000_000_000        # episodes do not start at 0
    T = int(seconds * control)
    action_ns = (np.arange(T) * 1e9 / control).astype(np.int64) + 5_000_000_000

    def grip(t):
        g = np.ones_like(t, dtype=np.float32)
        if close_at is not None:
            g[t >= close_at] = 0.0
        if reopen_at is not None:
            g[t >= reopen_at] = 1.0
        return g
    actions = np.zeros((T, A), np.float32)
    actions[:, 0] = np.linspace(0, 1, T)
    actions[:, 1] = grip((action_ns - action_ns[0]) / 1e9)
    actions[:, 2] = 0.5
    labels = rows = None
    if labelled:
        labels = np.zeros((F, 20, A), np.float32)
        labels[:, :, 1] = grip((frame_ns - frame_ns[0]) / 1e9)[:, None]
        labels[:, :, 2] = 0.5
        rows = np.full(F, 20)
    return Episode(source="test#0", images=np.zeros((F, 3, 2, 2, 3), np.uint8), image_mask=np.ones((F, 3), bool),
                   frame_ns=frame_ns, state=np.zeros((F, A), np.float32), instruction=["x"] * F,
                   texts=[[] for _ in range(F)], action_ns=action_ns, actions=actions, labels=labels, label_rows=rows)


def _groups(ep):
    return frame_groups(ep, 20, ABSOLUTE, column_ranges([ep, _episode(close_at=1.0)], ABSOLUTE))


@pytest.mark.parametrize("labelled", [True, False])
def test_start_and_grasp_frames_of_one_close(labelled):
    g = _groups(_episode(close_at=1.0, labelled=labelled))
    t = np.arange(20) / 10.0
    start = t < START_S
    grasp = (t >= 1.0 - GRASP_WINDOW_S[0] - 1e-9) & (t <= 1.0 + GRASP_WINDOW_S[1] + 1e-9)
    assert list(np.flatnonzero(g == "start")) == list(np.flatnonzero(start)) == [0, 1, 2]
    assert list(np.flatnonzero(g == "grasp")) == list(np.flatnonzero(grasp)) == [7, 8, 9, 10, 11]
    assert set(g[~start & ~grasp]) == {""}


def test_every_change_of_the_command_marks_its_window_and_start_wins_over_grasp():
    g = _groups(_episode(close_at=0.2, reopen_at=1.5))
    assert list(np.flatnonzero(g == "start")) == [0, 1, 2]
    assert list(np.flatnonzero(g == "grasp")) == [3, 12, 13, 14, 15, 16]   # 0.2 s's window but the start; 1.2..1.6 s


def test_no_change_no_grasp_frames_and_constant_columns_never_count():
    g = _groups(_episode())
    assert set(g[3:]) == {""} and set(g[:3]) == {"start"}
    ranges = column_ranges([_episode(close_at=1.0)], ABSOLUTE)
    assert ranges[0] == 0 and ranges[1] == pytest.approx(1.0) and ranges[2] == 0   # delta column: not measured
    # a gripper that never moves anywhere in the data has no range: nothing is a grasp frame
    flat = frame_groups(_episode(close_at=1.0), 20, ABSOLUTE, np.zeros(A))
    assert set(flat[3:]) == {""}


def test_sampling_probabilities_weigh_each_group():
    groups = np.array(["start", "grasp", "", "", "grasp"], dtype=object)
    p = sampling_probabilities(groups, {"start": 4.0, "grasp": 2.0})
    assert p.sum() == pytest.approx(1.0)
    assert p.tolist() == pytest.approx([4 / 10, 2 / 10, 1 / 10, 1 / 10, 2 / 10])
    assert sampling_probabilities(groups, {}) is None
    assert describe_groups(groups, p) == "start 20.0 % of frames (drawn 40.0 %), grasp 40.0 % of frames (drawn 40.0 %)"
    assert describe_groups(groups, None) == "start 20.0 % of frames, grasp 40.0 % of frames"


def test_parse_focus():
    assert parse_focus("") == {}
    assert parse_focus("start=4, grasp=2.5") == {"start": 4.0, "grasp": 2.5}
    for bad, match in (("start", "GROUP=WEIGHT"), ("reach=2", "GROUP=WEIGHT"), ("start=x", "not a number"),
                       ("start=0", "> 0"), ("start=-1", "> 0"), ("start=nan", "> 0"), ("start=inf", "> 0"),
                       ("start=1,start=2", "twice")):
        with pytest.raises(ValueError, match=match):
            parse_focus(bad)
