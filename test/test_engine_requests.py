"""Engine request controls on the real tiny model, CPU, behaviour only (never timing): ``Engine.cancel`` stops a
decoding request at the next cycle boundary or before the current cycle's decode (so at most one more cycle of
tokens), ends it with finish_reason "cancelled" and its partial output, frees its KV (pool usage returns to what it
was, ``check_invariants`` holds) and leaves the other requests' tokens unchanged; a pending or waiting request is
cancelled before admission; caller-allocated request ids are used and must be unique; per-request temperature/top_p
overrides replace the engine's sampling (temperature 0 = greedy) and bad values are refused; a memory context is
prepended to the prompt the model reads, its oldest entries left out so the question survives the prompt limit."""
import pytest
import torch

from oxygen_ros.engine.engine import Engine, EngineConfig
from oxygen_ros.engine.requests import next_request_id, with_context
from oxygen_ros.model import Processor, build_model, load_tokenizer
from oxygen_ros.model.pi05 import SamplingParams

from test_engine import frames, small_cfg

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NEVER_EOS = -1          # eos id no token has: requests run to max_new_tokens


@pytest.fixture(scope="module")
def setup():
    cfg = small_cfg()
    model = build_model(cfg, seed=0)
    return model, Processor(cfg, load_tokenizer(cfg)), frames(cfg, 1)[0]


class Recorder:
    """An engine with callbacks that record every token and result."""

    def __init__(self, model, proc, **cfg):
        self.tokens, self.results, self.on_actions = {}, {}, None
        cfg.setdefault("eos_token_id", NEVER_EOS)
        self.eng = Engine(model, proc, EngineConfig(**cfg), on_actions=self._act, on_token=self._tok,
                          on_finished=self._fin)

    def _act(self, a):
        if self.on_actions is not None:
            self.on_actions(a)

    def _tok(self, t):
        self.tokens.setdefault(t.request_id, []).append(t)

    def _fin(self, r):
        assert r.request_id not in self.results, "one result per request"
        self.results[r.request_id] = r

    def n(self, rid) -> int:
        return len(self.tokens.get(rid, []))

    def cycle(self, obs):
        self.eng.cycle(obs)
        self.eng.kv.check_invariants(idle=True)


def test_cancel_stops_decoding_at_next_cycle_and_frees_kv(setup):
    model, proc, obs = setup
    r = Recorder(model, proc, decode_k=3, max_new_tokens=40)
    r.cycle(obs)
    used_before = r.eng.pool.used_blocks
    rid = r.eng.submit("conversation", "tell me a long story", 40)
    r.cycle(obs)
    r.cycle(obs)
    assert r.n(rid) == 6 and r.eng.pool.used_blocks > used_before, "3 tokens per cycle while decoding"
    assert r.eng.cancel(rid)
    r.cycle(obs)
    assert r.n(rid) == 6, "no token after the cancel"
    res = r.results[rid]
    assert res.finish_reason == "cancelled"
    assert res.token_ids == [t.token_id for t in r.tokens[rid]], "the result carries the partial output"
    assert rid not in r.eng.kv.requests and r.eng.active() == 0
    assert r.eng.pool.used_blocks == used_before, "the request's KV (and its frame prefix) were freed"
    assert not r.eng.cancel(rid), "a finished request is no longer cancellable"
    assert r.eng.metrics()["requests_cancelled"] == 1


def test_cancel_arriving_mid_cycle_skips_that_cycles_decode(setup):
    model, proc, obs = setup
    r = Recorder(model, proc, decode_k=4, max_new_tokens=40)
    rid = r.eng.submit("conversation", "count to forty", 40)
    r.cycle(obs)
    assert r.n(rid) == 4
    r.on_actions = lambda a: r.eng.cancel(rid)        # arrives after this cycle's actions, before its decode
    r.cycle(obs)
    assert r.n(rid) == 4 and r.results[rid].finish_reason == "cancelled"
    assert r.eng.pool.used_blocks == 0


def test_cancel_leaves_other_requests_unchanged(setup):
    model, proc, obs = setup
    alone = Recorder(model, proc, decode_k=3, max_new_tokens=12)
    a = alone.eng.submit("conversation", "what is on the table?", 12)
    while a not in alone.results:
        alone.cycle(obs)
    both = Recorder(model, proc, decode_k=3, max_new_tokens=12)
    a2 = both.eng.submit("conversation", "what is on the table?", 12)
    b = both.eng.submit("memory", "describe it", 12)
    both.cycle(obs)
    both.eng.cancel(b)
    while a2 not in both.results:
        both.cycle(obs)
    assert both.results[b].finish_reason == "cancelled" and both.n(b) == 3
    assert both.results[a2].token_ids == alone.results[a].token_ids
    assert both.results[a2].finish_reason == "length"
    assert both.eng.pool.used_blocks == 0


def test_cancel_pending_and_waiting_requests(setup):
    model, proc, obs = setup
    r = Recorder(model, proc, decode_k=2, max_new_tokens=8, max_batch=1)
    first = r.eng.submit("conversation", "first", 8)
    waiting = r.eng.submit("conversation", "second", 8)
    r.cycle(obs)                                      # max_batch 1: `waiting` goes back to the queue
    assert r.n(first) == 2 and r.n(waiting) == 0 and r.eng.pending() == 1
    pending = r.eng.submit("conversation", "third", 8)
    assert r.eng.cancel(waiting) and r.eng.cancel(pending)
    r.cycle(obs)
    for rid in (waiting, pending):
        assert r.results[rid].finish_reason == "cancelled" and r.n(rid) == 0
        assert r.results[rid].frame_index == -1 and "before it was admitted" in r.results[rid].detail
    assert r.eng.pending() == 0 and r.n(first) == 4


def test_caller_allocated_request_ids(setup):
    model, proc, obs = setup
    r = Recorder(model, proc, decode_k=4, max_new_tokens=4)
    rid = next_request_id()
    assert r.eng.submit("conversation", "hi", 4, request_id=rid) == rid
    with pytest.raises(ValueError, match="already in use"):
        r.eng.submit("conversation", "again", 4, request_id=rid)
    r.cycle(obs)
    assert {t.request_id for t in r.tokens[rid]} == {rid} and r.results[rid].finish_reason == "length"
    assert r.eng.submit("conversation", "reused after it finished", 4, request_id=rid) == rid


def test_sampling_overrides_per_request(setup):
    model, proc, obs = setup
    prompt = "pick a word"

    def run(**kw):
        r = Recorder(model, proc, decode_k=8, max_new_tokens=8,
                     sampling=SamplingParams(temperature=50.0, seed=3))
        rid = r.eng.submit("conversation", prompt, 8, **kw)
        r.cycle(obs)
        return r.results[rid].token_ids

    greedy = Recorder(model, proc, decode_k=8, max_new_tokens=8)
    g = greedy.eng.submit("conversation", prompt, 8)
    greedy.cycle(obs)
    assert run(temperature=0.0) == greedy.results[g].token_ids, "temperature 0 overrides to greedy"
    assert run() == run() != greedy.results[g].token_ids, "no override: the engine's (seeded) sampling"
    torch.manual_seed(0)
    assert run(temperature=50.0, top_p=1.0) == run(temperature=50.0, top_p=1.0), "the engine's seed is kept"
    for bad in ({"temperature": -1.0}, {"top_p": 0.0}, {"top_p": 1.5}, {"temperature": float("nan")}):
        with pytest.raises(ValueError):
            greedy.eng.submit("conversation", prompt, 8, **bad)


def test_memory_context_is_prepended_and_oldest_left_out(setup):
    model, proc, obs = setup
    r = Recorder(model, proc, decode_k=2, max_new_tokens=2)
    rid = r.eng.submit("conversation", "what?", 2, context=("red cup", "blue box."))
    r.cycle(obs)
    assert r.results[rid].model_prompt == "Earlier you saw: red cup; blue box. what?"
    assert r.results[rid].prompt == "what?"
    # small_cfg: max_token_len 64, one token per character, "User: ...\nAssistant: " + BOS = 19 -> 45 characters
    ctx = ("x" * 30, "old", "newest")
    rid = r.eng.submit("conversation", "now?", 2, context=ctx)
    r.cycle(obs)
    assert r.results[rid].model_prompt == with_context("now?", ctx[1:]) == "Earlier you saw: old; newest. now?"
    m = r.eng.metrics()
    assert m["requests_memory_context_trimmed"] == 1 and m["requests_truncated_prompts"] == 0
    rid = r.eng.submit("conversation", "no memory", 2)
    r.cycle(obs)
    assert r.results[rid].model_prompt == "no memory"
