"""The kernels lower to Triton for CUDA, checked on any machine (CI has no GPU).

Interpret mode runs the kernel's jaxpr, not its Triton lowering, so a construct that
lowers badly (an i1/i32 mix, a double indexer) would pass the CPU suite and fail only on
a GPU. Lowering for the "cuda" platform runs the real Triton lowering without a device.
(Compilation by Triton — shared memory, registers — still needs `make test-gpu`.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import jaxattn

B, TQ, TK, HQ, HKV = 2, 100, 120, 8, 2
LENGTHS = jax.ShapeDtypeStruct((B,), jnp.int32)


def _spec(shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


def _rel(bidirectional):
    return jaxattn.RelativeBias(jnp.zeros((HQ, 32), jnp.float32), 128, bidirectional)


# Options given as arrays are passed as traced arguments (shape specs), the rest statically.
DENSE = {
    "plain": {},
    "causal": dict(causal=True),
    "window": dict(window=17),
    "window_sinks_causal": dict(window=17, sink_tokens=3, causal=True),
    "lengths": dict(causal=True, q_lengths=LENGTHS, kv_lengths=LENGTHS),
    "alibi_softcap": dict(alibi_slopes=_spec((HQ,), jnp.float32), soft_cap=30.0),
    "bias_full": dict(bias=_spec((B, HQ, TQ, TK), jnp.float32)),
    "bias_keys": dict(bias=_spec((B, 1, 1, TK), jnp.bfloat16)),
    "mask_rows": dict(mask=_spec((1, HQ, TQ, 1), jnp.bool_), causal=True),
    "t5_bidirectional": dict(relative_bias=_rel(True)),
    "t5_causal": dict(relative_bias=_rel(False), causal=True),
    "lse": dict(causal=True, return_lse=True),
    "cross": dict(scale=0.1),
}  # fmt: skip


def _lower(fn, *args):
    return fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.fixture(autouse=True)
def compiled_kernels(monkeypatch):
    monkeypatch.setenv("JAXATTN_INTERPRET", "0")


def _split(options):
    arrays = {k: v for k, v in options.items() if isinstance(v, jax.ShapeDtypeStruct)}
    static = {k: v for k, v in options.items() if k not in arrays}
    return arrays, static


@pytest.mark.parametrize("name", DENSE)
@pytest.mark.parametrize(
    "head_dim, dtype", [(128, jnp.bfloat16), (80, jnp.float16), (64, jnp.float32)]
)
@pytest.mark.every_case
def test_dense_lowers_to_triton(name, head_dim, dtype):
    arrays, static = _split(DENSE[name])
    fn = jax.jit(
        lambda q, k, v, arrays: jaxattn.attention(
            q, k, v, implementation="pallas", **static, **arrays
        )
    )
    text = _lower(
        fn,
        _spec((B, TQ, HQ, head_dim), dtype),
        _spec((B, TK, HKV, head_dim), dtype),
        _spec((B, TK, HKV, head_dim), dtype),
        arrays,
    )
    assert "triton" in text


@pytest.mark.parametrize(
    "options",
    [dict(causal=True), dict(causal=True, window=33, sink_tokens=4, return_lse=True),
     dict(bias=_spec((HQ, 300, 300), jnp.float32), alibi_slopes=_spec((HQ,), jnp.float32))],
    ids=["causal", "window_sinks_lse", "bias_alibi"],
)  # fmt: skip
def test_packed_lowers_to_triton(options):
    arrays, static = _split(options)
    fn = jax.jit(
        lambda q, k, v, cu, arrays: jaxattn.ragged_attention(
            q, k, v, cu, cu, implementation="pallas", **static, **arrays
        )
    )
    text = _lower(
        fn,
        _spec((300, HQ, 128)),
        _spec((300, HKV, 128)),
        _spec((300, HKV, 128)),
        _spec((5,), jnp.int32),
        arrays,
    )
    assert "triton" in text


@pytest.mark.parametrize("name", DENSE)
@pytest.mark.parametrize("head_dim, dtype", [(128, jnp.bfloat16), (80, jnp.float32)])
def test_dense_gradient_lowers_to_triton(name, head_dim, dtype):
    """The backward kernels (dK/dV, dQ and the extras' gradients) lower too."""
    arrays, static = _split(DENSE[name])
    rel = static.pop("relative_bias", None)
    if rel is not None:
        arrays["table"] = _spec(rel.table.shape, jnp.float32)

    def loss(q, k, v, arrays):
        arrays = dict(arrays)
        if "table" in arrays:
            table = arrays.pop("table")
            arrays["relative_bias"] = jaxattn.RelativeBias(table, rel.max_distance,
                                                           rel.bidirectional)  # fmt: skip
        out = jaxattn.attention(q, k, v, implementation="pallas", **static, **arrays)
        out = out[0] if isinstance(out, tuple) else out
        return jnp.sum(out.astype(jnp.float32))

    float_arrays = {n: a for n, a in arrays.items() if a.dtype != jnp.int32 and n != "mask"}
    fn = jax.jit(
        jax.grad(lambda q, k, v, f, rest: loss(q, k, v, {**f, **rest}), argnums=(0, 1, 2, 3))
    )
    rest = {n: a for n, a in arrays.items() if n not in float_arrays}
    q = _spec((B, TQ, HQ, head_dim), dtype)
    kv = _spec((B, TK, HKV, head_dim), dtype)
    text = _lower(fn, q, kv, kv, float_arrays, rest)
    assert "flash_backward_dq" in text and "flash_backward_dkdv" in text


def test_packed_gradient_lowers_to_triton():
    def loss(q, k, v, cu, bias):
        out = jaxattn.ragged_attention(q, k, v, cu, cu, causal=True, bias=bias, window=33,
                                       sink_tokens=4, implementation="pallas")  # fmt: skip
        return jnp.sum(out.astype(jnp.float32))

    fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 4)))
    text = _lower(
        fn,
        _spec((300, HQ, 128)),
        _spec((300, HKV, 128)),
        _spec((300, HKV, 128)),
        _spec((5,), jnp.int32),
        _spec((HQ, 300, 300), jnp.float32),
    )
    assert "flash_backward_dq" in text and "flash_backward_dkdv" in text


def test_interpret_override_is_respected():
    """The env switch is what the tests above rely on: it must reach the kernel."""
    from pallas_kernels.common import use_interpret

    assert use_interpret() is False


@pytest.mark.parametrize("page_size", [8, 16, 128])
@pytest.mark.parametrize(
    "options",
    [{}, dict(window=100, sink_tokens=4, soft_cap=30.0), dict(alibi_slopes=_spec((32,)))],
    ids=["plain", "window_sinks_softcap", "alibi"],
)  # fmt: skip
@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.every_case
def test_paged_decode_lowers_to_triton(page_size, options, num_splits):
    arrays, static = _split(options)
    config = jaxattn.PagedDecodeConfig(block_kv=64, num_splits=num_splits)
    fn = jax.jit(
        lambda q, cache, tables, lengths, arrays: jaxattn.paged_decode(
            q, cache, tables, lengths, implementation="pallas", config=config, **static, **arrays
        )
    )
    pages = _spec((64, 8, page_size, 128))
    text = _lower(
        fn,
        _spec((4, 32, 128)),
        jaxattn.PagedKVCache(pages, pages),
        _spec((4, 2048 // page_size), jnp.int32),
        _spec((4,), jnp.int32),
        arrays,
    )
    assert "triton" in text


@pytest.mark.parametrize(
    "quant",
    [
        jaxattn.KVQuant("int8"),
        jaxattn.KVQuant("float8_e4m3fn"),
        jaxattn.KVQuant("int4"),
        jaxattn.KVQuant("int8", "group"),
        jaxattn.KVQuant("int4", "group", 32),
        jaxattn.KVQuant("float8_e4m3fn", "group", 64),
    ],
    ids=str,
)
@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.every_case
def test_quantized_paged_decode_lowers_to_triton(quant, num_splits):
    config = jaxattn.PagedDecodeConfig(block_kv=64, num_splits=num_splits)
    fn = jax.jit(
        lambda q, cache, tables, lengths: jaxattn.paged_decode(
            q, cache, tables, lengths, implementation="pallas", config=config
        )
    )
    head_dim = 128
    shape = (64, 8, 16, quant.packed_dim(head_dim))
    if quant.granularity == "tensor":
        scales = (_spec((), jnp.float32),) * 2
    else:
        scales = (_spec((64, 8, 16, quant.num_groups(head_dim)), jnp.bfloat16),) * 2
    pages = _spec(shape, quant.storage_dtype)
    text = _lower(
        fn,
        _spec((4, 32, head_dim)),
        jaxattn.PagedKVCache(pages, pages, *scales, quant=quant),
        _spec((4, 128), jnp.int32),
        _spec((4,), jnp.int32),
    )
    assert "triton" in text


@pytest.mark.parametrize(
    "quant",
    [jaxattn.KVQuant("int8", "group", 8), jaxattn.KVQuant("float8_e4m3fn"),
     jaxattn.KVQuant("int4", "group", 16), jaxattn.KVQuant("int4", "group", 32)],
    ids=str,
)  # fmt: skip
@pytest.mark.parametrize("q_dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("read", ["codes", "words", "stacked", "k_words"])
def test_v_words_lower_to_triton(quant, q_dtype, read):
    """V read as words (PTX for bf16 queries, shifts and casts for the others) or as codes;
    group scales per value or through stacked rows (`paged_decode.stacked`); INT4 K read
    as half-words too (`k_words`; other formats ignore it)."""
    config = jaxattn.PagedDecodeConfig(
        block_kv=64, num_splits=2, v_words=read != "codes", stacked=read == "stacked",
        query_rows=4 if read == "stacked" else 16, k_words=read == "k_words",
    )  # fmt: skip
    fn = jax.jit(
        lambda q, cache, tables, lengths: jaxattn.paged_decode(
            q, cache, tables, lengths, implementation="pallas", config=config
        )
    )
    head_dim = 128
    stored_dim = head_dim // 2 if quant.dtype == "int4" else head_dim
    pages = _spec((64, 8, 16, stored_dim), quant.storage_dtype)
    if quant.granularity == "tensor":
        scales = (_spec((), jnp.float32),) * 2
    else:
        scales = (_spec((64, 8, 16, quant.num_groups(head_dim)), jnp.bfloat16),) * 2
    cache = jaxattn.PagedKVCache(pages, pages, *scales, quant=quant)
    text = _lower(fn, _spec((4, 32, head_dim), q_dtype), cache, _spec((4, 128), jnp.int32),
                  _spec((4,), jnp.int32))  # fmt: skip
    assert "triton" in text


def _meta_spec(num_tokens, num_seqs, max_pages, ring=None, decode_only=False):
    i32 = lambda *shape: _spec(shape, jnp.int32)  # noqa: E731
    return jaxattn.AttentionMetadata(
        cu_seqlens_q=i32(num_seqs + 1),
        context_lens=i32(num_seqs),
        block_tables=i32(num_seqs, max_pages),
        positions=i32(num_tokens),
        slot_mapping=i32(num_tokens),
        seq_ids=i32(num_seqs),
        ring=ring,
        decode_only=decode_only,
    )


@pytest.mark.parametrize(
    "quant",
    [None, jaxattn.KVQuant("int8"), jaxattn.KVQuant("int4", "group", 32),
     jaxattn.KVQuant("float8_e4m3fn", "group")],
    ids=str,
)  # fmt: skip
@pytest.mark.parametrize(
    "options",
    [{}, dict(window=100, sink_tokens=4, ring=(16, 112)),
     dict(relative_bias=jaxattn.RelativeBias(jnp.zeros((32, 32), jnp.float32), 128, False)),
     dict(alibi_slopes=_spec((32,), jnp.float32), soft_cap=30.0, return_lse=True),
     dict(window=100, sink_tokens=4, ring=(16, 112), rope_on_read=True,
          rope=jaxattn.RoPE(theta=500000.0, rotary_dim=64, scaling=jaxattn.Llama3Scaling(8.0))),
     dict(decode_only=True, soft_cap=30.0, return_lse=True,
          rope=jaxattn.RoPE(theta=500000.0, style="gptj", rotary_dim=64)),
     dict(config=jaxattn.PagedAttentionConfig(gather_tokens=128, gather_min_tokens=16))],
    ids=["plain", "window_ring", "t5", "alibi_softcap_lse", "rope_on_read_ring", "decode_only",
         "history_gather"],
)  # fmt: skip
def test_paged_attention_lowers_to_triton(quant, options):
    """Both kernels of a serving step: the flash kernel reading a paged (quantized,
    possibly cyclic) prefix, and the decode kernel; with rope_on_read, both rotate on
    read (StreamingLLM). A decode-only plan: the decode kernel alone, rotating q on load
    (and over a plain cache k, which it writes itself: no XLA scatter).
    History gather: the copy kernel (dequantizing) and the packed flash launch too."""
    options = dict(options)
    ring = options.pop("ring", None)
    decode_only = options.pop("decode_only", False)
    arrays, static = _split(options)
    head_dim, page_size, num_pages = 128, 16, 64
    fn = jax.jit(
        lambda q, k, v, cache, meta, arrays: jaxattn.paged_attention(
            q, k, v, cache, meta, implementation="pallas", **static, **arrays
        )
    )
    if quant is None:
        pages, scales = _spec((num_pages, 8, page_size, head_dim)), ()
    else:
        pages = _spec((num_pages, 8, page_size, quant.packed_dim(head_dim)), quant.storage_dtype)
        if quant.granularity == "tensor":
            scales = (_spec((), jnp.float32),) * 2
        else:
            shape = (num_pages, 8, page_size, quant.num_groups(head_dim))
            scales = (_spec(shape, jnp.bfloat16),) * 2
    text = _lower(
        fn,
        _spec((96, 32, head_dim)),
        _spec((96, 8, head_dim)),
        _spec((96, 8, head_dim)),
        jaxattn.PagedKVCache(pages, pages, *scales, quant=quant),
        _meta_spec(96, 8, 8, ring, decode_only),
        arrays,
    )
    assert "triton" in text
    if decode_only:  # the decode kernel alone; over a plain cache it writes k/v itself
        assert text.count('name = "paged_decode"') == 1
        assert ("stablehlo.scatter" in text) == (quant is not None)
    if "config" in options:  # the copy kernel, then the flash kernel's two launches
        # (A kernel's name appears in its source locations too: count the launches' names.)
        launches = {k: text.count(f'name = "{k}"') for k in ("history_gather", "flash_prefill")}
        assert launches == {"history_gather": 1, "flash_prefill": 2}, launches


def test_decode_step_on_a_fused_projection_lowers_to_triton():
    """`paged_attention_qkv` in a decode-only plan: one kernel reads q, k and v from the
    projection at their head offsets, rotates q and k and writes k/v (no scatter)."""
    fn = jax.jit(
        lambda qkv, cache, meta: jaxattn.paged_attention_qkv(
            qkv, cache, meta, num_q_heads=32, num_kv_heads=8, implementation="pallas",
            rope=jaxattn.RoPE(theta=500000.0),
        )
    )  # fmt: skip
    pages = _spec((64, 8, 16, 128))
    text = _lower(fn, _spec((96, 48 * 128)), jaxattn.PagedKVCache(pages, pages),
                  _meta_spec(96, 96, 8, decode_only=True))  # fmt: skip
    assert text.count('name = "paged_decode"') == 1 and "stablehlo.scatter" not in text


# FP8 output (out_dtype=float8_e4m3fn): the quantizing epilogues lower (Triton's RTNE
# float32 -> e4m3 conversion), and the op's result is an f8E4M3FN array. out_scale is traced.
FP8 = dict(out_dtype=jnp.float8_e4m3fn)
OUT_SCALE = _spec((), jnp.float32)


def _assert_fp8_triton(text):
    assert "triton" in text and "f8E4M3FN" in text


@pytest.fixture
def fp8_kernels():
    """On a GPU older than sm_89 the ops refuse fp8 output from the kernels (Triton
    cannot convert to e4m3 there): nothing to lower."""
    try:
        jaxattn.validation.check_fp8_kernel_output()
    except NotImplementedError as e:
        pytest.skip(str(e))


@pytest.mark.parametrize(
    "options",
    [dict(causal=True, q_lengths=LENGTHS, kv_lengths=LENGTHS),
     dict(causal=True, window=17, alibi_slopes=_spec((HQ,), jnp.float32), return_lse=True)],
    ids=["lengths", "window_alibi_lse"],
)  # fmt: skip
@pytest.mark.usefixtures("fp8_kernels")
def test_fp8_output_dense_lowers_to_triton(options):
    arrays, static = _split(options)
    fn = jax.jit(
        lambda q, k, v, s, arrays: jaxattn.attention(
            q, k, v, implementation="pallas", out_scale=s, **FP8, **static, **arrays
        )
    )
    kv = _spec((B, TK, HKV, 128))
    _assert_fp8_triton(_lower(fn, _spec((B, TQ, HQ, 128)), kv, kv, OUT_SCALE, arrays))


@pytest.mark.usefixtures("fp8_kernels")
def test_fp8_output_packed_lowers_to_triton():
    fn = jax.jit(
        lambda q, k, v, cu, s: jaxattn.ragged_attention(
            q, k, v, cu, cu, causal=True, implementation="pallas", out_scale=s, **FP8
        )
    )
    kv = _spec((300, HKV, 128))
    text = _lower(fn, _spec((300, HQ, 128)), kv, kv, _spec((5,), jnp.int32), OUT_SCALE)
    _assert_fp8_triton(text)


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.usefixtures("fp8_kernels")
def test_fp8_output_paged_decode_lowers_to_triton(num_splits):
    config = jaxattn.PagedDecodeConfig(block_kv=64, num_splits=num_splits)
    fn = jax.jit(
        lambda q, cache, tables, lengths, s: jaxattn.paged_decode(
            q, cache, tables, lengths, implementation="pallas", config=config,
            window=100, out_scale=s, **FP8,
        )
    )  # fmt: skip
    pages = _spec((64, 8, 16, 128))
    text = _lower(
        fn,
        _spec((4, 32, 128)),
        jaxattn.PagedKVCache(pages, pages),
        _spec((4, 128), jnp.int32),
        _spec((4,), jnp.int32),
        OUT_SCALE,
    )
    _assert_fp8_triton(text)


@pytest.mark.parametrize("quant", [None, jaxattn.KVQuant("float8_e4m3fn")], ids=str)
@pytest.mark.usefixtures("fp8_kernels")
def test_fp8_output_paged_attention_lowers_to_triton(quant):
    head_dim, page_size, num_pages = 128, 16, 64
    fn = jax.jit(
        lambda q, k, v, cache, meta, s: jaxattn.paged_attention(
            q, k, v, cache, meta, implementation="pallas", return_lse=True,
            out_scale=s, **FP8,
        )
    )  # fmt: skip
    shape = (num_pages, 8, page_size, head_dim)
    if quant is None:
        cache = jaxattn.PagedKVCache(_spec(shape), _spec(shape))
    else:
        pages = _spec(shape, quant.storage_dtype)
        scales = (_spec((), jnp.float32),) * 2
        cache = jaxattn.PagedKVCache(pages, pages, *scales, quant=quant)
    text = _lower(
        fn,
        _spec((96, 32, head_dim)),
        _spec((96, 8, head_dim)),
        _spec((96, 8, head_dim)),
        cache,
        _meta_spec(96, 8, 8),
        OUT_SCALE,
    )
    _assert_fp8_triton(text)


@pytest.mark.parametrize("layout", [0, 1, 2, 3])
@pytest.mark.parametrize(
    "quant_bit, options",
    [(0, dict(cache_mode=0)), (8, dict(cache_mode=1, is_alibi=True)),
     (4, dict(cache_mode=1, attn_mask=True))],
    ids=["plain-offsets", "int8-pages-alibi", "int4-pages-mask"],
)  # fmt: skip
def test_ppl_op_lowers_to_triton(layout, quant_bit, options):
    """OpenPPL's op: both kernels read the layer-stacked cache of each layout in place
    (and the unmasked second flash launch of decoding batches: causal steps); with a
    mask, the flash kernel alone."""
    from jaxattn import ppl
    from jaxattn.ppl.cache import PPLCache

    options = dict(options)
    mask = options.pop("attn_mask", False)
    head_dim, max_t, tokens = 128, 4096, 96
    spec = PPLCache(2, 1, 8, head_dim, quant_bit, 8, options["cache_mode"], layout, 16)
    cache = _spec(spec.shape(max_t, head_dim // 2 if quant_bit == 4 else head_dim),
                  {0: jnp.bfloat16, 8: jnp.int8, 4: jnp.uint8}[quant_bit])  # fmt: skip
    scale = _spec(spec.shape(max_t, head_dim // 8), jnp.float16) if quant_bit else None
    starts = _spec((9,), jnp.int32)
    cachestarts = _spec((8,) if options["cache_mode"] == 0 else (8, 32), jnp.int32)

    def fn(q, k, v, seqstarts, kvstarts, cachestarts, start_pos, decoding, cache, scale, mask):
        return ppl.multi_head_cache_attention(
            q, k, v, seqstarts, kvstarts, cachestarts, start_pos, decoding, 64, 512, cache,
            scale, mask, num_heads=32, num_kv_heads=8, head_dim=head_dim, is_causal=True,
            num_layer=2, layer_idx=1, quant_bit=quant_bit, cache_layout=layout, page_size=16,
            implementation="pallas", **options,
        )  # fmt: skip

    text = _lower(
        jax.jit(fn),
        _spec((tokens, 32, head_dim), jnp.float16),
        _spec((tokens, 8, head_dim), jnp.float16),
        _spec((tokens, 8, head_dim), jnp.float16),
        starts,
        starts,
        cachestarts,
        _spec((8,), jnp.int32),
        _spec((), jnp.int32),
        cache,
        scale,
        _spec((tokens, 4096), jnp.float16) if mask else None,
    )
    launches = {k: text.count(f'name = "{k}"') for k in ("paged_decode", "flash_prefill")}
    assert launches == {"paged_decode": 0 if mask else 1, "flash_prefill": 2}, launches
