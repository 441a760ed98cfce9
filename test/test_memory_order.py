"""Memory queries are ordered by capture time, newest first, whatever order the entries were inserted in.

With cross-frame batching a memory request of an older frame can finish after one of a newer frame, so entries reach
SQLite out of capture order; ``memory/query`` (and the conversation's memory context, which takes the newest M)
promises newest *capture time* first.  Every entry here is inserted out of capture order, several within the same
second and differing only in nanoseconds, two with the same stamp (the tie goes to the later insertion, i.e. the
higher ``entry_id``; an entry still waiting for the database counts as inserted last).  Checked through each layer a
query passes: ``MemoryStore.query`` (the SQL), ``MemoryLog.query`` (database rows merged with entries waiting in the
backlog of a failing database; and with no database at all), and the ``memory/query`` service over DDS
(``MemoryServices`` on an rclpy node, a real client).  Ordering by insertion, by entry id, by seconds only or by
nanoseconds first each fails these tests.
"""
from __future__ import annotations

import os

import pytest

from oxygen_ros.ros import diagnostics as diag
from oxygen_ros.ros.memory_log import MemoryLog
from oxygen_ros.ros.memory_store import MemoryQuery, MemoryStore

S = 1_000_000_000
# (stamp_sec, stamp_nanosec, text) in insertion order; the text names the capture order (a oldest ... e newest)
INSERTS = [(1000, 500, "b1"), (1000, 999_999_999, "d"), (999, 999_999_999, "a"), (1001, 0, "e"),
           (1000, 600, "c"), (1000, 500, "b2")]
NEWEST_FIRST = ["e", "d", "c", "b2", "b1", "a"]            # b2 and b1: same stamp, b2 inserted later
FRAME = {"a": 1, "b1": 2, "b2": 2, "c": 3, "d": 4, "e": 5}  # frames follow capture time, not insertion


class _Log:
    def __init__(self):
        self.lines = []

    def info(self, t):
        self.lines.append(t)

    warning = error = info


def _reporter():
    return diag.Reporter(diag.Counters(), _Log(), period_s=0.0)


def _add_all(add) -> None:
    for sec, nsec, text in INSERTS:
        add(sec, nsec, text)


def _log_add(m: MemoryLog):
    return lambda sec, nsec, text: m.add(text=text, source_prompt="describe", frame_index=FRAME[text],
                                         request_id=10 + FRAME[text], num_tokens=1, stamp_ns=sec * S + nsec)


def _check(query) -> None:
    """``query(MemoryQuery) -> texts`` newest first, for the whole set, a limit and a time window."""
    assert query(MemoryQuery()) == NEWEST_FIRST
    assert query(MemoryQuery(limit=3)) == ["e", "d", "c"], "the limit keeps the newest by capture time"
    assert query(MemoryQuery(start_ns=1000 * S + 500, end_ns=1000 * S + 999_999_999)) == ["d", "c", "b2", "b1"]
    assert query(MemoryQuery(min_frame=2, max_frame=3, limit=2)) == ["c", "b2"]


def test_store_orders_by_capture_time(tmp_path):
    with MemoryStore(str(tmp_path / "memory.db")) as st:
        _add_all(lambda sec, nsec, text: st.add(text=text, source_prompt="describe", frame_index=FRAME[text],
                                                request_id=1, num_tokens=1, stamp_sec=sec, stamp_nanosec=nsec))
        assert [e.text for e in st.recent(6)] == [t for _, _, t in INSERTS], "inserted out of capture order"
        _check(lambda q: [e.text for e in st.query(q)])


def test_log_orders_by_capture_time_with_a_database(tmp_path):
    m = MemoryLog(str(tmp_path / "memory.db"), _reporter())
    _add_all(_log_add(m))
    _check(lambda q: [e.text for e in m.query(q)])
    m.close()


def test_log_orders_stored_and_waiting_entries_together(tmp_path):
    """The database fails after three entries: the other three wait in the backlog (id 0), the query merges both."""
    m = MemoryLog(str(tmp_path / "memory.db"), _reporter(), retry_s=1e9)
    add = _log_add(m)
    for i, (sec, nsec, text) in enumerate(INSERTS):
        if i == 3:
            m.fail_writes(True)
        add(sec, nsec, text)
    assert m.status()["backlog"] == 3 and m.status()["state"] == "failing"
    _check(lambda q: [e.text for e in m.query(q)])
    m.close()


def test_log_orders_by_capture_time_without_a_database():
    m = MemoryLog("", _reporter())
    _add_all(_log_add(m))
    _check(lambda q: [e.text for e in m.query(q)])


def test_memory_query_service_orders_by_capture_time(ros, tmp_path):
    pytest.importorskip("oxygen_ros.srv", reason="oxygen_ros services are not built (run `make` / `pip install .`)")
    from builtin_interfaces.msg import Time
    from rclpy.executors import SingleThreadedExecutor

    from oxygen_ros.ros.memory_services import MemoryServices
    from oxygen_ros.srv import QueryMemory

    m = MemoryLog(str(tmp_path / "memory.db"), _reporter())
    _add_all(_log_add(m))
    node = ros.rclpy.create_node("memory_order", namespace=f"/memory_order_{os.getpid()}")
    services = MemoryServices(node, m, _reporter())
    client = node.create_client(QueryMemory, "memory/query")
    executor = SingleThreadedExecutor()
    executor.add_node(node)

    def query(q: MemoryQuery) -> list[str]:
        req = QueryMemory.Request(text_contains=q.text_contains, limit=q.limit,
                                  min_frame_index=-1 if q.min_frame is None else q.min_frame,
                                  max_frame_index=-1 if q.max_frame is None else q.max_frame)
        if q.start_ns is not None:
            req.start_time = Time(sec=q.start_ns // S, nanosec=q.start_ns % S)
        if q.end_ns is not None:
            req.end_time = Time(sec=q.end_ns // S, nanosec=q.end_ns % S)
        future = client.call_async(req)
        executor.spin_until_future_complete(future, timeout_sec=20)
        resp = future.result()
        assert resp is not None and resp.success, resp
        stamps = [e.header.stamp.sec * S + e.header.stamp.nanosec for e in resp.entries]
        assert stamps == sorted(stamps, reverse=True)
        assert all(e.frame_index == FRAME[e.text] for e in resp.entries)
        return [e.text for e in resp.entries]

    try:
        assert client.wait_for_service(timeout_sec=20), "memory/query did not appear"
        _check(query)
    finally:
        services.destroy()
        node.destroy_client(client)
        executor.shutdown()
        node.destroy_node()
        m.close()
