"""The closed-loop part of ``oxygen demo`` (``tools/sim/demo.py`` holds the options): the shipped policy driving the
simulated robot over DDS, narrated live, recorded as a video.

This file owns that run: ``run(args)`` starts ``oxygen_node`` (``config/sim_aloha.yaml``, ``use_sim_time``, the
policy) and ``sim_node`` (``clock: realtime``, one episode per ``~/reset``) through ``tools/harness.py``, watches them
with ``harness.Monitor`` (chunks, tokens, diagnostics) and ``sim_realtime.SimWatch`` (episodes, cameras, executed
commands, ground truth), starts each episode, asks the scene questions on ``conversation/prompt`` every
``QUESTION_EVERY_S`` of sim time, prints outcomes, status lines, answers and memory entries with their ground truth,
and writes the video (``tools/sim/video.py``), the timeline and the summary.  Exit status 0 when both nodes ran and
exited cleanly (not a judgement of the policy: the summary reports success and answer accuracy).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

__all__ = ["run"]

QUESTION_EVERY_S = 1.2          # sim seconds between scene questions during an episode
MEMORY_EVERY_S = 2.0            # the node's memory_interval_s (sim time)
ANSWER_WAIT_S = 2.0             # wall seconds an answer waits for its frame's capture time and ground truth


def run(a) -> int:
    import rclpy  # noqa: PLC0415

    from oxygen_ros.ros.engine_factory import resolve_checkpoint  # noqa: PLC0415
    from oxygen_ros.ros.lockstep import default_sim_params  # noqa: PLC0415
    from oxygen_ros.sim.tasks import QUESTIONS, TASKS, draw_task  # noqa: PLC0415

    from .demo_timeline import RANDOM_NOTE, diag_level, plot_timeline  # noqa: PLC0415
    from ..harness import Monitor, NodeProcess, isolate_dds, stats_ms  # noqa: PLC0415
    from .report import normalise  # noqa: PLC0415
    from .realtime import SimWatch  # noqa: PLC0415
    from .video import EpisodeVideo  # noqa: PLC0415

    tasks = [t.strip() for t in a.tasks.split(",") if t.strip()]
    bad = [t for t in tasks if t not in TASKS]
    if bad or a.episodes < 1 or not 0 < a.real_time_factor <= 1:
        print(f"oxygen demo: error: tasks must be among {list(TASKS)} (got {bad}), --episodes >= 1, "
              "0 < --real-time-factor <= 1")
        return 2
    if a.checkpoint and not Path(resolve_checkpoint(a.checkpoint)).is_dir():
        print(f"oxygen demo: error: checkpoint {a.checkpoint!r} not found ({resolve_checkpoint(a.checkpoint)}); "
              "`make train-demo` trains the demo policy")
        return 2
    isolate_dds()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    print("oxygen demo: the simulated ALOHA (sim_node) + oxygen_node over DDS, "
          f"real-time factor {a.real_time_factor:g}", flush=True)
    params = {"use_sim_time": True, "engine_mode": a.engine_mode, "device": a.device, "memory_interval_s":
              MEMORY_EVERY_S, "memory_db": str(out / "demo_memory.db"), "max_new_tokens": 40,
              "checkpoint": a.checkpoint}
    if not a.checkpoint:
        params.update(preset=a.preset)
        print(RANDOM_NOTE.format(preset=a.preset), flush=True)
    (out / "demo_memory.db").unlink(missing_ok=True)
    node = NodeProcess(out / "demo_node.log", params, a.params_file or default_sim_params())
    sim = NodeProcess(out / "demo_sim.log", {"clock": "realtime", "real_time_factor": a.real_time_factor,
                                             "autostart": False, "episodes": 1, "tail_s": 0.5},
                      module="oxygen_ros.ros.sim_node")
    print(f"[setup] oxygen_node pid {node.proc.pid} (policy {a.checkpoint or 'random ' + a.preset}), sim_node pid "
          f"{sim.proc.pid}; logs in {out}/demo_node.log, demo_sim.log; loading ...", flush=True)
    rclpy.init(args=[])
    mon, watch = Monitor("oxygen_demo"), SimWatch(images=not a.no_video)
    video = EpisodeVideo("oxygen demo", 10.0)
    results, qa, memories = [], [], []
    rc_node = rc_sim = None
    t_start = time.monotonic()
    try:
        t0 = time.monotonic()
        while "active:" not in node.log():
            if not node.alive() or not sim.alive() or time.monotonic() - t0 > 240:
                print("the nodes did not come up:\n" + node.tail(15) + "\n" + sim.tail(8), flush=True)
                return 1
            time.sleep(0.2)
        if not watch.reset.wait_for_service(timeout_sec=30):
            print("sim_node's ~/reset did not appear:\n" + sim.tail(8))
            return 1
        print(f"[ready] in {time.monotonic() - t0:.1f} s\n", flush=True)
        t_start = time.monotonic()
        seed = a.seed
        for task in tasks:
            for _ in range(a.episodes):
                results.append(_episode(a, task, seed, watch, mon, node, sim, draw_task(task, seed), QUESTIONS,
                                        qa, memories, video, normalise, diag_level))
                seed += 1
    except KeyboardInterrupt:
        print("\ninterrupted", flush=True)
    finally:
        t_end = time.monotonic()
        rc_sim, _ = sim.stop()
        rc_node, dt_stop = node.stop()
        time.sleep(0.2)
        watch.close()
        mon.close()
        rclpy.try_shutdown()

    # ---- summary -------------------------------------------------------------------------------------------------
    chunks, tokens, new_chunk = mon.window(t_start, t_end)
    with mon.lock:
        responses = list(mon.responses)
    dur = max(1e-6, t_end - t_start)
    ok = [r for r in results if r["success"]]
    right = [q for q in qa if q["ok"]]
    scored = [q for q in qa if q["scored"]]
    mem_ok = [m for m in memories if m["objects_ok"]]
    summary = {"policy": a.checkpoint or f"random {a.preset}", "engine_mode": a.engine_mode,
               "real_time_factor": a.real_time_factor, "episodes": results,
               "success": f"{len(ok)}/{len(results)}", "answers": qa, "answers_right": f"{len(right)}/{len(scored)}",
               "answers_unscored": len(qa) - len(scored),
               "memory": memories, "memory_objects_right": f"{len(mem_ok)}/{len(memories)}",
               "wall_s": dur, "inference_rate_hz": len(new_chunk) / dur,
               "inference_latency_ms": stats_ms(c[5] for c in new_chunk.values()),
               "tokens_per_s": len(tokens) / dur, "node_exit_code": rc_node, "sim_exit_code": rc_sim}
    print("\n=== summary ===")
    for r in results:
        print(f"  {r['task']:8} seed {r['seed']}: {'SUCCESS' if r['success'] else 'failed '} "
              f"{'(' + format(r['time'], '.1f') + ' s)' if r['success'] else ''}  {r['instruction']!r}")
    print(f"success      {summary['success']} episodes")
    print(f"answers      {summary['answers_right']} exactly right ({summary['answers_unscored']} unscored: frame "
          f"unknown); memory entries naming the right cubes {summary['memory_objects_right']}")
    print(f"inference    {summary['inference_rate_hz']:.1f} cycles/s (wall), latency p50 "
          f"{summary['inference_latency_ms'].get('p50', 0):.0f} ms; {summary['tokens_per_s']:.1f} tokens/s")
    print(f"exit codes   oxygen_node {rc_node}, sim_node {rc_sim}")
    (out / "demo_summary.json").write_text(json.dumps(summary, indent=1, default=float))
    print(f"wrote {out / 'demo_summary.json'}")
    if not a.no_video and video.frames:
        video.fps = 10.0 * a.real_time_factor
        print(f"wrote {video.write(out / 'demo.mp4')} ({len(video.frames)} frames: cameras, joints, answers)")
    if not a.no_plot:
        png = out / "demo_timeline.png"
        plot_timeline(png, t_start, chunks, new_chunk, tokens, {}, responses, control_hz=50.0)
        print(f"wrote {png}")
    return 0 if rc_node == 0 and rc_sim == 0 and results else 1


def _episode(a, task, seed, watch, mon, node, sim, spec, questions, qa, memories, video, normalise, level) -> dict:
    from oxygen_ros.sim.tasks import MEMORY_PROMPT  # noqa: PLC0415
    from oxygen_ros.srv import ResetEpisode  # noqa: PLC0415

    from .report import colours_in  # noqa: PLC0415

    watch.clear()
    n_ans, n_mem = len(watch.answers), len(watch.memories)
    fut = watch.reset.call_async(ResetEpisode.Request(seed=seed, task=task))
    while not fut.done():
        time.sleep(0.02)
    eid = int(fut.result().episode_id)
    print(f"--- episode {eid}: {task} seed {seed}: {spec.instruction!r}", flush=True)
    start_ns, next_q, qi, last_status = None, None, 0, time.monotonic()
    lines: list = []                                  # (sim ns when it was known, text) for the video
    shown_ans = shown_mem = 0
    pending: dict[int, float] = {}                    # answer index -> when first seen, waiting for its frame
    while True:
        with watch.lock:
            sts = list(watch.status.get(eid, []))
            now = watch.sim_ns
            answers, mems = list(watch.answers), list(watch.memories)
            frames, texts = dict(watch.frames), dict(watch.texts)
        if sts and start_ns is None:
            start_ns = watch._ns(sts[0].header.stamp) - int(round(sts[0].elapsed * 1e9))
            next_q = start_ns + int(0.3e9)
        if next_q is not None and now >= next_q:
            q = questions[qi % len(questions)]
            qi += 1
            watch.prompt.publish(watch.String(data=q))
            next_q += int(QUESTION_EVERY_S * 1e9)
        for m in answers[shown_ans:]:
            cap = frames.get(int(m.frame_index))
            known = cap is not None and cap in texts
            # the answer can arrive before the action_chunk that maps its frame index to a capture time (or before
            # that frame's ground truth): wait for them up to ANSWER_WAIT_S, then report the answer unscored
            first = pending.setdefault(shown_ans, time.monotonic())
            if not known and time.monotonic() - first < ANSWER_WAIT_S:
                break
            shown_ans += 1
            gt = texts[cap][0].get(m.prompt) if known else None
            ok = gt is not None and normalise(m.text) == normalise(gt)
            qa.append({"episode": eid, "q": m.prompt, "a": m.text, "ground_truth": gt, "ok": ok,
                       "scored": gt is not None})
            verdict = "right" if ok else (f"truth: {gt}" if gt is not None else "unscored: frame unknown")
            lines.append((watch._ns(m.header.stamp), f"Q: {m.prompt}  A: {m.text}  [{verdict}]"))
            print(f"    Q: {m.prompt!r}\n    A: {m.text!r}   {'(right)' if ok else f'(ground truth: {gt!r})'}",
                  flush=True)
        for m in mems[shown_mem:]:
            shown_mem += 1
            gt = texts.get(watch._ns(m.header.stamp), ({}, None))[1]
            right = gt is not None and colours_in(m.text) == colours_in(gt)
            memories.append({"episode": eid, "text": m.text, "ground_truth": gt, "objects_ok": right})
            lines.append((now, f"memory: {m.text}"))
            print(f"    memory: {m.text!r}   {'(right cubes)' if right else f'(ground truth: {gt!r})'}",
                  flush=True)
        if time.monotonic() - last_status >= 1.0:
            last_status = time.monotonic()
            kv = mon.diag_value("kv_used_fraction", 0.0) or 0.0
            el = (now - start_ns) / 1e9 if start_ns else 0.0
            d = mon.diag_value
            print(f"  [sim {el:4.1f} s] cycles {d('inference_rate_hz', 0.0):4.1f}/s | action freq "
                  f"{d('action_frequency_hz', 0.0):5.0f}/s | tokens {d('tokens_per_s', 0.0):5.1f}/s | KV "
                  f"{100 * kv:4.1f}% | {level(mon.diag, 'oxygen_node: control')}", flush=True)
        if sts and sts[-1].done:
            break
        if not (node.alive() and sim.alive()):
            raise RuntimeError("a node exited during the demo:\n" + node.tail(10) + "\n" + sim.tail(10))
        time.sleep(0.02)
    time.sleep(0.3)
    last = sts[-1]
    with watch.lock:
        imgs = sorted(watch.images.items())
        cmds = [(t, p) for t, p in watch.exec]
    for t, ims in imgs:
        if any(x is None for x in ims):
            continue
        commands = [p for tc, p in cmds if tc <= t]
        el = (t - start_ns) / 1e9 if start_ns else 0.0
        status = "SUCCESS" if (last.success and el >= last.elapsed - 0.6) else ""
        video.title = f"episode {eid} {task}: {spec.instruction}"
        video.add_frame(el, ims, commands[-250:], [text for tl, text in lines if tl <= t], status)
    print(f"    -> {'SUCCESS' if last.success else 'failed'} ({last.detail}) after {last.elapsed:.1f} s sim time",
          flush=True)
    return {"episode": eid, "task": task, "seed": seed, "instruction": spec.instruction, "success": bool(last.success),
            "time": float(last.elapsed), "detail": last.detail, "memory_prompt": MEMORY_PROMPT}
