"""Speed of the simulation on this machine: physics (control steps/s, 10 substeps each), rendering (ms per camera image
at the model's 96 px and at 224 px, one renderer for three cameras), the scripted expert's IK (ms per 20-row chunk)
and whole lockstep episodes through the node's action path (episodes per minute per task, cameras at 10 Hz).

    PYTHONPATH=. .venv/bin/python bench/sim_speed.py [--out bench/results/<UTC>-vm-sim/sim_speed.json]

Prints a table and writes JSON with the hardware and the load average (the CPU may be shared: say so with the numbers).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time

import oxygen_ros.sim  # noqa: F401 - MUJOCO_GL before mujoco


def _timeit(fn, n):
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n


def main() -> None:


    from oxygen_ros.ros.lockstep import PipelinePolicy, sim_settings
    from oxygen_ros.sim.episode import EpisodeConfig, run_episode
    from oxygen_ros.sim.expert import Expert
    from oxygen_ros.sim.scene import START_POSE, AlohaScene
    from oxygen_ros.sim.tasks import TASKS, draw_task

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--episodes", type=int, default=10)
    a = ap.parse_args()
    res = {"cpu": next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
                       platform.processor()), "cpu_count": os.cpu_count(), "python": platform.python_version()}
    sim = AlohaScene((96, 96))
    sim.reset(draw_task("pick", 0).scene)
    res["control_steps_per_s"] = 1.0 / _timeit(lambda: sim.step(START_POSE), 500)
    res["physics_steps_per_s"] = res["control_steps_per_s"] * sim.substeps
    sim.render()
    res["render_ms_per_camera_96"] = 1e3 * _timeit(sim.render, 50) / 3
    big = AlohaScene((224, 224))
    big.reset(draw_task("pick", 0).scene)
    big.render()
    res["render_ms_per_camera_224"] = 1e3 * _timeit(big.render, 30) / 3
    big.close()
    spec = draw_task("transfer", 0)
    sim.reset(spec.scene)
    ex = Expert(sim, spec)
    res["expert_ms_per_chunk_transfer"] = 1e3 * _timeit(lambda: ex.chunk(1.0, 20), 20)
    pol = PipelinePolicy(sim_settings(None, {"delta_action_mask": []}), expert=True, horizon=20)
    res["episodes_per_min"] = {}
    for task in TASKS:
        t = time.perf_counter()
        steps = 0
        for s in range(a.episodes):
            steps += len(run_episode(sim, draw_task(task, 10_000 + s), pol, EpisodeConfig()).actions)
        el = time.perf_counter() - t
        res["episodes_per_min"][task] = a.episodes / el * 60
        res[f"sim_speed_x_realtime_{task}"] = steps * 0.02 / el
    pol.close()
    sim.close()
    res["load_avg_end"] = os.getloadavg()
    rows = [("control steps/s (10 physics substeps each)", f"{res['control_steps_per_s']:.0f}"),
            ("physics steps/s", f"{res['physics_steps_per_s']:.0f}"),
            ("render ms per camera, 96 px", f"{res['render_ms_per_camera_96']:.1f}"),
            ("render ms per camera, 224 px", f"{res['render_ms_per_camera_224']:.1f}"),
            ("expert IK ms per 20-row chunk (transfer)", f"{res['expert_ms_per_chunk_transfer']:.1f}")]
    rows += [(f"lockstep expert episodes/min, {t}", f"{v:.0f} ({res[f'sim_speed_x_realtime_{t}']:.1f}x real time)")
             for t, v in res["episodes_per_min"].items()]
    print(f"simulation speed on {res['cpu']} ({res['cpu_count']} cores), load {res['load_avg_end']}")
    for k, v in rows:
        print(f"  {k:48s} {v}")
    if a.out:
        os.makedirs(os.path.dirname(a.out), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)



if __name__ == "__main__":
    main()
