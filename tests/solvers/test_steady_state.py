"""`solvers.steady_state`: equilibria and their implicit derivatives, and how failures of
either phase (integration, Newton) are reported."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from solvers import MAX_STEPS, NONFINITE, SUCCESS, steady_state

pytestmark = pytest.mark.usefixtures("fast_compiles")

RUNTIME_ERRORS = (RuntimeError, ValueError)  # see implicitdiff._errors: eager, jit, fast path


def logistic(y, t, r, K):
    """Settles at the carrying capacity K from any y0 > 0; d y*/dK = 1."""
    return r * y * (1 - y / K)


def oscillator(y, t, c):
    """y'' + c y' + y = 0: settles at 0 for c > 0, circles for ever at c = 0."""
    return jnp.stack([y[1], -y[0] - c * y[1]])


def blow_up(y, t):
    """y' = y^2: from y(0) = 1 the solution 1 / (1 - t) blows up at t = 1."""
    return y**2


def test_value_and_implicit_derivative():
    np.testing.assert_allclose(steady_state(logistic, 0.1, 1.0, 5.0), 5.0, rtol=1e-6)
    dK = jax.grad(lambda K: steady_state(logistic, 0.1, 1.0, K))(5.0)
    np.testing.assert_allclose(dK, 1.0, rtol=1e-5)


def test_a_state_with_several_leaves():
    """Each leaf relaxes to its own target; the settle test takes the max over leaves."""

    def field(y, t, target):
        return {"a": target["a"] - y["a"], "b": 2.0 * (target["b"] - y["b"])}

    target = {"a": jnp.array([1.0, -1.0]), "b": jnp.asarray(3.0)}
    y0 = {"a": jnp.zeros(2), "b": jnp.asarray(0.0)}
    y = steady_state(field, y0, target)
    np.testing.assert_allclose(y["a"], [1.0, -1.0], rtol=1e-6)
    np.testing.assert_allclose(y["b"], 3.0, rtol=1e-6)


def test_complex_state_is_refused_in_its_own_terms():
    """The root solve takes real unknowns: a complex `y0` is an error naming `y0`."""
    match = r"steady_state: `y0` leaf 0 has dtype complex.*\(x.real, x.imag\)"
    with pytest.raises(TypeError, match=match):
        steady_state(lambda y, t: 1.0 - y, jnp.array([1.0 + 1.0j]))


def test_throw_false_needs_return_info():
    """Without the run-time check and without the status, nothing would show a failure."""
    match = r"steady_state: `throw=False`.*`return_info=True`"
    with pytest.raises(ValueError, match=match):
        steady_state(logistic, 0.1, 1.0, 5.0, throw=False)
    with pytest.raises(ValueError, match=match):
        jax.grad(lambda K: steady_state(logistic, 0.1, 1.0, K, throw=False))(5.0)
    y, info = steady_state(logistic, 0.1, 1.0, 5.0, throw=False, return_info=True)
    assert int(info.status) == SUCCESS and bool(info.converged)
    np.testing.assert_allclose(y, 5.0, rtol=1e-6)


def test_a_state_that_does_not_settle_is_a_failure():
    """Undamped, the state circles the centre at 0; Newton from anywhere on the circle
    lands on 0 in one step, but the integration never settled, and the status says so."""
    y0 = jnp.array([1.0, 0.0])
    y, info = steady_state(oscillator, y0, 0.0, max_time=50.0, throw=False, return_info=True)
    assert int(info.status) == MAX_STEPS and not bool(info.converged)
    with pytest.raises(RUNTIME_ERRORS, match=r"steady_state: the state did not settle"):
        jax.block_until_ready(
            jax.jit(lambda c: steady_state(oscillator, y0, c, max_time=50.0))(0.0)
        )
    # damped, the same call settles
    y, info = steady_state(oscillator, y0, 1.0, max_time=50.0, throw=False, return_info=True)
    assert int(info.status) == SUCCESS
    np.testing.assert_allclose(y, [0.0, 0.0], atol=1e-6)


def test_status_per_vmap_element():
    y0 = jnp.array([1.0, 0.0])
    y, info = jax.vmap(
        lambda c: steady_state(oscillator, y0, c, max_time=50.0, throw=False, return_info=True)
    )(jnp.array([1.0, 0.0, 0.5]))
    np.testing.assert_array_equal(info.status, [SUCCESS, MAX_STEPS, SUCCESS])
    np.testing.assert_allclose(np.asarray(y)[[0, 2]], 0.0, atol=1e-6)


def test_a_failed_integration_is_reported():
    y, info = steady_state(blow_up, 1.0, throw=False, return_info=True)
    assert int(info.status) == NONFINITE
    assert np.isnan(float(y))
    with pytest.raises(RUNTIME_ERRORS, match=r"steady_state: the integration phase failed"):
        jax.block_until_ready(steady_state(blow_up, 1.0))
