"""An auxiliary training target: where the named cube is, read from the action expert's own hidden state.

Why (``checkpoints/demo/README.md``, stages 3-6): the policy's VLM places the named cube within one cell of the top
image, but the action expert's plans barely move with the cube's x - at the start pose pick's first chunk moves the
cube's arm (the cube's side, x) in about 6 of 10 episodes, chance being 5.  Behaviour cloning rewards reading the
cube's place only through the few frames where the arm's pose does not already carry the motion.  This target asks
the action expert for it directly: a linear head on its final hidden state (mean over the chunk's H tokens, after the
final norm - what ``action_out_proj`` reads) regresses the named cube's table position, so the gradient that teaches
the expert to attend to the cube reaches it at every frame, not only through the flow loss.  The head is a training
aid: it is not part of the model, the checkpoint or inference (``Pi05Model`` is unchanged).

This file owns the labels and the head:

* ``attach_targets(episodes)`` sets ``Episode.target`` [F, 3] = (x, y normalised, valid) per frame: the named cube's
  resting place from the episode's own task draw (``sim.tasks.draw_task(task, seed)``; bags of ``oxygen sim-record``
  carry both in their episode status), valid while the frame's "Where is the <colour> cube?" text target still
  gives the cell it gave at the first frame (once a gripper moves the cube its resting place is no longer where it
  is).  Episodes without a task draw or that text target get no valid frames.  ``within_s``: only the frames of the
  episode's first ``within_s`` seconds (where the arm's pose cannot say where it is going, so the head must read the
  images; ``oxygen train --target-within``).
* ``TargetHead`` maps the hidden state [B, H, We] to the normalised (x, y) [B, 2].
* ``target_loss`` is the mean squared error over valid rows (0 still connected to the graph when none is valid).
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

__all__ = ["CENTRE", "SCALE", "attach_targets", "normalise", "TargetHead", "target_loss"]

# the tasks' cube regions (sim/tasks.py: x in [-0.15, 0.2], y in [0.4, 0.66]) mapped to about [-1, 1]
CENTRE = np.array([0.0, 0.53])
SCALE = np.array([0.15, 0.13])


def normalise(xy) -> np.ndarray:
    """World table position (x, y) in metres -> the head's units."""
    return (np.asarray(xy, np.float64) - CENTRE) / SCALE


def attach_targets(episodes: list, within_s: float | None = None) -> int:
    """Set ``ep.target`` ([F, 3] float32: x, y normalised, valid 0/1) on every episode; returns the valid frames."""
    from oxygen_ros.sim.tasks import TASKS, draw_task, locate_question, named_colour  # noqa: PLC0415

    total = 0
    for ep in episodes:
        out = np.zeros((ep.num_frames, 3), np.float32)
        ep.target = out
        task, seed = ep.meta.get("task"), ep.meta.get("seed")
        if task not in TASKS or seed is None:
            continue
        spec = draw_task(task, int(seed))
        cube = spec.scene.cubes[spec.target_index]
        out[:, :2] = normalise((cube.x, cube.y))
        q = locate_question(spec.target)
        first = None
        for f in range(ep.num_frames):
            if named_colour(ep.instruction[f] or "") != spec.target:
                break                                   # not the drawn task's instruction: trust nothing after it
            cell = next((text for _kind, prompt, text in ep.texts[f] if prompt == q), None)
            if cell is None:
                continue
            first = cell if first is None else first
            if cell != first:
                break                                   # the cube has left its resting cell: the label no longer holds
            if within_s is None or (ep.frame_ns[f] - ep.frame_ns[0]) / 1e9 < within_s:
                out[f, 2] = 1.0
        total += int(out[:, 2].sum())
    return total


class TargetHead(nn.Module):
    """hidden [B, H, We] -> (x, y) normalised [B, 2]: a linear map of the chunk-mean hidden state."""

    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, 2)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.linear(hidden.float().mean(dim=1))


def target_loss(pred: torch.Tensor, target: torch.Tensor, valid: torch.Tensor,
                denom: float | torch.Tensor | None = None) -> torch.Tensor:
    """Mean over valid rows of the squared error summed over (x, y).  pred / target [B, 2], valid [B] bool."""
    se = (pred.float() - target.float()).pow(2).sum(dim=-1)                            # [B]
    w = valid.float()
    d = w.sum().clamp(min=1.0) if denom is None else denom
    return (se * w).sum() / d
