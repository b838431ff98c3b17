"""Convergence tests, diagnostics and the failure check of a fixed-point iteration.

Everything here compares the last two iterates, `x` and `x_prev` (of which `x` is the
image), against the tolerance `(rtol, atol)`: whether an element still moves
(`_moving`, `_not_settled`), the `SolveInfo` of a finished solve (`_info`), and the
run-time check that raises when a solve failed (`_check`), which works out which
elements failed, and why, only when one did.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from implicitdiff.internal import all_finite, check_lazily, reduce_any

from .._info import (
    MAX_STEPS,
    NONFINITE,
    SUCCESS,
    SolveInfo,
    describe_status,
    failure_message,
    max_norm,
)


def _pairs(x, x_prev):
    return zip(jax.tree_util.tree_leaves(x), jax.tree_util.tree_leaves(x_prev))


def _moving(x, x_prev, tol):
    """Whether any element moved by more than `atol + rtol |x|` (False where NaN)."""
    rtol, atol = tol
    flags = [reduce_any(jnp.abs(u - v) > atol + rtol * jnp.abs(u)) for u, v in _pairs(x, x_prev)]
    return functools.reduce(jnp.logical_or, flags)


def _not_settled(x, x_prev, tol):
    """Like `_moving`, but True where not finite."""
    rtol, atol = tol
    flags = [
        reduce_any(~(jnp.abs(u - v) <= atol + rtol * jnp.abs(u)) | ~jnp.isfinite(u))
        for u, v in _pairs(x, x_prev)
    ]
    return functools.reduce(jnp.logical_or, flags)


def _info(x, x_prev, steps, tol, scale):
    """The `SolveInfo` of a solve that stopped at `x`, the image of `x_prev`."""
    status = jnp.where(
        all_finite(x), jnp.where(_moving(x, x_prev, tol), MAX_STEPS, SUCCESS), NONFINITE
    )
    sizes = [jnp.abs(u - v) for u, v in _pairs(x, x_prev)]
    return SolveInfo(
        steps=jnp.asarray(steps, jnp.int32),
        residual=max_norm(sizes) / scale,
        status=status.astype(jnp.int32),
    )


def _failed(x, x_prev, tol):
    return _moving(x, x_prev, tol) | ~all_finite(x)


def _check(x, x_prev, steps, tol, failed, cfg):
    """`x`, raising at run time if `failed` (a verdict reduced over any batch; a false
    alarm will do: which elements failed, and why, is worked out only then). Neither `x`
    nor anything of its size reaches the host, so a sharded `x` stays sharded."""
    if cfg.derivative:
        msg = (
            "fixed_point: the linear solve for the derivative (adjoint='neumann': the "
            "fixed-point iteration run on the linearised map) did not converge: status "
            f"{{status}} ({describe_status(MAX_STEPS, NONFINITE)}) after {{steps}} steps, "
            "last step {residual:.3e}. It converges only when `f` contracts at the "
            "solution (every eigenvalue of df/dx below 1 in modulus). To fix it: pass "
            "adjoint='dense' (small states) or adjoint='gmres', raise `max_steps` (now "
            f"{cfg.max_steps}), or, for a map that does not contract, solve with "
            "method='damped' or 'anderson', after which the default adjoint falls back "
            "to a direct solve where the series fails."
        )
    else:
        msg = failure_message("fixed_point", cfg.max_steps)
    details = functools.partial(_failure_details, cfg.scale)
    return check_lazily(
        x, failed, details, (x, x_prev, steps, tol), msg, ("status", "steps", "residual")
    )


def _failure_details(scale, x, x_prev, steps, tol):
    info = _info(x, x_prev, steps, tol, scale)
    return info.status != SUCCESS, (info.status, info.steps, info.residual)
