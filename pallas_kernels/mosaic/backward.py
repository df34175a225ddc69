"""Flash attention backward for Hopper (sm90) in Pallas Mosaic GPU: dQ and dK/dV kernels.

Both kernels follow the forward's structure (`forward.py`): per block a producer warpgroup
streams tiles through a TMA ring of `num_stages` slots ("loaded" / "consumed" barriers),
and two consumer warpgroups compute on wgmma, each passing over the ring blocks its rows
do not need (waiting and arriving, so barrier phases stay in step).

- dQ: a consumer holds 64 query rows of one head (Q, dO in shared memory; lse, delta in
  registers) and walks the key blocks they see: S = Q K^T, P = exp2(S' - lse), dP = dO
  V^T, dS = P (dP - delta), dQ += dS K. Causal blocks launch the last query tiles (the
  ones seeing the most keys) first. Sinks: as the forward (`common.key_ring`).
- dK/dV: a consumer holds 64 keys of one kv head (K, V in shared memory) and walks, for
  each query head of the group in turn, the query blocks that see them: S^T = K Q^T,
  P^T, dV += P^T dO, dP^T = V dO^T, dS^T = P^T (dP^T - delta), dK += dS^T Q. The group's
  sum stays in registers: no per-query-head dK/dV in HBM. A tile holding sinks walks
  every query block at or past them (`query_block_range`).

The two kernels compute S and dP twice (7 GEMMs where a fused dQ needs 5). Tried on the
H100 and slower (`bench/HISTORY.md`, probe of 2026-11-25 19:40 UTC; GQA 32/8 D128): a
dK/dV kernel reduce-adding each consumer's full dS K into a float32 dQ by TMA (1.7x), one
where the two consumers swap dS^T through shared memory and each reduce-adds half of dQ's
columns (1.3-1.5x), and this dK/dV kernel issuing S^T with dP^T and dV with dK (6-10%).

Inputs come preprocessed (`mosaic_backward`): the base-2 lse (+inf for rows that see no
key, so their P is 0) and delta = rowsum(dO * O) - d(lse) (the lse cotangent enters as
dS = P (dP - delta + g_lse)). With q/kv lengths the padding rows of q, dO, k and v come
zeroed and padding rows get lse +inf and delta 0, so their P and dS are 0; the kernels
read each sequence's lengths for its positions, mask keys past kv_len and skip the blocks
past either length. Packed batches (`mosaic_backward_packed`) read tiles from tables
(`packed.py`); the dK/dV kernel masks the neighbouring sequences' query rows its blocks
hold by position (their lse is finite).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.batch import packed_batch
from pallas_kernels.common import LOG2E, MASK_VALUE, varying_like
from pallas_kernels.mosaic.common import (
    CONSUMER_REGISTERS,
    CONSUMERS,
    PRODUCER_REGISTERS,
    Launch,
    Tile,
    clip,
    consumer_steps,
    floor_div,
    imax,
    imin,
    kernel_options,
    key_ring,
    load_plgpu,
    produce,
    ring_steps,
    sequence_lengths,
    sink_end,
    slot_of,
    split_refs,
    visible,
    within,
    zero_padding,
)
from pallas_kernels.mosaic.config import MosaicBackwardConfig, key_tile_rows, split_columns
from pallas_kernels.mosaic.forward import key_blocks
from pallas_kernels.mosaic.packed import (
    IN_PLACE,
    block_tile,
    check_rows,
    merge_tails,
    tail_rows,
    tile_order,
    tile_table,
)

_ROWS = 64  # query rows (dQ) or keys (dK/dV) per consumer warpgroup
# Head dims above SPLIT_HEAD_DIM split the dK/dV kernel's columns (`split_columns`): the
# two consumers hold the same 64 keys, each accumulating half of dK's and dV's columns
# (64 keys x 256 columns of dK and of dV in float32 would need 256 registers a thread,
# more than a consumer's 232). Each stores such operands as two halves of D / 2 columns;
# the GEMMs over D take both.


def query_block_range(first_key, last_key, *, causal, window, offset, num_blocks, block_q,
                      q_len=None, kv_len=None, q_first=None, kv_first=None,
                      sink_tokens: int = 0):  # fmt: skip
    """(lo, hi, full_lo, full_hi): the query blocks `[lo, hi)` with a row that sees some
    key of `first_key..last_key` (row r sits at position r + offset), and the blocks
    `[full_lo, full_hi)` whose every row sees every one of those keys. With lengths
    (`kv_len` not None; `q_len`, `kv_len`: the sequence's counts), rows at or past q_len
    and keys at or past kv_len see nothing; without, q_len is not read. Packed batches
    (`q_first`, `kv_first`): rows and keys below them are the sequence before's, so the
    blocks holding them are masked (the range may then hold blocks no real row of which
    sees a key: masked, only slower). `sink_tokens` (with a window): the sequence's first
    keys, which every row at or past them sees."""
    lo = full_lo = 0
    hi = full_hi = num_blocks
    if causal:  # rows r >= key - offset see the key
        lo = clip(floor_div(first_key - offset, block_q), 0, num_blocks)
        full_lo = clip(floor_div(last_key - offset + block_q - 1, block_q), 0, num_blocks)
    if window is not None:  # rows r <= key + window - 1 - offset see the key
        hi = clip(floor_div(last_key + window - offset + block_q - 1, block_q), 0, num_blocks)
        first_windowed = first_key  # the first key the window bounds
        if sink_tokens:  # a sink is seen by every later row
            first_windowed = imax(first_key, sink_end(sink_tokens, kv_first))
            hi = jnp.where(first_key < first_windowed, num_blocks, hi)
        full_hi = clip(floor_div(first_windowed + window - offset, block_q), 0, num_blocks)
        if sink_tokens:
            full_hi = jnp.where(last_key < first_windowed, num_blocks, full_hi)
    if kv_len is not None:
        hi = imin(hi, floor_div(q_len + block_q - 1, block_q))  # cdiv(q_len)
        full_hi = imin(full_hi, floor_div(q_len, block_q))
        hi = jnp.where(first_key < kv_len, hi, 0)  # keys all padding: no block
        full_hi = jnp.where(last_key < kv_len, full_hi, 0)  # some padding: all masked
    if q_first is not None:
        full_lo = imax(full_lo, floor_div(q_first + block_q - 1, block_q))
    if kv_first is not None:
        full_hi = jnp.where(first_key >= kv_first, full_hi, 0)
    lo = imin(lo, hi)
    full_lo = clip(full_lo, lo, hi)
    full_hi = clip(full_hi, full_lo, hi)
    return lo, hi, full_lo, full_hi


def _logits(qk, *, rows_first, keys_first, transposed, causal, window, kv_len, soft_cap, scale,
            masked, kv_first=None, pos_range=None, sink_tokens=0):  # fmt: skip
    """Base-2 logits of an S tile `[rows, keys]` (or S^T `[keys, rows]`: `transposed`) and
    the soft-cap's derivative factor `1 - tanh^2` (None without a cap). Masked: invisible
    entries at MASK_VALUE. rows_first / keys_first: positions of the tile's first row/key;
    kv_len: with lengths, the sequence's key count (else None); kv_first, pos_range:
    a packed batch's; sink_tokens: as `common.visible`'s."""
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
        seen = visible(pos, key, causal=causal, window=window, kv_len=kv_len,
                       kv_first=kv_first, pos_range=pos_range, sink_tokens=sink_tokens)  # fmt: skip
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


def _store(tile: Tile, pairs, tail_refs, at, tail_at):
    """Each (shared-memory tile, output ref) of `pairs` to `at` (`(b, rows, head[,
    columns])`), or, for a packed tile cut by its sequence's start or end, into the
    matching tail ref's slot at `tail_at` (`(rows, head[, columns])` in the slot:
    `packed.py`); then waits for the copies."""
    plgpu = load_plgpu()

    def in_place():
        for smem, ref in pairs:
            plgpu.copy_smem_to_gmem(smem, ref.at[at])

    def to_tail():
        for (smem, _), tail in zip(pairs, tail_refs, strict=True):
            plgpu.copy_smem_to_gmem(smem, tail.at[(tile.store, *tail_at)])

    if tile.store is None:
        in_place()
    else:
        pl.when(tile.store == IN_PLACE)(in_place)
        pl.when(tile.store >= 0)(to_tail)
    plgpu.wait_smem_to_gmem(0)


def _dq_kernel(*refs, has_lengths, packed, causal, window, sink_tokens, soft_cap, scale, group,
               launch, stages, block_kv):  # fmt: skip
    # q, do [B, Tq, Hq, D]; k, v [B, Tk, Hkv, D]; lse (base 2), delta [B, Hq, Tq] float32;
    # with lengths, lengths [2, B] int32; dq [B, Tq, Hq, D]. Packed (B = 1): the query
    # tiles' table instead of the lengths, and after dq its tails [2S, 128, Hq, D].
    inputs, lengths_ref, (dq_ref, *tail_refs, smem, barriers) = split_refs(
        refs, 6, has_lengths or packed
    )
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = inputs
    plgpu = load_plgpu()
    q_smem2, do_smem2, row_smem2, k_smem, v_smem = smem
    in_barriers, k_loaded, v_loaded, k_consumed, v_consumed = barriers
    _, q_rows, _, head_dim = q_ref.shape
    kv_rows = k_ref.shape[1]
    dtype = q_ref.dtype
    num_blocks = pl.cdiv(kv_rows, block_kv)
    t, h, b = launch.place()
    wg = lax.axis_index("wg")
    tile = block_tile(lengths_ref, t, b, packed=packed, rows=CONSUMERS * _ROWS, q_rows=q_rows,
                      kv_rows=kv_rows, last_first=causal)  # fmt: skip
    b, seq = tile.batch, tile.seq
    q_len, offset, kv_limit, kv_first = seq.q_len, seq.offset, seq.kv_limit, seq.kv_first
    kvh = h // group

    def blocks_of(consumer):
        first = tile.row + consumer * _ROWS
        return key_blocks(first, _ROWS, q_len=q_len, offset=offset, kv_len=kv_limit,
                          kv_first=kv_first, causal=causal, window=window,
                          num_blocks=num_blocks, block_kv=block_kv)  # fmt: skip

    ring = key_ring(blocks_of, window=window, sink_tokens=sink_tokens, block_kv=block_kv,
                    kv_first=kv_first)  # fmt: skip

    @pl.when(wg < CONSUMERS)
    def _consumer():
        plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
        first_row = tile.row + wg * _ROWS  # in the sequence
        at = tile.q_base + first_row  # in the arrays
        my_lo, my_hi, full_lo, full_hi = consumer_steps(ring, blocks_of(wg))
        q_smem, do_smem, row_smem = q_smem2.at[wg], do_smem2.at[wg], row_smem2.at[wg]
        rows = (b, pl.ds(at, _ROWS), h)
        plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem, in_barriers.at[wg])
        plgpu.copy_gmem_to_smem(do_ref.at[rows], do_smem, in_barriers.at[wg])
        plgpu.copy_gmem_to_smem(lse_ref.at[b, h, pl.ds(at, _ROWS)], row_smem.at[0],
                                in_barriers.at[wg])  # fmt: skip
        plgpu.copy_gmem_to_smem(delta_ref.at[b, h, pl.ds(at, _ROWS)], row_smem.at[1],
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
            s, cap_grad = _logits(qk, rows_first=first_row + offset,
                                  keys_first=ring.block(step) * block_kv, transposed=False,
                                  causal=causal, window=window, kv_len=kv_limit,
                                  kv_first=kv_first, sink_tokens=sink_tokens,
                                  soft_cap=soft_cap, scale=scale, masked=masked)  # fmt: skip
            p = jnp.exp2(s - lax.broadcast_in_dim(lse, s.shape, [0]))
            ds16 = _dscores(p, dp, delta, cap_grad, row_axis=0, dtype=dtype)

            def dq_gemm(acc_ref):
                plgpu.wgmma(acc_ref, ds16, k_smem.at[slot])

            dq = pl.run_state(dq_gemm)(plgpu.ACC.init(dq))
            plgpu.barrier_arrive(k_consumed.at[slot])
            return dq

        bounds = (ring.first, my_lo, full_lo, full_hi, my_hi, ring.hi)
        dq = _walk(bounds, step_body, pass_over, dq)
        q_smem[...] = (dq * scale).astype(dtype)
        plgpu.commit_smem()
        _store(tile, ((q_smem, dq_ref),), tail_refs, rows, (pl.ds(wg * _ROWS, _ROWS), h))

    @pl.when(wg == CONSUMERS)
    def _producer():
        plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")
        sources = ((k_ref, k_smem, k_loaded, k_consumed), (v_ref, v_smem, v_loaded, v_consumed))

        def load(step, wait):
            slot = slot_of(step, stages)
            rows = (b, pl.ds(tile.k_base + ring.block(step) * block_kv, block_kv), kvh)
            for src, dst, loaded, consumed in sources:
                if wait:
                    plgpu.barrier_wait(consumed.at[slot])
                plgpu.copy_gmem_to_smem(src.at[rows], dst.at[slot], loaded.at[slot])

        produce(ring.first, ring.hi, stages, load)


def _dkdv_kernel(*refs, has_lengths, packed, causal, window, sink_tokens, soft_cap, scale,
                 group, launch, stages, block_q):  # fmt: skip
    # The dQ kernel's inputs (and lengths, or packed the key tiles' table); dk, dv
    # [B, Tk, Hkv, D] (packed: then their tails [2S, key_tile_rows(D), Hkv, D]).
    inputs, lengths_ref, (dk_ref, dv_ref, *tail_refs, smem, barriers) = split_refs(
        refs, 6, has_lengths or packed
    )
    # Split columns: K, V [2, 64, D/2] (the halves), Q, dO [stages, 2, bq, D/2].
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = inputs
    plgpu = load_plgpu()
    k_smem2, v_smem2, q_smem, do_smem, row_smem = smem
    in_barriers, q_loaded, q_consumed, *done = barriers
    _, q_rows, _, head_dim = q_ref.shape
    kv_rows = k_ref.shape[1]
    dtype = q_ref.dtype
    num_blocks = pl.cdiv(q_rows, block_q)
    t, kvh, b = launch.place()
    wg = lax.axis_index("wg")
    split, half = split_columns(head_dim), head_dim // 2
    tile = block_tile(lengths_ref, t, b, packed=packed, rows=key_tile_rows(head_dim),
                      q_rows=q_rows, kv_rows=kv_rows)  # fmt: skip
    b, seq = tile.batch, tile.seq
    q_len, offset, kv_limit = seq.q_len, seq.offset, seq.kv_limit
    # Packed: the query blocks hold the neighbours' rows, whose lse is finite: masked.
    pos_range = None if seq.q_first is None else (seq.q_first + offset, q_len + offset)

    def first_key_of(consumer):  # split columns: both consumers hold the tile's 64 keys
        return tile.row if split else tile.row + consumer * _ROWS

    def blocks_of(consumer):
        first = first_key_of(consumer)
        return query_block_range(first, first + _ROWS - 1, causal=causal, window=window,
                                 offset=offset, num_blocks=num_blocks, block_q=block_q,
                                 q_len=q_len, kv_len=kv_limit, q_first=seq.q_first,
                                 kv_first=seq.kv_first, sink_tokens=sink_tokens)  # fmt: skip

    lo, hi = ring_steps(blocks_of)
    span = hi - lo  # ring steps per query head: head g's block j is step g * span + j - lo

    @pl.when(wg < CONSUMERS)
    def _consumer():
        plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
        first_key = first_key_of(wg)  # in the sequence
        my_lo, my_hi, full_lo, full_hi = within(blocks_of(wg), lo, hi)
        keys = (b, pl.ds(tile.k_base + first_key, _ROWS), kvh)
        if split:  # each loads its half of K and V; both wait for all four copies
            out_cols = (pl.ds(wg * half, half),)
            loaded = in_barriers.at[0]
        else:
            out_cols = ()
            loaded = in_barriers.at[wg]
        plgpu.copy_gmem_to_smem(k_ref.at[(*keys, *out_cols)], k_smem2.at[wg], loaded)
        plgpu.copy_gmem_to_smem(v_ref.at[(*keys, *out_cols)], v_smem2.at[wg], loaded)
        plgpu.barrier_wait(loaded)
        layout = plgpu.Layout.WGMMA
        out_dim = half if split else head_dim  # the columns of dK, dV this consumer sums
        zeros = plgpu.layout_cast(jnp.zeros((_ROWS, out_dim), jnp.float32), layout)

        # Views of a ring slot, taken inside the GEMMs' bodies (run_state takes a view's
        # static indices as its own inputs, which Mosaic GPU cannot lower).
        def parts(ref, slot):  # a ring slot's Q or dO: its halves (split) or itself
            return (ref.at[slot, 0], ref.at[slot, 1]) if split else (ref.at[slot],)

        def held(ref):  # the block's K or V: both halves (split), or this consumer's keys
            return (ref.at[0], ref.at[1]) if split else (ref.at[wg],)

        def own(ref, slot):  # the part whose columns this consumer's dK, dV take
            return ref.at[slot, wg] if split else ref.at[slot]

        def over_d(acc_ref, lhs, rhs):  # acc += lhs @ rhs^T, summed over D's parts
            for a, b_part in zip(lhs, rhs, strict=True):
                plgpu.wgmma(acc_ref, a, plgpu.transpose_ref(b_part, (1, 0)))

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
                    over_d(acc_ref, held(k_smem2), parts(q_smem, slot))
                    return acc_ref[...]

                qk = pl.run_scoped(st_gemm, plgpu.ACC((_ROWS, block_q), jnp.float32))
                s, cap_grad = _logits(qk, rows_first=j * block_q + offset, keys_first=first_key,
                                      transposed=True, causal=causal, window=window,
                                      kv_len=kv_limit, kv_first=seq.kv_first,
                                      pos_range=pos_range, sink_tokens=sink_tokens,
                                      soft_cap=soft_cap, scale=scale, masked=masked)  # fmt: skip
                p = jnp.exp2(s - lax.broadcast_in_dim(lse, s.shape, [1]))

                def dv_dp_gemms(refs):
                    dv_ref, dp_ref = refs
                    plgpu.wgmma(dv_ref, p.astype(dtype), own(do_smem, slot))
                    over_d(dp_ref, held(v_smem2), parts(do_smem, slot))

                st_zeros = plgpu.layout_cast(jnp.zeros((_ROWS, block_q), jnp.float32), layout)
                dv, dp = pl.run_state(dv_dp_gemms)((plgpu.ACC.init(dv), plgpu.ACC.init(st_zeros)))
                ds16 = _dscores(p, dp, delta, cap_grad, row_axis=1, dtype=dtype)

                def dk_gemm(acc_ref):
                    plgpu.wgmma(acc_ref, ds16, own(q_smem, slot))

                dk = pl.run_state(dk_gemm)(plgpu.ACC.init(dk))
                plgpu.barrier_arrive(q_consumed.at[slot])
                return dk, dv

            bounds = (lo, my_lo, full_lo, full_hi, my_hi, hi)
            return _walk(bounds, step_body, pass_over, carry)

        dk, dv = lax.fori_loop(0, group, head_loop, (zeros, zeros))
        if split:  # the other consumer reads both halves of K and V until its last step
            plgpu.barrier_arrive(done[0])
            plgpu.barrier_wait(done[0])
        k_out, v_out = k_smem2.at[wg], v_smem2.at[wg]
        k_out[...] = (dk * scale).astype(dtype)
        v_out[...] = dv.astype(dtype)
        plgpu.commit_smem()
        tail_at = (pl.ds(first_key - tile.row, _ROWS), kvh, *out_cols)
        _store(tile, ((k_out, dk_ref), (v_out, dv_ref)), tail_refs, (*keys, *out_cols), tail_at)

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
            rows = (b, pl.ds(tile.q_base + j * block_q, block_q), h)
            for src, dst in ((q_ref, q_smem), (do_ref, do_smem)):
                if split:  # the two column halves
                    for part in range(2):
                        cols = pl.ds(part * half, half)
                        plgpu.copy_gmem_to_smem(src.at[(*rows, cols)], dst.at[slot, part],
                                                q_loaded.at[slot])  # fmt: skip
                else:
                    plgpu.copy_gmem_to_smem(src.at[rows], dst.at[slot], q_loaded.at[slot])
            cols = (b, h, pl.ds(tile.q_base + j * block_q, block_q))
            plgpu.copy_gmem_to_smem(lse_ref.at[cols], row_smem.at[slot, 0], q_loaded.at[slot])
            plgpu.copy_gmem_to_smem(delta_ref.at[cols], row_smem.at[slot, 1], q_loaded.at[slot])

        produce(0, group * span, stages, load)


_STATIC = ("causal", "window", "sink_tokens", "soft_cap", "scale", "config")


@functools.partial(jax.jit, static_argnames=_STATIC)
def mosaic_backward(q, k, v, out, lse, g_out, g_lse=None, q_lengths=None, kv_lengths=None, *,
                    causal=False, window=None, sink_tokens=0, soft_cap=None, scale=1.0,
                    config=None):  # fmt: skip
    """(dq, dk, dv) of dense flash attention from its forward's residuals (either
    forward kernel's: both return the natural lse).

    Args:
      q: `[B, Tq, Hq, D]` bfloat16 or float16; k, v: `[B, Tk, Hkv, D]`, same dtype; D 64,
        128 or 256; Tq, Tk multiples of 128 (the dispatchers check all of this with
        `pallas_kernels.mosaic.support.backward_unsupported` first; this checks Tq and Tk).
      out: the forward's output, like q; lse: its float32 `[B, Hq, Tq]` (not finite: the
        row sees no key); g_out: out's cotangent, q's shape (cast to q's dtype); g_lse:
        lse's or None.
      q_lengths, kv_lengths: the forward's (int `[B]` or None). Padding may hold anything:
        one XLA pass zeroes the padding rows of q, g_out (query rows) and k, v (keys), which
        the GEMMs multiply by zero weights; padding rows and keys get zero gradients.
      causal, window, sink_tokens, soft_cap, scale: the forward's (queries bottom-right
        aligned).
      config: a `MosaicBackwardConfig`; None picks `MosaicBackwardConfig.heuristic`.

    Returns:
      (dq, dk, dv) in the inputs' shapes and dtype.
    """
    config = config or MosaicBackwardConfig.heuristic(causal or window is not None, q.shape[-1])
    batch, q_rows, _, _ = q.shape
    kv_rows = k.shape[1]
    rows = config.rows
    if q_rows % rows or kv_rows % rows:
        raise ValueError(f"mosaic_backward: {q.shape=}, {k.shape=}: Tq, Tk multiples of {rows}")
    g_out = g_out.astype(q.dtype)
    lengths = sequence_lengths(q_lengths, kv_lengths, batch, q_rows, kv_rows)
    real_row = None
    if lengths is not None:
        q, g_out = (zero_padding(x, lengths[0]) for x in (q, g_out))
        k, v = (zero_padding(x, lengths[1]) for x in (k, v))
        real_row = jnp.arange(q_rows)[None, None, :] < lengths[0][:, None, None]  # [B, 1, Tq]
    lse2, delta = _row_terms(out, g_out, lse, g_lse, real_row)
    grids = ((q_rows // rows, batch), (kv_rows // key_tile_rows(q.shape[-1]), batch))
    options = kernel_options(causal, window, sink_tokens, soft_cap, scale)
    return _launch(q, k, v, g_out, lse2, delta, lengths, grids=grids, config=config, **options)


@functools.partial(jax.jit, static_argnames=_STATIC)
def mosaic_backward_packed(q, k, v, out, lse, g_out, g_lse, cu_seqlens_q, cu_seqlens_k, *,
                           causal=False, window=None, sink_tokens=0, soft_cap=None,
                           scale=1.0, config=None):  # fmt: skip
    """(dq, dk, dv) of packed flash attention (`mosaic_forward_packed`'s layout) from its
    forward's residuals.

    Args:
      q: `[Tq, Hq, D]`, k, v: `[Tk, Hkv, D]` (dtypes and D as `mosaic_backward`'s; Tq, Tk
        multiples of 8); out like q, lse float32 `[Hq, Tq]`, g_out like q, g_lse like lse
        or None; cu_seqlens_q, cu_seqlens_k: int `[B + 1]` as the forward's. Rows past
        `cu_seqlens_q[-1]` and keys past `cu_seqlens_k[-1]` may hold anything (zeroed in
        one XLA pass) and get zero gradients.
      causal, window, sink_tokens, soft_cap, scale, config: as `mosaic_backward`'s.

    Returns:
      (dq, dk, dv) in the inputs' shapes and dtype. The dQ kernel tiles each sequence's
      query rows, the dK/dV kernel its keys (`packed.tile_table`, from starts rounded down
      to 8 rows); tiles cut by a sequence's start or end go through tails
      (`packed.merge_tails`).
    """
    check_rows("mosaic_backward_packed", q.shape, k.shape)
    config = config or MosaicBackwardConfig.heuristic(causal or window is not None, q.shape[-1])
    q_rows, kv_rows = q.shape[0], k.shape[0]
    batch = packed_batch(cu_seqlens_q, cu_seqlens_k, q_rows, kv_rows)
    used_q, used_k = batch.q_start[-1:], batch.k_start[-1:]  # rows past them: padding
    q, g_out = (zero_padding(x.astype(q.dtype)[None], used_q) for x in (q, g_out))
    k, v = (zero_padding(x[None], used_k) for x in (k, v))
    real_row = (jnp.arange(q_rows) < used_q)[None, None, :]  # [1, 1, Tq]
    g_lse = None if g_lse is None else g_lse[None]
    lse2, delta = _row_terms(out[None], g_out, lse[None], g_lse, real_row)
    options = kernel_options(causal, window, sink_tokens, soft_cap, scale)
    order = tile_order(options)
    key_rows = key_tile_rows(q.shape[-1])  # the dK/dV kernel's tiles (64 keys above D128)
    tiles = ((config.rows, q_rows, "q"), (key_rows, kv_rows, "kv"))
    tables = tuple(tile_table(batch, rows, n, axis=axis, **order) for rows, n, axis in tiles)
    grids = tuple((table.shape[0], 1) for table in tables)
    (dq, dq_tail), (dk, dv, dk_tail, dv_tail) = _launch(
        q, k, v, g_out, lse2, delta, tables, grids=grids, config=config,
        num_tails=2 * batch.q_len.shape[0], **options,
    )  # fmt: skip
    q_where = tail_rows(batch.q_start, batch.q_rows, config.rows, q_rows)
    k_where = tail_rows(batch.k_start, batch.k_rows, key_rows, kv_rows)
    dq = merge_tails(dq[0], dq_tail, q_where)
    return dq, merge_tails(dk[0], dk_tail, k_where), merge_tails(dv[0], dv_tail, k_where)


def _row_terms(out, g_out, lse, g_lse, real_row):
    """(lse in base 2, delta), float32 `[B, Hq, Tq]`: the kernels' per-row inputs. delta =
    rowsum(dO * O) - d(lse). Rows that see no key (lse not finite) and padding rows
    (`real_row` False, `[B, 1, Tq]`, or None: none) get lse +inf, so their P is 0, and
    padding rows delta 0, whatever their out and lse hold."""
    delta = jnp.sum(out.astype(jnp.float32) * g_out.astype(jnp.float32), axis=-1)
    delta = delta.transpose(0, 2, 1)  # [B, Hq, Tq]
    finite = jnp.isfinite(lse)
    if real_row is not None:
        finite = finite & real_row
        delta = jnp.where(real_row, delta, 0.0)
    if g_lse is not None:
        delta = delta - jnp.where(finite, g_lse, 0.0)
    return jnp.where(finite, lse * LOG2E, jnp.inf), delta


def _launch(q, k, v, g_out, lse2, delta, lengths, *, grids, config, num_tails=None, **options):
    """Both kernels on `[B, T, H, D]` inputs: `lengths` the dense `[2, B]` lengths or None,
    or (`num_tails` given) the packed batch's query and key tile tables; `grids`: the dQ
    and dK/dV kernels' (tiles, batch). Returns (dq, dk, dv); packed, ((dq, dq_tail), (dk,
    dv, dk_tail, dv_tail))."""
    plgpu = load_plgpu()
    _, _, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    stages, dtype = config.num_stages, q.dtype
    packed = num_tails is not None
    tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    opts = dict(group=num_q_heads // num_kv_heads, stages=stages, packed=packed,
                has_lengths=lengths is not None and not packed, **options)  # fmt: skip
    inputs = (q, k, v, g_out, lse2, delta)
    # The kernels' extra input: the lengths (both), or each its own tile table.
    dq_aux, dkdv_aux = lengths if packed else (lengths, lengths)
    common = dict(num_threads=CONSUMERS + 1, thread_name="wg",
                  compiler_params=plgpu.CompilerParams(approx_math=True))  # fmt: skip

    def out_types(like, count, rows):  # rows: of a tile (of a tail slot)
        types = [jax.ShapeDtypeStruct(like.shape, dtype)] * count
        if packed:
            tail = (num_tails, rows, like.shape[2], head_dim)
            types += [jax.ShapeDtypeStruct(tail, dtype)] * count
        return tuple(types)

    def aux(x):  # no lengths: no extra input
        return () if x is None else (x,)

    bk, dq_stages = config.block_kv_dq, config.dq_stages(head_dim)
    dq_launch = Launch(num_q_heads, *grids[0], group=opts["group"])
    dq = plgpu.kernel(
        functools.partial(
            _dq_kernel, block_kv=bk, launch=dq_launch, **{**opts, "stages": dq_stages}
        ),
        out_type=out_types(q, 1, config.rows),
        scratch_types=(
            (
                plgpu.SMEM((CONSUMERS, _ROWS, head_dim), dtype, transforms=tiled),
                plgpu.SMEM((CONSUMERS, _ROWS, head_dim), dtype, transforms=tiled),
                plgpu.SMEM((CONSUMERS, 2, _ROWS), jnp.float32),
                plgpu.SMEM((dq_stages, bk, head_dim), dtype, transforms=tiled),
                plgpu.SMEM((dq_stages, bk, head_dim), dtype, transforms=tiled),
            ),
            (
                plgpu.Barrier(num_arrivals=4, num_barriers=CONSUMERS),
                plgpu.Barrier(num_barriers=dq_stages),
                plgpu.Barrier(num_barriers=dq_stages),
                plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=dq_stages),
                plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=dq_stages),
            ),
        ),
        **dq_launch.grid(),
        **common,
    )(*inputs, *aux(dq_aux))
    dq = varying_like(dq, inputs)

    bq = config.block_q_dkv
    # Split columns: K, V in halves [2, 64, D/2], Q and dO [stages, 2, bq, D/2].
    split, half = split_columns(head_dim), head_dim // 2
    held, ring = ((2, _ROWS, half), (stages, 2, bq, half)) if split else (
        (CONSUMERS, _ROWS, head_dim), (stages, bq, head_dim))  # fmt: skip
    done = (plgpu.Barrier(num_arrivals=CONSUMERS),) if split else ()  # both consumers' last step
    dkdv_launch = Launch(num_kv_heads, *grids[1])
    dkdv = plgpu.kernel(
        functools.partial(_dkdv_kernel, block_q=bq, launch=dkdv_launch, **opts),
        out_type=out_types(k, 2, key_tile_rows(head_dim)),
        scratch_types=(
            (
                plgpu.SMEM(held, dtype, transforms=tiled),
                plgpu.SMEM(held, dtype, transforms=tiled),
                plgpu.SMEM(ring, dtype, transforms=tiled),
                plgpu.SMEM(ring, dtype, transforms=tiled),
                plgpu.SMEM((stages, 2, bq), jnp.float32),
            ),
            (
                # K and V loaded: a consumer's two copies, or (split) all four halves.
                plgpu.Barrier(num_arrivals=4 if split else 2, num_barriers=CONSUMERS),
                plgpu.Barrier(num_arrivals=6 if split else 4, num_barriers=stages),
                plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),
                *done,
            ),
        ),
        **dkdv_launch.grid(),
        **common,
    )(*inputs, *aux(dkdv_aux))
    dkdv = varying_like(dkdv, inputs)
    if packed:
        return dq, dkdv
    return dq[0], *dkdv
