"""Results of a run: markdown tables (stdout and bench/RESULTS.md, the latest run of each
set; older runs in bench/HISTORY.md), results.json, plots."""

from __future__ import annotations

import dataclasses
import datetime
import json
from pathlib import Path

import jax

from bench import history
from bench.common import Row, SetResult, Settings

BENCH_DIR = Path(__file__).parent


def _number(x: float | None, digits: int) -> str:
    return "" if x is None else f"{x:.{digits}f}"


def _rate(x: float | None) -> str:
    """Three significant digits: 404 TFLOP/s on an H100, 0.0213 on a CPU smoke run."""
    return "" if x is None else f"{x:.3g}"


def format_row(row: Row) -> str:
    spread = "" if row.min_ms is None else f"{row.min_ms:.3f}..{row.max_ms:.3f}"
    impl = f"{row.impl} (sweep)" if row.sweep else row.impl
    cells = [
        row.shape,
        impl,
        row.status,
        _number(row.time_ms, 3),
        spread,
        _rate(row.rate),
        _number(row.pct_ceiling, 0),
        row.notes.replace("|", "\\|"),
    ]
    return "| " + " | ".join(cells) + " |"


def format_table(result: SetResult) -> str:
    unit = result.rows[0].unit if result.rows else "TFLOP/s"
    lines = [
        f"### {result.name} ({result.description})",
        "",
        f"| shape | impl | status | median ms | min..max ms | {unit} | % ceiling | notes |",
        "|---|---|---|---:|---|---:|---:|---|",
        *(format_row(row) for row in result.rows),
    ]
    return "\n".join(lines)


def format_section(results: list[SetResult], settings: Settings, metadata: dict) -> str:
    """A dated section: device, jax version, this run's ceilings, one table per set."""
    c = settings.ceilings
    lines = [
        f"## {metadata['date']} - {metadata['device']}, jax {metadata['jax_version']}"
        + (" (smoke)" if settings.smoke else ""),
        "",
        f"Ceilings (this run): bf16 {c.matmul_n}^3 matmul {_rate(c.matmul_tflops)} TFLOP/s; "
        f"device copy of {c.copy_bytes / 2**20:.0f} MiB {_rate(c.copy_tbps)} TB/s "
        "(read + write). Median of "
        f"{settings.reps} measurements of >= 20 ms of back-to-back calls on rotated inputs.",
        "",
    ]
    for result in results:
        lines += [format_table(result), ""]
    return "\n".join(lines)


def run_metadata() -> dict:
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": jax.devices()[0].device_kind,
        "backend": jax.default_backend(),
        "jax_version": jax.__version__,
    }


def write_results(
    results: list[SetResult], settings: Settings, metadata: dict, section: str
) -> None:
    """Puts `section` on top of RESULTS.md, moving the runs of the same sets it replaces
    to HISTORY.md (`bench.history`); replaces this run's sets in results.json (other
    sets, from earlier runs, stay, each with its run's metadata) and their plots."""
    history.write(BENCH_DIR / "RESULTS.md", BENCH_DIR / "HISTORY.md", section)
    run = {**metadata, "settings": dataclasses.asdict(settings)}
    sets = {}
    results_json = BENCH_DIR / "results.json"
    if results_json.exists():
        old = json.loads(results_json.read_text())
        sets = {s["name"]: s for s in old.get("sets", []) if "run" in s}
    sets.update({r.name: {**dataclasses.asdict(r), "run": run} for r in results})
    results_json.write_text(json.dumps({"sets": list(sets.values())}, indent=1) + "\n")
    for result in results:
        _plot(result, metadata, BENCH_DIR / "plots" / f"{result.name}.png")


def _plot(result: SetResult, metadata: dict, path: Path) -> None:
    """Bars of the rate by shape and implementation (timed, non-sweep rows)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = [r for r in result.rows if r.status == "ok" and not r.sweep]
    if not rows:
        return
    shapes = list(dict.fromkeys(r.shape for r in rows))
    impls = list(dict.fromkeys(r.impl for r in rows))
    width = 0.8 / len(impls)
    fig, ax = plt.subplots(figsize=(max(6, 1.8 * len(shapes)), 4))
    for i, impl in enumerate(impls):
        rates = {r.shape: r.rate for r in rows if r.impl == impl}
        xs = [s + (i - (len(impls) - 1) / 2) * width for s in range(len(shapes))]
        ax.bar(xs, [rates.get(shape, 0.0) for shape in shapes], width, label=impl)
    ax.set_xticks(range(len(shapes)), shapes, fontsize=8)
    ax.set_ylabel(rows[0].unit)
    ax.set_title(f"{result.name}: {result.description}\n{metadata['device']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
