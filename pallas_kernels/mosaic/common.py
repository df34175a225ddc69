"""Pieces both Hopper kernels (`forward.py`, `backward.py`) are built from: the warpgroup
roles, integer bounds that stay Python ints where they can, the visibility predicate, and
the producer's side of the TMA ring."""

from __future__ import annotations

import dataclasses
import functools
import heapq
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.mosaic.config import CONSUMERS

PRODUCER_REGISTERS = 40  # the producer warpgroup only issues TMA copies
CONSUMER_REGISTERS = 232  # what the consumers take back (wgmma accumulators)

__all__ = [
    "CONSUMERS",
    "CONSUMER_REGISTERS",
    "KeyRing",
    "PRODUCER_REGISTERS",
    "Sequence",
    "Tile",
    "clip",
    "consumer_steps",
    "dense_tile",
    "floor_div",
    "imax",
    "imin",
    "Launch",
    "SMS",
    "kernel_options",
    "key_ring",
    "load_plgpu",
    "produce",
    "ring_steps",
    "sequence_lengths",
    "sequence_of",
    "sink_end",
    "slot_of",
    "split_refs",
    "union",
    "visible",
    "within",
    "zero_padding",
]


SMS = 132  # streaming multiprocessors of an H100 / H200 (SXM): a wave of blocks


@dataclasses.dataclass(frozen=True)
class Launch:
    """The order in which a kernel's blocks start: a grid over `tiles` tiles of every
    (batch, head) pair, `heads` heads a sequence (static; the kernels take it whole).

    Blocks start tile-major within each section (below), so that every pair's tile 0
    starts before any pair's tile 1:
    the kernels number tiles heaviest first (causal: the query tiles that see the most
    keys, the key tiles seen by the most queries; packed: `tile_table`'s order), and the
    SMs then take the longest blocks first and end on short ones. Pallas Mosaic GPU
    launches a grid row-major (its last axis varies fastest); before this the grid was
    (heads, tiles, batch), and each head walked its tiles from heaviest to lightest before
    the next head's began: the last heads' heavy tiles ran alone at the end (H100, B1
    S4096 causal: the dK/dV kernel 0.69 -> 0.50 ms, bench/HISTORY.md).

    Pairs go in sections of `section` (heads fastest, so that the pairs of a section share
    their kv heads and sequences), tile-major within each: the blocks in flight read a
    section's keys and values (or queries) from L2 instead of every pair's at once. A
    section is the fewest pairs, whole kv groups of `group` heads, that fill two waves
    (`SMS`) of blocks (B8 S2048 causal, the dQ kernel: 0.81 ms, against 0.84 with all
    pairs in one section).
    """

    heads: int
    tiles: int
    batch: int
    group: int = 1

    @functools.cached_property  # read per block by `walk`'s loop
    def section(self) -> int:
        pairs = self.batch * self.heads
        for size in range(self.group, pairs, self.group):
            if pairs % size == 0 and size * self.tiles >= 2 * SMS:
                return size
        return pairs

    def grid(self) -> dict:
        """`plgpu.kernel`'s grid arguments."""
        sections = self.batch * self.heads // self.section
        return dict(grid=(sections, self.tiles, self.section),
                    grid_names=("section", "tiles", "member"))  # fmt: skip

    @property
    def items(self) -> int:
        """Blocks of the grid: tiles of every pair."""
        return self.tiles * self.heads * self.batch

    def item(self, i):
        """(tile, head, batch index) of the i-th block of the launch order (int32; a
        persistent kernel's blocks walk it; Python ints for a Python int, `walk`'s)."""
        section, rest = _divmod(i, self.tiles * self.section)
        return self.unravel(section, *_divmod(rest, self.section))

    def walk(self, blocks: int, cost) -> np.ndarray:
        """The tiles each of `blocks` persistent blocks walks when tiles differ (causal),
        as the GPU hands a block per tile out: in launch order, each to the block that
        frees first, a tile costing `cost(tile index)` (list scheduling, which the
        launch order's heaviest-first tiles make near-even). int32 `[blocks, 1 + n]`:
        row p holds block p's count, then its tiles' launch-order indices (0-padded).
        Host side, at trace time: costs depend only on the tile index."""
        costs = [cost(t) for t in range(self.tiles)]
        free = [(0, p) for p in range(blocks)]  # (busy until, block): a heap
        walks = [[] for _ in range(blocks)]
        for i in range(self.items):
            busy, p = heapq.heappop(free)
            walks[p].append(i)
            heapq.heappush(free, (busy + costs[self.item(i)[0]], p))
        table = np.zeros((blocks, 1 + max(map(len, walks))), np.int32)
        for p, walk in enumerate(walks):
            table[p, 0] = len(walk)
            table[p, 1 : 1 + len(walk)] = walk
        return table

    def place(self):
        """(tile, head, batch index) of the running block (inside the kernel)."""
        names = ("section", "tiles", "member")
        return self.unravel(*(lax.axis_index(name) for name in names))

    def unravel(self, section, tile, member):
        """(tile, head, batch index) of the block at grid index (section, tile, member)."""
        pair = section * self.section + member
        return tile, pair % self.heads, pair // self.heads


def load_plgpu():
    """`jax.experimental.pallas.mosaic_gpu`, imported when a kernel is built."""
    from jax.experimental.pallas import mosaic_gpu

    return mosaic_gpu


def _static(*xs) -> bool:
    return all(isinstance(x, int) for x in xs)


def _divmod(a, b: int):
    """(a // b, a % b) for a >= 0: Python ints for a Python int."""
    return divmod(a, b) if _static(a) else (lax.div(a, b), lax.rem(a, b))


def imax(a, b):
    """max that stays a Python int for Python ints: Mosaic GPU kernels take no array
    constants, and jnp on two ints would make one."""
    return max(a, b) if _static(a, b) else jnp.maximum(a, b)


def imin(a, b):
    return min(a, b) if _static(a, b) else jnp.minimum(a, b)


def clip(x, lo, hi):
    return imin(imax(x, lo), hi)


def floor_div(a, b: int):
    """floor(a / b) for a >= 0, and 0 for a < 0 (all the callers clip at 0 anyway); a
    Python int for a Python int."""
    return max(a, 0) // b if _static(a) else lax.div(jnp.maximum(a, 0), b)


def slot_of(step, stages: int):
    """The ring slot of ring step `step`."""
    return step % stages if isinstance(step, int) else lax.rem(step, stages)


def visible(pos, key, *, causal: bool, window: int | None, kv_len=None, kv_first=None,
            pos_range=None, sink_tokens: int = 0):  # fmt: skip
    """Whether the query at position `pos` sees the key at `key` (arrays of one shape):
    causal (key <= pos), within the window (key > pos - window, or one of the sequence's
    first `sink_tokens` keys) and, with lengths, a real key (key < kv_len, and key >=
    kv_first where given: a packed sequence's keys start there); `pos_range` (lo, hi):
    only queries at positions `lo <= pos < hi` are the sequence's (the dK/dV kernel of a
    packed batch reads the neighbours' rows too). At least one of them is set."""
    conditions = [] if kv_first is None else [key >= kv_first]
    if pos_range is not None:
        conditions += [pos >= pos_range[0], pos < pos_range[1]]
    if causal:
        conditions.append(key <= pos)
    if window is not None:
        in_window = key > pos - window
        if sink_tokens:
            in_window = in_window | (key < sink_end(sink_tokens, kv_first))
        conditions.append(in_window)
    if kv_len is not None:
        conditions.append(key < kv_len)
    return functools.reduce(lambda a, b: a & b, conditions)


def kernel_options(causal, window, sink_tokens, soft_cap, scale) -> dict:
    """A kernel's static options from a wrapper's arguments; sinks only count with a
    window (`jaxattn.attention`'s rule)."""
    sink_tokens = sink_tokens if window is not None else 0
    return dict(causal=causal, window=window, sink_tokens=sink_tokens, soft_cap=soft_cap,
                scale=scale)  # fmt: skip


def sequence_lengths(q_lengths, kv_lengths, batch: int, q_rows: int, kv_rows: int):
    """None when neither is given, else int32 `[2, B]`: each sequence's query and key
    counts (a missing one: all rows). Taken as given, as the reference and the Triton
    kernels take them (positions `r + kv_len - q_len`); counts past the arrays read
    nothing past them (the kernels' block ranges stop at Tq and Tk)."""
    if q_lengths is None and kv_lengths is None:
        return None

    def counts(lengths, rows):
        if lengths is None:
            return jnp.full((batch,), rows, jnp.int32)
        return jnp.asarray(lengths).astype(jnp.int32)

    return jnp.stack([counts(q_lengths, q_rows), counts(kv_lengths, kv_rows)])


def zero_padding(x, lengths):
    """x `[B, T, H, D]` with rows `t >= lengths[b]` zeroed (one XLA pass). The kernels'
    GEMMs multiply padding rows by zero weights, and 0 * NaN is NaN: padding must be
    finite before it reaches them."""
    rows = jnp.arange(x.shape[1], dtype=jnp.int32)
    return jnp.where((rows[None, :] < lengths[:, None])[:, :, None, None], x, 0)


class Sequence(NamedTuple):
    """One sequence's extent inside a kernel: `q_len` query rows and `kv_len` keys are
    real, query row r sits at position `r + offset`; `kv_limit` is kv_len (at most Tk)
    with lengths (keys at or past it are padding) and None without (no key mask). `kv_first`,
    `q_first` (packed batches): keys and query rows below them belong to the sequence
    before (`packed.py`)."""

    q_len: object
    kv_len: object
    offset: object
    kv_limit: object
    kv_first: object = None
    q_first: object = None


def sequence_of(lengths_ref, b, q_rows: int, kv_rows: int) -> Sequence:
    """Sequence `b`'s extent: scalars read from the lengths array (`sequence_lengths`'
    `[2, B]`), or the static row counts (Python ints) when `lengths_ref` is None. A
    length past Tk places the rows (offset) but masks no key below it: the keys stop at
    Tk (a last key block running past Tk reads zeros there, which are no keys)."""
    if lengths_ref is None:
        return Sequence(q_rows, kv_rows, kv_rows - q_rows, None)
    q_len, kv_len = lengths_ref[0, b], lengths_ref[1, b]
    return Sequence(q_len, kv_len, kv_len - q_len, imin(kv_len, kv_rows))


class Tile(NamedTuple):
    """Where a block's tile is. `batch`: the batch index into the arrays (0 for a packed
    batch, viewed as one sequence of all rows); `row`: the tile's first row (query rows,
    or keys in the dK/dV kernel) within its sequence; `q_base`, `k_base`: the array rows
    of the sequence's query row 0 and key 0 (0 in a dense batch; in a packed one,
    multiples of 8 with the rows before the sequence as padding: `packed.py`); `seq`:
    its extent; `store` (packed only, else None): where the tile's rows go
    (`packed.STORE`'s values)."""

    batch: object
    row: object
    q_base: object
    k_base: object
    seq: Sequence
    store: object = None


def dense_tile(lengths_ref, b, row, q_rows: int, kv_rows: int) -> Tile:
    """The tile of sequence `b` of a dense batch starting at row `row` of it."""
    return Tile(b, row, 0, 0, sequence_of(lengths_ref, b, q_rows, kv_rows))


def split_refs(refs, num_inputs: int, has_lengths: bool):
    """A kernel's refs as (inputs, lengths ref or None, the rest): the lengths array (or a
    packed batch's tile table), when there is one, comes right after the `num_inputs`
    inputs."""
    if not has_lengths:
        return refs[:num_inputs], None, refs[num_inputs:]
    return refs[:num_inputs], refs[num_inputs], refs[num_inputs + 1 :]


def ring_steps(blocks_of):
    """The producer's ring steps `(lo, hi)`: the union of consumers 0 and 1's ranges
    (`blocks_of(consumer)` returns a `(lo, hi, full_lo, full_hi)`)."""
    lo0, hi0, _, _ = blocks_of(0)
    lo1, hi1, _, _ = blocks_of(1)
    return union(lo0, hi0, lo1, hi1)


def union(lo0, hi0, lo1, hi1):
    """The producer's range of ring steps: both consumers' `[lo, hi)` (an empty one adds
    nothing)."""
    if _static(lo0, hi0, lo1, hi1):
        lo = lo0 if hi0 > lo0 else lo1
        lo = min(lo, lo1) if hi1 > lo1 else lo
        hi = max(hi0, hi1)
        return min(lo, hi), hi
    lo = jnp.where(hi0 > lo0, lo0, lo1)
    lo = jnp.where(hi1 > lo1, jnp.minimum(lo, lo1), lo)
    hi = imax(hi0, hi1)
    return imin(lo, hi), hi


def sink_end(sink_tokens: int, kv_first=None):
    """The first key past a sequence's sinks (its first `sink_tokens` keys)."""
    return sink_tokens if kv_first is None else kv_first + sink_tokens


class KeyRing(NamedTuple):
    """The key blocks a query tile's producer loads, as ring steps `[first, hi)`: steps
    `[lo, hi)` load block `step` (the union of the consumers' window ranges), and with
    attention sinks (`sinks`, static) below `lo` steps `[first, lo)` load the sink blocks
    `[0, lo - first)` first. Without sinks `first` is `lo` and a step is its block."""

    first: object
    lo: object
    hi: object
    sinks: bool = False

    def block(self, step):
        """The key block ring step `step` loads."""
        if not self.sinks:
            return step
        return jnp.where(step < self.lo, step - self.first, step)


def key_ring(blocks_of, *, window, sink_tokens: int, block_kv: int, kv_first=None) -> KeyRing:
    """The forward's and the dQ kernel's ring of key blocks: both consumers' ranges
    (`ring_steps`) and, with a window and sinks, the sink blocks below them."""
    lo, hi = ring_steps(blocks_of)
    if window is None or not sink_tokens:
        return KeyRing(lo, lo, hi)
    if kv_first is None:
        sink_blocks = -(-sink_tokens // block_kv)  # a Python int: no array constant
    else:
        sink_blocks = floor_div(kv_first + sink_tokens + block_kv - 1, block_kv)
    return KeyRing(lo - imin(sink_blocks, lo), lo, hi, sinks=True)


def consumer_steps(ring: KeyRing, bounds):
    """A key-streaming consumer's `(my_lo, my_hi, full_lo, full_hi)` in ring steps: its
    `block_range` bounds `within` the ring and, where the ring has sink steps, reaching
    down to them when it sees any key (a row that sees a key sees the sinks; the blocks
    between them and its own range are masked: correct, only slower)."""
    my_lo, my_hi, full_lo, full_hi = within(bounds, ring.first, ring.hi)
    if ring.sinks:
        my_lo = jnp.where(my_hi > my_lo, ring.first, my_lo)
    return my_lo, my_hi, full_lo, full_hi


def within(bounds, lo, hi):
    """A consumer's `(my_lo, my_hi, full_lo, full_hi)` clipped into the producer's ring
    steps `[lo, hi)`. A consumer passes over `lo..my_lo` and `my_hi..hi`, so its range
    must lie inside; a non-empty one does already, but an empty one may sit anywhere:
    with lengths a consumer holding only padding rows (`block_range`) or padding keys
    (`query_block_range`) gets (0, 0), below a `lo` the other consumer's causal or window
    bound raised, and would pass over steps never loaded (on the H100 the dK/dV kernel
    died so at q_len = kv_len = 300 in Tq = Tk = 512)."""
    my_lo, my_hi, full_lo, full_hi = bounds
    my_lo = clip(my_lo, lo, hi)
    my_hi = clip(my_hi, my_lo, hi)
    full_lo = clip(full_lo, my_lo, my_hi)
    return my_lo, my_hi, full_lo, clip(full_hi, full_lo, my_hi)


def produce(lo, hi, stages: int, load):
    """The producer's loop over ring steps `[lo, hi)`: the first `stages` without waiting,
    the rest each once its slot is consumed (`load(step, wait)` issues the copies)."""
    for i in range(stages):
        pl.when(lo + i < hi)(functools.partial(load, lo + i, False))

    @pl.loop(lo + stages, imax(hi, lo + stages))
    def _(step):
        load(step, True)
