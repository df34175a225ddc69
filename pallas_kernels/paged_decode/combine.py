"""The second pass of split-K decode: merge each split's partial output by log-sum-exp.

Split s of a query head holds `o_s` (normalised over its keys) and `lse_s`; the result is
`out = sum_s exp(lse_s - lse) * o_s` with `lse = log(sum_s exp(lse_s))`. Splits that saw
no key have `lse_s = -inf` and weigh nothing; a head with no key at all gets zeros and
`lse = -inf`. One small kernel (one program per sequence and query head) rather than the
three or four XLA reductions the same formula becomes: at small batch the decode step is a
few microseconds, and every launch counts.

With FP8 output (`pallas_kernels.output`) the split partials stay float32 and the merged
value is quantized once, here.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import next_power_of_2, whole_array_call
from pallas_kernels.output import FP8, inverse_scale, output_value


def _combine_kernel(
    o_part_ref, lse_part_ref, *refs, num_splits: int, head_dim: int, quantize: bool
):
    """o_part `[B, Hq, S, D]`, lse_part `[B, Hq, S]` float32 (and the inverse output scale
    `[1]` when `quantize`) -> o `[B, Hq, D]`, lse `[B, Hq]`."""
    inv_ref = refs[0] if quantize else None
    o_ref, lse_ref = refs[-2:]
    b, h = pl.program_id(0), pl.program_id(1)
    splits, dims = jnp.arange(next_power_of_2(num_splits)), jnp.arange(next_power_of_2(head_dim))
    split_ok, dim_ok = splits < num_splits, dims < head_dim
    lse_s = plgpu.load(lse_part_ref.at[b, h, splits], mask=split_ok, other=-jnp.inf)
    o_s = plgpu.load(
        o_part_ref.at[b, h, splits[:, None], dims[None, :]],
        mask=split_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    top = jnp.max(lse_s)
    top = jnp.where(top > -jnp.inf, top, 0.0)  # all splits empty: weights exp(-inf) = 0
    w = jnp.exp(lse_s - top)
    total = jnp.sum(w)
    seen = total > 0.0
    out = jnp.sum(w[:, None] * o_s, axis=0) / jnp.where(seen, total, 1.0)
    plgpu.store(o_ref.at[b, h, dims], output_value(out, o_ref, inv_ref), mask=dim_ok)
    lse_ref[b, h] = jnp.where(seen, top + jnp.log(jnp.where(seen, total, 1.0)), -jnp.inf)


@functools.partial(jax.jit, static_argnames=("dtype", "interpret"))
def combine_splits(o_part, lse_part, *, dtype, out_scale=None, interpret: bool = False):
    """Merges split results: o_part `[B, Hq, S, D]`, lse_part `[B, Hq, S]` (float32).

    dtype: of the output; float8_e4m3fn needs `out_scale` (float32 `[]`): the merged
    float32 value is stored as `quantize_output(out, 1 / out_scale)`.
    Returns out `[B, Hq, D]` in `dtype` and lse `[B, Hq]` float32.
    """
    batch, num_heads, num_splits, head_dim = o_part.shape
    quantize = jnp.dtype(dtype) == FP8
    if quantize and out_scale is None:
        raise ValueError("combine_splits: a float8_e4m3fn output needs out_scale")
    inputs = [o_part, lse_part] + ([inverse_scale(out_scale)] if quantize else [])
    kernel = functools.partial(
        _combine_kernel, num_splits=num_splits, head_dim=head_dim, quantize=quantize
    )
    return whole_array_call(
        kernel,
        inputs,
        [
            jax.ShapeDtypeStruct((batch, num_heads, head_dim), dtype),
            jax.ShapeDtypeStruct((batch, num_heads), jnp.float32),
        ],
        grid=(batch, num_heads),
        num_warps=4,
        num_stages=1,
        interpret=interpret,
        name="paged_decode_combine",
    )
