"""jaxattn: attention for large language models in JAX, with Pallas GPU kernels.

Context phase: `attention` (padded batch) and `ragged_attention` (packed, cu_seqlens).
Every op takes `implementation="pallas"` (the kernels; Pallas interpret mode off-GPU),
`"xla"` (the pure-jnp reference) or None (pallas on a GPU, xla elsewhere).
"""

from jaxattn.attention import attention, ragged_attention
from jaxattn.positional import RelativeBias, alibi_slopes, relative_position_bucket
from jaxattn.reference import attention_reference, ragged_attention_reference
from pallas_kernels.flash_prefill import FlashPrefillConfig

__all__ = [
    "FlashPrefillConfig",
    "RelativeBias",
    "alibi_slopes",
    "attention",
    "attention_reference",
    "ragged_attention",
    "ragged_attention_reference",
    "relative_position_bucket",
]
