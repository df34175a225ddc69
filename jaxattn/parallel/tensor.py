"""Tensor parallelism for the Llama (Megatron's split) on a mesh axis.

Placement comes from each parameter's logical axis names (`jaxattn.nn.sharding`) and the
tensor-parallel rules over them (`tensor_parallel_rules`); kernels are `[in, out]`:

  q_proj, gate_proj, up_proj            column-parallel: kernel `P(None, tp)`, bias `P(tp)`
  k_proj, v_proj                        column-parallel by kv head; replicated when the kv
                                        heads do not split over tp (the vLLM / TensorRT-LLM
                                        rule; the serving caches then hold each kv head
                                        once per device that reads it: `shard_serving`)
  o_proj, down_proj                     row-parallel: kernel `P(tp, None)`, bias replicated
  lm_head, embed_tokens                 split by vocabulary (when it divides)
  qkv_proj (fused), norms               replicated

Column splits of q_proj fall on head boundaries (Hq % tp == 0), so the attention's query
heads arrive split and its kernels run shard-local (`jaxattn.parallel.partition`); a
row-parallel projection ends each block with one all-reduce, as in Megatron. A fused
qkv_proj interleaves no per-shard groups: it stays whole (use separate projections under
tensor parallelism). The vocabulary split leaves the logits split by vocabulary and makes
the embedding lookup a masked local gather plus one all-reduce.

Nothing here changes results: a sharding only places data (XLA keeps the program's
meaning), so a tensor-parallel model gives the single-device model's logits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxattn.cache import PagedKVCache
from jaxattn.parallel.sharding import axes_size, shard_cache

__all__ = ["duplicate_kv_heads", "param_shardings", "shard_model", "shard_serving"]


def auto_axes(mesh: Mesh) -> Mesh:
    """`mesh` with auto axes: the model's parameters are placed so, and XLA's partitioner
    carries their split through the matmuls (with explicit axes, `jax.make_mesh`'s default,
    every row-parallel matmul would need an `out_sharding` written into the model)."""
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def param_shardings(model: nnx.Module, mesh: Mesh, tp: str | tuple[str, ...] = "tp"):
    """The `NamedSharding` of each of `model`'s parameters (an `nnx.State`): their logical
    axis names under `tensor_parallel_rules` for `mesh`'s size along `tp`, on `mesh`'s
    devices with auto axes (`auto_axes`). `model` has a Llama's config (`num_q_heads`,
    `num_kv_heads`, `intermediate_size`, `vocab_size`)."""
    from jaxattn.nn.sharding import tensor_parallel_rules  # jaxattn.nn imports the ops

    mesh = auto_axes(mesh)
    rules = tensor_parallel_rules(model.config, axes_size(mesh, tp), tp)
    with nnx.logical_axis_rules(rules):
        specs = nnx.get_partition_spec(nnx.state(model, nnx.Param))
    return jax.tree.map(
        lambda spec: NamedSharding(mesh, spec), specs, is_leaf=lambda x: isinstance(x, P)
    )


def shard_model(model: nnx.Module, mesh: Mesh, tp: str | tuple[str, ...] = "tp") -> None:
    """Places `model`'s parameters on `mesh` by `param_shardings` (in place)."""
    state = nnx.state(model, nnx.Param)
    nnx.update(model, jax.device_put(state, param_shardings(model, mesh, tp)))


def duplicate_kv_heads(cache: PagedKVCache, num_devices: int) -> PagedKVCache:
    """`cache` with each kv head repeated `num_devices / Hkv` times (pools and per-group
    scales, `[N, Hkv, P, *]` -> `[N, num_devices, P, *]`), when Hkv < num_devices; else
    `cache`. Needs `num_devices % Hkv == 0`."""
    num_kv = cache.num_kv_heads
    if num_kv >= num_devices:
        return cache
    if num_devices % num_kv:
        raise ValueError(f"{num_kv} kv heads cannot be duplicated evenly over {num_devices}")
    copies = num_devices // num_kv
    repeat = lambda x: x if x.ndim == 0 else jnp.repeat(x, copies, axis=1)  # noqa: E731
    return jax.tree.map(repeat, cache)


def shard_serving(model, caches, manager, mesh: Mesh, tp: str | tuple[str, ...] = "tp"):
    """A serving set-up placed for tensor parallelism: the model's parameters split (in
    place), each layer's cache split by kv head (`shard_cache`), the `KVCacheManager`
    (block tables, lengths, free list) replicated. Returns `(caches, manager)`.

    With fewer kv heads than devices (n of them), each cache holds every kv head n / Hkv
    times (`duplicate_kv_heads`), one copy per device that reads it, and the attention
    layers write each new k/v to every copy: each device keeps and reads its query heads'
    kv head only, as vLLM and TensorRT-LLM do."""
    shard_model(model, mesh, tp)
    mesh = auto_axes(mesh)
    n = axes_size(mesh, tp)
    caches = [duplicate_kv_heads(c, n) for c in caches]
    caches = [shard_cache(c, mesh, tp) for c in caches]
    manager = jax.device_put(manager, NamedSharding(mesh, P()))
    return caches, manager
