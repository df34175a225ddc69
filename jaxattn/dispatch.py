"""`implementation=`: which backend runs an op (tokamax-style names with fallback)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import jax

__all__ = ["IMPLEMENTATIONS", "resolve_implementations", "run_first"]

IMPLEMENTATIONS = ("pallas", "xla")
T = TypeVar("T")


def resolve_implementations(implementation: str | Sequence[str] | None) -> tuple[str, ...]:
    """None -> pallas on a GPU (xla as fallback), xla elsewhere; a name or a list as given.
    Pallas needs jax's 64-bit mode off: a ValueError says so rather than a kernel's
    TypeError."""
    if implementation is None:
        names = ("xla",) if jax.default_backend() != "gpu" else ("pallas", "xla")
    elif isinstance(implementation, str):
        names = (implementation,)
    else:
        names = tuple(implementation)
    for name in names:
        if name not in IMPLEMENTATIONS:
            raise ValueError(f"{implementation=}: each name must be one of {IMPLEMENTATIONS}")
    if not names:
        raise ValueError(f"{implementation=}: empty")
    if "pallas" in names and _x64():
        raise ValueError(
            f"{implementation=}: the Pallas kernels index in int32 and do not run with "
            "jax_enable_x64 on; turn it off, or pass implementation='xla'"
        )
    return names


def _x64() -> bool:
    """jax's 64-bit mode is on (the `jax_enable_x64` flag, or its context manager)."""
    return jax.dtypes.canonicalize_dtype(jax.numpy.int64) == jax.numpy.int64


def run_first(implementation: str | Sequence[str] | None, run: Callable[[str], T]) -> T:
    """`run(name)` for each implementation in turn; NotImplementedError falls through."""
    errors = []
    for name in resolve_implementations(implementation):
        try:
            return run(name)
        except NotImplementedError as e:
            errors.append(f"{name}: {e}")
    raise NotImplementedError("no implementation could run this call: " + "; ".join(errors))
