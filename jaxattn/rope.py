"""Rotary position embeddings (RoPE): `RoPE` (static config), its scalings, `apply_rope`.

RoPE (Su et al., "RoFormer", arXiv:2104.09864, eq. 34) rotates each pair of channels
(c, partner(c)) of a query or key at position `pos` by the angle `pos * f[k]`, with the
inverse frequencies `f[k] = theta ** (-2k / rotary_dim)`, k < rotary_dim / 2. Then
`<rope(q, m), rope(k, n)>` depends on m - n only. Two channel pairings are in use:

- "neox" (GPT-NeoX, Llama; HF `rotate_half`): channel i pairs with i + rotary_dim / 2.
- "gptj" (GPT-J, the RoFormer paper; HF `rotate_every_two`): channel 2i pairs with 2i + 1.

Partial rotary (GPT-NeoX `rotary_ndims`, GPT-J `rotary_dim`, Phi `partial_rotary_factor`):
only the first `rotary_dim` channels rotate, the others pass through unchanged.

The scalings follow Hugging Face transformers' `modeling_rope_utils` (the function named
in each class), computed here in float64 and rounded once to float32.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jaxattn.int32 import is_int
from jaxattn.shapes import broadcasts_into

__all__ = [
    "ChannelTables",
    "DynamicNTKScaling",
    "LinearScaling",
    "Llama3Scaling",
    "RoPE",
    "TokenRotations",
    "YarnScaling",
    "apply_rope",
    "rotation_tables",
    "token_rotations",
]

STYLES = ("neox", "gptj")


def _require(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


def _check_factor(obj) -> None:
    name, factor = type(obj).__name__, obj.factor
    if isinstance(factor, bool) or not isinstance(factor, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name}: factor={factor!r} must be a real number >= 1")
    _require(1.0 <= factor < math.inf, f"{name}: factor={factor} must be finite and >= 1")


def _check_positive_int(obj, field: str) -> None:
    value = getattr(obj, field)
    ok = is_int(value) and value >= 1
    _require(ok, f"{type(obj).__name__}: {field}={value!r} must be an int >= 1")


def _default_inv_freq(theta: float, dim: int) -> np.ndarray:
    """`theta ** (-2k / dim)`, float64 `[dim // 2]` (HF `_compute_default_rope_parameters`)."""
    return theta ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)


@dataclasses.dataclass(frozen=True)
class LinearScaling:
    """Position interpolation (Chen et al. 2023, arXiv:2306.15595; /u/kaiokendev):
    positions / factor, i.e. `f / factor`. HF `_compute_linear_scaling_rope_parameters`."""

    factor: float

    def __post_init__(self):
        _check_factor(self)

    def inv_freq(self, theta: float, dim: int) -> np.ndarray:
        return _default_inv_freq(theta, dim) / self.factor


@dataclasses.dataclass(frozen=True)
class Llama3Scaling:
    """Llama 3.1's frequency-dependent interpolation, HF `_compute_llama3_parameters`.

    With wavelength `w = 2 pi / f` and L = original_max_position_embeddings: `f` is kept
    where `w < L / high_freq_factor`, divided by `factor` where `w > L / low_freq_factor`,
    and in between blended as `(1 - s) f / factor + s f`, `s = (L / w - low) / (high - low)`.
    """

    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        _check_factor(self)
        _check_positive_int(self, "original_max_position_embeddings")
        _require(
            0 < self.low_freq_factor < self.high_freq_factor,
            f"Llama3Scaling: need 0 < low_freq_factor < high_freq_factor, got "
            f"low_freq_factor={self.low_freq_factor}, high_freq_factor={self.high_freq_factor}",
        )

    def inv_freq(self, theta: float, dim: int) -> np.ndarray:
        f = _default_inv_freq(theta, dim)
        context = self.original_max_position_embeddings
        wavelen = 2 * math.pi / f
        smooth = (context / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        blended = (1 - smooth) * f / self.factor + smooth * f
        low_freq = wavelen > context / self.low_freq_factor
        high_freq = wavelen < context / self.high_freq_factor
        return np.where(low_freq, f / self.factor, np.where(high_freq, f, blended))


def _mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction `0.1 * mscale * ln(factor) + 1` (HF `get_mscale`)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclasses.dataclass(frozen=True)
class YarnScaling:
    """YaRN (Peng et al. 2023, arXiv:2309.00071), HF `_compute_yarn_parameters`.

    Frequencies that rotate more than `beta_fast` times over the original context keep `f`
    (extrapolation), those that rotate fewer than `beta_slow` times get `f / factor`
    (interpolation), with a linear ramp over the channels in between (`find_correction_range`,
    `linear_ramp_factor`; `truncate` floors/ceils the range as HF does by default). cos and
    sin are multiplied by `attention_factor`, by default HF's `get_mscale`:
    `0.1 * ln(factor) + 1`, or `get_mscale(factor, mscale) / get_mscale(factor,
    mscale_all_dim)` when both are set (DeepSeek-V2/V3).
    """

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self):
        _check_factor(self)
        _check_positive_int(self, "original_max_position_embeddings")
        _require(
            0 < self.beta_slow <= self.beta_fast,
            f"YarnScaling: need 0 < beta_slow <= beta_fast, got beta_slow={self.beta_slow}, "
            f"beta_fast={self.beta_fast}",
        )
        _require(
            self.attention_factor is None or self.attention_factor > 0,
            f"YarnScaling: attention_factor={self.attention_factor} must be > 0",
        )

    @property
    def cos_sin_factor(self) -> float:
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return _mscale(self.factor, self.mscale) / _mscale(self.factor, self.mscale_all_dim)
        return _mscale(self.factor)

    def _correction_range(self, theta: float, dim: int) -> tuple[float, float]:
        """Channel-pair indices where `f` makes `beta_fast` / `beta_slow` turns over L."""

        def pair_index(rotations: float) -> float:  # inverse of rotations(f_k) over L
            turns = self.original_max_position_embeddings / (rotations * 2 * math.pi)
            return dim * math.log(turns) / (2 * math.log(theta))

        low, high = pair_index(self.beta_fast), pair_index(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        return max(low, 0), min(high, dim - 1)

    def inv_freq(self, theta: float, dim: int) -> np.ndarray:
        f = _default_inv_freq(theta, dim)
        low, high = self._correction_range(theta, dim)
        high = high + 0.001 if low == high else high  # HF: "prevent singularity"
        ramp = np.clip((np.arange(dim // 2) - low) / (high - low), 0.0, 1.0)
        return f / self.factor * ramp + f * (1 - ramp)


@dataclasses.dataclass(frozen=True)
class DynamicNTKScaling:
    """Dynamic NTK-aware scaling (/u/bloc97, /u/emozilla), HF `_compute_dynamic_ntk_parameters`.

    For a current sequence length `seq_len > L = original_max_position_embeddings` the base
    grows to `theta * (factor * seq_len / L - (factor - 1)) ** (dim / (dim - 2))`; up to L it
    is `theta`. `apply_rope` takes `seq_len = max(positions) + 1` by default (HF's
    `dynamic_rope_update` without its cache of the longest length seen).
    """

    factor: float
    original_max_position_embeddings: int

    def __post_init__(self):
        _check_factor(self)
        _check_positive_int(self, "original_max_position_embeddings")

    def inv_freq(self, theta: float, dim: int, seq_len) -> Float[Array, " K"]:
        # theta' ** (-2k / dim) = theta ** (-2k / dim) * s ** (-2k / (dim - 2)): only the
        # power of s depends on seq_len (possibly traced).
        _require(dim > 2, f"DynamicNTKScaling: rotary_dim={dim} must be > 2")
        context = self.original_max_position_embeddings
        length = jnp.maximum(jnp.asarray(seq_len, jnp.float32), context)
        s = self.factor * length / context - (self.factor - 1)
        exponent = (-np.arange(0, dim, 2) / (dim - 2)).astype(np.float32)
        return jnp.asarray(_default_inv_freq(theta, dim), jnp.float32) * s[..., None] ** exponent


_SCALINGS = (LinearScaling, Llama3Scaling, YarnScaling, DynamicNTKScaling)


class ChannelTables(NamedTuple):
    """Per-channel constants, numpy `[D]` each, of the elementwise form of RoPE:

    `out[c] = a * (x[c] * cos(pos * f[freq_index[c]])
                   + sign[c] * x[partner[c]] * sin(pos * f[freq_index[c]]))` if `rotates[c]`,
    `out[c] = x[c]` otherwise (a = `RoPE.attention_factor`). For "neox" the partner is a roll
    by rotary_dim / 2 inside the rotary channels; for "gptj" a swap of neighbours.
    Pass-through channels have partner c, sign 0 and freq_index 0.
    """

    partner: np.ndarray  # int32
    sign: np.ndarray  # float32, -1 / +1 / 0
    freq_index: np.ndarray  # int32, into inv_freq
    rotates: np.ndarray  # bool


@dataclasses.dataclass(frozen=True)
class RoPE:
    """Rotary position embedding config: frozen, hashable, a static jit argument.

    Attributes:
      theta: base of the inverse frequencies (`rope_theta`; Llama 3: 500000).
      style: "neox" (rotate halves) or "gptj" (rotate every two), see the module doc.
      rotary_dim: channels that rotate (even); None = all of head_dim.
      scaling: None, LinearScaling, Llama3Scaling, YarnScaling or DynamicNTKScaling.
    """

    theta: float = 10000.0
    style: str = "neox"
    rotary_dim: int | None = None
    scaling: LinearScaling | Llama3Scaling | YarnScaling | DynamicNTKScaling | None = None

    def __post_init__(self):
        _require(self.style in STYLES, f"RoPE: style={self.style!r}: expected one of {STYLES}")
        _require(1 < self.theta < math.inf, f"RoPE: theta={self.theta} must be finite and > 1")
        if self.rotary_dim is not None:
            _check_positive_int(self, "rotary_dim")
            _require(self.rotary_dim % 2 == 0, f"RoPE: rotary_dim={self.rotary_dim} must be even")
        _require(
            self.scaling is None or isinstance(self.scaling, _SCALINGS),
            f"RoPE: scaling={self.scaling!r}: expected None or one of "
            f"{[s.__name__ for s in _SCALINGS]}",
        )

    def rotary_dim_for(self, head_dim: int) -> int:
        """The number of rotating channels for this head_dim (checked against it)."""
        if self.rotary_dim is None:
            _require(head_dim % 2 == 0, f"RoPE: {head_dim=} is odd; set an even rotary_dim")
            return head_dim
        _require(self.rotary_dim <= head_dim, f"RoPE: rotary_dim={self.rotary_dim} > {head_dim=}")
        return self.rotary_dim

    @property
    def attention_factor(self) -> float:
        """The factor on cos and sin: YaRN's, 1.0 for every other scaling."""
        if isinstance(self.scaling, YarnScaling):
            return self.scaling.cos_sin_factor
        return 1.0

    def inv_freq(self, head_dim: int, seq_len=None) -> Float[Array, "*N K"]:
        """float32 `[rotary_dim // 2]` inverse frequencies `f[k]`, scaled.

        `seq_len` (int, or a traced int array `[*N]`: one length per token or row, giving
        `[*N, K]`) is read by DynamicNTKScaling only; None means "within the original
        context" (no scaling), as in HF at init time.
        """
        dim = self.rotary_dim_for(head_dim)
        if isinstance(self.scaling, DynamicNTKScaling):
            length = self.scaling.original_max_position_embeddings if seq_len is None else seq_len
            return self.scaling.inv_freq(self.theta, dim, length)
        if self.scaling is None:
            f = _default_inv_freq(self.theta, dim)
        else:
            f = self.scaling.inv_freq(self.theta, dim)
        return jnp.asarray(f, jnp.float32)

    def channel_tables(self, head_dim: int) -> ChannelTables:
        """The per-channel partner / sign / frequency index / rotates mask, see ChannelTables."""
        dim = self.rotary_dim_for(head_dim)
        c = np.arange(dim)
        if self.style == "neox":
            half = dim // 2
            first = c < half
            partner, freq_index = np.where(first, c + half, c - half), c % half
        else:
            first = c % 2 == 0
            partner, freq_index = c ^ 1, c // 2
        rest = np.arange(dim, head_dim)
        return ChannelTables(
            partner=np.concatenate([partner, rest]).astype(np.int32),
            sign=np.concatenate([np.where(first, -1.0, 1.0), 0 * rest]).astype(np.float32),
            freq_index=np.concatenate([freq_index, 0 * rest]).astype(np.int32),
            rotates=np.arange(head_dim) < dim,
        )


def _check_seq_len(fn: str, seq_len, rope: RoPE, shape: tuple) -> None:
    """DynamicNTKScaling's `seq_len` broadcasts into `shape` (the tokens' dims) without
    growing it: the tables it gives must not outgrow the tokens they rotate."""
    if seq_len is None or not isinstance(rope.scaling, DynamicNTKScaling):
        return
    ok = broadcasts_into(jnp.shape(seq_len), shape)
    _require(ok, f"{fn}: seq_len shape {jnp.shape(seq_len)} must broadcast into {shape}")


def _check_inputs(x, positions) -> None:
    _require(x.ndim >= 3, f"apply_rope: x.shape={x.shape}: expected [..., T, H, D]")
    _require(
        jnp.issubdtype(x.dtype, jnp.floating),
        f"apply_rope: x.dtype={x.dtype}: expected a float dtype",
    )
    _require(
        jnp.issubdtype(positions.dtype, jnp.integer),
        f"apply_rope: positions.dtype={positions.dtype}: expected an integer dtype",
    )
    _require(
        broadcasts_into(positions.shape + (1, 1), x.shape) and positions.ndim >= 1,
        f"apply_rope: {x.shape=} and {positions.shape=}: positions [..., T] must broadcast "
        "against x [..., T, H, D] (heads and head_dim excluded)",
    )


def rotation_tables(
    positions: Int[Array, "*N"], rope: RoPE, head_dim: int, *, seq_len=None
) -> tuple[Float[Array, "*N D"], Float[Array, "*N D"]]:
    """float32 `(cos, sin)` of each channel's angle at `positions`, attention factor folded
    in; 1 and 0 on pass-through channels. The angles are float32 `pos * f`, as HF's cos/sin
    tables (off by ~2 ulps of pos * f: 1e-2 at 1e5). `seq_len`: DynamicNTKScaling's current
    length, an int or int array broadcasting against `positions` (each token's sequence
    length: tokens of sequences of other lengths then rotate apart), default
    `max(positions) + 1` over all of them (HF's, over its batch)."""
    tables = rope.channel_tables(head_dim)
    if seq_len is None and isinstance(rope.scaling, DynamicNTKScaling) and positions.size:
        seq_len = jnp.max(positions) + 1
    freq = rope.inv_freq(head_dim, seq_len)[..., tables.freq_index]  # [*N or 1, D]
    angle = positions[..., None].astype(jnp.float32) * freq
    factor = rope.attention_factor
    cos = jnp.where(tables.rotates, jnp.cos(angle) * factor, 1.0)
    sin = jnp.where(tables.rotates, jnp.sin(angle) * factor, 0.0)
    return cos.astype(jnp.float32), sin.astype(jnp.float32)


class TokenRotations(NamedTuple):
    """RoPE of given tokens as `out = x * cos + x[partner] * sin` (float32), for a kernel
    that rotates its queries on load: `cos`, `sin` float32 `[T, D]` (attention factor and
    partner sign folded in; 1 and 0 on pass-through channels), `partner` int32 `[D]`."""

    cos: Float[Array, "T D"]
    sin: Float[Array, "T D"]
    partner: Int[Array, " D"]


def token_rotations(
    positions: Int[Array, " T"], rope: RoPE, head_dim: int, *, seq_len=None
) -> TokenRotations:
    """`TokenRotations` of tokens at `positions`, the angles and factors of `apply_rope`
    (its `seq_len` default too)."""
    tables = rope.channel_tables(head_dim)
    positions = jnp.asarray(positions)
    _check_seq_len("token_rotations", seq_len, rope, positions.shape)
    cos, sin = rotation_tables(positions, rope, head_dim, seq_len=seq_len)
    return TokenRotations(cos, tables.sign * sin, jnp.asarray(tables.partner))


def apply_rope(
    x: Float[Array, "*B T H D"],
    positions: Int[Array, "*#B #T"],
    rope: RoPE,
    *,
    seq_len: int | Int[Array, "*#B #T"] | None = None,
) -> Float[Array, "*B T H D"]:
    """Rotates the channels of `x` by the position of each token (RoFormer, eq. 34).

    Args:
      x: float `[..., T, H, D]` queries or keys, any leading dims.
      positions: int `[..., T]` absolute position of each token, broadcast over heads (and
        against x's leading dims); any order, any values below 2**24.
      rope: the static config.
      seq_len: the current sequence length for DynamicNTKScaling: an int, or an int array
        broadcasting into x's `[..., T]` (each token's or row's own length); default
        `max(positions) + 1` over the whole call (HF's rule, over its batch). Ignored
        otherwise.

    Returns:
      `x`'s shape and dtype. Computed in float32 with the elementwise form of
      `ChannelTables` (a gather of the partner channel), as a kernel does on load.
    """
    x, positions = jnp.asarray(x), jnp.asarray(positions)
    _check_inputs(x, positions)
    _check_seq_len("apply_rope", seq_len, rope, x.shape[:-2])
    head_dim = x.shape[-1]
    tables = rope.channel_tables(head_dim)
    cos, sin = rotation_tables(positions, rope, head_dim, seq_len=seq_len)
    cos, sin = cos[..., None, :], sin[..., None, :]  # [..., T, 1, D]
    xf = x.astype(jnp.float32)
    partner = jnp.take(xf, tables.partner, axis=-1)  # [..., T, H, D]
    rotated = xf * cos + tables.sign * partner * sin
    return jnp.where(tables.rotates, rotated, xf).astype(x.dtype)
