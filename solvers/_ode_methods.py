"""The integration methods of `odeint`: one step of each, on a flat state vector.

The Butcher tableaux come from diffrax, so the coefficients are never typed by hand.
Every method exposes the same step function

    step(f, y, k1, t, h, params) -> (y1, y_error, k1_next, ok)

where `f(y, t, params)` is the flattened vector field, `k1 = f(y, t, params)` is
carried between steps (first-same-as-last: every method here evaluates it at the new
point anyway, so a step costs `stages - 1` new evaluations), `y_error` is the embedded
error estimate (zeros for the fixed-step methods) and `ok` is False when an implicit
stage solve did not converge (the step is then rejected).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import diffrax
import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
import numpy as np

from implicitdiff import custom_root

__all__ = [
    "Method",
    "StageTolerance",
    "METHODS",
    "get_method",
    "explicit_stages",
    "stage_polynomials",
    "output_weights",
    "step_coefficients",
    "evaluate_step",
    "pull_back_outputs",
    "output_moments",
    "basis_from_moments",
]


@dataclasses.dataclass(frozen=True)
class Method:
    """A Runge-Kutta method: the tableau as nested tuples (hashable), and its traits.

    Attributes:
        name: the `method=` string.
        order: the exponent of the step-size controller (the order of the local error
            estimate); for fixed-step methods, the order of the method.
        c: the stage times, `c[0] = 0`.
        a: the strictly lower triangle, `a[i]` has `i` entries.
        b: the weights of the solution.
        e: the weights of the error estimate, or `None` (no error control: fixed step).
        gamma: the diagonal of an ESDIRK tableau (0 for the explicit first stage), or
            `None` for an explicit method.
        predictor: for ESDIRK, the weights of each stage's initial guess in the
            earlier stages (diffrax's `a_predictor`).
        interpolation: diffrax's interpolation class for the method's own continuous
            extension (see `stage_polynomials`), or `None` for a cubic Hermite
            interpolant from the values and derivatives at the step ends.
    """

    name: str
    order: int
    c: tuple[float, ...]
    a: tuple[tuple[float, ...], ...]
    b: tuple[float, ...]
    e: tuple[float, ...] | None
    gamma: tuple[float, ...] | None = None
    predictor: tuple[tuple[float, ...], ...] | None = None
    interpolation: Any = None

    @property
    def stages(self) -> int:
        return len(self.b)

    @property
    def adaptive(self) -> bool:
        return self.e is not None

    @property
    def implicit(self) -> bool:
        return self.gamma is not None

    @property
    def fsal(self) -> bool:
        """First same as last: the last stage is evaluated at the step's end (its row
        of `a` is `b`, and `c = 1`), so it is `f` at the new point."""
        return (
            self.stages > 1
            and self.c[-1] == 1.0
            and self.b[-1] == 0.0
            and tuple(self.a[-1]) == tuple(self.b[:-1])
        )

    @property
    def stiffly_accurate(self) -> bool:
        """An implicit method whose last stage is the solution (its row of `a`, with
        its diagonal, is `b`): the step's end is that stage's value."""
        return (
            self.implicit
            and self.c[-1] == 1.0
            and tuple(self.a[-1]) + (self.gamma[-1],) == tuple(self.b)
        )

    @property
    def evals_per_step(self) -> int:
        """Evaluations of `f` a step makes outside an implicit method's Newton iterations
        and Jacobian: the explicit stages after the carried first one, and `f` at the
        new point unless the last stage is already that."""
        if self.implicit:
            return 0 if self.stiffly_accurate else 1
        return self.stages - 1 + (0 if self.fsal else 1)

    def step(self, f, y, k1, t, h, params, *, tol=None):
        """One step from `(t, y)` of size `h`; `tol` (a `StageTolerance`) sets the
        accuracy of implicit stage solves. Returns `(y1, y_error, k1_next, ok)`."""
        return self.step_with_stages(f, y, k1, t, h, params, tol=tol)[:4]

    def step_with_stages(self, f, y, k1, t, h, params, *, tol=None):
        """`step`, also returning the stage derivatives `[k_1, ..., k_s]` (for the
        interpolant inside the step, `step_coefficients`)."""
        if self.implicit:
            return _esdirk_step(self, f, y, k1, t, h, params, tol or StageTolerance())
        return _explicit_step(self, f, y, k1, t, h, params)


@dataclasses.dataclass(frozen=True)
class StageTolerance:
    """How accurately an implicit method solves its stage equations: to `kappa` times
    the step's own error tolerance, in the same weighted RMS norm, measured on the
    first `size` entries of the state (all of them when `None`)."""

    rtol: float = 1e-6
    atol: float = 1e-6
    size: int | None = None


def _from_diffrax(name: str, solver: Any, order: int) -> Method:
    tab = solver.tableau
    tup = lambda v: tuple(float(x) for x in np.asarray(v))  # noqa: E731
    c = (float(tab.c1),) + tup(tab.c)
    a = tuple(tup(row) for row in tab.a_lower)
    gamma = predictor = None
    if tab.implicit:
        gamma = tup(tab.a_diagonal)
        predictor = tuple(tup(row) for row in tab.a_predictor)
    b = tup(tab.b_sol)
    interp = solver.interpolation_cls
    interp = interp if isinstance(interp, type) else None  # None: cubic Hermite
    return Method(
        name=name,
        order=order,
        c=c,
        a=((),) + a,
        b=b,
        e=tup(tab.b_error),
        gamma=gamma,
        predictor=predictor,
        interpolation=interp,
    )


@functools.cache
def stage_polynomials(m: Method) -> np.ndarray:
    """The method's continuous extension `y(t + theta h) = y + h sum_j w_j(theta) k_j`
    as a `(stages, degree + 1)` array: the coefficients of each weight `w_j`, lowest
    power first.

    They come from diffrax's interpolant: it is linear in the stages, so probing it
    with one unit stage per component gives every weight at once, and a least-squares
    fit through more points than the degree recovers the coefficients (to rounding).
    """
    s = m.stages
    # Computed once, with concrete numbers, even when first asked for inside a `jit`.
    with jax.ensure_compile_time_eval(), jax.enable_x64(True):
        interp = m.interpolation(
            t0=0.0,
            t1=1.0,
            y0=jnp.zeros(s, jnp.float64),
            y1=jnp.asarray(m.b, jnp.float64),
            k=jnp.eye(s, dtype=jnp.float64),
        )
        thetas = np.linspace(0.0, 1.0, 25)
        w = np.stack([np.asarray(interp.evaluate(th), np.float64) for th in thetas])
    for degree in range(1, 12):  # the lowest degree that fits exactly
        vander = np.vander(thetas, degree + 1, increasing=True)
        coef = np.linalg.lstsq(vander, w, rcond=None)[0]  # (degree + 1, stages)
        if np.max(np.abs(vander @ coef - w)) < 1e-13:
            # Exact zeros where the fit leaves rounding noise (the weights vanish at
            # theta = 0), so the evaluation skips those terms.
            coef[np.abs(coef) < 1e-12 * np.max(np.abs(coef))] = 0.0
            return coef.T
    raise AssertionError(f"no polynomial fits the interpolant of {m.name}")


# The interpolant inside one step, as weights on a fixed basis:
#
#     y(t + theta h) = w_0(theta) y + w_1(theta) y1 + h (w_2(theta) k1_next
#                      + sum_j w_{3+j}(theta) k_j)
#
# from the step's start `y`, end `y1`, the derivative at the end `k1_next` and the
# stages `k_j`. Dopri5, Tsit5 and Dopri8 use their own continuous extension (weights
# on the stages only); the others the cubic Hermite interpolant through `y`, `y1`
# and their derivatives `k_1 = f(y, t)` and `k1_next`.
BASIS_Y, BASIS_Y1, BASIS_K_NEXT, BASIS_STAGES = 0, 1, 2, 3

# Cubic Hermite basis, lowest power first.
_H00, _H01 = (1.0, 0.0, -3.0, 2.0), (0.0, 0.0, 3.0, -2.0)
_H10, _H11 = (0.0, 1.0, -2.0, 1.0), (0.0, 0.0, -1.0, 1.0)


@functools.cache
def output_weights(m: Method) -> np.ndarray:
    """The polynomials `w_r(theta)` of the interpolant inside a step on the basis
    `[y, y1, k1_next, k_1, ..., k_s]`, as a `(3 + stages, degree + 1)` array (lowest
    power first). A row of zeros is a basis entry the interpolant does not use."""
    if m.interpolation is not None:
        stages = stage_polynomials(m)
        w = np.zeros((BASIS_STAGES + m.stages, stages.shape[1]))
        w[BASIS_Y, 0] = 1.0
        w[BASIS_STAGES:] = stages
        return w
    w = np.zeros((BASIS_STAGES + m.stages, 4))
    w[BASIS_Y], w[BASIS_Y1], w[BASIS_K_NEXT], w[BASIS_STAGES] = _H00, _H01, _H11, _H10
    return w


def _weighted_sum(weights, terms):
    """`sum_r weights[r] * terms[r]` over the non-zero (static) weights; `None` if none."""
    acc = None
    for wr, term in zip(weights, terms):
        if wr != 0.0:
            acc = wr * term if acc is None else acc + wr * term
    return acc


def step_coefficients(m: Method, h, y, y1, k_next, ks):
    """The interpolant of one step as a polynomial in `theta`: its coefficients, a
    `(degree + 1,) + y.shape` array, lowest power first."""
    basis = [y, y1, k_next, *ks]
    w = output_weights(m)
    h = jnp.asarray(h, y.dtype)
    coeffs = []
    # Sums with static weights (no matrix product): they fuse into one elementwise pass.
    for p in range(w.shape[1]):
        plain = _weighted_sum(w[:BASIS_K_NEXT, p], basis[:BASIS_K_NEXT])
        slopes = _weighted_sum(w[BASIS_K_NEXT:, p], basis[BASIS_K_NEXT:])
        c = jnp.zeros_like(y) if plain is None else plain
        coeffs.append(c if slopes is None else c + h * slopes)
    return jnp.stack(coeffs)


def evaluate_step(coeffs, theta, y1):
    """The interpolant with coefficients `coeffs` at `theta` (any shape; one row per
    point); at `theta >= 1` (an output the step lands on) exactly its end `y1`."""
    th = jnp.asarray(theta, coeffs.dtype)[..., None]
    vals = coeffs[-1]
    for p in range(coeffs.shape[0] - 2, -1, -1):  # Horner's rule
        vals = vals * th + coeffs[p]
    return jnp.where((theta >= 1)[..., None], y1, vals)


def pull_back_outputs(m: Method, theta, g, h):
    """The transpose of `evaluate_step` through `step_coefficients`: the cotangents of
    the basis `[y, y1, k1_next, k_1, ..., k_s]` (a `(3 + stages, n)` array) given the
    cotangents `g` (rows, n) of the outputs at `theta` (rows,); rows with a zero `g`
    contribute nothing."""
    # One small reduction per moment: a single reduction over the stacked (rows,
    # powers, n) moments is slower on CPU.
    sums = [jnp.sum(x, axis=0) for x in _row_moments(m, theta, g)]
    return basis_from_moments(m, jnp.stack(sums), h)


def output_moments(m: Method, theta, g):
    """`pull_back_outputs` before its sum over rows: each row's `theta**p g` for every
    power `p` of the interpolant (zero at `theta >= 1`), then `g` itself where `theta
    >= 1` (an output on the step's end), as a `(rows, powers + 1, n)` array. Summed
    over a step's rows, `basis_from_moments` turns it into that step's cotangents."""
    return jnp.stack(_row_moments(m, theta, g), axis=1)


def _row_moments(m: Method, theta, g):
    # The list behind `output_moments` (the powers by repeated products, not `**`).
    end = (theta >= 1)[:, None]
    th = jnp.asarray(theta, g.dtype)[:, None]
    weighted = jnp.where(end, 0, g)  # theta**0 g
    moments = [weighted]
    for _ in range(output_weights(m).shape[1] - 1):
        weighted = weighted * th
        moments.append(weighted)
    moments.append(jnp.where(end, g, 0))
    return moments


def basis_from_moments(m: Method, moments, h):
    """The cotangents of the basis `[y, y1, k1_next, k_1, ..., k_s]` (`(3 + stages,
    n)`) from the moments of a step's output cotangents (`(powers + 1, n)`, see
    `output_moments`) and the step size `h`."""
    w = output_weights(m)  # (basis, powers)
    poly = [moments[p] for p in range(w.shape[1])]
    h = jnp.asarray(h, moments.dtype)
    zero = jnp.zeros_like(poly[0])
    ct = []
    for r in range(w.shape[0]):
        c = _weighted_sum(w[r], poly)
        c = zero if c is None else c
        if r == BASIS_Y1:
            c = c + moments[-1]
        ct.append(c * h if r >= BASIS_K_NEXT else c)
    return jnp.stack(ct)


METHODS: dict[str, Method] = {
    "dopri5": _from_diffrax("dopri5", diffrax.Dopri5, 5),
    "tsit5": _from_diffrax("tsit5", diffrax.Tsit5, 5),
    "bosh3": _from_diffrax("bosh3", diffrax.Bosh3, 3),
    "dopri8": _from_diffrax("dopri8", diffrax.Dopri8, 8),
    "kvaerno5": _from_diffrax("kvaerno5", diffrax.Kvaerno5, 5),
    # Fixed step (no error estimate): the classic fourth-order method (diffrax has no
    # tableau for it) and Euler's.
    "rk4": Method(
        name="rk4",
        order=4,
        c=(0.0, 0.5, 0.5, 1.0),
        a=((), (0.5,), (0.0, 0.5), (0.0, 0.0, 1.0)),
        b=(1 / 6, 1 / 3, 1 / 3, 1 / 6),
        e=None,
    ),
    "euler": Method(name="euler", order=1, c=(0.0,), a=((),), b=(1.0,), e=None),
}

ADAPTIVE = tuple(k for k, m in METHODS.items() if m.adaptive)
FIXED = tuple(k for k, m in METHODS.items() if not m.adaptive)


def get_method(name: str) -> Method:
    return METHODS[name]


def _combine(y, h, coeffs, ks):
    """`y + h * sum(c_j k_j)`, skipping zero coefficients (a static choice)."""
    acc = None
    for cj, kj in zip(coeffs, ks):
        if cj != 0.0:
            term = cj * kj
            acc = term if acc is None else acc + term
    if acc is None:
        return y
    return y + h * acc


def explicit_stages(m: Method, f, y, k1, t, h, params):
    """The stage derivatives `[k_1, ..., k_s]` of an explicit step."""
    ks = [k1]
    for i in range(1, m.stages):
        yi = _combine(y, h, m.a[i], ks)
        ks.append(f(yi, t + m.c[i] * h, params))
    return ks


def _explicit_step(m: Method, f, y, k1, t, h, params):
    ks = explicit_stages(m, f, y, k1, t, h, params)
    y1 = _combine(y, h, m.b, ks)
    if m.adaptive:
        err = h * sum(ej * kj for ej, kj in zip(m.e, ks) if ej != 0.0)
    else:
        err = jnp.zeros_like(y)
    # First same as last: the last stage is already f at the new point.
    k_next = ks[-1] if m.fsal else f(y1, t + h, params)
    return y1, err, k_next, jnp.asarray(True), ks


# ---------------------------------------------------------------------------
# ESDIRK (Kvaerno5): each implicit stage solves `z = base + h gamma_i f(z, t_i)` by a
# simplified Newton iteration with the Jacobian at the step's start, `I - h gamma_i J`
# factorised once per step for each distinct diagonal value. The stage solves go
# through `implicitdiff.custom_root`, so differentiating a step (the discrete adjoint,
# forward sensitivities of a replayed step) uses the implicit function theorem on the
# stage equations, not the iterations.
#
# The iteration stops by Hairer and Wanner's test (Solving ODEs II, IV.8): with the
# contraction rate `theta_k = |dz_k| / |dz_(k-1)|` and `eta = theta / (1 - theta)`, the
# distance to the solution is about `eta |dz_k|`, and the stage is converged once that
# is `_NEWTON_KAPPA` in the step's weighted RMS norm (`atol + rtol |z|` per entry, the
# norm of the error control). A rate of 1 or more (divergence), a non-finite iterate or
# `_NEWTON_ITERS` iterations fail the step, which is then retried smaller. The rate of
# one stage's iteration starts the next stage's test (`eta` of the first update).

_NEWTON_ITERS = 10
_NEWTON_KAPPA = 1e-2


def _esdirk_step(m: Method, f, y, k1, t, h, params, tol: StageTolerance):
    n = y.shape[0]
    dt = y.dtype
    rdt = jnp.finfo(dt).dtype
    jac = jax.lax.stop_gradient(jax.jacfwd(lambda v: f(v, t, params))(jax.lax.stop_gradient(y)))
    eye = jnp.eye(n, dtype=dt)
    lus = {g: jsl.lu_factor(eye - jnp.asarray(h * g, dt) * jac) for g in sorted(set(m.gamma[1:]))}
    size = n if tol.size is None else tol.size
    eps = float(jnp.finfo(rdt).eps)

    def weighted_norm(dz, z):
        scale = tol.atol + tol.rtol * jnp.abs(z[:size])
        return jnp.sqrt(jnp.mean(jnp.square(jnp.abs(dz[:size]) / scale)))

    ks = [k1]
    ok = jnp.asarray(True)
    eta0 = jnp.asarray(1.0, rdt)
    z = y
    for i in range(1, m.stages):
        base = _combine(y, h, m.a[i], ks)
        ti = t + m.c[i] * h
        g = m.gamma[i]
        lu = lus[g]
        guess = _combine(y, h, m.predictor[i - 1], ks) if m.predictor else base

        def residual(z, base=base, ti=ti, g=g):
            return z - base - (h * g) * f(z, ti, params)

        def newton(res, z0, lu=lu, eta0=eta0):
            def body(carry):
                z, _, it, prev, eta = carry
                dz = jsl.lu_solve(lu, -res(z))
                z = z + dz
                size_k = weighted_norm(dz, z)
                theta = size_k / prev
                # The first update has no rate of its own: the last stage's, damped.
                eta = jnp.where(
                    it == 0,
                    jnp.maximum(eta, eps) ** 0.8,
                    theta / jnp.maximum(1 - theta, eps),
                )
                finite = jnp.all(jnp.isfinite(z)) & jnp.isfinite(size_k)
                diverged = (it > 0) & (theta >= 1) & (size_k > 100 * eps)
                state = jnp.where(
                    ~finite | diverged,
                    _FAILED,
                    jnp.where((eta * size_k <= _NEWTON_KAPPA) | (size_k <= 100 * eps),
                              _CONVERGED, _RUNNING),
                )  # fmt: skip
                return z, state, it + 1, size_k, eta

            def cond(carry):
                _, state, it, *_ = carry
                return (state == _RUNNING) & (it < _NEWTON_ITERS)

            one = jnp.asarray(1.0, rdt)
            init = (z0, jnp.asarray(_RUNNING), jnp.asarray(0), one, eta0)
            z, state, _, _, eta = jax.lax.while_loop(cond, body, init)
            return z, (state == _CONVERGED, eta)

        def tangent_solve(lin, rhs):
            # The Jacobian of the residual at the stage value, solved densely.
            dense = jax.jacfwd(lin)(jnp.zeros_like(rhs))
            return jnp.linalg.solve(dense, rhs)

        z, (conv, eta0) = custom_root(residual, guess, newton, tangent_solve, has_aux=True)
        eta0 = jax.lax.stop_gradient(eta0)
        ok = ok & conv
        # The stage derivative from the stage equation, `(z - base) / (h gamma)`: equal
        # to `f(z, t_i)` at the solution, but `f` at the iterate would multiply the
        # iteration's remaining error by the stiffness (`|h J|` can be 1e6), and the
        # error estimate and the next stages would carry that. (A zero step, as the
        # checkpoint sweep gives an element it masks, has no stage derivatives.)
        hg = jnp.asarray(h * g, dt)
        nonzero = hg != 0
        ks.append(jnp.where(nonzero, (z - base) / jnp.where(nonzero, hg, 1), 0))
    if m.stiffly_accurate:
        # The last stage is the solution; `y + h sum(b_j k_j)` would differ from it by
        # the stage's Newton residual, and on a stiff problem `f` at the two points
        # differs by that residual times the stiffness.
        y1 = z
    else:
        y1 = _combine(y, h, m.b, ks)
    err = h * sum(ej * kj for ej, kj in zip(m.e, ks) if ej != 0.0)
    k_next = ks[-1] if m.stiffly_accurate else f(y1, t + h, params)
    return y1, err, k_next, ok, ks


_RUNNING, _CONVERGED, _FAILED = 0, 1, 2
