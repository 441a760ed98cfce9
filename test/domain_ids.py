"""ROS_DOMAIN_ID allocation for test sessions: no two sessions on this machine (other checkouts, other users, CI
jobs running side by side) ever share a DDS domain, so one session's nodes never receive another's messages.

A session claims an id by taking an exclusive, non-blocking ``fcntl.flock`` on ``<lock_dir>/<id>.lock`` (one file per
id, in a directory shared through the system temp dir) and keeps the file open until it exits; the kernel drops the
lock when the process dies, however it dies, so a crashed session never leaks its id.  Ids are scanned from a
pid-dependent start so that concurrent sessions rarely even try the same one.  An explicitly set ``ROS_DOMAIN_ID``
is respected (not locked); one that an ancestor session claimed (marked in ``OXYGEN_TEST_DOMAIN_CLAIMED_BY``) is not
"explicit": a nested session claims its own.  Pure stdlib, no ROS import (conftest calls it before rclpy loads).
"""
from __future__ import annotations

import errno
import fcntl
import os
import tempfile
from pathlib import Path

LOCK_DIR = Path(tempfile.gettempdir()) / "oxygen_ros_test_domain_ids"
IDS = range(1, 101)        # 0 is ROS's default domain (robots, other users); ids up to 101 are valid on Linux
CLAIMED_BY = "OXYGEN_TEST_DOMAIN_CLAIMED_BY"

# lock file (``<lock_dir>/<id>.lock``) -> its open fd in this process (closing it releases the claim).  Keyed by the
# file, not the id: a claim of id 1 in another lock dir (the allocator's own tests) is a different claim, and releasing
# it must not touch this session's id 1.
_held: dict[Path, int] = {}


def claim_domain_id(lock_dir: Path = LOCK_DIR, ids=IDS, start: int | None = None) -> int:
    """Lock the first free id of ``ids`` (scanned cyclically from index ``start``, default pid-dependent) and return
    it; the lock is held until ``release_domain_id(id, lock_dir)`` or process exit.  RuntimeError when every id is
    taken."""
    ids = list(ids)
    lock_dir = Path(lock_dir)
    lock_dir.mkdir(parents=True, exist_ok=True)
    try:
        os.chmod(lock_dir, 0o1777)        # shared by every user, like /tmp (fails harmlessly if another user owns it)
    except OSError:
        pass
    first = os.getpid() % len(ids) if start is None else start
    for i in range(len(ids)):
        did = ids[(first + i) % len(ids)]
        path = lock_path(did, lock_dir)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o666)
        except OSError:
            continue                      # e.g. another user's file we cannot open: treat as taken
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                continue                  # held by another session
            raise
        _held[path] = fd
        return did
    raise RuntimeError(f"all ROS domain ids {ids[0]}..{ids[-1]} are held by other test sessions (locks in "
                       f"{lock_dir}); set ROS_DOMAIN_ID explicitly or wait for one to finish")


def lock_path(did: int, lock_dir: Path = LOCK_DIR) -> Path:
    return Path(lock_dir) / f"{did}.lock"


def release_domain_id(did: int, lock_dir: Path = LOCK_DIR) -> None:
    fd = _held.pop(lock_path(did, lock_dir), None)
    if fd is not None:
        os.close(fd)


def session_domain_id(environ=os.environ, lock_dir: Path = LOCK_DIR, ids=IDS) -> int:
    """This session's ROS_DOMAIN_ID, written to ``environ`` (so that the node/replay subprocesses inherit it): an
    explicitly set one is kept; otherwise a claimed one, marked with this pid in ``CLAIMED_BY``."""
    explicit = environ.get("ROS_DOMAIN_ID", "").strip()
    if explicit and CLAIMED_BY not in environ:
        return int(explicit)
    did = claim_domain_id(lock_dir, ids)
    environ["ROS_DOMAIN_ID"] = str(did)
    environ[CLAIMED_BY] = str(os.getpid())
    return did
