"""Which calls the Mosaic GPU kernels cover, and on which devices they run.

The dispatcher (`jaxattn.attention`) asks `forward_unsupported`: None means the Hopper
kernel takes the call, a string says why not (the Triton kernel then runs, or a forced
backend raises with that reason). Everything here is static: shapes, dtypes, options.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.mosaic.config import MosaicForwardConfig

HEAD_DIMS = (64, 128, 256)
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def device_unsupported(device=None) -> str | None:
    """None on a GPU of compute capability 9.x (Hopper: wgmma, TMA), else why not."""
    device = device or jax.devices()[0]
    if device.platform != "gpu":
        return f"Mosaic GPU kernels need an sm90 GPU (this device: {device.platform})"
    capability = str(getattr(device, "compute_capability", ""))
    if not capability.startswith("9."):
        return f"Mosaic GPU kernels need compute capability 9.x (this GPU: {capability or '?'})"
    return None


def forward_unsupported(
    q_shape,
    k_shape,
    dtype,
    *,
    packed: bool,
    lengths: bool,
    sink_tokens: int,
    terms: bool,
    out_fp8: bool,
    config: MosaicForwardConfig,
) -> str | None:
    """None if `mosaic_forward` computes this call, else the first reason it cannot.

    q_shape, k_shape: dense `[B, Tq, Hq, D]`, `[B, Tk, Hkv, D]` (or packed). `lengths`: q or
    kv lengths given; `terms`: a bias, mask, ALiBi or T5 table; causal, window, soft-cap,
    scale and GQA are always covered.
    """
    if packed:
        return "packed (cu_seqlens) batches"
    if lengths:
        return "q_lengths / kv_lengths"
    if sink_tokens:
        return "sink tokens"
    if terms:
        return "bias, mask, ALiBi or T5 terms"
    if out_fp8:
        return "an FP8 output"
    if jnp.dtype(dtype) not in DTYPES:
        return f"dtype {jnp.dtype(dtype).name} (bfloat16 and float16 only)"
    head_dim = q_shape[-1]
    if head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim} (one of {HEAD_DIMS})"
    q_rows, kv_rows = q_shape[1], k_shape[1]
    if q_rows % config.rows:
        return f"Tq={q_rows} not a multiple of {config.rows} (2 * block_q)"
    if kv_rows % config.block_kv:
        return f"Tk={kv_rows} not a multiple of block_kv={config.block_kv}"
    if not config.fits(head_dim, jnp.dtype(dtype).itemsize):
        return f"{config} needs {config.smem_bytes(head_dim)} bytes of shared memory"
    return None
