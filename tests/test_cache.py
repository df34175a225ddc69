"""PagedKVCache, write_kv, gather_kv: round trips with scattered pages, write isolation
(a write touches only the slots it names), buffer donation, bad input.

Caches start filled with random values (never zeros), so "untouched" and "zero past the
length" are meaningful checks.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import util

import jaxattn
from jaxattn.cache import PagedKVCache, gather_kv, write_kv
from jaxattn.manager import KVCacheManager

N, P, HKV, D = 16, 4, 2, 8  # pages, page size, kv heads, head dim
S, M = 4, 4  # sequences, pages per sequence (capacity M * P = 16 tokens)
CAP = M * P
# Edge lengths: one token, exactly one page, one past a page boundary, full capacity.
EDGE_LENGTHS = (1, P, P + 1, CAP)

WRITE = jax.jit(write_kv)
GATHER = jax.jit(gather_kv, static_argnums=3)
RESERVE = jax.jit(KVCacheManager.reserve)
RELEASE = jax.jit(KVCacheManager.release)
SLOTS = jax.jit(KVCacheManager.slot_mapping)


def random_cache(rng, dtype="float32", num_pages=N) -> PagedKVCache:
    shape = (num_pages, HKV, P, D)
    return PagedKVCache(util.randn(rng, shape, dtype), util.randn(rng, shape, dtype))


def scattered_manager(rng, lengths) -> KVCacheManager:
    """A manager whose sequences end at `lengths`, grown in random steps with releases of
    scratch sequences in between, so pages are interleaved and out of order."""
    mgr = KVCacheManager.create(N, P, S + 2, M)
    current = [0] * S
    while current != list(lengths):
        seq = int(rng.integers(S))
        current[seq] = min(lengths[seq], current[seq] + int(rng.integers(1, 2 * P)))
        scratch = S + int(rng.integers(2))
        mgr, ok = RESERVE(mgr, jnp.array([seq, scratch]), jnp.array([current[seq], P]))
        if not ok:  # the scratch sequence took the room: drop it and grow alone
            mgr = RELEASE(mgr, jnp.array([scratch]))
            mgr, ok = RESERVE(mgr, jnp.array([seq]), jnp.array([current[seq]]))
        assert ok
        if rng.random() < 0.5:
            mgr = RELEASE(mgr, jnp.array([scratch]))
    mgr = RELEASE(mgr, jnp.array([S, S + 1]))
    return mgr


def tokens_of(lengths, start=None):
    """Flattened (seq id, position) of positions start[s]..lengths[s]-1 of every sequence."""
    start = start or [0] * len(lengths)
    seq = np.concatenate([np.full(n - a, s) for s, (a, n) in enumerate(zip(start, lengths))])
    pos = np.concatenate([np.arange(a, n) for a, n in zip(start, lengths)])
    return seq.astype(np.int32), pos.astype(np.int32)


def check_round_trip(cache, tables, lengths, k_seq, v_seq, dtype):
    max_len = CAP + 3  # past the table's capacity too
    k_out, v_out = GATHER(cache, jnp.asarray(tables), jnp.asarray(lengths, jnp.int32), max_len)
    assert k_out.shape == v_out.shape == (len(lengths), max_len, HKV, D)
    assert k_out.dtype == v_out.dtype == jnp.dtype(dtype)
    for s, n in enumerate(lengths):
        for got, want, name in ((k_out, k_seq, "k"), (v_out, v_seq, "v")):
            np.testing.assert_array_equal(
                np.asarray(got[s, :n]), np.asarray(want[s][:n]), err_msg=f"{name} seq {s}"
            )
            tail = np.asarray(got[s, n:], np.float32)
            assert (tail == 0).all(), f"{name} seq {s}: positions >= {n} are not zero"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("seed", range(3))
def test_round_trip_with_manager_pages(dtype, seed):
    rng = util.rng_for("round_trip_manager", dtype, seed)
    lengths = [int(x) for x in rng.permutation(EDGE_LENGTHS)]
    mgr = scattered_manager(rng, lengths)
    tables = np.asarray(mgr.block_tables)[:S]
    assert any((np.diff(row[row >= 0]) != 1).any() for row in tables), f"not scattered: {tables}"
    k_seq = [util.randn(rng, (n, HKV, D), dtype) for n in lengths]
    v_seq = [util.randn(rng, (n, HKV, D), dtype) for n in lengths]
    cache = random_cache(rng, dtype)
    # Prefill the first part of every sequence, then the rest (decode-like appends).
    split = [int(rng.integers(0, n + 1)) for n in lengths]
    for lo, hi in ((None, split), (split, lengths)):
        seq, pos = tokens_of(hi, lo)
        slots = SLOTS(mgr, jnp.asarray(seq), jnp.asarray(pos))
        assert (np.asarray(slots) >= 0).all()
        k = jnp.stack([k_seq[s][p] for s, p in zip(seq, pos)]) if len(seq) else None
        v = jnp.stack([v_seq[s][p] for s, p in zip(seq, pos)]) if len(seq) else None
        if k is not None:
            cache = WRITE(cache, k, v, slots)
    check_round_trip(cache, tables, lengths, k_seq, v_seq, dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_round_trip_with_shuffled_table(dtype):
    rng = util.rng_for("round_trip_shuffled", dtype)
    tables = rng.permutation(N)[: S * M].reshape(S, M).astype(np.int32)
    lengths = list(EDGE_LENGTHS)
    for s, n in enumerate(lengths):  # entries past a sequence's pages: -1 (never read)
        tables[s, -(-n // P) :] = -1
    k_seq = [util.randn(rng, (n, HKV, D), dtype) for n in lengths]
    v_seq = [util.randn(rng, (n, HKV, D), dtype) for n in lengths]
    seq, pos = tokens_of(lengths)
    order = rng.permutation(len(seq))  # token order does not matter
    seq, pos = seq[order], pos[order]
    slots = tables[seq, pos // P] * P + pos % P
    k = jnp.stack([k_seq[s][p] for s, p in zip(seq, pos)])
    v = jnp.stack([v_seq[s][p] for s, p in zip(seq, pos)])
    cache = WRITE(random_cache(rng, dtype), k, v, jnp.asarray(slots))
    check_round_trip(cache, tables, lengths, k_seq, v_seq, dtype)


@pytest.mark.parametrize("seed", range(4))
def test_write_touches_only_its_slots(seed):
    rng = util.rng_for("isolation", seed)
    lengths = [int(x) for x in rng.integers(1, CAP + 1, size=S)]
    lengths[int(rng.integers(S))] = CAP
    while sum(-(-n // P) for n in lengths) > N:
        lengths[int(rng.integers(S))] //= 2
    lengths = [max(n, 1) for n in lengths]
    mgr = scattered_manager(rng, lengths)
    before = random_cache(rng)
    # Some tokens of some sequences, plus padding ids and positions past the lengths:
    # those get slot -1 and carry huge values that must land nowhere.
    writers = rng.choice(S, size=2, replace=False)
    seq = np.concatenate([np.full(lengths[s], s) for s in writers] + [[-1, writers[0], -1]])
    pos = np.concatenate([np.arange(lengths[s]) for s in writers] + [[0, lengths[writers[0]], 3]])
    keep = rng.random(len(seq)) < 0.6
    keep[-3:] = True
    seq, pos = seq[keep].astype(np.int32), pos[keep].astype(np.int32)
    slots = np.asarray(SLOTS(mgr, jnp.asarray(seq), jnp.asarray(pos)))
    np.testing.assert_array_equal(slots[-3:], -1)
    k = util.randn(rng, (len(seq), HKV, D))
    v = util.randn(rng, (len(seq), HKV, D))
    k, v = k.at[-3:].set(1e30), v.at[-3:].set(-1e30)
    after = WRITE(before, k, v, jnp.asarray(slots))

    k_want, v_want = np.array(before.k_pages), np.array(before.v_pages)
    for t, slot in enumerate(slots):
        if slot >= 0:
            k_want[slot // P, :, slot % P] = k[t]
            v_want[slot // P, :, slot % P] = v[t]
    np.testing.assert_array_equal(np.asarray(after.k_pages), k_want)
    np.testing.assert_array_equal(np.asarray(after.v_pages), v_want)
    # Spelled out: pages the writers do not hold are bit-identical.
    tables = np.asarray(mgr.block_tables)
    owned = set(tables[writers][tables[writers] >= 0].tolist())
    others = [p for p in range(N) if p not in owned]
    for name, b, a in (("k", before.k_pages, after.k_pages), ("v", before.v_pages, after.v_pages)):
        np.testing.assert_array_equal(np.asarray(a)[others], np.asarray(b)[others], err_msg=name)
        assert np.abs(np.asarray(a)).max() < 1e29, f"{name}: a skipped token was written"


def test_slots_past_the_pool_are_dropped():
    rng = util.rng_for("past_pool")
    before = random_cache(rng)
    k, v = util.randn(rng, (3, HKV, D)), util.randn(rng, (3, HKV, D))
    after = WRITE(before, k, v, jnp.array([N * P, N * P + 5, 2**30], jnp.int32))
    np.testing.assert_array_equal(np.asarray(after.k_pages), np.asarray(before.k_pages))
    np.testing.assert_array_equal(np.asarray(after.v_pages), np.asarray(before.v_pages))


def test_int64_slots_and_pages_past_int32_are_an_error():
    """A numpy int64 slot 2**32 + 5 had wrapped to slot 5 and been written, and a source
    page 2**32 to page 0 and been copied: host integers outside int32 raise."""
    cache = random_cache(util.rng_for("int64_slots"))
    k = jnp.ones((1, HKV, D), jnp.float32)
    with pytest.raises(ValueError, match="slot_mapping holds values outside int32"):
        jaxattn.write_kv(cache, k, k, np.array([2**32 + 5]))
    with pytest.raises(ValueError, match="src_pages holds values outside int32"):
        jaxattn.copy_pages(cache, np.array([2**32]), np.array([1]))


def test_donated_write_is_in_place_and_equal():
    rng = util.rng_for("donation")
    cache = random_cache(rng)
    k, v = util.randn(rng, (5, HKV, D)), util.randn(rng, (5, HKV, D))
    slots = jnp.array([0, 7, -1, 33, N * P - 1], jnp.int32)
    want = WRITE(cache, k, v, slots)
    got = jax.jit(write_kv, donate_argnums=0)(cache, k, v, slots)
    np.testing.assert_array_equal(np.asarray(got.k_pages), np.asarray(want.k_pages))
    np.testing.assert_array_equal(np.asarray(got.v_pages), np.asarray(want.v_pages))
    if not cache.k_pages.is_deleted():
        pytest.skip(f"backend {jax.default_backend()} does not implement buffer donation")
    assert cache.v_pages.is_deleted()
    assert not k.is_deleted() and not slots.is_deleted()


def test_create_is_zeroed_with_layout():
    cache = PagedKVCache.create(N, P, HKV, D)
    assert cache.k_pages.shape == cache.v_pages.shape == (N, HKV, P, D)
    assert cache.dtype == jnp.bfloat16
    assert (cache.num_pages, cache.page_size, cache.num_kv_heads, cache.head_dim) == (N, P, HKV, D)
    assert len(jax.tree.leaves(cache)) == 2


# ---------------------------------------------------------------- bad input
SDS = jax.ShapeDtypeStruct
CACHE = jax.eval_shape(lambda: PagedKVCache.create(N, P, HKV, D, jnp.float32))


@pytest.mark.parametrize(
    "k, v, slots, match",
    [
        ((5, HKV + 1, D), (5, HKV + 1, D), (5,), "k.shape=(5, 3, 8)"),  # head count
        ((5, HKV, D + 1), (5, HKV, D + 1), (5,), "k.shape=(5, 2, 9)"),  # head_dim
        ((5, HKV, D), (5, HKV, D), (4,), "slot_mapping.shape=(4,)"),
        ((5, HKV, D), (4, HKV, D), (5,), "v.shape=(4, 2, 8)"),
        ((5, HKV * D), (5, HKV * D), (5,), "k.shape=(5, 16)"),
    ],
)
@pytest.mark.every_case
def test_write_kv_rejects_bad_shapes(k, v, slots, match):
    args = (SDS(k, jnp.float32), SDS(v, jnp.float32), SDS(slots, jnp.int32))
    with pytest.raises(ValueError, match=re.escape(match)):
        jax.eval_shape(write_kv, CACHE, *args)


@pytest.mark.parametrize("name", ["num_pages", "page_size", "num_kv_heads", "head_dim"])
@pytest.mark.every_case
def test_create_rejects_zero_sizes(name):
    sizes = dict(num_pages=N, page_size=P, num_kv_heads=HKV, head_dim=D) | {name: 0}
    with pytest.raises(ValueError, match=f"{name}=0"):
        PagedKVCache.create(**sizes)


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.uint8, jnp.int32])
@pytest.mark.every_case
def test_unquantized_pools_hold_floats(dtype):
    """Integer pools without scales would truncate every value written to them."""
    with pytest.raises(ValueError, match="quant=KVQuant"):
        PagedKVCache.create(N, P, HKV, D, dtype)
    pool = jnp.zeros((N, HKV, P, D), dtype)
    with pytest.raises(ValueError, match="k_pages.dtype"):
        jaxattn.write_kv(PagedKVCache(pool, pool), jnp.ones((1, HKV, D)), jnp.ones((1, HKV, D)),
                         jnp.array([0]))  # fmt: skip


def test_gather_kv_past_table_capacity_is_zero():
    """Positions beyond max_pages * P come back zero, not a re-read of the last page."""
    cache = jaxattn.PagedKVCache(
        jnp.arange(2 * 1 * 2 * 1, dtype=jnp.float32).reshape(2, 1, 2, 1) + 1,
        jnp.ones((2, 1, 2, 1), jnp.float32),
    )
    k, _ = jaxattn.gather_kv(cache, jnp.array([[1]], jnp.int32), jnp.array([4], jnp.int32), 4)
    assert np.asarray(k)[0, :, 0, 0].tolist() == [3.0, 4.0, 0.0, 0.0]


def test_corrupt_page_ids_read_inside_the_pool_and_are_reported():
    """A -1 or too-large page id never reads outside the pool: gather_kv and the decode
    kernel clamp it the same way, and validate_page_table flags the sequence."""
    rng = np.random.default_rng(7)
    pool = jnp.asarray(rng.standard_normal((4, 2, 4, 16)), jnp.float32)
    cache = jaxattn.PagedKVCache(pool, pool * 0.5)
    tables = jnp.array([[1, -1], [2, 9]], jnp.int32)
    lengths = jnp.array([7, 8], jnp.int32)
    q = jnp.asarray(rng.standard_normal((2, 4, 16)), jnp.float32)
    out = jaxattn.paged_decode(q, cache, tables, lengths, implementation="pallas")
    ref = jaxattn.paged_decode(q, cache, tables, lengths, implementation="xla")
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=2e-5, atol=2e-5)
    report = jaxattn.validate_page_table(cache, tables, lengths)
    assert report["pages_in_range"].tolist() == [False, False]


@pytest.mark.parametrize(
    "k_dtype, v_dtype, slot_dtype",
    [(jnp.float32, jnp.float16, jnp.int32), (jnp.float32, jnp.float32, jnp.float32)],
    ids=["kv_dtype_mix", "float_slots"],
)
@pytest.mark.every_case
def test_write_kv_rejects_dtype_mix(k_dtype, v_dtype, slot_dtype):
    cache = jaxattn.PagedKVCache.create(4, 4, 1, 8, dtype=jnp.float32)
    k = jnp.ones((2, 1, 8), k_dtype)
    v = jnp.ones((2, 1, 8), v_dtype)
    with pytest.raises(ValueError, match="dtype"):
        jaxattn.write_kv(cache, k, v, jnp.array([0, 1], slot_dtype))
