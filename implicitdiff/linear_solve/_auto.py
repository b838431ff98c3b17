"""`Auto`: a solver picked from the size of the system (dense, CG or GMRES)."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Literal

import jax
import numpy as np

from ._base import LinearSolver, MatVec, PyTree
from ._checks import check_x0, prepare_b
from ._dense import Dense
from ._iterative import IterativeOptions
from ._krylov import CG, GMRES

__all__ = ["Auto", "auto", "auto_method", "AUTO_DENSE_MAX_SIZE"]

#: `auto` solves systems with at most this many unknowns (summed over the leaves of `b`)
#: with `dense`.
AUTO_DENSE_MAX_SIZE: int = 256


def auto_method(b: PyTree, *, symmetric: bool = False) -> Literal["dense", "cg", "gmres"]:
    """Name of the solver `auto` uses for right-hand side `b`.

    Arguments:
        b: right-hand side (only the sizes of its leaves matter; `jax.ShapeDtypeStruct`
            leaves are fine).
        symmetric: whether the operator is symmetric positive definite.

    Returns:
        `"dense"` when `b` has at most `AUTO_DENSE_MAX_SIZE` unknowns in total, otherwise
        `"cg"` if `symmetric` else `"gmres"`.

    Example:
        ```python
        import jax.numpy as jnp
        from implicitdiff import linear_solve

        assert linear_solve.auto_method(jnp.zeros(10)) == "dense"
        assert linear_solve.auto_method(jnp.zeros(1000), symmetric=True) == "cg"
        ```
    """
    size = sum(int(np.prod(np.shape(leaf))) for leaf in jax.tree_util.tree_leaves(b))
    if size <= AUTO_DENSE_MAX_SIZE:
        return "dense"
    return "cg" if symmetric else "gmres"


@dataclasses.dataclass(frozen=True)
class Auto(IterativeOptions, LinearSolver):
    """A solver picked from the size of the system.

    Small systems (at most `AUTO_DENSE_MAX_SIZE` = 256 unknowns) use `Dense`, which is
    exact and, at that size, usually fastest. Larger ones use `CG` when `symmetric=True`
    (the operator must then be symmetric positive definite) and `GMRES` otherwise.
    `select(b_like)` gives the solver chosen; `init`, `solve` and `transpose_solve` are
    its own.

    The options of `IterativeOptions` (`rtol`, `atol`, `maxiter`) go to the iterative
    solver (`Dense` ignores them), `throw` to the chosen solver, and:

    Arguments:
        symmetric: declare the operator symmetric positive definite.

    Example:
        ```python
        import jax.numpy as jnp
        from implicitdiff import linear_solve

        solver = linear_solve.Auto(symmetric=True)
        print(solver.select(jnp.zeros(1000)))  # CG(rtol=None, atol=0.0, maxiter=None, throw=True)
        A = jnp.array([[2.0, 1.0], [1.0, 3.0]])
        x = solver(lambda v: A @ v, jnp.array([3.0, 4.0]))  # dense: [1., 1.]
        ```
    """

    name: ClassVar[str] = "auto"
    symmetric: bool = False

    def select(self, b_like: PyTree) -> LinearSolver:
        """The solver used for right-hand sides shaped like `b_like`.

        Arguments:
            b_like: a pytree shaped like the right-hand sides (arrays or
                `jax.ShapeDtypeStruct`s).

        Returns:
            A `Dense`, `CG` or `GMRES` instance with this solver's options.
        """
        method = auto_method(b_like, symmetric=bool(self.symmetric))
        if method == "dense":
            return Dense(symmetric=bool(self.symmetric), throw=self.throw)
        cls = CG if method == "cg" else GMRES
        return cls(rtol=self.rtol, atol=self.atol, maxiter=self.maxiter, throw=self.throw)

    def init(self, matvec: MatVec, b_like: PyTree) -> PyTree:
        return self.select(b_like).init(matvec, b_like)

    def solve(self, state: PyTree, b: PyTree) -> PyTree:
        return self.select(b).solve(state, b)

    def transpose_solve(self, state: PyTree, b: PyTree) -> PyTree:
        return self.select(b).transpose_solve(state, b)

    def __call__(self, matvec: MatVec, b: PyTree, *, x0: PyTree | None = None) -> PyTree:
        """Solve `matvec(x) = b` once with the solver `select(b)` picks.

        Arguments:
            matvec: the linear function `A` on pytrees shaped like `b`.
            b: the right-hand side, a pytree of real floating-point arrays.
            x0: initial guess for an iterative solver (ignored by `Dense`).

        Returns:
            `x`, a pytree with the structure of `b`.
        """
        b, _, _ = prepare_b(b, self.name)
        x0 = check_x0(x0, b, self.name)
        solver = self.select(b)
        if isinstance(solver, Dense):
            return solver(matvec, b)
        return solver(matvec, b, x0=x0)


def auto(
    matvec: MatVec,
    b: PyTree,
    *,
    symmetric: bool = False,
    rtol: float | None = None,
    atol: float = 0.0,
    maxiter: int | None = None,
    x0: PyTree | None = None,
    throw: bool = True,
) -> Any:
    """Solve `matvec(x) = b` with a solver picked from the size of the system (see `Auto`).

    Arguments:
        matvec: linear function on pytrees shaped like `b`.
        b: right-hand side, a pytree of real floating-point arrays.
        symmetric: declare the operator symmetric positive definite.
        rtol: passed to the iterative solver (ignored by `dense`).
        atol: passed to the iterative solver (ignored by `dense`).
        maxiter: passed to the iterative solver (ignored by `dense`).
        x0: passed to the iterative solver (ignored by `dense`).
        throw: passed to the chosen solver (see `dense` and `cg`).

    Returns:
        `x`, a pytree with the structure of `b`: `Auto(**options)(matvec, b, x0=x0)`.

    Example:
        ```python
        import jax.numpy as jnp
        from implicitdiff import linear_solve

        A = jnp.array([[2.0, 1.0], [0.0, 3.0]])
        x = linear_solve.auto(lambda v: A @ v, jnp.array([3.0, 3.0]))  # dense: [1., 1.]
        ```
    """
    solver = Auto(symmetric=bool(symmetric), rtol=rtol, atol=atol, maxiter=maxiter, throw=throw)
    return solver(matvec, b, x0=x0)
