"""`odeint_event`: integrate until an event function crosses zero (a terminal event).

The event time `t*` solves `event(y(t*), t*, *args) = 0`, where `y(t)` is the ODE's
solution. The integration steps from `t0` until a step would cross a zero of `event`;
bisection on the length of that last step (each trial re-takes the step) then pins
`t*` down to rounding. Derivatives come from the implicit function theorem applied to
`r(t) = event(y(t), t, *args)`:

    dt* = -(dr/dparams) dparams / (dr/dt),  dr/dt = d_y event . func + d_t event,

through `implicitdiff.custom_root`, with `y(t)` given by `odeint` (so `dr/dparams`
uses `odeint`'s own derivatives). The state at the event is `odeint` at `t*`, whose
derivative includes the motion of `t*`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

from implicitdiff import custom_root, error_if
from implicitdiff.internal import closure_convert

from .._checks import not_in_checked_shard_map, static_bool, status_returned
from .adjoints import AbstractAdjoint
from .info import EVENT, MAX_STEPS, SUCCESS
from .loop import LoopConfig
from .methods import AbstractMethod, resolve_method
from .odeint import odeint, positive, real_form
from .outputs import integrate

__all__ = ["odeint_event"]

_BISECTIONS = 64


def odeint_event(
    func: Callable[..., Any],
    event: Callable[..., Any],
    y0: Any,
    t0: Any,
    t_max: Any,
    *args: Any,
    rtol: float = 1.4e-8,
    atol: float = 1.4e-8,
    mxstep: float = jnp.inf,
    hmax: float = jnp.inf,
    method: str | AbstractMethod = "dopri5",
    dt: float | None = None,
    adjoint: str | AbstractAdjoint | None = None,
    throw: bool = True,
    return_info: bool = False,
) -> Any:
    """Integrate `dy/dt = func(y, t, *args)` from `(t0, y0)` until `event` crosses zero.

    Arguments:
        func: the vector field `func(y, t, *args)`.
        event: the event function `event(y, t, *args) -> scalar`; the solve stops at
            its first sign change after `t0`.
        y0: the initial state (a pytree of floating-point or complex arrays, as
            `odeint` takes it).
        t0: the initial time.
        t_max: the latest time searched.
        *args: extra arguments of `func` and `event`.
        rtol: as for `odeint`.
        atol: as for `odeint`.
        mxstep: as for `odeint`.
        hmax: as for `odeint`.
        method: as for `odeint`.
        dt: as for `odeint` (fixed-step methods).
        adjoint: as for `odeint` (the reverse mode of the solves to the event).
        throw: raise at run time when no event happens before `t_max` (or the solve
            fails); with `throw=False` (which needs `return_info=True`), `t_max` and
            the state there come back, with the status `MAX_STEPS` in the info.
        return_info: also return an `ODEInfo` (see Returns).

    Returns:
        `(t_event, y_event)`, both differentiable (forward and reverse mode) with
        respect to `y0`, `t0`, `args` and values `func`/`event` close over;
        `(t_event, y_event, info)` when `return_info`, with `info` an `ODEInfo` of the
        search: its steps, rejected attempts and evaluations up to the step that
        crossed, `t_final = t_event`, and `status` `SUCCESS` when an event was found
        (`MAX_STEPS` when `t_max` was reached first, other codes as in `odeint`).

    Example:
        ```python
        import jax, jax.numpy as jnp
        from solvers import odeint_event

        # A ball dropped from height h hits the ground at t = sqrt(2 h / g).
        def fall(y, t, g):
            return jnp.stack([y[1], -g])

        def ground(y, t, g):
            return y[0]

        t_hit, y_hit = odeint_event(fall, ground, jnp.array([10.0, 0.0]), 0.0, 5.0, 9.81)
        ```
    """
    name = "odeint_event"
    if not callable(event):
        raise TypeError(f"{name}: `event` must be callable as event(y, t, *args), got {event!r}")
    static_bool(name, "throw", throw)
    not_in_checked_shard_map(name)
    static_bool(name, "return_info", return_info)
    status_returned(name, throw, return_info)
    m = resolve_method(name, method)
    y_flat, unravel = ravel_pytree(y0)
    tdt = jnp.finfo(y_flat.dtype).dtype
    t0 = jnp.asarray(t0, tdt)
    t_max = jnp.asarray(t_max, tdt)
    options = dict(rtol=rtol, atol=atol, mxstep=mxstep, hmax=hmax, method=method, dt=dt)

    # Detection, forward only: closed-over values and inputs enter as constants. A
    # complex state is searched in the real form `odeint` integrates it in.
    search_func = func
    if m.implicit and jnp.iscomplexobj(y_flat):
        y_flat, unravel, search_func, _ = real_form(name, m, y0, y_flat, unravel, func, None, None)
    f_conv, f_consts, _ = closure_convert(lambda y, t, *a: search_func(y, t, *a), y0, t0, *args)
    g_conv, g_consts, _ = closure_convert(lambda y, t, *a: event(y, t, *a), y0, t0, *args)
    const = jax.lax.stop_gradient((f_consts, g_consts, args, y_flat, t0, t_max))
    fc, gc, a_sg, y_sg, t0_sg, tmax_sg = const

    def field(y, t, params):
        return ravel_pytree(f_conv(params[0], unravel(y), t, *params[2]))[0].astype(y.dtype)

    def g_flat(y, t, params):
        return jnp.asarray(g_conv(params[1], unravel(y), t, *params[2])).reshape(())

    loop = LoopConfig(
        method=m,
        rtol=positive(name, "rtol", rtol),
        atol=positive(name, "atol", atol),
        mxstep=positive(name, "mxstep", mxstep),
        hmax=positive(name, "hmax", hmax),
        dt=None if dt is None else positive(name, "dt", dt),
        event=g_flat,
    )
    if not m.adaptive and dt is None:
        raise ValueError(f"{name}: method={method!r} takes fixed steps: pass `dt=`")
    params = (fc, gc, a_sg)
    search = integrate(field, y_sg, jnp.stack([t0_sg, tmax_sg]), params, loop)
    stats = search.info
    found = stats.status == EVENT
    t_guess = _refine(m, field, g_flat, params, search.final, loop)
    t_guess = jnp.where(found, t_guess, tmax_sg)
    status = jnp.where(found, SUCCESS, jnp.where(stats.status == SUCCESS, MAX_STEPS, stats.status))
    if throw:
        t_guess = error_if(
            t_guess,
            status != SUCCESS,
            f"{name}: no zero crossing of `event` between t0 and t_max (status {{status}}; "
            "1: t_max reached without an event, other codes as in odeint) at t = {t:.6g}. "
            "Raise `t_max`, check the sign of `event` at the start, or pass throw=False "
            "with return_info=True.",
            values={"status": status, "t": stats.t_final},
        )

    def residual(tau):
        ys = odeint(func, y0, jnp.stack([t0, tau]), *args, adjoint=adjoint, **options)
        y = jax.tree_util.tree_map(lambda v: v[-1], ys)
        return jnp.asarray(event(y, tau, *args)).reshape(())

    def solve(_, guess):
        return guess

    def tangent_solve(lin, rhs):
        return rhs / lin(jnp.ones_like(rhs))

    # Without an event (throw=False) the answer is t_max, which does not move.
    t_root = custom_root(residual, t_guess, solve, tangent_solve)
    t_event = jnp.where(found, t_root, tmax_sg)
    ys = odeint(func, y0, jnp.stack([t0, t_event]), *args, adjoint=adjoint, **options)
    y_event = jax.tree_util.tree_map(lambda v: v[-1], ys)
    if return_info:
        info = dataclasses.replace(
            stats, t_final=jax.lax.stop_gradient(t_event), status=status.astype(jnp.int32)
        )
        return t_event, y_event, info
    return t_event, y_event


def _refine(method, field, g_flat, params, final, loop):
    """The event time inside the step that crossed, by bisection on its length (each
    trial length re-takes the step from the last point before the crossing)."""
    y, t, k, h = final.y, final.t, final.k, final.h
    side = jnp.sign(g_flat(y, t, params))

    def g_after(s):
        y1 = method.step(field, y, k, t, s, params, tol=loop.stage_tol)[0]
        return g_flat(y1, t + s, params)

    def bisect(_, bounds):
        lo, hi = bounds
        mid = 0.5 * (lo + hi)
        same = jnp.sign(g_after(mid)) == side
        return jnp.where(same, mid, lo), jnp.where(same, hi, mid)

    lo, hi = jax.lax.fori_loop(0, _BISECTIONS, bisect, (jnp.zeros_like(h), h))
    return t + 0.5 * (lo + hi)
