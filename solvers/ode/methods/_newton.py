"""The simplified Newton iteration of the implicit Runge-Kutta methods, and its stopping
test.

The iteration matrix is fixed for the whole step (the Jacobian at the step's start),
so the iteration converges linearly, and Hairer and Wanner's test (Solving ODEs II,
IV.8) stops it: with the contraction rate `theta_k = |dx_k| / |dx_(k-1)|` and
`eta = theta / (1 - theta)`, the distance to the solution is about `eta |dx_k|`, and
the iteration has converged once that is at most `kappa` in the weighted RMS norm of
the error control. A rate of 1 or more (divergence), a non-finite iterate or
`max_iters` iterations fail it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["hairer_kappa", "simplified_newton"]

_RUNNING, _CONVERGED, _FAILED = 0, 1, 2


def hairer_kappa(rtol: float, dtype) -> float:
    """Hairer and Wanner's `kappa` for the implicit Runge-Kutta stages (RADAU5's
    `fnewt`): `min(0.03, sqrt(rtol))`, and never below ten roundings of the solution
    in units of the tolerance."""
    eps = float(jnp.finfo(dtype).eps)
    return max(10 * eps / rtol, min(0.03, rtol**0.5))


def simplified_newton(correction, x0, norm, *, kappa, max_iters, eta0):
    """Iterate `x <- x + correction(x)` from `x0` (see the module).

    Arguments:
        correction: `x -> dx`, the Newton correction (a solve with the iteration
            matrix).
        x0: the starting point (an array).
        norm: `(dx, x) -> ` the size of the correction `dx` at the new iterate `x`, in
            units of the tolerance.
        kappa: the estimated distance to the solution at which to stop.
        max_iters: the most iterations.
        eta0: the `eta` the first iteration's test uses (it has no rate of its own):
            a previous solve's, damped as `eta0 ** 0.8`.

    Returns:
        `(x, converged, eta, iterations)`.
    """
    rdt = jnp.finfo(jnp.result_type(x0)).dtype
    eps = float(jnp.finfo(rdt).eps)

    def body(carry):
        x, _, it, prev, eta = carry
        dx = correction(x)
        x = x + dx
        size_k = norm(dx, x)
        theta = size_k / prev
        eta = jnp.where(it == 0, jnp.maximum(eta, eps) ** 0.8, theta / jnp.maximum(1 - theta, eps))
        finite = jnp.all(jnp.isfinite(x)) & jnp.isfinite(size_k)
        diverged = (it > 0) & (theta >= 1) & (size_k > 100 * eps)
        done = (eta * size_k <= kappa) | (size_k <= 100 * eps)
        state = jnp.where(~finite | diverged, _FAILED, jnp.where(done, _CONVERGED, _RUNNING))
        return x, state, it + 1, size_k, eta

    def cond(carry):
        _, state, it, *_ = carry
        return (state == _RUNNING) & (it < max_iters)

    one = jnp.asarray(1.0, rdt)
    init = (x0, jnp.asarray(_RUNNING), jnp.asarray(0), one, jnp.asarray(eta0, rdt))
    x, state, iters, _, eta = jax.lax.while_loop(cond, body, init)
    return x, state == _CONVERGED, eta, iters
