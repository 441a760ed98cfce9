"""Eager vs compiled in ``oxygen bench --compile``: the shapes every engine of a compiled run shares (one set of
graphs), the profiler's operator counts per denoise / decode step (the launch-overhead proxy), the component table
side by side, the compiled-over-eager summary, and the bf16-vs-fp32 action check (``--bf16-check``)."""
from __future__ import annotations

import math
from typing import Optional

import torch

from ...engine.requests import LanguageRequest
from ...kv.cache import KVCacheManager
from ...kv.pool import KVPool
from ...model import Processor, build_model, get_config, load_tokenizer
from ...model.compiled import CompiledModel
from ...model.pi05 import DecodeBatch
from .costs import pool_blocks, sync
from .inputs import make_frames, make_noise


_VIEW_OPS = {"aten::as_strided", "aten::view", "aten::expand", "aten::transpose", "aten::resolve_conj",
             "aten::empty", "aten::reshape", "aten::permute", "aten::t", "aten::slice", "aten::select",
             "aten::unsqueeze", "aten::squeeze", "aten::detach", "aten::alias", "aten::_unsafe_view",
             "aten::lift_fresh", "aten::empty_strided", "aten::_reshape_alias", "aten::resolve_neg",
             "aten::unflatten", "aten::split", "aten::chunk", "aten::narrow", "aten::contiguous",
             "aten::split_with_sizes", "aten::unbind"}


def op_counts(fn, device) -> dict:
    """Operators one call of ``fn`` dispatches, from the profiler: ``ops`` = leaf ATen operators that compute (views
    and allocations left out; on CPU this includes the internals of composite operators, e.g. the ~10 of
    ``F.rms_norm``, and the scalar conversions of ``x + 1e-6``, and leaves out operators with children, e.g. ``mm``);
    ``calls`` = the ATen operators the Python code issues (top level, views left out: one ``linear``, one
    ``scaled_dot_product_attention``, one ``rms_norm`` each); on CUDA also ``kernels`` = device kernels launched.
    Eager: every tensor op is one; compiled: the fused kernels replace them (on CPU inductor's C++ kernels are not
    dispatcher ops, so what is left is the matmuls / attention it calls out to) - the launch-overhead proxy."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.device(device).type == "cuda" else [])
    fn()
    sync(device)
    with profile(activities=acts) as prof:
        fn()
        sync(device)
    ev = prof.events()
    aten = [e for e in ev if e.name.startswith("aten::") and e.name not in _VIEW_OPS]
    ops = sum(1 for e in aten if not e.cpu_children)
    calls = sum(1 for e in aten if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))
    out = {"ops": ops, "calls": calls}
    if torch.device(device).type == "cuda":
        out["kernels"] = sum(1 for e in ev if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA)
    return out


@torch.no_grad()
def step_op_counts(model, processor, obs, S: int, batch: int, num_blocks: Optional[int] = None,
                   block_size: int = 16, pool: Optional[KVPool] = None) -> dict:
    """op_counts of one prefill, one denoise step (one S-step sample_actions / S) and one decode step at ``batch``
    rows."""
    dev = next(model.parameters()).device
    cfg = model.cfg
    mi = processor.prepare(obs)
    args = (mi.images.to(dev), mi.image_masks.to(dev), mi.tokens.to(dev), mi.token_masks.to(dev))
    pre = model.prefill(*args, want_logits=True)
    prefill = op_counts(lambda: model.prefill(*args, want_logits=True), dev)
    noise = torch.zeros((1, cfg.action_horizon, cfg.action_dim), device=dev)
    den = op_counts(lambda: model.sample_actions(pre, noise, S), dev)
    if pool is None:                                  # the run's pool shape (a compiled run passes its pool)
        pool = KVPool.from_config(cfg, num_blocks=num_blocks or (pool_blocks(cfg, block_size) + batch * 4 + 4),
                                  block_size=block_size, dtype=model.dtype, device=dev)
    if isinstance(model, CompiledModel):
        model.warmup(pool)
    kv = KVCacheManager(pool, max_batch=batch)
    fp = kv.store_prefix(pre, 0, frame_index=0, image_positions=cfg.num_image_tokens)
    rows = [kv.admit(LanguageRequest("subtask", "", 8), fp, shared_len=fp.length, first_token=5, max_new_tokens=8,
                     eos_token_id=None) for _ in range(batch)]
    kv.release(fp)
    plan = kv.plan_decode(rows, [1] * batch)
    pos, w, r, m = kv.step_tensors(plan)
    ids = torch.full((batch,), 5, dtype=torch.long, device=dev)
    dec = op_counts(lambda: model.decode(DecodeBatch(ids, pos, w, r, m), pool), dev)
    for st in rows:
        kv.finish(st, "length")
    return {"prefill": prefill, "denoise_step": {k: v / S for k, v in den.items()}, f"decode_step_b{batch}": dec}


@torch.no_grad()
def bf16_check(preset: str = "tiny", seed: int = 0, S: int = 10) -> dict:
    """Action chunk of the same random-weight model, inputs and noise in bf16 vs fp32 (CPU): the tolerance a GPU's
    bf16 run should be judged by."""
    res = {}
    acts = {}
    for dt in ("float32", "bfloat16"):
        cfg = get_config(preset, num_denoise_steps=S)
        model = build_model(cfg, dtype=dt, seed=seed)
        proc = Processor(model.cfg, load_tokenizer(model.cfg))
        obs = make_frames(model.cfg, 1, seed)[0]
        mi = proc.prepare(obs)
        pre = model.prefill(mi.images, mi.image_masks, mi.tokens, mi.token_masks)
        acts[dt] = model.sample_actions(pre, make_noise(model.cfg, 1, seed)[0], S).float()
    a, b = acts["float32"], acts["bfloat16"]
    res = {"preset": preset, "max_abs_diff": float((a - b).abs().max()), "mean_abs_diff": float((a - b).abs().mean()),
           "max_rel_diff": float((a - b).abs().max() / a.abs().max().clamp(min=1e-12)),
           "action_abs_max_fp32": float(a.abs().max())}
    return res


def components_table(eager: dict, comp: dict, ops: Optional[dict], mode: str) -> str:
    rows = [("prefill", eager["prefill_s"], comp["prefill_s"]),
            ("denoise step", eager["denoise_step_s"], comp["denoise_step_s"])]
    rows += [(f"decode step b{b}", eager["decode_step_s"][b], comp["decode_step_s"][b])
             for b in sorted(eager["decode_step_s"])]
    lines = [f"{'component':18s} {'eager ms':>9s} {mode + ' ms':>14s} {'speedup':>8s}"]
    for name, e, c in rows:
        lines.append(f"{name:18s} {e * 1e3:9.3f} {c * 1e3:14.3f} {e / c:7.2f}x")
    if ops:
        for name in ops["eager"]:
            e, c = ops["eager"][name], ops["compiled"][name]
            extra = "".join(f", {k}: {e[k]:.0f} -> {c[k]:.0f}" for k in e if k != "ops")
            lines.append(f"ops per {name}: {e['ops']:.0f} eager -> {c['ops']:.0f} {mode}{extra}")
    return "\n".join(lines)


def compile_shapes(cfg, a, arrivals, k_num: int) -> dict:
    """Engine settings shared by every engine of a compiled run (so that all use the same graphs): batch buckets,
    the largest batch, the KV pool size and the decode context the graphs are built for."""
    Ns = [a.N] + ([int(x) for x in a.sweep_n.split(",")] if a.sweep else [])
    ks = [k_num] + ([int(x) for x in a.sweep_k.split(",")] if a.sweep else [])
    n_max = max(Ns) * (2 if a.mixed_lengths else 1)
    per_frame = max(1, max(len(r) for r in arrivals))
    max_batch = max(16, per_frame * (math.ceil(2 * n_max / min(ks)) + 2))
    per_prefix = pool_blocks(cfg, a.block_size)
    per_req = -(-(cfg.max_token_len + n_max) // a.block_size)
    num_blocks = (max_batch + 2) * per_prefix + max_batch * per_req + 64
    return {"max_batch": max_batch, "kv_num_blocks": num_blocks,
            "compile_batch_sizes": tuple(int(x) for x in a.compile_batch_sizes.split(",")),
            "compile_max_context": cfg.num_image_tokens + cfg.max_token_len + n_max + 16}


def compile_summary(results: dict, eager: dict, comp: dict, mode: str) -> dict:
    """Compiled over eager: component speedups and, per engine mode run both ways, frame time speedup; and the
    compiled oxygen over compiled isolated action Hz."""
    out = {"compiled_denoise_step_speedup": eager["denoise_step_s"] / comp["denoise_step_s"],
           "compiled_prefill_speedup": eager["prefill_s"] / comp["prefill_s"]}
    for b in sorted(eager["decode_step_s"]):
        out[f"compiled_decode_b{b}_speedup"] = eager["decode_step_s"][b] / comp["decode_step_s"][b]
    for name in ("isolated", "shared", "oxygen"):
        e, c = results.get(name), results.get(f"{name}+{mode}")
        if e and c:
            out[f"compiled_{name}_frame_speedup"] = e["metrics"]["cycle_ms_mean"] / c["metrics"]["cycle_ms_mean"]
    ci, co = results.get(f"isolated+{mode}"), results.get(f"oxygen+{mode}")
    if ci and co:
        out["compiled_oxygen_vs_isolated_hz"] = co["metrics"]["action_hz"] / ci["metrics"]["action_hz"]
        out["compiled_oxygen_action_hz"] = co["metrics"]["action_hz"]
        out["compiled_oxygen_tokens_per_s"] = co["metrics"]["tokens_per_s"]
        out["compiled_oxygen_frame_ms"] = co["metrics"]["cycle_ms_mean"]
    return out
