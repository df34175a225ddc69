"""Ring attention: context parallelism over a mesh axis that splits the sequence.

Each of the n devices on `axis_name` holds its slice of q, k and v. K/V blocks travel
round the ring (device d sends to d + 1, `lax.ppermute`): at step s device i attends to
the block of device `(i - s) mod n`, and merges the partial (out, lse) into its running
result by log-sum-exp (float32). The gradient (a `jax.custom_vjp` saving q, k, v, out and
the merged float32 lse) walks the same ring: dQ accumulates at home, and dK/dV of the
visiting block accumulate as they travel with it, arriving home after n hops. With the
merged (global) lse and out, the flash backward of one block pair is exactly that pair's
share of the gradient (P = exp(s - lse), delta = rowsum(dO * O)), so nothing else is
exchanged (Liu et al. 2023, "Ring Attention with Blockwise Transformers").

Causal load balance, `layout="zigzag"`: the sequence is cut into 2n chunks and device i
holds chunks i and 2n-1-i (`zigzag_shard` lays a global array out so). Then the first step
(its own block) is causal, and every later step is either "all my queries x the visitor's
first chunk" (visitor before me) or "my second chunk's queries x the visitor's whole
block" (visitor after me): half a block of work on every device at every step, where
`layout="contiguous"` leaves device 0 idle for n-1 steps and device n-1 busy for all.

Overlap. The loop is unrolled (n is the static axis size). Each step issues the ppermute
of the next block before its compute, which does not need it, and an optimization barrier
lets the hop after that start only once this step's compute is done: one hop in flight
per step, two blocks alive. (Without it XLA's GPU scheduler ran every hop of the K/V chain
before the first step.) The dK/dV hop of a step is consumed after the next step's compute.
The schedule compiled for a 4 x H100 topology (jax 0.11.2, deviceless) has each forward hop
as an async start/done around exactly one step's kernel; in the backward most hops are,
and the last dK/dV hop home is exposed. On two H100s (NVLink) the forward of 128k causal
tokens runs at 99% of one GPU per device (`bench/RESULTS.md`, set `scale`); the steps
beside a hop launch the Hopper kernel a block per tile (`_attend`).
A step's transfer hides under its compute when

    compute:  4 * B * Tl^2 * Hq * D FLOPs  at the kernel's FLOP/s
              (causal zig-zag steps: half of it; backward: ~2.5x)
    transfer: 2 * B * Tl * Hkv * D * bytes(dtype)  at the link's bytes/s
              (K and V; backward: 3x, as dK and dV travel too, in float32)

i.e. for Tl >= (Hkv / Hq) * bytes * (FLOP/s / link bytes/s) / 2 tokens per device (causal
zig-zag: twice that): 250 tokens for bf16 GQA 4:1 at 1000 FLOP per link byte (~500
TFLOP/s of kernel over ~450 GB/s of NVLink 4 per direction), 500 for its zig-zag steps.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float

from jaxattn import reference, validation
from jaxattn.dispatch import run_first
from pallas_kernels.common import use_interpret
from pallas_kernels.flash_backward import FlashBackwardConfig, flash_backward
from pallas_kernels.flash_prefill import Batch, FlashPrefillConfig, LogitParams, flash_prefill
from pallas_kernels.mosaic import mosaic_backward, mosaic_forward, select_backward, select_forward

__all__ = [
    "LAYOUTS",
    "axis_size",
    "explicit_axes",
    "ring_attention",
    "zigzag_shard",
    "zigzag_unshard",
]

LAYOUTS = ("contiguous", "zigzag")
_HIGHEST = lax.Precision.HIGHEST


def _zigzag_order(n: int) -> np.ndarray:
    """Chunk order of the zig-zag layout: device i holds chunks i and 2n-1-i."""
    return np.stack([np.arange(n), 2 * n - 1 - np.arange(n)], axis=1).reshape(-1)


def explicit_axes(mesh) -> bool:
    """Whether `mesh` has explicit axes (shardings in the types, `jax.make_mesh`'s default)."""
    return any(t == AxisType.Explicit for t in getattr(mesh, "axis_types", ()))


def _permute_chunks(x, n: int, axis: int, order: np.ndarray):
    axis = axis % x.ndim  # a negative axis counts from the end
    size = x.shape[axis]
    if size % (2 * n):
        raise ValueError(f"{x.shape=}: axis {axis} ({size}) must split into 2n = {2 * n} chunks")
    sharding = jax.typeof(x).sharding
    spec = tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec))
    split = explicit_axes(sharding.mesh) and spec[axis] is not None
    if split:  # explicit axes: a gather along a split axis is ambiguous; gather it first
        whole = spec[:axis] + (None,) + spec[axis + 1 :]
        x = jax.sharding.reshard(x, NamedSharding(sharding.mesh, P(*whole)))
    chunks = x.reshape(*x.shape[:axis], 2 * n, size // (2 * n), *x.shape[axis + 1 :])
    y = jnp.take(chunks, order, axis=axis).reshape(x.shape)
    return jax.sharding.reshard(y, sharding) if split else y


def zigzag_shard(x: Array, n: int, axis: int = 1) -> Array:
    """A global array in sequence order -> the zig-zag order of `n` devices along `axis`:
    the sequence cut into 2n equal chunks, ordered [0, 2n-1, 1, 2n-2, ..., n-1, n], so that
    splitting the result evenly n ways gives device i the chunks i and 2n-1-i.

    A relayout: on an array already split along `axis` it moves data between devices
    (the result keeps the input's sharding). Lay out the model's inputs (tokens,
    positions) once, not each layer's activations."""
    return _permute_chunks(x, n, axis, _zigzag_order(n))


def zigzag_unshard(x: Array, n: int, axis: int = 1) -> Array:
    """The inverse of `zigzag_shard`: zig-zag order -> sequence order."""
    return _permute_chunks(x, n, axis, np.argsort(_zigzag_order(n)))


@dataclasses.dataclass(frozen=True)
class _Ring:
    """The static part of a call."""

    axis_name: str | tuple[str, ...]
    causal: bool
    scale: float
    layout: str
    impl: str
    config: FlashPrefillConfig | None
    # The mesh's axis names in order, for `_ppermute_numbers`; None: the abstract mesh's.
    mesh_axes: tuple[str, ...] | None = None


def ring_attention(
    q: Float[Array, "B Tq Hq D"],
    k: Float[Array, "B Tk Hkv D"],
    v: Float[Array, "B Tk Hkv D"],
    *,
    axis_name: str | tuple[str, ...],
    causal: bool = False,
    scale: float | None = None,
    layout: str = "zigzag",
    implementation: str | Sequence[str] | None = None,
    config: FlashPrefillConfig | None = None,
) -> Float[Array, "B Tq Hq D"]:
    """Attention over a sequence split along the mesh axis `axis_name` (ring / context
    parallelism). Call it where `axis_name` is bound: inside `jax.shard_map`. Its default
    `check_vma=True` works on a GPU (the kernels type their outputs as varying like their
    inputs); on CPU, Pallas's interpreter needs `check_vma=False`.

    Args:
      q: `[B, Tq, Hq, D]` bf16/fp16/fp32, this device's queries.
      k, v: `[B, Tk, Hkv, D]`, q's dtype, this device's keys and values; `Hq % Hkv == 0`
        (GQA: kv heads are never repeated, also not on the wire).
      axis_name: the mesh axis (or tuple of axes) the sequence is split over, n devices.
      causal: key j is visible to query p iff `j <= p`, in global positions; needs
        `Tq == Tk`. Without it every device's queries attend to every key, and `layout`
        does not matter.
      scale: logit scale; default `1/sqrt(D)`.
      layout: which tokens each device holds. "contiguous": device i holds the tokens
        `[i*T, (i+1)*T)`; "zigzag" (the default, the balanced causal ring): the sequence is
        cut in 2n chunks of `T/2` and device i holds chunks i and 2n-1-i, in that order
        (`zigzag_shard` lays out a global array so; causal needs an even T).
      implementation: "pallas" (flash kernels, Pallas interpret mode off-GPU), "xla"
        (`jaxattn.reference` per block, an einsum backward), a list tried in order, or None
        (pallas on a GPU, xla elsewhere).
      config: `FlashPrefillConfig` of the per-block kernels (its `backend`: the Hopper
        forward on sm90 where it covers the block shapes, as `jaxattn.attention` picks
        it; its `backward` for the gradient); None picks a heuristic for the block shape.
        Steps that run beside a K/V hop launch the Hopper forward a block per tile
        whatever its `mosaic.persistent` says (`_attend`).

    Returns:
      out `[B, Tq, Hq, D]` in q's dtype: this device's rows of the global attention, in the
      same layout as q.

    Other `jaxattn.attention` options (lengths, window, bias, ...) are not supported here:
    `ulysses_attention` takes them all. Gradients (`jax.grad`) flow to q, k and v through
    the backward ring described in the module docstring, deterministically, accumulated in
    float32 (each block's kernel result is rounded to the input dtype first).
    """
    validation.check_qkv(q, k, v, packed=False)
    validation.check_config("config", config, FlashPrefillConfig)
    if layout not in LAYOUTS:
        raise ValueError(f"{layout=}: expected one of {LAYOUTS}")
    if causal and q.shape[1] != k.shape[1]:
        raise ValueError(
            f"{q.shape=} and {k.shape=}: causal ring attention needs as many local query "
            "tokens as key tokens (Tq == Tk)"
        )
    if causal and layout == "zigzag" and q.shape[1] % 2:
        raise ValueError(f"{q.shape=}: the zigzag layout holds two chunks: Tq must be even")
    if scale is not None and not np.isfinite(scale):
        raise ValueError(f"{scale=}: expected a finite number or None")
    try:
        axis_size(axis_name)
    except NameError as e:
        raise ValueError(
            f"{axis_name=} is not bound: call ring_attention inside jax.shard_map over a "
            "mesh with that axis (or use context_parallel_attention on global arrays)"
        ) from e
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)

    def run(impl: str):
        ring = _Ring(axis_name, bool(causal), scale, layout, impl, config)
        return _ring(ring, q, k, v)

    return run_first(implementation, run)


def axis_size(axis_name) -> int:
    """Devices along a bound mesh axis (or tuple of axes), a static int."""
    if hasattr(lax, "axis_size"):
        return lax.axis_size(axis_name)
    return lax.psum(1, axis_name)


def _shift(x, ring: _Ring, n: int, step: int = 1):
    """Every device's `x` (a pytree) to the device `step` further round the ring: the ring
    is `lax.axis_index`'s order (the axes as listed), and `ppermute` numbers the devices
    of several axes in mesh order (`_ppermute_numbers`)."""
    number = _ppermute_numbers(ring.axis_name, n, ring.mesh_axes)
    perm = [(number[d], number[(d + step) % n]) for d in range(n)]
    return jax.tree.map(lambda a: lax.ppermute(a, ring.axis_name, perm), x)


def _ppermute_numbers(axis_name, n: int, mesh_axes=None) -> list[int]:
    """`ppermute`'s number of the device at each `lax.axis_index(axis_name)`, 0..n-1. They
    differ when `axis_name` lists several axes out of the mesh's order: axis_index counts
    in the listed order, ppermute in the mesh's (a ("model", "data") split of a ("data",
    "model") mesh otherwise shifted blocks to the wrong devices). `mesh_axes`: the mesh's
    axis names in order (None: the abstract mesh's, which a `jax.shard_map` sets)."""
    axes = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    mesh_names = mesh_axes or tuple(jax.sharding.get_abstract_mesh().axis_names)
    in_mesh_order = tuple(a for a in mesh_names if a in axes)
    if len(axes) < 2 or in_mesh_order == axes or set(in_mesh_order) != set(axes):
        return list(range(n))
    sizes = [axis_size(a) for a in axes]
    coords = np.unravel_index(np.arange(n), sizes)  # per listed axis, of each index
    order = [axes.index(a) for a in in_mesh_order]
    return np.ravel_multi_index([coords[i] for i in order], [sizes[i] for i in order]).tolist()


# ---------------------------------------------------------------- one block pair


def _attend(ring: _Ring, q, k, v, causal: bool, transfer: bool):
    """(out float32 `[B, Tq, Hq, D]`, lse float32 `[B, Hq, Tq]`) of q against one block;
    `transfer`: a hop of the ring is in flight beside this step's kernel.

    Beside a hop the Hopper kernel launches a block per tile, never persistent: the
    hop's NCCL kernel holds SMs until the peer's runs too, and a persistent launch's
    blocks each own a fixed share of the tiles, so a block that finds its SM held waits,
    share and all, until the hop ends, which the peer's persistent kernel, holding every
    SM, could put off to its own end. Measured on 2 x H100 (CP2 128k causal, zig-zag):
    calls of 114-165 ms, most near 117 or 160, persistent; 112-132 ms (median 114) with
    the steps beside a hop a block per tile (`bench/HISTORY.md`, probes of 2026-11-27)."""
    if ring.impl == "xla":
        out, lse = reference.attention_reference(
            q, k, v, causal=causal, scale=ring.scale, return_lse=True
        )
        return out.astype(jnp.float32), lse
    tiling = select_forward(ring.config, q.shape, k.shape, q.dtype, full=not causal)
    if tiling is not None and transfer:
        tiling = dataclasses.replace(tiling, persistent=False)
    if tiling is not None:  # the Hopper kernel (sm90), as `jaxattn.attention` picks it
        out, lse = mosaic_forward(q, k, v, causal=causal, scale=ring.scale, config=tiling)
        return out.astype(jnp.float32), lse
    config = (ring.config or FlashPrefillConfig()).resolve(
        q.shape[1], k.shape[1], q.shape[-1], q.dtype, causal
    )
    params = LogitParams(causal=causal, scale=ring.scale)
    out, lse = flash_prefill(
        q, k, v, Batch(), params=params, config=config, return_lse=True, interpret=use_interpret()
    )
    return out.astype(jnp.float32), lse


def _attend_backward(ring: _Ring, q, k, v, out, lse, g, causal: bool):
    """This block pair's share (dq, dk, dv), float32, given the global out and lse."""
    if ring.impl == "xla":
        return _attend_backward_xla(q, k, v, out, lse, g, causal, ring.scale)
    backward = ring.config.backward if ring.config is not None else None
    tiling = select_backward(backward, q.shape, k.shape, q.dtype, masked=causal)
    if tiling is not None:  # the Hopper kernels (sm90), as `jaxattn.attention` picks them
        grads = mosaic_backward(
            q, k, v, out, lse, g, causal=causal, scale=ring.scale, config=tiling
        )
        return tuple(x.astype(jnp.float32) for x in grads)
    backward = (backward or FlashBackwardConfig()).resolve(
        q.shape[1], k.shape[1], q.shape[-1], q.dtype
    )
    params = LogitParams(causal=causal, scale=ring.scale)
    dq, dk, dv, *_ = flash_backward(
        q, k, v, out, lse, g, None, Batch(), params=params, config=backward,
        interpret=use_interpret(),
    )  # fmt: skip
    return tuple(x.astype(jnp.float32) for x in (dq, dk, dv))


def _attend_backward_xla(q, k, v, out, lse, g, causal: bool, scale: float):
    """FlashAttention-2's backward of one block in einsums: P = exp(s - lse),
    dS = P * (dO.V^T - rowsum(dO * O)); GQA as `[.., Hkv, group, ..]`."""
    batch, tq, num_q_heads, head_dim = q.shape
    tk, num_kv_heads = k.shape[1:3]
    group = num_q_heads // num_kv_heads
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    split = lambda x: f32(x).reshape(batch, tq, num_kv_heads, group, head_dim)  # noqa: E731
    qg, og, gg = split(q), split(out), split(g)  # [B, Tq, Hkv, G, D]
    lse = lse.reshape(batch, num_kv_heads, group, tq, 1)
    s = scale * jnp.einsum("bqhgd,bkhd->bhgqk", qg, f32(k), precision=_HIGHEST)
    p = jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, jnp.inf))  # [B, Hkv, G, Tq, Tk]
    if causal:  # bottom-right aligned, as everywhere (Tq == Tk in the ring)
        p = jnp.where(jnp.tril(jnp.ones((tq, tk), bool), tk - tq), p, 0.0)
    delta = jnp.einsum("bqhgd,bqhgd->bhgq", gg, og, precision=_HIGHEST)[..., None]
    dp = jnp.einsum("bqhgd,bkhd->bhgqk", gg, f32(v), precision=_HIGHEST)
    ds = p * (dp - delta)
    dq = scale * jnp.einsum("bhgqk,bkhd->bqhgd", ds, f32(k), precision=_HIGHEST)
    dk = scale * jnp.einsum("bhgqk,bqhgd->bkhd", ds, qg, precision=_HIGHEST)
    dv = jnp.einsum("bhgqk,bqhgd->bkhd", p, gg, precision=_HIGHEST)
    return dq.reshape(q.shape), dk, dv


def _merge(acc, part):
    """Two partial (out, lse) of the same rows -> their log-sum-exp combination. Rows whose
    lse is -inf in both stay (0, -inf): no NaN."""
    (out, lse), (out_b, lse_b) = acc, part
    new = jnp.logaddexp(lse, lse_b)  # [B, H, T]
    safe = jnp.where(jnp.isfinite(new), new, 0.0)
    weight = lambda l: jnp.exp(l - safe).transpose(0, 2, 1)[..., None]  # noqa: E731
    return out * weight(lse) + out_b * weight(lse_b), new


def _merge_late(acc, part, half: int):
    """`part` holds the rows `half:` only."""
    out, lse = acc
    tail = _merge((out[:, half:], lse[..., half:]), part)
    return (
        jnp.concatenate([out[:, :half], tail[0]], axis=1),
        jnp.concatenate([lse[..., :half], tail[1]], axis=-1),
    )


def _then_zeros(x):
    return jnp.concatenate([x, jnp.zeros_like(x)], axis=1)


def _zeros_then(x):
    return jnp.concatenate([jnp.zeros_like(x), x], axis=1)


# ---------------------------------------------------------------- the ring


def _after(result, incoming):
    """`incoming` (the next block) usable only once this step's `result` is computed.
    Nothing else orders the hops of the K/V chain (ppermutes of ppermutes) after the
    compute: XLA's GPU scheduler ran them all before the first step, serially, holding all
    n blocks at once (seen in the compiled schedule of a 4-GPU H100 topology)."""
    return lax.optimization_barrier((result, incoming))


def _forward_step(ring: _Ring, s: int, src, me, q, kv, acc, transfer: bool):
    """The running (out, lse) after attending to the block of device `src` at step s
    (`transfer`: the next block's hop is in flight)."""
    k, v = kv
    attend = functools.partial(_attend, ring, transfer=transfer)
    if s == 0:  # own block: the diagonal
        return attend(q, k, v, ring.causal)
    if not ring.causal:
        return _merge(acc, attend(q, k, v, False))
    if ring.layout == "contiguous":  # a block before mine is all visible, after: none
        return lax.cond(src < me, lambda a: _merge(a, attend(q, k, v, False)), lambda a: a, acc)
    half = q.shape[1] // 2  # zig-zag: chunks (me, 2n-1-me) against (src, 2n-1-src)

    def earlier(a):  # src < me: both my chunks see src's first chunk, none its second
        return _merge(a, attend(q, k[:, :half], v[:, :half], False))

    def later(a):  # src > me: only my second chunk sees src, but both of its chunks
        return _merge_late(a, attend(q[:, half:], k, v, False), half)

    return lax.cond(src < me, earlier, later, acc)


def _forward(ring: _Ring, q, k, v):
    n, me = axis_size(ring.axis_name), lax.axis_index(ring.axis_name)
    kv, acc = (k, v), None
    for s in range(n):
        incoming = _shift(kv, ring, n) if s + 1 < n else None  # issued before the compute
        acc = _forward_step(ring, s, (me - s) % n, me, q, kv, acc, incoming is not None)
        if incoming is not None:
            acc, incoming = _after(acc, incoming)
        kv = incoming
    out, lse = acc
    return out.astype(q.dtype), lse


def _backward_step(ring: _Ring, s: int, src, me, q, kv, out, lse, g):
    """(dq, dk, dv) float32 shares of the pair (my queries, block of `src`) at step s."""
    k, v = kv
    grads = functools.partial(_attend_backward, ring)
    if s == 0:
        return grads(q, k, v, out, lse, g, ring.causal)
    if not ring.causal:
        return grads(q, k, v, out, lse, g, False)
    if ring.layout == "contiguous":
        zeros = lambda: tuple(jnp.zeros_like(x, jnp.float32) for x in (q, k, v))  # noqa: E731
        return lax.cond(src < me, lambda: grads(q, k, v, out, lse, g, False), zeros)
    half = q.shape[1] // 2

    def earlier():  # shares of src's first chunk; its second gets none
        dq, dk, dv = grads(q, k[:, :half], v[:, :half], out, lse, g, False)
        return dq, _then_zeros(dk), _then_zeros(dv)

    def later():  # shares of my second chunk's queries; my first gets none
        rows = lambda x: x[:, half:]  # noqa: E731
        dq, dk, dv = grads(rows(q), k, v, rows(out), lse[..., half:], rows(g), False)
        return _zeros_then(dq), dk, dv

    return lax.cond(src < me, earlier, later)


def _backward(ring: _Ring, q, k, v, out, lse, g):
    n, me = axis_size(ring.axis_name), lax.axis_index(ring.axis_name)
    g = g.astype(out.dtype)
    dq = jnp.zeros_like(q, jnp.float32)
    dkv = (jnp.zeros_like(k, jnp.float32), jnp.zeros_like(v, jnp.float32))  # of the visitor
    kv = (k, v)
    # The backward ring turns the other way (step -1): the same ppermutes of the same k, v
    # as the forward's would let XLA reuse the forward's received blocks (CSE), holding all
    # n of them, the whole sequence, from the forward to the backward.
    for s in range(n):
        incoming = _shift(kv, ring, n, -1) if s + 1 < n else None
        dq_s, dk_s, dv_s = _backward_step(ring, s, (me + s) % n, me, q, kv, out, lse, g)
        dq = dq + dq_s
        # dK/dV follow their block; after the n-th hop they are home. The sum waits for
        # the previous hop only after this step's compute, so that hop can overlap it.
        dkv = _shift((dkv[0] + dk_s, dkv[1] + dv_s), ring, n, -1)
        if incoming is not None:
            dq, incoming = _after(dq, incoming)
        kv = incoming
    return dq.astype(q.dtype), dkv[0].astype(k.dtype), dkv[1].astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(ring: _Ring, q, k, v):
    return _forward(ring, q, k, v)[0]


def _ring_fwd(ring: _Ring, q, k, v):
    out, lse = _forward(ring, q, k, v)
    return out, (q, k, v, out, lse)  # lse: the merged (global) float32 log-sum-exp


def _ring_bwd(ring: _Ring, residuals, g):
    return _backward(ring, *residuals, g)


_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_forward(q, k, v, *, axis_name, causal: bool, scale: float, config=None, mesh_axes=None):
    """The forward ring on the flash kernels, for `jaxattn.attention` on a sequence split
    over `axis_name` (contiguous layout) of a mesh with axes `mesh_axes` (in order; None:
    the abstract mesh's): `(out, lse)` with lse the merged float32 `[B, Hq, Tq]`. No custom
    VJP: the caller's backward calls `ring_backward`."""
    ring = _Ring(axis_name, causal, scale, "contiguous", "pallas", config, mesh_axes)
    return _forward(ring, q, k, v)


def ring_backward(
    q, k, v, out, lse, g, *, axis_name, causal: bool, scale: float, config=None, mesh_axes=None
):
    """(dq, dk, dv) of `ring_forward`'s output for its cotangent `g` (the backward ring)."""
    ring = _Ring(axis_name, causal, scale, "contiguous", "pallas", config, mesh_axes)
    return _backward(ring, q, k, v, out, lse, g)
