"""The forward solve of `fixed_point` and the static options that configure it.

`_Config` holds the static options of one solve (a hashable primitive parameter), and
`for_derivative` turns them into those of a derivative's linear solve. `_solve` runs
the iteration method the options name (see `iteration`), picks how often to test
convergence from the size of a step, hands a derivative solve that the series could
not finish to the direct solve (see `direct`), and checks the result (see
`convergence`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from implicitdiff.internal import any_over_batch, reduce_any, vmap_size

from .convergence import _check, _failed, _info
from .direct import _fall_back
from .iteration import _anderson, _damped_step, _iterate, _iterate_step

_MIN_DERIVATIVE_STEPS = 100  # the derivative solves may take at least this many steps
# The default `check_every` when a step updates at least `_LARGE` numbers: the tests then
# cost passes over memory, and an inner loop of steps between them pays for itself.
_LARGE = 2**14
_CHECK_EVERY_LARGE = 4


@dataclasses.dataclass(frozen=True)
class _Config:
    """The static options of one solve (hashable: a primitive parameter)."""

    method: str
    scale: float
    max_steps: int
    check_every: int | None  # None: chosen from the number of values per step
    damping: float
    history: int
    regularisation: float
    throw: bool
    with_info: bool  # compute the `SolveInfo` (else `None`)
    # For the derivative solves: stop the series where it grows or stalls, and solve
    # directly where it has not converged.
    fallback: bool = False
    derivative: bool = False  # a linear solve for a derivative, not the user's problem

    def for_derivative(self) -> _Config:
        return dataclasses.replace(
            self,
            method="iterate",
            scale=1.0,
            max_steps=max(self.max_steps, _MIN_DERIVATIVE_STEPS),
            with_info=False,
            derivative=True,
        )


def _solve(f, a, x0, tol, cfg):
    """Iterate to the fixed point of `f(a, .)` from `x0`: `(x, SolveInfo)`, checked.
    `tol` is `(rtol, atol)` for an undamped step."""
    tol = (tol[0] * cfg.scale, tol[1] * cfg.scale)  # for the step actually taken
    if cfg.method == "anderson":
        x_prev, x, steps = _anderson(
            f, a, x0, tol, cfg.max_steps, cfg.damping, cfg.history, cfg.regularisation
        )
    else:
        step = _damped_step if cfg.method == "damped" else _iterate_step
        step = functools.partial(step, f, a, damping=cfg.damping)
        every = cfg.check_every
        if every is None:  # from the numbers a step updates, the whole batch under vmap
            leaves = jax.tree_util.tree_leaves(x0)
            batch = max(vmap_size(v) for v in leaves + jax.tree_util.tree_leaves(a))
            size = batch * sum(int(np.size(v)) for v in leaves)
            every = _CHECK_EVERY_LARGE if size >= _LARGE else 1
        first = 1 if cfg.derivative else every
        fallback = cfg.derivative and cfg.fallback
        # With `throw`, a NaN does not stop the loop: it runs on to max_steps and fails,
        # so that running out of steps is the whole verdict (no pass over the iterate).
        # A derivative solve that falls back also stops where the series grows, stalls or
        # is NaN (`watch`); its verdict is then a pass over the iterate.
        x_prev, x, steps = _iterate(
            step, x0, tol, cfg.max_steps, every, first, nan_stops=not cfg.throw, watch=fallback
        )
        if fallback:
            failed = any_over_batch(reduce_any(_failed(x, x_prev, tol)))
            return _fall_back(f, a, x, x_prev, tol, failed, cfg), None
    if cfg.throw:
        if cfg.method == "anderson":
            failed = any_over_batch(reduce_any(_failed(x, x_prev, tol)))
        else:
            failed = steps >= cfg.max_steps
        x = _check(x, x_prev, steps, tol, failed, cfg)
    return x, (_info(x, x_prev, steps, tol, cfg.scale) if cfg.with_info else None)
