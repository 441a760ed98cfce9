"""Lifecycle and capacity tests of ``oxygen_node`` as a separate process: a missing or corrupt checkpoint makes
``configure`` fail with a clear message (autostart: exit status 2); with ``autostart: false`` the node waits
unconfigured (diagnostics ERROR) until a lifecycle manager configures and activates it through the standard
``~/change_state`` service, deactivation stops ``action_chunk``, and cleanup + a parameter change + configure
switches to ``stale_behavior: hold`` (cameras stop -> the last action is repeated, diagnostics ERROR); with a deliberately tiny KV pool a burst of
conversation prompts is rejected for capacity (counted) while actions keep their rate.  Same ``config/oxygen.yaml``
as everything else, plus overrides.
"""
from __future__ import annotations

import signal
import time

import pytest

from conftest import TIMING_GROUP, NodeProcess, require_ros, start_replay, stop_proc

require_ros()

from diagnostic_msgs.msg import DiagnosticArray  # noqa: E402
from lifecycle_msgs.msg import Transition  # noqa: E402
from lifecycle_msgs.srv import ChangeState, GetState  # noqa: E402
from rcl_interfaces.msg import Parameter, ParameterType, ParameterValue  # noqa: E402
from rcl_interfaces.srv import SetParameters  # noqa: E402
from std_msgs.msg import String  # noqa: E402

from oxygen_ros.msg import ActionChunk  # noqa: E402

from test_node import BASE_PARAMS, STARTUP_S, assert_control_rate, diag_values, stamp_ns  # noqa: E402

pytestmark = pytest.mark.xdist_group(TIMING_GROUP)     # node / player / launch processes: one worker

SIM_BAG_START_NS = 1_000_000_000 * 1_000_000_000     # 2001-09-09: bag time far from wall time


def test_missing_corrupt_and_nan_checkpoint_fail_configure(tmp_path):
    bad = tmp_path / "corrupt_ckpt"
    bad.mkdir()
    (bad / "config.json").write_text("{ this is not json")
    (bad / "model.safetensors").write_bytes(b"\x00garbage" * 100)
    # a checkpoint that loads structurally but holds a NaN weight (it would run and drop every chunk)
    import torch
    from safetensors.torch import load_file, save_file
    from oxygen_ros.model import build_model, get_config, save_checkpoint
    nan = tmp_path / "nan_ckpt"
    save_checkpoint(build_model(get_config("tiny")), nan)
    sd = load_file(nan / "model.safetensors")
    sd["action_out_proj.weight"] = torch.full_like(sd["action_out_proj.weight"], float("nan"))
    save_file(sd, nan / "model.safetensors")
    procs = {
        "missing": NodeProcess(tmp_path / "missing.log", {"checkpoint": str(tmp_path / "no_such_dir"),
                                                          "memory_db": ""}),
        "corrupt": NodeProcess(tmp_path / "corrupt.log", {"checkpoint": str(bad), "memory_db": ""}),
        "nan": NodeProcess(tmp_path / "nan.log", {"checkpoint": str(nan), "memory_db": "",
                                                  "action_joint_names": [""], "state_joint_names": [""]}),
    }
    for name, p in procs.items():
        try:
            rc = p.proc.wait(STARTUP_S)
        except Exception:  # noqa: BLE001
            p.stop(signal.SIGKILL)
            raise AssertionError(f"{name}: node did not exit after a failed configure\n{p.log()[-2000:]}")
        log = p.log()
        assert rc == 2, f"{name}: exit status {rc}\n{log[-2000:]}"
        assert "configure failed" in log and "checkpoint" in log, log[-2000:]
    assert "not found" in procs["missing"].log()
    assert str(bad) in procs["corrupt"].log()
    assert "action_out_proj.weight" in procs["nan"].log() and "non-finite" in procs["nan"].log()


def _call(ros, client, req, timeout=30.0):
    assert client.wait_for_service(timeout_sec=timeout), f"service {client.srv_name} not available"
    fut = client.call_async(req)
    assert ros.wait_for(fut.done, timeout), f"{client.srv_name} did not answer"
    return fut.result()


def _transition(ros, client, tid, timeout=STARTUP_S):
    req = ChangeState.Request()
    req.transition = Transition(id=tid)
    return _call(ros, client, req, timeout).success


def test_managed_lifecycle_and_kv_capacity(ros, tmp_path, synthetic_bag):
    params = {**BASE_PARAMS, "autostart": False, "memory_db": "", "memory_interval_s": 0.0,
              "kv_budget_mb": 0.12, "max_wait_cycles": 3, "max_new_tokens": 12, "prompt_queue_size": 64}
    chunks = ros.collect(ActionChunk, "action_chunk", qos=200, keep=3000)
    diags = ros.collect(DiagnosticArray, "/diagnostics", qos=50, keep=20)
    change = ros.node.create_client(ChangeState, "oxygen_node/change_state")
    get = ros.node.create_client(GetState, "oxygen_node/get_state")
    setp = ros.node.create_client(SetParameters, "oxygen_node/set_parameters")
    node = NodeProcess(tmp_path / "node.log", params)
    replay = start_replay(synthetic_bag, tmp_path / "replay.log", "--loop", "--exclude", "/conversation/prompt")
    try:
        assert ros.wait_for(lambda: len(diags) > 0, STARTUP_S), node.log()[-2000:]
        d = diag_values(diags[-1][1])
        assert d["oxygen_node: control"][0] == 2 and "unconfigured" in d["oxygen_node: control"][1]
        time.sleep(1.0)
        assert not chunks, "an unconfigured node publishes nothing"
        assert _call(ros, get, GetState.Request()).current_state.label == "unconfigured"

        assert _transition(ros, change, Transition.TRANSITION_CONFIGURE), node.log()[-2000:]
        assert _call(ros, get, GetState.Request()).current_state.label == "inactive"
        time.sleep(0.5)
        assert not chunks, "an inactive node publishes nothing"
        assert _transition(ros, change, Transition.TRANSITION_ACTIVATE)
        assert ros.wait_for(lambda: len(chunks) > 20, 60), node.log()[-2000:]

        # KV capacity: a burst of questions against a tiny pool -> rejected (counted), actions unaffected
        pub = ros.publisher(String, "conversation/prompt", qos=100)
        ros.wait_matched(pub, "oxygen_node")
        for i in range(16):
            pub.publish(String(data=f"Please describe everything you can see in great detail, item {i}."))

        def counter(key):
            for _, m in list(diags)[-1:]:
                for st in diag_values(m).values():
                    if key in st[2]:
                        return float(st[2][key])
            return 0.0
        assert ros.wait_for(lambda: counter("request_rejected") > 0 and counter("kv_full") > 0, 60), \
            node.log()[-3000:]
        t0 = time.monotonic()
        assert ros.wait_for(lambda: len([1 for t, _ in list(chunks) if t >= t0]) >= 280, 60), node.log()[-2000:]
        assert_control_rate([(t, m) for t, m in list(chunks) if t >= t0][:280])   # node-side ticks, any load
        assert "rejected" in node.log()

        assert _transition(ros, change, Transition.TRANSITION_DEACTIVATE)
        t1_ns = ros.now().nanoseconds          # the node's clock too (one machine): no tick after this is published
        time.sleep(1.5)
        late = [stamp_ns(m.start_time) - t1_ns for _, m in list(chunks) if stamp_ns(m.start_time) > t1_ns]
        assert not late, f"a deactivated node stops publishing action_chunk: ticks {late[:5]} ns after"
        assert node.alive()

        # cleanup -> stale_behavior:=hold -> configure -> activate; cameras stop -> the last action is held
        assert _transition(ros, change, Transition.TRANSITION_CLEANUP)
        assert _call(ros, get, GetState.Request()).current_state.label == "unconfigured"
        req = SetParameters.Request()
        req.parameters = [Parameter(name="stale_behavior", value=ParameterValue(
            type=ParameterType.PARAMETER_STRING, string_value="hold"))]
        assert _call(ros, setp, req).results[0].successful
        assert _transition(ros, change, Transition.TRANSITION_CONFIGURE)
        assert _transition(ros, change, Transition.TRANSITION_ACTIVATE)
        n = len(chunks)
        assert ros.wait_for(lambda: len(chunks) > n + 50, 60)
        stop_proc(replay)
        t2 = time.monotonic()

        def held():
            """The one-row messages after the last longer one since the cameras stopped (the last chunk used up)."""
            after = [(t, m) for t, m in list(chunks) if t >= t2]
            last = max((i for i, (_, m) in enumerate(after) if m.horizon > 1), default=None)
            return [] if last is None else after[last + 1:]
        # the last chunk runs out, then every tick repeats its last action: wait for 140 such messages (counted)
        assert ros.wait_for(lambda: len(held()) >= 140, 60), f"hold: {len(held())} one-row messages\n" + \
            node.log()[-2000:]
        h = held()[:140]
        assert len({tuple(m.actions) for _, m in h}) == 1, "hold repeats one action"
        assert len({m.chunk_id for _, m in h}) == 1 and h[-1][1].observation_age_s > 1.5
        assert_control_rate(h)
        assert ros.wait_for(lambda: diags and diag_values(diags[-1][1])["oxygen_node: control"][0] == 2, 5)
        rc, dt = node.stop(signal.SIGINT)
        assert rc == 0 and dt < 5.0, f"rc {rc}, {dt:.1f} s"
    finally:
        stop_proc(replay)
        if node.alive():
            node.stop(signal.SIGKILL)
        ros.node.destroy_client(change)
        ros.node.destroy_client(get)
        ros.node.destroy_client(setp)
        ros.uncollect(chunks)
        ros.uncollect(diags)


def _recorded_stamps(bag, topic="/camera/base/image_raw") -> set[int]:
    """header.stamp of every message on ``topic`` in the bag, read back from the file."""
    from rosbags.rosbag2 import Reader
    from oxygen_ros.bags.types import typestore
    ts = typestore()
    with Reader(bag) as r:
        conns = [c for c in r.connections if c.topic == topic]
        return {stamp_ns(ts.deserialize_cdr(raw, c.msgtype).header.stamp) for c, _, raw in r.messages(conns)}


def test_sim_time_with_replayed_clock(ros, tmp_path):
    """use_sim_time: the node follows /clock from `oxygen replay --clock` (bag time, stamps not rewritten): the
    control output runs on a ROS timer of the simulated clock and chunks carry the recorded capture stamps.
    Deterministic under any load: the bag is played once from a time 25 years before the wall clock, and every
    chunk is judged on its own stamps (no rate: on sim time the timer's ticks follow /clock's granularity)."""
    from oxygen_ros.tools.bags.replay import make_bag
    bag = make_bag(tmp_path / "bag", duration=6.0, fps=15.0, width=64, height=48, start_ns=SIM_BAG_START_NS)
    recorded = _recorded_stamps(bag)
    chunks = ros.collect(ActionChunk, "action_chunk", qos=200, keep=3000)
    node = NodeProcess(tmp_path / "node.log", {**BASE_PARAMS, "use_sim_time": True, "memory_db": "",
                                               "memory_interval_s": 0.0, "subtask_enabled": False})
    replay = None
    try:
        # the bag plays once: start it when the node is up (a slow start on a loaded machine must not miss it)
        assert ros.wait_for(lambda: "active:" in node.log() or not node.alive(), STARTUP_S), node.log()[-2000:]
        replay = start_replay(bag, tmp_path / "replay.log", "--clock", "100", "--exclude", "/conversation/prompt")
        assert ros.wait_for(lambda: len(chunks) >= 20 or not node.alive(), STARTUP_S), node.log()[-2000:]
        got = [m for _, m in list(chunks)]
        stamps = [stamp_ns(m.header.stamp) for m in got]
        starts = [stamp_ns(m.start_time) for m in got]
        # every chunk comes from a recorded frame and carries its recorded capture stamp
        assert set(stamps) <= recorded, (sorted(set(stamps) - recorded)[:5], min(recorded), len(recorded))
        # the control ticks are on the bag's clock (wall time is 25 years later), in order, after the capture
        lo, hi = min(recorded), max(recorded) + 1_000_000_000
        assert all(lo <= t <= hi for t in starts), ([t for t in starts if not lo <= t <= hi][:5], (lo, hi))
        assert all(b >= a for a, b in zip(starts, starts[1:])), "simulated ticks went back"
        assert all(t >= c for t, c in zip(starts, stamps))
        rc, dt = node.stop(signal.SIGINT)
        assert rc == 0 and dt < 5.0
    finally:
        if replay is not None:
            stop_proc(replay)
        if node.alive():
            node.stop(signal.SIGKILL)
        ros.uncollect(chunks)
