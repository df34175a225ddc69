"""The Hopper (Mosaic GPU) backward: which gradients it takes, and what it computes.

On CPU: the selection logic (`select_backward` against stand-in devices, and that
`jaxattn.attention`'s gradient calls the Hopper kernels exactly when it selects them), the
query-block ranges the dK/dV kernel walks (against brute-force visibility), config
validation, and that both kernels trace and lower for CUDA. On an sm90 GPU: dq, dk, dv
(with an lse cotangent) against the float64 analytic backward (`grad_oracle.py`) over the
option combinations and both tilings, and `jaxattn.attention`'s gradient through the
automatic choice against the Triton kernels' and the oracle.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import util
from grad_oracle import attention_grad_oracle
from test_grad_kernels import assert_qkv_grads_close
from test_mosaic import AMPERE, CPU, HOPPER, assert_range_matches, hopper_only

import jaxattn
from pallas_kernels.mosaic import (
    MosaicBackwardConfig,
    backward_unsupported,
    mosaic_backward,
    mosaic_forward,
    select_backward,
)
from pallas_kernels.mosaic.backward import query_block_range

attention_module = importlib.import_module("jaxattn.attention")  # (`jaxattn.attention` is
# also the function, which the package's attribute names)
Q_SHAPE, K_SHAPE = (2, 512, 8, 128), (2, 512, 2, 128)


def _select(config=None, q_shape=Q_SHAPE, k_shape=K_SHAPE, dtype=jnp.bfloat16, device=HOPPER,
            masked=True, **features):  # fmt: skip
    return select_backward(config, q_shape, k_shape, dtype, masked=masked, device=device,
                           **features)  # fmt: skip


# ------------------------------------------------------------------ selection (CPU)


def test_auto_takes_mosaic_on_hopper_only():
    assert _select() == MosaicBackwardConfig.heuristic(True)
    assert _select(masked=False) == MosaicBackwardConfig(block_kv_dq=128)
    assert _select(jaxattn.FlashBackwardConfig()) is not None
    assert _select(device=AMPERE) is None
    assert _select(device=CPU) is None
    assert _select(jaxattn.FlashBackwardConfig(backend="triton")) is None
    tiling = MosaicBackwardConfig(block_kv_dq=128, num_stages=3)
    assert _select(jaxattn.FlashBackwardConfig(mosaic=tiling), q_shape=(1, 256, 4, 64),
                   k_shape=(1, 256, 4, 64)) == tiling  # fmt: skip


@pytest.mark.parametrize(
    "change, reason",
    [
        (dict(packed=True), "packed"),
        (dict(terms=True), "ALiBi"),
        (dict(dtype=jnp.float32), "float32"),
        (dict(q_shape=(2, 512, 8, 96), k_shape=(2, 512, 2, 96)), "head_dim 96"),
        (dict(q_shape=(2, 448, 8, 128)), "Tq=448"),
        (dict(k_shape=(2, 576, 2, 128)), "Tk=576"),
        (
            dict(
                config=jaxattn.FlashBackwardConfig(
                    mosaic=MosaicBackwardConfig(block_kv_dq=128, num_stages=3)
                )
            ),
            "shared memory",
        ),
    ],
)
@pytest.mark.every_case
def test_uncovered_calls_fall_back_or_raise(change, reason):
    config = change.pop("config", jaxattn.FlashBackwardConfig())
    assert _select(config, **change) is None
    forced = jaxattn.FlashBackwardConfig(backend="mosaic", mosaic=config.mosaic)
    with pytest.raises(NotImplementedError, match=reason):
        _select(forced, **change)


def test_forced_mosaic_names_the_device():
    with pytest.raises(NotImplementedError, match="compute capability 9"):
        _select(jaxattn.FlashBackwardConfig(backend="mosaic"), device=AMPERE)


def test_config_validation():
    with pytest.raises(ValueError, match="backend"):
        jaxattn.FlashBackwardConfig(backend="cudnn")
    for bad in (dict(block_kv_dq=32), dict(block_kv_dq=256), dict(num_stages=1),
                dict(num_stages=4)):  # fmt: skip
        with pytest.raises(ValueError, match=next(iter(bad))):
            MosaicBackwardConfig(**bad)
    assert MosaicBackwardConfig(block_kv_dq=128, num_stages=2).fits(128)
    assert MosaicBackwardConfig(block_kv_dq=64, num_stages=2).fits(256)  # one dQ slot
    assert MosaicBackwardConfig(block_kv_dq=64, num_stages=2).dq_stages(256) == 1
    assert not MosaicBackwardConfig(block_kv_dq=128, num_stages=2).fits(256)
    assert MosaicBackwardConfig.heuristic(False, 256) == MosaicBackwardConfig(64, 2)
    assert (
        backward_unsupported(Q_SHAPE, K_SHAPE, jnp.float16, config=MosaicBackwardConfig()) is None
    )


@pytest.mark.parametrize("selected", [True, False])
@pytest.mark.parametrize("with_lse, with_lengths", [(False, False), (True, False), (False, True)])
def test_attention_gradient_calls_the_selected_kernels(monkeypatch, selected, with_lse,
                                                       with_lengths):  # fmt: skip
    """On any device: `jaxattn.attention`'s gradient runs `mosaic_backward` (with the
    call's options and lengths, the lse cotangent where the loss uses the lse, and the
    selected tiling) exactly when `select_backward` takes it."""
    tiling = MosaicBackwardConfig(block_kv_dq=128)
    seen = {}

    def fake_select(config, q_shape, k_shape, dtype, *, masked, **features):
        seen["select"] = dict(masked=masked, **features)
        return tiling if selected else None

    def fake_backward(q, k, v, out, lse, g_out, g_lse, q_lengths, kv_lengths, **kw):
        seen["backward"] = kw
        seen["g_lse"] = None if g_lse is None else np.asarray(g_lse)
        seen["lengths"] = [None if x is None else np.asarray(x) for x in (q_lengths, kv_lengths)]
        return tuple(jnp.full_like(x, 7) for x in (q, k, v))

    monkeypatch.setattr(attention_module, "select_backward", fake_select)
    monkeypatch.setattr(attention_module, "mosaic_backward", fake_backward)
    rng = util.rng_for("backward wiring", selected, with_lse)
    q, k, v = (util.randn(rng, (1, 128, 2, 32)) for _ in range(3))
    lengths = dict(q_lengths=jnp.array([100]), kv_lengths=jnp.array([120])) if with_lengths else {}

    def loss(q, k, v):
        out, lse = jaxattn.attention(q, k, v, causal=True, window=40, sink_tokens=3,
                                     soft_cap=20.0, scale=0.3, return_lse=True,
                                     implementation="pallas", **lengths)  # fmt: skip
        return jnp.sum(out) + (3.0 * jnp.sum(lse) if with_lse else 0.0)

    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    assert seen["select"] == dict(masked=True, packed=False, terms=False)
    if selected:
        assert seen["backward"] == dict(causal=True, window=40, sink_tokens=3, soft_cap=20.0,
                                        scale=0.3, config=tiling)  # fmt: skip
        if with_lengths:
            assert [x.tolist() for x in seen["lengths"]] == [[100], [120]]
        else:
            assert seen["lengths"] == [None, None]
        if with_lse:
            assert seen["g_lse"].shape == (1, 2, 128) and (seen["g_lse"] == 3.0).all()
        else:
            assert seen["g_lse"] is None or not seen["g_lse"].any()
        assert all((np.asarray(g) == 7).all() for g in grads)
    else:
        assert "backward" not in seen
        assert not any((np.asarray(g) == 7).all() for g in grads)


@pytest.mark.parametrize("selected", [True, False])
def test_ring_block_gradient_calls_the_selected_kernels(monkeypatch, selected):
    """Ring attention's per-block backward: `mosaic_backward` (causal, scale, tiling; no
    lse cotangent) exactly when `select_backward` takes the block, float32 shares out."""
    ring = importlib.import_module("jaxattn.parallel.ring")
    tiling = MosaicBackwardConfig()
    seen = {}

    def fake_select(config, q_shape, k_shape, dtype, *, masked, **features):
        seen["select"] = dict(masked=masked, **features)
        return tiling if selected else None

    def fake_backward(q, k, v, out, lse, g_out, *rest, **kw):
        seen["backward"] = (rest, kw)
        return tuple(jnp.full_like(x, 7) for x in (q, k, v))

    monkeypatch.setattr(ring, "select_backward", fake_select)
    monkeypatch.setattr(ring, "mosaic_backward", fake_backward)
    rng = util.rng_for("ring backward wiring", selected)
    q, k, v, g = (util.randn(rng, (1, 64, 2, 32)) for _ in range(4))
    out, lse = jaxattn.attention_reference(q, k, v, causal=True, scale=0.2, return_lse=True)
    static = ring._Ring("x", True, 0.2, "contiguous", "pallas", None)
    grads = ring._attend_backward(static, q, k, v, out, lse, g, True)
    assert seen["select"] == dict(masked=True)
    assert all(x.dtype == jnp.float32 for x in grads)
    if selected:
        assert seen["backward"] == ((), dict(causal=True, scale=0.2, config=tiling))
        assert all((np.asarray(x) == 7).all() for x in grads)
    else:
        assert "backward" not in seen


# ------------------------------------------------------------------ skipped blocks (CPU)


@pytest.mark.parametrize("causal, window", [(True, None), (False, 37), (True, 37), (True, 300)])
@pytest.mark.parametrize(
    "offset, lengths", [(0, None), (24, None), (-40, None), (None, (100, 124)), (None, (150, 97))]
)
@pytest.mark.parametrize("sink_tokens", [0, 5, 20])
def test_query_block_range_matches_visibility(causal, window, offset, lengths, sink_tokens):
    """As the forward's key-block ranges (`test_mosaic.py`), for the dK/dV kernel's query
    blocks; with lengths (q_len, kv_len) rows past q_len and keys past kv_len see
    nothing, and row r sits at position r + kv_len - q_len; with a window the first
    `sink_tokens` keys are seen by every row at or past them."""
    block, num_blocks = 16, 10
    rows = np.arange(block * num_blocks)
    q_len, kv_len = lengths or (None, None)
    if lengths:
        offset = kv_len - q_len
    pos = rows[:, None] + offset
    for first in range(0, block * num_blocks + 40, 3):
        for count in (1, 16, 64):
            keys = np.arange(first, first + count)[None, :]
            visible = np.ones((rows.size, count), bool)
            if causal:
                visible &= keys <= pos
            if window is not None:
                visible &= (keys > pos - window) | (keys < sink_tokens)
            if lengths:
                visible &= (rows[:, None] < q_len) & (keys < kv_len)
            per_block = visible.reshape(num_blocks, block, count)
            any_seen = np.flatnonzero(per_block.any(axis=(1, 2)))
            all_seen = per_block.all(axis=(1, 2))
            extra = dict(q_len=jnp.int32(q_len), kv_len=jnp.int32(kv_len)) if lengths else {}
            lo, hi, full_lo, full_hi = (
                int(x)
                for x in query_block_range(
                    jnp.int32(first),
                    jnp.int32(first + count - 1),
                    causal=causal,
                    window=window,
                    offset=jnp.int32(offset),
                    num_blocks=num_blocks,
                    block_q=block,
                    sink_tokens=sink_tokens,
                    **extra,
                )  # fmt: skip
            )
            where = f"keys {first}..{first + count - 1}"
            assert_range_matches((lo, hi, full_lo, full_hi), any_seen, all_seen, where)


PACKED_LEADS = [(100, 124, 5, 3), (150, 97, 7, 0), (40, 40, 0, 7), (6, 90, 5, 2)]


@pytest.mark.parametrize("causal, window", [(True, None), (False, 37), (True, 37), (False, None)])
@pytest.mark.parametrize("q_len, kv_len, q_first, kv_first", PACKED_LEADS)
@pytest.mark.parametrize("sink_tokens", [0, 20])
def test_query_block_range_covers_packed_visibility(causal, window, q_len, kv_len, q_first,
                                                    kv_first, sink_tokens):  # fmt: skip
    """A packed sequence read from starts rounded down to 8: rows below q_first and keys
    below kv_first are its neighbours' and see nothing (its sinks are its first keys,
    from kv_first). Every block with a visible pair is in [lo, hi) and [full_lo, full_hi)
    holds only fully visible blocks (the range may be loose there: the extra blocks are
    masked)."""
    block, num_blocks = 16, 10
    rows = np.arange(block * num_blocks)
    offset = kv_len - q_len
    pos = rows[:, None] + offset
    for first in range(0, block * num_blocks + 40, 3):
        for count in (1, 16, 64):
            keys = np.arange(first, first + count)[None, :]
            visible = (rows[:, None] >= q_first) & (rows[:, None] < q_len)
            visible = visible & (keys >= kv_first) & (keys < kv_len)
            if causal:
                visible &= keys <= pos
            if window is not None:
                visible &= (keys > pos - window) | (keys < kv_first + sink_tokens)
            per_block = visible.reshape(num_blocks, block, count)
            lo, hi, full_lo, full_hi = (int(x) for x in query_block_range(
                jnp.int32(first), jnp.int32(first + count - 1), causal=causal, window=window,
                offset=jnp.int32(offset), num_blocks=num_blocks, block_q=block,
                q_len=jnp.int32(q_len), kv_len=jnp.int32(kv_len), q_first=jnp.int32(q_first),
                kv_first=jnp.int32(kv_first), sink_tokens=sink_tokens,
            ))  # fmt: skip
            where = f"keys {first}..{first + count - 1}"
            seen = np.flatnonzero(per_block.any(axis=(1, 2)))
            assert lo <= full_lo <= full_hi <= hi, where
            assert ((seen >= lo) & (seen < hi)).all(), where
            assert per_block.all(axis=(1, 2))[full_lo:full_hi].all(), where


# ------------------------------------------------------------------ lowering (CPU)


@pytest.mark.parametrize(
    "d, causal, window, cap, tq, tk, block_kv_dq",
    [
        (128, True, None, None, 256, 256, 64),
        (64, True, 100, None, 256, 384, 64),
        (128, False, None, 30.0, 128, 256, 128),
    ],
)
def test_backward_lowers_for_cuda(d, causal, window, cap, tq, tk, block_kv_dq):
    q = jax.ShapeDtypeStruct((1, tq, 4, d), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, tk, 2, d), jnp.bfloat16)
    lse = jax.ShapeDtypeStruct((1, 4, tq), jnp.float32)
    fn = functools.partial(mosaic_backward, causal=causal, window=window, soft_cap=cap,
                           scale=0.1, config=MosaicBackwardConfig(block_kv_dq))  # fmt: skip
    text = jax.jit(fn).trace(q, k, k, q, lse, q, lse).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("mosaic_gpu") >= 2


# ------------------------------------------------------------------ the kernels (sm90)

CASES = [  # (B, Tq, Tk, Hq, Hkv, D, causal, window, soft_cap)
    (1, 256, 256, 4, 4, 128, False, None, None),
    (2, 512, 512, 8, 2, 128, True, None, None),
    (1, 256, 512, 4, 1, 64, True, None, None),
    (1, 512, 256, 4, 2, 128, True, None, None),  # Tq > Tk: the first rows see no key
    (1, 512, 512, 4, 2, 128, True, 100, 20.0),
    (1, 384, 640, 8, 2, 64, False, 200, None),
    (1, 256, 384, 4, 2, 64, True, 150, None),  # causal and window, Tq < Tk
    (1, 384, 256, 4, 2, 128, False, 100, None),  # window alone, Tq > Tk
    (1, 256, 256, 4, 4, 128, False, None, 2.0),  # a cap without a mask; tanh saturates
    # D256: the dK/dV kernel's consumers split the columns, the dQ kernel has one slot.
    (1, 256, 512, 4, 2, 256, True, None, None),
    (1, 384, 256, 4, 1, 256, False, 100, 20.0),
]


def _case_inputs(case, dtype):
    b, tq, tk, hq, hkv, d, *_ = case
    rng = util.rng_for("mosaic backward", case, dtype)
    q = util.randn(rng, (b, tq, hq, d), dtype)
    k, v = (util.randn(rng, (b, tk, hkv, d), dtype) for _ in range(2))
    g_out = util.randn(rng, (b, tq, hq, d), dtype)
    g_lse = util.randn(rng, (b, hq, tq), "float32")
    return q, k, v, g_out, g_lse


def _check(case, dtype, grads, inputs):
    *_, causal, window, cap = case
    q, k, v, g_out, g_lse = inputs
    opts = dict(causal=causal, window=window, soft_cap=cap, scale=q.shape[-1] ** -0.5)
    args = [util.f64(x) for x in inputs]
    want = attention_grad_oracle(*args, **opts)
    lowp = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16
    plain = attention_grad_oracle(*args, lowp=lowp, **opts)
    assert_qkv_grads_close(grads, want, plain, dtype)


@hopper_only
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.every_case
def test_backward_matches_oracle(case, dtype):
    *_, causal, window, cap = case
    inputs = _case_inputs(case, dtype)
    q, k, v, g_out, g_lse = inputs
    opts = dict(causal=causal, window=window, soft_cap=cap, scale=q.shape[-1] ** -0.5)
    out, lse = mosaic_forward(q, k, v, **opts)
    grads = jax.jit(functools.partial(mosaic_backward, **opts))(q, k, v, out, lse, g_out, g_lse)
    _check(case, dtype, grads, inputs)


@hopper_only
@pytest.mark.parametrize(
    "config, case",
    [
        (MosaicBackwardConfig(64, 3), CASES[1]),
        (MosaicBackwardConfig(128, 2), CASES[1]),
        (MosaicBackwardConfig(128, 3), CASES[2]),  # D64: 128-key dQ steps in three stages
        (MosaicBackwardConfig(64, 3), CASES[4]),  # window and soft-cap
    ],
    ids=lambda x: str(x) if isinstance(x, MosaicBackwardConfig) else "-".join(map(str, x)),
)
@pytest.mark.every_case
def test_backward_tilings(config, case):
    *_, causal, window, cap = case
    inputs = _case_inputs(case, "bfloat16")
    q, k, v, g_out, g_lse = inputs
    opts = dict(causal=causal, window=window, soft_cap=cap, scale=q.shape[-1] ** -0.5)
    out, lse = mosaic_forward(q, k, v, **opts)
    fn = functools.partial(mosaic_backward, config=config, **opts)
    grads = jax.jit(fn)(q, k, v, out, lse, g_out, g_lse)
    _check(case, "bfloat16", grads, inputs)


@hopper_only
def test_attention_gradient_takes_mosaic_and_matches_triton(monkeypatch):
    """`jaxattn.attention`'s gradient on this device, through out and the lse: the
    automatic choice runs the Hopper kernels (on either forward's residuals) and matches
    the oracle and the Triton kernels."""
    case = (2, 512, 512, 8, 2, 128, True, None, 25.0)
    inputs = _case_inputs(case, "bfloat16")
    q, k, v, g_out, g_lse = inputs
    calls = []

    def spy(*args, **kw):
        calls.append(kw)
        return mosaic_backward(*args, **kw)

    monkeypatch.setattr(attention_module, "mosaic_backward", spy)

    def grads(prefill, backward):
        config = jaxattn.FlashPrefillConfig(backend=prefill, backward=backward)

        def loss(q, k, v):
            out, lse = jaxattn.attention(q, k, v, causal=True, soft_cap=25.0, config=config,
                                         return_lse=True, implementation="pallas")  # fmt: skip
            return jnp.sum(out.astype(jnp.float32) * g_out.astype(jnp.float32)) + jnp.sum(
                jnp.where(jnp.isfinite(lse), lse * g_lse, 0.0)
            )

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)

    triton = grads("triton", jaxattn.FlashBackwardConfig(backend="triton"))
    assert not calls
    for prefill in ("auto", "triton"):
        got = grads(prefill, None)
        assert len(calls) == 1 and calls.pop()["config"] is not None, prefill
        _check(case, "bfloat16", got, inputs)
        for name, g, t in zip("qkv", got, triton, strict=True):
            diff = np.abs(util.f64(g) - util.f64(t)).max()
            assert diff <= 5e-2 * max(1.0, np.abs(util.f64(t)).max()), (prefill, name, diff)


def test_cases_cover_each_option():
    """The GPU cases meet causal, full, window, soft-cap, each head dim, MQA/GQA/MHA, Tq > Tk."""
    seen = set()
    for _, tq, tk, hq, hkv, d, causal, window, cap in CASES:
        seen |= {f"D{d}", "causal" if causal else "full", f"group{hq // hkv}"}
        seen |= {"window"} if window else set()
        seen |= {"cap"} if cap else set()
        seen |= {"tq>tk"} if tq > tk else set()
    assert seen >= {"D64", "D128", "D256", "causal", "full", "window", "cap", "group1",
                    "group4", "tq>tk"}  # fmt: skip


def test_backward_config_resolves_unset_triton_fields():
    """A config built only to pick the backend takes the Triton heuristic's tiles for the
    shape (float32 / D256 need smaller ones than bf16 D128); set fields stay."""
    want = jaxattn.FlashBackwardConfig.heuristic(2048, 2048, 256, jnp.float32)
    got = jaxattn.FlashBackwardConfig(backend="triton").resolve(2048, 2048, 256, jnp.float32)
    assert dataclasses.replace(got, backend="auto") == want
    mine = jaxattn.FlashBackwardConfig(block_q_dq=16, num_stages=(3, 3))
    got = mine.resolve(2048, 2048, 128, jnp.bfloat16)
    assert (got.block_q_dq, got.num_stages, got.block_kv_dkv) == (16, (3, 3), 64)
    full = jaxattn.FlashBackwardConfig(16, 16, 16, 16, (4, 4), (1, 1))
    assert full.resolve(2048, 2048, 128, jnp.bfloat16) is full
    with pytest.raises(TypeError, match="MosaicBackwardConfig"):
        jaxattn.FlashBackwardConfig(mosaic=jaxattn.MosaicForwardConfig())
