"""The committed bag-replay regression data (``test/data/bag_eval/``) and the one command that regenerates it.

``input/`` is a small synthetic recording (``oxygen make-bag`` content: 3 s, three 64x48 cameras at 10 fps, joint
states at 50 Hz, the instruction, two questions) and ``golden_tiny/`` is what ``oxygen bag-eval`` wrote for it with
the shipped ``config/oxygen.yaml`` (tiny preset, random weights, seed 0) plus ``OVERRIDES``.  ``test_bag_eval.py``
re-runs that evaluation and requires ``oxygen bag-diff`` to find no difference beyond ``ATOL``.

Regenerate the golden output only when a change of outputs is intended (a deliberate change of the model's numerics,
processing, engine scheduling, the default parameters or the output messages), never to make a failing test pass
without knowing why; say so in the commit message:

    .venv/bin/python test/bag_golden.py            # rewrite golden_tiny/ with the current code (or: make golden)
    .venv/bin/python test/bag_golden.py --input    # also rewrite input/ (only when the recording itself must change)
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "test" / "data" / "bag_eval"
INPUT = DATA / "input"
GOLDEN = DATA / "golden_tiny"
CONFIG = REPO / "config" / "oxygen.yaml"
# on top of config/oxygen.yaml: the CPU, eager (the shipped `auto` takes a GPU where there is one), short answers that
# finish inside the bag, a memory entry every second
OVERRIDES = ("device:=cpu", "compile:=none", "preset:=tiny", "checkpoint:=''", "seed:=0", "memory_interval_s:=1.0",
             "max_new_tokens:=16")
# Action tolerance (robot units, |a - b| <= ATOL) for the golden comparison.  Reruns on one machine are
# bit-identical; changing the torch thread count (another reduction order, the kind of difference another CPU's
# kernels make) moved actions by at most 4.8e-7 here (200x margin), while deliberate changes moved them by 8.8e-4
# (RMSNorm epsilon 1e-6 -> 1e-4), 8e-2 (denoise_steps 10 -> 5) and 6 (seed 1).
ATOL = 1e-4
START_NS = 1_700_000_000_000_000_000


def make_input(path: Path = INPUT) -> Path:
    from oxygen_ros.tools.bags.replay import make_bag

    return make_bag(path, duration=3.0, fps=10.0, width=64, height=48, question_period=1.5, start_ns=START_NS,
                    overwrite=True)


def eval_args(out: Path, *extra: str) -> list[str]:
    """``oxygen bag-eval`` arguments of the golden run (``extra``: more ``-p`` overrides or options)."""
    args = [str(INPUT), "--params", str(CONFIG), "--out", str(out), "--quiet"]
    for o in OVERRIDES:
        args += ["-p", o]
    return args + list(extra)


def regenerate(with_input: bool = False) -> None:
    from oxygen_ros.tools.bags import eval as bag_eval

    if with_input:
        make_input()
    if bag_eval.main(eval_args(GOLDEN, "--overwrite")) != 0:
        raise SystemExit("bag-eval failed")
    # keep the provenance (parameters, model, counts), drop the machine's timings: they change on every run
    summary_path = GOLDEN / "summary.json"
    s = json.loads(summary_path.read_text())
    s.pop("timing", None)
    s["bag"], s["out"] = str(INPUT.relative_to(REPO)), str(GOLDEN.relative_to(REPO))
    summary_path.write_text(json.dumps(s, indent=2, sort_keys=True) + "\n")
    size = sum(f.stat().st_size for f in DATA.rglob("*") if f.is_file())
    print(f"wrote {GOLDEN} ({s['cycles']} cycles, {s['chunks']} chunks, {s['tokens']} tokens, {s['answers']} answers, "
          f"{s['memory_entries']} memory entries); test/data/bag_eval is {size / 1e6:.2f} MB")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", action="store_true", help="also rewrite the input bag")
    sys.path.insert(0, str(REPO))
    regenerate(p.parse_args().input)
