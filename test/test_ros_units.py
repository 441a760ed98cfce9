"""Fast unit tests of the ROS layer's pure parts: image conversion (numpy path, and equivalence with the ROS 2
cv_bridge where installed), the control chunk buffer (remainder indexing, blending, stop, and hold = the last
*executed* action, also when the chunk was replaced or its last rows were never sampled), the SQLite memory store
(one committed row per entry, ids continue across reopen) and the diagnostics levels.  No DDS, no model."""
from __future__ import annotations

import os
import sqlite3
import subprocess
import sys

import numpy as np
import pytest

from oxygen_ros.ros import images
from oxygen_ros.ros.control import ChunkBuffer
from oxygen_ros.ros.diagnostics import ERROR, OK, WARN, Counters, RateMeter, build_statuses
from oxygen_ros.ros.images import ENCODINGS, ImageError, image_to_rgb8, image_to_rgb8_numpy, rgb_to_image
from oxygen_ros.ros.memory_store import MemoryStore


class FakeImage:
    """Duck-typed sensor_msgs/Image (the converter needs only these fields)."""

    def __init__(self, **kw):
        self.height = kw.get("height", 0)
        self.width = kw.get("width", 0)
        self.encoding = kw.get("encoding", "rgb8")
        self.is_bigendian = kw.get("is_bigendian", 0)
        self.step = kw.get("step", 0)
        self.data = kw.get("data", b"")


def _img(rgb, enc, **kw):
    return rgb_to_image(rgb, enc, msg=FakeImage(), **kw)


@pytest.fixture(scope="module")
def rgb():
    rng = np.random.default_rng(0)
    return rng.integers(0, 256, size=(7, 5, 3), dtype=np.uint8)


# -- images --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("enc", ["rgb8", "bgr8", "rgba8", "bgra8", "8UC3", "8UC4", "rgb16", "bgr16", "rgba16",
                                 "bgra16", "16UC3", "16UC4"])
@pytest.mark.parametrize("pad", [0, 3, 4])
@pytest.mark.parametrize("big", [False, True])
def test_color_roundtrip_exact(rgb, enc, pad, big):
    msg = _img(rgb, enc, row_padding=pad, bigendian=big)
    if pad % ENCODINGS[enc].itemsize:     # OpenCV also requires step to be a multiple of the sample size
        with pytest.raises(ImageError, match="multiple"):
            image_to_rgb8_numpy(msg)
        return
    assert msg.step == rgb.shape[1] * ENCODINGS[enc].channels * ENCODINGS[enc].itemsize + pad
    out = image_to_rgb8_numpy(msg)
    assert out.dtype == np.uint8 and out.shape == rgb.shape and out.flags["C_CONTIGUOUS"]
    np.testing.assert_array_equal(out, rgb)


@pytest.mark.parametrize("enc", ["mono8", "mono16", "8UC1", "16UC1"])
def test_mono_replicates_luma(rgb, enc):
    out = image_to_rgb8_numpy(_img(rgb, enc, row_padding=2, bigendian=True))
    y = np.clip(np.rint(rgb[..., 0] * 0.299 + rgb[..., 1] * 0.587 + rgb[..., 2] * 0.114), 0, 255).astype(np.uint8)
    for c in range(3):
        np.testing.assert_array_equal(out[..., c], y)


def test_16bit_scaling_rounds_like_opencv():
    data = np.array([[0, 1, 128, 129, 257, 65535]], dtype="<u2")
    msg = FakeImage(height=1, width=6, encoding="mono16", step=12, data=data.tobytes())
    out = image_to_rgb8_numpy(msg)[0, :, 0]
    np.testing.assert_array_equal(out, np.clip(np.rint(data[0] * 255.0 / 65535.0), 0, 255).astype(np.uint8))


@pytest.mark.parametrize("kw,reason", [
    (dict(height=2, width=2, encoding="yuv422", step=4, data=b"\0" * 8), "encoding"),
    (dict(height=2, width=2, encoding="bayer_rggb8", step=2, data=b"\0" * 4), "encoding"),
    (dict(height=0, width=2, encoding="rgb8", step=6, data=b""), "size"),
    (dict(height=2, width=0, encoding="rgb8", step=0, data=b""), "size"),
    (dict(height=2, width=2, encoding="rgb8", step=5, data=b"\0" * 10), "step"),
    (dict(height=2, width=2, encoding="mono16", step=5, data=b"\0" * 10), "step"),
    (dict(height=2, width=2, encoding="rgb8", step=6, data=b"\0" * 11), "truncated"),
    (dict(height=2, width=2, encoding="rgb8", step=6, data=b"\0" * 13), "size"),
    (dict(height=100000, width=2, encoding="rgb8", step=6, data=b""), "size"),
])
def test_bad_images_have_reasons(kw, reason):
    with pytest.raises(ImageError) as ei:
        image_to_rgb8(FakeImage(**kw))
    assert ei.value.reason == reason
    assert str(ei.value)


def test_real_sensor_msgs_image_roundtrip(rgb):
    pytest.importorskip("sensor_msgs.msg", reason="sensor_msgs (ROS 2) not importable")
    msg = rgb_to_image(rgb, "bgr8", row_padding=4)
    assert type(msg).__name__ == "Image"
    np.testing.assert_array_equal(image_to_rgb8(msg), rgb)


def test_cv_bridge_equivalence(rgb):
    if not images.have_cv_bridge():
        pytest.skip("ROS 2 cv_bridge not installed here (PyPI cv-bridge is ROS 1 code and is never used); "
                    "only the numpy path is tested")
    for enc in sorted(images._CV_BRIDGE_ENCODINGS):
        for pad in (0, 4):
            msg = rgb_to_image(rgb, enc, row_padding=pad)
            np.testing.assert_array_equal(image_to_rgb8(msg, use_cv_bridge=True),
                                          image_to_rgb8(msg, use_cv_bridge=False), err_msg=enc)


# -- control buffer -------------------------------------------------------------------------------------------------
def _chunk(h=10, a=2, base=0.0):
    return (base + np.arange(h * a, dtype=np.float32)).reshape(h, a)


def test_remainder_indexed_by_elapsed_time():
    buf = ChunkBuffer(0.1)
    assert buf.sample(0.0) is None
    buf.push(_chunk(), chunk_id=1, frame_index=3, capture_time=0.5, ready_time=1.0, latency_ms=500)
    s = buf.sample(1.0)
    assert s.index == 0 and s.actions.shape == (10, 2) and s.chunk_id == 1 and s.frame_index == 3
    assert s.capture_time == 0.5 and not s.held and not s.blended
    s = buf.sample(1.35)
    assert s.index == 3 and s.actions.shape == (7, 2)
    np.testing.assert_array_equal(s.actions[0], _chunk()[3])
    assert buf.sample(2.0) is None          # used up, stop
    assert buf.remaining(2.0) == 0
    assert buf.observation_age(2.0) == pytest.approx(1.5)


def test_capture_time_origin_skips_latency_rows():
    buf = ChunkBuffer(0.1, time_origin="capture")
    buf.push(_chunk(), chunk_id=1, frame_index=0, capture_time=0.0, ready_time=0.25)
    assert buf.sample(0.25).index == 2
    buf.push(_chunk(), chunk_id=2, frame_index=1, capture_time=1.0, ready_time=2.5)  # expired on arrival
    assert buf.chunks_expired_on_arrival == 1
    assert buf.sample(2.5) is None


def test_hold_repeats_last_action():
    buf = ChunkBuffer(0.1, stale_behavior="hold")
    buf.push(_chunk(), chunk_id=1, frame_index=0, capture_time=0.0, ready_time=0.0)
    last = buf.sample(0.95)
    assert last.index == 9
    s = buf.sample(5.0)
    assert s.held and s.actions.shape == (1, 2)
    np.testing.assert_array_equal(s.actions[0], last.actions[0])


@pytest.mark.parametrize("case", ["ticks_skip_the_last_rows", "replaced_then_used_up_unsampled",
                                  "replaced_by_a_chunk_expired_on_arrival"])
def test_hold_repeats_the_last_executed_action_not_the_chunks_last_row(case):
    """hold repeats the action the robot last executed: when ticks skip the chunk's last rows, or the chunk is
    replaced before its last row was ever sampled, that is neither the chunk's nor the replacement's last row."""
    origin = "capture" if case == "replaced_by_a_chunk_expired_on_arrival" else "arrival"
    buf = ChunkBuffer(0.1, stale_behavior="hold", time_origin=origin)
    a, b = _chunk(base=0.0), _chunk(base=1000.0)
    buf.push(a, chunk_id=1, frame_index=0, capture_time=0.0, ready_time=0.0)
    executed = buf.sample(0.35)
    assert executed.index == 3 and not executed.held
    if case == "replaced_then_used_up_unsampled":
        buf.push(b, chunk_id=2, frame_index=1, capture_time=0.3, ready_time=0.4)     # b's rows: 0.4 .. 1.3 s
    elif case == "replaced_by_a_chunk_expired_on_arrival":
        buf.push(b, chunk_id=2, frame_index=1, capture_time=0.3, ready_time=1.5)     # b's rows ended at 1.3 s
        assert buf.chunks_expired_on_arrival == 1
    s = buf.sample(5.0)
    assert s.held and s.actions.shape == (1, 2)
    np.testing.assert_array_equal(s.actions[0], a[3])
    assert not np.array_equal(s.actions[0], a[-1]) and not np.array_equal(s.actions[0], b[-1])
    np.testing.assert_array_equal(buf.sample(6.0).actions[0], a[3])                  # and keeps holding it


def test_blend_crossfades_old_remainder():
    buf = ChunkBuffer(0.1, blend_steps=3)
    old = _chunk(base=0.0)
    new = _chunk(base=1000.0)
    buf.push(old, chunk_id=1, frame_index=0, capture_time=0.0, ready_time=0.0)
    buf.push(new, chunk_id=2, frame_index=1, capture_time=0.3, ready_time=0.4)   # old at row 4 now
    s = buf.sample(0.4)
    assert s.chunk_id == 2 and s.blended and s.index == 0
    w = np.array([1, 2, 3], np.float32)[:, None] / 4
    np.testing.assert_allclose(s.actions[:3], (1 - w) * old[4:7] + w * new[:3], rtol=1e-6)
    np.testing.assert_array_equal(s.actions[3:], new[3:])
    assert not buf.sample(0.75).blended       # past the overlap window
    assert buf.chunks_blended == 1


def test_buffer_rejects_bad_arguments():
    with pytest.raises(ValueError):
        ChunkBuffer(0.0)
    with pytest.raises(ValueError):
        ChunkBuffer(0.1, stale_behavior="freeze")
    with pytest.raises(ValueError):
        ChunkBuffer(0.1).push(np.zeros((0, 2)), chunk_id=0, frame_index=0, capture_time=0, ready_time=0)


# -- memory store ---------------------------------------------------------------------------------------------------
def test_memory_store_commits_each_row_and_ids_continue(tmp_path):
    path = tmp_path / "sub" / "memory.db"
    with MemoryStore(str(path)) as st:
        a = st.add(text="a red block", source_prompt="describe", frame_index=1, request_id=7, num_tokens=3,
                   stamp_sec=10, stamp_nanosec=5)
        # Visible to another connection immediately (committed), without closing.
        other = sqlite3.connect(str(path))
        assert other.execute("SELECT text FROM memory_entries WHERE entry_id=?", (a,)).fetchone()[0] == "a red block"
        other.close()
        b = st.add(text="b", source_prompt="describe", frame_index=2, request_id=8, num_tokens=1)
        assert b == a + 1
    with MemoryStore(str(path)) as st:
        assert st.count() == 2 and st.last_id() == b
        c = st.add(text="c", source_prompt="p", frame_index=3, request_id=9, num_tokens=1)
        assert c == b + 1
        assert [e.text for e in st.recent(2)] == ["b", "c"]
        assert st.get(a).stamp_sec == 10 and st.get(a).stamp_nanosec == 5


def test_memory_store_survives_killed_writer(tmp_path):
    path = tmp_path / "m.db"
    code = ("import os,sys; sys.path.insert(0, %r); from oxygen_ros.ros.memory_store import MemoryStore;"
            "s=MemoryStore(%r); s.add(text='x', source_prompt='p', frame_index=0, request_id=0, num_tokens=1);"
            "os._exit(9)" % (os.getcwd(), str(path)))
    subprocess.run([sys.executable, "-c", code], check=False, timeout=60)
    with MemoryStore(str(path)) as st:
        assert st.count() == 1 and st.recent(1)[0].text == "x"


# -- diagnostics ----------------------------------------------------------------------------------------------------
def test_diagnostic_levels():
    base = dict(state="active", control_rate_hz=70.0, control_rate_measured_hz=69.0, observation_age_s=0.1,
                max_observation_age_s=1.0, counters={}, counters_delta={})
    st = {s.name: s for s in build_statuses(base)}
    assert all(s.level == OK for s in st.values())
    st = {s.name: s for s in build_statuses({**base, "stale": True, "observation_age_s": 3.0})}
    assert st["oxygen_node: control"].level == ERROR
    st = {s.name: s for s in build_statuses({**base, "control_rate_measured_hz": 30.0})}
    assert st["oxygen_node: control"].level == WARN
    st = {s.name: s for s in build_statuses({**base, "counters": {"rejected.image_encoding": 2},
                                             "counters_delta": {"rejected.image_encoding": 1}})}
    assert st["oxygen_node: inputs"].level == WARN
    assert st["oxygen_node: inputs"].values["rejected.image_encoding"] == 2
    st = {s.name: s for s in build_statuses({"state": "unconfigured", "configure_error": "no such file"})}
    assert st["oxygen_node: inference"].level == ERROR and "no such file" in st["oxygen_node: inference"].message


def test_rate_meter_and_counters():
    m = RateMeter(window_s=1.0)
    for i in range(10):
        m.tick(now=100.0 + i * 0.1)
    assert m.rate(now=100.95) == pytest.approx(10.0)
    assert m.rate(now=105.0) == 0.0
    c = Counters()
    c.inc("a")
    c.inc("a", 2)
    assert c.delta() == {"a": 3} and c.delta() == {"a": 0} and c.get("a") == 3


def test_diagnostics_to_msg():
    pytest.importorskip("diagnostic_msgs.msg", reason="diagnostic_msgs (ROS 2) not importable")
    from oxygen_ros.ros.diagnostics import to_msg
    arr = to_msg(build_statuses({"state": "active", "counters": {"rejected.x": 1}}))
    assert len(arr.status) == 4 and {kv.key for kv in arr.status[3].values} >= {"rejected.x", "rejected_total"}
