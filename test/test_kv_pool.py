"""Tests of kv/pool.py: the preallocated block pool owns its storage (shapes from the config, sized from a byte budget
or a block count), hands out each block at most once, takes back only blocks it handed out, makes freed blocks
reusable, maps blocks to flat slots, and keeps exact accounting (blocks/tokens/bytes in use, peak, capacity)."""
import pytest
import torch

from oxygen_ros.kv.pool import KVPool, PoolExhausted, kv_shape_from_config
from oxygen_ros.model import get_config


def test_shapes_and_budget_from_config():
    cfg = get_config("tiny")
    assert kv_shape_from_config(cfg) == (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    pool = KVPool.from_config(cfg, kv_budget_mb=1.0, block_size=16)
    assert pool.num_blocks == (2 ** 20) // (per_token * 16)
    assert len(pool.k) == len(pool.v) == cfg.num_layers
    assert tuple(pool.k[0].shape) == (pool.num_blocks * 16, cfg.num_kv_heads, cfg.head_dim)
    assert pool.bytes_per_token == per_token
    assert pool.capacity_bytes == pool.num_slots * per_token <= 2 ** 20
    bf = KVPool.from_config(get_config("bench-cpu"), num_blocks=4, block_size=8, dtype=torch.bfloat16)
    assert bf.k[0].dtype == torch.bfloat16 and bf.k[0].shape == (32, 1, 64)
    with pytest.raises(ValueError):
        KVPool.from_config(cfg, kv_budget_mb=1e-6)
    with pytest.raises(ValueError):
        KVPool.from_config(cfg)


def test_allocate_free_accounting_and_reuse():
    pool = KVPool(2, 1, 4, num_blocks=6, block_size=4)
    assert pool.free_blocks == 6 and pool.used_bytes == 0
    a = pool.allocate(2)
    b = pool.allocate(3)
    assert len(set(a + b)) == 5 and pool.used_blocks == 5 and pool.used_tokens == 20
    assert pool.used_bytes == 20 * pool.bytes_per_token
    with pytest.raises(PoolExhausted):
        pool.allocate(2)
    pool.check_invariants()
    pool.free(a)
    assert pool.used_blocks == 3 and pool.peak_used_blocks == 5 and pool.peak_tokens == 20
    c = pool.allocate(3)                      # freed memory is reusable
    assert set(a) <= set(c) and pool.free_blocks == 0
    with pytest.raises(RuntimeError):
        pool.free([a[0], a[0]])               # double free is caught (a[0] was re-handed out once)
    pool.free(b)
    with pytest.raises(RuntimeError):
        pool.free(b)
    pool.reset_peak()
    assert pool.peak_used_blocks == pool.used_blocks
    pool.check_invariants()


def test_slots_and_write_roundtrip():
    pool = KVPool(3, 2, 4, num_blocks=5, block_size=4)
    blocks = pool.allocate(2)
    slots = pool.slots(blocks, 6)
    assert slots.tolist() == [blocks[0] * 4 + i for i in range(4)] + [blocks[1] * 4 + i for i in range(2)]
    with pytest.raises(ValueError):
        pool.slots(blocks, 9)
    k = [torch.randn(6, 2, 4) for _ in range(3)]
    v = [torch.randn(6, 2, 4) for _ in range(3)]
    pool.write(slots, k, v)
    for l in range(3):
        assert torch.equal(pool.k[l][slots], k[l]) and torch.equal(pool.v[l][slots], v[l])
    assert pool.blocks_for(0) == 0 and pool.blocks_for(4) == 1 and pool.blocks_for(5) == 2
