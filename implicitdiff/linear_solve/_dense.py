"""`Dense`: materialise the operator and factor it once (LU)."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsp_linalg
from jax.flatten_util import ravel_pytree

from ._base import MatVec, PyTree, as_operator
from ._checks import as_arrays, check_throw
from ._factored import Factored
from ._unrolled import UNROLLED_LU_MAX, unrolled_lu

__all__ = ["Dense", "DenseState", "dense", "materialise"]

#: Up to this many unknowns, `solve` substitutes through the LU factors with scalar
#: operations that XLA fuses, instead of two LAPACK triangular solves: on CPU a LAPACK
#: call's fixed cost outweighs such a solve, and the stiff ODE methods make several per
#: step. Above it the substitution's unrolled code grows and loses to LAPACK.
SUBSTITUTE_MAX = 8
#: The same for solves with `A^T` (`transpose_solve`, and the reverse pass of `solve`),
#: lower: inside a reverse pass XLA fuses the substitutions of successive solves
#: together and recomputes their shared terms, so at eight unknowns they were slower
#: than LAPACK.
SUBSTITUTE_TRANSPOSE_MAX = 4


class DenseState(NamedTuple):
    """The state of `Dense`: the operator, the LU factors of its matrix (as
    `jax.scipy.linalg.lu_factor` gives them) and the row order the pivots give
    (`perm`).

    The solves use the factors; their derivatives with respect to the operator come from
    the operator itself (`dx = -A^{-1} dA x`, one more solve with the same factors), so
    differentiating never differentiates the factorisation.
    """

    operator: jax.tree_util.Partial
    lu: jax.Array
    pivots: jax.Array
    perm: jax.Array


def materialise(matvec: MatVec, b_like: PyTree) -> jax.Array:
    """The matrix of `matvec` on the flattened unknowns (`ravel_pytree` order): column `i`
    is `matvec` applied to the `i`-th unit vector, all columns in one `jax.vmap`.

    Example:
        ```python
        import jax.numpy as jnp
        from implicitdiff import internal

        print(internal.materialise(lambda v: 2 * v, jnp.zeros(2)))  # [[2. 0.] [0. 2.]]
        ```
    """
    flat, unravel = ravel_pytree(as_arrays(b_like))

    def flat_matvec(v):
        return ravel_pytree(matvec(unravel(v)))[0]

    eye = jnp.eye(flat.size, dtype=flat.dtype)
    return jax.vmap(flat_matvec, out_axes=1)(eye)


@dataclasses.dataclass(frozen=True)
class Dense(Factored):
    """Solve by building the matrix and factoring it once (LU with partial pivoting).

    `init` materialises the operator by applying `matvec` (vectorised with `jax.vmap`)
    to the columns of the identity, on the flattened unknowns
    (`jax.flatten_util.ravel_pytree`), and factors it; `solve` and `transpose_solve`
    are two triangular solves each, with the same factors, and so are their derivatives
    (the factorisation itself is never differentiated). For a system so small that a
    LAPACK call costs more than the solve (up to 8 unknowns, 4 for solves with `A^T`),
    the two triangular solves are written out as scalar substitution, and up to 4
    unknowns the factorisation is written out entry by entry (`UNROLLED_LU_MAX`).
    Cost: `n` matvecs, `O(n^2)` memory and `O(n^3)` time to factor for `n` unknowns,
    `O(n^2)` per solve, so use it for small systems (up to a few hundred or thousand
    unknowns). It is exact up to rounding whatever the symmetry or conditioning.

    Arguments:
        symmetric: the operator is symmetric; then the one-shot call differentiates in
            reverse mode with `matvec` instead of its transpose.
        throw: if True (default), raise at run time when the solution is not finite (a
            singular matrix). If False, return it as is.

    Example:
        ```python
        import jax, jax.numpy as jnp
        from implicitdiff import linear_solve

        A = jnp.array([[2.0, 1.0], [0.0, 3.0]])
        solver = linear_solve.Dense()
        x = solver(lambda v: A @ v, jnp.array([3.0, 3.0]))  # [1., 1.]
        state = solver.init(lambda v: A @ v, jnp.zeros(2))
        y = solver.transpose_solve(state, jnp.array([2.0, 4.0]))  # [1., 1.]
        ```
    """

    name: ClassVar[str] = "dense"
    symmetric: bool = False
    throw: bool = True
    singular_message: ClassVar[str] = (
        "implicitdiff.linear_solve.dense: the solution is not finite (NaN or inf), so the "
        "matrix is singular (or b is not finite). To fix it: make the system non-singular "
        "(e.g. add a small multiple of the identity: matvec(x) + eps * x), check the "
        "inputs for NaN, or use `normal_cg`/`gmres` for a least-squares-like answer. "
        "Pass `throw=False` to skip this check."
    )

    def __post_init__(self):
        check_throw(self.throw, self.name)

    def init(self, matvec: MatVec, b_like: PyTree) -> DenseState:
        operator = as_operator(matvec, b_like)
        # The factors are never differentiated (see `DenseState`): without the stop, a
        # derivative would still trace the factorisation's own rule, costly in reverse.
        matrix = jax.lax.stop_gradient(materialise(operator, b_like))
        return DenseState(operator, *_factor(matrix))

    def _solve_once(self, matvec: MatVec, b: PyTree) -> PyTree:
        return self._factor_solve(_factor(materialise(matvec, b)), 0, matvec, b)

    def _apply(self, factors, b: jax.Array, trans: int) -> jax.Array:
        lu, _, perm = factors
        n = lu.shape[-1]
        if trans == 0 and 0 < n <= SUBSTITUTE_MAX:
            return _substitute(lu, perm, b)
        if trans == 1 and 0 < n <= SUBSTITUTE_TRANSPOSE_MAX:
            return _substitute_transposed(lu, perm, b)
        return _triangular_solves(lu, perm, b, trans)


def _factor(matrix: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`(lu, pivots, perm)`: LAPACK's factors (written out up to `UNROLLED_LU_MAX`
    unknowns, see `unrolled_lu`) and the row order of `P A = L U` (row `i` swapped with
    row `pivots[i]`, in turn). The row order is computed once with the factors:
    `lax.linalg.lu_pivots_to_permutation` is a loop, which `jax.scipy.linalg.lu_solve`
    runs at each solve (and for `A^T` a sort besides), inside the loop of every Newton
    iteration that reuses the factors and at every step of a reverse pass."""
    n = matrix.shape[-1]
    if 0 < n <= UNROLLED_LU_MAX:
        return unrolled_lu(matrix)
    lu, pivots = jsp_linalg.lu_factor(matrix)
    return lu, pivots, jax.lax.linalg.lu_pivots_to_permutation(pivots, n)


def _triangular_solves(lu: jax.Array, perm: jax.Array, b: jax.Array, trans: int) -> jax.Array:
    """`A^{-1} b` (`trans` 0) or `A^{-T} b` (`trans` 1) from `P A = L U` by LAPACK's
    triangular solves, the rows of `P` applied with `perm`: as
    `jax.scipy.linalg.lu_solve`, without its row order from the pivots at each
    solve."""
    dtype = jnp.result_type(lu, b)  # as `lu_solve`, both in a common dtype
    lu, x = lu.astype(dtype), b.reshape(b.shape[0], -1).astype(dtype)
    solve = jax.lax.linalg.triangular_solve
    if trans == 0:  # L U x = P b
        x = solve(lu, x[perm], left_side=True, lower=True, unit_diagonal=True)
        x = solve(lu, x, left_side=True, lower=False)
    else:  # A^T = U^T L^T P: U^T z = b, L^T w = z, x = P^T w
        x = solve(lu, x, left_side=True, lower=False, transpose_a=True)
        x = solve(lu, x, left_side=True, lower=True, unit_diagonal=True, transpose_a=True)
        x = jnp.zeros_like(x).at[perm].set(x)
    return x.reshape(b.shape)


@jax.jit
def _substitute(lu: jax.Array, perm: jax.Array, b: jax.Array) -> jax.Array:
    """`A^{-1} b` from `P A = L U` (unit lower `L` and `U` packed in `lu`; `perm` the
    row order of `P`): permute `b`, then forward and back substitution, unrolled into
    scalar operations."""
    n = lu.shape[-1]
    v = b[perm]
    y = []
    for i in range(n):  # L y = P b
        y.append(v[i] - sum((lu[i, j] * y[j] for j in range(i)), start=0.0))
    x = [None] * n
    for i in reversed(range(n)):  # U x = y
        x[i] = (y[i] - sum((lu[i, j] * x[j] for j in range(i + 1, n)), start=0.0)) / lu[i, i]
    return jnp.stack(x)


@jax.jit
def _substitute_transposed(lu: jax.Array, perm: jax.Array, b: jax.Array) -> jax.Array:
    """`A^{-T} b` from `P A = L U`: `A^T = U^T L^T P`, so forward substitution with
    `U^T`, back substitution with `L^T`, then the rows put back in place."""
    n = lu.shape[-1]
    z = []
    for i in range(n):  # U^T z = b
        z.append((b[i] - sum((lu[j, i] * z[j] for j in range(i)), start=0.0)) / lu[i, i])
    w = [None] * n
    for i in reversed(range(n)):  # L^T w = z
        w[i] = z[i] - sum((lu[j, i] * w[j] for j in range(i + 1, n)), start=0.0)
    w = jnp.stack(w)
    return jnp.zeros_like(w).at[perm].set(w)  # x = P^T w


def dense(matvec: MatVec, b: PyTree, *, symmetric: bool = False, throw: bool = True) -> Any:
    """Solve `matvec(x) = b` by building the matrix and using an LU factorisation.

    The one-shot form of `Dense` (see there for the method and its cost):
    `dense(matvec, b, **options)` is `Dense(**options)(matvec, b)`.

    Arguments:
        matvec: linear function from pytrees shaped like `b` to pytrees shaped like `b`.
        b: right-hand side, a pytree of real floating-point arrays.
        symmetric: set to True if the operator is symmetric; then reverse-mode
            differentiation reuses `matvec` instead of transposing it.
        throw: if True (default), raise at run time when the solution is not finite (a
            singular matrix). If False, return it as is.

    Returns:
        `x`, a pytree with the structure of `b`.

    Example:
        ```python
        import jax.numpy as jnp
        from implicitdiff import linear_solve

        A = jnp.array([[2.0, 1.0], [0.0, 3.0]])
        x = linear_solve.dense(lambda v: A @ v, jnp.array([3.0, 3.0]))  # [1., 1.]
        ```
    """
    return Dense(symmetric=bool(symmetric), throw=throw)(matvec, b)
