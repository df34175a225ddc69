"""Scale-out on jax's SPMD machinery: partition rules for the kernels, the sharded cache."""

from jaxattn.parallel.sharding import cache_sharding, shard_cache

__all__ = ["cache_sharding", "shard_cache"]
