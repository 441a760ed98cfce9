"""The ``converse`` action server (``oxygen_ros/action/Converse``): a question as a goal, the streamed answer as
feedback, the full answer as the result, cancel to stop it.

This file owns the rclpy side of the action; the goal semantics are ``converse.py``'s.  Nothing here holds an
executor thread or makes the inference thread wait: the goal callback only checks the goal and the capacity
(``max_goals`` goals in flight; more are rejected, the reason logged and counted as ``converse_rejected.<reason>``);
the execute callback is a coroutine that submits the request through the pipeline (thread-safe) and then awaits a
future; the inference thread's token and end records (``on_token`` / ``on_response``, forwarded by the node's
``Outputs``) only append to the goal's ``GoalStream`` and trigger a guard condition; the guard's callback, in the
executor, publishes one feedback with every piece since the previous one (one flush at a time, so feedback stays in
order) and completes the future when the request ended.  The result is sent ``RESULT_GRACE_S`` after that last
feedback: rclpy's ActionClient drops feedback that it takes after the result, and a busy client may still have
feedback queued.  Cancel asks the engine to stop the request (``Pipeline.cancel``: honoured before the next decode, KV freed);
the goal then ends CANCELED with the partial answer.  ``eos``/``length`` end SUCCEEDED, anything else ABORTED.
The goal, cancel and result services queue ``SERVICE_QUEUE`` requests, so a burst of goals or cancels is answered
in full (each goal accepted or rejected with its reason counted), never dropped.
"""
from __future__ import annotations

import threading

from rclpy.action import ActionServer, CancelResponse, GoalResponse
from rclpy.callback_groups import ReentrantCallbackGroup
from rclpy.qos import HistoryPolicy, QoSProfile, ReliabilityPolicy
from rclpy.task import Future

from oxygen_ros.action import Converse

from . import messages
from .converse import GoalStream, goal_request
from .diagnostics import Reporter
from .language import ResponseOut, TokenOut

__all__ = ["ConverseServer", "RESULT_GRACE_S"]

RESULT_GRACE_S = 0.05
# The action's goal / cancel / result services keep this many requests.  rclpy's default (the services profile,
# KEEP_LAST 10) let a burst of goals overflow the server's request queue: the oldest requests were dropped without
# a response and those clients waited forever.  Every request must be answered (accepted or rejected), so the queue
# is deep enough for any realistic burst (tested with 100 goals at once).
SERVICE_QUEUE = 1000


_SERVICE_QOS = QoSProfile(depth=SERVICE_QUEUE, reliability=ReliabilityPolicy.RELIABLE,
                          history=HistoryPolicy.KEEP_LAST)


class _Goal:
    def __init__(self, handle, request_id: int):
        self.handle = handle
        self.stream = GoalStream(request_id)
        self.done = Future()


class ConverseServer:
    def __init__(self, node, pipeline, report: Reporter, *, max_goals: int, name: str = "converse"):
        self.node, self.pipeline, self.report = node, pipeline, report
        self.max_goals = int(max_goals)
        self._lock = threading.Lock()
        self._goals: dict[int, _Goal] = {}          # request_id -> goal
        self._by_uuid: dict[bytes, int] = {}        # goal uuid -> request_id
        self._reserved = 0                          # accepted goals whose execute callback has not started yet
        self._flush_lock = threading.Lock()
        self._cb = ReentrantCallbackGroup()
        self._guard = node.create_guard_condition(self._flush, callback_group=self._cb)
        self._server = ActionServer(
            node, Converse, name, execute_callback=self._execute, goal_callback=self._on_goal,
            cancel_callback=self._on_cancel, callback_group=self._cb,
            goal_service_qos_profile=_SERVICE_QOS, cancel_service_qos_profile=_SERVICE_QOS,
            result_service_qos_profile=_SERVICE_QOS,
            feedback_pub_qos_profile=QoSProfile(depth=100), result_timeout=60)

    # ---------------------------------------------------------------------------------------------- goal callbacks
    def _check(self, goal):
        s = self.pipeline.settings
        return goal_request(goal.prompt, goal.max_new_tokens, goal.temperature, goal.top_p,
                            node_max_new_tokens=int(s.max_new_tokens), max_prompt_chars=int(s.max_prompt_chars))

    def _on_goal(self, goal) -> GoalResponse:
        req = self._check(goal)
        with self._lock:
            full = len(self._goals) + self._reserved >= self.max_goals
            if not full and not isinstance(req, str):
                self._reserved += 1
        if isinstance(req, str) or full:
            reason, why = ("invalid", req) if isinstance(req, str) else \
                ("capacity", f"{self.max_goals} goals in flight (converse_max_goals)")
            self.report.event(f"converse_rejected.{reason}", f"converse goal rejected: {why}")
            return GoalResponse.REJECT
        self.report.count("converse_goals")
        return GoalResponse.ACCEPT

    def _on_cancel(self, handle) -> CancelResponse:
        with self._lock:
            rid = self._by_uuid.get(bytes(handle.goal_id.uuid))
        if rid is None:                  # execute has not started: it will see is_cancel_requested
            return CancelResponse.ACCEPT
        return CancelResponse.ACCEPT if self.pipeline.cancel(rid) else CancelResponse.REJECT

    async def _execute(self, handle):
        req = self._check(handle.request)
        rid = self.pipeline.new_request_id()
        g = _Goal(handle, rid)
        with self._lock:
            self._reserved -= 1
            self._goals[rid] = g
            self._by_uuid[bytes(handle.goal_id.uuid)] = rid
        try:
            if isinstance(req, str):     # cannot happen (checked at acceptance), kept as a guard
                self.pipeline.requests.end(rid, "conversation", handle.request.prompt, "rejected", req)
            elif handle.is_cancel_requested:
                self.pipeline.requests.end(rid, "conversation", req.prompt, "cancelled", "cancelled before it started")
            else:
                if req.truncated:
                    self.report.event("prompt_truncated", "converse goal prompt truncated to max_prompt_chars")
                self.pipeline.submit("conversation", req.prompt, request_id=rid, **req.options())
            res: ResponseOut = await g.done
            await self._after(RESULT_GRACE_S)
        finally:
            with self._lock:
                self._goals.pop(rid, None)
                self._by_uuid.pop(bytes(handle.goal_id.uuid), None)
        if handle.is_cancel_requested and res.finish_reason == "cancelled":
            handle.canceled()
        elif res.completed:
            handle.succeed()
        else:
            handle.abort()
        return messages.converse_result(res)

    def _after(self, seconds: float) -> Future:
        """A future completed by a one-shot timer (awaited without holding an executor thread)."""
        fut = Future()
        timer = None

        def fire():
            timer.cancel()
            if not fut.done():
                fut.set_result(None)
            self.node.destroy_timer(timer)
        timer = self.node.create_timer(seconds, fire, callback_group=self._cb)
        return fut

    # ---------------------------------------------------------------------------------------------- from the tracker
    def on_token(self, t: TokenOut) -> None:
        g = self._goals.get(t.request_id)
        if g is not None:
            g.stream.push(t)
            self._wake()

    def on_response(self, r: ResponseOut) -> None:
        g = self._goals.get(r.request_id)
        if g is not None:
            g.stream.finish(r)
            self._wake()

    def _wake(self) -> None:
        try:
            self._guard.trigger()
        except Exception:  # noqa: BLE001 - destroyed during shutdown
            pass

    def _flush(self) -> None:
        """Executor side: one feedback per goal with news; complete the goals whose request ended."""
        with self._lock:
            goals = list(self._goals.values())
        with self._flush_lock:
            self._flush_goals(goals)

    def _flush_goals(self, goals: list) -> None:
        for g in goals:
            p = g.stream.take()
            if p.pieces:
                try:
                    g.handle.publish_feedback(messages.converse_feedback(g.stream.request_id, p))
                except Exception as exc:  # noqa: BLE001 - goal already terminal / server going away
                    self.report.log("converse_feedback", f"converse feedback not published: {exc}")
            if p.result is not None and not g.done.done():
                g.done.set_result(p.result)

    def active(self) -> int:
        with self._lock:
            return len(self._goals)

    def destroy(self) -> None:
        """Stop: cancel the goals' requests and destroy the server (clients see it go away; goals in flight get no
        result).  Safe during shutdown (the context may already be gone)."""
        with self._lock:
            rids = list(self._goals)
        for rid in rids:
            self.pipeline.cancel(rid)
        for destroy in (self._server.destroy, lambda: self.node.destroy_guard_condition(self._guard)):
            try:
                destroy()
            except Exception:  # noqa: BLE001 - shutting down
                pass
