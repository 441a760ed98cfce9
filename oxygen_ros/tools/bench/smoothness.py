"""`oxygen smoothness`: how smooth the executed action stream is at chunk switches, per chunking mode, without DDS.

This file owns the engine-level smoothness benchmark of issue 10.  It builds a preset's model (random, seeded weights),
a seeded stream of synthetic frames and per-chunk action noise, and simulates the control loop in *simulated* time
(no sleeping): a control tick every 1/control_hz s executes row 0 of what the node's ``ChunkBuffer``
(``ros/control.py``, pure numpy) returns; an inference starts at tick k0 (one every ``execution_horizon`` ticks, or
later when it takes longer), its chunk is ready ``d = ceil(latency / step)`` ticks later (latency: the cycle's
measured frame-in -> chunk-out time, or ``--latency-ms``) and is pushed into the buffer then.  Modes, in one run on
the same model, frames and noise:

* ``none``: the new chunk replaces the old one (``blend_steps`` 0, ``--time-origin``, default the node's ``arrival``);
* ``blend``: today's linear cross-fade of ``--blend-steps`` rows from the old remainder into the new chunk;
* ``rtc``: the engine denoises with real-time chunking (``Engine.cycle(rtc=RTCRequest)``): prev_actions = the rows the
  robot executes from tick k0 on (the buffer's remainder at k0), ``delay_steps`` = the node-style estimate (p95 of the
  last 10 measured latencies, in steps), and the buffer switches on the capture time base (``time_origin="capture"``),
  so the new chunk's first d rows, executed from the old chunk meanwhile, are skipped.

Reported per mode: the jump at chunk switches (|a_k - a_{k-1}|_2 over the robot dims at the ticks where the executed
chunk changes) vs the step-to-step change inside chunks, p50 / p95 / max and their ratios; ticks held (no chunk
left); how close the guided frozen rows came to the target; and RTC's extra inference time per chunk (the cycle's
action time, guided vs unguided, plus an interleaved micro-benchmark of ``sample_actions`` vs ``sample_actions_rtc``
on one prefix).  Also the distance, at each switch tick, between the new chunk's executed row and the row the old
chunk had planned for that tick ("vs plan"): with random weights consecutive rows of one chunk differ as much as
unrelated chunks do, so the switch/inside ratio is ~1 for every mode and "vs plan" is what tells the modes apart.
Writes a table to stdout and ``results.json`` + ``table.txt`` + ``streams.json`` (the executed rows) under ``--out``
(default ``bench/results/<UTC timestamp>-<host>-smoothness/``).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import socket
import sys
import time
from collections import deque

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")     # see tools/bench.py: spin-waiting on a shared CPU

import numpy as np  # noqa: E402
import torch  # noqa: E402

from ...engine.engine import Engine, EngineConfig  # noqa: E402
from ...engine.requests import RTCRequest  # noqa: E402
from ...model import ByteTokenizer, Observation, Processor, build_model, get_config, load_tokenizer  # noqa: E402
from ...model.rtc import rtc_target, sample_actions_rtc  # noqa: E402
from ...ros.control import ChunkBuffer  # noqa: E402
from .report import hardware  # noqa: E402

MODES = ("none", "blend", "rtc")
PROMPT = "pick up the red block"


def make_inputs(cfg, n: int, seed: int) -> tuple[list, list]:
    """n frames (random images, 7-dim state) and n action noises, the same for every mode."""
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed + 1)
    frames, noise = [], []
    for i in range(n):
        imgs = [rng.integers(0, 256, (cfg.image_size, cfg.image_size, 3), dtype=np.uint8)
                for _ in range(cfg.num_cameras)]
        frames.append(Observation(images=imgs, state=rng.uniform(-1, 1, 7).astype(np.float32), prompt=PROMPT,
                                  stamp=float(i), frame_index=i))
        noise.append(torch.randn(1, cfg.action_horizon, cfg.action_dim, generator=g))
    return frames, noise


def _pct(xs, q):
    return float(np.percentile(np.asarray(xs, dtype=np.float64), q)) if len(xs) else None


def stats(xs) -> dict:
    return {"n": len(xs), "p50": _pct(xs, 50), "p95": _pct(xs, 95), "max": float(max(xs)) if len(xs) else None}


def simulate(engine: Engine, frames: list, noise: list, mode: str, *, step_dt: float, execution_horizon: int,
             blend_steps: int, time_origin: str, latency_ms: float | None, beta: float, warmup: int) -> dict:
    """One mode over all frames in simulated time -> executed stream, switch/inside step changes and timings."""
    H = engine.cfg.action_horizon
    robot_dim = engine.processor.action_dims
    out: list = []
    engine.on_actions = out.append
    lat_hist: deque = deque(maxlen=10)                 # measured latencies in ms (node-style estimate of d)

    def steps(ms: float) -> int:
        return max(1, math.ceil(ms / (step_dt * 1e3) - 1e-9))

    def run(obs, nz, rtc):
        out.clear()
        st = engine.cycle(obs, noise=nz, rtc=rtc)
        return out[0], st

    # warm-up (not recorded): fills caches and the latency history with this mode's own cost
    for i in range(warmup):
        rtc = None
        if mode == "rtc":
            rtc = RTCRequest(np.zeros((H - execution_horizon, robot_dim), np.float32), 1, execution_horizon, beta)
        res, _ = run(frames[i % len(frames)], noise[i % len(noise)], rtc)
        lat_hist.append(res.latency_ms)

    buf = ChunkBuffer(step_dt, blend_steps=blend_steps if mode == "blend" else 0, stale_behavior="hold",
                      time_origin="capture" if mode == "rtc" else time_origin)
    stream = []                                        # (tick, row, chunk_id, held)
    frozen_err, d_used, d_est_used, act_ms, rtc_ms, lat_ms, plan_dev = [], [], [], [], [], [], []
    cur = 0                                            # next tick to execute
    k0 = 0

    def tick(k: int):
        s = buf.sample(k * step_dt)
        if s is not None:
            stream.append((k, s.actions[0].copy(), s.chunk_id, s.held))
        return s

    for j, (obs, nz) in enumerate(zip(frames, noise)):
        for k in range(cur, k0):                       # the old chunk runs until this inference starts
            tick(k)
        now = tick(k0)                                 # tick k0: executed; the remainder from here on is prev
        rtc, d_est = None, None
        if mode == "rtc" and now is not None and not now.held:
            d_est = steps(latency_ms) if latency_ms is not None else steps(_pct(list(lat_hist), 95))
            rtc = RTCRequest(now.actions, d_est, execution_horizon, beta)
        res, st = run(obs, nz, rtc)
        lat_hist.append(res.latency_ms)
        lat_ms.append(res.latency_ms)
        act_ms.append(st["actions_s"] * 1e3)
        if res.guided:
            rtc_ms.append(res.rtc_ms)
            n = min(d_est, len(rtc.prev_actions))
            frozen_err.append(float(np.abs(res.actions[:n] - rtc.prev_actions[:n]).max()))
            d_est_used.append(d_est)
        d = steps(latency_ms if latency_ms is not None else res.latency_ms)
        d_used.append(d)
        for k in range(k0 + 1, k0 + d):                # executed from the old chunk while inferring
            tick(k)
        buf.push(res.actions, chunk_id=res.chunk_id, frame_index=res.frame_index, capture_time=k0 * step_dt,
                 ready_time=(k0 + d) * step_dt, latency_ms=res.latency_ms)
        cur = k0 + d
        if now is not None and not now.held and d < len(now.actions):
            first = tick(cur)                          # the switch tick: new chunk vs what the old plan had there
            plan_dev.append(float(np.linalg.norm(first.actions[0][:robot_dim] - now.actions[d][:robot_dim])))
            cur += 1
        k0 = k0 + max(execution_horizon, d)
    for k in range(cur, k0):                           # the last chunk's executed part
        tick(k)

    switch, inside = [], []
    held = sum(1 for s in stream if s[3])
    for (k1, a1, c1, _), (k2, a2, c2, h2) in zip(stream, stream[1:]):
        if h2:                                         # a held tick repeats the last action: counted as held
            continue
        dlt = float(np.linalg.norm(a2[:robot_dim] - a1[:robot_dim]))
        (switch if c2 != c1 else inside).append(dlt)
    sw, ins = stats(switch), stats(inside)
    ratio = {q: (sw[q] / ins[q] if sw[q] is not None and ins[q] else None) for q in ("p50", "p95", "max")}
    return {"mode": mode, "ticks": len(stream), "held_ticks": held, "chunks": len(frames),
            "switch": sw, "inside": ins, "ratio": ratio, "switch_vs_old_plan": stats(plan_dev),
            "d_steps": stats(d_used), "d_est_steps": stats(d_est_used),
            "latency_ms": stats(lat_ms), "actions_ms": stats(act_ms), "rtc_ms": stats(rtc_ms),
            "frozen_rows_max_abs_err": stats(frozen_err),
            "blend_steps": blend_steps if mode == "blend" else 0,
            "time_origin": "capture" if mode == "rtc" else time_origin,
            "stream": [[int(k), [float(x) for x in a], int(c), bool(h)] for k, a, c, h in stream]}


def micro_bench(engine: Engine, frame, noise, execution_horizon: int, delay: int, beta: float, reps: int) -> dict:
    """sample_actions vs sample_actions_rtc on one prefix, interleaved, median ms (what RTC adds per chunk)."""
    model, proc, cfg = engine.model, engine.processor, engine.cfg
    dev = engine.device
    mi = proc.prepare(frame)
    prefix = model.prefill(mi.images.to(dev), mi.image_masks.to(dev), mi.tokens.to(dev), mi.token_masks.to(dev))
    nz = noise.to(dev)
    prev = model.sample_actions(prefix, nz, engine.S)[0, execution_horizon:]
    target, weights = rtc_target(prev, cfg.action_horizon, cfg.action_dim, delay, execution_horizon)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def timed(fn):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        return (time.perf_counter() - t) * 1e3

    plain, guided = [], []
    for _ in range(2):                                    # warm-up
        model.sample_actions(prefix, nz, engine.S)
        sample_actions_rtc(model, prefix, nz, engine.S, target, weights, beta)
    for _ in range(reps):
        plain.append(timed(lambda: model.sample_actions(prefix, nz, engine.S)))
        guided.append(timed(lambda: sample_actions_rtc(model, prefix, nz, engine.S, target, weights, beta)))
    p, g = float(np.median(plain)), float(np.median(guided))
    return {"sample_actions_ms": p, "sample_actions_rtc_ms": g, "extra_ms": g - p, "ratio": g / p, "reps": reps}


def _f(x, nd=3):
    return "-" if x is None else f"{x:.{nd}f}"


def table(results: dict) -> str:
    head = (f"{'mode':6s} {'d':>3s} {'switch p50':>10s} {'p95':>7s} {'max':>7s} {'inside p50':>10s} {'p95':>7s} "
            f"{'max':>7s} {'ratio p50':>9s} {'p95':>6s} {'max':>6s} {'vs plan p50':>11s} {'act ms':>7s} {'held':>4s}")
    lines = [head, "-" * len(head)]
    for m, r in results.items():
        sw, ins, ra = r["switch"], r["inside"], r["ratio"]
        lines.append(f"{m:6s} {_f(r['d_steps']['p50'], 0):>3s} {_f(sw['p50']):>10s} {_f(sw['p95']):>7s} "
                     f"{_f(sw['max']):>7s} {_f(ins['p50']):>10s} {_f(ins['p95']):>7s} {_f(ins['max']):>7s} "
                     f"{_f(ra['p50'], 2):>9s} {_f(ra['p95'], 2):>6s} {_f(ra['max'], 2):>6s} "
                     f"{_f(r['switch_vs_old_plan']['p50']):>11s} "
                     f"{_f(r['actions_ms']['p50'], 1):>7s} {r['held_ticks']:>4d}")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="oxygen smoothness", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: the preset's)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--chunks", type=int, default=40, help="chunks (inference cycles) per mode")
    p.add_argument("--warmup", type=int, default=3, help="unrecorded cycles per mode (caches, latency history)")
    p.add_argument("--control-hz", type=float, default=None,
                   help="control ticks per simulated second (default: auto, 2 steps per measured unguided cycle)")
    p.add_argument("--latency-ms", type=float, default=None,
                   help="fixed inference latency in simulated time (default: each cycle's measured latency)")
    p.add_argument("--execution-horizon", "-s", type=int, default=None,
                   help="ticks between inference starts (default H/2)")
    p.add_argument("--blend-steps", type=int, default=None, help="blend mode's cross-fade rows (default H - s)")
    p.add_argument("--time-origin", choices=("arrival", "capture"), default="arrival",
                   help="ChunkBuffer time origin of none/blend (the node's default: arrival); rtc uses capture")
    p.add_argument("--max-guidance-weight", type=float, default=10.0, help="RTC beta")
    p.add_argument("--denoise-steps", "-S", type=int, default=None, dest="S")
    p.add_argument("--reps", type=int, default=10, help="micro-benchmark repetitions")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--no-stream", action="store_true", help="do not write the executed streams (streams.json)")
    p.add_argument("--out", default=None, help="output directory (default bench/results/<timestamp>-<host>-smoothness)")
    return p


def main(argv=None) -> int:
    """``oxygen smoothness``: run the simulation, write its files; exit status 0 (bad arguments: 2)."""
    run(argv)
    return 0


def run(argv=None) -> dict:
    """The simulation: returns the results document (also written as results.json)."""
    p = parser()
    a = p.parse_args(argv)
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad:
        p.error(f"unknown mode(s) {bad}; expected {MODES}")
    if a.threads:
        torch.set_num_threads(a.threads)
    over = {} if a.S is None else {"num_denoise_steps": a.S}
    cfg = get_config(a.preset, **over)
    model = build_model(cfg, device=a.device, dtype=a.dtype, seed=a.seed)
    cfg = model.cfg
    try:
        tok = load_tokenizer(cfg)
    except FileNotFoundError:
        tok = ByteTokenizer(cfg.vocab_size, pad_id=cfg.pad_id, eos_id=cfg.eos_id, bos_id=cfg.bos_id)
    proc = Processor(cfg, tok)
    H = cfg.action_horizon
    s = a.execution_horizon if a.execution_horizon is not None else H // 2
    if not 1 <= s < H:
        p.error(f"--execution-horizon must be in [1, {H - 1}]")
    blend = a.blend_steps if a.blend_steps is not None else H - s
    frames, noise = make_inputs(cfg, a.chunks, a.seed)
    if a.control_hz is None:                           # auto: the unguided cycle's p95 latency = 2 control steps
        eng = Engine(model, proc, EngineConfig(mode="oxygen", seed=a.seed))
        lat = []
        eng.on_actions = lambda r: lat.append(r.latency_ms)
        for i in range(max(3, a.warmup)):
            eng.cycle(frames[i % len(frames)], noise=noise[i % len(noise)])
        a.control_hz = 2e3 / _pct(lat[1:], 95)
        print(f"[smoothness] control rate auto: {a.control_hz:.1f} Hz (unguided cycle p95 {_pct(lat[1:], 95):.1f} ms "
              "= 2 steps)", flush=True)
    step_dt = 1.0 / a.control_hz
    print(f"[smoothness] preset={a.preset} device={a.device} dtype={cfg.dtype} H={H} S={cfg.num_denoise_steps} "
          f"control {a.control_hz:.1f} Hz, s={s}, blend_steps={blend}, latency="
          f"{'measured' if a.latency_ms is None else f'{a.latency_ms:g} ms'}, beta={a.max_guidance_weight:g}, "
          f"{a.chunks} chunks per mode", flush=True)
    results = {}
    for m in modes:
        eng = Engine(model, proc, EngineConfig(mode="oxygen", seed=a.seed))
        t = time.perf_counter()
        results[m] = simulate(eng, frames, noise, m, step_dt=step_dt, execution_horizon=s, blend_steps=blend,
                              time_origin=a.time_origin, latency_ms=a.latency_ms, beta=a.max_guidance_weight,
                              warmup=a.warmup)
        print(f"[smoothness] {m}: {results[m]['ticks']} ticks in {time.perf_counter() - t:.1f} s", flush=True)
    eng = Engine(model, proc, EngineConfig(mode="oxygen", seed=a.seed))
    d_mb = int(results.get("rtc", {}).get("d_est_steps", {}).get("p50") or max(1, s // 2))
    mb = micro_bench(eng, frames[0], noise[0], s, d_mb, a.max_guidance_weight, a.reps)
    tab = table(results)
    print()
    print(tab)
    print()
    for m, r in results.items():
        vp = r["switch_vs_old_plan"]
        print(f"  {m}: switch row vs the old plan's row for that tick p50 {_f(vp['p50'])} p95 {_f(vp['p95'])} max "
              f"{_f(vp['max'])}; cycle latency p50 {_f(r['latency_ms']['p50'], 1)} ms")
    if "rtc" in results:
        r = results["rtc"]
        print(f"  rtc: frozen rows max |new - prev| p50 {_f(r['frozen_rows_max_abs_err']['p50'], 4)}, max "
              f"{_f(r['frozen_rows_max_abs_err']['max'], 4)}; guided sample_actions in the cycle p50 "
              f"{_f(r['rtc_ms']['p50'], 1)} ms; d estimate p50 {_f(r['d_est_steps']['p50'], 0)} steps")
    if "none" in results and "rtc" in results:
        print(f"  cycle action time p50: none {_f(results['none']['actions_ms']['p50'], 1)} ms, rtc "
              f"{_f(results['rtc']['actions_ms']['p50'], 1)} ms")
    print(f"  micro-benchmark (median of {a.reps}): sample_actions {mb['sample_actions_ms']:.1f} ms, "
          f"sample_actions_rtc {mb['sample_actions_rtc_ms']:.1f} ms -> +{mb['extra_ms']:.1f} ms per chunk "
          f"({mb['ratio']:.2f}x)")
    out_dir = a.out or os.path.join("bench", "results", _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
                                    + "-" + socket.gethostname() + "-smoothness")
    os.makedirs(out_dir, exist_ok=True)
    streams = {m: r.pop("stream") for m, r in results.items()}
    if not a.no_stream:                                # tick, row (robot dims, 5 significant digits), chunk, held
        with open(os.path.join(out_dir, "streams.json"), "w") as f:
            json.dump({m: [[k, [float(f"{x:.5g}") for x in row], c, h] for k, row, c, h in st]
                       for m, st in streams.items()}, f, separators=(",", ":"))
    doc = {"args": vars(a), "config": cfg.to_dict(), "hardware": hardware(a.device), "execution_horizon": s,
           "blend_steps": blend, "control_hz": a.control_hz, "modes": results, "micro_bench": mb, "table": tab}
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(doc, f, indent=1)
    with open(os.path.join(out_dir, "table.txt"), "w") as f:
        f.write(tab + "\n")
    print(f"\n[smoothness] wrote {out_dir}/results.json, table.txt" + ("" if a.no_stream else ", streams.json"))
    doc["out_dir"] = out_dir
    return doc


if __name__ == "__main__":
    sys.exit(main())
