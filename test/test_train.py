"""``oxygen train`` (``oxygen_ros/train``): the flow-matching and text losses on hand-computed cases, the training
forward's attention equal to the engine's inference path (actions from ``prefill`` + ``velocity``, text logits from
``prefill_images`` + ``extend_prefix``), the segments' isolation (the prefix-LM mask), a smoke run on real episode
bags (``oxygen sim-record``) whose loss falls and whose checkpoint the node's loader serves with the same actions,
resume = an uninterrupted run, 2-process DDP (torchrun, gloo) = one process on the same global batch, and the errors
bad data gives before training starts."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import oxygen_ros.sim  # noqa: F401 - MUJOCO_GL before mujoco

from oxygen_ros.model import build_model, get_config
from oxygen_ros.train.losses import flow_matching_loss, sample_time, text_loss

pytestmark = pytest.mark.usefixtures("one_torch_thread")
REPO = Path(__file__).resolve().parents[1]
# the committed one-episode bag, recorded before the "Where is the X cube?" text targets existed
EPISODES_OLD = REPO / "test" / "data" / "episode_bag"
# a small model over the sim's 16 px cameras: what the smoke / resume / DDP runs train
SMALL = {"vision": {"image_size": 16, "patch_size": 8, "width": 32, "depth": 1, "num_heads": 2, "mlp_dim": 64},
         "vlm": {"width": 32, "depth": 2, "mlp_dim": 64, "num_heads": 2, "head_dim": 16},
         "expert": {"width": 32, "depth": 2, "mlp_dim": 64, "num_heads": 2, "head_dim": 16},
         "action_horizon": 8, "max_token_len": 40}


# ---------------------------------------------------------------------------------------------------- losses
def test_flow_matching_loss_on_a_hand_computed_case():
    actions = torch.tensor([[[1.0, 2.0], [3.0, 4.0]]])
    noise = torch.tensor([[[0.0, 1.0], [1.0, 1.0]]])
    v = torch.tensor([[[-1.0, -1.0], [0.0, 0.0]]])          # u = noise - actions = [[-1,-1],[-2,-3]]
    valid = torch.tensor([[True, True]])
    # row 0: ((0)^2 + (0)^2) / 2 = 0; row 1: ((2)^2 + (3)^2) / 2 = 6.5 -> mean 3.25
    assert flow_matching_loss(v, actions, noise, valid).item() == pytest.approx(3.25)
    assert flow_matching_loss(v, actions, noise, torch.tensor([[True, False]])).item() == pytest.approx(0.0)


def test_time_follows_openpis_beta_distribution():
    t = sample_time(200_000, torch.Generator().manual_seed(0))
    assert float(t.min()) >= 0.001 and float(t.max()) <= 1.0
    assert float(t.mean()) == pytest.approx(0.6 * 0.999 + 0.001, abs=3e-3)      # E[Beta(1.5, 1)] = 0.6
    assert float((t < 0.5).float().mean()) == pytest.approx((0.499 / 0.999) ** 1.5, abs=3e-3)   # CDF x^1.5


def test_text_loss_counts_only_the_answer_and_eos():
    V = 5
    logits = torch.zeros(1, 4, V)
    logits[0, 1, 3] = 10.0                                   # position 1 predicts token 3 (the answer) well
    text = torch.tensor([[2, 4, 3, 1]])                      # BOS, prompt, answer, EOS
    targets = torch.tensor([[False, True, True, False]])     # predict text[2] from 1 and text[3] from 2
    ce = text_loss(logits, text, targets).item()
    expect = (-torch.log_softmax(logits[0, 1], -1)[3] - torch.log_softmax(logits[0, 2], -1)[1]).item() / 2
    assert ce == pytest.approx(expect)


# ---------------------------------------------------------------------------------------------------- attention
@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    m = build_model(get_config("tiny"))
    from model_fixtures import randomize_parameters
    randomize_parameters(m, seed=3)
    return m


def _inputs(cfg, seed=0):
    g = torch.Generator().manual_seed(seed)
    B, C, S = 2, 3, cfg.image_size
    images = torch.randn(B, C, 3, S, S, generator=g)
    imask = torch.tensor([[1, 0, 1], [1, 1, 1]]).bool()
    tok = torch.randint(3, 200, (B, 12), generator=g)
    tmask = torch.ones(B, 12, dtype=torch.bool)
    tmask[0, 9:] = False
    txt = torch.randint(3, 200, (B, 10), generator=g)
    xmask = torch.ones(B, 10, dtype=torch.bool)
    xmask[1, 7:] = False
    x = torch.randn(B, cfg.action_horizon, cfg.action_dim, generator=g)
    t = torch.rand(B, generator=g)
    return images, imask, tok, tmask, txt, xmask, x, t


@torch.no_grad()
def test_training_forward_is_the_engines_inference_attention(tiny):
    m = tiny
    images, imask, tok, tmask, txt, xmask, x, t = _inputs(m.cfg)
    v, logits = m.forward_train(images, imask, tok, tmask, x, t, txt, xmask)
    # actions: the prefix of prefill (images + action prompt), S Euler steps' velocity
    assert torch.allclose(v, m.velocity(m.prefill(images, imask, tok, tmask), x, t), atol=1e-5)
    # text: image prefix shared, the prompt + answer extended on it (how the engine admits a language request)
    img = m.prefill_images(images, imask)
    for j in range(1, txt.shape[1] + 1):
        e = m.extend_prefix(img, txt[:, :j], xmask[:, :j], want_logits=True)
        for b in range(2):
            if xmask[b, j - 1]:
                assert torch.allclose(e.last_logits[b], logits[b, j - 1], atol=1e-4), (b, j)


@torch.no_grad()
def test_prefix_lm_mask_isolates_the_segments(tiny):
    m = tiny
    images, imask, tok, tmask, txt, xmask, x, t = _inputs(m.cfg)
    v, lg = m.forward_train(images, imask, tok, tmask, x, t, txt, xmask)
    v_no_text, _ = m.forward_train(images, imask, tok, tmask, x, t)
    assert torch.allclose(v, v_no_text, atol=1e-6)                      # actions never see the text
    tok2 = tok.clone()
    tok2[:, 1:5] = (tok2[:, 1:5] + 7) % 200 + 3
    v2, lg2 = m.forward_train(images, imask, tok2, tmask, x, t, txt, xmask)
    assert torch.allclose(lg, lg2, atol=1e-6)                            # text never sees the action prompt
    assert not torch.allclose(v, v2, atol=1e-4)                          # actions do see it
    txt2 = txt.clone()
    txt2[:, 6] = (txt2[:, 6] + 11) % 200 + 3
    _, lg3 = m.forward_train(images, imask, tok, tmask, x, t, txt2, xmask)
    assert torch.allclose(lg[:, :6], lg3[:, :6], atol=1e-6)              # causal: earlier positions unchanged
    assert not torch.allclose(lg[0, 6:9], lg3[0, 6:9], atol=1e-4)


# ---------------------------------------------------------------------------------------------------- runs
@pytest.fixture(scope="module")
def bags(tmp_path_factory):
    pytest.importorskip("mujoco")
    from oxygen_ros.tools.sim.record import main as record
    d = tmp_path_factory.mktemp("bags")
    assert record(["--out", str(d / "reach"), "--task", "reach", "--seeds", "0:3", "--camera-size", "16",
                   "--camera-rate", "10", "--quiet"]) == 0
    return d / "reach"


def _options(bags, out, **kw):
    from oxygen_ros.train.trainer import TrainOptions
    base = dict(bags=[str(bags)], out=str(out), preset="tiny", steps=40, batch_size=8, lr=1e-3, warmup=5,
                val_fraction=0.34, val_every=20, ckpt_every=20, log_every=10, vocab_size=640, seed=1, quiet=True,
                model_overrides=SMALL)
    base.update(kw)
    return TrainOptions(**base)


def _trainer(bags, out, **kw):
    """A Trainer on ``_options``, with the robot layout ``oxygen train`` reads (config/sim_aloha.yaml)."""
    from oxygen_ros.tools.train import robot_layout
    from oxygen_ros.train.trainer import Trainer
    o = _options(bags, out, **kw)
    return Trainer(o, robot_layout(o.params))


def _weights(path) -> dict:
    from safetensors.torch import load_file
    return load_file(str(Path(path) / "model.safetensors"))


def test_training_smoke_loss_falls_and_the_node_serves_the_checkpoint(bags, tmp_path):
    tr = _trainer(bags, tmp_path / "run", steps=60)
    tr.setup()
    before = tr.validate()
    res = tr.train()
    after = tr.validate()
    assert res["step"] == 60
    assert after["fm"] < 0.8 * before["fm"] and after["ce"] < 0.8 * before["ce"], (before, after)
    ck = Path(res["latest"])
    assert {"model.safetensors", "config.json", "paligemma_tokenizer.model", "train_state.json"} <= \
        {p.name for p in ck.iterdir()}
    assert (ck / "assets" / "sim_aloha" / "norm_stats.json").is_file()
    curves = json.loads((tmp_path / "run" / "curves.json").read_text())
    assert len(curves["train"]) == 6 and len(curves["val"]) == 3
    assert (tmp_path / "run" / "curves.png").is_file()
    # the node's own loader (engine_factory, as `checkpoint:=...` does) gives the in-memory model's actions
    from oxygen_ros.ros.engine_factory import build_engine
    from oxygen_ros.ros.lockstep import sim_settings
    built = build_engine(sim_settings(None, {"checkpoint": str(ck), "device": "cpu"}), on_actions=lambda r: None,
                         on_token=lambda e: None, on_finished=lambda r: None)
    loaded, proc = built.engine.model, built.engine.processor
    ep = tr.train_eps[0]
    from oxygen_ros.model.processing import Observation
    obs = Observation(images=list(ep.images[3]), state=ep.state[3], prompt=ep.instruction[3])
    tr.model.eval()
    with torch.no_grad():
        outs = []
        for model in (tr.model, loaded):
            mi = proc.prepare(obs)
            pre = model.prefill(mi.images, mi.image_masks, mi.tokens, mi.token_masks)
            noise = torch.randn(1, model.cfg.action_horizon, model.cfg.action_dim, generator=torch.Generator().manual_seed(5))
            outs.append(model.sample_actions(pre, noise))
    assert torch.allclose(outs[0], outs[1], atol=1e-5)
    assert built.action_dims == 14 and built.horizon == SMALL["action_horizon"]


def test_device_auto_is_the_cpu_without_a_gpu_and_ddp_uses_nccl_only_for_cuda_tensors(monkeypatch):
    from oxygen_ros.train.device import ddp_backend, resolve_device
    assert resolve_device("cpu") == torch.device("cpu")
    assert ddp_backend(torch.device("cpu")) == "gloo"
    assert ddp_backend(torch.device("cuda", 0)) == "nccl"
    with pytest.raises(ValueError, match="cpu or cuda"):
        resolve_device("meta")
    if torch.cuda.is_available():
        monkeypatch.setenv("LOCAL_RANK", "0")
        assert resolve_device("auto") == torch.device("cuda", 0) == resolve_device("cuda")
    else:
        assert resolve_device("auto") == torch.device("cpu")
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device("cuda")
    with monkeypatch.context() as m:                      # no GPU: auto falls back to the CPU, cuda is refused
        m.setattr(torch.cuda, "is_available", lambda: False)
        assert resolve_device("auto") == torch.device("cpu")
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device("cuda:0")
    with monkeypatch.context() as m:                      # a GPU: auto picks this rank's (as torchrun sets it)
        m.setattr(torch.cuda, "is_available", lambda: True)
        m.setenv("LOCAL_RANK", "1")
        assert resolve_device("auto") == torch.device("cuda", 1)
        assert resolve_device("cuda:0") == torch.device("cuda", 0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the CPU path is tested everywhere)")
def test_training_on_cuda_follows_the_cpu_run(bags, tmp_path):
    """Same data, seed and steps on the GPU and on the CPU: the model and every batch on the device, the same
    host-drawn noise, so the losses agree to float tolerance."""
    runs = {}
    for dev in ("cpu", "cuda"):
        tr = _trainer(bags, tmp_path / dev, steps=5, device=dev, val_every=100, ckpt_every=5)
        tr.setup()
        assert next(tr.model.parameters()).device.type == dev
        runs[dev] = [r["loss"] for r in tr.train()["curves"]["train"]]
    assert np.allclose(runs["cpu"], runs["cuda"], rtol=1e-3, atol=1e-4), runs


def test_resume_equals_an_uninterrupted_run(bags, tmp_path):
    full = _trainer(bags, tmp_path / "full", steps=8, ckpt_every=4, val_every=100)
    full.setup()
    full.train()
    part = _trainer(bags, tmp_path / "part", steps=8, ckpt_every=4, val_every=100)
    part.setup()
    part.train(until=4)                                       # interrupted after the step-4 checkpoint
    resumed = _trainer(bags, tmp_path / "part", steps=8, ckpt_every=4, val_every=100, resume=True)
    resumed.setup()
    assert resumed.step == 4
    resumed.train()
    a, b = _weights(tmp_path / "full/checkpoints/step_000008"), _weights(tmp_path / "part/checkpoints/step_000008")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_ctrl_c_finishes_the_step_and_its_handler_takes_no_lock(bags, tmp_path):
    """Ctrl-C during training: the handler only sets the flag (audited as the interpreter would run it, here from
    inside a log line, where a print of its own would raise "reentrant call" out of the step).  The run stops after
    that step and says so.  A second Ctrl-C raises KeyboardInterrupt at once (caught by the audit here)."""
    import signal
    from handler_audit import blocking_calls
    lines, audits = [], []

    def log(s):
        lines.append(s)
        if s.startswith("step ") and not audits:                 # the first log line: inside the training loop
            handler, n = signal.getsignal(signal.SIGINT), len(lines)
            audits.append(blocking_calls(handler, signal.SIGINT))
            audits.append(blocking_calls(handler, signal.SIGINT, raises=KeyboardInterrupt))
            audits.append(lines[n:])                                # nothing logged from the handler
    from oxygen_ros.tools.train import robot_layout
    from oxygen_ros.train.trainer import Trainer
    o = _options(bags, tmp_path / "run", steps=6, ckpt_every=2, log_every=1, val_every=100, quiet=False)
    tr = Trainer(o, robot_layout(o.params), log=log)
    tr.setup()
    old = signal.getsignal(signal.SIGINT)
    out = tr.train()
    assert audits == [[], [], []], audits
    assert out["step"] == 1 and tr.step == 1, out["step"]
    assert any("interrupted: stopped after step 1" in s for s in lines), lines
    assert signal.getsignal(signal.SIGINT) is old                # the training's handler is removed again


@pytest.mark.parametrize("extra", [[], ["--target-weight", "0.5", "--target-within", "0.3"]], ids=["plain", "target"])
def test_two_process_ddp_matches_one_process(bags, tmp_path, extra):
    """With the auxiliary target too (on the first 0.3 s only, so the ranks' halves hold different numbers of valid
    targets): its loss is averaged over the valid frames of the *global* batch (the ranks' counts summed,
    ``loss_counts``), not per rank - a per-rank mean differs by 7e-4 here (checked) - and the head's gradients are
    averaged with the model's."""
    args = [str(bags), "--preset", "tiny", "--steps", "3", "--batch-size", "8", "--lr", "1e-3", "--warmup", "1",
            "--vocab-size", "640", "--seed", "2", "--val-fraction", "0.34", "--ckpt-every", "3", "--quiet",
            "--threads", "1", *extra]
    code = ("import sys, json; from oxygen_ros.tools import train; from oxygen_ros.train import trainer as t; "
            f"t.TrainOptions.__dataclass_fields__['model_overrides'].default_factory = lambda: {SMALL!r}; "
            "sys.exit(train.main(sys.argv[1:]))")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    one = subprocess.run([sys.executable, "-c", code, *args, "--out", str(tmp_path / "one")], env=env,
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert one.returncode == 0, one.stderr[-2000:]
    script = tmp_path / "run_train.py"
    script.write_text(code.replace("sys.argv[1:]", "sys.argv[1:]") + "\n")
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
                          str(script), *args, "--out", str(tmp_path / "two")], env=env, capture_output=True,
                         text=True, timeout=300, cwd=REPO)
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = _weights(tmp_path / "one/checkpoints/step_000003"), _weights(tmp_path / "two/checkpoints/step_000003")
    worst = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
    assert worst < 1e-5, f"DDP differs from one process by {worst}"
    assert math.isfinite(worst)


# ---------------------------------------------------------------------------------------------------- bad data
def _write_bag(path, *, nan_state=False, action_dim=14, with_actions=True, success=True):
    from oxygen_ros.sim.scene import JOINTS
    from oxygen_ros.tools.sim.record import EpisodeBagWriter
    path.mkdir(parents=True)
    w = EpisodeBagWriter(path / "b")
    ns = 1_000_000_000_000
    w.status(ns, episode_id=1, seed=0, task="reach", instruction="x", elapsed=0.0, done=False, success=False,
             detail="running")
    w.string("instruction", ns, "touch the red cube with the left gripper")
    for k in range(10):
        t = ns + k * 20_000_000
        if k % 5 == 0:
            for slot in ("base", "left_wrist", "right_wrist"):
                w.image(slot, t, np.zeros((16, 16, 3), np.uint8))
        st = np.zeros(14)
        if nan_state and k == 3:
            st[2] = np.nan
        w.joints("joint_states", t, JOINTS, st)
        if with_actions:
            w.joints("executed_action", t, JOINTS[:action_dim], np.zeros(action_dim))
    w.status(ns + 200_000_000, episode_id=1, seed=0, task="reach", instruction="x", elapsed=0.2, done=True,
             success=success, detail="success")
    w.close()
    return path / "b"


@pytest.mark.parametrize("kind,match", [
    ("no_actions", r"/executed_action.*not in the bag"),
    ("nan_state", r"/joint_states position.*NaN"),
    ("short_actions", r"/executed_action position: joint name\(s\) \['right_arm_waist'"),
    ("failed_only", r"no usable episode"),
    ("not_a_bag", r"no rosbag2 bag there"),
])
def test_bad_data_fails_before_training_naming_the_bag_topic_and_field(tmp_path, kind, match):
    if kind == "not_a_bag":
        bag = tmp_path / "nothing"
        bag.mkdir()
        (bag / "file.txt").write_text("x")
        bag = bag / "file.txt"
    else:
        bag = _write_bag(tmp_path / "d", nan_state=kind == "nan_state", with_actions=kind != "no_actions",
                         action_dim=7 if kind == "short_actions" else 14, success=kind != "failed_only")
    tr = _trainer(bag, tmp_path / "run")
    with pytest.raises(ValueError, match=match):
        tr.setup()
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_parameter_file_the_node_refuses_is_refused_before_any_data(tmp_path, capsys):
    """``oxygen train`` reads the robot layout with the node's own validation: a delta_action_mask longer than the
    action joints exits 2 naming both (not a traceback), before any bag is read."""
    from oxygen_ros.tools import train
    bad = tmp_path / "bad.yaml"
    bad.write_text("/**:\n  ros__parameters:\n    state_joint_names: [a, b]\n    action_joint_names: [a, b]\n"
                   "    delta_action_mask: [1, 1, 1]\n")
    assert train.main([str(tmp_path / "no_bag"), "--out", str(tmp_path / "run"), "--params", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "delta_action_mask has 3 entries" in err and "action_joint_names has 2" in err
    assert not (tmp_path / "run").exists()


def test_init_from_another_architecture_is_refused(bags, tmp_path):
    from oxygen_ros.model import save_checkpoint
    other = build_model(get_config("tiny"))
    save_checkpoint(other, tmp_path / "ck")
    tr = _trainer(bags, tmp_path / "run", preset="demo", init=str(tmp_path / "ck"))
    with pytest.raises(ValueError, match="architecture"):
        tr.setup()


def test_init_with_another_horizon_fine_tunes_a_longer_plan(bags, tmp_path):
    """``--init CK --horizon H2``: the checkpoint's weights (none depends on H) plan H2 rows; the norm stats are
    recomputed over H2-row chunks (the init's describe H-row deltas); the saved checkpoint is an H2 policy the node
    serves.  Without ``--horizon`` the init's own H is kept."""
    from oxygen_ros.model import load_checkpoint
    H = SMALL["action_horizon"]
    first = _trainer(bags, tmp_path / "r1", steps=4, ckpt_every=4, val_every=4)
    first.setup()
    ck = Path(first.train()["latest"])
    same = _trainer(bags, tmp_path / "r2", steps=1, init=str(ck), preset=None)
    same.setup()
    assert same.cfg.action_horizon == H
    assert same.norm_stats.to_dict() == first.norm_stats.to_dict()
    longer = _trainer(bags, tmp_path / "r3", steps=2, ckpt_every=2, val_every=2, init=str(ck), preset=None,
                      horizon=3 * H)
    longer.setup()
    assert longer.cfg.action_horizon == 3 * H
    for k, v in first.model.state_dict().items():                      # the same weights, another plan length
        assert torch.equal(v, longer.model.state_dict()[k].to(v.device)), k
    from oxygen_ros.train.data import norm_stats
    assert longer.norm_stats.to_dict() == norm_stats(longer.train_eps, 3 * H, longer.delta_mask)
    arm = np.flatnonzero(longer.delta_mask)
    q99 = lambda tr: np.asarray(tr.norm_stats.to_dict()["norm_stats"]["actions"]["q99"])[arm]   # noqa: E731
    assert q99(longer).max() > 1.2 * q99(first).max()                  # the arm moves farther in 3H rows
    out = Path(longer.train()["latest"])
    pol = load_checkpoint(out)
    assert pol.cfg.action_horizon == 3 * H
    assert json.loads((out / "config.json").read_text())["action_horizon"] == 3 * H


def test_resume_with_another_horizon_is_refused_and_with_its_own_resumes(bags, tmp_path):
    """``--resume --horizon H2`` on a run that plans H rows is refused before any step (it used to be ignored
    silently: the run went on at H); the run's own horizon resumes."""
    H = SMALL["action_horizon"]
    first = _trainer(bags, tmp_path / "run", steps=4, ckpt_every=2, val_every=100)
    first.setup()
    first.train(until=2)
    other = _trainer(bags, tmp_path / "run", steps=4, ckpt_every=2, val_every=100, resume=True, horizon=2 * H)
    with pytest.raises(ValueError, match=f"plans {H} rows, not --horizon {2 * H}"):
        other.setup()
    same = _trainer(bags, tmp_path / "run", steps=4, ckpt_every=2, val_every=100, resume=True, horizon=H)
    same.setup()
    assert same.step == 2 and same.cfg.action_horizon == H


def test_locate_in_instruction_writes_each_frames_cell_and_refuses_bags_without_it(bags, tmp_path):
    """``--locate-in-instruction`` (issue 26's localisation experiment): every frame's action prompt carries the
    named cube's cell from that frame's own text target; a bag without such targets fails before training."""
    import re

    from oxygen_ros.sim.tasks import locate_question, named_colour
    tr = _trainer(bags, tmp_path / "run", steps=1, locate_in_instruction=True)
    tr.setup()
    eps = tr.train_eps + tr.val_eps
    for ep in eps:
        for f, instr in enumerate(ep.instruction):
            cell = dict((p, t) for _k, p, t in ep.texts[f])[locate_question(named_colour(instr))]
            assert re.fullmatch(r"touch the \w+ cube with the (left|right) gripper \(row \d column \d\)", instr)
            assert instr.endswith(f"({cell})"), (instr, cell)
    old = _trainer(EPISODES_OLD, tmp_path / "old", steps=1, locate_in_instruction=True)
    with pytest.raises(ValueError, match="no frame has a 'Where is the <named> cube"):
        old.setup()


def test_state_noise_changes_only_the_prompts_state_on_the_arm_joints(bags, tmp_path):
    """``--state-noise`` (issue 26's copycat experiment): the action prompt's state tokens change, the action targets
    (relative to the true state) and the images do not; with no delta-action (arm) joint nothing is noised; it is
    drawn from the batch's generator (the same seed, the same batch)."""
    tr = _trainer(bags, tmp_path / "run", steps=1)
    tr.setup()
    items = [(ep, f, 0) for ep in tr.train_eps for f in range(0, ep.num_frames, 7)][:6]
    gen = lambda: torch.Generator().manual_seed(3)                                  # noqa: E731
    clean = tr.maker.make(items, gen())
    noisy = tr.maker.make(items, gen(), state_noise=0.3)
    again = tr.maker.make(items, gen(), state_noise=0.3)
    assert not torch.equal(clean.tokens, noisy.tokens) and torch.equal(noisy.tokens, again.tokens)
    assert torch.equal(clean.actions, noisy.actions) and torch.equal(clean.images, noisy.images)
    mask = tr.maker.delta_mask.copy()
    tr.maker.delta_mask[:] = False                                                  # no arm joint: nothing to noise
    try:
        assert torch.equal(tr.maker.make(items, gen(), state_noise=0.3).tokens, clean.tokens)
    finally:
        tr.maker.delta_mask[:] = mask


@pytest.mark.parametrize("bad", ["-0.1", "nan", "inf"])
def test_a_state_noise_that_is_not_a_finite_non_negative_number_is_refused(bad, tmp_path, capsys):
    from oxygen_ros.tools.train import main
    with pytest.raises(SystemExit) as e:
        main([str(EPISODES_OLD), "--out", str(tmp_path / "run"), "--state-noise", bad])
    assert e.value.code == 2 and "--state-noise must be a finite number >= 0" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("flag", ["--steps", "--batch-size", "--ckpt-every", "--val-every", "--log-every"])
def test_a_count_or_period_below_1_is_refused(flag, tmp_path, capsys):
    """The periods are divisors in the training loop (0: a ZeroDivisionError traceback at the first step); zero
    steps or a zero batch train nothing.  Each is refused before anything is read or written."""
    from oxygen_ros.tools.train import main
    with pytest.raises(SystemExit) as e:
        main([str(EPISODES_OLD), "--out", str(tmp_path / "run"), flag, "0"])
    assert e.value.code == 2 and f"{flag} must be >= 1, got 0" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("bad", ["0", "-1", "11"])
def test_a_stop_after_outside_1_to_steps_is_refused(bad, tmp_path, capsys):
    """``--stop-after N`` is ``Trainer.train(until=N)`` (test_resume_equals_an_uninterrupted_run checks that an
    interrupted-then-resumed run equals an uninterrupted one); outside 1..--steps it is refused before anything runs."""
    from oxygen_ros.tools.train import main
    with pytest.raises(SystemExit) as e:
        main([str(EPISODES_OLD), "--out", str(tmp_path / "run"), "--steps", "10", "--stop-after", bad])
    assert e.value.code == 2 and "--stop-after must be 1..--steps (10)" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
    with pytest.raises(SystemExit) as e:                       # it would stop between checkpoints
        main([str(EPISODES_OLD), "--out", str(tmp_path / "run"), "--steps", "10", "--ckpt-every", "4",
              "--stop-after", "6"])
    assert e.value.code == 2 and "--stop-after must be a multiple of --ckpt-every (4)" in capsys.readouterr().err


@pytest.mark.parametrize("bad", ["0", "-5", "1001"])
def test_a_horizon_outside_1_to_1000_rows_is_refused(bad, tmp_path, capsys):
    from oxygen_ros.tools.train import main
    with pytest.raises(SystemExit) as e:
        main([str(EPISODES_OLD), "--out", str(tmp_path / "run"), "--horizon", bad])
    assert e.value.code == 2 and "--horizon must be 1..1000 rows" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()



def test_no_state_input_leaves_the_state_out_of_the_prompt_and_the_node_follows_the_checkpoint(bags, tmp_path):
    """``--no-state-input`` (issue 26: the arm's pose must not carry the motion): the training prompt's tokens do not
    depend on the state while the targets still do (relative actions); the checkpoint says so (config.json), so the
    node's own loader builds a processor whose prompt has no state; fine-tuning it without the flag is refused, and
    ``--init`` from a checkpoint with state plus the flag drops the state from there on."""
    from oxygen_ros.model.processing import Observation
    from oxygen_ros.ros.engine_factory import build_engine
    from oxygen_ros.ros.lockstep import sim_settings
    tr = _trainer(bags, tmp_path / "run", steps=20, state_input=False)
    tr.setup()
    assert tr.cfg.discrete_state_input is False
    ep = tr.train_eps[0]
    items = [(ep, f, 0) for f in range(0, ep.num_frames, 5)][:4]
    gen = lambda: torch.Generator().manual_seed(3)                                  # noqa: E731
    b = tr.maker.make(items, gen())
    moved = ep.state.copy()
    ep.state[:] = moved + 0.2
    try:
        b2 = tr.maker.make(items, gen())
    finally:
        ep.state[:] = moved
    assert torch.equal(b.tokens, b2.tokens) and not torch.equal(b.actions, b2.actions)
    ck = Path(tr.train()["latest"])
    assert json.loads((ck / "config.json").read_text())["discrete_state_input"] is False
    built = build_engine(sim_settings(None, {"checkpoint": str(ck), "device": "cpu"}), on_actions=lambda r: None,
                         on_token=lambda e: None, on_finished=lambda r: None)
    proc = built.engine.processor
    obs = [Observation(images=list(ep.images[3]), state=s, prompt=ep.instruction[3])
           for s in (ep.state[3], ep.state[3] + 0.5)]
    a, c = (proc.prepare(o) for o in obs)
    assert torch.equal(a.tokens, c.tokens) and "State" not in a.prompt_text
    with pytest.raises(ValueError, match="without the state in its action prompt"):
        _trainer(bags, tmp_path / "again", init=str(ck)).setup()
    src = _trainer(bags, tmp_path / "s", steps=1)
    src.setup()
    with_state = Path(src.train()["latest"])
    assert json.loads((with_state / "config.json").read_text())["discrete_state_input"] is True
    ft = _trainer(bags, tmp_path / "ft", steps=1, init=str(with_state), state_input=False)
    ft.setup()
    assert ft.cfg.discrete_state_input is False
    assert json.loads((Path(ft.train()["latest"]) / "config.json").read_text())["discrete_state_input"] is False


def test_no_state_input_with_state_noise_is_refused(tmp_path, capsys):
    from oxygen_ros.tools.train import main
    with pytest.raises(SystemExit) as e:
        main([str(EPISODES_OLD), "--out", str(tmp_path / "run"), "--no-state-input", "--state-noise", "0.1"])
    assert e.value.code == 2 and "with --no-state-input there is none" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_focus_draws_its_groups_more_often_and_validation_reports_them(bags, tmp_path):
    """``--focus`` (issue 26: the frames vision decides): the trainer draws a group's frames as often as its weight
    says, leaves the uniform draws untouched without it, reports the validation flow loss of the start / grasp frames
    apart (fm_start, fm_grasp) and records the weights; a fine-tune's curve starts with its init's validation."""
    from oxygen_ros.train.focus import frame_groups
    plain = _trainer(bags, tmp_path / "plain", steps=1)
    plain.setup()
    assert plain.draw_p is None
    tr = _trainer(bags, tmp_path / "run", steps=2, focus={"start": 50.0})
    tr.setup()
    start = {(id(e), f) for e in tr.train_eps
             for f, g in enumerate(frame_groups(e, tr.cfg.action_horizon, ~tr.delta_mask, np.ones(14))) if g == "start"}
    share = len(start) / len(tr.samples)
    assert 0 < share < 0.5
    drawn = [it for _ in range(100) for it in tr._global_items()]
    got = sum((id(e), f) in start for e, f, _ in drawn) / len(drawn)
    expect = 50 * share / (50 * share + 1 - share)
    assert abs(got - expect) < 0.05, (got, expect)
    v = tr.validate()
    assert {"fm", "ce", "fm_start", "fm_grasp"} <= set(v) and all(math.isfinite(x) for x in v.values())
    ck = Path(tr.train()["latest"])
    assert json.loads((ck / "train_state.json").read_text())["options"]["focus"] == {"start": 50.0}
    ft = _trainer(bags, tmp_path / "ft", steps=1, init=str(ck), val_every=100)
    ft.setup()
    ft.train()
    curves = json.loads((tmp_path / "ft" / "curves.json").read_text())
    assert [r["step"] for r in curves["val"]] == [0, 1] and "fm_start" in curves["val"][0]


def test_a_bad_focus_is_refused_before_any_data(tmp_path, capsys):
    from oxygen_ros.tools.train import main
    with pytest.raises(SystemExit) as e:
        main([str(EPISODES_OLD), "--out", str(tmp_path / "run"), "--focus", "start=0"])
    assert e.value.code == 2 and "--focus: the weight of 'start' must be a finite number > 0" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
