"""The shared case table of the context-phase ops and the machinery to run one case.

A case names shapes and options; `build_*` turns it into fresh random inputs (seeded from
the case name), `run_*` calls one implementation on inputs whose padding is poisoned and
checks it against the float64 oracle computed on the clean inputs:
  - out within the dtype's tolerance (util.assert_out_close),
  - rows with no visible key (padding rows included) exactly 0,
  - lse -inf exactly there, close elsewhere.
`impl` is "xla" / "pallas" (through `jaxattn.attention` / `ragged_attention`), a list of
them, or "reference" (`jaxattn.attention_reference` / `ragged_attention_reference`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import util
from oracle import attention_oracle, ragged_attention_oracle

import jaxattn


@dataclasses.dataclass(frozen=True)
class Options:
    """Attention options shared by dense and packed cases (CPU token counts)."""

    hq: int = 4
    hkv: int = 2
    head_dim: int | None = None  # None: util.DEFAULT_HEAD_DIM
    causal: bool = False
    window: int | None = None
    sink_tokens: int = 0
    alibi: bool = False
    bias: tuple | None = None  # shape, with "B", "H", "Tq", "Tk" for the full sizes
    neg_inf_bias: bool = False  # some bias entries are -inf, one whole row finfo(f32).min
    mask: tuple | None = None  # shape, as bias
    rel: tuple[int, int, bool] | None = None  # T5: (num_buckets, max_distance, bidirectional)
    soft_cap: float | None = None
    scale: float | None = None
    return_lse: bool = True
    core: bool = False  # also run in float32 on a GPU
    slow: bool = False


@dataclasses.dataclass(frozen=True)
class Dense(Options):
    name: str = ""
    batch: int = 2
    tq: int = 37
    tk: int | None = None  # None: tq
    q_lengths: tuple[int, ...] | None = None
    kv_lengths: tuple[int, ...] | None = None


@dataclasses.dataclass(frozen=True)
class Packed(Options):
    name: str = ""
    q_lens: tuple[int, ...] = ()
    kv_lens: tuple[int, ...] | None = None  # None: q_lens
    q_pad: int = 5  # trailing padding rows past cu_seqlens_q[-1]
    k_pad: int = 0  # trailing key rows past cu_seqlens_k[-1]


BHQK = ("B", "H", "Tq", "Tk")
HQK = ("H", "Tq", "Tk")

DENSE = [
    Dense(name="mha", hkv=4, core=True),
    Dense(name="mha_causal", hkv=4, causal=True, core=True),
    Dense(name="gqa_causal", causal=True),
    Dense(name="mqa_causal", hkv=1, causal=True),
    Dense(name="heads6_kv3", hq=6, hkv=3, causal=True, alibi=True),
    Dense(name="len1", tq=1),
    Dense(name="len1_causal", tq=1, causal=True),
    Dense(name="odd_len_batch3", batch=3, tq=23, causal=True),
    Dense(name="cross_attention", tq=19, tk=53),
    Dense(name="chunked_causal", tq=21, tk=70, causal=True, core=True),
    Dense(name="lengths_causal", q_lengths=(30, 11), kv_lengths=(37, 25), causal=True),
    Dense(name="lengths_cross", tq=20, tk=45, q_lengths=(20, 7), kv_lengths=(13, 45)),
    Dense(
        name="lengths_0_and_1_causal",
        batch=4,
        q_lengths=(0, 1, 37, 5),
        kv_lengths=(10, 1, 0, 37),
        causal=True,
    ),
    Dense(name="lengths_0_and_1", batch=4, q_lengths=(0, 1, 37, 1), kv_lengths=(10, 0, 1, 37)),
    Dense(name="q_longer_than_kv_causal", q_lengths=(37, 30), kv_lengths=(20, 10), causal=True),
    Dense(name="window", causal=True, window=8, core=True),
    Dense(name="window_1", causal=True, window=1),
    Dense(name="window_sinks", causal=True, window=8, sink_tokens=4),
    Dense(name="window_noncausal", window=9),
    Dense(name="window_sinks_noncausal", window=5, sink_tokens=3),
    Dense(name="sinks_without_window", causal=True, sink_tokens=4),
    Dense(name="window_sinks_chunked", tq=21, tk=90, causal=True, window=17, sink_tokens=5),
    Dense(name="alibi_causal", causal=True, alibi=True, core=True),
    Dense(name="alibi_lengths", alibi=True, q_lengths=(12, 37), kv_lengths=(30, 37)),
    Dense(name="bias_full", bias=BHQK),
    Dense(name="bias_B11Tk", bias=("B", 1, 1, "Tk"), causal=True),
    Dense(name="bias_1HTqTk", bias=(1, "H", "Tq", "Tk")),
    Dense(name="bias_TqTk", bias=("Tq", "Tk"), tk=45),
    Dense(name="bias_neg_inf", bias=BHQK, neg_inf_bias=True),
    # the cap would make a -inf bias finite: it still hides its key
    Dense(name="bias_neg_inf_soft_cap", bias=BHQK, neg_inf_bias=True, soft_cap=2.0),
    Dense(name="mask_full", mask=BHQK),
    Dense(name="mask_B11Tk", mask=("B", 1, 1, "Tk")),
    Dense(name="mask_1HTqTk_causal", mask=(1, "H", "Tq", "Tk"), causal=True),
    Dense(name="bias_and_mask", bias=("B", 1, "Tq", "Tk"), mask=(1, "H", 1, "Tk")),
    Dense(name="t5_bidirectional", tq=70, rel=(32, 128, True), core=True),
    Dense(name="t5_unidirectional_causal", tq=70, rel=(32, 128, False), causal=True),
    Dense(name="t5_small_buckets", rel=(8, 20, True)),
    Dense(
        name="t5_cross_lengths",
        tq=30,
        tk=60,
        q_lengths=(30, 9),
        kv_lengths=(41, 60),
        rel=(16, 32, True),
    ),
    Dense(name="soft_cap", soft_cap=2.0, scale=0.5),
    Dense(name="scale", scale=0.3, causal=True),
    Dense(name="no_lse", causal=True, return_lse=False),
    Dense(
        name="gqa_causal_window_sinks_alibi_softcap",
        causal=True,
        window=10,
        sink_tokens=3,
        alibi=True,
        soft_cap=3.0,
        q_lengths=(37, 26),
        kv_lengths=(37, 33),
        core=True,
    ),
    Dense(
        name="mqa_bias_mask_t5_softcap_lengths",
        hkv=1,
        bias=("B", 1, "Tq", "Tk"),
        mask=BHQK,
        rel=(32, 64, True),
        soft_cap=4.0,
        q_lengths=(37, 20),
        kv_lengths=(37, 29),
    ),
    Dense(
        name="chunked_everything",
        tq=21,
        tk=60,
        causal=True,
        window=12,
        sink_tokens=2,
        alibi=True,
        bias=(1, "H", 1, "Tk"),
        mask=("B", 1, "Tq", "Tk"),
        rel=(16, 64, False),
        soft_cap=5.0,
        scale=0.2,
        q_lengths=(21, 8),
        kv_lengths=(60, 31),
    ),
    Dense(name="long_causal_lengths", tq=100, q_lengths=(100, 77), causal=True, slow=True),
    Dense(
        name="long_cross_window",
        tq=64,
        tk=100,
        window=33,
        sink_tokens=16,
        causal=True,
        alibi=True,
        slow=True,
    ),
]

PACKED = [
    Packed(name="basic_causal", q_lens=(5, 17, 1, 33), causal=True, core=True),
    Packed(name="basic", q_lens=(5, 17, 1, 33), q_pad=0),
    Packed(name="single_seq", q_lens=(29,), causal=True),
    Packed(name="lengths_1_to_150", q_lens=(1, 2, 63, 150, 7, 31), causal=True, slow=True),
    Packed(name="chunked_zero_q", q_lens=(0, 12, 0, 9), kv_lens=(5, 12, 0, 20), causal=True),
    Packed(name="zero_k", q_lens=(4, 6, 3), kv_lens=(0, 6, 9)),
    Packed(name="zero_k_causal", q_lens=(4, 6, 3), kv_lens=(0, 6, 9), causal=True),
    Packed(name="cross", q_lens=(7, 13, 2), kv_lens=(20, 5, 33), k_pad=6),
    Packed(name="q_longer_than_kv_causal", q_lens=(9, 20), kv_lens=(4, 16), causal=True),
    Packed(name="mqa_window_sinks", q_lens=(40, 3, 25), hkv=1, causal=True, window=7,
           sink_tokens=2),
    Packed(name="alibi_softcap", q_lens=(11, 30, 2), causal=True, alibi=True, soft_cap=3.0),
    Packed(name="bias_HTqTk", q_lens=(6, 14, 9), kv_lens=(10, 14, 3), bias=HQK, k_pad=3),
    Packed(name="bias_1TqTk_neg_inf", q_lens=(6, 14, 9), bias=(1, "Tq", "Tk"),
           neg_inf_bias=True),
    Packed(name="mask_HTqTk", q_lens=(6, 14, 9), mask=HQK, causal=True),
    Packed(name="mask_Tk_and_bias_H11", q_lens=(12, 8), mask=("Tk",), bias=("H", 1, 1)),
    Packed(name="t5_bidirectional", q_lens=(30, 45, 1), rel=(32, 128, True), core=True),
    Packed(name="t5_unidirectional_chunked", q_lens=(10, 21), kv_lens=(40, 30),
           rel=(32, 128, False), causal=True),
    Packed(
        name="everything", q_lens=(1, 19, 0, 44, 7), kv_lens=(1, 30, 3, 44, 9), hkv=1,
        causal=True, window=9, sink_tokens=2, alibi=True, bias=(1, "Tq", "Tk"), mask=HQK,
        rel=(16, 48, True), soft_cap=6.0, scale=0.25, k_pad=4, core=True,
    ),
    Packed(name="long_mixed", q_lens=(1, 300 - 1 - 37 - 5, 37), kv_lens=(1, 257, 37),
           causal=True, window=60, sink_tokens=4, slow=True),
    # More real tiles (24) than the kernel launches programs (a program per block_q tokens
    # plus 8): programs loop over several tiles.
    Packed(name="many_short_loop_tiles", q_lens=tuple(1 + i % 3 for i in range(24)),
           kv_lens=tuple(2 + i % 5 for i in range(24)), causal=True),
]  # fmt: skip


def params(cases, dtypes=None):
    """pytest params `(case, dtype)` with readable ids; slow cases marked."""
    out = []
    for case in cases:
        for dtype in dtypes or (util.CORE_DTYPES if case.core else util.CASE_DTYPES):
            marks = [pytest.mark.slow] if case.slow else []
            out.append(pytest.param(case, dtype, id=f"{case.name}-{dtype}", marks=marks))
    return out


# ------------------------------------------------------------------------- inputs
@dataclasses.dataclass
class Inputs:
    q: jnp.ndarray
    k: jnp.ndarray
    v: jnp.ndarray
    positional: tuple  # extra positional args (cu_seqlens for packed)
    kwargs: dict  # keyword options for the jaxattn op (without return_lse/impl/config)
    oracle_kwargs: dict
    q_pad: np.ndarray  # bool, padding query rows: [B, Tq] or [Tq_total]
    k_pad: np.ndarray  # bool, padding key rows: [B, Tk] or [Tk_total]


def _resolve(shape, sizes):
    return tuple(sizes[s] if isinstance(s, str) else s for s in shape)


def _extras(case: Options, rng, sizes, dtype, row_axis):
    """Library kwargs and oracle kwargs for the options other than lengths."""
    kw, okw = {}, {}
    for name in ("causal", "window", "sink_tokens", "soft_cap", "scale"):
        kw[name] = okw[name] = getattr(case, name)
    if case.window is not None:
        kw["window"] = okw["window"] = util.tokens(case.window)
    if case.sink_tokens:
        kw["sink_tokens"] = okw["sink_tokens"] = util.tokens(case.sink_tokens)
    if case.alibi:
        kw["alibi_slopes"] = jnp.asarray(jaxattn.alibi_slopes(case.hq))
        okw["alibi_slopes"] = util.f64(kw["alibi_slopes"])
    if case.bias is not None:
        shape = _resolve(case.bias, sizes)
        bias = rng.standard_normal(shape)
        if case.neg_inf_bias:
            bias[rng.random(shape) < 0.25] = -np.inf
            if len(shape) + row_axis >= 0 and shape[row_axis] > 2:  # a row of transformers'
                bias[(Ellipsis, 2, slice(None))] = np.finfo(np.float32).min  # mask value
        kw["bias"] = jnp.asarray(bias, jnp.float32)
        okw["bias"] = util.f64(kw["bias"])
    if case.mask is not None:
        shape = _resolve(case.mask, sizes)
        mask = rng.random(shape) < 0.75
        if len(shape) + row_axis >= 0 and shape[row_axis] > 3:
            mask[(Ellipsis, 3, slice(None))] = False  # a row that sees nothing
        kw["mask"] = jnp.asarray(mask)
        okw["mask"] = mask
    if case.rel is not None:
        num_buckets, max_distance, bidirectional = case.rel
        table = rng.standard_normal((case.hq, num_buckets)).astype(np.float32)
        kw["relative_bias"] = jaxattn.RelativeBias(jnp.asarray(table), max_distance, bidirectional)
        okw["relative_bias"] = (table, max_distance, bidirectional)
    return kw, okw


def _qkv(rng, case: Options, q_shape, k_shape, dtype):
    scale = 1.5 if case.soft_cap is not None else 1.0  # make the cap bite
    q = util.randn(rng, q_shape, dtype, scale)
    return q, util.randn(rng, k_shape, dtype, scale), util.randn(rng, k_shape, dtype)


def build_dense(case: Dense, dtype: str, head_dim: int | None = None) -> Inputs:
    rng = util.rng_for(case.name, dtype, head_dim)
    d = head_dim or case.head_dim or util.DEFAULT_HEAD_DIM
    tq = util.tokens(case.tq)
    tk = util.tokens(case.tk if case.tk is not None else case.tq)
    q, k, v = _qkv(rng, case, (case.batch, tq, case.hq, d), (case.batch, tk, case.hkv, d), dtype)
    sizes = dict(B=case.batch, H=case.hq, Tq=tq, Tk=tk)
    kw, okw = _extras(case, rng, sizes, dtype, row_axis=-2)
    q_len = tuple(map(util.tokens, case.q_lengths)) if case.q_lengths else (tq,) * case.batch
    kv_len = tuple(map(util.tokens, case.kv_lengths)) if case.kv_lengths else (tk,) * case.batch
    if case.q_lengths is not None:
        kw["q_lengths"] = jnp.asarray(q_len, jnp.int32)
    if case.kv_lengths is not None:
        kw["kv_lengths"] = jnp.asarray(kv_len, jnp.int32)
    okw.update(q_lengths=q_len, kv_lengths=kv_len)
    q_pad = np.arange(tq)[None, :] >= np.asarray(q_len)[:, None]
    k_pad = np.arange(tk)[None, :] >= np.asarray(kv_len)[:, None]
    return Inputs(q, k, v, (), kw, okw, q_pad, k_pad)


def cu_seqlens(lengths) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def build_packed(case: Packed, dtype: str, head_dim: int | None = None) -> Inputs:
    rng = util.rng_for("packed", case.name, dtype, head_dim)
    d = head_dim or case.head_dim or util.DEFAULT_HEAD_DIM
    q_lens = tuple(map(util.tokens, case.q_lens))
    kv_lens = tuple(map(util.tokens, case.kv_lens)) if case.kv_lens is not None else q_lens
    cu_q, cu_k = cu_seqlens(q_lens), cu_seqlens(kv_lens)
    tq = int(cu_q[-1]) + util.tokens(case.q_pad)
    tk = int(cu_k[-1]) + util.tokens(case.k_pad)
    q, k, v = _qkv(rng, case, (tq, case.hq, d), (tk, case.hkv, d), dtype)
    sizes = dict(H=case.hq, Tq=tq, Tk=tk)
    kw, okw = _extras(case, rng, sizes, dtype, row_axis=-2)
    positional = (jnp.asarray(cu_q), jnp.asarray(cu_k))
    okw.update(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    return Inputs(
        q, k, v, positional, kw, okw, np.arange(tq) >= cu_q[-1], np.arange(tk) >= cu_k[-1]
    )


# ------------------------------------------------------------------------- running
def poisoned(inp: Inputs, kind: str | None, dtype: str):
    """q/k/v with every padding row (beyond lengths / past cu_seqlens[-1]) overwritten."""
    if kind is None:
        return inp.q, inp.k, inp.v
    value = util.poison_value(dtype, kind)
    qm = jnp.asarray(inp.q_pad)[..., None, None]
    km = jnp.asarray(inp.k_pad)[..., None, None]
    fill = lambda x, m: jnp.where(m, jnp.asarray(value, x.dtype), x)  # noqa: E731
    return fill(inp.q, qm), fill(inp.k, km), fill(inp.v, km)


def oracle(inp: Inputs, packed: bool, lowp=None):
    if packed:
        okw = dict(inp.oracle_kwargs)
        cu_q, cu_k = okw.pop("cu_seqlens_q"), okw.pop("cu_seqlens_k")
        return ragged_attention_oracle(
            util.f64(inp.q), util.f64(inp.k), util.f64(inp.v), cu_q, cu_k, lowp=lowp, **okw
        )
    return attention_oracle(
        util.f64(inp.q), util.f64(inp.k), util.f64(inp.v), lowp=lowp, **inp.oracle_kwargs
    )


STATIC_OPTIONS = ("causal", "window", "sink_tokens", "soft_cap", "scale")


def call(packed: bool, impl, q, k, v, inp: Inputs, *, return_lse: bool, config=None, jit=True):
    """One op call; under `jax.jit` (arrays traced, options static) unless `jit=False`."""
    static = {n: x for n, x in inp.kwargs.items() if n in STATIC_OPTIONS}
    arrays = {n: x for n, x in inp.kwargs.items() if n not in STATIC_OPTIONS}
    if impl == "reference":
        fn = jaxattn.ragged_attention_reference if packed else jaxattn.attention_reference
        fn = functools.partial(fn, **static, return_lse=return_lse)
    else:
        fn = jaxattn.ragged_attention if packed else jaxattn.attention
        fn = functools.partial(
            fn, **static, return_lse=return_lse, implementation=impl, config=config
        )
    run = lambda q, k, v, positional, arrays: fn(q, k, v, *positional, **arrays)  # noqa: E731
    if jit:
        run = jax.jit(run, compiler_options=util.FAST_COMPILE)
    return run(q, k, v, inp.positional, arrays)


def check_case(case, impl, dtype, *, head_dim=None, poison="huge", config="default", jit=True):
    """Runs `impl` on the case (padding poisoned with `poison`) and checks it vs the oracle."""
    packed = isinstance(case, Packed)
    inp = (build_packed if packed else build_dense)(case, dtype, head_dim)
    config = util.kernel_config() if config == "default" else config
    want_out, want_lse = oracle(inp, packed)
    lowp_ref = None
    if dtype != "float32":
        lowp_ref, _ = oracle(inp, packed, lowp=jnp.dtype(dtype).type)
    q, k, v = poisoned(inp, poison, dtype)
    got = call(packed, impl, q, k, v, inp, return_lse=case.return_lse, config=config, jit=jit)
    got_out, got_lse = got if case.return_lse else (got, None)
    assert got_out.dtype == q.dtype, f"out dtype {got_out.dtype} != input dtype {q.dtype}"
    util.assert_out_close(got_out, want_out, dtype, lowp_ref=lowp_ref)
    # Rows that see no key (padding rows included): exact zeros.
    lse_rows = want_lse.T if packed else want_lse.transpose(0, 2, 1)  # [.., T, H]
    util.assert_zero_rows(got_out, np.isneginf(lse_rows)[..., None], "rows with no visible key")
    if case.return_lse:
        assert got_lse.dtype == jnp.float32, f"lse dtype {got_lse.dtype}"
        util.assert_lse_close(got_lse, want_lse, dtype)
    return inp, got
