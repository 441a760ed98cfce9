"""Embedded SQLite store for memory entries (scene descriptions), one committed row per entry.

This file owns the ``memory_db`` file format.  ``MemoryStore(path)`` opens (or creates) the database in WAL mode
with ``synchronous=FULL``; ``add(...)`` inserts one entry and commits before returning its ``entry_id`` (the SQLite
row id), so an entry that was published is on disk even if the process crashes right after.  Ids continue across
restarts (``AUTOINCREMENT``: never reused, even after deletes).  ``recent(n)`` / ``count()`` / ``get(entry_id)`` /
``query(MemoryQuery)`` (substring, capture-time and frame range, newest first, on the capture-time index) read back,
``delete_all()`` empties it.  Opening checks the file (``PRAGMA quick_check``): a file that is not SQLite or is
corrupt raises an error for which ``is_corruption`` is true.  Thread-safe: writes share one connection under a lock,
reads use a second connection (WAL lets them run while a write is in progress).  ``fail_writes`` is a test-only
fault hook: an SQLite authorizer makes SQLite itself refuse every insert (an ``sqlite3.DatabaseError``, as a failing
disk gives), so a database failing mid-run can be tested anywhere.
No rclpy; the node converts rows to ``MemoryEntry``.
"""
from __future__ import annotations

import os
import sqlite3
import threading
import time
from dataclasses import dataclass

__all__ = ["MemoryStore", "StoredEntry", "MemoryQuery", "CorruptDatabase", "is_corruption", "QUERY_LIMIT_MAX"]

QUERY_LIMIT_DEFAULT, QUERY_LIMIT_MAX = 100, 1000

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


class CorruptDatabase(sqlite3.DatabaseError):
    """The file opens but fails SQLite's integrity check."""


def is_corruption(exc: BaseException) -> bool:
    """True for 'not a database' / 'malformed' errors (the file must be replaced), False for I/O, permission or
    full-disk errors (the file is fine; writing may work later)."""
    if isinstance(exc, CorruptDatabase):
        return True
    name = getattr(exc, "sqlite_errorname", "") or ""
    if name in ("SQLITE_CORRUPT", "SQLITE_NOTADB"):
        return True
    text = str(exc).lower()
    return isinstance(exc, sqlite3.DatabaseError) and ("not a database" in text or "malformed" in text)


@dataclass(frozen=True)
class MemoryQuery:
    """Filters of a memory query (all optional); times in ns since the epoch (capture time), bounds inclusive."""
    text_contains: str = ""
    start_ns: int | None = None
    end_ns: int | None = None
    min_frame: int | None = None
    max_frame: int | None = None
    limit: int = QUERY_LIMIT_DEFAULT

    def error(self) -> str | None:
        """Why this query is invalid, or None."""
        if self.start_ns is not None and self.end_ns is not None and self.end_ns < self.start_ns:
            return (f"bad time range: end_time {self.end_ns / 1e9:.9f} is before start_time "
                    f"{self.start_ns / 1e9:.9f}")
        if self.min_frame is not None and self.max_frame is not None and self.max_frame < self.min_frame:
            return f"bad frame range: max_frame_index {self.max_frame} < min_frame_index {self.min_frame}"
        if self.limit < 1 or self.limit > QUERY_LIMIT_MAX:
            return f"limit must be in [1, {QUERY_LIMIT_MAX}], got {self.limit}"
        return None

    def matches(self, e: "StoredEntry") -> bool:
        """The same filter as the SQL of ``MemoryStore.query``, for entries held in memory."""
        t = e.stamp_sec * 1_000_000_000 + e.stamp_nanosec
        return ((not self.text_contains or self.text_contains.lower() in e.text.lower())
                and (self.start_ns is None or t >= self.start_ns) and (self.end_ns is None or t <= self.end_ns)
                and (self.min_frame is None or e.frame_index >= self.min_frame)
                and (self.max_frame is None or e.frame_index <= self.max_frame))


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

    @property
    def stamp_ns(self) -> int:
        return self.stamp_sec * 1_000_000_000 + self.stamp_nanosec


class MemoryStore:
    def __init__(self, path: str):
        self.path = os.path.abspath(os.path.expanduser(path))
        d = os.path.dirname(self.path)
        if d:
            os.makedirs(d, exist_ok=True)
        self._lock = threading.Lock()
        self._rlock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=5.0)
        self._rdb = None
        try:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.executescript(_SCHEMA)
            check = self._db.execute("PRAGMA quick_check").fetchone()[0]
            if check != "ok":
                raise CorruptDatabase(f"database disk image is malformed: {check}")
            self._rdb = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=5.0)
        except BaseException:
            self._db.close()
            raise

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

    def query(self, q: MemoryQuery) -> list[StoredEntry]:
        """Entries matching ``q``, newest first (capture time, then entry_id), at most ``q.limit``."""
        where, args = [], []
        if q.text_contains:
            esc = q.text_contains.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
            where.append("text LIKE ? ESCAPE '\\'")
            args.append(f"%{esc}%")
        if q.start_ns is not None:
            where.append("(stamp_sec, stamp_nanosec) >= (?, ?)")
            args += list(divmod(int(q.start_ns), 1_000_000_000))
        if q.end_ns is not None:
            where.append("(stamp_sec, stamp_nanosec) <= (?, ?)")
            args += list(divmod(int(q.end_ns), 1_000_000_000))
        if q.min_frame is not None:
            where.append("frame_index >= ?")
            args.append(int(q.min_frame))
        if q.max_frame is not None:
            where.append("frame_index <= ?")
            args.append(int(q.max_frame))
        sql = (f"SELECT {self._cols()} FROM memory_entries {'WHERE ' + ' AND '.join(where) if where else ''} "
               "ORDER BY stamp_sec DESC, stamp_nanosec DESC, entry_id DESC LIMIT ?")
        with self._rlock:
            rows = self._rdb.execute(sql, (*args, int(q.limit))).fetchall()
        return [StoredEntry(*r) for r in rows]

    def delete_all(self) -> int:
        """Delete every entry; returns how many. Ids keep increasing afterwards (AUTOINCREMENT)."""
        with self._lock:
            return int(self._db.execute("DELETE FROM memory_entries").rowcount)

    def fail_writes(self, fail: bool) -> None:
        """Tests only: with ``fail`` SQLite refuses every insert into the table ('not authorized'); False undoes it.
        (Setting an authorizer expires the prepared statements, so it applies to the very next ``add``.)"""
        def deny_inserts(action, table, *_):
            insert = action == sqlite3.SQLITE_INSERT and table == "memory_entries"
            return sqlite3.SQLITE_DENY if insert else sqlite3.SQLITE_OK
        with self._lock:
            self._db.set_authorizer(deny_inserts if fail else None)

    def last_id(self) -> int:
        with self._lock:
            row = self._db.execute("SELECT MAX(entry_id) FROM memory_entries").fetchone()
        return int(row[0] or 0)

    @staticmethod
    def _cols() -> str:
        return ("entry_id, stamp_sec, stamp_nanosec, frame_index, request_id, num_tokens, text, source_prompt,"
                " frame_id, created_unix")

    def close(self) -> None:
        with self._lock, self._rlock:
            for db in (self._db, self._rdb):
                try:
                    if db is not None:
                        db.close()
                except sqlite3.Error:
                    pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
