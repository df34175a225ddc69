"""`multi_head_cache_attention`: OpenPPL's `MultiHeadCacheAttention` (its definition:
`../shared/reference/openppl_multi_head_cache_attention.md`) over jaxattn's kernels.

One call writes the step's K/V into the cache (layer `layer_idx`, at `start_pos`), then
attends each sequence's query tokens to its `kvlen` keys: one-token rows through the
paged-decode kernel, longer rows through the flash kernel (its cached prefix read from
the cache in place, its own keys from the inputs as the cache stores them), as
`jaxattn.paged_attention` does for our own cache.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jaxattn import reference, validation
from jaxattn.dispatch import run_first
from jaxattn.int32 import check_int32
from jaxattn.positional import alibi_slopes
from jaxattn.ppl.cache import LAYOUTS, PPLCache
from pallas_kernels.common import use_interpret
from pallas_kernels.flash_prefill import (
    Batch,
    CachedPrefix,
    FlashPrefillConfig,
    LogitParams,
    flash_prefill,
)
from pallas_kernels.paged_decode import DecodeParams, PagedDecodeConfig, paged_decode

__all__ = ["check_inputs", "multi_head_cache_attention"]

_T1 = ("float16", "float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class _Options:
    """The static options of one call."""

    cache: PPLCache
    num_heads: int
    is_causal: bool
    is_alibi: bool
    max_seqlen: int
    max_kvlen: int


def multi_head_cache_attention(
    query: Float[Array, "T Hq D"],
    current_key: Float[Array, "T Hkv D"],
    current_value: Float[Array, "T Hkv D"],
    seqstarts: Int[Array, " B1"],
    kvstarts: Int[Array, " B1"],
    cachestarts: Int[Array, " B *P"],
    start_pos: Int[Array, " B"],
    decoding_batches: Int[Array, ""] | int,
    max_seqlen: int,
    max_kvlen: int,
    cache: jax.Array,
    scale: jax.Array | None = None,
    attn_mask: Float[Array, "*H T K"] | None = None,
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
    implementation: str | None = None,
    prefill_config: FlashPrefillConfig | None = None,
    decode_config: PagedDecodeConfig | None = None,
):
    """OpenPPL's `dynamic_batching.MultiHeadCacheAttention`, functional.

    Arguments and semantics are the definition's (B sequences, T packed tokens):

      query `[T, num_heads, head_dim]`, current_key / current_value `[T, num_kv_heads,
        head_dim]`: float16 or float32 (bfloat16 too), one dtype. Sequence b owns tokens
        `seqstarts[b] : seqstarts[b+1]`; tokens from `seqstarts[B]` on are padding (a
        static T may exceed the real count): they output zeros and are not written.
      seqstarts, kvstarts `[B+1]`: query and key offsets (kvlen = kvstarts[b+1] -
        kvstarts[b] keys: the cached past, then the current tokens).
      cachestarts: `[B]` (cache_mode 0: where each sequence starts in the cache's MaxT
        token rows) or `[B, MaxP]` (cache_mode 1: the token offsets of its pages of
        `page_size` tokens).
      start_pos `[B]`: the sequence position of the first current token: current token j
        is stored at position `start_pos[b] + j`. The keys are cat(past, current), the
        past being the `start_pos` cached tokens: `kvlen = start_pos + seqlen`
        (`check_inputs` raises otherwise).
      decoding_batches: an int scalar, the first batches are decoding: never
        causal-masked (may be traced).
      max_seqlen, max_kvlen: static ints >= every seqlen / kvlen (shape buckets for the
        kernels' tilings and the "xla" path).
      cache, scale: as `cache_layout` says (`jaxattn.ppl.cache`); scale float16 / float32
        with `head_dim // quant_group` groups, required iff `quant_bit` (8: int8 cache;
        4: uint8 cache of head_dim / 2 bytes, two codes a byte).
      attn_mask: None, or an additive float mask `[num_heads, T, K]` or `[T, K]`, K >=
        kvstarts[B]: element `[h, seqstarts[b] + i, kvstarts[b] + j]` adds to the logit
        of query i and key j of batch b.
      num_heads, head_dim, num_kv_heads (0: num_heads), num_layer, layer_idx, quant_bit,
        quant_group, cache_mode, cache_layout, page_size: static, as defined.
      is_causal: causal mask for batches from `decoding_batches` on (query i of batch b at
        position kvlen - seqlen + i sees keys j <= its position). is_alibi: add
        `-slope[h] * |i_pos - j|` with the ALiBi paper's slopes (`jaxattn.alibi_slopes`).
      implementation: "pallas" (the kernels; Pallas interpret mode without a GPU), "xla"
        (jnp, gathering each sequence's keys), or None (pallas on a GPU, else xla).
      prefill_config, decode_config: the kernels' tilings (None: heuristics).

    Index inputs may be int64 (the definition's type): they are taken as int32 (with
    jax's x64 mode off, as by default, jnp arrays are int32 already), so offsets must stay
    below 2**31 (a cache of fewer than 2**31 token rows).

    Returns `(attn_output [T, num_heads, head_dim], cache, scale)`: the cache (and the
    scale, None when not quantized) with the current K/V written; in place when the caller
    donates them to `jax.jit`. Nothing else of the cache changes: other layers, other
    sequences' rows and unowned rows stay bit-identical.

    Data-dependent preconditions (monotone offsets, positions inside the page table and the
    cache) are checked by `check_inputs`, not here.
    """
    validation.check_paged_prefill("prefill_config", prefill_config)
    validation.check_config("decode_config", decode_config, PagedDecodeConfig)
    options = _static(
        query, current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos,
        decoding_batches, cache, scale, attn_mask, num_heads, head_dim, num_kv_heads,
        num_layer, layer_idx, quant_bit, quant_group, cache_mode, cache_layout, page_size,
        is_causal, is_alibi, max_seqlen, max_kvlen,
    )  # fmt: skip
    ints = (seqstarts, kvstarts, cachestarts, start_pos, decoding_batches)
    seqstarts, kvstarts, cachestarts, start_pos, decoding_batches = (
        jnp.asarray(x).astype(jnp.int32) for x in ints
    )
    spec = options.cache
    table = spec.table(cachestarts)
    num_tokens = query.shape[0]
    token = jnp.arange(num_tokens, dtype=jnp.int32)
    # Each packed token's batch (padding tokens: the last, masked by `real`).
    batch = jnp.clip(jnp.searchsorted(seqstarts[1:], token, side="right"), 0, len(start_pos) - 1)
    real = token < seqstarts[-1]
    positions = start_pos[batch] + token - seqstarts[batch]
    rows = jnp.where(real, spec.rows(cache, table, batch, positions), spec.max_tokens(cache))
    cache, scale, k_stored, v_stored = spec.write(cache, scale, current_key, current_value, rows)
    lens = (seqstarts[1:] - seqstarts[:-1], kvstarts[1:] - kvstarts[:-1])
    args = (query, seqstarts, kvstarts, lens, batch, table, decoding_batches, cache, scale,
            attn_mask, options)  # fmt: skip

    def run(impl):
        if impl == "xla":
            return _xla(*args)
        return _pallas(*args, k_stored, v_stored, prefill_config, decode_config)

    out = run_first(implementation, run)
    return jnp.where(real[:, None, None], out, 0).astype(query.dtype), cache, scale


def _static(query, current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos,
            decoding_batches, cache, scale, attn_mask,
            num_heads, head_dim, num_kv_heads, num_layer, layer_idx, quant_bit, quant_group,
            cache_mode, cache_layout, page_size, is_causal, is_alibi, max_seqlen,
            max_kvlen):  # fmt: skip
    """Trace-time checks of shapes, dtypes and static options; the resolved `_Options`."""

    def fail(msg):
        raise ValueError(f"multi_head_cache_attention: {msg}")

    def is_int(value):  # bools are ints to Python: True would pass as 1
        return isinstance(value, (int, np.integer)) and not isinstance(value, bool)

    ints = dict(num_kv_heads=num_kv_heads, layer_idx=layer_idx, quant_bit=quant_bit,
                cache_mode=cache_mode, cache_layout=cache_layout,
                **(dict(quant_group=quant_group) if quant_bit else {}))  # fmt: skip
    for name, value in ints.items():
        if not is_int(value):
            fail(f"{name}={value!r} must be a Python int (static)")
    num_kv_heads = num_kv_heads or num_heads
    for name, value in (("num_heads", num_heads), ("head_dim", head_dim),
                        ("num_kv_heads", num_kv_heads), ("num_layer", num_layer),
                        ("page_size", page_size), ("max_seqlen", max_seqlen),
                        ("max_kvlen", max_kvlen)):  # fmt: skip
        if not is_int(value) or value < 1:
            fail(f"{name}={value!r} must be a positive Python int (static)")
    if num_heads % num_kv_heads:
        fail(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    if not 0 <= layer_idx < num_layer:
        fail(f"layer_idx={layer_idx} must be in [0, num_layer={num_layer})")
    if quant_bit not in (0, 4, 8):
        fail(f"quant_bit={quant_bit}: expected 0, 4 or 8")
    if quant_bit and (quant_group < 1 or head_dim % quant_group):
        fail(f"quant_group={quant_group} must divide head_dim={head_dim}")
    if quant_bit == 4 and head_dim % 2:
        fail(f"quant_bit=4 packs two codes a byte: head_dim={head_dim} must be even")
    if cache_mode not in (0, 1):
        fail(f"cache_mode={cache_mode}: expected 0 (offsets) or 1 (pages)")
    if cache_layout not in LAYOUTS:
        fail(f"cache_layout={cache_layout}: expected one of {list(LAYOUTS)}")
    if query.ndim != 3 or query.shape[1:] != (num_heads, head_dim):
        fail(f"query.shape={query.shape}: expected [T, num_heads={num_heads}, head_dim={head_dim}]")
    want = (query.shape[0], num_kv_heads, head_dim)
    for name, x in (("current_key", current_key), ("current_value", current_value)):
        if x.shape != want or x.dtype != query.dtype:
            fail(f"{name} {x.shape} {x.dtype}: expected {want} {query.dtype} (query's)")
    if str(query.dtype) not in _T1:
        fail(f"query.dtype={query.dtype}: expected one of {_T1}")
    batch = start_pos.shape[0] if jnp.ndim(start_pos) == 1 else -1
    for name, x, n in (("seqstarts", seqstarts, batch + 1), ("kvstarts", kvstarts, batch + 1),
                       ("start_pos", start_pos, batch)):  # fmt: skip
        if jnp.ndim(x) != 1 or x.shape[0] != n or n < 1 or not jnp.issubdtype(x.dtype, jnp.integer):
            fail(f"{name}.shape={jnp.shape(x)}: expected an int vector [{n}] (B={batch})")
    if cachestarts.shape[:1] != (batch,) or not jnp.issubdtype(cachestarts.dtype, jnp.integer):
        fail(
            f"cachestarts.shape={cachestarts.shape} {cachestarts.dtype}: expected int, "
            f"B={batch} rows"
        )
    if jnp.ndim(decoding_batches) or not jnp.issubdtype(jnp.result_type(decoding_batches),
                                                        jnp.integer):  # fmt: skip
        fail(f"decoding_batches={decoding_batches!r}: expected an int scalar")
    spec = PPLCache(num_layer, layer_idx, num_kv_heads, head_dim, quant_bit, quant_group,
                    cache_mode, cache_layout, page_size)  # fmt: skip
    try:
        spec.check(cache, scale, cachestarts)
    except ValueError as e:
        fail(str(e))
    if attn_mask is not None:
        ok = attn_mask.ndim in (2, 3) and attn_mask.shape[-2] == query.shape[0]
        if attn_mask.ndim == 3:
            ok &= attn_mask.shape[0] == num_heads
        if not ok or str(attn_mask.dtype) not in _T1:
            fail(
                f"attn_mask {attn_mask.shape} {attn_mask.dtype}: expected a float "
                f"[num_heads={num_heads}, T={query.shape[0]}, K] or [T, K] (K >= kvstarts[B])"
            )
    return _Options(spec, num_heads, bool(is_causal), bool(is_alibi), max_seqlen, max_kvlen)


def _alibi(options: _Options):
    return jnp.asarray(alibi_slopes(options.num_heads), jnp.float32) if options.is_alibi else None


# ---------------------------------------------------------------- kernels
def _pallas(query, seqstarts, kvstarts, lens, batch, table, decoding_batches, cache, scale,
            attn_mask, options: _Options, k_new, v_new, prefill_config, decode_config):  # fmt: skip
    """One-token rows: the decode kernel over the cache; others: the flash kernel, the
    cached prefix read in place and the current keys as stored (`k_new`, `v_new`). With a
    mask, every row takes the flash kernel (the decode kernel has no bias); with
    `max_seqlen == 1` and no mask, the decode kernel alone. Returns out `[T, Hq, D]`."""
    spec, interpret = options.cache, use_interpret()
    seqlen, kvlen = lens
    num_tokens, _, head_dim = query.shape
    fmt = spec.format(cache)
    decode_rows = (seqlen == 1) & (attn_mask is None)
    decode = functools.partial(
        _decode_rows, query, seqstarts, batch, table, cache, scale, options, fmt, decode_rows,
        kvlen, decode_config, interpret,
    )  # fmt: skip
    if options.max_seqlen == 1 and attn_mask is None:  # a decode step: no flash launch
        return decode(None)
    ctx_q = jnp.where(decode_rows, 0, seqlen)
    flash_batch = Batch(
        q_len=ctx_q,
        kv_len=jnp.where(decode_rows, 0, kvlen),
        q_start=seqstarts[:-1],
        q_rows=ctx_q,
        k_start=seqstarts[:-1],
        k_cols=kvstarts[:-1],
        dense=False,
    )
    flash_config = (prefill_config or FlashPrefillConfig()).resolve(
        num_tokens, options.max_kvlen, head_dim, query.dtype, options.is_causal,
        lengths=True, packed=True, logit_tiles=attn_mask is not None, paged=True,
    )  # fmt: skip
    bias = None
    if attn_mask is not None:  # [1, Hq or 1, T, K]: rows and columns in packed coordinates
        bias = attn_mask.reshape(1, -1, *attn_mask.shape[-2:])
    flash = functools.partial(
        flash_prefill,
        cached=CachedPrefix(cache, cache, table, scale, scale, fmt=fmt),
        bias=bias,
        alibi_slopes=_alibi(options),
        config=flash_config,
        return_lse=True,
        interpret=interpret,
    )
    params = LogitParams(causal=options.is_causal, scale=head_dim**-0.5, packed_coords=True)
    if not options.is_causal:
        out, _ = flash(query, k_new, v_new, flash_batch, params=params)
    else:  # decoding batches are never masked: theirs of several tokens in a second launch
        decoding = jnp.arange(len(seqlen)) < decoding_batches
        only = lambda rows: dataclasses.replace(  # noqa: E731
            flash_batch, q_len=jnp.where(rows, ctx_q, 0), q_rows=jnp.where(rows, ctx_q, 0)
        )
        into = flash(query, k_new, v_new, only(~decoding), params=params)
        unmasked = dataclasses.replace(params, causal=False)
        out, _ = jax.lax.cond(
            jnp.any(decoding & (ctx_q > 0)),
            lambda into: flash(query, k_new, v_new, only(decoding), params=unmasked, into=into),
            lambda into: into,
            into,
        )
    return out if attn_mask is not None else decode(out)


def _decode_rows(query, seqstarts, batch, table, cache, scale, options: _Options, fmt,
                 decode_rows, kvlen, decode_config, interpret, out):  # fmt: skip
    """The decode kernel for the one-token rows `decode_rows`, merged into the other rows'
    output `out` (None: every row has one token); `batch`: each token's batch."""
    spec = options.cache
    num_tokens, _, head_dim = query.shape
    decode_config = decode_config or PagedDecodeConfig.for_format(
        fmt, head_dim, len(kvlen), spec.num_kv_heads, options.max_kvlen,
        spec.table_page_size(cache),
    )  # fmt: skip
    first = jnp.minimum(seqstarts[:-1], num_tokens - 1)
    out_d, _ = paged_decode(
        query[first],
        cache,
        cache,
        table,
        jnp.where(decode_rows, kvlen, 0),
        k_scales=scale,
        v_scales=scale,
        alibi_slopes=_alibi(options),
        params=DecodeParams(scale=head_dim**-0.5),
        config=decode_config,
        fmt=fmt,
        interpret=interpret,
    )
    if out is None:
        return out_d[batch]
    return jnp.where(decode_rows[batch][:, None, None], out_d[batch], out)


# ---------------------------------------------------------------- xla
def _xla(query, seqstarts, kvstarts, lens, token_batch, table, decoding_batches, cache, scale,
         attn_mask, options: _Options):  # fmt: skip
    """Each sequence's queries `[max_seqlen]` and keys `[max_kvlen]` gathered dense (keys
    read back from the cache, dequantized), the reference attention, scattered back. Its
    logits are float32 `[B, Hq, max_seqlen, max_kvlen]`: a test and CPU path, not one for
    large steps (8.6 GB for 64 rows of 2048 keys with a 512-token chunk)."""
    spec = options.cache
    seqlen, kvlen = lens
    num_batch, dtype = len(seqlen), query.dtype
    i = jnp.arange(options.max_seqlen)
    j = jnp.arange(options.max_kvlen)
    batch = jnp.arange(num_batch)[:, None]
    q_rows = jnp.clip(seqstarts[:-1, None] + i, 0, query.shape[0] - 1)  # [B, Sq]
    rows = spec.rows(cache, table, jnp.broadcast_to(batch, (num_batch, len(j))), j[None, :])
    rows = jnp.clip(rows, 0, spec.max_tokens(cache) - 1)  # [B, Sk] (past kvlen: masked)
    keys = spec.read(cache, scale, rows, 0, dtype)
    values = spec.read(cache, scale, rows, 1, dtype)
    q_pos = (kvlen - seqlen)[:, None] + i  # [B, Sq]
    visible = jnp.ones((num_batch, 1, len(i), len(j)), bool)
    if options.is_causal:
        open_rows = (batch < decoding_batches)[:, :, None, None]
        visible = open_rows | (j[None, None, None, :] <= q_pos[:, None, :, None])
    bias = None
    if attn_mask is not None:
        mask = attn_mask.reshape(-1, *attn_mask.shape[-2:]).astype(jnp.float32)  # [Hm, T, K]
        cols = jnp.clip(kvstarts[:-1, None] + j, 0, mask.shape[-1] - 1)  # [B, Sk]
        bias = mask[:, q_rows[:, :, None], cols[:, None, :]].transpose(1, 0, 2, 3)
    out = reference.attention_reference(
        query[q_rows], keys, values, q_lengths=seqlen, kv_lengths=kvlen, mask=visible,
        bias=bias, alibi_slopes=_alibi(options), scale=query.shape[-1] ** -0.5,
    )  # fmt: skip
    token = jnp.arange(query.shape[0])
    local = jnp.clip(token - seqstarts[token_batch], 0, options.max_seqlen - 1)
    return out[token_batch, local]


# ---------------------------------------------------------------- opt-in validation
def check_inputs(*args, **kwargs) -> None:
    """The data-dependent preconditions of `multi_head_cache_attention` on concrete
    inputs (its arguments, as passed to it; call it outside `jit`): ValueError naming the
    argument and the offending batch, after the op's own trace-time checks. Checks:
    index inputs within int32 (int64 arrays as given, before the op takes them as int32);
    seqstarts and kvstarts start at 0 (seqstarts) and never decrease; seqlen <= kvlen,
    seqlen <= max_seqlen, kvlen <= max_kvlen; seqstarts[B] <= T; 0 <= decoding_batches <=
    B; start_pos >= 0 and `start_pos + seqlen == kvlen` (the keys are the start_pos cached
    ones and the current ones); the positions `[0, kvlen)` inside the page table (mode
    1: MaxP * page_size) and, with their rows, inside the cache; the mask wide enough."""
    bound = inspect.signature(multi_head_cache_attention).bind(*args, **kwargs)
    bound.apply_defaults()  # the op's own defaults
    given = dict(bound.arguments)
    for name in ("seqstarts", "kvstarts", "cachestarts", "start_pos", "decoding_batches"):
        check_int32("multi_head_cache_attention inputs", name, given[name])
    for name in ("seqstarts", "kvstarts", "cachestarts", "start_pos"):
        given[name] = jnp.asarray(given[name])
    opts = _static(**{name: given[name] for name in inspect.signature(_static).parameters})
    query, cache, attn_mask = given["query"], given["cache"], given["attn_mask"]
    decoding_batches = given["decoding_batches"]
    max_seqlen, max_kvlen = given["max_seqlen"], given["max_kvlen"]
    seqstarts, kvstarts, start_pos, cachestarts = (
        np.asarray(given[name], np.int64)
        for name in ("seqstarts", "kvstarts", "start_pos", "cachestarts")
    )

    def fail(msg):
        raise ValueError(f"multi_head_cache_attention inputs: {msg}")

    for name, x in (("seqstarts", seqstarts), ("kvstarts", kvstarts)):
        if x[0] != 0 or np.any(np.diff(x) < 0):
            fail(f"{name}={x.tolist()} must start at 0 and never decrease")
    seqlen, kvlen = np.diff(seqstarts), np.diff(kvstarts)
    num_batch = len(seqlen)
    for what, bad in (
        ("seqlen > kvlen", seqlen > kvlen),
        (f"seqlen > max_seqlen={max_seqlen}", seqlen > max_seqlen),
        (f"kvlen > max_kvlen={max_kvlen}", kvlen > max_kvlen),
        ("start_pos < 0", start_pos < 0),
        ("start_pos + seqlen != kvlen", start_pos + seqlen != kvlen),
    ):
        if np.any(bad):
            fail(f"{what} in batches {np.flatnonzero(bad).tolist()}")
    if seqstarts[-1] > query.shape[0]:
        fail(f"seqstarts[B]={seqstarts[-1]} > T={query.shape[0]} (query.shape={query.shape})")
    if not 0 <= int(decoding_batches) <= num_batch:
        fail(f"decoding_batches={int(decoding_batches)} must be in [0, B={num_batch}]")
    spec = opts.cache
    max_t = spec.max_tokens(cache)
    ends = kvlen  # positions written and read: [0, kvlen)
    if spec.cache_mode == 1:
        capacity = cachestarts.shape[1] * spec.page_size
        bad = ends > capacity
        if np.any(bad):
            fail(
                f"kvlen beyond the page table (MaxP * page_size = "
                f"{capacity}) in batches {np.flatnonzero(bad).tolist()}"
            )
        used = (np.arange(cachestarts.shape[1])[None, :] * spec.page_size) < ends[:, None]
        bad = used & ((cachestarts < 0) | (cachestarts + spec.page_size > max_t))
        bad = np.any(bad, axis=1)
    else:
        bad = (cachestarts < 0) | (cachestarts + ends > max_t)
    if np.any(bad):
        fail(f"cachestarts put rows of batches {np.flatnonzero(bad).tolist()} outside the "
             f"cache's MaxT={max_t} token rows")  # fmt: skip
    if attn_mask is not None and attn_mask.shape[-1] < kvstarts[-1]:
        fail(f"attn_mask.shape={attn_mask.shape}: last axis < kvstarts[B]={kvstarts[-1]}")
