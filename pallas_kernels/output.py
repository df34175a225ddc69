"""What a kernel epilogue stores: the output in its dtype, or FP8 (float8_e4m3fn).

FP8 output: the final float32 result is stored as `clip(out * inv_scale, -448, 448)` in
float8_e4m3fn, `inv_scale = 1 / out_scale` (TensorRT-LLM's convention; the user
dequantizes with `out * out_scale`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

FP8 = jnp.dtype(jnp.float8_e4m3fn)
_FP8_MAX = float(jnp.finfo(FP8).max)  # 448: e4m3fn has no inf, an overflow would be NaN


def inverse_scale(out_scale) -> jax.Array:
    """`1 / out_scale` as the float32 `[1]` input of a quantizing epilogue (computed once,
    outside the kernels, as the reference computes it)."""
    return jnp.reshape(1.0 / jnp.asarray(out_scale, jnp.float32), (1,))


def quantize_output(x, inv_scale):
    """Float32 `x` -> float8_e4m3fn: `x * inv_scale`, saturated to +-448, rounded to nearest
    even (Triton's RTNE conversion). Exact zeros stay zeros."""
    y = x * inv_scale
    return jnp.minimum(jnp.maximum(y, -_FP8_MAX), _FP8_MAX).astype(FP8)


def output_value(x, o_ref, inv_ref):
    """What the epilogue stores: `x` cast to `o_ref`'s dtype, or quantized with the
    inverse scale in `inv_ref` (`[1]` float32; None unless `o_ref` is float8_e4m3fn)."""
    return x.astype(o_ref.dtype) if inv_ref is None else quantize_output(x, inv_ref[0])
