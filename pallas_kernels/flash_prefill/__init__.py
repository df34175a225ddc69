"""Flash attention for the context (prefill) phase: dense and packed sequences."""

from pallas_kernels.batch import Batch, packed_batch
from pallas_kernels.flash_prefill.config import FlashPrefillConfig
from pallas_kernels.flash_prefill.kernel import CachedPrefix, LogitParams, flash_prefill

__all__ = [
    "Batch",
    "CachedPrefix",
    "FlashPrefillConfig",
    "LogitParams",
    "flash_prefill",
    "packed_batch",
]
