"""An independent numpy oracle of the KV-cache formats, written from jaxattn/quant.py's doc.

It shares no code with `jaxattn`: rounding onto the int8 / int4 / e4m3fn grids, bf16 scale
rounding and the int4 nibble layout are spelled out here with float32/float64 numpy
arithmetic and bit operations (ml_dtypes only gives the fp8 *storage* of values already on
its grid). A quantization config is anything with `.dtype`, `.granularity` and
`.group_size` attributes (a `jaxattn.quant.KVQuant`).

Spec: `y = x * (1/scale)` (per-tensor) or `x / scale` (per-group, scale bf16-rounded
`max(amax / qmax, 2**-64)`), all in float32; integers round half to even and saturate to
±qmax; fp8 saturates to ±448 and rounds to nearest even on the e4m3fn grid (3 mantissa
bits, exponents -6..8, subnormals with spacing 2**-9). Dequantized: `q * scale` in float32.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

QMAX = {"int8": 127, "float8_e4m3fn": 448, "int4": 7}
TINY_SCALE = np.float32(2.0**-64)


def round_bf16(x) -> np.ndarray:
    """float32 -> the nearest bfloat16 value (ties to even), as float32. Finite inputs."""
    bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.astype(np.uint32).view(np.float32)


def round_e4m3fn(y) -> np.ndarray:
    """Values in [-448, 448] -> the nearest float8_e4m3fn value (ties to even), float64.

    A value in [2**e, 2**(e+1)) with e >= -6 has 8 grid steps of 2**(e-3); below 2**-6
    (subnormals) the step stays 2**-9. Rounding to a multiple of the step, ties to even, is
    rounding the mantissa to 3 bits, ties to even."""
    y = np.asarray(y, np.float64)
    a = np.abs(y)
    assert (a <= 448).all(), "clip before rounding: e4m3fn has no inf"
    _, e = np.frexp(a)  # a = m * 2**e with m in [0.5, 1): a's binade is 2**(e - 1)
    step = np.ldexp(1.0, np.maximum(e - 1, -6) - 3)
    return np.copysign(np.round(a / step) * step, y)


def _per_channel(scale, head_dim: int) -> np.ndarray:
    scale = np.asarray(scale, np.float32)
    return np.repeat(scale, head_dim // scale.shape[-1], axis=-1)


def group_scales_np(x, quant) -> np.ndarray:
    """bf16-rounded `max(amax / qmax, 2**-64)` per group, float32 `[..., G]`."""
    x = np.asarray(x, np.float32)
    head_dim = x.shape[-1]
    size = quant.group_size or head_dim
    amax = np.abs(x.reshape(*x.shape[:-1], head_dim // size, size)).max(-1)
    return round_bf16(np.maximum(amax / np.float32(QMAX[quant.dtype]), TINY_SCALE))


def quantize_np(x, scale, quant) -> np.ndarray:
    """Quantized values (on the format's grid) `[..., D]`, float64."""
    x = np.asarray(x, np.float32)
    if quant.granularity == "tensor":
        y = x * (np.float32(1.0) / np.float32(scale))
    else:
        y = x / _per_channel(scale, x.shape[-1])
    qmax = QMAX[quant.dtype]
    if quant.dtype == "float8_e4m3fn":
        return round_e4m3fn(np.clip(y, -qmax, qmax))
    return np.clip(np.round(y), -qmax, qmax).astype(np.float64)


def dequantize_np(values, scale, quant) -> np.ndarray:
    """float32 `values * scale` `[..., D]`."""
    values = np.asarray(values, np.float32)
    if quant.granularity == "group":
        scale = _per_channel(scale, values.shape[-1])
    return values * np.asarray(scale, np.float32)


def pack_int4_np(values) -> np.ndarray:
    """Integers in [-8, 7] `[..., D]` -> uint8 `[..., D/2]`: byte j = channel j's two's
    complement nibble + 16 * channel (j + D/2)'s."""
    nibbles = np.asarray(values).astype(np.int64) % 16  # two's complement in 4 bits
    half = nibbles.shape[-1] // 2
    return (nibbles[..., :half] + 16 * nibbles[..., half:]).astype(np.uint8)


def unpack_int4_np(packed) -> np.ndarray:
    packed = np.asarray(packed).astype(np.int64)
    low, high = packed % 16, packed // 16
    return np.concatenate([low - 16 * (low >= 8), high - 16 * (high >= 8)], -1)


def to_storage_np(values, quant) -> np.ndarray:
    """Grid values `[..., D]` -> what the cache stores (int8, float8_e4m3fn, packed uint8)."""
    if quant.dtype == "int4":
        return pack_int4_np(values)
    if quant.dtype == "int8":
        return np.asarray(values).astype(np.int8)
    return np.asarray(values, np.float32).astype(ml_dtypes.float8_e4m3fn)  # exact: on grid


def from_storage_np(stored, quant) -> np.ndarray:
    """The inverse of `to_storage_np`: grid values `[..., D]` float64."""
    if quant.dtype == "int4":
        return unpack_int4_np(stored).astype(np.float64)
    return np.asarray(stored).astype(np.float64)
