"""Step-size control of the adaptive methods: the error norm, the first step size and
the next one.

A step is accepted when its embedded error estimate, in the weighted RMS norm
`sqrt(mean((err / (atol + rtol * max(|y|, |y_new|)))**2))`, is at most 1. The next step
size is `h * clip(0.9 * ratio**(-1/order), 0.2, 10)` (never shrinking after an
accepted step, never growing after a rejected one), capped at `hmax`.

The implicit one-step methods add Gustafsson's predictive control (Hairer and Wanner,
Solving ODEs II, IV.8; the controller of RADAU5 and RODAS): after an accepted step
that follows another, the next size is also at most (so it may shrink)

    h * clip(0.9 * ratio**(-1/order) * min(1, (h / h_acc) * (err_acc / ratio)**(1/order)), 0.2, 10)

with `h_acc` and `err_acc` the size and error (at least 0.01) of the accepted step
before. It sees the error growing from one step to the next, so the steps stop
growing into a region where they would be rejected: on stiff problems with fast
transitions (VDPOL, OREGO) rejected attempts fall by a factor of 5 to 15, and the
attempts in all by 10-20%, with the final errors within a factor of 3 either way.
"""

from __future__ import annotations

import jax.numpy as jnp

__all__ = [
    "SAFETY",
    "GROW_MAX",
    "SHRINK_MIN",
    "ERR_ACC_MIN",
    "rms_ratio",
    "initial_step",
    "next_size",
]

SAFETY, GROW_MAX, SHRINK_MIN = 0.9, 10.0, 0.2
#: The least error of an accepted step that the predictive controller remembers.
ERR_ACC_MIN = 1e-2


def rms_ratio(err, y, y1, rtol, atol, size):
    """The error estimate in units of the tolerance (weighted RMS over the first
    `size` entries, or all when `size` is None)."""
    if size is not None:
        err, y, y1 = err[:size], y[:size], y1[:size]
    scale = atol + rtol * jnp.maximum(jnp.abs(y), jnp.abs(y1))
    return jnp.sqrt(jnp.mean(jnp.square(jnp.abs(err) / scale)))


def initial_step(method, f, y0, k0, t0, params, rtol, atol, size):
    """A first step size from the norms of `y0`, `f(y0)` and a trial Euler step
    (Hairer, Norsett and Wanner, Solving ODEs I, II.4).

    The exponent is `1 / method.order`, the order of the local error estimate (the
    error of a 5(4) pair with local extrapolation is `O(h^5)`), as in Hairer's own
    `dopri5`/`dop853` codes, diffrax, SciPy and `jax.experimental.ode`."""
    yv, kv = (y0, k0) if size is None else (y0[:size], k0[:size])
    scale = atol + jnp.abs(yv) * rtol
    d0 = jnp.sqrt(jnp.mean(jnp.square(jnp.abs(yv) / scale)))
    d1 = jnp.sqrt(jnp.mean(jnp.square(jnp.abs(kv) / scale)))
    h0 = jnp.where((d0 < 1e-5) | (d1 < 1e-5), 1e-6, 0.01 * d0 / d1)
    y1 = y0 + h0.astype(y0.dtype) * k0
    k1 = f(y1, t0 + h0, params)
    k1v = k1 if size is None else k1[:size]
    d2 = jnp.sqrt(jnp.mean(jnp.square(jnp.abs(k1v - kv) / scale))) / h0
    big = jnp.maximum(d1, d2)
    h1 = jnp.where(
        big <= 1e-15,
        jnp.maximum(1e-6, h0 * 1e-3),
        (0.01 / big) ** (1.0 / method.order),
    )
    return jnp.minimum(100 * h0, h1)


def next_size(h_step, ratio, good, accept, order, last=None):
    """The next step size after an attempt of size `h_step` whose error is `ratio`
    (`good`: the step computed finite values and its stage solves converged). With
    `last = (h_acc, err_acc, any)`, the size and error of the accepted step before and
    whether there was one, an accepted step's successor is also held to Gustafsson's
    predictive size (see the module)."""
    safe_ratio = jnp.where(good, ratio, jnp.inf)
    standard = SAFETY * safe_ratio ** (-1.0 / order)
    grow = jnp.where(safe_ratio == 0, GROW_MAX, jnp.clip(standard, SHRINK_MIN, GROW_MAX))
    grow = jnp.where(accept, jnp.maximum(grow, 1.0), jnp.minimum(grow, 1.0))
    if last is not None:
        h_acc, err_acc, any_acc = last
        tiny = jnp.finfo(jnp.result_type(ratio)).tiny
        trend = (h_step / h_acc) * (err_acc / jnp.maximum(safe_ratio, tiny)) ** (1.0 / order)
        predicted = jnp.clip(standard * jnp.minimum(trend, 1.0), SHRINK_MIN, GROW_MAX)
        use = accept & any_acc & (safe_ratio > 0)
        grow = jnp.where(use, jnp.minimum(grow, predicted), grow)
    return h_step * grow
