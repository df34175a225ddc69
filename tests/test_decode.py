"""`jaxattn.paged_decode` against the float64 numpy oracle, for every implementation.

Each sequence's K/V history is drawn in numpy, then scattered by hand (not by `write_kv`)
into pages placed at random in the pool; every page no sequence owns is filled with NaN,
so a read outside a sequence's pages shows up as NaN in the output.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import util
from oracle import attention_oracle

import jaxattn
from jaxattn.decode import cache_format
from pallas_kernels.cache_read import reads_segments, reads_v_words
from pallas_kernels.paged_decode.stacked import stacks

impls = pytest.mark.parametrize("impl", util.IMPLEMENTATIONS)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    lengths: tuple[int, ...]  # context lengths (query included); 0 = idle slot
    num_kv_heads: int = 2
    page_size: int = 8
    max_pages: int = 6
    window: int | None = None
    sink_tokens: int = 0
    alibi: bool = False
    soft_cap: float | None = None
    scale: float | None = None

    def __str__(self):
        return self.name


NUM_Q_HEADS = 8
CASES = [
    Case("gqa4", lengths=(1, 8, 9, 48)),  # 1 token, a page boundary, one past, full
    Case("mha", lengths=(5, 17, 40), num_kv_heads=8),
    Case("mqa", lengths=(3, 33), num_kv_heads=1),
    Case("idle_slot", lengths=(0, 13, 0)),
    Case("page16", lengths=(16, 31, 64), page_size=16, max_pages=4),
    Case("window", lengths=(30, 48, 4), window=9),
    Case("window_sinks", lengths=(30, 48, 4, 2), window=9, sink_tokens=3),
    Case("alibi_softcap_scale", lengths=(21, 44), alibi=True, soft_cap=3.0, scale=0.3),
    Case("everything", lengths=(47, 12, 1), num_kv_heads=1, window=16, sink_tokens=4,
         alibi=True, soft_cap=20.0),
]  # fmt: skip


def _head_dim():
    return util.DEFAULT_HEAD_DIM


def _build(case: Case, dtype: str, seed):
    """q [B, Hq, D]; a poisoned cache; block tables; lengths; and the dense K/V history."""
    rng = util.rng_for("decode", seed, case.name, dtype)
    batch, head_dim, page = len(case.lengths), _head_dim(), case.page_size
    num_pages = batch * case.max_pages + 5
    k_hist = rng.standard_normal((batch, case.max_pages * page, case.num_kv_heads, head_dim))
    v_hist = rng.standard_normal(k_hist.shape)
    pools = [np.full((num_pages, case.num_kv_heads, page, head_dim), np.nan) for _ in range(2)]
    tables = rng.permutation(num_pages)[: batch * case.max_pages].reshape(batch, -1)
    for b, length in enumerate(case.lengths):
        for t in range(length):
            for pool, hist in zip(pools, (k_hist, v_hist), strict=True):
                pool[tables[b, t // page], :, t % page] = hist[b, t]
    q = rng.standard_normal((batch, NUM_Q_HEADS, head_dim))
    cache = jaxattn.PagedKVCache(*(jnp.asarray(p, dtype) for p in pools))
    # Round the history like the cache so the oracle sees the same values.
    k_hist, v_hist = (util.f64(jnp.asarray(h, dtype)) for h in (k_hist, v_hist))
    return (jnp.asarray(q, dtype), cache, jnp.asarray(tables, jnp.int32),
            jnp.asarray(case.lengths, jnp.int32), k_hist, v_hist)  # fmt: skip


def _options(case: Case):
    return dict(
        window=case.window,
        sink_tokens=case.sink_tokens,
        alibi_slopes=jaxattn.alibi_slopes(NUM_Q_HEADS) if case.alibi else None,
        soft_cap=case.soft_cap,
        scale=case.scale,
    )


def _oracle(case, q, k_hist, v_hist):
    opts = _options(case)
    out, lse = attention_oracle(
        util.f64(q)[:, None], k_hist, v_hist, causal=True,
        q_lengths=np.ones(len(case.lengths), int), kv_lengths=np.asarray(case.lengths),
        **{**opts, "alibi_slopes": None if opts["alibi_slopes"] is None else
           np.asarray(opts["alibi_slopes"], np.float64)},
    )  # fmt: skip
    return out[:, 0], lse[:, :, 0]


def _dtypes():
    return ("bfloat16", "float32") if util.ON_GPU else ("float32",)


@impls
@pytest.mark.parametrize("dtype", _dtypes())
@pytest.mark.parametrize("case", CASES, ids=str)
def test_decode_vs_oracle(case, dtype, impl):
    q, cache, tables, lengths, k_hist, v_hist = _build(case, dtype, 0)
    want, want_lse = _oracle(case, q, k_hist, v_hist)
    configs = [None]
    if impl == "pallas":  # split-K off and on, query rows padded to 16 and to 4 (or the
        # group's 8): the same function
        configs = [jaxattn.PagedDecodeConfig(16, 1), jaxattn.PagedDecodeConfig(16, 3, query_rows=4)]
    for config in configs:
        out, lse = jax.jit(
            lambda q, cache, tables, lengths, config=config: jaxattn.paged_decode(
                q, cache, tables, lengths, return_lse=True, implementation=impl,
                config=config, **_options(case),
            ),
            compiler_options=util.FAST_COMPILE,
        )(q, cache, tables, lengths)  # fmt: skip
        if dtype == "float32":
            util.assert_out_close(out, want, dtype, what=f"out ({config})")
        else:  # bf16: the plain bf16 oracle sets the bound (FlashAttention's rule)
            lowp, _ = attention_oracle(
                util.f64(q)[:, None], k_hist, v_hist, causal=True,
                q_lengths=np.ones(len(case.lengths), int),
                kv_lengths=np.asarray(case.lengths), lowp=jnp.bfloat16, **{
                    **_options(case), "alibi_slopes": None if not case.alibi else
                    np.asarray(jaxattn.alibi_slopes(NUM_Q_HEADS), np.float64)},
            )  # fmt: skip
            util.assert_out_close(out, want, dtype, lowp_ref=lowp[:, 0], what=f"out {config}")
        util.assert_lse_close(lse, want_lse, dtype)
        idle = np.asarray(case.lengths) == 0
        util.assert_zero_rows(out, idle[:, None, None], "idle slots")


@pytest.mark.parametrize("splits", [1, 2, 5])
def test_split_k_matches_single_pass(splits):
    case = Case("split", lengths=(48, 7, 33, 1), window=20, sink_tokens=2, alibi=True)
    q, cache, tables, lengths, *_ = _build(case, "float32", 1)
    run = lambda n: jaxattn.paged_decode(  # noqa: E731
        q, cache, tables, lengths, implementation="pallas", return_lse=True,
        config=jaxattn.PagedDecodeConfig(16, n), **_options(case),
    )  # fmt: skip
    (out1, lse1), (out, lse) = run(1), run(splits)
    np.testing.assert_allclose(np.asarray(out), np.asarray(out1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(lse1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "batch, context, want",
    [
        (1, 32768, (128, 33, 4, 2)),  # few programs: about two per SM through split-K
        (8, 8192, (128, 5, 4, 2)),
        (32, 4096, (64, 2, 4, 3)),  # >= one per SM: split while all stay resident (4 per SM)
        (17, 4096, (64, 3, 4, 3)),
        (48, 4096, (64, 1, 4, 3)),  # two splits would need a second wave of programs
        (32, 16384, (128, 8, 4, 2)),  # long contexts: about 16 programs per SM
        (64, 16384, (128, 4, 4, 2)),
        (48, 8192, (128, 5, 4, 2)),
        (256, 16384, (64, 1, 4, 3)),  # 2048 programs already
        (32, 64, (64, 1, 4, 3)),  # too short to split
    ],
)
@pytest.mark.every_case
def test_decode_heuristic_tilings(batch, context, want):
    """The H100 choices documented in `PagedDecodeConfig.heuristic` (8 kv heads, 132 SMs)."""
    config = jaxattn.PagedDecodeConfig.heuristic(batch, 8, context, 16, sm_count=132)
    assert (config.block_kv, config.num_splits, config.num_warps, config.num_stages) == want


@pytest.mark.parametrize(
    "batch, context, code, want, want_rows",
    [  # per tensor; one scale per token row
        (64, 16384, "int8", (128, 2, 4, 4), (128, 2, 4, 3)),  # >= 2 splits; per tensor 4 stages
        (8, 8192, "int8", (128, 4, 4, 3), (128, 5, 4, 3)),  # one wave of two programs an SM
        (8, 8192, "int4", (128, 8, 4, 3), (128, 8, 4, 3)),  # INT4: about four programs an SM
        (4, 16384, "int4", (128, 16, 4, 3), (128, 16, 4, 3)),
        (22, 8192, "int4", (128, 2, 4, 3), (128, 2, 4, 3)),  # 176 programs: >= one an SM
        (16, 8192, "int8", (128, 2, 4, 3), (128, 3, 4, 3)),
        (2, 8192, "int8", (128, 16, 4, 3), (128, 17, 4, 3)),
        (1, 2048, "int8", (128, 8, 4, 3), (128, 8, 4, 3)),  # each split at least two blocks
        (256, 2048, "float8_e4m3fn", (128, 2, 4, 4), (128, 2, 4, 3)),
    ],
)
@pytest.mark.every_case
def test_decode_heuristic_tilings_quantized(batch, context, code, want, want_rows):
    """Quantized caches: 128-token blocks in 3 stages, split at least in two, into one
    wave of two programs an SM; with a scale per token row about two programs an SM;
    INT4 per tensor or with a scale per row about four. INT8 and FP8 per tensor with >=
    one program per SM: 4 stages."""
    heuristic = functools.partial(
        jaxattn.PagedDecodeConfig.heuristic, batch, 8, context, 16, sm_count=132, code=code
    )
    for config, expected in ((heuristic(), want), (heuristic(row_scales=True), want_rows)):
        got = (config.block_kv, config.num_splits, config.num_warps, config.num_stages)
        assert got == expected


def test_decode_heuristic_int4_splits_need_half_words():
    """The four-programs-an-SM rule for INT4 per tensor / one scale a row was measured with
    V read as half-words: where words cannot apply (`v_words=False`) INT4 keeps the split
    count of the other formats; INT4 groups too."""
    heuristic = functools.partial(
        jaxattn.PagedDecodeConfig.heuristic, 8, 8, 8192, 16, sm_count=132, code="int4"
    )
    assert heuristic().num_splits == heuristic(row_scales=True).num_splits == 8
    assert heuristic(v_words=False).num_splits == 4
    assert heuristic(row_scales=True, v_words=False).num_splits == 5
    assert heuristic(group_size=32).num_splits == 4


@pytest.mark.parametrize(
    "code, group_size, want",
    [
        ("int8", 8, (64, 2, 3)),  # groups of 8: 64-token blocks in 2 warps
        ("float8_e4m3fn", 8, (64, 2, 3)),
        ("int8", 16, (128, 4, 4)),  # 4 stages
        ("float8_e4m3fn", 32, (128, 4, 4)),
        ("int8", 32, (128, 4, 3)),
        ("float8_e4m3fn", 16, (128, 4, 3)),
        ("int4", 8, (128, 4, 4)),  # K read as half-words, 4 stages
        ("int4", 0, (128, 4, 3)),
    ],
)
@pytest.mark.every_case
def test_decode_heuristic_group_sizes(code, group_size, want):
    """With >= one program per SM (B64, 8 kv heads) the group size picks the tiling; with
    fewer (B8) every format and group size runs 128-token blocks in 3 stages."""
    heuristic = functools.partial(
        jaxattn.PagedDecodeConfig.heuristic, sm_count=132, code=code, group_size=group_size
    )
    config = heuristic(64, 8, 16384, 16)
    assert (config.block_kv, config.num_warps, config.num_stages) == want
    few = heuristic(8, 8, 8192, 16)
    assert (few.block_kv, few.num_warps, few.num_stages) == (128, 4, 3)


@pytest.mark.parametrize("head_dim", [32, 64])
@pytest.mark.every_case
def test_decode_heuristic_small_heads(head_dim):
    """Head dims up to 64, quantized caches of every format and layout: at most 8 query
    rows (16 ran 2.5-4.5x slower at D 64), no stacked rows; 64-token blocks in 2 warps
    with >= one program per SM (B64, 8 kv heads), 128-token blocks in 4 warps with fewer
    (B8), 4 rows there with group scales; INT4 reads K as half-words where V is read as
    words. D 128 keeps its own tilings, and float caches theirs."""
    heuristic = functools.partial(
        jaxattn.PagedDecodeConfig.heuristic,
        sm_count=132,
        head_dim=head_dim,
        query_group=4,
        v_words=head_dim == 64,
    )  # D 32: no words (D / 4 < 16)
    formats = [(code, group, rows) for code in ("int8", "float8_e4m3fn", "int4")
               for group, rows in ((0, False), (0, True), (8, False), (16, False))]  # fmt: skip
    for code, group_size, row_scales in formats:
        for pages in (True, False):
            kw = dict(code=code, group_size=group_size, row_scales=row_scales, pages=pages)
            many, few = heuristic(64, 8, 16384, 16, **kw), heuristic(8, 8, 8192, 16, **kw)
            assert (many.block_kv, many.num_warps, many.num_stages) == (64, 2, 3), kw
            assert (few.block_kv, few.num_warps, few.num_stages) == (128, 4, 3), kw
            assert many.query_rows == 8 and few.query_rows == (4 if group_size else 8), kw
            assert not many.stacked and not few.stacked, kw
            assert many.k_words == few.k_words == (code == "int4" and head_dim == 64), kw
    assert heuristic(64, 8, 16384, 16, code="int8", head_dim=128).query_rows == 16
    assert heuristic(64, 8, 16384, 16).block_kv == 128  # bf16: 128-token blocks, 4 splits


def test_decode_heuristic_heads_of_no_power_of_two():
    """Head dims 80, 96, 112 and 192 over our pages: 8 query rows for every quantized format
    (V read as codes there). With >= one program per SM, 64-token blocks of 2 warps for
    INT4 in groups, INT4 per tensor where its halves are read in segments below D192 (not
    at D112, halves of 56, nor D120), INT8 groups of 8 and 16 from D96 and INT8 with one
    scale a row; with fewer, 128-token blocks of 4 warps, INT4 per tensor's rows padded
    where they would be read in segments below D128 (D80, D96; not D160). OpenPPL's
    layouts keep their rows."""
    for head_dim in (80, 96, 112, 192):
        heuristic = functools.partial(jaxattn.PagedDecodeConfig.heuristic, sm_count=132,
                                      head_dim=head_dim, query_group=4, v_words=False)  # fmt: skip
        for code in ("int8", "float8_e4m3fn", "int4"):
            for group_size, row_scales in ((0, False), (0, True), (8, False), (16, False),
                                           (32, False)):  # fmt: skip
                kw = dict(code=code, group_size=group_size, row_scales=row_scales)
                many, few = heuristic(64, 8, 16384, 16, **kw), heuristic(8, 8, 8192, 16, **kw)
                assert many.query_rows == few.query_rows == 8, kw
                int4_tensor = code == "int4" and not group_size and not row_scales
                int4_segments = int4_tensor and head_dim in (80, 96)
                small = (
                    (code == "int4" and group_size > 0)
                    or int4_segments
                    or (code == "int8" and group_size in (8, 16) and head_dim >= 96)
                    or (code == "int8" and row_scales)
                )
                assert (many.block_kv, many.num_warps) == ((64, 2) if small else (128, 4)), kw
                assert (few.block_kv, few.num_warps) == (128, 4), kw
                assert few.segments == (not int4_segments) and many.segments, kw
                assert many.num_stages == few.num_stages == 3, kw
                assert not (many.k_words or few.k_words or many.stacked or few.stacked), kw
        ppl = heuristic(64, 8, 16384, 16, code="int8", pages=False)
        assert ppl.query_rows == 16
        ppl = heuristic(64, 8, 16384, 16, code="int4", group_size=16, pages=False)
        assert (ppl.block_kv, ppl.num_warps) == (128, 4)
        ppl = heuristic(8, 8, 8192, 16, code="int8", row_scales=True, pages=False)
        assert (ppl.block_kv, ppl.num_warps) == (64, 2)  # measured over our pages only
    for code, group_size, want in (("int4", 0, 128), ("int8", 8, 64)):  # D120: one tile
        d120 = jaxattn.PagedDecodeConfig.heuristic(64, 8, 16384, 16, sm_count=132, code=code,
                                                    group_size=group_size, head_dim=120,
                                                    v_words=False)  # fmt: skip
        assert d120.block_kv == want, code
    d160 = jaxattn.PagedDecodeConfig.heuristic(64, 8, 16384, 16, sm_count=132, code="int4",
                                                head_dim=160, v_words=False)  # fmt: skip
    assert (d160.block_kv, d160.num_warps) == (64, 2)  # halves of 80 = 64 + 16
    d160 = jaxattn.PagedDecodeConfig.heuristic(8, 8, 8192, 16, sm_count=132, code="int4",
                                                head_dim=160, v_words=False)  # fmt: skip
    assert d160.segments  # fewer programs: padded only where measured (D80, D96)


def test_decode_heuristic_int4_keys_as_words():
    """INT4 reads K as half-words (where V is read as words), groups of 8 only with >= one
    program per SM (B64 8 kv heads, not B8); not with stacked rows (groups of 32 at D
    128), nor the 8-bit formats (the config's `k_words` applies to INT4 alone). Groups of
    16 then pad to 4 query rows."""
    heuristic = functools.partial(jaxattn.PagedDecodeConfig.heuristic, sm_count=132,
                                  head_dim=128, query_group=4)  # fmt: skip
    for shape in ((64, 8, 16384, 16), (8, 8, 8192, 16)):
        for group_size, row_scales in ((0, False), (0, True), (8, False), (16, False), (64, False)):
            config = heuristic(*shape, code="int4", group_size=group_size, row_scales=row_scales)
            assert config.k_words == (group_size != 8 or shape[0] == 64), (shape, group_size)
            assert (config.query_rows == 4) == (group_size == 16), (shape, group_size)
            assert not heuristic(*shape, code="int4", group_size=group_size, v_words=False).k_words
        for code, group_size in (("int4", 32), ("int8", 8), ("int8", 0)):
            assert not heuristic(*shape, code=code, group_size=group_size).k_words, code
        for code, group_size in (("int4", 0), ("int4", 16), ("int4", 32), (None, 0)):
            # rope on read: K as bytes, scales per value; its tables' 64-token blocks, 1 stage
            config = heuristic(*shape, code=code, group_size=group_size, rope_on_read=True)
            assert not (config.k_words or config.stacked) and config.query_rows >= 8
            assert (config.block_kv, config.num_stages) == (64, 1), (code, group_size)


@pytest.mark.parametrize("batch, context", [(64, 16384), (8, 8192)])
@pytest.mark.every_case
def test_decode_heuristic_query_rows(batch, context):
    """Query rows padded to 8 for INT4 with group scales and 8-bit groups of 8, 16 or 64;
    to 16 otherwise (`few_rows`); but INT4 groups of 16, K read as half-words, to 4."""
    heuristic = functools.partial(
        jaxattn.PagedDecodeConfig.heuristic, batch, 8, context, 16, sm_count=132
    )
    eight = [dict(code="int4", group_size=g) for g in (8, 32, 64)]
    eight += [dict(code="int4", row_scales=True)]
    eight += [dict(code=c, group_size=g) for c in ("int8", "float8_e4m3fn") for g in (8, 16, 64)]
    sixteen = [dict(), dict(code="int4"), dict(code="int8"), dict(code="float8_e4m3fn")]
    sixteen += [dict(code="int8", row_scales=True), dict(code="int8", group_size=32)]
    sixteen += [dict(code="float8_e4m3fn", group_size=32)]
    assert [heuristic(**x).query_rows for x in eight] == [8] * len(eight)
    assert [heuristic(**x).query_rows for x in sixteen] == [16] * len(sixteen)
    assert heuristic(code="int4", group_size=16).query_rows == 4
    assert heuristic(code="int4", group_size=16, v_words=False).query_rows == 8


def test_decode_heuristic_stacked_groups():
    """Group scales go through stacked rows (4 of them) for INT4 with two groups a half row
    and kv groups of at most 4 query heads, over our pages (`stacked_groups`; above D 64);
    not for finer or coarser INT4 groups, larger kv groups, 8-bit groups, OpenPPL's
    layouts, V not read as words, or a head dim or kv group not given."""
    heuristic = functools.partial(
        jaxattn.PagedDecodeConfig.heuristic, 64, 8, 16384, 16, sm_count=132, code="int4"
    )
    for head_dim, group_size, query_group in ((128, 32, 4), (256, 64, 1)):
        config = heuristic(group_size=group_size, head_dim=head_dim, query_group=query_group)
        assert (config.stacked, config.query_rows) == (True, 4), (head_dim, group_size)
        assert (config.block_kv, config.num_warps, config.num_stages) == (128, 4, 3)
    # fewer programs than SMs (B8, 8 kv heads) as well; D 64 never (`heuristic`'s small heads)
    few = functools.partial(jaxattn.PagedDecodeConfig.heuristic, 8, 8, 8192, 16, sm_count=132,
                            code="int4", query_group=4)  # fmt: skip
    assert few(group_size=32, head_dim=128).stacked and few(group_size=64, head_dim=256).stacked
    assert not few(group_size=16, head_dim=64).stacked
    assert not heuristic(group_size=16, head_dim=64, query_group=4).stacked
    unstacked = [
        dict(group_size=16), dict(group_size=64), dict(query_group=8),
        dict(code="int8", group_size=64), dict(code="float8_e4m3fn", group_size=64),
        dict(pages=False), dict(v_words=False), dict(head_dim=0), dict(query_group=0),
    ]  # fmt: skip
    for change in unstacked:
        config = heuristic(**{**dict(group_size=32, head_dim=128, query_group=4), **change})
        assert not config.stacked, change


def test_decode_rows_over_ppl_layouts():
    """OpenPPL's cache layouts keep 16 query rows at D 128 (8 ran slower through the PPL
    op); at D 64 they take 8, as our pages do."""
    from pallas_kernels.cache_read import CacheFormat, PoolLayout

    ours = CacheFormat("int8", "group", 8)
    ppl = dataclasses.replace(ours, layout=PoolLayout(("token", "kv", "head", "dim"), 16))
    config = functools.partial(jaxattn.PagedDecodeConfig.for_format, head_dim=128, batch=64,
                               num_kv_heads=8, max_context=8192, page_size=16)  # fmt: skip
    assert (config(ours).query_rows, config(ppl).query_rows) == (8, 16)
    assert config(ppl, head_dim=64).query_rows == 8


def test_decode_pads_query_rows_as_configured():
    """The kernel's logits are `[rows, block_kv]`, rows = max(query_rows, the kv group's
    query heads) (the kernel's results at 4, 8 and 16 rows: the oracle tests); query_rows
    other than 4, 8 or 16 is refused."""
    q = jnp.zeros((1, NUM_Q_HEADS, 32), jnp.float32)
    tables, lens = jnp.arange(4, dtype=jnp.int32)[None], jnp.asarray([20], jnp.int32)
    for num_kv_heads, query_rows, want in ((2, 4, 4), (2, 8, 8), (2, 16, 16), (1, 4, 8)):
        cache = jaxattn.PagedKVCache.create(4, 8, num_kv_heads, 32, dtype=jnp.float32)
        config = jaxattn.PagedDecodeConfig(16, 1, query_rows=query_rows)
        decode = functools.partial(jaxattn.paged_decode, implementation="pallas", config=config)
        text = str(jax.make_jaxpr(decode)(q, cache, tables, lens))
        assert set(re.findall(r"f32\[(\d+),16\] = dot_general", text)) == {str(want)}
    with pytest.raises(ValueError, match="query_rows=2 not 4, 8 or 16"):
        jaxattn.PagedDecodeConfig(query_rows=2)


def test_decode_hands_the_heuristic_the_group_size(monkeypatch):
    """The op hands the heuristic the cache's group size, whether V is read as words, the
    head dim and the query heads a kv head serves: on a GPU of as many SMs as programs,
    INT8 in groups of 8 gets 64-token blocks in 2 warps, FP8 in groups of 32 4 stages,
    INT8 with one group a row (not per tensor) 3 stages; at head dim 32 (no words) that
    one 64-token blocks in 2 warps; INT4 in groups of 16 at head dim 64 (two a half row)
    stacked rows, 4 of them, at head dim 128 not."""
    import jaxattn.decode as decode
    import pallas_kernels.paged_decode.config as decode_config

    configs = []

    class Chosen(Exception):  # the spy stops the call once the tiling is chosen
        pass

    def spy(*args, config, **kw):
        configs.append(config)
        raise Chosen

    monkeypatch.setattr(decode, "_paged_decode_kernel", spy)
    monkeypatch.setattr(decode_config, "device_sm_count", lambda default: 2)  # 1 x 2 programs
    rng = util.rng_for("group-size-tiling")
    page, num_pages = 8, 4
    tables, lens = jnp.arange(num_pages, dtype=jnp.int32)[None], jnp.asarray([20], jnp.int32)
    for dtype, group_size, d, want in (  # d <= 64: the small heads' tiling
        ("int8", 8, 128, (64, 2, 3, 8, False)),
        ("float8_e4m3fn", 32, 128, (128, 4, 4, 16, False)),
        ("int8", None, 128, (128, 4, 3, 16, False)),
        ("int8", None, 32, (64, 2, 3, 8, False)),
        ("int4", 16, 64, (64, 2, 3, 8, False)),
        ("int4", 32, 128, (128, 4, 3, 4, True)),
        ("int4", 16, 128, (128, 4, 3, 4, False)),  # K read as half-words
    ):
        q = util.randn(rng, (1, NUM_Q_HEADS, d), "float32")
        quant = jaxattn.KVQuant(dtype, "group", group_size)
        cache = jaxattn.PagedKVCache.create(num_pages, page, 2, d, quant=quant)
        with pytest.raises(Chosen):
            jaxattn.paged_decode(q, cache, tables, lens, implementation="pallas")
        got = configs[-1]
        fields = (got.block_kv, got.num_warps, got.num_stages, got.query_rows, got.stacked)
        assert fields == want, (quant, got)


@pytest.mark.parametrize(
    "window, has_new, want",
    [  # rows of 100, 1000 and 0 tokens, blocks of 16, 4 splits: [start, end) per split
        (None, False, [[(0, 7), (7, 7), (7, 7), (7, 7)],
                       [(0, 16), (16, 32), (32, 48), (48, 63)], [(0, 0)] * 4]),
        (200, True, [[(0, 4), (4, 7), (7, 7), (7, 7)],
                     [(50, 54), (54, 58), (58, 62), (62, 63)], [(0, 0)] * 4]),
    ],
)  # fmt: skip
def test_split_chunks_have_one_length_across_the_batch(window, has_new, want):
    """Split-K chunks are the longest visible span over the splits for every row: a short
    row of a ragged batch keeps fewer splits busy (not as many shorter ones), and each
    row's splits cover its visible blocks once, in order."""
    from pallas_kernels.paged_decode.kernel import split_blocks, visible_blocks

    spans = functools.partial(visible_blocks, window=window, has_new=has_new, block_kv=16)
    ctx_all = jnp.asarray([100, 1000, 0], jnp.int32)
    got = [
        [tuple(int(x) for x in split_blocks(spans, ctx, ctx_all, s, 4)[1:]) for s in range(4)]
        for ctx in ctx_all
    ]
    assert got == want


QUANTS = [
    jaxattn.KVQuant(dtype, granularity, group_size)
    for dtype in ("int8", "float8_e4m3fn", "int4")
    for granularity, group_size in (("tensor", None), ("group", None), ("group", 8))
] + [jaxattn.KVQuant("int4", "group", _head_dim() // 2)]  # a scale per INT4 part's row


@impls
@pytest.mark.parametrize("dtype", _dtypes())
@pytest.mark.parametrize("quant", QUANTS, ids=str)
def test_quantized_decode_vs_oracle(quant, dtype, impl):
    """Dequantized in-kernel: equals the float64 oracle run on the dequantized cache (the
    values `gather_kv` returns), with split-K off and on. Every slot no sequence owns holds
    large garbage, so reading one shows. The 80-token row runs two sink blocks, then three
    window blocks (two a split): loads issued a step ahead cross steps and loops."""
    _quantized_decode_vs_oracle(quant, dtype, impl, _head_dim())


@pytest.mark.parametrize(
    "quant, head_dim",
    [(jaxattn.KVQuant("int4", "group", 40), 80), (jaxattn.KVQuant("int8", "group", 8), 80),
     (jaxattn.KVQuant("int4", "group", 8), 80), (jaxattn.KVQuant("int4", "group", 16), 96),
     (jaxattn.KVQuant("float8_e4m3fn", "group", 32), 96),
     (jaxattn.KVQuant("int8", "group", 24), 96), (jaxattn.KVQuant("int4", "group", 4), 16),
     (jaxattn.KVQuant("int8"), 96), (jaxattn.KVQuant("int4", "group", None), 96),
     (jaxattn.KVQuant("int4", "group", 32), 96),
     (jaxattn.KVQuant("float8_e4m3fn", "group", 16), 112)],
    ids=str,
)  # fmt: skip
def test_quantized_decode_odd_head_dim(quant, head_dim):
    """Head dims 80, 96 and 112, no power of two, read in segments (96 = 64 + 32; INT4
    halves of 40 = 32 + 8, the 8 padded to 16; 112 = 64 + 32 + 16) and, in a run of their
    own, as one tile padded to a power of two: INT4 halves of 40 channels, each with its
    own scale (factored); per tensor and one scale a row; groups of 8, 16, 32 whose scales
    load as one vector a tile, padded to the dot's width without segments (INT8 at D 80:
    10 groups of a 128-wide tile, 16 loaded; INT4 halves of 40: 5 of 8; INT4 halves of 8
    at D 16, padded to 16: 2 of 4; in segments INT4's 8 channels: 1 of 2); groups that
    tile no segment (INT4 groups of 32 in halves of 48) read unsegmented; groups of 24 (no
    divisor of the padded width), a scale per element, unsegmented."""
    _quantized_decode_vs_oracle(quant, "float32", "pallas", head_dim)


@pytest.mark.parametrize(
    "quant, head_dim",
    [(jaxattn.KVQuant("int4", "group", 48), 96), (jaxattn.KVQuant("int8", "group", 8), 80)],
    ids=str,
)  # fmt: skip
def test_quantized_decode_odd_head_dim_bf16(quant, head_dim):
    """bf16 queries, read in segments: INT4 with a scale a half row reads its keys biased
    (`n + 136`, the kernel's `biased_keys`), and `136 * sum(q)` of each segment's query
    tile comes off that tile's logits; INT8 groups of 8 dequantize in bf16."""
    _quantized_decode_vs_oracle(quant, "bfloat16", "pallas", head_dim)


def test_column_segments():
    """Power-of-two runs, widest first, what is left below 16 the last (padded to 16 for its
    dot); one run where segments would pad as much; tiles in `read_kv`'s order (segments
    outer, INT4's halves inner); segments where the scales allow, not for float pools nor
    8-bit groups of 32, nor factored scales over three segments (D112)."""
    from pallas_kernels.cache_read import CacheFormat, column_segments, dot_columns
    from pallas_kernels.common import dot_width

    want = {80: ((0, 64), (64, 16)), 96: ((0, 64), (64, 32)), 112: ((0, 64), (64, 32), (96, 16)),
            40: ((0, 32), (32, 8)), 192: ((0, 128), (128, 64)), 128: ((0, 128),),
            24: ((0, 24),), 8: ((0, 8),)}  # fmt: skip
    for width, runs in want.items():
        assert column_segments(width) == runs, width
    for width in range(1, 600):  # every channel once, in order, widest first
        runs = column_segments(width)
        widths = [w for _, w in runs]
        assert [s for s, _ in runs] == list(np.cumsum([0] + widths[:-1]))
        assert sum(widths) == width and widths == sorted(widths, reverse=True)
        assert all(w & (w - 1) == 0 and w >= 16 for w in widths[:-1]), width
        if len(runs) > 1:  # only where the dots then span fewer columns
            assert sum(dot_width(w) for w in widths) < dot_width(width), width
    int4 = CacheFormat("int4", "group", 16)
    assert dot_columns(int4, 96, True) == ((0, 32), (48, 32), (32, 16), (80, 16))
    assert dot_columns(int4, 96) == ((0, 48), (48, 48))
    cases = {("int8", "tensor", 0, 96): True, ("int8", "group", 8, 80): True,
             ("int8", "group", 32, 96): False, ("int8", "group", 24, 96): False,
             ("int4", "group", 16, 96): True, ("int4", "group", 32, 96): False,
             ("int4", "group", 48, 96): True, ("float8_e4m3fn", "group", 0, 112): False,
             ("int8", "tensor", 0, 112): False, ("int8", "group", 8, 112): True,
             ("int8", "tensor", 0, 192): True,
             (None, "tensor", 0, 96): False, ("int8", "tensor", 0, 128): False}  # fmt: skip
    for (code, granularity, group, d), want_segments in cases.items():
        fmt = CacheFormat(code, granularity, group)
        assert reads_segments(fmt, d) == want_segments, (fmt, d)
    for d in range(16, 260, 4):  # where segments apply, every tile holds whole groups
        for group in (g for g in range(4, d, 4) if d % g == 0):
            for code in ("int8", "int4"):
                fmt = CacheFormat(code, "group", group)
                if reads_segments(fmt, d) and not fmt.factored(d):
                    assert all(w % group == 0 for _, w in dot_columns(fmt, d, True)), (fmt, d)


@pytest.mark.parametrize(
    "quant",
    [jaxattn.KVQuant("int8"), jaxattn.KVQuant("int8", "group", 8),
     jaxattn.KVQuant("float8_e4m3fn", "group", 16),
     jaxattn.KVQuant("float8_e4m3fn", "group", None), jaxattn.KVQuant("int4"),
     jaxattn.KVQuant("int4", "group", 8), jaxattn.KVQuant("int4", "group", 16),
     jaxattn.KVQuant("int4", "group", 32), jaxattn.KVQuant("int4", "group", None)],
    ids=str,
)  # fmt: skip
def test_quantized_decode_v_words(quant):
    """Head dim 64: V read as words (8-bit codes: int32 words; INT4: int16 half-words;
    parts of 16 strided channels each, the group scales spread over them or, with stacked
    rows, applied to logits and probabilities: INT4 groups of 16 are two a half row, as
    groups of 32 at D 128; INT4 groups of 32 are one a half row, factored), with and
    without splits (on a GPU also as codes; on CPU the codes path runs in the default head
    dim's cases, 32, where words do not apply; INT4 also with K read as half-words). The
    words path runs when asked: the kernel then takes the V pool as words, and with
    `k_words` the INT4 K pool too."""
    scales = dict(k_scale=1.0, v_scale=1.0) if quant.granularity == "tensor" else {}
    cache = jaxattn.PagedKVCache.create(4, 8, 2, 64, quant=quant, **scales)
    q = jnp.zeros((1, NUM_Q_HEADS, 64), jnp.float32)
    tables, lens = jnp.arange(4, dtype=jnp.int32)[None], jnp.asarray([20], jnp.int32)
    word = "int16" if quant.dtype == "int4" else "int32"
    k_words = quant.dtype == "int4"
    for v_words, k, views in ((True, False, 1), (False, False, 0), (True, True, 1 + k_words)):
        config = jaxattn.PagedDecodeConfig(16, 1, v_words=v_words, k_words=k)
        decode = functools.partial(jaxattn.paged_decode, implementation="pallas", config=config)
        text = str(jax.make_jaxpr(decode)(q, cache, tables, lens))
        assert text.count(f"bitcast_convert_type[new_dtype={word}") == views, (v_words, k)
    _quantized_decode_vs_oracle(quant, "float32", "pallas", 64)


def test_int4_keys_as_words_biased():
    """INT4 with one scale a row, bf16 queries, K read as half-words: the keys are read
    biased (`n + INT4_BIAS`, the bias times the sum of the query row taken off the
    logits), against the float64 oracle."""
    _quantized_decode_vs_oracle(jaxattn.KVQuant("int4", "group", None), "bfloat16", "pallas", 64)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize(
    "quant", [jaxattn.KVQuant("int4", "group", 16), jaxattn.KVQuant("int8", "group", 8)], ids=str
)
def test_stacked_rows_low_precision_soft_cap(quant, dtype):
    """Stacked rows (head dim 64: INT4 groups of 16 are two a half row) with bf16 queries
    (INT4 keys read biased) and float16 ones, and soft-capped logits."""
    assert stacks(cache_format(jaxattn.PagedKVCache.create(4, 8, 2, 64, quant=quant)), 64)
    _quantized_decode_vs_oracle(quant, dtype, "pallas", 64, soft_cap=30.0)


@pytest.mark.skipif(not util.ON_GPU, reason="128-token blocks at D 128: slow in interpret mode")
@pytest.mark.parametrize(
    "quant",
    [jaxattn.KVQuant("int4", "group", 32), jaxattn.KVQuant("int4", "group", 64),
     jaxattn.KVQuant("int4", "group", None), jaxattn.KVQuant("int8", "group", 8)],
    ids=str,
)  # fmt: skip
@pytest.mark.every_case
def test_quantized_decode_shipped_tiling(quant):
    """The tiling the heuristic picks at head dim 128 (128-token blocks, V read as words,
    query rows padded to 8; INT4 groups of 32: stacked rows, 4) against the float64
    oracle, bf16 queries."""
    config = jaxattn.PagedDecodeConfig.heuristic(
        6, 2, 80, 8, code=quant.dtype, group_size=quant.group_size or 0,
        row_scales=quant.group_size is None, head_dim=128, query_group=NUM_Q_HEADS // 2,
    )  # fmt: skip
    stacked = quant == jaxattn.KVQuant("int4", "group", 32)
    assert (config.query_rows, config.stacked) == ((4, True) if stacked else (8, False))
    _quantized_decode_vs_oracle(quant, "bfloat16", "pallas", 128, heuristic=True)


@pytest.mark.skipif(
    not util.ON_GPU,
    reason="XLA:CPU expands the word view of the V pool into a copy (interpret mode only)",
)
@pytest.mark.parametrize(
    "quant", [jaxattn.KVQuant("int8", "group", 8), jaxattn.KVQuant("int4", "group", 8)], ids=str
)
@pytest.mark.every_case
def test_v_words_view_is_no_copy(quant):
    """On the GPU the word view of a V pool (int32 of 8-bit codes, int16 of INT4 bytes) is
    a bitcast: the compiled decode call holds no temporary near the pool's size."""
    d, page, num_pages, batch = 128, 16, 512, 4
    cache = jaxattn.PagedKVCache.create(num_pages, page, 2, d, quant=quant)
    q = jnp.zeros((batch, NUM_Q_HEADS, d), jnp.bfloat16)
    tables = jnp.arange(num_pages, dtype=jnp.int32).reshape(batch, -1)
    lens = jnp.full((batch,), num_pages // batch * page, jnp.int32)
    config = jaxattn.PagedDecodeConfig(64, 2, 2, 3, v_words=True)
    decode = functools.partial(jaxattn.paged_decode, implementation="pallas", config=config)
    compiled = jax.jit(decode).lower(q, cache, tables, lens).compile()
    assert compiled.memory_analysis().temp_size_in_bytes < cache.v_pages.nbytes // 4


def _quantized_decode_vs_oracle(quant, dtype, impl, d, heuristic=False, soft_cap=None):
    """`heuristic`: one run, the tiling `paged_decode` picks (else fixed tilings below).
    A row of no tokens gives zeros."""
    rng = util.rng_for("quant-decode", str(quant), dtype, d, soft_cap)
    page, max_pages, hkv, num_pages = 8, 10, 2, 80
    lengths = np.array([1, 8, 9, 48, 30, 0, 80])
    batch = len(lengths)
    tables = rng.permutation(num_pages)[: batch * max_pages].reshape(batch, max_pages)
    scales = dict(k_scale=0.03, v_scale=0.025) if quant.granularity == "tensor" else {}
    cache = jaxattn.PagedKVCache.create(num_pages, page, hkv, d, quant=quant, **scales)
    garbage = util.randn(rng, (num_pages * page, hkv, d), scale=50.0)
    # Under jit (here and below): eager calls compile op by op.
    write = jax.jit(jaxattn.write_kv, compiler_options=util.FAST_COMPILE)
    cache = write(cache, garbage, -garbage, jnp.arange(num_pages * page))
    slots = np.concatenate([tables[b, np.arange(n) // page] * page + np.arange(n) % page
                            for b, n in enumerate(lengths)])  # fmt: skip
    k, v = (util.randn(rng, (len(slots), hkv, d)) for _ in range(2))
    cache = write(cache, k, v, jnp.asarray(slots, jnp.int32))
    q = util.randn(rng, (batch, NUM_Q_HEADS, d), dtype)
    tables, lens = jnp.asarray(tables, jnp.int32), jnp.asarray(lengths, jnp.int32)
    # The oracle's K/V: the dequantized history, rounded to q's dtype as the kernel does.
    k_hist, v_hist = jax.jit(
        jaxattn.gather_kv, static_argnums=3, compiler_options=util.FAST_COMPILE
    )(cache, tables, lens, max_pages * page)
    k_hist, v_hist = (util.f64(x.astype(dtype)) for x in (k_hist, v_hist))
    options = dict(window=40, sink_tokens=18, alibi_slopes=jaxattn.alibi_slopes(NUM_Q_HEADS),
                   soft_cap=soft_cap)  # fmt: skip
    oracle = functools.partial(
        attention_oracle, util.f64(q)[:, None], k_hist, v_hist, causal=True,
        q_lengths=np.ones(batch, int), kv_lengths=lengths,
        **{**options, "alibi_slopes": np.float64(options["alibi_slopes"])},
    )  # fmt: skip
    want = oracle()[0][:, 0]
    lowp = None if dtype == "float32" else oracle(lowp=jnp.dtype(dtype))[0][:, 0]
    # On a GPU the codes path runs again where words apply (on CPU it runs in the cases at
    # the default head dim, 32, where they do not); xla: one run.
    fmt = cache_format(cache)
    # (splits, V read as words where the format allows, query rows, stacked rows: where
    # the format allows, `paged_decode.stacked`; INT4 K read as words, where V is; rows
    # read in segments, where the head dim and format allow: `cache_read.reads_segments`)
    runs = [(1, True, 16, False, False, True), (2, True, 8, False, False, True)]
    runs += [(2, True, 4, True, False, True)] * stacks(fmt, d)
    runs += [(2, False, 4, False, False, True)] * (reads_v_words(fmt, d) and util.ON_GPU)
    runs += [(3, True, 8, False, True, True)] * (fmt.dtype == "int4" and reads_v_words(fmt, d))
    runs += [(2, True, 8, False, False, False)] * reads_segments(fmt, d)
    configs = [
        jaxattn.PagedDecodeConfig(
            16, n, v_words=w, query_rows=r, stacked=st, k_words=kw, segments=sg
        )
        for n, w, r, st, kw, sg in runs
    ]
    for config in [None] if impl != "pallas" or heuristic else configs:
        out = util.jit_call(jaxattn.paged_decode, q, cache, tables, lens,
                            static=dict(implementation=impl, config=config, window=40,
                                        sink_tokens=18, soft_cap=soft_cap),
                            alibi_slopes=options["alibi_slopes"])  # fmt: skip
        util.assert_out_close(out, want, dtype, lowp_ref=lowp, what=f"{quant} {config}")


def test_combine_splits_vs_numpy():
    """The split-K merge on its own: empty splits (lse -inf) weigh nothing, a head whose
    every split is empty gives zeros and -inf, and S need not be a power of two."""
    from pallas_kernels.common import use_interpret
    from pallas_kernels.paged_decode.combine import combine_splits

    rng = np.random.default_rng(7)
    o_part = rng.standard_normal((2, 3, 5, 40)).astype(np.float32)
    lse_part = (3 * rng.standard_normal((2, 3, 5))).astype(np.float32)
    lse_part[0, 1, [0, 3]] = -np.inf
    lse_part[1, 2, :] = -np.inf
    out, lse = combine_splits(
        jnp.asarray(o_part), jnp.asarray(lse_part), dtype=jnp.float32, interpret=use_interpret()
    )
    with np.errstate(invalid="ignore"):  # the all-empty head: -inf - -inf
        w = np.exp(lse_part.astype(np.float64) - lse_part.max(-1, keepdims=True))
    w[1, 2] = 0.0
    total = w.sum(-1)
    want = np.einsum("bhs,bhsd->bhd", w, o_part) / np.where(total > 0, total, 1)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        want_lse = np.where(total > 0, lse_part.max(-1) + np.log(total), -np.inf)
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(out)[1, 2] == 0) and np.asarray(lse)[1, 2] == -np.inf


WRITE_CASES = [
    Case("gqa4", lengths=(1, 8, 9, 48, 0)),
    Case("window_sinks_alibi_softcap", lengths=(30, 48, 4, 2), window=9, sink_tokens=3,
         alibi=True, soft_cap=3.0, scale=0.3),
    Case("mqa_pages16", lengths=(16, 33, 17), num_kv_heads=1, page_size=16, max_pages=3),
]  # fmt: skip


ROPES = {"no_rope": None, "gptj_partial": jaxattn.RoPE(theta=50.0, style="gptj", rotary_dim=16)}


def _write_runs():
    """case x splits x rope on a GPU; in interpret mode pairwise (6 of the 12): the 1st
    and 3rd cases run (1 split, no rope) and (3, gptj), the 2nd (1, gptj) and (3, no
    rope): each case with both split counts and both ropes, every (splits, rope) pair."""
    runs = [(c, n, r) for c in WRITE_CASES for n in (1, 3) for r in ROPES]
    if not util.ON_GPU:
        runs = [(c, n, r) for c, n, r in runs
                if (n == 3) ^ (r == "no_rope") ^ (WRITE_CASES.index(c) % 2 == 1)]  # fmt: skip
    return [pytest.param(c, n, ROPES[r], id=f"{c}-{n}-{r}") for c, n, r in runs]


@pytest.mark.parametrize("case, splits, rope", _write_runs())
def test_kernel_writes_the_new_token(case, splits, rope):
    """`new_kv`: each row's last token comes as an input (its slot in the pools still
    poisoned), is attended from there (k rotated as q) and stored at its slot; a real row
    with slot -1 and one with a slot past the pools attend but store nothing; every other
    slot keeps its bits."""
    from paged_oracle import rope_np

    from jaxattn.rope import token_rotations
    from pallas_kernels.common import use_interpret
    from pallas_kernels.paged_decode import DecodeParams, paged_decode

    q, cache, tables, lengths, k_hist, v_hist = _build(case, "float32", 2)
    batch, page, hkv, d = len(case.lengths), case.page_size, case.num_kv_heads, _head_dim()
    num_pages = cache.k_pages.shape[0]
    last = np.maximum(np.asarray(case.lengths) - 1, 0)
    live = np.asarray(case.lengths) > 0
    slots = np.where(live, np.asarray(tables)[np.arange(batch), last // page] * page + last % page,
                     -1)  # fmt: skip
    k_pool, v_pool = (np.array(x) for x in (cache.k_pages, cache.v_pages))
    for b in np.flatnonzero(live):  # the new token is not in the pools yet
        for pool in (k_pool, v_pool):
            pool[slots[b] // page, :, slots[b] % page] = np.nan
    stored = slots.copy()
    live_rows = np.flatnonzero(live)
    stored[live_rows[0]] = -1  # attended, not stored
    if len(live_rows) > 1:
        stored[live_rows[1]] = num_pages * page  # past the pools: dropped
    k_new, v_new = k_hist[np.arange(batch), last], v_hist[np.arange(batch), last]  # [B, Hkv, D]
    positions = last
    q_rope = None
    q64 = util.f64(q)
    if rope is not None:
        rot = token_rotations(jnp.asarray(positions), rope, d)
        q_rope = (rot.cos, rot.sin, rot.partner)
        q64 = rope_np(q64, positions, rope)
        k_hist = k_hist.copy()
        k_hist[np.arange(batch), last] = rope_np(k_new, positions, rope)
    opts = _options(case)
    params = DecodeParams(window=case.window, sink_tokens=case.sink_tokens,
                          soft_cap=case.soft_cap, scale=case.scale or d**-0.5)  # fmt: skip
    rows = 16 if splits == 1 else 4  # query rows: 16, or the group's own 4 (mqa: 8)
    config = jaxattn.PagedDecodeConfig(16, splits, query_rows=rows)
    out, lse, k_after, v_after = jax.jit(
        functools.partial(paged_decode, params=params, interpret=use_interpret(), config=config),
        compiler_options=util.FAST_COMPILE,
    )(
        q, jnp.asarray(k_pool), jnp.asarray(v_pool), tables, lengths,
        alibi_slopes=opts["alibi_slopes"], q_rope=q_rope,
        new_kv=(jnp.asarray(k_new, jnp.float32), jnp.asarray(v_new, jnp.float32),
                jnp.asarray(stored, jnp.int32)),
    )  # fmt: skip
    want, want_lse = _oracle(case, q64, k_hist, v_hist)
    util.assert_out_close(out, want, "float32", what=f"out ({splits} splits)")
    util.assert_lse_close(lse, want_lse, "float32")
    util.assert_zero_rows(out, ~live[:, None, None], "idle rows")
    written = stored[(stored >= 0) & (stored < num_pages * page)]
    pools = (("k", k_pool, k_after, k_hist), ("v", v_pool, v_after, v_hist))
    for name, before, after, hist in pools:
        rows_before, rows_after = (np.asarray(x).transpose(0, 2, 1, 3).reshape(-1, hkv, d)
                                   for x in (before, after))  # fmt: skip
        others = np.setdiff1d(np.arange(num_pages * page), written)
        np.testing.assert_array_equal(util.bits(rows_after[others]), util.bits(rows_before[others]),
                                      f"{name}: a slot not written changed")  # fmt: skip
        tol = 1e-5 if name == "k" and rope is not None else 0.0  # float32 rotation
        for b in np.flatnonzero(np.isin(stored, written)):
            np.testing.assert_allclose(rows_after[stored[b]], hist[b, last[b]], rtol=tol,
                                       atol=tol, err_msg=f"{name}: row {b}'s token")  # fmt: skip


def test_decode_after_write_kv_matches_gather_reference():
    """The serving path: tokens written with write_kv, decode equals the reference on
    gather_kv of the same cache."""
    rng = util.rng_for("write_then_decode")
    page, max_pages, hkv, d = 8, 4, 2, _head_dim()
    lengths = np.array([3, 32, 17])
    tables = rng.permutation(20)[: 3 * max_pages].reshape(3, max_pages)
    slots = np.concatenate([tables[b, np.arange(n) // page] * page + np.arange(n) % page
                            for b, n in enumerate(lengths)])  # fmt: skip
    cache = jaxattn.PagedKVCache.create(20, page, hkv, d, dtype=jnp.float32)
    k = util.randn(rng, (len(slots), hkv, d))
    v = util.randn(rng, (len(slots), hkv, d))
    cache = jaxattn.write_kv(cache, k, v, jnp.asarray(slots, jnp.int32))
    q = util.randn(rng, (3, NUM_Q_HEADS, d))
    tables, lengths = jnp.asarray(tables, jnp.int32), jnp.asarray(lengths, jnp.int32)
    ref = jaxattn.paged_decode_reference(q, cache, tables, lengths)
    out = jaxattn.paged_decode(q, cache, tables, lengths, implementation="pallas")
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=2e-5, atol=2e-5)


def test_contiguous_cache_is_the_same_kernel():
    rng = util.rng_for("contiguous")
    b, hkv, s, d = 2, 2, 40, _head_dim()
    k, v = util.randn(rng, (b, hkv, s, d)), util.randn(rng, (b, hkv, s, d))
    cache, tables = jaxattn.contiguous_kv_cache(k, v)
    q = util.randn(rng, (b, NUM_Q_HEADS, d))
    lengths = jnp.array([40, 11], jnp.int32)
    out = jaxattn.paged_decode(q, cache, tables, lengths, implementation="pallas")
    k_dense, v_dense = (jnp.swapaxes(x, 1, 2) for x in (k, v))  # [B, S, Hkv, D]
    want, _ = attention_oracle(
        util.f64(q)[:, None], util.f64(k_dense), util.f64(v_dense), causal=True,
        q_lengths=np.ones(b, int), kv_lengths=np.asarray(lengths),
    )  # fmt: skip
    util.assert_out_close(out, want[:, 0], "float32")


def test_validate_page_table_reports_each_problem():
    """Each flag on its row; lengths judged in their own dtype (an int64 or uint32
    length past int32 is past capacity, not wrapped into it), narrow ones (int8, int16,
    uint8) alike."""
    cache = jaxattn.PagedKVCache.create(10, 4, 1, 8, dtype=jnp.float32)
    tables = jnp.array([[0, 1, 2], [3, 4, 11], [5, 5, 6]], jnp.int32)
    report = jaxattn.validate_page_table(cache, tables, jnp.array([13, 9, 6], jnp.int32))
    assert report["length_in_capacity"].tolist() == [False, True, True]
    assert report["pages_in_range"].tolist() == [True, False, True]
    assert report["pages_exclusive"].tolist() == [True, True, False]
    fine = jaxattn.validate_page_table(cache, tables, jnp.array([12, 8, 4], jnp.int32))
    assert all(bool(v.all()) for v in fine.values())
    for narrow in (jnp.int8, jnp.int16, jnp.uint8):  # bounds past the dtype do not wrap
        report = jaxattn.validate_page_table(cache, tables, jnp.array([13, 9, 6], narrow))
        assert report["length_in_capacity"].tolist() == [False, True, True], narrow
        assert report["pages_in_range"].tolist() == [True, False, True], narrow
        assert report["pages_exclusive"].tolist() == [True, True, False], narrow
    report = jaxattn.validate_page_table(cache, tables, jnp.array([2**31 + 4, 1, 1], jnp.uint32))
    assert report["length_in_capacity"].tolist() == [False, True, True]
    assert report["pages_in_range"].tolist() == [True, True, True]
    jax.config.update("jax_enable_x64", True)
    try:
        lens = jnp.asarray(np.array([2**32 + 4, -(2**32) + 4, 4], np.int64))  # 4 as int32
        report = jaxattn.validate_page_table(cache, tables, lens)
    finally:
        jax.config.update("jax_enable_x64", False)
    assert report["length_in_capacity"].tolist() == [False, False, True]
    assert report["pages_exclusive"].tolist() == [True, True, True]  # row 0: every page


def test_validate_page_table_reports_bad_indirection():
    """Two requests of W = 2 beams (rows 0-1, 2-3): beam ids out of [0, W) among the
    tokens a row reads, and a token read from a beam too short to hold it (a token t from
    a beam of exactly t tokens included), are flagged on the reading row; the same values
    past the row's length (never read) are not; a source is the beam the kernels read,
    the id clamped into the request's beams; under jit too."""
    cache = jaxattn.PagedKVCache.create(16, 4, 1, 8, dtype=jnp.float32)
    tables = jnp.arange(16, dtype=jnp.int32).reshape(4, 4)
    check = jax.jit(jaxattn.validate_page_table)
    lens = jnp.array([6, 6, 5, 4], jnp.int32)
    ind = np.zeros((2, 2, 8), np.int32)
    ind[0, 0, 3] = -1  # row 0 reads token 3 from beam -1 (beam 0 as clamped)
    ind[0, 1, 2] = 2  # row 1 reads token 2 from beam 2 (beam 1 as clamped)
    ind[0, 0, 7] = ind[0, 1, 6] = -5  # past rows 0 and 1's 6 tokens: never read
    ind[1, 0, 4] = 1  # row 2 reads token 4 from row 3, which holds 4 tokens
    ind[1, 1, 4:] = 5  # row 3 holds 4 tokens: entries 4.. are never read
    report = check(cache, tables, lens, jnp.asarray(ind))
    assert report["indirection_in_range"].tolist() == [False, False, True, True]
    assert report["indirection_sources_hold"].tolist() == [True, True, False, True]
    ind = np.zeros((2, 2, 8), np.int32)
    ind[0, 0, 3] = 9  # clamped: beam 1, row 1 of 2 tokens (unclamped, no such row)
    report = check(cache, tables, jnp.array([6, 2, 6, 6], jnp.int32), jnp.asarray(ind))
    assert report["indirection_in_range"].tolist() == [False, True, True, True]
    assert report["indirection_sources_hold"].tolist() == [False, True, True, True]
    ind = jnp.zeros((2, 2, 8), jnp.int32)
    fine = check(cache, tables, jnp.array([6, 6, 3, 3], jnp.int32), ind)
    assert set(fine) > {"indirection_in_range", "pages_exclusive"}
    assert all(bool(v.all()) for v in fine.values())
    for bad in ((3, 2, 8), (4, 8), (2, 2, 0)):
        with pytest.raises(ValueError, match=re.escape(f"cache_indirection.shape={bad}")):
            jaxattn.validate_page_table(cache, tables, lens, jnp.zeros(bad, jnp.int32))
    with pytest.raises(ValueError, match=r"cache_indirection\.dtype"):
        jaxattn.validate_page_table(cache, tables, lens, ind.astype(jnp.float32))
    jax.config.update("jax_enable_x64", True)  # an int64 id judged before any int32 cast
    try:
        wide = np.zeros((2, 2, 8), np.int64)
        wide[0, 1, 2] = 2**32 + 1  # 1 once cast to int32
        report = jaxattn.validate_page_table(cache, tables, lens, jnp.asarray(wide))
    finally:
        jax.config.update("jax_enable_x64", False)
    assert report["indirection_in_range"].tolist() == [True, False, True, True]


BAD = {
    "rank": (lambda q, c, t, n: (q[0], c, t, n), r"q\.shape"),
    "head_dim": (lambda q, c, t, n: (q[..., :4], c, t, n), r"head_dim"),
    "heads": (lambda q, c, t, n: (q[:, :3], c, t, n), r"multiple of num_kv_heads"),
    "dtype": (lambda q, c, t, n: (q.astype(jnp.bfloat16), c, t, n), r"dtype"),
    "tables": (lambda q, c, t, n: (q, c, t[:1], n), r"block_tables\.shape"),
    "no_pages": (lambda q, c, t, n: (q, c, t[:, :0], n * 0), r"block_tables\.shape"),
    "lengths": (lambda q, c, t, n: (q, c, t, n[:1]), r"context_lens\.shape"),
}


@pytest.mark.parametrize("name", BAD)
@pytest.mark.every_case
def test_bad_input_raises_at_trace_time(name):
    case = Case("bad", lengths=(3, 9))
    q, cache, tables, lengths, *_ = _build(case, "float32", 2)
    make, match = BAD[name]
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(lambda *a: jaxattn.paged_decode(*make(*a)), q, cache, tables, lengths)
