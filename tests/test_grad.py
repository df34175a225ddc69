"""Gradients of `attention` / `ragged_attention` (both implementations) w.r.t. q, k, v and
the float extras (bias, alibi_slopes, the T5 table), with the lse in the loss.

Two checks per case: (1) equal to `jax.grad` through `jaxattn.attention_reference` (the
spec); (2) independent of jaxattn: directional derivatives match central finite
differences of the float64 numpy oracle. Grads must be finite everywhere (rows with no
visible key included) and exactly 0 on padding query rows."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import util
from cases import STATIC_OPTIONS, Dense, Packed, build_dense, build_packed, oracle

import jaxattn

GRAD_CASES = [
    Dense(name="grad_gqa_causal_lengths_alibi", causal=True, alibi=True, q_lengths=(37, 14),
          kv_lengths=(37, 29)),
    Dense(name="grad_bias_mask_softcap", tq=20, tk=29, bias=("B", 1, "Tq", "Tk"),
          mask=("B", "H", "Tq", "Tk"), soft_cap=2.5),
    Dense(name="grad_t5_window_sinks", causal=True, window=9, sink_tokens=2,
          rel=(16, 40, True), q_lengths=(25, 37), hkv=1),
    Packed(name="grad_packed_causal_t5", q_lens=(9, 0, 24, 1), kv_lens=(9, 3, 30, 6),
           causal=True, rel=(32, 64, False), k_pad=2),
    Packed(name="grad_packed_bias_alibi_window", q_lens=(11, 17), causal=True, window=6,
           alibi=True, bias=("H", "Tq", "Tk"), soft_cap=3.0),
]  # fmt: skip
ids = [c.name for c in GRAD_CASES]
# The backward pass recomputes through the reference, so both sides see the same math.
GRAD_TOL = dict(rtol=1e-4, atol=1e-4) if util.ON_GPU else dict(rtol=1e-5, atol=1e-5)


def _setup(case):
    packed = isinstance(case, Packed)
    inp = (build_packed if packed else build_dense)(case, "float32")
    params = dict(q=inp.q, k=inp.k, v=inp.v)
    kw = dict(inp.kwargs)
    static = {n: kw.pop(n) for n in STATIC_OPTIONS}
    for name in ("bias", "alibi_slopes"):
        if name in kw:
            params[name] = kw.pop(name)
    rel = kw.pop("relative_bias", None)
    if rel is not None:
        params["table"] = rel.table
    consts = kw  # mask, lengths
    rng = util.rng_for("grad weights", case.name)
    shape_out = inp.q.shape
    w_out = jnp.asarray(rng.standard_normal(shape_out), jnp.float32)
    lse_shape = (inp.q.shape[1], inp.q.shape[0]) if packed else (
        inp.q.shape[0], inp.q.shape[2], inp.q.shape[1])  # fmt: skip
    w_lse = jnp.asarray(rng.standard_normal(lse_shape), jnp.float32)
    return packed, inp, params, static, consts, rel, (w_out, w_lse)


def _loss_fn(op, packed, inp, static, consts, rel, weights, **extra):
    w_out, w_lse = weights

    def loss(params):
        p = dict(params)
        kw = dict(consts)
        if "table" in p:
            kw["relative_bias"] = jaxattn.RelativeBias(
                p.pop("table"), rel.max_distance, rel.bidirectional
            )
        q, k, v = p.pop("q"), p.pop("k"), p.pop("v")
        out, lse = op(q, k, v, *inp.positional, **static, **kw, **p, return_lse=True, **extra)
        lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
        return jnp.sum(out * w_out) + jnp.sum(lse * w_lse)

    return loss


@pytest.mark.parametrize("impl", util.IMPLEMENTATIONS)
@pytest.mark.parametrize("case", GRAD_CASES, ids=ids)
def test_grad_matches_reference(case, impl):
    packed, inp, params, static, consts, rel, weights = _setup(case)
    op = jaxattn.ragged_attention if packed else jaxattn.attention
    ref_op = jaxattn.ragged_attention_reference if packed else jaxattn.attention_reference
    op = functools.partial(op, implementation=impl, config=util.kernel_config())
    loss = _loss_fn(op, packed, inp, static, consts, rel, weights)
    ref_loss = _loss_fn(ref_op, packed, inp, static, consts, rel, weights)
    # On CPU without LLVM's optimizations (FAST_COMPILE), XLA recomputes the reference's
    # logits for its backward in another rounding than the forward's: the reference's
    # gradient had been inf / NaN there until its softmax left the row max out of it.
    value, grads = jax.jit(jax.value_and_grad(loss), compiler_options=util.FAST_COMPILE)(params)
    ref_value, ref_grads = jax.jit(jax.value_and_grad(ref_loss),
                                   compiler_options=util.FAST_COMPILE)(params)  # fmt: skip
    np.testing.assert_allclose(value, ref_value, **GRAD_TOL)
    for name in params:
        g = np.asarray(grads[name])
        assert g.shape == params[name].shape and g.dtype == params[name].dtype, name
        assert np.isfinite(g).all(), f"d{name}: non-finite values"
        assert np.isfinite(np.asarray(ref_grads[name])).all(), f"reference d{name}: non-finite"
        np.testing.assert_allclose(g, ref_grads[name], **GRAD_TOL, err_msg=name)
    # Padding query rows do not influence anything: their gradient is exactly 0.
    g_q = np.asarray(grads["q"])
    assert (g_q[np.broadcast_to(inp.q_pad[..., None, None], g_q.shape)] == 0).all()

    # Independent check: <grad, u> vs central differences of the float64 oracle.
    rng = util.rng_for("directions", case.name)
    w_out, w_lse = (np.asarray(w, np.float64) for w in weights)

    def oracle_loss(p64):
        inp64 = _with_params(inp, p64, rel, packed)
        out, lse = oracle(inp64, packed)
        return float(np.sum(out * w_out) + np.sum(np.where(np.isfinite(lse), lse, 0.0) * w_lse))

    base = {n: util.f64(x) for n, x in params.items()}
    eps = 1e-4
    for name in params:
        u = rng.standard_normal(base[name].shape)
        plus = dict(base, **{name: base[name] + eps * u})
        minus = dict(base, **{name: base[name] - eps * u})
        fd = (oracle_loss(plus) - oracle_loss(minus)) / (2 * eps)
        got = float(np.sum(np.asarray(grads[name], np.float64) * u))
        scale = float(np.sqrt(np.sum(np.asarray(grads[name], np.float64) ** 2 * u**2)))
        assert abs(got - fd) <= 2e-4 * max(abs(fd), scale, 1.0), (
            f"d{name}: directional derivative {got} vs finite differences {fd}"
        )


def _with_params(inp, p64, rel, packed):
    """A copy of `inp` whose oracle inputs are the float64 arrays in `p64`."""
    import copy

    new = copy.copy(inp)
    new.q, new.k, new.v = p64["q"], p64["k"], p64["v"]
    okw = dict(inp.oracle_kwargs)
    if "bias" in p64:
        okw["bias"] = p64["bias"]
    if "alibi_slopes" in p64:
        okw["alibi_slopes"] = p64["alibi_slopes"]
    if "table" in p64:
        okw["relative_bias"] = (p64["table"], rel.max_distance, rel.bidirectional)
    new.oracle_kwargs = okw
    return new


@pytest.mark.parametrize("impl", util.IMPLEMENTATIONS)
def test_grad_out_only_no_nan(impl):
    """A loss on `out` alone (no lse cotangent), with rows that see no key at all."""
    case = Dense(name="grad_out_only", causal=True, q_lengths=(37, 30), kv_lengths=(20, 0),
                 mask=("B", 1, "Tq", "Tk"))  # fmt: skip
    inp = build_dense(case, "float32")
    kw = {n: x for n, x in inp.kwargs.items() if n not in STATIC_OPTIONS}

    @jax.jit(compiler_options=util.FAST_COMPILE)
    def grads(q, k, v):
        def loss(q, k, v):
            out = jaxattn.attention(
                q, k, v, causal=True, implementation=impl, config=util.kernel_config(), **kw
            )
            return jnp.sum(out**2)

        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    def ref_grads(q, k, v):
        f = lambda q, k, v: jnp.sum(jaxattn.attention_reference(q, k, v, causal=True, **kw) ** 2)  # noqa: E731
        return jax.jit(jax.grad(f, argnums=(0, 1, 2)), compiler_options=util.FAST_COMPILE)(q, k, v)

    got, want = grads(inp.q, inp.k, inp.v), ref_grads(inp.q, inp.k, inp.v)
    for name, g, w in zip("qkv", got, want):
        assert np.isfinite(np.asarray(g)).all(), f"d{name}: non-finite"
        np.testing.assert_allclose(g, w, **GRAD_TOL, err_msg=name)
    # Sequence 1 has no keys: nothing flows to it.
    assert (np.asarray(got[0])[1] == 0).all()
