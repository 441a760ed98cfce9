"""``oxygen soak``: a long run of the node on a looping replayed bag with a question every few seconds, sampling the
node process's resident memory (RSS), to show that memory stays flat after warm-up.

This file owns the soak benchmark (not a test: it runs for minutes).  It starts ``oxygen_node`` as a child process
(``config/oxygen.yaml`` + ``--preset``), replays a synthetic bag in a loop through rclpy in this process, asks a
conversation question every ``--prompt-period`` seconds, and every ``--sample-period`` seconds records the RSS of the
node's Python process (the deepest process of its tree: the PyPI ROS wheels' bootstrapper runs the interpreter as a
child), the action_chunk rate and the counts of answers and memory entries.  Prints the series and a summary (growth
over the whole run and over the last ``--window`` seconds) and writes JSON (``--out``); exits 1 when the node died
during the run (the summary says when).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path


def _children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if ppid == pid:
                out.append(int(d))
    return out


def deepest_process(pid: int) -> int:
    """The last process of a single-child chain starting at ``pid`` (the real interpreter under the bootstrapper)."""
    while True:
        kids = _children(pid)
        if len(kids) != 1:
            return pid
        pid = kids[0]


def rss_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="oxygen soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=660.0, help="measured seconds (default: %(default)s)")
    p.add_argument("--prompt-period", type=float, default=2.0, help="seconds between questions")
    p.add_argument("--sample-period", type=float, default=10.0, help="seconds between RSS samples")
    p.add_argument("--window", type=float, default=300.0, help="report the growth over the last N s")
    p.add_argument("--warmup", type=float, default=60.0, help="seconds excluded from the whole-run growth")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--horizon", type=int, default=50)
    p.add_argument("--out", default="out/soak.json")
    a = p.parse_args(argv)

    from oxygen_ros.tools.harness import Monitor, NodeProcess, isolate_dds  # noqa: PLC0415
    from oxygen_ros.tools.bags.replay import BagReplayer, make_bag  # noqa: PLC0415

    isolate_dds()
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    import shutil  # noqa: PLC0415
    import tempfile  # noqa: PLC0415
    work = Path(tempfile.mkdtemp(prefix="oxygen_soak_"))      # the bag (~100 MB) and the memory DB: not results
    bag = make_bag(work / "bag", duration=10.0, fps=15.0, width=320, height=240)
    params = {"preset": a.preset, "horizon": a.horizon, "memory_db": str(work / "memory.db"),
              "memory_interval_s": 5.0, "max_new_tokens": 24}
    node = NodeProcess(out.parent / "soak_node.log", params)
    mon = Monitor("oxygen_soak")
    rep = BagReplayer(mon.node, bag, loop=True, exclude=("/conversation/prompt",))
    rep.start()
    series = []
    try:
        t_wait = time.monotonic()
        while not mon.chunks:
            if not node.alive() or time.monotonic() - t_wait > 180:
                print("node did not start:\n" + node.tail(30))
                return 1
            time.sleep(0.2)
        pid = deepest_process(node.proc.pid)
        t0 = time.monotonic()
        next_prompt, next_sample, i = t0, t0, 0
        print(f"soak: node pid {pid}, {a.duration:.0f} s, a question every {a.prompt_period:g} s", flush=True)
        print(f"{'t_s':>6} {'rss_mib':>8} {'chunk_hz':>8} {'answers':>7} {'memory':>6}", flush=True)
        while time.monotonic() - t0 < a.duration and node.alive():
            now = time.monotonic()
            if now >= next_prompt:
                mon.ask(f"What do you see now? (question {i})")
                i += 1
                next_prompt += a.prompt_period
            if now >= next_sample:
                rss = rss_kib(pid)
                row = {"t_s": round(now - t0, 1), "rss_mib": None if rss is None else rss / 1024,
                       "chunk_hz": mon.chunk_rate(2.0), "answers": len(mon.responses), "memory": len(mon.memory)}
                series.append(row)
                rss_txt = "-" if row["rss_mib"] is None else f"{row['rss_mib']:.1f}"     # None: the node is gone
                print(f"{row['t_s']:6.0f} {rss_txt:>8} {row['chunk_hz']:8.1f} {row['answers']:7d} "
                      f"{row['memory']:6d}", flush=True)
                next_sample += a.sample_period
            time.sleep(0.05)
        died_at = None if node.alive() else round(time.monotonic() - t0, 1)
    finally:
        rep.stop()
        rc, dt = node.stop()
        mon.close()
        import rclpy  # noqa: PLC0415
        rclpy.try_shutdown()
        shutil.rmtree(work, ignore_errors=True)

    def growth(rows):
        rows = [r for r in rows if r["rss_mib"] is not None]
        return (rows[-1]["rss_mib"] - rows[0]["rss_mib"]) if len(rows) >= 2 else None

    t_end = series[-1]["t_s"] if series else 0.0
    summary = {
        "duration_s": t_end, "questions": i, "answers": series[-1]["answers"] if series else 0,
        "memory_entries": series[-1]["memory"] if series else 0,
        "rss_first_mib": series[0]["rss_mib"] if series else None,
        "rss_last_mib": series[-1]["rss_mib"] if series else None,
        "rss_max_mib": max((r["rss_mib"] or 0) for r in series) if series else None,
        "growth_after_warmup_mib": growth([r for r in series if r["t_s"] >= a.warmup]),
        f"growth_last_{a.window:.0f}s_mib": growth([r for r in series if r["t_s"] >= t_end - a.window]),
        "chunk_hz_min": min((r["chunk_hz"] for r in series[1:]), default=None),
        "node_exit": rc, "node_exit_s": dt, "node_died_at_s": died_at,
        "host": platform.node(), "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
    }
    print(json.dumps(summary, indent=2))
    out.write_text(json.dumps({"args": vars(a), "summary": summary, "series": series}, indent=2))
    print(f"wrote {out}")
    if died_at is not None:                            # a soak whose node died is a failed soak, whatever it measured
        print(f"soak FAILED: the node exited {died_at:.0f} s into the run (code {rc}); its log: "
              f"{node.log_path}")
        return 1
    return 0
