#!/usr/bin/env bash
# Checks the colcon build path without a ROS install: builds this package with colcon from PyPI against PyPI's
# ROS 2 build-tool wheels in a throw-away venv (colcon-core wants setuptools < 80, torch wants >= 77, so colcon
# stays out of the project's .venv), then imports the generated messages from the colcon install tree with the
# project's interpreter. On the robot, use a plain `colcon build` in a ROS 2 Jazzy workspace instead.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
work=${1:-/tmp/oxygen-colcon-check}
rm -rf "$work" && mkdir -p "$work/ws/src"
python3 -m venv "$work/venv"
"$work/venv/bin/pip" install -q colcon-common-extensions "setuptools<80" -r "$here/requirements-build.txt" \
  ros-std-msgs ros-builtin-interfaces
git -C "$here" archive --prefix=oxygen_ros/ HEAD | tar x -C "$work/ws/src"
export AMENT_PREFIX_PATH=$work/venv CMAKE_PREFIX_PATH=$work/venv PATH=$work/venv/bin:$PATH
(cd "$work/ws" && colcon build --event-handlers console_direct- \
  --cmake-args -DBUILD_TESTING=OFF -DPython3_EXECUTABLE="$work/venv/bin/python")
inst=$work/ws/install/oxygen_ros
test -x "$inst/lib/oxygen_ros/oxygen_node" && test -x "$inst/lib/oxygen_ros/converse_client"
test -f "$inst/share/oxygen_ros/launch/oxygen.launch.py"
test -f "$inst/share/oxygen_ros/config/oxygen.yaml"
site=$(ls -d "$inst"/lib/python3*/site-packages)
cd /tmp && env -u _ROS_WHEELS_BOOTSTRAP_COMPLETE LD_LIBRARY_PATH="$inst/lib" PYTHONPATH="$site" \
  "$here/.venv/bin/python" -c "from oxygen_ros.msg import ActionChunk, ConversationResponse, LanguageToken, MemoryEntry; from oxygen_ros.srv import QueryMemory, ClearMemory; from oxygen_ros.action import Converse; print('colcon build OK')"
