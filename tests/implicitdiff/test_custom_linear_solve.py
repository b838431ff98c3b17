"""Tests for `implicitdiff.custom_linear_solve`: a linear solve differentiated implicitly.

Modelled on (and a superset of) JAX's own tests for `lax.custom_linear_solve`
(tests/custom_linear_solve_test.py). Every derivative is checked against a real
value: autodiff of `jnp.linalg.solve` (which does not go through our code), closed
forms, or finite differences (`jax.test_util.check_grads`, float64).
"""

from functools import partial

import jax
import jax.numpy as jnp
import jax.scipy as jsp
import numpy as np
import pytest
from jax import lax
from jax.test_util import check_grads

from implicitdiff import custom_linear_solve, custom_root


@pytest.fixture(params=["float32", "float64"])
def dtype(request):
    if request.param == "float64":
        request.getfixturevalue("x64")
    return np.dtype(request.param)


pytestmark = pytest.mark.usefixtures("fast_compiles")


def tol(dtype, f32, f64):
    return f32 if dtype == np.float32 else f64


def assert_trees_close(got, want, **kw):
    assert jax.tree.structure(got) == jax.tree.structure(want), (got, want)
    jax.tree.map(
        lambda g, w: np.testing.assert_allclose(np.asarray(g), np.asarray(w), **kw), got, want
    )


def check_pairs(out, **kw):
    """`out` maps a name to (ours, reference); compare each pair, shapes and dtypes included."""
    for name, (got, want) in out.items():
        shapes = lambda t: jax.tree.map(lambda x: (np.shape(x), np.asarray(x).dtype), t)
        assert shapes(got) == shapes(want), name
        assert_trees_close(got, want, err_msg=name, **kw)


def explicit_jacobian_solve(matvec, b):
    """Materialise the matrix of `matvec` and solve densely (JAX's test solver)."""
    return lax.stop_gradient(jnp.linalg.solve(jax.jacobian(matvec)(b), b))


def spd_solve(a, b):
    """Solve with an SPD matrix through a Cholesky factorisation (symmetric=True)."""
    factors = jsp.linalg.cho_factor(a)
    return custom_linear_solve(
        partial(jnp.dot, a), b, lambda mv, r: jsp.linalg.cho_solve(factors, r), symmetric=True
    )


def lu_solve(a, b, with_transpose=True):
    """Nonsymmetric solve with LU factorisations of A and A^T."""
    a_factors = jsp.linalg.lu_factor(a)
    at_factors = jsp.linalg.lu_factor(a.T)
    solve = lambda mv, r: jsp.linalg.lu_solve(a_factors, r)
    transpose_solve = lambda vm, r: jsp.linalg.lu_solve(at_factors, r)
    return custom_linear_solve(
        partial(jnp.dot, a), b, solve, transpose_solve if with_transpose else None
    )


def posify(m):
    return m @ m.T + jnp.eye(m.shape[0], dtype=m.dtype)


_RNG = np.random.RandomState(0)
_M = _RNG.randn(3, 3)
_B = _RNG.randn(3)
_NS = _RNG.randn(3, 3) + 3 * np.eye(3)  # nonsymmetric, well conditioned
_BS = _RNG.randn(4, 3)


# ---------------------------------------------------------------------------
# SPD system, Cholesky solve, symmetric=True.


def test_spd_cholesky_under_transformations(dtype):
    m, b, bs = _M.astype(dtype), _B.astype(dtype), _BS.astype(dtype)
    ms = np.stack([m, 2 * m, m.T])
    ours = lambda m, b: spd_solve(posify(m), b)
    ref = lambda m, b: jnp.linalg.solve(posify(m), b)
    loss = lambda f: lambda m, b: jnp.sum(jnp.sin(f(m, b)))

    def compute(m, b, bs, ms):
        out = {"value": (ours(m, b), ref(m, b))}
        dm, db = jnp.ones_like(m), jnp.arange(3, dtype=b.dtype)
        out["jvp"] = (jax.jvp(ours, (m, b), (dm, db)), jax.jvp(ref, (m, b), (dm, db)))
        for jac in (jax.jacfwd, jax.jacrev):
            for argnum in (0, 1):  # 0: the matrix closed over by matvec; 1: b
                out[f"{jac.__name__}{argnum}"] = (jac(ours, argnum)(m, b), jac(ref, argnum)(m, b))
        out["grad"] = (jax.grad(loss(ours), (0, 1))(m, b), jax.grad(loss(ref), (0, 1))(m, b))
        out["hessian"] = (
            jax.hessian(loss(ours), (0, 1))(m, b),
            jax.hessian(loss(ref), (0, 1))(m, b),
        )
        out["vmap_b"] = (jax.vmap(ours, (None, 0))(m, bs), jax.vmap(ref, (None, 0))(m, bs))
        out["vmap_b_axis1"] = (
            jax.vmap(ours, (None, 1), 1)(m, bs.T),
            jax.vmap(ref, (None, 1), 1)(m, bs.T),
        )
        out["vmap_matrix"] = (jax.vmap(ours, (0, None))(ms, b), jax.vmap(ref, (0, None))(ms, b))
        out["vmap_both"] = (jax.vmap(ours)(ms, bs[:3]), jax.vmap(ref)(ms, bs[:3]))
        out["grad_vmap"] = (
            jax.grad(lambda ms, bs: jax.vmap(ours)(ms, bs).sum(), (0, 1))(ms, bs[:3]),
            jax.grad(lambda ms, bs: jax.vmap(ref)(ms, bs).sum(), (0, 1))(ms, bs[:3]),
        )
        out["vmap_grad"] = (
            jax.vmap(jax.grad(loss(ours), (0, 1)), (0, None))(ms, b),
            jax.vmap(jax.grad(loss(ref), (0, 1)), (0, None))(ms, b),
        )
        out["vmap_jacfwd"] = (
            jax.vmap(jax.jacfwd(ours, 1), (None, 0))(m, bs),
            jax.vmap(jax.jacfwd(ref, 1), (None, 0))(m, bs),
        )
        y, f_lin = jax.linearize(ours, m, b)
        y_ref, f_lin_ref = jax.linearize(ref, m, b)
        out["linearize"] = ((y, f_lin(dm, db)), (y_ref, f_lin_ref(dm, db)))
        return out

    out = jax.jit(compute)(m, b, bs, ms)
    np.testing.assert_allclose(
        out["value"][0], np.linalg.solve(_M @ _M.T + np.eye(3), _B), atol=tol(dtype, 1e-5, 1e-13)
    )
    check_pairs(out, rtol=tol(dtype, 2e-3, 1e-10), atol=tol(dtype, 2e-4, 1e-12))


def test_spd_cholesky_eager():
    """No jit: value, grad w.r.t. b and the matrix, vmap over b, all op by op."""
    m, b = _M.astype(np.float32), _B.astype(np.float32)
    a = np.asarray(m @ m.T + np.eye(3, dtype=np.float32))
    np.testing.assert_allclose(spd_solve(a, b), np.linalg.solve(a, b), rtol=1e-4)
    g_ours = jax.grad(lambda a, b: spd_solve(a, b).sum(), (0, 1))(a, b)
    g_ref = jax.grad(lambda a, b: jnp.linalg.solve(a, b).sum(), (0, 1))(a, b)
    assert_trees_close(g_ours, g_ref, rtol=1e-4, atol=1e-5)
    bs = _BS.astype(np.float32)
    np.testing.assert_allclose(
        jax.vmap(spd_solve, (None, 0))(a, bs), np.linalg.solve(a, bs.T).T, rtol=1e-4, atol=1e-5
    )


def test_solver_constants_get_no_derivative(x64):
    """Derivatives come from matvec alone: a solver built from stop_gradient'ed
    factors (or closing over unrelated traced values) changes nothing."""
    a = np.asarray(posify(jnp.asarray(_M)))

    def ours(a, b, c):
        factors = jsp.linalg.cho_factor(lax.stop_gradient(a))
        solve = lambda mv, r: jsp.linalg.cho_solve(factors, r) + 0.0 * c
        return custom_linear_solve(lambda x: a @ x, b, solve, symmetric=True)

    g = jax.jit(jax.grad(lambda a, b, c: ours(a, b, c).sum(), (0, 1, 2)))(a, _B, 2.0)
    g_ref = jax.grad(lambda a, b: jnp.linalg.solve(a, b).sum(), (0, 1))(a, _B)
    assert_trees_close(g[:2], g_ref, rtol=1e-10)
    assert g[2] == 0


@pytest.mark.slow
@pytest.mark.parametrize("symmetric", [False, True], ids=["nonsymmetric", "symmetric"])
def test_explicit_jacobian_solve_check_grads(symmetric, x64):
    """JAX's test_custom_linear_solve: finite differences to second order, jit, vmap.

    With symmetric=True the matrix is parametrised as m + m.T so that the finite
    differences stay on symmetric matrices (JAX's test perturbs `a` off them; that case is
    test_second_order_check_grads_unconstrained_matrix).
    """

    def linear_solve(m, b):
        a = m + m.T if symmetric else m
        return custom_linear_solve(
            partial(jnp.dot, a),
            b,
            explicit_jacobian_solve,
            explicit_jacobian_solve,
            symmetric=symmetric,
        )

    rng = np.random.RandomState(1)
    m, b = rng.randn(3, 3), rng.randn(3)
    a = m + m.T if symmetric else m
    check_grads(jax.jit(linear_solve), (m, b), order=2, rtol=3e-5)
    np.testing.assert_allclose(jax.jit(linear_solve)(m, b), np.linalg.solve(a, b), rtol=1e-10)
    c = rng.randn(3, 2)
    np.testing.assert_allclose(
        jax.jit(jax.vmap(linear_solve, (None, 1), 1))(m, c), np.linalg.solve(a, c), rtol=1e-10
    )


def test_symmetric_second_order_off_the_manifold(x64):
    """Second derivatives at a symmetric `a`, in every direction, with symmetric=True.

    As in JAX, the transposed solve is `solve(matvec, .)`: the operator stays `matvec`, so
    the derivative of the gradient is taken through `A`, not `A^T`. Hence the Hessian with
    respect to an unconstrained `a` is lax.custom_linear_solve's (the derivative of the
    gradient as computed, which finite differences confirm in
    test_second_order_check_grads_unconstrained_matrix), and in symmetric directions it is
    that of `jnp.linalg.solve`.
    """
    rng = np.random.RandomState(1)
    a = rng.randn(3, 3)
    a = a + a.T
    b = rng.randn(3)
    sym_dir = rng.randn(3, 3)
    sym_dir = sym_dir + sym_dir.T

    def make(cls):
        return lambda a, b: cls(partial(jnp.dot, a), b, explicit_jacobian_solve, symmetric=True)

    ours, theirs, ref = make(custom_linear_solve), make(lax.custom_linear_solve), jnp.linalg.solve
    loss = lambda f: lambda a, b: jnp.sum(jnp.sin(f(a, b)))

    def symmetric_hvp(f):  # second derivative along a symmetric perturbation of `a`
        grad = jax.grad(loss(f), (0, 1))
        return jax.jvp(grad, (a, b), (sym_dir, jnp.ones(3)))[1]

    out = jax.jit(
        lambda a, b: {
            "hessian": (
                jax.hessian(loss(ours), (0, 1))(a, b),
                jax.hessian(loss(theirs), (0, 1))(a, b),
            ),
            "rev_rev": (
                jax.jacrev(jax.jacrev(loss(ours)))(a, b),
                jax.jacrev(jax.jacrev(loss(theirs)))(a, b),
            ),
            "symmetric_direction": (symmetric_hvp(ours), symmetric_hvp(ref)),
        }
    )(a, b)
    check_pairs(out, rtol=1e-10, atol=1e-13)


def dense_jacobian_solve(matvec, b):
    """The solver of JAX's symmetric test: the matrix of `matvec`, then a dense solve."""
    return jnp.linalg.solve(jax.jacfwd(matvec)(b), b)


@pytest.mark.parametrize("has_aux", [False, True], ids=["plain", "aux"])
@pytest.mark.parametrize("symmetric", [False, True], ids=["nonsymmetric", "symmetric"])
def test_second_order_check_grads_unconstrained_matrix(symmetric, has_aux, x64):
    """JAX's own second-order check: finite differences perturb `a` in every direction.

    `a = r r^T + n I` is symmetric positive definite, but the perturbations that
    check_grads takes are not symmetric; second derivatives (jvp of vjp) must agree with
    finite differences of the function as computed, as lax.custom_linear_solve's do, and
    the values must be lax.custom_linear_solve's.
    """
    rng = np.random.RandomState(7)
    n = 3
    r = rng.randn(n, n)
    a, b = r @ r.T + n * np.eye(n), rng.randn(n)
    direction = rng.randn(n, n)  # a perturbation of `a` that is not symmetric
    aux = {"converged": np.array(1.0), "nfev": np.array(12.0)}

    def solve(mv, rhs):
        x = dense_jacobian_solve(mv, rhs)
        return (x, aux) if has_aux else x

    def make(cls):
        return lambda a, b: cls(
            lambda x: a @ x, b, solve, solve, symmetric=symmetric, has_aux=has_aux
        )

    ours, theirs = make(custom_linear_solve), make(lax.custom_linear_solve)
    check_grads(ours, (a, b), order=2, modes=["fwd", "rev"])

    def derivatives(f):
        x_of = (lambda a, b: f(a, b)[0]) if has_aux else f
        loss = lambda a, b: jnp.sum(jnp.sin(x_of(a, b)))
        grad = jax.grad(loss, (0, 1))
        tangents = (jnp.asarray(direction), jnp.ones(n))
        return {
            "value": f(a, b),
            "grad": grad(a, b),
            "jvp_of_vjp": jax.jvp(grad, (a, b), tangents)[1],
            "hessian": jax.hessian(loss, (0, 1))(a, b),
        }

    got, want = jax.jit(lambda: derivatives(ours))(), jax.jit(lambda: derivatives(theirs))()
    check_pairs({k: (got[k], want[k]) for k in got}, rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------------------
# Nonsymmetric with solve and transpose_solve.


def test_nonsymmetric_lu_under_transformations(x64):
    dtype = np.dtype("float64")
    a, b, bs = _NS.astype(dtype), _B.astype(dtype), _BS.astype(dtype)
    as_ = np.stack([a, a.T, 2 * a])
    ref = jnp.linalg.solve
    loss = lambda f: lambda a, b: jnp.sum(f(a, b) ** 2)

    def compute(a, b, bs, as_):
        out = {"value": (lu_solve(a, b), ref(a, b))}
        for jac in (jax.jacfwd, jax.jacrev):
            for argnum in (0, 1):
                out[f"{jac.__name__}{argnum}"] = (
                    jac(lu_solve, argnum)(a, b),
                    jac(ref, argnum)(a, b),
                )
        out["hessian"] = (
            jax.hessian(loss(lu_solve), (0, 1))(a, b),
            jax.hessian(loss(ref), (0, 1))(a, b),
        )
        out["vjp"] = (jax.vjp(lu_solve, a, b)[1](b), jax.vjp(ref, a, b)[1](b))
        out["grad_vmap_b"] = (
            jax.grad(lambda a, bs: jax.vmap(lu_solve, (None, 0))(a, bs).sum(), (0, 1))(a, bs),
            jax.grad(lambda a, bs: jax.vmap(ref, (None, 0))(a, bs).sum(), (0, 1))(a, bs),
        )
        out["vmap_grad_a"] = (
            jax.vmap(jax.grad(loss(lu_solve)), (0, None))(as_, b),
            jax.vmap(jax.grad(loss(ref)), (0, None))(as_, b),
        )
        return out

    out = jax.jit(compute)(a, b, bs, as_)
    np.testing.assert_allclose(
        out["value"][0], np.linalg.solve(_NS, _B), rtol=tol(dtype, 1e-5, 1e-13)
    )
    check_pairs(out, rtol=tol(dtype, 1e-3, 1e-10), atol=tol(dtype, 1e-5, 1e-13))


@pytest.mark.slow
def test_nonsymmetric_lu_check_grads(x64):
    """JAX's test_custom_linear_solve_lu, with its jit regression (jax#1536)."""
    rng = np.random.RandomState(2)
    a, b = rng.randn(3, 3), rng.randn(3)
    check_grads(jax.jit(lu_solve), (a, b), order=2, rtol=2e-3)


def test_host_solvers(x64):
    """Solvers that JAX cannot differentiate (NumPy on the host) still give every derivative."""

    def host(fn):
        def call(*args):
            return jax.pure_callback(
                lambda *a: np.asarray(fn(*map(np.asarray, a))),
                jax.ShapeDtypeStruct(args[-1].shape, args[-1].dtype),
                *args,
                vmap_method="sequential",
            )

        return call

    def ours(a, b):
        solve = lambda mv, r: host(np.linalg.solve)(a, r)
        transpose_solve = lambda vm, r: host(lambda a, r: np.linalg.solve(a.T, r))(a, r)
        return custom_linear_solve(lambda x: a @ x, b, solve, transpose_solve)

    a, b = _NS, _B

    def compute(a, b):
        return {
            "value": (ours(a, b), jnp.linalg.solve(a, b)),
            "jacrev": (jax.jacrev(ours, (0, 1))(a, b), jax.jacrev(jnp.linalg.solve, (0, 1))(a, b)),
            "jacfwd": (jax.jacfwd(ours, (0, 1))(a, b), jax.jacfwd(jnp.linalg.solve, (0, 1))(a, b)),
            "hessian_b": (
                jax.hessian(lambda b: jnp.sum(ours(a, b) ** 3))(b),
                jax.hessian(lambda b: jnp.sum(jnp.linalg.solve(a, b) ** 3))(b),
            ),
        }

    check_pairs(jax.jit(compute)(a, b), rtol=1e-10, atol=1e-13)


def test_transpose_solve_is_what_reverse_mode_uses(x64):
    """Reverse mode solves with transpose_solve, forward mode with solve; neither is
    differentiated. A transpose_solve scaled by 2 scales the gradient by 2 only."""
    a, b = _NS, _B

    def scaled(a, b):
        solve = lambda mv, r: jnp.linalg.solve(a, r)
        transpose_solve = lambda vm, r: 2.0 * jnp.linalg.solve(a.T, r)
        return custom_linear_solve(lambda x: a @ x, b, solve, transpose_solve)

    g = jax.jit(jax.grad(lambda b: scaled(a, b).sum()))(b)
    g_ref = jax.grad(lambda b: jnp.linalg.solve(a, b).sum())(b)
    np.testing.assert_allclose(g, 2 * g_ref, rtol=1e-12)
    j = jax.jit(jax.jacfwd(scaled, 1))(a, b)
    np.testing.assert_allclose(j, np.linalg.inv(a), rtol=1e-12, atol=1e-14)


# ---------------------------------------------------------------------------
# Missing transpose_solve.


def test_missing_transpose_solve_forward_mode_works(x64):
    dtype = np.dtype("float64")
    a, b = _NS.astype(dtype), _B.astype(dtype)
    ours = lambda a, b: lu_solve(a, b, with_transpose=False)
    ref = jnp.linalg.solve

    def compute(a, b):
        t = (jnp.ones_like(a), jnp.ones_like(b))
        y, f_lin = jax.linearize(ours, a, b)
        y_ref, f_lin_ref = jax.linearize(ref, a, b)
        return {
            "jvp": (jax.jvp(ours, (a, b), t), jax.jvp(ref, (a, b), t)),
            "jacfwd": (jax.jacfwd(ours, (0, 1))(a, b), jax.jacfwd(ref, (0, 1))(a, b)),
            "jacfwd_jacfwd": (
                jax.jacfwd(jax.jacfwd(ours, 1), 0)(a, b),
                jax.jacfwd(jax.jacfwd(ref, 1), 0)(a, b),
            ),
            "vmap_jacfwd": (
                jax.vmap(jax.jacfwd(ours, 0), (0, None))(jnp.stack([a, a.T]), b),
                jax.vmap(jax.jacfwd(ref, 0), (0, None))(jnp.stack([a, a.T]), b),
            ),
            "linearize": ((y, f_lin(*t)), (y_ref, f_lin_ref(*t))),
        }

    check_pairs(jax.jit(compute)(a, b), rtol=tol(dtype, 1e-4, 1e-10), atol=tol(dtype, 1e-5, 1e-13))


@pytest.mark.slow
def test_missing_transpose_solve_check_grads_fwd(x64):
    """JAX's test_custom_linear_solve_without_transpose_solve (forward mode, order 2)."""

    def loss(a, b):
        x = custom_linear_solve(partial(jnp.dot, a), b, explicit_jacobian_solve)
        return jnp.sum(x)

    rng = np.random.RandomState(3)
    a, b = rng.randn(2, 2), rng.randn(2)
    check_grads(jax.jit(loss), (a, b), order=2, modes=["fwd"], atol=1e-11)
    check_grads(jax.jit(jax.vmap(loss)), (a[None], b[None]), order=2, modes=["fwd"], atol=1e-11)


def test_missing_transpose_solve_reverse_mode_raises():
    """A TypeError, as from lax.custom_linear_solve, that says what to pass."""
    a, b = _NS.astype(np.float32), _B.astype(np.float32)

    def make(cls):
        solve = lambda mv, r: jsp.linalg.lu_solve(jsp.linalg.lu_factor(a), r)
        return lambda a, b: cls(partial(jnp.dot, a), b, solve)

    calls = {
        "grad": lambda f: jax.grad(lambda a, b: f(a, b).sum())(a, b),
        "grad_b": lambda f: jax.grad(lambda b: f(a, b).sum())(b),
        "jit_grad_a": lambda f: jax.jit(jax.grad(lambda a: f(a, b).sum()))(a),
        "jacrev": lambda f: jax.jacrev(f, 1)(a, b),
        "vjp": lambda f: jax.vjp(f, a, b)[1](b),
        "linear_transpose": lambda f: jax.linear_transpose(lambda b: f(a, b), b)(b),
    }
    ours = lambda a, b: lu_solve(a, b, with_transpose=False)
    for name, call in calls.items():
        with pytest.raises(TypeError, match="transpose_solve required") as info:
            call(ours)
        message = str(info.value)
        assert "pass `transpose_solve`" in message and "symmetric=True" in message, name
        with pytest.raises(TypeError, match="transpose_solve required"):
            call(make(lax.custom_linear_solve))  # what JAX does on the same call
    # symmetric=True makes solve its own transpose: no transpose_solve needed
    sym = _M @ _M.T + np.eye(3)
    g = jax.grad(
        lambda b: custom_linear_solve(
            lambda x: sym @ x, b, lambda mv, r: jnp.linalg.solve(sym, r), symmetric=True
        ).sum()
    )(_B)
    np.testing.assert_allclose(g, np.linalg.solve(sym, np.ones(3)), rtol=1e-4)


# ---------------------------------------------------------------------------
# Iterative solver, nonlinear parametrisation (JAX's test_custom_linear_solve_iterative).


def richardson_iteration(matvec, b, omega=0.1, tolerance=1e-12):
    def cond(x):
        return jnp.linalg.norm(matvec(x) - b) > tolerance

    def body(x):
        return x + omega * (b - matvec(x))

    return lax.while_loop(cond, body, b)


def _build_and_solve(a, b):
    # intentionally nonlinear in a and b
    matvec = partial(jnp.dot, jnp.exp(a))
    return custom_linear_solve(matvec, jnp.cos(b), richardson_iteration, richardson_iteration)


def test_iterative_solver_nonlinear_parameters(x64):
    rng = np.random.RandomState(0)  # known to converge
    a, b = rng.randn(2, 2), rng.randn(2)
    ref = lambda a, b: jnp.linalg.solve(jnp.exp(a), jnp.cos(b))

    def compute(a, b):
        return {
            "value": (_build_and_solve(a, b), ref(a, b)),
            "jacrev": (jax.jacrev(_build_and_solve, (0, 1))(a, b), jax.jacrev(ref, (0, 1))(a, b)),
            "jacfwd": (jax.jacfwd(_build_and_solve, (0, 1))(a, b), jax.jacfwd(ref, (0, 1))(a, b)),
            "hessian_b": (
                jax.hessian(lambda b: _build_and_solve(a, b).sum())(b),
                jax.hessian(lambda b: ref(a, b).sum())(b),
            ),
            # vmap across an (unusual) size-one axis
            "vmap": (jax.vmap(_build_and_solve)(a[None], b[None]), ref(a, b)[None]),
        }

    check_pairs(jax.jit(compute)(a, b), rtol=1e-8, atol=1e-9)


# ---------------------------------------------------------------------------
# has_aux


def _aux_solve(a, b, aux):
    def solve(mv, r):
        return explicit_jacobian_solve(mv, r), aux

    return custom_linear_solve(partial(jnp.dot, a), b, solve, solve, symmetric=True, has_aux=True)


def test_has_aux(x64):
    """JAX's test_custom_linear_solve_aux, plus aux tangents and gradients through aux."""
    array_aux = {"converged": np.array(1.0), "nfev": np.array(12345)}
    rng = np.random.RandomState(4)
    a = rng.randn(3, 3)
    a = a + a.T
    b = rng.randn(3)
    expected = np.linalg.solve(a, b)

    x, aux = _aux_solve(a, b, array_aux)
    np.testing.assert_allclose(x, expected, rtol=1e-10)
    assert jax.tree.structure(aux) == jax.tree.structure(array_aux)
    jax.tree.map(np.testing.assert_array_equal, aux, array_aux)

    solve_aux = lambda a, b: _aux_solve(a, b, array_aux)
    ref = jnp.linalg.solve
    c = rng.randn(3, 2)

    def compute(a, b, c):
        x_vmap, aux_vmap = jax.vmap(solve_aux, (None, 1), -1)(a, c)
        return {
            "jit": (solve_aux(a, b), (ref(a, b), array_aux)),
            "jacrev": (
                jax.jacrev(lambda a, b: solve_aux(a, b)[0], (0, 1))(a, b),
                jax.jacrev(ref, (0, 1))(a, b),
            ),
            "jacfwd_x": (jax.jacfwd(solve_aux, (0, 1))(a, b)[0], jax.jacfwd(ref, (0, 1))(a, b)),
            "jacfwd_aux": (
                jax.jacfwd(solve_aux, 1)(a, b)[1],
                {"converged": jnp.zeros(3), "nfev": jnp.zeros(3, int)},
            ),
            # a loss using the aux: the aux contributes no derivative
            "grad_through_aux": (
                jax.grad(
                    lambda b: solve_aux(a, b)[0].sum() + 3.0 * solve_aux(a, b)[1]["converged"]
                )(b),
                jax.grad(lambda b: ref(a, b).sum())(b),
            ),
            "vmap": (
                (x_vmap, aux_vmap),
                (ref(a, c), jax.tree.map(partial(np.repeat, repeats=2), array_aux)),
            ),
        }

    check_pairs(jax.jit(compute)(a, b, c), rtol=1e-10, atol=1e-13)


@pytest.mark.slow
def test_has_aux_check_grads(x64):
    rng = np.random.RandomState(4)
    a = rng.randn(3, 3)
    a = a + a.T
    b = rng.randn(3)
    float_aux = {"converged": np.array(1.0), "nfev": np.array(12.0)}
    # symmetric parametrisation: finite differences must stay on symmetric matrices
    check_grads(jax.jit(lambda m, b: _aux_solve(m + m.T, b, float_aux)), (a, b), order=2, rtol=1e-4)


def test_has_aux_batching_with_python_and_bool_aux():
    """JAX's test_custom_linear_solve_batching_with_aux: aux with a bool and a Python int."""
    rng = np.random.RandomState(5)
    a = rng.randn(3, 3).astype(np.float32)
    a = a + a.T + 6 * np.eye(3, dtype=np.float32)
    b = rng.randn(3, 3).astype(np.float32)

    def solve(mv, r):
        return jax.tree.map(lambda t: jnp.linalg.solve(a, t), r), (np.array(1.0), True, 0)

    def solve_aux(x):
        matvec = lambda y: jax.tree.map(partial(jnp.dot, a), y)
        return custom_linear_solve(matvec, (x, x), solve, solve, symmetric=True, has_aux=True)

    (x1, x2), (f, flag, n) = jax.jit(jax.vmap(solve_aux))(b)
    np.testing.assert_allclose(x1, np.linalg.solve(a, b.T).T, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(x2, x1)
    np.testing.assert_array_equal(f, [1.0] * 3)
    np.testing.assert_array_equal(flag, [True] * 3)
    np.testing.assert_array_equal(n, [0] * 3)
    # pytree b + aux (jax#13093): aux passes through untouched
    aux_orig = {"a": 1, "b": 2}
    sol, aux = custom_linear_solve(
        lambda x: x, {"c": jnp.ones(2), "d": jnp.ones(3)}, lambda mv, r: (r, aux_orig), has_aux=True
    )
    assert set(aux) == {"a", "b"}
    np.testing.assert_array_equal(aux["a"], 1)
    np.testing.assert_array_equal(aux["b"], 2)
    np.testing.assert_array_equal(sol["d"], np.ones(3))


def test_has_aux_requires_pair():
    with pytest.raises(TypeError, match=r"has_aux=True.*`solve` must return a pair"):
        custom_linear_solve(lambda x: x, 1.0, lambda mv, r: r, has_aux=True)
    with pytest.raises(TypeError, match="transpose_solve"):
        custom_linear_solve(lambda x: x, 1.0, lambda mv, r: (r, 0.0), lambda vm, r: r, has_aux=True)


# ---------------------------------------------------------------------------
# Pytree right-hand sides.


def _tuple_system(a_blocks):
    """A coupled 2-block system on (u, v) with u in R^2, v in R^3: a 5x5 matrix split in blocks."""
    a = a_blocks

    def matvec(x):
        flat = a @ jnp.concatenate([x[0], x[1]])
        return flat[:2], flat[2:]

    def solve_with(mat):
        def solve(mv, r):
            flat = jnp.linalg.solve(mat, jnp.concatenate([r[0], r[1]]))
            return flat[:2], flat[2:]

        return solve

    return matvec, solve_with(a), solve_with(a.T)


def _tuple_solve(a, b):
    matvec, solve, transpose_solve = _tuple_system(a)
    return custom_linear_solve(matvec, b, solve, transpose_solve)


def _tuple_ref(a, b):
    flat = jnp.linalg.solve(a, jnp.concatenate([b[0], b[1]]))
    return flat[:2], flat[2:]


def _dict_solve(a, c, b):
    """Block-diagonal: {"u": a u, "v": c v}."""
    matvec = lambda x: {"u": a @ x["u"], "v": c @ x["v"]}
    solve = lambda mv, r: {"u": jnp.linalg.solve(a, r["u"]), "v": jnp.linalg.solve(c, r["v"])}
    transpose_solve = lambda vm, r: {
        "u": jnp.linalg.solve(a.T, r["u"]),
        "v": jnp.linalg.solve(c.T, r["v"]),
    }
    return custom_linear_solve(matvec, b, solve, transpose_solve)


def _dict_ref(a, c, b):
    return {"u": jnp.linalg.solve(a, b["u"]), "v": jnp.linalg.solve(c, b["v"])}


def test_pytree_b(x64):
    dtype = np.dtype("float64")
    rng = np.random.RandomState(6)
    a5 = (rng.randn(5, 5) + 4 * np.eye(5)).astype(dtype)
    a2 = (rng.randn(2, 2) + 3 * np.eye(2)).astype(dtype)
    c3 = (rng.randn(3, 3) + 3 * np.eye(3)).astype(dtype)
    bt = (rng.randn(2).astype(dtype), rng.randn(3).astype(dtype))
    bd = {"u": rng.randn(2).astype(dtype), "v": rng.randn(3).astype(dtype)}
    us = rng.randn(4, 2).astype(dtype)
    full = lambda f: lambda *args: sum(jnp.sum(jnp.sin(t)) for t in jax.tree.leaves(f(*args)))

    def compute(a5, a2, c3, bt, bd, us):
        out = {
            "tuple": (_tuple_solve(a5, bt), _tuple_ref(a5, bt)),
            "dict": (_dict_solve(a2, c3, bd), _dict_ref(a2, c3, bd)),
        }
        for jac in (jax.jacfwd, jax.jacrev):
            out[f"tuple_{jac.__name__}"] = (
                jac(_tuple_solve, (0, 1))(a5, bt),
                jac(_tuple_ref, (0, 1))(a5, bt),
            )
            out[f"dict_{jac.__name__}"] = (
                jac(_dict_solve, (0, 1, 2))(a2, c3, bd),
                jac(_dict_ref, (0, 1, 2))(a2, c3, bd),
            )
        out["tuple_grad"] = (
            jax.grad(full(_tuple_solve), (0, 1))(a5, bt),
            jax.grad(full(_tuple_ref), (0, 1))(a5, bt),
        )
        out["dict_hessian_b"] = (
            jax.hessian(full(_dict_solve), 2)(a2, c3, bd),
            jax.hessian(full(_dict_ref), 2)(a2, c3, bd),
        )
        # vmap over one leaf of b only
        in_axes = (None, (0, None))
        out["tuple_vmap_one_leaf"] = (
            jax.vmap(_tuple_solve, in_axes)(a5, (us, bt[1])),
            jax.vmap(_tuple_ref, in_axes)(a5, (us, bt[1])),
        )
        out["grad_vmap_one_leaf"] = (
            jax.grad(
                lambda us: sum(
                    jax.tree.leaves(
                        jax.tree.map(jnp.sum, jax.vmap(_tuple_solve, in_axes)(a5, (us, bt[1])))
                    )
                )
            )(us),
            jax.grad(
                lambda us: sum(
                    jax.tree.leaves(
                        jax.tree.map(jnp.sum, jax.vmap(_tuple_ref, in_axes)(a5, (us, bt[1])))
                    )
                )
            )(us),
        )
        return out

    out = jax.jit(compute)(a5, a2, c3, bt, bd, us)
    check_pairs(out, rtol=tol(dtype, 1e-3, 1e-10), atol=tol(dtype, 1e-5, 1e-13))


@pytest.mark.slow
def test_pytree_b_check_grads(x64):
    rng = np.random.RandomState(7)
    a5 = rng.randn(5, 5) + 4 * np.eye(5)
    bt = (rng.randn(2), rng.randn(3))
    check_grads(jax.jit(_tuple_solve), (a5, bt), order=2, rtol=1e-5)


# Regression test (was a bug): custom_linear_solve's vjp rule does not instantiate symbolic-
# Zero cotangents of some leaves of a pytree solution (tree_map skips Zero nodes): TypeError
# '_LinearSolve was built for arguments of structure ... but was called with ...
# CustomNode(Zero...)'
def test_pytree_b_grad_of_one_leaf():
    rng = np.random.RandomState(6)
    a5 = (rng.randn(5, 5) + 4 * np.eye(5)).astype(np.float32)
    bt = (rng.randn(2).astype(np.float32), rng.randn(3).astype(np.float32))
    matvec, solve, transpose_solve = _tuple_system(a5)
    with_aux = lambda bt: custom_linear_solve(
        matvec,
        bt,
        lambda mv, r: (solve(mv, r), jnp.array(1)),
        lambda vm, r: (transpose_solve(vm, r), jnp.array(1)),
        has_aux=True,
    )[0]

    def compute(a5, bt):
        # only one leaf of the solution gets a cotangent; the other's is a symbolic zero
        out = {}
        for i in (0, 1):
            out[f"grad_leaf{i}"] = (
                jax.grad(lambda bt, i=i: _tuple_solve(a5, bt)[i].sum(), allow_int=True)(bt),
                jax.grad(lambda bt, i=i: _tuple_ref(a5, bt)[i].sum())(bt),
            )
            out[f"grad_a_leaf{i}"] = (
                jax.grad(lambda a5, i=i: _tuple_solve(a5, bt)[i].sum())(a5),
                jax.grad(lambda a5, i=i: _tuple_ref(a5, bt)[i].sum())(a5),
            )
            out[f"jacrev_leaf{i}"] = (
                jax.jacrev(lambda bt, i=i: _tuple_solve(a5, bt)[i])(bt),
                jax.jacrev(lambda bt, i=i: _tuple_ref(a5, bt)[i])(bt),
            )
            out[f"has_aux_grad_leaf{i}"] = (
                jax.grad(lambda bt, i=i: with_aux(bt)[i].sum())(bt),
                jax.grad(lambda bt, i=i: _tuple_ref(a5, bt)[i].sum())(bt),
            )
        return out

    check_pairs(jax.jit(compute)(a5, bt), rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------------------
# Errors.


def test_errors_matvec():
    solve = lambda f, x: x
    with pytest.raises(TypeError, match=r"`matvec`.*structure") as e:
        custom_linear_solve(lambda x: [x], 1.0, solve, solve)
    assert "PyTreeDef([*])" in str(e.value)
    with pytest.raises(TypeError, match=r"`matvec`.*shapes") as e:
        custom_linear_solve(lambda x: jnp.ones(2), jnp.ones(3), solve, solve)
    assert "float32[2]" in str(e.value) and "float32[3]" in str(e.value)
    with pytest.raises(TypeError, match=r"`matvec`.*dtypes") as e:
        custom_linear_solve(lambda x: x.astype(jnp.float16), jnp.ones(3), solve, solve)
    assert "float16[3]" in str(e.value)

    # JAX raises this only under jvp; it is a plain TypeError here, eagerly and under jvp.
    def bad_matvec_usage(a):
        return custom_linear_solve(lambda x: a * jnp.ones(2), 1.0, solve, solve)

    with pytest.raises(TypeError, match="`matvec`"):
        bad_matvec_usage(1.0)
    with pytest.raises(TypeError, match="`matvec`"):
        jax.jvp(bad_matvec_usage, (1.0,), (1.0,))


def test_errors_solvers():
    solve = lambda f, x: x
    with pytest.raises(TypeError, match=r"`solve`.*structure"):
        custom_linear_solve(lambda x: x, 1.0, lambda f, x: [x], solve)
    with pytest.raises(TypeError, match=r"`transpose_solve`.*structure"):
        custom_linear_solve(lambda x: x, 1.0, solve, lambda f, x: [x])
    with pytest.raises(TypeError, match=r"`solve`.*shapes"):
        custom_linear_solve(lambda x: x, 1.0, lambda f, x: jnp.ones(2), solve)
    with pytest.raises(TypeError, match=r"`transpose_solve`.*shapes"):
        custom_linear_solve(lambda x: x, jnp.ones(3), solve, lambda f, x: jnp.ones(2))
    with pytest.raises(TypeError, match="`solve` must be callable"):
        custom_linear_solve(lambda x: x, 1.0, None)
    with pytest.raises(TypeError, match="`transpose_solve` must be callable or None"):
        custom_linear_solve(lambda x: x, 1.0, solve, 3)


def test_errors_b():
    solve = lambda f, x: x
    with pytest.raises(TypeError, match=r"`b` leaf 0 has dtype int32"):
        custom_linear_solve(lambda x: x, jnp.arange(3, dtype=jnp.int32), solve, solve)
    with pytest.raises(TypeError, match="`b`.*floating point"):
        custom_linear_solve(lambda x: x, 1, solve, solve)
    with pytest.raises(TypeError, match=r"`b` leaf 1 has dtype bool"):
        custom_linear_solve(lambda x: x, (jnp.ones(2), jnp.ones(2, bool)), solve, solve)
    with pytest.raises(TypeError, match="`b` has no array leaves"):
        custom_linear_solve(lambda x: x, {}, solve, solve)
    # traced integer b (under jit) is rejected the same way
    with pytest.raises(TypeError, match="`b`"):
        jax.jit(lambda b: custom_linear_solve(lambda x: x, b, solve, solve))(jnp.arange(3))


# ---------------------------------------------------------------------------
# Transposition.


def test_linear_transpose(dtype):
    """`b -> A^{-1} b` transposes to `c -> A^{-T} c`, for nonsymmetric and symmetric A."""
    a, c, spd = _NS.astype(dtype), _B.astype(dtype), (_M @ _M.T + np.eye(3)).astype(dtype)
    cs = _BS.astype(dtype)
    f_ns = lambda b: lu_solve(a, b)
    f_spd = lambda b: spd_solve(spd, b)

    def compute(c, cs):
        t_ns = jax.linear_transpose(f_ns, c)
        return {
            "nonsymmetric": (t_ns(c), (jnp.linalg.solve(a.T, c),)),
            "symmetric": (jax.linear_transpose(f_spd, c)(c), (jnp.linalg.solve(spd, c),)),
            "vmap_of_transpose": (jax.vmap(t_ns)(cs), (jnp.linalg.solve(a.T, cs.T).T,)),
            "transpose_of_linearize": (
                jax.linear_transpose(jax.linearize(f_ns, c)[1], c)(c),
                (jnp.linalg.solve(a.T, c),),
            ),
            # transposing twice gives back the solve
            "double_transpose": (
                jax.linear_transpose(lambda d: t_ns(d)[0], c)(c),
                (jnp.linalg.solve(a, c),),
            ),
        }

    check_pairs(jax.jit(compute)(c, cs), rtol=tol(dtype, 1e-4, 1e-12), atol=tol(dtype, 1e-5, 1e-13))
    # eagerly, too
    np.testing.assert_allclose(
        jax.linear_transpose(f_ns, c)(c)[0],
        np.linalg.solve(_NS.T, _B),
        rtol=tol(dtype, 1e-4, 1e-12),
    )


def test_linear_transpose_derivative_wrt_matrix(x64):
    """Differentiating the transposed solve w.r.t. the matrix (a transposed instance's rules)."""
    c = _B

    def transposed(a):
        return jax.linear_transpose(lambda b: lu_solve(a, b), c)(c)[0]

    ref = lambda a: jnp.linalg.solve(a.T, c)
    out = jax.jit(
        lambda a: {
            "jacrev": (jax.jacrev(transposed)(a), jax.jacrev(ref)(a)),
            "jacfwd": (jax.jacfwd(transposed)(a), jax.jacfwd(ref)(a)),
        }
    )(_NS)
    check_pairs(out, rtol=1e-10, atol=1e-13)


def test_linear_transpose_with_aux_where_lax_fails():
    """Transposing a has_aux solve with a cotangent on the aux output too.

    jax 0.10.2's `lax.custom_linear_solve` raises `NotImplementedError: open an issue`
    here (its transpose rule rejects nonzero aux cotangents); ours treats the aux as
    the constant it is. lax's outcome is only compared, never required to fail.
    """
    a = _NS.astype(np.float32)
    b = _B.astype(np.float32)
    solve = lambda mv, r: (jnp.linalg.solve(a, r), jnp.sum(r))
    transpose_solve = lambda vm, r: (jnp.linalg.solve(a.T, r), jnp.sum(r))
    expected = np.linalg.solve(_NS.T, _B)

    def make(cls):
        return lambda x: cls(lambda v: a @ v, x, solve, transpose_solve, has_aux=True)

    ct = (b, jnp.ones((), np.float32))
    (got,) = jax.linear_transpose(make(custom_linear_solve), b)(ct)
    np.testing.assert_allclose(got, expected, rtol=1e-4)
    (got,) = jax.jit(jax.linear_transpose(make(custom_linear_solve), b))(ct)
    np.testing.assert_allclose(got, expected, rtol=1e-4)
    try:
        (lax_got,) = jax.linear_transpose(make(lax.custom_linear_solve), b)(ct)
    except NotImplementedError:
        pass  # jax 0.10.2
    else:  # if JAX fixes it, the two must agree
        np.testing.assert_allclose(got, lax_got, rtol=1e-5)


def test_partially_symbolic_tangents_where_lax_fails(x64):
    """b = (x, 0): forward and reverse mode see a symbolic-zero leaf in b's tangent.

    jax 0.10.2's lax.custom_linear_solve raises a TypeError ("Error interpreting
    argument to custom_linear_solve as a JAX value ... Zero") on each of the jvp, jacrev
    and vjp below; ours must give the right answers.
    """
    a = np.kron(np.eye(2), _NS[:2, :2]) + 0.1 * np.ones((4, 4))
    matvec, solve, transpose_solve = _tuple_system(a)
    f = lambda x: custom_linear_solve(matvec, (x, jnp.zeros(2)), solve, transpose_solve)
    ref = lambda x: _tuple_ref(a, (x, jnp.zeros(2)))
    x = _B[:2]
    out = jax.jit(
        lambda x: {
            "jvp": (jax.jvp(f, (x,), (x,)), jax.jvp(ref, (x,), (x,))),
            "jacrev": (jax.jacrev(f)(x), jax.jacrev(ref)(x)),
            "vjp": (jax.vjp(f, x)[1]((x, x)), jax.vjp(ref, x)[1]((x, x))),
        }
    )(x)
    check_pairs(out, rtol=1e-12, atol=1e-14)


# Regression test (was a bug): _LinearSolve.transpose assumes every leaf of b is a linear
# input (an _Accum): AttributeError: 'ArrayImpl' object has no attribute 'accum'
def test_linear_transpose_with_partially_constant_b(x64):
    """`x -> A^{-1} (x, 0)` is linear in x; its transpose is the first block of A^{-T} ct."""
    a = np.kron(np.eye(2), _NS[:2, :2]) + 0.1 * np.ones((4, 4))
    matvec, solve, transpose_solve = _tuple_system(a)
    f = lambda x: custom_linear_solve(matvec, (x, jnp.zeros(2)), solve, transpose_solve)
    ct = (_B[:2], _B[1:])
    (got,) = jax.linear_transpose(f, _B[:2])(ct)
    np.testing.assert_allclose(got, np.linalg.solve(a.T, np.concatenate(ct))[:2], rtol=1e-12)


# Regression test (was a bug): _LinearSolve.transpose checks for its own _Accum in the solver
# constants but jax's linear_transpose hands it jax._src.interpreters.ad.ValAccum, so the
# intended error naming `solve` is replaced by TypeError "Argument 'ValAccum(float32[2])' ...
# is not a valid JAX type"
def test_transpose_with_solver_closing_over_b():
    """A solver closing over the right-hand side itself cannot be transposed (the rhs has
    no value during transposition); the error should say so. Also reached through
    custom_root's reverse mode, which transposes its tangent_solve."""
    a = jnp.array([[2.0, 1.0], [1.0, 3.0]])
    b = jnp.array([1.0, 2.0])
    f = lambda b: custom_linear_solve(
        lambda x: a @ x, b, lambda m, r: jnp.linalg.solve(a, r) + 0 * b, symmetric=True
    )
    # jax.grad does not transpose the solver constants: fine
    np.testing.assert_allclose(jax.grad(lambda b: f(b).sum())(b), [0.4, 0.2], rtol=1e-6)
    with pytest.raises((ValueError, NotImplementedError), match="`solve` closes over"):
        jax.linear_transpose(f, b)(b)

    # the same tangent solver inside custom_root: forward mode works, reverse mode says why not
    def root(c):
        def tangent_solve(g, y):
            dense = lambda m, r: jnp.linalg.solve(jax.jacfwd(m)(jnp.zeros(2)), r) + 0 * y
            return custom_linear_solve(g, y, dense, symmetric=True)

        oracle = lambda f, x: jnp.linalg.solve(a, c)
        return custom_root(lambda x: a @ x - c, jnp.zeros(2), oracle, tangent_solve)

    np.testing.assert_allclose(jax.jacfwd(root)(b), np.linalg.inv(a), rtol=1e-6)
    with pytest.raises((ValueError, NotImplementedError), match="`solve` closes over"):
        jax.grad(lambda c: root(c).sum())(b)


# Regression test (was a bug): VmapOf (the default batching of a Primitive) has no `transpose`
# rule, so jax.linear_transpose(jax.vmap(b -> custom_linear_solve(...))) raises
# NotImplementedError
def test_linear_transpose_of_vmap():
    a, cs = _NS.astype(np.float32), _BS.astype(np.float32)
    f = jax.vmap(lambda b: lu_solve(a, b))
    (got,) = jax.linear_transpose(f, cs)(cs)
    np.testing.assert_allclose(got, np.linalg.solve(_NS.T, _BS.T).T, rtol=1e-4)


# ---------------------------------------------------------------------------
# Closures, checkpoint, control flow, agreement with lax.


def test_integer_closure_in_matvec_under_jit_and_vmap():
    """matvec closes over an integer index (a traced int under jit/vmap): no leaked tracers."""

    def solve_scaled(i, ds, b):
        d = ds[i]
        return custom_linear_solve(lambda x: d * x, b, lambda mv, r: r / d, symmetric=True)

    ds = jnp.array([1.0, 2.0, 4.0])
    idx = jnp.array([0, 2])
    b = jnp.ones(2)
    with jax.checking_leaks():
        np.testing.assert_allclose(
            jax.vmap(solve_scaled, (0, None, None))(idx, ds, b), [[1.0, 1.0], [0.25, 0.25]]
        )
        out = jax.jit(
            lambda idx, i, ds, b: (
                jax.vmap(solve_scaled, (0, None, None))(idx, ds, b),
                jax.grad(lambda ds: solve_scaled(i, ds, b).sum())(ds),
                jax.vmap(jax.grad(lambda i, ds: solve_scaled(i, ds, b).sum(), 1), (0, None))(
                    idx, ds
                ),
            )
        )(idx, 2, ds, b)
    np.testing.assert_allclose(out[0], [[1.0, 1.0], [0.25, 0.25]])
    # d/dd (2/d) = -2/d**2
    np.testing.assert_allclose(out[1], [0.0, 0.0, -0.125])
    np.testing.assert_allclose(out[2], [[-2.0, 0.0, 0.0], [0.0, 0.0, -0.125]])


def test_checkpoint(x64):
    """JAX's test_custom_linear_solve_new_remat."""

    def matrix_free_solve(matvec, b):
        return custom_linear_solve(
            matvec, b, explicit_jacobian_solve, explicit_jacobian_solve, symmetric=True
        )

    def linear_solve(a, b):
        return matrix_free_solve(partial(jnp.dot, a), b)

    rng = np.random.RandomState(8)
    a = rng.randn(3, 3)
    a = a + a.T
    b = rng.randn(3)
    ref = jax.grad(lambda a, b: jnp.linalg.solve(a, b).sum(), (0, 1))(a, b)
    for ckpt in (
        jax.checkpoint(linear_solve),
        jax.checkpoint(linear_solve, policy=lambda *_, **__: True),
    ):
        g = jax.jit(jax.grad(lambda a, b, ckpt=ckpt: ckpt(a, b).sum(), (0, 1)))(a, b)
        assert_trees_close(g, ref, rtol=1e-10)


def test_inside_scan(x64):
    """x_{k+1} = A^{-1} (x_k + b_k) inside lax.scan, differentiated in both modes."""
    a = _NS

    def step(x, bk):
        x = lu_solve(a, x + bk)
        return x, jnp.sum(x)

    def step_ref(x, bk):
        x = jnp.linalg.solve(a, x + bk)
        return x, jnp.sum(x)

    run = lambda body: lambda bs: lax.scan(body, jnp.zeros(3), bs)
    bs = _BS
    out = jax.jit(
        lambda bs: {
            "value": (run(step)(bs), run(step_ref)(bs)),
            "jacrev": (
                jax.jacrev(lambda bs: run(step)(bs)[0])(bs),
                jax.jacrev(lambda bs: run(step_ref)(bs)[0])(bs),
            ),
            "jacfwd": (
                jax.jacfwd(lambda bs: run(step)(bs)[1])(bs),
                jax.jacfwd(lambda bs: run(step_ref)(bs)[1])(bs),
            ),
        }
    )(bs)
    check_pairs(out, rtol=1e-10, atol=1e-13)


def test_symbolic_zero_cotangents(x64):
    """Port of JAX's test_symbolic_zero_cotangents (jax#29342): jvp of vmap inside a vjp."""

    def g(x):
        def p(z):
            e1 = jnp.array([1.0, 0.0, 0.0])
            return custom_linear_solve(
                lambda v: z.sum() * v, e1, lambda mv, r: r / z.sum(), symmetric=True
            )[0]

        return lambda y: jax.jvp(jax.vmap(p), (x,), (y,))[1]

    def f(x):
        return jax.vjp(g(x), jnp.ones_like(x))[1](x)[0]

    x = jnp.array([200.0])
    # p(z) = 1/z, jvp -> -y/z**2, vjp w.r.t. y at cotangent x -> -x/z**2 = -1/z
    value, jac = jax.jit(lambda x: (f(x), jax.jacrev(f)(x)))(x)
    np.testing.assert_allclose(value, [-1 / 200.0], rtol=1e-12)
    np.testing.assert_allclose(jac, [[1 / 200.0**2]], rtol=1e-12)


def test_matches_lax_custom_linear_solve(x64):
    """Same values and derivatives as lax.custom_linear_solve on the same problems."""

    def make(cls):
        def f(a, b):
            x1 = cls(partial(jnp.dot, a), b, explicit_jacobian_solve, explicit_jacobian_solve)
            spd = a @ a.T + jnp.eye(3)
            x2 = cls(partial(jnp.dot, spd), b, explicit_jacobian_solve, symmetric=True)
            return x1, x2

        loss = lambda a, b: sum(jnp.sum(jnp.sin(x)) for x in f(a, b))
        return lambda a, b: (f(a, b), jax.grad(loss, (0, 1))(a, b), jax.hessian(loss, 1)(a, b))

    a, b = _NS, _B
    ours, theirs = (
        jax.jit(make(custom_linear_solve))(a, b),
        jax.jit(make(lax.custom_linear_solve))(a, b),
    )
    assert_trees_close(ours, theirs, rtol=1e-10, atol=1e-13)


def test_complex(x64):
    """JAX's test_custom_linear_solve_complex (transpose, not conjugate transpose)."""

    def solve(a, b):
        return custom_linear_solve(
            partial(jnp.dot, a),
            b,
            lambda mv, x: jnp.linalg.solve(a, x),
            lambda vm, x: jnp.linalg.solve(a.T, x),
        )

    rng = np.random.RandomState(9)
    a = 0.5 * rng.randn(2, 2) + 0.5j * rng.randn(2, 2) + 2 * np.eye(2)
    b = 0.5 * rng.randn(2) + 0.5j * rng.randn(2)
    out = jax.jit(
        lambda a, b: {
            "value": (solve(a, b), jnp.linalg.solve(a, b)),
            "jacfwd": (
                jax.jacfwd(solve, (0, 1), holomorphic=True)(a, b),
                jax.jacfwd(jnp.linalg.solve, (0, 1), holomorphic=True)(a, b),
            ),
            "jacrev": (
                jax.jacrev(solve, (0, 1), holomorphic=True)(a, b),
                jax.jacrev(jnp.linalg.solve, (0, 1), holomorphic=True)(a, b),
            ),
        }
    )(a, b)
    check_pairs(out, rtol=1e-10, atol=1e-13)
