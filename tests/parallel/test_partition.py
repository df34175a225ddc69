"""Partition rules: the kernels on arrays sharded along batch and heads run shard-local.

Each case runs the jitted op on sharded inputs (auto axes: the partitioner's
custom_partitioning; explicit axes: shard_map from the types) and checks the result and
gradients against the unsharded reference, the output's sharding, and that the compiled
program gathers no operand."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxattn
from jaxattn.parallel import (
    cache_sharding,
    context_parallel_attention,
    partition,
    ring_attention,
    shard_cache,
)
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


def _mesh(explicit: bool):
    axis_type = AxisType.Explicit if explicit else AxisType.Auto
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(axis_type, axis_type))


def _put(mesh, x, *spec):
    return jax.device_put(x, NamedSharding(mesh, P(*spec)))


_GATHER = re.compile(r"= \w+\[([\d,]*)\][^=]*? all-gather(?:-start)?\(")


def _gathered_sizes(f, *args) -> list[int]:
    """Element counts of the all-gathers in f's compiled program."""
    hlo = f.lower(*args).compile().as_text()
    sizes = []
    for dims in _GATHER.findall(hlo):
        sizes.append(int(np.prod([int(d) for d in dims.split(",") if d])))
    return sizes


def _no_operand_gather(f, *args, below: int = 64):
    """No all-gather of anything larger than `below` elements (a gradient of 8 ALiBi slopes
    resharded to its primal's replicated type may be gathered; q, k, v never)."""
    sizes = _gathered_sizes(f, *args)
    assert all(n < below for n in sizes), f"all-gathers of {sizes} elements"


def _spec(x) -> tuple:
    spec = tuple(x.sharding.spec)
    return spec + (None,) * (x.ndim - len(spec))


def _qkv(key, batch, tokens, heads, kv_heads, dim=16):
    ks = jax.random.split(key, 4)
    q = jax.random.normal(ks[0], (batch, tokens, heads, dim))
    k = jax.random.normal(ks[1], (batch, tokens, kv_heads, dim))
    v = jax.random.normal(ks[2], (batch, tokens, kv_heads, dim))
    g = jax.random.normal(ks[3], (batch, tokens, heads, dim))
    return q, k, v, g


@pytest.mark.parametrize("explicit", [False, True], ids=["auto", "explicit"])
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["kv-split", "kv-replicated"])
def test_attention_and_gradient_stay_sharded(explicit, kv_heads):
    """Batch over 'data', heads over 'model' (4 shards): with 4 kv heads each shard holds
    one; with 2, kv heads are replicated and each shard slices the one its queries read."""
    mesh = _mesh(explicit)
    q, k, v, g = _qkv(jax.random.key(kv_heads + 10 * explicit), 2, 32, 8, kv_heads)
    slopes = jaxattn.alibi_slopes(8)
    kv_axis = "model" if kv_heads % 4 == 0 else None
    args = (
        _put(mesh, q, "data", None, "model"),
        _put(mesh, k, "data", None, kv_axis),
        _put(mesh, v, "data", None, kv_axis),
        _put(mesh, slopes),
    )

    def attend(q, k, v, slopes, impl="pallas"):
        return jaxattn.attention(
            q, k, v, causal=True, alibi_slopes=slopes, implementation=impl, config=CONFIG
        )

    def loss(q, k, v, slopes, impl="pallas"):
        return jnp.sum(attend(q, k, v, slopes, impl) * g)

    forward = jax.jit(attend)
    out = forward(*args)
    np.testing.assert_allclose(out, attend(q, k, v, slopes, "xla"), **TOL)
    assert _spec(out) == ("data", None, "model", None)
    _no_operand_gather(forward, *args)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
    grads = grad(*args)
    expected = jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, slopes, "xla")
    for got, want, x in zip(grads, expected, args, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
        assert _spec(got)[:3] == _spec(x)[:3] or not explicit  # types match in explicit mode
    assert _spec(grads[0]) == ("data", None, "model", None)
    _no_operand_gather(grad, *args)


def test_bias_gradient_summed_over_the_batch_shards():
    """A bias broadcast over the batch ([1, H, Tq, Tk]) gets its gradient summed over the
    'data' shards; a per-head one split like the heads."""
    mesh = _mesh(False)
    q, k, v, g = _qkv(jax.random.key(3), 2, 16, 4, 4)
    bias = jax.random.normal(jax.random.key(4), (1, 4, 16, 16))
    args = (
        _put(mesh, q, "data", None, "model"),
        _put(mesh, k, "data", None, "model"),
        _put(mesh, v, "data", None, "model"),
        _put(mesh, bias, None, "model"),
    )

    def loss(q, k, v, bias, impl="pallas"):
        out = jaxattn.attention(q, k, v, bias=bias, implementation=impl, config=CONFIG)
        return jnp.sum(out * g)

    grad = jax.jit(jax.grad(loss, argnums=(0, 3)))
    dq, d_bias = grad(*args)
    want_dq, want_bias = jax.grad(loss, argnums=(0, 3))(q, k, v, bias, "xla")
    np.testing.assert_allclose(dq, want_dq, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(d_bias, want_bias, rtol=1e-4, atol=1e-4)
    _no_operand_gather(grad, *args)


def test_ragged_attention_split_by_heads():
    mesh = _mesh(False)
    ks = jax.random.split(jax.random.key(5), 3)
    q = jax.random.normal(ks[0], (40, 8, 16))
    k = jax.random.normal(ks[1], (40, 4, 16))
    v = jax.random.normal(ks[2], (40, 4, 16))
    cu = jnp.array([0, 13, 30, 37], jnp.int32)

    def attend(q, k, v, impl="pallas"):
        return jaxattn.ragged_attention(
            q, k, v, cu, cu, causal=True, implementation=impl, config=CONFIG
        )

    args = (
        _put(mesh, q, None, "model"),
        _put(mesh, k, None, "model"),
        _put(mesh, v, None, "model"),
    )
    f = jax.jit(attend)
    out = f(*args)
    np.testing.assert_allclose(out, attend(q, k, v, "xla"), **TOL)
    assert _spec(out) == (None, "model", None)
    _no_operand_gather(f, *args)


def test_vmap_of_a_sharded_call():
    """vmap over the kernel's partitioned call: the vmapped axis whole, the rest split."""
    mesh = _mesh(False)
    q, k, v, _ = _qkv(jax.random.key(6), 6, 16, 8, 4)
    q, k, v = (x.reshape(3, 2, *x.shape[1:]) for x in (q, k, v))

    def attend(q, k, v, impl="pallas"):
        return jaxattn.attention(q, k, v, causal=True, implementation=impl, config=CONFIG)

    args = [_put(mesh, x, None, "data", None, "model") for x in (q, k, v)]
    out = jax.jit(jax.vmap(attend))(*args)
    np.testing.assert_allclose(out, jax.vmap(lambda *a: attend(*a, impl="xla"))(q, k, v), **TOL)
    assert _spec(out) == (None, "data", None, "model", None)


def _filled_cache(kv_heads, quant=None):
    """A cache of 4 sequences (lengths 40, 17, 33, 5) in scattered pages of 8 tokens."""
    cache = jaxattn.PagedKVCache.create(32, 8, kv_heads, 16, dtype=jnp.float32, quant=quant)
    lens = jnp.array([40, 17, 33, 5])
    tables = (jnp.arange(20).reshape(4, 5)[:, ::-1] * 7) % 32
    ks = jax.random.split(jax.random.key(kv_heads), 2)
    k = jax.random.normal(ks[0], (160, kv_heads, 16))
    v = jax.random.normal(ks[1], (160, kv_heads, 16))
    pos, seq = jnp.tile(jnp.arange(40), 4), jnp.repeat(jnp.arange(4), 40)
    slots = jnp.where(pos < lens[seq], tables[seq, pos // 8] * 8 + pos % 8, -1)
    return jaxattn.write_kv(cache, k, v, slots), tables, lens


@pytest.mark.parametrize(
    "kv_heads, quant",
    [(4, None), (2, None), (4, jaxattn.KVQuant("int8", "group", group_size=8))],
    ids=["kv-split", "kv-replicated", "int8-group"],
)
@pytest.mark.parametrize("explicit", [False, True], ids=["auto", "explicit"])
def test_paged_decode_over_a_cache_split_by_kv_head(kv_heads, quant, explicit):
    mesh = _mesh(explicit)
    cache, tables, lens = _filled_cache(kv_heads, quant)
    q = jax.random.normal(jax.random.key(7), (4, 8, 16))
    want = jaxattn.paged_decode(q, cache, tables, lens, implementation="xla")
    sharded = shard_cache(cache, mesh, "model")
    assert sharded.k_pages.sharding.spec[1] == ("model" if kv_heads == 4 else None)
    args = (_put(mesh, q, "data", "model"), sharded, _put(mesh, tables), _put(mesh, lens))
    f = jax.jit(lambda q, c, t, n: jaxattn.paged_decode(q, c, t, n, implementation="pallas"))
    out = f(*args)
    np.testing.assert_allclose(out, want, **TOL)
    assert _spec(out) == ("data", "model", None)
    _no_operand_gather(f, *args)


def test_cache_writes_and_reads_stay_split():
    """write_kv, gather_kv and copy_pages (XLA ops) keep the pools split by kv head."""
    mesh = _mesh(False)
    cache, tables, lens = _filled_cache(4, jaxattn.KVQuant("int8", "group", group_size=8))
    sharded = shard_cache(cache, mesh, "model")
    k = jax.random.normal(jax.random.key(8), (6, 4, 16))
    slots = jnp.array([3, 9, 17, -1, 40, 41])

    write = jax.jit(lambda c, k, s: jaxattn.write_kv(c, k, k, s))
    args = (sharded, _put(mesh, k, None, "model"), _put(mesh, slots))
    written = write(*args)
    assert written.k_pages.sharding.spec[1] == "model"
    assert written.k_scales.sharding.spec[1] == "model"
    np.testing.assert_array_equal(written.k_pages, jaxattn.write_kv(cache, k, k, slots).k_pages)
    _no_operand_gather(write, *args)

    gather = jax.jit(lambda c, t, n: jaxattn.gather_kv(c, t, n, 40))
    args = (sharded, _put(mesh, tables), _put(mesh, lens))
    k_all, _ = gather(*args)
    assert _spec(k_all)[2] == "model"
    np.testing.assert_array_equal(k_all, jaxattn.gather_kv(cache, tables, lens, 40)[0])
    _no_operand_gather(gather, *args)

    copy = jax.jit(lambda c, s, d: jaxattn.copy_pages(c, s, d))
    src, dst = jnp.array([1, 2]), jnp.array([30, 31])
    args = (sharded, _put(mesh, src), _put(mesh, dst))
    copied = copy(*args)
    assert copied.k_pages.sharding.spec[1] == "model"
    np.testing.assert_array_equal(copied.v_pages, jaxattn.copy_pages(cache, src, dst).v_pages)
    _no_operand_gather(copy, *args)


def test_cache_sharding_replicates_kv_heads_that_do_not_split():
    mesh = _mesh(False)
    cache = jaxattn.PagedKVCache.create(8, 8, 2, 16, quant=jaxattn.KVQuant("int8", "tensor"))
    shardings = cache_sharding(cache, mesh, "model")
    assert shardings.k_pages.spec == P(None, None)
    assert shardings.k_scales.spec == P()


@pytest.mark.parametrize("decode_only", [False, True], ids=["mixed", "decode-only"])
def test_paged_attention_step_over_a_split_cache(decode_only):
    """A serving step (context chunks and generation rows, or generation rows alone through
    the kernel that writes the cache itself) with q split by heads and the cache by kv
    head: output, lse and the written cache as on one device, all still split."""
    mesh = _mesh(False)
    cache, _, _ = _filled_cache(4)
    if decode_only:
        q_lens, lens, tokens = [1, 1, 0, 1], [9, 16, 5, 3], 5
    else:
        q_lens, lens, tokens = [5, 1, 0, 7], [12, 16, 5, 7], 16
    pages = [[3, 9], [4, 10], [5], [6, 11]]
    meta = jaxattn.AttentionMetadata.from_lists(
        q_lens, lens, pages, 8, max_tokens=tokens, max_seqs=5, max_pages=3,
        decode_only=decode_only,
    )  # fmt: skip
    ks = jax.random.split(jax.random.key(9), 3)
    q = jax.random.normal(ks[0], (tokens, 8, 16))
    k, v = (jax.random.normal(key, (tokens, 4, 16)) for key in ks[1:])

    def step(q, k, v, cache, impl="pallas"):
        return jaxattn.paged_attention(q, k, v, cache, meta, return_lse=True, implementation=impl)

    (want, want_lse), want_cache = step(q, k, v, cache, "xla")
    args = (
        _put(mesh, q, None, "model"),
        _put(mesh, k, None, "model"),
        _put(mesh, v, None, "model"),
        shard_cache(cache, mesh, "model"),
    )
    f = jax.jit(step)
    (out, lse), new_cache = f(*args)
    real = np.arange(tokens) < sum(q_lens)
    np.testing.assert_allclose(np.asarray(out)[real], np.asarray(want)[real], **TOL)
    np.testing.assert_allclose(np.asarray(lse)[:, real], np.asarray(want_lse)[:, real], **TOL)
    np.testing.assert_allclose(new_cache.k_pages, want_cache.k_pages, **TOL)
    assert _spec(out)[1] == "model" and _spec(lse)[0] == "model"
    assert new_cache.k_pages.sharding.spec[1] == "model"
    _no_operand_gather(f, *args)


@pytest.mark.parametrize("explicit", [False, True], ids=["auto", "explicit"])
def test_sequence_split_runs_as_a_ring(explicit):
    """q, k, v split along the sequence over 'model' (and batch over 'data'): attention
    and its gradient run as ring attention (collective-permutes of K/V blocks), never
    gathering the sequence, and come back split along it."""
    mesh = _mesh(explicit)
    q, k, v, g = _qkv(jax.random.key(11 + explicit), 2, 64, 4, 2)

    def loss(q, k, v, impl="pallas"):
        out = jaxattn.attention(q, k, v, causal=True, implementation=impl, config=CONFIG)
        return jnp.sum(out * g)

    args = tuple(_put(mesh, x, "data", "model") for x in (q, k, v))
    forward = jax.jit(
        lambda q, k, v: jaxattn.attention(q, k, v, causal=True, config=CONFIG,
                                          implementation="pallas")
    )  # fmt: skip
    out = forward(*args)
    np.testing.assert_allclose(out, jaxattn.attention(q, k, v, causal=True), **TOL)
    assert _spec(out)[:2] == ("data", "model")
    hlo = forward.lower(*args).compile().as_text()
    assert "collective-permute" in hlo
    _no_operand_gather(forward, *args)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    grads = grad(*args)
    for got, want in zip(grads, jax.grad(loss, argnums=(0, 1, 2))(q, k, v, "xla"), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
        assert _spec(got)[:2] == ("data", "model")
    _no_operand_gather(grad, *args)


def test_sequence_split_without_a_ring_warns_and_gathers():
    """A window has no ring: the sequence is gathered (correct), with a warning."""
    mesh = _mesh(False)
    q, k, v, _ = _qkv(jax.random.key(12), 2, 32, 4, 4)
    args = tuple(_put(mesh, x, None, "model") for x in (q, k, v))
    f = jax.jit(
        lambda q, k, v: jaxattn.attention(q, k, v, causal=True, window=8, config=CONFIG,
                                          implementation="pallas")
    )  # fmt: skip
    with pytest.warns(UserWarning, match="sequence is split"):
        out = f(*args)
    np.testing.assert_allclose(out, jaxattn.attention(q, k, v, causal=True, window=8), **TOL)


@pytest.mark.parametrize("explicit", [False, True], ids=["auto", "explicit"])
@pytest.mark.parametrize("q_spec", [("data", "model"), ("model",)], ids=["q_sequence", "q_batch"])
def test_roles_placed_over_one_mesh_axis(explicit, q_spec):
    """q split along its sequence (or batch) over "model", k and v by kv head over "model":
    each placement is valid, but two roles cannot take one axis (one spec would name it
    twice, and the call raised). The heads are left whole, with a warning."""
    mesh = _mesh(explicit)
    q, k, v, _ = _qkv(jax.random.key(13), 4, 16, 4, 4)
    args = (_put(mesh, q, *q_spec), _put(mesh, k, None, None, "model"),
            _put(mesh, v, None, None, "model"))  # fmt: skip
    f = jax.jit(
        lambda q, k, v: jaxattn.attention(q, k, v, causal=True, config=CONFIG,
                                          implementation="pallas")
    )  # fmt: skip
    partition._warn_once.cache_clear()  # each message warns once a process
    with pytest.warns(UserWarning, match="heads are split over model"):
        out = f(*args)
    np.testing.assert_allclose(out, jaxattn.attention(q, k, v, causal=True), **TOL)


# ---------------------------------------------------------------- less usual axes and placements
# A sequence split over mesh axes listed out of the mesh's order (the ring's shifts), an
# operand never placed beside explicitly sharded ones, and the context-parallel method for
# causal Tq != Tk. Oracle: the unsharded XLA path.


def _seeded_qkv(seed, b, tq, hq, hkv, d=16, tk=None):
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
    q, k, v = _seeded_qkv(4, 1, 32, 4, 4)
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
    q, k, v = _seeded_qkv(5, 2, 32, 4, 2)
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
    q, k, v = _seeded_qkv(2, 2, 32, 8, 4)
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
    q, k, v = _seeded_qkv(3, 1, 512, 8, 1, tk=1024)
    want = jaxattn.attention(q, k, v, causal=True, implementation="xla")
    ok = context_parallel_attention(
        q, k, v, mesh=mesh, axis_name="sp", causal=True, method="ulysses", implementation="xla"
    )
    np.testing.assert_allclose(ok, want, **TOL)
    out = context_parallel_attention(
        q, k, v, mesh=mesh, axis_name="sp", causal=True, implementation="xla"
    )
    np.testing.assert_allclose(out, want, **TOL)
