"""Quantized cache codes to bfloat16 without conversion instructions (inline PTX).

The decode kernel turns every cached code into a bfloat16 value for the tensor cores. Done
one element at a time, Triton's conversions (FP8 goes e4m3 -> f16 -> f32 -> bf16; INT4
nibbles int -> float) run on Hopper's quarter-rate conversion units and cap the kernel
below the memory bandwidth.

Here one asm block takes a 32-bit register of four packed codes and builds the bfloat16
bit patterns of two 16-bit lanes at a time with byte permutes and logic operations, then
fixes the value with one exact packed bf16 FMA (`fma.rn.bf16x2`, sm_80+), the trick of
FasterTransformer's fast integer converters:

- FP8 e4m3 `s eeee mmm`: placed as `s 000 eeee mmm 0000` it is the bf16 with exponent
  `eeee` and mantissa `mmm` (subnormal codes: a bf16 subnormal), times 2**120 (the
  difference of the exponent biases, 127 - 7). Codes are never NaN (writes saturate).
- INT4 nibble `n` (two's complement): the lane `0x4300 | (n ^ 8)` is the bf16
  `128 + n + 8`, plus -136.
- INT8 keeps the plain cast: a packed form (`0x4300 | low7` plus `0xC300 | sign`) ran
  slower on the H100 (B64 ctx16384 decode 1.020 ms, RESULTS.md 12:45 UTC, against the
  plain cast's 0.929 ms at 12:56).

Every value is exact, the same number as the plain cast, which interpret mode (the CPU)
computes instead: inline PTX runs on the GPU only. H100, B64 ctx16384 decode (RESULTS.md,
12:56 UTC run): FP8 1.48x -> 1.66x the bf16 cache's speed, INT4 1.63x -> 2.36x.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

# Byte permutes (`prmt` selectors) of the 4 codes of the input register: codes 0-1 (for
# output register $0) or 2-3 ($1) into the low byte of two 16-bit lanes, zeros above
# (INT4); or into their high byte, zeros below (FP8).
_LOW_BYTES = ("0x4140", "0x4342")
_HIGH_BYTES = ("0x1404", "0x3424")


def _program(constants: dict[str, str], steps: str, selectors) -> str:
    """One asm block: registers t, x, s, z (= 0) and `constants`, then `steps` once per
    output register, with `{out}` and `{sel}` (its byte permute) filled in; `$2` is the
    input register (four codes)."""
    lines = [f".reg .b32 t, x, s, z, {', '.join(constants)};", "mov.b32 z, 0;"]
    lines += [f"mov.b32 {name}, {value};" for name, value in constants.items()]
    body = "".join(steps.format(out=f"${i}", sel=sel) for i, sel in enumerate(selectors))
    return "{\n" + "\n".join(lines) + "\n" + body + "}"


_FP8 = _program(
    dict(scale="0x7B807B80", zero="0x80008000"),  # 2**120 and -0.0, twice
    """prmt.b32 t, $2, z, {sel};
shr.b32 x, t, 4;
and.b32 x, x, 0x07F007F0;
and.b32 s, t, 0x80008000;
or.b32 x, x, s;
fma.rn.bf16x2 {out}, x, scale, zero;
""",
    _HIGH_BYTES,
)

# INT4: low nibbles, high nibbles; one result per asm block (Pallas lowers a multi-result
# `elementwise_inline_asm` to a single value).
_INT4 = tuple(
    _program(
        dict(one="0x3F803F80", bias="0xC308C308"),  # 1.0 and -136.0, twice
        f"""prmt.b32 t, $2, z, {{sel}};
shr.b32 x, t, {shift};
and.b32 x, x, 0x000F000F;
xor.b32 x, x, 0x43084308;
fma.rn.bf16x2 {{out}}, x, one, bias;
""",
        _LOW_BYTES,
    )
    for shift in (0, 4)
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


def codes_to_bf16(raw, dtype: str, *, asm: bool) -> list:
    """Stored codes `[block, Dp]` (int8, float8_e4m3fn, or uint8 holding two INT4 nibbles)
    -> bfloat16 value tiles, unscaled: one, or two for INT4 (low nibbles, high nibbles).
    asm: the packed PTX conversion (GPU); else plain casts (interpret mode)."""
    if dtype == "int4":
        if asm:
            return [_asm(code, raw) for code in _INT4]
        wide = raw.astype(jnp.int32)  # bytes (uint8): zero-extended
        # Two's-complement nibble n: (n ^ 8) - 8.
        return [((((wide >> shift) & 0xF) ^ 8) - 8).astype(jnp.bfloat16) for shift in (0, 4)]
    if asm and dtype == "float8_e4m3fn":
        return [_asm(_FP8, raw)]
    return [raw.astype(jnp.bfloat16)]  # INT8: the plain cast measured faster (module doc)
