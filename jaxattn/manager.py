"""`KVCacheManager`: a pure, jittable page allocator for the paged KV cache (a pytree).

TensorRT-LLM's KVCacheManager, on the device: a pool of `num_pages` pages of `page_size`
tokens, a block table and a length per sequence. Every method is pure jnp with static
shapes (works under `jax.jit`, returns a new manager), so the scheduler step that grows
sequences, maps new tokens to cache slots and writes them is one compiled program.

State (arrays are pytree leaves; `page_size` is static):
  block_tables  int32 `[max_seqs, max_pages_per_seq]`: row s lists the pages of sequence s,
                held pages first, then -1.
  lengths       int32 `[max_seqs]`: tokens sequence s holds; it holds ceil(length / P) pages.
  refcounts     int32 `[N]`: how many block-table entries point at each page; a page is
                free iff its count is 0. Counts, not an owner id: beams share pages.

Allocation is deterministic: the pages a `reserve` needs are the lowest free page ids, handed
to the sequences in increasing seq id order, each sequence's new pages in table order.

Worked example (FlashInfer-style), P = 4, 8 pages, 3 sequence rows:

    >>> mgr = KVCacheManager.create(num_pages=8, page_size=4, max_seqs=3, max_pages_per_seq=3)
    >>> mgr, ok = mgr.reserve(jnp.array([0, 2]), jnp.array([6, 3]))  # seq 0: 6 tokens, 2: 3
    >>> bool(ok), mgr.block_tables.tolist(), mgr.lengths.tolist(), int(mgr.num_free_pages)
    (True, [[0, 1, -1], [-1, -1, -1], [2, -1, -1]], [6, 0, 3], 5)

    Sequence 0 holds tokens 0..3 in page 0 and tokens 4, 5 in page 1 (offsets 0, 1); its
    token 5 lives in slot `block_tables[0, 5 // 4] * 4 + 5 % 4 = 1 * 4 + 1 = 5`. Position 6
    is past its length and padding ids (-1) map nowhere: slot -1 (`write_kv` skips it).

    >>> mgr.slot_mapping(jnp.array([0, 0, 2, -1]), jnp.array([5, 6, 0, 0])).tolist()
    [5, -1, 8, -1]

    Releasing sequence 0 frees pages 0 and 1; growing sequence 1 to 9 tokens (3 pages) then
    takes the lowest free pages 0, 1, 3 (page 2 is sequence 2's), so its pages are scattered:

    >>> mgr = mgr.release(jnp.array([0]))
    >>> mgr, ok = mgr.reserve(jnp.array([1]), jnp.array([9]))
    >>> mgr.block_tables.tolist(), mgr.lengths.tolist(), int(mgr.num_free_pages)
    ([[-1, -1, -1], [0, 1, 3], [2, -1, -1]], [0, 9, 3], 4)
    >>> mgr.slot_mapping(jnp.array([1, 1, 1]), jnp.array([3, 4, 8])).tolist()
    [3, 4, 12]

    A request the pool cannot meet changes nothing (all or nothing):

    >>> mgr2, ok = mgr.reserve(jnp.array([0, 2]), jnp.array([12, 12]))  # needs 3 + 2 > 4
    >>> bool(ok), mgr2.block_tables.tolist() == mgr.block_tables.tolist()
    (False, True)

Beam search (`fork`): a forked row shares its source's full pages (counts > 1) and gets
a copy of a partly filled last page, so every row owns the page it writes next. Pages are
only ever appended (`reserve`), so no row writes into a shared page; a shared page is
free once its last holder is released. (A cyclic cache rewrites every page of its ring:
there a fork shares only full pages of sink tokens and copies all the others.)

    >>> mgr, copy_src, copy_dst, ok = mgr.fork(jnp.array([1, 1]), jnp.array([0, -1]))
    >>> bool(ok), mgr.block_tables.tolist(), mgr.refcounts.tolist()
    (True, [[0, 1, 4], [0, 1, 3], [2, -1, -1]], [2, 2, 1, 1, 1, 0, 0, 0])
    >>> copy_src.tolist(), copy_dst.tolist()  # copy page 3 (token 8) into page 4
    ([3, -1], [4, -1])

In a serving loop (plan once per step, reuse in every layer):

    mgr, ok = step_reserve(mgr, seq_ids, new_lengths)            # jitted; preempt if not ok
    slots = mgr.slot_mapping(token_seq_ids, token_positions)      # once per step
    cache = write_kv(cache, k, v, slots)                          # every layer
    out = paged_decode(q, cache, mgr.block_tables[batch_rows], mgr.lengths[batch_rows])
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int

from jaxattn.int32 import as_int32, check_int32, is_int
from pallas_kernels.cache_read import ring_position

__all__ = ["KVCacheManager", "pad_ids", "reserve_from_lists"]

_INT32_MAX = np.iinfo(np.int32).max


def _int_vector(method: str, name: str, x, length: int | None = None) -> jax.Array:
    """`x` as an int32 `[length]` array; a ValueError naming `name` if it is not one."""
    check_int32(method, name, x)
    x = jnp.asarray(x)
    if x.ndim != 1 or (length is not None and x.shape[0] != length):
        want = "[T]" if length is None else f"[{length}]"
        raise ValueError(f"{method}: {name}.shape={x.shape}: expected a vector {want}")
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(f"{method}: {name}.dtype={x.dtype}: expected an integer dtype")
    return as_int32(x)


def _num_pages_for(lengths: jax.Array, page_size: int) -> jax.Array:
    """ceil(lengths / page_size) for lengths >= 0, without the int32 overflow of L + P - 1."""
    lengths = jnp.maximum(lengths, 0)
    return lengths // page_size + (lengths % page_size > 0)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCacheManager:
    """Free-page pool, block tables and lengths of up to `max_seqs` sequences.

    Sizes come from the array shapes (as in `PagedKVCache`), so they cannot disagree with
    them; `page_size` is static. Build one with `create`; every method returns a new manager.
    Seq ids index rows `0..max_seqs-1`; an id < 0 is padding and ignored everywhere.

    Attributes:
      block_tables: int32 `[max_seqs, max_pages_per_seq]`; row s holds sequence s's page
        ids in token order, -1 past its pages.
      lengths: int32 `[max_seqs]`; tokens each sequence holds (reserved, not necessarily
        written yet).
      refcounts: int32 `[N]`; block-table entries pointing at each page; 0 = free.
      page_size: P, tokens per page (static).
      window, sink_tokens: static; with a window the cache is cyclic (`ring`).

    Cyclic (sliding-window) caches: with `window=W` and `sink_tokens=S`, attention never
    reads a position below `p - W` other than the first S, so a row needs only its
    `M = max_pages_per_seq` pages however long the sequence grows: positions below S stay
    where they are (StreamingLLM's sinks), later ones cycle through the remaining
    `M * P - S` slots (`ring`), each new token overwriting the oldest. `window_pages(W, S,
    P) = ceil((W + S) / P) + 1` pages are enough for the decode kernel, which reads after
    the write; `paged_attention` reads a context chunk's prefix before its write, so long
    chunks fit too. Lengths keep counting positions; `slot_mapping` maps them into the ring.
    """

    block_tables: Int[Array, "max_seqs max_pages_per_seq"]
    lengths: Int[Array, " max_seqs"]
    refcounts: Int[Array, " N"]
    page_size: int = dataclasses.field(metadata=dict(static=True))
    window: int | None = dataclasses.field(default=None, metadata=dict(static=True))
    sink_tokens: int = dataclasses.field(default=0, metadata=dict(static=True))

    @classmethod
    def create(
        cls,
        num_pages: int,
        page_size: int,
        max_seqs: int,
        max_pages_per_seq: int,
        *,
        window: int | None = None,
        sink_tokens: int = 0,
    ) -> KVCacheManager:
        """An empty manager: every page free, every sequence of length 0.

        window, sink_tokens: a cyclic cache for attention with that window and sinks;
        `max_pages_per_seq` must be at least `window_pages(window, sink_tokens, page_size)`.
        """
        sizes = dict(
            num_pages=num_pages,
            page_size=page_size,
            max_seqs=max_seqs,
            max_pages_per_seq=max_pages_per_seq,
        )
        for name, value in sizes.items():
            if not is_int(value) or value < 1:
                raise ValueError(f"KVCacheManager.create: {name}={value!r} must be a positive int")
        # Slots (page * P + offset) and positions are int32.
        if num_pages * page_size > _INT32_MAX or max_pages_per_seq * page_size > _INT32_MAX:
            raise ValueError(
                f"KVCacheManager.create: {num_pages=}, {max_pages_per_seq=}, {page_size=}: "
                "slots and positions must fit in int32"
            )
        if window is not None:
            need = cls.window_pages(window, sink_tokens, page_size)
            if max_pages_per_seq < need:
                raise ValueError(
                    f"KVCacheManager.create: {max_pages_per_seq=} < {need} pages, what a "
                    f"cyclic cache with {window=}, {sink_tokens=}, {page_size=} needs"
                )
        elif sink_tokens:
            raise ValueError(f"KVCacheManager.create: {sink_tokens=} needs a window")
        return cls(
            block_tables=jnp.full((max_seqs, max_pages_per_seq), -1, jnp.int32),
            lengths=jnp.zeros((max_seqs,), jnp.int32),
            refcounts=jnp.zeros((num_pages,), jnp.int32),
            page_size=int(page_size),
            window=None if window is None else int(window),
            sink_tokens=int(sink_tokens),
        )

    @staticmethod
    def window_pages(window: int, sink_tokens: int, page_size: int) -> int:
        """Pages per sequence of a cyclic cache: `ceil((window + sink_tokens) / P) + 1`."""
        if not is_int(window) or window < 1 or not is_int(sink_tokens):
            raise ValueError(f"{window=} must be a positive int, {sink_tokens=} an int")
        if sink_tokens < 0:
            raise ValueError(f"{sink_tokens=} must be >= 0")
        return -(-(window + sink_tokens) // page_size) + 1

    # ------------------------------------------------------------------ sizes
    @property
    def num_pages(self) -> int:
        return self.refcounts.shape[0]

    @property
    def max_seqs(self) -> int:
        return self.block_tables.shape[0]

    @property
    def max_pages_per_seq(self) -> int:
        return self.block_tables.shape[1]

    @property
    def ring(self) -> tuple[int, int] | None:
        """`(kept, size)` of a cyclic cache, None otherwise: position t is stored at
        t if t < kept, else at `kept + (t - kept) % size` (slot order within the row's
        pages: column `stored // P`, offset `stored % P`)."""
        if self.window is None:
            return None
        return self.sink_tokens, self.max_pages_per_seq * self.page_size - self.sink_tokens

    def _pages_for(self, lengths: jax.Array) -> jax.Array:
        """Pages a row of `lengths` tokens holds (a cyclic row stops at its table's width)."""
        pages = _num_pages_for(lengths, self.page_size)
        return pages if self.ring is None else jnp.minimum(pages, self.max_pages_per_seq)

    @property
    def num_free_pages(self) -> Int[Array, ""]:
        """int32 scalar: pages with no reference."""
        return jnp.sum(self.refcounts == 0, dtype=jnp.int32)

    @property
    def pages_held(self) -> Int[Array, " max_seqs"]:
        """int32 `[max_seqs]`: pages in each sequence's block table."""
        return jnp.sum(self.block_tables >= 0, axis=1, dtype=jnp.int32)

    # ------------------------------------------------------------------ ops
    def reserve(
        self, seq_ids: Int[Array, " B"], lengths: Int[Array, " B"]
    ) -> tuple[KVCacheManager, Bool[Array, ""]]:
        """Grows sequence `seq_ids[b]` to hold `lengths[b]` tokens; all or nothing.

        Args:
          seq_ids: int `[B]`; rows to grow, < 0 = padding (ignored).
          lengths: int `[B]`; the length each sequence must reach. A length at or below the
            current one leaves that sequence unchanged (reserve never shrinks). A seq id
            given several times grows to the largest of its lengths.

        Returns:
          `(manager, ok)`, ok a bool scalar. When the pool has too few free pages, a
          sequence would need more than `max_pages_per_seq` pages, or an id is
          >= `max_seqs`, ok is False and the manager is returned unchanged (every array
          bit-identical). New pages are the lowest free page ids, given out in seq id order.

        Held pages are kept and new ones appended, never replaced. So the positions a grown
        sequence writes next (from its old length on) lie in its partly filled last page,
        which is its own (`fork` copies it), or in new pages: never in a page it shares.
        """
        seq_ids = _int_vector("reserve", "seq_ids", seq_ids)
        lengths = _int_vector("reserve", "lengths", lengths, seq_ids.shape[0])
        S, M = self.max_seqs, self.max_pages_per_seq

        live = seq_ids >= 0
        ids_ok = jnp.all(seq_ids < S)
        # Duplicates: scatter-max keeps the largest requested length per row.
        rows = jnp.where(live, seq_ids, S)  # padding rows land out of bounds: dropped
        target = self.lengths.at[rows].max(lengths, mode="drop")
        want_pages = self._pages_for(target)  # [S]
        held = self.pages_held  # [S]
        fits = jnp.all(want_pages <= M)
        need = jnp.clip(want_pages - held, 0, M)  # [S]; clipped so the sum cannot overflow
        total = jnp.sum(need)
        free = self.refcounts == 0  # [N]
        ok = ids_ok & fits & (total <= jnp.sum(free))

        # Free pages in id order: free_list[k] is the k-th lowest free page id (-1 past them).
        free_rank = jnp.cumsum(free, dtype=jnp.int32) - 1  # [N]
        page_ids = jnp.arange(self.num_pages, dtype=jnp.int32)
        free_list = jnp.full((self.num_pages,), -1, jnp.int32)
        free_list = free_list.at[jnp.where(free, free_rank, self.num_pages)].set(
            page_ids, mode="drop"
        )
        # Table entry (s, j) takes free page number first[s] + (j - held[s]) when it is one
        # of row s's new entries: held pages are a prefix of each row.
        first = jnp.cumsum(need) - need  # [S], exclusive prefix sum
        col = jnp.arange(M, dtype=jnp.int32)[None, :]  # [1, M]
        new_entry = (col >= held[:, None]) & (col < held[:, None] + need[:, None])  # [S, M]
        k = jnp.where(new_entry, first[:, None] + col - held[:, None], 0)
        tables = jnp.where(
            new_entry, free_list[jnp.minimum(k, self.num_pages - 1)], self.block_tables
        )
        refcounts = jnp.where(free & (free_rank < total), 1, self.refcounts)

        def pick(new, old):
            return jnp.where(ok, new, old)

        grown = dataclasses.replace(
            self,
            block_tables=pick(tables, self.block_tables),
            lengths=pick(target, self.lengths),
            refcounts=pick(refcounts, self.refcounts),
        )
        return grown, ok

    def release(self, seq_ids: Int[Array, " B"]) -> KVCacheManager:
        """Frees sequences `seq_ids` (int `[B]`): their pages' counts drop by one (a page
        is free at 0: a page shared by forked rows is free once its last holder is
        released), their table rows become -1, their lengths 0. Ids < 0 (padding) and
        >= `max_seqs` are ignored; an id given twice is released once."""
        seq_ids = _int_vector("release", "seq_ids", seq_ids)
        S, N = self.max_seqs, self.num_pages
        rows = jnp.where(seq_ids >= 0, seq_ids, S)
        gone = jnp.zeros((S,), bool).at[rows].set(True, mode="drop")  # [S]
        refs = jnp.where(gone[:, None] & (self.block_tables >= 0), self.block_tables, N)
        drops = jnp.zeros((N,), jnp.int32).at[refs.ravel()].add(1, mode="drop")
        return dataclasses.replace(
            self,
            block_tables=jnp.where(gone[:, None], -1, self.block_tables),
            lengths=jnp.where(gone, 0, self.lengths),
            refcounts=self.refcounts - drops,
        )

    def fork(
        self, src_ids: Int[Array, " B"], dst_ids: Int[Array, " B"]
    ) -> tuple[KVCacheManager, Int[Array, " C"], Int[Array, " C"], Bool[Array, ""]]:
        """Row `dst_ids[b]` becomes a copy of row `src_ids[b]` (beam search); all or nothing.

        The copy has the source's length and shares the source's pages that will never be
        written again (each shared page's count goes up by one); every other page the source
        holds is copied into a fresh page at the same table column (copy-on-write, done at
        fork time so every row owns every page it writes next), and the caller copies
        their contents with `jaxattn.copy_pages(cache, copy_src, copy_dst)`:

        - without a window, the full pages are shared and a partly filled last page is
          copied (at most one copy per pair);
        - in a cyclic cache (`ring = (kept, size)`), only full pages holding nothing but
          kept positions (sink tokens, column < kept // P) are shared. Every page of the
          ring is overwritten as the ring cycles, so all of them are copied, as is a partly
          filled page of sinks (up to `max_pages_per_seq` copies per pair).

        Fresh pages are the lowest free page ids, given out in pair order (a pair's pages
        in column order). A source may fork to several destinations (beam width k: k - 1
        pairs); every pair reads the rows as they were before the call.

        Fork between steps, after a step's K/V are written: the length counts reserved
        positions as held, so a fork between `reserve` and the write would share pages
        whose last tokens are not written yet, and the write would then skip them
        (`slot_mapping` gives no slot in a shared page).

        Args:
          src_ids, dst_ids: int `[B]`; a pair with an id < 0 is padding (ignored).

        Returns:
          `(manager, copy_src, copy_dst, ok)`: the pages to copy and where to, -1 where
          nothing is to copy (`copy_pages` skips those), in one of two shapes (C):
          without a window, int32 `[B]`: pair b's copy; in a cyclic cache, int32
          `[B * max_pages_per_seq]`, pair-major: entry `b * max_pages_per_seq + j` is pair
          b's copy of table column j. ok is a bool scalar: False when a destination is not
          empty (length 0), appears twice, an id is >= `max_seqs`, or the pool has too few
          free pages; then the manager is returned unchanged (every array bit-identical)
          and both copy vectors are all -1.
        """
        src_ids = _int_vector("fork", "src_ids", src_ids)
        dst_ids = _int_vector("fork", "dst_ids", dst_ids, src_ids.shape[0])
        P, S, N, M = self.page_size, self.max_seqs, self.num_pages, self.max_pages_per_seq

        live = (src_ids >= 0) & (dst_ids >= 0)
        src, dst = jnp.clip(src_ids, 0, S - 1), jnp.where(live, dst_ids, S)
        dst_uses = jnp.zeros((S,), jnp.int32).at[dst].add(1, mode="drop")
        length = jnp.where(live, self.lengths[src], 0)  # [B]
        held = self._pages_for(length)  # [B]
        # Pages never written again: full ones, and in a ring only those of sinks alone.
        num_shared = length // P  # [B]
        if self.ring is not None:
            num_shared = jnp.minimum(num_shared, self.ring[0] // P)
        col = jnp.arange(M, dtype=jnp.int32)[None, :]  # [1, M]
        shared = col < num_shared[:, None]  # [B, M]
        copied = ~shared & (col < held[:, None])  # [B, M]
        flat = copied.ravel()  # pair-major: the k-th copy takes the k-th free page
        free = jnp.nonzero(self.refcounts == 0, size=flat.shape[0], fill_value=-1)[0]
        fresh = jnp.where(flat, free[jnp.cumsum(flat) - 1], -1).reshape(copied.shape)
        ok = (
            jnp.all(~live | ((src_ids < S) & (dst_ids < S)))
            & jnp.all(dst_uses <= 1)
            & jnp.all((self.lengths[jnp.minimum(dst, S - 1)] == 0) | ~live)
            & (jnp.sum(flat) <= self.num_free_pages)
        )

        rows = self.block_tables[src]  # [B, M]
        new_rows = jnp.where(shared, rows, fresh)  # fresh is -1 past the copied pages
        refcounts = self.refcounts.at[jnp.where(shared, rows, N).ravel()].add(1, mode="drop")
        refcounts = refcounts.at[jnp.where(copied, fresh, N).ravel()].set(1, mode="drop")
        forked = dataclasses.replace(
            self,
            block_tables=self.block_tables.at[dst].set(new_rows, mode="drop"),
            lengths=self.lengths.at[dst].set(length, mode="drop"),
            refcounts=refcounts,
        )
        forked = jax.tree.map(lambda new, old: jnp.where(ok, new, old), forked, self)
        copy_src = jnp.where(ok & copied, rows, -1)  # [B, M]
        copy_dst = jnp.where(ok & copied, fresh, -1)
        if self.ring is None:  # at most one copy per pair (its last page): [B]
            return forked, jnp.max(copy_src, axis=1), jnp.max(copy_dst, axis=1), ok
        return forked, copy_src.ravel(), copy_dst.ravel(), ok

    def slot_mapping(
        self, seq_ids: Int[Array, " T"], positions: Int[Array, " T"]
    ) -> Int[Array, " T"]:
        """Cache slot of token (seq_ids[t], positions[t]), both int `[T]`.

        Returns int32 `[T]`: `block_tables[s, pos // P] * P + pos % P`, or -1 where the id
        is padding (< 0) or >= `max_seqs`, the position is < 0 or >= `lengths[s]`, the
        sequence has no page there, or the page is shared with another sequence (`fork`: a
        shared page is never written again): never a slot of a page the sequence does not
        hold alone.
        A cyclic cache maps `pos` into its ring first (`ring`), and gives -1 to positions
        the ring no longer holds (below `lengths[s] - size`, sinks excepted).
        Reserve first, then map the new tokens' positions.
        """
        seq_ids = _int_vector("slot_mapping", "seq_ids", seq_ids)
        positions = _int_vector("slot_mapping", "positions", positions, seq_ids.shape[0])
        P, S, M = self.page_size, self.max_seqs, self.max_pages_per_seq
        row = jnp.clip(seq_ids, 0, S - 1)
        stored = ring_position(positions, self.ring)
        valid = (seq_ids >= 0) & (seq_ids < S) & (positions >= 0)
        valid &= positions < self.lengths[row]
        if self.ring is not None:
            kept, size = self.ring
            valid &= (positions < kept) | (positions >= self.lengths[row] - size)
        col = stored // P
        page = self.block_tables[row, jnp.clip(col, 0, M - 1)]
        valid &= (col < M) & (page >= 0)
        valid &= self.refcounts[jnp.clip(page, 0, self.num_pages - 1)] == 1
        return jnp.where(valid, page * P + stored % P, -1).astype(jnp.int32)

    # ------------------------------------------------------------------ debugging
    def check(self) -> dict[str, Bool[Array, ""]]:
        """Data-dependent invariants (opt-in, jittable): bool scalars by name, and "ok".

        ids_in_range: table entries are -1 or page ids in [0, N).
        lengths_in_range: 0 <= lengths <= max_pages_per_seq * P.
        held_prefix: each row's pages come first, then only -1.
        held_matches_lengths: a sequence holds ceil(length / P) pages.
        distinct_in_row: no page appears twice in one sequence.
        refcounts_match_tables: each page's count equals the table entries pointing at it
          (so free + used = total and no free page is in a table).
        partial_pages_exclusive: a row's partly filled last page (the one it writes next)
          is its own (count 1): `fork` shares full pages only.
        ring_pages_exclusive: in a cyclic cache, every page a row holds at a column the
          ring cycles through (>= kept // P) is its own: it will be overwritten.
        exclusive: no page is shared (count <= 1). Informational, not part of "ok": it
          turns False when `fork` shares pages between beams.
        """
        P, N, M = self.page_size, self.num_pages, self.max_pages_per_seq
        t = self.block_tables
        held = self.pages_held
        col = jnp.arange(M)[None, :]
        refs = jnp.zeros((N,), jnp.int32).at[jnp.where(t >= 0, t, N).ravel()].add(1, mode="drop")
        same = (t[:, :, None] == t[:, None, :]) & (t[:, :, None] >= 0)  # [S, M, M]
        checks = dict(
            ids_in_range=jnp.all((t >= -1) & (t < N)),
            lengths_in_range=jnp.all(
                (self.lengths >= 0) & ((self.lengths <= M * P) | (self.ring is not None))
            ),
            held_prefix=jnp.all((t >= 0) == (col < held[:, None])),
            held_matches_lengths=jnp.all(held == self._pages_for(self.lengths)),
            distinct_in_row=jnp.sum(same) == jnp.sum(t >= 0),
            refcounts_match_tables=jnp.all(refs == self.refcounts),
        )
        last = t[jnp.arange(t.shape[0]), jnp.maximum(held - 1, 0)]  # [S]
        partial = (self.lengths % P > 0) & (last >= 0)
        checks["partial_pages_exclusive"] = jnp.all(
            ~partial | (self.refcounts[jnp.clip(last, 0, N - 1)] == 1)
        )
        rewritten = (t >= 0) & (col >= (M if self.ring is None else self.ring[0] // P))
        checks["ring_pages_exclusive"] = jnp.all(
            ~rewritten | (self.refcounts[jnp.clip(t, 0, N - 1)] == 1)
        )
        checks["ok"] = jnp.all(jnp.stack(list(checks.values())))
        checks["exclusive"] = jnp.all(self.refcounts <= 1)
        return checks


# ---------------------------------------------------------------------- host side
def pad_ids(ids: Sequence[int], size: int, fill: int = -1) -> Int[Array, " size"]:
    """int32 `[size]`: `ids` followed by `fill` (-1: padding). For batching into buckets
    (a few fixed sizes, so jitted steps compile once per bucket)."""
    if int(size) != size or size < 0:
        raise ValueError(f"pad_ids: {size=} must be a non-negative int")
    if len(ids) > size:
        raise ValueError(f"pad_ids: {len(ids)} ids do not fit in a bucket of size {size}")
    check_int32("pad_ids", "ids", ids)
    return jnp.asarray(
        np.pad(np.asarray(ids, np.int32).reshape(-1), (0, size - len(ids)), constant_values=fill)
    )


_reserve = jax.jit(KVCacheManager.reserve)


def reserve_from_lists(
    mgr: KVCacheManager, seq_ids: Sequence[int], lengths: Sequence[int], bucket: int
) -> tuple[KVCacheManager, Bool[Array, ""]]:
    """`mgr.reserve` (jitted) on Python lists padded to `bucket` entries."""
    if len(seq_ids) != len(lengths):
        raise ValueError(f"reserve_from_lists: {len(seq_ids)} seq_ids but {len(lengths)} lengths")
    return _reserve(mgr, pad_ids(seq_ids, bucket), pad_ids(lengths, bucket, fill=0))
