"""Scale-out on jax's SPMD machinery: partition rules for the kernels (`partition`), the
sharded cache (`sharding`), tensor-parallel models (`tensor`), and context parallelism:
ring (`ring`) and all-to-all (`ulysses`) attention over a sequence split across devices,
and a wrapper choosing between them (`context`)."""

from jaxattn.parallel.context import choose_method, context_parallel_attention
from jaxattn.parallel.ring import ring_attention, zigzag_shard, zigzag_unshard
from jaxattn.parallel.sharding import cache_sharding, shard_cache
from jaxattn.parallel.tensor import (
    duplicate_kv_heads,
    param_shardings,
    shard_model,
    shard_serving,
)
from jaxattn.parallel.ulysses import kv_heads_on_the_wire, ulysses_attention

__all__ = [
    "cache_sharding",
    "choose_method",
    "context_parallel_attention",
    "duplicate_kv_heads",
    "kv_heads_on_the_wire",
    "param_shardings",
    "ring_attention",
    "shard_cache",
    "shard_model",
    "shard_serving",
    "ulysses_attention",
    "zigzag_shard",
    "zigzag_unshard",
]
