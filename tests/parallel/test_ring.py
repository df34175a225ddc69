"""Ring attention (`jaxattn.parallel.ring_attention`) inside a user's shard_map, on 2, 4
and 8 host devices: output and gradients against the float64 oracle and the unsharded
reference, for both layouts, causal and full, GQA and MHA, both implementations; the
compiled program's collectives; the sharding of the result; the merge's -inf rows; and
the validation errors."""

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

from jaxattn.parallel import ring
from jaxattn.parallel.ring import ring_attention, zigzag_shard, zigzag_unshard

# (devices, causal, layout, (Hq, Hkv), implementation): every layout x causal x head
# layout on 2 and 4 devices with the einsum blocks; the kernels on the balanced ring, the
# unbalanced one and full attention; one 8-device ring.
CASES = [
    (2, True, "zigzag", (4, 2), "xla"),
    (4, True, "zigzag", (4, 4), "xla"),
    (4, True, "contiguous", (4, 2), "xla"),
    (2, True, "contiguous", (4, 4), "xla"),
    (4, False, "zigzag", (4, 2), "xla"),
    (2, False, "contiguous", (4, 4), "xla"),
    (8, True, "zigzag", (4, 2), "xla"),
    (4, True, "zigzag", (4, 2), "pallas"),
    (2, True, "contiguous", (4, 4), "pallas"),
    (2, False, "zigzag", (4, 2), "pallas"),
]


@pytest.mark.parametrize(
    "n, causal, layout, heads, impl", CASES, ids=["-".join(map(str, c)) for c in CASES]
)
def test_matches_unsharded(n, causal, layout, heads, impl):
    hq, hkv = heads
    q, k, v, g = inputs(("ring", n, causal, layout, heads, impl), n, hq=hq, hkv=hkv)
    m = mesh(n)
    local = lambda q, k, v: ring_attention(  # noqa: E731
        q, k, v, axis_name=AXIS, causal=causal, layout=layout, implementation=impl,
        config=util.CPU_CONFIG,
    )  # fmt: skip
    out, grads = value_and_grads(in_true_order(shard_mapped(local, m), n, layout), q, k, v, g)
    check_against_references(out, grads, q, k, v, g, causal=causal)


def test_cross_attention_scale_and_vma():
    """Full attention with more keys than queries per device and a custom scale, under a
    type-checked shard_map (`check_vma=True`: the einsum blocks carry varying types)."""
    n, scale = 4, 0.37
    q, k, v, g = inputs("ring cross", n, t_local=16, tk_local=32, hq=2, hkv=1)
    local = lambda q, k, v: ring_attention(  # noqa: E731
        q, k, v, axis_name=AXIS, scale=scale, implementation="xla"
    )
    out, grads = value_and_grads(shard_mapped(local, mesh(n), check_vma=True), q, k, v, g)
    check_against_references(out, grads, q, k, v, g, causal=False, scale=scale)


def test_collectives_and_sharding():
    """Forward: 2(n-1) ppermutes (K and V, n-1 hops); with the gradient 2(n-1) more (the
    blocks resent the other way round, not the forward's kept) and 2n for dK/dV (n hops
    home). No all-gather, no all-to-all (the loss's scalar psum is the one all-reduce).
    The output and the gradients stay split like the inputs."""
    n = 4
    m = mesh(n)
    q, k, v, g = (jax.device_put(x, NamedSharding(m, SEQ)) for x in inputs("ring hlo", n))
    local = lambda q, k, v: ring_attention(q, k, v, axis_name=AXIS, causal=True)  # noqa: E731
    f = shard_mapped(local, m)
    forward = compiled(f, q, k, v)
    assert Counter(collectives(forward)) == {"collective-permute": 2 * (n - 1)}
    # The barriers that keep each hop behind the previous step's compute on a GPU (XLA:CPU
    # drops them): one per hop of the forward.
    assert jax.jit(f).lower(q, k, v).as_text().count("optimization_barrier") == n - 1
    step = jax.value_and_grad(lambda q, k, v: jnp.sum(f(q, k, v) * g), argnums=(0, 1, 2))
    want = {"collective-permute": 4 * (n - 1) + 2 * n, "all-reduce": 1}
    gradient = compiled(step, q, k, v)
    assert Counter(collectives(gradient)) == want
    out = forward(q, k, v)
    _, grads = gradient(q, k, v)
    for x in (out, *grads):
        assert_sequence_sharded(x, m)


@pytest.mark.parametrize("n, causal", [(3, False), (2, True)])
def test_hopper_tiling_beside_a_hop_not_persistent(monkeypatch, n, causal):
    """Steps with a hop in flight launch the Hopper kernel a block per tile (a persistent
    launch's fixed shares wait on SMs the hop's NCCL kernel holds); the last step, with
    none in flight, keeps the persistent tiling. The selection is faked to say "Hopper"
    (this machine has none) and the kernel recorded, answering with the einsum block."""
    from jaxattn import MosaicForwardConfig, reference

    tiling = MosaicForwardConfig(64, 128, 2, persistent=True)
    seen = []

    def kernel(q, k, v, *, causal, scale, config):
        seen.append(config.persistent)
        out, lse = reference.attention_reference(
            q, k, v, causal=causal, scale=scale, return_lse=True
        )
        return out, lse

    monkeypatch.setattr(ring, "select_forward", lambda *args, **kw: tiling)
    monkeypatch.setattr(ring, "mosaic_forward", kernel)
    q, k, v, _ = inputs(("persistent", n, causal), n)
    local = lambda q, k, v: ring_attention(  # noqa: E731
        q, k, v, axis_name=AXIS, causal=causal, implementation="pallas"
    )
    out = in_true_order(shard_mapped(local, mesh(n)), n, "zigzag")(q, k, v)
    # Traced once: the diagonal, then each later step's kernel (causal zig-zag steps trace
    # both branches of their cond: two kernels a step).
    per_step = 2 if causal else 1
    assert seen == [False] * (1 + per_step * (n - 2)) + [True] * per_step
    want = reference.attention_reference(q, k, v, causal=causal)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


def test_zigzag_layout():
    """Device i's share of the zig-zag order is chunks i and 2n-1-i; unshard inverts; a
    negative axis counts from the end (it raised)."""
    n, chunk = 4, 3
    x = jnp.arange(2 * n * chunk * 2).reshape(2, 2 * n * chunk)  # [B, T]
    z = zigzag_shard(x, n, axis=1)
    for i in range(n):
        share = np.asarray(z[:, 2 * chunk * i : 2 * chunk * (i + 1)])
        want = np.concatenate(
            [np.asarray(x)[:, c * chunk : (c + 1) * chunk] for c in (i, 2 * n - 1 - i)], 1
        )
        np.testing.assert_array_equal(share, want)
    np.testing.assert_array_equal(zigzag_unshard(z, n, axis=1), x)
    for axis in (-1, -2):  # counted from the end, as numpy does
        y = x[:, None, :] if axis == -1 else x[:, :, None]  # [B, 1, T] or [B, T, 1]
        for fn in (zigzag_shard, zigzag_unshard):
            want = fn(y, n, axis=y.ndim + axis)
            np.testing.assert_array_equal(fn(y, n, axis=axis), want, err_msg=f"{fn} {axis}")


def test_merge_rows_without_keys():
    """Partial results whose lse is -inf (a row that saw no key yet, or none in this
    block) add nothing, and two -inf partials stay (0, -inf): never NaN."""
    rng = util.rng_for("ring merge")
    out_a, out_b = util.randn(rng, (1, 3, 2, 4)), util.randn(rng, (1, 3, 2, 4))
    lse_a = jnp.array([[[0.5, -jnp.inf, -jnp.inf], [1.0, 2.0, -jnp.inf]]])  # [B, H, T]
    lse_b = jnp.array([[[-jnp.inf, 0.3, -jnp.inf], [0.0, -jnp.inf, -jnp.inf]]])
    zero = lambda o, l: jnp.where(jnp.isfinite(l).transpose(0, 2, 1)[..., None], o, 0.0)  # noqa: E731
    out, lse = ring._merge((zero(out_a, lse_a), lse_a), (zero(out_b, lse_b), lse_b))
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_a) & np.isneginf(lse_b))
    np.testing.assert_allclose(out[0, 0, 0], out_a[0, 0, 0], rtol=1e-6)  # b adds nothing
    np.testing.assert_allclose(out[0, 1, 0], out_b[0, 1, 0], rtol=1e-6)
    assert (np.asarray(out[0, 2]) == 0).all()
    w = jax.nn.softmax(jnp.array([1.0, 0.0]))  # head 1, row 0: both contribute
    np.testing.assert_allclose(
        out[0, 0, 1], w[0] * out_a[0, 0, 1] + w[1] * out_b[0, 0, 1], rtol=1e-6
    )


def test_large_logits_finite():
    """Logits of magnitude ~100: most blocks' probabilities underflow against the row's
    maximum; the merged output and gradients stay finite and match the oracle (to what
    float32 logits of that size allow: 1e-5 relative error in s is 1e-3 in P)."""
    n = 2
    q, k, v, g = inputs("ring large logits", n, scale=8.0)
    local = lambda q, k, v: ring_attention(  # noqa: E731
        q, k, v, axis_name=AXIS, causal=True, implementation="xla"
    )
    out, grads = value_and_grads(
        in_true_order(shard_mapped(local, mesh(n)), n, "zigzag"), q, k, v, g
    )
    for x in (out, *grads):
        assert np.isfinite(np.asarray(x)).all()
    check_against_references(out, grads, q, k, v, g, causal=True, tol=dict(rtol=2e-3, atol=2e-3))


@pytest.mark.parametrize(
    "shapes, kwargs, match",
    [
        (((2, 8, 4, 16), (2, 8, 4)), {}, "rank 4"),
        (((2, 8, 3, 16), (2, 8, 2, 16)), {}, "multiple of num_kv_heads"),
        (((2, 8, 4, 16), (2, 16, 2, 16)), dict(causal=True), "Tq == Tk"),
        (((2, 7, 4, 16), (2, 7, 2, 16)), dict(causal=True), "even"),
        (((2, 8, 4, 16), (2, 8, 2, 16)), dict(layout="striped"), "layout"),
        (((2, 8, 4, 16), (2, 8, 2, 16)), dict(axis_name="nope"), "not bound"),
    ],
)
def test_validation(shapes, kwargs, match):
    q_shape, k_shape = shapes
    q, k = jnp.ones(q_shape), jnp.ones(k_shape)
    kwargs = dict(dict(axis_name=AXIS), **kwargs)
    local = lambda q, k: ring_attention(q, k, k, **kwargs)  # noqa: E731
    f = jax.shard_map(local, mesh=mesh(1), in_specs=(jax.P(), jax.P()), out_specs=jax.P())
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(f, q, k)
