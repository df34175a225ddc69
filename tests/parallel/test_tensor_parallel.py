"""Tensor parallelism: the Llama with its parameters split over a 'tp' mesh axis (Megatron's
split, `jaxattn.parallel.shard_model`) and the engine over caches split by kv head give
the single-device logits, gradients and tokens; weights and caches stay split."""

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
from jaxattn.parallel import param_shardings, shard_model


def _config(kv_heads: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2,
        num_q_heads=8, num_kv_heads=kv_heads, head_dim=8,
    )  # fmt: skip


@pytest.fixture(autouse=True)
def float32_matmuls():
    with jax.default_matmul_precision("highest"):
        yield


def _mesh(tp: int):
    return jax.make_mesh(
        (8 // tp, tp), ("data", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2
    )


def _pair(kv_heads, tp, **kwargs):
    """The same weights twice: one model on one device, one split over 'tp'."""
    one = Llama(_config(kv_heads), rngs=nnx.Rngs(0), **kwargs)
    split = Llama(_config(kv_heads), rngs=nnx.Rngs(0), **kwargs)
    shard_model(split, _mesh(tp), "tp")
    return one, split


@pytest.mark.parametrize("kv_heads, tp", [(4, 2), (4, 4), (2, 4)], ids=["tp2", "tp4", "kv2-tp4"])
def test_parameters_split_and_logits_unchanged(kv_heads, tp):
    one, split = _pair(kv_heads, tp)
    attn = split.layers[0].self_attn
    assert attn.q_proj.kernel.value.sharding.spec == P(None, "tp")
    assert attn.o_proj.kernel.value.sharding.spec == P("tp", None)
    assert split.layers[0].mlp.down_proj.kernel.value.sharding.spec == P("tp", None)
    # Fewer kv heads than devices: k/v projections replicated (the vLLM rule).
    kv_spec = P(None, "tp") if kv_heads % tp == 0 else P(None, None)
    assert attn.k_proj.kernel.value.sharding.spec == kv_spec
    tokens = jax.random.randint(jax.random.key(1), (4, 24), 0, 96)
    forward = nnx.jit(lambda m, t: m(t))
    np.testing.assert_allclose(forward(split, tokens), forward(one, tokens), rtol=1e-5, atol=1e-5)


def test_training_step_gradients_unchanged():
    """A loss's gradient on the split model (batch over 'data', weights over 'tp') equals
    the single-device gradient, and each gradient is split like its parameter."""
    pallas = functools.partial(jaxattn.attention, implementation="pallas")
    one, split = _pair(4, 2, attention_fn=pallas)
    mesh = _mesh(2)
    tokens = jax.random.randint(jax.random.key(2), (4, 16), 0, 96)

    def loss(model, tokens):
        logits = model(tokens[:, :-1])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1))

    grad = nnx.jit(nnx.grad(loss))
    g_split = grad(split, jax.device_put(tokens, NamedSharding(mesh, P("data"))))
    g_one = grad(one, tokens)
    for a, b in zip(jax.tree.leaves(g_split), jax.tree.leaves(g_one), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    assert g_split.layers[0].self_attn.q_proj.kernel.value.sharding.spec == P(None, "tp")


def _sizes_of_all_gathers(hlo: str) -> list[int]:
    dims = re.findall(r"= \w+\[([\d,]*)\][^=]*? all-gather(?:-start)?\(", hlo)
    return [int(np.prod([int(d) for d in x.split(",") if d])) for x in dims]


def test_engine_tensor_parallel_same_tokens():
    """Greedy generation through the engine (paged_attention on the kernels, interpret
    mode) with TP=4 and 2 kv heads gives the single-device engine's tokens; the caches,
    their kv heads duplicated per device (the vLLM rule), stay split by kv head; no weight
    or cache is gathered. (Kv heads that split need no duplication: the same path with
    copies = 1, covered by test_paged_attention_step_over_a_split_cache.)"""
    kv_heads = 2
    pallas = functools.partial(jaxattn.paged_attention, implementation="pallas")
    one, split = _pair(kv_heads, 4, paged_attention_fn=pallas)
    config = EngineConfig(num_pages=24, page_size=4, max_seqs=3, max_pages_per_seq=8,
                          token_buckets=(8,))  # fmt: skip
    rng = np.random.default_rng(3)
    texts = [rng.integers(1, 96, n).tolist() for n in (9, 3, 6)]
    outputs = []
    for model, mesh in ((one, None), (split, _mesh(4))):
        engine = Engine(model, config, mesh=mesh)
        requests = [Request(t, max_new_tokens=4, name=str(i)) for i, t in enumerate(texts)]
        engine.run(requests, progress=False)
        assert all(r.status is Status.FINISHED for r in requests)
        outputs.append([r.output for r in requests])
    assert outputs[0] == outputs[1]
    pools = engine.caches[0].k_pages
    # Split by kv head; 2 kv heads over 4 devices: each held twice (the vLLM rule).
    assert pools.shape[1] == 4 and pools.sharding.spec[1] == "tp"
    # The step's program gathers nothing of a weight matrix's or a page pool's size (the
    # sampler gathers the [S, V] logits that the vocabulary-split lm_head leaves split).
    probe = Request([5, 6], 2, sampling=SamplingParams(seed=0))
    probe.slot = 0
    step = engine._step.lower(
        engine._state, engine.caches, engine.manager, engine._inputs([(probe, 2)]),
        engine._key,
        decode_only=False,
    ).compile().as_text()  # fmt: skip
    smallest_weight = min(
        x.size for x in jax.tree.leaves(nnx.state(split, nnx.Param)) if x.ndim == 2
    )
    assert all(n < min(smallest_weight, pools.size) for n in _sizes_of_all_gathers(step))


def test_param_shardings_reject_heads_that_do_not_split():
    model = Llama(
        LlamaConfig(vocab_size=32, hidden_size=24, intermediate_size=32, num_layers=1,
                    num_q_heads=3, num_kv_heads=1, head_dim=8),
        rngs=nnx.Rngs(0),
    )  # fmt: skip
    with pytest.raises(ValueError, match="num_q_heads=3"):
        param_shardings(model, _mesh(2), "tp")
