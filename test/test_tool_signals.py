"""A tool that starts processes leaves none behind, however it is stopped.

``oxygen sim-eval --workers 2`` (the evaluation every success figure comes from) is stopped mid-grid by two SIGTERMs
(0.3 s apart), SIGINT or SIGKILL. Before ``cli.main`` turned SIGTERM into an orderly exit, SIGTERM killed the tool
alone: no ``finally`` block ran, the exit status said "killed", and its two simulation workers were seen at full CPU
after it was gone (found by stopping a ``bench/sim_evals.sh joins`` run), each until its queue broke. SIGKILL can run
no cleanup at all, so the workers must die with their parent (PR_SET_PDEATHSIG). The test records every descendant of
the tool while it runs (conftest's ``ProcessWatch``) and asserts that each is gone within a few seconds of the tool's
exit; the exit status is 128 + the signal (130 for Ctrl-C)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

# ("SIGTERM",) alone is the first half of the second case: its first signal must start the orderly exit the same way
SEQUENCES = [("SIGTERM", "SIGTERM"), ("SIGINT",), ("SIGKILL",)]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ProcessWatch reads /proc")
@pytest.mark.parametrize("sequence", SEQUENCES, ids=["+".join(s).lower() for s in SEQUENCES])
def test_sim_eval_leaves_no_worker_behind(tmp_path, sequence, process_watch):
    cmd = [sys.executable, "-m", "oxygen_ros.tools.cli", "sim-eval", "--policy", "expert", "--task", "reach",
           "--seeds", "0:12", "--workers", "2", "--no-video", "--out", str(tmp_path / "eval")]
    # the tool as started from a terminal: a test session run as a shell's background job (nohup ... &) has SIGINT
    # ignored, and an ignored signal stays ignored across exec - Python then never raises KeyboardInterrupt in the tool
    # (POSIX's rule for background jobs, which the tool rightly follows); a handled one is reset to the default
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
    finally:
        signal.signal(signal.SIGINT, old)
    progressed = threading.Event()
    err: list[str] = []

    def read_stderr():                                           # the progress bar: "... 1/12 episodes ..."
        buf = b""
        while chunk := proc.stderr.read1(4096):
            buf += chunk
            if b"/12 episodes" in buf:
                progressed.set()
        err.append(buf.decode(errors="replace"))

    threading.Thread(target=read_stderr, daemon=True).start()
    try:
        progressed.wait(180)
        assert progressed.is_set(), f"no episode finished within 180 s (rc {proc.poll()}): {''.join(err)[-2000:]}"
        process_watch.sample()
        workers = [c for c in process_watch.alive().values() if "multiprocessing-fork" in c]
        assert len(workers) == 2, f"expected 2 workers under {proc.pid}: {process_watch.alive()}"
        for name in sequence:
            proc.send_signal(getattr(signal, name))
            time.sleep(0.3)
        rc = proc.wait(60)
        left = process_watch.wait_gone(15)
        assert not left, f"{sequence}: processes outlived sim-eval: {left}"
        expected = {"SIGINT": 130}.get(sequence[0], 128 + getattr(signal, sequence[0]))
        if sequence[0] == "SIGKILL":
            expected = -signal.SIGKILL
        assert rc == expected, f"{sequence}: exit status {rc}, expected {expected}; stderr: {''.join(err)[-2000:]}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
