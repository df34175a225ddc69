"""Sharded calls whose axes or placements are less usual: a sequence split over mesh axes
listed out of the mesh's order (the ring's shifts), an operand never placed beside
explicitly sharded ones, and the context-parallel method for causal Tq != Tk. Oracle: the
unsharded XLA path."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxattn
from jaxattn.parallel import context_parallel_attention, ring_attention, shard_cache
from pallas_kernels.flash_backward import FlashBackwardConfig
from pallas_kernels.flash_prefill import FlashPrefillConfig

CONFIG = FlashPrefillConfig(
    block_q=16,
    block_kv=16,
    num_warps=4,
    num_stages=1,
    backward=FlashBackwardConfig(16, 16, 16, 16, (4, 4), (1, 1)),
)
TOL = dict(rtol=2e-5, atol=2e-5)


def _qkv(seed, b, tq, hq, hkv, d=16, tk=None):
    ks = jax.random.split(jax.random.key(seed), 3)
    tk = tk or tq
    return (
        jax.random.normal(ks[0], (b, tq, hq, d)),
        jax.random.normal(ks[1], (b, tk, hkv, d)),
        jax.random.normal(ks[2], (b, tk, hkv, d)),
    )


# A ring over a tuple of mesh axes listed out of the mesh's order.
def test_ring_attention_over_axes_out_of_mesh_order():
    """The sequence split over ("model", "data") of a ("data", "model") mesh: ppermute
    numbers the devices of a tuple of axes in mesh order, axis_index (and the shards) in
    the tuple's; causal attention sees which block each step holds."""
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    ax = ("model", "data")
    q, k, v = _qkv(4, 1, 32, 4, 4)
    want = jaxattn.attention(q, k, v, causal=True, implementation="xla")
    f = jax.shard_map(
        lambda q, k, v: ring_attention(
            q, k, v, axis_name=ax, causal=True, layout="contiguous", implementation="xla"
        ),
        mesh=mesh,
        in_specs=(P(None, ax),) * 3,
        out_specs=P(None, ax),
        check_vma=False,
    )
    np.testing.assert_allclose(jax.jit(f)(q, k, v), want, **TOL)


def test_attention_sequence_split_over_axes_out_of_mesh_order():
    """The same through jaxattn.attention's partition rule (its ring for a sequence split):
    q, k, v placed P(None, ("model", "data")), causal."""
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    q, k, v = _qkv(5, 2, 32, 4, 2)
    args = [jax.device_put(x, NamedSharding(mesh, P(None, ("model", "data")))) for x in (q, k, v)]
    f = jax.jit(
        lambda q, k, v: jaxattn.attention(
            q, k, v, causal=True, implementation="pallas", config=CONFIG
        )
    )
    want = jaxattn.attention(q, k, v, causal=True, implementation="xla")
    np.testing.assert_allclose(f(*args), want, **TOL)


# Explicit mesh (jax.make_mesh's default), an operand never placed.
def test_paged_decode_sharded_cache_with_unplaced_query():
    """The README's flow: an explicit mesh (jax.make_mesh's default), the cache placed by
    shard_cache, and a q never placed: the op takes the mesh from the placed operands."""
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    assert mesh.axis_types == (AxisType.Explicit,) * 2
    hkv, d = 4, 16
    cache = jaxattn.PagedKVCache.create(16, 8, hkv, d, dtype=jnp.float32)
    tables = jnp.arange(16, dtype=jnp.int32).reshape(4, 4)
    lens = jnp.array([24, 10, 3, 17], jnp.int32)
    pos = jnp.arange(32)
    slots = (tables[:, :, None] * 8 + jnp.arange(8)).reshape(4, 32)
    slots = jnp.where(pos[None] < lens[:, None], slots, -1)[:, :24].reshape(-1)
    kk = jax.random.normal(jax.random.key(1), (96, hkv, d))
    cache = jaxattn.write_kv(cache, kk, kk * 0.5, slots)
    q = jax.random.normal(jax.random.key(7), (4, 8, d))
    want = jaxattn.paged_decode(q, cache, tables, lens, implementation="xla")
    sharded = shard_cache(cache, mesh, "model")
    f = jax.jit(lambda q, c, t, n: jaxattn.paged_decode(q, c, t, n, implementation="pallas"))
    np.testing.assert_allclose(f(q, sharded, tables, lens), want, **TOL)


def test_attention_unplaced_query_explicit_kv_heads_split():
    """The same for attention: k, v split by kv head on an explicit mesh, q unplaced."""
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    q, k, v = _qkv(2, 2, 32, 8, 4)
    put = lambda x: jax.device_put(x, NamedSharding(mesh, P("data", None, "model")))  # noqa: E731
    f = jax.jit(
        lambda q, k, v: jaxattn.attention(
            q, k, v, causal=True, implementation="pallas", config=CONFIG
        )
    )
    want = jaxattn.attention(q, k, v, causal=True, implementation="xla")
    np.testing.assert_allclose(f(q, put(k), put(v)), want, **TOL)


# context_parallel_attention's automatic method.
def test_context_parallel_default_method_causal_cross_attention():
    """Causal with more keys than queries (a chunk after a prefix): the ring refuses it, so
    method=None takes ulysses even where the ring's transfers would hide."""
    mesh = jax.make_mesh((2,), ("sp",), axis_types=(AxisType.Auto,), devices=jax.devices()[:2])
    q, k, v = _qkv(3, 1, 512, 8, 1, tk=1024)
    want = jaxattn.attention(q, k, v, causal=True, implementation="xla")
    ok = context_parallel_attention(
        q, k, v, mesh=mesh, axis_name="sp", causal=True, method="ulysses", implementation="xla"
    )
    np.testing.assert_allclose(ok, want, **TOL)
    out = context_parallel_attention(
        q, k, v, mesh=mesh, axis_name="sp", causal=True, implementation="xla"
    )
    np.testing.assert_allclose(out, want, **TOL)
