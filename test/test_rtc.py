"""Tests of real-time chunking (model/rtc.py and its engine hook ``Engine.cycle(..., rtc=RTCRequest)``), CPU, tiny.

The formula is checked on stand-in velocity fields (plain functions, not the model: they test the guidance FORMULA,
the time convention and the VJP's transpose, where the answer can be computed by hand): one step of a linear field
that mixes rows (so J != J^T), and the whole guided Euler loop on the exact flow of Gaussian data (a linear field,
the guided chain is a scalar recurrence per element). On the real tiny model: beta = 0 reproduces ``sample_actions``;
the guided loop on the model equals the same loop on the independent naive reference's velocity (``pi05_reference``,
VJP through it; the only RTC test that does not share ``Pi05Model.action_attention``, so a broken action-token mask
or position is caught here); with beta = 10 and S = 10 the frozen rows land within 0.05 of a target taken from an
UNRELATED chunk (other frame, other noise; the unguided gap is up to ~5.7, so > 99 % of it is closed; measured 0.018)
because c(t)/S is ~1 at the first steps and again at the last ones, so each of those steps nearly cancels the
remaining error of the predicted clean chunk; the pull toward the target weakens row by row with the mask and is
absent past it; the prefix K/V are bit-identical before/after and carry no gradient. Engine: rtc None or empty =
bit-identical actions in every mode; the guided chunk is the same in isolated / shared / oxygen; language tokens are
unchanged by RTC; prev_actions are normalised with the processor's stats (the exact inverse of unnormalize_actions,
quantile and mean/std stats, robot_dim < action_dim). The smoothness benchmark's simulated control loop
(tools/bench/smoothness.py) switches chunks at the ticks it should, and with RTC the switch lands near the old plan.
"""
import math

import numpy as np
import pytest
import torch

from oxygen_ros.engine.engine import MODES, Engine, EngineConfig
from oxygen_ros.engine.requests import RTCRequest
from oxygen_ros.model import NormStats, Observation, Processor, build_model, get_config, load_tokenizer
from oxygen_ros.model.processing import Stats
from oxygen_ros.model.rtc import (guidance_weight, guided_euler, guided_velocity, prefix_weights, rtc_target,
                                  sample_actions_rtc)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

D, S_EXEC, BETA = 2, 3, 10.0          # frozen rows, execution horizon, guidance clip used on the model


# ---------------------------------------------------------------------------------------------------------------
# the formula on stand-in fields
# ---------------------------------------------------------------------------------------------------------------


def paper_weights(H, d, s, n):
    """Paper eq. 5 written out by hand (hard = min(d, n), end = max(hard, min(H - s, n)))."""
    hard = min(d, n)
    end = max(hard, min(H - s, n))
    out = []
    for i in range(H):
        if i < hard:
            out.append(1.0)
        elif i < end:
            c = (end - i) / (end - hard + 1)
            out.append(c * (math.exp(c) - 1) / (math.e - 1))
        else:
            out.append(0.0)
    return out


@pytest.mark.parametrize("H,d,s,n", [(10, 2, 3, 7), (10, 2, 3, 10), (10, 0, 0, 10), (10, 4, 2, 3), (10, 3, 8, 10),
                                     (10, 2, 3, 0), (50, 5, 25, 45)])
def test_prefix_weights_match_paper(H, d, s, n):
    w = prefix_weights(H, d, s, n)
    assert w.shape == (H,)
    np.testing.assert_allclose(w.numpy(), paper_weights(H, d, s, n), rtol=1e-6, atol=1e-7)
    assert (w[:min(d, n)] == 1).all() and (w[min(n, max(min(d, n), H - s)):] == 0).all()
    assert (w[1:] <= w[:-1]).all()                               # never increases


def test_prefix_weights_values():
    w = prefix_weights(10, 2, 3, 7).numpy()
    # end = 7: c_i = (7 - i) / 6 for i = 2..6
    c = np.array([5, 4, 3, 2, 1]) / 6
    np.testing.assert_allclose(w, [1, 1, *(c * np.expm1(c) / (np.e - 1)), 0, 0, 0], rtol=1e-6)
    assert w[2] == pytest.approx(0.6309, abs=1e-4) and w[6] == pytest.approx(0.01759, abs=1e-5)


def test_guidance_weight():
    assert guidance_weight(1.0, 10.0) == 10.0                      # tau = 0: infinite -> clipped
    assert guidance_weight(0.5, 10.0) == pytest.approx(2.0)       # (0.25 + 0.25) / 0.25
    assert guidance_weight(0.1, 10.0) == pytest.approx(0.82 / 0.09)
    assert guidance_weight(0.1, 5.0) == 5.0
    for t in (0.2, 0.3, 0.45):                                     # symmetric in t <-> 1 - t (tau = 1 - t)
        assert guidance_weight(t, 100.0) == pytest.approx(guidance_weight(1 - t, 100.0))
    assert guidance_weight(0.7, 0.0) == 0.0


def test_guided_velocity_one_step_linear_field_by_hand():
    """v(x) = M x + b with M mixing the H rows (not symmetric), so the VJP must apply J^T = I - t M^T, not J."""
    rng = np.random.default_rng(3)
    H, A, t, beta = 4, 2, 0.7, 10.0
    M = rng.normal(size=(H, H))
    b = rng.normal(size=(H, A))
    x = rng.normal(size=(H, A))
    Y = rng.normal(size=(H, A))
    W = np.array([1.0, 0.6, 0.2, 0.0])[:, None] * np.ones((1, A))
    Mt, bt = torch.tensor(M, dtype=torch.float32), torch.tensor(b, dtype=torch.float32)
    v_g, info = guided_velocity(lambda z: torch.einsum("hj,bja->bha", Mt, z) + bt, torch.tensor(x[None]), t,
                                torch.tensor(Y[None]), torch.tensor(W[None], dtype=torch.float32), beta)
    # by hand
    v = M @ x + b
    x1 = x - t * v                                    # predicted clean chunk, pi0.5 time
    e = W * (Y - x1)
    g = e - t * M.T @ e                               # J^T e, J = I - t M
    c = min(beta, (t ** 2 + (1 - t) ** 2) / (t * (1 - t)))
    assert info["c"] == pytest.approx(c)
    np.testing.assert_allclose(v_g[0].numpy(), v - c * g, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(info["err2"].numpy(), [(e ** 2).sum()], rtol=1e-5)
    # J (instead of J^T) would give a different answer: the check above can tell them apart
    assert np.abs((e - t * M @ e) - g).max() > 0.1


def gaussian_velocity(x, t):
    """The exact flow-matching velocity for data a ~ N(0, 1) per element: x_t = t eps + (1 - t) a,
    E[eps - a | x_t] = (2t - 1) / (t^2 + (1 - t)^2) x_t (a linear field)."""
    t = float(t[0])
    return (2 * t - 1) / (t * t + (1 - t) ** 2) * x


def test_guided_euler_gaussian_flow_matches_recurrence():
    """The whole guided loop against the same chain computed by hand: per element
    x <- x + dt (alpha x - c (1 - t alpha) W (Y - (1 - t alpha) x)), alpha = (2t - 1)/(t^2 + (1 - t)^2).
    Rows with W = 1 end at the target, rows with W = 0 follow the unguided flow exactly (the field is diagonal), and
    flipping the sign of the guidance term (the time-convention mistake) would drive them away."""
    g = torch.Generator().manual_seed(0)
    H, A, S = 8, 3, 10
    noise = torch.randn(1, H, A, generator=g)
    Y = torch.randn(1, H, A, generator=g) * 2
    w = prefix_weights(H, 2, 3, H)                                 # 1 1 .. decay .. 0 0 0
    trace = []
    out = guided_euler(gaussian_velocity, noise, S, Y, w, BETA, trace)
    x = noise[0].double().numpy()
    xu = x.copy()
    Wn = w.double().numpy()[:, None]
    Yn = Y[0].double().numpy()
    t, dt = 1.0, -1.0 / S
    for k in range(S):
        alpha = (2 * t - 1) / (t * t + (1 - t) ** 2)
        c = min(BETA, (t * t + (1 - t) ** 2) / (t * (1 - t))) if 0 < t < 1 else BETA
        assert trace[k]["t"] == pytest.approx(t) and trace[k]["c"] == pytest.approx(c)
        j = 1 - t * alpha
        x = x + dt * (alpha * x - c * j * Wn * (Yn - j * x))
        xu = xu + dt * alpha * xu
        t += dt
    np.testing.assert_allclose(out[0].numpy(), x, rtol=1e-4, atol=1e-4)
    o = out[0].numpy()
    np.testing.assert_allclose(o[w.numpy() == 0], xu[w.numpy() == 0], rtol=1e-5, atol=1e-5)
    frozen = np.abs(o[:2] - Yn[:2]).max()
    assert frozen < 0.05 * np.abs(xu[:2] - Yn[:2]).max()
    # unguided (beta 0) = the plain Euler flow
    np.testing.assert_allclose(guided_euler(gaussian_velocity, noise, S, Y, w, 0.0)[0].numpy(), xu, rtol=1e-5,
                               atol=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# the real tiny model
# ---------------------------------------------------------------------------------------------------------------


def small_cfg(**kw):
    return get_config("tiny", vision={"image_size": 64, "patch_size": 16}, max_token_len=64, **kw)


def frame(cfg, rng, stamp=0.0):
    imgs = [rng.integers(0, 256, (cfg.image_size, cfg.image_size, 3), dtype=np.uint8) for _ in range(cfg.num_cameras)]
    return Observation(images=imgs, state=rng.uniform(-1, 1, 2), prompt="stack it", stamp=stamp)


def prefill(model, proc, obs):
    mi = proc.prepare(obs)
    return model.prefill(mi.images, mi.image_masks, mi.tokens, mi.token_masks)


@pytest.fixture(scope="module")
def tiny():
    cfg = small_cfg()
    model = build_model(cfg, seed=0)
    proc = Processor(cfg, load_tokenizer(cfg))
    rng = np.random.default_rng(0)
    g = torch.Generator().manual_seed(0)
    H, A = cfg.action_horizon, cfg.action_dim
    old = model.sample_actions(prefill(model, proc, frame(cfg, rng)), torch.randn(1, H, A, generator=g))
    obs = frame(cfg, rng, 1.0)
    prefix = prefill(model, proc, obs)
    noise = torch.randn(1, H, A, generator=g)
    plain = model.sample_actions(prefix, noise)
    prev = old[0, S_EXEC:]                                   # the old plan for new rows 0 .. H - s - 1
    target, weights = rtc_target(prev, H, A, D, S_EXEC)
    return dict(cfg=cfg, model=model, proc=proc, obs=obs, prefix=prefix, noise=noise, plain=plain, old=old,
                target=target, weights=weights)


def test_beta_zero_is_sample_actions(tiny):
    out = sample_actions_rtc(tiny["model"], tiny["prefix"], tiny["noise"], None, tiny["target"], tiny["weights"], 0.0)
    torch.testing.assert_close(out, tiny["plain"], rtol=1e-5, atol=1e-6)


def test_guided_path_matches_the_independent_reference():
    """The guided loop on the model against the same loop on the naive reference's velocity (``pi05_reference``: one
    eager attention over [images | prompt | actions] with its own mask rule table, recomputing the prefix every step;
    it shares none of the model's forward code).  The tests above compare guided sampling with ``sample_actions`` and
    both build the action tokens' positions and mask with ``Pi05Model.action_attention``, so a broken action-token
    mask, position or prefix read would pass them; here it cannot.  The Jacobian-transpose product is taken through
    the reference too, so the VJP of the real network (not only of a linear stand-in) is checked; guided_euler itself
    is checked against a hand-written recurrence above.  A model with every parameter random (no neutral norm), a
    padded prompt (so masking matters), beta = 10 and 3 steps (the first at t = 1, where c = beta)."""
    from model_fixtures import randomize_parameters
    from pi05_reference import joint_forward

    cfg = small_cfg(num_denoise_steps=3)
    model = randomize_parameters(build_model(cfg, seed=5), seed=5)
    proc = Processor(cfg, load_tokenizer(cfg))
    rng = np.random.default_rng(5)
    mi = proc.prepare(frame(cfg, rng, 1.0))
    assert not bool(mi.token_masks.all()), "the prompt is padded: the action tokens' mask has something to hide"
    prefix = model.prefill(mi.images, mi.image_masks, mi.tokens, mi.token_masks)
    g = torch.Generator().manual_seed(5)
    H, A = cfg.action_horizon, cfg.action_dim
    noise = torch.randn(1, H, A, generator=g)
    prev = torch.randn(H - S_EXEC, 7, generator=g)                    # an unrelated old plan, 7 robot dims
    target, weights = rtc_target(prev, H, A, D, S_EXEC)

    def reference_velocity(x, t):                                      # x [1, H, A], t [1] -> [1, H, A]
        _, v, _ = joint_forward(model, mi.images[0], mi.image_masks[0], mi.tokens[0], mi.token_masks[0], x_t=x[0],
                                t=float(t[0]))
        return v[None]

    trace_m, trace_r = [], []
    got = sample_actions_rtc(model, prefix, noise, 3, target, weights, BETA, trace_m)
    ref = guided_euler(reference_velocity, noise, 3, target, weights, BETA, trace_r)
    plain = model.sample_actions(prefix, noise, 3)
    assert float((ref - plain).abs().max()) > 0.1, "the guidance moved the chunk (else this compares little)"
    err = float((got - ref).abs().max() / ref.abs().max())
    assert err <= 1e-4, err
    for a, b in zip(trace_m, trace_r):                                 # the weighted error at every step
        assert a["c"] == b["c"] and float(a["err2"]) == pytest.approx(float(b["err2"]), rel=1e-3)


def test_guided_chunk_follows_the_mask(tiny):
    m, T = tiny["model"], tiny["target"][0]
    k0 = [k.clone() for k in tiny["prefix"].k]
    v0 = [v.clone() for v in tiny["prefix"].v]
    mask0, pos0 = tiny["prefix"].mask.clone(), tiny["prefix"].positions.clone()
    trace = []
    out = sample_actions_rtc(m, tiny["prefix"], tiny["noise"], None, tiny["target"], tiny["weights"], BETA, trace)
    # prefix K/V read only: bit-identical, no gradient anywhere
    assert all(torch.equal(a, b) for a, b in zip(k0, tiny["prefix"].k))
    assert all(torch.equal(a, b) for a, b in zip(v0, tiny["prefix"].v))
    assert torch.equal(mask0, tiny["prefix"].mask) and torch.equal(pos0, tiny["prefix"].positions)
    assert not any(t.requires_grad for t in tiny["prefix"].k + tiny["prefix"].v)
    assert all(p.grad is None and not p.requires_grad for p in m.parameters())
    assert not out.requires_grad and torch.isfinite(out).all()
    # the weighted error of the predicted clean chunk shrinks: > 100x from the first step to the last
    assert float(trace[-1]["err2"]) < 0.01 * float(trace[0]["err2"])
    err = (out[0] - T).abs().max(-1).values                # per row
    err_u = (tiny["plain"][0] - T).abs().max(-1).values
    H = tiny["cfg"].action_horizon
    end = H - S_EXEC
    assert float(err[:D].max()) < 0.05 and float(err_u[:D].min()) > 1.0      # frozen rows: measured 0.018
    ratio = (err / err_u)[:end]                           # how much of the gap is left, row by row
    assert (ratio[1:] >= ratio[:-1] - 0.02).all(), ratio  # weaker pull as the weight decays
    assert float(ratio[end - 1]) > 0.5                    # weight 0.018: almost no pull
    r_after = err[end:] / err_u[end:]                     # weight 0 (no target there): unguided-like
    assert ((r_after > 0.8) & (r_after < 1.25)).all(), r_after


def test_guidance_under_no_grad_and_refused_under_inference_mode(tiny):
    args = (tiny["model"], tiny["prefix"], tiny["noise"], 2, tiny["target"], tiny["weights"], BETA)
    ref = sample_actions_rtc(*args)
    with torch.no_grad():                                  # a caller's no_grad does not switch the guidance off
        assert torch.equal(sample_actions_rtc(*args), ref)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="inference_mode"):
        sample_actions_rtc(*args)


def test_smoothness_is_an_oxygen_subcommand():
    from oxygen_ros.tools.cli import COMMANDS
    from oxygen_ros.tools.bench import smoothness
    module, func = COMMANDS["smoothness"]
    assert module == smoothness.__name__ and getattr(smoothness, func) is smoothness.main


def test_batch_rows_guided_independently(tiny):
    """B = 2 with a broadcast batch-1 prefix: each row equals its own batch-1 guided run."""
    m = tiny["model"]
    noise2 = torch.cat([tiny["noise"], torch.randn_like(tiny["noise"])])
    both = sample_actions_rtc(m, tiny["prefix"], noise2, None, tiny["target"], tiny["weights"], BETA)
    for b in range(2):
        one = sample_actions_rtc(m, tiny["prefix"], noise2[b:b + 1], None, tiny["target"], tiny["weights"], BETA)
        torch.testing.assert_close(both[b:b + 1], one, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# the engine hook
# ---------------------------------------------------------------------------------------------------------------


def run_engine(model, proc, mode, obs, noise, rtc=None, requests=()):
    acts, results = [], {}
    eng = Engine(model, proc, EngineConfig(mode=mode, max_new_tokens=6), on_actions=acts.append,
                 on_finished=lambda r: results.__setitem__(r.request_id, r))
    for kind, prompt in requests:
        eng.submit(kind, prompt)
    eng.cycle(obs, noise=noise, rtc=rtc)
    while eng.kv.num_active or eng.pending():
        eng.cycle(obs)
    return acts[0], [(r.kind, r.token_ids, r.finish_reason) for _, r in sorted(results.items())]


REQS = (("conversation", "what is on the table?"), ("subtask", ""))


def test_engine_rtc_off_is_bit_identical(tiny):
    model, proc, obs, noise = tiny["model"], tiny["proc"], tiny["obs"], tiny["noise"]
    today = proc.unnormalize_actions(model.sample_actions(prefill(model, proc, obs), noise)[0])
    empty = RTCRequest(np.zeros((0, proc.action_dims), np.float32), D, S_EXEC)
    assert not empty.active
    for mode in MODES:
        for rtc in (None, empty):
            a, _ = run_engine(model, proc, mode, obs, noise, rtc)
            assert np.array_equal(a.actions, today), (mode, rtc)
            assert not a.guided and a.rtc_ms == 0.0


def test_engine_rtc_same_in_every_mode_and_language_unchanged(tiny):
    model, proc, obs, noise = tiny["model"], tiny["proc"], tiny["obs"], tiny["noise"]
    prev = proc.unnormalize_actions(tiny["old"][0])[S_EXEC:]
    rtc = RTCRequest(prev, D, S_EXEC, BETA)
    guided = {}
    for mode in MODES:
        a, lang = run_engine(model, proc, mode, obs, noise, rtc, REQS)
        _, lang_off = run_engine(model, proc, mode, obs, noise, None, REQS)
        assert lang == lang_off and len(lang) == 2 and all(len(t) > 0 for _, t, _ in lang)
        assert a.guided and a.rtc_ms > 0
        guided[mode] = a.actions
    assert np.array_equal(guided["isolated"], guided["shared"]) and np.array_equal(guided["shared"], guided["oxygen"])
    # the engine's normalisation path gives what sample_actions_rtc gives on the normalised target directly
    direct = sample_actions_rtc(model, tiny["prefix"], noise, None, tiny["target"], tiny["weights"], BETA)
    np.testing.assert_allclose(guided["oxygen"], proc.unnormalize_actions(direct[0]), rtol=1e-5, atol=1e-5)
    assert np.abs(guided["oxygen"][:D] - prev[:D]).max() < 0.05


def quantile_stats(r, seed=5, mean_std=True):
    rng = np.random.default_rng(seed)
    lo = rng.uniform(-2, 0, r)
    hi = lo + rng.uniform(0.5, 3, r)
    return Stats(mean=rng.normal(size=r) if mean_std else None, std=rng.uniform(0.5, 2, r) if mean_std else None,
                 q01=lo, q99=hi)


def test_normalize_actions_inverts_unnormalize():
    cfg = small_cfg()
    tok = load_tokenizer(cfg)
    r = 7
    proc = Processor(cfg, tok, NormStats(actions=quantile_stats(r)))
    assert proc.action_dims == r
    x = np.random.default_rng(1).normal(size=(10, cfg.action_dim)).astype(np.float32)
    robot = proc.unnormalize_actions(x)
    assert robot.shape == (10, r)
    np.testing.assert_allclose(proc.normalize_actions(robot), x[:, :r], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(proc.unnormalize_actions(np.pad(proc.normalize_actions(robot), ((0, 0), (0, 25)))),
                               robot, rtol=1e-5, atol=1e-5)
    # mean/std only (pi0.5 normalises by quantiles): identity both ways, as unnormalize_actions is
    ms = Processor(cfg, tok, NormStats(actions=Stats(mean=np.ones(r), std=np.full(r, 2.0))), action_dims=r)
    assert np.array_equal(ms.normalize_actions(robot), robot)
    assert np.array_equal(ms.unnormalize_actions(x), x[:, :r])
    with pytest.raises(ValueError):
        proc.normalize_actions(x)                           # model width, not robot_dim


def test_engine_rtc_robot_units_and_padding_dims(tiny):
    """Quantile stats on 7 robot dims of 32: prev_actions in robot units are normalised, the frozen rows land on
    them in robot units, and the 25 padding dims carry no target and no weight."""
    cfg, model = tiny["cfg"], tiny["model"]
    r = 7
    stats = quantile_stats(r)
    proc = Processor(cfg, load_tokenizer(cfg), NormStats(actions=stats))
    prev = proc.unnormalize_actions(tiny["old"][0])[S_EXEC:]
    acts, _ = run_engine(model, proc, "oxygen", tiny["obs"], tiny["noise"], RTCRequest(prev, D, S_EXEC, BETA))
    assert acts.actions.shape == (cfg.action_horizon, r)
    span = stats.q99 - stats.q01
    assert (np.abs(acts.actions[:D] - prev[:D]) / span).max() < 0.05 / 2      # normalised units: x 2 / span
    target, weights = rtc_target(torch.from_numpy(proc.normalize_actions(prev)), cfg.action_horizon, cfg.action_dim,
                                 D, S_EXEC)
    assert (weights[..., r:] == 0).all() and (target[..., r:] == 0).all() and (target[0, len(prev):] == 0).all()
    assert (weights[0, :D, :r] == 1).all() and (weights[0, cfg.action_horizon - S_EXEC:] == 0).all()


def test_rtc_request_validation():
    assert RTCRequest(np.zeros((3, 2)), 1, 2).prev_actions.dtype == np.float32
    with pytest.raises(ValueError):
        RTCRequest(np.zeros(3), 1, 2)
    with pytest.raises(ValueError):
        RTCRequest(np.array([[np.nan, 0.0]]), 1, 2)
    with pytest.raises(ValueError):
        RTCRequest(np.zeros((3, 2)), -1, 2)
    with pytest.raises(ValueError):
        RTCRequest(np.zeros((3, 2)), 1, 2, max_guidance_weight=-1.0)


# ---------------------------------------------------------------------------------------------------------------
# the smoothness benchmark's simulated control loop (behaviour, not timing: fixed simulated latency)
# ---------------------------------------------------------------------------------------------------------------


def test_smoothness_simulation_switches_on_the_old_plan(tiny):
    """Fixed latency 3 steps, s = 5: one executed row per tick with no gap or hold, one switch per chunk, each at the
    tick the chunk became ready; RTC's first executed row of a new chunk stays near the old plan for that tick, far
    nearer than an unguided switch (random weights: unrelated chunks)."""
    from oxygen_ros.tools.bench.smoothness import simulate
    cfg, model, proc = tiny["cfg"], tiny["model"], tiny["proc"]
    rng, g = np.random.default_rng(3), torch.Generator().manual_seed(3)
    frames = [frame(cfg, rng, float(i)) for i in range(4)]
    noise = [torch.randn(1, cfg.action_horizon, cfg.action_dim, generator=g) for _ in frames]
    res = {}
    for mode in ("none", "rtc"):
        eng = Engine(model, proc, EngineConfig(mode="oxygen"))
        res[mode] = simulate(eng, frames, noise, mode, step_dt=0.02, execution_horizon=5, blend_steps=0,
                             time_origin="arrival", latency_ms=60.0, beta=BETA, warmup=0)
    for mode, r in res.items():
        ticks = [t for t, _, _, _ in r["stream"]]
        assert ticks == list(range(3, 3 + len(ticks))) and r["held_ticks"] == 0     # first chunk ready at tick 3
        chunk_at = {t: c for t, _, c, _ in r["stream"]}
        switches = [t for t in ticks[1:] if chunk_at[t] != chunk_at[t - 1]]
        assert switches == [8, 13, 18] and r["switch"]["n"] == 3                     # k0 = 5, 10, 15; + d = 3
        assert r["d_steps"]["p50"] == 3
    assert res["rtc"]["d_est_steps"]["p50"] == 3 and res["rtc"]["rtc_ms"]["n"] == 3
    assert res["rtc"]["frozen_rows_max_abs_err"]["max"] < 0.05
    assert res["rtc"]["switch_vs_old_plan"]["max"] < 0.5 * res["none"]["switch_vs_old_plan"]["p50"]
