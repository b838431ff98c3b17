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

import equinox as eqx
import jax
import jax.numpy as jnp

from implicitdiff import error_if

from .._checks import float_dtype, not_in_checked_shard_map, static_bool, status_returned
from .._info import DT_UNDERFLOW, MAX_STEPS, NONFINITE, STATUS_NAMES, SUCCESS, max_norm
from ..root import root
from .methods import AbstractMethod
from .odeint import odeint, positive

__all__ = ["steady_state"]


def steady_state(
    func: Callable[..., Any],
    y0: Any,
    *args: Any,
    t0: float = 0.0,
    method: str | AbstractMethod = "dopri5",
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
            integrating this long. When the integration itself fails (e.g. a
            non-finite state), the state is NaN and the status `NONFINITE`.
        linear_solver: the linear solver of the Newton steps and of the derivatives
            (see `solvers.root`).
        throw: raise at run time when the state does not settle or Newton fails.
            `throw=False` needs `return_info=True`: the status in the returned
            info is then the only sign of a failed solve (a `ValueError` otherwise).
        return_info: also return a `SolveInfo`: the steps and residual of the Newton
            phase, and a status that is not `SUCCESS` when either phase failed.

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
    settle = positive(name, "settle", settle)
    max_time = positive(name, "max_time", max_time)
    static_bool(name, "throw", throw)
    not_in_checked_shard_map(name)
    static_bool(name, "return_info", return_info)
    status_returned(name, throw, return_info)
    # The root solve takes real unknowns (complex ones as their real and imaginary parts).
    float_dtype(name, "y0", y0)

    def field(y, *a):
        return func(y, t0, *a)

    def residual(y, a):
        # max_norm, not Python's max: comparing traced leaves would need their values.
        size = max_norm(jax.tree_util.tree_leaves(field(y, *a)))
        scale = 1 + max_norm(jax.tree_util.tree_leaves(y))
        return size, scale

    # The integration phase: forward only, nothing is differentiated through it.
    y_start, a_start = jax.lax.stop_gradient((y0, args))

    def unsettled(carry):
        y, span, elapsed, ode_status = carry
        size, scale = residual(y, a_start)
        return (
            (size > settle * scale)
            & (elapsed < max_time)
            & jnp.isfinite(size)
            & (ode_status == SUCCESS)
        )

    def advance(carry):
        y, span, elapsed, _ = carry
        ts = jnp.stack([jnp.zeros_like(span), span])
        ys, ode_info = odeint(
            lambda y, t, *a: func(y, t0, *a),
            y,
            ts,
            *a_start,
            rtol=rtol,
            atol=atol,
            method=method,
            throw=False,  # reported below, with this phase's own message
            return_info=True,
        )
        # A failed integration leaves NaN, so the Newton phase reports NONFINITE too.
        y = jax.tree_util.tree_map(lambda v: jnp.where(ode_info.converged, v[-1], jnp.nan), ys)
        return y, 2 * span, elapsed + span, ode_info.status.astype(jnp.int32)

    dtype = jnp.result_type(*jax.tree_util.tree_leaves(y0))
    one = jnp.asarray(1.0, jnp.finfo(dtype).dtype)
    start = (y_start, one, 0 * one, jnp.asarray(SUCCESS, jnp.int32))
    y_int, _, elapsed, ode_status = jax.lax.while_loop(unsettled, advance, start)
    size, scale = residual(y_int, a_start)
    settled = size <= settle * scale
    if throw:
        codes = ", ".join(
            f"{code}: {STATUS_NAMES[code]}" for code in (MAX_STEPS, NONFINITE, DT_UNDERFLOW)
        )
        y_int = error_if(
            y_int,
            ode_status != SUCCESS,
            "steady_state: the integration phase failed before {elapsed:.4g} time units: "
            "odeint status {status} (" + codes + "). The state may blow up in finite time "
            "from y0, or the system be stiff (try method='rodas5p'); check func and its "
            "inputs for NaN.",
            values={"status": ode_status, "elapsed": elapsed},
        )
        y_int = error_if(
            y_int,
            ~settled,
            "steady_state: the state did not settle: max|func(y)| = {size:.3e} after "
            "integrating for {elapsed:.4g} time units (max_time = " + f"{max_time:g}). "
            "The system may oscillate, diverge or have no stable equilibrium reachable "
            "from y0; raise `max_time`, or loosen `settle`.",
            values={"size": size, "elapsed": elapsed},
        )
    y, info = root(
        field,
        y_int,
        *args,
        method="newton",
        linear_solver=linear_solver,
        throw=throw,
        return_info=True,
    )
    if not return_info:
        return y
    # Newton may converge from a state that has not settled, to an equilibrium that y0
    # does not flow to: that is a failure of the integration phase (status MAX_STEPS).
    status = jnp.where(settled | (info.status != SUCCESS), info.status, MAX_STEPS)
    return y, eqx.tree_at(lambda i: i.status, info, status.astype(info.status.dtype))
