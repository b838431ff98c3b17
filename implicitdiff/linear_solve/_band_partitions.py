"""Band LU of a long narrow band by partitions: Gaussian elimination with partial
pivoting on the columns reordered, so that `p` partitions of the rows are eliminated
side by side (lanes of one `lax.scan` of `n / p` steps) and only a small band of
`(p + 1) (lower + upper)` unknowns is left to a sequential factorisation.

With `k = lower + upper`, partition `i` holds the rows `s = i m .. s + m - 1` (`m`
rows). Its columns `s + upper .. s + m - lower - 1` (its interior) have entries in
those rows only; the `k` columns `s - lower .. s + upper - 1` between partition `i -
1` and `i` (the separator `G_{i-1}`) are shared. Ordering every interior before every
separator, Gaussian elimination with partial pivoting runs partition by partition
with no exchange of rows between partitions (a pivot for an interior column can only
come from its own partition), and leaves `k` rows per partition with entries in the
two separators around it: a band of the separators' unknowns with `lower + k - 1`
sub- and `upper + k - 1` super-diagonals, factored row by row. The whole is `P A Q
= L U` with ordinary partial pivoting on `A Q`, so it is as safe as band LU itself:
nothing breaks down where `A` is nonsingular (a partitioned scheme that factors each
diagonal block on its own, as SPIKE does, can).

A partition's elimination carries a window of `k + 1` rows, each held as its entries
in the left separator (`k` columns, filled in as rows are combined) and in the `k +
1` columns from the current one on. The separators at the two ends of the matrix
have columns outside it; the reduced band gives them identity rows, so it stays
square and banded.

Arbenz and Hegland, "On the stable parallel solution of general narrow banded linear
systems" (1998), and ScaLAPACK's `pdgbtrf` use this ordering.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import _band_rows

__all__ = [
    "PARTITIONED_MAX_COUPLING",
    "PartitionedFactors",
    "band_lu_partitioned",
    "partitioned_solve",
    "partitions",
]


class PartitionedFactors(NamedTuple):
    """The factors of `band_lu_partitioned`, the partitions last (each partition a
    lane of the scans).

    `rows[t, :, i]`: the pivot row of step `t` of partition `i`, its `k` entries in
    the left separator and then the `k + 1` from its own column on.
    `multipliers[t, :, i]` and `pivots[t, i]` as in `band_lu_rows` (over a window of
    `k + 1` rows). `reduced`: the `band_lu_rows` factors of the separators' band
    (at most 11 sub- or super-diagonals, since `k <= PARTITIONED_MAX_COUPLING`).
    """

    rows: jax.Array
    multipliers: jax.Array
    pivots: jax.Array
    reduced: tuple


#: Partitions are worth it up to this `lower + upper`: measured on CPU at 2048
#: unknowns, a factorisation and eight solves in one loop take 0.56x the time row by
#: row at `lower + upper = 2`, 0.67x at 4, 0.89x at 6 and 1.6x at 10 (the reduced
#: band widens with it).
PARTITIONED_MAX_COUPLING = 6


def partitions(n: int, lower: int, upper: int) -> int:
    """How many partitions `band_lu` cuts a band of `n` rows into: 32 (64 from 8192
    rows), so that the lanes fill whole vector registers (measured on CPU: 11 or 13
    partitions took several times longer than 32), provided each partition holds at
    least `4 (lower + upper)` rows; 1 (no partitions) otherwise, or for a band wider
    than `PARTITIONED_MAX_COUPLING`."""
    k = lower + upper
    if k == 0 or k > PARTITIONED_MAX_COUPLING:
        return 1
    p = 64 if n >= 8192 else 32
    return p if n >= 4 * k * p else 1


def _lane_pivot(column: jax.Array) -> jax.Array:
    """`_band_rows._pivot` in each lane: the first largest of `column[:, i]`."""
    if column.shape[0] - 1 > _band_rows._PIVOT_BY_COMPARISONS:
        return jnp.argmax(column, axis=0).astype(jnp.int32)
    p, best = jnp.zeros(column.shape[1:], jnp.int32), column[0]
    for i in range(1, column.shape[0]):
        better = column[i] > best
        p, best = jnp.where(better, i, p), jnp.where(better, column[i], best)
    return p


def _swap(v: jax.Array, p: jax.Array) -> jax.Array:
    """Rows 0 and `p[i]` of `v` exchanged in each lane `i` (by selects)."""
    idx = jnp.arange(v.shape[0])[:, None]
    hit = idx == p[None, :]
    other = jnp.sum(jnp.where(hit, v, 0), axis=0)
    return jnp.where(idx == 0, other[None], jnp.where(hit, v[0][None], v))


def _gather(values: jax.Array, index: np.ndarray, ones: np.ndarray | None = None) -> jax.Array:
    """`values.ravel()[index]`, zero where `index < 0` and one where `ones`: one
    gather (each array operation costs the same few microseconds whatever its size)."""
    flat = jnp.concatenate([values.reshape(-1), jnp.zeros((1,), values.dtype)])
    out = flat[np.where(index < 0, flat.shape[0] - 1, index)]
    if ones is not None:
        out = jnp.where(ones, jnp.ones((), values.dtype), out)
    return out


def band_lu_partitioned(ab: jax.Array, lower: int, upper: int, parts: int) -> PartitionedFactors:
    """LU factorisation with partial pivoting of the band `ab` (`(n, lower + upper +
    1)`, as `_banded.band_matrix` stores it) by `parts` partitions of its rows (see the
    module's docstring); `partitioned_solve` solves with the result.

    Raises:
        ValueError: if a partition would hold `lower + upper + 1` rows or fewer.
    """
    n, width = ab.shape
    k = lower + upper
    m = -(-n // parts)
    if m <= k + 1:
        raise ValueError(
            f"band_lu_partitioned: {parts} partitions of {n} rows hold {m} rows each; "
            f"a partition needs more than lower + upper + 1 = {k + 1}"
        )

    # Row `a <= k` of a partition starts at column `s + a - lower`, entry `a` of the
    # left separator: its band sits at offset `a` of the extended row (`2k + 1`
    # entries). A later row enters when the current column is its first one: its
    # band fills the last `k + 1` entries. Rows past `n` are identity rows.
    a = np.arange(m + 1)[:, None, None]  # row `m` stands for the window's last fill
    j = np.arange(2 * k + 1)[None, :, None]
    lane = np.arange(parts)[None, None, :]
    d = j - np.where(a <= k, a, k)
    row = lane * m + a
    index = np.where((d >= 0) & (d < width) & (a < m) & (row < n), row * width + d, -1)
    ones = (row >= n) & (a < m) & (d == lower)
    extended = _gather(ab, index, ones)  # (m + 1, 2k + 1, parts)
    window, incoming = extended[: k + 1], extended[k + 1 :]

    rows_index = jnp.arange(k + 1)[:, None, None]

    def step(window, new_row):
        p = _lane_pivot(jnp.abs(window[:, k]))
        hit = rows_index == p[None, None, :]
        pivot_row = jnp.sum(jnp.where(hit, window, 0), axis=0)
        others = jnp.where(hit[1:], window[0][None], window[1:])
        ell = others[:, k] / pivot_row[k][None]
        rest = others - ell[:, None] * pivot_row[None]
        # The current column leaves the window; the left separator stays in place.
        shifted = jnp.concatenate(
            [rest[:, :k], rest[:, k + 1 :], jnp.zeros((k, 1, parts), rest.dtype)], axis=1
        )
        # One output per step, the pivot's offset (at most k) in the matrix's dtype:
        # each output of a scan costs a kernel of its own per step (three outputs
        # took about 25 us more per factorisation at 2048 unknowns).
        out = jnp.concatenate([pivot_row, ell, p[None].astype(rest.dtype)])
        return jnp.concatenate([shifted, new_row[None]]), out

    left, out = jax.lax.scan(step, window, incoming)
    rows, multipliers = out[:, : 2 * k + 1], out[:, 2 * k + 1 : 3 * k + 1]
    pivots = jnp.real(out[:, 3 * k + 1]).astype(jnp.int32)

    # The k rows each partition leaves, entries in its left and right separators:
    # reduced row `lower + i k + a` (`a < k`) of a band with `lower + k - 1` sub-
    # diagonals, entry `j` of `left[a, :, i]` on its diagonal `j - a + k - 1`. The
    # separators at the two ends have columns outside the matrix (`lower` on the
    # left, `upper` on the right), which get identity rows.
    red_lower, red_upper = lower + k - 1, upper + k - 1
    red_width = red_lower + red_upper + 1  # 3k - 1
    r = np.arange((parts + 1) * k)[:, None]
    dd = np.arange(red_width)[None, :]
    i, aa = (r - lower) // k, (r - lower) % k
    jj = dd - k + 1 + aa
    real = (r >= lower) & (r < lower + parts * k)
    index = np.where(real & (jj >= 0) & (jj < 2 * k), (aa * (2 * k + 1) + jj) * parts + i, -1)
    reduced_band = _gather(left, index, ~real & (dd == red_lower))
    reduced = _band_rows.band_lu_rows(reduced_band, red_lower, red_upper)
    return PartitionedFactors(rows, multipliers, pivots, tuple(reduced))


def partitioned_solve(factors: PartitionedFactors, b: jax.Array, lower: int, trans: int):
    """Solve `A x = b` (`trans=0`) or `A^T x = b` (`trans=1`) with the factors of
    `band_lu_partitioned` (the lanes' scans and the reduced band's)."""
    rows, multipliers, pivots, reduced = factors
    steps, k, parts = multipliers.shape
    upper = k - lower
    m = steps + k
    n = b.size
    dt = jnp.result_type(rows, b)
    blocks = jnp.pad(b.astype(dt), (0, parts * m - n)).reshape(parts, m).T  # (m, parts)
    red_lower = lower + k - 1
    spikes = rows[:, :k]  # the pivot rows' entries in the left separators

    if trans == 0:
        # Each partition's elimination on its own rows of b.
        def fwd(win, x):
            ell, p, nxt = x
            win = _swap(win, p)
            yk = win[0]
            return jnp.concatenate([win[1:] - ell * yk[None], nxt[None]]), yk

        incoming = jnp.concatenate([blocks[k + 1 :], jnp.zeros((1, parts), dt)])
        last, y = jax.lax.scan(fwd, blocks[: k + 1], (multipliers, pivots, incoming))
        rhs = jnp.concatenate([jnp.zeros(lower, dt), last[:k].T.reshape(-1), jnp.zeros(upper, dt)])
        separators = _band_rows.band_rows_solve(reduced, rhs, red_lower, 0).reshape(parts + 1, k).T
        left, right = separators[:, :-1], separators[:, 1:]  # (k, parts)
        y = y - jnp.einsum("tjp,jp->tp", spikes, left)

        def bwd(tail, x):
            u, yk = x
            xk = (yk - jnp.sum(u[k + 1 :] * tail, axis=0)) / u[k]
            return jnp.concatenate([xk[None], tail[:-1]]), xk

        _, interior = jax.lax.scan(bwd, right, (rows, y), reverse=True)
        x = jnp.concatenate([left[lower:], interior, right[:lower]])
        return x.T.reshape(-1)[:n]

    # A^T x = b. With the unknowns ordered interiors first, the factors are
    # M A Q = [[U, V], [0, S]]: U the partitions' pivot rows on their interiors, V
    # their entries in the separators, S the reduced band; A^T = Q [[U^T, 0], [V^T,
    # S^T]] M^{-T}.
    def fwd_t(acc, x):
        u, ck = x
        wk = (ck - acc[0]) / u[k]
        acc = jnp.concatenate([acc[1:], jnp.zeros((1, parts), dt)]) + wk[None] * u[k + 1 :]
        return acc, wk

    to_right, w = jax.lax.scan(fwd_t, jnp.zeros((k, parts), dt), (rows, blocks[upper : m - lower]))
    to_left = jnp.einsum("tjp,tp->pj", spikes, w)
    padded = jnp.pad(b.astype(dt), (lower, parts * m - n + upper))
    gather = (np.arange(parts + 1) * m)[:, None] + np.arange(k)[None, :]
    rhs = (
        padded[gather] - jnp.pad(to_left, ((0, 1), (0, 0))) - jnp.pad(to_right.T, ((1, 0), (0, 0)))
    )
    z = _band_rows.band_rows_solve(reduced, rhs.reshape(-1), red_lower, 1)
    z = z[lower : lower + parts * k].reshape(parts, k).T

    def bwd_t(win, x):
        ell, p, wk = x
        full = _swap(jnp.concatenate([(wk - jnp.sum(ell * win, axis=0))[None], win]), p)
        return full[:k], full[k]

    head, tail = jax.lax.scan(bwd_t, z, (multipliers, pivots, w), reverse=True)
    return jnp.concatenate([head, tail]).T.reshape(-1)[:n]
