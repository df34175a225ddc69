"""Logical axis names on the parameters of `jaxattn.nn` and `jaxattn.models`, and their
mapping to a tensor-parallel mesh axis (Megatron's split).

Every parameter carries flax NNX sharding metadata (`out_sharding`): the logical name of
each of its axes. The names say what an axis is, not where it goes; a rule table maps them
to mesh axes (`nnx.logical_axis_rules`), so one model places itself on any mesh:

  name          axis of                                   tensor parallel (`tensor_parallel_rules`)
  "embed"       d_model (rows of a kernel, norms' scale)  replicated
  "q_heads"     Hq*D: q_proj's out, o_proj's in           split: column / row parallel
  "kv_heads"    Hkv*D: k_proj / v_proj's out              split when Hkv % n == 0, else replicated
  "qkv"         (Hq + 2 Hkv)*D: a fused qkv_proj's out    replicated (its columns hold no
                                                          per-device group of q, k and v)
  "mlp"         the MLP width: gate/up out, down in       split: column / row parallel
  "vocab"       V: embedding rows, lm_head's out          split when V % n == 0, else replicated
  "norm"        D of the QK-norm scales                   replicated

Column splits of "q_heads" (and "kv_heads") fall on head boundaries (Hq % n == 0 is
required), in the order of the heads, so device i holds query heads `i*Hq/n ...` and, when
the kv heads split, their kv heads `i*Hkv/n ...`: each kv head stays with its query group
and the attention runs shard-local. With fewer kv heads than devices (or any count that
does not split) the k/v projections are replicated, the vLLM / TensorRT-LLM rule: each
device computes every kv head and reads those of its query heads.

The metadata is set with `eager_sharding=False`: building a model needs no mesh, and
`jaxattn.parallel.shard_model` places it afterwards. To read a placement yourself:

    with nnx.logical_axis_rules(tensor_parallel_rules(config, 4, "tp")):
        shardings = nnx.get_named_sharding(nnx.state(model, nnx.Param), mesh)
"""

from __future__ import annotations

from typing import Any

__all__ = ["LOGICAL_AXES", "logical_axes", "tensor_parallel_rules"]

LOGICAL_AXES = ("embed", "q_heads", "kv_heads", "qkv", "mlp", "vocab", "norm")


def logical_axes(*names: str | None) -> dict[str, Any]:
    """Variable metadata naming a parameter's axes (`nnx.Linear(kernel_metadata=...)`,
    `bias_metadata`, `nnx.Embed(embedding_metadata=...)`, `nnx.RMSNorm(scale_metadata=...)`)."""
    unknown = [n for n in names if n is not None and n not in LOGICAL_AXES]
    if unknown:
        raise ValueError(f"logical_axes: {unknown} not in {LOGICAL_AXES}")
    return {"out_sharding": names, "eager_sharding": False}


def tensor_parallel_rules(
    config, num_devices: int, tp: str | tuple[str, ...] = "tp"
) -> tuple[tuple[str, Any], ...]:
    """The `nnx.logical_axis_rules` of Megatron's split over `num_devices` devices along
    mesh axis (or axes) `tp`, for a model of `config` (`num_q_heads`, `num_kv_heads`,
    `vocab_size`: a `jaxattn.models.LlamaConfig`).

    Raises ValueError when the query heads do not split evenly (a device would hold part
    of a head)."""
    if config.num_q_heads % num_devices:
        raise ValueError(
            f"tensor parallelism over {tp} ({num_devices} devices): "
            f"num_q_heads={config.num_q_heads} must split evenly"
        )

    def split_if(divides: bool):
        return tp if divides else None

    return (
        ("embed", None),
        ("q_heads", tp),
        ("kv_heads", split_if(config.num_kv_heads % num_devices == 0)),
        ("qkv", None),
        ("mlp", split_if(config.intermediate_size % num_devices == 0)),
        ("vocab", split_if(config.vocab_size % num_devices == 0)),
        ("norm", None),
    )
