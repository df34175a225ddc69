"""Flash attention for the context (prefill) phase: dense and packed sequences."""

from pallas_kernels.flash_prefill.config import FlashPrefillConfig
from pallas_kernels.flash_prefill.kernel import flash_prefill

__all__ = ["FlashPrefillConfig", "flash_prefill"]
