"""Model configuration and parameter layout: the ``pi05`` preset built on the meta device has exactly openpi's
state_dict (813 keys, same order, shapes and the bf16/fp32 dtype plan of ``test/data/pi05_openpi_state_dict.tsv``,
copied from the reference so CI on a robot needs no ../shared); the LM head is tied to ``embed_tokens``; the
``bench-cpu`` preset has its fixed numbers; every shape follows the config (no hard-coded head counts) and a 6-query /
2-KV-head model computes the naive reference's numbers; bf16 differs from the same weights in fp32 by rounding only;
invalid configs are refused; ``oxygen_ros/model`` never imports rclpy.
"""
import copy
import subprocess
import sys
from types import SimpleNamespace
from pathlib import Path

import pytest
import torch

from model_fixtures import randomize_parameters
from oxygen_ros.model import Pi05Model, build_model, get_config
from oxygen_ros.model.pi05 import keeps_fp32
from pi05_reference import joint_forward, reference_actions

TSV = Path(__file__).parent / "data" / "pi05_openpi_state_dict.tsv"
ROOT = Path(__file__).resolve().parents[1]


def tsv_rows():
    rows = []
    for line in TSV.read_text().splitlines():
        name, shape, dtype = line.split("\t")
        rows.append((name, tuple(int(x) for x in shape.strip("()").split(",") if x.strip()), dtype))
    return rows


def meta_model(name="pi05", **kw):
    with torch.device("meta"):
        return Pi05Model(get_config(name, **kw))


def test_pi05_meta_state_dict_matches_openpi_exactly():
    rows = tsv_rows()
    assert len(rows) == 813
    sd = meta_model().state_dict()
    mine = [(k, tuple(v.shape), str(v.dtype)) for k, v in sd.items()]
    missing = sorted(set(r[0] for r in rows) - set(sd))
    extra = sorted(set(sd) - set(r[0] for r in rows))
    assert not missing and not extra, (missing[:5], extra[:5])
    diffs = [(a, b) for a, b in zip(mine, rows) if a != b]
    assert not diffs, diffs[:5]
    assert sum(v.dtype == torch.float32 for v in sd.values()) == 122


def test_pi05_parameter_count_and_tie():
    m = meta_model()
    lm = m.paligemma_with_expert.paligemma
    assert lm.lm_head.weight is lm.model.language_model.embed_tokens.weight
    unique = sum(p.numel() for p in m.parameters())              # tied pair counted once
    expert_head = m.paligemma_with_expert.gemma_expert.lm_head.weight.numel()
    assert abs((unique - expert_head) / 1e9 - 3.35) < 0.02, unique


def test_shapes_follow_the_config():
    m = meta_model("pi05", vlm={"num_heads": 4, "num_kv_heads": 2, "head_dim": 128},
                   expert={"num_heads": 4, "num_kv_heads": 2, "head_dim": 128}, action_dim=14, num_cameras=2)
    sd = m.state_dict()
    p = "paligemma_with_expert.paligemma.model.language_model.layers.0.self_attn."
    assert tuple(sd[p + "q_proj.weight"].shape) == (512, 2048)
    assert tuple(sd[p + "k_proj.weight"].shape) == (256, 2048)
    e = "paligemma_with_expert.gemma_expert.model.layers.0.self_attn."
    assert tuple(sd[e + "o_proj.weight"].shape) == (1024, 512)
    assert tuple(sd["action_in_proj.weight"].shape) == (1024, 14)
    assert m.cfg.prefix_len == 2 * 256 + 200


def _inputs(cfg, n_tokens=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    S = cfg.image_size
    return (torch.rand(1, 3, 3, S, S, generator=g) * 2 - 1, torch.ones(1, 3, dtype=torch.bool),
            torch.randint(3, cfg.vocab_size, (1, n_tokens), generator=g), torch.ones(1, n_tokens, dtype=torch.bool))


def _rel_err(a, b):
    return float((a - b).abs().max() / b.abs().max())


def test_non_default_heads_match_the_reference():
    """6 query heads on 2 KV heads (head_dim 8): the shapes follow the config and the numbers are the naive
    reference's (query head h reads KV head h // 3, as in Gemma), not merely finite (pitfall C)."""
    cfg = get_config("tiny", vlm={"num_heads": 6, "num_kv_heads": 2, "head_dim": 8},
                     expert={"num_heads": 6, "num_kv_heads": 2, "head_dim": 8})
    m = randomize_parameters(build_model(cfg, seed=6), seed=6)
    images, im, tokens, tm = _inputs(cfg)
    prefix = m.prefill(images, im, tokens, tm, want_logits=True)
    assert prefix.k[0].shape == (1, cfg.num_image_tokens + 5, 2, 8)
    noise = torch.randn(1, cfg.action_horizon, cfg.action_dim, generator=torch.Generator().manual_seed(1))
    a = m.sample_actions(prefix, noise, num_steps=2)
    assert a.shape == (1, cfg.action_horizon, cfg.action_dim)
    assert _rel_err(a[0], reference_actions(m, images[0], im[0], tokens[0], tm[0], noise[0], 2)) <= 1e-5
    ref_logits, _, _ = joint_forward(m, images[0], im[0], tokens[0], tm[0])
    assert _rel_err(prefix.last_logits[0], ref_logits[-1]) <= 1e-5


def test_bench_cpu_preset_is_fixed():
    c = get_config("bench-cpu")
    assert (c.vision.depth, c.vision.width, c.vision.num_heads, c.vision.mlp_dim, c.vision.patch_size,
            c.vision.image_size, c.image_tokens_per_camera) == (4, 256, 4, 1024, 14, 224, 256)
    assert (c.vlm.depth, c.vlm.width, c.vlm.num_heads, c.vlm.num_kv_heads, c.vlm.head_dim, c.vlm.mlp_dim) == \
        (6, 256, 4, 1, 64, 1024)
    assert (c.expert.depth, c.expert.width, c.expert.num_heads, c.expert.num_kv_heads, c.expert.head_dim,
            c.expert.mlp_dim, c.expert.adarms) == (6, 128, 4, 1, 64, 512, True)
    assert (c.vocab_size, c.num_cameras, c.max_token_len, c.action_horizon, c.num_denoise_steps, c.action_dim,
            c.dtype) == (8192, 3, 100, 10, 10, 32, "float32")


def test_pi05_preset_numbers():
    c = get_config("pi05")
    assert (c.vision.width, c.vision.depth, c.vision.num_heads, c.vision.mlp_dim, c.image_tokens_per_camera) == \
        (1152, 27, 16, 4304, 256)
    assert (c.vlm.width, c.vlm.depth, c.vlm.mlp_dim, c.expert.width, c.expert.mlp_dim) == (2048, 18, 16384, 1024, 4096)
    assert (c.vocab_size, c.max_token_len, c.action_horizon, c.num_denoise_steps, c.dtype) == \
        (257152, 200, 50, 10, "bfloat16")
    assert c.prefix_attention == "image_isolated" and (c.pad_id, c.eos_id, c.bos_id) == (0, 1, 2)
    assert get_config("pi05", action_horizon=10).action_horizon == 10


def test_invalid_configs_refused():
    with pytest.raises(ValueError, match="prefix_attention"):
        get_config("tiny", prefix_attention="causal")
    with pytest.raises(ValueError, match="unknown preset"):
        get_config("pi0")
    with pytest.raises(ValueError, match="joint attention"):
        get_config("tiny", expert={"head_dim": 32})
    with pytest.raises(ValueError, match="dtype"):
        get_config("tiny", dtype="int8")
    assert get_config("tiny", dtype="bf16").dtype == "bfloat16" == get_config("tiny", dtype=torch.bfloat16).dtype
    with pytest.raises(ValueError, match="unknown config fields"):
        get_config("tiny", horizon=5)


def test_dtype_plan_and_bf16_runs():
    assert keeps_fp32("time_mlp_in.weight") and keeps_fp32(
        "paligemma_with_expert.gemma_expert.model.layers.3.input_layernorm.dense.bias")
    assert not keeps_fp32("paligemma_with_expert.paligemma.model.vision_tower.vision_model.post_layernorm.weight")
    m = randomize_parameters(build_model(get_config("tiny"), dtype="bfloat16"))
    assert m.dtype == torch.bfloat16 and m.time_mlp_in.weight.dtype == torch.float32
    prefix = m.prefill(*_inputs(m.cfg), want_logits=True)
    assert prefix.k[0].dtype == torch.bfloat16 and prefix.last_logits.dtype == torch.float32
    noise = torch.randn(1, m.cfg.action_horizon, m.cfg.action_dim, generator=torch.Generator().manual_seed(2))
    a = m.sample_actions(prefix, noise, num_steps=2)
    assert a.dtype == torch.float32
    # the same weights computed in fp32: bf16 differs by rounding only (~0.2-0.5% here), not by a wrong path
    m32 = copy.deepcopy(m)
    m32.apply_dtype_plan(torch.float32)
    p32 = m32.prefill(*_inputs(m.cfg), want_logits=True)
    assert _rel_err(a, m32.sample_actions(p32, noise, num_steps=2)) < 3e-2
    assert _rel_err(prefix.last_logits, p32.last_logits) < 3e-2
    from oxygen_ros.model import DecodeBatch
    P = prefix.length
    outs = []
    for pool_dtype in (torch.bfloat16, torch.float32):          # the pool's dtype may differ from the model's
        kv = SimpleNamespace(k=[torch.zeros(P + 1, 1, m.cfg.head_dim, dtype=pool_dtype) for _ in prefix.k],
                             v=[torch.zeros(P + 1, 1, m.cfg.head_dim, dtype=pool_dtype) for _ in prefix.v])
        for l in range(m.cfg.num_layers):
            kv.k[l][:P], kv.v[l][:P] = prefix.k[l][0], prefix.v[l][0]
        out = m.decode(DecodeBatch(torch.tensor([7]), prefix.next_position, torch.tensor([P]),
                                   torch.arange(P + 1)[None], torch.ones(1, P + 1, dtype=torch.bool)), kv)
        assert out.logits.dtype == torch.float32 and torch.isfinite(out.logits).all()
        assert kv.k[0][P].abs().sum() > 0                      # the new token's K was written
        outs.append(out.logits)
    assert torch.equal(outs[0], outs[1])                        # bf16 K/V round-trip exactly through either pool


def test_model_package_never_imports_rclpy():
    src = "\n".join(p.read_text() for p in (ROOT / "oxygen_ros" / "model").glob("*.py"))
    assert "rclpy" not in src.replace("never rclpy", "").replace("never imports rclpy", "")
    code = "import sys, oxygen_ros.model; assert 'rclpy' not in sys.modules, 'rclpy imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_timing_helper_runs():
    from oxygen_ros.model.timing import measure
    r = measure("tiny", repeats=1, decode_batches=(2,))
    assert r["prefix_len"] == 3 * 49 + get_config("tiny").max_token_len
    assert all(r[k] > 0 for k in ("prefill_ms", "sample_actions_ms", "frame_ms", "decode_b2_ms"))
