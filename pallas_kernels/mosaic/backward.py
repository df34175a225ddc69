"""Flash attention backward for Hopper (sm90) in Pallas Mosaic GPU: dQ and dK/dV kernels.

Both kernels follow the forward's structure (`forward.py`): per block a producer warpgroup
streams tiles through a TMA ring of `num_stages` slots ("loaded" / "consumed" barriers),
and two consumer warpgroups compute on wgmma, each passing over the ring blocks its rows
do not need (waiting and arriving, so barrier phases stay in step).

- dQ: a consumer holds 64 query rows of one head (Q, dO in shared memory; lse, delta in
  registers) and walks the key blocks they see: S = Q K^T, P = exp2(S' - lse), dP = dO
  V^T, dS = P (dP - delta), dQ += dS K. Causal blocks launch the last query tiles (the
  ones seeing the most keys) first.
- dK/dV: a consumer holds 64 keys of one kv head (K, V in shared memory) and walks, for
  each query head of the group in turn, the query blocks that see them: S^T = K Q^T,
  P^T, dV += P^T dO, dP^T = V dO^T, dS^T = P^T (dP^T - delta), dK += dS^T Q. The group's
  sum stays in registers: no per-query-head dK/dV in HBM.

The two kernels compute S and dP twice (7 GEMMs where a fused dQ needs 5). Tried on the
H100 and slower (`bench/RESULTS.md`, probe of 2026-11-25 19:40 UTC; GQA 32/8 D128): a
dK/dV kernel reduce-adding each consumer's full dS K into a float32 dQ by TMA (1.7x), one
where the two consumers swap dS^T through shared memory and each reduce-adds half of dQ's
columns (1.3-1.5x), and this dK/dV kernel issuing S^T with dP^T and dV with dK (6-10%).

Inputs come preprocessed (`mosaic_backward`): the base-2 lse (+inf for rows that see no
key, so their P is 0) and delta = rowsum(dO * O) - d(lse) (the lse cotangent enters as
dS = P (dP - delta + g_lse)). With q/kv lengths the padding rows of q, dO, k and v come
zeroed and padding rows get lse +inf and delta 0, so their P and dS are 0; the kernels
read each sequence's lengths for its positions, mask keys past kv_len and skip the blocks
past either length.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.common import LOG2E, MASK_VALUE
from pallas_kernels.mosaic.common import (
    CONSUMER_REGISTERS,
    CONSUMERS,
    PRODUCER_REGISTERS,
    clip,
    floor_div,
    imin,
    load_plgpu,
    produce,
    ring_steps,
    sequence_lengths,
    sequence_of,
    slot_of,
    split_refs,
    visible,
    within,
    zero_padding,
)
from pallas_kernels.mosaic.config import MosaicBackwardConfig
from pallas_kernels.mosaic.forward import key_blocks

_ROWS = 64  # query rows (dQ) or keys (dK/dV) per consumer warpgroup


def query_block_range(first_key, last_key, *, causal, window, offset, num_blocks, block_q,
                      q_len=None, kv_len=None):  # fmt: skip
    """(lo, hi, full_lo, full_hi): the query blocks `[lo, hi)` with a row that sees some
    key of `first_key..last_key` (row r sits at position r + offset), and the blocks
    `[full_lo, full_hi)` whose every row sees every one of those keys. With lengths
    (`kv_len` not None; `q_len`, `kv_len`: the sequence's counts), rows at or past q_len
    and keys at or past kv_len see nothing; without, q_len is not read."""
    lo = full_lo = 0
    hi = full_hi = num_blocks
    if causal:  # rows r >= key - offset see the key
        lo = clip(floor_div(first_key - offset, block_q), 0, num_blocks)
        full_lo = clip(floor_div(last_key - offset + block_q - 1, block_q), 0, num_blocks)
    if window is not None:  # rows r <= key + window - 1 - offset see the key
        hi = clip(floor_div(last_key + window - offset + block_q - 1, block_q), 0, num_blocks)
        full_hi = clip(floor_div(first_key + window - offset, block_q), 0, num_blocks)
    if kv_len is not None:
        hi = imin(hi, floor_div(q_len + block_q - 1, block_q))  # cdiv(q_len)
        full_hi = imin(full_hi, floor_div(q_len, block_q))
        hi = jnp.where(first_key < kv_len, hi, 0)  # keys all padding: no block
        full_hi = jnp.where(last_key < kv_len, full_hi, 0)  # some padding: all masked
    lo = imin(lo, hi)
    full_lo = clip(full_lo, lo, hi)
    full_hi = clip(full_hi, full_lo, hi)
    return lo, hi, full_lo, full_hi


def _logits(qk, *, rows_first, keys_first, transposed, causal, window, kv_len, soft_cap, scale,
            masked):  # fmt: skip
    """Base-2 logits of an S tile `[rows, keys]` (or S^T `[keys, rows]`: `transposed`) and
    the soft-cap's derivative factor `1 - tanh^2` (None without a cap). Masked: invisible
    entries at MASK_VALUE. rows_first / keys_first: positions of the tile's first row/key;
    kv_len: with lengths, the sequence's key count (else None)."""
    plgpu = load_plgpu()
    t = None
    if soft_cap is None:
        s = qk * (scale * LOG2E)
    else:
        t = jnp.tanh(qk * (scale / soft_cap))
        s = (soft_cap * LOG2E) * t
    if masked and (causal or window is not None or kv_len is not None):
        layout = plgpu.Layout.WGMMA
        a = plgpu.broadcasted_iota(jnp.int32, qk.shape, 0, layout=layout)
        c = plgpu.broadcasted_iota(jnp.int32, qk.shape, 1, layout=layout)
        pos, key = (
            (c + rows_first, a + keys_first) if transposed else (a + rows_first, c + keys_first)
        )
        seen = visible(pos, key, causal=causal, window=window, kv_len=kv_len)
        s = jnp.where(seen, s, MASK_VALUE)
    return s, None if t is None else 1.0 - t * t


def _dscores(p, dp, delta, cap_grad, *, row_axis: int, dtype):
    """dS = P (dP - delta) of a tile, times the soft-cap's derivative (`cap_grad`, or None),
    in the GEMMs' dtype. `row_axis`: the tile's query-row axis (0 for S, 1 for S^T), which
    delta (one value per row) runs along."""
    ds = p * (dp - lax.broadcast_in_dim(delta, p.shape, [row_axis]))
    if cap_grad is not None:
        ds = ds * cap_grad
    return ds.astype(dtype)


def _walk(bounds, step_body, pass_over, carry):
    """A consumer's pass over the producer's ring steps `[lo, hi)`: those outside its own
    `[my_lo, my_hi)` passed over (`pass_over(step, None)`), the rest through
    `step_body(step, carry, masked=...)`, unmasked only in `[full_lo, full_hi)`."""
    lo, my_lo, full_lo, full_hi, my_hi, hi = bounds
    lax.fori_loop(lo, my_lo, pass_over, None)
    carry = lax.fori_loop(my_lo, full_lo, functools.partial(step_body, masked=True), carry)
    carry = lax.fori_loop(full_lo, full_hi, functools.partial(step_body, masked=False), carry)
    carry = lax.fori_loop(full_hi, my_hi, functools.partial(step_body, masked=True), carry)
    lax.fori_loop(my_hi, hi, pass_over, None)
    return carry


def _dq_kernel(*refs, has_lengths, causal, window, soft_cap, scale, group, stages, block_kv):
    # q, do [B, Tq, Hq, D]; k, v [B, Tk, Hkv, D]; lse (base 2), delta [B, Hq, Tq] float32;
    # with lengths, lengths [2, B] int32; dq [B, Tq, Hq, D].
    inputs, lengths_ref, (dq_ref, smem, barriers) = split_refs(refs, 6, has_lengths)
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = inputs
    plgpu = load_plgpu()
    q_smem2, do_smem2, row_smem2, k_smem, v_smem = smem
    in_barriers, k_loaded, v_loaded, k_consumed, v_consumed = barriers
    _, q_rows, _, head_dim = q_ref.shape
    kv_rows = k_ref.shape[1]
    dtype = q_ref.dtype
    num_blocks = kv_rows // block_kv
    b, h, wg = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("wg")
    seq = sequence_of(lengths_ref, b, q_rows, kv_rows)
    q_len, offset, kv_limit = seq.q_len, seq.offset, seq.kv_limit
    kvh = h // group
    tile = lax.axis_index("tiles")
    if causal:  # the last query tiles see the most keys: launch them first
        tile = q_rows // (CONSUMERS * _ROWS) - 1 - tile

    def blocks_of(consumer):
        first = tile * (CONSUMERS * _ROWS) + consumer * _ROWS
        return key_blocks(first, _ROWS, q_len=q_len, offset=offset, kv_len=kv_limit,
                          causal=causal, window=window, num_blocks=num_blocks,
                          block_kv=block_kv)  # fmt: skip

    lo, hi = ring_steps(blocks_of)

    @pl.when(wg < CONSUMERS)
    def _consumer():
        plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
        first_row = tile * (CONSUMERS * _ROWS) + wg * _ROWS
        my_lo, my_hi, full_lo, full_hi = within(blocks_of(wg), lo, hi)
        q_smem, do_smem, row_smem = q_smem2.at[wg], do_smem2.at[wg], row_smem2.at[wg]
        rows = (b, pl.ds(first_row, _ROWS), h)
        plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem, in_barriers.at[wg])
        plgpu.copy_gmem_to_smem(do_ref.at[rows], do_smem, in_barriers.at[wg])
        plgpu.copy_gmem_to_smem(lse_ref.at[b, h, pl.ds(first_row, _ROWS)], row_smem.at[0],
                                in_barriers.at[wg])  # fmt: skip
        plgpu.copy_gmem_to_smem(delta_ref.at[b, h, pl.ds(first_row, _ROWS)], row_smem.at[1],
                                in_barriers.at[wg])  # fmt: skip
        plgpu.barrier_wait(in_barriers.at[wg])
        row_layout = plgpu.Layout.WGMMA.reduce(1)
        lse = plgpu.load(row_smem.at[0], (), layout=row_layout)
        delta = plgpu.load(row_smem.at[1], (), layout=row_layout)
        dq = plgpu.layout_cast(jnp.zeros((_ROWS, head_dim), jnp.float32), plgpu.Layout.WGMMA)

        def pass_over(step, _):
            slot = slot_of(step, stages)
            for loaded, consumed in ((k_loaded, k_consumed), (v_loaded, v_consumed)):
                plgpu.barrier_wait(loaded.at[slot])
                plgpu.barrier_arrive(consumed.at[slot])

        def step_body(step, dq, *, masked: bool):
            slot = slot_of(step, stages)
            plgpu.barrier_wait(k_loaded.at[slot])
            plgpu.barrier_wait(v_loaded.at[slot])

            def gemms(refs):
                s_ref, dp_ref = refs
                plgpu.wgmma(s_ref, q_smem, plgpu.transpose_ref(k_smem.at[slot], (1, 0)))
                plgpu.wgmma(dp_ref, do_smem, plgpu.transpose_ref(v_smem.at[slot], (1, 0)))

            zeros = plgpu.layout_cast(jnp.zeros((_ROWS, block_kv), jnp.float32), plgpu.Layout.WGMMA)
            qk, dp = pl.run_state(gemms)((plgpu.ACC.init(zeros), plgpu.ACC.init(zeros)))
            plgpu.barrier_arrive(v_consumed.at[slot])
            s, cap_grad = _logits(qk, rows_first=first_row + offset, keys_first=step * block_kv,
                                  transposed=False, causal=causal, window=window,
                                  kv_len=kv_limit, soft_cap=soft_cap, scale=scale,
                                  masked=masked)  # fmt: skip
            p = jnp.exp2(s - lax.broadcast_in_dim(lse, s.shape, [0]))
            ds16 = _dscores(p, dp, delta, cap_grad, row_axis=0, dtype=dtype)

            def dq_gemm(acc_ref):
                plgpu.wgmma(acc_ref, ds16, k_smem.at[slot])

            dq = pl.run_state(dq_gemm)(plgpu.ACC.init(dq))
            plgpu.barrier_arrive(k_consumed.at[slot])
            return dq

        dq = _walk((lo, my_lo, full_lo, full_hi, my_hi, hi), step_body, pass_over, dq)
        q_smem[...] = (dq * scale).astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_smem, dq_ref.at[rows])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == CONSUMERS)
    def _producer():
        plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")
        sources = ((k_ref, k_smem, k_loaded, k_consumed), (v_ref, v_smem, v_loaded, v_consumed))

        def load(step, wait):
            slot = slot_of(step, stages)
            rows = (b, pl.ds(step * block_kv, block_kv), kvh)
            for src, dst, loaded, consumed in sources:
                if wait:
                    plgpu.barrier_wait(consumed.at[slot])
                plgpu.copy_gmem_to_smem(src.at[rows], dst.at[slot], loaded.at[slot])

        produce(lo, hi, stages, load)


def _dkdv_kernel(*refs, has_lengths, causal, window, soft_cap, scale, group, stages, block_q):
    # The dQ kernel's inputs (and lengths); dk, dv [B, Tk, Hkv, D].
    inputs, lengths_ref, (dk_ref, dv_ref, smem, barriers) = split_refs(refs, 6, has_lengths)
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = inputs
    plgpu = load_plgpu()
    k_smem2, v_smem2, q_smem, do_smem, row_smem = smem
    in_barriers, q_loaded, q_consumed = barriers
    _, q_rows, _, head_dim = q_ref.shape
    kv_rows = k_ref.shape[1]
    dtype = q_ref.dtype
    num_blocks = q_rows // block_q
    b, kvh, wg = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("wg")
    seq = sequence_of(lengths_ref, b, q_rows, kv_rows)
    q_len, offset, kv_limit = seq.q_len, seq.offset, seq.kv_limit
    tile = lax.axis_index("tiles")

    def blocks_of(consumer):
        first = tile * (CONSUMERS * _ROWS) + consumer * _ROWS
        return query_block_range(first, first + _ROWS - 1, causal=causal, window=window,
                                 offset=offset, num_blocks=num_blocks, block_q=block_q,
                                 q_len=q_len, kv_len=kv_limit)  # fmt: skip

    lo, hi = ring_steps(blocks_of)
    span = hi - lo  # ring steps per query head: head g's block j is step g * span + j - lo

    @pl.when(wg < CONSUMERS)
    def _consumer():
        plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
        first_key = tile * (CONSUMERS * _ROWS) + wg * _ROWS
        my_lo, my_hi, full_lo, full_hi = within(blocks_of(wg), lo, hi)
        k_smem, v_smem = k_smem2.at[wg], v_smem2.at[wg]
        keys = (b, pl.ds(first_key, _ROWS), kvh)
        plgpu.copy_gmem_to_smem(k_ref.at[keys], k_smem, in_barriers.at[wg])
        plgpu.copy_gmem_to_smem(v_ref.at[keys], v_smem, in_barriers.at[wg])
        plgpu.barrier_wait(in_barriers.at[wg])
        layout = plgpu.Layout.WGMMA
        zeros = plgpu.layout_cast(jnp.zeros((_ROWS, head_dim), jnp.float32), layout)

        def head_loop(g, carry):
            base = g * span - lo  # ring step of block j of this head: base + j

            def pass_over(j, _):
                slot = slot_of(base + j, stages)
                plgpu.barrier_wait(q_loaded.at[slot])
                plgpu.barrier_arrive(q_consumed.at[slot])

            def step_body(j, carry, *, masked: bool):
                dk, dv = carry
                slot = slot_of(base + j, stages)
                plgpu.barrier_wait(q_loaded.at[slot])
                col_layout = layout.reduce(0)
                lse = plgpu.load(row_smem.at[slot, 0], (), layout=col_layout)
                delta = plgpu.load(row_smem.at[slot, 1], (), layout=col_layout)

                def st_gemm(acc_ref):
                    plgpu.wgmma(acc_ref, k_smem, plgpu.transpose_ref(q_smem.at[slot], (1, 0)))
                    return acc_ref[...]

                qk = pl.run_scoped(st_gemm, plgpu.ACC((_ROWS, block_q), jnp.float32))
                s, cap_grad = _logits(qk, rows_first=j * block_q + offset, keys_first=first_key,
                                      transposed=True, causal=causal, window=window,
                                      kv_len=kv_limit, soft_cap=soft_cap, scale=scale,
                                      masked=masked)  # fmt: skip
                p = jnp.exp2(s - lax.broadcast_in_dim(lse, s.shape, [1]))

                def dv_dp_gemms(refs):
                    dv_ref, dp_ref = refs
                    plgpu.wgmma(dv_ref, p.astype(dtype), do_smem.at[slot])
                    plgpu.wgmma(dp_ref, v_smem, plgpu.transpose_ref(do_smem.at[slot], (1, 0)))

                st_zeros = plgpu.layout_cast(jnp.zeros((_ROWS, block_q), jnp.float32), layout)
                dv, dp = pl.run_state(dv_dp_gemms)((plgpu.ACC.init(dv), plgpu.ACC.init(st_zeros)))
                ds16 = _dscores(p, dp, delta, cap_grad, row_axis=1, dtype=dtype)

                def dk_gemm(acc_ref):
                    plgpu.wgmma(acc_ref, ds16, q_smem.at[slot])

                dk = pl.run_state(dk_gemm)(plgpu.ACC.init(dk))
                plgpu.barrier_arrive(q_consumed.at[slot])
                return dk, dv

            bounds = (lo, my_lo, full_lo, full_hi, my_hi, hi)
            return _walk(bounds, step_body, pass_over, carry)

        dk, dv = lax.fori_loop(0, group, head_loop, (zeros, zeros))
        k_smem[...] = (dk * scale).astype(dtype)
        v_smem[...] = dv.astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(k_smem, dk_ref.at[keys])
        plgpu.copy_smem_to_gmem(v_smem, dv_ref.at[keys])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == CONSUMERS)
    def _producer():
        plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

        def load(step, wait):
            slot = slot_of(step, stages)
            g = step // span if isinstance(step, int) else lax.div(step, span)
            j = lo + step - g * span
            h = kvh * group + g
            if wait:
                plgpu.barrier_wait(q_consumed.at[slot])
            rows = (b, pl.ds(j * block_q, block_q), h)
            plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem.at[slot], q_loaded.at[slot])
            plgpu.copy_gmem_to_smem(do_ref.at[rows], do_smem.at[slot], q_loaded.at[slot])
            cols = (b, h, pl.ds(j * block_q, block_q))
            plgpu.copy_gmem_to_smem(lse_ref.at[cols], row_smem.at[slot, 0], q_loaded.at[slot])
            plgpu.copy_gmem_to_smem(delta_ref.at[cols], row_smem.at[slot, 1], q_loaded.at[slot])

        produce(0, group * span, stages, load)


@functools.partial(jax.jit, static_argnames=("causal", "window", "soft_cap", "scale", "config"))
def mosaic_backward(q, k, v, out, lse, g_out, g_lse=None, q_lengths=None, kv_lengths=None, *,
                    causal=False, window=None, soft_cap=None, scale=1.0, config=None):  # fmt: skip
    """(dq, dk, dv) of dense flash attention from its forward's residuals (either
    forward kernel's: both return the natural lse).

    Args:
      q: `[B, Tq, Hq, D]` bfloat16 or float16; k, v: `[B, Tk, Hkv, D]`, same dtype; D 64
        or 128; Tq, Tk multiples of 128 (the dispatchers check all of this with
        `pallas_kernels.mosaic.support.backward_unsupported` first; this checks Tq and Tk).
      out: the forward's output, like q; lse: its float32 `[B, Hq, Tq]` (not finite: the
        row sees no key); g_out: out's cotangent, q's shape (cast to q's dtype); g_lse:
        lse's or None.
      q_lengths, kv_lengths: the forward's (int `[B]` or None). Padding may hold anything:
        one XLA pass zeroes the padding rows of q, g_out (query rows) and k, v (keys), which
        the GEMMs multiply by zero weights; padding rows and keys get zero gradients.
      causal, window, soft_cap, scale: the forward's (queries bottom-right aligned).
      config: a `MosaicBackwardConfig`; None picks `MosaicBackwardConfig.heuristic`.

    Returns:
      (dq, dk, dv) in the inputs' shapes and dtype.
    """
    plgpu = load_plgpu()
    config = config or MosaicBackwardConfig.heuristic(causal or window is not None)
    batch, q_rows, num_q_heads, head_dim = q.shape
    kv_rows, num_kv_heads = k.shape[1], k.shape[2]
    group = num_q_heads // num_kv_heads
    stages, dtype = config.num_stages, q.dtype
    rows = config.rows
    if q_rows % rows or kv_rows % rows:
        raise ValueError(f"mosaic_backward: {q.shape=}, {k.shape=}: Tq, Tk multiples of {rows}")
    g_out = g_out.astype(dtype)
    lengths = sequence_lengths(q_lengths, kv_lengths, batch, q_rows, kv_rows)
    if lengths is not None:
        q, g_out = (zero_padding(x, lengths[0]) for x in (q, g_out))
        k, v = (zero_padding(x, lengths[1]) for x in (k, v))
        real_row = jnp.arange(q_rows)[None, None, :] < lengths[0][:, None, None]  # [B, 1, Tq]
    delta = jnp.sum(out.astype(jnp.float32) * g_out.astype(jnp.float32), axis=-1)
    delta = delta.transpose(0, 2, 1)  # [B, Hq, Tq]
    finite = jnp.isfinite(lse)  # not: the row sees no key
    if lengths is not None:  # padding rows: no weight, whatever their out and lse hold
        finite = finite & real_row
        delta = jnp.where(real_row, delta, 0.0)
    if g_lse is not None:
        delta = delta - jnp.where(finite, g_lse, 0.0)
    lse2 = jnp.where(finite, lse * LOG2E, jnp.inf)
    tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    opts = dict(causal=causal, window=window, soft_cap=soft_cap, scale=scale, group=group,
                stages=stages, has_lengths=lengths is not None)  # fmt: skip
    inputs = (q, k, v, g_out, lse2, delta) + (() if lengths is None else (lengths,))
    common = dict(num_threads=CONSUMERS + 1, thread_name="wg",
                  compiler_params=plgpu.CompilerParams(approx_math=True))  # fmt: skip

    bk = config.block_kv_dq
    dq = plgpu.kernel(
        functools.partial(_dq_kernel, block_kv=bk, **opts),
        out_type=jax.ShapeDtypeStruct(q.shape, dtype),
        scratch_types=(
            (
                plgpu.SMEM((CONSUMERS, _ROWS, head_dim), dtype, transforms=tiled),
                plgpu.SMEM((CONSUMERS, _ROWS, head_dim), dtype, transforms=tiled),
                plgpu.SMEM((CONSUMERS, 2, _ROWS), jnp.float32),
                plgpu.SMEM((stages, bk, head_dim), dtype, transforms=tiled),
                plgpu.SMEM((stages, bk, head_dim), dtype, transforms=tiled),
            ),
            (
                plgpu.Barrier(num_arrivals=4, num_barriers=CONSUMERS),
                plgpu.Barrier(num_barriers=stages),
                plgpu.Barrier(num_barriers=stages),
                plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),
                plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),
            ),
        ),
        grid=(num_q_heads, q_rows // rows, batch),
        grid_names=("heads", "tiles", "batch"),
        **common,
    )(*inputs)

    bq = config.block_q_dkv
    dk, dv = plgpu.kernel(
        functools.partial(_dkdv_kernel, block_q=bq, **opts),
        out_type=(jax.ShapeDtypeStruct(k.shape, dtype), jax.ShapeDtypeStruct(v.shape, dtype)),
        scratch_types=(
            (
                plgpu.SMEM((CONSUMERS, _ROWS, head_dim), dtype, transforms=tiled),
                plgpu.SMEM((CONSUMERS, _ROWS, head_dim), dtype, transforms=tiled),
                plgpu.SMEM((stages, bq, head_dim), dtype, transforms=tiled),
                plgpu.SMEM((stages, bq, head_dim), dtype, transforms=tiled),
                plgpu.SMEM((stages, 2, bq), jnp.float32),
            ),
            (
                plgpu.Barrier(num_arrivals=2, num_barriers=CONSUMERS),
                plgpu.Barrier(num_arrivals=4, num_barriers=stages),
                plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),
            ),
        ),
        grid=(num_kv_heads, kv_rows // rows, batch),
        grid_names=("heads", "tiles", "batch"),
        **common,
    )(*inputs)
    return dq, dk, dv
