"""`pallas_kernels.codes.codes_to_bf16` and `words_to_values`: every stored code (all 256
bytes of INT8, FP8 e4m3 and packed INT4, also read as words)
becomes the exact bfloat16 value, checked bit for bit against numpy (ml_dtypes' e4m3
decoding). Read as words, INT8 and FP8 come four a 32-bit word, INT4 four nibbles a
16-bit half-word. On a GPU the packed PTX runs; on the CPU the kernel
runs the plain casts in interpret mode and the PTX path is lowered to Triton only."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import util

from pallas_kernels.codes import INT4_BIAS, codes_to_bf16, words_to_values
from pallas_kernels.common import whole_array_call

ROWS, COLS = 16, 64  # every byte value 4 times, in an order that mixes them
BYTES = np.random.default_rng(0).permutation(np.tile(np.arange(256, dtype=np.uint8), 4))
STORAGE = {"int8": jnp.int8, "float8_e4m3fn": jnp.float8_e4m3fn, "int4": jnp.uint8}


def expected(dtype: str) -> list[np.ndarray]:
    """float32 values of BYTES read as `dtype` (INT4: low nibbles, high nibbles)."""
    if dtype == "int4":
        return [(((BYTES.astype(np.int32) >> s) & 0xF) ^ 8) - 8 for s in (0, 4)]
    if dtype == "int8":
        return [BYTES.view(np.int8).astype(np.float32)]
    values = BYTES.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    return [np.where(np.isnan(values), 0, values)]  # 0x7F / 0xFF (NaN) are never stored


def _kernel(raw_ref, *out_refs, dtype, asm, biased):
    raw = raw_ref[...]
    values = codes_to_bf16(raw, dtype, asm=asm, biased=biased)
    for ref, part in zip(out_refs, values, strict=True):
        ref[...] = part


def convert(raw, dtype: str, *, asm: bool, interpret: bool, biased: bool = False):
    parts = 2 if dtype == "int4" else 1
    return whole_array_call(
        functools.partial(_kernel, dtype=dtype, asm=asm, biased=biased),
        [raw],
        [jax.ShapeDtypeStruct((ROWS, COLS), jnp.bfloat16)] * parts,
        grid=(1,),
        num_warps=4,
        num_stages=1,
        interpret=interpret,
        name="codes_to_bf16",
    )


@pytest.mark.parametrize("dtype", list(STORAGE))
def test_every_code_converts_exactly(dtype):
    raw = jax.lax.bitcast_convert_type(jnp.asarray(BYTES.view(np.int8)), STORAGE[dtype])
    raw = raw.reshape(ROWS, COLS)
    got = convert(raw, dtype, asm=util.ON_GPU, interpret=not util.ON_GPU)
    for part, (g, want) in enumerate(zip(got, expected(dtype), strict=True)):
        g = np.asarray(g, np.float32).reshape(-1)
        nan = np.isnan(BYTES.view(ml_dtypes.float8_e4m3fn).astype(np.float32))
        keep = ~nan if dtype == "float8_e4m3fn" else np.ones_like(nan)
        np.testing.assert_array_equal(g[keep], want[keep], f"{dtype} part {part}")


def test_every_int4_code_converts_exactly_biased():
    """INT4 read biased (the decode kernel's keys with a scale per half row): every nibble
    n becomes exactly n + INT4_BIAS."""
    raw = jnp.asarray(BYTES).reshape(ROWS, COLS)
    got = convert(raw, "int4", asm=util.ON_GPU, interpret=not util.ON_GPU, biased=True)
    for part, (g, want) in enumerate(zip(got, expected("int4"), strict=True)):
        g = np.asarray(g, np.float32).reshape(-1)
        np.testing.assert_array_equal(g, want + INT4_BIAS, f"int4 biased part {part}")


@pytest.mark.parametrize("dtype", list(STORAGE))
@pytest.mark.every_case
def test_packed_conversion_lowers_to_triton(dtype):
    spec = jax.ShapeDtypeStruct((ROWS, COLS), STORAGE[dtype])
    fn = jax.jit(functools.partial(convert, dtype=dtype, asm=True, interpret=False))
    text = fn.trace(spec).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text.lower()


def _words_kernel(words_ref, *out_refs, dtype, asm, biased):
    values = words_to_values(words_ref[...], dtype, jnp.bfloat16, asm=asm, biased=biased)
    for ref, part in zip(out_refs, values, strict=True):
        ref[...] = part


def convert_words(words, dtype: str, *, asm: bool, interpret: bool, biased: bool = False):
    return whole_array_call(
        functools.partial(_words_kernel, dtype=dtype, asm=asm, biased=biased),
        [words],
        [jax.ShapeDtypeStruct(words.shape, jnp.bfloat16)] * 4,
        grid=(1,),
        num_warps=4,
        num_stages=1,
        interpret=interpret,
        name="words_to_values",
    )


WORD_DTYPES = {"int8": jnp.int32, "float8_e4m3fn": jnp.int32, "int4": jnp.int16}


def as_words(dtype: str):
    """BYTES as `[ROWS, COLS / n]` words of n = 4 bytes (int32) or 2 (int16, INT4)."""
    word = WORD_DTYPES[dtype]
    n = jnp.dtype(word).itemsize
    return jax.lax.bitcast_convert_type(
        jnp.asarray(BYTES.view(np.int8)).reshape(ROWS, COLS // n, n), word
    )


def expected_words(dtype: str) -> list[np.ndarray]:
    """Part c of the words' values, float32 `[ROWS, words]`: code c of every word (INT8 /
    FP8: byte c; INT4: the low nibbles of bytes 0 and 1, then their high nibbles)."""
    if dtype == "int4":
        low, high = (x.reshape(ROWS, COLS) for x in expected("int4"))
        return [low[:, 0::2], low[:, 1::2], high[:, 0::2], high[:, 1::2]]
    [want] = expected(dtype)
    return [want.reshape(ROWS, COLS)[:, c::4] for c in range(4)]


@pytest.mark.parametrize("dtype", list(WORD_DTYPES))
def test_every_code_converts_exactly_from_words(dtype):
    """Rows of ROWS x COLS bytes read as words: part c holds code c of every word, each
    the exact value."""
    got = convert_words(as_words(dtype), dtype, asm=util.ON_GPU, interpret=not util.ON_GPU)
    codes = BYTES.reshape(ROWS, COLS // (2 if dtype == "int4" else 4), -1)
    nan = np.isnan(codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32))
    for c, (g, want) in enumerate(zip(got, expected_words(dtype), strict=True)):
        g = np.asarray(g, np.float32)
        keep = ~nan[:, :, c] if dtype == "float8_e4m3fn" else np.ones_like(g, bool)
        np.testing.assert_array_equal(g[keep], want[keep], f"{dtype} part {c}")


def test_every_int4_code_converts_exactly_from_words_biased():
    """INT4 half-words read biased (the decode kernel's keys read as words): part c holds
    nibble c of every half-word plus INT4_BIAS, exactly; other codes refuse the bias."""
    got = convert_words(as_words("int4"), "int4", asm=util.ON_GPU, interpret=not util.ON_GPU,
                        biased=True)  # fmt: skip
    for c, (g, want) in enumerate(zip(got, expected_words("int4"), strict=True)):
        np.testing.assert_array_equal(np.asarray(g, np.float32), want + INT4_BIAS, f"part {c}")
    with pytest.raises(ValueError, match="biased"):
        words_to_values(as_words("int8"), "int8", jnp.bfloat16, asm=False, biased=True)


@pytest.mark.parametrize("dtype", list(WORD_DTYPES))
@pytest.mark.every_case
def test_packed_word_conversion_lowers_to_triton(dtype):
    spec = as_words(dtype)
    spec = jax.ShapeDtypeStruct(spec.shape, spec.dtype)
    fn = jax.jit(functools.partial(convert_words, dtype=dtype, asm=True, interpret=False))
    text = fn.trace(spec).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text.lower()
