"""`solvers.root`: values (closed forms, scipy), implicit derivatives, diagnostics, errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.optimize

from implicitdiff import check_grads, linear_solve
from solvers import BAD_BRACKET, MAX_STEPS, NONFINITE, SUCCESS, root

from ._transforms import transform_table

pytestmark = pytest.mark.usefixtures("fast_compiles")

METHODS = ["newton", "chord", "broyden", "bisection"]
RUNTIME_ERRORS = (RuntimeError, ValueError)  # see implicitdiff.error_if: eager, jit, fast path


def cube_root(a, method="newton", **kw):
    """x**3 = a from x0 = 1.5 (near enough for the chord method when 1 <= a <= 5);
    bisection on (0, 10)."""
    if method == "bisection":
        kw.setdefault("bracket", (0.0, 10.0))
    return root(lambda x, a: x**3 - a, 1.5, a, method=method, **kw)


def sqrt(a, method="newton", **kw):
    if method == "bisection":
        kw.setdefault("bracket", (10.0, 0.0))  # either order
    return root(lambda x, a: x**2 - a, 1.5, a, method=method, **kw)


# ---------------------------------------------------------------------------
# Values: closed forms and scipy.


@pytest.mark.parametrize("method", METHODS)
def test_cube_root_and_sqrt_float64(x64, method):
    a = jnp.array([2.0, 3.0, 5.0])
    for solve, exact in ((cube_root, np.cbrt), (sqrt, np.sqrt)):
        # default tolerance (1e-10 on the step, or on the bracket's width)
        x, info = jax.vmap(functools.partial(solve, method=method, return_info=True))(a)
        assert x.dtype == jnp.float64
        np.testing.assert_array_equal(info.status, SUCCESS)
        np.testing.assert_allclose(x, exact(a), rtol=0, atol=3e-10)
        tight = jax.vmap(functools.partial(solve, method=method, rtol=1e-14, atol=1e-14))(a)
        np.testing.assert_allclose(tight, exact(a), rtol=2e-14)


@pytest.mark.parametrize("method", METHODS)
def test_cube_root_float32(method):
    x, info = cube_root(3.0, method, return_info=True)
    assert x.dtype == jnp.float32 and int(info.status) == SUCCESS
    np.testing.assert_allclose(x, np.cbrt(3.0), rtol=1e-6)
    g = jax.grad(functools.partial(cube_root, method=method))(3.0)
    np.testing.assert_allclose(g, 3.0 ** (-2 / 3) / 3, rtol=1e-6)


def test_newton_converges_faster_than_chord(x64):
    steps = {m: int(cube_root(5.0, m, return_info=True)[1].steps) for m in METHODS[:3]}
    assert steps["newton"] <= 6 < steps["chord"]
    assert steps["broyden"] < steps["chord"]


def _system(x, p):
    """Three equations in a dict {"u": (2,), "v": ()}."""
    u, v = x["u"], x["v"]
    return {
        "u": jnp.stack([u[0] ** 2 + u[1] ** 2 + v**2 - p, jnp.exp(u[0]) - 2 * u[1]]),
        "v": u[0] * u[1] * v - 1.0 + jnp.sin(v),
    }


def _system_np(z, p):
    """The same equations in NumPy, on the flat vector (u0, u1, v), for scipy."""
    u0, u1, v = z
    return np.array([u0**2 + u1**2 + v**2 - p, np.exp(u0) - 2 * u1, u0 * u1 * v - 1.0 + np.sin(v)])


def test_nonlinear_system_pytree_matches_scipy(x64):
    z0 = np.array([0.5, 1.0, 1.0])
    ref = scipy.optimize.root(_system_np, z0, args=(4.0,), method="hybr", tol=1e-14)
    assert ref.success
    x0 = {"u": jnp.asarray(z0[:2]), "v": jnp.asarray(z0[2])}
    x, info = root(_system, x0, 4.0, rtol=1e-13, atol=1e-13, return_info=True)
    # Plain Newton wanders for about 45 steps from x0 (Jacobians with condition numbers
    # up to 1e7), and where it ends depends on rounding; the line search takes 6.
    assert int(info.status) == SUCCESS and int(info.steps) <= 10
    np.testing.assert_allclose(x["u"], ref.x[:2], rtol=1e-10)
    np.testing.assert_allclose(x["v"], ref.x[2], rtol=1e-10)
    # chord and broyden from near the root (the system has others)
    near = {"u": jnp.asarray(ref.x[:2] + 0.05), "v": jnp.asarray(ref.x[2] - 0.05)}
    for method in ("chord", "broyden"):
        x = root(_system, near, 4.0, method=method, rtol=1e-13, atol=1e-13)
        np.testing.assert_allclose(x["u"], ref.x[:2], rtol=1e-10)
        np.testing.assert_allclose(x["v"], ref.x[2], rtol=1e-10)
    # the derivative in p against scipy's roots by central differences
    h = 1e-6
    plus = scipy.optimize.root(_system_np, ref.x, args=(4.0 + h,), tol=1e-14).x
    minus = scipy.optimize.root(_system_np, ref.x, args=(4.0 - h,), tol=1e-14).x
    dx = jax.jacfwd(lambda p: root(_system, x0, p, rtol=1e-13, atol=1e-13))(4.0)
    np.testing.assert_allclose(
        np.append(dx["u"], dx["v"]), (plus - minus) / (2 * h), rtol=1e-6, atol=1e-8
    )


@pytest.mark.parametrize("method", ["newton", "broyden"])
@pytest.mark.parametrize(
    "f, x0",
    [
        # Newton's full step from |x| > 1.39 overshoots further each time: x -> -x(1+x^2)...
        (lambda x, a: jnp.arctan(x - a), 3.0),
        # ... and here it jumps to x = e^10 - 10, where exp overflows to inf.
        (lambda x, a: jnp.expm1(x - a), -10.0),
    ],
    ids=["arctan", "expm1"],
)
def test_line_search_converges_where_the_full_step_diverges(x64, method, f, x0):
    """Both roots are x = a, with dx/da = 1; full steps diverge from these x0."""
    x, info = root(f, x0, 0.5, method=method, return_info=True)
    assert int(info.status) == SUCCESS and int(info.steps) < 60
    np.testing.assert_allclose(x, 0.5, rtol=1e-12)
    np.testing.assert_allclose(jax.grad(lambda a: root(f, x0, a, method=method))(0.5), 1.0)


def test_tuple_x_with_newton(x64):
    """x = (s, t) with s + t = a, s t = 2 (a tuple of scalars): s, t = (a -/+ sqrt(a^2 - 8)) / 2."""

    def f(x, a):
        s, t = x
        return (s + t - a, s * t - 2.0)

    s, t = root(f, (0.5, 5.0), 6.0)
    np.testing.assert_allclose([s, t], [3 - np.sqrt(7), 3 + np.sqrt(7)], rtol=1e-12)
    ds = jax.grad(lambda a: root(f, (0.5, 5.0), a)[0])(6.0)
    np.testing.assert_allclose(ds, 0.5 - 0.5 * 6.0 / np.sqrt(28.0), rtol=1e-10)


@pytest.mark.parametrize("bracket", [(0.0, 1.0), (1.0, 0.0)])
def test_bisection_matches_brentq_with_bracket_in_either_order(x64, bracket):
    f = lambda x, a: jnp.cos(x) - a * x
    ref = scipy.optimize.brentq(lambda x: np.cos(x) - 2.0 * x, 0.0, 1.0, xtol=1e-15)
    x = root(f, 0.0, 2.0, method="bisection", bracket=bracket, rtol=1e-14, atol=1e-14)
    np.testing.assert_allclose(x, ref, rtol=1e-13)
    # x' = -x / (sin x + a)
    g = jax.grad(lambda a: root(f, 0.0, a, method="bisection", bracket=bracket))(2.0)
    np.testing.assert_allclose(g, -ref / (np.sin(ref) + 2.0), rtol=1e-9)


@pytest.mark.parametrize("bracket", [(2.0, 5.0), (5.0, 2.0), (-1.0, 2.0), (2.0, -1.0)])
def test_bisection_exact_root_at_a_bracket_end(x64, bracket):
    x, info = root(lambda x: x - 2.0, 0.0, method="bisection", bracket=bracket, return_info=True)
    assert float(x) == 2.0 and int(info.status) == SUCCESS and float(info.residual) == 0.0
    g = jax.grad(lambda a: root(lambda x, a: x**2 - a, 0.0, a, method="bisection", bracket=bracket))
    np.testing.assert_allclose(g(4.0), 0.25, rtol=1e-12)


@pytest.mark.parametrize("bracket", [(0.0, 4.0), (4.0, 0.0), (1.0, 3.0)])
def test_bisection_exact_root_at_a_midpoint(x64, bracket):
    """The first midpoint is the root, f(mid) == 0 exactly: that is the answer."""
    x, info = root(lambda x: x - 2.0, 0.0, method="bisection", bracket=bracket, return_info=True)
    assert float(x) == 2.0 and int(info.status) == SUCCESS and float(info.residual) == 0.0
    x = root(lambda x, a: x**2 - a, 0.0, 4.0, method="bisection", bracket=bracket)
    assert float(x) == 2.0


# ---------------------------------------------------------------------------
# Transformations, against the closed form a**(1/3) in float64.

A = 3.0  # scalar point
AS = np.array([1.0, 3.0, 5.0])  # batch point

X = np.cbrt
D1 = lambda a: a ** (-2 / 3) / 3
D2 = lambda a: -2 / 9 * a ** (-5 / 3)


TRANSFORMS = transform_table(X, D1, D2, A, AS)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_transformations(x64, name, method):
    transform, expected, at = TRANSFORMS[name]
    f = functools.partial(cube_root, method=method, rtol=1e-13, atol=1e-13)
    at = jnp.asarray(at, jnp.float64)
    np.testing.assert_allclose(transform(f)(at), expected(np.asarray(at)), rtol=1e-9)


@pytest.mark.parametrize("method", METHODS)
def test_closed_over_value_gets_the_implicit_gradient(x64, method):
    def sqrt_c(c):
        kw = {"bracket": (0.0, 10.0)} if method == "bisection" else {}
        f = lambda x: x**2 - c
        return root(f, jnp.float64(1.5), method=method, rtol=1e-13, atol=1e-13, **kw)

    d1 = lambda c: 0.5 / np.sqrt(c)
    np.testing.assert_allclose(jax.grad(sqrt_c)(3.0), d1(3.0), rtol=1e-10)
    np.testing.assert_allclose(jax.jacfwd(sqrt_c)(3.0), d1(3.0), rtol=1e-10)
    np.testing.assert_allclose(jax.hessian(sqrt_c)(3.0), -0.25 * 3.0**-1.5, rtol=1e-9)
    c = jnp.array([2.0, 3.0, 4.0])
    np.testing.assert_allclose(jax.vmap(jax.grad(sqrt_c))(c), d1(c), rtol=1e-10)


# ---------------------------------------------------------------------------
# Several parameters, a matrix among them: against finite differences (float64).


def _cubic(x, m, b):
    """A x + 0.1 x^3 = b: J = A + 0.3 diag(x^2), invertible for A near 3 I."""
    return m @ x + 0.1 * x**3 - b


def _matrix_and_vector():
    rng = np.random.default_rng(0)
    m = jnp.asarray(3.0 * np.eye(3) + 0.5 * rng.standard_normal((3, 3)))
    return m, jnp.asarray(rng.standard_normal(3))


def test_matrix_argument_check_grads(x64):
    m, b = _matrix_and_vector()

    def solve(m, b):
        return root(_cubic, jnp.zeros(3), m, b, rtol=1e-13, atol=1e-13)

    np.testing.assert_allclose(_cubic(solve(m, b), m, b), 0.0, atol=1e-13)
    rows = check_grads(solve, (m, b), order=2)
    assert {r.argument for r in rows} >= {"m", "b"} and all(r.passed for r in rows)


@pytest.mark.parametrize("method", ["newton", "chord", "broyden"])
def test_matrix_argument_closed_form(x64, method):
    """dx/db = J^-1 and dx/dm[i, j] = -J^-1 e_i x_j, J = m + 0.3 diag(x^2)."""
    m, b = _matrix_and_vector()

    def solve(m, b):
        return root(_cubic, jnp.zeros(3), m, b, method=method, rtol=1e-13, atol=1e-13)

    x = solve(m, b)
    jinv = np.linalg.inv(m + 0.3 * np.diag(x**2))
    jac_b, jac_m = jax.jit(lambda m, b: (jax.jacrev(solve, 1)(m, b), jax.jacfwd(solve)(m, b)))(m, b)
    np.testing.assert_allclose(jac_b, jinv, rtol=1e-10)
    np.testing.assert_allclose(jac_m, -np.einsum("ki,j->kij", jinv, x), rtol=1e-10, atol=1e-14)


def test_pytree_system_check_grads(x64):
    # from near the root: _system has several, and from farther away the basin of
    # attraction can change under the finite differences' perturbations
    near = {"u": jnp.array([0.1, 0.55]), "v": jnp.asarray(1.9)}
    check_grads(lambda p: root(_system, near, p, rtol=1e-13, atol=1e-13), (4.0,), order=1)


# ---------------------------------------------------------------------------
# Linear solvers for the derivatives.


@pytest.mark.parametrize(
    "linear_solver",
    [
        "auto",
        "dense",
        "gmres",
        "bicgstab",
        "normal_cg",
        "gmres(rtol=1e-12)",
        linear_solve.Dense(),
        linear_solve.GMRES(rtol=1e-12),
    ],
    ids=str,
)
def test_linear_solvers_give_the_same_derivatives(x64, linear_solver):
    if linear_solver == "gmres(rtol=1e-12)":
        linear_solver = functools.partial(linear_solve.gmres, rtol=1e-12)
    m, b = _matrix_and_vector()

    def solve(b):
        return root(_cubic, jnp.zeros(3), m, b, rtol=1e-13, atol=1e-13, linear_solver=linear_solver)

    x = solve(b)
    jinv = np.linalg.inv(m + 0.3 * np.diag(x**2))
    rev, fwd = jax.jit(lambda b: (jax.jacrev(solve)(b), jax.jacfwd(solve)(b)))(b)
    np.testing.assert_allclose(rev, jinv, rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(fwd, jinv, rtol=1e-8, atol=1e-10)


class _HalfDense(linear_solve.Dense):
    """Dense LU whose solves return half the solution (damped steps)."""

    def solve(self, state, b):
        return jax.tree_util.tree_map(lambda x: 0.5 * x, super().solve(state, b))


@pytest.mark.parametrize(
    "linear_solver",
    ["dense", linear_solve.Banded(1, 1), linear_solve.GMRES(rtol=1e-13), "object", "function"],
    ids=str,
)
def test_chord_steps_solve_with_the_linear_solver(x64, linear_solver):
    """The chord method prepares the Jacobian at `x0` once with `linear_solver` and
    solves with it at every step: on a tridiagonal system a band solver and GMRES take
    the dense LU's steps to the same root; a solver object or a function whose solves
    return half the solution (damped steps) converges, slower, which shows its solves
    are the steps'."""
    n = 6
    m = jnp.asarray(
        3.0 * np.eye(n) + np.diag(np.full(n - 1, 0.4), 1) - np.diag(np.full(n - 1, 0.3), -1)
    )
    b = jnp.linspace(-1.0, 1.0, n)

    def solve(solver):
        return root(_cubic, jnp.zeros(n), m, b, method="chord", rtol=1e-12, atol=1e-12,
                    linear_solver=solver, return_info=True)  # fmt: skip

    x_dense, info_dense = solve("dense")
    if linear_solver in ("object", "function"):
        dense = linear_solve.Dense()
        half = _HalfDense() if linear_solver == "object" else lambda mv, rhs: 0.5 * dense(mv, rhs)
        x, info = solve(half)
        assert int(info.steps) > int(info_dense.steps) + 10
    else:
        x, info = solve(linear_solver)
        assert abs(int(info.steps) - int(info_dense.steps)) <= 1
    assert int(info.status) == SUCCESS
    np.testing.assert_allclose(_cubic(x, m, b), 0.0, atol=1e-11)
    np.testing.assert_allclose(x, x_dense, rtol=1e-11, atol=1e-12)


def _cubic_hessian(m, b, c):
    """The Hessian in `b` of `c . x(b)` for `_cubic`: differentiating `J dx = db` twice,
    `x_jk = -J^-1 (0.6 x * X_j * X_k)` with `X = J^-1`, so `H = -0.6 X^T diag(w x) X`
    with `w = J^-T c`."""
    x = np.asarray(root(_cubic, jnp.zeros(3), m, b, rtol=1e-13, atol=1e-13))
    jinv = np.linalg.inv(np.asarray(m) + 0.3 * np.diag(x**2))
    w = jinv.T @ np.asarray(c)
    return jinv, -0.6 * jinv.T @ np.diag(w * x) @ jinv


@pytest.mark.parametrize(
    "linear_solver", [linear_solve.Dense(), linear_solve.GMRES(rtol=1e-12)], ids=repr
)
def test_higher_order_derivatives_with_solver_objects(x64, linear_solver):
    """Derivatives of every order reuse the solver's state; closed forms of `_cubic`."""
    m, b = _matrix_and_vector()
    c, d = jnp.array([1.0, -2.0, 0.5]), jnp.array([0.3, 0.1, -0.2])

    def phi(b):
        x = root(_cubic, jnp.zeros(3), m, b, rtol=1e-13, atol=1e-13, linear_solver=linear_solver)
        return c @ x

    along = lambda t: phi(b + t * d)  # noqa: E731
    got = jax.jit(
        lambda b: {
            "grad": jax.grad(phi)(b),
            "hessian": jax.hessian(phi)(b),
            "jacrev(jacfwd)": jax.jacrev(jax.jacfwd(phi))(b),
            "grad(grad)": jax.grad(jax.grad(along))(0.0),
            "vmap(grad)": jax.vmap(jax.grad(phi))(jnp.stack([b, b])),
        }
    )(b)
    jinv, hess = _cubic_hessian(m, b, c)
    want = {
        "grad": jinv.T @ np.asarray(c),
        "hessian": hess,
        "jacrev(jacfwd)": hess,
        "grad(grad)": np.asarray(d) @ hess @ np.asarray(d),
        "vmap(grad)": np.stack([jinv.T @ np.asarray(c)] * 2),
    }
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-8, atol=1e-12, err_msg=name)


def test_linear_solver_names_objects_and_functions():
    m, b = _matrix_and_vector()
    with pytest.raises(ValueError, match=r"`linear_solver` must be one of .*'normal_cg'\)"):
        root(_cubic, jnp.zeros(3), m, b, linear_solver="neumann")
    with pytest.raises(ValueError, match="LinearSolver"):
        root(_cubic, jnp.zeros(3), m, b, linear_solver=3)


# ---------------------------------------------------------------------------
# Diagnostics and non-convergence.


@pytest.mark.parametrize("method", METHODS)
def test_info(x64, method):
    x, info = cube_root(jnp.float64(3.0), method, return_info=True)
    assert int(info.status) == SUCCESS and bool(info.converged)
    assert int(info.steps) > 0
    assert float(info.residual) == pytest.approx(abs(float(x) ** 3 - 3.0), abs=1e-15)
    assert float(info.residual) < 1e-9


def test_non_convergence_raises_with_the_residual():
    with pytest.raises(RUNTIME_ERRORS, match=r"root did not converge.*last residual"):
        jax.block_until_ready(cube_root(50.0, max_steps=2))
    with pytest.raises(RUNTIME_ERRORS, match=r"root did not converge.*status 1.*after 2 steps"):
        jax.block_until_ready(jax.jit(lambda a: cube_root(a, max_steps=2))(50.0))


@pytest.mark.parametrize("method", METHODS)
def test_max_steps_status_without_throwing(method):
    x, info = cube_root(5.0, method, max_steps=2, throw=False, return_info=True)
    assert int(info.status) == MAX_STEPS and not bool(info.converged)
    assert int(info.steps) == 2 and float(info.residual) > 1e-3


@pytest.mark.parametrize("method", METHODS)
def test_nan_is_reported(method):
    x, info = cube_root(jnp.nan, method, throw=False, return_info=True)
    assert int(info.status) == NONFINITE
    with pytest.raises(RUNTIME_ERRORS, match="root did not converge: status 2"):
        jax.block_until_ready(cube_root(jnp.nan, method))


def test_throw_false_needs_return_info():
    """Without the run-time check and without the status, nothing would show a failure."""
    match = r"root: `throw=False`.*`return_info=True`"
    with pytest.raises(ValueError, match=match):
        cube_root(5.0, throw=False)
    with pytest.raises(ValueError, match=match):
        cube_root(5.0, "bisection", throw=False)
    with pytest.raises(ValueError, match=match):
        jax.jit(jax.grad(lambda a: cube_root(a, throw=False)))(5.0)
    # With the info the same failing solve reports, and a good one answers.
    x, info = cube_root(5.0, max_steps=2, throw=False, return_info=True)
    assert int(info.status) == MAX_STEPS and not bool(info.converged)
    x, info = cube_root(8.0, throw=False, return_info=True)
    assert int(info.status) == SUCCESS
    np.testing.assert_allclose(x, 2.0, rtol=1e-6)


def test_bad_bracket():
    x, info = cube_root(2000.0, "bisection", throw=False, return_info=True)
    assert int(info.status) == BAD_BRACKET and int(info.steps) == 0
    with pytest.raises(RUNTIME_ERRORS, match="root did not converge: status 3"):
        jax.block_until_ready(cube_root(2000.0, "bisection"))


def test_status_per_vmap_element():
    a = jnp.array([2.0, 1e12, 4.0])
    x, info = jax.vmap(lambda a: cube_root(a, max_steps=6, throw=False, return_info=True))(a)
    np.testing.assert_array_equal(info.status, [SUCCESS, MAX_STEPS, SUCCESS])
    np.testing.assert_allclose(np.asarray(x)[[0, 2]], np.cbrt([2.0, 4.0]), rtol=1e-6)
    a = jnp.array([8.0, 2000.0, jnp.nan, 27.0])
    x, info = jax.vmap(lambda a: cube_root(a, "bisection", throw=False, return_info=True))(a)
    np.testing.assert_array_equal(info.status, [SUCCESS, BAD_BRACKET, NONFINITE, SUCCESS])
    np.testing.assert_allclose(np.asarray(x)[[0, 3]], [2.0, 3.0], rtol=1e-6)
    with pytest.raises(RUNTIME_ERRORS, match=r"status 3.*\n.*first failing element.*\(1,\)"):
        jax.block_until_ready(jax.vmap(lambda a: cube_root(a, "bisection"))(a))


def test_bracket_can_be_traced_and_x0_and_bracket_get_no_derivative():
    """A per-element bracket under vmap; the ends of the bracket and x0 get zero derivative."""

    def sqrt2(lo):
        return root(lambda x: x**2 - 2.0, 1.0, method="bisection", bracket=(lo, 5.0))

    np.testing.assert_allclose(
        jax.vmap(sqrt2)(jnp.array([0.0, 1.0, -1.0])), np.sqrt(2.0), rtol=1e-6
    )
    assert float(jax.grad(sqrt2)(0.0)) == 0.0
    assert float(jax.grad(lambda x0: root(lambda x: x**3 - 3.0, x0))(1.5)) == 0.0


# ---------------------------------------------------------------------------
# Bad input.


def test_bad_input_names_the_argument():
    f = lambda x, a: x**3 - a
    with pytest.raises(ValueError, match="`method` must be one of"):
        root(f, 1.0, 2.0, method="secant")
    with pytest.raises(TypeError, match="`f` must be callable"):
        root(2.0, 1.0)
    with pytest.raises(TypeError, match=r"structure of `x0`"):
        root(lambda x: (x, x), 1.0)
    with pytest.raises(TypeError, match=r"shape and dtype of `x0`.*float32\[3\] where x0 has"):
        root(lambda x: jnp.ones(3), jnp.ones(2))
    with pytest.raises(TypeError, match=r"shape and dtype of `x0`.*float16\[\] where x0 has"):
        root(lambda x: x.astype(jnp.float16), 1.0)
    with pytest.raises(TypeError, match="`x0` leaf 0 has dtype int"):
        root(f, 1, 2.0)
    with pytest.raises(TypeError, match="`x0` leaf 1 has dtype int"):
        root(lambda x: x, (1.0, jnp.array([1, 2])))
    with pytest.raises(TypeError, match="`max_steps` must be a Python int"):
        jax.jit(lambda n: root(f, 1.0, 2.0, max_steps=n))(5)
    with pytest.raises(ValueError, match="`max_steps` must be an int >= 1"):
        root(f, 1.0, 2.0, max_steps=0)
    with pytest.raises(TypeError, match="`throw` must be True or False"):
        root(f, 1.0, 2.0, throw=1)
    with pytest.raises(ValueError, match="needs `bracket"):
        root(f, 1.0, 2.0, method="bisection")
    with pytest.raises(TypeError, match="`bracket` must be a pair"):
        root(f, 1.0, 2.0, method="bisection", bracket=(0.0, 1.0, 2.0))
    with pytest.raises(ValueError, match="`bracket` is only used by method='bisection'"):
        root(f, 1.0, 2.0, method="newton", bracket=(0.0, 10.0))
    with pytest.raises(TypeError, match="bisection' solves scalar equations; `x0` must be"):
        root(f, jnp.ones(2), 2.0, method="bisection", bracket=(0.0, 10.0))
    with pytest.raises(ValueError, match="`linear_solver` must be one of"):
        root(f, 1.0, 2.0, linear_solver="lu")
