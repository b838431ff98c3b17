"""`Banded`: a banded matrix, built from a few matvecs and factored once (band LU with
partial pivoting)."""

from __future__ import annotations

import abc
import dataclasses
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsp_linalg
import numpy as np
from jax.flatten_util import ravel_pytree

from .._errors import error_if
from .._per_element import in_batch
from .._trees import all_finite
from ..linear_system import custom_linear_solve
from . import _band_partitions
from ._band_rows import band_lu_rows, band_rows_solve
from ._base import MatVec, PyTree, as_operator
from ._checks import as_arrays, check_throw, prepare_b
from ._factored import Factored

__all__ = [
    "BandLU",
    "Banded",
    "BandedState",
    "BLOCKED_MIN_BANDWIDTH",
    "band_matrix",
    "band_lu",
    "band_lu_rows",
    "band_lu_blocks",
    "band_lu_solve",
    "rows_differ",
]

#: Bands with `max(lower, upper)` at least this are factored by blocks (`band_lu`).
#: Measured on CPU at 2048 unknowns: bandwidth 30 factors as fast either way and
#: solves 3.8x faster by blocks; bandwidth 126 factors 2.7x faster; bandwidth 2 is
#: faster row by row (2x to factor, 5x to solve).
BLOCKED_MIN_BANDWIDTH = 16


class BandedState(NamedTuple):
    """The state of `Banded` (and `Sparse`): the operator, and the band LU factors of
    its matrix, in one of three layouts (see `band_lu`).

    Narrow bands, one row at a time: `upper_rows[k]` holds `U[k, k : k + lower +
    upper + 1]`, `multipliers[k]` the multipliers of column `k` (rows `k + 1 .. k +
    lower` after the interchange) and `pivots[k]` the offset of the row swapped with
    row `k`. Wide bands, one block of `b` rows at a time: `upper_rows[i]` is the
    block row `i` of `U` (`b x 3b`), `multipliers[i]` the LU factors of the `2b x b`
    panel of step `i` and `pivots[i]` its row permutation. `Sparse` on independent
    small groups of unknowns (`SparsityPattern.blocks`): `upper_rows[k]` the LU factors
    of block `k`, `multipliers[k]` its row permutation as a one-hot matrix and
    `pivots[k]` as indices. Long narrow bands, by partitions of the rows
    (`band_lu_partitioned`): the first three fields hold the partitions' pivot rows,
    multipliers and pivots, and `reduced` the factors of the band that couples the
    partitions; `reduced` is empty in the other layouts. As for `Dense`, the solves'
    derivatives come from the operator, never from the factors.
    """

    operator: jax.tree_util.Partial
    upper_rows: jax.Array
    multipliers: jax.Array
    pivots: jax.Array
    reduced: tuple = ()


def band_matrix(flat_matvec, n: int, lower: int, upper: int, dtype) -> jax.Array:
    """The band of the `n x n` matrix of `flat_matvec` from `lower + upper + 1` matvecs.

    Columns `j` and `j'` with `j = j' mod (lower + upper + 1)` never meet in one row of a
    matrix of that band, so they are probed together (a column colouring): matvec `c`
    applies the matrix to the sum of the unit vectors of the columns of colour `c`.

    Returns:
        `ab` of shape `(n, lower + upper + 1)` with `ab[i, d] = A[i, i - lower + d]`
        (zero outside the matrix).
    """
    width = lower + upper + 1
    cols = jnp.arange(n)
    seeds = (cols[None, :] % width == jnp.arange(width)[:, None]).astype(dtype)
    compressed = jax.vmap(flat_matvec)(seeds)  # (width, n): row c = sum of columns c
    rows = jnp.arange(n)[:, None]
    j = rows - lower + jnp.arange(width)[None, :]
    ab = compressed[j % width, rows]
    return jnp.where((j >= 0) & (j < n), ab, 0)


def _row_sums(x: jax.Array) -> jax.Array:
    """`jnp.sum(x, axis=1)` for `x` of shape `(n, width)`, by adding halves: on CPU a
    sum over an axis is a reduction XLA hands to its multithreaded library, measured
    several times slower at 2048 x 5 (a banded line's check) and no quicker at 512 x
    125 (the reordered band of a 16 x 16 grid)."""
    width = x.shape[1]
    if width == 0:
        return jnp.zeros(x.shape[:1], x.dtype)
    while width > 1:
        half = (width + 1) // 2
        x = x[:, :half] + jnp.pad(x[:, half:], ((0, 0), (0, 2 * half - width)))
        width = half
    return x[:, 0]


def band_mismatch(ab: jax.Array, exact: jax.Array, probe: jax.Array, lower: int) -> jax.Array:
    """Whether the operator's matvec `exact` on `probe` differs from the stored
    matrix's by more than rounding in some row: the matrix misses entries (see
    `rows_differ`)."""
    n, width = ab.shape
    padded = jnp.pad(probe, (lower, width - lower - 1))
    windows = jnp.stack([padded[d : d + n] for d in range(width)], axis=1)  # probe[i - lower + d]
    stored = _row_sums(ab * windows)
    magnitude = _row_sums(jnp.abs(ab) * jnp.abs(windows))
    return rows_differ(exact, stored, magnitude, width)


#: Up to this many unknowns the band check's probe is a constant of the program.
_PROBE_CONSTANT_MAX = 1 << 16


def _probe(n: int, dtype) -> jax.Array:
    """The band check's probe, `cos(1.618 i + 0.5)`: a constant of the program up to
    `_PROBE_CONSTANT_MAX` unknowns, else computed behind an optimisation barrier.
    Computed and fused into the operator's matvec, the cosines were recomputed for
    each use (measured at 2048 unknowns: 65 us for a matvec of 5 us); a larger
    constant would swell the compiled program."""
    if n <= _PROBE_CONSTANT_MAX:
        return jnp.asarray(np.cos(np.arange(n) * 1.618 + 0.5), dtype)
    rdt = jnp.finfo(dtype).dtype
    probe = jnp.cos(jnp.arange(n, dtype=rdt) * 1.618 + 0.5)
    return jax.lax.optimization_barrier(probe).astype(dtype)


def rows_differ(exact: jax.Array, stored: jax.Array, magnitude: jax.Array, width: int):
    """Whether the operator's matvec `exact` on a probe differs from the stored
    matrix's, `stored`, by more than rounding in some row. Row `i` may differ by `1e3
    eps (width (|A| |probe|)_i + |exact_i|)` (`magnitude` is `|A| |probe|`), the
    rounding of either product; an entry outside the stored ones shows unless it is
    that small against its row (the probe's components are all of order one)."""
    eps = jnp.finfo(stored.dtype).eps
    slack = 1e3 * eps * (width * magnitude + jnp.abs(exact)) + jnp.finfo(stored.dtype).tiny
    return jnp.any(jnp.abs(exact - stored) > slack) & all_finite(exact)


def band_lu(ab: jax.Array, lower: int, upper: int):
    """LU factorisation with partial pivoting of the band `ab`: by partitions of the
    rows (`band_lu_partitioned`) for one long narrow band (see `partitions`), row by
    row (`band_lu_rows`) for other narrow bands, by blocks (`band_lu_blocks`) once
    `max(lower, upper) >= BLOCKED_MIN_BANDWIDTH`. `band_lu_solve` tells the layouts
    apart by the number of factors (four by partitions) and their rank.

    For each element of a batch (`in_batch`: `vmap` of `odeint`, or of a linear solve
    whose matrix is batched), a narrow band is factored row by row: the batch's
    elements are the lanes the partitions would make, at a third of the work
    (measured on CPU, 2048 unknowns, `lower = upper = 2`, a factorisation and a
    solve: 134 us per matrix row by row in a batch of 8 against 304 by partitions,
    98 against 548 in a batch of 64)."""
    parts = 1 if in_batch() else _band_partitions.partitions(ab.shape[0], lower, upper)
    if parts > 1:
        return tuple(_band_partitions.band_lu_partitioned(ab, lower, upper, parts))
    if ab.shape[0] > 0 and max(lower, upper) >= BLOCKED_MIN_BANDWIDTH:
        return band_lu_blocks(ab, lower, upper)
    return band_lu_rows(ab, lower, upper)


def band_lu_solve(factors, b: jax.Array, lower: int, trans: int = 0) -> jax.Array:
    """Solve `A x = b` (`trans=0`) or `A^T x = b` (`trans=1`) with the factors of
    `band_lu` (each a forward and a backward `lax.scan`)."""
    if len(factors) == 4 and factors[3]:
        return _band_partitions.partitioned_solve(
            _band_partitions.PartitionedFactors(*factors), b, lower, trans
        )
    if factors[0].ndim == 3:
        return _block_solve(factors, b, trans)
    return band_rows_solve(factors[:3], b, lower, trans)


def _block_rows(ab: jax.Array, lower: int, size: int) -> jax.Array:
    """The band as block rows of `size` rows: `R[i, a, q] = A[i size + a, (i - 1) size
    + q]` for `q < 3 size` (zero outside the band and the matrix; ones on the diagonal
    of the unknowns that pad `n` to a multiple of `size`)."""
    n, width = ab.shape
    blocks = -(-n // size)
    i = np.arange(blocks)[:, None, None]
    a = np.arange(size)[None, :, None]
    q = np.arange(3 * size)[None, None, :]
    r, c = i * size + a, (i - 1) * size + q
    d = c - r + lower
    inside = (d >= 0) & (d < width) & (c >= 0) & (c < n) & (r < n)
    values = ab[np.minimum(r, n - 1), np.clip(d, 0, width - 1)]
    return jnp.where(inside, values, 0) + ((r >= n) & (c == r)).astype(ab.dtype)


def band_lu_blocks(ab: jax.Array, lower: int, upper: int):
    """LU factorisation with partial pivoting of the band `ab`, by blocks of `b =
    max(lower, upper)` rows (so the matrix is block tridiagonal), one block column per
    step of a `lax.scan`.

    Step `i` stacks block row `i` as the earlier steps left it (block columns `i`,
    `i + 1`) over the original block row `i + 1` (block columns `i .. i + 2`), factors
    the `2b x b` panel of block column `i` with LAPACK (partial pivoting over every row
    that can hold a pivot there), applies its interchanges to the rest of the two
    block rows, and updates the lower one by a matrix product. Its `U` block row
    spans three block columns, since interchanges widen the band. The products run
    at the speed of dense linear algebra, which a row-by-row scan over a wide band
    does not reach.

    Returns:
        `(upper_rows, multipliers, pivots)` of shapes `(blocks, b, 3 b)`, `(blocks,
        2 b, b)` and `(blocks, 2 b)`, as in `BandedState`.
    """
    size = max(lower, upper)
    rows = _block_rows(ab, lower, size)
    below = jnp.concatenate([rows[1:], jnp.zeros((1, size, 3 * size), ab.dtype)])
    zeros = jnp.zeros((size, size), ab.dtype)

    def step(current, below):
        stacked = jnp.concatenate([jnp.concatenate([current, zeros], axis=1), below])
        lu, _, perm = jax.lax.linalg.lu(stacked[:, :size])
        stacked = stacked[perm]
        u12 = jsp_linalg.solve_triangular(
            lu[:size], stacked[:size, size:], lower=True, unit_diagonal=True
        )
        rest = stacked[size:, size:] - lu[size:] @ u12
        return rest, (jnp.concatenate([jnp.triu(lu[:size]), u12], axis=1), lu, perm)

    _, (upper_rows, multipliers, pivots) = jax.lax.scan(step, rows[0, :, size:], below)
    return upper_rows, multipliers, pivots.astype(jnp.int32)


def _block_solve(factors, b: jax.Array, trans: int) -> jax.Array:
    """`band_lu_solve` for the factors of `band_lu_blocks`."""
    upper_rows, multipliers, pivots = factors
    blocks, size, _ = upper_rows.shape
    n = b.size
    dt = jnp.result_type(upper_rows, b)
    bp = jnp.pad(b.astype(dt), (0, (blocks + 1) * size - n)).reshape(blocks + 1, size)

    def unit_lower(lu, v, trans=0):
        return jsp_linalg.solve_triangular(
            lu[:size], v, lower=True, unit_diagonal=True, trans=trans
        )

    if trans == 0:
        # y = M^{-1} b: each step permutes two blocks and eliminates the lower one.
        def fwd(top, x):
            lu, perm, below = x
            v = jnp.concatenate([top, below])[perm]
            y = unit_lower(lu, v[:size])
            return v[size:] - lu[size:] @ y, y

        _, y = jax.lax.scan(fwd, bp[0], (multipliers, pivots, bp[1:]))

        # x = U^{-1} y, from the last block up; U's block row reaches two blocks right.
        def bwd(right, x):
            u, yi = x
            xi = jsp_linalg.solve_triangular(u[:, :size], yi - u[:, size:] @ right)
            return jnp.concatenate([xi, right[:size]]), xi

        _, x = jax.lax.scan(bwd, jnp.zeros(2 * size, dt), (upper_rows, y), reverse=True)
        return x.reshape(-1)[:n]

    # z = U^{-T} b, pushing each block into the two blocks it reaches.
    def fwd_t(acc, x):
        u, bi = x
        zi = jsp_linalg.solve_triangular(u[:, :size], bi - acc[:size], trans=1)
        acc = jnp.concatenate([acc[size:], jnp.zeros(size, dt)]) + u[:, size:].T @ zi
        return acc, zi

    _, z = jax.lax.scan(fwd_t, jnp.zeros(2 * size, dt), (upper_rows, bp[:blocks]))

    # x = M^{-T} z, undoing the steps from the last one back.
    def bwd_t(below, x):
        lu, perm, zi = x
        top = unit_lower(lu, zi - lu[size:].T @ below, trans=1)
        v = jnp.zeros(2 * size, dt).at[perm].set(jnp.concatenate([top, below]))
        return v[:size], v[size:]

    first, rest = jax.lax.scan(bwd_t, jnp.zeros(size, dt), (multipliers, pivots, z), reverse=True)
    return jnp.concatenate([first, rest.reshape(-1)])[:n]


def _without_empty_reduced(factors: tuple) -> tuple:
    """The factors, without `BandedState.reduced` when the layout has none."""
    if isinstance(factors[-1], tuple) and not factors[-1]:
        return factors[:-1]
    return factors


class BandLU(Factored):
    """What `Banded` and `Sparse` share: the matrix in band storage (in the solver's
    own order of the unknowns), checked against one more matvec, factored by
    `band_lu` and solved by `band_lu_solve`.

    A subclass gives its bandwidths (`_widths`), builds the band from the flattened
    matvec (`_storage`), and may reorder the unknowns (`_reorder`: `(order,
    position)` with the band holding `A[order][:, order]`, `position` the inverse
    permutation) and check their number (`_check_size`). A subclass that stores its
    matrix otherwise replaces `_factor`, `_mismatch` and `_solve_factors`.
    """

    check: bool = True
    layout_bound: ClassVar[bool] = True

    @abc.abstractmethod
    def _widths(self) -> tuple[int, int]:
        """`(lower, upper)` of the stored band."""

    @abc.abstractmethod
    def _storage(self, flat_matvec, n: int, dtype) -> jax.Array:
        """The band of the matrix of `flat_matvec`, `(n, lower + upper + 1)`."""

    @abc.abstractmethod
    def _mirrored(self) -> BandLU:
        """The solver for the transposed operator."""

    @abc.abstractmethod
    def _outside_message(self) -> str:
        """The error of an operator with entries outside the stored ones."""

    def _reorder(self) -> tuple[np.ndarray, np.ndarray] | None:
        return None

    @property
    def factors_in_batches(self) -> bool:
        # The row-by-row factorisation of a narrow band batches well (one scan for the
        # batch); the blocked one of a wide band does not (see `LinearSolver`).
        return max(self._widths()) < BLOCKED_MIN_BANDWIDTH

    def factors_in_batches_at(self, n: int) -> bool:
        # One long narrow band is factored by partitions; a batch of them costs 2 to 5
        # times more per matrix (see `band_lu`).
        widths = self._widths()
        return self.factors_in_batches and _band_partitions.partitions(n, *widths) == 1

    def _check_size(self, n: int) -> None:
        del n

    def _band(self, matvec: MatVec, b_like: PyTree) -> jax.Array:
        flat, unravel = ravel_pytree(as_arrays(b_like))
        n, dt = flat.size, flat.dtype
        self._check_size(n)

        def flat_matvec(v):
            return ravel_pytree(matvec(unravel(v)))[0]

        ab = self._storage(flat_matvec, n, dt)
        if self.check and n > 0:
            probe = _probe(n, dt)
            exact = flat_matvec(probe)
            reorder = self._reorder()
            if reorder is not None:
                probe, exact = probe[reorder[0]], exact[reorder[0]]
            off = self._mismatch(ab, exact, probe)
            ab = error_if(ab, off, self._outside_message())
        return ab

    def init(self, matvec: MatVec, b_like: PyTree) -> BandedState:
        operator = as_operator(matvec, b_like)
        ab = jax.lax.stop_gradient(self._band(operator, b_like))
        return BandedState(operator, *self._factor(ab))

    def __call__(self, matvec: MatVec, b: PyTree) -> PyTree:
        b, size, _ = prepare_b(b, self.name)
        if size == 0:
            return b
        return custom_linear_solve(
            matvec, b, self._solve_once, transpose_solve=self._mirrored()._solve_once
        )

    def _solve_once(self, matvec: MatVec, b: PyTree) -> PyTree:
        factors = self._factor(self._band(matvec, b))
        return self._factor_solve(factors, 0, matvec, b)

    def _factor(self, storage: jax.Array):
        """The factors of the stored matrix (band LU)."""
        return band_lu(storage, *self._widths())

    def _mismatch(self, storage: jax.Array, exact: jax.Array, probe: jax.Array) -> jax.Array:
        """Whether the stored matrix misses entries of the operator (`band_mismatch`)."""
        return band_mismatch(storage, exact, probe, self._widths()[0])

    def _solve_factors(self, factors, b: jax.Array, trans: int) -> jax.Array:
        """`_apply` in the solver's own order of the unknowns."""
        return band_lu_solve(factors, b, self._widths()[0], trans)

    def factors(self, state: BandedState) -> tuple:
        return _without_empty_reduced(tuple(state[1:]))

    def _apply(self, factors, b: jax.Array, trans: int) -> jax.Array:
        factors = _without_empty_reduced(factors)
        # A reordered matrix is P A P^T, its transpose P A^T P^T: one reordering
        # serves both solves.
        reorder = self._reorder()
        if reorder is None:
            return self._solve_factors(factors, b, trans)
        order, position = reorder
        return self._solve_factors(factors, b[order], trans)[position]


@dataclasses.dataclass(frozen=True)
class Banded(BandLU):
    """Solve with a banded matrix: `A[i, j] = 0` unless `-lower <= j - i <= upper`.

    `init` builds the band from `lower + upper + 1` matvecs (columns that never share
    a row are probed together, so the cost does not grow with the size) and factors
    it by LU with partial pivoting; `solve` and `transpose_solve` reuse the factors.
    Cost for `n` unknowns: `O(n (lower + upper)^2)` time to factor, `O(n (lower +
    upper))` per solve and memory, against `O(n^3)` and `O(n^2)` for `Dense`. The
    factorisation and the solves are sequential scans, over the rows of a narrow band
    and over blocks of rows of a wide one (from `BLOCKED_MIN_BANDWIDTH` on; see
    `band_lu`), so a band is worth it from a few hundred unknowns on; below that
    `Dense` is faster. A long narrow band (see `_band_partitions.partitions`) is
    factored by partitions of its rows eliminated side by side, still with partial
    pivoting, in far fewer sequential steps (`band_lu_partitioned`); in a batch of
    solves, row by row (see `band_lu`).

    The unknowns are numbered as `jax.flatten_util.ravel_pytree` numbers them. A
    semi-discretised PDE on a line with `c` fields per grid point, stored point by
    point (an array of shape `(points, c)`), has `lower = upper = 2 c - 1` at most for
    nearest-neighbour coupling.

    A bandwidth that is too small would alias entries outside the band into it, so
    `init` checks the band against one more matvec, on a fixed vector, and raises if
    they differ (`check=False` skips this).

    Arguments:
        lower: the number of sub-diagonals (`>= 0`).
        upper: the number of super-diagonals (`>= 0`).
        throw: if True (default), raise at run time when the solution is not finite (a
            singular matrix). If False, return it as is.
        check: if True (default), check the bandwidths at `init`.

    Example:
        ```python
        import jax.numpy as jnp
        from implicitdiff import linear_solve

        def laplacian(v):  # tridiagonal: lower = upper = 1
            return 2 * v - jnp.pad(v[1:], (0, 1)) - jnp.pad(v[:-1], (1, 0))

        solver = linear_solve.Banded(lower=1, upper=1)
        x = solver(laplacian, jnp.ones(5))  # [2.5, 4., 4.5, 4., 2.5]
        ```
    """

    name: ClassVar[str] = "banded"
    lower: int = 0
    upper: int = 0
    throw: bool = True
    check: bool = True
    singular_message: ClassVar[str] = (
        "implicitdiff.linear_solve.Banded: the solution is not finite (NaN or inf), so "
        "the matrix is singular (or b is not finite). To fix it: make the system "
        "non-singular, check the inputs for NaN, or pass `throw=False` to skip this check."
    )

    def __post_init__(self):
        for arg in ("lower", "upper"):
            value = getattr(self, arg)
            if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 0:
                raise ValueError(
                    f"linear_solve.Banded: `{arg}` must be a Python int >= 0 (the number "
                    f"of {'sub' if arg == 'lower' else 'super'}-diagonals), got {value!r}"
                )
        check_throw(self.throw, self.name)

    def coupled(self, m: int) -> Banded:
        """The band of `m` coupled copies (see `LinearSolver.coupled`): unknown `i`'s
        copies are numbered `m i .. m i + m - 1`, so a coupling `j - i` in
        `[-lower, upper]` spans `m (j - i) - (m - 1) .. m (j - i) + m - 1`."""
        return dataclasses.replace(self, lower=m * self.lower + m - 1, upper=m * self.upper + m - 1)

    def _widths(self) -> tuple[int, int]:
        return self.lower, self.upper

    def _storage(self, flat_matvec, n: int, dtype) -> jax.Array:
        return band_matrix(flat_matvec, n, self.lower, self.upper, dtype)

    def _mirrored(self) -> Banded:
        # The transposed operator has the band mirrored.
        return dataclasses.replace(self, lower=self.upper, upper=self.lower)

    def _outside_message(self) -> str:
        return _OUTSIDE_BAND.format(lower=self.lower, upper=self.upper)


_OUTSIDE_BAND = (
    "implicitdiff.linear_solve.Banded(lower={lower}, upper={upper}): the operator has "
    "entries outside this band (its matvec on a test vector differs from the band's). "
    "To fix it: give the true bandwidths (for unknowns stored point by point with c "
    "fields each and nearest-neighbour coupling, lower = upper = 2c - 1), or use Dense "
    "or GMRES. Pass check=False to skip this check."
)
