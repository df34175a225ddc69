"""Tiling of the Mosaic GPU (Hopper) flash forward kernel."""

from __future__ import annotations

import dataclasses

_SMEM_BYTES = 227 * 1024  # shared memory a block may hold on sm90
_COMPUTE_WARPGROUPS = 2


@dataclasses.dataclass(frozen=True)
class MosaicForwardConfig:
    """Tiling of `mosaic_forward`: hashable, passed as a static argument.

    Attributes:
      block_q: query rows per consumer warpgroup: 64 (wgmma's M; a block holds two
        consumer warpgroups, so it covers 128 rows; 128 rows per warpgroup would hold two
        128-column float32 tiles, more than a consumer's registers).
      block_kv: keys per step of the TMA ring: 64 or 128 (the sizes tested on the GPU).
      num_stages: slots of the ring, 2 to 4: K/V blocks in flight ahead of the consumers.
    """

    block_q: int = 64
    block_kv: int = 128
    num_stages: int = 2

    def __post_init__(self):
        if self.block_q != 64:
            raise ValueError(f"MosaicForwardConfig: block_q={self.block_q} must be 64")
        if self.block_kv not in (64, 128):
            raise ValueError(f"MosaicForwardConfig: block_kv={self.block_kv} not in (64, 128)")
        if not 2 <= self.num_stages <= 4:
            raise ValueError(f"MosaicForwardConfig: num_stages={self.num_stages} not in 2..4")

    @property
    def rows(self) -> int:
        """Query rows per block (both consumer warpgroups)."""
        return _COMPUTE_WARPGROUPS * self.block_q

    def smem_bytes(self, head_dim: int, itemsize: int = 2) -> int:
        """Shared memory of a block: the two Q/O tiles, the K and V ring, the lse rows."""
        q = self.rows * head_dim * itemsize
        ring = 2 * self.num_stages * self.block_kv * head_dim * itemsize
        return q + ring + self.rows * 4

    def fits(self, head_dim: int, itemsize: int = 2) -> bool:
        return self.smem_bytes(head_dim, itemsize) <= _SMEM_BYTES

    @classmethod
    def heuristic(cls, head_dim: int) -> MosaicForwardConfig:
        """128-key steps in two stages for head dims up to 128 (160 KiB of shared memory
        at D128); 64-key steps for D256 (192 KiB)."""
        return cls(block_q=64, block_kv=64 if head_dim > 128 else 128, num_stages=2)
