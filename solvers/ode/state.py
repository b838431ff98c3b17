"""The typed state of the stepping loop (pytrees: one entry per element under `vmap`)."""

from __future__ import annotations

from typing import Any

import equinox as eqx
from jaxtyping import Array, Float, Int

__all__ = ["StepState", "RecordBuffers", "Record"]


class StepState(eqx.Module):
    """Where an integration stands.

    Attributes:
        t: the time reached.
        y: the state there (flat).
        k: the method's carry there (a pytree; by default the derivative as the last
            step computed it; see `solvers.ode.methods`).
        h: the next step size to try.
        acc: accepted steps.
        rej: rejected attempts.
        failed: attempts whose stage equations were not solved (an implicit method's
            Newton iteration diverged or ran out of iterations).
        iterations: Newton iterations the attempts spent on their stage equations.
        tries: attempts since the last output time (for `mxstep`).
        jacobians: Jacobians the attempts evaluated.
        factorisations: stage-matrix factorisations the attempts made.
        h_acc: the size of the latest accepted step (the step-size controller's
            memory, see `solvers.ode.controller`).
        err_acc: its error in units of the tolerance, at least `ERR_ACC_MIN`.
        status: the status code (`solvers.ode.info`).
        g: the sign of the event function at `(t, y)` (an event search), else `None`.
    """

    t: Float[Array, ...]
    y: Array
    k: Any
    h: Float[Array, ...]
    acc: Int[Array, ...]
    rej: Int[Array, ...]
    failed: Int[Array, ...]
    iterations: Int[Array, ...]
    tries: Int[Array, ...]
    status: Int[Array, ...]
    jacobians: Int[Array, ...]
    factorisations: Int[Array, ...]
    h_acc: Float[Array, ...]
    err_acc: Float[Array, ...]
    g: Array | None = None


class RecordBuffers(eqx.Module):
    """What a recording loop writes as it goes (for the checkpointed adjoint). (With
    `base` set, the buffers are one block's `BlockRows` instead of arrays.)

    Attributes:
        t: each accepted step's start (`max_steps + 1` slots, the last a spare).
        h: each accepted step's size.
        y_cp: the state every `every` accepted steps, from step 0 (the last slot a
            spare), and the solve's end in the slot after its last step's segment
            (`loop.write_end`). When `y_last` keeps every step's start, only step 0's
            and the end are written.
        k_cp: the method's carry at those states, and at the solve's end where its
            replay reads the end's carry (`AbstractMethod.replay_end`; a pytree, each
            leaf with a leading slot axis): a replay from a checkpoint starts from it,
            so it repeats the solve's steps exactly.
        y_last: the starts of the latest `every` steps, step `k` in slot `k % every`.
        k_last: the carry at those starts, as a replay of the step with its end known
            reads it (`AbstractMethod.replay_carry`).
        base: `None`, or for one block of a record written by blocks (see
            `solvers.ode.blocks`), the number of steps before the block: `t`, `h`,
            `y_last` and (leaf by leaf) `k_last` are then `BlockRows` holding the
            block's steps only, step k in row k - base.
    """

    t: Float[Array, ...]
    h: Float[Array, ...]
    y_cp: Float[Array, ...]
    k_cp: Any
    y_last: Float[Array, ...]
    k_last: Any
    base: Int[Array, ...] | None = None


class Record(eqx.Module):
    """What a recording solve hands the checkpointed sweep: the `RecordBuffers`, where
    each output lies, and the number of steps.

    Attributes:
        buffers: the `RecordBuffers` (`y_last` and `k_last` with their spare row).
        out_step: for each output row, the accepted-step count at which it was reached
            (it lies in step `out_step - 1`).
        out_theta: where in that step, as a fraction of it (1 at its end).
        steps: the accepted steps.
        per_element: whether the solve ran for each element of a batch
            (`implicitdiff.internal.in_batch`), so its factorisations (carried in
            `k_cp`, `k_last`) have the layout of a batch; the sweep replays the steps
            so.
    """

    buffers: RecordBuffers
    out_step: Int[Array, ...]
    out_theta: Float[Array, ...]
    steps: Int[Array, ...]
    per_element: bool = eqx.field(static=True, default=False)
