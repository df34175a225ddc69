"""The spec in code: pure-jnp attention implementing every semantic of the library.

This is the `"xla"` backend and the oracle the kernels are tested against. It favours
obviousness over speed: it materialises the full `[B, Hq, Tq, Tk]` logits in float32.

Semantics (DESIGN.md): query token i of sequence b sits at position
`kv_len[b] - q_len[b] + i` (bottom-right alignment), key j at position j. Logits are
`scale * q.k + bias + alibi + relative_bias`, then the optional soft-cap, then masking and a
float32 softmax. A key is visible if `j < kv_len`, and (causal) `j <= p`, and (window W)
`j > p - W` or (sinks S) `j < S`, and the custom mask allows it. Rows with no visible key,
and padding rows, output zeros and a log-sum-exp of -inf.

Output: q's dtype by default; with `out_dtype=float8_e4m3fn` the float32 result is
quantized as `saturate(out * (1 / out_scale))` rounded to e4m3 (TensorRT-LLM's FP8 output,
`jaxattn.quant`'s per-tensor convention), straight from float32, never from a value
already rounded to q's dtype.

Inputs are assumed valid: `jaxattn.attention` and `jaxattn.ragged_attention` check them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxattn import validation
from jaxattn.positional import RelativeBias, relative_position_bucket
from jaxattn.rope import apply_rope
from jaxattn.streaming import cache_positions
from pallas_kernels.common import HIDDEN_BIAS

_HIGHEST = jax.lax.Precision.HIGHEST


def _store(out, q_dtype, out_dtype, out_scale):
    """The float32 result `out` as the op returns it: cast to `out_dtype` (None: q's), or
    for float8_e4m3fn quantized, `clip(out * (1 / out_scale), -448, 448)` rounded to
    nearest even. Zeros stay exact zeros."""
    dtype, out_scale = validation.check_output(out_dtype, out_scale, q_dtype)
    if dtype != validation.FP8_OUT:
        return out.astype(dtype)
    y = out.astype(jnp.float32) * (1.0 / out_scale)
    return jnp.clip(y, -validation.FP8_OUT_MAX, validation.FP8_OUT_MAX).astype(dtype)


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


def _add_terms(s, rel, *, bias, alibi_slopes, relative_bias, soft_cap):
    """Scaled logits `s` `[B, Hq, Tq, Tk]` float32 plus bias, ALiBi and T5 terms, then
    the soft-cap; `rel` int32 `[B, 1, Tq, Tk]` is key position - query position."""
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
    if bias is not None:  # a bias <= HIDDEN_BIAS (-inf too) hides its key, soft-cap or not
        s = jnp.where(bias <= HIDDEN_BIAS, -jnp.inf, s)
    return s


def _softmax(s, visible):
    """Masked float32 softmax over the last axis: (probabilities, lse `s.shape[:-1]`);
    rows with no visible key get zeros and an lse of -inf.

    The row max is taken off for range only, outside the gradient (as `jax.nn.logsumexp`
    does): its gradient cancels, and differentiating it divides by the count of logits
    equal to it, which is 0 wherever the compiler recomputes the logits in another
    rounding for the backward (XLA:CPU at optimization level 0 fuses them with and
    without an FMA: inf and NaN gradients)."""
    s = jnp.where(visible, s, -jnp.inf)
    m = jnp.max(jax.lax.stop_gradient(s), axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m)
    l = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(l > 0, l, 1.0)
    lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)[..., 0]
    return p, lse


def _attend(
    q,
    k,
    v,
    q_pos,
    k_pos,
    visible,
    *,
    scale,
    soft_cap,
    alibi_slopes,
    bias,
    relative_bias,
    out_dtype=None,
    out_scale=None,
):
    """Masked softmax attention with explicit positions.

    q `[B, Tq, Hq, D]`; k, v `[B, Tk, Hkv, D]`; q_pos `[B, Tq]` and k_pos `[B, Tk]` int32;
    visible bool broadcastable to `[B, Hq, Tq, Tk]`; bias likewise (float).
    Returns out `[B, Tq, Hq, D]` in `out_dtype` (`_store`) and lse `[B, Hq, Tq]` float32.
    """
    batch, tq, num_q_heads, head_dim = q.shape
    tk, num_kv_heads = k.shape[1], k.shape[2]
    group = num_q_heads // num_kv_heads
    qg = q.astype(jnp.float32).reshape(batch, tq, num_kv_heads, group, head_dim)
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k.astype(jnp.float32), precision=_HIGHEST)
    s = s.reshape(batch, num_q_heads, tq, tk) * scale
    rel = k_pos[:, None, None, :] - q_pos[:, None, :, None]  # [B, 1, Tq, Tk]
    s = _add_terms(
        s, rel, bias=bias, alibi_slopes=alibi_slopes, relative_bias=relative_bias, soft_cap=soft_cap
    )
    p, lse = _softmax(s, visible)
    pg = p.reshape(batch, num_kv_heads, group, tq, tk)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", pg, v.astype(jnp.float32), precision=_HIGHEST)
    out = out.reshape(batch, tq, num_q_heads, head_dim)
    return _store(out, q.dtype, out_dtype, out_scale), lse


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
    out_dtype=None,
    out_scale=None,
):
    """Dense (padded) attention. Shapes and options as `jaxattn.attention`.

    q `[B, Tq, Hq, D]`, k/v `[B, Tk, Hkv, D]`, q_lengths/kv_lengths int `[B]`,
    bias float and mask bool broadcastable to `[B, Hq, Tq, Tk]`, alibi_slopes `[Hq]`.
    Returns out `[B, Tq, Hq, D]` in `out_dtype` (None: q's; float8_e4m3fn: quantized by
    `out_scale`, a float32 scalar) and, with `return_lse`, lse `[B, Hq, Tq]` float32.
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
    # Padding keys and rows get zero weight, but 0 * NaN is NaN: padding values must not
    # leak, into the output or (through dq = ds @ k, dk = ds^T @ q) the gradients.
    k_ok = (k_pos < kv_len[:, None])[:, :, None, None]
    k, v = jnp.where(k_ok, k, 0), jnp.where(k_ok, v, 0)
    q = jnp.where((rows[None, :] < q_len[:, None])[:, :, None, None], q, 0)
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
        out_dtype=out_dtype,
        out_scale=out_scale,
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
    out_dtype=None,
    out_scale=None,
):
    """Packed (varlen) attention. Shapes and options as `jaxattn.ragged_attention`.

    q `[Tq_total, Hq, D]`, k/v `[Tk_total, Hkv, D]`; sequence b owns query tokens
    `cu_seqlens_q[b]:cu_seqlens_q[b+1]` and keys `cu_seqlens_k[b]:cu_seqlens_k[b+1]`.
    bias/mask are broadcastable to `[Hq, Tq_total, Tk_total]` (packed coordinates).
    Returns out `[Tq_total, Hq, D]` in `out_dtype` (as `attention_reference`; and lse
    `[Hq, Tq_total]`); tokens past `cu_seqlens_q[-1]` are padding and output zeros.
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
    # Padding values must not leak (0 * NaN), into the output or the gradients.
    k, v = jnp.where(k_valid[:, None, None], k, 0), jnp.where(k_valid[:, None, None], v, 0)
    q = jnp.where(q_valid[:, None, None], q, 0)
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
        out_dtype=out_dtype,
        out_scale=out_scale,
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
    cache_indirection=None,
    out_dtype=None,
    out_scale=None,
):
    """One query token per sequence against its paged history (generation phase).

    q `[B, Hq, D]`; sequence b holds `context_lens[b]` tokens (the new one included, so the
    query sits at position `context_lens[b] - 1`) in pages `block_tables[b]` of `cache`.
    A quantized cache is dequantized in float32, then rounded to q's dtype, as the kernel
    does: the reference sees exactly the K/V values the kernel multiplies.
    cache_indirection: None, or int32 `[B // W, W, L]` (beam width W): token t of row
    `r = b * W + j` is read through row `b * W + clip(ind[b, j, t], 0, W - 1)`'s block
    table; tokens t >= L read through row r's own (`jaxattn.paged_decode`).
    Returns out `[B, Hq, D]` in `out_dtype` (as `attention_reference`; and lse `[B, Hq]`).
    """
    from jaxattn.cache import gather_kv  # (cache imports nothing from here)

    max_len = block_tables.shape[1] * cache.page_size
    if cache_indirection is None:
        k, v = gather_kv(cache, block_tables, context_lens, max_len)  # quantized: float32
    else:
        # Every row's full table, then token t of row r from its source row src[r, t].
        everything = jnp.full_like(context_lens, max_len)
        k, v = gather_kv(cache, block_tables, everything, max_len)
        width, ind_len = cache_indirection.shape[1:]
        t = jnp.arange(max_len)
        row = jnp.arange(q.shape[0])[:, None]  # [B, 1]
        beam = jnp.clip(cache_indirection[:, :, jnp.minimum(t, ind_len - 1)], 0, width - 1)
        beam = jnp.where(t < ind_len, beam.reshape(q.shape[0], max_len), row % width)
        src = row - row % width + beam  # [B, max_len]
        valid = (t < context_lens[:, None])[:, :, None, None]
        k, v = (jnp.where(valid, x[src, t], 0) for x in (k, v))
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
        out_dtype=out_dtype,
        out_scale=out_scale,
    )
    if return_lse:
        return out[0][:, 0], out[1][:, :, 0]
    return out[:, 0]


def cached_positions(slots, prefix, ring):
    """Position held by slot index `slots` (int32 `[K]`, in table order: slot v is in table
    column v // P) of a sequence whose first `prefix` (int32 `[T, 1]`) positions are
    cached; -1 where the slot holds none of them. `ring = (kept, size)`: a cyclic cache
    (positions >= kept cycle through slots kept .. kept + size - 1; the latest wins)."""
    if ring is None:
        return jnp.where(slots < prefix, slots, -1)
    kept, size = ring
    r = slots - kept
    latest = kept + r + size * jnp.floor_divide(prefix - 1 - kept - r, size)
    pos = jnp.where(slots < kept, slots, latest)
    return jnp.where((pos >= 0) & (pos < prefix) & ((slots < kept) | (pos >= kept)), pos, -1)


def paged_attention_reference(
    q,
    k_new,
    v_new,
    cache,
    meta,
    *,
    window: int | None = None,
    sink_tokens: int = 0,
    alibi_slopes=None,
    soft_cap: float | None = None,
    scale: float | None = None,
    relative_bias: RelativeBias | None = None,
    read_rope=None,
    return_lse: bool = False,
    out_dtype=None,
    out_scale=None,
):
    """In-flight batching attention (spec of `jaxattn.paged_attention`, after RoPE).

    q `[T, Hq, D]`; k_new, v_new `[T, Hkv, D]`: the step's new keys and values as the cache
    stores them (`jaxattn.cache.write_kv_stored`); cache: the cache BEFORE this step's write;
    meta: the `AttentionMetadata`. Token i of row s sits at position
    `context_lens[s] - q_len[s] + i` and attends causally to the row's cached prefix (its
    first `context_lens[s] - q_len[s]` positions, read through its block table) and to the
    row's new tokens, with the options of `attention_reference`. Padding tokens output
    zeros. Memory is O(T * (M * P + T)): for tests and small models.
    read_rope: None, or the `jaxattn.RoPE` of `rope_on_read=True` (StreamingLLM): q, k_new
    and the cache are un-rotated; each query is rotated at its position within the cache
    `p - o(p)`, `o(p) = max(0, p - window + 1 - sink_tokens)` (0 without a window), and
    each of its keys j at `j` (sinks, `j < sink_tokens`) or `j - o(p)` (`jaxattn.streaming`).
    ALiBi and T5 terms keep the absolute positions.
    Returns out `[T, Hq, D]` in `out_dtype` (as `attention_reference`; and lse float32
    `[Hq, T]`).
    """
    from jaxattn.cache import gather_kv  # (cache imports nothing from here)

    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_new.shape[1]
    group = num_q_heads // num_kv_heads
    rows, real = meta.token_rows()
    q_lens = meta.q_lens
    ctx = meta.context_lens[rows]
    prefix = (ctx - q_lens[rows])[:, None]  # [T, 1]
    q_pos = ctx - q_lens[rows] + (jnp.arange(num_tokens) - meta.cu_seqlens_q[rows])  # [T]

    # Cached keys: every slot of the row's table, in table order.
    num_slots = meta.max_pages * cache.page_size
    full = jnp.full((num_tokens,), num_slots, jnp.int32)
    k_c, v_c = gather_kv(cache, meta.block_tables[rows], full, num_slots)  # [T, K, Hkv, D]
    k_c, v_c = k_c.astype(q.dtype), v_c.astype(q.dtype)
    pos_c = cached_positions(jnp.arange(num_slots)[None, :], prefix, meta.ring)  # [T, K]
    held = (pos_c >= 0)[:, :, None, None]  # other slots may hold anything (0 * NaN = NaN)
    k_c, v_c = jnp.where(held, k_c, 0), jnp.where(held, v_c, 0)
    # New keys: the step's tokens of the same row.
    same_row = (rows[None, :] == rows[:, None]) & real[None, :]  # [T, T]
    pos_n = jnp.where(same_row, q_pos[None, :], -1)

    k_pos = jnp.concatenate([pos_c, pos_n], axis=1)  # [T, K + T], -1 = no key
    valid = (k_pos >= 0) & real[:, None]
    visible = valid & _visible(
        q_pos[:, None], k_pos, causal=True, window=window, sink_tokens=sink_tokens
    )
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    k_n, new_keys = k_new.astype(q.dtype), "uhd"  # [T, Hkv, D], shared by every query
    if read_rope is not None:  # Every query rotates its own copy of the keys.

        def in_cache(k_pos):
            pos = cache_positions(q_pos, k_pos, window, sink_tokens)
            return pos[0], jnp.maximum(pos[1], 0)  # (keys that are not there: any angle)

        q_in, kc_in = in_cache(pos_c)
        k_n = jnp.broadcast_to(k_n, (num_tokens, *k_n.shape))
        k_c = apply_rope(k_c, kc_in, read_rope)  # [T, K, Hkv, D]
        k_n, new_keys = apply_rope(k_n, in_cache(pos_n)[1], read_rope), "tuhd"  # [T, T, Hkv, D]
        q = apply_rope(q[:, None], q_in[:, None], read_rope)[:, 0]
    qg = q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, head_dim)
    s_c = jnp.einsum("thgd,tkhd->thgk", qg, f32(k_c), precision=_HIGHEST)
    s_n = jnp.einsum(f"thgd,{new_keys}->thgu", qg, f32(k_n), precision=_HIGHEST)
    s = jnp.concatenate([s_c, s_n], axis=-1).reshape(num_tokens, num_q_heads, 1, -1)
    s = s * (head_dim**-0.5 if scale is None else scale)
    rel = (k_pos - q_pos[:, None])[:, None, None, :]  # [T, 1, 1, K + T]
    s = _add_terms(
        s,
        rel,
        bias=None,
        alibi_slopes=alibi_slopes,
        relative_bias=relative_bias,
        soft_cap=soft_cap,
    )
    p, lse = _softmax(s, visible[:, None, None, :])  # [T, Hq, 1, K + T], [T, Hq, 1]
    p = p.reshape(num_tokens, num_kv_heads, group, -1)
    p_c, p_n = p[..., :num_slots], p[..., num_slots:]
    v_n = jnp.where(real[:, None, None], f32(v_new.astype(q.dtype)), 0)  # padding: no NaN
    out = jnp.einsum("thgk,tkhd->thgd", p_c, f32(v_c), precision=_HIGHEST)
    out = out + jnp.einsum("thgu,uhd->thgd", p_n, v_n, precision=_HIGHEST)
    out = out.reshape(num_tokens, num_q_heads, head_dim)
    out = _store(jnp.where(real[:, None, None], out, 0), q.dtype, out_dtype, out_scale)
    if return_lse:
        return out, jnp.where(real[None, :], lse[:, :, 0].T, -jnp.inf)
    return out
