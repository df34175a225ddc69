"""Machine switches live in `util.py`; this exposes them as fixtures and in the header."""

from __future__ import annotations

import jax
import pytest
import util


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
