"""The generated ROS message class of a bag's type name, for the tools that publish or subscribe raw CDR over DDS.

This file owns one mapping: ``msg_class("oxygen_ros/msg/ActionChunk")`` -> ``oxygen_ros.msg.ActionChunk`` (imports the
generated ``pkg.msg`` module of the name).  ``replay.py`` publishes a bag's recorded bytes with it, ``recorder.py``
subscribes to the node's outputs with it.  Reading and writing bags needs only the type store
(``oxygen_ros/bags/types.py``); this is the ROS side of the same names.  No rclpy at import.
"""
from __future__ import annotations

import importlib

__all__ = ["msg_class"]


def msg_class(msgtype: str):
    """The generated Python class of a message type name ``pkg/msg/Name`` (imports ``pkg.msg``)."""
    pkg, sep, name = msgtype.partition("/msg/")
    if not sep or not name:
        raise ValueError(f"not a message type name of the form pkg/msg/Name: {msgtype!r}")
    return getattr(importlib.import_module(f"{pkg}.msg"), name)
