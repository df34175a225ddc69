"""Reading K/V tiles from the page pools inside the decode kernel, dequantized on load.

A step of the kernel reads the rows of `block_kv` cached tokens of one kv head, wherever
their pages are, and hands the dot products values in the query's dtype. Quantized pools
(formats: `jaxattn.quant`) are dequantized in registers, exactly as the reference does it:
`(stored as float32) * scale`, rounded once to the query's dtype; no dequantized copy of
the cache ever exists in HBM.

INT4 rows hold channel j in the low nibble and channel j + D/2 in the high nibble of byte
j, so a tile comes out as two halves ("parts"): channels `[0, D/2)` and `[D/2, D)`. The
kernel keeps the query and the output in the same parts (dots per part, summed), so the
nibbles never need interleaving.

Integers become floats through the float32 "magic number" identity (bits of 2**23 + u
read as a float are exactly 2**23 + u for 0 <= u < 2**23): an integer add and a float
subtract per value, where a conversion instruction would run at a quarter of the rate,
which at INT4's four values per byte read would cap the bandwidth.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import next_power_of_2

_MAGIC = 0x4B000000  # float32 bits of 2**23
_MAGIC_F = float(2**23)


@dataclasses.dataclass(frozen=True)
class CacheFormat:
    """What the pools hold (static).

    dtype: None (float pools, read as they are), "int8", "float8_e4m3fn" or "int4".
    granularity: "tensor" (a float32 `[1]` scale per pool) or "group" (scale pages
      bfloat16 `[N, Hkv, P, G]` beside each pool, G = head_dim // group_size).
    group_size: channels per scale ("group").
    """

    dtype: str | None = None
    granularity: str = "tensor"
    group_size: int = 0

    @property
    def parts(self) -> int:
        return 2 if self.dtype == "int4" else 1


def _ints_to_f32(x_plus_bias, bias: int):
    """int32 values `u = x + bias` in [0, 2**23) -> float32 x, exactly."""
    bits = x_plus_bias + _MAGIC
    return jax.lax.bitcast_convert_type(bits, jnp.float32) - (_MAGIC_F + bias)


def _decode(raw, fmt: CacheFormat) -> list:
    """Stored tile `[block, Pd]` -> float32 value tiles, one per part (before scaling)."""
    if fmt.dtype is None or fmt.dtype == "float8_e4m3fn":
        return [raw.astype(jnp.float32)]
    wide = raw.astype(jnp.int32)  # int8: sign-extended; int4 bytes (uint8): zero-extended
    if fmt.dtype == "int8":
        return [_ints_to_f32(wide + 128, 128)]
    # Two's-complement nibble n: (n ^ 8) = n + 8 in [0, 16).
    return [_ints_to_f32((wide & 0xF) ^ 8, 8), _ints_to_f32(((wide >> 4) & 0xF) ^ 8, 8)]


def read_kv(ref, scale_ref, fmt: CacheFormat, at, t_ok, head_dim: int, dtype):
    """One K or V tile of `block` tokens, dequantized: a tuple of `[block, Pd]` parts.

    Args:
      ref: the pool `[N, Hkv, P, Dp]`; scale_ref: None, float32 `[1]` ("tensor") or the
        pool's scale pages ("group").
      at: (pages `[block, 1]`, kv head, offsets `[block, 1]`): where the tokens are.
      t_ok: `[block]`, tokens to read (others read as zeros).
      head_dim: D; each part spans D / parts channels, padded to a power of two (Pd).
    """
    pages, kvh, offsets = at
    part_dim = head_dim // fmt.parts
    dims = jnp.arange(next_power_of_2(part_dim))
    ok = t_ok[:, None] & (dims < part_dim)[None, :]
    other = 0 if jnp.issubdtype(ref.dtype, jnp.integer) else 0.0
    raw = plgpu.load(ref.at[pages, kvh, offsets, dims[None, :]], mask=ok, other=other)
    if fmt.dtype is None:
        return (raw.astype(dtype),)
    parts = []
    for p, values in enumerate(_decode(raw, fmt)):
        if fmt.granularity == "tensor":
            scale = scale_ref[0]
        elif fmt.group_size == head_dim:  # one scale per token row
            row = scale_ref.at[pages, kvh, offsets, jnp.int32(0)]
            scale = plgpu.load(row, mask=t_ok[:, None], other=1)
        else:
            group = (p * part_dim + dims[None, :]) // fmt.group_size
            scale = plgpu.load(scale_ref.at[pages, kvh, offsets, group], mask=ok, other=1)
        parts.append((values * scale.astype(jnp.float32)).astype(dtype))
    return tuple(parts)
