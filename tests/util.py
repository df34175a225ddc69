"""The one place where the suite adapts to its machine, plus shared tolerance checks.

On CPU the Pallas kernels run in interpret mode (~1 s per compiled shape): small shapes,
float32, a small explicit tiling so several tiles and key blocks are exercised. On a GPU
(`jax.default_backend() == "gpu"`) the same cases run with compiled kernels: longer
sequences (lengths scaled by `GPU_SCALE`), bf16 as well as float32, the heuristic config,
and the head-dim sweep of real models.
"""

from __future__ import annotations

import math
import zlib

import jax
import jax.numpy as jnp
import numpy as np

import jaxattn

ON_GPU = jax.default_backend() == "gpu"
IMPLEMENTATIONS = ("xla", "pallas")

# Several q tiles and key blocks per sequence even at CPU sizes.
CPU_CONFIG = jaxattn.FlashPrefillConfig(
    block_q=16,
    block_kv=16,
    num_warps=4,
    num_stages=2,
    backward=jaxattn.FlashBackwardConfig(16, 16, 16, 16, (4, 4), (1, 1)),
)

# XLA:CPU compile time dominates the interpret-mode cases: jits given
# `compiler_options=FAST_COMPILE` compile without LLVM's optimizations, ~25% faster (as
# the parallel suite's context_cases.py does). GPU: the default. Results agree with the
# default compile's but for roundings: fused elementwise chains may round with or without
# an FMA, and differently where XLA recomputes them (test_grad found the reference's
# gradient depending on bit-equal recomputed logits).
FAST_COMPILE = {} if ON_GPU else {"xla_backend_optimization_level": 0}

GPU_SCALE = 4  # token counts and lengths (> 1) are multiplied by this on a GPU
DEFAULT_HEAD_DIM = 128 if ON_GPU else 32
# The head-dim sweep: real models on a GPU; one odd size (padded in-kernel) on CPU.
HEAD_DIMS = (8, 64, 80, 96, 128, 256, 512) if ON_GPU else (40,)  # 8: a dot of width 16
# dtypes every case runs in; "core" cases also run in float32 on a GPU.
CASE_DTYPES = ("bfloat16",) if ON_GPU else ("float32",)
CORE_DTYPES = ("bfloat16", "float32") if ON_GPU else ("float32",)
LOW_PRECISION = ("bfloat16", "float16")


def kernel_config():
    """The `config=` the suite passes: heuristic on a GPU, small tiles in interpret mode."""
    return None if ON_GPU else CPU_CONFIG


def tokens(n: int) -> int:
    """A CPU token count, scaled up on a GPU (0 and 1 stay: they are edge cases)."""
    return n if n <= 1 or not ON_GPU else n * GPU_SCALE


def rng_for(*key) -> np.random.Generator:
    """A generator seeded from the test's identity: fresh per case, reproducible."""
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def randn(rng, shape, dtype="float32", scale=1.0) -> jax.Array:
    return jnp.asarray(scale * rng.standard_normal(shape), dtype)


def f64(x) -> np.ndarray:
    """float64 copy; jax arrays (bf16/fp16 included) go through float32, which is exact."""
    if isinstance(x, np.ndarray):
        return x.astype(np.float64)
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


# ---------------------------------------------------------------- tolerances
# Absolute + relative error allowed against the float64 oracle, for float32 inputs (the
# kernel asks Triton for IEEE float32 dots; its exp2 is approximate on a GPU).
F32_TOL = dict(atol=1e-4, rtol=1e-4) if ON_GPU else dict(atol=2e-5, rtol=2e-5)
LSE_TOL = {
    "float32": dict(atol=1e-4, rtol=1e-4) if ON_GPU else dict(atol=2e-5, rtol=2e-5),
    "bfloat16": dict(atol=1e-2, rtol=1e-3),
    "float16": dict(atol=1e-2, rtol=1e-3),
}
# Low precision (FlashAttention's rule): the max error against the float64 oracle may be at
# most LOWP_FACTOR x that of a plain reference run in the same precision, plus LOWP_ATOL.
LOWP_FACTOR = 2.0
LOWP_ATOL = {"bfloat16": 2e-3, "float16": 5e-4}
# Whatever the plain low-precision reference does, never accept errors this large.
LOWP_CAP = {"bfloat16": 6e-2, "float16": 1e-2}


def assert_out_close(got, want, dtype: str, *, lowp_ref=None, what: str = "out"):
    """`got` vs the float64 oracle `want`; `lowp_ref` is the oracle run with `lowp=dtype`."""
    got = f64(got)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert np.isfinite(got).all(), f"{what}: {np.sum(~np.isfinite(got))} non-finite values"
    err = np.abs(got - want)
    if dtype == "float32":
        bound = F32_TOL["atol"] + F32_TOL["rtol"] * np.abs(want)
        worst = np.unravel_index(np.argmax(err - bound), err.shape)
        assert (err <= bound).all(), (
            f"{what}: {np.sum(err > bound)} elements out of tolerance {F32_TOL}; worst at "
            f"{worst}: got {got[worst]}, want {want[worst]}"
        )
        return
    assert lowp_ref is not None, "low precision needs the plain low-precision reference"
    ref_err = float(np.max(np.abs(lowp_ref - want), initial=0.0))
    bound = min(LOWP_FACTOR * ref_err + LOWP_ATOL[dtype], LOWP_CAP[dtype])
    worst = np.unravel_index(np.argmax(err), err.shape) if err.size else ()
    assert float(np.max(err, initial=0.0)) <= bound, (
        f"{what} ({dtype}): max error {np.max(err)} at {worst} > {bound} "
        f"= {LOWP_FACTOR} x plain {dtype} reference error {ref_err} + {LOWP_ATOL[dtype]}"
    )


def assert_lse_close(got, want, dtype: str, tol: dict | None = None):
    got = np.asarray(got, np.float64)
    assert got.shape == want.shape, f"lse: shape {got.shape} != {want.shape}"
    empty = np.isneginf(want)
    np.testing.assert_array_equal(
        np.isneginf(got), empty, err_msg="lse must be -inf exactly where no key is visible"
    )
    tol = LSE_TOL[dtype] if tol is None else tol
    np.testing.assert_allclose(got[~empty], want[~empty], **tol, err_msg="lse")


def assert_zero_rows(out, rows_mask, what: str):
    """Rows selected by `rows_mask` (broadcast over the trailing dims) must be exactly 0."""
    out = np.asarray(jnp.asarray(out, jnp.float32))
    sel = out[np.broadcast_to(rows_mask, out.shape)]
    assert (sel == 0).all(), (
        f"{what}: {np.sum(sel != 0)} values not exactly 0 (nan: " + str(np.isnan(sel).sum()) + ")"
    )


def bits(x) -> np.ndarray:
    """Raw bits of an array as unsigned ints: bit-exact comparisons (NaN, bf16, fp8)."""
    x = np.ascontiguousarray(np.asarray(x))
    return x.view(np.dtype(f"u{x.dtype.itemsize}"))


def poison_value(dtype: str, kind: str) -> float:
    """What padding inputs are filled with: NaN, or a finite value of huge magnitude."""
    if kind == "nan":
        return math.nan
    return float(jnp.finfo(jnp.dtype(dtype)).max) / 8


def spy_calls(monkeypatch, module, names) -> list[str]:
    """Wraps `module.<name>` for each of `names` to record its calls; returns the list the
    names are appended to, in call order (the wrapped functions still run)."""
    calls = []
    for name in names:
        real = getattr(module, name)

        def spy(*args, _real=real, _name=name, **kw):
            calls.append(_name)
            return _real(*args, **kw)

        monkeypatch.setattr(module, name, spy)
    return calls


def jit_call(fn, *args, static: dict | None = None, **arrays):
    """`fn(*args, **static, **arrays)` under `jax.jit` with only `static` held static.

    Eager calls of the jnp reference compile op by op (seconds per shape on CPU); one jit
    compile is ~10x cheaper."""
    static = static or {}
    jitted = jax.jit(lambda args, arrays: fn(*args, **static, **arrays),
                     compiler_options=FAST_COMPILE)  # fmt: skip
    return jitted(args, arrays)


def weighted_grads(op, inputs, weight):
    """(dq, dk, dv): `jax.grad` of `sum(op(q, k, v) * weight)` (in float32) under jit."""

    def loss(q, k, v):
        return jnp.sum(op(q, k, v).astype(jnp.float32) * weight.astype(jnp.float32))

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*inputs)


def assert_grads_near(got, want, tol: float):
    """Each of (dq, dk, dv) `got` within `tol` (max abs difference) of `want`'s."""
    for name, a, b in zip("qkv", got, want, strict=True):
        err = float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
        assert err < tol, f"d{name}: {err}"
