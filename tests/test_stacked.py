"""The algebra of stacked query rows (`pallas_kernels.paged_decode.stacked`) as plain jnp,
against group scales applied per value in float64 numpy: the logits, and the output of
probabilities over word parts whose columns run over the groups in order."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import util

from pallas_kernels.paged_decode import stacked


@pytest.mark.parametrize("rows, width, group_size", [(4, 64, 32), (4, 32, 16), (8, 64, 8)])
def test_stacked_logits_equal_per_value_scales(rows, width, group_size):
    rng = util.rng_for("stacked-logits", rows, width, group_size)
    n, block = width // group_size, 16
    q = rng.standard_normal((rows, width))
    codes = rng.integers(-8, 8, (block, width)).astype(np.float64)
    scales = rng.uniform(0.01, 2.0, (block, n))
    want = q @ (codes * np.repeat(scales, group_size, axis=1)).T
    stacked_q = stacked.stack_queries(jnp.asarray(q, jnp.float32), group_size, n)
    partial = np.asarray(stacked_q, np.float64) @ codes.T  # the dot in numpy (no TF32)
    got = stacked.fold_logits(jnp.asarray(partial, jnp.float32), jnp.asarray(scales))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows, width, n", [(4, 32, 2), (4, 32, 4), (8, 16, 8)])
def test_stacked_output_equals_per_value_scales(rows, width, n):
    """A word part's `width` columns run over its n groups in order (width / n each)."""
    rng = util.rng_for("stacked-output", rows, width, n)
    block = 16
    p = rng.uniform(0.0, 1.0, (rows, block))
    codes = rng.integers(-8, 8, (block, width)).astype(np.float64)
    scales = rng.uniform(0.01, 2.0, (block, n))
    want = p @ (codes * np.repeat(scales, width // n, axis=1))
    probs = stacked.stack_probs(jnp.asarray(p, jnp.float32), jnp.asarray(scales, jnp.float32))
    partial = np.asarray(probs, np.float64) @ codes  # the dot in numpy (no TF32)
    got = stacked.unstack(jnp.asarray(partial, jnp.float32), n)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_tile_rows_repeats_row_blocks():
    x = jnp.arange(3.0)
    np.testing.assert_array_equal(np.asarray(stacked.tile_rows(x, 2)), [0, 1, 2, 0, 1, 2])
