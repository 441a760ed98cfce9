"""Episode videos: the three cameras side by side, the executed joint commands as traces, the task and its outcome,
and the questions / answers and memory entries as they arrive - one MP4 (H.264 via imageio-ffmpeg) per episode.

This file owns the picture only; ``EpisodeVideo`` is fed by the runners' hooks (``add_frame`` at every camera frame
with the executed commands so far and the language events up to that moment) and ``write(path)`` encodes it at the
camera rate (real time).  OpenCV draws the text and traces.
"""
from __future__ import annotations

import numpy as np

__all__ = ["EpisodeVideo"]

_W_CAM = 200
_PANEL_H = 152
_TEXT_H = 96


class EpisodeVideo:
    def __init__(self, title: str, fps: float):
        self.title, self.fps = title, float(fps)
        self.frames: list[np.ndarray] = []

    def add_frame(self, t: float, images: list, commands: np.ndarray, lines: list[str], status: str) -> None:
        import cv2  # noqa: PLC0415

        cams = [cv2.resize(im, (_W_CAM, _W_CAM), interpolation=cv2.INTER_NEAREST) for im in images]
        top = np.concatenate(cams, axis=1)
        W = top.shape[1]
        panel = np.full((_PANEL_H, W, 3), 255, np.uint8)
        a = np.asarray(commands, dtype=np.float64)
        if len(a) > 1:
            window = a[-250:]                                   # the last 5 s at 50 Hz
            lo, hi = window.min(), window.max()
            span = max(hi - lo, 1e-6)
            xs = np.linspace(0, W - 1, len(window)).astype(np.int32)
            for j in range(window.shape[1]):
                ys = (_PANEL_H - 6 - (window[:, j] - lo) / span * (_PANEL_H - 12)).astype(np.int32)
                hue = int(180 * j / window.shape[1])
                color = cv2.cvtColor(np.uint8([[[hue, 200, 200]]]), cv2.COLOR_HSV2RGB)[0, 0].tolist()
                cv2.polylines(panel, [np.stack([xs, ys], axis=1)], False, color, 1, cv2.LINE_AA)
        cv2.putText(panel, "executed joint commands (last 5 s)", (4, 12), cv2.FONT_HERSHEY_SIMPLEX, 0.35, (0, 0, 0), 1)
        text = np.full((_TEXT_H, W, 3), 245, np.uint8)
        rows = [f"{self.title}   t = {t:5.2f} s   {status}"] + list(lines)[-5:]
        for i, row in enumerate(rows):
            cv2.putText(text, row[:110], (4, 14 + 16 * i), cv2.FONT_HERSHEY_SIMPLEX, 0.38, (0, 0, 0), 1,
                        cv2.LINE_AA)
        self.frames.append(np.concatenate([top, panel, text], axis=0))

    def write(self, path) -> str:
        import imageio.v2 as imageio  # noqa: PLC0415

        path = str(path)
        with imageio.get_writer(path, fps=self.fps, codec="libx264", quality=7, macro_block_size=8) as w:
            for f in self.frames:
                w.append_data(f)
        return path
