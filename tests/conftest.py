"""Machine switches live in `util.py`; this exposes them as fixtures and in the header,
and `--sample` thins the parametrized cases for the CPU suite (`make test`)."""

from __future__ import annotations

import collections
import zlib

import jax
import pytest
import util

# Parameters whose every value a sampled run keeps: each is sampled apart (the XLA path
# and the Pallas kernels both run in every parametrized test).
_EVERY_VALUE = ("impl", "implementation")


def pytest_addoption(parser):
    parser.addoption(
        "--sample",
        type=int,
        default=1,
        metavar="K",
        help="of each parametrized test's cases (per value of an implementation parameter), "
        "run the first and every K-th after it, the offset varying by test, so that the "
        "cases one test leaves out others run; 1 (default): every case",
    )


def pytest_collection_modifyitems(config, items):
    """`--sample K`: a deterministic 1/K of each parametrized test's cases and its first
    (the same on every xdist worker), but every case of a test marked `every_case` (cheap
    cases: under 0.3 s each on CPU, 2026-11-27). `make test` samples: on 2 CPU cores the
    interpret-mode kernels' compiles make the whole matrix take over 20 minutes; `make
    test-full` and the GPU suite run every case."""
    k = config.getoption("--sample")
    if k <= 1:
        return
    groups = collections.defaultdict(list)
    for item in items:
        spec = getattr(item, "callspec", None)
        if spec is not None and item.get_closest_marker("every_case") is None:
            kept = tuple(spec.params.get(name) for name in _EVERY_VALUE if name in spec.params)
            groups[(item.path.name, item.originalname, repr(kept))].append(item)
    dropped = set()
    for (path, name, _), cases in groups.items():
        offset = zlib.crc32(f"{path}::{name}".encode()) % k
        dropped.update(item for i, item in enumerate(cases) if i and (i + offset) % k)
    if dropped:
        config.hook.pytest_deselected(items=[item for item in items if item in dropped])
        items[:] = [item for item in items if item not in dropped]


def pytest_report_header(config):
    mode = "compiled Pallas kernels" if util.ON_GPU else "Pallas interpret mode"
    return (
        f"jaxattn tests: jax {jax.__version__}, backend {jax.default_backend()} ({mode}); "
        f"case dtypes {util.CASE_DTYPES}, head dims {util.HEAD_DIMS}"
    )


@pytest.fixture
def on_gpu() -> bool:
    return util.ON_GPU


@pytest.fixture
def config():
    """The `config=` to pass to the ops: heuristic (None) on a GPU, small tiles on CPU."""
    return util.kernel_config()
