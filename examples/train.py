"""Training a small Llama on jaxattn's attention: `jax.grad` through `jaxattn.attention`.

A `jaxattn.models.Llama` learns next-byte prediction on text bundled with Python (the
docstrings of some standard-library modules, read through `inspect`; nothing is
downloaded), with optax's AdamW under one jitted step (`nnx.split` / `nnx.merge`: the step
is a pure function of (params, optimizer state) and a batch, its state donated). Every
`--log-every` steps a progress line gives the loss, tokens per second and memory. The
last tenth of the corpus is held out: the loss of one fixed held-out batch is taken before
and after training, and the exit status is 1 if it did not fall (the first and last
training losses are printed too; they are of different batches).

    python examples/train.py                              # tiny: CPU, a minute or two
    python examples/train.py --size 8b-layers             # GPU: 4 Llama-3-8B layers, bf16
    python examples/train.py --size 8b-layers --attention cudnn   # the same, cuDNN attention

Sizes: `tiny` (2 layers of d_model 128, float32) runs anywhere; `8b-layers` is four decoder
layers of Llama-3-8B's shape (d_model 4096, GQA 32/8, head_dim 128, MLP 14336; vocabulary
32000 as in `bench/model.py`), bf16 parameters and computation (AdamW's moments bf16 too:
a throughput setting, not a training recipe). `--implementation` picks jaxattn's backend
(None: the Pallas kernels on a GPU, the XLA reference elsewhere; "pallas" off a GPU runs
the kernels in interpret mode, slowly); `--attention cudnn` swaps the op for
`jax.nn.dot_product_attention(implementation="cudnn")` behind the same signature.

`bench/train.py` times this step (`train_step`) at the 8b-layers size.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import inspect
import sys
import time
from collections.abc import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxattn
from jaxattn.models import Llama, LlamaConfig

# The corpus: these modules' docstrings and those of their public members (~0.5 MB of
# English with code fragments; the exact text follows the Python version).
CORPUS_MODULES = (
    "argparse", "bisect", "calendar", "collections", "contextlib", "csv", "dataclasses",
    "datetime", "decimal", "difflib", "enum", "fractions", "functools", "heapq", "inspect",
    "itertools", "json", "logging", "os", "pathlib", "pickle", "random", "re", "shutil",
    "statistics", "string", "subprocess", "tarfile", "textwrap", "threading", "typing",
    "unittest", "zipfile",
)  # fmt: skip
VOCAB_BYTES = 256  # tokens are the corpus' UTF-8 bytes


@dataclasses.dataclass(frozen=True)
class Size:
    """A model and its default run."""

    config: LlamaConfig
    dtype: jnp.dtype  # parameters and computation
    steps: int
    batch: int
    seq_len: int
    learning_rate: float


SIZES = {
    "tiny": Size(
        LlamaConfig(vocab_size=VOCAB_BYTES, hidden_size=128, intermediate_size=384,
                    num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=32),
        jnp.dtype(jnp.float32), steps=150, batch=16, seq_len=128, learning_rate=3e-3,
    ),
    "8b-layers": Size(
        LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                    num_layers=4, num_q_heads=32, num_kv_heads=8, head_dim=128,
                    rope_theta=500000.0),
        jnp.dtype(jnp.bfloat16), steps=100, batch=8, seq_len=2048, learning_rate=3e-4,
    ),
}  # fmt: skip


# --------------------------------------------------------------------------- data
def corpus() -> np.ndarray:
    """uint8 `[N]`: the UTF-8 bytes of CORPUS_MODULES' docstrings, in a fixed order."""
    docs = []
    for name in CORPUS_MODULES:
        module = importlib.import_module(name)
        docs.append(inspect.getdoc(module) or "")
        for member_name, member in sorted(vars(module).items()):
            defined_here = getattr(member, "__module__", None) == module.__name__
            if member_name.startswith("_") or not defined_here:
                continue
            docs.append(f"{member_name}: {inspect.getdoc(member) or ''}")
    text = "\n\n".join(d for d in docs if d.strip())
    return np.frombuffer(text.encode("utf-8"), np.uint8)


def split(data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(training bytes, held-out bytes): the last tenth is held out."""
    cut = len(data) - len(data) // 10
    return data[:cut], data[cut:]


def batches(data: np.ndarray, batch: int, seq_len: int, seed: int = 0) -> Iterator[np.ndarray]:
    """Endless int32 `[batch, seq_len + 1]` windows of `data` at random offsets (inputs are
    `[:, :-1]`, targets `[:, 1:]`)."""
    if len(data) <= seq_len + 1:
        raise ValueError(
            f"corpus of {len(data)} bytes, need more than seq_len + 1 = {seq_len + 1} "
            "(python -OO strips the docstrings it is made of)"
        )
    rng = np.random.default_rng(seed)
    window = np.arange(seq_len + 1)
    while True:
        starts = rng.integers(0, len(data) - seq_len - 1, batch)
        yield data[starts[:, None] + window].astype(np.int32)


# ---------------------------------------------------------------------- attention
def nn_attention(q, k, v, *, causal: bool = False, q_lengths=None, kv_lengths=None, mask=None,
                 window=None, sink_tokens: int = 0, soft_cap=None, scale=None,
                 implementation: str = "cudnn"):  # fmt: skip
    """`jax.nn.dot_product_attention` behind `jaxattn.attention`'s signature (what
    `Llama(attention_fn=...)` calls), for comparisons: q `[B, Tq, Hq, D]`, k and v
    `[B, Tk, Hkv, D]` (GQA natively) -> `[B, Tq, Hq, D]`. Raises NotImplementedError for
    what it does not map (sliding windows, sink tokens, soft-capping) and for causal cross
    attention (jax.nn's causal mask is top-left aligned, jaxattn's bottom-right)."""
    if window is not None or sink_tokens or soft_cap is not None:
        raise NotImplementedError(f"nn_attention: {window=}, {sink_tokens=}, {soft_cap=}")
    if causal and q.shape[1] != k.shape[1]:
        raise NotImplementedError(f"nn_attention: causal with {q.shape=} and {k.shape=}")
    return jax.nn.dot_product_attention(
        q,
        k,
        v,
        mask=mask,
        scale=scale,
        is_causal=causal,
        query_seq_lengths=q_lengths,
        key_value_seq_lengths=kv_lengths,
        implementation=implementation,
    )


def attention_fn(attention: str = "jaxattn", implementation: str | None = None) -> Callable:
    """The model's attention op: `jaxattn.attention` on `implementation`, or cuDNN's."""
    if attention == "cudnn":
        return functools.partial(nn_attention, implementation="cudnn")
    return functools.partial(jaxattn.attention, implementation=implementation)


# -------------------------------------------------------------------------- model
def build_model(config: LlamaConfig, dtype, attention: Callable, seed: int = 0) -> Llama:
    """A randomly initialised Llama with parameters and computation in `dtype`."""
    return Llama(
        config, dtype=dtype, param_dtype=dtype, attention_fn=attention, rngs=nnx.Rngs(seed)
    )


def optimizer(learning_rate: float, steps: int) -> optax.GradientTransformation:
    """AdamW (weight decay on matrices only), global-norm clipping at 1, a short warm-up
    from a tenth of the rate and a cosine decay back to it."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=learning_rate / 10,
        peak_value=learning_rate,
        warmup_steps=max(1, steps // 10),
        decay_steps=max(2, steps),
        end_value=learning_rate / 10,
    )
    matrices = lambda params: jax.tree.map(lambda p: p.ndim > 1, params)  # noqa: E731
    return optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.1, mask=matrices),
    )


def loss_fn(model: Llama, tokens: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy (float32) of int32 `tokens [B, T + 1]`."""
    logits = model(tokens[:, :-1]).astype(jnp.float32)  # [B, T, V]
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


TrainState = tuple  # (params: nnx.State of the model's nnx.Param, optax state)


def train_step(model: Llama, tx: optax.GradientTransformation) -> tuple[Callable, TrainState]:
    """(step, state): `step(state, tokens) -> (state, loss)` is one AdamW step as a pure
    function (not jitted; `jax.jit(step, donate_argnums=0)` updates the state in place),
    `state` the model's parameters and a fresh optimizer state."""
    graphdef, params = nnx.split(model, nnx.Param)  # raises if the model had other state

    def step(state: TrainState, tokens: jax.Array):
        params, opt_state = state
        loss, grads = jax.value_and_grad(
            lambda p: loss_fn(nnx.merge(graphdef, p), tokens)
        )(params)  # fmt: skip
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    return step, (params, tx.init(params))


def eval_loss(model: Llama) -> Callable:
    """`evaluate(params, tokens) -> loss` for the parameters of `train_step`'s state."""
    graphdef = nnx.split(model, nnx.Param)[0]
    return lambda params, tokens: loss_fn(nnx.merge(graphdef, params), tokens)


def gib(n: float) -> str:
    """Bytes in GiB (MiB below a quarter of one)."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"


def memory_note(compiled) -> str:
    """The device's peak memory in use so far, or (where the device keeps no statistics,
    e.g. CPU) the compiled step's temporary buffers."""
    stats = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        return f"peak {gib(stats['peak_bytes_in_use'])}"
    analysis = compiled.memory_analysis()
    return f"step temp {gib(analysis.temp_size_in_bytes)}" if analysis else "memory n/a"


def progress_line(step: int, steps: int, loss: float, tok_per_s: float, memory: str) -> str:
    width = 24
    bar = "#" * (width * step // steps) + "-" * (width - width * step // steps)
    return (
        f"[{bar}] {step:>{len(str(steps))}}/{steps}  loss {loss:7.4f}  "
        f"{tok_per_s / 1e3:9.2f}k tok/s  {memory}"
    )


# ---------------------------------------------------------------------------- run
def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="examples/train.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--size", choices=list(SIZES), default="tiny")
    parser.add_argument("--steps", type=int, help="default: the size's")
    parser.add_argument("--batch", type=int, help="sequences per step; default: the size's")
    parser.add_argument("--seq-len", type=int, help="tokens per sequence; default: the size's")
    parser.add_argument("--lr", type=float, help="peak learning rate; default: the size's")
    parser.add_argument(
        "--implementation",
        choices=["pallas", "xla"],
        help="jaxattn's backend (default: pallas on a GPU, xla elsewhere)",
    )
    parser.add_argument("--attention", choices=["jaxattn", "cudnn"], default="jaxattn")
    parser.add_argument("--log-every", type=int, help="steps per progress line (default ~10 lines)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    size = SIZES[args.size]
    args.steps = size.steps if args.steps is None else args.steps
    args.batch = size.batch if args.batch is None else args.batch
    args.seq_len = size.seq_len if args.seq_len is None else args.seq_len
    args.lr = size.learning_rate if args.lr is None else args.lr
    args.log_every = args.log_every or max(1, args.steps // 10)
    if args.steps < 2 or args.batch < 1 or args.seq_len < 1:
        parser.error(f"need --steps >= 2, --batch >= 1, --seq-len >= 1: {args}")
    if args.attention == "cudnn" and args.implementation is not None:
        parser.error("--implementation picks jaxattn's backend; not with --attention cudnn")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    size = SIZES[args.size]
    config = size.config
    backend = (
        "cudnn (jax.nn)"
        if args.attention == "cudnn"
        else f"jaxattn {args.implementation or 'default'} (backend {jax.default_backend()})"
    )
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; attention: {backend}")
    print(
        f"model {args.size}: {config.num_layers} layers, d_model {config.hidden_size}, heads "
        f"{config.num_q_heads}/{config.num_kv_heads}x{config.head_dim}, vocab "
        f"{config.vocab_size}, {size.dtype.name}; batch {args.batch} x {args.seq_len} tokens, "
        f"{args.steps} steps, AdamW lr {args.lr:g}",
        flush=True,
    )
    data = corpus()
    train_data, held_out = split(data)
    data_batches = batches(train_data, args.batch, args.seq_len, args.seed)
    held_out_batch = jnp.asarray(next(batches(held_out, args.batch, args.seq_len, args.seed)))
    model = build_model(
        config, size.dtype, attention_fn(args.attention, args.implementation), args.seed
    )
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    print(
        f"{n_params / 1e6:.1f}M parameters; corpus {len(data) / 1e3:.0f} kB of docstrings "
        f"(last {len(held_out) / 1e3:.0f} kB held out)"
    )

    step, state = train_step(model, optimizer(args.lr, args.steps))
    evaluate = jax.jit(eval_loss(model))
    held_out_before = float(evaluate(state[0], held_out_batch))
    del model  # its arrays are in `state`, which the step donates
    tokens = jnp.asarray(next(data_batches))
    start = time.perf_counter()
    compiled = jax.jit(step, donate_argnums=0).lower(state, tokens).compile()
    analysis = compiled.memory_analysis()
    temp = f", temp {gib(analysis.temp_size_in_bytes)}" if analysis else ""
    print(f"step compiled in {time.perf_counter() - start:.1f} s{temp}", flush=True)

    tokens_per_step = args.batch * args.seq_len
    losses = []
    last_step, last_time = 0, time.perf_counter()
    for i in range(args.steps):
        state, loss = compiled(state, tokens)
        losses.append(loss)
        if i + 1 < args.steps:
            tokens = jnp.asarray(next(data_batches))  # the host draws while the step runs
        if (i + 1) % args.log_every == 0 or i + 1 == args.steps:
            value = float(loss)  # waits for the step
            now = time.perf_counter()
            rate = (i + 1 - last_step) * tokens_per_step / (now - last_time)
            print(progress_line(i + 1, args.steps, value, rate, memory_note(compiled)), flush=True)
            last_step, last_time = i + 1, now

    losses = [float(x) for x in losses]
    tail = max(1, min(10, args.steps // 5))
    print(
        f"training loss: first {losses[0]:.4f}, last {np.mean(losses[-tail:]):.4f} "
        f"(mean of the last {tail} steps)"
    )
    after = float(evaluate(state[0], held_out_batch))
    fell = bool(np.isfinite(after)) and after < held_out_before
    print(
        f"held-out loss (one fixed batch): before {held_out_before:.4f}, after {after:.4f}: "
        + ("fell" if fell else "DID NOT FALL")
    )
    return 0 if fell else 1


if __name__ == "__main__":
    sys.exit(main())
