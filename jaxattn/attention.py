"""Context-phase attention: `attention` (dense, padded) and `ragged_attention` (packed).

Both validate at trace time, then dispatch to the Pallas flash kernels (`"pallas"`) or the
pure-jnp reference (`"xla"`). Of the flash forwards, `forward_backend` picks the Hopper
kernel (`pallas_kernels.mosaic`, Mosaic GPU) on compute capability 9.x where it covers
the call, the Triton kernel otherwise (`FlashPrefillConfig.backend` forces one).

Gradients come from a custom VJP. With `"pallas"` its forward saves q, k, v, the output
and the float32 log-sum-exp (nothing of size Tq x Tk), whichever kernel ran, and its
backward runs flash backward kernels (dK/dV and dQ, deterministic, GQA summed in-kernel):
the Hopper ones (`pallas_kernels.mosaic.mosaic_backward`, `mosaic_backward_packed`) where
`select_backward` takes the call, the Triton ones (`pallas_kernels.flash_backward`) for
every other option the forward takes (`FlashBackwardConfig.backend` forces one); the
gradients of a bias, the ALiBi slopes and a T5 table are computed only when they are
differentiated (symbolic zeros). With `"xla"` the backward differentiates the reference.
An FP8 output (`out_dtype=float8_e4m3fn`) is an inference format: it has no gradient, and
differentiating it raises.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, Bool, Float, Int

from jaxattn import reference, validation
from jaxattn.dispatch import run_first
from jaxattn.parallel import ring
from jaxattn.parallel.partition import BATCH, HEADS, KV_HEADS, SEQUENCE, Out, like, run_sharded
from jaxattn.positional import RelativeBias
from pallas_kernels.batch import Batch, packed_batch
from pallas_kernels.common import use_interpret, varying_like
from pallas_kernels.flash_backward import FlashBackwardConfig, flash_backward
from pallas_kernels.flash_prefill import FlashPrefillConfig, flash_prefill
from pallas_kernels.flash_prefill.kernel import LogitParams
from pallas_kernels.mosaic import (
    full_attention,
    mosaic_backward,
    mosaic_backward_packed,
    mosaic_forward,
    mosaic_forward_packed,
    select_backward,
    select_forward,
)

__all__ = ["attention", "ragged_attention"]


@dataclasses.dataclass(frozen=True)
class _Static:
    """The hashable part of a call: options that select code, not data."""

    packed: bool
    causal: bool
    window: int | None
    sink_tokens: int
    soft_cap: float | None
    scale: float
    return_lse: bool
    rel_max_distance: int
    rel_bidirectional: bool
    out_fp8: bool = False  # out_dtype=float8_e4m3fn, quantized by out_scale


def _reference(static: _Static, qkv, lengths, extras, out_scale=None):
    q, k, v = qkv
    alibi, bias, mask, rel_table = extras
    relative_bias = (
        None
        if rel_table is None
        else RelativeBias(rel_table, static.rel_max_distance, static.rel_bidirectional)
    )
    opts = dict(
        causal=static.causal,
        window=static.window,
        sink_tokens=static.sink_tokens,
        alibi_slopes=alibi,
        bias=bias,
        mask=mask,
        relative_bias=relative_bias,
        soft_cap=static.soft_cap,
        scale=static.scale,
        return_lse=True,
    )
    if static.out_fp8:
        opts.update(out_dtype=validation.FP8_OUT, out_scale=out_scale)
    if static.packed:
        cu_q, cu_k = lengths
        # bias/mask arrive 4-D ([1, H, Tq, Tk]); the packed reference takes 3-D.
        opts["bias"] = None if bias is None else bias[0]
        opts["mask"] = None if mask is None else mask[0]
        return reference.ragged_attention_reference(q, k, v, cu_q, cu_k, **opts)
    q_len, kv_len = lengths
    return reference.attention_reference(q, k, v, q_lengths=q_len, kv_lengths=kv_len, **opts)


def _batch(static: _Static, q, k, lengths) -> Batch:
    """Lengths (dense) or placement (packed) of the sequences, for the kernel."""
    if static.packed:
        return packed_batch(*lengths, q.shape[0], k.shape[0])
    q_len, kv_len = lengths
    return Batch(q_len=q_len, kv_len=kv_len)


def _roles(static: _Static):
    """Axis roles of (q, k, v, lengths, alibi, bias, mask, rel_table) and of out and lse,
    for the partition rules (`jaxattn.parallel.partition`)."""
    if static.packed:
        q, kv, length, lse = (None, HEADS, None), (None, KV_HEADS, None), (None,), (HEADS, None)
    else:
        q, kv = (BATCH, SEQUENCE, HEADS, None), (BATCH, SEQUENCE, KV_HEADS, None)
        length, lse = (BATCH,), (BATCH, HEADS, SEQUENCE)
    extras = ((HEADS,), (BATCH, HEADS, None, None), (BATCH, HEADS, None, None), (HEADS, None))
    return (q, kv, kv, length, length, *extras), q, lse


def _pallas(static: _Static, config, qkv, lengths, extras, out_scale=None):
    """The flash kernel, shard-local on arrays split along batch and heads."""
    ins, q_roles, lse_roles = _roles(static)
    run = functools.partial(_pallas_local, static, config)
    has_ring = _has_ring(static, qkv, lengths, extras)
    out, lse = run_sharded(
        run,
        (*qkv, *lengths, *extras, out_scale),
        (*ins, ()),
        (Out(q_roles), Out(lse_roles)),
        name="attention",
        sequence_fn=_ring_forward(static, config) if has_ring else None,
    )
    return out, lse


def _has_ring(static: _Static, qkv, lengths, extras, g_lse=None) -> bool:
    """Whether a sequence split over devices runs as ring attention (`jaxattn.parallel.ring`):
    a dense batch with causal and scale alone, as many queries as keys, no lse cotangent."""
    q, k, _ = qkv
    plain = static.window is None and static.sink_tokens == 0 and static.soft_cap is None
    return (
        not static.packed
        and plain
        and not static.out_fp8
        and all(x is None for x in (*lengths, *extras, g_lse))
        and q.shape[1] == k.shape[1]
    )


def _ring_forward(static: _Static, config):
    def on(axes, mesh_axes):
        def run(q, k, v, *unused):
            return ring.ring_forward(
                q, k, v, axis_name=axes, causal=static.causal, scale=static.scale,
                config=config, mesh_axes=mesh_axes,
            )  # fmt: skip

        return run

    return on


def _ring_backward(static: _Static, config):
    def on(axes, mesh_axes):
        def run(q, k, v, out, lse, g_out, *unused):
            grads = ring.ring_backward(
                q, k, v, out, lse, g_out, axis_name=axes, causal=static.causal,
                scale=static.scale, config=config, mesh_axes=mesh_axes,
            )  # fmt: skip
            return (*grads, None, None, None)

        return run

    return on


def _hopper_options(static: _Static, extras) -> dict:
    """The call's options that decide whether a Hopper kernel covers it
    (`pallas_kernels.mosaic.support`; both cover q/kv lengths, sinks and packed batches)."""
    return dict(packed=static.packed, terms=any(x is not None for x in extras))


def forward_backend(static: _Static, config, q, k, extras, device=None):
    """("mosaic", its tiling) or ("triton", None): the kernel that runs this forward
    (`pallas_kernels.mosaic.select_forward`: the Hopper kernel on sm90 where it covers
    the call, unless `config.backend` forces one)."""
    options = _hopper_options(static, extras)
    full = full_attention(static.causal, static.window, ragged=static.packed)
    tiling = select_forward(
        config, q.shape, k.shape, q.dtype, device=device, full=full, out_fp8=static.out_fp8,
        **options,
    )  # fmt: skip
    return ("triton", None) if tiling is None else ("mosaic", tiling)


def _pallas_local(
    static: _Static, config, q, k, v, len_q, len_k, alibi, bias, mask, rel_table, out_scale
):
    if static.out_fp8:
        validation.check_fp8_kernel_output()
    lengths = (len_q, len_k)
    backend, tiling = forward_backend(static, config, q, k, (alibi, bias, mask, rel_table))
    if backend == "mosaic":
        run = mosaic_forward_packed if static.packed else mosaic_forward
        out, lse = run(
            q, k, v, *lengths, causal=static.causal, window=static.window,
            sink_tokens=static.sink_tokens, soft_cap=static.soft_cap, scale=static.scale,
            config=tiling,
        )  # fmt: skip
        return out, (lse if static.return_lse else None)
    params = _params(static)
    config = (config or FlashPrefillConfig()).resolve(
        *_max_lengths(static, q, k),
        q.shape[-1],
        q.dtype,
        static.causal,
        lengths=static.packed or any(x is not None for x in lengths),
        packed=static.packed,
        logit_tiles=any(x is not None for x in (bias, mask, rel_table)),
    )
    return flash_prefill(
        q,
        k,
        v,
        _batch(static, q, k, lengths),
        bias=bias,
        mask=mask,
        alibi_slopes=alibi,
        rel_table=rel_table,
        params=params,
        config=config,
        return_lse=static.return_lse,
        out_dtype=validation.FP8_OUT if static.out_fp8 else None,
        out_scale=out_scale,
        interpret=use_interpret(),
    )


def _forward(impl: str, static: _Static, config, qkv, lengths, extras, out_scale=None):
    if impl == "xla":
        out, lse = _reference(static, qkv, lengths, extras, out_scale)
        return out, (lse if static.return_lse else None)
    return _pallas(static, config, qkv, lengths, extras, out_scale)


def _params(static: _Static) -> LogitParams:
    return LogitParams(
        causal=static.causal,
        window=static.window,
        sink_tokens=static.sink_tokens,
        soft_cap=static.soft_cap,
        scale=static.scale,
        packed_coords=static.packed,
        rel_max_distance=static.rel_max_distance,
        rel_bidirectional=static.rel_bidirectional,
    )


def _max_lengths(static: _Static, q, k) -> tuple[int, int]:
    """Query and key tokens per sequence (the static bound)."""
    token_axis = 0 if static.packed else 1
    return q.shape[token_axis], k.shape[token_axis]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _differentiable(impl, static, config, qkv, lengths, extras):
    return _forward(impl, static, config, qkv, lengths, extras)


def _differentiable_fwd(impl, static, config, qkv, lengths, extras):
    """Residuals: q, k, v, the lengths and extras, and for the kernels out and the float32
    lse (nothing of size Tq x Tk); for "xla", out, lse and the reference's vjp (its own
    residuals, as autodiff of the dense reference keeps them). `needs` names the float
    extras that are being differentiated (its keys are static structure), so the backward
    computes no others."""
    unwrap = lambda tree: jax.tree.map(lambda x: x.value, tree, is_leaf=_is_primal)  # noqa: E731
    perturbed = jax.tree.map(lambda x: x.perturbed, extras, is_leaf=_is_primal)
    needs = {name: None for name, p in zip(_FLOAT_EXTRAS, perturbed, strict=True) if p is True}
    qkv, lengths, extras = unwrap(qkv), unwrap(lengths), unwrap(extras)
    if impl == "xla":  # the reference's own gradient: its vjp, residuals kept, not recomputed
        alibi, bias, mask, rel_table = extras

        def f(qkv, alibi, bias, rel_table):
            return _reference(static, qkv, lengths, (alibi, bias, mask, rel_table))

        (out, lse), vjp = jax.vjp(f, qkv, alibi, bias, rel_table)
        outputs = (out, lse if static.return_lse else None)
        return outputs, (qkv, lengths, extras, (out, lse, vjp), needs)
    out, lse = _pallas(dataclasses.replace(static, return_lse=True), config, qkv, lengths, extras)
    outputs = (out, lse if static.return_lse else None)
    return outputs, (qkv, lengths, extras, (out, lse), needs)


_FLOAT_EXTRAS = ("alibi", "bias", "mask", "rel_table")  # the order of `extras`


def _is_primal(x) -> bool:
    return isinstance(x, jax.custom_derivatives.CustomVJPPrimal)


def _dense_cotangent(g, like):
    """A cotangent as an array: symbolic zeros (an output the loss does not use) as zeros."""
    if g is None or isinstance(g, jax.custom_derivatives.SymbolicZero):
        return None if like is None else jnp.zeros(like.shape, like.dtype)
    return g


def _differentiable_bwd(impl, static, config, residuals, cotangents):
    qkv, lengths, extras, saved, needs = residuals
    alibi, bias, mask, rel_table = extras
    g_out, g_lse = cotangents
    if impl == "xla":  # the vjp the forward rule kept
        out, lse, vjp = saved
        g_out = _dense_cotangent(g_out, out)
        g_lse = _dense_cotangent(g_lse, lse)
        g_lse = jnp.where(jnp.isfinite(lse), g_lse, 0)
        g_qkv, g_alibi, g_bias, g_rel = vjp((g_out.astype(out.dtype), g_lse))
        return g_qkv, None, (g_alibi, g_bias, None, g_rel)

    out, lse = saved
    g_out = _dense_cotangent(g_out, out).astype(out.dtype)
    g_lse = None if isinstance(g_lse, jax.custom_derivatives.SymbolicZero) else g_lse
    grads_of = ("bias" in needs, "alibi" in needs, "rel_table" in needs)
    ins, q_roles, lse_roles = _roles(static)
    q_in, k_in, v_in, len_q, len_k, *extra_roles = ins
    alibi_r, bias_r, _, rel_r = extra_roles
    run = functools.partial(_backward_local, static, config, grads_of)
    has_ring = _has_ring(static, qkv, lengths, extras, g_lse)
    dq, dk, dv, d_bias, d_alibi, d_rel = run_sharded(
        run,
        (*qkv, out, lse, g_out, g_lse, *lengths, *extras),
        (q_in, k_in, v_in, q_roles, lse_roles, q_roles, lse_roles, len_q, len_k, *extra_roles),
        (
            Out(q_in),
            Out(k_in, sums=True),  # a replicated kv head's gradient: its shards' sum
            Out(v_in, sums=True),
            Out(bias_r, sums=True),
            Out(alibi_r, sums=True),
            Out(rel_r, sums=True),
        ),
        name="attention (gradient)",
        sequence_fn=_ring_backward(static, config) if has_ring else None,
    )
    cast = lambda g, x: None if g is None else like(g.astype(x.dtype), x)  # noqa: E731
    return (
        tuple(cast(g, x) for g, x in zip((dq, dk, dv), qkv, strict=True)),
        None,
        (cast(d_alibi, alibi), cast(d_bias, bias), None, cast(d_rel, rel_table)),
    )


def _backward_local(
    static: _Static,
    config,
    grads_of,
    q,
    k,
    v,
    out,
    lse,
    g_out,
    g_lse,
    len_q,
    len_k,
    alibi,
    bias,
    mask,
    rel_table,
):
    """The flash backward kernels on one shard: (dq, dk, dv, d_bias, d_alibi, d_rel).
    The Hopper kernels where `select_backward` takes the call (they cover no bias terms:
    those gradients are None), else the Triton ones."""
    backward = None if config is None else config.backward
    options = _hopper_options(static, (alibi, bias, mask, rel_table))
    masked = static.causal or static.window is not None
    tiling = select_backward(backward, q.shape, k.shape, q.dtype, masked=masked, **options)
    if tiling is not None:
        run = mosaic_backward_packed if static.packed else mosaic_backward
        dq, dk, dv = run(
            q, k, v, out, lse, g_out, g_lse, len_q, len_k, causal=static.causal,
            window=static.window, sink_tokens=static.sink_tokens, soft_cap=static.soft_cap,
            scale=static.scale, config=tiling,
        )  # fmt: skip
        return dq, dk, dv, None, None, None
    backward = (backward or FlashBackwardConfig()).resolve(
        *_max_lengths(static, q, k), q.shape[-1], q.dtype
    )
    return flash_backward(
        q,
        k,
        v,
        out,
        lse,
        g_out,
        g_lse,
        _batch(static, q, k, (len_q, len_k)),
        bias=bias,
        mask=mask,
        alibi_slopes=alibi,
        rel_table=rel_table,
        params=_params(static),
        config=backward,
        grads_of=grads_of,
        interpret=use_interpret(),
    )


_differentiable.defvjp(_differentiable_fwd, _differentiable_bwd, symbolic_zeros=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _quantized(impl, static, config, qkv, lengths, extras, out_scale):
    """The FP8-output forward. A custom VJP whose forward rule raises: differentiation
    stops with a clear message instead of a gradient through a rounding (or a lowering
    error deep in the kernel)."""
    return _forward(impl, static, config, qkv, lengths, extras, out_scale)


def _quantized_fwd(impl, static, config, *args):
    del impl, static, config, args
    raise TypeError(
        "attention with out_dtype=float8_e4m3fn is not differentiable (a quantized "
        "inference output); differentiate the out_dtype=None call and quantize its result"
    )


def _quantized_bwd(impl, static, config, residuals, cotangents):  # pragma: no cover
    raise AssertionError("unreachable: _quantized_fwd raises")


_quantized.defvjp(_quantized_fwd, _quantized_bwd)


def _empty(static: _Static, q, k):
    """No query rows or no keys (a static size of 0): zeros, and lse = -inf."""
    out = jnp.zeros(q.shape, validation.FP8_OUT if static.out_fp8 else q.dtype)
    if not static.return_lse:
        return out
    num_q_heads = q.shape[-2]
    if static.packed:
        lse_shape = (num_q_heads, q.shape[0])
    else:
        lse_shape = (q.shape[0], num_q_heads, q.shape[1])
    return out, jnp.full(lse_shape, -jnp.inf, jnp.float32)


def _run(implementation, static, config, qkv, lengths, extras, out_scale):
    validation.check_config("config", config, FlashPrefillConfig)
    q, k, _ = qkv
    token_axis = 0 if static.packed else 1
    if q.shape[token_axis] == 0 or k.shape[token_axis] == 0:
        return _empty(static, q, k)

    def run(impl):
        if static.out_fp8:
            out, lse = _quantized(impl, static, config, qkv, lengths, extras, out_scale)
        else:
            # Differentiable inputs vary alike, so that the gradient of one that does not
            # vary where the others do (slopes or a bias replicated over a shard_map's
            # axis, say) is summed over that axis.
            alike = varying_like((qkv, extras), (qkv, lengths, extras))
            out, lse = _differentiable(impl, static, config, alike[0], lengths, alike[1])
        return (out, lse) if static.return_lse else out

    return run_first(implementation, run)


def _prepare(
    q,
    k,
    v,
    *,
    packed,
    causal,
    window,
    sink_tokens,
    alibi_slopes,
    bias,
    mask,
    relative_bias,
    soft_cap,
    scale,
    return_lse,
    out_dtype,
    out_scale,
):
    validation.check_qkv(q, k, v, packed=packed)
    out_dtype, out_scale = validation.check_output(out_dtype, out_scale, q.dtype)
    num_q_heads, head_dim = q.shape[-2:]
    validation.check_options(
        num_q_heads=num_q_heads,
        window=window,
        sink_tokens=sink_tokens,
        alibi_slopes=alibi_slopes,
        relative_bias=relative_bias,
        soft_cap=soft_cap,
        scale=scale,
    )
    if packed:
        target = (1, num_q_heads, q.shape[0], k.shape[0])
    else:
        target = (q.shape[0], num_q_heads, q.shape[1], k.shape[1])
    bias = validation.broadcast_operand("bias", bias, target, boolean=False)
    mask = validation.broadcast_operand("mask", mask, target, boolean=True)
    rel_table = None if relative_bias is None else relative_bias.table.astype(jnp.float32)
    alibi = None if alibi_slopes is None else jnp.asarray(alibi_slopes, jnp.float32)
    static = _Static(
        packed=packed,
        causal=bool(causal),
        window=None if window is None else int(window),
        sink_tokens=int(sink_tokens),
        soft_cap=None if soft_cap is None else float(soft_cap),
        scale=head_dim**-0.5 if scale is None else float(scale),
        return_lse=bool(return_lse),
        rel_max_distance=0 if relative_bias is None else relative_bias.max_distance,
        rel_bidirectional=False if relative_bias is None else relative_bias.bidirectional,
        out_fp8=out_dtype == validation.FP8_OUT,
    )
    return static, (alibi, bias, mask, rel_table), out_scale


def attention(
    q: Float[Array, "B Tq Hq D"],
    k: Float[Array, "B Tk Hkv D"],
    v: Float[Array, "B Tk Hkv D"],
    *,
    causal: bool = False,
    q_lengths: Int[Array, " B"] | None = None,
    kv_lengths: Int[Array, " B"] | None = None,
    window: int | None = None,
    sink_tokens: int = 0,
    alibi_slopes: Float[Array, " Hq"] | None = None,
    bias: Float[Array, "#B #Hq #Tq #Tk"] | None = None,
    mask: Bool[Array, "#B #Hq #Tq #Tk"] | None = None,
    relative_bias: RelativeBias | None = None,
    soft_cap: float | None = None,
    scale: float | None = None,
    return_lse: bool = False,
    implementation: str | Sequence[str] | None = None,
    config: FlashPrefillConfig | None = None,
    out_dtype: DTypeLike | None = None,
    out_scale: float | Float[Array, ""] | None = None,
):
    """Attention of a padded batch (context / prefill phase; also cross attention).

    Args:
      q: `[B, Tq, Hq, D]` bf16/fp16/fp32 queries.
      k, v: `[B, Tk, Hkv, D]`, same dtype as q; `Hq % Hkv == 0` (MHA, GQA, MQA).
      causal: key j is visible to a query at position p only if `j <= p`. Queries are
        bottom-right aligned: query i of sequence b sits at `kv_len[b] - q_len[b] + i`.
      q_lengths, kv_lengths: int `[B]`, valid tokens per sequence (default: all), at most
        Tq and Tk (counts are clipped to [0, Tq] and [0, Tk]: a larger one never reads
        the next sequence's rows). Query rows at or past `q_lengths[b]` are padding and
        output zeros.
      window: sliding window W: keys `j > p - W` (the last W, the query's own included).
      sink_tokens: keys `j < sink_tokens` stay visible whatever the window (StreamingLLM).
      alibi_slopes: float `[Hq]`; adds `-slope[h] * |p - j|` (see `jaxattn.alibi_slopes`).
      bias: float, broadcastable to `[B, Hq, Tq, Tk]`; added to the scaled logits.
      mask: bool, broadcastable to `[B, Hq, Tq, Tk]`; False hides the key.
      relative_bias: implicit T5 bias `jaxattn.RelativeBias(table[Hq, num_buckets], ...)`.
      soft_cap: if set, logits become `soft_cap * tanh(logits / soft_cap)` before masking.
      scale: logit scale; default `1/sqrt(D)` (TensorRT-LLM's q_scaling: `1/(q_scaling*sqrt(D))`).
      return_lse: also return the natural log-sum-exp of each row, float32 `[B, Hq, Tq]`
        (-inf for rows with no visible key).
      implementation: "pallas", "xla", a list tried in order (a name that raises
        NotImplementedError falls through to the next), or None (pallas on GPU, else xla).
      config: a `FlashPrefillConfig` for the pallas kernels; None picks a heuristic. Its
        `backend` says which forward runs: "auto" (the Hopper kernel on sm90 when it
        covers the call: bf16/fp16, head_dim 64/128/256, lengths or none, sinks or
        none, no bias/mask/ALiBi/T5 terms, Tq a multiple of 128 and Tk of 64; else Triton),
        "triton", or "mosaic" (NotImplementedError, with the reason, where it cannot).
        `config.backward.backend` says the same of the gradient's kernels (the Hopper
        ones: the forward's coverage, Tq and Tk multiples of 128).
      out_dtype: None (q's dtype), or `jnp.float8_e4m3fn`: FP8 output, quantized in the
        kernel's epilogue from the float32 result as `clip(out * (1 / out_scale), -448,
        448)` rounded to nearest even (TensorRT-LLM's convention; dequantize with
        `out.astype(jnp.float32) * out_scale`). Not differentiable: `jax.grad` raises.
        The compiled kernels need compute capability >= 8.9 (else NotImplementedError,
        which an implementation list such as `["pallas", "xla"]` falls through).
      out_scale: float32 scalar (a Python float or a traced `[]` array, > 0), required
        with (and only with) `out_dtype=float8_e4m3fn`.

    Returns:
      out `[B, Tq, Hq, D]` in `out_dtype` (default q's); rows with no visible key are
      zeros. With `return_lse`, `(out, lse)` (lse float32 whatever `out_dtype`).

    Gradients (`jax.grad`, first order) flow to q, k, v, `bias`, `alibi_slopes` and the
    `relative_bias` table, and through the lse too. With `"pallas"` they come from the
    flash backward kernels (Hopper or Triton, as `config.backward.backend` picks) in
    memory linear in the sequence length, deterministically (the same bits on every run:
    no atomics), in the inputs' dtypes with float32 accumulation;
    rows with no visible key get zero gradient. A differentiated `bias` costs one float32
    `[B, Hq, Tq, Tk]` buffer (its gradient before the sum over broadcast axes).
    """
    static, extras, out_scale = _prepare(
        q,
        k,
        v,
        packed=False,
        causal=causal,
        window=window,
        sink_tokens=sink_tokens,
        alibi_slopes=alibi_slopes,
        bias=bias,
        mask=mask,
        relative_bias=relative_bias,
        soft_cap=soft_cap,
        scale=scale,
        return_lse=return_lse,
        out_dtype=out_dtype,
        out_scale=out_scale,
    )
    validation.check_int_vector("q_lengths", q_lengths, q.shape[0])
    validation.check_int_vector("kv_lengths", kv_lengths, q.shape[0])
    lengths = tuple(
        None if n is None else jnp.clip(n, 0, rows)
        for n, rows in ((q_lengths, q.shape[1]), (kv_lengths, k.shape[1]))
    )
    return _run(implementation, static, config, (q, k, v), lengths, extras, out_scale)


def ragged_attention(
    q: Float[Array, "Tq Hq D"],
    k: Float[Array, "Tk Hkv D"],
    v: Float[Array, "Tk Hkv D"],
    cu_seqlens_q: Int[Array, " B+1"],
    cu_seqlens_k: Int[Array, " B+1"],
    *,
    causal: bool = False,
    window: int | None = None,
    sink_tokens: int = 0,
    alibi_slopes: Float[Array, " Hq"] | None = None,
    bias: Float[Array, "#Hq #Tq #Tk"] | None = None,
    mask: Bool[Array, "#Hq #Tq #Tk"] | None = None,
    relative_bias: RelativeBias | None = None,
    soft_cap: float | None = None,
    scale: float | None = None,
    return_lse: bool = False,
    implementation: str | Sequence[str] | None = None,
    config: FlashPrefillConfig | None = None,
    out_dtype: DTypeLike | None = None,
    out_scale: float | Float[Array, ""] | None = None,
):
    """Attention over packed (varlen) sequences, FlashAttention's `cu_seqlens` layout.

    Args:
      q: `[Tq_total, Hq, D]`; sequence b owns rows `cu_seqlens_q[b]:cu_seqlens_q[b+1]`.
        `Tq_total` is a static bucket: rows past `cu_seqlens_q[-1]` are padding (zeros).
      k, v: `[Tk_total, Hkv, D]`; sequence b owns rows `cu_seqlens_k[b]:cu_seqlens_k[b+1]`.
      cu_seqlens_q, cu_seqlens_k: int32 `[B+1]`, non-decreasing, starting at 0 (static B).
        Query and key counts may differ per sequence (chunked context, cross attention);
        queries are bottom-right aligned within their sequence as in `attention`.
      bias, mask: broadcastable to `[Hq, Tq_total, Tk_total]`, in packed coordinates.
      Other options (`out_dtype` / `out_scale` for an FP8 output included): as `attention`.

    Returns:
      out `[Tq_total, Hq, D]` in `out_dtype` (default q's); with `return_lse`, also lse
      float32 `[Hq, Tq_total]`.

    Gradients: as `attention` (flash backward kernels with `"pallas"`); nothing flows
    between sequences, and the padding rows past `cu_seqlens_q[-1]` / `cu_seqlens_k[-1]`
    get exact zeros.
    """
    validation.check_qkv(q, k, v, packed=True)
    if cu_seqlens_q.ndim != 1 or cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(
            f"{cu_seqlens_q.shape=} and {cu_seqlens_k.shape=}: expected equal shapes [B+1]"
        )
    num_seqs = cu_seqlens_q.shape[0] - 1
    if num_seqs < 1:
        raise ValueError(f"{cu_seqlens_q.shape=}: expected [B+1] with B >= 1")
    validation.check_int_vector("cu_seqlens_q", cu_seqlens_q, num_seqs + 1)
    validation.check_int_vector("cu_seqlens_k", cu_seqlens_k, num_seqs + 1)
    static, extras, out_scale = _prepare(
        q,
        k,
        v,
        packed=True,
        causal=causal,
        window=window,
        sink_tokens=sink_tokens,
        alibi_slopes=alibi_slopes,
        bias=bias,
        mask=mask,
        relative_bias=relative_bias,
        soft_cap=soft_cap,
        scale=scale,
        return_lse=return_lse,
        out_dtype=out_dtype,
        out_scale=out_scale,
    )
    lengths = (cu_seqlens_q, cu_seqlens_k)
    return _run(implementation, static, config, (q, k, v), lengths, extras, out_scale)
