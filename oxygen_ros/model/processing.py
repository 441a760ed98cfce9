"""Pre- and post-processing between robot data and model tensors, following openpi's pi0.5 pipeline: the
``Observation`` the engine receives, ``NormStats`` (quantile normalisation of the state, unnormalisation of the actions,
dims past the stats pass through), resize-with-pad of camera images to 224 (keep aspect, bilinear with antialiasing,
zero padding -> -1 after scaling), uint8 -> [-1, 1] CHW, camera-slot masks for missing cameras, the pi0.5 action prompt
with the discretised state and the language prompts (subtask / conversation / memory), right-padding to
``max_token_len`` and truncation with a warning.  ``Processor`` ties these together and validates its inputs.
"""
from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


NUM_STATE_BINS = 256


@dataclass
class Observation:
    images: list            # C slots of np.ndarray uint8 [H, W, 3] RGB, or None for a missing camera
    state: np.ndarray | None = None     # robot-native state vector
    prompt: str = ""
    stamp: float = 0.0                  # capture time, seconds
    frame_index: int = 0


@dataclass
class ModelInputs:
    images: torch.Tensor                # [1, C, 3, S, S] float32 in [-1, 1]
    image_masks: torch.Tensor           # [1, C] bool
    tokens: torch.Tensor                # [1, L] long
    token_masks: torch.Tensor           # [1, L] bool
    truncated: bool = False
    prompt_text: str = ""


# ------------------------------------------------------------------------------------------------------------------
# Normalisation
# ------------------------------------------------------------------------------------------------------------------


@dataclass
class Stats:
    mean: np.ndarray | None = None
    std: np.ndarray | None = None
    q01: np.ndarray | None = None
    q99: np.ndarray | None = None

    @staticmethod
    def from_dict(d: dict) -> "Stats":
        get = lambda k: None if d.get(k) is None else np.asarray(d[k], dtype=np.float64).reshape(-1)  # noqa: E731
        return Stats(get("mean"), get("std"), get("q01"), get("q99"))

    def to_dict(self) -> dict:
        return {k: getattr(self, k).tolist() for k in ("mean", "std", "q01", "q99") if getattr(self, k) is not None}

    @property
    def dim(self) -> int:
        return len(self.q01) if self.q01 is not None else (len(self.mean) if self.mean is not None else 0)


@dataclass
class NormStats:
    """Quantile normalisation (pi0.5): x_hat = (x - q01) / (q99 - q01 + 1e-6) * 2 - 1 on the first len(q01) dims,
    the rest passes through.  Missing stats -> identity."""
    state: Stats | None = None
    actions: Stats | None = None

    @staticmethod
    def from_dict(d: dict) -> "NormStats":
        d = d.get("norm_stats", d)
        return NormStats(Stats.from_dict(d["state"]) if d.get("state") else None,
                         Stats.from_dict(d["actions"]) if d.get("actions") else None)

    @staticmethod
    def load(path: str | os.PathLike) -> "NormStats":
        with open(path) as f:
            return NormStats.from_dict(json.load(f))

    def to_dict(self) -> dict:
        d = {}
        if self.state is not None:
            d["state"] = self.state.to_dict()
        if self.actions is not None:
            d["actions"] = self.actions.to_dict()
        return {"norm_stats": d}

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2)

    @staticmethod
    def _quantiles(s: Stats | None):
        if s is None or s.q01 is None or s.q99 is None:
            return None
        return s.q01, s.q99

    @classmethod
    def _quantile_map(cls, x: np.ndarray, stats: Stats | None, inverse: bool) -> np.ndarray:
        """x_hat = (x - q01) / (q99 - q01 + 1e-6) * 2 - 1 over the dims the stats cover (inverse: the other way);
        dims past the stats pass through; identity without stats."""
        x = np.asarray(x, dtype=np.float64).copy()
        q = cls._quantiles(stats)
        if q is not None:
            n = min(len(q[0]), x.shape[-1])
            lo, span = q[0][:n], q[1][:n] - q[0][:n] + 1e-6
            x[..., :n] = (x[..., :n] + 1.0) / 2.0 * span + lo if inverse else (x[..., :n] - lo) / span * 2.0 - 1.0
        return x.astype(np.float32)

    def normalize_state(self, x: np.ndarray) -> np.ndarray:
        return self._quantile_map(x, self.state, inverse=False)

    def unnormalize_actions(self, a: np.ndarray) -> np.ndarray:
        return self._quantile_map(a, self.actions, inverse=True)

    def normalize_actions(self, a: np.ndarray) -> np.ndarray:
        return self._quantile_map(a, self.actions, inverse=False)

    @property
    def action_dim(self) -> int | None:
        return None if self.actions is None or self.actions.dim == 0 else self.actions.dim


# ------------------------------------------------------------------------------------------------------------------
# Images
# ------------------------------------------------------------------------------------------------------------------


# A frame whose short side would shrink below this many pixels in resize-with-pad carries no usable content (a
# 1000x2 strip becomes 224x0): such frames are refused with a clear reason instead of failing inside the resize.
MIN_RESIZED_SIDE = 8


def resized_size(h: int, w: int, height: int, width: int) -> tuple[int, int]:
    """The (rows, cols) an h x w image is scaled to by ``resize_with_pad`` before padding (openpi's int())."""
    ratio = max(w / width, h / height)
    return int(h / ratio), int(w / ratio)


def unusable_image_reason(h: int, w: int, size: int) -> str | None:
    """Why an h x w frame cannot be used by a model with ``size`` x ``size`` inputs, or None."""
    rh, rw = resized_size(h, w, size, size)
    if min(rh, rw) < MIN_RESIZED_SIDE:
        return (f"a {w}x{h} frame shrinks to {rw}x{rh} in the model's {size}x{size} resize-with-pad (aspect ratio "
                f"{max(w, h) / max(1, min(w, h)):.0f}:1); at least {MIN_RESIZED_SIDE} px per side are needed")
    return None


def resize_with_pad(image: np.ndarray, height: int, width: int) -> np.ndarray:
    """uint8 [h, w, 3] -> uint8 [height, width, 3]: scale by 1/max(w/width, h/height) (keep aspect, sizes truncated
    as openpi's int(), at least 1 px), bilinear with antialiasing (as PIL), then centre with zero padding (extra
    pixel bottom/right)."""
    h, w = image.shape[:2]
    if (h, w) == (height, width):
        return image
    rh, rw = (max(1, n) for n in resized_size(h, w, height, width))
    # uint8 channels-last input takes torch's PIL-like fast path (within 1/255 of PIL, ~4x faster than float)
    t = torch.from_numpy(np.require(image, requirements=["C", "W"])).permute(2, 0, 1)[None]   # copies read-only
    r = F.interpolate(t, size=(rh, rw), mode="bilinear", align_corners=False, antialias=True)
    r = r[0].permute(1, 2, 0).numpy()
    top, left = (height - rh) // 2, (width - rw) // 2
    out = np.zeros((height, width, 3), dtype=np.uint8)
    out[top:top + rh, left:left + rw] = r
    return out


def image_to_tensor(image: np.ndarray, out: torch.Tensor | None = None) -> torch.Tensor:
    """uint8 [S, S, 3] -> float32 [3, S, S] in [-1, 1] (written into ``out`` [3, S, S] when given: no temporaries)."""
    t = torch.from_numpy(np.ascontiguousarray(image)).permute(2, 0, 1)
    if out is None:
        return t.float() / 255.0 * 2.0 - 1.0
    return torch.div(t, 127.5, out=out).sub_(1.0)          # x / 127.5 == x / 255 * 2 exactly (a power-of-2 scale)


# ------------------------------------------------------------------------------------------------------------------
# Prompts
# ------------------------------------------------------------------------------------------------------------------


def clean_text(prompt: str) -> str:
    """openpi: strip, '_' -> ' ', newlines -> ' ' (no lower-casing for pi0.5)."""
    return prompt.strip().replace("_", " ").replace("\n", " ")


def discretize_state(state: np.ndarray) -> np.ndarray:
    """Normalised state -> 256 bins over [-1, 1] (openpi: np.digitize(x, linspace(-1, 1, 257)[:-1]) - 1)."""
    return np.digitize(np.asarray(state), bins=np.linspace(-1, 1, NUM_STATE_BINS + 1)[:-1]) - 1


def action_prompt(prompt: str, normalized_state: np.ndarray | None) -> str:
    """pi0.5 action prompt: ``"Task: {prompt}, State: {bins};\\nAction: "`` (tokenised with BOS)."""
    bins = "" if normalized_state is None else " ".join(map(str, discretize_state(normalized_state)))
    return f"Task: {clean_text(prompt)}, State: {bins};\nAction: "


PROMPT_FORMATS = {
    # kind -> format; "{text}" is the cleaned request text.  All are tokenised with BOS.
    "subtask": "Task: {text}. Subtask: ",                 # OxyGen's language/subtask prompt
    "conversation": "User: {text}\nAssistant: ",          # ours: a plain chat turn
    "memory": "Task: {text}. Memory: ",                   # ours: summarise what the robot has seen/done
}


def language_prompt(kind: str, text: str) -> str:
    if kind not in PROMPT_FORMATS:
        raise ValueError(f"unknown prompt kind {kind!r}; known: {sorted(PROMPT_FORMATS)} (and 'action')")
    return PROMPT_FORMATS[kind].format(text=clean_text(text))


def pad_tokens(ids: list[int], max_len: int, pad_id: int = 0, what: str = "prompt", warn: bool = True):
    """Right-pad to max_len -> (tokens [max_len], mask [max_len], truncated).  Warns (once, as a UserWarning) when
    truncating, unless ``warn`` is False."""
    truncated = len(ids) > max_len
    if truncated:
        if warn:
            warnings.warn(f"{what} has {len(ids)} tokens, more than max_token_len={max_len}: truncated "
                          "(consider a larger max_token_len)", stacklevel=3)
        ids = ids[:max_len]
    n = len(ids)
    tokens = np.full(max_len, pad_id, dtype=np.int64)
    tokens[:n] = ids
    mask = np.zeros(max_len, dtype=bool)
    mask[:n] = True
    return tokens, mask, truncated


# ------------------------------------------------------------------------------------------------------------------
# Processor
# ------------------------------------------------------------------------------------------------------------------


class Processor:
    """Observation -> ModelInputs, prompts -> tokens, normalised actions -> robot actions.
    ``action_dims``: robot action dims returned by ``unnormalize_actions`` (default: from the action norm stats,
    else the model's action_dim)."""

    def __init__(self, cfg, tokenizer, norm_stats: NormStats | None = None, action_dims: int | None = None):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.norm_stats = norm_stats or NormStats()
        self.action_dims = action_dims or self.norm_stats.action_dim or cfg.action_dim
        if self.action_dims > cfg.action_dim:
            raise ValueError(f"action_dims {self.action_dims} > model action_dim {cfg.action_dim}")
        self._last_truncation: dict = {}

    # ---- validation ------------------------------------------------------------------------------------------------
    def validate(self, obs: Observation) -> None:
        C = self.cfg.num_cameras
        if not isinstance(obs.images, (list, tuple)) or len(obs.images) != C:
            n = len(obs.images) if hasattr(obs.images, "__len__") else "?"
            raise ValueError(f"observation.images must be a list of {C} camera slots (None = missing), "
                             f"got {type(obs.images).__name__} of length {n}")
        for i, im in enumerate(obs.images):
            if im is None:
                continue
            if not isinstance(im, np.ndarray):
                raise ValueError(f"camera slot {i}: expected a numpy array, got {type(im).__name__}")
            if im.dtype != np.uint8:
                raise ValueError(f"camera slot {i}: expected dtype uint8, got {im.dtype}")
            if im.ndim != 3 or im.shape[2] != 3 or im.shape[0] < 1 or im.shape[1] < 1:
                raise ValueError(f"camera slot {i}: expected shape [H, W, 3] (RGB), got {list(im.shape)}")
            why = unusable_image_reason(im.shape[0], im.shape[1], self.cfg.image_size)
            if why:
                raise ValueError(f"camera slot {i}: {why}")
        if obs.state is not None:
            s = np.asarray(obs.state)
            if s.ndim != 1 or s.size == 0:
                raise ValueError(f"state must be a non-empty 1-D vector, got shape {list(s.shape)}")
            if not np.issubdtype(s.dtype, np.number):
                raise ValueError(f"state must be numeric, got dtype {s.dtype}")
            if not np.all(np.isfinite(s)):
                raise ValueError("state contains NaN or inf")
            if s.size > self.cfg.action_dim:
                raise ValueError(f"state has {s.size} dims, more than the model's {self.cfg.action_dim}")
        if not isinstance(obs.prompt, str):
            raise ValueError(f"prompt must be a str, got {type(obs.prompt).__name__}")

    # ---- images ----------------------------------------------------------------------------------------------------
    def prepare_images(self, images: list, out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """C slots -> images [1, C, 3, S, S] in [-1, 1] (missing = zeros), masks [1, C] bool.  ``out``: a float32
        [1, C, 3, S, S] buffer to write into (e.g. the engine's pinned staging buffer, reused every frame)."""
        S = self.cfg.image_size
        C = self.cfg.num_cameras
        out = torch.empty(1, C, 3, S, S) if out is None else out
        mask = torch.zeros(1, C, dtype=torch.bool)
        for i, im in enumerate(images):
            if im is None:
                out[0, i].zero_()
                continue
            image_to_tensor(resize_with_pad(im, S, S), out=out[0, i])
            mask[0, i] = True
        return out, mask

    # ---- prompts ---------------------------------------------------------------------------------------------------
    def _tokens(self, text: str, what: str, suffix: str | None = None, key: str | None = None):
        ids = self.tokenizer.encode(text, add_bos=True)
        if suffix is not None:                                   # tokenised separately, as openpi does for "\n"
            ids = ids + self.tokenizer.encode(suffix)
        # warn once per change of the truncated prompt (``key``: the part that identifies it, e.g. the instruction
        # without the state, which changes every frame), not on every cycle
        key = (text if key is None else key, len(ids) > self.cfg.max_token_len)
        warn = self._last_truncation.get(what) != key
        self._last_truncation[what] = key
        t, m, truncated = pad_tokens(ids, self.cfg.max_token_len, self.tokenizer.pad_id, what, warn=warn)
        return torch.from_numpy(t)[None], torch.from_numpy(m)[None], truncated

    def action_prompt_text(self, prompt: str, state: np.ndarray | None) -> str:
        """The action prompt as text.  ``cfg.discrete_state_input`` (openpi's flag; False e.g. for pi05_libero):
        True -> ``"Task: {prompt}, State: {bins};\nAction: "``; False -> ``"{prompt}\n"`` (no state; the "\n" is
        tokenised on its own)."""
        if not self.cfg.discrete_state_input:
            return clean_text(prompt) + "\n"
        ns = None if state is None else self.norm_stats.normalize_state(np.asarray(state, dtype=np.float64))
        return action_prompt(prompt, ns)

    def _action_tokens(self, prompt: str, state, text: str | None = None):
        if not self.cfg.discrete_state_input:
            return self._tokens(clean_text(prompt), "action prompt", suffix="\n")
        text = self.action_prompt_text(prompt, state) if text is None else text
        return self._tokens(text, "action prompt", key=prompt)

    def encode_prompt(self, kind: str, text: str, state: np.ndarray | None = None):
        """kind 'action' (text = task, uses ``state``) | 'subtask' | 'conversation' | 'memory'
        -> (tokens [1, L] long, mask [1, L] bool, truncated)."""
        if kind == "action":
            return self._action_tokens(text, state)
        return self._tokens(language_prompt(kind, text), f"{kind} prompt")

    def prepare(self, obs: Observation, images_out: torch.Tensor | None = None) -> ModelInputs:
        """Observation -> ModelInputs with the pi0.5 action prompt (images written into ``images_out`` if given)."""
        self.validate(obs)
        images, masks = self.prepare_images(obs.images, images_out)
        text = self.action_prompt_text(obs.prompt, obs.state)
        tokens, tmask, truncated = self._action_tokens(obs.prompt, obs.state, text)
        return ModelInputs(images, masks, tokens, tmask, truncated, text)

    # ---- actions ---------------------------------------------------------------------------------------------------
    def unnormalize_actions(self, actions) -> np.ndarray:
        """[H, A] (or [B, H, A]) normalised model actions -> [H, robot_dim] robot-native actions."""
        a = actions.detach().float().cpu().numpy() if isinstance(actions, torch.Tensor) else np.asarray(actions)
        return self.norm_stats.unnormalize_actions(a)[..., : self.action_dims]

    def normalize_actions(self, actions) -> np.ndarray:
        """[..., robot_dim] robot-native actions -> [..., robot_dim] normalised model actions: the inverse of
        ``unnormalize_actions`` on the robot's dims (same quantile map, fp32 round-off); the model's dims beyond
        robot_dim are not represented (callers zero-pad them)."""
        a = actions.detach().float().cpu().numpy() if isinstance(actions, torch.Tensor) else np.asarray(actions)
        if a.shape[-1] != self.action_dims:
            raise ValueError(f"actions have {a.shape[-1]} dims, expected robot_dim {self.action_dims}")
        return self.norm_stats.normalize_actions(a)
