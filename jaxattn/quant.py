"""KV-cache quantization: INT8, FP8 (e4m3fn) and INT4, with per-tensor or per-group scales.

Formats (`KVQuant.dtype`), all symmetric (no zero point):

  dtype             storage             values               qmax
  "int8"            int8                -127..127 integers   127
  "float8_e4m3fn"   float8_e4m3fn       e4m3fn grid          448
  "int4"            uint8, two a byte   -7..7 integers       7

Quantize: `y = x / scale` (per-tensor: `x * (1/scale)`, as TensorRT-LLM), then integers
round half to even and saturate to `[-qmax, qmax]`; fp8 saturates to `[-448, 448]` and
the cast rounds to nearest even (e4m3fn has no inf: an unclipped overflow would be NaN).
With group scales the rounding is the exact quotient's, whatever XLA's division gives
(`_exact_quotient`).
Dequantize: `q.astype(float32) * scale` in float32, then a cast to the requested dtype.
Inputs must be finite (and, for per-group scales, below ~3.3e38 in magnitude: a scale
rounded up to bf16 times qmax must stay a finite float32).

Scales (`KVQuant.granularity`):
  "tensor": one float32 scalar (shape `[]`) for all of K and one for all of V, given by
    the user (e.g. from `calibrate_kv_scales`: `amax / qmax`) and fixed for the cache's
    life (TensorRT-LLM's `kv_cache_scaling_factor`).
  "group": one scale per token, kv head and group of `group_size` consecutive channels
    of head_dim (OpenPPL's quant_group; `group_size=None` = the whole head_dim),
    computed on write as `max(amax / qmax, TINY_SCALE)` and stored as bfloat16
    `[..., num_groups]`. Quantization divides by the *stored* (bf16-rounded) scale, so
    dequantization uses exactly the scale that quantization used. The amax element may
    then land a hair (<= 2**-9 relative) above qmax and saturate; its error stays within
    the format's rounding error (scale/2 for the integers).
Scales are never zero, inf or NaN for finite inputs: an all-zero (or tiny) group gets
`TINY_SCALE = 2**-64`, a normal bf16 and float32 value well clear of the subnormals (which
XLA on CPU may flush to zero) and far below any value that matters in attention.

INT4 packing (the decode kernel depends on it): byte j of a token-head row of D channels
holds channel j in the low nibble and channel j + D/2 in the high nibble, each a
two's-complement 4-bit value. Splitting the row in halves (rather than pairing
neighbours) lets a kernel use the low nibbles as channels 0..D/2-1 and the high ones as
D/2..D-1 (e.g. `q[:D/2] . low + q[D/2:] . high`) with no interleaving shuffle.

Accuracy of decode attention on a quantized cache (`paged_decode_reference`; K/V standard
normal, D=64, 1 to 32 tokens; per-tensor scales from `calibrate_kv_scales`): relative
Frobenius error of the output against the unquantized float32 result, typical over seeds
(tests/test_quant.py measures it and allows ~1.6x the worst seed):

  format   tensor   group(None)   group(32)
  int8     0.9 %    0.6 %         0.6 %
  fp8      2.8 %    2.7 %         2.6 %
  int4     17 %     12 %          10 %

fp8's error is that of its 3-bit mantissa (up to 2**-4 relative per value) whatever the
scale; the integer formats gain from per-group scales, which follow each token's range.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, Shaped

from jaxattn.int32 import is_int
from jaxattn.shapes import broadcasts_into

__all__ = [
    "TINY_SCALE",
    "KVQuant",
    "calibrate_kv_scales",
    "dequantize",
    "group_amax",
    "group_scales",
    "pack_int4",
    "quantize",
    "unpack_int4",
]

TINY_SCALE = 2.0**-64  # the smallest scale ever used (normal in bf16 and float32)

_STORAGE = {"int8": jnp.int8, "float8_e4m3fn": jnp.float8_e4m3fn, "int4": jnp.uint8}
_QMAX = {"int8": 127, "float8_e4m3fn": 448, "int4": 7}
_GRANULARITIES = ("tensor", "group")


def _dtype_name(dtype) -> str:
    """The format name of a string or a dtype (jnp.int4 -> "int4"); ValueError otherwise."""
    if isinstance(dtype, str):
        name = dtype
    else:
        try:
            name = jnp.dtype(dtype).name
        except TypeError:
            name = repr(dtype)
    if name not in _STORAGE:
        raise ValueError(
            f"KVQuant: dtype={name!r} is not supported; expected one of {list(_STORAGE)}"
        )
    return name


@dataclasses.dataclass(frozen=True)
class KVQuant:
    """How a KV cache is quantized: a static, hashable config.

    Attributes:
      dtype: "int8", "float8_e4m3fn" or "int4" (jnp.int8 / jnp.float8_e4m3fn / jnp.int4
        are accepted and normalised to these strings).
      granularity: "tensor" (one float32 scale for K, one for V) or "group" (a bf16 scale
        per token, kv head and `group_size` channels).
      group_size: channels per group ("group" only); None = the whole head_dim.
    """

    dtype: str
    granularity: str = "tensor"
    group_size: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "dtype", _dtype_name(self.dtype))
        if self.granularity not in _GRANULARITIES:
            raise ValueError(
                f"KVQuant: granularity={self.granularity!r} is not supported; "
                f"expected one of {list(_GRANULARITIES)}"
            )
        if self.group_size is None:
            return
        if self.granularity != "group":
            raise ValueError(
                f"KVQuant: group_size={self.group_size} needs granularity='group', "
                f"got {self.granularity!r}"
            )
        size = self.group_size
        if not is_int(size) or size < 1:
            raise ValueError(f"KVQuant: group_size={size!r} must be a positive int")

    @property
    def storage_dtype(self):
        """dtype of the stored values (int4: uint8 holding two values)."""
        return jnp.dtype(_STORAGE[self.dtype])

    @property
    def qmax(self) -> int:
        """Largest stored magnitude: 127, 448 (fp8's max) or 7 (int4 uses -7..7)."""
        return _QMAX[self.dtype]

    def check(self, head_dim: int) -> None:
        """ValueError unless `head_dim` splits into groups (and into bytes, for int4)."""
        if self.dtype == "int4" and head_dim % 2:
            raise ValueError(f"KVQuant(dtype='int4'): {head_dim=} must be even (2 a byte)")
        if self.group_size is not None and head_dim % self.group_size:
            raise ValueError(f"KVQuant: group_size={self.group_size} must divide {head_dim=}")

    def packed_dim(self, head_dim: int) -> int:
        """Stored values per token-head row: D, or D // 2 for int4."""
        return head_dim // 2 if self.dtype == "int4" else head_dim

    def unpacked_dim(self, packed_dim: int) -> int:
        """The inverse of `packed_dim`: head_dim from the pool's last axis."""
        return 2 * packed_dim if self.dtype == "int4" else packed_dim

    def num_groups(self, head_dim: int) -> int:
        """Scales per token-head row: head_dim // group_size (1 for "tensor" or None)."""
        self.check(head_dim)
        return head_dim // (self.group_size or head_dim)


# ---------------------------------------------------------------- int4 packing
def pack_int4(x: Int[Array, "... D"]) -> Int[Array, "... Dp"]:
    """Integers in [-8, 7] `[..., D]` -> uint8 `[..., Dp = D // 2]`: byte j holds channel j in
    its low nibble and channel j + D/2 in its high nibble (two's complement)."""
    if x.shape[-1] % 2:
        raise ValueError(f"pack_int4: {x.shape=}: the last axis (head_dim) must be even")
    half = x.shape[-1] // 2
    nibbles = jax.lax.bitcast_convert_type(x.astype(jnp.int8), jnp.uint8) & 0xF
    return nibbles[..., :half] | (nibbles[..., half:] << 4)


def unpack_int4(packed: Int[Array, "... Dp"]) -> Int[Array, "... D"]:
    """uint8 `[..., Dp]` -> int8 `[..., D = 2 * Dp]`, the inverse of `pack_int4`."""
    if packed.dtype != jnp.uint8:
        raise ValueError(f"unpack_int4: {packed.dtype=}: INT4 storage is uint8 (two a byte)")

    def signed(nibble):  # 0..15 -> -8..7
        return (nibble.astype(jnp.int8) ^ 8) - 8

    return jnp.concatenate([signed(packed & 0xF), signed(packed >> 4)], axis=-1)


# ---------------------------------------------------------------- scales
def _per_channel(scale: Float[Array, "... G"], head_dim: int) -> Float[Array, "... D"]:
    """Each group's scale repeated over its channels (float32)."""
    group = head_dim // scale.shape[-1]
    return jnp.repeat(scale.astype(jnp.float32), group, axis=-1)


def group_amax(x: Float[Array, "... D"], quant: KVQuant) -> Float[Array, "... G"]:
    """float32 `max |x|` over each group of `group_size` consecutive channels."""
    head_dim = x.shape[-1]
    groups = quant.num_groups(head_dim)
    xg = x.astype(jnp.float32).reshape(*x.shape[:-1], groups, head_dim // groups)
    return jnp.max(jnp.abs(xg), axis=-1)


def group_scales(x: Float[Array, "... D"], quant: KVQuant) -> Float[Array, "... G"]:
    """Per-group scales of `x`, bfloat16 `[..., num_groups]`: `max(amax / qmax, TINY_SCALE)`
    over each group of `group_size` consecutive channels."""
    scale = jnp.maximum(group_amax(x, quant) / quant.qmax, TINY_SCALE)
    # Round to bf16 explicitly: XLA may drop a float32 -> bf16 -> float32 round trip
    # (excess precision, on by default on GPUs), and `quantize` in the same jitted program
    # would then divide by the unrounded scale while the bf16 one is stored.
    return jax.lax.reduce_precision(scale, exponent_bits=8, mantissa_bits=7).astype(jnp.bfloat16)


def calibrate_kv_scales(
    k: Float[Array, "*k_shape"], v: Float[Array, "*v_shape"], quant: KVQuant
) -> tuple[Float[Array, ""], Float[Array, ""]]:
    """Per-tensor scales from sample K and V (any shapes): float32 `amax / qmax` each,
    never below `TINY_SCALE`. Non-finite samples are left out of the amax (a NaN or inf
    one would make the scale NaN or inf, and with it every value of the cache)."""

    def scale(x):
        x = jnp.abs(x.astype(jnp.float32))
        amax = jnp.max(jnp.where(jnp.isfinite(x), x, 0.0))
        return jnp.maximum(amax / quant.qmax, TINY_SCALE)

    return scale(k), scale(v)


def _check_scale(scale, quant: KVQuant, lead: tuple, head_dim: int) -> None:
    """A ValueError naming `scale` unless it is a float array that broadcasts against the
    values' leading axes `lead` (per group: with a last axis of num_groups)."""
    if not jnp.issubdtype(scale.dtype, jnp.floating):
        raise ValueError(f"{scale.dtype=}: scales are float")
    group = quant.granularity == "group"
    if group and scale.shape[-1:] != (quant.num_groups(head_dim),):
        raise ValueError(
            f"{scale.shape=}: per-group scales need a last axis of num_groups="
            f"{quant.num_groups(head_dim)} (head_dim={head_dim}, group_size={quant.group_size})"
        )
    own, values = (scale.shape[:-1], lead) if group else (scale.shape, (*lead, head_dim))
    if not broadcasts_into(own, values):
        raise ValueError(f"{scale.shape=}: does not broadcast against the values {values}")


# ---------------------------------------------------------------- quantize / dequantize
def _round_e4m3fn(y: Float[Array, "*shape"], mantissa_bits: int = 3) -> Float[Array, "*shape"]:
    """float32 `y` (|y| <= 448) rounded to the nearest float8_e4m3fn value, ties to even,
    still float32; the cast to fp8 is then exact. `mantissa_bits=4`: to the grid of those
    values and their midpoints (`_exact_quotient`'s boundaries).

    The convert alone would round the same way, but XLA on GPU drops a float32 -> fp8 ->
    float32 convert pair inside one jitted program (excess precision, on by default), so
    `dequantize(quantize(x))` there would return x unrounded. Normals keep 3 mantissa bits
    (e5m3's rounding is e4m3fn's on its normal range, 2**-6..448); below 2**-6 the values
    are multiples of 2**-9 (e4m3fn's subnormals).
    """
    normal = jax.lax.reduce_precision(y, exponent_bits=5, mantissa_bits=mantissa_bits)
    steps = 2.0 ** (6 + mantissa_bits)  # subnormal steps per unit: 512 for e4m3fn's own
    subnormal = jnp.round(y * steps) * (1.0 / steps)
    return jnp.where(jnp.abs(y) < 2.0**-6, subnormal, normal)


def _exact_quotient(x: Float[Array, "*s"], y: Float[Array, "*s"], s, fp8: bool):
    """`y`, an approximation of `x / s` within an ulp or two, moved to the side of the
    rounding boundary next to it that `x / s` is on, and onto that boundary exactly at a
    tie; so rounding the result rounds `x / s` itself (s > 0).

    XLA's division is free to be an ulp off: it rewrites `x / broadcast(s)` as
    `x * (1 / s)`, and on GPU divides approximately; a tie (x / s = k + 1/2 for the
    integers, the midpoint of two e4m3fn values for FP8) then rounded to the odd code. The
    boundary `m` next to y (a half-integer; for FP8 y rounded to 4 mantissa bits, or to a
    multiple of 2**-10 among the subnormals) is compared with x as `m * s`, exact for bf16
    and float16 scales (m has at most 9 significant bits). With float32 scales the product
    rounds, so a quotient within an ulp of m may still fall on either side.
    """
    m = _round_e4m3fn(y, mantissa_bits=4) if fp8 else jnp.floor(y) + 0.5
    t = m * s
    up, down = jnp.nextafter(m, jnp.inf), jnp.nextafter(m, -jnp.inf)
    return jnp.where(x > t, jnp.maximum(y, up), jnp.where(x < t, jnp.minimum(y, down), m))


def quantize(
    x: Float[Array, "... D"], scale: Float[Array, "*shape"], quant: KVQuant
) -> Shaped[Array, "... Dp"]:
    """`x` `[..., D]` (float) -> stored values `[..., packed_dim(D)]` of `storage_dtype`.

    scale: float32 `[]` (or broadcastable to x) for "tensor"; `[..., num_groups]` (bf16 from
    `group_scales`, broadcastable against x's leading axes) for "group". Every scale must
    be >= TINY_SCALE, as `group_scales`, `calibrate_kv_scales` and the caches' checks
    ensure: below it (0) zeros quantize to NaN. Not checked here (the values may be
    traced).
    """
    x, scale = x.astype(jnp.float32), jnp.asarray(scale)
    quant.check(x.shape[-1])
    _check_scale(scale, quant, x.shape[:-1], x.shape[-1])
    fp8 = quant.dtype == "float8_e4m3fn"
    if quant.granularity == "tensor":
        y = x * (1.0 / scale.astype(jnp.float32))  # the product is the definition
    else:
        s = _per_channel(scale, x.shape[-1])
        y = _exact_quotient(x, x / s, s, fp8)
    if fp8:
        return _round_e4m3fn(jnp.clip(y, -quant.qmax, quant.qmax)).astype(jnp.float8_e4m3fn)
    q = jnp.clip(jnp.round(y), -quant.qmax, quant.qmax).astype(jnp.int8)
    return pack_int4(q) if quant.dtype == "int4" else q


def dequantize(
    data: Shaped[Array, "... Dp"], scale: Float[Array, "*shape"], quant: KVQuant, dtype=jnp.float32
) -> Float[Array, "... D"]:
    """Stored values `[..., packed_dim(D)]` -> `[..., D]` of `dtype`, computed in float32 as
    `q * scale` (scale as in `quantize`)."""
    if data.dtype != quant.storage_dtype:
        raise ValueError(f"dequantize: {data.dtype=}: {quant} stores {quant.storage_dtype}")
    scale = jnp.asarray(scale)
    q = unpack_int4(data) if quant.dtype == "int4" else data
    head_dim = q.shape[-1]
    _check_scale(scale, quant, q.shape[:-1], head_dim)
    if quant.granularity == "group":
        scale = _per_channel(scale, head_dim)
    return (q.astype(jnp.float32) * scale.astype(jnp.float32)).astype(dtype)
