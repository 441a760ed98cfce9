"""Which training frames decide the closed loop, and how often to draw them (``oxygen train --focus``).

The demo policy's diagnosis (checkpoints/demo/README.md, ``oxygen sim-diagnose --copycat``) found its motion copied
from the arm's pose: at most frames the joint state already says where the arm is heading (the start pose is fixed,
so the displacement from it points at the target), and only two kinds of frame need the images to decide:

- **start** - the first ``START_S`` seconds of an episode: the arm is at (or near) its start pose and the first chunk
  must point at the named cube, which only the cameras show;
- **grasp** - frames within ``GRASP_WINDOW_S`` of a change of an absolute action column's command (ALOHA's grippers:
  ``delta_action_mask`` 0) by more than ``GRASP_FRACTION`` of that column's range: the moments just before and at
  closing or opening the fingers, where *when* and *where* come from the images.  (The command of a frame is its
  chunk's first row; the state-driven expert's labels hold the gripper constant within a chunk and switch it between
  frames, so the change shows between consecutive frames, not inside one chunk.)

Drawn uniformly they are a small share of the frames (``describe_groups`` says how small).  ``frame_groups`` names each
frame's group, ``sampling_probabilities`` turns per-group weights (``{"start": 4, "grasp": 4}``: drawn 4x as often as an
ordinary frame) into draw probabilities.  The trainer also reports the validation flow loss per group, so a run shows
whether the frames that matter are the ones it fits.
"""
from __future__ import annotations

import numpy as np

__all__ = ["GROUPS", "START_S", "GRASP_FRACTION", "GRASP_WINDOW_S", "parse_focus", "column_ranges", "frame_groups",
           "sampling_probabilities", "describe_groups"]

GROUPS = ("start", "grasp")
START_S = 0.3                      # an episode's first 0.3 s (3 frames at the sim's 10 Hz cameras)
GRASP_FRACTION = 0.1               # a command change of > 10 % of the column's q01..q99 range
GRASP_WINDOW_S = (0.3, 0.1)        # frames from 0.3 s before such a change to 0.1 s after it


def parse_focus(text: str) -> dict:
    """'start=4,grasp=2' -> {'start': 4.0, 'grasp': 2.0}; '' -> {}.  ValueError names what is wrong."""
    out = {}
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        name, sep, value = part.partition("=")
        name = name.strip()
        if not sep or name not in GROUPS:
            raise ValueError(f"--focus: {part!r} is not GROUP=WEIGHT with GROUP one of {', '.join(GROUPS)}")
        try:
            w = float(value)
        except ValueError:
            raise ValueError(f"--focus: the weight of {name!r} is not a number: {value!r}") from None
        if not (0 < w < float("inf")):
            raise ValueError(f"--focus: the weight of {name!r} must be a finite number > 0, got {value!r}")
        if name in out:
            raise ValueError(f"--focus: {name!r} given twice")
        out[name] = w
    return out


def column_ranges(episodes: list, columns: np.ndarray) -> np.ndarray:
    """q99 - q01 of the executed actions per column of ``columns`` ([A] bool) over ``episodes`` (0 elsewhere)."""
    acts = np.concatenate([e.actions for e in episodes]) if episodes else np.zeros((0, len(columns)), np.float32)
    rng = np.zeros(len(columns), np.float64)
    if len(acts):
        q = np.quantile(acts[:, columns].astype(np.float64), [0.01, 0.99], axis=0)
        rng[columns] = q[1] - q[0]
    return rng


def frame_groups(episode, horizon: int, absolute: np.ndarray, ranges: np.ndarray) -> np.ndarray:
    """Per frame of ``episode``: 'start', 'grasp' or '' (start wins where both apply).  ``absolute`` [A] bool: the
    columns the policy outputs as absolute targets; ``ranges`` [A]: their spread (``column_ranges``)."""
    F = episode.num_frames
    out = np.full(F, "", dtype=object)
    t = (episode.frame_ns - episode.frame_ns[0]) / 1e9
    cols = np.flatnonzero(absolute & (ranges > 0))
    if len(cols) and F > 1:
        cmd = np.stack([episode.action_chunk(f, horizon)[0][0, cols] for f in range(F)])      # [F, k]
        changed = np.flatnonzero(np.any(np.abs(np.diff(cmd, axis=0)) > GRASP_FRACTION * ranges[cols], axis=1)) + 1
        before, after = GRASP_WINDOW_S
        for c in changed:
            out[(t >= t[c] - before - 1e-9) & (t <= t[c] + after + 1e-9)] = "grasp"
    out[t < START_S] = "start"
    return out


def sampling_probabilities(groups: np.ndarray, focus: dict) -> np.ndarray | None:
    """Draw probabilities over frames: an ordinary frame weighs 1, a frame of group g weighs focus[g].  None when
    ``focus`` is empty (uniform draws, the trainer's own stream)."""
    if not focus:
        return None
    w = np.ones(len(groups), np.float64)
    for name, weight in focus.items():
        w[groups == name] = weight
    return w / w.sum()


def describe_groups(groups: np.ndarray, probs: np.ndarray | None) -> str:
    """'start 7.9 % of frames (drawn 25.6 %), grasp 9.1 % (29.4 %)'."""
    n = max(1, len(groups))
    parts = []
    for g in GROUPS:
        m = groups == g
        share = f"{100 * m.sum() / n:.1f} % of frames"
        if probs is not None:
            share += f" (drawn {100 * probs[m].sum():.1f} %)"
        parts.append(f"{g} {share}")
    return ", ".join(parts)
