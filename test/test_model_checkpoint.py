"""Checkpoint IO of ``oxygen_ros/model/checkpoint.py`` on tiny models saved in the real file layouts: openpi
(``model.safetensors`` with the tied weight stored only as ``paligemma.lm_head.weight`` + ``config.json`` +
``assets/<id>/norm_stats.json``) and LeRobot (``model.`` prefix, older ``action_time_mlp_*`` names) load back
bit-exactly with the fp32 dtype plan (the models hold random values in every parameter, norms included, so a loader
that swaps or drops a tensor is seen); the unused expert lm_head is ignored; corrupted, mismatched and missing files
fail with a ``CheckpointError`` that lists the offending keys; nothing is ever unpickled.
"""
import json
import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from model_fixtures import neutral_parameters, randomize_parameters
from oxygen_ros.model import (ByteTokenizer, CheckpointError, NormStats, build_model, get_config, load_checkpoint,
                              save_checkpoint)
from oxygen_ros.model.checkpoint import EMBED, EXPERT_LM_HEAD, LM_HEAD

STATS = NormStats.from_dict({"norm_stats": {"state": {"mean": [0, 0], "std": [1, 1], "q01": [-1, -2],
                                                      "q99": [1, 2]},
                                            "actions": {"q01": [0, 0, 0], "q99": [1, 2, 3]}}})


@pytest.fixture(scope="module")
def tiny():
    m = randomize_parameters(build_model(get_config("tiny"), seed=4), seed=4)
    assert neutral_parameters(m) == []
    return m


def same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert sa[k].dtype == sb[k].dtype, k
        assert torch.equal(sa[k], sb[k]), k
    return True


def outputs(model):
    S = model.cfg.image_size
    g = torch.Generator().manual_seed(0)
    prefix = model.prefill(torch.rand(1, 3, 3, S, S, generator=g), torch.tensor([[True, False, True]]),
                           torch.randint(3, 300, (1, 8), generator=g), torch.ones(1, 8, dtype=torch.bool),
                           want_logits=True)
    return prefix.last_logits, model.sample_actions(prefix, torch.ones(1, model.cfg.action_horizon,
                                                                        model.cfg.action_dim), 2)


@pytest.mark.parametrize("layout", ["openpi", "lerobot"])
def test_round_trip_bit_exact(tiny, tmp_path, layout):
    save_checkpoint(tiny, tmp_path, layout=layout, norm_stats=STATS)
    keys = load_file(tmp_path / "model.safetensors")
    prefix = "model." if layout == "lerobot" else ""
    assert prefix + LM_HEAD in keys and prefix + EMBED not in keys      # tied weight stored once, as lm_head
    assert all(k.startswith(prefix) for k in keys)
    policy = load_checkpoint(tmp_path)
    model, cfg, stats, tok = policy
    assert cfg == tiny.cfg
    assert same_weights(tiny, model)
    assert model.lm_head.weight is model.vlm.embed_tokens.weight
    head = model.paligemma_with_expert.gemma_expert.lm_head.weight          # unused: shape only, no memory
    assert head.shape == (cfg.vocab_size, cfg.expert.width) and head.stride() == (0, 0)
    for a, b in zip(outputs(tiny), outputs(model)):
        assert torch.equal(a, b)
    assert np.allclose(stats.actions.q99, [1, 2, 3]) and np.allclose(stats.state.q01, [-1, -2])
    assert isinstance(tok, ByteTokenizer)
    if layout == "lerobot":                 # stats in LeRobot's processor files, not assets/
        assert not (tmp_path / "assets").exists()
        assert load_file(tmp_path / "policy_preprocessor_step_3_normalizer_processor.safetensors")[
            "observation.state.q99"].tolist() == [1, 2]


def test_bf16_checkpoint_keeps_fp32_plan(tmp_path):
    m = randomize_parameters(build_model(get_config("tiny"), dtype="bfloat16", seed=5), seed=5)
    assert neutral_parameters(m) == []
    save_checkpoint(m, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["precision"] == "bfloat16" and cfg["action_horizon"] == 10 and cfg["action_dim"] == 32
    loaded = load_checkpoint(tmp_path).model
    assert same_weights(m, loaded)
    assert loaded.time_mlp_in.weight.dtype == torch.float32 and loaded.vlm.embed_tokens.weight.dtype == torch.bfloat16
    up = load_checkpoint(tmp_path, dtype=torch.float32).model           # upcast on request
    assert up.vlm.embed_tokens.weight.dtype == torch.float32
    assert torch.equal(up.vlm.embed_tokens.weight, m.vlm.embed_tokens.weight.float())


def test_lerobot_old_names_and_expert_head_ignored(tiny, tmp_path):
    sd = {("model." + k).replace("model.time_mlp_", "model.action_time_mlp_"): v.contiguous()
          for k, v in tiny.state_dict().items() if k != EMBED}
    sd["model." + EXPERT_LM_HEAD] = torch.randn(sd["model." + EXPERT_LM_HEAD].shape)    # garbage: unused
    vt = "model.paligemma_with_expert.paligemma.model.vision_tower."        # flattened SigLIP (newer transformers)
    sd = {k.replace(vt + "vision_model.", vt): v for k, v in sd.items()}
    assert "model.action_time_mlp_in.weight" in sd
    save_file(sd, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({"type": "pi05", "chunk_size": 10, "max_action_dim": 32,
                                                      "dtype": "float32", "oxygen_preset": "tiny"}))
    loaded = load_checkpoint(tmp_path).model
    for k, v in tiny.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k]), k


def test_openpi_config_json_maps_to_pi05(tmp_path):
    from oxygen_ros.model.checkpoint import config_from_json
    cfg = config_from_json({"action_dim": 32, "action_horizon": 10, "paligemma_variant": "gemma_2b",
                            "action_expert_variant": "gemma_300m", "precision": "bfloat16"})
    assert cfg.name == "pi05" and cfg.action_horizon == 10 and cfg.dtype == "bfloat16" and cfg.vocab_size == 257152
    with pytest.raises(CheckpointError, match="variants"):
        config_from_json({"action_dim": 32, "paligemma_variant": "gemma_2b_lora", "action_expert_variant": "x"})


def _save_mutated(tiny, path, mutate):
    sd = {k: v.contiguous() for k, v in tiny.state_dict().items() if k != EMBED}
    mutate(sd)
    save_file(sd, os.path.join(path, "model.safetensors"))
    save_checkpoint_config(tiny, path)


def save_checkpoint_config(model, path):
    from oxygen_ros.model.checkpoint import config_to_json
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config_to_json(model.cfg, "openpi"), f)


def test_mismatched_keys_are_listed(tiny, tmp_path):
    q = "paligemma_with_expert.paligemma.model.language_model.layers.1.self_attn.q_proj.weight"
    n = "paligemma_with_expert.gemma_expert.model.norm.dense.bias"

    def mutate(sd):
        del sd[q]
        sd["paligemma_with_expert.some_new.weight"] = torch.zeros(3)
        sd[n] = torch.zeros(7)
    _save_mutated(tiny, tmp_path, mutate)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(tmp_path)
    msg = str(e.value)
    assert "1 missing, 1 unexpected, 1 mis-shaped" in msg
    assert q in msg and "paligemma_with_expert.some_new.weight" in msg and f"{n}: file (7,)" in msg


def test_wrong_preset_is_a_shape_error(tiny, tmp_path):
    save_checkpoint(tiny, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["oxygen_config"]["vlm"]["mlp_dim"] = 96
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="mis-shaped"):
        load_checkpoint(tmp_path)


def test_missing_and_corrupt_files(tiny, tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        load_checkpoint(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="config.json"):
        load_checkpoint(tmp_path)
    save_checkpoint(tiny, tmp_path)
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])                          # truncated
    with pytest.raises(CheckpointError, match="corrupt"):
        load_checkpoint(tmp_path)
    weights.write_bytes(b"\x80\x04\x95 definitely a pickle, never loaded")
    with pytest.raises(CheckpointError, match="corrupt"):
        load_checkpoint(tmp_path)
    weights.unlink()
    with pytest.raises(CheckpointError, match="missing weights"):
        load_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="bad"):
        load_checkpoint(tmp_path)


def test_pi05_config_with_wrong_weights_is_a_shape_error(tmp_path):
    # a real-layout pi05 config.json with (wrong, tiny) weights: the shape check reports it before anything else
    m = build_model(get_config("tiny"))
    sd = {k: v.contiguous() for k, v in m.state_dict().items() if k != EMBED}
    save_file(sd, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({"action_dim": 32, "action_horizon": 10,
                                                      "paligemma_variant": "gemma_2b",
                                                      "action_expert_variant": "gemma_300m", "precision": "float32"}))
    with pytest.raises(CheckpointError, match="mis-shaped"):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weights_are_refused_naming_the_tensor(tiny, tmp_path, bad):
    """A checkpoint with a NaN/inf weight loads and runs (every chunk non-finite) unless it is checked at load."""
    save_checkpoint(tiny, tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    name = "paligemma_with_expert.gemma_expert.model.layers.1.mlp.down_proj.weight"
    sd[name] = sd[name].clone()
    sd[name].view(-1)[3] = bad
    save_file(sd, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.") + r".*1 non-finite"):
        load_checkpoint(tmp_path)


def test_tower_overrides_as_dicts(tiny, tmp_path):
    """get_config's documented dict overrides work for load_checkpoint too (or fail as a CheckpointError)."""
    save_checkpoint(tiny, tmp_path)
    pol = load_checkpoint(tmp_path, vlm={"rms_norm_eps": 1e-5})
    assert pol.cfg.vlm.rms_norm_eps == 1e-5 and pol.cfg.vlm.width == tiny.cfg.vlm.width
    with pytest.raises(CheckpointError, match="no_such_field"):
        load_checkpoint(tmp_path, vlm={"no_such_field": 1})
    with pytest.raises(CheckpointError, match="unknown config fields"):
        load_checkpoint(tmp_path, not_a_field=3)


def test_fused_projections_keep_openpi_tensors(tiny):
    """The model keeps Q/K/V (Gemma and SigLIP) and gate/up stacked in one parameter each (one GEMM), while
    ``state_dict`` shows openpi's separate tensors - views of the stacked parameter, no copy - and
    ``load_state_dict`` stacks them back in the right place; a missing or mis-shaped part is named in openpi's terms."""
    lm = "paligemma_with_expert.paligemma.model.language_model.layers.0."
    vm = "paligemma_with_expert.paligemma.model.vision_tower.vision_model.encoder.layers.0."
    attn, mlp = tiny.vlm.layers[0].self_attn, tiny.vlm.layers[0].mlp
    sv = tiny.vision.encoder.layers[0].self_attn
    sd = tiny.state_dict()
    assert torch.equal(attn.qkv_weight, torch.cat([sd[lm + f"self_attn.{n}_proj.weight"] for n in "qkv"]))
    assert torch.equal(mlp.gate_up_weight, torch.cat([sd[lm + f"mlp.{n}_proj.weight"] for n in ("gate", "up")]))
    assert torch.equal(sv.qkv_bias, torch.cat([sd[vm + f"self_attn.{n}_proj.bias"] for n in "qkv"]))
    assert sd[lm + "self_attn.k_proj.weight"].data_ptr() != attn.qkv_weight.data_ptr()           # a view inside it
    assert sd[lm + "self_attn.k_proj.weight"].untyped_storage().data_ptr() == attn.qkv_weight.data_ptr()
    assert not any("qkv" in k or "gate_up" in k for k in sd)

    # load: SigLIP's q and k (same shape) swapped in the file end up swapped in the stacked parameter
    other = build_model(get_config("tiny"), seed=9)
    swapped = dict(sd)
    swapped[vm + "self_attn.q_proj.weight"], swapped[vm + "self_attn.k_proj.weight"] = \
        sd[vm + "self_attn.k_proj.weight"], sd[vm + "self_attn.q_proj.weight"]
    other.load_state_dict(swapped)
    W = tiny.cfg.vision.width
    ov = other.vision.encoder.layers[0].self_attn.qkv_weight
    assert torch.equal(ov[:W], sv.qkv_weight[W:2 * W]) and torch.equal(ov[W:2 * W], sv.qkv_weight[:W])
    assert torch.equal(ov[2 * W:], sv.qkv_weight[2 * W:])

    missing = {k: v for k, v in sd.items() if k != lm + "mlp.up_proj.weight"}
    with pytest.raises(RuntimeError, match=r"Missing key\(s\).*" + (lm + "mlp.up_proj.weight").replace(".", r"\.")):
        other.load_state_dict(missing)
    bad = dict(sd)
    bad[lm + "self_attn.v_proj.weight"] = torch.zeros(3, tiny.cfg.vlm.width)
    with pytest.raises(RuntimeError, match=r"size mismatch for " + (lm + "self_attn.v_proj.weight").replace(".", r"\.")):
        other.load_state_dict(bad)
