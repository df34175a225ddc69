"""StreamingLLM's positions within the cache (Xiao et al. 2023, arXiv:2309.17453, 3.2):
`paged_attention(..., rope=..., rope_on_read=True)` keeps un-rotated keys in the cache
and rotates queries and keys at their positions *within the cache* when it reads them.

For a query at position p with window W and S sink tokens (visible keys: `j < S` and
`p - W < j <= p`), `o(p) = max(0, p - W + 1 - S)` tokens were evicted between the sinks
and the window. The query sits at `p - o(p)` in the cache, key j at `j` if `j < S`, else
at `j - o(p)`: the positions stay below `S + W` however long the sequence grows, as a
model trained on contexts of that length expects. Without a window, o = 0 (absolute RoPE,
with the cache still holding un-rotated keys).
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxattn.rope import DynamicNTKScaling, RoPE, rotation_tables
from pallas_kernels.rope_read import RopeTables, evicted

__all__ = ["cache_positions", "check_rope_on_read", "evicted", "rope_tables"]


def check_rope_on_read(rope, rope_on_read: bool) -> None:
    """ValueError for `rope_on_read` without a `RoPE`, or with a dynamic scaling."""
    if not rope_on_read:
        return
    if rope is None:
        raise ValueError("rope_on_read=True needs rope=jaxattn.RoPE(...): nothing to rotate")
    if isinstance(rope.scaling, DynamicNTKScaling):
        raise ValueError(
            f"rope_on_read=True with rope.scaling={rope.scaling}: dynamic NTK frequencies "
            "depend on the sequence length, so un-rotated keys have no fixed rotation on read"
        )


def cache_positions(
    q_pos: Int[Array, "*N"], k_pos: Int[Array, "*N K"], window: int | None, sink_tokens: int
) -> tuple[Int[Array, "*N"], Int[Array, "*N K"]]:
    """Positions within the cache of queries at `q_pos` and of their keys at `k_pos`."""
    o = evicted(q_pos, window, sink_tokens)
    k_in = k_pos - o[..., None]
    if window is not None and sink_tokens:
        k_in = jnp.where(k_pos < sink_tokens, k_pos, k_in)
    return q_pos - o, k_in


def rope_tables(rope: RoPE, q: Float[Array, "T Hq D"], rows: int) -> RopeTables:
    """The kernels' `RopeTables`: float32 cos/sin `[rows, D]` at positions 0..rows-1 (the
    float32 angles `n * f` of `apply_rope`, attention factor folded in, 1 / 0 on
    pass-through channels), and q's partner form `sign[partner(c)] * q[partner(c)]`."""
    head_dim = q.shape[-1]
    tables = rope.channel_tables(head_dim)
    cos, sin = rotation_tables(jnp.arange(rows), rope, head_dim)
    partner_sign = jnp.asarray(tables.sign[tables.partner], q.dtype)
    q_partner = jnp.take(q, tables.partner, axis=-1) * partner_sign
    return RopeTables(cos, sin, q_partner)
