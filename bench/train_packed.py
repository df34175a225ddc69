"""Training on packed sequences (set `train_packed`): attention's forward + backward on a
varlen (`cu_seqlens`) batch, against the same sequences padded.

Rows (bf16, GQA with 32 query / 8 kv heads, head dim 128; the `prefill_packed` batch: 8
causal sequences of fixed, seeded mixed lengths in 512..3584 packed into 16384 tokens):
the jitted gradient of `sum(out * g)` w.r.t. q, k and v (the forward and the backward,
as in the `train` set; g a random cotangent) of

- ours auto: `jaxattn.ragged_attention(..., implementation="pallas")` with its default
  config (on sm90 the Hopper forward and backward, which take packed batches; the notes
  name the kernels "auto" picks on this device);
- ours triton: the same with the Triton forward and backward forced (`backend="triton"`,
  tiled by their heuristics for the longest sequence);
- ours auto on the same sequences padded to the longest, `[8, 3584, H, D]`, with
  `q_lengths` / `kv_lengths` (`jaxattn.attention`);
- cudnn on that padded batch: `jax.nn.dot_product_attention(implementation="cudnn")` with
  `query_seq_lengths` / `key_value_seq_lengths` (skipped where it cannot run).

The padding holds random q, k and v (which the lengths must mask) and a zero cotangent
(a loss masked at the padding), so that the padding's gradients are zeros whatever an
implementation writes to its padded output rows. Correctness first: each (dq, dk, dv)
on the first input set is compared with float32 gradients of the spec, computed one
sequence at a time (`train.reference_grads`), each by its relative error under the
`TOLERANCES` of the inputs' dtype; a row that fails is not timed. TFLOP/s count 3.5x the
forward's causal FLOPs on the real tokens (the padded rows too). The two packed rows are
measured in turn, and the two padded ones. Notes: the compiled gradient's temporary
buffers; on the packed `ours auto` row, its speed against the padded one and cuDNN
(peer time / our time).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from bench.common import TOLERANCES, Entry, SetResult, Settings, bench_row, join_notes
from bench.prefill import (
    FULL_HEADS,
    PACKED,
    SMOKE_HEADS,
    SMOKE_PACKED,
    Heads,
    attention_flops,
    cu_seqlens,
    pad_packed,
    padded_qkv_sets,
    qkv_sets,
    sequence_slices,
    triton_config,
)
from bench.train import (
    BACKWARD_FACTOR,
    grad_fn,
    note_speeds,
    reference_grads,
    with_temp,
    with_triton_backward,
)

SET_NAME = "train_packed"


def _packed_reference_grads(q, k, v, g, lengths: Sequence[int]) -> tuple[jax.Array, ...]:
    """float32 (dq `[T, Hq, D]`, dk, dv `[T, Hkv, D]`) of `sum(out * g)` over causal
    packed sequences: `reference_grads` of each sequence alone."""
    per_sequence = [
        reference_grads(*(x[None, rows] for x in (q, k, v, g)), causal=True)
        for rows in sequence_slices(lengths)
    ]
    return tuple(
        jnp.concatenate([d[0] for d in grads]) for grads in zip(*per_sequence, strict=True)
    )


def _auto_kernels(q_shape: tuple, k_shape: tuple, heads: Heads, **features) -> str:
    """Which kernels `backend="auto"` runs on this device for a causal call of these
    shapes (`features`: `packed`)."""
    from pallas_kernels.mosaic import select_backward, select_forward

    forward = select_forward(None, q_shape, k_shape, heads.dtype, **features)
    backward = select_backward(None, q_shape, k_shape, heads.dtype, masked=True, **features)
    fwd, bwd = ("triton" if tiling is None else "mosaic" for tiling in (forward, backward))
    return f"config auto (heuristic): fwd {fwd}, bwd {bwd}"


def _ragged(config) -> Callable:
    """`grad_fn` of `jaxattn.ragged_attention(q, k, v, cu_seqlens_q, cu_seqlens_k)`."""
    import jaxattn

    return grad_fn(
        functools.partial(
            jaxattn.ragged_attention, causal=True, implementation="pallas", config=config
        )
    )


def _padded_ours(q, k, v, q_lengths, kv_lengths):
    """`jaxattn.attention` on the pallas kernels: q `[B, S, Hq, D]`, lengths `[B]`."""
    import jaxattn

    return jaxattn.attention(
        q, k, v, causal=True, q_lengths=q_lengths, kv_lengths=kv_lengths, implementation="pallas"
    )


def _padded_cudnn(q, k, v, q_lengths, kv_lengths):
    """cuDNN's fused attention through `jax.nn`: q `[B, S, Hq, D]`, lengths `[B]`."""
    return jax.nn.dot_product_attention(
        q,
        k,
        v,
        is_causal=True,
        query_seq_lengths=q_lengths,
        key_value_seq_lengths=kv_lengths,
        implementation="cudnn",
    )


def train_packed_set(settings: Settings) -> SetResult:
    """Packed fwd+bwd (`ragged_attention`, the automatic choice and the Triton kernels
    forced) against the same sequences padded with lengths, ours and cuDNN's."""
    heads = SMOKE_HEADS if settings.smoke else FULL_HEADS
    packed = SMOKE_PACKED if settings.smoke else PACKED
    lengths = packed.lengths()
    max_len = int(lengths.max())
    flops = BACKWARD_FACTOR * attention_flops(lengths, heads, causal=True)  # real tokens
    tol = TOLERANCES[heads.dtype]
    row_args = dict(set_name=SET_NAME, tol=tol, work=flops)

    # Packed: q, g [T, Hq, D], k, v [T, Hkv, D], then cu_seqlens [B+1] for q and for k.
    sets = qkv_sets((packed.total,), heads, seed=1000, cotangent=True)
    cu = cu_seqlens(lengths)
    packed_sets = [(*qkvg, cu, cu) for qkvg in sets]
    ref = _packed_reference_grads(*sets[0], lengths)
    triton, triton_notes = with_triton_backward(
        triton_config(max_len, heads, lengths=True, packed=True), max_len, heads
    )
    q_shape, k_shape = sets[0][0].shape, sets[0][1].shape
    auto_notes = join_notes(
        "lengths " + ",".join(str(n) for n in lengths),
        _auto_kernels(q_shape, k_shape, heads, packed=True),
    )
    entries = [
        Entry("ours auto", _ragged(None), packed_sets, "FAILED", auto_notes),
        Entry("ours triton", _ragged(triton), packed_sets, "FAILED", triton_notes),
    ]
    rows = bench_row(settings, entries, shape=packed.label, ref=ref, **row_args)
    packed_rows = with_temp(rows, entries)

    # Padded: q, g [B, max_len, Hq, D], k, v [B, max_len, Hkv, D], then lengths [B] twice.
    lens = jnp.asarray(lengths, jnp.int32)
    padded_sets = [
        (*qkv, pad_packed(g, lengths), lens, lens)
        for qkv, (*_, g) in zip(
            padded_qkv_sets([s[:3] for s in sets], lengths, heads, seed=3000), sets, strict=True
        )
    ]
    ref = tuple(pad_packed(d, lengths) for d in ref)
    q_shape, k_shape = padded_sets[0][0].shape, padded_sets[0][1].shape
    real_tokens = "FLOPs counted on real tokens"
    auto_notes = join_notes(_auto_kernels(q_shape, k_shape, heads), real_tokens)
    entries = [
        Entry("ours auto", grad_fn(_padded_ours), padded_sets, "FAILED", auto_notes),
        Entry("cudnn", grad_fn(_padded_cudnn), padded_sets, notes=real_tokens),
    ]
    rows = bench_row(settings, entries, shape=packed.padded_label, ref=ref, **row_args)
    padded_rows = with_temp(rows, entries)
    del ref

    padded, cudnn = padded_rows
    packed_rows[0] = note_speeds(packed_rows[0], {"padded": padded, "cudnn": cudnn})
    description = (
        f"{heads.describe()}; grad of sum(out * g) w.r.t. q, k, v (fwd+bwd), TFLOP/s at "
        f"{BACKWARD_FACTOR}x the forward's FLOPs on the real tokens, err: dq/dk/dv against "
        "the float32 spec per sequence, temp: the compiled gradient's temporary buffers"
    )
    return SetResult(SET_NAME, description, packed_rows + padded_rows)
