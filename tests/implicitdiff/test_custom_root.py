"""Tests for `implicitdiff.custom_root`: implicit derivatives of a root, under every transformation.

Modelled on (and a superset of) JAX's own tests for `lax.custom_root`
(tests/custom_root_test.py). Every derivative is checked against a real value:
a closed form, `jnp.linalg.solve` and its autodiff, autodiff of a well-converged
unrolled iteration, or finite differences (`jax.test_util.check_grads`, float64).
"""

import re

import jax
import jax.numpy as jnp
import jax.scipy as jsp
import numpy as np
import pytest
from jax import lax
from jax.flatten_util import ravel_pytree
from jax.test_util import check_grads

from implicitdiff import custom_linear_solve, custom_root

# ---------------------------------------------------------------------------
# Solvers and tangent solvers used throughout.


def binary_search(func, x0, low=0.0, high=100.0):
    """Bisection on [low, high] with a while_loop (not reverse-differentiable)."""
    dtype = jnp.result_type(x0)

    def cond(state):
        lo, hi = state
        mid = 0.5 * (lo + hi)
        return (lo < mid) & (mid < hi)

    def body(state):
        lo, hi = state
        mid = 0.5 * (lo + hi)
        upper = func(mid) > 0
        return jnp.where(upper, lo, mid), jnp.where(upper, mid, hi)

    sol, _ = lax.while_loop(cond, body, (jnp.asarray(low, dtype), jnp.asarray(high, dtype)))
    return sol


def newton_scalar(func, x0, steps=40):
    """Scalar Newton with a fixed number of steps."""
    return lax.fori_loop(0, steps, lambda i, x: x - func(x) / jax.grad(func)(x), x0)


def newton_raphson(func, x0):
    """JAX's test solver: Newton with a while_loop, for arrays of any shape."""
    tol = 1e-16
    max_it = 30
    fx0, dfx0 = func(x0), jax.jacobian(func)(x0)

    def cond(state):
        it, _, fx, _ = state
        return (jnp.max(jnp.abs(fx)) > tol) & (it < max_it)

    def body(state):
        it, x, fx, dfx = state
        step = jnp.linalg.solve(dfx.reshape((-1, fx.size)), fx.ravel()).reshape(fx.shape)
        x_next = x - step
        return it + 1, x_next, func(x_next), jax.jacobian(func)(x_next)

    _, x, _, _ = lax.while_loop(cond, body, (0, x0, fx0, dfx0))
    return x


def scalar_solve(g, y):
    return y / g(1.0)


def vector_solve(g, y):
    """Dense tangent solve: materialise the Jacobian of the linear map `g`."""
    return jnp.linalg.solve(jax.jacobian(g)(y), y)


def flat_tangent_solve(g, y):
    """Dense tangent solve for arrays of any shape (JAX's test helper)."""
    return jnp.linalg.solve(jax.jacobian(g)(y).reshape(-1, y.size), y.ravel()).reshape(y.shape)


def tree_tangent_solve(g, y):
    """Dense tangent solve for pytrees: ravel, materialise, solve, unravel."""
    flat, unravel = ravel_pytree(y)
    jac = jax.jacfwd(lambda z: ravel_pytree(g(unravel(z)))[0])(flat)
    return unravel(jnp.linalg.solve(jac, flat))


SOLVERS = {"binary_search": binary_search, "newton": newton_scalar}


pytestmark = pytest.mark.usefixtures("fast_compiles")


@pytest.fixture(params=["float32", "float64"])
def dtype(request):
    if request.param == "float64":
        request.getfixturevalue("x64")
    return jnp.dtype(request.param)


def tol(dtype, f32, f64):
    return f32 if dtype == jnp.float32 else f64


def assert_trees_close(got, want, **kw):
    """assert_allclose leaf by leaf, after checking the two pytrees have one structure."""
    assert jax.tree.structure(got) == jax.tree.structure(want)
    jax.tree.map(
        lambda g, w: np.testing.assert_allclose(np.asarray(g), np.asarray(w), **kw), got, want
    )


def make_sqrt_cubed(solve, dtype):
    """x -> x**1.5 as the root of y**2 - x**3 (JAX's scalar test problem)."""

    def sqrt_cubed(x):
        f = lambda y: y**2 - x**3
        # Nonzero derivative at the initial guess, needed by Newton.
        return custom_root(f, jnp.asarray(1.0, dtype), solve, scalar_solve)

    return sqrt_cubed


# ---------------------------------------------------------------------------
# Scalar root: y**2 - x**3 = 0, so y = x**1.5, y' = 1.5 sqrt(x), y'' = 0.75 / sqrt(x).


@pytest.mark.parametrize("solver", sorted(SOLVERS))
def test_scalar_root_under_transformations(solver, dtype):
    """value, first/second/third derivatives in both modes, linearize, vmap combinations."""
    sqrt_cubed = make_sqrt_cubed(SOLVERS[solver], dtype)
    xs_np = np.array([4.0, 5.0, 9.0])
    d1 = lambda x: 1.5 * np.sqrt(x)
    d2 = lambda x: 0.75 / np.sqrt(x)
    d3 = lambda x: -0.375 * x**-1.5

    def compute(x, xs):
        y_lin, f_lin = jax.linearize(sqrt_cubed, x)
        one = jnp.ones((), dtype)
        return {
            "value": (sqrt_cubed(x), 5**1.5),
            "value_and_grad": (jax.value_and_grad(sqrt_cubed)(x), (5**1.5, d1(5.0))),
            "jvp": (jax.jvp(sqrt_cubed, (x,), (2 * one,)), (5**1.5, 2 * d1(5.0))),
            "jacfwd": (jax.jacfwd(sqrt_cubed)(x), d1(5.0)),
            "vjp": (jax.vjp(sqrt_cubed, x)[1](2 * one), (2 * d1(5.0),)),
            "linearize": ((y_lin, f_lin(one), f_lin(-3 * one)), (5**1.5, d1(5.0), -3 * d1(5.0))),
            "linear_transpose_of_linearized": (jax.linear_transpose(f_lin, x)(one), (d1(5.0),)),
            "grad_grad": (jax.grad(jax.grad(sqrt_cubed))(x), d2(5.0)),
            "hessian": (jax.hessian(sqrt_cubed)(x), d2(5.0)),
            "jacfwd_jacrev": (jax.jacfwd(jax.jacrev(sqrt_cubed))(x), d2(5.0)),
            "jacrev_jacfwd": (jax.jacrev(jax.jacfwd(sqrt_cubed))(x), d2(5.0)),
            "jacfwd_jacfwd": (jax.jacfwd(jax.jacfwd(sqrt_cubed))(x), d2(5.0)),
            "third": (jax.grad(jax.grad(jax.grad(sqrt_cubed)))(x), d3(5.0)),
            "vmap": (jax.vmap(sqrt_cubed)(xs), xs_np**1.5),
            "vmap_grad": (jax.vmap(jax.grad(sqrt_cubed))(xs), d1(xs_np)),
            "grad_vmap": (jax.grad(lambda v: jax.vmap(sqrt_cubed)(v).sum())(xs), d1(xs_np)),
            "vmap_jacfwd": (jax.vmap(jax.jacfwd(sqrt_cubed))(xs), d1(xs_np)),
            "jacrev_vmap": (jax.jacrev(jax.vmap(sqrt_cubed))(xs), np.diag(d1(xs_np))),
            "vmap_hessian": (jax.vmap(jax.hessian(sqrt_cubed))(xs), d2(xs_np)),
            "vmap_vmap": (
                jax.vmap(jax.vmap(sqrt_cubed))(jnp.stack([xs, 2 * xs])),
                np.stack([xs_np, 2 * xs_np]) ** 1.5,
            ),
        }

    out = jax.jit(compute)(jnp.asarray(5.0, dtype), jnp.asarray(xs_np, dtype))
    for name, (got, want) in out.items():
        for leaf in jax.tree.leaves(got):
            assert leaf.dtype == dtype, name
        rtol = tol(dtype, 1e-5, 1e-12)
        if name in (
            "grad_grad",
            "hessian",
            "jacfwd_jacrev",
            "jacrev_jacfwd",
            "jacfwd_jacfwd",
            "vmap_hessian",
        ):
            rtol = tol(dtype, 1e-4, 1e-10)
        elif name == "third":
            rtol = tol(dtype, 1e-3, 1e-9)
        jax.tree.map(
            lambda g, w, rtol=rtol, name=name: np.testing.assert_allclose(
                g, w, rtol=rtol, err_msg=name
            ),
            got,
            want,
        )


@pytest.mark.parametrize("solver", sorted(SOLVERS))
def test_scalar_root_eager(solver):
    """Without jit: each transformation applied op by op."""
    sqrt_cubed = make_sqrt_cubed(SOLVERS[solver], jnp.float32)
    value, grad = jax.value_and_grad(sqrt_cubed)(5.0)
    np.testing.assert_allclose(value, 5**1.5, rtol=1e-6)
    np.testing.assert_allclose(grad, 1.5 * np.sqrt(5.0), rtol=1e-6)
    np.testing.assert_allclose(
        jax.jvp(sqrt_cubed, (5.0,), (1.0,))[1], 1.5 * np.sqrt(5.0), rtol=1e-6
    )
    inputs = jnp.array([4.0, 5.0])
    np.testing.assert_allclose(jax.vmap(sqrt_cubed)(inputs), inputs**1.5, rtol=1e-6)
    np.testing.assert_allclose(jax.jit(sqrt_cubed)(5.0), 5**1.5, rtol=1e-6)


def test_scalar_check_grads(x64):
    """Finite differences to second order (JAX's check), with the non-differentiable bisection."""
    sqrt_cubed = make_sqrt_cubed(binary_search, jnp.float64)
    check_grads(jax.jit(sqrt_cubed), (5.0,), order=2, modes=["fwd", "rev"], rtol=1e-6)


def test_scalar_matches_lax_custom_root(x64):
    """Same answers as `lax.custom_root` on the same problem, to second order."""

    def make(root_fn):
        def sqrt_cubed(x):
            return root_fn(lambda y: y**2 - x**3, 1.0, newton_scalar, scalar_solve)

        return jax.jit(
            lambda x: (sqrt_cubed(x), jax.grad(sqrt_cubed)(x), jax.hessian(sqrt_cubed)(x))
        )

    ours, theirs = make(custom_root)(3.0), make(lax.custom_root)(3.0)
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(a, b, rtol=1e-13)


def test_checkpoint(dtype):
    sqrt_cubed = make_sqrt_cubed(newton_scalar, dtype)
    x = jnp.asarray(5.0, dtype)
    rtol = tol(dtype, 1e-5, 1e-12)
    for ckpt in (
        jax.checkpoint(sqrt_cubed),
        jax.checkpoint(sqrt_cubed, policy=jax.checkpoint_policies.everything_saveable),
        jax.checkpoint(sqrt_cubed, policy=jax.checkpoint_policies.nothing_saveable),
    ):
        np.testing.assert_allclose(jax.jit(ckpt)(x), 5**1.5, rtol=rtol)
        np.testing.assert_allclose(jax.jit(jax.grad(ckpt))(x), 1.5 * np.sqrt(5.0), rtol=rtol)
    np.testing.assert_allclose(
        jax.jit(jax.hessian(jax.checkpoint(sqrt_cubed)))(x),
        0.75 / np.sqrt(5.0),
        rtol=tol(dtype, 1e-4, 1e-10),
    )
    # checkpoint inside a bigger function
    f = lambda x: jnp.sin(jax.checkpoint(sqrt_cubed)(x))
    np.testing.assert_allclose(
        jax.jit(jax.grad(f))(x), np.cos(5**1.5) * 1.5 * np.sqrt(5.0), rtol=tol(dtype, 1e-4, 1e-12)
    )


def test_inside_scan_body(dtype):
    """c_{k+1} = sqrt(c_k + x_k), each square root a custom_root inside the scan body."""

    def sqrt(a):
        return custom_root(lambda y: y**2 - a, jnp.asarray(1.0, dtype), newton_scalar, scalar_solve)

    def body(c, x):
        r = sqrt(c + x)
        return r, 2 * r

    def run(xs):
        c, ys = lax.scan(body, jnp.asarray(0.0, dtype), xs)
        return c, ys

    xs = jnp.asarray([1.0, 3.0, 5.0], dtype)
    # c1 = 1, c2 = 2, c3 = sqrt(7)
    rtol = tol(dtype, 1e-5, 1e-12)
    c, ys = jax.jit(run)(xs)
    np.testing.assert_allclose(c, np.sqrt(7.0), rtol=rtol)
    np.testing.assert_allclose(ys, 2 * np.array([1.0, 2.0, np.sqrt(7.0)]), rtol=rtol)
    # dc3/dx3 = 1/(2 c3); dc3/dx2 = dc3/dc2 * dc2/dx2 = 1/(2 c3) * 1/(2 c2); etc.
    c1, c2, c3 = 1.0, 2.0, np.sqrt(7.0)
    expected = np.array([1 / (8 * c3 * c2 * c1), 1 / (4 * c3 * c2), 1 / (2 * c3)])
    np.testing.assert_allclose(jax.jit(jax.grad(lambda v: run(v)[0]))(xs), expected, rtol=rtol)
    np.testing.assert_allclose(jax.jit(jax.jacfwd(lambda v: run(v)[0]))(xs), expected, rtol=rtol)
    # vmap over the whole scan
    xss = jnp.stack([xs, xs])
    np.testing.assert_allclose(jax.jit(jax.vmap(lambda v: run(v)[0]))(xss), [c3, c3], rtol=rtol)


def test_inside_cond_and_while(x64):
    def sqrt(a):
        return custom_root(lambda y: y**2 - a, 1.0, newton_scalar, scalar_solve)

    f = jax.jit(jax.grad(lambda a: lax.cond(a > 0, sqrt, lambda a: -a, a)))
    np.testing.assert_allclose(f(4.0), 0.25, rtol=1e-12)
    np.testing.assert_allclose(f(-4.0), -1.0, rtol=1e-12)

    # forward mode through a while_loop that calls the root in its body
    def repeated(a):
        return lax.fori_loop(0, 3, lambda i, c: sqrt(c), a)  # a ** (1/8)

    np.testing.assert_allclose(
        jax.jit(jax.jacfwd(repeated))(2.0), (1 / 8) * 2.0 ** (-7 / 8), rtol=1e-12
    )


# ---------------------------------------------------------------------------
# Vector problems.


def make_linear_root(tangent_solve=vector_solve):
    def linear_root(a, b):
        f = lambda y: a @ y - b
        solution = jnp.linalg.solve(a, b)
        oracle = lambda func, x0: solution
        return custom_root(f, jnp.zeros_like(b), oracle, tangent_solve)

    return linear_root


def _rand_system(seed, n=3):
    rng = np.random.RandomState(seed)
    return rng.randn(n, n) + n * np.eye(n), rng.randn(n)


def test_vector_oracle_solve_derivatives(dtype):
    """`a @ y = b` with an oracle solve: every derivative matches `jnp.linalg.solve`'s."""
    a_np, b_np = _rand_system(0)
    a, b = a_np.astype(dtype), b_np.astype(dtype)
    linear_root = make_linear_root()
    loss = lambda f: lambda a, b: jnp.sum(jnp.sin(f(a, b)))

    def compute(a, b):
        out = {"value": (linear_root(a, b), jnp.linalg.solve(a, b))}
        for jac in (jax.jacfwd, jax.jacrev):
            for argnum in (0, 1):
                out[f"{jac.__name__}{argnum}"] = (
                    jac(linear_root, argnum)(a, b),
                    jac(jnp.linalg.solve, argnum)(a, b),
                )
        out["hessian"] = (
            jax.hessian(loss(linear_root), (0, 1))(a, b),
            jax.hessian(loss(jnp.linalg.solve), (0, 1))(a, b),
        )
        return out

    out = jax.jit(compute)(a, b)
    np.testing.assert_allclose(
        out["value"][0], np.linalg.solve(a_np, b_np), atol=tol(dtype, 1e-5, 1e-12)
    )
    for name, (got, want) in out.items():
        assert jax.tree.map(lambda x: (x.shape, x.dtype), got) == jax.tree.map(
            lambda x: (x.shape, x.dtype), want
        )
        assert_trees_close(got, want, atol=tol(dtype, 1e-4, 1e-11), err_msg=name)


def _nonlinear_solve(y):
    f = lambda x: (x - y) * (x**2 + y**2 + 1)
    return custom_root(f, -jnp.ones_like(y), newton_raphson, flat_tangent_solve)


def test_vector_nonlinear_jax_example(x64):
    """JAX's problem: (x - y)(x**2 + y**2 + 1) = 0 iff x == y; solution is y, jacobian I."""

    y = np.random.RandomState(2).randn(3, 1)
    value, jac = jax.jit(lambda y: (_nonlinear_solve(y), jax.jacrev(_nonlinear_solve)(y)))(y)
    np.testing.assert_allclose(value, y, rtol=1e-12)
    np.testing.assert_allclose(jac, np.eye(3).reshape(3, 1, 3, 1), atol=1e-12)


# x = tanh(W x + u): a contractive fixed point (||W|| < 1).
_FP_RNG = np.random.RandomState(3)
_FP_W = 0.5 * _FP_RNG.randn(4, 4) / 2.0
_FP_U = _FP_RNG.randn(4)


def _newton_vector(f, x):
    return lax.fori_loop(0, 25, lambda i, x: x - jnp.linalg.solve(jax.jacobian(f)(x), f(x)), x)


def _fixed_point_iteration(f, x):
    # Solve x - tanh(W x + u) = 0 by iterating x <- x - f(x) = tanh(W x + u).
    return lax.fori_loop(0, 200, lambda i, x: x - f(x), x)


def _fp_root(solve):
    def root(w, u):
        f = lambda x: x - jnp.tanh(w @ x + u)
        return custom_root(f, jnp.zeros_like(u), solve, vector_solve)

    return root


def _fp_unrolled(w, u):
    """Reference: plain autodiff through a well-converged fixed-point loop (a scan)."""
    return lax.fori_loop(0, 120, lambda i, x: jnp.tanh(w @ x + u), jnp.zeros_like(u))


@pytest.mark.parametrize(
    "solve, dtype",
    [
        pytest.param(_newton_vector, "float32", marks=pytest.mark.slow),
        (_fixed_point_iteration, "float64"),
    ],
    ids=["newton-float32", "fixed_point-float64"],
    indirect=["dtype"],
)
def test_vector_nonlinear_fixed_point_vs_unrolled(solve, dtype):
    assert np.linalg.norm(_FP_W, 2) < 0.9
    w, u = _FP_W.astype(dtype), _FP_U.astype(dtype)
    root = _fp_root(solve)
    loss = lambda f: lambda w, u: jnp.sum(f(w, u) ** 2)
    us = np.stack([u, -u, 0.5 * u])

    def compute(w, u, us):
        out = {"value": (root(w, u), _fp_unrolled(w, u))}
        for jac in (jax.jacfwd, jax.jacrev):
            for argnum in (0, 1):
                out[f"{jac.__name__}{argnum}"] = (
                    jac(root, argnum)(w, u),
                    jac(_fp_unrolled, argnum)(w, u),
                )
        out["hessian_u"] = (
            jax.hessian(loss(root), 1)(w, u),
            jax.hessian(loss(_fp_unrolled), 1)(w, u),
        )
        out["vmap"] = (
            jax.vmap(root, (None, 0))(w, us),
            jax.vmap(_fp_unrolled, (None, 0))(w, us),
        )
        out["grad_vmap"] = (
            jax.grad(lambda w, us: jax.vmap(root, (None, 0))(w, us).sum())(w, us),
            jax.grad(lambda w, us: jax.vmap(_fp_unrolled, (None, 0))(w, us).sum())(w, us),
        )
        return out

    out = jax.jit(compute)(w, u, us)
    x = np.asarray(out["value"][0], np.float64)
    np.testing.assert_allclose(x - np.tanh(_FP_W @ x + _FP_U), 0, atol=tol(dtype, 1e-5, 1e-14))
    for name, (got, want) in out.items():
        assert_trees_close(got, want, atol=tol(dtype, 2e-4, 1e-11), err_msg=name)


def _cholesky_root(a, b, has_aux=False, aux=None):
    """JAX's test: a @ x = b solved by Cholesky, tangent solves via custom_linear_solve."""
    f = lambda x: a @ x - b
    factors = jsp.linalg.cho_factor(a)
    cho_solve = lambda f, b: jsp.linalg.cho_solve(factors, b)

    def pos_def_solve(g, b):
        return custom_linear_solve(g, b, cho_solve, symmetric=True)

    if has_aux:
        return custom_root(f, b, lambda f, b: (cho_solve(f, b), aux), pos_def_solve, has_aux=True)
    return custom_root(f, b, cho_solve, pos_def_solve)


def test_tangent_solve_with_custom_linear_solve_cholesky(x64):
    dtype = np.dtype("float64")
    rng = np.random.RandomState(4)
    m_np, b_np = rng.randn(3, 3), rng.randn(3)
    m, b = m_np.astype(dtype), b_np.astype(dtype)
    spd = lambda m: m @ m.T + jnp.eye(3, dtype=dtype)
    ref = lambda m, b: jnp.linalg.solve(spd(m), b)
    root = lambda m, b: _cholesky_root(spd(m), b)
    loss = lambda f: lambda m, b: jnp.sum(f(m, b) ** 2)
    bs, ms = np.stack([b, 2 * b, -b]), np.stack([m, 2 * m])

    def compute(m, b, bs, ms):
        out = {"value": (root(m, b), ref(m, b))}
        for jac in (jax.jacfwd, jax.jacrev):
            for argnum in (0, 1):
                out[f"{jac.__name__}{argnum}"] = (jac(root, argnum)(m, b), jac(ref, argnum)(m, b))
        out["hessian"] = (
            jax.hessian(loss(root), (0, 1))(m, b),
            jax.hessian(loss(ref), (0, 1))(m, b),
        )
        out["vmap_b"] = (jax.vmap(root, (None, 0))(m, bs), jax.vmap(ref, (None, 0))(m, bs))
        out["vmap_grad_m"] = (
            jax.vmap(jax.grad(loss(root)), (0, None))(ms, b),
            jax.vmap(jax.grad(loss(ref)), (0, None))(ms, b),
        )
        return out

    out = jax.jit(compute)(m, b, bs, ms)
    np.testing.assert_allclose(
        out["value"][0],
        np.linalg.solve(m_np @ m_np.T + np.eye(3), b_np),
        atol=tol(dtype, 1e-4, 1e-12),
    )
    for name, (got, want) in out.items():
        assert_trees_close(got, want, atol=tol(dtype, 1e-3, 1e-10), err_msg=name)


@pytest.mark.slow
def test_vector_problems_check_grads(x64):
    """Finite-difference checks (JAX's test suite) of the vector problems, to second order."""
    a, b = _rand_system(1, n=2)
    check_grads(jax.jit(make_linear_root()), (a, b), order=2, atol=1e-8, rtol=1e-6)
    y = np.random.RandomState(2).randn(3, 1)
    check_grads(jax.jit(_nonlinear_solve), (y,), order=2, rtol=1e-5)
    rng = np.random.RandomState(5)
    m, b = rng.randn(2, 2), rng.randn(2)
    check_grads(jax.jit(lambda m, b: _cholesky_root(m @ m.T, b)), (m, b), order=2, rtol=1e-5)
    # has_aux, with an all-float aux (check_grads compares output dtypes)
    float_aux = {"converged": np.array(1.0), "nfev": np.array(12.0)}
    check_grads(
        jax.jit(lambda m, b: _cholesky_root(m @ m.T + jnp.eye(2), b, True, float_aux)),
        (m, b),
        order=2,
        rtol=3e-5,
    )


# ---------------------------------------------------------------------------
# has_aux


def test_has_aux(x64):
    aux = {
        "converged": np.array(1.0),
        "nfev": np.array(12345),
        "grad": np.array([1.0, 2.0, 3.0]),
    }
    rng = np.random.RandomState(6)
    m, b = rng.randn(2, 2), rng.randn(2)
    a = m @ m.T + np.eye(2)
    expected = np.linalg.solve(a, b)

    x, got_aux = _cholesky_root(a, b, True, aux)
    np.testing.assert_allclose(x, expected, rtol=1e-12)
    assert jax.tree.structure(got_aux) == jax.tree.structure(aux)
    jax.tree.map(np.testing.assert_array_equal, got_aux, aux)
    assert got_aux["nfev"].dtype == np.int64

    with_aux = lambda m, b: _cholesky_root(m @ m.T, b, True, aux)
    without = lambda m, b: _cholesky_root(m @ m.T, b)
    ref = lambda m, b: jnp.linalg.solve(m @ m.T, b)

    def loss(m, b):  # uses the (float) aux as well: it contributes no derivative
        x, aux_out = with_aux(m, b)
        return jnp.sum(x) + aux_out["converged"] * 3.0 + jnp.sum(aux_out["grad"])

    def compute(a, m, b):
        out = {"jit": (_cholesky_root(a, b, True, aux), (jnp.linalg.solve(a, b), aux))}
        for jac in (jax.jacfwd, jax.jacrev):
            for argnum in (0, 1):
                # gradients of the root are those of the no-aux version
                out[f"{jac.__name__}{argnum}"] = (
                    jac(lambda m, b: with_aux(m, b)[0], argnum)(m, b),
                    jac(without, argnum)(m, b),
                )
        out["grad_with_aux_in_loss"] = (
            jax.grad(loss, (0, 1))(m, b),
            jax.grad(lambda m, b: jnp.sum(ref(m, b)), (0, 1))(m, b),
        )
        out["grad_of_aux_only"] = (
            jax.grad(lambda m, b: with_aux(m, b)[1]["converged"], 1)(m, b),
            jnp.zeros(2),
        )
        return out, jax.jacfwd(with_aux, argnums=(0, 1))(m, b)

    out, (fwd_val, fwd_aux) = jax.jit(compute)(a, m, b)
    for name, (got, want) in out.items():
        assert_trees_close(got, want, atol=1e-12, err_msg=name)
    # jacfwd of the whole output: root jacobians right, aux tangents zeros of the right shapes
    expected_fwd = jax.jacfwd(ref, argnums=(0, 1))(m, b)
    assert_trees_close(fwd_val, expected_fwd, atol=1e-12)
    np.testing.assert_array_equal(fwd_aux["grad"][0], np.zeros((3, 2, 2)))
    np.testing.assert_array_equal(fwd_aux["converged"][1], np.zeros(2))
    np.testing.assert_array_equal(fwd_aux["nfev"][0], np.zeros((2, 2)))


def test_has_aux_vmap_and_scalar(dtype):
    def sqrt_with_count(a):
        def solve(f, x):
            return newton_scalar(f, x), (jnp.array(40), jnp.asarray(7.0, dtype))

        return custom_root(
            lambda y: y**2 - a, jnp.asarray(1.0, dtype), solve, scalar_solve, has_aux=True
        )

    rtol = tol(dtype, 1e-5, 1e-12)
    a = jnp.asarray([4.0, 9.0, 2.0], dtype)
    roots, (count, seven) = jax.jit(jax.vmap(sqrt_with_count))(a)
    np.testing.assert_allclose(roots, np.sqrt(np.asarray(a, np.float64)), rtol=rtol)
    np.testing.assert_array_equal(count, [40, 40, 40])
    np.testing.assert_array_equal(seven, [7.0, 7.0, 7.0])
    np.testing.assert_allclose(
        jax.jit(jax.vmap(jax.grad(lambda a: sqrt_with_count(a)[0])))(a),
        0.5 / np.sqrt(np.asarray(a, np.float64)),
        rtol=rtol,
    )
    # jvp: integer aux gets a float0 tangent, float aux a zero tangent
    (_, (n, s)), (dr, (dn, ds)) = jax.jvp(sqrt_with_count, (a[0],), (jnp.asarray(1.0, dtype),))
    np.testing.assert_allclose(dr, 0.25, rtol=rtol)
    assert dn.dtype == jax.dtypes.float0
    assert ds == 0


def test_has_aux_errors():
    with pytest.raises(TypeError, match=re.escape("has_aux=True")):
        custom_root(lambda y: y - 1.0, 0.0, lambda f, x: x, scalar_solve, has_aux=True)
    with pytest.raises(TypeError, match="pair"):
        custom_root(lambda y: y - 1.0, 0.0, lambda f, x: (x, x, x), scalar_solve, has_aux=True)
    # the root part of (root, aux) is still checked against initial_guess
    with pytest.raises(TypeError, match="structure"):
        custom_root(
            lambda y: y - 1.0, 0.0, lambda f, x: ((x, x), jnp.ones(2)), scalar_solve, has_aux=True
        )


# ---------------------------------------------------------------------------
# Pytree structure / shape errors.


def test_errors_f_mismatch():
    # jax: "f() output pytree"
    with pytest.raises(TypeError, match=r"f\(initial_guess\).*structure"):
        custom_root(lambda x: (x, x), 0.0, lambda f, x: x, lambda f, x: x)
    with pytest.raises(TypeError, match=r"f\(initial_guess\).*shape") as e:
        custom_root(lambda y: jnp.zeros(3), jnp.zeros(2), lambda f, x: x, scalar_solve)
    assert "float32[3]" in str(e.value) and "float32[2]" in str(e.value)
    with pytest.raises(TypeError, match=r"f\(initial_guess\).*dtype") as e:
        custom_root(lambda y: y.astype(jnp.int32), jnp.zeros(2), lambda f, x: x, scalar_solve)
    assert "int32[2]" in str(e.value)
    with pytest.raises(TypeError, match=r"f\(initial_guess\)") as e:
        custom_root(lambda t: {"b": t["a"]}, {"a": jnp.zeros(2)}, lambda f, x: x, scalar_solve)
    assert "'b'" in str(e.value) and "'a'" in str(e.value)


def test_errors_solve_mismatch():
    with pytest.raises(TypeError, match=r"solve\(f, initial_guess\).*structure"):
        custom_root(lambda x: x, 0.0, lambda f, x: (x, x), lambda f, x: x)
    with pytest.raises(TypeError, match=r"solve\(f, initial_guess\).*shape"):
        custom_root(lambda y: y, jnp.zeros(2), lambda f, x: jnp.zeros(3), scalar_solve)
    with pytest.raises(TypeError, match=r"solve\(f, initial_guess\)"):
        custom_root(lambda y: y, {"a": jnp.zeros(2)}, lambda f, x: {"b": x["a"]}, scalar_solve)
    with pytest.raises(TypeError, match="`solve` must be callable"):
        custom_root(lambda y: y, jnp.zeros(2), 3, scalar_solve)


def test_errors_tangent_solve_mismatch():
    def dummy_root_usage(x):
        f = lambda y: x - y
        return custom_root(f, 0.0, lambda f, x: x, lambda f, x: (x, x))

    # jax raises only under differentiation; we check eagerly too
    with pytest.raises(TypeError, match=r"tangent_solve\(g, y\).*structure"):
        jax.jvp(dummy_root_usage, (0.0,), (0.0,))
    with pytest.raises(TypeError, match=r"tangent_solve\(g, y\).*structure"):
        dummy_root_usage(0.0)
    with pytest.raises(TypeError, match=r"tangent_solve\(g, y\).*shape") as e:
        custom_root(lambda y: 1.0 - y, jnp.zeros(2), lambda f, x: x, lambda g, y: jnp.zeros(3))
    assert "float32[3]" in str(e.value)
    with pytest.raises(TypeError, match="`tangent_solve` must be callable"):
        custom_root(lambda y: y, jnp.zeros(2), lambda f, x: x, None)


# ---------------------------------------------------------------------------
# What gets a derivative: f's closures (implicitly), not the guess, not solve's closures.


def test_initial_guess_gets_zero_gradient(dtype):
    def sqrt(a, x0):
        # Newton from x0: the solver's output depends on x0 only through roundoff.
        return custom_root(lambda y: y**2 - a, x0, newton_scalar, scalar_solve)

    a, x0 = jnp.asarray(2.0, dtype), jnp.asarray(1.5, dtype)
    g_a, g_x0 = jax.jit(jax.grad(sqrt, (0, 1)))(a, x0)
    np.testing.assert_allclose(g_a, 0.5 / np.sqrt(2.0), rtol=tol(dtype, 1e-5, 1e-12))
    assert g_x0 == 0 and g_x0.dtype == dtype
    assert jax.jit(jax.jacfwd(sqrt, 1))(a, x0) == 0
    _, t = jax.jvp(lambda x0: sqrt(a, x0), (x0,), (jnp.asarray(1.0, dtype),))
    assert t == 0
    # also when the solver *uses* x0 in a differentiable way (x0 - x0 + sqrt(a))
    leaky = lambda a, x0: custom_root(
        lambda y: y**2 - a, x0, lambda f, x: x - x + jnp.sqrt(a), scalar_solve
    )
    assert jax.grad(leaky, 1)(a, x0) == 0
    # vmapped over x0
    np.testing.assert_array_equal(
        jax.jit(jax.vmap(jax.grad(sqrt, 1), (None, 0)))(a, jnp.asarray([0.5, 1.0, 3.0], dtype)), 0.0
    )


def test_closure_conversion_derivative_is_implicit(dtype):
    """f closes over the differentiated value; the derivative is d/da sqrt(a) = 1/(2 sqrt a)."""
    rtol = tol(dtype, 1e-5, 1e-12)
    one = jnp.asarray(1.0, dtype)

    def sqrt(a):
        return custom_root(lambda y: y**2 - a, one, newton_scalar, scalar_solve)

    a = jnp.asarray(2.0, dtype)
    np.testing.assert_allclose(jax.grad(sqrt)(a), 0.5 / np.sqrt(2.0), rtol=rtol)

    # The solver's own closures get no derivative: a solver that returns the
    # right number through stop_gradient still gives the implicit derivative...
    stopped = lambda a: custom_root(
        lambda y: y**2 - a, one, lambda f, x: jnp.sqrt(lax.stop_gradient(a)), scalar_solve
    )
    np.testing.assert_allclose(jax.grad(stopped)(a), 0.5 / np.sqrt(2.0), rtol=rtol)
    # ...and one that closes over `b` (used only by the solver) gives zero derivative w.r.t. `b`.
    solver_only = lambda a, b: custom_root(
        lambda y: y**2 - a, one, lambda f, x: jnp.sqrt(a) + 0 * b, scalar_solve
    )
    g_a, g_b = jax.grad(solver_only, (0, 1))(a, jnp.asarray(3.0, dtype))
    np.testing.assert_allclose(g_a, 0.5 / np.sqrt(2.0), rtol=rtol)
    assert g_b == 0

    # f closes over an intermediate value computed from the argument (chain rule).
    def sqrt_of_sin(t):
        s = jnp.sin(t) + 2.0
        return custom_root(lambda y: y**2 - s, one, newton_scalar, scalar_solve)

    t = jnp.asarray(0.3, dtype)
    np.testing.assert_allclose(
        jax.jit(jax.grad(sqrt_of_sin))(t),
        np.cos(0.3) / (2 * np.sqrt(np.sin(0.3) + 2.0)),
        rtol=rtol,
    )
    # f closes over two values; both derivatives, and cross second derivatives
    # root of y**2 - a*b:  y = sqrt(ab), d2y/dadb = 1 / (4 sqrt(ab))
    two = lambda a, b: custom_root(lambda y: y**2 - a * b, one, newton_scalar, scalar_solve)
    b = jnp.asarray(8.0, dtype)
    g = jax.jit(jax.grad(two, (0, 1)))(a, b)
    np.testing.assert_allclose(g, [0.5 * np.sqrt(8 / 2.0), 0.5 * np.sqrt(2.0 / 8)], rtol=rtol)
    h = jax.jit(jax.hessian(two, (0, 1)))(a, b)
    np.testing.assert_allclose(h[0][1], 1 / (4 * 4.0), rtol=tol(dtype, 1e-4, 1e-12))


def test_closure_over_integer_values_under_jit_and_vmap():
    """Integer tracers closed over by f (an exponent, an index) are hoisted, not leaked."""

    def nth_root(n, a):  # root of y**n - a: y = a**(1/n)
        return custom_root(lambda y: y**n - a, 1.5, newton_scalar, scalar_solve)

    def pick(i, v):  # root of y - v[i]
        return custom_root(lambda y: y - v[i], 0.0, lambda f, x: x - f(x), scalar_solve)

    ns, a = jnp.array([2, 3]), jnp.array([4.0, 8.0])
    v, idx = jnp.array([1.0, 2.0, 3.0]), jnp.array([0, 2])
    # d/da a**(1/n) = a**(1/n - 1) / n
    d_nth = np.array([4.0 ** (-0.5) / 2, 8.0 ** (-2 / 3) / 3])

    def compute(ns, a, n, v, idx, i):
        return {
            "nth_root": (nth_root(n, a[1]), 2.0),
            "vmap_nth_root": (jax.vmap(nth_root)(ns, a), jnp.array([2.0, 2.0])),
            "vmap_grad": (jax.vmap(jax.grad(nth_root, 1))(ns, a), d_nth),
            "grad": (jax.grad(nth_root, 1)(n, a[1]), d_nth[1]),
            "jacfwd": (jax.jacfwd(nth_root, 1)(n, a[1]), d_nth[1]),
            "vmap_pick": (jax.vmap(pick, (0, None))(idx, v), jnp.array([1.0, 3.0])),
            "vmap_grad_pick": (
                jax.vmap(jax.grad(pick, 1), (0, None))(idx, v),
                jnp.array([[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]]),
            ),
            "grad_pick": (jax.grad(pick, 1)(i, v), jnp.array([0.0, 0.0, 1.0])),
            "grad_vmap_pick": (
                jax.grad(lambda v: jax.vmap(pick, (0, None))(idx, v).sum())(v),
                jnp.array([1.0, 0.0, 1.0]),
            ),
        }

    with jax.checking_leaks():
        out = jax.jit(compute)(ns, a, 3, v, idx, 2)
        for name, (got, want) in out.items():
            np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=name)
        # without jit: vmap alone batches the integer closure
        np.testing.assert_allclose(jax.vmap(jax.grad(nth_root, 1))(ns, a), d_nth, rtol=1e-5)
        np.testing.assert_allclose(jax.vmap(pick, (0, None))(idx, v), [1.0, 3.0])


def test_zero_and_unused_cotangents(x64):
    def sqrt(a):
        return custom_root(lambda y: y**2 - a, 1.0, newton_scalar, scalar_solve)

    assert jax.grad(lambda a: 0.0 * sqrt(a) + a)(2.0) == 1.0
    assert jax.vjp(sqrt, 2.0)[1](0.0) == (0.0,)
    # the root of an f that does not depend on `a` has zero derivative w.r.t. `a`
    np.testing.assert_allclose(jax.grad(lambda a: sqrt(2.0) * a)(3.0), np.sqrt(2.0), rtol=1e-12)
    assert (
        jax.grad(
            lambda a: custom_root(lambda y: y - 2.0, 0.0, lambda f, x: 2.0 + 0 * a, scalar_solve)
        )(3.0)
        == 0
    )


def test_nested_custom_root(x64):
    """y**3 = sqrt(a), the sqrt itself a custom_root inside f: y = a**(1/6)."""

    def sqrt(a):
        return custom_root(lambda y: y**2 - a, 1.0, newton_scalar, scalar_solve)

    def sixth_root(a):
        return custom_root(lambda y: y**3 - sqrt(a), 1.0, newton_scalar, scalar_solve)

    a = 3.0
    np.testing.assert_allclose(jax.jit(sixth_root)(a), a ** (1 / 6), rtol=1e-12)
    np.testing.assert_allclose(jax.jit(jax.grad(sixth_root))(a), a ** (-5 / 6) / 6, rtol=1e-12)
    np.testing.assert_allclose(
        jax.jit(jax.hessian(sixth_root))(a), -5 / 36 * a ** (-11 / 6), rtol=1e-10
    )
    np.testing.assert_allclose(
        jax.jit(jax.vmap(jax.grad(sixth_root)))(jnp.array([a, 2 * a])),
        [a ** (-5 / 6) / 6, (2 * a) ** (-5 / 6) / 6],
        rtol=1e-12,
    )


# ---------------------------------------------------------------------------
# Pytree roots.


def _tree_root(p):
    """u = p v, v**3 = p: v = p**(1/3), u = p**(4/3)."""
    f = lambda t: {"u": t["u"] - p * t["v"], "v": t["v"] ** 3 - p}

    def solve(f, t):
        v = jnp.cbrt(p)
        return {"u": p * v, "v": v}

    return custom_root(f, {"u": 0.0, "v": 1.0}, solve, tree_tangent_solve)


def test_pytree_root(x64):
    p = 8.0
    d = {"u": 4 / 3 * p ** (1 / 3), "v": p ** (-2 / 3) / 3}

    def compute(p):
        return {
            "value": (_tree_root(p), {"u": 16.0, "v": 2.0}),
            "jacfwd": (jax.jacfwd(_tree_root)(p), d),
            "jacrev": (jax.jacrev(_tree_root)(p), d),
            # a cotangent on every leaf
            "grad_sum": (jax.grad(lambda p: sum(_tree_root(p).values()))(p), d["u"] + d["v"]),
            "vjp": (jax.vjp(_tree_root, p)[1]({"u": 1.0, "v": 0.0}), (d["u"],)),
        }

    for name, (got, want) in jax.jit(compute)(p).items():
        assert_trees_close(got, want, rtol=1e-12, err_msg=name)


# Regression test (was a bug): custom_root's vjp rule does not instantiate symbolic-Zero
# cotangents of some leaves of a pytree root (tree_map skips Zero nodes): TypeError 'cotangent
# tree does not match function output'
def test_pytree_root_grad_of_one_leaf(x64):
    p = 8.0
    # only one leaf of the output gets a cotangent; the other's is a symbolic zero
    np.testing.assert_allclose(jax.grad(lambda p: _tree_root(p)["u"])(p), 4 / 3 * 2.0, rtol=1e-12)
    out = jax.jit(
        lambda p: (
            jax.grad(lambda p: _tree_root(p)["v"])(p),
            jax.jacrev(lambda p: _tree_root(p)["u"])(p),
            jax.hessian(lambda p: _tree_root(p)["u"])(p),
        )
    )(p)
    # v = p**(1/3), u = p**(4/3), u'' = 4/9 p**(-2/3)
    np.testing.assert_allclose(out, [p ** (-2 / 3) / 3, 4 / 3 * 2.0, 4 / 9 / 4.0], rtol=1e-12)


def test_host_callback_solver(x64):
    """The solver need not be differentiable or even JAX: here a NumPy call on the host."""

    def host_sqrt(a):
        return jax.pure_callback(
            lambda a: np.sqrt(np.asarray(a)),
            jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)),
            a,
            vmap_method="sequential",
        )

    def sqrt(a):
        return custom_root(
            lambda y: y**2 - a, jnp.ones_like(a), lambda f, x: host_sqrt(a), scalar_solve
        )

    a = jnp.array([2.0, 9.0])
    np.testing.assert_allclose(jax.jit(jax.vmap(sqrt))(a), np.sqrt(a), rtol=1e-12)
    np.testing.assert_allclose(jax.jit(jax.vmap(jax.grad(sqrt)))(a), 0.5 / np.sqrt(a), rtol=1e-12)
    np.testing.assert_allclose(jax.hessian(sqrt)(2.0), -0.25 * 2.0**-1.5, rtol=1e-12)


def test_complex_unknowns_with_a_linear_solve_solver(x64):
    """A `linear_solve` solver builds the Jacobian from products with real unit vectors,
    which for complex unknowns is the Jacobian only where `f` is holomorphic: complex
    unknowns with one are refused (before, `x + 0.3 conj(x) = a c` got a wrong
    gradient from `Dense`). As real and imaginary parts, the root and its derivative
    are the closed forms `Re x = a Re c / 1.3`, `Im x = a Im c / 0.7`."""
    from implicitdiff import linear_solve

    c = jnp.array([1.0 + 2.0j, -0.5 + 0.3j])

    def complex_root(a):
        f = lambda x: x + 0.3 * jnp.conj(x) - a * c  # noqa: E731
        solve = lambda f, x: x - jnp.real(f(x)) / 1.3 - 1j * jnp.imag(f(x)) / 0.7  # noqa: E731
        # (exact in one step: the equations are linear in the real and imaginary parts)
        return custom_root(f, jnp.zeros(2, complex), solve, linear_solve.Dense())

    with pytest.raises(TypeError, match=r"custom_root: `initial_guess` leaf 0 .* real unknowns"):
        complex_root(0.8)

    # `implicit_diff` refuses them in its own terms.
    from implicitdiff import implicit_diff

    @implicit_diff(lambda x, a: x + 0.3 * jnp.conj(x) - a * c)
    def solver(init, a):
        return a * (jnp.real(c) / 1.3 + 1j * jnp.imag(c) / 0.7)

    with pytest.raises(TypeError, match="implicit_diff: `init` leaf 0 .* `solve` is a linear"):
        solver(jnp.zeros(2, complex), 0.8)

    def parts_root(a):
        def f(x):
            u, v = x
            return u * 1.3 - a * jnp.real(c), v * 0.7 - a * jnp.imag(c)

        def solve(f, x):
            u, v = x
            ru, rv = f(x)
            return u - ru / 1.3, v - rv / 0.7

        zero = jnp.zeros(2)
        return custom_root(f, (zero, zero), solve, linear_solve.Dense())

    u, v = parts_root(0.8)
    np.testing.assert_allclose(u + 1j * v, 0.8 * (jnp.real(c) / 1.3 + 1j * jnp.imag(c) / 0.7))
    du, dv = jax.jacfwd(parts_root)(0.8)
    np.testing.assert_allclose(du + 1j * dv, jnp.real(c) / 1.3 + 1j * jnp.imag(c) / 0.7)
    gu = jax.grad(lambda a: jnp.sum(parts_root(a)[0] + 2 * parts_root(a)[1]))(0.8)
    np.testing.assert_allclose(gu, jnp.sum(jnp.real(c) / 1.3 + 2 * jnp.imag(c) / 0.7))
