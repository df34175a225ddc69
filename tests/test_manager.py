"""KVCacheManager against a pure-Python model: property tests over random reserve/release
sequences (invariants after every step), slot_mapping, jit/determinism, bad input.

The manager methods are jitted once at module level with fixed shapes, so hypothesis
examples reuse the compiled programs instead of recompiling.
"""

from __future__ import annotations

import doctest
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxattn.manager
from jaxattn.manager import KVCacheManager, pad_ids, reserve_from_lists

# A pool smaller than max_seqs * max_pages_per_seq (so reserves can run it dry), an odd
# page size, and lengths drawn up to past the per-sequence cap.
N, P, S, M = 9, 3, 4, 5  # pages, page size, max seqs, max pages per seq
R = 4  # requests per reserve/release call (padded with -1)
T = 16  # tokens per slot_mapping call
CAP = M * P

RESERVE = jax.jit(KVCacheManager.reserve)
RELEASE = jax.jit(KVCacheManager.release)
SLOTS = jax.jit(KVCacheManager.slot_mapping)
CHECK = jax.jit(KVCacheManager.check)
SETTINGS = settings(max_examples=80, deadline=None)


def new_manager() -> KVCacheManager:
    return KVCacheManager.create(num_pages=N, page_size=P, max_seqs=S, max_pages_per_seq=M)


def ids(xs) -> jax.Array:
    return pad_ids(xs, R)


def lens(xs) -> jax.Array:
    return pad_ids(xs, R, fill=0)


def arrays(mgr: KVCacheManager) -> dict[str, np.ndarray]:
    return {
        f.name: np.asarray(getattr(mgr, f.name))
        for f in mgr.__dataclass_fields__.values()
        if f.name != "page_size"
    }


class Model:
    """The documented semantics in plain Python: lowest free pages first, in seq id order."""

    def __init__(self):
        self.tables = [[] for _ in range(S)]
        self.lengths = [0] * S
        self.free = set(range(N))

    def reserve(self, seq_ids, lengths) -> bool:
        target = list(self.lengths)
        for s, n in zip(seq_ids, lengths):
            if s < 0:
                continue
            if s >= S:
                return False
            target[s] = max(target[s], n)  # duplicates: the largest length wins
        want = [math.ceil(n / P) for n in target]
        if any(w > M for w in want):
            return False
        need = [max(0, w - len(t)) for w, t in zip(want, self.tables)]
        if sum(need) > len(self.free):
            return False
        pool = iter(sorted(self.free))
        for s in range(S):
            for _ in range(need[s]):
                page = next(pool)
                self.tables[s].append(page)
                self.free.remove(page)
        self.lengths = target
        return True

    def release(self, seq_ids):
        for s in set(seq_ids):
            if 0 <= s < S:
                self.free.update(self.tables[s])
                self.tables[s] = []
                self.lengths[s] = 0

    def slot(self, s, pos) -> int:
        if not (0 <= s < S and 0 <= pos < self.lengths[s]):
            return -1
        return self.tables[s][pos // P] * P + pos % P

    def block_tables(self) -> np.ndarray:
        return np.array([t + [-1] * (M - len(t)) for t in self.tables], np.int32)


def assert_invariants(mgr: KVCacheManager):
    """Checked on the arrays directly (numpy), and through `mgr.check()`."""
    tables, lengths, refs = (np.asarray(x) for x in (mgr.block_tables, mgr.lengths, mgr.refcounts))
    assert tables.shape == (S, M) and lengths.shape == (S,) and refs.shape == (N,)
    assert tables.dtype == lengths.dtype == refs.dtype == np.int32
    held = [row[row >= 0] for row in tables]
    for s, (row, pages) in enumerate(zip(tables, held)):
        assert len(pages) == math.ceil(lengths[s] / P), f"seq {s}: {row=} {lengths[s]=}"
        assert (row[len(pages) :] == -1).all(), f"seq {s}: entries past its pages: {row}"
    used = np.concatenate(held)
    assert ((used >= 0) & (used < N)).all(), f"page ids out of range: {used}"
    assert len(set(used.tolist())) == len(used), f"a page held twice: {tables}"
    assert (refs == np.isin(np.arange(N), used)).all(), f"{refs=} vs tables {tables}"
    assert int(mgr.num_free_pages) + len(used) == N
    checks = {k: bool(v) for k, v in CHECK(mgr).items()}
    assert all(checks.values()), checks


def assert_matches(mgr: KVCacheManager, model: Model):
    np.testing.assert_array_equal(np.asarray(mgr.block_tables), model.block_tables())
    np.testing.assert_array_equal(np.asarray(mgr.lengths), model.lengths)
    assert int(mgr.num_free_pages) == len(model.free)


# ---------------------------------------------------------------- property tests
seq_id = st.integers(-1, S - 1)
length = st.one_of(st.integers(0, CAP + 2), st.integers(CAP - 2 * P, CAP))  # long ones often
request = st.lists(st.tuples(seq_id, length), max_size=R)


@st.composite
def op(draw):
    """("reserve", [(seq id, length), ...]) or ("release", [seq id, ...])."""
    kind = draw(st.integers(0, 9))
    if kind < 3:
        return "release", draw(st.lists(seq_id, max_size=R))
    if kind == 3:  # an id past max_seqs rejects the whole call
        return "reserve", [*draw(request)[: R - 1], (S, 1)]
    return "reserve", draw(request)


def run_op(mgr: KVCacheManager, model: Model, step) -> KVCacheManager:
    kind, args = step
    if kind == "release":
        model.release(args)
        return RELEASE(mgr, ids(args))
    before = arrays(mgr)
    seq_ids, lengths = [a for a, _ in args], [b for _, b in args]
    mgr, ok = RESERVE(mgr, ids(seq_ids), lens(lengths))
    assert bool(ok) == model.reserve(seq_ids, lengths), (seq_ids, lengths)
    if not ok:  # all or nothing: every array bit-identical
        after = arrays(mgr)
        for name, x in before.items():
            np.testing.assert_array_equal(after[name], x, err_msg=name)
    return mgr


@SETTINGS
@given(st.lists(op(), min_size=1, max_size=12))
def test_random_reserve_release_matches_model(steps):
    mgr, model = new_manager(), Model()
    for step in steps:
        mgr = run_op(mgr, model, step)
        assert_invariants(mgr)
        assert_matches(mgr, model)


@SETTINGS
@given(
    st.lists(op(), min_size=0, max_size=8),
    st.lists(st.tuples(st.integers(-2, S), st.integers(-2, CAP + 2)), min_size=T, max_size=T),
)
def test_slot_mapping_matches_model(steps, tokens):
    mgr, model = new_manager(), Model()
    for step in steps:
        mgr = run_op(mgr, model, step)
    seq_ids, positions = (jnp.array(x, jnp.int32) for x in zip(*tokens))
    slots = np.asarray(SLOTS(mgr, seq_ids, positions))
    assert slots.dtype == np.int32 and slots.shape == (T,)
    want = [model.slot(s, p) for s, p in tokens]
    np.testing.assert_array_equal(slots, want, err_msg=f"{tokens=}")
    for (s, _), slot in zip(tokens, slots):  # never a page the sequence does not hold
        if slot >= 0:
            assert slot // P in model.tables[s]


# ---------------------------------------------------------------- semantics
def test_create_is_empty():
    mgr = new_manager()
    assert (mgr.num_pages, mgr.page_size, mgr.max_seqs, mgr.max_pages_per_seq) == (N, P, S, M)
    assert int(mgr.num_free_pages) == N and mgr.num_free_pages.dtype == jnp.int32
    assert (np.asarray(mgr.block_tables) == -1).all() and (np.asarray(mgr.lengths) == 0).all()
    assert_invariants(mgr)


def test_duplicate_ids_grow_to_the_largest_length():
    mgr, ok = RESERVE(new_manager(), ids([1, 1, -1, 1]), lens([2, 7, 100, 4]))
    assert bool(ok)
    assert mgr.lengths.tolist() == [0, 7, 0, 0]  # the padding entry's 100 is ignored
    assert mgr.block_tables[1].tolist() == [0, 1, 2, -1, -1]
    # A duplicate whose largest length is over the cap fails the whole call.
    again, ok = RESERVE(mgr, ids([1, 1, 2]), lens([3, CAP + 1, 1]))
    assert not bool(ok)
    assert again.lengths.tolist() == [0, 7, 0, 0]


def test_reserve_never_shrinks_and_grows_in_place():
    mgr, ok = RESERVE(new_manager(), ids([0, 2]), lens([5, 1]))
    assert bool(ok) and mgr.block_tables[:, :2].tolist() == [[0, 1], [-1, -1], [2, -1], [-1, -1]]
    mgr, ok = RESERVE(mgr, ids([0]), lens([1]))
    assert bool(ok) and mgr.lengths.tolist() == [5, 0, 1, 0]
    mgr, ok = RESERVE(mgr, ids([0]), lens([7]))  # grows: keeps pages 0, 1, appends page 3
    assert bool(ok) and mgr.block_tables[0].tolist() == [0, 1, 3, -1, -1]
    assert_invariants(mgr)


@pytest.mark.parametrize(
    "seq_ids, lengths, why",
    [
        ([0, 1, 2, 3], [CAP, CAP, CAP, 1], "pool short"),
        ([0, 1], [1, CAP + 1], "over max_pages_per_seq"),
        ([0, S], [1, 1], "seq id >= max_seqs"),
    ],
)
@pytest.mark.every_case
def test_failed_reserve_changes_nothing(seq_ids, lengths, why):
    mgr, ok = RESERVE(new_manager(), ids([3]), lens([4]))
    assert bool(ok)
    before = arrays(mgr)
    after, ok = RESERVE(mgr, ids(seq_ids), lens(lengths))
    assert not bool(ok), why
    for name, x in arrays(after).items():
        np.testing.assert_array_equal(x, before[name], err_msg=f"{why}: {name}")


def test_release_frees_pages_once_and_ignores_padding():
    mgr, _ = RESERVE(new_manager(), ids([0, 1, 2]), lens([4, 3, 9]))
    free = int(mgr.num_free_pages)
    mgr = RELEASE(mgr, ids([2, -1, 2, S]))  # duplicate, padding, out of range
    assert int(mgr.num_free_pages) == free + 3
    assert mgr.lengths.tolist() == [4, 3, 0, 0]
    assert mgr.block_tables[2].tolist() == [-1] * M
    assert_invariants(mgr)
    # The freed pages are reused, lowest id first.
    mgr, ok = RESERVE(mgr, ids([3]), lens([4]))
    assert bool(ok) and mgr.block_tables[3].tolist()[:2] == [3, 4]


def test_jit_matches_eager_and_is_deterministic():
    def script(reserve, release):
        mgr = new_manager()
        mgr, _ = reserve(mgr, ids([0, 1, 2]), lens([4, 8, 2]))
        mgr = release(mgr, ids([1]))
        mgr, _ = reserve(mgr, ids([3, 0]), lens([9, 6]))
        return mgr

    eager = script(KVCacheManager.reserve, KVCacheManager.release)
    for _ in range(2):
        jitted = script(RESERVE, RELEASE)
        for name, x in arrays(jitted).items():
            np.testing.assert_array_equal(x, arrays(eager)[name], err_msg=name)


def test_is_a_pytree_with_static_page_size():
    mgr = new_manager()
    leaves, treedef = jax.tree.flatten(mgr)
    assert len(leaves) == 3 and all(x.dtype == jnp.int32 for x in leaves)
    assert jax.tree.unflatten(treedef, leaves).page_size == P

    # A whole step (grow, then map each sequence's last token) in one jit, manager in and out.
    @jax.jit
    def step(mgr, seq_ids, lengths):
        mgr, ok = mgr.reserve(seq_ids, lengths)
        return mgr, ok, mgr.slot_mapping(seq_ids, lengths - 1)

    mgr, ok, slots = step(mgr, ids([0, 1]), lens([3, 5]))
    assert bool(ok) and isinstance(mgr, KVCacheManager) and mgr.page_size == P
    # seq 0 holds page 0 (token 2: slot 2); seq 1 holds pages 1, 2 (token 4: page 2, offset 1)
    assert slots.tolist() == [2, 2 * P + 1, -1, -1]


def test_check_flags_corruption():
    mgr, _ = RESERVE(new_manager(), ids([0, 1]), lens([4, 2]))
    tables = mgr.block_tables
    shared = KVCacheManager(tables.at[1, 0].set(tables[0, 0]), mgr.lengths, mgr.refcounts, P)
    checks = CHECK(shared)
    assert not bool(checks["refcounts_match_tables"]) and not bool(checks["ok"])
    hole = KVCacheManager(tables.at[0, 0].set(-1), mgr.lengths, mgr.refcounts, P)
    assert not bool(CHECK(hole)["held_prefix"]) and not bool(CHECK(hole)["ok"])
    twice = KVCacheManager(
        tables.at[0, 1].set(tables[0, 0]), mgr.lengths, mgr.refcounts.at[tables[0, 0]].add(1), P
    )
    assert not bool(CHECK(twice)["distinct_in_row"]) and not bool(CHECK(twice)["exclusive"])
    too_long = KVCacheManager(tables, mgr.lengths.at[0].set(7), mgr.refcounts, P)
    assert not bool(CHECK(too_long)["held_matches_lengths"])


def test_module_docstring_example():
    result = doctest.testmod(jaxattn.manager, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


# ---------------------------------------------------------------- host side
def test_pad_ids_and_reserve_from_lists():
    assert pad_ids([3, 1], 4).tolist() == [3, 1, -1, -1]
    assert pad_ids([3, 1], 4).dtype == jnp.int32
    assert pad_ids([], 2, fill=0).tolist() == [0, 0]
    with pytest.raises(ValueError, match="3 ids do not fit in a bucket of size 2"):
        pad_ids([1, 2, 3], 2)
    mgr, ok = reserve_from_lists(new_manager(), [2, 0], [4, 1], bucket=8)
    assert bool(ok) and mgr.lengths.tolist() == [1, 0, 4, 0]
    with pytest.raises(ValueError, match="2 seq_ids but 1 lengths"):
        reserve_from_lists(new_manager(), [2, 0], [4], bucket=8)


# ---------------------------------------------------------------- bad input
SDS = jax.ShapeDtypeStruct


@pytest.mark.parametrize("name", ["num_pages", "page_size", "max_seqs", "max_pages_per_seq"])
@pytest.mark.parametrize("value", [0, -2, 1.5, 4.0, True])
@pytest.mark.every_case
def test_create_rejects_bad_sizes(name, value):
    """Sizes are positive ints: 4.0 had passed this check and failed later in jnp.full with
    a message naming no argument, and True had counted as 1."""
    sizes = dict(num_pages=N, page_size=P, max_seqs=S, max_pages_per_seq=M) | {name: value}
    with pytest.raises(ValueError, match=f"{name}={value}"):
        KVCacheManager.create(**sizes)


@pytest.mark.parametrize("window", [True, 2.0, 0])
@pytest.mark.every_case
def test_create_rejects_a_window_that_is_no_positive_int(window):
    """window=True had made a ring of one token."""
    with pytest.raises(ValueError, match="window="):
        KVCacheManager.create(num_pages=12, page_size=4, max_seqs=3, max_pages_per_seq=3,
                              window=window)  # fmt: skip


def test_create_rejects_int32_overflow():
    with pytest.raises(ValueError, match="int32"):
        KVCacheManager.create(num_pages=2**20, page_size=2**12, max_seqs=1, max_pages_per_seq=1)


@pytest.mark.parametrize(
    "method, args, match",
    [
        ("reserve", (SDS((2, 2), jnp.int32), SDS((2, 2), jnp.int32)), "seq_ids.shape=(2, 2)"),
        ("reserve", (SDS((3,), jnp.int32), SDS((2,), jnp.int32)), "lengths.shape=(2,)"),
        ("reserve", (SDS((3,), jnp.float32), SDS((3,), jnp.int32)), "seq_ids.dtype=float32"),
        ("reserve", (SDS((3,), jnp.int32), SDS((3,), jnp.float32)), "lengths.dtype=float32"),
        ("release", (SDS((), jnp.int32),), "seq_ids.shape=()"),
        ("slot_mapping", (SDS((4,), jnp.int32), SDS((5,), jnp.int32)), "positions.shape=(5,)"),
        ("slot_mapping", (SDS((4,), jnp.int32), SDS((4,), jnp.bool_)), "positions.dtype=bool"),
    ],
)
@pytest.mark.every_case
def test_bad_arguments_fail_at_trace_time(method, args, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        jax.eval_shape(getattr(KVCacheManager, method), new_manager(), *args)


def _two_sequences() -> KVCacheManager:
    mgr = KVCacheManager.create(num_pages=8, page_size=4, max_seqs=3, max_pages_per_seq=3)
    mgr, ok = mgr.reserve(jnp.array([0, 1]), jnp.array([6, 3]))
    assert bool(ok)
    return mgr


BIG = 2**32 + 1  # numpy's default int64; jax with 64-bit mode off would wrap it to 1


@pytest.mark.parametrize(
    "call",
    [
        lambda m: m.release(np.array([BIG])),
        lambda m: m.reserve(np.array([2]), np.array([BIG + 4])),
        lambda m: m.slot_mapping(np.array([BIG]), np.array([0])),
        lambda m: pad_ids(np.array([BIG]), 2),
    ],
    ids=["release", "reserve", "slot_mapping", "pad_ids"],
)
@pytest.mark.every_case
def test_int64_host_values_past_int32_are_an_error(call):
    """Id 2**32 + 1 had released live sequence 1, mapped into its pages, and a length of
    2**32 + 5 had reserved 5 tokens: host integers outside int32 now raise."""
    with pytest.raises(ValueError, match="outside int32"):
        call(_two_sequences())


@pytest.mark.parametrize(
    "call",
    [
        lambda m: m.reserve(jnp.array([2], jnp.uint32), jnp.array([3_000_000_000], jnp.uint32)),
        lambda m: m.release(jnp.array([2**32 - 1], jnp.uint32)),
        lambda m: m.slot_mapping(jnp.array([0], jnp.uint32), jnp.array([2**31], jnp.uint32)),
    ],
    ids=["reserve", "release", "slot_mapping"],
)
@pytest.mark.every_case
def test_uint32_device_values_past_int32_are_an_error(call):
    """A uint32 JAX array (allowed with 64-bit mode off) of a length 3e9 had reserved
    nothing and reported success, and id 2**32 - 1 had wrapped to -1 (padding): values
    outside int32 of a concrete JAX array raise as host ones do."""
    with pytest.raises(ValueError, match="outside int32"):
        call(_two_sequences())


def test_traced_uint32_values_past_int32_saturate():
    """Traced, a uint32 length past int32 cannot be looked at: it saturates to int32's
    bound (more than any pool holds), so reserve fails rather than wrapping to 0."""
    reserve = jax.jit(lambda m, ids, lengths: m.reserve(ids, lengths))
    ids = jnp.array([2], jnp.uint32)
    mgr, ok = reserve(_two_sequences(), ids, jnp.array([3_000_000_000], jnp.uint32))
    assert not bool(ok) and mgr.lengths.tolist() == [6, 3, 0]
    mgr, ok = reserve(_two_sequences(), ids, jnp.array([4], jnp.uint32))
    assert bool(ok) and mgr.lengths.tolist() == [6, 3, 4]


def test_slot_mapping_never_gives_a_slot_of_a_shared_page():
    """After `fork` the beams share their full pages; a plan built after a failed reserve
    (both beams' next token at position 3 of the shared page) gets no slot there: it had
    written both beams' tokens into one slot, each overwriting the other's history."""
    mgr = KVCacheManager.create(num_pages=2, page_size=4, max_seqs=3, max_pages_per_seq=2)
    mgr, _ = mgr.reserve(jnp.array([0]), jnp.array([4]))
    mgr, _, _, ok = mgr.fork(jnp.array([0]), jnp.array([1]))
    assert bool(ok) and mgr.refcounts.tolist() == [2, 0]
    mgr, ok = mgr.reserve(jnp.array([0, 1]), jnp.array([5, 5]))  # one free page for two
    assert not bool(ok)
    assert mgr.slot_mapping(jnp.array([0, 1, 0]), jnp.array([3, 3, 0])).tolist() == [-1] * 3
