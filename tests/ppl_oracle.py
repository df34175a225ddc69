"""A float64 numpy oracle of OpenPPL's `MultiHeadCacheAttention` (`jaxattn.ppl`), and the
inputs of one step for it.

Written from `shared/reference/openppl_multi_head_cache_attention.md` and the semantics
decided for `jaxattn.ppl.multi_head_cache_attention`, sharing no code with `jaxattn`
(only the ALiBi slopes come from the suite's own `oracle.bloom_alibi_slopes`):

- batch b owns tokens `seqstarts[b]:seqstarts[b+1]` (tokens past `seqstarts[B]` are
  padding: zero outputs, nothing written) and `kvlen[b] = kvstarts[b+1] - kvstarts[b]`
  keys; its token j is stored at sequence position `start_pos[b] + j`;
- sequence position p of batch b lives at cache token row `cachestarts[b] + p` (cache_mode
  0) or `cachestarts[b, p // page_size] + p % page_size` (cache_mode 1);
- the step first writes the current K/V into layer `layer_idx` at those rows (quantized
  for `quant_bit` 8/4), then attends to positions `0..kvlen[b]-1` read back from the cache;
  query i sits at position `kvlen[b] - seqlen[b] + i`; batches `b >= decoding_batches`
  are causal-masked when `is_causal`; ALiBi adds `-slope[h] * |p - j|`; `attn_mask` adds
  its element `[h, seqstarts[b] + i, kvstarts[b] + j]`; rows with no visible key are 0.

Quantization, per token, kv head and group of `quant_group` channels, in float32 as the
definition states: `s = max(absmax * (1 / qmax), tiny)` (float32) rounded to the scale
array's dtype (tiny: its smallest normal), `code = clip(round_half_even(x / s), -qmax,
qmax)` with qmax 127 (int8) or 7 (int4: two codes a byte, channel j in the low nibble
of byte j and channel j + D/2 in the high one, two's complement). Dequantized: `code * s`.

Cache layouts are handled by viewing every cache/scale as the canonical layout 0,
`[MaxT, L, 2, H, X]` (`canonical` / `from_canonical`).
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
from oracle import bloom_alibi_slopes

__all__ = [
    "QMAX",
    "Case",
    "cache_row",
    "canonical",
    "dequantize_rows",
    "from_canonical",
    "make_case",
    "pack_int4",
    "ppl_oracle",
    "quantize_rows",
    "unpack_int4",
    "written_rows",
]

QMAX = {8: 127, 4: 7}

# Axis order of each layout, as positions of the canonical axes (MaxT, L, 2, H, X).
_LAYOUT_AXES = {
    0: ("T", "L", "2", "H", "X"),
    1: ("L", "T", "2", "H", "X"),
    2: ("L", "2", "T", "H", "X"),
    3: ("L", "2", "H", "T", "X"),
}
_CANONICAL = ("T", "L", "2", "H", "X")


def canonical(x: np.ndarray, layout: int) -> np.ndarray:
    """A cache or scale array in `layout` as a view `[MaxT, L, 2, H, X]`."""
    axes = _LAYOUT_AXES[layout]
    return np.transpose(x, [axes.index(a) for a in _CANONICAL])


def from_canonical(x: np.ndarray, layout: int) -> np.ndarray:
    """The inverse of `canonical`: `[MaxT, L, 2, H, X]` -> `layout` (a contiguous copy)."""
    return np.ascontiguousarray(
        np.transpose(x, [_CANONICAL.index(a) for a in _LAYOUT_AXES[layout]])
    )


def layout_shape(layout: int, max_t: int, num_layer: int, heads: int, x: int) -> tuple:
    sizes = dict(T=max_t, L=num_layer, H=heads, X=x)
    sizes["2"] = 2
    return tuple(sizes[a] for a in _LAYOUT_AXES[layout])


# ------------------------------------------------------------------------ indexing
def cache_row(cachestarts, b: int, p: int, cache_mode: int, page_size: int) -> int:
    """The cache token row of sequence position p of batch b."""
    cachestarts = np.asarray(cachestarts)
    if cache_mode == 0:
        return int(cachestarts[b]) + p
    return int(cachestarts[b, p // page_size]) + p % page_size


def written_rows(seqstarts, cachestarts, start_pos, cache_mode: int, page_size: int):
    """`(token, row)` of every current token: where the step writes its K/V."""
    seqstarts, start_pos = np.asarray(seqstarts), np.asarray(start_pos)
    out = []
    for b in range(len(seqstarts) - 1):
        for j in range(int(seqstarts[b + 1] - seqstarts[b])):
            p = int(start_pos[b]) + j
            out.append((int(seqstarts[b]) + j, cache_row(cachestarts, b, p, cache_mode, page_size)))
    return out


# ---------------------------------------------------------------------- quantization
def pack_int4(codes) -> np.ndarray:
    """Integers in [-8, 7] `[..., D]` -> uint8 `[..., D/2]`: byte j = channel j's 4-bit two's
    complement + 16 * channel (j + D/2)'s."""
    nibbles = np.asarray(codes).astype(np.int64) & 0xF
    half = nibbles.shape[-1] // 2
    return (nibbles[..., :half] | (nibbles[..., half:] << 4)).astype(np.uint8)


def unpack_int4(packed) -> np.ndarray:
    """uint8 `[..., D/2]` -> int64 codes `[..., D]` in [-8, 7]."""
    packed = np.asarray(packed).astype(np.int64)
    low, high = packed & 0xF, packed >> 4
    return np.concatenate([low - 16 * (low >= 8), high - 16 * (high >= 8)], -1)


def quantize_rows(x, quant_bit: int, quant_group: int, scale_dtype):
    """Tokens `x` `[..., D]` (any float dtype) -> (stored codes `[..., Dc]` int8 or packed
    uint8, scales `[..., D / quant_group]` in `scale_dtype`)."""
    x = np.asarray(x).astype(np.float32)
    scale_dtype = np.dtype(scale_dtype)
    head_dim = x.shape[-1]
    groups = x.reshape(*x.shape[:-1], head_dim // quant_group, quant_group)
    qmax = np.float32(QMAX[quant_bit])
    tiny = np.float32(np.finfo(scale_dtype).tiny)
    inverse = np.float32(1) / qmax
    s = np.maximum(np.abs(groups).max(-1) * inverse, tiny).astype(scale_dtype)  # [..., G]
    s32 = s.astype(np.float32)
    codes = np.clip(np.round(groups / s32[..., None]), -qmax, qmax).astype(np.int64)
    codes = codes.reshape(x.shape)
    stored = pack_int4(codes) if quant_bit == 4 else codes.astype(np.int8)
    return stored, s


def codes_of(stored, quant_bit: int) -> np.ndarray:
    """Stored cache entries `[..., Dc]` -> integer codes `[..., D]`."""
    return unpack_int4(stored) if quant_bit == 4 else np.asarray(stored).astype(np.int64)


def dequantize_rows(stored, scale, quant_bit: int, quant_group: int) -> np.ndarray:
    """float64 `code * scale` `[..., D]`."""
    codes = codes_of(stored, quant_bit).astype(np.float64)
    s = np.repeat(np.asarray(scale).astype(np.float64), quant_group, axis=-1)
    return codes * s


# ---------------------------------------------------------------------------- oracle
def ppl_oracle(
    query,
    current_key,
    current_value,
    seqstarts,
    kvstarts,
    cachestarts,
    start_pos,
    decoding_batches,
    max_seqlen,
    max_kvlen,
    cache,
    scale=None,
    attn_mask=None,
    *,
    num_heads: int,
    head_dim: int,
    is_causal: bool,
    is_alibi: bool = False,
    num_kv_heads: int = 0,
    num_layer: int = 1,
    layer_idx: int = 0,
    quant_bit: int = 0,
    quant_group: int = 8,
    cache_mode: int = 0,
    cache_layout: int = 0,
    page_size: int = 128,
    implementation=None,
    written=None,
):
    """One `MultiHeadCacheAttention` step. Returns (out float64 `[T, num_heads, head_dim]`,
    the updated cache and scale (numpy, dtypes and layout of the inputs; scale as passed
    when quant_bit is 0)). `written`: None, or (cache, scale) after some write of this
    step, which the attention then reads instead of the oracle's own write."""
    del max_seqlen, max_kvlen, implementation, num_layer  # no effect on the result
    num_kv_heads = num_kv_heads or num_heads
    group = num_heads // num_kv_heads
    seqstarts, kvstarts, start_pos = (
        np.asarray(x).astype(np.int64) for x in (seqstarts, kvstarts, start_pos)
    )
    cachestarts = np.asarray(cachestarts).astype(np.int64)
    decoding_batches = int(np.asarray(decoding_batches))
    batch = len(seqstarts) - 1

    new_cache = np.array(cache, copy=True)
    cache_c = canonical(new_cache, cache_layout)  # a view: writes land in new_cache
    new_scale = None if scale is None else np.array(scale, copy=True)
    scale_c = None if new_scale is None else canonical(new_scale, cache_layout)

    # Write first.
    key, value = np.asarray(current_key), np.asarray(current_value)
    rows_written = written_rows(seqstarts, cachestarts, start_pos, cache_mode, page_size)
    if written is not None:
        cache_c = canonical(np.asarray(written[0]), cache_layout)
        scale_c = None if written[1] is None else canonical(np.asarray(written[1]), cache_layout)
        rows_written = []
    for token, row in rows_written:
        for kv, x in enumerate((key, value)):
            if quant_bit:
                stored, s = quantize_rows(x[token], quant_bit, quant_group, scale_c.dtype)
                cache_c[row, layer_idx, kv], scale_c[row, layer_idx, kv] = stored, s
            else:
                cache_c[row, layer_idx, kv] = x[token].astype(cache_c.dtype)

    # Then attend to what the cache holds.
    q = np.asarray(query).astype(np.float64)
    mask = None
    if attn_mask is not None:
        mask = np.asarray(attn_mask).astype(np.float64)
        if mask.ndim == 2:
            mask = np.broadcast_to(mask[None], (num_heads, *mask.shape))
    slopes = bloom_alibi_slopes(num_heads) if is_alibi else None
    out = np.zeros((q.shape[0], num_heads, head_dim))
    for b in range(batch):
        q0, seqlen = int(seqstarts[b]), int(seqstarts[b + 1] - seqstarts[b])
        k0, kvlen = int(kvstarts[b]), int(kvstarts[b + 1] - kvstarts[b])
        if seqlen == 0:
            continue
        rows = [cache_row(cachestarts, b, p, cache_mode, page_size) for p in range(kvlen)]
        kv = cache_c[rows, layer_idx]  # [kvlen, 2, H, Dc]
        if quant_bit:
            kv = dequantize_rows(kv, scale_c[rows, layer_idx], quant_bit, quant_group)
        kv = kv.astype(np.float64)
        k, v = kv[:, 0], kv[:, 1]  # [kvlen, H, D]
        pos = kvlen - seqlen + np.arange(seqlen)[:, None]  # [seqlen, 1]
        j = np.arange(kvlen)[None, :]
        visible = np.ones((seqlen, kvlen), bool)
        if is_causal and b >= decoding_batches:
            visible = j <= pos
        for h in range(num_heads):
            s = q[q0 : q0 + seqlen, h] @ k[:, h // group].T / math.sqrt(head_dim)
            if slopes is not None:
                s = s - slopes[h] * np.abs(pos - j)
            if mask is not None:
                s = s + mask[h, q0 : q0 + seqlen, k0 : k0 + kvlen]
            s = np.where(visible, s, -np.inf)
            m = np.max(s, axis=-1, initial=-np.inf, keepdims=True)
            seen = np.isfinite(m)
            p = np.where(visible & seen, np.exp(s - np.where(seen, m, 0.0)), 0.0)
            p = p / np.where(seen, p.sum(-1, keepdims=True), 1.0)
            out[q0 : q0 + seqlen, h] = p @ v[:, h // group]
    return out, new_cache, new_scale


# ----------------------------------------------------------------------------- inputs
@dataclasses.dataclass
class Case:
    """One step's inputs (numpy), in the op's argument order, and its keywords."""

    query: np.ndarray
    current_key: np.ndarray
    current_value: np.ndarray
    seqstarts: np.ndarray
    kvstarts: np.ndarray
    cachestarts: np.ndarray
    start_pos: np.ndarray
    decoding_batches: int
    max_seqlen: int
    max_kvlen: int
    cache: np.ndarray
    scale: np.ndarray | None
    attn_mask: np.ndarray | None
    kw: dict

    def args(self) -> tuple:
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self)[:13])

    def oracle(self, written=None):
        return ppl_oracle(*self.args(), **self.kw, written=written)

    def written(self):
        """`(token, row)` of the current tokens."""
        return written_rows(
            self.seqstarts, self.cachestarts, self.start_pos, self.kw["cache_mode"],
            self.kw["page_size"],
        )  # fmt: skip


def _place(rng, sizes, *, gap: int, align: int = 1):
    """Non-overlapping blocks of `sizes` in a random order with random gaps (multiples of
    `align`): (their offsets, the total extent)."""
    offsets = [0] * len(sizes)
    at = 0
    for i in rng.permutation(len(sizes)):
        at += align * int(rng.integers(0, gap + 1))
        offsets[i] = at
        at += sizes[i]
    return offsets, at


def make_case(
    rng: np.random.Generator,
    *,
    seqlens,
    kvlens,
    decoding_batches: int,
    cache_layout: int = 0,
    cache_mode: int = 0,
    quant_bit: int = 0,
    dtype: str = "float32",
    cache_dtype: str | None = None,
    scale_dtype: str = "float16",
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    num_layer: int = 3,
    layer_idx: int = 1,
    page_size: int = 8,
    quant_group: int = 8,
    is_causal: bool = True,
    is_alibi: bool = False,
    mask: str | None = None,
    pad_tokens: int = 3,
    aligned_pages: bool = True,
    poison: str = "garbage",
    extra_len: int = 0,
    spare_pages: int = 2,
) -> Case:
    """A valid random step: batch b has `seqlens[b]` new tokens after `kvlens[b] -
    seqlens[b]` cached ones (start_pos = kvlen - seqlen).

    - mode 0: each batch owns `kvlen + slack` rows at a scattered offset; mode 1: its pages
      are scattered over the cache (page-aligned, or at arbitrary token offsets with
      `aligned_pages=False`), its page table has a spare column, and entries past its
      pages point at other pages;
    - layer `layer_idx` holds the cached prefix of each batch (random K/V in `dtype`,
      quantized as the op would); every other row and layer holds garbage (large values /
      random codes and scales; `poison="nan"`: NaN for float caches, and NaN padding
      tokens), so a read of a wrong row or an unmasked key shows in the output;
    - `pad_tokens` padding tokens (garbage) end the packed q/k/v;
    - `mask`: None, "3d" `[num_heads, T, K]` or "2d" `[T, K]`, K = kvstarts[B] + 5.
    `extra_len` is added to max_seqlen and max_kvlen.
    """
    seqlens, kvlens = [int(x) for x in seqlens], [int(x) for x in kvlens]
    assert all(k >= s for s, k in zip(seqlens, kvlens))
    batch = len(seqlens)
    hkv = num_kv_heads or num_heads
    dt = jnp.dtype(dtype)
    cache_dt = jnp.dtype(cache_dtype or dtype)
    if quant_bit:
        cache_dt = np.dtype(np.int8 if quant_bit == 8 else np.uint8)
    dc = head_dim // 2 if quant_bit == 4 else head_dim
    groups = head_dim // quant_group
    seqstarts = np.concatenate([[0], np.cumsum(seqlens)]).astype(np.int32)
    kvstarts = np.concatenate([[0], np.cumsum(kvlens)]).astype(np.int32)
    start_pos = np.asarray([k - s for s, k in zip(seqlens, kvlens)], np.int32)
    total = int(seqstarts[-1]) + pad_tokens

    if cache_mode == 0:
        sizes = [k + int(rng.integers(0, 4)) for k in kvlens]
        offsets, end = _place(rng, sizes, gap=5)
        max_t = end + 2
        cachestarts = np.asarray(offsets, np.int32)
    else:
        held = [-(-k // page_size) for k in kvlens]
        num_pages = sum(held) + spare_pages
        if aligned_pages:
            offsets, end = _place(rng, [page_size] * num_pages, gap=1, align=page_size)
        else:
            offsets, end = _place(rng, [page_size] * num_pages, gap=3)
        max_t = end + (0 if aligned_pages else int(rng.integers(0, 3)))
        max_pages = max(held) + 1
        table = np.zeros((batch, max_pages), np.int64)
        first = 0
        for b in range(batch):
            table[b, : held[b]] = offsets[first : first + held[b]]
            first += held[b]
            # entries past the batch's pages: other (valid) pages, never to be read
            table[b, held[b] :] = rng.choice(offsets, max_pages - held[b])
        cachestarts = table.astype(np.int32)

    def draw(shape, scale=1.0):
        return (scale * rng.standard_normal(shape)).astype(dt)

    # The cache: garbage everywhere, then each batch's cached prefix in layer layer_idx.
    cache_c = np.zeros((max_t, num_layer, 2, hkv, dc), cache_dt)
    scale_c = None
    if quant_bit:
        qmax = QMAX[quant_bit]
        codes = rng.integers(-qmax, qmax + 1, (max_t, num_layer, 2, hkv, head_dim))
        cache_c[...] = pack_int4(codes) if quant_bit == 4 else codes
        scale_c = rng.uniform(0.5, 2.0, (max_t, num_layer, 2, hkv, groups)).astype(scale_dtype)
    elif poison == "nan":
        cache_c[...] = np.nan
    else:
        cache_c[...] = rng.uniform(-100, 100, cache_c.shape).astype(cache_dt)
    for b in range(batch):
        past = int(start_pos[b])
        if not past:
            continue
        rows = [cache_row(cachestarts, b, p, cache_mode, page_size) for p in range(past)]
        kv = draw((past, 2, hkv, head_dim))
        if quant_bit:
            cache_c[rows, layer_idx], scale_c[rows, layer_idx] = quantize_rows(
                kv, quant_bit, quant_group, scale_dtype
            )
        else:
            cache_c[rows, layer_idx] = kv.astype(cache_dt)

    padding = np.nan if poison == "nan" else 1000.0
    q = np.concatenate([draw((total - pad_tokens, num_heads, head_dim)),
                        np.full((pad_tokens, num_heads, head_dim), padding, dt)])  # fmt: skip
    k, v = (
        np.concatenate(
            [
                draw((total - pad_tokens, hkv, head_dim)),
                np.full((pad_tokens, hkv, head_dim), padding, dt),
            ]
        )  # fmt: skip
        for _ in "kv"
    )
    attn_mask = None
    if mask is not None:
        cols = int(kvstarts[-1]) + 5
        shape = (num_heads, total, cols) if mask == "3d" else (total, cols)
        attn_mask = draw(shape, scale=2.0)

    kw = dict(
        num_heads=num_heads, head_dim=head_dim, is_causal=is_causal, is_alibi=is_alibi,
        num_kv_heads=num_kv_heads, num_layer=num_layer, layer_idx=layer_idx,
        quant_bit=quant_bit, quant_group=quant_group, cache_mode=cache_mode,
        cache_layout=cache_layout, page_size=page_size,
    )  # fmt: skip
    return Case(
        q, k, v, seqstarts, kvstarts, cachestarts, start_pos, decoding_batches,
        max(seqlens) + extra_len, max(kvlens) + extra_len,
        from_canonical(cache_c, cache_layout),
        None if scale_c is None else from_canonical(scale_c, cache_layout),
        attn_mask, kw,
    )  # fmt: skip
