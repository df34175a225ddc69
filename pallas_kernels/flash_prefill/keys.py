"""Where a flash tile's key blocks come from: the packed new keys, or a paged cache.

A packed sequence's first `prefix = kv_len - q_len` keys may live in a paged KV cache
(`CachedPrefix`: read through the sequence's block table, dequantized on load) and the
rest in the packed `k`, `v` rows. `KeyBlocks.run` walks a range of `block_kv`-key blocks
in three runs, each loading from one place: blocks wholly inside the prefix (their page
ids fetched one step ahead, so the K/V loads do not wait on a table load), at most one
block mixing cached and new rows, and blocks of new rows only. Without a cache every
block is new rows.

The caller supplies the math: `attend(k, load_v, k0, masked, carry) -> carry`, given a
block's K tile `[block_kv, Dp]`, a thunk loading its V tile, the block's first key
position and whether it needs the mask.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.cache_read import CacheFormat, read_rows, ring_position


@dataclasses.dataclass(frozen=True)
class CacheRefs:
    """The kernel's refs of a cached prefix: block tables `[S, M]`, pools `[N, Hkv, P,
    Dp]` (or as `fmt.layout` says), scales (None, `[1]` or mirroring the pools, groups
    last), and what the pools hold."""

    table: Any
    k_pool: Any
    v_pool: Any
    k_scale: Any
    v_scale: Any
    fmt: CacheFormat
    ring: tuple[int, int] | None


@dataclasses.dataclass(frozen=True)
class KeyBlocks:
    """The key blocks of one tile: sequence `seq`, kv head `kvh`, `kv_len` keys whose
    first `prefix` are cached (`cache`; prefix 0 without one) and the rest are packed rows
    from `k_start` on. Columns: `dims` (a `pl.ds` of Dp), `dim_ok` `[1, Dp]`."""

    k_ref: Any
    v_ref: Any
    cache: CacheRefs | None
    seq: Any
    kvh: Any
    k_start: Any
    kv_len: Any
    prefix: Any
    block_kv: int
    head_dim: int
    padded_dim: int
    dims: Any
    dim_ok: Any
    dtype: Any

    def load_new(self, ref, k0, masked):  # [block_kv, Dp]: keys k0.. of the packed rows
        block_kv, dim_ok = self.block_kv, self.dim_ok
        if masked:  # Keys past kv_len belong to another sequence or to nothing.
            kv_ok = ((k0 + jnp.arange(block_kv)) < self.kv_len)[:, None] & dim_ok
        elif self.padded_dim != self.head_dim:
            kv_ok = jnp.broadcast_to(dim_ok, (block_kv, self.padded_dim))
        else:
            kv_ok = None
        other = None if kv_ok is None else 0.0
        rows = pl.ds(self.k_start - self.prefix + k0, block_kv)
        return plgpu.load(ref.at[rows, self.kvh, self.dims], mask=kv_ok, other=other)

    def locate(self, k0):
        """Block-table entries `[block_kv]` and offsets of keys k0.. in the cache (entries
        of keys past the prefix read as 0; `read_rows` clips them into the pool)."""
        cache = self.cache
        t = k0 + jnp.arange(self.block_kv)
        stored_at = ring_position(t, cache.ring)
        page_size, max_pages = cache.fmt.layout.page_size_of(cache.k_pool), cache.table.shape[1]
        col = stored_at // page_size
        ok = (t < self.prefix) & (col < max_pages)
        entries = plgpu.load(cache.table.at[self.seq, col], mask=ok, other=0)
        return entries, stored_at % page_size

    def load_cached(self, pool, scale, kv, located, rows_ok):  # [block_kv, Dp]
        entries, offsets = located
        at = (entries[:, None], self.kvh, offsets[:, None])
        fmt = self.cache.fmt
        return read_rows(pool, scale, fmt, at, kv, rows_ok, self.head_dim, self.dtype)

    def load_mixed(self, ref, pool, scale, kv, k0):  # [block_kv, Dp]: cached rows, then new
        t = k0 + jnp.arange(self.block_kv)
        in_cache = t < self.prefix
        tile = self.load_cached(pool, scale, kv, self.locate(k0), in_cache)
        fresh_ok = (t >= self.prefix) & (t < self.kv_len)
        rows = (self.k_start - self.prefix + t)[:, None]
        cols = jnp.arange(self.padded_dim)[None, :]
        at = ref.at[rows, self.kvh, cols]
        fresh = plgpu.load(at, mask=fresh_ok[:, None] & self.dim_ok, other=0.0)
        return jnp.where(in_cache[:, None], tile, fresh)

    def _body(self, attend, masked, source, block, carry):
        k0 = block * self.block_kv
        if source == "new":
            load = functools.partial(self.load_new, k0=k0, masked=masked)
            k, load_v = load(self.k_ref), lambda: load(self.v_ref)
        else:  # "both"
            cache = self.cache
            k = self.load_mixed(self.k_ref, cache.k_pool, cache.k_scale, 0, k0)
            load_v = lambda: self.load_mixed(self.v_ref, cache.v_pool, cache.v_scale, 1, k0)  # noqa: E731
        return attend(k, load_v, k0, masked, carry)

    def _cached_body(self, attend, masked, block, carry):
        """A block inside the prefix. Its page ids were loaded by the previous step, so
        the K/V loads do not wait on a table load and pipeline across steps."""
        carry, located = carry
        cache = self.cache
        k0 = block * self.block_kv
        k = self.load_cached(cache.k_pool, cache.k_scale, 0, located, None)  # all cached
        load_v = lambda: self.load_cached(cache.v_pool, cache.v_scale, 1, located, None)  # noqa: E731
        carry = attend(k, load_v, k0, masked, carry)
        return carry, self.locate(k0 + self.block_kv)

    def run(self, lo, hi, masked: bool, carry, attend: Callable):
        """Key blocks [lo, hi), each loaded from where its keys are."""
        if self.cache is None:
            step = functools.partial(self._body, attend, masked, "new")
            return jax.lax.fori_loop(lo, hi, step, carry)
        cache_end, new_start = self.prefix // self.block_kv, pl.cdiv(self.prefix, self.block_kv)
        end = jnp.maximum(lo, jnp.minimum(hi, cache_end))
        step = functools.partial(self._cached_body, attend, masked)
        carry, _ = jax.lax.fori_loop(lo, end, step, (carry, self.locate(lo * self.block_kv)))
        for source, start, end in (
            ("both", jnp.maximum(lo, cache_end), jnp.minimum(hi, new_start)),
            ("new", jnp.maximum(lo, new_start), hi),
        ):
            step = functools.partial(self._body, attend, masked, source)
            carry = jax.lax.fori_loop(start, jnp.maximum(start, end), step, carry)
        return carry
