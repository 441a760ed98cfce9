"""Launch oxygen_node: ``ros2 launch oxygen_ros oxygen.launch.py checkpoint:=/path/to/pi05``.

This file owns how the node is launched on a ROS 2 install.  Arguments (all optional):
  checkpoint          pi0.5 checkpoint directory ("" = the params file's value; random weights of `preset` if none)
  preset              tiny | bench-cpu | demo | pi05 when no checkpoint ("" = the params file's value, default tiny)
  device              auto | cpu | cuda | cuda:N ("" = params file: auto = cuda when available, else cpu)
  compile             auto | none | inductor | cudagraphs | inductor-graphs ("" = params file: auto = cudagraphs
                      on CUDA, eager elsewhere)
  params_file         parameter YAML (default: <share>/oxygen_ros/config/oxygen.yaml)
  namespace           node namespace; relative topics (camera/..., action_chunk, ...) move with it
  camera_base, camera_left_wrist, camera_right_wrist
                      remap the three camera inputs to your topics (e.g. camera_base:=/cam0/color/image_raw)
  joint_states        remap the joint state input
  use_sim_time        true to follow /clock (e.g. `ros2 bag play --clock`); "" = params file (default false)
  autostart           false to leave configure/activate to a lifecycle manager ("" = params file)
  stamp_source        header | receive: where the observation capture time comes from ("" = params file)
  fastdds_profile     Fast DDS XML profile for the node's process (e.g. <share>/oxygen_ros/config/
                      fastdds_large_frames.xml; what matters for big frames is the camera driver's profile)
  log_level           ROS log level of the node (info)
Only arguments given a non-empty value override the params file, so a robot-specific YAML stays in charge.
"""
from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, OpaqueFunction
from launch.substitutions import LaunchConfiguration, PathJoinSubstitution
from launch_ros.actions import Node
from launch_ros.substitutions import FindPackageShare

_OVERRIDES = ("checkpoint", "preset", "device", "compile", "stamp_source")
_BOOL_OVERRIDES = ("use_sim_time", "autostart")
_CAMERAS = {"camera_base": "camera/base/image_raw", "camera_left_wrist": "camera/left_wrist/image_raw",
            "camera_right_wrist": "camera/right_wrist/image_raw"}


def _node(context, *args, **kwargs):
    get = lambda name: LaunchConfiguration(name).perform(context)  # noqa: E731
    overrides = {name: get(name) for name in _OVERRIDES if get(name) != ""}
    overrides.update({name: get(name).lower() in ("true", "1", "yes") for name in _BOOL_OVERRIDES if get(name) != ""})
    remaps = [(topic, get(arg)) for arg, topic in _CAMERAS.items() if get(arg) != ""]
    if get("joint_states") != "":
        remaps.append(("joint_states", get("joint_states")))
    return [Node(
        package="oxygen_ros",
        executable="oxygen_node",
        name="oxygen_node",
        namespace=get("namespace"),
        parameters=[get("params_file"), overrides],
        remappings=remaps,
        output="screen",
        emulate_tty=True,
        additional_env={"FASTDDS_DEFAULT_PROFILES_FILE": get("fastdds_profile")} if get("fastdds_profile") else None,
        arguments=["--ros-args", "--log-level", get("log_level")],
    )]


def generate_launch_description():
    default_params = PathJoinSubstitution([FindPackageShare("oxygen_ros"), "config", "oxygen.yaml"])
    args = [
        DeclareLaunchArgument("checkpoint", default_value="", description="pi0.5 checkpoint directory"),
        DeclareLaunchArgument("preset", default_value="", description="tiny | bench-cpu | demo | pi05 (no checkpoint)"),
        DeclareLaunchArgument("device", default_value="", description="auto | cpu | cuda | cuda:N"),
        DeclareLaunchArgument("compile", default_value="", description="auto | none | inductor | cudagraphs | "
                                                                      "inductor-graphs"),
        DeclareLaunchArgument("params_file", default_value=default_params, description="parameter YAML"),
        DeclareLaunchArgument("namespace", default_value="", description="node namespace"),
        DeclareLaunchArgument("use_sim_time", default_value="", description="follow /clock (\"\" = params file)"),
        DeclareLaunchArgument("autostart", default_value="", description="configure+activate at start"),
        DeclareLaunchArgument("joint_states", default_value="", description="remap joint_states"),
        DeclareLaunchArgument("fastdds_profile", default_value="", description="Fast DDS XML profile for the node"),
        DeclareLaunchArgument("stamp_source", default_value="", description="header | receive"),
        DeclareLaunchArgument("log_level", default_value="info", description="node log level"),
    ] + [DeclareLaunchArgument(arg, default_value="", description=f"remap {topic}") for arg, topic in _CAMERAS.items()]
    return LaunchDescription(args + [OpaqueFunction(function=_node)])
