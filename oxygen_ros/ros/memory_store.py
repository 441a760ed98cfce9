"""Embedded SQLite store for memory entries (scene descriptions), one committed row per entry.

This file owns the ``memory_db`` file format.  ``MemoryStore(path)`` opens (or creates) the database in WAL mode
with ``synchronous=FULL``; ``add(...)`` inserts one entry and commits before returning its ``entry_id`` (the SQLite
row id), so an entry that was published is on disk even if the process crashes right after.  Ids continue across
restarts (``AUTOINCREMENT``: never reused, even after deletes).  ``recent(n)`` / ``count()`` / ``get(entry_id)`` read
back.  Thread-safe (one connection guarded by a lock).  No rclpy; the node converts rows to ``MemoryEntry``.
"""
from __future__ import annotations

import os
import sqlite3
import threading
import time
from dataclasses import dataclass

__all__ = ["MemoryStore", "StoredEntry"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS memory_entries (
    entry_id      INTEGER PRIMARY KEY AUTOINCREMENT,
    stamp_sec     INTEGER NOT NULL,
    stamp_nanosec INTEGER NOT NULL,
    frame_index   INTEGER NOT NULL,
    request_id    INTEGER NOT NULL,
    num_tokens    INTEGER NOT NULL,
    text          TEXT    NOT NULL,
    source_prompt TEXT    NOT NULL,
    frame_id      TEXT    NOT NULL DEFAULT '',
    created_unix  REAL    NOT NULL
);
CREATE INDEX IF NOT EXISTS memory_entries_stamp ON memory_entries (stamp_sec, stamp_nanosec);
"""


@dataclass
class StoredEntry:
    entry_id: int
    stamp_sec: int
    stamp_nanosec: int
    frame_index: int
    request_id: int
    num_tokens: int
    text: str
    source_prompt: str
    frame_id: str
    created_unix: float


class MemoryStore:
    def __init__(self, path: str):
        self.path = os.path.abspath(os.path.expanduser(path))
        d = os.path.dirname(self.path)
        if d:
            os.makedirs(d, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=5.0)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)

    def add(self, *, text: str, source_prompt: str, frame_index: int, request_id: int, num_tokens: int,
            stamp_sec: int = 0, stamp_nanosec: int = 0, frame_id: str = "") -> int:
        """Insert and commit one entry; returns its entry_id."""
        with self._lock:
            cur = self._db.execute(
                "INSERT INTO memory_entries (stamp_sec, stamp_nanosec, frame_index, request_id, num_tokens, text,"
                " source_prompt, frame_id, created_unix) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (int(stamp_sec), int(stamp_nanosec), int(frame_index), int(request_id), int(num_tokens), str(text),
                 str(source_prompt), str(frame_id), time.time()))
            # isolation_level=None: autocommit, the INSERT is durable when execute returns.
            return int(cur.lastrowid)

    def count(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM memory_entries").fetchone()[0])

    def get(self, entry_id: int) -> StoredEntry | None:
        with self._lock:
            row = self._db.execute(f"SELECT {self._cols()} FROM memory_entries WHERE entry_id = ?",
                                   (int(entry_id),)).fetchone()
        return StoredEntry(*row) if row else None

    def recent(self, n: int = 10) -> list[StoredEntry]:
        """The newest ``n`` entries, oldest first."""
        with self._lock:
            rows = self._db.execute(f"SELECT {self._cols()} FROM memory_entries ORDER BY entry_id DESC LIMIT ?",
                                    (int(n),)).fetchall()
        return [StoredEntry(*r) for r in reversed(rows)]

    def last_id(self) -> int:
        with self._lock:
            row = self._db.execute("SELECT MAX(entry_id) FROM memory_entries").fetchone()
        return int(row[0] or 0)

    @staticmethod
    def _cols() -> str:
        return ("entry_id, stamp_sec, stamp_nanosec, frame_index, request_id, num_tokens, text, source_prompt,"
                " frame_id, created_unix")

    def close(self) -> None:
        with self._lock:
            try:
                self._db.close()
            except sqlite3.Error:
                pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
