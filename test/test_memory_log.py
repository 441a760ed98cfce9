"""The memory log's faults, for real and without ROS: a file that is not SQLite is moved aside and a new database is
written; a path that cannot be opened (a parent that is a file; a read-only directory, made with a read-only bind
mount when running as root) leaves the node without persistence, entries kept in memory and stored once the path
works; a database that fails mid-run (SQLite itself refusing writes, ``fail_writes``; and a really full file system,
a 64 KiB tmpfs, when running as root) keeps entries in the backlog with id 0 and writes them in order when it works again, publishing them again with their ids; a full backlog counts
what it lost and /diagnostics goes ERROR; every status message names the file.  Also the query semantics
(substring, time and frame ranges, limit, newest first, entries of an earlier run, bad ranges) and clear."""
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from oxygen_ros.ros import diagnostics as diag
from oxygen_ros.ros.memory_log import MemoryLog
from oxygen_ros.ros.memory_store import MemoryQuery

REPO = Path(__file__).resolve().parents[1]
S = 1_000_000_000


class Log:
    def __init__(self):
        self.lines = []

    def info(self, t):
        self.lines.append(("info", t))

    def warning(self, t):
        self.lines.append(("warning", t))

    def error(self, t):
        self.lines.append(("error", t))


def make(path, **kw):
    counters, log = diag.Counters(), Log()
    stored = []
    m = MemoryLog(str(path), diag.Reporter(counters, log, period_s=0.0), on_stored=stored.append, **kw)
    return m, counters, log, stored


def add(m, i, text=None, stamp_s=None):
    return m.add(text=text or f"entry {i}", source_prompt="describe", frame_index=i, request_id=100 + i,
                 num_tokens=3, stamp_ns=int((stamp_s if stamp_s is not None else 1000 + i) * S), frame_id="cam")


def rows(path):
    with sqlite3.connect(str(path)) as db:
        return db.execute("SELECT entry_id, request_id, text FROM memory_entries ORDER BY entry_id").fetchall()


def status(m, lost_recently=0):
    return diag.memory_status(m.status(), lost_recently)


def test_file_that_is_not_sqlite_is_moved_aside(tmp_path):
    db = tmp_path / "memory.db"
    db.write_bytes(b"this is not a database\n" * 100)
    m, counters, log, _ = make(db)
    assert m.state == "ok" and m.moved_aside.startswith(str(db) + ".corrupt-")
    assert Path(m.moved_aside).read_bytes().startswith(b"this is not a database"), "the bad file is kept"
    assert add(m, 1) == 1 and rows(db) == [(1, 101, "entry 1")]
    st = status(m)
    assert st.level == diag.WARN and str(db) in st.message and m.moved_aside in st.message
    assert counters.get("memory_db_corrupt") == 1 and any(str(db) in t for _, t in log.lines)
    m.close()


def test_parent_is_a_file_runs_without_persistence_then_recovers(tmp_path):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("x")
    db = blocker / "memory.db"
    m, counters, log, stored = make(db, retry_s=0.0)
    assert m.state == "unavailable" and counters.get("memory_db_unavailable") == 1
    assert add(m, 1) == 0 and add(m, 2) == 0, "not stored yet: id 0"
    st = status(m)
    assert st.level == diag.WARN and str(db) in st.message and "2 entries waiting" in st.message
    assert [e.text for e in m.query(MemoryQuery())] == ["entry 2", "entry 1"], "waiting entries are queryable"
    assert all(str(db) in t for lvl, t in log.lines if lvl != "info")
    blocker.unlink()
    blocker.mkdir()
    assert m.flush() == 2
    assert [(e.entry_id, e.request_id) for e in stored] == [(1, 101), (2, 102)], "published again with their ids"
    assert rows(db) == [(1, 101, "entry 1"), (2, 102, "entry 2")] and status(m).level == diag.OK
    m.close()


RO_SCRIPT = textwrap.dedent("""
    import json, os, subprocess, sys
    sys.path.insert(0, {repo!r})
    from oxygen_ros.ros import diagnostics as diag
    from oxygen_ros.ros.memory_log import MemoryLog
    d = {d!r}
    if {bind!r}:
        subprocess.run(["mount", "--bind", "-o", "ro", d, d], check=True)
    class L:
        info = warning = error = lambda self, t: None
    m = MemoryLog(os.path.join(d, "memory.db"), diag.Reporter(diag.Counters(), L()), retry_s=0.0)
    out = {{"state": m.state, "id": m.add(text="x", source_prompt="p", frame_index=0, request_id=1, num_tokens=1,
                                         stamp_ns=1), "status": diag.memory_status(m.status()).message}}
    if {bind!r}:
        subprocess.run(["mount", "-o", "remount,rw,bind", d], check=True)
    else:
        os.chmod(d, 0o755)
    out["flushed"] = m.flush()
    out["after"] = m.state
    print(json.dumps(out))
""")


def test_read_only_directory(tmp_path):
    d = tmp_path / "ro"
    d.mkdir()
    if os.geteuid() == 0:        # root ignores permissions: a read-only bind mount in a private mount namespace
        if shutil.which("unshare") is None:
            pytest.skip("root without unshare: cannot make a read-only directory")
        probe = subprocess.run(["unshare", "-m", "true"], capture_output=True)
        if probe.returncode != 0:
            pytest.skip(f"unshare -m not permitted here: {probe.stderr.decode()[:200]}")
        cmd = ["unshare", "-m", sys.executable, "-c", RO_SCRIPT.format(repo=str(REPO), d=str(d), bind=True)]
    else:
        d.chmod(0o555)
        cmd = [sys.executable, "-c", RO_SCRIPT.format(repo=str(REPO), d=str(d), bind=False)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr

    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["state"] == "unavailable" and out["id"] == 0
    assert str(d / "memory.db") in out["status"] and "cannot be opened" in out["status"]
    assert out["flushed"] == 1 and out["after"] == "ok", "stored once the directory is writable"


def test_database_failing_mid_run_keeps_entries_and_writes_them_later(tmp_path):
    db = tmp_path / "memory.db"
    m, counters, log, stored = make(db, retry_s=0.0)
    assert [add(m, i) for i in (1, 2)] == [1, 2]
    m.fail_writes(True)
    assert [add(m, i) for i in (3, 4, 5)] == [0, 0, 0]
    assert m.state == "failing" and m.write_errors == 3 and counters.get("memory_db_errors") == 3
    assert "not authorized" in m.last_error
    st = status(m)
    assert st.level == diag.WARN and str(db) in st.message and "3 entries waiting" in st.message
    assert any(lvl == "error" and str(db) in t and "write failed" in t for lvl, t in log.lines)
    m.fail_writes(False)
    assert add(m, 6) == 6, "the backlog is written first, in order"
    assert [(e.entry_id, e.request_id) for e in stored] == [(3, 103), (4, 104), (5, 105)]
    assert [r[1] for r in rows(db)] == [101, 102, 103, 104, 105, 106] and m.lost == 0
    assert status(m).level == diag.OK
    m.close()


def test_full_backlog_counts_lost_entries_and_goes_error(tmp_path):
    db = tmp_path / "memory.db"
    m, counters, _, _ = make(db, backlog_max=2, retry_s=0.0)
    add(m, 0)
    m.fail_writes(True)
    for i in range(1, 5):
        add(m, i)
    assert m.lost == 2 and counters.get("memory_lost") == 2
    st = status(m, lost_recently=counters.delta().get("memory_lost", 0))
    assert st.level == diag.ERROR and "2 memory entries lost" in st.message and str(db) in st.message
    m.fail_writes(False)
    m.flush()
    assert [r[1] for r in rows(db)] == [100, 103, 104], "the oldest waiting entries were the ones lost"
    m.close()


def test_query_filters_order_restart_and_clear(tmp_path):
    db = tmp_path / "memory.db"
    m, *_ = make(db)
    assert m.query(MemoryQuery()) == [], "an empty store answers an empty list"
    texts = ["a red cup", "a blue box", "the RED block", "nothing", "red_dot 100%"]
    for i, t in enumerate(texts):
        add(m, i, text=t, stamp_s=2000 + 10 * i)
    m.close()
    m, *_ = make(db)                                     # a restart: entries of the earlier run are there
    q = lambda **kw: [e.text for e in m.query(MemoryQuery(**kw))]  # noqa: E731
    assert q() == texts[::-1], "newest first"
    assert q(text_contains="red") == ["red_dot 100%", "the RED block", "a red cup"], "case-insensitive substring"
    assert q(text_contains="_d") == ["red_dot 100%"] and q(text_contains="0%") == ["red_dot 100%"]
    assert q(start_ns=2010 * S, end_ns=2030 * S) == ["nothing", "the RED block", "a blue box"], "inclusive bounds"
    assert q(start_ns=2030 * S + 1) == ["red_dot 100%"]
    assert q(min_frame=1, max_frame=2) == ["the RED block", "a blue box"]
    assert q(limit=2) == ["red_dot 100%", "nothing"]
    for bad, why in ((dict(start_ns=5 * S, end_ns=4 * S), "end_time"), (dict(min_frame=3, max_frame=2), "frame"),
                     (dict(limit=1001), "limit"), (dict(limit=0), "limit")):
        with pytest.raises(ValueError, match=why):
            m.query(MemoryQuery(**bad))
    assert m.clear() == 5 and m.query(MemoryQuery()) == []
    assert add(m, 9) == 6, "ids are never reused after a clear"
    m.close()


def test_no_database_configured(tmp_path):
    m, counters, _, _ = make("")
    assert m.state == "off" and [add(m, i) for i in range(3)] == [1, 2, 3]
    assert [e.entry_id for e in m.query(MemoryQuery(limit=2))] == [3, 2]
    assert status(m).level == diag.OK and "not stored" in status(m).message
    assert not list(tmp_path.iterdir())


FULL_FS_SCRIPT = textwrap.dedent("""
    import json, os, subprocess, sys
    sys.path.insert(0, {repo!r})
    from oxygen_ros.ros import diagnostics as diag
    from oxygen_ros.ros.memory_log import MemoryLog
    d = {d!r}
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", d], check=True)
    class L:
        info = warning = error = lambda self, t: None
    m = MemoryLog(os.path.join(d, "memory.db"), diag.Reporter(diag.Counters(), L()), retry_s=0.0)
    add = lambda i: m.add(text="a scene description " * 20, source_prompt="p", frame_index=i, request_id=i,
                          num_tokens=1, stamp_ns=i)
    first = add(1)
    fd = os.open(os.path.join(d, "filler"), os.O_WRONLY | os.O_CREAT)      # fill the file system
    try:
        while os.write(fd, b"x" * 4096):
            pass
    except OSError:
        pass
    os.close(fd)
    ids = [add(i) for i in range(2, 40)]
    out = {{"first": first, "failed": ids.count(0), "error": m.last_error, "state": m.state}}
    os.remove(os.path.join(d, "filler"))
    out["flushed"] = m.flush()
    out["after"] = m.state
    out["count"] = m.count()
    print(json.dumps(out))
""")


def test_really_full_file_system(tmp_path):
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare to mount a small tmpfs")
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"unshare -m not permitted here: {probe.stderr.decode()[:200]}")
    d = tmp_path / "small"
    d.mkdir()
    r = subprocess.run(["unshare", "-m", sys.executable, "-c", FULL_FS_SCRIPT.format(repo=str(REPO), d=str(d))],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr

    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["first"] == 1 and out["failed"] > 0 and out["state"] == "failing", out
    assert "full" in out["error"].lower() or "disk i/o" in out["error"].lower(), out
    assert out["after"] == "ok" and out["count"] == 39, f"every entry stored after space came back: {out}"
