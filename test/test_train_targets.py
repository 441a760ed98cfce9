"""What training teaches, checked against what inference does: the text target mask token by token (the first
answer token and EOS are targets, no prompt token is) on the shipped demo checkpoint's domain tokenizer with the
prompt the engine itself builds; the flow-matching interpolation ``x_t`` and velocity target against the model's own
sampler (``sample_actions`` on the exact flow to a known chunk: ``x_t`` is the sampler's state at time t, the target
is the velocity it integrates, one Euler step from ``x_t`` lands on its next state); ``to_policy_actions`` with the
simulation's ``delta_action_mask`` (gripper columns stay absolute; the node's ``ActionSpace.to_absolute`` inverts it,
also through a whole batch); ``norm_stats`` on hand-built episodes against numpy's quantiles over exactly the rows
the docstring names, in openpi's layout, q01 <= q99."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from oxygen_ros.model import build_model, get_config
from oxygen_ros.train.batches import Batch, BatchMaker
from oxygen_ros.train.data import Episode, norm_stats, to_policy_actions
from oxygen_ros.train.losses import flow_matching_loss, loss_counts, pi05_loss, text_loss

pytestmark = pytest.mark.usefixtures("one_torch_thread")
DEMO = Path(__file__).resolve().parents[1] / "checkpoints" / "demo"
SIM_MASK = [1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 0]     # config/sim_aloha.yaml (checked below)


def _episode(F=4, T=30, every=5, D=14, seed=0, texts=None, S=8):
    """Frames every ``every`` control steps (20 ms) from 0; executed action k at step k."""
    g = np.random.default_rng(seed)
    ns = 1_000_000_000_000
    return Episode(source=f"hand#{seed}", images=np.zeros((F, 3, S, S, 3), np.uint8), image_mask=np.ones((F, 3), bool),
                   frame_ns=ns + np.arange(F, dtype=np.int64) * every * 20_000_000,
                   state=g.normal(size=(F, D)).astype(np.float32), instruction=["pick up the red cube"] * F,
                   texts=texts or [[] for _ in range(F)], action_ns=ns + np.arange(T, dtype=np.int64) * 20_000_000,
                   actions=g.normal(size=(T, D)).astype(np.float32) * (1 + np.arange(D, dtype=np.float32)))


# ---------------------------------------------------------------------------------------------------- text targets
@pytest.fixture(scope="module")
def demo_processor():
    from oxygen_ros.model import load_checkpoint
    from oxygen_ros.model.processing import Processor
    pol = load_checkpoint(DEMO)
    return Processor(pol.cfg, pol.tokenizer, pol.norm_stats, action_dims=14)


@pytest.mark.parametrize("kind,prompt,answer", [
    ("conversation", "How many cubes are on the table?", "two"),
    ("memory", "Describe the scene in one sentence.", "a red cube and a blue cube on the table"),
])
def test_the_text_target_mask_token_by_token(demo_processor, kind, prompt, answer):
    proc = demo_processor
    tok = proc.tokenizer
    maker = BatchMaker(proc.cfg, proc, np.asarray(SIM_MASK, bool), text_len=40)
    texts = [[], [(kind, prompt, answer)], [], []]
    ep = _episode(texts=texts, S=proc.cfg.image_size)
    b = maker.make([(ep, 1, 0), (ep, 0, 0)])
    # the prompt exactly as the engine feeds it for a language request, then the answer's tokens and EOS
    p_tok, p_mask, _ = proc.encode_prompt(kind, prompt)
    prompt_ids = p_tok[0][p_mask[0]].tolist()
    assert prompt_ids[0] == tok.bos_id
    ans = tok.encode(answer)
    ids = prompt_ids + ans + [tok.eos_id]
    n = len(ids)
    assert b.text[0, :n].tolist() == ids and bool(b.text_masks[0, :n].all()) and not b.text_masks[0, n:].any()
    for j in range(b.text.shape[1]):                            # logits at j predict text[j + 1]
        predicts = b.text[0, j + 1].item() if j + 1 < n else None
        want = len(prompt_ids) <= j + 1 < n                     # an answer token or EOS
        assert bool(b.text_targets[0, j]) == want, (j, predicts)
    assert b.text_targets[0, len(prompt_ids) - 1]               # the first answer token is a target
    assert b.text[0, len(prompt_ids)].item() == ans[0]
    assert not b.text_targets[1].any() and not b.text_masks[1].any()   # a frame without text: nothing
    assert loss_counts(b)[1].item() == len(ans) + 1
    # logits that predict exactly the targets -> ~0 loss; the prompt's positions never count
    V = tok.vocab_size
    logits = torch.full((2, b.text.shape[1], V), -30.0)
    for j in range(n - 1):
        logits[0, j, b.text[0, j + 1]] = 30.0
    assert text_loss(logits, b.text, b.text_targets).item() < 1e-6
    logits[0, :len(prompt_ids) - 1] = 0.0                        # prompt positions wrong: unchanged
    assert text_loss(logits, b.text, b.text_targets).item() < 1e-6
    logits[0, len(prompt_ids) - 1] = 0.0                         # the first answer token's position wrong: counted
    assert text_loss(logits, b.text, b.text_targets).item() > 0.1


# ---------------------------------------------------------------------------------------------------- x_t
def test_x_t_and_the_velocity_target_follow_the_samplers_convention(monkeypatch):
    """On the exact flow from noise n (t = 1) to a chunk a (t = 0) the sampler's velocity is (x - a) / t: its states
    x_k at t_k = 1 - k / S are the points the training interpolation must produce, and the training target must be
    the velocity it integrates (zero flow-matching loss), so x_t + dt u = x_(k+1)."""
    torch.manual_seed(0)
    m = build_model(get_config("tiny"))
    cfg = m.cfg
    H, A, S = cfg.action_horizon, cfg.action_dim, 4
    g = torch.Generator().manual_seed(1)
    images = torch.zeros(1, cfg.num_cameras, 3, cfg.image_size, cfg.image_size)
    prefix = m.prefill(images, torch.ones(1, cfg.num_cameras, dtype=torch.bool), torch.tensor([[2, 5, 6]]),
                       torch.ones(1, 3, dtype=torch.bool))
    a = torch.randn(1, H, A, generator=g)
    n = torch.randn(1, H, A, generator=g)
    states = []
    times = []
    real_time_condition = m.time_condition

    def recording_time_condition(t):                           # the S times the sampler conditions its steps on
        times.extend(t.tolist())
        return real_time_condition(t)

    def exact_velocity(x, mods, *args, **kw):                  # the layers' velocity at the k-th step's time
        t = times[len(states)]
        states.append((t, x.clone()))
        return (x - a) / t

    monkeypatch.setattr(m, "time_condition", recording_time_condition)
    monkeypatch.setattr(m, "_velocity", exact_velocity)
    out = m.sample_actions(prefix, n, num_steps=S)
    assert torch.allclose(out, a, atol=1e-5)
    assert [t for t, _ in states] == pytest.approx([1.0, 0.75, 0.5, 0.25])
    nxt = [x for _, x in states[1:]] + [out]

    batch = Batch(images=images, image_masks=torch.ones(1, cfg.num_cameras, dtype=torch.bool),
                  tokens=torch.zeros(1, 3, dtype=torch.long), token_masks=torch.ones(1, 3, dtype=torch.bool),
                  actions=a, action_valid=torch.ones(1, H, dtype=torch.bool), text=torch.zeros(1, 2, dtype=torch.long),
                  text_masks=torch.zeros(1, 2, dtype=torch.bool), text_targets=torch.zeros(1, 2, dtype=torch.bool))
    for (t, x_k), x_next in zip(states, nxt):
        seen = {}

        def step_fn(images, image_masks, tokens, token_masks, x_t, time, text, text_masks):
            seen["x_t"], seen["t"] = x_t.clone(), time.clone()
            return (x_t - a) / time[:, None, None], None       # the velocity the sampler integrates there

        total, fm, _, _, _ = pi05_loss(step_fn, batch, n, torch.tensor([t]), text_weight=0.0)
        assert torch.allclose(seen["x_t"], x_k, atol=1e-5), t              # the sampler's state at time t
        assert fm.item() < 1e-9, t                                          # the target is that velocity
        u = n - a                                                           # (zero loss for exactly this target)
        assert flow_matching_loss(u, a, n, batch.action_valid).item() < 1e-12
        assert torch.allclose(seen["x_t"] + (-1.0 / S) * u, x_next, atol=1e-5), t   # one Euler step -> next state


# ---------------------------------------------------------------------------------------------------- delta actions
def test_the_simulations_delta_mask_keeps_the_grippers_absolute():
    from oxygen_ros.ros.action_space import ActionSpace
    from oxygen_ros.ros.lockstep import sim_settings
    from oxygen_ros.sim.scene import JOINTS
    mask = np.asarray(sim_settings(None).delta_action_mask, bool)
    assert mask.tolist() == [bool(v) for v in SIM_MASK]
    assert [j for j, m in zip(JOINTS, mask) if not m] == ["left_arm_gripper", "right_arm_gripper"]
    g = np.random.default_rng(3)
    a = g.normal(size=(5, 14)).astype(np.float32)
    s = g.normal(size=14).astype(np.float32)
    out = to_policy_actions(a, s, mask)
    for j in range(14):
        want = a[:, j] - s[j] if mask[j] else a[:, j]
        assert np.allclose(out[:, j], want), JOINTS[j]
    assert np.array_equal(out[:, [6, 13]], a[:, [6, 13]])
    assert np.array_equal(a, to_policy_actions(a, s, [])) and out is not a       # no mask: unchanged, a copy
    space = ActionSpace.build(14, delta_action_mask=SIM_MASK, state_dim=14)
    assert np.allclose(space.to_absolute(out, s), a, atol=1e-6)                  # what the node executes


def test_a_batchs_action_target_is_what_the_node_turns_back_into_the_executed_chunk(demo_processor):
    from oxygen_ros.ros.action_space import ActionSpace
    proc = demo_processor
    H = proc.cfg.action_horizon
    maker = BatchMaker(proc.cfg, proc, np.asarray(SIM_MASK, bool), text_len=8)
    ep = _episode(F=4, T=60, S=proc.cfg.image_size)
    b = maker.make([(ep, 2, 0)])
    first = int(np.searchsorted(ep.action_ns, ep.frame_ns[2]))
    executed = ep.actions[first:first + H]
    assert len(executed) == H and bool(b.action_valid.all())
    model_out = proc.unnormalize_actions(b.actions[0])                          # [H, 14], as the node unnormalises
    space = ActionSpace.build(14, delta_action_mask=SIM_MASK, state_dim=14)
    assert np.allclose(space.to_absolute(model_out, ep.state[2]), executed, atol=1e-4)


# ---------------------------------------------------------------------------------------------------- norm stats
def test_norm_stats_are_numpys_quantiles_of_the_policys_targets_in_openpis_layout():
    eps = [_episode(F=5, T=24, every=5, seed=1), _episode(F=3, T=14, every=5, seed=2)]
    H = 6
    got = norm_stats(eps, H, SIM_MASK)
    assert set(got) == {"norm_stats"} and set(got["norm_stats"]) == {"state", "actions"}
    for part in got["norm_stats"].values():
        assert set(part) == {"mean", "std", "q01", "q99"} and all(len(v) == 14 for v in part.values())
    # the reference: every frame's state; for actions every valid row of every frame's H-row chunk (rows from the
    # frame's time on, within the episode), masked columns minus the frame's state
    states = np.concatenate([e.state for e in eps]).astype(np.float64)
    rows = []
    for e in eps:
        for f in range(e.num_frames):
            k0 = list(e.action_ns).index(e.frame_ns[f])
            for k in range(k0, min(k0 + H, len(e.actions))):
                r = e.actions[k].astype(np.float64).copy()
                r[np.asarray(SIM_MASK, bool)] -= e.state[f][np.asarray(SIM_MASK, bool)]
                rows.append(r)
    rows = np.array(rows)
    assert len(rows) == (4 * 6 + 4) + (2 * 6 + 4)     # each episode's last frame has 4 rows left
    for name, x in (("state", states), ("actions", rows)):
        s = got["norm_stats"][name]
        assert np.allclose(s["q01"], np.quantile(x, 0.01, axis=0), atol=1e-5), name
        assert np.allclose(s["q99"], np.quantile(x, 0.99, axis=0), atol=1e-5), name
        assert np.allclose(s["mean"], x.mean(0), atol=1e-5) and np.allclose(s["std"], x.std(0), atol=1e-5), name
        assert np.all(np.asarray(s["q01"]) <= np.asarray(s["q99"])), name
    # the node's NormStats reads them: q01 -> -1, q99 -> +1
    from oxygen_ros.model.processing import NormStats
    ns = NormStats.from_dict(got)
    q = got["norm_stats"]["actions"]
    assert np.allclose(ns.normalize_actions(np.array([q["q01"], q["q99"]])), [[-1] * 14, [1] * 14], atol=1e-4)


def test_norm_stats_on_a_known_distribution():
    """States 0..100 in steps of 1 per dimension (scaled per dim): q01 = 1, q99 = 99 (numpy's linear rule)."""
    e = _episode(F=101, T=101, every=1)
    e.state = (np.arange(101, dtype=np.float32)[:, None] * np.arange(1, 15, dtype=np.float32)[None, :])
    got = norm_stats([e], 1, [])["norm_stats"]["state"]
    assert np.allclose(got["q01"], np.arange(1, 15) * 1.0) and np.allclose(got["q99"], np.arange(1, 15) * 99.0)
    assert np.allclose(got["mean"], np.arange(1, 15) * 50.0)
