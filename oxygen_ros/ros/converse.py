"""What the ``converse`` action does with a goal, without ROS: the goal's overrides checked and bounded by the node's
limits (``goal_request``), and one goal's answer as the action server streams it (``GoalStream``).

This file owns the goal semantics the ``Converse.action`` comments promise: an empty prompt or an out-of-range
temperature / top_p is refused with a reason; ``max_new_tokens`` 0 means the node's and larger values are capped
at it (the KV pool is sized for it); a negative temperature or a non-positive top_p means the node's; an over-long
prompt is truncated to ``max_prompt_chars`` like a topic prompt.  ``GoalStream`` collects the pieces the
``RequestTracker`` forwards for the goal's request (any thread) until the action server takes them as one feedback
(batched: everything since the previous feedback), and holds the request's end (``ResponseOut``).  The rclpy side is
``converse_server.py``.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass

from .language import ResponseOut, TokenOut

__all__ = ["GoalRequest", "goal_request", "GoalStream", "Progress", "TEMPERATURE_MAX"]

TEMPERATURE_MAX = 10.0          # the node's `temperature` parameter range


@dataclass(frozen=True)
class GoalRequest:
    prompt: str
    max_new_tokens: int | None   # None = the node's
    temperature: float | None    # None = the node's
    top_p: float | None          # None = the node's
    truncated: bool = False      # the prompt was cut to max_prompt_chars

    def options(self) -> dict:
        return {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature, "top_p": self.top_p}


def goal_request(prompt: str, max_new_tokens: int, temperature: float, top_p: float, *, node_max_new_tokens: int,
                 max_prompt_chars: int) -> GoalRequest | str:
    """A goal's fields -> the request to submit, or the reason it is refused."""
    text = (prompt or "").strip()
    if not text:
        return "empty prompt"
    if not math.isfinite(temperature) or temperature > TEMPERATURE_MAX:
        return f"temperature {temperature} outside the node's limit [0, {TEMPERATURE_MAX:g}] (negative = default)"
    if not math.isfinite(top_p) or top_p > 1.0:
        return f"top_p {top_p} outside (0, 1] (0 or negative = default)"
    cut = len(text) > max_prompt_chars
    return GoalRequest(text[:max_prompt_chars], min(int(max_new_tokens), node_max_new_tokens) or None,
                       float(temperature) if temperature >= 0 else None, float(top_p) if top_p > 0 else None, cut)


@dataclass(frozen=True)
class Progress:
    """What one feedback (and, once ``result`` is set, the final one) carries."""
    pieces: list                 # token texts since the previous take()
    text: str                    # the answer so far
    num_tokens: int
    frame_index: int
    result: ResponseOut | None   # the request's end, once known


class GoalStream:
    """One goal's streamed answer; ``push``/``finish`` from any thread, ``take`` from the action server's."""

    def __init__(self, request_id: int):
        self.request_id = request_id
        self._lock = threading.Lock()
        self._new: list[str] = []
        self._text: list[str] = []
        self._n = 0
        self._frame_index = 0
        self._result: ResponseOut | None = None

    def push(self, t: TokenOut) -> None:
        with self._lock:
            self._frame_index = max(0, t.frame_index)
            if t.token_id >= 0:              # -1 = the empty final marker of a request that produced no token
                self._n = t.index + 1
            if t.text:
                self._new.append(t.text)
                self._text.append(t.text)

    def finish(self, r: ResponseOut) -> None:
        with self._lock:
            self._result = r

    def take(self) -> Progress:
        with self._lock:
            new, self._new = self._new, []
            return Progress(new, "".join(self._text), self._n, self._frame_index, self._result)
