"""Command line: `python -m bench.run [--sets a,b] [--smoke] [--sweep] [--no-write] [--reps N]`.

Measures the ceilings once, runs each named set, prints one table per set, and (unless
--no-write, or --smoke without --write) puts them on top of bench/RESULTS.md (older runs
of the same sets move to bench/HISTORY.md) and rewrites
bench/results.json and bench/plots/<set>.png. Exits 1 if an output failed its check or a
set crashed.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Callable

from bench import (
    decode,
    decode_quant,
    model,
    ppl,
    prefill,
    report,
    scale,
    serving,
    train,
    train_packed,
)
from bench.common import SetResult, Settings, describe_error, measure_ceilings

# A set takes the settings and returns its rows; new sets (decode, ...) register here.
SETS: dict[str, Callable[[Settings], SetResult]] = {
    "prefill": prefill.prefill_set,
    "prefill_packed": prefill.packed_set,
    "decode": decode.decode_set,
    "decode_quant": decode_quant.decode_quant_set,
    "serving_mixed": serving.mixed_set,
    "serving_chunk": serving.chunk_set,
    "ppl": ppl.ppl_set,
    "ppl_mixed": ppl.ppl_mixed_set,
    "model": model.model_set,
    "train": train.train_set,
    "train_packed": train_packed.train_packed_set,
    "scale": scale.scale_set,
}


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.run",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--sets", default=",".join(SETS), help=f"comma-separated, of {list(SETS)}")
    parser.add_argument("--smoke", action="store_true", help="CPU-sized shapes (interpret mode)")
    parser.add_argument("--sweep", action="store_true", help="also time kernel config variants")
    parser.add_argument(
        "--sweep-configs",
        help="comma-separated variants for --sweep, e.g. 128x64x8x3 "
        "(prefill: block_q x block_kv x num_warps x num_stages); default: each set's list",
    )
    parser.add_argument("--reps", type=int, help="measurements per row (default 20; smoke 2)")
    parser.add_argument("--warmup", type=int, help="untimed calls per row (default 3; smoke 1)")
    parser.add_argument(
        "--write",
        action=argparse.BooleanOptionalAction,
        help="write RESULTS.md, results.json and plots (default: yes, except with --smoke)",
    )
    args = parser.parse_args(argv)
    args.sets = args.sets.split(",")
    unknown = [name for name in args.sets if name not in SETS]
    if unknown:
        parser.error(f"unknown sets {unknown}; known: {list(SETS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    if args.reps is None:
        args.reps = 2 if args.smoke else 20
    if args.warmup is None:
        args.warmup = 1 if args.smoke else 3
    print("measuring ceilings", flush=True)
    settings = Settings(
        smoke=args.smoke,
        reps=args.reps,
        warmup=args.warmup,
        sweep=args.sweep or args.sweep_configs is not None,
        sweep_configs=tuple(args.sweep_configs.split(",")) if args.sweep_configs else None,
        ceilings=measure_ceilings(smoke=args.smoke, reps=args.reps),
    )
    results = []
    crashed = []
    for name in args.sets:
        print(f"set {name}", flush=True)
        try:
            results.append(SETS[name](settings))
        except Exception as e:  # Keep the other sets' rows: a GPU call is expensive.
            traceback.print_exc()
            crashed.append(name)
            results.append(SetResult(name, "CRASHED: " + describe_error(e), rows=[]))

    metadata = report.run_metadata()
    section = report.format_section(results, settings, metadata)
    print("\n" + section)
    if args.write if args.write is not None else not args.smoke:
        report.write_results(results, settings, metadata, section)
    return int(bool(crashed) or any(row.status == "FAILED" for r in results for row in r.rows))


if __name__ == "__main__":
    sys.exit(main())
