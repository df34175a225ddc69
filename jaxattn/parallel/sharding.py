"""Placing a paged KV cache on a mesh: pools split by kv head, everything else replicated."""

from __future__ import annotations

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxattn.cache import PagedKVCache

__all__ = ["axes_size", "cache_sharding", "shard_cache"]


def axes_size(mesh: Mesh, axes: str | tuple[str, ...]) -> int:
    """Devices along one mesh axis or a tuple of them."""
    size = 1
    for a in axes if isinstance(axes, tuple) else (axes,):
        size *= mesh.shape[a]
    return size


def cache_sharding(cache: PagedKVCache, mesh: Mesh, axis: str | tuple[str, ...]) -> PagedKVCache:
    """The shardings of `cache`'s leaves (a PagedKVCache of NamedShardings): the K/V pools
    `[N, Hkv, P, D]` and per-group scales `[N, Hkv, P, G]` split by kv head over `axis`,
    per-tensor scales replicated. When the kv heads do not split over `axis` (fewer kv
    heads than devices) the pools are replicated: each device keeps every kv head and reads
    those of its query heads (the vLLM / TensorRT-LLM rule)."""
    heads = axis if cache.k_pages.shape[1] % axes_size(mesh, axis) == 0 else None

    def leaf(x):
        spec = P(None, heads) if x.ndim == 4 else P()
        return NamedSharding(mesh, spec)

    return jax.tree.map(leaf, cache)


def shard_cache(cache: PagedKVCache, mesh: Mesh, axis: str | tuple[str, ...]) -> PagedKVCache:
    """`cache` placed on `mesh` as `cache_sharding` says (a copy; block tables and the
    `KVCacheManager` stay replicated: they are small and every device reads them)."""
    return jax.device_put(cache, cache_sharding(cache, mesh, axis))
