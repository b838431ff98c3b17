"""Band LU with partial pivoting one row at a time: the factorisation of narrow bands
(`band_lu_rows`) and its solves (`band_rows_solve`), each a sequential `lax.scan`."""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["band_lu_rows", "band_rows_solve"]

# Rows per iteration of the solves' sequential scans: unrolled, a body has more
# operations than XLA's CPU runtime runs in order, and the solves slow down tenfold.
_UNROLL = 1
#: Bands with `lower` up to this find each pivot by comparisons row after row (fused
#: into the step's other operations); wider ones by `argmax`. Measured on CPU at 2048
#: unknowns: 4x faster at `lower = 1`, equal at 8, 1.4x slower at 10.
_PIVOT_BY_COMPARISONS = 8


def _pivot(column: jax.Array) -> jax.Array:
    """The index of the first largest entry of `column`, as `jnp.argmax` picks it for
    finite entries (a NaN is passed over here, unless first; the factors are not finite
    either way)."""
    if column.shape[0] - 1 > _PIVOT_BY_COMPARISONS:
        return jnp.argmax(column).astype(jnp.int32)
    p, best = jnp.zeros((), jnp.int32), column[0]
    for i in range(1, column.shape[0]):
        better = column[i] > best
        p, best = jnp.where(better, i, p), jnp.where(better, column[i], best)
    return p


def band_lu_rows(ab: jax.Array, lower: int, upper: int):
    """LU factorisation with partial pivoting of the band `ab` (LAPACK's unblocked
    band algorithm, one column per step of a `lax.scan`).

    Step `k` holds the rows `k .. k + lower` that can still hold column `k`, on the
    columns `k .. k + lower + upper` (interchanges widen `U`'s band to
    `lower + upper`), swaps the largest entry of column `k` up, eliminates below it
    and slides the window by one row and one column.

    Returns:
        `(upper_rows, multipliers, pivots)` as in `BandedState`.
    """
    n, width = ab.shape
    m = width  # U's band: the diagonal and lower + upper entries right of it
    # The window at k = 0: row i (i <= lower) starts at column i - lower.
    padded = jnp.pad(ab, ((0, lower + 1), (0, 0)))
    window = jnp.stack([jnp.roll(padded[i], i - lower) for i in range(lower + 1)])
    window = window * (jnp.arange(m)[None, :] <= jnp.arange(lower + 1)[:, None] + upper)
    incoming = padded[lower + 1 : lower + 1 + n]  # row k + lower + 1 enters at step k

    rows = jnp.arange(lower + 1)[:, None]

    def step(window, new_row):
        p = _pivot(jnp.abs(window[:, 0]))
        hit = rows == p
        # The interchange by selects, and the step's factors packed into one row: a
        # scatter, or three outputs, would each be one more operation of the loop body.
        pivot_row = jnp.sum(jnp.where(hit, window, 0), axis=0)
        others = jnp.where(hit[1:], window[0][None, :], window[1:])
        ell = others[:, 0] / pivot_row[0]
        rest = others - ell[:, None] * pivot_row[None, :]
        shifted = jnp.concatenate([rest[:, 1:], jnp.zeros((lower, 1), rest.dtype)], axis=1)
        window = jnp.concatenate([shifted, new_row[None, :]], axis=0)
        return window, jnp.concatenate([pivot_row, ell, p[None].astype(ell.dtype)])

    _, packed = jax.lax.scan(step, window, incoming)
    pivots = jnp.real(packed[:, -1]).astype(jnp.int32)
    return packed[:, :m], packed[:, m : m + lower], pivots


def band_rows_solve(factors, b: jax.Array, lower: int, trans: int = 0) -> jax.Array:
    """Solve `A x = b` (`trans=0`) or `A^T x = b` (`trans=1`) with the factors of
    `band_lu_rows` (a forward and a backward `lax.scan`)."""
    upper_rows, multipliers, pivots = factors
    n, m = upper_rows.shape
    dt = jnp.result_type(upper_rows, b)
    b = b.astype(dt)

    def swap(v, p):
        # Entries 0 and p exchanged by selects: under `vmap` (a pivot per element) an
        # indexed update would become a scatter, several times slower on CPU.
        idx = jnp.arange(v.shape[0])
        other = jnp.sum(jnp.where(idx == p, v, 0))
        return jnp.where(idx == 0, other, jnp.where(idx == p, v[0], v))

    if trans == 0:
        # y = M^{-1} b, M = P_0 L_0 P_1 L_1 ...: swap, then eliminate below.
        def fwd(win, x):
            ell, p, nxt = x
            win = swap(win, p)
            yk = win[0]
            win = jnp.concatenate([win[1:] - ell * yk, nxt[None]])
            return win, yk

        bp = jnp.pad(b, (0, lower + 1))
        _, y = jax.lax.scan(
            fwd,
            bp[: lower + 1],
            (multipliers, pivots, bp[lower + 1 : lower + 1 + n]),
            unroll=_UNROLL,
        )

        if m == 1:
            return y / upper_rows[:, 0]

        # x = U^{-1} y, from the last row up.
        def bwd(tail, x):
            u, yk = x
            xk = (yk - jnp.dot(u[1:], tail)) / u[0]
            return jnp.concatenate([xk[None], tail[:-1]]), xk

        _, x = jax.lax.scan(
            bwd, jnp.zeros(m - 1, dt), (upper_rows, y), reverse=True, unroll=_UNROLL
        )
        return x

    if m == 1:
        return b / upper_rows[:, 0]

    # z = U^{-T} b, pushing each z_k into the rows it reaches.
    def fwd_t(acc, x):
        u, bk = x
        zk = (bk - acc[0]) / u[0]
        acc = jnp.concatenate([acc[1:], jnp.zeros((1,), dt)]) + zk * u[1:]
        return acc, zk

    _, z = jax.lax.scan(fwd_t, jnp.zeros(m - 1, dt), (upper_rows, b), unroll=_UNROLL)

    # x = M^{-T} z = P_0 L_0^{-T} P_1 L_1^{-T} ... z, from the last column back.
    def bwd_t(win, x):
        ell, p, zk = x
        full = jnp.concatenate([(zk - jnp.dot(ell, win))[None], win])
        full = swap(full, p)
        return full[:lower], full[lower]

    if lower == 0:
        return z
    head, tail = jax.lax.scan(
        bwd_t, jnp.zeros(lower, dt), (multipliers, pivots, z), reverse=True, unroll=_UNROLL
    )
    return jnp.concatenate([head, tail])[:n]
