"""The Hopper (Mosaic GPU) forward: which calls it takes, and what it computes.

Mosaic GPU kernels do not run in CPU interpret mode. On CPU this file tests the selection
logic (`forward_backend` against a stand-in sm90 device), the key-block ranges the kernel
skips by (against brute-force visibility), and that the kernel traces and lowers for CUDA
for each option set. On a GPU of compute capability 9.x it runs the kernel against the
float64 oracle over the option combinations, and the gradient of `jaxattn.attention`
through it (its residuals feed the flash backward kernels).
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import util
from oracle import attention_oracle

import jaxattn
from jaxattn.attention import _Static, forward_backend
from pallas_kernels.mosaic import (
    MosaicForwardConfig,
    forward_unsupported,
    mosaic_forward,
    select_forward,
)
from pallas_kernels.mosaic.common import SMS, Launch, consumer_steps, key_ring
from pallas_kernels.mosaic.config import LONG_FULL_KEYS
from pallas_kernels.mosaic.forward import (
    TILE_COST_STEPS,
    block_range,
    causal_tile_cost,
    causal_walks,
    key_blocks,
    persistent_blocks,
)

ON_HOPPER = util.ON_GPU and str(getattr(jax.devices()[0], "compute_capability", "")).startswith(
    "9."
)
hopper_only = pytest.mark.skipif(not ON_HOPPER, reason="Mosaic GPU kernels need an sm90 GPU")


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    """Stands in for a jax device in the selection logic."""

    platform: str = "gpu"
    compute_capability: str = "9.0"


HOPPER, AMPERE, CPU = FakeDevice(), FakeDevice(compute_capability="8.0"), FakeDevice("cpu")


def _static(**kw) -> _Static:
    opts = dict(packed=False, causal=True, window=None, sink_tokens=0, soft_cap=None,
                scale=0.1, return_lse=False, rel_max_distance=0,
                rel_bidirectional=False)  # fmt: skip
    return _Static(**{**opts, **kw})


def _backend(static=None, config=None, q_shape=(2, 512, 8, 128), k_shape=(2, 512, 2, 128),
             dtype=jnp.bfloat16, extras=(None,) * 4, device=HOPPER):  # fmt: skip
    q = jax.ShapeDtypeStruct(q_shape, dtype)
    k = jax.ShapeDtypeStruct(k_shape, dtype)
    return forward_backend(static or _static(), config, q, k, extras, device)[0]


# ------------------------------------------------------------------ selection (CPU)


def test_auto_takes_mosaic_on_hopper_only():
    assert _backend() == "mosaic"
    assert _backend(config=jaxattn.FlashPrefillConfig()) == "mosaic"
    assert _backend(device=AMPERE) == "triton"
    assert _backend(device=CPU) == "triton"
    assert _backend(config=jaxattn.FlashPrefillConfig(backend="triton")) == "triton"


@pytest.mark.parametrize(
    "change, reason",
    [
        (dict(static=_static(packed=True)), "packed"),
        (dict(extras=(jnp.ones(8), None, None, None)), "ALiBi"),
        (dict(static=_static(out_fp8=True)), "FP8"),
        (dict(dtype=jnp.float32), "float32"),
        (dict(q_shape=(2, 512, 8, 96), k_shape=(2, 512, 2, 96)), "head_dim 96"),
        (dict(q_shape=(2, 500, 8, 128)), "Tq=500"),
        (dict(k_shape=(2, 520, 2, 128)), "Tk=520"),
    ],
)
@pytest.mark.every_case
def test_uncovered_calls_fall_back_or_raise(change, reason):
    assert _backend(**change) == "triton"
    forced = jaxattn.FlashPrefillConfig(backend="mosaic")
    with pytest.raises(NotImplementedError, match=reason):
        _backend(config=forced, **change)


def test_covered_options():
    covered = (_static(causal=False), _static(window=100), _static(soft_cap=30.0),
               _static(window=100, sink_tokens=4))  # fmt: skip
    for static in covered:
        assert _backend(static) == "mosaic"
    for d in (64, 256):
        assert _backend(q_shape=(1, 256, 4, d), k_shape=(1, 1024, 4, d)) == "mosaic"
    assert _backend(dtype=jnp.float16) == "mosaic"


def test_ring_blocks_select_like_attention():
    """Ring attention's per-block calls (no lengths or terms) go through the same choice."""
    shape = (1, 1024, 8, 128)
    assert select_forward(None, shape, shape, jnp.bfloat16, device=HOPPER) == (
        MosaicForwardConfig.heuristic(128)
    )
    assert select_forward(None, shape, shape, jnp.float32, device=HOPPER) is None
    assert select_forward(None, shape, shape, jnp.bfloat16, device=AMPERE) is None


def test_long_full_attention_takes_192_key_steps():
    """Full attention (no causal mask, window or packing) over LONG_FULL_KEYS keys or more
    up to D128 takes persistent 192-key steps; every other call the default tiling."""
    long_full = MosaicForwardConfig(64, 192, 2, persistent=True)
    default = MosaicForwardConfig.heuristic(128)
    assert default.block_kv == 128 and default.persistent
    for d in (64, 128):
        assert MosaicForwardConfig.heuristic(d, kv_rows=LONG_FULL_KEYS, full=True) == long_full
        short = MosaicForwardConfig.heuristic(d, kv_rows=LONG_FULL_KEYS - 64, full=True)
        assert short == MosaicForwardConfig.heuristic(d) == default
        assert MosaicForwardConfig.heuristic(d, kv_rows=LONG_FULL_KEYS) == default
    d256 = MosaicForwardConfig.heuristic(256, kv_rows=LONG_FULL_KEYS, full=True)
    assert d256 == MosaicForwardConfig.heuristic(256) and d256.block_kv == 64

    def tiling(**kw):
        q = jax.ShapeDtypeStruct((1, 1024, 8, 128), jnp.bfloat16)
        k = jax.ShapeDtypeStruct((1, LONG_FULL_KEYS, 2, 128), jnp.bfloat16)
        return forward_backend(_static(**kw), None, q, k, (None,) * 4, HOPPER)[1]

    assert tiling(causal=False) == long_full
    assert tiling(causal=True) == default
    assert tiling(causal=False, window=4096) == default
    ring_shape = (1, 1024, 8, 128)
    assert select_forward(None, ring_shape, (1, LONG_FULL_KEYS, 8, 128), jnp.bfloat16,
                          device=HOPPER, full=True) == long_full  # fmt: skip


def test_forced_mosaic_names_the_device():
    forced = jaxattn.FlashPrefillConfig(backend="mosaic")
    with pytest.raises(NotImplementedError, match="compute capability 9"):
        _backend(config=forced, device=AMPERE)


def test_forced_mosaic_off_hopper_falls_through_an_implementation_list():
    if ON_HOPPER:
        pytest.skip("this device runs the kernel")
    rng = util.rng_for("fallthrough")
    q, k, v = (util.randn(rng, (1, 128, 2, 64)) for _ in range(3))
    forced = jaxattn.FlashPrefillConfig(backend="mosaic")
    with pytest.raises(NotImplementedError, match="Mosaic GPU kernels run compiled only"):
        jaxattn.attention(q, k, v, implementation="pallas", config=forced)
    out = jaxattn.attention(q, k, v, implementation=["pallas", "xla"], config=forced)
    want, _ = attention_oracle(*(util.f64(x) for x in (q, k, v)))
    np.testing.assert_allclose(util.f64(out), want, atol=1e-5, rtol=1e-5)


def test_o_staging():
    """Where a block stages O: Q's buffer for a block per tile; persistent, tiles of its
    own where they fit, else the short last step's spare slot rows, else Q's buffer."""
    from pallas_kernels.mosaic.forward import K_SLOT, V_SLOT, OStaging, o_staging

    def staging(block_kv, d, tail, persistent=True, stages=2):
        config = MosaicForwardConfig(64, block_kv, stages, persistent=persistent)
        return o_staging(config, d, 2, persistent=persistent, tail_keys=tail)

    assert staging(192, 128, 64, persistent=False) == OStaging()
    assert staging(128, 128, 64) == staging(192, 64, 64) == OStaging(tiles=True)
    assert staging(192, 128, 64) == OStaging(spare=((K_SLOT, 64), (K_SLOT, 128)))
    assert staging(192, 128, 128) == OStaging(spare=((K_SLOT, 128), (V_SLOT, 128)))
    assert staging(128, 128, 64, stages=3) == OStaging(spare=((K_SLOT, 64), (V_SLOT, 64)))
    assert staging(192, 128, 0) == staging(64, 256, 0) == OStaging()  # Q's buffer
    # The kernel's short step: full attention over a dense batch only.
    from pallas_kernels.mosaic.forward import short_tail_keys

    full = dict(causal=False, window=None, ragged=False)
    assert short_tail_keys(4096, 192, **full) == 64
    assert short_tail_keys(2624, 192, **full) == 128 and short_tail_keys(2304, 192, **full) == 0
    for other in (dict(causal=True), dict(window=100), dict(ragged=True)):
        assert short_tail_keys(4096, 192, **{**full, **other}) == 0


def test_config_validation():
    with pytest.raises(ValueError, match="backend"):
        jaxattn.FlashPrefillConfig(backend="cuda")
    for bad in (dict(block_q=128), dict(block_kv=96), dict(num_stages=1), dict(num_stages=5)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            MosaicForwardConfig(**bad)
    assert MosaicForwardConfig(block_kv=192).fits(128)
    assert MosaicForwardConfig.heuristic(128).persistent and MosaicForwardConfig.heuristic(
        128
    ).fits(128)
    assert not MosaicForwardConfig.heuristic(256).persistent
    assert MosaicForwardConfig.heuristic(256).fits(256)
    # Persistent 192-key steps fit by sending O through Q's buffer (no O tiles of their own).
    wide = MosaicForwardConfig(64, 192, 2, persistent=True)
    assert wide.fits(128) and not wide.out_tiles(128) and wide.out_tiles(64)
    assert wide.smem_bytes(128) == MosaicForwardConfig(64, 192, 2).smem_bytes(128)
    assert MosaicForwardConfig.heuristic(128).out_tiles(128)
    huge = MosaicForwardConfig(block_kv=128, num_stages=4)
    assert "shared memory" in forward_unsupported(
        (1, 1024, 8, 256), (1, 1024, 8, 256), jnp.bfloat16, packed=False,
        terms=False, out_fp8=False, config=huge,
    )  # fmt: skip


# ------------------------------------------------------------------ skipped blocks (CPU)


def assert_range_matches(bounds, any_seen, all_seen, where: str):
    """A kernel's (lo, hi, full_lo, full_hi) block range against brute force: `any_seen`
    the indices of the blocks with some visible pair, `all_seen` per block whether every
    pair is visible. No fully visible block is left to the masked path outside
    [full_lo, full_hi) except at the range's ends (masking there is correct, only slower)."""
    lo, hi, full_lo, full_hi = bounds
    if any_seen.size:
        assert (lo, hi) == (any_seen[0], any_seen[-1] + 1), where
    else:
        assert lo == hi, where
    assert lo <= full_lo <= full_hi <= hi, where
    assert all_seen[full_lo:full_hi].all(), where
    inner = np.flatnonzero(all_seen)
    if inner.size:
        assert full_lo <= inner[0] and full_hi >= inner[-1] + 1, where


@pytest.mark.parametrize(
    "causal, window", [(True, None), (False, 37), (True, 37), (True, 300), (False, None)]
)
@pytest.mark.parametrize("kv_len, kv_first", [(None, None), (100, None), (150, None),
                                               (100, 5), (150, 7), (3, 5)])  # fmt: skip
def test_block_range_matches_visibility(causal, window, kv_len, kv_first):
    """Every block holding a visible key is in [lo, hi); blocks in [full_lo, full_hi) are
    fully visible to every row; [lo, hi) is the tightest range. With lengths keys at or
    past kv_len are padding, and a consumer may hold no real row (last < first); in a
    packed batch keys below kv_first are too (the sequence before's)."""
    if kv_len is None and not causal and window is None:
        pytest.skip("no mask: every block, nothing to check")
    block, num_blocks = 16, 12
    keys = np.arange(block * num_blocks)
    for first in range(-40, block * num_blocks + 8, 5):
        for rows in (1, 16, 64) if kv_len is None else (0, 1, 16, 64):
            pos = np.arange(first, first + rows)[:, None]
            visible = np.ones((rows, keys.size), bool)
            if causal:
                visible &= keys[None, :] <= pos
            if window is not None:
                visible &= keys[None, :] > pos - window
            if kv_len is not None:
                visible &= keys[None, :] < kv_len
            if kv_first is not None:
                visible &= keys[None, :] >= kv_first
            per_block = visible.reshape(rows, num_blocks, block)
            any_seen = np.flatnonzero(per_block.any(axis=(0, 2)))
            all_seen = per_block.all(axis=(0, 2)) & (rows > 0)
            lo, hi, full_lo, full_hi = (
                int(x)
                for x in block_range(
                    jnp.int32(first),
                    jnp.int32(first + rows - 1),
                    causal=causal,
                    window=window,
                    num_blocks=num_blocks,
                    block_kv=block,
                    kv_len=None if kv_len is None else jnp.int32(kv_len),
                    kv_first=None if kv_first is None else jnp.int32(kv_first),
                )  # fmt: skip
            )
            where = f"rows {first}..{first + rows - 1}"
            assert_range_matches((lo, hi, full_lo, full_hi), any_seen, all_seen, where)


def _visible(pos, keys, *, causal, window, sink_tokens=0, kv_len=None, kv_first=None):
    """Brute-force visibility of keys `[1, K]` to positions `[R, 1]` (`jaxattn.reference`'s
    rule; sinks: the sequence's first `sink_tokens` keys, from `kv_first` in a packed one)."""
    first = 0 if kv_first is None else kv_first
    seen = np.broadcast_to(keys >= first, (pos.shape[0], keys.shape[1])).copy()
    if causal:
        seen &= keys <= pos
    if window is not None:
        seen &= (keys > pos - window) | (keys < first + sink_tokens)
    if kv_len is not None:
        seen &= keys < kv_len
    return seen


@pytest.mark.parametrize(
    "causal, window", [(True, 37), (False, 37), (True, 100), (True, 16), (True, 1)]
)
@pytest.mark.parametrize("sink_tokens", [5, 40])  # within one block, over three
@pytest.mark.parametrize(  # (7, 7): a packed sequence with no keys (the padding's)
    "kv_len, kv_first", [(None, None), (150, None), (150, 5), (190, 7), (7, 7)]
)
def test_key_ring_covers_sinks(causal, window, sink_tokens, kv_len, kv_first):
    """The forward's and the dQ kernel's walk with sinks (`key_ring`, `consumer_steps`):
    for each consumer of a two-consumer tile, the ring steps it computes load distinct
    blocks, every block holding a key one of its rows sees among them; the unmasked steps
    load blocks every row sees in full; the producer's steps load distinct blocks. Rows
    are given by position (`tile_first` from -40: rows before the keys, as with Tq > Tk,
    see none under causal)."""
    block, num_blocks, rows = 16, 12, 16
    keys = np.arange(block * num_blocks)[None, :]
    with_sinks = 0
    kv_end = block * num_blocks if kv_len is None else kv_len
    for tile_first in range(-40, block * num_blocks + 8, 7):
        # Real rows sit before the keys' end (positions bottom-right aligned); without
        # lengths every row of a tile is real.
        if kv_len is None and tile_first + 2 * rows > kv_end:
            continue
        q_lens = (kv_end,) if kv_len is None else (kv_end, min(tile_first + 20, kv_end))
        for q_len in q_lens:

            def blocks_of(c, q_len=q_len, tile_first=tile_first):
                return key_blocks(
                    jnp.int32(tile_first + c * rows), rows,
                    q_len=jnp.int32(q_len), offset=0,
                    kv_len=None if kv_len is None else jnp.int32(kv_len),
                    kv_first=None if kv_first is None else jnp.int32(kv_first),
                    causal=causal, window=window, num_blocks=num_blocks, block_kv=block,
                )  # fmt: skip

            ring = key_ring(blocks_of, window=window, sink_tokens=sink_tokens, block_kv=block,
                            kv_first=None if kv_first is None else jnp.int32(kv_first))  # fmt: skip
            first, lo, hi = (int(x) for x in ring[:3])
            with_sinks += first < lo
            loaded = [int(ring.block(jnp.int32(s))) for s in range(first, hi)]
            assert len(set(loaded)) == len(loaded), loaded
            assert all(0 <= j < num_blocks for j in loaded), loaded
            no_keys = kv_len is not None and kv_len == kv_first  # nothing to load or compute
            assert not (no_keys and loaded), (tile_first, q_len, loaded)
            for c in range(2):
                pos = np.arange(tile_first + c * rows, tile_first + (c + 1) * rows)
                pos = pos[pos < q_len]
                seen = _visible(pos[:, None], keys, causal=causal, window=window,
                                sink_tokens=sink_tokens, kv_len=kv_len,
                                kv_first=kv_first)  # fmt: skip
                per_block = seen.reshape(pos.size, num_blocks, block)
                needed = set(np.flatnonzero(per_block.any(axis=(0, 2))).tolist())
                full = per_block.all(axis=(0, 2)) & (pos.size > 0)
                my_lo, my_hi, full_lo, full_hi = (
                    int(x) for x in consumer_steps(ring, blocks_of(c))
                )
                where = f"tile {tile_first} q_len {q_len} consumer {c}"
                assert first <= my_lo <= full_lo <= full_hi <= my_hi <= hi, where
                assert not (no_keys and my_hi > my_lo), where
                computed = [int(ring.block(jnp.int32(s))) for s in range(my_lo, my_hi)]
                assert needed <= set(computed), (where, needed - set(computed))
                unmasked = [int(ring.block(jnp.int32(s))) for s in range(full_lo, full_hi)]
                assert all(full[j] for j in unmasked), (where, unmasked)
    assert with_sinks or kv_len == kv_first, "no tile took the sink steps: the test is vacuous"


@pytest.mark.parametrize(  # (heads, tiles, batch, group)
    "shape", [(32, 32, 1, 4), (8, 32, 1, 1), (32, 16, 8, 4), (32, 128, 1, 4), (12, 3, 5, 3),
              (6, 1, 1, 6), (4, 2, 3, 1)],
)  # fmt: skip
def test_launch_order(shape):
    """Every (tile, head, batch) block exactly once; in launch order (row-major over the
    grid) each section's tiles run heaviest (0) first and its pairs are whole kv groups;
    a section fills two waves, with as few pairs as that takes."""
    heads, tiles, batch, group = shape
    launch = Launch(heads, tiles, batch, group)
    grid = launch.grid()["grid"]
    order = [launch.unravel(*ix) for ix in np.ndindex(*grid)]  # the launch order
    assert sorted(order) == sorted(np.ndindex(tiles, heads, batch))
    section = launch.section
    assert batch * heads % section == 0 and section % group == 0
    for first in range(0, len(order), tiles * section):
        blocks = order[first : first + tiles * section]
        assert [t for t, _, _ in blocks] == sorted(t for t, _, _ in blocks)
        pairs = {(b, h) for _, h, b in blocks}
        kv_groups = {(b, h // group) for b, h in pairs}
        assert len(pairs) == section == group * len(kv_groups)
    smaller = [n for n in range(group, section, group) if batch * heads % n == 0]
    assert all(n * tiles < 2 * SMS for n in smaller)
    assert section * tiles >= 2 * SMS or section == batch * heads
    # A persistent kernel's blocks walk the same order by its index.
    walked = launch.item(jnp.arange(launch.items, dtype=jnp.int32))
    assert list(zip(*(np.asarray(x).tolist() for x in walked), strict=True)) == order


def test_persistent_blocks():
    """One block per SM for a persistent config over walkable tiles (alike, or
    `causal_walks`) of more than one wave; else a block per tile."""
    config, plain = MosaicForwardConfig.heuristic(128), MosaicForwardConfig()
    many, few = Launch(32, 32, 1, 4), Launch(4, 8, 2, 2)  # 1024 and 64 tiles
    assert persistent_blocks(config, many, True, sms=132) == 132
    assert persistent_blocks(config, many, True, sms=114) == 114
    assert persistent_blocks(config, many, False, sms=132) == 0  # lengths, windows, ...
    assert persistent_blocks(plain, many, True, sms=132) == 0
    assert persistent_blocks(config, few, True, sms=132) == 0  # one wave
    assert persistent_blocks(config, many, True, sms=0) == 0  # count unknown


def test_causal_walks():
    """Causal tiles are walked over a dense batch without a window where every row sees
    a key (Tq <= Tk); lengths, packing, windows and full attention are not `causal_walks`
    (full attention's tiles are alike: walked by stride)."""
    assert causal_walks(True, None, False, 4096, 4096)
    assert causal_walks(True, None, False, 2048, 4160)
    assert not causal_walks(True, None, False, 4160, 4096)  # top rows see no key
    assert not causal_walks(True, 512, False, 4096, 4096)
    assert not causal_walks(True, None, True, 4096, 4096)
    assert not causal_walks(False, None, False, 4096, 4096)


@pytest.mark.parametrize("block_kv", [64, 128, 192])
@pytest.mark.parametrize("tq, tk", [(1024, 1024), (640, 2048), (1280, 1344), (768, 832)])
def test_causal_walk_steps(tq, tk, block_kv):
    """Under `causal_walks` every consumer of every tile computes a step and passes over
    none before its first (`my_lo == ring.first < my_hi`: the kernel's hand-over and
    next-Q load rely on it), and `causal_tile_cost` is the tile's ring (the kernel's
    `key_ring` over both consumers) plus TILE_COST_STEPS; against brute force too."""
    assert causal_walks(True, None, False, tq, tk)
    config = MosaicForwardConfig(64, block_kv, 2, persistent=True)
    num_blocks = -(-tk // block_kv)
    tiles = tq // config.rows
    for t in range(tiles):
        row = (tiles - 1 - t) * config.rows  # heaviest first, as `block_tile` numbers them

        def blocks_of(consumer, row=row):
            return key_blocks(row + 64 * consumer, 64, q_len=tq, offset=tk - tq, kv_len=None,
                              causal=True, window=None, num_blocks=num_blocks,
                              block_kv=block_kv)  # fmt: skip

        ring = key_ring(blocks_of, window=None, sink_tokens=0, block_kv=block_kv)
        for consumer in (0, 1):
            my_lo, my_hi, _, _ = consumer_steps(ring, blocks_of(consumer))
            assert my_lo == ring.first < my_hi <= ring.hi
        last = row + config.rows - 1 + tk - tq  # the tile's last position sees keys <= it
        assert ring.hi - ring.first == -(-(last + 1) // block_kv)
        cost = causal_tile_cost(t, config=config, q_rows=tq, kv_rows=tk)
        assert cost == ring.hi - ring.first + TILE_COST_STEPS


@pytest.mark.parametrize("shape", [(4096, 4096, 1), (2048, 2048, 8), (2560, 2624, 1),
                                   (640, 2048, 3), (16384, 16384, 1)])  # fmt: skip
def test_causal_walk_table(shape):
    """`Launch.walk` over causal tiles: every tile of the launch order exactly once, each
    block's in launch order, and as even as list scheduling makes it (no block busier
    than the least busy by more than one tile's cost); `Launch.item` of a Python int (the
    walk's) is the kernel's."""
    tq, tk, batch = shape
    config = MosaicForwardConfig.heuristic(128)
    launch = Launch(32, tq // config.rows, batch, 4)
    costs = [causal_tile_cost(t, config=config, q_rows=tq, kv_rows=tk) for t in range(launch.tiles)]
    tiles, _, _ = launch.item(jnp.arange(launch.items, dtype=jnp.int32))
    assert [launch.item(i)[0] for i in range(launch.items)] == np.asarray(tiles).tolist()
    table = launch.walk(132, costs.__getitem__)
    counts = table[:, 0]
    walks = [list(table[p, 1 : 1 + n]) for p, n in enumerate(counts)]
    assert sorted(i for w in walks for i in w) == list(range(launch.items))
    assert all(w == sorted(w) for w in walks)
    busy = [sum(costs[launch.item(int(i))[0]] for i in w) for w in walks]
    assert max(busy) - min(busy) <= max(costs)


PERSISTENT_LOWERED = [  # (Tk, D, block_kv, stages): where O is staged
    (4160, 128, 128, 2),  # its own tiles; a short last step of 64 keys
    (4096, 128, 192, 2),  # the last block's K slot rows 64..191 (both consumers)
    (4160, 128, 192, 2),  # the last block's K and V slot rows 128..191
    (4032, 128, 192, 2),  # Q's buffer (Tk a multiple of 192: no spare rows)
    (4096, 64, 192, 2),  # its own tiles
    (4160, 128, 128, 3),  # K and V slot rows 64..127 of a 3-slot ring
    (4096, 256, 64, 2),  # Q's buffer
    (4096, 128, 128, 2, True),  # causal: blocks walk a table
    (4160, 128, 128, 2, True),  # causal, consumer 0 passing over each tile's last step
    (4096, 128, 192, 2, True),  # causal, 192-key steps: O through Q's buffer
    (4096, 64, 64, 3, True),
]


@pytest.mark.parametrize("case", PERSISTENT_LOWERED, ids=lambda c: "-".join(map(str, c)))
def test_persistent_kernel_lowers_for_cuda(monkeypatch, case):
    """The persistent form traces and lowers for CUDA (its block count taken), O staged
    in each of its places; causal, with its walks table an input."""
    from pallas_kernels.mosaic import forward

    tk, d, block_kv, stages, *causal = case
    causal = bool(causal)
    calls = []

    def blocks(config, launch, walkable, sms=None):
        calls.append(persistent_blocks(config, launch, walkable, sms=132))
        return calls[-1]

    monkeypatch.setattr(forward, "persistent_blocks", blocks)
    q = jax.ShapeDtypeStruct((1, 4096, 8, d), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, tk, 2, d), jnp.bfloat16)
    config = MosaicForwardConfig(64, block_kv, stages, persistent=True)
    fn = functools.partial(mosaic_forward, causal=causal, scale=0.1, config=config)
    text = jax.jit(fn).trace(q, k, k).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text and calls == [132]
    # The walks table, an int32 [132, 1 + n] input of the kernel, for causal calls only.
    assert bool(re.search(r"tensor<132x\d+xi32>", text)) == causal


LOWERED = [  # (D, causal, window, soft_cap, Tq, Tk, Hq, Hkv, dtype)
    (128, True, None, None, 256, 256, 4, 2, jnp.bfloat16),
    (128, False, None, None, 128, 512, 4, 4, jnp.float16),
    (64, True, 100, None, 256, 384, 4, 1, jnp.bfloat16),
    (256, False, None, 30.0, 128, 256, 2, 1, jnp.bfloat16),
]


@pytest.mark.parametrize("case", LOWERED, ids=lambda c: f"D{c[0]}-causal{c[1]}-w{c[2]}-cap{c[3]}")
def test_kernel_lowers_for_cuda(case):
    """Traces and lowers (no GPU needed): catches API misuse before a device run."""
    d, causal, window, cap, tq, tk, hq, hkv, dtype = case
    q = jax.ShapeDtypeStruct((1, tq, hq, d), dtype)
    k = jax.ShapeDtypeStruct((1, tk, hkv, d), dtype)
    fn = functools.partial(mosaic_forward, causal=causal, window=window, soft_cap=cap, scale=0.1)
    text = jax.jit(fn).trace(q, k, k).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


# ------------------------------------------------------------------ the kernel (sm90 GPU)

KERNEL_CASES = [  # (B, Tq, Tk, Hq, Hkv, D, causal, window, soft_cap)
    (2, 256, 256, 4, 4, 128, False, None, None),
    (2, 512, 512, 8, 2, 128, True, None, None),
    (1, 256, 768, 4, 1, 128, True, None, None),  # bottom-right, MQA
    (1, 512, 256, 4, 2, 128, True, None, None),  # Tq > Tk: rows with no key
    (1, 512, 512, 4, 2, 64, True, None, None),
    (1, 512, 512, 4, 2, 256, True, None, None),
    (1, 256, 512, 4, 2, 256, False, None, 20.0),
    (1, 512, 1024, 4, 2, 128, False, 200, None),
    (1, 1024, 1024, 4, 2, 128, True, 300, 30.0),
    (1, 1024, 1024, 4, 2, 64, True, 64, None),
    (1, 512, 192, 4, 2, 256, True, None, None),  # warpgroup 0 sees no key, 1 does
    (1, 512, 256, 4, 2, 128, False, 64, None),  # window, Tq > Tk, not causal
    (1, 256, 256, 4, 2, 128, True, 1, None),  # window 1: each row its own key
    (1, 256, 320, 4, 2, 128, False, None, None),  # Tk past the last full block: short step
    (1, 256, 320, 4, 2, 128, False, 200, None),  # the same with a window: masked
    (1, 256, 448, 4, 2, 64, True, None, 20.0),
    (2, 256, 320, 4, 2, 128, True, None, None),
]
LOWP = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


@hopper_only
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("case", KERNEL_CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.every_case
def test_kernel_matches_oracle(case, dtype):
    b, tq, tk, hq, hkv, d, causal, window, cap = case
    rng = util.rng_for("mosaic", case, dtype)
    q = util.randn(rng, (b, tq, hq, d), dtype)
    k, v = (util.randn(rng, (b, tk, hkv, d), dtype) for _ in range(2))
    opts = dict(causal=causal, window=window, soft_cap=cap, scale=d**-0.5)
    out, lse = jax.jit(functools.partial(mosaic_forward, **opts))(q, k, v)
    args = [util.f64(x) for x in (q, k, v)]
    want, want_lse = attention_oracle(*args, **opts)
    lowp_ref, _ = attention_oracle(*args, **opts, lowp=LOWP[dtype])
    util.assert_out_close(out, want, dtype, lowp_ref=lowp_ref)
    util.assert_lse_close(lse, want_lse, dtype)
    util.assert_zero_rows(out, np.isneginf(want_lse).transpose(0, 2, 1)[..., None], "keyless rows")


TILINGS = [MosaicForwardConfig(64, 64, n) for n in (2, 3, 4)] + [
    MosaicForwardConfig(64, 128, 3),
    MosaicForwardConfig(64, 192, 2),  # 512 keys: two blocks of 192 and one of 128
]


@hopper_only
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("config", TILINGS, ids=str)
@pytest.mark.every_case
def test_kernel_tilings(config, causal):
    rng = util.rng_for("mosaic tilings", config, causal)
    q = util.randn(rng, (1, 512, 4, 128), "bfloat16")
    k, v = (util.randn(rng, (1, 512, 2, 128), "bfloat16") for _ in range(2))
    out, lse = mosaic_forward(q, k, v, causal=causal, scale=0.1, config=config)
    args = [util.f64(x) for x in (q, k, v)]
    want, want_lse = attention_oracle(*args, causal=causal, scale=0.1)
    lowp_ref, _ = attention_oracle(*args, causal=causal, scale=0.1, lowp=ml_dtypes.bfloat16)
    util.assert_out_close(out, want, "bfloat16", lowp_ref=lowp_ref)
    util.assert_lse_close(lse, want_lse, "bfloat16")


PERSISTENT_CASES = [  # (B, Tq, Tk, Hq, Hkv, D, soft_cap, (block_kv, stages)): > 1 wave
    (1, 2560, 2560, 8, 2, 128, None, (128, 2)),  # 160 tiles
    (2, 1024, 1536, 16, 4, 64, 30.0, (128, 2)),  # 256 tiles over two sequences
    (1, 4096, 4160, 9, 3, 128, None, (128, 2)),  # 2 or 3 tiles a block; last block 64 keys
    (1, 2560, 2624, 8, 2, 64, None, (128, 3)),  # 21 steps a tile: slots of 3 across tiles
    (2, 2048, 2048, 8, 4, 64, None, (64, 4)),
    # Where O tiles do not fit (`o_staging`): O in the last block's spare rows, else
    # through Q's buffer. 192-key steps at D128:
    (1, 2560, 2624, 8, 2, 128, None, (192, 2)),  # 13 x 192 + 128: K and V rows 128..191
    (1, 2560, 2560, 8, 2, 128, 30.0, (192, 2)),  # 13 x 192 + 64: K rows 64..191
    (1, 2560, 2304, 8, 2, 128, None, (192, 2)),  # 12 x 192, no short step: Q's buffer
    (2, 1024, 2624, 16, 4, 128, None, (192, 2), "float16"),
    (1, 2560, 128, 8, 2, 128, None, (192, 2)),  # one block, its short step the only step
    (1, 2560, 2624, 8, 2, 128, None, (128, 3)),  # 3 slots: K and V rows 64..127
    (1, 2560, 2560, 8, 2, 128, None, (128, 3)),  # 3 slots, no short step: Q's buffer
    (1, 2560, 2560, 8, 2, 256, None, (64, 2)),  # D256: Q's buffer
    (2, 1024, 2560, 16, 4, 64, None, (192, 2)),  # D64: O tiles of its own
]


PERSISTENT_CAUSAL_CASES = [  # as PERSISTENT_CASES, causal: blocks walk `Launch.walk`'s table
    (1, 2560, 2560, 8, 2, 128, None, (128, 2)),
    (1, 4096, 4160, 9, 3, 128, None, (128, 2)),  # consumer 0 passes over each tile's last step
    (2, 1024, 1536, 16, 4, 64, 30.0, (128, 2)),
    (1, 2560, 2624, 8, 2, 64, None, (128, 3)),  # slots of 3 across tiles of differing steps
    (2, 2048, 2048, 8, 4, 64, None, (64, 4)),
    (2, 1024, 1088, 16, 4, 128, None, (128, 2), "float16"),
    (1, 2560, 2560, 8, 2, 128, None, (192, 2)),  # O through Q's buffer
    (1, 2560, 2560, 8, 2, 256, None, (64, 2)),  # D256: O through Q's buffer
]


@hopper_only
@pytest.mark.parametrize(
    "case, causal",
    [(c, False) for c in PERSISTENT_CASES] + [(c, True) for c in PERSISTENT_CAUSAL_CASES],
    ids=lambda c: "-".join(map(str, c)) if isinstance(c, tuple) else ("causal" if c else "full"),
)
@pytest.mark.every_case
def test_persistent_matches_per_tile(case, causal):
    """The persistent form computes each tile as the per-tile launch does (which the
    oracle tests check): bit for bit, out and lse, whichever block takes the tile."""
    b, tq, tk, hq, hkv, d, cap, (block_kv, stages), *dtype = case
    dtype = dtype[0] if dtype else "bfloat16"
    rng = util.rng_for("mosaic persistent", case, causal)
    q = util.randn(rng, (b, tq, hq, d), dtype)
    k, v = (util.randn(rng, (b, tk, hkv, d), dtype) for _ in range(2))
    persistent = MosaicForwardConfig(64, block_kv, stages, persistent=True)
    launch = Launch(hq, tq // persistent.rows, b, hq // hkv)
    assert persistent.persistent and persistent_blocks(persistent, launch, True) > 0
    assert not causal or causal_walks(causal, None, False, tq, tk)
    per_tile = dataclasses.replace(persistent, persistent=False)
    fn = functools.partial(mosaic_forward, causal=causal, soft_cap=cap, scale=d**-0.5)
    got = jax.jit(functools.partial(fn, config=persistent))(q, k, v)
    want = jax.jit(functools.partial(fn, config=per_tile))(q, k, v)
    for x, y, name in zip(got, want, ("out", "lse"), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=name)


@hopper_only
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.every_case
def test_long_full_attention_matches_oracle(d):
    """The tiling the heuristic gives long full attention (192-key steps), chosen by
    `jaxattn.attention`, with a last key block a third full (Tk = 11 blocks of 192 + 64:
    the short last step), over 160 tiles (persistent; at D128 O in the spare rows)."""
    rng = util.rng_for("mosaic long full", d)
    q = util.randn(rng, (1, 2560, 8, d), "bfloat16")
    k, v = (util.randn(rng, (1, LONG_FULL_KEYS + 128, 2, d), "bfloat16") for _ in range(2))
    picked = forward_backend(_static(causal=False), None, q, k, (None,) * 4)
    assert picked == ("mosaic", MosaicForwardConfig(64, 192, 2, persistent=True))
    out = jax.jit(functools.partial(jaxattn.attention, scale=0.1, implementation="pallas"))(q, k, v)
    args = [util.f64(x) for x in (q, k, v)]
    want, _ = attention_oracle(*args, scale=0.1)
    lowp_ref, _ = attention_oracle(*args, scale=0.1, lowp=ml_dtypes.bfloat16)
    util.assert_out_close(out, want, "bfloat16", lowp_ref=lowp_ref)


@hopper_only
def test_attention_selects_mosaic_and_differentiates():
    """`jaxattn.attention` on this device: the forward runs the Hopper kernel (chosen
    automatically), and gradients through its residuals (the Hopper backward, also chosen
    automatically) match the reference's as closely as the Triton kernels' do."""
    static = _static(causal=True, window=None)
    q_shape, k_shape = (2, 512, 8, 128), (2, 512, 2, 128)
    q_s, k_s = (jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in (q_shape, k_shape))
    assert forward_backend(static, None, q_s, k_s, (None,) * 4)[0] == "mosaic"
    rng = util.rng_for("mosaic grad")
    q = util.randn(rng, q_shape, "bfloat16")
    k, v = (util.randn(rng, k_shape, "bfloat16") for _ in range(2))
    w = util.randn(rng, q_shape, "float32")

    def loss(op, q, k, v):
        return jnp.sum(op(q, k, v, causal=True, soft_cap=25.0).astype(jnp.float32) * w)

    auto = functools.partial(jaxattn.attention, implementation="pallas")
    triton_bwd = jaxattn.FlashBackwardConfig(backend="triton")
    config = jaxattn.FlashPrefillConfig(backend="triton", backward=triton_bwd)
    triton = functools.partial(auto, config=config)
    grads = jax.jit(jax.grad(functools.partial(loss, auto), argnums=(0, 1, 2)))(q, k, v)
    ref = jax.jit(jax.grad(functools.partial(loss, triton), argnums=(0, 1, 2)))(q, k, v)
    exact = jax.jit(
        jax.grad(functools.partial(loss, jaxattn.attention_reference), argnums=(0, 1, 2))
    )(*(x.astype(jnp.float32) for x in (q, k, v)))
    for name, g, r, e in zip("qkv", grads, ref, exact, strict=True):
        g, r, e = (np.asarray(x, np.float64) for x in (g, r, e))
        assert np.isfinite(g).all(), name
        err, triton_err = np.abs(g - e).max(), np.abs(r - e).max()
        assert err <= 2 * triton_err + 1e-2 * np.abs(e).max(), (name, err, triton_err)


def test_cases_cover_each_option():
    """The GPU cases meet causal, full, window, soft-cap, each head dim and MQA/GQA/MHA."""
    seen = set()
    for _, _, _, hq, hkv, d, causal, window, cap in KERNEL_CASES:
        seen |= {f"D{d}", "causal" if causal else "full", f"group{hq // hkv}"}
        seen |= {"window"} if window else set()
        seen |= {"cap"} if cap else set()
    want = {"D64", "D128", "D256", "causal", "full", "window", "cap", "group1", "group4"}
    assert want <= seen, want - seen
