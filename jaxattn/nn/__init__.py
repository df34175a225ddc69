"""Flax NNX modules over the functional ops: they own parameters, the ops do the work.

`Attention`: projections (fused QKV optional), GQA, RoPE, QK-norm; full-sequence mode
through `jaxattn.attention`, serving mode through `jaxattn.paged_attention`.

`sharding`: the logical axis names on every parameter ("embed", "q_heads", "kv_heads",
"mlp", "vocab", ...) and their tensor-parallel rules (`tensor_parallel_rules`).
"""

from jaxattn.nn.attention import Attention
from jaxattn.nn.sharding import LOGICAL_AXES, logical_axes, tensor_parallel_rules

__all__ = ["LOGICAL_AXES", "Attention", "logical_axes", "tensor_parallel_rules"]
