"""Where the sequences of a batch are in the kernels' packed `[T, H, D]` views."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Batch:
    """Where each sequence's queries and keys are in the packed `[T, H, D]` views.

    Dense batches (`dense=True`): sequence b owns query rows `b*Tq : (b+1)*Tq` and keys
    `b*Tk : (b+1)*Tk`, of which the first `q_len[b]` / `kv_len[b]` are real; rows past
    `q_len[b]` output zeros. Packed batches: sequence b owns query rows
    `q_start[b] : q_start[b] + q_rows[b]` (the first `q_len[b]` real) and keys
    `k_start[b] : k_start[b] + kv_len[b]`; `k_rows[b]` (optional, >= kv_len[b]) says how
    many key rows from `k_start[b]` it owns for the backward's dK/dV (zeros past kv_len:
    the trailing padding keys of a packed batch). `k_cols[b]` (optional, forward only):
    the bias/mask column of its key 0 in packed coordinates (default `k_start[b]`; with a
    cached prefix the packed keys start at the prefix, the columns need not).

    All arrays int32 `[S]`; `q_start`, `q_rows`, `k_start` are None for dense batches, and
    so are `q_len` / `kv_len` when every sequence is full (the kernel then has static
    loop bounds).
    """

    q_len: Int[Array, " S"] | None = None
    kv_len: Int[Array, " S"] | None = None
    q_start: Int[Array, " S"] | None = None
    q_rows: Int[Array, " S"] | None = None
    k_start: Int[Array, " S"] | None = None
    k_rows: Int[Array, " S"] | None = None
    k_cols: Int[Array, " S"] | None = None
    dense: bool = dataclasses.field(default=True, metadata=dict(static=True))


def packed_batch(cu_seqlens_q, cu_seqlens_k, num_q_rows: int, num_k_rows: int) -> Batch:
    """The `Batch` of a packed call (`jaxattn.ragged_attention`'s `cu_seqlens` over
    `num_q_rows` query and `num_k_rows` key rows): one sequence per `cu_seqlens` interval,
    plus one pseudo-sequence owning the trailing padding rows and keys (no keys, so its
    rows output zeros, and the backward zeroes its keys' dK/dV)."""
    cu_q, cu_k = (jnp.asarray(x).astype(jnp.int32) for x in (cu_seqlens_q, cu_seqlens_k))
    q_len, kv_len = jnp.append(jnp.diff(cu_q), 0), jnp.append(jnp.diff(cu_k), 0)
    return Batch(
        q_len=q_len,
        kv_len=kv_len,
        q_start=cu_q,
        q_rows=q_len.at[-1].set(num_q_rows - cu_q[-1]),
        k_start=cu_k,
        k_rows=kv_len.at[-1].set(num_k_rows - cu_k[-1]),
        dense=False,
    )


__all__ = ["Batch", "packed_batch"]
