"""Hopper (sm90) kernels in Pallas Mosaic GPU: TMA, wgmma, warp specialization.

They run on compute capability 9.x only (not in CPU interpret mode); `support` says which
calls they cover, and the dispatcher falls back to the Triton kernels for the rest.
"""

from pallas_kernels.mosaic.backward import mosaic_backward, mosaic_backward_packed
from pallas_kernels.mosaic.config import (
    MosaicBackwardConfig,
    MosaicForwardConfig,
    full_attention,
)
from pallas_kernels.mosaic.forward import mosaic_forward, mosaic_forward_packed
from pallas_kernels.mosaic.support import (
    backward_unsupported,
    device_unsupported,
    forward_unsupported,
    select_backward,
    select_forward,
)

__all__ = [
    "MosaicBackwardConfig",
    "MosaicForwardConfig",
    "backward_unsupported",
    "device_unsupported",
    "forward_unsupported",
    "full_attention",
    "mosaic_backward",
    "mosaic_backward_packed",
    "mosaic_forward",
    "mosaic_forward_packed",
    "select_backward",
    "select_forward",
]
