"""OpenPPL's `MultiHeadCacheAttention` with its own names, layouts and cache modes, over
jaxattn's kernels (`multi_head_cache_attention`; the cache: `jaxattn.ppl.cache`)."""

from jaxattn.ppl.cache import LAYOUTS, PPLCache
from jaxattn.ppl.op import check_inputs, multi_head_cache_attention

__all__ = ["LAYOUTS", "PPLCache", "check_inputs", "multi_head_cache_attention"]
