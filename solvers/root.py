"""`root`: solve `f(x, *args) = 0` for `x`, differentiating by the implicit function theorem.

The forward solve is Newton, chord, Broyden or (for a scalar) bisection, each a
`lax.while_loop`. Derivatives never look at the iterations: with `J = d_x f` at
the root `x*` and `f` closing over `args`,

    dx* = -J^{-1} (d_args f) dargs       (forward mode)
    args_bar = -(d_args f)^T J^{-T} x_bar      (reverse mode)

which `implicitdiff.custom_root` provides, with `linear_solver` for the systems
with `J` (and its transpose).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

from implicitdiff import custom_root, linear_solve

from ._checks import float_dtype, returns_like, solve_flags, static_int
from ._info import (
    BAD_BRACKET,
    MAX_STEPS,
    NONFINITE,
    SUCCESS,
    SolveInfo,
    default_tolerance,
    max_norm,
    report,
)

__all__ = ["root"]

Method = Literal["newton", "chord", "broyden", "bisection"]
_METHODS = ("newton", "chord", "broyden", "bisection")
# The Jacobian of a root problem is neither symmetric nor contractive in general: CG and
# the Neumann series are not offered by name.
_LINEAR_SOLVER_NAMES = ("auto", "dense", "gmres", "bicgstab", "normal_cg")


def root(
    f: Callable[..., Any],
    x0: Any,
    *args: Any,
    method: Method = "newton",
    rtol: float | None = None,
    atol: float | None = None,
    max_steps: int = 256,
    bracket: tuple[Any, Any] | None = None,
    linear_solver: str | linear_solve.LinearSolver | Callable[..., Any] = "auto",
    throw: bool = True,
    return_info: bool = False,
) -> Any:
    """Find `x` with `f(x, *args) = 0`, starting from `x0`; derivatives are implicit.

    Derivatives with respect to `args` and to any value `f` closes over come from
    the implicit function theorem (forward and reverse mode, any order, under
    `vmap`, `jit` and `lax.scan`); `x0` and `bracket` get zero derivative.

    Arguments:
        f: the function, `f(x, *args)`, returning a pytree with the structure,
            shapes and dtypes of `x` (a square system).
        x0: the starting point, a pytree of floating-point arrays. For
            `"bisection"` a scalar, used only for its dtype.
        *args: parameters passed to `f`: pytrees of arrays, differentiable.
        method: `"newton"` (Jacobian by autodiff at every step, one linear
            solve per step: quadratic convergence), `"chord"` (the Jacobian at
            `x0` prepared once by `linear_solver` and reused, factorised once by
            dense LU for `Dense` and for `"auto"` at any size: cheaper steps, linear
            convergence), `"broyden"` (Broyden's
            "good" rank-one updates of the inverse Jacobian, a dense matrix,
            starting from the exact one at `x0`: superlinear), or
            `"bisection"` (scalar `x` only, needs `bracket`; always converges
            when `f` changes sign over it).
        rtol: relative tolerance: converged when the last step satisfies
            `|dx| <= atol + rtol |x|` elementwise (for bisection: when the bracket
            is that narrow). Default 1e-6 in float32, 1e-10 in float64.
        atol: absolute tolerance (same defaults).
        max_steps: the most iterations before giving up (a Python int).
        bracket: `(lower, upper)` with `f(lower)` and `f(upper)` of opposite signs;
            required by (and only used by) `"bisection"`. May be traced.
        linear_solver: how systems with the Jacobian are solved, in Newton and
            chord steps and in the derivatives (Broyden's steps use their dense
            inverse): a `implicitdiff.linear_solve.LinearSolver`,
            e.g. `linear_solve.GMRES(rtol=1e-12)` (the derivatives prepare it once
            at the root: `Dense()` factors the Jacobian once for forward and
            reverse mode), a name as an alias of one with default options
            (`"auto"`, `"dense"`, `"gmres"`, `"bicgstab"`, `"normal_cg"`), or any
            transposable function `solve(matvec, b)`.
        throw: raise at run time when the solve fails (max steps, non-finite
            values, a bracket without a sign change). `throw=False` needs
            `return_info=True`: the status in the returned info is then the only
            sign of a failed solve (a `ValueError` otherwise).
        return_info: also return a `SolveInfo` (steps, `max |f(x)|`, status).

    Returns:
        The root, with the structure of `x0`; `(x, info)` when `return_info`.

    Example:
        ```python
        import jax
        from solvers import root

        def cube_root(a):
            return root(lambda x, a: x**3 - a, 1.0, a)

        print(cube_root(8.0))            # 2.0
        print(jax.grad(cube_root)(8.0))  # 0.083333336 = 1 / (3 * 2**2)
        ```
    """
    name = "root"
    if not callable(f):
        raise TypeError(f"root: `f` must be callable as f(x, *args), got {f!r}")
    if method not in _METHODS:
        raise ValueError(f"root: `method` must be one of {_METHODS}, got {method!r}")
    max_steps = static_int(name, "max_steps", max_steps, minimum=1)
    solve_flags(name, throw, return_info)
    dtype = float_dtype(name, "x0", x0)
    returns_like(name, "f(x0, *args)", jax.eval_shape(f, x0, *args), "x0", x0)
    rtol = default_tolerance(dtype) if rtol is None else rtol
    atol = default_tolerance(dtype) if atol is None else atol
    solve_linear = linear_solve.resolve(
        linear_solver, "root: `linear_solver`", choices=_LINEAR_SOLVER_NAMES
    )

    if method == "bisection":
        if bracket is None:
            raise ValueError(
                "root: method='bisection' needs `bracket=(lower, upper)`, two points where "
                "f has opposite signs"
            )
        leaves = jax.tree_util.tree_leaves(x0)
        if len(leaves) != 1 or jnp.shape(leaves[0]) != () or not isinstance(x0, type(leaves[0])):
            raise TypeError(
                "root: method='bisection' solves scalar equations; `x0` must be a scalar, "
                f"got {jax.tree_util.tree_map(jnp.shape, x0)}. Use 'newton', 'chord' or "
                "'broyden' for systems."
            )
        try:
            lower, upper = bracket
        except (TypeError, ValueError):
            msg = f"root: `bracket` must be a pair (lower, upper), got {bracket!r}"
            raise TypeError(msg) from None
        forward = functools.partial(
            _bisection, lower=lower, upper=upper, rtol=rtol, atol=atol, max_steps=max_steps
        )
    elif bracket is not None:
        raise ValueError(f"root: `bracket` is only used by method='bisection', not {method!r}")
    else:
        forward = functools.partial(
            {"newton": _newton, "chord": _chord, "broyden": _broyden}[method],
            rtol=rtol,
            atol=atol,
            max_steps=max_steps,
            linear_solver=solve_linear,
        )

    def g(x):
        return f(x, *args)

    x, info = custom_root(g, x0, forward, solve_linear, has_aux=True)
    x = report(x, info, throw=throw, name="root", max_steps=max_steps)
    return (x, info) if return_info else x


# ---------------------------------------------------------------------------
# Forward solvers: `solve(g, x0) -> (x, SolveInfo)` with `g(x) = f(x, *args)`.


def _step_ratio(dx, x, rtol, atol):
    """max |dx| / (atol + rtol |x|) over the flat vectors."""
    return jnp.max(jnp.abs(dx) / (atol + rtol * jnp.abs(x)), initial=0.0)


def _finish(g_flat, x, ratio, steps, finite):
    fx = g_flat(x)
    finite = finite & jnp.all(jnp.isfinite(fx))
    status = jnp.where(~finite, NONFINITE, jnp.where(ratio <= 1, SUCCESS, MAX_STEPS))
    info = SolveInfo(steps=steps, residual=max_norm([fx]), status=status.astype(jnp.int32))
    return x, info


def _flat(g, x0):
    flat0, unravel = ravel_pytree(x0)

    def g_flat(v):
        return ravel_pytree(g(unravel(v)))[0]

    return flat0, unravel, g_flat


#: Armijo constant of the backtracking: a step length `t` is accepted when it lowers
#: `|f|^2` by at least the fraction `_ARMIJO * t` (a Newton step's own slope is -2).
_ARMIJO = 1e-4
#: The shortest step length tried, as a power of 1/2.
_MAX_HALVINGS = 20


def _backtrack(g_flat, x, dx, fx, f_full, local):
    """A step length along `dx` by backtracking on the merit function `|f|^2`.

    Newton's full step can overshoot far from the root: the iterates then wander, and
    whether they land on a root or overflow to inf/NaN depends on rounding (so on the
    machine). The step length is halved until `f` is finite and `|f|^2` has dropped by
    the Armijo fraction of the Newton model's decrease, as line-search Newton methods
    do (Dennis and Schnabel, ch. 6).

    The full step is kept without a search where the iteration is `local`: where the
    step is already small against `x` (`_step_ratio` at most `1 / sqrt(rtol)`: a
    change of about `sqrt(rtol) |x|` or less). There Newton converges without help,
    and `|f|` is near its rounding noise, so a decrease test would only stall the
    iteration. The full step is also kept when no length down to
    `2**-_MAX_HALVINGS` decreases `|f|` (a local minimum of `|f|`): the iteration then
    runs as plain Newton and reports by its status.

    Returns `(x_new, f_new, t)`.
    """
    phi0 = fx @ fx

    def bad(t, f_t):
        return ~jnp.all(jnp.isfinite(f_t)) | ~(f_t @ f_t <= (1 - _ARMIJO * t) * phi0)

    t_min = jnp.asarray(0.5**_MAX_HALVINGS, x.dtype)

    def cond(carry):
        t, f_t = carry
        return bad(t, f_t) & (t > t_min) & ~local

    def body(carry):
        t = 0.5 * carry[0]
        return t, g_flat(x + t * dx)

    t, f_t = jax.lax.while_loop(cond, body, (jnp.ones((), x.dtype), f_full))
    keep_full = local | (bad(t, f_t) & jnp.all(jnp.isfinite(f_full)))
    t = jnp.where(keep_full, 1.0, t).astype(x.dtype)
    f_new = jnp.where(keep_full, f_full, f_t)
    return x + t * dx, f_new, t


def _globalised_loop(g_flat, flat0, state0, direction, update, rtol, atol, max_steps):
    """Iterate `x <- x + t dx` with `dx = direction(state, x, fx)` and `t` from `_backtrack`,
    until the full step `dx` is within tolerance.

    `state` (nothing, a Jacobian factorisation or an inverse-Jacobian estimate) is
    refreshed by `update(state, s, fx, f_new)` after each step `s = t dx`.
    """

    def cond(carry):
        *_, ratio, steps, finite = carry
        return (ratio > 1) & (steps < max_steps) & finite

    def body(carry):
        x, fx, state, _, steps, _ = carry
        dx = direction(state, x, fx)
        ratio = _step_ratio(dx, x + dx, rtol, atol)
        f_full = g_flat(x + dx)
        local = jnp.where(rtol > 0, ratio * jnp.sqrt(jnp.abs(rtol)) <= 1, ratio <= 1)
        x_new, f_new, t = _backtrack(g_flat, x, dx, fx, f_full, local)
        state = update(state, t * dx, fx, f_new)
        finite = jnp.all(jnp.isfinite(x_new)) & jnp.all(jnp.isfinite(f_new))
        return x_new, f_new, state, ratio, steps + 1, finite

    f0 = g_flat(flat0)
    inf = jnp.asarray(jnp.inf, flat0.dtype)
    init = (flat0, f0, state0, inf, jnp.asarray(0, jnp.int32), jnp.all(jnp.isfinite(f0)))
    x, _, _, ratio, steps, finite = jax.lax.while_loop(cond, body, init)
    return _finish(g_flat, x, ratio, steps, finite)


def _quiet(solve):
    """`solve` with `throw=False` where it has that option: a step's accuracy is
    judged by the iteration, not by the linear solve."""
    if dataclasses.is_dataclass(solve) and getattr(solve, "throw", False):
        return dataclasses.replace(solve, throw=False)
    return solve


def _newton(g, x0, *, rtol, atol, max_steps, linear_solver):
    """Newton's method, matrix-free: each step solves `J(x) dx = -f(x)` with `linear_solver`,
    then backtracks along `dx` (`_backtrack`)."""
    solve = _quiet(linear_solver)
    flat0, unravel, g_flat = _flat(g, x0)

    def direction(state, x, fx):
        _, jvp = jax.linearize(g, unravel(x))
        dx = solve(jvp, unravel(-fx))
        return ravel_pytree(dx)[0]

    def update(state, s, fx, f_new):
        return state

    x, info = _globalised_loop(g_flat, flat0, None, direction, update, rtol, atol, max_steps)
    return unravel(x), info


def _chord(g, x0, *, rtol, atol, max_steps, linear_solver):
    """The chord method: the Jacobian at `x0`, prepared once by `linear_solver` (a
    `LinearSolver`: `Dense` factors it once, `Banded` or `Sparse` by their structure,
    a Krylov solver iterates with its products), for every step; a plain function
    `solve(matvec, b)` is called with the same products at every step. `Auto`, the
    default, factors it by dense LU at any size: reusing one factorisation is the
    method's point, where `Auto` would run GMRES at every step above its dense size."""
    solve = _quiet(linear_solver)
    if isinstance(solve, linear_solve.Auto):
        solve = linear_solve.Dense(throw=False)
    flat0, unravel, g_flat = _flat(g, x0)
    _, jvp0 = jax.linearize(g, x0)
    if isinstance(solve, linear_solve.LinearSolver):
        state0 = solve.init(jvp0, x0)

        def solve_once(state, b):
            return solve.solve(state, b)
    else:
        state0 = None

        def solve_once(state, b):
            return solve(jvp0, b)

    def direction(state, x, fx):
        return ravel_pytree(solve_once(state, unravel(-fx)))[0]

    def update(state, dx, fx, f_new):
        return state

    x, info = _globalised_loop(g_flat, flat0, state0, direction, update, rtol, atol, max_steps)
    return unravel(x), info


def _broyden(g, x0, *, rtol, atol, max_steps, linear_solver):
    """Broyden's "good" method on the inverse Jacobian, from the exact one at `x0`."""
    del linear_solver
    flat0, unravel, g_flat = _flat(g, x0)
    lu = jax.scipy.linalg.lu_factor(jax.jacfwd(g_flat)(flat0))
    inv0 = jax.scipy.linalg.lu_solve(lu, jnp.eye(flat0.size, dtype=flat0.dtype))
    tiny = jnp.finfo(flat0.dtype).tiny

    def direction(inv, x, fx):
        return -inv @ fx

    def update(inv, dx, fx, f_new):
        # Sherman-Morrison form of the rank-one secant update: the new inverse maps
        # df = f_new - fx to dx and differs from the old one only along dx^T inv.
        inv_df = inv @ (f_new - fx)
        denom = dx @ inv_df
        safe = jnp.abs(denom) > tiny
        change = jnp.outer(dx - inv_df, dx @ inv) / jnp.where(safe, denom, 1.0)
        return jnp.where(safe, inv + change, inv)

    x, info = _globalised_loop(g_flat, flat0, inv0, direction, update, rtol, atol, max_steps)
    return unravel(x), info


def _bisection(g, x0, *, lower, upper, rtol, atol, max_steps):
    """Bisection on `[lower, upper]` (either order): halve the bracket, keep the sign change."""
    dt = jnp.result_type(x0)
    lo = jnp.asarray(lower, dt).reshape(jnp.shape(x0))
    hi = jnp.asarray(upper, dt).reshape(jnp.shape(x0))
    f_lo, f_hi = g(lo), g(hi)
    finite_ends = jnp.isfinite(f_lo) & jnp.isfinite(f_hi)
    valid = finite_ends & (jnp.sign(f_lo) * jnp.sign(f_hi) <= 0)
    # Keep `lo` at the end where f is negative, so the update needs no sign bookkeeping.
    lo, hi = jnp.where(f_lo <= 0, lo, hi), jnp.where(f_lo <= 0, hi, lo)

    def width_ratio(lo, hi):
        mid = 0.5 * (lo + hi)
        return jnp.abs(hi - lo) / (atol + rtol * jnp.abs(mid))

    def cond(carry):
        lo, hi, f_mid, steps = carry
        return (width_ratio(lo, hi) > 1) & (f_mid != 0) & (steps < max_steps) & valid

    def body(carry):
        lo, hi, _, steps = carry
        mid = 0.5 * (lo + hi)
        f_mid = g(mid)
        lo, hi = jnp.where(f_mid <= 0, mid, lo), jnp.where(f_mid < 0, hi, mid)
        return lo, hi, f_mid, steps + 1

    nan = jnp.asarray(jnp.nan, dt)
    lo, hi, f_mid, steps = jax.lax.while_loop(cond, body, (lo, hi, nan, jnp.asarray(0, jnp.int32)))
    # An exact zero at an end of the bracket is the root.
    x = jnp.where(f_lo == 0, lower, jnp.where(f_hi == 0, upper, 0.5 * (lo + hi))).astype(dt)
    fx = g(x)
    done = (width_ratio(lo, hi) <= 1) | (f_mid == 0) | (fx == 0)
    finite = finite_ends & jnp.isfinite(x) & jnp.isfinite(fx)
    status = jnp.where(
        finite_ends & ~valid,
        BAD_BRACKET,
        jnp.where(~finite, NONFINITE, jnp.where(done, SUCCESS, MAX_STEPS)),
    )
    info = SolveInfo(steps=steps, residual=jnp.abs(fx), status=status.astype(jnp.int32))
    return x, info
