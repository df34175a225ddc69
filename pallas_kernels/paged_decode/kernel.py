"""Paged GQA decode (generation phase) as a Pallas Triton kernel.

One program serves one sequence, one kv head and one split of the context: it holds the
query rows of all heads of that kv group (`[G, D]`, padded to a power of two of at least
`config.query_rows`, 16, 8 or 4: Triton's dots take each), so each cached K/V block is read
once for the whole group (as TensorRT-LLM's XQA kernels do). Block tables are read
in-kernel: a `block_kv`-token step gathers its rows from whatever pages hold them, so
pages may lie anywhere in the pool and have any size.

Split-K ("multi-block"): with `num_splits > 1` each program covers a contiguous chunk of
its row's context and writes its normalised partial output and log-sum-exp; a second
kernel merges them (out = sum_s exp(lse_s - lse) * out_s; `combine.py`). This keeps the
GPU busy when `batch * num_kv_heads` is small against the number of SMs. Chunks have one
length across the batch (the longest row's span over `num_splits`): in a ragged batch all
busy programs finish together, and a short row's surplus programs exit at once.

Quantized caches whose head dim (INT4: half of it) is no power of two may be read in
segments of power-of-two widths (`config.segments`, `cache_read.column_segments`): q, K,
V and the output then come in one tile a segment (96 = 64 + 32 channels), a dot each.

Quantized caches may have V read as words of four codes (`config.v_words`,
`cache_read.read_words`; 32-bit words of INT8 / FP8, 16-bit half-words of INT4): the PV
dot then runs in four parts of strided channels, and the output is stored part by part.
INT4 may read K as half-words too (`config.k_words`): q is then loaded in the same four
parts of strided channels, and the logits are the sum of four dots.
Their group scales may be applied through stacked query rows (`config.stacked`,
`stacked.py`: a row block per group, the scales on logits and probabilities) rather than
per cached value.

FP8 output (`out_dtype=float8_e4m3fn`): the normalised float32 result is quantized in the
store (`combine.quantize_output`): by this kernel's epilogue without splits, by the
combine kernel's with them (the partials stay float32).

Fused cache write (`new_kv`, TensorRT-LLM's generation-phase attention does the same): the
row's new token (its last, at position `context_len - 1`) comes as inputs: the kernel
rotates its key with q's rotation (`q_rope`), attends to it from registers, reads only the
tokens before it from the pages, and stores it at its slot of the pools, which it returns
updated in place (`input_output_aliases`). A decode step then needs no XLA pass between the
projections and this kernel.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import rope_read
from pallas_kernels.cache_read import (
    PLAIN,
    CacheFormat,
    dot_columns,
    factored_scales,
    load_scales,
    read_kv,
    read_words,
    reads_segments,
    reads_v_words,
    ring_position,
    scaled_sum,
    scales_per_element,
    word_columns,
    word_part_scales,
    word_view,
)
from pallas_kernels.codes import INT4_BIAS
from pallas_kernels.common import (
    LOG2E,
    MASK_VALUE,
    dot_width,
    next_power_of_2,
    softmax_finish,
    softmax_init,
    softmax_update,
    whole_array_call,
)
from pallas_kernels.output import FP8, inverse_scale, output_value
from pallas_kernels.paged_decode import stacked as stacked_rows
from pallas_kernels.paged_decode.combine import combine_splits
from pallas_kernels.paged_decode.config import PagedDecodeConfig


@dataclasses.dataclass(frozen=True)
class DecodeParams:
    """Static options of the logits and mask (semantics: DESIGN.md / jaxattn.reference)."""

    window: int | None = None
    sink_tokens: int = 0
    soft_cap: float | None = None
    scale: float = 1.0
    ring: tuple[int, int] | None = None  # a cyclic cache's (kept, size): cache_read


def _paged_decode_kernel(
    ctx_ref,  # [B] int32 tokens held (the query is the last)
    table_ref,  # [B, max_pages] int32
    q_ref,  # [B, Hq, D]
    k_ref,
    v_ref,  # [N, Hkv, P, Dp]: float, or quantized as `fmt` says (int4: Dp = D / 2);
    # with `v_words` the V pool viewed as words (int32; INT4: int16), [N, Hkv, P, D / 4],
    # with `k_words` the K pool too
    *refs,
    params: DecodeParams,
    fmt: CacheFormat,
    has_alibi: bool,
    has_indirection: bool,
    has_rope: bool,
    has_q_rope: bool,
    has_new: bool,
    new_heads: tuple[int, int],
    split_out: bool,
    quantize: bool,
    group: int,
    rows: int,
    head_dim: int,
    block_kv: int,
    num_splits: int,
    interpret: bool,
    v_words: bool,
    k_words: bool,
    biased_keys: bool,
    stacked: bool,
    segmented: bool,
):
    refs = list(refs)
    k_scale_ref = v_scale_ref = None
    if fmt.dtype is not None:  # "tensor": [1] each; "group": [N, Hkv, P, G] each
        k_scale_ref, v_scale_ref = refs.pop(0), refs.pop(0)
    alibi_ref = refs.pop(0) if has_alibi else None  # [Hq]
    ind_ref = refs.pop(0) if has_indirection else None  # [B // W, W, L] int32
    # RoPE on read: q' [B, Hq, D] (rope_read), cos and sin tables float32 [R, D].
    rope_refs = [refs.pop(0) for _ in range(3)] if has_rope else None
    # Ordinary RoPE of q on load: cos, sin float32 [B, D], partner int32 [D].
    q_rope_refs = [refs.pop(0) for _ in range(3)] if has_q_rope else None
    # The new token: k, v [B, Hkv, D] and its slot int32 [B] (< 0: not stored).
    new_refs = [refs.pop(0) for _ in range(3)] if has_new else None
    inv_ref = refs.pop(0) if quantize else None  # [1] float32: 1 / out_scale (fp8 output)
    # [B, Hq, D] and [B, Hq]; or [B, Hq, S, D] and [B, Hq, S]; then with `has_new` the
    # pools again (aliased to k_ref, v_ref: written, never read).
    o_ref, lse_ref, *pool_refs = refs

    b, kvh, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    page_size, max_pages = fmt.layout.page_size_of(k_ref), table_ref.shape[1]
    # q, K (and V read as codes) come in `fmt.parts` parts of D / parts channels (two for
    # INT4: cache_read), with `segmented` each in segments of power-of-two widths: one
    # tile a dot (`cache_read.dot_columns`); V read as words in four parts of strided
    # channels, and with `k_words` q and K too.
    tiles = []  # each tile's (channels [1, W], which of them exist [1, W])
    for first, width in dot_columns(fmt, head_dim, segmented):
        cols = jnp.arange(dot_width(width))[None, :]
        tiles.append((first + cols, cols < width))
    g = jnp.arange(rows)
    row_ok = g < group
    heads = kvh * group + g  # [rows] query heads of this kv group

    def query_part(cols, ok):  # [rows, W]: this group's query heads at columns `cols` [1, W]
        if has_q_rope:
            return rope_read.rotated_query_rows(q_ref, q_rope_refs, b, heads, row_ok, cols, ok)
        return plgpu.load(q_ref.at[b, heads[:, None], cols], mask=row_ok[:, None] & ok,
                          other=0.0)  # fmt: skip

    if k_words:  # K read as words: q in the word parts' strided channels
        q = tuple(query_part(cols, True) for cols in word_columns(fmt, head_dim))
    else:
        q = tuple(query_part(cols, ok) for cols, ok in tiles)
    ctx = ctx_ref[b]
    pos = ctx - 1  # the query's position
    cached = cached_tokens(ctx, has_new)
    slopes = None
    if has_alibi:
        slopes = plgpu.load(alibi_ref.at[heads], mask=row_ok, other=0.0)
    dtype = q[0].dtype
    precision = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None
    qk_scale = params.scale * (1.0 if params.soft_cap is not None else LOG2E)
    if has_rope:  # StreamingLLM: rotate q and keys at their positions within the cache
        rope_at = dict(window=params.window, sink_tokens=params.sink_tokens,
                       part_cols=[cols for cols, _ in tiles], col_ok=tiles[0][1])  # fmt: skip
        q_rot = rope_read.decode_queries(q, rope_refs, b, heads, row_ok, pos, **rope_at)

    def logits(s, t):  # q.k `[rows, n]` of tokens t `[n]` -> base-2 logits (unmasked)
        s = s * qk_scale
        if has_alibi:
            dist = jnp.abs(pos - t).astype(jnp.float32)
            alibi = -slopes[:, None] * dist[None, :]
            s = s + alibi * (1.0 if params.soft_cap is not None else LOG2E)
        if params.soft_cap is not None:
            s = (params.soft_cap * LOG2E) * jnp.tanh(s / params.soft_cap)
        return s

    factored = fmt.factored(head_dim)
    n_groups = stacked_rows.groups(fmt, head_dim) if stacked else 1
    if stacked:  # each part's query rows once per group (`stacked`): `[n * rows, Pd]`
        q = tuple(stacked_rows.stack_queries(qp, fmt.group_size, n_groups) for qp in q)
    # `biased_keys` (INT4 with a scale per half row, or stacked rows, or one scale a row
    # with K read as half-words; bf16 queries): keys read as `n + INT4_BIAS`, no FMA a value
    # pair; the logits of (stacked) query row r of tile p are then q_r . (k_p + bias), and
    # `bias * sum(q_r)` (over tile p's channels) comes off them before their scale. H100,
    # B64 ctx16384 (probe of 2026-11-26 13:22 UTC, bench/HISTORY.md): 0.601 against 0.649
    # ms, B8 ctx8192 0.054 against 0.060. Per tensor, and one scale a row with K read as
    # bytes, ran 1-7% slower so (0.437 / 0.528 against 0.431 / 0.492 ms) and keep the FMA;
    # with K read as half-words one scale a row runs faster biased (0.454 against 0.492 ms),
    # per tensor still slower (0.432 against 0.408; probe of 2026-11-27 03:50 UTC). Only the
    # PTX conversion saves the FMA; float16 / float32 queries, whose casts cost the same
    # either way, keep the exact values (the subtraction loses float32 digits).
    q_bias = None
    if biased_keys:
        q_bias = [INT4_BIAS * jnp.sum(qp.astype(jnp.float32), axis=1) for qp in q]
        if k_words:
            q_bias = pair_sums(q_bias)
    # Quantized pools: table entries and scales loaded a step ahead (`fetch`). H100, B64
    # ctx16384 (probes of 2026-11-26, bench/HISTORY.md): INT8 per tensor 0.88 -> 0.81 ms
    # (with 3 stages), groups of 8 1.56 -> 1.15; float pools ran as fast or slower
    # (B64 ctx2048, 3 stages: 0.198 -> 0.214 ms). Not scales per element (groups that do
    # not divide the padded tile): a `[block, Pd]` scale tile a tile, for K and V, is too
    # much to carry.
    ahead = fmt.dtype is not None and not scales_per_element(fmt, head_dim, segmented)

    def tokens(block):  # block's token positions [block_kv], which exist, where stored
        t = block * block_kv + jnp.arange(block_kv)
        return t, (t >= 0) & (t < cached), ring_position(t, params.ring)

    def fetch(block):
        """The loads block's reads depend on: its table entries `[block_kv]` and its K and
        V scales (`load_scales`); for quantized pools issued a step ahead (`ahead`)."""
        t, t_ok, stored_at = tokens(block)
        col = stored_at // page_size
        row = b
        if has_indirection:  # token t from beam ind[b // W, b % W, t] of this request
            width, ind_len = ind_ref.shape[1], ind_ref.shape[2]
            beam = b % width
            src = plgpu.load(ind_ref.at[b // width, beam, t], mask=t_ok & (t < ind_len), other=beam)
            row = b - beam + jnp.clip(src, 0, width - 1)  # [block_kv]
        # Entries are clipped into the pool on use: a corrupt table never reads off it.
        entries = plgpu.load(table_ref.at[row, col], mask=t_ok & (col < max_pages), other=0)
        at = (entries[:, None], kvh, (stored_at % page_size)[:, None])
        scales = tuple(load_scales(ref, fmt, at, kv, t_ok, head_dim, segmented)
                       for kv, ref in enumerate((k_scale_ref, v_scale_ref)))  # fmt: skip
        return entries, scales

    def body(block, carry):
        state, next_loads = carry
        if ahead:
            entries, (k_scales, v_scales) = next_loads
            next_loads = fetch(block + 1)
        else:
            entries, (k_scales, v_scales) = fetch(block)
        t, t_ok, stored_at = tokens(block)
        at = (entries[:, None], kvh, (stored_at % page_size)[:, None])
        read = functools.partial(
            read_kv, fmt=fmt, at=at, t_ok=t_ok, head_dim=head_dim, asm=not interpret,
            unscaled=stacked, segmented=segmented,
        )  # fmt: skip
        if k_words:
            k = read_words(k_ref, fmt, at, t_ok, head_dim, dtype, k_scales, asm=not interpret,
                           kv=0, biased=biased_keys)  # fmt: skip
        else:
            k = read(k_ref, kv=0, dtype=dtype, scales=k_scales, biased=biased_keys)  # tiles
        k_scale = v_scale = part_scales = None
        if factored:  # scales factored out of the tiles: they scale logits and probabilities
            k_scale = factored_scales(k_scale_ref, k_scales, t_ok)  # [block_kv], or per tile
            v_scale = factored_scales(v_scale_ref, v_scales, t_ok)
            if fmt.part_scales(head_dim):  # each tile's logits by its part's own
                part_scales, k_scale = k_scale, None
        if has_rope:
            s = rope_read.decode_scores(q_rot, k, rope_refs[1:], t, pos, precision,
                                        part_scales=part_scales, **rope_at)  # fmt: skip
        else:
            dots = [
                jnp.dot(qp, kp.T, precision=precision, preferred_element_type=jnp.float32)
                for qp, kp in zip(q, k, strict=True)
            ]
            if k_words:  # word parts 0, 1 hold low nibbles, 2, 3 high: as K's two halves
                dots = pair_sums(dots)
            if biased_keys:
                dots = [d - qb[:, None] for d, qb in zip(dots, q_bias, strict=True)]
            if stacked:
                s = sum(stacked_rows.fold_logits(d, x) for d, x in zip(dots, k_scales, strict=True))
            else:
                s = scaled_sum(dots, part_scales)
        if k_scale is not None:
            s = s * k_scale[None, :]
        s = logits(s, t)
        visible = t_ok
        if params.window is not None:
            in_window = t > pos - params.window
            if params.sink_tokens:
                in_window |= t < params.sink_tokens
            visible &= in_window
        s = jnp.where(visible[None, :], s, MASK_VALUE)
        if v_words:  # four parts of strided channels
            load_v = functools.partial(read_words, v_ref, fmt, at, t_ok, head_dim, dtype,
                                       v_scales, asm=not interpret, unscaled=stacked)  # fmt: skip
            if stacked:
                v_scales = stacked_rows.word_scales(fmt, v_scales)
                return stacked_rows.update(state, s, load_v, v_scales, precision), next_loads
            v_scale = word_part_scales(v_scale)
        else:
            load_v = functools.partial(read, v_ref, kv=1, dtype=dtype, scales=v_scales)
        return softmax_update(state, s, load_v, precision, v_scale), next_loads

    def run_blocks(lo, hi, state):  # folds blocks [lo, hi) into the softmax state
        next_loads = fetch(lo) if ahead else None
        return jax.lax.fori_loop(lo, hi, body, (state, next_loads))[0]

    ctx_all = None
    if num_splits > 1:  # every row's length: the batch's chunk length
        rows_all = jnp.arange(next_power_of_2(ctx_ref.shape[0]))
        ctx_all = plgpu.load(ctx_ref.at[rows_all], mask=rows_all < ctx_ref.shape[0], other=0)
    spans = functools.partial(visible_blocks, window=params.window, has_new=has_new,
                              block_kv=block_kv)  # fmt: skip
    lo_b, start, end = split_blocks(spans, ctx, ctx_all, split, num_splits)

    # The output's parts: (columns [1, W], which are channels [1, W]).
    v_parts = tiles
    if v_words:  # V in parts of strided channels (cache_read.read_words), all channels
        v_parts = [(cols, jnp.full(cols.shape, True)) for cols in word_columns(fmt, head_dim)]
    widths = tuple(cols.shape[1] for cols, _ in v_parts)
    if stacked:
        carry = stacked_rows.init(rows, [(n_groups, w) for w in widths])
    else:
        carry = softmax_init(rows, widths)
    if has_new:
        # Split 0 stores the new token and attends to it first: the softmax state starts
        # from it, so nothing of it stays live through the loops (holding its logits and
        # value through them, or q for them after, ran B64 ctx2048 15-17% slower).
        new_ok = (split == 0) & (ctx > 0)
        [cols] = tiles  # plain pools: one tile
        k_new, v_new = new_token(new_refs, new_heads, q_rope_refs, pool_refs[0].dtype, b, kvh,
                                 *cols)  # fmt: skip
        store_new_token(new_refs[2], pool_refs, b, kvh, new_ok, k_new, v_new, *cols)
        s_new = jnp.sum(q[0].astype(jnp.float32) * k_new.astype(dtype).astype(jnp.float32), axis=1)
        s_new = logits(s_new[:, None], jnp.full((1,), pos))[:, 0]
        carry = first_key(carry, new_ok, s_new, v_new.astype(dtype))
    if params.window is not None and params.sink_tokens:
        # Sink blocks below the window belong to split 0. (Integer arithmetic rather than
        # a select of constants: see flash_prefill on Triton's i1/i32 lowering.)
        sink_b = jnp.minimum(pl.cdiv(jnp.minimum(params.sink_tokens, cached), block_kv), lo_b)
        sink_b = sink_b * (1 - jnp.minimum(split, 1))
        carry = run_blocks(0, sink_b, carry)
    carry = run_blocks(start, end, carry)
    if stacked:  # each channel from its group's rows
        acc, m, l = carry
        carry = tuple(stacked_rows.unstack(a, n_groups) for a in acc), m, l
    out, lse = softmax_finish(carry)
    for part, (cols, cols_ok) in zip(out, v_parts, strict=True):
        store_ok = row_ok[:, None] & cols_ok
        if split_out:
            plgpu.store(o_ref.at[b, heads[:, None], split, cols], part, mask=store_ok)
        else:
            value = output_value(part, o_ref, inv_ref)
            plgpu.store(o_ref.at[b, heads[:, None], cols], value, mask=store_ok)
    if split_out:
        plgpu.store(lse_ref.at[b, heads, split], lse, mask=row_ok)
    else:
        plgpu.store(lse_ref.at[b, heads], lse, mask=row_ok)


def pair_sums(parts):
    """K's four word parts' `[rows, block]` logits (or `[rows]` bias terms) as its two
    halves' (parts 0 + 1: the low nibbles, 2 + 3: the high; `word_columns`), which share
    a half row's scales: each half's sum is scaled and biased once."""
    return [parts[0] + parts[1], parts[2] + parts[3]]


def cached_tokens(ctx, has_new):
    """Tokens read from the pages for a row of `ctx` (its query the last): all of them, or
    with `has_new` (the last comes as an input) all but the last."""
    return jnp.maximum(ctx - 1, 0) if has_new else ctx


def visible_blocks(ctx, window, has_new, block_kv):
    """(first, end) of the `block_kv`-token blocks of the cache that can hold keys visible
    to a row of `ctx` tokens (`window`: None or the tokens its query sees; `has_new`: as
    `cached_tokens`). Any shape of ctx."""
    lo = 0 if window is None else jnp.maximum(ctx - window, 0)  # (ctx - 1) - window + 1
    hi_b = pl.cdiv(cached_tokens(ctx, has_new), block_kv)
    return jnp.minimum(lo // block_kv, hi_b), hi_b


def split_blocks(spans, ctx, ctx_all, split, num_splits):
    """(first visible block, start, end): the blocks `[start, end)` of split `split` of a
    row of `ctx` tokens; `spans(ctx)` gives (first, end) of its visible blocks.

    With splits, chunks have one length for the whole batch `ctx_all` (every row's ctx):
    the longest row's span over `num_splits`. A short row of a ragged batch then keeps
    fewer programs busy instead of as many shorter ones, which left the long rows'
    programs to finish alone (B8 ctx8192 ragged: 83.5 against 62.3 us)."""
    lo_b, hi_b = spans(ctx)
    per_split = hi_b - lo_b
    if num_splits > 1:
        lo_all, hi_all = spans(ctx_all)
        per_split = pl.cdiv(jnp.max(hi_all - lo_all), num_splits)
    start = jnp.minimum(lo_b + split * per_split, hi_b)
    return lo_b, start, jnp.minimum(start + per_split, hi_b)


def new_token(new_refs, new_heads, rope_refs, pool_dtype, b, kvh, cols, col_ok):
    """Row b's new key (rotated as q when `rope_refs`) and value at kv head `kvh`, `[1, Pd]`
    each, as the pools store them (`pool_dtype`); `new_heads`: where the kv heads start
    in the k and v arrays (past the q heads of a fused projection)."""
    k_ref, v_ref, _ = new_refs
    k_head, v_head = (jnp.full((1,), start + kvh, jnp.int32) for start in new_heads)
    if rope_refs is None:
        k = plgpu.load(k_ref.at[b, k_head[:, None], cols], mask=col_ok, other=0.0)
    else:
        row_ok = jnp.full((1,), True)
        k = rope_read.rotated_query_rows(k_ref, rope_refs, b, k_head, row_ok, cols, col_ok)
    v = plgpu.load(v_ref.at[b, v_head[:, None], cols], mask=col_ok, other=0.0)
    return k.astype(pool_dtype), v.astype(pool_dtype)


def store_new_token(slot_ref, pool_refs, b, kvh, ok, k, v, cols, col_ok):
    """Stores row b's new k, v `[1, Pd]` at its slot when `ok` and the slot is a place in
    the pools (slot < 0: not stored)."""
    k_pool, v_pool = pool_refs
    num_pages, page_size = k_pool.shape[0], k_pool.shape[2]
    slot = slot_ref[b]
    ok = ok & (slot >= 0) & (slot < num_pages * page_size)
    slot = jnp.where(ok, slot, 0)
    at = (slot // page_size, kvh, slot % page_size, cols)
    for pool, x in ((k_pool, k), (v_pool, v)):
        plgpu.store(pool.at[at], x, mask=ok & col_ok)


def first_key(carry, ok, s, v):
    """The softmax state `softmax_init` gave (`carry`) after one key when `ok`: base-2
    logits s `[rows]`, value v `[1, Dp]` (m = s, l = 1, acc = v)."""
    (acc,), m, l = carry
    acc = jnp.where(ok, acc + v.astype(jnp.float32), acc)
    return (acc,), jnp.where(ok, s, m), jnp.where(ok, 1.0, l)


@functools.partial(jax.jit, static_argnames=("params", "config", "fmt", "out_dtype", "interpret"))
def paged_decode(
    q,
    k_pages,
    v_pages,
    block_tables,
    context_lens,
    *,
    k_scales=None,
    v_scales=None,
    alibi_slopes=None,
    cache_indirection=None,
    rope: rope_read.RopeTables | None = None,
    q_rope=None,
    new_kv=None,
    params: DecodeParams,
    config: PagedDecodeConfig,
    fmt: CacheFormat = PLAIN,
    out_dtype=None,
    out_scale=None,
    interpret: bool = False,
):
    """Decode attention over a paged cache.

    Args:
      q: `[B, Hq, D]`. k_pages, v_pages: `[N, Hkv, P, Dp]`: any float dtype (read as q's),
        or quantized as `fmt` says, with `k_scales`, `v_scales` (float32 `[]` per tensor,
        `[N, Hkv, P, G]` per group). Other pool layouts as `fmt.layout` says (K and V may
        then be one array, passed twice).
      block_tables: int32 `[B, max_pages]` (page ids; token offsets of pages for a "token"
        layout); context_lens: int32 `[B]` (query included).
      alibi_slopes: float32 `[Hq]` or None. params, config: static options and tiling.
      cache_indirection: int32 `[B // W, W, L]` or None: token t of row b is read through
        the block table of row `b - b % W + ind[b // W, b % W, t]` (t < L; beam search).
      rope: None, or `RopeTables` (q_partner `[B, Hq, D]`): the cache holds un-rotated keys
        and q comes un-rotated; both are rotated in-kernel at their positions within the
        cache (StreamingLLM, `pallas_kernels.rope_read`; `params.window`, `sink_tokens`).
      q_rope: None, or `(cos, sin, partner)` (`jaxattn.rope.token_rotations`: float32
        `[B, D]` twice, int32 `[D]`): q comes un-rotated and the kernel applies ordinary
        RoPE to it on load (the cache holds rotated keys). Not with `rope`.
      new_kv: None, or `(k, v, slots)`: row b's new token (position `context_lens[b] - 1`),
        k, v `[B, Hkv, D]` (k un-rotated when `q_rope` is given: rotated as q) and int32
        slots `[B]` (`page * P + offset`; < 0 or past the pools: not stored). Or
        `(None, None, slots)` with q the step's fused projection `[B, Hq + 2 * Hkv, D]`
        (q heads, then k, then v heads), read in place (no copies of its slices). The kernel
        attends to the token from these inputs, reads only the earlier tokens from the
        pages, and stores it (cast to the pools' dtype). Plain caches only; not with
        `rope` or `cache_indirection`, nor a cyclic cache (`params.ring`). The slot must be
        the row's own, where its tables put that position (`KVCacheManager.slot_mapping`):
        no other program reads it during the call.
      out_dtype: None (q's dtype) or float8_e4m3fn, which needs `out_scale` (float32 `[]`):
        stored `clip(out * (1 / out_scale), -448, 448)`, rounded to nearest even.

    Returns:
      out `[B, Hq, D]` in `out_dtype` and lse float32 `[B, Hq]`; with `new_kv`, also the
      pools with the new tokens stored (in place: donate them to the enclosing `jax.jit`).
    """
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = fmt.layout.num_heads(k_pages)
    fused_qkv = new_kv is not None and new_kv[0] is None
    if fused_qkv:  # q is the step's fused projection: q heads, then k, then v
        num_q_heads -= 2 * num_kv_heads
    if num_q_heads <= 0 or num_q_heads % num_kv_heads:
        raise ValueError(
            f"paged_decode: {q.shape=} with {num_kv_heads} kv heads: expected [B, Hq, D] "
            "(or [B, Hq + 2 * Hkv, D] with new_kv=(None, None, slots)), Hq a multiple of Hkv"
        )
    group = num_q_heads // num_kv_heads
    rows = max(config.query_rows, next_power_of_2(group))
    splits = config.num_splits
    out_dtype = q.dtype if out_dtype is None else jnp.dtype(out_dtype)
    quantize = out_dtype == FP8 and splits == 1
    if out_dtype == FP8 and out_scale is None:
        raise ValueError("paged_decode: out_dtype=float8_e4m3fn needs out_scale")
    inputs = [context_lens.astype(jnp.int32), block_tables.astype(jnp.int32), q, k_pages, v_pages]
    if fmt.dtype is not None:
        scales = (k_scales, v_scales)
        if fmt.granularity == "tensor":
            scales = tuple(jnp.reshape(x, (1,)).astype(jnp.float32) for x in scales)
        inputs += scales
    if alibi_slopes is not None:
        inputs.append(alibi_slopes.astype(jnp.float32))
    if cache_indirection is not None:
        ind = cache_indirection
        if jnp.issubdtype(ind.dtype, jnp.unsignedinteger):  # clamped before the int32 cast,
            ind = jnp.minimum(ind, ind.shape[1] - 1)  # as the XLA path clamps (no wrap)
        inputs.append(ind.astype(jnp.int32))
    if rope is not None:
        inputs += [rope.q_partner.astype(q.dtype), rope.cos, rope.sin]
    if q_rope is not None:
        if rope is not None:
            raise ValueError(
                "paged_decode: q_rope (ordinary RoPE) and rope (on read) exclude each other"
            )
        cos, sin, partner = q_rope
        inputs += [cos.astype(jnp.float32), sin.astype(jnp.float32), partner.astype(jnp.int32)]
    new_heads = (0, 0)  # where the kv heads start in the arrays of new k and v
    if new_kv is not None:
        if fmt != PLAIN or rope is not None or cache_indirection is not None or params.ring:
            raise ValueError(
                "paged_decode: new_kv needs a plain cache, no rope on read, no "
                f"cache_indirection and no cyclic cache ({fmt=}, ring={params.ring})"
            )
        k_new, v_new, slots = new_kv
        if fused_qkv:
            k_new = v_new = q
            new_heads = (num_q_heads, num_q_heads + num_kv_heads)
        elif k_new.shape != v_new.shape or k_new.shape != (batch, num_kv_heads, head_dim):
            raise ValueError(
                f"paged_decode: new_kv {k_new.shape=}, {v_new.shape=}: expected "
                f"[B={batch}, Hkv={num_kv_heads}, D={head_dim}]"
            )
        inputs += [k_new, v_new, jnp.reshape(slots, (batch,)).astype(jnp.int32)]
    if quantize:
        inputs.append(inverse_scale(out_scale))
    if splits == 1:
        out_shape = [
            jax.ShapeDtypeStruct((batch, num_q_heads, head_dim), out_dtype),
            jax.ShapeDtypeStruct((batch, num_q_heads), jnp.float32),
        ]
    else:
        out_shape = [
            jax.ShapeDtypeStruct((batch, num_q_heads, splits, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((batch, num_q_heads, splits), jnp.float32),
        ]
    aliases = None
    if new_kv is not None:  # inputs 3 and 4 (the pools) come back updated
        out_shape += [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (k_pages, v_pages)]
        aliases = {3: 2, 4: 3}
    v_words = config.v_words and reads_v_words(fmt, head_dim)
    stacked = config.stacked and v_words and rope is None and stacked_rows.stacks(fmt, head_dim)
    k_words = config.k_words and v_words and fmt.dtype == "int4" and not stacked and rope is None
    segmented = config.segments and rope is None and not v_words and reads_segments(fmt, head_dim)
    biased_keys = (
        fmt.dtype == "int4"
        and rope is None
        and q.dtype == jnp.bfloat16
        and (fmt.part_scales(head_dim) or stacked or (k_words and fmt.one_group_a_row))
    )
    if v_words:  # V pool viewed as words of four codes: a bitcast on XLA:GPU, but XLA:CPU
        # (interpret mode) expands it into a copy (tests/test_decode.py checks the GPU)
        inputs[4] = word_view(v_pages, fmt)
    if k_words:
        inputs[3] = word_view(k_pages, fmt)
    kernel = functools.partial(
        _paged_decode_kernel,
        params=params,
        fmt=fmt,
        has_alibi=alibi_slopes is not None,
        has_indirection=cache_indirection is not None,
        has_rope=rope is not None,
        has_q_rope=q_rope is not None,
        has_new=new_kv is not None,
        new_heads=new_heads,
        split_out=splits > 1,
        quantize=quantize,
        group=group,
        rows=rows,
        head_dim=head_dim,
        block_kv=config.block_kv,
        num_splits=splits,
        interpret=interpret,
        v_words=v_words,
        k_words=k_words,
        biased_keys=biased_keys,
        stacked=stacked,
        segmented=segmented,
    )
    out, lse, *pools = whole_array_call(
        kernel,
        inputs,
        out_shape,
        grid=(batch, num_kv_heads, splits),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        interpret=interpret,
        name="paged_decode",
        aliases=aliases,
    )
    if splits > 1:
        out, lse = combine_splits(
            out, lse, dtype=out_dtype, out_scale=out_scale, interpret=interpret
        )
    return (out, lse, *pools)
