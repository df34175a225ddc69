"""Group scales applied through stacked query rows, not per value (`PagedDecodeConfig.stacked`).

A cache quantized in groups of `g` channels stores a scale `s[t, i]` per token t and group
i. Applied per value, every code of a tile is multiplied by its group's scale before the
dots: `[block, D]` multiplies (and the scales spread over their channels) a step, which
held INT4 groups well below the bandwidth (left out, V's multiply alone cost groups of
8-32 a fifth to a quarter of the kernel's time; bench/HISTORY.md, 2026-11-26 15:15 UTC).

Stacked, the scales go where they are constant, at the price of larger dots:

- Logits: `sum_c q[r, c] s[t, i(c)] k[t, c] = sum_i s[t, i] (q_i . k)[r, t]`, with `q_i` the
  query masked to group i's channels. The n groups' masked copies of the query rows are
  stacked into one `[n * rows, Pd]` operand (built once), so one dot over the raw codes
  gives every group's partial logits `[n * rows, block]`; each is scaled by its group's
  `[block]` scales and the n are summed: `[n * rows, block]` multiplies instead of
  `[block, Pd]`.
- Output: `sum_t p[r, t] s[t, i(c)] v[t, c]`: the probabilities times each group's scales,
  stacked `[n * rows, block]`, make one dot with the raw codes, `[n * rows, W]`, whose
  row block i is exact for the channels of group i. The accumulator keeps all n blocks
  (rescaled as the softmax goes), and `unstack` picks each channel's own at the end.

Row block i of a stacked operand holds group i: stacked row `i * rows + r` is query row r.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.cache_read import CacheFormat, reads_v_words, scales_per_element
from pallas_kernels.common import softmax_init, softmax_step


def stacks(fmt: CacheFormat, head_dim: int) -> bool:
    """Whether this cache's group scales can be applied by stacked rows: groups finer than
    a part's row that tile it (a row's groups load as one vector: `cache_read.load_scales`),
    with V read as words (`cache_read.reads_v_words`), whose parts each span all the
    groups of their scales in order."""
    return (
        fmt.dtype is not None
        and fmt.granularity == "group"
        and fmt.group_size > 0
        and not fmt.factored(head_dim)
        and not scales_per_element(fmt, head_dim)
        and reads_v_words(fmt, head_dim)
    )


def groups(fmt: CacheFormat, head_dim: int) -> int:
    """n: groups a part's row holds (K's parts, and the scales of each V word part)."""
    return head_dim // fmt.parts // fmt.group_size


def word_scales(fmt: CacheFormat, v_scales) -> tuple:
    """The `[block, n]` scales of V's four word parts (`cache_read.word_columns`) from
    what `load_scales` gave: INT4's halves (low nibbles: parts 0, 1; high: 2, 3), or the
    one array of 8-bit codes for all four."""
    if fmt.dtype == "int4":
        low, high = v_scales
        return (low, low, high, high)
    (scales,) = v_scales
    return (scales,) * 4


def tile_rows(x, n: int):
    """`[rows, ...]` -> `[n * rows, ...]`: n copies of x, one per row block."""
    return jnp.broadcast_to(x[None], (n, *x.shape)).reshape(n * x.shape[0], *x.shape[1:])


def stack_queries(q, group_size: int, n: int):
    """Query rows `[rows, Pd]` (a part of `n` groups of `group_size` channels; columns past
    them are zeros) -> `[n * rows, Pd]`: row block i keeps group i's channels, zeros
    elsewhere."""
    rows, width = q.shape
    block = jnp.arange(n * rows)[:, None] // rows
    group = jnp.arange(width)[None, :] // group_size
    return jnp.where(block == group, tile_rows(q, n), jnp.zeros((), q.dtype))


def fold_logits(partial, scales):
    """Partial logits `[n * rows, block]` (row block i: group i's channels of the stacked
    dot) and the groups' scales `[block, n]` -> the logits `[rows, block]`."""
    block, n = scales.shape
    partial = partial.reshape(n, partial.shape[0] // n, block)
    return jnp.sum(partial * scales.T.astype(jnp.float32)[:, None, :], axis=0)


def stack_probs(p, scales):
    """Probabilities `[rows, block]` and the groups' scales `[block, n]` -> `[n * rows,
    block]`: row block i is p times group i's scales."""
    rows, block = p.shape
    n = scales.shape[1]
    stacked = p[None] * scales.T.astype(jnp.float32)[:, None, :]
    return stacked.reshape(n * rows, block)


def init(rows: int, shapes):
    """The softmax state (`common.softmax_init`) with stacked accumulators: `shapes` gives
    each part's (n, W), its accumulator `[n * rows, W]`."""
    _, m, l = softmax_init(rows, ())
    return tuple(jnp.zeros((n * rows, w), jnp.float32) for n, w in shapes), m, l


def update(carry, s, load_v, v_scales, precision=None):
    """`common.softmax_update` with stacked accumulators: s `[rows, block]` base-2 logits;
    `load_v()` gives V's parts `[block, W]` as raw values (unscaled); `v_scales` one
    `[block, n]` per part (parts may share one array: its stacked probabilities are
    built once)."""
    acc, m, l = carry
    m_new, alpha, p, l = softmax_step(m, l, s)
    v = load_v()
    probs = {}
    out = []
    for a, vp, scales in zip(acc, v, v_scales, strict=True):
        if id(scales) not in probs:
            probs[id(scales)] = stack_probs(p, scales).astype(vp.dtype)
        pv = jnp.dot(probs[id(scales)], vp, precision=precision,
                     preferred_element_type=jnp.float32)  # fmt: skip
        out.append(a * tile_rows(alpha, scales.shape[1])[:, None] + pv)
    return tuple(out), m_new, l


def unstack(acc, n: int):
    """A stacked accumulator `[n * rows, W]` whose columns run over the n groups in order
    (W / n columns a group) -> `[rows, W]`: each column from its group's row block."""
    stacked, width = acc.shape
    acc = acc.reshape(n, stacked // n, width)
    group = jnp.arange(width) // (width // n)
    own = jnp.arange(n)[:, None, None] == group[None, None, :]
    return jnp.sum(jnp.where(own, acc, 0.0), axis=0)
