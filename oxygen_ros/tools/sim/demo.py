"""``oxygen demo`` (``make demo``): the project's main job, end to end on one machine in a few minutes.

This file owns the demo.  By default it runs the closed loop as a robot would: ``sim_node`` (the simulated ALOHA:
three cameras, joint states, ``/clock``; ``clock: realtime`` at ``--real-time-factor``) and ``oxygen_node`` (the shipped
demo policy, ``checkpoint: demo``, in ``oxygen`` engine mode, on sim time) as separate processes over DDS, and walks
through ``--episodes`` episodes of each task (reach, pick, transfer; seeds never used in training).  The terminal shows
each episode's instruction and outcome, one status line per second (control rate, inference cycles/s, action
frequency, tokens/s, KV use), every scene question with the model's answer and the ground truth (asked on
``conversation/prompt`` while the robot works) and every memory entry with the ground truth.  It writes
``out/demo.mp4`` (the three cameras, the executed joint commands, the questions and answers), ``out/demo_timeline.png``
(chunk arrivals, tokens per request, latency) and ``out/demo_summary.json``.  ``--checkpoint`` runs another policy
(``""`` with ``--preset``: random weights); ``--bag PATH`` (or ``--bag synthetic``) runs the older open-loop demo: the
node fed by a replayed bag.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from .demo_timeline import RANDOM_NOTE, diag_level, plot_timeline

QUESTIONS = ("What do you see on the table?", "Where is the red block?", "What should the robot do next?",
             "Is the bowl empty?")

def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="oxygen demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--episodes", type=int, default=2, help="episodes per task (default: %(default)s)")
    p.add_argument("--tasks", default="reach,pick,transfer", help="tasks, in order (default: %(default)s)")
    p.add_argument("--seed", type=int, default=900_000, help="first seed (training used 100000..; default %(default)s)")
    p.add_argument("--real-time-factor", type=float, default=0.5, help="sim seconds per wall second (<= 1)")
    p.add_argument("--out", default="out", help="output folder (default: %(default)s)")
    p.add_argument("--checkpoint", default="demo", help="policy checkpoint (default: the shipped demo policy; "
                                                        "\"\" = random weights of --preset)")
    p.add_argument("--preset", default="tiny", help="model preset without checkpoint (default: %(default)s)")
    p.add_argument("--engine-mode", default="oxygen", choices=("oxygen", "shared", "isolated"))
    p.add_argument("--device", default="auto", help="policy device: auto (cuda when available) | cpu | cuda[:N]")
    p.add_argument("--bag", default="", help="the open-loop demo instead: replay this bag (or `synthetic`)")
    p.add_argument("--duration", type=float, default=20.0, help="--bag: seconds of live run (default: %(default)s)")
    p.add_argument("--horizon", type=int, default=50,
                   help="--bag: action horizon for random weights (default 50 = pi0.5's)")
    p.add_argument("--params-file", default="", help="node parameter YAML (default: config/sim_aloha.yaml, "
                                                     "--bag: config/oxygen.yaml)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--no-video", action="store_true")
    a = p.parse_args(argv)
    if a.bag:
        return _bag_demo(a)
    from .demo_loop import run  # noqa: PLC0415
    return run(a)


def _bag_demo(a) -> int:
    """The node fed by a replayed bag (``--bag PATH`` or ``--bag synthetic``) on wall time."""
    from oxygen_ros.tools.harness import Monitor, NodeProcess, isolate_dds, stats_ms  # noqa: PLC0415
    from oxygen_ros.tools.bags.replay import BagReplayer, make_bag  # noqa: PLC0415

    isolate_dds()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    print("oxygen demo --bag: node + replayed bag + conversation, live metrics", flush=True)
    if not a.checkpoint:
        print(RANDOM_NOTE.format(preset=a.preset), flush=True)
    if a.bag != "synthetic":
        bag = Path(a.bag)
    else:
        t = time.monotonic()
        bag = make_bag(out / "demo_bag", duration=10.0, fps=15.0, width=320, height=240, overwrite=True)
        print(f"[setup] wrote synthetic bag {bag} (3 cameras 320x240 @ 15 Hz, joints, instruction) "
              f"in {time.monotonic() - t:.1f} s", flush=True)

    params = {"memory_db": str(out / "demo_memory.db"), "memory_interval_s": 4.0, "device": a.device,
              "max_new_tokens": 24}
    if a.checkpoint:
        params["checkpoint"] = a.checkpoint
    else:
        # sampled (not greedy) so the random model's streamed text visibly changes token by token
        params.update(preset=a.preset, horizon=a.horizon, temperature=1.0)
    node = NodeProcess(out / "demo_node.log", params, a.params_file or None)
    print(f"[setup] started oxygen_node (pid {node.proc.pid}, log {out / 'demo_node.log'}); loading the model ...",
          flush=True)

    import rclpy  # noqa: PLC0415

    mon = Monitor("oxygen_demo")
    rep = BagReplayer(mon.node, bag, loop=True, exclude=("/conversation/prompt",))
    rep.start()
    t_wait = time.monotonic()
    while not mon.chunks:
        if not node.alive():
            print("oxygen_node exited during start-up:\n" + node.tail(30), flush=True)
            rep.stop()
            mon.close()
            rclpy.try_shutdown()
            return 1
        if time.monotonic() - t_wait > 180:
            print("no action chunks after 180 s:\n" + node.tail(30), flush=True)
            rep.stop()
            node.stop()
            mon.close()
            rclpy.try_shutdown()
            return 1
        time.sleep(0.1)
    print(f"[ready] first action chunk after {time.monotonic() - t_wait:.1f} s; running {a.duration:.0f} s\n",
          flush=True)

    t_start = time.monotonic()
    asked: dict[float, str] = {}
    q_times = [2.0 + i * (a.duration - 4.0) / max(1, len(QUESTIONS)) for i in range(len(QUESTIONS))]
    shown = 0
    next_status = t_start + 1.0
    try:
        while time.monotonic() - t_start < a.duration and node.alive():
            el = time.monotonic() - t_start
            if q_times and el >= q_times[0]:
                q = QUESTIONS[len(asked)]
                q_times.pop(0)
                asked[time.monotonic()] = q
                mon.ask(q)
                print(f"  >> asked: {q!r}", flush=True)
            while shown < len(mon.responses):
                tr, text = mon.responses[shown]
                shown += 1
                print(f"  << answer ({len(text)} chars, streamed): {text[:100]!r}", flush=True)
            if time.monotonic() >= next_status:
                next_status += 1.0
                with mon.lock:
                    partial = {}
                    for _, rid, task, _, text, final, _ in mon.tokens[-400:]:
                        if task == "conversation":
                            partial.setdefault(rid, []).append(text)
                    mem = len(mon.memory)
                kv = mon.diag_value("kv_used_fraction", 0.0) or 0.0
                line = (f"[{el:5.1f} s] control {mon.chunk_rate():5.1f} Hz | action freq "
                        f"{mon.diag_value('action_frequency_hz', 0.0):6.0f}/s | cycles "
                        f"{mon.diag_value('inference_rate_hz', 0.0):4.1f}/s | tokens "
                        f"{mon.diag_value('tokens_per_s', 0.0):5.1f}/s | KV {100 * kv:4.1f}% | active "
                        f"{int(mon.diag_value('active_requests', 0) or 0)} | memory {mem} | obs age "
                        f"{mon.diag_value('observation_age_s', -1):.2f} s | "
                        f"{diag_level(mon.diag, 'oxygen_node: control')}")
                if partial:
                    rid = max(partial)
                    line += f" | streaming #{rid}: {''.join(partial[rid])[-24:]!r}"
                print(line, flush=True)
            time.sleep(0.05)
    except KeyboardInterrupt:
        print("\ninterrupted", flush=True)
    t_end = time.monotonic()
    rep.stop()
    rc, dt_stop = node.stop()
    time.sleep(0.2)
    mon.close()
    rclpy.try_shutdown()

    # ---- summary ---------------------------------------------------------------------------------------------
    chunks, tokens, new_chunk = mon.window(t_start, t_end)
    with mon.lock:
        responses = list(mon.responses)
        memory = list(mon.memory)
        diag = dict(mon.diag)
    dur = max(1e-6, t_end - t_start)
    arr = np.array([c[0] for c in chunks])
    gaps = np.diff(arr) * 1e3 if arr.size > 1 else np.array([])
    ticks = np.diff(np.array([c[7] for c in chunks], dtype=np.float64)) / 1e6    # start_time: the node's own clock
    summary = {
        "duration_s": dur, "model": "checkpoint " + a.checkpoint if a.checkpoint else f"random {a.preset}",
        "control_rate_hz": len(chunks) / dur, "control_interarrival_ms": stats_ms(gaps),
        "control_tick_interval_ms": stats_ms(ticks),
        "chunks_computed": len(new_chunk), "inference_rate_hz": len(new_chunk) / dur,
        "inference_latency_ms": stats_ms(c[5] for c in new_chunk.values()),
        "observation_age_ms": stats_ms(1e3 * c[6] for c in chunks),
        "tokens": len(tokens), "tokens_per_s": len(tokens) / dur,
        "conversation_questions": len(asked), "conversation_answers": len(responses),
        "memory_entries": len(memory), "node_exit_code": rc, "node_shutdown_s": dt_stop,
        "diagnostics": {k: {"level": v[0], "message": v[1]} for k, v in diag.items()},
    }
    print("\n=== summary ===")
    print(f"control      {summary['control_rate_hz']:.1f} Hz on action_chunk (target 70), inter-arrival p50 "
          f"{summary['control_interarrival_ms'].get('p50', 0):.1f} ms, p99 "
          f"{summary['control_interarrival_ms'].get('p99', 0):.1f} ms")
    print(f"inference    {summary['inference_rate_hz']:.1f} chunks/s, latency p50 "
          f"{summary['inference_latency_ms'].get('p50', 0):.0f} ms; observation age p50 "
          f"{summary['observation_age_ms'].get('p50', 0):.0f} ms")
    print(f"language     {summary['tokens']} tokens ({summary['tokens_per_s']:.1f}/s), "
          f"{len(responses)}/{len(asked)} answers, {len(memory)} memory entries (stored in {out / 'demo_memory.db'})")
    for _, text in responses[:4]:
        print(f"   answer: {text[:80]!r}")
    for _, eid, text in memory[:3]:
        print(f"   memory #{eid}: {text[:80]!r}")
    print("diagnostics  " + ", ".join(f"{k.split(': ')[-1]}={diag_level(diag, k)}" for k in sorted(diag)))
    print(f"node exit    code {rc} after SIGINT in {dt_stop:.2f} s")
    (out / "demo_summary.json").write_text(json.dumps(summary, indent=2, default=float))
    print(f"wrote {out / 'demo_summary.json'}")
    if not a.no_plot:
        png = out / "demo_timeline.png"
        plot_timeline(png, t_start, chunks, new_chunk, tokens, asked, responses)
        print(f"wrote {png} (timeline: action chunks, tokens per request, latency)")
    if not a.checkpoint:
        print(RANDOM_NOTE.format(preset=a.preset))
    return 0 if rc == 0 and chunks else 1


if __name__ == "__main__":
    raise SystemExit(main())
