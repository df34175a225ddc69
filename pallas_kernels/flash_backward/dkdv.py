"""dK and dV: one program per (kv head, key tile), looping over the query heads of the
kv head's group and, for each, over the query blocks that see the tile (FlashAttention-2's
backward, Dao 2023, algorithm 2, outer loop over key blocks). The group's contributions
are summed in registers, so K/V are never repeated and no two programs write one row:
deterministic, no atomics. Blocks every row sees in full skip the mask arithmetic.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import dot_width
from pallas_kernels.flash_backward.tile import QuerySide, load_keys, logit_grads, tile_at
from pallas_kernels.flash_prefill.logits import TermRefs, TileLogits
from pallas_kernels.tiles import _NUM_REAL, query_block_range


def _dkdv_kernel(*refs, params, has, block_q, block_kv, head_dim, group, dense_shape,
                 tile_loop):  # fmt: skip
    has_index, has_bias, has_mask, has_alibi, has_rel = has
    refs = list(refs)
    # Dense: q_len and kv_len [2, B] (absent: all full); packed: the key-tile table.
    index_ref = refs.pop(0) if has_index else None
    q_ref, k_ref, v_ref, do_ref = (refs.pop(0) for _ in range(4))  # q, dO [Tq_all, Hq, D]
    lse2_ref, delta_ref = refs.pop(0), refs.pop(0)  # float32 [Hq, Tq_all]
    terms = TermRefs(
        bias=refs.pop(0) if has_bias else None,  # [Bb, Hb, Rq, Rk]
        mask=refs.pop(0) if has_mask else None,  # [Bm, Hm, Rq, Rk]
        alibi=refs.pop(0) if has_alibi else None,  # [Hq]
        rel=refs.pop(0) if has_rel else None,  # [Hq, num_buckets]
    )
    dk_ref, dv_ref = refs  # [Tk_all, Hkv, D]
    query_side = QuerySide(q_ref, do_ref, lse2_ref, delta_ref)
    kvh = pl.program_id(0)
    padded_dim = dot_width(head_dim)
    dims = pl.ds(0, padded_dim)
    dim_ok = (jnp.arange(padded_dim) < head_dim)[None, :]  # [1, Dp]
    precision = jax.lax.Precision.HIGHEST if q_ref.dtype == jnp.float32 else None

    def one_tile(tile_id):
        tile = tile_at(index_ref, tile_id, dense_shape, block_kv, first_blocks_first=True)
        c0 = tile.row
        k, v = load_keys(k_ref, v_ref, tile, kvh, c0, block_kv, dims, dim_ok)  # [block_kv, Dp]

        def block(h, masked, qb, carry):
            dk, dv = carry  # float32 [block_kv, Dp]
            r0 = qb * block_q
            q, do, lse2, delta = query_side.load(h, tile, r0, block_q, dims, dim_ok)
            rows = r0 + jnp.arange(block_q)
            logits = TileLogits(params, terms, h, tile.seq, tile.q_start, tile.k_start, r0,
                                rows < tile.q_rows, tile.kv_len - tile.q_len + rows,
                                tile.kv_len, block_q, block_kv, precision)  # fmt: skip
            s = logits(q, k, c0, masked)  # [block_q, block_kv], base 2
            p, dz = logit_grads(s, v, do, lse2, delta, params.soft_cap, precision)
            f32 = jnp.float32
            dv += jnp.dot(p.astype(do.dtype).T, do, precision=precision, preferred_element_type=f32)
            dk += jnp.dot(dz.astype(q.dtype).T, q, precision=precision, preferred_element_type=f32)
            return dk, dv

        lo_b, full_lo_b, full_hi_b, hi_b = query_block_range(
            params, tile.q_len, tile.kv_len, c0, block_q, block_kv
        )
        if has_mask:  # Every block reads the mask anyway.
            full_hi_b = full_lo_b

        def head(g, carry):
            h = kvh * group + g
            for lo, hi, masked in ((lo_b, full_lo_b, True), (full_hi_b, hi_b, True),
                                   (full_lo_b, full_hi_b, False)):  # fmt: skip
                carry = jax.lax.fori_loop(lo, hi, functools.partial(block, h, masked), carry)
            return carry

        zeros = jnp.zeros((block_kv, padded_dim), jnp.float32)
        dk, dv = jax.lax.fori_loop(0, group, head, (zeros, zeros))
        at = (pl.ds(tile.k_start + c0, block_kv), kvh, dims)
        store = ((c0 + jnp.arange(block_kv)) < tile.k_rows)[:, None] & dim_ok
        plgpu.store(dk_ref.at[at], (dk * params.scale).astype(dk_ref.dtype), mask=store)
        plgpu.store(dv_ref.at[at], dv.astype(dv_ref.dtype), mask=store)

    if dense_shape is not None:
        one_tile(pl.program_id(1))
    elif tile_loop:  # A program per potential tile would launch mostly empty ones: loop.
        first, stride = pl.program_id(1), pl.num_programs(1)
        trips = pl.cdiv(jnp.maximum(index_ref[0, _NUM_REAL] - first, 0), stride)
        jax.lax.fori_loop(0, trips, lambda i, c: (one_tile(first + i * stride), c)[1], 0)
    else:
        tile = pl.program_id(1)
        pl.when(tile < index_ref[0, _NUM_REAL])(lambda: one_tile(tile))
