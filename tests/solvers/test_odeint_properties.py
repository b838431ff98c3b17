"""Property tests of `odeint`: random stable linear systems `y' = A y + b0 + b1 t` for
every method and derivative mode, against the matrix exponential.

The solution is `y(t) = expm(M t) z0` restricted to `y`, with `z = (y, 1, t)` and
`M = [[A, b0, b1], [0, 0, 0], [0, 1, 0]]`; its derivatives come from JAX's
differentiation of `jax.scipy.linalg.expm` (Pade approximation and scaling and
squaring): an implementation that shares nothing with the integrators.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from solvers import odeint

pytestmark = pytest.mark.usefixtures("fast_compiles")

N = 3
TS = np.array([0.0, 0.4, 1.0])

# Per method: options and the relative accuracy they buy (of values and derivatives).
OPTIONS = {
    "dopri5": (dict(rtol=1e-10, atol=1e-10), 1e-6),
    "tsit5": (dict(rtol=1e-10, atol=1e-10), 1e-6),
    "bosh3": (dict(rtol=1e-9, atol=1e-9), 1e-5),
    "dopri8": (dict(rtol=1e-10, atol=1e-10), 1e-6),
    "kvaerno5": (dict(rtol=1e-10, atol=1e-10), 1e-6),
    "rodas5p": (dict(rtol=1e-10, atol=1e-10), 1e-6),
    "rodas4": (dict(rtol=1e-9, atol=1e-9), 1e-5),
    "rk4": (dict(dt=1 / 128), 1e-6),
    "euler": (dict(dt=1 / 2048), 5e-3),
}


def _field(y, t, a, b0, b1):
    return a @ y + b0 + b1 * t


def _exact(a, b0, b1, y0, w, terms=False):
    """The loss `sum_i w . y(t_i)`; with `terms`, the sum of its terms' magnitudes (the
    scale of its error: the terms may cancel)."""
    ys = _exact_ys(a, b0, b1, y0)
    return jnp.sum(jnp.abs(ys * w)) if terms else jnp.sum(ys * w)


def _exact_ys(a, b0, b1, y0):
    n = y0.shape[0]
    m = jnp.zeros((n + 2, n + 2), a.dtype)
    m = m.at[:n, :n].set(a).at[:n, n].set(b0).at[:n, n + 1].set(b1).at[n + 1, n].set(1.0)
    z0 = jnp.concatenate([y0, jnp.array([1.0, 0.0], a.dtype)])
    return jnp.stack([(jax.scipy.linalg.expm(m * t) @ z0)[:n] for t in TS])


@functools.cache
def _checks(method):
    """One compiled function per method: the loss and its derivatives, ours and exact."""
    options, _ = OPTIONS[method]
    ts = jnp.asarray(TS)

    def ours(a, b0, b1, y0, w, adjoint):
        ys = odeint(_field, y0, ts, a, b0, b1, method=method, adjoint=adjoint, **options)
        return jnp.sum(ys * w)

    args = (0, 1, 3)  # A, b0, y0

    def run(a, b0, b1, y0, w, da):
        loss = functools.partial(ours, adjoint="checkpoint")
        back = functools.partial(ours, adjoint="backsolve")
        inputs = (a, b0, b1, y0, w)
        return dict(
            value=(loss(*inputs), _exact(*inputs)),
            value_scale=_exact(*inputs, terms=True),
            # The scale of the directional derivative's error: its terms' magnitudes.
            jvp_scale=jnp.sum(
                jnp.abs(w * jax.jvp(lambda a: _exact_ys(a, b0, b1, y0), (a,), (da,))[1])
            ),
            checkpoint=(jax.grad(loss, args)(*inputs), jax.grad(_exact, args)(*inputs)),
            backsolve=(jax.grad(back, args)(*inputs), None),
            jacfwd=(jax.jacfwd(loss, args)(*inputs), None),
            jvp=(
                jax.jvp(lambda a: loss(a, b0, b1, y0, w), (a,), (da,))[1],
                jax.jvp(lambda a: _exact(a, b0, b1, y0, w), (a,), (da,))[1],
            ),
        )

    return jax.jit(run)


def _stable_system(draw):
    """`A = S - (Q Q^T / n + I / 2)`: eigenvalues with real part at most -1/2, and of
    modulus at most a few (not stiff, so every method applies)."""
    floats = st.floats(-1.0, 1.0, allow_nan=False, allow_infinity=False)
    mat = lambda: np.array(draw(st.lists(floats, min_size=N * N, max_size=N * N))).reshape(N, N)  # noqa: E731
    vec = lambda: np.array(draw(st.lists(floats, min_size=N, max_size=N)))  # noqa: E731
    q, s = mat(), mat()
    a = (s - s.T) - (q @ q.T / N + 0.5 * np.eye(N))
    # The steps follow the solution, not its derivatives: an initial state bounded away
    # from zero keeps the solution on the scale of the changes the forcing makes (with
    # `y0 = b = 0` the solution is zero, the steps grow unchecked and `d/db` is as
    # inaccurate as they are; see docs/odes.md).
    y0 = vec()
    y0 = np.where(np.abs(y0) < 0.25, np.copysign(0.25, y0), y0)
    return a, vec(), vec(), y0, vec() + 2.0, mat()


@st.composite
def systems(draw):
    return _stable_system(draw)


def _assert_close(ours, exact, rtol, scale=None):
    ours_flat = np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(ours)])
    exact_flat = np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(exact)])
    if scale is None:
        scale = np.max(np.abs(exact_flat)) + 1e-3
    np.testing.assert_allclose(ours_flat, exact_flat, rtol=rtol, atol=rtol * scale)


def _check_system(method, system):
    a, b0, b1, y0, w, da = (jnp.asarray(v) for v in system)
    _, rtol = OPTIONS[method]
    out = _checks(method)(a, b0, b1, y0, w, da)
    exact_grad = out["checkpoint"][1]
    _assert_close(*out["value"], rtol, scale=float(out["value_scale"]))
    _assert_close(out["checkpoint"][0], exact_grad, rtol)
    _assert_close(out["backsolve"][0], exact_grad, rtol)
    _assert_close(out["jacfwd"][0], exact_grad, rtol)
    _assert_close(*out["jvp"], rtol, scale=float(out["jvp_scale"]) + 1e-3)


_SETTINGS = dict(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


# Each method compiles one program for all its derivative modes (10 to 20 s on 2
# cores): the main suite runs dopri5, the slow suite every method.
@pytest.mark.parametrize(
    "method",
    [m if m == "dopri5" else pytest.param(m, marks=pytest.mark.slow) for m in OPTIONS],
)
@settings(max_examples=6, **_SETTINGS)
@given(system=systems())
def test_random_linear_systems(x64, method, system):
    _check_system(method, system)


@pytest.mark.slow
@pytest.mark.parametrize("method", list(OPTIONS))
@settings(max_examples=150, **_SETTINGS)
@given(system=systems())
def test_random_linear_systems_many(x64, method, system):
    _check_system(method, system)
