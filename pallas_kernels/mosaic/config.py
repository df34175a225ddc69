"""Tiling of the Mosaic GPU (Hopper) flash kernels: forward and backward."""

from __future__ import annotations

import dataclasses

BACKENDS = ("auto", "triton", "mosaic")  # the values of the configs' `backend` fields
_SMEM_BYTES = 227 * 1024  # shared memory a block may hold on sm90
CONSUMERS = 2  # compute warpgroups per block (plus one producer)
KEY_ROWS = 64  # the forward's Tk is a multiple of this (not necessarily of block_kv)
# Full attention over at least this many keys takes 192-key steps up to D128 (`heuristic`).
LONG_FULL_KEYS = 2048
# The backward's head dims above this split the dK/dV block's columns between its two
# consumers, which then hold the same 64 keys (`backward.py`).
SPLIT_HEAD_DIM = 128


def full_attention(causal: bool, window, ragged: bool = False) -> bool:
    """Every query row sees every key: no causal mask, no window and (`ragged`: lengths
    or packing) no padding. `MosaicForwardConfig.heuristic`'s `full` is this of a dense
    or length-padded call; the short last step needs it of a dense batch, and so does
    the persistent form but for causal calls (`forward.causal_walks`)."""
    return not causal and window is None and not ragged


def split_columns(head_dim: int) -> bool:
    """The dK/dV block's two consumers hold the same keys, each half of the columns."""
    return head_dim > SPLIT_HEAD_DIM


def key_tile_rows(head_dim: int) -> int:
    """Keys per dK/dV block: 64 (both consumers, split columns) above SPLIT_HEAD_DIM, else
    128 (64 per consumer)."""
    return 64 if split_columns(head_dim) else CONSUMERS * 64


@dataclasses.dataclass(frozen=True)
class MosaicForwardConfig:
    """Tiling of `mosaic_forward`: hashable, passed as a static argument.

    Attributes:
      block_q: query rows per consumer warpgroup: 64 (wgmma's M; a block holds two
        consumer warpgroups, so it covers 128 rows; 128 rows per warpgroup would hold two
        128-column float32 tiles, more than a consumer's registers).
      block_kv: keys per step of the TMA ring: 64, 128 or 192 (wgmma contracts P V over
        multiples of 64 keys). Tk need not be a multiple: the last block's TMA copy
        reads zeros past Tk, and full attention over a dense batch runs that block as a
        narrower step over its real keys; other calls mask the keys past Tk.
      num_stages: slots of the ring, 2 to 4: K/V blocks in flight ahead of the consumers.
      persistent: calls whose tiles are all alike (no causal mask, window, lengths or
        packing), or causal over a dense batch without a window and Tq <= Tk
        (`forward.causal_walks`), run one block per SM, each walking its share of the
        tiles (causal: a list dealt as the GPU hands out a block per tile, heaviest
        first, `Launch.walk`): the producer loads the next tile's keys and values under
        this tile's last steps, and each consumer its next Q. O leaves through a Q-sized
        tile more of shared memory where that fits (`out_tiles`: 128-key steps up to
        D128, 192-key steps at D64); else (192-key steps at D128) through the rows of
        the last key block's K and V slots past Tk, which its short step does not read
        (Tk not a multiple of 192, full attention), or failing those through Q's
        buffer, the next Q loading once that copy has read it. Other calls (windows,
        lengths, packing), and grids of at most one wave, launch a block per tile, which
        the GPU hands out as SMs free up.
    """

    block_q: int = 64
    block_kv: int = 128
    num_stages: int = 2
    persistent: bool = False

    def __post_init__(self):
        if self.block_q != 64:
            raise ValueError(f"MosaicForwardConfig: block_q={self.block_q} must be 64")
        if self.block_kv not in (64, 128, 192):
            raise ValueError(f"MosaicForwardConfig: block_kv={self.block_kv} not in (64, 128, 192)")
        if not 2 <= self.num_stages <= 4:
            raise ValueError(f"MosaicForwardConfig: num_stages={self.num_stages} not in 2..4")

    @property
    def rows(self) -> int:
        """Query rows per block (both consumer warpgroups)."""
        return CONSUMERS * self.block_q

    def smem_bytes(self, head_dim: int, itemsize: int = 2) -> int:
        """Shared memory of a block: the two Q/O tiles (and with `out_tiles`, the two O
        tiles), the K and V ring, the lse rows."""
        return self._smem_bytes(head_dim, itemsize, self.out_tiles(head_dim, itemsize))

    def out_tiles(self, head_dim: int, itemsize: int = 2) -> bool:
        """Whether a persistent block stages O in tiles of its own (they fit beside Q's
        and the ring). Where they do not, O goes to the last key block's spare slot rows
        or Q's buffer (`forward.o_staging`)."""
        return self.persistent and self._smem_bytes(head_dim, itemsize, True) <= _SMEM_BYTES

    def _smem_bytes(self, head_dim: int, itemsize: int, out_tiles: bool) -> int:
        q = (2 if out_tiles else 1) * self.rows * head_dim * itemsize
        ring = 2 * self.num_stages * self.block_kv * head_dim * itemsize
        return q + ring + self.rows * 4

    def fits(self, head_dim: int, itemsize: int = 2) -> bool:
        return self.smem_bytes(head_dim, itemsize) <= _SMEM_BYTES

    @classmethod
    def heuristic(
        cls, head_dim: int, *, kv_rows: int = 0, full: bool = False
    ) -> MosaicForwardConfig:
        """128-key steps in two stages for head dims up to 128 (160 KiB of shared memory
        at D128, 192 KiB with the persistent form's O tiles); 64-key steps for D256 (192
        KiB). Persistent up to D128 (not asked at D256, where the O tiles do not fit).
        `full` calls (no causal mask or window) of at least LONG_FULL_KEYS keys
        (`kv_rows`, Tk) up to D128 take 192-key steps, persistent (224 KiB at D128: O
        leaves through the last block's spare slot rows, or Q's buffer when Tk is a
        multiple of 192); their last block, when Tk is not a multiple of 192, runs as a
        narrower step over its real keys.

        Measured on an H100 (jax 0.11.2, bf16 GQA 32/8, full attention, probes of
        2026-11-26 19:25-19:30 UTC, `bench/HISTORY.md`), persistent 192-key steps against
        persistent 128, ms: B1 S4096 0.462 / 0.481, B8 S2048 0.938 / 0.983, B1 S8192
        1.767 / 1.926, B1 S16384 7.004 / 7.578, D64 B8 S2048 0.632 / 0.655; but B16 S1024
        0.578 / 0.495 (O through Q's buffer then). Causal rows ran 5-46% slower in
        192-key steps. Calls of one wave of tiles over 2048-8192 keys (a block per tile)
        were not measured at 192 against 128 keys.
        """
        if full and head_dim <= 128 and kv_rows >= LONG_FULL_KEYS:
            return cls(64, 192, 2, persistent=True)
        return cls(64, 64 if head_dim > 128 else 128, 2, persistent=head_dim <= 128)


@dataclasses.dataclass(frozen=True)
class MosaicBackwardConfig:
    """Tiling of `mosaic_backward`: hashable, passed as a static argument.

    Both kernels hold 64 rows per consumer warpgroup (query rows in the dQ kernel, keys in
    the dK/dV kernel; 128 per block) and stream the other side through a TMA ring. Above
    head dim 128 the dK/dV kernel's two consumers hold the same 64 keys, each summing half
    of dK's and dV's columns (`key_tile_rows`).

    Attributes:
      block_kv_dq: keys per ring step of the dQ kernel: 64 or 128 (wgmma's K of dS K is
        a multiple of 64).
      num_stages: ring slots of both kernels, 2 or 3; above head dim 128 the dQ kernel's
        ring has one (`dq_stages`: two 64-key K/V slots of D256 do not fit beside the
        block's Q and dO).
    """

    block_kv_dq: int = 64
    num_stages: int = 2

    block_q_dkv = 64  # query rows per ring step of the dK/dV kernel (wgmma's N of S^T)

    def __post_init__(self):
        if self.block_kv_dq not in (64, 128):
            raise ValueError(
                f"MosaicBackwardConfig: block_kv_dq={self.block_kv_dq} not in (64, 128)"
            )
        if self.num_stages not in (2, 3):
            raise ValueError(f"MosaicBackwardConfig: num_stages={self.num_stages} not in (2, 3)")

    @property
    def rows(self) -> int:
        """Query rows per dQ block (both consumer warpgroups); keys per dK/dV block up to
        head dim SPLIT_HEAD_DIM (`key_tile_rows`)."""
        return CONSUMERS * 64

    def dq_stages(self, head_dim: int) -> int:
        """Ring slots of the dQ kernel: `num_stages`, one above head dim 128."""
        return self.num_stages if head_dim <= SPLIT_HEAD_DIM else 1

    def smem_bytes(self, head_dim: int, itemsize: int = 2) -> int:
        """Shared memory of the larger kernel's block: the rows it holds (Q and dO with
        their lse / delta, or K and V) and its ring."""
        dq_held = 2 * self.rows * head_dim * itemsize + 2 * self.rows * 4
        dq_ring = 2 * self.dq_stages(head_dim) * self.block_kv_dq * head_dim * itemsize
        dkdv_held = 2 * key_tile_rows(head_dim) * head_dim * itemsize
        dkdv_ring = self.num_stages * self.block_q_dkv * (2 * head_dim * itemsize + 2 * 4)
        return max(dq_held + dq_ring, dkdv_held + dkdv_ring)

    def fits(self, head_dim: int, itemsize: int = 2) -> bool:
        return self.smem_bytes(head_dim, itemsize) <= _SMEM_BYTES

    @classmethod
    def heuristic(cls, masked: bool, head_dim: int = 128) -> MosaicBackwardConfig:
        """Two stages; 128-key dQ steps without a causal mask or window, 64 with one or
        above head dim 128 (shared memory).

        Measured on an H100 (jax 0.11.2, bf16 GQA 32/8 D128, backward alone, 2026-11-25):
        64-key steps in 2 stages ran B1 S4096 causal / full, B1 S16384 causal, B8 S2048
        causal in 1.01 / 1.48 / 11.8 / 1.69 ms; 3 stages 1.03 / 1.57 / 12.3 / 1.81;
        128-key dQ steps 1.02 / 1.40 / 12.0 / 1.83.
        """
        return cls(block_kv_dq=64 if masked or head_dim > 128 else 128, num_stages=2)
