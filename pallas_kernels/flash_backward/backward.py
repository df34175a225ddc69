"""`flash_backward`: the gradients of `flash_prefill` from its residuals (q, k, v, out and
the float32 log-sum-exp; nothing of size Tq x Tk): a delta preprocess (one fused XLA
pass over dO and O), the dK/dV kernel (`dkdv.py`) and the dQ kernel (`dq.py`).

Deterministic: every output element is written by one program, and the per-tile partial
sums (ALiBi slopes, T5 table) are added in a fixed order, so two runs give the same bits.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from pallas_kernels.common import LOG2E, next_power_of_2, whole_array_call
from pallas_kernels.flash_backward.config import FlashBackwardConfig
from pallas_kernels.flash_backward.dkdv import _dkdv_kernel
from pallas_kernels.flash_backward.dq import _dq_kernel
from pallas_kernels.tiles import packed_grid, packed_tile_table

if TYPE_CHECKING:  # (flash_prefill's config imports this package)
    from pallas_kernels.flash_prefill.kernel import Batch, LogitParams


def _grid_and_index(batch: Batch, params, num_q_rows, num_k_rows, block, axis, dense_shape):
    """(index input or None, tiles, programs) of a kernel tiling `axis` ("q" or "kv")."""
    if dense_shape is not None:
        num_seqs, q_rows, k_rows = dense_shape
        tiles = num_seqs * -(-(q_rows if axis == "q" else k_rows) // block)
        index = None
        if batch.q_len is not None or batch.kv_len is not None:
            full = lambda x, n: jnp.full((num_seqs,), n, jnp.int32) if x is None else x  # noqa: E731
            index = jnp.stack([full(batch.q_len, q_rows), full(batch.kv_len, k_rows)])
            index = index.astype(jnp.int32)  # [2, B]
        return index, tiles, tiles
    num_rows = num_q_rows if axis == "q" else num_k_rows
    tiles, programs = packed_grid(num_rows, batch.q_len.shape[0], block)
    return packed_tile_table(batch, block, tiles, params, axis), tiles, programs


@functools.partial(jax.jit, static_argnames=("params", "config", "grads_of", "interpret"))
def flash_backward(
    q,
    k,
    v,
    out,
    lse,
    g_out,
    g_lse,
    batch: Batch,
    *,
    bias=None,
    mask=None,
    alibi_slopes=None,
    rel_table=None,
    params: LogitParams,
    config: FlashBackwardConfig,
    grads_of: tuple[bool, bool, bool] = (False, False, False),
    interpret: bool = False,
):
    """Gradients of `flash_prefill(q, k, v, batch, ...)` (same arguments and layouts).

    Args:
      q, k, v, batch, bias, mask, alibi_slopes, rel_table, params: as the forward's.
      out: the forward's output (q's shape and dtype); lse: its float32 lse, dense
        `[B, Hq, Tq]` or packed `[Hq, Tq_all]` (-inf for rows with no visible key).
      g_out: cotangent of out (q's shape); g_lse: cotangent of lse (lse's shape) or None.
      grads_of: which of (bias, alibi_slopes, rel_table) to differentiate.

    Returns:
      (dq, dk, dv) in the inputs' shapes and dtypes; d_bias float32 shaped like `bias`
      (or None); d_alibi float32 `[Hq]` (or None); d_table float32 like rel_table (or None).
    """
    want_bias, want_alibi, want_rel = grads_of
    num_q_heads, head_dim = q.shape[-2:]
    num_kv_heads = k.shape[-2]
    dense_shape = None
    if batch.dense:
        dense_shape = (q.shape[0], q.shape[1], k.shape[1])
        q, k, v, out, g_out = (x.reshape(-1, *x.shape[2:]) for x in (q, k, v, out, g_out))
        to_rows = lambda x: x.transpose(1, 0, 2).reshape(num_q_heads, -1)  # noqa: E731
    else:
        to_rows = lambda x: x  # noqa: E731
    lse = to_rows(lse)  # [Hq, Tq_all]
    finite = jnp.isfinite(lse)
    lse2 = jnp.where(finite, lse * LOG2E, jnp.inf)  # +inf: the row's probabilities are 0
    delta = jnp.sum(g_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1).T
    if g_lse is not None:
        delta = delta - jnp.where(finite, to_rows(g_lse), 0.0)
    terms = [x for x in (bias, mask, alibi_slopes, rel_table) if x is not None]
    has_terms = tuple(x is not None for x in (bias, mask, alibi_slopes, rel_table))
    common = dict(params=params, head_dim=head_dim, group=num_q_heads // num_kv_heads,
                  dense_shape=dense_shape)  # fmt: skip
    num_q_rows, num_k_rows = q.shape[0], k.shape[0]

    # dK, dV: a program per (kv head, key tile).
    block_kv = config.block_kv_dkv
    index, tiles, programs = _grid_and_index(
        batch, params, num_q_rows, num_k_rows, block_kv, "kv", dense_shape
    )
    inputs = [x for x in (index,) if x is not None] + [q, k, v, g_out.astype(q.dtype), lse2, delta]
    kernel = functools.partial(_dkdv_kernel, has=(index is not None, *has_terms),
                               block_q=config.block_q_dkv, block_kv=block_kv,
                               tile_loop=programs < tiles, **common)  # fmt: skip
    dk, dv = whole_array_call(
        kernel, inputs + terms, [jax.ShapeDtypeStruct(k.shape, k.dtype)] * 2,
        grid=(num_kv_heads, programs), num_warps=config.num_warps[0],
        num_stages=config.num_stages[0], interpret=interpret, name="flash_backward_dkdv",
    )  # fmt: skip

    # dQ and the extras: a program per (query head, query tile).
    block_q = config.block_q_dq
    index, tiles, programs = _grid_and_index(
        batch, params, num_q_rows, num_k_rows, block_q, "q", dense_shape
    )
    inputs = [x for x in (index,) if x is not None] + [q, k, v, g_out.astype(q.dtype), lse2, delta]
    inputs += terms
    zeros = []  # aliased to the extras' outputs: entries no program writes stay 0
    if want_bias:
        if dense_shape is not None:
            full = (dense_shape[0], num_q_heads, dense_shape[1], dense_shape[2])
        else:
            full = (1, num_q_heads, num_q_rows, num_k_rows)
        zeros.append(jnp.zeros(full, jnp.float32))
    if want_alibi:
        zeros.append(jnp.zeros((num_q_heads, tiles), jnp.float32))
    if want_rel:
        buckets_p2 = next_power_of_2(rel_table.shape[-1])
        zeros.append(jnp.zeros((num_q_heads, tiles, buckets_p2), jnp.float32))
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
    out_shape += [jax.ShapeDtypeStruct(z.shape, z.dtype) for z in zeros]
    aliases = {len(inputs) + i: 1 + i for i in range(len(zeros))}
    kernel = functools.partial(_dq_kernel, has=(index is not None, *has_terms),
                               grads_of=grads_of, block_q=block_q, block_kv=config.block_kv_dq,
                               tile_loop=programs < tiles, **common)  # fmt: skip
    dq, *extras = whole_array_call(
        kernel, inputs + zeros, out_shape, grid=(num_q_heads, programs),
        num_warps=config.num_warps[1], num_stages=config.num_stages[1], interpret=interpret,
        name="flash_backward_dq", aliases=aliases,
    )  # fmt: skip

    d_bias = d_alibi = d_table = None
    if want_bias:
        full = extras.pop(0)
        axes = tuple(i for i, n in enumerate(bias.shape) if n == 1 and full.shape[i] != 1)
        d_bias = jnp.sum(full, axis=axes, keepdims=True)
    if want_alibi:
        d_alibi = jnp.sum(extras.pop(0), axis=1)
    if want_rel:
        d_table = jnp.sum(extras.pop(0), axis=1)[:, : rel_table.shape[-1]]
    if dense_shape is not None:
        num_seqs, q_rows, k_rows = dense_shape
        dq = dq.reshape(num_seqs, q_rows, num_q_heads, head_dim)
        dk, dv = (x.reshape(num_seqs, k_rows, num_kv_heads, head_dim) for x in (dk, dv))
    return dq, dk, dv, d_bias, d_alibi, d_table
