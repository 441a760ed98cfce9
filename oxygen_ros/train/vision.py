"""Vision pretraining: teach the SigLIP tower to locate the cubes before it meets actions.

Why this room exists: trained from scratch together with the action expert, the demo's 2.4 M-parameter tower learned
the instruction and the arm's motion long before it learned where a 6-pixel cube is - the shipped policy's planned
endpoint did not move with the cube at all (r = -0.03 / +0.10 over 50 scenes; ``oxygen sim-diagnose``).  π0.5 itself
never starts from a blind tower: its SigLIP was pretrained on images.  Here the simulation gives that pretraining for
free: ``render_scenes`` draws table scenes from the tasks' own scene distribution (``sim/tasks.draw_task`` on seeds
disjoint from the training and evaluation episodes), with the arms at randomly perturbed poses (so the grippers occlude
and cross the cubes as they do mid-episode), and renders the base (``top``) camera at the model's image size.  The
tower plus a small ``LocateHead`` - one learned query per colour attending over the tower's tokens, as SigLIP's own
MAP head pools, then (present logit, x, y) - is trained to say which colours are on the table and where (metres,
world frame).  The head is dropped; ``oxygen train --init-vision`` loads the tower's weights (``vision.safetensors``)
into a fresh model, whose expert and VLM then read positions from tokens that already carry them.

``pretrain_vision(options)`` writes ``vision.safetensors`` (the tower's own state dict, the keys of
``Pi05Model.vision``) and ``vision.json`` (options, the validation curve, final error quantiles in cm).
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .precision import resolve_bf16

__all__ = ["VisionOptions", "LocateHead", "render_scenes", "pretrain_vision", "load_vision", "VISION_FILE"]

VISION_FILE = "vision.safetensors"
# label normalisation: x / X_SCALE, (y - Y_CENTRE) / Y_SCALE lands the tasks' cube regions in about [-1, 1]
X_SCALE, Y_CENTRE, Y_SCALE = 0.25, 0.53, 0.2


@dataclass
class VisionOptions:
    out: str
    preset: str = "demo"
    scenes: int = 8000                  # rendered scenes (train + validation)
    val_scenes: int = 512
    steps: int = 1500
    batch_size: int = 64
    lr: float = 1e-3
    warmup: int = 100
    arm_noise: float = 0.3              # rad, uniform on each arm joint, in half of the scenes (0: start pose only)
    first_seed: int = 500_000           # scene seeds first_seed.. (training episodes use 100000.., evaluation 0..)
    seed: int = 0
    bf16: bool | str = False               # on / off / auto (precision.resolve_bf16)
    threads: int = 0
    eval_every: int = 100
    model_overrides: dict = field(default_factory=dict)   # config fields over the preset's (tests: small images)


def render_scenes(n: int, image_size: int, first_seed: int = 500_000, arm_noise: float = 0.3,
                  seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``n`` scenes -> (uint8 images [n, S, S, 3] of the top camera, labels float32 [n, colours, 3] = (present, x, y)
    normalised; colours in ``sorted(COLOURS)`` order).  Scene i is task ``TASKS[i % 3]``'s scene for seed
    ``first_seed + i``; odd scenes move each arm joint by U(-arm_noise, arm_noise) from the start pose."""
    from oxygen_ros.sim.scene import COLOURS, START_POSE, AlohaScene  # noqa: PLC0415 - MuJoCo only when used
    from oxygen_ros.sim.tasks import TASKS, draw_task  # noqa: PLC0415

    colours = sorted(COLOURS)
    rng = np.random.default_rng(seed)
    sim = AlohaScene(camera_size=(image_size, image_size), cameras=("top",))
    images = np.zeros((n, image_size, image_size, 3), np.uint8)
    labels = np.zeros((n, len(colours), 3), np.float32)
    arm = np.ones(14, bool)
    arm[[6, 13]] = False                                      # grippers keep their start opening
    try:
        for i in range(n):
            spec = draw_task(TASKS[i % len(TASKS)], first_seed + i)
            pose = START_POSE.copy()
            if arm_noise > 0 and i % 2:
                pose[arm] += rng.uniform(-arm_noise, arm_noise, size=int(arm.sum()))
            sim.reset(spec.scene, arm_pose=pose)
            images[i] = sim.render()[0]
            for c in spec.scene.cubes:
                labels[i, colours.index(c.colour)] = (1.0, c.x / X_SCALE, (c.y - Y_CENTRE) / Y_SCALE)
    finally:
        sim.close()
    return images, labels


class LocateHead(nn.Module):
    """tokens [B, N, W] -> [B, K, 3] (present logit, x, y): K learned queries, one attention over the tokens, an MLP."""

    def __init__(self, width: int, colours: int = 4, heads: int = 4):
        super().__init__()
        self.queries = nn.Parameter(torch.randn(colours, width) * 0.02)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.out = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU(), nn.Linear(width, 3))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        q = self.queries.expand(len(tokens), -1, -1)
        pooled, _ = self.attn(q, tokens, tokens, need_weights=False)
        return self.out(pooled)


def locate_loss(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Presence BCE + squared position error on the colours present."""
    present = labels[..., 0]
    pos = ((pred[..., 1:] - labels[..., 1:]) ** 2).sum(-1)
    return F.binary_cross_entropy_with_logits(pred[..., 0], present) + (pos * present).sum() / present.sum().clamp(min=1)


def _to_pixels(images: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(images).permute(0, 3, 1, 2).float().div_(127.5).sub_(1.0)       # [n, 3, S, S] in [-1, 1]


@torch.no_grad()
def locate_metrics(vision, head, images: np.ndarray, labels: np.ndarray, dtype=torch.float32) -> dict:
    """Presence accuracy and position error (cm, world) quantiles over the colours present."""
    preds = []
    for i in range(0, len(images), 128):
        with torch.autocast("cpu", torch.bfloat16, enabled=dtype == torch.bfloat16):
            preds.append(head(vision(_to_pixels(images[i:i + 128]), dtype).float()).float())
    p, y = torch.cat(preds), torch.from_numpy(labels)
    present = y[..., 0] > 0
    scale = torch.tensor([X_SCALE, Y_SCALE])
    err = ((p[..., 1:] - y[..., 1:]) * scale).norm(dim=-1)[present] * 100.0
    return {"presence_accuracy": float(((p[..., 0] > 0) == present).float().mean()),
            "err_cm_p50": float(err.median()), "err_cm_p90": float(err.quantile(0.9)),
            "err_cm_max": float(err.max())}


def pretrain_vision(o: VisionOptions, log=print) -> dict:
    """Render, train, write ``vision.safetensors`` + ``vision.json`` into ``o.out``; returns the summary."""
    from safetensors.torch import save_file  # noqa: PLC0415

    from oxygen_ros.model import get_config  # noqa: PLC0415
    from oxygen_ros.model.pi05 import Pi05Model  # noqa: PLC0415

    if o.scenes <= o.val_scenes or o.steps < 1:
        raise ValueError(f"need more scenes ({o.scenes}) than validation scenes ({o.val_scenes}) and steps >= 1")
    if o.threads:
        torch.set_num_threads(o.threads)
    bf16 = resolve_bf16(o.bf16, torch.device("cpu"))        # before minutes of rendering
    out = Path(o.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = get_config(o.preset, **o.model_overrides)
    t0 = time.perf_counter()
    images, labels = render_scenes(o.scenes, cfg.vision.image_size, o.first_seed, o.arm_noise, o.seed)
    render_s = time.perf_counter() - t0
    log(f"rendered {o.scenes} scenes in {render_s:.0f} s")
    vi, vl, ti, tl = images[:o.val_scenes], labels[:o.val_scenes], images[o.val_scenes:], labels[o.val_scenes:]
    torch.manual_seed(o.seed)
    vision = Pi05Model(cfg).vision.float()
    vision.requires_grad_(True).train()
    head = LocateHead(cfg.vision.width, labels.shape[1])
    params = list(vision.parameters()) + list(head.parameters())
    opt = torch.optim.AdamW(params, lr=o.lr, weight_decay=1e-4)
    dtype = torch.bfloat16 if bf16 else torch.float32
    gen = torch.Generator().manual_seed(o.seed)
    curve, t0 = [], time.perf_counter()
    for step in range(1, o.steps + 1):
        lr = o.lr * min(1.0, step / max(1, o.warmup)) * 0.5 * (1.0 + math.cos(math.pi * step / o.steps))
        for g in opt.param_groups:
            g["lr"] = lr
        idx = torch.randint(len(ti), (o.batch_size,), generator=gen).numpy()
        with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            pred = head(vision(_to_pixels(ti[idx]), dtype).float())
        loss = locate_loss(pred.float(), torch.from_numpy(tl[idx]))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % o.eval_every == 0 or step == o.steps:
            vision.eval()
            m = {"step": step, "loss": loss.item(), "seconds": round(time.perf_counter() - t0, 1),
                 **locate_metrics(vision, head, vi, vl, dtype)}
            vision.train()
            curve.append(m)
            log(f"step {step}: loss {m['loss']:.4f}, presence {m['presence_accuracy']:.3f}, "
                f"error p50 {m['err_cm_p50']:.2f} cm / p90 {m['err_cm_p90']:.2f} cm ({m['seconds']:.0f} s)")
    save_file({k: v.detach().contiguous() for k, v in vision.state_dict().items()}, str(out / VISION_FILE))
    summary = {"options": asdict(o), "render_s": round(render_s, 1), "train_s": round(time.perf_counter() - t0, 1),
               "final": curve[-1], "curve": curve}
    (out / "vision.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def load_vision(model, path) -> None:
    """Copy a ``vision.safetensors`` (or the folder holding one) into ``model.vision`` (shapes must match)."""
    from safetensors.torch import load_file  # noqa: PLC0415

    path = Path(path)
    if path.is_dir():
        path = path / VISION_FILE
    state = load_file(str(path))
    own = model.vision.state_dict()
    bad = sorted(k for k in own if k not in state or state[k].shape != own[k].shape)
    extra = sorted(set(state) - set(own))
    if bad or extra:
        raise ValueError(f"{path}: not this model's vision tower (missing / mis-shaped {bad[:3]}, unknown {extra[:3]})")
    if not all(bool(torch.isfinite(v).all()) for v in state.values()):
        raise ValueError(f"{path}: non-finite weights")
    with torch.no_grad():
        for k, v in own.items():
            v.copy_(state[k].to(v.dtype))
