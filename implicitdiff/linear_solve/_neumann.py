"""`Neumann`: the Richardson iteration `x <- x + (b - A x)`, i.e. the Neumann series."""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from .._errors import any_over_batch
from .._trees import tree_norm, tree_sub
from ._base import MatVec, PyTree
from ._checks import check_converged
from ._iterative import IterativeSolver

__all__ = ["Neumann", "neumann", "NEUMANN_DEFAULT_MAXITER"]

#: Default iteration cap of `neumann` (its convergence speed depends on the spectral radius
#: of `I - A`, not on the size of the system).
NEUMANN_DEFAULT_MAXITER: int = 1000


@dataclasses.dataclass(frozen=True)
class Neumann(IterativeSolver):
    """The Richardson / Neumann-series iteration, for `A = I - J` with `J` contracting.

    Iterates `x <- x + (b - matvec(x))` from `x0` (default zero). Writing
    `matvec = I - J`, this sums the Neumann series `b + J b + J^2 b + ...`, which converges
    exactly when the spectral radius of `J = I - A` is below 1 (the rate is that radius).
    This is the natural solver for the backward pass of a fixed-point iteration
    `z = f(z)`, where `A = I - df/dz` and `f` is a contraction: it needs one matvec per step
    and no extra memory. It stops when `||b - matvec(x)|| <= max(rtol * ||b||, atol)`, after
    `maxiter` steps (default `NEUMANN_DEFAULT_MAXITER`), or when the residual stops being
    finite; the residual check then includes the divergent case. Under `vmap` the batch is
    one loop: it stops when every element has, and the converged elements keep
    iterating until then (which only shrinks their residuals). Options as
    `IterativeOptions`.

    Example:
        ```python
        import jax.numpy as jnp
        from implicitdiff import linear_solve

        J = jnp.array([[0.5, 0.0], [0.25, 0.25]])  # spectral radius 0.5
        x = linear_solve.Neumann()(lambda v: v - J @ v, jnp.array([1.0, 1.0]))  # [2., 2.]
        ```
    """

    name: ClassVar[str] = "neumann"

    def _default_maxiter(self, size: int) -> int:
        return NEUMANN_DEFAULT_MAXITER

    def _iterate(self, matvec, b, x0, rtol, atol, maxiter):
        tol = jnp.maximum(rtol * tree_norm(b), atol)
        if x0 is None:  # the first step from zero, x = b, taken here
            x, k = b, 1
        else:
            x, k = x0, 0
        r = tree_sub(b, matvec(x))

        def keep_going(state):
            _, r, k = state
            rnorm = tree_norm(r)
            # Under vmap the loop runs until every element has converged (the converged
            # ones keep iterating, which only shrinks their residual): one loop over the
            # batch rather than one masked loop per element.
            return (k < maxiter) & any_over_batch((rnorm > tol) & jnp.isfinite(rnorm))

        def step(state):
            x, r, k = state
            x = jax.tree_util.tree_map(operator.add, x, r)  # x + (b - A x)
            return x, tree_sub(b, matvec(x)), k + 1

        x, r, _ = jax.lax.while_loop(keep_going, step, (x, r, k))
        if self.throw:
            x = check_converged(self.name, matvec, b, x, rtol, atol, maxiter, residual=r)
        return x


def neumann(
    matvec: MatVec,
    b: PyTree,
    *,
    rtol: float | None = None,
    atol: float = 0.0,
    maxiter: int | None = None,
    x0: PyTree | None = None,
    throw: bool = True,
) -> Any:
    """Solve `matvec(x) = b` with the Richardson / Neumann-series iteration (see `Neumann`).

    Arguments:
        matvec: linear function on pytrees shaped like `b`, with `I - matvec` of spectral
            radius below 1.
        b: right-hand side, a pytree of real floating-point arrays.
        rtol: relative tolerance (default from the dtype of `b`, as `cg`).
        atol: absolute tolerance.
        maxiter: maximum number of steps; default `NEUMANN_DEFAULT_MAXITER` (1000).
        x0: initial guess, default zeros.
        throw: raise at run time when the residual check fails (which includes the
            divergent case, spectral radius >= 1) or `x` is not finite.

    Returns:
        `x`, a pytree with the structure of `b`: `Neumann(**options)(matvec, b, x0=x0)`.

    Example:
        ```python
        import jax.numpy as jnp
        from implicitdiff import linear_solve

        J = jnp.array([[0.5, 0.0], [0.25, 0.25]])  # spectral radius 0.5
        x = linear_solve.neumann(lambda v: v - J @ v, jnp.array([1.0, 1.0]))  # [2., 2.]
        ```
    """
    return Neumann(rtol=rtol, atol=atol, maxiter=maxiter, throw=throw)(matvec, b, x0=x0)
