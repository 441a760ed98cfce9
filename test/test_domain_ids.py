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
    release_domain_id(a)
    assert claim_domain_id(tmp_path, IDS, start=0) == 1          # free again once released
    assert claim_domain_id(tmp_path, IDS, start=0) == 3
    with pytest.raises(RuntimeError, match="all ROS domain ids 1..3 are held"):
        claim_domain_id(tmp_path, IDS, start=0)
    for d in (1, 2, 3):
        release_domain_id(d)


def test_a_claim_held_by_another_process_is_refused_until_it_dies(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER % (str(HERE), str(tmp_path))], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "1"
        mine = claim_domain_id(tmp_path, IDS, start=0)
        assert mine == 2
        release_domain_id(mine)
    finally:
        holder.send_signal(signal.SIGKILL)                         # a crashed session: the kernel drops its lock
        holder.wait(10)
    assert claim_domain_id(tmp_path, IDS, start=0) == 1
    release_domain_id(1)


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
        release_domain_id(d)


def test_this_session_holds_its_domain_id():
    did = int(os.environ["ROS_DOMAIN_ID"])
    if os.environ.get(CLAIMED_BY) != str(os.getpid()):
        pytest.skip(f"ROS_DOMAIN_ID={did} was set explicitly (or by an ancestor): not claimed by this session")
    assert did in domain_ids.IDS and did in domain_ids._held
    with pytest.raises(RuntimeError):                              # nobody, not even this process, can claim it
        claim_domain_id(domain_ids.LOCK_DIR, [did])
