"""Every `LinearSolver` of `linear_problems.SOLVERS` on every problem of its catalogue.

For each (solver, problem) pair one jitted program computes the one-shot solve, the
state-based solves (`init` once, then `solve` for two right-hand sides and
`transpose_solve`), and derivatives of each with respect to `b` and to the matrix the
operator closes over (grad, jacfwd, jvp, second order), and the test compares each with
its closed form from NumPy. The batch problem runs the same program under `jax.vmap`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

from implicitdiff import linear_solve

from .linear_problems import LinearProblem, cases, is_slow

pytestmark = pytest.mark.usefixtures("fast_compiles")


def _param(solver, problem):
    marks = [pytest.mark.slow] if is_slow(solver, problem) else []
    return pytest.param(solver, problem, id=f"{type(solver).__name__}-{problem.name}", marks=marks)


CASES = [_param(s, p) for s, p in cases()]


def _flat(tree):
    return ravel_pytree(tree)[0]


def _quantities(solver, problem, a, b, c, e):
    """Everything under test for one system `a x = b`, as flat arrays: `c` weighs the
    solution into a scalar, `e` is a direction in matrix space."""
    op = functools.partial(problem.operator, like=b)
    b2 = jax.tree_util.tree_map(jnp.cos, b)  # a second right-hand side

    def one_shot(a, b):
        return _flat(solver(op(a), b))

    def with_state(a, b, transposed=False):
        state = solver.init(op(a), b)
        method = solver.transpose_solve if transposed else solver.solve
        return _flat(method(state, b))

    flat_b, unravel = ravel_pytree(b)
    state = solver.init(op(a), jax.eval_shape(lambda: b))  # `b_like` may be abstract
    along = lambda f: lambda t: c @ f(a + t * e, b)  # noqa: E731
    return {
        "call": one_shot(a, b),
        "solve": _flat(solver.solve(state, b)),
        "solve_again": _flat(solver.solve(state, b2)),
        "transpose_solve": _flat(solver.transpose_solve(state, b)),
        "grad_b": _flat(jax.grad(lambda b: c @ one_shot(a, b))(b)),
        "grad_matrix": jax.grad(lambda a: c @ one_shot(a, b))(a),
        "grad_matrix_state": jax.grad(lambda a: c @ with_state(a, b))(a),
        "grad_matrix_transposed": jax.grad(lambda a: c @ with_state(a, b, True))(a),
        "jacfwd_b_state": jax.jacfwd(lambda fb: with_state(a, unravel(fb)))(flat_b),
        "jvp_matrix": jax.jvp(lambda a: one_shot(a, b), (a,), (e,))[1],
        "d2_state": jax.jacfwd(jax.grad(along(with_state)))(0.0),
        "d2_one_shot": jax.grad(jax.grad(along(one_shot)))(0.0),
    }


def _expected(a, b, c, e):
    """The closed forms of `_quantities`, with NumPy."""
    b, b2 = _flat(b), _flat(jax.tree_util.tree_map(np.cos, b))
    inv = np.linalg.inv(a)
    x, y, w = inv @ b, inv.T @ b, inv.T @ c
    return {
        "call": x,
        "solve": x,
        "solve_again": inv @ b2,
        "transpose_solve": y,
        "grad_b": w,
        "grad_matrix": -np.outer(w, x),
        "grad_matrix_state": -np.outer(w, x),
        "grad_matrix_transposed": -np.outer(y, inv @ c),
        "jacfwd_b_state": inv,
        "jvp_matrix": -inv @ e @ x,
        "d2_state": 2 * c @ inv @ e @ inv @ e @ x,
        "d2_one_shot": 2 * c @ inv @ e @ inv @ e @ x,
    }


def _element(k, t):
    """Element `k` of a batched result (`k` None: unbatched), as a NumPy array."""
    return np.asarray(t if k is None else t[k])


def _symmetric_part(m):
    return (m + m.T) / 2


def _data(problem: LinearProblem):
    a, b = problem.arrays()
    n = a.shape[-1]
    rng = np.random.default_rng(7)
    e = rng.normal(size=(n, n))
    if problem.symmetric:  # stay among the operators a symmetric solver is meant for
        e = _symmetric_part(e)
    return a, b, jnp.asarray(rng.normal(size=n)), jnp.asarray(e)


@pytest.mark.parametrize("solver, problem", CASES)
def test_solver_against_closed_forms(x64, solver, problem):
    a, b, c, e = _data(problem)
    run = functools.partial(_quantities, solver, problem)
    if problem.batched:
        run = jax.vmap(run, in_axes=(0, 0, None, None))
    got = jax.jit(run)(a, b, c, e)
    for k in range(a.shape[0] if problem.batched else 1):
        pick = functools.partial(_element, k if problem.batched else None)
        ak, bk = pick(a), jax.tree_util.tree_map(pick, b)
        want = _expected(ak, bk, np.asarray(c), np.asarray(e))
        for name, value in want.items():
            value_got = pick(got[name]).reshape(np.shape(value))
            if solver.symmetric and name == "grad_matrix_transposed":
                # A solver for symmetric operators solves with `A` for `A^T`: the two
                # derivatives agree along symmetric perturbations of the matrix only.
                value_got, value = _symmetric_part(value_got), _symmetric_part(value)
            np.testing.assert_allclose(
                value_got,
                value,
                rtol=1e-7,
                atol=1e-9,
                err_msg=f"{name} (batch element {k})",
            )


def test_catalogue_covers_every_registered_solver():
    from .linear_problems import SOLVERS

    assert {type(s) for s in SOLVERS} == set(linear_solve.SOLVERS.values())


@pytest.mark.parametrize(
    "solver",
    [
        linear_solve.Dense(),
        linear_solve.Banded(lower=1, upper=2),
        linear_solve.Sparse(np.tri(7, 7, 2, dtype=bool) & ~np.tri(7, 7, -2, dtype=bool)),
        linear_solve.GMRES(rtol=1e-12),
    ],
    ids=["dense", "banded", "sparse", "gmres"],
)
def test_factors_kept_apart_from_the_state_solve_alone(x64, solver):
    """`factors(state)` is a pytree of arrays that solves on its own, the same as
    `solve` (NumPy's solve of the matrix); a Krylov method keeps none."""
    n = 7
    a = 3.0 * np.eye(n) + np.diag(np.arange(1.0, n), -1) + np.diag(np.full(n - 1, 0.5), 1)
    a += np.diag(np.full(n - 2, -0.25), 2)
    b = np.linspace(-1.0, 2.0, n)
    state = solver.init(lambda v: jnp.asarray(a) @ v, jnp.zeros(n))
    factors = solver.factors(state)
    if isinstance(solver, linear_solve.GMRES):
        assert factors is None
        with pytest.raises(NotImplementedError, match="keeps no factors"):
            solver.solve_factors(factors, jnp.asarray(b))
        return
    assert all(isinstance(x, jax.Array) for x in jax.tree_util.tree_leaves(factors))
    kept = jax.jit(solver.solve_factors)(factors, jnp.asarray(b))
    np.testing.assert_allclose(kept, np.linalg.solve(a, b), rtol=1e-12)
    np.testing.assert_allclose(kept, solver.solve(state, jnp.asarray(b)), rtol=1e-14)
    kept_t = solver.solve_factors(factors, jnp.asarray(b), transpose=True)
    np.testing.assert_allclose(kept_t, np.linalg.solve(a.T, b), rtol=1e-12)


def _refined(a, b):
    """`a^{-1} b` to about `cond(a) * 1e-19`: LAPACK's solve refined with residuals in
    extended precision (`np.longdouble`, 80 bits on x86), an independent reference for
    the solves' rounding."""
    x = np.linalg.solve(a, b).astype(np.longdouble)
    al, bl = a.astype(np.longdouble), b.astype(np.longdouble)
    for _ in range(4):
        x = x + np.linalg.solve(a, (bl - al @ x).astype(np.float64)).astype(np.longdouble)
    return x


def _hard_matrices():
    """Stage matrices `I - 0.2 h J` of Robertson's kinetics (rates 0.04, 3e7, 1e4) at
    steps up to 1e6, matrices with condition numbers up to 1e12, a matrix whose rows
    and columns span twelve orders of magnitude, and Kahan's matrices (upper
    triangular, ill-conditioned without small pivots: the hard case for applying an
    inverse rather than substituting)."""
    rng = np.random.default_rng(3)
    out = []
    for h in (1e-3, 1.0, 1e4, 1e6):
        for y in ((1.0, 0.0, 0.0), (0.9, 3e-5, 0.1), (0.05, 2e-7, 0.95)):
            j = np.array(
                [
                    [-0.04, 1e4 * y[2], 1e4 * y[1]],
                    [0.04, -1e4 * y[2] - 6e7 * y[1], -1e4 * y[1]],
                    [0.0, 6e7 * y[1], 0.0],
                ]
            )
            out.append(np.eye(3) - 0.2 * h * j)
    for n in (8, linear_solve.SMALL_DENSE, linear_solve.SMALL_DENSE + 8):
        for cond in (1e4, 1e8, 1e12):
            q1, _ = np.linalg.qr(rng.normal(size=(n, n)))
            q2, _ = np.linalg.qr(rng.normal(size=(n, n)))
            out.append(q1 @ np.diag(np.logspace(0, -np.log10(cond), n)) @ q2)
        scale = np.diag(np.logspace(-6, 6, n)) @ (np.eye(n) + 0.1 * rng.normal(size=(n, n)))
        out.append(scale @ np.diag(np.logspace(3, -3, n)))
        for theta in (1.2, 0.5):
            s, c = np.sin(theta), np.cos(theta)
            kahan = np.diag(s ** np.arange(n)) @ (np.eye(n) - c * np.triu(np.ones((n, n)), 1))
            out.append(kahan @ np.diag(1 + 1e-10 * np.arange(n)))
    return out


def test_dense_solves_as_accurately_as_lapack(x64):
    """`Dense` keeps the inverses of its triangular factors up to `SMALL_DENSE`
    unknowns and the LU factors above; either way its solves and transposed solves
    are within a small factor of LAPACK's (`scipy.linalg.lu_solve`) against an
    extended-precision reference, on ill-conditioned and badly scaled matrices, with
    random right-hand sides and with `b = a x` (a solution much smaller than
    `|a^{-1}| |b|` on Kahan's matrices)."""
    import scipy.linalg

    solver = linear_solve.Dense()
    solve = jax.jit(solver.solve)
    transpose_solve = jax.jit(solver.transpose_solve)
    rng = np.random.default_rng(4)
    worst = 0.0
    for a in _hard_matrices():
        n = a.shape[0]
        state = solver.init(lambda v, a=jnp.asarray(a): a @ v, jnp.zeros(n))
        small = n <= linear_solve.SMALL_DENSE
        expected = linear_solve.InverseFactors if small else linear_solve.LUFactors
        assert isinstance(state.factors, expected)
        lu = scipy.linalg.lu_factor(a)
        for trans in (0, 1):
            a_t = a.T if trans else a
            rhs = (rng.normal(size=n), np.logspace(0, -8, n) * rng.normal(size=n))
            for b in (*rhs, a_t @ rng.normal(size=n)):
                ref = _refined(a_t, b)
                ours = (transpose_solve if trans else solve)(state, jnp.asarray(b))
                lapack = scipy.linalg.lu_solve(lu, b, trans=trans)
                err = lambda x: float(np.max(np.abs(np.asarray(x) - ref)) / np.max(np.abs(ref)))  # noqa: B023, E731
                # Within ten times LAPACK's own error, or of the bound a backward-stable
                # solve has, `cond(a) eps` (the inverse's products reach it on Kahan's
                # matrices with `b = a x`, where LAPACK does better than its bound).
                bound = max(err(lapack), np.linalg.cond(a) * np.finfo(float).eps)
                worst = max(worst, err(ours) / bound)
                assert err(ours) <= 10 * bound, (n, trans)
    print(f"largest error / bound: {worst:.2f}")


@pytest.mark.parametrize("form", ["inverse", "lu"])
def test_dense_factors_under_transformations(x64, monkeypatch, form):
    """Both factor forms (`InverseFactors`, and `LUFactors` with `SMALL_DENSE`
    lowered to 0) under `vmap` (a batch of matrices, and one matrix with a batch of
    right-hand sides), in the derivative with respect to the matrix
    (`d(a^{-1} b) = -a^{-1} da a^{-1} b`), and kept apart from the state."""
    from implicitdiff.linear_solve import _dense

    if form == "lu":
        monkeypatch.setattr(_dense, "SMALL_DENSE", 0)
    rng = np.random.default_rng(5)
    a = 4.0 * np.eye(5)[None] + rng.normal(size=(3, 5, 5))
    b = rng.normal(size=(3, 5))
    solver = linear_solve.Dense()

    def solve(a, b):
        return solver.solve(solver.init(lambda v: a @ v, b), b)

    batched = jax.jit(jax.vmap(solve))(jnp.asarray(a), jnp.asarray(b))
    np.testing.assert_allclose(batched, np.linalg.solve(a, b[..., None])[..., 0], rtol=1e-12)
    many = jax.vmap(solve, (None, 0))(jnp.asarray(a[0]), jnp.asarray(b))
    np.testing.assert_allclose(many, np.linalg.solve(a[0], b.T).T, rtol=1e-12)
    da = rng.normal(size=(5, 5))
    _, tangent = jax.jvp(
        lambda a: solve(a, jnp.asarray(b[0])), (jnp.asarray(a[0]),), (jnp.asarray(da),)
    )
    x = np.linalg.solve(a[0], b[0])
    np.testing.assert_allclose(tangent, -np.linalg.solve(a[0], da @ x), rtol=1e-11)
    state = solver.init(lambda v: jnp.asarray(a[0]) @ v, jnp.zeros(5))
    expected = linear_solve.InverseFactors if form == "inverse" else linear_solve.LUFactors
    assert isinstance(state.factors, expected)
    kept = solver.solve_factors(solver.factors(state), jnp.asarray(b[0]), transpose=True)
    np.testing.assert_allclose(kept, np.linalg.solve(a[0].T, b[0]), rtol=1e-12)
    if form == "inverse":
        with pytest.raises(TypeError, match="solver.factors"):
            solver.solve_factors(state.factors, jnp.asarray(b[0]))


def test_dense_with_no_unknowns():
    """A system of no unknowns: `init` factors the empty matrix, a solve returns `b`."""
    solver = linear_solve.Dense()
    b = {"a": jnp.zeros((0,)), "b": jnp.zeros((2, 0))}
    state = solver.init(lambda v: v, b)
    out = solver.solve(state, b)
    assert jax.tree_util.tree_map(jnp.shape, out) == {"a": (0,), "b": (2, 0)}
