"""``oxygen soak`` (``tools/node/soak.py``, the memory-growth benchmark behind ``bench/results/*-soak``) as a process, run
for seconds instead of minutes: the node starts on the tiny preset, the looping bag drives it, questions are answered,
the RSS series and the summary are written, the node exits 0 and nothing is left behind (no process, no temporary bag).
And the fault a long run meets: the node dying mid-soak makes the soak fail (exit 1, saying when), where it used to
report a summary and exit 0.  No memory growth or rate is asserted (seconds on shared CPUs say nothing about either)."""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import tempfile

import pytest

from conftest import REPO, TIMING_GROUP, kill_node_mid_run, require_ros

require_ros()

pytestmark = pytest.mark.xdist_group(TIMING_GROUP)     # node processes: one worker

ARGS = ["--prompt-period", "1", "--sample-period", "1", "--warmup", "1", "--window", "3", "--preset", "tiny"]


def _soak_dirs() -> set:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "oxygen_soak_*")))


def test_a_short_soak_measures_and_cleans_up(tmp_path, process_watch):
    before = _soak_dirs()
    out = tmp_path / "soak.json"
    r = subprocess.run([sys.executable, "-m", "oxygen_ros.tools.cli", "soak", "--duration", "6", *ARGS,
                        "--out", str(out)], cwd=str(REPO), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert process_watch.wait_gone(10.0) == {}
    assert _soak_dirs() == before                                          # the ~100 MB bag is gone
    d = json.loads(out.read_text())
    s, series = d["summary"], d["series"]
    assert len(series) >= 4 and all(row["rss_mib"] and row["rss_mib"] > 50 for row in series)
    assert s["questions"] >= 4 and s["answers"] >= 1, s                   # questions asked and answered
    assert s["node_exit"] == 0 and s["node_died_at_s"] is None
    assert s["rss_max_mib"] >= s["rss_first_mib"] and s["chunk_hz_min"] is not None
    assert (tmp_path / "soak_node.log").is_file()


def test_the_node_dying_mid_soak_fails_the_soak(tmp_path, process_watch):
    out = tmp_path / "soak.json"
    rc, text = kill_node_mid_run(["soak", "--duration", "60", *ARGS, "--out", out], "soak: node pid",
                                 lambda line: int(line.split()[3].rstrip(",")), settle_s=2.0)   # its interpreter
    assert rc == 1, text[-3000:]
    assert "soak FAILED: the node exited" in text
    s = json.loads(out.read_text())["summary"]
    assert s["node_died_at_s"] is not None and s["node_died_at_s"] < 60
    assert process_watch.wait_gone(10.0) == {}
