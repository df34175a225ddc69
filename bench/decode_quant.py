"""Decode over quantized KV caches (INT8 / FP8 / INT4, per-tensor and per-group scales).

Set `decode_quant`: B64 ctx16384 and B8 ctx8192 (bf16 queries, GQA 32/8, head_dim 128,
page 16, pages scattered), the same K/V written into a bf16 cache and into each quantized
format with `write_kv`: INT8, FP8 and INT4 with a scale per tensor, per group of 8, 16,
32 or 64 channels, or per head row (group D = 128); ours (`paged_decode`, dequantizing
in-kernel) on each. Bytes read count the stored values plus the scales (per-group: bf16
pages beside the data, as many bytes as OpenPPL's float16 scales); "vs bf16" is the
speedup over the bf16 cache's time in the same run, and "ideal" the ratio of bytes read.
Each output is checked against the reference run on the same (dequantized) cache.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import TOLERANCES, SetResult, Settings, bench_ours, progress
from bench.decode import DecodeRow, _reference, _sweep, ours

ROWS, SMOKE_ROWS = (DecodeRow(64, 16384), DecodeRow(8, 8192)), (DecodeRow(2, 512),)
HEADS, SMOKE_HEADS = (32, 8, 128, 16), (4, 2, 32, 8)
GROUPS, SMOKE_GROUPS = (8, 16, 32, 64, None), (8, None)
QUERY_SETS = 8


def formats(smoke: bool = False):
    import jaxattn

    found = [None]
    for dtype in ("int8", "float8_e4m3fn", "int4"):
        found.append(jaxattn.KVQuant(dtype))
        found += [jaxattn.KVQuant(dtype, "group", g) for g in (SMOKE_GROUPS if smoke else GROUPS)]
    return found


def bytes_per_token_head(quant, head_dim: int) -> int:
    """Bytes one token of one kv head occupies in K (or V): values plus scales."""
    if quant is None:
        return 2 * head_dim
    scales = 2 * quant.num_groups(head_dim) if quant.granularity == "group" else 0
    return quant.packed_dim(head_dim) * quant.storage_dtype.itemsize + scales


def label(quant) -> str:
    if quant is None:
        return "bf16"
    group = f" group {quant.group_size or 'D'}" if quant.granularity == "group" else " tensor"
    return quant.dtype.replace("float8_e4m3fn", "fp8") + group


def decode_quant_set(settings: Settings) -> SetResult:
    rows = []
    for row in SMOKE_ROWS if settings.smoke else ROWS:
        rows += _decode_quant_rows(settings, row)
    num_q_heads, num_kv_heads, head_dim, page_size = SMOKE_HEADS if settings.smoke else HEADS
    description = (
        f"bf16 queries, Hq {num_q_heads} / Hkv {num_kv_heads}, D {head_dim}, page {page_size}, "
        "pages scattered; per-tensor scales calibrated from the K/V (amax); per-group scales "
        f"computed on write; calls under 250 us timed chained over {QUERY_SETS} query sets"
    )
    return SetResult("decode_quant", description, rows)


@dataclasses.dataclass
class QuantInputs:
    """The K/V of a row (`B ctx`, every sequence full, pages scattered at random) and
    QUERY_SETS queries; `cache(quant)` writes them into a cache of that format (None:
    bf16). Several queries: calls shorter than bench.common.CHAIN_BELOW_S (B8 rows) run
    chained over them in one program, so host dispatch does not set their time."""

    row: DecodeRow
    heads: tuple
    k: jax.Array
    v: jax.Array
    queries: jax.Array  # [QUERY_SETS, B, Hq, D]
    tables: jax.Array
    slots: jax.Array
    lengths: jax.Array

    @classmethod
    def make(cls, row: DecodeRow, heads) -> QuantInputs:
        num_q_heads, num_kv_heads, head_dim, page_size = heads
        num_pages = row.batch * (row.context // page_size)
        keys = jax.random.split(jax.random.key(7), 3)
        k, v = (
            jax.random.normal(x, (num_pages * page_size, num_kv_heads, head_dim), jnp.bfloat16)
            for x in keys[:2]
        )
        shape = (QUERY_SETS, row.batch, num_q_heads, head_dim)
        queries = jax.random.normal(keys[2], shape, jnp.bfloat16)
        tables = np.random.default_rng(7).permutation(num_pages).reshape(row.batch, -1)
        slots = jnp.asarray(  # token t of sequence b -> its slot
            (tables[:, :, None] * page_size + np.arange(page_size)).reshape(-1), jnp.int32
        )
        lengths = jnp.full((row.batch,), row.context, jnp.int32)
        return cls(row, heads, k, v, queries, jnp.asarray(tables, jnp.int32), slots, lengths)

    def cache(self, quant):
        import jaxattn

        _, num_kv_heads, head_dim, page_size = self.heads
        scales = {}
        if quant is not None and quant.granularity == "tensor":
            k_scale, v_scale = jaxattn.calibrate_kv_scales(self.k, self.v, quant)
            scales = dict(k_scale=k_scale, v_scale=v_scale)
        cache = jaxattn.PagedKVCache.create(
            self.tables.size, page_size, num_kv_heads, head_dim, quant=quant, **scales
        )
        return jax.jit(jaxattn.write_kv, donate_argnums=0)(cache, self.k, self.v, self.slots)

    def arg_sets(self, cache) -> list[tuple]:
        return [(q, cache, self.tables, self.lengths) for q in self.queries]


def _decode_quant_rows(settings: Settings, row: DecodeRow) -> list:
    from jaxattn.decode import default_decode_config

    heads = SMOKE_HEADS if settings.smoke else HEADS
    num_kv_heads, head_dim = heads[1], heads[2]
    inputs = QuantInputs.make(row, heads)
    q, tables, lengths = inputs.queries[0], inputs.tables, inputs.lengths

    rows, base_ms = [], None
    for quant in formats(settings.smoke):
        cache = inputs.cache(quant)
        config = default_decode_config(cache, row.batch, row.context, heads[0] // num_kv_heads)
        kv_bytes = 2.0 * row.batch * row.context * num_kv_heads
        kv_bytes *= bytes_per_token_head(quant, head_dim)
        ideal = bytes_per_token_head(None, head_dim) / bytes_per_token_head(quant, head_dim)
        row_args = dict(
            set_name="decode_quant", shape=f"B{row.batch} ctx{row.context} {label(quant)}",
            ref=_reference(q, cache, tables, lengths), tol=TOLERANCES[jnp.dtype(jnp.bfloat16)],
            work=kv_bytes, unit="TB/s",
        )  # fmt: skip
        mine, *variants = bench_ours(
            settings, row_args, sweep=_sweep(config), make_fn=ours, config=config,
            arg_sets=inputs.arg_sets(cache),
            notes=f"{kv_bytes / 2**30:.2f} GiB read",
        )  # fmt: skip
        if mine.status == "ok":
            base_ms = base_ms or mine.time_ms
            speed = f"{base_ms / mine.time_ms:.2f}x bf16 (ideal {ideal:.2f}x)"
            mine = progress(dataclasses.replace(mine, notes=f"{mine.notes}; {speed}"))
        rows += [mine, *variants]
        del cache
    return rows
