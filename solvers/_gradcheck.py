"""The solvers' problems for the `implicitdiff-gradcheck` catalogue.

`implicitdiff` never imports `solvers`; this module is published under the
entry-point group `implicitdiff.gradcheck` (see pyproject.toml), so the command
line finds these problems whenever `solvers` is installed. Each checks a solver's
implicit derivatives, to second order, against finite differences in float64 and
against a closed form.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from implicitdiff.gradcheck import Problem

__all__ = ["problems"]


def _fixed_point_newton_sqrt():
    from solvers import fixed_point

    def newton_sqrt(a):
        return fixed_point(lambda a, x: 0.5 * (x + a / x), a, a)

    return newton_sqrt, (jnp.array([0.5, 2.0, 9.0]),), jnp.sqrt


def _anderson_cos():
    from solvers import fixed_point

    def solve(a):
        # x = cos(a x) elementwise, Anderson-accelerated; a contraction for |a| < 1
        return fixed_point(lambda a, x: jnp.cos(a * x), a, jnp.zeros_like(a), method="anderson")

    return solve, (jnp.array([0.3, 0.6, 0.9]),)


def _root_newton_system():
    from solvers import root

    def f(x, A, b):
        return A @ x + 0.1 * x**3 - b

    def solve(A, b):
        return root(f, jnp.zeros_like(b), A, b, method="newton")

    rng = np.random.default_rng(2)
    A = jnp.asarray(rng.standard_normal((3, 3)) + 3.0 * np.eye(3))
    b = jnp.asarray(rng.standard_normal(3))
    return solve, (A, b)


def _root_bisection_cbrt():
    from solvers import root

    def cbrt(a):
        return root(lambda x, a: x**3 - a, 1.0, a, method="bisection", bracket=(0.0, 10.0))

    return cbrt, (jnp.asarray(5.0),), jnp.cbrt


def _minimize_ridge():
    from solvers import minimize

    rng = np.random.default_rng(3)
    n, d = 10, 3
    X = jnp.asarray(rng.standard_normal((n, d)))
    y = jnp.asarray(rng.standard_normal(n))

    def loss(w, lam, X, y):
        return 0.5 * jnp.mean((X @ w - y) ** 2) + 0.5 * lam * w @ w

    def ridge(lam, X, y):
        return minimize(loss, jnp.zeros(X.shape[1], X.dtype), lam, X, y, rtol=1e-13, atol=1e-13)

    def closed_form(lam, X, y):
        n, d = X.shape
        return jnp.linalg.solve(X.T @ X + lam * n * jnp.eye(d, dtype=X.dtype), X.T @ y)

    return ridge, (jnp.asarray(0.3), X, y), closed_form


def _minimize_newton_log():
    from solvers import minimize

    def argmin(a):
        # argmin_x exp(x) - a x = log(a)
        return minimize(
            lambda x, a: jnp.sum(jnp.exp(x) - a * x),
            jnp.zeros_like(a),
            a,
            method="newton",
            rtol=1e-13,
            atol=1e-13,
        )

    return argmin, (jnp.array([0.5, 2.0, 7.0]),), jnp.log


def _odeint_pendulum():
    from solvers import odeint

    def pendulum(y, t, m, g):
        return jnp.stack([y[1], -m * y[1] - g * jnp.sin(y[0])])

    ts = jnp.linspace(0.0, 2.0, 5)

    def solve(y0, m, g):
        return odeint(pendulum, y0, ts, m, g, rtol=1e-11, atol=1e-11)

    return solve, (jnp.array([jnp.pi - 0.1, 0.0]), jnp.asarray(0.25), jnp.asarray(9.8))


def _odeint_van_der_pol():
    from solvers import odeint

    def vdp(y, t, mu):
        return jnp.stack([y[1], mu * (1 - y[0] ** 2) * y[1] - y[0]])

    ts = jnp.linspace(0.0, 1.0, 3)

    def solve(y0, mu):
        # Backsolve would integrate the stiff state backwards (unstable): checkpoint.
        return odeint(
            vdp, y0, ts, mu, method="kvaerno5", adjoint="checkpoint", rtol=1e-10, atol=1e-10
        )

    return solve, (jnp.array([2.0, 0.0]), jnp.asarray(20.0))


def _deq_tanh():
    import equinox as eqx
    import jax

    from solvers.nn import DEQ

    class TanhCell(eqx.Module):
        W: jax.Array

        def __call__(self, z, x):
            return jnp.tanh(self.W @ z + x)

    def deq(x, W):
        # z* = tanh(W z* + x): the layer's default Anderson forward, GMRES adjoint
        return DEQ(TanhCell(W), z_shape=x.shape, rtol=1e-13, atol=1e-13)(x)

    def unrolled(x, W):
        # ||W|| = 0.4, so 120 plain iterations from zero converge to rounding, and
        # autodiff through them is an independent reference (to every order)
        return jax.lax.fori_loop(0, 120, lambda _, z: jnp.tanh(W @ z + x), jnp.zeros_like(x))

    rng = np.random.default_rng(4)
    M = rng.standard_normal((3, 3))
    W = jnp.asarray(0.4 * M / np.linalg.norm(M, 2))
    x = jnp.asarray(rng.standard_normal(3))
    return deq, (x, W), unrolled


def problems() -> list[Problem]:
    """The solvers' gradient-check problems (the `implicitdiff.gradcheck` entry point)."""
    return [
        Problem(
            "fixed-point-newton-sqrt",
            _fixed_point_newton_sqrt,
            description="solvers.fixed_point: the hijax guide's Newton sqrt, vs jnp.sqrt",
        ),
        Problem(
            "fixed-point-anderson-cos",
            _anderson_cos,
            description="solvers.fixed_point(method='anderson'): x = cos(a x)",
            quick=False,
        ),
        Problem(
            "deq-tanh",
            _deq_tanh,
            description="solvers.nn.DEQ: z = tanh(W z + x), d/dx and d/dW vs unrolled iteration",
            quick_order=1,
        ),
        Problem(
            "root-newton-system",
            _root_newton_system,
            description="solvers.root(method='newton'): A x + 0.1 x^3 = b, d/dA and d/db",
            quick=False,
        ),
        Problem(
            "root-bisection-cbrt",
            _root_bisection_cbrt,
            description="solvers.root(method='bisection'): x^3 = a, vs jnp.cbrt",
            quick=False,
        ),
        Problem(
            "minimize-ridge",
            _minimize_ridge,
            description="solvers.minimize (L-BFGS): ridge regression vs its closed form",
            quick=False,
        ),
        Problem(
            "minimize-newton-log",
            _minimize_newton_log,
            description="solvers.minimize(method='newton'): argmin exp(x) - a x = log(a)",
            quick=False,
        ),
        Problem(
            "odeint-pendulum",
            _odeint_pendulum,
            description="solvers.odeint (dopri5, backsolve): the damped pendulum, d/d(y0, m, g)",
            atol=1e-6,
            rtol=1e-6,
            quick_order=1,
        ),
        Problem(
            "odeint-van-der-pol-stiff",
            _odeint_van_der_pol,
            order=1,
            description="solvers.odeint (kvaerno5, checkpoint): stiff van der Pol, d/d(y0, mu)",
            atol=1e-5,
            rtol=1e-5,
            quick=False,
        ),
    ]
