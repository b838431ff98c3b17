"""`ODEInfo`: what a solve did; and the status codes it reports."""

from __future__ import annotations

import equinox as eqx
from jaxtyping import Array, Bool, Float, Int

from .._info import DT_UNDERFLOW, MAX_STEPS, NONFINITE, SUCCESS

__all__ = ["ODEInfo", "SUCCESS", "MAX_STEPS", "NONFINITE", "DT_UNDERFLOW", "EVENT"]

#: Internal status: the loop stopped before a step across an event (`odeint_event`).
EVENT = -1


class ODEInfo(eqx.Module):
    """What an `odeint` solve did (a pytree; one entry per element under `vmap`).

    Attributes:
        steps: accepted steps.
        rejected: rejected step attempts.
        num_fevals: evaluations of `func`: at `t[0]`, for the first step size, and by
            every step attempt (an implicit method also spends evaluations in its
            Newton iterations and Jacobians, not counted here).
        num_jacobians: Jacobians of `func` evaluated: one per attempt of an implicit
            method, except where it keeps a step's factorisation for later steps
            (`"bdf"`, and `"radau5"` from 16 states on with a solver that keeps
            factors), which counts only the attempts that evaluated one; none for an
            explicit method.
        num_factorisations: factorisations of the stage matrices `I - h gamma J`
            (one per distinct diagonal value per attempt that factored).
        num_stage_failures: attempts rejected because their stage equations were
            not solved (Newton's iteration diverged or ran out of iterations).
        num_newton_iterations: simplified Newton iterations spent on the stage
            equations by every attempt (summed over an attempt's stages, and over a
            retry with a fresh iteration matrix); none for an explicit or a Rosenbrock
            method, whose stages are explicit or linear. Divided by `steps +
            rejected` and by the stage equations an attempt solves (one for
            `"radau5"` and `"bdf"`, six for `"kvaerno5"`), it is the iterations of one
            solve: 2 to 3.5 on the IVP test set; many more mean an iteration matrix
            gone stale or steps near the iteration's limit of convergence (try
            another method, or a tighter tolerance).
        t_final: the time reached (`t[-1]` on success).
        status: `SUCCESS` (0), `MAX_STEPS` (1: `mxstep` attempts in one output
            interval, or more than `max_steps` steps recorded for the checkpointed
            adjoint or kept for dense output), `NONFINITE` (2) or `DT_UNDERFLOW` (4:
            the step size fell below the resolution of `t`).
    """

    steps: Int[Array, ...]
    rejected: Int[Array, ...]
    num_fevals: Int[Array, ...]
    num_jacobians: Int[Array, ...]
    num_factorisations: Int[Array, ...]
    num_stage_failures: Int[Array, ...]
    num_newton_iterations: Int[Array, ...]
    t_final: Float[Array, ...]
    status: Int[Array, ...]

    @property
    def converged(self) -> Bool[Array, ...]:
        """True where the solve reached the last output time."""
        return self.status == SUCCESS
