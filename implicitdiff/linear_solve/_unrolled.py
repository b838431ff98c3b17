"""LU with partial pivoting of very small matrices, written out entry by entry.

On CPU a LAPACK factorisation has a fixed cost of about 0.2 us per matrix (measured:
3 x 3 in 0.25 us, against 0.02 us written out), which dominates a stiff step of a
system of a few unknowns, and a batch of many small blocks (`vmap` of LAPACK's `getrf`
runs one matrix after another). Written out, each operation acts on one entry across
the whole batch, and XLA fuses the lot. Past four unknowns XLA's fusion recomputes the
earlier eliminations for every entry and LAPACK wins (8 x 8: 4.8 us against 0.5 us).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["UNROLLED_LU_MAX", "unrolled_lu"]

#: The largest matrix (unknowns) factored by `unrolled_lu` instead of LAPACK.
UNROLLED_LU_MAX = 4


def _magnitude(x: jax.Array) -> jax.Array:
    """LAPACK's pivoting magnitude: `|x|`, or `|re x| + |im x|` for a complex `x`."""
    if jnp.iscomplexobj(x):
        return jnp.abs(x.real) + jnp.abs(x.imag)
    return jnp.abs(x)


def unrolled_lu(matrix: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`(lu, pivots, perm)` of `matrix` (`(..., n, n)`, leading axes a batch) as LAPACK's
    `getrf` gives them: `P A = L U` with the unit lower `L` and `U` packed in `lu`; row
    `k` swapped with row `pivots[k]` at elimination step `k` (the first row of largest
    magnitude in the column, as LAPACK picks it); `A[perm] = L U`. An exactly zero
    pivot stays on the diagonal of `U` with the column below it left as it is, as
    LAPACK leaves it: the solves are then not finite."""
    n = matrix.shape[-1]
    batch = matrix.shape[:-2]
    rows = [[matrix[..., i, j] for j in range(n)] for i in range(n)]
    perm = [jnp.full(batch, i, jnp.int32) for i in range(n)]
    pivots = []
    for k in range(n):
        best, largest = jnp.full(batch, k, jnp.int32), _magnitude(rows[k][k])
        for r in range(k + 1, n):
            size = _magnitude(rows[r][k])
            better = size > largest
            best, largest = jnp.where(better, r, best), jnp.where(better, size, largest)
        pivots.append(best)
        # Swap row k with row `best`, entry by entry with selects.
        top, top_perm = list(rows[k]), perm[k]
        for r in range(k + 1, n):
            hit = best == r
            top = [jnp.where(hit, rows[r][j], top[j]) for j in range(n)]
            top_perm = jnp.where(hit, perm[r], top_perm)
            rows[r] = [jnp.where(hit, rows[k][j], rows[r][j]) for j in range(n)]
            perm[r] = jnp.where(hit, perm[k], perm[r])
        rows[k], perm[k] = top, top_perm
        # As LAPACK: the column scaled by the pivot's reciprocal (cheaper than a
        # division per entry: 1000 blocks of 3 in 15 us against 25 us), and left as it
        # is (zero) where the pivot is zero, so that only the solves are not finite. (A
        # subnormal pivot, which LAPACK divides by instead, would overflow; XLA on CPU
        # flushes it to zero.)
        pivot = rows[k][k]
        inverse = 1 / jnp.where(pivot == 0, jnp.ones_like(pivot), pivot)
        for r in range(k + 1, n):
            factor = rows[r][k] * inverse
            rest = [rows[r][j] - factor * rows[k][j] for j in range(k + 1, n)]
            rows[r] = rows[r][:k] + [factor] + rest
    lu = jnp.stack([jnp.stack(row, axis=-1) for row in rows], axis=-2)
    return lu, jnp.stack(pivots, axis=-1), jnp.stack(perm, axis=-1)
