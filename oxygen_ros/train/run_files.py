"""What a run writes beside its weights: the optimiser state flattened to safetensors (``train_state.safetensors`` +
its layout in ``train_state.json``) and back, and ``curves.png`` from ``curves.json``."""
from __future__ import annotations

from pathlib import Path

import torch

from .focus import GROUPS

__all__ = ["flatten_optimizer", "restore_optimizer", "plot_curves"]


def flatten_optimizer(opt) -> tuple[dict, dict]:
    sd = opt.state_dict()
    tensors, meta = {}, {"param_groups": sd["param_groups"], "state": {}}
    for pid, st in sd["state"].items():
        meta["state"][str(pid)] = []
        for k, v in st.items():
            t = v if torch.is_tensor(v) else torch.tensor(v)
            tensors[f"opt.{pid}.{k}"] = t.detach().cpu().contiguous()
            meta["state"][str(pid)].append(k)
    return tensors, meta


def restore_optimizer(opt, tensors: dict, meta: dict) -> None:
    state = {int(pid): {k: tensors[f"opt.{pid}.{k}"] for k in keys} for pid, keys in meta["state"].items()}
    opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def plot_curves(curves: dict, path: Path) -> None:
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    tr, va = curves.get("train", []), curves.get("val", [])
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.4))
    if tr:
        s = [r["step"] for r in tr]
        axes[0].plot(s, [r["fm"] for r in tr], label="train flow matching")
        axes[1].plot(s, [r["ce"] for r in tr], label="train text CE")
        axes[2].plot(s, [r["lr"] for r in tr], label="learning rate")
    if va:
        s = [r["step"] for r in va]
        axes[0].plot(s, [r["fm"] for r in va], "o-", label="validation")
        for g, style in zip(GROUPS, ("^--", "v--")):
            pts = [(r["step"], r["fm_" + g]) for r in va if "fm_" + g in r]
            if pts:
                axes[0].plot(*zip(*pts), style, label=f"validation, {g} frames")
        axes[1].plot(s, [r["ce"] for r in va], "o-", label="validation")
    ev = curves.get("eval", [])
    if ev:
        ax = axes[2].twinx()
        ax.plot([r["step"] for r in ev], [100 * r.get("success", 0) for r in ev], "s-", color="green",
                label="closed-loop success %")
        ax.set_ylim(-5, 105)
        ax.legend(loc="lower right", fontsize=7)
    for ax, yl in zip(axes, ("loss", "loss", "lr")):
        ax.set_xlabel("step")
        ax.set_ylabel(yl)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_yscale("log")
    axes[1].set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
