"""`solvers.odeint`: JAX's own odeint tests, closed forms for every method and adjoint,
diffrax and scipy as independent references, stiff problems, failure modes, float32."""

import functools
import re

import diffrax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.integrate as osp_integrate
from jax.experimental.ode import odeint as jax_odeint

from implicitdiff import check_grads
from solvers import odeint
from solvers.ode import methods as ode_methods

pytestmark = pytest.mark.usefixtures("fast_compiles")

# ODEInfo.status codes (spec): 0 success, 1 mxstep exceeded, 2 non-finite, 4 dt underflow.
SUCCESS, MAX_STEPS, NONFINITE, DT_UNDERFLOW = 0, 1, 2, 4

# Every registered method is tested: a new one is covered by registering it (with its
# accuracy settings below when the defaults do not suit it).
ADAPTIVE = [name for name, m in ode_methods.METHODS.items() if m.adaptive]
FIXED = [name for name, m in ode_methods.METHODS.items() if not m.adaptive]
METHODS = ADAPTIVE + FIXED
ADJOINTS = ["backsolve", "checkpoint"]

# Per method: the keyword arguments that make the answer accurate, and the relative
# tolerance against the closed form that this accuracy buys.
METHOD_KW = {
    **{m: dict(rtol=1e-10, atol=1e-10) for m in ADAPTIVE},
    **{m: dict(dt=1 / 64) for m in FIXED},
    "bosh3": dict(rtol=1e-9, atol=1e-9),  # third order: keep the step count modest
    "euler": dict(dt=1 / 1024),
}
METHOD_RTOL = {**{m: 1e-6 for m in METHODS}, "euler": 2e-3}


def _raises_at_run_time(fn, *args, match):
    """Call `fn` and block: the error may come at trace time or at run time."""
    with pytest.raises(Exception, match=match) as excinfo:
        jax.block_until_ready(fn(*args))
    return str(excinfo.value)


# ---------------------------------------------------------------------------
# 1. JAX's tests/ode_test.py, ported (float64, check_grads in reverse mode to order 2).


def _against_scipy(fun, y0, ts, *args, tol):
    """`fun(np_or_jnp, y, t, *args)`; our odeint against scipy.integrate.odeint."""
    y0, ts = np.array(y0), np.array(ts)
    expected = osp_integrate.odeint(
        functools.partial(fun, np), y0, ts, args, rtol=1e-12, atol=1e-12
    )
    ours = odeint(functools.partial(fun, jnp), jnp.array(y0), jnp.array(ts), *args)
    np.testing.assert_allclose(np.asarray(ours), expected, atol=tol, rtol=tol)


def _check_rev2(integrate, args):
    """JAX's check: reverse mode to second order with JAX's finite-difference step 1e-4,
    all arguments in one pytree (one compile per derivative level, not per argument)."""
    check_grads(
        lambda a: integrate(*a),
        (tuple(args),),
        modes=["rev"],
        order=2,
        atol=1e-3,
        rtol=1e-3,
        eps=1e-4,
    )


def _pend(_np, y, _t, m, g):
    theta, omega = y
    return [omega, -m * omega - g * _np.sin(theta)]


def test_pend_grads(x64):
    y0 = [np.pi - 0.1, 0.0]
    ts = np.linspace(0.0, 1.0, 11)
    args = (0.25, 9.8)
    _against_scipy(
        lambda _np, y, t, m, g: _np.array(_pend(_np, y, t, m, g)), y0, ts, *args, tol=1e-6
    )
    integrate = functools.partial(odeint, functools.partial(_pend, jnp))
    y0 = [jnp.float64(np.pi - 0.1), jnp.float64(0.0)]
    _check_rev2(integrate, (y0, jnp.asarray(ts), *map(jnp.float64, args)))


def test_pend_values_and_grads_match_jax_odeint(x64):
    """JAX's own odeint (same dopri5, same backsolve adjoint) as a yardstick."""
    y0 = jnp.array([np.pi - 0.1, 0.0])
    ts = jnp.linspace(0.0, 1.0, 11)
    f = lambda y, t, m, g: jnp.stack(_pend(jnp, y, t, m, g))

    def loss(solve, y0, m, g):
        ys = solve(f, y0, ts, m, g, rtol=1e-11, atol=1e-11)
        return jnp.sum(ys[:, 0] ** 2) + jnp.sum(jnp.sin(ys[:, 1]))

    ours = jax.value_and_grad(functools.partial(loss, odeint), argnums=(0, 1, 2))(y0, 0.25, 9.8)
    ref = jax.value_and_grad(functools.partial(loss, jax_odeint), argnums=(0, 1, 2))(y0, 0.25, 9.8)
    np.testing.assert_allclose(ours[0], ref[0], rtol=1e-8)
    for a, b in zip(ours[1], ref[1]):
        np.testing.assert_allclose(a, b, rtol=1e-7, atol=1e-9)


def test_pytree_state(x64):
    def dynamics(y, _t):
        return jax.tree_util.tree_map(jnp.negative, y)

    y0 = (jnp.array(-0.1), jnp.array([[[0.1]]]))
    ts = jnp.linspace(0.0, 1.0, 11)
    ys = odeint(dynamics, y0, ts)
    assert ys[0].shape == (11,) and ys[1].shape == (11, 1, 1, 1)
    np.testing.assert_allclose(ys[0], -0.1 * np.exp(-ts), rtol=1e-7)
    np.testing.assert_allclose(ys[1][:, 0, 0, 0], 0.1 * np.exp(-ts), rtol=1e-7)
    _check_rev2(functools.partial(odeint, dynamics), (y0, ts))


def test_dict_state_and_first_row_is_y0(x64):
    y0 = {"a": jnp.array([1.0, 2.0]), "b": jnp.array(3.0)}
    ys = odeint(lambda y, t: {"a": -y["a"], "b": y["b"] * 0.0 + 1.0}, y0, jnp.array([0.0, 2.0]))
    np.testing.assert_array_equal(ys["a"][0], y0["a"])
    np.testing.assert_array_equal(ys["b"][0], y0["b"])
    np.testing.assert_allclose(ys["a"][1], np.array([1.0, 2.0]) * np.exp(-2.0), rtol=1e-7)
    np.testing.assert_allclose(ys["b"][1], 5.0, rtol=1e-10)


def test_weird_time_pendulum_grads(x64):
    """The dynamics depend on t."""

    def dynamics(_np, y, t):
        return _np.array([y[1] * -t, -1 * y[1] - 9.8 * _np.sin(y[0])])

    y0 = [np.pi - 0.1, 0.0]
    ts = np.linspace(0.0, 1.0, 11)
    _against_scipy(dynamics, y0, ts, tol=1e-6)
    integrate = functools.partial(odeint, functools.partial(dynamics, jnp))
    _check_rev2(integrate, ([jnp.float64(y) for y in y0], jnp.asarray(ts)))


def test_decay(x64):
    def decay(_np, y, t, arg1, arg2):
        return -_np.sqrt(t) - y + arg1 - _np.mean((y + arg2) ** 2)

    rng = np.random.RandomState(0)
    args = (rng.randn(3), rng.randn(3))
    y0 = rng.randn(3)
    ts = np.linspace(0.1, 0.2, 4)
    _against_scipy(decay, y0, ts, *args, tol=1e-6)
    integrate = functools.partial(odeint, functools.partial(decay, jnp))
    _check_rev2(integrate, tuple(map(jnp.asarray, (y0, ts, *args))))


def _swoop(_np, y, t, arg1, arg2):
    return _np.array(y - _np.sin(t) - _np.cos(t) * arg1 + arg2)


@pytest.mark.parametrize(
    ("y0", "args"),
    [
        pytest.param(np.linspace(0.1, 0.9, 10), (0.1, 0.2), id="swoop"),
        pytest.param(
            np.linspace(1.1, 10.9, 10), (0.1, 0.3), id="swoop_bigger", marks=pytest.mark.slow
        ),
    ],
)
def test_swoop(x64, y0, args):
    ts = np.array([0.1, 0.2])
    _against_scipy(_swoop, y0, ts, *args, tol=1e-6)
    integrate = functools.partial(odeint, functools.partial(_swoop, jnp))
    _check_rev2(integrate, tuple(map(jnp.asarray, (y0, ts, *args))))


def test_odeint_vmap_grad(x64):
    # https://github.com/google/jax/issues/2531
    def dx_dt(x, *args):
        return 0.1 * x

    t = jnp.array([0.0, 5.0])

    def f(x, y):
        return odeint(dx_dt, jnp.array([x, y]), t)[-1].sum()

    def g(x):
        y0_arr = jnp.array([[x, 0.1], [x, 0.2]])
        return jax.vmap(lambda y0: odeint(dx_dt, y0, t))(y0_arr)[:, -1].sum()

    ans = jax.grad(g)(2.0)
    expected = jax.grad(f, 0)(2.0, 0.1) + jax.grad(f, 0)(2.0, 0.2)
    np.testing.assert_allclose(ans, expected, atol=5e-15, rtol=2e-15)
    np.testing.assert_allclose(ans, 2 * np.exp(0.5), rtol=1e-7)


def test_disable_jit_odeint_with_vmap(x64):
    # https://github.com/google/jax/issues/2598
    with jax.disable_jit():
        t = jnp.array([0.0, 1.0])
        x0 = jnp.arange(10.0).reshape(5, 2)
        ys = jax.vmap(lambda x0: odeint(lambda x, _t: x, x0, t))(x0)
    np.testing.assert_allclose(ys[:, 1], np.e * np.asarray(x0), rtol=1e-7)


def test_grad_closure(x64):
    # simplification of https://github.com/google/jax/issues/2718
    def experiment(x):
        def model(y, t):
            return -x * y

        return odeint(model, 1.0, jnp.arange(0, 10, 0.1))[-1]

    check_grads(experiment, (jnp.float64(0.01),), modes=["rev"], order=1, atol=1e-3, rtol=1e-3)
    t_end = float(jnp.arange(0, 10, 0.1)[-1])
    np.testing.assert_allclose(
        jax.grad(experiment)(0.01), -t_end * np.exp(-0.01 * t_end), rtol=1e-6
    )


def test_grad_closure_with_vmap(x64):
    # https://github.com/google/jax/issues/2718
    @jax.jit
    def experiment(x):
        def model(y, t):
            return -x * y

        return odeint(model, 1.0, jnp.arange(0, 10, 0.1))[-1]

    t = jnp.arange(0.0, 1.0, 0.01)
    h, g = jax.vmap(jax.value_and_grad(experiment))(t)
    t_end = float(jnp.arange(0, 10, 0.1)[-1])
    np.testing.assert_allclose(h, np.exp(-t * t_end), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(g, -t_end * np.exp(-t * t_end), rtol=1e-6, atol=1e-6)
    expected_g = (experiment(t[11] + 1e-5) - experiment(t[11] - 1e-5)) / 2e-5
    np.testing.assert_allclose(g[11], expected_g, rtol=1e-4)


def test_forward_mode_works(x64):
    """Inverse of JAX's test_forward_mode_error (issue 3558): jacfwd agrees with jacrev
    and with finite differences."""

    def f(k):
        return odeint(lambda x, t: k * x, 1.0, jnp.linspace(0, 1.0, 50)).sum()

    ts = np.linspace(0, 1.0, 50)
    expected = np.sum(ts * np.exp(-3.0 * ts))  # d/dk sum exp(k t) at k = -3
    fwd, rev = jax.jacfwd(f)(-3.0), jax.jacrev(f)(-3.0)
    np.testing.assert_allclose(fwd, expected, rtol=1e-7)
    np.testing.assert_allclose(rev, expected, rtol=1e-7)
    fd = (f(-3.0 + 1e-5) - f(-3.0 - 1e-5)) / 2e-5
    np.testing.assert_allclose(fwd, fd, rtol=1e-4)
    check_grads(f, (jnp.float64(-3.0),), modes=["fwd", "rev"], order=1, atol=1e-3, rtol=1e-3)


def test_closure_nondiff(x64):
    # https://github.com/google/jax/issues/3584
    def dz_dt(z, t):
        return jnp.stack([z[0], z[1]])

    def f(z):
        return jnp.sum(odeint(dz_dt, z, jnp.arange(10.0)))

    g = jax.grad(f)(jnp.ones(2))
    np.testing.assert_allclose(g, np.full(2, np.sum(np.exp(np.arange(10.0)))), rtol=1e-6)


def test_complex_odeint(x64):
    # https://github.com/google/jax/issues/3986, https://github.com/google/jax/issues/8757
    def dy_dt(y, t, alpha):
        return alpha * y * jnp.exp(-t).astype(y.dtype)

    def f(y0, ts, alpha):
        return odeint(dy_dt, y0, ts, alpha).real

    alpha, y0 = 3 + 4j, 1 + 2j
    ts = jnp.linspace(0.0, 1.0, 11)
    # y(t) = y0 exp(alpha (1 - exp(-t)))
    expected = y0 * np.exp(alpha * (1 - np.exp(-np.asarray(ts))))
    with jax.numpy_dtype_promotion("standard"):
        ys = odeint(dy_dt, jnp.complex128(y0), ts, jnp.complex128(alpha))
        np.testing.assert_allclose(ys, expected, rtol=1e-6)
        _check_rev2(f, (jnp.complex128(y0), ts, jnp.complex128(alpha)))


def test_hmax(x64):
    """A step of more than hmax = 1 would jump over the pulse in [5, 7]."""

    def rhs(y, t):
        return jnp.piecewise(
            t,
            [t <= 2.0, (t >= 5.0) & (t <= 7.0)],
            [lambda s: jnp.array(1.0), lambda s: jnp.array(-1.0), lambda s: jnp.array(0.0)],
        )

    ys = odeint(rhs, jnp.array(0.0), jnp.array([0.0, 5.0, 10.0]), hmax=1.0)
    assert abs(float(ys[1]) - 2.0) < 1e-4
    assert abs(float(ys[2])) < 1e-4


def test_integer_args_under_jacobian(x64):
    # https://github.com/jax-ml/jax/issues/16517: int arguments are not differentiated
    def f(y, t, n, scale):
        return -scale * n * y

    def solve(y0, scale):
        return odeint(f, y0, jnp.array([0.0, 1.0]), 2, scale)[-1]

    y0 = jnp.array([1.0, 2.0])
    jac_y0, jac_scale = jax.jacobian(solve, argnums=(0, 1))(y0, 0.5)
    np.testing.assert_allclose(jac_y0, np.exp(-1.0) * np.eye(2), rtol=1e-7)
    np.testing.assert_allclose(jac_scale, -2.0 * np.exp(-1.0) * np.asarray(y0), rtol=1e-7)
    np.testing.assert_allclose(jax.jacfwd(solve)(y0, 0.5), np.exp(-1.0) * np.eye(2), rtol=1e-7)


# ---------------------------------------------------------------------------
# 2. Closed forms for each method and adjoint.

K, Y0 = 0.7, 1.5
TS = np.array([0.0, 0.5, 1.0])
KS = np.array([0.3, 0.7, 1.2])


def _neg_k_y(y, t, k):
    return -k * y


def decay(k, method="dopri5", adjoint="backsolve", y0=Y0):
    """y' = -k y from t = 0: y(1) = y0 exp(-k)."""
    ys = odeint(
        _neg_k_y,
        y0,
        jnp.asarray(TS),
        k,
        method=method,
        adjoint=adjoint,
        **METHOD_KW[method],
    )
    return ys[-1]


D0 = lambda k: Y0 * np.exp(-k)
D1 = lambda k: -Y0 * np.exp(-k)
D2 = lambda k: Y0 * np.exp(-k)


def _scan(f):
    return jax.grad(lambda ks: jax.lax.scan(lambda c, k: (c + f(k), None), 0.0, ks)[0])


TRANSFORMS = {
    # name: (transform of a scalar function of k, expected, point)
    "value": (lambda f: f, D0, K),
    "value_and_grad": (
        lambda f: lambda k: jnp.stack(jax.value_and_grad(f)(k)),
        lambda k: np.stack([D0(k), D1(k)]),
        K,
    ),
    "jit": (lambda f: jax.jit(f), D0, K),
    "grad": (lambda f: jax.grad(f), D1, K),
    "jvp": (lambda f: lambda k: jax.jvp(f, (k,), (jnp.ones_like(k),))[1], D1, K),
    "jacfwd": (lambda f: jax.jacfwd(f), D1, K),
    "jacrev": (lambda f: jax.jacrev(f), D1, K),
    "hessian": (lambda f: jax.hessian(f), D2, K),
    "linearize": (lambda f: lambda k: jax.linearize(f, k)[1](jnp.ones_like(k)), D1, K),
    "jit(grad)": (lambda f: jax.jit(jax.grad(f)), D1, K),
    "vmap": (lambda f: jax.vmap(f), D0, KS),
    "vmap(grad)": (lambda f: jax.vmap(jax.grad(f)), D1, KS),
    "grad(vmap)": (lambda f: jax.grad(lambda k: jax.vmap(f)(k).sum()), D1, KS),
    "jacfwd(vmap)": (lambda f: lambda k: jnp.diag(jax.jacfwd(jax.vmap(f))(k)), D1, KS),
    "checkpoint": (lambda f: jax.grad(jax.checkpoint(f)), D1, K),
    "scan(grad)": (_scan, D1, KS),
    "grad(grad)": (lambda f: jax.grad(jax.grad(f)), D2, K),
}
# The default run: a cross-section for dopri5, and forward and reverse mode for every
# method and adjoint; everything else (the hessians of the other methods too) is slow.
FAST = {
    "dopri5": {
        "value_and_grad",
        "jacrev",
        "hessian",
        "vmap(grad)",
        "grad(vmap)",
        "linearize",
        "grad(grad)",
        "checkpoint",
        "scan(grad)",
    },
    **{m: {"value_and_grad", "jacfwd"} for m in METHODS if m != "dopri5"},
}


def _transform_cases():
    for method in METHODS:
        for adjoint in ADJOINTS:
            for name in TRANSFORMS:
                if name == "grad(grad)" and adjoint == "checkpoint":
                    continue  # raises: see test_checkpoint_grad_grad_points_to_backsolve
                slow = name not in FAST[method]
                yield pytest.param(
                    name,
                    method,
                    adjoint,
                    id=f"{name}-{method}-{adjoint}",
                    marks=[pytest.mark.slow] if slow else [],
                )


@pytest.mark.parametrize(("name", "method", "adjoint"), list(_transform_cases()))
def test_exponential_decay_transformations(x64, name, method, adjoint):
    transform, expected, at = TRANSFORMS[name]
    f = functools.partial(decay, method=method, adjoint=adjoint)
    at = jnp.asarray(at, jnp.float64)
    np.testing.assert_allclose(transform(f)(at), expected(np.asarray(at)), rtol=METHOD_RTOL[method])


@pytest.mark.parametrize("adjoint", ADJOINTS)
def test_decay_grad_wrt_y0_and_k_and_all_rows(x64, adjoint):
    def solve(y0, k):
        return odeint(
            lambda y, t, k: -k * y, y0, jnp.asarray(TS), k, adjoint=adjoint, rtol=1e-10, atol=1e-10
        )

    y0 = jnp.array([1.5, -0.5])
    ys = solve(y0, K)
    np.testing.assert_allclose(ys, np.outer(np.exp(-K * TS), y0), rtol=1e-8)
    jy0, jk = jax.jacrev(solve, argnums=(0, 1))(y0, K)
    # d ys[i, a] / d y0[b] = exp(-k t_i) delta_ab; d ys[i, a] / dk = -t_i ys[i, a]
    np.testing.assert_allclose(
        jy0, np.exp(-K * TS)[:, None, None] * np.eye(2)[None], rtol=1e-8, atol=1e-14
    )
    np.testing.assert_allclose(jk, -TS[:, None] * np.asarray(ys), rtol=1e-7, atol=1e-14)
    jfy0, jfk = jax.jacfwd(solve, argnums=(0, 1))(y0, K)
    np.testing.assert_allclose(jfy0, jy0, rtol=1e-8, atol=1e-14)
    np.testing.assert_allclose(jfk, jk, rtol=1e-7, atol=1e-14)


@pytest.mark.parametrize("adjoint", ADJOINTS)
def test_jacobian_wrt_t(x64, adjoint):
    """y_i = y0 exp(-k (t_i - t_0)): dy_i/dt_i = -k y_i, dy_i/dt_0 = k y_i for i >= 1,
    and ys[0] = y0 does not depend on t at all."""

    def solve(ts):
        return odeint(lambda y, t: -K * y, Y0, ts, adjoint=adjoint, rtol=1e-11, atol=1e-11)

    ts = jnp.asarray(TS)
    ys = np.asarray(solve(ts))
    expected = np.diag(-K * ys)
    expected[1:, 0] = K * ys[1:]
    expected[0, 0] = 0.0
    np.testing.assert_allclose(jax.jacfwd(solve)(ts), expected, rtol=1e-8, atol=1e-12)
    np.testing.assert_allclose(jax.jacrev(solve)(ts), expected, rtol=1e-8, atol=1e-12)


def test_checkpoint_grad_grad_points_to_backsolve(x64):
    f = functools.partial(decay, adjoint="checkpoint")
    with pytest.raises(NotImplementedError, match="backsolve"):
        jax.grad(jax.grad(f))(jnp.float64(K))


def oscillator(w, x0, v0, method="dopri5", adjoint="backsolve", t_end=2.0):
    """x'' = -w^2 x: x(T) = x0 cos(w T) + v0 / w sin(w T)."""

    def f(y, t, w):
        return jnp.stack([y[1], -(w**2) * y[0]])

    ts = jnp.array([0.0, t_end / 2, t_end])
    kw = dict(METHOD_KW[method])
    if "dt" in kw:
        kw["dt"] = kw["dt"] / 2
    return odeint(f, jnp.stack([x0, v0]), ts, w, method=method, adjoint=adjoint, **kw)[-1, 0]


def _oscillator_exact(w, x0, v0, T=2.0):
    x = x0 * np.cos(w * T) + v0 / w * np.sin(w * T)
    dx_dw = -x0 * T * np.sin(w * T) + v0 * (T * np.cos(w * T) / w - np.sin(w * T) / w**2)
    return x, dx_dw, np.cos(w * T), np.sin(w * T) / w


def _slow_unless(fast, *cases):
    return [
        pytest.param(*case, id="-".join(case), marks=[] if case in fast else [pytest.mark.slow])
        for case in cases
    ]


@pytest.mark.parametrize(
    ("method", "adjoint"),
    _slow_unless(
        {("dopri5", "backsolve"), ("kvaerno5", "checkpoint"), ("rk4", "backsolve")},
        *[(m, a) for m in METHODS for a in ADJOINTS],
    ),
)
def test_harmonic_oscillator(x64, method, adjoint):
    w, x0, v0 = 1.3, 0.8, -0.4
    x, dw, dx0, dv0 = _oscillator_exact(w, x0, v0)
    f = functools.partial(oscillator, method=method, adjoint=adjoint)
    rtol = 10 * METHOD_RTOL[method]
    np.testing.assert_allclose(f(w, x0, v0), x, rtol=rtol)
    grads = jax.grad(f, argnums=(0, 1, 2))(w, x0, v0)
    np.testing.assert_allclose(grads, [dw, dx0, dv0], rtol=rtol, atol=rtol)
    np.testing.assert_allclose(jax.jacfwd(f)(w, x0, v0), dw, rtol=rtol)


def test_fixed_step_methods_land_on_the_discrete_solution(x64):
    """dt = 1/8 divides the output times: Euler is y0 (1 - k h)^8 and RK4 is y0 R(-k h)^8
    exactly; the checkpoint adjoint differentiates exactly that discrete solution."""
    h, n = 1 / 8, 8
    discrete = {
        "euler": lambda k: Y0 * (1 - k * h) ** n,
        "rk4": lambda k: (
            Y0 * (1 - k * h + (k * h) ** 2 / 2 - (k * h) ** 3 / 6 + (k * h) ** 4 / 24) ** n
        ),
    }
    for method, exact in discrete.items():
        f = lambda k, method=method: odeint(
            lambda y, t, k: -k * y,
            Y0,
            jnp.asarray(TS),
            k,
            method=method,
            dt=h,
            adjoint="checkpoint",
        )[-1]
        np.testing.assert_allclose(f(K), exact(K), rtol=1e-13)
        np.testing.assert_allclose(jax.grad(f)(K), jax.grad(exact)(K), rtol=1e-12)
        np.testing.assert_allclose(jax.jacfwd(f)(K), jax.grad(exact)(K), rtol=1e-12)


def test_fixed_step_methods_land_exactly_on_uneven_output_times(x64):
    """dt does not divide the intervals: the step is shortened to land on each t[i]."""
    ts = jnp.array([0.0, 0.33, 0.5, 1.07])
    for method in FIXED:
        dt = 1e-3 if method == "euler" else 0.05
        ys = odeint(lambda y, t: -y, 1.0, ts, method=method, dt=dt)
        np.testing.assert_allclose(
            ys, np.exp(-np.asarray(ts)), rtol=2e-3 if method == "euler" else 1e-7
        )


@pytest.mark.parametrize(
    ("method", "order", "dts"), [("euler", 1, (1 / 16, 1 / 32)), ("rk4", 4, (1 / 4, 1 / 8))]
)
def test_fixed_step_convergence_order(x64, method, order, dts):
    def err(dt, adjoint):
        f = lambda k: odeint(
            lambda y, t, k: -k * y,
            1.0,
            jnp.array([0.0, 1.0]),
            k,
            method=method,
            dt=dt,
            adjoint=adjoint,
        )[-1]
        return abs(float(f(1.0)) - np.exp(-1.0)), abs(float(jax.grad(f)(1.0)) + np.exp(-1.0))

    for adjoint in ADJOINTS:
        (e1, g1), (e2, g2) = err(dts[0], adjoint), err(dts[1], adjoint)
        assert 0.75 * 2**order < e1 / e2 < 1.3 * 2**order, (adjoint, e1, e2)
        assert 0.7 * 2**order < g1 / g2 < 1.4 * 2**order, (adjoint, g1, g2)


def test_adaptive_methods_get_more_accurate_with_tighter_tolerance(x64):
    for method in ADAPTIVE:
        errs = [
            abs(
                float(
                    odeint(
                        lambda y, t: -y,
                        1.0,
                        jnp.array([0.0, 2.0]),
                        method=method,
                        rtol=tol,
                        atol=tol,
                    )[-1]
                )
                - np.exp(-2.0)
            )
            for tol in (1e-4, 1e-9)
        ]
        assert errs[1] < 1e-8 and errs[1] < errs[0], (method, errs)


def test_vmap_elements_take_their_own_steps(x64):
    def solve(k):
        return odeint(
            lambda y, t, k: -k * y,
            1.0,
            jnp.array([0.0, 1.0]),
            k,
            rtol=1e-8,
            atol=1e-8,
            return_info=True,
        )

    ks = jnp.array([0.1, 50.0])
    ys, info = jax.vmap(solve)(ks)
    np.testing.assert_allclose(ys[:, -1], np.exp(-np.asarray(ks)), rtol=1e-6, atol=1e-8)
    assert info.steps.shape == (2,) and np.all(np.asarray(info.status) == SUCCESS)
    assert int(info.steps[1]) > int(info.steps[0])
    # the same as solving each element alone
    _, info0 = solve(ks[0])
    assert int(info0.steps) == int(info.steps[0])


def test_info_fields(x64):
    ys, info = odeint(lambda y, t: -y, 1.0, jnp.array([0.0, 1.0, 2.0]), return_info=True)
    assert int(info.status) == SUCCESS
    assert int(info.steps) > 0 and int(info.rejected) >= 0
    assert int(info.num_fevals) >= 6 * int(info.steps)  # dopri5: at least 6 per step
    np.testing.assert_allclose(info.t_final, 2.0)


# ---------------------------------------------------------------------------
# 3. Against diffrax: Lotka-Volterra in float64.

LV_TS = np.linspace(0.0, 4.0, 9)
LV_P = np.array([1.5, 1.0, 3.0, 1.0])
LV_Y0 = np.array([1.0, 1.0])


def _lv(y, t, p):
    x, z = y[0], y[1]
    return jnp.stack([p[0] * x - p[1] * x * z, -p[2] * z + p[3] * x * z])


def _lv_loss(ys):
    return jnp.sum(ys[:, 0] ** 2) + jnp.sum(jnp.log(ys[:, 1]))


def _lv_diffrax(p, y0, solver):
    sol = diffrax.diffeqsolve(
        diffrax.ODETerm(lambda t, y, p: _lv(y, t, p)),
        solver,
        t0=0.0,
        t1=float(LV_TS[-1]),
        dt0=0.01,
        y0=y0,
        args=p,
        saveat=diffrax.SaveAt(ts=jnp.asarray(LV_TS)),
        stepsize_controller=diffrax.PIDController(rtol=1e-11, atol=1e-11),
        max_steps=20000,
    )
    return sol.ys


@functools.cache
def _lv_reference():
    """Values and gradients of the loss from diffrax (Tsit5, discretise-then-optimise)."""
    assert jax.config.jax_enable_x64
    f = lambda p, y0: _lv_loss(_lv_diffrax(p, y0, diffrax.Tsit5()))
    ys = _lv_diffrax(jnp.asarray(LV_P), jnp.asarray(LV_Y0), diffrax.Tsit5())
    grads = jax.jit(jax.grad(f, argnums=(0, 1)))(jnp.asarray(LV_P), jnp.asarray(LV_Y0))
    return np.asarray(ys), tuple(np.asarray(g) for g in grads)


@pytest.mark.parametrize(
    ("method", "adjoint"),
    _slow_unless(
        {("dopri5", "backsolve"), ("tsit5", "checkpoint")},
        *[(m, a) for m in ["dopri5", "tsit5", "dopri8", "kvaerno5"] for a in ADJOINTS],
    ),
)
def test_lotka_volterra_against_diffrax(x64, method, adjoint):
    ys_ref, grads_ref = _lv_reference()

    def ours(p, y0):
        return odeint(
            _lv, y0, jnp.asarray(LV_TS), p, method=method, adjoint=adjoint, rtol=1e-11, atol=1e-11
        )

    p, y0 = jnp.asarray(LV_P), jnp.asarray(LV_Y0)
    np.testing.assert_allclose(ours(p, y0), ys_ref, rtol=1e-7)
    grads = jax.jit(jax.grad(lambda p, y0: _lv_loss(ours(p, y0)), argnums=(0, 1)))(p, y0)
    for g, g_ref in zip(grads, grads_ref):
        np.testing.assert_allclose(g, g_ref, rtol=1e-6)


# ---------------------------------------------------------------------------
# 4. Stiff problems.


def _robertson(y, t, k):
    y1, y2, y3 = y[0], y[1], y[2]
    return jnp.stack(
        [
            -k[0] * y1 + k[2] * y2 * y3,
            k[0] * y1 - k[2] * y2 * y3 - k[1] * y2**2,
            k[1] * y2**2,
        ]
    )


ROB_K = np.array([0.04, 3e7, 1e4])
ROB_TS = np.array([0.0, 0.4, 4.0, 40.0])


@functools.cache
def _robertson_scipy():
    def fun(t, y):
        k = ROB_K
        return np.array(
            [
                -k[0] * y[0] + k[2] * y[1] * y[2],
                k[0] * y[0] - k[2] * y[1] * y[2] - k[1] * y[1] ** 2,
                k[1] * y[1] ** 2,
            ]
        )

    sol = osp_integrate.solve_ivp(
        fun,
        (0.0, ROB_TS[-1]),
        [1.0, 0.0, 0.0],
        method="Radau",
        t_eval=ROB_TS,
        rtol=1e-12,
        atol=1e-16,
    )
    assert sol.success
    return sol.y.T


def test_robertson_kvaerno5_matches_scipy_radau(x64):
    ys, info = odeint(
        _robertson,
        jnp.array([1.0, 0.0, 0.0]),
        jnp.asarray(ROB_TS),
        jnp.asarray(ROB_K),
        method="kvaerno5",
        rtol=1e-8,
        atol=1e-12,
        return_info=True,
    )
    ref = _robertson_scipy()
    np.testing.assert_allclose(ys[:, [0, 2]], ref[:, [0, 2]], rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(ys[:, 1], ref[:, 1], rtol=1e-4, atol=1e-12)
    np.testing.assert_allclose(ys.sum(axis=1), 1.0, rtol=1e-9)  # mass is conserved
    assert int(info.status) == SUCCESS and int(info.steps) < 2000


def test_explicit_method_on_a_stiff_problem_fails_loudly(x64):
    def solve(**kw):
        return odeint(
            _robertson,
            jnp.array([1.0, 0.0, 0.0]),
            jnp.array([0.0, 1e3]),
            jnp.asarray(ROB_K),
            method="dopri5",
            rtol=1e-6,
            atol=1e-10,
            mxstep=200,
            **kw,
        )

    _raises_at_run_time(solve, match="mxstep")
    ys, info = solve(throw=False, return_info=True)
    assert int(info.status) in (MAX_STEPS, DT_UNDERFLOW)
    assert 0.0 < float(info.t_final) < 1e3
    np.testing.assert_array_equal(ys[0], [1.0, 0.0, 0.0])
    assert np.all(np.isnan(np.asarray(ys[1])))


# ---------------------------------------------------------------------------
# 5. Failure modes.


@pytest.mark.parametrize(
    "ts",
    [[0.0, 1.0, 0.5], [0.0, 1.0, 1.0], [1.0, 0.0]],
    ids=["decreasing", "repeated", "backwards"],
)
def test_non_increasing_t_raises(x64, ts):
    with pytest.raises(ValueError, match=r"\bt\b"):
        odeint(lambda y, t: -y, 1.0, jnp.array(ts))


def test_mxstep_exceeded_reports_the_time_reached(x64):
    solve = lambda **kw: odeint(
        lambda y, t: -y, 1.0, jnp.array([0.0, 1.0, 10.0]), mxstep=5, rtol=1e-12, atol=1e-12, **kw
    )
    msg = _raises_at_run_time(solve, match="mxstep")
    assert re.search(r"\d\.\d|\de-?\d", msg), msg  # the time reached
    ys, info = solve(throw=False, return_info=True)
    assert int(info.status) == MAX_STEPS
    t_final = float(info.t_final)
    assert 0.0 < t_final < 1.0
    assert float(ys[0]) == 1.0 and np.all(np.isnan(np.asarray(ys[1:])))
    # also when only the gradient is used
    _raises_at_run_time(
        jax.grad(
            lambda y0: odeint(
                lambda y, t: -y, y0, jnp.array([0.0, 10.0]), mxstep=5, rtol=1e-12, atol=1e-12
            )[-1]
        ),
        1.0,
        match="mxstep",
    )


def test_nan_dynamics_raise(x64):
    def f(y, t):
        return jnp.where(t > 0.5, jnp.nan, -y)

    solve = lambda **kw: odeint(f, jnp.array([1.0, 2.0]), jnp.array([0.0, 0.25, 1.0]), **kw)
    _raises_at_run_time(solve, match=r"(?i)non-?finite|nan")
    ys, info = solve(throw=False, return_info=True)
    assert int(info.status) == NONFINITE
    np.testing.assert_allclose(ys[1], np.exp(-0.25) * np.array([1.0, 2.0]), rtol=1e-7)
    assert np.all(np.isnan(np.asarray(ys[2])))


def test_status_per_element_under_vmap(x64):
    """sqrt(-1) = NaN fails one element; the others are unaffected."""

    def solve(k, **kw):
        return odeint(lambda y, t, k: -jnp.sqrt(k) * y, 1.0, jnp.array([0.0, 1.0]), k, **kw)

    ks = jnp.array([1.0, -1.0, 4.0])
    ys, info = jax.vmap(functools.partial(solve, throw=False, return_info=True))(ks)
    np.testing.assert_array_equal(np.asarray(info.status), [SUCCESS, NONFINITE, SUCCESS])
    np.testing.assert_allclose(ys[[0, 2], -1], np.exp([-1.0, -2.0]), rtol=1e-7)
    assert np.isnan(float(ys[1, -1]))
    # the good elements take the steps they take alone
    _, info_alone = solve(4.0, return_info=True)
    assert int(info.steps[2]) == int(info_alone.steps)
    _raises_at_run_time(jax.vmap(solve), ks, match=r"(?i)non-?finite|nan")


def test_fixed_step_method_without_dt_raises():
    for method in FIXED:
        with pytest.raises(ValueError, match=r"\bdt\b"):
            odeint(lambda y, t: -y, 1.0, jnp.array([0.0, 1.0]), method=method)


def test_unknown_method_raises():
    with pytest.raises(ValueError, match="rk45"):
        odeint(lambda y, t: -y, 1.0, jnp.array([0.0, 1.0]), method="rk45")


def test_integer_y0_raises():
    with pytest.raises(TypeError):
        odeint(lambda y, t: -y, jnp.array([1, 2]), jnp.array([0.0, 1.0]))


# ---------------------------------------------------------------------------
# 6. float32.


def test_float32_pendulum_against_scipy():
    assert not jax.config.jax_enable_x64
    y0 = np.array([np.pi - 0.1, 0.0])
    ts = np.linspace(0.0, 1.0, 11)
    f = lambda y, t, m, g: jnp.stack(_pend(jnp, y, t, m, g))
    ys = odeint(
        f,
        jnp.asarray(y0, jnp.float32),
        jnp.asarray(ts, jnp.float32),
        0.25,
        9.8,
        rtol=1e-6,
        atol=1e-6,
    )
    assert ys.dtype == jnp.float32
    ref = osp_integrate.odeint(
        lambda y, t: np.array(_pend(np, y, t, 0.25, 9.8)), y0, ts, rtol=1e-12, atol=1e-12
    )
    np.testing.assert_allclose(ys, ref, rtol=1e-4, atol=1e-4)
    g = jax.grad(
        lambda m: odeint(
            f,
            jnp.asarray(y0, jnp.float32),
            jnp.asarray(ts, jnp.float32),
            m,
            9.8,
            rtol=1e-6,
            atol=1e-6,
        )[-1, 0]
    )(jnp.float32(0.25))
    assert g.dtype == jnp.float32 and np.isfinite(float(g))
    eps = 1e-6
    fd = (
        osp_integrate.odeint(
            lambda y, t: np.array(_pend(np, y, t, 0.25 + eps, 9.8)), y0, ts, rtol=1e-12, atol=1e-12
        )[-1, 0]
        - osp_integrate.odeint(
            lambda y, t: np.array(_pend(np, y, t, 0.25 - eps, 9.8)), y0, ts, rtol=1e-12, atol=1e-12
        )[-1, 0]
    ) / (2 * eps)
    np.testing.assert_allclose(g, fd, rtol=1e-3, atol=1e-3)
