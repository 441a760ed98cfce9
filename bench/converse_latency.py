"""Time to first feedback and cancel latency of the `converse` action, measured over DDS against oxygen_node as its own
process (config/oxygen.yaml + overrides, tiny random-weight model unless --preset/--checkpoint), fed by a replayed
synthetic bag.  Not a test: prints a table and writes JSON.

    .venv/bin/python bench/converse_latency.py --goals 20 --out bench/results/converse-<host>.json

Per goal (client steady clock): *first feedback* = goal sent -> first feedback received; *result* = goal sent ->
SUCCEEDED result.  Per cancelled goal (cancel sent once 2 feedback messages arrived): *cancel ack* = cancel sent ->
cancel response; *canceled result* = cancel sent -> CANCELED result; *last token* = cancel sent -> the request's
final LanguageToken; plus the tokens that arrived after the cancel was acknowledged (at most decode_k expected).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--goals", type=int, default=20)
    ap.add_argument("--cancels", type=int, default=10)
    ap.add_argument("--decode-k", type=int, default=5)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()

    from oxygen_ros.tools import harness
    harness.isolate_dds()
    os.environ.setdefault("ROS_DOMAIN_ID", str(150 + os.getpid() % 80))
    import rclpy
    from action_msgs.msg import GoalStatus
    from rclpy.action import ActionClient
    from rclpy.qos import QoSProfile

    from oxygen_ros.action import Converse
    from oxygen_ros.msg import LanguageToken
    from oxygen_ros.tools.bags.replay import make_bag

    tmp = Path(tempfile.mkdtemp(prefix="converse-bench-"))
    bag = make_bag(tmp / "bag", duration=6.0, fps=15.0, width=224, height=224)
    params = {"preset": a.preset, "horizon": 50, "memory_interval_s": 0.0, "subtask_enabled": False,
              "max_new_tokens": 90, "decode_k": a.decode_k, "memory_db": ""}
    node = harness.NodeProcess(tmp / "node.log", params)
    import subprocess
    replay = subprocess.Popen([sys.executable, "-m", "oxygen_ros.tools.bags.replay", "replay", str(bag), "--loop", "--quiet"],
                              cwd=str(ROOT), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    rclpy.init()
    n = rclpy.create_node("converse_bench")
    tokens: dict = {}
    n.create_subscription(LanguageToken, "language/tokens",
                          lambda m: tokens.setdefault(m.request_id, []).append((time.monotonic(), m)), 1000)
    client = ActionClient(n, Converse, "converse", feedback_sub_qos_profile=QoSProfile(depth=100))

    def spin_until(pred, timeout):
        end = time.monotonic() + timeout
        while not pred() and time.monotonic() < end:
            rclpy.spin_once(n, timeout_sec=0.01)
        return pred()

    try:
        assert client.wait_for_server(timeout_sec=120), "no converse server:\n" + node.tail()
        time.sleep(3.0)                        # let the node warm up on the replayed frames
        first, total, cancel_ack, cancel_res, last_tok, late = [], [], [], [], [], []
        for i in range(a.goals + a.cancels):
            cancel = i >= a.goals
            fb = []
            t0 = time.monotonic()
            gf = client.send_goal_async(Converse.Goal(prompt=f"What do you see? ({i})",
                                                      max_new_tokens=90 if cancel else 12),
                                        feedback_callback=lambda m: fb.append(time.monotonic()))
            assert spin_until(gf.done, 30) and gf.result().accepted
            h = gf.result()
            rf = h.get_result_async()
            if cancel:
                spin_until(lambda: len(fb) >= 2, 30)
                tc = time.monotonic()
                cf = h.cancel_goal_async()
                spin_until(cf.done, 10)
                t_ack = time.monotonic()
                cancel_ack.append(t_ack - tc)
            assert spin_until(rf.done, 60)
            t_res = time.monotonic()
            res = rf.result()
            spin_until(lambda: any(m.is_final for _, m in tokens.get(res.result.request_id, [])), 5)
            if cancel:
                assert res.status == GoalStatus.STATUS_CANCELED, res.status
                cancel_res.append(t_res - tc)
                toks = tokens.get(res.result.request_id, [])
                last_tok.append(max(t for t, _ in toks) - tc)
                late.append(sum(1 for t, m in toks if t > t_ack and not m.is_final))
            else:
                first.append(fb[0] - t0)
                total.append(t_res - t0)
    finally:
        client.destroy()
        n.destroy_node()
        rclpy.try_shutdown()
        replay.terminate()
        replay.wait(10)
        node.stop()

    import numpy as np

    def row(name, xs):
        x = np.asarray(xs) * 1e3
        return {"name": name, "n": len(xs), "p50_ms": float(np.percentile(x, 50)), "p90_ms": float(np.percentile(x, 90)),
                "max_ms": float(x.max())}
    rows = [row("first feedback", first), row("result (12 tokens)", total), row("cancel ack", cancel_ack),
            row("canceled result", cancel_res), row("last token after cancel", last_tok)]
    print(f"{'measure':28s} {'n':>3s} {'p50 ms':>8s} {'p90 ms':>8s} {'max ms':>8s}")
    for r in rows:
        print(f"{r['name']:28s} {r['n']:3d} {r['p50_ms']:8.1f} {r['p90_ms']:8.1f} {r['max_ms']:8.1f}")
    print(f"tokens received after the cancel was acknowledged: {late} (decode_k {a.decode_k})")
    out = {"host": platform.node(), "cpus": os.cpu_count(), "preset": a.preset, "decode_k": a.decode_k,
           "rows": rows, "tokens_after_cancel_ack": late, "stamp": time.strftime("%Y-%m-%d %H:%M:%S")}
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(out, indent=1))
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
