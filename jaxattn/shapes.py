"""Shape predicates shared by the input checks (a leaf module: the checks of `quant`,
`rope` and `validation` import it, and it imports none of them)."""

from __future__ import annotations

import numpy as np

__all__ = ["broadcasts_into"]


def broadcasts_into(shape: tuple, into: tuple) -> bool:
    """Whether an array of `shape` broadcasts against `into` without growing it."""
    try:
        return np.broadcast_shapes(tuple(shape), tuple(into)) == tuple(into)
    except ValueError:
        return False
