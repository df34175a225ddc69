"""Index inputs given on the host: checked against int32 before JAX takes them.

With jax's 64-bit mode off (the default, and the Pallas kernels' requirement), `jnp.asarray`
of a numpy int64 array wraps every value to 32 bits without a warning: a sequence id 2**32
becomes id 0, a slot past the pool a slot inside it. Each entry point that takes ids,
lengths, slots or pages calls `check_int32` on what it was given first.
"""

from __future__ import annotations

import jax
import numpy as np

__all__ = ["check_int32", "host_values"]

_INT32 = np.iinfo(np.int32)


def host_values(x) -> np.ndarray | None:
    """`x` as a numpy array if it is a host value (numpy, a list, a number); None for JAX
    arrays and tracers (already int32, or traced: not looked at)."""
    return None if isinstance(x, jax.Array) else np.asarray(x)


def check_int32(where: str, name: str, x) -> None:
    """A ValueError naming `where` and `name` if `x` is a host integer array (numpy, a
    list) with values outside int32. JAX arrays and tracers pass: already int32, or traced."""
    raw = host_values(x)
    if raw is None:
        return
    if raw.dtype.kind in "iu" and raw.size and (raw.min() < _INT32.min or raw.max() > _INT32.max):
        raise ValueError(
            f"{where}: {name} holds values outside int32 ({raw.min()}..{raw.max()}); "
            "jax (64-bit mode off) would wrap them"
        )
