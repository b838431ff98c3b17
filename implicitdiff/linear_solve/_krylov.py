"""Krylov solvers from `jax.scipy.sparse.linalg`, with a convergence check: `CG`,
`NormalCG`, `GMRES`, `BiCGStab`, and their one-shot functions."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import jax.scipy.sparse.linalg as jsp_linalg

from ._base import MatVec, PyTree, transposed
from ._checks import check_converged, check_int
from ._iterative import IterativeSolver

__all__ = ["CG", "NormalCG", "GMRES", "BiCGStab", "cg", "normal_cg", "gmres", "bicgstab"]


@dataclasses.dataclass(frozen=True)
class CG(IterativeSolver):
    """The conjugate gradient method, for symmetric positive definite operators.

    For example a Hessian of a strictly convex function, or `J^T J + lambda I`. For other
    operators CG may fail silently in exact arithmetic; the residual check then reports
    the failure. Reverse-mode derivatives and `transpose_solve` reuse the operator (no
    transposition needed). Uses `jax.scipy.sparse.linalg.cg`. The options are those of
    `IterativeOptions` (`rtol`, `atol`, `maxiter`, default `10 * n` for `n` unknowns,
    `throw`).

    Example:
        ```python
        import jax.numpy as jnp
        from implicitdiff import linear_solve

        A = jnp.array([[4.0, 1.0], [1.0, 3.0]])
        x = linear_solve.CG(rtol=1e-6)(lambda v: A @ v, jnp.array([1.0, 2.0]))
        # [0.0909, 0.6364]
        ```
    """

    name: ClassVar[str] = "cg"
    symmetric: ClassVar[bool] = True

    def _iterate(self, matvec, b, x0, rtol, atol, maxiter):
        x, _ = jsp_linalg.cg(matvec, b, x0=x0, tol=rtol, atol=atol, maxiter=maxiter)
        if self.throw:
            x = check_converged(self.name, matvec, b, x, rtol, atol, maxiter)
        return x


@dataclasses.dataclass(frozen=True)
class NormalCG(IterativeSolver):
    """Conjugate gradients on the normal equations `A^T A x = A^T b`.

    Works for any non-singular `A` (`A^T` is obtained with `jax.linear_transpose`, so
    `matvec` must be transposable JAX code). The price is that the condition number is
    squared, so convergence is slow on ill-conditioned systems. The inner CG stops on the
    normal-equation residual; the convergence check (with `throw=True`) is made on the
    original residual `||matvec(x) - b||`. Options as `IterativeOptions`; `maxiter`
    (default `10 * n`) counts CG iterations, each one `A` and one `A^T` product.

    Example:
        ```python
        import jax.numpy as jnp
        from implicitdiff import linear_solve

        A = jnp.array([[0.0, 1.0], [1.0, 0.0]])  # symmetric but indefinite
        x = linear_solve.NormalCG()(lambda v: A @ v, jnp.array([2.0, 3.0]))  # [3., 2.]
        ```
    """

    name: ClassVar[str] = "normal_cg"

    def _iterate(self, matvec, b, x0, rtol, atol, maxiter):
        vecmat = transposed(matvec, b)

        def normal(v):
            return vecmat(matvec(v))

        x, _ = jsp_linalg.cg(normal, vecmat(b), x0=x0, tol=rtol, atol=atol, maxiter=maxiter)
        if self.throw:
            x = check_converged(self.name, matvec, b, x, rtol, atol, maxiter)
        return x


@dataclasses.dataclass(frozen=True)
class GMRES(IterativeSolver):
    """Restarted GMRES (`jax.scipy.sparse.linalg.gmres`), for general operators.

    For non-symmetric non-singular operators. Memory grows with `restart` (`restart + 1`
    vectors are stored). Options as `IterativeOptions`, plus:

    Arguments:
        restart: size of the Krylov subspace built before each restart (capped at the
            number of unknowns). Larger values are more robust and use more memory.

    `maxiter` counts restart cycles (as in SciPy and JAX, not individual iterations);
    default `ceil(10 * n / restart)`, i.e. about `10 * n` matvecs.

    Example:
        ```python
        import jax.numpy as jnp
        from implicitdiff import linear_solve

        A = jnp.array([[2.0, 1.0], [0.0, 3.0]])
        x = linear_solve.GMRES(rtol=1e-8)(lambda v: A @ v, jnp.array([3.0, 3.0]))  # [1., 1.]
        ```
    """

    name: ClassVar[str] = "gmres"
    restart: int = 20

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "restart", check_int(self.restart, "restart", self.name))

    def _restart(self, size: int) -> int:
        return min(self.restart, size)

    def _default_maxiter(self, size: int) -> int:
        return -(-10 * size // self._restart(size))

    def _iterate(self, matvec, b, x0, rtol, atol, maxiter):
        size = sum(int(jnp.size(leaf)) for leaf in jax.tree_util.tree_leaves(b))
        restart = self._restart(size)
        x, _ = jsp_linalg.gmres(
            matvec, b, x0=x0, tol=rtol, atol=atol, restart=restart, maxiter=maxiter
        )
        if self.throw:
            # JAX's GMRES treats vectors shorter than machine epsilon as zero (it returns
            # x = 0 for such a b), so its accuracy has that absolute floor.
            eps = jnp.finfo(jnp.result_type(*jax.tree_util.tree_leaves(b))).eps
            x = check_converged(
                self.name,
                matvec,
                b,
                x,
                rtol,
                jnp.maximum(atol, eps),
                maxiter,
                f"restart cycles of {restart} iterations",
            )
        return x


@dataclasses.dataclass(frozen=True)
class BiCGStab(IterativeSolver):
    """BiCGStab (`jax.scipy.sparse.linalg.bicgstab`), for general operators.

    For non-symmetric operators, with constant memory (unlike GMRES); it may stagnate or
    break down on some operators, which the residual check reports. Options as
    `IterativeOptions`; `maxiter` (default `10 * n`) counts iterations of two matvecs.

    Example:
        ```python
        import jax.numpy as jnp
        from implicitdiff import linear_solve

        A = jnp.array([[2.0, 1.0], [0.0, 3.0]])
        x = linear_solve.BiCGStab()(lambda v: A @ v, jnp.array([3.0, 3.0]))  # [1., 1.]
        ```
    """

    name: ClassVar[str] = "bicgstab"

    def _iterate(self, matvec, b, x0, rtol, atol, maxiter):
        x, _ = jsp_linalg.bicgstab(matvec, b, x0=x0, tol=rtol, atol=atol, maxiter=maxiter)
        if self.throw:
            x = check_converged(self.name, matvec, b, x, rtol, atol, maxiter)
        return x


# ---------------------------------------------------------------------------
# One-shot functions: `fn(matvec, b, x0=x0, **options)` is `Class(**options)(matvec, b, x0=x0)`.


def cg(
    matvec: MatVec,
    b: PyTree,
    *,
    rtol: float | None = None,
    atol: float = 0.0,
    maxiter: int | None = None,
    x0: PyTree | None = None,
    throw: bool = True,
) -> Any:
    """Solve `matvec(x) = b` with the conjugate gradient method (see `CG`).

    Arguments:
        matvec: symmetric positive definite linear function on pytrees shaped like `b`.
        b: right-hand side, a pytree of real floating-point arrays.
        rtol: relative tolerance; default `1e-10` (float64), `1e-5` (float32), `1e-2`
            (16-bit).
        atol: absolute tolerance; convergence means
            `||matvec(x) - b|| <= max(rtol * ||b||, atol)`.
        maxiter: maximum number of iterations; default `10 * n` for `n` unknowns.
        x0: initial guess (same structure as `b`); default zeros.
        throw: raise at run time when the residual check fails or `x` is not finite.

    Returns:
        `x`, a pytree with the structure of `b`: `CG(**options)(matvec, b, x0=x0)`.

    Example:
        ```python
        import jax.numpy as jnp
        from implicitdiff import linear_solve

        A = jnp.array([[4.0, 1.0], [1.0, 3.0]])
        x = linear_solve.cg(lambda v: A @ v, jnp.array([1.0, 2.0]))  # [0.0909, 0.6364]
        ```
    """
    return CG(rtol=rtol, atol=atol, maxiter=maxiter, throw=throw)(matvec, b, x0=x0)


def normal_cg(
    matvec: MatVec,
    b: PyTree,
    *,
    rtol: float | None = None,
    atol: float = 0.0,
    maxiter: int | None = None,
    x0: PyTree | None = None,
    throw: bool = True,
) -> Any:
    """Solve `matvec(x) = b` by CG on the normal equations `A^T A x = A^T b` (see `NormalCG`).

    Arguments:
        matvec: non-singular linear function on pytrees shaped like `b`, transposable.
        b: right-hand side, a pytree of real floating-point arrays.
        rtol: relative tolerance (default from the dtype of `b`, as `cg`).
        atol: absolute tolerance.
        maxiter: maximum number of CG iterations (one `A` and one `A^T` product each);
            default `10 * n`.
        x0: initial guess, default zeros.
        throw: raise at run time when the residual check fails or `x` is not finite.

    Returns:
        `x`, a pytree with the structure of `b`: `NormalCG(**options)(matvec, b, x0=x0)`.

    Example:
        ```python
        import jax.numpy as jnp
        from implicitdiff import linear_solve

        A = jnp.array([[0.0, 1.0], [1.0, 0.0]])  # symmetric but indefinite
        x = linear_solve.normal_cg(lambda v: A @ v, jnp.array([2.0, 3.0]))  # [3., 2.]
        ```
    """
    return NormalCG(rtol=rtol, atol=atol, maxiter=maxiter, throw=throw)(matvec, b, x0=x0)


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
) -> Any:
    """Solve `matvec(x) = b` with restarted GMRES (see `GMRES`).

    Arguments:
        matvec: linear function on pytrees shaped like `b`.
        b: right-hand side, a pytree of real floating-point arrays.
        rtol: relative tolerance (default from the dtype of `b`, as `cg`).
        atol: absolute tolerance.
        restart: size of the Krylov subspace built before each restart (capped at the
            number of unknowns).
        maxiter: maximum number of restart cycles; default `ceil(10 * n / restart)`.
        x0: initial guess, default zeros.
        throw: raise at run time when the residual check fails or `x` is not finite.

    Returns:
        `x`, a pytree with the structure of `b`: `GMRES(**options)(matvec, b, x0=x0)`.

    Example:
        ```python
        import jax.numpy as jnp
        from implicitdiff import linear_solve

        A = jnp.array([[2.0, 1.0], [0.0, 3.0]])
        x = linear_solve.gmres(lambda v: A @ v, jnp.array([3.0, 3.0]))  # [1., 1.]
        ```
    """
    solver = GMRES(rtol=rtol, atol=atol, restart=restart, maxiter=maxiter, throw=throw)
    return solver(matvec, b, x0=x0)


def bicgstab(
    matvec: MatVec,
    b: PyTree,
    *,
    rtol: float | None = None,
    atol: float = 0.0,
    maxiter: int | None = None,
    x0: PyTree | None = None,
    throw: bool = True,
) -> Any:
    """Solve `matvec(x) = b` with BiCGStab (see `BiCGStab`).

    Arguments:
        matvec: linear function on pytrees shaped like `b`.
        b: right-hand side, a pytree of real floating-point arrays.
        rtol: relative tolerance (default from the dtype of `b`, as `cg`).
        atol: absolute tolerance.
        maxiter: maximum number of iterations (two matvecs each); default `10 * n`.
        x0: initial guess, default zeros.
        throw: raise at run time when the residual check fails or `x` is not finite.

    Returns:
        `x`, a pytree with the structure of `b`: `BiCGStab(**options)(matvec, b, x0=x0)`.

    Example:
        ```python
        import jax.numpy as jnp
        from implicitdiff import linear_solve

        A = jnp.array([[2.0, 1.0], [0.0, 3.0]])
        x = linear_solve.bicgstab(lambda v: A @ v, jnp.array([3.0, 3.0]))  # [1., 1.]
        ```
    """
    return BiCGStab(rtol=rtol, atol=atol, maxiter=maxiter, throw=throw)(matvec, b, x0=x0)
