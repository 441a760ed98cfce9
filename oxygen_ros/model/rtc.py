"""Real-time chunking (RTC): the action chunk denoised by guided inpainting toward what the robot will execute.

This file owns the RTC math of the model layer (Black, Galliker, Levine 2025, "Real-Time Execution of Action Chunking
Flow Policies", arXiv 2506.07339, Algorithm 1; the same scheme as LeRobot's ``policies/rtc``): the soft mask
(``prefix_weights``), the clipped guidance weight (``guidance_weight``), one guided velocity (``guided_velocity``) and
the guided Euler loop (``guided_euler``) - both written against any velocity callable, so that the formula is
unit-tested on a field with a known answer - and ``sample_actions_rtc``, which runs that loop over
``Pi05Model.velocity`` with a read-only prefix.  The plain ``Pi05Model.sample_actions`` is untouched: this is a
separate eager function that needs autograd (one vector-Jacobian product per step through the action expert with
respect to the noisy actions only; the model's parameters and the prefix K/V carry no gradient and are never
written).  Imports torch only.

Time convention (derivation).  pi0.5 (openpi) trains with ``x_t = t * eps + (1 - t) * a`` and target velocity
``u = eps - a``, and samples from t = 1 (noise) to t = 0 (data) with ``x <- x + dt * v``, ``dt = -1/S``.  The paper
uses tau = 1 - t: ``A^tau = tau * A + (1 - tau) * eps``, ``v_p = A - eps = -v``, integrating tau 0 -> 1 with
``A <- A + (1/S) * v_p``.  Both describe the same point, x_t = A^tau.
  * Predicted clean chunk: paper ``A_hat = A^tau + (1 - tau) v_p``  =>  ``x1_hat = x_t - t * v``.
  * Guidance: paper ``g = J^T (W * (Y - A_hat))`` with ``J = d A_hat / d A^tau`` = ``d x1_hat / d x_t`` (one VJP),
    and step ``A <- A + (1/S) (v_p + c g)``.  In pi0.5 terms that step is ``x <- x + dt (v - c g)``: the guided
    velocity is ``v_guided = v - c * g`` (the sign flips with the velocity, not with the guidance).
  * Weight: paper ``c = min(beta, (1 - tau) / (tau * r^2))`` with ``r^2 = (1 - tau)^2 / (tau^2 + (1 - tau)^2)``, i.e.
    ``c = (tau^2 + (1 - tau)^2) / (tau (1 - tau))`` before the clip.  It is symmetric in tau <-> 1 - tau, so in pi0.5
    time it reads the same with t: ``c(t) = min(beta, (t^2 + (1 - t)^2) / (t (1 - t)))``; it is infinite (-> beta)
    at the first step t = 1, 2 at t = 0.5 and 9.11 at t = 0.1.

Soft mask (paper eq. 5, LeRobot's "exp" schedule).  With H rows, d frozen rows, execution horizon s and n rows of
target, let ``hard = min(d, n)`` and ``end = max(hard, min(H - s, n))``.  Then ``W_i = 1`` for ``i < hard``,
``W_i = c_i (e^{c_i} - 1) / (e - 1)`` with ``c_i = (end - i) / (end - hard + 1)`` for ``hard <= i < end``, and
``W_i = 0`` for ``i >= end``.  Action dims beyond the robot's (padding of the model's action space) get weight 0.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from .pi05 import Prefix

__all__ = ["prefix_weights", "guidance_weight", "guided_velocity", "guided_euler", "sample_actions_rtc", "rtc_target"]


def prefix_weights(horizon: int, delay_steps: int, execution_horizon: int, n_target: int | None = None) -> Tensor:
    """The soft mask W [H] (fp32) of the module docstring: 1 on the frozen rows, exponential decay over the rest of
    the overlap with the target, 0 from ``min(H - s, n)`` on."""
    H = int(horizon)
    n = H if n_target is None else max(0, min(int(n_target), H))
    hard = max(0, min(int(delay_steps), n))
    end = max(hard, min(H - max(0, int(execution_horizon)), n))
    w = torch.zeros(H, dtype=torch.float32)
    w[:hard] = 1.0
    if end > hard:
        i = torch.arange(hard, end, dtype=torch.float64)
        ci = (end - i) / (end - hard + 1)
        w[hard:end] = (ci * torch.expm1(ci) / (math.e - 1.0)).float()
    return w


def guidance_weight(t: float, max_guidance_weight: float) -> float:
    """c(t) = min(beta, (t^2 + (1 - t)^2) / (t (1 - t))) in pi0.5 time (t = 1 noise, t = 0 data); beta at t in
    {0, 1}."""
    beta = float(max_guidance_weight)
    if t <= 0.0 or t >= 1.0:
        return beta
    return min(beta, (t * t + (1.0 - t) ** 2) / (t * (1.0 - t)))


def guided_velocity(velocity_fn, x_t: Tensor, t: float, target: Tensor, weights: Tensor,
                    max_guidance_weight: float) -> tuple[Tensor, dict]:
    """One RTC step: ``velocity_fn(x) -> v`` (pi0.5 convention), x_t [B, H, A] at time t -> (v - c(t) * g, info).
    ``g = J^T (W * (Y - x1_hat))`` with ``x1_hat = x_t - t v`` and J its Jacobian w.r.t. x_t, by one VJP
    (torch.autograd.grad) through ``velocity_fn`` w.r.t. x_t only; weights broadcast to [B, H, A].  ``info``: c, the
    weighted error's squared norm per batch row (``err2``), and g (detached)."""
    if torch.is_inference_mode_enabled():
        raise RuntimeError("RTC guidance needs autograd (one VJP per step): call it outside torch.inference_mode() "
                           "(torch.no_grad() is fine)")
    x = x_t.detach().float().requires_grad_(True)
    with torch.enable_grad():
        v = velocity_fn(x)
        x1_hat = x - t * v
        err = (weights * (target - x1_hat)).detach()
        (g,) = torch.autograd.grad(x1_hat, x, grad_outputs=err)
    c = guidance_weight(t, max_guidance_weight)
    v = v.detach()
    return v - c * g, {"c": c, "err2": err.pow(2).sum(dim=(1, 2)), "g": g}


def rtc_target(prev_actions: Tensor, horizon: int, action_dim: int, delay_steps: int,
               execution_horizon: int) -> tuple[Tensor, Tensor]:
    """Normalised previous actions [n, r] (r <= A, row i = the old plan for new row i) -> (target [1, H, A] zero-padded,
    weights [1, H, A]: ``prefix_weights`` on the first r dims, 0 on the model's padding dims)."""
    n, r = prev_actions.shape
    if r > action_dim:
        raise ValueError(f"prev_actions has {r} dims, more than the model's {action_dim}")
    n = min(n, horizon)
    target = torch.zeros(1, horizon, action_dim, dtype=torch.float32, device=prev_actions.device)
    target[0, :n, :r] = prev_actions[:n].float()
    w = prefix_weights(horizon, delay_steps, execution_horizon, n).to(prev_actions.device)
    weights = torch.zeros(1, horizon, action_dim, dtype=torch.float32, device=prev_actions.device)
    weights[0, :, :r] = w[:, None]
    return target, weights


def sample_actions_rtc(model, prefix, noise: Tensor, num_steps: int | None, target: Tensor, weights: Tensor,
                       max_guidance_weight: float = 10.0, trace: list | None = None) -> Tensor:
    """RTC guided inpainting: noise [B, H, A] -> actions [B, H, A] (fp32), S Euler steps from t = 1 to t = 0 with the
    guided velocity of ``guided_velocity`` (same time grid as ``Pi05Model.sample_actions``).  target [B or 1, H, A]
    in the model's normalised action space; weights [H] or [B or 1, H, A].  The prefix is read only (its K/V are
    detached views; no gradient flows into them or into the model's parameters).  ``trace``: if a list, one dict per
    step (t, c, err2) is appended."""
    S = num_steps or model.cfg.num_denoise_steps
    B, H, _ = noise.shape
    prefix = prefix.expand(B)
    ro = Prefix([k.detach() for k in prefix.k], [v.detach() for v in prefix.v], prefix.mask, prefix.positions,
                prefix.next_position, None)
    positions, bias = model.action_attention(ro, H)
    return guided_euler(lambda xx, tt: model.velocity(ro, xx, tt, positions, bias), noise, S, target, weights,
                        max_guidance_weight, trace)


def guided_euler(velocity_fn, noise: Tensor, num_steps: int, target: Tensor, weights: Tensor,
                 max_guidance_weight: float, trace: list | None = None) -> Tensor:
    """The RTC sampling loop over any velocity ``velocity_fn(x [B, H, A], t [B]) -> v`` (pi0.5 convention): S Euler
    steps ``x <- x + dt * guided_velocity(...)``, dt = -1/S, t = 1, 1 - 1/S, ..., 1/S (t accumulated as in
    ``Pi05Model.sample_actions``)."""
    B = noise.shape[0]
    dev = noise.device
    target = target.to(device=dev, dtype=torch.float32)
    weights = weights.to(device=dev, dtype=torch.float32)
    if weights.dim() == 1:
        weights = weights[None, :, None]
    dt = -1.0 / num_steps
    x = noise.float()
    t = 1.0
    for _ in range(num_steps):
        tt = torch.full((B,), t, device=dev)
        v, info = guided_velocity(lambda xx: velocity_fn(xx, tt), x, t, target, weights, max_guidance_weight)
        if trace is not None:
            trace.append({"t": t, "c": info["c"], "err2": info["err2"].detach().cpu()})
        x = x + dt * v
        t += dt
    return x.detach()
