"""`linear_solve.Banded`: band LU with partial pivoting, built from a few matvecs.

The solves and every derivative are checked against NumPy's closed forms with the same
program as the other solvers (`test_linear_solvers._quantities`), on band matrices
whose pivots need row interchanges, for every shape of band (none below, none above,
wider than the matrix), batched under `vmap` and on a pytree right-hand side.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from implicitdiff import linear_solve

from .linear_problems import LinearProblem
from .test_linear_solvers import _expected, _quantities

pytestmark = pytest.mark.usefixtures("fast_compiles")


def band(n, lower, upper, seed):
    """A random band matrix with a small diagonal (so partial pivoting swaps rows),
    well conditioned enough for tight comparisons."""
    rng = np.random.default_rng(seed)
    a = np.zeros((n, n))
    for d in range(-lower, upper + 1):
        if abs(d) < n:
            a += np.diag(rng.uniform(0.5, 1.5, n - abs(d)) * rng.choice([-1, 1], n - abs(d)), d)
    a += np.diag(0.1 * rng.uniform(size=n))
    return a


def band_mask(n, lower, upper):
    i, j = np.indices((n, n))
    return ((j - i) >= -lower) & ((j - i) <= upper)


def assert_closed_forms(solver, kind, a, b, c, e):
    """Every quantity of `test_linear_solvers._quantities` (solves, transposed solves,
    derivatives) of `solver` on the matrix `a` against NumPy's closed forms."""
    problem = LinearProblem(kind, a, b, False)
    got = jax.jit(functools.partial(_quantities, solver, problem))(
        jnp.asarray(a), jnp.asarray(b), jnp.asarray(c), jnp.asarray(e)
    )
    for name, value in _expected(a, b, c, e).items():
        np.testing.assert_allclose(
            np.asarray(got[name]).reshape(np.shape(value)), value, rtol=1e-9, atol=1e-11,
            err_msg=name,
        )  # fmt: skip


@pytest.mark.parametrize(
    "n, lower, upper", [(9, 2, 1), (8, 0, 2), (8, 3, 0), (7, 1, 1), (4, 5, 6), (1, 0, 0)]
)
def test_against_closed_forms(x64, n, lower, upper):
    a = band(n, lower, upper, seed=n + 10 * lower + 100 * upper)
    assert np.linalg.cond(a) < 1e4
    rng = np.random.default_rng(1)
    b = rng.normal(size=n)
    c = rng.normal(size=n)
    e = rng.normal(size=(n, n)) * band_mask(n, lower, upper)  # stays in the band
    assert_closed_forms(linear_solve.Banded(lower=lower, upper=upper), "band", a, b, c, e)


def assert_batched_pytree_solves(solver, a):
    """`solver` under `vmap` over the matrices `a` (a stack of three 7 x 7), on a
    pytree right-hand side, against NumPy."""
    b = {"p": np.arange(3.0), "q": np.ones((2, 2))}
    problem = LinearProblem("structured", a[0], b, False)

    def solve(a):
        return solver(problem.operator(a, b), jax.tree_util.tree_map(jnp.asarray, b))

    got = jax.vmap(solve)(jnp.asarray(a))
    flat_b = np.concatenate([b["p"], b["q"].ravel()])
    for k in range(3):
        x = np.linalg.solve(a[k], flat_b)
        np.testing.assert_allclose(got["p"][k], x[:3], rtol=1e-12)
        np.testing.assert_allclose(got["q"][k].ravel(), x[3:], rtol=1e-12)


def test_batched_and_pytree(x64):
    a = np.stack([band(7, 1, 2, seed=s) for s in range(3)])
    assert_batched_pytree_solves(linear_solve.Banded(lower=1, upper=2), a)


def test_large_band_matches_dense(x64):
    """A long band (the scans run over many rows) with a nearly singular leading
    block, so rows are swapped all along."""
    n, lower, upper = 300, 3, 2
    a = band(n, lower, upper, seed=5)
    b = np.sin(np.arange(n))
    x = linear_solve.Banded(lower, upper)(lambda v: jnp.asarray(a) @ v, jnp.asarray(b))
    xt = linear_solve.Banded(lower, upper).transpose_solve(
        linear_solve.Banded(lower, upper).init(lambda v: jnp.asarray(a) @ v, jnp.asarray(b)),
        jnp.asarray(b),
    )
    scale = np.abs(a).max() * np.abs(np.asarray(x)).max()
    assert np.abs(a @ np.asarray(x) - b).max() <= 1e-13 * n * scale
    assert (
        np.abs(a.T @ np.asarray(xt) - b).max()
        <= 1e-13 * n * np.abs(a).max() * np.abs(np.asarray(xt)).max()
    )


def test_laplacian_docstring_value(x64):
    def laplacian(v):
        return 2 * v - jnp.pad(v[1:], (0, 1)) - jnp.pad(v[:-1], (1, 0))

    x = linear_solve.Banded(lower=1, upper=1)(laplacian, jnp.ones(5))
    np.testing.assert_allclose(x, [2.5, 4.0, 4.5, 4.0, 2.5], rtol=1e-13)


def test_entries_outside_the_band_raise(x64):
    a = jnp.asarray(np.eye(6) + np.diag(np.ones(4), 2))  # upper bandwidth 2, not 1
    with pytest.raises((RuntimeError, ValueError), match=r"outside this band"):
        jax.block_until_ready(linear_solve.Banded(1, 1)(lambda v: a @ v, jnp.ones(6)))
    x = linear_solve.Banded(1, 2)(lambda v: a @ v, jnp.ones(6))
    np.testing.assert_allclose(a @ x, np.ones(6), rtol=1e-13)


@pytest.mark.parametrize("width", [0, 1, 2, 3, 5, 8, 9, 17, 125])
def test_row_sums_of_every_width(x64, width):
    """The band check's row sums (halves added, no reduction) equal NumPy's."""
    from implicitdiff.linear_solve._banded import _row_sums

    x = np.random.default_rng(width).standard_normal((7, width))
    np.testing.assert_allclose(_row_sums(jnp.asarray(x)), x.sum(axis=1), rtol=1e-14, atol=1e-14)
    hlo = jax.jit(_row_sums).lower(jnp.asarray(x)).as_text()
    assert "reduce" not in hlo


@pytest.mark.parametrize("lower, upper", [(0, 0), (1, 2), (2, 2), (8, 8), (20, 12)])
def test_band_check_finds_one_entry_outside(x64, lower, upper):
    """`band_mismatch` passes the exact band and flags a single entry just outside
    it, in any row."""
    from implicitdiff.linear_solve._banded import band_matrix, band_mismatch

    n = 40
    a = band(n, lower, upper, seed=lower + upper)
    probe = np.cos(np.arange(n) * 1.618 + 0.5)
    ab = band_matrix(lambda v: jnp.asarray(a) @ v, n, lower, upper, jnp.float64)
    assert not bool(band_mismatch(ab, jnp.asarray(a @ probe), jnp.asarray(probe), lower))
    for row in (0, n // 2, n - upper - 2):
        outside = a.copy()
        outside[row, row + upper + 1] = 1e-3
        exact = jnp.asarray(outside @ probe)
        assert bool(band_mismatch(ab, exact, jnp.asarray(probe), lower))


def test_band_check_with_a_computed_probe(x64, monkeypatch):
    """Above `_PROBE_CONSTANT_MAX` unknowns the probe is computed in the program (here
    from 9 on): the check still passes the true band and catches a missing one."""
    import implicitdiff.linear_solve._banded as banded

    monkeypatch.setattr(banded, "_PROBE_CONSTANT_MAX", 8)
    a = jnp.asarray(np.eye(12) * 3 + np.diag(np.ones(10), 2))
    x = linear_solve.Banded(0, 2)(lambda v: a @ v, jnp.ones(12))
    np.testing.assert_allclose(a @ x, np.ones(12), rtol=1e-13)
    with pytest.raises((RuntimeError, ValueError), match=r"outside this band"):
        jax.block_until_ready(linear_solve.Banded(0, 1)(lambda v: a @ v, jnp.ones(12)))


def test_singular_raises_unless_throw_false(x64):
    a = jnp.asarray(np.diag([1.0, 0.0, 2.0]))
    with pytest.raises((RuntimeError, ValueError), match=r"not finite"):
        jax.block_until_ready(linear_solve.Banded(0, 0)(lambda v: a @ v, jnp.ones(3)))
    x = linear_solve.Banded(0, 0, throw=False)(lambda v: a @ v, jnp.ones(3))
    assert not np.all(np.isfinite(np.asarray(x)))


@pytest.mark.parametrize("bad", [dict(lower=-1), dict(upper=1.5), dict(lower=True)])
def test_invalid_bandwidths(bad):
    with pytest.raises(ValueError, match=r"`(lower|upper)` must be a Python int >= 0"):
        linear_solve.Banded(**bad)


@pytest.mark.parametrize(
    "n, lower, upper",
    [
        (70, 16, 3),  # several blocks
        pytest.param(61, 2, 17, marks=pytest.mark.slow),
        pytest.param(40, 20, 20, marks=pytest.mark.slow),
        pytest.param(16, 16, 16, marks=pytest.mark.slow),
        (5, 16, 0),
    ],
)
def test_blocked_factorisation_of_wide_bands(x64, n, lower, upper):
    """Wide bands are factored by blocks (`band_lu_blocks`); both layouts solve with
    the matrix and its transpose to rounding, on matrices whose pivots swap rows, and
    `n` not a multiple of the block size."""
    from implicitdiff.linear_solve._banded import (
        BLOCKED_MIN_BANDWIDTH,
        band_lu_blocks,
        band_lu_rows,
        band_lu_solve,
        band_matrix,
    )

    assert max(lower, upper) >= BLOCKED_MIN_BANDWIDTH
    a = band(n, lower, upper, seed=n)
    ab = band_matrix(lambda v: jnp.asarray(a) @ v, n, lower, upper, jnp.float64)
    b = np.cos(np.arange(n))
    for factors in (band_lu_blocks(ab, lower, upper), band_lu_rows(ab, lower, upper)):
        for trans, m in ((0, a), (1, a.T)):
            x = np.asarray(band_lu_solve(factors, jnp.asarray(b), lower, trans))
            np.testing.assert_allclose(x, np.linalg.solve(m, b), rtol=1e-9, atol=1e-10)
    assert band_lu_blocks(ab, lower, upper)[0].ndim == 3
    x = linear_solve.Banded(lower, upper)(lambda v: jnp.asarray(a) @ v, jnp.asarray(b))
    np.testing.assert_allclose(x, np.linalg.solve(a, b), rtol=1e-9, atol=1e-10)


def test_factors_in_batches_follows_the_factorisation():
    """A narrow band (factored row by row) and small blocks batch well under `vmap`; a
    wide band's blocked factorisation does not (`LinearSolver.factors_in_batches`)."""
    from implicitdiff.linear_solve._banded import BLOCKED_MIN_BANDWIDTH as WIDE

    assert linear_solve.Dense().factors_in_batches
    assert linear_solve.Banded(2, 2).factors_in_batches
    assert linear_solve.Banded(WIDE - 1, 3).factors_in_batches
    assert not linear_solve.Banded(0, WIDE).factors_in_batches
    assert not linear_solve.Banded(2, 2).coupled(8).factors_in_batches  # widened to 23
    line = np.arange(200)
    pairs = linear_solve.Sparse((np.r_[line, line[1:]], np.r_[line, line[:-1]]))
    assert pairs.pattern.lower == 1 and pairs.factors_in_batches
    # 100 independent pairs, factored as blocks (reordered, a band of 1 each side).
    blocks = linear_solve.Sparse((line, line ^ 1))
    assert blocks.pattern.blocks is not None and blocks.factors_in_batches
    # A periodic 10 x 20 grid's 5-point stencil: no narrow band after reordering.
    grid = line.reshape(10, 20)
    near = [np.roll(grid, s, a).ravel() for s in (1, -1) for a in (0, 1)]
    stencil = linear_solve.Sparse((np.tile(line, 5), np.concatenate([line, *near])))
    assert stencil.pattern.blocks is None
    assert max(stencil.pattern.lower, stencil.pattern.upper) >= WIDE
    assert not stencil.factors_in_batches


def test_wide_band_on_no_unknowns(x64):
    solver = linear_solve.Banded(16, 16)
    state = solver.init(lambda v: v, jnp.zeros(0))
    assert solver.solve(state, jnp.zeros(0)).shape == (0,)


@pytest.mark.parametrize(
    "n, lower, upper, parts",
    [
        (64, 2, 2, 4),
        (67, 2, 2, 4),  # n not a multiple of the partitions
        (100, 1, 1, 5),
        (90, 0, 3, 3),
        (90, 3, 0, 3),
        (50, 1, 0, 3),
        (50, 0, 1, 3),
        (200, 3, 3, 8),
        (1030, 2, 2, 32),
    ],
)
def test_partitioned_factorisation_of_long_bands(x64, n, lower, upper, parts):
    """Long narrow bands are factored by partitions of their rows
    (`band_lu_partitioned`): the solves with the matrix and its transpose agree with
    NumPy's, and with the row-by-row factors', on matrices whose pivots swap rows
    (also across the partitions' boundaries), in real and complex arithmetic."""
    from implicitdiff.linear_solve._band_partitions import (
        band_lu_partitioned,
        partitioned_solve,
    )
    from implicitdiff.linear_solve._banded import band_lu_rows, band_lu_solve, band_matrix

    a = band(n, lower, upper, seed=n + lower)
    if min(lower, upper) == 0:  # triangular: kept well conditioned by its diagonal
        a += 4 * np.eye(n)
    assert np.linalg.cond(a) < 1e6
    b = np.cos(1.3 * np.arange(n))
    for dtype, m in ((np.float64, a), (np.complex128, a + 0.5j * band(n, lower, upper, 7))):
        ab = band_matrix(lambda v, m=m: jnp.asarray(m) @ v, n, lower, upper, dtype)
        factors = band_lu_partitioned(ab, lower, upper, parts)
        assert factors.rows.shape == (
            -(-n // parts) - lower - upper,
            2 * (lower + upper) + 1,
            parts,
        )
        rows = band_lu_rows(ab, lower, upper)
        for trans, mt in ((0, m), (1, m.T)):
            x = np.asarray(partitioned_solve(factors, jnp.asarray(b, dtype), lower, trans))
            np.testing.assert_allclose(x, np.linalg.solve(mt, b), rtol=1e-10, atol=1e-12)
            by_rows = band_lu_solve(rows, jnp.asarray(b, dtype), lower, trans)
            np.testing.assert_allclose(x, by_rows, rtol=1e-10, atol=1e-12)


def test_partitioned_factorisation_without_a_diagonal(x64):
    """A tridiagonal matrix with a zero diagonal (non-singular for an even size):
    every pivot swaps rows, and a scheme that factored each partition's diagonal
    block on its own would meet singular blocks; partial pivoting over each
    partition's rows does not."""
    from implicitdiff.linear_solve._band_partitions import (
        band_lu_partitioned,
        partitioned_solve,
    )
    from implicitdiff.linear_solve._banded import band_matrix

    n = 256
    rng = np.random.default_rng(4)
    a = np.diag(rng.uniform(1, 2, n - 1), 1) + np.diag(rng.uniform(1, 2, n - 1), -1)
    assert abs(np.linalg.slogdet(a)[0]) == 1 and np.linalg.cond(a) < 1e6
    ab = band_matrix(lambda v: jnp.asarray(a) @ v, n, 1, 1, jnp.float64)
    factors = band_lu_partitioned(ab, 1, 1, 8)
    b = np.cos(np.arange(n))
    for trans, m in ((0, a), (1, a.T)):
        x = partitioned_solve(factors, jnp.asarray(b), 1, trans)
        np.testing.assert_allclose(x, np.linalg.solve(m, b), rtol=1e-10, atol=1e-12)


def test_partitions_follow_the_band():
    """`band_lu` partitions a band of at most `PARTITIONED_MAX_COUPLING` coupled
    diagonals once each of 32 partitions (64 from 8192 rows) holds `4 (lower + upper)`
    rows; partitions too short for the band are refused."""
    from implicitdiff.linear_solve._band_partitions import (
        PARTITIONED_MAX_COUPLING,
        band_lu_partitioned,
        partitions,
    )

    assert partitions(2048, 2, 2) == 32 and partitions(8192, 1, 1) == 64
    assert partitions(511, 2, 2) == 1 and partitions(512, 2, 2) == 32
    assert partitions(1 << 16, 0, 0) == 1
    assert partitions(1 << 16, PARTITIONED_MAX_COUPLING, 1) == 1
    with pytest.raises(ValueError, match="more than lower"):
        band_lu_partitioned(jnp.ones((20, 5)), 2, 2, 4)


def test_long_band_solves_and_derivatives(x64, monkeypatch):
    """`Banded` on a long narrow band (factored by partitions): the solves, the
    transposed solves and every derivative against NumPy's closed forms; under `vmap`
    over the matrix, factored row by row."""
    from implicitdiff.linear_solve import _band_partitions

    calls = []
    factor = _band_partitions.band_lu_partitioned
    monkeypatch.setattr(
        _band_partitions, "band_lu_partitioned", lambda *a: calls.append(1) or factor(*a)
    )
    n, lower, upper = 700, 2, 2
    a = band(n, lower, upper, seed=3)
    assert np.linalg.cond(a) < 1e4
    rng = np.random.default_rng(2)
    b, c = rng.normal(size=n), rng.normal(size=n)
    e = rng.normal(size=(n, n)) * band_mask(n, lower, upper)
    solver = linear_solve.Banded(lower=lower, upper=upper)
    state = solver.init(lambda v: jnp.asarray(a) @ v, jnp.asarray(b))
    assert state.reduced  # factored by partitions
    assert_closed_forms(solver, "band", a, b, c, e)
    assert calls
    calls.clear()
    stack = np.stack([a, band(n, lower, upper, seed=4)])
    x = jax.vmap(lambda m: solver(lambda v: m @ v, jnp.asarray(b)))(jnp.asarray(stack))
    assert not calls
    for k in range(2):
        np.testing.assert_allclose(x[k], np.linalg.solve(stack[k], b), rtol=1e-10, atol=1e-12)
