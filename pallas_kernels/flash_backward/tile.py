"""What the two backward kernels share: where a tile is, the rows of the query side of a
block (q, dO, lse, delta), and the gradient of one `[block_q, block_kv]` block of logits.

FlashAttention-2's backward (Dao 2023, algorithm 2), in base 2 as the forward: with the
forward's natural log-sum-exp saved per row, `P = exp2(s2 - lse * log2(e))` recomputes the
probabilities exactly as the forward normalised them, `dP = dO V^T`, and
`dS = P * (dP - delta)` with `delta = rowsum(dO * O) - d_lse` (the lse's own cotangent
enters here: d lse / d s = P). A soft-cap multiplies by its derivative, `1 - tanh^2`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import LOG2E
from pallas_kernels.tiles import (
    _K_ROWS,
    _K_START,
    _KV_LEN,
    _Q_LEN,
    _Q_ROWS,
    _Q_START,
    _ROW,
    _SEQ,
)


@dataclasses.dataclass(frozen=True)
class Tile:
    """One program's tile: sequence `seq`, whose query rows start at packed row `q_start`
    (`q_rows` of them, the first `q_len` real) and keys at `k_start` (`k_rows`, the first
    `kv_len` real); the tile's first row of its own axis is `row`."""

    seq: Any
    q_start: Any
    q_rows: Any
    q_len: Any
    k_start: Any
    k_rows: Any
    kv_len: Any
    row: Any


def tile_at(index_ref, tile, dense_shape, block: int, first_blocks_first: bool) -> Tile:
    """The tile `tile` of a dense batch (`dense_shape = (B, Tq, Tk)`; `index_ref` int32
    `[2, B]` of q and kv lengths, or None when all are full) or a packed one (`index_ref`
    the tile table). Dense tiles go through every sequence in turn, by block: the first
    blocks first (dK/dV: a causal row's first keys serve the most queries) or the last."""
    if dense_shape is None:
        col = lambda c: index_ref[tile, c]  # noqa: E731
        return Tile(col(_SEQ), col(_Q_START), col(_Q_ROWS), col(_Q_LEN), col(_K_START),
                    col(_K_ROWS), col(_KV_LEN), col(_ROW))  # fmt: skip
    num_seqs, q_rows, k_rows = dense_shape
    seq = tile % num_seqs
    tiled_rows = k_rows if first_blocks_first else q_rows
    block_index = tile // num_seqs
    if not first_blocks_first:
        block_index = pl.cdiv(tiled_rows, block) - 1 - block_index
    q_len, kv_len = q_rows, k_rows  # Python ints when every sequence is full
    if index_ref is not None:
        q_len, kv_len = index_ref[0, seq], index_ref[1, seq]
    return Tile(seq, seq * q_rows, q_rows, q_len, seq * k_rows, k_rows, kv_len,
                block_index * block)  # fmt: skip


def load_keys(k_ref, v_ref, tile: Tile, kvh, k0, block_kv: int, dims, dim_ok, masked=True):
    """K and V `[block_kv, Dp]` of keys `k0..` of kv head `kvh`. With `masked`, keys past
    `kv_len` (padding, or the next sequence's rows) read zeros: their probabilities are 0,
    but `dP = dO V^T` of a garbage V could overflow, and 0 * inf is NaN. Unmasked blocks
    lie wholly below kv_len."""
    at = (pl.ds(tile.k_start + k0, block_kv), kvh, dims)
    if masked:
        ok = ((k0 + jnp.arange(block_kv)) < tile.kv_len)[:, None] & dim_ok
    elif dim_ok.shape[-1] != k_ref.shape[-1]:  # a head dim padded to a power of two
        ok = jnp.broadcast_to(dim_ok, (block_kv, dim_ok.shape[-1]))
    else:
        ok = None
    other = None if ok is None else 0.0
    return plgpu.load(k_ref.at[at], mask=ok, other=other), plgpu.load(
        v_ref.at[at], mask=ok, other=other
    )


@dataclasses.dataclass(frozen=True)
class QuerySide:
    """The query-side refs: q and dO `[Tq_all, Hq, D]`; lse2 (base-2 lse, +inf for rows
    with no visible key) and delta, float32 `[Hq, Tq_all]`."""

    q: Any
    do: Any
    lse2: Any
    delta: Any

    def load(self, h, tile: Tile, r0, block_q: int, dims, dim_ok):
        """q, dO `[block_q, Dp]` and lse2, delta `[block_q]` of rows `r0..` of head `h`.
        Rows past `q_len` (padding, or the next sequence's) read zeros and lse2 = +inf:
        their probabilities are 0 and they add nothing, whatever the padding holds (a
        huge q would overflow the logits to inf, and inf - inf is NaN)."""
        rows = r0 + jnp.arange(block_q)
        real = rows < tile.q_len
        at = (pl.ds(tile.q_start + r0, block_q), h, dims)
        q = plgpu.load(self.q.at[at], mask=real[:, None] & dim_ok, other=0.0)
        do = plgpu.load(self.do.at[at], mask=real[:, None] & dim_ok, other=0.0)
        cols = pl.ds(tile.q_start + r0, block_q)
        lse2 = plgpu.load(self.lse2.at[h, cols], mask=real, other=float("inf"))
        delta = plgpu.load(self.delta.at[h, cols], mask=real, other=0.0)
        return q, do, lse2, delta


def logit_grads(s, v, do, lse2, delta, soft_cap, precision):
    """`(p, dz)` of one block: s `[block_q, block_kv]` base-2 logits as the forward's
    `TileLogits` gives them, V `[block_kv, Dp]`, dO `[block_q, Dp]`, lse2 and delta
    `[block_q]`. p: the probabilities; dz: the loss's gradient w.r.t. the natural-unit
    logits before the soft-cap (scale * q.k + bias + ALiBi + T5), float32."""
    p = jnp.exp2(s - lse2[:, None])
    dp = jnp.dot(do, v.T, precision=precision, preferred_element_type=jnp.float32)
    dz = p * (dp - delta[:, None])
    if soft_cap is not None:  # s = soft_cap * log2(e) * tanh(z / soft_cap)
        t = jnp.clip(s * (1.0 / (soft_cap * LOG2E)), -1.0, 1.0)  # masked keys: +-1, p = 0
        dz = dz * (1.0 - t * t)
    return p, dz
