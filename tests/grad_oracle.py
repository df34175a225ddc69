"""An independent float64 numpy ANALYTIC backward of attention, from DESIGN.md's semantics.

It shares no code with `jaxattn`; it reuses `oracle.py`'s T5 bucketing only. Per sequence
b and query head h (kv head `h // (Hq // Hkv)`), with p = kv_len - q_len + i:

    z  = scale * q.k + bias - slope[h] * |p - j| + table[h, bucket(j - p)]
    s  = soft_cap * tanh(z / soft_cap)           (s = z without a soft-cap)
    P  = softmax of s over the visible keys      (a row with none: P = 0, lse = -inf)
    out = P V,   lse = log sum exp(s)

and, for cotangents g_out (like out) and g_lse (like lse; ignored where lse is -inf):

    dV = P^T g_out,   dP = g_out V^T,   dS = P * (dP - rowsum(dP * P) + g_lse)
    dZ = dS * (1 - tanh(z / soft_cap)^2)         (dZ = dS without a soft-cap)
    dq = scale * dZ K,   dk = scale * dZ^T q     (GQA: dk, dv summed over the group)
    d_bias = dZ (summed over the bias's broadcast axes),
    d_slope[h] = sum dZ * (-|p - j|),   d_table[h, b] = sum of dZ where bucket(j - p) = b.

Padding query rows (past q_len / past cu_seqlens_q[-1]) get dq = 0; keys past kv_len
(past cu_seqlens_k[-1]) get dk = dv = 0: P is 0 there, so every sum above skips them.

`lowp` (e.g. `ml_dtypes.bfloat16`, `np.float16`) makes it the plain low-precision
reference of FlashAttention's tests for the backward: as `oracle.py`'s forward, the
scaled logits, P and out are rounded to `lowp`; so are dP, the dZ fed to the matmuls,
and dq / dk / dv (what a low-precision autograd of the plain formula rounds).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from oracle import t5_relative_position_bucket

__all__ = ["GradResult", "attention_grad_oracle", "ragged_attention_grad_oracle", "sum_to_shape"]


class GradResult(NamedTuple):
    out: np.ndarray  # float64, like q
    lse: np.ndarray  # float64 [B, Hq, Tq] (packed: [Hq, Tq_total]); -inf: no visible key
    grads: dict  # name -> float64 gradient, the input's shape
    # name -> bool, the gradient's shape: False where no gradient can flow at all (P is 0
    # for every logit the entry touches: padding rows, rows with no visible key, keys no
    # query sees, masked logits), so an implementation must give exactly 0 there. (A
    # gradient that is 0 by cancellation, e.g. dq of a row seeing one key, is not.)
    flows: dict


def _round(x, lowp):
    return x if lowp is None else np.asarray(x).astype(lowp).astype(np.float64)


def sum_to_shape(g: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """The gradient of `broadcast_to(x, g.shape)` w.r.t. x of `shape`: sums broadcast axes."""
    g = g.sum(axis=tuple(range(g.ndim - len(shape))))
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and g.shape[i] != 1)
    return g.sum(axis=axes, keepdims=True).reshape(shape)


def _dense(
    q,
    k,
    v,
    g_out,
    g_lse,
    *,
    causal,
    q_lengths,
    kv_lengths,
    window,
    sink_tokens,
    alibi_slopes,
    bias,
    mask,
    table,
    rel,
    soft_cap,
    scale,
    lowp,
):
    """Forward and backward on `[B, Tq, Hq, D]` / `[B, Tk, Hkv, D]`; bias, mask already
    broadcast to `[B, Hq, Tq, Tk]`. Returns a `GradResult` whose "bias" gradient and flows
    are at that full shape."""
    batch, tq, num_q_heads, head_dim = q.shape
    tk, num_kv_heads = k.shape[1], k.shape[2]
    group = num_q_heads // num_kv_heads
    out = np.zeros(q.shape)
    lse = np.full((batch, num_q_heads, tq), -np.inf)
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    d_bias = None if bias is None else np.zeros((batch, num_q_heads, tq, tk))
    d_slopes = None if alibi_slopes is None else np.zeros(num_q_heads)
    d_table = None if table is None else np.zeros(table.shape)
    q_flow, k_flow = np.zeros(q.shape[:3], bool), np.zeros(k.shape[:3], bool)
    bias_flow = np.zeros((batch, num_q_heads, tq, tk), bool)
    i = np.arange(tq)[:, None]
    j = np.arange(tk)[None, :]
    for b in range(batch):
        q_len, kv_len = int(q_lengths[b]), int(kv_lengths[b])
        pos = kv_len - q_len + i  # [Tq, 1]
        visible = (i < q_len) & (j < kv_len)
        if causal:
            visible &= j <= pos
        if window is not None:
            visible &= (j > pos - window) | (j < sink_tokens)
        distance = np.abs(pos - j).astype(np.float64)  # [Tq, Tk]
        buckets = None
        if table is not None:
            max_distance, bidirectional = rel
            buckets = t5_relative_position_bucket(
                j - pos, bidirectional, table.shape[1], max_distance
            )
        for h in range(num_q_heads):
            kvh = h // group
            qh, kh, vh = q[b, :, h], k[b, :, kvh], v[b, :, kvh]  # [Tq, D], [Tk, D], [Tk, D]
            z = _round(scale * (qh @ kh.T), lowp)  # [Tq, Tk]
            if bias is not None:
                z = z + bias[b, h]
            if alibi_slopes is not None:
                z = z - alibi_slopes[h] * distance
            if table is not None:
                z = z + table[h][buckets]
            if soft_cap is not None:
                t = np.tanh(z / soft_cap)
                s = soft_cap * t
            else:
                s = z
            vis = visible if mask is None else visible & mask[b, h]
            if bias is not None:  # a bias <= -1e37 (-inf too) hides its key (README)
                vis = vis & (np.broadcast_to(bias[b, h], s.shape) > -1e37)
            s = np.where(vis, s, -np.inf)
            m = np.max(s, axis=-1, initial=-np.inf, keepdims=True)  # [Tq, 1]
            seen = np.isfinite(m)
            with np.errstate(invalid="ignore"):
                e = np.where(vis & seen, np.exp(s - np.where(seen, m, 0.0)), 0.0)
            l = e.sum(-1, keepdims=True)
            p = _round(e / np.where(seen, l, 1.0), lowp)  # [Tq, Tk]; 0 where not visible
            o = _round(p @ vh, lowp)
            out[b, :, h] = o
            bias_flow[b, h] = p > 0
            q_flow[b, :, h] = (p > 0).any(-1)
            k_flow[b, :, kvh] |= (p > 0).any(0)
            lse[b, h] = np.where(seen, m + np.log(np.where(seen, l, 1.0)), -np.inf)[:, 0]

            go = g_out[b, :, h]  # [Tq, D]
            gl = np.zeros(tq) if g_lse is None else np.where(seen[:, 0], g_lse[b, h], 0.0)
            dv[b, :, kvh] += p.T @ go
            dp = _round(go @ vh.T, lowp)  # [Tq, Tk]
            delta = np.sum(dp * p, axis=-1, keepdims=True)  # = rowsum(g_out * out)
            ds = p * (dp - delta + gl[:, None])
            dz = ds if soft_cap is None else ds * (1.0 - t**2)
            dzr = _round(dz, lowp)
            dq[b, :, h] = scale * (dzr @ kh)
            dk[b, :, kvh] += scale * (dzr.T @ qh)
            if d_bias is not None:
                d_bias[b, h] = dz
            if d_slopes is not None:
                d_slopes[h] -= np.sum(dz * distance)
            if d_table is not None:
                d_table[h] += np.bincount(buckets.ravel(), dz.ravel(), table.shape[1])
    grads = dict(q=_round(dq, lowp), k=_round(dk, lowp), v=_round(dv, lowp))
    flows = dict(q=q_flow[..., None], k=k_flow[..., None], v=k_flow[..., None])
    if d_bias is not None:
        grads["bias"], flows["bias"] = d_bias, bias_flow
    if d_slopes is not None:
        grads["alibi_slopes"] = d_slopes
    if d_table is not None:
        grads["table"] = d_table
    for name, g in grads.items():
        flows[name] = np.broadcast_to(flows.get(name, True), g.shape)
    return GradResult(out, lse, grads, flows)


def _f64(x):
    return None if x is None else np.asarray(x, np.float64)


def attention_grad_oracle(
    q,
    k,
    v,
    g_out,
    g_lse=None,
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
    """Dense attention and its gradients. Arguments as `oracle.attention_oracle`, plus
    g_out `[B, Tq, Hq, D]` and g_lse `[B, Hq, Tq]` (None: no lse term).

    Returns a `GradResult`: float64 out `[B, Tq, Hq, D]`, lse `[B, Hq, Tq]`, and grads
    (with their `flows`) of "q", "k", "v" and, where given, "bias" (bias's own shape),
    "alibi_slopes" `[Hq]` and "table" `[Hq, num_buckets]` (`relative_bias`'s table).
    """
    q, k, v, g_out, g_lse = (_f64(x) for x in (q, k, v, g_out, g_lse))
    batch, tq, num_q_heads, head_dim = q.shape
    tk = k.shape[1]
    full = (batch, num_q_heads, tq, tk)
    bias_shape = None if bias is None else np.shape(bias)
    table, rel = None, None
    if relative_bias is not None:
        table, max_distance, bidirectional = relative_bias
        table, rel = _f64(table), (max_distance, bidirectional)
    res = _dense(
        q,
        k,
        v,
        g_out,
        g_lse,
        causal=causal,
        q_lengths=[tq] * batch if q_lengths is None else np.asarray(q_lengths),
        kv_lengths=[tk] * batch if kv_lengths is None else np.asarray(kv_lengths),
        window=window,
        sink_tokens=sink_tokens,
        alibi_slopes=_f64(alibi_slopes),
        bias=None if bias is None else np.broadcast_to(_f64(bias), full),
        mask=None if mask is None else np.broadcast_to(np.asarray(mask, bool), full),
        table=table,
        rel=rel,
        soft_cap=soft_cap,
        scale=1.0 / math.sqrt(head_dim) if scale is None else scale,
        lowp=lowp,
    )
    if bias is not None:
        res.grads["bias"] = sum_to_shape(res.grads["bias"], bias_shape)
        res.flows["bias"] = sum_to_shape(res.flows["bias"].astype(float), bias_shape) > 0
    return res


def ragged_attention_grad_oracle(
    q, k, v, cu_seqlens_q, cu_seqlens_k, g_out, g_lse=None, *, bias=None, mask=None, **opts
):
    """Packed attention and its gradients: each sequence alone through the dense oracle.

    q, g_out `[Tq_total, Hq, D]`, k/v `[Tk_total, Hkv, D]`, g_lse `[Hq, Tq_total]`;
    bias/mask broadcast to `[Hq, Tq_total, Tk_total]` (packed coordinates). Rows past
    `cu_seqlens_q[-1]` / `cu_seqlens_k[-1]` are padding: zero out and zero gradients.
    Returns a `GradResult` as `attention_grad_oracle` (lse `[Hq, Tq_total]`).
    """
    q, k, v, g_out, g_lse = (_f64(x) for x in (q, k, v, g_out, g_lse))
    cu_q = [int(x) for x in np.asarray(cu_seqlens_q)]
    cu_k = [int(x) for x in np.asarray(cu_seqlens_k)]
    full = (q.shape[1], q.shape[0], k.shape[0])
    bias_shape = None if bias is None else np.shape(bias)
    if bias is not None:
        bias = np.broadcast_to(_f64(bias), full)
    if mask is not None:
        mask = np.broadcast_to(np.asarray(mask, bool), full)
    out = np.zeros(q.shape)
    lse = np.full((q.shape[1], q.shape[0]), -np.inf)
    grads = dict(q=np.zeros(q.shape), k=np.zeros(k.shape), v=np.zeros(v.shape))
    flows = {name: np.zeros(x.shape, bool) for name, x in grads.items()}
    if bias is not None:
        grads["bias"], flows["bias"] = np.zeros(full), np.zeros(full, bool)
    for b in range(len(cu_q) - 1):
        rows, cols = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        res = attention_grad_oracle(
            q[None, rows],
            k[None, cols],
            v[None, cols],
            g_out[None, rows],
            None if g_lse is None else g_lse[None, :, rows],
            bias=None if bias is None else bias[None, :, rows, cols],
            mask=None if mask is None else mask[None, :, rows, cols],
            **opts,
        )
        g, f = res.grads, res.flows
        out[rows], lse[:, rows] = res.out[0], res.lse[0]
        grads["q"][rows], flows["q"][rows] = g["q"][0], f["q"][0]
        for name in ("k", "v"):
            grads[name][cols] += g[name][0]
            flows[name][cols] |= f[name][0]
        if bias is not None:
            grads["bias"][:, rows, cols], flows["bias"][:, rows, cols] = g["bias"][0], f["bias"][0]
        for name in ("alibi_slopes", "table"):
            if name in g:  # B >= 1: every sequence gives one
                grads[name] = grads.get(name, 0.0) + g[name]
                flows[name] = f[name]
    if bias is not None:
        grads["bias"] = sum_to_shape(grads["bias"], bias_shape)
        flows["bias"] = sum_to_shape(flows["bias"].astype(float), bias_shape) > 0
    return GradResult(out, lse, grads, flows)
