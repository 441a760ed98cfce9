"""action_chunk rate over real DDS while one fault at a time hits the node (node + looping replay, tiny model, H=50):
malformed and unusable / future-stamped wrist frames, NaN joint states, a prompt flood, an injected exception in
every cycle.  Usage (from the checkout): AMENT_PREFIX_PATH=.venv .venv/bin/python bench/fault_rates.py OUT.json.
Uses the node-test helpers in test/ (same node process and replay as test_node.py)."""
import sys, time, tempfile, json
from pathlib import Path
import numpy as np
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "test"))
import conftest
from conftest import RosHelper, start_replay, stop_proc
from test_node import Env, BASE_PARAMS, _bad_image, _unusable_frame
from sensor_msgs.msg import Image, JointState
from std_msgs.msg import String
from oxygen_ros.tools.bags.replay import make_bag, JOINT_NAMES
from pathlib import Path
tmp = Path(tempfile.mkdtemp())
bag = make_bag(tmp / "bag", duration=6.0, fps=15.0, width=224, height=224)
ros = RosHelper()
env = Env(ros, tmp, bag); env.start_node(); env.start_replay(); env.wait_chunks()
time.sleep(3)
def rate(fn, secs=4.0):
    t0 = time.monotonic(); i = 0
    while time.monotonic() - t0 < secs:
        fn(i); i += 1; time.sleep(0.05)
    got = env.chunks_since(t0 + 0.5); return len(got) / (secs - 0.5)
res = {}
res["baseline"] = rate(lambda i: None)
cam = ros.publisher(Image, "camera/left_wrist/image_raw"); js = ros.publisher(JointState, "joint_states")
pr = ros.publisher(String, "conversation/prompt", qos=1000); fault = ros.publisher(String, "oxygen_node/inject_fault")
time.sleep(1)
res["malformed wrist frames (4 kinds, 20/s)"] = rate(lambda i: cam.publish(_bad_image(("encoding", "size", "step", "truncated")[i % 4])))
res["unusable/future-stamped wrist frames (20/s)"] = rate(lambda i: cam.publish(_unusable_frame(("strip", "sliver", "future")[i % 3], ros)))
res["NaN joint states (20/s)"] = rate(lambda i: js.publish(JointState(name=list(JOINT_NAMES), position=[float("nan")] * len(JOINT_NAMES))))
res["prompt flood (50 per 50 ms)"] = rate(lambda i: [pr.publish(String(data=f"q{i}-{k}?")) for k in range(50)])
res["injected cycle exception (20/s)"] = rate(lambda i: fault.publish(String(data="cycle_exception")))
for k, v in res.items(): print(f"{k:45s} {v:5.1f} Hz")
out = Path(sys.argv[1] if len(sys.argv) > 1 else "out/fault_rates.json"); out.parent.mkdir(parents=True, exist_ok=True)
json.dump(res, open(out, "w"), indent=1)
env.close(); ros.close()
