"""Pieces both Hopper kernels (`forward.py`, `backward.py`) are built from: the warpgroup
roles, integer bounds that stay Python ints where they can, the visibility predicate, and
the producer's side of the TMA ring."""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.mosaic.config import CONSUMERS

PRODUCER_REGISTERS = 40  # the producer warpgroup only issues TMA copies
CONSUMER_REGISTERS = 232  # what the consumers take back (wgmma accumulators)

__all__ = [
    "CONSUMERS",
    "CONSUMER_REGISTERS",
    "PRODUCER_REGISTERS",
    "clip",
    "floor_div",
    "imax",
    "imin",
    "load_plgpu",
    "produce",
    "slot_of",
    "union",
    "visible",
]


def load_plgpu():
    """`jax.experimental.pallas.mosaic_gpu`, imported when a kernel is built."""
    from jax.experimental.pallas import mosaic_gpu

    return mosaic_gpu


def _static(*xs) -> bool:
    return all(isinstance(x, int) for x in xs)


def imax(a, b):
    """max that stays a Python int for Python ints: Mosaic GPU kernels take no array
    constants, and jnp on two ints would make one."""
    return max(a, b) if _static(a, b) else jnp.maximum(a, b)


def imin(a, b):
    return min(a, b) if _static(a, b) else jnp.minimum(a, b)


def clip(x, lo, hi):
    return imin(imax(x, lo), hi)


def floor_div(a, b: int):
    """floor(a / b) for a >= 0, and 0 for a < 0 (all the callers clip at 0 anyway)."""
    return lax.div(jnp.maximum(a, 0), b)


def slot_of(step, stages: int):
    """The ring slot of ring step `step`."""
    return step % stages if isinstance(step, int) else lax.rem(step, stages)


def visible(pos, key, *, causal: bool, window: int | None):
    """Whether the query at position `pos` sees the key at `key` (arrays of one shape):
    causal (key <= pos) and within the window (key > pos - window). At least one of
    `causal` / `window` is set."""
    seen = key <= pos if causal else None
    if window is not None:
        in_window = key > pos - window
        seen = in_window if seen is None else seen & in_window
    return seen


def union(lo0, hi0, lo1, hi1):
    """The producer's range of ring steps: both consumers' `[lo, hi)` (an empty one adds
    nothing)."""
    if _static(lo0, hi0, lo1, hi1):
        return min(lo0, lo1), max(hi0, hi1)
    lo = jnp.where(hi0 > lo0, lo0, lo1)
    lo = jnp.where(hi1 > lo1, jnp.minimum(lo, lo1), lo)
    hi = imax(hi0, hi1)
    return imin(lo, hi), hi


def produce(lo, hi, stages: int, load):
    """The producer's loop over ring steps `[lo, hi)`: the first `stages` without waiting,
    the rest each once its slot is consumed (`load(step, wait)` issues the copies)."""
    for i in range(stages):
        pl.when(lo + i < hi)(functools.partial(load, lo + i, False))

    @pl.loop(lo + stages, imax(hi, lo + stages))
    def _(step):
        load(step, True)
