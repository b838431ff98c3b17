"""A catalogue of linear systems and linear solvers for parametrised tests.

Every `LinearSolver` in `SOLVERS` is run on every problem of `PROBLEMS` it applies to (see
`applies`), against closed forms computed with NumPy. A new solver is tested by adding an
instance to `SOLVERS` (with `SLOW_SOLVERS` for those whose programs take long to compile);
a new operator by adding a `LinearProblem`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from implicitdiff import linear_solve

#: The solvers under test, with default options: float64 tolerances are `1e-10`.
SOLVERS = (
    linear_solve.Dense(),
    linear_solve.CG(),
    linear_solve.NormalCG(),
    linear_solve.GMRES(),
    linear_solve.BiCGStab(),
    linear_solve.Neumann(),
    linear_solve.Auto(),
)
#: Solvers left to the slow run: their programs compile about as long as another one's
#: and test nothing the others do not (`Auto` is `Dense` at these sizes).
SLOW_SOLVERS = (linear_solve.NormalCG, linear_solve.BiCGStab, linear_solve.Auto)
#: GMRES's programs take the longest to compile: the default run keeps one problem.
GMRES_FAST_PROBLEM = "nonsymmetric"


def _orthogonal(n: int, seed: int) -> np.ndarray:
    q, _ = np.linalg.qr(np.random.default_rng(seed).normal(size=(n, n)))
    return q


def spd(n: int, seed: int) -> np.ndarray:
    """Symmetric positive definite with eigenvalues in [0.5, 1.5]: `I - A` has spectral
    radius 0.5, so the Neumann series applies too."""
    q = _orthogonal(n, seed)
    a = q @ np.diag(np.linspace(0.5, 1.5, n)) @ q.T
    return (a + a.T) / 2


def nonsymmetric(n: int, seed: int) -> np.ndarray:
    """`I - J` with `||J||_2 = 0.5`: non-symmetric, condition number at most 3."""
    j = np.random.default_rng(seed).normal(size=(n, n))
    return np.eye(n) - 0.5 * j / np.linalg.norm(j, 2)


@dataclasses.dataclass(frozen=True, eq=False)
class LinearProblem:
    """`A x = b` with `A` a matrix on the flattened unknowns of the pytree `b`.

    `matrix` is `(n, n)`, or `(batch, n, n)` with `b` batched alike for a problem that is
    solved under `jax.vmap`. `symmetric` says `A` is symmetric positive definite (CG
    applies); every operator here has `I - A` of spectral radius below 1 (Neumann
    applies).
    """

    name: str
    matrix: np.ndarray
    b: Any
    symmetric: bool
    batched: bool = False

    def __repr__(self):
        return self.name

    def operator(self, a: jax.Array, like: Any):
        """`matvec` for the matrix `a` (closed over) on pytrees shaped like `like`."""
        _, unravel = ravel_pytree(like)

        def matvec(v):
            return unravel(a @ ravel_pytree(v)[0])

        return matvec

    def arrays(self) -> tuple[jax.Array, Any]:
        """`(A, b)` as float64 JAX arrays (call with x64 enabled)."""
        return jnp.asarray(self.matrix), jax.tree_util.tree_map(jnp.asarray, self.b)


def _pytree_rhs(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"u": rng.normal(size=3), "w": rng.normal(size=(2, 2))}


PROBLEMS = (
    LinearProblem("spd", spd(6, 0), np.random.default_rng(10).normal(size=6), True),
    LinearProblem(
        "nonsymmetric", nonsymmetric(6, 1), np.random.default_rng(11).normal(size=6), False
    ),
    LinearProblem("pytree", nonsymmetric(7, 2), _pytree_rhs(12), False),
    LinearProblem(
        "batch",
        np.stack([spd(5, 3), spd(5, 4), spd(5, 5)]),
        np.random.default_rng(13).normal(size=(3, 5)),
        True,
        batched=True,
    ),
)


def applies(solver: linear_solve.LinearSolver, problem: LinearProblem) -> bool:
    """Whether `solver` is meant to solve `problem` (CG needs a symmetric operator)."""
    return problem.symmetric or not isinstance(solver, linear_solve.CG)


def cases() -> list[tuple[linear_solve.LinearSolver, LinearProblem]]:
    """Every (solver, problem) pair to test."""
    return [(s, p) for s in SOLVERS for p in PROBLEMS if applies(s, p)]


def is_slow(solver: linear_solve.LinearSolver, problem: LinearProblem) -> bool:
    """Whether the pair runs only in the slow run (see `SLOW_SOLVERS`)."""
    if isinstance(solver, SLOW_SOLVERS):
        return True
    return isinstance(solver, linear_solve.GMRES) and problem.name != GMRES_FAST_PROBLEM
