"""`small_product`: products with a few-by-few matrix inside a step, equal to NumPy's
on both sides of the size at which it stops reducing, and in the form each size
takes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from solvers.ode._small import PRODUCT_MIN, small_product, weighted_stages


@pytest.mark.parametrize("rows, cols", [(6, 6), (1, 8), (3, 3), (2, 1)])
@pytest.mark.parametrize("n", [3, 192, 2048])
def test_matches_numpy_either_way(x64, rows, cols, n):
    rng = np.random.default_rng(rows * cols + n)
    a, b = rng.standard_normal((rows, cols)), rng.standard_normal((cols, n))
    out = small_product(jnp.asarray(a), jnp.asarray(b))
    np.testing.assert_allclose(out, a @ b, rtol=1e-13, atol=1e-13)
    hlo = jax.jit(small_product).lower(jnp.asarray(a), jnp.asarray(b)).as_text()
    # Small products are reduced; large ones, one row or several, are a matrix
    # product, never a reduction for XLA to hand to its threads.
    small = a.size * n < PRODUCT_MIN
    assert ("reduce" in hlo) == small
    assert ("dot_general" in hlo) == (not small)


def test_weighted_stages_matches_numpy(x64):
    rng = np.random.default_rng(0)
    w, ks = rng.standard_normal(7), rng.standard_normal((7, 64, 32))
    out = weighted_stages(jnp.asarray(w), jnp.asarray(ks))
    np.testing.assert_allclose(out, np.tensordot(w, ks, axes=1), rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("rows", [1, 6])
@pytest.mark.parametrize("n", [16, 2048])
def test_derivatives_and_complex_values(x64, rows, n):
    """Both sides of `PRODUCT_MIN`, one row and several: `jvp` and `vjp` with respect to
    both factors equal NumPy's products, and complex factors multiply as complex."""
    rng = np.random.default_rng(rows + n)
    a, b = rng.standard_normal((rows, 6)), rng.standard_normal((6, n))
    da, db = rng.standard_normal(a.shape), rng.standard_normal(b.shape)
    out, tangent = jax.jvp(small_product, (jnp.asarray(a), jnp.asarray(b)), (da, db))
    np.testing.assert_allclose(tangent, da @ b + a @ db, rtol=1e-12, atol=1e-12)
    ct = rng.standard_normal(out.shape)
    _, pull = jax.vjp(small_product, jnp.asarray(a), jnp.asarray(b))
    ct_a, ct_b = pull(jnp.asarray(ct))
    np.testing.assert_allclose(ct_a, ct @ b.T, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(ct_b, a.T @ ct, rtol=1e-12, atol=1e-12)
    za, zb = a + 1j * da, b - 2j * db
    np.testing.assert_allclose(
        small_product(jnp.asarray(za), jnp.asarray(zb)), za @ zb, rtol=1e-12, atol=1e-12
    )
