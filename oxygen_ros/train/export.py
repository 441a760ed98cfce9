"""Export a training run's latest checkpoint as a deployable policy folder (what ships as ``checkpoints/demo``).

This file owns one job: copy what the node loads - ``model.safetensors``, ``config.json``, ``assets/*/norm_stats.json``,
``paligemma_tokenizer.model`` - plus the run's curves (``curves.json`` / ``curves.png``) and the checkpoint's
``train_state.json`` summary (step, options; not the optimizer moments) from ``RUN/latest`` to ``DEST``, built beside it
and moved into place (a run that cannot be exported leaves ``DEST`` as it was).
``python -m oxygen_ros.train.export RUN DEST``.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

__all__ = ["export_checkpoint"]

KEEP = ("model.safetensors", "config.json", "paligemma_tokenizer.model")
REQUIRED = ("model.safetensors", "config.json", "train_state.json")


def export_checkpoint(run: str | os.PathLike, dest: str | os.PathLike) -> Path:
    run, dest = Path(run), Path(dest)
    latest = run / "latest"
    if not latest.is_file():
        raise FileNotFoundError(f"{run}: no `latest` checkpoint (is it an `oxygen train --out` folder?)")
    ck = run / latest.read_text().strip()
    missing = [n for n in REQUIRED if not (ck / n).is_file()]
    if missing:
        raise FileNotFoundError(f"{ck}: no {', '.join(missing)} (an incomplete checkpoint; nothing exported)")
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        _fill(ck, run, dest, tmp)
    except BaseException:                             # a broken run never costs the policy already there
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)
    return dest


def _fill(ck: Path, run: Path, dest: Path, tmp: Path) -> None:
    for name in KEEP:
        if (ck / name).is_file():
            shutil.copy2(ck / name, tmp / name)
    if (ck / "assets").is_dir():
        shutil.copytree(ck / "assets", tmp / "assets")
    state = json.loads((ck / "train_state.json").read_text())
    summary = {k: state[k] for k in ("step", "options", "bf16_autocast", "text_len", "val_episodes", "delta_action_mask")
               if k in state}
    summary["source"] = str(ck)
    (tmp / "training.json").write_text(json.dumps(summary, indent=1))
    for name in ("curves.json", "curves.png"):
        if (run / name).is_file():
            shutil.copy2(run / name, tmp / name)
    readme = dest / "README.md"
    if readme.is_file():                              # the training card is written by hand; keep it
        shutil.copy2(readme, tmp / "README.md")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        print("usage: python -m oxygen_ros.train.export RUN DEST", file=sys.stderr)
        sys.exit(2)
    try:
        print(export_checkpoint(sys.argv[1], sys.argv[2]))
    except (OSError, ValueError, KeyError) as exc:
        print(f"export: {exc}", file=sys.stderr)
        sys.exit(2)
