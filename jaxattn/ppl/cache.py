"""OpenPPL's KV cache: its four layouts, its two indexing modes, and its quantized write.

One array holds K and V of every layer; `scale` (quantized caches) mirrors it with
`head_dim // quant_group` scales per token row of a head (MaxT cache tokens, L layers,
H kv heads, Dc = head_dim, or head_dim / 2 for INT4):

  cache_layout   cache                  kernels' view (`pallas_kernels.cache_read.PoolLayout`)
  0              [MaxT, L, 2, H, Dc]    ("token", "layer", "kv", "head", "dim")
  1              [L, MaxT, 2, H, Dc]    ("layer", "token", "kv", "head", "dim")
  2              [L, 2, MaxT, H, Dc]    ("layer", "kv", "token", "head", "dim")
  3              [L, 2, H, MaxT, Dc]    ("layer", "kv", "head", "token", "dim")

The kernels index these arrays where they are (no transpose, no copy per call).

Where sequence position p of batch b lives (a token row of MaxT):
  cache_mode 0 (offsets): `cachestarts[b] + p`;
  cache_mode 1 (pages):   `cachestarts[b, p // page_size] + p % page_size` (the entries are
                          the token offsets where the sequence's pages start).
Mode 0 is mode 1 with one page as long as the cache: the kernels see it so.

Quantization (`quant_bit` 8: int8 codes, qmax 127; 4: codes -7..7, two a byte): for each
written token, kv head and group of `quant_group` channels, `s = max(amax * (1 / qmax),
tiny)` in float32 (the reciprocal a float32 constant: XLA turns a division by a constant
into that product anyway, so the rule says so), rounded to the scale array's dtype
(float16 or float32; tiny its smallest normal), then `code = clip(round(x / s), -qmax,
qmax)` (round half to even) with that stored s, so the kernels dequantize (`code * s`)
with the scale the write used. Two limits: a float16 scale saturates at float16's largest
value (a group's amax past 65504 * qmax then saturates its codes, where it would have
been inf and read back NaN); with float32 scales, a quotient within a float32 ulp of a
tie (k + 1/2) may round either way (x is compared with the tie as the float32 product
`(k + 1/2) * s`, which rounds). INT4 bytes hold channel j in the low nibble and channel
j + head_dim/2 in the high one (`jaxattn.quant.pack_int4`): the last axis is head_dim / 2
bytes (uint8).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int

from jaxattn.quant import KVQuant, dequantize, group_amax, quantize
from pallas_kernels.cache_read import CacheFormat, PoolLayout

__all__ = ["LAYOUTS", "PPLCache"]

LAYOUTS = {
    0: ("token", "layer", "kv", "head", "dim"),
    1: ("layer", "token", "kv", "head", "dim"),
    2: ("layer", "kv", "token", "head", "dim"),
    3: ("layer", "kv", "head", "token", "dim"),
}
_CODES = {8: "int8", 4: "int4"}
_SCALE_DTYPES = ("float16", "float32")


@dataclasses.dataclass(frozen=True)
class PPLCache:
    """The static description of one call's cache: what the layout, mode and quantization
    options say (checked against the arrays by `check`)."""

    num_layer: int
    layer_idx: int
    num_kv_heads: int
    head_dim: int
    quant_bit: int
    quant_group: int
    cache_mode: int
    cache_layout: int
    page_size: int

    @property
    def quant(self) -> KVQuant | None:
        if not self.quant_bit:
            return None
        return KVQuant(_CODES[self.quant_bit], "group", self.quant_group)

    @property
    def axes(self) -> tuple[str, ...]:
        return LAYOUTS[self.cache_layout]

    def shape(self, max_t: int, last: int) -> tuple[int, ...]:
        """The array shape of this layout with `max_t` tokens and `last` on the last axis."""
        sizes = dict(token=max_t, layer=self.num_layer, kv=2, head=self.num_kv_heads, dim=last)
        return tuple(sizes[a] for a in self.axes)

    def max_tokens(self, cache) -> int:
        return cache.shape[self.axes.index("token")]

    def check(self, cache, scale, cachestarts) -> None:
        """Trace-time: the cache's rank, shape and dtype, the scale's, and cachestarts' rank
        against the options; ValueError naming the argument."""
        quant = self.quant
        if cache.ndim != 5:
            raise ValueError(
                f"cache.shape={cache.shape}: cache_layout={self.cache_layout} expects rank 5 "
                f"{self.axes}"
            )
        max_t = self.max_tokens(cache)
        last = self.head_dim // 2 if self.quant_bit == 4 else self.head_dim
        want = self.shape(max_t, last)
        if cache.shape != want:
            raise ValueError(
                f"cache.shape={cache.shape}: cache_layout={self.cache_layout} with "
                f"num_layer={self.num_layer}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, quant_bit={self.quant_bit} expects {want} "
                f"(axes {self.axes})"
            )
        dtypes = {8: ("int8",), 4: ("uint8",), 0: ("float16", "float32", "bfloat16")}
        if str(cache.dtype) not in dtypes[self.quant_bit]:
            raise ValueError(
                f"cache.dtype={cache.dtype}: quant_bit={self.quant_bit} expects one of "
                f"{dtypes[self.quant_bit]} (INT4: two codes a byte, uint8)"
            )
        if quant is None:
            if scale is not None:
                raise ValueError(f"scale.shape={scale.shape}: quant_bit=0 takes no scale")
        else:
            want = self.shape(max_t, self.head_dim // self.quant_group)
            if scale is None or scale.shape != want or str(scale.dtype) not in _SCALE_DTYPES:
                got = None if scale is None else (scale.shape, str(scale.dtype))
                raise ValueError(
                    f"scale={got}: quant_bit={self.quant_bit}, quant_group={self.quant_group} "
                    f"expects {want} of {_SCALE_DTYPES}"
                )
        rank = 1 if self.cache_mode == 0 else 2
        if cachestarts.ndim != rank:
            raise ValueError(
                f"cachestarts.shape={cachestarts.shape}: cache_mode={self.cache_mode} expects "
                f"rank {rank} ({'[B]' if rank == 1 else '[B, MaxP]'})"
            )

    def table(self, cachestarts: Int[Array, ...]) -> Int[Array, "B M"]:
        """The kernels' block table: token offsets of pages (mode 0: one page each)."""
        table = cachestarts[:, None] if self.cache_mode == 0 else cachestarts
        return table.astype(jnp.int32)

    def table_page_size(self, cache) -> int:
        """Tokens per table entry: page_size (mode 1) or the whole cache (mode 0)."""
        return self.page_size if self.cache_mode == 1 else self.max_tokens(cache)

    def rows(self, cache, table, batch, positions):
        """Token rows of `positions` (int32, any shape) of batches `batch` (same shape)."""
        size = self.table_page_size(cache)
        return table[batch, positions // size] + positions % size

    def format(self, cache) -> CacheFormat:
        """What the kernels need to read `cache` in place."""
        layout = PoolLayout(self.axes, page_size=self.table_page_size(cache), layer=self.layer_idx)
        quant = self.quant
        if quant is None:
            return CacheFormat(layout=layout)
        group = 0 if self.quant_group == self.head_dim else self.quant_group
        return CacheFormat(quant.dtype, "group", group, layout=layout)

    def index(self, rows, kv: int) -> tuple:
        """`.at[]` indexers selecting `[n, H, Dc]` (rows `[n]`) of layer `layer_idx`, K or V."""
        where = dict(token=rows, layer=self.layer_idx, kv=kv, head=slice(None))
        return tuple(where[a] for a in self.axes[:-1])

    def write(self, cache, scale, k, v, rows):
        """`(cache, scale, k_stored, v_stored)`: k, v `[n, H, D]` stored at token `rows`
        `[n]` (rows out of range, e.g. padding tokens at MaxT, are dropped), quantized as
        the module says; `k_stored`, `v_stored` are what the cache now holds, read back in
        k's dtype (what the kernels read for the current tokens)."""
        quant = self.quant
        stored = []
        for kv, x in enumerate((k, v)):
            at = self.index(rows, kv)
            if quant is None:
                cache = cache.at[at].set(x.astype(cache.dtype), mode="drop")
                stored.append(x.astype(cache.dtype).astype(x.dtype))
                continue
            s = _group_scales(x, quant, scale.dtype)
            codes = quantize(x, s, quant)
            cache = cache.at[at].set(codes, mode="drop")
            scale = scale.at[at].set(s, mode="drop")
            stored.append(dequantize(codes, s, quant, x.dtype))
        return cache, scale, *stored

    def read(self, cache, scale, rows, kv: int, dtype):
        """Values `[*rows.shape, H, D]` of `dtype` at token rows `rows` (dequantized)."""
        at = self.index(rows.reshape(-1), kv)
        values = cache[at]
        if self.quant is not None:
            values = dequantize(values, scale[at], self.quant, jnp.float32)
        values = values.astype(dtype)
        return values.reshape(*rows.shape, *values.shape[1:])


def _group_scales(x, quant: KVQuant, dtype) -> jax.Array:
    """PPL's scales of `x` `[..., D]`: `max(amax * (1 / qmax), tiny)` per group, in `dtype`."""
    info = jnp.finfo(dtype)  # tiny: the smallest normal, so a scale never flushes to zero
    inverse = np.float32(1.0) / np.float32(quant.qmax)
    # A float16 scale past its largest value would be inf, and its codes read back NaN:
    # it saturates there, and the group's codes at +-qmax.
    scale = jnp.clip(group_amax(x, quant) * inverse, float(info.tiny), float(info.max))
    if jnp.dtype(dtype) == jnp.float16:  # rounded here: XLA may drop a round trip of casts
        scale = jax.lax.reduce_precision(scale, exponent_bits=5, mantissa_bits=10)
    return scale.astype(dtype)
