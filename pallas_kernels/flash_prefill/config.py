"""Block sizes and launch parameters of the flash prefill kernel."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_kernels.common import check_config, next_power_of_2
from pallas_kernels.flash_backward.config import FlashBackwardConfig, fill_tiles
from pallas_kernels.mosaic.config import BACKENDS, MosaicForwardConfig


def _is_power_of_2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


_TRITON_FIELDS = ("block_q", "block_kv", "num_warps", "num_stages")


@dataclasses.dataclass(frozen=True)
class FlashPrefillConfig:
    """Tiling of `flash_prefill`: hashable, passed as a static argument.

    Attributes (the first four tile the Triton kernel; each left None is taken from
    `heuristic` for the call's shape, so a config built only to choose `backend`,
    `backward` or `mosaic` tiles like no config at all):
      block_q: query rows per program (a power of two, >= 16).
      block_kv: keys per inner-loop step (a power of two, >= 16).
      num_warps: warps per program.
      num_stages: software-pipelining depth of the KV loop.
      backward: the tiling of the gradient's kernels (`FlashBackwardConfig`); None picks
        `FlashBackwardConfig.heuristic` for the shape.
      backend: which kernel runs the forward of a dense batch. "auto": the Hopper kernel
        (`pallas_kernels.mosaic`, Mosaic GPU) on compute capability 9.x when it covers
        the call, else the Triton kernel; "triton" or "mosaic" force one ("mosaic" raises
        NotImplementedError, with the reason, for a call or device it does not cover).
        The fields above tile the Triton kernel; `mosaic` tiles the Hopper one.
      mosaic: the Hopper kernel's tiling (`MosaicForwardConfig`); None picks its heuristic.
    """

    block_q: int | None = None
    block_kv: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    backward: FlashBackwardConfig | None = None
    backend: str = "auto"
    mosaic: MosaicForwardConfig | None = None

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"FlashPrefillConfig: backend={self.backend!r} not in {BACKENDS}")
        check_config("FlashPrefillConfig: backward", self.backward, FlashBackwardConfig)
        check_config("FlashPrefillConfig: mosaic", self.mosaic, MosaicForwardConfig)
        for name in ("block_q", "block_kv"):
            size = getattr(self, name)
            if size is not None and not (_is_power_of_2(size) and size >= 16):
                raise ValueError(f"FlashPrefillConfig: {name}={size} must be a power of 2 >= 16")
        if self.num_warps not in (None, 1, 2, 4, 8, 16):
            raise ValueError(f"FlashPrefillConfig: num_warps={self.num_warps} not in 1..16 (pow2)")
        if self.num_stages is not None and self.num_stages < 1:
            raise ValueError(f"FlashPrefillConfig: num_stages={self.num_stages} must be >= 1")

    @property
    def resolved(self) -> bool:
        """Every Triton tile field is set (the kernel takes no other)."""
        return all(getattr(self, name) is not None for name in _TRITON_FIELDS)

    def fill(self, tiles: FlashPrefillConfig) -> FlashPrefillConfig:
        """This config with each Triton field left None taken from `tiles`."""
        return fill_tiles(self, _TRITON_FIELDS, lambda: tiles)

    def resolve(self, *shape, **features) -> FlashPrefillConfig:
        """`fill` from `heuristic(*shape, **features)` (the same arguments)."""
        heuristic = FlashPrefillConfig.heuristic
        return fill_tiles(self, _TRITON_FIELDS, lambda: heuristic(*shape, **features))

    @classmethod
    def heuristic(
        cls,
        q_len: int,
        kv_len: int,
        head_dim: int,
        dtype,
        causal: bool = False,
        *,
        lengths: bool = False,
        packed: bool = False,
        logit_tiles: bool = False,
        paged: bool = False,
    ) -> FlashPrefillConfig:
        """A config for the shape and features.

        `q_len`/`kv_len` are per-sequence token counts (the maximum); `lengths`: q/kv
        lengths are data; `packed`: a packed (cu_seqlens) batch; `logit_tiles`: a bias,
        mask or T5 table is read per key block. Measured on an H100 (bench/HISTORY.md,
        2026-11-22), bf16 D128 GQA 32/8: 128x128 tiles run 4-20% faster than 128x64, with
        lengths as data too since the kernel runs its masked blocks first (the chunk's
        work with lengths: 463 vs 435 TFLOP/s; 344 on 128x128 before); three pipeline
        stages beat two and four; packed mixed-length batches run 10% faster on 64x32
        tiles than on 128x64 (less waste in partial tiles; 64x64 was level within noise
        in the sweep before the 16:33 UTC run). Bias/mask/T5 tiles are pipelined too: at
        128x128x3 they need up to 352 KiB of shared memory (the H100 has 227), at
        128x64x2 they fit.
        `paged`: keys come from a paged cache (chunked context); a 2048-token chunk over a
        14k prefix runs at 348 TFLOP/s on 128x64x8x3, against 284 on 128x128x8x3 and
        279 on 64x32x4x3 (2026-11-22 sweep before the 16:33 UTC run, bench/HISTORY.md).
        """
        padded_dim = next_power_of_2(head_dim)
        wide = jnp.dtype(dtype).itemsize >= 4
        if padded_dim >= 512:  # two stages asked 384 KiB of shared memory at D512 (H100)
            block_q, block_kv, num_warps, num_stages = (32, 16, 4, 1) if wide else (64, 32, 4, 1)
        elif padded_dim >= 256 or wide:
            block_q, block_kv, num_warps, num_stages = 64, 32, 4, 2
        elif logit_tiles:
            block_q, block_kv, num_warps, num_stages = 128, 64, 8 if padded_dim >= 128 else 4, 2
        elif padded_dim >= 128 and paged:
            block_q, block_kv, num_warps, num_stages = 128, 64, 8, 3
        elif padded_dim >= 128 and packed:
            block_q, block_kv, num_warps, num_stages = 64, 32, 4, 3
        elif padded_dim >= 128:
            # Full attention without lengths runs its key loop with static bounds; when
            # the last block is cut (kv_len not a multiple of 128), three stages ask for
            # 288 KiB of shared memory (H100: 227) and the launch fails; two fit.
            cut = not causal and not lengths and kv_len % 128 != 0
            block_q, block_kv, num_warps, num_stages = 128, 128, 8, 2 if cut else 3
        else:
            block_q, block_kv, num_warps, num_stages = 128, 64, 4, 3
        block_q = min(block_q, max(16, next_power_of_2(q_len)))
        return cls(block_q, block_kv, num_warps, num_stages)
