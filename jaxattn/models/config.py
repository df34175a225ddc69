"""`LlamaConfig`: the architecture of a Llama-style decoder, and its reading from a Hugging
Face transformers config (`LlamaConfig.from_hf`).

transformers 4.x keeps `rope_theta` and a `rope_scaling` dict ("type" or "rope_type") on
the config; 5.x one `rope_parameters` dict holding `rope_type` and `rope_theta`. Both are
read, from a config object or its config.json dict.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from jaxattn.rope import DynamicNTKScaling, LinearScaling, Llama3Scaling, RoPE, YarnScaling

__all__ = ["LlamaConfig", "rope_scaling_from_hf"]

Scaling = LinearScaling | Llama3Scaling | YarnScaling | DynamicNTKScaling


def rope_scaling_from_hf(params: Mapping[str, Any], max_position_embeddings: int) -> Scaling | None:
    """jaxattn's scaling for an HF `rope_scaling` / `rope_parameters` dict (None: plain RoPE).

    `max_position_embeddings` is the HF config's: the default of
    `original_max_position_embeddings` (llama3, yarn) and dynamic NTK's original context,
    as in `transformers.modeling_rope_utils`.
    """
    kind = params.get("rope_type", params.get("type", "default"))
    original = int(params.get("original_max_position_embeddings") or max_position_embeddings)
    if kind == "default":
        return None
    if kind == "linear":
        return LinearScaling(float(params["factor"]))
    if kind == "llama3":
        return Llama3Scaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=original,
        )
    if kind == "yarn":
        # DeepSeek-V3 style configs leave factor out: HF then uses the context ratio.
        factor = params.get("factor") or max_position_embeddings / original
        return YarnScaling(
            factor=float(factor),
            original_max_position_embeddings=original,
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            mscale=params.get("mscale"),
            mscale_all_dim=params.get("mscale_all_dim"),
            attention_factor=params.get("attention_factor"),
            truncate=bool(params.get("truncate", True)),
        )
    if kind == "dynamic":
        return DynamicNTKScaling(float(params["factor"]), int(max_position_embeddings))
    raise NotImplementedError(
        f"rope_type={kind!r}: jaxattn maps 'default', 'linear', 'llama3', 'yarn' and 'dynamic'"
    )


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """A Llama-style decoder: RMSNorm, GQA attention with RoPE ("neox" pairing), SwiGLU MLP.

    Attributes (HF names in brackets where they differ):
      vocab_size, hidden_size, intermediate_size: V, d_model, the MLP width.
      num_layers [num_hidden_layers], num_q_heads [num_attention_heads], num_kv_heads
        [num_key_value_heads], head_dim (default in HF: hidden_size / num_q_heads).
      rope_theta: RoPE base; rope_scaling: None or a jaxattn scaling (`rope_scaling_from_hf`).
      rms_norm_eps: epsilon of every RMSNorm.
      tie_word_embeddings: logits from the embedding matrix (no lm_head).
      attention_bias: biases on q/k/v/o; mlp_bias: on gate/up/down.
      sliding_window: None, or each token attends to the last this many tokens, itself
        included (Mistral's `sliding_window`; `jaxattn.attention`'s `window`).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: Scaling | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_q_heads", "num_kv_heads", "head_dim"):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"LlamaConfig: {name}={value!r} must be an int >= 1")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"LlamaConfig: num_q_heads={self.num_q_heads} must be a multiple of "
                f"num_kv_heads={self.num_kv_heads}"
            )
        window = self.sliding_window
        if window is not None and (not isinstance(window, int) or window < 1):
            raise ValueError(f"LlamaConfig: sliding_window={window!r} must be None or an int >= 1")
        self.rope.rotary_dim_for(self.head_dim)  # validates theta, scaling, head_dim

    @property
    def rope(self) -> RoPE:
        return RoPE(theta=self.rope_theta, style="neox", scaling=self.rope_scaling)

    @classmethod
    def from_hf(cls, hf_config) -> LlamaConfig:
        """From a transformers `LlamaConfig` (4.x or 5.x) or its config.json as a dict.

        A `sliding_window` (Mistral; Qwen2's only with `use_sliding_window`) becomes every
        layer's window. Raises ValueError for what this model does not compute (an
        activation other than SiLU, partial rotary, windows on some layers only) and
        NotImplementedError for an unknown `rope_type`. A
        top-level `original_max_position_embeddings` takes precedence over the scaling
        dict's for llama3 and yarn, as transformers reads it.
        """

        def get(name, default=None):
            if isinstance(hf_config, Mapping):
                return hf_config.get(name, default)
            return getattr(hf_config, name, default)

        if get("hidden_act", "silu") != "silu":
            raise ValueError(f"LlamaConfig.from_hf: hidden_act={get('hidden_act')!r}: need silu")
        rope = dict(get("rope_parameters") or get("rope_scaling") or {})
        kind = rope.get("rope_type", rope.get("type"))
        original = get("original_max_position_embeddings")
        if kind in ("llama3", "yarn") and original:  # the config's own wins, as in transformers
            rope["original_max_position_embeddings"] = original
        # Partial rotary: in the rope dict (transformers 5.x) or at the top (4.x, Phi style).
        partial = rope.get("partial_rotary_factor", get("partial_rotary_factor", 1.0))
        if partial is not None and partial != 1.0:
            raise ValueError(f"LlamaConfig.from_hf: partial_rotary_factor={partial} != 1")
        window = _sliding_window(get)
        num_q_heads = get("num_attention_heads")
        return cls(
            vocab_size=get("vocab_size"),
            hidden_size=get("hidden_size"),
            intermediate_size=get("intermediate_size"),
            num_layers=get("num_hidden_layers"),
            num_q_heads=num_q_heads,
            num_kv_heads=get("num_key_value_heads") or num_q_heads,
            head_dim=get("head_dim") or get("hidden_size") // num_q_heads,
            rope_theta=float(rope.get("rope_theta") or get("rope_theta", 10000.0)),
            rope_scaling=rope_scaling_from_hf(rope, get("max_position_embeddings", 2048)),
            rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            attention_bias=bool(get("attention_bias", False)),
            mlp_bias=bool(get("mlp_bias", False)),
            sliding_window=window,
        )


def _sliding_window(get) -> int | None:
    """An HF config's window of every layer (`get(name, default)` reads the config): its
    `sliding_window` where it applies (Qwen2: with `use_sliding_window`, on the layers
    `layer_types` says, or in 4.x from `max_window_layers` on). Raises ValueError where it
    applies to some layers only."""
    # transformers' defaults where a config dict leaves them out: Qwen2 / Qwen3 window no
    # layer unless `use_sliding_window`, and then only layers from the 28th on.
    qwen = str(get("model_type", "")).startswith("qwen")
    window = get("sliding_window") if get("use_sliding_window", not qwen) else None
    layer_types = set(get("layer_types") or ())
    first = get("max_window_layers", 28 if qwen else None)
    if window is not None and not layer_types and first is not None:
        layer_types = {
            "sliding_attention" if i >= first else "full_attention"
            for i in range(get("num_hidden_layers"))
        }
    if window is None or layer_types == {"full_attention"}:
        return None
    if layer_types - {"sliding_attention"}:
        raise ValueError(
            f"LlamaConfig.from_hf: sliding_window={window} on some layers only (layer types "
            f"{sorted(layer_types)}): this model windows every layer or none"
        )
    return window
