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
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from implicitdiff import custom_root, linear_solve
from implicitdiff.linear_solve import LinearSolver

from ._base import StageTolerance, after, jacobian_product
from ._newton import simplified_newton
from ._runge_kutta import TableauMethod, combine

__all__ = ["ESDIRK", "NEWTON_ITERS", "NEWTON_KAPPA"]

#: The most simplified Newton iterations for one stage.
NEWTON_ITERS = 10
#: The estimated distance to a stage's solution at which its iteration stops, as a
#: fraction of the step's error tolerance (in the error control's norm).
NEWTON_KAPPA = 1e-2


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
    """

    linear_solver: LinearSolver = linear_solve.Dense(throw=False)

    def __post_init__(self):
        tab = self.tableau
        if tab.gamma is None or tab.gamma[0] != 0.0:
            raise ValueError(
                f"ESDIRK {self.name!r}: the tableau needs a diagonal `gamma` whose first "
                "entry is 0 (an explicit first stage)"
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

    @property
    def derivative_solver(self) -> LinearSolver:
        return self.linear_solver

    def step_with_stages(self, f, y, k1, t, h, params, *, tol=None):
        tol = tol or StageTolerance()
        tab = self.tableau
        n, dt = y.shape[0], y.dtype
        rdt = jnp.finfo(dt).dtype
        # The iteration matrices `I - h gamma J`, one per distinct diagonal, prepared by
        # the linear solver from Jacobian-vector products at the step's start. They only
        # steer the iteration (its derivative is implicit), so no gradient flows
        # through them.
        solver = self.linear_solver
        jvp = jacobian_product(
            f, jax.lax.stop_gradient(y), t, jax.tree_util.tree_map(jax.lax.stop_gradient, params)
        )
        lus, prev = {}, None
        for g in sorted(set(tab.gamma[1:])):
            # One preparation after the other (see `after`).
            hg = after(jnp.asarray(h * g, dt), prev)
            lus[g] = prev = jax.lax.stop_gradient(solver.init(lambda v, hg=hg: v - hg * jvp(v), y))
        size = n if tol.size is None else tol.size

        def weighted_norm(dz, z):
            scale = tol.atol + tol.rtol * jnp.abs(z[:size])
            return jnp.sqrt(jnp.mean(jnp.square(jnp.abs(dz[:size]) / scale)))

        def newton(res, z0, lu, eta0):
            z, conv, eta, _ = simplified_newton(
                lambda z: solver.solve(lu, -res(z)),
                z0,
                weighted_norm,
                kappa=NEWTON_KAPPA,
                max_iters=NEWTON_ITERS,
                eta0=eta0,
            )
            return z, (conv, eta)

        # The stage equations' derivatives: the residual's Jacobian at the stage value,
        # prepared once by the same linear solver (in reverse mode, for the forward and
        # the transposed solve). The solver should not check finiteness: a step whose
        # Newton iteration failed is rejected and its tangent discarded, and the stage
        # value of such a step may be far off, with a singular or non-finite Jacobian.
        tangent_solve = solver

        ks = [k1]
        ok = jnp.asarray(True)
        eta = jnp.asarray(1.0, rdt)
        z = y
        for i in range(1, tab.stages):
            base = combine(y, h, tab.a[i], ks)
            ti = t + tab.c[i] * h
            g = tab.gamma[i]
            guess = combine(y, h, tab.predictor[i - 1], ks) if tab.predictor else base

            def residual(z, base=base, ti=ti, g=g):
                return z - base - (h * g) * f(z, ti, params)

            def solve(res, z0, lu=lus[g], eta0=eta):
                return newton(res, z0, lu, eta0)

            z, (conv, eta) = custom_root(residual, guess, solve, tangent_solve, has_aux=True)
            eta = jax.lax.stop_gradient(eta)
            ok = ok & conv
            # (A zero step, such as a solve from `t0` to `t0` attempts, has no stage
            # derivatives.)
            hg = jnp.asarray(h * g, dt)
            nonzero = hg != 0
            ks.append(jnp.where(nonzero, (z - base) / jnp.where(nonzero, hg, 1), 0))
        y1 = z if self.stiffly_accurate else combine(y, h, tab.b, ks)
        k_next = ks[-1] if self.stiffly_accurate else f(y1, t + h, params)
        return y1, self.error(h, ks), k_next, ok, ks
