"""`solve_bvp`: against SciPy's `solve_bvp` on its documented examples (Bratu's problem,
the Sturm-Liouville eigenvalue with an unknown parameter) and against closed forms;
derivatives (grad, jvp, hessian, vmap) against closed forms and central differences
of SciPy at a tight tolerance."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.integrate import solve_bvp as scipy_solve_bvp

from solvers import BVPSolution, solve_bvp

pytestmark = pytest.mark.usefixtures("fast_compiles")


# Bratu's problem: y'' + lam exp(y) = 0, y(0) = y(1) = 0 (SciPy's first example).
def bratu(lam):
    def fun(x, y):
        return jnp.stack([y[1], -lam * jnp.exp(y[0])])

    def fun_np(x, y):
        return np.vstack([y[1], -lam * np.exp(y[0])])

    def bc(ya, yb):
        return jnp.stack([ya[0], yb[0]])

    return fun, fun_np, bc


def test_bratu_matches_scipy(x64):
    x = np.linspace(0, 1, 5)
    y0 = np.zeros((2, x.size))
    fun, fun_np, bc = bratu(1.0)
    ours = solve_bvp(fun, bc, x, y0, tol=1e-6, max_nodes=200)
    ref = scipy_solve_bvp(fun_np, lambda a, b: np.array([a[0], b[0]]), x, y0, tol=1e-10)
    assert isinstance(ours, BVPSolution) and bool(ours.success)
    xs = np.linspace(0, 1, 23)
    np.testing.assert_allclose(ours.sol(xs), ref.sol(xs), atol=1e-6)
    m = int(ours.num_nodes)
    same = scipy_solve_bvp(fun_np, lambda a, b: np.array([a[0], b[0]]), x, y0, tol=1e-6)
    assert m == same.x.size  # the same algorithm refines the same way
    np.testing.assert_allclose(ours.x[:m], same.x, rtol=1e-12)
    assert float(jnp.max(ours.rms_residuals)) <= 1e-6
    np.testing.assert_array_equal(ours.x[m:], 1.0)  # the buffer past the last node


def test_bratu_gradient_against_scipy_central_differences(x64):
    """d y'(0) / d lam: implicit, against central differences of SciPy at 1e-10."""

    def slope(lam):
        fun, _, bc = bratu(lam)
        x = jnp.linspace(0.0, 1.0, 5)
        res = solve_bvp(fun, bc, x, jnp.zeros((2, 5)), tol=1e-8, max_nodes=300)
        return res.y[1, 0]

    def scipy_slope(lam):
        _, fun_np, _ = bratu(lam)
        x = np.linspace(0, 1, 5)
        bc = lambda a, b: np.array([a[0], b[0]])  # noqa: E731
        return scipy_solve_bvp(fun_np, bc, x, np.zeros((2, 5)), tol=1e-10, max_nodes=10**5).y[1, 0]

    eps = 1e-4
    fd = (scipy_slope(1.0 + eps) - scipy_slope(1.0 - eps)) / (2 * eps)
    g = jax.jit(jax.grad(slope))(1.0)
    np.testing.assert_allclose(g, fd, rtol=1e-5)
    np.testing.assert_allclose(jax.jit(jax.jacfwd(slope))(1.0), g, rtol=1e-9)


# y'' + k^2 y = 0, y(0) = y(1) = 0, y'(0) = k: the eigenvalue k is an unknown parameter
# (SciPy's second example); the guess picks the second eigenvalue, k = 2 pi. With a
# stiffness s, y'' + s k^2 y = 0: k = 2 pi / sqrt(s).
def eigen_fun(s):
    def fun(x, y, p):
        return jnp.stack([y[1], -s * p[0] ** 2 * y[0]])

    return fun


def eigen_bc(ya, yb, p):
    return jnp.stack([ya[0], yb[0], ya[1] - p[0]])


def _eigen_guess():
    x = np.linspace(0, 1, 5)
    y = np.zeros((2, x.size))
    y[0, 1], y[0, 3] = 1.0, -1.0
    return x, y


def test_eigenvalue_matches_scipy_and_the_closed_form(x64):
    x, y = _eigen_guess()
    ours = solve_bvp(eigen_fun(1.0), eigen_bc, x, y, p=np.array([6.0]), tol=1e-6, max_nodes=300)
    ref = scipy_solve_bvp(
        lambda x, y, p: np.vstack([y[1], -p[0] ** 2 * y[0]]),
        lambda a, b, p: np.array([a[0], b[0], a[1] - p[0]]),
        x, y, p=[6.0], tol=1e-6,
    )  # fmt: skip
    np.testing.assert_allclose(ours.p, ref.p, rtol=1e-6)
    np.testing.assert_allclose(ours.p, [2 * np.pi], rtol=1e-6)
    xs = np.linspace(0, 1, 17)
    np.testing.assert_allclose(ours.sol(xs)[0], np.sin(2 * np.pi * xs), atol=1e-5)
    np.testing.assert_allclose(ours.sol(xs, 1)[1], -((2 * np.pi) ** 2) * np.sin(2 * np.pi * xs),
                               atol=1e-2)  # fmt: skip


def test_eigenvalue_derivatives_match_the_closed_form(x64):
    """k(s) = 2 pi / sqrt(s): grad, jvp, second derivative and vmap."""
    x, y = _eigen_guess()

    def k(s):
        res = solve_bvp(eigen_fun(s), eigen_bc, x, y, p=jnp.array([6.0]), tol=1e-6, max_nodes=300)
        return res.p[0]

    exact = lambda s: 2 * jnp.pi / jnp.sqrt(s)  # noqa: E731
    s = 1.3
    np.testing.assert_allclose(jax.jit(k)(s), exact(s), rtol=1e-6)
    np.testing.assert_allclose(jax.jit(jax.grad(k))(s), jax.grad(exact)(s), rtol=1e-5)
    _, t = jax.jit(lambda s: jax.jvp(k, (s,), (1.0,)))(s)
    np.testing.assert_allclose(t, jax.grad(exact)(s), rtol=1e-5)
    np.testing.assert_allclose(jax.jit(jax.grad(jax.grad(k)))(s), jax.grad(jax.grad(exact))(s),
                               rtol=1e-4)  # fmt: skip
    ss = jnp.array([0.8, 1.0, 1.7])
    np.testing.assert_allclose(jax.jit(jax.vmap(k))(ss), exact(ss), rtol=1e-6)
    np.testing.assert_allclose(jax.jit(jax.vmap(jax.grad(k)))(ss), jax.vmap(jax.grad(exact))(ss),
                               rtol=1e-5)  # fmt: skip


def test_linear_problem_and_boundary_data_derivatives(x64):
    """y'' = a^2 y, y(0) = u, y(1) = v: y = (u sinh(a (1 - x)) + v sinh(a x)) / sinh(a).
    Derivatives with respect to the equation's `a` and the boundary values `u`, `v`
    (closed over by `bc`), of the solution anywhere (`sol`)."""
    xq = jnp.array([0.1, 0.45, 0.8])

    def solve(a, u, v):
        fun = lambda x, y: jnp.stack([y[1], a**2 * y[0]])  # noqa: E731
        bc = lambda ya, yb: jnp.stack([ya[0] - u, yb[0] - v])  # noqa: E731
        x = jnp.linspace(0.0, 1.0, 4)
        res = solve_bvp(fun, bc, x, jnp.zeros((2, 4)), tol=1e-6, max_nodes=100)
        return res.sol(xq)[0]

    def exact(a, u, v):
        return (u * jnp.sinh(a * (1 - xq)) + v * jnp.sinh(a * xq)) / jnp.sinh(a)

    args = (2.0, 0.5, -1.5)
    np.testing.assert_allclose(jax.jit(solve)(*args), exact(*args), rtol=1e-6, atol=1e-8)
    for got, want in zip(jax.jit(jax.jacrev(solve, (0, 1, 2)))(*args),
                         jax.jacfwd(exact, (0, 1, 2))(*args)):  # fmt: skip
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def test_failure_is_reported(x64):
    fun, _, bc = bratu(1.0)
    x = np.linspace(0, 1, 5)
    res = solve_bvp(fun, bc, x, np.zeros((2, 5)), tol=1e-9, max_nodes=8, throw=False)
    assert int(res.status) == 1 and not bool(res.success)
    with pytest.raises(Exception, match="max_nodes"):
        jax.block_until_ready(solve_bvp(fun, bc, x, np.zeros((2, 5)), tol=1e-9, max_nodes=8).y)


def test_bad_input():
    fun, _, bc = bratu(1.0)
    x = np.linspace(0, 1, 5)
    with pytest.raises(ValueError, match="strictly increasing"):
        solve_bvp(fun, bc, x[::-1], np.zeros((2, 5)))
    with pytest.raises(ValueError, match=r"\(n, 5\)"):
        solve_bvp(fun, bc, x, np.zeros((2, 4)))
    with pytest.raises(ValueError, match="n \\+ k = 3"):
        solve_bvp(eigen_fun(1.0), lambda a, b, p: jnp.stack([a[0], b[0]]), x,
                  np.zeros((2, 5)), p=np.array([6.0]))  # fmt: skip
    with pytest.raises(ValueError, match="max_nodes"):
        solve_bvp(fun, bc, x, np.zeros((2, 5)), max_nodes=3)
    # A complex guess is refused, not cast to its real part.
    with pytest.raises(TypeError, match="`y` is complex"):
        solve_bvp(fun, bc, x, np.zeros((2, 5), complex))
    with pytest.raises(TypeError, match="`p` is complex"):
        solve_bvp(eigen_fun(1.0), eigen_bc, x, np.zeros((2, 5)), p=np.array([6.0 + 0j]))


def test_shooting_matches_scipy_and_its_derivatives_the_closed_form(x64):
    """Single shooting: Bratu against SciPy at the nodes, and the eigenvalue k(s) =
    2 pi / sqrt(s) with its derivative, jvp and vmap."""
    x = np.linspace(0, 1, 11)
    fun, fun_np, bc = bratu(1.0)
    ours = solve_bvp(fun, bc, x, np.zeros((2, 11)), tol=1e-6, method="shooting")
    ref = scipy_solve_bvp(fun_np, lambda a, b: np.array([a[0], b[0]]), x, np.zeros((2, 11)),
                          tol=1e-10)  # fmt: skip
    assert int(ours.status) == 0 and int(ours.num_nodes) == 11
    np.testing.assert_allclose(ours.y, ref.sol(x), atol=1e-8)

    xe, ye = _eigen_guess()
    ye[1, 0] = 6.0  # shooting starts from the guess at x[0] only: y'(0) = k, not 0

    def k(s):
        res = solve_bvp(eigen_fun(s), eigen_bc, xe, ye, p=jnp.array([6.0]), tol=1e-6,
                        method="shooting")  # fmt: skip
        return res.p[0]

    exact = lambda s: 2 * jnp.pi / jnp.sqrt(s)  # noqa: E731
    np.testing.assert_allclose(jax.jit(k)(1.3), exact(1.3), rtol=1e-8)
    np.testing.assert_allclose(jax.jit(jax.grad(k))(1.3), jax.grad(exact)(1.3), rtol=1e-7)
    _, t = jax.jit(lambda s: jax.jvp(k, (s,), (1.0,)))(1.3)
    np.testing.assert_allclose(t, jax.grad(exact)(1.3), rtol=1e-7)
    ss = jnp.array([1.1, 1.4])
    np.testing.assert_allclose(jax.jit(jax.vmap(k))(ss), exact(ss), rtol=1e-8)
    with pytest.raises(ValueError, match="collocation' or 'shooting"):
        solve_bvp(fun, bc, x, np.zeros((2, 11)), method="newton")


def test_derivative_with_respect_to_the_interval(x64):
    """y'' = a^2 y on [0, L], y(0) = u, y(L) = v: y'(0) = a (v - u cosh(a L)) / sinh(a L).
    The mesh is traced (built from L inside jit); its ends carry L's derivative."""
    a, u, v = 2.0, 0.5, -1.5

    def slope(L):
        fun = lambda x, y: jnp.stack([y[1], a**2 * y[0]])  # noqa: E731
        bc = lambda ya, yb: jnp.stack([ya[0] - u, yb[0] - v])  # noqa: E731
        x = jnp.linspace(0.0, L, 4)
        return solve_bvp(fun, bc, x, jnp.zeros((2, 4)), tol=1e-6, max_nodes=150).y[1, 0]

    exact = lambda L: a * (v - u * jnp.cosh(a * L)) / jnp.sinh(a * L)  # noqa: E731
    np.testing.assert_allclose(jax.jit(slope)(1.3), exact(1.3), rtol=1e-6)
    np.testing.assert_allclose(jax.jit(jax.grad(slope))(1.3), jax.grad(exact)(1.3), rtol=1e-5)
    np.testing.assert_allclose(jax.jit(jax.jacfwd(slope))(1.3), jax.grad(exact)(1.3), rtol=1e-5)


def test_float32():
    fun, fun_np, bc = bratu(1.0)
    x = np.linspace(0, 1, 5, dtype=np.float32)
    res = solve_bvp(fun, bc, x, np.zeros((2, 5), np.float32), tol=1e-3, max_nodes=100)
    assert res.y.dtype == jnp.float32 and int(res.status) == 0
    ref = scipy_solve_bvp(fun_np, lambda a, b: np.array([a[0], b[0]]), x, np.zeros((2, 5)),
                          tol=1e-8)  # fmt: skip
    np.testing.assert_allclose(res.sol(np.float32([0.3, 0.5])), ref.sol([0.3, 0.5]), atol=1e-3)


def test_singular_jacobian_is_reported_as_scipy_does(x64):
    """The same boundary condition twice: the collocation Jacobian is singular
    (status 2, as SciPy's)."""
    fun, fun_np, _ = bratu(1.0)
    x, y = np.linspace(0, 1, 5), np.zeros((2, 5))
    res = solve_bvp(fun, lambda a, b: jnp.stack([a[0], a[0]]), x, y, throw=False)
    ref = scipy_solve_bvp(fun_np, lambda a, b: np.array([a[0], a[0]]), x, y)
    assert int(res.status) == ref.status == 2 and not bool(res.success)


def test_vmap_over_problems_that_refine_differently(x64):
    """Bratu at three values of lam needs 17, 29 and 81 nodes: under `vmap` each keeps
    its own mesh, equal to its own solve and to SciPy's."""
    x, y = np.linspace(0, 1, 5), np.zeros((2, 5))

    def run(lam):
        return solve_bvp(bratu(lam)[0], bratu(lam)[2], x, y, tol=1e-6, max_nodes=200)

    lams = (0.5, 1.0, 3.0)
    batched = jax.vmap(run)(jnp.array(lams))
    for i, lam in enumerate(lams):
        alone = run(lam)
        ref = scipy_solve_bvp(bratu(lam)[1], lambda a, b: np.array([a[0], b[0]]), x, y, tol=1e-6)
        m = int(alone.num_nodes)
        assert int(batched.num_nodes[i]) == m == ref.x.size
        np.testing.assert_allclose(batched.y[i], alone.y, rtol=0, atol=1e-14)
        np.testing.assert_allclose(alone.y[:, :m], ref.y, rtol=0, atol=1e-12)


def test_sol_outside_the_interval_extends_the_end_pieces(x64):
    """`sol` beyond the ends evaluates the first and last cubic pieces, as SciPy's."""
    fun, fun_np, bc = bratu(1.0)
    x, y = np.linspace(0, 1, 5), np.zeros((2, 5))
    res = solve_bvp(fun, bc, x, y, tol=1e-6)
    ref = scipy_solve_bvp(fun_np, lambda a, b: np.array([a[0], b[0]]), x, y, tol=1e-6)
    xs = np.array([-0.2, 1.0, 1.1, 1.3])
    np.testing.assert_allclose(res.sol(xs), ref.sol(xs), rtol=0, atol=1e-12)
