"""In-flight batching: `jaxattn.paged_attention` on serving steps (issue 5's rows).

Sets `serving_mixed` and `serving_chunk` (bf16, GQA 32/8, head_dim 128, page 16, pages
scattered at random):

- mixed step: 4 context sequences of 512 tokens + 60 generation sequences at context
  2048 in one call, against the same two groups run as separate calls (context-only,
  generation-only); the figure of merit is mixed / (context + generation).
- chunked prefix: a 2048-token chunk attending to a 14336-token paged prefix (16384 keys),
  against the dense flash kernel (`jaxattn.attention`, causal, bottom-right) on the same
  work, in TFLOP/s.

Each call writes its K/V into the cache, so a timed call runs `STEPS` steps in one jitted
loop that carries the cache (donated: updated in place, as in a serving loop); per-step
time = loop time / STEPS. Outputs are checked against the reference before timing.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import (
    TOLERANCES,
    Row,
    SetResult,
    Settings,
    bench_impl,
    check_close,
    describe_error,
    join_notes,
    progress,
    time_carried,
    timed_row,
)
from bench.prefill import config_label, parse_config

HEADS, SMOKE_HEADS = (32, 8, 128, 16), (4, 2, 32, 8)  # Hq, Hkv, D, page size
STEPS = 20
DEFAULT_SWEEP = (
    "64x64x4x3",
    "128x64x8x3",
    "128x128x8x3",
    "128x128x8x2",
    "64x128x4x3",
    "128x64x4x3",
)


@dataclasses.dataclass(frozen=True)
class Step:
    """Rows of one serving step: `(new tokens, length after the step)` per sequence."""

    rows: tuple[tuple[int, int], ...]

    @property
    def tokens(self) -> int:
        return sum(q for q, _ in self.rows)


def _pool(step: Step, heads, seed: int):
    """A cache whose sequences hold their prefixes (pages scattered), the step's inputs
    and its metadata."""
    import jaxattn

    num_q_heads, num_kv_heads, head_dim, page_size = heads
    rng = np.random.default_rng(seed)
    pages_per = [math.ceil(ctx / page_size) for _, ctx in step.rows]
    perm = rng.permutation(sum(pages_per))
    tables, start = [], 0
    for n in pages_per:
        tables.append(perm[start : start + n].tolist())
        start += n
    cache = jaxattn.PagedKVCache.create(len(perm), page_size, num_kv_heads, head_dim)
    # Prefixes: every slot of the pool gets a random token (the step rewrites its own).
    keys = jax.random.split(jax.random.key(seed), 5)
    slots = len(perm) * page_size
    prefix = [
        jax.random.normal(keys[i], (slots, num_kv_heads, head_dim), jnp.bfloat16) for i in range(2)
    ]
    cache = jax.jit(jaxattn.write_kv, donate_argnums=0)(cache, *prefix, jnp.arange(slots))
    meta = jaxattn.AttentionMetadata.from_lists(
        [q for q, _ in step.rows],
        [c for _, c in step.rows],
        tables,
        page_size,
        max_tokens=step.tokens,
        max_seqs=len(step.rows),
        max_pages=max(pages_per),
        decode_only=all(q == 1 for q, _ in step.rows),  # a generation-only step's plan
    )
    t = step.tokens
    q = jax.random.normal(keys[2], (t, num_q_heads, head_dim), jnp.bfloat16)
    k = jax.random.normal(keys[3], (t, num_kv_heads, head_dim), jnp.bfloat16)
    v = jax.random.normal(keys[4], (t, num_kv_heads, head_dim), jnp.bfloat16)
    return cache, (q, k, v, meta)


def _ours(config=None, **options):
    import jaxattn

    cfg = jaxattn.PagedAttentionConfig(prefill=config, **options)
    return functools.partial(jaxattn.paged_attention, implementation="pallas", config=cfg)


def _row(settings, name, shape, impl, attn, cache, args, ref, *, work, unit, notes="", sweep=False):
    """Checks one step against `ref`, then times it (a Row of set `name`)."""
    row = Row(name, shape, impl, "ok", unit=unit, notes=notes, sweep=sweep)
    try:
        out, _ = attn(*args[:3], cache, args[3])
        passed, check = check_close(out, ref, f"{impl} {shape}", TOLERANCES[out.dtype])
        if not passed:
            return progress(
                dataclasses.replace(row, status="FAILED", notes=join_notes(notes, check))
            )

        def step(cache, q, k, v, meta):
            out, cache = attn(q, k, v, cache, meta)
            return cache, out

        timing = time_carried(step, cache, args, settings, STEPS)
    except Exception as e:  # a sweep variant that does not compile
        status = "error" if sweep else "FAILED"
        return progress(dataclasses.replace(row, status=status, notes=describe_error(e)))
    return timed_row(settings, row, timing, work, notes=join_notes(notes, check))


def _kv_bytes(step: Step, heads) -> float:
    """K/V bytes a step reads (bf16): every sequence's whole context."""
    return 2.0 * 2 * heads[1] * heads[2] * sum(ctx for _, ctx in step.rows)


def _flops(step: Step, heads) -> float:
    """Causal attention FLOPs: 4 * Hq * D per (query, visible key)."""
    pairs = sum(q * (ctx - q) + q * (q + 1) / 2 for q, ctx in step.rows)
    return 4.0 * heads[0] * heads[2] * pairs


def _mixed_rows(settings: Settings, heads) -> list[Row]:
    n_ctx, ctx_len, n_gen, gen_len = (4, 512, 60, 2048) if not settings.smoke else (2, 64, 6, 128)
    context = Step(((ctx_len, ctx_len),) * n_ctx)
    generation = Step(((1, gen_len),) * n_gen)
    rng = np.random.default_rng(3)
    order = rng.permutation(n_ctx + n_gen)  # rows in any order
    mixed = Step(tuple((context.rows + generation.rows)[i] for i in order))
    labels = {
        "mixed": f"mixed: {n_ctx}x{ctx_len} ctx + {n_gen} gen@{gen_len}",
        "context only": f"context only: {n_ctx}x{ctx_len}",
        "generation only": f"generation only: {n_gen} gen@{gen_len}",
    }
    rows, times = [], {}
    for name, step in (
        ("mixed", mixed),
        ("context only", context),
        ("generation only", generation),
    ):
        cache, args = _pool(step, heads, seed=len(rows))
        row = _row(
            settings,
            "serving_mixed",
            labels[name],
            "ours",
            _ours(),
            cache,
            args,
            _split_reference(cache, args),
            work=_kv_bytes(step, heads),
            unit="TB/s",
        )
        times[name] = row.time_ms
        rows.append(row)
        del cache
    if all(times.values()):
        ratio = times["mixed"] / (times["context only"] + times["generation only"])
        rows[0] = progress(
            dataclasses.replace(
                rows[0], notes=join_notes(rows[0].notes, f"{ratio:.3f}x (context + generation)")
            )
        )
    return rows


def _split_reference(cache, args):
    """Reference of a step without the O(T * M * P) memory of `paged_attention_reference`:
    context rows (no prefix here) as ragged causal attention on the new tokens, generation
    rows as `paged_decode_reference` on the written cache."""
    import jaxattn

    q, k, v, meta = args
    q_lens = np.asarray(meta.q_lens)
    cu = np.asarray(meta.cu_seqlens_q)
    new_cache = jaxattn.write_kv(cache, k, v, meta.slot_mapping)
    ragged = jaxattn.ragged_attention(
        q, k, v, meta.cu_seqlens_q, meta.cu_seqlens_q, causal=True, implementation="xla"
    )
    decode = jaxattn.paged_decode(
        q[jnp.minimum(meta.cu_seqlens_q[:-1], q.shape[0] - 1)],
        new_cache,
        meta.block_tables,
        meta.context_lens,
        implementation="xla",
    )
    out = ragged
    for s in np.nonzero(q_lens == 1)[0]:
        out = out.at[cu[s]].set(decode[s])
    return out


def _chunk_rows(settings: Settings, heads) -> list[Row]:
    """A chunk over a long paged prefix, against the dense kernel on the same work: the
    default (the history gather, `jaxattn.history`) and the paged key loop alone (gather
    off), for a 2048-token chunk (the target row) and a 512-token one (the gather's
    threshold)."""
    rows = []
    for chunk, prefix in ((2048, 14336), (512, 14336)) if not settings.smoke else ((64, 192),):
        rows += _one_chunk(settings, heads, chunk, prefix)
    return rows


def _one_chunk(settings: Settings, heads, chunk: int, prefix: int) -> list[Row]:
    import jaxattn

    step = Step(((chunk, prefix + chunk),))
    cache, args = _pool(step, heads, seed=11)
    q, k, v, meta = args
    # The same keys, dense: the prefix as the cache holds it, then the chunk.
    written = jaxattn.write_kv(cache, k, v, meta.slot_mapping)
    k_all, v_all = jaxattn.gather_kv(written, meta.block_tables, meta.context_lens, prefix + chunk)
    dense_args = (q[None], k_all, v_all)
    ref = jaxattn.attention(*dense_args, causal=True, implementation="xla")[0]
    flops = _flops(step, heads)
    shape = f"chunk {chunk} over {prefix} prefix"
    dense = bench_impl(
        settings,
        set_name="serving_chunk",
        shape=shape,
        impl="dense flash",
        fn=jax.jit(functools.partial(jaxattn.attention, causal=True, implementation="pallas")),
        arg_sets=[dense_args],
        ref=ref[None],
        tol=TOLERANCES[q.dtype],
        work=flops,
        on_error="FAILED",
        notes="jaxattn.attention on contiguous K/V (same work)",
    )
    config = jaxattn.FlashPrefillConfig.heuristic(
        chunk, prefix + chunk, heads[2], q.dtype, True, lengths=True, packed=True, paged=True
    )
    paged = "ours (paged loop)"  # its own bars in the plot
    variants = [
        ("ours", _ours(), "default: history gather", False),
        (paged, _ours(gather_tokens=0), f"gather off, {config_label(config)}", False),
    ]
    if settings.sweep:
        specs = settings.sweep_configs or DEFAULT_SWEEP
        variants += [
            (paged, _ours(parse_config(spec), gather_tokens=0), f"sweep {spec}", True)
            for spec in specs
        ]
    rows = [dense]
    for impl, attn, notes, sweep in variants:
        row = _row(settings, "serving_chunk", shape, impl, attn, cache, args, ref,
                   work=flops, unit="TFLOP/s", notes=notes, sweep=sweep)  # fmt: skip
        if dense.rate and row.rate:
            ratio = f"{row.rate / dense.rate:.2f}x dense"
            row = progress(dataclasses.replace(row, notes=join_notes(row.notes, ratio)))
        rows.append(row)
    return rows


def _description(heads) -> str:
    q_heads, kv_heads, head_dim, page_size = heads
    return (
        f"bf16, Hq {q_heads} / Hkv {kv_heads}, D {head_dim}, page {page_size}, pages scattered; "
        f"each step writes its K/V (cache donated, {STEPS} steps per jitted loop)"
    )


def mixed_set(settings: Settings) -> SetResult:
    heads = SMOKE_HEADS if settings.smoke else HEADS
    return SetResult("serving_mixed", _description(heads), _mixed_rows(settings, heads))


def chunk_set(settings: Settings) -> SetResult:
    heads = SMOKE_HEADS if settings.smoke else HEADS
    return SetResult("serving_chunk", _description(heads), _chunk_rows(settings, heads))
