"""RoPE applied on read (StreamingLLM, Xiao et al. 2023, arXiv:2309.17453, section 3.2):
the cache holds un-rotated keys and the kernels rotate queries and keys at their positions
*within the cache* as they load them; no rotated copy of the cache ever exists in HBM.

A query at position p with window W and S sink tokens sees keys `j < S` and
`p - W < j <= p`. With `o(p) = max(0, p - W + 1 - S)` tokens evicted between the sinks and
the window, the query sits at `p - o(p)` in the cache, key j at `j` (a sink) or `j - o(p)`.
RoPE depends on the difference of the two angles only, so a window key's logit is the same
at positions `p - base` and `j - base` for any base: the flash kernel rotates a tile's keys
once at `j - base` (base = o of the tile's first query, which keeps every angle below
S + W + block_q) and sink keys at j, against a second rotation of the queries.

Rotation without a gather of partner channels. With `q'[c] = sign[partner(c)] *
q[partner(c)]` (`jaxattn.RoPE.channel_tables`; 0 on pass-through channels) and float32
tables `C = a cos(n f)`, `S = a sin(n f)` (1 and 0 on pass-through channels):

    rope(q, n)  = q * C[n] - q' * S[n],      rope(q, n)' = q' * C[n] + q * S[n]
    rope(q, m) . rope(k, n) = rope(q, m) . (k * C[n]) + rope(q, m)' . (k * S[n])

so the logits are two dots of the rotated query (and its partner form) with the key tile
scaled by `[block_kv, D]` rows of the tables: per channel, no partner of k is needed, and
INT4's two halves of channels ("parts") rotate independently.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float

from pallas_kernels.cache_read import scaled_sum

__all__ = [
    "RopeTables",
    "TileQueries",
    "decode_queries",
    "decode_scores",
    "evicted",
    "rotated_query_rows",
    "tile_queries",
    "tile_scores",
]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RopeTables:
    """What a kernel needs to rotate on read (built in XLA by `jaxattn.streaming`).

    cos, sin: float32 `[R, D]`, row n: `a cos(n f[c])` / `a sin(n f[c])` of channel c
      (attention factor a folded in; 1 and 0 on pass-through channels). R covers every
      position the kernel rotates at; rows are clamped into the table.
    q_partner: `[..., Hq, D]` in q's dtype: `sign[partner(c)] * q[partner(c)]`, laid out as
      the kernel's q.
    """

    cos: Float[Array, "R D"]
    sin: Float[Array, "R D"]
    q_partner: Float[Array, "*T Hq D"]

    def take(self, index) -> RopeTables:
        """The same tables with `q_partner[index]` (the rows a kernel reads)."""
        return dataclasses.replace(self, q_partner=self.q_partner[index])


def evicted(pos, window: int | None, sink_tokens: int):
    """o(p): tokens between the sinks and the window of a query at `pos` (int32 array)."""
    if window is None:
        return jnp.zeros_like(pos)
    return jnp.maximum(pos - (window - 1 + sink_tokens), 0)


def table_rows(refs, pos, cols, col_ok):
    """(cos, sin) float32 `[n, len(cols)]` at rows `pos` `[n]` (clamped into the table) and
    columns `cols` `[1, Dp]`; columns not `col_ok` (`[1, Dp]` or None) read as 0."""
    cos_ref, sin_ref = refs
    rows = jnp.clip(pos, 0, cos_ref.shape[0] - 1)[:, None]
    ok = None if col_ok is None else jnp.broadcast_to(col_ok, (pos.shape[0], cols.shape[1]))
    other = None if ok is None else 0.0
    return tuple(plgpu.load(r.at[rows, cols], mask=ok, other=other) for r in (cos_ref, sin_ref))


def rotate_query(q, q_partner, cos, sin, dtype):
    """(rope(q, n), rope(q, n)') in `dtype` from `[rows, Dp]` q, q' and table rows."""
    qf, pf = q.astype(jnp.float32), q_partner.astype(jnp.float32)
    return (qf * cos - pf * sin).astype(dtype), (pf * cos + qf * sin).astype(dtype)


def rotated_dot(q_pair, k, cos, sin, precision):
    """float32 `[rows, block]` logits `rope(q, m) . rope(k, n)`: q_pair from
    `rotate_query`, k `[block, Dp]` un-rotated, cos/sin `[block, Dp]` rows at n."""
    dtype = q_pair[0].dtype
    kf = k.astype(jnp.float32)
    f32 = jnp.float32
    return sum(
        jnp.dot(qp, (kf * t).astype(dtype).T, precision=precision, preferred_element_type=f32)
        for qp, t in zip(q_pair, (cos, sin), strict=True)
    )


# ----------------------------------------------------------------- flash (context) tiles
class TileQueries(NamedTuple):
    """A flash tile's queries rotated for its key blocks.

    window: (rope(q, p - base), partner form), for keys rotated at `j - base`.
    sink: the same at `p - o(p)` for sink keys (rotated at j), or None in runs of blocks
      that hold no sink.
    """

    window: tuple
    sink: tuple | None
    base: jax.Array
    sink_tokens: int


def tile_queries(q, q_partner, refs, q_pos, p_first, cols, col_ok, window, sink_tokens):
    """`TileQueries` of a `[block_q, Dp]` tile at positions `q_pos` (first real: p_first)."""
    base = evicted(p_first, window, sink_tokens)
    rotate = lambda pos: rotate_query(  # noqa: E731
        q, q_partner, *table_rows(refs, pos, cols, col_ok), q.dtype
    )
    sink = None
    if window is not None and sink_tokens:
        sink = rotate(q_pos - evicted(q_pos, window, sink_tokens))
    return TileQueries(rotate(q_pos - base), sink, base, sink_tokens)


def tile_scores(tq: TileQueries, k, key_pos, refs, cols, col_ok, precision):
    """float32 `[block_q, block_kv]` logits of un-rotated keys `k` at positions `key_pos`
    `[block_kv]`: window keys at `j - base`; with `tq.sink`, keys `j < S` at j against the
    sink rotation of the queries."""
    sinks = tq.sink is not None
    is_sink = key_pos < tq.sink_tokens
    pos = key_pos - tq.base
    if sinks:
        pos = jnp.where(is_sink, key_pos, pos)
    cos, sin = table_rows(refs, pos, cols, col_ok)
    s = rotated_dot(tq.window, k, cos, sin, precision)
    if sinks:
        s = jnp.where(is_sink[None, :], rotated_dot(tq.sink, k, cos, sin, precision), s)
    return s


# ---------------------------------------------------------------- decode (one query row)
def decode_queries(q, refs, b, heads, row_ok, pos, *, window, sink_tokens, part_cols, col_ok):
    """Per part, (rope(q, p - o(p)), partner form) of a decode program's query parts `q`
    (`[rows, Pd]` each, columns `part_cols`) at position `pos` (scalar); refs: q' `[B, Hq,
    D]`, cos, sin."""
    q2_ref, *tables = refs
    rows = jnp.zeros(heads.shape, jnp.int32) + (pos - evicted(pos, window, sink_tokens))
    out = []
    for qp, cols in zip(q, part_cols, strict=True):
        ok = row_ok[:, None] & col_ok
        q2 = plgpu.load(q2_ref.at[b, heads[:, None], cols], mask=ok, other=0.0)
        out.append(rotate_query(qp, q2, *table_rows(tables, rows, cols, col_ok), qp.dtype))
    return tuple(out)


def decode_scores(q_rot, k, tables, t, pos, precision, *, window, sink_tokens, part_cols,
                  col_ok, part_scales=None):  # fmt: skip
    """float32 `[rows, block_kv]` logits of the un-rotated key parts `k` of tokens `t`, at
    their positions within the cache (`t` for sinks, `t - o(pos)` otherwise); each part's
    scaled by its `[block_kv]` scales (`part_scales`, one per part) when given."""
    key_pos = t - evicted(pos, window, sink_tokens)
    if window is not None and sink_tokens:
        key_pos = jnp.where(t < sink_tokens, t, key_pos)
    dots = [
        rotated_dot(qp, kp, *table_rows(tables, key_pos, cols, col_ok), precision)
        for qp, kp, cols in zip(q_rot, k, part_cols, strict=True)
    ]
    return scaled_sum(dots, part_scales)


def rotated_query_rows(q_ref, refs, b, heads, row_ok, cols, col_ok):
    """Ordinary RoPE on load (not on read: the cache holds rotated keys): rows `heads` of
    token b's query at columns `cols` `[1, Pd]`, `q * cos + q[partner] * sin` in float32
    then q's dtype, the arithmetic of `jaxattn.apply_rope`. refs: cos, sin float32
    `[B, D]` (the token's rotation, sign folded in) and partner int32 `[D]`
    (`jaxattn.rope.token_rotations`)."""
    cos_ref, sin_ref, partner_ref = refs
    ok = row_ok[:, None] & col_ok
    partner = plgpu.load(partner_ref.at[cols], mask=col_ok, other=0)  # [1, Pd]
    q, q2 = (
        plgpu.load(q_ref.at[b, heads[:, None], c], mask=ok, other=0.0) for c in (cols, partner)
    )
    cos, sin = (plgpu.load(r.at[b, cols], mask=col_ok, other=0.0) for r in (cos_ref, sin_ref))
    return (q.astype(jnp.float32) * cos + q2.astype(jnp.float32) * sin).astype(q.dtype)
