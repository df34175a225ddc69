"""Flash attention forward for Hopper (sm90) in Pallas Mosaic GPU: TMA, wgmma, warp
specialization.

A block computes `2 * block_q` query rows of one query head of one sequence (a tile); in
the persistent form (more tiles than SMs, of full attention or of causal attention over a
dense batch), one block per SM computes tile after tile, its ring running on across them:
alike tiles by stride, causal ones from a table dealt when the kernel is built as the GPU
would hand out a block per tile (`Launch.walk`). O leaves through tiles of its own, or
where those do not fit (192-key steps at D128) through the rows of the last key block's
ring slots that lie past Tk, and each consumer loads its next tile's Q once its last S
GEMM of this one is done; failing both (Tk a multiple of 192), O leaves through Q's
buffer and the next Q loads after its copy (`o_staging`). Full attention's last
key block, when Tk is not a multiple of `block_kv`, runs as a narrower step over its real
keys. A block runs three warpgroups (FlashAttention-3, Shah et al. 2024):

- a producer (warpgroup 2) that only issues TMA copies of the head's K and V blocks into
  a ring of `num_stages` shared-memory slots, each slot guarded by a "loaded" barrier
  (TMA completes it) and a "consumed" barrier (both consumers arrive), and gives most of
  its registers away (`set_max_registers`; section 3.1, warp specialization and register
  reallocation);
- two consumers (warpgroups 0 and 1), `block_q` rows each, that run the online softmax in
  base 2 on the wgmma accumulators (S = Q K^T from shared memory, then O += P V with P
  from registers). A two-party "schedule" barrier makes them take turns on the tensor
  cores: one's softmax overlaps the other's GEMMs (section 3.2, ping-pong scheduling).
  In the persistent form a consumer hands its next tile's first turn over as soon as its
  tile's last P V GEMM is issued (or after the steps it passes over past its own), so
  that the other consumer's GEMMs run under its epilogue (FlashAttention-3 too hands the
  turn over before its epilogue).
  Each consumer waits for its next K block while its P V GEMM is in flight: a small part
  of section 3.3. Its full intra-warpgroup overlap (block j's S GEMM issued with block
  j-1's P V GEMM, the softmax under the latter) was tried: level on full attention and
  1.5-1.7x slower on causal rows (H100, 2026-11-25; more registers live across the
  masked blocks), so it is not used.

Semantics are those of `jaxattn.reference` for a dense batch: query row r sits at position
`r + Tk - Tq` (bottom-right aligned; with lengths, `r + kv_len - q_len` of its sequence),
causal hides keys past it, a window W keeps keys `j > p - W` and the sequence's first
`sink_tokens` keys (attention sinks: the producer loads their blocks below the window's
as extra ring steps, `common.key_ring`), keys at or past `kv_len` are padding, and the
soft-cap bends the scaled logits. Key blocks a consumer's rows
cannot see are skipped (the producer loads the union of both consumers' ranges; a
consumer passes over the blocks outside its own, waiting and arriving so the barriers'
phases stay in step). Masks are computed only on blocks that straddle a boundary. Rows
that see no key, and padding rows, output zeros and lse -inf.

What runs here and what falls back to the Triton kernel is decided by
`pallas_kernels.mosaic.support` (`forward_unsupported`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.batch import packed_batch
from pallas_kernels.common import LN2, LOG2E, MASK_VALUE, device_sm_count, varying_like
from pallas_kernels.mosaic.common import (
    CONSUMER_REGISTERS,
    CONSUMERS,
    PRODUCER_REGISTERS,
    KeyRing,
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
    sequence_lengths,
    slot_of,
    split_refs,
    visible,
    zero_padding,
)
from pallas_kernels.mosaic.config import KEY_ROWS, MosaicForwardConfig, full_attention
from pallas_kernels.mosaic.packed import (
    IN_PLACE,
    block_tile,
    check_rows,
    merge_tails,
    tail_rows,
    tile_order,
    tile_table,
)

# The running maximum starts here, above the masked logits (MASK_VALUE): a masked key's
# weight exp2(MASK_VALUE - m) is 0 even before the row has seen a key, so a row that
# never sees one keeps O = 0 and l = 0 exactly (and its max is still NO_KEY at the end).
_NO_KEY = 0.5 * MASK_VALUE


def block_range(
    first_pos, last_pos, *, causal, window, num_blocks, block_kv, kv_len=None, kv_first=None
):
    """(lo, hi, full_lo, full_hi): the key blocks `[lo, hi)` holding a key visible to some
    row at positions `first_pos..last_pos` (int32 scalars), and the blocks `[full_lo,
    full_hi)` whose keys every such row sees (no mask needed). `kv_len`: with lengths,
    the sequence's key count (no key at or past it is visible); rows then may be none
    (`last_pos < first_pos`: an empty range). `kv_first` (with `kv_len`): keys below it
    are not the sequence's (fewer than `block_kv` of them: only the first block needs
    the mask).
    Plain integer arithmetic: runs in kernels and in tests alike; bounds that do not
    depend on the rows stay Python ints."""
    lo = full_lo = 0
    hi = full_hi = num_blocks
    if causal:
        hi = clip(floor_div(last_pos + block_kv, block_kv), 0, num_blocks)  # cdiv(last + 1)
        full_hi = clip(floor_div(first_pos + 1, block_kv), 0, num_blocks)
    if window is not None:
        lo = clip(floor_div(first_pos - window + 1, block_kv), 0, num_blocks)
        full_lo = clip(floor_div(last_pos - window + block_kv, block_kv), 0, num_blocks)
    if kv_len is not None:
        hi = imin(hi, floor_div(kv_len + block_kv - 1, block_kv))  # cdiv(kv_len)
        full_hi = imin(full_hi, floor_div(kv_len, block_kv))
        some = last_pos >= first_pos  # some row, and (window) some key below kv_len
        some = some if window is None else some & (first_pos - window + 1 < kv_len)
        if kv_first is not None:  # packed: the sequence's keys are [kv_first, kv_len)
            some = some & (kv_len > kv_first)
            some = some & (last_pos >= kv_first) if causal else some
            full_lo = imax(full_lo, floor_div(kv_first + block_kv - 1, block_kv))
        hi = jnp.where(some, hi, 0)
    lo = imin(lo, hi)
    full_lo = clip(full_lo, lo, hi)
    full_hi = clip(full_hi, full_lo, hi)
    return lo, hi, full_lo, full_hi


def key_blocks(first_row, rows: int, *, q_len, offset, kv_len, kv_first=None, **range_options):
    """`block_range` of a consumer's query rows `first_row .. first_row + rows - 1`: those
    before `q_len` (the rest are padding), at positions `row + offset`; `kv_len`: None
    without lengths. The forward's and the dQ kernel's consumers take their key blocks
    from here."""
    last = imin(first_row + rows, q_len) - 1  # the last real row
    first, last = first_row + offset, last + offset
    return block_range(first, last, kv_len=kv_len, kv_first=kv_first, **range_options)


K_SLOT, V_SLOT = 0, 1  # a ring slot's K or V buffer (`OStaging.spare`)


class OStaging(NamedTuple):
    """Where a block stages its O tiles for their copy out: in tiles of their own
    (`tiles`), in rows of the last key block's ring slots that its short step does not
    read (`spare`: per consumer, (K_SLOT or V_SLOT, first row)), or else in Q's buffer."""

    tiles: bool = False
    spare: tuple = ()


def short_tail_keys(kv_rows: int, block_kv: int, *, causal, window, ragged) -> int:
    """The real keys of the last key block when full attention over a dense batch runs
    it as a narrower step (Tk not a multiple of `block_kv`: 64 or 128 of 192), else 0."""
    return kv_rows % block_kv if full_attention(causal, window, ragged) else 0


def o_staging(config: MosaicForwardConfig, head_dim: int, itemsize: int, *,
              persistent: bool, tail_keys: int) -> OStaging:  # fmt: skip
    """A block per tile: Q's buffer (nothing loads after O). Persistent: O tiles of its
    own where they fit (`config.out_tiles`), so that the next Q loads under the last
    steps; else the spare rows of a short last step (`tail_keys` > 0: 64 rows for each
    consumer, K's first, then V's), which keep that overlap; else Q's buffer, the next Q
    loading after O's copy has read it."""
    if not persistent:
        return OStaging()
    if config.out_tiles(head_dim, itemsize):
        return OStaging(tiles=True)
    if not tail_keys:
        return OStaging()
    rows = range(tail_keys, config.block_kv, config.block_q)  # at least one a slot
    return OStaging(spare=tuple((buf, r) for buf in (K_SLOT, V_SLOT) for r in rows)[:CONSUMERS])


class _Work(NamedTuple):
    """One query tile's work: where it is (`tile`, query head `h`, kv head `kvh`), the
    key count past which keys are masked (`kv_limit`, or None) and the key blocks its
    producer loads (`ring`)."""

    tile: Tile
    h: object
    kvh: object
    kv_limit: object
    ring: KeyRing


def _kernel(
    *refs,
    has_lengths: bool,
    packed: bool,
    causal: bool,
    window: int | None,
    sink_tokens: int,
    soft_cap: float | None,
    scale: float,
    group: int,
    launch: Launch,
    persistent: int,
    walks: bool,
    tail_keys: int,
    staging: OStaging,
    config: MosaicForwardConfig,
):
    # q [B, Tq, Hq, D], k and v [B, Tk, Hkv, D] (GMEM); with lengths, lengths [2, B] int32
    # (`sequence_lengths`); out [B, Tq, Hq, D]; lse [B, Hq, Tq] float32, natural log.
    # Packed (B = 1): the tile table instead of the lengths (`packed.tile_table`), and
    # after out and lse their tails [2S, rows, Hq, D] and [2S, Hq, rows] (`packed.py`).
    # `persistent` (> 0): that many blocks (`persistent_blocks`), block p taking the tiles
    # p, p + persistent, ... of the launch order where tiles are all alike, or (`walks`:
    # causal tiles) those its row of the walks table `[persistent, 1 + n]` (`Launch.walk`,
    # after the lengths) lists; 0: a block per tile.
    (q_ref, k_ref, v_ref), lengths_ref, rest = split_refs(refs, 3, has_lengths or packed)
    walks_ref, rest = (rest[0], rest[1:]) if walks else (None, rest)
    out_ref, lse_ref, *tail_refs, smem, barriers = rest
    plgpu = load_plgpu()
    qo_smem2, k_smem, v_smem, lse_smem2, *o_tiles = smem  # o_tiles: `staging.tiles`
    q_barriers, k_loaded, v_loaded, k_consumed, v_consumed, schedule = barriers
    block_q, block_kv, stages = config.block_q, config.block_kv, config.num_stages
    _, q_rows, _, head_dim = q_ref.shape
    kv_rows = k_ref.shape[1]
    dtype = q_ref.dtype
    num_blocks = pl.cdiv(kv_rows, block_kv)
    ragged = has_lengths or packed  # rows and keys past the sequence's counts are padding
    # The last block runs past Tk (Tk not a multiple of block_kv): in full attention
    # over a dense batch a narrower step over its `tail_keys` real keys (no mask, no
    # GEMM past Tk), else masked there.
    ragged_end = not ragged and kv_rows % block_kv != 0
    mask_needed = causal or window is not None or ragged or (ragged_end and not tail_keys)
    spare = staging.spare  # the slots holding O are released once its copy has read it
    wg = lax.axis_index("wg")
    if persistent:
        p = lax.axis_index("blocks")
        if walks:
            count = walks_ref[p, 0]  # this block's tiles

            def item(k):  # this block's k-th tile
                return launch.item(walks_ref[p, 1 + k])

        else:
            count = lax.div(launch.items - 1 - p, persistent) + 1

            def item(k):
                return launch.item(p + k * persistent)

    def work_of(place) -> _Work:
        t, h, b = place
        tile = block_tile(lengths_ref, t, b, packed=packed, rows=config.rows, q_rows=q_rows,
                          kv_rows=kv_rows, last_first=causal)  # fmt: skip
        kv_limit = kv_rows if ragged_end else tile.seq.kv_limit
        ring = key_ring(functools.partial(blocks_of, tile), window=window,
                        sink_tokens=sink_tokens, block_kv=block_kv,
                        kv_first=tile.seq.kv_first)  # fmt: skip
        return _Work(tile, h, h // group, kv_limit, ring)

    def rows_of(tile, consumer):  # first query row of a consumer warpgroup, in its sequence
        return tile.row + consumer * block_q

    def blocks_of(tile, consumer):
        seq = tile.seq
        bounds = key_blocks(rows_of(tile, consumer), block_q, q_len=seq.q_len,
                            offset=seq.offset, kv_len=seq.kv_limit, kv_first=seq.kv_first,
                            causal=causal, window=window, num_blocks=num_blocks,
                            block_kv=block_kv)  # fmt: skip
        if not ragged_end:
            return bounds
        # The last block runs past Tk (masked, or a short step). Bounds that were Python
        # ints stay so (a `kv_len` would make them traced): static trip counts run 2-5%
        # faster (H100, 192-key blocks at Tk 4096 / 16384, B8 Tk 2048; bench/HISTORY.md).
        lo, hi, full_lo, full_hi = bounds
        full_hi = imin(full_hi, kv_rows // block_kv)
        return lo, hi, imin(full_lo, full_hi), full_hi

    def schedule_turn():  # FA3 section 3.2: consumers take turns on the tensor cores
        plgpu.barrier_arrive(schedule)
        plgpu.barrier_wait(schedule)

    @pl.when(wg < CONSUMERS)
    def _consumer():
        plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
        q_smem, lse_smem = qo_smem2.at[wg], lse_smem2.at[wg]
        # O's staging tile (`staging`); in the last block's spare rows it is picked in
        # the epilogue. Staged apart from Q, the next tile's Q (persistent) loads under
        # the last steps and the epilogue of this one; in Q's buffer, after O's copy.
        o_smem = o_tiles[0].at[wg] if staging.tiles else q_smem
        next_q_early = staging.tiles or bool(spare)

        def load_q(w: _Work):
            rows = pl.ds(w.tile.q_base + rows_of(w.tile, wg), block_q)
            plgpu.copy_gmem_to_smem(q_ref.at[w.tile.batch, rows, w.h], q_smem, q_barriers.at[wg])

        def attend(w: _Work, base, *, opening, closing, next_q=None):
            """Tile `w`'s rows of this consumer, its ring steps at `base + step` in the
            slots; `next_q()` loads the next tile's Q once this one's last S GEMM is done.
            `opening` / `closing` (bools, or traced): the block's first / last tile, where
            consumer 1 takes the extra turn that starts the ping-pong and consumer 0 the
            one that ends it."""
            tile, ring, kv_limit, seq = w.tile, w.ring, w.kv_limit, w.tile.seq
            first_row = rows_of(tile, wg)
            bounds = blocks_of(tile, wg)
            my_lo, my_hi, full_lo, full_hi = consumer_steps(ring, bounds)
            plgpu.barrier_wait(q_barriers.at[wg])

            wgmma_layout = plgpu.Layout.WGMMA
            row_layout = wgmma_layout.reduce(1)
            m = plgpu.layout_cast(jnp.full((block_q,), _NO_KEY, jnp.float32), row_layout)
            l = plgpu.layout_cast(jnp.full((block_q,), 0.0, jnp.float32), row_layout)
            acc = plgpu.layout_cast(jnp.zeros((block_q, head_dim), jnp.float32), wgmma_layout)

            def pass_over(step, _):
                """A block this consumer does not need: keep the barriers' phases in step."""
                slot = slot_of(base + step, stages)
                plgpu.barrier_wait(k_loaded.at[slot])
                plgpu.barrier_wait(v_loaded.at[slot])
                plgpu.barrier_arrive(k_consumed.at[slot])
                plgpu.barrier_arrive(v_consumed.at[slot])
                if not persistent:
                    schedule_turn()
                    schedule_turn()
                    return
                # As a step's two turns, the first arrived on at the last tile's end and
                # the tile's last turn handed over early (`hand_over`).
                pl.when(first_turn(step))(lambda: plgpu.barrier_arrive(schedule))
                plgpu.barrier_wait(schedule)
                schedule_turn()
                pl.when(hand_over(step + 1, ring.hi))(lambda: plgpu.barrier_arrive(schedule))

            def first_turn(step):
                """Whether a ring step arrives on its first turn: in the persistent form
                the tile's first step does not (its arrival was the last tile's
                hand-over), but in the block's first tile."""
                return (step != ring.first) | opening

            def hand_over(nxt, last):
                """Whether the step before `nxt` hands the turn over at the end of the
                tile's last step (`last`: the tile's last ring step + 1), so that the
                other consumer's GEMMs run under this one's epilogue (persistent form;
                not in the block's last tile)."""
                return (nxt == last) & (last == ring.hi) & jnp.logical_not(closing)

            def logits(qk, step, masked: bool):
                if soft_cap is None:
                    s = qk * (scale * LOG2E)
                else:
                    s = (soft_cap * LOG2E) * jnp.tanh(qk * (scale / soft_cap))
                if not masked or not mask_needed:
                    return s
                shape = (block_q, block_kv)
                r = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=wgmma_layout)
                j = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=wgmma_layout)
                pos = r + (first_row + seq.offset)
                key = j + ring.block(step) * block_kv
                seen = visible(pos, key, causal=causal, window=window, kv_len=kv_limit,
                               kv_first=seq.kv_first, sink_tokens=sink_tokens)  # fmt: skip
                return jnp.where(seen, s, MASK_VALUE)

            def softmax(qk, step, masked: bool, m, l):
                """Online softmax in base 2 of one S tile: (m, alpha, p, l) after it."""
                if soft_cap is None and scale > 0 and not (masked and mask_needed):
                    c = scale * LOG2E  # max(c * qk) = c * max(qk): one FMA per logit below
                    m_new = jnp.maximum(m, qk.max(axis=1) * c)
                    p = jnp.exp2(qk * c - lax.broadcast_in_dim(m_new, qk.shape, [0]))
                else:
                    s = logits(qk, step, masked)
                    m_new = jnp.maximum(m, s.max(axis=1))
                    p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
                alpha = jnp.exp2(m - m_new)
                return m_new, alpha, p, l * alpha + p.sum(axis=1)

            def release(consumed, slot, keys: int, buf: int):
                """Arrive on a slot's K (`buf` K_SLOT) or V consumed barrier, but for the
                buffer whose spare rows stage this consumer's O (the short step's): the
                epilogue arrives there, after O's copy."""
                holders = [c for c, (b, _) in enumerate(spare) if b == buf]
                if keys == block_kv or not holders:
                    plgpu.barrier_arrive(consumed.at[slot])
                elif len(holders) < CONSUMERS:  # CONSUMERS == 2: one holder, one not
                    pl.when(wg != holders[0])(lambda: plgpu.barrier_arrive(consumed.at[slot]))

            def step_body(step, carry, *, masked: bool, keys: int = block_kv):
                """One key block: S = Q K^T, softmax, O += P V, the GEMMs in turn; over
                the block's first `keys` keys (the short last step: `tail_keys`)."""
                acc, m, l = carry
                slot = slot_of(base + step, stages)
                k_tile, v_tile = k_smem.at[slot], v_smem.at[slot]
                if keys < block_kv:
                    k_tile, v_tile = k_tile.at[pl.ds(0, keys)], v_tile.at[pl.ds(0, keys)]

                def qk_gemm(acc_ref):
                    plgpu.wgmma(acc_ref, q_smem, plgpu.transpose_ref(k_tile, (1, 0)))
                    if persistent:  # a tile's first turn was arrived on at the last one's end
                        pl.when(first_turn(step))(lambda: plgpu.barrier_arrive(schedule))
                        plgpu.barrier_wait(schedule)
                    else:
                        schedule_turn()
                    return acc_ref[...]

                qk = pl.run_scoped(qk_gemm, plgpu.ACC((block_q, keys), jnp.float32))
                release(k_consumed, slot, keys, buf=K_SLOT)
                if next_q is not None:  # Q is read: the next tile's may land (every
                    # consumer of a persistent tile sees a block, full attention or
                    # `causal_walks`' Tq <= Tk: my_hi > my_lo, so this runs)
                    pl.when(step == my_hi - 1)(next_q)
                m_new, alpha, p, l = softmax(qk, step, masked, m, l)
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                p16 = p.astype(dtype)
                acc, l, m_new, p16 = lax.optimization_barrier((acc, l, m_new, p16))
                plgpu.barrier_arrive(schedule)  # softmax done
                plgpu.barrier_wait(v_loaded.at[slot])
                plgpu.barrier_wait(schedule)  # the tensor cores are ours

                def pv_gemm(acc_ref):
                    plgpu.wgmma(acc_ref, p16, v_tile)
                    nxt = step + 1
                    if persistent:  # the tile's last GEMM: hand the turn over for the epilogue
                        pl.when(hand_over(nxt, my_hi))(lambda: plgpu.barrier_arrive(schedule))

                    @pl.when(nxt < my_hi)
                    def _():  # FA3 section 3.3 in small: wait for the next K under this GEMM
                        plgpu.barrier_wait(k_loaded.at[slot_of(base + nxt, stages)])

                acc = pl.run_state(pv_gemm)(plgpu.ACC.init(acc))
                release(v_consumed, slot, keys, buf=V_SLOT)
                return acc, m_new, l

            lax.fori_loop(ring.first, my_lo, pass_over, None)
            pl.when((wg == 1) & opening)(schedule_turn)

            @pl.when(my_lo < my_hi)
            def _():
                plgpu.barrier_wait(k_loaded.at[slot_of(base + my_lo, stages)])

            masked = functools.partial(step_body, masked=True)
            unmasked = functools.partial(step_body, masked=False)
            carry = (acc, m, l)
            carry = lax.fori_loop(my_lo, full_lo, masked, carry)
            carry = lax.fori_loop(full_lo, full_hi, unmasked, carry)
            if tail_keys:  # the last block (my_hi = full_hi + 1): its real keys only
                short = functools.partial(step_body, masked=False, keys=tail_keys)
                carry = lax.fori_loop(full_hi, my_hi, short, carry)
            else:
                carry = lax.fori_loop(full_hi, my_hi, masked, carry)
            acc, m, l = carry
            pl.when((wg == 0) & closing)(schedule_turn)
            lax.fori_loop(my_hi, ring.hi, pass_over, None)

            seen = m > _NO_KEY  # rows that saw a key
            inv = jnp.where(seen, 1.0 / jnp.where(seen, l, 1.0), 0.0)
            out = acc * lax.broadcast_in_dim(inv, acc.shape, [0])
            if ragged:  # padding rows: zeros (their q may be anything, NaN included)
                r = plgpu.broadcasted_iota(jnp.int32, acc.shape, 0, layout=wgmma_layout)
                real = r < seq.q_len - first_row
                out = jnp.where(real, out, 0.0)
                seen = seen & (jnp.where(real, 1.0, 0.0).max(axis=1) > 0)
            if staging.tiles:  # the last tile's stores have read their buffers (the other
                # stagings waited after their copies)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            out = out.astype(dtype)
            lse = jnp.where(seen, m * LN2 + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)

            def store(outs, lses, seq, rows, o_smem=o_smem):
                o_smem[...] = out
                lse_smem[...] = lse
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_smem, outs.at[seq, pl.ds(rows, block_q), w.h])
                plgpu.copy_smem_to_gmem(lse_smem, lses.at[seq, w.h, pl.ds(rows, block_q)])

            if spare:  # O in the last block's spare rows; their slot freed after the copy
                # Full attention (a short step is full attention's): every tile ends on
                # the short step, whose bounds are Python ints.
                assert (my_lo, full_hi, my_hi) == (0, num_blocks - 1, num_blocks)
                last = slot_of(base + my_hi - 1, stages)
                for c, (buf, row) in enumerate(spare):

                    @pl.when(wg == c)
                    def _(buf=buf, row=row):
                        staged = (k_smem, v_smem)[buf].at[last, pl.ds(row, block_q)]
                        store(out_ref, lse_ref, tile.batch, first_row, o_smem=staged)
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                        plgpu.barrier_arrive((k_consumed, v_consumed)[buf].at[last])

            elif not packed:
                store(out_ref, lse_ref, tile.batch, first_row)
            else:  # in place, or (a tile cut by its sequence's start or end) into a tail
                at_array = functools.partial(
                    store, out_ref, lse_ref, tile.batch, tile.q_base + first_row
                )
                at_tail = functools.partial(store, *tail_refs, tile.store, wg * block_q)
                pl.when(tile.store == IN_PLACE)(at_array)
                pl.when(tile.store >= 0)(at_tail)

        if not persistent:
            w = work_of(launch.place())
            load_q(w)
            attend(w, 0, opening=True, closing=True)
        else:
            load_q(work_of(item(0)))

            def tile(k, done):  # done: the ring steps of this block's tiles before k
                def next_q():
                    pl.when(k + 1 < count)(lambda: load_q(work_of(item(k + 1))))

                w = work_of(item(k))
                attend(w, done - w.ring.first, opening=k == 0, closing=k == count - 1,
                       next_q=next_q if next_q_early else None)  # fmt: skip
                if not next_q_early:  # O left through Q's buffer: the next Q once its
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # copy has read it
                    next_q()
                return done + (w.ring.hi - w.ring.first)

            lax.fori_loop(0, count, tile, jnp.int32(0))

        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == CONSUMERS)
    def _producer():
        plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

        def load(w: _Work, base, step, wait):
            """K then V of ring step `step` of tile `w` into slot `base + step`, each copy
            once its own slot is free (`wait`, a bool or traced): the next K can land
            while the consumers still read this V."""
            slot = slot_of(base + step, stages)
            keys = pl.ds(w.tile.k_base + w.ring.block(step) * block_kv, block_kv)
            rows = (w.tile.batch, keys, w.kvh)
            for src, dst, loaded, consumed in ((k_ref, k_smem, k_loaded, k_consumed),
                                               (v_ref, v_smem, v_loaded, v_consumed)):  # fmt: skip
                if wait is True:
                    plgpu.barrier_wait(consumed.at[slot])
                elif wait is not False:
                    pl.when(wait)(functools.partial(plgpu.barrier_wait, consumed.at[slot]))
                plgpu.copy_gmem_to_smem(src.at[rows], dst.at[slot], loaded.at[slot])

        if not persistent:
            w = work_of(launch.place())
            produce(w.ring.first, w.ring.hi, stages, functools.partial(load, w, 0))
        else:  # the block's tiles' rings, one run of ring steps (the consumers' `done`)

            def tile(k, done):
                w = work_of(item(k))
                base = done - w.ring.first

                @pl.loop(w.ring.first, w.ring.hi)
                def _(step):
                    load(w, base, step, base + step >= stages)  # the first `stages`: free

                return done + (w.ring.hi - w.ring.first)

            lax.fori_loop(0, count, tile, jnp.int32(0))


_STATIC = ("causal", "window", "sink_tokens", "soft_cap", "scale", "config")


@functools.partial(jax.jit, static_argnames=_STATIC)
def mosaic_forward(
    q,
    k,
    v,
    q_lengths=None,
    kv_lengths=None,
    *,
    causal: bool = False,
    window: int | None = None,
    sink_tokens: int = 0,
    soft_cap: float | None = None,
    scale: float = 1.0,
    config: MosaicForwardConfig | None = None,
):
    """Flash attention of a dense batch on Hopper.

    Args:
      q: `[B, Tq, Hq, D]` bfloat16 or float16; k, v: `[B, Tk, Hkv, D]`, same dtype,
        `Hq % Hkv == 0`. D in (64, 128, 256); Tq a multiple of `config.rows`, Tk of 64
        (not necessarily of `config.block_kv`: the last block runs as a narrower step
        in full attention, masked otherwise); `pallas_kernels.mosaic.support` checks
        all of this first.
      q_lengths, kv_lengths: int `[B]` or None (all rows), as `jaxattn.attention`'s:
        sequence b's real queries are its first `q_lengths[b]` rows, its keys the first
        `kv_lengths[b]`, and its query row r sits at position `r + kv_lengths[b] -
        q_lengths[b]`. Padding may hold anything: one XLA pass zeroes v's padding rows
        (the P V GEMM multiplies them by zero weights, and 0 * NaN is NaN); the kernel
        masks the keys and zeroes the padding rows' output.
      causal, window, sink_tokens, soft_cap, scale: as `jaxattn.attention` (queries
        bottom-right aligned; sinks, the first `sink_tokens` keys, count with a window).
      config: tiling; None picks `MosaicForwardConfig.heuristic` (by D, Tk, and whether
        the call is full attention).

    Returns:
      out `[B, Tq, Hq, D]` in q's dtype and the natural log-sum-exp float32 `[B, Hq, Tq]`
      (-inf for rows that see no key and for padding rows, whose output is zeros).
    """
    batch, q_rows, _, head_dim = q.shape
    kv_rows = k.shape[1]
    full = full_attention(causal, window)
    config = config or MosaicForwardConfig.heuristic(head_dim, kv_rows=kv_rows, full=full)
    if not q_rows or not kv_rows or q_rows % config.rows or kv_rows % KEY_ROWS:
        raise ValueError(
            f"mosaic_forward: {q.shape=}, {k.shape=}: Tq must be a positive multiple of "
            f"{config.rows} and Tk of {KEY_ROWS} ({config})"
        )
    lengths = sequence_lengths(q_lengths, kv_lengths, batch, q_rows, kv_rows)
    if lengths is not None:
        v = zero_padding(v, lengths[1])
    num_tiles = q_rows // config.rows
    options = kernel_options(causal, window, sink_tokens, soft_cap, scale)
    return _launch(q, k, v, lengths, grid=(num_tiles, batch), config=config, **options)


@functools.partial(jax.jit, static_argnames=_STATIC)
def mosaic_forward_packed(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    *,
    causal: bool = False,
    window: int | None = None,
    sink_tokens: int = 0,
    soft_cap: float | None = None,
    scale: float = 1.0,
    config: MosaicForwardConfig | None = None,
):
    """Flash attention of a packed batch on Hopper (`jaxattn.ragged_attention`'s layout).

    Args:
      q: `[Tq, Hq, D]`, sequence b owning rows `cu_seqlens_q[b] : cu_seqlens_q[b + 1]`;
        rows past `cu_seqlens_q[-1]` are padding (zeros out). k, v: `[Tk, Hkv, D]` by
        `cu_seqlens_k` likewise. Tq, Tk multiples of 8 (TMA moves 8-row tiles); dtypes
        and D as `mosaic_forward`'s.
      cu_seqlens_q, cu_seqlens_k: int `[B + 1]`, non-decreasing from 0. Query row i of
        sequence b sits at position `i + kv_len[b] - q_len[b]` (bottom-right aligned).
        Padding rows may hold anything (one XLA pass zeroes v's past `cu_seqlens_k[-1]`).
      causal, window, sink_tokens, soft_cap, scale, config: as `mosaic_forward`'s (the
        sinks: each sequence's first keys).

    Returns:
      out `[Tq, Hq, D]` in q's dtype, lse float32 `[Hq, Tq]` (as `mosaic_forward`'s).

    A block per tile of `config.rows` rows of one sequence (`packed.tile_table`, heaviest
    first), from the sequence's start rounded down to 8 rows; a tile cut by its
    sequence's start or end is written to a tail array and its own rows scattered into
    place after the kernel (`packed.merge_tails`).
    """
    q_rows, _, head_dim = q.shape
    kv_rows = k.shape[0]
    config = config or MosaicForwardConfig.heuristic(head_dim)
    check_rows("mosaic_forward_packed", q.shape, k.shape)
    batch = packed_batch(cu_seqlens_q, cu_seqlens_k, q_rows, kv_rows)
    options = kernel_options(causal, window, sink_tokens, soft_cap, scale)
    table = tile_table(batch, config.rows, q_rows, **tile_order(options))
    v = zero_padding(v[None], batch.k_start[-1:])
    num_slots = 2 * batch.q_len.shape[0]  # tail slots: two per sequence (`packed.py`)
    out, lse, out_tail, lse_tail = _launch(
        q[None], k[None], v, table, grid=(table.shape[0], 1), config=config,
        num_tails=num_slots, **options,
    )  # fmt: skip
    where = tail_rows(batch.q_start, batch.q_rows, config.rows, q_rows)
    out = merge_tails(out[0], out_tail, where)
    return out, merge_tails(lse[0], lse_tail, where, axis=1)


def _launch(q, k, v, lengths, *, grid, config, num_tails=None, **options):
    """The kernel over `grid = (query tiles, batch)` of every query head: lengths is the
    `[2, B]` lengths or None (dense), or the packed tile table (`num_tails` tail slots)."""
    plgpu = load_plgpu()
    batch, q_rows, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    dtype = q.dtype
    packed = num_tails is not None
    inputs = (q, k, v) if lengths is None else (q, k, v, lengths)
    tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    stages = config.num_stages
    smem = (
        plgpu.SMEM((CONSUMERS, config.block_q, head_dim), dtype, transforms=tiled),
        plgpu.SMEM((stages, config.block_kv, head_dim), dtype, transforms=tiled),
        plgpu.SMEM((stages, config.block_kv, head_dim), dtype, transforms=tiled),
        plgpu.SMEM((CONSUMERS, config.block_q), jnp.float32),
    )
    barriers = (
        plgpu.Barrier(num_barriers=CONSUMERS),  # Q tiles loaded
        plgpu.Barrier(num_barriers=stages),  # K slot loaded
        plgpu.Barrier(num_barriers=stages),  # V slot loaded
        plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),  # K slot consumed
        plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),  # V slot consumed
        plgpu.Barrier(num_arrivals=CONSUMERS),  # the consumers' turns
    )
    group = num_q_heads // num_kv_heads
    launch = Launch(heads=num_q_heads, tiles=grid[0], batch=grid[1], group=group)
    ragged = lengths is not None  # lengths, or a packed batch's tile table
    alike = full_attention(options["causal"], options["window"], ragged)
    walkable = alike or causal_walks(options["causal"], options["window"], ragged, q_rows,
                                     k.shape[1])  # fmt: skip
    blocks = persistent_blocks(config, launch, walkable)
    walks = bool(blocks) and not alike  # causal: each block's tiles from a table
    if walks:
        cost = functools.partial(causal_tile_cost, config=config, q_rows=q_rows,
                                 kv_rows=k.shape[1])  # fmt: skip
        inputs += (jnp.asarray(launch.walk(blocks, cost)),)
    tail_keys = short_tail_keys(k.shape[1], config.block_kv, causal=options["causal"],
                                window=options["window"], ragged=ragged)  # fmt: skip
    staging = o_staging(config, head_dim, jnp.dtype(dtype).itemsize, persistent=bool(blocks),
                        tail_keys=tail_keys)  # fmt: skip
    if staging.tiles:  # O's own staging tiles
        smem += (plgpu.SMEM((CONSUMERS, config.block_q, head_dim), dtype, transforms=tiled),)
    kernel = functools.partial(
        _kernel,
        has_lengths=lengths is not None and not packed,
        packed=packed,
        group=group,
        launch=launch,
        persistent=blocks,
        walks=walks,
        tail_keys=tail_keys,
        staging=staging,
        config=config,
        **options,
    )
    out_type = [
        jax.ShapeDtypeStruct(q.shape, dtype),
        jax.ShapeDtypeStruct((batch, num_q_heads, q_rows), jnp.float32),
    ]
    if packed:  # the tiles cut by their sequence's start or end (`packed.py`)
        out_type += [
            jax.ShapeDtypeStruct((num_tails, config.rows, num_q_heads, head_dim), dtype),
            jax.ShapeDtypeStruct((num_tails, num_q_heads, config.rows), jnp.float32),
        ]
    outs = plgpu.kernel(
        kernel,
        out_type=tuple(out_type),
        scratch_types=(smem, barriers),
        **(dict(grid=(blocks,), grid_names=("blocks",)) if blocks else launch.grid()),
        num_threads=CONSUMERS + 1,
        thread_name="wg",
        # No cross-warp reductions (a row's sums stay in its warp): no scratch for them,
        # which leaves room for 192-key blocks.
        compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0),
    )(*inputs)
    return varying_like(outs, inputs)


def causal_walks(causal: bool, window, ragged: bool, q_rows: int, kv_rows: int) -> bool:
    """Whether a causal call's tiles can be walked by persistent blocks (`Launch.walk`):
    over a dense batch without a window, each tile's keys are known when the kernel is
    built, and with Tq <= Tk every row sees a key (a consumer's tile ends on a step of
    its own, where it loads its next Q)."""
    return causal and window is None and not ragged and q_rows <= kv_rows


TILE_COST_STEPS = 2  # a tile's fixed cost in ring steps, for `Launch.walk` (about 4.5 us
# a tile against 1.8 us a 128-key step, H100 sweeps of 2026-11-26, bench/HISTORY.md)


def causal_tile_cost(t: int, *, config: MosaicForwardConfig, q_rows: int, kv_rows: int) -> int:
    """Dense causal tile `t`'s ring steps (tiles numbered heaviest first, as
    `block_tile`'s), plus TILE_COST_STEPS: `Launch.walk`'s cost of it."""
    row = (q_rows // config.rows - 1 - t) * config.rows
    num_blocks = pl.cdiv(kv_rows, config.block_kv)
    _, hi, _, _ = key_blocks(row, config.rows, q_len=q_rows, offset=kv_rows - q_rows,
                             kv_len=None, causal=True, window=None, num_blocks=num_blocks,
                             block_kv=config.block_kv)  # fmt: skip
    return hi + TILE_COST_STEPS


def persistent_blocks(config: MosaicForwardConfig, launch: Launch, walkable: bool, sms=None) -> int:
    """The blocks of a persistent launch (`MosaicForwardConfig.persistent`), one per SM
    (`sms`; None: the default device's count); 0, a block per tile, when the config does
    not ask, the tiles cannot be walked (`walkable` False: neither all alike nor
    `causal_walks`), they fit in one wave, or the SM count is unknown."""
    if not (config.persistent and walkable):
        return 0
    sms = device_sm_count(0) if sms is None else sms
    return sms if 0 < sms < launch.items else 0


__all__ = ["block_range", "key_blocks", "mosaic_forward", "mosaic_forward_packed"]
