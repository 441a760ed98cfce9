"""``train/export.py``: a training run's latest checkpoint -> a deployable policy folder (how ``checkpoints/demo`` is
made).  From a real 2-step ``oxygen train`` run (tiny preset): the folder holds exactly what the node loads plus the
run's summary (no optimiser moments), loads to the same weights as the run's checkpoint, keeps
the hand-written card on re-export, and a run that cannot be exported (no ``latest``, a checkpoint without weights or
state) leaves an existing policy as it was, with no half-built folder beside it."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from oxygen_ros.train.export import export_checkpoint

EPISODES = Path(__file__).resolve().parent / "data" / "episode_bag"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    pytest.importorskip("mujoco")
    from oxygen_ros.tools.train import main
    out = tmp_path_factory.mktemp("export") / "run"
    assert main([str(EPISODES), "--out", str(out), "--device", "cpu", "--preset", "tiny", "--steps", "2",
                 "--batch-size", "4", "--warmup", "1", "--val-fraction", "0", "--ckpt-every", "2",
                 "--vocab-size", "640", "--threads", "1", "--quiet"]) == 0
    return out


def _ck(run: Path) -> Path:
    return run / (run / "latest").read_text().strip()


def test_the_policy_folder_is_what_the_node_loads_and_the_runs_summary(run, tmp_path):
    dest = export_checkpoint(run, tmp_path / "policy")
    names = {p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file()}
    assert {"model.safetensors", "config.json", "training.json", "curves.json"} <= names
    assert any(n.startswith("assets/") and n.endswith("norm_stats.json") for n in names)
    assert not any(n.startswith("train_state") for n in names)            # no optimiser moments
    summary = json.loads((dest / "training.json").read_text())
    assert summary["step"] == 2 and summary["options"]["steps"] == 2
    assert summary["source"] == str(_ck(run))
    assert not (tmp_path / "policy.tmp").exists()

    from safetensors.torch import load_file
    a, b = load_file(str(_ck(run) / "model.safetensors")), load_file(str(dest / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    from oxygen_ros.model.checkpoint import load_checkpoint
    sd = load_checkpoint(dest).model.state_dict()                         # what the node's `checkpoint` reads
    assert a.keys() <= sd.keys() and all(torch.equal(sd[k], a[k]) for k in a)


def test_re_export_keeps_the_hand_written_card(run, tmp_path):
    dest = export_checkpoint(run, tmp_path / "policy")
    (dest / "README.md").write_text("# the training card\n")
    (dest / "stale.bin").write_bytes(b"x")                                # a file of the old policy
    export_checkpoint(run, dest)
    assert (dest / "README.md").read_text() == "# the training card\n"
    assert not (dest / "stale.bin").exists()


@pytest.mark.parametrize("damage", ["no latest", "no weights", "no state"])
def test_a_run_that_cannot_be_exported_leaves_the_policy_there_as_it_was(run, tmp_path, damage):
    import shutil
    broken = tmp_path / "broken"
    shutil.copytree(run, broken)
    if damage == "no latest":
        (broken / "latest").unlink()
    else:
        (_ck(broken) / ("model.safetensors" if damage == "no weights" else "train_state.json")).unlink()
    dest = export_checkpoint(run, tmp_path / "policy")
    before = {p.name: p.read_bytes() for p in dest.iterdir() if p.is_file()}
    with pytest.raises(FileNotFoundError) as e:
        export_checkpoint(broken, dest)
    assert ("latest" if damage == "no latest" else "nothing exported") in str(e.value)
    assert {p.name: p.read_bytes() for p in dest.iterdir() if p.is_file()} == before
    assert not (tmp_path / "policy.tmp").exists()
    r = subprocess.run([sys.executable, "-m", "oxygen_ros.train.export", str(broken), str(dest)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("export: ") and "Traceback" not in r.stderr
