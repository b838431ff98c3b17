"""`LinearSolver`: the abstract base of the linear solvers."""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any, ClassVar

import jax

from .. import _jax_compat as compat
from ..linear_system import custom_linear_solve
from ._checks import as_arrays, prepare_b

__all__ = ["LinearSolver", "PyTree", "MatVec", "as_operator", "transposed"]

PyTree = Any
MatVec = Callable[[PyTree], PyTree]


class LinearSolver(abc.ABC):
    """A method for square linear systems `matvec(x) = b` on pytrees: prepare once, then
    solve, forwards and transposed, as often as needed.

    A solver splits its work in two. `init(matvec, b_like)` does what depends on the
    operator only (materialise and factor the matrix, say) and returns a *state*, a
    pytree of arrays, so it can be carried through `jax.jit`, `jax.vmap` and
    differentiation, e.g. saved as a residual between the two passes of reverse mode.
    `solve(state, b)` and `transpose_solve(state, b)` then solve with the operator and with
    its transpose, reusing that state: one factorisation serves every right-hand side and
    both directions. Both are differentiable with respect to `b` and to the state (so to
    whatever the operator was built from), to any order, and linear and transposable in
    `b`.

    Calling the solver, `solver(matvec, b)`, is a one-shot solve with the semantics of the
    functions of `implicitdiff.linear_solve`: it goes through `custom_linear_solve`, so
    its derivatives are implicit, and it checks its own answer unless built with
    `throw=False`. An instance can thus be passed wherever a `solve(matvec, b)` callable
    is accepted. The implicit rules (`custom_root`, `implicit_diff`) recognise an
    instance and prepare it once at the solution, reusing the state for the derivative
    solves.

    Subclasses are frozen dataclasses (hashable, so an instance can be a static
    parameter) whose fields are the options. A new solver implements `init`, `solve` and
    `transpose_solve`; the one-shot call then works as is.

    Example:
        ```python
        import jax.numpy as jnp
        from implicitdiff import linear_solve

        A = jnp.array([[2.0, 1.0], [0.0, 3.0]])
        solver = linear_solve.Dense()
        state = solver.init(lambda v: A @ v, jnp.zeros(2))  # one LU factorisation
        x = solver.solve(state, jnp.array([3.0, 3.0]))  # [1., 1.]
        y = solver.transpose_solve(state, jnp.array([2.0, 4.0]))  # A^T y = b: [1., 1.]
        z = solver(lambda v: A @ v, jnp.array([3.0, 3.0]))  # one-shot: [1., 1.]
        ```
    """

    #: The solver's name in `linear_solve.SOLVERS` and in its error messages.
    name: ClassVar[str] = "solver"
    #: Whether the solver is built for one layout of the unknowns (a band, a sparsity
    #: pattern), so that it fits only operators on those unknowns (and, through
    #: `coupled`, on copies of them), not on a larger system made from them.
    layout_bound: ClassVar[bool] = False
    #: Whether the operator is taken to be symmetric: the one-shot call then
    #: differentiates in reverse mode with `matvec` itself instead of its transpose.
    symmetric: bool = False

    @property
    def factors_in_batches(self) -> bool:
        """Whether `init` on a batch of operators at once (under `vmap`) costs less per
        operator on CPU than one `init` after another. True unless the solver says
        otherwise: the blocked factorisation of a wide band (`Banded`, `Sparse`) is
        slower per matrix in a batch, its small LUs, row gathers and triangular solves
        being done matrix by matrix with the batch's overheads on top. Code that may
        prepare several systems together (the checkpointed adjoint of `odeint`
        linearises eight steps at once) asks `factors_in_batches_at` first."""
        return True

    def factors_in_batches_at(self, n: int) -> bool:
        """`factors_in_batches` for systems of `n` unknowns: a solver may factor one
        large matrix by an algorithm of its own, which a batch would run at a higher
        cost per matrix (one long narrow band: by partitions, see `Banded`)."""
        return self.factors_in_batches

    @property
    def solves_complex(self) -> bool:
        """Whether `init`, `solve` and `transpose_solve` take a complex operator and
        complex right-hand sides (an operator on complex vectors, `b_like` of a complex
        dtype; `transpose_solve` with the plain transpose, not the conjugate one). True
        for the direct solvers (`Dense`, `Banded`, `Sparse`); the iterative ones are
        written for real systems, on which a complex one is solved as the real system
        of twice its size. The one-shot call takes real systems only, and derivatives
        are for real systems. Code with a complex system to solve (the complex pair of
        Radau IIA's iteration, outside any derivative) asks this first."""
        return False

    @abc.abstractmethod
    def init(self, matvec: MatVec, b_like: PyTree) -> PyTree:
        """Prepare to solve with the operator `matvec`.

        Arguments:
            matvec: the linear function `A`, from pytrees shaped like `b_like` to pytrees
                of the same structure, shapes and dtypes. It may close over traced values.
            b_like: a pytree with the structure, shapes and dtypes of the right-hand
                sides (arrays or `jax.ShapeDtypeStruct`s); its values are not used.

        Returns:
            The state, a pytree of arrays, for `solve` and `transpose_solve`.
        """

    @abc.abstractmethod
    def solve(self, state: PyTree, b: PyTree) -> PyTree:
        """Solve `A x = b` with the operator `init` prepared.

        Arguments:
            state: what `init` returned.
            b: the right-hand side, shaped like `init`'s `b_like`.

        Returns:
            `x`, a pytree with the structure of `b`.
        """

    @abc.abstractmethod
    def transpose_solve(self, state: PyTree, b: PyTree) -> PyTree:
        """Solve `A^T x = b` with the same state as `solve` (no new preparation).

        Arguments:
            state: what `init` returned.
            b: the right-hand side, shaped like `init`'s `b_like`.

        Returns:
            `x`, a pytree with the structure of `b`.
        """

    def factors(self, state: PyTree) -> PyTree | None:
        """The part of `state` a solve needs besides the operator, as a pytree of
        arrays that can be kept across iterations of a loop (an iterative method
        reuses a factorisation over several of its steps), or `None` for a solver
        that keeps nothing of the kind (a Krylov method)."""
        del state
        return None

    def solve_factors(self, factors: PyTree, b: PyTree, *, transpose: bool = False) -> PyTree:
        """`A^{-1} b` (`A^{-T} b` when `transpose`) from `factors(state)` alone. Not
        differentiable in the operator (it is not there): for iterations whose
        derivatives are taken another way, such as a Newton iteration under
        `custom_root`, or a preconditioner."""
        raise NotImplementedError(f"{type(self).__name__} keeps no factors (`factors` is None)")

    def coupled(self, m: int) -> LinearSolver:
        """This solver for `m` coupled copies of its unknowns: an operator on arrays of
        shape `(n, m)` (copy `s` of unknown `i` at `[i, s]`) whose coupling between
        unknowns is that of the original `n x n` operator (a block `A_ij` of size
        `m x m` where `A` had an entry). An implicit Runge-Kutta method with `m` stages
        solves such systems. Most solvers serve it as they are (returned unchanged); a
        solver that relies on the sparsity of the matrix adapts it (`Banded` widens
        its band).

        Arguments:
            m: the number of copies (`>= 1`).

        Returns:
            The solver for the coupled system.
        """
        return self

    def __call__(self, matvec: MatVec, b: PyTree) -> PyTree:
        """Solve `matvec(x) = b` once, differentiably through `custom_linear_solve`.

        Arguments:
            matvec: the linear function `A` on pytrees shaped like `b`.
            b: the right-hand side, a pytree of real floating-point arrays.

        Returns:
            `x`, a pytree with the structure of `b`.
        """
        b, size, _ = prepare_b(b, self.name)
        if size == 0:
            return b
        return custom_linear_solve(
            matvec,
            b,
            self._solve_once,
            transpose_solve=self._solve_once,
            symmetric=bool(self.symmetric),
        )

    def _solve_once(self, matvec: MatVec, b: PyTree) -> PyTree:
        """`init` then `solve`: the solver `custom_linear_solve` calls (with the operator,
        or with its transpose for the transposed system)."""
        return self.solve(self.init(matvec, b), b)


def as_operator(matvec: MatVec, b_like: PyTree) -> jax.tree_util.Partial:
    """`matvec` as a pytree: a `jax.tree_util.Partial` whose leaves are the traced values
    it closes over, so that a state holding it can be saved, batched and differentiated."""
    fn, consts, _ = compat.closure_convert(matvec, as_arrays(b_like))
    return jax.tree_util.Partial(fn, consts)


def transposed(matvec: MatVec, b_like: PyTree) -> MatVec:
    """The transpose of the linear function `matvec`, on pytrees shaped like `b_like`."""
    transpose = jax.linear_transpose(matvec, as_arrays(b_like))
    return lambda y: transpose(y)[0]
