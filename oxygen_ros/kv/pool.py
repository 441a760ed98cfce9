"""KVPool: the one preallocated store of all language-side KV memory. Per layer it holds flat K and V tensors
`k[l]`, `v[l]` of shape [num_slots, Hkv, D] (num_slots = num_blocks x block_size), allocated once from the model config
and a memory budget, never grown. Memory is handed out in fixed-size blocks through a free list; a slot index is
`block * block_size + offset`. The pool only does storage, allocation and accounting (blocks/tokens/bytes in use, peak,
capacity); who owns which block (frame prefixes, requests) is decided by kv.cache.KVCacheManager.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import torch


class PoolExhausted(RuntimeError):
    """Raised when an allocation asks for more blocks than are free."""


def _elem_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _cfg_get(cfg, *names, default=None):
    for n in names:
        if hasattr(cfg, n):
            return getattr(cfg, n)
    if default is not None:
        return default
    raise AttributeError(f"config has none of {names}")


def kv_shape_from_config(cfg) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of the VLM tower's attention, read from a Pi05Config."""
    vlm = getattr(cfg, "vlm", None)
    src = vlm if vlm is not None else cfg
    nl = _cfg_get(src, "depth", "num_layers", "num_hidden_layers", "vlm_depth")
    hkv = _cfg_get(src, "num_kv_heads", "num_key_value_heads", "vlm_num_kv_heads")
    d = _cfg_get(src, "head_dim", "vlm_head_dim")
    return int(nl), int(hkv), int(d)


class KVPool:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int, block_size: int = 16,
                 *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_layers, self.num_kv_heads, self.head_dim = int(num_layers), int(num_kv_heads), int(head_dim)
        self.num_blocks, self.block_size = int(num_blocks), int(block_size)
        self.num_slots = self.num_blocks * self.block_size
        self.dtype, self.device = dtype, torch.device(device)
        shape = (self.num_slots, self.num_kv_heads, self.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(self.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(self.num_layers)]
        # stack of free blocks; pop() hands out the lowest numbered block first (deterministic layouts in tests)
        self._free: list[int] = list(range(self.num_blocks - 1, -1, -1))
        self._in_use = bytearray(self.num_blocks)         # 1 = allocated
        self.peak_used_blocks = 0
        self.total_allocations = 0
        self._arange = torch.arange(self.block_size, dtype=torch.long)

    # ------------------------------------------------------------------ construction from a model config
    @classmethod
    def from_config(cls, cfg, *, kv_budget_mb: float | None = None, num_blocks: int | None = None,
                    block_size: int = 16, dtype: torch.dtype | None = None,
                    device: str | torch.device = "cpu") -> "KVPool":
        """Size the pool from the config's KV shape and either `num_blocks` or a byte budget `kv_budget_mb`."""
        nl, hkv, d = kv_shape_from_config(cfg)
        dtype = dtype or torch.float32
        per_token = 2 * nl * hkv * d * _elem_size(dtype)
        if num_blocks is None:
            if kv_budget_mb is None:
                raise ValueError("give kv_budget_mb or num_blocks")
            num_blocks = int(kv_budget_mb * 2 ** 20) // (per_token * block_size)
            if num_blocks < 1:
                raise ValueError(f"kv_budget_mb={kv_budget_mb} holds less than one block of {block_size} tokens "
                                 f"({per_token * block_size} bytes)")
        return cls(nl, hkv, d, num_blocks, block_size, dtype=dtype, device=device)

    # ------------------------------------------------------------------ allocation
    def blocks_for(self, n_tokens: int) -> int:
        return -(-int(n_tokens) // self.block_size)

    def allocate(self, n_blocks: int) -> list[int]:
        n_blocks = int(n_blocks)
        if n_blocks < 0:
            raise ValueError("n_blocks < 0")
        if n_blocks > len(self._free):
            raise PoolExhausted(f"asked for {n_blocks} blocks, {len(self._free)} free of {self.num_blocks}")
        out = [self._free.pop() for _ in range(n_blocks)]
        for b in out:
            self._in_use[b] = 1
        self.total_allocations += n_blocks
        used = self.used_blocks
        if used > self.peak_used_blocks:
            self.peak_used_blocks = used
        return out

    def free(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            b = int(b)
            if not (0 <= b < self.num_blocks) or not self._in_use[b]:
                raise RuntimeError(f"double free or foreign block {b}")
            self._in_use[b] = 0
            self._free.append(b)

    def slots(self, blocks: Sequence[int], n_tokens: int | None = None) -> torch.Tensor:
        """Flat slot indices (long, on the pool's device) of the first n_tokens tokens stored in `blocks`."""
        if len(blocks) == 0:
            return torch.empty(0, dtype=torch.long, device=self.device)
        b = torch.as_tensor(list(blocks), dtype=torch.long)
        s = (b[:, None] * self.block_size + self._arange[None, :]).reshape(-1)
        if n_tokens is not None:
            if n_tokens > s.numel():
                raise ValueError(f"{n_tokens} tokens do not fit in {len(blocks)} blocks")
            s = s[:n_tokens]
        return s.to(self.device)

    # ------------------------------------------------------------------ data movement
    @torch.no_grad()
    def write(self, slots: torch.Tensor, k_layers: Sequence[torch.Tensor], v_layers: Sequence[torch.Tensor]) -> None:
        """Store per-layer K/V rows ([n, Hkv, D] each, n = len(slots)) into the given slots."""
        if len(k_layers) != self.num_layers or len(v_layers) != self.num_layers:
            raise ValueError("one K and one V tensor per layer expected")
        for l in range(self.num_layers):
            self.k[l].index_copy_(0, slots, k_layers[l].to(self.dtype))
            self.v[l].index_copy_(0, slots, v_layers[l].to(self.dtype))

    # ------------------------------------------------------------------ accounting
    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * _elem_size(self.dtype)

    @property
    def capacity_tokens(self) -> int:
        return self.num_slots

    @property
    def used_tokens(self) -> int:
        """Slots held by allocated blocks (whether or not every slot carries a live token)."""
        return self.used_blocks * self.block_size

    @property
    def peak_tokens(self) -> int:
        return self.peak_used_blocks * self.block_size

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.bytes_per_token

    @property
    def used_bytes(self) -> int:
        return self.used_tokens * self.bytes_per_token

    @property
    def peak_bytes(self) -> int:
        return self.peak_tokens * self.bytes_per_token

    def reset_peak(self) -> None:
        self.peak_used_blocks = self.used_blocks

    def is_allocated(self, block: int) -> bool:
        return bool(self._in_use[block])

    def check_invariants(self) -> None:
        free = self._free
        if len(set(free)) != len(free):
            raise AssertionError("a block is on the free list twice")
        for b in free:
            if self._in_use[b]:
                raise AssertionError(f"block {b} is both free and in use")
        if sum(self._in_use) + len(free) != self.num_blocks:
            raise AssertionError("blocks lost: in-use + free != total")
        if self.peak_used_blocks < self.used_blocks:
            raise AssertionError("peak below current use")
