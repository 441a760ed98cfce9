"""Where training runs: the device (``--device``) and the DDP backend that can reduce its tensors.  bf16 on that
device: ``precision.py``."""
from __future__ import annotations

import os

import torch

__all__ = ["resolve_device", "ddp_backend"]


def resolve_device(name: str = "auto") -> torch.device:
    """``auto`` -> CUDA when available (``cuda:LOCAL_RANK`` under torchrun), else the CPU; ``cuda`` likewise picks
    the local rank's GPU; anything else as given.  ValueError for CUDA without a GPU or an unknown name."""
    name = (name or "auto").strip().lower()
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(name)
    except RuntimeError as exc:
        raise ValueError(f"--device {name!r}: {exc}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name}: CUDA is not available here (use cpu or auto)")
        if dev.index is None:
            dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    elif dev.type != "cpu":
        raise ValueError(f"--device {name}: training runs on cpu or cuda")
    return dev


def ddp_backend(device: torch.device) -> str:
    """NCCL for CUDA tensors, gloo for CPU tensors (NCCL cannot reduce host tensors)."""
    return "nccl" if device.type == "cuda" else "gloo"
