"""Model-level decode: one generation step of a Llama-shaped stack (set `model`).

Four decoder layers of Llama-3-8B (d_model 4096, GQA 32/8, head_dim 128, MLP 14336;
vocabulary 32000), bf16 weights and caches, 64 sequences at context 2048, one new token
each. One `jaxattn.models.Llama` holds the weights; the implementations differ only in the
attention op and the cache it reads, injected through `paged_attention_fn`, so the
projections (one fused qkv_proj per layer, which XLA makes of three anyway), MLPs, norms
and head are the same XLA matmuls on the same weights:

- ours: paged caches (page 16, pages scattered at random), `jaxattn.paged_attention`
  (pallas) on the fused projection: one kernel per layer reads q, k and v in place,
  rotates q and k, writes k and v into the pages and attends.
- cudnn: contiguous caches `[B, max_len, Hkv, D]`; RoPE, the new token written with
  `dynamic_update_slice` per sequence, then `jax.nn.dot_product_attention` (cuDNN) with
  `key_value_seq_lengths`.
- xla: the same contiguous step with XLA's `dot_product_attention`.

Correctness first (STYLE.md, FlashAttention's rule): each step's logits are compared with a
float32 run of the same step (weights and caches upcast, XLA attention, full-precision
matmuls); an implementation passes when its error is at most twice that of the bf16 xla
step (a bf16 model is ~1% off float32 whatever its attention does).

Both caches hold the same K/V values. A timed call runs `STEPS` steps in one jitted loop
carrying the caches (donated: updated in place, as in a serving loop); the step's plan
(`AttentionMetadata`) is built once outside the loop. The three implementations are
measured in turn, one measurement of each per round (`bench.common.interleave`). Rates:
thousands of tokens per second (B / step time); "% ceiling" is the bytes a step must read
(weights, K/V) per second against the device-copy ceiling of the run.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bench.common import (
    Row,
    SetResult,
    Settings,
    carried_measure,
    describe_error,
    interleave,
    join_notes,
    progress,
    relative_error,
    timed_row,
)

SET_NAME = "model"
STEPS, SMOKE_STEPS = 20, 2


@dataclasses.dataclass(frozen=True)
class Shape:
    """The stack and the decode batch."""

    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    layers: int
    batch: int
    context: int  # length of each sequence after the step
    page_size: int

    def llama_config(self):
        from jaxattn.models import LlamaConfig

        return LlamaConfig(
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_layers=self.layers,
            num_q_heads=self.q_heads,
            num_kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            rope_theta=500000.0,
        )

    @property
    def label(self) -> str:
        return f"B{self.batch} ctx{self.context} decode, {self.layers} layers"


LLAMA3_8B_X4 = Shape(4096, 32, 8, 128, 14336, 32000, layers=4, batch=64, context=2048,
                     page_size=16)  # fmt: skip
SMOKE = Shape(128, 4, 2, 32, 256, 512, layers=2, batch=4, context=64, page_size=8)


# ----------------------------------------------------------------- contiguous baseline
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ContiguousCache:
    """One layer's K and V, bf16 `[B, max_len, Hkv, D]` (sequence b in row b)."""

    k: jax.Array
    v: jax.Array


def contiguous_attention(q, k, v, cache, meta, *, rope, implementation, scale=None, **options):
    """A decode step over a `ContiguousCache`, with `jaxattn.paged_attention`'s signature:
    q `[B, Hq, D]`, k, v `[B, Hkv, D]` (or the fused form: q `[B, Hq + 2 * Hkv, D]`,
    k = v = None): token b is sequence b's one new token, at `meta.positions[b]`. Returns
    (out `[B, Hq, D]`, the cache with the token written)."""
    from jaxattn.paged import split_qkv
    from jaxattn.rope import apply_rope

    if k is None and v is None:
        q, k, v = split_qkv(q, cache.k.shape[2])
    if any(options.get(name) for name in ("window", "sink_tokens", "soft_cap")):
        raise NotImplementedError(f"contiguous_attention: {options=}")
    positions = meta.positions  # [B]
    q, k = apply_rope(q, positions, rope), apply_rope(k, positions, rope)
    write = jax.vmap(lambda rows, x, p: jax.lax.dynamic_update_slice(rows, x[None], (p, 0, 0)))
    cache = ContiguousCache(write(cache.k, k, positions), write(cache.v, v, positions))
    out = jax.nn.dot_product_attention(
        q[:, None],
        cache.k,
        cache.v,
        scale=scale,
        key_value_seq_lengths=meta.context_lens,
        implementation=implementation,
    )  # [B, 1, Hq, D]
    return out[:, 0], cache


# --------------------------------------------------------------------------- inputs
def _models(shape: Shape):
    """`{impl: Llama}` sharing one set of bf16 weights, each with its attention op."""
    import jaxattn
    from jaxattn.models import Llama

    config = shape.llama_config()
    ops = {
        "ours": functools.partial(jaxattn.paged_attention, implementation="pallas"),
        "cudnn": functools.partial(contiguous_attention, implementation="cudnn"),
        "xla": functools.partial(contiguous_attention, implementation="xla"),
    }
    types = dict(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, fused_qkv=True)
    base = Llama(config, **types, paged_attention_fn=ops["ours"], rngs=nnx.Rngs(0))
    models = {"ours": base}
    for name in ("cudnn", "xla"):
        shell = nnx.eval_shape(
            lambda op=ops[name]: Llama(config, **types, paged_attention_fn=op, rngs=nnx.Rngs(0))
        )
        nnx.update(shell, nnx.state(base))
        models[name] = shell
    return models


def _caches(shape: Shape, seed: int = 0):
    """(paged caches, contiguous caches, the step's metadata, tokens): per layer, every
    sequence's K/V history drawn once and stored both ways."""
    import jaxattn

    B, P = shape.batch, shape.page_size
    pages_per_seq = math.ceil(shape.context / P)
    num_pages = B * pages_per_seq
    rng = np.random.default_rng(seed)
    tables = rng.permutation(num_pages).reshape(B, pages_per_seq)
    meta = jaxattn.AttentionMetadata.from_lists(
        [1] * B, [shape.context] * B, tables.tolist(), P,
        max_tokens=B, max_seqs=B, max_pages=pages_per_seq, decode_only=True,
    )  # fmt: skip
    slots = num_pages * P
    write = jax.jit(jaxattn.write_kv, donate_argnums=0)
    gather = jax.jit(jaxattn.gather_kv, static_argnums=3)
    paged, contiguous = [], []
    for layer in range(shape.layers):
        keys = jax.random.split(jax.random.key(seed * 1000 + layer), 2)
        kv = [
            jax.random.normal(key, (slots, shape.kv_heads, shape.head_dim), jnp.bfloat16)
            for key in keys
        ]
        cache = jaxattn.PagedKVCache.create(num_pages, P, shape.kv_heads, shape.head_dim)
        cache = write(cache, *kv, jnp.arange(slots, dtype=jnp.int32))
        k, v = gather(cache, meta.block_tables, meta.context_lens, pages_per_seq * P)
        paged.append(cache)
        contiguous.append(ContiguousCache(k, v))
    tokens = jnp.asarray(rng.integers(0, shape.vocab, B), jnp.int32)
    return paged, contiguous, meta, tokens


# --------------------------------------------------------------------------- timing
def _one_step(model, caches, tokens, meta):
    """Logits `[B, V]` of one step (caches not donated: the inputs stay usable)."""
    graphdef, state = nnx.split(model)
    run = jax.jit(lambda s, c: nnx.merge(graphdef, s).step(tokens, c, meta)[0])
    return run(state, caches)


def _bytes_per_step(shape: Shape, model) -> float:
    """What a step must read: every weight but the embedding table (B rows of it), and
    each sequence's K/V history in every layer (bf16)."""
    params = nnx.state(model, nnx.Param)
    weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    weights -= (shape.vocab - shape.batch) * shape.hidden * 2
    kv = 2 * shape.batch * shape.context * shape.kv_heads * shape.head_dim * 2 * shape.layers
    return float(weights + kv)


def _float32_reference(shape: Shape, model, contiguous, tokens, meta):
    """Logits `[B, V]` of the step in float32: `model`'s weights and the caches upcast,
    XLA attention, full-precision matmuls."""
    from jaxattn.models import Llama

    op = functools.partial(contiguous_attention, implementation="xla")
    config = shape.llama_config()
    f32 = functools.partial(jax.tree.map, lambda x: x.astype(jnp.float32))
    model32 = nnx.eval_shape(
        lambda: Llama(config, fused_qkv=True, paged_attention_fn=op, rngs=nnx.Rngs(0))
    )
    nnx.update(model32, f32(nnx.state(model)))
    with jax.default_matmul_precision("highest"):
        return _one_step(model32, f32(contiguous), tokens, meta)


def _checked(settings, shape, impl, model, caches, tokens, meta, ref, lowp_err, *, steps):
    """(row, its measurement or None): checks one step's logits against the float32 `ref`
    (error <= 2 * `lowp_err`, the bf16 xla step's), then prepares the step's timing."""
    row = Row(SET_NAME, shape.label, impl, "ok", unit="ktok/s")
    try:
        err = relative_error(_one_step(model, caches, tokens, meta), ref)
        check = f"err {err:.1e} (bf16 xla {lowp_err:.1e})"
        if not err <= 2 * lowp_err:
            return progress(dataclasses.replace(row, status="FAILED", notes=check)), None
        graphdef, state = nnx.split(model)

        def step(caches, state):
            logits, caches = nnx.merge(graphdef, state).step(tokens, caches, meta)
            return caches, logits

        measure = carried_measure(step, caches, (state,), settings, steps)
    except Exception as e:  # cuDNN missing off-GPU; ours must run
        status = "FAILED" if impl == "ours" else "skipped"
        return progress(dataclasses.replace(row, status=status, notes=describe_error(e))), None
    return dataclasses.replace(row, notes=check), measure


def model_set(settings: Settings) -> SetResult:
    shape = SMOKE if settings.smoke else LLAMA3_8B_X4
    steps = SMOKE_STEPS if settings.smoke else STEPS
    models = _models(shape)
    paged, contiguous, meta, tokens = _caches(shape)
    caches = {"ours": paged, "cudnn": contiguous, "xla": contiguous}
    work = _bytes_per_step(shape, models["ours"])
    ref = _float32_reference(shape, models["ours"], contiguous, tokens, meta)
    lowp_err = relative_error(_one_step(models["xla"], contiguous, tokens, meta), ref)
    checked = {
        impl: _checked(settings, shape, impl, models[impl], caches[impl], tokens, meta, ref,
                       lowp_err, steps=steps)
        for impl in ("ours", "cudnn", "xla")
    }  # fmt: skip
    rows = {impl: row for impl, (row, _) in checked.items()}
    timed = [impl for impl, (_, measure) in checked.items() if measure is not None]
    timings = interleave([checked[impl][1] for impl in timed], settings.reps)  # in turn
    for impl, timing in zip(timed, timings, strict=True):
        rate = shape.batch / timing.median_s / 1e3  # thousand tokens per second
        rows[impl] = timed_row(settings, rows[impl], timing, work, rate=rate, work_unit="TB/s")
    ours, cudnn = rows["ours"], rows["cudnn"]
    if ours.time_ms and cudnn.time_ms:
        rows["ours"] = progress(
            dataclasses.replace(
                ours,
                notes=join_notes(ours.notes, f"{cudnn.time_ms / ours.time_ms:.2f}x cudnn speed"),
            )
        )
    description = (
        f"bf16, {shape.layers} layers of d_model {shape.hidden}, GQA {shape.q_heads}/"
        f"{shape.kv_heads}, D {shape.head_dim}, MLP {shape.intermediate}, vocab {shape.vocab}; "
        f"page {shape.page_size}; {steps} steps per jitted loop, caches donated; % ceiling: "
        "bytes read (weights + K/V) vs the copy ceiling"
    )
    return SetResult(SET_NAME, description, list(rows.values()))
