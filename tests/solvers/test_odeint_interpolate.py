"""`odeint(..., interpolate=True)`: outputs from the step interpolant instead of steps
onto every output time. Values against closed forms and against `dense=True` (the same
steps, the interpolant rebuilt independently from the kept states); derivatives exact
for the computed outputs (checkpoint adjoint against forward sensitivities, and both
against float64 finite differences); vmap; the windowed output loop; failure."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from solvers import odeint

pytestmark = pytest.mark.usefixtures("fast_compiles")

ADAPTIVE = ["dopri5", "tsit5", "bosh3", "dopri8", "kvaerno5"]
KW = {
    **{m: dict(rtol=1e-9, atol=1e-9) for m in ADAPTIVE},
    "rk4": dict(dt=0.1),
    "euler": dict(dt=0.002),
}
# Tolerance of the outputs against the closed form: the interpolant's own accuracy
# (the cubic Hermite of Bosh3/Kvaerno5/RK4 is fourth order, Euler's first).
VALUE_TOL = {**{m: 1e-6 for m in ADAPTIVE}, "rk4": 1e-4, "euler": 2e-2}
SLOW = ("dopri8", "kvaerno5", "tsit5", "bosh3")
W = 1.3
TS = np.linspace(0.0, 3.0, 61)  # many outputs per step


def oscillator(y, t, w):
    return jnp.stack([y[1], -(w**2) * y[0]])


def _exact(x0, v0, w, ts):
    return np.stack([x0 * np.cos(w * ts) + v0 / w * np.sin(w * ts),
                     -x0 * w * np.sin(w * ts) + v0 * np.cos(w * ts)], axis=1)  # fmt: skip


def _solve(y0, w, method, interpolate=True, adjoint="checkpoint", ts=TS, **kw):
    return odeint(
        oscillator,
        y0,
        jnp.asarray(ts),
        w,
        method=method,
        adjoint=adjoint,
        interpolate=interpolate,
        **{**KW[method], **kw},
    )


@pytest.mark.parametrize("method", list(KW))
def test_values_against_closed_form_with_fewer_steps(x64, method):
    y0 = jnp.array([0.8, -0.4])
    ys, info = _solve(y0, W, method, return_info=True)
    np.testing.assert_allclose(ys, _exact(0.8, -0.4, W, TS), atol=VALUE_TOL[method])
    # The first row is y0 and the last a step end, both exactly.
    np.testing.assert_array_equal(ys[0], y0)
    _, stepped = _solve(y0, W, method, interpolate=False, return_info=True)
    if method == "euler":  # dt divides the output spacing: no step to save
        assert int(info.steps) <= int(stepped.steps)
    else:
        assert int(info.steps) < int(stepped.steps)
    assert int(info.status) == 0


@pytest.mark.parametrize("method", ["dopri5", "tsit5", "bosh3", "rk4"])
def test_same_as_dense_output_evaluated_at_the_times(x64, method):
    """`dense=True` takes the same steps (both step freely to the end) and rebuilds each
    step's polynomial from the kept states; evaluated at `t`, it matches to rounding."""
    y0 = jnp.array([0.8, -0.4])
    ys = _solve(y0, W, method)
    kw = dict(KW[method])
    sol = odeint(oscillator, y0, jnp.asarray(TS[[0, -1]]), W, method=method, dense=True, **kw)
    np.testing.assert_allclose(ys, sol.evaluate(jnp.asarray(TS)), rtol=1e-12, atol=1e-12)


# Dopri8 and Kvaerno5 (the slowest to compile), Tsit5 and Bosh3 run with the slow suite.
@pytest.mark.parametrize(
    "method",
    [m if m not in SLOW else pytest.param(m, marks=pytest.mark.slow) for m in KW],
)
def test_checkpoint_gradient_is_exact_for_the_interpolated_outputs(x64, method):
    """The discrete adjoint through the interpolants against forward sensitivities (an
    independent rule: the tangent is integrated with the state): equal to rounding,
    because both differentiate the same computed outputs."""

    def loss(y0, w, adjoint="checkpoint"):
        ys = _solve(y0, w, method, adjoint=adjoint)
        return jnp.sum(jnp.sin(ys) * jnp.arange(1, 1 + ys.shape[0])[:, None])

    y0 = jnp.array([0.8, -0.4])
    rev = jax.jit(jax.grad(loss, argnums=(0, 1)))(y0, W)
    fwd = jax.jit(jax.jacfwd(loss, argnums=(0, 1)))(y0, W)
    np.testing.assert_allclose(rev[0], fwd[0], rtol=1e-11, atol=1e-11)
    np.testing.assert_allclose(rev[1], fwd[1], rtol=1e-11, atol=1e-11)
    # Central differences of the same computed outputs. The steps follow `w` here (the
    # controller is not held), and a step decision that flips between `w - eps` and
    # `w + eps` moves the loss by about the tolerance; a wider `eps` keeps that jump
    # small in the quotient (the truncation error stays near 1e-8 relative).
    eps = 1e-4
    fd = (loss(y0, W + eps) - loss(y0, W - eps)) / (2 * eps)
    np.testing.assert_allclose(rev[1], fd, rtol=1e-5)
    if method != "euler":  # the continuous adjoint, to the solver's accuracy
        back = jax.grad(loss, argnums=1)(y0, W, "backsolve")
        np.testing.assert_allclose(back, rev[1], rtol=1e-4)


@pytest.mark.parametrize(
    "adjoint", ["checkpoint", pytest.param("backsolve", marks=pytest.mark.slow)]
)
def test_hessian_and_closed_form_derivatives(x64, adjoint):
    """x(T) = x0 cos(wT) + v0/w sin(wT); d/dw and d2/dw2 of the sum over the outputs."""

    def total(w):
        return jnp.sum(_solve(jnp.array([0.8, -0.4]), w, "dopri5", adjoint=adjoint)[:, 0])

    def exact(w):
        return jnp.sum(0.8 * jnp.cos(w * TS) - 0.4 / w * jnp.sin(w * TS))

    d1, d2 = jax.grad(exact)(W), jax.hessian(exact)(W)
    np.testing.assert_allclose(jax.jit(jax.grad(total))(W), d1, rtol=1e-6)
    np.testing.assert_allclose(jax.jit(jax.hessian(total))(W), d2, rtol=1e-5)


# (Per-element steps under vmap are also in test_odeint_dense and test_odeint_batched_sweep.)
@pytest.mark.slow
def test_vmap_elements_keep_their_own_steps(x64):
    """Under vmap each element steps on its own: the batch equals the stacked solves,
    and so do the gradients of the checkpoint adjoint."""
    ws = jnp.array([0.5, 1.3, 4.0])
    y0 = jnp.array([0.8, -0.4])
    batched, info = jax.vmap(lambda w: _solve(y0, w, "tsit5", return_info=True))(ws)
    assert len(set(np.asarray(info.steps).tolist())) > 1
    for i, w in enumerate(ws):
        np.testing.assert_allclose(batched[i], _solve(y0, w, "tsit5"), rtol=1e-13, atol=1e-14)

    def loss(w):
        return jnp.sum(_solve(y0, w, "tsit5") ** 2)

    np.testing.assert_allclose(
        jax.vmap(jax.grad(loss))(ws), [jax.grad(loss)(w) for w in ws], rtol=1e-12
    )
    np.testing.assert_allclose(
        jax.grad(lambda ws: jax.vmap(loss)(ws).sum())(ws), jax.vmap(jax.grad(loss))(ws), rtol=1e-12
    )


def test_many_outputs_per_step_on_a_large_state(x64):
    """A state of 2000 numbers makes the loop handle the outputs a few at a time (an
    inner loop over windows), forwards and in the adjoint."""
    n = 2000
    rates = jnp.linspace(0.1, 1.0, n)
    ts = jnp.linspace(0.0, 1.0, 40)

    def solve(y0, scale):
        return odeint(lambda y, t, s: -s * rates * y, y0, ts, scale, interpolate=True,
                      adjoint="checkpoint", rtol=1e-10, atol=1e-10)  # fmt: skip

    y0 = jnp.ones(n)
    ys, info = odeint(lambda y, t: -rates * y, y0, ts, interpolate=True, return_info=True,
                      rtol=1e-10, atol=1e-10)  # fmt: skip
    assert int(info.steps) < ts.shape[0] - 1  # several outputs share a step
    np.testing.assert_allclose(ys, np.exp(-np.outer(ts, rates)), rtol=1e-8)
    direction = jnp.cos(jnp.arange(n))
    weights = jnp.sin(jnp.arange(40 * n).reshape(40, n))
    loss = lambda y0, s: jnp.sum(weights * solve(y0, s))  # noqa: E731
    g_y0, g_s = jax.jit(jax.grad(loss, argnums=(0, 1)))(y0, 1.0)
    t_y0 = jax.jvp(lambda y0: loss(y0, 1.0), (y0,), (direction,))[1]
    t_s = jax.jvp(lambda s: loss(y0, s), (1.0,), (1.0,))[1]
    np.testing.assert_allclose(jnp.dot(g_y0, direction), t_y0, rtol=1e-10)
    np.testing.assert_allclose(g_s, t_s, rtol=1e-10)
    # Closed form: d/ds sum(W * exp(-s r t)) = -sum(W * r t exp(-s r t)).
    exact = -jnp.sum(weights * rates * ts[:, None] * jnp.exp(-jnp.outer(ts, rates)))
    np.testing.assert_allclose(g_s, exact, rtol=1e-7)


def test_float32_pytree_and_jit():
    def field(y, t):
        return {"x": y["v"], "v": -y["x"]}

    ts = jnp.linspace(0.0, 2.0, 25)
    solve = jax.jit(functools.partial(odeint, field, t=ts, interpolate=True, rtol=1e-5, atol=1e-5))
    ys = solve({"x": jnp.float32(1.0), "v": jnp.float32(0.0)})
    assert ys["x"].dtype == jnp.float32
    np.testing.assert_allclose(ys["x"], np.cos(ts), atol=1e-4)
    np.testing.assert_allclose(ys["v"], -np.sin(ts), atol=1e-4)


def test_failure_leaves_unreached_rows_nan(x64):
    ts = jnp.linspace(0.0, 2.0, 20)  # no output at the blow-up time 1
    ys, info = odeint(lambda y, t: y**2, 1.0, ts, interpolate=True, throw=False,
                      return_info=True)  # fmt: skip  # blows up at t = 1
    assert int(info.status) != 0
    reached = np.asarray(ts) < float(info.t_final)
    assert np.all(np.isfinite(ys[reached])) and np.all(np.isnan(ys[~reached]))
    np.testing.assert_allclose(ys[reached], 1 / (1 - np.asarray(ts)[reached]), rtol=1e-5)
    with pytest.raises(Exception, match="odeint failed"):
        jax.block_until_ready(odeint(lambda y, t: y**2, 1.0, ts, interpolate=True))


def test_dense_and_interpolate_together_is_an_error():
    with pytest.raises(ValueError, match="either dense=True or interpolate=True"):
        odeint(lambda y, t: -y, 1.0, jnp.array([0.0, 1.0]), dense=True, interpolate=True)
    with pytest.raises(TypeError, match="interpolate"):
        odeint(lambda y, t: -y, 1.0, jnp.array([0.0, 1.0]), interpolate="yes")
