"""`BacksolveAdjoint`: the continuous adjoint, integrated backwards with the state."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

from implicitdiff import error_if

from ..fields import AdjointField
from ._base import AbstractAdjoint

__all__ = ["BacksolveAdjoint", "BACKSOLVE_DRIFT"]

#: The most the backsolve adjoint's state (adaptive methods), integrated backwards over
#: one output interval, may differ from the forward solution at the interval's start,
#: in units of the error tolerance (`atol + rtol |y|`, RMS over the state). A stable
#: backward integration stays within a few tens of units (an error of a few tolerances
#: per interval); a problem that is stiff, strongly damped or chaotic over the interval
#: amplifies it by `exp(|lambda| dt)`, and with it the error of the gradient.
BACKSOLVE_DRIFT = 1e3

_UNSTABLE = (
    "odeint(adjoint='backsolve'): integrating the state backwards in time is unstable "
    "for this problem: at t = {t:.6g} it strayed from the forward solution by "
    "{drift:.3g} times the tolerance (the limit is " + f"{BACKSOLVE_DRIFT:g}"
    "), so the gradient would be wrong. This happens for stiff, strongly damped or "
    "chaotic systems. Use adjoint='checkpoint' (the exact gradient of the computed "
    "solution, replayed forwards from checkpoints), or shorten the intervals between "
    "output times."
)


@dataclasses.dataclass(frozen=True)
class BacksolveAdjoint(AbstractAdjoint):
    """The continuous adjoint `a' = -J^T a`, `p_bar' = -(df/dp)^T a`, integrated from
    each output time back to the previous one together with the state `y`, as
    `jax.experimental.ode.odeint` does. Memory does not grow with the number of steps,
    and the backward solves are `odeint` solves themselves, so every order of reverse
    mode works (`grad(grad)`).

    Integrating the state backwards is unstable for stiff, strongly damped and chaotic
    problems; the backward state is compared with the forward solution at every output
    time, and a gap of more than `BACKSOLVE_DRIFT` tolerances raises an error (NaN
    cotangents with `throw=False`).

    Example:
        ```python
        import jax, jax.numpy as jnp
        from solvers import odeint
        from solvers.ode import BacksolveAdjoint

        loss = lambda k: odeint(lambda y, t: -k * y, 1.0, jnp.array([0.0, 1.0]),
                                adjoint=BacksolveAdjoint())[-1]
        jax.grad(loss)(2.0)  # -exp(-2)
        ```
    """

    def forward(self, solve, y0, ts, pd, pn):
        return solve(y0, ts, pd, pn), None

    def backward(self, solve, kept, ys, ts, pd, pn, g_ys):
        return _backsolve(type(solve), solve.f, solve.cfg, ys, ts, pd, pn, g_ys)


def _backsolve(solve_cls, f, cfg, ys, ts, pd, pn, g):
    n = ys.shape[1]
    dtype = ys.dtype
    p_flat, unravel_p = ravel_pytree(pd) if pd else (jnp.zeros((0,), dtype), None)
    field = AdjointField(f, n)
    loop = dataclasses.replace(
        cfg.loop, err_size=None, record=0, dense=0, interpolate=False, progress=False
    )
    adj_cfg = dataclasses.replace(cfg, loop=loop, info=False, backward=True)
    rtol, atol = cfg.loop.rtol, cfg.loop.atol

    def interval(carry, i):
        a, p_bar, drift = carry
        a = a + g[i]
        z = jnp.concatenate([ys[i], a, p_bar])
        span = jnp.stack([-ts[i], -ts[i - 1]])
        zs = solve_cls.apply(z, span, pd, pn, f=field, cfg=adj_cfg)[0]
        # How far the state integrated backwards strayed from the forward solution at
        # the interval's start, in units of the tolerance (see `BACKSOLVE_DRIFT`).
        y_back = jax.lax.stop_gradient(zs[-1, :n])
        scale = atol + rtol * jnp.maximum(jnp.abs(ys[i - 1]), jnp.abs(ys[i]))
        gap = jnp.sqrt(jnp.mean(jnp.square(jnp.abs(y_back - ys[i - 1]) / scale)))
        worst = jnp.where(gap > drift[0], jnp.stack([gap, ts[i - 1].real]), drift)
        return (zs[-1, n : 2 * n], zs[-1, 2 * n :], worst), None

    init_drift = jnp.zeros((2,), jnp.finfo(dtype).dtype)
    init = (jnp.zeros((n,), dtype), jnp.zeros(p_flat.shape, dtype), init_drift)
    steps = jnp.arange(ys.shape[0] - 1, 0, -1)
    (a, p_bar, drift), _ = jax.lax.scan(interval, init, steps)
    a = a + g[0]
    # A state that strays that far makes the Jacobians along the way wrong: the gradient
    # cannot be trusted. An error (or, with throw=False, NaN) says so. (The fixed-step
    # methods have no tolerance: their backward error is that of the step size, as the
    # forward one; only a non-finite state is caught there.)
    if cfg.loop.method.adaptive:
        bad = ~(drift[0] <= BACKSOLVE_DRIFT)
    else:
        bad = jnp.asarray(False)
    if cfg.throw:
        a, p_bar = error_if((a, p_bar), bad, _UNSTABLE, values={"drift": drift[0], "t": drift[1]})
    else:
        a, p_bar = jnp.where(bad, jnp.nan, a), jnp.where(bad, jnp.nan, p_bar)
    ct_pd = None
    if pd:
        if not jnp.iscomplexobj(p_flat):
            p_bar = p_bar.real
        ct_pd = unravel_p(p_bar.astype(p_flat.dtype))
    return a, ct_pd
