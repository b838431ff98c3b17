"""The simplified Newton iteration of the implicit methods, and its stopping test.

The iteration matrix is fixed for the whole step (the Jacobian at the step's start),
so the iteration converges linearly, and Hairer and Wanner's test (Solving ODEs II,
IV.8) stops it: with the contraction rate `theta_k = |dx_k| / |dx_(k-1)|` and
`eta = theta / (1 - theta)`, the distance to the solution is about `eta |dx_k|`, and
the iteration has converged once that is at most `kappa` in the weighted RMS norm of
the error control. A rate of 1 or more (divergence) above the rounding floor, a
non-finite iterate or `max_iters` iterations fail it.

The rounding floor. Near the solution, a correction is the rounding error of the
residual passed through the iteration matrix's inverse: for a badly scaled matrix (a
DAE's algebraic rows at a tight tolerance) that can be a thousand roundings of the
solution, far above `kappa`, and successive corrections stop shrinking. A rate
measured there says nothing about convergence, so an iteration whose rate is
`STALL_RATE` or more while its correction is below `floor` (`rounding_floor`) is
taken as converged. The test cannot tell such noise from a real contraction that
slow (whose remaining error may be many corrections): the step's error estimate,
computed from the iterate, is the safeguard. Away from the floor the test is Hairer
and Wanner's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["STALL_RATE", "hairer_kappa", "rounding_floor", "simplified_newton"]

_RUNNING, _CONVERGED, _FAILED = 0, 1, 2

#: The contraction rate from which an iteration counts as stalled (see the module): at
#: this rate, reaching `kappa` from above the floor takes many more iterations than a
#: step allows, so the test would otherwise reject the step.
STALL_RATE = 0.9

#: The most roundings of the solution, in units of the tolerance, that the iteration
#: matrix can amplify a residual's rounding error into (see `rounding_floor`).
ROUNDING_GAIN = 1e4


def hairer_kappa(rtol: float, dtype) -> float:
    """Hairer and Wanner's `kappa` for the implicit Runge-Kutta stages (RADAU5's
    `fnewt`): `min(0.03, sqrt(rtol))`, and never below ten roundings of the solution
    in units of the tolerance."""
    eps = float(jnp.finfo(dtype).eps)
    return max(10 * eps / rtol, min(0.03, rtol**0.5))


def rounding_floor(rtol: float, dtype) -> float:
    """The size, in units of the tolerance, below which a stalled iteration's
    corrections are rounding noise: `ROUNDING_GAIN` roundings of the solution, and
    never more than `0.03` (Hairer and Wanner's loosest `kappa`)."""
    eps = float(jnp.finfo(dtype).eps)
    return min(0.03, ROUNDING_GAIN * eps / rtol)


def simplified_newton(correction, x0, norm, *, kappa, max_iters, eta0, floor):
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
        floor: the rounding floor of the corrections in units of the tolerance
            (`rounding_floor`; `0` keeps only the floor of `100 eps`).

    Returns:
        `(x, converged, eta, iterations)`: `eta` the last rate's, or the one before a
        stall at the floor (`eta0 ** 0.8` if the first measured rate stalled).
    """
    rdt = jnp.finfo(jnp.result_type(x0)).dtype
    eps = float(jnp.finfo(rdt).eps)
    floor = max(float(floor), 100 * eps)

    def body(carry):
        x, _, it, prev, eta = carry
        dx = correction(x)
        x = x + dx
        size_k = norm(dx, x)
        theta = size_k / prev
        finite = jnp.all(jnp.isfinite(x)) & jnp.isfinite(size_k)
        stalled = (it > 0) & (theta >= STALL_RATE) & (size_k <= floor)
        at_floor = (size_k <= 100 * eps) | stalled
        # A stalled rate measures the noise, not the iteration: the returned `eta` (a
        # next solve's `eta0`) stays the last one measured above the floor.
        measured = theta / jnp.maximum(1 - theta, eps)
        eta = jnp.where(it == 0, jnp.maximum(eta, eps) ** 0.8, jnp.where(stalled, eta, measured))
        diverged = (it > 0) & (theta >= 1) & ~at_floor
        done = (eta * size_k <= kappa) | at_floor
        state = jnp.where(~finite | diverged, _FAILED, jnp.where(done, _CONVERGED, _RUNNING))
        return x, state, it + 1, size_k, eta

    def cond(carry):
        _, state, it, *_ = carry
        return (state == _RUNNING) & (it < max_iters)

    one = jnp.asarray(1.0, rdt)
    init = (x0, jnp.asarray(_RUNNING), jnp.asarray(0), one, jnp.asarray(eta0, rdt))
    x, state, iters, _, eta = jax.lax.while_loop(cond, body, init)
    return x, state == _CONVERGED, eta, iters
