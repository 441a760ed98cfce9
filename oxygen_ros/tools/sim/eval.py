"""``oxygen sim-eval``: closed-loop evaluation of a policy in the simulation, over a grid of conditions.

This file owns the evaluation run: the grid (``--engine-mode`` x ``--chunking`` x ``--delay-ms`` x ``--language``,
each a comma-separated list), the episodes (every task x seed of ``--seeds A:B`` in every cell), their distribution
over ``--workers`` processes, the outputs and the merge of shards.  An episode runs in lockstep (``sim/episode.py``):
the policy side is the node's own ``Pipeline`` (``ros/lockstep.py``) with the modelled delay d = round(delay / 20 ms)
control steps; the policy is ``expert`` (the scripted expert through the same action path), ``random`` (random
weights of ``preset``) or a checkpoint directory (the node's ``checkpoint`` parameter).  Language load
``none`` | ``q<s>`` | ``m<s>`` | ``q<s>m<s>``: a scene question every <s> sim seconds on the conversation path and/or a
memory request every <s> (the node's ``memory_interval_s``); answers and memory entries are scored against the
ground truth of the frame they read (``tools/sim/report.py`` defines every number).

Outputs under ``--out``: the table on stdout and in ``table.txt``, ``results.json`` (configuration, hardware, per
cell aggregates, every episode), ``summary.json`` (the same without the per-episode lists: what ``bench/results/``
keeps), plots (``results_delay.png``, ``results_language.png`` when those axes vary) and one
episode video per cell (``videos/*.mp4``, the first seed of the first task, unless ``--no-video``).  Files are
written atomically (temp file + rename).  A worker that crashes is reported with the episode it was running, which is
marked incomplete (never counted as a failure); the grid still finishes.  ``--merge DIR ...`` combines the
``results.json`` of shards (same grid, disjoint seed ranges, e.g. a job array) into one.  Lockstep results depend only
on the arguments: a repeated run gives identical results.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
import traceback
from pathlib import Path

__all__ = ["main", "run_grid", "merge"]


def _language(text: str) -> str:
    """argparse type of a language load label (checked by ``LanguageLoad.parse_periods``)."""
    from oxygen_ros.ros.lockstep import LanguageLoad  # noqa: PLC0415 - ROS message types load only when used
    try:
        LanguageLoad.parse_periods(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _csv(choices=None, conv=str):
    def parse(text: str) -> list:
        items = [x.strip() for x in text.split(",") if x.strip()]
        if not items:
            raise argparse.ArgumentTypeError("empty list")
        out = []
        for x in items:
            if choices and x not in choices:
                raise argparse.ArgumentTypeError(f"{x!r} is not one of {list(choices)}")
            try:
                out.append(conv(x))
            except (ValueError, argparse.ArgumentTypeError) as exc:
                raise argparse.ArgumentTypeError(f"bad value {x!r}: {exc}") from None
        return out
    return parse


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------------------------------------
# one worker: runs episodes of any cell
# ------------------------------------------------------------------------------------------------------------------
class _Worker:
    def __init__(self, common: dict):
        self.c = common
        self.sim = None
        self.policies: dict = {}

    def policy(self, cell: dict):
        from oxygen_ros.ros.lockstep import LanguageLoad, PipelinePolicy, sim_settings  # noqa: PLC0415
        from oxygen_ros.sim.tasks import QUESTIONS  # noqa: PLC0415

        key = (cell["engine_mode"], cell["chunking"], cell["language"])
        if key not in self.policies:
            c = self.c
            q, m = LanguageLoad.parse_periods(cell["language"])
            lang = LanguageLoad(q, m, QUESTIONS)
            self.policies[key] = PipelinePolicy(sim_settings(c["params"], cell_node_params(c, cell)),
                                                expert=c["policy"] == "expert", horizon=c["horizon"], language=lang)
            if c.get("locate_prompt"):
                from oxygen_ros.sim.locate_prompt import wrap  # noqa: PLC0415
                self.policies[key] = wrap(self.policies[key], c["locate_prompt"])
        return self.policies[key]

    def close(self) -> None:
        for p in self.policies.values():
            p.close()
        self.policies.clear()
        if self.sim is not None:
            self.sim.close()                         # the EGL context, before the interpreter tears EGL down
            self.sim = None

    def run(self, job: dict) -> dict:
        from oxygen_ros.sim.episode import EpisodeConfig, run_episode  # noqa: PLC0415
        from oxygen_ros.sim.scene import CONTROL_DT, AlohaScene  # noqa: PLC0415
        from oxygen_ros.sim.tasks import draw_task  # noqa: PLC0415

        from .report import episode_measures  # noqa: PLC0415

        c, cell = self.c, job["cell"]
        if self.sim is None:
            self.sim = AlohaScene((c["camera_size"], c["camera_size"]))
        pol = self.policy(cell)
        spec = draw_task(job["task"], job["seed"])
        cfg = EpisodeConfig(delay_steps=cell["delay_steps"], camera_every=c["camera_every"])
        hooks = {}
        video = None
        steps = []                                      # on_step hooks of this episode (trace, video)
        tracer = None
        if c.get("trace"):
            from oxygen_ros.sim.trace import EpisodeTracer  # noqa: PLC0415
            tracer = EpisodeTracer(self.sim, spec)
            steps.append(tracer.on_step)
        if job.get("video"):
            from .video import EpisodeVideo  # noqa: PLC0415
            video = EpisodeVideo(f"{spec.task} seed {spec.seed}: {spec.instruction}",
                                 1.0 / (CONTROL_DT * c["camera_every"]))
            cmds = []

            def video_step(t, state, cmd, monitor):
                cmds.append(cmd)
                hooks["success"] = monitor.success

            def on_frame(frame, gt):
                lines = [f"Q: {e['prompt']}  A: {e['text']!r}" if e["kind"] == "conversation"
                         else f"memory: {e['text']!r}" for e in pol.language_log]
                status = "SUCCESS" if hooks.get("success") else ""
                video.add_frame(frame.t, frame.images, cmds, lines, status)
            steps.append(video_step)
            hooks["on_frame"] = on_frame

        def on_step(*args):
            for f in steps:
                f(*args)
        res = run_episode(self.sim, spec, pol, cfg, on_step=on_step if steps else None,
                          on_frame=hooks.get("on_frame"))
        out = episode_measures(res, pol.language_log, pol.horizon)
        out["cycle_outcomes"] = dict(pol.cycle_outcomes)
        if tracer is not None:
            out["trace_summary"] = tracer.summary(res.success)
            out["trace"] = tracer.series(0.1)
        if video is not None:
            path = Path(c["out"]) / "videos" / f"{job['cell_name']}.mp4"
            path.parent.mkdir(parents=True, exist_ok=True)
            out["video"] = str(video.write(path))
        return out


def _die_with_parent() -> None:
    """A worker never outlives the evaluation that started it, however that one ends (SIGKILL, a second Ctrl-C during
    its cleanup): on Linux the kernel sends the worker SIGKILL when its parent dies (PR_SET_PDEATHSIG); a parent gone
    before that was set is caught by the ppid check.  Ctrl-C in a terminal reaches the whole process group: the
    workers ignore it and the parent, which gets it too, terminates them."""
    import multiprocessing as mp  # noqa: PLC0415
    import signal  # noqa: PLC0415

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        import ctypes  # noqa: PLC0415
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))        # 1 = PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    parent = mp.parent_process()
    if parent is not None and os.getppid() != parent.pid:
        os._exit(1)


def _worker_main(common: dict, jobs, results) -> None:
    _die_with_parent()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    w = _Worker(common)
    while True:
        job = jobs.get()
        if job is None:
            w.close()
            return
        results.put(("start", os.getpid(), job["id"], None))
        results.put(("done", os.getpid(), job["id"], _safe_run(w, job)))


def _safe_run(w: _Worker, job: dict) -> dict:
    try:
        return w.run(job)
    except Exception as exc:  # noqa: BLE001 - one failing episode never stops the grid
        return {"task": job["task"], "seed": job["seed"], "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc(limit=5)}


# ------------------------------------------------------------------------------------------------------------------
# the grid
# ------------------------------------------------------------------------------------------------------------------
class _Progress:
    def __init__(self, total: int, quiet: bool):
        self.total, self.done, self.quiet, self.t0 = total, 0, quiet, time.perf_counter()

    def tick(self, failed: bool = False) -> None:
        self.done += 1
        if self.quiet:
            return
        el = time.perf_counter() - self.t0
        rate = self.done / el if el > 0 else 0.0
        eta = (self.total - self.done) / rate if rate > 0 else 0.0
        bar = "#" * int(30 * self.done / self.total)
        print(f"\r[{bar:<30}] {self.done}/{self.total} episodes  {rate * 60:.0f}/min  eta {eta:.0f} s ",
              end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if not self.quiet:
            print(file=sys.stderr)


def cell_node_params(common: dict, cell: dict) -> dict:
    """The node parameters one grid cell runs with, in either clock mode: the ``-p`` overrides (a ``blend_steps``
    override only in blend cells: the node refuses it with another chunking), the cell's engine mode and chunking, and
    the policy (a checkpoint; ``random``: random weights of the preset; ``expert``: absolute actions, no model)."""
    ov = dict(common["overrides"])
    if cell["chunking"] != "blend":
        ov.pop("blend_steps", None)
    ov.update(engine_mode=cell["engine_mode"], chunking=cell["chunking"])
    if common["policy"] == "expert":
        ov["delta_action_mask"] = []
    else:
        ov["checkpoint"] = "" if common["policy"] == "random" else common["policy"]
    return ov


def run_realtime(common: dict, cells: list[dict], tasks: list[str], seeds, rtf: float, quiet: bool = False) -> list:
    """``--clock realtime``: each cell's episodes through sim_node + oxygen_node over DDS, one cell after another
    (``tools/sim/realtime.py``); a cell whose processes fail marks its episodes incomplete."""
    from .realtime import RealtimeCell  # noqa: PLC0415

    prog = _Progress(len(cells) * len(tasks) * len(seeds), quiet)
    out = []
    for cell in cells:
        try:
            eps = RealtimeCell(common, cell, cell_node_params(common, cell), Path(common["out"]) / "logs",
                               rtf).run(tasks, list(seeds), prog.tick)
        except Exception as exc:  # noqa: BLE001 - one broken cell never stops the grid
            print(f"\ncell {cell['name']} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            eps = [{"task": t, "seed": int(s), "error": f"{type(exc).__name__}: {exc}"} for t in tasks for s in seeds]
        for e in eps:
            e["cell"] = cell["name"]
        out += eps
    prog.close()
    return out


def run_grid(common: dict, cells: list[dict], tasks: list[str], seeds, workers: int, video: bool,
             quiet: bool = False) -> list[dict]:
    """Every (cell, task, seed) episode -> the list of episode dicts (each with its cell's key)."""
    jobs = []
    for ci, cell in enumerate(cells):
        for ti, task in enumerate(tasks):
            for si, seed in enumerate(seeds):
                jobs.append({"id": len(jobs), "cell": cell, "cell_name": cell["name"], "task": task,
                             "seed": int(seed), "video": video and ti == 0 and si == 0})
    prog = _Progress(len(jobs), quiet)
    results: dict[int, dict] = {}
    if workers <= 1:
        w = _Worker(common)
        try:
            for job in jobs:
                results[job["id"]] = _safe_run(w, job)
                prog.tick()
        finally:
            w.close()
    else:
        _run_pool(common, jobs, workers, results, prog)
    prog.close()
    out = []
    for job in jobs:
        r = dict(results[job["id"]])
        r["cell"] = job["cell_name"]
        out.append(r)
    return out


def _run_pool(common, jobs, workers, results, prog) -> None:
    import multiprocessing as mp  # noqa: PLC0415
    import queue  # noqa: PLC0415

    ctx = mp.get_context("spawn")
    jq, rq = ctx.Queue(), ctx.Queue()
    for job in jobs:
        jq.put(job)
    procs = []

    def spawn():
        p = ctx.Process(target=_worker_main, args=(common, jq, rq), daemon=True)
        p.start()
        procs.append(p)
        jq.put(None)                                   # one stop marker per worker ever started

    for _ in range(min(workers, len(jobs))):
        spawn()
    running: dict[int, int] = {}                       # pid -> job id
    by_id = {j["id"]: j for j in jobs}
    try:
        while len(results) < len(jobs):
            try:
                kind, pid, jid, payload = rq.get(timeout=1.0)
            except queue.Empty:
                for p in list(procs):
                    if not p.is_alive() and p.exitcode not in (0, None):
                        procs.remove(p)
                        jid = running.pop(p.pid, None)
                        if jid is not None and jid not in results:
                            j = by_id[jid]
                            results[jid] = {"task": j["task"], "seed": j["seed"],
                                            "error": f"worker crashed (exit code {p.exitcode}) in this episode"}
                            prog.tick()
                            print(f"\nworker {p.pid} crashed (exit code {p.exitcode}) running {j['cell_name']} "
                                  f"{j['task']} seed {j['seed']}; marked incomplete, continuing", file=sys.stderr)
                        if len(results) < len(jobs):
                            spawn()
                continue
            if kind == "start":
                running[pid] = jid
            else:
                running.pop(pid, None)
                results[jid] = payload
                prog.tick()
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join(5)


def _cells(engine_modes, chunkings, delays_ms, languages) -> list[dict]:
    from oxygen_ros.sim.scene import CONTROL_DT  # noqa: PLC0415

    cells = []
    for mode, ch, dms, lang in itertools.product(engine_modes, chunkings, delays_ms, languages):
        d = int(round(dms / 1000.0 / CONTROL_DT))
        cells.append({"engine_mode": mode, "chunking": ch, "delay_ms": int(dms), "delay_steps": d,
                      "language": lang, "name": f"{mode}-{ch}-{int(dms)}ms-{lang}"})
    return cells


def _summarise(cells: list[dict], episodes: list[dict]) -> list[dict]:
    from .report import aggregate  # noqa: PLC0415

    out = []
    for cell in cells:
        eps = [e for e in episodes if e["cell"] == cell["name"]]
        c = dict(cell)
        c["aggregate"] = aggregate(eps)
        c["video"] = next((e["video"] for e in eps if e.get("video")), None)
        out.append(c)
    return out


def _hardware() -> dict:
    import platform  # noqa: PLC0415
    import subprocess  # noqa: PLC0415

    cpu = platform.processor()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    hw = {"cpu": cpu, "cpu_count": os.cpu_count(), "python": platform.python_version()}
    try:
        hw["load_avg_end"] = os.getloadavg()
        hw["git_commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                          cwd=os.path.dirname(__file__), timeout=5).stdout.strip()
    except Exception:  # noqa: BLE001
        pass
    return hw


def _write_outputs(out: Path, config: dict, cells: list[dict], episodes: list[dict], wall_s: float) -> str:
    from .report import format_table, plot, summary  # noqa: PLC0415

    out.mkdir(parents=True, exist_ok=True)
    table = format_table(cells)
    plots = plot(cells, out / "results")
    if any(e.get("trace") for e in episodes):
        from oxygen_ros.sim.trace import plot_traces  # noqa: PLC0415
        plots = list(plots or []) + [plot_traces(episodes, out / "results")]
    doc = {"config": config, "hardware": _hardware(), "wall_s": wall_s, "cells": cells, "plots": plots,
           "episodes": episodes}
    _write_atomic(out / "results.json", json.dumps(doc, indent=1, default=str))
    _write_atomic(out / "summary.json", json.dumps(summary(doc), indent=1, default=str))
    _write_atomic(out / "table.txt", table + "\n")
    return table


def merge(dirs: list[str], out: str) -> str:
    docs = [json.loads((Path(d) / "results.json").read_text()) for d in dirs]
    grid = [[c["name"] for c in d["cells"]] for d in docs]
    if any(g != grid[0] for g in grid):
        raise ValueError("the shards' grids differ (engine modes, chunking, delays, language loads must be equal)")
    keys = set()
    episodes = []
    for d in docs:
        for e in d["episodes"]:
            k = (e["cell"], e["task"], e["seed"])
            if k in keys:
                raise ValueError(f"episode {k} appears in more than one shard (overlapping seed ranges)")
            keys.add(k)
            episodes.append(e)
    base = [{k: v for k, v in c.items() if k not in ("aggregate", "video")} for c in docs[0]["cells"]]
    cells = _summarise(base, episodes)
    config = dict(docs[0]["config"])
    config["merged_from"] = [str(d) for d in dirs]
    config["seeds"] = [d["config"]["seeds"] for d in docs]
    return _write_outputs(Path(out), config, cells, episodes, sum(d.get("wall_s", 0) for d in docs))


def _parser() -> argparse.ArgumentParser:
    from oxygen_ros.sim.tasks import TASKS  # noqa: PLC0415

    from .record import parse_seeds  # noqa: PLC0415

    ap = argparse.ArgumentParser(prog="oxygen sim-eval", description=__doc__.split("\n\n")[0])
    ap.add_argument("--policy", default="expert", help="expert | random | demo (the shipped policy) | a checkpoint "
                                                       "directory")
    ap.add_argument("--task", type=_csv(TASKS), default=list(TASKS), help="comma-separated tasks")
    ap.add_argument("--seeds", type=parse_seeds, default=parse_seeds("0:10"), help="seed range A:B (default 0:10)")
    ap.add_argument("--engine-mode", type=_csv(("oxygen", "shared", "isolated")), default=["oxygen"])
    ap.add_argument("--chunking", type=_csv(("blend", "none", "rtc")), default=["blend"])
    ap.add_argument("--delay-ms", type=_csv(conv=float), default=[0.0],
                    help="injected inference delays, ms (rounded to 20 ms control steps)")
    ap.add_argument("--language", type=_csv(conv=_language), default=["none"],
                    help="language loads: none | q<s> | m<s> | q<s>m<s> (question / memory request periods)")
    ap.add_argument("--workers", type=int, default=1, help="parallel worker processes (lockstep)")
    ap.add_argument("--clock", choices=("lockstep", "realtime"), default="lockstep",
                    help="lockstep: in-process, modelled delay, deterministic; realtime: sim_node + oxygen_node over "
                         "DDS, the engine's real compute time is the delay")
    ap.add_argument("--real-time-factor", type=float, default=0.5,
                    help="realtime: sim seconds per wall second (state it with the results)")
    ap.add_argument("--camera-size", type=int, default=96)
    ap.add_argument("--camera-rate", type=float, default=10.0)
    ap.add_argument("--horizon", type=int, default=20, help="the expert's chunk rows (models use their own H)")
    ap.add_argument("--params", default=None, help="node parameter file (default config/sim_aloha.yaml)")
    ap.add_argument("-p", dest="overrides", action="append", default=[], metavar="NAME:=VALUE",
                    help="node parameter override (repeatable), e.g. -p preset:=tiny")
    ap.add_argument("--out", default=None, help="output folder (default out/sim_eval/<UTC time>)")
    ap.add_argument("--no-video", action="store_true")
    ap.add_argument("--trace", action="store_true",
                    help="per episode: gripper-to-cube distance over time, the milestone reached, where the arm stood "
                         "still (sim/trace.py); plotted in results_traces.png")
    ap.add_argument("--locate-prompt", choices=("oracle", "self"), default=None,
                    help="for a policy trained with oxygen train --locate-in-instruction: append the named cube's cell "
                         "to the instruction - oracle: the true cell; self: the model's own answer to 'Where is the "
                         "<named> cube?', asked every frame (sim/locate_prompt.py); lockstep only")
    ap.add_argument("--merge", nargs="+", metavar="DIR", help="merge shards' results.json into --out and exit")
    ap.add_argument("--quiet", action="store_true")
    return ap


def main(argv=None) -> int:
    from oxygen_ros.ros.parameters import ConfigureError, parse_overrides  # noqa: PLC0415
    from oxygen_ros.sim.scene import CONTROL_DT  # noqa: PLC0415

    ap = _parser()
    o = ap.parse_args(argv)
    out = Path(o.out or Path("out") / "sim_eval" / time.strftime("%Y%m%d-%H%M%S", time.gmtime()))
    if o.merge:
        try:
            print(merge(o.merge, str(out)))
        except (OSError, ValueError, KeyError) as exc:
            ap.error(f"--merge: {exc}")
        print(f"merged results: {out}/results.json")
        return 0
    every = 1.0 / CONTROL_DT / o.camera_rate if o.camera_rate > 0 else 0.0
    if o.camera_rate <= 0 or abs(every - round(every)) > 1e-6:
        ap.error(f"--camera-rate must divide the control rate {1 / CONTROL_DT:g} Hz")
    if o.workers < 1 or o.camera_size < 8 or any(d < 0 for d in o.delay_ms):
        ap.error("--workers >= 1, --camera-size >= 8, delays >= 0")
    if o.clock == "realtime" and (o.policy == "expert" or o.workers > 1 or not 0 < o.real_time_factor <= 1):
        ap.error("--clock realtime: a model policy (not expert), --workers 1, 0 < --real-time-factor <= 1")
    if o.locate_prompt and (o.clock == "realtime" or o.policy == "expert"):
        ap.error("--locate-prompt: lockstep and a model policy only")
    from oxygen_ros.ros.engine_factory import SHIPPED, resolve_checkpoint  # noqa: PLC0415
    if o.policy in SHIPPED:
        o.policy = resolve_checkpoint(o.policy)
    if o.policy not in ("expert", "random") and not Path(o.policy).is_dir():
        ap.error(f"--policy must be expert, random, demo (the shipped policy) or a checkpoint directory; "
                 f"{o.policy!r} is none of them")
    try:
        overrides = parse_overrides(o.overrides)
        from oxygen_ros.ros.lockstep import sim_settings  # noqa: PLC0415
        sim_settings(o.params, overrides)                      # bad parameters fail here, before any episode
    except (ConfigureError, OSError) as exc:
        ap.error(str(exc))
    cells = _cells(o.engine_mode, o.chunking, o.delay_ms, o.language)
    common = {"policy": o.policy, "params": o.params, "overrides": overrides, "camera_size": o.camera_size,
              "camera_every": int(round(every)), "horizon": o.horizon, "out": str(out), "trace": o.trace,
              "locate_prompt": o.locate_prompt}
    config = {k: v for k, v in common.items() if k != "out"}
    config.update(tasks=o.task, seeds=f"{o.seeds.start}:{o.seeds.stop}", workers=o.workers,
                  camera_rate=o.camera_rate, clock=o.clock,
                  real_time_factor=o.real_time_factor if o.clock == "realtime" else None,
                  grid={"engine_mode": o.engine_mode, "chunking": o.chunking, "delay_ms": o.delay_ms,
                        "language": o.language})
    t0 = time.perf_counter()
    if o.clock == "realtime":
        episodes = run_realtime(common, cells, o.task, o.seeds, o.real_time_factor, o.quiet)
    else:
        episodes = run_grid(common, cells, o.task, o.seeds, o.workers, not o.no_video, o.quiet)
    table = _write_outputs(out, config, _summarise(cells, episodes), episodes, time.perf_counter() - t0)
    print(table)
    bad = [e for e in episodes if e.get("error")]
    for e in bad[:10]:
        print(f"INCOMPLETE {e['cell']} {e['task']} seed {e['seed']}: {e['error']}", file=sys.stderr)
    print(f"results: {out}/results.json ({len(episodes)} episodes, {len(bad)} incomplete, "
          f"{time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
