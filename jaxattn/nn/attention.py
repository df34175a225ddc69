"""`Attention`: the Flax NNX attention layer. It owns the projections (and the QK-norm
scales); `jaxattn.attention` (full sequences) and `jaxattn.paged_attention` (serving, over a
paged cache) do the attention itself.

Axis legend (DESIGN.md): B sequences, T tokens, Hq / Hkv query / kv heads, D head dim,
d_model the model width.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

import jaxattn
from jaxattn.cache import PagedKVCache
from jaxattn.nn.sharding import logical_axes
from jaxattn.rope import RoPE, apply_rope
from jaxattn.streaming import check_rope_on_read
from jaxattn.validation import check_options

__all__ = ["Attention"]


class Attention(nnx.Module):
    """Multi-head self-attention with GQA, RoPE, optional QK-norm and biases.

    Parameters (HF names, kernels `[in, out]` as in `nnx.Linear`):
      q_proj `[d_model, Hq*D]`, k_proj / v_proj `[d_model, Hkv*D]`, or with `fused_qkv`
      one qkv_proj `[d_model, (Hq + 2*Hkv)*D]` (columns: q heads, then k heads, then v
      heads, each head's D channels contiguous); o_proj `[Hq*D, d_model]`; with `qk_norm`,
      q_norm / k_norm scales `[D]`. Each carries the logical names of its axes ("embed",
      "q_heads", "kv_heads", "qkv", "norm": `jaxattn.nn.sharding`), which place it on a
      mesh (`jaxattn.parallel.shard_model`).

    Two call modes, picked by whether a cache is passed:

    - full sequence: `y = attn(x[B, T, d_model], positions=..., q_lengths=..., mask=...)`.
      The module rotates q and k with `apply_rope` at `positions`, then calls
      `attention_fn(q, k, v, causal=..., ...)` (default `jaxattn.attention`); differentiable.
    - serving: `y, cache = attn(x[T, d_model], cache=cache, meta=meta)` with a
      `PagedKVCache` and the step's `AttentionMetadata`; `paged_attention_fn` (default
      `jaxattn.paged_attention`) applies RoPE at `meta.positions`, writes k/v into the cache
      and attends.

    Args:
      d_model: width of x and y.
      num_q_heads, num_kv_heads: Hq and Hkv, `Hq % Hkv == 0` (MHA, GQA, MQA).
      head_dim: D (need not be d_model / Hq).
      rope: a `jaxattn.RoPE`, or None for no rotary embedding.
      rope_on_read: serving mode: StreamingLLM's positions within the cache (the cache
        holds un-rotated keys; `jaxattn.paged_attention`). Full mode has no cache: with a
        window it raises (the positions would differ from serving); without one it is
        plain RoPE.
      fused_qkv: one qkv_proj kernel instead of three. Serving mode (without QK-norm)
        then passes the projection whole, as `paged_attention`'s fused form (q
        `[T, Hq + 2*Hkv, D]`, k = v = None): a decode step's kernel reads it in place.
      qk_norm: RMSNorm of each head's q and k over D before RoPE (Qwen3).
      norm_eps: epsilon of the QK-norm.
      qkv_bias, out_bias: biases on the q/k/v (or fused) and output projections.
      causal: full mode's causal mask; serving mode is causal only (raises without it).
      window, sink_tokens, soft_cap, scale: as `jaxattn.attention`, passed in both modes.
      attention_fn: full-mode op with `jaxattn.attention`'s signature (e.g.
        `functools.partial(jaxattn.attention, implementation="xla")`).
      paged_attention_fn: serving op with `jaxattn.paged_attention`'s signature (e.g. with
        `implementation=` or `config=` bound), its fused form included.
      dtype: computation dtype (None: that of x and the params, promoted); param_dtype: the
        parameters'.
      rngs: `nnx.Rngs` for the initializers.
    """

    def __init__(
        self,
        d_model: int,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        rope: RoPE | None = None,
        rope_on_read: bool = False,
        fused_qkv: bool = False,
        qk_norm: bool = False,
        norm_eps: float = 1e-6,
        qkv_bias: bool = False,
        out_bias: bool = False,
        causal: bool = True,
        window: int | None = None,
        sink_tokens: int = 0,
        soft_cap: float | None = None,
        scale: float | None = None,
        attention_fn: Callable = jaxattn.attention,
        paged_attention_fn: Callable = jaxattn.paged_attention,
        dtype=None,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        sizes = dict(d_model=d_model, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                     head_dim=head_dim)  # fmt: skip
        for name, value in sizes.items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Attention: {name}={value!r} must be an int >= 1")
        if num_q_heads % num_kv_heads:
            raise ValueError(f"Attention: {num_q_heads=} must be a multiple of {num_kv_heads=}")
        if rope is not None and not isinstance(rope, RoPE):
            raise ValueError(f"Attention: rope={rope!r}: expected a jaxattn.RoPE or None")
        if rope is not None:
            rope.rotary_dim_for(head_dim)  # an odd head dim or too large a rotary_dim
        self.num_q_heads, self.num_kv_heads, self.head_dim = num_q_heads, num_kv_heads, head_dim
        try:  # not only when serving: a full-mode layer is served later
            check_rope_on_read(rope, rope_on_read)
        except ValueError as e:
            raise ValueError(f"Attention: {e}") from None
        self.rope, self.fused_qkv, self.causal = rope, fused_qkv, causal
        self.rope_on_read = bool(rope_on_read)
        try:  # here, not at the first call
            check_options(num_q_heads=num_q_heads, window=window, sink_tokens=sink_tokens,
                          alibi_slopes=None, relative_bias=None, soft_cap=soft_cap,
                          scale=scale)  # fmt: skip
        except (TypeError, ValueError) as e:
            raise type(e)(f"Attention: {e}") from None
        self.d_model = d_model
        self.options = dict(window=window, sink_tokens=sink_tokens, soft_cap=soft_cap, scale=scale)
        self.attention_fn, self.paged_attention_fn = attention_fn, paged_attention_fn
        linear = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        q_dim, kv_dim = num_q_heads * head_dim, num_kv_heads * head_dim

        def project(d_in, d_out, axes, bias):  # axes: logical names of the kernel's axes
            meta = dict(kernel_metadata=logical_axes(*axes), bias_metadata=logical_axes(axes[1]))
            return nnx.Linear(d_in, d_out, use_bias=bias, **meta, **linear)

        if fused_qkv:
            self.qkv_proj = project(d_model, q_dim + 2 * kv_dim, ("embed", "qkv"), qkv_bias)
        else:
            self.q_proj = project(d_model, q_dim, ("embed", "q_heads"), qkv_bias)
            self.k_proj = project(d_model, kv_dim, ("embed", "kv_heads"), qkv_bias)
            self.v_proj = project(d_model, kv_dim, ("embed", "kv_heads"), qkv_bias)
        self.o_proj = project(q_dim, d_model, ("q_heads", "embed"), out_bias)
        norm = dict(
            epsilon=norm_eps,
            dtype=dtype,
            param_dtype=param_dtype,
            scale_metadata=logical_axes("norm"),
            rngs=rngs,
        )
        self.q_norm = nnx.RMSNorm(head_dim, **norm) if qk_norm else None
        self.k_norm = nnx.RMSNorm(head_dim, **norm) if qk_norm else None

    def project_qkv(self, x: Float[Array, "*B T d_model"]):
        """q `[*B, T, Hq, D]`, k and v `[*B, T, Hkv, D]` (QK-norm applied, no RoPE)."""
        q_dim, kv_dim = self.num_q_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if self.fused_qkv:
            q, k, v = jnp.split(self.qkv_proj(x), [q_dim, q_dim + kv_dim], axis=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        lead = x.shape[:-1]
        q = q.reshape(*lead, self.num_q_heads, self.head_dim)
        k = k.reshape(*lead, self.num_kv_heads, self.head_dim)
        v = v.reshape(*lead, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def __call__(
        self,
        x: Float[Array, "B T d_model"] | Float[Array, "T d_model"],
        *,
        positions: Int[Array, "#B T"] | None = None,
        q_lengths: Int[Array, " B"] | None = None,
        mask: Bool[Array, "#B #Hq T T"] | None = None,
        cache: PagedKVCache | None = None,
        meta=None,
    ):
        """Full mode (no cache): x float `[B, T, d_model]` -> y `[B, T, d_model]`.

          positions: int `[B, T]` or `[T]`, the RoPE positions (default `0..T-1`);
            DynamicNTKScaling takes each row's length as its last real token's position
            + 1 (tokens before `q_lengths`), so that no row's rotation depends on the
            padding or on the other rows. Only with `rope`.
          q_lengths: int `[B]`, valid tokens of each (right-padded) sequence, also its key
            length; rows at or past it are padding (their attention output is zero).
          mask: bool, broadcastable to `[B, Hq, T, T]`, anded into the causal mask.

        Serving mode (`cache` and `meta` given): x float `[T, d_model]`, the step's packed
        tokens (padding past `meta.cu_seqlens_q[-1]`) -> (y `[T, d_model]`, the cache with
        this step's k/v written). `cache`: this layer's `PagedKVCache`; `meta`: the step's
        `jaxattn.AttentionMetadata` (positions, slots, block tables), shared by all layers.
        """
        if (cache is None) != (meta is None):
            raise ValueError("Attention: serving mode needs both cache and meta")
        if x.shape[-1:] != (self.d_model,):
            raise ValueError(f"Attention: {x.shape=}: the last axis must be d_model={self.d_model}")
        if cache is not None:
            if x.ndim != 2 or any(a is not None for a in (positions, q_lengths, mask)):
                raise ValueError(
                    f"Attention (serving): {x.shape=}: expected [T, d_model]; positions, "
                    "q_lengths and mask come from meta"
                )
            return self._serve(x, cache, meta)
        if x.ndim != 3:
            raise ValueError(f"Attention: {x.shape=}: expected [B, T, d_model]")
        if self.rope_on_read and self.options["window"] is not None:
            raise ValueError(
                "Attention: rope_on_read=True with a window has positions within a cache; "
                "full-sequence mode has none (use serving mode)"
            )
        if positions is not None and self.rope is None:
            raise ValueError("Attention: positions given to a layer without rope")
        q, k, v = self.project_qkv(x)
        if self.rope is not None:
            if positions is None:
                positions = jnp.arange(x.shape[1], dtype=jnp.int32)
            positions = jnp.asarray(positions)
            seq_len = _row_lengths(positions, q_lengths, x.shape[:2])
            rotate = functools.partial(apply_rope, rope=self.rope, seq_len=seq_len)
            q, k = rotate(q, positions), rotate(k, positions)
        out = self.attention_fn(
            q,
            k,
            v,
            causal=self.causal,
            q_lengths=q_lengths,
            kv_lengths=q_lengths,
            mask=mask,
            **self.options,
        )  # [B, T, Hq, D]
        return self.o_proj(out.reshape(*x.shape[:2], -1))

    def _serve(self, x, cache, meta):
        on_read = dict(rope_on_read=True) if self.rope_on_read else {}
        if not self.causal:
            raise ValueError("Attention: serving mode is causal; this layer has causal=False")
        if (
            cache.num_kv_heads % self.num_kv_heads
            or self.num_q_heads % cache.num_kv_heads
            or cache.head_dim != self.head_dim
        ):
            raise ValueError(
                f"Attention: a cache of {cache.num_kv_heads} kv heads of dim {cache.head_dim} "
                f"for a layer of num_q_heads={self.num_q_heads}, "
                f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}: the cache needs "
                "the layer's head dim and a multiple of its kv heads that divides its q heads"
            )
        copies = cache.num_kv_heads // self.num_kv_heads
        if self.fused_qkv and self.q_norm is None and copies == 1:  # the op reads the
            # projection in place (a duplicated cache needs k and v repeated first)
            heads = self.num_q_heads + 2 * self.num_kv_heads
            q, k, v = self.qkv_proj(x).reshape(x.shape[0], heads, self.head_dim), None, None
        else:
            q, k, v = self.project_qkv(x)
            if copies > 1:  # a cache with each kv head duplicated (`shard_serving`)
                k, v = jnp.repeat(k, copies, axis=1), jnp.repeat(v, copies, axis=1)
        out, cache = self.paged_attention_fn(
            q, k, v, cache, meta, rope=self.rope, **on_read, **self.options
        )  # [T, Hq, D]
        return self.o_proj(out.reshape(x.shape[0], -1)), cache


def _row_lengths(positions, q_lengths, shape):
    """DynamicNTKScaling's `seq_len` of a full-mode call, int `[B, 1]`: each row's last
    real token's position + 1 (its tokens before `q_lengths`, all without), or None
    (`[T]` positions shared by every row, no lengths: the call's `max + 1`, the same)."""
    if q_lengths is None and positions.ndim < 2:
        return None
    positions = jnp.broadcast_to(positions, shape)
    if q_lengths is not None:
        real = jnp.arange(shape[1])[None, :] < jnp.asarray(q_lengths)[:, None]
        positions = jnp.where(real, positions, -1)
    return positions.max(axis=1, keepdims=True) + 1
