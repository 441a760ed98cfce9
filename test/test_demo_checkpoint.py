"""The shipped demo checkpoint (``checkpoints/demo``) in closed loop: it loads through the node's loader
(``checkpoint: demo``), drives the simulated ALOHA through the node's own action path (``ros/lockstep.py``: pipeline,
chunk buffer, trajectory, executor) and answers scene questions in the same frames' shared prefix.

Fixed, unseen seeds (training used seeds >= 100000, ``checkpoints/demo/README.md``), lockstep and one torch thread, so
the run is deterministic: >= 2 of 3 ``reach`` episodes succeed and the first 5 scene questions asked are answered
exactly (the ground truth is computed from the simulator's state at the frame the question was asked on)."""
from __future__ import annotations

import json

import pytest

import oxygen_ros.sim  # noqa: F401 - sets MUJOCO_GL=egl before mujoco is imported

pytest.importorskip("mujoco", reason="the simulation needs mujoco (requirements.txt)")
pytest.importorskip("gym_aloha", reason="the simulation needs gym-aloha (requirements.txt)")

from oxygen_ros.ros.engine_factory import resolve_checkpoint  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SEEDS = "0:3"           # unseen: training data uses seeds 100000 and up


def test_the_shipped_checkpoint_is_complete_and_small():
    from pathlib import Path
    d = Path(resolve_checkpoint("demo"))
    names = {p.name for p in d.iterdir()}
    assert {"model.safetensors", "config.json", "paligemma_tokenizer.model", "assets", "README.md"} <= names, names
    assert list(d.glob("assets/*/norm_stats.json")), "no norm stats (openpi layout: assets/<id>/norm_stats.json)"
    size = sum(p.stat().st_size for p in d.rglob("*") if p.is_file())
    assert size <= 25 * 2 ** 20, f"checkpoints/demo is {size / 2 ** 20:.1f} MB (issue 19: <= 25 MB)"


def test_the_shipped_policy_reaches_and_answers_in_closed_loop(tmp_path):
    from oxygen_ros.tools import sim_eval
    out = tmp_path / "eval"
    rc = sim_eval.main(["--policy", "demo", "--task", "reach", "--seeds", SEEDS, "--language", "q1",
                        "--no-video", "--quiet", "--out", str(out)])
    assert rc == 0
    doc = json.loads((out / "results.json").read_text())
    eps = doc["episodes"]
    assert len(eps) == 3 and not any(e.get("error") for e in eps), [e.get("error") for e in eps]
    wins = [e["seed"] for e in eps if e["success"]]
    assert len(wins) >= 2, f"reach succeeded on seeds {wins} of {[e['seed'] for e in eps]}"
    answers = [a for e in sorted(eps, key=lambda e: e["seed"]) for a in sorted(e["answers"],
                                                                               key=lambda a: a["frame_t"])]
    assert len(answers) >= 5, f"only {len(answers)} questions were answered"
    wrong = [(a["q"], a["a"], a["gt"]) for a in answers[:5] if not a["ok"]]
    assert not wrong, f"wrong answers (question, answer, truth): {wrong}"
