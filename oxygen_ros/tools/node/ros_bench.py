"""``oxygen ros-bench``: timing of the ROS path through real DDS, on replayed frames.

This file owns the ROS-level benchmark.  It starts ``oxygen_node`` as a child process (``config/oxygen.yaml`` +
``--preset``/``--checkpoint``), replays a synthetic bag (made fresh unless ``--bag``) through rclpy in this process,
restamping each frame with its publication time, and after ``--warmup`` seconds measures for ``--duration`` seconds:
the ``action_chunk`` rate and its jitter (inter-arrival p50/p99/max and |inter-arrival - period| at the receiver, and
the node's own tick jitter from ``start_time``), and the
camera-to-chunk latency (first arrival of each new chunk minus the capture stamp of the frame it was computed from,
i.e. DDS in + queueing + inference + DDS out) and how late ``joint_trajectory`` messages arrive relative to their
``header.stamp`` (the node promises the stamp is at most one control step before publication; arrival adds DDS).  Both ends share this machine's clock.  Prints a table and writes
JSON (``--out``, default ``out/ros_bench.json``).  Bounds are not asserted here; tests only check >= 80% of the rate.

Smoothness (every run): the executed stream is row 0 of each ``action_chunk`` message (what the robot is commanded
at that tick); ``smoothness`` splits the change between consecutive ticks (L2 norm over the action columns; pairs
further apart than 1.5 periods are left out) into *switch* steps (the chunk id changed) and *inside* steps (same
chunk), with p50/p95/max of each and the ratios switch/inside.  ``--chunking none,blend,rtc`` runs one node per mode
in one command (``--blend-steps`` for blend) and prints the comparison table, with each mode's inference latency and,
for rtc, the engine's RTC time per chunk from ``/diagnostics`` (``rtc_ms_p50``) — the extra inference time RTC costs.
An rtc run needs an engine whose ``cycle`` takes ``rtc``; without one it is reported as unavailable, not run.
"""
from __future__ import annotations

import argparse
import inspect
import json
import platform
import time
from pathlib import Path

import numpy as np


def smoothness(stream, period_s: float) -> dict:
    """``stream``: (tick time ns, chunk_id, row 0 [A]) in tick order -> step sizes at chunk switches vs inside
    chunks (p50 / p95 / max / n) and the ratios switch / inside (p50, p95)."""
    sw, inside = [], []
    for (t0, c0, a0), (t1, c1, a1) in zip(stream, stream[1:]):
        if not 0 < (t1 - t0) <= 1.5 * period_s * 1e9:
            continue                                  # a missed tick (or a restart) is not one step
        d = float(np.linalg.norm(np.asarray(a1, np.float64) - np.asarray(a0, np.float64)))
        (sw if c1 != c0 else inside).append(d)

    def st(x):
        x = np.asarray(x, dtype=np.float64)
        if not x.size:
            return {"n": 0}
        return {"n": int(x.size), "p50": float(np.percentile(x, 50)), "p95": float(np.percentile(x, 95)),
                "max": float(x.max())}

    out = {"switch": st(sw), "inside": st(inside)}
    for k in ("p50", "p95"):
        a, b = out["switch"].get(k), out["inside"].get(k)
        out[f"ratio_{k}"] = (a / b) if a is not None and b else None
    return out


def _engine_has_rtc() -> bool:
    from oxygen_ros.engine.engine import Engine  # noqa: PLC0415

    return "rtc" in inspect.signature(Engine.cycle).parameters


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="oxygen ros-bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=15.0, help="measured seconds (default: %(default)s)")
    p.add_argument("--warmup", type=float, default=3.0, help="seconds ignored after the first chunk")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--checkpoint", default="")
    p.add_argument("--device", default="auto", help="policy device: auto (cuda when available) | cpu | cuda[:N]")
    p.add_argument("--horizon", type=int, default=50, help="action horizon for random weights (default 50)")
    p.add_argument("--control-rate", type=float, default=70.0)
    p.add_argument("--bag", default="")
    p.add_argument("--width", type=int, default=320)
    p.add_argument("--height", type=int, default=240)
    p.add_argument("--fps", type=float, default=15.0)
    p.add_argument("--params-file", default="")
    p.add_argument("--chunking", default="", help="comma-separated chunking modes, one node run each (e.g. "
                                                     "none,blend,rtc); default: the params file's")
    p.add_argument("--blend-steps", type=int, default=5, help="blend_steps of a --chunking blend run")
    p.add_argument("--out", default="out/ros_bench.json")
    a = p.parse_args(argv)

    from oxygen_ros.tools.harness import isolate_dds  # noqa: PLC0415
    from oxygen_ros.tools.bags.replay import make_bag  # noqa: PLC0415

    isolate_dds()
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    bag = Path(a.bag) if a.bag else make_bag(out.parent / "ros_bench_bag", duration=8.0, fps=a.fps, width=a.width,
                                             height=a.height, overwrite=True)
    modes = [m.strip() for m in a.chunking.split(",") if m.strip()] or [""]
    bad = [m for m in modes if m not in ("", "none", "blend", "rtc")]
    if bad:
        p.error(f"--chunking: unknown mode(s) {bad}")
    runs, rc_all = {}, 0
    for mode in modes:
        if mode == "rtc" and not _engine_has_rtc():
            print("chunking rtc: this engine's cycle() takes no rtc argument (RTC not built in): not run")
            runs[mode] = {"unavailable": "Engine.cycle has no rtc argument"}
            continue
        res, rc = _run(a, bag, out.parent, mode)
        runs[mode or "default"] = res
        rc_all = rc_all or rc
    if len(runs) == 1 and "default" in runs:
        res = runs["default"]
    else:
        res = {"runs": runs}
        _print_smoothness(runs)
    out.write_text(json.dumps(res, indent=2, default=float))
    print(f"\nwrote {out}")
    return rc_all


def _run(a, bag: Path, out_dir: Path, mode: str) -> tuple[dict, int]:
    """One node run (``mode``: a chunking mode, or "" = the params file's): measurements + smoothness."""
    from oxygen_ros.tools.harness import Monitor, NodeProcess, stats_ms  # noqa: PLC0415
    from oxygen_ros.tools.bags.replay import BagReplayer  # noqa: PLC0415

    params = {"control_rate_hz": a.control_rate, "memory_db": "", "memory_interval_s": 0.0, "device": a.device,
              "outputs": ["action_chunk", "joint_trajectory"]}
    if mode:
        params.update(chunking=mode, blend_steps=a.blend_steps if mode == "blend" else 0)
    if a.checkpoint:
        params["checkpoint"] = a.checkpoint
    else:
        params.update(preset=a.preset, horizon=a.horizon)
    node = NodeProcess(out_dir / f"ros_bench_node{'_' + mode if mode else ''}.log", params, a.params_file or None)

    import rclpy  # noqa: PLC0415

    mon = Monitor("oxygen_ros_bench")
    published: dict[int, float] = {}

    def on_pub(topic, stamp_ns):
        if topic == "/camera/base/image_raw" and stamp_ns is not None:
            published[stamp_ns] = time.monotonic()

    rep = BagReplayer(mon.node, bag, loop=True, on_publish=on_pub, exclude=("/conversation/prompt",))
    rep.start()
    t0 = time.monotonic()
    while not mon.chunks and node.alive() and time.monotonic() - t0 < 180:
        time.sleep(0.1)
    if not mon.chunks:
        print("no action chunks:\n" + node.tail(30))
        rep.stop()
        node.stop()
        mon.close()
        rclpy.try_shutdown()
        return {"error": "no action chunks"}, 1
    print(f"{'chunking ' + mode + ': ' if mode else ''}node ready after {time.monotonic() - t0:.1f} s; warm-up "
          f"{a.warmup:.0f} s, measuring {a.duration:.0f} s ...", flush=True)
    time.sleep(a.warmup)
    t_start = time.monotonic()
    time.sleep(a.duration)
    t_end = time.monotonic()
    died = not node.alive()                           # a node that exited mid-measurement makes no benchmark
    diag = dict(mon.diag)
    frame_wait = mon.diag_value("frame_age_at_cycle_ms_p50")
    rtc_ms = mon.diag_value("rtc_ms_p50")
    rep.stop()
    rc, _ = node.stop()
    mon.close()
    rclpy.try_shutdown()
    if died:
        print(f"ros-bench FAILED: the node exited during the measurement (code {rc}); its log: {node.log_path}\n"
              + node.tail(15))
        rc = rc or 1

    with mon.lock:
        chunks = [c for c in mon.chunks if t_start <= c[0] <= t_end]
        trajs = [x for x in mon.trajectories if t_start <= x[0] <= t_end]
    period_ms = 1e3 / a.control_rate
    # joint_trajectory: arrival (this process's ROS clock, the node's clock too: one machine) minus header.stamp
    late = np.array([(x[1] - x[2]) / 1e6 for x in trajs])
    t = np.array([c[0] for c in chunks])
    gaps = np.diff(t) * 1e3 if t.size > 1 else np.array([])
    ticks = np.diff(np.array([c[7] for c in chunks], dtype=np.float64)) / 1e6 if len(chunks) > 1 else np.array([])
    first = {}
    for c in chunks:
        first.setdefault(c[3], c)
    # camera -> chunk: steady-clock arrival of a chunk's first message minus the steady-clock publication of its
    # frame (looked up by the restamped capture stamp); falls back to the ROS clock difference
    lat = []
    for c in first.values():
        tp = published.get(c[2])
        lat.append((c[0] - tp) * 1e3 if tp is not None else (c[1] - c[2]) / 1e6)
    stream = sorted(((c[7], c[3], c[8]) for c in chunks), key=lambda x: x[0])
    res = {
        "host": platform.node(), "python": platform.python_version(),
        "model": f"checkpoint {a.checkpoint}" if a.checkpoint else f"random {a.preset} (H={a.horizon})",
        "frames": f"3 cameras {a.width}x{a.height} @ {a.fps:g} Hz", "duration_s": t_end - t_start,
        "chunking": mode or "(params file)", "blend_steps": params.get("blend_steps"),
        "control_rate_target_hz": a.control_rate,
        "control_rate_hz": len(chunks) / (t_end - t_start),
        "interarrival_ms": stats_ms(gaps),
        "jitter_abs_ms": stats_ms(np.abs(gaps - period_ms)),
        "tick_interval_ms": stats_ms(ticks),          # node side: start_time differences (no DDS, no receiver)
        "tick_jitter_abs_ms": stats_ms(np.abs(ticks - period_ms)),
        "chunks_computed": len(first), "inference_rate_hz": len(first) / (t_end - t_start),
        "camera_to_chunk_ms": stats_ms(lat),
        "trajectory_arrival_minus_stamp_ms": stats_ms(late),
        "trajectories": len(trajs),
        "trajectories_later_than_one_step": int(np.sum(late > period_ms)),
        "inference_latency_ms": stats_ms(c[5] for c in first.values()),
        "frame_age_at_cycle_start_ms_p50": frame_wait,
        "smoothness": smoothness(stream, period_ms / 1e3),
        "rtc_ms_p50": None if rtc_ms is None else float(rtc_ms),
        "node_exit_code": rc, "node_died": died,
        "diagnostics": {k: {"level": v[0], "message": v[1]} for k, v in diag.items()},
    }
    sm = res["smoothness"]
    rows = [
        ("action_chunk rate", f"{res['control_rate_hz']:.1f} Hz", f"target {a.control_rate:g} Hz"),
        ("inter-arrival p50 / p99 / max", _ms(res["interarrival_ms"], ("p50", "p99", "max")),
         f"period {period_ms:.2f} ms"),
        ("|jitter| p50 / p99", _ms(res["jitter_abs_ms"], ("p50", "p99")), "at the receiver"),
        ("node tick |jitter| p50 / p99", _ms(res["tick_jitter_abs_ms"], ("p50", "p99")),
         "start_time deltas, node side"),
        ("new chunks (inference)", f"{res['inference_rate_hz']:.1f} /s", f"{len(first)} chunks"),
        ("camera -> chunk p50 / p99", _ms(res["camera_to_chunk_ms"], ("p50", "p99")), "frame published -> chunk"),
        ("trajectory arrival - stamp", _ms(res["trajectory_arrival_minus_stamp_ms"], ("p50", "p99", "max")),
         f"p50/p99/max; {res['trajectories_later_than_one_step']} of {len(trajs)} > 1 step"),
        ("inference latency p50 / p99", _ms(res["inference_latency_ms"], ("p50", "p99")), "engine, in node"),
        ("frame age at cycle start p50", "-" if frame_wait is None else f"{float(frame_wait):.1f} ms",
         "waiting for the running cycle (node diagnostics)"),
        ("step at switch p50 / p95", _num(sm["switch"], ("p50", "p95")), "executed stream (row 0 per tick)"),
        ("step inside chunk p50 / p95", _num(sm["inside"], ("p50", "p95")),
         "switch/inside p50 " + ("-" if sm["ratio_p50"] is None else f"{sm['ratio_p50']:.1f}x")),
    ]
    print(f"\noxygen ros-bench: {res['model']}, {res['frames']}, {res['duration_s']:.1f} s measured"
          + (f", chunking {mode}" if mode else ""))
    print(f"{'metric':32s} {'value':>24s}   note")
    print("-" * 80)
    for name, val, note in rows:
        print(f"{name:32s} {val:>24s}   {note}")
    return res, rc


def _num(s: dict, keys) -> str:
    if not s.get("n"):
        return "-"
    return " / ".join(f"{s[k]:.3g}" for k in keys)


def _print_smoothness(runs: dict) -> None:
    print("\nsmoothness of the executed stream (L2 step between consecutive ticks, robot units)")
    print(f"{'chunking':10s} {'switch p50':>11s} {'p95':>9s} {'max':>9s} {'inside p50':>11s} {'p95':>9s} "
          f"{'max':>9s} {'ratio p50':>10s} {'ratio p95':>10s} {'infer p50 ms':>13s} {'rtc ms':>8s}")
    for mode, r in runs.items():
        if "smoothness" not in r:
            print(f"{mode:10s} {r.get('unavailable') or r.get('error')}")
            continue
        sm, sw, ins = r["smoothness"], r["smoothness"]["switch"], r["smoothness"]["inside"]

        def f(d, k):
            return f"{d[k]:.3g}" if d.get("n") else "-"

        def rt(x):
            return "-" if x is None else f"{x:.2f}"
        inf = r["inference_latency_ms"]
        inf_p50 = f"{inf['p50']:.1f}" if inf.get("n") else "-"
        rtc = "-" if r.get("rtc_ms_p50") is None else f"{r['rtc_ms_p50']:.1f}"
        print(f"{mode:10s} {f(sw, 'p50'):>11s} {f(sw, 'p95'):>9s} {f(sw, 'max'):>9s} {f(ins, 'p50'):>11s} "
              f"{f(ins, 'p95'):>9s} {f(ins, 'max'):>9s} {rt(sm['ratio_p50']):>10s} {rt(sm['ratio_p95']):>10s} "
              f"{inf_p50:>13s} {rtc:>8s}")


def _ms(s: dict, keys) -> str:
    if not s.get("n"):
        return "-"
    return " / ".join(f"{s[k]:.1f}" for k in keys) + " ms"


if __name__ == "__main__":
    raise SystemExit(main())
