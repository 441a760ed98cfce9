"""``oxygen sim-diagnose --copycat T``: does a policy's plan follow the image or the arm's own pose?

Behaviour cloning with proprioception has a known shortcut (causal confusion, de Haan et al. 2019; "copycat" policies,
Wen et al. 2020): on the expert's path the arm's pose already says where it is going, so a policy can fit the labels
from the state and barely use the image - and then has nothing to go on where the pose says nothing (the start pose)
or is off the path.  This file measures it.  For each seed the scripted expert drives the task through the node's
action path until ``T`` seconds; the frame there (three images, the state, the gripper and cube positions) is kept.
The policy then plans from that state twice: with that frame's own images, and with the images of another seed's frame
for the same arm (a cube elsewhere).  Each plan's endpoint (forward kinematics of the chunk's last row) against the
named cube's offset: the within-arm statistics of ``report.within_group_stats``.  Cube-following that survives
another scene's image comes from the state, not from seeing the cube.
"""
from __future__ import annotations

import numpy as np

__all__ = ["image_vs_state"]


def _expert_frames(task: str, seeds, t_probe: float, camera_size: int, params):
    """(spec, frame) per seed whose episode reached ``t_probe`` with the task unfinished."""
    from oxygen_ros.ros.lockstep import PipelinePolicy, sim_settings  # noqa: PLC0415
    from oxygen_ros.sim.episode import EpisodeConfig, run_episode  # noqa: PLC0415
    from oxygen_ros.sim.scene import AlohaScene  # noqa: PLC0415
    from oxygen_ros.sim.tasks import draw_task  # noqa: PLC0415

    sim = AlohaScene((camera_size, camera_size))
    expert = PipelinePolicy(sim_settings(params, {"delta_action_mask": []}), expert=True, horizon=20)
    out = []

    class Capture:
        def reset(self, spec, s):
            expert.reset(spec, s)
            self.spec, self.frame = spec, None

        def act(self, obs, ready_t):
            if self.frame is None and obs.t >= t_probe - 1e-9:
                self.frame = {"images": obs.images, "state": obs.state.copy(),
                              "grip": sim.grip_pos(self.spec.arm).copy(),
                              "cube": sim.cube_pos(self.spec.target_index).copy()}
            return expert.act(obs, ready_t)
    cap = Capture()
    try:
        for seed in seeds:
            spec = draw_task(task, int(seed))
            run_episode(sim, spec, cap, EpisodeConfig())      # stops at success: no frame if done before T
            if cap.frame is not None:
                out.append((spec, cap.frame))
    finally:
        expert.close()
        sim.close()
    return out


def image_vs_state(policy: str, task: str, seeds, t_probe: float, camera_size: int = 96,
                   params: str | None = None) -> list[dict]:
    """Two results (own image, another scene's image) in ``diagnose.grounding``'s layout, plus ``mean_abs_change``
    (m, x / y: how far the other image moves the planned endpoint) in the second."""
    from oxygen_ros.ros.lockstep import PipelinePolicy, sim_settings  # noqa: PLC0415
    from oxygen_ros.sim.episode import SimObservation  # noqa: PLC0415
    from oxygen_ros.sim.ik import ArmIK  # noqa: PLC0415
    from oxygen_ros.sim.scene import JOINTS, AlohaScene  # noqa: PLC0415

    from .report import within_group_stats  # noqa: PLC0415

    frames = _expert_frames(task, seeds, t_probe, camera_size, params)
    if len(frames) < 4:
        raise ValueError(f"--copycat {t_probe:g}: only {len(frames)} episodes were unfinished at {t_probe:g} s")
    sim = AlohaScene((camera_size, camera_size))
    ik = {a: ArmIK(sim, a) for a in ("left", "right")}
    pol = PipelinePolicy(sim_settings(params, {"checkpoint": "" if policy == "random" else policy}), horizon=20)
    rows = {"own": [], "other": []}
    try:
        for i, (spec, fr) in enumerate(frames):
            order = list(range(i + 1, len(frames))) + list(range(i))
            j = next((k for k in order if frames[k][0].arm == spec.arm), None)
            if j is None:
                continue
            sim.reset(spec.scene)
            for key, images in (("own", fr["images"]), ("other", frames[j][1]["images"])):
                pol.reset(spec, sim)
                trs = pol.act(SimObservation(0.0, images, fr["state"], spec.instruction, 0.0), 0.0)
                last = dict(zip(trs[-1].joint_names, trs[-1].positions[-1]))
                q = np.array([last[n] for n in JOINTS if n.startswith(spec.arm) and not n.endswith("gripper")])
                end, _ = ik[spec.arm].forward(q)
                rows[key].append({"seed": spec.seed, "arm": spec.arm, "image_of": frames[j][0].seed if key == "other"
                                  else spec.seed, "planned": (end - fr["grip"]).round(5).tolist(),
                                  "true": (fr["cube"] - fr["grip"]).round(5).tolist()})
    finally:
        pol.close()
        sim.close()
    out = []
    for key in ("own", "other"):
        r = rows[key]
        stats = within_group_stats(np.array([x["planned"][:2] for x in r]), np.array([x["true"][:2] for x in r]),
                                   [x["arm"] for x in r])
        out.append({"policy": policy, "task": task, "copycat_t": t_probe, "image": key, "scenes": len(r),
                    "usable": len(r), "stats": stats, "locate": None, "instruction_cell": None, "rows": r})
    a = np.array([x["planned"][:2] for x in rows["own"]])
    b = np.array([x["planned"][:2] for x in rows["other"]])
    out[1]["mean_abs_change"] = np.abs(a - b).mean(0).round(4).tolist()
    out[1]["mean_abs_plan"] = np.abs(a).mean(0).round(4).tolist()
    return out
