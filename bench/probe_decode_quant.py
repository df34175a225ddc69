"""Probe: tilings of the decode kernel over quantized caches, timed against each other.

Not a bench set (`bench/run.py`): a quick comparison while tuning
`PagedDecodeConfig.heuristic`. For each shape and cache format it builds one cache (GQA
32/8, D 128, pages of 16 scattered at random: `bench.decode_quant.QuantInputs`),
compiles the heuristic's tiling and each given one, checks every output against the
heuristic's, and times them interleaved (`bench.common.op_measure`, 9 rounds: calls
under 250 us run chained over the query sets). One line per tiling, also appended to
`$OUT/probe.txt`:

    PYTHONPATH=. python3 bench/probe_decode_quant.py --shapes 64x16384,8x8192 \
        --formats int8:D,float8_e4m3fn:D,int8:8 --tilings 64x2x3,128x4x3

Shapes are BxCONTEXT; formats DTYPE (per tensor), DTYPE:GROUP (per group) or DTYPE:D (one
group a row); --head-dim: D (128 unless given); tilings BLOCK_KVxWARPSxSTAGES with the
heuristic's split count, or BLOCK_KVxWARPSxSTAGESxSPLITS, either followed by "rROWS" to
pad the query rows to ROWS
(`PagedDecodeConfig.query_rows`; the heuristic's otherwise), then by "c" to read V as
codes rather than words (`PagedDecodeConfig.v_words`), then by "s" to apply group scales
through stacked rows (`PagedDecodeConfig.stacked`; off otherwise), then by "k" to read INT4
K as half-words (`PagedDecodeConfig.k_words`; off otherwise), then by "p" to read rows of a
head dim that is no power of two as one padded tile (`PagedDecodeConfig.segments` off).
"""

from __future__ import annotations

import argparse
import os

import jax.numpy as jnp

import jaxattn
from bench.common import interleave, op_measure
from bench.decode import DecodeRow, config_label, ours, parse_config
from bench.decode_quant import HEADS, QuantInputs
from jaxattn.decode import default_decode_config


def _quant(spec: str):
    dtype, _, group = spec.partition(":")
    if not group:
        return jaxattn.KVQuant(dtype)
    return jaxattn.KVQuant(dtype, "group", None if group == "D" else int(group))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="64x16384,8x8192")
    parser.add_argument("--formats", default="int8,int8:8,int8:D,float8_e4m3fn:32,int4:32")
    parser.add_argument("--tilings", default="64x2x3,128x4x3")
    parser.add_argument("--head-dim", type=int, default=HEADS[2])
    args = parser.parse_args()
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "probe.txt"), "a") as log:
        _probe(args, log)


def _probe(args, log) -> None:
    for shape in args.shapes.split(","):
        batch, context = map(int, shape.split("x"))
        heads = (*HEADS[:2], args.head_dim, *HEADS[3:])
        inputs = QuantInputs.make(DecodeRow(batch, context), heads)
        for spec in args.formats.split(","):
            cache = inputs.cache(_quant(spec))
            arg_sets = inputs.arg_sets(cache)
            chosen = default_decode_config(cache, batch, context, heads[0] // heads[1])
            configs = {"heuristic": chosen}
            for tiling in args.tilings.split(","):
                configs[tiling] = parse_config(tiling, chosen)
            fns = {name: ours(c) for name, c in configs.items()}
            want = fns["heuristic"](*arg_sets[0]).astype(jnp.float32)
            measures = [op_measure(fn, arg_sets, warmup=3) for fn in fns.values()]
            timings = interleave(measures, reps=9)
            for (name, c), fn, timing in zip(configs.items(), fns.values(), timings, strict=True):
                diff = float(jnp.max(jnp.abs(fn(*arg_sets[0]).astype(jnp.float32) - want)))
                line = (
                    f"B{batch} ctx{context} D{args.head_dim} {spec:18s} {name:10s} "
                    f"{config_label(c)}: "
                    f"{timing.median_s * 1e3:.3f} ms, max |diff| vs heuristic {diff:.2g}"
                )
                print(line, flush=True)
                log.write(line + "\n")


if __name__ == "__main__":
    main()
