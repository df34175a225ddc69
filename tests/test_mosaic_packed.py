"""Packed (`cu_seqlens`) batches on the Hopper (Mosaic GPU) forward and backward.

Sequence b owns query rows `cu_seqlens_q[b] : cu_seqlens_q[b + 1]` and keys
`cu_seqlens_k[b] : cu_seqlens_k[b + 1]`; rows past `cu_seqlens_q[-1]` are padding (zeros,
lse -inf). A block computes one tile of one sequence, read from its start rounded down
to 8 rows; the tiles cut by a sequence's start or end go through a tail array scattered
into place after the kernel (`packed.py`).

On CPU: the tile table and the tails place every row exactly once, in its own sequence's
tile at its own row (the invariant that keeps blocks from overwriting each other's rows);
the kernel lowers for CUDA; the selection logic. On an sm90 GPU: the kernel against the
float64 oracle with the padding past `cu_seqlens[-1]` poisoned (the backward's dq, dk,
dv with an lse cotangent too), and `jaxattn.ragged_attention` taking both kernels.
"""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import util
from grad_oracle import ragged_attention_grad_oracle
from oracle import ragged_attention_oracle
from test_grad_kernels import assert_qkv_grads_close
from test_mosaic import hopper_only

import jaxattn
from pallas_kernels.batch import packed_batch
from pallas_kernels.mosaic import (
    MosaicBackwardConfig,
    MosaicForwardConfig,
    backward_unsupported,
    forward_unsupported,
    mosaic_backward_packed,
    mosaic_forward_packed,
)
from pallas_kernels.mosaic.packed import (
    IN_PLACE,
    LEAD_K,
    LEAD_Q,
    NOWHERE,
    ROW_ALIGN,
    STORE,
    merge_tails,
    tail_rows,
    tile_table,
)
from pallas_kernels.tiles import _K_START, _KV_LEN, _Q_LEN, _Q_START, _ROW, _SEQ

attention_module = importlib.import_module("jaxattn.attention")
LOWP = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def _many(n: int, seed: int, most: int) -> tuple[int, ...]:
    return tuple(int(x) for x in np.random.default_rng(seed).integers(1, most, n))


# (Tq, Tk, Hq, Hkv, D, causal, window, soft_cap, q_lens, kv_lens): Tq, Tk the arrays'
# rows (multiples of 8), at least the sums of the lengths.
CASES = [
    (640, 640, 8, 2, 128, True, None, None, (100, 200, 1, 255), (100, 200, 1, 255)),
    (640, 1024, 4, 4, 64, False, None, None, (300, 0, 129, 128), (500, 77, 129, 200)),
    (384, 384, 4, 2, 128, True, 50, 30.0, (3, 250, 64, 64), (10, 250, 64, 60)),
    (256, 256, 4, 2, 128, True, None, None, (200, 40), (100, 40)),  # rows that see no key
    (256, 256, 4, 2, 64, True, None, None, (256,), (256,)),  # no padding, whole tiles
    (512, 512, 4, 2, 128, True, None, None, _many(24, 0, 20), _many(24, 0, 20)),
    (256, 256, 4, 1, 256, True, None, None, (57, 199), (57, 199)),  # D256
    # Sequence starts off the 8-row grid, queries and keys apart.
    (520, 520, 4, 2, 128, True, None, None, (3, 130, 1, 127, 128, 9), (5, 121, 2, 7, 256, 9)),
]


def _opts(case):
    *_, d, causal, window, cap, _, _ = case
    return dict(causal=causal, window=window, soft_cap=cap, scale=d**-0.5)


def _cu(lens):
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def _inputs(case, dtype, poison_kind="nan"):
    """(clean q, k, v; poisoned q, k, v; cu_q, cu_k): the poisoned copies hold NaN (or a
    huge finite value) in every row past the last sequence."""
    tq, tk, hq, hkv, d, *_, q_lens, kv_lens = case
    rng = util.rng_for("mosaic packed", case, dtype)
    q = util.randn(rng, (tq, hq, d), dtype)
    k, v = (util.randn(rng, (tk, hkv, d), dtype) for _ in range(2))
    cu_q, cu_k = _cu(q_lens), _cu(kv_lens)
    value = util.poison_value(dtype, poison_kind)

    def poison(x, used):
        pad = (jnp.arange(x.shape[0]) >= used)[:, None, None]
        return jnp.where(pad, value, x).astype(x.dtype)

    bad = (poison(q, cu_q[-1]), poison(k, cu_k[-1]), poison(v, cu_k[-1]))
    return (q, k, v), bad, (jnp.asarray(cu_q), jnp.asarray(cu_k))


# ------------------------------------------------------------------ placement (CPU)


@pytest.mark.parametrize("axis", ["q", "kv"])
@pytest.mark.parametrize("causal, window", [(True, None), (False, None), (True, 50)])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{len(c[8])}seqs-T{c[0]}")
def test_tiles_and_tails_place_every_row_once(case, causal, window, axis):
    """Every row of the arrays is written exactly once: by a tile of its own sequence (in
    place, or through a tail slot) holding it at its own row, or, past the last sequence,
    by the padding's tiles (zeros); tiles start at multiples of 8 rows and their
    sequence's lengths count the rows and keys before its start as padding; spare tiles
    write nothing. `axis`: the forward's and dQ kernel's query tiles, or the dK/dV
    kernel's key tiles."""
    tq, tk, *_, q_lens, kv_lens = case
    rows = 128
    cu_q, cu_k = _cu(q_lens), _cu(kv_lens)
    batch = packed_batch(cu_q, cu_k, tq, tk)
    n, cu, lens = (tq, cu_q, q_lens) if axis == "q" else (tk, cu_k, kv_lens)
    own_rows = batch.q_rows if axis == "q" else batch.k_rows
    table = np.asarray(tile_table(batch, rows, n, causal=causal, window=window, axis=axis))
    where = np.asarray(tail_rows(cu, own_rows, rows, n))
    owner = np.searchsorted(cu, np.arange(n), side="right") - 1  # [n]: its sequence
    q_lens_all, kv_lens_all = list(q_lens) + [0], list(kv_lens) + [0]
    written = np.zeros(n, int)
    slots_used = set()
    for tile in table:
        seq, row, store = tile[_SEQ], tile[_ROW] * ROW_ALIGN, tile[STORE]
        if store == NOWHERE:
            assert tile[_Q_LEN] == 0 and tile[_KV_LEN] == 0
            continue
        q_base, k_base = tile[_Q_START] * ROW_ALIGN, tile[_K_START] * ROW_ALIGN
        lead_q, lead_k = cu_q[seq] - q_base, cu_k[seq] - k_base
        assert 0 <= lead_q < ROW_ALIGN and 0 <= lead_k < ROW_ALIGN and row % rows == 0
        assert tile[LEAD_K] == lead_k and tile[_KV_LEN] == kv_lens_all[seq] + lead_k
        assert tile[LEAD_Q] == lead_q and tile[_Q_LEN] == q_lens_all[seq] + lead_q
        base = q_base if axis == "q" else k_base
        at = base + row + np.arange(rows)  # the tile's rows in the arrays
        if store >= 0:  # a tail slot: its map sends exactly the sequence's rows home
            assert store // 2 == seq and store not in slots_used
            slots_used.add(store)
            kept = where[store] < n
            mine = (at >= cu[seq]) & (at < cu[seq] + own_rows[seq]) & (at < n)
            np.testing.assert_array_equal(kept, mine)
            np.testing.assert_array_equal(where[store][kept], at[kept])
            at = at[kept]
        else:
            assert store == IN_PLACE
            at = at[at < n]  # TMA drops rows past the arrays
        np.testing.assert_array_equal(owner[at], np.minimum(seq, len(lens)))
        written[at] += 1
    unused = [s for s in range(where.shape[0]) if s not in slots_used]
    assert (where[unused] == n).all(), "a slot no tile writes must scatter nothing"
    np.testing.assert_array_equal(written, 1)


def test_merge_tails_moves_only_real_rows():
    """Slot 2s (a sequence's first tile, from its start rounded down to 8 rows) and slot
    2s + 1 (its last tile, cut by its end) send home only the sequence's own rows; slots
    no tile writes send nothing; in-place rows stay."""
    starts, lens = jnp.array([0, 5, 5, 13], jnp.int32), jnp.array([5, 0, 8, 3], jnp.int32)
    where = np.asarray(tail_rows(starts, lens, 8, 16))
    assert where.shape == (8, 8)
    np.testing.assert_array_equal(where[1][:5], np.arange(5))  # seq 0: its cut last tile
    assert (where[[0, 2, 3, 7]] == 16).all()  # aligned start; empty; the padding's end
    np.testing.assert_array_equal(where[4][5:], [5, 6, 7])  # seq 2 from row 0: its head
    np.testing.assert_array_equal(where[5][:5], [8, 9, 10, 11, 12])  # ... and its end
    np.testing.assert_array_equal(where[6][5:], [13, 14, 15])  # the padding's head
    x = jnp.zeros((16, 2, 3))
    tail = jnp.arange(8 * 8 * 2 * 3, dtype=jnp.float32).reshape(8, 8, 2, 3) + 1
    got = np.asarray(merge_tails(x, tail, jnp.asarray(where)))
    np.testing.assert_array_equal(got[:5], np.asarray(tail[1, :5]))
    np.testing.assert_array_equal(got[5:8], np.asarray(tail[4, 5:]))
    np.testing.assert_array_equal(got[8:13], np.asarray(tail[5, :5]))
    lse = merge_tails(jnp.zeros((2, 16)), jnp.moveaxis(tail[..., 0], 1, 2), jnp.asarray(where), 1)
    np.testing.assert_array_equal(np.asarray(lse)[:, :16], np.asarray(got[..., 0]).T)


# ------------------------------------------------------------------ lowering, selection (CPU)


@pytest.mark.parametrize("case", [CASES[0], CASES[2]], ids=["causal", "window-softcap"])
def test_packed_kernels_lower_for_cuda(case):
    tq, tk, hq, hkv, d, *_, q_lens, _ = case
    q = jax.ShapeDtypeStruct((tq, hq, d), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((tk, hkv, d), jnp.bfloat16)
    lse = jax.ShapeDtypeStruct((hq, tq), jnp.float32)
    cu = jax.ShapeDtypeStruct((len(q_lens) + 1,), jnp.int32)
    fwd = functools.partial(mosaic_forward_packed, **_opts(case))
    bwd = functools.partial(mosaic_backward_packed, **_opts(case))
    for fn, args in ((fwd, (q, k, k, cu, cu)), (bwd, (q, k, k, q, lse, q, lse, cu, cu))):
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text


def test_key_tiles_holding_sinks_launch_first():
    """With a window, a key tile holding its sequence's sinks serves every later query row:
    the heaviest tile of the dK/dV kernel's table, launched first (a window alone costs
    every full key tile the same)."""
    cu = _cu((1024, 1024))
    batch = packed_batch(cu, cu, 2048, 2048)
    for sinks in (0, 4):
        table = np.asarray(tile_table(batch, 128, 2048, causal=True, window=64,
                                      sink_tokens=sinks, axis="kv"))  # fmt: skip
        first_two = {int(r) for r in table[:2, _ROW]}
        assert (first_two == {0}) == bool(sinks), (sinks, table[:4, _ROW])


def test_support_takes_packed_batches_of_whole_row_tiles():
    for unsupported, config in ((forward_unsupported, MosaicForwardConfig()),
                                (backward_unsupported, MosaicBackwardConfig())):  # fmt: skip
        check = functools.partial(unsupported, dtype=jnp.bfloat16, config=config, packed=True)
        assert check((1000, 8, 128), (904, 2, 128)) is None
        assert "multiples of 8" in check((1001, 8, 128), (904, 2, 128))
        assert "multiples of 8" in check((1000, 8, 128), (900, 2, 128))
    q = jax.ShapeDtypeStruct((1001, 8, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((904, 2, 128), jnp.bfloat16)
    cu = jax.ShapeDtypeStruct((3,), jnp.int32)
    with pytest.raises(ValueError, match="multiples of 8"):  # called directly: a clear error
        jax.jit(mosaic_forward_packed).trace(q, k, k, cu, cu)
    lse = jax.ShapeDtypeStruct((8, 1001), jnp.float32)
    with pytest.raises(ValueError, match="mosaic_backward_packed.*multiples of 8"):
        jax.jit(mosaic_backward_packed).trace(q, k, k, q, lse, q, lse, cu, cu)


# ------------------------------------------------------------------ the kernel (sm90)


def _check(case, dtype, out, lse, clean, cu):
    args = [util.f64(x) for x in clean]
    want, want_lse = ragged_attention_oracle(*args, *cu, **_opts(case))
    lowp_ref, _ = ragged_attention_oracle(*args, *cu, **_opts(case), lowp=LOWP[dtype])
    util.assert_out_close(out, want, dtype, lowp_ref=lowp_ref)
    util.assert_lse_close(lse, want_lse, dtype)
    util.assert_zero_rows(out, np.isneginf(want_lse).T[..., None], "keyless and padding rows")


@hopper_only
@pytest.mark.parametrize("poison", ["nan", "huge"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[:8])) + f"-{len(c[8])}")
@pytest.mark.every_case
def test_packed_forward_matches_oracle(case, dtype, poison):
    clean, bad, cu = _inputs(case, dtype, poison)
    out, lse = jax.jit(functools.partial(mosaic_forward_packed, **_opts(case)))(*bad, *cu)
    _check(case, dtype, out, lse, clean, cu)


@hopper_only
def test_packed_forward_config_variants():
    case = CASES[0]
    clean, bad, cu = _inputs(case, "bfloat16")
    for block_kv, stages in ((64, 2), (64, 3), (64, 4)):  # (128, 2): the heuristic's
        config = MosaicForwardConfig(block_kv=block_kv, num_stages=stages)
        fn = functools.partial(mosaic_forward_packed, **_opts(case), config=config)
        out, lse = jax.jit(fn)(*bad, *cu)
        _check(case, "bfloat16", out, lse, clean, cu)


def _grad_inputs(case, dtype):
    """(clean q, k, v, g_out, g_lse; poisoned copies; cu): NaN past the last sequence."""
    clean, bad, cu = _inputs(case, dtype)
    rng = util.rng_for("mosaic packed cotangents", case, dtype)
    g_out = util.randn(rng, clean[0].shape, dtype)
    g_lse = util.randn(rng, (clean[0].shape[1], clean[0].shape[0]), "float32")
    pad = jnp.arange(clean[0].shape[0]) >= cu[0][-1]
    bad_g = jnp.where(pad[:, None, None], jnp.nan, g_out).astype(g_out.dtype)
    return (*clean, g_out, g_lse), (*bad, bad_g, jnp.where(pad[None, :], jnp.nan, g_lse)), cu


@hopper_only
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[:8])) + f"-{len(c[8])}")
@pytest.mark.every_case
def test_packed_backward_matches_oracle(case, dtype):
    """dq, dk, dv with an lse cotangent against the float64 per-sequence oracle; padding
    past the last sequence NaN (inputs, out, lse, cotangents) gets zero gradients, and no
    gradient crosses between neighbouring sequences (the kernels read their rows)."""
    clean, bad, cu = _grad_inputs(case, dtype)
    q, k, v, g_out, g_lse = bad
    out, lse = mosaic_forward_packed(q, k, v, *cu, **_opts(case))
    pad = jnp.arange(q.shape[0]) >= cu[0][-1]
    out = jnp.where(pad[:, None, None], jnp.nan, out).astype(out.dtype)
    lse = jnp.where(pad[None, :], jnp.nan, lse)
    fn = jax.jit(functools.partial(mosaic_backward_packed, **_opts(case)))
    grads = fn(q, k, v, out, lse, g_out, g_lse, *cu)
    args = [util.f64(x) for x in clean]
    want = ragged_attention_grad_oracle(*args[:3], *cu, *args[3:], **_opts(case))
    plain = ragged_attention_grad_oracle(*args[:3], *cu, *args[3:], lowp=LOWP[dtype],
                                         **_opts(case))  # fmt: skip
    assert_qkv_grads_close(grads, want, plain, dtype)
    again = fn(q, k, v, out, lse, g_out, g_lse, *cu)
    for name, g, h in zip("qkv", grads, again, strict=True):
        np.testing.assert_array_equal(util.bits(g), util.bits(h), err_msg=f"d{name}")


@hopper_only
def test_ragged_attention_takes_the_hopper_kernels(monkeypatch):
    """`jaxattn.ragged_attention` with `"pallas"` runs both packed Hopper kernels; its
    gradient matches the XLA reference's."""
    case = CASES[2]
    clean, bad, cu = _inputs(case, "bfloat16")
    calls = util.spy_calls(
        monkeypatch, attention_module, ("mosaic_forward_packed", "mosaic_backward_packed")
    )
    g = util.randn(util.rng_for("packed cotangent"), clean[0].shape, "bfloat16")

    def attend(impl):
        def op(q, k, v):
            return jaxattn.ragged_attention(q, k, v, *cu, implementation=impl, **_opts(case))

        return op

    got = util.weighted_grads(attend("pallas"), clean, g)
    assert calls == ["mosaic_forward_packed", "mosaic_backward_packed"]
    util.assert_grads_near(got, util.weighted_grads(attend("xla"), clean, g), 0.05)
