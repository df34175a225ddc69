"""The paged KV cache: an immutable pytree of K and V page pools.

Layout: `k_pages`, `v_pages` are `[N, Hkv, P, D]` (N pages of P tokens). A page holds all
kv heads of its tokens, each head's P tokens contiguous (`[P, D]`, P*D*2 bytes in bf16:
4 KiB at P=16, D=128). The decode kernel reads one kv head of a page per step, so every
read is one contiguous slab; writes of a new token touch Hkv runs of D values. This is
TensorRT-LLM's per-block layout ([blocks, 2, Hkv, P, D], with K and V as two arrays here).

Addressing (DESIGN.md): token position t of a sequence lives in page
`block_tables[seq, t // P]` at offset `t % P`; its slot is `page * P + offset`.
Example with P=4: a sequence with block table [7, 2] and 6 tokens keeps tokens 0..3 in
page 7 (slots 28..31) and tokens 4, 5 in page 2 (slots 8, 9).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

__all__ = ["PagedKVCache", "gather_kv", "write_kv"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
    """K and V page pools. Arrays are leaves; sizes come from their shapes.

    Attributes:
      k_pages, v_pages: `[N, Hkv, P, D]` (num_pages, num_kv_heads, page_size, head_dim).
    """

    k_pages: Float[Array, "N Hkv P D"]
    v_pages: Float[Array, "N Hkv P D"]

    @classmethod
    def create(
        cls,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype=jnp.bfloat16,
        quant=None,
    ) -> PagedKVCache:
        """An empty (zeroed) cache of `num_pages` pages of `page_size` tokens."""
        if quant is not None:
            raise NotImplementedError("quantized caches: see the quantized-cache issue")
        for name, value in (
            ("num_pages", num_pages),
            ("page_size", page_size),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            if int(value) != value or value < 1:
                raise ValueError(f"PagedKVCache.create: {name}={value} must be a positive int")
        shape = (num_pages, num_kv_heads, page_size, head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

    @property
    def num_pages(self) -> int:
        return self.k_pages.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.k_pages.shape[1]

    @property
    def page_size(self) -> int:
        return self.k_pages.shape[2]

    @property
    def head_dim(self) -> int:
        return self.k_pages.shape[3]

    @property
    def dtype(self):
        return self.k_pages.dtype


def write_kv(
    cache: PagedKVCache,
    k: Float[Array, "T Hkv D"],
    v: Float[Array, "T Hkv D"],
    slot_mapping: Int[Array, " T"],
) -> PagedKVCache:
    """Writes token t's K/V into slot `slot_mapping[t]`; slots < 0 are skipped.

    Returns a new cache. Under `jax.jit(..., donate_argnums=...)` with the cache donated,
    XLA updates the pools in place (no copy of the cache):

        step = jax.jit(write_kv, donate_argnums=0)
        cache = step(cache, k, v, slots)
    """
    if k.shape != v.shape or k.ndim != 3:
        raise ValueError(f"{k.shape=} and {v.shape=}: expected equal shapes [T, Hkv, D]")
    if k.dtype != v.dtype or not jnp.issubdtype(k.dtype, jnp.floating):
        raise ValueError(f"{k.dtype=} and {v.dtype=}: expected one float dtype")
    if k.shape[1:] != (cache.num_kv_heads, cache.head_dim):
        raise ValueError(
            f"{k.shape=}: expected [T, num_kv_heads={cache.num_kv_heads}, "
            f"head_dim={cache.head_dim}] for a cache of {cache.k_pages.shape=}"
        )
    if slot_mapping.shape != (k.shape[0],) or not jnp.issubdtype(slot_mapping.dtype, jnp.integer):
        raise ValueError(
            f"{slot_mapping.shape=}, {slot_mapping.dtype=}: expected int [T={k.shape[0]}]"
        )
    page_size = cache.page_size
    slots = slot_mapping.astype(jnp.int32)
    # Skipped tokens (and slots past the pool) point past the last page and are dropped.
    page = jnp.where(slots >= 0, slots // page_size, cache.num_pages)
    offset = jnp.where(slots >= 0, slots % page_size, 0)

    def scatter(pages, x):  # pages [N, Hkv, P, D], x [T, Hkv, D]
        return pages.at[page, :, offset].set(x.astype(pages.dtype), mode="drop")

    return PagedKVCache(scatter(cache.k_pages, k), scatter(cache.v_pages, v))


def gather_kv(
    cache: PagedKVCache,
    block_tables: Int[Array, "B max_pages"],
    lengths: Int[Array, " B"],
    max_len: int,
) -> tuple[Float[Array, "B max_len Hkv D"], Float[Array, "B max_len Hkv D"]]:
    """Contiguous K and V `[B, max_len, Hkv, D]` of each sequence (for tests, debugging).

    Positions at or past `lengths[b]` (or past the table's capacity) are zeros. Block-table
    entries past a sequence's pages are never read. Page ids are clamped into the pool, as
    the decode kernel does, so a corrupt table never reads outside the cache (and reads
    what the kernel reads): `validate_page_table` reports such tables.
    """
    if block_tables.ndim != 2 or not jnp.issubdtype(block_tables.dtype, jnp.integer):
        raise ValueError(f"{block_tables.shape=}, {block_tables.dtype=}: expected int [B, P]")
    if lengths.shape != block_tables.shape[:1] or not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise ValueError(
            f"{lengths.shape=}, {lengths.dtype=}: expected int [B={block_tables.shape[0]}]"
        )
    page_size = cache.page_size
    pos = jnp.arange(max_len, dtype=jnp.int32)
    table_col = jnp.minimum(pos // page_size, block_tables.shape[1] - 1)
    pages = jnp.clip(block_tables[:, table_col], 0, cache.num_pages - 1)  # [B, max_len]
    valid = (pos[None, :] < lengths[:, None]) & (pos < block_tables.shape[1] * page_size)
    pages = jnp.where(valid, pages, 0)
    offsets = jnp.broadcast_to(pos % page_size, pages.shape)

    def gather(pool):  # [N, Hkv, P, D] -> [B, max_len, Hkv, D]
        x = pool[pages, :, offsets]
        return jnp.where(valid[:, :, None, None], x, 0)

    return gather(cache.k_pages), gather(cache.v_pages)
