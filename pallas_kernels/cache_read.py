"""Reading K/V tiles from the page pools inside the decode kernel, dequantized on load.

A step of the kernel reads the rows of `block_kv` cached tokens of one kv head, wherever
their pages are, and hands the dot products values in the query's dtype. Quantized pools
(formats: `jaxattn.quant`) are dequantized in registers; no dequantized copy of the cache
ever exists in HBM. A scale that is constant along a row (per tensor, or per token and
head: per-group scales with `group_size = head_dim`) is factored out of the tile: the
stored integers (exact in bf16) go straight to the dot, and the scale multiplies the
logits (K) or the probabilities (V) of that token, `[block]` values instead of
`[block, D]`. Finer groups are applied per element: `(stored as float32) * scale`, rounded
once to the query's dtype, as the reference does.

INT4 rows hold channel j in the low nibble and channel j + D/2 in the high nibble of byte
j, so a tile comes out as two halves ("parts"): channels `[0, D/2)` and `[D/2, D)`. The
kernel keeps the query and the output in the same parts (dots per part, summed), so the
nibbles never need interleaving.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.codes import codes_to_bf16, int4_nibbles
from pallas_kernels.common import next_power_of_2


@dataclasses.dataclass(frozen=True)
class CacheFormat:
    """What the pools hold (static).

    dtype: None (float pools, read as they are), "int8", "float8_e4m3fn" or "int4".
    granularity: "tensor" (a float32 `[1]` scale per pool) or "group" (scale pages
      bfloat16 `[N, Hkv, P, G]` beside each pool, G = head_dim // group_size).
    group_size: channels per scale ("group"); 0 when one scale covers the whole row.
    """

    dtype: str | None = None
    granularity: str = "tensor"
    group_size: int = 0

    @property
    def parts(self) -> int:
        return 2 if self.dtype == "int4" else 1

    @property
    def row_scales(self) -> bool:
        """One scale per token row (per tensor, or groups spanning the whole row)."""
        return self.dtype is not None and (self.granularity == "tensor" or self.group_size == 0)


PLAIN = CacheFormat()  # float pools, no scales


def ring_position(t, ring: tuple[int, int] | None):
    """Where position `t` (int array, >= 0) is stored in a sequence's pages: `t` itself, or
    in a cyclic cache `ring = (kept, size)`: positions below `kept` (sink tokens) stay put,
    later ones cycle through the next `size` places (`jaxattn.manager`, window caches)."""
    if ring is None:
        return t
    kept, size = ring
    return jnp.where(t < kept, t, kept + (jnp.maximum(t - kept, 0) % size))


def _decode(raw, fmt: CacheFormat, dtype, asm: bool) -> list:
    """Stored tile `[block, Pd]` -> value tiles of `dtype` (unscaled), one per part."""
    if fmt.dtype is not None and dtype == jnp.bfloat16:
        return codes_to_bf16(raw, fmt.dtype, asm=asm)
    return int4_nibbles(raw, dtype) if fmt.dtype == "int4" else [raw.astype(dtype)]


def row_scale(scale_ref, at, t_ok):
    """The per-row scales of `block` tokens, float32 `[block]` (`fmt.row_scales`)."""
    if scale_ref.shape == (1,):  # per tensor
        return jnp.full(t_ok.shape, scale_ref[0], jnp.float32)
    pages, kvh, offsets = at
    row = scale_ref.at[pages[:, 0], kvh, offsets[:, 0], jnp.int32(0)]
    return plgpu.load(row, mask=t_ok, other=1).astype(jnp.float32)


def read_kv(ref, scale_ref, fmt: CacheFormat, at, t_ok, head_dim: int, dtype, asm: bool = False):
    """One K or V tile of `block` tokens: a tuple of `[block, Pd]` parts of `dtype`,
    dequantized except for row scales (`fmt.row_scales`: the caller applies `row_scale`).
    Codes become bfloat16 values without conversion instructions (`codes.py`; `asm`: on
    the GPU, not in interpret mode); finer groups multiply by their bfloat16 scale in
    bfloat16 (one rounding of the exact product, as the reference's).

    Args:
      ref: the pool `[N, Hkv, P, Dp]`; scale_ref: None, float32 `[1]` ("tensor") or the
        pool's scale pages `[N, Hkv, P, G]` ("group").
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
    if fmt.dtype is None or fmt.row_scales:
        return tuple(_decode(raw, fmt, dtype, asm))
    exact = jnp.bfloat16 if dtype == jnp.bfloat16 else jnp.float32  # code * bf16 scale
    parts = []
    for p, values in enumerate(_decode(raw, fmt, exact, asm)):
        group = (p * part_dim + dims[None, :]) // fmt.group_size
        scale = plgpu.load(scale_ref.at[pages, kvh, offsets, group], mask=ok, other=1)
        parts.append((values * scale.astype(exact)).astype(dtype))
    return tuple(parts)


def read_rows(ref, scale_ref, fmt: CacheFormat, at, t_ok, head_dim: int, dtype):
    """One K or V tile `[block, Dp]` of `dtype` in natural channel order, fully dequantized
    (scales applied per element): for kernels whose tile mixes cached and fresh rows.

    Arguments as `read_kv`, except `t_ok` may be None: every row is read. Dp = D padded to
    a power of two (columns past D read as 0). Without a mask (t_ok None and D a power of
    two) the loads vectorize along D. INT4 reads each byte twice (for channel j and
    j + D/2) and picks the nibble, so the tile needs no interleaving.
    """
    pages, kvh, offsets = at
    dims = jnp.arange(next_power_of_2(head_dim))
    ok = None
    if t_ok is not None:
        ok = t_ok[:, None]
    if len(dims) != head_dim:
        ok = (dims < head_dim)[None, :] if ok is None else ok & (dims < head_dim)[None, :]
    if ok is not None:
        ok = jnp.broadcast_to(ok, (pages.shape[0], len(dims)))

    def load(x_ref, cols, other):
        return plgpu.load(x_ref.at[pages, kvh, offsets, cols[None, :]], mask=ok,
                          other=None if ok is None else other)  # fmt: skip

    if fmt.dtype is None:
        return load(ref, dims, 0.0).astype(dtype)
    if fmt.dtype == "int4":
        half = head_dim // 2
        shift = jnp.where(dims >= half, 4, 0)[None, :]
        raw = load(ref, dims % half, 0).astype(jnp.int32)
        values = ((((raw >> shift) & 0xF) ^ 8) - 8).astype(jnp.float32)
    else:
        values = load(ref, dims, 0 if fmt.dtype == "int8" else 0.0).astype(jnp.float32)
    if scale_ref.shape == (1,):  # per tensor
        return (values * scale_ref[0]).astype(dtype)
    group = dims // fmt.group_size if fmt.group_size else jnp.zeros_like(dims)
    return (values * load(scale_ref, group, 1).astype(jnp.float32)).astype(dtype)
