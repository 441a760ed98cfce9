"""oxygen_ros.sim: the MuJoCo simulation of a bimanual ALOHA (gym-aloha's model) with seeded tasks, ground truth, a
scripted expert, the robot-side execution rule and lockstep episodes.  ROS-free (mujoco + numpy).  Importing it sets
``MUJOCO_GL=egl`` (headless rendering) unless already set; it must happen before anything imports mujoco."""
import os

os.environ.setdefault("MUJOCO_GL", "egl")
