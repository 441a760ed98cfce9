"""The auxiliary target (``oxygen train --target-weight``, ``oxygen_ros/train/target_aux.py``): the labels are the
named cube's resting place while it rests, the loss reaches the action expert and the image tokens, and the head
stays out of the checkpoint the node loads."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from test_train import _trainer, _weights, bags  # noqa: F401 - the module-scoped fixture of recorded reach episodes

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_labels_are_the_named_cubes_resting_place_while_its_cell_holds(bags):  # noqa: F811
    from oxygen_ros.sim.tasks import draw_task, locate_question
    from oxygen_ros.tools.train import robot_layout
    from oxygen_ros.train.data import TopicMap, load_episodes
    from oxygen_ros.train.target_aux import attach_targets, normalise

    eps = load_episodes([str(bags)], TopicMap.from_layout(robot_layout(None)), image_size=16)
    assert attach_targets(eps) == sum(e.num_frames for e in eps)          # reach: the cube never leaves its cell
    for e in eps:
        spec = draw_task(e.meta["task"], int(e.meta["seed"]))
        cube = spec.scene.cubes[spec.target_index]
        np.testing.assert_allclose(e.target[:, :2], np.broadcast_to(normalise((cube.x, cube.y)), (e.num_frames, 2)),
                                   atol=1e-6)
    # the cube moved (its cell changed at frame 3): from there on its resting place is no label
    moved = copy.deepcopy(eps[0])
    q = locate_question(draw_task("reach", int(moved.meta["seed"])).target)
    for f in range(3, moved.num_frames):
        moved.texts[f] = [(k, p, "row 8 column 8" if p == q else t) for k, p, t in moved.texts[f]]
    # no task draw in the episode status (another robot's bag): no label at all
    foreign = copy.deepcopy(eps[1])
    foreign.meta = {"success": True}
    assert attach_targets([moved, foreign]) == 3
    assert moved.target[:3, 2].all() and not moved.target[3:, 2].any()
    assert not foreign.target[:, 2].any()
    # --target-within: only the episode's first seconds
    first = copy.deepcopy(eps[0])
    n_early = int(((first.frame_ns - first.frame_ns[0]) / 1e9 < 0.25).sum())
    assert 0 < n_early < first.num_frames
    assert attach_targets([first], within_s=0.25) == n_early and first.target[:n_early, 2].all()


def test_its_loss_reaches_the_expert_vlm_and_tower_and_only_valid_rows_count(bags, tmp_path):  # noqa: F811
    from oxygen_ros.train.losses import pi05_loss
    from oxygen_ros.train.target_aux import target_loss

    tr = _trainer(bags, tmp_path / "run", steps=1, target_weight=1.0)
    tr.setup()
    items = [(e, 0, 0) for e in tr.train_eps[:2]]
    b = tr.maker.make(items)
    assert b.target_valid.all()
    H, A = tr.cfg.action_horizon, tr.cfg.action_dim
    g = torch.Generator().manual_seed(0)
    noise, t = torch.randn(2, H, A, generator=g), torch.full((2,), 0.5)
    _, _, _, tl, _ = pi05_loss(tr._plain_step, b, noise, t, 0.0, target_weight=1.0)
    pred = tr.target_head(tr.model.forward_train(b.images, b.image_masks, b.tokens, b.token_masks,
                                                 t[:, None, None] * noise + (1 - t[:, None, None]) * b.actions, t,
                                                 return_hidden=True)[2])
    assert float(tl) == pytest.approx(float((pred - b.target).pow(2).sum(-1).mean().detach()), rel=1e-4)
    # gradients of the target loss alone: the head, the action expert, the VLM and the vision tower all get some
    tr.model.zero_grad()
    target_loss(pred, b.target, b.target_valid).backward()
    for name, mod in (("expert", tr.model.expert), ("vlm", tr.model.vlm), ("vision", tr.model.vision)):
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in mod.parameters()), name
    # an invalid row changes nothing; no valid row gives 0 (still connected to the graph)
    valid = torch.tensor([True, False])
    far = b.target.clone()
    far[1] += 100.0
    with torch.no_grad():
        assert float(target_loss(pred, far, valid)) == pytest.approx(float(target_loss(pred[:1], b.target[:1],
                                                                                       valid[:1])))
    none = target_loss(pred, b.target, torch.zeros(2, dtype=torch.bool))
    assert float(none.detach()) == 0.0 and none.requires_grad


def test_a_run_with_it_logs_it_resumes_it_and_its_checkpoint_is_the_plain_model(bags, tmp_path):  # noqa: F811
    from oxygen_ros.model import load_checkpoint

    tr = _trainer(bags, tmp_path / "run", steps=20, target_weight=0.5)
    tr.setup()
    res = tr.train()
    assert all("target" in r and np.isfinite(r["target"]) for r in res["curves"]["train"])
    assert all("target" in r for r in res["curves"]["val"])
    ck = tmp_path / "run" / "checkpoints" / "step_000020"
    assert not any("target" in k for k in _weights(ck))            # the head is a training aid, not the model
    pol = load_checkpoint(ck)
    assert set(pol.model.state_dict()) == set(tr.model.state_dict())
    # resume: the head comes back with the optimiser
    again = _trainer(bags, tmp_path / "run", steps=30, target_weight=0.5, resume=True)
    again.setup()
    for k, v in tr.target_head.state_dict().items():
        torch.testing.assert_close(again.target_head.state_dict()[k], v)
    plain = _trainer(bags, tmp_path / "run", steps=30, resume=True)
    with pytest.raises(ValueError, match="not trained with --target-weight|trained with --target-weight"):
        plain.setup()


def test_bags_without_a_task_draw_and_bad_weights_are_refused(tmp_path, capsys):
    from oxygen_ros.tools.train import main
    from test_train import EPISODES_OLD

    for bad in ("-1", "nan", "inf"):
        with pytest.raises(SystemExit):
            main(["x", "--out", str(tmp_path / "o"), f"--target-weight={bad}"])
        assert "--target-weight must be a finite number >= 0" in capsys.readouterr().err
    for args in (["--target-within", "0.3"], ["--target-weight", "0.1", "--target-within", "0"],
                 ["--target-weight", "0.1", "--target-within", "nan"]):
        with pytest.raises(SystemExit):
            main(["x", "--out", str(tmp_path / "o"), *args])
        assert "--target-within needs --target-weight > 0" in capsys.readouterr().err
    old = _trainer(EPISODES_OLD, tmp_path / "old", steps=1, target_weight=0.1)
    with pytest.raises(ValueError, match="no frame has a named cube with a known place"):
        old.setup()
