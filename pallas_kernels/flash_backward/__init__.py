"""Flash attention backward (context phase): dK/dV and dQ kernels on the forward's residuals."""

from pallas_kernels.flash_backward.backward import flash_backward
from pallas_kernels.flash_backward.config import FlashBackwardConfig

__all__ = ["FlashBackwardConfig", "flash_backward"]
