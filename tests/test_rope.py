"""RoPE (`RoPE`, `apply_rope`) against a float64 numpy oracle that transcribes Hugging Face
transformers as written: Llama's `rotate_half` / `apply_rotary_pos_emb` with
`cos/sin = cat(freqs, freqs)` ("neox"), GPT-J's `rotate_every_two` / `apply_rotary_pos_emb`
with repeat-interleaved sin/cos ("gptj"), GPT-NeoX's partial rotary, and the inverse
frequencies of `modeling_rope_utils` (`_compute_default_rope_parameters`, `..._linear_...`,
`_compute_llama3_parameters`, `_compute_yarn_parameters`, `_compute_dynamic_ntk_parameters`).
`apply_rope` uses the per-channel partner/sign form instead, so the two share no formula.
Then the properties of a rotation (norms; dot products depend on m - n only) and bad input.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import util

from jaxattn.rope import (
    DynamicNTKScaling,
    LinearScaling,
    Llama3Scaling,
    RoPE,
    YarnScaling,
    apply_rope,
    token_rotations,
)

# --------------------------------------------- oracle: inverse frequencies (HF, float64)


def hf_default_inv_freq(base, dim):
    return 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float64) / dim))


def hf_linear_inv_freq(base, dim, factor):
    inv_freq = hf_default_inv_freq(base, dim)
    inv_freq /= factor
    return inv_freq


def hf_dynamic_ntk_inv_freq(base, dim, factor, max_position_embeddings, seq_len=None):
    # seq_len: default to max_position_embeddings, e.g. at init time
    seq_len = (
        seq_len
        if seq_len is not None and seq_len > max_position_embeddings
        else max_position_embeddings
    )
    base = base * ((factor * seq_len / max_position_embeddings) - (factor - 1)) ** (dim / (dim - 2))
    return 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float64) / dim))


def hf_llama3_inv_freq(base, dim, factor, low_freq_factor, high_freq_factor, old_context_len):
    inv_freq = hf_default_inv_freq(base, dim)
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (
        high_freq_factor - low_freq_factor
    )
    smoothed_inv_freq = (
        1 - smooth_factor
    ) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return np.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)


def hf_yarn_parameters(
    base, dim, factor, original_max_position_embeddings, beta_fast=None, beta_slow=None,
    attention_factor=None, mscale=None, mscale_all_dim=None, truncate=True,
):  # fmt: skip
    def get_mscale(scale, mscale=1):
        if scale <= 1:
            return 1.0
        return 0.1 * mscale * math.log(scale) + 1.0

    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(
                get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
            )
        else:
            attention_factor = get_mscale(factor)
    beta_fast = beta_fast or 32
    beta_slow = beta_slow or 1

    def find_correction_dim(num_rotations, dim, base, max_position_embeddings):
        return (dim * math.log(max_position_embeddings / (num_rotations * 2 * math.pi))) / (
            2 * math.log(base)
        )

    def find_correction_range(low_rot, high_rot, dim, base, max_position_embeddings, truncate):
        low = find_correction_dim(low_rot, dim, base, max_position_embeddings)
        high = find_correction_dim(high_rot, dim, base, max_position_embeddings)
        if truncate:
            low = math.floor(low)
            high = math.ceil(high)
        return max(low, 0), min(high, dim - 1)

    def linear_ramp_factor(min, max, dim):
        if min == max:
            max += 0.001  # Prevent singularity
        linear_func = (np.arange(dim, dtype=np.float64) - min) / (max - min)
        return np.clip(linear_func, 0, 1)

    pos_freqs = base ** (np.arange(0, dim, 2).astype(np.float64) / dim)
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)
    low, high = find_correction_range(
        beta_fast, beta_slow, dim, base, original_max_position_embeddings, truncate
    )
    inv_freq_extrapolation_factor = 1 - linear_ramp_factor(low, high, dim // 2)
    inv_freq = (
        inv_freq_interpolation * (1 - inv_freq_extrapolation_factor)
        + inv_freq_extrapolation * inv_freq_extrapolation_factor
    )
    return inv_freq, attention_factor


def oracle_parameters(rope: RoPE, dim: int, seq_len=None) -> tuple[np.ndarray, float]:
    """(inv_freq float64 [dim // 2], attention factor) for `rope`'s fields, the HF way."""
    s, base = rope.scaling, rope.theta
    if s is None:
        return hf_default_inv_freq(base, dim), 1.0
    if isinstance(s, LinearScaling):
        return hf_linear_inv_freq(base, dim, s.factor), 1.0
    if isinstance(s, Llama3Scaling):
        args = (s.factor, s.low_freq_factor, s.high_freq_factor)
        return hf_llama3_inv_freq(base, dim, *args, s.original_max_position_embeddings), 1.0
    if isinstance(s, DynamicNTKScaling):
        args = (s.factor, s.original_max_position_embeddings, seq_len)
        return hf_dynamic_ntk_inv_freq(base, dim, *args), 1.0
    assert isinstance(s, YarnScaling)
    return hf_yarn_parameters(
        base, dim, s.factor, s.original_max_position_embeddings, s.beta_fast, s.beta_slow,
        s.attention_factor, s.mscale, s.mscale_all_dim, s.truncate,
    )  # fmt: skip


# --------------------------------------------------- oracle: the rotation (HF, float64)


def rotate_half(x):  # Llama
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return np.concatenate((-x2, x1), axis=-1)


def llama_apply_rotary_pos_emb(q, cos, sin, unsqueeze_dim):
    cos = np.expand_dims(cos, unsqueeze_dim)
    sin = np.expand_dims(sin, unsqueeze_dim)
    return (q * cos) + (rotate_half(q) * sin)


def rotate_every_two(x):  # GPT-J
    x1 = x[..., ::2]
    x2 = x[..., 1::2]
    x = np.stack((-x2, x1), axis=-1)
    return x.reshape(x.shape[:-2] + (-1,))


def gptj_apply_rotary_pos_emb(tensor, sin, cos):
    sin = np.repeat(sin[..., None, :], 2, axis=-1)  # torch.repeat_interleave(sin[:, :, None], 2, 3)
    cos = np.repeat(cos[..., None, :], 2, axis=-1)
    return (tensor * cos) + (rotate_every_two(tensor) * sin)


def rope_oracle(x, positions, inv_freq, attention_factor, style, rotary_dim):
    """x float64 `[..., T, H, D]`, positions `[..., T]` -> (out, angles `[..., T, rotary_dim]`).

    Partial rotary as GPT-NeoX / GPT-J: rotate `x[..., :rotary_dim]`, pass the rest."""
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    freqs = np.asarray(positions, np.float64)[..., None] * inv_freq  # [..., T, rotary_dim / 2]
    if style == "neox":  # LlamaRotaryEmbedding.forward
        emb = np.concatenate((freqs, freqs), axis=-1)
        cos, sin = np.cos(emb) * attention_factor, np.sin(emb) * attention_factor
        x_rot = llama_apply_rotary_pos_emb(x_rot, cos, sin, unsqueeze_dim=-2)
    else:  # GPT-J: sincos = cat(sin, cos) of create_sinusoidal_positions, split in two
        sincos = np.concatenate((np.sin(freqs), np.cos(freqs)), axis=-1)
        sin, cos = np.split(sincos, 2, axis=-1)
        x_rot = gptj_apply_rotary_pos_emb(x_rot, sin * attention_factor, cos * attention_factor)
        emb = np.repeat(freqs, 2, axis=-1)
    return np.concatenate([x_rot, x_pass], axis=-1), emb


# ------------------------------------------------------------------------ tolerances
U32 = 2.0**-24  # float32 unit roundoff
U_BF16 = 2.0**-8


def assert_rope_close(got, want, angles, x, attention_factor, dtype):
    """`got` vs the oracle. In float32 the angle `pos * f` (f rounded to float32, then the
    product) is off by up to ~2 ulps of itself, as in HF's float32 cos/sin: that moves an
    output by at most that angle error times the pair's magnitude. bf16 adds the rounding
    of the output."""
    got, x = util.f64(got), util.f64(x)
    assert got.shape == want.shape and np.isfinite(got).all()
    pad = [(0, 0)] * (angles.ndim - 1) + [(0, want.shape[-1] - angles.shape[-1])]
    angle_err = 4 * U32 * np.expand_dims(np.pad(np.abs(angles), pad), -2)  # [..., T, 1, D]
    pair = 2 * np.max(np.abs(x), axis=-1, keepdims=True)
    bound = 1e-6 + 1e-6 * np.abs(want) + angle_err * attention_factor * pair
    if dtype == "bfloat16":
        bound = 1.01 * bound + U_BF16 * np.abs(want)
    err = np.abs(got - want)
    worst = np.unravel_index(np.argmax(err / bound), err.shape)
    assert (err <= bound).all(), (
        f"{np.sum(err > bound)} of {err.size} out of tolerance; worst at {worst}: got "
        f"{got[worst]}, want {want[worst]}, bound {bound[worst]}"
    )


# ------------------------------------------------------------------------------ cases
SCALINGS = {
    "none": (10000.0, None),
    "linear": (10000.0, LinearScaling(factor=4.0)),
    "llama3": (500000.0, Llama3Scaling(factor=8.0)),  # Llama 3.1's config
    "llama3_custom": (
        10000.0,
        Llama3Scaling(4.0, low_freq_factor=2.0, high_freq_factor=8.0,
                      original_max_position_embeddings=2048),
    ),
    "yarn": (10000.0, YarnScaling(factor=4.0, original_max_position_embeddings=4096)),
    "yarn_mscale": (  # DeepSeek-style mscale / mscale_all_dim
        10000.0,
        YarnScaling(40.0, 4096, mscale=1.0, mscale_all_dim=0.707),
    ),
    "yarn_untruncated": (
        1e6,
        YarnScaling(2.0, 32768, beta_fast=16.0, beta_slow=2.0, attention_factor=1.25,
                    truncate=False),
    ),
    "dynamic_ntk": (10000.0, DynamicNTKScaling(factor=2.0, original_max_position_embeddings=2048)),
}  # fmt: skip
STYLES = ("neox", "gptj")
# (head_dim, rotary_dim): full rotary, and partial as GPT-J (64 of 256) and Phi-2 (32 of 80).
HEAD_DIMS = [(64, None), (128, None), (80, None), (80, 32), (256, 64)]
MAX_POSITION = 100_000

# The many-config tests call apply_rope eagerly: its few ops, compiled once per shape and
# cached across configs, cost half of one jit compile per config. These check it under jit.
_apply = jax.jit(apply_rope, static_argnames="rope")
_apply_seq_len = jax.jit(apply_rope, static_argnames=("rope", "seq_len"))


def _positions(rng, shape, high=MAX_POSITION):
    """Random positions in arbitrary order, the extremes 0 and high - 1 included."""
    p = rng.integers(0, high, size=shape)
    p.flat[0], p.flat[-1] = 0, high - 1
    return jnp.asarray(p, jnp.int32)


def _rope(name, style="neox", rotary_dim=None) -> RoPE:
    theta, scaling = SCALINGS[name]
    return RoPE(theta=theta, style=style, rotary_dim=rotary_dim, scaling=scaling)


@pytest.mark.parametrize("head_dim, rotary_dim", HEAD_DIMS, ids=lambda v: str(v))
@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.every_case
def test_apply_rope_vs_hf_oracle(scaling, style, head_dim, rotary_dim):
    rope = _rope(scaling, style, rotary_dim)
    rng = util.rng_for("rope", scaling, style, head_dim, rotary_dim)
    positions = _positions(rng, (2, 16))
    dim = rotary_dim or head_dim
    inv_freq, factor = oracle_parameters(rope, dim, seq_len=int(positions.max()) + 1)
    assert rope.attention_factor == pytest.approx(factor, rel=1e-12)
    for dtype in ("float32", "bfloat16"):
        x = util.randn(rng, (2, 16, 3, head_dim), dtype)
        got = apply_rope(x, positions, rope)
        assert got.dtype == x.dtype and got.shape == x.shape
        want, angles = rope_oracle(util.f64(x), positions, inv_freq, factor, style, dim)
        assert_rope_close(got, want, angles, x, factor, dtype)
        # Pass-through channels are copied bit for bit.
        np.testing.assert_array_equal(got[..., dim:], x[..., dim:])


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.every_case
def test_token_rotations_vs_hf_oracle(scaling, style):
    """The decode kernel's form `x * cos + x[partner] * sin` (tables per token) against
    the same oracle, tight in float32 (the angles are `apply_rope`'s); pass-through
    channels come out exactly."""
    head_dim, dim = 80, 48
    rope = _rope(scaling, style, dim)
    rng = util.rng_for("token_rotations", scaling, style)
    positions = _positions(rng, (16,))
    inv_freq, factor = oracle_parameters(rope, dim, seq_len=int(positions.max()) + 1)
    x = util.randn(rng, (16, 3, head_dim), "float32")
    cos, sin, partner = token_rotations(positions, rope, head_dim)
    assert cos.shape == sin.shape == (16, head_dim) and partner.shape == (head_dim,)
    got = x * cos[:, None] + x[..., partner] * sin[:, None]
    want, angles = rope_oracle(util.f64(x), positions, inv_freq, factor, style, dim)
    assert_rope_close(got, want, angles, x, factor, "float32")
    np.testing.assert_array_equal(got[..., dim:], x[..., dim:])


@pytest.mark.parametrize("dim", [64, 128, 80, 32])
@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.every_case
def test_inv_freq_vs_hf(scaling, dim):
    rope = _rope(scaling)
    lengths = [None, 100, 2048, 2049, 10_000, MAX_POSITION] if "dynamic" in scaling else [None]
    for seq_len in lengths:
        got = rope.inv_freq(dim, seq_len)
        want, _ = oracle_parameters(rope, dim, seq_len)
        assert got.dtype == jnp.float32 and got.shape == (dim // 2,)
        np.testing.assert_allclose(util.f64(got), want, rtol=4e-7, err_msg=f"{seq_len=}")


def test_scalings_change_what_they_should():
    """Sanity of the oracle cases themselves: each scaling moves some frequencies."""
    base = hf_default_inv_freq(10000.0, 128)
    for name in ("linear", "llama3_custom", "yarn", "yarn_mscale"):
        inv_freq, _ = oracle_parameters(_rope(name), 128)
        assert np.any(np.abs(inv_freq / base - 1) > 0.1), name
    llama3, _ = oracle_parameters(_rope("llama3_custom"), 128)
    ratio = base / llama3  # 1 (high frequencies), factor (low), and blends in between
    assert ratio[0] == 1 and ratio[-1] == pytest.approx(4.0)
    assert np.any((ratio > 1.01) & (ratio < 3.99))
    yarn, factor = oracle_parameters(_rope("yarn"), 128)
    assert factor == pytest.approx(0.1 * math.log(4.0) + 1)
    assert yarn[0] == base[0] and yarn[-1] == pytest.approx(base[-1] / 4)


# -------------------------------------------------------------------- dynamic NTK
def test_dynamic_ntk_seq_len():
    rope = _rope("dynamic_ntk", rotary_dim=64)
    rng = util.rng_for("dynamic seq_len")
    x = util.randn(rng, (2, 8, 2, 96))
    positions = _positions(rng, (2, 8), high=20_000)

    def oracle(seq_len, pos=positions):
        inv_freq, _ = oracle_parameters(rope, 64, seq_len)
        return rope_oracle(util.f64(x), pos, inv_freq, 1.0, "neox", 64)

    # Default: max(positions) + 1 over the whole call (HF's current sequence length).
    want, angles = oracle(20_000)
    assert_rope_close(_apply(x, positions, rope=rope), want, angles, x, 1.0, "float32")
    # Explicit, as an int and traced under jit.
    traced = jax.jit(lambda x, p, n: apply_rope(x, p, rope, seq_len=n))
    for seq_len in (50_000, 2048, 3000):
        want, angles = oracle(seq_len)
        got = traced(x, positions, jnp.int32(seq_len))
        assert_rope_close(got, want, angles, x, 1.0, "float32")
        got = _apply_seq_len(x, positions, rope=rope, seq_len=seq_len)
        assert_rope_close(got, want, angles, x, 1.0, "float32")
    # Within the original context the frequencies are the unscaled ones.
    short = positions % 2000
    plain = RoPE(theta=rope.theta, rotary_dim=64)
    np.testing.assert_allclose(_apply(x, short, rope=rope), _apply(x, short, rope=plain), atol=1e-6)


# ------------------------------------------------------------------ shapes, tables
def test_leading_dims_and_broadcasting():
    rope = RoPE(style="gptj", scaling=LinearScaling(2.0))
    rng = util.rng_for("leading dims")
    inv_freq, _ = oracle_parameters(rope, 32)
    x = util.randn(rng, (2, 3, 5, 4, 32))  # [A, B, T, H, D]
    for pos_shape in [(5,), (3, 5), (2, 3, 5), (2, 1, 5), (1, 3, 1)]:
        positions = _positions(rng, pos_shape, high=5000)
        want, angles = rope_oracle(
            util.f64(x), np.broadcast_to(positions, (2, 3, 5)), inv_freq, 1.0, "gptj", 32
        )
        got = _apply(x, positions, rope=rope)
        angles = np.broadcast_to(angles, want.shape[:3] + (32,))
        assert_rope_close(got, want, angles, x, 1.0, "float32")
    # Unbatched [T, H, D] and one decode step per sequence [B, 1, H, D].
    positions = _positions(rng, (5,), high=5000)
    unbatched = _apply(x[0, 0], positions, rope=rope)
    np.testing.assert_allclose(unbatched, _apply(x, positions, rope=rope)[0, 0], atol=1e-6)
    step = _apply(x[:, :, 2:3], positions[2:3], rope=rope)
    np.testing.assert_allclose(step, _apply(x, positions, rope=rope)[:, :, 2:3], atol=1e-6)


def test_channel_tables_by_hand():
    t = RoPE().channel_tables(8)
    assert t.partner.tolist() == [4, 5, 6, 7, 0, 1, 2, 3]
    assert t.sign.tolist() == [-1, -1, -1, -1, 1, 1, 1, 1]
    assert t.freq_index.tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    assert t.rotates.all()
    t = RoPE(style="gptj").channel_tables(8)
    assert t.partner.tolist() == [1, 0, 3, 2, 5, 4, 7, 6]
    assert t.sign.tolist() == [-1, 1, -1, 1, -1, 1, -1, 1]
    assert t.freq_index.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    t = RoPE(rotary_dim=4).channel_tables(8)
    assert t.partner.tolist() == [2, 3, 0, 1, 4, 5, 6, 7]
    assert t.sign.tolist() == [-1, -1, 1, 1, 0, 0, 0, 0]
    assert t.freq_index.tolist() == [0, 1, 0, 1, 0, 0, 0, 0]
    assert t.rotates.tolist() == [True] * 4 + [False] * 4
    assert t.partner.dtype == np.int32 and t.sign.dtype == np.float32
    assert t.freq_index.dtype == np.int32 and t.rotates.dtype == np.bool_


def test_config_is_hashable_static():
    a = RoPE(theta=1e6, scaling=YarnScaling(4.0, 4096, mscale=1.0, mscale_all_dim=1.0))
    b = RoPE(theta=1e6, scaling=YarnScaling(4.0, 4096, mscale=1.0, mscale_all_dim=1.0))
    assert a == b and hash(a) == hash(b) and a.attention_factor == 1.0
    traces = []
    f = jax.jit(
        lambda x, p, rope: traces.append(1) or apply_rope(x, p, rope), static_argnames="rope"
    )
    x, p = jnp.ones((4, 1, 8)), jnp.arange(4)
    f(x, p, rope=a)
    f(x, p, rope=b)
    assert len(traces) == 1


# ---------------------------------------------------------------------- properties
@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.every_case
def test_norm_preserved(scaling, style):
    """A rotation: each head's rotary part keeps its norm (times YaRN's factor)."""
    rope = _rope(scaling, style, rotary_dim=48)
    rng = util.rng_for("norm", scaling, style)
    x = util.randn(rng, (3, 16, 2, 64))
    got = util.f64(apply_rope(x, _positions(rng, (3, 16)), rope))
    x = util.f64(x)
    np.testing.assert_allclose(
        np.linalg.norm(got[..., :48], axis=-1),
        rope.attention_factor * np.linalg.norm(x[..., :48], axis=-1),
        rtol=2e-6,
    )
    np.testing.assert_array_equal(got[..., 48:], x[..., 48:])


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.every_case
def test_dot_depends_on_relative_position_only(scaling, style):
    """<rope(q, m), rope(k, n)> is a function of m - n (RoFormer, eq. 16); for dynamic NTK at
    a fixed seq_len (its frequencies depend on the length)."""
    rope, head_dim = _rope(scaling, style), 80
    rng = util.rng_for("relative", scaling, style)
    q, k = util.randn(rng, (head_dim,)), util.randn(rng, (head_dim,))
    shifts, deltas = np.array([0, 1, 17, 999, 4321]), np.array([0, 3, 50])
    m = shifts[None, :] + deltas[:, None]  # [deltas, shifts]
    n = np.broadcast_to(shifts, m.shape)
    x = jnp.broadcast_to(
        jnp.stack([q, k])[:, None, None, None, None], (2, *m.shape, 1, 1, head_dim)
    )
    seq_len = 50_000 if "dynamic" in scaling else None
    out = util.f64(apply_rope(x, jnp.asarray(np.stack([m, n]))[..., None], rope, seq_len=seq_len))
    dots = np.sum(out[0] * out[1], axis=(-3, -2, -1))  # [deltas, shifts]
    # float32 angles at position p are off by ~2 ulps of p * f (f <= 1).
    scale = rope.attention_factor**2 * float(jnp.sum(jnp.abs(q) * jnp.abs(k)))
    tol = 8 * U32 * m.max() * scale + 1e-5
    spread = np.ptp(dots, axis=1)
    assert (spread <= tol).all(), f"m - n in {deltas}: dot products {dots} vary beyond {tol}"
    assert np.ptp(dots[:, 0]) > 4 * tol  # and they do depend on m - n


# ------------------------------------------------------------------------ bad input
def _apply_to(rope, head_dim=64, positions=None, x_shape=None):
    x = jnp.ones(x_shape or (4, 2, head_dim))
    return lambda: apply_rope(x, jnp.arange(4) if positions is None else positions, rope)


DYNAMIC = RoPE(scaling=DynamicNTKScaling(4.0, 16))
ROW_LENGTHS = np.array([[20], [40]])  # a length per row: [B, 1]

BAD = {
    "rotary_dim odd": (lambda: RoPE(rotary_dim=7), "rotary_dim"),
    "rotary_dim zero": (lambda: RoPE(rotary_dim=0), "rotary_dim"),
    "rotary_dim > head_dim": (_apply_to(RoPE(rotary_dim=96)), "rotary_dim"),
    "head_dim odd": (_apply_to(RoPE(), head_dim=65), "head_dim"),
    "style": (lambda: RoPE(style="llama"), "style"),
    "theta": (lambda: RoPE(theta=0.5), "theta"),
    "scaling dict": (lambda: RoPE(scaling={"rope_type": "linear", "factor": 2.0}), "scaling"),
    "linear factor": (lambda: LinearScaling(0.5), "factor"),
    "llama3 factor": (lambda: Llama3Scaling(0.9), "factor"),
    "llama3 freq factors": (
        lambda: Llama3Scaling(8.0, low_freq_factor=4.0, high_freq_factor=1.0),
        "high_freq_factor",
    ),
    "llama3 context": (
        lambda: Llama3Scaling(8.0, original_max_position_embeddings=0),
        "original_max_position_embeddings",
    ),
    "yarn factor": (lambda: YarnScaling(0.5, 4096), "factor"),
    "yarn betas": (lambda: YarnScaling(4.0, 4096, beta_fast=1.0, beta_slow=32.0), "beta_slow"),
    "yarn attention_factor": (lambda: YarnScaling(4.0, 4096, attention_factor=-1.0),
                              "attention_factor"),
    "dynamic context": (lambda: DynamicNTKScaling(2.0, 1.5), "original_max_position_embeddings"),
    "positions dtype": (_apply_to(RoPE(), positions=jnp.arange(4.0)), "positions"),
    "positions length": (_apply_to(RoPE(), positions=jnp.arange(5)), "positions"),
    "positions extra dims": (_apply_to(RoPE(), positions=jnp.zeros((3, 4), int)), "positions"),
    "x rank": (_apply_to(RoPE(), x_shape=(4, 64)), "x.shape"),
    "linear factor inf": (lambda: LinearScaling(float("inf")), "factor"),
    "dynamic factor nan": (lambda: DynamicNTKScaling(float("nan"), 16), "factor"),
    # A length per row where x has none: the tables would outgrow x (they had, silently).
    "seq_len grows x": (
        lambda: apply_rope(jnp.ones((3, 1, 8)), jnp.arange(3), DYNAMIC, seq_len=ROW_LENGTHS),
        "seq_len",
    ),
    "seq_len grows tokens": (
        lambda: token_rotations(jnp.arange(3), DYNAMIC, 8, seq_len=ROW_LENGTHS),
        "seq_len",
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", BAD)
@pytest.mark.every_case
def test_bad_input(name):
    fn, field = BAD[name]
    with pytest.raises(ValueError, match=field):
        fn()


@pytest.mark.parametrize("factor", ["2", True, None])
@pytest.mark.every_case
def test_factor_not_a_number(factor):
    with pytest.raises(TypeError, match="factor"):
        LinearScaling(factor)


def test_seq_len_per_row_broadcasts_into_x():
    """A length per row of a `[B, T]` batch with positions `[T]` (nn.Attention's q_lengths)
    is still taken: it grows the positions, not x."""
    x = jax.random.normal(jax.random.key(0), (2, 3, 1, 8))
    out = apply_rope(x, jnp.arange(3), DYNAMIC, seq_len=ROW_LENGTHS)
    assert out.shape == x.shape
    for b in range(2):
        row = apply_rope(x[b], jnp.arange(3), DYNAMIC, seq_len=int(ROW_LENGTHS[b, 0]))
        np.testing.assert_array_equal(out[b], row)
