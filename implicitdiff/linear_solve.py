"""Linear solvers for the tangent and adjoint systems of implicit differentiation.

Every solver has the form `solver(matvec, b, *, options) -> x` and returns `x` with
`matvec(x) = b`. Here `b` is any pytree of real floating-point arrays and `matvec` is a
linear JAX function mapping pytrees of that structure to the same structure (it may close
over arrays, e.g. a matrix or the parameters of a Jacobian). Every solver

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

Which solver to use:

| Situation                                                        | Solver                        |
|------------------------------------------------------------------|-------------------------------|
| Up to a few hundred unknowns                                     | `dense` (LU, exact)           |
| Unsure                                                           | `auto` (dense / cg / gmres)   |
| Large, symmetric positive definite (convex Hessians, J^T J + cI) | `cg`                          |
| Large, non-symmetric                                             | `gmres`, or `bicgstab`        |
|                                                                  | (constant memory)             |
| Large, well-conditioned, but GMRES/BiCGStab stagnate; symmetric  | `normal_cg` (CG on A^T A:     |
| indefinite                                                       | squares the condition number) |
| A = I - J, J the Jacobian of a contractive fixed-point map       | `neumann` (matvecs only)      |
| (the backward pass of a fixed-point solver)                      |                               |
| Ill-conditioned (condition number above ~1e6)                    | `dense` if it fits, else      |
|                                                                  | float64 and preconditioning   |

No solver takes a preconditioner argument: to precondition, solve the equivalent system
`M(matvec(x)) = M(b)` with a cheap `M` close to the inverse of the operator.

Tolerances. The iterative solvers stop when `||matvec(x) - b|| <= max(rtol * ||b||, atol)`
(2-norm over all leaves of the pytree). The default `rtol` follows the dtype of `b` (the
widest one if its leaves differ): `1e-10` for float64, `1e-5` for float32 and `1e-2` for
16-bit floats; the default `atol` is `0`. The convergence check allows an extra factor
`RESIDUAL_SLACK = 10`, because the Krylov methods track an updated residual that can drift
a little from the true one.

Errors. A failed check raises at run time through `implicitdiff._errors.error_if`; see
there for the exception type: `jax.errors.JaxRuntimeError` (a `RuntimeError`), or a
`ValueError` with the same text when jit serves the call from its cached fast path
(jax-ml/jax#34083); catch `(RuntimeError, ValueError)`. The message names the solver, the
residual reached, the tolerance, `maxiter` and what to try next.

Example:
    ```python
    import jax, jax.numpy as jnp
    from implicitdiff import linear_solve

    A = jnp.array([[4.0, 1.0], [1.0, 3.0]])
    b = jnp.array([1.0, 2.0])
    x = linear_solve.cg(lambda v: A @ v, b)           # [0.0909, 0.6364]
    g = jax.grad(lambda b: linear_solve.gmres(lambda v: A @ v, b).sum())(b)
    ```
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import jax.scipy.sparse.linalg as jsp_linalg
import numpy as np
from jax.flatten_util import ravel_pytree

from ._errors import any_over_batch, error_if
from .linear_system import custom_linear_solve

__all__ = [
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

PyTree = Any
MatVec = Callable[[PyTree], PyTree]

#: `auto` solves systems with at most this many unknowns (summed over the leaves of `b`)
#: with `dense`.
AUTO_DENSE_MAX_SIZE: int = 256

#: Factor by which the true residual may exceed `max(rtol * ||b||, atol)` before an
#: iterative solve counts as failed.
RESIDUAL_SLACK: float = 10.0

#: Default iteration cap of `neumann` (its convergence speed depends on the spectral radius
#: of `I - A`, not on the size of the system).
NEUMANN_DEFAULT_MAXITER: int = 1000


# ---------------------------------------------------------------------------
# Argument checking and small helpers.


def _prepare_b(b: PyTree, name: str) -> tuple[PyTree, int, Any]:
    """Convert the leaves of `b` to arrays; check they are real floats. Returns
    `(b, total size, common dtype)`."""
    leaves, treedef = jax.tree_util.tree_flatten(b)
    arrays = []
    for i, leaf in enumerate(leaves):
        arr = jnp.asarray(leaf)
        if not jnp.issubdtype(arr.dtype, jnp.floating):
            raise TypeError(
                f"linear_solve.{name}: `b` must contain real floating-point arrays, but leaf "
                f"{i} has dtype {arr.dtype}. Convert it first, e.g. `jnp.asarray(b, float)`."
                + (
                    " Complex systems are not supported; split them into real and imaginary parts."
                    if jnp.issubdtype(arr.dtype, jnp.complexfloating)
                    else ""
                )
            )
        arrays.append(arr)
    size = sum(int(a.size) for a in arrays)
    dtype = jnp.result_type(*arrays) if arrays else jnp.float32
    return jax.tree_util.tree_unflatten(treedef, arrays), size, dtype


def _default_rtol(dtype: Any) -> float:
    bits = jnp.finfo(dtype).bits
    if bits >= 64:
        return 1e-10
    if bits >= 32:
        return 1e-5
    return 1e-2


def _check_tol(value: Any, arg: str, name: str) -> None:
    if isinstance(value, jax.core.Tracer):
        return  # a traced tolerance is allowed; it cannot be validated here
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise TypeError(
            f"linear_solve.{name}: `{arg}` must be a non-negative number, got {value!r}."
        ) from None
    if not (v >= 0 and math.isfinite(v)):
        raise ValueError(
            f"linear_solve.{name}: `{arg}` must be a finite number >= 0, got {value!r}. "
            f"Use e.g. `{arg}=1e-6`."
        )


def _check_int(value: Any, arg: str, name: str, *, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(
            f"linear_solve.{name}: `{arg}` must be a Python int (static, not a traced "
            f"array), got {value!r}."
        )
    if value < minimum:
        raise ValueError(
            f"linear_solve.{name}: `{arg}` must be >= {minimum}, got {value}. "
            f"Pass a positive number of iterations, e.g. `{arg}=100`."
        )
    return int(value)


def _resolve(
    name: str, b: PyTree, rtol: Any, atol: Any, maxiter: int | None, x0: PyTree | None
) -> tuple[PyTree, int, Any, Any, int | None, PyTree | None]:
    b, size, dtype = _prepare_b(b, name)
    if rtol is None:
        rtol = _default_rtol(dtype)
    _check_tol(rtol, "rtol", name)
    _check_tol(atol, "atol", name)
    if maxiter is not None:
        maxiter = _check_int(maxiter, "maxiter", name)
    if x0 is not None:
        x0_leaves, x0_tree = jax.tree_util.tree_flatten(x0)
        b_leaves, b_tree = jax.tree_util.tree_flatten(b)
        if x0_tree != b_tree:
            raise ValueError(
                f"linear_solve.{name}: `x0` must have the same pytree structure as `b`; "
                f"got {x0_tree} and {b_tree}."
            )
        x0_leaves = [jnp.asarray(v, dtype=bl.dtype) for v, bl in zip(x0_leaves, b_leaves)]
        for v, bl in zip(x0_leaves, b_leaves):
            if v.shape != bl.shape:
                raise ValueError(
                    f"linear_solve.{name}: `x0` must have the same shapes as `b`; got a leaf "
                    f"of shape {v.shape} where `b` has {bl.shape}."
                )
        x0 = jax.tree_util.tree_unflatten(x0_tree, x0_leaves)
    return b, size, dtype, rtol, maxiter, x0


def _check_throw(throw: Any, name: str) -> None:
    if not isinstance(throw, bool):
        raise TypeError(f"linear_solve.{name}: `throw` must be True or False, got {throw!r}.")


def _tree_sub(a: PyTree, b: PyTree) -> PyTree:
    return jax.tree_util.tree_map(operator.sub, a, b)


def _tree_norm(tree: PyTree) -> jax.Array:
    leaves = jax.tree_util.tree_leaves(tree)
    return jnp.sqrt(sum(jnp.sum(jnp.square(leaf)) for leaf in leaves))


def _all_finite(tree: PyTree) -> jax.Array:
    leaves = jax.tree_util.tree_leaves(tree)
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(leaf)) for leaf in leaves]))


_HINTS = {
    "cg": (
        "`cg` requires a symmetric positive definite operator; if yours is not, use "
        "`gmres`, `bicgstab` or `dense`"
    ),
    "normal_cg": (
        "`normal_cg` squares the condition number of the operator, so it is slow on "
        "ill-conditioned systems; try `gmres` or `dense`"
    ),
    "gmres": "a larger `restart` can also help when GMRES stagnates",
    "bicgstab": "BiCGStab can break down on some operators; `gmres` is more robust",
    "neumann": (
        "the Neumann (Richardson) iteration only converges when the spectral radius of "
        "I - A is below 1 (for a fixed-point backward pass, A = I - J: the fixed-point map "
        "must be a contraction at the solution); otherwise use `gmres` or `dense`"
    ),
}


def _check_converged(
    name: str,
    matvec: MatVec,
    b: PyTree,
    x: PyTree,
    rtol: Any,
    atol: Any,
    maxiter: int,
    iter_word: str = "iterations",
    residual: PyTree | None = None,
) -> PyTree:
    """Attach the residual check of an iterative solve to its result `x`.

    `residual` is `b - matvec(x)` when the solver already has it (saving a matvec)."""
    if residual is None:
        residual = _tree_sub(matvec(x), b)
    rnorm = _tree_norm(residual)
    tol = jnp.maximum(rtol * _tree_norm(b), atol).astype(rnorm.dtype)
    failed = jnp.logical_not(rnorm <= RESIDUAL_SLACK * tol)
    failed = jnp.logical_or(failed, jnp.logical_not(_all_finite(x)))
    msg = (
        f"implicitdiff.linear_solve.{name} did not converge: the residual "
        "||matvec(x) - b|| = {residual:.3e} is above the tolerance "
        "max(rtol * ||b||, atol) = {tol:.3e} "
        f"(allowing a factor RESIDUAL_SLACK={RESIDUAL_SLACK:g}) after maxiter={maxiter} "
        f"{iter_word}. A NaN/inf residual means the solution is not finite (a singular "
        "operator or a diverging iteration). To fix it: raise `maxiter`, loosen `rtol`/`atol`, "
        "precondition the system (solve M(matvec(x)) = M(b) with M close to the inverse), "
        "or choose another solver, e.g. "
        "`implicitdiff.linear_solve.dense` for small systems. "
        f"Note: {_HINTS[name]}. Pass `throw=False` to skip this check."
    )
    return error_if(x, failed, msg, values={"residual": rnorm, "tol": tol})


# ---------------------------------------------------------------------------
# dense


def _dense_kernel(matvec: MatVec, b: PyTree, *, throw: bool) -> PyTree:
    flat_b, unravel = ravel_pytree(b)

    def flat_matvec(v):
        return ravel_pytree(matvec(unravel(v)))[0]

    eye = jnp.eye(flat_b.size, dtype=flat_b.dtype)
    matrix = jax.vmap(flat_matvec, out_axes=1)(eye)  # column i = A e_i
    x = unravel(jnp.linalg.solve(matrix, flat_b))
    if throw:
        msg = (
            "implicitdiff.linear_solve.dense: the solution is not finite (NaN or inf), so the "
            "matrix is singular (or b is not finite). To fix it: make the system non-singular "
            "(e.g. add a small multiple of the identity: matvec(x) + eps * x), check the "
            "inputs for NaN, or use `normal_cg`/`gmres` for a least-squares-like answer. "
            "Pass `throw=False` to skip this check."
        )
        x = error_if(x, jnp.logical_not(_all_finite(x)), msg)
    return x


def dense(matvec: MatVec, b: PyTree, *, symmetric: bool = False, throw: bool = True) -> PyTree:
    """Solve `matvec(x) = b` by building the matrix and using an LU factorisation.

    The operator is materialised by applying `matvec` (vectorised with `jax.vmap`) to the
    columns of the identity, on the flattened unknowns (`jax.flatten_util.ravel_pytree`),
    then `jnp.linalg.solve` is called. Cost: `n` matvecs, `O(n^2)` memory and `O(n^3)`
    time for `n` unknowns, so use it for small systems (up to a few hundred or thousand
    unknowns). It is exact up to rounding whatever the symmetry or conditioning.

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
    _check_throw(throw, "dense")
    b, size, _ = _prepare_b(b, "dense")
    if size == 0:
        return b

    def solve(mv, rhs):
        return _dense_kernel(mv, rhs, throw=throw)

    return custom_linear_solve(matvec, b, solve, transpose_solve=solve, symmetric=bool(symmetric))


def _iterative(
    name: str,
    kernel: Callable[..., PyTree],
    matvec: MatVec,
    b: PyTree,
    *,
    rtol: Any,
    atol: Any,
    maxiter: int | None,
    x0: PyTree | None,
    throw: bool,
    default_maxiter: Callable[[int], int],
    symmetric: bool = False,
    **kernel_opts: Any,
) -> PyTree:
    """The shared wrapper: check the options, then `kernel` inside `custom_linear_solve`
    (the transpose solve is the same kernel on the transposed operator, started at 0)."""
    _check_throw(throw, name)
    b, size, _, rtol, maxiter, x0 = _resolve(name, b, rtol, atol, maxiter, x0)
    if size == 0:
        return b
    maxiter = default_maxiter(size) if maxiter is None else maxiter
    opts = dict(rtol=rtol, atol=atol, maxiter=maxiter, throw=throw, **kernel_opts)

    def solve(mv, rhs):
        return kernel(mv, rhs, x0, **opts)

    def transpose_solve(mv, rhs):
        return kernel(mv, rhs, None, **opts)

    return custom_linear_solve(
        matvec, b, solve, transpose_solve=transpose_solve, symmetric=symmetric
    )


# ---------------------------------------------------------------------------
# Krylov solvers from jax.scipy.sparse.linalg, with a convergence check.


def _cg_kernel(mv, rhs, x0, *, rtol, atol, maxiter, throw):
    x, _ = jsp_linalg.cg(mv, rhs, x0=x0, tol=rtol, atol=atol, maxiter=maxiter)
    if throw:
        x = _check_converged("cg", mv, rhs, x, rtol, atol, maxiter)
    return x


def cg(
    matvec: MatVec,
    b: PyTree,
    *,
    rtol: float | None = None,
    atol: float = 0.0,
    maxiter: int | None = None,
    x0: PyTree | None = None,
    throw: bool = True,
) -> PyTree:
    """Solve `matvec(x) = b` with the conjugate gradient method.

    `matvec` must be symmetric positive definite (e.g. a Hessian of a strictly convex
    function, or `J^T J + lambda I`). For other operators CG may fail silently in exact
    arithmetic; the residual check then reports the failure. Reverse-mode derivatives reuse
    `matvec` (no transposition needed). Uses `jax.scipy.sparse.linalg.cg`.

    Arguments:
        matvec: symmetric positive definite linear function on pytrees shaped like `b`.
        b: right-hand side, a pytree of real floating-point arrays.
        rtol: relative tolerance; default `1e-10` (float64), `1e-5` (float32), `1e-2`
            (16-bit).
        atol: absolute tolerance; convergence means
            `||matvec(x) - b|| <= max(rtol * ||b||, atol)`.
        maxiter: maximum number of iterations; default `10 * n` for `n` unknowns.
        x0: initial guess (same structure as `b`); default zeros. It is also the starting
            point of the tangent/adjoint solves that differentiation performs, which does
            not change their result.
        throw: if True (default), raise at run time when the residual stays above
            `RESIDUAL_SLACK * max(rtol * ||b||, atol)` or `x` is not finite. If False, return
            whatever the iteration reached, without checking (and without the extra matvec
            the check costs).

    Returns:
        `x`, a pytree with the structure of `b`.

    Example:
        ```python
        import jax.numpy as jnp
        from implicitdiff import linear_solve

        A = jnp.array([[4.0, 1.0], [1.0, 3.0]])
        x = linear_solve.cg(lambda v: A @ v, jnp.array([1.0, 2.0]))  # [0.0909, 0.6364]
        ```
    """
    return _iterative(
        "cg",
        _cg_kernel,
        matvec,
        b,
        rtol=rtol,
        atol=atol,
        maxiter=maxiter,
        x0=x0,
        throw=throw,
        default_maxiter=lambda n: 10 * n,
        symmetric=True,
    )


def _normal_cg_kernel(mv, rhs, x0, *, rtol, atol, maxiter, throw):
    mv_t = jax.linear_transpose(mv, rhs)

    def normal(v):
        return mv_t(mv(v))[0]

    x, _ = jsp_linalg.cg(normal, mv_t(rhs)[0], x0=x0, tol=rtol, atol=atol, maxiter=maxiter)
    if throw:
        x = _check_converged("normal_cg", mv, rhs, x, rtol, atol, maxiter)
    return x


def normal_cg(
    matvec: MatVec,
    b: PyTree,
    *,
    rtol: float | None = None,
    atol: float = 0.0,
    maxiter: int | None = None,
    x0: PyTree | None = None,
    throw: bool = True,
) -> PyTree:
    """Solve `matvec(x) = b` by conjugate gradients on the normal equations `A^T A x = A^T b`.

    Works for any non-singular `A` (`A^T` is obtained with `jax.linear_transpose`, so
    `matvec` must be transposable JAX code). The price is that the condition number is
    squared, so convergence is slow on ill-conditioned systems. The inner CG stops on the
    normal-equation residual; the convergence check (with `throw=True`) is made on the
    original residual `||matvec(x) - b||`.

    Arguments:
        matvec: non-singular linear function on pytrees shaped like `b`.
        b: right-hand side, a pytree of real floating-point arrays.
        rtol: relative tolerance; default `1e-10` (float64), `1e-5` (float32), `1e-2`
            (16-bit).
        atol: absolute tolerance.
        maxiter: maximum number of CG iterations (each costs one `A` and one `A^T`
            product); default `10 * n`.
        x0: initial guess, default zeros (also used to start the derivative solves).
        throw: if True (default), raise at run time when the residual check fails or `x`
            is not finite; if False, return without checking.

    Returns:
        `x`, a pytree with the structure of `b`.

    Example:
        ```python
        import jax.numpy as jnp
        from implicitdiff import linear_solve

        A = jnp.array([[0.0, 1.0], [1.0, 0.0]])  # symmetric but indefinite
        x = linear_solve.normal_cg(lambda v: A @ v, jnp.array([2.0, 3.0]))  # [3., 2.]
        ```
    """
    return _iterative(
        "normal_cg",
        _normal_cg_kernel,
        matvec,
        b,
        rtol=rtol,
        atol=atol,
        maxiter=maxiter,
        x0=x0,
        throw=throw,
        default_maxiter=lambda n: 10 * n,
    )


def _gmres_kernel(mv, rhs, x0, *, rtol, atol, restart, maxiter, throw):
    x, _ = jsp_linalg.gmres(mv, rhs, x0=x0, tol=rtol, atol=atol, restart=restart, maxiter=maxiter)
    if throw:
        # JAX's GMRES treats vectors shorter than machine epsilon as zero (it returns
        # x = 0 for such a b), so its accuracy has that absolute floor.
        eps = jnp.finfo(jnp.result_type(*jax.tree_util.tree_leaves(rhs))).eps
        x = _check_converged(
            "gmres",
            mv,
            rhs,
            x,
            rtol,
            jnp.maximum(atol, eps),
            maxiter,
            f"restart cycles of {restart} iterations",
        )
    return x


def gmres(
    matvec: MatVec,
    b: PyTree,
    *,
    rtol: float | None = None,
    atol: float = 0.0,
    restart: int = 20,
    maxiter: int | None = None,
    x0: PyTree | None = None,
    throw: bool = True,
) -> PyTree:
    """Solve `matvec(x) = b` with restarted GMRES (`jax.scipy.sparse.linalg.gmres`).

    For general (non-symmetric) non-singular operators. Memory grows with `restart`
    (`restart + 1` vectors are stored).

    Arguments:
        matvec: linear function on pytrees shaped like `b`.
        b: right-hand side, a pytree of real floating-point arrays.
        rtol: relative tolerance; default `1e-10` (float64), `1e-5` (float32), `1e-2`
            (16-bit).
        atol: absolute tolerance.
        restart: size of the Krylov subspace built before each restart (capped at the
            number of unknowns). Larger values are more robust and use more memory.
        maxiter: maximum number of restart cycles (as in SciPy and JAX, not individual
            iterations); default `ceil(10 * n / restart)`, i.e. about `10 * n` matvecs.
        x0: initial guess, default zeros (also used to start the derivative solves).
        throw: if True (default), raise at run time when the residual check fails or `x`
            is not finite; if False, return without checking.

    Returns:
        `x`, a pytree with the structure of `b`.

    Example:
        ```python
        import jax.numpy as jnp
        from implicitdiff import linear_solve

        A = jnp.array([[2.0, 1.0], [0.0, 3.0]])
        x = linear_solve.gmres(lambda v: A @ v, jnp.array([3.0, 3.0]))  # [1., 1.]
        ```
    """
    _check_throw(throw, "gmres")
    restart = _check_int(restart, "restart", "gmres")
    b, size, _, rtol, maxiter, x0 = _resolve("gmres", b, rtol, atol, maxiter, x0)
    if size == 0:
        return b
    restart = min(restart, size)
    maxiter = -(-10 * size // restart) if maxiter is None else maxiter
    opts = dict(rtol=rtol, atol=atol, restart=restart, maxiter=maxiter, throw=throw)

    def solve(mv, rhs):
        return _gmres_kernel(mv, rhs, x0, **opts)

    def transpose_solve(mv, rhs):
        return _gmres_kernel(mv, rhs, None, **opts)

    return custom_linear_solve(matvec, b, solve, transpose_solve=transpose_solve)


def _bicgstab_kernel(mv, rhs, x0, *, rtol, atol, maxiter, throw):
    x, _ = jsp_linalg.bicgstab(mv, rhs, x0=x0, tol=rtol, atol=atol, maxiter=maxiter)
    if throw:
        x = _check_converged("bicgstab", mv, rhs, x, rtol, atol, maxiter)
    return x


def bicgstab(
    matvec: MatVec,
    b: PyTree,
    *,
    rtol: float | None = None,
    atol: float = 0.0,
    maxiter: int | None = None,
    x0: PyTree | None = None,
    throw: bool = True,
) -> PyTree:
    """Solve `matvec(x) = b` with BiCGStab (`jax.scipy.sparse.linalg.bicgstab`).

    For general non-symmetric operators, with constant memory (unlike GMRES); it may
    stagnate or break down on some operators, which the residual check reports.

    Arguments:
        matvec: linear function on pytrees shaped like `b`.
        b: right-hand side, a pytree of real floating-point arrays.
        rtol: relative tolerance; default `1e-10` (float64), `1e-5` (float32), `1e-2`
            (16-bit).
        atol: absolute tolerance.
        maxiter: maximum number of iterations (two matvecs each); default `10 * n`.
        x0: initial guess, default zeros (also used to start the derivative solves).
        throw: if True (default), raise at run time when the residual check fails or `x`
            is not finite; if False, return without checking.

    Returns:
        `x`, a pytree with the structure of `b`.

    Example:
        ```python
        import jax.numpy as jnp
        from implicitdiff import linear_solve

        A = jnp.array([[2.0, 1.0], [0.0, 3.0]])
        x = linear_solve.bicgstab(lambda v: A @ v, jnp.array([3.0, 3.0]))  # [1., 1.]
        ```
    """
    return _iterative(
        "bicgstab",
        _bicgstab_kernel,
        matvec,
        b,
        rtol=rtol,
        atol=atol,
        maxiter=maxiter,
        x0=x0,
        throw=throw,
        default_maxiter=lambda n: 10 * n,
    )


# ---------------------------------------------------------------------------
# neumann


def _neumann_kernel(mv, rhs, x0, *, rtol, atol, maxiter, throw):
    tol = jnp.maximum(rtol * _tree_norm(rhs), atol)
    if x0 is None:  # the first step from zero, x = b, taken here
        x, k = rhs, 1
    else:
        x, k = x0, 0
    r = _tree_sub(rhs, mv(x))

    def keep_going(state):
        _, r, k = state
        rnorm = _tree_norm(r)
        # Under vmap the loop runs until every element has converged (the converged
        # ones keep iterating, which only shrinks their residual): one loop over the
        # batch rather than one masked loop per element.
        return (k < maxiter) & any_over_batch((rnorm > tol) & jnp.isfinite(rnorm))

    def step(state):
        x, r, k = state
        x = jax.tree_util.tree_map(operator.add, x, r)  # x + (b - A x)
        return x, _tree_sub(rhs, mv(x)), k + 1

    x, r, _ = jax.lax.while_loop(keep_going, step, (x, r, k))
    if throw:
        x = _check_converged("neumann", mv, rhs, x, rtol, atol, maxiter, residual=r)
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
) -> PyTree:
    """Solve `matvec(x) = b` with the Richardson / Neumann-series iteration.

    Iterates `x <- x + (b - matvec(x))` from `x0` (default zero). Writing
    `matvec = I - J`, this sums the Neumann series `b + J b + J^2 b + ...`, which converges
    exactly when the spectral radius of `J = I - A` is below 1 (the rate is that radius).
    This is the natural solver for the backward pass of a fixed-point iteration
    `z = f(z)`, where `A = I - df/dz` and `f` is a contraction: it needs one matvec per step
    and no extra memory. It stops when `||b - matvec(x)|| <= max(rtol * ||b||, atol)`, after
    `maxiter` steps, or when the residual stops being finite. Under `vmap` the batch is
    one loop: it stops when every element has, and the converged elements keep
    iterating until then (which only shrinks their residuals).

    Arguments:
        matvec: linear function on pytrees shaped like `b`, with `I - matvec` of spectral
            radius below 1.
        b: right-hand side, a pytree of real floating-point arrays.
        rtol: relative tolerance; default `1e-10` (float64), `1e-5` (float32), `1e-2`
            (16-bit).
        atol: absolute tolerance.
        maxiter: maximum number of steps; default `NEUMANN_DEFAULT_MAXITER` (1000).
        x0: initial guess, default zeros (also used to start the derivative solves).
        throw: if True (default), raise at run time when the residual check fails, which
            includes the divergent case (spectral radius >= 1); if False, return without
            checking.

    Returns:
        `x`, a pytree with the structure of `b`.

    Example:
        ```python
        import jax.numpy as jnp
        from implicitdiff import linear_solve

        J = jnp.array([[0.5, 0.0], [0.25, 0.25]])  # spectral radius 0.5
        x = linear_solve.neumann(lambda v: v - J @ v, jnp.array([1.0, 1.0]))  # [2., 2.]
        ```
    """
    return _iterative(
        "neumann",
        _neumann_kernel,
        matvec,
        b,
        rtol=rtol,
        atol=atol,
        maxiter=maxiter,
        x0=x0,
        throw=throw,
        default_maxiter=lambda n: NEUMANN_DEFAULT_MAXITER,
    )


# ---------------------------------------------------------------------------
# auto


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
) -> PyTree:
    """Solve `matvec(x) = b` with a solver picked from the size of the system.

    Small systems (at most `AUTO_DENSE_MAX_SIZE` = 256 unknowns) use `dense`, which is
    exact and, at that size, usually fastest. Larger ones use `cg` when `symmetric=True`
    (the operator must then be symmetric positive definite) and `gmres` otherwise. See
    `auto_method` for the choice alone.

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
        `x`, a pytree with the structure of `b`.

    Example:
        ```python
        import jax.numpy as jnp
        from implicitdiff import linear_solve

        A = jnp.array([[2.0, 1.0], [0.0, 3.0]])
        x = linear_solve.auto(lambda v: A @ v, jnp.array([3.0, 3.0]))  # dense: [1., 1.]
        ```
    """
    method = auto_method(b, symmetric=symmetric)
    if method == "dense":
        _resolve("auto", b, rtol, atol, maxiter, x0)  # validate options all the same
        return dense(matvec, b, symmetric=bool(symmetric), throw=throw)
    solver = cg if method == "cg" else gmres
    return solver(matvec, b, rtol=rtol, atol=atol, maxiter=maxiter, x0=x0, throw=throw)
