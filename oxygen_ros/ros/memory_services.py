"""The memory services: ``memory/query`` (``oxygen_ros/srv/QueryMemory``) and ``memory/clear``
(``oxygen_ros/srv/ClearMemory``), served from the pipeline's ``MemoryLog``.

This file owns the request -> ``MemoryQuery`` mapping (zero times and -1 frames = unbounded, limit 0 = 100) and the
answers: entries newest first, or ``success: false`` with a message that says what is wrong (a bad range, a limit
over 1000, a database that cannot be read, a clear without ``confirm: true``).  The callbacks run in the executor
(their own callback group), never in the inference or control threads; SQLite reads use the store's read connection,
so a query does not wait for a write.
"""
from __future__ import annotations

from rclpy.callback_groups import MutuallyExclusiveCallbackGroup

from oxygen_ros.srv import ClearMemory, QueryMemory

from . import messages
from .diagnostics import Reporter
from .inputs import stamp_ns
from .language import memory_out
from .memory_log import MemoryLog
from .memory_store import MemoryQuery

__all__ = ["MemoryServices", "memory_query"]


def memory_query(req) -> MemoryQuery:
    """QueryMemory.Request -> MemoryQuery (the bounds as the .srv comments define them)."""
    start, end = stamp_ns(req.start_time), stamp_ns(req.end_time)
    return MemoryQuery(text_contains=req.text_contains, start_ns=start or None, end_ns=end or None,
                       min_frame=None if req.min_frame_index < 0 else int(req.min_frame_index),
                       max_frame=None if req.max_frame_index < 0 else int(req.max_frame_index),
                       limit=int(req.limit) or 100)


class MemoryServices:
    def __init__(self, node, memory: MemoryLog, report: Reporter):
        self.node, self.memory, self.report = node, memory, report
        cb = MutuallyExclusiveCallbackGroup()
        self._services = [node.create_service(QueryMemory, "memory/query", self._query, callback_group=cb),
                          node.create_service(ClearMemory, "memory/clear", self._clear, callback_group=cb)]

    def _query(self, req, resp):
        q = memory_query(req)
        try:
            entries = self.memory.query(q)
        except (ValueError, RuntimeError) as exc:
            resp.success, resp.message = False, str(exc)
            self.report.event("memory_query_errors", f"memory/query refused: {exc}")
            return resp
        resp.entries = [messages.memory_entry(memory_out(e)) for e in entries]
        resp.success = True
        resp.message = f"{len(entries)} entries" + (f" (limit {q.limit})" if len(entries) == q.limit else "")
        return resp

    def _clear(self, req, resp):
        if not req.confirm:
            resp.success, resp.message = False, "nothing deleted: set confirm: true to delete every memory entry"
            return resp
        try:
            resp.deleted = self.memory.clear()
        except RuntimeError as exc:
            resp.success, resp.message = False, str(exc)
            return resp
        resp.success, resp.message = True, f"deleted {resp.deleted} memory entries from {self.memory.path or 'memory'}"
        self.node.get_logger().warning(resp.message + " (memory/clear)")
        return resp

    def destroy(self) -> None:
        for srv in self._services:
            try:
                self.node.destroy_service(srv)
            except Exception:  # noqa: BLE001 - shutting down
                pass
        self._services = []

