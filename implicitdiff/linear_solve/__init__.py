"""Linear solvers for the tangent and adjoint systems of implicit differentiation.

Each method is a class, a subclass of `LinearSolver` whose fields are its options:
`Dense`, `Banded`, `Sparse`, `CG`, `NormalCG`, `GMRES`, `BiCGStab`, `Neumann` and `Auto`. A solver

- prepares once and solves many times: `state = solver.init(matvec, b_like)` (for `Dense`,
  the LU factorisation), then `solver.solve(state, b)` and `solver.transpose_solve(state, b)`
  (with the transposed operator, from the same state). The implicit rules
  (`custom_root`, `implicit_diff`) use this to factor once per derivative;
- solves in one shot when called, `solver(matvec, b) -> x` with `matvec(x) = b`, so an
  instance goes wherever a function `solve(matvec, b)` is expected.

Here `b` is any pytree of real floating-point arrays (the direct solvers' `init`, `solve`
and `transpose_solve` also take complex ones: `LinearSolver.solves_complex`) and `matvec`
is a linear JAX function mapping pytrees of that structure to the same structure (it may
close over arrays, e.g. a matrix or the parameters of a Jacobian). Every solver

- works under `jax.jit` and `jax.vmap` (over `b` and over anything `matvec` closes over);
- is differentiable, in forward and reverse mode and to any order, with respect to `b` and
  to the values `matvec` closes over. The derivative is computed implicitly through
  `custom_linear_solve` (another solve with the same method, on the transposed operator in
  reverse mode), never by differentiating through the iterations;
- checks its own answer (unless `throw=False`): after solving it evaluates the residual
  `||matvec(x) - b||` and raises if it exceeds `RESIDUAL_SLACK * max(rtol * ||b||, atol)`
  or if `x` is not finite. The check also runs for the solves made by differentiation.
  `jax.scipy.sparse.linalg` never reports failure, so without this check an unconverged
  solve would silently return a wrong answer (and wrong gradients).

The functions `dense`, `cg`, `normal_cg`, `gmres`, `bicgstab`, `neumann` and `auto` are the
one-shot forms: `cg(matvec, b, rtol=1e-8)` is `CG(rtol=1e-8)(matvec, b)`. `SOLVERS` maps
the names (`"dense"`, `"cg"`, ...) to the classes, and `resolve` turns a name, an instance
or a function into the solver it stands for: the strings that `solvers.root`,
`solvers.minimize` and `solvers.fixed_point` accept are aliases of the classes.

Which solver to use:

| Situation                                                        | Solver                        |
|------------------------------------------------------------------|-------------------------------|
| Up to a few hundred unknowns                                     | `Dense` (LU, exact)           |
| Banded (locally coupled: semi-discretised PDEs, chains)          | `Banded(lower, upper)` (band  |
|                                                                  | LU from a few matvecs)        |
| Sparse with a known pattern (reaction networks, 2-D grids,       | `Sparse(pattern)` (colouring, |
| block-diagonal in any order); `sparsity_pattern` finds it (by    | reordering, band LU)          |
| evaluation, or traced from the operations of a function)         |                               |
| Unsure                                                           | `Auto` (dense / cg / gmres)   |
| Large, symmetric positive definite (convex Hessians, J^T J + cI) | `CG`                          |
| Large, non-symmetric                                             | `GMRES`, or `BiCGStab`        |
|                                                                  | (constant memory)             |
| Large, well-conditioned, but GMRES/BiCGStab stagnate; symmetric  | `NormalCG` (CG on A^T A:      |
| indefinite                                                       | squares the condition number) |
| A = I - J, J the Jacobian of a contractive fixed-point map       | `Neumann` (matvecs only)      |
| (the backward pass of a fixed-point solver)                      |                               |
| Ill-conditioned (condition number above ~1e6)                    | `Dense` if it fits, else      |
|                                                                  | float64 and preconditioning   |

No solver takes a preconditioner yet: to precondition, solve the equivalent system
`M(matvec(x)) = M(b)` with a cheap `M` close to the inverse of the operator.

Tolerances. The iterative solvers stop when `||matvec(x) - b|| <= max(rtol * ||b||, atol)`
(2-norm over all leaves of the pytree). The default `rtol` follows the dtype of `b` (the
widest one if its leaves differ): `1e-10` for float64, `1e-5` for float32 and `1e-2` for
16-bit floats; the default `atol` is `0`. The convergence check allows an extra factor
`RESIDUAL_SLACK = 10`, because the Krylov methods track an updated residual that can drift
a little from the true one.

Errors. A failed check raises at run time through `implicitdiff.error_if`; see there for
the exception type: `jax.errors.JaxRuntimeError` (a `RuntimeError`), or a `ValueError`
with the same text when jit serves the call from its cached fast path; catch
`(RuntimeError, ValueError)`. The message names the solver, the residual reached, the
tolerance, `maxiter` and what to try next.

Example:
    ```python
    import jax, jax.numpy as jnp
    from implicitdiff import linear_solve

    A = jnp.array([[4.0, 1.0], [1.0, 3.0]])
    b = jnp.array([1.0, 2.0])
    x = linear_solve.cg(lambda v: A @ v, b)           # [0.0909, 0.6364]
    g = jax.grad(lambda b: linear_solve.GMRES()(lambda v: A @ v, b).sum())(b)

    solver = linear_solve.Dense()
    state = solver.init(lambda v: A @ v, b)           # factor once ...
    x, y = solver.solve(state, b), solver.transpose_solve(state, b)  # ... solve twice
    ```
"""

from ._auto import AUTO_DENSE_MAX_SIZE, Auto, auto, auto_method
from ._banded import Banded, BandedState
from ._base import LinearSolver
from ._checks import RESIDUAL_SLACK
from ._dense import Dense, DenseState, dense
from ._iterative import IterativeOptions, IterativeSolver
from ._krylov import CG, GMRES, BiCGStab, NormalCG, bicgstab, cg, gmres, normal_cg
from ._neumann import NEUMANN_DEFAULT_MAXITER, Neumann, neumann
from ._registry import SOLVERS, resolve
from ._sparse import Sparse, SparsityPattern, sparsity_pattern

__all__ = [
    "LinearSolver",
    "IterativeOptions",
    "IterativeSolver",
    "Dense",
    "DenseState",
    "Banded",
    "BandedState",
    "Sparse",
    "SparsityPattern",
    "sparsity_pattern",
    "CG",
    "NormalCG",
    "GMRES",
    "BiCGStab",
    "Neumann",
    "Auto",
    "SOLVERS",
    "resolve",
    "dense",
    "cg",
    "normal_cg",
    "gmres",
    "bicgstab",
    "neumann",
    "auto",
    "auto_method",
    "AUTO_DENSE_MAX_SIZE",
    "RESIDUAL_SLACK",
    "NEUMANN_DEFAULT_MAXITER",
]
