"""Deterministic tests of ``OxygenNode``'s bookkeeping, in-process with a stand-in engine (no model, no torch):
the node is configured/activated through its lifecycle with ``engine_factory``, then the engine callbacks and input
callbacks are called directly and the published messages are read back over DDS.  Owns the cases the real engine
does not produce on demand: a request's final token arriving before or after ``on_finished``, rejected requests (an
empty final marker, no response), memory entries stored with continuing ids, invalid chunks, every joint-state and
image rejection reason, and prompt truncation / queue overflow counters; request ids given on arrival and carried
into ``engine.submit``, every dropped / rejected / refused prompt ending with a final token and a
``ConversationResponse`` carrying its id, and the memory context handed to the engine (``conversation_memory_entries``).
"""
from __future__ import annotations

import sqlite3
import time

import numpy as np
import pytest

from conftest import require_ros

require_ros()

from sensor_msgs.msg import JointState  # noqa: E402
from std_msgs.msg import String  # noqa: E402

from oxygen_ros.engine.requests import ActionResult, RequestResult, TokenEvent  # noqa: E402
from oxygen_ros.msg import ActionChunk, ConversationResponse, LanguageToken, MemoryEntry  # noqa: E402
from oxygen_ros.ros.engine_factory import BuiltEngine  # noqa: E402
from oxygen_ros.ros.images import rgb_to_image  # noqa: E402
from oxygen_ros.ros.node import OxygenNode  # noqa: E402


def stub_factory(settings, **callbacks):
    return BuiltEngine(StubEngine(), "stub engine", action_dims=3, horizon=4, state_dim_max=6)


class StubEngine:
    def __init__(self):
        self.submitted = []
        self.cancelled = []

    def submit(self, kind, prompt="", max_new_tokens=None, *, request_id, **options):
        if prompt == "refuse":
            raise ValueError("refused by the test engine")
        self.submitted.append((kind, prompt, request_id, options))
        return request_id

    def cancel(self, request_id):
        self.cancelled.append(request_id)
        return True

    def cycle(self, obs):
        return {}

    def metrics(self):
        return {"kv_bytes_in_use": 10, "kv_bytes_capacity": 100}


@pytest.fixture(scope="module")
def node(ros, tmp_path_factory):
    from rclpy.parameter import Parameter
    db = tmp_path_factory.mktemp("cb") / "mem.db"
    n = OxygenNode(engine_factory=stub_factory, parameter_overrides=[
        Parameter("memory_db", value=str(db)), Parameter("prompt_queue_size", value=3),
        Parameter("max_prompt_chars", value=10), Parameter("state_joint_names", value=["a", "b", "c"]),
        Parameter("action_joint_names", value=["x", "y", "z"]), Parameter("camera_topics", value=["cam0", "", ""])])
    n.trigger_configure()
    assert n._state == "inactive", n.configure_error
    n.trigger_activate()
    n.db_path = db
    time.sleep(0.5)
    yield n
    n.stop_all()
    n.destroy_node()


def _tok(rid, kind, i, text, final=False, fi=7):
    return TokenEvent(rid, kind, fi, i, 65 + i, text, final, time.time())


def _res(rid, kind, text, reason, n=0, prompt="p", fi=7):
    return RequestResult(rid, kind, fi, prompt, text, list(range(n)), time.time(), reason)


def test_token_stream_both_orders_and_rejection(ros, node):
    toks = ros.collect(LanguageToken, "language/tokens", qos=100)
    resp = ros.collect(String, "conversation/response", qos=100)
    ros.wait_matched(node.pub.tokens)
    ros.wait_matched(node.pub.response_text)
    # order 1: tokens, final token, then on_finished
    for i, t in enumerate(["he", "ll"]):
        node.pipeline._on_token(_tok(1, "conversation", i, t))
    node.pipeline._on_token(_tok(1, "conversation", 2, "o", final=True))
    node.pipeline._on_finished(_res(1, "conversation", "hello", "eos", 3))
    # order 2: on_finished before the final token
    node.pipeline._on_token(_tok(2, "conversation", 0, "a"))
    node.pipeline._on_finished(_res(2, "conversation", "ab", "length", 2))
    node.pipeline._on_token(_tok(2, "conversation", 1, "b", final=True))
    # rejected before any token
    node.pipeline._on_finished(_res(3, "conversation", "", "rejected"))
    assert ros.wait_for(lambda: len(toks) >= 6 and len(resp) >= 2, 5)
    time.sleep(0.2)
    by = {}
    for _, m in toks:
        by.setdefault(m.request_id, []).append(m)
    assert [m.index for m in by[1]] == [0, 1, 2] and [m.is_final for m in by[1]] == [False, False, True]
    assert by[1][-1].finish_reason == "eos" and by[2][-1].finish_reason == "length"
    assert [m.index for m in by[2]] == [0, 1]
    assert len(by[3]) == 1 and by[3][0].is_final and by[3][0].token_id == -1 and by[3][0].finish_reason == "rejected"
    assert [m.data for _, m in resp] == ["hello", "ab"], "no response for a rejected request"
    assert node.counters.get("request_rejected") >= 1


def test_memory_entries_are_stored_with_continuing_ids(ros, node):
    mem = ros.collect(MemoryEntry, "memory/entries", qos=100)
    ros.wait_matched(node.pub.memory_entries)
    node.pipeline._on_actions(ActionResult(9, 1, 1700000000.25, np.zeros((4, 3), np.float32), 5.0))
    for rid in (10, 11):
        node.pipeline._on_token(_tok(rid, "memory", 0, "a red ", fi=9))
        node.pipeline._on_token(_tok(rid, "memory", 1, "block", final=True, fi=9))
        node.pipeline._on_finished(_res(rid, "memory", "a red block", "eos", 2, prompt="describe", fi=9))
    node.pipeline._on_finished(_res(12, "memory", "", "error", fi=9))     # failed: no entry
    assert ros.wait_for(lambda: len(mem) >= 2, 5)
    time.sleep(0.2)
    assert len(mem) == 2
    a, b = mem[0][1], mem[1][1]
    assert b.entry_id == a.entry_id + 1 and a.text == "a red block" and a.source_prompt == "describe"
    assert a.frame_index == 9 and a.num_tokens == 2
    assert a.header.stamp.sec == 1700000000 and abs(a.header.stamp.nanosec - 250_000_000) < 1000
    with sqlite3.connect(str(node.db_path)) as db:
        assert db.execute("SELECT COUNT(*) FROM memory_entries").fetchone()[0] == 2


def test_invalid_chunk_is_dropped(node):
    before = node.counters.get("chunk_invalid")
    node.pipeline._on_actions(ActionResult(1, 99, time.time(), np.full((4, 3), np.nan, np.float32), 1.0))
    node.pipeline._on_actions(ActionResult(1, 100, time.time(), np.zeros(5, np.float32), 1.0))
    assert node.counters.get("chunk_invalid") == before + 2


def test_control_tick_publishes_named_remainder(ros, node):
    chunks = ros.collect(ActionChunk, "action_chunk", qos=100)
    ros.wait_matched(node.pub.actions)
    stamp = time.time()
    node.pipeline._on_actions(ActionResult(5, 200, stamp, np.arange(12, dtype=np.float32).reshape(4, 3), 3.0))
    assert ros.wait_for(lambda: any(m.chunk_id == 200 for _, m in chunks), 5)
    m = next(m for _, m in chunks if m.chunk_id == 200)
    assert list(m.joint_names) == ["x", "y", "z"] and m.action_dim == 3 and 1 <= m.horizon <= 4
    # the not-yet-executed remainder: the chunk's last `horizon` rows, row-major, values unchanged
    assert list(m.actions) == np.arange(12, dtype=np.float32)[12 - 3 * m.horizon:].tolist()
    assert m.inference_latency_ms == pytest.approx(3.0)
    assert abs((m.header.stamp.sec + m.header.stamp.nanosec * 1e-9) - stamp) < 1e-6


@pytest.mark.parametrize("msg,reason", [
    (JointState(name=["a", "b"], position=[0.0, 1.0]), "joint_names"),
    (JointState(name=["a", "b", "c"], position=[0.0, 1.0]), "joint_size"),
    (JointState(name=["c", "b", "a"], position=[0.0, float("nan"), 1.0]), "joint_nonfinite"),
])
def test_joint_state_rejections(node, msg, reason):
    before = node.counters.get(f"rejected.{reason}")
    node.pipeline.inputs.on_joint_state(msg, 0)
    assert node.counters.get(f"rejected.{reason}") == before + 1


def test_joint_state_reordered_by_name(node):
    node.pipeline.inputs.on_joint_state(JointState(name=["c", "x", "a", "b"], position=[3.0, 9.0, 1.0, 2.0]), 0)
    np.testing.assert_array_equal(node.pipeline.inputs.take().joint.position, np.array([1.0, 2.0, 3.0], np.float32))


def test_image_rejections_and_prompt_limits(node):
    bad = rgb_to_image(np.zeros((4, 4, 3), np.uint8))
    bad.encoding = "jpeg"
    node.pipeline.inputs.on_image(0, bad, 0)
    assert node.counters.get("rejected.image_encoding") >= 1
    node.pipeline.inputs.on_prompt("x" * 50, 0)
    assert node.counters.get("prompt_truncated") >= 1
    before = node.counters.get("prompt_dropped")
    for i in range(6):
        node.pipeline.inputs.on_prompt(f"q{i}", 0)
    assert node.counters.get("prompt_dropped") >= before + 3
    assert node.pipeline.inputs.queued_prompts() == 3
    node.pipeline.inputs.on_prompt("   ", 0)
    assert node.counters.get("rejected.prompt_empty") == 1


def test_prompt_ids_drops_and_rejections_are_published(ros, node):
    toks = ros.collect(LanguageToken, "language/tokens", qos=100)
    results = ros.collect(ConversationResponse, "conversation/result", qos=100)
    ros.wait_matched(node.pub.tokens)
    ros.wait_matched(node.pub.results)
    inputs, eng = node.pipeline.inputs, node.pipeline.engine
    inputs.take(max_prompts=100)                      # earlier tests left prompts queued
    for i in range(5):                                # queue of 3: q0 and q1 are dropped
        inputs.on_prompt(f"q{i}", 0)
    inputs.on_prompt("  ", 0)                         # rejected: empty
    node.pipeline.step()                              # no frame: the cycle is skipped, the prompts are submitted
    assert node.pipeline.submit("conversation", "refuse") is None
    assert ros.wait_for(lambda: len(results) >= 4, 5)
    time.sleep(0.2)
    ends = {m.prompt: m for _, m in results}
    sub = {p: rid for kind, p, rid, _ in eng.submitted[-3:]}
    assert set(sub) == {"q2", "q3", "q4"}, eng.submitted[-3:]
    ids = {ends["q0"].request_id, ends["q1"].request_id, ends["  "].request_id, ends["refuse"].request_id,
           *sub.values()}
    assert len(ids) == 7 and 0 not in ids, "every prompt has its own id"
    for p, reason, why in (("q0", "dropped", "prompt_queue_size"), ("q1", "dropped", "prompt_queue_size"),
                           ("  ", "rejected", "empty"), ("refuse", "rejected", "refused by the test engine")):
        m = ends[p]
        assert m.finish_reason == reason and why in m.detail and m.text == "" and m.num_tokens == 0
        assert m.time_to_first_token_s == -1.0 and m.total_time_s >= 0.0
        final = [t for _, t in toks if t.request_id == m.request_id]
        assert len(final) == 1 and final[0].is_final and final[0].finish_reason == reason and final[0].token_id == -1
    # a submitted prompt's answer carries the id it got on arrival
    rid = sub["q2"]
    node.pipeline._on_token(_tok(rid, "conversation", 0, "o"))
    node.pipeline._on_token(_tok(rid, "conversation", 1, "k", final=True))
    node.pipeline._on_finished(RequestResult(rid, "conversation", 7, "q2", "ok", [1, 2], time.time(), "eos", "",
                                             "User prompt as read"))
    assert ros.wait_for(lambda: any(m.request_id == rid for _, m in results), 5)
    m = next(m for _, m in results if m.request_id == rid)
    assert (m.prompt, m.text, m.finish_reason, m.num_tokens, m.frame_index) == ("q2", "ok", "eos", 2, 7)
    assert m.model_prompt == "User prompt as read" and 0.0 <= m.time_to_first_token_s <= m.total_time_s


def test_memory_context_reaches_the_engine(node):
    pl = node.pipeline
    pl.settings = pl.settings.replace(conversation_memory_entries=2)
    try:
        for rid, text in ((20, "first scene"), (21, "second scene"), (22, "third scene")):
            pl._on_finished(_res(rid, "memory", text, "eos", 2, prompt="describe", fi=9))
            pl._on_token(_tok(rid, "memory", 0, text, final=True, fi=9))
        rid = pl.submit("conversation", "what happened?")
        kind, prompt, got_id, opts = pl.engine.submitted[-1]
        assert (kind, prompt, got_id) == ("conversation", "what happened?", rid)
        assert opts["context"] == ("second scene", "third scene"), "the newest entries, oldest first"
    finally:
        pl.settings = pl.settings.replace(conversation_memory_entries=0)
    pl.submit("conversation", "no context")
    assert "context" not in pl.engine.submitted[-1][3]
