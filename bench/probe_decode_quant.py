"""Probe: tilings of the decode kernel over quantized caches, timed against each other.

Not a bench set (`bench/run.py`): a quick comparison while tuning
`PagedDecodeConfig.heuristic`. For each shape and cache format it builds one cache (GQA
32/8, D 128, pages of 16 scattered at random, the K/V of `bench/decode_quant.py`),
compiles the heuristic's tiling and each given one, checks every output against the
heuristic's, and times them interleaved (medians of 9 rounds of 10 calls). One line per
tiling, also appended to `$OUT/probe.txt`:

    PYTHONPATH=. python3 bench/probe_decode_quant.py --shapes 64x16384,8x8192 \
        --formats int8:D,float8_e4m3fn:D,int8:8 --tilings 64x2x3,128x4x3

Shapes are BxCONTEXT; formats DTYPE (per tensor), DTYPE:GROUP (per group) or DTYPE:D (one
group a row); tilings BLOCK_KVxWARPSxSTAGES, with the heuristic's split count.
"""

from __future__ import annotations

import argparse
import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxattn
from jaxattn.decode import default_decode_config

HQ, HKV, D, PAGE = 32, 8, 128, 16


def _quant(spec: str):
    dtype, _, group = spec.partition(":")
    if not group:
        return jaxattn.KVQuant(dtype)
    return jaxattn.KVQuant(dtype, "group", None if group == "D" else int(group))


def _cache(quant, batch: int, context: int):
    """(q, cache, tables, lengths): one scattered cache of `batch` rows of `context`."""
    pages = batch * context // PAGE
    keys = jax.random.split(jax.random.key(7), 3)
    k, v = (jax.random.normal(x, (pages * PAGE, HKV, D), jnp.bfloat16) for x in keys[:2])
    q = jax.random.normal(keys[2], (batch, HQ, D), jnp.bfloat16)
    tables = np.random.default_rng(7).permutation(pages).reshape(batch, -1)
    slots = jnp.asarray((tables[:, :, None] * PAGE + np.arange(PAGE)).reshape(-1), jnp.int32)
    scales = {}
    if quant.granularity == "tensor":
        k_scale, v_scale = jaxattn.calibrate_kv_scales(k, v, quant)
        scales = dict(k_scale=k_scale, v_scale=v_scale)
    cache = jaxattn.PagedKVCache.create(pages, PAGE, HKV, D, quant=quant, **scales)
    cache = jax.jit(jaxattn.write_kv, donate_argnums=0)(cache, k, v, slots)
    lengths = jnp.full((batch,), context, jnp.int32)
    return q, cache, jnp.asarray(tables, jnp.int32), lengths


def _median_ms(fns: dict, args: tuple, rounds: int = 9, calls: int = 10) -> dict:
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            jax.block_until_ready(fn(*args))
            start = time.perf_counter()
            for _ in range(calls):
                out = fn(*args)
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - start) / calls * 1e3)
    return {name: float(np.median(x)) for name, x in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="64x16384,8x8192")
    parser.add_argument("--formats", default="int8,int8:8,int8:D,float8_e4m3fn:32,int4:32")
    parser.add_argument("--tilings", default="64x2x3,128x4x3")
    args = parser.parse_args()
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "probe.txt"), "a") as log:
        _probe(args, log)


def _probe(args, log) -> None:
    for shape in args.shapes.split(","):
        batch, context = map(int, shape.split("x"))
        for spec in args.formats.split(","):
            quant = _quant(spec)
            inputs = _cache(quant, batch, context)
            chosen = default_decode_config(inputs[1], batch, context)
            configs = {"heuristic": chosen}
            for tiling in args.tilings.split(","):
                block_kv, warps, stages = map(int, tiling.split("x"))
                configs[tiling] = jaxattn.PagedDecodeConfig(
                    block_kv, chosen.num_splits, warps, stages
                )
            fns = {
                name: jax.jit(
                    functools.partial(jaxattn.paged_decode, implementation="pallas", config=c)
                )
                for name, c in configs.items()
            }
            outs = {name: fn(*inputs).astype(jnp.float32) for name, fn in fns.items()}
            times = _median_ms(fns, inputs)
            for name, ms in times.items():
                c = configs[name]
                diff = float(jnp.max(jnp.abs(outs[name] - outs["heuristic"])))
                line = (
                    f"B{batch} ctx{context} {spec:18s} {name:10s} "
                    f"{c.block_kv}x{c.num_warps}x{c.num_stages}x{c.num_splits}: "
                    f"{ms:.3f} ms, max |diff| vs heuristic {diff:.2g}"
                )
                print(line, flush=True)
                log.write(line + "\n")


if __name__ == "__main__":
    main()
