"""Probe: can a Hopper (Pallas Mosaic GPU) decode kernel stream INT4 K/V at the memory's pace?

Not a bench set (`bench/run.py`), and no kernel of the library: the building blocks of a
Hopper decode kernel for INT4 caches (issue: quantized decode at the bandwidth limit),
timed on dense streams (no pages, one scale-free head). The decode kernel (Pallas Triton)
is bound by the instructions it issues per code (bench/HISTORY.md); wgmma can take its A
operand from registers, so with the keys as wgmma's M (64 keys a step, the query rows as
N = 8) K's codes go from shared memory to registers to the tensor cores: loaded in
`WGMMA_LAYOUT_UPCAST_4X`, moved to the WGMMA layout by shuffles within each warp, and
converted by Mosaic's int4 -> bf16 path (a `lop3` per two values):

    S^T [64 keys, 8 rows] = K [64, D] Q^T [D, 8]       K: registers, Q^T: shared memory

V is the contraction's other side (keys are its K dimension), so its codes must be
transposed: here dequantized to bf16 in shared memory and read as A transposed,

    O^T [D, 8] += V^T [D, 64 keys] P^T [64 keys, 8]    V^T, P^T: shared memory

with P^T stored transposed from the softmax's registers. The softmax runs over the keys
(axis 0 of S^T: a reduction across the warpgroup's warps) in base 2.

Each block is one warpgroup streaming its slice of `[N, D]` int4 K and V through
`plgpu.emit_pipeline` (TMA, `stages` tiles of 64 tokens in flight). Modes:
- `stream`: the pipeline alone (its TMA loads; the body reads nothing);
- `k`: the K side: codes to bf16 registers, the S GEMM, the running max over keys;
- `kvv`: `k` plus V's codes to bf16 in shared memory, no P V GEMM;
- `kv`: the whole step (V through the WGMMA register layout to shared memory);
- `kvw`: `kv` with V stored straight from the load's layout (8 values a thread, one
  128-bit store) instead;
- `kr`: `k` with no relayout: the converted codes' registers read as the WGMMA layout
  as they lie (`as_wgmma`), which permutes K's channels; q comes permuted alike;
- `kvt`: V given transposed (`[D, N]`, tokens along the packed axis, as a cache could
  store its V pages): V^T's codes go to registers as K's do and are the P V GEMM's A
  operand, with no bf16 copy in shared memory;
- `kvtr`: `kvt` with K read as in `kr`;
- `kvtr2`: `kvtr` in steps of 128 keys (two 64-key tiles of K and of V^T, each its own
  TMA copy; one max, one rescale and one wait for the P V GEMMs a step).
`kv`, `kvw` and the `kvt` modes are checked against a float32 reference (error from P
rounded to bf16).
Bytes: K and V codes read, in every mode (the pipeline loads both). One line per variant,
also appended to `$OUT/probe.txt` (medians of 9 interleaved rounds of
`bench.common.op_measure`):

    PYTHONPATH=. python3 bench/probe_mosaic_decode.py [--lower] [--modes=k,kvt] [--configs=528x3]

`--lower` lowers every mode for CUDA without a GPU (CPU: the Pallas-level checks).
"""

from __future__ import annotations

import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import fragmented_array as fa
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from bench.common import interleave, op_measure

ROWS = 8  # query rows: wgmma's smallest N (GQA 32/8 has 4 a kv head)
D = 128
BLOCK = 64  # keys a step: wgmma's M
MODES = ("stream", "k", "kr", "kvv", "kv", "kvw", "kvt", "kvtr", "kvtr2")
TOKENS = 64 * 8 * 16384  # B64 x 8 kv heads x ctx16384: 1 GiB of INT4 K and V
CONFIGS = ((264, 4), (396, 3), (528, 3))  # (blocks: 2-4 an SM, pipeline stages)


def regrouped_channels() -> np.ndarray:
    """sigma: `K[:, sigma]` is what `as_wgmma` makes of K's tile (a permutation within
    each 32 channels: 32c + 8x + 2y + e <-> 32c + 8y + 2x + e, e < 2)."""
    j = np.arange(D)
    c, x, y, e = j // 32, j % 32 // 8, j % 8 // 2, j % 2
    return 32 * c + 8 * y + 2 * x + e


@plgpu.inline_mgpu(
    arg_types=(plgpu.Layout.WGMMA_UPCAST_4X,),
    return_type=plgpu.ShapeDtypeStruct((BLOCK, D), jnp.bfloat16, layout=plgpu.Layout.WGMMA),
)
def as_wgmma(ctx, x):
    """A `[64, 128]` bf16 array in `WGMMA_LAYOUT_UPCAST_4X` read as the WGMMA layout, no data
    moved: a thread's 8 consecutive columns of a 32-column tile become its 2-column pairs of
    that tile's four 8-column tiles. Rows stay; columns are permuted (`regrouped_channels`)."""
    del ctx
    regs = x.registers  # [1, 4 tiles of 32 columns, 1, 1, 2 row halves, 1, 1, 1, 1]
    out = np.empty(fa.WGMMA_LAYOUT.registers_shape(x.shape), dtype=object)
    for idx, reg in np.ndenumerate(regs):
        for i in range(4):
            at = (idx[0], idx[1] * 4 + i, *idx[2:])
            out[at] = mgpu_utils.vector_slice(reg, slice(2 * i, 2 * i + 2))
    return fa.FragmentedArray(_registers=out, _layout=fa.WGMMA_LAYOUT, _is_signed=None)


def tiles_a_step(mode: str) -> int:
    """64-key tiles a step of `mode` (each its own TMA copy)."""
    return 2 if mode == "kvtr2" else 1


def stream_kernel(n_tokens: int, blocks: int, stages: int, mode: str):
    """The probe kernel: q `[ROWS, D]` bf16, k `[n_tokens, D]` int4 and v (`[n_tokens, D]`
    int4, or V^T `[D, n_tokens]` in modes `kvt*`) -> O^T `[blocks, D, ROWS]` float32, each
    block's attention over its `n_tokens // blocks` keys rounded down to whole steps (in
    modes without the P V GEMM: the running max over keys, or zeros in `stream`)."""
    subs = tiles_a_step(mode)
    steps = n_tokens // BLOCK // subs // blocks
    int4_tiles = (plgpu.TilingTransform((8, 128)), plgpu.SwizzleTransform(64))  # 64-byte rows
    vt_tiles = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(32))  # 32-byte rows
    bf16_tiles = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    wgmma, rows_of = plgpu.Layout.WGMMA, plgpu.Layout.WGMMA.reduce(0)
    transposed_v = mode.startswith("kvt")  # v is V^T: its codes load as K's do
    regrouped = mode in ("kr", "kvtr", "kvtr2")  # K read by `as_wgmma`: q comes as q[:, sigma]
    has_v = mode.startswith("kv")
    has_pv = has_v and mode != "kvv"

    def kernel(q_ref, k_ref, v_ref, out_ref, q_smem, v_bf16, p_smem, o_smem, q_loaded):
        block = lax.axis_index("x")
        plgpu.copy_gmem_to_smem(q_ref, q_smem, q_loaded.at[0])
        plgpu.barrier_wait(q_loaded.at[0])
        acc = plgpu.layout_cast(jnp.zeros((D, ROWS), jnp.float32), wgmma)
        m = plgpu.layout_cast(jnp.full((ROWS,), -1e30, jnp.float32), rows_of)
        l = plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), rows_of)

        def registers(tile_smem, regroup: bool):
            codes = plgpu.load(tile_smem, (), layout=plgpu.Layout.WGMMA_UPCAST_4X)
            if regroup:  # no relayout (`as_wgmma`)
                return as_wgmma(codes.astype(jnp.bfloat16))
            return plgpu.layout_cast(codes, wgmma).astype(jnp.bfloat16)  # int4 relayout first

        def step(_, *refs):
            *tiles, carry = refs
            if mode == "stream":
                return carry
            acc, m, l = carry
            k_tiles, v_tiles = tiles[:subs], tiles[subs:]

            def qk(k_smem):
                def gemm(s_ref):
                    plgpu.wgmma(s_ref, registers(k_smem, regrouped), q_smem.T)
                    return s_ref[...]

                return pl.run_scoped(gemm, plgpu.ACC((BLOCK, ROWS), jnp.float32))

            s = [qk(k_smem) for k_smem in k_tiles]  # S^T of each 64-key tile
            m_new = m
            for part in s:
                m_new = jnp.maximum(m_new, part.max(axis=0))
            if not has_v:
                return acc, m_new, l
            if transposed_v:  # V^T [D, 64 keys]: wgmma's A from registers
                v_t = [registers(v_smem, False) for v_smem in v_tiles]
            else:
                codes = plgpu.load(v_tiles[0], (), layout=plgpu.Layout.WGMMA_UPCAST_4X)
                if mode != "kvw":
                    codes = plgpu.layout_cast(codes, wgmma)
                v_bf16[...] = codes.astype(jnp.bfloat16)
                v_t = [v_bf16.T]
            if not has_pv:
                plgpu.commit_smem()
                return acc, m_new, l
            alpha = jnp.exp2(m - m_new)
            for i, part in enumerate(s):
                p = jnp.exp2(part - lax.broadcast_in_dim(m_new, part.shape, [1]))
                l = l * alpha + p.sum(axis=0) if i == 0 else l + p.sum(axis=0)
                p_t = plgpu.layout_cast(p.astype(jnp.bfloat16), plgpu.Layout.WGMMA_TRANSPOSED)
                p_smem.at[i].T[...] = p_t
            plgpu.commit_smem()
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [1])

            def pv(acc_ref):
                for i, a in enumerate(v_t):
                    plgpu.wgmma(acc_ref, a, p_smem.at[i].T)

            return pl.run_state(pv)(plgpu.ACC.init(acc)), m_new, l

        def tile(i, sub):
            return block * steps * subs + i * subs + sub  # the 64-key tile of step i

        k_specs = [
            plgpu.BlockSpec((BLOCK, D), lambda i, j=j: (tile(i, j), 0), transforms=int4_tiles)
            for j in range(subs)
        ]
        v_specs = [
            plgpu.BlockSpec((D, BLOCK), lambda i, j=j: (0, tile(i, j)), transforms=vt_tiles)
            if transposed_v
            else plgpu.BlockSpec((BLOCK, D), lambda i, j=j: (tile(i, j), 0), transforms=int4_tiles)
            for j in range(subs)
        ]
        pipeline = plgpu.emit_pipeline(
            step, grid=(steps,), in_specs=[*k_specs, *v_specs], max_concurrent_steps=stages,
            init_carry=(acc, m, l),
        )  # fmt: skip
        acc, m, l = pipeline(*[k_ref] * subs, *[v_ref] * subs)
        if has_pv:
            acc = acc * lax.broadcast_in_dim(1.0 / l, acc.shape, [1])
        elif mode != "stream":  # keep the max live
            acc = acc + lax.broadcast_in_dim(m, acc.shape, [1])
        o_smem[...] = acc
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, out_ref.at[block])
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((blocks, D, ROWS), jnp.float32),
        grid=(blocks,),
        grid_names=("x",),
        scratch_types=(
            plgpu.SMEM((ROWS, D), jnp.bfloat16, transforms=bf16_tiles),
            plgpu.SMEM(
                (BLOCK, D) if has_v and not transposed_v else (8, 64),
                jnp.bfloat16,
                transforms=bf16_tiles,
            ),
            plgpu.SMEM((subs, ROWS, BLOCK), jnp.bfloat16, transforms=bf16_tiles),
            plgpu.SMEM((D, ROWS), jnp.float32),
            plgpu.Barrier(num_barriers=1),
        ),
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )


def reference(q, k, v, blocks: int):
    """O^T `[blocks, D, ROWS]`: softmax(q k^T) v over each block's keys, in base 2 on the
    raw logits as the kernel takes them (float32)."""
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    s = jnp.einsum("rd,btd->brt", q, k.reshape(blocks, -1, D))
    p = jnp.exp2(s - s.max(axis=2, keepdims=True))
    out = jnp.einsum("brt,btd->brd", p, v.reshape(blocks, -1, D)) / p.sum(axis=2)[..., None]
    return out.transpose(0, 2, 1)


def inputs(n_tokens: int):
    """q `[ROWS, D]` bf16; K and V codes `[n_tokens, D]` int4; and V^T `[D, n_tokens]`
    (the `kvt` modes)."""
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = (jax.random.normal(kq, (ROWS, D), jnp.float32) * 0.05).astype(jnp.bfloat16)
    codes = lambda key: jax.random.randint(key, (n_tokens, D), -8, 8, jnp.int8)  # noqa: E731
    v = codes(kv)
    return q, codes(kk).astype(jnp.int4), v.astype(jnp.int4), v.T.astype(jnp.int4)


def arguments(mode: str, q, k, v, vt) -> tuple:
    """The kernel's arguments in `mode`: q's channels permuted where K is regrouped, V^T
    where V is given transposed."""
    if mode in ("kr", "kvtr", "kvtr2"):
        q = q[:, regrouped_channels()]
    return q, k, vt if mode.startswith("kvt") else v


def main(lower_only: bool, modes=MODES, configs=CONFIGS) -> None:
    out_dir = os.environ.get("OUT", ".")
    if lower_only:
        q, k, v, vt = inputs(BLOCK * 132 * 2)
        for mode in MODES:
            fn = jax.jit(stream_kernel(k.shape[0], 132, 2, mode))
            args = arguments(mode, q, k, v, vt)
            text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
            print(mode, "lowers:", "mosaic_gpu" in text)
        return
    q, k, v, vt = inputs(TOKENS)
    small = BLOCK * 132 * 8
    args = {mode: arguments(mode, q, k, v, vt) for mode in MODES}
    with open(os.path.join(out_dir, "probe.txt"), "a") as log:
        header = f"== {time.strftime('%H:%M', time.gmtime())} UTC {jax.devices()[0].device_kind}"
        print(header, f"jax {jax.__version__}", file=log, flush=True)
        for mode in ("kv", "kvw", "kvt", "kvtr", "kvtr2"):
            fn = jax.jit(stream_kernel(small, 132, 2, mode))
            got = fn(*arguments(mode, q, k[:small], v[:small], vt[:, :small]))
            err = float(jnp.max(jnp.abs(got - reference(q, k[:small], v[:small], 132))))
            line = f"{mode}: max abs error against the float32 reference {err:.2e}"
            print(line, flush=True)
            print(line, file=log, flush=True)
        for blocks, stages in configs:
            fns = [jax.jit(stream_kernel(TOKENS, blocks, stages, mode)) for mode in modes]
            measures = [
                op_measure(fn, [args[m]], warmup=2) for fn, m in zip(fns, modes, strict=True)
            ]
            timings = interleave(measures, reps=9)
            for mode, timing in zip(modes, timings, strict=True):
                t = timing.median_s
                subs = tiles_a_step(mode)  # the keys read: whole steps; K and V, half a byte each
                nbytes = blocks * (TOKENS // BLOCK // subs // blocks) * subs * BLOCK * D
                line = (f"blocks {blocks} stages {stages} {mode}: {t * 1e3:.3f} ms, "
                        f"{nbytes / t / 1e12:.2f} TB/s of {nbytes / 2**30:.2f} GiB")  # fmt: skip
                print(line, flush=True)
                print(line, file=log, flush=True)


if __name__ == "__main__":
    flags = dict(a.split("=", 1) for a in sys.argv[1:] if "=" in a)
    modes = tuple(flags["--modes"].split(",")) if "--modes" in flags else MODES
    configs = CONFIGS
    if "--configs" in flags:  # e.g. 528x3,660x2: blocks x stages
        configs = tuple(tuple(map(int, c.split("x"))) for c in flags["--configs"].split(","))
    main("--lower" in sys.argv, modes, configs)
