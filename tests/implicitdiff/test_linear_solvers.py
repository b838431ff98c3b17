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


def _complex_band(n, lower, upper, seed):
    from .test_banded import band

    return band(n, lower, upper, seed) + 1j * band(n, lower, upper, seed + 1)


def _shuffled_band_for_sparse(n, seed):
    a = _complex_band(n, 2, 3, seed)
    order = np.random.default_rng(seed).permutation(n)
    a = a[order][:, order]
    return linear_solve.Sparse(np.nonzero(a)), a


def _blocks_for_sparse(sizes, seed):
    """Independent diagonal blocks stored interleaved: `Sparse` factors them as blocks."""
    n = sum(sizes)
    a = np.zeros((n, n), complex)
    start = 0
    for k, size in enumerate(sizes):
        a[start : start + size, start : start + size] = _complex_band(size, size, size, seed + k)
        start += size
    order = np.random.default_rng(seed).permutation(n)
    a = a[order][:, order]
    return linear_solve.Sparse(np.nonzero(a)), a


@pytest.mark.parametrize(
    "make",
    [
        lambda: (linear_solve.Dense(), _complex_band(4, 3, 3, 1)),  # substitution
        lambda: (linear_solve.Dense(), _complex_band(12, 11, 11, 2)),  # LAPACK
        lambda: (linear_solve.Banded(2, 1), _complex_band(30, 2, 1, 3)),  # row by row
        lambda: (linear_solve.Banded(17, 16), _complex_band(40, 17, 16, 4)),  # by blocks
        lambda: _shuffled_band_for_sparse(30, 5),  # reordered to a band
        lambda: _blocks_for_sparse([3, 2, 3, 3], 6),  # independent blocks
    ],
    ids=["dense-small", "dense", "banded-rows", "banded-blocks", "sparse", "sparse-blocks"],
)
def test_direct_solvers_take_complex_systems(x64, make):
    """The direct solvers (`solves_complex`) factor a complex matrix and solve with it
    and with its transpose (not the conjugate transpose), jitted and under `vmap`,
    agreeing with NumPy to rounding; the Krylov solvers say they do not."""
    solver, a = make()
    n = a.shape[0]
    assert solver.solves_complex
    b = np.cos(np.arange(n)) + 1j * np.sin(0.7 * np.arange(n))

    @jax.jit
    def solves(m, b):
        state = solver.init(functools.partial(jnp.matmul, m), b)
        return solver.solve(state, b), solver.transpose_solve(state, b)

    x, x_t = solves(jnp.asarray(a), jnp.asarray(b))
    assert x.dtype == jnp.complex128
    np.testing.assert_allclose(x, np.linalg.solve(a, b), rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(x_t, np.linalg.solve(a.T, b), rtol=1e-12, atol=1e-13)
    scaled = np.stack([a, a * (1 - 0.5j)])
    xs, xs_t = jax.vmap(solves, (0, None))(jnp.asarray(scaled), jnp.asarray(b))
    np.testing.assert_allclose(xs[1], np.linalg.solve(scaled[1], b), rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(xs_t[1], np.linalg.solve(scaled[1].T, b), rtol=1e-12, atol=1e-13)
    for krylov in (linear_solve.GMRES(), linear_solve.CG(), linear_solve.Auto()):
        assert not krylov.solves_complex


def _needs_pivoting(n: int, seed: int) -> np.ndarray:
    """A well-conditioned random matrix with a tiny diagonal and its rows shuffled, so
    that LU reorders the rows (in an order that is not its own inverse for some seeds,
    which tells `P` from `P^T`)."""
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(n, n)) + n * np.eye(n)
    a[np.arange(n), np.arange(n)] *= 1e-3
    return a[rng.permutation(n)]


def _kahan(n: int, seed: int) -> np.ndarray:
    """Kahan's upper triangular matrix (angle 0.5), with a random row order: ill
    conditioned (2e4 at n = 8, 9e4 at n = 9) in a way pivoting does not see."""
    s, c = np.sin(0.5), np.cos(0.5)
    k = np.diag(s ** np.arange(n)) @ (np.eye(n) - c * np.triu(np.ones((n, n)), 1))
    return k[np.random.default_rng(seed).permutation(n)]


# The sizes either side of each switch in the main suite; 1 and 3 with the slow one.
@pytest.mark.parametrize(
    "n", [*(pytest.param(k, marks=pytest.mark.slow) for k in (1, 3)), 4, 5, 8, 9]
)
@pytest.mark.parametrize("make", [_needs_pivoting, _kahan], ids=["pivoting", "kahan"])
def test_dense_solves_either_side_of_the_substitution_size(x64, n, make):
    """`Dense` solves small systems by written-out substitution and larger ones with
    LAPACK (`SUBSTITUTE_MAX`, `SUBSTITUTE_TRANSPOSE_MAX`): both agree with NumPy to
    `cond(A) eps` and with `jax.scipy.linalg.lu_solve` on the same factors to rounding, in float64
    and float32, for `A` and `A^T`, and under `vmap` with a different row order per
    element (batched factors and a shared right-hand side, and the reverse)."""
    from implicitdiff.linear_solve import _dense

    assert 4 <= _dense.SUBSTITUTE_TRANSPOSE_MAX <= _dense.SUBSTITUTE_MAX < 9
    a = make(n, 3)
    x = np.linspace(-1.0, 2.0, n)  # b = A x, so the error bound is cond(A) eps
    solver = linear_solve.Dense()
    for dtype, eps in [(np.float64, 2.2e-16), (np.float32, 1.2e-7)]:
        bound = 10 * n * np.linalg.cond(a) * eps
        matvec = functools.partial(jnp.matmul, jnp.asarray(a, dtype))
        state = solver.init(matvec, jnp.zeros(n, dtype))
        b, b_t = jnp.asarray(a @ x, dtype), jnp.asarray(a.T @ x, dtype)
        for trans, limit, method, rhs in [
            (0, _dense.SUBSTITUTE_MAX, solver.solve, b),
            (1, _dense.SUBSTITUTE_TRANSPOSE_MAX, solver.transpose_solve, b_t),
        ]:
            got = method(state, rhs)
            assert got.dtype == dtype
            assert np.max(np.abs(got - x)) <= bound * np.max(np.abs(x))
            lapack = jax.scipy.linalg.lu_solve((state.lu, state.pivots), rhs, trans=trans)
            scale = np.max(np.abs(lapack))
            assert np.max(np.abs(got - lapack)) <= 10 * n * np.linalg.cond(a) * eps * scale
            # The dispatch: written out up to the limit, LAPACK's triangular solves above,
            # with the row order the factorisation computed: no loop over the pivots
            # and no sort to invert them at each solve.
            lowered = jax.jit(method).lower(state, rhs).as_text()
            assert ("trsm" in lowered) == (n > limit), (trans, n)
            assert "stablehlo.sort" not in lowered, (trans, n)
            assert "stablehlo.while" not in lowered, (trans, n)
    # Batches: each element its own matrix, so its own pivots. Each direction is its
    # own program: two independent batched LAPACK calls in one can wait on each other
    # on two cores.
    batch = jnp.asarray(np.stack([make(n, seed) for seed in range(4)]))
    xs = np.cos(np.arange(4 * n)).reshape(4, n)
    bound = 20 * n * max(np.linalg.cond(m) for m in np.asarray(batch)) * 2.2e-16

    def solve(m, b, transposed):
        state = solver.init(functools.partial(jnp.matmul, m), b)
        return (solver.transpose_solve if transposed else solver.solve)(state, b)

    for transposed in (False, True):
        mats = jnp.swapaxes(batch, 1, 2) if transposed else batch
        rhs = jnp.einsum("kij,kj->ki", mats, xs)
        run = jax.jit(jax.vmap(functools.partial(solve, transposed=transposed)))
        np.testing.assert_allclose(run(batch, rhs), xs, rtol=0, atol=bound)
        # One right-hand side for every matrix.
        run_shared = jax.jit(
            jax.vmap(functools.partial(solve, transposed=transposed), in_axes=(0, None))
        )
        want = [np.linalg.solve(np.asarray(m), np.asarray(rhs[0])) for m in mats]
        np.testing.assert_allclose(run_shared(batch, rhs[0]), want, rtol=1e-10, atol=bound)
        # One matrix for every right-hand side.
        run_one = jax.jit(
            jax.vmap(functools.partial(solve, transposed=transposed), in_axes=(None, 0))
        )
        want = np.linalg.solve(np.asarray(mats[0]), np.asarray(rhs).T).T
        np.testing.assert_allclose(run_one(batch[0], rhs), want, rtol=1e-10, atol=bound)


def test_dense_solves_complex_systems_above_the_written_out_sizes(x64):
    """Above the written-out sizes `Dense` solves with LAPACK's triangular solves and
    its own row order: complex systems, one right-hand side, `A` and `A^T` (the
    transpose, not the conjugate transpose), against NumPy."""
    rng = np.random.default_rng(4)
    solver = linear_solve.Dense()
    for n in (9, 12):
        a = rng.normal(size=(n, n)) + 1j * rng.normal(size=(n, n))
        b = rng.normal(size=n) + 1j * rng.normal(size=n)
        state = solver.init(functools.partial(jnp.matmul, jnp.asarray(a)), jnp.zeros(n, a.dtype))
        got = solver.solve(state, jnp.asarray(b))
        got_t = solver.transpose_solve(state, jnp.asarray(b))
        np.testing.assert_allclose(got, np.linalg.solve(a, b), rtol=1e-11, atol=1e-12)
        np.testing.assert_allclose(got_t, np.linalg.solve(a.T, b), rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.complex128])
def test_unrolled_lu_gives_lapacks_factors(x64, n, dtype):
    """Up to `UNROLLED_LU_MAX` unknowns the LU factors are written out entry by entry,
    over a batch at once: on random matrices, the same row exchanges as LAPACK's
    `getrf` (the first largest magnitude, `|re| + |im|` for complex) and the same
    factors to rounding; on integer matrices (ties: rounding may then pick another
    row), `L U = A[perm]` with every multiplier at most 1 in magnitude (sqrt 2 for
    complex) and the first exchange by LAPACK's rule; with a zero column (singular),
    finite factors with a zero pivot, as LAPACK's. `Dense` and the sparse solver's
    blocks use them up to that size and LAPACK above it."""
    from implicitdiff.linear_solve import _blocks, _dense
    from implicitdiff.linear_solve._unrolled import UNROLLED_LU_MAX, unrolled_lu

    assert UNROLLED_LU_MAX == 4
    rng = np.random.default_rng(n)
    a = rng.normal(size=(2, 40, n, n))
    if dtype == np.complex128:
        a = a + 1j * rng.normal(size=a.shape)
    a[:, 20:] = np.round(3 * a[:, 20:])
    a[:, 35:, :, 0] = 0
    a = jnp.asarray(a.astype(dtype))
    lu, pivots, perm = jax.jit(unrolled_lu)(a)
    want_lu, want_pivots, want_perm = jax.lax.linalg.lu(a)
    assert lu.dtype == a.dtype and pivots.dtype == perm.dtype == jnp.int32
    eps = np.finfo(dtype).eps
    lu, want_lu, perm, a = (np.asarray(x) for x in (lu, want_lu, perm, a))
    scale = np.maximum(np.max(np.abs(a), axis=(-2, -1), keepdims=True), 1)
    random = slice(0, 20)
    np.testing.assert_array_equal(pivots[:, random], want_pivots[:, random])
    np.testing.assert_array_equal(perm[:, random], want_perm[:, random])
    err = (
        np.abs(lu - want_lu)[:, random]
        / np.max(np.abs(want_lu), axis=(-2, -1))[:, random, None, None]
    )
    assert np.max(err) < 20 * n * eps
    # Every matrix: P A = L U, |L| <= 1, finite factors.
    lower = np.tril(lu, -1) + np.eye(n)
    upper = np.triu(lu)
    rows = np.take_along_axis(a, perm[..., None], axis=-2)
    assert np.max(np.abs(lower @ upper - rows) / scale) < 20 * n * eps
    # (For complex the pivot's |re| + |im| is largest, so its modulus is within sqrt 2.)
    bound = np.sqrt(2) if dtype == np.complex128 else 1
    assert np.max(np.abs(np.tril(lu, -1))) <= bound * (1 + eps) and np.isfinite(lu).all()
    # The first exchange: the first largest magnitude (NumPy's argmax takes the first).
    column = np.abs(a[..., :, 0].real) + np.abs(a[..., :, 0].imag)
    np.testing.assert_array_equal(pivots[..., 0], np.argmax(column, axis=-1))
    assert (lu[:, 35:, 0, 0] == 0).all() and (want_lu[:, 35:, 0, 0] == 0).all()
    # The dispatch: written out up to the limit, LAPACK above it.
    for size in (UNROLLED_LU_MAX, UNROLLED_LU_MAX + 1):
        m = jnp.eye(size, dtype=dtype)
        dense = jax.jit(_dense._factor).lower(m).as_text()
        blocks = jax.jit(_blocks.block_lu).lower(jnp.stack([m, m])).as_text()
        assert ("getrf" in dense) == ("getrf" in blocks) == (size > UNROLLED_LU_MAX)
