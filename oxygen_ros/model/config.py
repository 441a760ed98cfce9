"""Configuration of the pi0.5 model: one frozen ``Pi05Config`` (vision / VLM / action-expert towers + top level) and
named presets (``pi05`` = the real model exactly as in the reference, ``bench-cpu`` = the fixed benchmark model,
``tiny`` = same architecture at toy widths for tests, ``demo`` = the size of the shipped simulation policy).  Every
tensor shape in ``pi05.py`` is derived from these fields; nothing else in the package hard-codes a width, a head
count or a token count.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

PREFIX_ATTENTION_MODES = ("upstream", "image_isolated")


@dataclass(frozen=True)
class VisionConfig:
    """SigLIP vision tower (no pooling head)."""
    width: int = 1152
    depth: int = 27
    num_heads: int = 16
    mlp_dim: int = 4304
    patch_size: int = 14
    image_size: int = 224
    layer_norm_eps: float = 1e-6

    @property
    def num_tokens(self) -> int:            # tokens per camera image, e.g. (224 // 14) ** 2 = 256
        return (self.image_size // self.patch_size) ** 2


@dataclass(frozen=True)
class GemmaConfig:
    """One Gemma tower (the VLM or the action expert).  Both towers must share num_kv_heads and head_dim
    and num_heads (they attend in one joint attention per layer)."""
    width: int = 2048
    depth: int = 18
    mlp_dim: int = 16384
    num_heads: int = 8
    num_kv_heads: int = 1
    head_dim: int = 256
    rms_norm_eps: float = 1e-6
    adarms: bool = False                    # True for the action expert: adaRMSNorm conditioned on the time embedding


@dataclass(frozen=True)
class Pi05Config:
    name: str = "pi05"
    vision: VisionConfig = field(default_factory=VisionConfig)
    vlm: GemmaConfig = field(default_factory=GemmaConfig)
    expert: GemmaConfig = field(default_factory=lambda: GemmaConfig(width=1024, depth=18, mlp_dim=4096, adarms=True))
    vocab_size: int = 257152
    num_cameras: int = 3
    max_token_len: int = 200
    action_dim: int = 32
    action_horizon: int = 50
    num_denoise_steps: int = 10
    discrete_state_input: bool = True          # openpi: state as 256-bin text in the action prompt (pi05_libero: False)
    rope_theta: float = 10000.0
    prefix_attention: str = "image_isolated"   # "upstream" (openpi-exact, bidirectional prefix) | "image_isolated"
    dtype: str = "bfloat16"                     # compute / weight dtype; fp32 kept for the params listed in pi05.py
    pad_id: int = 0
    eos_id: int = 1
    bos_id: int = 2
    time_min_period: float = 4e-3
    time_max_period: float = 4.0

    def __post_init__(self):
        aliases = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16", "float": "float32", "half": "float16"}
        dtype = str(self.dtype).removeprefix("torch.")
        object.__setattr__(self, "dtype", aliases.get(dtype, dtype))
        if self.prefix_attention not in PREFIX_ATTENTION_MODES:
            raise ValueError(f"prefix_attention must be one of {PREFIX_ATTENTION_MODES}, got {self.prefix_attention!r}")
        v, e = self.vlm, self.expert
        if (v.num_heads, v.num_kv_heads, v.head_dim) != (e.num_heads, e.num_kv_heads, e.head_dim):
            raise ValueError("VLM and expert must have the same num_heads / num_kv_heads / head_dim (joint attention)")
        if v.depth != e.depth:
            raise ValueError("VLM and expert must have the same depth (one joint attention per layer)")
        if v.num_heads % v.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.vision.width % self.vision.num_heads:
            raise ValueError("vision width must be divisible by vision num_heads")
        if self.vision.image_size % self.vision.patch_size:
            raise ValueError("image_size must be a multiple of patch_size")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")

    # ---- derived sizes -------------------------------------------------------------------------------------------
    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def num_layers(self) -> int:
        return self.vlm.depth

    @property
    def num_kv_heads(self) -> int:
        return self.vlm.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.vlm.head_dim

    @property
    def image_tokens_per_camera(self) -> int:
        return self.vision.num_tokens

    @property
    def num_image_tokens(self) -> int:
        return self.num_cameras * self.vision.num_tokens

    @property
    def prefix_len(self) -> int:            # full prefix length P for a max_token_len prompt
        return self.num_image_tokens + self.max_token_len

    @property
    def image_size(self) -> int:
        return self.vision.image_size

    def replace(self, **kw) -> "Pi05Config":
        return dataclasses.replace(self, **kw)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @staticmethod
    def from_dict(d: dict) -> "Pi05Config":
        d = dict(d)
        d["vision"] = VisionConfig(**d.get("vision", {}))
        d["vlm"] = GemmaConfig(**d.get("vlm", {}))
        d["expert"] = GemmaConfig(**d.get("expert", {}))
        return Pi05Config(**d)


def _pi05() -> Pi05Config:
    return Pi05Config()


def _bench_cpu() -> Pi05Config:
    # Fixed benchmark model: do not tune.
    return Pi05Config(
        name="bench-cpu",
        vision=VisionConfig(width=256, depth=4, num_heads=4, mlp_dim=1024, patch_size=14, image_size=224),
        vlm=GemmaConfig(width=256, depth=6, mlp_dim=1024, num_heads=4, num_kv_heads=1, head_dim=64),
        expert=GemmaConfig(width=128, depth=6, mlp_dim=512, num_heads=4, num_kv_heads=1, head_dim=64, adarms=True),
        vocab_size=8192, num_cameras=3, max_token_len=100, action_dim=32, action_horizon=10, num_denoise_steps=10,
        dtype="float32",
    )


def _tiny() -> Pi05Config:
    # Same architecture at toy widths: 2 layers per tower, patch 32 -> 7x7 = 49 tokens per camera.  max_token_len 160:
    # the byte tokenizer spends one token per character, and the shipped config's action prompt (the synthetic
    # bag's instruction + a 14-joint state) is 125 tokens (96 truncated it on every cycle).
    return Pi05Config(
        name="tiny",
        vision=VisionConfig(width=64, depth=2, num_heads=4, mlp_dim=128, patch_size=32, image_size=224),
        vlm=GemmaConfig(width=64, depth=2, mlp_dim=128, num_heads=4, num_kv_heads=1, head_dim=16),
        expert=GemmaConfig(width=32, depth=2, mlp_dim=64, num_heads=4, num_kv_heads=1, head_dim=16, adarms=True),
        vocab_size=512, num_cameras=3, max_token_len=160, action_dim=32, action_horizon=10, num_denoise_steps=10,
        dtype="float32",
    )


def _demo() -> Pi05Config:
    # The shipped demo policy (trained from scratch on the simulation's expert episodes by `make train-demo`): the
    # simulated ALOHA's three 96 px cameras at patch 16 (6 x 6 = 36 tokens each; a cube is ~6 px in the top camera),
    # towers sized so that training does several thousand batch-32 steps per hour on 2 CPU cores and the node runs
    # >= 15 cycles/s with language load (measured in the training card, checkpoints/demo/README.md).
    # action_dim 14 = the robot's joints (no padded dims to learn);
    # H = 20 rows = 0.4 s at 50 Hz; vocabulary = the trained SentencePiece model's (<= 1024); prompts <= 48 tokens.
    return Pi05Config(
        name="demo",
        vision=VisionConfig(width=128, depth=4, num_heads=4, mlp_dim=512, patch_size=16, image_size=96),
        vlm=GemmaConfig(width=128, depth=4, mlp_dim=512, num_heads=4, num_kv_heads=1, head_dim=32),
        expert=GemmaConfig(width=64, depth=4, mlp_dim=256, num_heads=4, num_kv_heads=1, head_dim=32, adarms=True),
        vocab_size=1024, num_cameras=3, max_token_len=48, action_dim=14, action_horizon=20, num_denoise_steps=10,
        dtype="float32",
    )


PRESETS = {"pi05": _pi05, "bench-cpu": _bench_cpu, "tiny": _tiny, "demo": _demo}


def apply_overrides(cfg: Pi05Config, **overrides) -> Pi05Config:
    """``cfg`` with top-level field overrides; tower overrides (``vision`` / ``vlm`` / ``expert``) take a dict of
    that tower's fields or a whole tower config.  Unknown fields raise ValueError."""
    for tower in ("vision", "vlm", "expert"):
        if isinstance(overrides.get(tower), dict):
            try:
                overrides[tower] = dataclasses.replace(getattr(cfg, tower), **overrides[tower])
            except TypeError as e:
                raise ValueError(f"bad {tower} override: {e}") from e
    unknown = set(overrides) - {f.name for f in dataclasses.fields(Pi05Config)}
    if unknown:
        raise ValueError(f"unknown config fields: {sorted(unknown)}")
    return dataclasses.replace(cfg, **overrides)


def get_config(name: str = "pi05", **overrides) -> Pi05Config:
    """Return a preset by name with top-level field overrides, e.g. ``get_config("pi05", action_horizon=10)``.
    Tower overrides take a dict or a config: ``get_config("tiny", vlm={"depth": 3})``."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {sorted(PRESETS)}")
    return apply_overrides(PRESETS[name](), **overrides)
