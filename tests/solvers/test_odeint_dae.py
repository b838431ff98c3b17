"""`odeint(mass_matrix=...)`: index-1 differential-algebraic systems `M y' = f`.

Against independent answers: the Robertson problem in DAE form (`y1 + y2 + y3 = 1`)
against SciPy's Radau on the ODE form at rtol 1e-12 (the same solution), and a linear
index-1 system with a closed form, in semi-explicit form and mixed by constant
matrices into a full singular `M`. Every derivative mode, `vmap`, the consistent
initialisation and its derivative, and the errors.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from implicitdiff import linear_solve
from solvers import odeint
from solvers.ode import MassMatrix
from solvers.ode.methods import Radau5

from .stiff_problems import PROBLEMS, load_references

pytestmark = pytest.mark.usefixtures("fast_compiles")

REFS = load_references()
METHODS = ("radau5", "rodas5p", "rodas4", "bdf")
# Rodas4 shares Rodas5P's Rosenbrock code: its longer cases run with the slow tests.
SOME_METHODS = ("radau5", "rodas5p", pytest.param("rodas4", marks=pytest.mark.slow), "bdf")


def _rel(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def robertson_dae(y, t, p):
    k1, k2, k3 = p
    y1, y2, y3 = y
    return jnp.array(
        [
            -k1 * y1 + k3 * y2 * y3,
            k1 * y1 - k3 * y2 * y3 - k2 * y2**2,
            y1 + y2 + y3 - 1.0,
        ]
    )


ROBER_MASS = np.array([1.0, 1.0, 0.0])


def _rober_loss(method, rtol=1e-8, **kw):
    """The loss of `tests/solvers/stiff_problems.py`'s `rober`, on the DAE form."""
    prob = PROBLEMS["rober"]
    ts, w = jnp.asarray(prob["ts"]), jnp.asarray(prob["w"])

    def solve(p, y0, **more):
        return odeint(
            robertson_dae, y0, ts, p, method=method, rtol=rtol, atol=rtol * prob["atol_factor"],
            mxstep=1e6, mass_matrix=ROBER_MASS, max_steps=16384, **kw, **more,
        )  # fmt: skip

    def loss(p, y0):
        return jnp.sum(solve(p, y0)[1:] * w)

    def steps(p, y0):
        return solve(p, y0, return_info=True)[1].steps

    return loss, steps, (jnp.asarray(prob["p"]), jnp.asarray(prob["y0"]))


# radau5, rodas5p and bdf once each in the main suite between this test and the next;
# the rest (rodas4 in both) with the slow tests.
@pytest.mark.parametrize(
    "method",
    [*(pytest.param(m, marks=pytest.mark.slow) for m in ("radau5", "rodas5p", "rodas4")), "bdf"],
)
def test_robertson_dae_matches_the_ode_reference(x64, method):
    """The DAE form has the ODE form's solution: its loss and gradient in the rate
    constants match SciPy's at rtol 1e-12 (within `10 n rtol`, as the ODE tests); the
    gradient in `y0` is the ODE's along the constraint (moving `y_i` moves `y3` by
    the opposite amount, which the consistent initialisation does); forward and
    reverse mode agree to rounding."""
    rtol = 1e-8
    loss, steps, (p, y0) = _rober_loss(method, rtol)
    ref = REFS["rober"]
    bound = 10 * int(jax.jit(steps)(p, y0)) * rtol
    value, (gp, gy) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(p, y0)
    assert _rel(value, ref["loss"]) < bound
    assert _rel(gp, ref["grad_p"]) < bound, (_rel(gp, ref["grad_p"]), bound)
    ry = np.asarray(ref["grad_y0"])
    along = np.array([ry[0] - ry[2], ry[1] - ry[2], 0.0])
    assert _rel(gy, along) < bound, (gy, along)
    assert gy[2] == 0.0  # y3 is corrected away whatever it was
    # BDF's history couples its steps' roundings: its two modes agree to 1.3e-8 here,
    # the one-step methods to 1e-8.
    modes = 1e-7 if method == "bdf" else 1e-8
    fp, fy = jax.jit(jax.jacfwd(loss, argnums=(0, 1)))(p, y0)
    np.testing.assert_allclose(fp, gp, rtol=modes)
    np.testing.assert_allclose(fy, gy, rtol=modes, atol=1e-12 * np.max(np.abs(gy)))


@pytest.mark.parametrize("method", METHODS)
def test_robertson_dae_keeps_its_constraint(x64, method):
    prob = PROBLEMS["rober"]
    ys = odeint(
        robertson_dae, jnp.asarray(prob["y0"]), jnp.asarray(prob["ts"]), jnp.asarray(prob["p"]),
        method=method, rtol=1e-6, atol=1e-10, mass_matrix=ROBER_MASS,
    )  # fmt: skip
    np.testing.assert_allclose(jnp.sum(ys, axis=1), 1.0, atol=1e-13)
    assert np.all(np.asarray(ys) > -1e-9)


# A linear index-1 system with a closed form: y' = -k y + z, 0 = z + y - c, so
# z = c - y and y' = -(k + 1) y + c.


def linear_dae(u, t, k, c):
    y, z = u
    return jnp.array([-k * y + z, z + y - c])


def linear_closed_form(ts, k, c, y0):
    a = k + 1.0
    y = c / a + (y0 - c / a) * jnp.exp(-a * ts)
    return jnp.stack([y, c - y], axis=1)


TS = np.array([0.0, 0.3, 1.0, 2.5])


@pytest.mark.parametrize(
    "method",
    ["radau5", "rodas5p", *(pytest.param(m, marks=pytest.mark.slow) for m in ("rodas4", "bdf"))],
)
def test_linear_dae_and_its_derivatives_match_the_closed_form(x64, method):
    def solve(k, c, y0):
        u0 = jnp.array([y0, 0.0])  # z inconsistent: corrected to c - y0
        return odeint(
            linear_dae, u0, TS, k, c, method=method, rtol=1e-10, atol=1e-12,
            mass_matrix=np.diag([1.0, 0.0]),
        )  # fmt: skip

    args = (0.7, 1.3, 2.0)
    np.testing.assert_allclose(solve(*args), linear_closed_form(TS, *args), rtol=1e-7, atol=1e-9)
    argnums = (0, 1, 2)
    rev = jax.jit(jax.jacrev(solve, argnums))(*args)
    fwd = jax.jit(jax.jacfwd(solve, argnums))(*args)
    exact = jax.jacfwd(lambda k, c, y0: linear_closed_form(TS, k, c, y0), argnums)(*args)
    for r, f, e in zip(rev, fwd, exact):
        np.testing.assert_allclose(r, e, rtol=1e-6, atol=1e-8)
        np.testing.assert_allclose(f, r, rtol=1e-9, atol=1e-12)


def test_linear_dae_hessian_matches_the_closed_form(x64):
    def last(kc, method):
        u0 = jnp.array([2.0, 0.0])
        return odeint(
            linear_dae, u0, TS, kc[0], kc[1], method=method, rtol=1e-10, atol=1e-12,
            mass_matrix=np.array([1.0, 0.0]),
        )[-1, 0]  # fmt: skip

    kc = jnp.array([0.7, 1.3])
    exact = jax.hessian(lambda kc: linear_closed_form(TS, kc[0], kc[1], 2.0)[-1, 0])(kc)
    got = jax.jit(jax.hessian(last), static_argnums=1)(kc, "radau5")
    np.testing.assert_allclose(got, exact, rtol=1e-6, atol=1e-9)


# The same system in other unknowns and other equations: x = S^-1 u, and the
# equations mixed by R, so that R diag(1, 0) S x' = R f(S x): a full, singular M.
_R = np.array([[2.0, 1.0], [1.0, 1.0]])
_S = np.array([[1.0, 0.5], [-0.5, 1.0]])
FULL_MASS = _R @ np.diag([1.0, 0.0]) @ _S


def mixed_dae(x, t, k, c):
    return jnp.asarray(_R) @ linear_dae(jnp.asarray(_S) @ x, t, k, c)


@pytest.mark.parametrize("method", [*METHODS[:-1], pytest.param("bdf", marks=pytest.mark.slow)])
def test_a_full_singular_mass_matrix(x64, method):
    """`M` neither diagonal nor with zero rows: the algebraic equation is `L f = 0` for
    the left null vector `L`, the algebraic direction `M`'s null vector; both are
    found from `M` for the consistent initialisation."""
    s_inv = jnp.asarray(np.linalg.inv(_S))

    def solve(k, c, y0):
        x0 = s_inv @ jnp.array([y0, 0.0])  # inconsistent
        return odeint(
            mixed_dae, x0, TS, k, c, method=method, rtol=1e-10, atol=1e-12,
            mass_matrix=FULL_MASS,
        ) @ jnp.asarray(_S).T  # fmt: skip

    args = (0.7, 1.3, 2.0)
    # The correction moves x0 along M's null vector, which changes y0 too; the
    # closed form starts from the corrected point.
    u = solve(*args)
    np.testing.assert_allclose(u, linear_closed_form(TS, 0.7, 1.3, u[0, 0]), rtol=1e-7, atol=1e-9)
    np.testing.assert_allclose(u[:, 0] + u[:, 1], 1.3, rtol=1e-10)
    g = jax.jit(jax.grad(lambda k: solve(k, 1.3, 2.0)[-1, 0]))(0.7)
    e = jax.grad(lambda k: linear_closed_form(TS, k, 1.3, u[0, 0])[-1, 0])(0.7)
    np.testing.assert_allclose(g, e, rtol=1e-6)


@pytest.mark.parametrize("method", [pytest.param("radau5", marks=pytest.mark.slow), "bdf"])
def test_vmap_keeps_each_elements_steps(x64, method):
    ks = jnp.array([0.5, 2.0, 40.0])

    def solve(k):
        return odeint(
            linear_dae, jnp.array([2.0, -0.7]), TS, k, 1.3, method=method, rtol=1e-8,
            atol=1e-10, mass_matrix=np.array([1.0, 0.0]),
        )  # fmt: skip

    batched = jax.jit(jax.vmap(solve))(ks)
    one_by_one = jnp.stack([solve(k) for k in ks])
    np.testing.assert_allclose(batched, one_by_one, rtol=1e-10, atol=1e-12)
    gb = jax.jit(jax.vmap(jax.grad(lambda k: solve(k)[-1, 0])))(ks)
    exact = jax.vmap(jax.grad(lambda k: linear_closed_form(TS, k, 1.3, 2.0)[-1, 0]))(ks)
    np.testing.assert_allclose(gb, exact, rtol=1e-5)


def test_consistent_y0_false_takes_y0_as_given(x64):
    m = np.array([1.0, 0.0])
    u0 = jnp.array([2.0, 0.0])  # inconsistent: z should be c - y = -0.7
    kw = dict(method="radau5", rtol=1e-10, atol=1e-12, mass_matrix=m)
    ys = odeint(linear_dae, u0, TS, 0.7, 1.3, **kw)
    np.testing.assert_allclose(ys[0], jnp.array([2.0, -0.7]), rtol=1e-12)
    ys = odeint(linear_dae, u0, TS, 0.7, 1.3, **kw, consistent_y0=False)
    np.testing.assert_array_equal(ys[0], u0)
    # The first step puts the algebraic unknown on its equation.
    np.testing.assert_allclose(ys[1:, 0] + ys[1:, 1], 1.3, rtol=1e-9)


def test_an_unsolvable_algebraic_equation_is_reported(x64):
    def no_root(u, t):
        return jnp.array([-u[0], u[1] ** 2 + 1.0])  # 0 = z^2 + 1 has no real root

    kw = dict(method="radau5", mass_matrix=np.array([1.0, 0.0]))
    with pytest.raises(Exception, match="consistent initialisation"):
        jax.block_until_ready(odeint(no_root, jnp.array([1.0, 0.5]), TS, **kw))
    ys, info = odeint(no_root, jnp.array([1.0, 0.5]), TS, **kw, throw=False, return_info=True)
    assert int(info.status) != 0 and np.all(np.isnan(np.asarray(ys[1:])))


@pytest.mark.parametrize("method", ["radau5", "rodas5p", "bdf"])
def test_a_diagonal_mass_other_than_ones(x64, method):
    """`2 y' = -2 k y + 2 z` is the linear system with its first equation doubled."""

    def doubled(u, t, k, c):
        return linear_dae(u, t, k, c) * jnp.array([2.0, 1.0])

    ys = odeint(doubled, jnp.array([2.0, 0.0]), TS, 0.7, 1.3, method=method, rtol=1e-10,
                atol=1e-12, mass_matrix=np.array([2.0, 0.0]))  # fmt: skip
    np.testing.assert_allclose(ys, linear_closed_form(TS, 0.7, 1.3, 2.0), rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("method", [pytest.param("radau5", marks=pytest.mark.slow), "rodas5p"])
def test_dense_output_of_a_dae(x64, method):
    def at(k):
        sol = odeint(linear_dae, jnp.array([2.0, 0.0]), jnp.array([0.0, 2.5]), k, 1.3,
                     method=method, rtol=1e-10, atol=1e-12, mass_matrix=np.array([1.0, 0.0]),
                     dense=True)  # fmt: skip
        return sol.evaluate(jnp.array([0.37, 1.61]))

    exact = lambda k: linear_closed_form(jnp.array([0.37, 1.61]), k, 1.3, 2.0)  # noqa: E731
    np.testing.assert_allclose(at(0.7), exact(0.7), rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(jax.jit(jax.grad(lambda k: at(k)[1, 0]))(0.7),
                               jax.grad(lambda k: exact(k)[1, 0])(0.7), rtol=1e-5)  # fmt: skip


def test_a_banded_stage_solver_with_a_mass_matrix(x64):
    prob = PROBLEMS["rober"]
    args = (robertson_dae, jnp.asarray(prob["y0"]), jnp.asarray(prob["ts"]), jnp.asarray(prob["p"]))
    kw = dict(method="bdf", rtol=1e-6, atol=1e-10, mass_matrix=ROBER_MASS)
    dense = odeint(*args, **kw)
    band = odeint(*args, **kw, linear_solver=linear_solve.Banded(2, 2, throw=False))
    # The two solves round differently, so their steps may differ: they agree to
    # the tolerance, and both keep the constraint.
    np.testing.assert_allclose(band, dense, rtol=1e-5, atol=1e-11)
    np.testing.assert_allclose(jnp.sum(band, axis=1), 1.0, atol=1e-13)
    with pytest.raises(ValueError, match="outside the band"):
        odeint(*args, **dict(kw, mass_matrix=np.triu(np.ones((3, 3)))),
               linear_solver=linear_solve.Banded(1, 1, throw=False))  # fmt: skip


def test_mass_matrix_errors(x64):
    u0, m = jnp.array([2.0, -0.7]), np.array([1.0, 0.0])
    call = lambda **kw: odeint(linear_dae, u0, TS, 0.7, 1.3, **kw)  # noqa: E731
    for method in ("dopri5", "kvaerno5", "rk4"):
        with pytest.raises(ValueError, match="mass_matrix.*radau5"):
            call(method=method, mass_matrix=m, dt=0.1 if method == "rk4" else None)
    with pytest.raises(ValueError, match="backsolve"):
        call(method="radau5", mass_matrix=m, adjoint="backsolve")
    with pytest.raises(ValueError, match=r"\(2, 2\) or its diagonal"):
        call(method="radau5", mass_matrix=np.ones(3))
    with pytest.raises(TypeError, match="concrete"):
        jax.jit(lambda m: call(method="radau5", mass_matrix=m))(m)
    with pytest.raises(NotImplementedError, match="times"):
        jax.grad(lambda t: odeint(linear_dae, u0, jnp.array([0.0, t]), 0.7, 1.3,
                                  method="radau5", mass_matrix=m)[-1, 0])(1.0)  # fmt: skip
    with pytest.raises(ValueError, match="own interpolant"):
        odeint(linear_dae, u0, jnp.array([0.0, 1.0]), 0.7, 1.3, method="bdf",
               mass_matrix=m, dense=True)  # fmt: skip
    with pytest.raises(ValueError, match="sparsity pattern"):
        call(method="bdf", mass_matrix=np.ones((2, 2)) - np.eye(2) * 0.5,
             linear_solver=linear_solve.Sparse(np.eye(2, dtype=bool), throw=False))  # fmt: skip
    # A method object that already holds a mass matrix is checked as well.
    with pytest.raises(TypeError, match="MassMatrix of 2 unknowns"):
        call(method=Radau5(mass_matrix=MassMatrix(np.ones(3), 3)))
    with pytest.raises(ValueError, match="backsolve"):
        call(method=Radau5(mass_matrix=MassMatrix(m, 2)), adjoint="backsolve")
    preset = call(method=Radau5(mass_matrix=MassMatrix(m, 2)), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(preset, linear_closed_form(TS, 0.7, 1.3, 2.0), rtol=1e-7)


def test_mass_matrix_object():
    m = MassMatrix(np.diag([1.0, 2.0, 0.0]), 3)
    assert m.diagonal and m.algebraic.tolist() == [2]
    assert m == MassMatrix(np.array([1.0, 2.0, 0.0]), 3)
    assert hash(m) == hash(MassMatrix(np.array([1.0, 2.0, 0.0]), 3))
    assert m != MassMatrix(np.array([1.0, 1.0, 0.0]), 3)
    left, right = MassMatrix(FULL_MASS, 2).null_spaces()
    np.testing.assert_allclose(left @ FULL_MASS, 0, atol=1e-14)
    np.testing.assert_allclose(FULL_MASS @ right, 0, atol=1e-14)


# The transistor amplifier of the IVP test set (Mazzia and Magherini, Bari;
# `transamp.F`): eight node voltages, an index-1 DAE whose mass matrix of capacitances
# is full and singular (rank 5), driven by `0.1 sin(200 pi t)` over [0, 0.2].
_UB, _UF, _ALPHA, _BETA, _R0, _RL = 6.0, 0.026, 0.99, 1e-6, 1000.0, 9000.0


def transistor_amplifier(y, t, ub):
    ue = 0.1 * jnp.sin(200 * jnp.pi * t)
    g1 = _BETA * (jnp.exp((y[1] - y[2]) / _UF) - 1)
    g2 = _BETA * (jnp.exp((y[4] - y[5]) / _UF) - 1)
    return jnp.stack(
        [
            (y[0] - ue) / _R0,
            y[1] / _RL + (y[1] - ub) / _RL + (1 - _ALPHA) * g1,
            y[2] / _RL - g1,
            (y[3] - ub) / _RL + _ALPHA * g1,
            y[4] / _RL + (y[4] - ub) / _RL + (1 - _ALPHA) * g2,
            y[5] / _RL - g2,
            (y[6] - ub) / _RL + _ALPHA * g2,
            y[7] / _RL,
        ]
    )


def _amplifier_mass():
    c = (1e-6, 2e-6, 3e-6, 4e-6, 5e-6)
    m = np.zeros((8, 8))
    for (i, j), ck in zip(((0, 1), (3, 4), (6, 7)), (c[0], c[2], c[4])):
        m[i, i] = m[j, j] = -ck
        m[i, j] = m[j, i] = ck
    m[2, 2], m[5, 5] = -c[1], -c[3]
    return m


AMPLIFIER_Y0 = np.array([0.0, 3.0, 3.0, 6.0, 3.0, 3.0, 6.0, 0.0])
#: y(0.2) by PSIDE at rtol = atol = 1e-14 (the test set's reference solution).
AMPLIFIER_REF = np.array(
    [
        -0.5562145012262709e-2, 0.3006522471903042e1, 0.2849958788608128e1,
        0.2926422536206241e1, 0.2704617865010554e1, 0.2761837778393145e1,
        0.4770927631616772e1, 0.1236995868091548e1,
    ]
)  # fmt: skip


def _amplifier(method, rtol, ub=_UB):
    return odeint(
        transistor_amplifier, jnp.asarray(AMPLIFIER_Y0), jnp.array([0.0, 0.2]), ub,
        method=method, rtol=rtol, atol=rtol, mass_matrix=_amplifier_mass(), mxstep=1e6,
        max_steps=16384,
    )[-1]  # fmt: skip


@pytest.mark.parametrize(
    ("method", "rtol", "bound"),
    [
        ("rodas5p", 1e-6, 1e-6),
        ("bdf", 1e-6, 2e-5),
        pytest.param("radau5", 1e-8, 1e-8, marks=pytest.mark.slow),
    ],
)
def test_transistor_amplifier_matches_the_test_set_reference(x64, method, rtol, bound):
    y = jax.jit(lambda: _amplifier(method, rtol))()
    err = np.max(np.abs(y - AMPLIFIER_REF) / np.maximum(np.abs(AMPLIFIER_REF), 1e-6))
    assert err < bound, err


@pytest.mark.slow
def test_transistor_amplifier_at_a_tight_tolerance_iterates_to_the_rounding_floor(x64):
    """At rtol = atol = 1e-10 the stage iteration of this DAE stalls at its rounding
    floor (corrections of 1e-4 to 3e-3 tolerance units that no longer shrink): that
    is taken as converged, so the steps hardly fail or shrink for it, and the solution
    still matches the test set's reference to about 1e-12."""
    ys, info = jax.jit(
        lambda: odeint(
            transistor_amplifier, jnp.asarray(AMPLIFIER_Y0), jnp.array([0.0, 0.2]), _UB,
            method="radau5", rtol=1e-10, atol=1e-10, mass_matrix=_amplifier_mass(),
            mxstep=1e6, max_steps=32768, return_info=True,
        )
    )()  # fmt: skip
    steps = int(info.steps)
    assert int(info.num_stage_failures) < 0.01 * steps, info
    assert int(info.rejected) < 0.02 * steps, info
    err = np.max(np.abs(ys[-1] - AMPLIFIER_REF) / np.maximum(np.abs(AMPLIFIER_REF), 1e-6))
    assert err < 1e-11, err


@pytest.mark.slow
@pytest.mark.parametrize("method", ["rodas5p", "bdf"])
def test_transistor_amplifier_gradient_against_central_differences(x64, method):
    """d y8(0.2) / d ub (the supply voltage) by the checkpointed adjoint and by forward
    mode, against central differences of Radau5 at rtol 1e-10 (another method, ten
    thousand times tighter)."""
    rtol = 1e-7
    grad = jax.jit(jax.grad(lambda ub: _amplifier(method, rtol, ub)[7]))(_UB)
    fwd = jax.jit(jax.jacfwd(lambda ub: _amplifier(method, rtol, ub)[7]))(_UB)
    tight = jax.jit(lambda ub: _amplifier("radau5", 1e-10, ub)[7])
    eps = 1e-4
    fd = (tight(_UB + eps) - tight(_UB - eps)) / (2 * eps)
    np.testing.assert_allclose(grad, fd, rtol=1e-4)
    np.testing.assert_allclose(fwd, grad, rtol=1e-7)


@pytest.mark.parametrize("n", [8, 40])
def test_full_mass_matrix_products(x64, n):
    """`M v` for a full `M`, on one vector and on columns side by side, matches NumPy;
    up to `SMALL` unknowns it is written as sums of products, with no matrix product
    for XLA to hand to a threaded library."""
    from solvers.ode._small import SMALL, small_product

    rng = np.random.default_rng(n)
    m = rng.standard_normal((n, n))
    mass = MassMatrix(m, n)
    v, cols = rng.standard_normal(n), rng.standard_normal((n, 3))
    np.testing.assert_allclose(mass(jnp.asarray(v)), m @ v, rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(mass(jnp.asarray(cols)), m @ cols, rtol=1e-13, atol=1e-13)
    for x in (v, cols):
        hlo = jax.jit(mass).lower(jnp.asarray(x)).as_text()
        assert ("dot_general" in hlo) == (n > SMALL)
    with pytest.raises(ValueError, match="small_product"):
        small_product(jnp.ones((2, 2)), jnp.ones((2, 2, 2)))
