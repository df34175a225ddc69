"""Our kernels inside a user's own `jax.shard_map` with `check_vma=True` (its default).

A shard_map that checks types asks every value which mesh axes it varies over; a kernel's
outputs say so only if its call names them (`pallas_kernels.common.typed_like`: the axes
its inputs vary over) or they are cast afterwards (`varying_like`, for the Hopper kernels:
`plgpu.kernel` types its outputs invariant). On a GPU the kernels run under such a
shard_map (a one-device mesh) and give the bits they give outside one: `attention`'s
forward and gradient on the Hopper kernels (sm90) and on the Triton ones, `paged_decode`,
and `ring_attention`. On CPU the kernels run in Pallas's interpreter, which jax cannot
trace under `check_vma=True` (it pads a kernel's operands with an invariant zero), so
there only the typing is checked: pass `check_vma=False` to run the interpreter inside a
shard_map.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import util
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jaxattn
from jaxattn.parallel import ring_attention
from pallas_kernels.common import typed_like, varying_like

AXIS = "x"
gpu_only = pytest.mark.skipif(not util.ON_GPU, reason="Pallas's interpreter under check_vma")


def one_device_mesh():
    return jax.make_mesh((1,), (AXIS,), axis_types=(AxisType.Auto,), devices=jax.devices()[:1])


def test_typed_like_names_the_inputs_varying_axes():
    out = [jax.ShapeDtypeStruct((3, 2), jnp.float32), jax.ShapeDtypeStruct((3,), jnp.int32)]
    seen = {}

    def body(split, whole):
        seen["both"] = typed_like(out, [split, whole])
        seen["whole"] = typed_like(out, [whole])
        # An output typed invariant (as plgpu.kernel types them), cast to vary like split.
        cast = varying_like({"a": whole * 2}, [split, whole])
        seen["cast"] = set(jax.typeof(cast["a"]).manual_axis_type.varying)
        seen["kept"] = varying_like(whole, [whole]) is whole
        return split + cast["a"]

    x = jnp.zeros((2, 4))
    jax.shard_map(body, mesh=one_device_mesh(), in_specs=(P(AXIS), P()), out_specs=P(AXIS))(x, x)
    for name, want in (("both", {AXIS}), ("whole", set())):
        got = seen[name]
        assert [(s.shape, s.dtype) for s in got] == [(s.shape, s.dtype) for s in out]
        assert all(set(s.manual_axis_type.varying) == want for s in got), name
    assert seen["cast"] == {AXIS} and seen["kept"]
    outside = typed_like(out, [x])  # no shard_map: no axes
    assert all(not s.manual_axis_type.varying for s in outside)


def traced_for_cuda(monkeypatch, body, in_specs, out_specs, *args) -> str:
    """The jaxpr of `body` under a checking shard_map, the Triton kernels traced for CUDA
    (`JAXATTN_INTERPRET=0`: nothing runs, so this machine needs no GPU)."""
    monkeypatch.setenv("JAXATTN_INTERPRET", "0")
    mapped = jax.shard_map(body, mesh=one_device_mesh(), in_specs=in_specs, out_specs=out_specs)
    return str(jax.make_jaxpr(mapped)(*args))


def test_gradient_of_a_replicated_input_is_summed(monkeypatch):
    """q, k, v split, ALiBi slopes replicated: each device's d_slopes is a partial sum,
    so the gradient must psum it (as the XLA path's autodiff does); k and v replicated
    with q split: their gradients too. Before, d_slopes came back typed replicated and
    unsummed, and replicated k, v raised in the custom VJP."""
    q = jnp.ones((1, 128, 4, 64), jnp.bfloat16)
    k = v = jnp.ones((1, 128, 2, 64), jnp.bfloat16)
    slopes = jnp.ones((4,), jnp.float32)

    def grads(q, k, v, slopes):
        def loss(q, k, v, slopes):
            out = jaxattn.attention(
                q, k, v, causal=True, alibi_slopes=slopes, implementation="pallas"
            )
            return out.astype(jnp.float32).sum()

        return jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, slopes)

    split, whole = P(AXIS), P()
    for specs in ((split, split, split, whole), (split, whole, whole, whole)):
        jaxpr = traced_for_cuda(monkeypatch, grads, specs, specs, q, k, v, slopes)
        assert "psum" in jaxpr, specs


def test_pool_written_in_place_varies(monkeypatch):
    """A pool updated in place by a kernel from varying data varies too: a replicated
    out_spec for it is refused (it had been taken at its input's word)."""
    from pallas_kernels.common import whole_array_call

    def kernel(x_ref, pool_ref, out_ref, pool_out_ref):
        out_ref[...] = x_ref[...]
        pool_out_ref[...] = x_ref[...]

    def body(x, pool):
        out = [jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(pool.shape, pool.dtype)]
        return whole_array_call(
            kernel, [x, pool], out, grid=(1,), num_warps=4, num_stages=1, interpret=False,
            name="write", aliases={1: 1},
        )  # fmt: skip

    x = jnp.ones((8, 128))
    with pytest.raises(ValueError, match="replicated"):
        traced_for_cuda(monkeypatch, body, (P(AXIS), P()), (P(AXIS), P()), x, x)
    traced_for_cuda(monkeypatch, body, (P(AXIS), P()), (P(AXIS), P(AXIS)), x, x)


def in_shard_map(fn, *args):
    """fn(*args) inside a checking shard_map splitting every argument's first axis."""
    specs = tuple(P(AXIS) for _ in args)
    return jax.jit(jax.shard_map(fn, mesh=one_device_mesh(), in_specs=specs, out_specs=P(AXIS)))(
        *args
    )


def qkv(name, b=2, t=256, hq=4, hkv=2, d=64):
    rng = util.rng_for("shard_map types", name)
    q = util.randn(rng, (b, t, hq, d), "bfloat16")
    k, v = (util.randn(rng, (b, t, hkv, d), "bfloat16") for _ in range(2))
    return q, k, v


def assert_same(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


BACKENDS = {
    "auto": None,  # the Hopper kernels on sm90
    "triton": jaxattn.FlashPrefillConfig(
        backend="triton", backward=jaxattn.FlashBackwardConfig(backend="triton")
    ),
}


@gpu_only
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_attention_and_gradient(backend):
    q, k, v = qkv(backend)
    g = util.randn(util.rng_for("shard_map types", "g"), q.shape, "bfloat16")

    def forward_and_grads(q, k, v, g):
        def attend(q, k, v):
            return jaxattn.attention(
                q, k, v, causal=True, implementation="pallas", config=BACKENDS[backend]
            )

        out, pull = jax.vjp(attend, q, k, v)
        return (out, *pull(g))

    assert_same(in_shard_map(forward_and_grads, q, k, v, g), jax.jit(forward_and_grads)(q, k, v, g))


@gpu_only
def test_ring_attention():
    q, k, v = qkv("ring")

    def ring(q, k, v):
        return ring_attention(q, k, v, axis_name=AXIS, causal=True, implementation="pallas")

    want = jax.jit(jaxattn.attention, static_argnames=("causal", "implementation"))(
        q, k, v, causal=True, implementation="pallas"
    )
    np.testing.assert_allclose(
        np.asarray(in_shard_map(ring, q, k, v), np.float32),
        np.asarray(want, np.float32),
        atol=2e-2,
    )


@gpu_only
def test_paged_decode():
    rng = util.rng_for("shard_map types", "decode")
    b, hq, hkv, d, page, pages = 4, 8, 2, 64, 16, 4
    shape = (b * pages, hkv, page, d)
    cache = jaxattn.PagedKVCache(
        util.randn(rng, shape, "bfloat16"), util.randn(rng, shape, "bfloat16")
    )
    q = util.randn(rng, (b, hq, d), "bfloat16")
    tables = jnp.asarray(rng.permutation(b * pages).reshape(b, pages), jnp.int32)
    lengths = jnp.asarray([1, 17, 40, 64], jnp.int32)

    def decode(q, tables, lengths):  # the pool whole on every device
        return jaxattn.paged_decode(q, cache, tables, lengths, implementation="pallas")

    assert_same(in_shard_map(decode, q, tables, lengths), jax.jit(decode)(q, tables, lengths))
