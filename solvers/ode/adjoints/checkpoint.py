"""`CheckpointAdjoint`: the discrete adjoint, replaying recorded steps from checkpoints."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from implicitdiff import error_if

from ..solve import dense_cotangents, times_cotangent
from ._base import AbstractAdjoint
from .sweep import CheckpointSweep, batch_first, batched_sweep, shared_or_first

__all__ = ["CheckpointAdjoint"]

_NONFINITE = (
    "odeint(adjoint='checkpoint'): the gradient is not finite although the solution "
    "and the cotangents of its outputs are. A step replayed from a checkpoint, or the "
    "derivative of a step (for an implicit method, the stage equations' Jacobian), "
    "overflowed: check `func` and its derivatives for values that overflow or divide by "
    "zero along the solution. Pass throw=False (with return_info=True) to get the "
    "non-finite gradient instead."
)


@dataclasses.dataclass(frozen=True)
class CheckpointAdjoint(AbstractAdjoint):
    """The exact gradient of the computed solution (the discrete adjoint).

    The forward pass records each accepted step's start and size, the state (and the
    method's carry, e.g. the derivative the next step starts from) every `m` steps (a
    checkpoint), and the states of the latest `m` steps; the backward pass recomputes
    one earlier segment of states at a time from its checkpoint and pulls the
    cotangent back through each step (one `jax.vjp` of the step). By default `m` is
    more than `max_steps` when the start of every step fits in `KEEP_ALL_MAX` numbers
    (2^20, times the largest `vmap` batch among the inputs: a small system), so nothing
    is recomputed. Otherwise `m` is as long as a record of `RECORD_MAX` numbers allows
    (2^23, 64 MB in double precision), up to `SEGMENT_STEPS_MAX` (512) steps, so that
    a solve of fewer steps replays none, and never less than about `sqrt(max_steps)`
    (rounded down to a multiple of 8). For a state of 100 entries or more, the steps
    of a segment are linearised eight at a time in one batch, so their Jacobians and
    factorisations run batched (on CPU, not when a solver the step's linearisation
    factors with factors a batch no faster than one matrix after another: a wide
    band's blocked LU or a long narrow band's partitions, see
    `AbstractMethod.linearisation_solvers`); and a method whose stage equation's
    solution the step's end holds (BDF's corrector, the end state; Radau5's and
    ESDIRK's stages, the carry the step handed on) takes it from the record instead of
    iterating again.
    Outputs inside a step (`interpolate=True`) are linear in the step's stages, so
    their cotangents join that pull-back. Memory: the record's step
    times and sizes (`2 max_steps`), its states and carries (at most `RECORD_MAX`
    numbers over the batch, or those of `sqrt(max_steps)` checkpoints and as many
    latest steps if that is more; `O(max_steps)` when every start is kept) and the
    linearisations of up to eight steps (for a dense stage solver, eight `n x n`
    factorisations). Under `vmap` the sweep runs once for the whole batch, with the
    cotangents of shared parameters summed inside each step; `jacrev` of one solve
    sends its cotangents through in groups whose copies of the record stay within
    `KEEP_ALL_MAX` numbers (one at a time if one copy is larger). Differentiable once
    in reverse mode, then to any order in forward mode (`jax.hessian`; each tangent
    then carries a tangent of the record: with many parameters, `checkpoints=` bounds
    it).

    Attributes:
        max_steps: the most accepted steps recorded (more is an error naming it).
        checkpoints: at most how many checkpoints the record holds (`m = max_steps /
            checkpoints`, rounded up, and up to a multiple of 8 above 8): fewer make
            longer segments, so fewer steps replayed and a larger buffer of the
            latest states; more, the reverse. Default `None`: as above.

    Example:
        ```python
        import jax, jax.numpy as jnp
        from solvers import odeint
        from solvers.ode import CheckpointAdjoint

        loss = lambda k: odeint(lambda y, t: -k * y, 1.0, jnp.array([0.0, 1.0]),
                                adjoint=CheckpointAdjoint(max_steps=1024))[-1]
        jax.grad(loss)(2.0)  # -exp(-2)
        ```
    """

    max_steps: int = 4096
    checkpoints: int | None = None

    def __post_init__(self):
        for name in ("max_steps", "checkpoints"):
            value = getattr(self, name)
            if value is None and name == "checkpoints":
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"CheckpointAdjoint: `{name}` must be a Python int, got {value!r}")
            if value < 1:
                raise ValueError(f"CheckpointAdjoint: `{name}` must be >= 1, got {value}")

    def forward(self, solve, y0, ts, pd, pn):
        return solve.run(y0, ts, pd, pn, record=self.max_steps, checkpoints=self.checkpoints or 0)

    def _sweep_params(self, solve, states):
        # Steps between checkpoints, as the forward pass chose them (`checkpoint_every`):
        # the rows of its latest states but their spare.
        return dict(f=solve.f, loop=solve.cfg.loop, every=states[2].shape[-2] - 1)

    def backward(self, solve, kept, ys, ts, pd, pn, g_ys):
        states, steps = _record_parts(kept)
        a0, ct_pd = CheckpointSweep.apply(
            states, g_ys, pd, pn, steps, per_element=kept.per_element,
            **self._sweep_params(solve, states),
        )  # fmt: skip
        return _finite(a0, ct_pd, g_ys, solve.cfg.throw)

    def backward_batched(self, solve, axis_size, in_dims, res, res_dims, g, g_dims):
        # A vmapped solve: one sweep for the whole batch, in which the cotangents of the
        # parameters the batch shares are summed over it at each step (not held per
        # element). The rest maps element by element.
        first = lambda x, d: batch_first(x, d, axis_size)  # noqa: E731

        def batched(key):
            return jax.tree_util.tree_map(first, res[key], res_dims[key])

        pd, pd_axes = shared_or_first(res["pd"], res_dims["pd"])
        pn, pn_axes = shared_or_first(res["pn"], res_dims["pn"])
        rec, ys, tn, ts = batched("kept"), batched("ys"), batched("tn"), batched("ts")
        g_ys, ts = jax.vmap(dense_cotangents)(tn, ts, first(g[0], g_dims[0]))
        states, steps = _record_parts(rec)
        a0, ct_pd = batched_sweep(
            states, g_ys, (pd, pd_axes), (pn, pn_axes), steps, per_element=rec.per_element,
            **self._sweep_params(solve, states),
        )  # fmt: skip
        a0, ct_pd = _finite(a0, ct_pd, g_ys, solve.cfg.throw)
        y0_dims, ts_dims = in_dims[0], in_dims[1]
        ct_ts = None
        if tn is None and res["ts_ct"]:
            times = jax.vmap(
                lambda *a: times_cotangent(solve.f, *a), (0, 0, pd_axes, pn_axes, 0, 0)
            )
            ct_ts = times(ys, ts, pd, pn, g_ys, a0)
            ct_ts = ct_ts if ts_dims is not None else jnp.sum(ct_ts, axis=0)
        a0 = a0 if y0_dims is not None else jnp.sum(a0, axis=0)
        return a0, ct_ts, ct_pd, None


def _record_parts(rec):
    """A `Record` as the sweep takes it: the kept states, and the steps and outputs."""
    b = rec.buffers
    states = (b.y_cp, b.k_cp, b.y_last, b.k_last)
    return states, (b.t, b.h, rec.out_step, rec.out_theta, rec.steps)


def _finite(a0, ct_pd, g_ys, throw):
    """The sweep's cotangents, with an error (when `throw`) where they are not finite
    although the outputs' cotangents are: a NaN gradient never comes back silently."""
    if not throw:
        return a0, ct_pd
    leaves = [a0, *jax.tree_util.tree_leaves(ct_pd)]
    finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))
    bad = jnp.all(jnp.isfinite(g_ys)) & ~finite
    return error_if((a0, ct_pd), bad, _NONFINITE)
