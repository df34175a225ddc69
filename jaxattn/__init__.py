"""jaxattn: attention for large language models in JAX, with Pallas GPU kernels.

Context phase: `attention` (padded batch) and `ragged_attention` (packed, cu_seqlens).
Generation phase: `paged_decode` over a `PagedKVCache` (`write_kv`, `gather_kv`).
OpenPPL's `MultiHeadCacheAttention`: `jaxattn.ppl.multi_head_cache_attention`.
Every op takes `implementation="pallas"` (the kernels; Pallas interpret mode off-GPU),
`"xla"` (the pure-jnp reference) or None (pallas on a GPU, xla elsewhere).
"""

from jaxattn import ppl
from jaxattn.attention import attention, ragged_attention
from jaxattn.cache import PagedKVCache, copy_pages, gather_kv, write_kv
from jaxattn.decode import contiguous_kv_cache, paged_decode, validate_page_table
from jaxattn.manager import KVCacheManager, pad_ids, reserve_from_lists
from jaxattn.metadata import AttentionMetadata
from jaxattn.paged import PagedAttentionConfig, paged_attention, paged_attention_qkv
from jaxattn.positional import RelativeBias, alibi_slopes, relative_position_bucket
from jaxattn.quant import KVQuant, calibrate_kv_scales, dequantize, quantize
from jaxattn.reference import (
    attention_reference,
    paged_attention_reference,
    paged_decode_reference,
    ragged_attention_reference,
)
from jaxattn.rope import (
    DynamicNTKScaling,
    LinearScaling,
    Llama3Scaling,
    RoPE,
    YarnScaling,
    apply_rope,
)
from pallas_kernels.flash_backward import FlashBackwardConfig
from pallas_kernels.flash_prefill import FlashPrefillConfig
from pallas_kernels.mosaic import MosaicBackwardConfig, MosaicForwardConfig
from pallas_kernels.paged_decode import PagedDecodeConfig

__all__ = [
    "AttentionMetadata",
    "PagedAttentionConfig",
    "paged_attention",
    "paged_attention_qkv",
    "paged_attention_reference",
    "DynamicNTKScaling",
    "KVQuant",
    "LinearScaling",
    "Llama3Scaling",
    "RoPE",
    "YarnScaling",
    "apply_rope",
    "calibrate_kv_scales",
    "dequantize",
    "quantize",
    "FlashBackwardConfig",
    "FlashPrefillConfig",
    "MosaicBackwardConfig",
    "MosaicForwardConfig",
    "KVCacheManager",
    "PagedDecodeConfig",
    "PagedKVCache",
    "RelativeBias",
    "alibi_slopes",
    "attention",
    "attention_reference",
    "contiguous_kv_cache",
    "copy_pages",
    "gather_kv",
    "pad_ids",
    "paged_decode",
    "paged_decode_reference",
    "ragged_attention",
    "ragged_attention_reference",
    "relative_position_bucket",
    "reserve_from_lists",
    "validate_page_table",
    "write_kv",
    "ppl",
]
