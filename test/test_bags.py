"""Tests of ``oxygen_ros/tools/bags/replay.py``: synthetic bags in both storages (topics, counts, moving content, stamps,
readable back with the ROS 2 types), the CDR restamp helper, and ``oxygen replay`` as a separate process delivering
every message over real DDS at recorded timing with restamped ``header.stamp``, and exiting with status 0 and no
traceback on every signal sequence launch can send it.  No model involved."""
from __future__ import annotations

import signal
import struct
import time

import numpy as np
import pytest

from oxygen_ros.bags import types as bag_types
from oxygen_ros.tools.bags import replay as bags

from conftest import TIMING_GROUP

pytestmark = pytest.mark.xdist_group(TIMING_GROUP)     # node / player / launch processes: one worker


@pytest.mark.parametrize("storage", ["mcap", "sqlite3"])
def test_make_bag_contents(tmp_path, storage):
    out = bags.make_bag(tmp_path / "b", duration=1.0, fps=10.0, width=64, height=48, storage=storage,
                        start_ns=1_700_000_000_000_000_000)
    s = bags.bag_summary(out)
    assert s["topics"]["/camera/base/image_raw"] == ("sensor_msgs/msg/Image", 10)
    assert s["topics"]["/camera/right_wrist/image_raw"][1] == 10
    assert s["topics"]["/joint_states"] == ("sensor_msgs/msg/JointState", 50)
    assert s["topics"]["/instruction"][1] >= 1 and s["topics"]["/conversation/prompt"][1] >= 1
    with pytest.raises(FileExistsError):
        bags.make_bag(out, duration=0.2)

    from rosbags.rosbag2 import Reader
    from oxygen_ros.ros.images import image_to_rgb8_numpy
    ts = bag_types.typestore()
    frames, stamps = [], []
    with Reader(out) as r:
        conns = [c for c in r.connections if c.topic == "/camera/left_wrist/image_raw"]
        for c, t_ns, raw in r.messages(connections=conns):
            m = ts.deserialize_cdr(raw, c.msgtype)
            assert m.encoding == "bgr8" and (m.width, m.height) == (64, 48)
            assert m.header.stamp.sec * 1_000_000_000 + m.header.stamp.nanosec == t_ns
            frames.append(image_to_rgb8_numpy(m))
            stamps.append(t_ns)
    assert stamps[0] == 1_700_000_000_000_000_000 and all(np.diff(stamps) > 0)
    assert not np.array_equal(frames[0], frames[-1])          # moving content
    assert (frames[0][..., 0] > 200).any()                     # the red block is visible (RGB after conversion)


def test_typestore_knows_oxygen_messages():
    ts = bag_types.typestore()
    assert "oxygen_ros/msg/ActionChunk" in ts.types and "oxygen_ros/msg/MemoryEntry" in ts.types


def test_restamp_rewrites_header_in_cdr():
    ts = bag_types.typestore()
    String = ts.types["std_msgs/msg/String"]
    Header = ts.types["std_msgs/msg/Header"]
    Time = ts.types["builtin_interfaces/msg/Time"]
    for little in (True, False):
        raw = bytes(ts.serialize_cdr(Header(stamp=Time(sec=1, nanosec=2), frame_id="cam"), "std_msgs/msg/Header",
                                     little_endian=little))
        out = bags._restamp(raw, 123, 456)
        m = ts.deserialize_cdr(out, "std_msgs/msg/Header")
        assert (m.stamp.sec, m.stamp.nanosec, m.frame_id) == (123, 456, "cam")
    assert ts.deserialize_cdr(ts.serialize_cdr(String(data="x"), "std_msgs/msg/String"), "std_msgs/msg/String").data


def test_replay_process_delivers_at_recorded_timing(ros, tmp_path):
    """A 2 s bag played in full (the counts are the bag's, not those of a wall-clock window), header.stamp
    rewritten to the time of publication, and paced at the recorded 15 fps judged on those stamps - the player's own
    clock, not this receiver's (which lags on a loaded machine): in order, median frame interval within
    [0.6, 1.5] x 1/15 s."""
    from conftest import start_replay, stop_proc
    from sensor_msgs.msg import Image, JointState
    from std_msgs.msg import String

    fps, duration = 15.0, 2.0
    bag = bags.make_bag(tmp_path / "bag", duration=duration, fps=fps, width=224, height=224)
    n_frames, n_joints = int(duration * fps), int(duration * 50)
    imgs = ros.collect(Image, "camera/base/image_raw", qos=50)
    joints = ros.collect(JointState, "joint_states", qos=100)
    prompts = ros.collect(String, "conversation/prompt")
    t_start = ros.now().nanoseconds
    p = start_replay(bag, tmp_path / "replay.log")
    try:
        assert ros.wait_for(lambda: p.poll() is not None, 60), "replay did not finish"
        assert p.returncode == 0, (tmp_path / "replay.log").read_text()
        # every message was published; a few at the very end may die with the exiting player's DDS writer
        assert ros.wait_for(lambda: len(imgs) >= n_frames - 3 and len(joints) >= n_joints - 10 and prompts, 10), \
            (len(imgs), len(joints), len(prompts))
    finally:
        stop_proc(p)
        for c in (imgs, joints, prompts):
            ros.uncollect(c)
    assert len(imgs) <= n_frames and len(joints) <= n_joints
    stamps = np.array([m.header.stamp.sec * 1_000_000_000 + m.header.stamp.nanosec for _, m in imgs])
    assert stamps.min() >= t_start, "replay restamps header.stamp to the time of publication"
    gaps = np.diff(stamps) / 1e9
    assert (gaps > 0).all(), "frames in order"
    assert 0.6 / fps <= float(np.median(gaps)) <= 1.5 / fps, np.median(gaps)     # 40-100 ms
    assert imgs[0][1].width == 224 and len(imgs[0][1].data) == 224 * 224 * 3


SIGNAL_SEQUENCES = [("SIGINT",), ("SIGINT", "SIGINT"), ("SIGTERM",), ("SIGINT", "SIGTERM")]


def test_replay_process_exits_cleanly_on_signals(ros, synthetic_bag, tmp_path):
    """launch stops a player with SIGINT (SIGTERM 5 s later if it is still running); a Ctrl-C under ``ros2 launch``
    reaches it twice (the terminal's and launch's). Each sequence, 50 ms apart, must end in exit 0 within 5 s.
    One replay process per sequence, all at once (each in its own namespace)."""
    from conftest import start_replay, stop_proc
    from sensor_msgs.msg import JointState

    runs = []
    for signals in SIGNAL_SEQUENCES:
        ns = "sig_" + "_".join(signals).lower()
        log = tmp_path / f"{ns}.log"
        runs.append((signals, log, ros.collect(JointState, f"/{ns}/joint_states", qos=100),
                     start_replay(synthetic_bag, log, "--loop", "--wait", "0", "--namespace", ns)))
    results = {}
    try:
        for signals, log, joints, p in runs:
            assert ros.wait_for(lambda: len(joints) > 0, 60), f"replay did not start publishing: {log.read_text()}"
            t = time.monotonic()
            for i, name in enumerate(signals):
                time.sleep(0.05 if i else 0.0)
                p.send_signal(getattr(signal, name))
            rc = p.wait(10)
            results["+".join(signals)] = (rc, round(time.monotonic() - t, 2), "Traceback" in log.read_text())
    finally:
        for _, _, joints, p in runs:
            stop_proc(p)
            ros.uncollect(joints)
    assert all(rc == 0 and took < 5.0 and not tb for rc, took, tb in results.values()), results


def test_replay_rejects_non_bag(tmp_path):
    assert bags.replay_main([str(tmp_path)]) == 2


def test_cdr_header_layout_assumption():
    """The restamp helper relies on header.stamp being the first 8 bytes after the encapsulation header."""
    ts = bag_types.typestore()
    Image = ts.types["sensor_msgs/msg/Image"]
    Header = ts.types["std_msgs/msg/Header"]
    Time = ts.types["builtin_interfaces/msg/Time"]
    raw = bytes(ts.serialize_cdr(Image(header=Header(stamp=Time(sec=7, nanosec=9), frame_id="f"), height=1, width=1,
                                       encoding="mono8", is_bigendian=0, step=1, data=np.zeros(1, np.uint8)),
                                 "sensor_msgs/msg/Image"))
    assert struct.unpack_from("<iI", raw, 4) == (7, 9)
