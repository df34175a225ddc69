"""All-to-all (Ulysses) context parallelism: swap the sequence split for a head split.

Inputs split by sequence over n devices go through one `lax.all_to_all` each (q, k, v) so
that every device holds the whole sequence for Hq/n query heads (and their kv heads); it
runs `jaxattn.attention` there, with every option that takes, and one more all_to_all
brings the output back split by sequence (Jacobs et al. 2023, "DeepSpeed Ulysses").
Gradients are jax's: the transpose of an all_to_all is an all_to_all, and `attention`'s
own custom VJP runs the flash backward kernels.

Per device and call, the all-to-alls move `(n-1)/n * B * Tl * D * (2*Hq + 2*Hkv')` elements
(q, k, v in, out back; Hkv' = max(Hkv, n), see the kv rule), whatever the sequence
length per device; none of it overlaps the attention, which needs it all first.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float

from jaxattn import attention as attention_module  # a module: jaxattn.attention imports us
from jaxattn import validation
from jaxattn.parallel.ring import LAYOUTS, axis_size, zigzag_shard, zigzag_unshard
from pallas_kernels.flash_prefill import FlashPrefillConfig

__all__ = ["kv_heads_on_the_wire", "ulysses_attention"]


def kv_heads_on_the_wire(num_q_heads: int, num_kv_heads: int, n: int) -> int:
    """The kv heads that travel: Hkv if n divides them, else each repeated n / Hkv times,
    so that every device receives the kv head of its query-head group. Raises if neither
    fits (the rule of vLLM and TensorRT-LLM's tensor parallelism)."""
    if num_q_heads % n:
        raise ValueError(
            f"ulysses attention splits the {num_q_heads} query heads over the {n} devices "
            f"of the sequence axis: num_q_heads must be a multiple of {n} (use ring attention)"
        )
    if num_kv_heads % n == 0:
        return num_kv_heads
    if n % num_kv_heads == 0:
        return n
    raise ValueError(
        f"ulysses attention: {num_kv_heads} kv heads over {n} devices: either must divide "
        "the other, so that each device holds the kv heads of its query heads"
    )


def ulysses_attention(
    q: Float[Array, "B Tq Hq D"],
    k: Float[Array, "B Tk Hkv D"],
    v: Float[Array, "B Tk Hkv D"],
    *,
    axis_name: str | tuple[str, ...],
    causal: bool = False,
    scale: float | None = None,
    layout: str = "contiguous",
    implementation: str | Sequence[str] | None = None,
    config: FlashPrefillConfig | None = None,
    **options,
):
    """Attention over a sequence split along the mesh axis `axis_name`, by all-to-all.
    Call it where `axis_name` is bound: inside `jax.shard_map` (`check_vma=True` works on a
    GPU; on CPU, Pallas's interpreter needs `check_vma=False`).

    Args:
      q: `[B, Tq, Hq, D]`, this device's queries; k, v: `[B, Tk, Hkv, D]`, its keys and
        values (q's dtype). Needs `Hq % n == 0` for the n devices of `axis_name`, and
        either `Hkv % n == 0` (kv heads split with their query heads) or `n % Hkv == 0`
        (each kv head sent to the n / Hkv devices of its query heads: fewer kv heads than
        devices, as vLLM and TensorRT-LLM replicate them under tensor parallelism).
      axis_name: the mesh axis (or tuple of axes) the sequence is split over.
      causal, scale: as `jaxattn.attention`, in global positions.
      layout: "contiguous" (device i holds tokens `[i*T, (i+1)*T)`) or "zigzag" (chunks i
        and 2n-1-i of 2n, see `zigzag_shard`); the sequence is put back in order after
        the all-to-all, so masks and positions are the true ones, and the output comes
        back in the input's layout.
      implementation, config: as `jaxattn.attention`.
      **options: any other `jaxattn.attention` option, for the GLOBAL sequence in its
        true order: `q_lengths` / `kv_lengths` `[B]`, `window`, `sink_tokens`, `soft_cap`,
        `return_lse`, `out_dtype` / `out_scale`, and the per-head ones, given for all Hq
        heads and sliced here to the device's heads: `alibi_slopes` `[Hq]`,
        `relative_bias` (table `[Hq, buckets]`), `bias` / `mask` broadcastable to
        `[B, Hq, Tq_global, Tk_global]`.

    Returns:
      out `[B, Tq, Hq, D]` split like q (and with `return_lse` lse float32 `[B, Hq, Tq]`).
    """
    validation.check_qkv(q, k, v, packed=False)
    if layout not in LAYOUTS:
        raise ValueError(f"{layout=}: expected one of {LAYOUTS}")
    try:
        n = axis_size(axis_name)
    except NameError as e:
        raise ValueError(
            f"{axis_name=} is not bound: call ulysses_attention inside jax.shard_map over a "
            "mesh with that axis (or use context_parallel_attention on global arrays)"
        ) from e
    num_q_heads, num_kv_heads = q.shape[2], k.shape[2]
    wire_kv = kv_heads_on_the_wire(num_q_heads, num_kv_heads, n)
    if wire_kv != num_kv_heads:
        k, v = (jnp.repeat(x, wire_kv // num_kv_heads, axis=2) for x in (k, v))
    zigzag = layout == "zigzag" and n > 1

    def to_heads(x):  # [B, Tl, H, D] -> [B, T, H/n, D], the sequence in order
        x = lax.all_to_all(x, axis_name, split_axis=2, concat_axis=1, tiled=True)
        return zigzag_unshard(x, n, axis=1) if zigzag else x

    def to_sequence(x, seq_axis, head_axis):  # the inverse, for out and lse
        x = zigzag_shard(x, n, axis=seq_axis) if zigzag else x
        return lax.all_to_all(x, axis_name, split_axis=seq_axis, concat_axis=head_axis, tiled=True)

    options = _local_heads(options, num_q_heads, n, lax.axis_index(axis_name))
    result = attention_module.attention(
        to_heads(q),
        to_heads(k),
        to_heads(v),
        causal=causal,
        scale=scale,
        implementation=implementation,
        config=config,
        **options,
    )
    if options.get("return_lse"):
        out, lse = result
        return to_sequence(out, 1, 2), to_sequence(lse, 2, 1)
    return to_sequence(result, 1, 2)


def _local_heads(options: dict, num_q_heads: int, n: int, index) -> dict:
    """Per-head options sliced to this device's `Hq / n` query heads."""
    per_device = num_q_heads // n

    def heads(x, axis):
        if x is None or x.ndim <= axis or x.shape[axis] != num_q_heads:
            return x  # absent, or broadcast over heads
        return lax.dynamic_slice_in_dim(x, index * per_device, per_device, axis=axis)

    options = dict(options)
    if options.get("alibi_slopes") is not None:
        options["alibi_slopes"] = heads(jnp.asarray(options["alibi_slopes"]), 0)
    for name in ("bias", "mask"):  # broadcastable to [B, Hq, Tq, Tk]: heads 3rd from last
        x = options.get(name)
        if x is not None and x.ndim >= 3:
            options[name] = heads(x, x.ndim - 3)
    relative = options.get("relative_bias")
    if relative is not None:
        options["relative_bias"] = dataclasses.replace(relative, table=heads(relative.table, 0))
    return options
