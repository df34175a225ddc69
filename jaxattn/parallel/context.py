"""Context parallelism on global arrays: a `shard_map` over the sequence axis that runs
ring or all-to-all (Ulysses) attention, whichever the shape favours."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float

from jaxattn import validation
from jaxattn.parallel.ring import explicit_axes, ring_attention
from jaxattn.parallel.ulysses import kv_heads_on_the_wire, ulysses_attention
from pallas_kernels.flash_prefill import FlashPrefillConfig

__all__ = ["METHODS", "choose_method", "context_parallel_attention"]

METHODS = ("ring", "ulysses")

# FLOPs the attention kernel runs per byte a link moves, for the overlap estimate of
# `choose_method`: ~500 TFLOP/s of bf16 flash attention over ~450 GB/s of NVLink 4 per
# direction (H100 SXM, datasheet figures; not measured here).
FLOPS_PER_LINK_BYTE = 1000.0


def choose_method(
    q_shape: tuple[int, ...],
    k_shape: tuple[int, ...],
    n: int,
    *,
    causal: bool,
    itemsize: int = 2,
    options: tuple[str, ...] = (),
) -> str:
    """The method, "ring" or "ulysses", for local shapes q `[B, Tl, Hq, D]` and k
    `[B, Tl_k, Hkv, D]` on n devices. The rule, in order:

    1. `options` (attention options other than causal / scale), and causal attention
       with Tl != Tl_k (which the ring refuses), need "ulysses" (and raise
       `kv_heads_on_the_wire`'s ValueError if the heads do not split).
    2. Heads that do not split (`Hq % n`, or neither of Hkv and n dividing the other):
       "ring".
    3. Otherwise the one whose communication is less exposed, per device and forward:
       ring: `(n-1) * max(0, 2*Tl_k*Hkv*D*itemsize - F / FLOPS_PER_LINK_BYTE)` bytes,
       its K/V transfers minus what hides under the step's F = 4*Tl*Tl_k*Hq*D FLOPs
       (halved when causal); ulysses: `(n-1)/n * D*itemsize * (2*Tl*Hq + 2*Tl_k*Hkv')`
       (q in, out back, k and v in; Hkv' as `kv_heads_on_the_wire`), none hidden. A tie
       goes to "ulysses" (one kernel call over the whole sequence).
    So short sequences per device go all-to-all and long ones ring, where ring's
    transfers hide under the compute.
    """
    _, tq, num_q_heads, head_dim = q_shape
    tk, num_kv_heads = k_shape[1], k_shape[2]
    needs_ulysses = bool(options) or (causal and tq != tk)
    try:
        wire_kv = kv_heads_on_the_wire(num_q_heads, num_kv_heads, n)
    except ValueError:
        if needs_ulysses:
            raise
        return "ring"
    if needs_ulysses:
        return "ulysses"
    step_flops = 4 * tq * tk * num_q_heads * head_dim / (2 if causal else 1)
    ring_bytes = 2 * tk * num_kv_heads * head_dim * itemsize
    ring = (n - 1) * max(0.0, ring_bytes - step_flops / FLOPS_PER_LINK_BYTE)
    ulysses = (n - 1) / n * head_dim * itemsize * (2 * tq * num_q_heads + 2 * tk * wire_kv)
    return "ulysses" if ulysses <= ring else "ring"


def context_parallel_attention(
    q: Float[Array, "B Tq Hq D"],
    k: Float[Array, "B Tk Hkv D"],
    v: Float[Array, "B Tk Hkv D"],
    *,
    mesh: Mesh,
    axis_name: str,
    causal: bool = False,
    scale: float | None = None,
    layout: str = "contiguous",
    method: str | None = None,
    implementation: str | Sequence[str] | None = None,
    config: FlashPrefillConfig | None = None,
    **options,
):
    """`jaxattn.attention` on global arrays whose sequence is split over `mesh`'s axis
    `axis_name` (n devices): a `shard_map` of `ring_attention` or `ulysses_attention`.

    Args:
      q: `[B, Tq, Hq, D]`; k, v: `[B, Tk, Hkv, D]` (global shapes, T divisible by n; by 2n
        for layout="zigzag"). Placed split along T over `axis_name`, everything else
        whole (other mesh axes replicate them); inputs placed otherwise are moved.
      layout: the order of the sequence axis of q, k, v and of the output: "contiguous"
        (the natural order) or "zigzag" (arrays laid out by `zigzag_shard(x, n)`: the
        balanced causal ring; permute the model's inputs once, not each layer).
        Causal ring attention on "contiguous" is correct but unbalanced.
      method: "ring", "ulysses", or None: `choose_method`'s rule on the local shapes.
      causal, scale, implementation, config: as `jaxattn.attention`.
      **options: other `jaxattn.attention` options (ulysses only, see
        `ulysses_attention`; those left at their defaults are ignored): arrays among
        them are passed whole to every device.

    Returns:
      out `[B, Tq, Hq, D]` split along T like q (with `return_lse`, also lse
      `[B, Hq, Tq]` split along Tq).
    """
    validation.check_qkv(q, k, v, packed=False)
    options = {name: _as_array(x) for name, x in options.items() if not _is_default(name, x)}
    if implementation is not None and not isinstance(implementation, str):
        implementation = tuple(implementation)  # hashable: part of the cache key
    n = mesh.shape[axis_name]
    for name, x in (("q", q), ("k", k)):
        if x.shape[1] % n:
            raise ValueError(f"{name}.shape={x.shape}: T must split evenly over {n} devices")
    local = lambda x: (x.shape[0], x.shape[1] // n, *x.shape[2:])  # noqa: E731
    if method is None:
        method = choose_method(
            local(q), local(k), n, causal=causal, itemsize=q.dtype.itemsize,
            options=tuple(options),
        )  # fmt: skip
    if method not in METHODS:
        raise ValueError(f"{method=}: expected one of {METHODS} or None")
    if method == "ring" and options:
        raise ValueError(
            f"ring attention takes causal and scale only, not {sorted(options)}: "
            "use method='ulysses' (or None)"
        )
    static = tuple(sorted((name, x) for name, x in options.items() if not _is_array_tree(x)))
    arrays = {name: x for name, x in options.items() if _is_array_tree(x)}
    mapped = _mapped(
        method, mesh, axis_name, bool(options.get("return_lse")),
        (("causal", causal), ("scale", scale), ("layout", layout),
         ("implementation", implementation), ("config", config), *static),
    )  # fmt: skip
    seq = P(None, axis_name)
    place = lambda x, spec: _place(x, mesh, spec)  # noqa: E731
    arrays = jax.tree.map(lambda x: place(x, P()), arrays)
    return mapped(place(q, seq), place(k, seq), place(v, seq), arrays)


@functools.lru_cache(maxsize=64)
def _mapped(method: str, mesh: Mesh, axis_name: str, return_lse: bool, static: tuple):
    """The jitted shard_map of one configuration (jit: `attention`'s custom VJP does not
    run in an eager shard_map; cached: an eager caller compiles once)."""
    attend = ring_attention if method == "ring" else ulysses_attention
    fn = functools.partial(attend, axis_name=axis_name, **dict(static))
    seq, lse = P(None, axis_name), P(None, None, axis_name)
    mapped = _shard_map(
        lambda q, k, v, arrays: fn(q, k, v, **arrays),
        mesh=mesh,
        in_specs=(seq, seq, seq, P()),
        out_specs=(seq, lse) if return_lse else seq,
    )
    return jax.jit(mapped)


@functools.cache
def _defaults() -> dict:
    """`jaxattn.attention`'s keyword defaults, read from its signature when first needed
    (`jaxattn.attention` imports this package: not at import time)."""
    from jaxattn.attention import attention

    params = inspect.signature(attention).parameters.values()
    return {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}


def _is_default(name: str, x) -> bool:
    """An option left as `attention`'s default: not an option in use. (Only the default
    itself: `window=0` is an error `attention` reports, not a default.)"""
    default = _defaults().get(name)
    return x is None or (type(x) is type(default) and x == default)


def _as_array(x):
    """A list or tuple of numbers (e.g. `alibi_slopes`) as an array, as `attention` takes
    it; anything else as it is."""
    if isinstance(x, (list, tuple)) and x and all(isinstance(a, (int, float)) for a in x):
        return np.asarray(x, np.float32)
    return x


def _is_array_tree(x) -> bool:
    leaves = jax.tree.leaves(x)
    return bool(leaves) and all(isinstance(a, (jax.Array, np.ndarray)) for a in leaves)


def _place(x, mesh: Mesh, spec: P):
    """With explicit mesh axes (shardings in the types) shard_map needs its inputs placed
    as its specs say (a reshard; none where they are). Auto axes: the partitioner does it."""
    if not explicit_axes(mesh):
        return x
    return jax.sharding.reshard(x, NamedSharding(mesh, spec))


def _shard_map(f, *, mesh, in_specs, out_specs):
    """`jax.shard_map` where this jax has it, else the experimental one. Unchecked
    replication: Pallas's interpreter (CPU) cannot be traced under checked types."""
    if hasattr(jax, "shard_map"):
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    from jax.experimental.shard_map import shard_map

    return shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)
