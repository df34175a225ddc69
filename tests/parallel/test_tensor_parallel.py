"""Tensor parallelism: the Llama with its parameters split over a 'tp' mesh axis (Megatron's
split, from each parameter's logical axis names: `jaxattn.nn.sharding`,
`jaxattn.parallel.shard_model`) and the engine over caches split by kv head give the
single-device logits, gradients and tokens; weights and caches stay split."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxattn
from jaxattn.generation import Engine, EngineConfig, Request, SamplingParams, Status
from jaxattn.models import Llama, LlamaConfig
from jaxattn.nn import LOGICAL_AXES, tensor_parallel_rules
from jaxattn.parallel import param_shardings, shard_model

XLA = dict(
    attention_fn=functools.partial(jaxattn.attention, implementation="xla"),
    paged_attention_fn=functools.partial(jaxattn.paged_attention, implementation="xla"),
)


def _config(kv_heads: int, num_layers: int = 2, **kwargs) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=num_layers,
        num_q_heads=8, num_kv_heads=kv_heads, head_dim=8, **kwargs,
    )  # fmt: skip


@pytest.fixture(autouse=True)
def float32_matmuls():
    with jax.default_matmul_precision("highest"):
        yield


def _mesh(tp: int):
    return jax.make_mesh(
        (8 // tp, tp), ("data", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2
    )


def _pair(kv_heads, tp, num_layers=2, tied=False, **kwargs):
    """The same weights twice: one model on one device, one split over 'tp'."""
    config = _config(kv_heads, num_layers, tie_word_embeddings=tied)
    one = Llama(config, rngs=nnx.Rngs(0), **kwargs)
    split = Llama(config, rngs=nnx.Rngs(0), **kwargs)
    shard_model(split, _mesh(tp), "tp")
    return one, split


def _spec(param) -> P:
    spec = param.get_value().sharding.spec
    return P(*spec, *[None] * (param.get_value().ndim - len(spec)))  # P() == P(None, None)


@pytest.mark.parametrize(
    "fused_qkv, config",
    [(False, {}), (True, {}), (False, dict(tie_word_embeddings=True, attention_bias=True))],
    ids=["separate", "fused", "tied-biases"],
)
def test_every_parameter_names_its_axes(fused_qkv, config):
    model = nnx.eval_shape(
        lambda: Llama(_config(4, mlp_bias=True, **config), fused_qkv=fused_qkv, rngs=nnx.Rngs(0))
    )
    for path, param in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        names = param.get_metadata().get("out_sharding")
        assert names is not None, path
        assert len(names) == param.get_value().ndim and set(names) <= set(LOGICAL_AXES), path


@pytest.mark.parametrize("kv_heads, tp", [(4, 2), (4, 4), (2, 4)], ids=["tp2", "tp4", "kv2-tp4"])
def test_parameters_split_and_logits_unchanged(kv_heads, tp):
    one, split = _pair(kv_heads, tp, **XLA)
    attn, mlp = split.layers[0].self_attn, split.layers[0].mlp
    assert _spec(attn.q_proj.kernel) == P(None, "tp")  # column-parallel, by head
    assert _spec(attn.o_proj.kernel) == P("tp", None)  # row-parallel
    assert _spec(mlp.gate_proj.kernel) == P(None, "tp")
    assert _spec(mlp.down_proj.kernel) == P("tp", None)
    assert _spec(split.lm_head.kernel) == P(None, "tp")  # by vocabulary
    assert _spec(split.layers[0].input_layernorm.scale) == P(None)
    # Fewer kv heads than devices: k/v projections replicated (the vLLM rule).
    kv_spec = P(None, "tp") if kv_heads % tp == 0 else P(None, None)
    assert _spec(attn.k_proj.kernel) == _spec(attn.v_proj.kernel) == kv_spec
    # Every parameter sits where its logical names say under the tensor-parallel rules.
    with nnx.logical_axis_rules(tensor_parallel_rules(split.config, tp, "tp")):
        want = nnx.get_partition_spec(nnx.state(split, nnx.Param))
    flat_want = dict(nnx.to_flat_state(want))
    for path, param in nnx.to_flat_state(nnx.state(split, nnx.Param)):
        assert _spec(param) == P(*flat_want[path].get_value()), path
    tokens = jax.random.randint(jax.random.key(1), (4, 24), 0, 96)
    forward = nnx.jit(lambda m, t: m(t))
    np.testing.assert_allclose(forward(split, tokens), forward(one, tokens), rtol=1e-5, atol=1e-5)


def test_training_step_gradients_unchanged():
    """A loss's gradient on the split model (batch over 'data', weights over 'tp') equals
    the single-device gradient, and each gradient is split like its parameter."""
    one, split = _pair(4, 2, **XLA)
    mesh = _mesh(2)
    tokens = jax.random.randint(jax.random.key(2), (4, 16), 0, 96)

    def loss(model, tokens):
        logits = model(tokens[:, :-1])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1))

    shardings = param_shardings(split, mesh, "tp")

    @nnx.jit
    def grad_split(model, tokens):  # a training step keeps each gradient with its parameter
        return jax.lax.with_sharding_constraint(nnx.grad(loss)(model, tokens), shardings)

    g_split = grad_split(split, jax.device_put(tokens, NamedSharding(mesh, P("data"))))
    g_one = nnx.jit(nnx.grad(loss))(one, tokens)
    for a, b in zip(jax.tree.leaves(g_split), jax.tree.leaves(g_one), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    params = dict(nnx.to_flat_state(nnx.state(split, nnx.Param)))
    for path, g in nnx.to_flat_state(g_split):
        assert _spec(g) == _spec(params[path]), path


def _collectives(hlo: str) -> list[tuple[str, int]]:
    """(kind, elements of its result) of each collective of a compiled program's text."""
    found = re.findall(
        r"= (\w+)\[([\d,]*)\][^=]*? (all-gather|all-reduce|all-to-all|reduce-scatter|"
        r"collective-permute)(?:-start)?\(",
        hlo,
    )
    return [(kind, int(np.prod([int(d) for d in dims.split(",") if d]))) for _, dims, kind in found]


@pytest.mark.parametrize(
    "kv_heads, tp, num_layers, tied, implementation",
    [(4, 2, 2, True, "xla"), (2, 4, 1, False, "pallas")],  # interpret mode compiles slowly
    ids=["tp2-tied-xla", "kv2-tp4-pallas"],
)
def test_engine_tensor_parallel_same_tokens(kv_heads, tp, num_layers, tied, implementation):
    """Greedy generation through the engine gives the single-device engine's tokens (the
    logits from a vocabulary-split lm_head or tied embedding); the caches stay split by kv
    head (2 kv heads over 4 devices: each held twice, the vLLM rule); a decode step
    communicates only all-reduces of `[T, d_model]` activations (row-parallel projections,
    embedding lookup) and one all-gather of the `[S, V]` logits: no weight or cache moves.
    The pallas case runs `paged_attention` on the kernels (interpret mode) under their
    partition rules (jaxattn/parallel/partition.py)."""
    serve = functools.partial(jaxattn.paged_attention, implementation=implementation)
    one, split = _pair(kv_heads, tp, num_layers, tied, paged_attention_fn=serve)
    config = EngineConfig(num_pages=24, page_size=4, max_seqs=3, max_pages_per_seq=8,
                          token_buckets=(8,))  # fmt: skip
    rng = np.random.default_rng(3)
    texts = [rng.integers(1, 96, n).tolist() for n in (9, 3, 6)]
    outputs = []
    for model, mesh in ((one, None), (split, _mesh(tp))):
        engine = Engine(model, config, mesh=mesh)
        requests = [Request(t, max_new_tokens=4, name=str(i)) for i, t in enumerate(texts)]
        engine.run(requests, progress=False)
        assert all(r.status is Status.FINISHED for r in requests)
        outputs.append([r.output for r in requests])
    assert outputs[0] == outputs[1]
    pools = engine.caches[0].k_pages
    assert pools.shape[1] == max(kv_heads, tp) and pools.sharding.spec[1] == "tp"
    assert engine.manager.block_tables.sharding.is_fully_replicated
    # The compiled decode step: what moves between devices.
    probe = Request([5, 6], 2, sampling=SamplingParams(seed=0))
    probe.slot, probe.prefilled, probe.output = 0, 2, [7]
    inputs = engine._inputs([(probe, 1)])
    step = engine._step.lower(
        engine._state, engine.caches, engine.manager, inputs, engine._key, decode_only=True
    ).compile().as_text()  # fmt: skip
    T, S, V, d_model = len(inputs.tokens), config.max_seqs, 96, 64
    found = _collectives(step)
    head = split.embed_tokens.embedding if tied else split.lm_head.kernel
    vocab_split = "tp" in tuple(head.get_value().sharding.spec)  # else the logits are whole
    gathers = [c for c in found if c[0] != "all-reduce"]
    assert gathers == ([("all-gather", S * V)] if vocab_split else []), found
    assert all(n == T * d_model for kind, n in found if kind == "all-reduce"), found


def test_param_shardings_reject_heads_that_do_not_split():
    model = Llama(
        LlamaConfig(vocab_size=32, hidden_size=24, intermediate_size=32, num_layers=1,
                    num_q_heads=3, num_kv_heads=1, head_dim=8),
        rngs=nnx.Rngs(0),
    )  # fmt: skip
    with pytest.raises(ValueError, match="num_q_heads=3"):
        param_shardings(model, _mesh(2), "tp")
