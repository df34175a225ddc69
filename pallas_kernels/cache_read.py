"""Reading K/V tiles from the page pools inside the decode kernel, dequantized on load.

A step of the kernel reads the rows of `block_kv` cached tokens of one kv head, wherever
their pages are, and hands the dot products values in the query's dtype. Quantized pools
(formats: `jaxattn.quant`) are dequantized in registers; no dequantized copy of the cache
ever exists in HBM. A scale that is constant along a row (per tensor, or per token and
head: per-group scales with `group_size = head_dim`), or along each part's row (INT4 in
groups of D/2), is factored out of the tile: the stored integers (exact in bf16) go
straight to the dot, and the scale multiplies the logits (K) or the probabilities (V) of
that token, `[block]` values instead of `[block, D]` (per part: each of its tiles' dots). Finer
groups are applied per element: `(stored as float32) * scale`, rounded once to the
query's dtype, as the reference does. Scales are loaded apart from their tile
(`load_scales`), so that a kernel can issue them a step ahead.

INT4 rows hold channel j in the low nibble and channel j + D/2 in the high nibble of byte
j, so a tile comes out as two halves ("parts"): channels `[0, D/2)` and `[D/2, D)`. The
kernel keeps the query and the output in the same parts (dots per part, summed), so the
nibbles never need interleaving.

Head dims that are no power of two may be read in segments (`reads_segments`): each part's
channels as runs of power-of-two widths (96 = 64 + 32), a dot each, rather than one tile
padded to the next power of two (128), whose padding the kernel would convert and
multiply for nothing. A "tile" below is one dot's columns: a part, or a segment of one
(`dot_columns`); one load of stored columns gives a tile per part (INT4: two).

V tiles may instead be read as words of four codes (`read_words`; 8-bit codes: 32-bit
words of four channels, INT4: 16-bit half-words of two bytes): the PV dot then runs in four
parts of strided channels (`word_columns`), whose outputs the kernel stores to those
channels. INT4 K tiles may be read so too, the query then loaded in the same parts.

Where rows are (`PoolLayout`): our pools are `[N, Hkv, P, Dp]` pages, a block-table
entry a page id; OpenPPL's caches are one array of token rows holding K and V of every
layer (e.g. `[MaxT, L, 2, H, Dh]`), a block-table entry the token offset where a page
starts. A layout names the pool's axes, and every read and the kernels' page arithmetic
go through it: each layout is read in place, with no relayout of the cache.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.codes import codes_to_bf16, int4_nibbles, words_to_values
from pallas_kernels.common import dot_width

_SEGMENTS_8BIT_GROUP_BELOW = 32  # 8-bit groups read in segments: narrower than this
_FACTORED_SEGMENTS = 2  # factored scales read in segments: at most this many
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

    @property
    def one_group_a_row(self) -> bool:
        """Per-group scales with one group a row: a scale per token and head."""
        return self.dtype is not None and self.granularity == "group" and self.group_size == 0

    def part_scales(self, head_dim: int) -> bool:
        """One scale along each part's row: groups of a whole part or more (INT4 in groups
        of D/2; a group of D given as such)."""
        part_dim = head_dim // self.parts
        return (
            self.dtype is not None
            and self.granularity == "group"
            and self.group_size > 0
            and self.group_size % part_dim == 0
        )

    def factored(self, head_dim: int) -> bool:
        """Scales constant along a part's row: factored out of the tiles (module doc)."""
        return self.row_scales or self.part_scales(head_dim)


PLAIN = CacheFormat()  # float pools, no scales


def ring_position(t, ring: tuple[int, int] | None):
    """Where position `t` (int array, >= 0) is stored in a sequence's pages: `t` itself, or
    in a cyclic cache `ring = (kept, size)`: positions below `kept` (sink tokens) stay put,
    later ones cycle through the next `size` places (`jaxattn.manager`, window caches)."""
    if ring is None:
        return t
    kept, size = ring
    return jnp.where(t < kept, t, kept + (jnp.maximum(t - kept, 0) % size))


def column_segments(width: int) -> tuple[tuple[int, int], ...]:
    """(first column, width) of the runs a part of `width` channels is read in with
    segments: power-of-two widths, widest first, down to 16; what is left below 16 is
    the last run, padded to 16 for its dot (80 -> 64 + 16, 96 -> 64 + 32, 40 -> 32 + 8,
    108 -> 64 + 32 + 12); one run when that pads no less than one tile of the part
    (`dot_width`: 24 -> 16 + 8 would pad to 32 all the same; 120 -> 64 + 32 + 16 + 8 to
    128)."""
    runs, start = [], 0
    while start < width:
        rest = width - start  # below 16: the last run, padded to 16 for its dot
        run = rest if rest < 16 else 1 << (rest.bit_length() - 1)
        runs.append((start, run))
        start += run
    if sum(dot_width(w) for _, w in runs) >= dot_width(width):
        return ((0, width),)
    return tuple(runs)


def dot_columns(fmt: CacheFormat, head_dim: int, segmented: bool = False) -> tuple:
    """(first channel, width) of each tile a K or V row is read in, in the order `read_kv`
    gives them: one per part (INT4: the low nibbles' channels `[0, D/2)`, then the high
    ones'), or with `segmented` one per segment of a part (`column_segments`), segments
    outer, parts inner. A tile's stored columns start at its first channel's place within
    its part (INT4: the byte holding it)."""
    part_dim = head_dim // fmt.parts
    runs = column_segments(part_dim) if segmented else ((0, part_dim),)
    return tuple((p * part_dim + start, width) for start, width in runs for p in range(fmt.parts))


def reads_segments(fmt: CacheFormat, head_dim: int) -> bool:
    """Whether this format's rows are read in segments (`column_segments`) where the
    config asks for them: quantized pools (float pools are read at the memory's pace
    either way) whose part width `column_segments` splits (no power of two, and split
    it pads less than one tile), with scales that are factored or
    whose groups tile every segment (else the scales come per element, as without
    segments), but 8-bit codes in groups of 32 channels or more, which ran slower so
    (H100, B64 ctx16384 D96, groups of 32: INT8 1.14 against 1.07 ms, FP8 1.09 against
    0.93; probes of 2026-11-27 11:25-11:48 UTC, bench/HISTORY.md; wider groups and other
    head dims not measured), and factored scales over more than two segments, which ran
    slower than the one tile padded by an eighth (INT8 per tensor at D112 = 64 + 32 + 16,
    B64 ctx16384 0.911 against 0.776 ms, B8 ctx8192 0.073 against 0.061; probe of
    2026-11-27 13:25 UTC; INT4 at such head dims, 176 or 208, not measured). `read_kv`
    and `load_scales` take `segmented` only where this holds: groups that tile no
    segment would load misaligned scales."""
    part_dim = head_dim // fmt.parts
    runs = column_segments(part_dim)
    if fmt.dtype is None or len(runs) == 1:
        return False
    if fmt.factored(head_dim):
        return len(runs) <= _FACTORED_SEGMENTS
    if fmt.dtype != "int4" and fmt.group_size >= _SEGMENTS_8BIT_GROUP_BELOW:
        return False
    return not any(_per_element(fmt.group_size, width) for _, width in runs)


def _decode(raw, fmt: CacheFormat, dtype, asm: bool, biased: bool = False) -> list:
    """Stored columns `[block, Pd]` -> value tiles of `dtype` (unscaled), one per part
    (`biased`: INT4 values plus INT4_BIAS)."""
    if fmt.dtype is not None and dtype == jnp.bfloat16:
        return codes_to_bf16(raw, fmt.dtype, asm=asm, biased=biased)
    return int4_nibbles(raw, dtype, biased) if fmt.dtype == "int4" else [raw.astype(dtype)]


def load_scales(scale_ref, fmt: CacheFormat, at, kv: int, t_ok, head_dim: int,
                segmented: bool = False):  # fmt: skip
    """The stored scales a tile of `block` tokens needs, loaded apart from the tile (a
    kernel issues them a step ahead of their use: loads that feed no dot are not
    pipelined by Triton, and a scale load waited on in every step held the per-row and
    per-group formats far below the per-tensor ones).

    Returns None (plain pools; per tensor: `factored_scales` reads the scalar); with scales
    factored out of the tiles (`fmt.factored`) the `[block]` row scales as stored, or per
    tile its part's own (`fmt.part_scales`); with finer groups, per tile, the row's groups
    `[block, Pd / group size]` (those past the tile's width masked, as 1) for `read_kv`
    to repeat over their channels, or, for groups that do not divide Pd (the tile's
    width padded to a power of two), each element's scale `[block, Pd]`.

    Args:
      scale_ref: None (plain pools), float32 `[1]` ("tensor") or the pool's scale pages
        (`[N, Hkv, P, G]`, or as `fmt.layout` says) ("group").
      at, kv, t_ok, head_dim, segmented: as `read_kv`."""
    if fmt.dtype is None or scale_ref.shape == (1,):
        return None
    entries, kvh, offsets = at
    tiles = dot_columns(fmt, head_dim, segmented)
    if fmt.factored(head_dim):
        index = fmt.layout.index(scale_ref, entries[:, 0], offsets[:, 0], kvh, kv)
        load = lambda g: plgpu.load(scale_ref.at[(*index, jnp.int32(g))], mask=t_ok, other=1)  # noqa: E731
        if fmt.row_scales:
            return load(0)
        return tuple(load(first // fmt.group_size) for first, _ in tiles)
    index = fmt.layout.index(scale_ref, entries, offsets, kvh, kv)
    return tuple(
        _group_scales(scale_ref, index, fmt.group_size, first, width, t_ok)
        for first, width in tiles
    )


def factored_scales(scale_ref, scales, t_ok):
    """The factored scales of `block` tokens (`fmt.factored`), float32 `[block]`, or a
    tuple of them per tile (each its part's), from the per-tensor `scale_ref` or what
    `load_scales` gave (`scales`)."""
    if scales is None:  # per tensor
        return jnp.full(t_ok.shape, scale_ref[0], jnp.float32)
    if isinstance(scales, tuple):
        return tuple(x.astype(jnp.float32) for x in scales)
    return scales.astype(jnp.float32)


def scaled_sum(dots, part_scales=None):
    """The sum of the tiles' logits `[rows, block]`, each times its `[block]` scales
    (`part_scales`: None, or one per tile, its part's)."""
    if part_scales is None:
        return sum(dots)
    return sum(s * c[None, :] for s, c in zip(dots, part_scales, strict=True))


def read_kv(ref, fmt: CacheFormat, at, kv: int, t_ok, head_dim: int, dtype, scales=None,
            asm: bool = False, biased: bool = False, unscaled: bool = False,
            segmented: bool = False):  # fmt: skip
    """The K or V rows of `block` tokens: a tuple of `[block, Pd]` tiles of `dtype`, one
    per part or, `segmented`, per segment of a part (`dot_columns`), dequantized except
    for factored scales (`fmt.factored`: the caller applies `factored_scales`).
    Codes become bfloat16 values without conversion instructions (`codes.py`; `asm`: on
    the GPU, not in interpret mode); finer groups multiply by their bfloat16 scale in
    bfloat16 (one rounding of the exact product, as the reference's).

    Args:
      ref: the pool (`[N, Hkv, P, Dp]`, or as `fmt.layout` says).
      at: (block-table entries `[block, 1]`, kv head, offsets `[block, 1]` within the
        entries' pages): where the tokens are.
      kv: 0 reading K, 1 reading V (for layouts holding both in one array).
      t_ok: `[block]`, tokens to read (others read as zeros).
      head_dim: D; each part spans D / parts channels, padded to a power of two of at
        least 16 (Pd, `dot_width`: a dot's contraction needs 16); with `segmented`, each
        segment of a part so (`column_segments`).
      scales: finer groups: what `load_scales` gave for these tokens (with the same
        `segmented`).
      biased: INT4 with factored scales, or `unscaled`: the values plus `codes.INT4_BIAS`
        (the caller takes `INT4_BIAS * sum(q)` off the logits; the decode kernel's
        `biased_keys`).
      unscaled: the codes' values whatever the scales (the caller applies them: the
        decode kernel's stacked rows, `paged_decode.stacked`).
    """
    entries, kvh, offsets = at
    index = fmt.layout.index(ref, entries, offsets, kvh, kv)
    other = 0 if jnp.issubdtype(ref.dtype, jnp.integer) else 0.0
    scaled = not (fmt.dtype is None or fmt.factored(head_dim) or unscaled)
    exact = jnp.bfloat16 if dtype == jnp.bfloat16 else jnp.float32  # code * bf16 scale
    columns = dot_columns(fmt, head_dim, segmented)
    tiles = []
    for first, width in columns[:: fmt.parts]:  # a load a segment: a tile per part
        dims = jnp.arange(dot_width(width))
        ok = t_ok[:, None] & (dims < width)[None, :]
        raw = plgpu.load(ref.at[(*index, first + dims[None, :])], mask=ok, other=other)
        tiles += _decode(raw, fmt, exact if scaled else dtype, asm, biased)  # a tile a part
    if not scaled:
        return tuple(tiles)
    return tuple(
        (values * _spread(scale, fmt.group_size, width).astype(exact)).astype(dtype)
        for values, scale, (_, width) in zip(tiles, scales, columns, strict=True)
    )


def _group_scales(scale_ref, index, group_size: int, first: int, width: int, t_ok):
    """The scales of a tile's rows (`width` channels from channel `first`, a part or a
    segment of one) from per-group scale pages: `[block, n]`, a row's n = width /
    group_size groups (one vector load: contiguous), which `_spread` repeats over their
    channels in registers.
    Loading the scale per element instead (an index per channel) issued a load
    instruction per value, 16x those of the codes: INT4 with groups of 32 decoded slower
    than bf16. A tile of a width that is no power of two loads its groups padded to the
    dot's width, `[block, Pd / group_size]`, the groups past the tile masked (scale 1;
    their codes read as 0): INT8 at D 96 in groups of 8, B64 ctx16384, 1.06 ms against
    1.94 per element (read unsegmented). Groups that do not tile the padded width keep
    the per-element load (`[block, Pd]`)."""
    if _per_element(group_size, width):
        dims = jnp.arange(dot_width(width))
        group = (first + dims[None, :]) // group_size
        ok = t_ok[:, None] & (dims < width)[None, :]
        return plgpu.load(scale_ref.at[(*index, group)], mask=ok, other=1)
    n, loaded = width // group_size, dot_width(width) // group_size
    cols = first // group_size + jnp.arange(loaded)
    ok = jnp.broadcast_to(t_ok[:, None], (t_ok.shape[0], loaded))
    if loaded > n:  # a padded tile (no power of two): its groups past the tile masked
        ok = ok & (jnp.arange(loaded) < n)[None, :]
    return plgpu.load(scale_ref.at[(*index, cols[None, :])], mask=ok, other=1)


def _per_element(group_size: int, width: int) -> bool:
    """Tiles whose groups are loaded per element (`_group_scales`): groups that do not tile
    the tile's `width` channels, or its dot's width (a power of two)."""
    return width % group_size != 0 or dot_width(width) % group_size != 0


def scales_per_element(fmt: CacheFormat, head_dim: int, segmented: bool = False) -> bool:
    """A tile's scales come one per element (`[block, Pd]` a tile): too many registers to
    carry from one step to the next (`load_scales`)."""
    return (
        fmt.dtype is not None
        and fmt.granularity == "group"
        and not fmt.factored(head_dim)
        and any(_per_element(fmt.group_size, w) for _, w in dot_columns(fmt, head_dim, segmented))
    )


def _spread(scales, group_size: int, width: int):
    """`_group_scales`' tile -> the scale of each element of a tile of `width` channels,
    `[block, Pd]`."""
    if _per_element(group_size, width):
        return scales
    block, n = scales.shape  # n >= 1 (groups of a whole part are factored: `part_scales`)
    spread = jnp.broadcast_to(scales[:, :, None], (block, n, group_size))
    return spread.reshape(block, n * group_size)  # n * group_size = Pd


def read_rows(ref, scale_ref, fmt: CacheFormat, at, kv: int, t_ok, head_dim: int, dtype):
    """One K or V tile `[block, Dp]` of `dtype` in natural channel order, fully dequantized
    (scales applied per element): for kernels whose tile mixes cached and fresh rows.

    Arguments as `read_kv`, except `t_ok` may be None: every row is read. Dp = D padded to
    a power of two of at least 16 (`dot_width`; columns past D read as 0). Without a mask
    (t_ok None and D a power of two) the loads vectorize along D. INT4 reads each byte
    twice (for channel j and j + D/2) and picks the nibble, so the tile needs no
    interleaving.
    """
    entries, kvh, offsets = at
    index = fmt.layout.index(ref, entries, offsets, kvh, kv)
    dims = jnp.arange(dot_width(head_dim))
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


def reads_v_words(fmt: CacheFormat, head_dim: int) -> bool:
    """V tiles of this format can be read as words of four codes (`read_words`): 8-bit
    codes or INT4, D / 4 a power of two of at least 16 (a dot's width), and scales a word's
    codes share: one a row, or groups of a multiple of 4 channels (8-bit), or INT4 groups
    of an even number of channels that tile a half row, or one a half row. (An 8-bit group
    of D given as such, which `jaxattn` stores as one a row, reads codes: its scales come
    per part.)"""
    width = head_dim // 4
    if head_dim % 4 or dot_width(width) != width:
        return False
    if fmt.dtype == "int4":
        group = fmt.group_size
        return fmt.factored(head_dim) or (group % 2 == 0 and (head_dim // 2) % group == 0)
    return (
        fmt.dtype in ("int8", "float8_e4m3fn")
        and not fmt.part_scales(head_dim)
        and (fmt.row_scales or fmt.group_size % 4 == 0)
    )


def word_columns(fmt: CacheFormat, head_dim: int) -> list:
    """The channels of each part `read_words` gives, `[1, D / 4]`: part c, 4j + c (8-bit
    codes); INT4, whose half-word j holds bytes 2j and 2j + 1 (channels 2j, 2j + 1 in their
    low nibbles, 2j + D/2, 2j + 1 + D/2 in their high ones), 2j + c % 2 + (c // 2) * D/2."""
    j = jnp.arange(head_dim // 4)[None, :]
    if fmt.dtype == "int4":
        return [2 * j + c % 2 + (c // 2) * (head_dim // 2) for c in range(4)]
    return [4 * j + c for c in range(4)]


def word_view(pool, fmt: CacheFormat):
    """A pool `[..., Dp]` as words of four codes `[..., D / 4]` (`read_words`): int32 of
    four bytes, or for INT4 int16 of two (bytes hold two codes)."""
    per_word = 2 if fmt.dtype == "int4" else 4
    word = jnp.int16 if fmt.dtype == "int4" else jnp.int32
    shape = (*pool.shape[:-1], pool.shape[-1] // per_word, per_word)
    return jax.lax.bitcast_convert_type(pool.reshape(shape), word)


def word_part_scales(v_scale):
    """Factored V scales for the four word parts: as they are (one a row), or INT4's per
    half row (`fmt.part_scales`, a pair) as parts 0, 1 (low nibbles) and 2, 3 need them."""
    if isinstance(v_scale, tuple):
        low, high = v_scale
        return (low, low, high, high)
    return v_scale


def read_words(ref, fmt: CacheFormat, at, t_ok, head_dim: int, dtype, scales=None,
               asm: bool = False, unscaled: bool = False, kv: int = 1,
               biased: bool = False):  # fmt: skip
    """A V (or INT4 K) tile of `block` tokens read as words from `ref` (the pool viewed as
    `[..., D / 4]` words of four codes, `word_view`: int32 for 8-bit codes, int16 for
    INT4): four parts `[block, D / 4]` of `dtype`, holding the channels `word_columns`
    says, dequantized except for factored scales (`word_part_scales`). `at`, `t_ok`,
    `head_dim`, `dtype`, `kv` (1: V, 0: K): as `read_kv`; `scales`: what `load_scales`
    gave for this pool (finer groups: a tuple of `[block, groups]`, one per half row for
    INT4); `unscaled`: the codes' values whatever the scales, as `read_kv`'s; `biased`:
    INT4 values plus `codes.INT4_BIAS`, with factored scales or `unscaled` only.

    Why: the PV dot takes V as its B operand, which wants two consecutive tokens of one
    channel in a register. Read as codes `[block, D]`, Triton gathers those with a
    shared-memory load per byte (ldmatrix cannot transpose 8-bit elements); read as
    words, one load serves four channels and a byte permute (INT8, FP8) or a shift (INT4)
    pairs two tokens' codes (H100, B64 ctx16384: INT8 per tensor 0.81 -> 0.77 ms, groups
    of 8 1.16 -> 0.98; bench/HISTORY.md, probes of 2026-11-26 09:32-09:41 UTC)."""
    if biased and not (fmt.factored(head_dim) or unscaled):
        raise ValueError("read_words: biased values need factored scales or unscaled")
    entries, kvh, offsets = at
    index = fmt.layout.index(ref, entries, offsets, kvh, kv)
    width = head_dim // 4
    raw = plgpu.load(ref.at[(*index, jnp.arange(width)[None, :])], mask=t_ok[:, None], other=0)
    if fmt.factored(head_dim) or unscaled:  # the codes' values; the caller applies the scales
        asm = asm and dtype == jnp.bfloat16
        return tuple(words_to_values(raw, fmt.dtype, dtype, asm=asm, biased=biased))
    exact = jnp.bfloat16 if dtype == jnp.bfloat16 else jnp.float32  # code * bf16 scale
    parts = words_to_values(raw, fmt.dtype, exact, asm=asm and exact == jnp.bfloat16)
    if fmt.dtype == "int4":  # a half-word's two channels share a group: g / 2 words a scale
        part_scales = word_part_scales(
            tuple(_spread(x, fmt.group_size // 2, width).astype(exact) for x in scales)
        )
    else:
        part_scales = (_spread(scales[0], fmt.group_size // 4, width).astype(exact),) * 4
    return tuple((p * x).astype(dtype) for p, x in zip(parts, part_scales, strict=True))
