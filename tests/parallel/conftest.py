"""Multi-device tests on 8 host CPU devices, in a pytest process of their own (`make test`
runs `XLA_FLAGS=--xla_force_host_platform_device_count=8 pytest tests/parallel` after the
rest of the suite): the flag must be set before jax starts its backend, which
tests/conftest.py does on import."""

import jax
import pytest


@pytest.fixture(scope="session", autouse=True)
def eight_devices():
    if jax.device_count() != 8:
        pytest.fail(
            f"tests/parallel needs 8 devices, got {jax.device_count()}: run it as "
            "XLA_FLAGS=--xla_force_host_platform_device_count=8 pytest tests/parallel"
        )
