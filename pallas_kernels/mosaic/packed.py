"""Packed (`cu_seqlens`) batches on the Hopper kernels: which tile a block computes, and
where its rows go.

A packed batch is laid out as `[T, H, D]` rows, sequence b owning rows `q_start[b] :
q_start[b] + q_rows[b]` (`pallas_kernels.batch.packed_batch`, whose last pseudo-sequence
owns the trailing padding). A block takes one row of the tile table (`tile_table`: the
Triton kernels' `packed_tile_table`, heaviest tiles first, plus three columns) and loads
its rows by TMA, rows past the arrays reading as zeros.

TMA moves the swizzled tiles the wgmma reads in whole 8-row units, so a tile must start
at a multiple of 8 rows (jax 0.11's Mosaic GPU refuses offsets it cannot prove so): each
sequence's rows and keys are taken from its start rounded down to 8, the up to 7 rows and
keys before it (the sequence before's) being padding: keys masked as q/kv lengths' padding
is; query rows zeroed in the forward and the dQ kernel, and masked by position in the dK/dV
kernel (`common.visible`'s `pos_range`), where their finite lse would otherwise count.

Stores are the catch: a TMA store writes whole tiles, and a sequence's first tile (from
an unaligned start) and last tile (cut by its end) run into rows another block writes.
Such a tile writes into a small `tail` array instead (two slots per sequence), and
`merge_tails` scatters its own rows into place after the kernel (an XLA scatter of at
most two tiles per sequence). The padding's last tile runs only past the arrays' end,
where TMA drops the rows.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_kernels.batch import Batch
from pallas_kernels.mosaic.common import Sequence, Tile, dense_tile
from pallas_kernels.tiles import (
    _K_ROWS,
    _K_START,
    _KV_LEN,
    _NUM_COLS,
    _NUM_REAL,
    _Q_LEN,
    _Q_ROWS,
    _Q_START,
    _ROW,
    _SEQ,
    packed_grid,
    packed_tile_table,
)

ROW_ALIGN = 8  # a tile's first row: a multiple of this (TMA moves whole 8-row tiles)
LEAD_Q, LEAD_K, STORE = _NUM_COLS, _NUM_COLS + 1, _NUM_COLS + 2  # `tile_table` appends
IN_PLACE, NOWHERE = -1, -2  # STORE's values besides a tail slot (>= 0)


@dataclasses.dataclass(frozen=True)
class _Order:  # what `packed_tile_table` reads of a call's options to sort its tiles
    causal: bool
    window: int | None
    sink_tokens: int = 0


def _aligned(starts, rows):
    """(first row rounded down to ROW_ALIGN, rows before the start, rows from there)."""
    lead = starts % ROW_ALIGN
    return starts - lead, lead, jnp.where(rows > 0, rows + lead, 0)


def _cut(row, lead, grown, not_padding, block: int):
    """(head, end): whether the tile at `row` of a sequence read from `lead` rows before
    its start (`grown` rows from there) is cut by its start (a head: slot 2s) or else by
    its end (an end: slot 2s + 1; never the padding's, whose end is the arrays')."""
    head = (row == 0) & (lead > 0)
    return head, not_padding & (row + block > grown) & ~head


def rows_unsupported(q_shape, k_shape) -> str | None:
    """None if a packed batch's arrays hold positive whole ROW_ALIGN-row tiles (TMA moves
    rows in such tiles), else why not."""
    q_rows, kv_rows = q_shape[0], k_shape[0]
    if not q_rows or not kv_rows or q_rows % ROW_ALIGN or kv_rows % ROW_ALIGN:
        return f"packed Tq={q_rows}, Tk={kv_rows}: positive multiples of {ROW_ALIGN}"
    return None


def check_rows(caller: str, q_shape, k_shape) -> None:
    """Raises a clear ValueError where `rows_unsupported` gives a reason (Mosaic GPU's own
    error for such arrays is obscure)."""
    why = rows_unsupported(q_shape, k_shape)
    if why is not None:
        raise ValueError(f"{caller}: q {tuple(q_shape)}, k {tuple(k_shape)}: {why}")


def tile_table(batch, block: int, num_rows: int, *, causal, window, sink_tokens: int = 0,
               axis: str = "q"):  # fmt: skip
    """int32 `[tiles, _NUM_COLS + 3]`: `packed_tile_table`'s rows for `block`-row tiles
    of query rows (`axis="q"`) or keys (`"kv"`) over `num_rows` rows, each sequence's rows
    and keys taken from ROW_ALIGN-aligned starts (the rows and keys before its start are
    padding: its query and key lengths count them, `LEAD_Q` / `LEAD_K` say how many),
    `_Q_START`, `_K_START` and `_ROW` in units of ROW_ALIGN rows (so the kernels' TMA
    offsets are provably aligned), and `STORE`: a tail slot for a tile cut by its
    sequence's start (slot 2s) or end (2s + 1; real sequences only), IN_PLACE for the
    others, NOWHERE for spare tiles (whose lengths are zeroed: they compute nothing).

    batch: a packed `Batch` (`pallas_kernels.batch.packed_batch`, its last sequence the
    padding); causal, window, sink_tokens: the call's (the tiles' work, for the
    heaviest-first order).
    """
    k_rows = batch.kv_len if batch.k_rows is None else batch.k_rows
    q_base, lead_q, q_rows = _aligned(batch.q_start, batch.q_rows)
    k_base, lead_k, k_rows = _aligned(batch.k_start, k_rows)
    aligned = Batch(q_len=batch.q_len + lead_q, kv_len=batch.kv_len + lead_k, q_start=q_base,
                    q_rows=q_rows, k_start=k_base, k_rows=k_rows, dense=False)  # fmt: skip
    num_seqs = batch.q_len.shape[0]
    # Each sequence may grow by ROW_ALIGN - 1 leading rows: a bound on the tiles of all.
    num_tiles, _ = packed_grid(num_rows + (ROW_ALIGN - 1) * num_seqs, num_seqs, block)
    order = _Order(causal, window, sink_tokens)
    table = packed_tile_table(aligned, block, num_tiles, order, axis)
    seq, row = table[:, _SEQ], table[:, _ROW]
    real = jnp.arange(num_tiles, dtype=jnp.int32) < table[:, _NUM_REAL]
    lead, rows = (lead_q, _Q_ROWS) if axis == "q" else (lead_k, _K_ROWS)
    head, end = _cut(row, lead[seq], table[:, rows], seq < num_seqs - 1, block)
    store = jnp.where(head, 2 * seq, jnp.where(end, 2 * seq + 1, IN_PLACE))
    store = jnp.where(real, store, NOWHERE)
    table = table.at[:, _Q_LEN].set(jnp.where(real, table[:, _Q_LEN], 0))
    table = table.at[:, _KV_LEN].set(jnp.where(real, table[:, _KV_LEN], 0))
    for col in (_Q_START, _K_START, _ROW):  # multiples of ROW_ALIGN, in its units
        table = table.at[:, col].set(table[:, col] // ROW_ALIGN)
    leads = [jnp.where(real, x[seq], 0) for x in (lead_q, lead_k)]
    extra = jnp.stack([*leads, store], axis=1).astype(jnp.int32)
    return jnp.concatenate([table, extra], axis=1)


def tile_order(options: dict) -> dict:
    """The kernel options `tile_table` orders tiles by (of `common.kernel_options`')."""
    return {name: options[name] for name in ("causal", "window", "sink_tokens")}


def block_tile(lengths_ref, t, b, *, packed: bool, rows: int, q_rows: int, kv_rows: int,
               last_first: bool = False) -> Tile:  # fmt: skip
    """Tile `t` of sequence `b` (`Launch.place`): a packed batch's from its table
    (`lengths_ref`, heaviest first), a dense one's `rows` rows from `t * rows`, with the
    lengths (or None) from `lengths_ref`; `last_first`: dense tiles numbered from the
    last (causal query tiles: the last see the most keys)."""
    if packed:
        return _packed_tile(lengths_ref, t)
    t = q_rows // rows - 1 - t if last_first else t
    return dense_tile(lengths_ref, b, t * rows, q_rows, kv_rows)


def _packed_tile(table_ref, t) -> Tile:
    """Tile `t` of a packed batch, read from the kernel's copy of `tile_table` (GMEM):
    rows and keys from the sequence's aligned starts, the ones before its start padding."""
    q_len, kv_len = table_ref[t, _Q_LEN], table_ref[t, _KV_LEN]
    return Tile(
        batch=0,
        row=table_ref[t, _ROW] * ROW_ALIGN,
        q_base=table_ref[t, _Q_START] * ROW_ALIGN,
        k_base=table_ref[t, _K_START] * ROW_ALIGN,
        seq=Sequence(
            q_len,
            kv_len,
            kv_len - q_len,
            kv_len,
            kv_first=table_ref[t, LEAD_K],
            q_first=table_ref[t, LEAD_Q],
        ),  # fmt: skip
        store=table_ref[t, STORE],
    )


def tail_rows(starts, rows, block: int, num_rows: int):
    """int32 `[2 * S, block]`: where row i of tail slot 2s (sequence s's first tile, when
    its start is not aligned) and slot 2s + 1 (its last tile, when cut by its end and not
    also its first; never for the last sequence, the padding) go in the arrays, or
    `num_rows` (out of bounds: dropped) for rows outside the sequence and for slots no
    tile wrote. starts, rows: every sequence's `[S]` first row and row count."""
    base, lead, grown = _aligned(starts, rows)
    tiles = (grown + block - 1) // block
    i = jnp.arange(block, dtype=jnp.int32)[None, :]
    inside = lambda at: (at >= starts[:, None]) & (at < (starts + rows)[:, None])  # noqa: E731
    last = jnp.maximum(tiles - 1, 0) * block  # the last tile's first row
    not_padding = jnp.arange(starts.shape[0]) < starts.shape[0] - 1
    head, _ = _cut(0, lead, grown, not_padding, block)  # the first tile's (tile_table's rule)
    _, end = _cut(last, lead, grown, not_padding, block)  # the last tile's
    head, end = head & (tiles > 0), end & (tiles > 0)
    head_at, end_at = base[:, None] + i, (base + last)[:, None] + i
    slots = [jnp.where(ok[:, None] & inside(at), at, num_rows)
             for ok, at in ((head, head_at), (end, end_at))]  # fmt: skip
    return jnp.stack(slots, axis=1).reshape(-1, block)


def merge_tails(x, tail, where, axis: int = 0):
    """x with the tails' rows scattered in along `axis` (the token axis of `[T, H, D]`, or
    1 of an lse `[H, T]`): tail `[2S, block, ...]` (or `[2S, H, block]` for `axis=1`),
    where: `tail_rows`' `[2S, block]`."""
    index = where.reshape(-1)
    if axis == 0:
        return x.at[index].set(tail.reshape(-1, *x.shape[1:]), mode="drop")
    rows = jnp.moveaxis(tail, 1, 0).reshape(x.shape[0], -1)  # [H, S * block]
    return x.at[:, index].set(rows, mode="drop")


__all__ = [
    "IN_PLACE",
    "LEAD_K",
    "LEAD_Q",
    "NOWHERE",
    "ROW_ALIGN",
    "STORE",
    "merge_tails",
    "block_tile",
    "tile_order",
    "tail_rows",
    "tile_table",
]
