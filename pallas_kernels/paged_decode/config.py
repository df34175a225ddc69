"""Tiling and split-K ("multi-block") choice of the paged decode kernel."""

from __future__ import annotations

import dataclasses

from pallas_kernels.cache_read import PAGES, CacheFormat, reads_segments, reads_v_words
from pallas_kernels.common import device_sm_count, next_power_of_2

_DEFAULT_SM_COUNT = 132  # H100 SXM; read from the device when it says
_RESIDENT_PER_SM = 4  # 64x4x3 programs an SM holds at once (128 registers per thread)
_LONG_CONTEXT = 8192  # tables this long split into about 16 programs per SM
_LONG_PROGRAMS_PER_SM = 16
# 8-bit caches (V read as words) with >= one program per SM: (code, channels a scale; 0 per
# tensor) that ran best in 4 stages, and the group size run in 64-token blocks of 2 warps.
_FOUR_STAGES = {("int8", 0), ("float8_e4m3fn", 0), ("int8", 16), ("float8_e4m3fn", 32)}
_SMALL_BLOCK_GROUP = 8
_INT4_ROW_PROGRAMS_PER_SM = 4  # INT4 with a scale per tensor or row, < one program per SM
_FEW_ROWS = 8  # query rows of the formats `few_rows` names
_FEW_ROWS_8BIT_GROUPS = (8, 16, 64)  # the 8-bit group sizes among them
_STACKED_ROWS = 8  # the most stacked query rows (groups x rows) the heuristic takes
_SHORT_DIM = 64  # quantized caches up to this head dim: one tiling (`heuristic`)
_FOUR_ROW_GROUP = 16  # INT4 groups of 16, K read as half-words: 4 query rows on our pages
# INT8 groups run in 64-token blocks of 2 warps at head dims of no power of two from
# _ODD_DIM_SMALL_BLOCK_FROM (`_odd_dim_small_blocks`)
_ODD_DIM_SMALL_BLOCK_GROUPS = (8, 16)
_ODD_DIM_SMALL_BLOCK_FROM = 96
_ODD_DIM_INT4_SMALL_BLOCK_BELOW = 192  # INT4 per tensor runs them so below this head dim
_ODD_DIM_INT4_PADDED_BELOW = 128  # and, with fewer programs than SMs, reads padded below this


@dataclasses.dataclass(frozen=True)
class PagedDecodeConfig:
    """Tiling of `paged_decode`: hashable, passed as a static argument.

    Attributes:
      block_kv: cached tokens per inner-loop step (a power of two >= 16; may span several
        small pages or part of a large one).
      num_splits: the context is cut into this many chunks, each a program of its own,
        combined afterwards through their log-sum-exps (split-K / "multi-block" mode).
      num_warps, num_stages: Triton launch parameters.
      v_words: quantized caches read V as words of four codes (INT8, FP8: 32-bit words;
        INT4: 16-bit half-words), dequantized into four parts of strided channels
        (`cache_read.read_words`); ignored for float caches and for head dims and
        groups where words cannot apply (`cache_read.reads_v_words`).
      query_rows: the kv group's query rows are padded to at least this many (4, 8 or
        16; to a power of two of at least the group in any case) for the kernel's dots:
        every elementwise step of the softmax runs over the padded rows.
      stacked: group scales finer than a part's row are applied through stacked query rows
        (`paged_decode.stacked`: one row block per group, the scales multiplying logits and
        probabilities) rather than per cached value; with V read as words, no rope on read
        (`paged_decode.stacked.stacks`); ignored otherwise.
      k_words: INT4 caches read K as 16-bit half-words as well (with `v_words`), the query
        loaded in the same four parts of strided channels: a shift and a logic operation
        a value pair, where K read as bytes also takes a byte permute. Ignored for other
        formats, with stacked rows and with rope on read.
      segments: quantized caches whose head dim (INT4: half of it) is no power of two read
        each row in segments of power-of-two widths, a dot each (96 = 64 + 32), rather
        than one tile padded to the next power of two, where that pads less
        (`cache_read.column_segments`: not 120) and the scales allow it
        (`cache_read.reads_segments`); not with V read as words nor with rope on read.
    """

    block_kv: int = 64
    num_splits: int = 1
    num_warps: int = 4
    num_stages: int = 3
    v_words: bool = True
    query_rows: int = 16
    stacked: bool = False
    k_words: bool = False
    segments: bool = True

    def __post_init__(self):
        if self.block_kv < 16 or self.block_kv & (self.block_kv - 1):
            raise ValueError(
                f"PagedDecodeConfig: block_kv={self.block_kv} must be a power of 2 >= 16"
            )
        if self.num_splits < 1:
            raise ValueError(f"PagedDecodeConfig: num_splits={self.num_splits} must be >= 1")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(
                f"PagedDecodeConfig: num_warps={self.num_warps} not a power of 2 <= 16"
            )
        if self.num_stages < 1:
            raise ValueError(f"PagedDecodeConfig: num_stages={self.num_stages} must be >= 1")
        if self.query_rows not in (4, 8, 16):
            raise ValueError(f"PagedDecodeConfig: query_rows={self.query_rows} not 4, 8 or 16")

    @classmethod
    def heuristic(
        cls,
        batch: int,
        num_kv_heads: int,
        max_context: int,
        page_size: int,
        sm_count=None,
        *,
        code: str | None = None,
        row_scales: bool = False,
        group_size: int = 0,
        v_words: bool = True,
        pages: bool = True,
        head_dim: int = 0,
        query_group: int = 0,
        rope_on_read: bool = False,
    ) -> PagedDecodeConfig:
        """Split the context when `batch * num_kv_heads` programs cannot fill the GPU.

        Tuned on an H100 (bench/HISTORY.md, decode sweeps; bf16, D 128, pages of 16):
        - >= one program per SM, contexts of 8192 and more: 128-token blocks in 2 stages,
          split into about 16 programs per SM (B32: 8 splits, B64: 4) as long as a split
          holds at least 1024 tokens. Programs of equal chunks then keep every SM busy to
          the end with ragged lengths: B64 ctx16384 ragged 797 against 870 us unsplit,
          B64 ctx8192 ragged 410 against 466, B32 ctx16384 ragged 386 against 409 (two
          splits); uniform lengths pay 0.6-2.3% (sweep of 2026-11-22 22:29 UTC).
          `max_context` is the tables' capacity: rows much shorter than it get short
          chunks (4 splits of B64 rows of 2048 tokens: 202 against 190 us).
        - >= one program per SM, shorter contexts: 64-token blocks, 3 stages (2.9 TB/s at
          B64), split as far as all programs stay resident at once (4 per SM): B32 gets 2
          splits (ragged lengths 16-18% faster, uniform -2% to +2%); B48 and B64 none
          (splits cost 3-5% at B64 ctx2048-4096 with uniform lengths, and ragged B256
          ctx2048 ran best unsplit too).
        - fewer: about two programs per SM through split-K, each split streaming at least
          two 128-token blocks (the split's start-up and the combine pass then stay
          small); 128-token blocks in 2 stages were best with ragged lengths (B8 ctx8192:
          65 against 68-70 us for 64-token tilings) and within 3% of the best otherwise
          (64x2x3: 99 against 102 us with uniform lengths; sweep of 2026-11-22 20:42-21:37 UTC).
        - quantized caches (`code`: "int8", "float8_e4m3fn", "int4"; in-kernel
          dequantization): 128-token blocks and at least two splits were best for every
          format at B64 ctx16384 (up to 1.35x over 64x4x3 unsplit; sweep of 2026-11-22
          14:51 UTC); 3 stages, with the kernel's table entries and scales loaded a step
          ahead (INT8 per tensor 0.81 ms against 0.90 in 2 stages, groups of 8 1.15
          against 1.28, INT4 per tensor 0.54 against 0.55 in 4 stages; 128x8 and 256x8
          tilings 1.2-1.7x slower; probes of 2026-11-26, bench/HISTORY.md).
          INT8 and FP8 read V as words (`v_words`), 128-token blocks in 4 warps (probes
          of 2026-11-26 09:32-09:41 UTC; B64 ctx16384 against codes read as bytes: INT8
          per tensor 0.77 against 0.81 ms, groups of 32 0.88 against 0.99, one group a row
          0.80 against 0.98 in its former 64x2 tiling; FP8 per tensor 0.78 against 0.82;
          B8 ctx8192 10-26% faster, but for FP8 groups of 16 and 64 and INT8 groups of
          16, within 3%). With >= one program per SM
          (`group_size`: channels a scale, 0 per tensor or, with `row_scales`, one a row):
          groups of 8 in 64-token blocks of 2 warps (INT8 0.98 against 1.03 ms, FP8 0.96
          against 0.99), and 4 stages where they ran best (probes of 09:53-09:57 UTC; 5-28%
          slower for the other group sizes, no faster at B8): per tensor (INT8 0.756 against
          0.778, FP8 0.758 against 0.787), INT8 groups of 16 (0.926 against 1.019), FP8
          groups of 32 (0.900 against 0.959-1.065). INT4 reads V as 16-bit half-words of
          four nibbles in 128-token blocks of 4 warps, 3 stages (probe of 2026-11-26 11:50
          UTC, B64 ctx16384 against V read as bytes: per tensor 0.439 against 0.542 ms,
          groups of 8 0.703 against 0.804, of 32 0.618 against 0.725, one a row 0.502
          against 0.598; B8 ctx8192 up to 18% faster, groups of 64 equal; 64x2x3, 64x4x3
          and 128x4x4 tilings as fast or slower but for groups of 64 in 4 stages, 1%
          faster). (32-bit words of eight nibbles, in eight parts, ran 1.4-6x slower.)
          INT4 reads K as half-words too (`k_words`) but with stacked rows, and groups of
          8 only with >= one program per SM (probes of 2026-11-27
          03:47-03:52 UTC, bench/HISTORY.md; B64 ctx16384 against K read as bytes: per
          tensor 0.408-0.412 against 0.439-0.446 ms, one a row 0.454 against 0.472 (its
          keys then read biased), groups of 16 0.588 against 0.605, groups of 8 in 4
          stages 0.632-0.638 against 0.675; B8 ctx8192 0.035 / 0.039 / 0.050 against
          0.037 / 0.041 / 0.053 ms, groups of 8 there 0.053-0.058 against 0.051; head
          dims 64 and 256 alike, 0-22% faster, probe of 04:01 UTC). Groups of 16 so pad
          their query rows to 4, not 8 (probes of 04:08-04:10 UTC: B64 ctx16384 0.550
          against 0.596 ms, B32 ctx16384 0.292 against 0.322, B8 ctx8192 0.047 against
          0.049). Groups of 64 (one a half row): 0.483 against 0.494 ms at B64, 0.048
          either way at B8 (probe of 04:19 UTC, once the two halves' logits were summed
          before their scales; 13% slower before). Groups of 32 stay on stacked rows
          (0.511 against 0.555 ms).
          `v_words`: whether this cache's V can be read as words (`reads_v_words`: D / 4
          a power of two >= 16, and scales that a word's codes share). Where it cannot,
          INT8 with one scale a row keeps 64-token blocks in 2 warps, 9-13% faster with
          V read as codes (B64 ctx16384 0.965 against 1.109 ms; probes of 2026-11-26 03:55
          and 04:25 UTC); at head dims of no power of two over our pages only with >= one
          program per SM (fewer: 128x4x3, below).
          Splits: as many as run two to an SM in one wave (two 128-token programs
          of 3 stages fit an SM), not one more: B8 ctx8192 (64 programs) in 4 splits
          against 5: INT8 per tensor 0.063 against 0.070 ms, groups of 8 0.088 against
          0.119, INT4 0.046 against 0.049, INT4 groups of 32 0.061 against 0.065, FP8
          groups of 32 0.080 against 0.081 (8-16 splits within 7% of the best; probe of
          06:15 UTC).
          With one scale per token and head (`row_scales`) 4 splits ran slower (the
          decode_quant run of 06:20 UTC: INT8 0.104 against 0.089 ms, FP8 0.080 against
          0.077, INT4 0.059 against 0.054): those keep about two programs an SM.
          But INT4 per tensor or with one scale a row (`group_size` 0) with V read as
          half-words and fewer programs than SMs: about four programs an SM (probes of
          12:47-12:50 and 12:51-12:54 UTC; per tensor / one a row against the former
          splits: B8 ctx8192 0.035 / 0.044 against 0.037 / 0.050 ms, B16 ctx8192 0.062 /
          0.076 against 0.066 / 0.083, B4 ctx16384 0.038 / 0.044 against 0.039 / 0.051, B8
          ctx32768 0.117 / 0.141 against 0.128 / 0.163).
          INT4 groups and INT8 ran as fast or slower with more splits.
          Query rows padded to 8 rather than 16 for the formats `few_rows` names, over our
          pages (`pages`; OpenPPL's layouts keep 16 above D 64), and to 4 for INT4 groups of
          16 with K read as half-words (above). INT4 with two groups a half row
          (groups of 32 at D 128) applies its scales through stacked rows, 4 query rows
          (`stacked_groups`; `head_dim` and `query_group`, the query heads a kv head
          serves, decide it; 0: not known, not stacked).
          `rope_on_read`: the kernel rotates keys as it reads them, which it does with K
          read as bytes and group scales per value: no K half-words, no stacked rows; and
          its float32 rotation tables take shared memory per stage: at most 64-token
          blocks, one stage (128 keys in 2 stages asked for 336 KiB with float32 queries
          on an H100).
          Head dims up to 64 (`head_dim`; 0: not known), every quantized format and layout:
          at most 8 query rows; with >= one program per SM, 64-token blocks in 2 warps, 3
          stages; fewer programs, 128-token blocks in 4 warps, 3 stages, 4 rows with group
          scales. 16 rows ran 2.5-4.5x slower at D 64 (probes of 2026-11-27 09:20-09:40 UTC,
          bench/HISTORY.md; B64 ctx16384, this tiling against the former: INT8 per tensor
          0.390 against 1.188 ms, FP8 0.389 against 1.419, INT8 groups of 32 0.431 against
          1.729, one a row 0.405 against 1.740, FP8 groups of 32 0.427 against 1.923, INT4
          per tensor 0.260 against 0.854, groups of 8 / 16 / 32 / one a row 0.365 / 0.332 /
          0.308 / 0.275 against 0.481 / 0.406 / 0.380 / 0.347, INT8 groups of 16 0.444
          against 0.627, 8-bit groups of 8 the same 0.48; B8 ctx8192 INT8 / FP8 / INT4 per
          tensor 0.037 / 0.040 / 0.025 against 0.093 / 0.109 / 0.061, groups of 32 INT8
          0.048 against 0.123; the OpenPPL op's decode step, B32 ctx8192 INT8 groups of 8,
          layouts 0 and 3, 0.54 against 0.57-0.59 ms with 16 rows). At B8, 64-token blocks
          in 2 warps ran 0-8% faster per tensor and 12% with INT4's one scale a row at D 64,
          14% slower with INT8's, 23-42% slower at D 32.
          Head dims above 64 that are no power of two (measured at 80 and 96; V read as codes
          there), over our pages: 8 query rows, and INT4 in groups, and per tensor where read
          in segments (below), with >= one program per SM in 64-token blocks of 2 warps (probe
          of 2026-11-27 10:20 UTC, against the former 128x4x3, 16 rows but for INT4 groups,
          which had 8; B64 ctx16384 D96 / D80: INT8 per tensor 0.738 / 0.738 against 0.787 /
          0.788 ms, INT4 0.500 / 0.496 against 0.544 / 0.540, INT4 groups of 16 / 8 0.751 /
          0.877 against 0.896 / 1.005, INT8 one a row at D96 (64x2x3) 0.918 against 1.057, FP8
          groups of 32 0.922 against 0.974; B8 ctx8192 as fast or up to 10% faster). Rows are
          then read in segments (`segments`; probes of 11:25-11:48 UTC, B64 ctx16384 D96 /
          D80, the heuristic's tiling against the one it took before, rows padded): INT8 per
          tensor 0.641 / 0.583 against 0.749 / 0.748 ms, INT8 groups of 8 0.986 / 0.834
          against 1.060 / 1.129, INT4 per tensor (64x2x3 as INT4 groups; 128x4x3 in segments
          0.479 / 0.476) 0.443 / 0.472 against 0.514 / 0.506, INT4 groups of 8 0.725 / 0.648
          against 0.823 / 0.880, INT4 one a row 0.530 / 0.578 against 0.641 / 0.600; B8
          ctx8192 up to 1.24x faster, but INT4 per tensor at D96 (0.047 against 0.044 ms).
          Re-swept at 80, 96, 112 and 192 (probes of 13:23-13:37 UTC, bench/HISTORY.md;
          the heuristic's new tiling against its former one):
          - with >= one program per SM, INT8 groups of 8 and 16 from D96 in 64-token
            blocks of 2 warps (B64 ctx16384, groups of 8 / 16: D96 0.881 / 0.818 against
            0.985 / 0.873 ms, D112 1.012 / 0.990 against 1.138 / 1.135, D192 1.887 / 1.684
            against 2.024 / 1.874); not at D80 (groups of 8 0.868 against 0.829) nor for
            FP8 (D96 groups of 8 / 16 0.974 / 0.948 against 0.887 / 0.842; D192 slower,
            D112 faster);
          - INT4 per tensor at D192 in 128-token blocks of 4 warps, not 64x2 (0.755
            against 0.817 ms; at D160 64x2x3 stays, 0.776 against 0.804, probe of 14:16
            UTC, which also ran INT8 groups of 8 at D120 / D160 in 64x2x3 1.226 / 1.504
            against 1.325 / 1.574 in 128x4x3);
          - with fewer programs than SMs, INT8 with one scale a row in 128-token blocks of
            4 warps, not 64x2 (B8 ctx8192 D96 / D80 0.060 / 0.056 against 0.074 / 0.075
            ms), and INT4 per tensor with its rows padded, not in segments (D96 0.045
            against 0.049; D80 0.042 against 0.041).
          INT8 with one scale a row at B64 keeps 64x2x3, though 128x4x3 ran faster at D96
          and D112 (0.737 / 0.906 against 0.773 / 1.012 ms) and slower at D80 and D192
          (0.753 / 1.602 against 0.723 / 1.525).
        The page size does not matter: a block gathers its rows from any pages.
        """
        del page_size  # (kept in the signature: a kernel reading whole pages would use it)

        def tiling(block_kv, num_splits, num_warps, num_stages, **kw):  # rope on read: capped
            if rope_on_read:
                block_kv, num_stages = min(block_kv, 64), 1
            return cls(block_kv, num_splits, num_warps, num_stages, **kw)

        sm_count = sm_count or device_sm_count(_DEFAULT_SM_COUNT)
        programs = max(1, batch * num_kv_heads)  # (an empty batch still gets a tiling)
        many = programs >= sm_count  # at least one program per SM
        if many and code is None:
            if max_context >= _LONG_CONTEXT:
                splits = min(_LONG_PROGRAMS_PER_SM * sm_count // programs, max_context // 1024)
                if splits > 1:
                    return tiling(block_kv=128, num_splits=splits, num_warps=4, num_stages=2)
            splits = max(1, min(_RESIDENT_PER_SM * sm_count // programs, max_context // 128))
            return tiling(block_kv=64, num_splits=splits, num_warps=4, num_stages=3)
        block_kv = 128
        splits = -(-2 * sm_count // programs)  # about two programs an SM
        if code == "int4" and group_size == 0 and v_words and not many:
            # per tensor or one scale a row, V read as half-words: about four programs an SM
            splits = max(_INT4_ROW_PROGRAMS_PER_SM * sm_count // programs, 2)
        elif code is not None:  # at least two; without row scales, one wave unless two exceed it
            splits = max(splits if row_scales else 2 * sm_count // programs, 2)
        splits = min(splits, max(1, max_context // (2 * block_kv)), 64)
        if code is None:
            return tiling(block_kv=block_kv, num_splits=splits, num_warps=4, num_stages=2)
        words = v_words and code in ("int8", "float8_e4m3fn")
        k_words = code == "int4" and v_words and not rope_on_read
        # over our pages, a head dim of no power of two (80, 96, ...): V read as codes
        odd_pages = pages and head_dim & (head_dim - 1) != 0
        rows = _FEW_ROWS if odd_pages or (pages and few_rows(code, group_size, row_scales)) else 16
        if 0 < head_dim <= _SHORT_DIM:  # every format and layout alike
            if many:
                return tiling(64, splits, 2, 3, query_rows=_FEW_ROWS, k_words=k_words)
            rows = 4 if group_size else _FEW_ROWS
            return tiling(block_kv, splits, 4, 3, query_rows=rows, k_words=k_words)
        if odd_pages and _odd_dim_small_blocks(code, group_size, row_scales, head_dim):
            if many:
                return tiling(64, splits, 2, 3, query_rows=rows)
            if code == "int4" and not group_size and head_dim < _ODD_DIM_INT4_PADDED_BELOW:
                return tiling(block_kv, splits, 4, 3, query_rows=rows, segments=False)
        stack = stacked_groups(code, group_size, head_dim, query_group) and not rope_on_read
        if stack and pages and v_words:
            return tiling(block_kv, splits, num_warps=4, num_stages=3, query_rows=4, stacked=True)
        if many and words:
            if group_size == _SMALL_BLOCK_GROUP:
                return tiling(64, splits, num_warps=2, num_stages=3, query_rows=rows)
            if (code, group_size) in _FOUR_STAGES and not row_scales:
                return tiling(block_kv, splits, num_warps=4, num_stages=4, query_rows=rows)
        if code == "int8" and row_scales and not words and (many or not odd_pages):
            return tiling(64, splits, num_warps=2, num_stages=3, query_rows=rows)
        if group_size == _SMALL_BLOCK_GROUP:  # groups of 8: with >= one program an SM
            k_words = k_words and many
        stages = 4 if k_words and group_size == _SMALL_BLOCK_GROUP else 3
        if k_words and group_size == _FOUR_ROW_GROUP and pages:
            rows = 4
        return tiling(block_kv, splits, 4, stages, query_rows=rows, k_words=k_words)

    @classmethod
    def for_format(
        cls,
        fmt: CacheFormat,
        head_dim: int,
        batch: int,
        num_kv_heads: int,
        max_context: int,
        page_size: int,
        query_group: int = 0,
        rope_on_read: bool = False,
    ) -> PagedDecodeConfig:
        """`heuristic` for pools of format `fmt` (`cache_read.CacheFormat`) and head dim;
        `query_group`: query heads a kv head serves (0: not known); `rope_on_read`: as
        `heuristic`'s."""
        return cls.heuristic(
            batch, num_kv_heads, max_context, page_size,
            code=fmt.dtype, row_scales=fmt.one_group_a_row, group_size=fmt.group_size,
            v_words=reads_v_words(fmt, head_dim), pages=fmt.layout == PAGES,
            head_dim=head_dim, query_group=query_group, rope_on_read=rope_on_read,
        )  # fmt: skip


def _odd_dim_small_blocks(code: str, group_size: int, row_scales: bool, head_dim: int) -> bool:
    """Formats that a head dim of no power of two (over our pages) runs in 64-token blocks
    of 2 warps with >= one program per SM (`PagedDecodeConfig.heuristic`): INT4 in
    groups; INT4 per tensor where its halves are read in segments, below D192 (faster so
    at 80, 96 and 160, slower at 192; with fewer programs, the heuristic reads those
    rows padded instead, where measured: at 80 and 96); INT8 groups of 8 and 16 from
    D96 (groups of 8 faster so at 96, 112, 120, 160 and 192; at D80 slower, as FP8
    groups of 8 and 16 at D96 and D192)."""
    if code == "int4":
        if group_size:
            return True
        segments = reads_segments(CacheFormat("int4"), head_dim)
        return not row_scales and segments and head_dim < _ODD_DIM_INT4_SMALL_BLOCK_BELOW
    small_group = group_size in _ODD_DIM_SMALL_BLOCK_GROUPS
    return code == "int8" and small_group and head_dim >= _ODD_DIM_SMALL_BLOCK_FROM


def few_rows(code: str | None, group_size: int, row_scales: bool) -> bool:
    """Whether decode over this cache format pads its query rows to `_FEW_ROWS` (8) rather
    than 16 (`PagedDecodeConfig.query_rows`): INT4 with group scales (any group, or one a
    row), and 8-bit codes in groups of 8, 16 or 64. (The heuristic takes 4 for INT4 groups
    of 16 with K read as half-words, and for stacked rows; and 8 for every format at head
    dims up to 64, and, over our pages, at those that are no power of two.) A thread's
    accumulators, logits and softmax vectors scale with the rows, and these formats hold
    the most registers a thread besides (INT4 groups: 168 in the Nsight Compute profile of
    12:00 UTC, three programs an SM).

    H100, GQA 32/8 (4 real rows), D 128, heuristic tilings, 16 rows against 8 (probes of
    2026-11-26 14:55-15:04 UTC, bench/HISTORY.md):
    - INT4 at B64 ctx16384, groups of 8 / 16 / 32 / 64 / one a row: 0.697 / 0.651 / 0.612
      / 0.598 / 0.491 against 0.681 / 0.610 / 0.602 / 0.487 / 0.471 ms. At B32 ctx16384
      groups of 32 0.343 against 0.291, of 64 0.343 against 0.247; at B8 ctx8192 2-14%.
    - 8-bit groups of 8 and 16 (B64 ctx16384, B32 ctx16384, B8 ctx8192): 0-16% faster (FP8
      groups of 16 at B8: 0.081 against 0.068 ms) but for INT8 groups of 16 at B32 (1%
      slower) and FP8 groups of 16 at B64 (0.907 against 0.931 ms).
    - 8-bit groups of 64 (probes of 16:45 and 16:55 UTC): B8 ctx8192 INT8 0.066 against
      0.071 ms, FP8 0.066 against 0.074; B32 ctx16384 INT8 0.514 against 0.534, FP8
      0.511 against 0.508; B64 ctx16384 within 1% (INT8 0.877 against 0.868 ms).
    - Per tensor (INT4, INT8) ran within 3% either way, and INT8 with one scale a row at
      B64 5% slower (0.794 against 0.830 ms): they keep 16 rows, as do the formats not
      probed (FP8 per tensor and one a row) and 8-bit groups of 32 (4 rows: B32 ctx16384
      INT8 0.517 against 0.444 ms).
    4 rows ran 7-8% faster than 8 for INT4 groups of 8 at B64, but slower at B32 and for
    groups of 32 (up to 22%).
    Our pools only: over OpenPPL's caches (`jaxattn.ppl`: token rows, float16 scales) the
    PPL op's decode step (B64 ctx8192, INT8 groups of 8) ran 7-12% slower with 8 rows
    (layouts 0 / 3: 0.620 / 0.563 against 0.670 / 0.634 ms; our op on our pools 0.510
    against 0.499; probe of 15:43 UTC), so they keep 16 above D 64
    (`PagedDecodeConfig.heuristic`'s `pages`)."""
    if code == "int4":
        return bool(group_size) or row_scales
    return code is not None and group_size in _FEW_ROWS_8BIT_GROUPS


def stacked_groups(code: str | None, group_size: int, head_dim: int, query_group: int) -> bool:
    """Whether decode over this cache applies its group scales through stacked query rows
    (`PagedDecodeConfig.stacked`, `paged_decode.stacked`), 4 rows: INT4 whose half row
    holds two groups (groups of 32 at D 128), for kv groups of at most 4 query heads
    (stacked rows: two groups x 4 = 8), with V read as words (D / 4 a power of two of at
    least 16); the heuristic takes it above D 64 (at D 64, 64-token blocks of 8 rows per
    value ran faster: B64 ctx16384 groups of 16 0.332 against 0.406 ms).
    Measured with kv groups of 4: kv groups of 1-3 query heads take it by the same count
    of stacked rows.

    H100, GQA 32/8 (4 real rows), D 128, 128-token blocks in 4 warps and 3 stages against
    the former tiling (8 rows, scales per value; probes of 2026-11-26 16:40-16:45 UTC,
    bench/HISTORY.md): INT4 groups of 32 B64 ctx16384 0.503-0.506 against 0.603-0.610 ms,
    B32 ctx16384 0.257 against 0.294, B8 ctx8192 0.047 against 0.050. Stacking 16 rows
    ran as fast as per value (INT4 groups of 32 at 8 rows 0.599 against 0.603 ms, of 16
    at 4 rows 0.597 against 0.604), 32 or more 1.4-5x slower (INT4 groups of 8 and 16,
    INT8 groups of 8). 8-bit groups of 32 and 64 (16 and 8 stacked rows) ran within 4%
    of the per-value tiling at B64 and B8, and at B32 ctx16384 from 7% faster (groups of
    64) to 12% slower (INT8 groups of 32): they keep their scales per value.
    Other head dims (probe of 18:07 UTC), stacked against 8 and 4 rows per value: D 256
    in groups of 64 B64 ctx16384 0.995 against 1.166 / 1.110 ms, B8 ctx8192 0.076 against
    0.084 / 0.079; D 64 in groups of 16 B64 0.407 against 0.462 / 0.451, but B8 0.042
    against 0.040 / 0.037."""
    if code != "int4" or not group_size or not query_group:
        return False
    if not reads_v_words(CacheFormat(code, "group", group_size), head_dim):
        return False
    half, rows = head_dim // 2, max(4, next_power_of_2(query_group))
    groups = half // group_size
    return half % group_size == 0 and groups >= 2 and groups * rows <= _STACKED_ROWS
