"""Shared pieces of the context-parallel tests (ring and ulysses): meshes over the first n
of the 8 host devices, fresh inputs, the run of a sharded op on global arrays (output and
gradients in true sequence order) and the expected values (float64 oracle and the
unsharded reference)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import util
from grad_oracle import attention_grad_oracle
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxattn
from jaxattn.parallel.ring import zigzag_shard, zigzag_unshard

AXIS = "sp"
SEQ = P(None, AXIS)
# Against the float64 oracle (float32 inputs, float32 accumulation over the ring).
TOL = dict(rtol=5e-5, atol=5e-5)
# XLA:CPU compile time dominates these tests (the ring is unrolled): ~35% less without
# LLVM's optimizations, and the same results.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def mesh(n: int, explicit: bool = False):
    axis_type = AxisType.Explicit if explicit else AxisType.Auto
    return jax.make_mesh((n,), (AXIS,), axis_types=(axis_type,), devices=jax.devices()[:n])


def inputs(name, n, *, t_local=16, tk_local=None, hq=4, hkv=2, d=16, b=2, scale=1.0):
    """Global float32 q `[b, n*t_local, hq, d]`, k, v `[b, n*tk_local, hkv, d]` and an
    output cotangent g like q: fresh normals, seeded by the case's name."""
    rng = util.rng_for("context parallel", name)
    tq, tk = n * t_local, n * (tk_local or t_local)
    q = util.randn(rng, (b, tq, hq, d), scale=scale)
    k = util.randn(rng, (b, tk, hkv, d), scale=scale)
    v = util.randn(rng, (b, tk, hkv, d))
    g = util.randn(rng, (b, tq, hq, d))
    return q, k, v, g


def shard_mapped(local_fn, m, *, check_vma=False):
    """`local_fn(q, k, v)` as a user writes it: a shard_map splitting the sequence."""
    return jax.shard_map(
        local_fn, mesh=m, in_specs=(SEQ, SEQ, SEQ), out_specs=SEQ, check_vma=check_vma
    )


def in_true_order(f, n: int, layout: str):
    """f on arrays in `layout` order, wrapped to take and return the true order."""
    if layout == "contiguous":
        return f
    return lambda q, k, v: zigzag_unshard(
        f(zigzag_shard(q, n), zigzag_shard(k, n), zigzag_shard(v, n)), n
    )


def value_and_grads(f, q, k, v, g):
    """(out, (dq, dk, dv)) of `sum(f(q, k, v) * g)` in one jitted program."""

    def loss(q, k, v):
        out = f(q, k, v)
        return jnp.sum(out * g), out

    step = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
    (_, out), grads = jax.jit(step, compiler_options=FAST_COMPILE)(q, k, v)
    return out, grads


def check_against_references(out, grads, q, k, v, g, *, causal, scale=None, tol=TOL):
    """Output and gradients against the float64 oracle and the unsharded xla attention."""
    want = attention_grad_oracle(q, k, v, g, causal=causal, scale=scale)
    np.testing.assert_allclose(util.f64(out), want.out, **tol, err_msg="out vs oracle")
    for name, got in zip("qkv", grads):
        np.testing.assert_allclose(
            util.f64(got), want.grads[name], **tol, err_msg=f"d{name} vs oracle"
        )
    ref = lambda q, k, v: jaxattn.attention(  # noqa: E731
        q, k, v, causal=causal, scale=scale, implementation="xla"
    )
    ref_out, ref_grads = value_and_grads(ref, q, k, v, g)
    np.testing.assert_allclose(util.f64(out), util.f64(ref_out), **tol, err_msg="out vs xla")
    for name, got, w in zip("qkv", grads, ref_grads):
        np.testing.assert_allclose(util.f64(got), util.f64(w), **tol, err_msg=f"d{name} vs xla")


def assert_sequence_sharded(x, m):
    want = NamedSharding(m, SEQ)
    assert x.sharding.is_equivalent_to(want, x.ndim), f"{x.sharding} is not {want}"


_COLLECTIVE = re.compile(
    r"= [^=]*? (collective-permute|all-to-all|all-gather|all-reduce)(?:-start)?\("
)


def compiled(f, *args):
    return jax.jit(f).lower(*args).compile(FAST_COMPILE)


def collectives(program) -> list[str]:
    """The collectives of a compiled program, in program order."""
    return _COLLECTIVE.findall(program.as_text())
