"""Attention sinks (`sink_tokens` with a `window`) on the Hopper (Mosaic GPU) kernels.

A query at position p sees key j when j > p - window or j is one of its sequence's first
`sink_tokens` keys (and causal, lengths and packing allow). The forward and the dQ
kernel load the sink blocks below the window's blocks as extra ring steps
(`common.key_ring`); the dK/dV kernel's key tiles holding sinks walk every later query
block (`backward.query_block_range`).

On CPU (the walks against brute force are in `test_mosaic.py` and
`test_mosaic_backward.py`): the kernels lower for CUDA with sinks; `jaxattn.attention`
passes them to the Hopper kernels. On an sm90 GPU: dense, lengths (NaN padding) and packed
batches, forward and backward, against the float64 oracles, and `jaxattn.attention`
taking both kernels.
"""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import test_mosaic_lengths as lengths_tests
import test_mosaic_packed as packed_tests
import util
from grad_oracle import attention_grad_oracle, ragged_attention_grad_oracle
from oracle import attention_oracle, ragged_attention_oracle
from test_grad_kernels import assert_qkv_grads_close
from test_mosaic import hopper_only

import jaxattn
from pallas_kernels.mosaic import (
    mosaic_backward,
    mosaic_backward_packed,
    mosaic_forward,
    mosaic_forward_packed,
)

attention_module = importlib.import_module("jaxattn.attention")
LOWP = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}

# (B, Tq, Tk, Hq, Hkv, D, causal, window, sink_tokens, soft_cap)
DENSE = [
    (1, 512, 512, 4, 2, 128, True, 100, 4, None),  # one sink block below the window's
    (1, 1024, 1024, 4, 2, 64, True, 64, 130, None),  # sinks over two key blocks
    (1, 512, 768, 4, 1, 128, False, 150, 16, 30.0),  # window alone, Tq < Tk
    (1, 768, 512, 4, 2, 128, True, 80, 200, None),  # Tq > Tk: rows that see no key
    (2, 512, 512, 8, 2, 128, True, 256, 1, None),
    (1, 512, 512, 4, 2, 256, True, 100, 8, None),  # D256
]


def _opts(window, sinks, cap, d, causal):
    return dict(causal=causal, window=window, sink_tokens=sinks, soft_cap=cap, scale=d**-0.5)


def _dense_opts(case):
    *_, d, causal, window, sinks, cap = case
    return _opts(window, sinks, cap, d, causal)


# ------------------------------------------------------------------ lowering (CPU)


@pytest.mark.parametrize("case", [DENSE[0]], ids=lambda c: f"D{c[5]}-causal{c[6]}")
def test_kernels_lower_for_cuda_with_sinks(case):
    b, tq, tk, hq, hkv, d, *_ = case
    q = jax.ShapeDtypeStruct((b, tq, hq, d), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((b, tk, hkv, d), jnp.bfloat16)
    lse = jax.ShapeDtypeStruct((b, hq, tq), jnp.float32)
    opts = _dense_opts(case)
    cuda = dict(lowering_platforms=("cuda",))
    fwd = jax.jit(functools.partial(mosaic_forward, **opts)).trace(q, k, k).lower(**cuda)
    bwd = jax.jit(functools.partial(mosaic_backward, **opts))
    assert "mosaic_gpu" in fwd.as_text()
    assert bwd.trace(q, k, k, q, lse, q, lse).lower(**cuda).as_text().count("mosaic_gpu") >= 2


def test_attention_passes_sinks_to_the_hopper_kernels(monkeypatch):
    """On any device: with the Hopper kernels selected, `jaxattn.attention` hands them its
    `sink_tokens` (forward and backward)."""
    seen = {}

    def fake(name, result):
        def run(*args, **kw):
            seen[name] = kw["sink_tokens"]
            return result(*args)

        return run

    def forward(q, k, v, *_):
        return q, jnp.zeros((q.shape[0], q.shape[2], q.shape[1]), jnp.float32)

    def backward(q, k, v, *_):
        return q, k, v

    monkeypatch.setattr(attention_module, "forward_backend", lambda *a, **k: ("mosaic", None))
    monkeypatch.setattr(attention_module, "select_backward", lambda *a, **k: object())
    monkeypatch.setattr(attention_module, "mosaic_forward", fake("forward", forward))
    monkeypatch.setattr(attention_module, "mosaic_backward", fake("backward", backward))
    rng = util.rng_for("sinks wiring")
    q, k, v = (util.randn(rng, (1, 128, 2, 64)) for _ in range(3))

    def loss(q, k, v):
        out = jaxattn.attention(q, k, v, causal=True, window=32, sink_tokens=6,
                                implementation="pallas")  # fmt: skip
        return jnp.sum(out)

    jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    assert seen == {"forward": 6, "backward": 6}


# ------------------------------------------------------------------ the kernels (sm90)


def _dense_inputs(case, dtype):
    b, tq, tk, hq, hkv, d, *_ = case
    rng = util.rng_for("mosaic sinks", case, dtype)
    q, g_out = (util.randn(rng, (b, tq, hq, d), dtype) for _ in range(2))
    k, v = (util.randn(rng, (b, tk, hkv, d), dtype) for _ in range(2))
    return q, k, v, g_out, util.randn(rng, (b, hq, tq), "float32")


def _check_out(out, lse, want, want_lse, lowp_ref, dtype, keyless):
    util.assert_out_close(out, want, dtype, lowp_ref=lowp_ref)
    util.assert_lse_close(lse, want_lse, dtype)
    util.assert_zero_rows(out, keyless, "keyless rows")


@hopper_only
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("case", DENSE, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.every_case
def test_dense_forward_and_backward_match_oracle(case, dtype):
    opts = _dense_opts(case)
    q, k, v, g_out, g_lse = _dense_inputs(case, dtype)
    out, lse = jax.jit(functools.partial(mosaic_forward, **opts))(q, k, v)
    args = [util.f64(x) for x in (q, k, v)]
    want, want_lse = attention_oracle(*args, **opts)
    lowp_ref, _ = attention_oracle(*args, **opts, lowp=LOWP[dtype])
    keyless = np.isneginf(want_lse).transpose(0, 2, 1)[..., None]
    _check_out(out, lse, want, want_lse, lowp_ref, dtype, keyless)
    grads = jax.jit(functools.partial(mosaic_backward, **opts))(q, k, v, out, lse, g_out, g_lse)
    args = [util.f64(x) for x in (q, k, v, g_out, g_lse)]
    want = attention_grad_oracle(*args, **opts)
    plain = attention_grad_oracle(*args, lowp=LOWP[dtype], **opts)
    assert_qkv_grads_close(grads, want, plain, dtype)


# (lengths_tests' case: Tq, Tk, Hq, Hkv, D, causal, window, soft_cap, q_lengths, kv_lengths)
LENGTHS = [
    ((512, 512, 4, 2, 128, True, 100, 30.0, (450, 130), (500, 130)), 4),
    ((512, 512, 4, 2, 128, True, 100, None, (300, 512), (300, 512)), 150),
    ((256, 384, 4, 4, 64, False, 70, None, (200, 256), (384, 130)), 9),
]


@hopper_only
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("case, sinks", LENGTHS, ids=lambda c: str(c))
@pytest.mark.every_case
def test_lengths_match_oracle(case, sinks, dtype):
    """q/kv lengths with NaN in every padding row and key (and in the residuals' padding
    rows for the backward): the sinks are each sequence's first keys."""
    tq, tk, hq, hkv, d, causal, window, cap, *_ = case
    opts = _opts(window, sinks, cap, d, causal)
    clean, bad, lengths = lengths_tests._inputs(case, dtype)
    q, k, v, g_out, g_lse = bad
    out, lse = jax.jit(functools.partial(mosaic_forward, **opts))(q, k, v, *lengths)
    kw = dict(opts, q_lengths=np.asarray(lengths[0]), kv_lengths=np.asarray(lengths[1]))
    args = [util.f64(x) for x in clean[:3]]
    want, want_lse = attention_oracle(*args, **kw)
    lowp_ref, _ = attention_oracle(*args, **kw, lowp=LOWP[dtype])
    keyless = np.isneginf(want_lse).transpose(0, 2, 1)[..., None]
    _check_out(out, lse, want, want_lse, lowp_ref, dtype, keyless)
    q_pad = jnp.arange(tq)[None, :] >= lengths[0][:, None]  # [B, Tq]
    out = jnp.where(q_pad[:, :, None, None], jnp.nan, out).astype(out.dtype)
    lse = jnp.where(q_pad[:, None, :], jnp.nan, lse)
    fn = jax.jit(functools.partial(mosaic_backward, **opts))
    grads = fn(q, k, v, out, lse, g_out, g_lse, *lengths)
    args = [util.f64(x) for x in clean]
    want = attention_grad_oracle(*args, **kw)
    plain = attention_grad_oracle(*args, lowp=LOWP[dtype], **kw)
    assert_qkv_grads_close(grads, want, plain, dtype)


# (packed_tests' case: Tq, Tk, Hq, Hkv, D, causal, window, soft_cap, q_lens, kv_lens)
PACKED = [
    ((640, 640, 8, 2, 128, True, 60, None, (100, 200, 1, 255), (100, 200, 1, 255)), 5),
    ((520, 520, 4, 2, 128, True, 50, None, (3, 130, 1, 127, 128, 9), (5, 121, 2, 7, 256, 9)), 3),
    ((640, 1024, 4, 4, 64, False, 90, 20.0, (300, 0, 129, 128), (500, 77, 129, 200)), 40),
]


@hopper_only
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("case, sinks", PACKED, ids=lambda c: str(c))
@pytest.mark.every_case
def test_packed_match_oracle(case, sinks, dtype):
    """Packed sequences from unaligned starts: each one's sinks are its own first keys
    (not the array's); NaN past the last sequence."""
    tq, tk, hq, hkv, d, causal, window, cap, *_ = case
    opts = _opts(window, sinks, cap, d, causal)
    clean, bad, cu = packed_tests._grad_inputs(case, dtype)
    q, k, v, g_out, g_lse = bad
    out, lse = jax.jit(functools.partial(mosaic_forward_packed, **opts))(q, k, v, *cu)
    args = [util.f64(x) for x in clean[:3]]
    want, want_lse = ragged_attention_oracle(*args, *cu, **opts)
    lowp_ref, _ = ragged_attention_oracle(*args, *cu, **opts, lowp=LOWP[dtype])
    _check_out(out, lse, want, want_lse, lowp_ref, dtype, np.isneginf(want_lse).T[..., None])
    fn = jax.jit(functools.partial(mosaic_backward_packed, **opts))
    grads = fn(q, k, v, out, lse, g_out, g_lse, *cu)
    args = [util.f64(x) for x in clean]
    want = ragged_attention_grad_oracle(*args[:3], *cu, *args[3:], **opts)
    plain = ragged_attention_grad_oracle(*args[:3], *cu, *args[3:], lowp=LOWP[dtype], **opts)
    assert_qkv_grads_close(grads, want, plain, dtype)


@hopper_only
def test_attention_with_sinks_takes_the_hopper_kernels(monkeypatch):
    """`jaxattn.attention(..., window, sink_tokens)` with `"pallas"` runs both Hopper
    kernels; its gradient matches the XLA reference's."""
    case = DENSE[0]
    q, k, v, g, _ = _dense_inputs(case, "bfloat16")
    calls = util.spy_calls(monkeypatch, attention_module, ("mosaic_forward", "mosaic_backward"))
    opts = _dense_opts(case)

    def attend(impl):
        return functools.partial(jaxattn.attention, implementation=impl, **opts)

    got = util.weighted_grads(attend("pallas"), (q, k, v), g)
    assert calls == ["mosaic_forward", "mosaic_backward"]
    util.assert_grads_near(got, util.weighted_grads(attend("xla"), (q, k, v), g), 0.05)
