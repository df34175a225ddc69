"""Hopper (sm90) kernels in Pallas Mosaic GPU: TMA, wgmma, warp specialization.

They run on compute capability 9.x only (not in CPU interpret mode); `support` says which
calls they cover, and the dispatcher falls back to the Triton kernels for the rest.
"""

from pallas_kernels.mosaic.config import MosaicForwardConfig
from pallas_kernels.mosaic.forward import mosaic_forward
from pallas_kernels.mosaic.support import device_unsupported, forward_unsupported, select_forward

__all__ = [
    "MosaicForwardConfig",
    "device_unsupported",
    "forward_unsupported",
    "mosaic_forward",
    "select_forward",
]
