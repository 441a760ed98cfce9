"""The training objective of pi0.5: flow matching on action chunks plus next-token cross-entropy on text targets.

This file owns the losses, following openpi's PyTorch pi0.5 (``src/openpi/models_pytorch/pi0_pytorch.py``:
``sample_time`` draws t ~ Beta(1.5, 1) * 0.999 + 0.001, ``forward`` builds x_t = t * noise + (1 - t) * actions and the
velocity target u_t = noise - actions and returns the element-wise MSE to the predicted velocity), with LeRobot's
masking of padded chunk rows (rows past an episode's end do not count).  The text loss is the cross-entropy of the
answer tokens and EOS given the image tokens and the language prompt (prefix-LM: the prompt is context, only what
follows it is predicted).  ``pi05_loss(model, batch, noise, time)`` returns the weighted total and its parts; the
noise and times are drawn by the caller (from a seeded generator, so distributed ranks and resumed runs draw the same).
With ``target_weight`` > 0 the step function also returns the auxiliary head's prediction of the named cube's place
(``target_aux.py``) and its squared error joins the total; with ``plan_weight`` > 0 the grip-site distance of the
flow's estimate of the clean chunk to the label's (``plan_target.py``) does.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["sample_time", "flow_matching_loss", "text_loss", "loss_counts", "pi05_loss"]


def sample_time(batch: int, gen: torch.Generator | None = None) -> torch.Tensor:
    """openpi's time distribution: Beta(1.5, 1) * 0.999 + 0.001 (more weight near t = 1, pure noise)."""
    # Beta(a, 1) = U^(1/a): inverse-CDF sampling from the caller's generator (torch.distributions has no generator)
    u = torch.rand(batch, generator=gen)
    return u.pow(1.0 / 1.5) * 0.999 + 0.001


def flow_matching_loss(v_pred: torch.Tensor, actions: torch.Tensor, noise: torch.Tensor, valid: torch.Tensor,
                       denom: float | torch.Tensor | None = None) -> torch.Tensor:
    """Mean squared error between the predicted velocity and u_t = noise - actions over valid rows ([B, H]),
    averaged over all action dims (as openpi, padded dims included: their target is the noise).  ``denom``: the
    number of valid rows to divide by (default: this batch's; distributed ranks pass the global count / world size,
    so that averaging the ranks' gradients gives the gradient of the global mean)."""
    u = noise - actions
    se = (v_pred.float() - u).pow(2).mean(dim=-1)                                      # [B, H]
    w = valid.float()
    d = w.sum().clamp(min=1.0) if denom is None else denom
    return (se * w).sum() / d


def text_loss(logits: torch.Tensor, text: torch.Tensor, targets: torch.Tensor,
              denom: float | torch.Tensor | None = None) -> torch.Tensor:
    """Cross-entropy of text[:, j + 1] under logits[:, j] where targets[:, j] (the answer and EOS), summed and divided
    by ``denom`` (default: the number of such tokens here).  A batch without targets gives 0 still connected to the
    logits (every rank of a distributed step runs the same graph)."""
    m = targets[:, :-1]
    if not bool(m.any()):
        return logits.sum() * 0.0
    ce = F.cross_entropy(logits[:, :-1][m].float(), text[:, 1:][m], reduction="sum")
    return ce / (m.sum().clamp(min=1) if denom is None else denom)


def loss_counts(batch) -> torch.Tensor:
    """[valid action rows, predicted text tokens, valid auxiliary targets] of a batch (the losses' denominators)."""
    n_target = 0.0 if batch.target_valid is None else float(batch.target_valid.sum())
    return torch.tensor([float(batch.action_valid.sum()), float(batch.text_targets[:, :-1].sum()), n_target])


def pi05_loss(step_fn, batch, noise: torch.Tensor, time: torch.Tensor, text_weight: float = 1.0,
              denoms: torch.Tensor | None = None, target_weight: float = 0.0, plan=None, plan_weight: float = 0.0):
    """``step_fn`` = ``model.forward_train`` (or a DDP wrapper of it; with ``target_weight`` > 0 one that returns the
    auxiliary head's prediction third, the trainer's ``_Step``).  ``denoms``: (rows, text tokens, targets) to divide
    by (default ``loss_counts(batch)``).  ``plan``: a ``plan_target.PlanTarget``, its loss on the flow's estimate of
    the clean chunk x0 = x_t - t * v weighted by ``plan_weight``.  Returns (total, flow matching, text, target, plan)
    - the parts detached, for logging (target / plan 0 when unused)."""
    d = loss_counts(batch).clamp(min=1.0) if denoms is None else denoms
    t = time[:, None, None]
    x_t = t * noise + (1 - t) * batch.actions
    with_text = text_weight > 0
    out = step_fn(batch.images, batch.image_masks, batch.tokens, batch.token_masks, x_t, time,
                  batch.text if with_text else None, batch.text_masks if with_text else None)
    v, logits = out[0], out[1]
    fm = flow_matching_loss(v, batch.actions, noise, batch.action_valid, d[0])
    ce = text_loss(logits, batch.text, batch.text_targets, d[1]) if with_text else torch.zeros(())
    total = fm + text_weight * ce
    tl = torch.zeros(())
    if target_weight > 0:
        from .target_aux import target_loss  # noqa: PLC0415
        if len(out) < 3 or batch.target is None:
            raise ValueError("target_weight > 0 needs a step function returning the target head's prediction and "
                             "a batch with targets")
        tl = target_loss(out[2], batch.target, batch.target_valid, d[2] if len(d) > 2 else None)
        total = total + target_weight * tl
    pl = torch.zeros(())
    if plan is not None and plan_weight > 0:
        if batch.state is None:
            raise ValueError("plan_weight > 0 needs a batch with the frames' state")
        x0_hat = x_t - t * v.float()[..., :x_t.shape[-1]]
        pl = plan.loss(x0_hat, batch.actions, batch.state, batch.action_valid, d[0])
        total = total + plan_weight * pl
    return total, fm.detach(), ce.detach(), tl.detach(), pl.detach()
