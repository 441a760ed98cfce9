"""Bag-replay regression testing: ``oxygen bag-eval`` (the node's Pipeline on bag time), ``oxygen bag-diff`` and
``oxygen replay --record``.

The golden test re-evaluates the committed input bag with the tiny preset and requires no difference from the
committed golden output beyond ``bag_golden.ATOL`` (any change of model, processing or engine numerics, scheduling
or message content shows up; ``test/bag_golden.py`` regenerates the golden when a change is intended).  Also:
two runs give byte-identical bags; a changed parameter is reported as different (actions only, first frame);
the outputs follow the node's semantics on bag time (one chunk per cycle stamped with its frame, complete token
streams, memory entries of the right frames); topic names resolve with namespace and remaps like the node's;
bag-diff's exit status and report on hand-made differences; and an online recording over DDS has the same layout
and can be diffed against the offline run."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import bag_golden
from conftest import REPO, NodeProcess, require_ros

require_ros()

from oxygen_ros.tools.bags import diff as bag_diff, eval as bag_eval  # noqa: E402
from oxygen_ros.tools.bags.output import OUTPUTS, OutputBag, bag_files  # noqa: E402
from oxygen_ros.tools.bags.topic_names import TopicNames, expand  # noqa: E402

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.filterwarnings("ignore:action prompt has:UserWarning")]   # tiny preset, 14 joints


def _eval(out: Path, *extra: str) -> dict:
    rc, summary = bag_eval.run_command(bag_golden.eval_args(out, *extra))
    assert rc == 0
    return summary


def _diff(a, b, *extra) -> tuple[int, str]:
    import contextlib
    import io
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = bag_diff.main([str(a), str(b), "--atol", str(bag_golden.ATOL), *map(str, extra)])
    return rc, buf.getvalue()


@pytest.fixture(scope="module")
def run1(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("run1") / "eval"
    return out, _eval(out)


# ------------------------------------------------------------------------------------------------ units
def test_topic_names_resolve_like_the_node():
    assert expand("camera/base/image_raw") == "/camera/base/image_raw"
    assert expand("joint_states", "/robot1") == "/robot1/joint_states"
    assert expand("/abs/topic", "/robot1") == "/abs/topic"
    n = TopicNames("/", ["__ns:=/robot1", "camera/base/image_raw:=/cam0/image",
                         "/robot1/joint_states:=arm/joints", "other_node:instruction:=/nope",
                         "oxygen_node:conversation/prompt:=/ask"])
    assert n.resolve("camera/base/image_raw") == "/cam0/image"
    assert n.resolve("joint_states") == "/robot1/arm/joints"       # rule matched by its expanded name
    assert n.resolve("instruction") == "/robot1/instruction"       # a rule for another node does not apply
    assert n.resolve("conversation/prompt") == "/ask"
    assert n.resolve("action_chunk") == "/robot1/action_chunk"
    with pytest.raises(ValueError):
        TopicNames("/", ["no_separator"])
    with pytest.raises(ValueError):
        expand("~/private")


def test_inference_schedule_follows_the_node_rule():
    ms = 1_000_000
    s = bag_eval.InferenceSchedule(rate_hz=10.0)           # 100 ms between cycle starts
    s.on_primary(0)
    assert s.due_before(0) is None                         # messages of the same instant are delivered first
    assert s.due_before(1) == 0
    s.on_primary(30 * ms)                                  # too early: the cycle waits for the period...
    s.on_primary(60 * ms)                                  # ...and takes the newest frame then
    assert s.due_before(99 * ms) is None
    assert s.due_before(101 * ms) == 100 * ms
    assert s.due_before(300 * ms) is None                  # no new frame, no cycle
    s.on_primary(350 * ms)
    assert s.flush() == 350 * ms and s.flush() is None
    e = bag_eval.InferenceSchedule(rate_hz=10.0, every_frame=True)
    for t in (0, 30, 60):
        e.on_primary(t * ms)
        assert e.due_before(t * ms + 1) == t * ms


def test_eval_settings_are_the_nodes_with_reproducibility_rules():
    s, notes = bag_eval.settings_for_eval(str(bag_golden.CONFIG), {"decode_k": 3})
    assert s.decode_k == 3 and s.memory_db == "" and notes          # shipped memory_db is replaced, and said so
    assert s.state_joint_names == bag_eval.load_params_file(bag_golden.CONFIG)["state_joint_names"]
    with pytest.raises(bag_eval.ConfigureError, match="adaptive_k"):
        bag_eval.settings_for_eval(str(bag_golden.CONFIG), {"adaptive_k": True})
    with pytest.raises(bag_eval.ConfigureError, match="decode_k"):  # the node's own validation
        bag_eval.settings_for_eval(str(bag_golden.CONFIG), {"decode_k": 0})


# ------------------------------------------------------------------------------------------------ golden + determinism
def test_golden_bag_reproduced(run1, tmp_path):
    out, summary = run1
    rc, report = _diff(bag_golden.GOLDEN, out, "--plot", tmp_path / "golden.png", "--json", tmp_path / "d.json")
    assert rc == 0, report + "\n(if this change of outputs is intended: python test/bag_golden.py)"
    assert "result: SAME (4 of 4 topics agree)" in report
    res = json.loads((tmp_path / "d.json").read_text())
    assert res["same"] and {t["topic"] for t in res["topics"]} == {"/" + o for o in OUTPUTS}
    assert (tmp_path / "golden.png").stat().st_size > 5_000
    golden = json.loads((bag_golden.GOLDEN / "summary.json").read_text())
    for k in ("cycles", "chunks", "tokens", "answers", "memory_entries", "requests", "parameters"):
        assert summary[k] == golden[k], k


def test_two_runs_are_bit_identical(run1, tmp_path):
    out1, _ = run1
    out2 = tmp_path / "eval"                    # same directory name: rosbag2 stores it inside the files
    _eval(out2)
    f1, f2 = bag_files(out1), bag_files(out2)
    assert [f.name for f in f1] == [f.name for f in f2] and len(f1) == 2
    for a, b in zip(f1, f2):
        assert a.read_bytes() == b.read_bytes(), a.name


def test_changed_parameter_is_reported(run1, tmp_path):
    """Fewer denoising steps change every chunk from the first frame on and nothing in the language outputs."""
    out1, _ = run1
    out2 = tmp_path / "eval"
    _eval(out2, "-p", "denoise_steps:=5")
    rc, report = _diff(out1, out2, "--plot", tmp_path / "changed.png", "--json", tmp_path / "d.json")
    assert rc == 1, report
    res = {t["topic"]: t for t in json.loads((tmp_path / "d.json").read_text())["topics"]}
    act = res["/action_chunk"]
    assert not act["ok"] and act["stats"]["first_frame_beyond_tolerance"] == "0"
    assert act["stats"]["chunks_beyond_tolerance"] == act["matched"] == 30
    assert act["stats"]["max"] > 100 * bag_golden.ATOL
    assert set(act["stats"]["per_joint"]) == set(bag_eval.load_params_file(bag_golden.CONFIG)["action_joint_names"])
    assert res["/language/tokens"]["ok"] and res["/memory/entries"]["ok"] and res["/conversation/response"]["ok"]
    assert "/action_chunk: DIFFERENT" in report and "first at frame 0" in report and "per joint max/p95" in report
    assert "result: DIFFERENT (3 of 4 topics agree)" in report


def test_outputs_follow_the_node_semantics_on_bag_time(run1):
    out, s = run1
    bag, inputs = bag_diff.read_bag(out), bag_diff.read_bag(bag_golden.INPUT)
    frames = [r.t_ns for r in inputs["/camera/base/image_raw"][1]]
    assert s["primary_frames"] == s["cycles"] == s["chunks"] == len(frames) == 30      # 10 fps < frame_rate_hz 15
    assert s["cycles_stale"] == s["cycles_failed"] == 0
    chunks = [r for r in bag["/action_chunk"][1]]
    # one chunk per frame, in order, stamped with its frame, ready (and logged) at the cycle's bag time
    assert [r.msg.frame_index for r in chunks] == list(range(30)) == [r.msg.chunk_id for r in chunks]
    assert [bag_diff._stamp(r.msg.header.stamp) for r in chunks] == frames == [r.t_ns for r in chunks]
    for r in chunks:
        m = r.msg
        assert (m.horizon, m.action_dim, len(m.actions)) == (10, 14, 140) and len(m.joint_names) == 14
        assert m.inference_latency_ms == 0.0 and m.observation_age_s == 0.0 and not m.blended
        assert bag_diff._stamp(m.start_time) == r.t_ns and np.all(np.isfinite(m.actions))
    # language: consecutive indices, exactly one final token per finished request, answers = their tokens
    streams = bag_diff._streams(bag["/language/tokens"][1], "index")
    finished = [v for v in streams.values() if v[-1].is_final]
    assert [m.index for v in streams.values() for m in v] == [i for v in streams.values() for i in range(len(v))]
    assert all(sum(m.is_final for m in v) == 1 for v in finished)
    assert len(finished) == s["requests"]["finished"] and s["requests_unfinished"] == len(streams) - len(finished)
    conv = [bag_diff._text(v) for v in finished if v[0].task == "conversation"]
    assert conv == [r.msg.data for r in bag["/conversation/response"][1]] and len(conv) == s["answers"] == 2
    # memory every memory_interval_s (1 s) of bag time, each entry stamped with the frame it describes
    mem = [r.msg for r in bag["/memory/entries"][1]]
    assert [m.entry_id for m in mem] == [1, 2, 3] and [m.frame_index for m in mem] == [0, 10, 20]
    assert [bag_diff._stamp(m.header.stamp) for m in mem] == [frames[0], frames[10], frames[20]]
    prompts = [r.t_ns for r in inputs["/conversation/prompt"][1]]
    first_conv = min(v[0].frame_index for v in streams.values() if v[0].task == "conversation")
    assert frames[first_conv] >= prompts[0] and frames[first_conv - 1] < prompts[0]     # served at its next frame
    assert s["timing"]["frames_per_s"] > 0 and s["timing"]["cycles_s"] > 0


def test_namespace_and_remaps_pick_the_nodes_topics(tmp_path):
    """A bag recorded under /robot1 with the base camera on another name: the same flags as the node's find it."""
    from rosbags.rosbag2 import Reader, Writer

    moved = tmp_path / "robot1_bag"
    rename = {"/camera/base/image_raw": "/robot1/cam0/image", "/camera/left_wrist/image_raw": "/unused/left"}
    with Reader(bag_golden.INPUT) as r, Writer(moved, version=9) as w:
        from oxygen_ros.bags.types import typestore
        ts = typestore()
        conns = {c.id: w.add_connection(rename.get(c.topic, "/robot1" + c.topic), c.msgtype, typestore=ts)
                 for c in r.connections}
        for c, t, raw in r.messages(stop=r.start_time + int(0.45e9)):
            w.write(conns[c.id], t, raw)
    args = [str(moved), "--params", str(bag_golden.CONFIG), "--out", str(tmp_path / "eval"), "--quiet",
            "-p", "memory_interval_s:=0.0", "--namespace", "/robot1", "-r", "camera/base/image_raw:=cam0/image"]
    rc, s = bag_eval.run_command(args)
    assert rc == 0
    assert s["input_topics"]["camera/base/image_raw"] == "/robot1/cam0/image"
    assert s["input_topics"]["joint_states"] == "/robot1/joint_states"
    assert s["output_topics"]["action_chunk"] == "/robot1/action_chunk"
    assert s["cycles"] == 5 and s["counters"]["joint_states_received"] > 0
    assert s["counters"]["frames_received"] == 10                 # base + right wrist; the left wrist is elsewhere
    assert set(bag_diff.read_bag(tmp_path / "eval")) == {"/robot1/" + o for o in OUTPUTS}
    rc, _ = bag_eval.run_command(args[:-4] + ["--overwrite"])      # without the namespace: no primary camera
    assert rc == 2


# ---------------------------------------------------------------------------------------------- bag-diff, known input
def _write_run(path: Path, actions: dict, answers: dict, memory: list, storage: str = "mcap",
               drop: tuple[str, int] | None = None) -> Path:
    """An output bag from records: ``actions`` frame -> [H, A] array, ``answers`` request id -> text (one token per
    character, conversation), ``memory`` [text].  ``drop`` = (output, n): leave out the n-th message (0-based) of
    that output, and nothing else."""
    from std_msgs.msg import String

    from oxygen_ros.ros import messages
    from oxygen_ros.ros.control import ControlSample
    from oxygen_ros.ros.language import MemoryOut, TokenOut

    t0 = 1_700_000_000_000_000_000
    with OutputBag(path, storage=storage) as out:
        bag = _Dropping(out, drop)
        for fi, a in actions.items():
            t = t0 + fi * 100_000_000
            s = ControlSample(np.asarray(a, np.float32), fi, fi, t / 1e9, 0.0, False, False, 0, t, "camera_base")
            bag.write("action_chunk", t, messages.action_chunk(s, now_ns=t, step_dt=1 / 70, joint_names=["j0", "j1"]))
        for rid, text in answers.items():
            for i, ch in enumerate(text):
                bag.write("language/tokens", t0, messages.language_token(TokenOut(
                    rid, "conversation", 0, i, ord(ch), ch, i == len(text) - 1, "eos" if i == len(text) - 1 else "",
                    t0)))
            bag.write("conversation/response", t0, String(data=text))
        for i, text in enumerate(memory):
            bag.write("memory/entries", t0, messages.memory_entry(MemoryOut(i + 1, 0, text, "describe", 99, 3, t0,
                                                                            "camera_base")))
    return path


class _Dropping:
    """An OutputBag that leaves out the n-th message of one output."""

    def __init__(self, bag: OutputBag, drop: tuple[str, int] | None):
        self.bag, self.drop, self.seen = bag, drop, {}

    def write(self, output: str, stamp_ns: int, msg) -> None:
        n = self.seen[output] = self.seen.get(output, -1) + 1
        if (output, n) != self.drop:
            self.bag.write(output, stamp_ns, msg)


def test_bag_diff_exit_status_and_report(tmp_path):
    rng = np.random.default_rng(0)
    acts = {i: rng.normal(size=(4, 2)) for i in range(6)}
    base = dict(answers={1: "a red block", 2: "yes"}, memory=["a table"])
    a = _write_run(tmp_path / "a", acts, **base)
    b = _write_run(tmp_path / "b", acts, **base, storage="sqlite3")
    rc, rep = _diff(a, b, "--plot", "")
    assert rc == 0 and "result: SAME (4 of 4 topics agree)" in rep and "max |a - b| 0," in rep

    tol = bag_golden.ATOL
    near = {k: v.copy() for k, v in acts.items()}
    near[3][1, 0] += 0.5 * tol                                      # inside the tolerance
    rc, rep = _diff(a, _write_run(tmp_path / "near", near, **base), "--plot", "")
    assert rc == 0, rep

    far = {k: v.copy() for k, v in acts.items() if k != 5}          # frame 5 missing
    far[3][2, 1] += 3 * tol
    far[4][0, 0] -= 1.0
    far[7] = acts[0]                                                # an extra frame
    other = dict(answers={1: "a red black", 3: "no"}, memory=["a chair"])
    rc, rep = _diff(a, _write_run(tmp_path / "far", far, **other), "--plot", tmp_path / "p.png",
                    "--json", tmp_path / "far.json")
    assert rc == 1
    assert "missing in B: 5" in rep and "extra in B: 7" in rep
    assert "actions beyond tolerance in 2 of 5 chunks; first at frame 3:" in rep and "at row 2, j1" in rep
    assert "max |a - b| 1," in rep and "j0 1/" in rep                 # per-joint max: j0 moved by 1.0
    assert "request 1 (conversation): first differing token at index 8: A 'o', B 'a'" in rep
    assert "missing in B: 2" in rep and "extra in B: 3" in rep        # requests by id
    assert "text differs in 1 of 1 entries, first at 1: A 'a table', B 'a chair'" in rep
    assert "2 of 2 messages differ, first #0: A 'a red block', B 'a red black'" in rep
    assert "result: DIFFERENT (0 of 4 topics agree)" in rep
    res = json.loads((tmp_path / "far.json").read_text())
    act = next(t for t in res["topics"] if t["topic"] == "/action_chunk")
    assert act["stats"]["per_joint"]["j0"]["max"] == pytest.approx(1.0, rel=1e-6)
    assert act["stats"]["per_joint"]["j1"]["max"] == pytest.approx(3 * tol, rel=1e-3)
    assert [k for k, v in act["stats"]["per_frame_max"] if v > tol] == [3, 4]
    assert (tmp_path / "p.png").stat().st_size > 5_000
    assert _diff(a, tmp_path / "far", "--atol", "2", "--plot", "")[0] == 1      # texts still differ
    assert _diff(a, tmp_path / "nothing")[0] == 2
    shape = {k: (v if k != 2 else v[1:]) for k, v in acts.items()}   # a chunk with a row fewer
    rc, rep = _diff(a, _write_run(tmp_path / "shape", shape, **base), "--plot", "")
    assert rc == 1 and "frame 2: chunk shape A (4, 2), B (3, 2)" in rep


@pytest.mark.parametrize("output,n,missing,line", [
    ("action_chunk", 3, [3], "/action_chunk: DIFFERENT (6 vs 5 messages, 5 chunks matched)"),
    ("language/tokens", 12, [], "request 2 (conversation): token message(s) missing in B: index 1"),
    ("conversation/response", 1, [1], "/conversation/response: DIFFERENT (2 vs 1 messages, 1 messages matched)"),
    ("memory/entries", 1, [2], "/memory/entries: DIFFERENT (2 vs 1 messages, 1 entries matched)"),
])
def test_bag_diff_one_missing_message_alone_is_different(tmp_path, output, n, missing, line):
    """Issue 21: B lacks exactly one output message of A and nothing else differs -> exit 1, DIFFERENT, and the
    missing message named (frame 3; token index 1 of request 2 = the 13th token message; the 2nd answer string; the
    memory entry with id 2); every other topic the same."""
    rng = np.random.default_rng(1)
    acts = {i: rng.normal(size=(4, 2)) for i in range(6)}
    base = dict(answers={1: "a red block", 2: "yes"}, memory=["a table", "a chair"])
    a = _write_run(tmp_path / "a", acts, **base)
    b = _write_run(tmp_path / "b", acts, **base, drop=(output, n))
    assert _diff(a, _write_run(tmp_path / "same", acts, **base), "--plot", "")[0] == 0
    rc, rep = _diff(a, b, "--plot", "", "--json", tmp_path / "d.json")
    assert rc == 1, rep
    assert "result: DIFFERENT (3 of 4 topics agree)" in rep and line in rep, rep
    if missing:
        assert f"  missing in B: {missing[0]}" in rep
    topics = {t["topic"]: t for t in json.loads((tmp_path / "d.json").read_text())["topics"]}
    bad = topics.pop("/" + output)
    assert all(t["ok"] for t in topics.values()), "only the topic with the missing message differs"
    assert list(map(str, bad["missing"])) == list(map(str, missing)) and bad["extra"] == []
    if output != "language/tokens":
        assert bad["differences"] == [], "nothing but the missing message"
    assert "extra in B" not in rep


def test_bag_diff_nan_in_an_action_chunk(tmp_path):
    """Issue 21: a NaN (or inf) where the other bag has a number is beyond any tolerance, in either bag and with a
    relative tolerance too; NaN against NaN (and inf against the same inf) agrees."""
    rng = np.random.default_rng(2)
    acts = {i: rng.normal(size=(4, 2)) for i in range(6)}
    base = dict(answers={1: "ok"}, memory=["a table"])
    a = _write_run(tmp_path / "a", acts, **base)

    def with_value(name, frame, row, col, value):
        x = {k: v.copy() for k, v in acts.items()}
        x[frame][row, col] = value
        return _write_run(tmp_path / name, x, **base)

    nan_b = with_value("nan_b", 3, 1, 0, np.nan)
    rc, rep = _diff(a, nan_b, "--plot", "", "--json", tmp_path / "nan.json")
    assert rc == 1, rep
    want = f"actions beyond tolerance in 1 of 6 chunks; first at frame 3: |a - b| inf at row 1, j0 (A {acts[3][1, 0]:.6g}"
    assert want in rep and "B nan)" in rep, rep
    assert "/action_chunk: DIFFERENT" in rep and "result: DIFFERENT (3 of 4 topics agree)" in rep
    act = next(t for t in json.loads((tmp_path / "nan.json").read_text())["topics"] if t["topic"] == "/action_chunk")
    assert act["stats"]["per_joint"]["j0"]["max"] == float("inf") and act["stats"]["per_joint"]["j1"]["max"] == 0
    assert [k for k, v in act["stats"]["per_frame_max"] if v > 0] == [3]
    assert _diff(nan_b, a, "--plot", "")[0] == 1                               # NaN in A, the number in B
    assert _diff(a, nan_b, "--plot", "", "--atol", "1e9", "--rtol", "1")[0] == 1   # no tolerance covers it
    assert _diff(nan_b, with_value("nan_b2", 3, 1, 0, np.nan), "--plot", "")[0] == 0   # NaN vs NaN: the same
    inf_b = with_value("inf_b", 2, 0, 1, np.inf)
    assert _diff(a, inf_b, "--plot", "", "--rtol", "0.5")[0] == 1              # |b| = inf must not widen the bound
    assert _diff(inf_b, with_value("inf_b2", 2, 0, 1, np.inf), "--plot", "")[0] == 0
    assert _diff(inf_b, with_value("ninf_b", 2, 0, 1, -np.inf), "--plot", "")[0] == 1
    tol = bag_diff.Tolerance(1e-4, 0.5)
    x = np.array([1.0, np.nan, np.nan, np.inf, np.inf, 2.0])
    y = np.array([1.00005, 1.0, np.nan, np.inf, -np.inf, np.inf])
    assert tol.exceeded(x, y).tolist() == [False, True, False, False, True, True]
    assert bag_diff.distance(x, y).tolist() == [pytest.approx(5e-5), np.inf, 0.0, 0.0, np.inf, np.inf]


# ------------------------------------------------------------------------------------------------ online recording
def test_replay_record_has_the_same_layout_and_diffs_against_offline(run1, tmp_path):
    """`oxygen replay --clock --record` with the node on simulated time: the recording has bag-eval's topics and
    types, one message per chunk, capture stamps of recorded frames; bag-diff --match stamp pairs it with the
    offline run (numbers differ online: the node skips frames while busy and sees later joint states)."""
    out1, _ = run1
    params = {"use_sim_time": True, "memory_db": "", "memory_interval_s": 1.0, "max_new_tokens": 16}
    node = NodeProcess(tmp_path / "node.log", params)
    online = tmp_path / "online"
    log = tmp_path / "replay.log"
    try:
        with open(log, "wb") as f:
            # at half speed: the node skips frames while busy, so the number of chunks depends on the machine's load
            # (a loaded CI box gave 4 at full speed); half speed doubles the margin of the >= 3 below
            r = subprocess.run([sys.executable, "-m", "oxygen_ros.tools.cli", "replay", str(bag_golden.INPUT),
                                "--clock", "100", "--rate", "0.5", "--wait", "90", "--record", str(online),
                                "--record-tail", "2"],
                               cwd=str(REPO), stdout=f, stderr=subprocess.STDOUT, timeout=180)
        assert r.returncode == 0, log.read_text()[-2000:] + node.log()[-2000:]
        rc, _ = node.stop(signal.SIGINT)
        assert rc == 0
    finally:
        if node.alive():
            node.stop(signal.SIGKILL)
    assert "recorded" in log.read_text()
    rec, off = bag_diff.read_bag(online), bag_diff.read_bag(out1)
    assert {t: v[0] for t, v in rec.items()} == {t: v[0] for t, v in off.items()}
    chunks = [r.msg for r in rec["/action_chunk"][1]]
    assert len(chunks) >= 3 and len({m.chunk_id for m in chunks}) == len(chunks)   # >= 3: a loaded CI box gave 4
    frames = {bag_diff._stamp(r.msg.header.stamp) for r in off["/action_chunk"][1]}
    assert {bag_diff._stamp(m.header.stamp) for m in chunks} <= frames       # recorded capture stamps (--clock)
    assert rec["/language/tokens"][1] and rec["/memory/entries"][1]
    rc, rep = _diff(out1, online, "--match", "stamp", "--plot", "", "--json", tmp_path / "d.json")
    assert rc in (0, 1) and "/action_chunk:" in rep and "/language/tokens:" in rep, rep
    act = next(t for t in json.loads((tmp_path / "d.json").read_text())["topics"] if t["topic"] == "/action_chunk")
    assert act["matched"] == len(chunks) and not act["extra"]          # every online chunk found its frame
