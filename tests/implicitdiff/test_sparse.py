"""`linear_solve.Sparse` and `sparsity_pattern`: a known pattern, a column colouring, a
bandwidth-reducing reordering, band LU.

The solves and every derivative are checked against NumPy's closed forms with the same
program as the other solvers (`test_linear_solvers._quantities`), on matrices whose
entries are scattered (so the reordering is what makes the band narrow) and whose
pivots need row interchanges. The pattern analysis is checked on its own: the
colouring is valid, the reordering finds the band of a shuffled band matrix.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from implicitdiff import linear_solve

from .test_banded import assert_batched_pytree_solves, assert_closed_forms

pytestmark = pytest.mark.usefixtures("fast_compiles")


def shuffled_band(n, lower, upper, seed):
    """A band matrix with its unknowns renumbered at random, and the permutation."""
    rng = np.random.default_rng(seed)
    a = np.zeros((n, n))
    for d in range(-lower, upper + 1):
        a += np.diag(rng.uniform(0.5, 1.5, n - abs(d)) * rng.choice([-1, 1], n - abs(d)), d)
    a += np.diag(0.1 * rng.uniform(size=n))  # small diagonal: pivoting swaps rows
    perm = rng.permutation(n)
    return a[np.ix_(perm, perm)], perm


@pytest.mark.parametrize("n, lower, upper", [(12, 2, 1), (9, 0, 2), (1, 0, 0)])
def test_against_closed_forms(x64, n, lower, upper):
    a, _ = shuffled_band(n, lower, upper, seed=n + lower)
    assert np.linalg.cond(a) < 1e5
    rng = np.random.default_rng(1)
    b, c = rng.normal(size=n), rng.normal(size=n)
    e = rng.normal(size=(n, n)) * (a != 0)  # stays in the pattern
    assert_closed_forms(linear_solve.Sparse(a != 0), "sparse", a, b, c, e)


def test_reordering_recovers_the_band():
    """A shuffled tridiagonal matrix goes back to bandwidth 1; 100 copies of a 3 x 3
    block stored field by field (unknown `i` of copy `k` at `100 i + k`, bandwidth
    200 as stored) to bandwidth 2."""
    a, _ = shuffled_band(50, 1, 1, seed=3)
    p = linear_solve.SparsityPattern(a != 0)
    assert (p.lower, p.upper) == (1, 1)
    assert sorted(p.order) == list(range(50))

    blocks = np.kron(np.ones((3, 3)), np.eye(100)) != 0
    p = linear_solve.SparsityPattern(blocks)
    assert max(p.lower, p.upper) <= 2
    assert p.num_colours == 3


def test_reordering_walks_narrow_and_wide_levels_alike(monkeypatch):
    """The reverse Cuthill-McKee search walks narrow levels node by node and wide ones
    with array operations: both give the same order (a shuffled line, a shuffled 3-D
    grid whose levels hold hundreds of unknowns, isolated unknowns, and no unknown)."""
    from implicitdiff.linear_solve import _sparse

    rng = np.random.default_rng(0)
    line = np.arange(2999)
    k = 12
    idx = np.arange(k**3).reshape(k, k, k)
    grid_rows = np.concatenate([idx[1:].ravel(), idx[:, 1:].ravel(), idx[:, :, 1:].ravel()])
    grid_cols = np.concatenate([idx[:-1].ravel(), idx[:, :-1].ravel(), idx[:, :, :-1].ravel()])
    cases = {
        "line": (3000, line, line + 1),
        "grid": (k**3, grid_rows, grid_cols),
        "isolated": (50, np.array([3, 7]), np.array([9, 40])),
        "empty": (0, np.zeros(0, int), np.zeros(0, int)),
    }
    for name, (n, rows, cols) in cases.items():
        shuffle = rng.permutation(n)
        pattern = (shuffle[rows], shuffle[cols])
        orders = []
        for small in (0, 10**9):  # every level by arrays, then every level node by node
            monkeypatch.setattr(_sparse, "_SMALL_LEVEL", small)
            orders.append(linear_solve.SparsityPattern(pattern, n).order)
        np.testing.assert_array_equal(orders[0], orders[1], err_msg=name)
        assert sorted(orders[0]) == list(range(n)), name
    shuffle = rng.permutation(3000)
    p = linear_solve.SparsityPattern((shuffle[line], shuffle[line + 1]), 3000)
    assert max(p.lower, p.upper) == 1  # back to a line
    empty = linear_solve.SparsityPattern(np.zeros((0, 0), bool))
    assert (empty.n, empty.nnz, empty.num_colours) == (0, 0, 0)


def test_colouring_is_valid_and_small():
    """No two columns of one colour share a row; the 5-point stencil on a periodic
    32 x 32 grid needs a handful of colours, not 1024."""
    k = 32
    idx = np.arange(k * k).reshape(k, k)
    rows, cols = [], []
    for di, dj in [(0, 0), (1, 0), (-1, 0), (0, 1), (0, -1)]:
        rows.append(idx.ravel())
        cols.append(np.roll(np.roll(idx, di, 0), dj, 1).ravel())
    p = linear_solve.SparsityPattern((np.concatenate(rows), np.concatenate(cols)))
    assert p.num_colours <= 10
    mask = np.zeros((k * k, k * k), bool)
    mask[p.rows, p.cols] = True
    for c in range(p.num_colours):
        assert mask[:, p.colours == c].sum(axis=1).max() <= 1
    assert p.lower <= 2 * k and p.upper <= 2 * k  # a reordered grid: about 2 k


def test_pattern_forms_compare_equal():
    mask = np.array([[0, 1, 0], [0, 0, 1], [1, 0, 0]], bool)
    from_mask = linear_solve.Sparse(mask)
    from_pairs = linear_solve.Sparse((np.array([0, 1, 2]), np.array([1, 2, 0])))
    assert from_mask == from_pairs and hash(from_mask) == hash(from_pairs)
    assert from_mask.pattern.nnz == 6  # the diagonal is added
    assert from_mask != linear_solve.Sparse(mask.T)
    assert from_mask.pattern.transposed() == linear_solve.SparsityPattern(mask.T)


def test_coupled_copies(x64):
    """`coupled(m)`: an `m x m` block wherever the matrix has an entry, copy `s` of
    unknown `i` at `[i, s]`; solves such a system exactly."""
    a, _ = shuffled_band(8, 1, 1, seed=4)
    coupled = linear_solve.Sparse(a != 0).coupled(3)
    mask = np.zeros((24, 24), bool)
    mask[coupled.pattern.rows, coupled.pattern.cols] = True
    np.testing.assert_array_equal(mask, np.kron((a != 0) | np.eye(8, dtype=bool), np.ones((3, 3))))
    rng = np.random.default_rng(2)
    blocks = rng.normal(size=(3, 3)) * 0.1
    big = np.kron(a, np.eye(3)) + np.kron(np.eye(8), blocks)
    b = rng.normal(size=(8, 3))
    x = coupled(lambda v: (jnp.asarray(big) @ v.ravel()).reshape(8, 3), jnp.asarray(b))
    np.testing.assert_allclose(np.asarray(x).ravel(), np.linalg.solve(big, b.ravel()), rtol=1e-10)


def test_batched_and_pytree(x64):
    a = np.stack([shuffled_band(7, 1, 2, seed=s)[0] for s in range(3)])
    assert_batched_pytree_solves(linear_solve.Sparse(np.any(a != 0, axis=0)), a)


def test_sparsity_pattern_of_a_function(x64):
    """The Jacobian pattern of a periodic reaction-diffusion right-hand side on a
    pytree state: each field at a point meets itself and its neighbours, and the
    other field at the same point."""

    def f(state):
        u, v = state["u"], state["v"]
        lap = lambda w: jnp.roll(w, 1) + jnp.roll(w, -1) - 2 * w  # noqa: E731
        return {"u": u * u * v + lap(u), "v": jnp.sin(u) - v + lap(v)}

    n = 10
    x = {"u": jnp.ones(n), "v": jnp.zeros(n)}
    pattern = linear_solve.sparsity_pattern(f, x, chunk=7)
    assert pattern.n == 2 * n
    got = np.zeros((2 * n, 2 * n), bool)
    got[pattern.rows, pattern.cols] = True
    ring = np.eye(n) + np.roll(np.eye(n), 1, 1) + np.roll(np.eye(n), -1, 1)
    expected = np.block([[ring, np.eye(n)], [np.eye(n), ring]]) != 0
    np.testing.assert_array_equal(got, expected)


def test_docstring_values(x64):
    def operator(v):
        return 2 * v - jnp.roll(v, -3) * (jnp.arange(6) < 3)

    solver = linear_solve.Sparse(linear_solve.sparsity_pattern(operator, jnp.zeros(6)))
    np.testing.assert_allclose(solver(operator, jnp.ones(6)), [0.75] * 3 + [0.5] * 3)
    assert solver.pattern.lower + solver.pattern.upper == 1
    assert linear_solve.sparsity_pattern(lambda v: v * jnp.roll(v, 1), jnp.ones(4)).nnz == 8


def test_detection_keeps_zero_states_and_domains_and_the_size(x64):
    """Probes move components that are exactly zero (ROBER at its initial state, where
    `y_2 y_3` has zero derivatives), keep small positive states positive (`sqrt`
    stays in its domain), and keep the last unknown when its row and column are
    empty; entries not finite at a probe are left out with a warning."""

    def rober(y):
        return jnp.stack([-0.04 * y[0] + 1e4 * y[1] * y[2], 3e7 * y[1] ** 2, y[2] * 0.0])

    p = linear_solve.sparsity_pattern(rober, jnp.array([1.0, 0.0, 0.0]))
    got = np.zeros((3, 3), bool)
    got[p.rows, p.cols] = True
    np.testing.assert_array_equal(got, [[1, 1, 1], [0, 1, 0], [0, 0, 1]])

    p = linear_solve.sparsity_pattern(lambda y: -jnp.sqrt(y) + jnp.roll(y, 1), jnp.full(6, 1e-3))
    assert p.nnz == 12

    p = linear_solve.sparsity_pattern(lambda y: y.at[-1].set(0.0) * 2.0, jnp.ones(5))
    assert p.n == 5
    with pytest.warns(UserWarning, match=r"not finite at the probe points"):
        p = linear_solve.sparsity_pattern(lambda y: jnp.sqrt(y - 1.0), jnp.ones(3))
    assert p.n == 3


def test_index_forms_and_large_indices():
    """`(rows, cols)` is a tuple of 1-D integer arrays (int32 ones too, beyond 46341
    unknowns, where `rows * n` would overflow int32); a square mask written as a tuple
    of tuples is a mask."""
    n = 50_000
    rows = np.array([n - 1, 0], np.int32)
    cols = np.array([0, n - 1], np.int32)
    p = linear_solve.SparsityPattern((rows, cols), n)
    assert p.rows.min() >= 0 and p.nnz == n + 2
    assert {(n - 1, 0), (0, n - 1)} <= set(zip(p.rows.tolist(), p.cols.tolist()))
    mask = linear_solve.SparsityPattern(((1, 0), (1, 1)))
    assert mask.n == 2 and mask.nnz == 3


def test_a_nearly_full_band_warns():
    rng = np.random.default_rng(0)
    with pytest.warns(UserWarning, match=r"as wide as half the matrix"):
        linear_solve.Sparse(rng.uniform(size=(300, 300)) < 0.05)


def test_missing_entries_raise_in_float32():
    """Row by row: one entry of size 1 outside the pattern of a 200-unknown
    tridiagonal matrix shows in float32 as well."""
    n = 200
    a = 4 * np.eye(n) - np.eye(n, k=1) - np.eye(n, k=-1)
    mask = a != 0
    a[150, 3] = 1.0
    op = lambda v: jnp.asarray(a, jnp.float32) @ v  # noqa: E731
    with pytest.raises((RuntimeError, ValueError), match=r"outside the given sparsity pattern"):
        jax.block_until_ready(linear_solve.Sparse(mask)(op, jnp.ones(n, jnp.float32)))
    with pytest.raises((RuntimeError, ValueError), match=r"outside this band"):
        jax.block_until_ready(linear_solve.Banded(1, 1)(op, jnp.ones(n, jnp.float32)))


def test_missing_entries_raise(x64):
    a = jnp.asarray(np.eye(6) + np.diag(np.ones(3), 3))
    with pytest.raises((RuntimeError, ValueError), match=r"outside the given sparsity pattern"):
        jax.block_until_ready(linear_solve.Sparse(np.eye(6))(lambda v: a @ v, jnp.ones(6)))
    x = linear_solve.Sparse(np.asarray(a) != 0)(lambda v: a @ v, jnp.ones(6))
    np.testing.assert_allclose(a @ x, np.ones(6), rtol=1e-13)


def test_bad_patterns():
    with pytest.raises(ValueError, match=r"`pattern` is required"):
        linear_solve.Sparse()
    with pytest.raises(ValueError, match=r"must be a square boolean array"):
        linear_solve.Sparse(np.ones((2, 3), bool))
    with pytest.raises(ValueError, match=r"indices outside"):
        linear_solve.SparsityPattern((np.array([0, 5]), np.array([0, 1])), size=3)
    with pytest.raises(ValueError, match=r"`pattern` is for 3 unknowns but the system has 4"):
        linear_solve.Sparse(np.eye(3, dtype=bool))(lambda v: v, jnp.ones(4))


def _copies_operator(sizes, seed=0):
    """A block-diagonal operator: independent groups of the given sizes, their
    unknowns scattered through the vector by a fixed permutation."""
    rng = np.random.default_rng(seed)
    n = sum(sizes)
    perm = rng.permutation(n)
    mats, groups, start = [], [], 0
    for s in sizes:
        mats.append(jnp.asarray(rng.normal(size=(s, s)) + 3 * np.eye(s)))
        groups.append(perm[start : start + s])
        start += s

    def operator(v):
        out = jnp.zeros_like(v)
        for m, g in zip(mats, groups, strict=True):
            out = out.at[g].add(m @ v[g])
        return out

    dense = np.zeros((n, n))
    for m, g in zip(mats, groups, strict=True):
        dense[np.ix_(g, g)] = np.asarray(m)
    return operator, dense, n


@pytest.mark.parametrize(
    "sizes", [[3] * 7, pytest.param([1, 2, 3, 8, 2], marks=pytest.mark.slow), [1] * 5]
)
def test_independent_groups_are_solved_as_blocks(x64, sizes):
    """Groups of at most `BLOCK_MAX` unknowns in any order are stored as dense blocks
    (padded to the largest) and solved, in both directions, as `numpy.linalg.solve`
    does; the gradient goes through the operator."""
    operator, dense, n = _copies_operator(sizes)
    solver = linear_solve.Sparse(np.abs(dense) > 0)
    assert solver.pattern.blocks.shape == (len(sizes), max(sizes))
    b = jnp.asarray(np.random.default_rng(1).normal(size=n))
    np.testing.assert_allclose(solver(operator, b), np.linalg.solve(dense, b), rtol=1e-12)
    state = solver.init(operator, b)
    np.testing.assert_allclose(
        solver.transpose_solve(state, b), np.linalg.solve(dense.T, b), rtol=1e-12
    )
    # The block solves and the pattern check are sums of elementwise products: no
    # reduction for XLA to hand to a threaded library. (These blocks are diagonally
    # dominant, so their rows are rarely swapped: the permutations are exercised by
    # `test_direct_solvers_take_complex_systems`, whose blocks pivot.)
    from implicitdiff.linear_solve._blocks import block_lu_solve, block_mismatch

    factors, blocks = solver.factors(state), solver.pattern.blocks
    for trans in (0, 1):
        solve = lambda b, trans=trans: block_lu_solve(factors, b, blocks, trans)  # noqa: E731
        assert "reduce" not in jax.jit(solve).lower(b).as_text()
    check = lambda b: block_mismatch(factors[0], b, b, blocks)  # noqa: E731
    assert "reduce_sum" not in jax.jit(check).lower(b).as_text()
    grad = jax.grad(lambda b: jnp.sum(jnp.sin(solver(operator, b))))(b)
    expected = np.linalg.solve(dense.T, np.cos(np.linalg.solve(dense, b)))
    np.testing.assert_allclose(grad, expected, rtol=1e-12)
    # Batched right-hand sides and matrices.
    scaled = lambda s: linear_solve.Sparse(solver.pattern)(lambda v: s * operator(v), b)  # noqa: E731
    out = jax.vmap(scaled)(jnp.array([1.0, 2.0]))
    np.testing.assert_allclose(out[1], np.linalg.solve(2 * dense, b), rtol=1e-12)


def test_blocks_need_small_independent_groups():
    """One group of more than `BLOCK_MAX` unknowns, or a single group, keeps the band
    storage."""
    assert linear_solve.SparsityPattern(np.abs(_copies_operator([3, 9])[1]) > 0).blocks is None
    assert linear_solve.SparsityPattern(np.ones((4, 4), bool)).blocks is None
    assert "blocks=(2, 3)" in repr(
        linear_solve.SparsityPattern(np.kron(np.eye(2), np.ones((3, 3))))
    )


def test_blocks_missing_entries_raise(x64):
    operator, dense, n = _copies_operator([3, 3, 3])
    pattern = np.abs(dense) > 0
    rows, cols = np.nonzero(pattern & ~np.eye(n, dtype=bool))
    pattern[rows[0], cols[0]] = False  # an entry of a block left out
    solver = linear_solve.Sparse(pattern)
    assert solver.pattern.blocks is not None
    with pytest.raises(Exception, match=r"outside the given sparsity pattern"):
        solver(operator, jnp.ones(n))


def test_blocks_are_not_padded_far_past_the_entries():
    """One group of 8 among many single unknowns would pad every block to 8 x 8: the
    band storage is kept."""
    mask = np.eye(200, dtype=bool)
    mask[:8, :8] = True
    assert linear_solve.SparsityPattern(mask).blocks is None
