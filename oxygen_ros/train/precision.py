"""bf16 autocast only where the hardware computes bf16: ``--bf16 auto`` turns it on there, ``--bf16`` (on) elsewhere is
refused.  Without avx512_bf16 / AMX a CPU emulates bf16, and what was a speed-up on the VM the demo policy was trained
on (avx512_bf16) becomes a slow-down on an AVX2-only one (measured there: a
demo-preset training step over 3x slower than fp32, a bf16 matmul 29x)."""
from __future__ import annotations

import torch

__all__ = ["bf16_native", "resolve_bf16"]


def bf16_native(device: torch.device) -> bool:
    """Whether ``device`` computes bf16 in hardware: a CUDA GPU that supports it, a CPU with avx512_bf16 or AMX.
    Elsewhere autocast emulates bf16 - on an AVX2-only VM a 3200 x 128 @ 128 x 512 matmul took 29x as
    long as in fp32, and a demo-preset training step ran under 0.16 steps/s against fp32's 0.55."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    probes = [getattr(torch.cpu, n, None) for n in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    probes = [f for f in probes if f is not None]
    return any(f() for f in probes) if probes else True      # a torch without the probes: trust the request


def resolve_bf16(choice, device: torch.device) -> bool:
    """``--bf16`` as given (True / "on", False / "off", "auto") -> whether to autocast.  "auto" = where the device has
    native bf16 (``bf16_native``); "on" where it has not is a ValueError saying so, not a silently slower run."""
    c = {True: "on", False: "off", None: "off"}.get(choice, str(choice).strip().lower())
    if c not in ("on", "off", "auto"):
        raise ValueError(f"--bf16 {choice!r}: expected on, off or auto")
    if c == "off":
        return False
    native = bf16_native(device)
    if c == "on" and not native:
        raise ValueError(f"--bf16: this {device.type} has no native bf16 (no avx512_bf16 / AMX): autocast would emulate "
                         "it, several times slower per step than fp32 - use --bf16 auto or leave it out")
    return native
