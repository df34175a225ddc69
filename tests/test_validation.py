"""Bad input raises ValueError at trace time, naming the argument (and its shape).

Calls go through `jax.eval_shape` with `ShapeDtypeStruct` inputs: no data exists, so any
error is a trace-time one."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest

import jaxattn
from pallas_kernels.flash_prefill import Batch, LogitParams, flash_prefill

S = jax.ShapeDtypeStruct
F32, BF16, I32 = jnp.float32, jnp.bfloat16, jnp.int32
Q, KV = S((2, 8, 4, 32), F32), S((2, 8, 2, 32), F32)  # B=2, T=8, Hq=4, Hkv=2, D=32
PQ, PKV = S((8, 4, 32), F32), S((8, 2, 32), F32)  # packed
CU = S((3,), I32)  # B = 2


def trace(op, *args, **kwargs):
    """`op(*args, **kwargs)` abstractly; ShapeDtypeStruct kwargs are traced, others static."""
    arrays = {n: x for n, x in kwargs.items() if isinstance(x, S)}
    static = {n: x for n, x in kwargs.items() if n not in arrays}
    return jax.eval_shape(lambda a, kw: op(*a, **static, **kw), args, arrays)


def test_valid_calls_trace():
    out = trace(jaxattn.attention, Q, KV, KV, causal=True, bias=S((2, 1, 8, 8), F32))
    assert out.shape == Q.shape
    out, lse = trace(jaxattn.ragged_attention, PQ, PKV, PKV, CU, CU, return_lse=True)
    assert out.shape == PQ.shape and lse.shape == (4, 8)


def _shape(s):
    return re.escape(str(s.shape))


# (id, op args, kwargs, regex the message must match): the argument's name, and its shape.
DENSE_ERRORS = [
    ("q_rank", (S((8, 4, 32), F32), KV, KV), {}, r"q\.shape=\(8, 4, 32\).*rank 4"),
    ("k_rank", (Q, S((2, 8, 2, 32, 1), F32), KV), {}, r"k\.shape=\(2, 8, 2, 32, 1\)"),
    ("heads_not_multiple", (S((2, 8, 6, 32), F32), S((2, 8, 4, 32), F32),
                            S((2, 8, 4, 32), F32)), {},
     r"q\.shape=\(2, 8, 6, 32\).*k\.shape=\(2, 8, 4, 32\).*multiple of num_kv_heads"),
    ("more_kv_heads_than_q", (S((2, 8, 2, 32), F32), S((2, 8, 4, 32), F32),
                              S((2, 8, 4, 32), F32)), {}, r"num_q_heads.*multiple"),
    ("zero_kv_heads", (Q, S((2, 8, 0, 32), F32), S((2, 8, 0, 32), F32)), {}, r"k\.shape"),
    ("head_dim", (Q, S((2, 8, 2, 64), F32), S((2, 8, 2, 64), F32)), {},
     r"q\.shape=\(2, 8, 4, 32\).*k\.shape=\(2, 8, 2, 64\).*head_dim"),
    ("batch", (Q, S((3, 8, 2, 32), F32), S((3, 8, 2, 32), F32)), {}, r"k\.shape.*batch"),
    ("dtype_mix", (Q, S((2, 8, 2, 32), BF16), S((2, 8, 2, 32), BF16)), {},
     r"q\.dtype=.*float32.*k\.dtype=.*bfloat16"),
    ("int_dtype", (S((2, 8, 4, 32), I32), S((2, 8, 2, 32), I32), S((2, 8, 2, 32), I32)), {},
     r"q\.dtype=int32"),
    ("kv_shapes", (Q, KV, S((2, 9, 2, 32), F32)), {},
     r"k\.shape=\(2, 8, 2, 32\).*v\.shape=\(2, 9, 2, 32\)"),
    ("q_lengths_shape", (Q, KV, KV), dict(q_lengths=S((3,), I32)), r"q_lengths\.shape=\(3,\)"),
    ("kv_lengths_dtype", (Q, KV, KV), dict(kv_lengths=S((2,), F32)), r"kv_lengths\.dtype"),
    ("bias_shape", (Q, KV, KV), dict(bias=S((2, 4, 8, 7), F32)),
     r"bias\.shape=\(2, 4, 8, 7\).*\(2, 4, 8, 8\)"),
    ("bias_rank", (Q, KV, KV), dict(bias=S((1, 2, 4, 8, 8), F32)), r"bias\.shape"),
    ("bias_heads", (Q, KV, KV), dict(bias=S((2, 2, 8, 8), F32)), r"bias\.shape=\(2, 2, 8, 8\)"),
    ("bias_dtype", (Q, KV, KV), dict(bias=S((2, 4, 8, 8), I32)), r"bias\.dtype"),
    ("mask_shape", (Q, KV, KV), dict(mask=S((3, 1, 1, 8), jnp.bool_)),
     r"mask\.shape=\(3, 1, 1, 8\)"),
    ("mask_not_bool", (Q, KV, KV), dict(mask=S((2, 4, 8, 8), F32)), r"mask\.dtype=float32"),
    ("mask_int", (Q, KV, KV), dict(mask=S((2, 4, 8, 8), I32)), r"mask\.dtype=int32"),
    ("alibi_shape", (Q, KV, KV), dict(alibi_slopes=S((2,), F32)), r"alibi_slopes\.shape=\(2,\)"),
    ("alibi_rank", (Q, KV, KV), dict(alibi_slopes=S((1, 4), F32)), r"alibi_slopes\.shape"),
    ("window_0", (Q, KV, KV), dict(window=0), r"window=0"),
    ("window_negative", (Q, KV, KV), dict(window=-3), r"window=-3"),
    ("window_fraction", (Q, KV, KV), dict(window=2.5), r"window=2\.5"),
    ("sinks_negative", (Q, KV, KV), dict(sink_tokens=-1), r"sink_tokens=-1"),
    ("sinks_fraction", (Q, KV, KV), dict(sink_tokens=1.5), r"sink_tokens=1\.5"),
    # an "unlimited" window would wrap p - window around in int32: None says no window
    ("window_past_int32", (Q, KV, KV), dict(window=2**31 - 1), r"window=2147483647"),
    ("sinks_past_int32", (Q, KV, KV), dict(sink_tokens=2**31), r"sink_tokens=2147483648"),
    ("soft_cap_0", (Q, KV, KV), dict(soft_cap=0.0), r"soft_cap=0\.0"),
    ("soft_cap_negative", (Q, KV, KV), dict(soft_cap=-5.0), r"soft_cap=-5\.0"),
    ("soft_cap_nan", (Q, KV, KV), dict(soft_cap=float("nan")), r"soft_cap=nan"),
    # inf * tanh(s / inf) = inf * 0 = NaN: rejected rather than returning NaN.
    ("soft_cap_inf", (Q, KV, KV), dict(soft_cap=float("inf")), r"soft_cap=inf"),
    ("scale_nan", (Q, KV, KV), dict(scale=float("nan")), r"scale=nan"),
    ("scale_inf", (Q, KV, KV), dict(scale=float("inf")), r"scale=inf"),
    ("rel_not_relative_bias", (Q, KV, KV), dict(relative_bias=jnp.ones((4, 32))),
     r"relative_bias"),
    ("rel_table_heads", (Q, KV, KV),
     dict(relative_bias=jaxattn.RelativeBias(jnp.ones((2, 32)))),
     r"relative_bias\.table\.shape=\(2, 32\)"),
    ("rel_table_rank", (Q, KV, KV),
     dict(relative_bias=jaxattn.RelativeBias(jnp.ones((4,)))), r"relative_bias\.table\.shape"),
    ("rel_too_few_buckets", (Q, KV, KV),
     dict(relative_bias=jaxattn.RelativeBias(jnp.ones((4, 2)), 8, True)),
     r"relative_bias\.table\.shape=\(4, 2\)"),
    ("rel_max_distance", (Q, KV, KV),
     dict(relative_bias=jaxattn.RelativeBias(jnp.ones((4, 32)), 8, True)),
     r"relative_bias\.max_distance=8"),
    ("implementation_name", (Q, KV, KV), dict(implementation="cuda"), r"implementation='cuda'"),
    ("implementation_in_list", (Q, KV, KV), dict(implementation=["pallas", "triton"]),
     r"implementation=\['pallas', 'triton'\]"),
    ("implementation_empty", (Q, KV, KV), dict(implementation=[]), r"implementation"),
]  # fmt: skip


@pytest.mark.parametrize(
    "args, kwargs, match", [pytest.param(*e[1:], id=e[0]) for e in DENSE_ERRORS]
)
@pytest.mark.every_case
def test_attention_rejects(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        trace(jaxattn.attention, *args, **kwargs)


PACKED_ERRORS = [
    ("q_rank", (Q, PKV, PKV, CU, CU), {}, r"q\.shape=\(2, 8, 4, 32\).*rank 3"),
    ("heads", (S((8, 3, 32), F32), PKV, PKV, CU, CU), {}, r"num_q_heads.*multiple"),
    ("dtype_mix", (PQ, S((8, 2, 32), BF16), S((8, 2, 32), BF16), CU, CU), {}, r"q\.dtype"),
    ("kv_shapes", (PQ, PKV, S((7, 2, 32), F32), CU, CU), {}, r"k\.shape=.*v\.shape=\(7, 2, 32\)"),
    ("cu_mismatch", (PQ, PKV, PKV, S((4,), I32), CU), {},
     r"cu_seqlens_q\.shape=\(4,\).*cu_seqlens_k\.shape=\(3,\)"),
    ("cu_rank", (PQ, PKV, PKV, S((1, 3), I32), S((1, 3), I32)), {}, r"cu_seqlens_q\.shape"),
    ("cu_no_sequence", (PQ, PKV, PKV, S((1,), I32), S((1,), I32)), {},
     r"cu_seqlens_q\.shape=\(1,\)"),
    ("cu_dtype", (PQ, PKV, PKV, S((3,), F32), S((3,), F32)), {}, r"cu_seqlens_q\.dtype"),
    ("bias_shape", (PQ, PKV, PKV, CU, CU), dict(bias=S((4, 8, 9), F32)),
     r"bias\.shape=\(4, 8, 9\)"),
    ("bias_batched", (PQ, PKV, PKV, CU, CU), dict(bias=S((2, 4, 8, 8), F32)),
     r"bias\.shape=\(2, 4, 8, 8\)"),
    ("mask_not_bool", (PQ, PKV, PKV, CU, CU), dict(mask=S((4, 8, 8), F32)), r"mask\.dtype"),
    ("mask_shape", (PQ, PKV, PKV, CU, CU), dict(mask=S((3, 8, 8), jnp.bool_)),
     r"mask\.shape=\(3, 8, 8\)"),
    ("alibi_shape", (PQ, PKV, PKV, CU, CU), dict(alibi_slopes=S((8,), F32)),
     r"alibi_slopes\.shape=\(8,\)"),
    ("window", (PQ, PKV, PKV, CU, CU), dict(window=0), r"window=0"),
    ("implementation", (PQ, PKV, PKV, CU, CU), dict(implementation="XLA"), r"implementation"),
]  # fmt: skip


@pytest.mark.parametrize(
    "args, kwargs, match", [pytest.param(*e[1:], id=e[0]) for e in PACKED_ERRORS]
)
@pytest.mark.every_case
def test_ragged_attention_rejects(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        trace(jaxattn.ragged_attention, *args, **kwargs)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(block_q=24), r"block_q=24"),
        (dict(block_q=8), r"block_q=8"),
        (dict(block_kv=48), r"block_kv=48"),
        (dict(block_kv=0), r"block_kv=0"),
        (dict(num_warps=3), r"num_warps=3"),
        (dict(num_stages=0), r"num_stages=0"),
    ],
    ids=lambda x: "-".join(f"{k}={v}" for k, v in x.items()) if isinstance(x, dict) else None,
)
@pytest.mark.every_case
def test_flash_prefill_config_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        jaxattn.FlashPrefillConfig(**kwargs)


def test_flash_prefill_config_is_hashable_and_frozen():
    a = jaxattn.FlashPrefillConfig(block_q=32, block_kv=16, num_warps=4, num_stages=2)
    assert hash(a) == hash(jaxattn.FlashPrefillConfig(32, 16, 4, 2))
    with pytest.raises(AttributeError):
        a.block_q = 64  # type: ignore[misc]


def test_flash_prefill_config_resolves_unset_tiles():
    """A config built only to choose a backend takes the heuristic's tiles for the shape
    (at D256 the old fixed defaults, 128 x 64 in 3 stages, overflowed an H100's shared
    memory); fields set stay; the kernel refuses a config left unresolved."""
    shape = (4096, 4096, 256, jnp.bfloat16, True)
    want = jaxattn.FlashPrefillConfig.heuristic(*shape)
    got = jaxattn.FlashPrefillConfig(backend="triton").resolve(*shape)
    assert dataclasses.replace(got, backend="auto") == want
    mine = jaxattn.FlashPrefillConfig(block_q=32).resolve(*shape)
    assert (mine.block_q, mine.block_kv, mine.num_stages) == (32, want.block_kv, want.num_stages)
    full = jaxattn.FlashPrefillConfig(32, 16, 4, 2)
    assert full.resolve(*shape) is full
    q = jnp.zeros((1, 16, 1, 16))
    with pytest.raises(ValueError, match="resolve it first"):
        flash_prefill(q, q, q, Batch(), params=LogitParams(), config=jaxattn.FlashPrefillConfig())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.every_case
def test_heuristic_config_is_valid(dtype):
    for q_len in (1, 7, 100, 4096):
        for head_dim in (32, 40, 64, 80, 96, 128, 256):
            cfg = jaxattn.FlashPrefillConfig.heuristic(q_len, q_len, head_dim, jnp.dtype(dtype))
            assert isinstance(cfg, jaxattn.FlashPrefillConfig)


def test_pallas_asks_for_x64_off():
    """The kernels index in int32: with jax's 64-bit mode on, asking for them is a clear
    error (it was a TypeError from inside a kernel); the XLA path runs."""
    q = jax.random.normal(jax.random.key(0), (1, 128, 2, 32), jnp.float32)
    jax.config.update("jax_enable_x64", True)
    try:
        for implementation in ("pallas", ["pallas", "xla"]):
            with pytest.raises(ValueError, match="jax_enable_x64"):
                jaxattn.attention(q, q, q, causal=True, implementation=implementation)
        out = jaxattn.attention(q, q, q, causal=True, implementation="xla")
    finally:
        jax.config.update("jax_enable_x64", False)
    want = jaxattn.attention(q, q, q, causal=True, implementation="xla")
    assert jnp.allclose(out, want, atol=1e-5)


def test_pallas_asks_for_x64_off_when_none_picks_it(monkeypatch):
    """`implementation=None` on a GPU asks for the kernels too: the same clear error (it
    had returned ("pallas", "xla") before the check)."""
    monkeypatch.setattr(jaxattn.dispatch.jax, "default_backend", lambda: "gpu")
    jax.config.update("jax_enable_x64", True)
    try:
        with pytest.raises(ValueError, match="jax_enable_x64"):
            jaxattn.dispatch.resolve_implementations(None)
    finally:
        jax.config.update("jax_enable_x64", False)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(mosaic=jaxattn.MosaicBackwardConfig()), r"mosaic=.*MosaicForwardConfig"),
        (dict(mosaic=(64, 128, 2)), r"mosaic=\(64, 128, 2\)"),
        (dict(backward=jaxattn.MosaicBackwardConfig()), r"backward=.*FlashBackwardConfig"),
        (dict(backward=jaxattn.FlashPrefillConfig()), r"backward=.*FlashBackwardConfig"),
    ],
    ids=["mosaic-backward-tiling", "mosaic-tuple", "backward-mosaic", "backward-prefill"],
)
@pytest.mark.every_case
def test_flash_prefill_config_checks_its_nested_configs(kwargs, match):
    """A tiling of another kernel in `mosaic` / `backward` is rejected where it is built
    (a MosaicBackwardConfig as `mosaic` reached the Hopper forward on sm90)."""
    with pytest.raises(TypeError, match=match):
        jaxattn.FlashPrefillConfig(**kwargs)


@pytest.mark.parametrize("kwargs", [dict(num_warps=4), dict(num_stages=2), dict(num_warps=(4,))])
@pytest.mark.every_case
def test_flash_backward_config_pairs_name_the_field(kwargs):
    """The backward's warps and stages are per-kernel pairs: one int names the fields (it
    failed with "'int' object is not iterable")."""
    with pytest.raises(ValueError, match="num_warps=.*num_stages=.*a pair"):
        jaxattn.FlashBackwardConfig(**kwargs)


def _decode_args(batch):
    cache = jaxattn.PagedKVCache(*(jnp.zeros((4, 2, 16, 32), F32),) * 2)
    return cache, (S((batch, 4, 32), F32), S((batch, 2), I32), S((batch,), I32))


@pytest.mark.parametrize(
    "op, config",
    [
        ("attention", jaxattn.FlashBackwardConfig()),
        ("attention", jaxattn.MosaicForwardConfig()),
        ("paged_decode", jaxattn.FlashPrefillConfig(block_kv=64)),
    ],
    ids=["attention-backward", "attention-mosaic", "paged_decode-prefill"],
)
@pytest.mark.every_case
def test_config_of_another_kernel_names_the_argument(op, config):
    """A tiling of another kernel as `config=` raises a TypeError naming `config` (it
    failed deep inside: "unexpected keyword argument 'lengths'", "no attribute 'mosaic'",
    "no attribute 'query_rows'")."""
    with pytest.raises(TypeError, match=r"config=.*expected a"):
        if op == "attention":
            trace(jaxattn.attention, Q, KV, KV, implementation="pallas", config=config)
        else:
            cache, (q, tables, lens) = _decode_args(2)
            fn = lambda q, t, n: jaxattn.paged_decode(q, cache, t, n, config=config)  # noqa: E731
            jax.eval_shape(fn, q, tables, lens)


def test_paged_attention_config_checks_its_parts():
    """PagedAttentionConfig takes the two kernels' own tilings, and a forced Hopper
    prefill (context rows over a paged cache run on the Triton kernel alone) is an error,
    not silently ignored."""
    with pytest.raises(TypeError, match="prefill=.*FlashPrefillConfig"):
        jaxattn.PagedAttentionConfig(prefill=jaxattn.PagedDecodeConfig())
    with pytest.raises(TypeError, match="decode=.*PagedDecodeConfig"):
        jaxattn.PagedAttentionConfig(decode=jaxattn.FlashPrefillConfig())
    with pytest.raises(ValueError, match="backend='mosaic'"):
        jaxattn.PagedAttentionConfig(prefill=jaxattn.FlashPrefillConfig(backend="mosaic"))


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
@pytest.mark.every_case
def test_paged_decode_empty_batch(implementation):
    """B = 0: empty outputs from either implementation (the kernel's tiling heuristic
    divided by zero programs)."""
    cache, _ = _decode_args(0)
    q = jnp.zeros((0, 4, 32), F32)
    tables, lens = jnp.zeros((0, 2), I32), jnp.zeros((0,), I32)
    out, lse = jaxattn.paged_decode(
        q, cache, tables, lens, return_lse=True, implementation=implementation
    )
    assert out.shape == (0, 4, 32) and lse.shape == (0, 4)
    assert jaxattn.PagedDecodeConfig.heuristic(0, 8, 4096, 16, 132).num_splits >= 1


@pytest.mark.parametrize("option", ["scale", "soft_cap"])
@pytest.mark.every_case
def test_traced_scale_or_soft_cap_names_the_argument(option):
    """A learnable temperature under jax.grad is traced: a TypeError naming it (it was a
    bare TracerBoolConversionError)."""
    q = jnp.ones((1, 8, 2, 16), F32)
    call = lambda t: jnp.sum(jaxattn.attention(q, q, q, **{option: t}))  # noqa: E731
    with pytest.raises(TypeError, match=f"{option} is traced"):
        jax.grad(call)(jnp.float32(0.5))


def test_alibi_slopes_as_a_list():
    """A Python list of slopes is taken (it raised "'list' object has no attribute
    'shape'"), and a wrong-length one names the argument."""
    q = jnp.ones((1, 8, 2, 16), F32)
    out = jaxattn.attention(q, q, q, alibi_slopes=[0.5, 0.25], implementation="xla")
    assert out.shape == q.shape
    with pytest.raises(ValueError, match=r"alibi_slopes.shape=\(3,\)"):
        jaxattn.attention(q, q, q, alibi_slopes=[0.5, 0.25, 0.1])
