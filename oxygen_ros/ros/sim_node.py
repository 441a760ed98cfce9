"""``sim_node`` (``oxygen sim``, ``ros2 run oxygen_ros sim_node``): the simulated ALOHA robot as a ROS 2 node.

This file owns the ROS shell around the simulation core (``oxygen_ros/sim``): it publishes what a real robot's
drivers would - the three cameras (``camera/base|left_wrist|right_wrist/image_raw``, ``sensor_msgs/Image`` rgb8, at
``camera_rate_hz`` and ``camera_size``), ``joint_states`` (the 14 joints of ``config/sim_aloha.yaml``) and
``executed_action`` (the command executed in each control step) at 50 Hz, ``instruction``, ``/clock`` (sim time: run
``oxygen_node`` with ``use_sim_time``), ``episode`` (``oxygen_ros/EpisodeStatus``), ``text_targets`` (the ground truth
of the scene questions and the memory description at every camera frame) and ``/diagnostics`` - and executes what a
policy sends: ``joint_trajectory`` (``execute: joint_trajectory``, default) or ``action_chunk``, with the execution
rule of ``sim/execution.py`` (ros2_control's joint_trajectory_controller: the newest trajectory from its stamp on,
linear interpolation); bad ones (unknown joints, NaN, wrong lengths) are rejected, counted and logged, and the robot
holds.  ``~/reset`` (``oxygen_ros/srv/ResetEpisode``) ends the running episode (not successful, detail "reset") and
starts another; episodes also follow each other (``seed``, ``seed + 1``, ...; ``episodes`` 0 = forever).

Clock modes (``clock``):
* ``realtime``: the physics follow the wall clock times ``real_time_factor`` (<= 1; state it with every result),
  so the policy's real compute time becomes sim-time latency.
* ``lockstep``: deterministic; sim time stops at the first control step where the policy is free (its previous
  trajectory's ``delay_steps`` have passed) and a camera frame it has not seen exists - the newest, published then
  with its capture stamp - until the policy's next trajectory arrives (or ``lockstep_timeout_s`` of wall time
  passes), which then takes effect ``delay_steps`` control steps after its stamp - the same semantics as the
  in-process lockstep evaluator (``sim/episode.py``).
The simulation runs in its own thread (it also owns the renderer's EGL context); callbacks only queue work under a
lock.  SIGINT / SIGTERM (any number) stop it cleanly with exit status 0.
"""
from __future__ import annotations

import sys
import threading
import time
from collections import Counter
from dataclasses import replace

import rclpy
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue
from rclpy.executors import ExternalShutdownException, MultiThreadedExecutor
from rclpy.node import Node
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy
from rclpy.signals import SignalHandlerOptions
from rcl_interfaces.msg import ParameterDescriptor
from rosgraph_msgs.msg import Clock
from sensor_msgs.msg import Image, JointState
from std_msgs.msg import String
from trajectory_msgs.msg import JointTrajectory

from oxygen_ros.msg import ActionChunk, EpisodeStatus, TextTarget
from oxygen_ros.srv import ResetEpisode

from .messages import time_msg
from .node import _ShutdownRequest, _hard_exit
from .parameters import refuse_stray_args, ros_args
from .sim_io import camera_msg, episode_status_msg, joint_state_msg, stamp_s, text_target_msg, trajectory_from_msg

__all__ = ["SimNode", "main", "PARAMS"]

EPOCH_NS = 1_000_000_000_000
SLOT_TOPICS = ("camera/base/image_raw", "camera/left_wrist/image_raw", "camera/right_wrist/image_raw")

# name: (default, description)
PARAMS = {
    "task": ("reach", "Task of the episodes: reach | pick | transfer."),
    "seed": (0, "Seed of the first episode (the next ones count up)."),
    "episodes": (0, "Episodes to run, then hold until ~/reset; 0 = forever."),
    "autostart": (True, "Start the first episode at once; false = hold until ~/reset (an evaluator starts them)."),
    "clock": ("realtime", "realtime (physics follow the wall clock x real_time_factor) | lockstep (sim time waits "
                          "for the policy at each camera frame; deterministic)."),
    "real_time_factor": (0.5, "realtime: sim seconds per wall second (<= 1)."),
    "delay_steps": (0, "lockstep: control steps between an observation and its trajectory taking effect."),
    "lockstep_timeout_s": (30.0, "lockstep: wall seconds to wait for the policy before moving on without it."),
    "camera_rate_hz": (10.0, "Camera frames per sim second (divides 50 Hz)."),
    "camera_size": (96, "Square camera images, pixels."),
    "execute": ("joint_trajectory", "What to execute: joint_trajectory | action_chunk."),
    "stale_limit_s": (0.5, "Holding longer than this without policy output = stale (reported in the status)."),
    "tail_s": (0.5, "Sim seconds an episode continues after success before the next starts."),
    "status_rate_hz": (2.0, "EpisodeStatus messages per sim second while an episode runs."),
    "text_targets": (True, "Publish the ground-truth texts (scene answers, memory) at every camera frame."),
}


class SimNode(Node):
    def __init__(self, **node_kwargs):
        """``node_kwargs`` go to ``rclpy.node.Node`` (tests: ``context``, ``parameter_overrides``)."""
        super().__init__("oxygen_sim", **node_kwargs)
        for name, (default, desc) in PARAMS.items():
            self.declare_parameter(name, default, ParameterDescriptor(description=desc))
        p = {n: self.get_parameter(n).value for n in PARAMS}
        from oxygen_ros.sim.scene import CONTROL_DT, JOINTS  # noqa: PLC0415
        from oxygen_ros.sim.tasks import TASKS  # noqa: PLC0415

        bad = []
        if p["task"] not in TASKS:
            bad.append(f"task {p['task']!r} (known: {list(TASKS)})")
        if p["clock"] not in ("realtime", "lockstep"):
            bad.append(f"clock {p['clock']!r} (realtime | lockstep)")
        if p["execute"] not in ("joint_trajectory", "action_chunk"):
            bad.append(f"execute {p['execute']!r} (joint_trajectory | action_chunk)")
        if not 0 < float(p["real_time_factor"]) <= 1:
            bad.append(f"real_time_factor {p['real_time_factor']} (0 < rtf <= 1)")
        every = 1.0 / CONTROL_DT / float(p["camera_rate_hz"]) if float(p["camera_rate_hz"]) > 0 else 0.5
        if abs(every - round(every)) > 1e-6 or every < 1:
            bad.append(f"camera_rate_hz {p['camera_rate_hz']} (must divide 50 Hz)")
        if int(p["camera_size"]) < 8 or int(p["delay_steps"]) < 0 or int(p["episodes"]) < 0:
            bad.append("camera_size >= 8, delay_steps >= 0, episodes >= 0")
        if not p["autostart"] and int(p["episodes"]) < 1:
            bad.append("autostart false needs episodes >= 1 (episodes per ~/reset)")
        if bad:
            raise ValueError("bad parameter(s): " + "; ".join(bad))
        self.p = p
        self.joints = JOINTS
        self.dt = CONTROL_DT
        self.camera_every = int(round(every))
        reliable = QoSProfile(depth=5, reliability=ReliabilityPolicy.RELIABLE)
        latched = QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE,
                             durability=DurabilityPolicy.TRANSIENT_LOCAL)
        self.pub_cams = [self.create_publisher(Image, t, reliable) for t in SLOT_TOPICS]
        self.pub_joints = self.create_publisher(JointState, "joint_states", 10)
        self.pub_exec = self.create_publisher(JointState, "executed_action", 50)
        self.pub_instr = self.create_publisher(String, "instruction", latched)
        self.pub_clock = self.create_publisher(Clock, "/clock", 10)
        self.pub_status = self.create_publisher(EpisodeStatus, "episode", 10)
        self.pub_text = self.create_publisher(TextTarget, "text_targets", 50)
        self.pub_diag = self.create_publisher(DiagnosticArray, "/diagnostics", 10)
        if p["execute"] == "joint_trajectory":
            self.create_subscription(JointTrajectory, "joint_trajectory", self._on_trajectory, 10)
        else:
            self.create_subscription(ActionChunk, "action_chunk", self._on_chunk, 10)
        self.create_service(ResetEpisode, "~/reset", self._on_reset)
        self.lock = threading.Lock()
        self.arrived = threading.Event()             # lockstep: a trajectory arrived
        self.pending: list = []                      # trajectories waiting for the sim thread
        self.reset_req: tuple | None = None
        self.rejected: Counter = Counter()
        self.received = 0
        self.episode_id = 0
        self.stop = threading.Event()
        self.stats = {"episodes": 0, "successes": 0, "rtf": 0.0, "stale": False, "policy_timeouts": 0}
        self._last_reject_log: dict = {}
        self.thread = threading.Thread(target=self._run_safe, name="oxygen-sim", daemon=True)

    # ---- callbacks (executor threads): only queue ---------------------------------------------------------------
    def _queue(self, tr) -> None:
        with self.lock:
            self.pending.append(tr)
            self.received += 1
        self.arrived.set()

    def _on_trajectory(self, msg: JointTrajectory) -> None:
        self._queue(trajectory_from_msg(msg))

    def _on_chunk(self, msg: ActionChunk) -> None:
        """An ActionChunk as a trajectory: row i at start_time + i * step_dt (the same rule)."""
        import numpy as np  # noqa: PLC0415

        from oxygen_ros.sim.execution import Trajectory  # noqa: PLC0415

        n, a = int(msg.horizon), int(msg.action_dim)
        vals = np.asarray(msg.actions, dtype=np.float64)
        pos = vals.reshape(n, a) if n * a == vals.size and n > 0 else np.array([list(vals)], dtype=object)
        self._queue(Trajectory(stamp_s(msg.start_time), tuple(msg.joint_names), np.arange(n) * float(msg.step_dt),
                               pos))

    def _on_reset(self, req, resp):
        from oxygen_ros.sim.tasks import TASKS  # noqa: PLC0415

        task = req.task or self.p["task"]
        if task not in TASKS:
            resp.success, resp.message = False, f"unknown task {task!r}; known: {list(TASKS)}"
            return resp
        with self.lock:
            self.reset_req = (task, int(req.seed))
            resp.episode_id = self.episode_id + 1
        self.arrived.set()
        resp.success, resp.message = True, f"episode {resp.episode_id}: {task} seed {req.seed}"
        return resp

    # ---- the simulation thread -----------------------------------------------------------------------------------
    def _run_safe(self) -> None:
        try:
            self._run()
        except Exception as exc:  # noqa: BLE001 - report, then stop the process cleanly
            import traceback  # noqa: PLC0415
            self.get_logger().fatal(f"simulation failed: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
            self.stop.set()

    def _pub_clock(self, ns: int) -> None:
        self.pub_clock.publish(Clock(clock=time_msg(ns)))

    def _run(self) -> None:
        from oxygen_ros.sim.execution import TrajectoryExecutor, TrajectoryRejected  # noqa: PLC0415
        from oxygen_ros.sim.scene import AlohaScene  # noqa: PLC0415
        from oxygen_ros.sim.tasks import (MEMORY_PROMPT, TaskMonitor, draw_task, memory_text,  # noqa: PLC0415
                                          scene_answers, scene_facts)

        p, log = self.p, self.get_logger()
        sim = AlohaScene((int(p["camera_size"]),) * 2)
        lockstep = p["clock"] == "lockstep"
        rtf = float(p["real_time_factor"])
        d = int(p["delay_steps"])
        status_every = max(1, int(round(1.0 / self.dt / float(p["status_rate_hz"])))) if p["status_rate_hz"] > 0 \
            else 10 ** 9
        now_ns = EPOCH_NS
        self._pub_clock(now_ns)
        task, seed = p["task"], int(p["seed"])
        count = 0 if p["autostart"] else int(p["episodes"])          # not autostarting = waiting for ~/reset
        wall0, sim0 = time.monotonic(), 0.0
        while not self.stop.is_set():
            if p["episodes"] and count >= p["episodes"]:
                self._pub_clock(now_ns)
                self.stop.wait(0.1)
                with self.lock:
                    req, self.reset_req = self.reset_req, None
                if req is None:
                    continue
                task, seed = req
                count = 0
            spec = draw_task(task, seed)
            sim.reset(spec.scene)
            monitor = TaskMonitor(sim, spec)
            executor = TrajectoryExecutor(self.joints, sim.state())
            with self.lock:
                self.pending.clear()
                self.episode_id += 1
                eid = self.episode_id
            start_ns = now_ns
            self.pub_instr.publish(String(data=spec.instruction))
            status = dict(episode_id=eid, seed=seed, task=task, instruction=spec.instruction)
            self.pub_status.publish(episode_status_msg(now_ns, elapsed=0.0, done=False, success=False,
                                                       detail="running", **status))
            log.info(f"episode {eid}: {task} seed {seed}: {spec.instruction!r}")
            busy_until, detail, step, frame = -1.0, "timeout", 0, None
            n_steps = int(round(spec.time_limit_s / self.dt))
            while step < n_steps and not self.stop.is_set():
                with self.lock:
                    req, self.reset_req = self.reset_req, None
                if req is not None:
                    detail = "reset"
                    break
                t = step * self.dt
                state = sim.state()
                self._pub_clock(now_ns)
                self.pub_joints.publish(joint_state_msg(self.joints, state, now_ns))
                if step % self.camera_every == 0:
                    frame = (now_ns, sim.render())       # the newest frame; published once the policy is free
                # lockstep: a policy still "computing" (t < busy_until) gets the newest frame when it is free, with
                # its capture stamp (as the node's inference thread takes the newest frame when a cycle ends)
                ask = frame is not None and (not lockstep or t >= busy_until - 1e-9)
                if ask:
                    self.arrived.clear()
                    with self.lock:
                        n_before = self.received
                    cap_ns, images = frame
                    frame = None
                    for pub, cam, img in zip(self.pub_cams, sim.cameras, images):
                        pub.publish(camera_msg(img, cap_ns, cam))
                if step % self.camera_every == 0 and p["text_targets"]:
                    facts = scene_facts(sim)
                    for q, a in scene_answers(sim, facts).items():
                        self.pub_text.publish(text_target_msg(now_ns, "conversation", q, a))
                    self.pub_text.publish(text_target_msg(now_ns, "memory", MEMORY_PROMPT, memory_text(sim, facts)))
                if ask and lockstep:
                    got = self._wait_policy(n_before, float(p["lockstep_timeout_s"]))
                    busy_until = t + d * self.dt if got else t
                with self.lock:
                    queued, self.pending = self.pending, []
                for tr in queued:
                    # stamps are absolute sim time; in lockstep the policy's trajectory takes effect d steps later
                    tr = replace(tr, start=tr.start - start_ns / 1e9 + (d * self.dt if lockstep else 0.0))
                    try:
                        executor.submit(tr)
                    except TrajectoryRejected as exc:
                        self._rejected(exc)
                cmd = executor.command(t)
                stale = executor.idle_for(t) > float(p["stale_limit_s"])
                self.stats["stale"] = stale
                self.pub_exec.publish(joint_state_msg(self.joints, cmd, now_ns))
                sim.step(cmd)
                step += 1
                now_ns += int(round(self.dt * 1e9))
                if sim.unstable:
                    detail = "physics unstable"
                    log.warning(f"episode {eid}: the physics diverged under the commands (MuJoCo reset the "
                                "state); episode ended as failed")
                    break
                monitor.update()
                if step % status_every == 0:
                    self.pub_status.publish(episode_status_msg(
                        now_ns, elapsed=step * self.dt, done=False, success=monitor.success,
                        detail="stale: holding (no policy output)" if stale else "running", **status))
                if monitor.success and step * self.dt >= monitor.success_time + float(p["tail_s"]) - 1e-9:
                    detail = "success"
                    break
                if not lockstep:                         # pace: sim time = wall time x rtf
                    sim_t = (now_ns - EPOCH_NS) / 1e9
                    ahead = (sim_t - sim0) / rtf - (time.monotonic() - wall0)
                    if ahead > 0:
                        self.stop.wait(ahead)
                    elif ahead < -1.0:                   # fell behind (rendering, a loaded CPU): don't catch up
                        wall0, sim0 = time.monotonic(), sim_t
                    el = time.monotonic() - wall0
                    self.stats["rtf"] = (sim_t - sim0) / el if el > 0 else rtf
            self.pub_status.publish(episode_status_msg(now_ns, elapsed=step * self.dt, done=True,
                                                       success=monitor.success and detail != "reset",
                                                       detail=detail if not monitor.success or detail == "reset"
                                                       else "success", **status))
            self.stats["episodes"] += 1
            self.stats["successes"] += int(monitor.success and detail != "reset")
            log.info(f"episode {eid} ended: {detail}" + (f" (success at {monitor.success_time:.2f} s)"
                                                         if monitor.success else ""))
            if detail == "reset":
                task, seed = req
                count = 0
            else:
                seed += 1
                count += 1
            now_ns += 1_000_000_000                       # 1 s between episodes (as in episode bags)
        sim.close()

    def _wait_policy(self, n_before: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self.stop.is_set():
            with self.lock:
                if self.received > n_before or self.reset_req is not None:
                    return self.received > n_before
            left = deadline - time.monotonic()
            if left <= 0:
                self.stats["policy_timeouts"] += 1
                return False
            self.arrived.wait(min(left, 0.1))
            self.arrived.clear()
        return False

    def _rejected(self, exc) -> None:
        self.rejected[exc.reason] += 1
        now = time.monotonic()
        if now - self._last_reject_log.get(exc.reason, -1e9) > 5.0:
            self._last_reject_log[exc.reason] = now
            self.get_logger().warning(f"trajectory rejected ({exc.reason}, {self.rejected[exc.reason]} so far): "
                                      f"{exc}; the robot holds")

    def publish_diagnostics(self) -> None:
        s = self.stats
        st = DiagnosticStatus(name="oxygen_sim: simulation", hardware_id="mujoco",
                              level=DiagnosticStatus.WARN if (self.rejected or s["stale"]) else DiagnosticStatus.OK)
        st.message = (f"episode {self.episode_id}, {s['successes']}/{s['episodes']} successful"
                      + (", STALE: holding" if s["stale"] else "")
                      + (f", {sum(self.rejected.values())} trajectories rejected" if self.rejected else ""))
        kv = {"episode_id": self.episode_id, "episodes_done": s["episodes"], "successes": s["successes"],
              "clock": self.p["clock"], "real_time_factor_target": self.p["real_time_factor"],
              "real_time_factor": round(s["rtf"], 3), "trajectories_received": self.received,
              "trajectories_rejected": sum(self.rejected.values()), "policy_timeouts": s["policy_timeouts"],
              "stale": s["stale"]}
        kv.update({f"rejected.{k}": v for k, v in self.rejected.items()})
        st.values = [KeyValue(key=k, value=str(v)) for k, v in kv.items()]
        arr = DiagnosticArray()
        arr.header.stamp = self.get_clock().now().to_msg()
        arr.status = [st]
        self.pub_diag.publish(arr)


def main(argv=None) -> int:
    args = list(sys.argv if argv is None else ["sim_node", *argv])
    if refuse_stray_args("sim_node", args):
        return 2
    if any(a in ("-h", "--help") for a in args[1:]) and "--ros-args" not in args:
        print(__doc__.strip())
        print("\nparameters (-p name:=value after --ros-args):")
        for name, (default, desc) in PARAMS.items():
            print(f"  {name:20s} {default!r:18} {desc}")
        return 0
    shutdown = _ShutdownRequest()
    shutdown.install()
    try:
        rclpy.init(args=ros_args(args), signal_handler_options=SignalHandlerOptions.NO)
        node = SimNode()
    except Exception as exc:  # noqa: BLE001 - bad parameters: a clear line and status 2
        print(f"sim_node: cannot start: {type(exc).__name__}: {exc}", file=sys.stderr)
        rclpy.try_shutdown()
        return 2
    node.create_timer(1.0, node.publish_diagnostics)
    executor = MultiThreadedExecutor(num_threads=2)
    executor.add_node(node)
    node.thread.start()
    try:
        while not shutdown.requested and not node.stop.is_set() and rclpy.ok():
            executor.spin_once(timeout_sec=0.1)
    except ExternalShutdownException:
        pass
    failed = node.stop.is_set() and not shutdown.requested
    node.stop.set()
    node.arrived.set()
    node.thread.join(5.0)
    executor.shutdown(timeout_sec=1.0)
    node.destroy_node()
    rclpy.try_shutdown()
    _hard_exit(1 if failed else 0)
    return 0



if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
