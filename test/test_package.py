"""Package foundation: the installed package's messages, share directory and import rules.

Owns the checks that `pip install .` (or colcon) produced a usable ROS 2 package: each custom message type
round-trips between two separate processes over real DDS, `oxygen_ros.msg` imports with no extra environment
variables, ament_index finds the share directory with launch/ and config/, and the inference core
(model, kv, engine) never imports rclpy.
"""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

TALKER = textwrap.dedent("""
    import sys, time, rclpy
    from rclpy.qos import QoSProfile, ReliabilityPolicy, DurabilityPolicy
    from oxygen_ros.msg import ActionChunk, LanguageToken, MemoryEntry
    rclpy.init()
    node = rclpy.create_node("oxygen_msg_talker")
    qos = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE, durability=DurabilityPolicy.TRANSIENT_LOCAL)
    a = ActionChunk()
    a.header.stamp.sec, a.header.stamp.nanosec, a.header.frame_id = 12, 345, "base_camera"
    a.frame_index, a.chunk_id, a.step_dt, a.horizon, a.action_dim = 7, 3, 1 / 70, 2, 3
    a.start_time.sec = 13
    a.joint_names = ["j0", "j1", "j2"]
    a.actions = [0.5, -1.25, 2.0, 3.5, 4.0, -5.5]
    a.inference_latency_ms = 12.5
    t = LanguageToken(request_id=9, task="conversation", frame_index=7, index=4, token_id=1234,
                      text="h\\u00e9llo", is_final=True, finish_reason="eos")
    m = MemoryEntry(entry_id=5, frame_index=7, text="a red block on the table", source_prompt="describe",
                    request_id=9, num_tokens=6)
    m.header.stamp.sec = 12
    pubs = [(node.create_publisher(type(msg), topic, qos), msg)
            for topic, msg in (("action_chunk", a), ("language/tokens", t), ("memory/entries", m))]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for pub, msg in pubs:
            pub.publish(msg)
        time.sleep(0.1)
""")

LISTENER = textwrap.dedent("""
    import json, time, rclpy
    from rclpy.qos import QoSProfile, ReliabilityPolicy, DurabilityPolicy
    def message_to_ordereddict(msg):  # plain recursive conversion (rosidl_runtime_py is not on PyPI)
        if not hasattr(msg, "get_fields_and_field_types"):
            return list(msg) if hasattr(msg, "__len__") and not isinstance(msg, str) else msg
        return {f: message_to_ordereddict(getattr(msg, f)) for f in msg.get_fields_and_field_types()}
    from oxygen_ros.msg import ActionChunk, LanguageToken, MemoryEntry
    rclpy.init()
    node = rclpy.create_node("oxygen_msg_listener")
    qos = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE, durability=DurabilityPolicy.TRANSIENT_LOCAL)
    got = {}
    for topic, typ in (("action_chunk", ActionChunk), ("language/tokens", LanguageToken),
                       ("memory/entries", MemoryEntry)):
        node.create_subscription(typ, topic, lambda msg, topic=topic: got.setdefault(topic, msg), qos)
    deadline = time.monotonic() + 25
    while len(got) < 3 and time.monotonic() < deadline:
        rclpy.spin_once(node, timeout_sec=0.1)
    print(json.dumps({k: message_to_ordereddict(v) for k, v in got.items()}))
""")


def _clean_env(**extra):
    """The environment a user has after `pip install .`: no LD_LIBRARY_PATH / AMENT / PYTHONPATH help."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("LD_LIBRARY_PATH", "AMENT_PREFIX_PATH", "PYTHONPATH", "CMAKE_PREFIX_PATH",
                        "_ROS_WHEELS_BOOTSTRAP_COMPLETE")}
    env.setdefault("ROS_DOMAIN_ID", str(100 + os.getpid() % 100))
    env.setdefault("ROS_AUTOMATIC_DISCOVERY_RANGE", "LOCALHOST")
    env.update(extra)
    return env


def _py(code, tmp_path, env=None, timeout=60):
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env or _clean_env(),
                          capture_output=True, text=True, timeout=timeout)


def test_messages_import_without_environment_variables(tmp_path):
    r = _py("from oxygen_ros.msg import ActionChunk, ConversationResponse, LanguageToken, MemoryEntry; "
            "from oxygen_ros.srv import ClearMemory, QueryMemory; from oxygen_ros.action import Converse; "
            "print(ActionChunk().horizon)", tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "0"


def test_each_message_round_trips_between_processes_over_dds(tmp_path):
    env = _clean_env()
    talker = subprocess.Popen([sys.executable, "-c", TALKER], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        r = _py(LISTENER, tmp_path, env=env, timeout=60)
    finally:
        talker.terminate()
        talker.wait(timeout=10)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(got) == {"action_chunk", "language/tokens", "memory/entries"}, got.keys()
    a = got["action_chunk"]
    assert a["header"] == {"stamp": {"sec": 12, "nanosec": 345}, "frame_id": "base_camera"}
    assert (a["frame_index"], a["chunk_id"], a["horizon"], a["action_dim"]) == (7, 3, 2, 3)
    assert a["start_time"]["sec"] == 13 and a["step_dt"] == pytest.approx(1 / 70)
    assert a["joint_names"] == ["j0", "j1", "j2"]
    assert list(a["actions"]) == [0.5, -1.25, 2.0, 3.5, 4.0, -5.5]
    assert a["inference_latency_ms"] == 12.5
    t = got["language/tokens"]
    assert (t["request_id"], t["task"], t["frame_index"], t["index"], t["token_id"]) == (9, "conversation", 7, 4, 1234)
    assert t["text"] == "h\u00e9llo" and t["is_final"] is True and t["finish_reason"] == "eos"
    m = got["memory/entries"]
    assert (m["entry_id"], m["frame_index"], m["text"], m["source_prompt"]) == (5, 7, "a red block on the table",
                                                                                "describe")
    assert m["header"]["stamp"]["sec"] == 12 and m["request_id"] == 9 and m["num_tokens"] == 6


def test_share_directory_holds_launch_config_and_messages(tmp_path):
    code = ("import sys; from ament_index_python.packages import get_package_share_directory as g; "
            "print(g('oxygen_ros'))")
    r = _py(code, tmp_path, env=_clean_env(AMENT_PREFIX_PATH=sys.prefix))
    assert r.returncode == 0, r.stderr
    share = Path(r.stdout.strip())
    assert share == Path(sys.prefix) / "share" / "oxygen_ros"
    for rel in ("package.xml", "msg/ActionChunk.msg", "msg/LanguageToken.msg", "msg/MemoryEntry.msg",
                "msg/ConversationResponse.msg", "msg/EpisodeStatus.msg", "msg/TextTarget.msg",
                "srv/QueryMemory.srv", "srv/ClearMemory.srv", "srv/ResetEpisode.srv", "action/Converse.action",
                "launch/oxygen.launch.py", "launch/replay.launch.py", "config/oxygen.yaml"):
        assert (share / rel).is_file(), f"{rel} missing from the installed share directory {share}"
    assert (share / "package.xml").read_text() == (ROOT / "package.xml").read_text()
    for exe in ("oxygen_node", "sim_node", "oxygen", "converse_client", "memory_query"):
        assert os.access(Path(sys.prefix) / "lib" / "oxygen_ros" / exe, os.X_OK), f"lib/oxygen_ros/{exe}"


def test_every_source_module_is_installed(tmp_path):
    """The installed package (what `pip install .` / colcon put in site-packages) holds every hand-written module of
    the source tree: a new room (sim/, train/, ...) cannot be left out of the build."""
    r = _py("import oxygen_ros, os; print(os.path.dirname(oxygen_ros.__file__))", tmp_path)
    assert r.returncode == 0, r.stderr
    installed = Path(r.stdout.strip())
    assert installed != ROOT / "oxygen_ros", "the test must see the installed package, not the checkout"
    src = {p.relative_to(ROOT / "oxygen_ros") for p in (ROOT / "oxygen_ros").rglob("*.py")
           if "__pycache__" not in p.parts}
    missing = sorted(str(p) for p in src if not (installed / p).is_file())
    assert not missing, f"not installed (setup.py packages / CMakeLists install rules?): {missing}"


def test_inference_core_never_imports_rclpy(tmp_path):
    """model/kv/engine (and the simulation and training cores) run without ROS."""
    code = ("import sys, pkgutil, importlib, oxygen_ros\n"
            "mods = []\n"
            "for sub in ('model', 'kv', 'engine', 'sim', 'train'):\n"
            "    pkg = importlib.import_module('oxygen_ros.' + sub)\n"
            "    for info in pkgutil.iter_modules(pkg.__path__):\n"
            "        mods.append(importlib.import_module(f'oxygen_ros.{sub}.{info.name}').__name__)\n"
            "print(len(mods), 'rclpy' in sys.modules)\n")
    r = _py(code, tmp_path, env=_clean_env(PYTHONPATH=str(ROOT)))
    assert r.returncode == 0, r.stderr
    count, imported = r.stdout.split()
    assert int(count) >= 10 and imported == "False", r.stdout
