"""Paged GQA decode (generation phase) as a Pallas Triton kernel.

One program serves one sequence, one kv head and one split of the context: it holds the
query rows of all heads of that kv group (`[G, D]`, padded to 16 rows for the tensor
cores), so each cached K/V block is read once for the whole group (as TensorRT-LLM's XQA
kernels do). Block tables are read in-kernel: a `block_kv`-token step gathers its rows from
whatever pages hold them, so pages may lie anywhere in the pool and have any size.

Split-K ("multi-block"): with `num_splits > 1` each program covers a contiguous share of
the context and writes its normalised partial output and log-sum-exp; `_combine` merges
them (out = sum_s exp(lse_s - lse) * out_s). This keeps the GPU busy when
`batch * num_kv_heads` is small against the number of SMs.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import (
    LOG2E,
    MASK_VALUE,
    next_power_of_2,
    softmax_finish,
    softmax_init,
    softmax_update,
    whole_array_call,
)
from pallas_kernels.paged_decode.config import PagedDecodeConfig

_MIN_ROWS = 16  # Triton's dot needs M >= 16: the group's query rows are padded to this


@dataclasses.dataclass(frozen=True)
class DecodeParams:
    """Static options of the logits and mask (semantics: DESIGN.md / jaxattn.reference)."""

    window: int | None = None
    sink_tokens: int = 0
    soft_cap: float | None = None
    scale: float = 1.0


def _paged_decode_kernel(
    ctx_ref,  # [B] int32 tokens held (the query is the last)
    table_ref,  # [B, max_pages] int32
    q_ref,  # [B, Hq, D]
    k_ref,
    v_ref,  # [N, Hkv, P, D]
    *refs,
    params: DecodeParams,
    has_alibi: bool,
    split_out: bool,
    group: int,
    rows: int,
    head_dim: int,
    block_kv: int,
    num_splits: int,
):
    refs = list(refs)
    alibi_ref = refs.pop(0) if has_alibi else None  # [Hq]
    o_ref, lse_ref = refs  # [B, Hq, D] and [B, Hq]; or [B, Hq, S, D] and [B, Hq, S]

    b, kvh, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    num_pages, page_size, max_pages = k_ref.shape[0], k_ref.shape[2], table_ref.shape[1]
    padded_dim = next_power_of_2(head_dim)
    dims = jnp.arange(padded_dim)
    dim_ok = dims[None, :] < head_dim  # [1, Dp]
    g = jnp.arange(rows)
    row_ok = g < group
    heads = kvh * group + g  # [rows] query heads of this kv group

    q = plgpu.load(  # [rows, Dp]
        q_ref.at[b, pl.ds(kvh * group, rows), pl.ds(0, padded_dim)],
        mask=row_ok[:, None] & dim_ok,
        other=0.0,
    )
    ctx = ctx_ref[b]
    pos = ctx - 1  # the query's position
    slopes = None
    if has_alibi:
        slopes = plgpu.load(alibi_ref.at[pl.ds(kvh * group, rows)], mask=row_ok, other=0.0)
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    qk_scale = params.scale * (1.0 if params.soft_cap is not None else LOG2E)

    def body(block, carry):
        t = block * block_kv + jnp.arange(block_kv)  # [block_kv] token positions
        t_ok = (t >= 0) & (t < ctx)
        col = t // page_size
        pages = plgpu.load(table_ref.at[b, col], mask=t_ok & (col < max_pages), other=0)
        pages = jnp.clip(pages, 0, num_pages - 1)  # a corrupt table never reads off the pool
        at = (pages[:, None], kvh, (t % page_size)[:, None], dims[None, :])
        kv_ok = t_ok[:, None] & dim_ok
        k = plgpu.load(k_ref.at[at], mask=kv_ok, other=0.0).astype(q.dtype)  # [block_kv, Dp]
        s = jnp.dot(q, k.T, precision=precision, preferred_element_type=jnp.float32)
        s = s * qk_scale
        if has_alibi:
            dist = jnp.abs(pos - t).astype(jnp.float32)
            alibi = -slopes[:, None] * dist[None, :]
            s = s + alibi * (1.0 if params.soft_cap is not None else LOG2E)
        if params.soft_cap is not None:
            s = (params.soft_cap * LOG2E) * jnp.tanh(s / params.soft_cap)
        visible = t_ok
        if params.window is not None:
            in_window = t > pos - params.window
            if params.sink_tokens:
                in_window |= t < params.sink_tokens
            visible &= in_window
        s = jnp.where(visible[None, :], s, MASK_VALUE)
        load_v = lambda: plgpu.load(v_ref.at[at], mask=kv_ok, other=0.0).astype(q.dtype)  # noqa: E731
        return softmax_update(carry, s, load_v, precision)

    # This split's share of the blocks that can hold visible keys.
    lo = 0 if params.window is None else jnp.maximum(pos - params.window + 1, 0)
    hi_b = pl.cdiv(ctx, block_kv)
    lo_b = jnp.minimum(lo // block_kv, hi_b)
    per_split = pl.cdiv(hi_b - lo_b, num_splits)
    start = jnp.minimum(lo_b + split * per_split, hi_b)
    end = jnp.minimum(start + per_split, hi_b)

    carry = softmax_init(rows, padded_dim)
    if params.window is not None and params.sink_tokens:
        # Sink blocks below the window belong to split 0. (Integer arithmetic rather than
        # a select of constants: see flash_prefill on Triton's i1/i32 lowering.)
        sink_b = jnp.minimum(pl.cdiv(jnp.minimum(params.sink_tokens, ctx), block_kv), lo_b)
        sink_b = sink_b * (1 - jnp.minimum(split, 1))
        carry = jax.lax.fori_loop(0, sink_b, body, carry)
    out, lse = softmax_finish(jax.lax.fori_loop(start, end, body, carry))
    store_ok = row_ok[:, None] & dim_ok
    if split_out:
        plgpu.store(o_ref.at[b, heads[:, None], split, dims[None, :]], out, mask=store_ok)
        plgpu.store(lse_ref.at[b, heads, split], lse, mask=row_ok)
    else:
        plgpu.store(
            o_ref.at[b, heads[:, None], dims[None, :]], out.astype(o_ref.dtype), mask=store_ok
        )
        plgpu.store(lse_ref.at[b, heads], lse, mask=row_ok)


def _combine(o_part, lse_part, dtype):
    """Merges split results: o_part `[B, Hq, S, D]`, lse_part `[B, Hq, S]` (float32)."""
    lse = jax.nn.logsumexp(lse_part, axis=-1)  # -inf where every split was empty
    weights = jnp.where(jnp.isfinite(lse)[..., None], jnp.exp(lse_part - lse[..., None]), 0.0)
    out = jnp.einsum("bhs,bhsd->bhd", weights, o_part)
    return out.astype(dtype), lse


@functools.partial(jax.jit, static_argnames=("params", "config", "interpret"))
def paged_decode(
    q,
    k_pages,
    v_pages,
    block_tables,
    context_lens,
    *,
    alibi_slopes=None,
    params: DecodeParams,
    config: PagedDecodeConfig,
    interpret: bool = False,
):
    """Decode attention over a paged cache.

    Args:
      q: `[B, Hq, D]`. k_pages, v_pages: `[N, Hkv, P, D]` (any float dtype; read as q's).
      block_tables: int32 `[B, max_pages]`; context_lens: int32 `[B]` (query included).
      alibi_slopes: float32 `[Hq]` or None. params, config: static options and tiling.

    Returns:
      out `[B, Hq, D]` in q's dtype and lse float32 `[B, Hq]`.
    """
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_pages.shape[1]
    group = num_q_heads // num_kv_heads
    rows = max(_MIN_ROWS, next_power_of_2(group))
    splits = config.num_splits
    inputs = [context_lens.astype(jnp.int32), block_tables.astype(jnp.int32), q, k_pages, v_pages]
    if alibi_slopes is not None:
        inputs.append(alibi_slopes.astype(jnp.float32))
    if splits == 1:
        out_shape = [
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct((batch, num_q_heads), jnp.float32),
        ]
    else:
        out_shape = [
            jax.ShapeDtypeStruct((batch, num_q_heads, splits, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((batch, num_q_heads, splits), jnp.float32),
        ]
    kernel = functools.partial(
        _paged_decode_kernel,
        params=params,
        has_alibi=alibi_slopes is not None,
        split_out=splits > 1,
        group=group,
        rows=rows,
        head_dim=head_dim,
        block_kv=config.block_kv,
        num_splits=splits,
    )
    out, lse = whole_array_call(
        kernel,
        inputs,
        out_shape,
        grid=(batch, num_kv_heads, splits),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        interpret=interpret,
        name="paged_decode",
    )
    if splits > 1:
        out, lse = _combine(out, lse, q.dtype)
    return out, lse
