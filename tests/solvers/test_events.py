"""`solvers.odeint_event`: event times and states against closed forms and SciPy's
event location, their derivatives in every mode, and the failure reports."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.integrate

from solvers import MAX_STEPS, SUCCESS, ODEInfo, odeint_event

pytestmark = pytest.mark.usefixtures("fast_compiles")


def fall(y, t, g):
    return jnp.stack([y[1], -g])


def ground(y, t, g):
    return y[0]


def hit(h, g, **kw):
    """The time and velocity when a ball dropped from rest at height h lands."""
    out = odeint_event(fall, ground, jnp.stack([h, jnp.zeros_like(h)]), 0.0, 10.0, g, **kw)
    return (out[0], out[1][1], *out[2:])


# Closed forms: t = sqrt(2 h / g), v = -sqrt(2 g h).
def t_exact(h, g):
    return np.sqrt(2 * h / g)


def dt_exact(h, g):
    return np.array([1 / np.sqrt(2 * g * h), -np.sqrt(h / 2) * g**-1.5])


def dv_exact(h, g):
    return np.array([-np.sqrt(g / (2 * h)), -np.sqrt(h / (2 * g))])


METHODS = {
    "dopri5": dict(rtol=1e-10, atol=1e-10),
    "kvaerno5": dict(rtol=1e-10, atol=1e-10),
    "rk4": dict(dt=0.05),  # exact for this quadratic motion
}


@pytest.mark.parametrize(
    "method",
    [m if m != "kvaerno5" else pytest.param(m, marks=pytest.mark.slow) for m in METHODS],
)
def test_falling_ball_time_state_and_derivatives(x64, method):
    kw = dict(method=method, **METHODS[method])
    h, g = 10.0, 9.81
    t, v = hit(h, g, **kw)
    np.testing.assert_allclose(t, t_exact(h, g), rtol=1e-10)
    np.testing.assert_allclose(v, -np.sqrt(2 * g * h), rtol=1e-10)
    dt = jax.jit(jax.grad(lambda h, g: hit(h, g, **kw)[0], (0, 1)))(h, g)
    np.testing.assert_allclose(dt, dt_exact(h, g), rtol=1e-8)
    dv = jax.jit(jax.jacfwd(lambda h, g: hit(h, g, **kw)[1], (0, 1)))(h, g)
    np.testing.assert_allclose(dv, dv_exact(h, g), rtol=1e-8)


@pytest.mark.parametrize(
    "transform",
    [
        "jit(grad)",
        "jacrev",
        "jvp",
        "vmap",
        *(pytest.param(t, marks=pytest.mark.slow) for t in ("vmap(grad)", "hessian")),
    ],
)
def test_event_time_under_transformations(x64, transform):
    g = 9.81
    t_of_h = lambda h: hit(h, g, rtol=1e-10, atol=1e-10)[0]  # noqa: E731
    hs = jnp.array([1.0, 5.0, 20.0])
    if transform == "jit(grad)":
        out, want = jax.jit(jax.grad(t_of_h))(5.0), dt_exact(5.0, g)[0]
    elif transform == "jacrev":
        out, want = jax.jacrev(t_of_h)(5.0), dt_exact(5.0, g)[0]
    elif transform == "jvp":
        out, want = jax.jvp(t_of_h, (5.0,), (1.0,))[1], dt_exact(5.0, g)[0]
    elif transform == "vmap":
        out, want = jax.vmap(t_of_h)(hs), t_exact(np.asarray(hs), g)
    elif transform == "vmap(grad)":
        out, want = jax.vmap(jax.grad(t_of_h))(hs), dt_exact(np.asarray(hs), g)[0]
    else:  # d2t/dh2 = -1 / (2 sqrt(2 g) h^1.5)
        out, want = jax.hessian(t_of_h)(5.0), -1 / (2 * np.sqrt(2 * g) * 5.0**1.5)
    np.testing.assert_allclose(out, want, rtol=1e-7)


def test_closed_over_threshold_and_rate(x64):
    """y' = -k y from y0 down to the level c: t* = log(y0 / c) / k, with the level
    closed over by the event function."""

    def crossing(k, c, y0):
        return odeint_event(
            lambda y, t, k: -k * y, lambda y, t, k: y - c, y0, 0.0, 100.0, k,
            rtol=1e-11, atol=1e-12,
        )[0]  # fmt: skip

    k, c, y0 = 0.7, 0.2, 3.0
    np.testing.assert_allclose(crossing(k, c, y0), np.log(y0 / c) / k, rtol=1e-10)
    grads = jax.grad(crossing, (0, 1, 2))(k, c, y0)
    want = [-np.log(y0 / c) / k**2, -1 / (k * c), 1 / (k * y0)]
    np.testing.assert_allclose(grads, want, rtol=1e-8)


@pytest.mark.slow
def test_stiff_event_matches_scipy_event_location(x64):
    """Robertson kinetics until y1 falls to 0.5, against SciPy's Radau with its own
    event location (a different integrator and root finder)."""

    def rober(y, t, k):
        return jnp.stack(
            [
                -k[0] * y[0] + k[2] * y[1] * y[2],
                k[0] * y[0] - k[2] * y[1] * y[2] - k[1] * y[1] ** 2,
                k[1] * y[1] ** 2,
            ]
        )

    k = np.array([0.04, 3e7, 1e4])

    def scipy_time(k):
        def event(t, y):
            return y[0] - 0.5

        event.terminal = True
        sol = scipy.integrate.solve_ivp(
            lambda t, y: np.asarray(rober(y, t, k)), (0.0, 1e3), [1.0, 0.0, 0.0],
            method="Radau", rtol=1e-12, atol=1e-16, events=event,
        )  # fmt: skip
        return sol.t_events[0][0]

    def ours(k):
        return odeint_event(
            rober, lambda y, t, k: y[0] - 0.5, jnp.array([1.0, 0.0, 0.0]), 0.0, 1e3, k,
            method="kvaerno5", rtol=1e-9, atol=1e-14,
        )[0]  # fmt: skip

    kj = jnp.asarray(k)
    np.testing.assert_allclose(ours(kj), scipy_time(k), rtol=1e-6)
    step = 1e-4 * k[0]
    fd = (scipy_time(k + [step, 0, 0]) - scipy_time(k - [step, 0, 0])) / (2 * step)
    np.testing.assert_allclose(jax.grad(ours)(kj)[0], fd, rtol=1e-4)


def test_info_reports_the_search(x64):
    t, _, info = hit(10.0, 9.81, return_info=True)
    assert isinstance(info, ODEInfo)
    assert int(info.status) == SUCCESS and int(info.steps) > 0
    assert int(info.num_fevals) > int(info.steps)
    np.testing.assert_allclose(info.t_final, t)


def test_no_event_before_t_max(x64):
    def never(y, t):
        return 1.0 + y[0] ** 2

    args = (lambda y, t: -y, never, jnp.array([1.0]), 0.0, 2.0)
    with pytest.raises(Exception, match="no zero crossing of `event`"):
        jax.block_until_ready(odeint_event(*args))
    t, y, info = odeint_event(*args, throw=False, return_info=True)
    assert int(info.status) == MAX_STEPS
    np.testing.assert_allclose(t, 2.0)
    np.testing.assert_allclose(y, np.exp(-2.0), rtol=1e-6)


def test_events_per_element_under_vmap(x64):
    hs = jnp.array([1.0, 50.0, 2000.0])  # the last one does not land before t = 10
    ts, _, info = jax.vmap(functools.partial(hit, g=9.81, throw=False, return_info=True))(hs)
    np.testing.assert_array_equal(info.status, [SUCCESS, SUCCESS, MAX_STEPS])
    np.testing.assert_allclose(ts[:2], t_exact(np.asarray(hs[:2]), 9.81), rtol=1e-7)
    np.testing.assert_allclose(ts[2], 10.0)


def test_bad_event_function_is_named():
    with pytest.raises(TypeError, match="`event` must be callable"):
        odeint_event(fall, None, jnp.array([1.0, 0.0]), 0.0, 1.0, 9.81)
