"""What both demos (``tools/sim/demo.py``: the open-loop bag demo, ``tools/sim/demo_loop.py``: the closed loop) show besides
their own loop: the random-weights note, a diagnostics level as text, and the timeline plot (action-chunk arrivals,
tokens per request, inference latency and observation age).  Pure matplotlib / numpy over the monitor's records.
"""
from __future__ import annotations

import numpy as np

__all__ = ["RANDOM_NOTE", "diag_level", "plot_timeline"]

RANDOM_NOTE = ("NOTE: this runs a RANDOM-WEIGHT model (preset {preset}): actions and text are meaningless; the "
               "timing, topics and KV sharing are real.\n      For a trained policy: oxygen demo (the shipped demo "
               "checkpoint) or --checkpoint /path/to/checkpoint (see README).")


def diag_level(d, name):
    return {0: "OK", 1: "WARN", 2: "ERROR", 3: "STALE"}.get(d.get(name, (None,))[0], "-")


def plot_timeline(png, t0, chunks, new_chunk, tokens, asked, responses, control_hz: float = 70.0) -> None:
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(3, 1, figsize=(11, 8), sharex=True)
    if chunks:
        t = np.array([c[0] for c in chunks]) - t0
        g = np.diff(t) * 1e3
        ax[0].plot(t[1:], g, ".", ms=2, label="action_chunk inter-arrival")
        ax[0].axhline(1e3 / control_hz, color="k", lw=0.8, ls="--", label=f"1/{control_hz:g} s")
        for c in new_chunk.values():
            ax[0].axvline(c[0] - t0, color="tab:orange", lw=0.3, alpha=0.5)
        ax[0].set_ylabel("ms")
        ax[0].set_ylim(0, max(40.0, float(np.percentile(g, 99)) * 1.2) if g.size else 40)
        ax[0].legend(loc="upper right", fontsize=8)
        ax[0].set_title("control output (orange: a new chunk arrived)")
    rid_rows = {}
    for x in tokens:
        rid_rows.setdefault((x[2], x[1]), []).append(x[0] - t0)
    colors = {"conversation": "tab:blue", "memory": "tab:green", "subtask": "tab:purple"}
    for i, ((task, rid), ts) in enumerate(sorted(rid_rows.items(), key=lambda kv: kv[0][1])):
        ax[1].plot(ts, [rid] * len(ts), "|", color=colors.get(task, "gray"), ms=6)
    for tq in asked:
        ax[1].axvline(tq - t0, color="tab:red", lw=0.8, ls=":")
    ax[1].set_ylabel("request id")
    ax[1].set_title("language tokens (blue conversation, green memory; red: question asked)")
    if new_chunk:
        cs = sorted(new_chunk.values())
        ax[2].plot([c[0] - t0 for c in cs], [c[5] for c in cs], ".-", ms=3, label="inference latency (ms)")
        ax[2].plot([c[0] - t0 for c in cs], [1e3 * c[6] for c in cs], ".", ms=3, label="observation age (ms)")
        ax[2].legend(loc="upper right", fontsize=8)
    ax[2].set_xlabel("seconds since start")
    ax[2].set_ylabel("ms")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
