"""The message types of the project's bags, in one place for every tool that reads or writes them.

This file owns how a bag's type names become types: ``typestore()`` is a rosbags Typestore for ROS 2 Kilted plus the
``oxygen_ros`` messages, registered from the ``.msg`` text in ``msg/`` (source checkout or the installed share
directory), so ``ros2 bag`` and rosbags read our bags and we read bags recorded on a robot.  ``tools/bags/``
(replay.py: make-bag, replay; output.py: the output bag writer; eval.py, diff.py), ``tools/sim/record.py`` and
``train/data.py`` import it; it imports none of them.  No rclpy: rosbags (and ament_index to find an installed
msg/); the generated ROS classes of the same names, for DDS, are ``tools/bags/classes.py``'s.
"""
from __future__ import annotations

from pathlib import Path

__all__ = ["msg_dir", "typestore"]


def msg_dir() -> Path | None:
    """The package's msg/ folder: source checkout, or the installed share dir."""
    here = Path(__file__).resolve().parents[2] / "msg"
    if here.is_dir():
        return here
    try:
        from ament_index_python.packages import get_package_share_directory  # noqa: PLC0415
        p = Path(get_package_share_directory("oxygen_ros")) / "msg"
        return p if p.is_dir() else None
    except Exception:  # noqa: BLE001
        return None


def typestore():
    """A rosbags Typestore for ROS 2 Kilted plus the oxygen_ros message types (from msg/*.msg)."""
    from rosbags.typesys import Stores, get_typestore, get_types_from_msg  # noqa: PLC0415

    ts = get_typestore(Stores.ROS2_KILTED)
    d = msg_dir()
    if d is not None:
        types = {}
        for f in sorted(d.glob("*.msg")):
            types.update(get_types_from_msg(f.read_text(), f"oxygen_ros/msg/{f.stem}"))
        ts.register(types)
    return ts

