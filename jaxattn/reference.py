"""The spec in code: pure-jnp attention implementing every semantic of the library.

This is the `"xla"` backend and the oracle the kernels are tested against. It favours
obviousness over speed: it materialises the full `[B, Hq, Tq, Tk]` logits in float32.

Semantics (DESIGN.md): query token i of sequence b sits at position
`kv_len[b] - q_len[b] + i` (bottom-right alignment), key j at position j. Logits are
`scale * q.k + bias + alibi + relative_bias`, then the optional soft-cap, then masking and a
float32 softmax. A key is visible if `j < kv_len`, and (causal) `j <= p`, and (window W)
`j > p - W` or (sinks S) `j < S`, and the custom mask allows it. Rows with no visible key,
and padding rows, output zeros and a log-sum-exp of -inf.

Inputs are assumed valid: `jaxattn.attention` and `jaxattn.ragged_attention` check them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxattn.positional import RelativeBias, relative_position_bucket

_HIGHEST = jax.lax.Precision.HIGHEST


def _visible(q_pos, k_pos, *, causal, window, sink_tokens):
    """Position rule of DESIGN.md. q_pos `[..., Tq, 1]`, k_pos `[..., 1, Tk]` -> bool."""
    visible = jnp.ones(jnp.broadcast_shapes(q_pos.shape, k_pos.shape), bool)
    if causal:
        visible &= k_pos <= q_pos
    if window is not None:
        in_window = k_pos > q_pos - window
        if sink_tokens:
            in_window |= k_pos < sink_tokens
        visible &= in_window
    return visible


def _attend(q, k, v, q_pos, k_pos, visible, *, scale, soft_cap, alibi_slopes, bias, relative_bias):
    """Masked softmax attention with explicit positions.

    q `[B, Tq, Hq, D]`; k, v `[B, Tk, Hkv, D]`; q_pos `[B, Tq]` and k_pos `[B, Tk]` int32;
    visible bool broadcastable to `[B, Hq, Tq, Tk]`; bias likewise (float).
    Returns out `[B, Tq, Hq, D]` in q's dtype and lse `[B, Hq, Tq]` float32.
    """
    batch, tq, num_q_heads, head_dim = q.shape
    tk, num_kv_heads = k.shape[1], k.shape[2]
    group = num_q_heads // num_kv_heads
    qg = q.astype(jnp.float32).reshape(batch, tq, num_kv_heads, group, head_dim)
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k.astype(jnp.float32), precision=_HIGHEST)
    s = s.reshape(batch, num_q_heads, tq, tk) * scale

    rel = k_pos[:, None, None, :] - q_pos[:, None, :, None]  # [B, 1, Tq, Tk]
    if bias is not None:
        s = s + bias.astype(jnp.float32)
    if alibi_slopes is not None:
        slopes = alibi_slopes.astype(jnp.float32)[None, :, None, None]
        s = s - slopes * jnp.abs(rel).astype(jnp.float32)
    if relative_bias is not None:
        buckets = relative_position_bucket(
            rel[:, 0],
            relative_bias.num_buckets,
            relative_bias.max_distance,
            relative_bias.bidirectional,
        )  # [B, Tq, Tk]
        table = relative_bias.table.astype(jnp.float32)  # [Hq, num_buckets]
        s = s + jnp.moveaxis(table[:, buckets], 0, 1)  # [B, Hq, Tq, Tk]
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)

    s = jnp.where(visible, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m)
    l = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(l > 0, l, 1.0)
    pg = p.reshape(batch, num_kv_heads, group, tq, tk)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", pg, v.astype(jnp.float32), precision=_HIGHEST)
    out = out.reshape(batch, tq, num_q_heads, head_dim).astype(q.dtype)
    lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)[..., 0]
    return out, lse


def attention_reference(
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
    relative_bias: RelativeBias | None = None,
    soft_cap: float | None = None,
    scale: float | None = None,
    return_lse: bool = False,
):
    """Dense (padded) attention. Shapes and options as `jaxattn.attention`.

    q `[B, Tq, Hq, D]`, k/v `[B, Tk, Hkv, D]`, q_lengths/kv_lengths int `[B]`,
    bias float and mask bool broadcastable to `[B, Hq, Tq, Tk]`, alibi_slopes `[Hq]`.
    Returns out `[B, Tq, Hq, D]` (and lse `[B, Hq, Tq]` float32 with `return_lse`).
    """
    batch, tq, _, head_dim = q.shape
    tk = k.shape[1]
    q_len = jnp.full((batch,), tq, jnp.int32) if q_lengths is None else q_lengths
    kv_len = jnp.full((batch,), tk, jnp.int32) if kv_lengths is None else kv_lengths
    q_len = q_len.astype(jnp.int32)
    kv_len = kv_len.astype(jnp.int32)

    rows = jnp.arange(tq, dtype=jnp.int32)
    q_pos = (kv_len - q_len)[:, None] + rows[None, :]  # [B, Tq]
    k_pos = jnp.broadcast_to(jnp.arange(tk, dtype=jnp.int32), (batch, tk))  # [B, Tk]
    visible = _visible(
        q_pos[:, :, None],
        k_pos[:, None, :],
        causal=causal,
        window=window,
        sink_tokens=sink_tokens,
    )
    visible &= (rows[None, :, None] < q_len[:, None, None]) & (
        k_pos[:, None, :] < kv_len[:, None, None]
    )
    visible = visible[:, None]  # [B, 1, Tq, Tk]
    if mask is not None:
        visible = visible & mask
    # Padding keys get zero weight, but 0 * NaN is NaN: padding values must not leak.
    v = jnp.where((k_pos < kv_len[:, None])[:, :, None, None], v, 0)
    out, lse = _attend(
        q,
        k,
        v,
        q_pos,
        k_pos,
        visible,
        scale=head_dim**-0.5 if scale is None else scale,
        soft_cap=soft_cap,
        alibi_slopes=alibi_slopes,
        bias=bias,
        relative_bias=relative_bias,
    )
    return (out, lse) if return_lse else out


def ragged_attention_reference(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    *,
    causal: bool = False,
    window: int | None = None,
    sink_tokens: int = 0,
    alibi_slopes=None,
    bias=None,
    mask=None,
    relative_bias: RelativeBias | None = None,
    soft_cap: float | None = None,
    scale: float | None = None,
    return_lse: bool = False,
):
    """Packed (varlen) attention. Shapes and options as `jaxattn.ragged_attention`.

    q `[Tq_total, Hq, D]`, k/v `[Tk_total, Hkv, D]`; sequence b owns query tokens
    `cu_seqlens_q[b]:cu_seqlens_q[b+1]` and keys `cu_seqlens_k[b]:cu_seqlens_k[b+1]`.
    bias/mask are broadcastable to `[Hq, Tq_total, Tk_total]` (packed coordinates).
    Returns out `[Tq_total, Hq, D]` (and lse `[Hq, Tq_total]`); tokens past
    `cu_seqlens_q[-1]` are padding and output zeros.
    """
    tq, _, head_dim = q.shape
    tk = k.shape[0]
    cu_q = cu_seqlens_q.astype(jnp.int32)
    cu_k = cu_seqlens_k.astype(jnp.int32)

    def locate(cu, total):
        t = jnp.arange(total, dtype=jnp.int32)
        seq = jnp.searchsorted(cu, t, side="right").astype(jnp.int32) - 1
        seq = jnp.clip(seq, 0, cu.shape[0] - 2)
        valid = t < cu[-1]
        return seq, t - cu[seq], valid

    q_seq, q_local, q_valid = locate(cu_q, tq)
    k_seq, k_pos, k_valid = locate(cu_k, tk)
    q_lens = jnp.diff(cu_q)[q_seq]
    kv_lens = jnp.diff(cu_k)[q_seq]
    q_pos = kv_lens - q_lens + q_local  # [Tq]

    visible = _visible(
        q_pos[:, None],
        k_pos[None, :],
        causal=causal,
        window=window,
        sink_tokens=sink_tokens,
    )
    visible &= (q_seq[:, None] == k_seq[None, :]) & q_valid[:, None] & k_valid[None, :]
    visible = visible[None, None]  # [1, 1, Tq, Tk]
    if mask is not None:
        visible = visible & mask[None]
    v = jnp.where(k_valid[:, None, None], v, 0)  # padding values must not leak (0 * NaN)
    out, lse = _attend(
        q[None],
        k[None],
        v[None],
        q_pos[None],
        k_pos[None],
        visible,
        scale=head_dim**-0.5 if scale is None else scale,
        soft_cap=soft_cap,
        alibi_slopes=alibi_slopes,
        bias=None if bias is None else bias[None],
        relative_bias=relative_bias,
    )
    return (out[0], lse[0]) if return_lse else out[0]


def paged_decode_reference(
    q,
    cache,
    block_tables,
    context_lens,
    *,
    window: int | None = None,
    sink_tokens: int = 0,
    alibi_slopes=None,
    soft_cap: float | None = None,
    scale: float | None = None,
    return_lse: bool = False,
):
    """One query token per sequence against its paged history (generation phase).

    q `[B, Hq, D]`; sequence b holds `context_lens[b]` tokens (the new one included, so the
    query sits at position `context_lens[b] - 1`) in pages `block_tables[b]` of `cache`.
    A quantized cache is dequantized in float32, then rounded to q's dtype, as the kernel
    does: the reference sees exactly the K/V values the kernel multiplies.
    Returns out `[B, Hq, D]` (and lse `[B, Hq]`).
    """
    from jaxattn.cache import gather_kv  # (cache imports nothing from here)

    max_len = block_tables.shape[1] * cache.page_size
    k, v = gather_kv(cache, block_tables, context_lens, max_len)  # quantized: float32
    out = attention_reference(
        q[:, None],
        k.astype(q.dtype),
        v.astype(q.dtype),
        causal=True,
        q_lengths=jnp.ones_like(context_lens),
        kv_lengths=context_lens,
        window=window,
        sink_tokens=sink_tokens,
        alibi_slopes=alibi_slopes,
        soft_cap=soft_cap,
        scale=scale,
        return_lse=return_lse,
    )
    if return_lse:
        return out[0][:, 0], out[1][:, :, 0]
    return out[:, 0]
