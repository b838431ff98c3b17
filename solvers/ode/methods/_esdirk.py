"""Diagonally implicit Runge-Kutta methods with an explicit first stage (ESDIRK), for
stiff problems.

Each implicit stage solves `z = base + h gamma_i f(z, t_i)` by a simplified Newton
iteration with the Jacobian at the step's start: `I - h gamma_i J` is factorised once
per step for each distinct diagonal value. The stage solves go through
`implicitdiff.custom_root`, so differentiating a step (the checkpointed adjoint, forward
sensitivities) uses the implicit function theorem on the stage equations, not the
iterations.

The iteration stops by Hairer and Wanner's test (`solvers.ode.methods._newton`) once
its estimated distance to the solution is `NEWTON_KAPPA` in the step's weighted RMS
norm (`atol + rtol |z|` per entry, the norm of the error control); a failed iteration
fails the step, which is then retried smaller. The rate of one stage's iteration starts
the next stage's test.

A stage derivative is taken from its stage equation, `(z - base) / (h gamma)`: equal to
`f(z, t_i)` at the solution, but `f` at the iterate would multiply the iteration's
remaining error by the stiffness (`|h J|` can be 1e6), and the error estimate and the
next stages would carry that. A stiffly accurate method (its last row of `a`, with the
diagonal, is `b`) ends the step on its last stage for the same reason.

A step hands on, with `f` at its end, its implicit stages' values (`ESDIRKCarry`): the
checkpointed adjoint records them with the step, and its replay of the step
(`replay_step`) takes them as the stage equations' solutions instead of iterating
again. The derivative is the same implicit one, taken at the same point; the replay
needs no Newton iteration and no iteration matrix.

With one diagonal value (one iteration matrix), the implicit stages can run as one
loop over the tableau's rows (`stage_loop`, by default from `ROLL_MIN_STATES` states
on): the program then holds the field, the Newton iteration and the stage solve once
instead of once per stage. Measured with kvaerno5 (2-core CPU, `jit(grad)` of a
solve: trace, lowering and XLA): HIRES (8 states) 7.3 -> 3.3 s, the 64-point
Brusselator line (128) 12.3 -> 7.3 s, and ROBER (3) 5.0 -> 2.6 s with the loop forced;
the forward solve is as fast, but the gradient of a whole solve is slower: with
replays that take the recorded stages, 2.5-2.7 ms against 1.5-1.8 on HIRES and
12.1-13.7 against 11.7-12.9 on the Brusselator line (the fastest of 100 runs, both
forms timed in one process). A small system compiles quickly either way, so it keeps
the unrolled stages and their faster gradient.
"""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from implicitdiff import custom_root, linear_solve
from implicitdiff.linear_solve import LinearSolver

from .._small import weighted_stages
from ._base import (
    Memory,
    StageReport,
    StageTolerance,
    after,
    jacobian_product,
    lower_triangle,
)
from ._newton import rounding_floor, simplified_newton
from ._runge_kutta import TableauMethod, combine

__all__ = [
    "ESDIRK",
    "ESDIRKCarry",
    "StageValues",
    "NEWTON_ITERS",
    "NEWTON_KAPPA",
    "ROLL_MIN_STATES",
]

#: The most simplified Newton iterations for one stage.
NEWTON_ITERS = 10
#: The estimated distance to a stage's solution at which its iteration stops, as a
#: fraction of the step's error tolerance (in the error control's norm).
NEWTON_KAPPA = 1e-2
#: From this many states on, the implicit stages of a method with one diagonal value
#: run as one loop (`ESDIRK._rolled_stages`) instead of one after another.
ROLL_MIN_STATES = 8


class StageValues(Memory):
    """The values of a step's implicit stages, as the checkpointed adjoint's replay
    takes them (`ESDIRK.replay_step`): never differentiated (the derivative is the
    stage equations' implicit one), and one array, so that recording them is one
    buffer per step (a buffer with rows of more than one axis costs the record far
    more than its size).

    Attributes:
        packed: `((stages - 1) * n,)`: stage `i`'s value in entries `(i - 1) n` to
            `i n`. Before the first step, the start's value for every stage (those of
            a step of size zero).
    """

    packed: Float[Array, ...]

    def unpack(self, n: int):
        """The stages' values as rows, `(stages - 1, n)`."""
        return self.packed.reshape(-1, n)


class ESDIRKCarry(eqx.Module):
    """What an `ESDIRK` step hands on.

    Attributes:
        k: `f` at the step's end (the next step's explicit first stage).
        stages: the step's implicit stages' values (`StageValues`).
    """

    k: Float[Array, ...]
    stages: StageValues


@dataclasses.dataclass(frozen=True)
class ESDIRK(TableauMethod):
    """A diagonally implicit Runge-Kutta method whose first stage is explicit (see the
    module for how its stages are solved).

    Example:
        ```python
        from solvers.ode.methods import ESDIRK, ButcherTableau

        # A stiffly accurate 2(1) pair whose implicit stages have different diagonals.
        esdirk21 = ESDIRK(
            tableau=ButcherTableau(
                c=(0.0, 0.2, 1.0), a=((), (0.1,), (0.5, 0.0)), b=(0.5, 0.0, 0.5),
                e=(0.5, -1.0, 0.5), gamma=(0.0, 0.1, 0.5),
            ),
            order=2,
            name="esdirk21",
        )
        ```

    Attributes:
        linear_solver: how the Newton iteration and the stages' derivatives solve
            with `I - h gamma J`, a solver from `implicitdiff.linear_solve`: `Dense`
            (LU, the default), `Banded`, or a Krylov method such as `GMRES`. Give it
            `throw=False` (a failed stage solve rejects the step).
        stage_loop: `True` runs the implicit stages as one loop, so the field, the
            Newton iteration and the stage solve are compiled once (`jit(grad)`
            compiles in about half the time, the gradient of a solve runs up to 1.6
            times as long: see the module); `False` writes them one after another;
            `None` (the default) loops from `ROLL_MIN_STATES` states on. A loop needs
            one diagonal value for all implicit stages.
    """

    linear_solver: LinearSolver = linear_solve.Dense(throw=False)
    stage_loop: bool | None = None

    def __post_init__(self):
        tab = self.tableau
        if tab.gamma is None or tab.gamma[0] != 0.0:
            raise ValueError(
                f"ESDIRK {self.name!r}: the tableau needs a diagonal `gamma` whose first "
                "entry is 0 (an explicit first stage)"
            )
        if self.stage_loop and len(set(tab.gamma[1:])) != 1:
            raise ValueError(
                f"ESDIRK {self.name!r}: stage_loop=True needs one diagonal value for all "
                f"implicit stages (the tableau has {sorted(set(tab.gamma[1:]))}); leave "
                "stage_loop=None"
            )

    @property
    def implicit(self) -> bool:
        return True

    @property
    def stiffly_accurate(self) -> bool:
        """Whether the last stage is the solution (its row of `a`, with the diagonal, is
        `b`, and `c = 1`): the step then ends on that stage's value."""
        tab = self.tableau
        return tab.c[-1] == 1.0 and tuple(tab.a[-1]) + (tab.gamma[-1],) == tuple(tab.b)

    @property
    def factorisations_per_step(self) -> int:
        # One per distinct diagonal value of the implicit stages.
        return len(set(self.tableau.gamma[1:]))

    @property
    def evals_per_step(self) -> int:
        return 0 if self.stiffly_accurate else 1

    def linearisation_solvers(self, n: int) -> tuple[tuple[LinearSolver, int], ...]:
        return ((self.linear_solver, n),)

    def initial_carry(self, y0, k0) -> ESDIRKCarry:
        packed = jnp.tile(jax.lax.stop_gradient(y0), self.tableau.stages - 1)
        return ESDIRKCarry(k=k0, stages=StageValues(packed=packed))

    def slope(self, carry: ESDIRKCarry):
        return carry.k

    def replay_end(self, carry: ESDIRKCarry) -> StageValues:
        return carry.stages

    def replay_step(self, f, y, carry: ESDIRKCarry, t, h, params, end, *, tol=None):
        # The step's stage values are in the carry it handed on, as its iteration left
        # them: the replay takes them as the stage equations' solutions.
        stages = end.carry.unpack(y.shape[0])
        return self.step_with_stages(f, y, carry, t, h, params, tol=tol, stages=stages)

    def step_with_stages(self, f, y, carry: ESDIRKCarry, t, h, params, *, tol=None, stages=None):
        """One step (see `AbstractMethod.step_with_stages`). With `stages`, the implicit
        stages' values of a replayed step (`replay_step`): no iteration and no
        iteration matrix, a zero error estimate, and `ok` true (no iterations)."""
        tol = tol or StageTolerance()
        tab = self.tableau
        n, dt = y.shape[0], y.dtype
        k1 = carry.k
        # The iteration matrices `I - h gamma J`, one per distinct diagonal, prepared by
        # the linear solver from Jacobian-vector products at the step's start. They only
        # steer the iteration (its derivative is implicit), so no gradient flows
        # through them. A replay (`stages` given) iterates with none.
        solver = self.linear_solver
        lus = dict.fromkeys(sorted(set(tab.gamma[1:])))
        if stages is None:
            stat = jax.lax.stop_gradient
            jvp = jacobian_product(f, stat(y), t, jax.tree_util.tree_map(stat, params))
            prev = None
            for g in lus:
                # One preparation after the other (see `after`).
                hg = after(jnp.asarray(h * g, dt), prev)
                init = solver.init(lambda v, hg=hg: v - hg * jvp(v), y)
                lus[g] = prev = stat(init)
        size = n if tol.size is None else tol.size

        def weighted_norm(dz, z):
            scale = tol.atol + tol.rtol * jnp.abs(z[:size])
            return jnp.sqrt(jnp.mean(jnp.square(jnp.abs(dz[:size]) / scale)))

        floor = rounding_floor(tol.rtol, dt)

        def newton(res, z0, lu, eta0):
            z, conv, eta, iters = simplified_newton(
                lambda z: solver.solve(lu, -res(z)),
                z0,
                weighted_norm,
                kappa=NEWTON_KAPPA,
                max_iters=NEWTON_ITERS,
                eta0=eta0,
                floor=floor,
            )
            return z, (StageReport(conv, iters), eta)

        # The stage equations' derivatives: the residual's Jacobian at the stage value,
        # prepared once by the same linear solver (in reverse mode, for the forward and
        # the transposed solve). The solver should not check finiteness: a step whose
        # Newton iteration failed is rejected and its tangent discarded, and the stage
        # value of such a step may be far off, with a singular or non-finite Jacobian.
        tangent_solve = solver

        def stage(base, guess, ti, hg, lu, eta0, known):
            """One implicit stage: its value `z`, derivative, `StageReport` and rate.
            `known`: the stage's value in a replay, else `None`."""

            def residual(z):
                return z - base - hg * f(z, ti, params)

            def solve(res, z0):
                if known is None:
                    return newton(res, z0, lu, eta0)
                return jax.lax.stop_gradient(known), (StageReport.given(), eta0)

            z, (report, eta) = custom_root(residual, guess, solve, tangent_solve, has_aux=True)
            # (A zero step, such as a solve from `t0` to `t0` attempts, has no stage
            # derivatives.)
            nonzero = hg != 0
            k = jnp.where(nonzero, (z - base) / jnp.where(nonzero, hg, 1), 0)
            return z, k, jax.lax.stop_gradient(report), jax.lax.stop_gradient(eta)

        rolled = len(lus) == 1 and (
            n >= ROLL_MIN_STATES if self.stage_loop is None else self.stage_loop
        )
        run = self._rolled_stages if rolled else self._unrolled_stages
        ks, zs, ok = run(stage, lus, y, k1, t, h, stages)
        y1 = zs[-1] if self.stiffly_accurate else combine(y, h, tab.b, ks)
        k_next = ks[-1] if self.stiffly_accurate else f(y1, t + h, params)
        err = self.error(h, ks) if stages is None else jnp.zeros_like(y)
        stage_values = StageValues(packed=jax.lax.stop_gradient(zs.reshape(-1)))
        carry1 = ESDIRKCarry(k=k_next, stages=stage_values)
        return y1, err, carry1, ok, ks

    def _unrolled_stages(self, stage, lus, y, k1, t, h, known):
        """The stages one after another in the program: `(ks, zs, report)`, `zs` the
        implicit stages' values as rows, `report` the stages' `StageReport`."""
        tab = self.tableau
        rdt = jnp.finfo(y.dtype).dtype
        ks, zs, ok, eta = [k1], [], StageReport.given(), jnp.asarray(1.0, rdt)
        for i in range(1, tab.stages):
            base = combine(y, h, tab.a[i], ks)
            guess = combine(y, h, tab.predictor[i - 1], ks) if tab.predictor else base
            g = tab.gamma[i]
            hg = jnp.asarray(h * g, y.dtype)
            z_known = None if known is None else known[i - 1]
            z, k, report, eta = stage(base, guess, t + tab.c[i] * h, hg, lus[g], eta, z_known)
            ks.append(k)
            zs.append(z)
            ok = ok & report
        return ks, jnp.stack(zs), ok

    def _rolled_stages(self, stage, lus, y, k1, t, h, known):
        """Stages 2..s as one loop over the tableau's rows (one diagonal value, so one
        iteration matrix): the field, the Newton iteration and the stage solve appear
        once in the program instead of once per stage, which about halves the compile
        time of a solve's gradient (see the module)."""
        tab = self.tableau
        s, dt = tab.stages, y.dtype
        rdt = jnp.finfo(dt).dtype
        (lu,) = lus.values()
        hg = jnp.asarray(h * tab.gamma[1], dt)
        a = lower_triangle(tab.a, s, dt)
        # The predictor's row `i - 1` guesses stage `i`; without one, the guess is the
        # stage's explicit part.
        pred = lower_triangle(((),) + tab.predictor, s, dt) if tab.predictor else None
        c = jnp.asarray(tab.c, jnp.result_type(t, h))

        def body(i, carry):
            ks, zs, ok, eta = carry
            base = y + h * weighted_stages(a[i], ks)
            guess = base if pred is None else y + h * weighted_stages(pred[i], ks)
            z_known = None if known is None else known[i - 1]
            z, k, report, eta = stage(base, guess, t + c[i] * h, hg, lu, eta, z_known)
            return ks.at[i].set(k), zs.at[i - 1].set(z), ok & report, eta

        ks = jnp.zeros((s,) + y.shape, dt).at[0].set(k1)
        zs = jnp.zeros((s - 1,) + y.shape, dt)
        init = (ks, zs, StageReport.given(), jnp.asarray(1.0, rdt))
        ks, zs, ok, _ = jax.lax.fori_loop(1, s, body, init)
        return [ks[i] for i in range(s)], zs, ok
