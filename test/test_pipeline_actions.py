"""The action space and real-time chunking in the node's frame path: the real ``Pipeline`` with the real tiny engine on
a simulated clock (as ``test_pipeline_faults.py``), no DDS.
- ``delta_action_mask``: the chunk that reaches the buffer is the engine's output plus the joint state the cycle's
  Observation carried, in the masked columns only (compared against a second pipeline with the same seed and inputs
  and no mask); no joint state -> the cycle is skipped, counted;
- limits: every published value inside the bounds, clipped rows counted; the step limit counted and obeyed;
- RTC request construction (``_rtc_request``): prev_actions = the buffer's rows from the snapshot on, converted back to
  deltas relative to the NEW state; d from the measured latencies (p90, ceil) or ``rtc_delay_steps``;
- with an engine that takes ``rtc`` (after the model-side branch lands): the frozen rows follow the executed plan and
  the switch jump is smaller than without RTC.
"""
from __future__ import annotations

import inspect
import math

import numpy as np
import pytest

from oxygen_ros.engine.engine import Engine
from oxygen_ros.tools.bags.replay import JOINT_NAMES

from test_pipeline_faults import S, Harness, Joints

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ALOHA_MASK = [1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 0]      # openpi make_bool_mask(6, -1, 6, -1)
STATE = [0.5 + 0.25 * i for i in range(len(JOINT_NAMES))]


def _engine_has_rtc() -> bool:
    return "rtc" in inspect.signature(Engine.cycle).parameters


def _run(h: Harness, n: int, state=STATE, dt: float = 0.1):
    for _ in range(n):
        h.feed(joints=False)
        h.pl.inputs.on_joint_state(Joints(list(JOINT_NAMES), list(state)), h.now)
        assert h.step() == ("ran", 1)
        h.advance(dt)


def test_delta_mask_adds_the_observation_state_to_masked_columns_only():
    plain, delta = Harness(seed=3), Harness(seed=3, delta_action_mask=ALOHA_MASK)
    _run(plain, 2)
    _run(delta, 2)
    m = np.array(ALOHA_MASK, bool)
    for a, b in zip(plain.out.chunks, delta.out.chunks):
        np.testing.assert_allclose(b.actions[:, m], a.actions[:, m] + np.array(STATE, np.float32)[m], atol=1e-5)
        np.testing.assert_array_equal(b.actions[:, ~m], a.actions[:, ~m])
    # and the buffer (what the control loop publishes) holds the absolute chunk
    s = delta.pl.sample(delta.now - int(0.1 * S))
    np.testing.assert_array_equal(s.actions, delta.out.chunks[-1].actions[s.index:])


def test_delta_mask_uses_the_state_of_this_cycle():
    h = Harness(seed=3, delta_action_mask=ALOHA_MASK)
    ref = Harness(seed=3)
    for st in (STATE, [x - 2.0 for x in STATE]):
        _run(h, 1, st)
        _run(ref, 1, st)
    np.testing.assert_allclose(h.out.chunks[1].actions[:, 0], ref.out.chunks[1].actions[:, 0] + STATE[0] - 2.0,
                               atol=1e-5)


def test_delta_without_joint_state_skips_the_cycle():
    h = Harness(delta_action_mask=ALOHA_MASK, state_joint_names=[""], action_joint_names=[""])
    h.feed(joints=False)
    assert h.step() == ("stale", 0) and h.count("cycle_skipped_no_state") == 1


def test_limits_clip_and_count():
    lo, hi = [-0.05] * len(JOINT_NAMES), [0.05] * len(JOINT_NAMES)
    free = Harness(seed=1)
    _run(free, 2)
    h = Harness(seed=1, action_limits_min=lo, action_limits_max=hi)
    _run(h, 2)
    raw = np.concatenate([c.actions for c in free.out.chunks])
    want_rows = int(np.count_nonzero(np.any((raw < -0.05) | (raw > 0.05), axis=1)))
    assert want_rows > 0, "the tiny model's random actions must exceed +-0.05 somewhere for this test"
    for c, r in zip(h.out.chunks, free.out.chunks):
        assert np.all(c.actions >= -0.05) and np.all(c.actions <= 0.05)
        np.testing.assert_array_equal(c.actions, np.clip(r.actions, -0.05, 0.05))
    assert h.count("actions_clipped_rows") == want_rows


def test_step_limit_in_the_pipeline_bounds_the_executed_stream():
    h = Harness(seed=1, action_max_step_change=[0.01])
    stream = []
    for _ in range(3):
        _run(h, 1, dt=0.0)
        for _ in range(4):                    # 4 control ticks per cycle
            stream.append(h.pl.sample(h.now).actions[0].copy())
            h.advance(1.0 / h.settings.control_rate_hz)
    steps = np.abs(np.diff(np.array(stream), axis=0))
    assert np.all(steps <= 0.01 + 1e-6)
    assert h.count("actions_step_limited_rows") > 0


def test_the_first_chunk_ramps_from_the_joint_state_matched_by_name():
    """A new pipeline (node start / restart) anchors its first chunk to the newest joint state, each action column to
    the state joint of the same name (the state is listed in another order here); a column no state joint names is
    not anchored."""
    names = list(JOINT_NAMES)
    state_names = names[::-1][:-1]                         # reversed, and without the first action column
    h = Harness(seed=1, action_max_step_change=[0.01], state_joint_names=state_names)
    pos = [5.0 + i for i in range(len(state_names))]
    h.feed(joints=False)
    h.pl.inputs.on_joint_state(Joints(state_names, pos), h.now)
    assert h.step() == ("ran", 1)
    first = h.out.chunks[-1].view.rows[0]
    want = np.array([pos[state_names.index(n)] if n in state_names else np.nan for n in names])
    assert np.all(np.abs(first[1:] - want[1:]) <= 0.01 + 1e-6), first - want
    assert abs(first[0]) < 1.0                             # column 0: the model's own value (no anchor)


def test_rtc_request_is_the_buffered_plan_relative_to_the_new_state():
    h = Harness(seed=2, chunking="blend", delta_action_mask=ALOHA_MASK)
    _run(h, 1)
    new_state = np.array([x + 1.0 for x in STATE], np.float32)
    t = h.now - int(0.08 * S)                  # 20 ms after the chunk arrived
    req = h.pl._rtc_request(t, new_state)
    snap = h.pl.buffer.snapshot(t / 1e9)
    m = np.array(ALOHA_MASK, bool)
    assert req.prev_actions.shape == (len(snap.rows), len(JOINT_NAMES)) and req.prev_actions.dtype == np.float32
    np.testing.assert_allclose(req.prev_actions[:, m], snap.rows[:, m] - new_state[m], atol=1e-5)
    np.testing.assert_array_equal(req.prev_actions[:, ~m], snap.rows[:, ~m])
    assert req.max_guidance_weight == 10.0
    # no buffered chunk -> n = 0 (no RTC)
    h.pl.buffer.clear()
    assert h.pl._rtc_request(t, new_state).prev_actions.shape == (0, len(JOINT_NAMES))


def test_rtc_delay_estimate_is_p90_in_control_steps():
    h = Harness()
    dt = h.pl.step_dt
    assert h.pl.rtc_delay_steps() == 0                          # nothing measured yet
    h.pl.chunk_delay_s.extend([0.5 * dt] * 8 + [2.2 * dt, 3.5 * dt])
    p90 = float(np.percentile(h.pl.chunk_delay_s, 90))
    assert h.pl.rtc_delay_steps() == math.ceil(p90 / dt - 1e-9) == 3
    h.pl.chunk_delay_s.extend([1000.0] * 50)                    # clipped to H
    assert h.pl.rtc_delay_steps() == h.pl.horizon
    assert Harness(rtc_delay_steps=4).pl.rtc_delay_steps() == 4
    h.pl.chunk_interval_s.extend([4.1 * dt] * 5)
    assert h.pl.rtc_execution_horizon(2) == 5 and h.pl.rtc_execution_horizon(7) == 7


def test_blend_mode_never_passes_rtc():
    """Today's engine raises TypeError on an unknown rtc kwarg: the default mode must not send one."""
    h = Harness()
    _run(h, 2)
    assert h.pl.cycle_errors == 0


@pytest.mark.skipif(not _engine_has_rtc(), reason="the engine's RTC (Engine.cycle(rtc=...)) is not merged yet")
@pytest.mark.parametrize("mode", ["oxygen", "shared", "isolated"])
def test_rtc_in_the_pipeline_joins_chunks(mode):
    """Each new chunk's first d rows follow the plan the robot is executing; the executed stream's switch jumps are
    smaller than without RTC (same seed, same inputs)."""
    jumps = {}
    for chunking in ("none", "rtc"):
        h = Harness(seed=5, chunking=chunking, rtc_delay_steps=2, engine_mode=mode, horizon=10)
        stream, ids = [], []
        for _ in range(4):
            snap = h.pl.buffer.snapshot(h.now / 1e9)
            _run(h, 1, dt=0.0)
            if chunking == "rtc" and snap is not None:
                new = h.out.chunks[-1].actions
                err = float(np.max(np.abs(new[:2] - snap.rows[:2])))
                scale = float(np.max(np.abs(snap.rows))) + 1e-3
                assert err < 0.1 * scale, (err, scale)
            for _ in range(5):
                s = h.pl.sample(h.now)
                stream.append(s.actions[0].copy())
                ids.append(s.chunk_id)
                h.advance(1.0 / h.settings.control_rate_hz)
        a = np.array(stream)
        d = np.linalg.norm(np.diff(a, axis=0), axis=1)
        sw = np.array(ids[1:]) != np.array(ids[:-1])
        jumps[chunking] = float(d[sw].mean())
        if chunking == "rtc":
            assert h.pl.buffer.chunks_rtc == 3
    assert jumps["rtc"] < jumps["none"], jumps
