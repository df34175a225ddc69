"""Probe: how fast one kernel reads N bytes, by size (the ceiling small decode calls face).

Not a bench set (`bench/run.py`). The bench's copy ceiling moves 1 GiB; a B8 decode call
reads 64-160 MiB, where launch and ramp-up weigh more. For each size this times single-
kernel reads of 8 int8 arrays in rotation (`bench.common.op_measure`, chained as the bench
times short calls, 9 interleaved rounds): XLA reductions of three shapes, and a Pallas
Triton kernel of P programs streaming `[128, 128]` tiles in S stages (the decode kernel's
access shape). One line per variant, also appended to `$OUT/read.txt`:

    PYTHONPATH=. python3 bench/probe_read_ceiling.py
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from bench.common import interleave, op_measure

SIZES_MIB = (33, 66, 132, 165, 264, 528, 1056)  # multiples of 132 SMs' tiles
TILE = 128


def streaming_read(x, programs: int, stages: int):
    """Each of `programs` programs folds its `[rows, 128]` slice of x with max, a
    `[128, 128]` tile a step; `[programs, 128]` out."""
    rows = x.shape[0] // programs

    def kernel(x_ref, o_ref):
        p = pl.program_id(0)

        def step(i, acc):
            r = p * rows + i * TILE + jnp.arange(TILE)
            tile = x_ref[r[:, None], jnp.arange(TILE)[None, :]]
            return jnp.maximum(acc, tile.astype(jnp.int32))

        acc = jax.lax.fori_loop(0, rows // TILE, step, jnp.zeros((TILE, TILE), jnp.int32))
        o_ref[p, :] = jnp.max(acc, axis=0)

    return pl.pallas_call(
        kernel,
        grid=(programs,),
        in_specs=[pl.BlockSpec(x.shape, lambda i: (0, 0))],
        out_specs=pl.BlockSpec((programs, TILE), lambda i: (0, 0)),
        out_shape=jax.ShapeDtypeStruct((programs, TILE), jnp.int32),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=stages),
    )(x)


def main() -> None:
    fns = {
        "xla all": jax.jit(lambda x: jnp.max(x)),
        "xla rows": jax.jit(lambda x: jnp.max(x.reshape(-1, 4096), axis=1)),
        "xla cols": jax.jit(lambda x: jnp.max(x.reshape(-1, 128 * 1024), axis=0)),
    }
    for programs in (264, 528, 1056):
        for stages in (3, 4):
            read = functools.partial(streaming_read, programs=programs, stages=stages)
            fns[f"pallas {programs}x{stages}"] = jax.jit(read)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "read.txt"), "a") as log:
        for mib in SIZES_MIB:
            size = mib * 2**20
            keys = [jax.random.key(i) for i in range(8)]
            sets = [
                (jax.random.randint(k, (size // TILE, TILE), -100, 100, jnp.int8),) for k in keys
            ]
            timings = interleave([op_measure(fn, sets, warmup=3) for fn in fns.values()], reps=9)
            for name, timing in zip(fns, timings, strict=True):
                us = timing.median_s * 1e6
                line = f"read {mib} MiB {name:14s}: {us:7.1f} us = {size / us / 1e6:.3f} TB/s"
                print(line, flush=True)
                log.write(line + "\n")


if __name__ == "__main__":
    main()
