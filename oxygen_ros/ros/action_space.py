"""The published action space: delta -> absolute conversion, joint limits and the per-step change limit.

This file owns what happens to a chunk between the engine (``ActionResult.actions``: un-normalised, ``[H, A]``) and
the robot, and the inverse needed by real-time chunking.  Pure numpy, no rclpy; unit-tested alone.

* ``delta_action_mask`` (openpi ``DeltaActions`` / ``AbsoluteActions`` semantics): a per-column mask; a masked column
  ``j`` is a delta relative to the joint state ``state[j]`` **at the observation's capture time** (the very state
  vector the pipeline put into that cycle's ``Observation``), so ``absolute[:, j] = delta[:, j] + state[j]``.
  Unmasked columns are absolute.  As in openpi, a mask shorter than the action has its remaining columns absolute, so
  ``[]`` (the default) = every column absolute = nothing changes.  ``to_delta`` is the inverse (RTC hands the engine
  the rows the robot will execute, in the engine's output space, relative to the NEW observation's state).
* ``action_limits_min`` / ``action_limits_max``: per-column bounds (``[]`` = none; ``+-inf`` entries allowed in
  the arrays given here); ``clip`` returns the clipped chunk and how many rows had at least one value clipped.
* ``action_max_step_change``: the largest change of each column from one control step to the next (``[]`` = off;
  one value = the same bound for every column; one value per column otherwise; ``0`` for a column = unlimited).
  ``limit_steps(rows, prev)`` walks the rows in order, moving each one at most that far from the previous
  (already limited) row, starting from ``prev`` (the action the robot executed last; ``None`` = the first row is
  kept); it returns the limited rows and how many rows it changed.  Applied to the rows that will actually be
  executed (after blending / the RTC switch), so the executed stream obeys it across chunk switches too; the chunk
  buffer adds anchors so that a JointTrajectory consumer (which switches at the new trajectory's stamp) sees no
  larger step either (``ros/control.py``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["ActionSpace", "ActionSpaceError"]


class ActionSpaceError(ValueError):
    """An inconsistent action-space configuration (the message says which parameter and why)."""


def _vec(values, name: str, dims: int, *, allow_one: bool = False) -> np.ndarray | None:
    v = np.asarray(list(values), dtype=np.float64)
    if v.size == 0:
        return None
    if allow_one and v.size == 1:
        return np.full(dims, float(v[0]))
    if v.size != dims:
        raise ActionSpaceError(f"{name} has {v.size} entries, the action has {dims} columns"
                               + (" (give 1 entry for all columns or one per column)" if allow_one else ""))
    if np.any(np.isnan(v)):
        raise ActionSpaceError(f"{name} contains NaN")
    return v


@dataclass
class ActionSpace:
    dims: int                                  # published action columns
    delta_mask: np.ndarray                     # [dims] bool
    low: np.ndarray | None = None              # [dims] float64 or None
    high: np.ndarray | None = None
    max_step: np.ndarray | None = None         # [dims] float64 (inf = unlimited) or None

    @staticmethod
    def build(dims: int, *, delta_action_mask=(), limits_min=(), limits_max=(), max_step_change=(),
              state_dim: int | None = None) -> "ActionSpace":
        """Validated from the parameters' values; ``state_dim``: the joint state's length when known (a masked
        column needs a state entry)."""
        dims = int(dims)
        mask = [bool(int(m)) if not isinstance(m, bool) else m for m in delta_action_mask]
        if len(mask) > dims:
            raise ActionSpaceError(f"delta_action_mask has {len(mask)} entries, the action has {dims} columns")
        bad = [m for m in delta_action_mask if not isinstance(m, bool) and int(m) not in (0, 1)]
        if bad:
            raise ActionSpaceError(f"delta_action_mask entries must be 0/1 or true/false, got {bad[:4]}")
        full = np.zeros(dims, dtype=bool)
        full[:len(mask)] = mask
        if full.any() and state_dim is not None:
            last = int(np.nonzero(full)[0][-1])
            if last >= state_dim:
                raise ActionSpaceError(f"delta_action_mask marks column {last} as a delta, but the joint state has "
                                       f"only {state_dim} entries (state_joint_names)")
        low = _vec(limits_min, "action_limits_min", dims)
        high = _vec(limits_max, "action_limits_max", dims)
        if low is not None and high is not None and np.any(low > high):
            j = int(np.nonzero(low > high)[0][0])
            raise ActionSpaceError(f"action_limits_min[{j}] = {low[j]} > action_limits_max[{j}] = {high[j]}")
        step = _vec(max_step_change, "action_max_step_change", dims, allow_one=True)
        if step is not None:
            if np.any(step < 0):
                raise ActionSpaceError("action_max_step_change entries must be >= 0 (0 = unlimited)")
            step = np.where(step == 0, np.inf, step)
            if np.all(np.isinf(step)):
                step = None
        return ActionSpace(dims, full, low, high, step)

    @property
    def has_delta(self) -> bool:
        return bool(self.delta_mask.any())

    @property
    def has_limits(self) -> bool:
        return self.low is not None or self.high is not None

    def _state_offset(self, state) -> np.ndarray:
        if not self.has_delta:
            return np.zeros(self.dims, dtype=np.float32)
        if state is None:
            raise ValueError("delta actions need the joint state of the observation (none was received)")
        st = np.asarray(state, dtype=np.float64).reshape(-1)
        off = np.zeros(self.dims, dtype=np.float64)
        n = min(len(st), self.dims)
        off[:n] = st[:n]
        if self.delta_mask[n:].any():
            raise ValueError(f"delta_action_mask needs {int(np.nonzero(self.delta_mask)[0][-1]) + 1} state entries, "
                             f"the joint state has {len(st)}")
        return np.where(self.delta_mask, off, 0.0)

    def to_absolute(self, actions, state) -> np.ndarray:
        """Engine output ``[H, A]`` -> absolute actions: masked columns + ``state`` (the observation's joint state)."""
        a = np.asarray(actions, dtype=np.float32)
        if not self.has_delta:
            return a.copy()
        return (a.astype(np.float64) + self._state_offset(state)[None, :]).astype(np.float32)

    def to_delta(self, actions, state) -> np.ndarray:
        """Absolute ``[n, A]`` -> the engine's output space relative to ``state`` (inverse of ``to_absolute``)."""
        a = np.asarray(actions, dtype=np.float32)
        if not self.has_delta:
            return a.copy()
        return (a.astype(np.float64) - self._state_offset(state)[None, :]).astype(np.float32)

    def clip(self, actions) -> tuple[np.ndarray, int]:
        """Actions clipped to the limits, and the number of rows with at least one clipped value."""
        a = np.asarray(actions, dtype=np.float32)
        if not self.has_limits:
            return a, 0
        lo = -np.inf if self.low is None else self.low
        hi = np.inf if self.high is None else self.high
        out = np.clip(a, lo, hi).astype(np.float32)
        return out, int(np.count_nonzero(np.any(out != a, axis=1)))

    def limit_steps(self, rows, prev=None, anchors=()) -> tuple[np.ndarray, int]:
        """Rows with each step from the previous row (``prev`` before row 0) bounded by ``max_step``; the number of
        rows changed.  ``anchors``: (row index, reference) pairs - row ``i`` is also kept within ``max_step`` of each
        of its references, as far as that is compatible with the step from the previous row (which always holds).
        A NaN in ``prev`` or a reference leaves that column unbound by it (an unknown position)."""
        a = np.asarray(rows, dtype=np.float32)
        if self.max_step is None or len(a) == 0:
            return a, 0
        out = a.astype(np.float64).copy()
        last = None if prev is None else np.asarray(prev, dtype=np.float64).reshape(-1)
        extra: dict = {}
        for i, ref in anchors:
            extra.setdefault(int(i), []).append(np.asarray(ref, dtype=np.float64).reshape(-1))
        changed = 0
        L = self.max_step
        for i in range(len(out)):
            lo = np.full(self.dims, -np.inf) if last is None else np.where(np.isnan(last), -np.inf, last - L)
            hi = np.full(self.dims, np.inf) if last is None else np.where(np.isnan(last), np.inf, last + L)
            for ref in extra.get(i, []):          # narrowed to each anchor's window while it overlaps; where one
                known = ~np.isnan(ref)            # does not, the point of the window nearest to it (the step from
                nlo, nhi = np.maximum(lo, ref - L), np.minimum(hi, ref + L)     # the previous row always holds)
                below, above = ref + L < lo, ref - L > hi
                nlo = np.where(below, lo, np.where(above, hi, nlo))
                nhi = np.where(below, lo, np.where(above, hi, nhi))
                lo, hi = np.where(known, nlo, lo), np.where(known, nhi, hi)
            row = np.clip(out[i], lo, hi)
            if np.any(row != out[i]):
                changed += 1
            out[i] = row
            last = out[i]
        return out.astype(np.float32), changed
