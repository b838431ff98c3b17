"""`Dense`: materialise the operator and factor it once (LU)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsp_linalg
from jax.flatten_util import ravel_pytree

from ._base import MatVec, PyTree, as_operator
from ._checks import as_arrays, check_throw
from ._factored import Factored

__all__ = [
    "SMALL_DENSE",
    "Dense",
    "DenseState",
    "InverseFactors",
    "LUFactors",
    "apply_factors",
    "dense",
    "factor",
    "materialise",
]


#: Up to this many unknowns, `Dense` keeps the inverses of its triangular factors
#: (`InverseFactors`) and a solve is two matrix-vector products; above, it keeps the
#: LU factors (`LUFactors`) and a solve is two triangular solves.
SMALL_DENSE = 32


class LUFactors(NamedTuple):
    """LU factors with partial pivoting, as `jax.scipy.linalg.lu_factor` returns them:
    `P A = L U` with `L` unit lower triangular and `U` upper triangular, both stored
    in `lu`, and the row interchanges in `pivots`."""

    lu: jax.Array
    pivots: jax.Array


class InverseFactors(NamedTuple):
    """The same factorisation kept as two inverses: `lower = L^{-1} P` and
    `upper = U^{-1}`, so that `A^{-1} b = upper @ (lower @ b)` and
    `A^{-T} b = lower.T @ (upper.T @ b)`.

    For a small system each triangular solve is a call into LAPACK whose fixed cost
    outweighs its `n^2` operations (on CPU, an 8 x 8 solve costs more than the rest of
    a stiff step's arithmetic), while a product is one fused loop. The inverses cost
    two triangular solves with `n` right-hand sides when factoring. Applying the
    inverse of a triangular factor is not backward stable as substitution is, but its
    error stays below `cond(A) eps`, the bound of a backward-stable solve: equal to
    LAPACK's on the stage matrices of stiff problems and on matrices with condition
    numbers up to 1e12, and up to about 25 times LAPACK's on Kahan's matrices with
    `b = A x` (whose triangular factor is itself ill-conditioned: LAPACK stays well
    inside its bound there, the inverse comes closer to it). `U^{-1}` overflows only
    where a pivot is below the reciprocal of the largest float (about 5.6e-309 in
    float64); the solution is then not finite, and reported as a singular matrix.
    The products are sums of elementwise products, not `@`: on CPU a matrix product
    goes to a threaded library whose hand-off costs more than a small product, and an
    accelerator may round a matrix product's operands.
    """

    lower: jax.Array
    upper: jax.Array


class DenseState(NamedTuple):
    """The state of `Dense`: the operator, and the factors of its matrix
    (`LUFactors`, or `InverseFactors` up to `SMALL_DENSE` unknowns).

    The solves use the factors; their derivatives with respect to the operator come from
    the operator itself (`dx = -A^{-1} dA x`, one more solve with the same factors), so
    differentiating never differentiates the factorisation.
    """

    operator: jax.tree_util.Partial
    factors: LUFactors | InverseFactors


def factor(matrix: jax.Array) -> LUFactors | InverseFactors:
    """The factors `Dense` solves with: `InverseFactors` of a matrix of up to
    `SMALL_DENSE` rows, `LUFactors` of a larger one."""
    n = matrix.shape[-1]
    if n > SMALL_DENSE:
        return LUFactors(*jsp_linalg.lu_factor(matrix))
    if n == 0:
        return InverseFactors(matrix, matrix)
    lu, _, perm = jax.lax.linalg.lu(matrix)
    eye = jnp.eye(n, dtype=matrix.dtype)
    triangular = functools.partial(jax.lax.linalg.triangular_solve, lu, left_side=True)
    lower = triangular(eye[perm], lower=True, unit_diagonal=True)
    # The second solve waits for the first (a product with zero of one of its
    # entries, cast to an integer so that a NaN cannot spread; XLA keeps it). Two
    # independent LAPACK calls may run at once on CPU, and under `vmap`, each spreading
    # its batch over the same thread pool, they can wait for each other forever.
    # `upper` is then the last factor ready, which `solvers` orders the next
    # factorisation after.
    anchor = jnp.ravel(lower)[0].astype(jnp.int32).astype(matrix.dtype)
    upper = triangular(eye + 0 * anchor, lower=False)
    return InverseFactors(lower, upper)


def apply_factors(factors: LUFactors | InverseFactors, b: jax.Array, trans: int) -> jax.Array:
    """`A^{-1} b` (`trans=0`) or `A^{-T} b` (`trans=1`) for the `factor`s of `A`, `b`
    flat."""
    if isinstance(factors, LUFactors):
        return jsp_linalg.lu_solve(tuple(factors), b, trans=trans)
    if not isinstance(factors, InverseFactors):
        raise TypeError(
            "linear_solve.Dense: expected the factors `Dense.factors(state)` returns, got "
            f"{type(factors).__name__}; pass `solver.factors(state)` to `solve_factors`, "
            "not `state.factors`"
        )
    lower, upper = factors
    if trans == 0:
        return jnp.sum(upper * jnp.sum(lower * b, axis=1), axis=1)
    return jnp.sum(lower * jnp.sum(upper * b[:, None], axis=0)[:, None], axis=0)


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
    (the factorisation itself is never differentiated). Up to `SMALL_DENSE` unknowns
    it keeps the inverses of the triangular factors instead, and a solve is two
    matrix-vector products (`InverseFactors`). Cost: `n` matvecs, `O(n^2)`
    memory and `O(n^3)` time to factor for `n` unknowns, `O(n^2)` per solve, so use it
    for small systems (up to a few hundred or thousand unknowns). It is exact up to
    rounding whatever the symmetry or conditioning.

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
        return DenseState(operator, factor(matrix))

    def _solve_once(self, matvec: MatVec, b: PyTree) -> PyTree:
        return self._factor_solve((factor(materialise(matvec, b)),), 0, matvec, b)

    def _apply(self, factors, b: jax.Array, trans: int) -> jax.Array:
        return apply_factors(factors[0], b, trans)


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
