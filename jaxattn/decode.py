"""Generation-phase attention: `paged_decode` over a `PagedKVCache`.

Also: `contiguous_kv_cache` (TensorRT-LLM's non-paged cache as a one-page-per-sequence
view, so the same kernel serves it) and `validate_page_table`, the opt-in check of the
data-dependent invariants that shapes cannot show.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Int

from jaxattn import reference, validation
from jaxattn.cache import PagedKVCache
from jaxattn.dispatch import run_first
from jaxattn.parallel.partition import BATCH, HEADS, KV_HEADS, Out, run_sharded
from pallas_kernels.common import use_interpret
from pallas_kernels.paged_decode import CacheFormat, DecodeParams, PagedDecodeConfig
from pallas_kernels.paged_decode import paged_decode as _paged_decode_kernel

__all__ = ["contiguous_kv_cache", "paged_decode", "validate_page_table"]


def _check(
    q,
    cache,
    block_tables,
    context_lens,
    cache_indirection,
    alibi_slopes,
    window,
    sink_tokens,
    soft_cap,
    scale,
):
    if q.ndim != 3:
        raise ValueError(f"q.shape={q.shape}: expected rank 3 [B, Hq, D]")
    batch, num_q_heads, _ = q.shape
    validation.check_cache(q, cache)
    if not jnp.issubdtype(q.dtype, jnp.floating) or q.dtype.itemsize < 2:
        raise ValueError(f"{q.dtype=}: expected float32, bfloat16 or float16")
    if block_tables.ndim != 2 or block_tables.shape[0] != batch or block_tables.shape[1] < 1:
        raise ValueError(f"{block_tables.shape=}: expected [B={batch}, max_pages_per_seq >= 1]")
    if not np.issubdtype(block_tables.dtype, np.integer):
        raise ValueError(f"{block_tables.dtype=}: expected an integer dtype")
    validation.check_int_vector("context_lens", context_lens, batch)
    if cache_indirection is not None:
        _check_indirection(cache_indirection, batch)
    validation.check_options(
        num_q_heads=num_q_heads,
        window=window,
        sink_tokens=sink_tokens,
        alibi_slopes=alibi_slopes,
        relative_bias=None,
        soft_cap=soft_cap,
        scale=scale,
    )


def paged_decode(
    q: Float[Array, "B Hq D"],
    cache: PagedKVCache,
    block_tables: Int[Array, "B max_pages"],
    context_lens: Int[Array, " B"],
    *,
    window: int | None = None,
    sink_tokens: int = 0,
    alibi_slopes: Float[Array, " Hq"] | None = None,
    soft_cap: float | None = None,
    scale: float | None = None,
    return_lse: bool = False,
    implementation: str | Sequence[str] | None = None,
    config: PagedDecodeConfig | None = None,
    cache_indirection: Int[Array, "Bw W L"] | None = None,
    out_dtype: DTypeLike | None = None,
    out_scale: float | Float[Array, ""] | None = None,
):
    """One new query token per sequence attends to its cached history.

    Args:
      q: `[B, Hq, D]`, the query of each sequence's newest token, in the cache's dtype
        (a quantized cache: any of float32 / bfloat16 / float16; K/V are dequantized
        in-kernel to q's dtype, as the reference does).
      cache: the `PagedKVCache` holding every sequence's K/V (the new token's included:
        write it with `write_kv` first), plain or quantized (`jaxattn.KVQuant`).
      block_tables: int32 `[B, max_pages]`: page `block_tables[b, i]` holds positions
        `i*P .. i*P + P-1` of sequence b. Entries past a sequence's pages are never read.
      context_lens: int32 `[B]`, tokens sequence b holds; the query sits at position
        `context_lens[b] - 1`. 0 means an idle slot: its output is zeros.
      window, sink_tokens, alibi_slopes, soft_cap, scale: as `jaxattn.attention`.
      return_lse: also return the natural log-sum-exp, float32 `[B, Hq]`.
      implementation: "pallas", "xla", a list tried in order, or None (pallas on GPU).
      config: a `PagedDecodeConfig` (block size, split-K count); None: the heuristic,
        which splits the context when `B * Hkv` programs cannot fill the GPU.
      cache_indirection: None, or int32 `[B // W, W, L]`: beam search with W beams per
        request, TensorRT-LLM's input of that name. Batch rows are ordered (request,
        beam): row `r = b * W + j`. Token t of row r is read from row
        `b * W + cache_indirection[b, j, t]` (clamped into the request's W rows), through
        that row's block table; tokens t >= L are read from row r itself. Lengths,
        positions and masks stay row r's own. Reordering beams then copies no K/V.
      out_dtype, out_scale: None, or `jnp.float8_e4m3fn` with a float32 scalar scale: FP8
        output `clip(out * (1 / out_scale), -448, 448)` rounded to e4m3, as
        `jaxattn.attention`. The kernel quantizes in its epilogue; with split-K in the
        combine kernel's (the partial outputs stay float32).

    Returns:
      out `[B, Hq, D]` in `out_dtype` (default q's; idle slots: zeros), and lse float32
      with `return_lse`. Page ids, lengths and indirection values are trusted: check
      them with `validate_page_table` (given `cache_indirection` too) while debugging.

    Cache indirection, a worked example: one request, W = 2 beams, P = 2, 5 tokens.

        block_tables = [[0, 1, 2],   # row 0 (beam 0): tokens 0-1 in page 0, 2-3 page 1, 4 page 2
                        [3, 4, 5]]   # row 1 (beam 1)
        cache_indirection = [[[0, 0, 0, 1, 0],    # beam 0 reads token 3 from beam 1
                              [0, 0, 1, 0, 1]]]   # beam 1 reads tokens 0, 1, 3 from beam 0

    Row 0 reads its tokens from slots 0, 1, 2, 9 (row 1's page 4, offset 1), 4; row 1
    from slots 0, 1, 8, 3, 10.
    """
    _check(
        q,
        cache,
        block_tables,
        context_lens,
        cache_indirection,
        alibi_slopes,
        window,
        sink_tokens,
        soft_cap,
        scale,
    )
    validation.check_config("config", config, PagedDecodeConfig)
    out_dtype, out_scale = validation.check_output(out_dtype, out_scale, q.dtype)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if q.shape[0] == 0:  # an empty batch: no kernel launch of zero programs
        out = jnp.zeros(q.shape, out_dtype)
        return (out, jnp.zeros(q.shape[:2], jnp.float32)) if return_lse else out

    def run(impl):
        if impl == "xla":
            out, lse = reference.paged_decode_reference(
                q,
                cache,
                block_tables,
                context_lens,
                window=window,
                sink_tokens=sink_tokens,
                alibi_slopes=alibi_slopes,
                soft_cap=soft_cap,
                scale=scale,
                return_lse=True,
                cache_indirection=cache_indirection,
                out_dtype=out_dtype,
                out_scale=out_scale,
            )
        else:
            out, lse = _pallas(
                q,
                cache,
                block_tables,
                context_lens,
                cache_indirection,
                alibi_slopes,
                window,
                sink_tokens,
                soft_cap,
                scale,
                config,
                out_dtype,
                out_scale,
            )
        return (out, lse) if return_lse else out

    return run_first(implementation, run)


def default_decode_config(
    cache: PagedKVCache,
    batch: int,
    max_context: int,
    query_group: int = 0,
    rope_on_read: bool = False,
) -> PagedDecodeConfig:
    """The decode kernel's tiling for `batch` rows over `cache` with tables of `max_context`
    tokens when none is given: `PagedDecodeConfig.for_format` of the cache's format;
    `query_group`: query heads a kv head serves (0: not known); `rope_on_read`: the
    kernel rotates keys on read (`PagedDecodeConfig.heuristic`)."""
    return PagedDecodeConfig.for_format(
        cache_format(cache), cache.head_dim, batch, cache.num_kv_heads, max_context,
        cache.page_size, query_group=query_group, rope_on_read=rope_on_read,
    )  # fmt: skip


def cache_format(cache: PagedKVCache) -> CacheFormat:
    """What the kernels need to know of a cache's pools (`pallas_kernels.cache_read`):
    its quantized format, with group_size 0 when one group spans the row."""
    quant = cache.quant
    if quant is None:
        return CacheFormat()
    groups = quant.num_groups(cache.head_dim)
    return CacheFormat(quant.dtype, quant.granularity, 0 if groups == 1 else quant.group_size)


def _pallas(
    q,
    cache,
    block_tables,
    context_lens,
    cache_indirection,
    alibi_slopes,
    window,
    sink_tokens,
    soft_cap,
    scale,
    config,
    out_dtype,
    out_scale,
):
    """The decode kernel, shard-local on a query split by heads (and by sequence, without
    beams) and a cache split by kv head (`jaxattn.parallel.shard_cache`)."""
    batch = None if cache_indirection is not None else BATCH  # beams index across rows
    pool = (None, KV_HEADS, None, None)
    scales = () if cache.k_scales is None or cache.k_scales.ndim == 0 else pool
    alibi = None if alibi_slopes is None else jnp.asarray(alibi_slopes)
    static = dict(
        window=window,
        sink_tokens=sink_tokens,
        soft_cap=soft_cap,
        scale=scale,
        config=config,
        out_dtype=out_dtype,
        quant=cache.quant,
    )
    return run_sharded(
        functools.partial(_pallas_local, **static),
        (
            q,
            cache.k_pages,
            cache.v_pages,
            cache.k_scales,
            cache.v_scales,
            block_tables,
            context_lens,
            cache_indirection,
            alibi,
            out_scale,
        ),
        (
            (batch, HEADS, None),
            pool,
            pool,
            scales,
            scales,
            (batch, None),
            (batch,),
            (None, None, None),
            (HEADS,),
            (),
        ),
        (Out((batch, HEADS, None)), Out((batch, HEADS))),
        name="paged_decode",
    )


def _pallas_local(
    q,
    k_pages,
    v_pages,
    k_scales,
    v_scales,
    block_tables,
    context_lens,
    cache_indirection,
    alibi_slopes,
    out_scale,
    *,
    window,
    sink_tokens,
    soft_cap,
    scale,
    config,
    out_dtype,
    quant,
):
    cache = PagedKVCache(
        k_pages=k_pages, v_pages=v_pages, k_scales=k_scales, v_scales=v_scales, quant=quant
    )
    fp8 = out_dtype == validation.FP8_OUT
    if fp8:
        validation.check_fp8_kernel_output()
    fmt = cache_format(cache)
    if config is None:
        config = default_decode_config(
            cache, q.shape[0], block_tables.shape[1] * cache.page_size,
            query_group=q.shape[1] // cache.num_kv_heads,
        )  # fmt: skip
    params = DecodeParams(
        window=None if window is None else int(window),
        sink_tokens=int(sink_tokens),
        soft_cap=None if soft_cap is None else float(soft_cap),
        scale=scale,
    )
    return _paged_decode_kernel(
        q,
        cache.k_pages,
        cache.v_pages,
        block_tables,
        context_lens,
        k_scales=cache.k_scales,
        v_scales=cache.v_scales,
        alibi_slopes=alibi_slopes,
        cache_indirection=cache_indirection,
        params=params,
        config=config,
        fmt=fmt,
        out_dtype=out_dtype if fp8 else None,
        out_scale=out_scale,
        interpret=use_interpret(),
    )


def contiguous_kv_cache(
    k: Float[Array, "B Hkv S D"], v: Float[Array, "B Hkv S D"]
) -> tuple[PagedKVCache, Int[Array, "B 1"]]:
    """TensorRT-LLM's contiguous cache (`[max_batch, 2, Hkv, max_seq, D]`, K and V split)
    as a paged cache of one `max_seq`-token page per sequence, plus its block tables.

    A free reshape: the page layout `[N, Hkv, P, D]` is exactly `[B, Hkv, S, D]`. Slot of
    position t of sequence b (for `write_kv`): `b * S + t`.
    """
    if k.ndim != 4 or k.shape != v.shape:
        raise ValueError(f"{k.shape=} and {v.shape=}: expected equal shapes [B, Hkv, S, D]")
    tables = jnp.arange(k.shape[0], dtype=jnp.int32)[:, None]
    return PagedKVCache(k, v), tables


def validate_page_table(
    cache: PagedKVCache,
    block_tables: Int[Array, "B max_pages"],
    context_lens: Int[Array, " B"],
    cache_indirection: Int[Array, "Bw W L"] | None = None,
) -> dict[str, jax.Array]:
    """Data-dependent checks (jittable), each a bool per sequence `[B]` (True = fine).

    - `length_in_capacity`: `0 <= context_lens[b] <= max_pages * page_size`, judged in
      the lengths' own dtype (an int64 or uint32 length past int32 does not wrap).
    - `pages_in_range`: every page the sequence uses (`ceil(len / P)` entries) is in
      `[0, num_pages)`.
    - `pages_exclusive`: none of its pages is used by another sequence (beams sharing a
      prefix legitimately fail this one).
    With `cache_indirection` (`paged_decode`'s, `[B // W, W, L]`), for the entries a row
    reads (tokens `t < min(context_lens[b], L)`):
    - `indirection_in_range`: each names a beam of the row's request, in `[0, W)` (the
      kernels clamp others into that range: a wrong beam, read silently);
    - `indirection_sources_hold`: the row each names (clamped as the kernels do) holds
      token t (`t < its length`; else its block table's entry for t is read, whatever
      page that is).
    A window is not taken into account: entries below a row's window are checked,
    though no implementation lets them change the output.
    Use `{k: bool(v.all()) for k, v in report.items()}` on the host to see what is wrong.
    """
    page_size, num_pages = cache.page_size, cache.num_pages
    max_pages = block_tables.shape[1]
    capacity = max_pages * page_size
    # judged in its own dtype (an int64 or uint32 length past int32 must not wrap; narrower
    # ones widened first, so that the bounds fit), then clipped into int32: a negative
    # length reads nothing, one past capacity every page
    if jnp.iinfo(context_lens.dtype).bits < 32:
        context_lens = context_lens.astype(jnp.int32)
    capacity_ok = (context_lens >= 0) & (context_lens <= capacity)
    lens = jnp.clip(context_lens, 0, np.iinfo(np.int32).max).astype(jnp.int32)
    pages_read = (jnp.minimum(lens, capacity) + page_size - 1) // page_size
    used = jnp.arange(max_pages)[None, :] < pages_read[:, None]
    in_range = (block_tables >= 0) & (block_tables < num_pages)
    pages_ok = jnp.all(in_range | ~used, axis=1)
    ids = jnp.where(used & in_range, block_tables, num_pages)  # unused -> a sentinel bin
    counts = jnp.zeros(num_pages + 1, jnp.int32).at[ids.reshape(-1)].add(1)
    exclusive = jnp.all((counts[ids] <= 1) | ~(used & in_range), axis=1)
    report = dict(length_in_capacity=capacity_ok, pages_in_range=pages_ok,
                  pages_exclusive=exclusive)  # fmt: skip
    if cache_indirection is not None:
        report.update(_indirection_report(cache_indirection, lens))
    return report


def _check_indirection(indirection, batch: int) -> None:
    """`cache_indirection` is `[B // beam_width, beam_width, max_len]` of an integer dtype,
    for `batch` = B rows."""
    shape = indirection.shape
    if len(shape) != 3 or shape[0] * shape[1] != batch or shape[2] < 1:
        raise ValueError(
            f"cache_indirection.shape={shape} for a batch of {batch} rows: expected "
            "[B // beam_width, beam_width, max_len] with max_len >= 1"
        )
    if not np.issubdtype(indirection.dtype, np.integer):
        raise ValueError(f"cache_indirection.dtype={indirection.dtype}: expected int")


def _indirection_report(indirection, lens) -> dict[str, jax.Array]:
    """`validate_page_table`'s indirection checks, `[B]` each."""
    _check_indirection(indirection, lens.shape[0])
    requests, width, ind_len = indirection.shape
    ids = indirection.reshape(requests * width, ind_len)  # [B, L], in its own dtype:
    in_range = (ids >= 0) & (ids < width)  # an int64 id is judged before any cast
    src = jnp.clip(ids, 0, width - 1).astype(jnp.int32)  # the beam the kernels read
    t = jnp.arange(ind_len)
    read = t[None, :] < lens[:, None]  # the entries a row reads
    rows = jnp.arange(requests * width)
    source = rows[:, None] - rows[:, None] % width + src
    holds = t[None, :] < lens[source]
    return dict(
        indirection_in_range=jnp.all(in_range | ~read, axis=1),
        indirection_sources_hold=jnp.all(holds | ~read, axis=1),
    )
