"""Tests for `implicitdiff.implicit_diff`: solvers differentiated via their optimality condition.

The running example is ridge regression, whose solution has a closed form

    w(lam) = solve(X^T X + lam n I, X^T y),

solved here by iterative methods (gradient descent, conjugate gradient) whose
iterations are never differentiated. Derivatives are checked against autodiff
of the closed form and against central finite differences (float64).
"""

import functools
import inspect
import re

import jax
import jax.numpy as jnp
import jax.scipy.sparse.linalg as jsp_sparse
import numpy as np
import pytest
from jax import lax

from implicitdiff import custom_linear_solve, implicit_diff

_RNG = np.random.RandomState(0)
N, D = 20, 4
_X = _RNG.randn(N, D)
_Y = _RNG.randn(N)
LAM = 0.3


def ridge_optimality(w, X, y, lam):
    """Gradient of 0.5/n ||X w - y||^2 + 0.5 lam ||w||^2."""
    return X.T @ (X @ w - y) / X.shape[0] + lam * w


def closed_form(X, y, lam):
    n, d = X.shape
    return jnp.linalg.solve(X.T @ X + lam * n * jnp.eye(d, dtype=X.dtype), X.T @ y)


def dense_sym_solve(matvec, b):
    """A custom_linear_solve-wrapped dense solver (materialises the Hessian)."""
    return custom_linear_solve(
        matvec, b, lambda m, r: jnp.linalg.solve(jax.jacfwd(m)(r), r), symmetric=True
    )


def gradient_descent(init, X, y, lam, steps=500):
    """Plain gradient descent with step 1/L; lax.fori_loop, so never differentiated."""
    hess = X.T @ X / X.shape[0] + lam * jnp.eye(X.shape[1], dtype=X.dtype)
    step = 1.0 / jnp.linalg.eigvalsh(hess)[-1]
    return lax.fori_loop(0, steps, lambda i, w: w - step * ridge_optimality(w, X, y, lam), init)


def conjugate_gradient(init, X, y, lam):
    """CG on the normal equations, from jax.scipy (a while_loop: not reverse-differentiable)."""
    matvec = lambda w: X.T @ (X @ w) / X.shape[0] + lam * w
    w, _ = jsp_sparse.cg(matvec, X.T @ y / X.shape[0], x0=init, tol=1e-14, maxiter=100)
    return w


pytestmark = pytest.mark.usefixtures("fast_compiles")


def make_ridge(inner=gradient_descent, solve=dense_sym_solve):
    @implicit_diff(ridge_optimality, solve=solve)
    def ridge(init, X, y, lam):
        """Ridge regression by an iterative solver."""
        return inner(init, X, y, lam)

    return ridge


def assert_trees_close(got, want, **kw):
    assert jax.tree.structure(got) == jax.tree.structure(want), (got, want)
    jax.tree.map(
        lambda g, w: np.testing.assert_allclose(np.asarray(g), np.asarray(w), **kw), got, want
    )


def check_pairs(out, **kw):
    for name, (got, want) in out.items():
        shapes = lambda t: jax.tree.map(lambda x: (np.shape(x), np.asarray(x).dtype), t)
        assert shapes(got) == shapes(want), name
        assert_trees_close(got, want, err_msg=name, **kw)


def central_difference(fn, x, eps=1e-5):
    """Central finite difference of a scalar-argument function, in float64 NumPy."""
    return (np.asarray(fn(x + eps)) - np.asarray(fn(x - eps))) / (2 * eps)


# ---------------------------------------------------------------------------
# Derivatives against the closed form and finite differences.


def test_ridge_derivatives(x64):
    """Gradient descent inner solver: every derivative vs the closed form and finite differences."""
    ridge = make_ridge(gradient_descent)
    w0 = np.zeros(D)

    def compute(w0, X, y, lam):
        by_lam = lambda lam: ridge(w0, X, y, lam)
        closed_lam = lambda lam: closed_form(X, y, lam)
        return {
            "value": (ridge(w0, X, y, lam), closed_form(X, y, lam)),
            "jacrev_lam": (jax.jacrev(by_lam)(lam), jax.jacrev(closed_lam)(lam)),
            "jacfwd_lam": (jax.jacfwd(by_lam)(lam), jax.jacfwd(closed_lam)(lam)),
            "hessian_lam": (jax.hessian(by_lam)(lam), jax.hessian(closed_lam)(lam)),
            "jacrev_X": (
                jax.jacrev(ridge, 1)(w0, X, y, lam),
                jax.jacrev(closed_form, 0)(X, y, lam),
            ),
            "jacfwd_X": (
                jax.jacfwd(ridge, 1)(w0, X, y, lam),
                jax.jacfwd(closed_form, 0)(X, y, lam),
            ),
            "jacrev_y": (
                jax.jacrev(ridge, 2)(w0, X, y, lam),
                jax.jacrev(closed_form, 1)(X, y, lam),
            ),
            "jacfwd_y": (
                jax.jacfwd(ridge, 2)(w0, X, y, lam),
                jax.jacfwd(closed_form, 1)(X, y, lam),
            ),
            "grad_loss_all": (
                jax.grad(lambda X, y, lam: jnp.sum(ridge(w0, X, y, lam) ** 2), (0, 1, 2))(
                    X, y, lam
                ),
                jax.grad(lambda X, y, lam: jnp.sum(closed_form(X, y, lam) ** 2), (0, 1, 2))(
                    X, y, lam
                ),
            ),
            "fwd_equals_rev": (
                jax.jacfwd(ridge, (1, 2, 3))(w0, X, y, lam),
                jax.jacrev(ridge, (1, 2, 3))(w0, X, y, lam),
            ),
        }

    run = jax.jit(compute)
    out = run(w0, _X, _Y, LAM)
    np.testing.assert_allclose(
        out["value"][0], np.linalg.solve(_X.T @ _X + LAM * N * np.eye(D), _X.T @ _Y), rtol=1e-12
    )
    check_pairs(out, rtol=1e-9, atol=1e-12)

    # central finite differences, of the closed form and of the solver itself
    fd_closed = central_difference(lambda lam: closed_form(_X, _Y, lam), LAM)
    fd_ridge = central_difference(jax.jit(lambda lam: ridge(w0, _X, _Y, lam)), LAM)
    np.testing.assert_allclose(out["jacrev_lam"][0], fd_closed, rtol=1e-7, atol=1e-10)
    np.testing.assert_allclose(out["jacfwd_lam"][0], fd_ridge, rtol=1e-7, atol=1e-10)
    fd_second = central_difference(jax.jit(jax.jacrev(lambda lam: ridge(w0, _X, _Y, lam))), LAM)
    np.testing.assert_allclose(out["hessian_lam"][0], fd_second, rtol=1e-6, atol=1e-9)


def test_ridge_cg_inner_solver(x64):
    """CG (a while_loop, not reverse-differentiable) as the inner solver."""
    ridge = make_ridge(conjugate_gradient)
    w0 = np.zeros(D)
    out = jax.jit(
        lambda X, y, lam: {
            "value": (ridge(w0, X, y, lam), closed_form(X, y, lam)),
            "jacrev_lam": (
                jax.jacrev(ridge, 3)(w0, X, y, lam),
                jax.jacrev(closed_form, 2)(X, y, lam),
            ),
            "jacfwd_y": (
                jax.jacfwd(ridge, 2)(w0, X, y, lam),
                jax.jacfwd(closed_form, 1)(X, y, lam),
            ),
            "hessian_lam": (
                jax.hessian(lambda lam: ridge(w0, X, y, lam).sum())(lam),
                jax.hessian(lambda lam: closed_form(X, y, lam).sum())(lam),
            ),
        }
    )(_X, _Y, LAM)
    check_pairs(out, rtol=1e-9, atol=1e-12)
    fd = central_difference(lambda lam: closed_form(_X, _Y, lam), LAM)
    np.testing.assert_allclose(out["jacrev_lam"][0], fd, rtol=1e-7, atol=1e-10)


def test_ridge_float32():
    """The key case in float32: value and derivatives w.r.t. lam and X."""
    ridge = make_ridge()
    X, y = _X.astype(np.float32), _Y.astype(np.float32)
    w0 = np.zeros(D, np.float32)
    lam = np.float32(LAM)
    out = jax.jit(
        lambda w0, X, y, lam: {
            "value": (ridge(w0, X, y, lam), closed_form(X, y, lam)),
            "jacrev_lam": (
                jax.jacrev(ridge, 3)(w0, X, y, lam),
                jax.jacrev(closed_form, 2)(X, y, lam),
            ),
            "jacfwd_lam": (
                jax.jacfwd(ridge, 3)(w0, X, y, lam),
                jax.jacfwd(closed_form, 2)(X, y, lam),
            ),
            "grad_X": (
                jax.grad(lambda X: ridge(w0, X, y, lam).sum())(X),
                jax.grad(lambda X: closed_form(X, y, lam).sum())(X),
            ),
        }
    )(w0, X, y, lam)
    check_pairs(out, rtol=2e-4, atol=1e-5)
    # eagerly as well
    np.testing.assert_allclose(ridge(w0, X, y, lam), out["value"][1], rtol=1e-4, atol=1e-6)


def test_keyword_arguments_in_any_order(x64):
    ridge = make_ridge()
    w0 = np.zeros(D)
    expected = closed_form(_X, _Y, LAM)
    d_expected = jax.jacrev(closed_form, 2)(_X, _Y, LAM)
    dx_expected = jax.grad(lambda X: closed_form(X, _Y, LAM).sum())(_X)
    calls = {
        "positional": lambda X, y, lam: ridge(w0, X, y, lam),
        "lam_kw": lambda X, y, lam: ridge(w0, X, y, lam=lam),
        "y_lam_kw": lambda X, y, lam: ridge(w0, X, y=y, lam=lam),
        "all_kw_shuffled": lambda X, y, lam: ridge(w0, y=y, lam=lam, X=X),
        "all_kw_reversed": lambda X, y, lam: ridge(w0, lam=lam, y=y, X=X),
        "init_kw": lambda X, y, lam: ridge(init=w0, lam=lam, X=X, y=y),
    }

    def compute(X, y, lam):
        out = {name: (call(X, y, lam), expected) for name, call in calls.items()}
        for name in ("all_kw_shuffled",):
            call = calls[name]
            out[name + "_derivatives"] = (
                (
                    jax.jacrev(call, 2)(X, y, lam),
                    jax.grad(lambda X, call=call: call(X, y, lam).sum())(X),
                ),
                (d_expected, dx_expected),
            )
        return out

    check_pairs(jax.jit(compute)(_X, _Y, LAM), rtol=1e-9, atol=1e-12)
    # eager keyword call
    np.testing.assert_allclose(ridge(w0, y=_Y, lam=LAM, X=_X), expected, rtol=1e-9)


def test_keyword_only_and_defaulted_parameters(x64):
    """optimality_fun with keyword-only parameters and defaults (a static flag)."""

    def optimality(w, X, *, y, lam, scale=1.0):
        return scale * ridge_optimality(w, X, y, lam)

    @implicit_diff(optimality, solve=dense_sym_solve)
    def ridge(init, X, *, y, lam, scale=1.0):
        return gradient_descent(init, X, y, lam)

    w0 = np.zeros(D)
    d_expected = jax.jacrev(closed_form, 2)(_X, _Y, LAM)
    out = jax.jit(
        lambda X, y, lam: {
            "default": (jax.jacrev(lambda lam: ridge(w0, X, y=y, lam=lam))(lam), d_expected),
            "scale": (
                jax.jacrev(lambda lam: ridge(w0, X, lam=lam, y=y, scale=3.0))(lam),
                d_expected,
            ),
        }
    )(_X, _Y, LAM)
    check_pairs(out, rtol=1e-9, atol=1e-12)
    with pytest.raises(TypeError, match="signature of optimality_fun"):
        ridge(w0, _X, _Y, LAM)  # y, lam are keyword-only


def test_static_and_integer_arguments(x64):
    """Non-array arguments pass through; an integer iteration count may be traced (jit, vmap)."""

    def optimality(w, X, y, lam, maxiter, normalize):
        return ridge_optimality(w, X, y, lam)

    @implicit_diff(optimality, solve=dense_sym_solve)
    def ridge(init, X, y, lam, maxiter, normalize):
        assert normalize in (True, False)  # a Python bool, never traced
        return gradient_descent(init, X, y, lam, steps=maxiter)

    w0 = np.zeros(D)
    d_expected = jax.jacrev(closed_form, 2)(_X, _Y, LAM)
    f = lambda lam, maxiter: ridge(w0, _X, _Y, lam, maxiter, normalize=False)
    with jax.checking_leaks():
        out = jax.jit(
            lambda lam, maxiter, maxiters: {
                "traced_int_grad": (jax.jacrev(f)(lam, maxiter), d_expected),
                "vmap_int": (
                    jax.vmap(f, (None, 0))(lam, maxiters),
                    jnp.stack([closed_form(_X, _Y, LAM)] * 2),
                ),
                "vmap_int_jacfwd": (
                    jax.vmap(jax.jacfwd(f), (None, 0))(lam, maxiters),
                    jnp.stack([d_expected] * 2),
                ),
            }
        )(LAM, 500, jnp.array([400, 600]))
    check_pairs(out, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(jax.jacrev(f)(LAM, 500), d_expected, rtol=1e-9)


# ---------------------------------------------------------------------------
# Transformations: jit, vmap, has_aux.


def test_vmap(x64):
    ridge = make_ridge()
    w0 = np.zeros(D)
    lams = np.array([0.1, 0.3, 1.0])
    Xs = np.stack([_X, 2 * _X])
    by_lam = lambda lam: ridge(w0, _X, _Y, lam)
    closed_lam = lambda lam: closed_form(_X, _Y, lam)
    out = jax.jit(
        lambda lams, Xs: {
            "vmap_lam": (jax.vmap(by_lam)(lams), jax.vmap(closed_lam)(lams)),
            "vmap_jacrev": (
                jax.vmap(jax.jacrev(by_lam))(lams),
                jax.vmap(jax.jacrev(closed_lam))(lams),
            ),
            "vmap_jacfwd": (
                jax.vmap(jax.jacfwd(by_lam))(lams),
                jax.vmap(jax.jacfwd(closed_lam))(lams),
            ),
            "vmap_hessian": (
                jax.vmap(jax.hessian(by_lam))(lams),
                jax.vmap(jax.hessian(closed_lam))(lams),
            ),
            "grad_vmap": (
                jax.grad(lambda lams: jax.vmap(by_lam)(lams).sum())(lams),
                jax.grad(lambda lams: jax.vmap(closed_lam)(lams).sum())(lams),
            ),
            "vmap_X": (
                jax.vmap(lambda X: ridge(w0, X, _Y, LAM))(Xs),
                jax.vmap(lambda X: closed_form(X, _Y, LAM))(Xs),
            ),
            "vmap_grad_X": (
                jax.vmap(jax.grad(lambda X: ridge(w0, X, _Y, LAM).sum()))(Xs),
                jax.vmap(jax.grad(lambda X: closed_form(X, _Y, LAM).sum()))(Xs),
            ),
        }
    )(lams, Xs)
    check_pairs(out, rtol=1e-9, atol=1e-12)
    # eager vmap
    np.testing.assert_allclose(jax.vmap(by_lam)(lams), out["vmap_lam"][1], rtol=1e-9)


def test_has_aux(x64):
    @implicit_diff(ridge_optimality, solve=dense_sym_solve, has_aux=True)
    def ridge(init, X, y, lam):
        return gradient_descent(init, X, y, lam), jnp.array(500)

    w0 = np.zeros(D)
    w, n_iters = ridge(w0, _X, _Y, LAM)
    np.testing.assert_allclose(w, closed_form(_X, _Y, LAM), rtol=1e-12)
    assert int(n_iters) == 500 and jnp.issubdtype(n_iters.dtype, jnp.integer)

    d_expected = jax.jacrev(closed_form, 2)(_X, _Y, LAM)
    out = jax.jit(
        lambda X, y, lam, lams: {
            "value": (ridge(w0, X, y, lam)[0], closed_form(X, y, lam)),
            "jacrev_lam": (jax.jacrev(lambda lam: ridge(w0, X, y, lam)[0])(lam), d_expected),
            "jacfwd_lam": (jax.jacfwd(lambda lam: ridge(w0, X, y, lam))(lam)[0], d_expected),
            "jacfwd_aux": (
                jax.jacfwd(lambda lam: ridge(w0, X, y, lam))(lam)[1],
                jnp.zeros((), n_iters.dtype),
            ),
            "vmap": (
                jax.vmap(lambda lam: ridge(w0, X, y, lam))(lams),
                (
                    jax.vmap(lambda lam: closed_form(X, y, lam))(lams),
                    jnp.full(2, 500, n_iters.dtype),
                ),
            ),
        }
    )(_X, _Y, LAM, np.array([0.1, 1.0]))
    check_pairs(out, rtol=1e-9, atol=1e-12)
    # jvp: the integer aux gets a float0 tangent
    (_, aux), (_, daux) = jax.jvp(lambda lam: ridge(w0, _X, _Y, lam), (LAM,), (1.0,))
    assert daux.dtype == jax.dtypes.float0


def test_init_gets_zero_gradient(x64):
    ridge = make_ridge()
    w0 = np.full(D, 0.7)
    out = jax.jit(
        lambda w0: {
            "grad": (jax.grad(lambda w0: ridge(w0, _X, _Y, LAM).sum())(w0), jnp.zeros(D)),
            "jacfwd": (jax.jacfwd(lambda w0: ridge(w0, _X, _Y, LAM))(w0), jnp.zeros((D, D))),
            "vmap_grad": (
                jax.vmap(jax.grad(lambda w0: ridge(w0, _X, _Y, LAM).sum()))(jnp.stack([w0, -w0])),
                jnp.zeros((2, D)),
            ),
        }
    )(w0)
    check_pairs(out, atol=0)
    # the solution does not depend on init either (the solver converged)
    np.testing.assert_allclose(ridge(w0, _X, _Y, LAM), closed_form(_X, _Y, LAM), rtol=1e-12)


def test_decorated_solver_keeps_name_doc_and_signature():
    ridge = make_ridge()
    assert ridge.__name__ == "ridge"
    assert ridge.__doc__ == "Ridge regression by an iterative solver."
    assert list(inspect.signature(ridge).parameters) == ["init", "X", "y", "lam"]


# ---------------------------------------------------------------------------
# Pytree solutions and parameters.


def _ridge_intercept_optimality(params, data, lam):
    w, b = params["w"], params["b"]
    X, y = data["X"], data["y"]
    r = X @ w + b - y
    return {"w": X.T @ r / X.shape[0] + lam * w, "b": jnp.mean(r)}


def _ridge_intercept_closed(data, lam):
    X, y = data["X"], data["y"]
    n, d = X.shape
    Xa = jnp.concatenate([X, jnp.ones((n, 1), X.dtype)], axis=1)
    reg = lam * n * jnp.diag(jnp.concatenate([jnp.ones(d, X.dtype), jnp.zeros(1, X.dtype)]))
    sol = jnp.linalg.solve(Xa.T @ Xa + reg, Xa.T @ y)
    return {"w": sol[:d], "b": sol[d]}


def _tree_dense_solve(matvec, b):
    from jax.flatten_util import ravel_pytree

    flat, unravel = ravel_pytree(b)
    mv = lambda z: ravel_pytree(matvec(unravel(z)))[0]
    # materialise at a fresh zero vector: the solver must not close over `b` itself
    # (see test_custom_linear_solve.py::test_transpose_with_solver_closing_over_b)
    zero = jnp.zeros(flat.shape, flat.dtype)
    return custom_linear_solve(
        matvec,
        b,
        lambda m, r: unravel(jnp.linalg.solve(jax.jacfwd(mv)(zero), ravel_pytree(r)[0])),
        symmetric=True,
    )


@implicit_diff(_ridge_intercept_optimality, solve=_tree_dense_solve)
def _ridge_intercept(init, data, lam):
    """Newton's method (exact for a quadratic: one step from anywhere), on pytrees."""
    from jax.flatten_util import ravel_pytree

    flat, unravel = ravel_pytree(init)
    grad = lambda z: ravel_pytree(_ridge_intercept_optimality(unravel(z), data, lam))[0]
    hess = jax.jacfwd(grad)(flat)
    return unravel(flat - jnp.linalg.solve(hess, grad(flat)))


def test_pytree_solution_and_parameters(x64):
    data = {"X": _X, "y": _Y}
    init = {"w": np.zeros(D), "b": np.zeros(())}
    full_loss = lambda f: lambda data, lam: sum(jnp.sum(v**2) for v in f(data, lam).values())
    ours = lambda data, lam: _ridge_intercept(init, data, lam)
    out = jax.jit(
        lambda data, lam: {
            "value": (ours(data, lam), _ridge_intercept_closed(data, lam)),
            "jacrev": (
                jax.jacrev(ours, (0, 1))(data, lam),
                jax.jacrev(_ridge_intercept_closed, (0, 1))(data, lam),
            ),
            "jacfwd": (
                jax.jacfwd(ours, (0, 1))(data, lam),
                jax.jacfwd(_ridge_intercept_closed, (0, 1))(data, lam),
            ),
            "grad_all_leaves": (
                jax.grad(full_loss(ours), (0, 1))(data, lam),
                jax.grad(full_loss(_ridge_intercept_closed), (0, 1))(data, lam),
            ),
        }
    )(data, LAM)
    check_pairs(out, rtol=1e-9, atol=1e-12)


# Regression test (was a bug): custom_root's vjp rule does not instantiate symbolic-Zero
# cotangents of some leaves of a pytree solution: a loss using only params['w'] fails with
# TypeError 'cotangent tree does not match function output'
def test_pytree_solution_grad_of_one_leaf(x64):
    data = {"X": _X, "y": _Y}
    init = {"w": np.zeros(D), "b": np.zeros(())}
    g, g_ref = jax.jit(
        lambda lam: (
            jax.grad(lambda lam: _ridge_intercept(init, data, lam)["w"].sum())(lam),
            jax.grad(lambda lam: _ridge_intercept_closed(data, lam)["w"].sum())(lam),
        )
    )(LAM)
    np.testing.assert_allclose(g, g_ref, rtol=1e-9)


# ---------------------------------------------------------------------------
# Linear solvers for the implicit system.


_LINEAR_SOLVE_NAMES = ["dense", "cg", "gmres", "bicgstab", "normal_cg", "auto", "default"]


@pytest.mark.parametrize("name", _LINEAR_SOLVE_NAMES)
def test_linear_solve_solvers(name, x64):
    linear_solve = pytest.importorskip("implicitdiff.linear_solve")
    if name == "default":  # solve=None: linear_solve.auto

        @implicit_diff(ridge_optimality)
        def ridge(init, X, y, lam):
            return conjugate_gradient(init, X, y, lam)

    else:
        ridge = make_ridge(conjugate_gradient, solve=getattr(linear_solve, name))

    w0 = np.zeros(D)
    out = jax.jit(
        lambda X, y, lam: {
            "value": (ridge(w0, X, y, lam), closed_form(X, y, lam)),
            "jacrev_lam": (
                jax.jacrev(ridge, 3)(w0, X, y, lam),
                jax.jacrev(closed_form, 2)(X, y, lam),
            ),
            "jacfwd_y": (
                jax.jacfwd(ridge, 2)(w0, X, y, lam),
                jax.jacfwd(closed_form, 1)(X, y, lam),
            ),
        }
    )(_X, _Y, LAM)
    check_pairs(out, rtol=1e-7, atol=1e-10)


# ---------------------------------------------------------------------------
# Errors.


def test_bad_arguments_name_the_signature_mismatch():
    ridge = make_ridge()
    X, y, w0 = _X.astype(np.float32), _Y.astype(np.float32), np.zeros(D, np.float32)
    prefix = re.escape(
        "ridge's arguments after `init` must fit the signature of optimality_fun(w, X, y, lam)"
    )
    cases = {
        "too many positional arguments": lambda: ridge(w0, X, y, 0.1, 3.0),
        "missing a required argument: 'lam'": lambda: ridge(w0, X, y),
        "multiple values for argument 'lam'": lambda: ridge(w0, X, y, 0.1, lam=0.2),
        "unexpected keyword argument 'mu'": lambda: ridge(w0, X, y, lam=0.1, mu=0.1),
    }
    for detail, call in cases.items():
        with pytest.raises(TypeError, match=prefix) as e:
            call()
        assert detail in str(e.value), (detail, str(e.value))
    with pytest.raises(TypeError, match=prefix):
        jax.jit(lambda X: ridge(w0, X, y))(X)


def test_solution_shape_mismatch_with_init():
    """The solver returns a solution shaped differently from `init`."""

    def optimality(x, a):  # elementwise: evaluates fine at any shape
        return x - a

    @implicit_diff(optimality, solve=dense_sym_solve)
    def wrong_shape(init, a):
        return jnp.zeros(3) + a

    with pytest.raises(TypeError, match=r"init must have the structure, shapes and dtypes") as e:
        wrong_shape(jnp.zeros(2), 1.0)
    assert "wrong_shape" in str(e.value)
    assert "float32[2]" in str(e.value) and "float32[3]" in str(e.value)

    # init of the wrong shape or dtype for a correct solver
    ridge = make_ridge()
    X, y = _X.astype(np.float32), _Y.astype(np.float32)
    # (here the solver itself fails on the wrong init; the error says so)
    with pytest.raises(
        TypeError, match=re.escape("calling ridge(init, ...) failed with `init` of type float32[3]")
    ):
        ridge(np.zeros(3, np.float32), X, y, 0.1)
    with pytest.raises(TypeError, match="init") as e:
        ridge(np.zeros(4, np.int32), X, y, 0.1)
    assert "int32[4]" in str(e.value)


def test_solution_shape_mismatch_raises_type_error_for_ridge():
    """Ridge solver returning the wrong shape: a TypeError, whatever its message."""

    @implicit_diff(ridge_optimality, solve=dense_sym_solve)
    def bad(init, X, y, lam):
        return jnp.zeros(D + 1)

    with pytest.raises(TypeError):
        bad(np.zeros(D, np.float32), _X.astype(np.float32), _Y.astype(np.float32), 0.1)


# Regression test (was a bug): implicit_diff evaluates optimality_fun(solution, ...) before
# comparing the solution with init, so a wrong-shaped solution surfaces as optimality_fun's
# own error ('dot_general requires contracting dimensions to have the same shape') rather than
# the 'must have the structure, shapes and dtypes' message naming the solver
def test_solution_shape_mismatch_message_names_the_solver():
    @implicit_diff(ridge_optimality, solve=dense_sym_solve)
    def bad(init, X, y, lam):
        return jnp.zeros(D + 1)

    with pytest.raises(TypeError, match=r"shapes and dtypes of the solution bad returns"):
        bad(np.zeros(D, np.float32), _X.astype(np.float32), _Y.astype(np.float32), 0.1)

    # same with a solution of the wrong pytree structure
    @implicit_diff(lambda x, a: x - a, solve=dense_sym_solve)
    def wrong_structure(init, a):
        return {"x": init + a}

    with pytest.raises(TypeError, match="init must have the structure"):
        wrong_structure(jnp.zeros(2), 1.0)


def test_other_errors():
    def optimality(x, a):
        return x - a

    @implicit_diff(lambda x, a: jnp.zeros(3), solve=dense_sym_solve)
    def bad_residual(init, a):
        return init + a

    with pytest.raises(
        TypeError, match=re.escape("optimality_fun(solution, ...) must have the structure")
    ):
        bad_residual(jnp.zeros(2), 1.0)

    @implicit_diff(optimality, solve=dense_sym_solve, has_aux=True)
    def no_aux(init, a):
        return init + a

    with pytest.raises(
        TypeError, match=re.escape("with has_aux=True, no_aux must return (solution, aux)")
    ):
        no_aux(jnp.zeros(2), 1.0)

    @implicit_diff(optimality, solve=dense_sym_solve)
    def crashes(init, a):
        return init + "a"

    with pytest.raises(TypeError, match=re.escape("calling crashes(init, ...) failed")):
        crashes(jnp.zeros(2), 1.0)

    with pytest.raises(TypeError, match="`optimality_fun` must be callable"):
        implicit_diff(3)
    with pytest.raises(TypeError, match="`solve` must be a linear solver"):
        implicit_diff(optimality, solve=3)


def test_functools_partial_optimality(x64):
    """A functools.partial (and a builtin-free lambda) as optimality_fun."""
    opt = functools.partial(ridge_optimality, lam=LAM)

    @implicit_diff(opt, solve=dense_sym_solve)
    def ridge(init, X, y):
        return gradient_descent(init, X, y, LAM)

    w0 = np.zeros(D)
    out = jax.jit(
        lambda X, y: {
            "value": (ridge(w0, X, y), closed_form(X, y, LAM)),
            "jacrev_y": (jax.jacrev(ridge, 2)(w0, X, y), jax.jacrev(closed_form, 1)(X, y, LAM)),
        }
    )(_X, _Y)
    check_pairs(out, rtol=1e-9, atol=1e-12)
