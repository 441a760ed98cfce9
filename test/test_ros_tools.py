"""Smoke tests of the user-facing ROS tools as separate processes: ``oxygen demo`` (the README's main job: one short
closed-loop episode with the shipped policy - summary, scored answers, video, timeline, both nodes exit 0; and the
open-loop ``--bag`` demo: status lines, streamed answers, summary, PNG timeline and JSON written, node exits cleanly), ``oxygen ros-bench``
(table + JSON with rate, jitter and camera-to-chunk latency), ``oxygen make-bag``, and that every ``oxygen``
subcommand of the ROS layer resolves to the function the CLI expects."""
from __future__ import annotations

import importlib
import json
import subprocess
import sys

import pytest

from conftest import REPO, TIMING_GROUP, kill_node_mid_run, require_ros

require_ros()

pytestmark = pytest.mark.xdist_group(TIMING_GROUP)     # node / player / launch processes: one worker


def _oxygen(*args, timeout=240):
    return subprocess.run([sys.executable, "-m", "oxygen_ros.tools.cli", *map(str, args)], cwd=str(REPO),
                          capture_output=True, text=True, timeout=timeout)


def test_cli_entry_points_exist():
    from oxygen_ros.tools.cli import COMMANDS
    for name in ("node", "demo", "make-bag", "replay", "ros-bench", "bag-eval", "bag-diff"):
        module, func = COMMANDS[name]
        assert callable(getattr(importlib.import_module(module), func)), name


def test_make_bag_cli(tmp_path):
    r = _oxygen("make-bag", tmp_path / "b", "--duration", "1", "--storage", "sqlite3", "--width", "64",
                "--height", "48", timeout=60)
    assert r.returncode == 0, r.stderr
    assert "/camera/base/image_raw" in r.stdout and list((tmp_path / "b").glob("*.db3"))


def test_demo_closed_loop_short_run(tmp_path):
    """The README's main job, one short episode: sim_node + oxygen_node (the shipped demo policy) over DDS, the
    episode's instruction and outcome, questions answered and scored against the ground truth, both nodes exit 0,
    the video, the timeline and the summary written.  No success or rate is asserted (shared CPUs)."""
    pytest.importorskip("mujoco", reason="the simulation needs mujoco (requirements.txt)")
    r = _oxygen("demo", "--episodes", "1", "--tasks", "reach", "--device", "cpu", "--out", tmp_path, timeout=300)
    out = r.stdout
    assert r.returncode == 0, out[-3000:] + r.stderr[-2000:]
    assert "=== summary ===" in out and "reach" in out and "answers" in out
    s = json.loads((tmp_path / "demo_summary.json").read_text())
    assert s["node_exit_code"] == 0 and s["sim_exit_code"] == 0 and s["policy"] == "demo"
    assert len(s["episodes"]) == 1 and s["episodes"][0]["task"] == "reach" and s["episodes"][0]["seed"] >= 0
    # every answer is scored against the frame it read, or said to be unscored (never a wrong verdict)
    assert s["answers"] and any(a["scored"] for a in s["answers"]), s["answers"]
    assert all(a["scored"] == (a["ground_truth"] is not None) and (a["ok"] <= a["scored"]) for a in s["answers"])
    assert s["inference_rate_hz"] > 0 and s["tokens_per_s"] > 0
    for name, least in (("demo.mp4", 20_000), ("demo_timeline.png", 10_000)):
        f = tmp_path / name
        assert f.is_file() and f.stat().st_size > least, name


def test_demo_bag_mode_short_run(tmp_path):
    """``oxygen demo --bag synthetic`` (the open-loop demo) with random weights: the note says so, status lines,
    streamed answers, summary, PNG timeline and JSON, the control topic at its rate (the median interval between the
    node's tick stamps, not this machine's receive times), a clean and quick node exit."""
    r = _oxygen("demo", "--bag", "synthetic", "--checkpoint", "", "--duration", "8", "--device", "cpu",
                "--out", tmp_path)
    out = r.stdout
    assert r.returncode == 0, out[-3000:] + r.stderr[-2000:]
    assert "RANDOM-WEIGHT" in out and "--checkpoint" in out
    assert "control" in out and "Hz" in out and "=== summary ===" in out
    png = tmp_path / "demo_timeline.png"
    assert png.is_file() and png.stat().st_size > 10_000
    s = json.loads((tmp_path / "demo_summary.json").read_text())
    assert s["control_rate_hz"] > 0 and 0.5 <= s["control_tick_interval_ms"]["p50"] * 70 / 1e3 <= 2.0, s
    assert s["node_exit_code"] == 0 and s["node_shutdown_s"] < 5.0
    assert s["chunks_computed"] > 5 and s["tokens"] > 0


def test_ros_bench_short_run(tmp_path):
    out = tmp_path / "rb.json"
    r = _oxygen("ros-bench", "--duration", "3", "--warmup", "1", "--device", "cpu", "--out", out)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "camera -> chunk" in r.stdout and "action_chunk rate" in r.stdout
    res = json.loads(out.read_text())
    assert res["control_rate_hz"] > 0 and res["camera_to_chunk_ms"]["n"] > 0
    # the node's tick interval (start_time differences); the receiver's inter-arrival is reported, not judged
    assert 0.5 <= res["tick_interval_ms"]["p50"] * 70 / 1e3 <= 2.0, res["tick_interval_ms"]
    assert res["interarrival_ms"]["n"] > 0


def test_ros_bench_fails_when_the_node_dies_during_the_measurement(tmp_path, process_watch):
    """The node SIGKILLed mid-measurement: the benchmark says so, exits non-zero and marks its JSON (it used to print
    a table of whatever arrived before, with nothing saying the node had died)."""
    out = tmp_path / "rb.json"

    def node_pids(_line):
        process_watch.sample()
        return [pid for (pid, _), cmd in process_watch.alive().items() if "oxygen_ros.ros.node" in cmd]
    rc, text = kill_node_mid_run(["ros-bench", "--duration", "8", "--warmup", "1", "--device", "cpu", "--out", out],
                                 "node ready after", node_pids)
    assert rc != 0, text[-3000:]
    assert "ros-bench FAILED: the node exited during the measurement" in text, text[-3000:]
    assert json.loads(out.read_text())["node_died"] is True
    assert process_watch.wait_gone(10.0) == {}


def test_ros_bench_smoothness_splits_switch_and_inside_steps():
    from oxygen_ros.tools.node.ros_bench import smoothness

    p = 0.01
    t = [int(i * p * 1e9) for i in range(8)]
    rows = [[0.0], [0.1], [0.2], [1.2], [1.3], [1.4], [1.5], [5.0]]
    ids = [1, 1, 1, 2, 2, 2, 2, 3]
    t[7] += int(2 * p * 1e9)                       # a missed tick before the last one: not a step
    sm = smoothness(list(zip(t, ids, rows)), p)
    assert sm["switch"]["n"] == 1 and sm["switch"]["p50"] == pytest.approx(1.0)
    assert sm["inside"]["n"] == 5 and sm["inside"]["p50"] == pytest.approx(0.1)
    assert sm["ratio_p50"] == pytest.approx(10.0)
    assert smoothness([], p)["switch"] == {"n": 0} and smoothness([], p)["ratio_p50"] is None
