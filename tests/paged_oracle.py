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

__all__ = ["expected_storage", "rope_np", "step_oracle", "streaming_step_oracle"]


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


def _rows(cu_seqlens_q, context_lens, histories):
    """Per row with tokens: (first token, end token, context length, K, V float64 of the
    row's first `context_lens[s]` positions)."""
    cu = [int(x) for x in np.asarray(cu_seqlens_q)]
    for s, ctx in enumerate(int(x) for x in np.asarray(context_lens)):
        if cu[s + 1] > cu[s]:
            k, v = (np.asarray(x, np.float64)[:ctx] for x in histories[s])
            yield cu[s], cu[s + 1], ctx, k, v


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
    out = np.zeros(q.shape)
    lse = np.full((q.shape[1], q.shape[0]), -np.inf)
    for lo, hi, ctx, k, v in _rows(cu_seqlens_q, context_lens, histories):
        o, l = attention_oracle(
            q[None, lo:hi], k[None], v[None], causal=True, q_lengths=[hi - lo],
            kv_lengths=[ctx], lowp=lowp, **options,
        )  # fmt: skip
        out[lo:hi], lse[:, lo:hi] = o[0], l[0]
    return out, lse


def streaming_step_oracle(q, cu_seqlens_q, context_lens, histories, rope, *, window=None,
                          sink_tokens=0, lowp=None, **options):  # fmt: skip
    """`step_oracle` with `rope_on_read=True` (StreamingLLM, arXiv:2309.17453 section 3.2):
    RoPE at positions within the cache.

    q: float64 `[T, Hq, D]` un-rotated; histories: per row, `(K, V)` as the cache stores
    them (K un-rotated). A query at position p has `o = max(0, p - window + 1 -
    sink_tokens)` (0 without a window) evicted tokens before its window: it is rotated at
    `p - o`, and its keys j at `j` (j < sink_tokens) or `j - o`. Each query gets its own
    rotated copy of the keys (one oracle batch row per query); masking, ALiBi and the rest
    are `attention_oracle`'s, at absolute positions. `lowp` also rounds the rotated q and k.
    """
    q = np.asarray(q, np.float64)
    out = np.zeros(q.shape)
    lse = np.full((q.shape[1], q.shape[0]), -np.inf)
    for lo, hi, ctx, k, v in _rows(cu_seqlens_q, context_lens, histories):
        pos = np.arange(ctx - (hi - lo), ctx)  # the queries' absolute positions
        evicted = np.zeros_like(pos)
        if window is not None:
            evicted = np.maximum(pos - window + 1 - sink_tokens, 0)
        j = np.arange(ctx)
        k_at = np.where(j[None, :] < sink_tokens, j[None, :], j[None, :] - evicted[:, None])
        q_rot = rope_np(q[lo:hi], pos - evicted, rope)  # [n, Hq, D]
        k_rot = np.stack([rope_np(k, k_at[i], rope) for i in range(hi - lo)])  # [n, ctx, ..]
        if lowp is not None:  # a plain low-precision run rotates in that precision too
            q_rot, k_rot = (x.astype(lowp).astype(np.float64) for x in (q_rot, k_rot))
        o, l = attention_oracle(
            q_rot[:, None], k_rot, np.broadcast_to(v, k_rot.shape[:1] + v.shape), causal=True,
            q_lengths=[1] * (hi - lo), kv_lengths=pos + 1, window=window,
            sink_tokens=sink_tokens, lowp=lowp, **options,
        )  # fmt: skip
        out[lo:hi], lse[:, lo:hi] = o[:, 0], l[:, :, 0].T
    return out, lse


def expected_storage(x, quant, tensor_scale=None):
    """What a quantized cache stores for tokens `x` `[T, Hkv, D]`: (stored values in the
    pool's dtype `[T, Hkv, Dp]`, bf16-valued float32 group scales `[T, Hkv, G]` or None)."""
    x = np.asarray(x, np.float32)
    if quant.granularity == "tensor":
        return to_storage_np(quantize_np(x, np.float32(tensor_scale), quant), quant), None
    scales = group_scales_np(x, quant)
    return to_storage_np(quantize_np(x, scales, quant), quant), scales
