"""Decode attention (one query token per sequence) over a paged KV cache."""

from pallas_kernels.cache_read import CacheFormat
from pallas_kernels.paged_decode.config import PagedDecodeConfig
from pallas_kernels.paged_decode.kernel import DecodeParams, paged_decode

__all__ = ["CacheFormat", "DecodeParams", "PagedDecodeConfig", "paged_decode"]
