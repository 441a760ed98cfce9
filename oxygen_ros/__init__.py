"""oxygen_ros: a ROS 2 node serving a pi0.5-style VLA with unified KV cache management (OxyGen).

The generated message package (``oxygen_ros.msg``) and this hand-written code are installed into the same
``oxygen_ros`` directory by ``pip install .`` / ``colcon build``.  ``extend_path`` additionally lets a source
checkout on ``sys.path`` (development) find the installed, generated ``oxygen_ros.msg``.
"""
from pkgutil import extend_path

__path__ = extend_path(__path__, __name__)
