"""In-flight batching: `jaxattn.paged_attention`, `paged_attention_qkv` and
`AttentionMetadata`, against the float64 numpy oracle (`paged_oracle.py`), for every
implementation.

A `World` holds sequences with their whole q/k/v histories (numpy, drawn once) and pages
scattered at random in a pool whose every slot starts poisoned (NaN, or a huge finite
value; quantized caches: large garbage). A step ("call") names, in batch order, rows
`(sequence, prefix, q_len)`; the world plans it (`AttentionMetadata.from_lists`, checked
against the layout computed here), runs it, and checks:
  - every token's output against the oracle on its sequence's full history (as the cache
    stores it: the history drawn here, rotated when RoPE is on; for quantized caches the
    values `gather_kv` reads back after the step);
  - padding tokens (whose q/k/v are poisoned) output exact zeros;
  - the cache: the step's slots hold the step's K/V (quantized: the exact bytes and scales
    of `quant_oracle`), every other slot is bit-identical.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import util
from paged_oracle import expected_storage, rope_np, step_oracle

import jaxattn

impls = pytest.mark.parametrize("impl", util.IMPLEMENTATIONS)
dtypes = pytest.mark.parametrize("dtype", util.CASE_DTYPES)

HQ = 4  # query heads
P = 4  # page size
D = util.DEFAULT_HEAD_DIM  # 32 on CPU

# Tolerances against the oracle beyond util.assert_out_close's dtype table. RoPE: the
# float32 angle `pos * f` is off by ~2 ulps of itself (test_rope.py), which moves q and k
# by ~1e-6 relative at these positions and the outputs by a few 1e-6.
ROPE_TOL = dict(atol=1e-4, rtol=1e-4)
# The cache's rotated keys vs the oracle's rotation rounded to the cache's dtype: float32
# angles, and a rounding that may go the other way (one ulp of bf16).
ROTATED_K_TOL = {"float32": dict(atol=1e-5, rtol=1e-5), "bfloat16": dict(atol=1e-5, rtol=2**-7)}
# Two implementations' runs of one computation (chunked vs unchunked, qkv vs split):
# only the accumulation order differs.
SAME_TOL = {"float32": dict(atol=2e-5, rtol=2e-5), "bfloat16": dict(atol=1e-2, rtol=1e-2)}
# A quantized cache's per-tensor scales: values up to 4 are representable.
TENSOR_RANGE = 4.0


# ----------------------------------------------------------------------------- helpers
def assert_codes_equal(got, want, quant, msg):
    """Stored codes equal. On a GPU, XLA's fused `x * (1 / scale)` may round a value at a
    tie the other way: there codes may differ by one step (same sign), in <= 1% of them."""
    got, want = util.bits(got), util.bits(want)
    if not util.ON_GPU:
        np.testing.assert_array_equal(got, want, msg)
        return
    if quant.dtype == "int4":  # two signed nibbles per byte
        got, want = (x.astype(np.int32) for x in (got, want))
        got, want = (np.stack([((x & 0xF) ^ 8) - 8, ((x >> 4) ^ 8) - 8]) for x in (got, want))
    elif quant.dtype == "int8":
        got, want = got.view(np.int8), want.view(np.int8)
    diff = np.abs(got.astype(np.int32) - want.astype(np.int32))
    assert diff.max() <= 1 and np.mean(diff > 0) <= 0.01, f"{msg}: {np.sum(diff > 0)} codes off"


def slot_rows(pool) -> np.ndarray:
    """A pool (or group-scale pages) `[N, Hkv, P, X]` as `[N * P, Hkv, X]`: row = slot."""
    x = np.asarray(pool)
    return x.transpose(0, 2, 1, 3).reshape(-1, x.shape[1], x.shape[3])


def rounded(x, dtype) -> np.ndarray:
    """float64 values rounded to `dtype` (what a cache or an input of that dtype holds)."""
    return util.f64(jnp.asarray(np.asarray(x, np.float64), dtype))


def unpack(result, return_lse: bool):
    """(out, lse or None, cache) of a paged_attention call."""
    if return_lse:
        (out, lse), cache = result
        return out, lse, cache
    out, cache = result
    return out, None, cache


def check_out(got, want, dtype, lowp_ref, *, tol=None, what="out"):
    if tol is not None and dtype == "float32":
        got = util.f64(got)
        assert np.isfinite(got).all(), f"{what}: {np.sum(~np.isfinite(got))} non-finite"
        np.testing.assert_allclose(got, want, **tol, err_msg=what)
    else:
        util.assert_out_close(got, want, dtype, lowp_ref=lowp_ref, what=what)


@dataclasses.dataclass(frozen=True)
class Opts:
    """Options of a paged_attention case."""

    name: str
    hkv: int = 2
    window: int | None = None
    sink_tokens: int = 0
    alibi: bool = False
    soft_cap: float | None = None
    scale: float | None = None
    rel: tuple[int, int, bool] | None = None  # T5: (num_buckets, max_distance, bidirectional)
    rope: jaxattn.RoPE | None = None
    return_lse: bool = False
    poison: str = "nan"  # padding tokens and never-written cache slots: "nan" or "huge"
    config: jaxattn.PagedAttentionConfig | None = None  # None: the heuristics

    def __str__(self):
        return self.name

    def kwargs(self, rng) -> tuple[dict, dict]:
        """(paged_attention's keyword options, the oracle's)."""
        both = dict(window=self.window, sink_tokens=self.sink_tokens, soft_cap=self.soft_cap,
                    scale=self.scale)  # fmt: skip
        impl, oracle = dict(both, rope=self.rope), dict(both)
        if self.alibi:
            slopes = jaxattn.alibi_slopes(HQ)
            impl["alibi_slopes"], oracle["alibi_slopes"] = slopes, np.float64(slopes)
        if self.rel is not None:
            num_buckets, max_distance, bidirectional = self.rel
            table = rng.standard_normal((HQ, num_buckets)).astype(np.float32)
            impl["relative_bias"] = jaxattn.RelativeBias(
                jnp.asarray(table), max_distance, bidirectional
            )
            oracle["relative_bias"] = (table, max_distance, bidirectional)
        return impl, oracle


def attention_fn(impl: str, opts: Opts, impl_kw: dict):
    return jax.jit(
        functools.partial(
            jaxattn.paged_attention, implementation=impl, config=opts.config,
            return_lse=opts.return_lse, **impl_kw,
        ),
        compiler_options=util.FAST_COMPILE,
    )  # fmt: skip


@dataclasses.dataclass
class Plan:
    meta: jaxattn.AttentionMetadata
    q: jax.Array  # [T, Hq, D]
    k: jax.Array  # [T, Hkv, D]
    v: jax.Array
    positions: np.ndarray  # [T]
    slots: np.ndarray  # [T], -1 for padding
    owner: np.ndarray  # [T], the sequence of each token, -1 for padding
    num_real: int


class World:
    """Sequences of `lengths` tokens (q/k/v histories drawn here), their pages scattered
    in a poisoned pool, and the cache (updated by every checked step)."""

    def __init__(self, rng, lengths, *, hkv, dtype, quant=None, poison="nan", rope=None,
                 history=None, spare_pages=6):  # fmt: skip
        self.rng, self.hkv, self.dtype, self.quant, self.rope = rng, hkv, dtype, quant, rope
        self.poison = poison
        held = [-(-n // P) for n in lengths]
        self.num_pages = sum(held) + spare_pages
        self.max_pages = max(held) + 1  # a spare column: entries past a row's pages
        perm = rng.permutation(self.num_pages).tolist()
        self.pages = [perm[sum(held[:s]) : sum(held[: s + 1])] for s in range(len(lengths))]
        if history is None:
            history = [
                tuple(rounded(rng.standard_normal((n, h, D)), dtype) for h in (HQ, hkv, hkv))
                for n in lengths
            ]
        self.q_raw, self.k_raw, self.v_raw = (list(x) for x in zip(*history))
        # What an unquantized cache stores: k rotated (then rounded to the cache's dtype).
        self.k_stored = [
            rounded(rope_np(k, np.arange(len(k)), rope), dtype) if rope else k for k in self.k_raw
        ]
        self.cache = self._poisoned_cache()

    def _poisoned_cache(self):
        shape = (self.num_pages, self.hkv, P, D)
        if self.quant is None:
            value = util.poison_value(self.dtype, self.poison)
            return jaxattn.PagedKVCache(*(jnp.full(shape, value, self.dtype) for _ in "kv"))
        scales = {}
        if self.quant.granularity == "tensor":
            scale = TENSOR_RANGE / self.quant.qmax
            scales = dict(k_scale=scale, v_scale=0.75 * scale)
        cache = jaxattn.PagedKVCache.create(
            self.num_pages, P, self.hkv, D, quant=self.quant, **scales
        )
        garbage = util.randn(self.rng, (self.num_pages * P, self.hkv, D), scale=50.0)
        return jax.jit(jaxattn.write_kv, compiler_options=util.FAST_COMPILE)(
            cache, garbage, -garbage, jnp.arange(self.num_pages * P, dtype=jnp.int32)
        )

    # --------------------------------------------------------------- one step
    def plan(self, call, *, max_tokens, max_seqs, decode_only=False) -> Plan:
        """call: rows `(seq or None, prefix, q_len)` in batch order."""
        q_lens = [n for _, _, n in call]
        ctx = [a + n for _, a, n in call]
        tables = [self.pages[s][: -(-c // P)] if c else [] for (s, _, _), c in zip(call, ctx)]
        meta = jaxattn.AttentionMetadata.from_lists(
            q_lens, ctx, tables, P, max_tokens=max_tokens, max_seqs=max_seqs,
            max_pages=self.max_pages, decode_only=decode_only,
        )  # fmt: skip
        positions = np.zeros(max_tokens, np.int64)
        slots = np.full(max_tokens, -1, np.int64)
        owner = np.full(max_tokens, -1, np.int64)
        t = 0
        for (s, a, n), table in zip(call, tables):
            pos = np.arange(a, a + n)
            positions[t : t + n] = pos
            slots[t : t + n] = np.asarray(table, np.int64)[pos // P] * P + pos % P
            owner[t : t + n] = -1 if s is None else s
            t += n
        np.testing.assert_array_equal(np.asarray(meta.positions), positions, "meta.positions")
        np.testing.assert_array_equal(np.asarray(meta.slot_mapping), slots, "meta.slot_mapping")
        poison = util.poison_value(self.dtype, self.poison)
        q = np.full((max_tokens, HQ, D), poison)
        k = np.full((max_tokens, self.hkv, D), poison)
        v = np.full((max_tokens, self.hkv, D), poison)
        for i in range(t):
            s, p = owner[i], positions[i]
            q[i], k[i], v[i] = self.q_raw[s][p], self.k_raw[s][p], self.v_raw[s][p]
        q, k, v = (jnp.asarray(x, self.dtype) for x in (q, k, v))
        return Plan(meta, q, k, v, positions, slots, owner, t)

    def check(self, plan: Plan, result, *, oracle_kw, return_lse=False, what=""):
        """Checks a step's result against the oracle and the cache it started from, then
        makes the returned cache the world's."""
        out, lse, after = unpack(result, return_lse)
        before, self.cache = self.cache, after
        meta, real = plan.meta, plan.owner >= 0
        assert out.shape == plan.q.shape and out.dtype == plan.q.dtype, (out.shape, out.dtype)
        self._check_cache(plan, before, after, what)
        if self.quant is None:
            histories = {int(s): (self.k_stored[s], self.v_raw[s]) for s in plan.owner[real]}
        else:  # the dequantized values the cache holds now, rounded to q's dtype
            k_all, v_all = gather(after, meta.block_tables, meta.context_lens, self.max_pages * P)
            histories = {
                int(s): (rounded(k_all[r], self.dtype), rounded(v_all[r], self.dtype))
                for r, s in enumerate(self._row_owner(plan))
                if s >= 0
            }
        rows = [histories.get(int(s)) for s in self._row_owner(plan)]
        q = np.where(real[:, None, None], util.f64(plan.q), 0.0)
        q = rounded(rope_np(q, plan.positions, self.rope), self.dtype) if self.rope else q
        oracle = functools.partial(
            step_oracle, q, meta.cu_seqlens_q, meta.context_lens, rows, **oracle_kw
        )
        want, want_lse = oracle()
        lowp = None if self.dtype == "float32" else oracle(lowp=jnp.dtype(self.dtype))[0]
        check_out(out, want, self.dtype, lowp, tol=ROPE_TOL if self.rope else None,
                  what=f"{what} out")  # fmt: skip
        util.assert_zero_rows(out, ~real[:, None, None], f"{what} padding tokens")
        if return_lse:
            assert lse.dtype == jnp.float32, lse.dtype
            util.assert_lse_close(np.asarray(lse), want_lse, self.dtype)
        return out

    def _row_owner(self, plan: Plan) -> list[int]:
        """The sequence of each batch row (-1: no tokens), from the plan's token owners."""
        cu = np.asarray(plan.meta.cu_seqlens_q)
        return [int(plan.owner[cu[r]]) if cu[r + 1] > cu[r] else -1 for r in range(len(cu) - 1)]

    def _check_cache(self, plan: Plan, before, after, what):
        written = plan.slots[plan.slots >= 0]
        tokens = np.flatnonzero(plan.slots >= 0)
        others = np.setdiff1d(np.arange(self.num_pages * P), written)
        names = ["k_pages", "v_pages"]
        if self.quant is not None and self.quant.granularity == "group":
            names += ["k_scales", "v_scales"]
        for name in names:
            b, a = (util.bits(slot_rows(getattr(c, name))) for c in (before, after))
            np.testing.assert_array_equal(
                a[others], b[others], f"{what} {name}: a slot the step does not own changed"
            )
        owner, pos = plan.owner[tokens], plan.positions[tokens]
        if self.quant is None:
            want = {
                "k_pages": np.stack([self.k_stored[s][p] for s, p in zip(owner, pos)]),
                "v_pages": np.stack([self.v_raw[s][p] for s, p in zip(owner, pos)]),
            }
            for name, x in want.items():
                got = util.f64(slot_rows(getattr(after, name))[written])
                if self.rope and name == "k_pages":  # rotated by the library, then rounded
                    np.testing.assert_allclose(got, x, **ROTATED_K_TOL[self.dtype], err_msg=name)
                else:
                    np.testing.assert_array_equal(got, x, f"{what} {name}: written values")
            return
        for kind, x, tensor_scale in (
            ("k", plan.k, after.k_scales),
            ("v", plan.v, after.v_scales),
        ):
            tensor = self.quant.granularity == "tensor"
            stored, scales = expected_storage(
                util.f64(x)[tokens], self.quant, np.asarray(tensor_scale) if tensor else None
            )
            got = slot_rows(getattr(after, f"{kind}_pages"))[written]
            assert_codes_equal(got, stored, self.quant, f"{what} {kind}: stored bytes")
            if scales is not None:
                got = slot_rows(getattr(after, f"{kind}_scales"))[written].astype(np.float32)
                np.testing.assert_array_equal(got, scales, f"{what} {kind}: group scales")

    def step(self, call, fn, *, max_tokens, max_seqs, oracle_kw, return_lse=False, what="",
             decode_only=False):  # fmt: skip
        plan = self.plan(call, max_tokens=max_tokens, max_seqs=max_seqs, decode_only=decode_only)
        result = fn(plan.q, plan.k, plan.v, self.cache, plan.meta)
        return plan, self.check(plan, result, oracle_kw=oracle_kw, return_lse=return_lse,
                                what=what)  # fmt: skip


# dequantized: float32
gather = jax.jit(jaxattn.gather_kv, static_argnums=3, compiler_options=util.FAST_COMPILE)


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


# ------------------------------------------------------------------ the mixed batch
@dataclasses.dataclass(frozen=True)
class Row:
    prefix: int  # tokens a first call wrote (as a prompt of its own); 0 = a new prompt
    new: int  # the checked call's new tokens; 1 = generation; (0, 0) = an idle row


MIXED = (
    Row(0, 7),  # context: a prompt of its own, past a page boundary
    Row(8, 5),  # chunked context: a prefix of whole pages, then a chunk
    Row(6, 3),  # chunked context starting mid-page
    Row(9, 1),  # generation
    Row(4, 1),  # generation: the new token opens a page
    Row(0, 1),  # a one-token prompt
    Row(3, 1),  # generation finishing a page
    Row(5, 0),  # a sequence in the batch with nothing new this step
    Row(0, 0),  # an idle row in the middle of the batch
)


def run_two_calls(rows, opts: Opts, impl, dtype, quant=None, seed=0, decode_only=False):
    """The first call writes every prefix (context rows), the second runs `rows` mixed
    (a `decode_only` plan if asked); both in random batch order through one jitted
    function, both checked."""
    rng = util.rng_for("paged", opts.name, str(quant), dtype, seed)
    impl_kw, oracle_kw = opts.kwargs(rng)
    lengths = [r.prefix + r.new for r in rows]
    world = World(rng, lengths, hkv=opts.hkv, dtype=dtype, quant=quant, poison=opts.poison,
                  rope=opts.rope)  # fmt: skip
    first = [(s, 0, r.prefix) for s, r in enumerate(rows) if r.prefix]
    second = [(s if lengths[s] else None, r.prefix, r.new) for s, r in enumerate(rows)]
    calls = [[c[i] for i in rng.permutation(len(c))] for c in (first, second)]
    max_tokens = round_up(max(sum(n for *_, n in c) for c in calls) + 3, 8)
    fn = attention_fn(impl, opts, impl_kw)
    for i, call in enumerate(calls):
        world.step(call, fn, max_tokens=max_tokens, max_seqs=len(rows) + 2,
                   oracle_kw=oracle_kw, return_lse=opts.return_lse, what=f"call {i}",
                   decode_only=decode_only and i == 1)  # fmt: skip
    return world


HEADS = [
    Opts("gqa", hkv=2),
    Opts("mha", hkv=HQ, poison="huge"),
    Opts("mqa", hkv=1),
]


@impls
@dtypes
@pytest.mark.parametrize("opts", HEADS, ids=str)
def test_mixed_batch(opts, dtype, impl):
    run_two_calls(MIXED, opts, impl, dtype)


# A generation-only step, planned as such (`decode_only`: the decode kernel alone).
GENERATION = (Row(9, 1), Row(4, 1), Row(0, 1), Row(3, 1), Row(5, 0), Row(0, 0), Row(7, 1))


@impls
@dtypes
@pytest.mark.parametrize(
    "opts",
    [
        Opts("gqa", hkv=2, return_lse=True),
        Opts("window_sinks_alibi", window=4, sink_tokens=1, alibi=True, poison="huge"),
        # The decode kernel rotates q on load in these plans: partner channels, sign and
        # pass-through channels of both styles, the scalings' frequencies and YaRN's factor.
        Opts(
            "gptj_partial_yarn",
            hkv=2,
            return_lse=True,
            rope=jaxattn.RoPE(
                theta=100.0,
                style="gptj",
                rotary_dim=D // 2,
                scaling=jaxattn.YarnScaling(factor=4.0, original_max_position_embeddings=8),
            ),
        ),
        Opts(
            "mqa_llama3",
            hkv=1,
            rope=jaxattn.RoPE(
                theta=100.0,
                scaling=jaxattn.Llama3Scaling(factor=4.0, original_max_position_embeddings=16),
            ),
        ),
        Opts(
            "splits_softcap_rope",
            hkv=1,
            soft_cap=2.0,
            rope=jaxattn.RoPE(theta=100.0),
            return_lse=True,
            config=jaxattn.PagedAttentionConfig(
                decode=jaxattn.PagedDecodeConfig(block_kv=16, num_splits=3)
            ),
        ),
    ],
    ids=str,
)
def test_decode_only_plan(opts, dtype, impl):
    run_two_calls(GENERATION, opts, impl, dtype, decode_only=True)


def test_decode_only_plan_rejects_context_rows():
    with pytest.raises(ValueError, match="decode_only=True needs q_lens <= 1"):
        jaxattn.AttentionMetadata.from_lists(
            [1, 2], [3, 4], [[0], [1]], P, max_tokens=4, max_seqs=2, max_pages=2,
            decode_only=True,
        )  # fmt: skip
    meta = jaxattn.AttentionMetadata.from_lists(
        [1, 2], [3, 4], [[0], [1]], P, max_tokens=4, max_seqs=2, max_pages=2
    )
    bad = dataclasses.replace(meta, decode_only=True)
    assert bool(meta.check()["ok"]) and not bool(bad.check()["decode_only_rows"])


# ------------------------------------------------------------------------ options
OPTIONS = [
    Opts("window_alibi", window=5, alibi=True, return_lse=True),
    Opts("window_sinks_softcap_scale", window=6, sink_tokens=2, soft_cap=2.0, scale=0.3,
         return_lse=True, poison="huge"),
    Opts("t5_bias", rel=(8, 16, False), return_lse=True),
    Opts("rope_neox_partial", rope=jaxattn.RoPE(style="neox", rotary_dim=16), return_lse=True),
    Opts("rope_gptj_mqa", hkv=1, rope=jaxattn.RoPE(style="gptj", theta=500.0), return_lse=True),
]  # fmt: skip


@impls
@dtypes
@pytest.mark.parametrize("opts", OPTIONS, ids=str)
def test_options(opts, dtype, impl):
    run_two_calls(MIXED, opts, impl, dtype)


# ------------------------------------------------- several tiles, blocks and splits
LONG = (
    Row(0, 21),  # a prompt over two q tiles of 16
    Row(17, 6),  # a prefix over two key blocks of 16, then a chunk
    Row(30, 5),  # a chunk across the key block boundary at 32
    Row(33, 1),  # generation over three key blocks (and three splits)
    Row(16, 1),  # generation opening a key block
    Row(0, 2),
    Row(0, 0),
)
SMALL_TILES = dict(
    prefill=jaxattn.FlashPrefillConfig(block_q=16, block_kv=16, num_warps=4, num_stages=2),
    decode=jaxattn.PagedDecodeConfig(block_kv=16, num_splits=3),
)


@dtypes
@pytest.mark.parametrize(
    "opts", [Opts("tiles_gqa"), Opts("tiles_window_sinks_alibi", hkv=1, window=13,
                                     sink_tokens=3, alibi=True, return_lse=True)], ids=str
)  # fmt: skip
def test_pallas_small_tiles(opts, dtype):
    """With the heuristic configs, the CPU-sized cases fit one q tile and one key block;
    here small explicit tiles split rows, cached prefixes and the decode context."""
    rng = util.rng_for("tiles", opts.name, dtype)
    impl_kw, oracle_kw = opts.kwargs(rng)
    config = jaxattn.PagedAttentionConfig(**SMALL_TILES)
    lengths = [r.prefix + r.new for r in LONG]
    world = World(rng, lengths, hkv=opts.hkv, dtype=dtype)
    first = [(s, 0, r.prefix) for s, r in enumerate(LONG) if r.prefix]
    second = [(s if lengths[s] else None, r.prefix, r.new) for s, r in enumerate(LONG)]
    fn = jax.jit(
        functools.partial(jaxattn.paged_attention, implementation="pallas", config=config,
                          return_lse=opts.return_lse, **impl_kw),
        compiler_options=util.FAST_COMPILE,
    )  # fmt: skip
    for i, call in enumerate((first[:2], first[2:], second)):  # prefixes: 47 + 49 tokens
        call = [call[j] for j in rng.permutation(len(call))]
        world.step(call, fn, max_tokens=56, max_seqs=len(LONG) + 1, oracle_kw=oracle_kw,
                   return_lse=opts.return_lse, what=f"call {i}")  # fmt: skip


# ------------------------------------------------------------------ quantized caches
QUANTS = [
    jaxattn.KVQuant(dtype, granularity, group_size)
    for dtype, granularity, group_size in (
        ("int8", "tensor", None),
        ("int8", "group", 8),
        ("float8_e4m3fn", "tensor", None),
        ("float8_e4m3fn", "group", None),
        ("int4", "tensor", None),
        ("int4", "group", 16),
    )
]


def qid(quant) -> str:
    return f"{quant.dtype}-{quant.granularity}{quant.group_size or ''}"


@impls
@dtypes
@pytest.mark.parametrize("quant", QUANTS, ids=qid)
def test_quantized_cache(quant, dtype, impl):
    """The oracle attends over what the cache stores (read back with gather_kv, rounded to
    q's dtype); the stored bytes and group scales are the quant oracle's."""
    run_two_calls(MIXED, Opts("quant", hkv=2), impl, dtype, quant=quant)


def test_decode_tiling_is_told_the_query_group(monkeypatch):
    """The decode kernel's heuristic is told the query heads a kv head serves (it decides
    stacked rows, `PagedDecodeConfig.stacked`)."""
    import jaxattn.paged as paged

    seen = []
    real = paged.default_decode_config

    def spy(cache, batch, max_context, query_group=0, rope_on_read=False):
        seen.append(query_group)
        return real(cache, batch, max_context, query_group, rope_on_read)

    monkeypatch.setattr(paged, "default_decode_config", spy)
    run_two_calls((Row(3, 1), Row(0, 2)), Opts("gqa", hkv=2), "pallas", "float32")
    assert seen and set(seen) == {HQ // 2}


@dtypes
def test_quantized_decode_only_rotates_q_on_load(dtype):
    """INT4 splits channels in two parts, and a neox partner lies in the other half: the
    kernel reads it from q itself, so each part rotates whole. The kernel (q rotated on
    load) against the reference (q rotated by apply_rope) on the same INT4 cache, pages
    scattered, an idle row and padding tokens; the written caches bit for bit."""
    rng = util.rng_for("int4_rope_on_load", dtype)
    hkv, num_pages = 2, 12
    quant = jaxattn.KVQuant("int4", "group", 16)
    cache = jaxattn.PagedKVCache.create(num_pages, P, hkv, D, quant=quant)
    history = util.randn(rng, (num_pages * P, hkv, D), dtype)
    cache = jaxattn.write_kv(cache, history, history[::-1], jnp.arange(num_pages * P))
    pages = rng.permutation(num_pages).reshape(3, 4).tolist()
    meta = jaxattn.AttentionMetadata.from_lists(  # row 2 idle; lengths after the step
        [1, 1, 0, 1], [9, 16, 5, 3], [pages[0], pages[1], [], pages[2]],
        P, max_tokens=5, max_seqs=5, max_pages=4, decode_only=True,
    )  # fmt: skip
    q = util.randn(rng, (5, HQ, D), dtype)
    k, v = (util.randn(rng, (5, hkv, D), dtype) for _ in range(2))
    rope = jaxattn.RoPE(theta=100.0, scaling=jaxattn.YarnScaling(4.0, 8))
    run = {
        impl: jax.jit(functools.partial(jaxattn.paged_attention, rope=rope, return_lse=True,
                                        implementation=impl),
                compiler_options=util.FAST_COMPILE)(q, k, v, cache, meta)
        for impl in ("xla", "pallas")
    }  # fmt: skip
    (want, want_lse), want_cache = run["xla"]
    (got, got_lse), got_cache = run["pallas"]
    real = np.arange(5) < 3
    np.testing.assert_allclose(util.f64(got)[real], util.f64(want)[real], **SAME_TOL[dtype])
    np.testing.assert_allclose(np.asarray(got_lse)[:, real], np.asarray(want_lse)[:, real],
                               **SAME_TOL[dtype])  # fmt: skip
    util.assert_zero_rows(got, ~real[:, None, None], "padding tokens")
    for name in ("k_pages", "v_pages", "k_scales", "v_scales"):
        np.testing.assert_array_equal(
            util.bits(getattr(got_cache, name)), util.bits(getattr(want_cache, name))
        )


# --------------------------------------------------------------- paged_attention_qkv
@impls
@dtypes
@pytest.mark.parametrize("decode_only", [False, True], ids=["mixed", "decode_only"])
def test_qkv_equals_split(dtype, impl, decode_only):
    """The fused projection gives the split call's results; a decode-only plan's kernel
    reads it in place (q, k and v at their head offsets; k rotated on load)."""
    rope = jaxattn.RoPE(theta=100.0, style="gptj") if decode_only else None
    opts = Opts("qkv", hkv=2, window=7, alibi=True, rope=rope)
    rng = util.rng_for("qkv", dtype, decode_only)
    impl_kw, oracle_kw = opts.kwargs(rng)
    rows = GENERATION if decode_only else MIXED
    world = World(rng, [r.prefix + r.new for r in rows], hkv=2, dtype=dtype, rope=rope)
    sizes = dict(max_tokens=40, max_seqs=len(rows) + 1)
    split = attention_fn(impl, opts, impl_kw)
    world.step([(s, 0, r.prefix) for s, r in enumerate(rows) if r.prefix], split,
               oracle_kw=oracle_kw, **sizes)  # fmt: skip
    call = [(s if r.prefix + r.new else None, r.prefix, r.new) for s, r in enumerate(rows)]
    plan = world.plan([call[i] for i in rng.permutation(len(call))], decode_only=decode_only,
                      **sizes)  # fmt: skip
    fused = jax.jit(
        functools.partial(jaxattn.paged_attention_qkv, num_q_heads=HQ, num_kv_heads=2,
                          implementation=impl, config=None, **impl_kw),
        compiler_options=util.FAST_COMPILE,
    )  # fmt: skip
    t = plan.q.shape[0]
    qkv = jnp.concatenate([x.reshape(t, -1) for x in (plan.q, plan.k, plan.v)], axis=1)
    assert qkv.shape == (t, (HQ + 2 * 2) * D)
    out_fused, cache_fused = fused(qkv, world.cache, plan.meta)
    out_split, cache_split = split(plan.q, plan.k, plan.v, world.cache, plan.meta)
    np.testing.assert_allclose(util.f64(out_fused), util.f64(out_split), **SAME_TOL[dtype])
    for name in ("k_pages", "v_pages"):
        np.testing.assert_array_equal(
            util.bits(getattr(cache_fused, name)), util.bits(getattr(cache_split, name)), name
        )
    world.check(plan, (out_fused, cache_fused), oracle_kw=oracle_kw, what="qkv")


# ------------------------------------------------------- chunked equals unchunked
PROMPTS = (19, 13)
GENERATE = 3
# (seq, start, q_len) per call. Chunks are whole pages except a prompt's last one.
UNCHUNKED = [[(0, 0, 19), (1, 0, 13)]]
CHUNKED = [
    [(0, 0, 8), (1, 0, 4)],
    [(1, 4, 8), (0, 8, 4)],
    [(0, 12, 7), (1, 12, 1)],
]


@impls
@dtypes
@pytest.mark.parametrize(
    "quant", [None, jaxattn.KVQuant("int8", "group")], ids=lambda q: q and qid(q) or "plain"
)
def test_chunked_equals_unchunked(quant, dtype, impl):
    """A prompt in one step or in chunks over several, then generation: same outputs, same
    cache contents (pages placed differently). Every step is also checked on its own."""
    rng = util.rng_for("chunked", str(quant), dtype)
    lengths = [n + GENERATE for n in PROMPTS]
    history = [
        tuple(rounded(rng.standard_normal((n, h, D)), dtype) for h in (HQ, 2, 2)) for n in lengths
    ]
    gen = [[(s, n + i, 1) for s, n in enumerate(PROMPTS)][:: (-1) ** i] for i in range(GENERATE)]
    opts = Opts("chunked", window=11, sink_tokens=1)
    impl_kw, oracle_kw = opts.kwargs(rng)
    fn = attention_fn(impl, opts, impl_kw)
    outputs, caches = [], []
    for calls in (UNCHUNKED + gen, CHUNKED + gen):
        world = World(rng, lengths, hkv=2, dtype=dtype, quant=quant, history=history)
        got = {}
        for i, call in enumerate(calls):
            plan, out = world.step(call, fn, max_tokens=36, max_seqs=3, oracle_kw=oracle_kw,
                                   what=f"call {i}")  # fmt: skip
            for t in range(plan.num_real):
                got[plan.owner[t], plan.positions[t]] = util.f64(out[t])
        assert sorted(got) == [(s, p) for s in range(2) for p in range(lengths[s])]
        outputs.append(np.stack([got[key] for key in sorted(got)]))
        tables = jnp.asarray([w + [-1] * (world.max_pages - len(w)) for w in world.pages])
        caches.append(gather(world.cache, tables, jnp.asarray(lengths), world.max_pages * P))
    np.testing.assert_allclose(outputs[1], outputs[0], **SAME_TOL[dtype])
    for name, one, chunked in zip("kv", caches[0], caches[1]):
        np.testing.assert_array_equal(np.asarray(chunked), np.asarray(one), f"cache {name}")


# -------------------------------------------------------------- AttentionMetadata
META_FIELDS = ("cu_seqlens_q", "context_lens", "block_tables", "positions", "slot_mapping")


def test_metadata_worked_example():
    """P = 4. Row 0: a 3-token prompt in page 5. Row 1: the 6th token of a sequence in
    pages [2, 7]. Row 2: a chunk of 4 after a 5-token prefix, pages [0, 3, 1]. T = 10."""
    meta = jaxattn.AttentionMetadata.from_lists(
        [3, 1, 4], [3, 6, 9], [[5], [2, 7], [0, 3, 1]], 4, max_tokens=10, max_seqs=4,
        max_pages=3,
    )  # fmt: skip
    assert np.asarray(meta.cu_seqlens_q).tolist() == [0, 3, 4, 8, 8]
    assert np.asarray(meta.context_lens).tolist() == [3, 6, 9, 0]
    assert np.asarray(meta.block_tables).tolist() == [
        [5, -1, -1], [2, 7, -1], [0, 3, 1], [-1, -1, -1]
    ]  # fmt: skip
    # Row 0: positions 0..2 in page 5 (slots 20..22). Row 1: position 5 = page 7, offset 1
    # (slot 29). Row 2: positions 5..7 in page 3 (slots 13..15), 8 in page 1 (slot 4).
    assert np.asarray(meta.positions).tolist() == [0, 1, 2, 5, 5, 6, 7, 8, 0, 0]
    assert np.asarray(meta.slot_mapping).tolist() == [20, 21, 22, 29, 13, 14, 15, 4, -1, -1]
    assert np.asarray(meta.seq_ids).tolist() == [0, 1, 2, -1]
    assert int(meta.num_context) == 2 and int(meta.num_generation) == 1
    for name in META_FIELDS + ("seq_ids",):
        assert getattr(meta, name).dtype == jnp.int32, name
    assert len(jax.tree.leaves(meta)) >= len(META_FIELDS) + 1


def test_metadata_docstring_example():
    """The module docstring's example: 8 cached tokens + a 4-token chunk, and a 6th token."""
    meta = jaxattn.AttentionMetadata.from_lists(
        [4, 1], [12, 6], [[9, 4, 6], [1, 8]], 4, max_tokens=8, max_seqs=3, max_pages=3
    )
    assert np.asarray(meta.cu_seqlens_q).tolist() == [0, 4, 5, 5]
    assert np.asarray(meta.positions).tolist() == [8, 9, 10, 11, 5, 0, 0, 0]
    assert np.asarray(meta.slot_mapping).tolist() == [24, 25, 26, 27, 33, -1, -1, -1]


@pytest.mark.parametrize("seed", range(3))
def test_build_equals_from_lists(seed):
    """After `mgr.reserve`, `build` (jitted) and `from_lists` on the manager's own rows give
    the same plan; build's slots are the manager's `slot_mapping` of the new tokens."""
    rng = util.rng_for("build", seed)
    n_pages, rows, m_pages, max_tokens, max_seqs = 40, 6, 5, 24, 5
    mgr = jaxattn.KVCacheManager.create(n_pages, P, rows, m_pages)
    reserve = jax.jit(jaxattn.KVCacheManager.reserve)
    lengths = rng.integers(1, m_pages * P - 8, size=rows)  # scattered pages: grow in turns
    for stop in (3, 7, None):
        mgr, ok = reserve(mgr, jnp.arange(rows), jnp.asarray(np.minimum(lengths, stop or 99)))
        assert bool(ok)
    # This step: a few rows (random order, padding ids in between) grow by their q_len.
    chosen = rng.choice(rows, size=4, replace=False)
    q_lens = np.array([int(rng.integers(1, 8)) if i % 2 else 1 for i in range(4)])
    seq_ids = np.insert(chosen, 2, -1)  # a padding row in the middle
    q_lens = np.insert(q_lens, 2, 3)  # ignored: the row is padding
    before = np.asarray(mgr.lengths)[np.maximum(seq_ids, 0)]
    new_lengths = np.where(seq_ids >= 0, before + q_lens, 0)
    mgr, ok = reserve(mgr, jnp.asarray(seq_ids), jnp.asarray(new_lengths))
    assert bool(ok)
    build = jax.jit(jaxattn.AttentionMetadata.build, static_argnums=3)
    got = build(mgr, jnp.asarray(seq_ids, jnp.int32), jnp.asarray(q_lens, jnp.int32), max_tokens)
    live = seq_ids >= 0
    tables = np.asarray(mgr.block_tables)
    want = jaxattn.AttentionMetadata.from_lists(
        np.where(live, q_lens, 0).tolist(), new_lengths.tolist(),
        [tables[s][tables[s] >= 0].tolist() if s >= 0 else [] for s in seq_ids], P,
        max_tokens=max_tokens, max_seqs=max_seqs, max_pages=m_pages,
    )  # fmt: skip
    for name in META_FIELDS:
        np.testing.assert_array_equal(np.asarray(getattr(got, name)),
                                      np.asarray(getattr(want, name)), name)  # fmt: skip
    assert np.asarray(got.seq_ids).tolist() == seq_ids.tolist()
    assert int(got.num_context) == int(want.num_context) == int(np.sum(q_lens[live] > 1))
    assert int(got.num_generation) == int(np.sum(q_lens[live] == 1))
    # The new tokens' slots are the manager's, token by token.
    cu = np.asarray(got.cu_seqlens_q)
    tok_seq = np.full(max_tokens, -1)
    for r, s in enumerate(seq_ids):
        tok_seq[cu[r] : cu[r + 1]] = s
    slots = jax.jit(jaxattn.KVCacheManager.slot_mapping)(
        mgr, jnp.asarray(tok_seq, jnp.int32), got.positions
    )
    np.testing.assert_array_equal(np.asarray(got.slot_mapping), np.asarray(slots))


@impls
def test_build_keeps_the_callers_packing_for_rows_it_cannot_place(impl):
    """Rows the manager cannot place keep their tokens: a row with an id past max_seqs, and
    one with more new tokens than it reserved. Their tokens write only into their own pages
    (nothing without a slot), those that see no key output zeros, the valid row behind
    them keeps its own tokens (numpy oracle over its keys), and check() reports the plan."""
    rng = util.rng_for("unplaced", impl)
    mgr = jaxattn.KVCacheManager.create(8, P, 3, 3)
    mgr, ok = mgr.reserve(jnp.array([0, 1]), jnp.array([2, 6]))  # row 0 asks for 3 below
    assert bool(ok)
    cache = jaxattn.PagedKVCache.create(8, P, 1, D, jnp.float32)
    k_hist, v_hist = (rng.standard_normal((5, 1, D)).astype(np.float32) for _ in range(2))
    slots = mgr.slot_mapping(jnp.full(5, 1), jnp.arange(5))  # seq 1's first 5 tokens
    cache = jaxattn.write_kv(cache, jnp.asarray(k_hist), jnp.asarray(v_hist), slots)
    # Rows: seq 0 with 3 tokens (2 reserved), seq 7 (max_seqs 3) with 2, seq 1 with 1.
    meta = jaxattn.AttentionMetadata.build(mgr, jnp.array([0, 7, 1]), jnp.array([3, 2, 1]), 8)
    assert np.asarray(meta.cu_seqlens_q).tolist() == [0, 3, 5, 6]
    assert np.asarray(meta.positions).tolist()[:6] == [-1, 0, 1, -2, -1, 5]
    checks = meta.check()
    assert not bool(checks["q_within_context"]) and not bool(checks["ok"])
    q = rng.standard_normal((8, 1, D)).astype(np.float32)
    k, v = (rng.standard_normal((8, 1, D)).astype(np.float32) for _ in range(2))
    attend = jax.jit(functools.partial(jaxattn.paged_attention, implementation=impl),
                     compiler_options=util.FAST_COMPILE)  # fmt: skip
    out, new = attend(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), cache, meta)
    out = util.f64(out)
    assert np.all(np.isfinite(out))
    np.testing.assert_array_equal(out[[0, 3, 4]], 0.0)  # position -1; no pages at all
    keys = np.concatenate([k_hist[:, 0], k[5:6, 0]]).astype(np.float64)
    values = np.concatenate([v_hist[:, 0], v[5:6, 0]]).astype(np.float64)
    logits = keys @ q[5, 0].astype(np.float64) / np.sqrt(D)
    weights = np.exp(logits - logits.max())
    np.testing.assert_allclose(out[5, 0], weights @ values / weights.sum(), atol=1e-4, rtol=1e-4)
    # The cache changes at the plan's slots only, each in its own row's pages.
    written = np.asarray(meta.slot_mapping)
    assert written.tolist()[:6] == [-1, 0, 1, -1, -1, int(slots[-1]) + 1]
    tables = np.asarray(meta.block_tables)
    for t, row in ((1, 0), (2, 0), (5, 2)):
        assert written[t] // P in tables[row]
    before, after = (np.asarray(c.k_pages)[:, 0].reshape(-1, D) for c in (cache, new))
    untouched = np.setdiff1d(np.arange(before.shape[0]), written[written >= 0])
    np.testing.assert_array_equal(after[untouched], before[untouched])


def test_check_flags_a_sequence_in_two_rows():
    mgr = jaxattn.KVCacheManager.create(8, P, 3, 3)
    mgr, _ = mgr.reserve(jnp.array([0, 2]), jnp.array([6, 3]))
    meta = jaxattn.AttentionMetadata.build(mgr, jnp.array([0, 0, -1]), jnp.array([1, 1, 0]), 4)
    assert not bool(meta.check()["distinct_rows"]) and not bool(meta.check()["ok"])
    meta = jaxattn.AttentionMetadata.build(mgr, jnp.array([0, 2, -1]), jnp.array([1, 1, 0]), 4)
    assert bool(meta.check()["ok"])


def test_check_flags_an_overfull_step():
    """Rows of 8 and 4 new tokens in a bucket of 8: row 1 is cut off whole (no token left
    to show it) and `check()` says so (`tokens_fit`); it had passed."""
    mgr = jaxattn.KVCacheManager.create(8, P, 3, 3)
    mgr, _ = mgr.reserve(jnp.array([0, 1]), jnp.array([8, 4]))
    meta = jaxattn.AttentionMetadata.build(mgr, jnp.array([0, 1, -1]), jnp.array([8, 4, 0]), 8)
    assert int(meta.asked_tokens) == 12 and meta.q_lens.tolist() == [8, 0, 0]
    assert not bool(meta.check()["tokens_fit"]) and not bool(meta.check()["ok"])
    meta = jaxattn.AttentionMetadata.build(mgr, jnp.array([0, 1, -1]), jnp.array([4, 4, 0]), 8)
    assert bool(meta.check()["ok"])


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_an_overfull_step_keeps_the_first_tokens_of_the_row_it_cuts(impl):
    """A row of 9 new tokens (after 3 cached) in a bucket of 8 keeps its first 8: their
    keys are written at positions 3..10 and their queries attend as a step of those 8 does
    (a sequence of 11). Before, the kernels aligned the 8 queries to the row's 12 reserved
    keys (positions 4..11, the last key never written), and the backends disagreed."""
    rng = np.random.default_rng(0)
    cache = jaxattn.PagedKVCache.create(8, P, 1, D, dtype=F32)
    cache = jaxattn.PagedKVCache(*(jnp.asarray(rng.standard_normal(x.shape), F32)
                                   for x in (cache.k_pages, cache.v_pages)))  # fmt: skip
    q, k, v = (jnp.asarray(rng.standard_normal((8, h, D)), F32) for h in (HQ, 1, 1))
    base = jaxattn.KVCacheManager.create(8, P, 2, 4)
    base, _ = base.reserve(jnp.arange(2), jnp.array([3, 5]))
    cut, _ = base.reserve(jnp.arange(2), jnp.array([12, 6]))  # 9 and 1 new tokens
    meta = jaxattn.AttentionMetadata.build(cut, jnp.arange(2), jnp.array([9, 1]), 8)
    assert not bool(meta.check()["tokens_fit"]) and meta.q_lens.tolist() == [8, 0]
    fit, _ = base.reserve(jnp.arange(2), jnp.array([11, 5]))  # the 8 tokens that fit
    want = jaxattn.AttentionMetadata.build(fit, jnp.arange(2), jnp.array([8, 0]), 8)
    np.testing.assert_array_equal(meta.positions, want.positions)
    np.testing.assert_array_equal(meta.slot_mapping, want.slot_mapping)
    out, new = jaxattn.paged_attention(q, k, v, cache, meta, implementation=impl)
    ref, ref_cache = jaxattn.paged_attention(q, k, v, cache, want, implementation="xla")
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(new.k_pages, ref_cache.k_pages)


def test_build_rejects_negative_q_lens_given_on_the_host():
    """A live row's negative q_len given on the host raises, naming the row; a padding
    row's is ignored; traced, it counts as 0 (no tokens), as documented."""
    mgr = jaxattn.KVCacheManager.create(8, P, 3, 3)
    mgr, _ = mgr.reserve(jnp.array([0, 1]), jnp.array([4, 4]))
    build = jaxattn.AttentionMetadata.build
    with pytest.raises(ValueError, match=r"q_lens must be >= 0.*rows \[1\]"):
        build(mgr, np.array([0, 1, -1]), np.array([1, -2, 0]), 8)
    meta = build(mgr, [0, 1, -1], [1, 1, -5], 8)  # padding row: ignored
    assert meta.q_lens.tolist() == [1, 1, 0]
    traced = jax.jit(build, static_argnums=3)(mgr, jnp.array([0, 1]), jnp.array([1, -2]), 8)
    assert traced.q_lens.tolist() == [1, 0]


def test_plan_of_another_page_size_is_rejected():
    """A plan's slots are pages of its manager's size; a cache of another size would take
    them for other pages (other sequences')."""
    mgr = jaxattn.KVCacheManager.create(4, P, 2, 2)
    mgr, _ = mgr.reserve(jnp.array([0, 1]), jnp.array([P, 1]))
    meta = jaxattn.AttentionMetadata.build(mgr, jnp.array([0, 1]), jnp.array([P, 1]), 8)
    assert meta.page_size == P
    cache = jaxattn.PagedKVCache.create(4, 2 * P, 1, D, jnp.float32)
    x = jnp.ones((8, 1, D), jnp.float32)
    with pytest.raises(ValueError, match="page_size"):
        jaxattn.paged_attention(x, x, x, cache, meta, implementation="xla")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(q_lens=[5, 6], context_lens=[5, 6], block_tables=[[0, 1], [2, 3]]), "max_tokens"),
        (dict(q_lens=[1] * 4, context_lens=[1] * 4, block_tables=[[0], [1], [2], [3]]),
         "max_seqs"),
        (dict(q_lens=[1], context_lens=[13], block_tables=[[0, 1, 2, 3]]), "max_pages"),
        # two rows writing their new token into one slot of a page both list
        (dict(q_lens=[1, 1], context_lens=[2, 2], block_tables=[[0], [0]]), "one cache slot"),
        # pages the prefix is stored in, not only those the new tokens write: a -1 entry (it
        # had been read as page 0)
        (dict(q_lens=[1], context_lens=[2 * P + 1], block_tables=[[-1, -1, 2]]),
         r"block_tables\[0\] does not hold positions up to 8"),
    ],
)  # fmt: skip
@pytest.mark.every_case
def test_from_lists_overflow_names_the_bucket(kwargs, match):
    with pytest.raises(ValueError, match=match):
        jaxattn.AttentionMetadata.from_lists(
            page_size=P, max_tokens=10, max_seqs=3, max_pages=3, **kwargs
        )


# ------------------------------------------------------------- serving simulation
@dataclasses.dataclass
class Request:
    row: int  # manager row
    prompt: int
    total: int  # prompt + tokens to generate
    hist: tuple  # q, k, v float64 [total, H, D]
    done: int = 0  # tokens through attention (and in the cache)


@pytest.mark.slow
@impls
def test_serving_simulation(impl):
    """200 steps of in-flight batching through ONE jitted step (release, reserve, build,
    paged_attention): random arrivals, prompt lengths, chunk sizes (whole pages but a
    prompt's last chunk) under a token budget, random finishes. Every step is checked
    against the oracle; one trace in all; no page leaks at the end."""
    rng = util.rng_for("serving", impl)
    dtype, hkv = util.CASE_DTYPES[0], 2
    n_pages, n_rows, m_pages, max_tokens, max_seqs, steps = 20, 6, 6, 16, 4, 200
    capacity = m_pages * P
    traces = []

    @functools.partial(jax.jit, compiler_options=util.FAST_COMPILE)
    def step(mgr, cache, release_ids, seq_ids, lengths, q_lens, q, k, v):
        traces.append(1)
        mgr = mgr.release(release_ids)
        mgr, ok = mgr.reserve(seq_ids, lengths)
        meta = jaxattn.AttentionMetadata.build(mgr, seq_ids, q_lens, max_tokens)
        out, cache = jaxattn.paged_attention(q, k, v, cache, meta, implementation=impl,
                                             config=None)  # fmt: skip
        return mgr, cache, out, ok, meta.cu_seqlens_q

    mgr = jaxattn.KVCacheManager.create(n_pages, P, n_rows, m_pages)
    cache = jaxattn.PagedKVCache.create(n_pages, P, hkv, D, dtype=dtype)
    nan = util.poison_value(dtype, "nan")
    cache = jaxattn.PagedKVCache(*(jnp.full_like(x, nan) for x in (cache.k_pages, cache.v_pages)))
    active: list[Request] = []
    held = {}  # row -> pages held (the Python model of the pool)
    stats = dict(tokens=0, context_rows=0, generation_rows=0, finished=0)
    for i in range(steps):
        # Finish: whoever is through, and at random among those generating.
        gone = [r for r in active if r.done == r.total or (r.done > r.prompt and
                                                            rng.random() < 0.08)]  # fmt: skip
        for r in gone:
            active.remove(r)
            held.pop(r.row)
        stats["finished"] += len(gone)
        # Arrivals, admitted when the pool can hold every admitted request to its end (so
        # the scheduler never deadlocks; reserve then never fails).
        free_rows = sorted(set(range(n_rows)) - {r.row for r in active})
        if free_rows and rng.random() < 0.35:
            prompt = int(rng.integers(1, 21))
            total = min(capacity, prompt + int(rng.integers(1, 10)))
            if sum(-(-r.total // P) for r in active) + -(-total // P) <= n_pages:
                hist = tuple(
                    rounded(rng.standard_normal((total, h, D)), dtype) for h in (HQ, hkv, hkv)
                )
                active.append(Request(free_rows[0], prompt, total, hist))
        # Schedule under the token budget and the free pages.
        budget, free_pages, batch = max_tokens, n_pages - sum(held.values()), []
        for j in rng.permutation(len(active)):
            r = active[j]
            if len(batch) == max_seqs or budget == 0 or r.done == r.total:
                continue
            if r.done < r.prompt:
                remaining, chunk = r.prompt - r.done, P * int(rng.integers(1, 4))
                chunk = min(chunk, budget // P * P)
                n = remaining if remaining <= min(chunk or budget, budget) else chunk
            else:
                n = 1
            need = -(-(r.done + n) // P) - -(-r.done // P)
            if n == 0 or need > free_pages:
                continue
            budget, free_pages = budget - n, free_pages - need
            held[r.row] = held.get(r.row, 0) + need
            batch.append((r, n))
        rows = batch + [None] * (max_seqs - len(batch))
        rows = [rows[j] for j in rng.permutation(max_seqs)]
        seq_ids = [-1 if x is None else x[0].row for x in rows]
        q_lens = [0 if x is None else x[1] for x in rows]
        lengths = [0 if x is None else x[0].done + x[1] for x in rows]
        q = np.full((max_tokens, HQ, D), nan)
        k, v = (np.full((max_tokens, hkv, D), nan) for _ in "kv")
        t = 0
        for x in rows:
            if x is not None:
                r, n = x
                q[t : t + n], k[t : t + n], v[t : t + n] = (h[r.done : r.done + n] for h in r.hist)
                t += n
        release = [r.row for r in gone] + [-1] * (n_rows - len(gone))
        mgr, cache, out, ok, cu = step(
            mgr, cache, *(jnp.asarray(x, jnp.int32) for x in (release, seq_ids, lengths, q_lens)),
            *(jnp.asarray(x, dtype) for x in (q, k, v)),
        )  # fmt: skip
        assert bool(ok), f"step {i}: reserve failed; the scheduler's model is off"
        want = np.zeros((max_tokens, HQ, D))
        lowp = None if dtype == "float32" else np.zeros_like(want)
        t = 0
        for x in rows:
            if x is not None:
                r, n = x
                ctx = r.done + n
                oracle = functools.partial(
                    step_oracle, r.hist[0][r.done : ctx], [0, n], [ctx], [r.hist[1:]]
                )
                want[t : t + n] = oracle()[0]
                if lowp is not None:
                    lowp[t : t + n] = oracle(lowp=jnp.dtype(dtype))[0]
                t += n
                r.done = ctx
                stats["tokens"] += n
                stats["context_rows" if n > 1 else "generation_rows"] += 1
        assert np.asarray(cu)[-1] == t, f"step {i}: {np.asarray(cu)} for {t} tokens"
        if t:
            lowp_ref = None if lowp is None else lowp[:t]
            util.assert_out_close(out[:t], want[:t], dtype, lowp_ref=lowp_ref, what=f"step {i}")
        util.assert_zero_rows(out[t:], True, f"step {i} padding tokens")
    # Everyone leaves: the same step with an empty batch.
    release = [r.row for r in active] + [-1] * (n_rows - len(active))
    empty = [-1] * max_seqs
    mgr, cache, out, ok, _ = step(
        mgr, cache, *(jnp.asarray(x, jnp.int32) for x in (release, empty, [0] * max_seqs,
                                                           [0] * max_seqs)),
        *(jnp.full((max_tokens, h, D), nan, dtype) for h in (HQ, hkv, hkv)),
    )  # fmt: skip
    assert bool(ok)
    util.assert_zero_rows(out, True, "empty step")
    assert len(traces) == 1, f"{len(traces)} traces: the step must compile once per bucket"
    assert int(mgr.num_free_pages) == n_pages, "pages leaked"
    assert all(bool(x) for x in jax.jit(jaxattn.KVCacheManager.check)(mgr).values())
    # The simulation exercised what it is meant to.
    assert stats["context_rows"] > 20 and stats["generation_rows"] > 100, stats
    assert stats["finished"] > 10, stats


# ------------------------------------------------------------------------ bad input
SDS = jax.ShapeDtypeStruct
F32 = jnp.float32
BAD_META = dict(q_lens=[3, 1], context_lens=[3, 5], block_tables=[[0], [1, 2]], page_size=P)


def _bad_call(q=(8, HQ), k=(8, 2), quant=None, cache_dtype=F32, scales=None, **options):
    """eval_shape of paged_attention on T = 8 tokens; shapes `(T, heads)` of q and k/v."""
    cache = jaxattn.PagedKVCache.create(8, P, 2, D, dtype=cache_dtype, quant=quant)
    if scales is not None:
        cache = dataclasses.replace(cache, k_scales=scales)
    meta = jaxattn.AttentionMetadata.from_lists(**BAD_META, max_tokens=8, max_seqs=2, max_pages=2)
    q, k = SDS((*q, D), F32), SDS((*k, D), F32)
    call = functools.partial(jaxattn.paged_attention, implementation="xla", **options)
    return lambda: jax.eval_shape(call, q, k, k, cache, meta)


def _bad_qkv(width=(HQ + 4) * D - 1, num_kv_heads=2, fused_heads=None):
    """paged_attention_qkv on a `[8, width]` projection; or, with `fused_heads`, the fused
    form `paged_attention(qkv[8, fused_heads, D], None, None, ...)`."""
    cache = jaxattn.PagedKVCache.create(8, P, 2, D, dtype=F32)
    meta = jaxattn.AttentionMetadata.from_lists(**BAD_META, max_tokens=8, max_seqs=2, max_pages=2)
    if fused_heads is not None:
        call = functools.partial(jaxattn.paged_attention, implementation="xla")
        return lambda: jax.eval_shape(call, SDS((8, fused_heads, D), F32), None, None, cache, meta)
    call = functools.partial(jaxattn.paged_attention_qkv, num_q_heads=HQ, num_kv_heads=num_kv_heads)
    return lambda: jax.eval_shape(call, SDS((8, width), F32), cache, meta)


GROUP, TENSOR = jaxattn.KVQuant("int8", "group"), jaxattn.KVQuant("int8")
BAD = {
    "q tokens != meta tokens": (
        lambda: _bad_call(q=(7, HQ), k=(7, 2)),
        rf"meta\.positions.*q\.shape=\(7, {HQ}, {D}\)",
    ),
    "k tokens != q tokens": (lambda: _bad_call(k=(7, 2)), rf"k\.shape=\(7, 2, {D}\)"),
    "k heads != cache heads": (lambda: _bad_call(q=(8, 2), k=(8, 1)), rf"k\.shape=\(8, 1, {D}\)"),
    "q dtype != cache dtype": (lambda: _bad_call(cache_dtype=jnp.bfloat16), r"dtype"),
    "rotary_dim odd": (lambda: _bad_call(rope=jaxattn.RoPE(rotary_dim=7)), "rotary_dim=7"),
    "rotary_dim > head_dim": (
        lambda: _bad_call(rope=jaxattn.RoPE(rotary_dim=2 * D)),
        f"rotary_dim={2 * D}",
    ),
    "group scales shape": (
        lambda: _bad_call(quant=GROUP, scales=jnp.ones((8, 2, P, 2), jnp.bfloat16)),
        "k_scales",
    ),
    "tensor scales shape": (
        lambda: _bad_call(quant=TENSOR, scales=jnp.ones((2,), F32)),
        "k_scales",
    ),
    "qkv width": (_bad_qkv, rf"qkv\.shape=\(8, {(HQ + 4) * D - 1}\)"),
    "qkv kv heads != cache heads": (
        lambda: _bad_qkv(width=(HQ + 2) * D, num_kv_heads=1),
        "num_kv_heads=1 but the cache has 2",
    ),
    "fused form: too few heads": (lambda: _bad_qkv(fused_heads=4), r"qkv\.shape=\(8, 4,"),
    "fused form: q heads not a multiple": (lambda: _bad_qkv(fused_heads=7), r"Hq a multiple of it"),
}


@pytest.mark.parametrize("name", BAD)
@pytest.mark.every_case
def test_bad_input_raises_naming_the_argument(name):
    """Clear ValueErrors at trace time (or when building the config), naming the argument."""
    make, match = BAD[name]
    with pytest.raises(ValueError, match=match):
        make()()


# ------------------------------------------------------------------ history gather
# Chunks of at least 4 new tokens over a prefix are gathered while their histories fit in
# 64 rows (in batch order); the others keep the paged loop. The batch order is random, so
# which rows fit varies with the seed; every row is checked either way. The seeds: in each
# case two rows are gathered and one kept on the paged loop, and each of the three rows
# is gathered in one case ({12, 25}, then {46, 12}).
GATHERED = (
    Row(40, 6),  # a history of 46
    Row(20, 5),  # 25: both fit only without each other
    Row(8, 4),  # 12
    Row(6, 3),  # too few new tokens
    Row(0, 9),  # no prefix
    Row(9, 1),  # generation
    Row(0, 0),
)
GATHER = jaxattn.PagedAttentionConfig(gather_tokens=64, gather_min_tokens=4)


@dtypes
@pytest.mark.parametrize(
    "opts, seed",
    [
        (Opts("gather_gqa", return_lse=True, config=GATHER), 0),
        (Opts("gather_alibi_softcap_rope", hkv=1, alibi=True, soft_cap=2.0, return_lse=True,
              rope=jaxattn.RoPE(theta=100.0), poison="huge", config=GATHER), 4),
    ],
    ids=str,
)  # fmt: skip
def test_history_gather(opts, dtype, seed):
    run_two_calls(GATHERED, opts, "pallas", dtype, seed=seed)


@pytest.mark.parametrize("quant", [QUANTS[1], QUANTS[4]], ids=qid)
def test_history_gather_quantized(quant):
    """The copy dequantizes as the flash kernel's paged loop does (int8 groups, int4)."""
    run_two_calls(GATHERED, Opts("gather_quant", config=GATHER), "pallas", "float32", quant=quant)


def test_history_plan_rows_and_sources():
    """Rows qualify in batch order while their histories fit; a row's buffer rows name
    its cached positions (page, offset) and then its new rows."""
    # rows: (q_len, context_len) with pages of 4; row 3 (history 30) no longer fits.
    q_lens, lens = [5, 1, 6, 4, 8, 2], [13, 9, 22, 30, 8, 11]
    tables = [[s * 10 + i for i in range(-(-n // P))] for s, n in enumerate(lens)]
    meta = jaxattn.AttentionMetadata.from_lists(q_lens, lens, tables, P, max_tokens=32,
                                                max_seqs=6, max_pages=8)  # fmt: skip
    context_rows = jnp.asarray(q_lens) > 1
    plan = jaxattn.history.plan(meta, context_rows, P, 64, min_tokens=4)
    np.testing.assert_array_equal(plan.chosen, [True, False, True, False, False, False])
    np.testing.assert_array_equal(np.asarray(plan.starts)[[0, 2]], [0, 13])
    page, offset, new = np.asarray(plan.sources)
    cu = np.cumsum([0] + q_lens)
    for s, start in ((0, 0), (2, 13)):
        prefix = lens[s] - q_lens[s]
        for p in range(lens[s]):
            r = start + p
            if p < prefix:
                assert (page[r], offset[r], new[r]) == (tables[s][p // P], p % P, -1), (s, p)
            else:
                assert (page[r], new[r]) == (-1, cu[s] + p - prefix), (s, p)
    assert (page[35:] == -1).all() and (new[35:] == -1).all()
    # No row can qualify: too few tokens in the step, or histories longer than the buffer.
    row_bytes = 2 * 2 * D * 4  # Hkv 2, float32
    assert jaxattn.history.buffer_rows(meta, P, None, 32, row_bytes) == 0
    assert jaxattn.history.buffer_rows(meta, P, None, 4, row_bytes) == 64  # capacity 32
    assert jaxattn.history.buffer_rows(meta, P, 16, 4, row_bytes) == 64  # a block at least
    assert jaxattn.history.buffer_rows(meta, P, 0, 4, row_bytes) == 0
    # The default's byte cap: rows of 1 MiB leave 256 rows of a larger capacity.
    big = dataclasses.replace(meta, block_tables=jnp.zeros((6, 1024), jnp.int32))
    assert jaxattn.history.buffer_rows(big, P, None, 4, 2**20) == 256
    assert jaxattn.history.buffer_rows(big, P, None, 4, row_bytes) == 4096


def test_rope_on_read_decode_reads_int4_keys_as_bytes(monkeypatch):
    """With rope on read the decode kernel reads K as bytes: the plan's tiling asks no K
    half-words, and INT4 groups of 16 (4 query rows with half-words) keep 8 rows."""
    import jaxattn.paged as paged

    configs = []

    def spy(*args, config, **kw):
        configs.append(config)
        raise StopIteration  # the tiling is all this test needs

    monkeypatch.setattr(paged, "paged_decode", spy)
    hkv, d, page = 2, 128, 8
    cache = jaxattn.PagedKVCache.create(8, page, hkv, d, quant=jaxattn.KVQuant("int4", "group", 16))
    meta = jaxattn.AttentionMetadata.from_lists([1, 1], [9, 16], [[0, 1], [2, 3]], page,
                                                max_tokens=2, max_seqs=2, max_pages=2,
                                                decode_only=True)  # fmt: skip
    q = jnp.zeros((2, 2 * hkv, d), jnp.float32)  # kv groups of 2 query heads
    k = v = jnp.zeros((2, hkv, d), jnp.float32)
    for rope_on_read in (False, True):
        call = functools.partial(jaxattn.paged_attention, rope=jaxattn.RoPE(theta=100.0),
                                 rope_on_read=rope_on_read, implementation="pallas")  # fmt: skip
        with pytest.raises(StopIteration):
            jax.eval_shape(call, q, k, v, cache, meta)
    plain, on_read = configs
    assert (plain.k_words, plain.query_rows) == (True, 4)
    assert (on_read.k_words, on_read.query_rows, on_read.block_kv) == (False, 8, 64)
