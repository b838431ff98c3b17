"""`Factored`: what the direct solvers share: a state of the operator and its factors,
solves that apply the factors, derivatives that go through the operator."""

from __future__ import annotations

import abc
import functools
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

from .._errors import error_if
from .._trees import all_finite
from ..linear_system import custom_linear_solve
from ._base import LinearSolver, MatVec, PyTree, transposed

__all__ = ["Factored"]


class Factored(LinearSolver):
    """A direct solver: `init` returns `(operator, *factors)` (a `NamedTuple` whose
    first field is the operator as a `jax.tree_util.Partial`), and a solve applies the
    factors to the flattened right-hand side.

    `solve` and `transpose_solve` go through `custom_linear_solve` with the operator,
    so their derivatives with respect to the operator are `dx = -A^{-1} dA x` (one more
    solve with the same factors): the factorisation itself is never differentiated.
    A subclass implements `init`, `_apply` and `_solve_once`, and has a `throw` field.
    """

    #: The message of a non-finite solution, when `throw`.
    singular_message: ClassVar[str] = ""
    throw: bool = True

    @property
    def solves_complex(self) -> bool:
        # LU factors and substitutions hold in complex arithmetic as they are.
        return True

    @abc.abstractmethod
    def _apply(self, factors: tuple[Any, ...], b: jax.Array, trans: int) -> jax.Array:
        """`A^{-1} b` (`trans=0`) or `A^{-T} b` (`trans=1`) on a flat vector `b`."""

    def solve(self, state: PyTree, b: PyTree) -> PyTree:
        factors = tuple(state[1:])
        return custom_linear_solve(
            state[0],
            b,
            functools.partial(self._factor_solve, factors, 0),
            transpose_solve=functools.partial(self._factor_solve, factors, 1),
        )

    def transpose_solve(self, state: PyTree, b: PyTree) -> PyTree:
        factors = tuple(state[1:])
        return custom_linear_solve(
            transposed(state[0], b),
            b,
            functools.partial(self._factor_solve, factors, 1),
            transpose_solve=functools.partial(self._factor_solve, factors, 0),
        )

    def factors(self, state: PyTree) -> PyTree:
        return tuple(state[1:])

    def solve_factors(self, factors: PyTree, b: PyTree, *, transpose: bool = False) -> PyTree:
        return self._factor_solve(tuple(factors), int(bool(transpose)), None, b)

    def _factor_solve(self, factors, trans: int, matvec: MatVec, b: PyTree) -> PyTree:
        """`_apply` on the pytree `b` (`matvec` is the operator being inverted; the
        factors already stand for it), checked for finiteness when `throw`."""
        del matvec
        flat, unravel = ravel_pytree(b)
        if flat.size == 0:
            return b
        x = unravel(self._apply(factors, flat, trans).astype(flat.dtype))
        if self.throw:
            x = error_if(x, jnp.logical_not(all_finite(x)), self.singular_message)
        return x
