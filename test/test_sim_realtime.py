"""``oxygen sim-eval --clock realtime`` (``tools/sim/realtime.py``'s ``RealtimeCell``: the runner behind the README's
claim table, ``bench/sim_evals.sh claim``) end to end as a separate process: per grid cell it starts ``oxygen_node``
and ``sim_node`` over DDS, runs the episodes on ``~/reset``, asks the scene questions on sim time and measures each
episode like a lockstep one.  Checked: two engine modes give two cells, each with its episode complete, chunks and
cycles counted, answers scored against their frames, the nodes' logs kept, and no process left behind; a cell whose
node refuses its parameters marks its episodes incomplete and the grid still finishes.  No success or rate is asserted
(shared CPUs)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO, TIMING_GROUP, require_ros

require_ros()
pytest.importorskip("mujoco", reason="the simulation needs mujoco (requirements.txt)")

pytestmark = pytest.mark.xdist_group(TIMING_GROUP)     # node processes: one worker


def _sim_eval(out, *args, timeout=420):
    return subprocess.run([sys.executable, "-m", "oxygen_ros.tools.cli", "sim-eval", "--clock", "realtime",
                           "--task", "pick", "--seeds", "0:1", "--no-video", "--quiet", "--out", str(out), *args],
                          cwd=str(REPO), capture_output=True, text=True, timeout=timeout)


def test_realtime_grid_runs_each_engine_mode_as_its_own_cell(tmp_path, process_watch):
    r = _sim_eval(tmp_path, "--policy", "demo", "--engine-mode", "isolated,oxygen", "--language", "q0.5m0.5",
                  "--real-time-factor", "0.5")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert process_watch.wait_gone(10.0) == {}                  # both cells' nodes stopped, nothing re-parented
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["config"]["clock"] == "realtime" and s["config"]["real_time_factor"] == 0.5
    cells = {c["engine_mode"]: c for c in s["cells"]}
    assert set(cells) == {"isolated", "oxygen"}
    eps = json.loads((tmp_path / "results.json").read_text())["episodes"]
    assert len(eps) == 2 and {e["cell"] for e in eps} == {c["name"] for c in s["cells"]}
    for mode, c in cells.items():
        a = c["aggregate"]
        assert a["incomplete"] == 0, (mode, [e.get("error") for e in eps])
        assert a["tasks"]["pick"]["n"] == 1
        assert a["cycles_per_s"] > 0 and a["action_hz"] > 0, mode
        assert a["answers"]["n"] >= 1, mode                      # a question every 0.5 sim s (pick lasts >= 2 s), scored
        assert 0.0 <= a["answers"]["exact"] <= 1.0
        assert a["memory"]["n"] >= 1, mode
        lat, age = a["chunk_latency_ms"], a["chunk_obs_age_s"]          # each chunk's cost, from the node's messages
        assert lat["n"] >= 1 and lat["n"] == age["n"] and lat["p50"] > 0.0, (mode, lat)
        assert 0.0 <= age["p50"] <= age["p95"] < 60.0, (mode, age)
        mine = [e for e in eps if e["cell"] == c["name"]]     # one entry per chunk, not per re-sent message (+-1 at
        assert abs(lat["n"] - sum(e["chunks"] for e in mine)) <= 2 * len(mine), (mode, lat)   # an episode's ends)
        assert a["plan_age_s"]["n"] >= lat["n"] and a["plan_age_s"]["p50"] >= age["p50"], (mode, a["plan_age_s"])
        logs = {who: list((tmp_path / "logs").glob(f"{c['name']}.{who}.log"))
                for who in ("oxygen_node", "sim_node")}
        assert all(len(v) == 1 for v in logs.values()), logs     # the nodes' own logs, per cell
        assert f"engine {mode}," in logs["oxygen_node"][0].read_text()     # the cell's node ran the cell's mode
    for e in eps:
        assert e["chunks"] > 0 and e["duration_s"] > 0
        assert e["answers"] and all(ans["gt"] and ans["frame_t"] <= e["duration_s"] for ans in e["answers"])
    table = (tmp_path / "table.txt").read_text()
    assert "isolated" in table and "oxygen" in table


def test_a_cell_whose_node_refuses_to_start_marks_its_episodes_incomplete(tmp_path, process_watch):
    """The node exits 2 on a checkpoint that is not one (an empty folder passes the CLI's directory check): the
    cell's episode is reported incomplete with the node's reason, the grid still writes its results, nothing is
    left running."""
    bad = tmp_path / "not_a_checkpoint"
    bad.mkdir()
    r = _sim_eval(tmp_path / "out", "--policy", bad, "--real-time-factor", "1.0", timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert process_watch.wait_gone(10.0) == {}
    assert "INCOMPLETE" in r.stderr and "did not come up" in r.stderr, r.stderr[-3000:]
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    a = s["cells"][0]["aggregate"]
    assert a["incomplete"] == 1 and a["tasks"]["pick"]["n"] == 0
