"""An independent float64 numpy oracle, written from DESIGN.md's semantics.

It shares no code with `jaxattn` (not even `jaxattn.reference`): the tests compare both the
reference and the kernels against it. Positions are bottom-right aligned: query i of
sequence b sits at `kv_len[b] - q_len[b] + i`, key j at j. Logits are
`scale * q.k + bias - slope[h] * |p - j| + table[h, bucket(j - p)]`, then the soft-cap, then
masking (lengths, causal, window with sinks, boolean mask) and a float64 softmax. Rows that
see no key (or only keys with a -inf logit) output zeros and a log-sum-exp of -inf.

`lowp` (a numpy dtype such as `ml_dtypes.bfloat16` or `np.float16`) turns the oracle into the
"plain low-precision reference" of FlashAttention's tests (its `attention_ref` with
`upcast=False`): the scaled q.k logits and the normalised probabilities are rounded to
`lowp` before use, and so is the output.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = [
    "attention_oracle",
    "bloom_alibi_slopes",
    "ragged_attention_oracle",
    "t5_relative_position_bucket",
]


def t5_relative_position_bucket(
    relative_position, bidirectional: bool = True, num_buckets: int = 32, max_distance: int = 128
) -> np.ndarray:
    """numpy transcription of HF transformers' `T5Attention._relative_position_bucket`.

    Like the torch original, the logarithm is taken in float32 and truncated to an integer.
    `relative_position` is `memory_position - query_position` (key minus query).
    """
    relative_position = np.asarray(relative_position, np.int64)
    relative_buckets = np.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        relative_buckets += (relative_position > 0).astype(np.int64) * num_buckets
        relative_position = np.abs(relative_position)
    else:
        relative_position = -np.minimum(relative_position, np.zeros_like(relative_position))
    # now relative_position is in the range [0, inf)
    max_exact = num_buckets // 2
    is_small = relative_position < max_exact
    with np.errstate(divide="ignore"):
        log = np.log(relative_position.astype(np.float32) / np.float32(max_exact))
    scaled = (
        log / np.float32(math.log(max_distance / max_exact)) * np.float32(num_buckets - max_exact)
    )
    scaled = np.where(is_small, 0.0, scaled).astype(np.float32)  # -inf where is_small
    relative_position_if_large = max_exact + scaled.astype(np.int64)
    relative_position_if_large = np.minimum(relative_position_if_large, num_buckets - 1)
    relative_buckets += np.where(is_small, relative_position, relative_position_if_large)
    return relative_buckets


def bloom_alibi_slopes(num_heads: int) -> np.ndarray:
    """The slope code of HF transformers' BLOOM `build_alibi_tensor`, in numpy float64."""
    closest_power_of_2 = 2 ** math.floor(math.log2(num_heads))
    base = 2 ** (-(2 ** -(math.log2(closest_power_of_2) - 3)))
    powers = np.arange(1, 1 + closest_power_of_2)
    slopes = np.power(base, powers, dtype=np.float64)
    if closest_power_of_2 != num_heads:
        extra_base = 2 ** (-(2 ** -(math.log2(2 * closest_power_of_2) - 3)))
        num_remaining_heads = min(closest_power_of_2, num_heads - closest_power_of_2)
        extra_powers = np.arange(1, 1 + 2 * num_remaining_heads, 2)
        slopes = np.concatenate([slopes, np.power(extra_base, extra_powers, dtype=np.float64)])
    return slopes


def _round(x: np.ndarray, lowp) -> np.ndarray:
    return x if lowp is None else x.astype(lowp).astype(np.float64)


def attention_oracle(
    q,
    k,
    v,
    *,
    causal: bool = False,
    q_lengths=None,
    kv_lengths=None,
    window: int | None = None,
    sink_tokens: int = 0,
    alibi_slopes=None,
    bias=None,
    mask=None,
    relative_bias=None,
    soft_cap: float | None = None,
    scale: float | None = None,
    lowp=None,
):
    """Dense attention. q `[B, Tq, Hq, D]`, k/v `[B, Tk, Hkv, D]`.

    relative_bias: None or `(table [Hq, num_buckets], max_distance, bidirectional)`.
    bias (float) and mask (bool) broadcast to `[B, Hq, Tq, Tk]`.
    Returns float64 out `[B, Tq, Hq, D]` and lse `[B, Hq, Tq]`.
    """
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    batch, tq, num_q_heads, head_dim = q.shape
    tk, num_kv_heads = k.shape[1], k.shape[2]
    group = num_q_heads // num_kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    q_lengths = [tq] * batch if q_lengths is None else [int(x) for x in np.asarray(q_lengths)]
    kv_lengths = [tk] * batch if kv_lengths is None else [int(x) for x in np.asarray(kv_lengths)]
    full = (batch, num_q_heads, tq, tk)
    if bias is not None:
        bias = np.broadcast_to(np.asarray(bias, np.float64), full)
    if mask is not None:
        mask = np.broadcast_to(np.asarray(mask, bool), full)
    if alibi_slopes is not None:
        alibi_slopes = np.asarray(alibi_slopes, np.float64)

    out = np.zeros((batch, tq, num_q_heads, head_dim))
    lse = np.full((batch, num_q_heads, tq), -np.inf)
    i = np.arange(tq)[:, None]
    j = np.arange(tk)[None, :]
    for b in range(batch):
        q_len, kv_len = q_lengths[b], kv_lengths[b]
        pos = kv_len - q_len + i  # [Tq, 1] absolute query positions
        visible = (i < q_len) & (j < kv_len)
        if causal:
            visible = visible & (j <= pos)
        if window is not None:
            visible = visible & ((j > pos - window) | (j < sink_tokens))
        for h in range(num_q_heads):
            kvh = h // group
            s = _round(scale * (q[b, :, h] @ k[b, :, kvh].T), lowp)  # [Tq, Tk]
            if bias is not None:
                s = s + bias[b, h]
            if alibi_slopes is not None:
                s = s - alibi_slopes[h] * np.abs(pos - j)
            if relative_bias is not None:
                table, max_distance, bidirectional = relative_bias
                table = np.asarray(table, np.float64)
                buckets = t5_relative_position_bucket(
                    j - pos, bidirectional, table.shape[1], max_distance
                )
                s = s + table[h][buckets]
            if soft_cap is not None:
                s = soft_cap * np.tanh(s / soft_cap)
            vis = visible if mask is None else visible & mask[b, h]
            if bias is not None:  # a bias <= -1e37 (-inf too) hides its key (README)
                vis = vis & (np.broadcast_to(bias[b, h], s.shape) > -1e37)
            s = np.where(vis, s, -np.inf)
            m = np.max(s, axis=-1, initial=-np.inf, keepdims=True)  # [Tq, 1]
            seen = np.isfinite(m)
            with np.errstate(invalid="ignore"):
                p = np.where(vis & seen, np.exp(s - np.where(seen, m, 0.0)), 0.0)
            l = p.sum(-1, keepdims=True)
            p = _round(p / np.where(seen, l, 1.0), lowp)
            out[b, :, h] = _round(p @ v[b, :, kvh], lowp)
            lse[b, h] = np.where(seen, m + np.log(np.where(seen, l, 1.0)), -np.inf)[:, 0]
    return out, lse


def ragged_attention_oracle(q, k, v, cu_seqlens_q, cu_seqlens_k, *, bias=None, mask=None, **opts):
    """Packed attention: runs each sequence alone through `attention_oracle`.

    q `[Tq_total, Hq, D]`, k/v `[Tk_total, Hkv, D]`; bias/mask broadcast to
    `[Hq, Tq_total, Tk_total]` in packed coordinates. Rows past `cu_seqlens_q[-1]` are
    padding: zeros and lse -inf. Returns out `[Tq_total, Hq, D]` and lse `[Hq, Tq_total]`.
    """
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    cu_q = [int(x) for x in np.asarray(cu_seqlens_q)]
    cu_k = [int(x) for x in np.asarray(cu_seqlens_k)]
    full = (q.shape[1], q.shape[0], k.shape[0])
    if bias is not None:
        bias = np.broadcast_to(np.asarray(bias, np.float64), full)
    if mask is not None:
        mask = np.broadcast_to(np.asarray(mask, bool), full)
    out = np.zeros(q.shape)
    lse = np.full((q.shape[1], q.shape[0]), -np.inf)
    for b in range(len(cu_q) - 1):
        rows, cols = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        o, l = attention_oracle(
            q[None, rows], k[None, cols], v[None, cols],
            bias=None if bias is None else bias[None, :, rows, cols],
            mask=None if mask is None else mask[None, :, rows, cols],
            **opts,
        )  # fmt: skip
        out[rows], lse[:, rows] = o[0], l[0]
    return out, lse
