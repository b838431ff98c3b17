"""`minimize`: `argmin_x fun(x, *args)`, differentiated through its optimality condition.

The forward solve is optax's L-BFGS, any optax gradient transformation, or a
damped Newton method for small problems. The minimiser satisfies
`grad_x fun(x*, *args) = 0`; differentiating that identity gives, with
`H = d2_xx fun` and `B = d2_x,args fun` at `x*`,

    dx* = -H^{-1} B dargs       (forward mode)
    args_bar = -B^T H^{-1} x_bar      (reverse mode)

(`implicitdiff.implicit_diff` on `grad_x fun`). The iterations are never
differentiated, so the cost of a hyper-gradient is one linear solve with the
Hessian, whatever the number of steps the optimiser took.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
import optax.tree_utils as otu
from jax.flatten_util import ravel_pytree

from implicitdiff import implicit_diff, linear_solve
from implicitdiff.internal import all_finite, describe

from ._checks import float_dtype, solve_flags, static_int
from ._info import MAX_STEPS, NONFINITE, SUCCESS, SolveInfo, max_norm, report

__all__ = ["minimize"]

_METHODS = ("lbfgs", "newton")
# The Hessian is symmetric: CG applies, CG on the normal equations would only square its
# condition number, and the Neumann series needs a contraction.
_LINEAR_SOLVER_NAMES = ("auto", "dense", "cg", "gmres", "bicgstab")


def minimize(
    fun: Callable[..., Any],
    x0: Any,
    *args: Any,
    method: str | optax.GradientTransformation = "lbfgs",
    rtol: float | None = None,
    atol: float | None = None,
    max_steps: int = 1000,
    linear_solver: str | linear_solve.LinearSolver | Callable[..., Any] = "auto",
    throw: bool = True,
    return_info: bool = False,
) -> Any:
    """Find a local minimiser of `fun(x, *args)` from `x0`; derivatives are implicit.

    Derivatives with respect to `args` and to any value `fun` closes over come
    from the optimality condition `grad_x fun(x*, *args) = 0` (forward and reverse
    mode, any order, under `vmap`, `jit` and `lax.scan`): hyper-parameter
    gradients and bilevel problems without differentiating the optimiser. `x0`
    gets zero derivative. The minimiser must be strict (a non-singular Hessian)
    for the derivatives to exist.

    Arguments:
        fun: the objective, `fun(x, *args)`, returning a real scalar.
        x0: the starting point, a pytree of floating-point arrays.
        *args: parameters passed to `fun`: pytrees of arrays, differentiable.
        method: `"lbfgs"` (`optax.lbfgs()`, with its zoom line search: the
            default), `"newton"` (the exact Hessian, materialised, with a
            backtracking line search and a gradient step where the Newton
            direction does not descend: for problems with up to a few hundred
            unknowns), or any `optax.GradientTransformation`, e.g.
            `optax.adam(1e-2)` or `optax.lbfgs(memory_size=20)`; transformations
            that need the value or the objective (L-BFGS, line searches) receive
            `value`, `grad` and `value_fn`.
        rtol: relative tolerance: converged when
            `max |grad_x fun(x)| <= atol + rtol max |grad_x fun(x0)|`, i.e. when the
            gradient is small in absolute terms or has shrunk by the factor `rtol`
            (independent of constant offsets in `fun`). Default 1e-5 in float32,
            1e-10 in float64.
        atol: absolute tolerance on the gradient (same defaults).
        max_steps: the most iterations before giving up (a Python int).
        linear_solver: how systems with the Hessian are solved in the derivatives:
            a `implicitdiff.linear_solve.LinearSolver`, e.g.
            `linear_solve.CG(rtol=1e-12)` (prepared once at the minimiser:
            `Dense()` factors the Hessian once), a name as an alias of one with
            default options (`"auto"`: dense for small problems, CG for large
            ones; `"dense"`, `"cg"`, `"gmres"`, `"bicgstab"`; `"auto"` and
            `"dense"` are told the Hessian is symmetric), or any transposable
            function `solve(matvec, b)`.
        throw: raise at run time when the solve fails (max steps, non-finite
            values). `throw=False` needs `return_info=True`: the status in the
            returned info is then the only sign of a failed solve (a `ValueError`
            otherwise).
        return_info: also return a `SolveInfo` (steps, `max |grad_x fun|`, status).

    Returns:
        The minimiser, with the structure of `x0`; `(x, info)` when `return_info`.

    Example:
        ```python
        import jax, jax.numpy as jnp
        from solvers import minimize

        def fun(x, a):  # minimised at x = a / 2
            return jnp.sum(x**2) - a @ x

        a = jnp.array([1.0, 2.0])
        print(minimize(fun, jnp.zeros(2), a))  # [0.5 1. ]
        print(jax.jacobian(lambda a: minimize(fun, jnp.zeros(2), a))(a))  # 0.5 * eye
        ```
    """
    name = "minimize"
    if not callable(fun):
        raise TypeError(f"minimize: `fun` must be callable as fun(x, *args), got {fun!r}")
    if isinstance(method, str):
        if method not in _METHODS:
            raise ValueError(
                f"minimize: `method` must be one of {_METHODS} or an "
                f"optax.GradientTransformation, got {method!r}"
            )
    elif not isinstance(method, optax.GradientTransformation):
        raise TypeError(
            f"minimize: `method` must be one of {_METHODS} or an optax.GradientTransformation "
            f"(e.g. optax.adam(1e-2)), got {method!r}"
        )
    max_steps = static_int(name, "max_steps", max_steps, minimum=1)
    solve_flags(name, throw, return_info)
    dtype = float_dtype(name, "x0", x0)
    _check_scalar_objective(fun, x0, args)
    default = 1e-10 if jnp.dtype(dtype).itemsize >= 8 else 1e-5
    rtol = default if rtol is None else rtol
    atol = default if atol is None else atol
    solve = linear_solve.resolve(
        linear_solver, "minimize: `linear_solver`", choices=_LINEAR_SOLVER_NAMES, symmetric=True
    )

    def optimality(x, *args):
        return jax.grad(fun)(x, *args)

    @implicit_diff(optimality, solve=solve, has_aux=True)
    def solver(x_init, *args):
        def objective(x):
            return fun(x, *args)

        if method == "newton":
            return _newton(objective, x_init, rtol, atol, max_steps)
        opt = optax.lbfgs() if method == "lbfgs" else optax.with_extra_args_support(method)
        return _optax(objective, x_init, opt, rtol, atol, max_steps)

    x, info = solver(x0, *args)
    x = report(x, info, throw=throw, name="minimize", max_steps=max_steps)
    return (x, info) if return_info else x


def _check_scalar_objective(fun, x0, args):
    out = jax.eval_shape(fun, x0, *args)
    if (
        not isinstance(out, jax.ShapeDtypeStruct)
        or out.shape != ()
        or not jnp.issubdtype(out.dtype, jnp.floating)
    ):
        raise TypeError(
            "minimize: fun(x0, *args) must return a real floating-point scalar, got "
            f"{describe(out)}; "
            "reduce it (e.g. jnp.sum or jnp.mean) and return aux values separately"
        )


def _gradient_ratio(grad, tolerance):
    """max |grad| / tolerance, and max |grad|."""
    size = max_norm(jax.tree_util.tree_leaves(grad))
    return size / tolerance, size


def _info(ratio, size, steps, finite):
    status = jnp.where(~finite, NONFINITE, jnp.where(ratio <= 1, SUCCESS, MAX_STEPS))
    return SolveInfo(steps=steps, residual=size, status=status.astype(jnp.int32))


def _optax(objective, x0, opt, rtol, atol, max_steps):
    """Run an optax transformation until the gradient is small."""
    value_and_grad = jax.value_and_grad(objective)
    state0 = opt.init(x0)
    # L-BFGS's line search leaves the new point's value and gradient in its state.
    cached = otu.tree_get(state0, "grad") is not None and otu.tree_get(state0, "value") is not None
    if cached:
        value_and_grad = optax.value_and_grad_from_state(objective)

    def cond(carry):
        *_, ratio, _, steps, finite = carry
        return (ratio > 1) & (steps < max_steps) & finite

    def body(carry):
        x, state, value, grad, _, _, steps, _ = carry
        updates, state = opt.update(grad, state, x, value=value, grad=grad, value_fn=objective)
        x = optax.apply_updates(x, updates)
        value, grad = value_and_grad(x, state=state) if cached else value_and_grad(x)
        ratio, size = _gradient_ratio(grad, tolerance)
        return x, state, value, grad, ratio, size, steps + 1, all_finite((value, grad))

    value, grad = jax.value_and_grad(objective)(x0)
    tolerance = atol + rtol * max_norm(jax.tree_util.tree_leaves(grad))
    ratio, size = _gradient_ratio(grad, tolerance)
    steps = jnp.asarray(0, jnp.int32)
    init = (x0, state0, value, grad, ratio, size, steps, all_finite((value, grad)))
    x, *_, ratio, size, steps, finite = jax.lax.while_loop(cond, body, init)
    return x, _info(ratio, size, steps, finite)


def _newton(objective, x0, rtol, atol, max_steps):
    """Newton's method with the materialised Hessian and Armijo backtracking."""
    flat0, unravel = ravel_pytree(x0)

    def f(v):
        return objective(unravel(v))

    value_and_grad = jax.value_and_grad(f)
    hessian = jax.hessian(f)

    def cond(carry):
        *_, ratio, _, steps, finite = carry
        return (ratio > 1) & (steps < max_steps) & finite

    def body(carry):
        x, value, grad, _, _, steps, _ = carry
        p = jnp.linalg.solve(hessian(x), -grad)
        slope = grad @ p
        # Where the Hessian is not positive definite along p, go downhill instead.
        newton_ok = jnp.all(jnp.isfinite(p)) & (slope < 0)
        p = jnp.where(newton_ok, p, -grad)
        slope = jnp.where(newton_ok, slope, -(grad @ grad))

        # Armijo backtracking. Near the minimum the decrease can be below the rounding
        # of f (float32 especially); a change within a few ulps of f counts as no increase.
        slack = 4 * jnp.finfo(x.dtype).eps * jnp.abs(value)

        def too_long(t):
            return (f(x + t * p) > value + 1e-4 * t * slope + slack) & (t > 1e-10)

        t = jax.lax.while_loop(too_long, lambda t: 0.5 * t, jnp.ones((), x.dtype))
        x = x + t * p
        value, grad = value_and_grad(x)
        ratio, size = _gradient_ratio(grad, tolerance)
        return x, value, grad, ratio, size, steps + 1, all_finite((value, grad))

    value, grad = value_and_grad(flat0)
    tolerance = atol + rtol * max_norm([grad])
    ratio, size = _gradient_ratio(grad, tolerance)
    steps = jnp.asarray(0, jnp.int32)
    init = (flat0, value, grad, ratio, size, steps, all_finite((value, grad)))
    x, *_, ratio, size, steps, finite = jax.lax.while_loop(cond, body, init)
    return unravel(x), _info(ratio, size, steps, finite)
