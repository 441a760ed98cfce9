"""Unit tests of ``ros/control.py``'s chunk switching (pure numpy, no DDS, no model): the ``rtc`` switch (the new
chunk on the snapshot's time origin, rows executed while inferring skipped, the executed stream continuous for any
tick phase and delay), that stop / hold still behave, that ``none`` never blends, the per-step change limit across a
switch, and ``view`` (no side effect).  The executed stream is what a control timer at 1/step_dt publishes: row 0 of
each ``sample``."""
from __future__ import annotations

import numpy as np
import pytest

from oxygen_ros.ros.action_space import ActionSpace
from oxygen_ros.ros.control import ChunkBuffer

DT = 0.1
H = 10


def _ramp(start: float, n: int = H, dims: int = 2) -> np.ndarray:
    """Row i = start + i in every column: consecutive rows differ by exactly 1."""
    return (start + np.arange(n, dtype=np.float32))[:, None].repeat(dims, axis=1)


def _executed(buf: ChunkBuffer, ticks) -> list:
    out = []
    for t in ticks:
        s = buf.sample(t)
        out.append(None if s is None else (float(s.actions[0, 0]), s.chunk_id, s.index, s.held))
    return out


@pytest.mark.parametrize("phase", [0.0, 0.013, 0.05, 0.099])
@pytest.mark.parametrize("delay_rows", [0, 1, 3, 5])
def test_rtc_switch_is_continuous_and_skips_rows_executed_while_inferring(phase, delay_rows):
    """An ideal RTC chunk (rows = the old plan from the snapshot on, then continuing the ramp) must give the robot
    one continuous ramp, whatever the tick phase and however many rows inference took."""
    buf = ChunkBuffer(DT, chunking="rtc")
    t0 = 1.0
    buf.push(_ramp(0.0), chunk_id=1, frame_index=1, capture_time=t0, ready_time=t0)
    ticks = [t0 + phase + i * DT for i in range(60)]
    stream = _executed(buf, ticks[:3])                       # rows 0, 1, 2 of chunk 1
    t_s = ticks[3] - 0.5 * DT * (phase > 0.05)               # snapshot somewhere inside tick 3's slot or before
    snap = buf.snapshot(t_s)
    assert snap is not None and snap.chunk_id == 1
    k_s = snap.index
    np.testing.assert_array_equal(snap.rows, _ramp(0.0)[k_s:])
    assert snap.origin == pytest.approx(t0 + k_s * DT)       # the old chunk's slot start: same time grid
    new = _ramp(float(k_s))                                  # row i = the old plan's row k_s + i, continued
    ready = snap.origin + (delay_rows + 0.4) * DT
    executed_before = [x for x in _executed(buf, [t for t in ticks[3:] if t < ready])]
    info = buf.push(new, chunk_id=2, frame_index=2, capture_time=t_s, ready_time=ready, rtc_origin=snap.origin)
    assert info.rtc and info.index == delay_rows and buf.chunks_rtc == 1
    assert buf.rtc_rows_skipped == delay_rows
    after = _executed(buf, [t for t in ticks[3:] if t >= ready][:4])
    stream += executed_before + after
    vals = [v[0] for v in stream]
    assert vals == [float(i) for i in range(len(vals))], stream          # continuous: no jump, no repeat
    first_new = next(v for v in stream if v[1] == 2)
    assert first_new[2] >= delay_rows                        # the first d rows of the new chunk were never sent
    assert not any(v[3] for v in stream)


def test_rtc_new_row_k_is_due_after_old_rows_on_the_same_grid():
    """With a chunk that differs from the old plan the switch happens exactly at the first tick after ready, and the
    published row is the new chunk's row for that tick's slot (index_at(ready) or later)."""
    buf = ChunkBuffer(DT, chunking="rtc")
    buf.push(np.zeros((H, 1), np.float32), chunk_id=1, frame_index=1, capture_time=0.0, ready_time=0.0)
    snap = buf.snapshot(0.23)
    assert snap.index == 2 and snap.origin == pytest.approx(0.2)
    new = np.arange(H, dtype=np.float32)[:, None] + 100
    buf.push(new, chunk_id=2, frame_index=2, capture_time=0.23, ready_time=0.47, rtc_origin=snap.origin)
    s = buf.sample(0.47)
    assert s.chunk_id == 2 and s.index == 2 and s.actions[0, 0] == 102.0      # slot of 0.47 on origin 0.2
    assert buf.sample(0.51).actions[0, 0] == 103.0


def test_rtc_without_snapshot_starts_like_arrival_and_other_modes_ignore_rtc_origin():
    buf = ChunkBuffer(DT, chunking="rtc")
    assert buf.snapshot(0.0) is None
    info = buf.push(_ramp(0.0), chunk_id=1, frame_index=1, capture_time=0.0, ready_time=0.5, rtc_origin=None)
    assert not info.rtc and info.index == 0 and buf.sample(0.5).index == 0
    for mode in ("blend", "none"):
        b = ChunkBuffer(DT, chunking=mode)
        info = b.push(_ramp(0.0), chunk_id=1, frame_index=1, capture_time=0.0, ready_time=0.5, rtc_origin=0.0)
        assert not info.rtc and b.sample(0.5).index == 0    # origin = arrival, the given origin ignored


@pytest.mark.parametrize("behavior", ["stop", "hold"])
def test_rtc_stop_and_hold(behavior):
    buf = ChunkBuffer(DT, chunking="rtc", stale_behavior=behavior)
    buf.push(_ramp(0.0, 4), chunk_id=1, frame_index=1, capture_time=0.0, ready_time=0.0)
    snap = buf.snapshot(0.15)
    buf.push(_ramp(1.0, 4), chunk_id=2, frame_index=2, capture_time=0.15, ready_time=0.25, rtc_origin=snap.origin)
    assert buf.sample(0.25).actions[0, 0] == 2.0 and buf.sample(0.35).actions[0, 0] == 3.0
    assert buf.sample(0.45).actions[0, 0] == 4.0
    late = buf.sample(0.55)                                  # chunk 2 (origin 0.1) used up
    if behavior == "stop":
        assert late is None
    else:
        assert late.held and late.actions[0, 0] == 4.0 and late.chunk_id == 2
    assert buf.snapshot(0.55) is None                        # nothing left to guide toward


def test_rtc_chunk_expired_on_arrival_is_counted():
    buf = ChunkBuffer(DT, chunking="rtc")
    buf.push(_ramp(0.0), chunk_id=1, frame_index=1, capture_time=0.0, ready_time=0.0)
    snap = buf.snapshot(0.0)
    info = buf.push(_ramp(0.0, 3), chunk_id=2, frame_index=2, capture_time=0.0, ready_time=0.5,
                    rtc_origin=snap.origin)
    assert info.expired and buf.chunks_expired_on_arrival == 1 and buf.rtc_rows_skipped == 3


def test_none_never_blends_and_blend_default_unchanged():
    old, new = np.zeros((H, 1), np.float32), np.ones((H, 1), np.float32)
    b = ChunkBuffer(DT, chunking="none", blend_steps=3)
    b.push(old, chunk_id=1, frame_index=1, capture_time=0.0, ready_time=0.0)
    info = b.push(new, chunk_id=2, frame_index=2, capture_time=0.2, ready_time=0.2)
    assert info.blended_rows == 0 and b.sample(0.2).actions[0, 0] == 1.0 and b.chunks_blended == 0
    b = ChunkBuffer(DT, blend_steps=3)                       # default chunking = blend
    b.push(old, chunk_id=1, frame_index=1, capture_time=0.0, ready_time=0.0)
    info = b.push(new, chunk_id=2, frame_index=2, capture_time=0.2, ready_time=0.2)
    assert info.blended_rows == 3 and b.sample(0.2).actions[0, 0] == pytest.approx(0.25)


def test_step_limit_holds_across_the_switch():
    sp = ActionSpace.build(1, max_step_change=[0.5])
    buf = ChunkBuffer(DT, chunking="none", step_limit=sp.limit_steps)
    buf.push(np.zeros((H, 1), np.float32), chunk_id=1, frame_index=1, capture_time=0.0, ready_time=0.0)
    stream = [buf.sample(0.0 + i * DT + 0.01).actions[0, 0] for i in range(3)]
    info = buf.push(np.full((H, 1), 10.0, np.float32), chunk_id=2, frame_index=2, capture_time=0.3,
                    ready_time=0.3)
    stream += [buf.sample(0.3 + i * DT + 0.01).actions[0, 0] for i in range(H)]
    assert info.step_limited_rows == H and buf.step_limited_rows == H
    # rows 0 and 1 also stay within the limit of the previous plan at the switch time (0): a trajectory consumer
    # sampling between rows 0 and 1 then never steps more than the limit either (test_trajectory_step_limit.py)
    np.testing.assert_allclose(stream, [0, 0, 0, 0.5, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5])
    assert np.all(np.abs(np.diff(stream)) <= 0.5 + 1e-6)


@pytest.mark.parametrize("gap", ["used_up", "clear"])
def test_after_a_gap_the_next_chunk_ramps_from_the_held_end(gap):
    """Issue 28: chunk 1 is used up (no chunk for a while: a stale input, dropped chunks) or the node is deactivated
    and activated (``clear``); the robot holds chunk 1's end (0.0).  Chunk 2 (10.0) ramps from there: the
    action_chunk rows and the trajectory view alike, the first step repeated once (a controller switching at any
    moment of the slot never steps more than the limit); a hold position given with it is not used (the buffer knows
    what it sent)."""
    sp = ActionSpace.build(1, max_step_change=[0.5])
    buf = ChunkBuffer(DT, step_limit=sp.limit_steps)
    buf.push(np.zeros((4, 1), np.float32), chunk_id=1, frame_index=1, capture_time=0.0, ready_time=0.0)
    assert [buf.sample(i * DT + 0.01).actions[0, 0] for i in range(4)] == [0.0] * 4
    assert buf.sample(0.45) is None                          # used up: the consumer holds 0.0
    if gap == "clear":
        buf.clear()
        assert buf.sample(0.5) is None and buf.view(0.5) is None
    info = buf.push(np.full((H, 1), 10.0, np.float32), chunk_id=2, frame_index=2, capture_time=1.0, ready_time=1.0,
                    hold=np.array([7.0]))
    assert info.step_limited_rows == H
    ramp = [0.5, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5]
    np.testing.assert_allclose(buf.view(1.0).rows[:, 0], ramp)
    np.testing.assert_allclose([buf.sample(1.0 + i * DT + 0.01).actions[0, 0] for i in range(H)], ramp)


def test_a_new_buffer_ramps_from_the_robots_position():
    """A node (re)started knows no plan: the first chunk ramps from ``hold`` (the newest joint state in action
    columns); a NaN column (no joint state names it) is free; without ``hold`` the first chunk is not anchored."""
    sp = ActionSpace.build(2, max_step_change=[0.5])
    buf = ChunkBuffer(DT, step_limit=sp.limit_steps)
    buf.push(np.full((4, 2), 3.0, np.float32), chunk_id=1, frame_index=1, capture_time=0.0, ready_time=0.0,
             hold=np.array([1.0, np.nan]))
    np.testing.assert_allclose(buf.view(0.0).rows, [[1.5, 3.0], [1.5, 3.0], [2.0, 3.0], [2.5, 3.0]])


def test_first_chunk_is_not_step_limited():
    sp = ActionSpace.build(1, max_step_change=[0.5])
    buf = ChunkBuffer(DT, step_limit=sp.limit_steps)
    info = buf.push(np.array([[3.0], [3.2], [5.0]], np.float32), chunk_id=1, frame_index=1, capture_time=0.0,
                    ready_time=0.0)
    assert info.step_limited_rows == 1
    assert [buf.sample(i * DT + 0.01).actions[0, 0] for i in range(3)] == pytest.approx([3.0, 3.2, 3.7])


def test_view_has_no_side_effect_and_reports_due_time():
    buf = ChunkBuffer(DT, stale_behavior="hold")
    buf.push(_ramp(0.0, 4), chunk_id=1, frame_index=7, capture_time=0.0, ready_time=1.0, capture_ns=5,
             frame_id="cam")
    assert buf.sample(1.0).actions[0, 0] == 0.0
    v = buf.view(1.25)
    assert v.index == 2 and v.first_due == pytest.approx(1.2) and v.rows[:, 0].tolist() == [2.0, 3.0]
    assert (v.chunk_id, v.frame_index, v.capture_ns, v.frame_id) == (1, 7, 5, "cam")
    assert buf.view(1.5) is None
    held = buf.sample(1.5)
    assert held.held and held.actions[0, 0] == 0.0           # view() did not count as executed


def test_bad_chunking_rejected():
    with pytest.raises(ValueError, match="chunking"):
        ChunkBuffer(DT, chunking="smooth")
