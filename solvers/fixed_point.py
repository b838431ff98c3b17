"""`fixed_point`: solve `x = f(a, x)`, differentiating by the implicit function theorem.

The forward solve is an iteration (plain, damped, or Anderson-accelerated) in a
`lax.while_loop`. Its derivatives never look at the iterations: with `A = d_x f`
and `B = d_a f` at the solution `x*`,

    dx* = (I - A)^{-1} B da        (forward mode)
    a_bar = B^T w,  (I - A)^T w = x_bar        (reverse mode)

With the default adjoint (`adjoint=None`) and with `adjoint="neumann"` both linear
systems are solved as fixed points themselves, `t = B da + A t` and `w = x_bar + A^T w`,
by the same iteration (the backward pass of JAX's hijax guide): `fixed_point` is one
`implicitdiff.Primitive` whose derivative rules apply it again to those linear maps, so
derivatives of any order follow. That iteration (the Neumann series) converges only when
`A` contracts, which the convergence of plain iteration implies, but not that of damped or
Anderson iteration. After those two the default watches the series, stops it where it
grows or stalls, and solves the linear fixed point directly (dense LU, or GMRES for large
states) for the elements where it has not converged, inside the same primitive: its
output is always the solution of the linear system, so its rules stay valid. With
another `adjoint` the linear systems go to that solver of `implicitdiff.linear_solve`
through `implicitdiff.implicit_diff`.

Under `vmap` each loop runs over the whole batch until every element has converged
(the converged ones keep iterating, which keeps a contraction converged), and the
convergence test is one reduction over the batch; the failure check reduces the
batch to one verdict and computes its message on the host only when something failed.

The function below checks its arguments and chooses the adjoint; the forward solve,
the iteration methods, the primitive and its rules, the direct solve of the default
adjoint and the convergence tests are the modules of `solvers._fixed_point`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp

from implicitdiff import implicit_diff, linear_solve
from implicitdiff.internal import closure_convert

from ._checks import float_dtype, returns_like, solve_flags, static_float, static_int
from ._fixed_point.primitive import _FixedPoint
from ._fixed_point.solve import _Config, _solve
from ._info import default_tolerance

__all__ = ["fixed_point"]

Method = Literal["iterate", "damped", "anderson"]
_METHODS = ("iterate", "damped", "anderson")
# The names `adjoint` accepts: "neumann" is this package's own series (the primitive of
# `_fixed_point.primitive`), the others the solvers of `implicitdiff.linear_solve` of
# those names.
_ADJOINT_NAMES = ("neumann", "gmres", "dense", "auto")


def fixed_point(
    f: Callable[[Any, Any], Any],
    a: Any,
    x_guess: Any,
    *,
    method: Method = "iterate",
    rtol: float | None = None,
    atol: float | None = None,
    max_steps: int = 1000,
    damping: float = 0.5,
    history: int = 5,
    regularisation: float = 1e-5,
    check_every: int | None = None,
    adjoint: str | linear_solve.LinearSolver | Callable[..., Any] | None = None,
    throw: bool = True,
    return_info: bool = False,
) -> Any:
    """Find `x` with `x = f(a, x)`, starting from `x_guess`; derivatives are implicit.

    Derivatives with respect to `a` and to any value `f` closes over come from the
    implicit function theorem (forward and reverse mode, any order, under `vmap`,
    `jit` and `lax.scan`); `x_guess` gets zero derivative.

    Arguments:
        f: the map, `f(a, x) -> x`, returning a pytree with the structure, shapes
            and dtypes of `x`.
        a: parameters, a pytree of arrays (may be empty, e.g. `()`).
        x_guess: the starting point, a pytree of floating-point arrays.
        method: `"iterate"` (`x <- f(a, x)`), `"damped"`
            (`x <- (1 - damping) x + damping f(a, x)`), or `"anderson"` (Anderson
            acceleration over the last `history` iterates, with `damping` as the
            mixing parameter and Tikhonov `regularisation` of its least squares).
        rtol: relative tolerance: converged when `|x_new - x| <= atol + rtol |x_new|`
            elementwise (default 1e-6 in float32, 1e-10 in float64).
        atol: absolute tolerance (same defaults).
        max_steps: the most iterations before giving up (a Python int).
        damping: in (0, 1]; see `method`.
        history: Anderson's memory (a Python int >= 1).
        regularisation: Anderson's least-squares regularisation, relative to the
            scale of the residuals.
        check_every: for `"iterate"` and `"damped"`: test convergence every this many
            steps (a Python int; at most `max_steps` steps are taken). Each test is a
            pass over the iterate; steps past convergence keep a contraction
            converged, so testing less often changes the answer only within the
            tolerance, and makes cheap maps on many numbers faster. The default,
            `None`, tests every step, or every `4` steps when a step updates at least
            16384 numbers (a large state, or a batch of solves under `vmap`). The
            derivative solves by the Neumann series test after their first step,
            then as often.
        adjoint: the linear solver for the derivative systems with `I - A`, where
            `A = df/dx` at the solution. `None` (default) follows `method`. After
            `"iterate"`: the Neumann series `sum A^k` (the same iteration run on the
            linear map, to the same tolerance, for at least 100 steps), as
            `"neumann"`; plain iteration converges only where `f` contracts, and then
            so does the series, at the same rate. After `"damped"` and `"anderson"`,
            which also solve maps that do not contract (an eigenvalue of `A` of
            modulus >= 1): the series, stopped for an element once it grows (a step
            1000 times its first one) or stalls (no step below its first one after
            64 steps), then, for the elements (of a `vmap` batch) where it has not
            converged, a direct solve: dense LU up to 256 unknowns, GMRES above. So
            the default gives the derivative whenever the solve converged and
            `I - A` is invertible, at the cost of the series where `f` contracts.
            `"neumann"`: the series alone, raising when it does not converge.
            `"gmres"`, `"dense"`, `"auto"` (aliases of the classes of
            `implicitdiff.linear_solve` with default options), a
            `linear_solve.LinearSolver` such as `linear_solve.GMRES(maxiter=1000)`
            (prepared once at the solution: `Dense()` factors `I - A` once), or any
            transposable function `solve(matvec, b)`: that solver, always.
        throw: raise at run time when the solve fails (max steps, non-finite
            values). `throw=False` needs `return_info=True`: the status in the
            returned info is then the only sign of a failed solve (a `ValueError`
            otherwise).
        return_info: also return a `SolveInfo` (steps, residual, status).

    Returns:
        The fixed point, with the structure of `x_guess`; `(x, info)` when
        `return_info`.

    Example:
        ```python
        import jax
        from solvers import fixed_point

        def newton_sqrt(a):
            return fixed_point(lambda a, x: 0.5 * (x + a / x), a, a)

        print(newton_sqrt(2.0))                 # 1.4142135
        print(jax.grad(newton_sqrt)(2.0))       # 0.35355338
        ```
    """
    if not callable(f):
        raise TypeError(f"fixed_point: `f` must be callable as f(a, x), got {f!r}")
    if method not in _METHODS:
        raise ValueError(f"fixed_point: `method` must be one of {_METHODS}, got {method!r}")
    name = "fixed_point"
    max_steps = static_int(name, "max_steps", max_steps, minimum=1)
    history = static_int(name, "history", history, minimum=1)
    if check_every is not None:
        check_every = static_int(name, "check_every", check_every, minimum=1)
    damping = static_float(name, "damping", damping)
    regularisation = static_float(name, "regularisation", regularisation)
    if not 0.0 < damping <= 1.0:
        raise ValueError(f"fixed_point: `damping` must be in (0, 1], got {damping}")
    solve_flags(name, throw, return_info)
    # "neumann" is the series run by this module's primitive, not `linear_solve.Neumann`.
    series = adjoint is None or (isinstance(adjoint, str) and adjoint == "neumann")
    solve = linear_solve.resolve(
        adjoint, "fixed_point: `adjoint`", choices=_ADJOINT_NAMES, none_means="the default"
    )

    dtype = float_dtype(name, "x_guess", x_guess)
    # Trace `f` once: for the check below, and to hoist the traced values it closes over
    # so that they are differentiated through the primitive's rules.
    f_conv, consts, _ = closure_convert(f, a, x_guess)
    returns_like(
        name, "f(a, x_guess)", jax.eval_shape(f_conv, consts, a, x_guess), "x_guess", x_guess
    )
    default_tol = default_tolerance(dtype)
    # The tolerances are values (they may be traced), the rest static options.
    tol = tuple(
        jnp.asarray(default_tol if t is None else t, dtype) for t in (rtol, atol)
    )  # fmt: skip
    cfg = _Config(
        method=method,
        # A damped step is `damping` times the undamped one: measure the undamped size.
        scale=damping if method == "damped" else 1.0,
        max_steps=max_steps,
        check_every=check_every,
        damping=damping,
        history=history,
        regularisation=regularisation,
        throw=throw,
        with_info=return_info,
        # Plain iteration converges only where `f` contracts, and then so does the
        # series: after "iterate" the default is the series alone, as "neumann".
        fallback=adjoint is None and method != "iterate",
    )

    if series:
        x, info = _FixedPoint.apply(consts, a, x_guess, tol, f=f_conv, cfg=cfg)
    else:

        def solver(x0, a):
            return _solve(f, a, x0, tol, cfg)

        def residual(x, a):
            return jax.tree_util.tree_map(jnp.subtract, x, f(a, x))

        x, info = implicit_diff(residual, solve=solve, has_aux=True)(solver)(x_guess, a)
    return (x, info) if return_info else x
