"""End-to-end tests of ``oxygen_node`` as a separate process over real DDS, fed by ``oxygen replay`` of a synthetic
bag, with ``config/oxygen.yaml`` plus a few overrides (tiny random-weight model; ``horizon: 50`` so one chunk covers
0.7 s like the real pi0.5 and CPU contention on a shared 2-core CI box does not starve the 70 Hz output).
This file owns the running-node scenarios: action rate/shape/stamps, the conversation token stream, memory entries
persisting across a restart, every bad input (node keeps publishing, the right counter rises), cameras stopping and
returning, injected cycle exceptions, and SIGINT/SIGTERM shutdown time.  Speed belongs in ``oxygen ros-bench``:
the control rate is judged on the node's own tick stamps (``start_time``) of a counted number of messages
(``control_messages`` / ``assert_control_rate``), never on this process's receive clock or a count per wall-clock
window, so a loaded machine cannot fail it (it failed twice on 2 shared cores that way).
"""
from __future__ import annotations

import signal
import sqlite3
import time

import numpy as np
import pytest

from conftest import TIMING_GROUP, NodeProcess, require_ros, start_replay, stop_proc

require_ros()

from diagnostic_msgs.msg import DiagnosticArray  # noqa: E402
from sensor_msgs.msg import Image, JointState  # noqa: E402
from std_msgs.msg import String  # noqa: E402

from oxygen_ros.msg import ActionChunk, LanguageToken, MemoryEntry  # noqa: E402
from oxygen_ros.ros.images import rgb_to_image  # noqa: E402
from oxygen_ros.tools.bags.replay import JOINT_NAMES  # noqa: E402

pytestmark = pytest.mark.xdist_group(TIMING_GROUP)     # node / player / launch processes: one worker

RATE = 70.0
STARTUP_S = 90.0        # torch import + model build on a loaded 2-core machine

BASE_PARAMS = {"horizon": 50, "memory_interval_s": 1.5, "max_new_tokens": 12, "prompt_queue_size": 8,
               "max_prompt_chars": 200, "debug_fault_injection": True, "max_observation_age_s": 0.5,
               "stale_behavior": "stop", "frame_rate_hz": 15.0, "subtask_enabled": True, "subtask_interval_s": 2.0}


def stamp_ns(st) -> int:
    return st.sec * 1_000_000_000 + st.nanosec


def diag_values(arr: DiagnosticArray) -> dict:
    out = {}
    for st in arr.status:
        out[st.name] = (st.level[0] if isinstance(st.level, (bytes, bytearray)) else int(st.level), st.message,
                        {kv.key: kv.value for kv in st.values})
    return out


class Env:
    """One node + one looping replay, with collectors on every output (``frames``: also on the base camera, 150 KB
    a frame to deserialize in this process; only where a test needs them).  ``close`` removes every collector, so
    that later tests of the session's worker do not keep receiving for this one."""

    def __init__(self, ros, tmp_path, bag, params=None, frames=False):
        self.ros, self.tmp, self.bag = ros, tmp_path, bag
        self.db = tmp_path / "memory.db"
        self.params = {**BASE_PARAMS, "memory_db": str(self.db), **(params or {})}
        self._lists: list = []
        self.chunks = self.collect(ActionChunk, "action_chunk", qos=200, keep=5000)
        self.tokens = self.collect(LanguageToken, "language/tokens", qos=1000)
        self.responses = self.collect(String, "conversation/response", qos=100)
        self.memory = self.collect(MemoryEntry, "memory/entries", qos=100)
        self.diags = self.collect(DiagnosticArray, "/diagnostics", qos=50, keep=50)
        self.frames = self.collect(Image, "camera/base/image_raw", qos=100, keep=2000) if frames else []
        self.node = None
        self.replay = None

    def collect(self, *args, **kw) -> list:
        """``ros.collect`` for as long as this environment lives."""
        out = self.ros.collect(*args, **kw)
        self._lists.append(out)
        return out

    def start_node(self, name="node"):
        self.node = NodeProcess(self.tmp / f"{name}.log", self.params)
        return self.node

    def start_replay(self):
        self.replay = start_replay(self.bag, self.tmp / "replay.log", "--loop", "--exclude", "/conversation/prompt")
        return self.replay

    def stop_replay(self):
        if self.replay is not None:
            stop_proc(self.replay)
            self.replay = None

    def wait_chunks(self, timeout=STARTUP_S):
        ok = self.ros.wait_for(lambda: len(self.chunks) > 20 or not self.node.alive(), timeout)
        assert self.node.alive(), "node died:\n" + self.node.log()[-3000:]
        assert ok, "no action chunks:\n" + self.node.log()[-3000:]

    def chunks_since(self, t0):
        return [(t, m) for t, m in list(self.chunks) if t >= t0]

    def last_diag(self, after=None):
        d = [(t, m) for t, m in list(self.diags) if after is None or t >= after]
        return diag_values(d[-1][1]) if d else None

    def counter(self, key, after=None):
        d = self.last_diag(after)
        if d is None:
            return None
        for name in d:
            v = d[name][2].get(key)
            if v is not None:
                return float(v)
        return 0.0

    def close(self):
        self.stop_replay()
        if self.node is not None and self.node.alive():
            self.node.stop()
        for out in self._lists:
            self.ros.uncollect(out)
        self._lists.clear()


@pytest.fixture(scope="module")
def env(ros, tmp_path_factory, synthetic_bag):
    e = Env(ros, tmp_path_factory.mktemp("node"), synthetic_bag, frames=True)
    e.start_node()
    e.start_replay()
    e.wait_chunks()
    yield e
    e.close()


CONTROL_N = 140         # action_chunk messages to judge the control rate on (2 s of ticks at 70 Hz)


def control_messages(env, n=CONTROL_N, timeout=60.0, since=None):
    """The first ``n`` action_chunk messages received from now (or from monotonic time ``since``) on: waits for them
    (a counted event with a generous timeout, not a window of wall-clock time)."""
    t0 = time.monotonic() if since is None else since
    ok = env.ros.wait_for(lambda: len(env.chunks_since(t0)) >= n or not env.node.alive(), timeout)
    got = env.chunks_since(t0)
    assert ok and env.node.alive(), f"{len(got)} of {n} action_chunk messages in {timeout:.0f} s\n" + \
        env.node.log()[-2000:]
    return got[:n]


def assert_control_rate(got, rate=RATE, slack=2.0):
    """The control timer runs at ``rate`` by the node's own clock: the ticks' ``start_time`` stamps strictly increase
    (no tick published twice or out of order) and the median interval between consecutive ticks is within
    [1 / slack, slack] x 1 / rate.  A tick late by the scheduler is followed by a short one (the loop keeps its
    schedule), a tick with no valid chunk publishes nothing: neither moves the median, so a loaded machine passes
    (14.3 ms medians measured beside a CPU hog at load 6 on 2 cores) while a timer at half or twice the rate fails."""
    t = np.array([stamp_ns(m.start_time) for _, m in got], dtype=np.int64)
    assert t.size >= 20, f"only {t.size} messages"
    d = np.diff(t) / 1e9
    assert (d > 0).all(), f"tick stamps not strictly increasing: {np.flatnonzero(d <= 0)[:5]} of {t.size}"
    med = float(np.median(d))
    assert 1.0 / slack / rate <= med <= slack / rate, \
        f"median interval between control ticks {med * 1e3:.1f} ms (1 / {rate:g} Hz = {1e3 / rate:.1f} ms)"


# ---------------------------------------------------------------------------------------------------------------------
def test_actions_rate_shape_and_stamps(env):
    got = control_messages(env, 2 * CONTROL_N)
    assert_control_rate(got)
    frame_stamps = {stamp_ns(m.header.stamp) for _, m in list(env.frames)}
    ids = set()
    for _, m in got:
        assert m.action_dim == len(JOINT_NAMES) and list(m.joint_names) == list(JOINT_NAMES)
        assert 1 <= m.horizon <= 50 and len(m.actions) == m.horizon * m.action_dim
        assert np.isfinite(np.asarray(m.actions)).all()
        assert m.step_dt == pytest.approx(1.0 / RATE)
        assert stamp_ns(m.start_time) >= stamp_ns(m.header.stamp)
        assert 0.0 <= m.observation_age_s < 5.0
        assert m.inference_latency_ms > 0
        assert m.header.frame_id == "camera_base"
        ids.add(m.chunk_id)
    assert len(ids) >= 4, "several inference cycles produced chunks"       # >= 280 / horizon 50 whatever the load
    # header.stamp is the capture time of a replayed (restamped) base-camera frame
    stamped = [stamp_ns(m.header.stamp) in frame_stamps for _, m in got]
    assert sum(stamped) >= 0.95 * len(stamped), "chunks must carry the replayed frames' capture times"
    # remainder semantics, for every chunk: each message is a suffix of the chunk's first message, shorter by the
    # ticks elapsed between their start_times (+-2 rows for scheduling jitter), never longer
    by_chunk = {}
    for _, m in got:
        by_chunk.setdefault(m.chunk_id, []).append(m)
    assert sum(len(ms) > 2 for ms in by_chunk.values()) >= 3, "chunks republished over several ticks"
    for cid, ms in by_chunk.items():
        first = np.asarray(ms[0].actions).reshape(ms[0].horizon, -1)
        for prev, m in zip(ms, ms[1:]):
            assert m.horizon <= prev.horizon, (cid, [x.horizon for x in ms])
        for m in ms[1:]:
            np.testing.assert_array_equal(np.asarray(m.actions).reshape(m.horizon, -1),
                                          first[ms[0].horizon - m.horizon:], err_msg=f"chunk {cid}")
            ticks = (stamp_ns(m.start_time) - stamp_ns(ms[0].start_time)) * 1e-9 / m.step_dt
            assert abs((ms[0].horizon - m.horizon) - ticks) <= 2.0, (cid, ms[0].horizon, m.horizon, ticks)


def test_conversation_token_stream(env):
    pub = env.ros.publisher(String, "conversation/prompt")
    env.ros.wait_matched(pub, "oxygen_node")
    n_resp = len(env.responses)
    pub.publish(String(data="What do you see on the table?"))
    assert env.ros.wait_for(lambda: len(env.responses) > n_resp, 60), "no conversation/response"

    def finished():
        conv = {}
        for _, m in list(env.tokens):
            if m.task == "conversation":
                conv.setdefault(m.request_id, []).append(m)
        return {rid: toks for rid, toks in conv.items() if any(t.is_final for t in toks)}
    # the final token and the response travel on different topics: wait for it (no order between topics)
    assert env.ros.wait_for(lambda: finished(), 10), "a conversation request finished"
    finished = finished()
    texts = [r.data for _, r in list(env.responses)]
    for rid, toks in finished.items():
        idx = [t.index for t in toks]
        assert idx == list(range(len(toks))), f"indices must be consecutive from 0, got {idx}"
        assert [t.is_final for t in toks].count(True) == 1 and toks[-1].is_final
        assert toks[-1].finish_reason in ("eos", "length")
        assert all(t.finish_reason == "" for t in toks[:-1])
        assert len({t.frame_index for t in toks}) == 1
        assert "".join(t.text for t in toks) in texts
    tasks = {m.task for _, m in list(env.tokens)}
    assert {"conversation", "memory", "subtask"} <= tasks, tasks


def test_memory_entries_published_and_stored(env):
    assert env.ros.wait_for(lambda: len(env.memory) >= 2, 60), "no memory entries"
    entries = [m for _, m in list(env.memory)]
    ids = [m.entry_id for m in entries]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    with sqlite3.connect(str(env.db)) as db:
        rows = dict(db.execute("SELECT entry_id, text FROM memory_entries").fetchall())
    for m in entries:
        assert rows.get(m.entry_id) == m.text
        assert m.num_tokens >= 1 and m.source_prompt and stamp_ns(m.header.stamp) > 0


def _bad_image(kind):
    rgb = np.zeros((8, 8, 3), np.uint8)
    m = rgb_to_image(rgb, "rgb8")
    if kind == "encoding":
        m.encoding = "yuv422"
    elif kind == "size":
        m.height, m.width, m.step, m.data = 0, 0, 0, b""
    elif kind == "step":
        m.step = 5
    elif kind == "truncated":
        m.data = bytes(m.data)[:-10]
    return m


def test_bad_inputs_are_counted_and_actions_continue(env):
    ros = env.ros
    cam = ros.publisher(Image, "camera/left_wrist/image_raw")
    js = ros.publisher(JointState, "joint_states")
    prompt = ros.publisher(String, "conversation/prompt", qos=1000)
    fault = ros.publisher(String, "oxygen_node/inject_fault")
    for pub in (cam, js, prompt, fault):
        ros.wait_matched(pub, "oxygen_node")
    for kind in ("encoding", "size", "step", "truncated"):
        for _ in range(3):       # paced: the camera subscription is best effort with a shallow queue
            cam.publish(_bad_image(kind))
            time.sleep(0.05)
    for _ in range(3):           # paced too: the replay's 50 Hz joint states share the node's 10-deep queue, which a
        for bad in (JointState(name=list(JOINT_NAMES),   # loaded node drains late (one of two unpaced ones was lost)
                               position=[float("nan")] + [0.0] * (len(JOINT_NAMES) - 1)),
                    JointState(name=list(JOINT_NAMES), position=[float("inf")] * len(JOINT_NAMES)),
                    JointState(name=["foo", "bar"], position=[0.0, 1.0])):
            js.publish(bad)
            time.sleep(0.05)
    for i in range(1000):
        prompt.publish(String(data=f"burst question {i}?"))
    for _ in range(3):           # after the burst, paced: a loaded node's DDS queue drops the oldest of a burst
        prompt.publish(String(data="x" * 5000))
        time.sleep(0.05)
    fault.publish(String(data="cycle_exception"))

    expect = {"rejected.image_encoding": 1, "rejected.image_size": 1, "rejected.image_step": 1,
              "rejected.image_truncated": 1, "rejected.joint_nonfinite": 2, "rejected.joint_names": 1,
              "prompt_truncated": 1, "prompt_dropped": 500, "cycle_errors": 1}

    def all_raised():
        return all((env.counter(k) or 0) >= v for k, v in expect.items())
    ok = ros.wait_for(all_raised, 30, interval=0.5)
    got = {k: env.counter(k) for k in expect}
    assert ok, f"counters not raised: {got}\n" + env.node.log()[-2000:]
    assert env.node.alive()
    d = env.last_diag()
    assert d["oxygen_node: inputs"][2]["rejected_total"] != "0"
    assert_control_rate(control_messages(env))          # the control loop unharmed by the bad input
    assert "rejected input" in env.node.log()


def _unusable_frame(kind, ros):
    if kind == "strip":          # passes the header/data checks, shrinks to 224x0 in resize-with-pad
        m = rgb_to_image(np.zeros((1000, 2, 3), np.uint8), "rgb8")
    elif kind == "sliver":
        m = rgb_to_image(np.zeros((2, 1000, 3), np.uint8), "rgb8")
    else:                        # a good frame stamped 5 s ahead of the node's clock (camera clock skew)
        m = rgb_to_image(np.zeros((48, 64, 3), np.uint8), "rgb8")
        m.header.stamp = (ros.now() + __import__("rclpy").duration.Duration(seconds=5.0)).to_msg()
    return m


def test_unusable_and_skewed_wrist_frames_never_stop_the_actions(env):
    """Only bad frames on the left wrist camera (the replay leaves that topic out): 1000x2 / 2x1000 strips and frames
    stamped in the future. Before, a single strip made every cycle raise; now the slot is masked and counted and the
    base camera's actions keep their rate."""
    env.stop_replay()
    env.replay = start_replay(env.bag, env.tmp / "replay_nowrist.log", "--loop", "--exclude", "/conversation/prompt",
                              "/camera/left_wrist/image_raw")
    cam = env.ros.publisher(Image, "camera/left_wrist/image_raw")
    env.ros.wait_matched(cam, "oxygen_node")
    t_on = time.monotonic()
    # new chunks from the restarted replay (the old chunk's remainder keeps coming for a while)
    assert env.ros.wait_for(lambda: len({m.chunk_id for _, m in env.chunks_since(t_on)}) >= 4, 30), \
        env.node.log()[-2000:]
    before = {k: env.counter(k) or 0 for k in ("rejected.image_aspect", "future_stamps")}
    log_at = len(env.node.log())
    # unusable frames every 50 ms: 20 of them first, then on until CONTROL_N control messages and 4 new chunks have
    # come in since (counted events; 60 s is only a timeout)
    t1, i, deadline = None, 0, time.monotonic() + 60.0
    while time.monotonic() < deadline:
        cam.publish(_unusable_frame(("strip", "sliver", "future")[i % 3], env.ros))
        i += 1
        time.sleep(0.05)
        if i == 20:
            t1 = time.monotonic()
        got = env.chunks_since(t1) if t1 is not None else []
        if len(got) >= CONTROL_N and len({m.chunk_id for _, m in got}) >= 4:
            break
    assert t1 is not None and len(got) >= CONTROL_N, f"{len(got)} action_chunk messages\n" + env.node.log()[-2000:]
    assert_control_rate(got)
    assert len({m.chunk_id for _, m in got}) >= 4, "new chunks kept coming"
    assert env.ros.wait_for(lambda: (env.counter("rejected.image_aspect") or 0) > before["rejected.image_aspect"]
                            and (env.counter("future_stamps") or 0) > before["future_stamps"], 10)
    assert "cycle failed" not in env.node.log()[log_at:]
    env.stop_replay()
    env.start_replay()


def test_joint_states_stop_then_resume(env):
    """Cameras go on, joint_states stop: no new chunks after max_state_age_s, ERROR naming joint_states, a log line;
    chunks come back with the states."""
    env.stop_replay()
    env.replay = start_replay(env.bag, env.tmp / "replay_nojoints.log", "--loop", "--exclude", "/conversation/prompt",
                              "/joint_states")
    t_stop = time.monotonic()
    time.sleep(3.0)
    late = env.chunks_since(t_stop + 2.0)
    assert not {m.chunk_id for _, m in late} - {m.chunk_id for _, m in env.chunks_since(t_stop)[:1]}, \
        "new chunks were made from a stale joint state"
    assert env.ros.wait_for(lambda: "joint_states" in (env.last_diag(after=t_stop + 1.5) or {}).get(
        "oxygen_node: control", (0, ""))[1], 5), env.last_diag()
    assert env.last_diag()["oxygen_node: control"][0] == 2
    assert "joint_states: newest is" in env.node.log()
    env.stop_replay()
    env.start_replay()
    t_resume = time.monotonic()
    assert env.ros.wait_for(lambda: len({m.chunk_id for _, m in env.chunks_since(t_resume)}) >= 3, 30), \
        "no recovery after joint states return"
    assert "joint_states: receiving again" in env.node.log()


def test_cameras_stop_then_resume(env):
    env.stop_replay()
    t_stop = time.monotonic()
    # remainder of the last chunk (<= 50 rows at 70 Hz = 0.71 s) + max age 0.5 s + slack
    time.sleep(3.0)
    late = env.chunks_since(t_stop + 2.0)
    assert not late, f"{len(late)} chunks published 2 s after cameras stopped (stale_behavior=stop)"
    assert env.ros.wait_for(lambda: (env.last_diag(after=t_stop + 1.5) or {}).get("oxygen_node: control",
                                                                                  (0,))[0] == 2, 5)
    assert "too old" in env.last_diag()["oxygen_node: control"][1]
    # logged while no frame arrives (not only when a stale frame comes in)
    assert "camera 'camera/base/image_raw': newest is" in env.node.log()
    env.start_replay()
    t_resume = time.monotonic()
    assert env.ros.wait_for(lambda: len(env.chunks_since(t_resume)) > 50, 30), "no recovery after frames return"
    assert_control_rate(control_messages(env))
    assert env.ros.wait_for(lambda: (env.last_diag(after=time.monotonic() - 0.1) or {}).get(
        "oxygen_node: control", (2,))[0] == 0, 10)


def test_sigint_clean_shutdown_then_memory_persists_across_restart(env):
    before = [m.entry_id for _, m in list(env.memory)]
    assert before
    rc, dt = env.node.stop(signal.SIGINT, timeout=10.0)
    assert rc == 0, f"exit code {rc}\n" + env.node.log()[-2000:]
    assert dt < 5.0, f"SIGINT shutdown took {dt:.1f} s"
    with sqlite3.connect(str(env.db)) as db:
        n_before = db.execute("SELECT COUNT(*) FROM memory_entries").fetchone()[0]
    assert n_before >= len(before)
    n_msgs = len(env.memory)
    env.start_node("node2")
    assert env.ros.wait_for(lambda: len(env.memory) > n_msgs or not env.node.alive(), STARTUP_S + 30)
    new = [m.entry_id for _, m in list(env.memory)[n_msgs:]]
    assert new and min(new) > max(before), f"entry ids continue after restart: {before} then {new}"
    with sqlite3.connect(str(env.db)) as db:
        ids = [r[0] for r in db.execute("SELECT entry_id FROM memory_entries ORDER BY entry_id")]
    assert set(before) <= set(ids) and set(new) <= set(ids)
    rc, dt = env.node.stop(signal.SIGTERM, timeout=10.0)
    assert rc == 0 and dt < 5.0, f"SIGTERM: rc {rc}, {dt:.1f} s"
