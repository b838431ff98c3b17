"""The built-in problems of the gradient-check catalogue.

One or two per implicit-differentiation entry point of `implicitdiff`: Newton's
method through `custom_root` (`newton-sqrt`, `root-y2-x3`), conjugate gradients
through `implicit_diff` (`ridge-regression`) and LU through `custom_linear_solve`
(`linear-system`), each against a closed form. Each build() imports the
implicit-differentiation entry points lazily, so that importing this module does not
need them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ._problem import Problem, _BuildResult


def _newton(f: Callable[[jax.Array], jax.Array], x0: jax.Array) -> jax.Array:
    """Elementwise Newton iteration for f(x) = 0 (f acts elementwise), to machine precision."""
    tiny = 4 * jnp.finfo(jnp.result_type(x0)).eps

    def cond(state):
        i, _, dx = state
        return (i < 100) & jnp.any(dx > 0)

    def body(state):
        i, x, _ = state
        fx, dfx = jax.jvp(f, (x,), (jnp.ones_like(x),))
        x_new = x - fx / dfx
        dx = jnp.where(jnp.abs(x_new - x) > tiny * jnp.abs(x_new), 1.0, 0.0)
        return i + 1, x_new, dx

    _, x, _ = jax.lax.while_loop(cond, body, (0, x0, jnp.ones_like(x0)))
    return x


def _diagonal_tangent_solve(g: Callable[[jax.Array], jax.Array], y: jax.Array) -> jax.Array:
    # g is linear and elementwise (diagonal): its diagonal is g(1).
    return y / g(jnp.ones_like(y))


def _build_newton_sqrt() -> _BuildResult:
    from implicitdiff.root import custom_root

    def newton_sqrt(a):
        return custom_root(lambda x: x**2 - a, jnp.ones_like(a), _newton, _diagonal_tangent_solve)

    return newton_sqrt, (jnp.array([0.5, 2.0, 9.0]),), jnp.sqrt


def _build_root_y2_x3() -> _BuildResult:
    from implicitdiff.root import custom_root

    def y_of_x(x):
        # the positive root y of y**2 - x**3 = 0, Newton from y0 = x
        return custom_root(lambda y: y**2 - x**3, x, _newton, _diagonal_tangent_solve)

    return y_of_x, (jnp.array([0.7, 1.3, 2.0]),), lambda x: x**1.5


def _cg(matvec: Callable[[jax.Array], jax.Array], b: jax.Array, x0: jax.Array) -> jax.Array:
    """Plain conjugate gradients for a symmetric positive definite `matvec`, to ~1e-14."""
    stop = (1e-14 * jnp.linalg.norm(b)) ** 2

    def body(state):
        i, x, r, p, rr = state
        Ap = matvec(p)
        alpha = rr / jnp.vdot(p, Ap)
        x, r = x + alpha * p, r - alpha * Ap
        rr_new = jnp.vdot(r, r)
        return i + 1, x, r, r + (rr_new / rr) * p, rr_new

    r0 = b - matvec(x0)
    state = (0, x0, r0, r0, jnp.vdot(r0, r0))
    cond = lambda state: (state[0] < 10 * b.size) & (state[4] > stop)
    return jax.lax.while_loop(cond, body, state)[1]


def _build_ridge() -> _BuildResult:
    from implicitdiff import linear_solve
    from implicitdiff.implicit import implicit_diff

    rng = np.random.default_rng(0)
    n, d = 8, 3
    X = jnp.asarray(rng.standard_normal((n, d)))
    y = jnp.asarray(rng.standard_normal(n))
    lam = jnp.asarray(0.3)

    def optimality(w, lam, X, y):  # gradient of the ridge objective
        return X.T @ (X @ w - y) / X.shape[0] + lam * w

    @implicit_diff(optimality, solve=functools.partial(linear_solve.cg, rtol=1e-13))
    def ridge_solver(init, lam, X, y):
        # conjugate gradients on the normal equations; implicit_diff never differentiates it
        n = X.shape[0]
        return _cg(lambda w: X.T @ (X @ w) / n + lam * w, X.T @ y / n, init)

    def ridge(lam, X, y):
        return ridge_solver(jnp.zeros(X.shape[1], X.dtype), lam, X, y)

    def closed_form(lam, X, y):
        n, d = X.shape
        return jnp.linalg.solve(X.T @ X + lam * n * jnp.eye(d, dtype=X.dtype), X.T @ y)

    return ridge, (lam, X, y), closed_form


def _build_linear_system() -> _BuildResult:
    from implicitdiff.linear_system import custom_linear_solve

    rng = np.random.default_rng(1)
    A = jnp.asarray(rng.standard_normal((4, 4)) + 4.0 * np.eye(4))
    b = jnp.asarray(rng.standard_normal(4))

    def dense_solve(matvec, rhs):
        # a direct solver that sees A only through matvec: materialise it, then LU
        matrix = jax.jacfwd(matvec)(jnp.zeros_like(rhs))
        return jnp.linalg.solve(matrix, rhs)

    def linear_system(A, b):
        return custom_linear_solve(lambda x: A @ x, b, dense_solve, transpose_solve=dense_solve)

    return linear_system, (A, b), jnp.linalg.solve


def _builtin_problems() -> tuple[Problem, ...]:
    return (
        Problem(
            "newton-sqrt",
            _build_newton_sqrt,
            description="sqrt(a) as the root of x**2 - a: custom_root + Newton, vs jnp.sqrt",
        ),
        Problem(
            "root-y2-x3",
            _build_root_y2_x3,
            description="y with y**2 = x**3: custom_root + Newton, vs x**1.5",
            quick=False,
        ),
        Problem(
            "ridge-regression",
            _build_ridge,
            description="ridge weights w.r.t. (lam, X, y): implicit_diff + CG, vs closed form",
            quick_order=1,
        ),
        Problem(
            "linear-system",
            _build_linear_system,
            description="A^-1 b w.r.t. (A, b): custom_linear_solve + LU, vs jnp.linalg.solve",
        ),
    )
