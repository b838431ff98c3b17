"""`small_product`: products with a few-by-few matrix inside a step, equal to NumPy's
on both sides of the size at which it stops reducing, and in the form each size
takes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from solvers.ode._small import UNROLLED_MIN, small_product, weighted_stages


@pytest.mark.parametrize("rows, cols", [(6, 6), (1, 8), (3, 3), (2, 1)])
@pytest.mark.parametrize("n", [3, 192, 2048])
def test_matches_numpy_either_way(x64, rows, cols, n):
    rng = np.random.default_rng(rows * cols + n)
    a, b = rng.standard_normal((rows, cols)), rng.standard_normal((cols, n))
    out = small_product(jnp.asarray(a), jnp.asarray(b))
    np.testing.assert_allclose(out, a @ b, rtol=1e-13, atol=1e-13)
    hlo = jax.jit(small_product).lower(jnp.asarray(a), jnp.asarray(b)).as_text()
    # Small products are reduced; large ones are a sum of scaled rows (one row) or a
    # matrix product (several), never a reduction for XLA to hand to its threads.
    small = a.size * n < UNROLLED_MIN
    assert ("reduce" in hlo) == small
    assert ("dot_general" in hlo) == (not small and rows > 1)


def test_weighted_stages_matches_numpy(x64):
    rng = np.random.default_rng(0)
    w, ks = rng.standard_normal(7), rng.standard_normal((7, 64, 32))
    out = weighted_stages(jnp.asarray(w), jnp.asarray(ks))
    np.testing.assert_allclose(out, np.tensordot(w, ks, axes=1), rtol=1e-13, atol=1e-13)
