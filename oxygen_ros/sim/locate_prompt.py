"""The named cube's cell in the action prompt: the localisation-conditioning experiment (issue 26's diagnosis).

``oxygen sim-diagnose`` shows the demo policy's VLM locating the named cube (its "Where is the X cube?" answer within
one cell of 8 x 8 in every scene) while the action plan barely moves with the cube: the prefix holds the cube's place,
the action expert does not use it.  The experiment asks whether the action expert follows the cube once its place is
*text* in the prompt.  A policy fine-tuned with the cell appended to every instruction (``oxygen train
--locate-in-instruction``: "touch the red cube with the left gripper (row 3 column 5)") is driven by one of two
wrappers around a ``ros.lockstep.PipelinePolicy`` (``oxygen sim-eval --locate-prompt oracle|self``):

- ``LocateOracle``: the true cell, read from the simulator at every control step - an upper bound, not deployable;
- ``LocateSelf``: the model's own answer.  Every camera frame it asks "Where is the <named> cube?" through the node's
  conversation path (the same frame's shared prefix serves the question and the action: OxyGen's cross-task sharing);
  the answer goes into the instruction of the *next* frame's action (one camera period stale).  The first frame, with
  no answer yet, uses the plain instruction.

Both send a changed instruction to the node's pipeline as an ``/instruction`` message would (the cube moves in pick
and transfer).  Duck-typed on the policy: no import of the ROS shell.
"""
from __future__ import annotations

import dataclasses

from .tasks import cube_locations, locate_question, located_instruction, parse_cell

__all__ = ["LocateOracle", "LocateSelf", "wrap"]


class _LocatePrompt:
    def __init__(self, policy):
        self.policy = policy
        self._sent: str | None = None
        self._sim = self._question = None

    def reset(self, spec, sim) -> None:
        self.policy.reset(spec, sim)
        self._sim, self._question, self._sent = sim, locate_question(spec.target), None

    def cell(self) -> str | None:                  # the cell to write into this frame's instruction
        raise NotImplementedError

    def act(self, obs, ready_t: float) -> list:
        cell = self.cell()
        text = obs.instruction if cell is None else located_instruction(obs.instruction, cell)
        if self._sent is not None and text != self._sent:
            self.policy.pipeline.inputs.on_instruction(text)
        self._sent = text
        self.before_act()
        return self.policy.act(dataclasses.replace(obs, instruction=text), ready_t)

    def before_act(self) -> None:
        pass

    def __getattr__(self, name):                   # language_log, horizon, cycle_outcomes, close, ...
        return getattr(self.policy, name)


class LocateOracle(_LocatePrompt):
    """The named cube's true cell (``sim.tasks.cube_locations``) at every control step."""

    def cell(self) -> str | None:
        return cube_locations(self._sim)[self._question]


class LocateSelf(_LocatePrompt):
    """The model's own newest well-formed answer to "Where is the <named> cube?", asked every camera frame."""

    def reset(self, spec, sim) -> None:
        super().reset(spec, sim)
        self.asked = 0

    def cell(self) -> str | None:
        good = [e["text"].strip() for e in self.policy.language_log
                if e["kind"] == "conversation" and e["prompt"] == self._question and parse_cell(e["text"])]
        return good[-1] if good else None

    def before_act(self) -> None:
        # queued before the cycle: answered from the same frame's prefix as this cycle's action
        self.policy.pipeline.inputs.on_prompt(self._question, self.policy.clock.ns)
        self.asked += 1


def wrap(policy, mode: str | None):
    """``policy`` wrapped for ``--locate-prompt`` mode ``oracle`` | ``self`` (None / "": unwrapped)."""
    if not mode:
        return policy
    try:
        return {"oracle": LocateOracle, "self": LocateSelf}[mode](policy)
    except KeyError:
        raise ValueError(f"locate prompt mode must be oracle or self, got {mode!r}") from None
