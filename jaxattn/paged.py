"""In-flight batching: `paged_attention`, one call for the context and generation tokens of
a serving step over the paged KV cache (TensorRT-LLM's `gpt_attention`, OpenPPL's
`MultiHeadCacheAttention`).

The step's tokens are packed (`AttentionMetadata`): rows in any order, each a context
chunk or a generation token. The op rotates q and k (RoPE at `meta.positions`; with
`rope_on_read`, StreamingLLM, the kernels rotate on read instead: `jaxattn.streaming`),
writes k and v into the cache (quantizing), and attends:

- generation rows (one new token) run the paged-decode kernel over the updated cache (a
  `decode_only` plan runs that kernel alone);
- context rows (several new tokens) run the flash kernel, reading the cached prefix from
  the pages (dequantized on load) and the new keys from the packed input, rounded to what
  the cache stores, so a prompt processed in chunks attends to the same values as in one
  pass. The prefix is read from the cache as it was before the write only in a cyclic
  cache, where a long chunk may overwrite slots its own first queries still need. Long
  chunks (`PagedAttentionConfig.gather_min_tokens` new tokens over a prefix) attend over
  a contiguous copy of their history instead, in a second launch (`jaxattn.history`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, Float

from jaxattn import history, reference, streaming, validation
from jaxattn.cache import PagedKVCache, write_kv_stored
from jaxattn.decode import cache_format, default_decode_config
from jaxattn.dispatch import run_first
from jaxattn.metadata import AttentionMetadata
from jaxattn.parallel.partition import HEADS, KV_HEADS, Out, run_sharded
from jaxattn.positional import RelativeBias
from jaxattn.rope import DynamicNTKScaling, RoPE, apply_rope, token_rotations
from pallas_kernels.common import use_interpret
from pallas_kernels.flash_prefill import (
    Batch,
    CachedPrefix,
    FlashPrefillConfig,
    LogitParams,
    flash_prefill,
)
from pallas_kernels.history_gather import history_gather
from pallas_kernels.paged_decode import (
    DecodeParams,
    PagedDecodeConfig,
    paged_decode,
)

__all__ = ["PagedAttentionConfig", "paged_attention", "paged_attention_qkv"]


@dataclasses.dataclass(frozen=True)
class PagedAttentionConfig:
    """Tilings of the two kernels of `paged_attention` (None picks each one's heuristic)
    and the history gather of long chunks (`jaxattn.history`).

    Attributes:
      prefill, decode: `FlashPrefillConfig`, `PagedDecodeConfig` or None.
      gather_tokens: rows of the history buffer: context rows with a cached prefix and at
        least `gather_min_tokens` new tokens whose histories fit (in batch order) attend
        over a contiguous copy of them; None: the plan's capacity `max_pages * page_size`,
        at most 32768 rows and 256 MiB; 0: never. The buffer holds K and V,
        `2 * G * Hkv * D` values of q's dtype; only the rows used are copied. Not with
        a window, a cyclic cache, `rope_on_read` or a T5 bias (every row keeps the paged
        loop there).
      gather_min_tokens: new tokens a row needs to be gathered.
    """

    prefill: FlashPrefillConfig | None = None
    decode: PagedDecodeConfig | None = None
    gather_tokens: int | None = None
    gather_min_tokens: int = history.DEFAULT_MIN_TOKENS

    def __post_init__(self):
        validation.check_paged_prefill("PagedAttentionConfig: prefill", self.prefill)
        validation.check_config("PagedAttentionConfig: decode", self.decode, PagedDecodeConfig)
        if self.gather_tokens is not None and self.gather_tokens < 0:
            raise ValueError(f"PagedAttentionConfig: gather_tokens={self.gather_tokens} < 0")
        if self.gather_min_tokens < 2:
            raise ValueError(
                f"PagedAttentionConfig: gather_min_tokens={self.gather_min_tokens}: a "
                "context row has at least 2 new tokens"
            )


@dataclasses.dataclass(frozen=True)
class _Options:
    window: int | None
    sink_tokens: int
    soft_cap: float | None
    scale: float


def _check(q, k, v, cache, meta, rope, options, alibi_slopes, relative_bias):
    if not isinstance(meta, AttentionMetadata):
        raise ValueError(f"meta: expected a jaxattn.AttentionMetadata, got {type(meta)}")
    validation.check_qkv(q, k, v, packed=True)
    num_tokens, num_q_heads, head_dim = q.shape
    if k.shape[0] != num_tokens:
        raise ValueError(f"{q.shape=} and {k.shape=}: q and k/v need one token count T")
    validation.check_cache(q, cache, k=k)
    if meta.page_size is not None and meta.page_size != cache.page_size:
        raise ValueError(
            f"meta.page_size={meta.page_size}, cache.page_size={cache.page_size}: the plan's "
            "slots are pages of the manager's size, which must be the cache's"
        )
    S, M = meta.max_seqs, meta.max_pages
    for name, x, want in (
        ("meta.positions", meta.positions, (num_tokens,)),
        ("meta.slot_mapping", meta.slot_mapping, (num_tokens,)),
        ("meta.cu_seqlens_q", meta.cu_seqlens_q, (S + 1,)),
        ("meta.seq_ids", meta.seq_ids, (S,)),
        ("meta.block_tables", meta.block_tables, (S, M)),
    ):
        if x.shape != want or not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(
                f"{name}: {x.shape} {x.dtype}, expected int {list(want)} for {q.shape=} "
                f"and {meta.context_lens.shape=} (T tokens, S rows)"
            )
    if rope is not None:
        if not isinstance(rope, RoPE):
            raise ValueError(f"rope: expected a jaxattn.RoPE or None, got {type(rope)}")
        rope.rotary_dim_for(head_dim)  # raises for an odd or too large rotary_dim
    validation.check_options(
        num_q_heads=num_q_heads,
        window=options.window,
        sink_tokens=options.sink_tokens,
        alibi_slopes=alibi_slopes,
        relative_bias=relative_bias,
        soft_cap=options.soft_cap,
        scale=options.scale,
    )
    if meta.ring is not None:
        kept, size = meta.ring
        if options.window is None or options.window > size or options.sink_tokens > kept:
            raise ValueError(
                f"window={options.window}, sink_tokens={options.sink_tokens}: a cyclic cache "
                f"(meta.ring={meta.ring}, kept positions and ring size) needs a window <= "
                f"{size} and at most {kept} sink tokens"
            )


def paged_attention(
    q: Float[Array, "T Hq D"],
    k: Float[Array, "T Hkv D"] | None,
    v: Float[Array, "T Hkv D"] | None,
    cache: PagedKVCache,
    meta: AttentionMetadata,
    *,
    rope: RoPE | None = None,
    rope_on_read: bool = False,
    window: int | None = None,
    sink_tokens: int = 0,
    alibi_slopes: Float[Array, " Hq"] | None = None,
    soft_cap: float | None = None,
    scale: float | None = None,
    relative_bias: RelativeBias | None = None,
    return_lse: bool = False,
    implementation: str | Sequence[str] | None = None,
    config: PagedAttentionConfig | None = None,
    out_dtype: DTypeLike | None = None,
    out_scale: float | Float[Array, ""] | None = None,
):
    """Attention of a packed serving step (context and generation rows) over the cache.

    Args:
      q: `[T, Hq, D]`, the step's query tokens, packed as `meta.cu_seqlens_q` says, in the
        cache's dtype (a quantized cache: any float dtype of 16 bits or more). Or, with
        k = v = None, the step's fused projection `[T, Hq + 2 * Hkv, D]` (q heads, then k,
        then v heads; Hkv the cache's), which a decode-only plan's kernel reads in place.
      k, v: `[T, Hkv, D]`, the step's new keys and values (same dtype as q), or None.
      cache: the `PagedKVCache` (plain or quantized) holding every row's cached prefix.
      meta: the step's `AttentionMetadata` (rows, lengths after the step, pages, positions,
        slots); build it once per step, pass it to every layer.
      rope: rotate q and k at `meta.positions` (`jaxattn.RoPE`) before writing k; None: q
        and k come rotated (or the model has no RoPE).
      rope_on_read: StreamingLLM (needs `rope`; not with DynamicNTKScaling): the cache
        stores k un-rotated, and the kernels rotate q and the keys they read at their
        positions *within the cache*: for a query at position p, with
        `o = max(0, p - window + 1 - sink_tokens)` tokens evicted between the sinks and the
        window (o = 0 without a window), the query sits at `p - o`, key j at `j` if
        `j < sink_tokens`, else at `j - o`; angles stay below `window + sink_tokens`
        however long the sequence grows (`jaxattn.streaming`). ALiBi and T5 terms keep
        the absolute positions. Pair it with a cyclic cache (`KVCacheManager.create(...,
        window=, sink_tokens=)`) for unbounded generation in bounded memory.
      window, sink_tokens, alibi_slopes, soft_cap, scale, relative_bias: as
        `jaxattn.attention` (positions within each sequence; the attention is causal,
        bottom-right aligned). A cyclic cache (`meta.ring`) needs `window <= ring size`.
      return_lse: also return the natural log-sum-exp, float32 `[Hq, T]`.
      implementation: "pallas", "xla" (the reference), a list tried in order, or None.
      config: `PagedAttentionConfig` with the kernels' tilings, or None (heuristics).
      out_dtype, out_scale: None, or `jnp.float8_e4m3fn` with a float32 scalar scale: FP8
        output `clip(out * (1 / out_scale), -448, 448)` rounded to e4m3, as
        `jaxattn.attention`, quantized in both kernels' epilogues (e.g. for an FP8 output
        projection). The cache and lse are unaffected.

    Returns:
      `(out [T, Hq, D], cache)`: out in `out_dtype` (default q's), zeros for padding
      tokens (and lse float32 with `return_lse`); the cache
      with the new tokens written (in place when the caller donates it to `jax.jit`).
    """
    qkv = None
    if k is None and v is None:
        qkv, (q, k, v) = q, split_qkv(q, cache.num_kv_heads)
    options = _Options(
        window=None if window is None else int(window),
        sink_tokens=int(sink_tokens),
        soft_cap=None if soft_cap is None else float(soft_cap),
        scale=q.shape[-1] ** -0.5 if scale is None else float(scale),
    )
    _check(q, k, v, cache, meta, rope, options, alibi_slopes, relative_bias)
    validation.check_config("config", config, PagedAttentionConfig)
    streaming.check_rope_on_read(rope, rope_on_read)
    read_rope = rope if rope_on_read else None
    out_dtype, out_scale = validation.check_output(out_dtype, out_scale, q.dtype)
    # Ordinary RoPE: k before the write (fused into it); q rotated in XLA. A decode-only
    # plan over a plain cache runs the decode kernel alone, which rotates q and k on load
    # and writes k and v itself (`_fused_write`); over other caches it rotates q on load.
    rotate = rope is not None and not rope_on_read
    on_load = rotate and meta.decode_only and relative_bias is None
    fused_write = _fused_write(cache, meta, relative_bias, rope_on_read)
    result = lambda out, lse: (out, lse) if return_lse else out  # noqa: E731

    def step(impl, q, k, v, cache, meta, alibi_slopes, rel_table, out_scale):
        relative_bias = None if rel_table is None else dataclasses.replace(rel, table=rel_table)
        # DynamicNTKScaling: each token at its own sequence's length after the step, so
        # that no row's rotation depends on the other rows of the step.
        dynamic = rotate and isinstance(rope.scaling, DynamicNTKScaling)
        seq_len = meta.context_lens[meta.token_rows()[0]] if dynamic else None
        rotations = None
        if impl == "pallas" and on_load:
            rotations = token_rotations(meta.positions, rope, head_dim, seq_len=seq_len)
        if impl == "pallas" and fused_write:
            out, lse, new_cache = _pallas_fused_write(
                q, (k, v), cache, meta, options, alibi_slopes, config, out_dtype, out_scale,
                q_rotations=rotations,
            )  # fmt: skip
            return out, lse, new_cache
        if k is None:  # the fused projection, on a path that reads it split
            q, k, v = split_qkv(q, cache.num_kv_heads)
        k_in = apply_rope(k, meta.positions, rope, seq_len=seq_len) if rotate else k
        new_cache, k_new, v_new = write_kv_stored(cache, k_in, v, meta.slot_mapping, q.dtype)
        rotate_q = rotate and rotations is None
        q_in = apply_rope(q, meta.positions, rope, seq_len=seq_len) if rotate_q else q
        if impl == "xla":
            out, lse = reference.paged_attention_reference(
                q_in,
                k_new,
                v_new,
                cache,
                meta,
                window=options.window,
                sink_tokens=options.sink_tokens,
                alibi_slopes=alibi_slopes,
                soft_cap=options.soft_cap,
                scale=options.scale,
                relative_bias=relative_bias,
                read_rope=read_rope,
                return_lse=True,
                out_dtype=out_dtype,
                out_scale=out_scale,
            )
        else:
            # A cyclic chunk may overwrite prefix slots its own first queries still read.
            prefix_cache = cache if meta.ring is not None else new_cache
            out, lse = _pallas(
                q_in,
                k_new,
                v_new,
                prefix_cache,
                new_cache,
                meta,
                options,
                alibi_slopes,
                relative_bias,
                config,
                out_dtype,
                out_scale,
                read_rope=read_rope,
                q_rotations=rotations,
            )
        return out, lse, new_cache

    rel = relative_bias
    head_dim = q.shape[-1]
    # The fused projection is read in place only by the fused-write decode kernel.
    fused_in = qkv is not None and fused_write
    operands = (
        qkv if fused_in else q,
        None if fused_in else k,
        None if fused_in else v,
        cache,
        meta,
        None if alibi_slopes is None else jnp.asarray(alibi_slopes, jnp.float32),
        None if rel is None else rel.table,
        out_scale,
    )

    def run(impl):
        if impl == "xla":
            out, lse, new_cache = step(impl, *operands)
        else:
            out, lse, new_cache = _sharded_step(functools.partial(step, impl), operands)
        return result(out, lse), new_cache

    return run_first(implementation, run)


def _sharded_step(step, operands):
    """`step(*operands)` shard-local when q is split by heads and the cache by kv head
    (`jaxattn.parallel.partition`). The fused projection `[T, Hq + 2 Hkv, D]` interleaves
    no per-shard groups, so its heads are never split: under tensor parallelism pass q, k
    and v."""
    q, k, v, cache, meta, alibi, table, out_scale = operands
    fused = k is None
    pool = lambda x: (None, KV_HEADS, None, None) if x.ndim == 4 else (None,) * x.ndim  # noqa: E731
    cache_leaves, cache_def = jax.tree.flatten(cache)
    meta_leaves, meta_def = jax.tree.flatten(meta)
    n_cache, n_meta = len(cache_leaves), len(meta_leaves)
    heads = None if fused else HEADS
    roles = [
        (None, heads, None),
        (None, KV_HEADS, None),
        (None, KV_HEADS, None),
        *(pool(x) if not fused else (None,) * x.ndim for x in cache_leaves),
        *((None,) * jnp.ndim(x) for x in meta_leaves),
        (HEADS,),
        (HEADS, None),
        (),
    ]

    def local(q, k, v, *rest):
        cache = jax.tree.unflatten(cache_def, rest[:n_cache])
        meta = jax.tree.unflatten(meta_def, rest[n_cache : n_cache + n_meta])
        alibi, table, out_scale = rest[n_cache + n_meta :]
        out, lse, new_cache = step(q, k, v, cache, meta, alibi, table, out_scale)
        return (out, lse, *jax.tree.leaves(new_cache))

    results = run_sharded(
        local,
        (q, k, v, *cache_leaves, *meta_leaves, alibi, table, out_scale),
        roles,
        (Out((None, heads, None)), Out((heads, None)), *(Out(r) for r in roles[3 : 3 + n_cache])),
        name="paged_attention",
    )
    out, lse, *new_leaves = results
    return out, lse, jax.tree.unflatten(cache_def, new_leaves)


def _fused_write(cache, meta, relative_bias, rope_on_read) -> bool:
    """Whether the decode kernel writes the step's K/V itself: a decode-only plan (no T5
    bias) over a plain, non-cyclic cache without rotation on read."""
    plain = cache.quant is None and meta.ring is None and not rope_on_read
    return meta.decode_only and relative_bias is None and plain


def paged_attention_qkv(
    qkv: Float[Array, "T F"],
    cache: PagedKVCache,
    meta: AttentionMetadata,
    *,
    num_q_heads: int,
    num_kv_heads: int,
    **options,
):
    """`paged_attention` on a fused projection `qkv[T, (Hq + 2 * Hkv) * D]`: q is the
    first `Hq * D` columns, then k (`Hkv * D`), then v. Same options (`out_dtype` and
    `out_scale` included) and results; a decode-only plan's kernel reads q, k and v in
    place (no copies of the slices)."""
    if qkv.ndim != 2 or qkv.shape[1] % (num_q_heads + 2 * num_kv_heads):
        raise ValueError(
            f"{qkv.shape=}: expected [T, (num_q_heads + 2 * num_kv_heads) * D] with "
            f"{num_q_heads=}, {num_kv_heads=}"
        )
    if num_kv_heads != cache.num_kv_heads:
        raise ValueError(f"{num_kv_heads=} but the cache has {cache.num_kv_heads} kv heads")
    head_dim = qkv.shape[1] // (num_q_heads + 2 * num_kv_heads)
    qkv = qkv.reshape(qkv.shape[0], num_q_heads + 2 * num_kv_heads, head_dim)
    return paged_attention(qkv, None, None, cache, meta, **options)


def split_qkv(qkv: Float[Array, "T H D"], num_kv_heads: int):
    """q `[T, Hq, D]`, k, v `[T, Hkv, D]` of a fused projection `[T, Hq + 2 * Hkv, D]`."""
    heads = qkv.shape[1] - 2 * num_kv_heads if qkv.ndim == 3 else 0
    if heads <= 0 or heads % num_kv_heads:
        raise ValueError(
            f"{qkv.shape=}: a fused projection [T, Hq + 2 * Hkv, D] with Hkv = "
            f"{num_kv_heads} (the cache's) and Hq a multiple of it (k = v = None)"
        )
    return qkv[:, :heads], qkv[:, heads : heads + num_kv_heads], qkv[:, heads + num_kv_heads :]


def _pallas(
    q,
    k_new,
    v_new,
    prefix_cache,
    cache,
    meta,
    options,
    alibi_slopes,
    relative_bias,
    config,
    out_dtype,
    out_scale,
    read_rope=None,
    q_rotations=None,
):
    """Decode kernel for one-token rows, flash kernel (prefix from pages) for the others.
    With T5 relative bias (which the decode kernel lacks) every row takes the flash kernel.
    An FP8 output is quantized by each kernel's epilogue; the merge below only selects.
    `q_rotations` (`jaxattn.rope.TokenRotations`, decode-only plans): q comes un-rotated,
    and the decode kernel rotates it on load."""
    quant_out = _kernel_output(out_dtype, out_scale)
    config = config or PagedAttentionConfig()
    num_tokens, _, head_dim = q.shape
    fmt = cache_format(cache)
    rows, real = meta.token_rows()
    q_lens, cu = meta.q_lens, meta.cu_seqlens_q
    decode_rows = (q_lens == 1) if relative_bias is None else jnp.zeros_like(q_lens, bool)
    interpret = use_interpret()

    # Context rows: a packed batch; decode rows and padding rows get no tiles.
    ctx_q = jnp.where(decode_rows, 0, q_lens)
    batch = Batch(
        q_len=ctx_q,
        kv_len=jnp.where(decode_rows, 0, meta.context_lens),
        q_start=cu[:-1],
        q_rows=ctx_q,
        k_start=cu[:-1],
        dense=False,
    )
    tiles = FlashPrefillConfig.heuristic(
        num_tokens,
        meta.max_pages * cache.page_size,
        head_dim,
        q.dtype,
        True,
        lengths=True,
        packed=True,
        logit_tiles=relative_bias is not None,
        paged=True,
    )
    if read_rope is not None:
        # Rotating on read adds float32 cos/sin tiles [block_kv, D] per pipeline stage and
        # up to four rotated query tiles: the paged tiling (128 x 64, 3 stages) asks for
        # 304 KiB of shared memory (H100: 227 KiB), 128 x 32 in 2 stages still 336 KiB
        # with INT4 group scales. 64 x 32, loads not pipelined.
        tiles = dataclasses.replace(
            tiles, block_q=min(tiles.block_q, 64), block_kv=min(tiles.block_kv, 32), num_stages=1
        )
    prefill_config = (config.prefill or FlashPrefillConfig()).fill(tiles)
    rope = _rope_tables(read_rope, q, meta, cache, options, prefill_config.block_q)
    rel = relative_bias
    context = functools.partial(
        flash_prefill,
        cached=CachedPrefix(
            prefix_cache.k_pages,
            prefix_cache.v_pages,
            meta.block_tables,
            prefix_cache.k_scales,
            prefix_cache.v_scales,
            fmt=fmt,
            ring=meta.ring,
        ),
        alibi_slopes=None if alibi_slopes is None else jnp.asarray(alibi_slopes, jnp.float32),
        rel_table=None if rel is None else rel.table.astype(jnp.float32),
        rope=rope,
        params=LogitParams(
            causal=True,
            window=options.window,
            sink_tokens=options.sink_tokens,
            soft_cap=options.soft_cap,
            scale=options.scale,
            rel_max_distance=0 if rel is None else rel.max_distance,
            rel_bidirectional=False if rel is None else rel.bidirectional,
        ),
        config=prefill_config,
        return_lse=True,
        interpret=interpret,
        **quant_out,
    )
    if relative_bias is not None:  # every row takes the flash kernel
        return _zero_padding(*context(q, k_new, v_new, batch), real, out_dtype)
    query_group = q.shape[1] // cache.num_kv_heads
    decode = _decode_kernel(cache, meta, options, alibi_slopes, config, fmt, quant_out,
                            interpret, rope=rope, query_group=query_group)  # fmt: skip
    if meta.decode_only:
        out, lse = _decode_tokens(decode, q, meta, decode_rows, rope=rope, q_rope=q_rotations)
        return out, lse.T
    # Context rows: the flash kernel; generation rows: each row's one token, over the
    # cache after the write.
    gather_rows = 0
    if options.window is None and read_rope is None:  # (a cyclic cache has a window)
        row_bytes = 2 * k_new.shape[1] * head_dim * q.dtype.itemsize
        gather_rows = history.buffer_rows(
            meta, cache.page_size, config.gather_tokens, config.gather_min_tokens, row_bytes
        )
    if gather_rows:  # long chunks over their gathered histories, the rest paged
        out_p, lse_p = _gathered(context, q, k_new, v_new, batch, prefix_cache, meta, fmt,
                                 ~decode_rows, gather_rows, config, interpret)  # fmt: skip
    else:
        out_p, lse_p = context(q, k_new, v_new, batch)
    first = jnp.minimum(cu[:-1], num_tokens - 1)
    out_d, lse_d = decode(
        q[first],
        block_tables=meta.block_tables,
        context_lens=jnp.where(decode_rows, meta.context_lens, 0),
        rope=None if rope is None else rope.take(first),
    )
    from_decode = decode_rows[rows]
    out = jnp.where(from_decode[:, None, None], out_d[rows], out_p)
    lse = jnp.where(from_decode[None, :], lse_d[rows].T, lse_p)
    return _zero_padding(out, lse, real, out_dtype)


def _kernel_output(out_dtype, out_scale) -> dict:
    """The kernels' `out_dtype`/`out_scale` arguments: FP8 output quantized in their
    epilogues (where the GPU can), else None (q's dtype)."""
    fp8 = out_dtype == validation.FP8_OUT
    if fp8:
        validation.check_fp8_kernel_output()
    return dict(out_dtype=out_dtype if fp8 else None, out_scale=out_scale)


def _decode_kernel(cache, meta, options, alibi_slopes, config, fmt, quant_out, interpret, rope,
                   query_group=0):  # fmt: skip
    """`paged_decode` over `cache` with the step's options, and its tiling: `config.decode`
    or the heuristic for the plan's rows (its tokens when decode-only); `query_group`:
    query heads a kv head serves (0: not known)."""
    decode_config = config.decode or default_decode_config(
        cache,
        meta.max_tokens if meta.decode_only else meta.max_seqs,
        meta.max_pages * cache.page_size,
        query_group,
        rope_on_read=rope is not None,
    )
    return functools.partial(
        paged_decode,
        k_pages=cache.k_pages,
        v_pages=cache.v_pages,
        k_scales=cache.k_scales,
        v_scales=cache.v_scales,
        alibi_slopes=None if alibi_slopes is None else jnp.asarray(alibi_slopes),
        params=DecodeParams(
            window=options.window,
            sink_tokens=options.sink_tokens,
            soft_cap=options.soft_cap,
            scale=options.scale,
            ring=meta.ring,
        ),
        config=decode_config,
        fmt=fmt,
        interpret=interpret,
        **quant_out,
    )


def _decode_tokens(decode, q, meta, decode_rows, **kwargs):
    """A decode-only plan: token t is the one new token of row rows[t], so the kernel's
    batch is the tokens themselves, q read and the output written in place (no row
    gathers around the kernel). Padding tokens get length 0: zeros and lse -inf."""
    rows, real = meta.token_rows()
    lens = jnp.where(real & decode_rows[rows], meta.context_lens[rows], 0)
    return decode(q, block_tables=meta.block_tables[rows], context_lens=lens, **kwargs)


def _pallas_fused_write(q, new_kv, cache, meta, options, alibi_slopes, config, out_dtype,
                        out_scale, q_rotations):  # fmt: skip
    """A decode-only step in one kernel: each token's k (rotated on load with q when
    `q_rotations`) and v are attended from the inputs and stored at `meta.slot_mapping`
    (padding tokens: slot -1, not stored) by `paged_decode(new_kv=...)`, in place.
    new_kv: (k, v), or (None, None) with q the fused projection `[T, Hq + 2 * Hkv, D]`.
    Returns (out `[T, Hq, D]`, lse `[Hq, T]`, the cache)."""
    quant_out = _kernel_output(out_dtype, out_scale)
    decode = _decode_kernel(cache, meta, options, alibi_slopes, config or PagedAttentionConfig(),
                            cache_format(cache), quant_out, use_interpret(), rope=None)  # fmt: skip
    out, lse, k_pages, v_pages = _decode_tokens(
        decode, q, meta, meta.q_lens == 1, q_rope=q_rotations, new_kv=(*new_kv, meta.slot_mapping)
    )
    new_cache = dataclasses.replace(cache, k_pages=k_pages, v_pages=v_pages)
    return out, lse.T, new_cache


def _gathered(context, q, k_new, v_new, batch, cache, meta, fmt, context_rows, num_rows,
              config, interpret):  # fmt: skip
    """The context rows' flash attention in two launches into one output: the rows
    `history.plan` chooses over a contiguous copy of their histories (packed, no cache),
    the others paged."""
    gather = history.plan(meta, context_rows, cache.page_size, num_rows, config.gather_min_tokens)
    k_hist, v_hist = history_gather(
        gather.sources,
        cache.k_pages,
        cache.v_pages,
        k_new,
        v_new,
        k_scales=cache.k_scales,
        v_scales=cache.v_scales,
        fmt=fmt,
        interpret=interpret,
    )
    chosen = gather.chosen
    only = lambda x, rows: jnp.where(rows, x, 0)  # noqa: E731
    packed = dataclasses.replace(
        batch, q_len=only(batch.q_len, chosen), q_rows=only(batch.q_rows, chosen),
        k_start=gather.starts,
    )  # fmt: skip
    paged = dataclasses.replace(
        batch, q_len=only(batch.q_len, ~chosen), q_rows=only(batch.q_rows, ~chosen)
    )
    num_tokens, _, head_dim = q.shape
    packed_config = (config.prefill or FlashPrefillConfig()).resolve(
        num_tokens, num_rows, head_dim, q.dtype, True, lengths=True
    )
    into = context(q, k_new, v_new, paged)
    return context(q, k_hist, v_hist, packed, cached=None, config=packed_config, into=into)


def _zero_padding(out, lse, real, out_dtype):
    """Padding tokens, which no flash tile writes: zeros and lse -inf."""
    out = jnp.where(real[:, None, None], out, jnp.zeros((), out_dtype)).astype(out_dtype)
    return out, jnp.where(real[None, :], lse, -jnp.inf)


def _rope_tables(read_rope, q, meta, cache, options, block_q):
    """The kernels' cos/sin tables and q's partner form for `rope_on_read` (or None).
    Rows: every position a kernel rotates at. With a window, positions within the cache
    stay below `window + sink_tokens`, and the flash kernel's per-tile base adds at most
    `block_q` (`pallas_kernels.rope_read`); without one, the cache's capacity."""
    if read_rope is None:
        return None
    if options.window is None:
        rows = meta.max_pages * cache.page_size
    else:
        rows = options.window + options.sink_tokens + block_q
    return streaming.rope_tables(read_rope, q, rows)
