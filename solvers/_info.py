"""Diagnostics shared by the nonlinear solvers: `SolveInfo` and how failure is reported."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from implicitdiff import error_if
from implicitdiff.internal import max_norm

__all__ = [
    "SolveInfo",
    "SUCCESS",
    "MAX_STEPS",
    "NONFINITE",
    "BAD_BRACKET",
    "DT_UNDERFLOW",
    "STATUS_NAMES",
    "report",
    "default_tolerance",
    "describe_status",
    "failure_message",
    "max_norm",
]

#: `SolveInfo.status` codes.
SUCCESS, MAX_STEPS, NONFINITE, BAD_BRACKET, DT_UNDERFLOW = 0, 1, 2, 3, 4
STATUS_NAMES = {
    SUCCESS: "converged",
    MAX_STEPS: "max_steps reached",
    NONFINITE: "non-finite values",
    BAD_BRACKET: "f has the same sign at both ends of the bracket",
    DT_UNDERFLOW: "step size underflow",
}


def default_tolerance(dtype: Any) -> float:
    """The default `rtol` and `atol` on a step: 1e-10 in float64, 1e-6 in narrower floats."""
    return 1e-10 if jnp.dtype(dtype).itemsize >= 8 else 1e-6


class SolveInfo(eqx.Module):
    """What a solve did. A pytree: under `vmap`, every field has one entry per element.

    Attributes:
        steps: number of iterations taken.
        residual: the last convergence measure, in the max norm: for
            `fixed_point`, the last (undamped) step `|f(a, x) - x|`; for `root`,
            `|f(x)|` at the answer; for `minimize`, `|grad_x fun(x)|`.
        status: `SUCCESS` (0), `MAX_STEPS` (1), `NONFINITE` (2) or, for
            `root(method="bisection")`, `BAD_BRACKET` (3).
    """

    steps: Int[Array, ...]
    residual: Float[Array, ...]
    status: Int[Array, ...]

    @property
    def converged(self) -> Bool[Array, ...]:
        """True where the solve met its tolerance."""
        return self.status == SUCCESS


def describe_status(*codes: int) -> str:
    """The meaning of status codes for a message, e.g. `"1: max_steps reached, 2: ..."`."""
    return ", ".join(f"{code}: {STATUS_NAMES[code]}" for code in codes)


def failure_message(name: str, max_steps: int) -> str:
    """The run-time error text for a solve that did not converge, a `str.format` template
    with the fields `status`, `steps` and `residual`."""
    codes = describe_status(MAX_STEPS, NONFINITE, BAD_BRACKET)
    return (
        f"{name} did not converge: status {{status}} ({codes}; max_steps={max_steps}) "
        "after {steps} steps, last residual {residual:.3e}. To fix it: raise `max_steps`, "
        "loosen `rtol`/`atol`, try another `method` (e.g. damping or Anderson acceleration "
        "for a fixed point, Newton for a root), start closer to the solution, or check the "
        "inputs for NaN. Pass `throw=False` (with `return_info=True`) to get the status "
        "instead."
    )


def report(x: Any, info: SolveInfo, *, throw: bool, name: str, max_steps: int) -> Any:
    """Return `x`; when `throw`, raise at run time if the solve did not converge."""
    if not throw:
        return x
    return error_if(
        x,
        info.status != SUCCESS,
        failure_message(name, max_steps),
        values={"status": info.status, "steps": info.steps, "residual": info.residual},
    )
