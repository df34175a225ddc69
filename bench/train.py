"""Training: attention's forward + backward against its peers, and a training step (set `train`).

(The same gradient on packed sequences: set `train_packed`, bench/train_packed.py.)

Attention rows (bf16, GQA with 32 query / 8 kv heads, head dim 128): the jitted gradient
of `sum(out * g)` w.r.t. q, k and v (the forward and the backward, as a training step runs
them; g a random cotangent) at B1 S4096 causal, B1 S4096 full, B1 S16384 causal, B8 S2048
causal and B1 S65536 causal (the memory row). Implementations:

- ours: `jaxattn.attention(..., implementation="pallas")`, the flash forward and backward
  kernels with their heuristic configs, on sm90 the Hopper (Mosaic GPU) ones (`--sweep`
  times backward tilings: the Hopper kernels' "mosaic:block_kv_dq x num_stages" and the
  Triton kernels' "dK/dV kernel/dQ kernel", each block_q x block_kv x num_warps x
  num_stages);
- ours triton: the same with the Triton forward and backward forced (`backend="triton"`);
- cudnn: `jax.nn.dot_product_attention(implementation="cudnn")` (GQA native);
- triton mha: JAX's Pallas Triton `mha` (`jax.experimental.pallas.ops.gpu.attention`) with
  its default block sizes. It has no GQA: k and v are repeated to Hq heads inside the
  timed function (the repeat's transpose sums each group's dK/dV);
- xla: `jax.nn.dot_product_attention(implementation="xla")`, not run where its float32
  logits `[B, Hq, S, S]` would exceed 16 GiB.

Correctness first: every implementation's (dq, dk, dv) on the first input set is compared
with float32 gradients of the spec (`jax.grad` through `jaxattn.reference`, one sequence,
kv head and block of query rows at a time), each by its relative error, under the
`TOLERANCES` of the inputs' dtype; a row that fails is not timed. TFLOP/s count 3.5x the
forward's 4*B*S^2*Hq*D (halved for causal): the backward's five matmuls are 2.5x the
forward's two. Notes: the compiled gradient's temporary buffers (`memory_analysis`), and on
our row its speed against cuDNN's and mha's (peer time / our time). Our row and its
variants are measured in turn with the peers (`interleave`).

Model row: one training step (forward, backward, AdamW; `examples/train.py`'s
`train_step`) of four Llama-3-8B decoder layers (d_model 4096, GQA 32/8, MLP 14336,
vocabulary 32000; bf16 parameters and optimizer state) at B8 S2048, with our attention and
with cuDNN's. The gradient is checked first at B1 against a float32 copy of the model (XLA
attention, full-precision matmuls): an implementation passes when its error is at most
twice that of the bf16 model with XLA attention (`bench/model.py`'s rule). STEPS steps run
in one jitted loop carrying the donated state; the two are measured in turn. Rate: model
FLOPs per second (6 x matmul parameters x tokens, plus attention's 3.5x forward per
layer), so "% ceiling" is the model-FLOPs utilisation; notes: tokens/s, the compiled
step's temporary memory.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import pathlib
import sys
import traceback
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from bench.common import (
    TOLERANCES,
    Entry,
    Row,
    SetResult,
    Settings,
    Sweep,
    backend_label,
    bench_row,
    carried_measure,
    describe_error,
    interleave,
    join_notes,
    mark_best,
    ours_entries,
    progress,
    timed_row,
    with_backend,
)
from bench.prefill import (
    FULL_HEADS,
    SMOKE_HEADS,
    Dense,
    Heads,
    attention_flops,
    config_label,
    heuristic_config,
    qkv_sets,
)

SET_NAME = "train"
BACKWARD_FACTOR = 3.5  # (forward + backward) / forward matmul FLOPs: (2 + 5) / 2
# The XLA peer materialises [B, Hq, S, S] float32 logits (and keeps them for the backward).
XLA_LOGITS_LIMIT = 16 * 2**30
# Float32 logits of one reference call, [group, block, S]; its backward holds a few more.
REFERENCE_LOGITS_LIMIT = 2 * 2**30

SHAPES = (Dense(1, 4096, True), Dense(1, 4096, False), Dense(1, 16384, True),
          Dense(8, 2048, True), Dense(1, 65536, True))  # fmt: skip
SMOKE_SHAPES = (Dense(1, 128, True), Dense(1, 128, False), Dense(1, 256, True),
                Dense(2, 64, True), Dense(1, 512, True))  # fmt: skip

# Backward tilings: the Hopper kernels' "mosaic:block_kv_dq x num_stages", then Triton's
# "dK/dV kernel/dQ kernel", each block_q x block_kv x num_warps x num_stages (its
# heuristic for bf16 D 128 first); 128-key dK/dV tiles are left out (they spill:
# FlashBackwardConfig.heuristic's notes).
DEFAULT_SWEEP = (
    "mosaic:64x2",
    "mosaic:64x3",
    "mosaic:128x2",
    "64x64x4x2/64x64x4x2",
    "64x64x4x2/128x64x8x2",
    "64x64x8x2/64x64x8x2",
    "64x64x4x3/64x64x4x3",
    "64x64x4x1/64x64x4x1",
    "32x64x4x2/64x32x4x2",
    "64x32x4x2/64x64x4x2",
    "128x64x8x2/64x64x4x2",
)

# The model row: examples/train.py's "8b-layers" model (4 layers of Llama-3-8B).
MODEL_SIZE = "8b-layers"
MODEL_BATCH, MODEL_SEQ_LEN, CHECK_BATCH = 8, 2048, 1
SMOKE_MODEL = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2,
                   num_q_heads=4, num_kv_heads=2, head_dim=32)  # fmt: skip
SMOKE_BATCH, SMOKE_SEQ_LEN = 2, 64
STEPS, SMOKE_STEPS = 3, 2


# ------------------------------------------------------------------ attention rows
def grad_fn(attend: Callable) -> Callable:
    """Jitted `(q, k, v, g, *args) -> (dq, dk, dv)`: the gradient of
    `sum(attend(q, k, v, *args) * g)` (summed in float32), which runs the forward and the
    backward; `args` (sequence lengths, cu_seqlens) are data, not differentiated."""

    def grads(q, k, v, g, *args):
        def loss(q, k, v):
            out = attend(q, k, v, *args)
            return jnp.sum(out.astype(jnp.float32) * g.astype(jnp.float32))

        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    return jax.jit(grads)


def reference_grads(q, k, v, g, causal: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
    """float32 (dq `[B, S, Hq, D]`, dk, dv `[B, S, Hkv, D]`) of `sum(out * g)` through the
    spec, one sequence, kv head and block of query rows at a time.

    The loss sums over query rows, so a block of rows gives its own dq rows and a share of
    dk and dv (summed here). A block of rows [start, end) is passed with `kv_lengths=end`
    when causal: bottom-right alignment puts its row i at position start + i, and the keys
    it cannot see are masked, so one compiled call serves every block.
    """
    from jaxattn.reference import attention_reference

    batch, seq_len, num_q_heads, _ = q.shape
    num_kv_heads = k.shape[2]
    group = num_q_heads // num_kv_heads
    block = seq_len
    while group * block * seq_len * 4 > REFERENCE_LOGITS_LIMIT and block % 2 == 0:
        block //= 2

    @jax.jit
    def block_grads(q, k, v, g, end):  # q, g [1, block, group, D]; k, v [1, S, 1, D]
        def loss(q, k, v):
            out = attention_reference(q, k, v, causal=causal, kv_lengths=end)
            return jnp.sum(out * g)

        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    dq, dk, dv = [], [], []
    for b in range(batch):
        dq_heads, dk_heads, dv_heads = [], [], []
        for h in range(num_kv_heads):
            rows = slice(h * group, (h + 1) * group)
            k_h, v_h = f32(k[b : b + 1, :, h : h + 1]), f32(v[b : b + 1, :, h : h + 1])
            dq_blocks, dk_h, dv_h = [], 0.0, 0.0
            for start in range(0, seq_len, block):
                end = jnp.array([start + block if causal else seq_len], jnp.int32)
                q_blk = f32(q[b : b + 1, start : start + block, rows])
                g_blk = f32(g[b : b + 1, start : start + block, rows])
                dq_blk, dk_blk, dv_blk = block_grads(q_blk, k_h, v_h, g_blk, end)
                dq_blocks.append(dq_blk)
                dk_h, dv_h = dk_h + dk_blk, dv_h + dv_blk
            dq_heads.append(jnp.concatenate(dq_blocks, axis=1))
            dk_heads.append(dk_h)
            dv_heads.append(dv_h)
        dq.append(jnp.concatenate(dq_heads, axis=2))
        dk.append(jnp.concatenate(dk_heads, axis=2))
        dv.append(jnp.concatenate(dv_heads, axis=2))
    return tuple(jnp.concatenate(x, axis=0) for x in (dq, dk, dv))


def parse_backward_config(spec: str):
    """A FlashBackwardConfig from a spec: Triton's "dK/dV kernel/dQ kernel", each block_q x
    block_kv x num_warps x num_stages ("64x128x8x2/128x64x8x2"), or the Hopper kernels'
    "mosaic:block_kv_dq x num_stages" ("mosaic:64x2")."""
    from jaxattn import FlashBackwardConfig, MosaicBackwardConfig

    if spec.startswith("mosaic:"):
        block_kv_dq, stages = (int(x) for x in spec.removeprefix("mosaic:").split("x"))
        return FlashBackwardConfig(
            backend="mosaic", mosaic=MosaicBackwardConfig(block_kv_dq, stages)
        )
    dkdv, dq = spec.split("/")
    q_dkv, kv_dkv, warps_dkv, stages_dkv = (int(x) for x in dkdv.split("x"))
    q_dq, kv_dq, warps_dq, stages_dq = (int(x) for x in dq.split("x"))
    return FlashBackwardConfig(
        q_dkv, kv_dkv, q_dq, kv_dq, (warps_dkv, warps_dq), (stages_dkv, stages_dq),
        backend="triton",
    )  # fmt: skip


def backward_config_label(config) -> str:
    """The spec of the kernels a config runs (as `parse_backward_config` reads it); "auto"
    names both candidates (Triton fields left None: "heuristic")."""
    triton = "heuristic"
    if config.num_warps is not None and config.num_stages is not None:
        (warps_dkv, warps_dq), (stages_dkv, stages_dq) = config.num_warps, config.num_stages
        triton = (
            f"{config.block_q_dkv}x{config.block_kv_dkv}x{warps_dkv}x{stages_dkv}/"
            f"{config.block_q_dq}x{config.block_kv_dq}x{warps_dq}x{stages_dq}"
        )
    tiling = config.mosaic
    mosaic = "mosaic" if tiling is None else f"mosaic:{tiling.block_kv_dq}x{tiling.num_stages}"
    return backend_label(config, triton, mosaic)


def heuristic_backward(shape: Dense, heads: Heads):
    """The heuristic backward config of a row, with the backend that "auto" picks on this
    device spelled out (`with_backend`)."""
    from jaxattn import FlashBackwardConfig
    from pallas_kernels.mosaic import select_backward

    config = FlashBackwardConfig.heuristic(
        shape.seq_len, shape.seq_len, heads.head_dim, heads.dtype
    )
    q_shape = (shape.batch, shape.seq_len, heads.num_q_heads, heads.head_dim)
    k_shape = (shape.batch, shape.seq_len, heads.num_kv_heads, heads.head_dim)
    return with_backend(
        config, select_backward(config, q_shape, k_shape, heads.dtype, masked=shape.causal)
    )


def with_triton_backward(forward, seq_len: int, heads: Heads):
    """(config, notes) of an `ours triton` row: `forward`, a FlashPrefillConfig forcing the
    Triton kernel, with the Triton backward forced too, tiled by its heuristic for
    sequences of up to `seq_len` tokens; the notes name both tilings."""
    from jaxattn import FlashBackwardConfig

    backward = FlashBackwardConfig.heuristic(seq_len, seq_len, heads.head_dim, heads.dtype)
    config = dataclasses.replace(forward, backward=dataclasses.replace(backward, backend="triton"))
    notes = join_notes(
        f"fwd {config_label(config)}", f"config {backward_config_label(config.backward)}"
    )
    return config, notes


SWEEP = Sweep(parse=parse_backward_config, label=backward_config_label, default=DEFAULT_SWEEP)


def _ours(forward_config, causal: bool) -> Callable:
    """backward config -> `grad_fn` of `jaxattn.attention` on the pallas kernels (the
    forward tiled by `forward_config`)."""
    import jaxattn

    def make(backward) -> Callable:
        config = dataclasses.replace(forward_config, backward=backward)
        return grad_fn(
            functools.partial(
                jaxattn.attention, causal=causal, implementation="pallas", config=config
            )
        )

    return make


def _peers(shape: Dense, heads: Heads) -> list[tuple[str, Callable | None, str]]:
    """(name, `grad_fn` or None if not run, notes)."""
    from jax.experimental.pallas.ops.gpu import attention as pallas_attention

    def nn_attention(implementation):
        return functools.partial(
            jax.nn.dot_product_attention, is_causal=shape.causal, implementation=implementation
        )

    mha = functools.partial(
        pallas_attention.mha,
        segment_ids=None,
        sm_scale=heads.head_dim**-0.5,
        causal=shape.causal,
        interpret=jax.default_backend() != "gpu",
    )
    group = heads.num_q_heads // heads.num_kv_heads

    def mha_gqa(q, k, v):  # inside the timed function: its cost is mha's to pay
        return mha(q, jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2))

    logits_bytes = shape.batch * heads.num_q_heads * shape.seq_len**2 * 4
    xla = (
        (None, f"not run: {logits_bytes / 2**30:.0f} GiB logits")
        if logits_bytes > XLA_LOGITS_LIMIT
        else (grad_fn(nn_attention("xla")), "")
    )
    return [
        ("cudnn", grad_fn(nn_attention("cudnn")), ""),
        ("triton mha", grad_fn(mha_gqa), "k/v repeated"),
        ("xla", *xla),
    ]


def _temp(analysis) -> str:
    """The temporary buffers of a compiled program's `memory_analysis()`."""
    if analysis is None:
        return "temp n/a"
    n = analysis.temp_size_in_bytes
    return f"temp {n / 2**30:.2f} GiB" if n >= 2**28 else f"temp {n / 2**20:.1f} MiB"


def _temp_memory(entry: Entry) -> str:
    """The compiled gradient's temporary buffers (the call compiled it already)."""
    try:
        return _temp(entry.fn.lower(*entry.arg_sets[0]).compile().memory_analysis())
    except Exception as e:  # e.g. a backend without the analysis
        return f"temp n/a ({describe_error(e)})"


def with_temp(rows: Sequence[Row], entries: Sequence[Entry]) -> list[Row]:
    """The rows `bench_row` made of `entries`, those that ran (ok or FAILED) with the
    compiled gradient's temporary buffers first in their notes."""
    return [
        dataclasses.replace(row, notes=join_notes(_temp_memory(entry), row.notes))
        if row.status in ("ok", "FAILED")
        else row
        for row, entry in zip(rows, entries, strict=True)
    ]


def note_speeds(main: Row, peers: dict[str, Row]) -> Row:
    """`main` with its speed against each timed peer (`{name: row}`) in its notes, as
    "1.05x cudnn speed" (peer time / our time); printed."""
    speeds = [
        f"{peer.time_ms / main.time_ms:.2f}x {name} speed"
        for name, peer in peers.items()
        if main.time_ms and peer.time_ms
    ]
    if not speeds:
        return main
    print(f"  {main.shape} {main.impl}: {', '.join(speeds)}", flush=True)
    return dataclasses.replace(main, notes=join_notes(main.notes, *speeds))


def _attention_rows(settings: Settings, shape: Dense, heads: Heads, seed: int) -> list[Row]:
    arg_sets = qkv_sets((shape.batch, shape.seq_len), heads, seed, cotangent=True)
    ref = reference_grads(*arg_sets[0], shape.causal)
    flops = BACKWARD_FACTOR * attention_flops([shape.seq_len] * shape.batch, heads, shape.causal)
    forward = heuristic_config(shape.seq_len, heads, shape.causal)
    backward = heuristic_backward(shape, heads)
    ours = ours_entries(
        settings,
        sweep=SWEEP,
        make_fn=_ours(forward, shape.causal),
        config=backward,
        arg_sets=arg_sets,
        notes=f"fwd {config_label(forward)}",
    )
    triton, triton_notes = with_triton_backward(
        dataclasses.replace(forward, backend="triton"), shape.seq_len, heads
    )
    triton_fn = _ours(triton, shape.causal)(triton.backward)
    peers, not_run = [Entry("ours triton", triton_fn, arg_sets, notes=triton_notes)], {}
    for name, fn, notes in _peers(shape, heads):
        if fn is None:
            not_run[name] = Row(SET_NAME, shape.label, name, "skipped", notes=notes)
        else:
            peers.append(Entry(name, fn, arg_sets, notes=notes))
    entries = ours + peers
    rows = bench_row(
        settings,
        entries,
        set_name=SET_NAME,
        shape=shape.label,
        ref=ref,
        tol=TOLERANCES[heads.dtype],
        work=flops,
    )
    del ref
    for row in not_run.values():
        progress(row)
    rows = with_temp(mark_best(rows[: len(ours)]) + rows[len(ours) :], entries)
    by_impl = {row.impl: row for row in rows[len(ours) :]}
    peers = {name: by_impl[name] for name in ("cudnn", "triton mha") if name in by_impl}
    rows[0] = note_speeds(rows[0], peers)
    return rows + list(not_run.values())


# ----------------------------------------------------------------------- model row
def _example():
    """examples/train.py as a module (examples/ is not a package)."""
    name = "jaxattn_examples_train"
    if name not in sys.modules:
        path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "train.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up here
        spec.loader.exec_module(module)
    return sys.modules[name]


def _step_flops(config, batch: int, seq_len: int) -> float:
    """Model FLOPs of a training step: 6 per matmul parameter and token (forward 2,
    backward 4; the embedding lookup is no matmul), and each layer's causal attention at
    BACKWARD_FACTOR x its forward."""
    d, head_dim = config.hidden_size, config.head_dim
    projections = d * head_dim * 2 * (config.num_q_heads + config.num_kv_heads)  # q, o; k, v
    mlp = 3 * d * config.intermediate_size
    matmul_params = config.num_layers * (projections + mlp) + d * config.vocab_size
    heads = Heads(config.num_q_heads, config.num_kv_heads, head_dim)
    attention = BACKWARD_FACTOR * attention_flops([seq_len] * batch, heads, causal=True)
    return 6 * matmul_params * batch * seq_len + config.num_layers * attention


def _tree_error(tree, ref) -> float:
    """||tree - ref|| / ||ref|| over all leaves as one vector, in float32."""
    num = den = 0.0
    for x, r in zip(jax.tree.leaves(tree), jax.tree.leaves(ref), strict=True):
        x, r = jnp.asarray(x, jnp.float32), jnp.asarray(r, jnp.float32)
        num += float(jnp.sum((x - r) ** 2))
        den += float(jnp.sum(r**2))
    return math.sqrt(num / den)


def _gradient(example, model, tokens):
    """The gradient of the training loss w.r.t. the model's parameters."""
    from flax import nnx

    params = nnx.state(model, nnx.Param)
    return jax.jit(jax.grad(example.eval_loss(model)))(params, tokens)


def _models(example, config):
    """`{impl: Llama}` in bf16 sharing one set of weights (impl: ours, cudnn, xla), and the
    float32 copy with XLA attention."""
    from flax import nnx

    fns = {
        "ours": example.attention_fn("jaxattn", "pallas"),
        "cudnn": example.attention_fn("cudnn"),
        "xla": example.attention_fn("jaxattn", "xla"),
    }
    bf16 = jnp.dtype(jnp.bfloat16)
    base = example.build_model(config, bf16, fns["ours"])
    models = {"ours": base}
    for name in ("cudnn", "xla"):
        shell = nnx.eval_shape(lambda fn=fns[name]: example.build_model(config, bf16, fn))
        nnx.update(shell, nnx.state(base))
        models[name] = shell
    model32 = nnx.eval_shape(lambda: example.build_model(config, jnp.float32, fns["xla"]))
    nnx.update(model32, jax.tree.map(lambda x: x.astype(jnp.float32), nnx.state(base)))
    return models, model32


def _step_row(settings, example, label, impl, model, tokens, check_tokens, ref, lowp_err,
              steps):  # fmt: skip
    """(row, its measurement or None): the gradient checked against the float32 `ref`
    (error <= 2 * `lowp_err`), then the step compiled (its memory) and its timing prepared."""
    row = Row(SET_NAME, label, impl, "ok")
    try:
        err = _tree_error(_gradient(example, model, check_tokens), ref)
        check = f"grad err {err:.1e} (bf16 xla {lowp_err:.1e})"
        if not err <= 2 * lowp_err:
            return progress(dataclasses.replace(row, status="FAILED", notes=check)), None
        step, state = example.train_step(model, example.optimizer(1e-4, steps))
        compiled = jax.jit(step, donate_argnums=0).lower(state, tokens).compile()
        temp = _temp(compiled.memory_analysis())
        measure = carried_measure(step, state, (tokens,), settings, steps)
    except Exception as e:  # cuDNN missing off-GPU, out of memory; ours must run
        status = "FAILED" if impl == "ours" else "skipped"
        return progress(dataclasses.replace(row, status=status, notes=describe_error(e))), None
    return dataclasses.replace(row, notes=join_notes(temp, check)), measure


def _model_shape(settings: Settings):
    """(LlamaConfig, batch, seq_len, steps per timed loop) of the step rows."""
    from jaxattn.models import LlamaConfig

    if settings.smoke:
        return LlamaConfig(**SMOKE_MODEL), SMOKE_BATCH, SMOKE_SEQ_LEN, SMOKE_STEPS
    return _example().SIZES[MODEL_SIZE].config, MODEL_BATCH, MODEL_SEQ_LEN, STEPS


def _model_description(settings: Settings) -> str:
    """What the step rows share, in words."""
    config, batch, seq_len, steps = _model_shape(settings)
    return (
        f"{config.num_layers} Llama layers of d_model {config.hidden_size}, GQA "
        f"{config.num_q_heads}/{config.num_kv_heads}, MLP {config.intermediate_size}, vocab "
        f"{config.vocab_size}, bf16 weights and AdamW state, {steps} steps per jitted loop, "
        "TFLOP/s of model FLOPs (% ceiling: utilisation)"
    )


def _model_rows(settings: Settings) -> list[Row]:
    """The training step's rows: ours, cudnn."""
    example = _example()
    config, batch, seq_len, steps = _model_shape(settings)
    label = f"Llama {config.num_layers} layers B{batch} S{seq_len} step"
    data = example.batches(example.corpus(), batch, seq_len)
    tokens = jnp.asarray(next(data))
    check_tokens = tokens[:CHECK_BATCH]

    models, model32 = _models(example, config)
    with jax.default_matmul_precision("highest"):
        ref = _gradient(example, model32, check_tokens)
    del model32
    lowp_err = _tree_error(_gradient(example, models["xla"], check_tokens), ref)
    checked = {
        impl: _step_row(settings, example, label, impl, models[impl], tokens, check_tokens,
                        ref, lowp_err, steps)
        for impl in ("ours", "cudnn")
    }  # fmt: skip
    del ref
    rows = {impl: row for impl, (row, _) in checked.items()}
    timed = [impl for impl, (_, measure) in checked.items() if measure is not None]
    timings = interleave([checked[impl][1] for impl in timed], settings.reps)  # in turn
    work = _step_flops(config, batch, seq_len)
    for impl, timing in zip(timed, timings, strict=True):
        tokens_per_s = f"{batch * seq_len / timing.median_s / 1e3:.1f}k tok/s"
        notes = join_notes(tokens_per_s, rows[impl].notes)
        rows[impl] = timed_row(settings, rows[impl], timing, work, notes=notes)
    ours, cudnn = rows["ours"], rows["cudnn"]
    if ours.time_ms and cudnn.time_ms:
        speed = f"{cudnn.time_ms / ours.time_ms:.2f}x cudnn speed"
        rows["ours"] = progress(dataclasses.replace(ours, notes=join_notes(ours.notes, speed)))
    return list(rows.values())


# ---------------------------------------------------------------------------- set
def train_set(settings: Settings) -> SetResult:
    """Attention fwd+bwd rows against cuDNN, JAX's Triton mha and XLA; then the model's
    training step, ours against cuDNN. A shape that crashes (its reference or a timing
    out of memory) becomes a FAILED row, and the set goes on: a GPU run is expensive."""
    heads = SMOKE_HEADS if settings.smoke else FULL_HEADS
    rows = []
    for index, shape in enumerate(SMOKE_SHAPES if settings.smoke else SHAPES):
        rows += _guarded(shape.label, _attention_rows, settings, shape, heads, seed=100 * index)
    rows += _guarded("Llama step", _model_rows, settings)
    description = (
        f"{heads.describe()}; attention rows: grad of sum(out * g) w.r.t. q, k, v (fwd+bwd), "
        f"TFLOP/s at {BACKWARD_FACTOR}x the forward's FLOPs, err: dq/dk/dv against the "
        "float32 spec, config: our backward's tiling (dK/dV kernel/dQ kernel); step rows: "
        f"{_model_description(settings)}; temp: the compiled program's temporary buffers"
    )
    return SetResult(SET_NAME, description, rows)


def _guarded(label: str, fn: Callable, *args, **kwargs):
    """`fn(*args, **kwargs)`, or a list of one FAILED row of ours naming what it raised."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:
        traceback.print_exc()
        return [progress(Row(SET_NAME, label, "ours", "FAILED", notes=describe_error(e)))]
