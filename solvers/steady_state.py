"""`steady_state`: integrate an ODE to rest, differentiate the equilibrium implicitly.

The equilibrium `y*` of `dy/dt = func(y, t, *args)` solves `func(y*, t0, *args) = 0`.
Integrating from `y0` finds the equilibrium that `y0` flows to (a stable one, unlike
Newton's method from an arbitrary start); a few Newton steps then polish it to full
precision. Only the polishing is differentiated, by the implicit function theorem
(`solvers.root`): `dy* = -J^{-1} (dfunc/dargs) dargs`, the same at any integration
tolerance and without differentiating the integration.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from implicitdiff import error_if

from ._checks import not_in_checked_shard_map, static_bool
from .odeint import Method, _positive, odeint
from .root import root

__all__ = ["steady_state"]


def steady_state(
    func: Callable[..., Any],
    y0: Any,
    *args: Any,
    t0: float = 0.0,
    method: Method = "dopri5",
    rtol: float = 1e-6,
    atol: float = 1e-6,
    settle: float = 1e-4,
    max_time: float = 1e6,
    linear_solver: str | Callable[..., Any] = "auto",
    throw: bool = True,
    return_info: bool = False,
) -> Any:
    """The equilibrium that `dy/dt = func(y, t, *args)` reaches from `y0`.

    The ODE is integrated over growing spans (1, 2, 4, ... time units) until
    `max|func(y)| <= settle * (1 + max|y|)`, then Newton's method on
    `func(y, t0, *args) = 0` finishes. Derivatives with respect to `args` and values
    `func` closes over are implicit (any order, `vmap`, `jit`); `y0` gets none.

    Arguments:
        func: the vector field `func(y, t, *args)` (evaluated at `t = t0`: the
            system should be autonomous).
        y0: the starting state, a pytree of floating-point arrays.
        *args: extra arguments of `func`.
        t0: the time passed to `func`.
        method: the `odeint` method of the integration phase.
        rtol: relative tolerance of the integration phase.
        atol: absolute tolerance of the integration phase.
        settle: when to switch from integrating to Newton's method.
        max_time: give up (status `MAX_STEPS`) when the state has not settled after
            integrating this long.
        linear_solver: the linear solver of the Newton steps and of the derivatives
            (see `solvers.root`).
        throw: raise at run time when the state does not settle or Newton fails.
        return_info: also return the `SolveInfo` of the Newton phase.

    Returns:
        The equilibrium, a pytree like `y0`; `(y, info)` when `return_info`.

    Example:
        ```python
        import jax
        from solvers import steady_state

        # Logistic growth settles at the carrying capacity K.
        y = steady_state(lambda y, t, r, K: r * y * (1 - y / K), 0.1, 1.0, 5.0)
        dK = jax.grad(lambda K: steady_state(lambda y, t, K: y * (1 - y / K), 0.1, K))(5.0)
        ```
    """
    name = "steady_state"
    settle = _positive(name, "settle", settle)
    max_time = _positive(name, "max_time", max_time)
    static_bool(name, "throw", throw)
    not_in_checked_shard_map(name)
    static_bool(name, "return_info", return_info)

    def field(y, *a):
        return func(y, t0, *a)

    def residual(y, a):
        fy = jax.tree_util.tree_leaves(field(y, *a))
        size = max(jnp.max(jnp.abs(v)) for v in fy)
        scale = 1 + max(jnp.max(jnp.abs(v)) for v in jax.tree_util.tree_leaves(y))
        return size, scale

    # The integration phase: forward only, nothing is differentiated through it.
    y_start, a_start = jax.lax.stop_gradient((y0, args))

    def unsettled(carry):
        y, span, elapsed = carry
        size, scale = residual(y, a_start)
        return (size > settle * scale) & (elapsed < max_time) & jnp.isfinite(size)

    def advance(carry):
        y, span, elapsed = carry
        ts = jnp.stack([jnp.zeros_like(span), span])
        ys = odeint(
            lambda y, t, *a: func(y, t0, *a),
            y,
            ts,
            *a_start,
            rtol=rtol,
            atol=atol,
            method=method,
            throw=False,  # a failure leaves NaN, which the check below reports
        )
        y = jax.tree_util.tree_map(lambda v: v[-1], ys)
        return y, 2 * span, elapsed + span

    dtype = jnp.result_type(*jax.tree_util.tree_leaves(y0))
    one = jnp.asarray(1.0, jnp.finfo(dtype).dtype)
    y_int, _, elapsed = jax.lax.while_loop(unsettled, advance, (y_start, one, 0 * one))
    if throw:
        size, scale = residual(y_int, a_start)
        y_int = error_if(
            y_int,
            ~(size <= settle * scale),
            "steady_state: the state did not settle: max|func(y)| = {size:.3e} after "
            "integrating for {elapsed:.4g} time units (max_time = " + f"{max_time:g}). "
            "The system may oscillate, diverge or have no stable equilibrium reachable "
            "from y0; raise `max_time`, or loosen `settle`.",
            values={"size": size, "elapsed": elapsed},
        )
    return root(
        field,
        y_int,
        *args,
        method="newton",
        linear_solver=linear_solver,
        throw=throw,
        return_info=return_info,
    )
