"""Gradients of the Pallas path (`implementation="pallas"`) against an independent float64
analytic backward (`grad_oracle.py`), itself checked here against central finite
differences of the float64 forward oracle.

The loss is `sum(out * g_out) + sum(where(isfinite(lse), lse, 0) * g_lse)` (or the first
term alone) with random cotangents. Every case checks, for each differentiated input:
shape and dtype as the input's; finite; exactly 0 wherever the oracle's gradient is (padding
rows of q, keys past the lengths, rows with no visible key, keys no query sees, masked
logits); close to the oracle (float32: a tight tolerance; bf16/fp16: FlashAttention's rule,
error <= 2x that of a plain low-precision computation, plus a small atol); and the jitted
gradient run twice gives the same bits. Padding rows of q/k/v hold huge finite values.

Each distinct shape/option set compiles the kernels again (the forward and both backward
kernels: ~4 s a case in interpret mode on CPU), so the options are merged into few cases
with many checks each.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import util
from cases import BHQK, HQK, STATIC_OPTIONS, Dense, Packed, build_dense, build_packed, poisoned
from grad_oracle import attention_grad_oracle, ragged_attention_grad_oracle
from jax.test_util import check_grads
from oracle import attention_oracle, ragged_attention_oracle

import jaxattn

# ---------------------------------------------------------------- tolerances
# float32, against the float64 oracle: |err| <= atol * max(1, max|want|) + rtol * |want|
# (the gradient of a sum over many keys scales with them; atol follows the tensor's scale).
GRAD_F32_TOL = dict(atol=2e-4, rtol=2e-4) if util.ON_GPU else dict(atol=2e-5, rtol=2e-5)
# Low precision: max error <= LOWP_FACTOR x the larger plain low-precision error (jax.grad of
# the reference on the same inputs, or grad_oracle with `lowp`) + LOWP_ATOL x scale.
GRAD_LOWP_ATOL = {"bfloat16": 4e-3, "float16": 1e-3}
# Whatever the plain computations do, never accept errors this large (x scale).
GRAD_LOWP_CAP = {"bfloat16": 6e-2, "float16": 1e-2}


def _scale(want: np.ndarray) -> float:
    return max(1.0, float(np.max(np.abs(want), initial=0.0)))


def assert_grad_close(got, want, flows, dtype: str, what: str, ref_err: float | None = None):
    """`got` (any dtype) vs the float64 oracle `want`: exact zeros where no gradient `flows`,
    then the dtype's tolerance (`ref_err`: the plain low-precision error, for bf16/fp16)."""
    got = util.f64(got)
    assert got.shape == want.shape, f"d{what}: shape {got.shape} != {want.shape}"
    assert np.isfinite(got).all(), (
        f"d{what}: {np.sum(~np.isfinite(got))} non-finite values, at (leading indices) "
        f"{np.argwhere(~np.isfinite(got))[:8, :2].tolist()}"
    )
    zero = ~flows
    assert (got[zero] == 0).all(), (
        f"d{what}: {np.sum(got[zero] != 0)} values not exactly 0 where no gradient flows "
        f"(padding rows, keys past the lengths, rows with no visible key, masked logits); "
        f"max |got| there {np.max(np.abs(got[zero]))}"
    )
    err = np.abs(got - want)
    scale = _scale(want)
    worst = np.unravel_index(np.argmax(err), err.shape) if err.size else ()
    if dtype == "float32":
        bound = GRAD_F32_TOL["atol"] * scale + GRAD_F32_TOL["rtol"] * np.abs(want)
        worst = np.unravel_index(np.argmax(err - bound), err.shape) if err.size else ()
        assert (err <= bound).all(), (
            f"d{what}: {np.sum(err > bound)} of {err.size} elements out of tolerance "
            f"{GRAD_F32_TOL} (scale {scale:.3g}); worst at {worst}: got {got[worst]}, "
            f"want {want[worst]}"
        )
        return
    bound = min(
        util.LOWP_FACTOR * ref_err + GRAD_LOWP_ATOL[dtype] * scale, GRAD_LOWP_CAP[dtype] * scale
    )
    assert float(np.max(err, initial=0.0)) <= bound, (
        f"d{what} ({dtype}): max error {np.max(err):.4g} at {worst} (got {got[worst]}, want "
        f"{want[worst]}) > {bound:.4g} = {util.LOWP_FACTOR} x plain {dtype} error "
        f"{ref_err:.4g} + {GRAD_LOWP_ATOL[dtype]} x scale {scale:.3g}"
    )


# ---------------------------------------------------------------- problems
@dataclasses.dataclass
class Problem:
    """One case's inputs, split into what is differentiated and what is not."""

    case: Dense | Packed
    packed: bool
    dtype: str
    inp: object  # cases.Inputs (clean values: the oracle's)
    params: dict  # differentiated: q, k, v and (where given) bias, alibi_slopes, table
    consts: dict  # not differentiated: mask, lengths, cu_seqlens
    static: dict  # causal, window, sink_tokens, soft_cap, scale
    rel: object  # the RelativeBias (for its static fields) or None
    g_out: jax.Array  # float32, exactly representable in `dtype`
    g_lse: jax.Array  # float32


def assert_qkv_grads_close(grads, want, plain, dtype: str, what: str = ""):
    """(dq, dk, dv) against the float64 oracle's `GradResult` `want`, each within the
    dtype's tolerance widened by the plain low-precision oracle's (`plain`) own error."""
    for name, got in zip("qkv", grads, strict=True):
        ref_err = float(np.max(np.abs(plain.grads[name] - want.grads[name])))
        assert_grad_close(got, want.grads[name], want.flows[name], dtype, name + what, ref_err)


def make_problem(case, dtype: str, head_dim: int | None = None) -> Problem:
    packed = isinstance(case, Packed)
    inp = (build_packed if packed else build_dense)(case, dtype, head_dim)
    kw = dict(inp.kwargs)
    static = {n: kw.pop(n) for n in STATIC_OPTIONS}
    params = dict(q=inp.q, k=inp.k, v=inp.v)
    for name in ("bias", "alibi_slopes"):
        if name in kw:
            params[name] = kw.pop(name)
    rel = kw.pop("relative_bias", None)
    if rel is not None:
        params["table"] = rel.table
    kw["positional"] = inp.positional
    rng = util.rng_for("grad kernels cotangents", case.name, dtype, head_dim)
    g_out = jnp.asarray(util.randn(rng, inp.q.shape, dtype), jnp.float32)
    lse_shape = (
        (inp.q.shape[1], inp.q.shape[0])
        if packed
        else (inp.q.shape[0], inp.q.shape[2], inp.q.shape[1])
    )
    g_lse = util.randn(rng, lse_shape)
    return Problem(case, packed, dtype, inp, params, kw, static, rel, g_out, g_lse)


def loss_fn(prob: Problem, op, *, return_lse: bool):
    """loss(params, consts) through `op` (attention / ragged_attention or a reference)."""

    def loss(params, consts):
        p, kw = dict(params), dict(consts)
        table = p.pop("table", kw.pop("table", None))
        if table is not None:
            kw["relative_bias"] = jaxattn.RelativeBias(
                table, prob.rel.max_distance, prob.rel.bidirectional
            )
        q, k, v = p.pop("q"), p.pop("k"), p.pop("v")
        positional = kw.pop("positional")
        res = op(q, k, v, *positional, **prob.static, **kw, **p, return_lse=return_lse)
        out, lse = res if return_lse else (res, None)
        value = jnp.sum(out.astype(jnp.float32) * prob.g_out)
        if lse is not None:
            value += jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * prob.g_lse)
        return value

    return loss


def pallas_op(packed: bool):
    op = jaxattn.ragged_attention if packed else jaxattn.attention
    return functools.partial(op, implementation="pallas", config=util.kernel_config())


def reference_op(packed: bool):
    return jaxattn.ragged_attention_reference if packed else jaxattn.attention_reference


def oracle_grads(prob: Problem, *, return_lse: bool, lowp=None):
    """grad_oracle's `GradResult` on the clean inputs (float64)."""
    okw = dict(prob.inp.oracle_kwargs)
    q, k, v = (util.f64(x) for x in (prob.inp.q, prob.inp.k, prob.inp.v))
    g_out = util.f64(prob.g_out)
    g_lse = util.f64(prob.g_lse) if return_lse else None
    if prob.packed:
        cu_q, cu_k = okw.pop("cu_seqlens_q"), okw.pop("cu_seqlens_k")
        return ragged_attention_grad_oracle(q, k, v, cu_q, cu_k, g_out, g_lse, lowp=lowp, **okw)
    return attention_grad_oracle(q, k, v, g_out, g_lse, lowp=lowp, **okw)


def plain_lowp_errors(prob: Problem, want: dict, diff, *, return_lse: bool) -> dict:
    """Per input: the max error against the float64 oracle of the plain low-precision
    computations, the larger of jax.grad through `jaxattn.*_reference` on the same
    low-precision inputs and grad_oracle with `lowp` (rounding as a bf16 autograd does)."""
    loss = loss_fn(prob, reference_op(prob.packed), return_lse=return_lse)
    params = {n: prob.params[n] for n in diff}
    consts = dict(prob.consts, **{n: x for n, x in prob.params.items() if n not in diff})
    ref = jax.jit(jax.grad(loss), compiler_options=util.FAST_COMPILE)(params, consts)
    lowp = oracle_grads(prob, return_lse=return_lse, lowp=jnp.dtype(prob.dtype).type).grads
    return {
        n: max(
            float(np.max(np.abs(util.f64(ref[n]) - want[n]), initial=0.0)),
            float(np.max(np.abs(lowp[n] - want[n]), initial=0.0)),
        )
        for n in diff
    }


def run_and_check(prob: Problem, *, return_lse: bool = True, diff=None):
    """jax.grad through the pallas op (padding poisoned) w.r.t. `diff` (default: every
    float input), checked against the oracle; returns the gradients."""
    diff = tuple(prob.params) if diff is None else tuple(diff)
    loss = loss_fn(prob, pallas_op(prob.packed), return_lse=return_lse)
    q, k, v = poisoned(prob.inp, "huge", prob.dtype)
    inputs = dict(prob.params, q=q, k=k, v=v)
    params = {n: inputs[n] for n in diff}
    consts = dict(prob.consts, **{n: x for n, x in inputs.items() if n not in diff})
    grad = jax.jit(jax.grad(loss), compiler_options=util.FAST_COMPILE)
    got = grad(params, consts)
    assert set(got) == set(diff)
    oracle = oracle_grads(prob, return_lse=return_lse)
    want = oracle.grads
    ref_errs = {}
    if prob.dtype != "float32":
        ref_errs = plain_lowp_errors(prob, want, diff, return_lse=return_lse)
    for name in diff:
        x = params[name]
        assert got[name].dtype == x.dtype, f"d{name}: dtype {got[name].dtype} != {x.dtype}"
        what = f"{name} (padding rows of q/k/v poisoned with huge finite values)"
        assert_grad_close(
            got[name], want[name], oracle.flows[name], prob.dtype, what, ref_errs.get(name)
        )
    # Deterministic: no atomics or order-dependent reductions (the same bits run to run).
    again = grad(params, consts)
    for name in diff:
        np.testing.assert_array_equal(
            util.bits(again[name]), util.bits(got[name]), err_msg=f"d{name}: not deterministic"
        )
    return got


# ---------------------------------------------------------------- the oracle itself
def _fd_check(loss, params: dict, analytic: dict, eps=1e-6, tol=1e-7):
    """Every scalar of every input: central differences of `loss` vs `analytic`."""
    for name, x in params.items():
        fd = np.zeros(x.shape)
        for idx in np.ndindex(x.shape):
            plus, minus = x.copy(), x.copy()
            plus[idx] += eps
            minus[idx] -= eps
            fd[idx] = loss(dict(params, **{name: plus})) - loss(dict(params, **{name: minus}))
            fd[idx] /= 2 * eps
        np.testing.assert_allclose(analytic[name], fd, rtol=tol, atol=tol, err_msg=name)


def _check_flows(res):
    """Where no gradient flows the oracle's own gradient is exactly 0 (shapes agree)."""
    for name, g in res.grads.items():
        assert res.flows[name].shape == g.shape, name
        assert (g[~res.flows[name]] == 0).all(), name


def _tiny(rng, *shape):
    return rng.standard_normal(shape)


def test_grad_oracle_dense_vs_finite_differences():
    """Dense: chunk over a prefix with lengths, window + sinks, ALiBi, broadcast bias, mask
    (with a fully masked row), bidirectional T5, soft-cap and a custom scale, GQA."""
    rng = util.rng_for("grad oracle dense")
    b, tq, tk, hq, hkv, d = 2, 4, 6, 4, 2, 3
    mask = rng.random((b, hq, tq, tk)) < 0.8
    mask[0, 1, 2] = False
    params = dict(
        q=_tiny(rng, b, tq, hq, d),
        k=_tiny(rng, b, tk, hkv, d),
        v=_tiny(rng, b, tk, hkv, d),
        bias=_tiny(rng, b, 1, tq, tk),
        alibi_slopes=rng.random(hq),
        table=_tiny(rng, hq, 8),
    )
    opts = dict(
        causal=True,
        q_lengths=(4, 2),
        kv_lengths=(6, 5),
        window=3,
        sink_tokens=1,
        mask=mask,
        soft_cap=1.5,
        scale=0.7,
    )
    g_out, g_lse = _tiny(rng, b, tq, hq, d), _tiny(rng, b, hq, tq)

    def fwd(p):
        return attention_oracle(
            p["q"],
            p["k"],
            p["v"],
            bias=p["bias"],
            alibi_slopes=p["alibi_slopes"],
            relative_bias=(p["table"], 12, True),
            **opts,
        )

    def loss(p):
        out, lse = fwd(p)
        return np.sum(out * g_out) + np.sum(np.where(np.isfinite(lse), lse, 0.0) * g_lse)

    res = attention_grad_oracle(
        params["q"],
        params["k"],
        params["v"],
        g_out,
        g_lse,
        bias=params["bias"],
        alibi_slopes=params["alibi_slopes"],
        relative_bias=(params["table"], 12, True),
        **opts,
    )
    want_out, want_lse = fwd(params)
    np.testing.assert_allclose(res.out, want_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(res.lse, want_lse)
    assert np.isneginf(res.lse).any() and np.isfinite(res.lse).any()
    _fd_check(loss, params, res.grads)
    _check_flows(res)
    assert not res.flows["q"][1, 2:].any() and not res.flows["k"][1, 5:].any(), "padding"
    assert not res.flows["q"][0, 2, 1].any(), "the fully masked row"
    assert res.flows["bias"].shape == params["bias"].shape and not res.flows["bias"].all()


def test_grad_oracle_packed_vs_finite_differences():
    """Packed: lengths 0 and 1, a sequence with no keys, trailing padding rows of q and k,
    bias broadcast over heads in packed coordinates, unidirectional T5, causal, ALiBi, MQA,
    default scale, no soft-cap; cotangent on out only."""
    rng = util.rng_for("grad oracle packed")
    q_lens, kv_lens = (3, 0, 1, 4, 1), (5, 2, 1, 4, 0)
    cu_q, cu_k = np.cumsum((0, *q_lens)), np.cumsum((0, *kv_lens))
    tq, tk, hq, d = cu_q[-1] + 2, cu_k[-1] + 2, 2, 3
    params = dict(
        q=_tiny(rng, tq, hq, d),
        k=_tiny(rng, tk, 1, d),
        v=_tiny(rng, tk, 1, d),
        bias=_tiny(rng, 1, tq, tk),
        alibi_slopes=rng.random(hq),
        table=_tiny(rng, hq, 6),
    )
    g_out = _tiny(rng, tq, hq, d)

    def loss(p):
        out, _ = ragged_attention_oracle(
            p["q"],
            p["k"],
            p["v"],
            cu_q,
            cu_k,
            bias=p["bias"],
            causal=True,
            alibi_slopes=p["alibi_slopes"],
            relative_bias=(p["table"], 9, False),
        )
        return np.sum(out * g_out)

    res = ragged_attention_grad_oracle(
        params["q"],
        params["k"],
        params["v"],
        cu_q,
        cu_k,
        g_out,
        bias=params["bias"],
        causal=True,
        alibi_slopes=params["alibi_slopes"],
        relative_bias=(params["table"], 9, False),
    )
    _fd_check(loss, params, res.grads)
    _check_flows(res)
    flows = res.flows
    assert not flows["q"][cu_q[-1] :].any() and not flows["k"][cu_k[-1] :].any(), "padding"
    assert not flows["q"][cu_q[4]].any(), "the query of the sequence with no keys"
    assert not flows["k"][cu_k[1] : cu_k[2]].any(), "the keys of the sequence with no query"
    assert flows["bias"].shape == params["bias"].shape


# ---------------------------------------------------------------- kernels vs the oracle
CASES = [
    # A chunk over its prefix (Tq < Tk, bottom-right), lengths, GQA, window + sinks, ALiBi,
    # soft-cap, custom scale, bias [B, 1, Tq, Tk]; the head-dim sweep runs on this one.
    Dense(name="kg_chunk_gqa_window_sinks_alibi_softcap_bias_B1", tq=21, tk=45, causal=True,
          q_lengths=(21, 9), kv_lengths=(45, 30), window=12, sink_tokens=3, alibi=True,
          soft_cap=3.0, scale=0.3, bias=("B", 1, "Tq", "Tk")),
    # Cross attention (Tq != Tk, not causal), MHA, bidirectional T5, boolean mask (row 3
    # all False), full bias with -inf entries (row 2 all -inf), a sequence with kv_len 0.
    Dense(name="kg_cross_mha_t5_mask_bias_full_kv0", tq=19, tk=35, hkv=4, rel=(16, 40, True),
          mask=BHQK, bias=BHQK, neg_inf_bias=True, kv_lengths=(35, 0)),
    # -inf bias entries (row 2 all -inf) under a soft-cap: they still hide their keys.
    Dense(name="kg_bias_neg_inf_soft_cap", tq=19, tk=35, bias=BHQK, neg_inf_bias=True,
          soft_cap=3.0),
    # MQA, causal with q_lengths, unidirectional T5, bias [1, 1, Tq, Tk]; out only.
    Dense(name="kg_mqa_causal_t5_uni_bias_11_out_only", tq=29, hkv=1, causal=True,
          q_lengths=(29, 17), rel=(16, 64, False), bias=(1, 1, "Tq", "Tk"), return_lse=False),
    # Packed: lengths 0 and 1, a query with no key, keys with no query, trailing padding in
    # q and k, GQA, causal window + sinks, ALiBi, soft-cap.
    Packed(name="kg_packed_gqa_window_sinks_alibi_softcap", q_lens=(9, 0, 1, 24, 1),
           kv_lens=(9, 3, 1, 30, 0), q_pad=5, k_pad=3, causal=True, window=7, sink_tokens=2,
           alibi=True, soft_cap=4.0),
    # Packed cross attention, MQA, bidirectional T5, bias [1, Tq, Tk] and mask in packed
    # coordinates, custom scale.
    Packed(name="kg_packed_cross_mqa_t5_bias_1TqTk_mask", q_lens=(7, 13, 2), kv_lens=(20, 5, 33),
           k_pad=4, hkv=1, rel=(32, 128, True), bias=(1, "Tq", "Tk"), mask=HQK, scale=0.25),
]  # fmt: skip


def _main_params():
    out = []
    for i, case in enumerate(CASES):
        head_dims = util.HEAD_DIMS if i == 0 else (None,)
        for dtype, head_dim in itertools.product(util.CORE_DTYPES, head_dims):
            name = f"{case.name}-{dtype}" + ("" if head_dim is None else f"-D{head_dim}")
            out.append(pytest.param(case, dtype, head_dim, id=name))
    return out


@pytest.mark.parametrize("case, dtype, head_dim", _main_params())
def test_grad_kernels(case, dtype, head_dim):
    prob = make_problem(case, dtype, head_dim)
    run_and_check(prob, return_lse=case.return_lse)


LOWP_CASES = [
    Dense(name="kg_lowp_gqa_causal_lengths_alibi_softcap", causal=True, alibi=True,
          soft_cap=5.0, q_lengths=(37, 25), kv_lengths=(37, 30)),
    Packed(name="kg_lowp_packed_window_t5_bias", q_lens=(20, 1, 31), causal=True, window=9,
           rel=(32, 128, True), bias=HQK),
]  # fmt: skip


@pytest.mark.parametrize("dtype", util.LOW_PRECISION)
@pytest.mark.parametrize("case", LOWP_CASES, ids=lambda c: c.name)
def test_grad_kernels_low_precision(case, dtype):
    """bf16 / fp16 inputs: grads in the input dtype, FlashAttention's error rule."""
    run_and_check(make_problem(case, dtype))


def test_grad_qkv_only_with_constant_bias():
    """Only q, k, v differentiated; bias and ALiBi slopes are constants of the loss."""
    case = Dense(
        name="kg_qkv_only_const_bias",
        tq=24,
        tk=40,
        causal=True,
        q_lengths=(24, 13),
        bias=("B", "H", "Tq", "Tk"),
        alibi=True,
    )
    run_and_check(make_problem(case, util.CASE_DTYPES[0]), diff=("q", "k", "v"))


# ---------------------------------------------------------------- transformations
def test_check_grads_tiny():
    """jax.test_util.check_grads (reverse mode, finite differences in float32) through
    the pallas op, every float input included."""
    rng = util.rng_for("check_grads tiny")
    b, t, hq, hkv, d = 1, 20, 2, 1, 8
    args = (
        util.randn(rng, (b, t, hq, d)),
        util.randn(rng, (b, t, hkv, d)),
        util.randn(rng, (b, t, hkv, d)),
        util.randn(rng, (b, 1, t, t)),
        jnp.asarray([0.3, 0.1]),
        util.randn(rng, (hq, 8)),
    )
    op = pallas_op(False)

    @jax.jit
    def f(q, k, v, bias, slopes, table):
        return op(
            q,
            k,
            v,
            causal=True,
            window=11,
            bias=bias,
            alibi_slopes=slopes,
            relative_bias=jaxattn.RelativeBias(table, 16, True),
            soft_cap=2.0,
            return_lse=True,
        )

    check_grads(f, args, order=1, modes=["rev"], eps=1e-3)


def test_vmap_of_grad():
    """jax.vmap over a leading axis of jax.grad matches the oracle slice by slice."""
    case = Dense(name="kg_vmap", tq=20, causal=True, q_lengths=(20, 11), alibi=True)
    probs = [
        make_problem(dataclasses.replace(case, name=f"kg_vmap{i}"), "float32") for i in range(2)
    ]
    prob = probs[0]

    def grad_one(q, k, v, g_out, g_lse):
        p = dataclasses.replace(prob, g_out=g_out, g_lse=g_lse)
        params = dict(prob.params, q=q, k=k, v=v)
        return jax.grad(loss_fn(p, pallas_op(False), return_lse=True))(params, prob.consts)

    stack = lambda *xs: jnp.stack(xs)  # noqa: E731
    batched = [stack(*(getattr(p.inp, n) for p in probs)) for n in "qkv"]
    batched += [stack(*(p.g_out for p in probs)), stack(*(p.g_lse for p in probs))]
    got = jax.jit(jax.vmap(grad_one))(*batched)
    for i, p in enumerate(probs):
        want = oracle_grads(p, return_lse=True)
        for name in prob.params:
            assert_grad_close(
                got[name][i], want.grads[name], want.flows[name], "float32", f"{name}[{i}]"
            )


def test_grad_memory_is_linear():
    """Temp memory of the compiled gradient at S and 4S tokens: linear for the kernels (no
    [Tq, Tk] logits kept), quadratic for the dense reference ("xla"), printed for both."""
    s = util.tokens(256)
    temps = {}
    for impl in ("pallas", "xla"):
        for n in (s, 4 * s):
            x = jax.ShapeDtypeStruct((1, n, 2, util.DEFAULT_HEAD_DIM), jnp.float32)

            def loss(q, k, v, impl=impl):
                out, lse = jaxattn.attention(
                    q,
                    k,
                    v,
                    causal=True,
                    return_lse=True,
                    implementation=impl,
                    config=util.kernel_config(),
                )
                return jnp.sum(out) + jnp.sum(lse)

            grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
            memory = grad.lower(x, x, x).compile().memory_analysis()
            if memory is None:
                pytest.skip(f"memory_analysis() is None on {jax.default_backend()}")
            temps[impl, n] = memory.temp_size_in_bytes
            if impl == "pallas" and n == s:
                jaxpr = jax.make_jaxpr(grad)(*(jnp.zeros(x.shape, x.dtype) for _ in "qkv"))
                kernels = str(jaxpr).count("pallas_call")
    ratios = {impl: temps[impl, 4 * s] / max(temps[impl, s], 1) for impl in ("pallas", "xla")}
    report = ", ".join(
        f"{impl}: {temps[impl, s]} -> {temps[impl, 4 * s]} B (x{ratios[impl]:.1f})"
        for impl in ratios
    )
    print(f"\ngrad temp memory at S={s} -> 4S: {report}")
    if kernels < 2:
        pytest.xfail(f"the backward recomputes through the dense reference ({report})")
    assert ratios["pallas"] < 6, f"pallas grad temp memory is not linear in S: {report}"


@pytest.mark.parametrize("impl", util.IMPLEMENTATIONS)
def test_grad_nan_padding_does_not_leak(impl):
    """NaN in padding rows of q, k and v (past the lengths, dense; past cu_seqlens[-1],
    packed): every gradient finite, and the padding rows' gradients exactly 0."""
    rng = util.rng_for("nan padding", impl)
    hq, hkv, d = 4, 2, util.DEFAULT_HEAD_DIM
    tq, tk = util.tokens(19), util.tokens(35)
    q_len, kv_len = util.tokens(11), util.tokens(23)
    q, g = (util.randn(rng, (2, tq, hq, d)) for _ in range(2))
    k, v = (util.randn(rng, (2, tk, hkv, d)) for _ in range(2))
    # Sequence 0 is short (its padding poisoned); sequence 1 is full (and clean).
    q = q.at[0, q_len:].set(jnp.nan)
    k, v = (x.at[0, kv_len:].set(jnp.nan) for x in (k, v))
    lengths = dict(q_lengths=jnp.array([q_len, tq]), kv_lengths=jnp.array([kv_len, tk]))

    def dense_loss(q, k, v):
        out = jaxattn.attention(q, k, v, causal=True, implementation=impl,
                                config=util.kernel_config(), **lengths)  # fmt: skip
        return jnp.sum(jnp.where(jnp.isfinite(out), out, 0.0) * g)

    dq, dk, dv = jax.jit(jax.grad(dense_loss, argnums=(0, 1, 2)))(q, k, v)
    for name, grad in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert np.isfinite(np.asarray(grad)).all(), f"dense {name}: non-finite"
    assert (np.asarray(dq)[0, q_len:] == 0).all()
    assert (np.asarray(dk)[0, kv_len:] == 0).all() and (np.asarray(dv)[0, kv_len:] == 0).all()

    cu_q, cu_k = jnp.array([0, q_len, q_len + 3]), jnp.array([0, kv_len, kv_len + 5])
    qp, kp, vp = q[1], k[1], v[1]  # rows past cu[-1] are padding: poison them
    qp, kp, vp = (
        qp.at[q_len + 3 :].set(jnp.nan),
        kp.at[kv_len + 5 :].set(jnp.nan),
        vp.at[kv_len + 5 :].set(jnp.nan),
    )

    def packed_loss(q, k, v):
        out = jaxattn.ragged_attention(q, k, v, cu_q, cu_k, causal=True, implementation=impl,
                                       config=util.kernel_config())  # fmt: skip
        return jnp.sum(jnp.where(jnp.isfinite(out), out, 0.0) * g[1])

    dq, dk, dv = jax.jit(jax.grad(packed_loss, argnums=(0, 1, 2)))(qp, kp, vp)
    for name, grad in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert np.isfinite(np.asarray(grad)).all(), f"packed {name}: non-finite"
    assert (np.asarray(dq)[q_len + 3 :] == 0).all()
    assert (np.asarray(dk)[kv_len + 5 :] == 0).all() and (np.asarray(dv)[kv_len + 5 :] == 0).all()
