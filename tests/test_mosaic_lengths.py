"""q/kv lengths on the Hopper (Mosaic GPU) kernels: padded batches, forward and backward.

Sequence b's real queries are its first `q_lengths[b]` rows and its keys the first
`kv_lengths[b]`; its query row r sits at position `r + kv_lengths[b] - q_lengths[b]`.
Padding is poisoned with NaN (q, k, v, out's cotangent and lse's) and must not leak:
padding rows output zeros and lse -inf, padding rows and keys get exactly zero gradients.

On CPU: every consumer warpgroup walks exactly the ring steps its producer loads (the
barrier protocol's invariant, which an empty range below the other consumer's broke), and
both kernels trace and lower for CUDA with lengths. On an sm90 GPU: the forward
against the float64 oracle, the backward against the float64 analytic gradients
(`grad_oracle.py`), and `jaxattn.attention` with lengths through the automatic choice.
"""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import util
from grad_oracle import attention_grad_oracle
from oracle import attention_oracle
from test_grad_kernels import assert_qkv_grads_close
from test_mosaic import hopper_only

import jaxattn
from pallas_kernels.mosaic import mosaic_backward, mosaic_forward
from pallas_kernels.mosaic.backward import query_block_range
from pallas_kernels.mosaic.common import ring_steps, sequence_of, within
from pallas_kernels.mosaic.forward import key_blocks

attention_module = importlib.import_module("jaxattn.attention")
LOWP = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}

# (Tq, Tk, Hq, Hkv, D, causal, window, soft_cap, q_lengths, kv_lengths); B = len(q_lengths)
CASES = [
    (512, 512, 8, 2, 128, True, None, None, (512, 300, 1), (512, 300, 77)),
    (256, 384, 4, 4, 64, False, None, None, (200, 256), (384, 130)),
    (512, 512, 4, 2, 128, True, 100, 30.0, (450, 130), (500, 130)),
    (256, 256, 4, 2, 128, True, None, None, (256, 200), (100, 200)),  # q_len > kv_len
    (256, 256, 4, 1, 64, False, 64, None, (0, 256), (256, 0)),  # no rows; no keys
    (256, 512, 4, 2, 128, False, None, 5.0, (129, 127), (511, 1)),  # block edges
    # A tile whose second consumer holds only padding while the window lifts the first's
    # lowest block above 0 (the ring walk `within` keeps in step).
    (512, 512, 4, 2, 128, True, 100, None, (300, 512), (300, 512)),
    (256, 256, 4, 2, 256, True, None, None, (200, 256), (230, 97)),  # D256
]


def _inputs(case, dtype, poison_kind="nan"):
    """(clean inputs, poisoned inputs, lengths): q, k, v, g_out, g_lse; the poisoned copies
    hold NaN (or a huge finite value: `poison_kind`) in every padding row and key."""
    tq, tk, hq, hkv, d, *_, q_lengths, kv_lengths = case
    b = len(q_lengths)
    rng = util.rng_for("mosaic lengths", case, dtype)
    q = util.randn(rng, (b, tq, hq, d), dtype)
    k, v = (util.randn(rng, (b, tk, hkv, d), dtype) for _ in range(2))
    g_out = util.randn(rng, (b, tq, hq, d), dtype)
    g_lse = util.randn(rng, (b, hq, tq), "float32")
    q_len, kv_len = (jnp.array(x, jnp.int32) for x in (q_lengths, kv_lengths))
    q_pad = jnp.arange(tq)[None, :] >= q_len[:, None]  # [B, Tq]
    k_pad = jnp.arange(tk)[None, :] >= kv_len[:, None]

    value = util.poison_value(dtype, poison_kind)

    def poison(x, pad):
        return jnp.where(pad.reshape(pad.shape + (1,) * (x.ndim - 2)), value, x).astype(x.dtype)

    clean = (q, k, v, g_out, g_lse)
    bad = (poison(q, q_pad), poison(k, k_pad), poison(v, k_pad), poison(g_out, q_pad),
           jnp.where(q_pad[:, None, :], value, g_lse))  # fmt: skip
    return clean, bad, (q_len, kv_len)


def _opts(case):
    *_, d, causal, window, cap, _, _ = case
    return dict(causal=causal, window=window, soft_cap=cap, scale=d**-0.5)


# ------------------------------------------------------------------ ring walks (CPU)

WALK_LENGTHS = [None, (300, 300), (130, 130), (1, 77), (0, 200), (200, 0), (257, 511), (511, 3)]


def _walk_ok(raw, lo, hi):
    """A consumer's range after `within`: inside the producer's `[lo, hi)` in walk order
    (pass over, compute, pass over: every step exactly once), and unchanged if it held a
    block. Returns whether `within` had to move it."""
    my_lo, my_hi, full_lo, full_hi = (int(x) for x in within(raw, lo, hi))
    assert lo <= my_lo <= full_lo <= full_hi <= my_hi <= hi, (raw, lo, hi)
    raw = [int(x) for x in raw]
    if raw[0] < raw[1]:
        assert [my_lo, my_hi] == raw[:2], (raw, lo, hi)
    return not raw[0] >= lo


def _walks(tq, tk, causal, window, lengths, block):
    """Per tile, `blocks_of(consumer)` as the kernels build it: the key-block ranges of the
    forward / dQ consumers (`key_blocks`, 64 rows each, tiles of 128 rows) and the
    query-block ranges of the dK/dV consumers (64 keys each)."""
    q_len, kv_len = (jnp.int32(x) for x in (lengths or (tq, tk)))
    offset = kv_len - q_len
    limit = None if lengths is None else kv_len
    extra = {} if lengths is None else dict(q_len=q_len, kv_len=kv_len)
    walks = []
    for tile in range(tq // 128):
        walks.append(lambda c, tile=tile: key_blocks(
            jnp.int32(tile * 128 + c * 64), 64, q_len=q_len, offset=offset, kv_len=limit,
            causal=causal, window=window, num_blocks=tk // block, block_kv=block,
        ))  # fmt: skip
    for tile in range(tk // 128):
        walks.append(lambda c, tile=tile: query_block_range(
            jnp.int32(tile * 128 + c * 64), jnp.int32(tile * 128 + c * 64 + 63), causal=causal,
            window=window, offset=offset, num_blocks=tq // block, block_q=block, **extra,
        ))  # fmt: skip
    return walks


@pytest.mark.parametrize("causal, window", [(True, None), (True, 100), (False, 64), (False, None)])
def test_consumers_walk_exactly_the_producers_steps(causal, window):
    moved = 0
    for tq, tk in ((512, 512), (256, 640), (640, 256)):
        for lengths in WALK_LENGTHS:
            if lengths is not None:
                lengths = (min(lengths[0], tq), min(lengths[1], tk))
            elif not causal and window is None:
                continue
            for block in (64, 128):
                for blocks_of in _walks(tq, tk, causal, window, lengths, block):
                    lo, hi = (int(x) for x in ring_steps(blocks_of))
                    moved += _walk_ok(blocks_of(0), lo, hi) + _walk_ok(blocks_of(1), lo, hi)
    if causal:  # the case that crashed the dK/dV kernel: the check is not vacuous
        assert moved > 0


def test_lengths_past_the_arrays_mask_no_key_past_them():
    """A key count past Tk places the rows (offset) but its key limit stops at Tk: a last
    key block running past Tk reads zeros there, which must stay masked."""
    lengths = jnp.asarray([[3, 200], [900, 150]], jnp.int32)  # [q_lengths; kv_lengths]
    long, short = (sequence_of(lengths, b, 256, 320) for b in (0, 1))
    assert (int(long.kv_len), int(long.offset), int(long.kv_limit)) == (900, 897, 320)
    assert (int(short.kv_len), int(short.offset), int(short.kv_limit)) == (150, -50, 150)


# ------------------------------------------------------------------ lowering (CPU)


@pytest.mark.parametrize("case", [CASES[0], CASES[1], CASES[2]], ids=lambda c: f"D{c[4]}")
def test_kernels_lower_for_cuda_with_lengths(case):
    tq, tk, hq, hkv, d, *_, q_lengths, _ = case
    b = len(q_lengths)
    q = jax.ShapeDtypeStruct((b, tq, hq, d), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((b, tk, hkv, d), jnp.bfloat16)
    lse = jax.ShapeDtypeStruct((b, hq, tq), jnp.float32)
    lengths = jax.ShapeDtypeStruct((b,), jnp.int32)
    fwd = functools.partial(mosaic_forward, **_opts(case))
    bwd = functools.partial(mosaic_backward, **_opts(case))
    for fn, args in ((fwd, (q, k, k, lengths, lengths)),
                     (bwd, (q, k, k, q, lse, q, lse, lengths, lengths))):  # fmt: skip
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text


# ------------------------------------------------------------------ the kernels (sm90)


@hopper_only
@pytest.mark.parametrize("poison", ["nan", "huge"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.every_case
def test_forward_with_lengths_matches_oracle(case, dtype, poison):
    """NaN padding rows of q die with their own rows; huge finite ones would see keys and
    get a finite lse: both must end as zeros and -inf."""
    clean, bad, lengths = _inputs(case, dtype, poison)
    out, lse = jax.jit(functools.partial(mosaic_forward, **_opts(case)))(*bad[:3], *lengths)
    args = [util.f64(x) for x in clean[:3]]
    kw = dict(_opts(case), q_lengths=np.asarray(lengths[0]), kv_lengths=np.asarray(lengths[1]))
    want, want_lse = attention_oracle(*args, **kw)
    lowp_ref, _ = attention_oracle(*args, **kw, lowp=LOWP[dtype])
    util.assert_out_close(out, want, dtype, lowp_ref=lowp_ref)
    util.assert_lse_close(lse, want_lse, dtype)
    util.assert_zero_rows(out, np.isneginf(want_lse).transpose(0, 2, 1)[..., None], "keyless rows")


def _check_grads(case, dtype, grads, clean, lengths):
    kw = dict(_opts(case), q_lengths=np.asarray(lengths[0]), kv_lengths=np.asarray(lengths[1]))
    args = [None if x is None else util.f64(x) for x in clean]
    want = attention_grad_oracle(*args, **kw)
    plain = attention_grad_oracle(*args, lowp=LOWP[dtype], **kw)
    assert_qkv_grads_close(grads, want, plain, dtype, " (padding poisoned with NaN)")


@hopper_only
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.every_case
def test_backward_with_lengths_matches_oracle(case, dtype):
    """dq, dk, dv with an lse cotangent, on the forward's residuals with their padding rows
    poisoned too (NaN out, NaN lse): the backward must not trust them."""
    clean, bad, lengths = _inputs(case, dtype)
    q, k, v, g_out, g_lse = bad
    out, lse = mosaic_forward(q, k, v, *lengths, **_opts(case))
    q_pad = jnp.arange(q.shape[1])[None, :] >= lengths[0][:, None]  # [B, Tq]
    out = jnp.where(q_pad[:, :, None, None], jnp.nan, out).astype(out.dtype)
    lse = jnp.where(q_pad[:, None, :], jnp.nan, lse)
    fn = jax.jit(functools.partial(mosaic_backward, **_opts(case)))
    grads = fn(q, k, v, out, lse, g_out, g_lse, *lengths)
    _check_grads(case, dtype, grads, clean, lengths)
    again = fn(q, k, v, out, lse, g_out, g_lse, *lengths)
    for name, g, h in zip("qkv", grads, again, strict=True):
        np.testing.assert_array_equal(util.bits(g), util.bits(h), err_msg=f"d{name}")


@hopper_only
def test_attention_with_lengths_takes_the_hopper_kernels(monkeypatch):
    """`jaxattn.attention(..., q_lengths, kv_lengths)`: the automatic choice runs both
    Hopper kernels, with the lengths, and its gradient matches the oracle."""
    case = CASES[2]
    clean, bad, lengths = _inputs(case, "bfloat16")
    q, k, v, g_out, _ = bad
    calls = util.spy_calls(monkeypatch, attention_module, ("mosaic_forward", "mosaic_backward"))
    q_len, kv_len = lengths
    pad = (jnp.arange(q.shape[1])[None, :] >= q_len[:, None])[:, :, None, None]

    def loss(q, k, v):
        out = jaxattn.attention(q, k, v, q_lengths=q_len, kv_lengths=kv_len,
                                implementation="pallas", **_opts(case))  # fmt: skip
        # g_out's padding rows are NaN, so out's cotangent there is 0 * NaN = NaN: it must
        # not reach any gradient.
        product = out.astype(jnp.float32) * g_out.astype(jnp.float32)
        return jnp.sum(jnp.where(pad, 0.0, product))

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    assert calls == ["mosaic_forward", "mosaic_backward"]
    clean = (*clean[:4], None)
    _check_grads(case, "bfloat16", grads, clean, lengths)
