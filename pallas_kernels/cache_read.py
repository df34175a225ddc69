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

Where rows are (`PoolLayout`): our pools are `[N, Hkv, P, Dp]` pages, a block-table
entry a page id; OpenPPL's caches are one array of token rows holding K and V of every
layer (e.g. `[MaxT, L, 2, H, Dh]`), a block-table entry the token offset where a page
starts. A layout names the pool's axes, and every read and the kernels' page arithmetic
go through it: each layout is read in place, with no relayout of the cache.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.codes import codes_to_bf16, int4_nibbles
from pallas_kernels.common import dot_width, next_power_of_2

_ROW_AXES = ("page", "offset", "token")
_AXES = (*_ROW_AXES, "head", "dim", "kv", "layer")


@dataclasses.dataclass(frozen=True)
class PoolLayout:
    """How a pool array holds cached rows (static). Per-group scale arrays mirror their
    pool, groups on the last axis.

    axes: one name per axis of the pool, "dim" last: "page" and "offset" (a row's page and
      its place in the page: block-table entries are page ids), or "token" (the row
      itself: entries are the token offsets where pages start, OpenPPL's cachestarts);
      "head" (kv head); "kv" (0: K, 1: V, when one array holds both); "layer" (fixed at
      `layer`).
    page_size: tokens per block-table entry for "token" layouts (for "page" layouts, the
      "offset" axis's size).
    layer: the index read on the "layer" axis.
    """

    axes: tuple[str, ...] = ("page", "head", "offset", "dim")
    page_size: int = 0
    layer: int = 0

    def __post_init__(self):
        axes = self.axes
        rows = [a for a in axes if a in _ROW_AXES]
        if (
            not set(axes) <= set(_AXES)
            or len(set(axes)) != len(axes)
            or axes[-1] != "dim"
            or "head" not in axes
            or sorted(rows) not in (["offset", "page"], ["token"])
        ):
            raise ValueError(f"PoolLayout: {axes=} is not a pool layout")
        if self.token_rows and self.page_size < 1:
            raise ValueError(f"PoolLayout: a 'token' layout needs page_size >= 1 ({self})")

    @property
    def token_rows(self) -> bool:
        """Block-table entries are token offsets (the pool has a "token" axis)."""
        return "token" in self.axes

    def page_size_of(self, pool) -> int:
        """Tokens per block-table entry."""
        return self.page_size if self.token_rows else pool.shape[self.axes.index("offset")]

    def num_heads(self, pool) -> int:
        return pool.shape[self.axes.index("head")]

    def index(self, pool, entry, offset, kvh, kv: int) -> tuple:
        """Indexers of every axis but the last of `pool` (or of its scale array): the row
        at `offset` within block-table `entry` (int arrays of one shape), kv head `kvh`,
        K (kv 0) or V (1). Entries are clipped into the pool: a corrupt table never reads
        or writes off it."""
        axes = self.axes
        if self.token_rows:
            last = pool.shape[axes.index("token")] - 1
            row = jnp.clip(entry + offset, 0, last)
        else:
            entry = jnp.clip(entry, 0, pool.shape[axes.index("page")] - 1)
        where = {
            "page": lambda: entry,
            "offset": lambda: offset,
            "token": lambda: row,
            "head": lambda: kvh,
            "kv": lambda: jnp.int32(kv),
            "layer": lambda: jnp.int32(self.layer),
        }
        return tuple(where[a]() for a in axes[:-1])


PAGES = PoolLayout()  # our pools: [N, Hkv, P, Dp], entries are page ids


@dataclasses.dataclass(frozen=True)
class CacheFormat:
    """What the pools hold (static).

    dtype: None (float pools, read as they are), "int8", "float8_e4m3fn" or "int4".
    granularity: "tensor" (a float32 `[1]` scale per pool) or "group" (scale pages
      bfloat16 `[N, Hkv, P, G]` beside each pool, G = head_dim // group_size).
    group_size: channels per scale ("group"); 0 when one scale covers the whole row.
    layout: where the rows are in the pools (`PoolLayout`; ours by default).
    """

    dtype: str | None = None
    granularity: str = "tensor"
    group_size: int = 0
    layout: PoolLayout = PAGES

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


def row_scale(scale_ref, fmt: CacheFormat, at, kv: int, t_ok):
    """The per-row scales of `block` tokens, float32 `[block]` (`fmt.row_scales`)."""
    if scale_ref.shape == (1,):  # per tensor
        return jnp.full(t_ok.shape, scale_ref[0], jnp.float32)
    entries, kvh, offsets = at
    index = fmt.layout.index(scale_ref, entries[:, 0], offsets[:, 0], kvh, kv)
    return plgpu.load(scale_ref.at[(*index, jnp.int32(0))], mask=t_ok, other=1).astype(jnp.float32)


def read_kv(
    ref, scale_ref, fmt: CacheFormat, at, kv: int, t_ok, head_dim: int, dtype, asm: bool = False
):
    """One K or V tile of `block` tokens: a tuple of `[block, Pd]` parts of `dtype`,
    dequantized except for row scales (`fmt.row_scales`: the caller applies `row_scale`).
    Codes become bfloat16 values without conversion instructions (`codes.py`; `asm`: on
    the GPU, not in interpret mode); finer groups multiply by their bfloat16 scale in
    bfloat16 (one rounding of the exact product, as the reference's).

    Args:
      ref: the pool (`[N, Hkv, P, Dp]`, or as `fmt.layout` says); scale_ref: None, float32
        `[1]` ("tensor") or the pool's scale pages (`[N, Hkv, P, G]`) ("group").
      at: (block-table entries `[block, 1]`, kv head, offsets `[block, 1]` within the
        entries' pages): where the tokens are.
      kv: 0 reading K, 1 reading V (for layouts holding both in one array).
      t_ok: `[block]`, tokens to read (others read as zeros).
      head_dim: D; each part spans D / parts channels, padded to a power of two of at
        least 16 (Pd, `dot_width`: a dot's contraction needs 16).
    """
    entries, kvh, offsets = at
    index = fmt.layout.index(ref, entries, offsets, kvh, kv)
    part_dim = head_dim // fmt.parts
    dims = jnp.arange(dot_width(part_dim))
    ok = t_ok[:, None] & (dims < part_dim)[None, :]
    other = 0 if jnp.issubdtype(ref.dtype, jnp.integer) else 0.0
    raw = plgpu.load(ref.at[(*index, dims[None, :])], mask=ok, other=other)
    if fmt.dtype is None or fmt.row_scales:
        return tuple(_decode(raw, fmt, dtype, asm))
    exact = jnp.bfloat16 if dtype == jnp.bfloat16 else jnp.float32  # code * bf16 scale
    parts = []
    for p, values in enumerate(_decode(raw, fmt, exact, asm)):
        scale = _group_scale_tile(scale_ref, index, fmt.group_size, p, part_dim, t_ok, ok)
        parts.append((values * scale.astype(exact)).astype(dtype))
    return tuple(parts)


def _group_scale_tile(scale_ref, index, group_size: int, part: int, part_dim: int, t_ok, ok):
    """The scale of each element of part `part` of a `[block, Pd]` tile (columns
    `part * part_dim ...`), from per-group scale pages.

    A row's groups are loaded once, `[block, n]` (n = part_dim / group_size scales,
    contiguous: one vector load), and repeated over their channels in registers. Loading
    the scale per element instead (an index per channel) issued a load instruction per
    value, 16x those of the codes: INT4 with groups of 32 decoded slower than bf16. Parts
    of a width that is no power of two (head dims like 80) keep the per-element load."""
    padded = dot_width(part_dim)
    dims = jnp.arange(padded)
    if padded != part_dim or part_dim % group_size:
        group = (part * part_dim + dims[None, :]) // group_size
        return plgpu.load(scale_ref.at[(*index, group)], mask=ok, other=1)
    n = part_dim // group_size
    cols = part * n + jnp.arange(n)
    row_ok = jnp.broadcast_to(t_ok[:, None], (t_ok.shape[0], n))
    scale = plgpu.load(scale_ref.at[(*index, cols[None, :])], mask=row_ok, other=1)  # [block, n]
    block = scale.shape[0]
    if n == 1:
        return jnp.broadcast_to(scale, (block, part_dim))
    return jnp.broadcast_to(scale[:, :, None], (block, n, group_size)).reshape(block, part_dim)


def read_rows(ref, scale_ref, fmt: CacheFormat, at, kv: int, t_ok, head_dim: int, dtype):
    """One K or V tile `[block, Dp]` of `dtype` in natural channel order, fully dequantized
    (scales applied per element): for kernels whose tile mixes cached and fresh rows.

    Arguments as `read_kv`, except `t_ok` may be None: every row is read. Dp = D padded to
    a power of two (columns past D read as 0). Without a mask (t_ok None and D a power of
    two) the loads vectorize along D. INT4 reads each byte twice (for channel j and
    j + D/2) and picks the nibble, so the tile needs no interleaving.
    """
    entries, kvh, offsets = at
    index = fmt.layout.index(ref, entries, offsets, kvh, kv)
    dims = jnp.arange(next_power_of_2(head_dim))
    ok = None
    if t_ok is not None:
        ok = t_ok[:, None]
    if len(dims) != head_dim:
        ok = (dims < head_dim)[None, :] if ok is None else ok & (dims < head_dim)[None, :]
    if ok is not None:
        ok = jnp.broadcast_to(ok, (entries.shape[0], len(dims)))

    def load(x_ref, cols, other):
        return plgpu.load(x_ref.at[(*index, cols[None, :])], mask=ok,
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
