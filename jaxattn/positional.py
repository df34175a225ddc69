"""Position-dependent logit terms: ALiBi slopes and T5 relative-position bias (rotary
embeddings, which act on q and k instead, are `jaxattn.rope`)."""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from jaxtyping import Array, Float

from pallas_kernels.common import relative_position_bucket

__all__ = ["RelativeBias", "alibi_slopes", "relative_position_bucket"]


def alibi_slopes(num_heads: int) -> np.ndarray:
    """The ALiBi head slopes of Press et al. (2022), float32 `[num_heads]`.

    For a power of two n the slopes are the geometric sequence starting at and with ratio
    2**(-8/n). Otherwise the paper takes the slopes of the closest smaller power of two and
    adds every other slope of the next power of two.
    """
    if num_heads < 1:
        raise ValueError(f"alibi_slopes: {num_heads=} must be >= 1")

    def power_of_2(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    if math.log2(num_heads).is_integer():
        slopes = power_of_2(num_heads)
    else:
        closest = 2 ** math.floor(math.log2(num_heads))
        slopes = power_of_2(closest) + power_of_2(2 * closest)[0::2][: num_heads - closest]
    return np.asarray(slopes, dtype=np.float32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RelativeBias:
    """Implicit T5 relative-position bias: adds `table[h, bucket(key_pos - query_pos)]`.

    Attributes:
      table: float `[Hq, num_buckets]`, the learned bias per head and bucket.
      max_distance: distances at or beyond this share the last bucket (T5: 128).
      bidirectional: encoder-style (keys on both sides get their own buckets) or
        decoder-style (only keys before the query are distinguished).
    """

    table: Float[Array, "Hq num_buckets"]
    max_distance: int = dataclasses.field(default=128, metadata=dict(static=True))
    bidirectional: bool = dataclasses.field(default=True, metadata=dict(static=True))

    @property
    def num_buckets(self) -> int:
        return self.table.shape[-1]
