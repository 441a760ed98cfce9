"""The node's output messages, built from the pipeline's plain records: one function per message type.

This file owns how a ``ControlSample`` becomes an ``oxygen_ros/ActionChunk``, how a new chunk's ``ChunkView`` becomes a
``trajectory_msgs/JointTrajectory`` (for ros2_control's ``joint_trajectory_controller``: one point per row from the
current row on, ``time_from_start = i * step_dt``, velocities by finite differences -- central inside, one-sided at
the two ends, zero for a single point --, ``header.stamp`` = when the first point is due, i.e. the start of the
current row's slot, at most one control step before publication), and how ``TokenOut`` / ``MemoryOut`` /
``ResponseOut`` become ``LanguageToken`` / ``MemoryEntry`` / ``ConversationResponse`` (and the ``Converse`` action's
result and feedback) — used by the live node and by the offline tools that write the same messages into bags, so
both produce identical messages for identical records.
"""
from __future__ import annotations

import numpy as np
from builtin_interfaces.msg import Duration as DurationMsg
from builtin_interfaces.msg import Time as TimeMsg
from trajectory_msgs.msg import JointTrajectory, JointTrajectoryPoint

from oxygen_ros.msg import ActionChunk, ConversationResponse, LanguageToken, MemoryEntry

from .control import ChunkView, ControlSample
from .language import MemoryOut, ResponseOut, TokenOut

__all__ = ["time_msg", "duration_msg", "action_chunk", "joint_trajectory", "finite_difference_velocities",
           "language_token", "memory_entry", "conversation_response", "converse_result", "converse_feedback"]


def time_msg(ns: int) -> TimeMsg:
    return TimeMsg(sec=int(ns // 1_000_000_000), nanosec=int(ns % 1_000_000_000))


def duration_msg(ns: int) -> DurationMsg:
    return DurationMsg(sec=int(ns // 1_000_000_000), nanosec=int(ns % 1_000_000_000))


def finite_difference_velocities(positions: np.ndarray, step_dt: float) -> np.ndarray:
    """[n, A] positions at ``step_dt`` spacing -> [n, A] velocities: central differences inside, one-sided
    (forward at the first point, backward at the last) at the ends, zeros for a single point."""
    p = np.asarray(positions, dtype=np.float64)
    v = np.zeros_like(p)
    if len(p) >= 2:
        v[1:-1] = (p[2:] - p[:-2]) / (2.0 * step_dt)
        v[0] = (p[1] - p[0]) / step_dt
        v[-1] = (p[-1] - p[-2]) / step_dt
    return v


def joint_trajectory(v: ChunkView, *, step_dt: float, joint_names: list[str]) -> JointTrajectory:
    """A new chunk's rows from the current one on as a JointTrajectory (see the module docstring)."""
    m = JointTrajectory()
    first_ns = int(round(v.first_due * 1e9))
    m.header.stamp = time_msg(first_ns)
    m.header.frame_id = v.frame_id
    m.joint_names = list(joint_names)
    vel = finite_difference_velocities(v.rows, step_dt)
    step_ns = int(round(step_dt * 1e9))
    for i, (row, vrow) in enumerate(zip(np.asarray(v.rows, dtype=np.float64), vel)):
        pt = JointTrajectoryPoint()
        pt.positions = row.tolist()
        pt.velocities = vrow.tolist()
        pt.time_from_start = duration_msg(i * step_ns)
        m.points.append(pt)
    return m


def action_chunk(s: ControlSample, *, now_ns: int, step_dt: float, joint_names: list[str]) -> ActionChunk:
    """The remainder ``s.actions`` as published at control tick ``now_ns`` (row 0 = this tick)."""
    m = ActionChunk()
    m.header.stamp = time_msg(s.capture_ns)
    m.header.frame_id = s.frame_id
    m.frame_index = int(s.frame_index)
    m.chunk_id = int(s.chunk_id)
    m.start_time = time_msg(now_ns)
    m.step_dt = float(step_dt)
    m.horizon = int(s.actions.shape[0])
    m.action_dim = int(s.actions.shape[1])
    m.joint_names = list(joint_names) if len(joint_names) == s.actions.shape[1] else []
    m.actions = s.actions.reshape(-1).astype(np.float32).tolist()
    m.inference_latency_ms = float(s.latency_ms)
    m.observation_age_s = float((now_ns - s.capture_ns) / 1e9)
    m.blended = bool(s.blended)
    return m


def language_token(t: TokenOut) -> LanguageToken:
    m = LanguageToken()
    m.header.stamp = time_msg(t.stamp_ns)
    m.request_id = int(t.request_id)
    m.task = t.kind
    m.frame_index = max(0, int(t.frame_index))
    m.index = int(t.index)
    m.token_id = int(t.token_id)
    m.text = t.text
    m.is_final = bool(t.is_final)
    m.finish_reason = t.finish_reason
    return m


def memory_entry(e: MemoryOut) -> MemoryEntry:
    m = MemoryEntry()
    m.header.stamp = time_msg(e.stamp_ns)
    m.header.frame_id = e.frame_id
    m.entry_id = int(e.entry_id)
    m.frame_index = int(e.frame_index)
    m.text = e.text
    m.source_prompt = e.source_prompt
    m.request_id = int(e.request_id)
    m.num_tokens = int(e.num_tokens)
    return m


def conversation_response(r: ResponseOut) -> ConversationResponse:
    m = ConversationResponse()
    m.header.stamp = time_msg(r.stamp_ns)
    m.request_id = int(r.request_id)
    m.prompt, m.model_prompt, m.text = r.prompt, r.model_prompt, r.text
    m.finish_reason, m.detail = r.finish_reason, r.detail
    m.num_tokens = int(r.num_tokens)
    m.frame_index = max(0, int(r.frame_index))
    m.time_to_first_token_s, m.total_time_s = float(r.ttft_s), float(r.total_s)
    return m


def converse_result(r: ResponseOut):
    from oxygen_ros.action import Converse  # noqa: PLC0415 - only the node's action server needs it

    m = Converse.Result()
    m.request_id = int(r.request_id)
    m.text, m.finish_reason, m.detail = r.text, r.finish_reason, r.detail
    m.num_tokens = int(r.num_tokens)
    m.frame_index = max(0, int(r.frame_index))
    m.time_to_first_token_s, m.total_time_s = float(r.ttft_s), float(r.total_s)
    return m


def converse_feedback(request_id: int, p):
    """``p``: a ``converse.Progress`` (the pieces since the previous feedback)."""
    from oxygen_ros.action import Converse  # noqa: PLC0415

    m = Converse.Feedback()
    m.request_id = int(request_id)
    m.frame_index = max(0, int(p.frame_index))
    m.pieces = list(p.pieces)
    m.text = p.text
    m.num_tokens = int(p.num_tokens)
    return m
