"""Tests for `implicitdiff.linear_solve` and `implicitdiff.error_if`.

Compiling JAX's Krylov solvers dominates the run time (GMRES alone takes over a second to
compile on CPU), so the solves go through a few jitted functions that take the matrix as
an argument and are cached per (solver, options): tests that only change the matrix reuse
the compiled code.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from implicitdiff import ImplicitDiffRuntimeError, error_if
from implicitdiff import linear_solve as ls

# A failed run-time check reaches the caller as `jax.errors.JaxRuntimeError` (a
# RuntimeError), or as ValueError when jit serves the call from its C++ fast path
# (jax-ml/jax#34083). Both carry our message.
CHECK_ERRORS = (RuntimeError, ValueError)

N = 8
ALL = ["dense", "cg", "normal_cg", "gmres", "bicgstab", "neumann", "auto"]
NONSYMMETRIC = [s for s in ALL if s != "cg"]
ITERATIVE = ["cg", "normal_cg", "gmres", "bicgstab", "neumann"]
# `auto` is `dense` at the test size; it is covered where it adds something.
SOLVERS = ["dense", "cg", "normal_cg", "gmres", "bicgstab", "neumann"]


def _slow_unless(names, fast):
    """`names` as test parameters, those not in `fast` marked slow. Each parameter compiles
    new programs (about a second for GMRES on CPU); the fast subset keeps the default run
    short while the slow run covers every solver."""
    return [n if n in fast else pytest.param(n, marks=pytest.mark.slow) for n in names]


# ---------------------------------------------------------------------------
# Test matrices (float64 NumPy; tests convert them after enabling x64 when needed).


def _orthogonal(n, seed):
    q, _ = np.linalg.qr(np.random.default_rng(seed).normal(size=(n, n)))
    return q


def spd_matrix(n=N, seed=0):
    """Symmetric positive definite, eigenvalues in [0.5, 1.5]: so I - A has spectral
    radius 0.5 and every solver (neumann included) applies."""
    q = _orthogonal(n, seed)
    a = q @ np.diag(np.linspace(0.5, 1.5, n)) @ q.T
    return (a + a.T) / 2


def nonsymmetric_matrix(n=N, seed=1, radius=0.5):
    """A = I - J with ||J||_2 = radius: nonsymmetric, condition number <= 3 for 0.5."""
    j = np.random.default_rng(seed).normal(size=(n, n))
    j *= radius / np.linalg.norm(j, 2)
    return np.eye(n) - j


def ill_conditioned(n=N, seed=2, cond=1e6, symmetric=True):
    q = _orthogonal(n, seed)
    s = np.diag(np.logspace(0, -np.log10(cond), n))
    if symmetric:
        a = q @ s @ q.T
        return (a + a.T) / 2
    return q @ s @ _orthogonal(n, seed + 100).T


def rhs(n=N, seed=3):
    return np.random.default_rng(seed).normal(size=n)


def matrix_for(name, kind):
    """The well-conditioned test matrix of `kind` ("spd"/"nonsym"), SPD for cg."""
    if name == "cg" or kind == "spd":
        return spd_matrix()
    return nonsymmetric_matrix()


@functools.cache
def _compiled(name, opts):
    solver = getattr(ls, name)
    return jax.jit(lambda a, b: solver(lambda v: a @ v, b, **dict(opts)))


def solve_fn(name, **opts):
    """A jitted `(A, b) -> solver(lambda v: A @ v, b, **opts)`, compiled once per options."""
    return _compiled(name, tuple(sorted(opts.items())))


def relres(a, x, b):
    return np.linalg.norm(a @ np.asarray(x) - b) / np.linalg.norm(b)


# ---------------------------------------------------------------------------
# (a), (b): well-conditioned systems against NumPy and `dense`.


@pytest.mark.parametrize("name", ALL)
def test_spd_system(x64, name):
    a, b = spd_matrix(), rhs()
    x = solve_fn(name)(jnp.asarray(a), jnp.asarray(b))
    assert x.dtype == jnp.float64
    np.testing.assert_allclose(x, np.linalg.solve(a, b), rtol=1e-8, atol=1e-9)
    np.testing.assert_allclose(x, solve_fn("dense")(a, b), rtol=1e-8, atol=1e-9)


@pytest.mark.parametrize("name", NONSYMMETRIC)
def test_nonsymmetric_system(x64, name):
    a, b = nonsymmetric_matrix(), rhs()
    assert not np.allclose(a, a.T)
    x = solve_fn(name)(jnp.asarray(a), jnp.asarray(b))
    np.testing.assert_allclose(x, np.linalg.solve(a, b), rtol=1e-8, atol=1e-9)
    np.testing.assert_allclose(x, solve_fn("dense")(a, b), rtol=1e-8, atol=1e-9)


@pytest.mark.parametrize("name", _slow_unless(SOLVERS, fast={"dense", "cg", "neumann"}))
def test_float32_defaults(name):
    """The float32 default tolerance (rtol=1e-5) is reachable on a benign system."""
    a = np.float32(matrix_for(name, "nonsym"))
    b = np.float32(rhs())
    x = solve_fn(name)(jnp.asarray(a), jnp.asarray(b))
    assert x.dtype == jnp.float32
    assert relres(a.astype(np.float64), x, b) < 1e-4
    np.testing.assert_allclose(x, np.linalg.solve(a, b), rtol=1e-3, atol=1e-4)


# ---------------------------------------------------------------------------
# (c): ill-conditioned systems (condition number 1e6, float64).


@pytest.mark.parametrize("name", ["dense", "cg", "gmres", "bicgstab", "auto"])
def test_ill_conditioned_converges(x64, name):
    a = ill_conditioned(symmetric=(name == "cg"))
    assert 0.9e6 < np.linalg.cond(a) < 1.1e6
    b = rhs()
    x = solve_fn(name)(jnp.asarray(a), jnp.asarray(b))  # default maxiter = 10 n suffices
    if name != "dense":
        assert relres(a, x, b) <= ls.RESIDUAL_SLACK * 1e-10
    x_np = np.linalg.solve(a, b)
    # Error bound: condition number x relative residual.
    np.testing.assert_allclose(x, x_np, rtol=1e-5 * np.abs(x_np).max(), atol=1e-5)


def test_normal_cg_reports_squared_conditioning(x64):
    """CG on A^T A squares the condition number; on a very ill-conditioned system it
    cannot reach the tolerance, and says so."""
    a = ill_conditioned(n=12, cond=1e8, symmetric=False)
    b = rhs(12)
    with pytest.raises(CHECK_ERRORS, match="normal_cg did not converge") as info:
        jax.block_until_ready(solve_fn("normal_cg")(a, b))
    assert "squares the condition number" in str(info.value)
    assert "`dense`" in str(info.value)


TINY = {
    "cg": dict(maxiter=1),
    "normal_cg": dict(maxiter=1),
    "gmres": dict(maxiter=1, restart=2),
    "bicgstab": dict(maxiter=1),
    "neumann": dict(maxiter=1),
}


@pytest.mark.parametrize("name", ITERATIVE)
def test_tiny_maxiter_raises(x64, name):
    a = ill_conditioned(symmetric=(name == "cg"))
    b = rhs()
    with pytest.raises(CHECK_ERRORS) as info:
        jax.block_until_ready(solve_fn(name, **TINY[name])(a, b))
    text = str(info.value)
    assert f"implicitdiff.linear_solve.{name} did not converge" in text
    assert "maxiter=1" in text
    assert "raise `maxiter`" in text and "linear_solve.dense" in text
    assert "throw=False" in text
    # The residual reached and the tolerance are reported as numbers.
    found = re.search(r"= ([0-9.e+-]+) is above the tolerance .* = ([0-9.e+-]+)", text)
    assert found is not None
    residual, tol = float(found.group(1)), float(found.group(2))
    assert residual > ls.RESIDUAL_SLACK * tol
    np.testing.assert_allclose(tol, 1e-10 * np.linalg.norm(b), rtol=1e-3)


@pytest.mark.parametrize("name", _slow_unless(ITERATIVE, fast={"cg", "neumann"}))
def test_tiny_maxiter_throw_false_returns(x64, name):
    a = ill_conditioned(symmetric=(name == "cg"))
    b = rhs()
    x = jax.block_until_ready(solve_fn(name, throw=False, **TINY[name])(a, b))
    assert x.shape == b.shape
    assert relres(a, x, b) > 1e-9  # not converged, yet no error


def test_dense_singular_raises(x64):
    a = np.diag([1.0, 0.0, 2.0])
    b = np.ones(3)
    with pytest.raises(CHECK_ERRORS, match="linear_solve.dense: the solution is not finite"):
        jax.block_until_ready(solve_fn("dense")(a, b))
    x = solve_fn("dense", throw=False)(a, b)
    assert not np.all(np.isfinite(x))


# ---------------------------------------------------------------------------
# (d): pytree right-hand sides.


@pytest.mark.parametrize("name", _slow_unless(SOLVERS, fast={"dense", "cg", "neumann"}))
def test_pytree_rhs(x64, name):
    n = 7  # 3 + 2 * 2 unknowns
    a = spd_matrix(n) if name == "cg" else nonsymmetric_matrix(n)
    flat_b = rhs(n)
    b = {"u": jnp.asarray(flat_b[:3]), "w": jnp.asarray(flat_b[3:].reshape(2, 2))}

    def matvec(t):
        y = a @ jnp.concatenate([t["u"], t["w"].ravel()])
        return {"u": y[:3], "w": y[3:].reshape(2, 2)}

    x = jax.jit(lambda b: getattr(ls, name)(matvec, b))(b)
    assert set(x) == {"u", "w"} and x["w"].shape == (2, 2)
    expected = np.linalg.solve(a, flat_b)
    np.testing.assert_allclose(x["u"], expected[:3], rtol=1e-8, atol=1e-9)
    np.testing.assert_allclose(x["w"].ravel(), expected[3:], rtol=1e-8, atol=1e-9)


# ---------------------------------------------------------------------------
# (e): jit (all of the above) and vmap.


@pytest.mark.parametrize("name", _slow_unless(SOLVERS, fast={"dense", "cg", "neumann"}))
def test_vmap_over_rhs(x64, name):
    a = matrix_for(name, "nonsym")
    bs = np.stack([rhs(seed=s) for s in range(3)])
    solver = getattr(ls, name)
    xs = jax.jit(jax.vmap(lambda b: solver(lambda v: a @ v, b)))(bs)
    np.testing.assert_allclose(xs, np.linalg.solve(a, bs.T).T, rtol=1e-8, atol=1e-9)


@pytest.mark.parametrize("name", _slow_unless(SOLVERS, fast={"dense", "cg", "neumann"}))
def test_vmap_over_closed_over_matrix(x64, name):
    make = spd_matrix if name == "cg" else nonsymmetric_matrix
    a_batch = np.stack([make(seed=s) for s in range(3)])
    b = rhs()
    solver = getattr(ls, name)
    xs = jax.jit(jax.vmap(lambda a: solver(lambda v: a @ v, b)))(a_batch)
    np.testing.assert_allclose(xs, np.linalg.solve(a_batch, b), rtol=1e-8, atol=1e-9)


def test_vmap_raises_if_one_batch_element_fails(x64):
    a = ill_conditioned()
    bs = np.stack([np.zeros(N), rhs()])  # b = 0 is solved exactly by x = 0
    f = jax.jit(jax.vmap(lambda b: ls.cg(lambda v: a @ v, b, maxiter=1)))
    with pytest.raises(
        CHECK_ERRORS, match=r"cg did not converge(.|\n)*batch of shape \(2,\): \(1,\)"
    ):
        jax.block_until_ready(f(bs))
    np.testing.assert_array_equal(f(np.zeros((2, N))), np.zeros((2, N)))  # no element fails


# ---------------------------------------------------------------------------
# (f): derivatives, float64.


def _loss(name):
    solver = getattr(ls, name)
    return lambda a, b: jnp.sum(solver(lambda v: a @ v, b) ** 2)


@functools.cache
def _grad_fn(name):
    return jax.jit(jax.grad(_loss(name), argnums=(0, 1)))


@pytest.mark.parametrize("name", ALL)
def test_grad_matches_closed_form(x64, name):
    a, b = matrix_for(name, "nonsym"), rhs()
    ga, gb = _grad_fn(name)(jnp.asarray(a), jnp.asarray(b))
    # L = |x|^2 with A x = b:  dL/db = A^{-T} 2x,  dL/dA = -(dL/db) x^T.
    x = np.linalg.solve(a, b)
    w = np.linalg.solve(a.T, 2 * x)
    np.testing.assert_allclose(gb, w, rtol=1e-7, atol=1e-9)
    np.testing.assert_allclose(ga, -np.outer(w, x), rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("name", ["dense", "gmres", "neumann"])
def test_grad_matches_finite_differences(x64, name):
    a, b = matrix_for(name, "nonsym"), rhs()
    solve = solve_fn(name)  # compiled already by other tests
    loss = lambda a, b: np.sum(np.asarray(solve(a, b)) ** 2)
    ga, gb = _grad_fn(name)(jnp.asarray(a), jnp.asarray(b))
    eps = 1e-6
    fd_b = [(loss(a, b + eps * e) - loss(a, b - eps * e)) / (2 * eps) for e in np.eye(N)]
    np.testing.assert_allclose(gb, fd_b, rtol=1e-5, atol=1e-7)
    da = np.random.default_rng(7).normal(size=a.shape)  # a directional derivative in A
    fd_a = (loss(a + eps * da, b) - loss(a - eps * da, b)) / (2 * eps)
    np.testing.assert_allclose(np.sum(ga * da), fd_a, rtol=1e-5)


@pytest.mark.parametrize("name", _slow_unless(SOLVERS, fast={"dense"}))
def test_jacfwd_equals_jacrev(x64, name):
    a, b = jnp.asarray(matrix_for(name, "nonsym")), jnp.asarray(rhs())
    solver = getattr(ls, name)

    def f(a, b):
        return solver(lambda v: a @ v, b)

    fwd = jax.jit(jax.jacfwd(f, argnums=(0, 1)))(a, b)
    rev = jax.jit(jax.jacrev(f, argnums=(0, 1)))(a, b)
    inv = np.linalg.inv(a)
    np.testing.assert_allclose(fwd[1], inv, rtol=1e-7, atol=1e-9)
    for f_, r_ in zip(fwd, rev):
        np.testing.assert_allclose(f_, r_, rtol=1e-7, atol=1e-9)
    # dx_i/dA_jk = -inv_ij x_k
    x = inv @ b
    np.testing.assert_allclose(fwd[0], -np.einsum("ij,k->ijk", inv, x), rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("name", _slow_unless(["cg", "gmres"], fast={"cg"}))
def test_second_derivative(x64, name):
    a, b = matrix_for(name, "nonsym"), jnp.asarray(rhs())
    hess = jax.jit(jax.hessian(lambda b: _loss(name)(a, b)))(b)
    inv = np.linalg.inv(a)
    np.testing.assert_allclose(hess, 2 * inv.T @ inv, rtol=1e-7, atol=1e-9)


def test_initial_guess(x64):
    a, b = spd_matrix(), rhs()
    x_exact = np.linalg.solve(a, b)
    f = jax.jit(lambda a, b, x0: ls.cg(lambda v: a @ v, b, x0=x0))
    np.testing.assert_allclose(f(a, b, x_exact), x_exact, rtol=1e-9)
    np.testing.assert_allclose(f(a, b, np.ones(N)), x_exact, rtol=1e-8)
    # The answer does not depend on the guess, and neither do its derivatives.
    g_x0 = jax.grad(lambda x0: jnp.sum(f(a, b, x0) ** 2))(jnp.ones(N))
    np.testing.assert_array_equal(g_x0, np.zeros(N))
    with pytest.raises(ValueError, match="`x0` must have the same pytree structure"):
        ls.cg(lambda v: v, jnp.ones(3), x0=(jnp.ones(3),))
    with pytest.raises(ValueError, match="`x0` must have the same shapes"):
        ls.gmres(lambda v: v, jnp.ones(3), x0=jnp.ones(4))


# ---------------------------------------------------------------------------
# (g): neumann on I - J.


def test_neumann_on_contraction_matches_dense(x64):
    rng = np.random.default_rng(11)
    j = rng.normal(size=(N, N))
    j *= 0.5 / np.max(np.abs(np.linalg.eigvals(j)))  # spectral radius 0.5
    a, b = np.eye(N) - j, rhs()
    np.testing.assert_allclose(
        solve_fn("neumann")(a, b), solve_fn("dense")(a, b), rtol=1e-8, atol=1e-9
    )


def test_neumann_raises_when_radius_above_one(x64):
    rng = np.random.default_rng(11)
    j = rng.normal(size=(N, N))
    j *= 1.5 / np.max(np.abs(np.linalg.eigvals(j)))  # spectral radius 1.5: series diverges
    with pytest.raises(CHECK_ERRORS, match="neumann did not converge") as info:
        jax.block_until_ready(solve_fn("neumann")(np.eye(N) - j, rhs()))
    assert "spectral radius" in str(info.value)


# ---------------------------------------------------------------------------
# (h): auto.


def test_auto_method_choice():
    assert ls.AUTO_DENSE_MAX_SIZE == 256
    assert ls.auto_method(jnp.zeros(256)) == "dense"
    assert ls.auto_method(jnp.zeros(256), symmetric=True) == "dense"
    assert ls.auto_method(jnp.zeros(257)) == "gmres"
    assert ls.auto_method({"a": jnp.zeros(200), "b": jnp.zeros((8, 8))}) == "gmres"
    assert ls.auto_method(jax.ShapeDtypeStruct((300,), jnp.float32), symmetric=True) == "cg"


def test_auto_small_is_dense(x64):
    a, b = nonsymmetric_matrix(), rhs()
    np.testing.assert_array_equal(solve_fn("auto")(a, b), solve_fn("dense")(a, b))


def test_auto_large(x64):
    n = ls.AUTO_DENSE_MAX_SIZE + 44
    b = rhs(n)
    # Cheap well-conditioned tridiagonal matrices (eigenvalues / singular values in [1, 4]).
    spd = 2.5 * np.eye(n) - 0.5 * (np.eye(n, k=1) + np.eye(n, k=-1))
    nonsym = 3.0 * np.eye(n) - np.eye(n, k=-1) + 0.5 * np.eye(n, k=1)
    x_auto = solve_fn("auto", symmetric=True)(spd, b)
    np.testing.assert_array_equal(x_auto, solve_fn("cg")(spd, b))  # the same computation
    np.testing.assert_allclose(x_auto, np.linalg.solve(spd, b), rtol=1e-8, atol=1e-9)
    x = solve_fn("auto")(nonsym, b)  # gmres
    np.testing.assert_allclose(x, np.linalg.solve(nonsym, b), rtol=1e-8, atol=1e-9)


# ---------------------------------------------------------------------------
# Argument checking.


def test_invalid_options():
    mv, b = (lambda v: 2 * v), jnp.ones(3)
    with pytest.raises(ValueError, match="`maxiter` must be >= 1"):
        ls.cg(mv, b, maxiter=-1)
    with pytest.raises(TypeError, match="`maxiter` must be a Python int"):
        ls.bicgstab(mv, b, maxiter=2.5)
    with pytest.raises(ValueError, match="`restart` must be >= 1"):
        ls.gmres(mv, b, restart=0)
    with pytest.raises(ValueError, match="`rtol` must be a finite number >= 0"):
        ls.neumann(mv, b, rtol=-1e-3)
    with pytest.raises(ValueError, match="`atol`"):
        ls.normal_cg(mv, b, atol=float("nan"))
    with pytest.raises(TypeError, match="`b` must contain real floating-point arrays"):
        ls.dense(mv, jnp.arange(3))
    with pytest.raises(TypeError, match="Complex systems are not supported"):
        ls.auto(mv, jnp.ones(3, jnp.complex64))
    with pytest.raises(TypeError, match="`throw` must be True or False"):
        ls.cg(mv, b, throw="yes")


def test_empty_rhs():
    assert ls.gmres(lambda v: v, {}) == {}
    assert ls.dense(lambda v: v, jnp.zeros(0)).shape == (0,)


# ---------------------------------------------------------------------------
# (i): error_if.


def _guarded(x):
    return jnp.sum(jnp.sin(error_if(x, x < 0, "negative input")) ** 2)


def test_error_if_under_jit():
    f = jax.jit(_guarded)
    assert np.isfinite(f(jnp.array([1.0, 2.0])))
    with pytest.raises(CHECK_ERRORS, match="negative input"):
        jax.block_until_ready(f(jnp.array([1.0, -2.0])))
    assert np.isfinite(f(jnp.array([3.0, 2.0])))  # usable again afterwards


def test_error_if_survives_when_only_one_part_is_used():
    # The check rides on every leaf: a caller that keeps one part of the checked value
    # (the cotangent of one argument of a gradient, say) keeps the check.
    for keep in (0, 1):
        f = jax.jit(lambda x, keep=keep: error_if((x, 2 * x), x < 0, "negative input")[keep])
        np.testing.assert_allclose(f(jnp.array(1.5)), 1.5 * (1 + keep))
        with pytest.raises(CHECK_ERRORS, match="negative input"):
            jax.block_until_ready(f(jnp.array(-1.0)))


def test_error_if_under_vmap():
    f = jax.jit(jax.vmap(_guarded))
    np.testing.assert_allclose(f(jnp.ones((3, 2))), 2 * np.sin(1.0) ** 2 * np.ones(3))
    bad = jnp.ones((3, 2)).at[1, 0].set(-1.0)
    with pytest.raises(CHECK_ERRORS, match=r"negative input(.|\n)*batch of shape \(3,\): \(1,\)"):
        jax.block_until_ready(f(bad))
    nested = jax.vmap(jax.vmap(lambda x: error_if(x, x < 0, "v={v}", values={"v": x})))
    np.testing.assert_array_equal(nested(jnp.ones((2, 3))), np.ones((2, 3)))
    with pytest.raises(CHECK_ERRORS, match=r"v=-5\.0(.|\n)*\(2, 3\): \(1, 2\)"):
        jax.block_until_ready(nested(jnp.ones((2, 3)).at[1, 2].set(-5.0)))
    # Mapped along other axes, with two failures: the first in the mapped order is named,
    # with its index in that order (column 0, then row 2 of the array).
    by_column = jax.jit(
        jax.vmap(jax.vmap(lambda x: error_if(x, x < 0, "v={v}", values={"v": x})), in_axes=1)
    )
    bad = jnp.ones((3, 2)).at[2, 0].set(-5.0).at[1, 1].set(-4.0)
    with pytest.raises(CHECK_ERRORS, match=r"v=-5\.0(.|\n)*\(2, 3\): \(0, 2\)"):
        jax.block_until_ready(by_column(bad))
    # A batched value with an unbatched verdict.
    shared = jax.jit(jax.vmap(lambda v: error_if(v, jnp.array(True), "v={v}", values={"v": v})))
    with pytest.raises(CHECK_ERRORS, match=r"v=7\.0(.|\n)*\(2,\): \(0,\)"):
        jax.block_until_ready(shared(jnp.array([7.0, 8.0])))


def test_error_if_passes_gradients_through():
    # _guarded(x) = sum(sin(x)^2): gradient sin(2x), Hessian diag(2 cos(2x)).
    x = jnp.array([0.3, 0.5, 1.2])
    xn = np.asarray(x)
    cases = [
        (jax.grad, np.sin(2 * xn)),
        (jax.hessian, np.diag(2 * np.cos(2 * xn))),
        (lambda f: lambda x: jax.jvp(f, (x,), (jnp.ones(3),))[1], np.sum(np.sin(2 * xn))),
        (lambda f: lambda x: jax.linearize(f, x)[1](jnp.ones(3)), np.sum(np.sin(2 * xn))),
        (
            lambda f: lambda x: jax.vmap(jax.grad(f))(jnp.stack([x, 2 * x])),
            np.stack([np.sin(2 * xn), np.sin(4 * xn)]),
        ),
    ]
    for transform, expected in cases:
        np.testing.assert_allclose(jax.jit(transform(_guarded))(x), expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(jax.grad(_guarded)(x), np.sin(2 * xn), rtol=1e-5)  # eager
    # The check stays on the primal path of a derivative computation.
    with pytest.raises(CHECK_ERRORS, match="negative input"):
        jax.block_until_ready(jax.jit(jax.grad(_guarded))(-x))
    # Integer leaves (float0 tangents) are allowed.
    g = jax.grad(lambda s: error_if((s, jnp.arange(3)), s < 0, "m")[0] * 3.0)(1.0)
    assert g == 3.0


def test_error_if_in_loops():
    def body(c, _):
        c = error_if(c, c > 5, "carry too big: {c}", values={"c": c})
        return c + 1, c

    _, ys = jax.lax.scan(body, 0.0, None, length=5)
    np.testing.assert_array_equal(ys, np.arange(5.0))
    with pytest.raises(CHECK_ERRORS, match="carry too big: 6.0"):
        jax.block_until_ready(jax.lax.scan(body, 0.0, None, length=10))
    loop = jax.jit(
        lambda n: jax.lax.while_loop(
            lambda c: c < n, lambda c: error_if(c, c >= 3, "while body") + 1, 0
        )
    )
    assert loop(3) == 3
    with pytest.raises(CHECK_ERRORS, match="while body"):
        jax.block_until_ready(loop(5))


def test_error_if_concrete_pred_raises_eagerly():
    with pytest.raises(ImplicitDiffRuntimeError, match="eager failure"):
        error_if(jnp.ones(2), True, "eager failure")
    with pytest.raises(RuntimeError, match="bad value 2.50"):
        error_if(jnp.ones(2), np.array([False, True]), "bad value {v:.2f}", values={"v": 2.5})
    x = jnp.ones(2)
    assert error_if(x, False, "never") is x
    assert error_if(x, jnp.array([False, False]), "never") is x
    with pytest.raises(TypeError, match="`pred` must be boolean"):
        error_if(x, jnp.array([0, 1]), "m")
    with pytest.raises(TypeError, match="at least one array"):
        jax.jit(lambda p: error_if(None, p, "m"))(True)


# ---------------------------------------------------------------------------
# The docstring examples run.


def _examples():
    objects = [ls, error_if] + [getattr(ls, n) for n in ls.__all__ if callable(getattr(ls, n))]
    for obj in objects:
        for block in re.findall(r"```python\n(.*?)```", obj.__doc__ or "", re.S):
            name = getattr(obj, "__name__", "module")
            # Eager iterative solves compile their loops on first use: slow.
            marks = (
                [] if name in {"dense", "auto", "auto_method", "error_if"} else [pytest.mark.slow]
            )
            yield pytest.param(block, id=name, marks=marks)


@pytest.mark.parametrize("code", list(_examples()))
def test_docstring_examples(code):
    import textwrap

    exec(compile(textwrap.dedent(code), "<docstring>", "exec"), {})
