"""One of two processes of tests/parallel/test_multiprocess.py, joined by `jax.distributed`
with gloo collectives on CPU (2 devices each, 4 in all). Runs sharded steps of the tiny
Llama on meshes over both processes' devices and checks its own shards against the whole
computation done locally on one device; prints "process <i>: ok" and exits 0 when they
agree.

  1. forward, tensor-parallel over all 4 devices ('tp' spans the processes: the
     row-parallel all-reduces and the vocabulary-split embedding cross them);
  2. a training step's gradient, batch over 'data' (one process each: the gradient
     all-reduce crosses them), weights over 'tp' within a process, attention on the
     Pallas kernels (interpret mode) under their partition rules;
  3. greedy generation through the engine, tensor-parallel over all 4 devices (every
     process runs the same scheduler on the same requests: one program, SPMD), against
     greedy decoding with the whole model on this process's first device.

Usage: python multiprocess_worker.py <coordinator host:port> <process id>
"""

import sys

import jax

# CPU collectives across processes: gloo (jax 0.10's default, named so the choice shows;
# the environment's JAX_CPU_COLLECTIVES_IMPLEMENTATION=gloo does the same).
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(
    coordinator_address=sys.argv[1], num_processes=2, process_id=int(sys.argv[2])
)

import functools  # noqa: E402

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxattn  # noqa: E402
from jaxattn.generation import Engine, EngineConfig, Request  # noqa: E402
from jaxattn.models import Llama, LlamaConfig  # noqa: E402
from jaxattn.parallel import shard_model  # noqa: E402
from pallas_kernels.flash_backward import FlashBackwardConfig  # noqa: E402
from pallas_kernels.flash_prefill import FlashPrefillConfig  # noqa: E402

CONFIG = LlamaConfig(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
    num_q_heads=4, num_kv_heads=2, head_dim=8,
)  # fmt: skip
KERNELS = FlashPrefillConfig(
    16, 16, 4, 1, backward=FlashBackwardConfig(16, 16, 16, 16, (4, 4), (1, 1))
)
PALLAS = functools.partial(jaxattn.attention, implementation="pallas", config=KERNELS)


def loss(model, tokens):
    logits = model(tokens[:, :-1])
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1))


def check(got: jax.Array, want, what: str) -> None:
    """Each of this process's shards of the global array `got` against `want`'s slice."""
    want = np.asarray(want)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    for shard in got.addressable_shards:
        np.testing.assert_allclose(
            shard.data, want[shard.index], rtol=1e-4, atol=1e-5, err_msg=what
        )


def global_array(x, mesh, spec) -> jax.Array:
    """`x` (the same on every process) as one array over `mesh`'s devices."""
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda i: x[i])


def main() -> None:
    assert jax.process_count() == 2 and jax.device_count() == 4, jax.devices()
    auto = (AxisType.Auto,) * 2
    tokens = np.asarray(jax.random.randint(jax.random.key(1), (4, 12), 0, CONFIG.vocab_size))
    local = jax.local_devices()[0]
    forward = nnx.jit(lambda m, t: m(t))

    # 1. Tensor parallel over all 4 devices, across the processes.
    one = Llama(CONFIG, rngs=nnx.Rngs(0))  # the same weights in both processes
    split = Llama(CONFIG, rngs=nnx.Rngs(0))
    mesh = jax.make_mesh((1, 4), ("data", "tp"), axis_types=auto)
    shard_model(split, mesh, "tp")
    q_kernel = split.layers[0].self_attn.q_proj.kernel.get_value()
    assert not q_kernel.is_fully_addressable and q_kernel.sharding.spec == P(None, "tp")
    with jax.default_device(local):
        want = forward(one, jnp.asarray(tokens))
    check(forward(split, global_array(tokens, mesh, P())), want, "tp=4 logits")

    # 2. A gradient step: batch over 'data' (across the processes), weights over 'tp'.
    whole = Llama(CONFIG, attention_fn=PALLAS, rngs=nnx.Rngs(0))
    split = Llama(CONFIG, attention_fn=PALLAS, rngs=nnx.Rngs(0))
    mesh = jax.make_mesh((2, 2), ("data", "tp"), axis_types=auto)
    assert {d.process_index for d in mesh.devices[:, 0]} == {0, 1}  # 'data' spans both
    shard_model(split, mesh, "tp")
    grad = nnx.jit(nnx.value_and_grad(loss))
    with jax.default_device(local):
        want_value, want_grads = grad(whole, jnp.asarray(tokens))
    value, grads = grad(split, global_array(tokens, mesh, P("data")))
    np.testing.assert_allclose(np.asarray(value), np.asarray(want_value), rtol=1e-5)
    paths = jax.tree_util.tree_leaves_with_path(want_grads)
    for (path, want), got in zip(paths, jax.tree.leaves(grads), strict=True):
        check(got, want, jax.tree_util.keystr(path))
    assert grads.layers[0].self_attn.q_proj.kernel.get_value().sharding.spec == P(None, "tp")

    # 3. The engine, tensor parallel across the processes, against greedy decoding with the
    # single-device model of step 1 (causal: right padding leaves earlier logits alone).
    prompts, new_tokens = ([3, 4, 5, 6, 7], [9, 10]), 3
    want = [list(t) for t in prompts]
    for _ in range(new_tokens):
        batch = np.zeros_like(tokens)
        for i, t in enumerate(want):
            batch[i, : len(t)] = t
        with jax.default_device(local):
            logits = np.asarray(forward(one, jnp.asarray(batch)))
        for i, t in enumerate(want):
            t.append(int(np.argmax(logits[i, len(t) - 1])))
    xla = functools.partial(jaxattn.paged_attention, implementation="xla")
    model = Llama(CONFIG, paged_attention_fn=xla, rngs=nnx.Rngs(0))
    sizes = EngineConfig(num_pages=16, page_size=4, max_seqs=2, max_pages_per_seq=8,
                         token_buckets=(8,))  # fmt: skip
    engine = Engine(model, sizes, mesh=jax.make_mesh((1, 4), ("data", "tp"), axis_types=auto))
    requests = [Request(t, max_new_tokens=new_tokens) for t in prompts]
    engine.run(requests, progress=False)
    assert [r.output for r in requests] == [
        t[len(p) :] for t, p in zip(want, prompts, strict=True)
    ], want
    assert not engine.caches[0].k_pages.is_fully_addressable
    print(f"process {jax.process_index()}: ok", flush=True)


if __name__ == "__main__":
    with jax.default_matmul_precision("highest"):
        main()
