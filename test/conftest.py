"""Shared pytest set-up for the ROS tests: DDS isolation and helpers to run the node and a bag replay as processes.

This file owns test-session plumbing only (no test logic).  At import it gives the whole session (and every
subprocess it starts) its own ``ROS_DOMAIN_ID``, claimed with a file lock so that no other session on the machine
holds it (``domain_ids.py``; an explicitly set one is kept), ``ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST``,
``PYTHONPATH`` with the source tree, ``AMENT_PREFIX_PATH`` (PyPI ROS wheels do not set it) and the interpreter's
``bin/`` first on ``PATH`` (``ros2 run``/``launch`` start ``#!/usr/bin/env python3`` scripts).  Helpers:
``NodeProcess`` (start ``python -m oxygen_ros.ros.node`` with ``config/oxygen.yaml`` plus overrides, log to a file,
stop with SIGINT/SIGTERM and measure the exit time), ``start_replay`` (``oxygen replay`` as a process), the
``ros`` fixture (an in-process rclpy node spun in a background thread, with ``collect``/``publisher``/``wait_for``
helpers), ``ProcessWatch`` (every process started below this one, recorded while alive, so orphans are found and
killed) and ``synthetic_bag`` (a short bag made once per session).  Tests needing ROS skip visibly when rclpy or the
generated ``oxygen_ros.msg`` cannot be imported.  For ``make test``'s two workers (``--dist loadgroup``) an unmarked
test joins its file's group and the files marked ``xdist_group(TIMING_GROUP)`` share one worker.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from domain_ids import session_domain_id
from oxygen_ros.tools import harness

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "config" / "oxygen.yaml"

# -- per-session DDS isolation (set before anything imports rclpy) ----------------------------------------------------
session_domain_id(os.environ)
os.environ["ROS_AUTOMATIC_DISCOVERY_RANGE"] = "LOCALHOST"
os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                                          if p and p != str(REPO)])
if not os.environ.get("AMENT_PREFIX_PATH"):
    os.environ["AMENT_PREFIX_PATH"] = sys.prefix
_BIN = str(Path(sys.executable).parent)
os.environ["PATH"] = os.pathsep.join([_BIN] + [p for p in os.environ.get("PATH", "").split(os.pathsep) if p != _BIN])
os.environ.setdefault("PYTHONUNBUFFERED", "1")
os.environ.setdefault("MUJOCO_GL", "egl")          # headless rendering for the simulation (before mujoco is imported)
os.environ.setdefault("RCUTILS_COLORIZED_OUTPUT", "0")


# -- two workers (make test: pytest-xdist --dist loadgroup) ----------------------------------------------------------
TIMING_GROUP = "timing"     # pytest.mark.xdist_group(TIMING_GROUP): files that start node / player processes


def pytest_configure(config):
    if not config.pluginmanager.hasplugin("xdist"):     # pytest-xdist registers it itself
        config.addinivalue_line("markers", "xdist_group(name): run these tests in one pytest-xdist worker")


@pytest.hookimpl(tryfirst=True)            # before xdist's own hook reads the marks (--dist loadgroup)
def pytest_collection_modifyitems(config, items):
    """A test without an ``xdist_group`` mark joins the group of its file, so that ``--dist loadgroup`` keeps a file's
    tests (and its module fixtures) on one worker as ``--dist loadfile`` does; files marked
    ``xdist_group(TIMING_GROUP)`` (those running the node, the player or launch as processes) all share one worker, so
    no two of them load the CPUs at once.  A new test file needs no mark."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::", 1)[0]))


@pytest.fixture(scope="module")
def one_torch_thread():
    """Toy-sized ops are fastest on one thread and do not stall when the CPUs are shared; restored afterwards.
    Use per module: ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    import torch
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def require_ros():
    """Skip (visibly) unless rclpy and the generated oxygen_ros messages import."""
    pytest.importorskip("rclpy", reason="rclpy (ROS 2) is not installed in this environment")
    pytest.importorskip("oxygen_ros.msg", reason="oxygen_ros messages are not built (run `make` / `pip install .`)")


class NodeProcess(harness.NodeProcess):
    """The harness's node process with the tests' defaults: ``config/oxygen.yaml`` on the CPU, eager (the shipped
    ``auto`` would take a GPU and compile where there is one), run from the repository, log appended (a restarted
    node keeps writing to the same file)."""

    def __init__(self, log_path: Path, params: dict | None = None, **kw):
        super().__init__(log_path, {"device": "cpu", "compile": "none", **(params or {})}, CONFIG, append=True,
                         cwd=str(REPO), **kw)


def start_replay(bag, log_path: Path, *extra) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "oxygen_ros.tools.bags.replay", "replay", str(bag), "--quiet", *map(str, extra)]
    log = open(log_path, "ab")
    return subprocess.Popen(cmd, cwd=str(REPO), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def stop_proc(p: subprocess.Popen, timeout: float = 5.0) -> None:
    if p.poll() is None:
        p.send_signal(signal.SIGINT)
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(5)


def kill_node_mid_run(tool_args, marker: str, node_pid, settle_s: float = 1.5, timeout: float = 240.0):
    """Run ``oxygen <tool_args>`` (stdout + stderr merged), read its output to the first line containing ``marker``,
    wait ``settle_s``, SIGKILL what ``node_pid(line)`` returns (a pid or a list of pids), and let the tool finish.
    Returns (exit code, all output).  The tool is killed if it outlives ``timeout`` or the test fails first."""
    p = subprocess.Popen([sys.executable, "-u", "-m", "oxygen_ros.tools.cli", *map(str, tool_args)], cwd=str(REPO),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    watchdog = threading.Timer(timeout, p.kill)           # a tool silent before its marker cannot hang the test
    watchdog.start()
    try:
        for line in p.stdout:
            lines.append(line)
            if marker in line:
                break
        assert lines and marker in lines[-1], "".join(lines)
        time.sleep(settle_s)
        pids = node_pid(lines[-1])
        pids = [pids] if isinstance(pids, int) else list(pids)
        assert pids, "".join(lines)
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        rest, _ = p.communicate(timeout=timeout)
    finally:
        watchdog.cancel()
        if p.poll() is None:
            p.kill()
            p.wait()
    return p.returncode, "".join(lines) + rest


# s: how soon a node that exits cleanly has left the graph.  The participant announces its leave when it is finalised,
# and DDS unmatches the node's publishers when the announcement arrives.  Measured: under 1 ms in each of 99 exits of
# an rclpy node with 200 publishers and subscriptions, observed from a process at nice 10 beside four busy loops.
# After a SIGKILL, the 20 s lease took 19.8-20.0 s.  12 s keeps a wide margin from both.
LEAVE_S = 12.0


class RosHelper:
    """An in-process rclpy node spun by a background executor; collects messages with their receive times."""

    def __init__(self):
        import rclpy

        self.rclpy = rclpy
        if not rclpy.ok():
            rclpy.init()
        self.node = rclpy.create_node(f"oxygen_test_{os.getpid()}")
        self._subs: list = []
        self._collected: dict = {}      # id(list returned by collect) -> its subscription
        self._lock = threading.Lock()
        self._spin = harness.BackgroundSpin(self.node)   # survives a subscription destroyed while it waits

    def collect(self, msg_type, topic: str, qos=50, keep=None) -> list:
        """Subscribe; returns a list that receives (receive_time_monotonic, msg) tuples."""
        out: list = []

        def cb(m):
            with self._lock:
                out.append((time.monotonic(), m))
                if keep and len(out) > keep:
                    del out[: len(out) - keep]
        self._subs.append(self.node.create_subscription(msg_type, topic, cb, qos))
        self._collected[id(out)] = self._subs[-1]
        return out

    def uncollect(self, out: list) -> None:
        """Destroy the subscription that fills ``out`` (a list returned by ``collect``)."""
        sub = self._collected.pop(id(out))
        self._subs.remove(sub)
        self.node.destroy_subscription(sub)

    def publisher(self, msg_type, topic: str, qos=10):
        return self.node.create_publisher(msg_type, topic, qos)

    def wait_matched(self, pub, node_name: str | None = None, timeout: float = 30.0) -> None:
        """Wait until DDS discovery is done for ``pub`` (any publisher, this node's or an in-process node's): the
        graph lists a subscription of ``node_name`` (if given) on its topic and ``pub`` has matched every subscription
        the graph lists there, so a message published now reaches them (a fixed sleep was a race under load)."""
        def ready():
            subs = self.node.get_subscriptions_info_by_topic(pub.topic_name)
            return (node_name is None or any(s.node_name == node_name for s in subs)) and \
                len(subs) > 0 and pub.get_subscription_count() >= len(subs)
        assert self.wait_for(ready, timeout), (
            f"{pub.topic_name}: after {timeout:.0f} s the publisher matched {pub.get_subscription_count()} of the "
            f"subscriptions {[s.node_name for s in self.node.get_subscriptions_info_by_topic(pub.topic_name)]}")

    def publishers_matched(self, msg_type, topic: str):
        """A function that returns how many publishers of ``topic`` DDS has matched to a best-effort subscription
        (best effort matches any publisher's QoS).  The count drops the moment a publishing participant announces
        its leave, or when its 20 s lease expires.  Use it, not the graph's node list, to see a node leave: a
        long-lived participant's node list can keep a node that has exited. rmw_dds_common's
        ``GraphCache::update_participant_entities`` re-creates a participant's entry when it takes an entities
        message after that participant's removal, and a node sends such messages while it is being destroyed.
        This was seen in CI, where ``oxygen_node`` was still listed 30 s after it exited, past the lease."""
        from rclpy.qos import QoSProfile, ReliabilityPolicy   # noqa: PLC0415

        sub = self.node.create_subscription(msg_type, topic, lambda _m: None,
                                            QoSProfile(depth=1, reliability=ReliabilityPolicy.BEST_EFFORT))
        self._subs.append(sub)
        return sub.get_publisher_count

    def now(self):
        return self.node.get_clock().now()

    @staticmethod
    def wait_for(pred, timeout: float, interval: float = 0.05) -> bool:
        t_end = time.monotonic() + timeout
        while time.monotonic() < t_end:
            if pred():
                return True
            time.sleep(interval)
        return bool(pred())

    def close(self):
        self._spin.close()


class ProcessWatch:
    """Every process started below this test process while the watch runs, so none can escape as an orphan.

    A process whose parent dies without stopping it (e.g. the child of ``ros2 run`` when launch signals only
    ``ros2``) is re-parented to init and is no longer a descendant; so a thread samples the process tree (``/proc``,
    Linux) every ``period`` s and remembers each new descendant by (pid, start time), which pid reuse cannot fool.
    ``alive()`` lists the recorded processes still running, ``kill()`` SIGKILLs them (the fixture's safety net)."""

    def __init__(self, period: float = 0.1):
        self.period = period
        self.seen: dict[tuple[int, int], str] = {}       # (pid, start time in clock ticks) -> command line
        self._before = set(self._descendants())            # already running: not this watch's
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="process-watch", daemon=True)
        self._thread.start()

    @staticmethod
    def _stat(pid: int) -> tuple[int, int, str] | None:
        """(parent pid, start time, state) of a live process, None if gone."""
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()    # after "pid (comm)": state ppid ... starttime
        except (OSError, IndexError):
            return None
        return int(fields[1]), int(fields[19]), fields[0]

    @staticmethod
    def _cmdline(pid: int) -> str:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            return ""

    def _descendants(self) -> list[tuple[int, int]]:
        children: dict[int, list[tuple[int, int]]] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                st = self._stat(int(entry))
                if st is not None and st[2] != "Z":
                    children.setdefault(st[0], []).append((int(entry), st[1]))
        out, todo = [], [os.getpid()]
        while todo:
            for key in children.get(todo.pop(), []):
                out.append(key)
                todo.append(key[0])
        return out

    def sample(self) -> None:
        for key in self._descendants():
            if key not in self._before and key not in self.seen:
                self.seen[key] = self._cmdline(key[0])

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self.sample()

    def alive(self) -> dict[tuple[int, int], str]:
        """The recorded processes still running (not zombies): {(pid, start time): command line}.  The command line is
        read now: one recorded between fork and exec still showed its parent's (exec keeps pid and start time)."""
        out = {}
        for key, cmd in self.seen.items():
            st = self._stat(key[0])
            if st is not None and st[1] == key[1] and st[2] != "Z":
                out[key] = self._cmdline(key[0]) or cmd
        return out

    def wait_gone(self, timeout: float) -> dict[tuple[int, int], str]:
        """Wait up to ``timeout`` s for every recorded process to exit; return those still running."""
        t_end = time.monotonic() + timeout
        while self.alive() and time.monotonic() < t_end:
            time.sleep(0.1)
        return self.alive()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2)

    def kill(self) -> None:
        for pid, _ in self.alive():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


@pytest.fixture
def process_watch():
    """A ``ProcessWatch`` for one test; at teardown it SIGKILLs whatever the test left running (even on failure)."""
    w = ProcessWatch()
    yield w
    w.stop()
    w.sample()
    w.kill()


@pytest.fixture(scope="session")
def ros():
    pytest.importorskip("rclpy", reason="rclpy (ROS 2) is not installed in this environment")
    h = RosHelper()
    yield h
    h.close()
    if h.rclpy.ok():
        h.rclpy.shutdown()


@pytest.fixture(scope="session")
def synthetic_bag(tmp_path_factory):
    from oxygen_ros.tools.bags.replay import make_bag
    out = tmp_path_factory.mktemp("bags") / "synthetic"
    return make_bag(out, duration=6.0, fps=15.0, width=224, height=224)
