"""`implicit_diff`: give any solver implicit derivatives from its optimality condition.

A solver `solver(init, *params) -> x*` stops where `optimality_fun(x*, *params)`
is zero (a gradient for a minimiser, `g(x) - x` for a fixed point, a residual for
a root). The decorator hands the problem to `custom_root`: the solution is
computed by the solver exactly as written, and its derivatives with respect to
`params` come from the implicit function theorem, so the solver's iterations
are never differentiated (no memory grows with the iteration count, and the
solver may be anything, even non-differentiable code).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import jax

from . import linear_solve
from ._checks import find_mismatch
from ._trees import describe
from .linear_solve import LinearSolver
from .root import _check_real_unknowns, custom_root

__all__ = ["implicit_diff"]


def implicit_diff(
    optimality_fun: Callable[..., Any],
    *,
    solve: Callable[[Callable[[Any], Any], Any], Any] | None = None,
    has_aux: bool = False,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: differentiate a solver through the optimality condition it satisfies.

    The decorated `solver(init, *args, **kwargs)` returns `x*` with
    `optimality_fun(x*, *args, **kwargs) == 0`. Derivatives of `x*` with respect
    to `args` and `kwargs` (and anything `optimality_fun` closes over) follow
    from differentiating that identity:

        dx* = -(d_x F)^{-1} (d_params F) dparams,   F = optimality_fun,

    in forward mode (`jvp`, `jacfwd`, `hessian`) and reverse mode (`grad`,
    `jacrev`), at any order, under `jit` and `vmap`. `init` gets no derivative.

    Arguments:
        optimality_fun: `F(x, *params) -> residual`, with the residual shaped
            like `x`. Its parameters after the first are matched with the
            solver's arguments after `init`, by position and by keyword.
        solve: linear solver for systems with the Jacobian `d_x F`: a
            `linear_solve.LinearSolver` (default `linear_solve.Auto()`), prepared
            once at the solution (`Dense` factors `d_x F` once, and reverse mode
            reuses the factors for the transposed system), or any function
            `solve(matvec, b)` linear in `b` and transposable, as every function
            of `linear_solve` is. For minimisers `d_x F` is a Hessian, so
            `linear_solve.CG()` or `linear_solve.Dense(symmetric=True)` are good
            choices.
        has_aux: the solver returns `(x*, aux)`; `aux` is passed through
            without derivative.

    Returns:
        A decorator; the decorated solver has the original's signature.

    Example:
        ```python
        import jax, jax.numpy as jnp
        from implicitdiff import implicit_diff, linear_solve

        def ridge_optimality(w, X, y, lam):  # gradient of the ridge objective
            return X.T @ (X @ w - y) / len(y) + lam * w

        @implicit_diff(ridge_optimality, solve=linear_solve.CG())
        def ridge(init, X, y, lam):
            # Any solver will do; here a closed form stands in for an iterative one.
            n, d = X.shape
            return jnp.linalg.solve(X.T @ X / n + lam * jnp.eye(d), X.T @ y / n)

        X = jnp.array([[1.0, 2.0], [3.0, 4.0], [5.0, 7.0]])
        y = jnp.array([1.0, 0.0, 2.0])
        dw = jax.jacobian(lambda lam: ridge(jnp.zeros(2), X, y, lam=lam))(0.5)
        print(dw.shape)  # (2,)
        ```
    """
    if not callable(optimality_fun):
        raise TypeError(
            f"implicit_diff: `optimality_fun` must be callable, got {optimality_fun!r}; "
            "use it as @implicit_diff(optimality_fun, solve=...)"
        )
    if solve is None:
        solve = linear_solve.Auto()
    elif not callable(solve):
        raise TypeError(
            f"implicit_diff: `solve` must be a linear solver `solve(matvec, b)`, got {solve!r}"
        )
    try:
        signature = inspect.signature(optimality_fun)
    except (TypeError, ValueError):  # builtins without a signature: no checking
        signature = None
    tangent_solve = solve

    def decorator(solver: Callable[..., Any]) -> Callable[..., Any]:
        name = getattr(solver, "__name__", "solver")

        @functools.wraps(solver)
        def solver_with_implicit_derivatives(init: Any, *args: Any, **kwargs: Any) -> Any:
            if signature is not None:
                try:
                    signature.bind(init, *args, **kwargs)
                except TypeError as e:
                    raise TypeError(
                        f"implicit_diff: {name}'s arguments after `init` must fit the "
                        f"signature of optimality_fun{signature} after its first parameter "
                        f"(the solution), but they do not: {e}"
                    ) from None
            _check_shapes(optimality_fun, solver, name, init, args, kwargs, has_aux)
            if isinstance(tangent_solve, LinearSolver):
                _check_real_unknowns(init, "implicit_diff", ("init", "solve", "optimality_fun"))

            def residual(x):
                return optimality_fun(x, *args, **kwargs)

            def run_solver(_residual, x0):
                return solver(x0, *args, **kwargs)

            return custom_root(residual, init, run_solver, tangent_solve, has_aux=has_aux)

        return solver_with_implicit_derivatives

    return decorator


def _check_shapes(optimality_fun, solver, name, init, args, kwargs, has_aux):
    """Name the culprit when `init`, the solution and the residual disagree."""
    try:
        sol = jax.eval_shape(lambda x0: solver(x0, *args, **kwargs), init)
    except TypeError as e:
        raise TypeError(
            f"implicit_diff: calling {name}(init, ...) failed with `init` of type "
            f"{describe(jax.eval_shape(lambda x: x, init))}: {e}"
        ) from e
    if has_aux:
        if not (isinstance(sol, tuple) and len(sol) == 2):
            raise TypeError(f"implicit_diff: with has_aux=True, {name} must return (solution, aux)")
        sol = sol[0]
    init_s = jax.eval_shape(lambda x: x, init)
    _same_or_raise(name, "init", init_s, sol)
    res = jax.eval_shape(lambda x: optimality_fun(x, *args, **kwargs), sol)
    _same_or_raise(name, "optimality_fun(solution, ...)", res, sol)


def _same_or_raise(name, what, tree, sol):
    if find_mismatch(tree, sol) is not None:
        raise TypeError(
            f"implicit_diff: {what} must have the structure, shapes and dtypes of the "
            f"solution {name} returns; got {describe(tree)} for {what} and {describe(sol)} "
            "for the solution"
        )
