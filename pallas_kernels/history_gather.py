"""Copying sequences' key/value histories out of the page pools into contiguous rows.

A chunk of many new tokens over a long cached prefix attends faster with its keys
contiguous (the flash kernel's packed path) than read through the block table in the key
loop (`jaxattn.history` says when and by how much). Each buffer row names its source: a
cache slot (page, offset; dequantized on load as the flash kernel's paged path does,
`cache_read.read_rows`), a new (packed) row, or nothing. Blocks of rows with no source
are skipped, so the copy costs what is used, not the buffer's static size.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.cache_read import PLAIN, CacheFormat, read_rows
from pallas_kernels.common import next_power_of_2, whole_array_call

BLOCK_ROWS = 64  # buffer rows per program; buffer sizes are multiples of it
_PAGE, _OFFSET, _NEW = range(3)  # rows of the source table


def _history_gather_kernel(
    src_ref,  # [3, G] int32: page (-1: not from the cache), offset, new row (-1: none)
    k_pool,  # [N, Hkv, P, Dp] stored (quantized as `fmt` says)
    v_pool,
    *refs,
    fmt: CacheFormat,
    head_dim: int,
):
    refs = list(refs)
    k_scale = v_scale = None
    if fmt.dtype is not None:
        k_scale, v_scale = refs.pop(0), refs.pop(0)  # [1] or [N, Hkv, P, G]
    k_new, v_new, k_out, v_out = refs  # [T, Hkv, D] twice, then [G, Hkv, D] twice
    r0 = pl.program_id(0) * BLOCK_ROWS
    kvh = pl.program_id(1)
    rows = pl.ds(r0, BLOCK_ROWS)
    page, new = src_ref[_PAGE, rows], src_ref[_NEW, rows]  # [block]
    offset = src_ref[_OFFSET, rows]

    def copy():
        from_cache, from_new = page >= 0, new >= 0
        dims = jnp.arange(next_power_of_2(head_dim))
        dim_ok = (dims < head_dim)[None, :]
        at = (page[:, None], kvh, offset[:, None])  # pages clipped into the pool on read
        new_at = (jnp.maximum(new, 0)[:, None], kvh, dims[None, :])
        for kv, (pool, scale, fresh, out) in enumerate((
            (k_pool, k_scale, k_new, k_out),
            (v_pool, v_scale, v_new, v_out),
        )):  # fmt: skip
            cached = read_rows(pool, scale, fmt, at, kv, from_cache, head_dim, out.dtype)
            tile = plgpu.load(fresh.at[new_at], mask=from_new[:, None] & dim_ok, other=0.0)
            tile = jnp.where(from_cache[:, None], cached, tile.astype(out.dtype))
            store_ok = jnp.broadcast_to(dim_ok, tile.shape)
            plgpu.store(out.at[rows, kvh, pl.ds(0, len(dims))], tile, mask=store_ok)

    pl.when(jnp.max(jnp.maximum(page, new)) >= 0)(copy)


@functools.partial(jax.jit, static_argnames=("fmt", "interpret"))
def history_gather(
    sources,
    k_pages,
    v_pages,
    k_new,
    v_new,
    *,
    k_scales=None,
    v_scales=None,
    fmt: CacheFormat = PLAIN,
    interpret: bool = False,
):
    """K and V rows `[G, Hkv, D]` in k_new's dtype, copied from where `sources` says.

    Args:
      sources: int32 `[3, G]`, G a multiple of BLOCK_ROWS: per buffer row, the cache page
        (-1: not from the cache) and the offset in it, then the row of `k_new`/`v_new`
        (-1: none). A row with neither source is not written (its value is undefined).
      k_pages, v_pages: `[N, Hkv, P, Dp]`, float or quantized as `fmt` says, with
        k_scales, v_scales (float32 `[]` per tensor, `[N, Hkv, P, G]` per group) or None.
      k_new, v_new: `[T, Hkv, D]`.
    """
    num_rows = sources.shape[1]
    if num_rows % BLOCK_ROWS:
        raise ValueError(f"history_gather: {sources.shape=}: G must be a multiple of {BLOCK_ROWS}")
    inputs = [sources.astype(jnp.int32), k_pages, v_pages]
    if fmt.dtype is not None:
        scales = (k_scales, v_scales)
        if fmt.granularity == "tensor":
            scales = tuple(jnp.reshape(x, (1,)).astype(jnp.float32) for x in scales)
        inputs += scales
    inputs += [k_new, v_new]
    _, num_kv_heads, head_dim = k_new.shape
    out = jax.ShapeDtypeStruct((num_rows, num_kv_heads, head_dim), k_new.dtype)
    kernel = functools.partial(_history_gather_kernel, fmt=fmt, head_dim=head_dim)
    k, v = whole_array_call(
        kernel,
        inputs,
        [out, out],
        grid=(num_rows // BLOCK_ROWS, num_kv_heads),
        num_warps=4,
        num_stages=1,
        interpret=interpret,
        name="history_gather",
    )
    return k, v
