"""`solvers.fixed_point`: the hijax guide's values, implicit derivatives, diagnostics, errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from implicitdiff import linear_solve
from solvers import MAX_STEPS, NONFINITE, SUCCESS, fixed_point


def newton_sqrt(a, **kw):
    return fixed_point(lambda a, x: 0.5 * (x + a / x), a, a, **kw)


# ---------------------------------------------------------------------------
# The guide's printed values (float32) and exact ones (float64).


def test_guide_values_float32():
    assert newton_sqrt(2.0) == np.float32(1.4142135)
    assert jax.grad(newton_sqrt)(2.0) == np.float32(0.35355338)
    # the guide prints -0.088388346 (its own backward iteration); -0.08838835 for jnp.sqrt
    np.testing.assert_allclose(jax.grad(jax.grad(newton_sqrt))(2.0), -0.088388346, rtol=3e-7)
    np.testing.assert_array_equal(
        jax.jit(jax.vmap(newton_sqrt))(jnp.array([1.0, 2.0, 3.0, 4.0])),
        np.array([1.0, 1.4142135, 1.7320509, 2.0], np.float32),
    )


def test_guide_values_float64_exact(x64):
    a = jnp.float64(2.0)
    np.testing.assert_allclose(newton_sqrt(a), np.sqrt(2.0), rtol=0, atol=1e-12)
    np.testing.assert_allclose(jax.grad(newton_sqrt)(a), 0.5 / np.sqrt(2.0), atol=1e-12)
    np.testing.assert_allclose(
        jax.grad(jax.grad(newton_sqrt))(a), -0.25 * 2.0**-1.5, rtol=0, atol=1e-12
    )
    a4 = jnp.array([1.0, 2.0, 3.0, 4.0])
    np.testing.assert_allclose(jax.jit(jax.vmap(newton_sqrt))(a4), np.sqrt(a4), atol=1e-12)


# ---------------------------------------------------------------------------
# Transformations, against the closed form sqrt(a) in float64.

D1 = lambda a: 0.5 * a**-0.5
D2 = lambda a: -0.25 * a**-1.5

TRANSFORMS = {
    "grad": (lambda f: jax.grad(f), D1),
    "jvp": (lambda f: lambda a: jax.jvp(f, (a,), (jnp.ones_like(a),))[1], D1),
    "jacfwd": (lambda f: jax.jacfwd(f), D1),
    "jacrev": (lambda f: jax.jacrev(f), D1),
    "hessian": (lambda f: jax.hessian(f), D2),
    "grad(grad)": (lambda f: jax.grad(jax.grad(f)), D2),
    "jacfwd(grad)": (lambda f: jax.jacfwd(jax.grad(f)), D2),
    "jit(grad)": (lambda f: jax.jit(jax.grad(f)), D1),
    "linearize": (lambda f: lambda a: jax.linearize(f, a)[1](jnp.ones_like(a)), D1),
    "checkpoint": (lambda f: jax.grad(jax.checkpoint(f)), D1),
}


@pytest.mark.parametrize("method", ["iterate", "damped", "anderson"])
@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_transformations_scalar(x64, name, method):
    transform, expected = TRANSFORMS[name]
    f = functools.partial(newton_sqrt, method=method, rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(transform(f)(jnp.float64(3.0)), expected(3.0), rtol=1e-9)


# (GMRES, the slowest to compile here, is also the DEQ tests' backward solver.)
@pytest.mark.parametrize(
    "adjoint", ["neumann", pytest.param("gmres", marks=pytest.mark.slow), "dense", "auto"]
)
def test_vmap_grad_and_grad_vmap(x64, adjoint):
    a = jnp.array([1.0, 2.0, 5.0])
    f = functools.partial(newton_sqrt, adjoint=adjoint)
    np.testing.assert_allclose(jax.vmap(jax.grad(f))(a), D1(a), rtol=1e-9)
    np.testing.assert_allclose(jax.grad(lambda a: jax.vmap(f)(a).sum())(a), D1(a), rtol=1e-9)
    np.testing.assert_allclose(jax.vmap(jax.hessian(f))(a), D2(a), rtol=1e-8)


def test_under_scan(x64):
    def body(carry, a):
        return carry + newton_sqrt(a), None

    g = jax.grad(lambda a: jax.lax.scan(body, 0.0, a)[0])(jnp.array([1.0, 4.0, 9.0]))
    np.testing.assert_allclose(g, D1(jnp.array([1.0, 4.0, 9.0])), rtol=1e-9)


def test_closed_over_value_gets_the_implicit_gradient(x64):
    def sqrt_c(c):
        return fixed_point(lambda a, x: 0.5 * (x + c / x), (), jnp.float64(1.0))

    np.testing.assert_allclose(jax.grad(sqrt_c)(5.0), D1(5.0), rtol=1e-10)
    np.testing.assert_allclose(jax.jacfwd(sqrt_c)(5.0), D1(5.0), rtol=1e-10)
    np.testing.assert_allclose(jax.vmap(jax.grad(sqrt_c))(jnp.array([4.0, 9.0])), [0.25, 1 / 6])


def test_vector_pytree_problem_matches_unrolled(x64):
    """x = tanh(W x + u) (+ a dict leaf), a contraction; gradients vs unrolled autodiff."""
    rng = np.random.default_rng(0)
    w = jnp.asarray(0.3 * rng.standard_normal((4, 4)) / 2)
    u = jnp.asarray(rng.standard_normal(4))

    def f(p, x):
        return {"h": jnp.tanh(p["w"] @ x["h"] + p["u"]), "s": 0.5 * x["s"] + jnp.sum(x["h"])}

    x0 = {"h": jnp.zeros(4), "s": jnp.zeros(())}

    def unrolled(p):
        return jax.lax.fori_loop(0, 200, lambda _, x: f(p, x), x0)

    def loss(solve, p):
        x = solve(p)
        return jnp.sum(x["h"] ** 2) + x["s"]

    p = {"w": w, "u": u}
    for method in ("iterate", "anderson"):
        ours = functools.partial(
            lambda p, m: fixed_point(f, p, x0, method=m, rtol=1e-12, atol=1e-12), m=method
        )
        g, g_ref = (
            jax.grad(functools.partial(loss, ours))(p),
            jax.grad(functools.partial(loss, unrolled))(p),
        )
        for k in p:
            np.testing.assert_allclose(g[k], g_ref[k], rtol=1e-8, atol=1e-10)
        jf = jax.jacfwd(functools.partial(loss, ours))(p)
        for k in p:
            np.testing.assert_allclose(jf[k], g_ref[k], rtol=1e-8, atol=1e-10)


# ---------------------------------------------------------------------------
# The default adjoint on maps that do not contract, which damped and Anderson iteration
# solve: the Neumann series diverges there, and a direct solve takes over.

# Spectral radius 1.50 (an eigenvalue near -1.5): damping and Anderson both converge.
A_NEG = np.array([[-1.5, 0.2, 0.0], [0.1, 0.4, 0.3], [0.0, -0.2, 0.1]])
# Spectral radius 1.21 (an eigenvalue near +1.21): damping diverges, Anderson converges.
A_POS = np.array([[1.2, 0.5, 0.0], [0.0, 0.3, 0.2], [0.1, 0.0, -0.4]])
A_RHS = np.array([1.0, -2.0, 0.5])


@pytest.fixture
def quick_compiles():
    """Skip XLA's costly optimisation passes, for a test that compiles many small programs
    and runs each once (the derivative rules under test do not depend on them)."""
    old = jax.config.values["jax_disable_most_optimizations"]
    jax.config.update("jax_disable_most_optimizations", True)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", old)


def linear_fixed_point(A, a, method, **kw):
    """x = A x + a, solved to 1e-12 from zero."""
    return fixed_point(
        lambda p, x: p[0] @ x + p[1],
        (A, a),
        jnp.zeros_like(a),
        method=method,
        rtol=1e-12,
        atol=1e-12,
        **kw,
    )


@pytest.mark.parametrize(
    "method,A",
    [("damped", A_NEG), ("anderson", A_NEG), ("anderson", A_POS)],
    ids=["damped-radius1.5", "anderson-radius1.5", "anderson-radius1.21"],
)
def test_default_adjoint_non_contractive_linear_map(x64, quick_compiles, method, A):
    """x* = (I - A)^-1 a: dx*/da = (I - A)^-1, dx*_i/dA_jk = (I - A)^-1_ij x*_k."""
    assert np.max(np.abs(np.linalg.eigvals(A))) > 1.2  # the series cannot converge
    inv = np.linalg.inv(np.eye(3) - A)
    x_star = inv @ A_RHS
    A_, a_ = jnp.asarray(A), jnp.asarray(A_RHS)
    tol = dict(rtol=1e-8, atol=1e-10)
    of_a = lambda a: linear_fixed_point(A_, a, method)
    np.testing.assert_allclose(of_a(a_), x_star, **tol)
    np.testing.assert_allclose(jax.jacfwd(of_a)(a_), inv, **tol)
    np.testing.assert_allclose(jax.jacrev(of_a)(a_), inv, **tol)
    d_A = np.einsum("ij,k->ijk", inv, x_star)
    np.testing.assert_allclose(
        jax.jacrev(lambda A: linear_fixed_point(A, a_, method))(A_), d_A, **tol
    )


def test_default_adjoint_non_contractive_linear_map_transforms(x64, quick_compiles):
    """The same with damping, under grad, jit, forward mode in A and the Hessian (second
    order: derivatives of the derivative solves, which fall back again)."""
    inv = np.linalg.inv(np.eye(3) - A_NEG)
    x_star = inv @ A_RHS
    A_, a_ = jnp.asarray(A_NEG), jnp.asarray(A_RHS)
    tol = dict(rtol=1e-8, atol=1e-10)
    of_a = lambda a: linear_fixed_point(A_, a, "damped")
    c = jnp.array([0.3, -1.0, 2.0])
    np.testing.assert_allclose(jax.jit(jax.grad(lambda a: c @ of_a(a)))(a_), inv.T @ c, **tol)
    d_A = np.einsum("ij,k->ijk", inv, x_star)
    np.testing.assert_allclose(
        jax.jacfwd(lambda A: linear_fixed_point(A, a_, "damped"))(A_), d_A, **tol
    )
    hess = jax.hessian(lambda a: 0.5 * jnp.sum(of_a(a) ** 2))(a_)
    np.testing.assert_allclose(hess, inv.T @ inv, **tol)


def test_default_adjoint_vmap_mixes_contractive_and_non_contractive_elements(x64, quick_compiles):
    """One batch: elements whose series diverges (A_NEG, its transpose) and elements
    whose series converges (scaled down to spectral radius 0.45 and 0.15)."""
    As = np.stack([0.3 * A_NEG, A_NEG, 0.1 * A_NEG, A_NEG.T])
    a = np.stack([A_RHS, 2 * A_RHS, -A_RHS, A_RHS[::-1].copy()])
    invs = np.linalg.inv(np.eye(3) - As)
    As_, a_ = jnp.asarray(As), jnp.asarray(a)
    solve = lambda A, a: linear_fixed_point(A, a, "damped")
    tol = dict(rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(jax.vmap(solve)(As_, a_), np.einsum("bij,bj->bi", invs, a), **tol)
    np.testing.assert_allclose(jax.jit(jax.vmap(jax.jacrev(solve, 1)))(As_, a_), invs, **tol)
    np.testing.assert_allclose(jax.vmap(jax.jacfwd(solve, 1))(As_, a_), invs, **tol)
    # reverse mode through the batch: d/da of sum_b c . x*_b is inv_b^T c per element
    c = jnp.array([0.3, -1.0, 2.0])
    g = jax.grad(lambda a: jnp.sum(jax.vmap(solve)(As_, a) @ c))(a_)
    np.testing.assert_allclose(g, np.einsum("bji,j->bi", invs, c), **tol)


def _central_differences(fun, p, eps=1e-6):
    """The gradient of a scalar `fun` of a dict of float64 arrays, by central differences."""
    grads = {}
    for k, v in p.items():
        v = np.asarray(v, np.float64)
        g = np.zeros_like(v)
        for i in np.ndindex(v.shape):
            e = np.zeros_like(v)
            e[i] = eps
            up, down = dict(p, **{k: jnp.asarray(v + e)}), dict(p, **{k: jnp.asarray(v - e)})
            g[i] = (float(fun(up)) - float(fun(down))) / (2 * eps)
        grads[k] = g
    return grads


@pytest.mark.parametrize("method", ["damped", "anderson"])
def test_default_adjoint_nonlinear_non_contractive_map(x64, quick_compiles, method):
    """x = M x + c sin(x) + a, whose Jacobian at the solution has an eigenvalue near -1.5:
    gradients in M, c and a against central differences."""

    def f(p, x):
        return p["M"] @ x + p["c"] * jnp.sin(x) + p["a"]

    p = {
        "M": jnp.array([[-1.6, 0.4], [0.3, -1.2]]),
        "c": jnp.float64(0.3),
        "a": jnp.array([0.7, -0.4]),
    }
    solve = lambda p: fixed_point(f, p, jnp.zeros(2), method=method, rtol=1e-13, atol=1e-13)
    x_star = solve(p)
    np.testing.assert_allclose(f(p, x_star), x_star, atol=1e-12)
    jac = jax.jacobian(lambda x: f(p, x))(x_star)
    assert np.max(np.abs(np.linalg.eigvals(jac))) > 1.4
    loss = lambda p: jnp.dot(jnp.array([1.0, -2.0]), solve(p)) + jnp.sum(solve(p) ** 2)
    g = jax.grad(loss)(p)
    g_fd = _central_differences(jax.jit(loss), p)
    for k in p:
        np.testing.assert_allclose(g[k], g_fd[k], rtol=1e-6, atol=1e-8)


def test_default_adjoint_stops_a_diverging_or_stalling_series_early(x64):
    """The derivative's series is watched: it is given up after a few dozen steps where
    it grows (df/dx = -1.5) or stalls (df/dx = -1), not run to `max_steps`."""
    calls = []

    def counted(slope):
        def f(a, x):
            jax.debug.callback(lambda: calls.append(None))
            return slope * x + a

        return f

    for slope in (-1.5, -1.0):
        solve = lambda a, f=counted(slope): fixed_point(
            f, a, jnp.float64(0.0), method="damped", max_steps=5000
        )
        calls.clear()
        jax.block_until_ready(solve(1.0))
        forward = len(calls)
        calls.clear()
        np.testing.assert_allclose(jax.grad(solve)(1.0), 1 / (1 - slope), rtol=1e-9)
        assert len(calls) - forward < 100, (slope, forward, len(calls))


@pytest.mark.slow  # GMRES is slow to compile
def test_default_adjoint_large_state_falls_back_to_gmres(x64):
    """300 unknowns (above the dense limit of 256), a third of them with df/dx = -1.5."""
    lam = jnp.asarray(np.where(np.arange(300) % 3 == 0, -1.5, 0.5))
    solve = lambda a: fixed_point(
        lambda a, x: lam * x + a, a, jnp.zeros(300), method="damped", rtol=1e-12, atol=1e-12
    )
    a = jnp.linspace(-1.0, 1.0, 300)
    np.testing.assert_allclose(jax.grad(lambda a: jnp.sum(solve(a)))(a), 1 / (1 - lam), rtol=1e-8)
    _, tangent = jax.jvp(solve, (a,), (jnp.ones(300),))
    np.testing.assert_allclose(tangent, 1 / (1 - lam), rtol=1e-8)


def test_default_adjoint_singular_system_is_reported(x64):
    """x = x + a (x - 1)^2 has the fixed point 1 for every a, where df/dx = 1: I - df/dx
    is singular, so neither the series nor the direct solve can give the derivative."""
    f = lambda a, x: x + a * (x - 1.0) ** 2
    solve = lambda a, **kw: fixed_point(f, a, jnp.float64(1.0), method="damped", **kw)
    assert float(solve(2.0)) == 1.0
    with pytest.raises(Exception, match=r"the direct solve \(division\) failed too"):
        jax.block_until_ready(jax.grad(solve)(2.0))
    # Without the check the derivative is NaN, not a number that looks right.
    g = jax.grad(lambda a: solve(a, throw=False, return_info=True)[0])(2.0)
    assert np.isnan(g)


# ---------------------------------------------------------------------------
# Methods, diagnostics, non-convergence.


def test_methods_agree_and_anderson_is_faster_on_a_slow_contraction(x64):
    f = lambda a, x: 0.99 * jnp.cos(x) * 0.5 + a  # slow linear convergence
    results = {
        m: fixed_point(f, 0.3, jnp.zeros(3), method=m, return_info=True, max_steps=5000)
        for m in ("iterate", "damped", "anderson")
    }
    xs = [r[0] for r in results.values()]
    for x in xs[1:]:
        np.testing.assert_allclose(x, xs[0], rtol=1e-8)
    assert int(results["anderson"][1].steps) < int(results["iterate"][1].steps)


def test_info_and_check_every(x64):
    x, info = newton_sqrt(jnp.float64(2.0), return_info=True)
    assert int(info.status) == SUCCESS and bool(info.converged)
    assert 3 <= int(info.steps) <= 10 and float(info.residual) < 1e-8
    x4, info4 = newton_sqrt(jnp.float64(2.0), return_info=True, check_every=4)
    np.testing.assert_allclose(x4, x, rtol=0, atol=1e-15)
    assert int(info4.steps) % 4 == 0


def test_check_every_default_follows_the_batch_size(x64):
    """None (the default) tests every step for a small solve, every 4 steps for a large
    batch under vmap (x_guess batched or not); the answers agree to the tolerance."""
    _, info = newton_sqrt(jnp.float64(2.0), return_info=True)
    assert int(info.steps) % 4 != 0  # Newton from 2 takes 5 steps
    a = jnp.linspace(1.0, 100.0, 2**14)

    def solve(a, x0):
        return fixed_point(lambda a, x: 0.5 * (x + a / x), a, x0, return_info=True)

    for x_guess in (a, jnp.float64(1.0)):
        in_axes = (0, 0 if jnp.ndim(x_guess) else None)
        root, info = jax.jit(jax.vmap(solve, in_axes=in_axes))(a, x_guess)
        assert np.all(np.asarray(info.steps) % 4 == 0)
        np.testing.assert_allclose(root, np.sqrt(a), rtol=1e-12)
    g = jax.jit(jax.vmap(jax.grad(newton_sqrt)))(a)
    np.testing.assert_allclose(g, D1(a), rtol=1e-10)


def test_traced_and_batched_tolerances(x64):
    solve = lambda a, tol: newton_sqrt(a, rtol=tol, atol=tol, return_info=True)
    x, info = jax.jit(solve)(2.0, 1e-12)
    np.testing.assert_allclose(x, np.sqrt(2.0), rtol=1e-12)
    x, info = jax.vmap(solve)(jnp.array([4.0, 9.0]), jnp.array([1e-12, 1e-2]))
    np.testing.assert_allclose(x, [2.0, 3.0], rtol=1e-2)
    assert np.all(np.asarray(info.status) == SUCCESS)


def test_non_convergence_raises_with_the_residual():
    with pytest.raises(Exception, match=r"fixed_point did not converge.*last residual"):
        jax.block_until_ready(newton_sqrt(1e6, max_steps=3))
    # Also when only the gradient is used, and for an element of a vmap batch.
    with pytest.raises(Exception, match=r"fixed_point did not converge"):
        jax.block_until_ready(jax.grad(lambda a: newton_sqrt(a, max_steps=3))(1e6))
    with pytest.raises(
        Exception, match=r"did not converge(.|\n)*vmap batch of shape \(3,\): \(1,\)"
    ):
        jax.block_until_ready(
            jax.vmap(lambda a: newton_sqrt(a, max_steps=5))(jnp.array([1.0, 1e6, 4.0]))
        )


def test_neumann_adjoint_that_diverges_raises():
    """Damping makes x = -2 x + a converge, but the Neumann series cannot (df/dx = -2):
    `adjoint="neumann"` raises, the default falls back to a direct solve."""
    f = lambda a, x: -2.0 * x + a
    solve = lambda a, **kw: fixed_point(f, a, 0.0, method="damped", **kw)
    np.testing.assert_allclose(solve(3.0), 1.0, rtol=1e-5)
    with pytest.raises(Exception, match="linear solve for the derivative"):
        jax.block_until_ready(jax.grad(lambda a: solve(a, adjoint="neumann"))(3.0))
    np.testing.assert_allclose(jax.grad(solve)(3.0), 1 / 3, rtol=1e-6)
    np.testing.assert_allclose(jax.grad(lambda a: solve(a, adjoint="dense"))(3.0), 1 / 3)


def test_non_convergence_status_per_vmap_element():
    a = jnp.array([1.0, 1e6, 4.0])
    x, info = jax.vmap(lambda a: newton_sqrt(a, max_steps=5, throw=False, return_info=True))(a)
    np.testing.assert_array_equal(info.status, [SUCCESS, MAX_STEPS, SUCCESS])
    np.testing.assert_allclose(np.asarray(x)[[0, 2]], [1.0, 2.0])


def test_throw_false_needs_return_info():
    with pytest.raises(ValueError, match=r"`throw=False`.*`return_info=True`"):
        newton_sqrt(2.0, throw=False)
    with pytest.raises(ValueError, match=r"`throw=False`.*`return_info=True`"):
        jax.grad(lambda a: newton_sqrt(a, throw=False))(2.0)
    x, info = newton_sqrt(2.0, throw=False, return_info=True)
    np.testing.assert_allclose(x, np.sqrt(2.0), rtol=1e-6)
    assert int(info.status) == SUCCESS


def test_nan_is_reported():
    x, info = fixed_point(
        lambda a, x: jnp.log(x) + a, -5.0, 1.0, throw=False, return_info=True, max_steps=50
    )
    assert int(info.status) == NONFINITE
    with pytest.raises(Exception, match="non-finite"):
        jax.block_until_ready(fixed_point(lambda a, x: jnp.log(x) + a, -5.0, 1.0, max_steps=50))


@pytest.mark.parametrize(
    "solve",
    [
        functools.partial(linear_solve.gmres, rtol=1e-12),
        linear_solve.GMRES(rtol=1e-12),
        linear_solve.Dense(),
    ],
    ids=["partial", "GMRES", "Dense"],
)
def test_custom_adjoint_solver(x64, solve):
    f = functools.partial(newton_sqrt, adjoint=solve)
    np.testing.assert_allclose(jax.grad(f)(2.0), D1(2.0))
    np.testing.assert_allclose(jax.hessian(f)(2.0), D2(2.0), rtol=1e-8)


# ---------------------------------------------------------------------------
# Bad input.


def test_bad_input_names_the_argument():
    with pytest.raises(TypeError, match="structure of `x_guess`"):
        fixed_point(lambda a, x: (x, x), 1.0, 1.0)
    with pytest.raises(TypeError, match="shape and dtype of `x_guess`"):
        fixed_point(lambda a, x: jnp.ones(3), 1.0, jnp.ones(2))
    with pytest.raises(TypeError, match="x_guess` leaf 0 has dtype int"):
        fixed_point(lambda a, x: x, 1.0, jnp.array([1, 2]))
    with pytest.raises(TypeError, match="`max_steps` must be a Python int"):
        jax.jit(lambda n: fixed_point(lambda a, x: 0.5 * x, 1.0, 1.0, max_steps=n))(5)
    with pytest.raises(ValueError, match="`method` must be one of"):
        newton_sqrt(2.0, method="newton")
    with pytest.raises(ValueError, match="`adjoint` must be None"):
        newton_sqrt(2.0, adjoint="lu")
    with pytest.raises(ValueError, match="`damping` must be in"):
        newton_sqrt(2.0, method="damped", damping=1.5)
