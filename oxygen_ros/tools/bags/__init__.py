"""oxygen_ros.tools.bags: the bag commands: ``oxygen make-bag`` / ``oxygen replay`` (``replay.py``: synthetic input
bags, the raw-CDR player), ``oxygen bag-eval`` (``eval.py``), ``oxygen bag-diff`` (``diff.py``), the output bag's
layout and writer (``output.py``), its recorder over DDS (``recorder.py``; ``classes.py``: ROS classes by type name)
and the node's topic-name resolution (``topic_names.py``).  The type store they share is ``oxygen_ros/bags/types.py``."""
