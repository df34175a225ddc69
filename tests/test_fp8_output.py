"""FP8 output (`out_dtype=jnp.float8_e4m3fn`, `out_scale`) of every attention op, for every
implementation, against the float64 numpy oracle.

The contract (TensorRT-LLM's FP8 output, `jaxattn.quant`'s per-tensor convention): the
stored value is `saturate(out * (1 / out_scale))` rounded to e4m3fn, straight from the
float32 result; the user dequantizes with `out.astype(float32) * out_scale`. Checked here:
  - the dequantized output equals the oracle's (saturated to +-448 * out_scale) within one
    e4m3 step at that magnitude, plus the usual float32 attention tolerance;
  - a tiny out_scale saturates at +-448 (never NaN: e4m3fn has no inf);
  - rows with no visible key, padding rows and idle slots are exact zeros;
  - bf16 inputs are quantized from the float32 result, not from a bf16-rounded one;
  - bad `out_dtype` / `out_scale` raise at trace time, and differentiating raises.
Each op is traced once per case: out_scale is a traced argument, so the normal and the
saturating scale share one compiled function.
"""

from __future__ import annotations

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import util
from cases import STATIC_OPTIONS, Dense, Packed, build_dense, build_packed, oracle, poisoned
from paged_oracle import step_oracle
from test_decode import Case as DecodeCase
from test_decode import _build as build_decode
from test_decode import _options as decode_options
from test_decode import _oracle as decode_oracle

import jaxattn

impls = pytest.mark.parametrize("impl", util.IMPLEMENTATIONS)

FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0
# Outputs of these cases are O(1): 1/128 spreads them over most of e4m3's range, 1e-3
# pushes the larger ones past 448.
SCALES = {"normal": 1.0 / 128, "saturating": 1e-3}


# ----------------------------------------------------------------------------- checks
def e4m3_ulp(x) -> np.ndarray:
    """Spacing of e4m3fn values at magnitude |x| (3 mantissa bits; subnormals below 2**-6
    are spaced 2**-9)."""
    exponent = np.floor(np.log2(np.maximum(np.abs(x), 2.0**-6)))
    return 2.0 ** (exponent - 3)


def fp8_codes(x) -> np.ndarray:
    """The stored e4m3fn bytes as signed ordinals: neighbours differ by 1, +-0 are 0."""
    bits = np.asarray(x).view(np.uint8).astype(np.int32)
    return np.where(bits & 0x80, -(bits & 0x7F), bits & 0x7F)


def quantize_np(x, out_scale) -> np.ndarray:
    """The contract in numpy: float64/32 values -> e4m3fn (ml_dtypes rounds to nearest even)."""
    y = np.clip(np.asarray(x, np.float64) * (1.0 / np.float64(np.float32(out_scale))), -448, 448)
    return y.astype(jnp.dtype(FP8))


def assert_fp8_close(got, want, out_scale, what="out", *, dtype="float32", lowp_ref=None):
    """`got` (float8_e4m3fn) dequantized vs the float64 oracle `want` saturated to the
    format's range: within one e4m3 step at that magnitude plus the attention tolerance of
    the inputs' dtype (float32: util.F32_TOL; bf16/fp16: FlashAttention's rule against the
    plain low-precision oracle `lowp_ref`, as util.assert_out_close)."""
    got = np.asarray(got)
    assert got.dtype == jnp.dtype(FP8), f"{what}: dtype {got.dtype}, want float8_e4m3fn"
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    nan = (got.view(np.uint8) & 0x7F) == 0x7F
    assert not nan.any(), f"{what}: {nan.sum()} NaN codes"
    scale = np.float64(np.float32(out_scale))
    got_q = got.astype(np.float64)
    want_q = np.clip(want * (1.0 / scale), -FP8_MAX, FP8_MAX)
    err = np.abs(got_q - want_q) * scale  # dequantized units
    ulp = e4m3_ulp(np.maximum(np.abs(got_q), np.abs(want_q))) * scale
    if dtype == "float32":
        bound = ulp + util.F32_TOL["atol"] + util.F32_TOL["rtol"] * np.abs(want)
    else:
        ref_err = float(np.max(np.abs(lowp_ref - want)))
        lowp = util.LOWP_FACTOR * ref_err + util.LOWP_ATOL[dtype]
        bound = ulp + min(lowp, util.LOWP_CAP[dtype])
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert (err <= bound).all(), (
        f"{what}: {np.sum(err > bound)} of {err.size} values beyond one e4m3 step; worst at "
        f"{worst}: got {got_q[worst]} * {scale}, want {want[worst]}"
    )
    if np.abs(want).max() * (1.0 / scale) > FP8_MAX:  # the saturating scale
        big = np.abs(want_q) == FP8_MAX
        assert big.any() and (np.abs(got_q[big]) == FP8_MAX).all(), f"{what}: not saturated"
        assert np.abs(got_q).max() == FP8_MAX


def skip_without_fp8_kernels(impl):
    """Compiled kernels store e4m3 on sm_89+ only; elsewhere the op raises
    NotImplementedError (an implementation list falls through to "xla")."""
    if impl == "pallas":
        try:
            jaxattn.validation.check_fp8_kernel_output()
        except NotImplementedError as e:
            pytest.skip(str(e))


def assert_codes_within_one(got, want, what):
    diff = np.abs(fp8_codes(got) - fp8_codes(want))
    assert diff.max() <= 1, f"{what}: codes {diff.max()} steps apart ({np.sum(diff > 0)} differ)"


# ------------------------------------------------------------------ attention (context)
CONTEXT_CASES = [
    Dense(name="fp8_dense", causal=True, alibi=True, q_lengths=(37, 11), kv_lengths=(37, 30)),
    Packed(name="fp8_packed", q_lens=(5, 17, 0, 3, 20), kv_lens=(9, 17, 4, 0, 20),
           causal=True, window=6, sink_tokens=2, q_pad=5),  # 3 rows see no key, 5 pad
]  # fmt: skip


def _context_fn(case, impl, inp):
    """The jitted op on (q, k, v, out_scale, arrays), with the case's static options."""
    packed = isinstance(case, Packed)
    op = jaxattn.ragged_attention if packed else jaxattn.attention
    static = {n: x for n, x in inp.kwargs.items() if n in STATIC_OPTIONS}
    op = functools.partial(
        op, **static, return_lse=True, implementation=impl, config=util.kernel_config(),
        out_dtype=FP8,
    )  # fmt: skip
    return jax.jit(lambda q, k, v, s, arrays: op(q, k, v, *inp.positional, out_scale=s, **arrays))


@impls
@pytest.mark.parametrize("case", CONTEXT_CASES, ids=lambda c: c.name)
def test_attention_fp8_vs_oracle(case, impl):
    """Normal and saturating scales (traced: one compile); padding poisoned with NaN."""
    skip_without_fp8_kernels(impl)
    packed = isinstance(case, Packed)
    inp = (build_packed if packed else build_dense)(case, "float32")
    want, want_lse = oracle(inp, packed)
    q, k, v = poisoned(inp, "nan", "float32")
    arrays = {n: x for n, x in inp.kwargs.items() if n not in STATIC_OPTIONS}
    fn = _context_fn(case, impl, inp)
    empty_rows = np.isneginf(want_lse.T if packed else want_lse.transpose(0, 2, 1))[..., None]
    assert empty_rows.any(), "the case should have padding rows"
    for name, out_scale in SCALES.items():
        out, lse = fn(q, k, v, jnp.float32(out_scale), arrays)
        assert_fp8_close(out, want, out_scale, what=f"{case.name} {name}")
        util.assert_zero_rows(out, empty_rows, f"{case.name} {name}: rows with no key")
        assert lse.dtype == jnp.float32
        util.assert_lse_close(lse, want_lse, "float32")


@impls
def test_bf16_inputs_quantize_the_float32_result(impl):
    """The fp8 value comes from the float32 result, not through bf16: the reference gives
    exactly the codes of its own float32 result (bf16 inputs upcast exactly); the kernel
    (bf16 probabilities in its P @ V, as FlashAttention) meets the bf16 tolerance."""
    skip_without_fp8_kernels(impl)
    case = Dense(name="fp8_bf16", causal=True, q_lengths=(37, 20))
    inp = build_dense(case, "bfloat16")
    out_scale = SCALES["normal"]
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    ref32 = jax.jit(functools.partial(jaxattn.attention_reference, causal=True))(
        f32(inp.q), f32(inp.k), f32(inp.v), q_lengths=inp.kwargs["q_lengths"]
    )
    want = quantize_np(ref32, out_scale)
    got = jax.jit(
        functools.partial(
            jaxattn.attention, causal=True, implementation=impl, config=util.kernel_config(),
            out_dtype=FP8, out_scale=out_scale,
        )
    )(inp.q, inp.k, inp.v, q_lengths=inp.kwargs["q_lengths"])  # fmt: skip
    if impl == "xla" and not util.ON_GPU:
        np.testing.assert_array_equal(fp8_codes(got), fp8_codes(want), "reference codes")
    elif impl == "xla":  # a GPU's float32 dots may round another way
        assert_codes_within_one(got, want, "reference vs its float32 result")
    else:
        want64, _ = oracle(inp, packed=False)
        lowp, _ = oracle(inp, packed=False, lowp=jnp.dtype(jnp.bfloat16).type)
        assert_fp8_close(got, want64, out_scale, "bf16 kernel", dtype="bfloat16", lowp_ref=lowp)
    # Through bf16 first, some values would land on another code; the test has teeth.
    via_bf16 = quantize_np(np.asarray(jnp.asarray(ref32, jnp.bfloat16), np.float64), out_scale)
    assert (fp8_codes(via_bf16) != fp8_codes(want)).any()


# ------------------------------------------------------------------------- paged decode
DECODE_RUNS = [("xla", None), ("pallas", 1), ("pallas", 2)]


@pytest.mark.parametrize("impl, splits", DECODE_RUNS, ids=[f"{i}-{s}" for i, s in DECODE_RUNS])
def test_paged_decode_fp8_vs_oracle(impl, splits):
    """Split-K off (the decode kernel's epilogue quantizes) and on (the combine kernel's);
    an idle slot outputs zeros."""
    skip_without_fp8_kernels(impl)
    case = DecodeCase("fp8_decode", lengths=(1, 9, 0, 40), window=20, sink_tokens=2, alibi=True)
    q, cache, tables, lengths, k_hist, v_hist = build_decode(case, "float32", 0)
    want, want_lse = decode_oracle(case, q, k_hist, v_hist)
    config = None if splits is None else jaxattn.PagedDecodeConfig(block_kv=16, num_splits=splits)
    fn = jax.jit(
        lambda q, cache, tables, lengths, s: jaxattn.paged_decode(
            q, cache, tables, lengths, return_lse=True, implementation=impl, config=config,
            out_dtype=FP8, out_scale=s, **decode_options(case),
        )
    )  # fmt: skip
    idle = (np.asarray(case.lengths) == 0)[:, None, None]
    for name, out_scale in SCALES.items():
        out, lse = fn(q, cache, tables, lengths, jnp.float32(out_scale))
        assert_fp8_close(out, want, out_scale, what=f"decode {name}")
        util.assert_zero_rows(out, idle, f"decode {name}: idle slot")
        util.assert_lse_close(lse, want_lse, "float32")


# ---------------------------------------------------------------------- paged attention
HQ, HKV, P = 4, 2, 4
MIXED = ((0, 7), (8, 5), (20, 1), (4, 1), (0, 0))  # (cached prefix, new tokens) per row
GENERATION = ((20, 1), (4, 1), (0, 0), (0, 1))  # a decode-only step


def _mixed_step(seed=0, rows=MIXED, decode_only=False):
    """A serving step over a NaN-poisoned cache holding each row's prefix: by default a
    prompt, a chunk after 8 cached tokens, two generation rows (over two key blocks of 16
    and one), an idle row, and padding tokens. Returns (q, k, v, cache, meta, histories,
    real)."""
    rng = util.rng_for("fp8_paged", seed)
    d = util.DEFAULT_HEAD_DIM
    lengths = [a + n for a, n in rows]
    held = [-(-n // P) for n in lengths]
    num_pages = sum(held) + 3
    perm = rng.permutation(num_pages).tolist()
    pages = [perm[sum(held[:s]) : sum(held[: s + 1])] for s in range(len(rows))]
    hist = [[rng.standard_normal((n, h, d)) for h in (HQ, HKV, HKV)] for n in lengths]
    cache = jaxattn.PagedKVCache(*(jnp.full((num_pages, HKV, P, d), np.nan) for _ in "kv"))
    slot = lambda s, t: pages[s][t // P] * P + t % P  # noqa: E731
    prefix = [(s, t) for s, (a, _) in enumerate(rows) for t in range(a)]
    cache = jaxattn.write_kv(
        cache,
        *(jnp.asarray(np.stack([hist[s][i][t] for s, t in prefix]), jnp.float32) for i in (1, 2)),
        jnp.asarray([slot(s, t) for s, t in prefix], jnp.int32),
    )
    max_tokens = 24
    meta = jaxattn.AttentionMetadata.from_lists(
        [n for _, n in rows], lengths, pages, P, max_tokens=max_tokens,
        max_seqs=len(rows) + 1, max_pages=max(held) + 1, decode_only=decode_only,
    )  # fmt: skip
    new = [(s, t) for s, (a, n) in enumerate(rows) for t in range(a, a + n)]
    qkv = []
    for i, h in enumerate((HQ, HKV, HKV)):
        x = np.full((max_tokens, h, d), np.nan)
        x[: len(new)] = [hist[s][i][t] for s, t in new]
        qkv.append(jnp.asarray(x, jnp.float32))
    histories = [(k, v) if n else None for (_, k, v), (_, n) in zip(hist, rows)]
    real = np.arange(max_tokens) < len(new)
    return (*qkv, cache, meta, histories, real)


@impls
@pytest.mark.parametrize("window", [9, None], ids=["window", "history_gather"])
def test_paged_attention_fp8_mixed_batch(impl, window):
    """Context rows (flash kernel), generation rows (decode kernel, split-K), padding.
    Without a window the chunk row is gathered (`jaxattn.history`): its launch stores
    fp8 into the paged launch's output."""
    skip_without_fp8_kernels(impl)
    q, k, v, cache, meta, histories, real = _mixed_step()
    alibi = jaxattn.alibi_slopes(HQ)
    q_clean = np.where(real[:, None, None], util.f64(q), 0.0)
    want, want_lse = step_oracle(
        q_clean, meta.cu_seqlens_q, meta.context_lens, histories, window=window,
        alibi_slopes=np.float64(alibi),
    )  # fmt: skip
    config = None
    if impl == "pallas":
        decode = jaxattn.PagedDecodeConfig(block_kv=16, num_splits=2)
        config = jaxattn.PagedAttentionConfig(
            prefill=util.kernel_config(), decode=decode, gather_tokens=64, gather_min_tokens=4
        )
    fn = jax.jit(
        lambda q, k, v, cache, meta, s: jaxattn.paged_attention(
            q, k, v, cache, meta, window=window, alibi_slopes=alibi, return_lse=True,
            implementation=impl, config=config, out_dtype=FP8, out_scale=s,
        )
    )  # fmt: skip
    for name, out_scale in SCALES.items():
        (out, lse), _ = fn(q, k, v, cache, meta, jnp.float32(out_scale))
        assert_fp8_close(out, want, out_scale, what=f"paged {name}")
        util.assert_zero_rows(out, ~real[:, None, None], f"paged {name}: padding tokens")
        util.assert_lse_close(lse, want_lse, "float32")


@impls
@pytest.mark.parametrize("splits", [1, 2])
def test_paged_attention_fp8_decode_only(impl, splits):
    """A decode-only plan: the one kernel writes K/V and stores fp8 itself (one split) or
    through the combine kernel (two)."""
    skip_without_fp8_kernels(impl)
    q, k, v, cache, meta, histories, real = _mixed_step(1, GENERATION, decode_only=True)
    q_clean = np.where(real[:, None, None], util.f64(q), 0.0)
    want, _ = step_oracle(q_clean, meta.cu_seqlens_q, meta.context_lens, histories)
    config = None
    if impl == "pallas":
        decode = jaxattn.PagedDecodeConfig(block_kv=16, num_splits=splits)
        config = jaxattn.PagedAttentionConfig(decode=decode)
    fn = jax.jit(
        lambda q, k, v, cache, meta, s: jaxattn.paged_attention(
            q, k, v, cache, meta, implementation=impl, config=config, out_dtype=FP8,
            out_scale=s,
        )
    )  # fmt: skip
    for name, out_scale in SCALES.items():
        out, _ = fn(q, k, v, cache, meta, jnp.float32(out_scale))
        assert_fp8_close(out, want, out_scale, what=f"decode-only {name}")
        util.assert_zero_rows(out, ~real[:, None, None], f"decode-only {name}: padding")


def test_paged_attention_qkv_passes_fp8_options():
    q, k, v, cache, meta, *_ = _mixed_step()
    qkv = jnp.concatenate([x.reshape(x.shape[0], -1) for x in (q, k, v)], axis=1)
    (out, _), _ = jax.eval_shape(
        lambda qkv, cache, meta: jaxattn.paged_attention_qkv(
            qkv, cache, meta, num_q_heads=HQ, num_kv_heads=HKV, implementation="xla",
            out_dtype=FP8, out_scale=0.5, return_lse=True,
        ),
        qkv, cache, meta,
    )  # fmt: skip
    assert out.dtype == FP8 and out.shape == q.shape


# ------------------------------------------------------------------- bad inputs, grads
def _ops():
    """Each op as `call(**options)` on small valid inputs."""
    rng = util.rng_for("fp8_bad")
    q, k = util.randn(rng, (2, 5, 4, 16)), util.randn(rng, (2, 5, 2, 16))
    cu = jnp.asarray([0, 4, 10], jnp.int32)
    dq, dcache, tables, lengths, *_ = build_decode(DecodeCase("bad", lengths=(3, 9)), "float32", 2)
    pq, pk, pv, pcache, meta, *_ = _mixed_step()
    return {
        "attention": lambda **o: jaxattn.attention(q, k, k, **o),
        "ragged_attention": lambda **o: jaxattn.ragged_attention(
            q[0].repeat(2, 0), k[0].repeat(2, 0), k[0].repeat(2, 0), cu, cu, **o
        ),
        "paged_decode": lambda **o: jaxattn.paged_decode(dq, dcache, tables, lengths, **o),
        "paged_attention": lambda **o: jaxattn.paged_attention(pq, pk, pv, pcache, meta, **o),
    }


BAD = {
    "int8": (dict(out_dtype=jnp.int8), r"out_dtype=int8"),
    "other_float": (dict(out_dtype=jnp.bfloat16), r"out_dtype=bfloat16"),
    "e5m2": (dict(out_dtype=jnp.float8_e5m2, out_scale=1.0), r"out_dtype=float8_e5m2"),
    "not_a_dtype": (dict(out_dtype="fp8"), r"out_dtype='fp8'"),
    "no_scale": (dict(out_dtype=FP8), r"needs out_scale"),
    "scale_vector": (dict(out_dtype=FP8, out_scale=jnp.ones(2)), r"out_scale\.shape=\(2,\)"),
    "scale_zero": (dict(out_dtype=FP8, out_scale=0.0), r"out_scale=0\.0"),
    "scale_without_fp8": (dict(out_scale=1.0), r"out_scale is only used"),
}


@pytest.mark.parametrize("op", ["attention", "ragged_attention", "paged_decode",
                                "paged_attention"])  # fmt: skip
@pytest.mark.parametrize("bad", BAD)
@pytest.mark.every_case
def test_bad_output_options_raise_at_trace_time(op, bad):
    call = _ops()[op]
    options, match = BAD[bad]
    for impl in util.IMPLEMENTATIONS:
        with pytest.raises(ValueError, match=match):
            jax.eval_shape(functools.partial(call, implementation=impl, **options))


def test_output_dtype_options_that_mean_the_default():
    """out_dtype = q's dtype is the default path (same dtype, still differentiable); a
    static token axis of size 0 gives fp8 zeros."""
    call = _ops()["attention"]
    out = jax.eval_shape(lambda: call(out_dtype=jnp.float32, implementation="xla"))
    assert out.dtype == jnp.float32
    rng = util.rng_for("fp8_default")
    q, k = util.randn(rng, (1, 3, 2, 8)), util.randn(rng, (1, 4, 1, 8))
    grad = jax.eval_shape(
        jax.grad(lambda q: jaxattn.attention(q, k, k, out_dtype="float32").sum()), q
    )
    assert grad.shape == q.shape
    empty = jaxattn.attention(q[:, :0], k, k, out_dtype=FP8, out_scale=0.5)
    assert empty.dtype == FP8 and empty.shape == (1, 0, 2, 8)


@impls
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
@pytest.mark.every_case
def test_fp8_output_is_not_differentiable(impl, packed):
    skip_without_fp8_kernels(impl)
    rng = util.rng_for("fp8_grad", packed)
    shape = (6, 2, 8) if packed else (1, 6, 2, 8)
    q, k = util.randn(rng, shape), util.randn(rng, shape)
    cu = (jnp.asarray([0, 6], jnp.int32),) * 2 if packed else ()
    op = jaxattn.ragged_attention if packed else jaxattn.attention

    def loss(q, out_scale):
        out = op(q, k, k, *cu, implementation=impl, config=util.kernel_config(),
                 out_dtype=FP8, out_scale=out_scale)  # fmt: skip
        return out.astype(jnp.float32).sum()

    with pytest.raises(TypeError, match="not differentiable"):
        jax.eval_shape(jax.grad(loss), q, jnp.float32(0.5))
    with pytest.raises(TypeError, match="not differentiable"):
        jax.eval_shape(jax.grad(loss, argnums=1), q, jnp.float32(0.5))


@pytest.mark.parametrize("capability, supported", [("8.0", False), ("8.9", True), ("9.0", True)])
@pytest.mark.every_case
def test_old_gpus_fall_back_to_xla(monkeypatch, capability, supported):
    """Triton converts to e4m3 on sm_89+ only: on an older GPU "pallas" raises
    NotImplementedError at trace time, so ["pallas", "xla"] (the GPU default) runs xla."""
    fake_jax = types.SimpleNamespace(
        default_backend=lambda: "gpu",
        devices=lambda: [types.SimpleNamespace(compute_capability=capability)],
    )
    monkeypatch.setattr(jaxattn.validation, "jax", fake_jax)
    monkeypatch.setenv("JAXATTN_INTERPRET", "0")
    call = _ops()["attention"]
    options = dict(out_dtype=FP8, out_scale=0.5)
    if supported:
        jaxattn.validation.check_fp8_kernel_output()
    else:
        with pytest.raises(NotImplementedError, match="compute capability >= 8.9"):
            jax.eval_shape(functools.partial(call, implementation="pallas", **options))
    out = jax.eval_shape(functools.partial(call, implementation=["pallas", "xla"], **options))
    assert out.dtype == FP8
