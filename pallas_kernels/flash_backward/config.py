"""Block sizes and launch parameters of the flash backward kernels (dK/dV and dQ)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_kernels.common import check_config, next_power_of_2
from pallas_kernels.mosaic.config import BACKENDS, MosaicBackwardConfig

_BLOCKS = ("block_q_dkv", "block_kv_dkv", "block_q_dq", "block_kv_dq")
_TRITON_FIELDS = (*_BLOCKS, "num_warps", "num_stages")  # None: the heuristic's


def fill_tiles(config, fields, heuristic):
    """`config` with each of its tile `fields` left None taken from the config that
    `heuristic()` returns (called only when some field is unset)."""
    unset = [name for name in fields if getattr(config, name) is None]
    if not unset:
        return config
    tiles = heuristic()
    return dataclasses.replace(config, **{name: getattr(tiles, name) for name in unset})


@dataclasses.dataclass(frozen=True)
class FlashBackwardConfig:
    """Tiling of the two backward kernels: hashable, a static argument.

    The dK/dV kernel holds `block_kv_dkv` keys of one kv head and walks `block_q_dkv` query
    rows at a time (every query head of the group in turn); the dQ kernel holds `block_q_dq`
    query rows of one head and walks `block_kv_dq` keys at a time. Each is a power of two
    >= 16 (Triton's dot minimum). `num_warps` / `num_stages`: per kernel, (dK/dV, dQ).
    A field left None takes `heuristic`'s value for the call's shape (`resolve`).

    `backend`: which kernels run the gradient of a dense batch. "auto": the Hopper kernels
    (`pallas_kernels.mosaic`, Mosaic GPU) on compute capability 9.x when they cover the
    call, else the Triton kernels; "triton" or "mosaic" force one ("mosaic" raises
    NotImplementedError, with the reason, where it cannot). The fields above tile the
    Triton kernels; `mosaic` (a `MosaicBackwardConfig`, None: its heuristic) the Hopper ones.
    """

    block_q_dkv: int | None = None
    block_kv_dkv: int | None = None
    block_q_dq: int | None = None
    block_kv_dq: int | None = None
    num_warps: tuple[int, int] | None = None
    num_stages: tuple[int, int] | None = None
    backend: str = "auto"
    mosaic: MosaicBackwardConfig | None = None

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"FlashBackwardConfig: backend={self.backend!r} not in {BACKENDS}")
        check_config("FlashBackwardConfig: mosaic", self.mosaic, MosaicBackwardConfig)
        for name in _BLOCKS:
            size = getattr(self, name)
            if size is not None and not (size >= 16 and size & (size - 1) == 0):
                raise ValueError(f"FlashBackwardConfig: {name}={size} must be a power of 2 >= 16")
        pairs = [x for x in (self.num_warps, self.num_stages) if x is not None]
        if (
            any(not isinstance(x, tuple) or len(x) != 2 for x in pairs)
            or min(self.num_stages or (1,)) < 1
        ):
            raise ValueError(
                f"FlashBackwardConfig: num_warps={self.num_warps}, num_stages={self.num_stages}:"
                " a pair, one entry >= 1 per kernel (dK/dV, dQ)"
            )
        for w in self.num_warps or ():
            if w not in (1, 2, 4, 8, 16):
                raise ValueError(f"FlashBackwardConfig: num_warps={self.num_warps} not in 1..16")

    def resolve(self, q_len: int, kv_len: int, head_dim: int, dtype) -> FlashBackwardConfig:
        """This config with every Triton field left None taken from `heuristic` for the
        shape (a config built only to choose `backend` or `mosaic` tiles like the default)."""
        heuristic = FlashBackwardConfig.heuristic
        return fill_tiles(self, _TRITON_FIELDS, lambda: heuristic(q_len, kv_len, head_dim, dtype))

    @classmethod
    def heuristic(cls, q_len: int, kv_len: int, head_dim: int, dtype) -> FlashBackwardConfig:
        """A config for the shape: `q_len` / `kv_len` per sequence (the maximum).

        Measured on an H100 (jax 0.11.2, bf16 D128 GQA 32/8, fwd+bwd at B1 S4096 and
        S16384 causal, 2026-11-24): 64x64 tiles in both kernels, 4 warps, 2 stages ran
        1.45 / 20.6 ms; 64x64 dK/dV with 128x64 dQ at 8 warps 1.52 / 21.7; 128x64 / 64x128
        at 8 warps 2.01 / 29.5; three stages 1.85 / 26.2; 32-row blocks 1.90 / 27.3; 128-key
        dK/dV tiles 3.7 / 53 (they spill). 256-wide heads and float32 take 32-row blocks
        and one stage to stay within shared memory.
        """
        padded_dim = next_power_of_2(head_dim)
        if padded_dim >= 512:  # within an H100's shared memory at D512 (2026-11-27)
            size = 16 if jnp.dtype(dtype).itemsize >= 4 else 32
            config = cls(size, size, size, size, (4, 4), (1, 1))
        elif padded_dim >= 256 or jnp.dtype(dtype).itemsize >= 4:
            config = cls(32, 64, 64, 32, (4, 4), (1, 1))
        else:
            config = cls(64, 64, 64, 64, (4, 4), (2, 2))
        cap_q = max(16, next_power_of_2(q_len))
        cap_kv = max(16, next_power_of_2(kv_len))
        return dataclasses.replace(
            config,
            block_q_dkv=min(config.block_q_dkv, cap_q),
            block_kv_dkv=min(config.block_kv_dkv, cap_kv),
            block_q_dq=min(config.block_q_dq, cap_q),
            block_kv_dq=min(config.block_kv_dq, cap_kv),
        )
