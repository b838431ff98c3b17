"""Checks of the linear solvers' options and right-hand sides, and the convergence check
that every iterative solve attaches to its answer."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._checks import find_mismatch
from .._errors import error_if
from .._trees import all_finite, tree_norm, tree_sub

__all__ = [
    "RESIDUAL_SLACK",
    "prepare_b",
    "as_arrays",
    "default_rtol",
    "check_tol",
    "check_int",
    "check_throw",
    "check_x0",
    "check_iterative_options",
    "check_converged",
]

PyTree = Any
MatVec = Callable[[PyTree], PyTree]

#: Factor by which the true residual may exceed `max(rtol * ||b||, atol)` before an
#: iterative solve counts as failed.
RESIDUAL_SLACK: float = 10.0


def prepare_b(b: PyTree, name: str) -> tuple[PyTree, int, Any]:
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


def as_arrays(b_like: PyTree) -> PyTree:
    """`b_like` with `jax.ShapeDtypeStruct` leaves replaced by zeros of their type."""
    return jax.tree_util.tree_map(
        lambda v: jnp.zeros(v.shape, v.dtype) if isinstance(v, jax.ShapeDtypeStruct) else v,
        b_like,
    )


def default_rtol(dtype: Any) -> float:
    """`1e-10` for float64, `1e-5` for float32, `1e-2` for 16-bit floats."""
    bits = jnp.finfo(dtype).bits
    if bits >= 64:
        return 1e-10
    if bits >= 32:
        return 1e-5
    return 1e-2


def check_tol(value: Any, arg: str, name: str) -> None:
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


def check_int(value: Any, arg: str, name: str, *, minimum: int = 1) -> int:
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


def check_throw(throw: Any, name: str) -> None:
    if not isinstance(throw, bool):
        raise TypeError(f"linear_solve.{name}: `throw` must be True or False, got {throw!r}.")


def check_x0(x0: PyTree | None, b: PyTree, name: str) -> PyTree | None:
    """`x0` with the dtypes of `b`, after checking its structure and shapes against `b`."""
    if x0 is None:
        return None
    m = find_mismatch(x0, b, dtypes=False)
    if m is not None and m.index is None:
        raise ValueError(
            f"linear_solve.{name}: `x0` must have the same pytree structure as `b`; "
            f"got {m.got} and {m.want}."
        )
    if m is not None:
        raise ValueError(
            f"linear_solve.{name}: `x0` must have the same shapes as `b`; got a leaf "
            f"of shape {tuple(m.got.shape)} where `b` has {tuple(m.want.shape)}."
        )
    return jax.tree_util.tree_map(lambda v, bl: jnp.asarray(v, dtype=bl.dtype), x0, b)


def check_iterative_options(name: str, rtol: Any, atol: Any, maxiter: Any, throw: Any) -> None:
    """The options of an iterative solve: `rtol` (None: from the dtype), `atol`,
    `maxiter` (None: the method's default) and `throw`."""
    check_throw(throw, name)
    if rtol is not None:
        check_tol(rtol, "rtol", name)
    check_tol(atol, "atol", name)
    if maxiter is not None:
        check_int(maxiter, "maxiter", name)


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


def check_converged(
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
        residual = tree_sub(matvec(x), b)
    rnorm = tree_norm(residual)
    tol = jnp.maximum(rtol * tree_norm(b), atol).astype(rnorm.dtype)
    failed = jnp.logical_not(rnorm <= RESIDUAL_SLACK * tol)
    failed = jnp.logical_or(failed, jnp.logical_not(all_finite(x)))
    hint = _HINTS.get(name, "")
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
        + (f"Note: {hint}. " if hint else "")
        + "Pass `throw=False` to skip this check."
    )
    return error_if(x, failed, msg, values={"residual": rnorm, "tol": tol})
