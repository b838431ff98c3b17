"""The iteration methods of `fixed_point`: plain, damped and Anderson-accelerated.

`_iterate` runs plain or damped steps (`_iterate_step`, `_damped_step`) in a
`lax.while_loop`, testing convergence every `check_every` steps, one loop over the
whole batch under `vmap`; with `watch` it also stops an element whose linear iteration
diverges or stalls (`_gives_up`), for the default adjoint's fallback. `_anderson` is
type-II Anderson acceleration on the flattened iterate, whose small regularised least
squares is solved by `_solve_spd`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

from implicitdiff.internal import any_over_batch

from .._info import max_norm
from .convergence import _moving, _not_settled, _pairs

# The default adjoint after "damped" or "anderson" stops the Neumann series of an
# element once its step has grown `_GROWTH` times larger than its first step (the series
# diverges), or has not shrunk below its first step after `_STALL_STEPS` steps (an
# eigenvalue of modulus 1), and solves that element directly.
_GROWTH = 1e3
_STALL_STEPS = 64


def _iterate_step(f, a, x, *, damping):
    del damping
    return f(a, x)


def _damped_step(f, a, x, *, damping):
    fx = f(a, x)
    return jax.tree_util.tree_map(lambda u, v: (1 - damping) * u + damping * v, x, fx)


def _iterate(step, x0, tol, max_steps, check_every, first_check, *, nan_stops, watch=False):
    """Step from `x0` until a step moves no element by more than the tolerance;
    returns the last two iterates and the number of steps.

    The first test comes after `first_check` steps, the next ones every `check_every`
    steps, never beyond `max_steps`. An element that is NaN stops the loop when
    `nan_stops`, else it keeps it going. Under `vmap` the loop is one loop over the
    batch: it runs until every element has converged (`any_over_batch`), not once per
    element with masking. With `watch`, an element also stops counting once it
    diverges or stalls (`_gives_up`, measured against its step at the first test).
    """
    unsettled = _moving if nan_stops else _not_settled

    def advance(x, steps, every):
        if every == 1:
            return x, step(x), steps + 1
        n = jnp.minimum(every, max_steps - steps)
        # An inner loop rather than unrolled steps: XLA's CPU backend would cut an
        # unrolled chain of steps into several passes over memory per step.
        x = jax.lax.fori_loop(0, n - 1, lambda _, x: step(x), x)
        return x, step(x), steps + n

    init = advance(x0, jnp.asarray(0, jnp.int32), first_check)
    if watch:

        def watched_cond(carry):
            x_prev, x, steps, first = carry
            active = unsettled(x, x_prev, tol) & ~_gives_up(x, x_prev, steps, first)
            return (steps < max_steps) & any_over_batch(active)

        def watched_body(carry):
            return (*advance(carry[1], carry[2], check_every), carry[3])

        init = (*init, _step_size(init[1], init[0]))
        return jax.lax.while_loop(watched_cond, watched_body, init)[:3]

    def cond(carry):
        x_prev, x, steps = carry
        return (steps < max_steps) & any_over_batch(unsettled(x, x_prev, tol))

    return jax.lax.while_loop(cond, lambda c: advance(c[1], c[2], check_every), init)


def _step_size(x, x_prev):
    """The largest `|x - x_prev|` (per element under `vmap`)."""
    return max_norm([jnp.abs(u - v) for u, v in _pairs(x, x_prev)])


def _gives_up(x, x_prev, steps, first):
    """Whether a linear iteration whose first step had size `first` diverges (its step
    grew `_GROWTH` times larger, or is not finite) or stalls (no step below the first
    one after `_STALL_STEPS` steps). A contraction's steps shrink geometrically, but for
    a non-normal `A` they may grow for a while: a false alarm only costs a direct solve.
    """
    size = _step_size(x, x_prev)
    return ~(size <= _GROWTH * first) | ((steps >= _STALL_STEPS) & ~(size < first))


def _anderson(f, a, x0, tol, max_steps, beta, m, lam):
    """Anderson acceleration (type II) on the flattened iterate, memory `m`.

    Returns the last iterate, its image (the point returned, whose step was measured)
    and the number of evaluations of `f`.
    """
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
        x, g_x, _, _, steps = carry
        return (steps < max_steps) & _moving(g_x, x, tol) & jnp.all(jnp.isfinite(g_x))

    def body(carry):
        _, _, xs, gs, steps = carry
        # Weights alpha (summing to one) minimising |sum_i alpha_i (g_i - x_i)| over the
        # filled slots; empty slots get weight zero through an identity block.
        filled = jnp.arange(m) < jnp.minimum(steps + 1, m)
        both = filled[:, None] & filled[None, :]
        resid = gs - xs
        h = jnp.where(both, resid @ resid.T, 0.0)
        scale = jnp.trace(h) / jnp.sum(filled) + jnp.finfo(dt).tiny
        h = h + lam * scale * eye + jnp.where(both, 0.0, eye)
        alpha = _solve_spd(h, filled.astype(dt))
        alpha = alpha / jnp.sum(alpha)
        x_new = beta * (alpha @ gs) + (1 - beta) * (alpha @ xs)
        g_new = g(x_new)
        slot = (steps + 1) % m
        return x_new, g_new, xs.at[slot].set(x_new), gs.at[slot].set(g_new), steps + 1

    init = (flat0, g0, xs, gs, jnp.asarray(0, jnp.int32))
    x, g_x, _, _, steps = jax.lax.while_loop(cond, body, init)
    return unravel(x), unravel(g_x), steps + 1


_UNROLLED_SOLVE_MAX = 8  # the largest Anderson memory solved by the unrolled Cholesky


def _solve_spd(h, b):
    """Solve `h x = b` for a small symmetric positive definite `h` (Anderson's regularised
    normal equations). Up to `_UNROLLED_SOLVE_MAX` unknowns: an unrolled Cholesky
    factorisation, elementwise operations that vectorise under `vmap`, where a batched
    `jnp.linalg.solve` is a loop of LAPACK calls on XLA's CPU backend."""
    m = h.shape[0]
    if m > _UNROLLED_SOLVE_MAX:
        return jnp.linalg.solve(h, b)
    low = [[None] * m for _ in range(m)]  # the Cholesky factor, entry by entry
    for j in range(m):
        low[j][j] = jnp.sqrt(h[j, j] - sum(low[j][k] ** 2 for k in range(j)))
        for i in range(j + 1, m):
            dot = sum(low[i][k] * low[j][k] for k in range(j))
            low[i][j] = (h[i, j] - dot) / low[j][j]
    y = []
    for i in range(m):
        y.append((b[i] - sum(low[i][k] * y[k] for k in range(i))) / low[i][i])
    x = [None] * m
    for i in reversed(range(m)):
        x[i] = (y[i] - sum(low[k][i] * x[k] for k in range(i + 1, m))) / low[i][i]
    return jnp.stack(x)
