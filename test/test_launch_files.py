"""Structural tests of ``launch/*.launch.py`` that run without ROS 2 ``launch`` (not on PyPI): each launch file is
executed against small recording stand-ins for the ``launch`` / ``launch_ros`` classes it uses, and the test checks
the declared arguments, that only non-empty arguments override the params file, the camera remaps, the namespace,
the default params file (``<share>/oxygen_ros/config/oxygen.yaml``), and the replay player command lines (the
``oxygen`` player is the package's executable itself, not ``ros2 run``; ``--clock`` with sim time; ``stamp_source``
passed through).  Also checks that ``config/oxygen.yaml`` lists exactly the node's declared parameters with values of
the declared types.  ``test_launch_oxygen.py`` runs the launch files for real where ROS 2 launch is installed.
"""
from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]


class _Rec:
    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs


class _LaunchConfiguration:
    def __init__(self, name):
        self.name = name

    def perform(self, context):
        return context.values[self.name]


class _Context:
    def __init__(self, values):
        self.values = values


def _stub_modules():
    mods = {}

    def mod(name, **attrs):
        m = types.ModuleType(name)
        for k, v in attrs.items():
            setattr(m, k, v)
        mods[name] = m
        return m

    rec = lambda n: type(n, (_Rec,), {})  # noqa: E731
    mod("launch", LaunchDescription=rec("LaunchDescription"))
    mod("launch.actions", DeclareLaunchArgument=rec("DeclareLaunchArgument"), OpaqueFunction=rec("OpaqueFunction"),
        ExecuteProcess=rec("ExecuteProcess"), IncludeLaunchDescription=rec("IncludeLaunchDescription"))
    mod("launch.substitutions", LaunchConfiguration=_LaunchConfiguration,
        PathJoinSubstitution=rec("PathJoinSubstitution"))
    mod("launch.launch_description_sources", PythonLaunchDescriptionSource=rec("PythonLaunchDescriptionSource"))
    mod("launch_ros")
    mod("launch_ros.actions", Node=rec("Node"))
    mod("launch_ros.substitutions", FindPackageShare=rec("FindPackageShare"),
        ExecutableInPackage=rec("ExecutableInPackage"))
    return mods


@pytest.fixture
def load_launch(monkeypatch):
    for name, m in _stub_modules().items():
        monkeypatch.setitem(sys.modules, name, m)

    def load(fname):
        spec = importlib.util.spec_from_file_location(fname.replace(".", "_"), REPO / "launch" / fname)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        ld = module.generate_launch_description()
        entities = ld.args[0]
        declared = {e.args[0]: e.kwargs.get("default_value") for e in entities
                    if type(e).__name__ == "DeclareLaunchArgument"}
        opaque = [e for e in entities if type(e).__name__ == "OpaqueFunction"]
        return module, declared, opaque
    return load


def _resolve(v):
    if isinstance(v, str):
        return v
    share, *rest = v.args[0]           # PathJoinSubstitution([FindPackageShare(pkg), ...])
    return "/".join([f"<share>/{share.args[0]}", *rest])


def _defaults(declared, **given):
    vals = {k: _resolve(v) for k, v in declared.items() if v is not None}
    vals.update(given)
    return _Context(vals)


def test_oxygen_launch(load_launch):
    module, declared, opaque = load_launch("oxygen.launch.py")
    assert {"checkpoint", "preset", "params_file", "namespace", "use_sim_time", "camera_base", "camera_left_wrist",
            "camera_right_wrist"} <= set(declared)
    default_params = declared["params_file"]
    assert type(default_params).__name__ == "PathJoinSubstitution"
    share, *rest = default_params.args[0]
    assert share.args == ("oxygen_ros",) and rest == ["config", "oxygen.yaml"]

    (node,) = opaque[0].kwargs["function"](_defaults(declared))
    assert node.kwargs["package"] == "oxygen_ros" and node.kwargs["executable"] == "oxygen_node"
    params_file, overrides = node.kwargs["parameters"]
    assert params_file.endswith("config/oxygen.yaml")
    assert overrides == {}, "empty arguments must not override the params file"
    assert node.kwargs["additional_env"] is None
    assert node.kwargs["remappings"] == [] and node.kwargs["namespace"] == ""

    ctx = _defaults(declared, checkpoint="/models/pi05", namespace="robot1", use_sim_time="true",
                    camera_base="/cam0/color/image_raw", camera_right_wrist="/cam2/image", preset="pi05")
    (node,) = opaque[0].kwargs["function"](ctx)
    _, overrides = node.kwargs["parameters"]
    assert overrides == {"checkpoint": "/models/pi05", "preset": "pi05", "use_sim_time": True}
    assert node.kwargs["namespace"] == "robot1"
    assert ("camera/base/image_raw", "/cam0/color/image_raw") in node.kwargs["remappings"]
    assert ("camera/right_wrist/image_raw", "/cam2/image") in node.kwargs["remappings"]
    (node,) = opaque[0].kwargs["function"](_defaults(declared, use_sim_time="false", autostart="False"))
    assert node.kwargs["parameters"][1] == {"use_sim_time": False, "autostart": False}
    (node,) = opaque[0].kwargs["function"](_defaults(declared, device="cpu", compile="none"))
    assert node.kwargs["parameters"][1] == {"device": "cpu", "compile": "none"}


def test_replay_launch(load_launch):
    module, declared, opaque = load_launch("replay.launch.py")
    assert declared["bag"] is None and declared["player"] == "ros2bag"
    include, proc = opaque[0].kwargs["function"](_defaults(declared, bag="/bags/demo", namespace="r1"))
    cmd = proc.kwargs["cmd"]
    assert cmd[:4] == ["ros2", "bag", "play", "/bags/demo"] and "--loop" in cmd
    assert "/camera/base/image_raw:=/r1/camera/base/image_raw" in cmd
    args = dict(include.kwargs["launch_arguments"])
    assert args["stamp_source"] == "receive" and args["namespace"] == "r1"
    assert proc.kwargs["additional_env"]["FASTDDS_DEFAULT_PROFILES_FILE"].endswith(
        "oxygen_ros/config/fastdds_large_frames.xml")
    assert "--clock" not in cmd
    include, proc = opaque[0].kwargs["function"](_defaults(declared, bag="/bags/demo", use_sim_time="true"))
    assert proc.kwargs["cmd"][-2:] == ["--clock", "100"], "sim time needs a /clock"
    assert dict(include.kwargs["launch_arguments"])["stamp_source"] == "", "bag stamps are right on the bag clock"
    include, proc = opaque[0].kwargs["function"](_defaults(declared, bag="/bags/demo", stamp_source="header"))
    assert dict(include.kwargs["launch_arguments"])["stamp_source"] == "header", "a given stamp_source is kept"

    include, proc = opaque[0].kwargs["function"](_defaults(declared, bag="/bags/demo", player="oxygen",
                                                           loop="false"))
    exe, *cmd = proc.kwargs["cmd"]
    # the player process itself (launch's SIGINT must reach it), not `ros2 run`, which does not pass it on
    assert type(exe).__name__ == "ExecutableInPackage" and exe.args == ("oxygen", "oxygen_ros")
    assert cmd[:2] == ["replay", "/bags/demo"] and "--loop" not in cmd and "--clock" not in cmd
    args = dict(include.kwargs["launch_arguments"])
    assert args["stamp_source"] == "" and args["use_sim_time"] == ""
    include, proc = opaque[0].kwargs["function"](_defaults(declared, bag="/bags/demo", player="oxygen",
                                                           use_sim_time="true", clock_hz="250", namespace="/r2"))
    assert proc.kwargs["cmd"][-4:] == ["--namespace", "r2", "--clock", "250"]
    assert dict(include.kwargs["launch_arguments"])["use_sim_time"] == "true"


def test_config_yaml_matches_declared_parameters():
    pytest.importorskip("rclpy", reason="rclpy (ROS 2) is not installed")
    pytest.importorskip("oxygen_ros.msg", reason="oxygen_ros messages are not built")
    from rcl_interfaces.msg import ParameterType
    from oxygen_ros.ros.node import PARAMETERS

    cfg = yaml.safe_load((REPO / "config" / "oxygen.yaml").read_text())
    params = cfg["/**"]["ros__parameters"]
    assert set(params) == set(PARAMETERS), (set(params) ^ set(PARAMETERS))
    types_ = {ParameterType.PARAMETER_BOOL: bool, ParameterType.PARAMETER_INTEGER: int,
              ParameterType.PARAMETER_DOUBLE: float, ParameterType.PARAMETER_STRING: str,
              ParameterType.PARAMETER_STRING_ARRAY: list, ParameterType.PARAMETER_INTEGER_ARRAY: list,
              ParameterType.PARAMETER_DOUBLE_ARRAY: list}
    for name, value in params.items():
        typ, default, _desc, rng = PARAMETERS[name][:4]
        assert isinstance(value, types_[typ]) and not (typ == ParameterType.PARAMETER_INTEGER
                                                       and isinstance(value, bool)), name
        if isinstance(rng, tuple) and rng and isinstance(rng[0], str):
            assert value in rng, name
        elif rng is not None:
            assert rng[0] <= value <= rng[1], name
    assert params["preset"] == "tiny" and params["control_rate_hz"] == 70.0
    assert len(params["camera_topics"]) == 3
