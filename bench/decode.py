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

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import TOLERANCES, SetResult, Settings, bench_impl, progress

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
    DecodeRow(8, 8192, ragged=True),
)  # fmt: skip
SMOKE_ROWS = (DecodeRow(1, 512), DecodeRow(2, 512, ragged=True))  # peers need 16 splits


def _inputs(row: DecodeRow, heads, seed: int):
    """q, our cache, block tables and lengths, plus the same K/V contiguous [B, S, Hkv, D]."""
    import jaxattn

    num_q_heads, num_kv_heads, head_dim, page_size = heads
    lengths = row.lengths(seed)
    pages_per_seq = -(-row.context // page_size)
    num_pages = row.batch * pages_per_seq
    keys = jax.random.split(jax.random.key(seed), 3)
    shape = (row.batch, pages_per_seq * page_size, num_kv_heads, head_dim)
    k = jax.random.normal(keys[0], shape, jnp.bfloat16)
    v = jax.random.normal(keys[1], shape, jnp.bfloat16)
    q = jax.random.normal(keys[2], (row.batch, num_q_heads, head_dim), jnp.bfloat16)
    tables = np.random.default_rng(seed).permutation(num_pages).reshape(row.batch, -1)
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


def decode_set(settings: Settings) -> SetResult:
    from jax.experimental.pallas.ops.gpu import decode_attention, paged_attention

    import jaxattn

    heads = SMOKE_HEADS if settings.smoke else (NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE)
    interpret = jax.default_backend() != "gpu"
    rows = []
    for index, row in enumerate(SMOKE_ROWS if settings.smoke else ROWS):
        q, cache, tables, lengths, k, v = _inputs(row, heads, seed=10 * index)
        ref = _reference(q, cache, tables, lengths)
        kv_bytes = float(np.sum(np.asarray(lengths))) * heads[1] * heads[2] * 2 * 2
        config = jaxattn.PagedDecodeConfig.heuristic(
            row.batch, heads[1], tables.shape[1] * heads[3], heads[3]
        )
        measure = functools.partial(
            bench_impl, settings, set_name="decode", shape=row.label, ref=ref,
            tol=TOLERANCES[jnp.dtype(jnp.bfloat16)], work=kv_bytes, unit="TB/s",
        )  # fmt: skip
        ours = jax.jit(
            functools.partial(jaxattn.paged_decode, implementation="pallas", config=config)
        )
        mine = measure(
            impl="ours", fn=ours, arg_sets=[(q, cache, tables, lengths)], on_error="FAILED",
            notes=f"block_kv {config.block_kv}, splits {config.num_splits} (heuristic)",
        )  # fmt: skip
        cudnn = jax.jit(
            lambda q, k, v, n: jax.nn.dot_product_attention(
                q[:, None], k, v, key_value_seq_lengths=n, implementation="cudnn"
            )[:, 0]
        )
        peers = [measure(impl="cudnn", fn=cudnn, arg_sets=[(q, k, v, lengths)])]
        gqa = jax.jit(
            lambda q, k, v, n: decode_attention.gqa(q, k, v, kv_seq_len=n, interpret=interpret)
        )
        peers.append(measure(impl="jax gqa decode", fn=gqa, arg_sets=[(q, k, v, lengths)]))
        # Its layout is [Hkv, N, P, D], and it takes no scale: q comes pre-scaled.
        jax_pages = [jnp.swapaxes(x, 0, 1) for x in (cache.k_pages, cache.v_pages)]
        q_scaled = (q * heads[2] ** -0.5).astype(q.dtype)
        paged = jax.jit(
            lambda q, kp, vp, t, n: paged_attention.paged_attention(
                q, kp, vp, t, n, interpret=interpret
            )
        )
        paged_peer = measure(
            impl="jax paged_attention", fn=paged, arg_sets=[(q_scaled, *jax_pages, tables, lengths)]
        )
        if mine.status == paged_peer.status == "ok":
            ratio = mine.rate / paged_peer.rate
            mine = progress(
                dataclasses.replace(mine, notes=f"{mine.notes}; {ratio:.2f}x jax paged")
            )
        rows += [mine, *peers, paged_peer]
    label = f"bf16, Hq {heads[0]} / Hkv {heads[1]}, D {heads[2]}, page {heads[3]}, pages scattered"
    return SetResult("decode", label, rows)
