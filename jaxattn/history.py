"""History gather: long chunks attend over a contiguous copy of their keys and values.

The flash kernel reads a chunk's cached prefix through the block table, and that paged
key loop is slower than its packed one: the per-row page ids and addresses keep it at the
register cap. Copying a chunk's whole history (prefix from the pages, then its new rows)
into one contiguous buffer costs one read and one write of it, which grows with the
prefix while the attention grows with prefix x chunk; the chunk then runs the packed
kernel. H100, bf16, GQA 32/8, D 128 (bench/RESULTS.md, 2026-11-22 17:32 UTC), over a
14336-token prefix: a 2048-token chunk runs at 420 TFLOP/s gathered, 349 through the
paged loop, 457 for the dense kernel on the same work; a 512-token chunk at 332 against
323 (so `DEFAULT_MIN_TOKENS`). Shorter chunks keep the paged loop.

The buffer has a static number of rows (`PagedAttentionConfig.gather_tokens`): rows
qualify in batch order while their histories fit, the others keep the paged loop. Only
the rows used are copied (`pallas_kernels.history_gather`), but a plan in which some row
could qualify (enough tokens, a long enough table) always runs the copy kernel and a
second flash launch: a step where none does pays their fixed cost, ~25 us (the serving
mixed step: 0.300 -> 0.326 ms).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jaxtyping import Array, Bool, Int

from jaxattn.metadata import AttentionMetadata
from pallas_kernels.history_gather import BLOCK_ROWS

# The buffer when the config leaves it to the plan: the plan's capacity, at most this many
# rows and bytes (K and V together: 32768 rows of Hkv 8, D 128 in bf16 are 128 MiB).
DEFAULT_MAX_TOKENS = 32768
DEFAULT_MAX_BYTES = 256 * 2**20
DEFAULT_MIN_TOKENS = 512  # new tokens a row needs to be gathered


@dataclasses.dataclass(frozen=True)
class GatherPlan:
    """Which rows are gathered and where: `chosen` bool `[S]`, `starts` int32 `[S]` (a
    chosen row's first buffer row) and `sources` int32 `[3, G]` (`history_gather`)."""

    chosen: Bool[Array, " S"]
    starts: Int[Array, " S"]
    sources: Int[Array, "3 G"]


def buffer_rows(meta: AttentionMetadata, page_size: int, max_tokens: int | None,
                min_tokens: int, row_bytes: int) -> int:  # fmt: skip
    """The buffer's static row count G (a multiple of BLOCK_ROWS), or 0 when no row of
    this plan could qualify: fewer than `min_tokens` tokens in the step, or no history
    longer than that fits in the buffer or the table. `max_tokens` None: the defaults
    above, with `row_bytes` the bytes of one row of K and V (`2 * Hkv * D * itemsize`)."""
    capacity = meta.max_pages * page_size
    rows = max_tokens
    if max_tokens is None:
        rows = min(capacity, DEFAULT_MAX_TOKENS, DEFAULT_MAX_BYTES // row_bytes)
    rows = -(-rows // BLOCK_ROWS) * BLOCK_ROWS
    if meta.max_tokens < min_tokens or min(rows, capacity) <= min_tokens:
        return 0
    return rows


def plan(
    meta: AttentionMetadata,
    context_rows: Bool[Array, " S"],
    page_size: int,
    num_rows: int,
    min_tokens: int,
) -> GatherPlan:
    """Rows with a cached prefix and at least `min_tokens` new tokens, in batch order while
    their histories (`context_lens`) fit in `num_rows`; each row's source.

    Buffer row r of chosen row s holds position p = r - starts[s] of its sequence: below
    its prefix (`context_lens - q_lens`) from the cache (page `block_tables[s, p // P]`,
    offset `p % P`), after it from new row `cu_seqlens_q[s] + p - prefix`.
    """
    q_lens, lens, cu = meta.q_lens, meta.context_lens, meta.cu_seqlens_q
    prefix = lens - q_lens
    wanted = context_rows & (q_lens >= min_tokens) & (prefix > 0)
    ends = jnp.cumsum(jnp.where(wanted, lens, 0))
    chosen = wanted & (ends <= num_rows)  # once a row does not fit, no later one does
    length = jnp.where(chosen, lens, 0)
    ends = jnp.cumsum(length)
    starts = (ends - length).astype(jnp.int32)

    r = jnp.arange(num_rows, dtype=jnp.int32)
    s = jnp.minimum(jnp.sum(r[:, None] >= ends[None, :], axis=1), meta.max_seqs - 1)
    p = r - starts[s]
    used = r < ends[-1]
    in_cache = used & (p < prefix[s])
    col = jnp.clip(p // page_size, 0, meta.max_pages - 1)
    # A negative (corrupt) page id stays a cache read, clamped into the pool by the copy
    # kernel as by the paged loop, rather than leaving the row unwritten.
    page = jnp.where(in_cache, jnp.maximum(meta.block_tables[s, col], 0), -1)
    new = jnp.where(used & ~in_cache, cu[s] + p - prefix[s], -1)
    sources = jnp.stack([page, p % page_size, new]).astype(jnp.int32)
    return GatherPlan(chosen, starts, sources)
