"""Tensor parallelism for the Llama (Megatron's split) on a mesh axis.

Rules, by parameter (kernels `[in, out]` as in `nnx.Linear`):

  q_proj, gate_proj, up_proj, lm_head   column-parallel: kernel `P(None, tp)`, bias `P(tp)`
  k_proj, v_proj                        column-parallel by kv head; replicated when the kv
                                        heads do not split over tp (the vLLM / TensorRT-LLM
                                        rule; the serving caches then hold each kv head
                                        once per device that reads it: `shard_serving`)
  o_proj, down_proj                     row-parallel: kernel `P(tp, None)`, bias replicated
  qkv_proj (fused), embed_tokens, norms replicated

Column splits of q_proj fall on head boundaries (Hq % tp == 0), so the attention's query
heads arrive split and its kernels run shard-local (`jaxattn.parallel.partition`); a
row-parallel projection ends each block with one all-reduce, as in Megatron. A fused
qkv_proj interleaves no per-shard groups: it stays whole (use separate projections under
tensor parallelism). The lm_head's vocabulary split leaves the logits split by vocabulary.

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

_COLUMN = ("q_proj", "gate_proj", "up_proj", "lm_head")
_KV = ("k_proj", "v_proj")
_ROW = ("o_proj", "down_proj")


def _spec(path: tuple, ndim: int, tp, kv_split: bool) -> P:
    names = [str(getattr(p, "key", getattr(p, "name", p))) for p in path]
    if names and names[-1] == "value":  # a Variable's array
        names = names[:-1]
    module, leaf = (names[-2] if len(names) > 1 else ""), names[-1]
    if module in _COLUMN or (module in _KV and kv_split):
        return P(None, tp) if leaf == "kernel" else P(tp)
    if module in _ROW and leaf == "kernel":
        return P(tp, None)
    return P(*([None] * ndim))


def auto_axes(mesh: Mesh) -> Mesh:
    """`mesh` with auto axes: the model's parameters are placed so, and XLA's partitioner
    carries their split through the matmuls (with explicit axes, `jax.make_mesh`'s default,
    every row-parallel matmul would need an `out_sharding` written into the model)."""
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def param_shardings(model: nnx.Module, mesh: Mesh, tp: str | tuple[str, ...] = "tp"):
    """The `NamedSharding` of each of `model`'s parameters (an `nnx.State`), by the rules
    above, on `mesh`'s devices with auto axes (`auto_axes`). `model` has a Llama's config
    (`num_q_heads`, `num_kv_heads`)."""
    config = model.config
    mesh = auto_axes(mesh)
    n = axes_size(mesh, tp)
    if config.num_q_heads % n:
        raise ValueError(
            f"tensor parallelism over {tp} ({n} devices): num_q_heads={config.num_q_heads} "
            "must split evenly"
        )
    kv_split = config.num_kv_heads % n == 0
    state = nnx.state(model, nnx.Param)
    return jax.tree_util.tree_map_with_path(
        lambda path, x: NamedSharding(mesh, _spec(path, x.ndim, tp, kv_split)), state
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
