"""OpenPPL's MultiHeadCacheAttention (`jaxattn.ppl`) against our native op on the same K/V.

Sets `ppl` and `ppl_mixed` (bf16 queries, GQA 32/8, head_dim 128; our pools of page 16,
pages scattered at random): one serving step each, rows of (new tokens, length after the
step), generation rows first (so PPL's `decoding_batches` is the number of generation
rows):

- `ppl`, decode: 64 rows of 1 token at context 8192;
- `ppl_mixed`: 60 rows of 1 token at 2048 and 4 rows of 512 new tokens at 512
  (serving_mixed's step).

Each step in two formats: bf16 (our bf16 pools; PPL `quant_bit=0` over a bf16 cache, our
extension: PPL's caches are float16 / float32) and int8 group 8 (ours:
`KVQuant("int8", "group", 8)`, bf16 scales; PPL: `quant_bit=8, quant_group=8`, float16
scales). Rows of one (step, format): `native` (`jaxattn.paged_attention`, pallas), then
`ppl L<n> m1` (cache_layout n = 0..3, cache_mode 1: page_size 16, cachestarts = our block
table * 16 over a token-row view of the same pages) and `ppl L0 m0` (cache_mode 0: each
sequence contiguous, cachestarts[b] = the earlier contexts, each rounded up to 16, summed);
decode int8 also `ppl L0 m1 f16`: float16 queries, PPL's own T1.

Each PPL cache (and scale) is our pool relaid out before timing: the same values, int8
codes copied, bf16 scales converted to float16 (exactly). A PPL call passes seqstarts and
kvstarts from the rows, start_pos = kvlen - seqlen, max_seqlen / max_kvlen = the step's
largest, is_causal, one layer. Checks, before timing: native against the jnp reference on
its cache (`paged_attention(implementation="xla")`, a few rows at a time); PPL bf16 against
the native output; PPL int8 against the PPL op's "xla" path on the same inputs (the new
tokens quantize with float16 scales there, bf16 ones in ours). Timing as serving_mixed:
each call writes its K/V, so `STEPS` steps run in one jitted loop carrying the cache
(donated; PPL: `(cache, scale)`), per-step time = loop time / STEPS.

Figure of merit: the step's K/V bytes read per second (TB/s), every row's whole context:
`2 * Hkv * sum(contexts) * (D * bytes per value + scale bytes)`, scales 2 bytes per group
of 8 (ours bf16, PPL float16). A PPL row's notes give its time relative to the native row
of the same (step, format).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import (
    Row,
    SetResult,
    Settings,
    describe_error,
    join_notes,
    progress,
)
from bench.decode_quant import bytes_per_token_head, label
from bench.serving import HEADS, SMOKE_HEADS, STEPS, Step, _ours, _pool
from bench.serving import _row as serving_row

GROUP = 8  # int8 scales per group of GROUP channels
REF_ROWS, REF_TOKENS = 8, 512  # references run on chunks of at most this many rows / tokens


def _steps(smoke: bool) -> list[tuple[str, Step]]:
    """(label, step) pairs; generation rows first."""
    n_dec, dec_ctx = (4, 64) if smoke else (64, 8192)
    n_ctx, new, ctx_len, n_gen, gen_len = (2, 16, 32, 6, 64) if smoke else (4, 512, 512, 60, 2048)
    return [
        (f"decode B{n_dec} ctx{dec_ctx}", Step(((1, dec_ctx),) * n_dec)),
        (
            f"mixed {n_ctx}x{new}@{ctx_len} + {n_gen}@{gen_len}",
            Step(((1, gen_len),) * n_gen + ((new, ctx_len),) * n_ctx),
        ),
    ]


def ppl_set(settings: Settings) -> SetResult:
    """The decode step (set `ppl`)."""
    return _set(settings, "ppl", 0)


def ppl_mixed_set(settings: Settings) -> SetResult:
    """The mixed step (set `ppl_mixed`): a set of its own, so that each set's run (about
    7 minutes for both steps on an H100, mostly compiles) fits a 10-minute command."""
    return _set(settings, "ppl_mixed", 1)


def _set(settings: Settings, set_name: str, index: int) -> SetResult:
    heads = SMOKE_HEADS if settings.smoke else HEADS
    name, step = _steps(settings.smoke)[index]
    rows = [dataclasses.replace(r, set_name=set_name)
            for r in _step_rows(settings, heads, name, step, index)]  # fmt: skip
    q_heads, kv_heads, head_dim, page_size = heads
    description = (
        f"bf16 queries, Hq {q_heads} / Hkv {kv_heads}, D {head_dim}, page {page_size}, pages "
        f"scattered; ppl L<layout> m<cache_mode>, same K/V as native; each step writes its "
        f"K/V (cache donated, {STEPS} steps per jitted loop)"
    )
    return SetResult(set_name, description, rows)


def _step_rows(settings: Settings, heads, name: str, step: Step, seed: int) -> list[Row]:
    """Both formats of one step: native, then the PPL rows."""
    import jaxattn

    pool, args = _pool(step, heads, seed)
    tables = np.maximum(np.asarray(args[3].block_tables), 0)[: len(step.rows)]
    rows = []
    for quant in (None, jaxattn.KVQuant("int8", "group", GROUP)):
        cache = pool if quant is None else _quantized(pool, quant)
        rows += _format_rows(settings, heads, name, step, cache, args, tables)
        del cache
    del pool
    return rows


def _quantized(pool, quant):
    """A quantized cache holding `pool`'s values in the same slots."""
    import jaxattn

    cache = jaxattn.PagedKVCache.create(
        pool.num_pages, pool.page_size, pool.num_kv_heads, pool.head_dim, quant=quant
    )
    slots = jnp.arange(pool.num_pages * pool.page_size)
    k, v = (_token_rows(x) for x in (pool.k_pages, pool.v_pages))
    return jax.jit(jaxattn.write_kv, donate_argnums=0)(cache, k, v, slots)


@dataclasses.dataclass(frozen=True)
class _Format:
    """One (step, format): our cache before the step, the step's inputs, its rows' work."""

    heads: tuple[int, int, int, int]
    shape: str  # the rows' label
    step: Step
    cache: object  # jaxattn.PagedKVCache
    args: tuple  # q, k, v, meta
    tables: np.ndarray  # our block tables [B, M] (padding entries 0)
    work: float  # K/V bytes a step reads


def _format_rows(settings, heads, name, step, cache, args, tables) -> list[Row]:
    quant = cache.quant
    work = 2.0 * heads[1] * bytes_per_token_head(quant, heads[2]) * sum(c for _, c in step.rows)
    fmt = _Format(heads, f"{name} {label(quant)}", step, cache, args, tables, work)
    ref = _native_reference(fmt)
    native = _row(settings, fmt.shape, "native", _ours(), cache, args, ref, work=work)
    del ref
    out = None
    if quant is None and native.status == "ok":  # PPL bf16 checks against this output
        out, _ = _ours()(*args[:3], cache, args[3])
    rows = [native]
    for layout, mode in [(layout, 1) for layout in range(4)] + [(0, 0)]:
        rows.append(_ppl_row(settings, fmt, layout, mode, out, native.time_ms))
    if quant is not None and step.tokens == len(step.rows):  # decode int8: fp16 queries
        fp16 = dataclasses.replace(
            fmt, args=tuple(x.astype(jnp.float16) for x in args[:3]) + args[3:]
        )
        row = _ppl_row(settings, fp16, 0, 1, None, native.time_ms, impl="ppl L0 m1 f16",
                       notes="fp16 queries")  # fmt: skip
        rows.append(row)
    return rows


def _row(settings, shape, impl, attn, cache, args, ref, *, work, native_ms=None, notes=""):
    """`bench.serving`'s checked, carried-steps row of set "ppl" (TB/s), its notes saying
    the time relative to `native_ms`."""
    row = serving_row(settings, "ppl", shape, impl, attn, cache, args, ref, work=work,
                      unit="TB/s", notes=notes)  # fmt: skip
    if native_ms and row.status == "ok":
        ratio = f"{row.time_ms / native_ms:.2f}x native time"
        row = dataclasses.replace(row, notes=join_notes(row.notes, ratio))
    return row


def _chunks(step: Step) -> list[tuple[int, int]]:
    """Consecutive row ranges `[lo, hi)` of at most REF_ROWS rows and REF_TOKENS new tokens
    (one row at least): the references' pieces, to bound their memory."""
    chunks, lo, tokens = [], 0, 0
    for i, (q, _) in enumerate(step.rows):
        if i > lo and (i - lo == REF_ROWS or tokens + q > REF_TOKENS):
            chunks.append((lo, i))
            lo, tokens = i, 0
        tokens += q
    return chunks + [(lo, len(step.rows))]


def _token_range(step: Step, lo: int, hi: int) -> tuple[int, int]:
    return sum(q for q, _ in step.rows[:lo]), sum(q for q, _ in step.rows[:hi])


def _native_reference(fmt: _Format):
    """The jnp reference of our op (`implementation="xla"`, memory O(T * M * P)), a chunk
    of rows at a time, each with its own metadata over the same cache."""
    import jaxattn

    q, k, v, _ = fmt.args
    page_size = fmt.cache.page_size
    ref = jax.jit(lambda *a: jaxattn.paged_attention(*a, implementation="xla")[0])
    outs = []
    for lo, hi in _chunks(fmt.step):
        t0, t1 = _token_range(fmt.step, lo, hi)
        rows = fmt.step.rows[lo:hi]
        pages = [
            fmt.tables[s, : math.ceil(c / page_size)].tolist() for s, (_, c) in enumerate(rows, lo)
        ]
        meta = jaxattn.AttentionMetadata.from_lists(
            [n for n, _ in rows], [c for _, c in rows], pages, page_size,
            max_tokens=t1 - t0, max_seqs=hi - lo, max_pages=max(map(len, pages)),
        )  # fmt: skip
        outs.append(ref(q[t0:t1], k[t0:t1], v[t0:t1], fmt.cache, meta))
    return jnp.concatenate(outs)


# ---------------------------------------------------------------- PPL
def _ppl_row(settings, fmt: _Format, layout, mode, native_out, native_ms, impl=None, notes=""):
    """One PPL row: its cache built from ours, checked (against `native_out`, or else the
    PPL op's xla path), timed."""
    from jaxattn.ppl import check_inputs

    impl = impl or f"ppl L{layout} m{mode}"
    try:
        carry, starts = _ppl_cache(fmt, layout, mode)
        inputs, static = _ppl_inputs(fmt, fmt.step.rows, starts, layout, mode)
        q, k, v, _ = fmt.args
        check_inputs(q, k, v, *inputs, cache=carry[0], scale=carry[1], **static)
        args = (q, k, v, inputs)
        ref = native_out
        if ref is None:
            ref = _ppl_reference(fmt, carry, starts, layout, mode)
    except Exception as e:  # the inputs did not build or check
        row = Row("ppl", fmt.shape, impl, "FAILED", unit="TB/s", notes=describe_error(e))
        return progress(row)
    attn = _ppl_op("pallas", **static)
    row = _row(settings, fmt.shape, impl, attn, carry, args, ref, work=fmt.work,
               native_ms=native_ms, notes=notes)  # fmt: skip
    del carry
    return row


def _token_rows(pages):
    """Pool `[N, H, P, X]` -> token rows `[N * P, H, X]` (slot s = row s)."""
    n, h, p, x = pages.shape
    return pages.transpose(0, 2, 1, 3).reshape(n * p, h, x)


@functools.partial(jax.jit, static_argnums=(3,))
def _relayout(k_pages, v_pages, rows, layout: int):
    """PPL's array in `layout` (one layer) holding token rows `rows` of our K/V pools: the
    canonical `[MaxT, 1, 2, H, X]` (layout 0), transposed."""
    from jaxattn.ppl import LAYOUTS

    kv = jnp.stack([_token_rows(x)[rows] for x in (k_pages, v_pages)], axis=1)[:, None]
    return kv.transpose([LAYOUTS[0].index(axis) for axis in LAYOUTS[layout]])


def _ppl_cache(fmt: _Format, layout: int, mode: int):
    """`((cache, scale), cachestarts)` of PPL holding our cache's contents before the
    step. Mode 1: our pages in place (token rows = our slots); mode 0: each sequence's
    rows contiguous, its context rounded up to the page size."""
    cache, tables = fmt.cache, fmt.tables
    page_size = cache.page_size
    if mode == 1:
        rows = jnp.arange(cache.num_pages * page_size)
        starts = tables * page_size
    else:
        sizes = [math.ceil(c / page_size) * page_size for _, c in fmt.step.rows]
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        slots = [  # each sequence's positions -> our slots
            tables[b, p // page_size] * page_size + p % page_size
            for b, p in enumerate(map(np.arange, sizes))
        ]
        rows = jnp.asarray(np.concatenate(slots))
    ppl_cache = _relayout(cache.k_pages, cache.v_pages, rows, layout)
    scale = None
    if cache.quant is not None:
        scale = _relayout(cache.k_scales, cache.v_scales, rows, layout).astype(jnp.float16)
    return (ppl_cache, scale), starts


def _ppl_inputs(fmt: _Format, rows, starts, layout: int, mode: int):
    """The PPL call's index inputs for `rows` (cachestarts `starts`), and its static
    options."""
    num_q_heads, num_kv_heads, head_dim, page_size = fmt.heads
    seqlen = np.asarray([q for q, _ in rows])
    kvlen = np.asarray([c for _, c in rows])
    decoding = len(rows) if np.all(seqlen == 1) else int(np.argmax(seqlen != 1))
    i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    inputs = (
        i32(np.concatenate([[0], np.cumsum(seqlen)])),  # seqstarts
        i32(np.concatenate([[0], np.cumsum(kvlen)])),  # kvstarts
        i32(starts),  # cachestarts
        i32(kvlen - seqlen),  # start_pos
        i32(decoding),  # decoding_batches
    )
    quantized = fmt.cache.quant is not None
    static = dict(
        max_seqlen=int(seqlen.max()), max_kvlen=int(kvlen.max()), num_heads=num_q_heads,
        head_dim=head_dim, is_causal=True, num_kv_heads=num_kv_heads, num_layer=1,
        layer_idx=0, quant_bit=8 if quantized else 0, quant_group=GROUP, cache_mode=mode,
        cache_layout=layout, page_size=page_size,
    )  # fmt: skip
    return inputs, static


@functools.cache
def _ppl_op(implementation: str, out_only: bool = False, **static):
    """Jitted `attn(q, k, v, (cache, scale), inputs) -> (out, (cache, scale))` (or out)."""
    from jaxattn.ppl import multi_head_cache_attention

    def attn(q, k, v, carry, inputs):
        out, cache, scale = multi_head_cache_attention(
            q, k, v, *inputs, cache=carry[0], scale=carry[1], implementation=implementation,
            **static,
        )  # fmt: skip
        return out if out_only else (out, (cache, scale))

    return jax.jit(attn)


def _ppl_reference(fmt: _Format, carry, starts, layout: int, mode: int):
    """The PPL op's xla path on the same inputs, a chunk of rows at a time (its memory is
    O(B * max_seqlen * max_kvlen)); each chunk writes only its own rows."""
    q, k, v, _ = fmt.args
    outs = []
    for lo, hi in _chunks(fmt.step):
        t0, t1 = _token_range(fmt.step, lo, hi)
        inputs, static = _ppl_inputs(fmt, fmt.step.rows[lo:hi], starts[lo:hi], layout, mode)
        attn = _ppl_op("xla", out_only=True, **static)
        outs.append(attn(q[t0:t1], k[t0:t1], v[t0:t1], carry, inputs))
    return jnp.concatenate(outs)
