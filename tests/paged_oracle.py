"""Float64 numpy oracles of one in-flight-batching step (`jaxattn.paged_attention`).

Written from DESIGN.md and the issue-5 contract, sharing no code with `jaxattn`: the
attention itself is `oracle.attention_oracle` run per batch row on that sequence's whole
history, RoPE is `test_rope`'s transcription of Hugging Face transformers, and the bytes a
quantized cache must store come from `quant_oracle`.

A step packs the new tokens of S rows into T tokens: row s owns tokens
`cu[s]:cu[s+1]`, sits at positions `context_lens[s] - q_len[s] + i`, and attends causally
(bottom-right) to keys `0..position` of its own history. Padding tokens output zeros and
a log-sum-exp of -inf.
"""

from __future__ import annotations

import numpy as np
from oracle import attention_oracle
from quant_oracle import group_scales_np, quantize_np, to_storage_np
from test_rope import oracle_parameters, rope_oracle

__all__ = ["expected_storage", "rope_np", "step_oracle"]


def rope_np(x, positions, rope) -> np.ndarray:
    """x float64 `[T, H, D]` rotated at `positions` `[T]` by the `jaxattn.RoPE` config
    `rope` (its fields read as Hugging Face's rope parameters); None returns x."""
    x = np.asarray(x, np.float64)
    if rope is None or x.size == 0:
        return x
    head_dim = x.shape[-1]
    dim = head_dim if rope.rotary_dim is None else rope.rotary_dim
    inv_freq, factor = oracle_parameters(rope, dim)
    out, _ = rope_oracle(x, np.asarray(positions), inv_freq, factor, rope.style, dim)
    return out


def step_oracle(q, cu_seqlens_q, context_lens, histories, *, lowp=None, **options):
    """The outputs of one step.

    q: float64 `[T, Hq, D]` (already rotated when the step uses RoPE).
    cu_seqlens_q `[S+1]`, context_lens `[S]`: the step's plan.
    histories: per row, `(K, V)` float64 `[>= context_lens[s], Hkv, D]`, the sequence's
      keys and values as the cache stores them after the step (None for rows without
      tokens).
    options: `attention_oracle`'s (window, sink_tokens, alibi_slopes, relative_bias, ...).
    Returns out `[T, Hq, D]` and lse `[Hq, T]`.
    """
    q = np.asarray(q, np.float64)
    cu = [int(x) for x in np.asarray(cu_seqlens_q)]
    out = np.zeros(q.shape)
    lse = np.full((q.shape[1], q.shape[0]), -np.inf)
    for s, ctx in enumerate(int(x) for x in np.asarray(context_lens)):
        lo, hi = cu[s], cu[s + 1]
        if hi == lo:
            continue
        k, v = (np.asarray(x, np.float64)[:ctx] for x in histories[s])
        o, l = attention_oracle(
            q[None, lo:hi], k[None], v[None], causal=True, q_lengths=[hi - lo],
            kv_lengths=[ctx], lowp=lowp, **options,
        )  # fmt: skip
        out[lo:hi], lse[:, lo:hi] = o[0], l[0]
    return out, lse


def expected_storage(x, quant, tensor_scale=None):
    """What a quantized cache stores for tokens `x` `[T, Hkv, D]`: (stored values in the
    pool's dtype `[T, Hkv, Dp]`, bf16-valued float32 group scales `[T, Hkv, G]` or None)."""
    x = np.asarray(x, np.float32)
    if quant.granularity == "tensor":
        return to_storage_np(quantize_np(x, np.float32(tensor_scale), quant), quant), None
    scales = group_scales_np(x, quant)
    return to_storage_np(quantize_np(x, scales, quant), quant), scales
