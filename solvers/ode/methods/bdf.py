"""Variable-order, variable-step backward differentiation formulas (`"bdf"`), for stiff
problems: the numerical differentiation formulas (NDF) of orders 1 to 5, in the
quasi-constant step form of Shampine and Reichelt (MATLAB's `ode15s`) that SciPy's `BDF`
also uses.

The method keeps the backward differences of its past solutions, `D[j] = nabla^j y`
at the current step size, as its carry (`BDFCarry`). A step of order `q` predicts
`y_pred = sum_{j <= q} D[j]` and solves

    y1 - y_pred + psi = c f(y1, t + h),    c = h / alpha_q,
    psi = sum_{1 <= j <= q} gamma_j D[j] / alpha_q,

by a simplified Newton iteration with the matrix `I - c J` (`J` the Jacobian at the
prediction when the matrix is refreshed; see `BDFMemory.factors`), stopped by Hairer and
Wanner's test far inside the error test (`_newton.hairer_kappa`; see `NEWTON_ITERS`).
The error estimate is `error_const[q] (y1 - y_pred)`. After an accepted step the
differences are updated; once `q + 1` steps have been taken at one step size and order,
the errors the orders `q - 1` and `q + 1` would have made are estimated from the
differences, and the next order and step size are the ones that allow the largest step
(the step scaled by `SAFETY * (1 / err) ** (1 / (q + 1))`, `err` the estimated error in
units of the test's bound). A step of another size rescales the differences first (an
exact change of the interpolating polynomial's spacing).

The computed solution moves smoothly with the inputs wherever the step sizes and
orders hold: the decisions inside a step that rounding can tip (how many Newton
iterations a corrector takes, whether the factorisation is reused) move its solution
far less than the tolerance, and the step-size controller does not depend on them
(`SAFETY` is constant). So a derivative of the solve (which holds the step sizes and
orders fixed) is the derivative of what the solve computes nearby, and forward and
reverse mode, whose programs round differently, agree.

Derivatives: the corrector goes through `implicitdiff.custom_root` (the implicit
function theorem at its solution, never the iterations), and everything else is
linear in the differences, which the carry holds. The checkpointed adjoint therefore
differentiates through the whole history: the gradient is that of the computed
solution, with the step sizes and orders held fixed. Its backward pass knows each
step's end, so a replayed corrector takes it as its solution (`replay_step`) and only
its implicit derivative is computed there.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from implicitdiff import custom_root, linear_solve
from implicitdiff.linear_solve import LinearSolver

from .._small import small_product, weighted_stages
from ..mass import MassMatrix, apply_mass
from ._base import (
    AbstractMethod,
    Memory,
    StageReport,
    StageTolerance,
    after,
    factor_shapes,
    jacobian_product,
    keep_or_compute,
    placeholder,
)
from ._newton import hairer_kappa, rounding_floor, simplified_newton

__all__ = [
    "BDF",
    "BDFCarry",
    "BDFMemory",
    "HISTORY_PRODUCTS_MIN",
    "MAX_ORDER",
    "NEWTON_ITERS",
    "SAFETY",
]

#: The highest order.
MAX_ORDER = 5
#: The most Newton iterations of one corrector solve. The iteration stops by the test
#: of the implicit Runge-Kutta stages (`hairer_kappa`: `min(0.03, sqrt(rtol))` in the
#: error test's norm, as SciPy's `BDF`), so the rounding that tips a corrector from one
#: iteration count to the next moves its solution by a small share of the tolerance.
#: CVODE's looser test (a tenth of the error test) would halve the iterations on the
#: Brusselator line, but a tipped count then moves the solution by up to a third of
#: the tolerance: on VDPOL (eps = 1e-6, rtol 1e-8) each of 32 perturbations of the
#: parameter by 1e-15 takes its own sequence of steps, the loss moves by 1e-3 and
#: forward and reverse mode differ by 5e-3. With this test the loss moves by 2e-7 and
#: the two modes agree to 1e-6 to 1.2e-5 (docs/stiff.md).
NEWTON_ITERS = 4
#: The step-size controller's safety factor. Constant: SciPy's `BDF` lowers it after
#: more Newton iterations, so a corrector tipped from one count to the next by
#: rounding would change the next step by up to 10% (on VDPOL one perturbation in five
#: then takes another sequence of steps). At 0.7 and above more steps fail the error
#: test and the sequences split again; at 0.6, more steps for no gain.
SAFETY = 0.675
#: A factorisation of `I - c_old J` serves a step with another `c` while
#: `|c / c_old - 1|` is at most this (CVODE's `dgmax`), for at most `REUSE_STEPS` steps.
REUSE_CHANGE = 0.3
REUSE_STEPS = 20
_SHRINK_MIN, _GROW_MAX = 0.2, 10.0
#: The NDF modifications of the BDF formulas of orders 1..5 (Shampine and Reichelt).
_NDF_KAPPA = (0.0, -0.1850, -1 / 9, -0.0823, -0.0415, 0.0)


def _coefficients(ndf: bool):
    kappa = np.array(_NDF_KAPPA if ndf else (0.0,) * 6)
    gamma = np.concatenate([[0.0], np.cumsum(1.0 / np.arange(1, MAX_ORDER + 1))])
    alpha = (1 - kappa) * gamma
    error_const = kappa * gamma + 1.0 / np.arange(1, MAX_ORDER + 2)
    return gamma, alpha, error_const


def _rescale_matrix(factor):
    """The `(6, 6)` matrix `RU` with `D[:q+1] <- (RU[:q+1, :q+1])^T D[:q+1]` the
    differences of order `q` for a step `factor` times as long (its leading blocks are
    the matrices of the lower orders)."""
    i = jnp.arange(1, MAX_ORDER + 1, dtype=factor.dtype)[:, None]
    j = jnp.arange(1, MAX_ORDER + 1, dtype=factor.dtype)[None, :]

    def r(f):
        m = jnp.ones((MAX_ORDER + 1, MAX_ORDER + 1), factor.dtype)
        m = m.at[1:, :].set(0).at[1:, 1:].set((i - 1 - f * j) / i)
        return jnp.cumprod(m, axis=0)

    return small_product(r(factor), r(jnp.ones_like(factor)))


def _update_matrix(q, dtype):
    """`(A, b)` with `A D + b d^T` the differences after a step of order `q` whose
    corrector moved the prediction by `d`: `D[q+2] = d - D[q+1]`, `D[q+1] = d`, then
    `D[j] += D[j+1]` for `j = q, ..., 0` (rows above `q + 2` unchanged). Row `j <= q`
    of the product is `d + D[j] + ... + D[q]`."""
    rows = jnp.arange(MAX_ORDER + 3)
    i, j = rows[:, None], rows[None, :]
    low = (i <= q) & (j >= i) & (j <= q)
    above = (i > q + 2) & (i == j)
    a = jnp.where(low | above, 1, 0) - jnp.where((i == q + 2) & (j == q + 1), 1, 0)
    return a.astype(dtype), (rows <= q + 2).astype(dtype)


def _update_differences(D, d, q):
    """The differences after a step of order `q` (`_update_matrix`), as one product.
    Written as the recurrence, each of its six row updates copied the whole array
    (measured on CPU)."""
    a, b = _update_matrix(q, D.dtype)
    return small_product(a, D) + b[:, None] * d


#: From this many states on (the state's length; forward sensitivities step as the
#: derivative of the state's step, `fields.TangentField`), a step forms what it
#: computes from the differences as products with them (`_History`); below, row by
#: row. Measured with `bdf` on CPU, products against rows: 1000 copies of ROBER (3000
#: states) solved 1.33x and differentiated 1.69x as fast, the 1024-point Brusselator
#: line (2048) 1.25x and 1.37x, 64 copies (192) 1.08x and 1.21x, the 64-point line
#: (128, dense) 1.12x and 1.2x. Below, the rows were the quicker: on 6, 11 and 21
#: copies (18 to 63 states, dense) by 10-40% per step forward and up to 25% for a
#: gradient, and on ROBER, VDPOL and OREGO (2 and 3 states) by 10-20% forward.
HISTORY_PRODUCTS_MIN = 128


@dataclasses.dataclass(frozen=True)
class _History:
    """What a step computes from the differences `D` it starts from, all linear in
    them with coefficients that are constants of the step (its order `q` and size
    ratio `factor`, never differentiated): the differences rescaled to the step's
    size, `R D` (orders above `q` untouched); the prediction and `alpha_q psi`, the
    rows of `W R D` (`weights` is `W`); and the updated differences `A R D + b d^T`
    (`_update_matrix`).

    A large system multiplies the small matrices first, so that `D` enters one
    product, `[W R; A R] D`, whose derivative is a product too. Written row by row,
    each row's derivative with respect to `D` is a copy of the whole history padded
    around it: at 3000 states most of a backward step. A small system keeps the rows,
    which XLA fuses with the operations around them (see `HISTORY_PRODUCTS_MIN`)."""

    q: jax.Array
    weights: jax.Array
    rows: jax.Array  # for a small system: `R D`; for a large one, `[W R; A R] D`

    @classmethod
    def of(cls, D, q, factor, weights):
        top = MAX_ORDER + 1
        idx = jnp.arange(top)
        inside = (idx[:, None] <= q) & (idx[None, :] <= q)
        ru = jnp.where(inside, _rescale_matrix(factor), jnp.eye(top, dtype=D.dtype))
        if D.shape[-1] >= HISTORY_PRODUCTS_MIN:
            eye = jnp.eye(top + 2, dtype=D.dtype)
            rescale = jnp.where(factor == 1, eye, eye.at[:top, :top].set(ru.T))
            a, _ = _update_matrix(q, D.dtype)
            both = small_product(jnp.concatenate([weights, a]), rescale)
            return cls(q, weights, small_product(both, D))
        low = jnp.where(factor == 1, D[:top], small_product(ru.T, D[:top]))
        return cls(q, weights, D.at[:top].set(low))

    @property
    def products(self) -> bool:
        return self.rows.shape[0] > MAX_ORDER + 3

    def predict(self):
        """`(y_pred, alpha_q psi)`."""
        if self.products:
            return self.rows[0], self.rows[1]
        D = self.rows
        return weighted_stages(self.weights[0], D), weighted_stages(self.weights[1, 1:], D[1:])

    def update(self, d):
        """The differences after the step, whose corrector moved the prediction by
        `d`."""
        if self.products:
            _, b = _update_matrix(self.q, self.rows.dtype)
            # `b d^T` by `small_product`: on a large system a matrix product, whose
            # derivative with respect to `d`, `b^T D_bar`, is one too, where the
            # broadcast product's was a sum over the cotangent's rows, which XLA's CPU
            # runtime ran 4-8x slower (3000 states: 40 against 5.5 us; the gradient of
            # 1000 copies of ROBER 6-8% faster). Smaller, the broadcast product (192
            # states: the gradient 15% faster).
            return self.rows[2:] + small_product(b[:, None], d[None, :])
        return _update_differences(self.rows, d, self.q)


#: The order of `BDFMemory`'s scalars in its one array.
_SCALARS = ("h", "order", "order_used", "n_equal", "grow", "c", "age", "work")


class BDFMemory(Memory):
    """`BDF`'s bookkeeping (never differentiated): its scalars in one array, so that
    the checkpointed adjoint's record writes one row for them each step, not eight
    (on OREGO, eight writes a step made the recorded solve about a third slower);
    `of` builds it and each scalar is a property.

    Attributes:
        scalars: `(h, order, order_used, n_equal, grow, c, age, work)` in the state's
            dtype (`age` and `work` small whole numbers), along the last axis:
            - `h`: the step size the differences are for;
            - `order`: the order of the next step;
            - `order_used`: the order of the step that made this carry;
            - `n_equal`: steps taken at this order and step size;
            - `grow`: the step-size factor chosen after this step (1 while the
              order and step size stay);
            - `c`: the `c` of `factors` (0: none yet);
            - `age`: steps since those factors were made;
            - `work`: factorisations (each with its Jacobian) the attempt that made
              this carry computed: 0 when it reused the factors.
        factors: the factorisation of `I - c J` the next step may reuse (the linear
            solver's `factors`), or `None` for a solver that keeps none.
    """

    scalars: Float[Array, ...]
    factors: Any

    @classmethod
    def of(cls, factors, dtype, **scalars) -> BDFMemory:
        """The memory with the scalars named in `_SCALARS`."""
        values = [jnp.asarray(scalars[name], dtype) for name in _SCALARS]
        return cls(scalars=jax.lax.stop_gradient(jnp.stack(values, axis=-1)), factors=factors)

    def _get(self, name: str):
        return self.scalars[..., _SCALARS.index(name)]

    h = property(lambda self: self._get("h"))
    order = property(lambda self: self._get("order"))
    order_used = property(lambda self: self._get("order_used"))
    n_equal = property(lambda self: self._get("n_equal"))
    grow = property(lambda self: self._get("grow"))
    c = property(lambda self: self._get("c"))
    age = property(lambda self: self._get("age").astype(jnp.int32))
    work = property(lambda self: self._get("work").astype(jnp.int32))


class BDFCarry(eqx.Module):
    """What `BDF` hands from one accepted step to the next.

    Attributes:
        k: `f` at the step's end, as the corrector equation gives it.
        D: the backward differences, `MAX_ORDER + 3` rows, for steps of size
            `memory.h`.
        memory: the `BDFMemory`.
    """

    k: Float[Array, ...]
    D: Float[Array, ...]
    memory: BDFMemory


@dataclasses.dataclass(frozen=True)
class BDF(AbstractMethod):
    """Variable-order (1 to 5), variable-step NDF/BDF (see the module): few function
    evaluations and one factorisation per step, the method of choice for large stiff
    systems at moderate tolerances.

    Example:
        ```python
        import jax.numpy as jnp
        from solvers import odeint

        def robertson(y, t):
            y1, y2, y3 = y
            return jnp.array([-0.04 * y1 + 1e4 * y2 * y3,
                              0.04 * y1 - 1e4 * y2 * y3 - 3e7 * y2**2,
                              3e7 * y2**2])

        ys = odeint(robertson, jnp.array([1.0, 0.0, 0.0]), jnp.array([0.0, 40.0]),
                    method="bdf", rtol=1e-6, atol=1e-10)
        ```

    Attributes:
        ndf: the numerical differentiation formulas (the default; more accurate at the
            same cost) rather than the plain backward differentiation formulas.
        linear_solver: how the corrector and its derivative solve with `I - c J`, a
            solver from `implicitdiff.linear_solve`: `Dense` (LU, the default),
            `Banded`, or a Krylov method such as `GMRES`. Give it `throw=False` (a
            failed corrector rejects the step).
        order: the order of the first steps (the method chooses its own afterwards),
            which also sets the first step size.
        mass_matrix: the constant `M` of a differential-algebraic system `M y' = f`
            (`odeint(mass_matrix=...)` sets it), or `None` for an ODE. The corrector
            is then `M (y1 - y_pred + psi) = c f(y1, t + h)`, solved with `M - c J`.
    """

    ndf: bool = True
    linear_solver: LinearSolver = linear_solve.Dense(throw=False)
    order: int = 1
    name: str = "bdf"
    mass_matrix: MassMatrix | None = None

    @property
    def adaptive(self) -> bool:
        return True

    @property
    def implicit(self) -> bool:
        return True

    @property
    def stages(self) -> int:
        return 1

    @property
    def evals_per_step(self) -> int:
        # Only the corrector's own evaluations (one per Newton iteration).
        return 0

    def linearisation_solvers(self, n: int) -> tuple[tuple[LinearSolver, int], ...]:
        return ((self.linear_solver, n),)

    def initial_carry(self, y0, k0):
        dt = y0.dtype
        if self.mass_matrix is not None:
            # `k0 = f(y0)` is `M y'`: the differences want `y'` (the algebraic
            # unknowns' slopes, not given by `f`, start at zero).
            k0 = self.mass_matrix.pseudo_solve(k0)
        d = jnp.zeros((MAX_ORDER + 3,) + y0.shape, dt).at[0].set(y0).at[1].set(k0)
        one = jnp.ones((), dt)
        # Zeros of the factors' shapes, marked unusable by c = 0.
        factors = placeholder(factor_shapes(self.linear_solver, y0.shape, dt))
        memory = BDFMemory.of(
            factors, dt, h=one, order=one, order_used=one, n_equal=0, grow=one, c=0, age=0,
            work=0,
        )  # fmt: skip
        return BDFCarry(k=k0, D=d, memory=memory)

    def slope(self, carry: BDFCarry):
        return carry.k

    def attempt_work(self, carry1: BDFCarry):
        return carry1.memory.work, carry1.memory.work

    def next_size(self, h_step, ratio, good, accept, carry1: BDFCarry, last=None):
        # The order and size were chosen in the step (`BDFMemory.grow`).
        del last
        mem = carry1.memory
        safe = jnp.where(good, ratio, jnp.inf)
        shrink = jnp.maximum(_SHRINK_MIN, SAFETY * safe ** (-1.0 / (mem.order_used + 1)))
        shrink = jnp.where(good, shrink, 0.5)
        return h_step * jnp.where(accept, mem.grow, jnp.minimum(shrink, 1.0))

    def replay_carry(self, carry: BDFCarry) -> BDFCarry:
        # A replay with a known end takes it as the corrector's solution: the factors
        # are not read (for a system of 2048 states on a band they are about half of
        # what a step records).
        return dataclasses.replace(carry, memory=dataclasses.replace(carry.memory, factors=None))

    def replay_step(self, f, y, carry: BDFCarry, t, h, params, end, *, tol=None):
        return self.step_with_stages(f, y, carry, t, h, params, tol=tol, end=end.y)

    def step_with_stages(self, f, y, carry: BDFCarry, t, h, params, *, tol=None, end=None):
        tol = tol or StageTolerance()
        n, dt = y.shape[0], y.dtype
        size = n if tol.size is None else tol.size
        gamma, alpha, error_const = (jnp.asarray(c, dt) for c in _coefficients(self.ndf))
        h = jnp.asarray(h, dt)
        mem = carry.memory
        stat = jax.lax.stop_gradient
        order, n_equal = mem.order, mem.n_equal
        q = order.astype(jnp.int32)
        rows = jnp.arange(MAX_ORDER + 3)

        # The differences rescaled to this step's size (orders above `q` untouched),
        # the prediction and `psi` from them, and after the corrector the updated
        # differences (`_History`).
        factor = stat(h / mem.h)
        same = factor == 1
        n_equal = jnp.where(same, n_equal, 0)
        upto = (rows <= q).astype(dt)
        weights = jnp.stack([upto, upto * jnp.pad(gamma, (0, 2))])
        history = _History.of(carry.D, q, factor, weights)
        y_pred, psi = history.predict()
        psi = psi / alpha[q]
        c = h / alpha[q]
        t1 = t + h

        # The iteration matrix `I - c J`, `J` at the prediction. It only steers the
        # iteration (the corrector's derivative is implicit), so no gradient flows
        # through it. As in CVODE, the last factorisation, of `I - c_old J`, serves
        # while `c` is within `REUSE_CHANGE` of `c_old` and for at most `REUSE_STEPS`
        # steps, its corrections scaled by `2 / (1 + c / c_old)` (exact on the stiff
        # and the non-stiff components on average); if the iteration then fails, a
        # fresh factorisation is made and the iteration repeated.
        solver = self.linear_solver
        mass = lambda v: apply_mass(self.mass_matrix, v)  # noqa: E731
        y_c, p_c, c_c = stat((y_pred, params, c))

        def fresh_state(anchor=None):
            # After `anchor` when given: under `vmap` both branches of a `cond` run,
            # and two factorisations at once can deadlock on CPU (see `after`).
            y_a, c_a = after((y_c, c_c), anchor)
            jvp = jacobian_product(f, y_a, t1, p_c)
            return stat(solver.init(lambda v: mass(v) - c_a * jvp(v), y))

        # The corrector's stopping test (see `NEWTON_ITERS`).
        kappa, floor = hairer_kappa(tol.rtol, dt), rounding_floor(tol.rtol, dt)

        def norm(dz, z):
            scale = tol.atol + tol.rtol * jnp.abs(y_c[:size])
            return jnp.sqrt(jnp.mean(jnp.square(jnp.abs(dz[:size]) / scale)))

        def residual(z):
            return mass(z - y_pred + psi) - c * f(z, t1, params)

        def newton(res, z0, solve_with):
            z, conv, _, iters = simplified_newton(
                lambda z: solve_with(-res(z)),
                z0,
                norm,
                kappa=kappa,
                max_iters=NEWTON_ITERS,
                eta0=1.0,
                floor=floor,
            )
            return z, StageReport(conv, iters)

        def iterate(res, z0):
            """The corrector by simplified Newton: `(y1, (report, factors to keep,
            factorisations made))`."""
            if mem.factors is None:
                # A solver without factors to keep (a Krylov method): prepared every step.
                state = fresh_state()
                z, report = newton(res, z0, lambda b: solver.solve(state, b))
                return z, (report, mem.factors, jnp.ones((), jnp.int32))

            ratio_c = c_c / jnp.where(mem.c != 0, mem.c, 1)
            reuse = (mem.c != 0) & (jnp.abs(ratio_c - 1) <= REUSE_CHANGE) & (mem.age < REUSE_STEPS)
            factors0 = keep_or_compute(reuse, mem.factors, lambda: solver.factors(fresh_state()))
            scale0 = jnp.where(reuse, 2 / (1 + ratio_c), 1)

            def solve_with(factors, scale=1):
                return lambda b: scale * solver.solve_factors(factors, b)

            z, first = newton(res, z0, solve_with(factors0, scale0))

            def again():
                factors = solver.factors(fresh_state(anchor=(z, factors0)))
                z2, second = newton(res, z0, solve_with(factors))
                # The first iteration's work counts too.
                report = StageReport(second.converged, first.iterations + second.iterations)
                return z2, report, factors, jnp.ones((), jnp.int32)

            def keep():
                return z, first, factors0, (~reuse).astype(jnp.int32)

            retry = ~first.converged & reuse
            z, report, factors, work = keep_or_compute(~retry, keep(), again)
            return z, (report, factors, work)

        if end is None:
            solve = iterate
        else:
            # A replay (see `replay_step`): the corrector's solution is the end the
            # solve computed, taken as given. (Iterating again would not do: from a
            # carry without its factors, `replay_carry`, it would factor afresh where
            # the solve reused them, and end elsewhere.)
            def solve(res, z0):
                del res, z0
                return end, (StageReport.given(), mem.factors, jnp.zeros((), jnp.int32))

        y1, aux = custom_root(residual, y_pred, solve, solver, has_aux=True)
        report, factors, work = stat(aux)
        if mem.factors is None:
            c_lu, age = c_c, jnp.zeros((), jnp.int32)
        else:
            c_lu = jnp.where(work > 0, c_c, mem.c)
            age = jnp.where(work > 0, 0, mem.age + 1)
        d = y1 - y_pred
        err = error_const[q] * d
        nonzero = c != 0
        k_next = jnp.where(nonzero, (d + psi) / jnp.where(nonzero, c, 1), carry.k)

        D = history.update(d)
        n_equal = n_equal + 1

        # The next order and step size, once the order and size have held for q + 1
        # steps: from the errors orders q - 1, q and q + 1 would make.
        scale = tol.atol + tol.rtol * jnp.abs(stat(y1[:size]))

        def rms(e):
            return jnp.sqrt(jnp.mean(jnp.square(stat(e[:size]) / scale)))

        inf = jnp.asarray(jnp.inf, dt)
        err_m = jnp.where(q > 1, rms(error_const[jnp.maximum(q - 1, 0)] * D[q]), inf)
        err_p = jnp.where(
            q < MAX_ORDER,
            rms(error_const[jnp.minimum(q + 1, MAX_ORDER)] * D[jnp.minimum(q + 2, MAX_ORDER + 2)]),
            inf,
        )
        norms = jnp.stack([err_m, rms(err), err_p])
        powers = -1.0 / (order + jnp.arange(3, dtype=dt))
        factors_h = jnp.where(norms == 0, inf, norms**powers)
        due = n_equal >= order + 1
        new_order = jnp.where(due, order + jnp.argmax(factors_h).astype(dt) - 1, order)
        grow = jnp.where(due, jnp.minimum(_GROW_MAX, SAFETY * jnp.max(factors_h)), 1.0)
        memory = BDFMemory.of(
            factors, dt, h=h, order=new_order, order_used=order, n_equal=jnp.where(due, 0, n_equal),
            grow=grow, c=c_lu, age=age, work=work,
        )  # fmt: skip
        return y1, err, BDFCarry(k=k_next, D=D, memory=memory), report, [carry.k]
