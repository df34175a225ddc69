"""One shared suite for `jaxattn.attention` / `ragged_attention`, run against every
implementation ("xla" = the reference, "pallas" = the flash kernel) and compared with the
independent float64 numpy oracle (tests/oracle.py). Case table: tests/cases.py."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import util
from cases import (
    DENSE,
    HQK,
    PACKED,
    Dense,
    Packed,
    build_dense,
    build_packed,
    check_case,
    cu_seqlens,
    oracle,
    params,
)

import jaxattn

impls = pytest.mark.parametrize("impl", util.IMPLEMENTATIONS)


def _skip_redundant(case, impl):
    if util.ON_GPU and impl == "xla" and not case.core:
        # Keeps the GPU suite short: "xla" is the reference, which test_reference.py
        # already runs on every case; the core cases still cover the dispatch.
        pytest.skip("xla on a GPU: core cases only")


@impls
@pytest.mark.parametrize("case, dtype", params(DENSE))
def test_dense(case, dtype, impl):
    _skip_redundant(case, impl)
    check_case(case, impl, dtype)


@impls
@pytest.mark.parametrize("case, dtype", params(PACKED))
def test_packed(case, dtype, impl):
    _skip_redundant(case, impl)
    check_case(case, impl, dtype)


# Padding inputs full of NaN must not leak into real rows (real padding holds garbage:
# uninitialised buffers, previous batches). The main tests poison with huge finite values.
# (0 * NaN = NaN: a reference that multiplies zero weights by padding values fails this.)
POISON_CASES = [
    Dense(name="poison_lengths", q_lengths=(37, 11), kv_lengths=(30, 25), causal=True),
    Dense(name="poison_lengths_cross_bias", tq=20, tk=45, q_lengths=(20, 7),
          kv_lengths=(13, 45), bias=("B", 1, "Tq", "Tk")),
    Packed(name="poison_packed", q_lens=(5, 17, 1, 33), kv_lens=(9, 17, 4, 33), k_pad=7,
           causal=True),
]  # fmt: skip


@impls
@pytest.mark.parametrize("case, dtype", params(POISON_CASES))
def test_nan_padding_is_ignored(case, dtype, impl):
    check_case(case, impl, dtype, poison="nan")


@impls
@pytest.mark.parametrize("head_dim", util.HEAD_DIMS, ids=lambda d: f"D{d}")
@pytest.mark.parametrize(
    "case",
    [
        Dense(name="hd_gqa_causal_lengths", causal=True, q_lengths=(37, 20), kv_lengths=(37, 30)),
        Packed(name="hd_packed_window_alibi", q_lens=(3, 30, 17), causal=True, window=11,
               sink_tokens=2, alibi=True),
    ],
    ids=lambda c: c.name,
)  # fmt: skip
@pytest.mark.parametrize("dtype", util.CORE_DTYPES)
def test_head_dims(case, head_dim, dtype, impl):
    check_case(case, impl, dtype, head_dim=head_dim)


LOWP_CASES = [
    Dense(name="lowp_gqa_causal_alibi", causal=True, alibi=True, q_lengths=(37, 25)),
    Packed(name="lowp_packed_softcap_window", q_lens=(20, 1, 31), causal=True, window=9,
           soft_cap=3.0, rel=(32, 128, True)),
]  # fmt: skip


@impls
@pytest.mark.parametrize("case, dtype", params(LOWP_CASES, util.LOW_PRECISION))
def test_low_precision(case, dtype, impl):
    """FlashAttention's rule: error <= 2 x that of a plain low-precision reference."""
    check_case(case, impl, dtype)


@pytest.mark.parametrize(
    "case",
    [
        Dense(name="heuristic_dense", tq=45, causal=True, q_lengths=(45, 30), alibi=True),
        Packed(name="heuristic_packed", q_lens=(17, 70, 1), causal=True, window=20),
    ],
    ids=lambda c: c.name,
)
def test_pallas_heuristic_config(case):
    """config=None: the kernel picks its tiling from the shape."""
    check_case(case, "pallas", util.CASE_DTYPES[0], config=None)


@pytest.mark.parametrize(
    "config",
    [
        jaxattn.FlashPrefillConfig(block_q=32, block_kv=16, num_warps=4, num_stages=2),
        jaxattn.FlashPrefillConfig(block_q=16, block_kv=64, num_warps=4, num_stages=1),
    ],
    ids=lambda c: f"bq{c.block_q}_bkv{c.block_kv}",
)
def test_pallas_other_tilings(config):
    case = Packed(name="tilings", q_lens=(33, 1, 50), kv_lens=(40, 7, 50), causal=True,
                  window=21, sink_tokens=3, mask=("H", "Tq", "Tk"))  # fmt: skip
    check_case(case, "pallas", util.CASE_DTYPES[0], config=config)


def test_implementation_list():
    """A list is tried in order: ["pallas", "xla"] runs pallas, and matches xla."""
    case = Dense(name="impl_list", causal=True, q_lengths=(37, 21))
    _, got_list = check_case(case, ["pallas", "xla"], "float32", jit=False)
    _, got_pallas = check_case(case, "pallas", "float32", jit=False)
    for a, b in zip(got_list, got_pallas):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_implementation_fallback(monkeypatch):
    """A name that raises NotImplementedError falls through to the next one."""
    module = importlib.import_module("jaxattn.attention")
    calls = []

    def unavailable(*args, **kwargs):
        calls.append(1)
        raise NotImplementedError("pallas unavailable in this test")

    monkeypatch.setattr(module, "_pallas", unavailable)
    case = Dense(name="impl_fallback", tq=11, tk=13)  # a shape no other test traces
    check_case(case, ["pallas", "xla"], "float32", jit=False)
    assert calls, "pallas was not tried first"
    with pytest.raises(NotImplementedError, match="pallas unavailable"):
        check_case(case, "pallas", "float32", jit=False)


def test_default_implementation():
    """implementation=None: pallas on a GPU, xla elsewhere; either way correct."""
    check_case(Dense(name="impl_none", causal=True, window=5), None, util.CASE_DTYPES[0], jit=False)


@impls
def test_jit_dense(impl):
    case = Dense(name="jit_dense", causal=True, window=9, sink_tokens=2, alibi=True)
    inp = build_dense(case, "float32")
    want_out, want_lse = oracle(inp, packed=False)

    @jax.jit
    def f(q, k, v, q_lengths, kv_lengths, slopes):
        return jaxattn.attention(
            q, k, v, causal=True, window=util.tokens(9), sink_tokens=util.tokens(2),
            q_lengths=q_lengths, kv_lengths=kv_lengths, alibi_slopes=slopes, return_lse=True,
            implementation=impl, config=util.kernel_config(),
        )  # fmt: skip

    full = jnp.full((2,), inp.q.shape[1], jnp.int32)
    out, lse = f(inp.q, inp.k, inp.v, full, full, inp.kwargs["alibi_slopes"])
    util.assert_out_close(out, want_out, "float32")
    util.assert_lse_close(lse, want_lse, "float32")
    # Traced lengths: a second call with other values reuses the compiled function.
    q_len = jnp.asarray([util.tokens(20), 1], jnp.int32)
    kv_len = jnp.asarray([util.tokens(30), util.tokens(37)], jnp.int32)
    out, lse = f(inp.q, inp.k, inp.v, q_len, kv_len, inp.kwargs["alibi_slopes"])
    inp.oracle_kwargs.update(q_lengths=np.asarray(q_len), kv_lengths=np.asarray(kv_len))
    want_out, want_lse = oracle(inp, packed=False)
    util.assert_out_close(out, want_out, "float32")
    util.assert_lse_close(lse, want_lse, "float32")


@impls
def test_jit_packed_traced_cu_seqlens(impl):
    """cu_seqlens are data: one compiled function serves different packings."""
    case = Packed(name="jit_packed", q_lens=(10, 20, 7), causal=True)
    inp = build_packed(case, "float32")
    f = jax.jit(
        functools.partial(
            jaxattn.ragged_attention, causal=True, return_lse=True, implementation=impl,
            config=util.kernel_config(),
        )
    )  # fmt: skip
    for lens in [case.q_lens, (3, 0, 31), (1, 1, 1)]:
        lens = tuple(map(util.tokens, lens))
        cu = cu_seqlens(lens)
        out, lse = f(inp.q, inp.k, inp.v, jnp.asarray(cu), jnp.asarray(cu))
        inp.oracle_kwargs.update(cu_seqlens_q=cu, cu_seqlens_k=cu)
        want_out, want_lse = oracle(inp, packed=True)
        util.assert_out_close(out, want_out, "float32")
        util.assert_lse_close(lse, want_lse, "float32")
        util.assert_zero_rows(out, (np.arange(out.shape[0]) >= cu[-1])[:, None, None], "pad")


@impls
def test_vmap_dense(impl):
    """jax.vmap over an extra leading axis (e.g. layers) matches a Python loop."""
    case = Dense(name="vmap", tq=16, causal=True)
    inps = [build_dense(dataclasses.replace(case, name=f"vmap{i}"), "float32") for i in range(2)]
    stack = lambda xs: jnp.stack(xs)  # noqa: E731
    fn = functools.partial(
        jaxattn.attention, causal=True, implementation=impl, config=util.kernel_config()
    )
    got = jax.vmap(fn)(*(stack([getattr(i, n) for i in inps]) for n in "qkv"))
    for idx, inp in enumerate(inps):
        want, _ = oracle(inp, packed=False)
        util.assert_out_close(got[idx], want, "float32")


@impls
def test_lengths_past_the_arrays_are_clipped(impl):
    """kv_lengths > Tk and q_lengths > Tq count as Tk and Tq: a sequence never reads the
    next one's rows (the dense kernel views k as [B * Tk])."""
    rng = util.rng_for("lengths_past", impl)
    q, k, v = (util.randn(rng, (2, 16, 2, 32)) for _ in range(3))
    opts = dict(implementation=impl, config=util.CPU_CONFIG if impl == "pallas" else None)
    run = lambda k, **n: np.asarray(jaxattn.attention(q, k, v, causal=True, **n, **opts))  # noqa: E731
    over = dict(q_lengths=jnp.array([40, 16]), kv_lengths=jnp.array([24, 16]))
    got = run(k, **over)
    np.testing.assert_array_equal(got[0], run(k.at[1].add(3.0), **over)[0])
    np.testing.assert_allclose(got, run(k), atol=1e-6)


@impls
def test_eager(impl):
    """Outside jit (the other tests jit their calls): every option still works."""
    case = Packed(
        name="eager", q_lens=(9, 0, 21), kv_lens=(12, 4, 21), causal=True, window=7,
        sink_tokens=2, alibi=True, bias=HQK, rel=(16, 40, False), soft_cap=4.0,
    )  # fmt: skip
    check_case(case, impl, util.CASE_DTYPES[0], jit=False)


EMPTY_AXES = {
    # name: (packed, q shape, kv shape, cu_seqlens_q, cu_seqlens_k)
    "dense_Tk0": (False, (2, 5, 4, 16), (2, 0, 2, 16), None, None),
    "dense_Tq0": (False, (2, 0, 4, 16), (2, 5, 2, 16), None, None),
    "packed_Tk0": (True, (6, 4, 16), (0, 2, 16), (0, 2, 5), (0, 0, 0)),
    "packed_Tq0": (True, (0, 4, 16), (6, 2, 16), (0, 0, 0), (0, 2, 6)),
}


@impls
@pytest.mark.parametrize("name", EMPTY_AXES)
@pytest.mark.every_case
def test_empty_static_axes(name, impl):
    """A static token axis of size 0: zeros / lse -inf (or a ValueError naming the argument)."""
    packed, q_shape, kv_shape, cu_q, cu_k = EMPTY_AXES[name]
    rng = util.rng_for("empty", name)
    q = util.randn(rng, q_shape)
    k, v = util.randn(rng, kv_shape), util.randn(rng, kv_shape)
    op = jaxattn.ragged_attention if packed else jaxattn.attention
    args = (jnp.asarray(cu_q, jnp.int32), jnp.asarray(cu_k, jnp.int32)) if packed else ()
    try:
        out, lse = op(q, k, v, *args, return_lse=True, implementation=impl,
                      config=util.kernel_config())  # fmt: skip
    except ValueError as e:
        assert re.search(r"\b[qkv]\.shape", str(e)), f"unclear error: {e}"
        return
    assert out.shape == q.shape and (np.asarray(out) == 0).all()
    assert np.isneginf(np.asarray(lse)).all()
