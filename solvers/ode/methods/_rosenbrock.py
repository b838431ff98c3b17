"""Rosenbrock methods (linearly implicit Runge-Kutta), for stiff problems.

A Rosenbrock step replaces the Newton iteration of an implicit Runge-Kutta method by
one linear solve per stage with the same matrix `I - h gamma J`, `J` the Jacobian of
`f` at the step's start: one Jacobian and one factorisation per step, no iteration,
so no convergence test and no failed stage solve. In the increments form (Hairer and
Wanner, Solving ODEs II, IV.7, with the transformation that removes the matrix
products), with stage increments `u_i = h k_i`:

    (I / (h gamma) - J) u_i = f(y + sum_j a_ij u_j, t + c_i h) + h d_i f_t
                              + sum_j (C_ij / h) u_j

where `f_t` is the time derivative of `f` at the step's start (zero for an autonomous
field). Written with `k_i = u_i / h` (the stage derivatives the rest of `odeint`
works with), each stage is `k_i = gamma (I - h gamma J)^{-1} (...)`, so the matrix is
the one the ESDIRK methods factorise.

The Jacobian is part of the method, not a preconditioner: differentiating a step (the
checkpointed adjoint, forward sensitivities) differentiates through `J` and the
solves, which is the exact derivative of the computed solution.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from implicitdiff import linear_solve
from implicitdiff.linear_solve import LinearSolver

from .._small import weighted_stages
from ..mass import MassMatrix, apply_mass
from ._base import AbstractMethod, jacobian_product, lower_triangle

__all__ = ["RosenbrockTableau", "Rosenbrock", "ROLL_MIN_STATES"]

#: From this many states on, the stages after the first run as one loop
#: (`Rosenbrock._rolled_stages`) instead of one after another in the program, unless
#: the method's `stage_loop` says otherwise.
ROLL_MIN_STATES = 8


def _combine(y, h, coeffs, ks):
    """`y + h sum_j coeffs[j] ks[j]`, skipping the zero coefficients, each term added to
    `y` in turn. (`_runge_kutta.combine` sums the terms first and scales once; in a
    Rosenbrock step on 2-3 states that order measured up to 1.4x slower forward, VDPOL.)"""
    acc = y
    for aij, kj in zip(coeffs, ks):
        if aij != 0.0:
            acc = acc + (h * aij) * kj
    return acc


@dataclasses.dataclass(frozen=True)
class RosenbrockTableau:
    """The coefficients of a Rosenbrock method in the increments form (see the module).

    Attributes:
        gamma: the diagonal, one value for every stage.
        a: the strictly lower triangle of the stage arguments, row `i` with `i` entries.
        C: the strictly lower triangle of the increment couplings, row `i` with `i`
            entries.
        c: the stage times.
        d: the weights of the time derivative `f_t` per stage.
        b: the weights of the solution in the increments.
        e: the weights of the error estimate in the increments.
        dense: the rows `h_r` of the continuous extension
            `y(theta) = (1 - theta) y + theta (y1 + (1 - theta) sum_r theta^r K_r)`,
            `K_r = sum_i dense[r][i] u_i`, or `None` (cubic Hermite).
    """

    gamma: float
    a: tuple[tuple[float, ...], ...]
    C: tuple[tuple[float, ...], ...]
    c: tuple[float, ...]
    d: tuple[float, ...]
    b: tuple[float, ...]
    e: tuple[float, ...]
    dense: tuple[tuple[float, ...], ...] | None = None

    def __post_init__(self):
        s = len(self.b)
        rows_ok = all(len(r) == i for i, r in enumerate(self.a)) and all(
            len(r) == i for i, r in enumerate(self.C)
        )
        lengths = {len(self.a), len(self.C), len(self.c), len(self.d), len(self.e)}
        if not rows_ok or lengths != {s}:
            raise ValueError(
                f"RosenbrockTableau: with {s} stages, `a` and `C` need {s} rows (row i "
                f"with i entries) and `c`, `d`, `e` {s} entries"
            )
        if self.dense is not None and any(len(r) != s for r in self.dense):
            raise ValueError(f"RosenbrockTableau: each row of `dense` needs {s} entries")

    @property
    def stages(self) -> int:
        return len(self.b)


@dataclasses.dataclass(frozen=True)
class Rosenbrock(AbstractMethod):
    """A Rosenbrock method with an embedded error estimate (see the module).

    Attributes:
        tableau: the `RosenbrockTableau`.
        order: the exponent of the step-size controller (the order of the solution
            the error estimate measures).
        name: the name it is registered under.
        linear_solver: how the stages solve with `I - h gamma J`, a solver from
            `implicitdiff.linear_solve`: `Dense` (LU, the default), `Banded` (a band
            built from a few Jacobian-vector products), or a Krylov method such as
            `GMRES` (matrix-free). Give it `throw=False`: a step with a non-finite
            result is rejected and retried smaller.
        mass_matrix: the constant `M` of a differential-algebraic system `M y' = f`
            (`odeint(mass_matrix=...)` sets it), or `None` for an ODE. The stages then
            solve with `M - h gamma J`, and the increment couplings are multiplied by
            `M`.
        stage_loop: `True` runs the stages after the first as one loop, so the field
            and the stage solve are compiled once (`jit(grad)` compiles in about half
            the time); `False` writes them one after another, the fastest on a few
            states; `None` (the default) loops from `ROLL_MIN_STATES` states on.
    """

    tableau: RosenbrockTableau
    order: int
    name: str
    linear_solver: LinearSolver = linear_solve.Dense(throw=False)
    mass_matrix: MassMatrix | None = None
    stage_loop: bool | None = None

    @property
    def adaptive(self) -> bool:
        return True

    @property
    def implicit(self) -> bool:
        return True

    @property
    def stages(self) -> int:
        return self.tableau.stages

    @property
    def evals_per_step(self) -> int:
        # Stages 2..s, and `f` at the step's end for the next step's first stage.
        return self.stages

    def linearisation_solvers(self, n: int) -> tuple[tuple[LinearSolver, int], ...]:
        return ((self.linear_solver, n),)

    def continuous_weights(self) -> np.ndarray | None:
        """The continuous extension on the basis `[y, y1, k1_next, k_1, ..., k_s]`
        (see `solvers.ode.interpolation`), or `None` for cubic Hermite."""
        dense = self.tableau.dense
        if dense is None:
            return None
        # (1 - th) y + th y1 + sum_r (th^(r+1) - th^(r+2)) K_r, with K_r = h sum_i
        # dense[r][i] k_i: a polynomial of degree len(dense) + 1.
        degree = len(dense) + 1
        w = np.zeros((3 + self.stages, degree + 1))
        w[0, :2] = (1.0, -1.0)
        w[1, 1] = 1.0
        for r, row in enumerate(dense):
            for i, hri in enumerate(row):
                w[3 + i, r + 1] += hri
                w[3 + i, r + 2] -= hri
        return w

    def step_with_stages(self, f, y, k1, t, h, params, *, tol=None):
        tab = self.tableau
        dt = y.dtype
        h = jnp.asarray(h, dt)
        hg = h * tab.gamma
        # The stage matrix as a function: the linear solver builds from it what it
        # needs (the dense matrix, a band from a few products, or nothing for a
        # Krylov method). One preparation per step; the solves' derivatives reach `J`
        # through the operator, never through the factors.
        jvp = jacobian_product(f, y, t, params)
        solver = self.linear_solver
        mass = lambda v: apply_mass(self.mass_matrix, v)  # noqa: E731
        state = solver.init(lambda v: mass(v) - hg * jvp(v), y)
        f_t = None
        if any(di != 0.0 for di in tab.d):
            tt = jnp.asarray(t)
            f_t = jax.jvp(lambda s: f(y, s, params), (tt,), (jnp.ones_like(tt),))[1]
        loop = y.size >= ROLL_MIN_STATES if self.stage_loop is None else self.stage_loop
        stages = self._rolled_stages if loop else self._unrolled_stages
        ks = stages(f, y, k1, t, h, params, state, mass, f_t)
        y1 = _combine(y, h, tab.b, ks)
        err = sum((h * ei) * ki for ei, ki in zip(tab.e, ks) if ei != 0.0)
        k_next = f(y1, t + h, params)
        return y1, err, k_next, jnp.asarray(True), ks

    def _unrolled_stages(self, f, y, k1, t, h, params, state, mass, f_t):
        """The stages one after another in the program: the fastest for a small
        system, whose stages cost little more than a loop's own overhead."""
        tab = self.tableau
        ks = []
        for i in range(tab.stages):
            fi = k1 if i == 0 else f(_combine(y, h, tab.a[i], ks), t + tab.c[i] * h, params)
            rhs = fi
            if tab.d[i] != 0.0:
                rhs = rhs + (h * tab.d[i]) * f_t
            coupling = None
            for cij, kj in zip(tab.C[i], ks):
                if cij != 0.0:
                    coupling = cij * kj if coupling is None else coupling + cij * kj
            if coupling is not None:
                rhs = rhs + mass(coupling)
            ks.append(tab.gamma * self.linear_solver.solve(state, rhs))
        return ks

    def _rolled_stages(self, f, y, k1, t, h, params, state, mass, f_t):
        """Stages 2..s as one loop over the tableau's rows: the field and the stage
        solve appear once in the program instead of once per stage, which for a large
        system (a banded or sparse solve is a loop of its own) cuts the compile time of
        a step and of its derivative several times over, at a loop overhead that is
        small against such a stage."""
        tab = self.tableau
        s, dt = tab.stages, y.dtype
        a, C = lower_triangle(tab.a, s, dt), lower_triangle(tab.C, s, dt)
        c, d = jnp.asarray(tab.c, dt), jnp.asarray(tab.d, dt)

        def rhs_with_f_t(rhs, i):
            return rhs if f_t is None else rhs + (h * d[i]) * f_t

        def stage(i, ks):
            arg = y + h * weighted_stages(a[i], ks)
            rhs = f(arg, t + c[i] * h, params) + mass(weighted_stages(C[i], ks))
            k = tab.gamma * self.linear_solver.solve(state, rhs_with_f_t(rhs, i))
            return ks.at[i].set(k)

        k0 = tab.gamma * self.linear_solver.solve(state, rhs_with_f_t(k1, 0))
        ks = jnp.zeros((s,) + y.shape, dt).at[0].set(k0)
        ks = jax.lax.fori_loop(1, s, stage, ks)
        return [ks[i] for i in range(s)]
