"""The target on the plan itself (``oxygen train --plan-weight``, ``oxygen_ros/train/plan_target.py``): the arms'
forward kinematics in torch equal MuJoCo's, the loss measures the grip sites of a chunk (zero for the label, centimetres
for a wrong shoulder, nothing for a gripper column), it is zero at the flow's true velocity, and a run with it logs and
validates it."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from test_train import _trainer, bags  # noqa: F401 - the module-scoped fixture of recorded reach episodes

mujoco = pytest.importorskip("mujoco")
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def scene():
    pytest.importorskip("gym_aloha")
    from oxygen_ros.sim.scene import AlohaScene
    s = AlohaScene(camera_size=(8, 8))
    yield s
    s.close()


@pytest.fixture(scope="module")
def fk(scene):
    from oxygen_ros.train.plan_target import ArmKinematics
    return ArmKinematics(scene.model)


@pytest.fixture(scope="module")
def plan(fk):
    from oxygen_ros.model import load_checkpoint
    from oxygen_ros.tools.train import robot_layout
    from oxygen_ros.train.plan_target import PlanTarget
    pol = load_checkpoint("checkpoints/demo")
    return PlanTarget(pol.norm_stats, robot_layout(None).delta_action_mask, fk)


def _random_states(scene, n: int, seed: int = 0) -> np.ndarray:
    """States [n, 14] with every arm joint drawn within its range (grippers: anything)."""
    rng = np.random.default_rng(seed)
    m = scene.model
    out = rng.uniform(0, 1, (n, 14))
    for arm, off in (("left", 0), ("right", 7)):
        for i, d in enumerate(scene.arm_dofs[arm]):
            lo, hi = m.jnt_range[m.dof_jntid[d]]
            out[:, off + i] = lo + (hi - lo) * rng.uniform(0, 1, n)
    return out


def test_forward_kinematics_equals_mujocos_grip_sites(scene, fk):
    m, d = scene.model, mujoco.MjData(scene.model)
    states = _random_states(scene, 25)
    got = fk.grip(torch.from_numpy(states)).numpy()                                  # [25, 2, 3]
    for s, g in zip(states, got):
        for k, (arm, off) in enumerate((("left", 0), ("right", 7))):
            d.qpos[scene.arm_qpos[arm]] = s[off:off + 6]
        mujoco.mj_kinematics(m, d)
        for k, arm in enumerate(("left", "right")):
            np.testing.assert_allclose(g[k], d.site_xpos[scene.grip_site[arm]], atol=1e-9)
    # the sites move: the check above is not of a constant
    assert np.ptp(got[:, 0, 0]) > 0.1 and np.ptp(got[:, 1, 2]) > 0.1


def _chunk(plan, states: torch.Tensor, absolute: torch.Tensor) -> torch.Tensor:
    """Absolute joint targets [B, H, 14] -> the model's normalised output space (delta columns minus the state)."""
    rel = torch.where(plan.delta, absolute - states[:, None, :14], absolute)
    return (rel - plan.q01[:14]) / plan.span[:14] * 2 - 1


def test_the_loss_is_the_grip_sites_distance_and_ignores_the_grippers(scene, plan):
    states = torch.from_numpy(_random_states(scene, 4, seed=1)).float()
    label = states[:, None, :14].repeat(1, 5, 1) + 0.05                              # [4, 5, 14] absolute
    y = _chunk(plan, states, label)
    valid = torch.ones(4, 5, dtype=torch.bool)
    np.testing.assert_allclose(plan.absolute(y, states).numpy(), label.numpy(), atol=1e-5)
    assert float(plan.loss(y, y, states, valid)) < 1e-8
    # the right arm's shoulder 0.1 rad off in every row of sample 0: the loss is that grip site's displacement
    wrong = label.clone()
    wrong[0, :, 7 + 1] += 0.1
    moved = plan.fk.grip(wrong[0].double()) - plan.fk.grip(label[0].double())          # [5, 2, 3]
    assert float(moved[:, 1].norm(dim=-1).min()) > 0.01 and float(moved[:, 0].abs().max()) < 1e-9
    want = float(((moved / plan.scale) ** 2).sum()) / 20
    assert float(plan.loss(_chunk(plan, states, wrong), y, states, valid)) == pytest.approx(want, rel=1e-3)
    # ... counted only on valid rows: the same error on an invalid sample costs nothing
    masked = valid.clone()
    masked[0] = False
    assert float(plan.loss(_chunk(plan, states, wrong), y, states, masked, denom=20.0)) < 1e-8
    # the grippers and the padded columns do not move a grip site: no gradient reaches them
    x = y.clone().requires_grad_(True)
    wide = torch.cat([x, torch.zeros(4, 5, 2)], dim=-1)
    plan.loss(wide + 0.3, torch.cat([y, torch.zeros(4, 5, 2)], dim=-1), states, valid).backward()
    g = x.grad.abs().sum(dim=(0, 1))
    assert float(g[6]) == 0.0 and float(g[13]) == 0.0
    assert all(float(g[c]) > 0 for c in (1, 2, 8, 9))                                # shoulders and elbows


def test_pi05_loss_adds_it_on_the_flows_estimate_of_the_clean_chunk(bags, tmp_path):  # noqa: F811
    from oxygen_ros.train.losses import pi05_loss

    tr = _trainer(bags, tmp_path / "run", steps=1, plan_weight=1.0)
    tr.setup()
    b = tr.maker.make([(e, 0, 0) for e in tr.train_eps[:2]])
    assert b.state is not None and b.state.shape == (2, 14)
    H, A = tr.cfg.action_horizon, tr.cfg.action_dim
    g = torch.Generator().manual_seed(0)
    noise, t = torch.randn(2, H, A, generator=g), torch.full((2,), 0.7)

    def exact(images, image_masks, tokens, token_masks, x_t, time, *rest):             # the true velocity
        return noise - b.actions, None

    total, fm, _, _, pl = pi05_loss(exact, b, noise, t, 0.0, plan=tr.plan, plan_weight=1.0)
    assert float(fm) < 1e-10 and float(pl) < 1e-8
    # the model's own velocity: a plan some centimetres off, added to the total with its weight
    total, fm, _, _, pl = pi05_loss(tr._plain_step, b, noise, t, 0.0, plan=tr.plan, plan_weight=2.0)
    assert float(pl) > 0 and float(total) == pytest.approx(float(fm) + 2.0 * float(pl), rel=1e-5)


def test_a_run_with_it_logs_and_validates_it(bags, tmp_path):  # noqa: F811
    tr = _trainer(bags, tmp_path / "run", steps=10, log_every=5, val_every=10, ckpt_every=10, plan_weight=0.5)
    tr.setup()
    res = tr.train()
    assert [r["step"] for r in res["curves"]["train"]] == [5, 10]
    assert all(np.isfinite(r["plan"]) and r["plan"] > 0 for r in res["curves"]["train"])
    assert all("plan" in v and v["plan"] > 0 for v in res["curves"]["val"])
    plain = _trainer(bags, tmp_path / "plain", steps=1)
    plain.setup()
    assert plain.plan is None and "plan" not in plain.validate()


def test_bad_weights_are_refused(tmp_path, capsys):
    from oxygen_ros.tools.train import main

    for bad in ("-1", "nan", "inf"):
        with pytest.raises(SystemExit):
            main(["x", "--out", str(tmp_path / "o"), f"--plan-weight={bad}"])
        assert "--plan-weight must be a finite number >= 0" in capsys.readouterr().err
