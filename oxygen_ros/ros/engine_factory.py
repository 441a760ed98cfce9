"""From node parameters to a running engine: load the checkpoint (or build random weights of a preset), build the
``Processor`` and the ``Engine`` (which preallocates the KV pool).

This file owns the mapping from ``Settings`` to model / processor / engine configuration and the checks that need
the model (joint-name counts against the model's and the norm stats' dimensions).  Errors the user can fix are
``ConfigureError`` with the reason; the node turns them into a failed *configure*.  torch is imported only when an
engine is built, so ``--help``, parameter listing and diagnostics need no torch.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Optional

from .parameters import ConfigureError, Settings

__all__ = ["BuiltEngine", "build_engine", "resolve_checkpoint", "SHIPPED"]

# `checkpoint: demo` = the policy shipped with the package, trained on the simulation (checkpoints/demo/README.md)
SHIPPED = ("demo",)


def resolve_checkpoint(value: str) -> str:
    """The checkpoint directory a ``checkpoint`` parameter names: a shipped name (``demo``: ``checkpoints/demo`` of
    the source checkout or ``share/oxygen_ros/checkpoints/demo`` of the install) or a path (``~`` expanded)."""
    if value in SHIPPED:
        from pathlib import Path  # noqa: PLC0415
        here = Path(__file__).resolve().parents[2] / "checkpoints" / value
        if here.is_dir():
            return str(here)
        try:
            from ament_index_python.packages import get_package_share_directory  # noqa: PLC0415
            return os.path.join(get_package_share_directory("oxygen_ros"), "checkpoints", value)
        except Exception:  # noqa: BLE001 - not installed: report the checkout path as missing
            return str(here)
    return os.path.expanduser(value)


@dataclass
class BuiltEngine:
    engine: object               # oxygen_ros.engine.Engine (or a test stand-in with submit/cycle/metrics)
    info: str                    # one line for the log and /diagnostics
    action_dims: int             # published action columns
    horizon: int                 # rows per chunk
    state_dim_max: Optional[int] = None   # longest state vector the model takes
    image_size: int = 224                 # the model's square camera input (frames are resized with pad to it)
    max_requests: int = 16                # language requests the engine decodes at once (its batch capacity)


def build_engine(settings: Settings, *, on_actions: Callable, on_token: Callable, on_finished: Callable) -> BuiltEngine:
    import torch  # noqa: PLC0415
    from oxygen_ros.engine.engine import Engine, EngineConfig  # noqa: PLC0415
    from oxygen_ros.model import (Processor, SamplingParams, build_model, get_config,  # noqa: PLC0415
                                  load_checkpoint, load_tokenizer)
    from oxygen_ros.model.compiled import resolve_compile, resolve_device  # noqa: PLC0415

    s = settings
    if int(s.torch_threads) > 0:
        torch.set_num_threads(int(s.torch_threads))
    device = resolve_device(s.device)
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigureError(f"device {device!r} requested but CUDA is not available")
    compile_mode = resolve_compile(s.compile, device)
    dtype = s.dtype or None
    overrides = {}
    if s.prefix_attention:
        overrides["prefix_attention"] = s.prefix_attention
    if s.horizon > 0:
        overrides["action_horizon"] = int(s.horizon)
    if s.denoise_steps > 0:
        overrides["num_denoise_steps"] = int(s.denoise_steps)
    ckpt = resolve_checkpoint(s.checkpoint) if s.checkpoint else ""
    norm_stats = None
    if ckpt:
        from oxygen_ros.model.checkpoint import CheckpointError  # noqa: PLC0415
        try:
            pol = load_checkpoint(ckpt, device=device, dtype=dtype, **overrides)
        except CheckpointError as exc:
            raise ConfigureError(f"cannot load checkpoint {ckpt!r}: {exc}") from exc
        model, cfg, norm_stats, tok = pol.model, pol.cfg, pol.norm_stats, pol.tokenizer
        info = f"checkpoint {ckpt} ({cfg.name}, H={cfg.action_horizon}, {cfg.dtype}, {device})"
    else:
        try:
            cfg = get_config(s.preset, **overrides)
        except ValueError as exc:
            raise ConfigureError(str(exc)) from exc
        model = build_model(cfg, device=device, dtype=dtype, seed=int(s.seed))
        cfg = model.cfg
        tok = load_tokenizer(cfg)
        info = (f"RANDOM weights, preset {cfg.name} (H={cfg.action_horizon}, {cfg.dtype}, {device}): "
                "actions and text are meaningless; set `checkpoint` for a real model")
    action_names, state_names = s.action_names, s.state_names
    ns_dims = norm_stats.action_dim if norm_stats is not None else None
    if action_names:
        if len(action_names) > cfg.action_dim:
            raise ConfigureError(f"action_joint_names has {len(action_names)} names, more than the model's "
                                 f"action_dim {cfg.action_dim}")
        if ns_dims is not None and len(action_names) > ns_dims:
            raise ConfigureError(f"action_joint_names has {len(action_names)} names but the checkpoint's norm stats "
                                 f"cover {ns_dims} action dimensions")
        action_dims = len(action_names)
    else:
        action_dims = ns_dims or cfg.action_dim
    if state_names and len(state_names) > cfg.action_dim:
        raise ConfigureError(f"state_joint_names has {len(state_names)} names, more than the model's state size "
                             f"{cfg.action_dim}")
    processor = Processor(cfg, tok, norm_stats, action_dims=action_dims)
    rate = float(s.frame_rate_hz)
    ec = EngineConfig(
        mode=s.engine_mode,
        decode_k="adaptive" if s.adaptive_k else int(s.decode_k),
        max_new_tokens=int(s.max_new_tokens),
        target_period_s=(1.0 / rate) if rate > 0 else None,
        kv_budget_mb=float(s.kv_budget_mb) or None,
        denoise_steps=int(s.denoise_steps) or None,
        seed=int(s.seed),
        max_wait_frames=int(s.max_wait_cycles) or None,
        sampling=(SamplingParams(temperature=float(s.temperature), top_p=float(s.top_p))
                  if s.temperature > 0 else None),
        memory_prompt=s.memory_prompt,
        # memory requests are scheduled by the pipeline on the node's clock (sim time, bag time), not here
        memory_interval_s=None,
        compile=compile_mode,
    )
    engine = Engine(model, processor, ec, on_actions=on_actions, on_token=on_token, on_finished=on_finished)
    info += f"; engine {ec.mode}, k={ec.decode_k}, KV {engine.pool.capacity_bytes / 2**20:.1f} MiB"
    info += f"; device {device}{' (auto)' if s.device in ('', 'auto') else ''}, dtype {cfg.dtype}"
    cs = engine.warmup()                    # graphs are built here (configure), never in a control cycle
    info += f"; compile {cs['compile']}{' (auto)' if s.compile == 'auto' else ''}"
    if compile_mode != "none":
        info += f" ({cs['compile_graphs']} graphs in {cs['compile_s']:.1f} s"
        info += f", FELL BACK TO EAGER: {cs['compile_error']})" if cs["compile_error"] else ")"
    return BuiltEngine(engine, info, processor.action_dims, cfg.action_horizon, cfg.action_dim, cfg.image_size,
                       ec.max_batch)
