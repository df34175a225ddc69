"""The paged KV cache: an immutable pytree of K and V page pools (optionally quantized).

Layout: `k_pages`, `v_pages` are `[N, Hkv, P, D]` (N pages of P tokens). A page holds all
kv heads of its tokens, each head's P tokens contiguous (`[P, D]`, P*D*2 bytes in bf16:
4 KiB at P=16, D=128). The decode kernel reads one kv head of a page per step, so every
read is one contiguous slab; writes of a new token touch Hkv runs of D values. This is
TensorRT-LLM's per-block layout ([blocks, 2, Hkv, P, D], with K and V as two arrays here).

Addressing (DESIGN.md): token position t of a sequence lives in page
`block_tables[seq, t // P]` at offset `t % P`; its slot is `page * P + offset`.
Example with P=4: a sequence with block table [7, 2] and 6 tokens keeps tokens 0..3 in
page 7 (slots 28..31) and tokens 4, 5 in page 2 (slots 8, 9).

Quantized caches (`quant=KVQuant(...)`, formats and scales in `jaxattn.quant`):

  pools                  int8 / float8_e4m3fn `[N, Hkv, P, D]`; int4: uint8 `[N, Hkv, P, D/2]`
                         (byte j of a row: channel j low nibble, channel j + D/2 high)
  scales, "tensor"       `k_scales`, `v_scales`: float32 `[]`, fixed at `create`
  scales, "group"        `k_scales`, `v_scales`: bfloat16 `[N, Hkv, P, G]` (G = D / group_size),
                         pages beside the data pages: slot s's scales sit at the same
                         `[s // P, :, s % P]` as its values, written by the same `write_kv`

`write_kv` quantizes (per-group: computes the written tokens' scales); `gather_kv`
dequantizes. Unquantized caches have `k_scales = v_scales = None` and `quant = None`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, Shaped

from jaxattn.int32 import check_int32
from jaxattn.quant import TINY_SCALE, KVQuant, dequantize, group_scales, quantize

__all__ = ["PagedKVCache", "copy_pages", "gather_kv", "write_kv", "write_kv_stored"]


def _tensor_scale(name: str, value) -> jax.Array:
    """A per-tensor scale as float32 `[]`; None means 1.0. Checked positive when concrete."""
    scale = jnp.asarray(1.0 if value is None else value, jnp.float32)
    if scale.shape != ():
        raise ValueError(f"{name}: expected a scalar per-tensor scale, got shape {scale.shape}")
    try:
        concrete = float(scale)
    except jax.errors.ConcretizationTypeError:  # traced: checked by whoever made it
        return scale
    if not TINY_SCALE <= concrete < float("inf"):
        raise ValueError(
            f"{name}={concrete}: a scale must be finite and at least TINY_SCALE = 2**-64 "
            "(below it 1 / scale overflows float32 and zeros quantize to NaN)"
        )
    return scale


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
    """K and V page pools (and scales when quantized). Arrays are leaves; sizes come from
    their shapes; `quant` is static.

    Attributes:
      k_pages, v_pages: `[N, Hkv, P, D]` (num_pages, num_kv_heads, page_size, head_dim), of
        the cache's dtype or `quant.storage_dtype` (int4: uint8 `[N, Hkv, P, D // 2]`).
      k_scales, v_scales: None (unquantized); float32 `[]` ("tensor"); bfloat16
        `[N, Hkv, P, num_groups]` ("group").
      quant: None or the `KVQuant` the pools hold.
    """

    k_pages: Shaped[Array, "N Hkv P Dp"]
    v_pages: Shaped[Array, "N Hkv P Dp"]
    k_scales: Float[Array, "*shape"] | None = None
    v_scales: Float[Array, "*shape"] | None = None
    quant: KVQuant | None = dataclasses.field(default=None, metadata=dict(static=True))

    @classmethod
    def create(
        cls,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype=jnp.bfloat16,
        quant: KVQuant | None = None,
        k_scale: float | None = None,
        v_scale: float | None = None,
    ) -> PagedKVCache:
        """An empty (zeroed) cache of `num_pages` pages of `page_size` tokens.

        dtype: the pools' dtype when unquantized; ignored when `quant` is given (the pools
          then hold `quant.storage_dtype`; `gather_kv` picks the dequantized dtype).
        quant: None, or a `KVQuant` for a quantized cache.
        k_scale, v_scale: the per-tensor scales (float scalars, default 1.0) of a
          `granularity="tensor"` cache; not accepted otherwise (group scales are computed
          on write; their pages start at 1.0).
        """
        for name, value in (
            ("num_pages", num_pages),
            ("page_size", page_size),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            if int(value) != value or value < 1:
                raise ValueError(f"PagedKVCache.create: {name}={value} must be a positive int")
        if quant is not None and not isinstance(quant, KVQuant):
            raise ValueError(f"PagedKVCache.create: quant={quant!r}: expected a KVQuant or None")
        tensor = quant is not None and quant.granularity == "tensor"
        for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
            if value is not None and not tensor:
                raise ValueError(
                    f"PagedKVCache.create: {name}={value} needs a per-tensor quantized cache; "
                    f"got {quant=}"
                )
        rows = (num_pages, num_kv_heads, page_size)
        if quant is None:
            data = (rows + (head_dim,), dtype)
            cache = cls(jnp.zeros(*data), jnp.zeros(*data))
        else:
            quant.check(head_dim)
            data = (rows + (quant.packed_dim(head_dim),), quant.storage_dtype)
            if tensor:
                scales = (_tensor_scale("k_scale", k_scale), _tensor_scale("v_scale", v_scale))
            else:
                shape = rows + (quant.num_groups(head_dim),)
                scales = (jnp.ones(shape, jnp.bfloat16), jnp.ones(shape, jnp.bfloat16))
            cache = cls(jnp.zeros(*data), jnp.zeros(*data), *scales, quant=quant)
        cache.check()
        return cache

    def check(self) -> None:
        """Trace-time consistency of pools, scales and `quant` (shapes and dtypes only):
        ValueError naming the field and the shapes. `write_kv` and `gather_kv` call it."""
        k, v = self.k_pages, self.v_pages
        if k.ndim != 4 or k.shape != v.shape or k.dtype != v.dtype:
            raise ValueError(
                f"k_pages {k.shape} {k.dtype} and v_pages {v.shape} {v.dtype}: expected one "
                "shape [N, Hkv, P, D] and one dtype"
            )
        quant = self.quant
        if quant is None:
            if self.k_scales is not None or self.v_scales is not None:
                raise ValueError("k_scales, v_scales: an unquantized cache (quant=None) has none")
            if not jnp.issubdtype(k.dtype, jnp.floating):
                raise ValueError(
                    f"k_pages.dtype={k.dtype}: an unquantized cache (quant=None) holds floats; "
                    "for integer codes with scales pass quant=KVQuant(...)"
                )
            return
        quant.check(self.head_dim)
        if k.dtype != quant.storage_dtype:
            raise ValueError(f"k_pages.dtype={k.dtype}: {quant} stores {quant.storage_dtype}")
        if quant.granularity == "tensor":
            want = "float32 []"
        else:
            want = f"bfloat16 {list(k.shape[:3]) + [quant.num_groups(self.head_dim)]}"
        for name, scales in (("k_scales", self.k_scales), ("v_scales", self.v_scales)):
            got = "None" if scales is None else f"{jnp.dtype(scales.dtype)} {list(scales.shape)}"
            if got != want:
                raise ValueError(
                    f"{name}: got {got}, expected {want} for {quant} and k_pages of {k.shape}"
                )

    @property
    def num_pages(self) -> int:
        return self.k_pages.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.k_pages.shape[1]

    @property
    def page_size(self) -> int:
        return self.k_pages.shape[2]

    @property
    def head_dim(self) -> int:
        """The logical D (an int4 pool's last axis is D / 2)."""
        d = self.k_pages.shape[3]
        return d if self.quant is None else self.quant.unpacked_dim(d)

    @property
    def dtype(self):
        """The pools' storage dtype (int4: uint8)."""
        return self.k_pages.dtype


def _encode(cache: PagedKVCache, x, scales):
    """Tokens `[T, Hkv, D]` -> (stored `[T, Hkv, Dp]`, their group scales `[T, Hkv, G]` or
    None), with `scales` the cache's scales of that tensor."""
    quant = cache.quant
    if quant is None:
        return x.astype(cache.dtype), None
    if quant.granularity == "tensor":
        return quantize(x, scales, quant), None
    token_scales = group_scales(x, quant)
    return quantize(x, token_scales, quant), token_scales


def write_kv(
    cache: PagedKVCache,
    k: Float[Array, "T Hkv D"],
    v: Float[Array, "T Hkv D"],
    slot_mapping: Int[Array, " T"],
) -> PagedKVCache:
    """Writes token t's K/V into slot `slot_mapping[t]`; slots < 0 are skipped. The other
    slots must be distinct (as `KVCacheManager.slot_mapping` and `AttentionMetadata` make
    them): the scatter is declared free of duplicates, which lets XLA write in parallel
    (a 2048-token write on an H100: 43 -> 25 us).

    A quantized cache stores them quantized: with its per-tensor scales, or with per-group
    scales computed from these tokens and written to the same slots of the scale pages.
    Returns a new cache. Under `jax.jit(..., donate_argnums=...)` with the cache donated,
    XLA updates the pools (and scale pages) in place (no copy of the cache):

        step = jax.jit(write_kv, donate_argnums=0)
        cache = step(cache, k, v, slots)
    """
    return _write(cache, k, v, slot_mapping, None)[0]


def write_kv_stored(
    cache: PagedKVCache,
    k: Float[Array, "T Hkv D"],
    v: Float[Array, "T Hkv D"],
    slot_mapping: Int[Array, " T"],
    dtype,
) -> tuple[PagedKVCache, Float[Array, "T Hkv D"], Float[Array, "T Hkv D"]]:
    """`write_kv`, and the values it stored as a later read returns them in `dtype`
    (quantized and dequantized; unquantized: cast to the pools' dtype), from the same
    encoding: what attention sees of the new tokens without reading them back.
    Returns `(cache, k_stored, v_stored)`."""
    return _write(cache, k, v, slot_mapping, dtype)


def _write(cache, k, v, slot_mapping, read_dtype):
    """`write_kv`'s checks and scatter; with `read_dtype`, also the stored values read
    back in it (else None)."""
    cache.check()
    check_int32("write_kv", "slot_mapping", slot_mapping)
    if k.shape != v.shape or k.ndim != 3:
        raise ValueError(f"{k.shape=} and {v.shape=}: expected equal shapes [T, Hkv, D]")
    if k.dtype != v.dtype or not jnp.issubdtype(k.dtype, jnp.floating):
        raise ValueError(f"{k.dtype=} and {v.dtype=}: expected one float dtype")
    if k.shape[1:] != (cache.num_kv_heads, cache.head_dim):
        raise ValueError(
            f"{k.shape=}: expected [T, num_kv_heads={cache.num_kv_heads}, "
            f"head_dim={cache.head_dim}] for a cache of {cache.k_pages.shape=}"
        )
    if slot_mapping.shape != (k.shape[0],) or not jnp.issubdtype(slot_mapping.dtype, jnp.integer):
        raise ValueError(
            f"{slot_mapping.shape=}, {slot_mapping.dtype=}: expected int [T={k.shape[0]}]"
        )
    page_size = cache.page_size
    slots = slot_mapping.astype(jnp.int32)
    # Skipped tokens (and slots past the pool) point past the last page and are dropped.
    page = jnp.where(slots >= 0, slots // page_size, cache.num_pages)
    offset = jnp.where(slots >= 0, slots % page_size, 0)

    def scatter(pages, x):  # pages [N, Hkv, P, X], x [T, Hkv, X]
        return pages.at[page, :, offset].set(x, mode="drop", unique_indices=True)

    def read_back(stored, scales):
        if cache.quant is None:
            # XLA on GPU folds a convert to a narrower float and back into nothing (excess
            # precision): the barrier keeps the rounding to the pools' dtype. (Quantized
            # codes need none: `quantize` rounds explicitly.)
            return jax.lax.optimization_barrier(stored).astype(read_dtype)
        return dequantize(stored, scales, cache.quant, jnp.float32).astype(read_dtype)

    def write(pages, scales, x):
        stored, token_scales = _encode(cache, x, scales)
        read = None
        if read_dtype is not None:
            read = read_back(stored, scales if token_scales is None else token_scales)
        if token_scales is not None:
            scales = scatter(scales, token_scales)
        return scatter(pages, stored), scales, read

    k_pages, k_scales, k_read = write(cache.k_pages, cache.k_scales, k)
    v_pages, v_scales, v_read = write(cache.v_pages, cache.v_scales, v)
    return PagedKVCache(k_pages, v_pages, k_scales, v_scales, quant=cache.quant), k_read, v_read


def copy_pages(
    cache: PagedKVCache, src_pages: Int[Array, " N"], dst_pages: Int[Array, " N"]
) -> PagedKVCache:
    """Copies whole page `src_pages[i]` onto page `dst_pages[i]` (K, V and, per group,
    their scale pages); a pair with an entry < 0 or past the pool is skipped.

    The copy-on-write step of beam search: `KVCacheManager.fork` returns the pairs. Every
    pair reads the pages as they were before the call; destinations must be distinct.
    Returns a new cache; in place under `jax.jit(copy_pages, donate_argnums=0)`.
    """
    cache.check()
    check_int32("copy_pages", "src_pages", src_pages)
    check_int32("copy_pages", "dst_pages", dst_pages)
    src_pages, dst_pages = jnp.asarray(src_pages), jnp.asarray(dst_pages)
    if (
        src_pages.ndim != 1
        or src_pages.shape != dst_pages.shape
        or not jnp.issubdtype(src_pages.dtype, jnp.integer)
        or not jnp.issubdtype(dst_pages.dtype, jnp.integer)
    ):
        raise ValueError(
            f"copy_pages: {src_pages.shape=} {src_pages.dtype}, {dst_pages.shape=} "
            f"{dst_pages.dtype}: expected two int vectors [N] of one length"
        )
    n = cache.num_pages
    skip = (src_pages < 0) | (dst_pages < 0) | (src_pages >= n) | (dst_pages >= n)
    src = jnp.clip(src_pages, 0, n - 1)  # a skipped pair's read goes nowhere
    dst = jnp.where(skip, n, dst_pages)  # past the pool: dropped

    def copy(pool):  # [N, ...]
        return pool.at[dst].set(pool[src], mode="drop")

    group = cache.quant is not None and cache.quant.granularity == "group"
    scales = (cache.k_scales, cache.v_scales)
    return PagedKVCache(
        copy(cache.k_pages),
        copy(cache.v_pages),
        *(tuple(map(copy, scales)) if group else scales),
        quant=cache.quant,
    )


def gather_kv(
    cache: PagedKVCache,
    block_tables: Int[Array, "B max_pages"],
    lengths: Int[Array, " B"],
    max_len: int,
    dtype=None,
) -> tuple[Float[Array, "B max_len Hkv D"], Float[Array, "B max_len Hkv D"]]:
    """Contiguous K and V `[B, max_len, Hkv, D]` of each sequence (for tests, debugging and
    the reference), dequantized for a quantized cache.

    dtype: of the result; None = the pools' dtype (unquantized) or float32 (quantized:
    dequantization is computed in float32, then cast).
    Positions at or past `lengths[b]` (or past the table's capacity) are zeros. Block-table
    entries past a sequence's pages are never read. Page ids are clamped into the pool, as
    the decode kernel does, so a corrupt table never reads outside the cache (and reads
    what the kernel reads): `validate_page_table` reports such tables.
    """
    cache.check()
    if block_tables.ndim != 2 or not jnp.issubdtype(block_tables.dtype, jnp.integer):
        raise ValueError(f"{block_tables.shape=}, {block_tables.dtype=}: expected int [B, P]")
    if lengths.shape != block_tables.shape[:1] or not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise ValueError(
            f"{lengths.shape=}, {lengths.dtype=}: expected int [B={block_tables.shape[0]}]"
        )
    page_size, quant = cache.page_size, cache.quant
    pos = jnp.arange(max_len, dtype=jnp.int32)
    table_col = jnp.minimum(pos // page_size, block_tables.shape[1] - 1)
    pages = jnp.clip(block_tables[:, table_col], 0, cache.num_pages - 1)  # [B, max_len]
    valid = (pos[None, :] < lengths[:, None]) & (pos < block_tables.shape[1] * page_size)
    pages = jnp.where(valid, pages, 0)
    offsets = jnp.broadcast_to(pos % page_size, pages.shape)

    def gather(pool):  # [N, Hkv, P, X] -> [B, max_len, Hkv, X]
        return pool[pages, :, offsets]

    def read(pool, scales):
        if quant is None:
            x = gather(pool).astype(dtype or pool.dtype)
        else:
            scales = gather(scales) if quant.granularity == "group" else scales
            x = dequantize(gather(pool), scales, quant, dtype or jnp.float32)
        return jnp.where(valid[:, :, None, None], x, 0)

    return read(cache.k_pages, cache.k_scales), read(cache.v_pages, cache.v_scales)
