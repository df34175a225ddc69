"""StreamingLLM: `paged_attention(..., rope=..., rope_on_read=True)` against the float64
oracle of positions within the cache (`paged_oracle.streaming_step_oracle`), for every
implementation.

The cache must hold un-rotated keys (checked bit for bit, as `test_paged_attention`'s
`World` checks every written slot against the un-rotated history), and a query at p sees
itself at `p - o` and its keys at `j` (sinks) or `j - o`, `o = max(0, p - W + 1 - S)`. The
cases put most queries past `S + W`, where these positions differ from the absolute ones,
with a small theta so that the difference is large.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import util
from paged_oracle import streaming_step_oracle
from test_paged_attention import (
    GENERATION,
    HQ,
    MIXED,
    ROPE_TOL,
    SAME_TOL,
    Row,
    World,
    check_out,
    gather,
    qid,
    rounded,
    slot_rows,
    unpack,
)

import jaxattn

impls = pytest.mark.parametrize("impl", util.IMPLEMENTATIONS)
P = 4
D = util.DEFAULT_HEAD_DIM
DTYPE = util.CASE_DTYPES[0]
# The kernels round three operands of each logit to bfloat16 (the rotated query, k * cos
# and k * sin: the tensor cores' inputs) where the plain path rounds q alone; YaRN's
# attention factor scales the logits, and the error with them. Measured (interpret mode,
# D 128, INT4 group-16 cache, YaRN): up to 0.0113 in lse, against util's 0.01.
ROPE_LSE_TOL = {"bfloat16": dict(atol=2e-2, rtol=1e-3)}

ROPES = {
    "neox": jaxattn.RoPE(theta=100.0),
    "gptj_partial": jaxattn.RoPE(theta=300.0, style="gptj", rotary_dim=D // 2),
    "llama3": jaxattn.RoPE(
        theta=100.0,
        scaling=jaxattn.Llama3Scaling(factor=4.0, original_max_position_embeddings=16),
    ),
    "yarn": jaxattn.RoPE(
        theta=100.0, scaling=jaxattn.YarnScaling(factor=4.0, original_max_position_embeddings=8)
    ),
}
SMALL_TILES = jaxattn.PagedAttentionConfig(
    prefill=jaxattn.FlashPrefillConfig(block_q=16, block_kv=16, num_warps=4, num_stages=2),
    decode=jaxattn.PagedDecodeConfig(block_kv=16, num_splits=3),
)


@dataclasses.dataclass(frozen=True)
class Case:
    rope: jaxattn.RoPE
    window: int | None = 4
    sink_tokens: int = 2
    hkv: int = 2
    alibi: bool = False
    return_lse: bool = True

    def kwargs(self) -> tuple[dict, dict]:
        """(paged_attention's options, the oracle's)."""
        both = dict(window=self.window, sink_tokens=self.sink_tokens)
        impl, oracle = dict(both, rope=self.rope, rope_on_read=True), dict(both)
        if self.alibi:
            slopes = jaxattn.alibi_slopes(HQ)
            impl["alibi_slopes"], oracle["alibi_slopes"] = slopes, np.float64(slopes)
        return impl, oracle


class StreamWorld(World):
    """`World` (rope=None there: the cache must store the un-rotated history) checked
    against the streaming oracle."""

    def __init__(self, rng, lengths, case: Case, **kwargs):
        super().__init__(rng, lengths, hkv=case.hkv, dtype=DTYPE, **kwargs)
        self.read_rope = case.rope

    def check(self, plan, result, *, oracle_kw, return_lse=False, what=""):
        out, lse, after = unpack(result, return_lse)
        before, self.cache = self.cache, after
        meta, real = plan.meta, plan.owner >= 0
        self._check_cache(plan, before, after, what)  # un-rotated k, bit for bit
        owners = self._row_owner(plan)
        if self.quant is None:
            histories = {int(s): (self.k_raw[s], self.v_raw[s]) for s in plan.owner[real]}
        else:  # what the cache holds now, dequantized and rounded to q's dtype
            k_all, v_all = gather(after, meta.block_tables, meta.context_lens, self.max_pages * P)
            histories = {
                s: (rounded(k_all[r], DTYPE), rounded(v_all[r], DTYPE))
                for r, s in enumerate(owners)
                if s >= 0
            }
        rows = [histories.get(s) for s in owners]
        q = np.where(real[:, None, None], util.f64(plan.q), 0.0)
        plan_kw = (meta.cu_seqlens_q, meta.context_lens, rows, self.read_rope)
        want_lse = check_against_oracle(out, q, *plan_kw, oracle_kw=oracle_kw, what=what)
        util.assert_zero_rows(out, ~real[:, None, None], f"{what} padding tokens")
        if return_lse:
            util.assert_lse_close(np.asarray(lse), want_lse, DTYPE, ROPE_LSE_TOL.get(DTYPE))
        return out


def check_against_oracle(out, q, cu, context_lens, rows, rope, *, oracle_kw, what):
    """Checks `out` (real tokens) against the streaming oracle; returns the oracle's lse."""
    oracle = functools.partial(streaming_step_oracle, q, cu, context_lens, rows, rope,
                               **oracle_kw)  # fmt: skip
    want, want_lse = oracle()
    lowp = None if DTYPE == "float32" else oracle(lowp=jnp.dtype(DTYPE))[0]
    check_out(out, want, DTYPE, lowp, tol=ROPE_TOL, what=f"{what} out")
    return want_lse


def run_calls(rows, case: Case, impl, *, quant=None, config=None, seed=0, what="",
              decode_only=False):  # fmt: skip
    """The first call writes every prefix, the second runs `rows` mixed (random batch
    order; a `decode_only` plan if asked); both checked. Returns the world and the second
    call's output."""
    rng = util.rng_for("streaming", what, str(case), str(quant), impl, seed)
    impl_kw, oracle_kw = case.kwargs()
    lengths = [r.prefix + r.new for r in rows]
    world = StreamWorld(rng, lengths, case, quant=quant)
    first = [(s, 0, r.prefix) for s, r in enumerate(rows) if r.prefix]
    second = [(s if lengths[s] else None, r.prefix, r.new) for s, r in enumerate(rows)]
    calls = [[c[i] for i in rng.permutation(len(c))] for c in (first, second)]
    max_tokens = -(-(max(sum(n for *_, n in c) for c in calls) + 3) // 8) * 8
    fn = jax.jit(
        functools.partial(jaxattn.paged_attention, implementation=impl, config=config,
                          return_lse=case.return_lse, **impl_kw),
        compiler_options=util.FAST_COMPILE,
    )  # fmt: skip
    for i, call in enumerate(calls):
        _, out = world.step(call, fn, max_tokens=max_tokens, max_seqs=len(rows) + 2,
                            oracle_kw=oracle_kw, return_lse=case.return_lse,
                            what=f"{what} call {i}",
                            decode_only=decode_only and i == 1)  # fmt: skip
    return world, out


# --------------------------------------------------------------------- rope forms
@impls
@pytest.mark.parametrize("rope", ["neox", "gptj_partial"])
def test_mixed_batch(rope, impl):
    """Context, chunked context and generation rows in one step; window 4, 2 sinks: the
    longer rows' queries sit at positions within the cache up to 5 below their own."""
    run_calls(MIXED, Case(ROPES[rope], hkv=2 if rope != "gptj_partial" else 1), impl,
              what=rope)  # fmt: skip


@impls
def test_decode_only_plan(impl):
    """A generation-only step planned as such: the decode kernel reads q and the tables'
    rows per token (rows in random order, padding rows among them)."""
    run_calls(GENERATION, Case(ROPES["llama3"]), impl, what="decode_only", decode_only=True)


@impls
def test_no_window_is_absolute_rope(impl):
    """Without a window o = 0: rope_on_read gives the outputs of rotating before the write
    (same inputs, same pages), while its cache holds un-rotated keys (checked by the world)."""
    case = Case(ROPES["neox"], window=None, sink_tokens=0, alibi=True, return_lse=False)
    impl_kw, oracle_kw = case.kwargs()
    lengths = [r.prefix + r.new for r in MIXED]
    streaming = StreamWorld(util.rng_for("no_window", impl), lengths, case)
    history = list(zip(streaming.q_raw, streaming.k_raw, streaming.v_raw))
    absolute = World(util.rng_for("no_window", impl), lengths, hkv=2, dtype=DTYPE,
                     rope=case.rope, history=history)  # fmt: skip
    assert absolute.pages == streaming.pages
    first = [(s, 0, r.prefix) for s, r in enumerate(MIXED) if r.prefix]
    second = [(s if n else None, r.prefix, r.new) for s, (r, n) in enumerate(zip(MIXED, lengths))]
    outs = []
    for world, on_read in ((streaming, True), (absolute, False)):
        if impl == "pallas" and not on_read:  # (the xla case shows it; one compile less)
            continue
        fn = jax.jit(functools.partial(jaxattn.paged_attention, implementation=impl,
                                       **dict(impl_kw, rope_on_read=on_read)),
                     compiler_options=util.FAST_COMPILE)  # fmt: skip
        for call in (first, second):
            _, out = world.step(call, fn, max_tokens=40, max_seqs=len(MIXED) + 2,
                                oracle_kw=oracle_kw)  # fmt: skip
        outs.append(util.f64(out))
    if len(outs) == 2:
        np.testing.assert_allclose(outs[0], outs[1], **SAME_TOL[DTYPE])


@pytest.mark.parametrize("window, sink_tokens, rope", [(7, 3, "llama3"), (5, 18, "neox")])
def test_pallas_small_tiles(window, sink_tokens, rope):
    """Tiles of 16 queries with different bases, sink blocks holding window keys (3 sinks
    in a block of 16) and sinks over two blocks (18), split-K decode."""
    rows = (
        Row(0, 21),  # a prompt over two q tiles
        Row(17, 6),  # a prefix over two key blocks, then a chunk
        Row(30, 5),  # a chunk across the key block boundary at 32
        Row(33, 1),  # generation over three key blocks (and three splits)
        Row(0, 0),
    )
    case = Case(ROPES[rope], window=window, sink_tokens=sink_tokens, alibi=True)
    run_calls(rows, case, "pallas", config=SMALL_TILES, what=f"tiles{window}")


# ------------------------------------------------------------------ quantized caches
@impls
@pytest.mark.parametrize(
    "quant, rope",
    [(jaxattn.KVQuant("int8"), "neox"), (jaxattn.KVQuant("int4", "group", 16), "yarn")],
    ids=lambda x: qid(x) if isinstance(x, jaxattn.KVQuant) else x,
)  # fmt: skip
def test_quantized_cache(quant, rope, impl):
    """Rotation after dequantization (INT4: each half of the channels on its own, as the
    decode kernel reads them; with neox pairs, channel c's partner is in the other half);
    the cache stores the quantized un-rotated keys (bytes checked by the world)."""
    run_calls(MIXED, Case(ROPES[rope]), impl, quant=quant, what="quant")


# ------------------------------------------------------------ chunked = one pass
@impls
def test_chunked_equals_one_pass(impl):
    """A prompt of 19 in one step or in chunks of 8, 4, 7, then 3 generated tokens: the
    same outputs (and each step against the oracle)."""
    case = Case(ROPES["neox"], window=5, sink_tokens=2)
    impl_kw, oracle_kw = case.kwargs()
    fn = jax.jit(functools.partial(jaxattn.paged_attention, implementation=impl, **impl_kw),
                 compiler_options=util.FAST_COMPILE)  # fmt: skip
    history = None
    outputs = []
    for chunks in ([19], [8, 4, 7]):
        rng = util.rng_for("chunked", impl)
        world = StreamWorld(rng, [22], case, history=history)
        history = list(zip(world.q_raw, world.k_raw, world.v_raw))
        got, start = [], 0
        for n in chunks + [1, 1, 1]:
            _, out = world.step([(0, start, n)], fn, max_tokens=24, max_seqs=2,
                                oracle_kw=oracle_kw)  # fmt: skip
            got.append(util.f64(out[:n]))
            start += n
        outputs.append(np.concatenate(got))
    np.testing.assert_allclose(outputs[1], outputs[0], **SAME_TOL[DTYPE])


# ------------------------------------------------------------------ a cyclic cache
@impls
def test_cyclic_cache_many_windows(impl):
    """A ring cache (window 6, 2 sinks: 3 pages of 4 per row) run to 40 tokens, over six
    windows: a first chunk longer than the ring, chunked prefill, then generation token by
    token, through one jitted step (reserve, build, paged_attention). Every step against
    the oracle; every written slot holds the un-rotated key."""
    window, sinks, hkv = 6, 2, 2
    rope = ROPES["neox"]
    pages = jaxattn.KVCacheManager.window_pages(window, sinks, P)
    lengths = [40, 31]
    rng = util.rng_for("cyclic", impl)
    hist = [tuple(rounded(rng.standard_normal((n, h, D)), DTYPE) for h in (HQ, hkv, hkv))
            for n in lengths]  # fmt: skip
    mgr = jaxattn.KVCacheManager.create(len(lengths) * pages + 1, P, len(lengths), pages,
                                        window=window, sink_tokens=sinks)  # fmt: skip
    nan = util.poison_value(DTYPE, "nan")
    cache = jaxattn.PagedKVCache.create(mgr.num_pages, P, hkv, D, dtype=DTYPE)
    cache = jaxattn.PagedKVCache(*(jnp.full_like(x, nan) for x in (cache.k_pages, cache.v_pages)))
    max_tokens = 24

    @functools.partial(jax.jit, compiler_options=util.FAST_COMPILE)
    def step(mgr, cache, seq_ids, lengths, q_lens, q, k, v):
        mgr, ok = mgr.reserve(seq_ids, lengths)
        meta = jaxattn.AttentionMetadata.build(mgr, seq_ids, q_lens, max_tokens)
        out, cache = jaxattn.paged_attention(
            q, k, v, cache, meta, rope=rope, rope_on_read=True, window=window,
            sink_tokens=sinks, implementation=impl,
        )  # fmt: skip
        return mgr, cache, out, ok, meta.slot_mapping

    done = [0, 0]
    schedule = [[14, 5], [1, 4]] + [[1, 1]] * (lengths[0] - 15)
    for i, q_lens in enumerate(schedule):
        q_lens = [min(n, total - d) for n, total, d in zip(q_lens, lengths, done)]
        q = np.full((max_tokens, HQ, D), nan)
        k, v = (np.full((max_tokens, hkv, D), nan) for _ in "kv")
        t = 0
        for s, n in enumerate(q_lens):
            for x, h in zip((q, k, v), hist[s]):
                x[t : t + n] = h[done[s] : done[s] + n]
            t += n
        new = [d + n for d, n in zip(done, q_lens)]
        mgr, cache, out, ok, slots = step(
            mgr, cache, *(jnp.asarray(x, jnp.int32) for x in ([0, 1], new, q_lens)),
            *(jnp.asarray(x, DTYPE) for x in (q, k, v)),
        )  # fmt: skip
        assert bool(ok), f"step {i}: reserve failed"
        cu = np.concatenate([[0], np.cumsum(q_lens)])
        check_against_oracle(
            out[: cu[-1]], q[: cu[-1]], cu, new, [h[1:] for h in hist], rope,
            oracle_kw=dict(window=window, sink_tokens=sinks), what=f"step {i}",
        )  # fmt: skip
        util.assert_zero_rows(out[cu[-1] :], True, f"step {i} padding tokens")
        slots = np.asarray(slots)
        ok_slots = slots >= 0
        got = slot_rows(cache.k_pages)[slots[ok_slots]]
        np.testing.assert_array_equal(util.bits(got), util.bits(jnp.asarray(k[ok_slots], DTYPE)),
                                      f"step {i}: the cache must hold un-rotated keys")  # fmt: skip
        done = new
    assert done == lengths and lengths[0] > 6 * window


# ---------------------------------------------------------------------- nn.Attention
def test_nn_attention_serving():
    """`jaxattn.nn.Attention(rope_on_read=True)` passes it to paged_attention in serving
    mode; full-sequence mode (no cache: no positions within it) refuses a window."""
    from flax import nnx

    from jaxattn.nn import Attention

    rope = ROPES["neox"]
    kw = dict(rope=rope, window=4, sink_tokens=2, rngs=nnx.Rngs(0))
    layer = Attention(HQ * D, HQ, 2, D, rope_on_read=True, **kw)
    meta = jaxattn.AttentionMetadata.from_lists([9], [9], [[0, 1, 2]], P, max_tokens=12,
                                                max_seqs=2, max_pages=3)  # fmt: skip
    cache = jaxattn.PagedKVCache.create(4, P, 2, D, dtype=jnp.float32)
    x = util.randn(util.rng_for("nn"), (12, HQ * D))

    @jax.jit
    def both(x, cache, meta):
        y, new_cache = layer(x, cache=cache, meta=meta)
        q, k, v = layer.project_qkv(x)
        out, want_cache = jaxattn.paged_attention(
            q, k, v, cache, meta, rope=rope, rope_on_read=True, window=4, sink_tokens=2
        )
        return y, new_cache, layer.o_proj(out.reshape(12, -1)), want_cache

    y, new_cache, want, want_cache = both(x, cache, meta)
    np.testing.assert_allclose(y, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(new_cache.k_pages, want_cache.k_pages)
    with pytest.raises(ValueError, match="rope_on_read"):
        layer(x[None, :9])


# ------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    "rope, match",
    [(None, "rope_on_read=True needs rope"),
     (jaxattn.RoPE(scaling=jaxattn.DynamicNTKScaling(2.0, 16)), "dynamic NTK")],
    ids=["no_rope", "dynamic_ntk"],
)  # fmt: skip
@pytest.mark.every_case
def test_bad_input(rope, match):
    meta = jaxattn.AttentionMetadata.from_lists([3], [3], [[0]], P, max_tokens=4, max_seqs=1,
                                                max_pages=1)  # fmt: skip
    cache = jaxattn.PagedKVCache.create(2, P, 2, D, dtype=jnp.float32)
    q, k = (
        jax.ShapeDtypeStruct((4, HQ, D), jnp.float32),
        jax.ShapeDtypeStruct((4, 2, D), jnp.float32),
    )
    call = functools.partial(jaxattn.paged_attention, rope=rope, rope_on_read=True, window=4)
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(call, q, k, k, cache, meta)
