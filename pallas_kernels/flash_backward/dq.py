"""dQ, and the gradients of the logits' extra terms: one program per (query head, query
tile), looping over the key blocks the tile sees (FlashAttention-2's backward, Dao 2023,
algorithm 2, with the dQ loop split out as in its Triton version so that no two programs
write one row: deterministic, no atomics).

The same program holds dz, the gradient of each block's logits, and so also writes:
  - dbias: dz itself, into a full `[B, Hq, Tq, Tk]` float32 array (zeros where no key is
    visible); the caller sums it over the bias's broadcast axes;
  - ALiBi: sum(dz * -|p - j|), one partial per (head, tile);
  - T5: dz summed by relative-position bucket, `[num_buckets]` partials per (head, tile).
The partials are summed by the caller in a fixed order, so they too are deterministic.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import dot_width, relative_position_bucket
from pallas_kernels.flash_backward.tile import QuerySide, load_keys, logit_grads, tile_at
from pallas_kernels.flash_prefill.logits import TermRefs, TileLogits
from pallas_kernels.tiles import _NUM_REAL, key_block_range


def _dq_kernel(*refs, params, has, grads_of, block_q, block_kv, head_dim, group, dense_shape,
               tile_loop):  # fmt: skip
    has_index, has_bias, has_mask, has_alibi, has_rel = has
    want_bias, want_alibi, want_rel = grads_of
    refs = list(refs)
    index_ref = refs.pop(0) if has_index else None  # [2, B] lengths, or the q-tile table
    q_ref, k_ref, v_ref, do_ref = (refs.pop(0) for _ in range(4))
    lse2_ref, delta_ref = refs.pop(0), refs.pop(0)  # float32 [Hq, Tq_all]
    terms = TermRefs(
        bias=refs.pop(0) if has_bias else None,  # [Bb, Hb, Rq, Rk]
        mask=refs.pop(0) if has_mask else None,  # [Bm, Hm, Rq, Rk]
        alibi=refs.pop(0) if has_alibi else None,  # [Hq]
        rel=refs.pop(0) if has_rel else None,  # [Hq, num_buckets]
    )
    refs = refs[sum(grads_of) :]  # the zeros aliased to the extras' gradient outputs
    dq_ref = refs.pop(0)  # [Tq_all, Hq, D]
    dbias_ref = refs.pop(0) if want_bias else None  # float32 [Bb, Hq, Rq, Rk], full
    dslope_ref = refs.pop(0) if want_alibi else None  # float32 [Hq, tiles]
    dtable_ref = refs.pop(0) if want_rel else None  # float32 [Hq, tiles, NBp]
    query_side = QuerySide(q_ref, do_ref, lse2_ref, delta_ref)
    h = pl.program_id(0)
    kvh = h // group
    padded_dim = dot_width(head_dim)
    dims = pl.ds(0, padded_dim)
    dim_ok = (jnp.arange(padded_dim) < head_dim)[None, :]  # [1, Dp]
    precision = jax.lax.Precision.HIGHEST if q_ref.dtype == jnp.float32 else None
    num_buckets = 0 if dtable_ref is None else terms.rel.shape[-1]
    buckets_p2 = 0 if dtable_ref is None else dtable_ref.shape[-1]

    def one_tile(tile_id):
        tile = tile_at(index_ref, tile_id, dense_shape, block_q, first_blocks_first=False)
        r0 = tile.row
        rows = r0 + jnp.arange(block_q)
        row_store = rows < tile.q_rows
        q_pos = tile.kv_len - tile.q_len + rows  # [block_q]
        q, do, lse2, delta = query_side.load(h, tile, r0, block_q, dims, dim_ok)
        logits = TileLogits(params, terms, h, tile.seq, tile.q_start, tile.k_start, r0,
                            row_store, q_pos, tile.kv_len, block_q, block_kv,
                            precision)  # fmt: skip

        def block(masked, kb, carry):
            dq, slope, table = carry
            k0 = kb * block_kv
            keys = k0 + jnp.arange(block_kv)
            k, v = load_keys(k_ref, v_ref, tile, kvh, k0, block_kv, dims, dim_ok, masked)
            s = logits(q, k, k0, masked)  # [block_q, block_kv], base 2
            _, dz = logit_grads(s, v, do, lse2, delta, params.soft_cap, precision)
            f32 = jnp.float32
            dq += jnp.dot(dz.astype(k.dtype), k, precision=precision, preferred_element_type=f32)
            if dbias_ref is not None:
                _store_logit_tile(dbias_ref, dz, tile, h, r0, k0, row_store, keys, params)
            if dslope_ref is not None:
                slope += jnp.sum(dz * -jnp.abs(q_pos[:, None] - keys[None, :]).astype(f32))
            if dtable_ref is not None:
                bucket = relative_position_bucket(keys[None, :] - q_pos[:, None], num_buckets,
                                                  params.rel_max_distance,
                                                  params.rel_bidirectional)  # fmt: skip
                slots = jnp.arange(buckets_p2)
                for b in range(num_buckets):  # T5 tables are small (32 buckets typical)
                    table += jnp.where(slots == b, jnp.sum(jnp.where(bucket == b, dz, 0.0)), 0.0)
            return dq, slope, table

        lo_b, full_lo_b, full_hi_b, hi_b = key_block_range(
            params, tile.q_len, tile.kv_len, r0, block_q, block_kv
        )
        if has_mask:  # Every block reads the mask anyway.
            full_hi_b = full_lo_b
        carry = (
            jnp.zeros((block_q, padded_dim), jnp.float32),
            jnp.float32(0.0),
            jnp.zeros((max(buckets_p2, 1),), jnp.float32),
        )
        runs = [(lo_b, full_lo_b, True), (full_hi_b, hi_b, True), (full_lo_b, full_hi_b, False)]
        if params.window is not None and params.sink_tokens:  # sink blocks before the window
            sink_b = jnp.minimum(pl.cdiv(params.sink_tokens, block_kv), hi_b)
            runs.insert(0, (0, jnp.minimum(sink_b, lo_b), True))
        for lo, hi, masked in runs:
            carry = jax.lax.fori_loop(lo, hi, functools.partial(block, masked), carry)
        dq, slope, table = carry
        at = (pl.ds(tile.q_start + r0, block_q), h, dims)
        dq = (dq * params.scale).astype(dq_ref.dtype)
        plgpu.store(dq_ref.at[at], dq, mask=row_store[:, None] & dim_ok)
        if dslope_ref is not None:
            dslope_ref[h, tile_id] = slope
        if dtable_ref is not None:
            plgpu.store(dtable_ref.at[h, tile_id, pl.ds(0, buckets_p2)], table)

    if dense_shape is not None:
        one_tile(pl.program_id(1))
    elif tile_loop:  # A program per potential tile would launch mostly empty ones: loop.
        first, stride = pl.program_id(1), pl.num_programs(1)
        trips = pl.cdiv(jnp.maximum(index_ref[0, _NUM_REAL] - first, 0), stride)
        jax.lax.fori_loop(0, trips, lambda i, c: (one_tile(first + i * stride), c)[1], 0)
    else:
        tile = pl.program_id(1)
        pl.when(tile < index_ref[0, _NUM_REAL])(lambda: one_tile(tile))


def _store_logit_tile(ref, dz, tile, h, r0, k0, row_store, keys, params):
    """dz `[block_q, block_kv]` into the full float32 `[Bb, Hq, Rq, Rk]` gradient of a bias,
    indexed as the forward reads the bias (`TileLogits`): by sequence, head and position
    (dense) or packed coordinates (packed, `Bb == 1`)."""
    block_q, block_kv = dz.shape
    b = jnp.int32(0) if params.packed_coords else tile.seq
    row0 = (tile.q_start if params.packed_coords else 0) + r0
    col0 = (tile.k_start if params.packed_coords else 0) + k0
    ok = row_store[:, None] & (keys < tile.kv_len)[None, :]
    plgpu.store(ref.at[b, h, pl.ds(row0, block_q), pl.ds(col0, block_kv)], dz, mask=ok)
