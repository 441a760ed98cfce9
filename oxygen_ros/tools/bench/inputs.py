"""The benchmark's seeded inputs: synthetic frames (random images, state), action noise and the language arrival
schedule (one request per frame, or Poisson arrivals with mixed lengths), identical for every mode of a run."""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from ...model import Observation

PROMPT = "pick up the red block"
QUESTIONS = ["what do you see?", "where is the red block?", "is the gripper open?", "what is next?"]


def make_frames(cfg, n: int, seed: int, state_dim: int = 7, masked_camera: Optional[int] = None) -> list:
    rng = np.random.default_rng(seed)
    S = cfg.image_size
    frames = []
    for i in range(n):
        imgs = [rng.integers(0, 256, (S, S, 3), dtype=np.uint8) for _ in range(cfg.num_cameras)]
        if masked_camera is not None:
            imgs[masked_camera] = None
        frames.append(Observation(images=imgs, state=rng.uniform(-1, 1, state_dim).astype(np.float32),
                                  prompt=PROMPT, stamp=float(i) / 10.0, frame_index=i))
    return frames


def make_noise(cfg, n: int, seed: int) -> list:
    g = torch.Generator().manual_seed(seed + 1)
    return [torch.randn((1, cfg.action_horizon, cfg.action_dim), generator=g) for _ in range(n)]


def make_arrivals(n: int, seed: int, N: int, arrivals: str = "per-frame", mixed_lengths: bool = False,
                  kinds=("subtask",), rate: float = 1.0) -> list:
    """Per frame, a list of (kind, prompt, max_new_tokens)."""
    rng = np.random.default_rng(seed + 2)
    out, j = [], 0
    for _ in range(n):
        m = 1 if arrivals == "per-frame" else int(rng.poisson(rate))
        row = []
        for _ in range(m):
            kind = kinds[j % len(kinds)]
            prompt = "" if kind == "subtask" else QUESTIONS[j % len(QUESTIONS)]
            n_new = int(rng.integers(max(1, N // 3), 2 * N + 1)) if mixed_lengths else N
            row.append((kind, prompt, n_new))
            j += 1
        out.append(row)
    return out
