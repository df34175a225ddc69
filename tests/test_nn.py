"""Flax modules: `jaxattn.nn.Attention` and `jaxattn.models.Llama`.

Full mode against a float64 numpy transcription of the layer (projections, QK-norm, RoPE,
GQA, causal + window + lengths mask); fused and unfused QKV with the same weights; grads
through both implementations of `jaxattn.attention`. Serving mode (`jaxattn.paged_attention`
over a paged cache) against full mode: prompts processed in chunks through steps that mix
context and generation rows, then decode tokens, give every token the output (module) or
logits (model) full mode gives it.

Modules are built with `nnx.eval_shape` and filled with fresh random weights (eager
initialisation compiles every initializer: seconds on CPU).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import util
from flax import nnx

import jaxattn
from jaxattn.models import Llama, LlamaConfig
from jaxattn.nn import Attention

impls = pytest.mark.parametrize("impl", util.IMPLEMENTATIONS)

D_MODEL, HQ, HKV = 64, 4, 2
D = util.DEFAULT_HEAD_DIM  # 32 on CPU
THETA, EPS = 10000.0, 1e-6
TOL = util.F32_TOL
# Both implementations' backward passes recompute through the reference; only the forward
# outputs (which the o_proj grads read) differ by the kernel's rounding.
GRAD_TOL = dict(rtol=1e-4, atol=1e-4) if util.ON_GPU else dict(rtol=1e-4, atol=1e-5)


@pytest.fixture(autouse=True)
def float32_matmuls():
    """Full float32 projections (a GPU's default is TF32, ~1e-3 relative)."""
    with jax.default_matmul_precision("highest"):
        yield


def randomize(module, seed: int, scale: float = 0.2):
    """Every Param drawn fresh: N(0, scale^2), norm scales 1 + N(0, scale^2)."""
    rng = util.rng_for("randomize", seed)
    for path, node in nnx.iter_graph(module):
        if isinstance(node, nnx.Param):
            shape = node.get_value().shape
            value = scale * rng.standard_normal(shape) + (path[-1] == "scale")
            node.set_value(jnp.asarray(value, jnp.float32))
    return module


def make_attention(seed: int = 0, num_kv_heads: int = HKV, **kwargs) -> Attention:
    """An `Attention` (RoPE at THETA unless `rope=` says otherwise) with random weights."""
    opts = dict(rope=jaxattn.RoPE(THETA), norm_eps=EPS) | kwargs
    shell = nnx.eval_shape(
        lambda: Attention(D_MODEL, HQ, num_kv_heads, D, **opts, rngs=nnx.Rngs(0))
    )
    return randomize(shell, seed)


def params_np(module) -> dict:
    """The module's params as nested dicts of float64 numpy arrays."""
    pure = nnx.state(module, nnx.Param).to_pure_dict()
    return jax.tree.map(util.f64, pure)


@nnx.jit
def full(module, x, lengths):
    return module(x, q_lengths=lengths)


# ------------------------------------------------------------------ float64 oracle
def rms_np(y, scale):
    return y / np.sqrt(np.mean(y**2, -1, keepdims=True) + EPS) * scale


def rope_np(y):
    """Llama's rotate_half RoPE of y `[B, T, H, D]` at positions 0..T-1."""
    angle = np.arange(y.shape[1])[:, None] * THETA ** (-np.arange(0, D, 2) / D)  # [T, D/2]
    cos, sin = (np.concatenate([f(angle)] * 2, -1)[:, None] for f in (np.cos, np.sin))
    return y * cos + np.concatenate([-y[..., D // 2 :], y[..., : D // 2]], -1) * sin


def attention_np(module, x, lengths):
    """The layer written out in numpy float64 (x `[B, T, d_model]`, right-padded)."""
    p, batch, t = params_np(module), x.shape[0], x.shape[1]
    hq, hkv, window = module.num_q_heads, module.num_kv_heads, module.options["window"]

    def linear(name, h):
        return h @ p[name]["kernel"] + p[name].get("bias", 0.0)

    def heads(y, n):
        return y.reshape(batch, t, n, D)

    q = heads(linear("q_proj", x), hq)
    k, v = heads(linear("k_proj", x), hkv), heads(linear("v_proj", x), hkv)
    if module.q_norm is not None:
        q, k = rms_np(q, p["q_norm"]["scale"]), rms_np(k, p["k_norm"]["scale"])
    if module.rope is not None:
        q, k = rope_np(q), rope_np(k)
    k, v = np.repeat(k, hq // hkv, axis=2), np.repeat(v, hq // hkv, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D)
    i = np.arange(t)
    visible = (i[None, :] <= i[:, None]) & (i[None, None, :] < lengths[:, None, None])
    if window is not None:
        visible &= i[None, :] > i[:, None] - window
    s = np.where(visible[:, None], s, -np.inf)
    with np.errstate(invalid="ignore"):  # rows with no visible key: NaN, zeroed below
        w = np.exp(s - s.max(-1, keepdims=True))
        out = np.einsum("bhqk,bkhd->bqhd", w / w.sum(-1, keepdims=True), v)
    out = np.where((i[None, :] < lengths[:, None])[..., None, None], out, 0.0)
    return linear("o_proj", out.reshape(batch, t, hq * D))


def inputs(seed, batch=2, t=13, lengths=(13, 8)):
    rng = util.rng_for("inputs", seed)
    return util.randn(rng, (batch, t, D_MODEL)), jnp.asarray(lengths, jnp.int32)


# ------------------------------------------------------------------ full mode
def test_parameter_and_output_shapes():
    unfused = make_attention(qk_norm=True, qkv_bias=True)
    fused = make_attention(fused_qkv=True, out_bias=True)
    shapes = lambda m: jax.tree.map(np.shape, params_np(m))  # noqa: E731
    assert shapes(unfused) == {
        "q_proj": {"kernel": (D_MODEL, HQ * D), "bias": (HQ * D,)},
        "k_proj": {"kernel": (D_MODEL, HKV * D), "bias": (HKV * D,)},
        "v_proj": {"kernel": (D_MODEL, HKV * D), "bias": (HKV * D,)},
        "o_proj": {"kernel": (HQ * D, D_MODEL)},
        "q_norm": {"scale": (D,)},
        "k_norm": {"scale": (D,)},
    }
    assert shapes(fused) == {
        "qkv_proj": {"kernel": (D_MODEL, (HQ + 2 * HKV) * D)},
        "o_proj": {"kernel": (HQ * D, D_MODEL), "bias": (D_MODEL,)},
    }
    x, lengths = inputs(0)
    assert full(fused, x, lengths).shape == x.shape


FULL_CASES = {
    "gqa_rope_qknorm_bias": dict(qk_norm=True, qkv_bias=True, out_bias=True),
    "mqa_window_norope": dict(num_kv_heads=1, rope=None, window=5),
}


@pytest.mark.parametrize("case", list(FULL_CASES))
def test_full_mode_matches_numpy(case):
    module = make_attention(seed=1, **FULL_CASES[case])
    x, lengths = inputs(1)
    want = attention_np(module, util.f64(x), np.asarray(lengths))
    got = util.f64(full(module, x, lengths))
    valid = np.arange(x.shape[1]) < np.asarray(lengths)[:, None]
    np.testing.assert_allclose(got[valid], want[valid], **TOL)


def test_dynamic_ntk_full_mode_ignores_the_padding_width():
    """Full mode's default positions take DynamicNTKScaling's length from q_lengths: the
    real tokens' logits do not change with the right-padding (it had taken the padded
    width, 32, for a 6-token sequence)."""
    scaling = jaxattn.DynamicNTKScaling(factor=8.0, original_max_position_embeddings=8)
    config = LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2, num_q_heads=4,
        num_kv_heads=2, head_dim=8, rope_scaling=scaling,
    )  # fmt: skip
    model = Llama(config, rngs=nnx.Rngs(0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(1, 96, (1, 6)), jnp.int32)
    n = jnp.asarray([6])
    run = nnx.jit(lambda m, t: m(t, q_lengths=n))  # eager, op by op, took 4x as long
    with jax.default_matmul_precision("highest"):
        unpadded = np.asarray(run(model, tokens))
        padded = np.asarray(run(model, jnp.pad(tokens, ((0, 0), (0, 26)))))[:, :6]
    np.testing.assert_allclose(padded, unpadded, rtol=1e-5, atol=1e-5)


def test_dynamic_ntk_explicit_positions_take_each_rows_length():
    """With explicit positions too, DynamicNTKScaling takes each row's length from its
    real tokens: the positions the default would use give the default's output, however
    wide the padding and whatever the other rows (the call's max position + 1 had been
    taken, padding and other rows included)."""
    scaling = jaxattn.DynamicNTKScaling(factor=8.0, original_max_position_embeddings=4)
    module = make_attention(rope=jaxattn.RoPE(scaling=scaling))
    run = nnx.jit(lambda m, x, n, pos: m(x, q_lengths=n, positions=pos))
    x = jnp.asarray(util.rng_for("ntk positions").standard_normal((2, 16, D_MODEL)), jnp.float32)
    six = jnp.asarray([6])
    alone = np.asarray(full(module, x[:1, :6], six))
    for width in (6, 16):
        got = run(module, x[:1, :width], six, jnp.arange(width))
        np.testing.assert_allclose(np.asarray(got)[:, :6], alone, **TOL)
    rows = jnp.broadcast_to(jnp.arange(16), (2, 16))
    beside = run(module, x, jnp.asarray([6, 16]), rows)
    np.testing.assert_allclose(np.asarray(beside)[:1, :6], alone, **TOL)


def test_fused_qkv_equals_unfused():
    unfused = make_attention(qk_norm=True, qkv_bias=True)
    fused = make_attention(seed=1, fused_qkv=True, qk_norm=True, qkv_bias=True)
    p = nnx.state(unfused, nnx.Param).to_pure_dict()
    proj = [p[f"{n}_proj"] for n in "qkv"]
    fused.qkv_proj.kernel.set_value(jnp.concatenate([w["kernel"] for w in proj], axis=1))
    fused.qkv_proj.bias.set_value(jnp.concatenate([w["bias"] for w in proj]))
    fused.o_proj.kernel.set_value(p["o_proj"]["kernel"])
    fused.q_norm.scale.set_value(p["q_norm"]["scale"])
    fused.k_norm.scale.set_value(p["k_norm"]["scale"])
    x, lengths = inputs(2)
    np.testing.assert_allclose(full(fused, x, lengths), full(unfused, x, lengths), **TOL)


def test_grads_match_across_implementations():
    """jax.grad through full mode w.r.t. x and every parameter: pallas == xla."""
    x, lengths = inputs(3, t=20, lengths=(20, 11))
    w = util.randn(util.rng_for("grad weights"), x.shape)

    def grads(impl):
        fn = functools.partial(jaxattn.attention, implementation=impl, config=util.kernel_config())
        module = make_attention(seed=3, qk_norm=True, qkv_bias=True, attention_fn=fn)
        graphdef, params = nnx.split(module)

        def loss(params, x):
            return jnp.sum(nnx.merge(graphdef, params)(x, q_lengths=lengths) * w)

        return jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x)

    want, got = grads("xla"), grads("pallas")
    for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        assert np.isfinite(np.asarray(g)).all(), path
        np.testing.assert_allclose(g, r, **GRAD_TOL, err_msg=str(path))


def test_bad_calls_name_the_problem():
    with pytest.raises(ValueError, match="num_q_heads=4 must be a multiple of num_kv_heads=3"):
        Attention(D_MODEL, 4, 3, D, rngs=nnx.Rngs(0))
    module = make_attention()
    x, _ = inputs(0)
    with pytest.raises(ValueError, match="needs both cache and meta"):
        module(x[0], cache=object())
    with pytest.raises(ValueError, match=r"expected \[B, T, d_model\]"):
        module(x[0])
    with pytest.raises(ValueError, match="num_kv_heads=0 must be an int >= 1"):
        Attention(D_MODEL, 4, 0, D, rngs=nnx.Rngs(0))
    # At construction, not first when served: rope on read with dynamic NTK, an odd head dim.
    dynamic = jaxattn.RoPE(scaling=jaxattn.DynamicNTKScaling(2.0, 16))
    with pytest.raises(ValueError, match="Attention: rope_on_read=True with .*dynamic NTK"):
        Attention(D_MODEL, 4, 2, D, rope=dynamic, rope_on_read=True, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="head_dim=7 is odd"):
        Attention(28, 4, 2, 7, rope=jaxattn.RoPE(), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="positions given to a layer without rope"):
        make_attention(rope=None)(x, positions=jnp.arange(x.shape[1]))
    # The options at construction, not at the first call; x's width named.
    with pytest.raises(ValueError, match=r"Attention: window=0: expected an integer in \[1"):
        Attention(D_MODEL, 4, 2, D, window=0, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="Attention: soft_cap=-1.0"):
        Attention(D_MODEL, 4, 2, D, soft_cap=-1.0, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=f"the last axis must be d_model={D_MODEL}"):
        module(jnp.zeros((*x.shape[:2], D_MODEL + 1), x.dtype))
    with pytest.raises(ValueError, match=f"the last axis must be d_model={D_MODEL}"):
        module(jnp.zeros((3, D_MODEL + 1), x.dtype), cache=object(), meta=object())


@pytest.mark.parametrize("fused_qkv", [False, True])
@pytest.mark.every_case
def test_serving_over_a_mismatched_cache_names_it(fused_qkv):
    """A cache of 3 kv heads for a layer of 2 (fused: the op would have split the
    projection by 3 and run, o_proj then failing on a shape), or of another head dim."""
    module = make_attention(fused_qkv=fused_qkv)
    meta = jaxattn.AttentionMetadata.from_lists([5], [5], [[0, 1]], PAGE, max_tokens=8,
                                                max_seqs=1, max_pages=2)  # fmt: skip
    x = jnp.ones((8, D_MODEL))
    for heads, dim in ((HKV + 1, D), (HKV, 2 * D)):
        cache = jaxattn.PagedKVCache.create(4, PAGE, heads, dim, jnp.float32)
        with pytest.raises(ValueError, match=f"a cache of {heads} kv heads of dim {dim}"):
            module(x, cache=cache, meta=meta)
    # A multiple of the layer's kv heads that does not divide its q heads (4 for 6 / 2):
    # it had failed inside the op, naming the repeated k.
    six_heads = Attention(D_MODEL, 6, 2, D, fused_qkv=fused_qkv, rngs=nnx.Rngs(0))
    cache = jaxattn.PagedKVCache.create(4, PAGE, 4, D, jnp.float32)
    with pytest.raises(ValueError, match="a cache of 4 kv heads .* num_q_heads=6"):
        six_heads(x, cache=cache, meta=meta)


def test_serving_a_non_causal_layer_raises():
    """Serving mode is causal: a causal=False layer (it had been served causal, silently
    unlike its full mode) raises."""
    module = make_attention(causal=False)
    meta = jaxattn.AttentionMetadata.from_lists([5], [5], [[0, 1]], PAGE, max_tokens=8,
                                                max_seqs=1, max_pages=2)  # fmt: skip
    cache = jaxattn.PagedKVCache.create(4, PAGE, HKV, D, jnp.float32)
    with pytest.raises(ValueError, match="serving mode is causal"):
        module(jnp.ones((8, D_MODEL)), cache=cache, meta=meta)


# ------------------------------------------------------------------ serving mode
PAGE = 4
BUCKETS = dict(max_tokens=16, max_seqs=3, max_pages=5)
# Two sequences: A's 11-token prompt in chunks of 7 and 4, B's 6-token prompt in one
# step beside A's first chunk, then B decodes beside A's second chunk; then both decode.
# Rows come in either order; row 3 of each step is padding.
SCHEDULE = [[(0, 7), (1, 6)], [(1, 1), (0, 4)], [(0, 1), (1, 1)], [(1, 1), (0, 1)]]
TOTAL = (13, 9)  # tokens each sequence has seen at the end
TABLES = ([5, 2, 9, 0], [7, 3, 11])  # scattered pages


def run_schedule(step, state, per_seq, pad):
    """Feeds `per_seq[s]` (`[TOTAL[s], ...]`) through `SCHEDULE`; `step(x, state, meta) ->
    (y, state)` sees the packed tokens (`pad` after the live ones). Returns each sequence's
    outputs `[TOTAL[s], ...]` from the steps that processed its tokens."""
    done, outs = [0, 0], [[], []]
    for rows in SCHEDULE:
        q_lens = [n for _, n in rows]
        ctx = [done[s] + n for s, n in rows]
        meta = jaxattn.AttentionMetadata.from_lists(
            q_lens, ctx, [TABLES[s] for s, _ in rows], PAGE, **BUCKETS,
            decode_only=max(q_lens) == 1,  # the last two steps: the decode kernel alone
        )  # fmt: skip
        live = np.concatenate([per_seq[s][done[s] : done[s] + n] for s, n in rows])
        x = np.full((BUCKETS["max_tokens"],) + live.shape[1:], pad, live.dtype)
        x[: len(live)] = live
        y, state = step(jnp.asarray(x), state, meta)
        y, start = np.asarray(y), 0
        for s, n in rows:
            outs[s].append(y[start : start + n])
            start, done[s] = start + n, done[s] + n
    return [np.concatenate(o) for o in outs]


@impls
@pytest.mark.parametrize("fused_qkv", [False, True], ids=["qk_norm", "fused_qkv"])
def test_attention_serving_matches_full_mode(impl, fused_qkv):
    """Serving over chunks and decode steps gives full mode's outputs; with fused_qkv
    (no QK-norm) the op gets the projection whole."""
    serve = functools.partial(jaxattn.paged_attention, implementation=impl)
    layout = dict(fused_qkv=True) if fused_qkv else dict(qk_norm=True)
    module = make_attention(seed=4, qkv_bias=True, paged_attention_fn=serve, **layout)
    x, lengths = inputs(4, t=max(TOTAL), lengths=TOTAL)
    want = np.asarray(full(module, x, lengths))

    @nnx.jit
    def step(module, x, cache, meta):
        return module(x, cache=cache, meta=meta)

    cache = jaxattn.PagedKVCache.create(16, PAGE, HKV, D, jnp.float32)
    got = run_schedule(
        lambda x_, c, meta: step(module, x_, c, meta),
        cache,
        [np.asarray(x[b, :n]) for b, n in enumerate(TOTAL)],
        pad=np.nan,  # padding tokens must not reach the cache or the live rows
    )
    for b, n in enumerate(TOTAL):
        np.testing.assert_allclose(got[b], want[b, :n], **TOL)


LLAMA = LlamaConfig(
    vocab_size=96, hidden_size=D_MODEL, intermediate_size=96, num_layers=2, num_q_heads=HQ,
    num_kv_heads=HKV, head_dim=D, rope_scaling=jaxattn.Llama3Scaling(8.0, 1.0, 4.0, 8),
    tie_word_embeddings=True)  # fmt: skip


@pytest.mark.parametrize("fused_qkv", [False, True], ids=["qk_norm", "fused_qkv"])
def test_serving_over_a_duplicated_cache_matches_full_mode(fused_qkv):
    """`shard_serving` duplicates each kv head of the cache when the kv heads are fewer
    than the devices: the module repeats k and v to match, the fused projection too (it
    had passed the projection whole, split with the cache's doubled kv-head count)."""
    module = make_attention(qk_norm=not fused_qkv, fused_qkv=fused_qkv)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((1, 6, D_MODEL)), jnp.float32)
    meta = jaxattn.AttentionMetadata.from_lists([6], [6], [[0, 1]], 4, max_tokens=6,
                                                max_seqs=1, max_pages=2)  # fmt: skip
    cache = jaxattn.PagedKVCache.create(4, 4, HKV, D, jnp.float32)
    cache = jaxattn.parallel.duplicate_kv_heads(cache, 2 * HKV)
    with jax.default_matmul_precision("highest"):
        want = np.asarray(module(x))[0]
        got, _ = module(x[0], cache=cache, meta=meta)
    np.testing.assert_allclose(np.asarray(got), want, **TOL)


@pytest.mark.parametrize("fused_qkv", [False, True])
def test_llama_step_matches_full_mode(fused_qkv):
    serve = functools.partial(jaxattn.paged_attention, implementation="xla")
    model = nnx.eval_shape(
        lambda: Llama(LLAMA, fused_qkv=fused_qkv, paged_attention_fn=serve, rngs=nnx.Rngs(0))
    )
    randomize(model, seed=5)
    rng = util.rng_for("llama tokens")
    tokens = rng.integers(0, LLAMA.vocab_size, (2, max(TOTAL)))
    lengths = jnp.asarray(TOTAL, jnp.int32)
    want = np.asarray(nnx.jit(lambda m, t, n: m(t, q_lengths=n))(model, tokens, lengths))
    assert np.abs(want).max() > 1

    @nnx.jit
    def step(model, tokens, caches, meta):
        return model.step(tokens, caches, meta)

    caches = model.init_cache(num_pages=16, page_size=PAGE)
    assert len(caches) == LLAMA.num_layers and caches[0].k_pages.shape == (16, HKV, PAGE, D)
    got = run_schedule(
        lambda t, c, meta: step(model, t, c, meta),
        caches,
        [tokens[b, :n] for b, n in enumerate(TOTAL)],
        pad=0,
    )
    for b, n in enumerate(TOTAL):
        np.testing.assert_allclose(got[b], want[b, :n], **TOL)
