"""Are the expert's first-chunk labels a function of what the policy sees?  The wrist part, against the cube's yaw.

Reads the episode bags of ``oxygen sim-record`` (the expert's labelled episodes), takes each reach / pick episode's
first frame and compares, for the named arm's forearm roll and wrist rotate, the end of the expert's label chunk with
the named cube's yaw offset mod 90 degrees (relative to the arm's natural closing direction, ``sim/expert.py``'s
``_natural_yaw``, from which ``_grasp_yaw`` chooses the face to grasp) and with the plan of a checkpoint on the same
frame (zero noise).  Prints per task: std, Pearson r and slope of each against the offset, and the labels of the
episodes whose cube sits within 5 degrees of the +-45 degree flip (where nearly the same image gets opposite labels);
then, per joint of the named arm and per arm, how well the plan follows the label (std of each in rad, Pearson r of
plan with label) - which parts of the first chunk the policy reads from the images - and which arm moves more in the
first chunk, label vs plan (pick's arm is the cube's side, which only the images show).

    AMENT_PREFIX_PATH=$PWD/.venv .venv/bin/python dev/label_yaw_check.py data/r0_clean --checkpoint checkpoints/demo

Measured 2026-12-07 on round 0's clean bag (checkpoints/demo/README.md, *Stage 5*): label wrist_rotate r -0.99 / -1.00
(reach / pick), std 0.42 rad; the shipped policy's plan r -0.09 / +0.08, std 0.03-0.04 rad.  On the late-turning
expert's bag (*Stage 6*): pick's first chunk moves the cube's arm more in 116 / 200 plans of the shipped policy, 126 /
200 after the fine-tune (the labels: 200 / 200) - near chance; reach's (arm named in the instruction): 200 / 200.
"""
from __future__ import annotations

import argparse

import numpy as np
import torch


JOINTS = ("waist", "shoulder", "elbow", "forearm_roll", "wrist_angle", "wrist_rotate")   # an ALOHA arm's 6 joints


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bags", nargs="+")
    ap.add_argument("--checkpoint", default="checkpoints/demo")
    ap.add_argument("--tasks", default="reach,pick")
    a = ap.parse_args(argv)
    from oxygen_ros.model import Processor, load_checkpoint
    from oxygen_ros.model.processing import Observation
    from oxygen_ros.sim.expert import _natural_yaw      # the arm's natural closing direction, as the expert's
    from oxygen_ros.sim.scene import AlohaScene
    from oxygen_ros.sim.tasks import draw_task
    from oxygen_ros.tools.train import robot_layout
    from oxygen_ros.train.data import TopicMap, load_episodes, to_policy_actions

    torch.set_num_threads(2)
    lay = robot_layout(None)
    dm = np.array(lay.delta_action_mask, bool)
    sim = AlohaScene(camera_size=(16, 16))
    base = {arm: sim.arm_base[arm][:2].copy() for arm in ("left", "right")}
    sim.close()
    pol = load_checkpoint(a.checkpoint)
    model = pol.model.eval()
    proc = Processor(pol.cfg, pol.tokenizer, pol.norm_stats, action_dims=len(lay.action_names))
    episodes = load_episodes(a.bags, TopicMap.from_layout(lay), image_size=pol.cfg.image_size)
    for task in a.tasks.split(","):
        rows, joints, arm_moves = [], [], []
        for e in (e for e in episodes if e.meta.get("task") == task):
            spec = draw_task(task, int(e.meta["seed"]))
            cube = spec.scene.cubes[spec.target_index]
            rel = float(np.angle(np.exp(1j * (cube.yaw - _natural_yaw(base[spec.arm], np.array([cube.x, cube.y]))))))
            rel = (rel + np.pi / 4) % (np.pi / 2) - np.pi / 4                 # the grasp face's offset, [-45, 45) deg
            off = 0 if spec.arm == "left" else 7
            label = to_policy_actions(e.action_chunk(0, pol.cfg.action_horizon)[0], e.state[0], dm)[-1]
            mi = proc.prepare(Observation(images=list(e.images[0]), state=e.state[0], prompt=e.instruction[0]))
            with torch.no_grad():
                pre = model.prefill(mi.images, mi.image_masks, mi.tokens, mi.token_masks)
                z = torch.zeros(1, pol.cfg.action_horizon, pol.cfg.action_dim)
                plan = model.sample_actions(pre, z)[0, -1, :len(dm)].numpy()
            plan = pol.norm_stats.unnormalize_actions(plan[None])[0]
            rows.append((rel, label[off + 3], label[off + 5], plan[off + 3], plan[off + 5]))
            joints.append((spec.arm, label[off:off + 6], plan[off:off + 6]))
            moves = []                                            # [label, plan] x [this arm, the other arm] (rad)
            for v in (label, plan):
                moves.append([np.linalg.norm(v[o:o + 6] - np.where(dm[o:o + 6], 0.0, e.state[0][o:o + 6]))
                              for o in (off, 7 - off)])
            arm_moves.append(moves)
        if len(rows) < 3:
            print(f"{task}: {len(rows)} episodes - too few")
            continue
        R = np.array(rows)
        rel = R[:, 0]
        print(f"{task}: {len(R)} episodes; first chunk's end (rad) vs the cube's yaw offset mod 90 deg "
              f"(std {np.degrees(rel.std()):.0f} deg)")
        for name, col in (("label forearm_roll", 1), ("label wrist_rotate", 2), ("plan forearm_roll", 3),
                          ("plan wrist_rotate", 4)):
            y = R[:, col]
            r = np.corrcoef(rel, y)[0, 1] if y.std() > 0 else float("nan")
            print(f"  {name:>20}: std {y.std():.3f}, r {r:+.2f}, slope {np.polyfit(rel, y, 1)[0]:+.2f}")
        near = np.abs(np.abs(rel) - np.pi / 4) < np.radians(5)
        print(f"  within 5 deg of the +-45 deg flip: {int(near.sum())} episodes; label wrist_rotate "
              f"{np.round(R[near, 2], 2).tolist()} at offsets {np.round(np.degrees(rel[near])).tolist()} deg")
        M = np.array(arm_moves)                                                        # [N, 2, 2]
        print(f"  which arm moves more in the first chunk: the task's arm in {int((M[:, 0, 0] > M[:, 0, 1]).sum())} / "
              f"{len(M)} labels, {int((M[:, 1, 0] > M[:, 1, 1]).sum())} / {len(M)} plans; joint-space move of the "
              f"task's arm / the other, median rad: label {np.median(M[:, 0, 0]):.3f} / {np.median(M[:, 0, 1]):.3f}, "
              f"plan {np.median(M[:, 1, 0]):.3f} / {np.median(M[:, 1, 1]):.3f}")
        print("  per joint, left / right arm: label std, plan std (rad), r(plan, label)")
        for j, name in enumerate(JOINTS):
            cells = []
            for arm in ("left", "right"):
                L = np.array([lab[j] for s_, lab, _ in joints if s_ == arm])
                P = np.array([pl[j] for s_, _, pl in joints if s_ == arm])
                if len(L) < 3:
                    cells.append("-")
                    continue
                r = np.corrcoef(L, P)[0, 1] if L.std() > 0 and P.std() > 0 else float("nan")
                cells.append(f"{L.std():.3f} {P.std():.3f} {r:+.2f}")
            print(f"  {name:>20}: " + " / ".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
