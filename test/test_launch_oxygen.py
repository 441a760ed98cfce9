"""launch_pytest tests of the package's launch files, run through the real ROS 2 ``launch`` / ``launch_ros``.

This file owns what launch adds on top of the node (the node's own behaviour and rates are tested in
``test_node*.py``): ``launch/oxygen.launch.py`` brings the node up with its arguments (namespace, a params file,
camera and joint-state remaps, an override) and chunks flow; ``launch/replay.launch.py`` with the ``oxygen`` player
feeds the node on wall time (chunks stamped with the replayed frames' capture times) and on sim time (the player
publishes ``/clock``, chunks start in bag time); and after launch shuts down every launched process has exited with
status 0 and **no process started during the test survives it** (``ProcessWatch`` records the whole process tree
while the launch runs, so a player orphaned by a wrapper that does not pass SIGINT on is caught, and killed).
Both launch files are resolved from the *installed* share dir (``FindPackageShare``), so the package must be
installed (``make setup``; colcon + ``source install/setup.bash`` on a ROS install).  ``launch_pytest`` is not on
PyPI: ``make setup ROS_LAUNCH_WHEELS=<dir>`` installs it from wheels (``.ci/run`` does when ``../shared/ros-launch``
exists); without it this module is skipped with the reason shown.
"""
from __future__ import annotations

import sys

import pytest
import yaml

launch_pytest = pytest.importorskip(
    "launch_pytest",
    reason="ROS 2 launch/launch_pytest are not installed (not on PyPI): `make setup ROS_LAUNCH_WHEELS=<dir of the "
           "launch wheels>` (.ci/run does it when ../shared/ros-launch exists) or source a ROS 2 install")

from launch import LaunchDescription  # noqa: E402
from launch.actions import ExecuteProcess, IncludeLaunchDescription, RegisterEventHandler  # noqa: E402
from launch.event_handlers import OnProcessExit, OnProcessStart  # noqa: E402
from launch.launch_description_sources import PythonLaunchDescriptionSource  # noqa: E402
from launch.substitutions import PathJoinSubstitution  # noqa: E402
from launch_ros.substitutions import FindPackageShare  # noqa: E402

from conftest import CONFIG, LEAVE_S, TIMING_GROUP, require_ros  # noqa: E402

require_ros()
from rclpy.parameter import parameter_value_to_python  # noqa: E402
from rcl_interfaces.srv import GetParameters  # noqa: E402
from rosgraph_msgs.msg import Clock  # noqa: E402
from sensor_msgs.msg import Image  # noqa: E402

from oxygen_ros.msg import ActionChunk  # noqa: E402
from oxygen_ros.tools.bags.replay import make_bag  # noqa: E402

pytestmark = pytest.mark.xdist_group(TIMING_GROUP)     # node / player / launch processes: one worker

BAG_START_NS = 1_000_000_000 * 1_000_000_000     # 2001-09-09: bag time, far from wall time (sim-time check)
BAG_DURATION_S = 4.0
CHUNKS = 10              # chunks to see before checking them (the rate is test_node.py's business)
UP_TIMEOUT_S = 120.0     # node start (model build) on a loaded 2-core machine
EXIT_TIMEOUT_S = 5.0     # launch has already waited for its processes; this is for anything they left behind
NAMES = [f"arm_j{i}" for i in range(7)]    # the test params file's action_joint_names (the shipped file has 14)


@pytest.fixture(scope="module")
def bag(tmp_path_factory):
    return str(make_bag(tmp_path_factory.mktemp("launch") / "bag", duration=BAG_DURATION_S, width=224, height=224,
                        start_ns=BAG_START_NS))


class LaunchedProcesses:
    """Start and exit of every process launch runs (event handlers of the launch description under test)."""

    def __init__(self):
        self.started: dict[str, list[str]] = {}      # process name (e.g. oxygen_node-1) -> command line
        self.exits: dict[str, int] = {}               # process name -> return code

    def entities(self) -> list:
        def on_start(event, context):
            self.started[event.process_name] = list(event.cmd)

        def on_exit(event, context):
            self.exits[event.process_name] = event.returncode
        return [RegisterEventHandler(OnProcessStart(on_start=on_start)),
                RegisterEventHandler(OnProcessExit(on_exit=on_exit))]


@pytest.fixture
def launched():
    return LaunchedProcesses()


def _describe(launched: LaunchedProcesses, launch_file: str, args: dict, *extra) -> LaunchDescription:
    """The package's installed ``launch_file`` with ``args``, plus ``extra`` actions, recorded by ``launched``."""
    path = PathJoinSubstitution([FindPackageShare("oxygen_ros"), "launch", launch_file])
    return LaunchDescription(launched.entities() + [
        IncludeLaunchDescription(PythonLaunchDescriptionSource(path), launch_arguments=args.items()),
        *extra, launch_pytest.actions.ReadyToTest()])


def _wait_chunks(ros, chunks: list, n: int = CHUNKS) -> list:
    assert ros.wait_for(lambda: len(chunks) >= n, UP_TIMEOUT_S), f"only {len(chunks)} action chunks through launch"
    return [m for _, m in list(chunks)]


def _parameters(ros, node: str, names: list[str]) -> dict:
    """The values of ``names`` as the running ``node`` has them (its get_parameters service)."""
    client = ros.node.create_client(GetParameters, f"{node}/get_parameters")
    try:
        assert client.wait_for_service(timeout_sec=10.0), f"no parameter service of {node}"
        fut = client.call_async(GetParameters.Request(names=names))
        assert ros.wait_for(fut.done, 10.0), f"get_parameters of {node} timed out"
        return {n: parameter_value_to_python(v) for n, v in zip(names, fut.result().values)}
    finally:
        ros.node.destroy_client(client)


def _check_clean_exit(launched: LaunchedProcesses, process_watch) -> None:
    """After launch shut down: every process it started exited with 0, and nothing of the test is still running."""
    survivors = process_watch.wait_gone(EXIT_TIMEOUT_S)
    assert not survivors, f"processes survived the launch: {sorted(survivors.values())}"
    assert set(launched.exits) == set(launched.started), (launched.started, launched.exits)
    assert all(rc == 0 for rc in launched.exits.values()), f"exit codes: {launched.exits}"


# -- oxygen.launch.py: the node with its arguments ------------------------------------------------------------------

@pytest.fixture
def params_file(tmp_path):
    """The shipped params file with visible changes: 7 named action columns, frame_rate_hz 10, sim time (a launch
    argument left empty must not override it), no memory DB."""
    cfg = yaml.safe_load(CONFIG.read_text())
    p = cfg["/**"]["ros__parameters"]
    p.update(action_joint_names=NAMES, frame_rate_hz=10.0, use_sim_time=True, memory_db="", memory_interval_s=0.0)
    out = tmp_path / "robot.yaml"
    out.write_text(yaml.safe_dump(cfg))
    return str(out)


@launch_pytest.fixture
def oxygen_launch(process_watch, launched, bag, params_file):
    # the bag is replayed into /bagns (and its time on /clock); the node lives in /robot1 and reaches those topics
    # only through the remaps
    args = {"namespace": "robot1", "params_file": params_file, "stamp_source": "receive",
            "camera_base": "/bagns/camera/base/image_raw", "camera_left_wrist": "/bagns/camera/left_wrist/image_raw",
            "camera_right_wrist": "/bagns/camera/right_wrist/image_raw", "joint_states": "/bagns/joint_states"}
    replay = ExecuteProcess(cmd=[sys.executable, "-m", "oxygen_ros.tools.bags.replay", "replay", bag, "--loop", "--quiet",
                                 "--namespace", "bagns", "--clock", "100"], name="test_replay", output="screen")
    return _describe(launched, "oxygen.launch.py", args, replay)


@pytest.mark.launch(fixture=oxygen_launch)
def test_oxygen_launch_brings_up_the_node_with_its_arguments(ros, process_watch, launched):
    matched = ros.publishers_matched(ActionChunk, "/robot1/action_chunk")
    chunks = ros.collect(ActionChunk, "/robot1/action_chunk", qos=100, keep=200)
    try:
        recent = _wait_chunks(ros, chunks)
    finally:
        ros.uncollect(chunks)
    assert all(list(m.joint_names) == NAMES and m.action_dim == len(NAMES) for m in recent), "params_file not used"
    assert ("oxygen_node", "/robot1") in ros.node.get_node_names_and_namespaces()
    params = _parameters(ros, "/robot1/oxygen_node", ["frame_rate_hz", "stamp_source", "use_sim_time", "autostart"])
    # the params file's values, except stamp_source, the only argument given a value
    assert params == {"frame_rate_hz": 10.0, "stamp_source": "receive", "use_sim_time": True, "autostart": True}
    assert sorted(n.rsplit("-", 1)[0] for n in launched.started) == ["oxygen_node", "test_replay"], launched.started
    assert ros.wait_for(lambda: matched() >= 1, 10.0)     # the chunks came, so DDS has matched their publisher
    yield
    _check_clean_exit(launched, process_watch)
    # the node leaves the ROS graph: its publisher is unmatched when its participant announces the leave, well before
    # the 20 s lease would expire (read from DDS matching, not the graph's node list: see RosHelper.publishers_matched)
    assert ros.wait_for(lambda: matched() == 0, LEAVE_S), f"still matched {LEAVE_S} s after the launch ended"


# -- replay.launch.py: node + the oxygen player, on wall time and on sim time ----------------------------------------

@launch_pytest.fixture
def replay_launch(process_watch, launched, bag):
    return _describe(launched, "replay.launch.py", {"bag": bag, "player": "oxygen"})


@pytest.mark.launch(fixture=replay_launch)
def test_replay_launch_feeds_the_node_and_leaves_nothing_behind(ros, process_watch, launched):
    frames = ros.collect(Image, "/camera/base/image_raw", qos=100, keep=500)
    chunks = ros.collect(ActionChunk, "/action_chunk", qos=100, keep=200)
    try:
        recent = _wait_chunks(ros, chunks)
        stamps = {(m.header.stamp.sec, m.header.stamp.nanosec) for _, m in list(frames)}
    finally:
        ros.uncollect(chunks)
        ros.uncollect(frames)
    # restamped on replay: chunks carry the capture times of frames the player published now, not bag time
    assert all((m.header.stamp.sec, m.header.stamp.nanosec) in stamps for m in recent[-5:])
    assert all(m.header.stamp.sec > BAG_START_NS // 10**9 + 3600 for m in recent)
    # launch runs the node and the player itself (no `ros2 run` wrapper between launch and the player)
    players = [cmd for name, cmd in launched.started.items() if name.startswith("oxygen_replay")]
    assert len(launched.started) == 2 and len(players) == 1, launched.started
    assert players[0][0].endswith("lib/oxygen_ros/oxygen") and players[0][1] == "replay", players
    yield
    _check_clean_exit(launched, process_watch)


@launch_pytest.fixture
def replay_sim_time_launch(process_watch, launched, bag):
    return _describe(launched, "replay.launch.py", {"bag": bag, "player": "oxygen", "use_sim_time": "true",
                                                    "namespace": "sim"})


@pytest.mark.launch(fixture=replay_sim_time_launch)
def test_replay_launch_with_sim_time_follows_the_bag_clock(ros, process_watch, launched):
    clock = ros.collect(Clock, "/clock", qos=10, keep=10)
    chunks = ros.collect(ActionChunk, "/sim/action_chunk", qos=100, keep=200)
    try:
        recent = _wait_chunks(ros, chunks)
        assert clock, "the player publishes no /clock"
    finally:
        ros.uncollect(chunks)
        ros.uncollect(clock)
    assert _parameters(ros, "/sim/oxygen_node", ["use_sim_time"]) == {"use_sim_time": True}
    # the node's clock is the bag's: chunks start within the bag's time span and keep the recorded frame stamps
    # (not the ordering of the two: bag time jumps back when the loop restarts)
    span = (BAG_START_NS, BAG_START_NS + int((BAG_DURATION_S + 1.0) * 1e9))
    for m in recent:
        start = m.start_time.sec * 10**9 + m.start_time.nanosec
        stamp = m.header.stamp.sec * 10**9 + m.header.stamp.nanosec
        assert span[0] <= stamp <= span[1] and span[0] <= start <= span[1], (stamp, start, span)
    yield
    _check_clean_exit(launched, process_watch)
