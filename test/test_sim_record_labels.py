"""The recorder's labels, what DART-style noise and DAgger rest on (``oxygen sim-record``, ``tools/sim/record.py``):
every recorded frame carries ``action_label``, the clean expert's chunk from that frame's state, whatever drives the
robot.  With ``--noise`` the robot strays and the label stays the expert's (frame 0's label is the same bit for bit
with and without noise, the executed commands differ); with a trained policy driving (DAgger) its failed episode is
kept, every frame is labelled by the expert, the executed commands are the policy's, and ``oxygen train``'s loader
reads the episode and trains on the labels, not on what was executed.  Real recordings, 16 px cameras for the expert,
the shipped policy's 96 px for DAgger."""
from __future__ import annotations

import json

import numpy as np
import pytest

import oxygen_ros.sim  # noqa: F401 - sets MUJOCO_GL=egl before mujoco is imported

pytest.importorskip("mujoco", reason="the simulation needs mujoco (requirements.txt)")

from oxygen_ros.sim.scene import CONTROL_DT  # noqa: E402
from oxygen_ros.tools.sim.record import main as record  # noqa: E402

H = 20


def _load(out, only_success=True):
    from oxygen_ros.ros.lockstep import default_sim_params
    from oxygen_ros.tools.train import robot_layout
    from oxygen_ros.train.data import TopicMap, load_episodes
    return load_episodes([out], TopicMap.from_layout(robot_layout(default_sim_params())), only_success=only_success)


def _executed_at_frames(e) -> np.ndarray:
    """The command executed in the control step that starts at each frame's time: [F, A]."""
    idx = np.searchsorted(e.action_ns, e.frame_ns, side="left")
    return e.actions[np.minimum(idx, len(e.actions) - 1)]


@pytest.fixture(scope="module")
def expert_bags(tmp_path_factory):
    d = tmp_path_factory.mktemp("rec")
    for name, noise in (("clean", "0"), ("noisy", "0.08")):
        assert record(["--out", str(d / name), "--task", "pick", "--seeds", "3:4", "--camera-size", "16",
                       "--noise", noise, "--keep-failed", "--quiet"]) == 0
    return {name: _load(d / name, only_success=False)[0] for name in ("clean", "noisy")}


def test_every_frame_carries_the_experts_chunk_as_its_label(expert_bags):
    for name, e in expert_bags.items():
        assert e.labels is not None and e.labels.shape[1:] == (H, 14), name
        assert (e.label_rows == H).all(), name                             # every frame labelled, H rows
        assert np.isfinite(e.labels).all()
        chunk, valid = e.action_chunk(5, H)                                # training reads the label ...
        assert valid.all() and np.array_equal(chunk, e.labels[5])         # ... not the executed actions


def test_noise_moves_the_robot_and_leaves_the_label_the_experts(expert_bags):
    clean, noisy = expert_bags["clean"], expert_bags["noisy"]
    assert np.array_equal(clean.labels[0], noisy.labels[0])               # same state at frame 0 -> same label
    n = min(clean.num_frames, noisy.num_frames)
    ex_c, ex_n = _executed_at_frames(clean)[:n], _executed_at_frames(noisy)[:n]
    assert np.abs(ex_n - ex_c)[1:, :].max() > 0.02                        # the noisy robot went elsewhere
    assert np.abs(noisy.state[1:n] - clean.state[1:n]).max() > 0.01       # and so its states differ
    # the noisy episode's labels correct toward the expert's plan: they differ from what the noisy robot executed
    lab_n = noisy.labels[:n, 0]
    assert np.abs(lab_n - ex_n)[1:].mean() > np.abs(clean.labels[:n, 0] - ex_c)[1:].mean()


def test_a_trained_policy_drives_its_failures_are_kept_and_the_expert_labels_them(tmp_path):
    """DAgger's recording: the shipped policy drives (its own states), the episode is kept even when it fails, the
    loader reads it for training (labelled failures are data), and the labels are the expert's, not the policy's."""
    out = tmp_path / "dagger"
    assert record(["--out", str(out), "--policy", "demo", "--task", "pick", "--seeds", "0:1", "--quiet"]) == 0
    summary = json.loads((out / "episodes.json").read_text())
    assert summary["recorded"] == 1
    eps = _load(out)                                                      # only_success=True, as training loads
    assert len(eps) == 1, "a labelled failed episode is training data"
    e = eps[0]
    # the shipped policy picks 1-2 % of unseen seeds; seed 0 fails (lockstep is deterministic) - a kept failure
    assert e.meta["seed"] == 0 and e.meta["success"] is False and e.images.shape[2:] == (96, 96, 3)
    assert (e.label_rows == H).all()
    ex = _executed_at_frames(e)
    assert np.abs(e.labels[1:, 0] - ex[1:]).mean() > 1e-3                 # the policy's commands, not the labels
    assert len(e.actions) == pytest.approx(summary["episodes"][0]["frames"] * 5, abs=5)   # 50 Hz under 10 Hz frames
    assert CONTROL_DT == pytest.approx(0.02)


def test_noise_is_refused_for_a_trained_policy(tmp_path, capsys):
    with pytest.raises(SystemExit) as ex:
        record(["--out", str(tmp_path / "x"), "--policy", "demo", "--noise", "0.1", "--task", "reach",
                "--seeds", "0:1", "--quiet"])
    assert ex.value.code == 2 and "--noise" in capsys.readouterr().err
    assert not (tmp_path / "x").exists() and not (tmp_path / "x.partial").exists()
