"""The language interfaces end to end: ``oxygen_node`` as its own process over real DDS, fed by a replayed bag (tiny
random-weight model), with an rclpy action/service client in the test process.
Owns: a ``converse`` goal streams feedback whose concatenation is the result text and whose request id is the one on
``language/tokens`` and ``conversation/result``; two concurrent goals get separate, correct streams; a cancelled goal
ends CANCELED, emits at most one more cycle of tokens (``decode_k``) after the cancel is acknowledged and its KV is
freed (``kv_used_bytes`` back to its value before the goal); goals beyond ``converse_max_goals`` are rejected (the
reason counted in /diagnostics) while ``action_chunk`` keeps its rate (judged on the node's tick stamps); topic
prompts that overflow the queue end with a ``dropped`` final token and ``ConversationResponse`` carrying their ids;
``conversation_memory_entries`` puts the newest memory entries into the prompt the model read
(``ConversationResponse.model_prompt``);
``memory/query`` by substring / time range / frame range / limit over entries written before this node started,
bad ranges refused with a message, ``memory/clear`` only with ``confirm``, an empty store answering [] (the memory
database's faults with the node running: ``test_memory_faults.py``).  Speed is never asserted beyond the control
rate on the node's own stamps (``test_node.assert_control_rate``); the latencies are measured by
``bench/converse_latency.py``.
"""
from __future__ import annotations

import time

import pytest

from conftest import TIMING_GROUP, require_ros

require_ros()

from action_msgs.msg import GoalStatus  # noqa: E402
from builtin_interfaces.msg import Time  # noqa: E402
from rclpy.action import ActionClient  # noqa: E402
from rclpy.qos import QoSProfile  # noqa: E402
from std_msgs.msg import String  # noqa: E402

from oxygen_ros.action import Converse  # noqa: E402
from oxygen_ros.msg import ConversationResponse  # noqa: E402
from oxygen_ros.ros.memory_store import MemoryStore  # noqa: E402
from oxygen_ros.srv import ClearMemory, QueryMemory  # noqa: E402

from test_node import Env, assert_control_rate, control_messages  # noqa: E402

pytestmark = pytest.mark.xdist_group(TIMING_GROUP)     # node / player / launch processes: one worker

K = 3                   # decode_k: tokens per request per cycle
N_MAX = 90              # the node's max_new_tokens: a long goal runs ~30 cycles
PARAMS = {"horizon": 50, "memory_interval_s": 0.0, "subtask_enabled": False, "max_new_tokens": N_MAX,
          "decode_k": K, "converse_max_goals": 2, "conversation_memory_entries": 2, "prompt_queue_size": 4,
          "max_prompt_chars": 200, "frame_rate_hz": 15.0}
OLD = [("a red cup", 100.0, 5), ("a blue box", 60.0, 9), ("the red block moved", 30.0, 12)]   # text, age s, frame


class GoalRun:
    """One goal.  Its feedback is read from the action's feedback topic as the server sent it (every
    ``FeedbackMessage`` of the session), not from the client's callback: rclpy's ActionClient drops feedback it takes
    after the result, which a loaded test process does (the server waits only ``RESULT_GRACE_S`` after the last one).
    ``env``: the module's node environment with its action client and the feedback topic's collector."""

    def __init__(self, env, prompt: str, **fields):
        self.ros, self.raw = env.ros, env.raw_feedback
        fut = env.client.send_goal_async(Converse.Goal(prompt=prompt, **fields))
        assert self.ros.wait_for(fut.done, 30), (f"no goal response (test executor's last error: "
                                                 f"{self.ros._spin.last_error!r})\n" + env.node.log()[-2000:])
        self.handle = fut.result()
        self.result_fut = self.handle.get_result_async() if self.handle.accepted else None

    @property
    def feedback(self) -> list:
        """[(receive time, Converse.Feedback)] of this goal, in the order sent."""
        uuid = bytes(self.handle.goal_id.uuid)
        return [(t, m.feedback) for t, m in list(self.raw) if bytes(m.goal_id.uuid) == uuid]

    def result(self, timeout=60.0):
        assert self.ros.wait_for(self.result_fut.done, timeout), "no result"
        out = self.result_fut.result()
        # the last feedback may arrive after the result (another channel): wait for the one counting every token
        self.ros.wait_for(lambda: self.tokens() >= out.result.num_tokens, 10)
        return out.status, out.result

    def pieces(self) -> str:
        return "".join("".join(fb.pieces) for _, fb in self.feedback)

    def tokens(self) -> int:
        fb = self.feedback
        return fb[-1][1].num_tokens if fb else 0


@pytest.fixture(scope="module")
def cv(ros, tmp_path_factory, synthetic_bag):
    tmp = tmp_path_factory.mktemp("converse")
    db = tmp / "memory.db"
    now = time.time()
    with MemoryStore(str(db)) as st:            # entries "from before a restart"
        for text, age, frame in OLD:
            t = now - age
            st.add(text=text, source_prompt="describe", frame_index=frame, request_id=1, num_tokens=3,
                   stamp_sec=int(t), stamp_nanosec=int((t % 1) * 1e9))
    e = Env(ros, tmp, synthetic_bag, params=PARAMS)
    e.params["memory_db"] = str(db)
    e.results = e.collect(ConversationResponse, "conversation/result", qos=1000)
    e.client = ActionClient(ros.node, Converse, "converse", feedback_sub_qos_profile=QoSProfile(depth=100))
    e.raw_feedback = e.collect(Converse.Impl.FeedbackMessage, "converse/_action/feedback", qos=1000, keep=20000)
    e.query = ros.node.create_client(QueryMemory, "memory/query")
    e.clear = ros.node.create_client(ClearMemory, "memory/clear")
    e.start_node()
    e.start_replay()
    e.wait_chunks()
    assert e.client.wait_for_server(timeout_sec=30), "no converse action server"
    e.now = now
    yield e
    e.close()
    e.client.destroy()


def _tokens(env, rid):
    return [m for _, m in list(env.tokens) if m.request_id == rid]


def test_goal_streams_feedback_matching_tokens_and_result(cv):
    run = GoalRun(cv, "What is on the table?", max_new_tokens=12)
    assert run.handle.accepted
    status, r = run.result()
    assert status == GoalStatus.STATUS_SUCCEEDED and r.finish_reason in ("eos", "length"), (status, r)
    assert run.feedback, "feedback was streamed"
    assert run.pieces() == r.text and run.feedback[-1][1].text == r.text and run.tokens() == r.num_tokens
    assert {fb.request_id for _, fb in run.feedback} == {r.request_id}
    assert len({fb.frame_index for _, fb in run.feedback}) == 1 and run.feedback[0][1].frame_index == r.frame_index
    assert 0.0 < r.time_to_first_token_s <= r.total_time_s
    assert cv.ros.wait_for(lambda: any(t.is_final for t in _tokens(cv, r.request_id)), 5)
    toks = _tokens(cv, r.request_id)
    assert "".join(t.text for t in toks) == r.text and [t.index for t in toks] == list(range(len(toks)))
    assert toks[-1].finish_reason == r.finish_reason and len(toks) == r.num_tokens
    assert cv.ros.wait_for(lambda: any(m.request_id == r.request_id for _, m in list(cv.results)), 5)
    res = next(m for _, m in list(cv.results) if m.request_id == r.request_id)
    assert (res.text, res.finish_reason, res.num_tokens, res.prompt) == (r.text, r.finish_reason, r.num_tokens,
                                                                         "What is on the table?")
    # conversation_memory_entries 2: the two newest entries (written before this node started), oldest first
    assert res.model_prompt == "Earlier you saw: a blue box; the red block moved. What is on the table?"


def test_two_concurrent_goals_get_separate_streams(cv):
    a = GoalRun(cv, "Describe the scene.", max_new_tokens=15)
    b = GoalRun(cv, "Where is the block?", max_new_tokens=9)
    (sa, ra), (sb, rb) = a.result(), b.result()
    assert sa == sb == GoalStatus.STATUS_SUCCEEDED and ra.request_id != rb.request_id
    assert cv.ros.wait_for(lambda: all(any(t.is_final for t in _tokens(cv, r.request_id)) for r in (ra, rb)), 10)
    for run, r in ((a, ra), (b, rb)):
        assert run.pieces() == r.text and {fb.request_id for _, fb in run.feedback} == {r.request_id}
        assert "".join(t.text for t in _tokens(cv, r.request_id)) == r.text
    assert ra.num_tokens <= 15 and rb.num_tokens <= 9


def _kv_idle(env, after):
    d = env.last_diag(after)
    if d is None:
        return None
    vals = d["oxygen_node: language"][2]
    return vals["kv_used_bytes"] if vals["active_requests"] == "0" else None


def test_cancel_stops_within_one_cycle_and_frees_kv(cv):
    assert cv.ros.wait_for(lambda: _kv_idle(cv, time.monotonic() - 0.5) is not None, 10)
    kv_before = _kv_idle(cv, time.monotonic() - 0.5)
    run = GoalRun(cv, "Tell me everything you see, in detail.", max_new_tokens=N_MAX)
    assert run.handle.accepted
    assert cv.ros.wait_for(lambda: run.tokens() >= 2 * K, 30), "the goal is decoding"
    fut = run.handle.cancel_goal_async()
    assert cv.ros.wait_for(fut.done, 10) and fut.result().goals_canceling, "cancel accepted"
    t_ack_ns = cv.ros.now().nanoseconds       # the node's clock too (one machine)
    status, r = run.result()
    assert status == GoalStatus.STATUS_CANCELED and r.finish_reason == "cancelled", (status, r)
    assert r.num_tokens < N_MAX and run.pieces() == r.text
    # language/tokens is another topic than the action's result: wait for the request's final token
    assert cv.ros.wait_for(lambda: any(t.is_final for t in _tokens(cv, r.request_id)), 10), "no final token"
    toks = _tokens(cv, r.request_id)
    # tokens the node stamped (made) after this process had the acknowledgement: delivery delays on a loaded
    # machine cannot move a token into or out of this set
    late = [m for m in toks if not m.is_final and m.header.stamp.sec * 10**9 + m.header.stamp.nanosec > t_ack_ns]
    assert len(late) <= K, f"{len(late)} tokens after the cancel was acknowledged (at most one cycle = {K})"
    assert toks[-1].is_final and toks[-1].finish_reason == "cancelled"
    t = time.monotonic()
    assert cv.ros.wait_for(lambda: _kv_idle(cv, t) is not None, 10), "no request left active"
    assert _kv_idle(cv, t) == kv_before, "the cancelled request's KV was freed"


def test_goals_beyond_capacity_are_rejected_while_actions_keep_rate(cv):
    long = [GoalRun(cv, f"Long answer {i}", max_new_tokens=N_MAX) for i in range(2)]
    assert all(g.handle.accepted for g in long)
    extra = [GoalRun(cv, f"One more {i}", max_new_tokens=5) for i in range(2)]
    assert not any(g.handle.accepted for g in extra), "converse_max_goals 2: further goals are rejected"
    # while two long goals decode flat out: the inference thread shares the GIL with the control thread, and on an
    # overloaded machine (a CPU hog plus other tests) a descheduled GIL holder stalls it: a median of 44 ms was seen
    # there once, so this only asks that the actions keep flowing at >= 1/4 of the rate (test_node.py owns the rate)
    assert_control_rate(control_messages(cv), slack=4.0)
    assert cv.ros.wait_for(lambda: (cv.counter("converse_rejected.capacity") or 0) >= 2, 5), \
        "the rejection reason is counted in /diagnostics"
    for g in long:
        g.handle.cancel_goal_async()
    for g in long:
        status, r = g.result()
        assert status in (GoalStatus.STATUS_CANCELED, GoalStatus.STATUS_SUCCEEDED), status
    again = GoalRun(cv, "Room again?", max_new_tokens=3)
    assert again.handle.accepted and again.result()[0] == GoalStatus.STATUS_SUCCEEDED


def test_a_burst_of_goals_and_cancels_is_answered_in_full(cv):
    """100 goals sent at once (a client with a deep queue): every one gets a goal response - accepted (up to
    converse_max_goals at a time) or rejected with the reason counted - accepted ones finish, and a burst of cancels
    is answered too.  (The server's default 10-deep goal queue dropped most of a burst of 20: clients hung.)"""
    deep = QoSProfile(depth=1000)
    client = ActionClient(cv.ros.node, Converse, "converse", goal_service_qos_profile=deep,
                          cancel_service_qos_profile=deep, result_service_qos_profile=deep,
                          feedback_sub_qos_profile=QoSProfile(depth=100))
    try:
        assert client.wait_for_server(timeout_sec=30)
        before = cv.counter("converse_rejected.capacity") or 0
        futs = [client.send_goal_async(Converse.Goal(prompt=f"burst {i}?", max_new_tokens=4)) for i in range(100)]
        assert cv.ros.wait_for(lambda: all(f.done() for f in futs), 60), \
            f"{sum(not f.done() for f in futs)} of 100 goals got no response"
        handles = [f.result() for f in futs]
        accepted = [h for h in handles if h.accepted]
        assert 1 <= len(accepted) <= 100 and len(accepted) + sum(not h.accepted for h in handles) == 100
        cancels = [h.cancel_goal_async() for h in accepted]
        results = [h.get_result_async() for h in accepted]
        assert cv.ros.wait_for(lambda: all(c.done() for c in cancels), 30), "cancel requests left unanswered"
        assert cv.ros.wait_for(lambda: all(r.done() for r in results), 60), "accepted goals without a result"
        assert all(r.result().status in (GoalStatus.STATUS_SUCCEEDED, GoalStatus.STATUS_CANCELED) for r in results)
        rejected = 100 - len(accepted)
        assert cv.ros.wait_for(lambda: (cv.counter("converse_rejected.capacity") or 0) - before == rejected, 10), \
            f"counted {(cv.counter('converse_rejected.capacity') or 0) - before} capacity rejections, sent {rejected}"
    finally:
        client.destroy()


def test_topic_prompts_carry_ids_and_drops_are_visible(cv):
    pub = cv.ros.publisher(String, "conversation/prompt", qos=1000)
    cv.ros.wait_matched(pub, "oxygen_node")
    prompts = [f"flood question {i}?" for i in range(30)]
    for p in prompts:
        pub.publish(String(data=p))

    def ended():
        return {m.prompt: m for _, m in list(cv.results) if m.prompt in prompts}
    assert cv.ros.wait_for(lambda: len(ended()) == len(prompts), 60), f"{len(ended())} of {len(prompts)} ended"
    got = ended()
    ids = [m.request_id for m in got.values()]
    assert len(set(ids)) == len(prompts) and 0 not in ids
    dropped = [m for m in got.values() if m.finish_reason == "dropped"]
    done = [m for m in got.values() if m.finish_reason in ("eos", "length")]
    assert dropped and done and len(dropped) + len(done) == len(prompts), {m.finish_reason for m in got.values()}
    # tokens travel on another topic than the results: wait until every request's final token is in (any load)
    assert cv.ros.wait_for(lambda: all(any(t.is_final for t in _tokens(cv, m.request_id)) for m in got.values()), 10)
    for m in dropped:
        toks = _tokens(cv, m.request_id)
        assert len(toks) == 1 and toks[0].is_final and toks[0].finish_reason == "dropped" and toks[0].token_id == -1
    for m in done:
        assert "".join(t.text for t in _tokens(cv, m.request_id)) == m.text


def _call(env, client, req):
    assert client.wait_for_service(timeout_sec=10)
    fut = client.call_async(req)
    assert env.ros.wait_for(fut.done, 10)
    return fut.result()


def _stamp(t: float) -> Time:
    return Time(sec=int(t), nanosec=int((t % 1) * 1e9))


def test_memory_query_and_clear(cv):
    q = lambda **kw: _call(cv, cv.query, QueryMemory.Request(**kw))  # noqa: E731
    r = q()
    assert r.success and [e.text for e in r.entries] == [t for t, _, _ in OLD[::-1]], "newest first, from the DB"
    assert [e.text for e in q(text_contains="RED").entries] == ["the red block moved", "a red cup"]
    r = q(start_time=_stamp(cv.now - 80), end_time=_stamp(cv.now - 20))
    assert [e.text for e in r.entries] == ["the red block moved", "a blue box"]
    assert [e.text for e in q(min_frame_index=6, max_frame_index=20).entries] == ["the red block moved", "a blue box"]
    assert [e.text for e in q(limit=1).entries] == ["the red block moved"]
    e = q(limit=1).entries[0]
    assert e.entry_id == 3 and e.frame_index == 12 and e.source_prompt == "describe"
    bad = q(start_time=_stamp(cv.now), end_time=_stamp(cv.now - 10))
    assert not bad.success and "end_time" in bad.message and not bad.entries
    assert not q(limit=5000).success
    r = _call(cv, cv.clear, ClearMemory.Request())
    assert not r.success and "confirm" in r.message and len(q().entries) == 3, "nothing deleted without confirm"
    r = _call(cv, cv.clear, ClearMemory.Request(confirm=True))
    assert r.success and r.deleted == 3
    r = q()
    assert r.success and list(r.entries) == [], "an empty store answers an empty list"
