"""Launch oxygen_node fed by a bag: ``ros2 launch oxygen_ros replay.launch.py bag:=/path/to/bag``.

This file owns the "node + bag replay" launch. Arguments: ``bag`` (required; make one with ``oxygen make-bag``),
``player`` (``ros2bag`` = ``ros2 bag play``, the default on a ROS install; ``oxygen`` = the package's ``oxygen
replay``, which needs no rosbag2 and restamps header.stamp to the time of publication), ``rate`` (1.0), ``loop``
(true), ``clock_hz`` (100: /clock rate with ``use_sim_time:=true``), plus every argument of ``oxygen.launch.py``
(checkpoint, preset, device, params_file, namespace, camera remaps, stamp_source, ...), passed through;
``player_fastdds_profile`` (default: the shipped 32 MiB shared-memory profile, needed for frames over 512 KiB) is
given to the player process.  The player is started as its own process (the ``oxygen`` executable of the package's
lib dir, not through ``ros2 run``, which does not pass launch's SIGINT on), so launch stops it on shutdown.
``use_sim_time:=true`` makes the player publish bag time on ``/clock`` (``--clock``) and keep the recorded stamps.
Without sim time ``ros2 bag play`` keeps the recorded header stamps, which would make every frame older than
``max_observation_age_s``, so with that player the node takes capture time from message arrival
(``stamp_source: receive``) unless ``stamp_source`` is given.
"""
from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, ExecuteProcess, IncludeLaunchDescription, OpaqueFunction
from launch.launch_description_sources import PythonLaunchDescriptionSource
from launch.substitutions import LaunchConfiguration, PathJoinSubstitution
from launch_ros.substitutions import ExecutableInPackage, FindPackageShare

_TOPICS = ("/camera/base/image_raw", "/camera/left_wrist/image_raw", "/camera/right_wrist/image_raw",
           "/joint_states", "/instruction", "/conversation/prompt")
_PASS = ("checkpoint", "preset", "device", "params_file", "namespace", "use_sim_time", "autostart",
         "camera_base", "camera_left_wrist", "camera_right_wrist", "joint_states", "log_level", "fastdds_profile",
         "stamp_source")
_TRUE = ("true", "1", "yes")


def _actions(context, *args, **kwargs):
    get = lambda name: LaunchConfiguration(name).perform(context)  # noqa: E731
    bag, rate, ns, player = get("bag"), get("rate"), get("namespace").strip("/"), get("player")
    loop, sim_time = get("loop").lower() in _TRUE, get("use_sim_time").lower() in _TRUE
    launch_args = {name: get(name) for name in _PASS}
    # the player writes the camera frames: give it the big shared-memory segment (frames > 512 KiB)
    env = {"FASTDDS_DEFAULT_PROFILES_FILE": get("player_fastdds_profile")} if get("player_fastdds_profile") else None
    clock = ["--clock", get("clock_hz")] if sim_time else []
    if player == "oxygen":
        cmd = [ExecutableInPackage("oxygen", "oxygen_ros"), "replay", bag, "--rate", rate] + \
              (["--loop"] if loop else []) + (["--namespace", ns] if ns else []) + clock
        proc = ExecuteProcess(cmd=cmd, output="screen", name="oxygen_replay", additional_env=env)
    else:
        cmd = ["ros2", "bag", "play", bag, "--rate", rate] + (["--loop"] if loop else []) + clock
        if ns:
            cmd += ["--remap"] + [f"{t}:=/{ns}{t}" for t in _TOPICS]
        proc = ExecuteProcess(cmd=cmd, output="screen", name="ros2_bag_play", additional_env=env)
        if not sim_time and launch_args["stamp_source"] == "":
            launch_args["stamp_source"] = "receive"     # recorded stamps are old (see the module docstring)
    oxygen_launch = PathJoinSubstitution([FindPackageShare("oxygen_ros"), "launch", "oxygen.launch.py"])
    include = IncludeLaunchDescription(PythonLaunchDescriptionSource(oxygen_launch),
                                       launch_arguments=launch_args.items())
    return [include, proc]


def generate_launch_description():
    default_params = PathJoinSubstitution([FindPackageShare("oxygen_ros"), "config", "oxygen.yaml"])
    large_frames = PathJoinSubstitution([FindPackageShare("oxygen_ros"), "config", "fastdds_large_frames.xml"])
    args = [
        DeclareLaunchArgument("bag", description="rosbag2 directory to play"),
        DeclareLaunchArgument("player", default_value="ros2bag", choices=["ros2bag", "oxygen"],
                              description="ros2bag (ros2 bag play) | oxygen (oxygen replay)"),
        DeclareLaunchArgument("rate", default_value="1.0", description="playback rate"),
        DeclareLaunchArgument("loop", default_value="true", description="loop the bag"),
        DeclareLaunchArgument("clock_hz", default_value="100", description="/clock rate with use_sim_time:=true"),
        DeclareLaunchArgument("checkpoint", default_value=""),
        DeclareLaunchArgument("preset", default_value=""),
        DeclareLaunchArgument("device", default_value=""),
        DeclareLaunchArgument("params_file", default_value=default_params),
        DeclareLaunchArgument("namespace", default_value=""),
        DeclareLaunchArgument("use_sim_time", default_value="",
                              description="true: the node follows /clock and the player publishes it"),
        DeclareLaunchArgument("autostart", default_value=""),
        DeclareLaunchArgument("camera_base", default_value=""),
        DeclareLaunchArgument("camera_left_wrist", default_value=""),
        DeclareLaunchArgument("camera_right_wrist", default_value=""),
        DeclareLaunchArgument("joint_states", default_value=""),
        DeclareLaunchArgument("stamp_source", default_value="", description="header | receive"),
        DeclareLaunchArgument("log_level", default_value="info"),
        DeclareLaunchArgument("fastdds_profile", default_value=""),
        DeclareLaunchArgument("player_fastdds_profile", default_value=large_frames,
                              description="Fast DDS profile of the bag player ('' = none)"),
    ]
    return LaunchDescription(args + [OpaqueFunction(function=_actions)])
