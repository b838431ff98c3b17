"""The interpolant inside one step, shared by `interpolate=True`, dense output and the
checkpointed sweep.

Inside a step from `t` to `t + h` the solution is a polynomial in `theta = (s - t) / h`
with fixed weights on a basis of the step's quantities:

    y(t + theta h) = w_0(theta) y + w_1(theta) y1 + h (w_2(theta) k1_next
                     + sum_j w_{3+j}(theta) k_j)

from the step's start `y`, end `y1`, the derivative at the end `k1_next` and the stage
derivatives `k_j`. Dopri5, Tsit5 and Dopri8 use their own continuous extension
(weights on the stages only, probed from diffrax's interpolant); the others the cubic
Hermite interpolant through `y`, `y1` and their derivatives `k_1 = f(y, t)` and
`k1_next`. The interpolant is linear in the basis, so the cotangents of outputs inside
a step pull back onto the basis in closed form (`pull_back_outputs`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from .methods import AbstractMethod

__all__ = [
    "BASIS_Y",
    "BASIS_Y1",
    "BASIS_K_NEXT",
    "BASIS_STAGES",
    "stage_polynomials",
    "output_weights",
    "step_coefficients",
    "evaluate_step",
    "pull_back_outputs",
    "output_moments",
    "basis_from_moments",
]


@functools.cache
def stage_polynomials(m: AbstractMethod) -> np.ndarray:
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


BASIS_Y, BASIS_Y1, BASIS_K_NEXT, BASIS_STAGES = 0, 1, 2, 3

# Cubic Hermite basis, lowest power first.
_H00, _H01 = (1.0, 0.0, -3.0, 2.0), (0.0, 0.0, 3.0, -2.0)
_H10, _H11 = (0.0, 1.0, -2.0, 1.0), (0.0, 0.0, -1.0, 1.0)


@functools.cache
def output_weights(m: AbstractMethod) -> np.ndarray:
    """The polynomials `w_r(theta)` of the interpolant inside a step on the basis
    `[y, y1, k1_next, k_1, ..., k_s]`, as a `(3 + stages, degree + 1)` array (lowest
    power first). A row of zeros is a basis entry the interpolant does not use."""
    own = m.continuous_weights()
    if own is not None:
        return np.asarray(own, np.float64)
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


def step_coefficients(m: AbstractMethod, h, y, y1, k_next, ks):
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


def pull_back_outputs(m: AbstractMethod, theta, g, h):
    """The transpose of `evaluate_step` through `step_coefficients`: the cotangents of
    the basis `[y, y1, k1_next, k_1, ..., k_s]` (a `(3 + stages, n)` array) given the
    cotangents `g` (rows, n) of the outputs at `theta` (rows,); rows with a zero `g`
    contribute nothing."""
    # One small reduction per moment: a single reduction over the stacked (rows,
    # powers, n) moments is slower on CPU.
    sums = [jnp.sum(x, axis=0) for x in _row_moments(m, theta, g)]
    return basis_from_moments(m, jnp.stack(sums), h)


def output_moments(m: AbstractMethod, theta, g):
    """`pull_back_outputs` before its sum over rows: each row's `theta**p g` for every
    power `p` of the interpolant (zero at `theta >= 1`), then `g` itself where `theta
    >= 1` (an output on the step's end), as a `(rows, powers + 1, n)` array. Summed
    over a step's rows, `basis_from_moments` turns it into that step's cotangents."""
    return jnp.stack(_row_moments(m, theta, g), axis=1)


def _row_moments(m: AbstractMethod, theta, g):
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


def basis_from_moments(m: AbstractMethod, moments, h):
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
