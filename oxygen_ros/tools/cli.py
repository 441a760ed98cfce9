"""The `oxygen` command: one entry point for the package's tools.

  oxygen node [ROS args]        the lifecycle node (same as `oxygen_node` / `ros2 run oxygen_ros oxygen_node`)
  oxygen sim [ROS args]         the simulated ALOHA robot node (same as `ros2 run oxygen_ros sim_node`)
  oxygen demo [...]             the main job: the simulated robot driven by the shipped demo policy (closed loop),
                                questions, memory, live metrics, video + plot; --bag: the open-loop bag demo
  oxygen bench [...]            engine benchmark: isolated vs shared vs oxygen, side by side (no ROS needed)
  oxygen smoothness [...]       executed-action smoothness at chunk switches: none vs blend vs rtc (no ROS needed)
  oxygen make-bag [...]         write a synthetic multi-camera rosbag2
  oxygen replay BAG [...]       republish a bag's raw messages at recorded timing (no `ros2 bag` needed);
                                --record OUT also records the node's outputs
  oxygen bag-eval BAG [...]     run a bag through the node's inference path offline, deterministically -> output bag
  oxygen bag-diff A B [...]     compare two output bags (actions per joint, texts per answer); exit 1 if they differ
  oxygen ros-bench [...]        control-topic rate, jitter and camera-to-chunk latency through real DDS
  oxygen soak [...]             minutes of node + replay + questions, sampling the node's RSS (memory stays flat)
  oxygen sim-record [...]       scripted-expert episodes in the MuJoCo simulation -> an episode bag (training data)
  oxygen sim-eval [...]         closed-loop evaluation in the simulation over a grid (engine mode, chunking, delay,
                                language load): success with Wilson intervals, smoothness, answer accuracy, videos;
                                --trace: where and why episodes fail (distance, milestones, stalls)
  oxygen sim-diagnose [...]     visual grounding: does the policy's planned endpoint move with the named cube?
  oxygen train BAGS [...]       train / fine-tune the pi0.5 model on episode bags (torchrun for DDP) -> a checkpoint
  oxygen train-vision [...]     pretrain the vision tower to locate the cubes in rendered scenes (for --init-vision)

Each subcommand's module is imported only when it is used, so `oxygen bench` and `oxygen smoothness`
run on a machine without ROS.  Each subcommand's function takes its arguments and returns its exit status (an int:
0 success, 1 a negative result such as "the bags differ", 2 bad input; None counts as 0); returning anything else
is a bug of that subcommand and raises TypeError naming it, never a silent success.  test/test_cli.py runs every
entry of COMMANDS through the installed `oxygen` script.
"""
import importlib
import os
import signal
import sys

# the two nodes handle SIGINT/SIGTERM themselves (ros/node.py; rclpy in the sim node); every other command gets
# _stop_on_sigterm
OWN_SIGNALS = {"node", "sim"}

COMMANDS = {
    "node": ("oxygen_ros.ros.node", "main"),
    "sim": ("oxygen_ros.ros.sim_node", "main"),
    "demo": ("oxygen_ros.tools.sim.demo", "main"),
    "bench": ("oxygen_ros.tools.bench.command", "main"),
    "smoothness": ("oxygen_ros.tools.bench.smoothness", "main"),
    "make-bag": ("oxygen_ros.tools.bags.replay", "make_bag_main"),
    "replay": ("oxygen_ros.tools.bags.replay", "replay_main"),
    "bag-eval": ("oxygen_ros.tools.bags.eval", "main"),
    "bag-diff": ("oxygen_ros.tools.bags.diff", "main"),
    "ros-bench": ("oxygen_ros.tools.node.ros_bench", "main"),
    "soak": ("oxygen_ros.tools.node.soak", "main"),
    "sim-record": ("oxygen_ros.tools.sim.record", "main"),
    "sim-eval": ("oxygen_ros.tools.sim.eval", "main"),
    "sim-diagnose": ("oxygen_ros.tools.sim.diagnose", "main"),
    "train": ("oxygen_ros.tools.train", "main"),
    "train-vision": ("oxygen_ros.tools.train_vision", "main"),
}


def _default_ament_prefix() -> None:
    """PyPI's ROS wheels don't set AMENT_PREFIX_PATH; point it at this environment when it holds our index entry."""
    if os.environ.get("AMENT_PREFIX_PATH"):
        return
    marker = os.path.join(sys.prefix, "share", "ament_index", "resource_index", "packages", "oxygen_ros")
    if os.path.exists(marker):
        os.environ["AMENT_PREFIX_PATH"] = sys.prefix


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0
    if argv[0] not in COMMANDS:
        print(f"usage: oxygen COMMAND [args]  (oxygen --help)\noxygen: error: unknown command {argv[0]!r}; choose "
              f"from {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    _default_ament_prefix()
    module, func = COMMANDS[argv[0]]
    own_signals = argv[0] in OWN_SIGNALS
    if not own_signals:
        signal.signal(signal.SIGTERM, _stop_on_sigterm)
    try:
        return exit_status(argv[0], getattr(importlib.import_module(module), func)(argv[1:]))
    except KeyboardInterrupt:
        if own_signals:
            raise
        print(f"oxygen {argv[0]}: interrupted", file=sys.stderr)
        return 130


def _stop_on_sigterm(signum, _frame) -> None:
    """SIGTERM ends a tool the way Ctrl-C does: an exception in the main thread, so that its ``finally`` blocks stop
    what it started (sim-eval's worker processes, the demo's and the realtime evaluation's node processes) instead of
    the default action killing the tool alone and leaving them running.  Once: a second SIGTERM during that cleanup
    is ignored (the cleanup is bounded: terminate, then join with a timeout)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise SystemExit(128 + signum)


def exit_status(command: str, result) -> int:
    """A subcommand's return value as the process exit status: an int as is, None as 0; anything else (a results
    dict, a bool) is a bug of that subcommand, reported as such."""
    if result is None:
        return 0
    if isinstance(result, bool) or not isinstance(result, int):
        raise TypeError(f"oxygen {command}: its main function returned a {type(result).__name__}, not an exit status "
                        "(an int)")
    return result


if __name__ == "__main__":
    sys.exit(main())
