"""Helpers shared by the kernels: the interpret switch and in-kernel math.

Everything here is plain `jnp` so it runs both inside a Pallas (Triton) kernel body and
in ordinary XLA code; `jaxattn.positional` re-exports the public pieces.
"""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# Finite stand-in for -inf inside kernels: exp2(MASK - m) underflows to 0 for any real
# row maximum m, and never produces inf - inf = NaN when a whole block is masked.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
LOG2E = math.log2(math.e)
# A bias at or below this hides its key, as -inf does (transformers' masks use
# finfo(float32).min). Finite logits below about -8e37 would read as masked in the
# kernels (their rows' maxima fall below MASK_VALUE / 2); one rule for every path.
HIDDEN_BIAS = -1e37
LN2 = math.log(2.0)


def device_sm_count(default: int) -> int:
    """Streaming multiprocessors of the default device (its `core_count`), or `default`
    where jax does not say (CPU)."""
    return getattr(jax.devices()[0], "core_count", None) or default


def use_interpret() -> bool:
    """Kernels run compiled on a GPU backend and in Pallas interpret mode elsewhere.

    `JAXATTN_INTERPRET=0/1` overrides: the lowering tests set 0 on a CPU machine to lower
    the kernels for CUDA (Triton) without running them.
    """
    forced = os.environ.get("JAXATTN_INTERPRET")
    if forced is not None:
        return forced not in ("0", "false", "False", "")
    return jax.default_backend() != "gpu"


def check_config(name: str, config, cls: type) -> None:
    """`config` is None or a `cls`; else a TypeError naming `name` (a tiling of another
    kernel would fail deep inside)."""
    if config is not None and not isinstance(config, cls):
        raise TypeError(f"{name}={config!r}: expected a {cls.__name__} or None")


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def dot_width(n: int) -> int:
    """Columns of a tile that a dot contracts over `n` channels: the next power of two,
    at least 16 (Triton's dot needs K >= 16; narrower tiles compiled to wrong results:
    INT4 parts of head_dim 16 are 8 channels wide)."""
    return max(16, next_power_of_2(n))


def relative_position_bucket(
    relative_position: jax.Array, num_buckets: int, max_distance: int, bidirectional: bool
) -> jax.Array:
    """T5's bucket of `relative_position = key_pos - query_pos` (int32, any shape).

    Half of the buckets (or all, if not bidirectional) hold exact distances below
    `num_buckets // 2`; larger distances share buckets spaced logarithmically up to
    `max_distance` (Raffel et al. 2020, as in Mesh TensorFlow and HF transformers).
    Not bidirectional: keys after the query all fall into bucket 0.
    """
    if bidirectional:
        num_buckets //= 2
        offset = jnp.where(relative_position > 0, num_buckets, 0)
        distance = jnp.abs(relative_position)
    else:
        offset = 0
        distance = jnp.maximum(-relative_position, 0)
    max_exact = num_buckets // 2
    log_ratio = jnp.log(jnp.maximum(distance, 1).astype(jnp.float32) / max_exact)
    large = max_exact + (
        log_ratio / math.log(max_distance / max_exact) * (num_buckets - max_exact)
    ).astype(jnp.int32)
    large = jnp.minimum(large, num_buckets - 1)
    return offset + jnp.where(distance < max_exact, distance, large)


# Online softmax in base 2 (FlashAttention-2): the running state of each query row is the
# unnormalised output `acc [rows, Dp]`, the row maximum `m [rows]` and the sum `l [rows]`.
# `acc` may also be a tuple of column parts (`[rows, Dp_i]` each, V then comes as a tuple of
# matching parts): the decode kernel splits INT4 rows in two halves.


def softmax_init(rows: int, padded_dim):
    """(acc, m, l) before any key: m starts at MASK_VALUE, never -inf (no inf - inf).
    `padded_dim`: an int, or a tuple of ints for an accumulator in parts."""
    dims = padded_dim if isinstance(padded_dim, tuple) else (padded_dim,)
    acc = tuple(jnp.zeros((rows, d), jnp.float32) for d in dims)
    return (
        acc if isinstance(padded_dim, tuple) else acc[0],
        jnp.full((rows,), MASK_VALUE, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )


def softmax_step(m, l, s):
    """One key block's base-2 logits s `[rows, block]` (masked keys at MASK_VALUE) into the
    running maximum m and sum l `[rows]`: (m_new, alpha, p, l_new), alpha `[rows]` the
    factor of the old state, p `[rows, block]` the block's probabilities."""
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(s - m_new[:, None])
    return m_new, alpha, p, l * alpha + jnp.sum(p, axis=1)


def softmax_update(carry, s, load_v, precision=None, v_scale=None):
    """Folds one key block into the state. s: `[rows, block]` base-2 logits (masked keys at
    MASK_VALUE); `load_v()` returns V `[block, Dp]` (or its parts), loaded after the
    exponentials; `v_scale` `[block]`: a factor of each V row not applied by `load_v`
    (a quantized cache's row scales), folded into the probabilities instead; or a tuple
    of them, one per part of V."""
    acc, m, l = carry
    m_new, alpha, p, l = softmax_step(m, l, s)

    def fold(a, v, scale):
        p_v = p if scale is None else p * scale[None, :]
        f32 = jnp.float32
        pv = jnp.dot(p_v.astype(v.dtype), v, precision=precision, preferred_element_type=f32)
        return a * alpha[:, None] + pv

    v = load_v()
    if not isinstance(acc, tuple):
        return fold(acc, v, v_scale), m_new, l
    scales = v_scale if isinstance(v_scale, tuple) else (v_scale,) * len(acc)
    return tuple(fold(*x) for x in zip(acc, v, scales, strict=True)), m_new, l


def softmax_finish(carry, row_ok=True):
    """(out [rows, Dp] float32 (or its parts), natural lse [rows]); rows that saw no key
    (or not `row_ok`) give zeros and -inf."""
    acc, m, l = carry
    ok = row_ok & (m > 0.5 * MASK_VALUE)
    l_safe = jnp.where(ok, l, 1.0)
    out = jax.tree.map(lambda a: jnp.where(ok[:, None], a / l_safe[:, None], 0.0), acc)
    return out, jnp.where(ok, (m + jnp.log2(l_safe)) * LN2, -jnp.inf)


def _manual_axis_types(values) -> list:
    """The manual-axis type of each array among `values` (a pytree; the type is empty
    outside a `jax.shard_map`), or [] on a jax that types values otherwise."""
    types = [getattr(jax.typeof(x), "manual_axis_type", None) for x in jax.tree.leaves(values)]
    return [t for t in types if t is not None]


def _varying_axes(values) -> frozenset:
    """The mesh axes any array among `values` (a pytree) varies over."""
    return frozenset().union(*(t.varying for t in _manual_axis_types(values)))


def typed_like(out_shape, inputs) -> list:
    """`out_shape` (ShapeDtypeStructs) typed as varying over every manual mesh axis that
    any of `inputs` varies over: what a `jax.shard_map` with `check_vma=True` (its
    default) asks of a `pallas_call`'s outputs. Outside one the type is empty and unread."""
    types = _manual_axis_types(inputs)
    if not types:
        return list(out_shape)
    varying = frozenset().union(*(t.varying for t in types))
    axis_type = type(types[0])(varying=varying)  # jax's ManualAxisType
    return [jax.ShapeDtypeStruct(s.shape, s.dtype, manual_axis_type=axis_type) for s in out_shape]


def varying_like(outputs, inputs):
    """`outputs` (a pytree of arrays) cast to vary over every manual mesh axis that any of
    `inputs` (a pytree) varies over. For a kernel's outputs that its call types otherwise
    (`plgpu.kernel` types them invariant; a `pallas_call` gives an output updated in place
    its input's type), and for a custom VJP's differentiable inputs, whose cotangents then
    come out of that type and are summed over the axes an input did not vary over (the
    cast's transpose) as their partial sums must be."""
    axes = _varying_axes(inputs)

    def cast(x):
        missing = tuple(sorted(axes - _varying_axes(x)))
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(cast, outputs) if axes else outputs


def whole_array_call(kernel, inputs, out_shape, *, grid, num_warps, num_stages, interpret, name,
                     aliases=None):  # fmt: skip
    """A Triton `pallas_call` whose refs are whole arrays: the kernels index them
    themselves (data-dependent tiles, block tables), which BlockSpecs cannot express.
    `aliases`: {input index: output index} of inputs updated in place."""
    whole = lambda x: pl.BlockSpec(x.shape, lambda *_: (0,) * len(x.shape))  # noqa: E731
    out_shape = typed_like(out_shape, inputs)
    # An output updated in place takes its input's type: the input varies as all do.
    inputs = [varying_like(x, inputs) if i in (aliases or {}) else x for i, x in enumerate(inputs)]
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[whole(x) for x in inputs],
        out_specs=[whole(s) for s in out_shape],
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        input_output_aliases=aliases or {},
        interpret=interpret,
        name=name,
    )(*inputs)
