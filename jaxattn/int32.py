"""Index inputs given on the host: checked against int32 before JAX takes them.

With jax's 64-bit mode off (the default, and the Pallas kernels' requirement), `jnp.asarray`
of a numpy int64 array wraps every value to 32 bits without a warning: a sequence id 2**32
becomes id 0, a slot past the pool a slot inside it. Each entry point that takes ids,
lengths, slots or pages calls `check_int32` on what it was given first, and casts with
`as_int32`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["as_int32", "check_int32", "host_values", "is_int"]

_INT32 = np.iinfo(np.int32)


def is_int(value) -> bool:
    """A Python or numpy int given as a static size or option: not a bool, not a float of
    integral value."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def host_values(x) -> np.ndarray | None:
    """`x` as a numpy array if it is a host value (numpy, a list, a number); None for JAX
    arrays and tracers."""
    return None if isinstance(x, jax.Array) else np.asarray(x)


def _wide(dtype) -> bool:
    """An integer dtype holding values outside int32 (int64, uint32, uint64)."""
    return np.dtype(dtype).kind in "iu" and not np.can_cast(dtype, np.int32)


def check_int32(where: str, name: str, x) -> None:
    """A ValueError naming `where` and `name` if `x` holds integers outside int32: a host
    array (numpy, a list), or a concrete JAX array of a wider dtype (uint32; int64 under
    jax's 64-bit mode), whose cast to int32 would wrap. Tracers pass: `as_int32` saturates
    them."""
    raw = host_values(x)
    if raw is None:
        if isinstance(x, jax.core.Tracer) or not _wide(x.dtype):
            return
        raw = np.asarray(x)
    if raw.dtype.kind in "iu" and raw.size and (raw.min() < _INT32.min or raw.max() > _INT32.max):
        raise ValueError(
            f"{where}: {name} holds values outside int32 ({raw.min()}..{raw.max()}); "
            "a cast to int32 would wrap them"
        )


def as_int32(x) -> jax.Array:
    """`x` as int32, values of a wider integer dtype saturated into int32 rather than
    wrapped (traced ones, which `check_int32` cannot see): an id or length past int32
    reads as int32's bound, out of any pool, not as a small valid one."""
    x = jnp.asarray(x)
    if _wide(x.dtype):
        info = np.iinfo(x.dtype)  # bounds representable in x's own dtype
        lo, hi = max(int(info.min), int(_INT32.min)), min(int(info.max), int(_INT32.max))
        x = jnp.clip(x, jnp.asarray(lo, x.dtype), jnp.asarray(hi, x.dtype))
    return x.astype(jnp.int32)
