"""Helpers shared by the kernels: the interpret switch and in-kernel math.

Everything here is plain `jnp` so it runs both inside a Pallas (Triton) kernel body and
in ordinary XLA code; `jaxattn.positional` re-exports the public pieces.
"""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp

# Finite stand-in for -inf inside kernels: exp2(MASK - m) underflows to 0 for any real
# row maximum m, and never produces inf - inf = NaN when a whole block is masked.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


def use_interpret() -> bool:
    """Kernels run compiled on a GPU backend and in Pallas interpret mode elsewhere.

    `JAXATTN_INTERPRET=0/1` overrides: the lowering tests set 0 on a CPU machine to lower
    the kernels for CUDA (Triton) without running them.
    """
    forced = os.environ.get("JAXATTN_INTERPRET")
    if forced is not None:
        return forced not in ("0", "false", "False", "")
    return jax.default_backend() != "gpu"


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


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
