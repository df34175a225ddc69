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
- `kvt`: V given transposed (`[D, N]`, tokens along the packed axis, as a cache could
  store its V pages): V^T's codes go to registers as K's do and are the P V GEMM's A
  operand, with no bf16 copy in shared memory.
`kv`, `kvw` and `kvt` are checked against a float32 reference (error from P rounded to bf16).
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
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from bench.common import interleave, op_measure

ROWS = 8  # query rows: wgmma's smallest N (GQA 32/8 has 4 a kv head)
D = 128
BLOCK = 64  # keys a step: wgmma's M
MODES = ("stream", "k", "kvv", "kv", "kvw", "kvt")
TOKENS = 64 * 8 * 16384  # B64 x 8 kv heads x ctx16384: 1 GiB of INT4 K and V
CONFIGS = ((264, 4), (396, 3), (528, 3))  # (blocks: 2-4 an SM, pipeline stages)


def stream_kernel(n_tokens: int, blocks: int, stages: int, mode: str):
    """The probe kernel: q `[ROWS, D]` bf16, k and v `[n_tokens, D]` int4 -> O^T
    `[blocks, D, ROWS]` float32, each block's attention over its `n_tokens // blocks`
    keys (zeros in modes without the P V GEMM)."""
    steps = n_tokens // BLOCK // blocks
    int4_tiles = (plgpu.TilingTransform((8, 128)), plgpu.SwizzleTransform(64))  # 64-byte rows
    bf16_tiles = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    wgmma, rows_of = plgpu.Layout.WGMMA, plgpu.Layout.WGMMA.reduce(0)
    vt_tiles = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(32))  # 32-byte rows
    transposed_v = mode == "kvt"  # v is V^T `[D, n_tokens]`: loads as K does
    has_v, has_pv = mode in ("kvv", "kv", "kvw", "kvt"), mode in ("kv", "kvw", "kvt")

    def kernel(q_ref, k_ref, v_ref, out_ref, q_smem, v_bf16, p_smem, o_smem, q_loaded):
        block = lax.axis_index("x")
        plgpu.copy_gmem_to_smem(q_ref, q_smem, q_loaded.at[0])
        plgpu.barrier_wait(q_loaded.at[0])
        acc = plgpu.layout_cast(jnp.zeros((D, ROWS), jnp.float32), wgmma)
        m = plgpu.layout_cast(jnp.full((ROWS,), -1e30, jnp.float32), rows_of)
        l = plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), rows_of)

        def step(_, k_smem, v_smem, carry):
            if mode == "stream":
                return carry
            acc, m, l = carry
            codes = plgpu.load(k_smem, (), layout=plgpu.Layout.WGMMA_UPCAST_4X)
            k = plgpu.layout_cast(codes, wgmma).astype(jnp.bfloat16)  # int4 relayout first

            def qk(s_ref):
                plgpu.wgmma(s_ref, k, plgpu.transpose_ref(q_smem, (1, 0)))
                return s_ref[...]

            s = pl.run_scoped(qk, plgpu.ACC((BLOCK, ROWS), jnp.float32))
            m_new = jnp.maximum(m, s.max(axis=0))
            if not has_v:
                return acc, m_new, l
            codes = plgpu.load(v_smem, (), layout=plgpu.Layout.WGMMA_UPCAST_4X)
            if transposed_v:  # V^T [D, 64 keys]: wgmma's A from registers
                v_t = plgpu.layout_cast(codes, wgmma).astype(jnp.bfloat16)
            elif mode == "kvw":
                v_bf16[...] = codes.astype(jnp.bfloat16)
            else:
                v_bf16[...] = plgpu.layout_cast(codes, wgmma).astype(jnp.bfloat16)
            if not has_pv:
                plgpu.commit_smem()
                return acc, m_new, l
            p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [1]))
            alpha = jnp.exp2(m - m_new)
            l = l * alpha + p.sum(axis=0)
            p_t = plgpu.layout_cast(p.astype(jnp.bfloat16), plgpu.Layout.WGMMA_TRANSPOSED)
            plgpu.transpose_ref(p_smem, (1, 0))[...] = p_t
            plgpu.commit_smem()
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [1])

            def pv(acc_ref):
                p_t = plgpu.transpose_ref(p_smem, (1, 0))
                a = v_t if transposed_v else plgpu.transpose_ref(v_bf16, (1, 0))
                plgpu.wgmma(acc_ref, a, p_t)

            return pl.run_state(pv)(plgpu.ACC.init(acc)), m_new, l

        tiles = plgpu.BlockSpec((BLOCK, D), lambda i: (block * steps + i, 0), transforms=int4_tiles)
        v_tiles = tiles
        if transposed_v:
            v_tiles = plgpu.BlockSpec(
                (D, BLOCK), lambda i: (0, block * steps + i), transforms=vt_tiles
            )
        pipeline = plgpu.emit_pipeline(
            step, grid=(steps,), in_specs=[tiles, v_tiles], max_concurrent_steps=stages,
            init_carry=(acc, m, l),
        )  # fmt: skip
        acc, m, l = pipeline(k_ref, v_ref)
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
            plgpu.SMEM((ROWS, BLOCK), jnp.bfloat16, transforms=bf16_tiles),
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
    (mode `kvt`)."""
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = (jax.random.normal(kq, (ROWS, D), jnp.float32) * 0.05).astype(jnp.bfloat16)
    codes = lambda key: jax.random.randint(key, (n_tokens, D), -8, 8, jnp.int8)  # noqa: E731
    v = codes(kv)
    return q, codes(kk).astype(jnp.int4), v.astype(jnp.int4), v.T.astype(jnp.int4)


def main(lower_only: bool, modes=MODES, configs=CONFIGS) -> None:
    out_dir = os.environ.get("OUT", ".")
    if lower_only:
        q, k, v, vt = inputs(BLOCK * 132 * 2)
        for mode in MODES:
            fn = jax.jit(stream_kernel(k.shape[0], 132, 2, mode))
            args = (q, k, vt if mode == "kvt" else v)
            text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
            print(mode, "lowers:", "mosaic_gpu" in text)
        return
    q, k, v, vt = inputs(TOKENS)
    small = BLOCK * 132 * 8
    args = {mode: (q, k, vt if mode == "kvt" else v) for mode in MODES}
    with open(os.path.join(out_dir, "probe.txt"), "a") as log:
        header = f"== {time.strftime('%H:%M', time.gmtime())} UTC {jax.devices()[0].device_kind}"
        print(header, f"jax {jax.__version__}", file=log, flush=True)
        for mode in ("kv", "kvw", "kvt"):
            v_small = vt[:, :small] if mode == "kvt" else v[:small]
            got = jax.jit(stream_kernel(small, 132, 2, mode))(q, k[:small], v_small)
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
            nbytes = blocks * (TOKENS // BLOCK // blocks) * BLOCK * D  # K and V, half a byte each
            for mode, timing in zip(modes, timings, strict=True):
                t = timing.median_s
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
