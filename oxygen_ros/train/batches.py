"""Training samples -> model tensors, with the node's own preprocessing.

This file owns one job: turning a frame of an ``Episode`` into exactly what the model sees at inference.  The action
prompt comes from the node's ``Processor`` (instruction + the state quantile-normalised with the checkpoint's stats
and discretised, tokenised with BOS, right-padded to ``max_token_len``); a text target is the engine's language prompt
(``Processor``'s ``language_prompt(kind, prompt)`` with BOS, as ``Engine.submit`` builds it) followed by the answer's
tokens and EOS, right-padded to ``text_len``, with a loss mask on the answer and EOS; actions are converted to the
policy's output space (``delta_action_mask``), quantile-normalised and zero-padded to the model's ``action_dim``; images
go uint8 -> [-1, 1] CHW (``image_to_tensor``), masked slots zero.  ``BatchMaker.make(items, gen)`` returns a
``Batch``; ``augment`` optionally shifts and re-lights the base camera (openpi augments only non-wrist cameras).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .data import Episode, to_policy_actions

__all__ = ["Batch", "BatchMaker"]


@dataclass
class Batch:
    images: torch.Tensor          # [B, C, 3, S, S] float32 in [-1, 1]
    image_masks: torch.Tensor     # [B, C] bool
    tokens: torch.Tensor          # [B, L] long   action prompt
    token_masks: torch.Tensor     # [B, L] bool
    actions: torch.Tensor         # [B, H, A] float32 normalised (model action_dim)
    action_valid: torch.Tensor    # [B, H] bool
    text: torch.Tensor            # [B, Lt] long  language prompt + answer + EOS
    text_masks: torch.Tensor      # [B, Lt] bool
    text_targets: torch.Tensor    # [B, Lt] bool: logits at j are trained to predict text[j + 1]
    target: torch.Tensor | None = None         # [B, 2] float32: the named cube's place (target_aux.py), or None
    target_valid: torch.Tensor | None = None   # [B] bool
    state: torch.Tensor | None = None          # [B, D] float32: the frame's true joint state (plan_target.py)

    def slice(self, a: int, b: int) -> "Batch":
        return Batch(*[None if getattr(self, f) is None else getattr(self, f)[a:b] for f in self.__dataclass_fields__])

    def to(self, device: torch.device) -> "Batch":
        """On ``device``: for CUDA pinned on the host first and copied without blocking; the CPU: itself."""
        if device.type == "cpu":
            return self
        return Batch(*[None if getattr(self, f) is None else getattr(self, f).pin_memory().to(device, non_blocking=True)
                       for f in self.__dataclass_fields__])


class BatchMaker:
    def __init__(self, cfg, processor, delta_mask, text_len: int):
        self.cfg, self.proc = cfg, processor
        self.delta_mask = np.asarray(delta_mask, bool)
        self.text_len = int(text_len)
        self._lang_cache: dict = {}
        self._ans_cache: dict = {}

    # ---- text ------------------------------------------------------------------------------------------------------
    def text_ids(self, kind: str, prompt: str, answer: str) -> tuple[list[int], int]:
        """(ids, n_prompt): BOS + the engine's language prompt, then the answer's ids and EOS."""
        from oxygen_ros.model.processing import language_prompt  # noqa: PLC0415

        tok = self.proc.tokenizer
        key = (kind, prompt)
        if key not in self._lang_cache:
            self._lang_cache[key] = tok.encode(language_prompt(kind, prompt), add_bos=True)
        if answer not in self._ans_cache:
            self._ans_cache[answer] = tok.encode(answer)
        p = self._lang_cache[key]
        return p + self._ans_cache[answer] + [tok.eos_id], len(p)

    def longest_text(self, episodes: list[Episode]) -> int:
        return max((len(self.text_ids(k, p, t)[0]) for e in episodes for f in e.texts for (k, p, t) in f),
                   default=1)

    # ---- one batch -------------------------------------------------------------------------------------------------
    def make(self, items: list[tuple[Episode, int, int]], gen: torch.Generator | None = None,
             augment: bool = False, state_noise: float = 0.0) -> Batch:
        """items: (episode, frame, text choice index) per row.  ``state_noise`` > 0: Gaussian noise of that standard
        deviation (rad) on the delta-action joints (the arms) of the state *in the prompt* only - the action targets
        stay relative to the true state - so that the arm's pose alone cannot tell where it is going (the copycat
        shortcut of behaviour cloning with proprioception); drawn from ``gen``."""
        from oxygen_ros.model.processing import image_to_tensor  # noqa: PLC0415

        cfg, H, A = self.cfg, self.cfg.action_horizon, self.cfg.action_dim
        B, L, Lt = len(items), cfg.max_token_len, self.text_len
        C, S = cfg.num_cameras, cfg.image_size
        images = torch.zeros(B, C, 3, S, S)
        image_masks = torch.zeros(B, C, dtype=torch.bool)
        tokens = torch.zeros(B, L, dtype=torch.long)
        tmask = torch.zeros(B, L, dtype=torch.bool)
        actions = torch.zeros(B, H, A)
        valid = torch.zeros(B, H, dtype=torch.bool)
        text = torch.full((B, Lt), self.proc.tokenizer.pad_id, dtype=torch.long)
        xmask = torch.zeros(B, Lt, dtype=torch.bool)
        xtgt = torch.zeros(B, Lt, dtype=torch.bool)
        target, target_valid = torch.zeros(B, 2), torch.zeros(B, dtype=torch.bool)
        state = torch.zeros(B, items[0][0].state.shape[1]) if items else torch.zeros(0, 0)
        for b, (ep, f, ti) in enumerate(items):
            for c in range(C):
                if ep.image_mask[f, c]:
                    images[b, c] = image_to_tensor(ep.images[f, c])
                    image_masks[b, c] = True
            prompt_state = ep.state[f]
            state[b] = torch.from_numpy(np.asarray(ep.state[f], np.float32))
            if state_noise > 0:
                n = torch.randn(len(prompt_state), generator=gen).numpy() * state_noise
                k = min(len(prompt_state), len(self.delta_mask))
                prompt_state = prompt_state.copy()
                prompt_state[:k] += np.where(self.delta_mask[:k], n[:k], 0.0).astype(prompt_state.dtype)
            t, m, truncated = self.proc.encode_prompt("action", ep.instruction[f], prompt_state)
            if truncated:
                raise ValueError(f"{ep.source} frame {f}: the action prompt does not fit max_token_len "
                                 f"{cfg.max_token_len}")
            tokens[b], tmask[b] = t[0], m[0]
            a, v = ep.action_chunk(f, H)
            a = self.proc.norm_stats.normalize_actions(to_policy_actions(a, ep.state[f], self.delta_mask))
            actions[b, :, :a.shape[1]] = torch.from_numpy(np.asarray(a, np.float32))
            valid[b] = torch.from_numpy(v)
            if ep.target is not None:
                target[b] = torch.from_numpy(ep.target[f, :2])
                target_valid[b] = bool(ep.target[f, 2])
            if ep.texts[f]:
                kind, prompt, answer = ep.texts[f][ti % len(ep.texts[f])]
                ids, n_prompt = self.text_ids(kind, prompt, answer)
                if len(ids) > Lt:
                    raise ValueError(f"{ep.source} frame {f}: a text target of {len(ids)} tokens exceeds text_len "
                                     f"{Lt}")
                text[b, :len(ids)] = torch.tensor(ids)
                xmask[b, :len(ids)] = True
                xtgt[b, n_prompt - 1:len(ids) - 1] = True
        if augment:
            images[:, 0] = _augment(images[:, 0], image_masks[:, 0], gen)
        return Batch(images, image_masks, tokens, tmask, actions, valid, text, xmask, xtgt, target, target_valid, state)


def _augment(x: torch.Tensor, mask: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
    """Base-camera augmentation (openpi applies crop / rotation / colour jitter to non-wrist cameras): a random shift
    of up to 4 % of the side (zero padding) and brightness / contrast within +-10 %.  x [B, 3, S, S] in [-1, 1]."""
    B, _, S, _ = x.shape
    out = x.clone()
    m = max(1, int(round(0.04 * S)))
    shifts = torch.randint(-m, m + 1, (B, 2), generator=gen)
    gain = 1.0 + (torch.rand(B, generator=gen) - 0.5) * 0.2
    bias = (torch.rand(B, generator=gen) - 0.5) * 0.2
    for b in range(B):
        if not mask[b]:
            continue
        dy, dx = int(shifts[b, 0]), int(shifts[b, 1])
        img = torch.roll(x[b], shifts=(dy, dx), dims=(1, 2))
        if dy > 0:
            img[:, :dy] = -1.0
        elif dy < 0:
            img[:, dy:] = -1.0
        if dx > 0:
            img[:, :, :dx] = -1.0
        elif dx < 0:
            img[:, :, dx:] = -1.0
        out[b] = (img * gain[b] + bias[b]).clamp(-1.0, 1.0)
    return out
