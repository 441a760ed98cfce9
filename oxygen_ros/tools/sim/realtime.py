"""Closed-loop episodes in real time over DDS, for ``oxygen sim-eval --clock realtime``: ``sim_node`` and
``oxygen_node`` as separate processes, the way a robot runs them.

This file owns the realtime runner.  Per grid cell, ``RealtimeCell`` starts ``oxygen_node`` (``config/sim_aloha.yaml``,
``use_sim_time``, the cell's engine mode / chunking / memory interval, the policy's checkpoint or preset) and
``sim_node`` (``clock: realtime`` at ``real_time_factor``, ``autostart: false``, one episode per ``~/reset``), and an
in-process rclpy node that watches everything: the episode status (start, end, success), ``executed_action`` (what
the robot did, for smoothness), ``joint_trajectory`` (chunks: their stamps and count), ``text_targets`` (the ground
truth per camera frame), ``action_chunk`` (a frame index -> capture time map, to score each answer against the frame
it read), ``conversation/result`` and ``memory/entries``; it asks the scene questions on ``conversation/prompt`` at the
cell's rate on sim time.  Here the policy's real compute time is the latency: sim time runs at ``real_time_factor`` x
the wall clock, so an engine mode that computes longer acts on older observations and less often.  Each episode comes
back as a ``sim.episode.EpisodeResult`` (+ language log), measured by ``tools/sim/report.py`` like a lockstep one.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np

from ..harness import BackgroundSpin

__all__ = ["RealtimeCell", "SimWatch"]


class SimWatch:
    """The in-process observer of the closed loop (callbacks on a background executor; all state under one lock).
    ``images=True`` also keeps the cameras' frames (stamp ns -> [base, left wrist, right wrist]) for videos."""

    def __init__(self, images: bool = False):
        import rclpy  # noqa: PLC0415
        from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy  # noqa: PLC0415
        from sensor_msgs.msg import JointState  # noqa: PLC0415
        from std_msgs.msg import String  # noqa: PLC0415
        from trajectory_msgs.msg import JointTrajectory  # noqa: PLC0415

        from oxygen_ros.msg import ActionChunk, ConversationResponse, EpisodeStatus, MemoryEntry, TextTarget  # noqa
        from oxygen_ros.srv import ResetEpisode  # noqa: PLC0415

        if not rclpy.ok():
            rclpy.init(args=[])                  # not sys.argv: the evaluator's own options are no ROS args
        self.rclpy = rclpy
        self.node = rclpy.create_node(f"oxygen_sim_eval_{id(self) % 100000}")
        self.lock = threading.Lock()
        self.horizon = 0
        self.clear()
        n = self.node
        rel = QoSProfile(depth=200, reliability=ReliabilityPolicy.RELIABLE)
        n.create_subscription(EpisodeStatus, "episode", self._on_status, rel)
        n.create_subscription(JointState, "executed_action", self._on_exec, QoSProfile(depth=500))
        n.create_subscription(JointTrajectory, "joint_trajectory", self._on_traj, rel)
        n.create_subscription(TextTarget, "text_targets", self._on_text, QoSProfile(depth=500))
        n.create_subscription(ActionChunk, "action_chunk", self._on_chunk, QoSProfile(depth=100))
        n.create_subscription(ConversationResponse, "conversation/result", self._on_answer, rel)
        n.create_subscription(MemoryEntry, "memory/entries", self._on_memory, rel)
        n.create_subscription(String, "instruction", lambda m: None,
                              QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE,
                                         durability=DurabilityPolicy.TRANSIENT_LOCAL))
        self.prompt = n.create_publisher(String, "conversation/prompt", 10)
        self.reset = n.create_client(ResetEpisode, "oxygen_sim/reset")
        if images:
            from sensor_msgs.msg import Image  # noqa: PLC0415
            for slot, topic in enumerate(("camera/base/image_raw", "camera/left_wrist/image_raw",
                                          "camera/right_wrist/image_raw")):
                n.create_subscription(Image, topic, lambda m, i=slot: self._on_image(i, m),
                                      QoSProfile(depth=50, reliability=ReliabilityPolicy.RELIABLE))
        self.String = String
        self._spin = BackgroundSpin(n)

    def clear(self) -> None:
        with self.lock:
            self.status: dict = {}                 # episode id -> [EpisodeStatus ...]
            self.exec: list = []                   # (sim ns, positions)
            self.traj: list = []                   # trajectory stamps (sim ns)
            self.texts: dict = {}                  # frame stamp ns -> (answers dict, memory text)
            self.frames: dict = {}                 # engine frame index -> capture ns
            self.chunk_first: dict = {}            # chunk id -> (capture ns, inference ms, age s) at its first message
            self.plan_ages: list = []              # (capture ns, age s) of every ActionChunk message (the node
                                                   # re-sends the running chunk each control step)
            self.answers: list = []
            self.memories: list = []
            self.images: dict = {}                 # camera stamp ns -> [3 x rgb or None]
            self.sim_ns = 0

    def _on_image(self, slot: int, m):
        rgb = np.frombuffer(bytes(m.data), np.uint8).reshape(int(m.height), int(m.width), 3)
        with self.lock:
            self.images.setdefault(self._ns(m.header.stamp), [None, None, None])[slot] = rgb

    @staticmethod
    def _ns(stamp) -> int:
        return int(stamp.sec) * 1_000_000_000 + int(stamp.nanosec)

    def _on_status(self, m):
        with self.lock:
            self.status.setdefault(int(m.episode_id), []).append(m)
            self.sim_ns = max(self.sim_ns, self._ns(m.header.stamp))

    def _on_exec(self, m):
        with self.lock:
            t = self._ns(m.header.stamp)
            self.exec.append((t, np.asarray(m.position, dtype=np.float64)))
            self.sim_ns = max(self.sim_ns, t)

    def _on_traj(self, m):
        with self.lock:
            self.traj.append(self._ns(m.header.stamp))
            self.horizon = max(self.horizon, len(m.points))      # a new chunk's first trajectory: all H rows

    def _on_text(self, m):
        with self.lock:
            t = self._ns(m.header.stamp)
            answers, memory = self.texts.setdefault(t, ({}, ""))
            if m.kind == "memory":
                self.texts[t] = (answers, m.text)
            else:
                answers[m.prompt] = m.text

    def _on_chunk(self, m):
        with self.lock:
            t = self._ns(m.header.stamp)
            self.frames.setdefault(int(m.frame_index), t)
            age = float(m.observation_age_s)
            self.chunk_first.setdefault(int(m.chunk_id), (t, float(m.inference_latency_ms), age))
            self.plan_ages.append((t, age))

    def _on_answer(self, m):
        with self.lock:
            self.answers.append(m)

    def _on_memory(self, m):
        with self.lock:
            self.memories.append(m)

    def close(self) -> None:
        self._spin.close()


class RealtimeCell:
    """Run one grid cell's episodes through sim_node + oxygen_node (``common`` / ``cell``: as in sim_eval.py;
    ``node_params``: the cell's node parameters, ``sim_eval.cell_node_params``)."""

    def __init__(self, common: dict, cell: dict, node_params: dict, log_dir: Path, rtf: float):
        self.c, self.cell, self.node_params = common, cell, dict(node_params)
        self.log_dir, self.rtf = Path(log_dir), float(rtf)

    def run(self, tasks: list[str], seeds, on_episode=None) -> list[dict]:
        from oxygen_ros.ros.lockstep import default_sim_params  # noqa: PLC0415
        from oxygen_ros.sim.tasks import QUESTIONS, draw_task  # noqa: PLC0415

        from ..harness import NodeProcess, isolate_dds  # noqa: PLC0415
        from oxygen_ros.ros.lockstep import LanguageLoad  # noqa: PLC0415

        c, cell = self.c, self.cell
        if c["policy"] == "expert":
            raise ValueError("the scripted expert needs the simulation's internals: it runs in lockstep only")
        q_every, m_every = LanguageLoad.parse_periods(cell["language"])
        isolate_dds()
        node_params = dict(self.node_params, use_sim_time=True, memory_interval_s=m_every, memory_db="")
        sim_params = {"clock": "realtime", "real_time_factor": self.rtf, "autostart": False, "episodes": 1,
                      "camera_size": c["camera_size"], "camera_rate_hz": 50.0 / c["camera_every"], "tail_s": 0.0}
        self.log_dir.mkdir(parents=True, exist_ok=True)
        name = cell["name"]
        policy = NodeProcess(self.log_dir / f"{name}.oxygen_node.log", node_params,
                             c["params"] or default_sim_params())
        sim = NodeProcess(self.log_dir / f"{name}.sim_node.log", sim_params, module="oxygen_ros.ros.sim_node")
        watch = None
        out = []
        try:
            watch = SimWatch()
            self._wait_ready(policy, sim, watch)
            for task in tasks:
                for seed in seeds:
                    out.append(self._episode(watch, sim, policy, task, int(seed), q_every, QUESTIONS, draw_task))
                    if on_episode:
                        on_episode()
        finally:
            if watch is not None:
                watch.close()
            for proc in (sim, policy):
                proc.stop()
        return out

    def _wait_ready(self, policy, sim, watch, timeout: float = 180.0) -> None:
        t0 = time.monotonic()
        while "active:" not in policy.log():
            if not policy.alive() or not sim.alive() or time.monotonic() - t0 > timeout:
                raise RuntimeError("oxygen_node / sim_node did not come up:\n" + policy.tail(8) + "\n" + sim.tail(8))
            time.sleep(0.2)
        if not watch.reset.wait_for_service(timeout_sec=30.0):
            raise RuntimeError("sim_node's ~/reset service did not appear:\n" + sim.tail(8))

    def _episode(self, watch, sim, policy, task, seed, q_every, questions, draw_task) -> dict:
        from oxygen_ros.sim.episode import EpisodeConfig, EpisodeResult, frame_key  # noqa: PLC0415
        from oxygen_ros.srv import ResetEpisode  # noqa: PLC0415

        from .report import episode_measures  # noqa: PLC0415

        spec = draw_task(task, seed)
        watch.clear()
        fut = watch.reset.call_async(ResetEpisode.Request(seed=seed, task=task))
        t0 = time.monotonic()
        while not fut.done():
            if time.monotonic() - t0 > 30:
                raise RuntimeError("~/reset did not answer")
            time.sleep(0.02)
        eid = int(fut.result().episode_id)
        wall_limit = spec.time_limit_s / self.rtf * 3 + 30
        next_q, qi, start_ns = None, 0, None
        while True:
            with watch.lock:
                sts = list(watch.status.get(eid, []))
                now = watch.sim_ns
            if sts and start_ns is None:
                start_ns = watch._ns(sts[0].header.stamp) - int(round(sts[0].elapsed * 1e9))
                next_q = start_ns if q_every > 0 else None
            if sts and sts[-1].done:
                break
            if next_q is not None and now >= next_q:
                watch.prompt.publish(watch.String(data=questions[qi % len(questions)]))
                qi += 1
                next_q += int(q_every * 1e9)
            if time.monotonic() - t0 > wall_limit or not (sim.alive() and policy.alive()):
                raise RuntimeError(f"episode {task} seed {seed} did not finish (sim {sim.alive()}, node "
                                   f"{policy.alive()})")
            time.sleep(0.01)
        time.sleep(0.3)                                  # late answers / memory entries of this episode
        last = sts[-1]
        end_ns = watch._ns(last.header.stamp)
        with watch.lock:
            ex = [(t, p) for t, p in watch.exec if start_ns <= t < end_ns]
            traj = [t for t in watch.traj if start_ns <= t <= end_ns]
            texts = dict(watch.texts)
            frames = dict(watch.frames)
            meta = [(lat, age) for t, lat, age in watch.chunk_first.values() if start_ns <= t <= end_ns]
            plan_ages = [age for t, age in watch.plan_ages if start_ns <= t <= end_ns]
            answers, memories = list(watch.answers), list(watch.memories)
        res = EpisodeResult(spec, EpisodeConfig())
        res.success = bool(last.success)
        res.success_time = float(last.elapsed) if last.success else None
        res.duration_s = float(last.elapsed)
        res.actions = [p for _, p in ex]
        steps = [int(round((t - start_ns) / 2e7)) for t, _ in ex]
        res.chunk_times = [((t - start_ns) / 1e9, (t - start_ns) / 1e9) for t in traj]
        res.switch_steps = sorted({max(0, int(np.ceil((t - start_ns) / 2e7 - 1e-9))) for t in traj[1:]})
        res.frames_gt = {frame_key((t - start_ns) / 1e9): v for t, v in texts.items() if t >= start_ns}
        log = []
        for m in answers:
            cap = frames.get(int(m.frame_index))
            if cap is not None and m.finish_reason in ("eos", "length"):
                log.append({"kind": "conversation", "prompt": m.prompt, "text": m.text, "finish_reason":
                            m.finish_reason, "frame_t": (cap - start_ns) / 1e9, "t": None})
        for m in memories:
            log.append({"kind": "memory", "prompt": m.source_prompt, "text": m.text, "finish_reason": "",
                        "frame_t": (watch._ns(m.header.stamp) - start_ns) / 1e9, "t": None})
        out = episode_measures(res, [e for e in log if e["frame_t"] is not None and e["frame_t"] >= 0],
                               watch.horizon)
        out["steps_recorded"] = len(steps)
        # what each chunk cost before it was first published: the engine's compute (frame -> chunk, wall ms) and the
        # age of the observation it was planned from (s of the node's clock, here sim time); and how old the plan
        # being executed was, over every re-sent message (a slower cycle runs each plan longer)
        out["chunk_latency_ms"] = [round(lat, 2) for lat, _ in meta]
        out["chunk_obs_age_s"] = [round(age, 4) for _, age in meta]
        out["plan_age_s"] = [round(age, 4) for age in plan_ages]
        out["real_time_factor"] = self.rtf
        return out
