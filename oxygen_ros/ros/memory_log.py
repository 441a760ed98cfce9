"""The node's memory of what it saw: memory entries kept durable when the database works, and kept (bounded) in
memory when it does not, so that no fault of the ``memory_db`` file stops the robot and nothing is lost silently.

This file owns the availability policy around ``MemoryStore`` (the SQLite file format, ``memory_store.py``):
- *open*: a file that is not SQLite or is corrupt is moved aside to ``<name>.corrupt-<timestamp>`` (with its -wal/-shm
  files) and a new database is created; a path that cannot be opened (read-only directory, a parent that is a file,
  permissions) leaves the log *unavailable*: it runs without persistence and retries the open every ``retry_s``.
- *add*: an entry goes to a bounded backlog and the backlog is written in order; a write error (disk full, I/O error)
  leaves the entry and everything after it in the backlog, to be written by the next ``add`` or ``flush`` (``flush``
  retries at most every ``retry_s``; the node calls it from its diagnostics timer).  A full backlog drops its oldest
  entry (counted: ``memory_lost``).  An entry's id is 0 until it is stored; ``on_stored`` is called for every entry
  that got its id later (the node publishes it again), and a corrupt file found mid-run is moved aside as at open.
- *query* / *clear*: stored entries (from every run) plus the backlog, newest first.
- ``status()`` is what ``/diagnostics`` reports (``diagnostics.memory_status``).  Every log line names the file.
With ``memory_db: ""`` nothing is stored: entries get ids from a counter and the last ``backlog_max`` are kept for
queries.  No rclpy; thread-safe (the inference thread adds, the executor flushes, queries and clears).
"""
from __future__ import annotations

import collections
import os
import threading
import time
from typing import Callable, Optional

from .diagnostics import Reporter
from .memory_store import MemoryQuery, MemoryStore, StoredEntry, is_corruption

__all__ = ["MemoryLog"]

OFF, OK, FAILING, UNAVAILABLE = "off", "ok", "failing", "unavailable"


class MemoryLog:
    def __init__(self, path: str, report: Reporter, *, backlog_max: int = 1000, retry_s: float = 5.0,
                 on_stored: Optional[Callable[[StoredEntry], None]] = None, clock=time.monotonic):
        self.path = os.path.abspath(os.path.expanduser(path)) if path else ""
        self.report = report
        self.backlog_max = int(backlog_max)
        self.retry_s = float(retry_s)
        self.on_stored = on_stored
        self._clock = clock
        self._lock = threading.RLock()
        self._store: MemoryStore | None = None
        self._backlog: collections.deque[StoredEntry] = collections.deque()
        self._next_id = 1                      # ids when nothing is stored (memory_db "")
        self._last_try = -1e18
        self.state = OFF if not self.path else UNAVAILABLE
        self.last_error = ""
        self.moved_aside = ""                  # where a corrupt file was moved to (this run)
        self.write_errors = 0
        self.stored = 0                        # entries written during this run
        self.lost = 0                          # entries dropped from a full backlog
        self._in_db = 0                        # entries in the database (counted at open, kept up to date)
        if self.path:
            with self._lock:
                self._open()

    # ---------------------------------------------------------------------------------------------- opening
    def _open(self) -> bool:
        self._last_try = self._clock()
        try:
            self._store = MemoryStore(self.path)
        except Exception as exc:  # noqa: BLE001 - sqlite3.Error, OSError: any failure must leave the node running
            if is_corruption(exc) and self._replace_corrupt(exc):
                return True
            self._unavailable(exc)
            return False
        self._in_db = self._store.count()
        self.state = OK
        return True

    def _replace_corrupt(self, exc: BaseException) -> bool:
        """Move the corrupt file aside and create a new database; False if that failed too."""
        dst = f"{self.path}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}"
        n = 1
        while os.path.exists(dst):
            n += 1
            dst = f"{self.path}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}-{n}"
        try:
            os.replace(self.path, dst)
            for suffix in ("-wal", "-shm"):
                if os.path.exists(self.path + suffix):
                    os.replace(self.path + suffix, dst + suffix)
            self._store = MemoryStore(self.path)
        except Exception as exc2:  # noqa: BLE001
            self._unavailable(exc2, f" (it is corrupt: {exc}; moving it aside failed)")
            return False
        self.moved_aside = dst
        self._in_db = 0
        self.state = OK
        self.report.event("memory_db_corrupt", f"memory DB {self.path} was corrupt ({exc}): moved to {dst}; "
                                               "writing a new database there")
        return True

    def _unavailable(self, exc: BaseException, why: str = "") -> None:
        self._store = None
        self.state = UNAVAILABLE
        self.last_error = f"{type(exc).__name__}: {exc}{why}"
        self.report.event("memory_db_unavailable",
                          f"memory DB {self.path} cannot be opened ({self.last_error}): running without persistence, "
                          f"entries kept in memory (at most {self.backlog_max}), retried every {self.retry_s:g} s",
                          period_s=max(self.retry_s, 10.0))

    # ---------------------------------------------------------------------------------------------- writing
    def add(self, *, text: str, source_prompt: str, frame_index: int, request_id: int, num_tokens: int,
            stamp_ns: int, frame_id: str = "") -> int:
        """Keep one entry; returns its entry_id, or 0 when it could not be stored yet (it stays in the backlog)."""
        e = StoredEntry(0, int(stamp_ns) // 1_000_000_000, int(stamp_ns) % 1_000_000_000, int(frame_index),
                        int(request_id), int(num_tokens), str(text), str(source_prompt), str(frame_id), time.time())
        with self._lock:
            if not self.path:
                e.entry_id, self._next_id = self._next_id, self._next_id + 1
                self._keep(e)
                return e.entry_id
            self._keep(e)
            later = self._flush_locked(force=True)
        self._notify([x for x in later if x is not e])
        return e.entry_id

    def _keep(self, e: StoredEntry) -> None:
        self._backlog.append(e)
        while len(self._backlog) > self.backlog_max:
            old = self._backlog.popleft()
            if self.path:
                self.lost += 1
                self.report.event("memory_lost", f"memory DB {self.path} still failing: backlog full "
                                                 f"({self.backlog_max}), entry of request {old.request_id} lost",
                                  level="error")

    def flush(self) -> int:
        """Write the backlog if the database works again (at most one attempt per retry_s); returns entries stored."""
        with self._lock:
            if not self.path or not self._backlog:
                return 0
            stored = self._flush_locked(force=False)
        self._notify(stored)
        return len(stored)

    def _flush_locked(self, force: bool) -> list:
        if not self._backlog:
            return []
        if not force and self._clock() - self._last_try < self.retry_s:
            return []
        if self._store is None and not self._open():
            return []
        self._last_try = self._clock()
        done = []
        while self._backlog:
            e = self._backlog[0]
            try:
                e.entry_id = self._store.add(text=e.text, source_prompt=e.source_prompt, frame_index=e.frame_index,
                                             request_id=e.request_id, num_tokens=e.num_tokens,
                                             stamp_sec=e.stamp_sec, stamp_nanosec=e.stamp_nanosec,
                                             frame_id=e.frame_id)
            except Exception as exc:  # noqa: BLE001 - disk full, I/O error, corruption: keep the entries
                self._write_failed(exc)
                break
            self._backlog.popleft()
            done.append(e)
        if done:
            self.stored += len(done)
            self._in_db += len(done)
            self.report.count("memory_entries_stored", len(done))
            if self.state != OK:
                self.report.log("memory_db_recovered", f"memory DB {self.path} works again: {len(done)} entries "
                                                       "written", level="info", period_s=0.0)
            self.state, self.last_error = OK, ""
        return done

    def _write_failed(self, exc: BaseException) -> None:
        self.write_errors += 1
        self.state = FAILING
        self.last_error = f"{type(exc).__name__}: {exc}"
        self.report.event("memory_db_errors", f"memory DB {self.path}: write failed ({self.last_error}); "
                                              f"{len(self._backlog)} entries kept in memory, retried every "
                                              f"{self.retry_s:g} s", level="error")
        if is_corruption(exc):               # reopening moves the file aside
            self._store.close()
            self._store = None

    def _notify(self, entries: list) -> None:
        if self.on_stored is None:
            return
        for e in entries:
            try:
                self.on_stored(e)
            except Exception as exc:  # noqa: BLE001 - publishing must not undo the write
                self.report.log("memory_republish", f"publishing stored memory entry failed: {exc}")

    def fail_writes(self, fail: bool) -> None:
        """Tests only (``debug_fault_injection``): see ``MemoryStore.fail_writes``."""
        with self._lock:
            if self._store is not None:
                self._store.fail_writes(fail)
            if not fail:
                self._last_try = -1e18         # retry at the next flush

    # ---------------------------------------------------------------------------------------------- reading
    def query(self, q: MemoryQuery) -> list[StoredEntry]:
        """Stored entries and those waiting in the backlog that match ``q``, newest first; raises ValueError for a
        bad query and RuntimeError (naming the file) when the database cannot be read."""
        why = q.error()
        if why:
            raise ValueError(why)
        with self._lock:
            waiting = [e for e in self._backlog if q.matches(e)]
            store = self._store
        rows = []
        if store is not None:
            try:
                rows = store.query(q)
            except Exception as exc:  # noqa: BLE001
                raise RuntimeError(f"memory DB {self.path} cannot be read: {type(exc).__name__}: {exc}") from exc
        elif self.path and not waiting:
            raise RuntimeError(f"memory DB {self.path} is unavailable: {self.last_error}")
        merged = sorted(rows + waiting, key=lambda e: (e.stamp_ns, e.entry_id or 1 << 62), reverse=True)
        return merged[:q.limit]

    def clear(self) -> int:
        """Delete every entry (database and backlog); returns how many. Raises RuntimeError naming the file."""
        with self._lock:
            n = len(self._backlog)
            self._backlog.clear()
            if self._store is not None:
                try:
                    n += self._store.delete_all()
                except Exception as exc:  # noqa: BLE001
                    raise RuntimeError(f"memory DB {self.path}: clear failed: {type(exc).__name__}: {exc}") from exc
                self._in_db = 0
            return n

    def count(self) -> int:
        with self._lock:
            return self._in_db + (len(self._backlog) if self.path else 0)

    def status(self) -> dict:
        """Values for /diagnostics (see diagnostics.memory_status)."""
        with self._lock:
            return {"path": self.path, "state": self.state, "entries_in_db": self._in_db,
                    "stored_this_run": self.stored, "backlog": len(self._backlog) if self.path else 0,
                    "backlog_max": self.backlog_max, "write_errors": self.write_errors, "lost": self.lost,
                    "last_error": self.last_error, "moved_aside": self.moved_aside}

    def close(self) -> None:
        with self._lock:
            if self._store is not None:
                self._store.close()
                self._store = None
            if self._backlog and self.path:
                self.report.log("memory_lost_at_exit", f"memory DB {self.path}: {len(self._backlog)} entries were "
                                                       "never stored (database unavailable until exit)",
                                level="error", period_s=0.0)
