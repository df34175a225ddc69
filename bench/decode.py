"""Generation (decode) attention: one query token per sequence against its cached history.

Set `decode` (bf16, GQA 32/8, head_dim 128, page size 16, pages scattered at random in the
pool; PERF.md rows plus ragged rows with lengths drawn in 10%..100% of the maximum): ours
(`jaxattn.paged_decode`, pallas) against cuDNN through `jax.nn.dot_product_attention` on a
contiguous cache, JAX's Pallas `decode_attention.gqa` (contiguous) and JAX's Pallas
`paged_attention` (paged, its own `[Hkv, N, P, D]` layout), all on the same K/V values.

The figure of merit is KV bytes read per second: `sum(lengths) * Hkv * D * 2 (K and V) *
itemsize` over the time, against the device-copy ceiling measured in the same run.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import (
    L2_BYTES,
    TOLERANCES,
    Entry,
    SetResult,
    Settings,
    Sweep,
    bench_row,
    mark_best,
    num_input_sets,
    ours_entries,
    progress,
)

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE = 32, 8, 128, 16
SMOKE_HEADS = (4, 2, 32, 8)


@dataclasses.dataclass(frozen=True)
class DecodeRow:
    batch: int
    context: int
    ragged: bool = False

    @property
    def label(self) -> str:
        return f"B{self.batch} ctx{self.context}" + (" ragged" if self.ragged else "")

    def lengths(self, seed: int) -> np.ndarray:
        if not self.ragged:
            return np.full(self.batch, self.context)
        rng = np.random.default_rng(seed)
        return rng.integers(max(1, self.context // 10), self.context + 1, self.batch)


ROWS = (
    DecodeRow(1, 4096), DecodeRow(1, 32768), DecodeRow(8, 8192), DecodeRow(64, 4096),
    DecodeRow(64, 16384), DecodeRow(256, 2048), DecodeRow(64, 4096, ragged=True),
    DecodeRow(8, 8192, ragged=True), DecodeRow(32, 16384, ragged=True),
    DecodeRow(64, 16384, ragged=True), DecodeRow(256, 2048, ragged=True),
)  # fmt: skip
CHAINED, CHAINED_BYTES = 8, 2**32  # (peer layouts triple the memory of each copy)
SMOKE_ROWS = (DecodeRow(1, 512), DecodeRow(2, 512, ragged=True))  # peers need 16 splits

# block_kv x num_warps x num_stages x num_splits ("h": the heuristic's split count; "h*2",
# "h/2": twice, half of it).
DEFAULT_SWEEP = (
    "64x4x3xh", "64x4x4xh", "32x4x3xh", "32x2x4xh", "128x4x2xh", "128x4x3xh", "128x8x3xh",
    "64x8x3xh", "64x2x3xh", "64x4x3x1", "64x4x3x2", "64x4x3x4", "64x4x3x8", "64x4x3x16",
    "64x4x3x32",
)  # fmt: skip


_SPEC = re.compile(r"(\d+)x(\d+)x(\d+)(?:x(\d+|h(?:[*/]\d+)?))?(?:r(\d+))?(c)?(s)?(k)?(p)?")


def parse_config(spec: str, heuristic):
    """A decode config from BLOCK_KVxWARPSxSTAGES[xSPLITS][rROWS][c][s][k][p] (`config_label`).
    SPLITS: a count, or "h" (`heuristic.num_splits`), "h*N", "h/N"; left out, the
    heuristic's. rROWS pads the query rows to ROWS (`PagedDecodeConfig.query_rows`; the
    heuristic's otherwise); "c" reads V as codes rather than words (`v_words`); "s" applies
    group scales through stacked rows (`stacked`); "k" reads INT4 K as half-words
    (`k_words`); "p" reads rows of a head dim that is no power of two as one tile padded
    to a power of two rather than in segments (`segments` off). Without "s" or "k", those
    are off, whatever the heuristic's."""
    from pallas_kernels.paged_decode.config import PagedDecodeConfig

    match = _SPEC.fullmatch(spec)
    if not match:
        raise ValueError(f"{spec!r} is not BLOCK_KVxWARPSxSTAGES[xSPLITS][rROWS][c][s][k][p]")
    block_kv, warps, stages, splits, rows, codes, stacked, k_words, padded = match.groups()
    h = heuristic.num_splits
    if splits is None or splits == "h":
        splits = h
    elif splits.startswith("h"):
        factor = int(splits[2:])
        splits = h * factor if splits[1] == "*" else max(1, h // factor)
    return PagedDecodeConfig(
        int(block_kv), int(splits), int(warps), int(stages), v_words=not codes,
        query_rows=int(rows) if rows else heuristic.query_rows, stacked=bool(stacked),
        k_words=bool(k_words), segments=not padded,
    )  # fmt: skip


def _sweep(heuristic) -> Sweep:
    """Decode config specs (`parse_config`) against `heuristic`."""
    parse = functools.partial(parse_config, heuristic=heuristic)
    return Sweep(parse=parse, label=config_label, default=DEFAULT_SWEEP)


def config_label(c) -> str:
    """A decode tiling as BLOCKxWARPSxSTAGESxSPLITS, then rROWS where the query rows are
    padded to fewer than 16 (`PagedDecodeConfig.query_rows`), then "s" where group scales
    go through stacked rows (`PagedDecodeConfig.stacked`), then "k" where INT4 K is read
    as half-words (`PagedDecodeConfig.k_words`), then "p" where segments are off
    (`PagedDecodeConfig.segments`)."""
    rows = "" if c.query_rows == 16 else f"r{c.query_rows}"
    flags = "s" * c.stacked + "k" * c.k_words + "p" * (not c.segments)
    return f"{c.block_kv}x{c.num_warps}x{c.num_stages}x{c.num_splits}{rows}{flags}"


def _inputs(row: DecodeRow, heads, seed: int, copy: int = 0):
    """q, our cache, block tables and lengths, plus the same K/V contiguous [B, S, Hkv, D].

    Copies of one row share its lengths (`seed`) but draw their values and page placement
    anew (`copy`).
    """
    import jaxattn

    num_q_heads, num_kv_heads, head_dim, page_size = heads
    lengths = row.lengths(seed)
    pages_per_seq = -(-row.context // page_size)
    num_pages = row.batch * pages_per_seq
    keys = jax.random.split(jax.random.key(1000 * seed + copy), 3)
    shape = (row.batch, pages_per_seq * page_size, num_kv_heads, head_dim)
    k = jax.random.normal(keys[0], shape, jnp.bfloat16)
    v = jax.random.normal(keys[1], shape, jnp.bfloat16)
    q = jax.random.normal(keys[2], (row.batch, num_q_heads, head_dim), jnp.bfloat16)
    tables = np.random.default_rng(1000 * seed + copy).permutation(num_pages).reshape(row.batch, -1)
    inverse = np.argsort(tables.reshape(-1))  # page id -> (sequence, page index) flat

    def to_pages(x):  # [B, S, Hkv, D] -> [N, Hkv, P, D] with pages where tables say
        x = x.reshape(row.batch * pages_per_seq, page_size, num_kv_heads, head_dim)
        return jnp.swapaxes(x, 1, 2)[inverse]

    cache = jaxattn.PagedKVCache(to_pages(k), to_pages(v))
    tables = jnp.asarray(tables, jnp.int32)
    return q, cache, tables, jnp.asarray(lengths, jnp.int32), k, v


def _reference(q, cache, tables, lengths, chunk: int = 8):
    """The jnp reference, a few sequences at a time (it gathers and upcasts the cache)."""
    import jaxattn

    ref = jax.jit(jaxattn.paged_decode_reference)
    return jnp.concatenate([
        ref(q[i : i + chunk], cache, tables[i : i + chunk], lengths[i : i + chunk])
        for i in range(0, q.shape[0], chunk)
    ])  # fmt: skip


def ours(config):
    """config -> jitted `jaxattn.paged_decode(q, cache, tables, lengths)` on the kernel."""
    import jaxattn

    return jax.jit(functools.partial(jaxattn.paged_decode, implementation="pallas", config=config))


def decode_set(settings: Settings) -> SetResult:
    from jax.experimental.pallas.ops.gpu import decode_attention, paged_attention

    import jaxattn

    heads = SMOKE_HEADS if settings.smoke else (NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE)
    interpret = jax.default_backend() != "gpu"
    rows = []
    for index, row in enumerate(SMOKE_ROWS if settings.smoke else ROWS):
        lengths = row.lengths(seed=10 * index)
        kv_bytes = float(np.sum(lengths)) * heads[1] * heads[2] * 2 * 2
        # Caches that fit in L2 are rotated (several copies), so no call reads a warm cache;
        # short calls get CHAINED copies, timed back to back in one program (bench.common).
        copies = 1 if kv_bytes > 3 * L2_BYTES else num_input_sets(int(kv_bytes))
        if kv_bytes * CHAINED <= CHAINED_BYTES:
            copies = CHAINED
        inputs = [_inputs(row, heads, seed=10 * index, copy=i) for i in range(copies)]
        q, cache, tables, lengths, k, v = inputs[0]
        ref = _reference(q, cache, tables, lengths)
        config = jaxattn.PagedDecodeConfig.heuristic(
            row.batch, heads[1], tables.shape[1] * heads[3], heads[3]
        )
        mine = ours_entries(
            settings, sweep=_sweep(config), make_fn=ours, config=config,
            arg_sets=[x[:4] for x in inputs],
        )  # fmt: skip
        cudnn = jax.jit(
            lambda q, k, v, n: jax.nn.dot_product_attention(
                q[:, None], k, v, key_value_seq_lengths=n, implementation="cudnn"
            )[:, 0]
        )
        contiguous = [(x[0], x[4], x[5], x[3]) for x in inputs]
        gqa = jax.jit(
            lambda q, k, v, n: decode_attention.gqa(q, k, v, kv_seq_len=n, interpret=interpret)
        )
        # Its layout is [Hkv, N, P, D], and it takes no scale: q comes pre-scaled.
        paged = jax.jit(
            lambda q, kp, vp, t, n: paged_attention.paged_attention(
                q, kp, vp, t, n, interpret=interpret
            )
        )
        paged_sets = [
            (
                (q * heads[2] ** -0.5).astype(q.dtype),
                jnp.swapaxes(cache.k_pages, 0, 1),
                jnp.swapaxes(cache.v_pages, 0, 1),
                tables,
                lengths,
            )
            for q, cache, tables, lengths, _, _ in inputs
        ]
        peers = [
            Entry("cudnn", cudnn, contiguous),
            Entry("jax gqa decode", gqa, contiguous),
            Entry("jax paged_attention", paged, paged_sets),
        ]
        measured = bench_row(
            settings, mine + peers, set_name="decode", shape=row.label, ref=ref,
            tol=TOLERANCES[jnp.dtype(jnp.bfloat16)], work=kv_bytes, unit="TB/s",
        )  # fmt: skip
        (mine, *variants), peers = mark_best(measured[: len(mine)]), measured[len(mine) :]
        paged_peer = peers[-1]
        if mine.status == paged_peer.status == "ok":
            ratio = mine.rate / paged_peer.rate
            mine = progress(
                dataclasses.replace(mine, notes=f"{mine.notes}; {ratio:.2f}x jax paged")
            )
        rows += [mine, *variants, *peers]
    label = f"bf16, Hq {heads[0]} / Hkv {heads[1]}, D {heads[2]}, page {heads[3]}, pages scattered"
    return SetResult("decode", label, rows)
