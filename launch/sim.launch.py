"""Launch the simulated robot with the policy node: ``ros2 launch oxygen_ros sim.launch.py``.

This file owns the closed loop on a ROS 2 install (or with the launch wheels, see the README): ``sim_node`` (the
MuJoCo ALOHA: cameras, joint_states, /clock, episodes; executes joint_trajectory) and ``oxygen_node`` on sim time with
``config/sim_aloha.yaml`` (50 Hz control, the 14 ALOHA joints, joint_trajectory output).  Arguments (all optional):
  checkpoint          policy checkpoint ("" = the params file's; "demo" = the shipped demo policy)
  preset              model size without a checkpoint (random weights)
  params_file         oxygen_node parameters (default <share>/oxygen_ros/config/sim_aloha.yaml)
  task, seed, episodes   the simulation's episodes (reach | pick | transfer; first seed; 0 = forever)
  clock               realtime | lockstep (see sim_node);  real_time_factor (realtime), delay_steps (lockstep)
  camera_rate_hz, camera_size, execute (joint_trajectory | action_chunk)
  engine_mode         oxygen | shared | isolated ("" = params file)
  device, compile     the policy's device and hot path ("" = params file: auto = CUDA + cudagraphs when present)
  log_level           ROS log level of both nodes
"""
from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, OpaqueFunction
from launch.substitutions import LaunchConfiguration, PathJoinSubstitution
from launch_ros.actions import Node
from launch_ros.substitutions import FindPackageShare

_SIM = {"task": str, "seed": int, "episodes": int, "clock": str, "real_time_factor": float, "delay_steps": int,
        "camera_rate_hz": float, "camera_size": int, "execute": str}
_POLICY = ("checkpoint", "preset", "engine_mode", "device", "compile")


def _nodes(context, *args, **kwargs):
    get = lambda name: LaunchConfiguration(name).perform(context)  # noqa: E731
    sim_params = {k: conv(get(k)) for k, conv in _SIM.items() if get(k) != ""}
    policy = {k: get(k) for k in _POLICY if get(k) != ""}
    policy["use_sim_time"] = True
    level = ["--ros-args", "--log-level", get("log_level")]
    return [
        Node(package="oxygen_ros", executable="sim_node", name="oxygen_sim", parameters=[sim_params],
             output="screen", emulate_tty=True, arguments=level),
        Node(package="oxygen_ros", executable="oxygen_node", name="oxygen_node",
             parameters=[get("params_file"), policy], output="screen", emulate_tty=True, arguments=level),
    ]


def generate_launch_description():
    default_params = PathJoinSubstitution([FindPackageShare("oxygen_ros"), "config", "sim_aloha.yaml"])
    args = [DeclareLaunchArgument("params_file", default_value=default_params, description="oxygen_node YAML"),
            DeclareLaunchArgument("log_level", default_value="info", description="log level of both nodes")]
    args += [DeclareLaunchArgument(k, default_value="", description=f"sim_node {k}") for k in _SIM]
    args += [DeclareLaunchArgument(k, default_value="", description=f"oxygen_node {k}") for k in _POLICY]
    return LaunchDescription(args + [OpaqueFunction(function=_nodes)])
