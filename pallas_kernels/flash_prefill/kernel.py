"""Flash attention forward (context phase) as a Pallas Triton kernel.

One program computes one `[block_q, D]` tile of queries of one sequence for one query head,
streaming that sequence's keys in `[block_kv, D]` blocks with an online softmax in base 2
(FlashAttention-2, Dao 2023, algorithm 1). Dense and packed batches share the kernel: both
are passed as packed `[T, H, D]` views plus a table saying where each sequence's rows are.

Work skipping: a tile visits only the key blocks some of its rows can see (causal, window,
lengths, plus sink blocks); blocks every row sees in full run without the mask arithmetic,
after the masked ones (the online softmax takes blocks in any order).
Tiles are launched heaviest first so the long causal tiles do not form the tail. A packed
batch's tile count is a static bound (a tile per `block_q` rows, plus one per sequence for
its ragged end): there a program loops over the tiles `first + i * programs` with rows,
and the grid holds one program per `block_q` tokens plus a few, not one per potential
tile. (A serving step of 64 rows launched ~2,500 programs per layer for its 512 tiles, each
holding its shared memory until it found it had nothing to do.) When that grid holds a
program per potential tile anyway (one sequence, or a few), each takes its own tile
without the loop: 2-3% faster on a 2048-token chunk and a 16k-token packed sequence
(H100, 2026-11-22 14:30 UTC probe).

Chunked context (`CachedPrefix`): a packed sequence's first `kv_len - q_len` keys may come
from a paged KV cache instead (read through its block table, dequantized on load), and only
its new keys from the packed `k`, `v`: key blocks split into cache-only, mixed (one block at
most) and new-only runs, so each run loads from one place (`keys.py`).

FP8 output (`out_dtype=float8_e4m3fn`): the epilogue quantizes the normalised float32 tile
in the store (`paged_decode.combine.quantize_output`), never through q's dtype.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Int

from pallas_kernels import rope_read
from pallas_kernels.batch import Batch
from pallas_kernels.cache_read import CacheFormat
from pallas_kernels.common import (
    dot_width,
    softmax_finish,
    softmax_init,
    softmax_update,
    whole_array_call,
)
from pallas_kernels.flash_prefill.config import FlashPrefillConfig
from pallas_kernels.flash_prefill.keys import CacheRefs, KeyBlocks
from pallas_kernels.flash_prefill.logits import TermRefs, TileLogits
from pallas_kernels.output import FP8, inverse_scale, output_value
from pallas_kernels.tiles import (
    _K_COL,
    _K_START,
    _KV_LEN,
    _NUM_REAL,
    _Q_LEN,
    _Q_ROWS,
    _Q_START,
    _ROW,
    _SEQ,
    key_block_range,
    packed_grid,
    packed_tile_table,
)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CachedPrefix:
    """The cached keys of a packed batch: sequence b's positions below `kv_len[b] - q_len[b]`
    live in pages `block_tables[b]` of the pools (positions as `ring_position` maps them).

    k_pages, v_pages: `[N, Hkv, P, Dp]`, float or quantized as `fmt` says, with k_scales,
    v_scales (float32 `[1]` per tensor, `[N, Hkv, P, G]` per group) or None.
    block_tables: int32 `[S, M]`.
    """

    k_pages: jax.Array
    v_pages: jax.Array
    block_tables: Int[Array, "S M"]
    k_scales: jax.Array | None = None
    v_scales: jax.Array | None = None
    fmt: CacheFormat = dataclasses.field(default=CacheFormat(), metadata=dict(static=True))
    ring: tuple[int, int] | None = dataclasses.field(default=None, metadata=dict(static=True))


@dataclasses.dataclass(frozen=True)
class LogitParams:
    """Static options of the logits and mask (semantics: DESIGN.md / jaxattn.reference).

    `packed_coords`: bias/mask rows and columns are packed-array coordinates (ragged) rather
    than positions within the sequence (dense, where the bias batch index is the sequence).
    """

    causal: bool = False
    window: int | None = None
    sink_tokens: int = 0
    soft_cap: float | None = None
    scale: float = 1.0
    packed_coords: bool = False
    rel_max_distance: int = 0
    rel_bidirectional: bool = False


def _flash_prefill_kernel(
    *refs,
    params: LogitParams,
    has: tuple[bool, ...],
    block_q: int,
    block_kv: int,
    head_dim: int,
    group: int,
    dense_shape: tuple[int, int, int] | None,
    cached: tuple[CacheFormat, tuple[int, int] | None] | None,
    has_rope: bool,
    quantize: bool,
    tile_loop: bool,
    has_into: bool,
):
    has_index, has_bias, has_mask, has_alibi, has_rel, has_lse = has
    refs = list(refs)
    # Dense: q_len and kv_len [2, B] (absent: all full); packed: the tile table [tiles, 8].
    index_ref = refs.pop(0) if has_index else None
    q_ref = refs.pop(0)  # [Tq_all, Hq, D]
    k_ref, v_ref = refs.pop(0), refs.pop(0)  # [Tk_all, Hkv, D]
    cache_refs = None
    if cached is not None:  # block tables [S, M], pools [N, Hkv, P, Dp], scales or None
        table_ref, k_pool, v_pool = refs.pop(0), refs.pop(0), refs.pop(0)
        k_scale = v_scale = None
        if cached[0].dtype is not None:
            k_scale, v_scale = refs.pop(0), refs.pop(0)  # [1] or [N, Hkv, P, G]
        cache_refs = CacheRefs(table_ref, k_pool, v_pool, k_scale, v_scale, *cached)
    # RoPE on read: q' [Tq_all, Hq, D] (rope_read), cos and sin tables float32 [R, D].
    rope_refs = [refs.pop(0) for _ in range(3)] if has_rope else None
    terms = TermRefs(
        bias=refs.pop(0) if has_bias else None,  # [Bb, Hb, Rq, Rk]
        mask=refs.pop(0) if has_mask else None,  # [Bm, Hm, Rq, Rk]
        alibi=refs.pop(0) if has_alibi else None,  # [Hq]
        rel=refs.pop(0) if has_rel else None,  # [Hq, num_buckets]
        rope_tables=rope_refs[1:] if has_rope else None,
    )
    inv_ref = refs.pop(0) if quantize else None  # [1] float32: 1 / out_scale (fp8 output)
    if has_into:  # an earlier launch's out and lse, aliased to this one's
        refs = refs[2:]
    o_ref = refs.pop(0)  # [Tq_all, Hq, D]
    lse_ref = refs.pop(0) if has_lse else None  # [Hq, Tq_all]

    h = pl.program_id(0)

    def one_tile(tile):
        if dense_shape is not None:  # Heaviest row blocks first, every sequence in turn.
            num_seqs, q_rows, kv_rows_per_seq = dense_shape
            seq = tile % num_seqs
            r0 = (pl.cdiv(q_rows, block_q) - 1 - tile // num_seqs) * block_q
            q_start, k_start = seq * q_rows, seq * kv_rows_per_seq
            k_col = k_start
            # Without lengths they stay Python ints, and so do the loop bounds of full attention.
            q_len, kv_len = q_rows, kv_rows_per_seq
            if has_index:
                q_len, kv_len = index_ref[0, seq], index_ref[1, seq]
        else:
            q_start, q_rows = index_ref[tile, _Q_START], index_ref[tile, _Q_ROWS]
            q_len, k_start = index_ref[tile, _Q_LEN], index_ref[tile, _K_START]
            kv_len, r0, seq = index_ref[tile, _KV_LEN], index_ref[tile, _ROW], index_ref[tile, _SEQ]
            k_col = index_ref[tile, _K_COL]
        kvh = h // group

        padded_dim = dot_width(head_dim)  # a power of two, >= 16: 80 -> 128, 8 -> 16
        dims = pl.ds(0, padded_dim)
        dim_ok = (jnp.arange(padded_dim) < head_dim)[None, :]  # [1, Dp]
        rows = r0 + jnp.arange(block_q)  # [block_q] row index within the sequence
        row_store = rows < q_rows
        q_pos = kv_len - q_len + rows  # [block_q] absolute positions (bottom-right aligned)
        # The query rows load under the array's bounds only: rows past the sequence's
        # belong to the next one and their results are never stored. Under `row_store`
        # the load and the output store would share one mask, kept live across the key
        # loops: packed tiles ran 25% slower so (H100, 2026-11-22 probe before the 16:33
        # UTC run).
        q_ok = ((q_start + rows) < q_ref.shape[0])[:, None] & dim_ok
        q = plgpu.load(  # [block_q, Dp]
            q_ref.at[pl.ds(q_start + r0, block_q), h, dims], mask=q_ok, other=0.0
        )
        # Triton's default for float32 dots is TF32; float32 inputs ask for float32 products.
        precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
        if has_rope:  # StreamingLLM: q rotated per tile, keys on load (rope_read)
            q2 = plgpu.load(rope_refs[0].at[pl.ds(q_start + r0, block_q), h, dims],
                            mask=q_ok, other=0.0)  # fmt: skip
            rope_cols = (
                jnp.arange(padded_dim)[None, :],
                None if padded_dim == head_dim else dim_ok,
            )
            q = rope_read.tile_queries(q, q2, rope_refs[1:], q_pos, kv_len - q_len + r0, *rope_cols,
                                       params.window, params.sink_tokens)  # fmt: skip
        logits = TileLogits(
            params,
            terms,
            h,
            seq,
            q_start,
            k_col,
            r0,
            row_store,
            q_pos,
            kv_len,
            block_q,
            block_kv,
            precision,
            rope_cols=rope_cols if has_rope else None,
        )

        # Keys below `prefix` come from the cache (none without one); new keys are packed
        # rows `k_start + (position - prefix)`.
        keys = KeyBlocks(
            k_ref,
            v_ref,
            cache_refs,
            seq,
            kvh,
            k_start,
            kv_len,
            prefix=0 if cached is None else kv_len - q_len,
            block_kv=block_kv,
            head_dim=head_dim,
            padded_dim=padded_dim,
            dims=dims,
            dim_ok=dim_ok,
            dtype=q_ref.dtype,
        )

        def attend(q, k, load_v, k0, masked, carry):
            s = logits(q, k, k0, masked)  # [block_q, block_kv], base-2 units
            return softmax_update(carry, s, load_v, precision)

        def run(lo, hi, masked, carry, q=q):
            return keys.run(lo, hi, masked, carry, functools.partial(attend, q))

        # Key blocks: [lo_b, hi_b) holds what any valid row sees; [full_lo_b, full_hi_b)
        # what every valid row sees, so blocks inside it skip the mask.
        lo_b, full_lo_b, full_hi_b, hi_b = key_block_range(
            params, q_len, kv_len, r0, block_q, block_kv
        )
        if has_mask:  # Every block reads the mask anyway.
            full_hi_b = full_lo_b

        carry = softmax_init(block_q, padded_dim)
        if params.window is not None and params.sink_tokens:
            sink_b = jnp.minimum(pl.cdiv(params.sink_tokens, block_kv), hi_b)
            if has_rope:  # Every block holding a sink runs here: it needs both q rotations.
                lo_b = jnp.maximum(lo_b, sink_b)
                full_lo_b = jnp.clip(full_lo_b, lo_b, hi_b)
                full_hi_b = jnp.clip(full_hi_b, full_lo_b, hi_b)
            else:
                sink_b = jnp.minimum(sink_b, lo_b)
            carry = run(0, sink_b, True, carry)
        q_window = q._replace(sink=None) if has_rope else q
        # The masked edges first: what their masks need (positions, lengths) is then dead
        # during the long unmasked run. Ending on the causal diagonal kept it live, and
        # with lengths as data 128x128 tiles ran 27% slower (H100, 2026-11-22 probe before
        # the 16:33 UTC run).
        carry = run(lo_b, full_lo_b, True, carry, q_window)
        carry = run(full_hi_b, hi_b, True, carry, q_window)
        carry = run(full_lo_b, full_hi_b, False, carry, q_window)
        out, lse = softmax_finish(carry, row_ok=rows < q_len)
        plgpu.store(
            o_ref.at[pl.ds(q_start + r0, block_q), h, dims],
            output_value(out, o_ref, inv_ref),
            mask=row_store[:, None] & dim_ok,
        )
        if has_lse:
            plgpu.store(lse_ref.at[h, pl.ds(q_start + r0, block_q)], lse, mask=row_store)

    if dense_shape is not None:
        one_tile(pl.program_id(1))
    elif tile_loop:  # A program per potential tile would launch mostly empty ones: loop.
        first, stride = pl.program_id(1), pl.num_programs(1)
        trips = pl.cdiv(jnp.maximum(index_ref[0, _NUM_REAL] - first, 0), stride)
        jax.lax.fori_loop(0, trips, lambda i, c: (one_tile(first + i * stride), c)[1], 0)
    else:  # As many programs as potential tiles: one each, if real.
        tile = pl.program_id(1)
        pl.when(tile < index_ref[0, _NUM_REAL])(lambda: one_tile(tile))


@functools.partial(
    jax.jit, static_argnames=("params", "config", "return_lse", "out_dtype", "interpret")
)
def flash_prefill(
    q,
    k,
    v,
    batch: Batch,
    *,
    cached: CachedPrefix | None = None,
    bias=None,
    mask=None,
    alibi_slopes=None,
    rel_table=None,
    rope: rope_read.RopeTables | None = None,
    params: LogitParams,
    config: FlashPrefillConfig,
    return_lse: bool = False,
    out_dtype=None,
    out_scale=None,
    into=None,
    interpret: bool = False,
):
    """Flash attention of a dense or a packed batch.

    Args:
      q: dense `[B, Tq, Hq, D]` or packed `[Tq_all, Hq, D]`; k, v: `[B, Tk, Hkv, D]` or
        `[Tk_all, Hkv, D]`; one float dtype.
      batch: lengths (dense) or placement (packed) of the sequences (`Batch`).
      cached: packed batches only: where the first `kv_len - q_len` keys of each sequence
        are cached (`CachedPrefix`); `k`, `v` then hold only the new keys, at the same
        rows as the queries (`k_start = q_start`).
      bias: float `[Bb, Hb, Rq, Rk]`, each axis full or 1; mask: bool, same form. Indexed
        by sequence, head, and row/column within the sequence (dense) or in packed
        coordinates (packed, `Bb == 1`).
      alibi_slopes: float32 `[Hq]`; rel_table: float32 `[Hq, num_buckets]` (T5 bias).
      rope: packed batches only: None, or `RopeTables` (q_partner shaped like q): k, v and
        the cache hold un-rotated keys and q comes un-rotated; the kernel rotates them at
        their positions within the cache (StreamingLLM, `pallas_kernels.rope_read`).
      params, config: static options and tiling (every Triton field set: a config with
        fields left None is resolved first, `FlashPrefillConfig.resolve`).
      out_dtype: None (q's dtype) or float8_e4m3fn, which needs `out_scale` (float32 `[]`):
        stored `clip(out * (1 / out_scale), -448, 448)`, rounded to nearest even.
      into: packed batches with `return_lse`: None, or (out, lse) of an earlier call over
        the same q rows; this call writes its tiles' rows into them in place (aliased)
        and leaves every other row as it was (two launches over one output, no merge).

    Returns:
      out shaped like q in `out_dtype`, and lse float32 `[B, Hq, Tq]` / `[Hq, Tq_all]` (or None).
    """
    if not config.resolved:
        raise ValueError(f"flash_prefill: {config} has tile fields left None: resolve it first")
    num_q_heads, head_dim = q.shape[-2:]
    num_kv_heads = k.shape[-2]
    block_q = config.block_q
    if batch.dense:
        num_seqs, q_rows, kv_rows = q.shape[0], q.shape[1], k.shape[1]
        dense_shape = (num_seqs, q_rows, kv_rows)
        num_tiles = num_programs = num_seqs * pl.cdiv(q_rows, block_q)
        index = None
        if batch.q_len is not None or batch.kv_len is not None:
            full = lambda x, n: jnp.full((num_seqs,), n, jnp.int32) if x is None else x  # noqa: E731
            index = jnp.stack([full(batch.q_len, q_rows), full(batch.kv_len, kv_rows)])
            index = index.astype(jnp.int32)  # [2, B]
        q, k, v = (x.reshape(-1, *x.shape[2:]) for x in (q, k, v))
    else:
        dense_shape = None
        num_seqs = batch.q_len.shape[0]
        num_tiles, num_programs = packed_grid(q.shape[0], num_seqs, block_q)
        index = packed_tile_table(batch, block_q, num_tiles, params)

    pools, cache_layout = [], None
    if cached is not None:
        if batch.dense:
            raise ValueError("flash_prefill: a cached prefix needs a packed batch")
        pools = [cached.block_tables.astype(jnp.int32), cached.k_pages, cached.v_pages]
        if cached.fmt.dtype is not None:
            scales = (cached.k_scales, cached.v_scales)
            if cached.fmt.granularity == "tensor":
                scales = tuple(jnp.reshape(x, (1,)).astype(jnp.float32) for x in scales)
            pools += scales
        cache_layout = (cached.fmt, cached.ring)
    if rope is not None:
        if batch.dense:
            raise ValueError("flash_prefill: rope on read needs a packed batch")
        pools += [rope.q_partner.astype(q.dtype), rope.cos, rope.sin]
    optional = [bias, mask, alibi_slopes, rel_table]
    has = tuple(x is not None for x in [index, *optional]) + (return_lse,)
    inputs = [x for x in [index, q, k, v, *pools, *optional] if x is not None]
    out_dtype = q.dtype if out_dtype is None else jnp.dtype(out_dtype)
    quantize = out_dtype == FP8
    if quantize:
        if out_scale is None:
            raise ValueError("flash_prefill: out_dtype=float8_e4m3fn needs out_scale")
        inputs.append(inverse_scale(out_scale))
    out_shape = [jax.ShapeDtypeStruct(q.shape, out_dtype)]
    if return_lse:
        out_shape.append(jax.ShapeDtypeStruct((num_q_heads, q.shape[0]), jnp.float32))
    aliases = None
    if into is not None:
        if batch.dense or not return_lse:
            raise ValueError("flash_prefill: `into` needs a packed batch and return_lse=True")
        for x, want in zip(into, out_shape, strict=True):
            if x.shape != want.shape or x.dtype != want.dtype:
                raise ValueError(f"flash_prefill: into has {x.shape} {x.dtype}, expected {want}")
        aliases = {len(inputs): 0, len(inputs) + 1: 1}
        inputs += list(into)

    kernel = functools.partial(
        _flash_prefill_kernel,
        params=params,
        has=has,
        block_q=block_q,
        block_kv=config.block_kv,
        head_dim=head_dim,
        group=num_q_heads // num_kv_heads,
        dense_shape=dense_shape,
        cached=cache_layout,
        has_rope=rope is not None,
        quantize=quantize,
        tile_loop=num_programs < num_tiles,
        has_into=into is not None,
    )
    outs = whole_array_call(
        kernel,
        inputs,
        out_shape,
        grid=(num_q_heads, num_programs),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        interpret=interpret,
        name="flash_prefill",
        aliases=aliases,
    )
    out, lse = outs[0], (outs[1] if return_lse else None)
    if dense_shape is not None:
        out = out.reshape(num_seqs, q_rows, num_q_heads, head_dim)
        if lse is not None:
            lse = lse.reshape(num_q_heads, num_seqs, q_rows).transpose(1, 0, 2)
    return out, lse
