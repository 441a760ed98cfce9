"""Tests of ``domain_ids.py``, the ROS_DOMAIN_ID allocator of the test sessions (conftest.py): a claimed id is
refused to every other claimant, in this process and in another one, until its holder releases it or exits (also by
SIGKILL); every id taken is an error, not a silent collision; an explicitly set ROS_DOMAIN_ID is kept, one claimed
by an ancestor session is not reused; and this session runs on a claimed id that nobody else can take.  No ROS."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import domain_ids
from domain_ids import CLAIMED_BY, claim_domain_id, release_domain_id, session_domain_id

HERE = Path(__file__).resolve().parent
IDS = range(1, 4)

HOLDER = ("import sys; sys.path.insert(0, %r); from domain_ids import claim_domain_id; "
          "print(claim_domain_id(%r, range(1, 4), start=0), flush=True); sys.stdin.read()")


def test_claims_exclude_each_other_and_are_released(tmp_path):
    a = claim_domain_id(tmp_path, IDS, start=0)
    b = claim_domain_id(tmp_path, IDS, start=0)                  # same start: must skip the held id
    assert (a, b) == (1, 2)
    release_domain_id(a, tmp_path)
    assert claim_domain_id(tmp_path, IDS, start=0) == 1          # free again once released
    assert claim_domain_id(tmp_path, IDS, start=0) == 3
    with pytest.raises(RuntimeError, match="all ROS domain ids 1..3 are held"):
        claim_domain_id(tmp_path, IDS, start=0)
    for d in (1, 2, 3):
        release_domain_id(d, tmp_path)


def test_a_claim_held_by_another_process_is_refused_until_it_dies(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER % (str(HERE), str(tmp_path))], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "1"
        mine = claim_domain_id(tmp_path, IDS, start=0)
        assert mine == 2
        release_domain_id(mine, tmp_path)
    finally:
        holder.send_signal(signal.SIGKILL)                         # a crashed session: the kernel drops its lock
        holder.wait(10)
    assert claim_domain_id(tmp_path, IDS, start=0) == 1
    release_domain_id(1, tmp_path)


def test_session_domain_id_respects_explicit_and_claims_otherwise(tmp_path):
    env = {"ROS_DOMAIN_ID": "42"}
    assert session_domain_id(env, tmp_path, IDS) == 42 and env == {"ROS_DOMAIN_ID": "42"}     # kept, not locked
    assert not list(tmp_path.glob("*.lock"))
    env = {}
    did = session_domain_id(env, tmp_path, IDS)
    assert env == {"ROS_DOMAIN_ID": str(did), CLAIMED_BY: str(os.getpid())}
    nested = dict(env)                                             # a pytest run started inside this session
    assert session_domain_id(nested, tmp_path, IDS) != did
    for d in (did, int(nested["ROS_DOMAIN_ID"])):
        release_domain_id(d, tmp_path)


def test_the_same_id_in_another_lock_dir_is_another_claim(tmp_path):
    """Claims are per lock file: the allocator's own tests claim and release ids 1-3 in temp dirs, and that must not
    release this session's id when it is one of them (it did: the session test failed when the session had id 1)."""
    a, b = tmp_path / "a", tmp_path / "b"
    assert claim_domain_id(a, IDS, start=0) == 1 and claim_domain_id(b, IDS, start=0) == 1
    release_domain_id(1, b)
    assert domain_ids.lock_path(1, a) in domain_ids._held                     # a's claim is still this process's
    assert claim_domain_id(a, IDS, start=0) == 2                              # and still taken
    assert claim_domain_id(b, IDS, start=0) == 1                              # b's was released
    for d, where in ((1, a), (2, a), (1, b)):
        release_domain_id(d, where)


def test_this_session_holds_its_domain_id():
    did = int(os.environ["ROS_DOMAIN_ID"])
    if os.environ.get(CLAIMED_BY) != str(os.getpid()):
        pytest.skip(f"ROS_DOMAIN_ID={did} was set explicitly (or by an ancestor): not claimed by this session")
    assert did in domain_ids.IDS and domain_ids.lock_path(did) in domain_ids._held
    with pytest.raises(RuntimeError):                              # nobody, not even this process, can claim it
        claim_domain_id(domain_ids.LOCK_DIR, [did])
