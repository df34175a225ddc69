"""Block sizes and launch parameters of the flash prefill kernel."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_kernels.common import next_power_of_2


def _is_power_of_2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclasses.dataclass(frozen=True)
class FlashPrefillConfig:
    """Tiling of `flash_prefill`: hashable, passed as a static argument.

    Attributes:
      block_q: query rows per program (a power of two, >= 16: Triton's dot minimum).
      block_kv: keys per inner-loop step (a power of two, >= 16).
      num_warps: warps per program.
      num_stages: software-pipelining depth of the KV loop.
    """

    block_q: int = 128
    block_kv: int = 64
    num_warps: int = 8
    num_stages: int = 3

    def __post_init__(self):
        for name in ("block_q", "block_kv"):
            size = getattr(self, name)
            if not (_is_power_of_2(size) and size >= 16):
                raise ValueError(f"FlashPrefillConfig: {name}={size} must be a power of 2 >= 16")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"FlashPrefillConfig: num_warps={self.num_warps} not in 1..16 (pow2)")
        if self.num_stages < 1:
            raise ValueError(f"FlashPrefillConfig: num_stages={self.num_stages} must be >= 1")

    @classmethod
    def heuristic(
        cls, q_len: int, kv_len: int, head_dim: int, dtype, causal: bool = False
    ) -> FlashPrefillConfig:
        """A config for the shape: `q_len`/`kv_len` are per-sequence token counts (max)."""
        del kv_len, causal  # The tiling below is the same for both (measured on H100).
        padded_dim = next_power_of_2(head_dim)
        wide = jnp.dtype(dtype).itemsize >= 4
        if padded_dim >= 256 or wide:
            block_q, block_kv, num_warps, num_stages = 64, 32, 4, 2
        elif padded_dim >= 128:
            block_q, block_kv, num_warps, num_stages = 128, 64, 8, 3
        else:
            block_q, block_kv, num_warps, num_stages = 128, 64, 4, 3
        block_q = min(block_q, max(16, next_power_of_2(q_len)))
        return cls(block_q, block_kv, num_warps, num_stages)
