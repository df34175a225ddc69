"""All-to-all (Ulysses) attention inside a user's shard_map, and the global-array wrapper
`context_parallel_attention` (method choice, placement, both mesh modes): output and
gradients against the float64 oracle and the unsharded reference, the options of
`attention` (per-head ones sliced), the kv-head rule, the collectives, the shardings and a
sequence with no keys."""

from __future__ import annotations

from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import util
from context_cases import (
    AXIS,
    SEQ,
    TOL,
    assert_sequence_sharded,
    check_against_references,
    collectives,
    compiled,
    in_true_order,
    inputs,
    mesh,
    shard_mapped,
    value_and_grads,
)
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxattn
from jaxattn.parallel.context import choose_method, context_parallel_attention
from jaxattn.parallel.ring import zigzag_shard
from jaxattn.parallel.ulysses import kv_heads_on_the_wire, ulysses_attention

# (devices, causal, layout, (Hq, Hkv), implementation). GQA 4/2 on 4 devices sends each kv
# head to two devices; on 2 devices the kv heads split with their queries.
CASES = [
    (4, True, "contiguous", (4, 2), "xla"),
    (2, True, "zigzag", (4, 2), "xla"),
    (4, False, "zigzag", (4, 4), "xla"),
    (8, True, "zigzag", (8, 2), "xla"),
    (4, True, "zigzag", (4, 2), "pallas"),
]


@pytest.mark.parametrize(
    "n, causal, layout, heads, impl", CASES, ids=["-".join(map(str, c)) for c in CASES]
)
def test_matches_unsharded(n, causal, layout, heads, impl):
    hq, hkv = heads
    q, k, v, g = inputs(("ulysses", n, causal, layout, heads, impl), n, hq=hq, hkv=hkv)
    local = lambda q, k, v: ulysses_attention(  # noqa: E731
        q, k, v, axis_name=AXIS, causal=causal, layout=layout, implementation=impl,
        config=util.CPU_CONFIG,
    )  # fmt: skip
    f = in_true_order(shard_mapped(local, mesh(n)), n, layout)
    out, grads = value_and_grads(f, q, k, v, g)
    check_against_references(out, grads, q, k, v, g, causal=causal)


def test_options_and_empty_sequence():
    """attention's options through the all-to-all, on global arrays in true order: lengths
    (sequence 1 has no keys: zeros, lse -inf, finite zero gradients), a window, ALiBi
    slopes and a per-head bias (sliced to each device's heads), the lse; zig-zag layout."""
    n, hq, hkv = 2, 4, 2
    q, k, v, g = inputs("ulysses options", n, hq=hq, hkv=hkv)
    t = q.shape[1]
    rng = util.rng_for("ulysses options extras")
    opts = dict(
        q_lengths=jnp.array([t - 5, t], jnp.int32),
        kv_lengths=jnp.array([t - 3, 0], jnp.int32),
        window=9,
        alibi_slopes=jaxattn.alibi_slopes(hq),
        bias=util.randn(rng, (1, hq, t, t)),
    )
    local = lambda q, k, v: ulysses_attention(  # noqa: E731
        q, k, v, axis_name=AXIS, causal=True, layout="zigzag", return_lse=True,
        implementation="xla", **opts,
    )  # fmt: skip
    f = jax.shard_map(
        local, mesh=mesh(n), in_specs=(SEQ,) * 3, out_specs=(SEQ, P(None, None, AXIS))
    )
    zz = lambda x, axis=1: zigzag_shard(x, n, axis)  # noqa: E731
    out, lse = jax.jit(f)(zz(q), zz(k), zz(v))
    want_out, want_lse = jaxattn.attention(
        q, k, v, causal=True, return_lse=True, implementation="xla", **opts
    )
    np.testing.assert_allclose(out, zz(want_out), **TOL)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(zz(want_lse, 2)))
    np.testing.assert_allclose(lse[np.isfinite(lse)], zz(want_lse, 2)[np.isfinite(lse)], **TOL)
    assert (np.asarray(out[1]) == 0).all() and np.isneginf(np.asarray(lse[1])).all()
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a)[0] * zz(g)), argnums=(0, 1, 2)))(
        zz(q), zz(k), zz(v)
    )
    want_grads = jax.jit(
        jax.grad(
            lambda q, k, v: jnp.sum(
                jaxattn.attention(q, k, v, causal=True, implementation="xla", **opts) * g
            ),
            argnums=(0, 1, 2),
        )
    )(q, k, v)
    for got, want in zip(grads, want_grads):
        assert np.isfinite(np.asarray(got)).all()
        np.testing.assert_allclose(got, zz(want), **TOL)
    assert (np.asarray(grads[1][1]) == 0).all()  # dk of the sequence with no keys


def test_collectives_and_sharding():
    """Three all-to-alls in (q, k, v) and one out; with the gradient three back and one
    more (dO in, dq/dk/dv out: their transposes). No all-gather, no ppermute."""
    n = 4
    m = mesh(n)
    q, k, v, g = (jax.device_put(x, NamedSharding(m, SEQ)) for x in inputs("ulysses hlo", n))
    local = lambda q, k, v: ulysses_attention(q, k, v, axis_name=AXIS, causal=True)  # noqa: E731
    f = shard_mapped(local, m)
    forward = compiled(f, q, k, v)
    assert Counter(collectives(forward)) == {"all-to-all": 4}
    step = jax.value_and_grad(lambda q, k, v: jnp.sum(f(q, k, v) * g), argnums=(0, 1, 2))
    gradient = compiled(step, q, k, v)
    assert Counter(collectives(gradient)) == {"all-to-all": 8, "all-reduce": 1}
    out = forward(q, k, v)
    _, grads = gradient(q, k, v)
    for x in (out, *grads):
        assert_sequence_sharded(x, m)


def test_kv_head_rule():
    assert kv_heads_on_the_wire(8, 8, 4) == 8  # split with their query heads
    assert kv_heads_on_the_wire(8, 2, 4) == 4  # each sent to two devices
    assert kv_heads_on_the_wire(8, 1, 8) == 8  # MQA: to every device
    with pytest.raises(ValueError, match="multiple of 4"):
        kv_heads_on_the_wire(6, 2, 4)
    with pytest.raises(ValueError, match="divide"):
        kv_heads_on_the_wire(6, 3, 2)


def test_choose_method():
    b, d = 1, 128
    shape = lambda t, h: (b, t, h, d)  # noqa: E731
    # Heads that do not split: ring, whatever the length.
    assert choose_method(shape(512, 6), shape(512, 2), 4, causal=True) == "ring"
    # Short sequences per device: ring's transfers cannot hide; all-to-all moves less.
    assert choose_method(shape(128, 32), shape(128, 8), 8, causal=True) == "ulysses"
    # Long ones: ring's transfers hide under the block compute.
    assert choose_method(shape(8192, 32), shape(8192, 8), 8, causal=True) == "ring"
    # Options only the all-to-all path takes.
    assert (
        choose_method(shape(8192, 32), shape(8192, 8), 8, causal=True, options=("window",))
        == "ulysses"
    )
    with pytest.raises(ValueError, match="multiple"):
        choose_method(shape(64, 6), shape(64, 2), 4, causal=True, options=("window",))


@pytest.mark.parametrize("explicit", [False, True], ids=["auto", "explicit"])
@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_global_wrapper(method, explicit):
    """context_parallel_attention on global arrays placed anywhere: the result split along
    the sequence on the mesh, equal to the unsharded attention (zig-zag order in/out)."""
    n = 4
    m = mesh(n, explicit=explicit)
    q, k, v, g = inputs(("wrapper", method, explicit), n)
    zz = lambda x: zigzag_shard(x, n)  # noqa: E731
    out = context_parallel_attention(
        zz(q), zz(k), zz(v), mesh=m, axis_name=AXIS, causal=True, layout="zigzag",
        method=method,
    )  # fmt: skip
    assert_sequence_sharded(out, m)
    want = jaxattn.attention(q, k, v, causal=True, implementation="xla")
    np.testing.assert_allclose(out, zz(want), **TOL)


def test_global_wrapper_options_as_attention_takes_them():
    """Options as `attention` takes them: ALiBi slopes as a list (they had been taken for a
    static option, unhashable), and `window=0` an error (it had been dropped as a default)."""
    n, hq = 4, 4
    m = mesh(n, explicit=False)
    q, k, v, _ = inputs("wrapper options", n, hq=hq, hkv=2)
    slopes = [float(x) for x in jaxattn.alibi_slopes(hq)]
    out = context_parallel_attention(q, k, v, mesh=m, axis_name=AXIS, causal=True,
                                     alibi_slopes=slopes, implementation="xla")  # fmt: skip
    want = jaxattn.attention(q, k, v, causal=True, alibi_slopes=slopes, implementation="xla")
    np.testing.assert_allclose(out, want, **TOL)
    with pytest.raises(ValueError, match="window"):
        context_parallel_attention(q, k, v, mesh=m, axis_name=AXIS, causal=True, window=0,
                                   implementation="xla")  # fmt: skip


def test_global_wrapper_gradients():
    """The wrapper under jit and grad, in natural order, the method left to the rule."""
    n = 4
    q, k, v, g = inputs("wrapper grad", n)
    f = lambda q, k, v: context_parallel_attention(  # noqa: E731
        q, k, v, mesh=mesh(n), axis_name=AXIS, causal=True
    )
    out, grads = value_and_grads(f, q, k, v, g)
    check_against_references(out, grads, q, k, v, g, causal=True)


@pytest.mark.parametrize(
    "heads, kwargs, match",
    [
        ((6, 2), {}, "multiple of 4"),
        ((4, 2), dict(layout="striped"), "layout"),
        ((4, 2), dict(axis_name="nope"), "not bound"),
    ],
)
def test_validation(heads, kwargs, match):
    q, k = jnp.ones((1, 8, heads[0], 16)), jnp.ones((1, 8, heads[1], 16))
    kwargs = dict(dict(axis_name=AXIS), **kwargs)
    local = lambda q, k: ulysses_attention(q, k, k, **kwargs)  # noqa: E731
    f = jax.shard_map(local, mesh=mesh(4), in_specs=(SEQ, SEQ), out_specs=SEQ)
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(f, q, k)


def test_wrapper_refuses_ring_options():
    q = jnp.ones((1, 16, 4, 16))
    with pytest.raises(ValueError, match="ring attention takes causal and scale only"):
        context_parallel_attention(q, q, q, mesh=mesh(2), axis_name=AXIS, method="ring", window=4)
