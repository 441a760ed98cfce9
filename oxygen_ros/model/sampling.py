"""Sampling of language tokens from logits, shared by the model's decode step and the engine: ``SamplingParams`` (per
request: temperature, top-p, seed or generator), ``SamplerInputs`` (their per-row tensors, built on the host so the
decode step never reads the device), ``sample_rows`` (a pure tensor function: greedy rows by argmax, the others by
temperature + nucleus with the row's uniform draw) and ``sample_tokens``.  A seeded request's draw for a token is a
pure function of (seed, position), so the same text comes out however the request is batched or chunked.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = ["SamplingParams", "SamplerInputs", "sample_rows", "sample_tokens"]


@dataclass
class SamplingParams:
    """temperature 0 = greedy.  Randomness (see ``decode``): with ``generator`` set, draws come from it (the caller
    keeps one per request); else with ``seed`` set, the draw for a token is a pure function of (seed, position), so a
    seeded request gives the same text however it is batched or chunked; else the global torch RNG."""
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    generator: torch.Generator | None = field(default=None, repr=False, compare=False)



def _row_uniform(sp: SamplingParams, position: int) -> float:
    if sp.generator is not None:
        return torch.rand((), generator=sp.generator).item()
    if sp.seed is not None:
        h = hashlib.blake2b(f"{sp.seed}:{position}".encode(), digest_size=8).digest()
        return (int.from_bytes(h, "little") >> 11) / float(1 << 53)
    return torch.rand(()).item()


@dataclass
class SamplerInputs:
    """Per-row sampling inputs as tensors, built on the host so that the decode step itself never reads the device:
    temperature / top_p / uniform [B] float64 (temperature 0 = a greedy row)."""
    temperature: Tensor
    top_p: Tensor
    uniform: Tensor

    @staticmethod
    def build(sampling: list[SamplingParams] | None, positions: Tensor) -> "SamplerInputs | None":
        """None when every row is greedy.  positions [B]: positions of the tokens whose logits are sampled (the
        seed rule's input; read on the host once here)."""
        if not sampling or all(sp.temperature <= 0 for sp in sampling):
            return None
        if len(sampling) != positions.shape[0]:
            raise ValueError(f"sampling has {len(sampling)} entries for {positions.shape[0]} rows")
        pos = positions.tolist()
        u = [_row_uniform(sp, p) if sp.temperature > 0 else 0.0 for sp, p in zip(sampling, pos)]
        f64 = dict(dtype=torch.float64, device=positions.device)
        return SamplerInputs(torch.tensor([max(sp.temperature, 0.0) for sp in sampling], **f64),
                             torch.tensor([sp.top_p for sp in sampling], **f64), torch.tensor(u, **f64))


def sample_rows(logits: Tensor, s: SamplerInputs | None) -> Tensor:
    """logits [B, V] fp32 -> ids [B], a pure tensor function (no host reads; compiles into the decode step).
    Greedy rows (temperature 0) by argmax; the others by temperature + top-p (nucleus): tokens sorted by
    probability, those outside the smallest set reaching top_p dropped (top_p 1 keeps all), then the first token whose
    cumulative probability exceeds the row's uniform draw u.  Row-wise, so batch-invariant."""
    greedy = logits.argmax(-1)
    if s is None:
        return greedy
    sampled_row = s.temperature > 0
    temp = torch.where(sampled_row, s.temperature, 1.0)
    probs = torch.softmax(logits.double() / temp[:, None], dim=-1)                  # [B, V]
    probs, order = probs.sort(dim=-1, descending=True)
    probs = probs * ((probs.cumsum(-1) - probs) < s.top_p[:, None])                # always keeps the top token
    cdf = probs.cumsum(-1)
    choice = torch.searchsorted(cdf, s.uniform[:, None] * cdf[:, -1:], right=True).clamp(max=cdf.shape[-1] - 1)
    return torch.where(sampled_row, order.gather(-1, choice)[:, 0], greedy)


def sample_tokens(logits: Tensor, sampling: list[SamplingParams] | None, positions: Tensor) -> Tensor:
    """logits [B, V] fp32 -> ids [B] for SamplingParams per row (see ``SamplerInputs`` / ``sample_rows``)."""
    return sample_rows(logits, SamplerInputs.build(sampling, positions))
