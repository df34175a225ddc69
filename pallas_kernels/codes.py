"""Quantized cache codes to bfloat16 without conversion instructions (inline PTX).

The decode kernel turns every cached code into a bfloat16 value for the tensor cores. Done
one element at a time, Triton's conversions (FP8 goes e4m3 -> f16 -> f32 -> bf16; INT4
nibbles int -> float) run on Hopper's quarter-rate conversion units and cap the kernel
below the memory bandwidth.

Here one asm block takes a 32-bit register of four packed codes and builds the bit
patterns of floats whose value is the code plus a constant, with byte permutes and logic
operations, then removes the constant with one exact packed operation, the trick of
FasterTransformer's fast integer converters:

- FP8 e4m3 `s eeee mmm`: placed as `s 000 eeee mmm 0000` it is the bf16 with exponent
  `eeee` and mantissa `mmm` (subnormal codes: a bf16 subnormal), times 2**120 (the
  difference of the exponent biases, 127 - 7), one `fma.rn.bf16x2` (sm_80+). Codes are
  never NaN (writes saturate).
- INT4 nibble `n` (two's complement): the lane `0x4300 | (n ^ 8)` is the bf16
  `128 + n + 8`, plus -136 (`fma.rn.bf16x2`).
- INT8 code `c`: 9 significant bits do not fit a bf16 lane, so each becomes a float32
  first: `c ^ 0x80` under the bytes `0x4B 00 00` is `2**23 + c + 128`; one `sub.f32`
  leaves `c`, and `cvt.rn.bf16x2.f32` packs two (exact, |c| <= 128). (A bf16-only form,
  `0x4300 | low7` plus `0xC300 | sign`, ran slower than the plain cast: bench/HISTORY.md,
  run of 2026-11-22 12:45 UTC.)

Every value is exact, the same number as the plain cast, which interpret mode (the CPU)
computes instead: inline PTX runs on the GPU only. H100, B64 ctx16384 decode, speed
against the bf16 cache: FP8 1.48x -> 1.66x, INT4 1.63x -> 2.36x (bench/HISTORY.md, run of
12:56 UTC); INT8 1.57x -> 1.67x (probe of 2026-11-22 14:47 UTC, same machine and run for
both).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

# Byte permutes (`prmt` selectors) of the 4 codes of the input register: codes 0-1 (for
# output register $0) or 2-3 ($1) into the low byte of two 16-bit lanes, zeros above
# (INT4); or into their high byte, zeros below (FP8).
_LOW_BYTES = ("0x4140", "0x4342")
_HIGH_BYTES = ("0x1404", "0x3424")


def _program(constants: dict[str, str], steps: str, selectors, prelude: str = "") -> str:
    """One asm block: registers t, x, s, y, z (= 0) and `constants`, `prelude`, then
    `steps` once per output register ($0, $1, ...), with `{out}` and `{sel}` (its byte
    permute, or a tuple of them) filled in; the inputs follow the outputs (four codes in
    $2 after two outputs; two words in $1, $2 after one; two half-words in $1 after one)."""
    lines = [f".reg .b32 t, x, s, y, z, {', '.join(constants)};", "mov.b32 z, 0;"]
    lines += [f"mov.b32 {name}, {value};" for name, value in constants.items()]
    lines += [prelude] if prelude else []
    body = "".join(steps.format(out=f"${i}", sel=sel) for i, sel in enumerate(selectors))
    return "{\n" + "\n".join(lines) + "\n" + body + "}"


_FP8_CONSTANTS = dict(scale="0x7B807B80", zero="0x80008000")  # 2**120 and -0.0, twice
# From a lane holding a code in its high byte (t) to the bf16 value ({out}).
_FP8_LANES = """shr.b32 x, t, 4;
and.b32 x, x, 0x07F007F0;
and.b32 s, t, 0x80008000;
or.b32 x, x, s;
fma.rn.bf16x2 {out}, x, scale, zero;
"""
_FP8 = _program(_FP8_CONSTANTS, "prmt.b32 t, $2, z, {sel};\n" + _FP8_LANES, _HIGH_BYTES)

# INT4: low nibbles, high nibbles (the input shifted once); one result per asm block
# (Pallas lowers a multi-result `elementwise_inline_asm` to a single value). lop3 0x6A:
# (a & b) ^ c, the nibble and its lane's bits 0x4308 in one operation.
_INT4_CONSTANTS = dict(one="0x3F803F80", bias="0xC308C308", mask="0x000F000F", magic="0x43084308")
# INT4 biased by INT4_BIAS: the lanes' bits 0x4300 | (n ^ 8) are the bf16 128 + (n ^ 8) =
# n + 136 (two's complement n), exact; the FMA takes the 136 off.
INT4_BIAS = 136


def _int4_lanes(source: str, biased: bool = False) -> str:
    """Steps from a register whose lanes hold a nibble each at their bottom (`source`; bits
    above are masked off) to the bf16 values ({out}); `biased`: the values plus INT4_BIAS,
    without the FMA."""
    if biased:
        return f"lop3.b32 {{out}}, {source}, mask, magic, 0x6A;\n"
    return f"lop3.b32 x, {source}, mask, magic, 0x6A;\nfma.rn.bf16x2 {{out}}, x, one, bias;\n"


def _int4_programs(biased: bool) -> tuple:
    """The two INT4 programs of four bytes ($2): low nibbles, then high nibbles (the input
    shifted once)."""
    return tuple(
        _program(
            _INT4_CONSTANTS,
            f"prmt.b32 t, {source}, z, {{sel}};\n" + _int4_lanes("t", biased),
            _LOW_BYTES,
            prelude=prelude,
        )
        for source, prelude in (("$2", ""), ("y", "shr.b32 y, $2, 4;"))
    )


_INT4 = _int4_programs(biased=False)
_INT4_BIASED = _int4_programs(biased=True)


# INT8: the code's byte with its sign bit flipped (c + 128, unsigned) under the bytes
# 0x4B 00 00 is the float32 2**23 + c + 128; minus 2**23 + 128 it is c, exactly; two such
# float32 become one bf16x2 register (exact: |c| <= 128). Byte permutes: code k of x under
# the bytes of `high`.
_INT8_CONSTANTS = dict(high="0x4B000000")
# From two such float32 (t: the lower lane, s: the upper) to the bf16x2 {out}.
_INT8_PAIR = """sub.f32 t, t, 0f4B000080;
sub.f32 s, s, 0f4B000080;
cvt.rn.bf16x2.f32 {out}, s, t;
"""
_INT8 = _program(
    _INT8_CONSTANTS,
    "prmt.b32 t, x, high, {sel[0]};\nprmt.b32 s, x, high, {sel[1]};\n" + _INT8_PAIR,
    (("0x7540", "0x7541"), ("0x7542", "0x7543")),
    prelude="xor.b32 x, $2, 0x80808080;",
)


def _asm(code: str, raw):
    """bfloat16 values of the codes `raw` (4 per instance: two output registers)."""
    as_bytes = jax.lax.bitcast_convert_type(raw, jnp.int8)  # fp8 / uint8 -> raw bytes
    [values] = plgpu.elementwise_inline_asm(
        code,
        args=[as_bytes],
        constraints="=r,=r,r",
        pack=4,
        result_shape_dtypes=[jax.ShapeDtypeStruct(raw.shape, jnp.bfloat16)],
    )
    return values


def int4_nibbles(raw, dtype, biased: bool = False) -> list:
    """uint8 bytes `[block, Dp]` -> two tiles of `dtype` by plain casts: the low nibbles,
    then the high nibbles, as two's-complement values in [-8, 7] (`biased`: plus
    INT4_BIAS)."""
    wide = raw.astype(jnp.int32)  # bytes (uint8): zero-extended
    offset = INT4_BIAS - 8 if biased else -8
    return [((((wide >> shift) & 0xF) ^ 8) + offset).astype(dtype) for shift in (0, 4)]


def codes_to_bf16(raw, dtype: str, *, asm: bool, biased: bool = False) -> list:
    """Stored codes `[block, Dp]` (int8, float8_e4m3fn, or uint8 holding two INT4 nibbles)
    -> bfloat16 value tiles, unscaled: one, or two for INT4 (low nibbles, high nibbles;
    `biased`: plus INT4_BIAS, one instruction less a register).
    asm: the packed PTX conversion (GPU); else plain casts (interpret mode)."""
    if dtype == "int4":
        if not asm:
            return int4_nibbles(raw, jnp.bfloat16, biased)
        return [_asm(code, raw) for code in (_INT4_BIASED if biased else _INT4)]
    if asm:
        return [_asm(_FP8 if dtype == "float8_e4m3fn" else _INT8, raw)]
    return [raw.astype(jnp.bfloat16)]


# V tiles read as words (`cache_read.read_words`) of four codes: for 8-bit codes a 32-bit
# word holds channels 4j..4j+3 of one token; for INT4 a 16-bit half-word (two bytes) holds
# channels 2j, 2j+1 (low nibbles) and 2j + D/2, 2j + 1 + D/2 (high nibbles). Output part c
# gets code c of each word. One asm block takes two words (two tokens; `pack=2`) and gives
# their codes c as the two lanes of one bf16x2 register, by the conversions above.
def _word_int8(c: int) -> str:  # words already xor'ed with 0x80808080
    steps = "prmt.b32 t, $1, high, {sel};\nprmt.b32 s, $2, high, {sel};\n" + _INT8_PAIR
    return _program(_INT8_CONSTANTS, steps, (f"0x754{c}",))


def _word_fp8(c: int) -> str:  # the two codes c into the high bytes of the two lanes
    return _program(_FP8_CONSTANTS, "prmt.b32 t, $1, $2, {sel};\n" + _FP8_LANES,
                    (f"0x{4 + c}{4 + c}{c}{c}",))  # fmt: skip


def _word_int4(c: int, biased: bool = False) -> str:
    """Two half-words packed in $1 (bytes 0-1: the first token's, 2-3: the second's): nibble
    c of each (bits 8 (c % 2) + 4 (c // 2) of its half-word) shifted to the bottom of its
    lane, where the INT4 step's mask keeps it (no byte permute: the lanes line up);
    `biased`: the values plus INT4_BIAS."""
    shift = 8 * (c % 2) + 4 * (c // 2)
    source, prelude = ("$1", "") if shift == 0 else ("y", f"shr.b32 y, $1, {shift};")
    return _program(_INT4_CONSTANTS, _int4_lanes(source, biased), ("",), prelude=prelude)


_WORD_PROGRAMS = {"int8": _word_int8, "float8_e4m3fn": _word_fp8, "int4": _word_int4}


def words_to_values(words, code: str, dtype, *, asm: bool, biased: bool = False) -> list:
    """Words `[block, Dw]` of four codes each (`code`: int32 words of int8 or float8_e4m3fn,
    int16 half-words of int4 nibbles) -> four tiles `[block, Dw]` of `dtype`, part c
    holding each word's code c (module note above); every value exact. asm: the packed
    PTX conversion (GPU, `dtype` bfloat16); else shifts and one cast a part (interpret
    mode, and float16 / float32 queries). biased: INT4 only, the values plus INT4_BIAS."""
    if biased and code != "int4":
        raise ValueError(f"words_to_values: biased values are INT4's, not {code}'s")
    program = _WORD_PROGRAMS[code]
    if biased:
        program = functools.partial(program, biased=True)
    if asm:
        if dtype != jnp.bfloat16:
            raise ValueError(f"words_to_values: the PTX conversion gives bfloat16, not {dtype}")
        if code == "int8":
            words = words ^ jnp.int32(-0x7F7F7F80)  # 0x80808080: each code's sign bit
        # two half-words (int16) fill one register, two words two
        constraints = "=r,r" if words.dtype == jnp.int16 else "=r,r,r"
        return [
            plgpu.elementwise_inline_asm(
                program(c), args=[words], constraints=constraints, pack=2,
                result_shape_dtypes=[jax.ShapeDtypeStruct(words.shape, jnp.bfloat16)],
            )[0]
            for c in range(4)
        ]  # fmt: skip
    parts = []
    wide = words.astype(jnp.int32)
    for c in range(4):
        if code == "int4":
            nibble = (wide >> (8 * (c % 2) + 4 * (c // 2))) & 0xF
            parts.append(((nibble ^ 8) + ((INT4_BIAS if biased else 0) - 8)).astype(dtype))
            continue
        byte = (wide >> (8 * c)) & 0xFF
        if code == "int8":
            parts.append(((byte ^ 0x80) - 0x80).astype(dtype))
        else:
            fp8 = jax.lax.bitcast_convert_type(byte.astype(jnp.uint8), jnp.float8_e4m3fn)
            parts.append(fp8.astype(dtype))
    return parts
