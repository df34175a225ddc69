"""Flax NNX modules over the functional ops: they own parameters, the ops do the work.

`Attention`: projections (fused QKV optional), GQA, RoPE, QK-norm; full-sequence mode
through `jaxattn.attention`, serving mode through `jaxattn.paged_attention`.
"""

from jaxattn.nn.attention import Attention

__all__ = ["Attention"]
