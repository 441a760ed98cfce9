"""oxygen_ros.tools.node: the whole node over DDS, fed a replayed bag and watched from outside (a child process
through ``tools/harness.py``): ``oxygen ros-bench`` (``ros_bench.py``: rate, jitter, latency, smoothness) and
``oxygen soak`` (``soak.py``: memory over a long run)."""
