"""Shared plumbing for the tools that run the node (``oxygen demo``, ``ros-bench``, ``soak``, ``replay``, ``bag-eval``)
and for the tests: run ``oxygen_node`` as a child process, watch its outputs from an in-process rclpy node, feed it a
bag, and summarise timing.  It serves ``tools/`` (and ``test/conftest.py``), never the node itself, so it lives here.

This file owns no ROS logic of its own.  ``default_params_file()`` finds ``config/oxygen.yaml`` (source checkout or
installed share dir); ``NodeProcess`` starts ``python -m oxygen_ros.ros.node`` with that file plus overrides, logs to
a file and stops it with SIGINT; ``Monitor`` subscribes to every node output (``action_chunk``,
``language/tokens``, ``conversation/response``, ``memory/entries``, ``/diagnostics``) recording arrival times on
the steady clock; ``stats_ms`` gives percentiles; ``use_large_frame_profile`` points Fast DDS at
``config/fastdds_large_frames.xml`` (32 MiB shared-memory segment) unless the user chose a profile.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from oxygen_ros.ros.parameters import package_config

__all__ = ["default_params_file", "NodeProcess", "Monitor", "stats_ms", "isolate_dds", "use_large_frame_profile",
           "large_frame_profile"]


def isolate_dds() -> None:
    """Keep demo/bench traffic on this machine unless the user configured otherwise."""
    os.environ.setdefault("ROS_AUTOMATIC_DISCOVERY_RANGE", "LOCALHOST")
    if not os.environ.get("AMENT_PREFIX_PATH"):
        os.environ["AMENT_PREFIX_PATH"] = sys.prefix
    use_large_frame_profile()


def large_frame_profile() -> Path | None:
    """The shipped Fast DDS profile with a 32 MiB shared-memory segment (config/fastdds_large_frames.xml)."""
    here = Path(__file__).resolve().parents[2] / "config" / "fastdds_large_frames.xml"
    if here.is_file():
        return here
    try:
        from ament_index_python.packages import get_package_share_directory  # noqa: PLC0415
        p = Path(get_package_share_directory("oxygen_ros")) / "config" / "fastdds_large_frames.xml"
        return p if p.is_file() else None
    except Exception:  # noqa: BLE001
        return None


def use_large_frame_profile() -> None:
    """Frames over ~512 KiB leave Fast DDS's default shared-memory segment and best-effort delivery then loses
    most of them; a writer of camera frames (replay) should use the big-segment profile.  Only when the user chose
    no profile and no other RMW.  Must run before rclpy.init() in this process; child processes inherit it."""
    if os.environ.get("FASTDDS_DEFAULT_PROFILES_FILE"):
        return
    if os.environ.get("RMW_IMPLEMENTATION", "rmw_fastrtps_cpp") not in ("rmw_fastrtps_cpp",
                                                                         "rmw_fastrtps_dynamic_cpp"):
        return
    p = large_frame_profile()
    if p is not None:
        os.environ["FASTDDS_DEFAULT_PROFILES_FILE"] = str(p)


def default_params_file() -> Path:
    return package_config("oxygen.yaml")


def _fmt(v) -> str:
    """A parameter value for ``-p name:=value`` (YAML): strings single-quoted so '' and numeric-looking strings stay
    strings; lists in flow style."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return "'" + v.replace("'", "''") + "'"
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_fmt(x) for x in v) + "]"
    return str(v)


class NodeProcess:
    """``python -m oxygen_ros.ros.node --ros-args --params-file <params_file> -p k:=v ...`` as a child process in its
    own session, logging to ``log_path`` (truncated, or appended with ``append=True`` so restarts share one log).
    ``module``: another node's module (e.g. ``oxygen_ros.ros.sim_node``; no params file unless given)."""

    def __init__(self, log_path, params: dict | None = None, params_file=None, *, namespace: str = "",
                 remaps: dict | None = None, extra_args=(), append: bool = False, cwd=None,
                 module: str = "oxygen_ros.ros.node"):
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", module, "--ros-args"]
        if module == "oxygen_ros.ros.node" or params_file:
            cmd += ["--params-file", str(params_file or default_params_file())]
        for k, v in (params or {}).items():
            cmd += ["-p", f"{k}:={_fmt(v)}"]
        if namespace:
            cmd += ["-r", f"__ns:={namespace}"]
        for a, b in (remaps or {}).items():
            cmd += ["-r", f"{a}:={b}"]
        self.cmd = cmd + list(extra_args)
        env = dict(os.environ)
        root = Path(__file__).resolve().parents[2]
        if (root / "setup.py").is_file() and (root / "oxygen_ros").is_dir():   # running from a source checkout
            env["PYTHONPATH"] = os.pathsep.join([str(root)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                                               if p and p != str(root)])
        env.setdefault("PYTHONUNBUFFERED", "1")
        self._log = open(self.log_path, "ab" if append else "wb")
        self.proc = subprocess.Popen(self.cmd, cwd=cwd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        self.started = time.monotonic()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def tail(self, n: int = 20) -> str:
        return "\n".join(self.log().splitlines()[-n:])

    def stop(self, sig=signal.SIGINT, timeout: float = 10.0) -> tuple[int | None, float]:
        """Send ``sig``; return (exit code, or None if it had to be killed; seconds to exit)."""
        if self.proc.poll() is not None:
            self._log.close()
            return self.proc.returncode, 0.0
        t = time.monotonic()
        self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)
            rc = None
        self._log.close()
        return rc, time.monotonic() - t

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.alive():
            self.stop(timeout=5.0)


class BackgroundSpin:
    """One rclpy node spun on its own executor in a daemon thread until ``close()`` or rclpy's shutdown (the tools'
    in-process observers and the tests' ``ros`` helper).  An exception out of ``spin_once`` while running - a
    callback's, or rclpy's ``InvalidHandle`` when another thread destroys a subscription the wait set still holds - is
    kept in ``last_error`` and spinning goes on (the thread used to die of it, and every later message was lost);
    once closing, it ends the thread."""

    def __init__(self, node):
        from rclpy.executors import SingleThreadedExecutor  # noqa: PLC0415
        self.node = node
        self.executor = SingleThreadedExecutor()
        self.executor.add_node(node)
        self.last_error: Exception | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._spin, daemon=True)
        self._thread.start()

    def _spin(self) -> None:
        while not self._stop.is_set() and self.executor.context.ok():
            try:
                self.executor.spin_once(timeout_sec=0.05)
            except Exception as exc:  # noqa: BLE001 - shutting down, or an error that must not stop the others
                if self._stop.is_set():
                    return
                self.last_error = exc

    def close(self) -> None:
        """Stop spinning, shut the executor down and destroy the node."""
        self._stop.set()
        self._thread.join(2.0)
        self.executor.shutdown(timeout_sec=1.0)
        self.node.destroy_node()


class Monitor:
    """In-process observer of oxygen_node's outputs (spun in a background thread)."""

    def __init__(self, node_name: str = "oxygen_monitor"):
        import rclpy  # noqa: PLC0415
        from diagnostic_msgs.msg import DiagnosticArray  # noqa: PLC0415
        from std_msgs.msg import String  # noqa: PLC0415

        from oxygen_ros.msg import ActionChunk, LanguageToken, MemoryEntry  # noqa: PLC0415

        self.rclpy = rclpy
        if not rclpy.ok():
            rclpy.init()
        self.node = rclpy.create_node(node_name)
        self.lock = threading.Lock()
        # (t_recv_monotonic, recv_ros_ns, header stamp ns, chunk_id, horizon, latency_ms, observation_age_s,
        #  start_time ns = the node's control tick, row 0 = the action executed at that tick [A] float32)
        self.chunks: list = []
        self.tokens: list = []          # (t, request_id, task, index, text, is_final, finish_reason)
        self.responses: list = []       # (t, text)
        self.memory: list = []          # (t, entry_id, text)
        self.trajectories: list = []    # (t_recv_monotonic, recv_ros_ns, header stamp ns, points)
        self.diag: dict = {}            # name -> (level, message, values)
        self.diag_t = 0.0
        self.t0 = time.monotonic()
        n = self.node
        n.create_subscription(ActionChunk, "action_chunk", self._on_chunk, 200)
        n.create_subscription(LanguageToken, "language/tokens", self._on_token, 1000)
        n.create_subscription(String, "conversation/response", self._on_response, 100)
        n.create_subscription(MemoryEntry, "memory/entries", self._on_memory, 100)
        n.create_subscription(DiagnosticArray, "/diagnostics", self._on_diag, 20)
        from trajectory_msgs.msg import JointTrajectory  # noqa: PLC0415
        n.create_subscription(JointTrajectory, "joint_trajectory", self._on_trajectory, 100)
        self.prompt_pub = n.create_publisher(String, "conversation/prompt", 10)
        self._String = String
        self._spin = BackgroundSpin(n)

    def now_ns(self) -> int:
        return self.node.get_clock().now().nanoseconds

    def _on_chunk(self, m):
        t = time.monotonic()
        rn = self.now_ns()
        hs = m.header.stamp.sec * 1_000_000_000 + m.header.stamp.nanosec
        with self.lock:
            st = m.start_time.sec * 1_000_000_000 + m.start_time.nanosec
            row0 = np.asarray(m.actions[:m.action_dim], dtype=np.float32)
            self.chunks.append((t, rn, hs, m.chunk_id, m.horizon, m.inference_latency_ms, m.observation_age_s, st,
                                row0))

    def _on_trajectory(self, m):
        t, rn = time.monotonic(), self.now_ns()
        with self.lock:
            self.trajectories.append((t, rn, m.header.stamp.sec * 1_000_000_000 + m.header.stamp.nanosec,
                                      len(m.points)))

    def _on_token(self, m):
        with self.lock:
            self.tokens.append((time.monotonic(), m.request_id, m.task, m.index, m.text, m.is_final,
                                m.finish_reason))

    def _on_response(self, m):
        with self.lock:
            self.responses.append((time.monotonic(), m.data))

    def _on_memory(self, m):
        with self.lock:
            self.memory.append((time.monotonic(), m.entry_id, m.text))

    def _on_diag(self, arr):
        d = {}
        for st in arr.status:
            lvl = st.level[0] if isinstance(st.level, (bytes, bytearray)) else int(st.level)
            d[st.name] = (lvl, st.message, {kv.key: kv.value for kv in st.values})
        with self.lock:                     # merged by status name: other nodes (sim_node) publish here too
            self.diag.update(d)
            self.diag_t = time.monotonic()

    def ask(self, text: str) -> None:
        self.prompt_pub.publish(self._String(data=text))

    def window(self, t0: float, t1: float) -> tuple[list, list, dict]:
        """(chunks, tokens, first message of each new chunk by chunk id) received in [t0, t1] (monotonic)."""
        with self.lock:
            chunks = [c for c in self.chunks if t0 <= c[0] <= t1]
            tokens = [x for x in self.tokens if t0 <= x[0] <= t1]
        new_chunk: dict = {}
        for c in chunks:
            new_chunk.setdefault(c[3], c)
        return chunks, tokens, new_chunk

    def diag_value(self, key: str, default=None):
        with self.lock:
            for _, (_, _, vals) in self.diag.items():
                if key in vals:
                    try:
                        return float(vals[key])
                    except ValueError:
                        return vals[key]
        return default

    def chunk_rate(self, window: float = 1.0) -> float:
        t = time.monotonic()
        with self.lock:
            return sum(1 for c in self.chunks[-2000:] if c[0] >= t - window) / window

    def close(self):
        self._spin.close()


def stats_ms(xs) -> dict:
    a = np.asarray(list(xs), dtype=np.float64)
    if a.size == 0:
        return {"n": 0}
    return {"n": int(a.size), "mean": float(a.mean()), "p50": float(np.percentile(a, 50)),
            "p90": float(np.percentile(a, 90)), "p99": float(np.percentile(a, 99)), "max": float(a.max()),
            "min": float(a.min())}
