"""A Llama-style decoder in Flax NNX over `jaxattn.nn.Attention`, and the loader of a
Hugging Face `LlamaForCausalLM` state dict.

Module and parameter names follow transformers' (`embed_tokens`, `layers[i].self_attn`,
`mlp.gate_proj`, `input_layernorm`, ...), so the loader is a rename plus a transpose
(torch Linear weights are `[out, in]`, `nnx.Linear` kernels `[in, out]`).

Axis legend: B sequences, T tokens, V vocabulary, d_model = hidden_size.

Every parameter names its axes for placement on a mesh (`jaxattn.nn.sharding`): embedding
("vocab", "embed"), lm_head ("embed", "vocab"), gate/up ("embed", "mlp"), down ("mlp",
"embed"), norms ("embed",), the attention's as `jaxattn.nn.Attention` says.
`jaxattn.parallel.shard_model` places a model by them (tensor parallelism).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

import jaxattn
from jaxattn.cache import PagedKVCache
from jaxattn.models.config import LlamaConfig
from jaxattn.nn import Attention
from jaxattn.nn.sharding import logical_axes
from jaxattn.quant import KVQuant

__all__ = ["DecoderLayer", "Llama", "MLP", "load_hf_state_dict"]


class MLP(nnx.Module):
    """SwiGLU: `down_proj(silu(gate_proj(x)) * up_proj(x))`, `[..., d_model] -> [..., d_model]`."""

    def __init__(self, config: LlamaConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        linear = dict(use_bias=config.mlp_bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        d_model, width = config.hidden_size, config.intermediate_size
        column = dict(
            kernel_metadata=logical_axes("embed", "mlp"), bias_metadata=logical_axes("mlp")
        )
        row = dict(
            kernel_metadata=logical_axes("mlp", "embed"), bias_metadata=logical_axes("embed")
        )
        self.gate_proj = nnx.Linear(d_model, width, **column, **linear)
        self.up_proj = nnx.Linear(d_model, width, **column, **linear)
        self.down_proj = nnx.Linear(width, d_model, **row, **linear)

    def __call__(self, x: Float[Array, "... d_model"]) -> Float[Array, "... d_model"]:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    """Pre-norm block: `x + attn(norm(x))`, then `x + mlp(norm(x))`."""

    def __init__(self, config: LlamaConfig, *, dtype, param_dtype, rngs: nnx.Rngs, **attn_kwargs):
        norm = dict(
            epsilon=config.rms_norm_eps,
            dtype=dtype,
            param_dtype=param_dtype,
            scale_metadata=logical_axes("embed"),
            rngs=rngs,
        )
        self.input_layernorm = nnx.RMSNorm(config.hidden_size, **norm)
        self.self_attn = Attention(
            config.hidden_size,
            config.num_q_heads,
            config.num_kv_heads,
            config.head_dim,
            rope=config.rope,
            qkv_bias=config.attention_bias,
            out_bias=config.attention_bias,
            window=config.sliding_window,
            dtype=dtype,
            param_dtype=param_dtype,
            rngs=rngs,
            **attn_kwargs,
        )
        self.post_attention_layernorm = nnx.RMSNorm(config.hidden_size, **norm)
        self.mlp = MLP(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x, *, cache: PagedKVCache | None = None, meta=None, **full_kwargs):
        """As `Attention`: full mode `x[B, T, d_model] -> y`; serving mode (cache, meta)
        `x[T, d_model] -> (y, cache)`."""
        h = self.input_layernorm(x)
        if cache is None:
            x = x + self.self_attn(h, **full_kwargs)
        else:
            attn, cache = self.self_attn(h, cache=cache, meta=meta)
            x = x + attn
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x if cache is None else (x, cache)


class Llama(nnx.Module):
    """Llama-style causal LM: embedding, `num_layers` DecoderLayers, final RMSNorm, lm_head
    (or the tied embedding).

    Args:
      config: the architecture.
      dtype: computation dtype (None: the params'); param_dtype: the parameters'.
      fused_qkv: one qkv_proj kernel per layer (see `jaxattn.nn.Attention`).
      attention_fn, paged_attention_fn: the ops of every layer (see `Attention`).
      rngs: `nnx.Rngs` for the initializers.
    """

    def __init__(
        self,
        config: LlamaConfig,
        *,
        dtype=None,
        param_dtype=jnp.float32,
        fused_qkv: bool = False,
        attention_fn: Callable = jaxattn.attention,
        paged_attention_fn: Callable = jaxattn.paged_attention,
        rngs: nnx.Rngs,
    ):
        self.config = config
        self.dtype = jnp.dtype(dtype or param_dtype)
        types = dict(dtype=dtype, param_dtype=param_dtype)
        self.embed_tokens = nnx.Embed(
            config.vocab_size,
            config.hidden_size,
            embedding_metadata=logical_axes("vocab", "embed"),
            **types,
            rngs=rngs,
        )
        layer = dict(
            fused_qkv=fused_qkv, attention_fn=attention_fn, paged_attention_fn=paged_attention_fn
        )
        self.layers = nnx.List(
            [DecoderLayer(config, **types, **layer, rngs=rngs) for _ in range(config.num_layers)]
        )
        self.norm = nnx.RMSNorm(
            config.hidden_size,
            epsilon=config.rms_norm_eps,
            scale_metadata=logical_axes("embed"),
            **types,
            rngs=rngs,
        )
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nnx.Linear(
                config.hidden_size,
                config.vocab_size,
                use_bias=False,
                kernel_metadata=logical_axes("embed", "vocab"),
                **types,
                rngs=rngs,
            )
        )

    def _logits(self, h):
        h = self.norm(h)
        return self.embed_tokens.attend(h) if self.lm_head is None else self.lm_head(h)

    def __call__(
        self,
        tokens: Int[Array, "B T"],
        *,
        q_lengths: Int[Array, " B"] | None = None,
        positions: Int[Array, "#B T"] | None = None,
    ) -> Float[Array, "B T V"]:
        """Full mode: logits of every position of a right-padded batch.

        tokens: int `[B, T]`; q_lengths: int `[B]` valid tokens per sequence (default T;
        the logits of padding positions are finite and meaningless); positions: int `[B, T]`
        or `[T]` RoPE positions (default `0..T-1`). Returns logits `[B, T, V]` in `dtype`.
        """
        h = self.embed_tokens(tokens)
        for layer in self.layers:
            h = layer(h, q_lengths=q_lengths, positions=positions)
        return self._logits(h)

    def step(
        self,
        tokens: Int[Array, " T"],
        caches: Sequence[PagedKVCache],
        meta,
        logits_indices: Int[Array, " R"] | None = None,
    ) -> tuple[Float[Array, "T V"], list[PagedKVCache]]:
        """Serving mode: one step of in-flight batching (prefill chunks and decode tokens).

        tokens: int `[T]` packed as `meta` (a `jaxattn.AttentionMetadata`) says; caches:
        one `PagedKVCache` per layer (`init_cache`). logits_indices: int `[R]`, the tokens
        whose logits are wanted (e.g. each row's last new token: a long prompt chunk then
        costs no vocabulary matmul); None: all. Returns logits `[T, V]` (or `[R, V]`;
        padding tokens: meaningless) and the caches with this step's k/v written.
        """
        if len(caches) != len(self.layers):
            raise ValueError(f"Llama.step: {len(caches)} caches for {len(self.layers)} layers")
        h = self.embed_tokens(tokens)
        new_caches = []
        for layer, cache in zip(self.layers, caches, strict=True):
            h, cache = layer(h, cache=cache, meta=meta)
            new_caches.append(cache)
        if logits_indices is not None:
            h = h[logits_indices]
        return self._logits(h), new_caches

    def init_cache(
        self, num_pages: int, page_size: int, dtype=None, quant: KVQuant | None = None
    ) -> list[PagedKVCache]:
        """One empty `PagedKVCache` per layer, `[num_pages, Hkv, page_size, D]` each, of
        `dtype` (default: the model's computation dtype) or quantized as `quant`."""
        config = self.config
        return [
            PagedKVCache.create(
                num_pages,
                page_size,
                config.num_kv_heads,
                config.head_dim,
                dtype=dtype or self.dtype,
                quant=quant,
            )
            for _ in range(config.num_layers)
        ]


def _numpy(x) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch.Tensor (numpy has no bfloat16: go through float32)
        x = x.detach().cpu()
        x = x.float() if str(x.dtype) == "torch.bfloat16" else x
        x = x.numpy()
    return np.asarray(x)


def load_hf_state_dict(
    model_or_config: Llama | LlamaConfig, state_dict: Mapping[str, Any], **model_kwargs
) -> Llama:
    """A `Llama` holding the weights of a transformers `LlamaForCausalLM` state dict.

    Args:
      model_or_config: a `Llama` (its parameters are replaced in place and it is
        returned), or a `LlamaConfig` (a model is built without running the initializers,
        with `model_kwargs`, e.g. `dtype`, `param_dtype`, `fused_qkv`).
      state_dict: name -> torch tensor or numpy array, HF names
        (`model.layers.0.self_attn.q_proj.weight`, ...); values are cast to the
        parameters' dtype. `lm_head.weight` of a tied model and rotary `inv_freq` buffers
        are ignored.

    Raises ValueError naming the tensor for a missing or unexpected name or a wrong shape.
    """
    if isinstance(model_or_config, LlamaConfig):
        config = model_or_config
        model = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0), **model_kwargs))
    else:
        model = model_or_config
    left = dict(state_dict)

    def take(name):
        if name not in left:
            raise ValueError(f"load_hf_state_dict: {name!r} missing from the state dict")
        return _numpy(left.pop(name))

    def assign(param, value, name):
        want = param.get_value().shape
        if value.shape != want:
            raise ValueError(f"load_hf_state_dict: {name}: shape {value.shape}, expected {want}")
        param.set_value(jnp.asarray(value, param.get_value().dtype))

    def load(param, name):
        assign(param, take(name), name)

    def linear(module, *names):  # HF [out, in] weights of `names`, stacked along out
        kernel = np.concatenate([take(f"{n}.weight").T for n in names], axis=1)
        assign(module.kernel, kernel, f"{names}.weight")
        if module.bias is not None:
            bias = np.concatenate([take(f"{n}.bias") for n in names])
            assign(module.bias, bias, f"{names}.bias")

    load(model.embed_tokens.embedding, "model.embed_tokens.weight")
    load(model.norm.scale, "model.norm.weight")
    if model.lm_head is None:
        left.pop("lm_head.weight", None)
    else:
        linear(model.lm_head, "lm_head")
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            load(getattr(layer, norm).scale, f"{p}{norm}.weight")
        attn, qkv = layer.self_attn, [f"{p}self_attn.{n}_proj" for n in "qkv"]
        if attn.fused_qkv:
            linear(attn.qkv_proj, *qkv)
        else:
            for module, name in zip((attn.q_proj, attn.k_proj, attn.v_proj), qkv, strict=True):
                linear(module, name)
        linear(attn.o_proj, f"{p}self_attn.o_proj")
        for name in ("gate_proj", "up_proj", "down_proj"):
            linear(getattr(layer.mlp, name), f"{p}mlp.{name}")
    unexpected = sorted(k for k in left if not k.endswith("rotary_emb.inv_freq"))
    if unexpected:
        raise ValueError(f"load_hf_state_dict: unexpected names {unexpected}")
    return model
