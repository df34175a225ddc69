"""Beam search: `KVCacheManager.fork` (shared pages, copy-on-write), `copy_pages`, and
`paged_decode(cache_indirection=...)` against the float64 oracle on gathered histories.

The indirection cases store each row's own K/V history in random pages of a pool whose
other pages hold NaN, draw a random indirection, build in numpy the history each beam
should see (token t from the beam the indirection names), and compare with the oracle
run on those histories.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import util
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle import attention_oracle
from paged_oracle import step_oracle

import jaxattn
from jaxattn.manager import KVCacheManager, pad_ids
from jaxattn.quant import dequantize

N, P, S, M = 12, 4, 6, 4  # pages, page size, max seqs, max pages per seq
R = 3  # pairs / ids per call

FORK = jax.jit(KVCacheManager.fork)
RESERVE = jax.jit(KVCacheManager.reserve)
RELEASE = jax.jit(KVCacheManager.release)
CHECK = jax.jit(KVCacheManager.check)


def new_manager() -> KVCacheManager:
    return KVCacheManager.create(num_pages=N, page_size=P, max_seqs=S, max_pages_per_seq=M)


def ids(xs):
    return pad_ids(xs, R)


def arrays(mgr):
    return [np.asarray(x) for x in (mgr.block_tables, mgr.lengths, mgr.refcounts)]


def assert_ok(mgr, *, exclusive: bool):
    checks = {k: bool(v) for k, v in CHECK(mgr).items()}
    assert checks.pop("exclusive") == exclusive, checks
    assert all(checks.values()), checks


# ---------------------------------------------------------------- fork
def test_fork_shares_full_pages_and_copies_the_partial_one():
    mgr, ok = RESERVE(new_manager(), ids([0]), ids([10]))  # pages 0, 1 full; 2 holds 2
    assert bool(ok)
    mgr, copy_src, copy_dst, ok = FORK(mgr, ids([0, 0]), ids([1, 2]))  # beam width 3
    assert bool(ok)
    assert mgr.block_tables[:3].tolist() == [[0, 1, 2, -1], [0, 1, 3, -1], [0, 1, 4, -1]]
    assert mgr.lengths.tolist() == [10, 10, 10, 0, 0, 0]
    assert mgr.pages_held.tolist() == [3, 3, 3, 0, 0, 0]
    assert mgr.refcounts.tolist()[:6] == [3, 3, 1, 1, 1, 0]
    assert int(mgr.num_free_pages) == N - 5
    assert copy_src.tolist() == [2, 2, -1] and copy_dst.tolist() == [3, 4, -1]
    assert_ok(mgr, exclusive=False)


def test_fork_of_whole_pages_copies_nothing_and_reserve_appends_own_pages():
    mgr, _ = RESERVE(new_manager(), ids([0]), ids([8]))
    mgr, copy_src, copy_dst, ok = FORK(mgr, ids([0]), ids([1]))
    assert bool(ok) and copy_src.tolist() == [-1] * R and copy_dst.tolist() == [-1] * R
    assert mgr.block_tables[1].tolist() == [0, 1, -1, -1] and int(mgr.num_free_pages) == N - 2
    # Growing keeps the shared pages and appends pages of each row's own: the next
    # positions (8, 9) map into pages nobody else holds.
    mgr, ok = RESERVE(mgr, ids([0, 1]), ids([10, 9]))
    assert bool(ok)
    assert mgr.block_tables[:2].tolist() == [[0, 1, 2, -1], [0, 1, 3, -1]]
    slots = mgr.slot_mapping(jnp.array([0, 0, 1]), jnp.array([8, 9, 8]))
    assert slots.tolist() == [8, 9, 12]
    assert (mgr.refcounts[slots // P] == 1).all()
    assert_ok(mgr, exclusive=False)


def test_release_frees_a_shared_page_with_its_last_holder():
    mgr, _ = RESERVE(new_manager(), ids([0]), ids([10]))
    mgr, *_ = FORK(mgr, ids([0, 0]), ids([1, 2]))
    mgr = RELEASE(mgr, ids([0]))
    assert mgr.refcounts.tolist()[:5] == [2, 2, 0, 1, 1] and int(mgr.num_free_pages) == N - 4
    mgr = RELEASE(mgr, ids([1]))
    assert mgr.refcounts.tolist()[:5] == [1, 1, 0, 0, 1]
    assert_ok(mgr, exclusive=True)
    mgr = RELEASE(mgr, ids([2]))
    assert int(mgr.num_free_pages) == N and not mgr.refcounts.any()
    assert_ok(mgr, exclusive=True)


@pytest.mark.parametrize(
    "src, dst, why",
    [
        ([0, 1, 2], [3, 4, 5], "pool short: 3 copies, 2 free pages"),
        ([0], [1], "destination not empty"),
        ([0, 0], [3, 3], "destination twice"),
        ([0, 0], [3, S], "id >= max_seqs"),
        ([S, 0], [3, 4], "source id >= max_seqs"),
    ],
)
@pytest.mark.every_case
def test_failed_fork_changes_nothing(src, dst, why):
    mgr, ok = RESERVE(new_manager(), ids([0, 1, 2]), ids([13, 13, 6]))  # 10 pages, 3 partial
    assert bool(ok) and int(mgr.num_free_pages) == 2
    after, copy_src, copy_dst, ok = FORK(mgr, ids(src), ids(dst))
    assert not bool(ok), why
    assert copy_src.tolist() == [-1] * R and copy_dst.tolist() == [-1] * R, why
    for x, y in zip(arrays(after), arrays(mgr)):
        np.testing.assert_array_equal(x, y, err_msg=why)


def test_fork_ignores_padding_and_empty_sources():
    mgr, _ = RESERVE(new_manager(), ids([0]), ids([3]))
    mgr, copy_src, copy_dst, ok = FORK(mgr, jnp.array([0, -1, 4]), jnp.array([-1, 2, 5]))
    assert bool(ok) and copy_src.tolist() == [-1] * R and copy_dst.tolist() == [-1] * R
    assert mgr.lengths.tolist() == [3, 0, 0, 0, 0, 0] and int(mgr.num_free_pages) == N - 1


def test_fork_rejects_bad_arguments_at_trace_time():
    sds = jax.ShapeDtypeStruct
    with pytest.raises(ValueError, match=re.escape("dst_ids.shape=(2,)")):
        jax.eval_shape(
            KVCacheManager.fork, new_manager(), sds((3,), jnp.int32), sds((2,), jnp.int32)
        )
    with pytest.raises(ValueError, match="src_ids.dtype=float32"):
        jax.eval_shape(
            KVCacheManager.fork, new_manager(), sds((3,), jnp.float32), sds((3,), jnp.int32)
        )


def fork_copies(copy_src, copy_dst, b: int, ring: bool) -> list[tuple[int, int]]:
    """Pair b's (source page, fresh page) copies, in column order: one entry per pair
    `[B]`, or in a cyclic cache `max_pages_per_seq` entries per pair `[B * M]`."""
    cs, cd = copy_src.tolist(), copy_dst.tolist()
    cs, cd = (cs[b * M : (b + 1) * M], cd[b * M : (b + 1) * M]) if ring else ([cs[b]], [cd[b]])
    return [(x, y) for x, y in zip(cs, cd) if x >= 0 or y >= 0]


def run_random_steps(mgr: KVCacheManager, steps):
    """check() holds after every step (refcounts equal table references, the pages a row
    writes next are its own), forked rows share the pages never written again and copy the
    others, failed calls change nothing, and releasing everything frees every page."""
    ring = mgr.ring
    for kind, args in steps:
        before = mgr
        if kind == "release":
            mgr = RELEASE(mgr, ids(args))
        elif kind == "reserve":
            mgr, ok = RESERVE(mgr, ids([s for s, _ in args]), ids([n for _, n in args]))
        else:
            src, dst = [s for s, _ in args], [d for _, d in args]
            mgr, copy_src, copy_dst, ok = FORK(mgr, ids(src), ids(dst))
            assert copy_src.shape == copy_dst.shape == (R if ring is None else R * M,)
            if ok:
                for b, (s, d) in enumerate(zip(src, dst)):
                    if s < 0 or d < 0:
                        continue
                    n = int(before.lengths[s])
                    assert int(mgr.lengths[d]) == n
                    shared = n // P if ring is None else min(n // P, ring[0] // P)
                    held = int(before.pages_held[s])
                    table, src_table = mgr.block_tables[d].tolist(), before.block_tables[s]
                    assert table[:shared] == src_table[:shared].tolist()
                    want = [(int(src_table[j]), table[j]) for j in range(shared, held)]
                    assert fork_copies(copy_src, copy_dst, b, ring is not None) == want
        if kind != "release" and not ok:
            for x, y in zip(arrays(mgr), arrays(before)):
                np.testing.assert_array_equal(x, y)
        assert_ok(mgr, exclusive=bool(CHECK(mgr)["exclusive"]))
    mgr = RELEASE(RELEASE(mgr, ids([0, 1, 2])), ids([3, 4, 5]))
    assert int(mgr.num_free_pages) == N and not mgr.refcounts.any()


def ops(max_length: int):
    seq_id = st.integers(-1, S - 1)
    return st.one_of(
        st.tuples(
            st.just("reserve"), st.lists(st.tuples(seq_id, st.integers(0, max_length)), max_size=R)
        ),
        st.tuples(st.just("release"), st.lists(seq_id, max_size=R)),
        st.tuples(st.just("fork"), st.lists(st.tuples(seq_id, seq_id), max_size=R)),
    )


@settings(max_examples=60, deadline=None)
@given(st.lists(ops(M * P), min_size=1, max_size=14))
def test_random_fork_reserve_release_keep_invariants(steps):
    run_random_steps(new_manager(), steps)


@settings(max_examples=60, deadline=None)
@given(st.lists(ops(4 * M * P), min_size=1, max_size=14))  # rows wrap their ring
def test_random_ring_fork_reserve_release_keep_invariants(steps):
    run_random_steps(ring_manager(), steps)


# ---------------------------------------------------------------- cyclic (window) caches
WINDOW, SINKS = 7, 5  # with P = 4: 4 pages a row, ring = (kept 5, size 11)


def ring_manager(num_pages: int = N) -> KVCacheManager:
    pages = KVCacheManager.window_pages(WINDOW, SINKS, P)
    assert pages == M
    return KVCacheManager.create(num_pages, P, S, pages, window=WINDOW, sink_tokens=SINKS)


@pytest.mark.parametrize(
    "length, shared, copied",
    [
        (3, 0, [0]),  # sinks only, partly filled: copied
        (4, 1, []),  # page 0 full of sinks: shared, nothing to copy
        (9, 1, [1, 2]),  # page 1 holds sink 4 and ring positions: copied
        (16, 1, [1, 2, 3]),  # the ring full, not wrapped yet
        (30, 1, [1, 2, 3]),  # wrapped
    ],
)
@pytest.mark.every_case
def test_ring_fork_shares_full_sink_pages_and_copies_the_ring(length, shared, copied):
    mgr, ok = RESERVE(ring_manager(), ids([0]), ids([length]))
    assert bool(ok)
    src_table = mgr.block_tables[0].tolist()
    held = len(copied) + shared
    mgr, copy_src, copy_dst, ok = FORK(mgr, ids([0, -1, 0]), ids([1, 3, 2]))  # width 3
    assert bool(ok) and copy_src.shape == copy_dst.shape == (R * M,)
    fresh = iter(range(held, held + 2 * len(copied)))  # lowest free ids, in pair order
    want_src, want_dst = [-1] * (R * M), [-1] * (R * M)
    for b, d in ((0, 1), (2, 2)):
        table = mgr.block_tables[d].tolist()
        assert table[:shared] == src_table[:shared] and table[held:] == [-1] * (M - held)
        for j in copied:
            want_src[b * M + j], want_dst[b * M + j] = src_table[j], next(fresh)
            assert table[j] == want_dst[b * M + j]
    assert copy_src.tolist() == want_src and copy_dst.tolist() == want_dst
    assert mgr.lengths.tolist()[:4] == [length, length, length, 0]
    refs = mgr.refcounts.tolist()
    assert [refs[p] for p in src_table[:shared]] == [3] * shared
    assert all(refs[p] == 1 for p in src_table[shared:held] + want_dst if p >= 0)
    assert_ok(mgr, exclusive=not shared)
    for row in (0, 1, 2):  # any release order frees everything
        mgr = RELEASE(mgr, ids([row]))
        assert_ok(mgr, exclusive=row > 0 or not shared)
    assert int(mgr.num_free_pages) == N and not mgr.refcounts.any()


def test_ring_fork_short_pool_changes_nothing():
    mgr, ok = RESERVE(ring_manager(num_pages=10), ids([0, 1]), ids([30, 2]))  # 5 pages held
    assert bool(ok) and int(mgr.num_free_pages) == 5
    # Width 3: 2 x 3 ring pages to copy, 5 free pages: neither pair forks.
    after, copy_src, copy_dst, ok = FORK(mgr, ids([0, 0]), ids([2, 3]))
    assert not bool(ok)
    assert copy_src.tolist() == [-1] * (R * M) and copy_dst.tolist() == [-1] * (R * M)
    for x, y in zip(arrays(after), arrays(mgr)):
        np.testing.assert_array_equal(x, y)
    after, copy_src, copy_dst, ok = FORK(mgr, ids([0, 1]), ids([2, 3]))  # 3 + 1 copies fit
    assert bool(ok) and int(after.num_free_pages) == 1
    assert_ok(after, exclusive=False)


# ---------------------------------------------------------------- copy-on-write
@pytest.mark.parametrize(
    "quant", [None, jaxattn.KVQuant("int8", "group", 8)], ids=["bf16", "int8_group"]
)
def test_copy_on_write_beams_diverge(quant):
    """Prefill 6 tokens in beam 0, fork to beam 1, copy the partial page, then each beam
    writes its own token 6: both read the shared prefix, neither sees the other's token."""
    rng = util.rng_for("cow", str(quant))
    hkv, d = 2, 32
    cache = jaxattn.PagedKVCache.create(N, P, hkv, d, dtype=jnp.float32, quant=quant)
    mgr, _ = RESERVE(new_manager(), ids([0]), ids([6]))
    k, v = (util.randn(rng, (6, hkv, d)) for _ in range(2))
    cache = jaxattn.write_kv(cache, k, v, mgr.slot_mapping(jnp.zeros(6, int), jnp.arange(6)))
    mgr, copy_src, copy_dst, ok = FORK(mgr, ids([0]), ids([1]))
    assert bool(ok) and copy_src.tolist()[0] == 1 and copy_dst.tolist()[0] == 2
    cache = jax.jit(jaxattn.copy_pages, donate_argnums=0)(cache, copy_src, copy_dst)
    for name in ("k_pages", "v_pages") + (("k_scales", "v_scales") if quant else ()):
        pool = np.asarray(getattr(cache, name), np.float32)
        np.testing.assert_array_equal(pool[2], pool[1], err_msg=name)

    mgr, ok = RESERVE(mgr, ids([0, 1]), ids([7, 7]))
    k6, v6 = (util.randn(rng, (2, hkv, d)) for _ in range(2))
    beams = jnp.array([0, 1])
    cache = jaxattn.write_kv(cache, k6, v6, mgr.slot_mapping(beams, jnp.array([6, 6])))
    got_k, got_v = jaxattn.gather_kv(cache, mgr.block_tables[:2], mgr.lengths[:2], 8)
    if quant is None:
        for got, prefix, new in ((got_k, k, k6), (got_v, v, v6)):
            for beam in range(2):
                want = np.concatenate([prefix, new[beam : beam + 1], np.zeros((1, hkv, d))])
                np.testing.assert_array_equal(np.asarray(got[beam]), want)
    else:  # the shared prefix dequantizes identically; the new tokens differ
        for got, new in ((got_k, k6), (got_v, v6)):
            np.testing.assert_array_equal(got[0, :6], got[1, :6])
            for beam in range(2):
                np.testing.assert_allclose(got[beam, 6], new[beam], atol=0.05, rtol=0.02)


def test_copy_pages_skips_padding_and_pages_past_the_pool_and_reads_before_writing():
    rng = util.rng_for("copy_pages")
    pools = [util.randn(rng, (5, 2, 4, 8)) for _ in range(2)]
    cache = jaxattn.PagedKVCache(*pools)
    src, dst = jnp.array([0, 1, -1, 3, 7, 2]), jnp.array([1, 0, 4, -1, 2, 5])
    out = jaxattn.copy_pages(cache, src, dst)  # pairs 2-5: a page < 0 or past the pool
    for got, pool in zip((out.k_pages, out.v_pages), pools):
        np.testing.assert_array_equal(got, np.asarray(pool)[[1, 0, 2, 3, 4]])  # a swap
    with pytest.raises(ValueError, match="copy_pages"):
        jaxattn.copy_pages(cache, jnp.array([0, 1]), jnp.array([1]))


@pytest.mark.parametrize("impl", util.IMPLEMENTATIONS)
@pytest.mark.parametrize("fork_at", [3, 9, 26], ids=lambda n: f"fork_at{n}")
def test_ring_fork_beams_diverge_over_ring_wraps(impl, fork_at):
    """A cyclic row forks (at 3 tokens: sinks partly written; 9: a full sink page shared;
    26: the ring wrapped) and its pages are copied; then the two beams append different
    tokens, in chunks of 1 to 3 for three ring wraps, through `paged_attention` (one-token
    rows take the decode kernel, chunks the flash kernel). Every output of each beam
    equals the windowed float64 oracle on its own history, the manager's invariants hold,
    and releasing both beams frees every page."""
    rng = util.rng_for("ring_fork", impl, fork_at)
    hkv, d, max_tokens = 2, 32, 32
    mgr = ring_manager()
    total = fork_at + 3 * mgr.ring[1]
    # Each beam's history, float32 values: the beams agree before the fork.
    hist = [np.float32(rng.standard_normal((2, total, h, d))).astype(np.float64)
            for h in (HQ, hkv, hkv)]  # fmt: skip
    for x in hist:
        x[1, :fork_at] = x[0, :fork_at]
    cache = jaxattn.PagedKVCache.create(N, P, hkv, d, dtype=jnp.float32)
    cache = jaxattn.PagedKVCache(
        *(jnp.full_like(x, jnp.nan) for x in (cache.k_pages, cache.v_pages))
    )
    opts = dict(window=WINDOW, sink_tokens=SINKS)

    @jax.jit(compiler_options=util.FAST_COMPILE)
    def step(mgr, cache, seq_ids, lengths, q_lens, q, k, v):
        mgr, ok = mgr.reserve(seq_ids, lengths)
        meta = jaxattn.AttentionMetadata.build(mgr, seq_ids, q_lens, max_tokens)
        out, cache = jaxattn.paged_attention(q, k, v, cache, meta, implementation=impl, **opts)
        return mgr, cache, out, ok

    def run(mgr, cache, done, q_lens):
        """Beams 0 and 1 append q_lens[b] tokens after their done[b]; outputs checked."""
        packed = [np.full((max_tokens, x.shape[2], d), np.nan) for x in hist]
        want = np.zeros((max_tokens, HQ, d))
        t = 0
        for b, n in enumerate(q_lens):
            for x, y in zip(packed, hist):
                x[t : t + n] = y[b, done[b] : done[b] + n]
            ctx = done[b] + n
            history = [(hist[1][b], hist[2][b])]
            want[t : t + n] = step_oracle(hist[0][b, done[b] : ctx], [0, n], [ctx], history,
                                          **opts)[0]  # fmt: skip
            t += n
        lengths = [done[b] + n for b, n in enumerate(q_lens)]
        mgr, cache, out, ok = step(
            mgr, cache, *(jnp.asarray(x, jnp.int32) for x in ([0, 1], lengths, q_lens)),
            *(jnp.asarray(x, jnp.float32) for x in packed),
        )  # fmt: skip
        assert bool(ok)
        util.assert_out_close(out[:t], want[:t], "float32", what=f"{impl} at {done}+{q_lens}")
        util.assert_zero_rows(out[t:], True, "padding tokens")
        return mgr, cache, lengths

    mgr, cache, _ = run(mgr, cache, [0, 0], [fork_at, 0])
    mgr, copy_src, copy_dst, ok = FORK(mgr, ids([0]), ids([1]))
    assert bool(ok) and int((copy_dst >= 0).sum()) == mgr.pages_held[0] - (fork_at >= 4)
    cache = jax.jit(jaxattn.copy_pages, donate_argnums=0)(cache, copy_src, copy_dst)
    assert_ok(mgr, exclusive=fork_at < 4)
    done = [fork_at, fork_at]
    while min(done) < total:
        q_lens = [min(int(rng.integers(1, 4)), total - n) for n in done]
        mgr, cache, done = run(mgr, cache, done, q_lens)
    assert_ok(mgr, exclusive=fork_at < 4)
    mgr = RELEASE(mgr, ids([0, 1]))
    assert int(mgr.num_free_pages) == N and not mgr.refcounts.any()


# ---------------------------------------------------------------- cache indirection
HQ, HKV, D, PAGE, MAX_PAGES = 4, 2, 32, 4, 4
CAPACITY = PAGE * MAX_PAGES


def _beam_problem(width: int, lengths, ind_len: int, seed, max_pages: int = MAX_PAGES):
    """Requests of `width` beams (rows ordered (request, beam)), each row's own history in
    random pages (NaN elsewhere), a random indirection; and each row's gathered history
    (`max_pages` pages of PAGE tokens a row)."""
    rng = util.rng_for("beam", width, tuple(lengths), ind_len, seed)
    capacity = max_pages * PAGE
    rows = len(lengths) * width
    row_len = np.repeat(lengths, width)  # beams of a request have one length
    own = rng.standard_normal((2, rows, capacity, HKV, D))  # K and V of each row
    num_pages = rows * max_pages + 3
    pools = np.full((2, num_pages, HKV, PAGE, D), np.nan)
    tables = rng.permutation(num_pages)[: rows * max_pages].reshape(rows, max_pages)
    for r in range(rows):
        for t in range(row_len[r]):
            pools[:, tables[r, t // PAGE], :, t % PAGE] = own[:, r, t]
    ind = rng.integers(0, width, (len(lengths), width, ind_len))
    t = np.arange(capacity)
    r = np.arange(rows)[:, None]
    beam = np.where(
        t < ind_len, ind.reshape(rows, ind_len)[:, np.minimum(t, ind_len - 1)], r % width
    )
    hist = own[:, r - r % width + beam, t]  # [2, rows, capacity, HKV, D]
    q = rng.standard_normal((rows, HQ, D))
    cache = jaxattn.PagedKVCache(*(jnp.asarray(p, jnp.float32) for p in pools))
    return (jnp.asarray(q, jnp.float32), cache, jnp.asarray(tables, jnp.int32),
            jnp.asarray(row_len, jnp.int32), jnp.asarray(ind, jnp.int32), hist)  # fmt: skip


OPTIONS = {
    "plain": {},
    "window_sinks_alibi": dict(window=7, sink_tokens=2, alibi=True),
}


@pytest.mark.parametrize("impl", util.IMPLEMENTATIONS)
@pytest.mark.parametrize("width, lengths, ind_len", [(2, (13, 5, 0), CAPACITY), (3, (16, 9), 11)])
@pytest.mark.parametrize("options", OPTIONS, ids=str)
def test_decode_with_indirection_equals_gathered_histories(impl, width, lengths, ind_len, options):
    """`ind_len` < a length: tokens past the indirection's columns come from the row itself."""
    q, cache, tables, lens, ind, hist = _beam_problem(width, lengths, ind_len, 0)
    opts = dict(OPTIONS[options])
    slopes = jaxattn.alibi_slopes(HQ) if opts.pop("alibi", False) else None
    want, want_lse = attention_oracle(
        util.f64(q)[:, None], hist[0], hist[1], causal=True,
        q_lengths=np.ones(len(lens), int), kv_lengths=np.asarray(lens),
        alibi_slopes=None if slopes is None else np.float64(slopes), **opts,
    )  # fmt: skip
    configs = [None]
    if impl == "pallas":  # split-K off and on
        configs = [jaxattn.PagedDecodeConfig(16, 1), jaxattn.PagedDecodeConfig(16, 2)]
    for config in configs:
        out, lse = jax.jit(
            lambda q, cache, tables, lens, ind, config=config: jaxattn.paged_decode(
                q, cache, tables, lens, cache_indirection=ind, alibi_slopes=slopes,
                return_lse=True, implementation=impl, config=config, **opts,
            ),
            compiler_options=util.FAST_COMPILE,
        )(q, cache, tables, lens, ind)  # fmt: skip
        util.assert_out_close(out, want[:, 0], "float32", what=f"{impl} {config}")
        util.assert_lse_close(lse, want_lse[:, :, 0], "float32")
        util.assert_zero_rows(out, (np.asarray(lens) == 0)[:, None, None], "idle rows")


@pytest.mark.parametrize(
    "quant",
    [jaxattn.KVQuant("int8", "group", 8), jaxattn.KVQuant("int4", "group", D // 2)],
    ids=str,
)  # fmt: skip
def test_indirection_on_a_quantized_cache(quant):
    """Beams read through a quantized cache (table entries and scales loaded a step ahead
    in the kernel): the same outputs as the float cache holding its dequantized values,
    split-K off and on."""
    q, cache, tables, lens, ind, _ = _beam_problem(3, (40, 23), 30, 2, max_pages=12)
    n, hkv, page, d = cache.k_pages.shape
    tokens = lambda x: jnp.swapaxes(x, 1, 2).reshape(n * page, hkv, d)  # noqa: E731
    stored = jaxattn.PagedKVCache.create(n, page, hkv, d, quant=quant)
    stored = jaxattn.write_kv(stored, tokens(cache.k_pages), tokens(cache.v_pages),
                              jnp.arange(n * page))  # fmt: skip
    plain = jaxattn.PagedKVCache(
        *(dequantize(x, s, quant) for x, s in ((stored.k_pages, stored.k_scales),
                                               (stored.v_pages, stored.v_scales)))
    )  # fmt: skip
    # 16-token blocks: the 40-token rows run a sink block, then two window blocks.
    opts = dict(window=20, sink_tokens=18, cache_indirection=ind, return_lse=True)
    want, want_lse = jaxattn.paged_decode(q, plain, tables, lens, implementation="xla", **opts)
    for splits in (1, 2):
        config = jaxattn.PagedDecodeConfig(16, splits)
        out, lse = jaxattn.paged_decode(
            q, stored, tables, lens, implementation="pallas", config=config, **opts
        )
        np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=2e-5, atol=2e-5)
        np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=2e-5, atol=2e-5)


def test_unsigned_indirection_clamps_alike():
    """uint32 beam ids past int32's range clamp to the last beam in every implementation
    (the kernel's int32 cast had wrapped them to negative, then to beam 0)."""
    q, cache, tables, lens, ind, _ = _beam_problem(2, (13, 6), CAPACITY, 3)
    wide = np.asarray(ind, np.uint32)
    wide[0, 0, 3] = wide[1, 0, 2] = 2**31 + 5
    last = np.asarray(ind, np.uint32)
    last[0, 0, 3] = last[1, 0, 2] = 1
    want = jaxattn.paged_decode(q, cache, tables, lens, implementation="xla",
                                cache_indirection=jnp.asarray(last))  # fmt: skip
    for impl in util.IMPLEMENTATIONS:
        out = jaxattn.paged_decode(q, cache, tables, lens, implementation=impl,
                                   cache_indirection=jnp.asarray(wide))  # fmt: skip
        np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=1e-6, err_msg=impl)


def test_identity_indirection_changes_nothing():
    q, cache, tables, lens, ind, _ = _beam_problem(2, (13, 6), CAPACITY, 1)
    identity = jnp.broadcast_to(jnp.arange(2)[None, :, None], ind.shape)
    for impl in util.IMPLEMENTATIONS:
        plain = jaxattn.paged_decode(q, cache, tables, lens, implementation=impl)
        beams = jaxattn.paged_decode(
            q, cache, tables, lens, implementation=impl, cache_indirection=identity
        )
        np.testing.assert_array_equal(np.asarray(beams), np.asarray(plain), err_msg=impl)


@pytest.mark.parametrize(
    "shape, dtype, match",
    [
        ((4, 16), jnp.int32, "cache_indirection.shape=(4, 16)"),
        ((3, 2, 16), jnp.int32, "cache_indirection.shape=(3, 2, 16)"),
        ((2, 2, 0), jnp.int32, "cache_indirection.shape=(2, 2, 0)"),
        ((2, 2, 16), jnp.float32, "cache_indirection.dtype=float32"),
    ],
)
@pytest.mark.every_case
def test_bad_indirection_raises(shape, dtype, match):
    sds = jax.ShapeDtypeStruct
    pages = sds((20, HKV, PAGE, D), jnp.float32)
    for impl in util.IMPLEMENTATIONS:
        with pytest.raises(ValueError, match=re.escape(match)):
            jax.eval_shape(
                lambda q, cache, tables, lens, ind, impl=impl: jaxattn.paged_decode(
                    q, cache, tables, lens, cache_indirection=ind, implementation=impl
                ),
                sds((4, HQ, D), jnp.float32),
                jaxattn.PagedKVCache(pages, pages),
                sds((4, MAX_PAGES), jnp.int32),
                sds((4,), jnp.int32),
                sds(shape, dtype),
            )


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.every_case
def test_indirection_lowers_to_triton(monkeypatch, num_splits):
    """Interpret mode does not run the Triton lowering (see test_triton_lowering)."""
    monkeypatch.setenv("JAXATTN_INTERPRET", "0")
    sds = jax.ShapeDtypeStruct
    config = jaxattn.PagedDecodeConfig(block_kv=64, num_splits=num_splits)
    fn = jax.jit(
        lambda q, cache, tables, lens, ind: jaxattn.paged_decode(
            q, cache, tables, lens, cache_indirection=ind, implementation="pallas", config=config
        )
    )
    pages = sds((64, 8, 16, 128), jnp.bfloat16)
    args = (
        sds((8, 32, 128), jnp.bfloat16),
        jaxattn.PagedKVCache(pages, pages),
        sds((8, 128), jnp.int32),
        sds((8,), jnp.int32),
        sds((2, 4, 2048), jnp.int32),
    )
    text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text
