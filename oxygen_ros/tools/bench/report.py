"""What ``oxygen bench`` writes: the hardware record, the side-by-side table, the plot (action Hz vs tokens/s per
mode, and the k/N sweep) and the JSON-safe form of the results."""
from __future__ import annotations

import os
import platform
import socket
import subprocess
from typing import Optional

import numpy as np
import torch

from . import omp_wait_policy


def hardware(device) -> dict:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    hw = {"host": socket.gethostname(), "cpu": cpu, "cpu_count": os.cpu_count(),
          "torch_threads": torch.get_num_threads(),
          "torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
          "device": str(device), "device_name": cpu,
          "omp_wait_policy": omp_wait_policy()}
    if torch.device(device).type == "cuda":
        hw["device_name"] = torch.cuda.get_device_name(torch.device(device))
    try:
        hw["load_avg"] = os.getloadavg()
    except OSError:
        pass
    try:
        hw["git_commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                          cwd=os.path.dirname(__file__), timeout=5).stdout.strip()
    except Exception:
        pass
    return hw


def _fmt(x, nd=1):
    return "-" if x is None else f"{x:.{nd}f}"


def table(results: dict, base: str = "isolated") -> str:
    cols = ["mode", "frame ms", "action Hz", "tok/s", "tok/s tot", "cyc p50", "cyc p90", "cyc p99", "act lat p50",
            "ttft p50", "done p50", "prefill/f", "batch", "KV peak MB", "x Hz", "x tok/s", "| prefill", "actions",
            "decode", "other ms"]
    rows = []
    b = results.get(base, {}).get("metrics")
    for name, r in results.items():
        m = r["metrics"]
        xs = [None, None]
        if b and b.get("action_hz") and m.get("action_hz"):
            xs = [m["action_hz"] / b["action_hz"],
                  (m["tokens_per_s"] or 0) / b["tokens_per_s"] if b.get("tokens_per_s") else None]
        rows.append([name, _fmt(m.get("cycle_ms_mean")), _fmt(m.get("action_hz")), _fmt(m.get("tokens_per_s")),
                     _fmt(m.get("tokens_per_s_total")), _fmt(m.get("cycle_ms_p50")), _fmt(m.get("cycle_ms_p90")),
                     _fmt(m.get("cycle_ms_p99")), _fmt(m.get("action_latency_ms_p50")), _fmt(m.get("ttft_ms_p50")),
                     _fmt(m.get("completion_ms_p50")),
                     _fmt(m.get("prefills_per_frame"), 2), _fmt(m.get("batch_size_mean"), 2),
                     _fmt((m.get("kv_bytes_peak") or 0) / 2 ** 20, 2), _fmt(xs[0], 2), _fmt(xs[1], 2),
                     "| " + _fmt(m.get("prefill_ms_per_frame")), _fmt(m.get("actions_ms_per_frame")),
                     _fmt(m.get("decode_ms_per_frame")), _fmt(m.get("other_ms_per_frame"))])
    w = [max(len(str(c)), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    line = lambda r: "  ".join(str(x).rjust(w[i]) if i else str(x).ljust(w[i]) for i, x in enumerate(r))  # noqa: E731
    return "\n".join([line(cols), line(["-" * x for x in w])] + [line(r) for r in rows])


def plot(path: str, results: dict, sweep: Optional[list], title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    n = 2 if sweep else 1
    fig, axes = plt.subplots(1, n, figsize=(6.5 * n, 5))
    axes = np.atleast_1d(axes)
    ax = axes[0]
    for name, r in results.items():
        m = r["metrics"]
        ax.scatter(m["tokens_per_s"], m["action_hz"], s=60)
        ax.annotate(name, (m["tokens_per_s"], m["action_hz"]), textcoords="offset points", xytext=(6, 4))
    ax.set_xlabel("language tokens/s (mean over frames)")
    ax.set_ylabel("action frequency (Hz) = H x frames / time")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    if sweep:
        ax = axes[1]
        for i, N in enumerate(sorted({s["N"] for s in sweep})):
            pts = sorted((s["k"], s["speedup_hz"], s["ideal_speedup"]) for s in sweep if s["N"] == N)
            color = f"C{i}"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=color, label=f"N={N} measured")
            ax.plot([p[0] for p in pts], [p[2] for p in pts], "x--", color=color, alpha=0.5, label=f"N={N} ideal")
        ax.set_xlabel("k (tokens per request per frame)")
        ax.set_ylabel("oxygen / isolated action frequency")
        ax.set_title("k/N sweep", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def jsonable(x):
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    return x


def speedup_summary(results: dict, ide: dict) -> dict:
    """oxygen over isolated (action Hz, tokens/s), against the ideal of the component costs (``ide``) and against
    the ideal from the component times inside the runs; the shared N=k bound when it ran.  Empty without both."""
    if "isolated" not in results or "oxygen" not in results:
        return {}
    mi, mo = results["isolated"]["metrics"], results["oxygen"]["metrics"]
    sp_hz = mo["action_hz"] / mi["action_hz"]
    sp_tok = mo["tokens_per_s"] / mi["tokens_per_s"] if mi["tokens_per_s"] else None
    summary = {"speedup_action_hz": sp_hz, "speedup_tokens_per_s": sp_tok,
               "ideal_speedup": ide["speedup_oxygen_vs_isolated"],
               "pct_of_ideal_hz": 100 * sp_hz / ide["speedup_oxygen_vs_isolated"],
               "pct_of_ideal_tokens": None if sp_tok is None else 100 * sp_tok / ide["speedup_oxygen_vs_isolated"],
               "oxygen_frame_ms": mo["cycle_ms_mean"], "ideal_oxygen_frame_ms": ide["oxygen_frame_s"] * 1e3,
               "isolated_frame_ms": mi["cycle_ms_mean"], "ideal_isolated_frame_ms": ide["isolated_frame_s"] * 1e3}
    # the same ideal from the component times measured inside the runs themselves (prefill + actions + decode
    # per frame, i.e. the frame time minus everything else): what is left is scheduling overhead
    comp = lambda m: m["prefill_ms_per_frame"] + m["actions_ms_per_frame"] + m["decode_ms_per_frame"]  # noqa
    summary["ideal_speedup_in_run"] = comp(mi) / comp(mo)
    summary["pct_of_in_run_ideal_hz"] = 100 * sp_hz / summary["ideal_speedup_in_run"]
    summary["oxygen_other_ms_per_frame"] = mo["other_ms_per_frame"]
    summary["isolated_other_ms_per_frame"] = mi["other_ms_per_frame"]
    if "shared_N=k" in results:
        fs = results["shared_N=k"]["metrics"]["cycle_ms_mean"]
        summary["shared_N=k_frame_ms"] = fs
        summary["oxygen_frame_over_shared_N=k"] = mo["cycle_ms_mean"] / fs
    return summary
