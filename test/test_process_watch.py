"""conftest's ``ProcessWatch``, the fixture every process-starting test relies on to find survivors: it records a
descendant by (pid, start time) and reports its command line as it is *now* - a process first seen between fork and
exec (multiprocessing's spawn, subprocess) showed its parent's command line then (a fresh-clone CI run failed
``test_sim_eval_leaves_no_worker_behind`` on exactly that: one of two live workers was listed under sim-eval's own
command line)."""
from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from conftest import ProcessWatch

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ProcessWatch reads /proc")


def test_a_process_seen_before_its_exec_is_listed_with_its_new_command_line():
    watch = ProcessWatch(period=3600)                           # no background sampling: the test samples
    started: list[subprocess.Popen] = []
    # the child sleeps between fork and exec (Popen returns only after the exec, so it runs in a thread): sampled
    # then, its command line is this test process's
    t = threading.Thread(target=lambda: started.append(subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(30)", "marker-after-exec"],
        preexec_fn=lambda: time.sleep(1.5))))
    t.start()
    try:
        deadline = time.monotonic() + 10
        while not watch.seen and time.monotonic() < deadline:
            watch.sample()
            time.sleep(0.01)
        (key, before), = watch.seen.items()
        assert "marker-after-exec" not in before, before       # recorded before its exec
        t.join(20)
        assert started and key[0] == started[0].pid
        deadline = time.monotonic() + 10
        while "marker-after-exec" not in watch.alive().get(key, "") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "marker-after-exec" in watch.alive()[key]
        watch.sample()
        assert list(watch.seen) == [key]                        # the same process, not a new one
    finally:
        watch.stop()
        t.join(20)
        for proc in started:
            proc.kill()
            proc.wait(10)
    assert watch.alive() == {}
