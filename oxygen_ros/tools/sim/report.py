"""What ``oxygen sim-eval`` makes of its episodes: per-episode measures, per-cell aggregates with 95 % Wilson
intervals, the table, the plots.  Pure numpy/matplotlib over plain dicts, so a merge of shards recomputes exactly what
one big run would have printed.

This file owns the definitions of the reported numbers:

* **success rate** per task and cell, with the Wilson score interval (95 %, z = 1.96); crashed episodes are
  counted apart (``incomplete``) and never as failures; **time to success** = mean sim seconds of successful episodes;
* **action frequency** = H x chunks / sim duration (the paper's definition: executed chunks' rows per second) and
  **cycles/s** = policy calls per sim second;
* **smoothness at chunk switches**: for every step where a new trajectory takes over, the largest joint change of
  the executed command over that step ("switch jump", radians / gripper units); the same for all other steps
  ("inside"); reported as p50 / p95 and their ratio (1 = switches are as smooth as the motion inside a chunk);
* **answer accuracy**: a conversation answer is right when it equals the ground truth of the frame it read (lower
  case, surrounding spaces and a final period ignored); **memory accuracy**: a memory entry names the right objects
  when the set of cube colours it mentions equals the ground truth's (``memory_exact``: the whole sentence equal).

``summary(doc)`` is the part of a run's ``results.json`` a reader needs (``summary.json``, what ``bench/results/``
keeps): everything but the per-episode lists, so hundreds of episodes stay well under a megabyte.
"""
from __future__ import annotations

import math
import re

import numpy as np

__all__ = ["wilson", "normalise", "colours_in", "episode_measures", "aggregate", "format_table", "plot",
           "within_group_stats"]

_COLOURS = ("red", "green", "blue", "yellow")


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95 % Wilson score interval of a proportion k / n (0, 1 when n == 0)."""
    if n <= 0:
        return 0.0, 1.0
    p = k / n
    den = 1 + z * z / n
    c = (p + z * z / (2 * n)) / den
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    # the ends at 0 / n and n / n are 0 and 1 exactly (c - h and c + h leave a rounding error there)
    return (0.0 if k <= 0 else max(0.0, c - h)), (1.0 if k >= n else min(1.0, c + h))


def normalise(text: str) -> str:
    return re.sub(r"\s+", " ", (text or "").strip().lower()).rstrip(".").strip()


def colours_in(text: str) -> frozenset:
    words = set(re.findall(r"[a-z]+", (text or "").lower()))
    return frozenset(c for c in _COLOURS if c in words)


def episode_measures(result, language_log: list, horizon: int) -> dict:
    """One episode (``sim.episode.EpisodeResult`` + the policy's language log) -> a JSON-able dict."""
    from oxygen_ros.sim.episode import frame_key  # noqa: PLC0415

    d = result.to_dict()
    a = np.asarray(result.actions, dtype=np.float64)
    steps = np.abs(np.diff(a, axis=0)).max(axis=1) if len(a) > 1 else np.zeros(0)    # step k -> k+1 change
    sw = set(s - 1 for s in result.switch_steps if s >= 1)                           # the step into a switch
    d["switch_jumps"] = [float(steps[i]) for i in sorted(sw) if i < len(steps)]
    d["inside_steps"] = [float(steps[i]) for i in range(len(steps)) if i not in sw]
    d["chunks"] = len(result.chunk_times)
    d["horizon"] = int(horizon)
    answers, memories = [], []
    for e in language_log:
        if e.get("frame_t") is None:
            continue
        gt = result.frames_gt.get(frame_key(e["frame_t"]))
        if gt is None:
            continue
        gt_answers, gt_memory = gt
        if e["kind"] == "conversation" and e["prompt"] in gt_answers:
            answers.append({"q": e["prompt"], "a": e["text"], "gt": gt_answers[e["prompt"]],
                            "ok": normalise(e["text"]) == normalise(gt_answers[e["prompt"]]),
                            "finish": e["finish_reason"], "frame_t": e["frame_t"]})
        elif e["kind"] == "memory":
            memories.append({"text": e["text"], "gt": gt_memory, "frame_t": e["frame_t"],
                             "objects_ok": colours_in(e["text"]) == colours_in(gt_memory),
                             "exact": normalise(e["text"]) == normalise(gt_memory)})
    d["answers"], d["memories"] = answers, memories
    return d


def _pct(xs, q):
    return float(np.percentile(xs, q)) if len(xs) else None


def _spread(xs) -> dict:
    return {"n": len(xs), "p50": _pct(xs, 50), "p95": _pct(xs, 95)}


def aggregate(episodes: list[dict]) -> dict:
    """Episodes of one cell -> per task success (Wilson), times, and cell-wide rates, smoothness, language."""
    out = {"tasks": {}}
    for task in sorted({e["task"] for e in episodes}):
        eps = [e for e in episodes if e["task"] == task]
        done = [e for e in eps if not e.get("error")]
        k = sum(1 for e in done if e["success"])
        lo, hi = wilson(k, len(done))
        tts = [e["success_time"] for e in done if e["success"] and e["success_time"] is not None]
        out["tasks"][task] = {"n": len(done), "success": k, "rate": k / len(done) if done else None,
                              "ci95": [lo, hi], "time_to_success_s": float(np.mean(tts)) if tts else None,
                              "incomplete": [{"seed": e["seed"], "error": e["error"]} for e in eps if e.get("error")]}
        if task == "transfer":                 # gym-aloha's own definition beside the strict one, for comparison
            g = sum(1 for e in done if e.get("gym_success"))
            out["tasks"][task]["gym_aloha"] = {"success": g, "rate": g / len(done) if done else None,
                                               "ci95": list(wilson(g, len(done)))}
    done = [e for e in episodes if not e.get("error")]
    dur = sum(e["duration_s"] for e in done)
    chunks = sum(e["chunks"] for e in done)
    H = done[0]["horizon"] if done else 0
    out["sim_s"] = dur
    out["cycles_per_s"] = chunks / dur if dur else None
    out["action_hz"] = H * chunks / dur if dur else None
    if any(e.get("chunk_latency_ms") for e in done):          # realtime cells only (the node's ActionChunk messages)
        for key in ("chunk_latency_ms", "chunk_obs_age_s", "plan_age_s"):
            out[key] = _spread([x for e in done for x in e.get(key, [])])
    sj = [x for e in done for x in e["switch_jumps"]]
    ins = [x for e in done for x in e["inside_steps"]]
    p50s, p50i = _pct(sj, 50), _pct(ins, 50)
    out["smoothness"] = {"switches": len(sj), "switch_p50": p50s, "switch_p95": _pct(sj, 95),
                         "inside_p50": p50i, "inside_p95": _pct(ins, 95),
                         "ratio_p50": (p50s / p50i) if p50s is not None and p50i else None}
    ans = [a for e in done for a in e["answers"]]
    mem = [m for e in done for m in e["memories"]]
    out["answers"] = {"n": len(ans), "exact": (sum(a["ok"] for a in ans) / len(ans)) if ans else None,
                      "by_question": {q: {"n": len(qa), "exact": sum(a["ok"] for a in qa) / len(qa)}
                                      for q in sorted({a["q"] for a in ans if "q" in a})
                                      for qa in [[a for a in ans if a.get("q") == q]]}}
    out["memory"] = {"n": len(mem), "objects": (sum(m["objects_ok"] for m in mem) / len(mem)) if mem else None,
                     "exact": (sum(m["exact"] for m in mem) / len(mem)) if mem else None}
    out["rejected_trajectories"] = sum(sum(e["rejected"].values()) for e in done)
    out["incomplete"] = sum(1 for e in episodes if e.get("error"))
    return out


def _f(v, fmt="{:.1f}", none="-"):
    return none if v is None else fmt.format(v)


def format_table(cells: list[dict]) -> str:
    """One row per cell and task."""
    hdr = (f"{'engine':9} {'chunking':8} {'delay':>6} {'language':12} {'task':9} {'success':>8} {'95% CI':>13} "
           f"{'n':>4} {'t_succ':>6} {'act Hz':>7} {'cyc/s':>6} {'jump p50':>8} {'in p50':>7} {'ratio':>6} "
           f"{'answers':>8} {'memory':>7}")
    lines = [hdr, "-" * len(hdr)]
    for c in cells:
        a = c["aggregate"]
        sm = a["smoothness"]
        for task, t in a["tasks"].items():
            rate = _f(None if t["rate"] is None else 100 * t["rate"], "{:.0f}%")
            ci = f"[{100 * t['ci95'][0]:.0f}, {100 * t['ci95'][1]:.0f}]"
            inc = f" +{len(t['incomplete'])} incomplete" if t["incomplete"] else ""
            if "gym_aloha" in t and t["gym_aloha"]["rate"] is not None:
                inc += f"  (gym-aloha's definition: {100 * t['gym_aloha']['rate']:.0f}%)"
            lines.append(
                f"{c['engine_mode']:9} {c['chunking']:8} {c['delay_ms']:>4}ms {c['language']:12} {task:9} "
                f"{rate:>8} {ci:>13} {t['n']:>4} {_f(t['time_to_success_s'], '{:.2f}'):>6} "
                f"{_f(a['action_hz']):>7} {_f(a['cycles_per_s']):>6} {_f(sm['switch_p50'], '{:.4f}'):>8} "
                f"{_f(sm['inside_p50'], '{:.4f}'):>7} {_f(sm['ratio_p50'], '{:.2f}'):>6} "
                f"{_f(None if a['answers']['exact'] is None else 100 * a['answers']['exact'], '{:.0f}%'):>8} "
                f"{_f(None if a['memory']['objects'] is None else 100 * a['memory']['objects'], '{:.0f}%'):>7}{inc}")
    return "\n".join(lines)


def plot(cells: list[dict], path) -> list[str]:
    """Success vs delay per chunking mode (one panel per task), and success / action Hz vs language load per engine
    mode; returns the files written (none when an axis has a single value)."""
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    written = []
    tasks = sorted({t for c in cells for t in c["aggregate"]["tasks"]})
    delays = sorted({c["delay_ms"] for c in cells})
    if len(delays) > 1:
        fig, axes = plt.subplots(1, len(tasks), figsize=(4.5 * len(tasks), 3.6), squeeze=False)
        for ax, task in zip(axes[0], tasks):
            for (mode, chunking) in sorted({(c["engine_mode"], c["chunking"]) for c in cells}):
                pts = sorted((c["delay_ms"], c["aggregate"]["tasks"].get(task)) for c in cells
                             if c["chunking"] == chunking and c["engine_mode"] == mode and c["language"] == "none")
                pts = [(d, t) for d, t in pts if t and t["rate"] is not None]
                if not pts:
                    continue
                x = [d for d, _ in pts]
                y = [100 * t["rate"] for _, t in pts]
                err = [[100 * (t["rate"] - t["ci95"][0]) for _, t in pts], [100 * (t["ci95"][1] - t["rate"])
                                                                             for _, t in pts]]
                ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=f"{chunking} ({mode})")
            ax.set_title(task)
            ax.set_xlabel("injected inference delay (ms)")
            ax.set_ylabel("success (%)")
            ax.set_ylim(-5, 105)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        fig.tight_layout()
        f = str(path) + "_delay.png"
        fig.savefig(f, dpi=110)
        plt.close(fig)
        written.append(f)
    loads = sorted({c["language"] for c in cells})
    if len(loads) > 1:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.6))
        for mode in sorted({c["engine_mode"] for c in cells}):
            cs = [c for c in cells if c["engine_mode"] == mode]
            xs = list(range(len(loads)))
            rates, hz = [], []
            for ld in loads:
                sel = [c for c in cs if c["language"] == ld]
                k = sum(t["success"] for c in sel for t in c["aggregate"]["tasks"].values())
                n = sum(t["n"] for c in sel for t in c["aggregate"]["tasks"].values())
                rates.append(100 * k / n if n else np.nan)
                hzs = [c["aggregate"]["action_hz"] for c in sel if c["aggregate"]["action_hz"] is not None]
                hz.append(np.mean(hzs) if hzs else np.nan)
            a1.plot(xs, rates, marker="o", label=mode)
            a2.plot(xs, hz, marker="o", label=mode)
        for ax, yl in ((a1, "success, all tasks (%)"), (a2, "action frequency (Hz)")):
            ax.set_xticks(range(len(loads)))
            ax.set_xticklabels(loads, fontsize=8)
            ax.set_xlabel("language load")
            ax.set_ylabel(yl)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        f = str(path) + "_language.png"
        fig.savefig(f, dpi=110)
        plt.close(fig)
        written.append(f)
    return written


def summary(doc: dict) -> dict:
    """A ``results.json`` document -> its ``summary.json``: configuration, hardware, per-cell aggregates (what the
    table and plots show) and one row of scalars per episode (task, seed, success, times, counts); the per-episode
    lists (switch jumps, inside steps, answers, memory entries) are left out and named in ``left_out``."""
    out = {k: v for k, v in doc.items() if k != "episodes"}
    episodes = doc.get("episodes", [])
    out["episodes"] = [{k: v for k, v in e.items() if not isinstance(v, list)} for e in episodes]
    out["left_out"] = sorted({k for e in episodes for k, v in e.items() if isinstance(v, list)})
    return out


def within_group_stats(planned: np.ndarray, true: np.ndarray, groups) -> dict:
    """Per axis: Pearson r and the least-squares slope of planned [N, k] on true [N, k] after removing each group's
    mean (so that a policy that only knows which arm moves scores 0)."""
    planned, true = np.asarray(planned, float), np.asarray(true, float)
    groups = np.asarray(groups)
    p, t = planned.copy(), true.copy()
    for g in np.unique(groups):
        m = groups == g
        p[m] -= p[m].mean(0)
        t[m] -= t[m].mean(0)
    out = {}
    for k, ax in enumerate("xyz"[:planned.shape[1]]):
        sp, st = float(np.sqrt((p[:, k] ** 2).sum())), float(np.sqrt((t[:, k] ** 2).sum()))
        r = float((p[:, k] * t[:, k]).sum() / (sp * st)) if sp > 0 and st > 0 else 0.0
        slope = float((p[:, k] * t[:, k]).sum() / (t[:, k] ** 2).sum()) if st > 0 else 0.0
        out[ax] = {"r": round(r, 4), "slope": round(slope, 4)}
    return out
