"""Trace-time checks of shapes, dtypes and static options (no data-dependent checks).

Every error names the argument and the shapes involved, so a user sees what to change.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer

from jaxattn.cache import PagedKVCache
from jaxattn.positional import RelativeBias
from jaxattn.shapes import broadcasts_into
from pallas_kernels.common import check_config, use_interpret
from pallas_kernels.flash_prefill.config import FlashPrefillConfig

_FLOAT_DTYPES = ("bfloat16", "float16", "float32")

# The quantized output format (`out_dtype=`): e4m3fn, saturated to its largest finite value
# (it has no inf: an unclipped overflow would round to NaN).
FP8_OUT = np.dtype(jnp.float8_e4m3fn)
FP8_OUT_MAX = float(jnp.finfo(FP8_OUT).max)  # 448


def _fail(msg: str):
    raise ValueError(msg)


def check_paged_prefill(name: str, config) -> None:
    """None or a `FlashPrefillConfig` for context rows over a paged cache, which the Triton
    kernel alone runs: forcing the Hopper kernel there is an error, not ignored."""
    check_config(name, config, FlashPrefillConfig)
    if config is not None and config.backend == "mosaic":
        raise ValueError(
            f"{name}.backend='mosaic': the Hopper kernel does not cover context rows over a "
            "paged cache (the Triton kernel runs them); leave backend 'auto' or 'triton'"
        )


def check_qkv(q, k, v, *, packed: bool) -> None:
    """q `[B, Tq, Hq, D]` and k/v `[B, Tk, Hkv, D]` (dense) or without the B axis (packed)."""
    rank = 3 if packed else 4
    layout = "[T, H, D]" if packed else "[B, T, H, D]"
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != rank:
            _fail(f"{name}.shape={x.shape}: expected rank {rank} {layout}")
        if str(x.dtype) not in _FLOAT_DTYPES:
            _fail(f"{name}.dtype={x.dtype}: expected one of {_FLOAT_DTYPES}")
    for name, x in (("q", q), ("k", k)):
        if min(x.shape[-2:]) < 1 or (not packed and x.shape[0] < 1):
            _fail(f"{name}.shape={x.shape}: batch, head and head_dim sizes must be >= 1")
    if k.shape != v.shape:
        _fail(f"{k.shape=} and {v.shape=} must be equal")
    if not packed and q.shape[0] != k.shape[0]:
        _fail(f"{q.shape=} and {k.shape=}: batch sizes differ")
    if q.shape[-1] != k.shape[-1]:
        _fail(f"{q.shape=} and {k.shape=}: head_dim differs")
    if q.shape[-2] % k.shape[-2]:
        _fail(f"{q.shape=} and {k.shape=}: num_q_heads must be a multiple of num_kv_heads")
    if not (q.dtype == k.dtype == v.dtype):
        _fail(f"{q.dtype=}, {k.dtype=}, {v.dtype=}: q, k and v must share a dtype")


def check_cache(q, cache, *, k=None) -> None:
    """The cache against the op's inputs (`paged_decode`, `paged_attention`): a
    `PagedKVCache` whose own shapes agree (`cache.check`), q's heads and head_dim matching
    it, or with `k` (the new keys `[T, Hkv, D]`, whose heads match q's) k's matching it,
    and q in the cache's dtype unless the cache is quantized."""
    if not isinstance(cache, PagedKVCache):
        _fail(f"cache: expected a jaxattn.PagedKVCache, got {type(cache)}")
    if k is not None:
        if k.shape[1:] != (cache.num_kv_heads, cache.head_dim):
            _fail(
                f"{k.shape=}: expected [T, num_kv_heads={cache.num_kv_heads}, "
                f"head_dim={cache.head_dim}] for a cache of {cache.k_pages.shape=}"
            )
    elif q.shape[-1] != cache.head_dim:
        _fail(f"{q.shape=} and {cache.k_pages.shape=}: head_dim differs")
    elif q.shape[-2] % cache.num_kv_heads:
        _fail(
            f"{q.shape=} and {cache.k_pages.shape=}: num_q_heads must be a multiple of num_kv_heads"
        )
    cache.check()
    if cache.quant is None and q.dtype != cache.dtype:
        _fail(f"{q.dtype=} and {cache.dtype=}: q and the cache must share a dtype")


def check_int_vector(name: str, x, length: int) -> None:
    if x is None:
        return
    if x.ndim != 1 or x.shape[0] != length:
        _fail(f"{name}.shape={x.shape}: expected [{length}]")
    if not np.issubdtype(x.dtype, np.integer):
        _fail(f"{name}.dtype={x.dtype}: expected an integer dtype")


def broadcast_operand(name: str, x, target: tuple[int, ...], *, boolean: bool):
    """Checks that `x` broadcasts to `target`; returns it with rank len(target)."""
    if x is None:
        return None
    if boolean and x.dtype != np.bool_:
        _fail(f"{name}.dtype={x.dtype}: expected bool")
    if not boolean and str(x.dtype) not in _FLOAT_DTYPES:
        _fail(f"{name}.dtype={x.dtype}: expected a float dtype")
    if not broadcasts_into(x.shape, target):
        _fail(f"{name}.shape={x.shape} does not broadcast to {target}")
    return x.reshape((1,) * (len(target) - x.ndim) + x.shape)


# Windows and sink counts are at most this: positions are int32, and `p - window` must
# not wrap around for any position p > -2**30 (a window past every key is None's).
MAX_POSITIONS = 2**30


def check_options(
    *, num_q_heads, window, sink_tokens, alibi_slopes, relative_bias, soft_cap, scale
) -> None:
    for name, value in (("window", window), ("sink_tokens", sink_tokens),
                        ("soft_cap", soft_cap), ("scale", scale)):  # fmt: skip
        if isinstance(value, Tracer):
            raise TypeError(
                f"{name} is traced: it must be a static Python number (the kernels are "
                "compiled for it); a learnable temperature can scale q instead"
            )
    if window is not None and (int(window) != window or not 1 <= window <= MAX_POSITIONS):
        _fail(f"{window=}: expected an integer in [1, 2**30] or None (no window)")
    if int(sink_tokens) != sink_tokens or not 0 <= sink_tokens <= MAX_POSITIONS:
        _fail(f"{sink_tokens=}: expected an integer in [0, 2**30]")
    if soft_cap is not None and not (soft_cap > 0 and np.isfinite(soft_cap)):
        _fail(f"{soft_cap=}: expected a positive finite number or None")
    if scale is not None and not np.isfinite(scale):
        _fail(f"{scale=}: expected a finite number or None")
    if alibi_slopes is not None and np.shape(alibi_slopes) != (num_q_heads,):
        _fail(f"alibi_slopes.shape={np.shape(alibi_slopes)}: expected [num_q_heads={num_q_heads}]")
    if relative_bias is not None:
        if not isinstance(relative_bias, RelativeBias):
            _fail(f"relative_bias: expected a jaxattn.RelativeBias, got {type(relative_bias)}")
        table = relative_bias.table
        if table.ndim != 2 or table.shape[0] != num_q_heads:
            _fail(f"relative_bias.table.shape={table.shape}: expected [{num_q_heads}, num_buckets]")
        min_buckets = 4 if relative_bias.bidirectional else 2
        if table.shape[1] < min_buckets:
            _fail(f"relative_bias.table.shape={table.shape}: needs >= {min_buckets} buckets")
        exact = table.shape[1] // (4 if relative_bias.bidirectional else 2)
        if relative_bias.max_distance <= exact:
            _fail(
                f"relative_bias.max_distance={relative_bias.max_distance}: must exceed the "
                "exact-bucket range num_buckets // 4 (bidirectional) or // 2"
            )


def check_output(out_dtype, out_scale, q_dtype):
    """The output dtype of an op (None: q's) and its `out_scale`, checked.

    Returns `(dtype, scale)`: dtype is q's or float8_e4m3fn; scale is None, or (fp8 only)
    a float32 `[]` array. A Python scale must be positive and finite; a traced one is
    trusted (0 or inf would make `out * (1 / out_scale)` NaN).
    """
    try:
        dtype = np.dtype(q_dtype if out_dtype is None else out_dtype)
    except TypeError:
        _fail(f"{out_dtype=}: not a dtype; expected None, q's dtype or float8_e4m3fn")
    if dtype not in (np.dtype(q_dtype), FP8_OUT):
        _fail(f"out_dtype={dtype}: expected None, q's dtype ({np.dtype(q_dtype)}) or float8_e4m3fn")
    if dtype != FP8_OUT:
        if out_scale is not None:
            _fail(f"out_scale is only used with out_dtype=float8_e4m3fn (got out_dtype={dtype})")
        return dtype, None
    if out_scale is None:
        _fail("out_dtype=float8_e4m3fn needs out_scale (stored = out * (1 / out_scale))")
    shape = np.shape(out_scale)
    if shape != ():
        _fail(f"out_scale.shape={shape}: expected a scalar [] (one scale per output tensor)")
    scale_dtype = out_scale.dtype if hasattr(out_scale, "dtype") else np.result_type(out_scale)
    if not (jnp.issubdtype(scale_dtype, jnp.floating) or jnp.issubdtype(scale_dtype, jnp.integer)):
        _fail(f"out_scale.dtype={scale_dtype}: expected a real number")
    if isinstance(out_scale, int | float | np.number) and not (
        np.isfinite(out_scale) and out_scale > 0
    ):
        _fail(f"{out_scale=}: expected a positive finite number")
    return dtype, jnp.asarray(out_scale, jnp.float32)


def check_fp8_kernel_output() -> None:
    """Raises NotImplementedError (an `implementation=` list then falls through to "xla")
    where the compiled kernels cannot store float8_e4m3fn: Triton converts float32 to e4m3
    on sm_89 and later (Ada, Hopper) only."""
    if use_interpret() or jax.default_backend() != "gpu":
        return
    capability = getattr(jax.devices()[0], "compute_capability", None)
    if capability is None:  # not CUDA: let the lowering decide
        return
    major, minor = (int(x) for x in str(capability).split(".")[:2])
    if (major, minor) < (8, 9):
        raise NotImplementedError(
            f"out_dtype=float8_e4m3fn in the pallas kernels needs a GPU of compute capability "
            f">= 8.9 (this one: {capability}); implementation='xla' computes it"
        )
