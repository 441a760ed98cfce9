"""``oxygen sim-diagnose``: does a policy see the cube?  Visual grounding measured over many scenes.

This file owns the grounding check.  For each of ``--scenes`` seeds of ``--task`` it resets the simulation (arms at
their start pose), asks the policy for its first chunk through the node's own path (``ros/lockstep.py``
``PipelinePolicy``: cameras, state and instruction in, ``joint_trajectory`` out) and puts the chunk's last row
through the arm's forward kinematics: the *planned endpoint* of the acting gripper (the named arm; pick: the cube's
side; transfer: the right arm).  A policy that grounds the instruction in the image plans endpoints that move with the
named cube: per axis (x, y) the Pearson correlation between the planned displacement (endpoint - start) and the
cube's offset from the gripper, *within* each arm (the arm alone - known from the text - explains most of x), and the
slope of that relation.  The scripted expert is the reference (``--policy expert``); ``random`` weights the floor.

A model is also asked, in the same scene (the same still frame, through the node's conversation path), "Where is the
<named> cube?" - the localisation text target the policy co-trains on, answered as a cell of an 8 x 8 grid of the top
camera's image (``sim.tasks.cube_locations``).  Scored exact and within one cell: whether the *prefix* the action expert
reads locates the cube, apart from whether the plan uses it (``--no-locate`` skips it).
``--copycat T`` adds, per model, the plan from the expert's state T s into each episode with that frame's own images
and with another scene's (``copycat.py``): cube-following that survives the wrong image comes from the state.
Outputs under ``--out``: ``grounding.json`` (per scene and the statistics), ``grounding.png`` (planned vs true per
axis) and the table on stdout.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from .report import within_group_stats

__all__ = ["grounding", "within_group_stats", "cell_distance", "main"]

LOCATE_MAX_CYCLES = 30                  # camera frames of the still scene to wait for the answer


def cell_distance(answer: str, truth: str) -> int | None:
    """Cells between two "row R column C" answers (Chebyshev: 0 = the same cell, 1 = a neighbour); None when either
    is not such an answer (e.g. "not in view", or a model's malformed text)."""
    from oxygen_ros.sim.tasks import parse_cell  # noqa: PLC0415

    a, b = parse_cell(answer), parse_cell(truth)
    if a is None or b is None:
        return None
    return max(abs(a[0] - b[0]), abs(a[1] - b[1]))


def _ask_locate(pol, spec, sim, first_obs) -> dict:
    """Ask the policy where the named cube is, on the still start frame, until it answers (LOCATE_MAX_CYCLES)."""
    from oxygen_ros.ros.lockstep import LanguageLoad  # noqa: PLC0415
    from oxygen_ros.sim.episode import SimObservation  # noqa: PLC0415
    from oxygen_ros.sim.tasks import cube_locations, locate_question  # noqa: PLC0415

    q = locate_question(spec.target)
    truth = cube_locations(sim)[q]
    pol.language = LanguageLoad(question_every_s=1e6, questions=(q,))   # one question, at t = 0
    pol.reset(spec, sim)
    answer = None
    for i in range(LOCATE_MAX_CYCLES):
        t = i * 0.1
        pol.act(SimObservation(t, first_obs.images, first_obs.state, spec.instruction, t), t)
        said = [e["text"] for e in pol.language_log if e["kind"] == "conversation"]
        if said:
            answer = said[0]
            break
    d = cell_distance(answer or "", truth)
    return {"question": q, "answer": answer, "truth": truth, "cells_off": d}


def grounding(policy: str, task: str, seeds, camera_size: int = 96, params: str | None = None,
              locate: bool = True, instruction_cell: str | None = None, row: int | None = None) -> dict:
    """``row``: the planned endpoint is the chunk's row ``row`` (1-based; the expert then plans at least that many
    rows), so that policies of different horizons compare at one time ahead; None: the chunk's last row.
    ``instruction_cell``: for a policy trained with ``--locate-in-instruction``, the cell appended to each scene's
    instruction - "true" (the named cube's, ``sim.tasks.cube_locations``) or a fixed "row R column C" (a wrong one:
    does the plan follow the text?); None: the plain instruction."""
    from oxygen_ros.ros.lockstep import LanguageLoad, PipelinePolicy, sim_settings  # noqa: PLC0415
    from oxygen_ros.sim.episode import SimObservation  # noqa: PLC0415
    from oxygen_ros.sim.ik import ArmIK  # noqa: PLC0415
    from oxygen_ros.sim.scene import ARM_JOINTS, ARM_OFFSET, JOINTS, AlohaScene  # noqa: PLC0415
    from oxygen_ros.sim.tasks import cube_locations, draw_task, locate_question, located_instruction  # noqa: PLC0415

    expert = policy == "expert"
    over = {"delta_action_mask": []} if expert else {"checkpoint": "" if policy == "random" else policy}
    pol = PipelinePolicy(sim_settings(params, over), expert=expert, horizon=max(20, row or 0))
    locate = locate and not expert                     # the scripted expert has no language
    sim = AlohaScene((camera_size, camera_size))
    ik = {a: ArmIK(sim, a) for a in ("left", "right")}
    rows = []
    try:
        for seed in seeds:
            spec = draw_task(task, int(seed))
            sim.reset(spec.scene)
            pol.language = LanguageLoad()                       # the plan: no question in that frame
            pol.reset(spec, sim)
            instruction = spec.instruction
            if instruction_cell:
                cell = cube_locations(sim)[locate_question(spec.target)] if instruction_cell == "true" \
                    else instruction_cell
                instruction = located_instruction(instruction, cell)
            obs = SimObservation(0.0, sim.render(), sim.state(), instruction, 0.0)
            trs = pol.act(obs, 0.0)
            loc = _ask_locate(pol, spec, sim, obs) if locate else None
            if not trs:
                rows.append({"seed": int(seed), "arm": spec.arm, "error": "no trajectory"})
                continue
            tr = trs[-1]
            end_row = tr.positions[-1] if row is None else tr.positions[min(row, len(tr.positions)) - 1]
            last = dict(zip(tr.joint_names, end_row))
            off = ARM_OFFSET[spec.arm]                  # the named arm's six joints, in the IK's order
            q = np.array([last[JOINTS[off + i]] for i in range(len(ARM_JOINTS))])
            end, _ = ik[spec.arm].forward(q)
            start = sim.grip_pos(spec.arm)
            cube = sim.cube_pos(spec.target_index)
            rows.append({"seed": int(seed), "arm": spec.arm, "planned": (end - start).round(5).tolist(),
                         "true": (cube - start).round(5).tolist(), **({"locate": loc} if loc else {})})
    finally:
        pol.close()
        sim.close()
    ok = [r for r in rows if "planned" in r]
    stats = within_group_stats(np.array([r["planned"][:2] for r in ok]), np.array([r["true"][:2] for r in ok]),
                               [r["arm"] for r in ok]) if len(ok) > 2 else {}
    return {"policy": policy, "task": task, "instruction_cell": instruction_cell, "row": row, "scenes": len(rows),
            "usable": len(ok), "stats": stats,
            "locate": _locate_stats(rows) if locate else None, "rows": rows}


def _locate_stats(rows) -> dict:
    from oxygen_ros.sim.tasks import parse_cell  # noqa: PLC0415

    asked = [r["locate"] for r in rows if r.get("locate")]
    scored = [a for a in asked if parse_cell(a["truth"])]            # the named cube in the top camera's view
    n = len(scored)
    return {"asked": len(asked), "scored": n,
            "answered": sum(a["answer"] is not None for a in scored),
            "exact": round(sum(a["cells_off"] == 0 for a in scored) / n, 4) if n else None,
            "within_one_cell": round(sum(a["cells_off"] is not None and a["cells_off"] <= 1 for a in scored) / n, 4)
            if n else None}


def _plot(results: list[dict], path: Path) -> str:
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    for res in results:
        ok = [r for r in res["rows"] if "planned" in r]
        for k, ax in enumerate(axes):
            cell = f" + {res['instruction_cell']}" if res.get("instruction_cell") else ""
            if res.get("copycat_t") is not None:
                cell += f" @{res['copycat_t']:g}s {res['image']} image"
            ax.scatter([r["true"][k] for r in ok], [r["planned"][k] for r in ok], s=12, alpha=0.7,
                       label=f"{res['policy'][-30:]}{cell} "
                             f"(r within arm {res['stats'].get('xy'[k], {}).get('r', 0):+.2f})")
    for k, ax in enumerate(axes):
        ax.set_xlabel(f"cube offset from the gripper, {'xy'[k]} (m)")
        ax.set_ylabel(f"planned endpoint displacement, {'xy'[k]} (m)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("grounding: does the first chunk's endpoint move with the named cube?")
    fig.tight_layout()
    out = path / "grounding.png"
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return str(out)


def main(argv=None) -> int:
    from oxygen_ros.ros.engine_factory import SHIPPED, resolve_checkpoint  # noqa: PLC0415
    from oxygen_ros.sim.tasks import TASKS  # noqa: PLC0415

    from .record import parse_seeds  # noqa: PLC0415

    ap = argparse.ArgumentParser(prog="oxygen sim-diagnose", description=__doc__.split("\n\n")[0])
    ap.add_argument("--policy", action="append", default=None,
                    help="expert | random | demo | a checkpoint directory (repeatable: compared in one table)")
    ap.add_argument("--task", default="reach", choices=TASKS)
    ap.add_argument("--seeds", type=parse_seeds, default=parse_seeds("0:50"), help="scenes A:B (default 0:50)")
    ap.add_argument("--camera-size", type=int, default=96)
    ap.add_argument("--params", default=None, help="node parameter file (default config/sim_aloha.yaml)")
    ap.add_argument("--no-locate", action="store_true",
                    help="do not ask a model where the named cube is (the localisation probe)")
    ap.add_argument("--instruction-cell", action="append", default=None, metavar="none|true|'row R column C'",
                    help="for a policy trained with oxygen train --locate-in-instruction: the cell appended to the "
                         "instruction - none, the true one or a fixed one (repeatable: a table row per cell per "
                         "policy)")
    ap.add_argument("--copycat", type=float, default=None, metavar="T",
                    help="also: at the expert's state T seconds into each episode, the plan with that frame's own "
                         "images vs another scene's (tools/sim/copycat.py: does the plan follow the image or the "
                         "state?); model policies only")
    ap.add_argument("--row", type=int, default=None, metavar="N",
                    help="read the planned endpoint at the chunk's row N (1-based; the expert plans at least N rows): "
                         "policies of different horizons compared at one time ahead (default: each chunk's last row)")
    ap.add_argument("--out", default=None, help="output folder (default out/sim_diagnose/<UTC time>)")
    o = ap.parse_args(argv)
    policies = o.policy or ["expert", "demo"]
    names = list(policies)                       # as given (a shipped name rather than its installed path)
    for i, p in enumerate(policies):
        if p in SHIPPED:
            policies[i] = resolve_checkpoint(p)
        elif p not in ("expert", "random") and not Path(p).is_dir():
            ap.error(f"--policy {p!r} is not expert, random, demo or a checkpoint directory")
    out = Path(o.out or Path("out") / "sim_diagnose" / time.strftime("%Y%m%d-%H%M%S", time.gmtime()))
    out.mkdir(parents=True, exist_ok=True)
    from oxygen_ros.sim.tasks import parse_cell  # noqa: PLC0415
    cells = [None if c == "none" else c for c in (o.instruction_cell or ["none"])]
    for c in cells:
        if c is not None and c != "true" and (c != c.strip() or parse_cell(c) is None):
            ap.error(f"--instruction-cell must be true or 'row R column C', got {c!r}")
    if any(cells) and "expert" in policies:
        ap.error("--instruction-cell: model policies only (the expert reads no text)")
    if o.row is not None and not 1 <= o.row <= 1000:
        ap.error(f"--row must be 1..1000, got {o.row}")
    if o.copycat is not None and not 0 < o.copycat < float("inf"):      # NaN fails too
        ap.error("--copycat must be a finite time > 0 s")
    given = list(zip(names, policies))
    runs = [(n, p, c) for n, p in zip(names, policies) for c in cells]
    names = [n if c is None else f"{n} + {c}" for n, _, c in runs]
    results = [grounding(p, o.task, o.seeds, o.camera_size, o.params, locate=not o.no_locate and c is None,
                         instruction_cell=c, row=o.row) for _, p, c in runs]
    if o.copycat is not None:
        from .copycat import image_vs_state  # noqa: PLC0415
        for n, p in given:
            if p == "expert":
                continue
            try:
                pair = image_vs_state(p, o.task, o.seeds, o.copycat, o.camera_size, o.params)
            except ValueError as exc:
                ap.error(str(exc))
            results += pair
            names += [f"{n} @{o.copycat:g}s, its image", f"{n} @{o.copycat:g}s, another scene's"]
    at = "last row" if o.row is None else f"row {o.row}"
    lines = [f"grounding on {o.task}, scenes {o.seeds.start}:{o.seeds.stop} (within-arm Pearson r / slope of the "
             f"first chunk's planned endpoint ({at}) displacement vs the named cube's offset)",
             "locate: \"Where is the <named> cube?\" asked in the same scene, answered as a cell of 8 x 8 of the top "
             "image: exact / within one cell",
             f"{'policy':<48} {'x r':>7} {'x slope':>8} {'y r':>7} {'y slope':>8} {'locate':>7} {'<=1 cell':>8}"]
    for name, r in zip(names, results):
        s, loc = r["stats"], r.get("locate") or {}
        pct = [f"{loc[k]:.0%}" if loc.get(k) is not None else "-" for k in ("exact", "within_one_cell")]
        lines.append(f"{name[-48:]:<48} {s['x']['r']:>+7.3f} {s['x']['slope']:>+8.3f} "
                     f"{s['y']['r']:>+7.3f} {s['y']['slope']:>+8.3f} {pct[0]:>7} {pct[1]:>8}")
    for name, r in zip(names, results):
        if "mean_abs_change" in r:
            lines.append(f"{name[-48:]}: another scene's image moves the endpoint by {r['mean_abs_change']} m "
                         f"(x / y, mean; the plan itself: {r['mean_abs_plan']} m)")
    table = "\n".join(lines)
    (out / "grounding.json").write_text(json.dumps({"task": o.task, "results": results}, indent=1))
    (out / "table.txt").write_text(table + "\n")
    _plot(results, out)
    print(table)
    print(f"results: {out}/grounding.json, {out}/grounding.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
