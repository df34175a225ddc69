"""`AttentionMetadata`: the plan of one serving step, built once and used by every layer.

A step of in-flight batching packs the new tokens of many sequences into one `[T]` axis:
rows (sequences) in any order, each a context chunk (several tokens, attending to its
cached prefix and to itself) or a generation token (one). The plan says where each row's
tokens are, how long each sequence is after the step, where its pages are, and where each
new token goes in the cache (FlashInfer's "plan once, run many").

Buckets are the shapes: T = max_tokens, S = max_seqs, M = max_pages_per_seq. A serving
loop that pads every step to one of a few buckets compiles once per bucket.

Worked example, P = 4: row 0 continues a prompt (8 cached tokens + a 4-token chunk), row 1
generates its 6th token, row 2 is padding; T = 8 (3 padding tokens):

    cu_seqlens_q  [0, 4, 5, 5]           q_len = [4, 1, 0]
    context_lens  [12, 6, 0]             prefix = context_lens - q_len = [8, 5, 0]
    positions     [8, 9, 10, 11, 5, 0, 0, 0]
    slot_mapping  [page(0, 2)*4 + 0, ..., page(0, 2)*4 + 3, page(1, 1)*4 + 1, -1, -1, -1]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int

from jaxattn.int32 import as_int32, check_int32, host_values
from jaxattn.manager import KVCacheManager
from pallas_kernels.cache_read import ring_position

__all__ = ["AttentionMetadata"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Where the tokens of one step are and where they go (a pytree; arrays are leaves).

    Attributes:
      cu_seqlens_q: int32 `[S+1]`; row s owns tokens `cu_seqlens_q[s] : cu_seqlens_q[s+1]`.
        Padding rows have no tokens; tokens from `cu_seqlens_q[S]` on are padding.
      context_lens: int32 `[S]`; the sequence's length after this step (cached prefix plus
        its new tokens); 0 for padding rows.
      block_tables: int32 `[S, M]`; the row's pages (a `KVCacheManager` table row).
      positions: int32 `[T]`; each token's position, `context_lens[s] - q_len[s] + i`;
        0 for padding tokens. RoPE rotates at these positions.
      slot_mapping: int32 `[T]`; each token's cache slot (`page * P + offset`), -1 to skip.
      seq_ids: int32 `[S]`; the manager row of each batch row, -1 for padding rows.
      ring: static; `(kept, size)` of a cyclic (window) cache (`KVCacheManager.ring`), or
        None: positions below `kept` are stored as they are, later ones cycle through
        `size` slots.
      decode_only: static; every row has at most one new token (a generation-only step).
        `paged_attention` then runs the decode kernel alone: no flash-kernel branch, no
        merge of two kernels' rows. A row with more tokens in such a plan is an error
        that `check()` reports (its tokens output zeros).
      page_size: static; P of the manager or tables the plan was made for (its slots are
        `page * P + offset`), or None (not known). `paged_attention` raises when it is not
        the cache's page size.
      asked_tokens: int32 `[]`, the new tokens the caller asked for (`build`: the sum of
        `q_lens` before the cut at T), or None (not known). More than T is an overfull
        step: its last rows lost tokens, whole rows perhaps, and `check()` reports it.
    """

    cu_seqlens_q: Int[Array, " S1"]
    context_lens: Int[Array, " S"]
    block_tables: Int[Array, "S M"]
    positions: Int[Array, " T"]
    slot_mapping: Int[Array, " T"]
    seq_ids: Int[Array, " S"]
    ring: tuple[int, int] | None = dataclasses.field(default=None, metadata=dict(static=True))
    decode_only: bool = dataclasses.field(default=False, metadata=dict(static=True))
    page_size: int | None = dataclasses.field(default=None, metadata=dict(static=True))
    asked_tokens: Int[Array, ""] | None = None

    # ------------------------------------------------------------------ sizes
    @property
    def max_tokens(self) -> int:
        return self.positions.shape[0]

    @property
    def max_seqs(self) -> int:
        return self.context_lens.shape[0]

    @property
    def max_pages(self) -> int:
        return self.block_tables.shape[1]

    @property
    def q_lens(self) -> Int[Array, " S"]:
        """int32 `[S]`: new tokens of each row."""
        return jnp.diff(self.cu_seqlens_q)

    @property
    def num_context(self) -> Int[Array, ""]:
        """Rows with more than one new token (context or chunked context)."""
        return jnp.sum(self.q_lens > 1, dtype=jnp.int32)

    @property
    def num_generation(self) -> Int[Array, ""]:
        """Rows with exactly one new token (generation)."""
        return jnp.sum(self.q_lens == 1, dtype=jnp.int32)

    def token_rows(self) -> tuple[Int[Array, " T"], jax.Array]:
        """(row of each token int32 `[T]`, clamped into [0, S); bool `[T]` real token)."""
        t = jnp.arange(self.max_tokens, dtype=jnp.int32)
        row = jnp.sum(t[:, None] >= self.cu_seqlens_q[None, 1:], axis=1, dtype=jnp.int32)
        return jnp.minimum(row, self.max_seqs - 1), t < self.cu_seqlens_q[-1]

    # ------------------------------------------------------------------ builders
    @classmethod
    def build(
        cls,
        mgr: KVCacheManager,
        seq_ids: Int[Array, " S"],
        q_lens: Int[Array, " S"],
        max_tokens,
        *,
        decode_only: bool = False,
    ) -> AttentionMetadata:
        """The plan on the device (jittable), after `mgr.reserve` grew each sequence to its
        length after the step.

        Args:
          mgr: the manager; row `seq_ids[s]`'s length is taken as the length after the step.
          seq_ids: int `[S]`, manager rows in batch order; < 0 = padding row.
          q_lens: int `[S]`, new tokens per row (ignored for padding rows). A negative
            count for a live row raises where both arrays come from the host; a traced one
            counts as 0 (no tokens).
          max_tokens: T, the token bucket (static).
          decode_only: static; the caller promises every q_len is 0 or 1 (see the class).

        The rows keep the caller's packing of tokens (`cu_seqlens_q` from `q_lens`), valid
        or not, so that no row's tokens are taken for another's. A row the manager cannot
        place (an id >= `mgr.max_seqs`: no pages, length 0; or more new tokens than its
        reserved length, whose first tokens then sit at negative positions) writes nothing
        where it has no slot, its tokens without keys output zeros, and `check()` reports
        it (`q_within_context`), as it reports a sequence in two rows (`distinct_rows`).
        Tokens past T are dropped (`check()`: `tokens_fit`); a row cut short keeps its
        first tokens, planned as a step of those alone (its `context_lens` end with them),
        while the manager still counts the dropped ones, whose keys are never written.
        """
        check_int32("AttentionMetadata.build", "seq_ids", seq_ids)
        check_int32("AttentionMetadata.build", "q_lens", q_lens)
        _check_host_q_lens(seq_ids, q_lens)
        seq_ids, q_lens = as_int32(seq_ids), as_int32(q_lens)
        if seq_ids.ndim != 1 or q_lens.shape != seq_ids.shape:
            raise ValueError(
                f"AttentionMetadata.build: {seq_ids.shape=} and {q_lens.shape=}: expected [S]"
            )
        live = seq_ids >= 0
        known = live & (seq_ids < mgr.max_seqs)  # a manager row
        row = jnp.clip(seq_ids, 0, mgr.max_seqs - 1)
        context_lens = jnp.where(known, mgr.lengths[row], 0)
        q_lens = jnp.where(live, jnp.maximum(q_lens, 0), 0)
        cu = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(q_lens, dtype=jnp.int32)])
        asked = cu[-1]
        # Tokens past the bucket are dropped: `check()` reports it (`tokens_fit`). A row cut
        # short keeps its first tokens at their own positions, and its keys end with them
        # (the kernels align a row's queries to its last key).
        cu = jnp.minimum(cu, max_tokens)
        cut = q_lens - (cu[1:] - cu[:-1])
        meta = cls(
            cu_seqlens_q=cu,
            context_lens=jnp.maximum(context_lens - cut, 0),
            block_tables=jnp.where(known[:, None], mgr.block_tables[row], -1),
            positions=jnp.zeros(max_tokens, jnp.int32),
            slot_mapping=jnp.full(max_tokens, -1, jnp.int32),
            seq_ids=jnp.where(live, seq_ids, -1),
            ring=mgr.ring,
            decode_only=bool(decode_only),
            page_size=mgr.page_size,
            asked_tokens=asked,
        )
        tok_row, real = meta.token_rows()
        t = jnp.arange(max_tokens, dtype=jnp.int32)
        positions = context_lens[tok_row] - q_lens[tok_row] + (t - cu[tok_row])
        positions = jnp.where(real, positions, 0)
        slots = mgr.slot_mapping(jnp.where(real, seq_ids[tok_row], -1), positions)
        return dataclasses.replace(meta, positions=positions, slot_mapping=slots)

    @classmethod
    def from_lists(
        cls,
        q_lens: Sequence[int],
        context_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        page_size: int,
        *,
        max_tokens: int,
        max_seqs: int,
        max_pages: int,
        ring: tuple[int, int] | None = None,
        decode_only: bool = False,
    ) -> AttentionMetadata:
        """The plan from host lists (numpy), padded to the buckets.

        Args:
          q_lens, context_lens: per live row: new tokens, and length after the step.
          block_tables: per live row, its page ids (at least the pages its positions use).
          page_size: P. max_tokens, max_seqs, max_pages: the buckets T, S, M.
          ring: a cyclic cache's `(kept, size)` (`KVCacheManager.ring`), or None.
          decode_only: every q_len is 0 or 1 (see the class); checked here.
        Seq ids are the row numbers `0..len(q_lens)-1`. Raises ValueError for a plan that
        does not fit its buckets or tables, or whose new tokens share a cache slot.
        """
        n = len(q_lens)
        if len(context_lens) != n or len(block_tables) != n:
            raise ValueError(
                f"AttentionMetadata.from_lists: {len(q_lens)} q_lens, {len(context_lens)} "
                f"context_lens and {len(block_tables)} block_tables: one each per row"
            )
        q = np.asarray(q_lens, np.int64).reshape(-1)
        ctx = np.asarray(context_lens, np.int64).reshape(-1)
        if n > max_seqs:
            raise ValueError(f"from_lists: {n} rows do not fit in max_seqs={max_seqs}")
        if q.sum() > max_tokens:
            raise ValueError(f"from_lists: q_lens sum to {q.sum()} > max_tokens={max_tokens}")
        if decode_only and np.any(q > 1):
            raise ValueError(f"from_lists: decode_only=True needs q_lens <= 1; got {q_lens=}")
        if np.any(q < 0) or np.any(q > ctx):
            raise ValueError(
                f"from_lists: need 0 <= q_lens <= context_lens; got {q_lens=}, {context_lens=}"
            )
        tables = np.full((max_seqs, max_pages), -1, np.int64)
        for s, pages in enumerate(block_tables):
            if len(pages) > max_pages:
                raise ValueError(
                    f"from_lists: block_tables[{s}] has {len(pages)} pages > {max_pages=}"
                )
            tables[s, : len(pages)] = pages
        cu = np.zeros(max_seqs + 1, np.int64)
        cu[1 : n + 1] = np.cumsum(q)
        cu[n + 1 :] = cu[n]
        positions = np.zeros(max_tokens, np.int64)
        slots = np.full(max_tokens, -1, np.int64)
        for s in range(n):
            # Every page the row's positions are stored in (the new ones and those before:
            # a ring stores them in its first kept + size places) is in its table; an idle
            # row (no new token) is not read.
            places = ctx[s] if ring is None else min(ctx[s], sum(ring))
            held = tables[s, : -(-places // page_size)]
            if q[s] and (places > max_pages * page_size or np.any(held < 0)):
                raise ValueError(
                    f"from_lists: block_tables[{s}] does not hold positions up to {ctx[s] - 1}"
                )
            pos = np.arange(ctx[s] - q[s], ctx[s])
            stored = np.asarray(ring_position(pos, ring))
            # A chunk longer than a ring writes its sinks and its last `size` tokens only.
            pos_kept = True if ring is None else (pos < ring[0]) | (pos >= ctx[s] - ring[1])
            col = stored // page_size
            positions[cu[s] : cu[s + 1]] = pos
            page = tables[s, col]
            slots[cu[s] : cu[s + 1]] = np.where(pos_kept, page * page_size + stored % page_size, -1)
        written = slots[slots >= 0]
        if len(np.unique(written)) != len(written):  # `write_kv` takes its slots as unique
            raise ValueError(
                "from_lists: two new tokens write one cache slot (rows sharing a page "
                f"they both write); slots {slots.tolist()}"
            )
        ctx_all = np.zeros(max_seqs, np.int64)
        ctx_all[:n] = ctx
        seq_ids = np.where(np.arange(max_seqs) < n, np.arange(max_seqs), -1)
        for name, x in (("block_tables", tables), ("slots", slots), ("context_lens", ctx)):
            check_int32("AttentionMetadata.from_lists", name, x)
        i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
        return cls(
            cu_seqlens_q=i32(cu),
            context_lens=i32(ctx_all),
            block_tables=i32(tables),
            positions=i32(positions),
            slot_mapping=i32(slots),
            seq_ids=i32(seq_ids),
            ring=ring,
            decode_only=bool(decode_only),
            page_size=int(page_size),
            asked_tokens=i32(q.sum()),
        )

    # ------------------------------------------------------------------ checks
    def check(self) -> dict[str, jax.Array]:
        """Data-dependent consistency (opt-in, jittable): bool scalars by name and "ok".
        (Page ids and capacity: `jaxattn.validate_page_table`.)

        cu_monotone: `cu_seqlens_q` starts at 0, never decreases, ends within T.
        q_within_context: `0 <= q_len[s] <= context_lens[s]`.
        positions_match: every real token's position is `context_lens - q_len + i`.
        decode_only_rows: with `decode_only`, no row has more than one new token.
        distinct_rows: no sequence id in two rows (their tokens would share slots).
        tokens_fit: the new tokens asked for fit in T (`asked_tokens`; a row cut off
        whole by an overfull step has no token left to show it).
        """
        cu, q_lens = self.cu_seqlens_q, self.q_lens
        tok_row, real = self.token_rows()
        t = jnp.arange(self.max_tokens, dtype=jnp.int32)
        expect = self.context_lens[tok_row] - q_lens[tok_row] + (t - cu[tok_row])
        checks = dict(
            cu_monotone=(cu[0] == 0) & jnp.all(jnp.diff(cu) >= 0) & (cu[-1] <= self.max_tokens),
            q_within_context=jnp.all((q_lens >= 0) & (q_lens <= self.context_lens)),
            positions_match=jnp.all(jnp.where(real, self.positions == expect, True)),
            decode_only_rows=jnp.all(q_lens <= 1) | (not self.decode_only),
            distinct_rows=self._distinct_rows(),
            tokens_fit=jnp.asarray(
                self.asked_tokens is None or self.asked_tokens <= self.max_tokens
            ),
        )
        checks["ok"] = jnp.all(jnp.stack(list(checks.values())))
        return checks

    def _distinct_rows(self) -> jax.Array:
        ids = self.seq_ids
        same = (ids[:, None] == ids[None, :]) & (ids[:, None] >= 0)
        return ~jnp.any(same & ~jnp.eye(ids.shape[0], dtype=bool))


def _check_host_q_lens(seq_ids, q_lens) -> None:
    """A ValueError for a negative q_len of a live row (`seq_ids >= 0`), where both arrays
    are host values (numpy, lists; `host_values`)."""
    ids, lens = host_values(seq_ids), host_values(q_lens)
    if ids is None or lens is None or ids.shape != lens.shape:
        return  # (the shape check that follows names both)
    bad = np.flatnonzero((ids >= 0) & (lens < 0))
    if bad.size:
        raise ValueError(
            f"AttentionMetadata.build: q_lens must be >= 0 for live rows; rows {bad.tolist()} "
            f"(seq_ids {ids[bad].tolist()}) have {lens[bad].tolist()}"
        )
