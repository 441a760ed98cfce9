"""The output bag of a run: the node's outputs written to a rosbag2 bag, the same layout whether they come from
``oxygen bag-eval`` (offline, bag time) or ``oxygen replay --record`` (online, over DDS).

This file owns that layout: ``OUTPUTS`` (the node's relative output names and their message types; resolved with
the node's namespace/remaps by ``TopicNames``), and ``OutputBag``, a ``rosbags`` writer (MCAP default, sqlite3
optional, metadata version 9) whose connections carry our ``oxygen_ros`` types (registered from ``msg/*.msg``, so
``ros2 bag`` and rosbags can read them back).  Every output topic gets a connection even when nothing is written to
it, so two runs always have the same topics.  ``write(output, stamp_ns, msg)`` serialises an rclpy message with
``rclpy.serialization.serialize_message`` (CDR, no DDS involved; padding zeroed, see ``write``); ``write_raw``
takes CDR bytes as received.  The
bag's log time is the caller's clock (bag time offline, the receive time online).  Messages are written in call
order; given the same calls the files are byte-identical (rosbag2 stores the bag directory's name inside them, so
compare runs written under the same directory name).
"""
from __future__ import annotations

import collections
import os
import shutil
from pathlib import Path

from oxygen_ros.bags.types import typestore
from .topic_names import TopicNames

__all__ = ["OUTPUTS", "OutputBag", "bag_files"]

# the node's outputs (relative names, as node.py publishes them) -> message type
OUTPUTS: dict[str, str] = {
    "action_chunk": "oxygen_ros/msg/ActionChunk",
    "language/tokens": "oxygen_ros/msg/LanguageToken",
    "conversation/response": "std_msgs/msg/String",
    "memory/entries": "oxygen_ros/msg/MemoryEntry",
}


def bag_files(path: str | os.PathLike) -> list[Path]:
    """A bag directory's files that make up the bag (metadata.yaml and the storage files it lists)."""
    import yaml  # noqa: PLC0415

    path = Path(path)
    meta = yaml.safe_load((path / "metadata.yaml").read_text())["rosbag2_bagfile_information"]
    return [path / "metadata.yaml"] + [path / f for f in meta.get("relative_file_paths", [])]


class OutputBag:
    """``with OutputBag(path, TopicNames(...)) as bag: bag.write("action_chunk", stamp_ns, msg)``."""

    def __init__(self, path: str | os.PathLike, names: TopicNames | None = None, *, storage: str = "mcap",
                 overwrite: bool = False):
        from rosbags.rosbag2 import StoragePlugin, Writer  # noqa: PLC0415

        self.path = Path(path)
        if self.path.exists():
            if not overwrite:
                raise FileExistsError(f"{self.path} exists (use --overwrite)")
            shutil.rmtree(self.path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        plugin = {"mcap": StoragePlugin.MCAP, "sqlite3": StoragePlugin.SQLITE3}[storage]
        names = names or TopicNames()
        ts = typestore()
        self._writer = Writer(self.path, version=9, storage_plugin=plugin)
        self._writer.open()
        self.topics = {out: names.resolve(out) for out in OUTPUTS}         # output -> bag topic
        self._conns = {out: self._writer.add_connection(self.topics[out], typ, typestore=ts)
                       for out, typ in OUTPUTS.items()}
        self.counts: collections.Counter = collections.Counter()
        self._ts = ts
        self._serialize = None

    def write(self, output: str, stamp_ns: int, msg) -> None:
        """Serialise an rclpy message of ``output``'s type and write it at log time ``stamp_ns``.  rclpy's
        serialiser (Fast CDR) leaves alignment padding uninitialised, so the bytes are re-encoded once by rosbags
        (same values, zeroed padding): identical messages give identical bytes."""
        if self._serialize is None:
            from rclpy.serialization import serialize_message  # noqa: PLC0415
            self._serialize = serialize_message
        typ = OUTPUTS[output]
        raw = self._serialize(msg)
        self.write_raw(output, stamp_ns, self._ts.serialize_cdr(self._ts.deserialize_cdr(raw, typ), typ))

    def write_raw(self, output: str, stamp_ns: int, raw: bytes) -> None:
        self._writer.write(self._conns[output], int(stamp_ns), bytes(raw))
        self.counts[output] += 1

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> "OutputBag":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
