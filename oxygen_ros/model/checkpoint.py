"""Loading and saving pi0.5 checkpoints, safetensors only (never pickle / torch.load).

Reads a converted openpi PyTorch directory (``model.safetensors``, ``config.json`` with ``action_dim,
action_horizon, paligemma_variant, action_expert_variant, precision``, ``assets/<asset_id>/norm_stats.json``, optional
``paligemma_tokenizer.model``) and LeRobot ``pi05`` files (keys prefixed ``model.``, older ``action_time_mlp_*`` renamed
to ``time_mlp_*``, stats in ``policy_{pre,post}processor_step_*_{normalizer,unnormalizer}_processor.safetensors``).
The tied LM head is stored once, as ``paligemma.lm_head.weight``, and copied into
``embed_tokens``; the unused expert ``lm_head`` is ignored; every other key is checked strictly (a ``CheckpointError``
lists missing / unexpected / mis-shaped keys).  Parameters keep the model's dtype plan (fp32 for SigLIP's
patch/position embeddings, the Gemma (ada)RMS norms and the action/time projections; SigLIP's LayerNorms in the model
dtype).  ``save_checkpoint`` writes both layouts (used by tests and to make tiny checkpoints; non-pi05 presets are
named in config.json as ``oxygen_preset``).
"""
from __future__ import annotations

import glob
import json
import os
from typing import NamedTuple

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .config import Pi05Config, apply_overrides, get_config
from .pi05 import Pi05Model
from .processing import NormStats
from .tokenizer import load_tokenizer

WEIGHTS = "model.safetensors"
CONFIG = "config.json"
LM_HEAD = "paligemma_with_expert.paligemma.lm_head.weight"
EMBED = "paligemma_with_expert.paligemma.model.language_model.embed_tokens.weight"
EXPERT_LM_HEAD = "paligemma_with_expert.gemma_expert.lm_head.weight"
_RENAMES = (("action_time_mlp_in.", "time_mlp_in."), ("action_time_mlp_out.", "time_mlp_out."))
_VARIANTS = {("gemma_2b", "gemma_300m")}
_PRECISIONS = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float32": "float32", "fp32": "float32",
               "float16": "float16", "fp16": "float16"}


class CheckpointError(RuntimeError):
    pass


class LoadedPolicy(NamedTuple):
    model: Pi05Model
    cfg: Pi05Config
    norm_stats: NormStats | None
    tokenizer: object


# ------------------------------------------------------------------------------------------------------------------
# config.json
# ------------------------------------------------------------------------------------------------------------------


def config_from_json(d: dict, **overrides) -> Pi05Config:
    """openpi / LeRobot / oxygen config.json -> Pi05Config (overrides win)."""
    if not isinstance(d, dict):
        raise CheckpointError("config.json must hold a JSON object")
    try:
        if "oxygen_config" in d:
            cfg = Pi05Config.from_dict(d["oxygen_config"])
        else:
            preset = d.get("oxygen_preset", "pi05")
            cfg = get_config(preset)
        if d.get("type") == "pi05" or "chunk_size" in d:                  # LeRobot PI05Config
            horizon = d.get("chunk_size", cfg.action_horizon)
            adim = d.get("max_action_dim", cfg.action_dim)
            prec = d.get("dtype", cfg.dtype)
            max_len = d.get("tokenizer_max_length", cfg.max_token_len)
        else:                                                             # openpi
            horizon = d.get("action_horizon", cfg.action_horizon)
            adim = d.get("action_dim", cfg.action_dim)
            prec = d.get("precision", cfg.dtype)
            max_len = d.get("max_token_len", cfg.max_token_len)
        pv, ev = d.get("paligemma_variant"), d.get("action_expert_variant")
        if "oxygen_preset" not in d and "oxygen_config" not in d and (pv, ev) not in _VARIANTS:
            raise CheckpointError(f"config.json: unsupported variants paligemma_variant={pv!r}, "
                                  f"action_expert_variant={ev!r} (supported: gemma_2b + gemma_300m)")
        if prec not in _PRECISIONS:
            raise CheckpointError(f"config.json: unknown precision {prec!r}")
        cfg = cfg.replace(action_horizon=int(horizon), action_dim=int(adim), dtype=_PRECISIONS[prec],
                          max_token_len=int(max_len),
                          discrete_state_input=bool(d.get("discrete_state_input", cfg.discrete_state_input)))
        return apply_overrides(cfg, **overrides) if overrides else cfg
    except CheckpointError:
        raise
    except (TypeError, ValueError, KeyError) as e:
        raise CheckpointError(f"config.json: {e}") from e


def config_to_json(cfg: Pi05Config, layout: str) -> dict:
    if layout == "lerobot":
        d = {"type": "pi05", "chunk_size": cfg.action_horizon, "n_action_steps": cfg.action_horizon,
             "max_action_dim": cfg.action_dim, "max_state_dim": cfg.action_dim, "dtype": cfg.dtype,
             "tokenizer_max_length": cfg.max_token_len, "num_inference_steps": cfg.num_denoise_steps,
             "paligemma_variant": "gemma_2b", "action_expert_variant": "gemma_300m"}
    else:
        d = {"action_dim": cfg.action_dim, "action_horizon": cfg.action_horizon, "paligemma_variant": "gemma_2b",
             "action_expert_variant": "gemma_300m", "precision": cfg.dtype, "pi05": True,
             "max_token_len": cfg.max_token_len, "discrete_state_input": cfg.discrete_state_input}
    if cfg.name != "pi05":
        d["oxygen_preset"] = cfg.name
        d["oxygen_config"] = cfg.to_dict()
    return d


# ------------------------------------------------------------------------------------------------------------------
# state dict mapping
# ------------------------------------------------------------------------------------------------------------------


_VISION_TOWER = "paligemma_with_expert.paligemma.model.vision_tower."


def _normalize_keys(sd: dict) -> dict:
    """LeRobot ``model.`` prefix off, ``action_time_mlp_*`` -> ``time_mlp_*``, and a SigLIP tower saved without the
    ``vision_model.`` level (newer transformers flatten it) put back under it."""
    if sd and all(k.startswith("model.") for k in sd):
        sd = {k[len("model."):]: v for k, v in sd.items()}
    out = {}
    for k, v in sd.items():
        for old, new in _RENAMES:
            if k.startswith(old):
                k = new + k[len(old):]
        if k.startswith(_VISION_TOWER) and not k.startswith(_VISION_TOWER + "vision_model."):
            k = _VISION_TOWER + "vision_model." + k[len(_VISION_TOWER):]
        out[k] = v
    return out


def _expected(model: Pi05Model) -> dict:
    """key -> (shape, dtype) of the parameters a file must provide (tied lm_head and expert lm_head excluded)."""
    sd = model.state_dict(keep_vars=True)
    return {k: (tuple(v.shape), v.dtype) for k, v in sd.items() if k not in (LM_HEAD, EXPERT_LM_HEAD)}


def check_state_dict(sd: dict, expected: dict) -> None:
    missing = sorted(set(expected) - set(sd))
    unexpected = sorted(set(sd) - set(expected))
    misshaped = sorted(f"{k}: file {tuple(sd[k].shape)} != model {expected[k][0]}"
                       for k in set(sd) & set(expected) if tuple(sd[k].shape) != expected[k][0])
    if missing or unexpected or misshaped:
        lines = [f"checkpoint does not match the model ({len(missing)} missing, {len(unexpected)} unexpected, "
                 f"{len(misshaped)} mis-shaped keys)"]
        for title, keys in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", misshaped)):
            if keys:
                lines.append(f"{title}:")
                lines += [f"  {k}" for k in keys[:50]]
                if len(keys) > 50:
                    lines.append(f"  ... and {len(keys) - 50} more")
        raise CheckpointError("\n".join(lines))


def check_finite(sd: dict, order=None) -> None:
    """Raise CheckpointError naming the first tensor (in ``order``, default: sorted keys) that holds NaN or inf:
    such weights load and run, but every action chunk comes out non-finite."""
    for k in (order or sorted(sd)):
        t = sd[k]
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise CheckpointError(f"weight {k} {tuple(t.shape)} has {bad} non-finite value(s) (NaN/inf): the "
                                  "checkpoint is corrupt or was saved after a diverged training step")


def load_state_dict_into(model: Pi05Model, sd: dict, device: torch.device | str = "cpu") -> Pi05Model:
    """Map a (normalised) file state dict onto ``model`` (may live on the meta device), strictly, keeping the model's
    per-parameter dtypes.  Returns the model on ``device``."""
    sd = _normalize_keys(sd)
    sd.pop(EXPERT_LM_HEAD, None)
    if EMBED not in sd and LM_HEAD in sd:
        sd[EMBED] = sd.pop(LM_HEAD)
    else:
        sd.pop(LM_HEAD, None)
    expected = _expected(model)
    check_state_dict(sd, expected)
    check_finite(sd, order=expected)
    # copy=True: fresh, aligned storage per tensor (views into the file buffer can take other BLAS paths)
    tensors = {k: sd[k].to(device=device, dtype=expected[k][1], copy=True).contiguous() for k in expected}
    dev = torch.device(device)
    tensors[LM_HEAD] = tensors[EMBED]
    model.load_state_dict(tensors, strict=True, assign=True)       # the expert lm_head (UnusedLMHead) is not a key
    model.tie_weights()
    model.paligemma_with_expert.gemma_expert.lm_head.reset(dev)
    emb = model.vision.embeddings                     # non-persistent buffer (unused by our forward)
    emb.position_ids = torch.arange(emb.num_positions, device=dev).expand((1, -1))
    return model.to(dev)


# ------------------------------------------------------------------------------------------------------------------
# load / save
# ------------------------------------------------------------------------------------------------------------------


LEROBOT_NORMALIZER = "policy_preprocessor_step_*_normalizer_processor.safetensors"
LEROBOT_UNNORMALIZER = "policy_postprocessor_step_*_unnormalizer_processor.safetensors"


def _find_norm_stats(path: str) -> str | None:
    cands = sorted(glob.glob(os.path.join(path, "assets", "*", "norm_stats.json")))
    cands += [p for p in (os.path.join(path, "norm_stats.json"),) if os.path.isfile(p)]
    return cands[0] if cands else None


def _lerobot_norm_stats(path: str) -> NormStats | None:
    """LeRobot keeps stats in processor files: ``observation.state.<stat>`` (preprocessor normalizer) and
    ``action.<stat>`` (postprocessor unnormalizer, or the preprocessor), stat in mean/std/q01/q99/..."""
    files = sorted(glob.glob(os.path.join(path, LEROBOT_NORMALIZER))) + \
        sorted(glob.glob(os.path.join(path, LEROBOT_UNNORMALIZER)))
    if not files:
        return None
    flat = {}
    for f in files:
        flat.update({k: v.float().numpy() for k, v in _read_weights(f).items()})
    d = {}
    for feature, name in (("observation.state", "state"), ("action", "actions")):
        stats = {stat: flat[f"{feature}.{stat}"].reshape(-1).tolist() for stat in ("mean", "std", "q01", "q99")
                 if f"{feature}.{stat}" in flat}
        if stats:
            d[name] = stats
    return NormStats.from_dict({"norm_stats": d}) if d else None


def _read_weights(file: str) -> dict:
    if not os.path.isfile(file):
        raise CheckpointError(f"missing weights file: {file}")
    try:
        return load_file(file, device="cpu")
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"cannot read {file} (corrupt or not a safetensors file): {e}") from e


def load_checkpoint(path: str | os.PathLike, device: str | torch.device = "cpu",
                    dtype: torch.dtype | str | None = None, asset_id: str | None = None,
                    tokenizer_path: str | os.PathLike | None = None, **config_overrides) -> LoadedPolicy:
    """Directory -> LoadedPolicy(model (eval), cfg, norm_stats or None, tokenizer).  ``dtype`` overrides the
    checkpoint's precision; ``asset_id`` picks ``assets/<asset_id>/norm_stats.json`` (default: the only/first one);
    ``config_overrides`` go to the config (e.g. ``prefix_attention="upstream"``, ``num_denoise_steps=5``)."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint directory not found: {path}")
    cfg_file = os.path.join(path, CONFIG)
    if not os.path.isfile(cfg_file):
        raise CheckpointError(f"missing {CONFIG} in {path}")
    try:
        with open(cfg_file) as f:
            raw = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"bad {cfg_file}: {e}") from e
    if dtype is not None:
        config_overrides["dtype"] = str(dtype)       # "bfloat16" | "bf16" | torch.float32 ...
    cfg = config_from_json(raw, **config_overrides)
    sd = _read_weights(os.path.join(path, WEIGHTS))
    with torch.device("meta"):
        model = Pi05Model(cfg)
    model = load_state_dict_into(model, sd, device).eval()
    model.requires_grad_(False)

    norm_stats = None
    ns_file = os.path.join(path, "assets", asset_id, "norm_stats.json") if asset_id else _find_norm_stats(path)
    if asset_id and not os.path.isfile(ns_file):
        raise CheckpointError(f"missing norm stats: {ns_file}")
    if ns_file:
        try:
            norm_stats = NormStats.load(ns_file)
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"bad norm stats {ns_file}: {e}") from e
    else:
        norm_stats = _lerobot_norm_stats(path)
    try:
        tokenizer = load_tokenizer(cfg, checkpoint_dir=path, path=tokenizer_path)
    except (FileNotFoundError, ValueError, RuntimeError, OSError) as e:
        raise CheckpointError(str(e)) from e
    return LoadedPolicy(model, cfg, norm_stats, tokenizer)


def save_checkpoint(model: Pi05Model, path: str | os.PathLike, layout: str = "openpi",
                    norm_stats: NormStats | None = None, asset_id: str = "robot") -> None:
    """Write ``model.safetensors`` + ``config.json`` (+ ``assets/<asset_id>/norm_stats.json``).  The tied weight is
    stored only as ``paligemma.lm_head.weight``; ``layout="lerobot"`` prefixes keys with ``model.``."""
    if layout not in ("openpi", "lerobot"):
        raise ValueError(f"layout must be 'openpi' or 'lerobot', got {layout!r}")
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    tensors = {}
    for k, v in model.state_dict().items():
        if k == EMBED:
            continue
        tensors[("model." if layout == "lerobot" else "") + k] = v.detach().cpu().contiguous()
    save_file(tensors, os.path.join(path, WEIGHTS), metadata={"format": "pt"})
    with open(os.path.join(path, CONFIG), "w") as f:
        json.dump(config_to_json(model.cfg, layout), f, indent=2)
    if norm_stats is not None and layout == "openpi":
        os.makedirs(os.path.join(path, "assets", asset_id), exist_ok=True)
        norm_stats.save(os.path.join(path, "assets", asset_id, "norm_stats.json"))
    elif norm_stats is not None:                     # LeRobot: processor safetensors files
        for fname, feature, stats in (
                (LEROBOT_NORMALIZER.replace("*", "3"), "observation.state", norm_stats.state),
                (LEROBOT_UNNORMALIZER.replace("*", "0"), "action", norm_stats.actions)):
            if stats is not None:
                save_file({f"{feature}.{k}": torch.tensor(v, dtype=torch.float32)
                           for k, v in stats.to_dict().items()}, os.path.join(path, fname))
