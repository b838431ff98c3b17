"""Complex states with the implicit methods: they integrate the real and imaginary parts
as a real system of twice the size, so a field that is not holomorphic in `y` (with
`|y|` or `conj(y)`, whose Jacobian is only real-linear) gets exact stage solves and
exact derivatives. References: SciPy's DOP853 at `rtol = 1e-12` on the real form, and
central differences of it; closed forms for a linear field."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.integrate import solve_ivp

from solvers import odeint

pytestmark = pytest.mark.usefixtures("fast_compiles")

IMPLICIT = [
    "kvaerno5",
    "bdf",
    pytest.param("rodas5p", marks=pytest.mark.slow),
    pytest.param("rodas4", marks=pytest.mark.slow),
    pytest.param("radau5", marks=pytest.mark.slow),
]
Y0 = np.array([1.0 + 0.5j, 0.3 - 1.0j])
T1 = 1.0


def _field(y, t, a, xp=jnp):
    # Not holomorphic: |y|^2 y and conj(y).
    return 1j * a * xp.abs(y) ** 2 * y - 0.5 * y + 0.3 * xp.conj(y)


def _loss_of(y1, xp=jnp):
    return xp.sum(xp.real(y1) ** 2 + 3 * xp.imag(y1))


def _real_rhs(a):
    """`_field` on the real form `[Re y, Im y]`, for SciPy."""

    def rhs(t, u):
        f = _field(u[:2] + 1j * u[2:], t, a, np)
        return np.concatenate([f.real, f.imag])

    return rhs


U0 = np.concatenate([Y0.real, Y0.imag])


def _reference(a):
    """`loss(y(T1))` by SciPy on the real form, at `rtol = 1e-12`."""
    u1 = solve_ivp(_real_rhs(a), (0.0, T1), U0, method="DOP853", rtol=1e-12, atol=1e-14).y[:, -1]
    return float(_loss_of(u1[:2] + 1j * u1[2:], np))


@pytest.mark.parametrize("method", IMPLICIT)
def test_field_that_is_not_holomorphic_and_its_derivatives(x64, method):
    """The value, `grad` and `jacfwd` against SciPy and its central differences. A
    complex stage matrix built from the Jacobian's products with real unit vectors gave
    kvaerno5 a gradient of 1.6465 here, for 1.3254."""

    def loss(a):
        ys = odeint(_field, jnp.asarray(Y0), jnp.array([0.0, T1]), a, method=method,
                    rtol=1e-10, atol=1e-12, mxstep=10**5)  # fmt: skip
        return _loss_of(ys[-1])

    a, eps = 0.7, 1e-5
    fd = (_reference(a + eps) - _reference(a - eps)) / (2 * eps)
    np.testing.assert_allclose(float(jax.jit(loss)(a)), _reference(a), rtol=1e-8)
    np.testing.assert_allclose(float(jax.jit(jax.grad(loss))(a)), fd, rtol=1e-6)
    np.testing.assert_allclose(float(jax.jit(jax.jacfwd(loss))(a)), fd, rtol=1e-6)


def test_stiff_linear_field_matches_the_closed_form(x64):
    """`y' = a lam y` with a stiff complex `lam`, on a pytree state (a complex leaf and
    a real one): `y0 exp(a lam t)` and the gradient of `|y(T)|^2` in closed form; under
    `vmap` too."""
    lam = jnp.array([-1000.0 + 5.0j, -0.5 + 2.0j])
    ts = jnp.array([0.0, 0.5, 2.0])

    def field(y, t, a):
        return {"z": a * lam * y["z"], "x": -a * y["x"]}

    y0 = {"z": jnp.asarray(Y0), "x": jnp.array([2.0])}

    def loss(a):
        ys = odeint(field, y0, ts, a, method="radau5", rtol=1e-10, atol=1e-12)
        return jnp.sum(jnp.abs(ys["z"][-1]) ** 2) + ys["x"][-1, 0], ys

    def exact(a):
        z = y0["z"][None] * jnp.exp(a * lam[None] * ts[:, None])
        return jnp.sum(jnp.abs(z[-1]) ** 2) + 2.0 * jnp.exp(-a * ts[-1]), z

    (value, ys), g = jax.jit(jax.value_and_grad(loss, has_aux=True))(1.0)
    (value_x, z), g_x = jax.value_and_grad(exact, has_aux=True)(1.0)
    assert ys["z"].dtype == jnp.complex128 and ys["x"].dtype == jnp.float64
    np.testing.assert_allclose(ys["z"], z, rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(value, value_x, rtol=1e-9)
    np.testing.assert_allclose(g, g_x, rtol=1e-7)
    batch = jax.jit(jax.vmap(lambda a: loss(a)[0]))(jnp.array([0.5, 1.0]))
    np.testing.assert_allclose(batch, [exact(0.5)[0], value_x], rtol=1e-9)


def test_mass_matrix_applies_to_both_parts(x64):
    """`M y' = lam y` with a complex `M` given for the complex state: `y0 exp(lam t / m)`
    for each diagonal entry `m`."""
    lam = jnp.array([-3.0 + 1.0j, -0.5 + 2.0j])
    m = np.array([[2.0 + 1.0j, 0.0], [0.0, 1.0]])
    ts = jnp.array([0.0, 1.0])
    ys = odeint(lambda y, t: lam * y, jnp.asarray(Y0), ts, method="radau5", mass_matrix=m,
                rtol=1e-10, atol=1e-12)  # fmt: skip
    np.testing.assert_allclose(ys[-1], Y0 * np.exp(np.asarray(lam) / np.diag(m)), rtol=1e-8)


@pytest.mark.parametrize(
    "method", [*(pytest.param(m, marks=pytest.mark.slow) for m in ("radau5", "bdf")), "rodas5p"]
)
def test_mixed_state_with_a_real_algebraic_unknown(x64, method):
    """`y' = a y + z`, `0 = z - cos t` with a complex `y` and a real `z`: only the complex
    leaf gets an imaginary part to integrate (one for `z` would be an equation `0 = 0`,
    a singular stage matrix). The solution and the gradient of `|y(1)|^2` in `s` (with
    `a = s (-2 + 3i)`) against the closed form `y = e^(a t) (y0 - p(0)) + p(t)`,
    `p = (sin t - a cos t) / (a^2 + 1)`."""
    ts = jnp.array([0.0, 0.5, 1.0])
    mass = np.diag([1.0, 0.0])
    y0 = {"y": jnp.array([1.0 + 0.5j]), "z": jnp.array([1.0])}

    def field(u, t, s):
        a = s * (-2.0 + 3.0j)
        return {"y": a * u["y"] + u["z"], "z": u["z"] - jnp.cos(t)}

    def exact(s):
        a = s * (-2.0 + 3.0j)
        p = lambda t: (jnp.sin(t) - a * jnp.cos(t)) / (a**2 + 1)  # noqa: E731
        return jnp.exp(a * ts) * (y0["y"][0] - p(0.0)) + p(ts)

    def solve(s):
        return odeint(field, y0, ts, s, method=method, mass_matrix=mass, rtol=1e-10, atol=1e-12)

    ys = solve(1.0)
    assert ys["y"].dtype == jnp.complex128 and ys["z"].dtype == jnp.float64
    np.testing.assert_allclose(ys["y"][:, 0], exact(1.0), rtol=1e-7)
    np.testing.assert_allclose(ys["z"][:, 0], np.cos(np.asarray(ts)), rtol=1e-9)
    g = jax.jit(jax.grad(lambda s: jnp.abs(solve(s)["y"][-1, 0]) ** 2))(1.0)
    g_x = jax.grad(lambda s: jnp.abs(exact(s)[-1]) ** 2)(1.0)
    np.testing.assert_allclose(g, g_x, rtol=1e-6)


def test_complex_state_with_jac_is_refused(x64):
    """A complex matrix stands for the Jacobian of the real form only when the field is
    holomorphic, so `jac` with a complex state is an error naming it."""
    with pytest.raises(ValueError, match="`jac` with a complex state"):
        odeint(lambda y, t: -y, jnp.asarray(Y0), jnp.array([0.0, 1.0]), method="kvaerno5",
               jac=lambda y, t: -jnp.eye(2))  # fmt: skip


def _reference_event(a):
    """The first time `Re y_0 = 0.2`, by SciPy on the real form at `rtol = 1e-12`."""

    def crossing(t, u):
        return u[0] - 0.2

    crossing.terminal = True
    out = solve_ivp(
        _real_rhs(a), (0.0, 20.0), U0, method="DOP853", rtol=1e-12, atol=1e-14, events=crossing
    )
    return float(out.t_events[0][0])


@pytest.mark.parametrize("method", ["bdf", pytest.param("radau5", marks=pytest.mark.slow)])
def test_event_time_and_its_derivative(x64, method):
    """`odeint_event` searches a complex state in the same real form: the event time and
    its derivative against SciPy's and its central differences."""
    from solvers import odeint_event

    def crossing(y, t, a):
        return jnp.real(y[0]) - 0.2

    def t_event(a):
        return odeint_event(_field, crossing, jnp.asarray(Y0), 0.0, 20.0, a, method=method,
                            rtol=1e-10, atol=1e-12)[0]  # fmt: skip

    a, eps = 0.7, 1e-5
    fd = (_reference_event(a + eps) - _reference_event(a - eps)) / (2 * eps)
    np.testing.assert_allclose(float(jax.jit(t_event)(a)), _reference_event(a), rtol=1e-8)
    np.testing.assert_allclose(float(jax.jit(jax.grad(t_event))(a)), fd, rtol=1e-6)


def test_complex_parameters_of_a_real_state(x64):
    """`y' = -|a|^2 y` with a complex `a` and a real state: the gradient in closed form
    by default (checkpointed) and with adjoint='checkpoint'; 'backsolve', whose adjoint
    ODE keeps the parameters' adjoint in the real dtype (it returned the real part
    only), is refused."""

    def loss(a, **kw):
        return odeint(lambda y, t, a: -jnp.abs(a) ** 2 * y, jnp.array([1.0]),
                      jnp.array([0.0, 1.0]), a, rtol=1e-10, atol=1e-12, **kw)[-1, 0]  # fmt: skip

    a = 1.0 + 1.0j
    exact = jax.grad(lambda a: jnp.exp(-(jnp.abs(a) ** 2)))(a)
    for kw in ({}, {"adjoint": "checkpoint"}, {"method": "kvaerno5"}):
        np.testing.assert_allclose(jax.grad(functools.partial(loss, **kw))(a), exact, rtol=1e-8)
    with pytest.raises(ValueError, match="adjoint='backsolve' with complex"):
        jax.grad(lambda a: loss(a, adjoint="backsolve"))(a)


def test_structured_solver_or_wrong_mass_matrix_with_a_complex_state(x64):
    """A band or pattern given for the complex unknowns does not describe the real
    system of twice the size; a mass matrix is checked against the complex state's
    size. Both are errors naming the argument."""
    from implicitdiff import linear_solve

    y0, ts = jnp.asarray(Y0), jnp.array([0.0, 1.0])
    with pytest.raises(ValueError, match="Banded.*with a complex state"):
        odeint(lambda y, t: -y, y0, ts, method="bdf", linear_solver=linear_solve.Banded(1, 1))
    with pytest.raises(ValueError, match=r"`mass_matrix` must be \(2, 2\) or its diagonal"):
        odeint(lambda y, t: -y, y0, ts, method="radau5", mass_matrix=np.ones(3))
