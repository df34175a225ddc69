"""Measurement shared by the benchmark sets: timing, ceilings, the correctness gate, rows.

Method (METHOD.md; STYLE.md guideline 9): check each output against a reference before
timing it; warm up so compilation stays out of the numbers; per measurement, dispatch
enough back-to-back calls to last >= 20 ms and wait for the last one (calls run in order
on one stream), then take the median over measurements; calls under 250 us run chained
over their input sets in jitted programs of >= 2 ms (`chain`), so that host dispatch
does not set their time; rotate input sets so the L2 cache cannot serve repeated runs;
report rates against ceilings measured in the same process. The implementations of one
row are measured in turn (`interleave`: one measurement of each per round), so that a
drift of the clocks during the row lands on all of them rather than on whichever ran
last.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

L2_BYTES = 50 * 2**20  # H100 L2; rotated inputs should span several times this.
MAX_INPUT_SETS = 8
MIN_MEASUREMENT_S = 0.02  # Host clock and dispatch overheads vanish at this length.

# Relative Frobenius error allowed against a float32 reference, by input dtype.
TOLERANCES = {jnp.dtype(jnp.bfloat16): 2e-2, jnp.dtype(jnp.float16): 1e-2}


@dataclasses.dataclass(frozen=True)
class Ceilings:
    """Device limits measured in this process, the denominators of "% of ceiling"."""

    matmul_tflops: float  # bf16 [n, n] x [n, n]
    matmul_n: int
    copy_tbps: float  # bytes read + bytes written
    copy_bytes: int  # size of the copied array


@dataclasses.dataclass(frozen=True)
class Settings:
    """What the command line asked for; every set receives it."""

    smoke: bool  # CPU-sized shapes; Pallas kernels in interpret mode.
    reps: int  # measurements per timed row (median over these).
    warmup: int  # untimed calls before measuring (after the compile).
    sweep: bool  # also time config variants of our kernel.
    sweep_configs: tuple[str, ...] | None  # set-specific config specs; None: set default.
    ceilings: Ceilings


@dataclasses.dataclass(frozen=True)
class Timing:
    """Seconds per call: median and extremes over the measurements."""

    median_s: float
    min_s: float
    max_s: float


@dataclasses.dataclass(frozen=True)
class Row:
    """One implementation on one shape.

    status: "ok" (checked and timed), "FAILED" (wrong output, or our kernel raised),
    "error" (a sweep variant raised, e.g. did not compile) or "skipped" (a peer that
    cannot run here); only "ok" rows carry times and rates.
    """

    set_name: str
    shape: str
    impl: str
    status: str
    time_ms: float | None = None
    min_ms: float | None = None
    max_ms: float | None = None
    rate: float | None = None  # in `unit`
    unit: str = "TFLOP/s"  # or "TB/s"
    pct_ceiling: float | None = None
    notes: str = ""
    sweep: bool = False  # a config variant, not the default choice


@dataclasses.dataclass(frozen=True)
class SetResult:
    name: str
    description: str  # dtype, heads, head dim: what every row of the set shares
    rows: list[Row]


CHAIN_BELOW_S = 250e-6  # Calls shorter than this run chained over their input sets,
MIN_CHAIN_S = 2e-3  # in programs repeating the chain to last at least this long,
MAX_CHAIN_REPEATS = 64  # up to this many times (`chain`).


def _run_calls(fn: Callable, arg_sets: Sequence[tuple], calls: int) -> None:
    out = None
    for i in range(calls):
        out = fn(*arg_sets[i % len(arg_sets)])
    jax.block_until_ready(out)


def _fastest_s(fn: Callable, arg_sets: Sequence[tuple], calls: int, tries: int = 3) -> float:
    """The shortest of `tries` timings of `calls` calls: a sizing estimate that one host
    hiccup cannot inflate (a chain sized on one slow timing stays short enough to time
    its own dispatch)."""
    times = []
    for _ in range(tries):
        start = time.perf_counter()
        _run_calls(fn, arg_sets, calls)
        times.append(time.perf_counter() - start)
    return min(times)


def chain(fn: Callable, repeats: int = 1) -> Callable:
    """One jitted program calling `fn` on each of its argument tuples in turn, `repeats`
    times over.

    Short calls dispatched one by one from the host measure the dispatch, not the device;
    so does a program of a few of them (its dispatch takes about as long as their device
    time, and varies). Chained in a long enough program they run back to back on the
    device. The tuples must be distinct arrays (XLA merges calls on the same inputs), and
    every output is returned, so no call is dead code. With `repeats > 1`, `fn` must
    return an array like its first argument (attention: out like q): each call after the
    first takes the previous call's output there, so no call repeats another's inputs.
    """

    def run(sets):
        outs = []
        for _ in range(repeats):
            for first, *rest in sets:
                outs.append(fn(outs[-1] if repeats > 1 and outs else first, *rest))
        return outs

    return jax.jit(run)


def _feeds_back(fn: Callable, args: tuple) -> bool:
    """Whether `fn(*args)` is an array of its first argument's shape and dtype."""
    out, first = jax.eval_shape(fn, *args), args[0]
    shape = getattr(out, "shape", None)
    return shape == getattr(first, "shape", ()) and out.dtype == getattr(first, "dtype", None)


Measure = Callable[[], float]  # one measurement: seconds per call


def interleave(measures: Sequence[Measure], reps: int) -> list[Timing]:
    """`reps` rounds of one measurement of each; the median and extremes of each."""
    samples = [[] for _ in measures]
    for _ in range(reps):
        for measure, taken in zip(measures, samples, strict=True):
            taken.append(measure())
    return [Timing(statistics.median(x), min(x), max(x)) for x in samples]


def time_op(fn: Callable, arg_sets: Sequence[tuple], *, warmup: int, reps: int) -> Timing:
    """Times jitted `fn` over argument tuples taken in rotation (`op_measure`)."""
    return interleave([op_measure(fn, arg_sets, warmup=warmup)], reps)[0]


def op_measure(fn: Callable, arg_sets: Sequence[tuple], *, warmup: int) -> Measure:
    """Warms jitted `fn` up (compiling it) and returns its measurement: enough calls over
    the argument tuples, taken in rotation, to last MIN_MEASUREMENT_S.

    Calls shorter than CHAIN_BELOW_S with several input sets are timed as `chain`s over
    all the sets, repeated to last MIN_CHAIN_S (each measurement divided by the number of
    calls in the chain).
    """
    _run_calls(fn, arg_sets, max(warmup, 1))
    per_call = _fastest_s(fn, arg_sets, len(arg_sets)) / len(arg_sets)
    scale = 1
    if per_call < CHAIN_BELOW_S and len(arg_sets) > 1:
        repeats, most = 1, MAX_CHAIN_REPEATS if _feeds_back(fn, arg_sets[0]) else 1
        while True:
            chained, sets = chain(fn, repeats), [(tuple(arg_sets),)]
            _run_calls(chained, sets, max(warmup, 1))
            per_call = _fastest_s(chained, sets, 1)
            if per_call >= MIN_CHAIN_S or repeats >= most:
                break
            repeats = min(most, repeats * math.ceil(MIN_CHAIN_S / per_call))
        fn, arg_sets, scale = chained, sets, len(arg_sets) * repeats
    calls = max(len(arg_sets), math.ceil(MIN_MEASUREMENT_S / per_call))

    def measure() -> float:
        start = time.perf_counter()
        _run_calls(fn, arg_sets, calls)
        return (time.perf_counter() - start) / calls / scale

    return measure


def time_carried(step: Callable, carry, args: tuple, settings: Settings, steps: int) -> Timing:
    """Seconds per call of `step` (`carried_measure`), `settings.reps` measurements."""
    return interleave([carried_measure(step, carry, args, settings, steps)], settings.reps)[0]


def carried_measure(step: Callable, carry, args: tuple, settings: Settings, steps: int) -> Measure:
    """The measurement of `step(carry, *args) -> (carry, y)`, a call that updates state (a
    KV cache): `steps` calls run in one jitted loop that carries `carry`, donated so it is
    updated in place as in a serving loop; a scalar of each `y` is kept alive. Warms up
    (compiles) first; the measurement runs enough loops to last MIN_MEASUREMENT_S."""

    def loop(carry, *args):
        def body(_, loop_carry):
            carry, acc = loop_carry
            carry, y = step(carry, *args)
            return carry, acc + jnp.ravel(y)[0].astype(jnp.float32)

        return jax.lax.fori_loop(0, steps, body, (carry, jnp.float32(0)))

    run = jax.jit(loop, donate_argnums=0)
    carry = jax.tree.map(jnp.copy, carry)  # ours to donate
    for _ in range(max(settings.warmup, 1)):
        carry, acc = run(carry, *args)
    jax.block_until_ready(acc)
    start = time.perf_counter()
    carry, acc = jax.block_until_ready(run(carry, *args))
    calls = max(1, math.ceil(MIN_MEASUREMENT_S / (time.perf_counter() - start)))

    def measure() -> float:
        nonlocal carry, acc
        start = time.perf_counter()
        for _ in range(calls):
            carry, acc = run(carry, *args)
        jax.block_until_ready(acc)
        return (time.perf_counter() - start) / calls / steps

    return measure


def num_input_sets(bytes_per_set: int) -> int:
    """How many distinct input sets to rotate so that together they span 3x the L2."""
    return min(MAX_INPUT_SETS, max(2, math.ceil(3 * L2_BYTES / bytes_per_set)))


def measure_ceilings(*, smoke: bool, reps: int) -> Ceilings:
    """A bf16 8192^3 matmul and a 1 GiB device copy (small sizes with `smoke`)."""
    n = 512 if smoke else 8192
    keys = jax.random.split(jax.random.key(0), 4)
    operands = [
        (
            jax.random.normal(keys[2 * i], (n, n), jnp.bfloat16),
            jax.random.normal(keys[2 * i + 1], (n, n), jnp.bfloat16),
        )
        for i in range(2)
    ]
    t_matmul = time_op(jax.jit(jnp.matmul), operands, warmup=3, reps=reps)

    # Negation: one read and one write per element, which XLA cannot elide as it may a copy.
    copy_bytes = 2**24 if smoke else 2**30
    x = jax.random.normal(keys[0], (copy_bytes // 4,), jnp.float32)
    t_copy = time_op(jax.jit(jnp.negative), [(x,)], warmup=3, reps=reps)
    return Ceilings(
        matmul_tflops=2 * n**3 / t_matmul.median_s / 1e12,
        matmul_n=n,
        copy_tbps=2 * copy_bytes / t_copy.median_s / 1e12,
        copy_bytes=copy_bytes,
    )


def relative_error(out: jax.Array, ref: jax.Array) -> float:
    """||out - ref|| / ||ref|| (Frobenius), computed in float32."""
    out = jnp.asarray(out, jnp.float32)
    ref = jnp.asarray(ref, jnp.float32)
    return float(jnp.sqrt(jnp.sum((out - ref) ** 2) / jnp.sum(ref**2)))


def check_close(out, ref, name: str, tol: float) -> tuple[bool, str]:
    """(passed, message); NaN never passes. `out` and `ref` are arrays, or tuples of arrays
    (gradients) checked each against its reference: every error must pass, and the
    message lists them in order."""
    outs, refs = (out, ref) if isinstance(ref, tuple) else ((out,), (ref,))
    if not isinstance(outs, tuple) or len(outs) != len(refs):
        return False, f"{name}: {type(out).__name__} output, reference of {len(refs)} arrays"
    for o, r in zip(outs, refs, strict=True):
        if o.shape != r.shape:
            return False, f"{name}: shape {o.shape} != reference {r.shape}"
    errs = [relative_error(o, r) for o, r in zip(outs, refs, strict=True)]
    passed = all(err <= tol for err in errs)  # False for NaN
    listed = "/".join(f"{err:.1e}" for err in errs)
    return passed, f"err {listed}" if passed else f"{name}: rel err {listed} > tol {tol:.0e}"


def describe_error(e: Exception) -> str:
    first_line = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first_line[:160]}"


def backend_label(config, triton: str, mosaic: str) -> str:
    """The spec of the kernel(s) a config with a `backend` field runs, given each
    backend's spec; "auto" names both candidates."""
    return {"triton": triton, "mosaic": mosaic}.get(config.backend, f"auto {mosaic} | {triton}")


def with_backend(config, tiling):
    """`config` with the backend a `select_forward` / `select_backward` picked spelled out:
    "mosaic" and its tiling, or "triton" where it picked none (the same kernels run as
    with "auto"; the row's label names them)."""
    if tiling is None:
        return dataclasses.replace(config, backend="triton")
    return dataclasses.replace(config, backend="mosaic", mosaic=tiling)


def join_notes(*notes: str) -> str:
    return "; ".join(n for n in notes if n)


def progress(row: Row) -> Row:
    """Prints `row` as it is measured (the final table comes at the end); returns it."""
    timing = f"{row.time_ms:9.3f} ms {row.rate:7.3g} {row.unit}" if row.status == "ok" else ""
    print(f"  {row.shape:30} {row.impl:10} {row.status:7} {timing}  {row.notes}", flush=True)
    return row


@dataclasses.dataclass(frozen=True)
class Entry:
    """One implementation of a row: `fn` called on `arg_sets`; `on_error` is the status of
    its row when the call raises ("FAILED", "error" or "skipped")."""

    impl: str
    fn: Callable
    arg_sets: Sequence[tuple]
    on_error: str = "skipped"
    notes: str = ""
    sweep: bool = False  # a config variant, not the default choice


def bench_row(
    settings: Settings,
    entries: Sequence[Entry],
    *,
    set_name: str,
    shape: str,
    ref: jax.Array | None,
    tol: float,
    work: float,
    unit: str = "TFLOP/s",
) -> list[Row]:
    """Checks each entry's `fn(*arg_sets[0])` against `ref`, then times the entries that
    passed, interleaved (`interleave`); one row per entry, in their order.

    `work` is FLOPs (unit "TFLOP/s") or bytes (unit "TB/s") per call. A row whose output
    is wrong is FAILED and not timed. With no reference (too large), the rows are timed
    and their notes say "unchecked".
    """
    rows, measures = [], []
    for e in entries:
        row = Row(set_name, shape, e.impl, "ok", unit=unit, notes=e.notes, sweep=e.sweep)
        status, measure = "ok", None
        try:
            out = jax.block_until_ready(e.fn(*e.arg_sets[0]))
            check = "unchecked: reference too large"
            if ref is not None:
                passed, check = check_close(out, ref, f"{e.impl} {shape}", tol)
                status = "ok" if passed else "FAILED"
            del out
            if status == "ok":
                measure = op_measure(e.fn, e.arg_sets, warmup=settings.warmup)
        except Exception as err:  # A peer missing here, a config that does not compile,
            status, check = e.on_error, describe_error(err)  # or out of memory.
        rows.append(dataclasses.replace(row, status=status, notes=join_notes(e.notes, check)))
        measures.append(measure)
    timed = [i for i, m in enumerate(measures) if m is not None]
    timings = interleave([measures[i] for i in timed], settings.reps)
    for i, timing in zip(timed, timings, strict=True):
        rows[i] = with_timing(settings, rows[i], timing, work)
    return [progress(row) for row in rows]


def bench_impl(settings: Settings, *, impl: str, fn: Callable, arg_sets: Sequence[tuple],
               on_error: str = "skipped", notes: str = "", sweep: bool = False,
               **row_args) -> Row:  # fmt: skip
    """One implementation alone: `bench_row` of one `Entry`."""
    entry = Entry(impl, fn, arg_sets, on_error, notes, sweep)
    return bench_row(settings, [entry], **row_args)[0]


def timed_row(settings: Settings, row: Row, timing: Timing, work: float, notes: str | None = None,
              **rate) -> Row:  # fmt: skip
    """`with_timing` (`rate`: its `rate` and `work_unit`), with `notes` in place of the
    row's when given; printed as it is returned."""
    if notes is not None:
        row = dataclasses.replace(row, notes=notes)
    return progress(with_timing(settings, row, timing, work, **rate))


def with_timing(
    settings: Settings,
    row: Row,
    timing: Timing,
    work: float,
    *,
    rate: float | None = None,
    work_unit: str | None = None,
) -> Row:
    """`row` with its times, its rate (default: `work` per second in `row.unit`) and the
    share of this run's ceiling that `work` per second reaches (`work_unit`, default
    `row.unit`: "TFLOP/s" against the matmul ceiling, else bytes against the copy
    ceiling)."""
    throughput = work / timing.median_s / 1e12
    c = settings.ceilings
    ceiling = c.matmul_tflops if (work_unit or row.unit) == "TFLOP/s" else c.copy_tbps
    return dataclasses.replace(
        row,
        time_ms=timing.median_s * 1e3,
        min_ms=timing.min_s * 1e3,
        max_ms=timing.max_s * 1e3,
        rate=throughput if rate is None else rate,
        pct_ceiling=100 * throughput / ceiling,
    )


@dataclasses.dataclass(frozen=True)
class Sweep:
    """How a set names its kernel configs: spec string <-> config, and the default variants."""

    parse: Callable[[str], object]  # "128x64x8x3" -> config; raises ValueError if malformed
    label: Callable[[object], str]  # config -> its spec string
    default: tuple[str, ...]


def ours_entries(
    settings: Settings,
    *,
    sweep: Sweep,
    make_fn: Callable,
    config,
    arg_sets: Sequence[tuple],
    notes: str = "",
) -> list[Entry]:
    """Our kernel with the heuristic `config` (first); with `settings.sweep`, its config
    variants after it. `make_fn(config)` returns the jitted call. A malformed spec becomes
    a variant whose call raises its error (an "error" row)."""
    label = f"config {sweep.label(config)} (heuristic)"
    entries = [Entry("ours", make_fn(config), arg_sets, "FAILED", join_notes(notes, label))]
    for spec in (settings.sweep_configs or sweep.default) if settings.sweep else ():
        try:
            fn = make_fn(sweep.parse(spec))
        except ValueError as e:  # A malformed spec or an invalid block size.
            fn = functools.partial(_raise, e)
        entries.append(Entry("ours", fn, arg_sets, "error", f"sweep {spec}", sweep=True))
    return entries


def _raise(error: Exception, *args):
    raise error


def mark_best(rows: Sequence[Row]) -> list[Row]:
    """Our rows as `ours_entries` ordered them (the heuristic's, then variants): the
    fastest variant's notes say "BEST" and its speed-up over the heuristic."""
    main, *variants = rows
    timed = [r for r in variants if r.status == "ok"]
    if timed and main.time_ms:
        best = min(timed, key=lambda r: r.time_ms)
        speedup = f"{main.time_ms / best.time_ms:.2f}x vs heuristic"
        variants[variants.index(best)] = dataclasses.replace(
            best, notes=join_notes(best.notes, "BEST", speedup)
        )
    return [main, *variants]


def bench_ours(settings: Settings, row_args: dict, **ours) -> list[Row]:
    """`ours_entries(settings, **ours)` timed by `bench_row(settings, entries, **row_args)`
    (set_name, shape, ref, tol, work, unit), with the BEST variant marked."""
    return mark_best(bench_row(settings, ours_entries(settings, **ours), **row_args))
