"""``oxygen sim-record``: episodes in the simulation, labelled by the scripted expert -> one rosbag2 (MCAP) of
episodes, the format ``oxygen train`` reads (README "Closed-loop simulation" / "Training": the episode bag).

This file owns the recording: ``record`` plays N episodes per task over a seed range in lockstep, driven by
``--policy``: the scripted expert (optionally with ``--noise``: a smooth perturbation of what it executes, DART-style)
or a trained policy (DAgger: the policy's own states), either one's chunks travelling the node's own action path
(``ros/lockstep.py`` ``PipelinePolicy``: pipeline, chunk buffer, trajectory, executor) with the modelled delay.
It writes, per episode, on sim time (log time = header stamp): the three cameras at the camera rate and the model's
resolution (``sensor_msgs/Image`` rgb8, rendered only then), ``joint_states`` and ``executed_action``
(``sensor_msgs/JointState``: the command the robot executed during each control step) at 50 Hz, ``action_label``
(``trajectory_msgs/JointTrajectory``, one per frame, stamped with it: the chunk the state-driven expert commands from
that frame's state - what training learns; ``train/data.py`` falls back to the executed actions for bags without
it, e.g. a robot's), ``instruction`` at the start, ``episode`` (``oxygen_ros/EpisodeStatus``: start, every second,
end with success) and ``text_targets`` (``oxygen_ros/TextTarget``: the scene questions' ground-truth answers and the
memory description at every ``--text-every``-th frame, plus "where is the <colour> cube?" with its cell in the top
image, ``sim/tasks.py`` ``cube_locations``: training-only grounding targets).  Episodes follow each other on one clock with a 1 s gap.
Episodes the driving policy fails are left out unless ``--keep-failed`` (default for a trained policy: its failures
are what DAgger learns from).  Messages are built as rosbags types and
serialised with rosbags (no rclpy; byte-identical for the same arguments).  The bag is written under
``OUT.partial/`` and moved to ``OUT`` only when complete, with ``episodes.json`` (per episode: task, seed,
success, time range) beside ``metadata.yaml``; a crash leaves only the ``.partial`` folder.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np

__all__ = ["record", "main", "parse_seeds", "TOPICS", "TYPES", "EpisodeBagWriter"]

TOPICS = {"base": "/camera/base/image_raw", "left_wrist": "/camera/left_wrist/image_raw",
          "right_wrist": "/camera/right_wrist/image_raw", "joint_states": "/joint_states",
          "instruction": "/instruction", "executed_action": "/executed_action", "episode": "/episode",
          "text_targets": "/text_targets", "action_label": "/action_label"}
TYPES = {"base": "sensor_msgs/msg/Image", "left_wrist": "sensor_msgs/msg/Image", "right_wrist": "sensor_msgs/msg/Image",
         "joint_states": "sensor_msgs/msg/JointState", "instruction": "std_msgs/msg/String",
         "executed_action": "sensor_msgs/msg/JointState", "episode": "oxygen_ros/msg/EpisodeStatus",
         "text_targets": "oxygen_ros/msg/TextTarget", "action_label": "trajectory_msgs/msg/JointTrajectory"}
SLOTS = ("base", "left_wrist", "right_wrist")        # = sim cameras top, left_wrist, right_wrist
EPOCH_NS = 1_000_000_000_000
GAP_NS = 1_000_000_000


def parse_seeds(text: str) -> range:
    """"A:B" -> range(A, B); "N" -> range(N, N + 1)."""
    try:
        if ":" in text:
            a, b = text.split(":", 1)
            r = range(int(a), int(b))
        else:
            r = range(int(text), int(text) + 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"seeds must be A:B or N, got {text!r}") from None
    if len(r) == 0:
        raise argparse.ArgumentTypeError(f"empty seed range {text!r}")
    return r


class EpisodeBagWriter:
    """rosbags Writer + typestore message builders for the episode bag's topics."""

    def __init__(self, path: Path):
        from rosbags.rosbag2 import StoragePlugin, Writer  # noqa: PLC0415

        from oxygen_ros.bags.types import typestore  # noqa: PLC0415

        self.ts = ts = typestore()
        names = {"Image": "sensor_msgs/msg/Image", "JointState": "sensor_msgs/msg/JointState",
                 "String": "std_msgs/msg/String", "Header": "std_msgs/msg/Header",
                 "Time": "builtin_interfaces/msg/Time",
                 "EpisodeStatus": "oxygen_ros/msg/EpisodeStatus", "TextTarget": "oxygen_ros/msg/TextTarget",
                 "JointTrajectory": "trajectory_msgs/msg/JointTrajectory",
                 "JointTrajectoryPoint": "trajectory_msgs/msg/JointTrajectoryPoint",
                 "Duration": "builtin_interfaces/msg/Duration"}
        self.T = {k: ts.types[v] for k, v in names.items()}
        self.writer = Writer(path, version=9, storage_plugin=StoragePlugin.MCAP)
        self.writer.open()
        self.conns = {k: self.writer.add_connection(TOPICS[k], TYPES[k], typestore=ts) for k in TOPICS}
        self.counts = {k: 0 for k in TOPICS}

    def header(self, ns: int, frame_id: str = ""):
        return self.T["Header"](stamp=self.T["Time"](sec=ns // 1_000_000_000, nanosec=ns % 1_000_000_000),
                                frame_id=frame_id)

    def write(self, key: str, ns: int, msg) -> None:
        self.writer.write(self.conns[key], int(ns), self.ts.serialize_cdr(msg, TYPES[key]))
        self.counts[key] += 1

    def image(self, key: str, ns: int, rgb: np.ndarray) -> None:
        h, w, _ = rgb.shape
        self.write(key, ns, self.T["Image"](header=self.header(ns, f"camera_{key}"), height=h, width=w,
                                            encoding="rgb8", is_bigendian=0, step=w * 3,
                                            data=np.ascontiguousarray(rgb).reshape(-1)))

    def joints(self, key: str, ns: int, names, values) -> None:
        self.write(key, ns, self.T["JointState"](header=self.header(ns), name=list(names),
                                                 position=np.asarray(values, dtype=np.float64),
                                                 velocity=np.zeros(0), effort=np.zeros(0)))

    def trajectory(self, key: str, ns: int, names, rows: np.ndarray, dt: float) -> None:
        """Rows [n, len(names)] as a JointTrajectory stamped ``ns``, point i at i * dt."""
        T = self.T
        pts = []
        for i, r in enumerate(np.asarray(rows, dtype=np.float64)):
            d = int(round(i * dt * 1e9))
            pts.append(T["JointTrajectoryPoint"](positions=r, velocities=np.zeros(0), accelerations=np.zeros(0),
                                                 effort=np.zeros(0), time_from_start=T["Duration"](
                                                     sec=d // 1_000_000_000, nanosec=d % 1_000_000_000)))
        self.write(key, ns, T["JointTrajectory"](header=self.header(ns), joint_names=list(names), points=pts))

    def string(self, key: str, ns: int, text: str) -> None:
        self.write(key, ns, self.T["String"](data=text))

    def status(self, ns: int, **kw) -> None:
        self.write("episode", ns, self.T["EpisodeStatus"](header=self.header(ns), **kw))

    def text(self, ns: int, kind: str, prompt: str, text: str) -> None:
        self.write("text_targets", ns, self.T["TextTarget"](header=self.header(ns), kind=kind, prompt=prompt,
                                                            text=text))

    def close(self) -> None:
        self.writer.close()


def _parser() -> argparse.ArgumentParser:
    from oxygen_ros.sim.tasks import TASKS  # noqa: PLC0415

    ap = argparse.ArgumentParser(prog="oxygen sim-record", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="output bag directory (written as OUT.partial, renamed when done)")
    ap.add_argument("--policy", default="expert", help="what drives the robot: expert (the scripted expert) | demo (the "
                                                       "shipped policy) | a checkpoint directory (DAgger: the policy's "
                                                       "own states, every frame labelled by the expert)")
    ap.add_argument("--task", default=",".join(TASKS), help=f"comma-separated tasks ({', '.join(TASKS)})")
    ap.add_argument("--seeds", type=parse_seeds, default=parse_seeds("100000:100010"),
                    help="seed range A:B per task (default 100000:100010; evaluation uses 0:100000 - keep them apart)")
    ap.add_argument("--camera-size", type=int, default=96, help="square camera images, pixels (the model's input)")
    ap.add_argument("--camera-rate", type=float, default=10.0, help="camera frames per second (divides 50 Hz)")
    ap.add_argument("--delay-steps", type=int, default=0, help="modelled inference delay, control steps")
    ap.add_argument("--horizon", type=int, default=20, help="expert chunk rows H")
    ap.add_argument("--noise", type=float, default=0.0,
                    help="expert only: amplitude (rad) of a smooth seeded perturbation of the executed arm joints "
                         "(DART-style: the robot strays, the labels stay the expert's); 0 = none")
    ap.add_argument("--text-every", type=int, default=1, help="text targets at every n-th frame")
    ap.add_argument("--tail", type=float, default=0.5, help="seconds recorded after success")
    ap.add_argument("--keep-failed", action="store_true",
                    help="also record episodes that failed (always, when --policy is a trained policy)")
    ap.add_argument("--params", default=None, help="node parameter file (default config/sim_aloha.yaml)")
    ap.add_argument("--overwrite", action="store_true")
    ap.add_argument("--quiet", action="store_true")
    return ap


def record(o) -> dict:
    from oxygen_ros.ros.lockstep import PipelinePolicy, sim_settings  # noqa: PLC0415
    from oxygen_ros.sim.episode import EpisodeConfig, run_episode  # noqa: PLC0415
    from oxygen_ros.sim.expert import Expert  # noqa: PLC0415
    from oxygen_ros.sim.scene import CONTROL_DT, JOINTS, AlohaScene  # noqa: PLC0415
    from oxygen_ros.sim.tasks import MEMORY_PROMPT, QUESTIONS, TASKS, cube_locations, draw_task  # noqa: PLC0415

    tasks = [t.strip() for t in o.task.split(",") if t.strip()]
    bad = [t for t in tasks if t not in TASKS]
    if bad or not tasks:
        raise ValueError(f"unknown task(s) {bad}; known: {list(TASKS)}")
    every = 1.0 / CONTROL_DT / o.camera_rate
    if o.camera_rate <= 0 or abs(every - round(every)) > 1e-6:
        raise ValueError(f"--camera-rate must divide the control rate {1 / CONTROL_DT:g} Hz, got {o.camera_rate:g}")
    if o.camera_size < 8 or o.text_every < 1 or o.horizon < 1 or o.delay_steps < 0:
        raise ValueError("--camera-size >= 8, --text-every >= 1, --horizon >= 1, --delay-steps >= 0")
    out = Path(o.out)
    part = out.with_name(out.name + ".partial")
    if out.exists() or part.exists():
        if not o.overwrite:
            raise FileExistsError(f"{out if out.exists() else part} exists (use --overwrite)")
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(part, ignore_errors=True)
    expert = o.policy == "expert"
    if not expert:
        from oxygen_ros.ros.engine_factory import SHIPPED, resolve_checkpoint  # noqa: PLC0415
        o.policy = resolve_checkpoint(o.policy) if o.policy in SHIPPED else o.policy
        if not Path(o.policy).is_dir():
            raise ValueError(f"--policy must be expert, demo or a checkpoint directory; {o.policy!r} is none of them")
        if o.noise:
            raise ValueError("--noise perturbs the scripted expert's commands; a trained policy makes its own errors")
    keep_failed = o.keep_failed or not expert
    # the expert commands absolute targets; a trained policy runs with the node's sim parameters (its action space)
    settings = sim_settings(o.params, {"delta_action_mask": []} if expert else {"checkpoint": o.policy})
    sim = AlohaScene((o.camera_size, o.camera_size))
    policy = PipelinePolicy(settings, expert=expert, expert_noise=o.noise, horizon=o.horizon)
    config = EpisodeConfig(delay_steps=o.delay_steps, camera_every=int(round(every)), stop_on_success=True,
                           tail_s=o.tail)
    part.mkdir(parents=True)
    bag = EpisodeBagWriter(part / out.name)                 # the storage file is named after the bag directory
    episodes, t_ns, eid = [], EPOCH_NS, 0
    total = len(tasks) * len(o.seeds)
    wall0 = time.perf_counter()
    try:
        for task in tasks:
            for seed in o.seeds:
                spec = draw_task(task, seed)
                buf: list = []                                     # (ns, writer method, args) of this episode
                n_frames = [0]
                labeller = Expert(sim, spec)                       # the label of every frame: the clean expert chunk

                def on_frame(frame, gt, buf=buf, n_frames=n_frames, base=t_ns, labeller=labeller):
                    ns = base + int(round(frame.t * 1e9))
                    for slot, img in zip(SLOTS, frame.images):
                        buf.append((ns, "image", (slot, ns, img)))
                    buf.append((ns, "trajectory", ("action_label", ns, JOINTS, labeller.chunk(o.horizon),
                                                   CONTROL_DT)))
                    if n_frames[0] % o.text_every == 0:
                        answers, memory = gt
                        for q in QUESTIONS:
                            buf.append((ns, "text", (ns, "conversation", q, answers[q])))
                        for q, a in cube_locations(sim).items():       # training-only grounding targets
                            buf.append((ns, "text", (ns, "conversation", q, a)))
                        buf.append((ns, "text", (ns, "memory", MEMORY_PROMPT, memory)))
                    n_frames[0] += 1

                def on_step(t, state, cmd, monitor, buf=buf, base=t_ns):
                    ns = base + int(round(t * 1e9))
                    buf.append((ns, "joints", ("joint_states", ns, JOINTS, state)))
                    buf.append((ns, "joints", ("executed_action", ns, JOINTS, cmd)))
                    if int(round(t / CONTROL_DT)) % 50 == 0:
                        buf.append((ns, "status", dict(ns=ns, episode_id=eid + 1, seed=seed, task=task,
                                                       instruction=spec.instruction, elapsed=t, done=False,
                                                       success=monitor.success, detail="running")))

                res = run_episode(sim, spec, policy, config, on_frame=on_frame, on_step=on_step)
                if not (res.success or keep_failed):
                    if not o.quiet:
                        print(f"  {task} seed {seed}: expert FAILED, not recorded", file=sys.stderr)
                    continue
                eid += 1
                start = t_ns
                bag.string("instruction", start, spec.instruction)
                for ns, kind, args in buf:
                    if kind == "status":
                        args = dict(args)
                        args["episode_id"] = eid
                        bag.status(**args)
                    else:
                        getattr(bag, kind)(*args)
                end_ns = start + int(round(res.duration_s * 1e9))
                bag.status(end_ns, episode_id=eid, seed=seed, task=task, instruction=spec.instruction,
                           elapsed=res.duration_s, done=True, success=res.success,
                           detail="success" if res.success else "timeout")
                episodes.append({"episode_id": eid, "task": task, "seed": seed, "instruction": spec.instruction,
                                 "success": res.success, "success_time": res.success_time,
                                 "start_ns": start, "end_ns": end_ns, "frames": n_frames[0]})
                t_ns = end_ns + GAP_NS
                if not o.quiet:
                    done = sum(1 for _ in episodes)
                    print(f"\r  recorded {done} episodes ({task} seed {seed}) "
                          f"[{(time.perf_counter() - wall0) / 60:.1f} min]", end="", file=sys.stderr, flush=True)
    finally:
        bag.close()
        policy.close()
        sim.close()
    wall = time.perf_counter() - wall0
    summary = {"episodes": episodes, "attempted": total, "recorded": len(episodes), "policy": o.policy,
               "success": sum(e["success"] for e in episodes) / max(1, len(episodes)),
               "wall_s": wall, "episodes_per_min": total / wall * 60, "counts": bag.counts,
               "options": {k: (list(v) if isinstance(v, range) else v) for k, v in vars(o).items()}}
    summary["options"]["seeds"] = f"{o.seeds.start}:{o.seeds.stop}"
    (part / out.name / "episodes.json").write_text(json.dumps(summary, indent=1))
    (part / out.name).rename(out)
    part.rmdir()
    return summary


def main(argv=None) -> int:
    ap = _parser()
    o = ap.parse_args(argv)
    try:
        s = record(o)
    except (ValueError, FileExistsError) as exc:
        ap.error(str(exc))
    if not o.quiet:
        print(file=sys.stderr)
    print(f"{s['recorded']} of {s['attempted']} episodes recorded to {o.out} in {s['wall_s']:.0f} s "
          f"({s['episodes_per_min']:.1f} episodes/min); messages: {s['counts']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
