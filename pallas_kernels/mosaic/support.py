"""Which calls the Mosaic GPU kernels cover, and on which devices they run.

The dispatchers (`jaxattn.attention`, ring attention's per-block calls) ask
`select_forward` / `select_backward`, which read `forward_unsupported` /
`backward_unsupported`: None means the Hopper kernel takes the call, a string says why not
(the Triton kernel then runs, or a forced backend raises with that reason). Everything
here is static: shapes, dtypes, options.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.common import use_interpret
from pallas_kernels.mosaic.config import KEY_ROWS, MosaicBackwardConfig, MosaicForwardConfig
from pallas_kernels.mosaic.packed import rows_unsupported

HEAD_DIMS = (64, 128, 256)
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def device_unsupported(device=None) -> str | None:
    """None on a GPU of compute capability 9.x (Hopper: wgmma, TMA), else why not.
    `device`: the one asked about; None: the default device, and the kernels compiled
    (not in Pallas interpret mode, which Mosaic GPU kernels cannot run in)."""
    if device is None:
        if use_interpret():
            return "Mosaic GPU kernels run compiled only (Pallas interpret mode is on)"
        device = jax.devices()[0]
    if device.platform != "gpu":
        return f"Mosaic GPU kernels need an sm90 GPU (this device: {device.platform})"
    capability = str(getattr(device, "compute_capability", ""))
    if not capability.startswith("9."):
        return f"Mosaic GPU kernels need compute capability 9.x (this GPU: {capability or '?'})"
    return None


def select_forward(config, q_shape, k_shape, dtype, *, device=None, full=False, **features):
    """The Hopper kernel's tiling if it runs this forward, None if the Triton kernel does.

    config: a `FlashPrefillConfig` or None. Its `backend` "auto" (or no config) takes the
    Hopper kernel on compute capability 9.x where `forward_unsupported(..., **features)`
    says it covers the call; "mosaic" insists, raising NotImplementedError with the
    reason otherwise; "triton" never takes it. `device`: the device asked about (default
    the first); `full`: a dense call with no causal mask or window (for the tiling
    heuristic, `MosaicForwardConfig.heuristic`)."""
    tiling = None if config is None else config.mosaic
    tiling = tiling or MosaicForwardConfig.heuristic(q_shape[-1], kv_rows=k_shape[-3], full=full)
    return _select(config, tiling, device, forward_unsupported, q_shape, k_shape, dtype, **features)


def select_backward(config, q_shape, k_shape, dtype, *, masked, device=None, **features):
    """The Hopper backward's tiling if it runs this gradient, None if the Triton kernels do.

    config: a `FlashBackwardConfig` or None, its `backend` read as `select_forward` reads
    the forward's; `masked`: a causal mask or a window (for the tiling heuristic);
    features: as `backward_unsupported`'s."""
    tiling = None if config is None else config.mosaic
    tiling = tiling or MosaicBackwardConfig.heuristic(masked, q_shape[-1])
    return _select(
        config, tiling, device, backward_unsupported, q_shape, k_shape, dtype, **features
    )


def _select(config, tiling, device, unsupported, *args, **features):
    requested = "auto" if config is None else config.backend
    if requested == "triton":
        return None
    why = device_unsupported(device) or unsupported(*args, config=tiling, **features)
    if why is None:
        return tiling
    if requested == "mosaic":
        raise NotImplementedError(f"backend='mosaic' does not cover this call: {why}")
    return None


def _options_unsupported(dtype, *, terms: bool = False, out_fp8: bool = False) -> str | None:
    """The options neither Hopper kernel covers (the first one found), or None.
    `terms`: a bias, mask, ALiBi or T5 table. (Both cover q and kv lengths and sinks.)"""
    if terms:
        return "bias, mask, ALiBi or T5 terms"
    if out_fp8:
        return "an FP8 output"
    if jnp.dtype(dtype) not in DTYPES:
        return f"dtype {jnp.dtype(dtype).name} (bfloat16 and float16 only)"
    return None


def forward_unsupported(
    q_shape, k_shape, dtype, *, config: MosaicForwardConfig, packed: bool = False, **options
):
    """None if `mosaic_forward` (or, `packed`, `mosaic_forward_packed`) computes this
    call, else the first reason it cannot.

    q_shape, k_shape: dense `[B, Tq, Hq, D]`, `[B, Tk, Hkv, D]`, or packed `[Tq, Hq, D]`,
    `[Tk, Hkv, D]`; options: the call's `terms`, `out_fp8` (`_options_unsupported`).
    Causal, window, sinks, soft-cap, scale, GQA and q/kv lengths are always covered.
    """

    def dense_rows(q_rows, kv_rows):
        if q_rows % config.rows:
            return f"Tq={q_rows} not a multiple of {config.rows} (2 * block_q)"
        if kv_rows % KEY_ROWS:
            return f"Tk={kv_rows} not a multiple of {KEY_ROWS}"
        return None

    return _unsupported(q_shape, k_shape, dtype, config, packed, dense_rows, options)


def backward_unsupported(
    q_shape, k_shape, dtype, *, config: MosaicBackwardConfig, packed: bool = False, **options
):
    """None if `mosaic_backward` (or, `packed`, `mosaic_backward_packed`) computes this
    gradient, else the first reason it cannot (the arguments as `forward_unsupported`'s)."""

    def dense_rows(q_rows, kv_rows):
        if q_rows % config.rows or kv_rows % config.rows:  # (and so of block_kv_dq)
            return f"Tq={q_rows}, Tk={kv_rows} in the backward: multiples of {config.rows}"
        return None

    return _unsupported(q_shape, k_shape, dtype, config, packed, dense_rows, options)


def _unsupported(q_shape, k_shape, dtype, config, packed: bool, dense_rows, options):
    """The checks both kernels share, with `dense_rows(Tq, Tk)` the dense row check."""
    why = _options_unsupported(dtype, **options)
    if why is not None:
        return why
    head_dim = q_shape[-1]
    if head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim} (one of {HEAD_DIMS})"
    rows = rows_unsupported(q_shape, k_shape) if packed else dense_rows(q_shape[1], k_shape[1])
    return rows or _smem_unsupported(config, head_dim, dtype)


def _smem_unsupported(config, head_dim: int, dtype) -> str | None:
    if config.fits(head_dim, jnp.dtype(dtype).itemsize):
        return None
    return f"{config} needs {config.smem_bytes(head_dim)} bytes of shared memory"
