"""Weights for the tests that check the model's numbers: ``randomize_parameters`` gives every parameter that
``build_model``'s init leaves at a neutral value a random one (deterministic from a seed), ``neutral_parameters`` lists
the parameters that would still hide a wiring mistake.

``build_model``'s random init is kept as it is (the node, the demo and recorded outputs depend on it), but it leaves 20
parameter tensors of the ``tiny`` preset (piecewise) constant: every Gemma RMSNorm weight at 0 (scale 1 + 0), every
SigLIP LayerNorm at weight 1 / bias 0 and every adaRMS ``dense`` bias at [0 scale | 0 shift | 1 gate].  All norms of a
kind are then interchangeable, so wiring the wrong one into a layer (or a loader that swaps or drops them) changes no
output and no weight comparison.  Fixtures of the model-consistency and checkpoint tests call ``randomize_parameters``.
"""
from __future__ import annotations

import torch

# A zero-stride view kept for key compatibility; the forward never reads it (see UnusedLMHead in layers.py).
UNUSED = ("paligemma_with_expert.gemma_expert.lm_head.weight",)
TIED = "paligemma_with_expert.paligemma.lm_head.weight"          # the same tensor as embed_tokens.weight


def _is_piecewise_constant(p: torch.Tensor) -> bool:
    # zeros, ones, [0 | 0 | 1] blocks...: at most 3 distinct values (a random tensor of any dtype has many more)
    return p.numel() > 3 and p.detach().flatten().unique().numel() <= 3


def neutral_parameters(model) -> list[str]:
    """openpi's tensors (``state_dict``: the model's fused Q/K/V and gate/up matrices count as their separate parts),
    but the unused expert lm_head and the tied head's second name, that are (piecewise) constant or equal to another
    one."""
    found, by_shape = [], {}
    for name, p in model.state_dict().items():
        if name in UNUSED or name == TIED:
            continue
        if _is_piecewise_constant(p):
            found.append(name)
        for other, q in by_shape.get(tuple(p.shape), []):
            if torch.equal(p, q):
                found.append(f"{name} == {other}")
        by_shape.setdefault(tuple(p.shape), []).append((name, p))
    return found


@torch.no_grad()
def randomize_parameters(model, seed: int = 0, scale: float = 0.3):
    """Add N(0, scale^2) noise (a CPU generator seeded with ``seed``, in fp32, cast to the parameter's dtype) to every
    (piecewise) constant parameter: norm weights become 1 + w with w ~ N(0, 0.09), LayerNorm biases and adaRMS
    scale/shift/gate biases move off 0 / 1.  The other parameters already are independent random draws.  Returns the
    model (same object)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name not in UNUSED and _is_piecewise_constant(p):
            noise = torch.randn(p.shape, generator=g) * scale
            p.add_(noise.to(device=p.device, dtype=p.dtype))
    return model
