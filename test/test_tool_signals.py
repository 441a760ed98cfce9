"""A tool that starts processes leaves none behind, however it is stopped.

``oxygen sim-eval --workers 2`` (the evaluation every success figure comes from) is stopped mid-grid by two SIGTERMs
(0.3 s apart), SIGINT or SIGKILL. Before ``cli.main`` turned SIGTERM into an orderly exit, SIGTERM killed the tool
alone: no ``finally`` block ran, the exit status said "killed", and its two simulation workers were seen at full CPU
after it was gone (found by stopping a ``bench/sim_evals.sh joins`` run), each until its queue broke. SIGKILL can run
no cleanup at all, so the workers must die with their parent (PR_SET_PDEATHSIG). The test records every descendant of
the tool while it runs and asserts that each is gone within a few seconds of the tool's exit; the exit status is 128 +
the signal (130 for Ctrl-C)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

# ("SIGTERM",) alone is the first half of the second case: its first signal must start the orderly exit the same way
SEQUENCES = [("SIGTERM", "SIGTERM"), ("SIGINT",), ("SIGKILL",)]


def _children(pid: int) -> set[int]:
    out = set()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:      # field 4: ppid (the name in parentheses may hold spaces)
            out.add(int(d.name))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")                               # a zombie has exited; only its reaping is pending


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("sequence", SEQUENCES, ids=["+".join(s).lower() for s in SEQUENCES])
def test_sim_eval_leaves_no_worker_behind(tmp_path, sequence):
    cmd = [sys.executable, "-m", "oxygen_ros.tools.cli", "sim-eval", "--policy", "expert", "--task", "reach",
           "--seeds", "0:12", "--workers", "2", "--no-video", "--out", str(tmp_path / "eval")]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    seen: set[int] = set()
    progressed = threading.Event()
    err: list[str] = []

    def read_stderr():                                           # the progress bar: "... 1/12 episodes ..."
        buf = b""
        while chunk := proc.stderr.read1(4096):
            buf += chunk
            if b"/12 episodes" in buf:
                progressed.set()
        err.append(buf.decode(errors="replace"))

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 180
        while not progressed.is_set() and time.monotonic() < deadline and proc.poll() is None:
            seen |= _children(proc.pid)
            time.sleep(0.2)
        seen |= _children(proc.pid)
        assert progressed.is_set(), f"no episode finished within 180 s (rc {proc.poll()}): {''.join(err)[-2000:]}"
        workers = {p for p in seen if _alive(p)}
        assert len(workers) >= 2, f"expected 2 workers (+ the resource tracker) under {proc.pid}, saw {seen}"
        for name in sequence:
            proc.send_signal(getattr(signal, name))
            time.sleep(0.3)
        rc = proc.wait(60)
        deadline = time.monotonic() + 15
        while any(_alive(p) for p in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = [p for p in workers if _alive(p)]
        assert not left, f"{sequence}: processes {left} outlived sim-eval"
        expected = {"SIGINT": 130}.get(sequence[0], 128 + getattr(signal, sequence[0]))
        if sequence[0] == "SIGKILL":
            expected = -signal.SIGKILL
        assert rc == expected, f"{sequence}: exit status {rc}, expected {expected}; stderr: {''.join(err)[-2000:]}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        for p in seen:
            if _alive(p):
                try:
                    os.kill(p, signal.SIGKILL)
                except OSError:
                    pass
