"""``oxygen bench`` / ``python -m oxygen_ros.tools.bench``: the command line and the run that ties the pieces
together (inputs, component costs before and after, the mode runs, the optional compiled side, bf16 check and k/N
sweep, then table + JSON + PNG).  ``main`` returns the exit status, ``run`` the results document."""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import socket
import time

import torch

from ...engine.engine import Engine, EngineConfig
from ...kv.pool import KVPool
from ...model import ByteTokenizer, Processor, build_model, get_config, load_tokenizer
from ...model.compiled import COMPILE_MODES, resolve_compile, resolve_device
from . import __doc__ as _PACKAGE_DOC
from .compiled import bf16_check, compile_shapes, compile_summary, components_table, step_op_counts
from .costs import combine_costs, costs_ms, ideal, measure_components, steady_state_schedule
from .inputs import make_arrivals, make_frames, make_noise
from .report import hardware, jsonable, plot, speedup_summary, table
from .runs import compare, run_all, run_sweep


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="oxygen bench", description=_PACKAGE_DOC.split("\n\n")[0])
    p.add_argument("--preset", default="bench-cpu")
    p.add_argument("--device", default="cpu", help="cpu | cuda[:N] | auto (cuda when available)")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: the preset's)")
    p.add_argument("--modes", default="isolated,shared,oxygen")
    p.add_argument("--frames", type=int, default=50)
    p.add_argument("--eager-frames", type=int, default=None,
                   help="with --compile: timed frames of the eager runs (default --frames; fewer keeps a slow eager "
                        "reference short - equivalence is checked on the frames both ran)")
    p.add_argument("--decode-tokens", "-N", type=int, default=30, dest="N")
    p.add_argument("--k", default="5", help="tokens per request per frame, or 'adaptive'")
    p.add_argument("--target-period-ms", type=float, default=None,
                   help="cycle deadline for --k adaptive (default: the ideal oxygen frame time)")
    p.add_argument("--denoise-steps", "-S", type=int, default=10, dest="S")
    p.add_argument("--horizon", type=int, default=None,
                   help="action horizon H (default: the preset's; bench-cpu has 10 like the paper, pi05 has 50)")
    p.add_argument("--arrivals", choices=("per-frame", "poisson"), default="per-frame")
    p.add_argument("--rate", type=float, default=1.0, help="mean arrivals per frame for --arrivals poisson")
    p.add_argument("--mixed-lengths", action="store_true", help="max_new_tokens uniform in [N/3, 2N] per request")
    p.add_argument("--kinds", default="subtask", help="request kinds, cycled: subtask,conversation,memory")
    p.add_argument("--masked-camera", type=int, default=None, help="leave this camera slot empty")
    p.add_argument("--warmup", type=int, default=None, help="untimed warm-up frames per mode (default 2*ceil(N/k)+2)")
    p.add_argument("--sequential", action="store_true",
                   help="run the modes back to back (default: interleaved frame by frame, rotating order)")
    p.add_argument("--no-shared-nk", action="store_true", help="skip the shared run with N=k (batching bound)")
    p.add_argument("--sweep", action="store_true", help="also run the k/N grid (oxygen vs isolated)")
    p.add_argument("--sweep-n", default="10,30,50")
    p.add_argument("--sweep-k", default="1,5,10")
    p.add_argument("--sweep-frames", type=int, default=12)
    p.add_argument("--reps", type=int, default=5, help="repetitions per component cost")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--compile", default="none", choices=("none", "auto") + COMPILE_MODES[1:],
                   help="also run every measurement compiled (side by side with eager, same model and inputs); "
                        "auto = the node's default (CUDA: cudagraphs, else none)")
    p.add_argument("--compile-batch-sizes", default="1,2,4,8,16",
                   help="decode / prompt batch buckets that get a graph (larger batches run in the next bucket)")
    p.add_argument("--no-eager", action="store_true", help="with --compile: skip the eager engine runs (components "
                   "are still measured both ways)")
    p.add_argument("--no-ops", action="store_true", help="with --compile: skip the profiler operator counts")
    p.add_argument("--bf16-check", action="store_true", help="report bf16 vs fp32 actions on the tiny preset (CPU)")
    p.add_argument("--out", default=None, help="output directory (default bench/results/<timestamp>-<host>)")
    a = p.parse_args(argv)
    a.device = resolve_device(a.device)
    a.compile = resolve_compile(a.compile, a.device)
    return a


class _PoolBank:
    """KV pools for the compiled engines of a run, made on first use and handed out again in later phases (each
    phase's engines drain before the next begins): with CUDA graphs a pool's decode graphs are captured for its
    addresses, so reusing pools reuses graphs instead of building new ones for every engine."""

    def __init__(self, cfg, num_blocks, block_size, dtype, device):
        self.make = lambda: KVPool.from_config(cfg, num_blocks=num_blocks, block_size=block_size, dtype=dtype,
                                               device=device)
        self.pools = []

    def __call__(self, i: int) -> KVPool:
        while len(self.pools) <= i:
            self.pools.append(self.make())
        return self.pools[i]


def _write(out_dir: str, doc: dict, tab: str | None = None) -> None:
    """results.json (and table.txt) as they stand: written after every phase, so a run cut short still leaves its
    finished phases (``phase`` says which was the last)."""
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(jsonable(doc), f, indent=1)
    if tab is not None:
        with open(os.path.join(out_dir, "table.txt"), "w") as f:
            f.write(tab + "\n")


def main(argv=None) -> int:
    """``oxygen bench``: run the benchmark, write its files; exit status 0 (errors raise)."""
    run(argv)
    return 0


def run(argv=None) -> dict:
    """The benchmark: returns the results document (also written as results.json)."""
    a = parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    k = "adaptive" if a.k == "adaptive" else int(a.k)
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    kinds = tuple(x.strip() for x in a.kinds.split(",") if x.strip())
    over = {"num_denoise_steps": a.S}
    if a.horizon:
        over["action_horizon"] = a.horizon
    cfg = get_config(a.preset, **over)
    dtype = a.dtype or cfg.dtype
    model = build_model(cfg, device=a.device, dtype=dtype, seed=a.seed)
    cfg = model.cfg
    try:
        tokenizer = load_tokenizer(cfg)
    except FileNotFoundError:      # random weights: text is meaningless anyway; bytes keep the prompt lengths honest
        tokenizer = ByteTokenizer(cfg.vocab_size, pad_id=cfg.pad_id, eos_id=cfg.eos_id, bos_id=cfg.bos_id)
        print(f"[bench] no SentencePiece file for {cfg.name}: using the byte tokenizer (random weights)", flush=True)
    processor = Processor(cfg, tokenizer)
    k_num = 1 if k == "adaptive" else k
    warmup = a.warmup if a.warmup is not None else 2 * math.ceil(a.N / k_num) + 2
    frames = make_frames(cfg, a.frames, a.seed, masked_camera=a.masked_camera)
    noise = make_noise(cfg, a.frames, a.seed)
    arrivals = make_arrivals(a.frames, a.seed, a.N, a.arrivals, a.mixed_lengths, kinds, a.rate)
    out_dir = a.out or os.path.join("bench", "results",
                                    _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d-%H%M%S") + "-" +
                                    socket.gethostname())
    os.makedirs(out_dir, exist_ok=True)
    print(f"[bench] preset={a.preset} device={a.device} dtype={dtype} H={cfg.action_horizon} S={a.S} N={a.N} "
          f"k={k} frames={a.frames} warmup={warmup} arrivals={a.arrivals} kinds={','.join(kinds)}", flush=True)

    try:
        load = os.getloadavg()[0]
        if load > 0.5 * (os.cpu_count() or 1) and torch.device(a.device).type == "cpu":
            print(f"[bench] warning: load average {load:.2f} on {os.cpu_count()} CPUs: other processes compete for "
                  "the CPU; timings will be noisy (modes are interleaved to share the noise)", flush=True)
    except OSError:
        pass
    t = time.perf_counter()
    max_b = set(range(1, max(8, math.ceil(a.N / k_num) + 2) + 1))
    if a.sweep:                    # the batch sizes the sweep's steady states use, so its ideal is measured too
        for n_ in a.sweep_n.split(","):
            for k_ in a.sweep_k.split(","):
                max_b |= set(steady_state_schedule(int(n_), int(k_)))
    compiled = a.compile != "none"
    shapes, cm, compile_info, ops, pools = None, None, None, None, None
    doc = {"args": vars(a), "config": cfg.to_dict(), "hardware": hardware(a.device), "phase": "start",
           "compile": None, "op_counts": None}
    if compiled:                   # one pool shape and one set of graphs for every engine and measurement of the run
        shapes = compile_shapes(cfg, a, arrivals, k_num)
        pools = _PoolBank(cfg, shapes["kv_num_blocks"], a.block_size, model.dtype, model.device)
        probe = Engine(model, processor, EngineConfig(max_new_tokens=a.N, denoise_steps=a.S, compile=a.compile,
                                                      kv_block_size=a.block_size, **shapes), pool=pools(0))
        tc = time.perf_counter()
        compile_info = probe.warmup()
        cm = probe.model
        compile_info["graphs"] = dict(cm.report.graphs)
        print(f"[bench] compile={compile_info['compile']} (asked {a.compile}): {len(compile_info['graphs'])} graphs "
              f"in {time.perf_counter() - tc:.1f}s {compile_info['compile_error']}", flush=True)
        del probe
        doc.update(phase="compile", compile=compile_info)
        _write(out_dir, doc)
    mc = dict(reps=a.reps, block_size=a.block_size, num_blocks=shapes and shapes["kv_num_blocks"])
    costs = measure_components(model, processor, frames[0], a.N, a.S, max_b, **mc)
    costs_before = costs
    costs_c_before = measure_components(cm, processor, frames[0], a.N, a.S, max_b, **mc, pool=pools(0)) \
        if compiled else None
    if compiled and not a.no_ops:
        bo = 6 if 6 in max_b else max(max_b)
        ops = {"eager": step_op_counts(model, processor, frames[0], a.S, bo, shapes["kv_num_blocks"], a.block_size),
               "compiled": step_op_counts(cm, processor, frames[0], a.S, bo, shapes["kv_num_blocks"], a.block_size,
                                          pool=pools(0))}
    ideal_k = k_num
    ide = ideal(costs, a.N, ideal_k)
    print(f"[bench] components ({time.perf_counter() - t:.1f}s): prefill {costs['prefill_s'] * 1e3:.1f} ms, "
          f"actions {costs['actions_s'] * 1e3:.1f} ms ({costs['denoise_step_s'] * 1e3:.2f} ms/step), decode step "
          + ", ".join(f"b{b} {v * 1e3:.2f}" for b, v in costs["decode_step_s"].items()) + " ms", flush=True)
    print(f"[bench] ideal frame: isolated {ide['isolated_frame_s'] * 1e3:.1f} ms, shared "
          f"{ide['shared_frame_s'] * 1e3:.1f} ms, oxygen {ide['oxygen_frame_s'] * 1e3:.1f} ms -> ideal speedup "
          f"{ide['speedup_oxygen_vs_isolated']:.2f}x", flush=True)
    doc.update(phase="components", component_costs_before=costs_ms(costs_before), op_counts=ops,
               component_costs_compiled_before=costs_c_before and costs_ms(costs_c_before))
    if compiled:
        doc["components_table"] = components_table(costs_before, costs_c_before, ops, a.compile)
        print("\n" + doc["components_table"] + "\n", flush=True)
    _write(out_dir, doc)
    target = (a.target_period_ms / 1e3) if a.target_period_ms else (ide["oxygen_frame_s"] if k == "adaptive" else None)

    # isolated / shared carry nothing across frames: a few warm-up frames suffice; oxygen needs its pipeline filled
    short = warmup if a.warmup is not None else 3
    specs = {}
    for mode in modes:
        sp = dict(mode=mode, arrivals=arrivals, N=a.N, k=k, S=a.S, target_period_s=target, block_size=a.block_size,
                  warmup=warmup if mode == "oxygen" else short, shapes=shapes)
        if not (compiled and a.no_eager):
            specs[mode] = dict(sp, frames=a.eager_frames)
        if compiled:
            specs[f"{mode}+{a.compile}"] = dict(sp, compile=a.compile)
    if not a.no_shared_nk and "oxygen" in modes and k != "adaptive":
        arr_k = [[(kd, p, min(n, k)) for kd, p, n in row] for row in arrivals]
        specs["shared_N=k"] = dict(mode="shared", arrivals=arr_k, N=k, k=k, S=a.S, block_size=a.block_size,
                                   warmup=short, shapes=shapes, compile=a.compile)
    if compiled:                   # compiled engines on the bank's pools: their decode graphs exist already
        for i, sp in enumerate(x for x in specs.values() if x.get("compile", "none") != "none"):
            sp["pool"] = pools(i)
    t = time.perf_counter()
    results = run_all(model, processor, specs, frames, noise, warmup=warmup, interleave=not a.sequential,
                      log=lambda msg: print(f"[bench] {msg}", flush=True))
    print(f"[bench] runs done in {time.perf_counter() - t:.1f}s ("
          f"{'back to back' if a.sequential else 'interleaved frame by frame'})", flush=True)
    eq = compare(results)
    tab = table(results)
    print("\n" + tab + "\n", flush=True)
    for name, c in eq.items():
        print(f"  {name} vs isolated: actions max rel diff {c['actions_max_rel_diff']:.2e}, "
              f"{c['requests_same_tokens']}/{c['requests']} requests with identical tokens", flush=True)
    doc.update(phase="runs", equivalence=eq, modes={name: r["metrics"] for name, r in results.items()}, table=tab,
               summary=speedup_summary(results, ide))
    _write(out_dir, doc, tab)

    # component costs once more after the runs; the ideal uses the medians over both measurements' samples
    costs_after = measure_components(model, processor, frames[0], a.N, a.S, max_b, **mc)
    costs = combine_costs(costs_before, costs_after, a.S)
    costs_c = None
    if compiled:
        costs_c = combine_costs(costs_c_before, measure_components(cm, processor, frames[0], a.N, a.S, max_b, **mc,
                                                                   pool=pools(0)), a.S)
        summary_c = compile_summary(results, costs, costs_c, a.compile)
        print("\n" + components_table(costs, costs_c, ops, a.compile), flush=True)
    ide = ideal(costs, a.N, ideal_k)
    print(f"[bench] components after the runs: prefill {costs_after['prefill_s'] * 1e3:.1f} ms, actions "
          f"{costs_after['actions_s'] * 1e3:.1f} ms, decode step "
          + ", ".join(f"b{b} {v * 1e3:.2f}" for b, v in costs_after["decode_step_s"].items()) + " ms; ideal speedup "
          f"from both: {ide['speedup_oxygen_vs_isolated']:.2f}x", flush=True)
    summary = speedup_summary(results, ide)
    if compiled:
        summary.update(summary_c)
    for key, v in summary.items():
        print(f"  {key:32s} {v:.3f}" if isinstance(v, float) else f"  {key:32s} {v}")
    doc.update(phase="components_after", component_costs_after=costs_ms(costs_after), summary=summary,
               component_costs={"prefill_ms": costs["prefill_s"] * 1e3, "actions_ms": costs["actions_s"] * 1e3,
                                "denoise_step_ms": costs["denoise_step_s"] * 1e3,
                                "decode_step_ms": {b: v * 1e3 for b, v in costs["decode_step_s"].items()},
                                "prefix_valid_tokens": costs["prefix_valid_tokens"],
                                "prefix_positions": costs["prefix_positions"]},
               ideal={kk.replace("_s", "_ms") if kk.endswith("_s") else kk: (v * 1e3 if kk.endswith("_s") else v)
                      for kk, v in ide.items()},
               component_costs_compiled=None if costs_c is None else {
                   "prefill_ms": costs_c["prefill_s"] * 1e3, "actions_ms": costs_c["actions_s"] * 1e3,
                   "denoise_step_ms": costs_c["denoise_step_s"] * 1e3,
                   "decode_step_ms": {b: v * 1e3 for b, v in costs_c["decode_step_s"].items()}})
    if costs_c is not None:
        doc["components_table"] = components_table(costs, costs_c, ops, a.compile)
    _write(out_dir, doc, tab)
    bf16 = bf16_check(seed=a.seed) if a.bf16_check else None
    if bf16:
        print(f"[bench] bf16 vs fp32 actions ({bf16['preset']}): max abs diff {bf16['max_abs_diff']:.3e}, max rel "
              f"{bf16['max_rel_diff']:.3e}", flush=True)
    doc["bf16_vs_fp32"] = bf16
    sweep = None
    if a.sweep:                    # compiled when --compile is given: then its ideal is the compiled costs'
        sweep = run_sweep(model, processor, cfg, a, costs_c or costs, shapes, pools)
        print("\n  k/N sweep (oxygen / isolated action Hz; ideal):")
        for s_ in sweep:
            print(f"    N={s_['N']:3d} k={s_['k']:3d}: {s_['speedup_hz']:.2f}x (ideal {s_['ideal_speedup']:.2f}x)")
    doc.update(phase="done", sweep=sweep)
    _write(out_dir, doc, tab)
    title = (f"{a.preset} {a.device} {dtype}, H={cfg.action_horizon} S={a.S} N={a.N} k={k}, {a.frames} frames")
    plot(os.path.join(out_dir, "results.png"), {n: r for n, r in results.items()}, sweep, title)
    print(f"\n[bench] wrote {out_dir}/results.json, table.txt, results.png")
    doc["out_dir"] = out_dir
    return doc
