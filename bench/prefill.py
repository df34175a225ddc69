"""Context (prefill) attention: named shape sets, our kernel against its peers.

Sets (bf16, GQA with 32 query / 8 kv heads, head dim 128; PERF.md):
  prefill:        B1 S4096 causal, B1 S4096 full, B1 S16384 causal, B8 S2048 causal. Ours
                  (`jaxattn.attention`, pallas) against cuDNN and XLA through
                  `jax.nn.dot_product_attention`, and JAX's Pallas Triton `mha`.
  prefill_packed: 8 causal sequences of mixed lengths packed into 16384 tokens
                  (`jaxattn.ragged_attention`) against our dense B8 S2048 causal, the same
                  total tokens; the target is packed time within 1.15x of dense.

Every output is checked against the float32 spec (`jaxattn.reference`) before timing.
FLOPs count the two matmuls, 4*B*Tq*Tk*Hq*D, halved for causal (Tq == Tk).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import (
    TOLERANCES,
    Row,
    SetResult,
    Settings,
    Sweep,
    backend_label,
    bench_impl,
    bench_ours,
    join_notes,
    num_input_sets,
    progress,
    with_backend,
)

# Triton: block_q x block_kv x num_warps x num_stages; Hopper: "mosaic:" block_q (per
# consumer warpgroup) x block_kv x num_stages (a trailing "p": persistent). The first of
# each is the heuristic for bf16 D 128, timed again so that the sweep shows its own noise.
DEFAULT_SWEEP = (
    "mosaic:64x128x2p",
    "mosaic:64x128x2",
    "mosaic:64x192x2",
    "mosaic:64x192x2p",
    "mosaic:64x64x2",
    "mosaic:64x64x3",
    "mosaic:64x64x4",
    "128x128x8x3",
    "128x64x8x2",
    "128x64x8x4",
    "128x128x8x2",
    "128x32x4x3",
    "128x64x4x3",
    "64x64x4x3",
    "64x128x4x2",
)

# The XLA peer materialises [B, Hq, Tq, Tk] float32 logits; past this it does not fit.
XLA_LOGITS_LIMIT = 8 * 2**30
# The reference runs one (sequence, kv head) at a time: [group, Tq, Tk] float32 logits.
REFERENCE_LOGITS_LIMIT = 8 * 2**30


@dataclasses.dataclass(frozen=True)
class Heads:
    """What every row of a set shares."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: jnp.dtype = jnp.dtype(jnp.bfloat16)

    def describe(self) -> str:
        return (
            f"{self.dtype.name}, Hq {self.num_q_heads} / Hkv {self.num_kv_heads}, D {self.head_dim}"
        )


@dataclasses.dataclass(frozen=True)
class Dense:
    """A padded batch: q `[B, S, Hq, D]`, k and v `[B, S, Hkv, D]`."""

    batch: int
    seq_len: int
    causal: bool

    @property
    def label(self) -> str:
        return f"B{self.batch} S{self.seq_len} {'causal' if self.causal else 'full'}"


@dataclasses.dataclass(frozen=True)
class Packed:
    """`num_seqs` causal sequences, lengths in [min_len, max_len], `total` tokens in all."""

    num_seqs: int
    total: int
    min_len: int
    max_len: int
    seed: int = 0

    @property
    def label(self) -> str:
        return f"packed {self.num_seqs} seqs T{self.total} causal"

    def lengths(self) -> np.ndarray:
        """A fixed draw: uniform lengths, then the surplus moved onto random sequences."""
        rng = np.random.default_rng(self.seed)
        lengths = rng.integers(self.min_len, self.max_len + 1, self.num_seqs)
        for i in rng.permutation(self.num_seqs):
            surplus = self.total - lengths.sum()
            lengths[i] = np.clip(lengths[i] + surplus, self.min_len, self.max_len)
        assert lengths.sum() == self.total, (self, lengths)
        return lengths

    @property
    def padded_label(self) -> str:
        """The label of the same sequences padded to the longest, with their lengths."""
        return f"padded B{self.num_seqs} S{self.lengths().max()} causal, lengths"

    @property
    def dense_equivalent(self) -> Dense:
        """The padded batch with the same sequence count and total tokens."""
        return Dense(self.num_seqs, self.total // self.num_seqs, causal=True)


FULL_HEADS = Heads(num_q_heads=32, num_kv_heads=8, head_dim=128)
SMOKE_HEADS = Heads(num_q_heads=4, num_kv_heads=2, head_dim=32)

PREFILL = (Dense(1, 4096, True), Dense(1, 4096, False), Dense(1, 16384, True), Dense(8, 2048, True))
SMOKE_PREFILL = (Dense(1, 128, True), Dense(1, 128, False), Dense(1, 256, True), Dense(2, 64, True))

PACKED = Packed(num_seqs=8, total=16384, min_len=512, max_len=3584)
SMOKE_PACKED = Packed(num_seqs=8, total=512, min_len=16, max_len=112)


def attention_flops(seq_lens: Sequence[int], heads: Heads, causal: bool) -> float:
    """4*S^2*Hq*D per sequence (QK^T and PV), halved for causal."""
    total = sum(4 * int(s) ** 2 * heads.num_q_heads * heads.head_dim for s in seq_lens)
    return total / 2 if causal else total


def qkv_sets(
    tokens: tuple[int, ...], heads: Heads, seed: int, *, cotangent: bool = False
) -> list[tuple]:
    """Input sets (q, k, v), or with `cotangent` (q, k, v, g), to rotate; `tokens` is
    (B, S) for dense, (T,) for packed.

    q and g `[*tokens, Hq, D]`, k and v `[*tokens, Hkv, D]`, standard normal in
    `heads.dtype`.
    """
    q_shape = (*tokens, heads.num_q_heads, heads.head_dim)
    kv_shape = (*tokens, heads.num_kv_heads, heads.head_dim)
    shapes = (q_shape, kv_shape, kv_shape) + ((q_shape,) if cotangent else ())
    set_bytes = sum(math.prod(s) for s in shapes) * heads.dtype.itemsize
    sets = []
    for i in range(num_input_sets(set_bytes)):
        keys = jax.random.split(jax.random.key(seed + i), len(shapes))
        sets.append(
            tuple(jax.random.normal(k, s, heads.dtype) for k, s in zip(keys, shapes, strict=True))
        )
    return sets


def _dense_reference(q, k, v, causal: bool) -> jax.Array | None:
    """The float32 spec, one (sequence, kv head) at a time; None if even that is too large.

    q `[B, Tq, Hq, D]`, k and v `[B, Tk, Hkv, D]` -> float32 `[B, Tq, Hq, D]`.
    """
    from jaxattn.reference import attention_reference

    batch, tq, num_q_heads, _ = q.shape
    tk, num_kv_heads = k.shape[1], k.shape[2]
    group = num_q_heads // num_kv_heads
    if group * tq * tk * 4 > REFERENCE_LOGITS_LIMIT:
        return None
    reference = jax.jit(functools.partial(attention_reference, causal=causal))
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    outs = [
        [
            reference(
                q[b : b + 1, :, h * group : (h + 1) * group],
                k[b : b + 1, :, h : h + 1],
                v[b : b + 1, :, h : h + 1],
            )
            for h in range(num_kv_heads)
        ]
        for b in range(batch)
    ]
    return jnp.concatenate([jnp.concatenate(heads, axis=2) for heads in outs], axis=0)


def _packed_reference(q, k, v, lengths: Sequence[int], causal: bool) -> jax.Array | None:
    """The dense reference per sequence. q `[T, Hq, D]`, k/v `[T, Hkv, D]` -> `[T, Hq, D]`."""
    outs = []
    for rows in sequence_slices(lengths):
        out = _dense_reference(q[None, rows], k[None, rows], v[None, rows], causal)
        if out is None:
            return None
        outs.append(out[0])
    return jnp.concatenate(outs, axis=0)


def cu_seqlens(lengths: Sequence[int]) -> jax.Array:
    """int32 `[B+1]`: where each packed sequence starts, then the total."""
    return jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)


def sequence_slices(lengths: Sequence[int]) -> list[slice]:
    """The rows of each sequence in a packed `[T, ...]` array."""
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    return [slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def pad_packed(x, lengths: Sequence[int], base=None) -> jax.Array:
    """Packed rows `[T, ...]` into `base` `[B, max(lengths), ...]` (default zeros of x's
    dtype): sequence b's rows at positions 0 .. lengths[b] - 1 of `base[b]`."""
    if base is None:
        base = jnp.zeros((len(lengths), int(max(lengths)), *x.shape[1:]), x.dtype)
    seq_ids = np.repeat(np.arange(len(lengths)), lengths)
    positions = np.concatenate([np.arange(n) for n in lengths])
    return base.at[seq_ids, positions].set(x)


def padded_qkv_sets(sets: Sequence[tuple], lengths: Sequence[int], heads: Heads,
                    seed: int) -> list[tuple]:  # fmt: skip
    """Packed input sets (q, k, v) `[T, H, D]` as the same sequences padded to the
    longest, `[B, max(lengths), H, D]`: the rows past a sequence's length are random
    (never zeros), which the lengths must mask."""
    noise = qkv_sets((len(lengths), int(max(lengths))), heads, seed)
    return [
        tuple(pad_packed(x, lengths, n) for x, n in zip(qkv, noise[i % len(noise)], strict=True))
        for i, qkv in enumerate(sets)
    ]


def parse_config(spec: str):
    """A FlashPrefillConfig forcing one backend: "block_q x block_kv x num_warps x
    num_stages" for the Triton kernel ("128x64x8x3"), "mosaic:" block_q x block_kv x
    num_stages for the Hopper kernel ("mosaic:64x128x2"; a trailing "p": persistent)."""
    from jaxattn import FlashPrefillConfig, MosaicForwardConfig

    if spec.startswith("mosaic:"):
        tiles = spec.removeprefix("mosaic:")
        persistent = tiles.endswith("p")
        block_q, block_kv, num_stages = (int(x) for x in tiles.removesuffix("p").split("x"))
        tiling = MosaicForwardConfig(block_q, block_kv, num_stages, persistent)
        return FlashPrefillConfig(backend="mosaic", mosaic=tiling)
    block_q, block_kv, num_warps, num_stages = (int(x) for x in spec.split("x"))
    return FlashPrefillConfig(block_q, block_kv, num_warps, num_stages, backend="triton")


def config_label(config) -> str:
    """The spec of the kernel(s) a config may run; "auto" names both candidates."""
    triton = f"{config.block_q}x{config.block_kv}x{config.num_warps}x{config.num_stages}"
    tiling = config.mosaic
    mosaic = "mosaic" if tiling is None else (
        f"mosaic:{tiling.block_q}x{tiling.block_kv}x{tiling.num_stages}"
        + ("p" if tiling.persistent else ""))  # fmt: skip
    return backend_label(config, triton, mosaic)


def heuristic_config(seq_len: int, heads: Heads, causal: bool):
    """The heuristic config of a dense row of one sequence length, with the backend that
    `backend="auto"` picks on this device spelled out (`with_backend`)."""
    from jaxattn import FlashPrefillConfig
    from pallas_kernels.mosaic import full_attention, select_forward

    config = FlashPrefillConfig.heuristic(seq_len, seq_len, heads.head_dim, heads.dtype, causal)
    q_shape = (1, seq_len, heads.num_q_heads, heads.head_dim)
    k_shape = (1, seq_len, heads.num_kv_heads, heads.head_dim)
    full = full_attention(causal, window=None)
    tiling = select_forward(config, q_shape, k_shape, heads.dtype, full=full)
    return with_backend(config, tiling)


SWEEP = Sweep(parse=parse_config, label=config_label, default=DEFAULT_SWEEP)
# The rows only the Triton kernel covers (packed, lengths) sweep its tilings alone.
TRITON_SWEEP = dataclasses.replace(
    SWEEP, default=tuple(s for s in DEFAULT_SWEEP if not s.startswith("mosaic:"))
)


def triton_config(seq_len: int, heads: Heads, **features):
    """The Triton forward forced, tiled by its heuristic for causal sequences of up to
    `seq_len` tokens; `features` (lengths, packed): as `FlashPrefillConfig.heuristic`'s."""
    from jaxattn import FlashPrefillConfig

    config = FlashPrefillConfig.heuristic(
        seq_len, seq_len, heads.head_dim, heads.dtype, True, **features
    )
    return dataclasses.replace(config, backend="triton")


def _bench_ours(settings: Settings, *, set_name: str, shape: str, ref, flops: float,
                arg_sets: Sequence[tuple], sweep: Sweep = SWEEP, **ours) -> list[Row]:  # fmt: skip
    """`bench_ours` on a prefill row: TFLOP/s, the tolerance of the inputs' dtype."""
    tol = TOLERANCES[arg_sets[0][0].dtype]
    row_args = dict(set_name=set_name, shape=shape, ref=ref, tol=tol, work=flops)
    return bench_ours(settings, row_args, sweep=sweep, arg_sets=arg_sets, **ours)


def _ours_dense(causal: bool) -> Callable:
    """config -> jitted `jaxattn.attention(q, k, v)` on the pallas kernel."""
    import jaxattn

    return lambda config: jax.jit(
        functools.partial(jaxattn.attention, causal=causal, implementation="pallas", config=config)
    )


def _ours_packed(causal: bool) -> Callable:
    """config -> jitted `jaxattn.ragged_attention(q, k, v, cu_seqlens_q, cu_seqlens_k)`."""
    import jaxattn

    return lambda config: jax.jit(
        functools.partial(
            jaxattn.ragged_attention, causal=causal, implementation="pallas", config=config
        )
    )


def _peers(shape: Dense, heads: Heads) -> list[tuple[str, Callable, Callable | None, str]]:
    """(name, jitted fn, maps (q, k, v) to its arguments or None, reason to skip or "")."""
    from jax.experimental.pallas.ops.gpu import attention as pallas_attention

    def dot_product_attention(implementation):
        return jax.jit(
            functools.partial(
                jax.nn.dot_product_attention, is_causal=shape.causal, implementation=implementation
            )
        )

    logits_bytes = shape.batch * heads.num_q_heads * shape.seq_len**2 * 4
    mha = jax.jit(
        functools.partial(
            pallas_attention.mha,
            segment_ids=None,
            sm_scale=heads.head_dim**-0.5,
            causal=shape.causal,
            interpret=jax.default_backend() != "gpu",
        )
    )
    group = heads.num_q_heads // heads.num_kv_heads

    def repeat_kv(q, k, v):
        """mha has no GQA: k and v get Hq heads here, outside the timed call."""
        return q, jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)

    return [
        ("cudnn", dot_product_attention("cudnn"), None, ""),
        (
            "xla",
            dot_product_attention("xla"),
            None,
            "skipped: memory" if logits_bytes > XLA_LOGITS_LIMIT else "",
        ),
        ("triton mha", mha, repeat_kv, ""),
        ("jax mgpu fp16", *_jax_mosaic(shape, heads)),
    ]


def _jax_mosaic(shape: Dense, heads: Heads) -> tuple[Callable | None, Callable, str]:
    """JAX's Mosaic GPU flash forward (`attention_mgpu`): float16 only, sm90 only, and no
    logit scale: q comes scaled by 1/sqrt(D), all three cast to float16, outside the timed
    call (standard-normal bf16 values lie in float16's normal range and are exact there)."""
    from pallas_kernels.mosaic import device_unsupported

    why = device_unsupported()
    if why:
        return None, None, f"skipped: {why}"
    from jax.experimental.pallas.ops.gpu import attention_mgpu

    config = attention_mgpu.TuningConfig(
        block_q=64, block_kv=128, max_concurrent_steps=2, causal=shape.causal
    )
    fn = jax.jit(functools.partial(attention_mgpu.attention, config=config))

    def to_fp16(q, k, v):
        q = q.astype(jnp.float32) * heads.head_dim**-0.5
        return tuple(x.astype(jnp.float16) for x in (q, k, v))

    return fn, to_fp16, ""


def prefill_set(settings: Settings) -> SetResult:
    """The PERF.md prefill rows: ours (the kernel the heuristic picks, and the Triton
    kernel forced) against cuDNN, XLA, JAX's Pallas Triton `mha` and its Mosaic GPU
    kernel."""
    heads = SMOKE_HEADS if settings.smoke else FULL_HEADS
    rows = []
    for index, shape in enumerate(SMOKE_PREFILL if settings.smoke else PREFILL):
        arg_sets = qkv_sets((shape.batch, shape.seq_len), heads, seed=100 * index)
        ref = _dense_reference(*arg_sets[0], shape.causal)
        flops = attention_flops([shape.seq_len] * shape.batch, heads, shape.causal)
        config = heuristic_config(shape.seq_len, heads, shape.causal)
        rows += _bench_ours(
            settings,
            set_name="prefill",
            shape=shape.label,
            make_fn=_ours_dense(shape.causal),
            config=config,
            arg_sets=arg_sets,
            ref=ref,
            flops=flops,
        )
        triton = dataclasses.replace(config, backend="triton")
        rows.append(
            bench_impl(
                settings,
                set_name="prefill",
                shape=shape.label,
                impl="ours triton",
                fn=_ours_dense(shape.causal)(triton),
                arg_sets=arg_sets,
                ref=ref,
                tol=TOLERANCES[heads.dtype],
                work=flops,
                notes=f"config {config_label(triton)}",
            )  # fmt: skip
        )
        for name, fn, make_args, skip in _peers(shape, heads):
            if skip:
                rows.append(progress(Row("prefill", shape.label, name, "skipped", notes=skip)))
                continue
            rows.append(
                bench_impl(
                    settings,
                    set_name="prefill",
                    shape=shape.label,
                    impl=name,
                    fn=fn,
                    arg_sets=[make_args(*a) for a in arg_sets] if make_args else arg_sets,
                    ref=ref,
                    tol=TOLERANCES[heads.dtype],
                    work=flops,
                )
            )
    return SetResult("prefill", heads.describe(), rows)


def packed_set(settings: Settings) -> SetResult:
    """Packed mixed-length sequences (`ragged_attention`) against our dense kernel: the
    Triton kernel forced in the `ours` rows, so their ratios measure packing, not a change
    of kernel; then `ours auto` rows for the packed, dense and padded shapes (what the
    heuristic picks: the Hopper kernel on sm90, packed and lengths included)."""
    heads = SMOKE_HEADS if settings.smoke else FULL_HEADS
    triton = functools.partial(triton_config, heads=heads)
    packed = SMOKE_PACKED if settings.smoke else PACKED
    dense = packed.dense_equivalent
    lengths = packed.lengths()
    cu = cu_seqlens(lengths)  # [B+1]

    real_flops = attention_flops(lengths, heads, causal=True)  # the packed and padded rows'
    dense_flops = attention_flops([dense.seq_len] * dense.batch, heads, causal=True)
    packed_qkv = qkv_sets((packed.total,), heads, seed=1000)
    packed_sets = [(q, k, v, cu, cu) for q, k, v in packed_qkv]
    packed_ref = _packed_reference(*packed_qkv[0], lengths, causal=True)
    max_len = int(lengths.max())
    packed_rows = _bench_ours(
        settings,
        set_name="prefill_packed",
        shape=packed.label,
        make_fn=_ours_packed(causal=True),
        config=triton(max_len, lengths=True, packed=True),
        arg_sets=packed_sets,
        ref=packed_ref,
        flops=real_flops,
        notes="lengths " + ",".join(str(n) for n in lengths),
        sweep=TRITON_SWEEP,
    )

    dense_sets = qkv_sets((dense.batch, dense.seq_len), heads, seed=2000)
    dense_ref = _dense_reference(*dense_sets[0], causal=True)
    dense_rows = _bench_ours(
        settings,
        set_name="prefill_packed",
        shape=dense.label,
        make_fn=_ours_dense(causal=True),
        config=triton(dense.seq_len),
        arg_sets=dense_sets,
        ref=dense_ref,
        flops=dense_flops,
        sweep=TRITON_SWEEP,
    )

    # The alternative packing replaces: the same sequences padded to the longest, with
    # lengths (rows past a sequence's length are zeros, as in the reference).
    padded_sets = padded_qkv_sets(packed_qkv, lengths, heads, seed=3000)
    padded_ref = None if packed_ref is None else pad_packed(packed_ref, lengths)
    lengths_arg = jnp.asarray(lengths, jnp.int32)

    def padded_fn(config):
        return jax.jit(
            lambda q, k, v: _ours_dense(causal=True)(config)(
                q, k, v, q_lengths=lengths_arg, kv_lengths=lengths_arg
            )
        )

    padded_shape = packed.padded_label
    padded_rows = _bench_ours(
        settings,
        set_name="prefill_packed",
        shape=padded_shape,
        make_fn=padded_fn,
        config=triton(max_len, lengths=True),
        arg_sets=padded_sets,
        ref=padded_ref,
        flops=real_flops,
        notes="same sequences as the packed row; FLOPs counted on real tokens",
        sweep=TRITON_SWEEP,
    )

    # Mixed lengths do more work than equal ones (sum of S^2), so both ratios are shown.
    packed_main, dense_main, padded_main = packed_rows[0], dense_rows[0], padded_rows[0]
    if packed_main.status == dense_main.status == padded_main.status == "ok":
        ratios = (
            f"time {packed_main.time_ms / dense_main.time_ms:.2f}x dense, "
            f"TFLOP/s {packed_main.rate / dense_main.rate:.2f}x dense, "
            f"time {packed_main.time_ms / padded_main.time_ms:.2f}x padded"
        )
        print(f"  {packed.label} vs {dense.label} and padded: {ratios}", flush=True)
        packed_rows[0] = dataclasses.replace(
            packed_main, notes=join_notes(packed_main.notes, ratios)
        )

    def auto_row(label, fn, arg_sets, ref, flops, notes=""):
        notes = join_notes("config auto (heuristic)", notes)
        return bench_impl(settings, set_name="prefill_packed", shape=label, impl="ours auto",
                          fn=fn, arg_sets=arg_sets, ref=ref, tol=TOLERANCES[heads.dtype],
                          work=flops, notes=notes)  # fmt: skip

    auto_rows = [
        auto_row(
            packed.label, _ours_packed(causal=True)(None), packed_sets, packed_ref, real_flops
        ),
        auto_row(dense.label, _ours_dense(causal=True)(None), dense_sets, dense_ref, dense_flops),
        auto_row(
            padded_shape,
            padded_fn(None),
            padded_sets,
            padded_ref,
            real_flops,
            "FLOPs counted on real tokens",
        ),  # fmt: skip
    ]
    rows = packed_rows + dense_rows + padded_rows + auto_rows
    return SetResult("prefill_packed", heads.describe(), rows)
