"""oxygen_ros.train: training the package's pi0.5 on rosbag2 episode bags (data, tokenizer, losses, the trainer with
checkpoints, resume and DDP).  ROS-free: torch, numpy, rosbags, sentencepiece; the command is ``oxygen train``."""
