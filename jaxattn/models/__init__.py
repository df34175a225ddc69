"""Small reference models over `jaxattn.nn`: a Llama-style decoder with full-sequence
(`Llama.__call__`) and serving (`Llama.step` over paged caches) modes, and a loader of
Hugging Face `LlamaForCausalLM` weights.
"""

from jaxattn.models.config import LlamaConfig, rope_scaling_from_hf
from jaxattn.models.llama import MLP, DecoderLayer, Llama, load_hf_state_dict

__all__ = [
    "MLP",
    "DecoderLayer",
    "Llama",
    "LlamaConfig",
    "load_hf_state_dict",
    "rope_scaling_from_hf",
]
