"""Units of the language interfaces that need no DDS: a Converse goal's overrides bounded by the node's limits
(``goal_request``), one goal's streamed answer batched into feedback (``GoalStream``), the memory/query request
mapping (``memory_query``), and ``-p name:=`` (an empty value rcl cannot parse) meaning the empty string."""
import math

import pytest

from oxygen_ros.ros.converse import GoalRequest, GoalStream, goal_request
from oxygen_ros.ros.language import ResponseOut, TokenOut
from oxygen_ros.ros.parameters import ros_args


def req(prompt="what is on the table?", n=0, t=-1.0, p=-1.0, node_max=32, chars=100):
    return goal_request(prompt, n, t, p, node_max_new_tokens=node_max, max_prompt_chars=chars)


def test_goal_defaults_caps_and_refusals():
    assert req() == GoalRequest("what is on the table?", None, None, None)
    assert req(n=8, t=0.0, p=0.9) == GoalRequest("what is on the table?", 8, 0.0, 0.9), "0 = greedy override"
    assert req(n=500).max_new_tokens == 32, "capped at the node's max_new_tokens"
    assert req(p=0.0).top_p is None and req(t=-3.0).temperature is None, "out-of-band values = the node's"
    cut = req(prompt="x" * 150)
    assert cut.prompt == "x" * 100 and cut.truncated
    for bad, why in ((dict(prompt="   "), "empty"), (dict(t=11.0), "temperature"), (dict(t=math.nan), "temperature"),
                     (dict(p=1.5), "top_p"), (dict(p=math.inf), "top_p")):
        r = req(**bad)
        assert isinstance(r, str) and why in r, (bad, r)


def _t(i, text, final=False, token_id=None):
    return TokenOut(7, "conversation", 3, i, i if token_id is None else token_id, text, final, "", 0)


def test_goal_stream_batches_pieces_and_keeps_the_end():
    g = GoalStream(7)
    g.push(_t(0, "He"))
    g.push(_t(1, "llo"))
    p = g.take()
    assert (p.pieces, p.text, p.num_tokens, p.frame_index, p.result) == (["He", "llo"], "Hello", 2, 3, None)
    assert g.take().pieces == [], "each piece is delivered once"
    g.push(_t(2, "!", final=True))
    end = ResponseOut(7, "q", "Hello!", "eos", 3, 3, 0)
    g.finish(end)
    p = g.take()
    assert p.pieces == ["!"] and p.text == "Hello!" and p.num_tokens == 3 and p.result is end
    g2 = GoalStream(8)
    g2.push(_t(0, "", final=True, token_id=-1))          # the empty final marker of a request that never ran
    assert g2.take().num_tokens == 0


def test_empty_parameter_value_means_empty_string():
    argv = ["oxygen_node", "--ros-args", "-p", "memory_db:=", "-p", "seed:=3", "--param", "x:=", "-r", "a:=b"]
    assert ros_args(argv) == ["oxygen_node", "--ros-args", "-p", "memory_db:=''", "-p", "seed:=3", "--param",
                              "x:=''", "-r", "a:=b"]
    assert ros_args(["oxygen_node", "-p", "memory_db:="]) == ["oxygen_node", "-p", "memory_db:="], \
        "only inside --ros-args"


def test_memory_query_request_mapping():
    pytest.importorskip("oxygen_ros.srv")
    from builtin_interfaces.msg import Time
    from oxygen_ros.ros.memory_services import memory_query
    from oxygen_ros.srv import QueryMemory
    q = memory_query(QueryMemory.Request())
    assert (q.text_contains, q.start_ns, q.end_ns, q.min_frame, q.max_frame, q.limit) == ("", None, None, None,
                                                                                           None, 100)
    q = memory_query(QueryMemory.Request(text_contains="cup", start_time=Time(sec=5, nanosec=7),
                                         end_time=Time(sec=6), min_frame_index=0, max_frame_index=9, limit=3))
    assert (q.start_ns, q.end_ns, q.min_frame, q.max_frame, q.limit) == (5_000_000_007, 6_000_000_000, 0, 9, 3)
