"""`odeint(jac=..., linear_solver=...)`: a user Jacobian and structured stage solves.

The derivatives are checked against central differences of SciPy's Radau at rtol 1e-12
(as in `test_odeint_stiff`), and each structured solve against the dense default on the
same steps.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from implicitdiff import linear_solve
from solvers import odeint

from .stiff_problems import PROBLEMS, load_references
from .test_odeint_stiff import _loss, _point, _rel

pytestmark = pytest.mark.usefixtures("fast_compiles")

REFS = load_references()
# BRUSS on 16 points stores u then v: u_i meets v_i 16 places away.
BRUSS_BAND = linear_solve.Banded(lower=16, upper=16, throw=False)


def rober_jac(y, t, p):
    k1, k2, k3 = p[0], p[1], p[2]
    return jnp.array(
        [
            [-k1, k3 * y[2], k3 * y[1]],
            [k1, -k3 * y[2] - 2 * k2 * y[1], -k3 * y[1]],
            [0.0, 2 * k2 * y[1], 0.0],
        ]
    )


CASES = [
    pytest.param("bruss16", "rodas5p", dict(linear_solver=BRUSS_BAND), id="bruss16-rodas5p-banded"),
    pytest.param(
        "bruss16", "kvaerno5", dict(linear_solver=BRUSS_BAND), id="bruss16-kvaerno5-banded",
        marks=pytest.mark.slow,
    ),
    pytest.param("rober", "rodas5p", dict(jac=rober_jac), id="rober-rodas5p-jac"),
    pytest.param(
        "rober", "kvaerno5", dict(jac=rober_jac), id="rober-kvaerno5-jac", marks=pytest.mark.slow
    ),
    pytest.param(
        "bruss16", "radau5", dict(linear_solver=BRUSS_BAND), id="bruss16-radau5-banded",
        marks=pytest.mark.slow,
    ),
    pytest.param(
        "rober", "radau5", dict(jac=rober_jac), id="rober-radau5-jac", marks=pytest.mark.slow
    ),
    pytest.param("rober", "bdf", dict(jac=rober_jac), id="rober-bdf-jac", marks=pytest.mark.slow),
    pytest.param(
        "bruss16", "bdf", dict(linear_solver=BRUSS_BAND), id="bruss16-bdf-banded",
        marks=pytest.mark.slow,
    ),
    pytest.param(
        "hires", "rodas5p", dict(linear_solver="gmres"), id="hires-rodas5p-gmres",
        marks=pytest.mark.slow,
    ),
]  # fmt: skip


@pytest.mark.parametrize(("name", "method", "kw"), CASES)
def test_derivatives_match_scipy_references(x64, name, method, kw):
    rtol = 1e-8
    loss, steps = _loss(name, rtol, method, **kw)
    dense_loss, dense_steps = _loss(name, rtol, method)
    p, y0 = _point(name)
    ref = REFS[name]
    n = int(jax.jit(steps)(p, y0))
    assert n == int(jax.jit(dense_steps)(p, y0))  # the same steps as the dense default
    bound = 10 * n * rtol
    value, (gp, gy) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(p, y0)
    assert _rel(value, ref["loss"]) < bound
    assert _rel(gp, ref["grad_p"]) < bound, (_rel(gp, ref["grad_p"]), bound)
    assert _rel(gy, ref["grad_y0"]) < bound, (_rel(gy, ref["grad_y0"]), bound)
    # The same computed solution as the dense default, so the same derivatives up to
    # the rounding of a different factorisation.
    dv, (dgp, dgy) = jax.jit(jax.value_and_grad(dense_loss, argnums=(0, 1)))(p, y0)
    assert _rel(value, dv) < 1e-10
    assert _rel(gp, dgp) < 1e-7 and _rel(gy, dgy) < 1e-7
    fp, fy = jax.jit(jax.jacfwd(loss, argnums=(0, 1)))(p, y0)
    np.testing.assert_allclose(fp, gp, rtol=1e-8, atol=1e-11 * np.max(np.abs(gp)))
    np.testing.assert_allclose(fy, gy, rtol=1e-8, atol=1e-11 * np.max(np.abs(gy)))


def test_user_jacobian_replaces_autodiff_in_y(x64):
    """`jac` is what the stage matrices use: the exact one reproduces the autodiff
    solve to rounding, a slightly wrong one moves the solution (within the tolerance,
    as a Rosenbrock method's error estimate allows), and the steps still come from
    `func`."""
    prob = PROBLEMS["rober"]
    ts = jnp.array([0.0, 1.0, 100.0])
    p, y0 = _point("rober")
    f = lambda y, t, p: prob["f"](y, t, p, jnp)  # noqa: E731

    def solve(jac):
        return odeint(f, y0, ts, p, method="rodas5p", rtol=1e-6, atol=1e-10, jac=jac)

    auto = np.asarray(solve(None))
    right = np.asarray(solve(rober_jac))
    wrong = np.asarray(solve(lambda y, t, p: 1.01 * rober_jac(y, t, p)))
    scale = np.abs(auto).max()
    assert np.abs(right - auto).max() < 1e-12 * scale
    assert 1e-11 * scale < np.abs(wrong - auto).max() < 1e-3 * scale


def test_radau5_field_through_a_callback_with_a_vmap_method(x64):
    """radau5 evaluates its stages as one `vmap`ped call of `func`: a field computed
    outside JAX (`jax.pure_callback`, with `jac` for its Jacobian) works when the
    callback says how to batch, and agrees with the same field written in JAX."""
    prob = PROBLEMS["rober"]
    ts = jnp.array([0.0, 1.0, 100.0])
    p, y0 = _point("rober")

    def host(y, t, p):
        return np.asarray(prob["f"](np.asarray(y), t, np.asarray(p), np), y.dtype)

    def f(y, t, p):
        shape = jax.ShapeDtypeStruct(y.shape, y.dtype)
        return jax.pure_callback(host, shape, y, t, p, vmap_method="sequential")

    kw = dict(method="radau5", rtol=1e-6, atol=1e-10, jac=rober_jac)
    got = np.asarray(odeint(f, y0, ts, p, **kw))
    want = np.asarray(odeint(lambda y, t, p: prob["f"](y, t, p, jnp), y0, ts, p, **kw))
    assert np.abs(got - want).max() < 1e-12 * np.abs(want).max()


@pytest.mark.slow
def test_user_jacobian_pytree_state_and_every_mode(x64):
    """A dict state, the Jacobian on the flattened state; grad, jacfwd, hessian and vmap
    against the closed form of `y' = A y`."""
    a = jnp.array([[-2.0, 1.0], [0.5, -3.0]])

    def f(y, t, s):
        v = jnp.stack([y["u"], y["w"]])
        dv = s * (a @ v)
        return {"u": dv[0], "w": dv[1]}

    def jac(y, t, s):
        return s * a

    y0 = {"u": jnp.asarray(1.0), "w": jnp.asarray(-0.5)}
    ts = jnp.array([0.0, 0.7])

    def loss(s, method):
        ys = odeint(f, y0, ts, s, method=method, rtol=1e-10, atol=1e-10, jac=jac)
        return ys["u"][-1] + 2 * ys["w"][-1]

    def exact(s):
        v = jax.scipy.linalg.expm(0.7 * s * a) @ jnp.array([1.0, -0.5])
        return v[0] + 2 * v[1]

    # (radau5 with `jac` is checked against SciPy above; dopri5 runs the backsolve
    # adjoint, which transposes the user Jacobian.)
    for method in ("rodas5p", "dopri5"):
        s = 1.3
        np.testing.assert_allclose(loss(s, method), exact(s), rtol=1e-8)
        np.testing.assert_allclose(jax.grad(loss)(s, method), jax.grad(exact)(s), rtol=1e-7)
        np.testing.assert_allclose(jax.jacfwd(loss)(s, method), jax.grad(exact)(s), rtol=1e-7)
    np.testing.assert_allclose(
        jax.hessian(loss)(1.3, "rodas5p"), jax.hessian(exact)(1.3), rtol=1e-6
    )
    ss = jnp.array([0.5, 1.0, 2.0])
    np.testing.assert_allclose(
        jax.vmap(lambda s: loss(s, "rodas5p"))(ss), jax.vmap(exact)(ss), rtol=1e-8
    )


@pytest.mark.parametrize(
    "method",
    [
        pytest.param("rodas5p", marks=pytest.mark.slow),
        "radau5",
        pytest.param("bdf", marks=pytest.mark.slow),
    ],
)
def test_banded_stage_solves_on_a_line_of_points(x64, method):
    """The Brusselator stored point by point (`(points, 2)`, bandwidths 2): the banded
    solve takes the dense solve's steps and gives its solution and gradient (radau5
    solves its coupled stage systems with the band widened)."""

    def bruss(y, t, a):
        n = y.shape[0]
        u, v = y[:, 0], y[:, 1]
        c = 0.02 * (n + 1) ** 2
        one = jnp.ones(1)
        ul, ur = jnp.concatenate([one, u[:-1]]), jnp.concatenate([u[1:], one])
        vl, vr = jnp.concatenate([3 * one, v[:-1]]), jnp.concatenate([v[1:], 3 * one])
        du = a + u * u * v - 4 * u + c * (ul - 2 * u + ur)
        dv = 3 * u - u * u * v + c * (vl - 2 * v + vr)
        return jnp.stack([du, dv], axis=1)

    x = jnp.arange(1, 41) / 41
    y0 = jnp.stack([1 + jnp.sin(2 * jnp.pi * x), 3 * jnp.ones(40)], axis=1)
    ts = jnp.array([0.0, 2.0, 5.0])

    def run(a, solver):
        return odeint(
            bruss, y0, ts, a, method=method, rtol=1e-7, atol=1e-7, linear_solver=solver,
            return_info=True,
        )  # fmt: skip

    band = linear_solve.Banded(lower=2, upper=2, throw=False)
    (yb, ib), (yd, idn) = (jax.jit(lambda a, s=s: run(a, s))(1.0) for s in (band, None))
    assert int(ib.steps) == int(idn.steps)
    np.testing.assert_allclose(yb, yd, rtol=1e-11, atol=1e-12)
    g = lambda solver: jax.jit(jax.grad(lambda a: jnp.sum(run(a, solver)[0][-1])))(1.0)  # noqa: E731
    np.testing.assert_allclose(g(band), g(None), rtol=1e-8)
    with pytest.raises((RuntimeError, ValueError), match=r"outside this band"):
        jax.block_until_ready(run(1.0, linear_solve.Banded(lower=1, upper=1, throw=False)))


@pytest.mark.parametrize(
    "method",
    [
        pytest.param("bdf", marks=pytest.mark.slow),
        "radau5",
        pytest.param("rodas5p", marks=pytest.mark.slow),
    ],
)
def test_sparse_stage_solves_on_copies_stored_field_by_field(x64, method):
    """Six copies of ROBER stored field by field (`(3, 6)`: bandwidth 12 as stored).
    `Sparse` with the pattern found by `sparsity_pattern` reorders it into blocks and
    builds the matrix from 3 products; it takes the dense solve's steps and gives its
    solution and gradient (radau5 solves its coupled stage systems with the pattern
    widened)."""

    def rober(y, t, k):
        a, b, c = y[0], y[1], y[2]
        return jnp.stack(
            [-k[0] * a + k[2] * b * c, k[0] * a - k[2] * b * c - k[1] * b**2, k[1] * b**2]
        )

    copies = 6
    y0 = jnp.zeros((3, copies)).at[0].set(1.0 + 0.1 * jnp.arange(copies))
    ts = jnp.array([0.0, 1.0, 100.0])
    k0 = jnp.array([0.04, 3e7, 1e4])
    pattern = linear_solve.sparsity_pattern(lambda y: rober(y, 0.0, k0), y0)
    sparse = linear_solve.Sparse(pattern, throw=False)
    assert sparse.pattern.num_colours == 3 and sparse.pattern.lower <= 2
    assert sparse.pattern.blocks.shape == (copies, 3)  # factored block by block

    def run(k, solver):
        return odeint(
            rober, y0, ts, k, method=method, rtol=1e-7, atol=1e-10, linear_solver=solver,
            return_info=True,
        )  # fmt: skip

    (ys, info_s), (yd, info_d) = (jax.jit(lambda k, s=s: run(k, s))(k0) for s in (sparse, None))
    assert int(info_s.steps) == int(info_d.steps)
    np.testing.assert_allclose(ys, yd, rtol=1e-10, atol=1e-14)
    g = lambda solver: jax.jit(jax.grad(lambda k: jnp.sum(run(k, solver)[0][-1, 1])))(k0)  # noqa: E731
    np.testing.assert_allclose(g(sparse), g(None), rtol=1e-8)


def _line(y):
    # Two fields per point of a line, stored point by point: a band of 2 each side.
    u, v = y[0::2], y[1::2]
    lap = lambda w: jnp.concatenate([w[1:2], w[2:] + w[:-2], w[-2:-1]]) - 2 * w  # noqa: E731
    du = 1 + u * u * v - 4.4 * u + 0.5 * lap(u)
    dv = 3.4 * u - u * u * v + 0.5 * lap(v)
    return jnp.stack([du, dv], axis=1).reshape(-1)


def test_default_stage_solver_by_size(x64):
    """Up to `SPARSE_STAGE_MIN_STATES` states the default stays dense; above, it is
    `Sparse` on the pattern traced from `func` (with a mass matrix's entries), or
    dense without a warning up to `DENSE_STAGE_MAX_STATES` when there is no band."""
    import warnings

    from solvers.ode.mass import MassMatrix
    from solvers.ode.methods import resolve_method
    from solvers.ode.odeint import SPARSE_STAGE_MIN_STATES, _default_stage_solver

    n = SPARSE_STAGE_MIN_STATES + 2
    bdf = resolve_method("odeint", "bdf")
    line = lambda y, t: _line(y)  # noqa: E731
    small = _default_stage_solver(bdf, line, jnp.ones(n - 2), (0.0,), False)
    assert isinstance(small.linear_solver, linear_solve.Dense)
    chosen = _default_stage_solver(bdf, line, jnp.ones(n), (0.0,), False).linear_solver
    assert isinstance(chosen, linear_solve.Sparse) and not chosen.throw
    assert chosen.pattern == linear_solve.sparsity_pattern(_line, jnp.ones(n), method="probe")
    assert (chosen.pattern.lower, chosen.pattern.upper) == (2, 2)
    # A full mass matrix's entries join the pattern.
    mass = np.eye(n)
    mass[0, n - 1] = 1.0
    with_mass = dataclasses.replace(bdf, mass_matrix=MassMatrix(mass, n))
    pattern = _default_stage_solver(with_mass, line, jnp.ones(n), (0.0,), False)
    pattern = pattern.linear_solver.pattern
    assert (0, n - 1) in set(zip(pattern.rows.tolist(), pattern.cols.tolist()))

    # A periodic 2-D grid: its reordered band is about 4k wide for 2k^2 states, so
    # sparse at 16 x 16 (512 states, band 125) and dense at 8 x 8 (128, band 61).
    def grid(y, t):
        z = y.reshape(int(np.sqrt(y.size // 2)), -1, 2)
        lap = sum(jnp.roll(z, s, a) for s in (1, -1) for a in (0, 1)) - 4 * z
        return (lap + z[..., ::-1] * z).reshape(-1)

    for k, expected in ((16, linear_solve.Sparse), (8, linear_solve.Dense)):
        on_grid = _default_stage_solver(bdf, grid, jnp.ones(2 * k * k), (0.0,), False)
        assert type(on_grid.linear_solver) is expected, k
    # The same stencil written as a convolution (24 x 24, zero boundaries).
    stencil = np.array([[0.0, 1.0, 0.0], [1.0, -4.0, 1.0], [0.0, 1.0, 0.0]])
    heat = lambda y, t: jax.scipy.signal.convolve2d(y.reshape(24, 24), stencil, "same").ravel()  # noqa: E731
    conv = _default_stage_solver(bdf, heat, jnp.ones(576), (0.0,), False).linear_solver
    assert isinstance(conv, linear_solve.Sparse) and conv.pattern.nnz == 576 * 5 - 4 * 24
    # A dense Jacobian of a few hundred states: dense, silently.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dense = _default_stage_solver(
            bdf, lambda y, t: y * jnp.sum(y), jnp.ones(300), (0.0,), False
        )
    assert isinstance(dense.linear_solver, linear_solve.Dense)


@pytest.mark.parametrize(
    "method", [pytest.param(m, marks=pytest.mark.slow) for m in ("bdf", "rodas5p")]
)
def test_default_stage_solver_on_a_large_system(x64, method):
    """A 1040-state reaction-diffusion line with the default stage solver: no warning,
    the same solution and gradient as the explicit band."""
    import warnings

    n = 1040
    x = jnp.arange(n // 2) / (n // 2)
    y0 = jnp.stack([1 + jnp.sin(2 * jnp.pi * x), jnp.full(n // 2, 3.0)], axis=1).reshape(-1)
    ts = jnp.array([0.0, 0.5])
    band = linear_solve.Banded(2, 2, throw=False)

    def run(scale, solver, method):
        f = lambda y, t, s: s * _line(y)  # noqa: E731
        return odeint(f, y0, ts, scale, method=method, rtol=1e-6, atol=1e-8, linear_solver=solver)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        auto = jax.jit(run, static_argnums=(1, 2))(1.0, None, method)
    np.testing.assert_allclose(auto, run(1.0, band, method), rtol=1e-12, atol=1e-12)
    loss = lambda s, solver: jnp.sum(run(s, solver, method)[-1] ** 2)  # noqa: E731
    np.testing.assert_allclose(jax.grad(loss)(1.0, None), jax.grad(loss)(1.0, band), rtol=1e-10)


def test_a_large_system_without_sparse_structure_warns():
    """Past `DENSE_STAGE_MAX_STATES` states, a Jacobian with no narrow band after
    reordering keeps the dense default and warns, naming the structured solvers; an
    explicit solver, or an explicit method, does not."""
    import warnings

    from solvers.ode.odeint import DENSE_STAGE_MAX_STATES

    ts = jnp.array([0.0, 1.0])
    n = DENSE_STAGE_MAX_STATES + 1
    big = jnp.ones(n)
    mean_field = lambda y, t: -y + jnp.mean(y)  # noqa: E731
    with pytest.warns(UserWarning, match=rf"dense {n} x {n} stage matrix.*dense as traced.*Sparse"):
        jax.eval_shape(lambda y: odeint(mean_field, y, ts, method="bdf"), big)
    # Each state coupled to two others at random (a random graph, an expander): sparse,
    # but no narrow band in any order.
    far = [np.random.default_rng(s).permutation(n) for s in (0, 1)]
    scattered = lambda y, t: -y + 0.1 * (y[far[0]] + y[far[1]])  # noqa: E731
    with pytest.warns(UserWarning, match=r"wide after reordering"):
        jax.eval_shape(lambda y: odeint(scattered, y, ts, method="rodas5p"), big)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jax.eval_shape(lambda y: odeint(mean_field, y, ts, method="rodas5p"), big[:-1])
        jax.eval_shape(
            lambda y: odeint(mean_field, y, ts, method="bdf", linear_solver=linear_solve.Dense()),
            big,
        )
        jax.eval_shape(lambda y: odeint(mean_field, y, ts, method="dopri5"), big)


def test_bad_jac_and_linear_solver_arguments(x64):
    f = lambda y, t: -y  # noqa: E731
    y0, ts = jnp.ones(3), jnp.array([0.0, 1.0])
    with pytest.raises(TypeError, match=r"`jac\(y0, t\[0\], \*args\)` must return"):
        odeint(f, y0, ts, method="rodas5p", jac=lambda y, t: jnp.ones(3))
    with pytest.raises(TypeError, match=r"`jac` must be callable"):
        odeint(f, y0, ts, method="rodas5p", jac=1.0)
    with pytest.raises(ValueError, match=r"`linear_solver` is for the implicit methods"):
        odeint(f, y0, ts, method="dopri5", linear_solver="gmres")
    with pytest.raises(TypeError, match=r"must be a linear_solve.LinearSolver"):
        odeint(f, y0, ts, method="rodas5p", linear_solver=lambda mv, b: b)
    band = linear_solve.Banded(1, 1, throw=False)
    with pytest.raises(ValueError, match=r"adjoint='backsolve' integrates the state"):
        odeint(f, y0, ts, method="bdf", linear_solver=band, adjoint="backsolve")
    with pytest.raises(ValueError, match=r"odeint: `linear_solver` must be"):
        odeint(f, y0, ts, method="rodas5p", linear_solver="nope")


def test_default_stage_solver_pattern_holds_at_every_time(x64):
    """The pattern is traced with `t` (and `args`) unknown: a coupling whose coefficient
    vanishes at `t[0]` is kept, and the default sparse solve matches the band."""
    import warnings

    n = 1002
    shift = np.eye(n, k=1)
    func = lambda y, t: -y + (t * shift) @ y  # noqa: E731
    ts = jnp.array([0.0, 1.0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ys = odeint(func, jnp.ones(n), ts, method="radau5", rtol=1e-6, atol=1e-8)
    band = linear_solve.Banded(0, 1, throw=False)
    yb = odeint(func, jnp.ones(n), ts, method="radau5", rtol=1e-6, atol=1e-8, linear_solver=band)
    np.testing.assert_allclose(ys, yb, rtol=1e-12, atol=1e-14)


def test_chunk_size_follows_the_stage_solver(monkeypatch):
    """The adjoint sweep linearises `LINEARIZE_CHUNK` steps at once for one solve of
    at least `LINEARIZE_MIN_STATES` states, unless (on CPU) a solver its step's
    linearisation factors with (`linearisation_solvers`: the stage solver, for radau5
    the solver of its coupled stages) factors a batch badly (`factors_in_batches_at`: a wide
    band, or a long narrow one, factored by partitions)."""
    from solvers.ode.adjoints import sweep
    from solvers.ode.methods import resolve_method

    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")

    def with_solver(name, solver):
        return dataclasses.replace(resolve_method("odeint", name), linear_solver=solver)

    narrow, wide = linear_solve.Banded(2, 2), linear_solve.Banded(20, 20)
    many = sweep.LINEARIZE_MIN_STATES
    assert sweep.chunk_size(with_solver("bdf", narrow), 1, many, 64) == 8
    assert sweep.chunk_size(with_solver("bdf", narrow), 1, many, 4) == 4  # divides `every`
    assert sweep.chunk_size(with_solver("bdf", narrow), 1, many - 1, 64) == 1
    assert sweep.chunk_size(with_solver("bdf", narrow), 2, many, 64) == 1  # a vmap batch
    assert sweep.chunk_size(resolve_method("odeint", "tsit5"), 1, many, 64) == 8
    # From 512 unknowns a (2, 2) band is factored by partitions.
    assert sweep.chunk_size(with_solver("bdf", narrow), 1, 511, 64) == 8
    assert sweep.chunk_size(with_solver("bdf", narrow), 1, 512, 64) == 1
    line = np.arange(600)
    pairs = linear_solve.Sparse((np.r_[line, line[1:]], np.r_[line, line[:-1]]))
    assert sweep.chunk_size(with_solver("rodas5p", pairs), 1, 600, 64) == 1
    blocks = linear_solve.Sparse((line, line ^ 1))  # 300 pairs: dense LU of each
    assert sweep.chunk_size(with_solver("rodas5p", blocks), 1, 600, 64) == 8
    for name in ("bdf", "rodas5p", "kvaerno5", "radau5"):
        assert sweep.chunk_size(with_solver(name, wide), 1, many, 64) == 1, name
    # radau5's derivative solves its three stages coupled, in a band three times as wide.
    assert sweep.chunk_size(with_solver("rodas5p", linear_solve.Banded(6, 6)), 1, many, 64) == 8
    assert sweep.chunk_size(with_solver("radau5", linear_solve.Banded(6, 6)), 1, many, 64) == 1
    # Its replayed step takes its stages as given and factors only the coupled band:
    # a (2, 2) band of 512 unknowns is factored by partitions, its coupled band (8, 8)
    # of 1536 is not and batches well.
    assert not narrow.factors_in_batches_at(512)
    assert narrow.coupled(3).factors_in_batches_at(3 * 512)
    assert sweep.chunk_size(with_solver("radau5", narrow), 1, 512, 64) == 8
    # Elsewhere the batch is kept whatever the solver.
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert sweep.chunk_size(with_solver("bdf", wide), 1, many, 64) == 8


@pytest.mark.slow
@pytest.mark.parametrize("method", ["bdf", "kvaerno5"])
def test_wide_band_gradient_linearised_step_by_step(x64, monkeypatch, method):
    """A stage solver whose factorisation batches badly (a periodic 8 x 8 grid: no narrow
    band after reordering) is linearised one step at a time by the adjoint sweep; the
    gradient of `w . y(T)`, `y(T) = expm(T A(p)) y0`, matches SciPy's `expm_frechet`,
    and the one with eight steps linearised at a time."""
    import scipy.linalg

    from solvers.ode.adjoints import sweep
    from solvers.ode.methods import resolve_method

    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")  # the rule is for CPU
    k = 8
    idx = np.arange(k * k).reshape(k, k)
    lap = -4 * np.eye(k * k)
    for s, a in ((1, 0), (-1, 0), (1, 1), (-1, 1)):
        lap[idx.ravel(), np.roll(idx, s, a).ravel()] += 1
    # Two fields per point, stored point by point, diffusing and exchanging.
    L = np.kron(lap, np.eye(2)) * k**2 / 4
    R = np.kron(np.eye(k * k), np.array([[-1.0, 0.5], [0.5, -2.0]]))
    n = 2 * k * k
    y0 = np.cos(np.arange(n) * 0.7) + 1.5
    w = np.sin(np.arange(n) * 0.3)
    t1 = 0.5

    def f(y, t, p):
        return p * (jnp.asarray(L) @ y) + jnp.asarray(R) @ y

    pattern = linear_solve.sparsity_pattern(lambda y: f(y, 0.0, 1.0), jnp.asarray(y0))
    solver = linear_solve.Sparse(pattern, throw=False)
    stepper = dataclasses.replace(resolve_method("odeint", method), linear_solver=solver)
    assert sweep.chunk_size(stepper, 1, n, 64) == 1

    def loss(p):
        ys = odeint(f, jnp.asarray(y0), jnp.array([0.0, t1]), p, method=method, rtol=1e-10,
                    atol=1e-10, linear_solver=solver)  # fmt: skip
        return jnp.dot(jnp.asarray(w), ys[-1])

    p = 0.7
    rule, chunks = sweep.chunk_size, []
    monkeypatch.setattr(sweep, "chunk_size", lambda *a: chunks.append(rule(*a)) or chunks[-1])
    g = jax.grad(loss)(p)
    assert chunks == [1]  # the sweep asked, and linearised step by step
    eight = lambda method, size, n, every: math.gcd(every, sweep.LINEARIZE_CHUNK)  # noqa: E731
    monkeypatch.setattr(sweep, "chunk_size", eight)
    g_chunked = jax.grad(loss)(p)
    np.testing.assert_allclose(g, g_chunked, rtol=0, atol=1e-12)
    A = p * L + R
    exact = w @ scipy.linalg.expm_frechet(t1 * A, t1 * L, compute_expm=False) @ y0
    # The gradient (-3.4e-3) cancels terms a hundred times larger: compare absolutely,
    # to twenty times the solve's tolerance (errors at T and of the gradient: bdf
    # 2.7e-10 and 6.4e-10, kvaerno5 2.8e-10 and 4.0e-10).
    np.testing.assert_allclose(g, exact, rtol=0, atol=2e-9)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["bdf", "rodas5p", "radau5"])
def test_partitioned_band_on_a_long_line(x64, monkeypatch, method):
    """A long line of points with two fields each (600 states, bandwidths 2): the band
    is factored by partitions of its rows. `y(T) = expm(T A(p)) y0` and the gradient
    and forward derivative of `w . y(T)` match SciPy's `expm` and `expm_frechet`; the
    solve takes the steps of the row-by-row factorisation; a batch of solves (of one
    too) factors row by row, in the solve and its adjoint."""
    import scipy.linalg

    from implicitdiff.linear_solve import _band_partitions

    points = 300
    lap = (np.eye(points, k=1) + np.eye(points, k=-1) - 2 * np.eye(points)) * 0.02 * points**2
    L = np.kron(lap, np.eye(2))
    R = np.kron(np.eye(points), np.array([[-1.0, 0.5], [0.5, -2.0]]))
    n = 2 * points
    y0 = np.cos(np.arange(n) * 0.7) + 1.5
    w = np.sin(np.arange(n) * 0.3)
    t1, p = 0.5, 0.7
    band = linear_solve.Banded(2, 2, throw=False)
    assert _band_partitions.partitions(n, 2, 2) > 1

    def run(p):
        f = lambda y, t, p: p * (jnp.asarray(L) @ y) + jnp.asarray(R) @ y  # noqa: E731
        return odeint(f, jnp.asarray(y0), jnp.array([0.0, t1]), p, method=method, rtol=1e-10,
                      atol=1e-10, linear_solver=band, return_info=True)  # fmt: skip

    traced = []
    factor = _band_partitions.band_lu_partitioned
    monkeypatch.setattr(
        _band_partitions, "band_lu_partitioned", lambda *a: traced.append(a[1:]) or factor(*a)
    )
    ys, info = jax.jit(run)(p)
    assert traced  # the stage solves went through the partitions
    loss = lambda p: jnp.dot(jnp.asarray(w), run(p)[0][-1])  # noqa: E731
    g, gf = jax.jit(jax.grad(loss))(p), jax.jit(jax.jacfwd(loss))(p)
    A = p * L + R
    np.testing.assert_allclose(ys[-1], scipy.linalg.expm(t1 * A) @ y0, rtol=0, atol=1e-8)
    exact = w @ scipy.linalg.expm_frechet(t1 * A, t1 * L, compute_expm=False) @ y0
    np.testing.assert_allclose(g, exact, rtol=1e-7, atol=1e-8)
    np.testing.assert_allclose(gf, g, rtol=1e-8)
    # A batch of solves factors each element's band row by row, in the solve and its
    # adjoint alike (what the forward records, the adjoint replays).
    traced.clear()
    gs = jax.jit(jax.vmap(jax.grad(loss)))(jnp.array([p, 0.8]))
    assert not traced
    np.testing.assert_allclose(gs[0], g, rtol=1e-10)
    # A batch of one too, through the adjoint's batched sweep (`grad` of `vmap`).
    g1 = jax.jit(jax.grad(lambda ps: jnp.sum(jax.vmap(loss)(ps))))(jnp.array([p]))
    assert not traced
    np.testing.assert_allclose(g1[0], g, rtol=1e-10)
    A = 0.8 * L + R
    exact = w @ scipy.linalg.expm_frechet(t1 * A, t1 * L, compute_expm=False) @ y0
    np.testing.assert_allclose(gs[1], exact, rtol=1e-7, atol=1e-8)

    monkeypatch.setattr(_band_partitions, "PARTITIONED_MAX_COUPLING", 0)
    traced.clear()
    by_rows, info_rows = jax.jit(lambda p: run(p))(p)
    assert not traced
    assert int(info_rows.steps) == int(info.steps)
    np.testing.assert_allclose(by_rows, ys, rtol=1e-12, atol=1e-12)
