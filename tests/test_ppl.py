"""OpenPPL's `MultiHeadCacheAttention` (`jaxattn.ppl.multi_head_cache_attention`) against
the float64 numpy oracle of `ppl_oracle.py`, for every cache layout, cache mode and
quantization, through the Pallas kernels (interpret mode on CPU) and the XLA path.

Each step is a mixed batch (decode rows first, then prompts and chunked prompts with a
cached prefix), padding tokens at the end of the packed arrays, and a cache whose every
row no sequence owns (and every other layer) holds garbage. Checked:
  - outputs against the oracle, padding rows exactly zero;
  - the returned cache and scale: the written rows hold exactly the oracle's values
    (quantized: its codes and scales), everything else is bit-identical to the input.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import util
from oracle import bloom_alibi_slopes
from ppl_oracle import QMAX, canonical, codes_of, make_case, pack_int4, quantize_rows, unpack_int4

import jaxattn
from jaxattn import ppl
from jaxattn.ppl.cache import PPLCache

# Output tolerances (atol = rtol) against the float64 oracle, by query dtype. fp16/bf16:
# the output is stored in that dtype (half an ulp: ~5e-4 / 4e-3 at |out| ~ 1) and the
# kernels round probabilities and dequantized values to it before the P.V product.
# float32: compiled GPU kernels' exp2 is approximate (util.F32_TOL).
TOL = {"float32": 1e-4 if util.ON_GPU else 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}

# The default step: two decode rows (the second writes the last slot of a page), a prompt
# and a chunked prompt whose chunk crosses a page boundary (page_size 8).
SEQLENS, KVLENS, DECODING = (1, 1, 9, 6), (19, 8, 9, 37), 2


def case_for(*key, **kw):
    """`make_case` with a generator seeded from the case's identity."""
    kw.setdefault("seqlens", SEQLENS)
    kw.setdefault("kvlens", KVLENS)
    kw.setdefault("decoding_batches", DECODING)
    return make_case(util.rng_for("ppl", *key, *sorted(kw.items())), **kw)


def op_fn(case, implementation, *, donate=False, traced_decoding=True, **op_kw):
    """The op under jax.jit: arrays (and `decoding_batches`, unless not `traced_decoding`)
    traced; max_seqlen, max_kvlen and the keywords static (`op_kw`: more of them, such as
    the kernels' tilings)."""
    kw = dict(case.kw, implementation=implementation, **op_kw)

    def fn(q, k, v, seqstarts, kvstarts, cachestarts, start_pos, decoding, cache, scale, mask):
        if not traced_decoding:
            decoding = case.decoding_batches
        return ppl.multi_head_cache_attention(
            q, k, v, seqstarts, kvstarts, cachestarts, start_pos, decoding, case.max_seqlen,
            case.max_kvlen, cache, scale, mask, **kw,
        )  # fmt: skip

    return jax.jit(fn, donate_argnums=(8,) if donate else (), compiler_options=util.FAST_COMPILE)


def jax_args(case):
    args = list(case.args())
    del args[8:10]  # max_seqlen, max_kvlen: static
    args[7] = jnp.asarray(args[7], jnp.int32)
    # copies: a donated cache must not alias the numpy input the checks compare against
    return [None if x is None else jnp.array(x, copy=True) for x in args]


def run(case, implementation, **kw):
    return op_fn(case, implementation, **kw)(*jax_args(case))


# --------------------------------------------------------------------------- checks
def check_store(case, got, want, before, what):
    """A returned cache/scale: written entries equal the oracle's, the rest the input's."""
    got = np.asarray(got)
    assert got.shape == before.shape and got.dtype == before.dtype, (
        f"{what}: {got.shape} {got.dtype} returned for {before.shape} {before.dtype}"
    )
    layout, layer = case.kw["cache_layout"], case.kw["layer_idx"]
    g, w, b = (canonical(util.bits(x), layout) for x in (got, want, before))
    written = np.zeros(g.shape[:2], bool)  # [MaxT, L]
    written[[row for _, row in case.written()], layer] = True
    changed = np.argwhere(np.any(g != b, axis=(2, 3, 4)) & ~written)
    assert not len(changed), (
        f"{what}: (row, layer) entries the step does not write changed, e.g. {changed[:5]}"
    )
    quant_bit = case.kw["quant_bit"]
    if quant_bit and what.endswith("cache"):  # compare codes, naming those that differ
        gc, wc = (codes_of(canonical(x, layout)[written], quant_bit) for x in (got, want))
        bad = np.argwhere(gc != wc)
        if util.ON_GPU:  # a fused `x * (1 / s)` may round a tie the other way (test_paged)
            diff = np.abs(gc - wc)
            assert diff.max() <= 1 and np.mean(diff > 0) <= 0.01, f"{what}: {len(bad)} codes off"
            return
        assert not len(bad), (
            f"{what}: {len(bad)} of {gc.size} written codes differ from the oracle's; e.g. "
            f"[entry, k/v, head, channel] {bad[:3].tolist()}: got {gc[tuple(bad[:3].T)]}, "
            f"want {wc[tuple(bad[:3].T)]}"
        )
        return
    bad = np.argwhere(g[written] != w[written])
    if len(bad):
        at = tuple(bad[0])
        raise AssertionError(
            f"{what}: {len(bad)} of {g[written].size} written values differ from the oracle's; "
            f"e.g. [entry, k/v, head, channel] {list(at)}: got "
            f"{canonical(got, layout)[written][at]!r} (bits {g[written][at]:#x}), want "
            f"{canonical(want, layout)[written][at]!r} (bits {w[written][at]:#x})"
        )


def check(case, result, what=""):
    """The op's (out, cache, scale) against the oracle's."""
    out, cache, scale = result
    want_out, want_cache, want_scale = case.oracle()
    assert out.shape == case.query.shape and out.dtype == case.query.dtype, (out.shape, out.dtype)
    real = int(case.seqstarts[-1])
    util.assert_zero_rows(out, (np.arange(len(out)) >= real)[:, None, None], f"{what} padding")
    got = util.f64(out)
    assert np.isfinite(got[:real]).all(), f"{what} out: {np.sum(~np.isfinite(got))} non-finite"
    tol = TOL[str(case.query.dtype)]
    if util.ON_GPU and case.kw["quant_bit"]:
        # A fused `x * (1 / s)` may round a tie to the other code (check_store allows it):
        # one INT4 code is a seventh of its group's range. Attend to what the op stored.
        want_out = case.oracle(written=(cache, scale))[0]
    np.testing.assert_allclose(got, want_out, atol=tol, rtol=tol, err_msg=f"{what} out")
    check_store(case, cache, want_cache, case.cache, f"{what} cache".strip())
    if case.kw["quant_bit"]:
        check_store(case, scale, want_scale, case.scale, f"{what} scale".strip())
    else:
        assert scale is None, f"quant_bit=0: scale must be returned as passed (None), got {scale}"
    return result


# ---------------------------------------------------------- the oracle's own checks
def test_oracle_int4_packing_matches_the_library_convention():
    codes = np.random.default_rng(0).integers(-8, 8, (5, 16))
    np.testing.assert_array_equal(unpack_int4(pack_int4(codes)), codes)
    np.testing.assert_array_equal(
        pack_int4(codes), np.asarray(jaxattn.quant.pack_int4(jnp.asarray(codes, jnp.int8)))
    )
    assert pack_int4(np.asarray([[-1, 0, 3, 0]])).tolist() == [[0x3F, 0x00]]


@pytest.mark.parametrize("quant_bit", [8, 4])
@pytest.mark.every_case
def test_oracle_quantization(quant_bit):
    x = (np.random.default_rng(1).standard_normal((7, 2, 16)) * 3).astype(np.float16)
    x[0, 0, :8] = 0  # an all-zero group: the scale is fp16's smallest normal
    stored, s = quantize_rows(x, quant_bit, 8, np.float16)
    assert s.dtype == np.float16 and s[0, 0, 0] == np.float16(2**-14)
    codes = codes_of(stored, quant_bit)
    assert np.abs(codes).max() == QMAX[quant_bit]  # each group's absmax maps to +-qmax
    back = codes * np.repeat(s.astype(np.float64), 8, -1)
    assert np.all(np.abs(back - x.astype(np.float64)) <= 0.5 * np.repeat(s, 8, -1) * 1.001)


def test_float16_scales_saturate_rather_than_overflow():
    """A group whose amax / qmax passes float16's largest value (1e7 / 127 > 65504): its
    scale had been inf, its codes 0, and its values read back NaN. The scale now
    saturates at 65504 and the codes at +-qmax; the other group is exact as before."""
    rows = PPLCache(1, 0, 1, 8, 8, 8, 0, 0, 0)
    k = np.zeros((2, 1, 8), np.float32)
    k[0, 0], k[1, 0] = np.linspace(-1e7, 1e7, 8), np.linspace(-1e3, 1e3, 8)
    cache, scale = jnp.zeros((2, 1, 2, 1, 8), jnp.int8), jnp.zeros((2, 1, 2, 1, 1), jnp.float16)
    cache, scale, keys, _ = rows.write(cache, scale, jnp.asarray(k), jnp.asarray(k), jnp.arange(2))
    assert np.isfinite(np.asarray(keys, np.float32)).all()
    assert float(scale[0, 0, 0, 0, 0]) == 65504.0
    assert np.asarray(cache[0, 0, 0, 0]).tolist()[::7] == [-127, 127]
    stored, s = quantize_rows(k[1:], 8, 8, np.float16)  # the oracle, on the in-range row
    np.testing.assert_array_equal(np.asarray(cache[1, 0, 0]), stored[0])


def test_oracle_slopes_match_the_library():
    for n in (4, 6, 8):
        np.testing.assert_allclose(bloom_alibi_slopes(n), jaxattn.alibi_slopes(n), rtol=1e-6)


def test_oracle_matches_ragged_oracle():
    """The float-cache oracle reads back what it wrote: it agrees with `oracle`'s ragged
    attention on the histories assembled by hand."""
    from oracle import ragged_attention_oracle
    from ppl_oracle import cache_row

    case = case_for("self", cache_mode=1, cache_layout=2, mask="3d", decoding_batches=0)
    out, cache, _ = case.oracle()
    kv = canonical(cache, 2)[:, 1].astype(np.float64)
    rows = [cache_row(case.cachestarts, b, p, 1, 8) for b, n in enumerate(KVLENS) for p in range(n)]
    want, _ = ragged_attention_oracle(
        case.query, kv[rows, 0], kv[rows, 1], case.seqstarts, case.kvstarts, causal=True,
        bias=case.attn_mask[:, :, : case.kvstarts[-1]],
    )  # fmt: skip
    np.testing.assert_allclose(out, want, atol=1e-12)


# ----------------------------------------------------------- layouts x modes x quant
def dtypes_for(quant_bit):
    return dict(dtype="float32") if quant_bit == 0 else dict(dtype="float16")


def _layout_cases(other_half=False):
    """Every layout x mode x quant_bit on a GPU (make test-gpu). In interpret mode (CI), a
    case costs ~5 s of compile: every layout x quant_bit, the mode alternating so that
    each layout and each quant_bit meets both modes (12 of the 24). `other_half`: the
    other 12, as pairwise (the XLA path's; with the Pallas half, all 24 run on CPU)."""
    cases = [(layout, mode, q) for layout in range(4) for mode in (0, 1) for q in (0, 8, 4)]
    if util.ON_GPU:
        return cases
    return [(layout, mode, q) for layout, mode, q in cases
            if (mode == (layout + (0, 8, 4).index(q)) % 2) != other_half]  # fmt: skip


@pytest.mark.parametrize("cache_layout, cache_mode, quant_bit", _layout_cases())
def test_layouts_pallas(cache_layout, cache_mode, quant_bit):
    """Quantized caches at head dim 64: the decode kernel reads V as words (parts of strided
    channels; int32 words of INT8, int16 half-words of INT4) from PPL's caches in place;
    layout 0 holds K and V of every layer in one array, so V is a word view of the whole
    cache read at its own K/V and layer index. (V read as codes from PPL's layouts: the
    feature cases, at head dim 16.)"""
    case = case_for(cache_layout=cache_layout, cache_mode=cache_mode, quant_bit=quant_bit,
                    **dict(head_dim=64) if quant_bit else {}, **dtypes_for(quant_bit))  # fmt: skip
    check(case, run(case, "pallas"))


@pytest.mark.parametrize(
    "cache_layout, cache_mode, quant_bit", [(0, 1, 8), (3, 0, 4), (1, 0, 8), (2, 1, 4)]
)
def test_odd_head_dim_pallas(cache_layout, cache_mode, quant_bit):
    """Head dim 96 (no power of two), groups of 8: the decode kernel reads PPL's rows in
    segments (INT8 64 + 32 channels, INT4 halves of 48 as 32 + 16 bytes), in place, from
    the token layouts as from the page-major ones."""
    case = case_for("d96", cache_layout=cache_layout, cache_mode=cache_mode,
                    quant_bit=quant_bit, head_dim=96, **dtypes_for(quant_bit))  # fmt: skip
    check(case, run(case, "pallas"))


def test_int4_decode_over_several_blocks():
    """INT4 (groups of 8 = a scale per half-row at head_dim 16) read in 16-token blocks, two
    splits: the decode kernel's loads issued a step ahead cross steps in a token layout (the
    heuristic's 128-token blocks cover these rows in one step)."""
    case = case_for("several blocks", cache_layout=0, cache_mode=1, quant_bit=4, dtype="float16")
    check(case, run(case, "pallas", decode_config=jaxattn.PagedDecodeConfig(16, 2)))


@pytest.mark.parametrize("cache_layout, cache_mode, quant_bit", _layout_cases(other_half=True))
def test_layouts_xla(cache_layout, cache_mode, quant_bit):
    case = case_for("xla", cache_layout=cache_layout, cache_mode=cache_mode,
                    quant_bit=quant_bit, **dtypes_for(quant_bit))  # fmt: skip
    check(case, run(case, "xla"))


# ----------------------------------------------------------------------- features
# One option each (XLA path: every one, cheap to compile), cache mode in the id.
FEATURES = {
    "not_causal-0": dict(is_causal=False),
    # batch 2 is a prompt, but among the first `decoding_batches`: never causal-masked
    "decoding_covers_prompt-1": dict(decoding_batches=3),
    "decoding_0-0": dict(decoding_batches=0),
    "alibi_6_heads-1": dict(is_alibi=True, num_heads=6, num_kv_heads=3),
    "mask_3d-0": dict(mask="3d", cache_layout=2),
    "mask_2d_int8-1": dict(mask="2d", cache_layout=3, quant_bit=8, dtype="float16"),
    "alibi_mask_noncausal_int4-0": dict(
        is_alibi=True, mask="3d", is_causal=False, quant_bit=4, dtype="float16", cache_layout=1
    ),
    "mha-1": dict(num_kv_heads=0),
    "mqa_int8_group4-0": dict(num_kv_heads=1, quant_bit=8, dtype="float16", quant_group=4),
    "max_lens_larger-1": dict(extra_len=5),
    "empty_batches-0": dict(seqlens=(1, 0, 9, 0, 4), kvlens=(12, 5, 9, 0, 11), decoding_batches=1),
    "empty_batches-1": dict(seqlens=(1, 0, 9, 0, 4), kvlens=(12, 5, 9, 0, 11), decoding_batches=1),
    "decode_only-0": dict(seqlens=(1, 1, 1), kvlens=(5, 17, 33), decoding_batches=3),
    "decode_only-1": dict(seqlens=(1, 1, 1), kvlens=(5, 17, 33), decoding_batches=3),
    "prompts_only-0": dict(seqlens=(7, 12), kvlens=(7, 12), decoding_batches=0),
    "prompts_only-1": dict(seqlens=(7, 12), kvlens=(7, 12), decoding_batches=0),
    "one_layer-1": dict(num_layer=1, layer_idx=0, cache_layout=3),
    "last_layer-0": dict(layer_idx=2, cache_layout=2),
    # one group spans both nibbles of every byte
    "int4_group16-1": dict(quant_bit=4, quant_group=16, dtype="float16", cache_layout=3),
    "fp16_cache-0": dict(dtype="float16", cache_layout=1),
    "bf16_cache-1": dict(dtype="bfloat16", cache_layout=2),
    "bf16_int4-0": dict(dtype="bfloat16", quant_bit=4),
    # float32 scales: the ulp of the scale division shows (fp16 rounding hides it)
    "bf16_int8_f32_scale-1": dict(dtype="bfloat16", quant_bit=8, scale_dtype="float32"),
    "f32_int8_f32_scale-0": dict(quant_bit=8, scale_dtype="float32"),
    "unaligned_pages_int4-1": dict(aligned_pages=False, quant_bit=4, dtype="float16"),
    "nan_poison-1": dict(poison="nan"),
}

# The Pallas kernels compile in ~2.5 s a case on CPU (the file's budget: ~30 of them), so
# its cases combine options; each option alone runs through the XLA path above.
PALLAS_FEATURES = {
    "noncausal_mask2d_int8-0": dict(is_causal=False, mask="2d", quant_bit=8, dtype="float16",
                                    cache_layout=3),
    "alibi6_mask3d_mha_maxlens_empty_nan-1": dict(
        is_alibi=True, mask="3d", num_heads=6, num_kv_heads=0, extra_len=5, cache_layout=2,
        seqlens=(1, 0, 9, 0, 4), kvlens=(12, 5, 9, 0, 11), decoding_batches=1, poison="nan"),
    "mqa_int4_group4_first_layer-0": dict(num_kv_heads=1, quant_bit=4, dtype="float16",
                                          quant_group=4, layer_idx=0, cache_layout=1),
    # max_seqlen == 1: a decode-only step
    "decode_only_fp16_nan_unaligned_pages-1": dict(
        seqlens=(1, 1, 1), kvlens=(5, 17, 33), decoding_batches=3, dtype="float16",
        poison="nan", aligned_pages=False),
}  # fmt: skip


def _feature_case(name, kw):
    mode = int(name.rsplit("-", 1)[1])
    return case_for(name, cache_mode=mode, **kw)


@pytest.mark.parametrize("name", list(FEATURES))
def test_features_xla(name):
    case = _feature_case(name, FEATURES[name])
    check(case, run(case, "xla"), name)


@pytest.mark.parametrize("name", list(PALLAS_FEATURES))
def test_features_pallas(name):
    case = _feature_case(name, PALLAS_FEATURES[name])
    if "unaligned" in name:
        assert np.any(case.cachestarts % case.kw["page_size"]), "pages should be unaligned"
    check(case, run(case, "pallas"), name)


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_a_tie_is_written_to_the_even_code(implementation):
    """A decode row whose current V holds an exact tie (x / s = -6.5, s = 2.84375 / 7 in
    float16) with one group a row: the op stores -6, as the oracle (it had stored -7, the
    output then off by p * s = 0.04)."""
    case = case_for("tie", seqlens=(1,), kvlens=(3,), decoding_batches=1, pad_tokens=0,
                    cache_layout=3, cache_mode=0, quant_bit=4, head_dim=64, quant_group=64,
                    dtype="bfloat16")  # fmt: skip
    row = np.zeros(64, np.float32)
    row[0], row[1] = 2.84375, -2.640625
    case.current_value[0, 0] = row.astype(case.current_value.dtype)
    check(case, run(case, implementation), "tie")


def test_decoding_batches_python_int():
    case = case_for("static", cache_mode=1, decoding_batches=3)
    check(case, run(case, "xla", traced_decoding=False))


def test_traced_decoding_batches():
    """decoding_batches is data: one jitted function serves 0 (every prompt row causal),
    2 (the decode rows) and 3 (the prompt in batch 2 sees all its keys)."""
    case = case_for("traced", cache_mode=1, dtype="float16", cache_layout=3)
    fn = op_fn(case, "xla")
    for decoding in (0, 2, 3):
        case.decoding_batches = decoding
        check(case, fn(*jax_args(case)), f"decoding_batches={decoding}")
    assert fn._cache_size() == 1


@pytest.mark.parametrize("implementation", ["pallas", "xla"])
def test_two_steps_donated(implementation):
    """A prompt step, then a decode step on the cache it returned, through one jitted
    function (bf16 queries, int8 cache) with the cache donated and decoding_batches traced:
    step 1 has decoding_batches=1 with a prompt in batch 0 (never causal-masked), step 2
    decodes every row."""
    kw = dict(cache_mode=1, cache_layout=3, quant_bit=8, dtype="bfloat16")
    first = case_for("steps", seqlens=(5, 9, 3), kvlens=(5, 9, 3), decoding_batches=1,
                     pad_tokens=0, extra_len=1, **kw)  # fmt: skip
    fn = op_fn(first, implementation, donate=True)
    _, cache, scale = check(first, fn(*jax_args(first)), "step 1")
    second = case_for("steps2", seqlens=(1, 1, 1), kvlens=(6, 10, 4), decoding_batches=3,
                      pad_tokens=14, **kw)  # fmt: skip
    # the second step runs on the first's page table and cache
    second.cachestarts = first.cachestarts.copy()
    second.cache, second.scale = np.array(cache), np.array(scale)
    second.max_seqlen, second.max_kvlen = first.max_seqlen, first.max_kvlen  # 10, 10
    args = jax_args(second)
    args[8] = cache  # the first step's output buffer, donated again
    check(second, fn(*args), "step 2")
    assert fn._cache_size() == 1


# ------------------------------------------------------------------------- errors
S = jax.ShapeDtypeStruct


def trace(case, **override):
    """The op traced abstractly (no data) on `case`'s shapes, with keyword overrides and
    argument replacements (`arg_<name>=` a ShapeDtypeStruct or None)."""
    names = ["query", "current_key", "current_value", "seqstarts", "kvstarts", "cachestarts",
             "start_pos", "decoding_batches", "max_seqlen", "max_kvlen", "cache", "scale",
             "attn_mask"]  # fmt: skip
    args = dict(zip(names, case.args()))
    args["decoding_batches"] = np.int32(args["decoding_batches"])
    for name in names:
        if f"arg_{name}" in override:
            args[name] = override.pop(f"arg_{name}")
    static = {n: args.pop(n) for n in ("max_seqlen", "max_kvlen")}
    arrays = {n: None if x is None else S(np.shape(x), x.dtype) for n, x in args.items()}
    kw = dict(case.kw, **override)
    return jax.eval_shape(lambda a: ppl.multi_head_cache_attention(**a, **static, **kw), arrays)


@functools.cache
def error_case(cache_mode=0, quant_bit=8):
    return case_for("errors", cache_mode=cache_mode, quant_bit=quant_bit, dtype="float16")


def test_valid_calls_trace():
    for mode in (0, 1):
        out, cache, scale = trace(error_case(mode))
        assert (
            out.shape == error_case(mode).query.shape
            and cache.shape == error_case(mode).cache.shape
        )


# (id, cache_mode of the valid case, overrides given that case, regex of the message)
ERRORS = [
    ("quant_group", 0, lambda c: dict(quant_group=6), r"quant_group"),
    ("heads_not_multiple", 0, lambda c: dict(num_kv_heads=3), r"num_kv_heads|num_heads"),
    ("layer_idx", 0, lambda c: dict(layer_idx=3), r"layer_idx"),
    ("layer_idx_negative", 0, lambda c: dict(layer_idx=-1), r"layer_idx"),
    # bools are ints to Python: True would pass as 1
    ("num_layer_bool", 0, lambda c: dict(num_layer=True, layer_idx=0), r"num_layer=True must"),
    ("cache_mode_bool", 1, lambda c: dict(cache_mode=True), r"cache_mode=True must"),
    # a layout 0 array (MaxT, L, 2, H, D) read as layout 3 (L, 2, H, MaxT, D)
    ("layout_0_as_3", 0, lambda c: dict(cache_layout=3), r"cache"),
    ("layout_0_as_1", 1, lambda c: dict(cache_layout=1), r"cache"),
    ("no_scale", 0, lambda c: dict(arg_scale=None), r"scale"),
    # 4 groups a head instead of head_dim // quant_group = 2
    ("scale_groups", 0, lambda c: dict(arg_scale=S(c.scale.shape[:-1] + (4,), np.float16)),
     r"scale"),
    ("cachestarts_rank_mode0", 1, lambda c: dict(cache_mode=0), r"cachestarts"),
    ("cachestarts_rank_mode1", 0, lambda c: dict(cache_mode=1), r"cachestarts"),
    # quant_bit 4 stores head_dim // 2 bytes a channel row: an int8-shaped cache is wrong
    ("int4_cache_width", 0, lambda c: dict(quant_bit=4), r"cache"),
    # float offsets would be truncated to other rows
    ("cachestarts_float", 0, lambda c: dict(arg_cachestarts=S(c.cachestarts.shape, np.float32)),
     r"cachestarts"),
    ("decoding_batches_float", 0, lambda c: dict(arg_decoding_batches=S((), np.float32)),
     r"decoding_batches"),
    ("decoding_batches_vector", 0, lambda c: dict(arg_decoding_batches=S((2,), np.int32)),
     r"decoding_batches"),
]  # fmt: skip


@pytest.mark.parametrize("mode, override, match", [pytest.param(*e[1:], id=e[0]) for e in ERRORS])
@pytest.mark.every_case
def test_rejects_at_trace_time(mode, override, match):
    case = error_case(mode)
    with pytest.raises(ValueError, match=match):
        trace(case, **override(case))


# ------------------------------------------------------------------ check_inputs
def check_inputs(case):
    args = list(case.args())
    args = [x if i in (8, 9) or x is None else jnp.asarray(x) for i, x in enumerate(args)]
    ppl.check_inputs(*args, **case.kw)


def with_kvlen(case, b, kvlen):
    """`case` with batch b's kv length set (start_pos = kvlen - seqlen kept)."""
    kvlens = np.diff(case.kvstarts)
    kvlens[b] = kvlen
    case.kvstarts = np.concatenate([[0], np.cumsum(kvlens)]).astype(np.int32)
    case.start_pos = (kvlens - np.diff(case.seqstarts)).astype(np.int32)
    case.max_kvlen = int(kvlens.max())
    return case


@pytest.mark.parametrize("cache_mode", [0, 1])
@pytest.mark.every_case
def test_check_inputs_accepts_valid_steps(cache_mode):
    check_inputs(case_for("check", cache_mode=cache_mode))
    check_inputs(case_for("check2", cache_mode=cache_mode, quant_bit=4, dtype="float16"))


@pytest.mark.parametrize("cache_mode", [0, 1])
@pytest.mark.every_case
def test_check_inputs_rejects_non_monotone_seqstarts(cache_mode):
    case = case_for("check", cache_mode=cache_mode)
    case.seqstarts[1], case.seqstarts[2] = case.seqstarts[2], case.seqstarts[1]
    with pytest.raises(ValueError, match=r"seqstarts"):
        check_inputs(case)


def test_check_inputs_rejects_positions_past_the_page_table():
    """Batch 2 (9 tokens) ending exactly at MaxP * page_size passes; one further fails."""
    room = case_for("check", cache_mode=1).cachestarts.shape[1] * 8
    check_inputs(with_kvlen(case_for("check", cache_mode=1), 2, room))
    with pytest.raises(ValueError, match=r"start_pos|cachestarts|page"):
        check_inputs(with_kvlen(case_for("check", cache_mode=1), 2, room + 1))


def test_check_inputs_rejects_positions_past_the_cache():
    """Batch 2's last token (position kvlen - 1) at row MaxT - 1 passes; at MaxT fails."""
    case = case_for("check", cache_mode=0)
    max_t = case.cache.shape[0]  # layout 0
    case.cachestarts[2] = max_t - KVLENS[2]
    check_inputs(case)
    case.cachestarts[2] += 1
    with pytest.raises(ValueError, match=r"start_pos|cachestarts"):
        check_inputs(case)


def test_check_inputs_rejects_start_pos_other_than_the_cached_keys():
    """The keys are cat(past, current), the past the start_pos cached tokens: kvlen =
    start_pos + seqlen; another start_pos would write the current tokens elsewhere than
    the keys they are read as."""
    case = case_for("check", cache_mode=0)
    case.start_pos[1] -= 1
    with pytest.raises(ValueError, match=re.escape("start_pos + seqlen != kvlen in batches [1]")):
        check_inputs(case)


@pytest.mark.parametrize("cache_mode", [0, 1])
@pytest.mark.every_case
def test_check_inputs_sees_int64_offsets_before_they_wrap(cache_mode):
    """int64 offsets (the definition's type) past int32 would wrap when the op takes them as
    int32 (here back onto a valid row): check_inputs looks at them as given."""
    case = case_for("check", cache_mode=cache_mode)
    args = list(case.args())
    args = [x if i in (8, 9) or x is None else jnp.asarray(x) for i, x in enumerate(args)]
    args[5] = case.cachestarts.astype(np.int64) + 2**32
    with pytest.raises(ValueError, match=r"cachestarts holds values outside int32"):
        ppl.check_inputs(*args, **case.kw)


def test_messages_carry_the_values():
    """Trace-time messages carry the offending value (STYLE.md: `f"{x.shape=}"`)."""
    case = error_case(0)
    with pytest.raises(ValueError, match=r"quant_group=6"):
        trace(case, quant_group=6)
    with pytest.raises(ValueError, match=re.escape(f"cache.shape={case.cache.shape}")):
        trace(case, cache_layout=3)
    bad = S((2, 2, 2, 2), np.int32)
    with pytest.raises(ValueError, match=re.escape("cachestarts.shape=(2, 2, 2, 2)")):
        trace(case, arg_cachestarts=bad)


@pytest.mark.parametrize(
    "implementation, layout", [("pallas", 0), ("pallas", 3), ("xla", 2)], ids=str
)
def test_compiled_step_updates_the_cache_in_place(implementation, layout):
    """The compiled step with cache and scale donated: both come back aliased to their
    inputs, and its temporaries stay far below the scale's size (the cache's is 4x that):
    no per-call transpose or copy of either, whatever the layout."""
    case = case_for("in-place", layout, spare_pages=600, cache_layout=layout, cache_mode=1,
                    quant_bit=8, dtype="float16")  # fmt: skip
    kw = dict(case.kw, implementation=implementation)

    def fn(q, k, v, seqstarts, kvstarts, cachestarts, start_pos, decoding, cache, scale, mask):
        return ppl.multi_head_cache_attention(
            q, k, v, seqstarts, kvstarts, cachestarts, start_pos, decoding, case.max_seqlen,
            case.max_kvlen, cache, scale, mask, **kw,
        )  # fmt: skip

    args = jax_args(case)
    cache, scale = args[8], args[9]
    compiled = jax.jit(fn, donate_argnums=(8, 9)).lower(*args).compile()
    memory = compiled.memory_analysis()
    assert memory.alias_size_in_bytes == cache.nbytes + scale.nbytes
    assert memory.temp_size_in_bytes < scale.nbytes / 2, (memory.temp_size_in_bytes, scale.nbytes)
