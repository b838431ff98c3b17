"""`solvers.minimize`: values (closed forms, scipy), implicit derivatives, diagnostics, errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import scipy.optimize

from implicitdiff import check_grads, linear_solve
from solvers import MAX_STEPS, NONFINITE, SUCCESS, minimize

from ._transforms import transform_table

pytestmark = pytest.mark.usefixtures("fast_compiles")

# "optax.sgd": an optax transformation; on exp(x) - a x (Hessian a) it contracts for a < 6.6
METHODS = {"lbfgs": "lbfgs", "newton": "newton", "optax.sgd": optax.sgd(0.3)}
RUNTIME_ERRORS = (RuntimeError, ValueError)  # see implicitdiff.error_if: eager, jit, fast path


def log_a(a, method="lbfgs", **kw):
    """argmin_x exp(x) - a x = log(a), from x0 = 0."""
    return minimize(lambda x, a: jnp.exp(x) - a * x, 0.0, a, method=METHODS[method], **kw)


def quadratic(x, m, b):
    """0.5 x^T m x - b^T x, minimised at m^-1 b for m symmetric positive definite."""
    return 0.5 * x @ m @ x - b @ x


M = np.array([[3.0, 1.0, 0.0], [1.0, 2.0, 0.5], [0.0, 0.5, 1.5]])
B = np.array([1.0, -1.0, 2.0])


def ridge(w, x, y, lam):
    return 0.5 * jnp.mean((x @ w - y) ** 2) + 0.5 * lam * w @ w


def ridge_closed_form(x, y, lam):
    n, d = x.shape
    return np.linalg.solve(x.T @ x / n + lam * np.eye(d), x.T @ y / n)


def _data(n=20, d=3, seed=0):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal((n, d))), jnp.asarray(rng.standard_normal(n))


# ---------------------------------------------------------------------------
# Values: closed forms and scipy.


@pytest.mark.parametrize("method", list(METHODS))
def test_quadratic_closed_form(x64, method):
    m, b = jnp.asarray(M), jnp.asarray(B)

    def solve(m, b):
        return minimize(
            quadratic, jnp.zeros(3), m, b, method=METHODS[method], rtol=1e-12, atol=1e-12
        )

    x, jac_b, jac_m = jax.jit(
        lambda m, b: (solve(m, b), jax.jacrev(solve, 1)(m, b), jax.jacfwd(solve)(m, b))
    )(m, b)
    x_exact = np.linalg.solve(M, B)
    np.testing.assert_allclose(x, x_exact, rtol=1e-10)
    minv = np.linalg.inv(M)
    np.testing.assert_allclose(jac_b, minv, rtol=1e-10, atol=1e-14)
    # fun sees only the symmetric part of m: dx = -m^-1 sym(dm) x
    expected = -0.5 * (
        np.einsum("ki,j->kij", minv, x_exact) + np.einsum("kj,i->kij", minv, x_exact)
    )
    np.testing.assert_allclose(jac_m, expected, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("method", list(METHODS))
def test_quadratic_float32(method):
    x, info = minimize(
        quadratic,
        jnp.zeros(3),
        jnp.asarray(M, jnp.float32),
        jnp.asarray(B, jnp.float32),
        method=METHODS[method],
        return_info=True,
    )
    assert x.dtype == jnp.float32 and int(info.status) == SUCCESS
    np.testing.assert_allclose(x, np.linalg.solve(M, B), rtol=2e-5, atol=2e-5)


def rosenbrock(x):
    return jnp.sum(100.0 * (x[1:] - x[:-1] ** 2) ** 2 + (1.0 - x[:-1]) ** 2)


@pytest.mark.parametrize("method", ["lbfgs", "newton"])
def test_rosenbrock_matches_scipy(x64, method):
    x0 = np.array([-1.2, 1.0, -1.2, 1.0])
    np.testing.assert_allclose(rosenbrock(jnp.asarray(x0)), scipy.optimize.rosen(x0), rtol=1e-14)
    ref = scipy.optimize.minimize(
        scipy.optimize.rosen,
        x0,
        jac=scipy.optimize.rosen_der,
        method="BFGS",
        options={"gtol": 1e-10},
    )
    x, info = minimize(
        rosenbrock, jnp.asarray(x0), method=method, rtol=1e-13, atol=1e-13, return_info=True
    )
    g0 = np.max(np.abs(scipy.optimize.rosen_der(x0)))
    assert int(info.status) == SUCCESS and float(info.residual) <= 1e-13 * (1 + g0)
    np.testing.assert_allclose(x, np.ones(4), rtol=1e-7)
    np.testing.assert_allclose(x, ref.x, rtol=1e-6)


@pytest.mark.parametrize("method", ["lbfgs", "newton"])
def test_rosenbrock_float32(method):
    # the default float32 tolerance stops once the gradient has shrunk by 1e-5
    x = minimize(rosenbrock, jnp.array([-1.2, 1.0]), method=method)
    np.testing.assert_allclose(x, np.ones(2), rtol=5e-5)
    x = minimize(rosenbrock, jnp.array([-1.2, 1.0]), method=method, rtol=1e-7, atol=1e-7)
    np.testing.assert_allclose(x, np.ones(2), rtol=1e-5)


@pytest.mark.parametrize("method", ["lbfgs", "newton"])
def test_ridge_regression_closed_form(x64, method):
    x, y = _data()
    w = minimize(ridge, jnp.zeros(3), x, y, 0.1, method=method)  # default tolerance
    np.testing.assert_allclose(w, ridge_closed_form(np.asarray(x), np.asarray(y), 0.1), rtol=1e-7)


def _logistic(p, x, y, lam):
    z = x @ p["w"] + p["b"]
    return jnp.mean(jnp.logaddexp(0.0, z) - y * z) + 0.5 * lam * p["w"] @ p["w"]


def _logistic_np(z, x, y, lam):
    """The same objective and its gradient in NumPy, on the flat vector (w, b)."""
    w, b = z[:-1], z[-1]
    t = x @ w + b
    s = 1.0 / (1.0 + np.exp(-t)) - y
    value = np.mean(np.logaddexp(0.0, t) - y * t) + 0.5 * lam * w @ w
    return value, np.append(x.T @ s / len(y) + lam * w, s.mean())


def _logistic_hessian_np(z, x, y, lam):
    """The Hessian of `_logistic_np` in (w, b)."""
    a = np.hstack([x, np.ones((len(y), 1))])
    sig = 1.0 / (1.0 + np.exp(-(a @ z)))
    reg = np.diag(np.append(np.full(x.shape[1], lam), 0.0))
    return a.T @ ((sig * (1 - sig))[:, None] * a) / len(y) + reg


@pytest.mark.parametrize("method", ["lbfgs", "newton"])
def test_pytree_x_matches_scipy(x64, method):
    """Regularised logistic regression with x = {"w": (3,), "b": ()}."""
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((40, 3)), (rng.random(40) < 0.5).astype(float)
    lam = 0.1
    # scipy's BFGS stops with |grad| anywhere up to about 1e-9 ("precision loss"), which
    # leaves x off by up to 1e-8: a few Newton steps with the exact Hessian take the
    # reference to rounding level.
    z = scipy.optimize.minimize(
        _logistic_np, np.zeros(4), args=(x, y, lam), jac=True, method="BFGS"
    ).x
    for _ in range(3):
        z = z - np.linalg.solve(_logistic_hessian_np(z, x, y, lam), _logistic_np(z, x, y, lam)[1])
    grad0 = _logistic_np(np.zeros(4), x, y, lam)[1]
    assert np.max(np.abs(_logistic_np(z, x, y, lam)[1])) < 1e-15
    p0 = {"w": jnp.zeros(3), "b": jnp.asarray(0.0)}
    args = (jnp.asarray(x), jnp.asarray(y), lam)
    p = minimize(_logistic, p0, *args, method=method, rtol=1e-12, atol=1e-12)
    # The solve stops at max |grad| <= atol + rtol max |grad(x0)|; x is then within
    # |grad|_2 / lambda_min(H) of the minimiser.
    grad_bound = np.sqrt(4) * (1e-12 + 1e-12 * np.max(np.abs(grad0)))
    bound = grad_bound / np.linalg.eigvalsh(_logistic_hessian_np(z, x, y, lam))[0]
    err = np.linalg.norm(np.append(p["w"], p["b"]) - z)
    assert err <= bound, (err, bound)


OPTAX = {
    "adam": optax.adam(0.1),
    "sgd": optax.sgd(0.3),
    "sgd+momentum": optax.sgd(0.1, momentum=0.9),
    "chain(clip, sgd)": optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.3)),
    # a plain GradientTransformation, whose update takes no extra arguments
    "scale": optax.scale(-0.3),
}


@pytest.mark.parametrize("name", list(OPTAX))
def test_optax_transformations_converge(name):
    m, b = jnp.asarray(M, jnp.float32), jnp.asarray(B, jnp.float32)
    x, info = minimize(quadratic, jnp.zeros(3), m, b, method=OPTAX[name], return_info=True)
    assert int(info.status) == SUCCESS and 0 < int(info.steps) < 1000
    np.testing.assert_allclose(x, np.linalg.solve(M, B), rtol=5e-5, atol=5e-5)
    np.testing.assert_allclose(
        jax.grad(lambda b: minimize(quadratic, jnp.zeros(3), m, b, method=OPTAX[name])[0])(b),
        np.linalg.inv(M)[0],
        rtol=1e-5,
    )


# ---------------------------------------------------------------------------
# Transformations, against the closed form log(a) in float64.

A = 3.0  # scalar point
AS = np.array([0.5, 3.0, 5.0])  # batch point

X = np.log
D1 = lambda a: 1.0 / a
D2 = lambda a: -1.0 / a**2


TRANSFORMS = transform_table(X, D1, D2, A, AS)


# L-BFGS (with its zoom line search) is slow to compile: these run in the slow CI step.
LBFGS_SLOW = {"jacfwd", "jacrev", "grad(grad)", "jit(grad)", "linearize", "vmap", "jit(vmap(grad))"}


@pytest.mark.parametrize(
    ("name", "method"),
    [
        pytest.param(
            name,
            method,
            id=f"{name}-{method}",
            marks=[pytest.mark.slow] if method == "lbfgs" and name in LBFGS_SLOW else [],
        )
        for name in TRANSFORMS
        for method in METHODS
    ],
)
def test_transformations(x64, name, method):
    transform, expected, at = TRANSFORMS[name]
    f = functools.partial(log_a, method=method, rtol=1e-12, atol=1e-12)
    at = jnp.asarray(at, jnp.float64)
    np.testing.assert_allclose(transform(f)(at), expected(np.asarray(at)), rtol=1e-9)


@pytest.mark.parametrize("method", list(METHODS))
def test_closed_over_value_gets_the_implicit_gradient(x64, method):
    def log_c(c):
        fun = lambda x: jnp.exp(x) - c * x
        return minimize(fun, jnp.float64(0.0), method=METHODS[method], rtol=1e-12, atol=1e-12)

    np.testing.assert_allclose(jax.grad(log_c)(3.0), D1(3.0), rtol=1e-10)
    # under jit, c is a tracer when the closure is built
    c = jnp.array([2.0, 3.0, 4.0])
    d1, d2, batch = jax.jit(
        lambda c, cs: (jax.jacfwd(log_c)(c), jax.hessian(log_c)(c), jax.vmap(jax.grad(log_c))(cs))
    )(3.0, c)
    np.testing.assert_allclose(d1, D1(3.0), rtol=1e-10)
    np.testing.assert_allclose(d2, D2(3.0), rtol=1e-9)
    np.testing.assert_allclose(batch, D1(c), rtol=1e-10)


def test_x0_gets_no_derivative(x64):
    g = jax.grad(lambda x0: minimize(lambda x: jnp.exp(x) - 3.0 * x, x0, method="newton"))
    assert float(g(0.5)) == 0.0


# ---------------------------------------------------------------------------
# Hyper-gradients of ridge regression: closed forms and finite differences (float64).
#
# w(lam) = (G + lam I)^-1 c with G = X^T X / n, c = X^T y / n, so
# dw/dlam = -(G + lam I)^-1 w and d2w/dlam2 = 2 (G + lam I)^-2 w.


@pytest.mark.parametrize("method", ["lbfgs", "newton"])
def test_ridge_hypergradient_closed_form(x64, method):
    x, y = _data()
    xn, yn = np.asarray(x), np.asarray(y)
    h = xn.T @ xn / len(yn) + 0.1 * np.eye(3)
    w = ridge_closed_form(xn, yn, 0.1)

    def solve(lam):
        return minimize(ridge, jnp.zeros(3), x, y, lam, method=method, rtol=1e-12, atol=1e-12)

    # and a validation loss through the minimiser
    xv, yv = _data(seed=1)
    val = lambda lam: jnp.mean((xv @ solve(lam) - yv) ** 2)
    d1, d2, dval = jax.jit(
        lambda lam: (jax.jacrev(solve)(lam), jax.jacfwd(jax.jacrev(solve))(lam), jax.grad(val)(lam))
    )(0.1)
    np.testing.assert_allclose(d1, -np.linalg.solve(h, w), rtol=1e-9)
    np.testing.assert_allclose(d2, 2 * np.linalg.solve(h, np.linalg.solve(h, w)), rtol=1e-8)
    residual = np.asarray(xv) @ w - np.asarray(yv)
    expected = 2 * residual @ np.asarray(xv) @ -np.linalg.solve(h, w) / len(residual)
    np.testing.assert_allclose(dval, expected, rtol=1e-9)


def test_ridge_check_grads(x64):
    """The hyper-gradients in the data matrix and in lam against finite differences."""
    x, y = _data()

    def solve(x, lam):
        return minimize(ridge, jnp.zeros(3), x, y, lam, method="newton", rtol=1e-13, atol=1e-13)

    rows = check_grads(solve, (x, 0.1), order=1)
    assert {r.argument for r in rows} >= {"x", "lam"} and all(r.passed for r in rows)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["lbfgs", "newton"])
def test_ridge_check_grads_second_order(x64, method):
    x, y = _data()

    def solve(x, y, lam):
        return minimize(ridge, jnp.zeros(3), x, y, lam, method=method, rtol=1e-13, atol=1e-13)

    check_grads(solve, (x, y, 0.1), order=2)


# ---------------------------------------------------------------------------
# Linear solvers for the derivatives.


@pytest.mark.parametrize(
    "linear_solver",
    [
        "auto",
        "dense",
        "cg",
        "gmres",
        "bicgstab",
        "cg(rtol=1e-12)",
        linear_solve.CG(rtol=1e-12),
        linear_solve.Dense(symmetric=True),
    ],
    ids=str,
)
def test_linear_solvers_give_the_same_derivatives(x64, linear_solver):
    if linear_solver == "cg(rtol=1e-12)":
        linear_solver = functools.partial(linear_solve.cg, rtol=1e-12)
    x, y = _data()
    xn, yn = np.asarray(x), np.asarray(y)
    h = xn.T @ xn / len(yn) + 0.1 * np.eye(3)
    w = ridge_closed_form(xn, yn, 0.1)

    def solve(lam, y):
        return minimize(
            ridge,
            jnp.zeros(3),
            x,
            y,
            lam,
            method="newton",
            rtol=1e-12,
            atol=1e-12,
            linear_solver=linear_solver,
        )

    d_lam, d_y = jax.jit(lambda lam, y: (jax.jacfwd(solve)(lam, y), jax.jacrev(solve, 1)(lam, y)))(
        0.1, y
    )
    np.testing.assert_allclose(d_lam, -np.linalg.solve(h, w), rtol=1e-8)
    np.testing.assert_allclose(d_y, np.linalg.solve(h, xn.T) / len(yn), rtol=1e-8, atol=1e-12)


# ---------------------------------------------------------------------------
# Diagnostics and non-convergence.


@pytest.mark.parametrize("method", list(METHODS))
def test_info(x64, method):
    x, info = log_a(jnp.float64(3.0), method, return_info=True)
    assert int(info.status) == SUCCESS and bool(info.converged)
    assert int(info.steps) > 0
    # the residual is max |grad_x fun|, at most atol + rtol |fun| (default 1e-8 each)
    assert float(info.residual) == pytest.approx(abs(np.exp(float(x)) - 3.0), abs=1e-15)
    assert float(info.residual) < 1e-8 * (1 + abs(3.0 - 3.0 * np.log(3.0)))


def test_non_convergence_raises_with_the_residual():
    with pytest.raises(RUNTIME_ERRORS, match=r"minimize did not converge.*last residual"):
        jax.block_until_ready(log_a(5.0, "optax.sgd", max_steps=2))
    with pytest.raises(RUNTIME_ERRORS, match=r"minimize did not converge.*status 1.*after 2 steps"):
        jax.block_until_ready(jax.jit(lambda a: log_a(a, "newton", max_steps=2))(50.0))


@pytest.mark.parametrize("method", list(METHODS))
def test_max_steps_status_without_throwing(method):
    x, info = log_a(5.0, method, max_steps=2, throw=False, return_info=True)
    assert int(info.status) == MAX_STEPS and not bool(info.converged)
    assert int(info.steps) == 2
    assert float(info.residual) == pytest.approx(abs(np.exp(float(x)) - 5.0), rel=1e-5)
    assert float(info.residual) > 1e-3


@pytest.mark.parametrize("method", list(METHODS))
def test_nan_is_reported(method):
    x, info = log_a(jnp.nan, method, throw=False, return_info=True)
    assert int(info.status) == NONFINITE
    with pytest.raises(RUNTIME_ERRORS, match="minimize did not converge: status 2"):
        jax.block_until_ready(log_a(jnp.nan, method))


def test_throw_false_needs_return_info():
    """Without the run-time check and without the status, nothing would show a failure."""
    match = r"minimize: `throw=False`.*`return_info=True`"
    with pytest.raises(ValueError, match=match):
        log_a(5.0, throw=False)
    with pytest.raises(ValueError, match=match):
        log_a(5.0, "optax.sgd", throw=False)
    with pytest.raises(ValueError, match=match):
        jax.jit(jax.grad(lambda a: log_a(a, "newton", throw=False)))(5.0)
    # With the info the same failing solve reports, and a good one answers.
    x, info = log_a(5.0, "optax.sgd", max_steps=2, throw=False, return_info=True)
    assert int(info.status) == MAX_STEPS and not bool(info.converged)
    x, info = log_a(5.0, "newton", throw=False, return_info=True)
    assert int(info.status) == SUCCESS
    np.testing.assert_allclose(x, np.log(5.0), rtol=1e-5)  # float32: |grad| <= 1e-5 (1 + 5)


def test_status_per_vmap_element():
    """sgd(0.5) on 0.5 h x^2 - x, minimised at 1 / h: the step contracts by |1 - h / 2|,
    slowly for h = 0.01, so that element runs out of steps; h = 2 takes one exact step."""
    sgd = optax.sgd(0.5)

    def solve(h):
        fun = lambda x, h: 0.5 * h * x**2 - x
        return minimize(fun, 0.0, h, method=sgd, max_steps=50, throw=False, return_info=True)

    x, info = jax.vmap(solve)(jnp.array([1.0, 0.01, 2.0]))
    np.testing.assert_array_equal(info.status, [SUCCESS, MAX_STEPS, SUCCESS])
    assert int(info.steps[1]) == 50 and int(info.steps[2]) == 1 and 0 < int(info.steps[0]) < 50
    # converged to the default float32 tolerance: |grad| <= 1e-5 (1 + |grad(x0)|)
    np.testing.assert_allclose(np.asarray(x)[[0, 2]], [1.0, 0.5], rtol=3e-5)
    np.testing.assert_allclose(x[1], (1 - 0.995**50) / 0.01, rtol=1e-4)  # sgd's own iterate
    x, info = jax.vmap(lambda a: log_a(a, "newton", throw=False, return_info=True))(
        jnp.array([2.0, jnp.nan, 4.0])
    )
    np.testing.assert_array_equal(info.status, [SUCCESS, NONFINITE, SUCCESS])
    np.testing.assert_allclose(np.asarray(x)[[0, 2]], np.log([2.0, 4.0]), rtol=1e-6)


@pytest.mark.parametrize("method", ["lbfgs", "newton"])
def test_a_constant_offset_does_not_change_the_minimiser(method):
    fun = lambda x, c: (x - 2.0) ** 2 + c
    x, info = minimize(fun, 0.0, 1e6, method=method, return_info=True)
    np.testing.assert_allclose(x, 2.0, rtol=1e-5)
    assert float(info.residual) < 1e-4


@pytest.mark.parametrize(
    ("fun", "lr", "max_steps"),
    [
        # x <- -1.5 x + 0.5 runs away (once reported as SUCCESS at x ~ 3e5, |grad| ~ 1e6)
        (lambda x: 2.5 * x**2 - x, 0.5, 50),
        # one step overshoots to x = 14.7, the next to x ~ -7e5 (once reported as SUCCESS)
        (lambda x: jnp.exp(x) - 50.0 * x, 0.3, 2),
    ],
    ids=["quadratic", "exp"],
)
def test_a_diverging_optimiser_is_not_reported_as_converged(fun, lr, max_steps):
    x, info = minimize(
        fun, 0.0, method=optax.sgd(lr), max_steps=max_steps, throw=False, return_info=True
    )
    assert int(info.status) != SUCCESS, (x, info.residual)


# ---------------------------------------------------------------------------
# Bad input.


def test_bad_input_names_the_argument():
    fun = lambda x, a: jnp.exp(x) - a * x
    with pytest.raises(ValueError, match="`method` must be one of"):
        minimize(fun, 0.0, 2.0, method="bfgs")
    with pytest.raises(TypeError, match="`method` must be one of .* or an optax.Gradient"):
        minimize(fun, 0.0, 2.0, method=optax.adam)  # the factory, not a transformation
    with pytest.raises(TypeError, match="`method` must be one of .* or an optax.Gradient"):
        minimize(fun, 0.0, 2.0, method=42)
    with pytest.raises(TypeError, match="`fun` must be callable"):
        minimize(2.0, 0.0)
    with pytest.raises(TypeError, match=r"fun\(x0, \*args\) must return a real floating-point"):
        minimize(lambda x: x**2, jnp.zeros(2))
    with pytest.raises(TypeError, match=r"fun\(x0, \*args\) must return a real floating-point"):
        minimize(lambda x: (x**2, x), 1.0)
    with pytest.raises(TypeError, match=r"fun\(x0, \*args\) must return a real floating-point"):
        minimize(lambda x: jnp.sum(x > 0), 1.0)
    with pytest.raises(TypeError, match="`x0` leaf 0 has dtype int"):
        minimize(fun, 0, 2.0)
    with pytest.raises(TypeError, match="`max_steps` must be a Python int"):
        jax.jit(lambda n: minimize(fun, 0.0, 2.0, max_steps=n))(5)
    with pytest.raises(ValueError, match="`max_steps` must be an int >= 1"):
        minimize(fun, 0.0, 2.0, max_steps=-1)
    with pytest.raises(TypeError, match="`return_info` must be True or False"):
        minimize(fun, 0.0, 2.0, return_info="yes")
    with pytest.raises(ValueError, match="`linear_solver` must be one of"):
        minimize(fun, 0.0, 2.0, linear_solver="normal_cg")
