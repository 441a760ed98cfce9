"""Conversions between the simulation core's plain values (``oxygen_ros/sim``) and ROS messages.

This file owns one mapping, shared by every runner so they cannot drift apart: the lockstep policy runner
(``ros/lockstep.py``), the ROS simulation node (``ros/sim_node.py``) and the episode recorder
(``tools/sim/record.py``).  ``trajectory_from_msg`` reads a ``trajectory_msgs/JointTrajectory`` the way the robot's
executor needs it (start = ``header.stamp``, point times = ``time_from_start``; a point whose ``positions`` length
differs from the names is kept as a ragged row so the executor rejects the trajectory with its reason);
``camera_msg`` / ``joint_state_msg`` / ``episode_status_msg`` / ``text_target_msg`` build what the simulation
publishes and records.  Times are nanoseconds of sim time.
"""
from __future__ import annotations

import numpy as np

from oxygen_ros.sim.execution import Trajectory

from .images import rgb_to_image
from .messages import time_msg

__all__ = ["CAMERA_FRAMES", "trajectory_from_msg", "camera_msg", "joint_state_msg", "episode_status_msg",
           "text_target_msg", "stamp_s"]

CAMERA_FRAMES = {"top": "camera_top", "left_wrist": "camera_left_wrist", "right_wrist": "camera_right_wrist"}


def stamp_s(stamp) -> float:
    return int(stamp.sec) + int(stamp.nanosec) * 1e-9


def trajectory_from_msg(msg, time_offset_s: float = 0.0) -> Trajectory:
    """JointTrajectory -> Trajectory (start = header.stamp - ``time_offset_s``, e.g. an episode's start)."""
    times = np.array([int(p.time_from_start.sec) + int(p.time_from_start.nanosec) * 1e-9 for p in msg.points])
    rows = [list(p.positions) for p in msg.points]
    n = len(msg.joint_names)
    if all(len(r) == n for r in rows):
        positions = np.array(rows, dtype=np.float64).reshape(len(rows), n)
    else:
        positions = np.array(rows, dtype=object)          # ragged: the executor names it "wrong_length"
    return Trajectory(stamp_s(msg.header.stamp) - time_offset_s, tuple(msg.joint_names), times, positions)


def camera_msg(rgb: np.ndarray, stamp_ns: int, camera: str, msg=None):
    return rgb_to_image(rgb, "rgb8", stamp=time_msg(stamp_ns), frame_id=CAMERA_FRAMES.get(camera, camera), msg=msg)


def joint_state_msg(names, position, stamp_ns: int):
    from sensor_msgs.msg import JointState  # noqa: PLC0415

    m = JointState()
    m.header.stamp = time_msg(stamp_ns)
    m.name = list(names)
    m.position = [float(v) for v in position]
    return m


def episode_status_msg(stamp_ns: int, *, episode_id: int, seed: int, task: str, instruction: str, elapsed: float,
                       done: bool, success: bool, detail: str):
    from oxygen_ros.msg import EpisodeStatus  # noqa: PLC0415

    m = EpisodeStatus()
    m.header.stamp = time_msg(stamp_ns)
    m.episode_id, m.seed, m.task, m.instruction = int(episode_id), int(seed), task, instruction
    m.elapsed, m.done, m.success, m.detail = float(elapsed), bool(done), bool(success), detail
    return m


def text_target_msg(stamp_ns: int, kind: str, prompt: str, text: str):
    from oxygen_ros.msg import TextTarget  # noqa: PLC0415

    m = TextTarget()
    m.header.stamp = time_msg(stamp_ns)
    m.kind, m.prompt, m.text = kind, prompt, text
    return m
