"""oxygen_ros.kv: the one owner of language-side KV memory: a preallocated block pool (pool.py) and the cache manager
with shared refcounted frame prefixes and private request state (cache.py). Imports torch, never rclpy."""
from .cache import DecodePlan, FramePrefix, KVCacheManager, RequestState
from .pool import KVPool, PoolExhausted

__all__ = ["DecodePlan", "FramePrefix", "KVCacheManager", "KVPool", "PoolExhausted", "RequestState"]
