"""`fixed_point`: solve `x = f(a, x)`, differentiating by the implicit function theorem.

The forward solve is an iteration (plain, damped, or Anderson-accelerated) in a
`lax.while_loop`. Its derivatives never look at the iterations: with `A = d_x f`
and `B = d_a f` at the solution `x*`,

    dx* = (I - A)^{-1} B da        (forward mode)
    a_bar = B^T w,  (I - A)^T w = x_bar        (reverse mode)

which `implicitdiff.implicit_diff` derives from the residual `x - f(a, x)`. The
linear solve is the `adjoint` argument: the Neumann series (the backward pass of
JAX's fixed-point guide, and as fast as the forward iteration) by default.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from implicitdiff import implicit_diff, linear_solve

from ._checks import float_dtype, returns_like, static_bool, static_float, static_int
from ._info import MAX_STEPS, NONFINITE, SUCCESS, SolveInfo, max_norm, report

__all__ = ["fixed_point"]

Method = Literal["iterate", "damped", "anderson"]
_METHODS = ("iterate", "damped", "anderson")
_ADJOINTS = ("neumann", "gmres", "dense", "auto")


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
    check_every: int = 1,
    adjoint: str | Callable[..., Any] = "neumann",
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
        check_every: test convergence every this many iterations (a Python int).
            Extra iterations past convergence keep a contraction converged, so a
            value like 4 gives the same answer while letting XLA fuse the unrolled
            steps: much faster for cheap maps under `vmap`.
        adjoint: the linear solver for the derivative systems with `I - A`:
            `"neumann"` (the series `sum A^k`, needs `f` to contract), `"gmres"`,
            `"dense"`, `"auto"`, or any `solve(matvec, b)` from
            `implicitdiff.linear_solve` (e.g. a `functools.partial` with options).
        throw: raise at run time when the solve fails (max steps, non-finite
            values); with `throw=False` the status is in the returned info.
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
    check_every = static_int(name, "check_every", check_every, minimum=1)
    damping = static_float(name, "damping", damping)
    regularisation = static_float(name, "regularisation", regularisation)
    if not 0.0 < damping <= 1.0:
        raise ValueError(f"fixed_point: `damping` must be in (0, 1], got {damping}")
    static_bool(name, "throw", throw)
    static_bool(name, "return_info", return_info)

    dtype = float_dtype(name, "x_guess", x_guess)
    returns_like(name, "f(a, x_guess)", jax.eval_shape(f, a, x_guess), "x_guess", x_guess)
    default_tol = 1e-10 if dtype == np.float64 else 1e-6
    rtol = default_tol if rtol is None else rtol
    atol = default_tol if atol is None else atol
    solve = _adjoint_solver(adjoint, dtype, max_steps)

    step = {
        "iterate": _iterate_step,
        "damped": functools.partial(_damped_step, damping=damping),
    }.get(method)

    def solver(x0, a):
        if method == "anderson":
            return _anderson(f, a, x0, rtol, atol, max_steps, damping, history, regularisation)
        # A damped step is `damping` times the undamped one: measure the undamped size.
        scale = damping if method == "damped" else 1.0
        return _iterate(f, a, x0, step, rtol, atol, max_steps, check_every, scale)

    def residual(x, a):
        return jax.tree_util.tree_map(jnp.subtract, x, f(a, x))

    x, info = implicit_diff(residual, solve=solve, has_aux=True)(solver)(x_guess, a)
    x = report(x, info, throw=throw, name="fixed_point", max_steps=max_steps)
    return (x, info) if return_info else x


# ---------------------------------------------------------------------------
# Arguments.


def _adjoint_solver(adjoint, dtype, max_steps):
    if callable(adjoint):
        return adjoint
    if adjoint not in _ADJOINTS:
        raise ValueError(
            f"fixed_point: `adjoint` must be one of {_ADJOINTS} or a linear solver "
            f"`solve(matvec, b)`, got {adjoint!r}"
        )
    if adjoint == "neumann":
        # The series converges at the forward iteration's rate; allow as many terms.
        return functools.partial(linear_solve.neumann, maxiter=max(max_steps, 100))
    return getattr(linear_solve, adjoint)


# ---------------------------------------------------------------------------
# The forward iterations.


def _iterate_step(f, a, x):
    return f(a, x)


def _damped_step(f, a, x, *, damping):
    fx = f(a, x)
    return jax.tree_util.tree_map(lambda u, v: (1 - damping) * u + damping * v, x, fx)


def _scaled_step(x_new, x_old, rtol, atol):
    """max over leaves of |x_new - x_old| / (atol + rtol |x_new|), and max |x_new - x_old|."""
    ratios, sizes = [], []
    for u, v in zip(jax.tree_util.tree_leaves(x_new), jax.tree_util.tree_leaves(x_old)):
        d = jnp.abs(u - v)
        ratios.append(d / (atol + rtol * jnp.abs(u)))
        sizes.append(d)
    return max_norm(ratios), max_norm(sizes)


def _all_finite(tree):
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(v)) for v in jax.tree_util.tree_leaves(tree)]))


def _iterate(f, a, x0, step, rtol, atol, max_steps, check_every, scale):
    def cond(carry):
        _, ratio, _, steps, finite = carry
        return (ratio > 1) & (steps < max_steps) & finite

    def body(carry):
        x, _, _, steps, _ = carry
        x_prev = x
        for _ in range(check_every):
            x_prev, x = x, step(f, a, x)
        ratio, size = _scaled_step(x, x_prev, rtol, atol)
        return x, ratio / scale, size / scale, steps + check_every, _all_finite(x)

    dt = jnp.result_type(*jax.tree_util.tree_leaves(x0))
    inf = jnp.asarray(jnp.inf, dt)
    init = (x0, inf, inf, jnp.asarray(0, jnp.int32), jnp.asarray(True))
    x, ratio, size, steps, finite = jax.lax.while_loop(cond, body, init)
    return x, _info(steps, size, ratio, finite)


def _info(steps, size, ratio, finite):
    status = jnp.where(~finite, NONFINITE, jnp.where(ratio <= 1, SUCCESS, MAX_STEPS))
    return SolveInfo(steps=steps, residual=size, status=status.astype(jnp.int32))


def _anderson(f, a, x0, rtol, atol, max_steps, beta, m, lam):
    """Anderson acceleration (type II) on the flattened iterate, memory `m`."""
    flat0, unravel = ravel_pytree(x0)
    n = flat0.shape[0]
    dt = flat0.dtype

    def g(v):
        return ravel_pytree(f(a, unravel(v)))[0]

    g0 = g(flat0)
    # Ring buffers of the last m iterates and their images; slot 0 holds (x0, f(x0)).
    xs = jnp.zeros((m, n), dt).at[0].set(flat0)
    gs = jnp.zeros((m, n), dt).at[0].set(g0)
    eye = jnp.eye(m, dtype=dt)

    def cond(carry):
        *_, ratio, _, steps, finite = carry
        return (ratio > 1) & (steps < max_steps) & finite

    def body(carry):
        _, xs, gs, _, _, steps, _ = carry
        # Weights alpha (summing to one) minimising |sum_i alpha_i (g_i - x_i)| over the
        # filled slots; empty slots get weight zero through an identity block.
        filled = jnp.arange(m) < jnp.minimum(steps + 1, m)
        both = filled[:, None] & filled[None, :]
        resid = gs - xs
        h = jnp.where(both, resid @ resid.T, 0.0)
        scale = jnp.trace(h) / jnp.sum(filled) + jnp.finfo(dt).tiny
        h = h + lam * scale * eye + jnp.where(both, 0.0, eye)
        alpha = jnp.linalg.solve(h, filled.astype(dt))
        alpha = alpha / jnp.sum(alpha)
        x_new = beta * (alpha @ gs) + (1 - beta) * (alpha @ xs)
        g_new = g(x_new)
        slot = (steps + 1) % m
        xs = xs.at[slot].set(x_new)
        gs = gs.at[slot].set(g_new)
        d = jnp.abs(g_new - x_new)
        ratio = jnp.max(d / (atol + rtol * jnp.abs(g_new)))
        return g_new, xs, gs, ratio, jnp.max(d), steps + 1, jnp.all(jnp.isfinite(g_new))

    d0 = jnp.abs(g0 - flat0)
    init = (
        g0,
        xs,
        gs,
        jnp.max(d0 / (atol + rtol * jnp.abs(g0))),
        jnp.max(d0),
        jnp.asarray(0, jnp.int32),
        jnp.all(jnp.isfinite(g0)),
    )
    # The returned point is f(x) at the last iterate x: the point whose step was measured.
    x_out, _, _, ratio, size, steps, finite = jax.lax.while_loop(cond, body, init)
    return unravel(x_out), _info(steps + 1, size, ratio, finite)
