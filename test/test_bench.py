"""Tests of tools/bench/ (`oxygen bench`): the benchmark runs end to end on the tiny preset (all modes, the shared N=k bound, the k/N
sweep, adaptive k, Poisson arrivals with mixed lengths and kinds), writes its JSON / table / PNG with the hardware
named, reports component costs, the ideal speedup and the cross-mode equivalence check; and its ideal model follows
the engine's scheduling rule. Behaviour only: no timing thresholds."""
import json
import os

import pytest

from oxygen_ros.tools.bench import command, costs


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_steady_state_schedule_and_ideal():
    assert costs.steady_state_schedule(30, 5) == [6, 6, 6, 6, 5]
    assert costs.steady_state_schedule(7, 3) == [3, 2, 1]
    assert costs.steady_state_schedule(5, 1) == [4]
    c = {"prefill_s": 0.175, "actions_s": 0.04, "decode_step_s": {1: 0.0045, 6: 0.010, 8: 0.012}}
    ide = costs.ideal(c, 30, 5)
    assert ide["isolated_frame_s"] == pytest.approx(2 * 0.175 + 0.04 + 29 * 0.0045)
    assert ide["oxygen_frame_s"] == pytest.approx(0.175 + 0.04 + 4 * 0.010 + costs.decode_cost(c, 5))
    assert 1.8 < ide["speedup_oxygen_vs_isolated"] < 2.1       # the rough estimate: "near 2x"


def test_bench_end_to_end(tmp_path):
    out = tmp_path / "run"
    command.run(["--preset", "tiny", "--frames", "4", "-N", "5", "--k", "2", "-S", "2", "--warmup", "2",
              "--reps", "1", "--sweep", "--sweep-n", "4", "--sweep-k", "2,4", "--sweep-frames", "3",
              "--kinds", "subtask,conversation", "--masked-camera", "1", "--out", str(out)])
    for f in ("results.json", "table.txt", "results.png"):
        assert (out / f).stat().st_size > 0
    with open(out / "results.json") as f:
        j = json.load(f)
    assert set(j["modes"]) == {"isolated", "shared", "oxygen", "shared_N=k"}
    for key in ("cpu", "torch", "device", "device_name"):
        assert j["hardware"][key]
    cc = j["component_costs"]
    assert cc["prefill_ms"] > 0 and cc["denoise_step_ms"] > 0 and len(cc["decode_step_ms"]) >= 8
    assert j["ideal"]["speedup_oxygen_vs_isolated"] > 0
    for key in ("speedup_action_hz", "speedup_tokens_per_s", "pct_of_ideal_hz", "oxygen_frame_over_shared_N=k"):
        assert j["summary"][key] > 0
    for mode in ("shared", "oxygen"):
        eq = j["equivalence"][mode]
        assert eq["actions_max_rel_diff"] <= 1e-5 and eq["requests_same_tokens"] == eq["requests"] == 4
    assert j["modes"]["oxygen"]["prefills_per_frame"] == 1.0 and j["modes"]["isolated"]["prefills_per_frame"] >= 2
    assert j["modes"]["oxygen"]["kv_bytes_after_drain"] == 0
    assert len(j["sweep"]) == 2 and all(s["speedup_hz"] > 0 for s in j["sweep"])
    assert "oxygen" in (out / "table.txt").read_text()


def test_bench_adaptive_poisson_mixed(tmp_path):
    doc = command.run(["--preset", "tiny", "--frames", "4", "-N", "6", "--k", "adaptive", "-S", "1", "--warmup", "1",
                      "--reps", "1", "--modes", "oxygen", "--arrivals", "poisson", "--rate", "1.5",
                      "--mixed-lengths", "--kinds", "subtask,memory", "--out", str(tmp_path)])
    m = doc["modes"]["oxygen"]
    assert m["budget_adaptive"] is True and 1 <= m["k_mean"] <= 64       # the bench's k_max = max(64, 2N)
    # misses are counted over exactly the 4 timed frames (warm-up reset, drain not counted), against a real deadline
    assert m["budget_cycles"] == m["frames"] == 4 and 0 <= m["deadline_misses"] <= 4 and m["target_period_s"] > 0
    assert os.path.exists(os.path.join(tmp_path, "results.png"))


def test_bench_writes_each_phase_as_it_ends(tmp_path, monkeypatch):
    """A run cut short (here: the engine runs fail) leaves results.json with the phases that finished."""
    def boom(*a, **k):
        raise KeyboardInterrupt("cut short")
    monkeypatch.setattr(command, "run_all", boom)
    with pytest.raises(KeyboardInterrupt):
        command.run(["--preset", "tiny", "--frames", "2", "-N", "3", "--k", "2", "-S", "1", "--warmup", "1",
                     "--reps", "1", "--out", str(tmp_path)])
    j = json.loads((tmp_path / "results.json").read_text())
    assert j["phase"] == "components" and j["component_costs_before"]["prefill_ms"] > 0 and "modes" not in j


def test_gpu_script_quick_and_time_limit_arguments(tmp_path):
    """bench/gpu.sh's own options, with a stand-in interpreter that records its arguments: --quick runs isolated +
    oxygen on 10 compiled / 3 eager frames without the sweep; the default runs the sweep with the eager reference on
    8 frames; --time-limit wraps the run in timeout; --with-inductor-graphs adds the compiled-only second run."""
    import subprocess
    log = tmp_path / "args.log"
    shim = tmp_path / "python-args"
    shim.write_text(f"#!/bin/sh\nif [ \"$1\" = -c ]; then echo cpu; exit 0; fi\necho \"$@\" >> {log}\n"
                    "if [ -n \"$SLEEP\" ]; then exec sleep \"$SLEEP\"; fi\n")
    shim.chmod(0o755)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def gpu_sh(*args, rc=0, sleep=""):
        log.write_text("")
        r = subprocess.run(["bash", "bench/gpu.sh", "--device", "cpu", "--out", str(tmp_path / "o"), *args],
                           cwd=repo, env=dict(os.environ, PYTHON=str(shim), SLEEP=sleep), capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == rc and "[gpu.sh] done" in r.stdout, r.stdout + r.stderr
        return [line.split() for line in log.read_text().splitlines()], r.stdout

    (run,), _ = gpu_sh("--quick")
    assert "--sweep" not in run and "--bf16-check" not in run
    assert run[run.index("--frames") + 1] == "10" and run[run.index("--eager-frames") + 1] == "3"
    assert run[run.index("--modes") + 1] == "isolated,oxygen" and run[run.index("--compile") + 1] == "inductor"
    (run,), _ = gpu_sh()
    assert "--sweep" in run and run[run.index("--eager-frames") + 1] == "8" and "--bf16-check" in run
    runs, _ = gpu_sh("--quick", "--with-inductor-graphs")
    assert len(runs) == 2 and runs[1][runs[1].index("--compile") + 1] == "inductor-graphs" and "--no-eager" in runs[1]
    _, out = gpu_sh("--quick", "--time-limit", "1", "--with-inductor-graphs", rc=124, sleep="10")
    assert "time limit reached" in out and "(exit 124)" in out


_BLOCK_ROS = ("import sys, runpy\n"
              "for m in ('rclpy', 'oxygen_ros.msg', 'oxygen_ros.srv', 'oxygen_ros.action', 'sensor_msgs',\n"
              "          'std_msgs'):\n"
              "    sys.modules[m] = None          # importing any of them now raises ImportError\n"
              "sys.argv = ['oxygen_ros.tools.bench'] + sys.argv[1:]\n"
              "runpy.run_module('oxygen_ros.tools.bench', run_name='__main__')\n")


def test_gpu_script_runs_end_to_end_on_cpu_without_ros(tmp_path):
    """bench/gpu.sh --device cpu --preset tiny: the GPU benchmark's exact code path (eager vs compiled for every mode,
    the eager reference on fewer frames, the k/N subset, op counts, bf16 check, the phases' partial results) on a
    CPU, with rclpy and the generated messages made unimportable (the core runs on a GPU machine that has torch but no
    ROS).  Behaviour only: the compiled run agrees with eager.  Kept cheap: one batch bucket (8) needs 4 graphs
    instead of 6, S = 3 steps make the actions graph a third of S = 10's, N = 6 / k = 3 and 2 eager frames."""
    import subprocess
    import sys
    shim = tmp_path / "python-noros"
    shim.write_text(f"#!/bin/sh\nif [ \"$1\" = -m ]; then shift 2; exec {sys.executable} -c \"$BLOCK\" \"$@\"; fi\n"
                    f"exec {sys.executable} \"$@\"\n")
    shim.chmod(0o755)
    out = tmp_path / "gpu"
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHON=str(shim), BLOCK=_BLOCK_ROS)
    r = subprocess.run(["bash", "bench/gpu.sh", "--device", "cpu", "--preset", "tiny", "--frames", "3",
                        "--eager-frames", "2", "--sweep-frames", "3", "--out", str(out), "--warmup", "1", "--reps",
                        "1", "--threads", "1", "--no-shared-nk", "-N", "6", "--k", "3", "--sweep-n", "4,6",
                        "--sweep-k", "3,6", "--compile-batch-sizes", "8", "-S", "3"],
                       cwd=repo, env=env, capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "[gpu.sh] done" in r.stdout
    with open(out / "results.json") as f:
        j = json.load(f)
    assert j["phase"] == "done"
    assert j["compile"]["compile"] == "inductor" and j["compile"]["compile_error"] == ""
    assert j["compile"]["compile_graphs"] >= 4 and j["compile"]["graphs"]
    assert {"isolated", "shared", "oxygen", "isolated+inductor", "shared+inductor", "oxygen+inductor"} <= \
        set(j["modes"])
    for mode in ("isolated+inductor", "shared+inductor", "oxygen+inductor"):
        eq = j["equivalence"][mode]
        assert eq["actions_max_rel_diff"] <= 1e-5 and eq["requests_same_tokens"] == eq["requests"] > 0
        assert eq["frames"] == 2 and j["modes"][mode]["frames"] == 3      # compared on the 2 eager frames
        assert j["modes"][mode]["compile_eager_calls"] == 0          # every call of the run hit a warmed graph
    assert j["modes"]["isolated"]["frames"] == 2
    ops = j["op_counts"]
    assert ops["compiled"]["denoise_step"]["ops"] < ops["eager"]["denoise_step"]["ops"]
    for key in ("compiled_denoise_step_speedup", "compiled_oxygen_frame_speedup", "compiled_oxygen_vs_isolated_hz"):
        assert j["summary"][key] > 0
    assert j["component_costs_compiled"]["denoise_step_ms"] > 0
    assert j["bf16_vs_fp32"]["max_abs_diff"] > 0                 # bf16 really ran, and differs a little
    assert len(j["sweep"]) == 4 and j["args"]["compile"] == "inductor" and j["args"]["dtype"] == "float32"
