"""Which tiles a flash kernel launches, and which blocks of the other axis each one visits.

The forward and dQ kernels tile the query rows and walk key blocks; the dK/dV kernel tiles
the keys and walks query blocks. Both need, for one tile, the range of blocks some of its
rows or keys can see (`[lo, hi)`) and the sub-range that every one sees in full
(`[full_lo, full_hi)`, run without the mask arithmetic): `key_block_range` and
`query_block_range`. Positions are bottom-right aligned (DESIGN.md): query row i of a
sequence sits at `kv_len - q_len + i`, key j at j.

A packed batch's tiles come from `packed_tile_table`: a static bound on their count, one
table row per tile, heaviest first, spare tiles last (the kernels stop at `_NUM_REAL`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

# Columns of the packed tile table: one row of int32 per tile. _ROW: the tile's first row
# of the tiled axis (query rows, or keys) within its sequence; _K_COL: the bias/mask column
# of the sequence's key 0 in packed coordinates; _NUM_REAL (the same in every row): how many
# tiles have rows, the first ones after the sort.
(_Q_START, _Q_ROWS, _Q_LEN, _K_START, _K_ROWS, _KV_LEN, _ROW, _SEQ, _K_COL, _NUM_REAL,
 _NUM_COLS) = range(11)  # fmt: skip
# Programs beyond one per block of tokens, for packed batches: tiles cut by sequence ends.
SPARE_PROGRAMS = 8


def packed_tile_table(batch, block: int, num_tiles: int, params, axis: str = "q"):
    """int32 `[num_tiles, _NUM_COLS]`: tile t covers rows `_ROW : _ROW + block` of a
    sequence's query rows (`axis="q"`) or keys (`axis="kv"`).

    `batch`: a packed `pallas_kernels.batch.Batch` (`k_rows` None: a sequence's key rows
    are its `kv_len` keys). Tiles are sorted by their work (keys a query tile visits, query rows a
    key tile serves), largest first, so the long causal tiles do not form the tail. Spare
    tiles come last, with a row past their sequence's end. Built from a few fused
    elementwise ops and one sort: this runs on every call, next to a kernel of a
    millisecond or less.
    """
    k_rows = batch.kv_len if batch.k_rows is None else batch.k_rows
    rows = batch.q_rows if axis == "q" else k_rows
    n = (rows + block - 1) // block  # [S] tiles per sequence
    ends = jnp.cumsum(n)
    t = jnp.arange(num_tiles, dtype=jnp.int32)
    seq = jnp.sum(t[:, None] >= ends[None, :], axis=1, dtype=jnp.int32)  # [num_tiles]
    seq = jnp.minimum(seq, n.shape[0] - 1)
    row = (t - (ends - n)[seq]) * block
    kv_len, q_len = batch.kv_len[seq], batch.q_len[seq]
    if axis == "q":
        cost = kv_len
        if params.causal:
            cost = jnp.minimum(cost, kv_len - q_len + jnp.minimum(row + block, q_len))
        if params.window is not None:
            cost = jnp.minimum(cost, params.window + block + params.sink_tokens)
    else:
        cost = q_len
        if params.causal:
            cost = q_len - jnp.clip(row - (kv_len - q_len), 0, q_len)
        if params.window is not None:  # a tile holding sinks serves every later row
            windowed = jnp.minimum(cost, params.window + block)
            cost = jnp.where(row < params.sink_tokens, cost, windowed)
    cost = jnp.where(row < rows[seq], jnp.maximum(cost, 1), 0)
    columns = [batch.q_start, batch.q_rows, batch.q_len, batch.k_start, k_rows, batch.kv_len]
    k_cols = batch.k_start if batch.k_cols is None else batch.k_cols
    columns = [c[seq] for c in columns] + [row, seq, k_cols[seq]]
    columns = jax.lax.sort([-cost, *(c.astype(jnp.int32) for c in columns)], num_keys=1)[1:]
    num_real = jnp.full((num_tiles,), jnp.sum(cost > 0, dtype=jnp.int32))
    return jnp.stack([*columns, num_real], axis=1)


def packed_grid(num_rows: int, num_seqs: int, block: int) -> tuple[int, int]:
    """(tiles, programs) of a packed axis of `num_rows` rows over `num_seqs` sequences:
    a tile per `block` rows plus one per sequence for its ragged end; programs loop over
    tiles `first + i * programs` when fewer than the tiles (a step of many one-token rows
    has far fewer tiles than sequences)."""
    num_tiles = (num_rows + num_seqs * (block - 1)) // block
    return num_tiles, min(num_tiles, pl.cdiv(num_rows, block) + SPARE_PROGRAMS)


def _block_span(lo, full_lo, full_hi, hi, block: int):
    """Positions to blocks: `[lo_b, hi_b)` covers `[lo, hi)`; `[full_lo_b, full_hi_b)`
    (inside it) holds only blocks wholly within `[full_lo, full_hi)`."""
    hi_b = pl.cdiv(hi, block)
    lo_b = jnp.minimum(lo // block, hi_b)
    full_lo_b = jnp.clip(pl.cdiv(full_lo, block), lo_b, hi_b)
    full_hi_b = jnp.clip(full_hi // block, full_lo_b, hi_b)
    return lo_b, full_lo_b, full_hi_b, hi_b


def key_block_range(params, q_len, kv_len, r0, block_q: int, block_kv: int):
    """Key blocks `(lo_b, full_lo_b, full_hi_b, hi_b)` of the query tile of rows
    `r0 : r0 + block_q`: `[lo_b, hi_b)` holds every key some valid row sees (sinks of a
    window aside: they come first, see the kernels), `[full_lo_b, full_hi_b)` the blocks
    every valid row sees in full. Static ints for full attention without lengths."""
    if isinstance(kv_len, int) and not params.causal and params.window is None:
        return 0, 0, kv_len // block_kv, pl.cdiv(kv_len, block_kv)
    n_valid = jnp.clip(q_len - r0, 0, block_q)
    p_first = kv_len - q_len + r0
    p_last = p_first + n_valid - 1
    hi = jnp.minimum(kv_len, p_last + 1) if params.causal else kv_len
    # hi = 0 for a tile with no real row. (Integer arithmetic: Triton's lowering of a
    # select between constants trips over an i1/i32 mix in jax 0.10-0.11.)
    hi = jnp.maximum(hi, 0) * jnp.minimum(n_valid, 1)
    full_hi = jnp.minimum(kv_len, p_first + 1) if params.causal else kv_len
    lo, full_lo = 0, 0
    if params.window is not None:
        lo = jnp.maximum(p_first - params.window + 1, 0)
        full_lo = jnp.maximum(p_last - params.window + 1, 0)
    return _block_span(lo, full_lo, full_hi, hi, block_kv)


def query_block_range(params, q_len, kv_len, c0, block_q: int, block_kv: int):
    """Query blocks `(lo_b, full_lo_b, full_hi_b, hi_b)` of the key tile `c0 : c0 +
    block_kv`: `[lo_b, hi_b)` holds every valid row that sees some key of the tile,
    `[full_lo_b, full_hi_b)` blocks whose rows see all of its keys (a tile cut by `kv_len`
    has none). A tile holding a sink of a window is seen by every later row: all masked."""
    offset = kv_len - q_len  # row i sits at position offset + i
    n_keys = jnp.clip(kv_len - c0, 0, block_kv)
    c_last = c0 + n_keys - 1
    lo, full_lo = 0, 0
    hi = full_hi = q_len
    if params.causal:  # row i sees key j iff offset + i >= j
        lo = jnp.maximum(c0 - offset, 0)
        full_lo = jnp.maximum(c_last - offset, 0)
    if params.window is not None:  # ... and offset + i < j + window
        hi = jnp.clip(c_last + params.window - offset, 0, q_len)
        full_hi = jnp.clip(c0 + params.window - offset, 0, q_len)
        if params.sink_tokens:
            sink = (c0 < params.sink_tokens).astype(jnp.int32)
            hi = sink * q_len + (1 - sink) * hi
            full_hi = (1 - sink) * full_hi
    hi = jnp.maximum(hi, 0) * jnp.minimum(n_keys, 1)  # no valid key: no work
    full_hi = full_hi * (n_keys // block_kv)  # a tile cut by kv_len is masked everywhere
    return _block_span(lo, full_lo, full_hi, hi, block_q)
