"""Every ``oxygen`` subcommand run as a user runs it: the installed console script (``<env>/bin/oxygen``, the one
``make demo`` / ``make bench`` call) in a subprocess, with ``PYTHONPATH`` = this checkout (conftest) so the code under
test is this tree's.

One parametrized test over ``tools/cli.py``'s ``COMMANDS`` table, so a new subcommand cannot be missed: each one
needs an entry in ``SMOKE`` below (the test fails for a command without one) - a tiny real run (seconds: tiny preset,
a few frames, the committed 3 s input bag) that must exit 0 and leave its outputs, or ``--help`` where a run needs ROS
peers (the node, the demo, ros-bench, soak: tested as processes in their own files) - and the same command with an
unknown option must exit 2 with a usage message naming the option.  ``python -m`` and in-process calls do not go
through ``cli.main``'s handling of the return value, which is how ``oxygen bench`` came to exit 1 after a successful
run (it returned its results dict).  Also: ``oxygen --help`` names every command, an unknown command exits 2, and a
subcommand returning anything but an exit status is an error naming it.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import bag_golden
from oxygen_ros.tools.cli import COMMANDS, exit_status

OXYGEN = Path(sys.executable).parent / "oxygen"         # the console script of this environment (setup.py)
BAD = "--no-such-option"
EPISODES = Path(__file__).resolve().parent / "data" / "episode_bag"    # one reach episode, 16 px (oxygen sim-record)

# command -> (arguments of a tiny real run, or ["--help"]; files the run must leave under {tmp})
# {tmp}: the test's temporary directory, {input}: the committed input bag, {golden}: the committed output bag,
# {episodes}: the committed episode bag
SMOKE: dict[str, tuple[list[str], list[str]]] = {
    "node": (["--help"], []),
    "demo": (["--help"], []),
    "ros-bench": (["--help"], []),
    "soak": (["--help"], []),
    "bench": (["--preset", "tiny", "--frames", "2", "-N", "3", "--k", "2", "-S", "1", "--warmup", "1", "--reps", "1",
               "--threads", "1", "--modes", "isolated,oxygen", "--no-shared-nk", "--out", "{tmp}/bench"],
              ["bench/results.json", "bench/table.txt", "bench/results.png"]),
    "smoothness": (["--preset", "tiny", "--chunks", "2", "--warmup", "1", "--reps", "1", "--control-hz", "50",
                    "--latency-ms", "20", "--threads", "1", "--no-stream", "--out", "{tmp}/smooth"],
                   ["smooth/results.json", "smooth/table.txt"]),
    "make-bag": (["{tmp}/bag", "--duration", "0.5", "--fps", "5", "--width", "64", "--height", "48"],
                 ["bag/metadata.yaml"]),
    "replay": (["{input}", "--duration", "0.5", "--wait", "0"], []),
    "bag-eval": (["{input}", "--duration", "0.5", "--out", "{tmp}/eval", "-p", "seed:=0", "-p", "device:=cpu"],
                 ["eval/metadata.yaml", "eval/summary.json"]),
    "bag-diff": (["{golden}", "{golden}", "--plot", "{tmp}/diff.png", "--json", "{tmp}/diff.json"],
                 ["diff.png", "diff.json"]),
    "sim": (["--help"], []),
    "sim-record": (["--out", "{tmp}/rec", "--task", "reach", "--seeds", "0:1", "--camera-size", "16", "--quiet"],
                   ["rec/metadata.yaml", "rec/episodes.json"]),
    "sim-eval": (["--policy", "expert", "--task", "reach", "--seeds", "0:1", "--camera-size", "16", "--no-video",
                  "--out", "{tmp}/ev", "--quiet"], ["ev/results.json", "ev/table.txt"]),
    "sim-diagnose": (["--policy", "expert", "--task", "reach", "--seeds", "0:3", "--camera-size", "16",
                      "--out", "{tmp}/diag"], ["diag/grounding.json", "diag/grounding.png", "diag/table.txt"]),
    "train": (["{episodes}", "--out", "{tmp}/run", "--preset", "tiny", "--steps", "2", "--batch-size", "2",
               "--vocab-size", "640", "--val-fraction", "0", "--log-every", "1", "--threads", "1", "--quiet"],
              ["run/latest", "run/curves.json"]),
    "train-vision": (["--out", "{tmp}/vis", "--preset", "tiny", "--scenes", "12", "--val-scenes", "4", "--steps", "2",
                      "--batch-size", "4", "--eval-every", "1", "--threads", "1"],
                     ["vis/vision.safetensors", "vis/vision.json"]),
}


def _oxygen(args: list[str], tmp: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    if not OXYGEN.is_file():
        pytest.fail(f"{OXYGEN} does not exist: the package is not installed in this environment (make setup)")
    subst = {"{tmp}": str(tmp), "{input}": str(bag_golden.INPUT), "{golden}": str(bag_golden.GOLDEN),
             "{episodes}": str(EPISODES)}
    for k, v in subst.items():
        args = [a.replace(k, v) for a in args]
    return subprocess.run([str(OXYGEN), *args], cwd=str(tmp), capture_output=True, text=True, timeout=timeout)


def _smoke(command: str) -> tuple[list[str], list[str]]:
    if command not in SMOKE:
        pytest.fail(f"`oxygen {command}` has no smoke invocation: add a tiny real run (or --help where a run needs ROS "
                    "peers) to SMOKE in test/test_cli.py")
    return SMOKE[command]


def test_smoke_table_names_only_existing_commands():
    assert set(SMOKE) <= set(COMMANDS), f"stale entries: {sorted(set(SMOKE) - set(COMMANDS))}"


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_command_runs_and_exits_0(command, tmp_path):
    args, outputs = _smoke(command)
    r = _oxygen([command, *args], tmp_path)
    assert r.returncode == 0, f"oxygen {command} exited {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.stdout.strip(), "a run (or its help) says something"
    for rel in outputs:
        f = tmp_path / rel
        assert f.exists() and (f.is_dir() or f.stat().st_size > 0), f"oxygen {command} did not write {rel}"


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_command_with_a_bad_argument_exits_2_with_usage(command, tmp_path):
    args, _ = _smoke(command)
    run_args = [a for a in args if a != "--help"]
    r = _oxygen([command, *run_args, BAD], tmp_path, timeout=120)
    assert r.returncode == 2, f"oxygen {command} {BAD} exited {r.returncode}\n{r.stdout[-1000:]}\n{r.stderr[-2000:]}"
    assert "usage:" in r.stderr and BAD in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    for rel in _smoke(command)[1]:
        assert not (tmp_path / rel).exists(), f"a rejected command line still wrote {rel}"


def test_top_level_help_and_unknown_command(tmp_path):
    r = _oxygen(["--help"], tmp_path)
    assert r.returncode == 0
    missing = [c for c in COMMANDS if f"oxygen {c}" not in r.stdout]
    assert not missing, f"`oxygen --help` does not describe {missing} (tools/cli.py's docstring)"
    r = _oxygen(["no-such-command"], tmp_path)
    assert r.returncode == 2 and "usage:" in r.stderr and "'no-such-command'" in r.stderr, r.stderr


def test_exit_status_refuses_what_is_not_one():
    assert exit_status("x", None) == 0 and exit_status("x", 0) == 0 and exit_status("x", 2) == 2
    for bad in ({"modes": {}}, True, "0", 1.0):
        with pytest.raises(TypeError, match="oxygen x: its main function returned a"):
            exit_status("x", bad)


def test_node_arguments_outside_ros_args_are_user_arguments():
    from oxygen_ros.ros.parameters import user_args
    assert user_args(["oxygen_node"]) == [] and user_args(["n", "--help"]) == ["--help"]
    assert user_args(["n", "--ros-args", "-p", "a:=1", "-r", "__ns:=/x"]) == []
    assert user_args(["n", "--bogus", "--ros-args", "--params-file", "f.yaml", "--", "extra"]) == ["--bogus", "extra"]
    assert user_args(["n", "--ros-args", "-p", "a:=1", "--ros-args", "--log-level", "info"]) == []
