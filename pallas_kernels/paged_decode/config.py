"""Tiling and split-K ("multi-block") choice of the paged decode kernel."""

from __future__ import annotations

import dataclasses

import jax

from pallas_kernels.common import next_power_of_2

_DEFAULT_SM_COUNT = 132  # H100 SXM; read from the device when it says


@dataclasses.dataclass(frozen=True)
class PagedDecodeConfig:
    """Tiling of `paged_decode`: hashable, passed as a static argument.

    Attributes:
      block_kv: cached tokens per inner-loop step (a power of two >= 16; may span several
        small pages or part of a large one).
      num_splits: the context is cut into this many chunks, each a program of its own,
        combined afterwards through their log-sum-exps (split-K / "multi-block" mode).
      num_warps, num_stages: Triton launch parameters.
    """

    block_kv: int = 64
    num_splits: int = 1
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        if self.block_kv < 16 or self.block_kv & (self.block_kv - 1):
            raise ValueError(
                f"PagedDecodeConfig: block_kv={self.block_kv} must be a power of 2 >= 16"
            )
        if self.num_splits < 1:
            raise ValueError(f"PagedDecodeConfig: num_splits={self.num_splits} must be >= 1")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(
                f"PagedDecodeConfig: num_warps={self.num_warps} not a power of 2 <= 16"
            )
        if self.num_stages < 1:
            raise ValueError(f"PagedDecodeConfig: num_stages={self.num_stages} must be >= 1")

    @classmethod
    def heuristic(
        cls, batch: int, num_kv_heads: int, max_context: int, page_size: int, sm_count=None
    ) -> PagedDecodeConfig:
        """Split the context when `batch * num_kv_heads` programs cannot fill the GPU.

        Each split should still stream several blocks, or the combine pass and the
        per-program start-up dominate. (Not yet tuned on a GPU: see bench/RESULTS.md.)
        """
        sm_count = sm_count or _sm_count()
        block_kv = min(128, max(64, next_power_of_2(page_size)))
        programs = batch * num_kv_heads
        splits = 1
        if programs < sm_count:
            splits = -(-2 * sm_count // programs)  # two programs per SM
            splits = min(splits, max(1, max_context // (4 * block_kv)), 64)
        return cls(block_kv=block_kv, num_splits=splits)


def _sm_count() -> int:
    device = jax.devices()[0]
    return getattr(device, "core_count", None) or _DEFAULT_SM_COUNT
