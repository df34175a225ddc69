"""`jaxattn.reference` (the spec in code) against independent oracles: the float64 numpy
oracle (every case of the shared table), `jax.nn.dot_product_attention` where the two
overlap, published ALiBi slopes and HF transformers' T5 bucketing; and the packed reference
against the dense one run per sequence."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import util
from cases import DENSE, PACKED, check_case, cu_seqlens, params
from oracle import bloom_alibi_slopes, t5_relative_position_bucket

import jaxattn

# ------------------------------------------------------------------ vs the numpy oracle


def _skip_on_gpu(case):
    # The reference is plain jnp, checked case by case on CPU; on a GPU (where the suite
    # exists for the compiled kernels) the core cases are enough.
    if util.ON_GPU and not case.core:
        pytest.skip("reference on a GPU: core cases only")


@pytest.mark.parametrize("case, dtype", params(DENSE))
def test_dense_reference_vs_oracle(case, dtype):
    _skip_on_gpu(case)
    check_case(case, "reference", dtype)


@pytest.mark.parametrize("case, dtype", params(PACKED))
def test_packed_reference_vs_oracle(case, dtype):
    _skip_on_gpu(case)
    check_case(case, "reference", dtype)


# ------------------------------------------------------ vs jax.nn.dot_product_attention
def _qkv(rng, b, tq, tk, hq, hkv, d):
    return (
        util.randn(rng, (b, tq, hq, d)),
        util.randn(rng, (b, tk, hkv, d)),
        util.randn(rng, (b, tk, hkv, d)),
    )


T = util.tokens
JAX_NN_CASES = {
    # name: (shape (B, Tq, Tk, Hq, Hkv), our kwargs, jax.nn kwargs)
    "plain": ((2, T(29), T(29), 4, 4), {}, {}),
    "cross": ((2, T(13), T(31), 4, 4), {}, {}),
    "causal": ((2, T(29), T(29), 4, 4), dict(causal=True), dict(is_causal=True)),
    "gqa_causal": ((2, T(29), T(29), 6, 2), dict(causal=True), dict(is_causal=True)),
    "mqa": ((1, T(17), T(40), 4, 1), {}, {}),
    "scale": ((2, T(20), T(20), 4, 2), dict(scale=0.37), dict(scale=0.37)),
    "bias": ((2, T(20), T(33), 4, 2), dict(bias="B1QK"), dict(bias="B1QK")),
    "mask": ((2, T(20), T(33), 4, 2), dict(mask="BHQK"), dict(mask="BHQK")),
    "bias_mask_causal": (
        (2, T(24), T(24), 4, 4),
        dict(bias="1HQK", mask="B11K", causal=True),
        dict(bias="1HQK", mask="B11K", is_causal=True),
    ),
    "lengths": (
        (3, T(20), T(33), 4, 2),
        dict(q_lengths=(T(20), T(7), 1), kv_lengths=(T(33), T(12), T(5))),
        dict(query_seq_lengths=(T(20), T(7), 1), key_value_seq_lengths=(T(33), T(12), T(5))),
    ),
    # Causal with lengths agrees where queries and keys have the same lengths (jax.nn aligns
    # queries top-left, jaxattn bottom-right).
    "lengths_causal": (
        (2, T(30), T(30), 4, 2),
        dict(causal=True, q_lengths=(T(30), T(19)), kv_lengths=(T(30), T(19))),
        dict(is_causal=True, query_seq_lengths=(T(30), T(19)),
             key_value_seq_lengths=(T(30), T(19))),
    ),
    # window W: the last W keys (the query's own included) = jax.nn's (W - 1, 0) when causal.
    "window_causal": (
        (2, T(30), T(30), 4, 2), dict(causal=True, window=T(6)),
        dict(is_causal=True, local_window_size=(T(6) - 1, 0)),
    ),
    "window_noncausal": (
        (2, T(30), T(30), 4, 2), dict(window=T(6)), dict(local_window_size=(T(6) - 1, T(30))),
    ),
}  # fmt: skip


def _operand(spec, rng, b, h, tq, tk, boolean):
    if spec is None:
        return None
    sizes = dict(B=b, H=h, Q=tq, K=tk)
    shape = tuple(sizes.get(c, 1) for c in spec)
    if boolean:
        return jnp.asarray(rng.random(shape) < 0.7)
    return jnp.asarray(rng.standard_normal(shape), jnp.float32)


@pytest.mark.parametrize("name", JAX_NN_CASES)
def test_reference_vs_jax_nn(name):
    (b, tq, tk, hq, hkv), ours, theirs = JAX_NN_CASES[name]
    rng = util.rng_for("jax.nn", name)
    q, k, v = _qkv(rng, b, tq, tk, hq, hkv, util.DEFAULT_HEAD_DIM)
    ours, theirs = dict(ours), dict(theirs)
    for key in ("bias", "mask"):
        if key in ours:
            ours[key] = theirs[key] = _operand(ours[key], rng, b, hq, tq, tk, key == "mask")
    for key in ("q_lengths", "kv_lengths"):
        if key in ours:
            ours[key] = jnp.asarray(ours[key], jnp.int32)
    for key in ("query_seq_lengths", "key_value_seq_lengths"):
        if key in theirs:
            theirs[key] = jnp.asarray(theirs[key], jnp.int32)
    static = ("causal", "window", "scale", "is_causal", "local_window_size")
    split = lambda kw: ({n: x for n, x in kw.items() if n in static},  # noqa: E731
                        {n: x for n, x in kw.items() if n not in static})  # fmt: skip
    st, arr = split(ours)
    out, lse = util.jit_call(
        jaxattn.attention_reference, q, k, v, static=dict(st, return_lse=True), **arr
    )
    st, arr = split(theirs)
    with jax.default_matmul_precision("float32"):  # no TF32 on a GPU
        want, want_lse = util.jit_call(
            jax.nn.dot_product_attention, q, k, v, static=dict(st, return_residual=True), **arr
        )
    want_lse = jnp.swapaxes(want_lse, -1, -2)  # jax.nn: [B, Tq, Hq]
    # Compare rows that are real queries and see at least one key (jax.nn's output for
    # padding rows and fully masked rows is not specified the same way).
    valid = np.isfinite(np.asarray(lse))  # [B, Hq, Tq]
    if "q_lengths" in ours:
        valid &= np.arange(tq)[None, None, :] < np.asarray(ours["q_lengths"])[:, None, None]
    assert valid.any()
    rows = valid.transpose(0, 2, 1)  # [B, Tq, Hq]
    tol = util.F32_TOL
    np.testing.assert_allclose(np.asarray(out)[rows], np.asarray(want)[rows], **tol)
    np.testing.assert_allclose(np.asarray(lse)[valid], np.asarray(want_lse)[valid], **tol)


# --------------------------------------------------------------------------- ALiBi slopes
def test_alibi_slopes_power_of_two_exact():
    slopes = jaxattn.alibi_slopes(8)
    assert slopes.dtype == np.float32 and slopes.shape == (8,)
    np.testing.assert_array_equal(slopes, 2.0 ** -np.arange(1, 9, dtype=np.float32))
    np.testing.assert_allclose(
        jaxattn.alibi_slopes(16), 2.0 ** (-0.5 * np.arange(1, 17)), rtol=1e-7
    )
    np.testing.assert_array_equal(jaxattn.alibi_slopes(1), [2.0**-8])


def test_alibi_slopes_non_power_of_two_by_hand():
    """12 heads: the 8-head slopes, then every other slope of 16 heads (ALiBi paper, BLOOM)."""
    want = [2.0**-i for i in range(1, 9)] + [2.0**-0.5, 2.0**-1.5, 2.0**-2.5, 2.0**-3.5]
    np.testing.assert_allclose(jaxattn.alibi_slopes(12), want, rtol=1e-7)
    np.testing.assert_allclose(jaxattn.alibi_slopes(6), [2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3])


@pytest.mark.parametrize("num_heads", [1, 2, 3, 5, 6, 7, 12, 16, 24, 40, 64, 80, 96])
@pytest.mark.every_case
def test_alibi_slopes_vs_bloom(num_heads):
    got = jaxattn.alibi_slopes(num_heads)
    assert got.shape == (num_heads,) and got.dtype == np.float32
    np.testing.assert_allclose(got, bloom_alibi_slopes(num_heads), rtol=1e-6)


@pytest.mark.parametrize("num_heads", [0, -3])
@pytest.mark.every_case
def test_alibi_slopes_rejects_non_positive(num_heads):
    with pytest.raises(ValueError, match="num_heads"):
        jaxattn.alibi_slopes(num_heads)


# ------------------------------------------------------------------------ T5 buckets
@pytest.mark.parametrize("bidirectional", [True, False], ids=["bidirectional", "causal"])
@pytest.mark.parametrize(
    "num_buckets, max_distance", [(32, 128), (16, 64), (8, 20), (64, 256), (6, 40)]
)
def test_relative_position_bucket_vs_hf(num_buckets, max_distance, bidirectional):
    rel = np.arange(-3 * max_distance, 3 * max_distance + 1)
    got = util.jit_call(
        jaxattn.relative_position_bucket, jnp.asarray(rel, jnp.int32),
        static=dict(num_buckets=num_buckets, max_distance=max_distance,
                    bidirectional=bidirectional),
    )  # fmt: skip
    want = t5_relative_position_bucket(rel, bidirectional, num_buckets, max_distance)
    bad = np.nonzero(np.asarray(got) != want)[0]
    assert bad.size == 0, (
        f"relative positions {rel[bad][:10]}: got {np.asarray(got)[bad][:10]}, "
        f"want {want[bad][:10]}"
    )
    assert int(np.max(got)) < num_buckets and int(np.min(got)) >= 0


# relative position (key - query) -> bucket, worked out by hand from T5's formula
# (max_exact = 8 / 16; large = max_exact + floor(log(d / max_exact) / log(128 / max_exact)
#  * max_exact)).
HAND_BIDIRECTIONAL = {0: 0, -1: 1, 1: 17, -7: 7, -8: 8, 8: 24, -15: 9, -16: 10, -32: 12,
                      64: 30, -127: 15, -128: 15, -1000: 15, 1000: 31}  # fmt: skip
HAND_CAUSAL = {5: 0, 0: 0, -1: 1, -15: 15, -16: 16, -20: 17, -32: 21, -64: 26, -127: 31,
               -10000: 31}  # fmt: skip


def test_relative_position_bucket_by_hand():
    for table, bidirectional in ((HAND_BIDIRECTIONAL, True), (HAND_CAUSAL, False)):
        rel = jnp.asarray(list(table), jnp.int32)
        got = util.jit_call(
            jaxattn.relative_position_bucket, rel,
            static=dict(num_buckets=32, max_distance=128, bidirectional=bidirectional),
        )  # fmt: skip
        assert dict(zip(table, np.asarray(got).tolist())) == table


# --------------------------------------------------- packed reference vs dense reference
@pytest.mark.parametrize(
    "opts",
    [
        dict(),
        dict(causal=True),
        dict(causal=True, window=5, sink_tokens=2, alibi=True),
        dict(rel=(32, 64, False), causal=True, soft_cap=3.0),
        dict(bias=True, mask=True),
    ],
    ids=["plain", "causal", "window_sinks_alibi", "t5_softcap", "bias_mask"],
)
def test_ragged_reference_is_dense_per_sequence(opts):
    rng = util.rng_for("ragged_vs_dense", str(opts))
    q_lens = (T(7), 0, 1, T(19), T(12))
    kv_lens = (T(7), T(5), 1, T(30), 0)
    hq, hkv, d = 4, 2, util.DEFAULT_HEAD_DIM
    cu_q, cu_k = cu_seqlens(q_lens), cu_seqlens(kv_lens)
    tq, tk = int(cu_q[-1]) + 3, int(cu_k[-1]) + 2
    q = util.randn(rng, (tq, hq, d))
    k, v = util.randn(rng, (tk, hkv, d)), util.randn(rng, (tk, hkv, d))
    static = {n: opts[n] for n in ("causal", "window", "sink_tokens", "soft_cap") if n in opts}
    static["return_lse"] = True
    kw = {}
    if opts.get("alibi"):
        kw["alibi_slopes"] = jnp.asarray(jaxattn.alibi_slopes(hq))
    if "rel" in opts:
        nb, md, bidir = opts["rel"]
        kw["relative_bias"] = jaxattn.RelativeBias(util.randn(rng, (hq, nb)), md, bidir)
    bias = util.randn(rng, (hq, tq, tk)) if opts.get("bias") else None
    mask = jnp.asarray(rng.random((hq, tq, tk)) < 0.7) if opts.get("mask") else None
    out, lse = util.jit_call(
        jaxattn.ragged_attention_reference, q, k, v, jnp.asarray(cu_q), jnp.asarray(cu_k),
        static=static, bias=bias, mask=mask, **kw,
    )  # fmt: skip
    assert (np.asarray(out)[cu_q[-1] :] == 0).all() and np.isneginf(lse[:, cu_q[-1] :]).all()
    for b in range(len(q_lens)):
        rows, cols = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if rows.start == rows.stop:
            continue
        if cols.start == cols.stop:  # no keys: the dense reference needs Tk >= 1
            assert (np.asarray(out[rows]) == 0).all() and np.isneginf(lse[:, rows]).all()
            continue
        o, l = util.jit_call(
            jaxattn.attention_reference, q[None, rows], k[None, cols], v[None, cols],
            static=static, **kw,
            bias=None if bias is None else bias[None, :, rows, cols],
            mask=None if mask is None else mask[None, :, rows, cols],
        )  # fmt: skip
        np.testing.assert_allclose(out[rows], o[0], atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(lse[:, rows], l[0], atol=1e-5, rtol=1e-5)


def test_dense_lengths_are_cropping():
    """Lengths of a padded batch = running the cropped sequences alone."""
    rng = util.rng_for("crop")
    b, tq, tk, hq, hkv, d = 3, T(20), T(26), 4, 1, util.DEFAULT_HEAD_DIM
    q, k, v = _qkv(rng, b, tq, tk, hq, hkv, d)
    q_len, kv_len = (T(20), T(3), 1), (T(26), T(17), T(2))
    static = dict(causal=True, window=T(5), sink_tokens=1, return_lse=True)
    slopes = jnp.asarray(jaxattn.alibi_slopes(hq))
    out, lse = util.jit_call(
        jaxattn.attention_reference, q, k, v, static=static, alibi_slopes=slopes,
        q_lengths=jnp.asarray(q_len), kv_lengths=jnp.asarray(kv_len),
    )  # fmt: skip
    for i in range(b):
        o, l = util.jit_call(
            jaxattn.attention_reference, q[i : i + 1, : q_len[i]], k[i : i + 1, : kv_len[i]],
            v[i : i + 1, : kv_len[i]], static=static, alibi_slopes=slopes,
        )  # fmt: skip
        np.testing.assert_allclose(out[i, : q_len[i]], o[0], atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(lse[i, :, : q_len[i]], l[0], atol=1e-5, rtol=1e-5)
        assert (np.asarray(out[i, q_len[i] :]) == 0).all()
