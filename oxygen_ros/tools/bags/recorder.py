"""Online recording of the node's outputs over DDS into an output bag with the layout of ``oxygen bag-eval``
(``oxygen replay BAG --record OUT``), so that a team can compare a live run with an offline one (``oxygen bag-diff
--match stamp``).

This file owns the subscriber side: ``OutputRecorder(node, bag, clock_ns)`` subscribes (reliable, deep queues, raw
CDR) to every topic of ``tools/output_bag.OUTPUTS`` under the bag's resolved names and writes each message as
received, logged at ``clock_ns()`` (bag time when the replay publishes ``/clock``, else the ROS time of reception).
``action_chunk`` keeps bag-eval's unit: the node republishes the remainder of the newest chunk at
``control_rate_hz``, and only the first message of each ``chunk_id`` (the whole chunk at its first control tick)
is recorded; ``every_tick=True`` records all of them.  Callbacks run in the caller's executor thread; the caller
spins the node and closes the bag.
"""
from __future__ import annotations

import threading
from typing import Callable

from .classes import msg_class
from .output import OUTPUTS, OutputBag

__all__ = ["OutputRecorder"]


class OutputRecorder:
    def __init__(self, node, bag: OutputBag, clock_ns: Callable[[], int], *, every_tick: bool = False):
        from rclpy.qos import HistoryPolicy, QoSProfile, ReliabilityPolicy  # noqa: PLC0415
        from rclpy.serialization import deserialize_message  # noqa: PLC0415

        self.bag, self.clock_ns, self.every_tick = bag, clock_ns, every_tick
        self._chunk_type = msg_class(OUTPUTS["action_chunk"])
        self._deserialize = deserialize_message
        self._last_chunk: int | None = None       # a chunk's messages are consecutive: a newer chunk replaces it
        self._lock = threading.Lock()
        self.received = 0
        qos = QoSProfile(depth=1000, reliability=ReliabilityPolicy.RELIABLE, history=HistoryPolicy.KEEP_LAST)
        self._subs = [node.create_subscription(msg_class(typ), bag.topics[out],
                                               lambda raw, out=out: self._on_message(out, raw), qos, raw=True)
                      for out, typ in OUTPUTS.items()]

    def _on_message(self, output: str, raw: bytes) -> None:
        with self._lock:
            self.received += 1
            if output == "action_chunk" and not self.every_tick:
                cid = int(self._deserialize(raw, self._chunk_type).chunk_id)
                if cid == self._last_chunk:
                    return
                self._last_chunk = cid
            self.bag.write_raw(output, self.clock_ns(), raw)
