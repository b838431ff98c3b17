"""Property-based tests (hypothesis), in float64, against NumPy's dense linear algebra.

- `solvers.fixed_point` with every method and every adjoint, on random contractive
  linear maps `f(a, x) = A x + a` (spectral norm below 0.9): the solution is
  `(I - A)^-1 a`, `jax.jacfwd` in `a` gives `(I - A)^-1` and `jax.grad` of `c . x`
  gives `(I - A)^-T c`.
- `implicitdiff.linear_solve` (`dense`, `cg`, `gmres`, `bicgstab`, `auto`) on random
  symmetric positive definite systems `A x = b`: the solution is `A^-1 b`, and so are
  its derivatives in `b` (`A^-1` by `jax.jacfwd`, `A^-1 c` for `jax.grad` of `c . x`).

Problems have 1 to 6 unknowns. `jax.jit` compiles once per shape, so the main tests embed
each problem in one of `PADDED` unknowns: `A` gets a zero block for a fixed point (the
padded unknowns are then 0, and `I - A` has an identity block) and an identity block for
a linear system (`b` is padded with zeros). The references are computed on the same
padded matrices, so every example reuses one compiled program per solver. The slow
variants draw many more examples and solve them at their own sizes.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from implicitdiff import linear_solve
from solvers import fixed_point

pytestmark = pytest.mark.usefixtures("x64", "fast_compiles")

PADDED = 6
METHODS = ("iterate", "damped", "anderson")
ADJOINTS = (None, "neumann", "gmres", "dense", "auto")
LINEAR_SOLVERS = ("dense", "cg", "gmres", "bicgstab", "auto")
FIXED_POINT_TOL = 1e-12  # rtol = atol of the fixed-point iteration

# `x64` is function-scoped: it is set once around all the examples of a test, as needed.
_COMMON = dict(
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
MAIN = settings(max_examples=25, derandomize=True, **_COMMON)
SLOW = settings(max_examples=300, **_COMMON)


def _entries(low, high):
    """Floats in [low, high], those below 1e-100 in magnitude replaced by 0. The Krylov
    solvers of `jax.scipy.sparse.linalg` work with squared norms, which underflow for a
    vector shorter than about 1e-154: `cg` and `bicgstab` then stop at `x = 0`, which
    the residual check of `implicitdiff.linear_solve` reports as non-convergence. That
    range is a known limit, out of scope here."""
    floats = st.floats(low, high, allow_nan=False, allow_subnormal=False)
    return floats.map(lambda v: v if abs(v) >= 1e-100 else 0.0)


@st.composite
def contractive_maps(draw, max_size=PADDED):
    """`(A, a, c)`: `A` of spectral norm in [0, 0.89], `a` and the loss weights `c`."""
    n = draw(st.integers(1, max_size))
    m = draw(arrays(np.float64, (n, n), elements=_entries(-1.0, 1.0)))
    norm = draw(st.floats(0.0, 0.89))
    size = np.linalg.norm(m, 2)
    A = m * (norm / size) if size > 0 else m
    a = draw(arrays(np.float64, (n,), elements=_entries(-10.0, 10.0)))
    c = draw(arrays(np.float64, (n,), elements=_entries(-1.0, 1.0)))
    return A, a, c


@st.composite
def spd_systems(draw, max_size=PADDED):
    """`(A, b, c)`: `A = M M^T + mu I` with `M` in [-1, 1] and `mu` in [0.5, 2] (its
    condition number is at most 73), `b` and the loss weights `c`."""
    n = draw(st.integers(1, max_size))
    m = draw(arrays(np.float64, (n, n), elements=_entries(-1.0, 1.0)))
    mu = draw(st.floats(0.5, 2.0))
    b = draw(arrays(np.float64, (n,), elements=_entries(-10.0, 10.0)))
    c = draw(arrays(np.float64, (n,), elements=_entries(-1.0, 1.0)))
    return m @ m.T + mu * np.eye(n), b, c


def _pad(A, v, c, block):
    """Embed an `n`-unknown problem in `PADDED` unknowns: `block` (an identity or zero
    matrix) fills the new diagonal block of `A`, zeros the rest."""
    n = len(v)
    A_p = np.zeros((PADDED, PADDED))
    A_p[:n, :n] = A
    A_p[n:, n:] = block[: PADDED - n, : PADDED - n]
    return A_p, np.pad(v, (0, PADDED - n)), np.pad(c, (0, PADDED - n))


def _assert_close(actual, expected, rel):
    """Every entry within `rel` of the scale of `expected` (its largest entry, at least 1)."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    scale = max(1.0, float(np.max(np.abs(expected))))
    np.testing.assert_allclose(actual, expected, rtol=0, atol=rel * scale)


# ---------------------------------------------------------------------------
# fixed_point


@functools.cache
def _fixed_point_program(method, adjoint):
    """One jitted program per method and adjoint: the solution, `grad` of `c . x` and
    `jacfwd`, all with respect to `a`."""

    def solve(A, a):
        return fixed_point(
            lambda p, x: p[0] @ x + p[1],
            (A, a),
            jnp.zeros_like(a),
            method=method,
            adjoint=adjoint,
            rtol=FIXED_POINT_TOL,
            atol=FIXED_POINT_TOL,
        )

    def run(A, a, c):
        x = solve(A, a)
        grad = jax.grad(lambda a: c @ solve(A, a))(a)
        jac = jax.jacfwd(lambda a: solve(A, a))(a)
        return x, grad, jac

    return jax.jit(run)


def _check_fixed_point(A, a, c, method, adjoint):
    x, grad, jac = _fixed_point_program(method, adjoint)(A, a, c)
    inv = np.linalg.inv(np.eye(len(a)) - A)
    # The iteration stops on a step of 1e-12 relative; with a contraction rate below 0.9
    # and up to 6 unknowns the error is at most ~1e-10 relative. The derivative solves
    # (to a residual of 1e-10) lose up to the condition number of I - A, below 19.
    _assert_close(x, np.linalg.solve(np.eye(len(a)) - A, a), 1e-9)
    _assert_close(grad, inv.T @ c, 1e-7)
    _assert_close(jac, inv, 1e-7)


@pytest.mark.parametrize("adjoint", ADJOINTS, ids=str)
@pytest.mark.parametrize("method", METHODS)
@MAIN
@given(problem=contractive_maps())
def test_fixed_point_contractive_linear_maps(method, adjoint, problem):
    A, a, c = _pad(*problem, block=np.zeros((PADDED, PADDED)))
    _check_fixed_point(A, a, c, method, adjoint)


@pytest.mark.slow
@pytest.mark.parametrize("adjoint", ADJOINTS, ids=str)
@pytest.mark.parametrize("method", METHODS)
@SLOW
@given(problem=contractive_maps())
def test_fixed_point_contractive_linear_maps_many(method, adjoint, problem):
    _check_fixed_point(*problem, method, adjoint)


# ---------------------------------------------------------------------------
# implicitdiff.linear_solve


@functools.cache
def _linear_solve_program(name):
    """One jitted program per solver: the solution, `grad` of `c . x` and `jacfwd`, all
    with respect to `b`."""
    solver = getattr(linear_solve, name)

    def solve(A, b):
        return solver(lambda v: A @ v, b)

    def run(A, b, c):
        x = solve(A, b)
        grad = jax.grad(lambda b: c @ solve(A, b))(b)
        jac = jax.jacfwd(lambda b: solve(A, b))(b)
        return x, grad, jac

    return jax.jit(run)


def _check_linear_solve(A, b, c, name):
    x, grad, jac = _linear_solve_program(name)(A, b, c)
    inv = np.linalg.inv(A)
    # A residual of 1e-10 relative (times the slack of 10 the solvers allow) costs up to
    # the condition number, below 73: 1e-7 relative at worst.
    _assert_close(x, np.linalg.solve(A, b), 1e-7)
    _assert_close(grad, inv.T @ c, 1e-7)
    _assert_close(jac, inv, 1e-7)


@pytest.mark.parametrize("name", LINEAR_SOLVERS)
@MAIN
@given(system=spd_systems())
def test_linear_solve_spd_systems(name, system):
    A, b, c = _pad(*system, block=np.eye(PADDED))
    _check_linear_solve(A, b, c, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", LINEAR_SOLVERS)
@SLOW
@given(system=spd_systems())
def test_linear_solve_spd_systems_many(name, system):
    _check_linear_solve(*system, name)
