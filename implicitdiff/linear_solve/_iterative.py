"""`IterativeSolver`: what the matrix-free solvers (Krylov, Neumann) share.

Their state is the operator itself, closure-converted into a pytree (a
`jax.tree_util.Partial` whose leaves are the traced values `matvec` closes over), so it
can be saved and differentiated like any array. A solve runs the iteration inside
`custom_linear_solve`, so its derivatives are further solves, never derivatives of the
iterations; the transposed solve runs it on the transposed operator, which
`jax.linear_transpose` provides.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from ..linear_system import custom_linear_solve
from ._base import LinearSolver, MatVec, PyTree, as_operator, transposed
from ._checks import check_iterative_options, check_x0, default_rtol, prepare_b

__all__ = ["IterativeOptions", "IterativeSolver"]


@dataclasses.dataclass(frozen=True)
class IterativeOptions:
    """The options of an iterative solve, shared by the iterative solvers and `Auto`.

    Arguments:
        rtol: relative tolerance; default `1e-10` (float64), `1e-5` (float32), `1e-2`
            (16-bit), from the dtype of `b`.
        atol: absolute tolerance; convergence means
            `||matvec(x) - b|| <= max(rtol * ||b||, atol)`.
        maxiter: maximum number of iterations (a Python int); the default depends on the
            method.
        throw: if True (default), raise at run time when the residual stays above
            `RESIDUAL_SLACK * max(rtol * ||b||, atol)` or `x` is not finite. If False,
            return whatever the iteration reached, without checking.
    """

    name: ClassVar[str] = "iterative"
    rtol: float | None = None
    atol: float = 0.0
    maxiter: int | None = None
    throw: bool = True

    def __post_init__(self):
        check_iterative_options(self.name, self.rtol, self.atol, self.maxiter, self.throw)


@dataclasses.dataclass(frozen=True)
class IterativeSolver(IterativeOptions, LinearSolver):
    """Base of the iterative, matrix-free solvers: tolerances, iteration cap, check.

    Subclasses implement `_iterate(matvec, b, x0, rtol, atol, maxiter)` (the iteration
    and, when `throw`, the convergence check) and may change `_default_maxiter`.
    `solve` and the one-shot call take an optional initial guess `x0`; the transposed
    solves start from zero. The options are those of `IterativeOptions`. The state is the
    operator; a solver that prepares more (a preconditioner, say) keeps it in its state
    next to the operator and overrides `init`, `solve` and `transpose_solve`.
    """

    @abc.abstractmethod
    def _iterate(
        self, matvec: MatVec, b: PyTree, x0: PyTree | None, rtol: Any, atol: Any, maxiter: int
    ) -> PyTree:
        """Run the iteration from `x0` (None: zeros) and, when `throw`, check its answer."""

    def _default_maxiter(self, size: int) -> int:
        return 10 * size

    def _options(self, b: PyTree, size: int) -> tuple[Any, Any, int]:
        """`(rtol, atol, maxiter)` with the defaults for a right-hand side like `b`."""
        rtol = self.rtol
        if rtol is None:
            rtol = default_rtol(jnp.result_type(*jax.tree_util.tree_leaves(b)))
        maxiter = self._default_maxiter(size) if self.maxiter is None else int(self.maxiter)
        return rtol, self.atol, maxiter

    def init(self, matvec: MatVec, b_like: PyTree) -> jax.tree_util.Partial:
        return as_operator(matvec, b_like)

    def solve(self, state: MatVec, b: PyTree, x0: PyTree | None = None) -> PyTree:
        return self(state, b, x0=x0)

    def transpose_solve(self, state: MatVec, b: PyTree) -> PyTree:
        if self.symmetric:
            return self(state, b)
        return self(transposed(state, b), b)

    def __call__(self, matvec: MatVec, b: PyTree, *, x0: PyTree | None = None) -> PyTree:
        """Solve `matvec(x) = b` from `x0` (default zeros), differentiably.

        Arguments:
            matvec: the linear function `A` on pytrees shaped like `b`.
            b: the right-hand side, a pytree of real floating-point arrays.
            x0: initial guess with the structure and shapes of `b`; it also starts the
                solves that differentiation performs, which does not change their result.

        Returns:
            `x`, a pytree with the structure of `b`.
        """
        b, size, _ = prepare_b(b, self.name)
        x0 = check_x0(x0, b, self.name)
        if size == 0:
            return b
        rtol, atol, maxiter = self._options(b, size)

        def solve(mv, rhs):
            return self._iterate(mv, rhs, x0, rtol, atol, maxiter)

        def transpose_solve(mv, rhs):
            return self._iterate(mv, rhs, None, rtol, atol, maxiter)

        return custom_linear_solve(
            matvec, b, solve, transpose_solve=transpose_solve, symmetric=bool(self.symmetric)
        )
