"""``oxygen sim-eval``'s episode videos (``tools/sim/video.py`` fed by the evaluation's hooks; every other sim-eval
test runs ``--no-video``): one MP4 per grid cell, of that cell's first episode, that decodes, plays at the camera rate
for the episode's length, shows the three cameras side by side above the joint-command traces and the text panel, and
changes as the arm moves; the results name it.  The scripted expert drives (no model) at 16 px cameras."""
from __future__ import annotations

import json

import numpy as np
import pytest

import oxygen_ros.sim  # noqa: F401 - sets MUJOCO_GL=egl before mujoco is imported

pytest.importorskip("mujoco", reason="the simulation needs mujoco (requirements.txt)")
pytest.importorskip("imageio_ffmpeg", reason="videos need imageio-ffmpeg (requirements.txt)")


def test_sim_eval_writes_one_playable_video_per_cell_of_its_first_episode(tmp_path):
    import imageio.v2 as imageio

    from oxygen_ros.tools.sim import eval as sim_eval
    from oxygen_ros.tools.sim.video import _PANEL_H, _TEXT_H, _W_CAM
    out = tmp_path / "ev"
    assert sim_eval.main(["--policy", "expert", "--task", "reach", "--seeds", "0:2", "--camera-size", "16",
                          "--chunking", "blend,none", "--quiet", "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())
    videos = sorted((out / "videos").glob("*.mp4"))
    cells = {c["name"] for c in res["cells"]}
    assert {v.stem for v in videos} == cells                              # one per cell, named after it
    for cell in cells:
        eps = [e for e in res["episodes"] if e["cell"] == cell]
        first = [e for e in eps if e.get("video")]
        assert len(first) == 1 and first[0]["seed"] == 0                # the cell's first episode only
        assert first[0]["video"] == str(out / "videos" / f"{cell}.mp4")
        r = imageio.get_reader(first[0]["video"])
        assert r.get_meta_data()["fps"] == pytest.approx(10.0)          # the camera rate: real time
        frames = [f for f in r]
        r.close()
        n_cam = int(round(first[0]["duration_s"] * 10))                  # one video frame per camera frame
        assert abs(len(frames) - n_cam) <= 1, (len(frames), n_cam)
        h, w = frames[0].shape[:2]
        assert w == 3 * _W_CAM and h == _W_CAM + _PANEL_H + _TEXT_H
        cams = np.stack([f[:_W_CAM].astype(np.int16) for f in frames])
        assert np.abs(cams[-1] - cams[0]).mean() > 1.0                   # the arm moved between first and last
        assert cams.std() > 5                                             # pictures, not a blank screen
