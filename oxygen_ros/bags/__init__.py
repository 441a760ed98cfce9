"""oxygen_ros.bags: what every reader and writer of the project's rosbag2 bags shares, below both ``train/`` and
``tools/``: the rosbags type store with the ``oxygen_ros`` message types (``types.py``).  No rclpy, no ``ros/``."""
