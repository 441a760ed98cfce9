"""Fault classes of the node's inference path, in-process: the real ``Pipeline`` (``ros/pipeline.py``) with the real
tiny engine, driven on a simulated clock with duck-typed messages (the node's callbacks and ``oxygen bag-eval`` feed
it the same way), so each case is deterministic and needs no DDS.  One class of tests per defect family:
- every structurally valid but unusable frame (1000x2, 2x1000, ...) and every malformed frame, on **each** camera
  slot: a non-primary slot never stops the chunks; nothing bad ever replaces a good frame;
- a frame that fails conversion (injected) masks only its own slot; only the primary slot skips a cycle;
- stale joint state: no new chunks after ``max_state_age_s``, one log line per episode, recovery when states return;
- inputs that go silent are logged without a new frame arriving (``watch``), and when they come back;
- camera clocks ahead of the node: counted, and staleness judged by receive time;
- non-finite chunks: dropped, counted, and the control status goes ERROR after the grace period;
- concurrent faults of different kinds are each logged (throttling is per reason).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import pytest

from oxygen_ros.ros import diagnostics as diag
from oxygen_ros.ros.engine_factory import BuiltEngine, build_engine
from oxygen_ros.ros.parameters import Settings, load_params_file
from oxygen_ros.ros.pipeline import Pipeline
from oxygen_ros.tools.bags.replay import JOINT_NAMES

from conftest import CONFIG

pytestmark = pytest.mark.usefixtures("one_torch_thread")

S = 1_000_000_000          # ns per second
SLOTS = (0, 1, 2)


@dataclass
class Stamp:
    sec: int = 0
    nanosec: int = 0


@dataclass
class Header:
    stamp: Stamp = field(default_factory=Stamp)
    frame_id: str = ""


@dataclass
class Img:
    height: int
    width: int
    encoding: str
    step: int
    data: bytes
    is_bigendian: int = 0
    header: Header = field(default_factory=Header)


@dataclass
class Joints:
    name: list
    position: list


def image(h=48, w=64, t_ns=0, frame_id="camera_base", encoding="rgb8", step=None, data=None):
    px = (np.arange(h * w * 3) % 251).astype(np.uint8).tobytes()
    return Img(h, w, encoding, w * 3 if step is None else step, px if data is None else data,
               header=Header(Stamp(t_ns // S, t_ns % S), frame_id))


BAD_FRAMES = {      # kind -> (message builder, rejection reason)
    "strip_1000x2": (lambda t: image(1000, 2, t), "image_aspect"),
    "strip_2x1000": (lambda t: image(2, 1000, t), "image_aspect"),
    "sliver_3x500": (lambda t: image(3, 500, t), "image_aspect"),
    "encoding": (lambda t: image(t_ns=t, encoding="yuv422"), "image_encoding"),
    "truncated": (lambda t: image(t_ns=t, data=b"\0" * 100), "image_truncated"),
    "step": (lambda t: image(t_ns=t, step=5), "image_step"),
    "zero_size": (lambda t: Img(0, 0, "rgb8", 0, b"", header=Header(Stamp(t // S, t % S))), "image_size"),
}


class Recorder:
    """The pipeline's Outputs: keeps every record."""

    def __init__(self):
        self.tokens, self.responses, self.memory, self.chunks = [], [], [], []

    def token(self, t):
        self.tokens.append(t)

    def response(self, r):
        self.responses.append(r)

    def memory(self, m):
        self.memory.append(m)

    def chunk(self, c):
        self.chunks.append(c)


class LogCapture(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[tuple[str, str]] = []

    def emit(self, record):
        self.lines.append((record.levelname, record.getMessage()))

    def count(self, text):
        return sum(text in m for _, m in self.lines)


class Harness:
    def __init__(self, engine_factory=build_engine, **overrides):
        params = {**load_params_file(CONFIG), "device": "cpu", "compile": "none", "memory_db": "",
                  "memory_interval_s": 0.0, "horizon": 10, "max_new_tokens": 4, **overrides}
        self.settings = Settings.from_values(params)
        self.now = 1000 * S
        self.out = Recorder()
        self.log = LogCapture()
        logger = logging.getLogger(f"pipeline_test_{id(self)}")
        logger.propagate = False
        logger.setLevel(logging.INFO)
        logger.addHandler(self.log)
        self.pl = Pipeline(self.settings, self.out, clock_ns=lambda: self.now, logger=logger,
                           engine_factory=engine_factory)
        self.pl.reset_io()

    def advance(self, seconds):
        self.now += int(seconds * S)

    def feed(self, slots=SLOTS, joints=True):
        for s in slots:
            self.pl.inputs.on_image(s, image(t_ns=self.now, frame_id=f"cam{s}"), self.now)
        if joints:
            self.pl.inputs.on_joint_state(Joints(list(JOINT_NAMES), [0.1] * len(JOINT_NAMES)), self.now)

    def step(self):
        n = len(self.out.chunks)
        r = self.pl.step(self.now)
        return r, len(self.out.chunks) - n

    def count(self, key):
        return self.pl.counters.get(key)


@pytest.fixture
def h():
    return Harness()


def test_good_inputs_make_a_chunk_per_cycle(h):
    for _ in range(3):
        h.feed()
        assert h.step() == ("ran", 1)
        h.advance(0.05)
    c = h.out.chunks[-1]
    assert c.actions.shape == (10, len(JOINT_NAMES)) and np.all(np.isfinite(c.actions))
    assert c.frame_id == "cam0" and c.capture_ns == h.now - int(0.05 * S)


@pytest.mark.parametrize("slot", SLOTS)
@pytest.mark.parametrize("kind", list(BAD_FRAMES))
def test_a_bad_frame_on_any_slot_never_stops_the_actions(h, slot, kind):
    build, reason = BAD_FRAMES[kind]
    h.feed()
    assert h.step() == ("ran", 1)
    for _ in range(3):                     # the bad frame keeps coming on one slot, good frames on the others
        h.advance(0.05)
        h.feed(slots=[s for s in SLOTS if s != slot])
        assert not h.pl.inputs.on_image(slot, build(h.now), h.now)
        result, chunks = h.step()
        if slot == 0:
            # the primary's last good frame is still used while it is fresh: never a crash, never the bad frame
            assert (result, chunks) == ("ran", 1)
        else:
            assert (result, chunks) == ("ran", 1), "a bad non-primary frame stopped the actions"
    assert h.count(f"rejected.{reason}") == 3
    assert h.count("cycle_errors") == 0
    assert h.log.count(f"rejected input ({reason})") == 1, "logged once per reason per throttle period"


@pytest.mark.parametrize("slot", SLOTS)
def test_a_frame_that_fails_conversion_masks_only_its_slot(slot):
    h = Harness(debug_fault_injection=True)
    h.feed()
    h.pl.inject(f"image_exception:{slot}")
    result, chunks = h.step()
    assert h.count(f"camera_failed.{['base', 'left_wrist', 'right_wrist'][slot]}") == 1
    if slot == 0:
        assert (result, chunks) == ("error", 0) and h.count("cycle_skipped_primary_image") == 1
    else:
        assert (result, chunks) == ("ran", 1)
    h.advance(0.05)
    h.feed()
    assert h.step() == ("ran", 1), "the next cycle is normal again"
    assert h.count("cycle_errors") == 0


def test_stale_joint_state_stops_new_chunks_and_recovers(h):
    h.feed()
    assert h.step() == ("ran", 1)
    limit = h.settings.state_age_limit_s
    h.advance(limit + 0.1)
    h.feed(joints=False)                   # cameras go on, joint_states stopped
    assert h.step() == ("stale", 0)
    h.advance(0.1)
    h.feed(joints=False)
    assert h.step() == ("stale", 0)
    assert h.count("cycle_skipped_state_stale") == 2 and h.count("state_silent") == 1
    assert h.log.count("joint_states: newest is") == 1
    h.advance(0.1)
    h.feed()                               # states return
    assert h.step() == ("ran", 1)
    assert h.log.count("joint_states: receiving again") == 1


def test_max_state_age_s_overrides_the_camera_limit():
    h = Harness(max_state_age_s=2.0)
    h.feed()
    assert h.step() == ("ran", 1)
    h.advance(1.0)                         # > max_observation_age_s (0.5) but < max_state_age_s
    h.feed(joints=False)
    assert h.step() == ("ran", 1)
    h.advance(1.5)
    h.feed(joints=False)
    assert h.step() == ("stale", 0)


def test_no_joint_state_at_all_when_state_joints_are_configured(h):
    h.advance(1.0)
    h.feed(joints=False)
    assert h.step() == ("stale", 0)
    assert h.count("cycle_skipped_state_stale") == 1
    # without state_joint_names the policy runs without a state (counted as state_missing)
    h2 = Harness(state_joint_names=[""])
    h2.feed(joints=False)
    assert h2.step() == ("ran", 1) and h2.count("state_missing") == 1


def test_silent_inputs_are_logged_without_a_new_frame(h):
    h.feed()
    assert h.step() == ("ran", 1)
    for _ in range(20):                    # 2 s without any message: the node's idle loop calls watch()
        h.advance(0.1)
        h.pl.watch(h.now)
    assert h.log.count("camera 'camera/base/image_raw': newest is") == 1
    assert h.log.count("joint_states: newest is") == 1
    assert h.count("camera_silent.base") == 1
    h.advance(4.0)
    h.pl.watch(h.now)                      # reminder after repeat_s (5 s)
    assert h.log.count("camera 'camera/base/image_raw': newest is") == 2
    h.feed()
    h.pl.watch(h.now)
    assert h.log.count("camera 'camera/base/image_raw': receiving again") == 1


def test_a_silent_wrist_camera_is_masked_and_the_actions_go_on(h):
    h.feed()
    assert h.step() == ("ran", 1)
    for _ in range(10):
        h.advance(0.1)
        h.feed(slots=[0, 2])
        assert h.step() == ("ran", 1)
    assert h.count("camera_silent.left_wrist") == 1
    assert h.log.count("camera 'camera/left_wrist/image_raw': newest is") == 1


def test_future_header_stamps_are_counted_and_age_is_judged_by_receive_time(h):
    ahead = 4.9
    for s in SLOTS:
        h.pl.inputs.on_image(s, image(t_ns=h.now + int(ahead * S)), h.now)
    h.pl.inputs.on_joint_state(Joints(list(JOINT_NAMES), [0.0] * len(JOINT_NAMES)), h.now)
    assert h.step() == ("ran", 1)
    assert h.count("future_stamps") == 3 and h.pl.inputs.future_max_s == pytest.approx(ahead)
    assert h.log.count("check clock sync") == 1
    frame = h.pl.inputs.newest_primary()
    assert frame.capture_ns == h.now + int(ahead * S), "outputs keep the camera's stamp"
    h.advance(h.settings.max_observation_age_s + 0.1)
    assert h.step()[0] == "stale", "a frame stamped in the future must still go stale by its receive time"


class NanEngine:
    def __init__(self, on_actions):
        self.on_actions = on_actions

    def submit(self, kind, prompt="", max_new_tokens=None):
        return None

    def cycle(self, obs):
        from oxygen_ros.engine.requests import ActionResult
        self.on_actions(ActionResult(0, 0, obs.stamp, np.full((4, 3), np.nan, np.float32), 1.0))
        return {}

    def metrics(self):
        return {}


def test_non_finite_chunks_are_dropped_counted_and_reported():
    h = Harness(engine_factory=lambda s, on_actions, **_: BuiltEngine(NanEngine(on_actions), "nan", 3, 4, 32),
                state_joint_names=[""], action_joint_names=[""])
    for _ in range(3):
        h.feed()
        assert h.step() == ("ran", 0)
        h.advance(0.1)
    assert h.count("chunk_invalid") == 3 and h.pl.sample(h.now) is None
    counters = h.pl.counters.snapshot()
    base = {"state": "active", "control_rate_hz": 70.0, "control_rate_measured_hz": 0.0, "observation_age_s": 0.01,
            "max_observation_age_s": 0.5, "counters": counters, "counters_delta": {"chunk_invalid": 3}}
    st = {x.name: x for x in diag.build_statuses({**base, "no_chunk_s": 12.0, "active_s": 30.0})}
    assert st["oxygen_node: control"].level == diag.ERROR and "no valid action chunk" in st["oxygen_node: control"].message
    assert st["oxygen_node: inference"].level == diag.WARN and "invalid" in st["oxygen_node: inference"].message
    st = {x.name: x for x in diag.build_statuses({**base, "no_chunk_s": 3.0, "active_s": 30.0})}
    assert st["oxygen_node: control"].level == diag.WARN, "within the grace period: only the low rate"


def test_reporter_throttles_per_reason_not_globally():
    cap = LogCapture()
    logger = logging.getLogger("reporter_test")
    logger.propagate = False
    logger.addHandler(cap)
    t = [0.0]
    r = diag.Reporter(diag.Counters(), logger, period_s=2.0, clock=lambda: t[0])
    for _ in range(5):
        r.reject("image_aspect", "a")
        r.reject("joint_nonfinite", "b")
    assert cap.count("(image_aspect)") == 1 and cap.count("(joint_nonfinite)") == 1
    assert r.counters.get("rejected.image_aspect") == 5
    t[0] = 2.5
    r.reject("image_aspect", "a")
    assert cap.count("(image_aspect)") == 2 and cap.count("+4 more") == 1


def test_a_simulated_clock_that_starts_late_is_not_reported_as_silence():
    """With use_sim_time the node's clock reads 0 until /clock arrives, then jumps to bag time: the start-up grace
    counts from the first real time, and no input is reported as silent (or as back after 1e9 s)."""
    h = Harness()
    h.now = 0
    h.pl.reset_io()
    h.pl.watch(0)
    h.now = 1_700_000_000 * S                 # /clock starts: bag time
    h.pl.watch(h.now)
    h.advance(0.1)
    h.feed()
    assert h.step() == ("ran", 1)
    assert not [m for _, m in h.log.lines if "no message yet" in m or "receiving again" in m], h.log.lines
