"""Per-component timings of the model primitives for a preset (random weights): prefill (3 cameras, a full
``max_token_len`` prompt), one denoise step (from S=10 vs S=1 calls, so per-call set-up is not counted), a whole
``sample_actions``, a frame (prefill + S steps), and one decode step at batch 1 and 6 over a full prefix.  Reports the
minimum over repeats (robust to other processes on a shared machine).

    python -m oxygen_ros.model.timing --preset bench-cpu --threads 2
"""
from __future__ import annotations

import argparse
import json
import time
from types import SimpleNamespace

import torch

from .config import get_config
from .pi05 import DecodeBatch, build_model


def _best_ms(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def measure(preset: str = "bench-cpu", repeats: int = 10, device: str = "cpu", decode_batches=(1, 6)) -> dict:
    cfg = get_config(preset)
    model = build_model(cfg, device=device)
    C, L, S = cfg.num_cameras, cfg.max_token_len, cfg.image_size
    g = torch.Generator().manual_seed(0)
    images = (torch.rand(1, C, 3, S, S, generator=g) * 2 - 1).to(device)
    image_masks = torch.ones(1, C, dtype=torch.bool, device=device)
    tokens = torch.randint(3, cfg.vocab_size, (1, L), generator=g).to(device)
    token_masks = torch.ones(1, L, dtype=torch.bool, device=device)
    noise = torch.randn(1, cfg.action_horizon, cfg.action_dim, generator=g).to(device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def run(f):
        return lambda: (f(), sync())

    prefix = model.prefill(images, image_masks, tokens, token_masks, want_logits=True)
    out = {"preset": preset, "threads": torch.get_num_threads(), "prefix_len": prefix.length}
    out["prefill_ms"] = _best_ms(run(lambda: model.prefill(images, image_masks, tokens, token_masks, True)), repeats)
    steps = cfg.num_denoise_steps
    full = _best_ms(run(lambda: model.sample_actions(prefix, noise, steps)), repeats)
    one = _best_ms(run(lambda: model.sample_actions(prefix, noise, 1)), repeats)
    out["sample_actions_ms"] = full
    out["denoise_step_ms"] = (full - one) / max(steps - 1, 1)
    out["frame_ms"] = _best_ms(run(lambda: model.sample_actions(
        model.prefill(images, image_masks, tokens, token_masks), noise, steps)), repeats)
    P = prefix.length
    for B in decode_batches:
        T = P + 1
        kv = SimpleNamespace(k=[torch.zeros(B * T, cfg.num_kv_heads, cfg.head_dim, dtype=model.dtype, device=device)
                                for _ in range(cfg.num_layers)],
                             v=[torch.zeros(B * T, cfg.num_kv_heads, cfg.head_dim, dtype=model.dtype, device=device)
                                for _ in range(cfg.num_layers)])
        read = (torch.arange(B)[:, None] * T + torch.arange(T)[None]).to(device)
        batch = DecodeBatch(torch.full((B,), 5, device=device), torch.full((B,), P, device=device), read[:, -1], read,
                            torch.ones(B, T, dtype=torch.bool, device=device))
        out[f"decode_b{B}_ms"] = _best_ms(run(lambda: model.decode(batch, kv)), repeats)
    return {k: round(v, 2) if isinstance(v, float) else v for k, v in out.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="bench-cpu")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    print(json.dumps(measure(a.preset, a.repeats, a.device)))


if __name__ == "__main__":
    main()
