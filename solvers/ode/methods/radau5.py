"""Radau IIA of order 5 (`"radau5"`): the three-stage collocation method of Hairer and
Wanner's RADAU5, for stiff problems.

A step solves for the stage increments `Z_i = Y_i - y` at the collocation points
`c = ((4 - sqrt 6) / 10, (4 + sqrt 6) / 10, 1)`:

    Z = h (A x I) F(Z),    F(Z)_i = f(y + Z_i, t + c_i h),

a system of `3 n` equations, and ends on the last stage, `y1 = y + Z_3` (the method
is stiffly accurate and L-stable). The simplified Newton iteration works on the
transformed increments `W = (T^-1 x I) Z`, with `T^-1 A^-1 T` block diagonal: one
real eigenvalue and a complex pair of `A^-1` (Solving ODEs II, IV.8). Its matrix
`(h^-1 A^-1 x I - I x J)` then splits into a real `n x n` system `(gamma / h - J)` and
a complex one `((alpha - i beta) / h - J)`, each prepared at the step's start by the
method's linear solver: the direct solvers factor the complex one in complex
arithmetic, the others solve it as a real system on `(n, 2)` arrays (real and
imaginary parts side by side). From `_reuse.REUSE_MIN_STATES` states on, a step of
the last one's size reuses its factors when its iteration contracted fast (RADAU5's
rule, see `solvers.ode.methods._reuse`).

As in RADAU5, the iteration starts from the last accepted step's collocation
polynomial, extrapolated to the new step's collocation points (`StageStart`); from
zero at the first step, and for a step more than `START_RATIO_MAX` times as long as
the last (after a sliver of a step to an output time). On ROBER, HIRES, VDPOL, OREGO,
POLLU and the 64-point Brusselator it then takes 2.1 to 3.2 iterations a step on
average, against 3.1 to 3.9 from zero. Unlike RADAU5, each step's stopping test starts
afresh rather than from the last step's contraction rate: with that rate some
iterations stopped after one correction, and HIRES ran 1.45x slower.

The stage equations go through `implicitdiff.custom_root`: differentiating a step
(the checkpointed adjoint, forward sensitivities) uses the implicit function theorem
on the `3 n` collocation equations, with the same linear solver for `3` coupled
copies of the unknowns (`LinearSolver.coupled`), never the Newton iterations. The
carry a step hands on holds its stages (`StageStart`), so the checkpointed adjoint's
replay of a recorded step, which knows that carry, takes them as the solution
(`replay_step`): it neither iterates nor factors the real and complex systems nor
estimates the error, and its derivative is the same, to the last bit.

The error estimate is Hairer's: `(gamma / h - J)^-1 (f(y) + h^-1 sum_i e_i Z_i)`,
an embedded solution of order 3 filtered by the real iteration matrix so that it
stays bounded on stiff components. Where it would reject the step, it is refined by
one more evaluation and solve, as RADAU5 does after a rejection. Inside the step the
solution is the collocation polynomial through `y` and the three stages.
"""

from __future__ import annotations

import dataclasses
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from implicitdiff import custom_root, linear_solve
from implicitdiff.linear_solve import LinearSolver

from ..mass import MassMatrix, apply_mass
from . import _reuse
from ._base import (
    AbstractMethod,
    Memory,
    StageReport,
    StageTolerance,
    StepEnd,
    after,
    factor_shapes,
    jacobian_product,
)
from ._newton import hairer_kappa, rounding_floor, simplified_newton

__all__ = [
    "NEWTON_ITERS",
    "START_RATIO_MAX",
    "Radau5",
    "Radau5Carry",
    "StageStart",
    "extrapolated_start",
]

#: The most simplified Newton iterations of one step.
NEWTON_ITERS = 10
#: A step more than this many times as long as the last accepted one starts its
#: iteration from zero, not from the extrapolated polynomial (`extrapolated_start`).
#: The controller grows a step at most 10-fold (`controller.GROW_MAX`); a larger ratio
#: follows a step shortened to land on an output time, whose polynomial, extrapolated
#: so far, says nothing. (Measured with 400 output times on ROBER, HIRES, VDPOL, OREGO
#: and POLLU: the iterations are the same as with no bound.)
START_RATIO_MAX = 10.0

_S6 = math.sqrt(6.0)
#: The collocation points.
C = (0.4 - _S6 / 10, 0.4 + _S6 / 10, 1.0)
#: The Radau IIA coefficients.
A = np.array(
    [
        [(88 - 7 * _S6) / 360, (296 - 169 * _S6) / 1800, (-2 + 3 * _S6) / 225],
        [(296 + 169 * _S6) / 1800, (88 + 7 * _S6) / 360, (-2 - 3 * _S6) / 225],
        [(16 - _S6) / 36, (16 + _S6) / 36, 1 / 9],
    ]
)
#: The weights of the error estimate on the increments `Z_i / h`.
E = np.array([-13 - 7 * _S6, -13 + 7 * _S6, -1.0]) / 3
# The eigenvalues of A^-1: one real, and the pair alpha -+ i beta.
_GAMMA = 3 + 3 ** (2 / 3) - 3 ** (1 / 3)
_ALPHA = 3 + 0.5 * (3 ** (1 / 3) - 3 ** (2 / 3))
_BETA = 0.5 * (3 ** (5 / 6) + 3 ** (7 / 6))


def _transformation() -> tuple[np.ndarray, np.ndarray]:
    """`T` and `T^-1` with `T^-1 A^-1 T = [[gamma, 0, 0], [0, alpha, beta], [0, -beta,
    alpha]]`: the real eigenvector, and the real and imaginary parts of a complex one."""
    vals, vecs = np.linalg.eig(np.linalg.inv(A))
    real = vecs[:, np.argmin(np.abs(vals.imag))].real
    pair = vecs[:, np.argmax(vals.imag)]  # eigenvalue alpha + i beta
    t = np.stack([real, pair.real, pair.imag], axis=1)
    return t, np.linalg.inv(t)


T, T_INV = _transformation()


def _collocation_weights() -> np.ndarray:
    """The collocation polynomial `y + sum_i L_i(theta) Z_i` as coefficients of each
    `L_i` in powers of `theta` (lowest first): `L_i` is 1 at `c_i`, 0 at 0 and at the
    other points."""
    nodes = np.array((0.0,) + C)
    vander = np.vander(nodes, 4, increasing=True)
    return np.linalg.solve(vander, np.eye(4))[:, 1:].T  # (stage, power)


#: The collocation polynomial's basis, `L_i(theta) = sum_p LAGRANGE[i, p] theta^p`.
LAGRANGE = _collocation_weights()


def _taylor_at_one(coeffs: np.ndarray) -> np.ndarray:
    """`d` with `L(1 + s) - L(1) = d[0] s + d[1] s^2 + d[2] s^3` for the cubic `L` of
    coefficients `coeffs` (lowest power first)."""
    return np.array([sum(coeffs[p] * math.comb(p, k) for p in range(k, 4)) for k in range(1, 4)])


#: Each basis polynomial about the step's end: `L_i(1 + s) - L_i(1) = sum_k
#: SHIFTED[i, k] s^(k + 1)`.
SHIFTED = np.stack([_taylor_at_one(row) for row in LAGRANGE])


def extrapolated_start(z, ratio):
    """The starting increments of a step `ratio` times as long as the step whose
    increments are `z`, from that step's collocation polynomial `u(theta) = y + sum_j
    L_j(theta) z_j`: `u(1 + c_i ratio) - u(1)` at the new collocation points (Hairer's
    RADAU5), as a polynomial in `s_i = c_i ratio` (so exactly zero for `ratio = 0`).

    Written as elementwise products and sums (Horner's rule on the three points at
    once), which XLA fuses: as two small matrix products it cost several microseconds
    a step on an 8-state system."""
    s = jnp.asarray(C, z.dtype) * ratio  # (3,)
    out = None
    for j in range(3):
        d1, d2, d3 = (float(d) for d in SHIFTED[j])
        lj = s * (d1 + s * (d2 + s * d3))
        term = z[:, j : j + 1] * lj[None]
        out = term if out is None else out + term
    return out


def _mix(m: np.ndarray, z):
    """`z @ m.T` for a small constant matrix `m`: column `i` of the result is
    `sum_j m[i, j] z[:, j]`, written out as scaled sums (cheaper than a product with
    three columns, and fused with what surrounds it)."""
    cols = []
    for row in m:
        acc = None
        for j, mij in enumerate(row):
            if mij != 0.0:
                term = float(mij) * z[:, j]
                acc = term if acc is None else acc + term
        cols.append(jnp.zeros_like(z[:, 0]) if acc is None else acc)
    return jnp.stack(cols, axis=1)


class _Systems:
    """The two linear systems of the iteration, `(gamma / h M - J) x = b` (real) and
    `((alpha - i beta) / h M - J) x = b` (complex), as `solver` prepares and solves
    them.

    A solver that takes complex systems (`LinearSolver.solves_complex`: the direct
    ones) factors the `n x n` complex matrix, with `J` applied to the real and
    imaginary parts of a vector; one of real systems only, or a state of a precision
    with no complex type (16-bit floats), solves the equivalent real system on `(n, 2)`
    arrays (`solver.coupled(2)`), twice the size, and for a band twice the width.

    A step prepares them as the two factorisations when the solver keeps factors
    (`keeps`), which a later step may reuse (`solvers.ode.methods._reuse`), else as
    the two states.
    """

    def __init__(self, solver: LinearSolver, mass, n: int, dt):
        self.solver, self.mass, self.n, self.dt = solver, mass, n, dt
        self.complex = solver.solves_complex and jnp.dtype(dt) in (
            jnp.dtype(jnp.float32),
            jnp.dtype(jnp.float64),
        )
        self.pair_solver = solver if self.complex else solver.coupled(2)
        pair_like = ((n,), jnp.result_type(dt, jnp.complex64)) if self.complex else ((n, 2), dt)
        self.factor_shapes = (
            factor_shapes(solver, (n,), dt),
            factor_shapes(self.pair_solver, *pair_like),
        )
        self.keeps = self.factor_shapes[0] is not None
        #: Whether a step hands its factors to the next.
        self.reuses = self.keeps and n >= _reuse.REUSE_MIN_STATES

    def prepare(self, jvp, shift_real, shift_re, shift_im):
        """The two systems with `J v = jvp(v)`: their factors when the solver keeps
        factors, else their states."""
        solver, mass, n, dt = self.solver, self.mass, self.n, self.dt

        def real_matrix(v):
            return shift_real * mass(v) - jvp(v)

        real = jax.lax.stop_gradient(solver.init(real_matrix, jnp.zeros(n, dt)))
        # The second preparation waits for the first (see `after`).
        shift_re, shift_im = after((shift_re, shift_im), real)
        if self.complex:
            shift = jax.lax.complex(jnp.asarray(shift_re, dt), jnp.asarray(shift_im, dt))

            def matrix(v):
                return shift * mass(v) - jax.lax.complex(jvp(v.real), jvp(v.imag))

            like = jnp.zeros(n, shift.dtype)
        else:

            def matrix(v):  # the same operator on (re, im) columns
                mv = mass(v)
                re, im = mv[:, 0], mv[:, 1]
                out_re = shift_re * re - shift_im * im - jvp(v[:, 0])
                out_im = shift_im * re + shift_re * im - jvp(v[:, 1])
                return jnp.stack([out_re, out_im], axis=1)

            like = jnp.zeros((n, 2), dt)
        pair = jax.lax.stop_gradient(self.pair_solver.init(matrix, like))
        if self.keeps:
            return solver.factors(real), self.pair_solver.factors(pair)
        return real, pair

    def _solve(self, solver, prepared, b):
        if self.keeps:
            return solver.solve_factors(prepared, b)
        return solver.solve(prepared, b)

    def solve_real(self, prepared, b):
        return self._solve(self.solver, prepared[0], b)

    def solve_pair(self, prepared, b_re, b_im):
        """The complex system's solution for `b_re + i b_im`, as `(n, 2)`: the real and
        imaginary parts side by side."""
        if self.complex:
            x = self._solve(self.pair_solver, prepared[1], jax.lax.complex(b_re, b_im))
            return jnp.stack([x.real, x.imag], axis=1)
        return self._solve(self.pair_solver, prepared[1], jnp.stack([b_re, b_im], axis=1))


class StageStart(Memory):
    """Where the next step's iteration starts (never differentiated: the stages'
    derivative is implicit), as one array: the checkpointed adjoint records the carry
    at every step, and each array in it is a write per step and a read per step back.

    Attributes:
        packed: `(3 n + 1,)`: the last accepted step's stage increments `z` (`(n, 3)`
            row by row; zero before the first step), then its size `h` (0 before the
            first step, whose iteration starts from zero).
    """

    packed: Array

    @classmethod
    def pack(cls, z, h) -> StageStart:
        return cls(packed=jnp.concatenate([z.reshape(-1), jnp.asarray(h, z.dtype)[None]]))

    def unpack(self, n: int):
        """`(z, h)`."""
        return self.packed[: 3 * n].reshape(n, 3), self.packed[3 * n]


class Radau5Carry(eqx.Module):
    """What `Radau5` hands from one accepted step to the next.

    Attributes:
        k: `f` at the step's end.
        memory: the step's factors, for the next step to reuse (`_reuse.FactorMemory`),
            or `None` for a small system or a solver that keeps no factors.
        start: where the next step's iteration starts (`StageStart`).
    """

    k: Float[Array, ...]
    memory: _reuse.FactorMemory | None
    start: StageStart


@dataclasses.dataclass(frozen=True)
class Radau5(AbstractMethod):
    """Radau IIA of order 5 (see the module): three implicit stages solved together,
    L-stable and stiffly accurate, with a 3rd-order error estimate. Stiff problems at
    tight tolerances, and strongly oscillatory stiff ones where an ESDIRK method
    struggles.

    Attributes:
        linear_solver: how the iteration and the stages' derivatives solve, a solver
            from `implicitdiff.linear_solve`: `Dense` (LU, the default), `Banded` (its
            band widened for the coupled systems), or a Krylov method such as `GMRES`.
            Give it `throw=False` (a failed stage solve rejects the step).
        mass_matrix: the constant `M` of a differential-algebraic system `M y' = f`
            (`odeint(mass_matrix=...)` sets it), or `None` for an ODE.
    """

    order: int = 4
    name: str = "radau5"
    linear_solver: LinearSolver = linear_solve.Dense(throw=False)
    mass_matrix: MassMatrix | None = None

    @property
    def adaptive(self) -> bool:
        return True

    @property
    def implicit(self) -> bool:
        return True

    @property
    def stages(self) -> int:
        return 3

    @property
    def evals_per_step(self) -> int:
        # `f` at the step's end (the next step's error estimate starts from it).
        return 1

    def linearisation_solvers(self, n: int) -> tuple[tuple[LinearSolver, int], ...]:
        # A replayed step takes its stages as given (`replay_step`) and factors
        # nothing else: its derivative solves the three collocation equations coupled.
        return ((self.linear_solver.coupled(3), 3 * n),)

    @property
    def factorisations_per_step(self) -> int:
        # The real system and the complex one.
        return 2

    def continuous_weights(self) -> np.ndarray:
        """The collocation polynomial on the basis `[y, y1, k1_next, k_1, k_2, k_3]`,
        with `k_i = Z_i / h` the stages this method returns."""
        w = np.zeros((6, 4))
        w[0, 0] = 1.0
        w[3:] = LAGRANGE
        return w

    def _systems(self, n: int, dt) -> _Systems:
        mass = lambda v: apply_mass(self.mass_matrix, v)  # noqa: E731
        return _Systems(self.linear_solver, mass, n, dt)

    def initial_carry(self, y0, k0):
        systems = self._systems(y0.shape[0], y0.dtype)
        memory = None
        if systems.reuses:
            memory = _reuse.FactorMemory.empty(systems.factor_shapes, y0.dtype)
        n = y0.shape[0]
        start = StageStart.pack(jnp.zeros((n, 3), y0.dtype), 0)
        return Radau5Carry(k=k0, memory=memory, start=start)

    def slope(self, carry: Radau5Carry):
        return carry.k

    def attempt_work(self, carry1: Radau5Carry):
        if carry1.memory is None:
            return super().attempt_work(carry1)
        work = carry1.memory.work
        return work, 2 * work

    def next_size(self, h_step, ratio, good, accept, carry1: Radau5Carry, last=None):
        h_new = super().next_size(h_step, ratio, good, accept, carry1, last)
        if carry1.memory is None:
            return h_new
        return _reuse.hold(h_new, h_step, accept, carry1.memory)

    def replay_carry(self, carry: Radau5Carry) -> Radau5Carry:
        # A replay takes its stages from its end (`replay_step`): it never iterates, so
        # the factors a step may reuse are not read, and not recorded.
        return dataclasses.replace(carry, memory=None)

    def replay_end(self, carry: Radau5Carry) -> StageStart:
        return carry.start

    def replay_step(self, f, y, carry: Radau5Carry, t, h, params, end: StepEnd, *, tol=None):
        # The step's stages are in the carry it handed on (`StageStart`), exactly as its
        # iteration left them: the replay takes them as the solution of the collocation
        # equations, whose derivative is the same implicit one, taken at the same point.
        stages, _ = end.carry.unpack(y.shape[0])
        return self.step_with_stages(f, y, carry, t, h, params, tol=tol, stages=stages)

    def step_with_stages(self, f, y, carry: Radau5Carry, t, h, params, *, tol=None, stages=None):
        """One step (see `AbstractMethod.step_with_stages`). With `stages`, the stage
        increments `Z` of a replayed step (`replay_step`): no iteration, no
        factorisation, a zero error estimate, and the carry's factors handed on as
        they came."""
        tol = tol or StageTolerance()
        n, dt = y.shape[0], y.dtype
        h = jnp.asarray(h, dt)
        size = n if tol.size is None else tol.size
        nonzero = h != 0
        inv_h = jnp.where(nonzero, 1 / jnp.where(nonzero, h, 1), 0)
        k1, memory = carry.k, carry.memory
        z_last, h_last = carry.start.unpack(n)
        stat = jax.lax.stop_gradient
        systems = self._systems(n, dt)
        mass = systems.mass
        # The iteration matrices, from Jacobian-vector products at the step's start (or
        # the last step's factors, see `_reuse`). They only steer the iteration (its
        # derivative is implicit) and the error estimate, so no gradient flows
        # through them.
        y_c, p_c = stat((y, params))
        shift_real = _GAMMA * inv_h
        shift_re, shift_im = _ALPHA * inv_h, -_BETA * inv_h

        def fresh():
            return systems.prepare(jacobian_product(f, y_c, t, p_c), shift_real, shift_re, shift_im)

        if stages is not None:
            prepared = work = None
        elif memory is None:
            prepared, work = fresh(), None
        else:
            prepared, work = _reuse.prepare_or_reuse(memory, h, fresh)

        # The three stages' fields as one batched evaluation: the field appears once
        # in the program wherever the stages are evaluated, differentiated or
        # transposed, not three times (on POLLU, about a fifth less to compile for
        # `jit(grad)`, and no slower to run).
        stage_field = jax.vmap(f, in_axes=(1, 0, None), out_axes=1)
        stage_times = t + jnp.asarray(C, dt) * h

        def stage_fields(z):
            return stage_field(y[:, None] + z, stage_times, params)

        scale = tol.atol + tol.rtol * jnp.abs(y_c[:size])

        def norm(dw, w):
            return jnp.sqrt(jnp.mean(jnp.square(dw[:size] / scale[:, None])))

        def correction(w):
            fw = _mix(T_INV, stage_fields(_mix(T, w)))
            mw = mass(w)
            d_real = systems.solve_real(prepared, fw[:, 0] - shift_real * mw[:, 0])
            rhs_re = fw[:, 1] - (shift_re * mw[:, 1] - shift_im * mw[:, 2])
            rhs_im = fw[:, 2] - (shift_im * mw[:, 1] + shift_re * mw[:, 2])
            pair = systems.solve_pair(prepared, rhs_re, rhs_im)
            return jnp.concatenate([d_real[:, None], pair], axis=1)

        kappa, floor = hairer_kappa(tol.rtol, dt), rounding_floor(tol.rtol, dt)

        def newton(res, z0):
            w, conv, eta, iters = simplified_newton(
                correction,
                _mix(T_INV, z0),
                norm,
                kappa=kappa,
                max_iters=NEWTON_ITERS,
                eta0=1.0,
                floor=floor,
            )
            return _mix(T, w), (StageReport(conv, iters), _reuse.contraction(eta, iters))

        def residual(z):
            return mass(z) - h * _mix(A, stage_fields(z))

        known = h_last != 0
        ratio = jnp.where(known, h / jnp.where(known, h_last, 1), 0)
        extrapolate = (ratio != 0) & (jnp.abs(ratio) <= START_RATIO_MAX)
        z0 = stat(jnp.where(extrapolate, extrapolated_start(z_last, ratio), 0))
        if stages is None:
            solve = newton
        else:

            def solve(res, z0):  # a replay's solution is given (`replay_step`)
                del res, z0
                return stat(stages), (StageReport.given(), jnp.zeros((), dt))

        z, (report, theta) = custom_root(
            residual, z0, solve, self.linear_solver.coupled(3), has_aux=True
        )
        y1 = y + z[:, 2]
        k_next = f(y1, t + h, params)
        if stages is None:
            err = self._error(f, y_c, t, p_c, stat((k1, z)), inv_h, systems, prepared, tol)
        else:
            err = jnp.zeros_like(y)
        ks = [z[:, i] * inv_h for i in range(3)]
        if memory is not None and stages is None:
            memory = _reuse.FactorMemory(
                factors=prepared, h=stat(h), theta=stat(theta).astype(memory.theta.dtype),
                work=work,
            )  # fmt: skip
        start = StageStart.pack(stat(z), stat(h))
        return y1, err, Radau5Carry(k=k_next, memory=memory, start=start), report, ks

    def _error(self, f, y, t, params, k1_z, inv_h, systems, prepared, tol):
        """Hairer's error estimate, refined by one more solve where it exceeds the
        tolerance (see the module)."""
        k1, z = k1_z
        ze = apply_mass(self.mass_matrix, _mix(E[None], z)[:, 0] * inv_h)
        err = systems.solve_real(prepared, k1 + ze)
        size = y.shape[0] if tol.size is None else tol.size
        y1 = y + z[:, 2]
        w = tol.atol + tol.rtol * jnp.maximum(jnp.abs(y[:size]), jnp.abs(y1[:size]))
        big = jnp.sqrt(jnp.mean(jnp.square(err[:size] / w))) > 1

        def refine(err):
            return systems.solve_real(prepared, f(y + err, t, params) + ze)

        return jax.lax.cond(big, refine, lambda e: e, err)
