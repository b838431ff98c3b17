"""The checkpointed adjoint of a `vmap`ped solve: one backward sweep for the whole batch,
in which the parameters the batch shares get their cotangent summed inside each step
(`Primitive.vjp_bwd_batched`), and `vmap` of the sweep itself (`jacrev`).

Every gradient is checked against an independent one: the per-element solves one at a
time (summed by hand), forward-mode sensitivities (`jacfwd`, a different rule), and
float64 central differences.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from solvers import odeint
from solvers.ode import CheckpointAdjoint

from .stiff_problems import PROBLEMS

pytestmark = pytest.mark.usefixtures("fast_compiles")

TS = np.linspace(0.0, 2.0, 9)
Y0S = np.array([[1.0, 0.0], [0.2, -0.7], [-1.5, 0.4]])
KW = {
    "tsit5": dict(rtol=1e-9, atol=1e-9),  # explicit, first-same-as-last
    "rk4": dict(dt=0.05),  # fixed step, f at the step's end evaluated separately
    "kvaerno5": dict(rtol=1e-7, atol=1e-7),  # implicit stages
    "rodas5p": dict(rtol=1e-7, atol=1e-7),  # linearly implicit stages
}


def duffing(y, t, w, c):
    """A nonlinear oscillator: the step count depends on the initial state."""
    return jnp.stack([y[1], -(w**2) * y[0] - c * y[0] ** 3 - 0.1 * y[1]])


def solve(y0, w, c, method="tsit5", interpolate=True, ts=TS, **kw):
    kw = {"adjoint": "checkpoint", **KW[method], **kw}
    return odeint(duffing, y0, jnp.asarray(ts), w, c, method=method, interpolate=interpolate,
                  **kw)  # fmt: skip


def central(fn, x, eps=1e-6):
    return (fn(x + eps) - fn(x - eps)) / (2 * eps)


@pytest.mark.parametrize(
    "method, interpolate",
    [
        ("tsit5", True),
        pytest.param("tsit5", False, marks=pytest.mark.slow),
        pytest.param("rk4", True, marks=pytest.mark.slow),
        pytest.param("rk4", False, marks=pytest.mark.slow),
        pytest.param("kvaerno5", True, marks=pytest.mark.slow),
        pytest.param("kvaerno5", False, marks=pytest.mark.slow),
        pytest.param("rodas5p", True, marks=pytest.mark.slow),
    ],
)
def test_shared_parameters_summed_over_the_batch(x64, method, interpolate):
    """grad of a batch loss with shared parameters = the sum of the elements' grads,
    = forward sensitivities; the initial states keep one cotangent each."""

    def loss(y0s, w, c):
        ys = jax.vmap(lambda y0: solve(y0, w, c, method, interpolate))(y0s)
        return jnp.sum(jnp.sin(ys))

    y0s = jnp.asarray(Y0S)
    g_y0, g_w, g_c = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(y0s, 1.3, 0.5)

    def one(y0, w, c):
        return jnp.sum(jnp.sin(solve(y0, w, c, method, interpolate)))

    grad_one = jax.jit(jax.grad(one, argnums=(0, 1, 2)))
    per = [grad_one(y0, 1.3, 0.5) for y0 in y0s]
    np.testing.assert_allclose(g_y0, np.stack([p[0] for p in per]), rtol=1e-10, atol=1e-13)
    np.testing.assert_allclose(g_w, sum(p[1] for p in per), rtol=1e-10)
    np.testing.assert_allclose(g_c, sum(p[2] for p in per), rtol=1e-10)
    # Forward mode (forward sensitivities) is an independent rule.
    f_w, f_c = jax.jit(jax.jacfwd(loss, (1, 2)))(y0s, 1.3, 0.5)
    np.testing.assert_allclose(g_w, f_w, rtol=1e-8)
    np.testing.assert_allclose(g_c, f_c, rtol=1e-8)


def test_elements_with_different_step_counts_and_several_segments(x64):
    """Elements that take different numbers of steps, with checkpoints every 8 steps
    (`max_steps=100` in 13 checkpoints), so earlier segments are replayed: against
    central differences."""
    y0s = jnp.asarray(Y0S) * jnp.array([[1.0], [0.3], [2.0]])
    steps = jax.vmap(lambda y0: solve(y0, 1.3, 0.5, max_steps=100, return_info=True)[1].steps)(y0s)
    assert len(set(np.asarray(steps).tolist())) > 1 and int(steps.max()) > 20
    every_eight = CheckpointAdjoint(max_steps=100, checkpoints=13)

    def loss(w, c=0.5):
        ys = jax.vmap(lambda y0: solve(y0, w, c, adjoint=every_eight))(y0s)
        return jnp.sum(ys[:, -1] ** 2) + jnp.sum(ys[:, 3])

    # The discrete adjoint is exact for the computed solution; central differences see
    # the step sizes move too, so compare at the solve's own tolerance.
    grad = jax.jit(jax.grad(loss))(1.3)
    np.testing.assert_allclose(grad, central(jax.jit(loss), 1.3), rtol=1e-6)
    np.testing.assert_allclose(grad, jax.jit(jax.jacfwd(loss))(1.3), rtol=1e-9)


@pytest.mark.parametrize("method", ["radau5", pytest.param("bdf", marks=pytest.mark.slow)])
def test_stiff_elements_ending_in_different_segments(x64, method):
    """ROBER with shared rate constants, one element ending within the first segment
    while the other runs through many. The steps the short element has no more of are
    linearised at one it did take: a zero step of radau5 here has a singular stage
    matrix, which made the summed gradient NaN. Against the elements' own gradients."""
    f = lambda y, t, p: PROBLEMS["rober"]["f"](y, t, p, jnp)  # noqa: E731
    p = jnp.asarray(PROBLEMS["rober"]["p"])
    y0 = jnp.asarray(PROBLEMS["rober"]["y0"])
    kw = dict(method=method, rtol=1e-6, atol=1e-10, max_steps=400)
    every_16 = CheckpointAdjoint(max_steps=400, checkpoints=25)

    def one(p, t1):
        return jnp.sum(odeint(f, y0, jnp.stack([0.0, t1]), p, adjoint=every_16, **kw)[-1] ** 2)

    t1s = jnp.array([1e-5, 1e5])
    steps = [
        int(odeint(f, y0, jnp.stack([0.0, t]), p, return_info=True, **kw)[1].steps) for t in t1s
    ]
    assert steps[0] < 16 < 4 * 16 < steps[1]  # checkpoints every 16 steps
    batch = jax.jit(jax.grad(lambda p: jnp.sum(jax.vmap(one, (None, 0))(p, t1s))))(p)
    each = sum(jax.jit(jax.grad(one))(p, t) for t in t1s)
    assert np.all(np.isfinite(batch))
    np.testing.assert_allclose(batch, each, rtol=1e-8)


@pytest.mark.parametrize("layout", [pytest.param("chunks", marks=pytest.mark.slow), "blocks"])
def test_one_solve_skips_the_steps_past_its_count(x64, monkeypatch, layout):
    """The sweep of one solve of 100 states or more (forced here) skips the steps past
    the solve's count, where a batch's sweep pulls them back masked. Segments of 8 steps
    linearised eight at a time (the last segment's chunk runs past its steps), or every
    step's start kept and read by blocks of the steps taken, one step at a time (each
    through the same `cond`): each solve's gradient against the batch's (whose elements
    take different numbers of steps) and against central differences, and `vmap` of
    `jacfwd(grad)` against each element's."""
    from solvers.ode.adjoints import sweep

    monkeypatch.setattr(sweep, "LINEARIZE_MIN_STATES", 1)
    kw = dict(max_steps=100)
    if layout == "chunks":
        kw["adjoint"] = CheckpointAdjoint(max_steps=100, checkpoints=13)
    else:
        monkeypatch.setattr(sweep, "LINEARIZE_CHUNK", 1)
    y0s = jnp.asarray(Y0S) * jnp.array([[1.0], [0.3], [2.0]])
    steps = jax.vmap(lambda y0: solve(y0, 1.3, 0.5, return_info=True, **kw)[1].steps)(y0s)
    steps = np.asarray(steps).tolist()
    assert len(set(steps)) > 1 and min(steps) > 20 and any(s % 8 for s in steps)

    def loss(p, y0):
        ys = solve(y0, p[0], p[1], **kw)
        return jnp.sum(ys[-1] ** 2) + jnp.sum(ys[3])

    p = jnp.array([1.3, 0.5])
    each = jnp.stack([jax.jit(jax.grad(loss))(p, y0) for y0 in y0s])
    batch = jax.jit(jax.vmap(jax.grad(loss), (None, 0)))(p, y0s)
    np.testing.assert_allclose(each, batch, rtol=1e-10, atol=1e-14)
    # The discrete adjoint is exact for the computed solution; central differences see
    # the step sizes move too, so compare at the solve's own tolerance.
    w_only = lambda w: loss(jnp.stack([w, p[1]]), y0s[2])  # noqa: E731
    np.testing.assert_allclose(each[2, 0], central(jax.jit(w_only), p[0]), rtol=1e-6)
    # Forward mode over the sweep, under a `vmap` the sweep does not see: one sweep
    # for all the elements, whose `cond` the `vmap` makes a select.
    hess = jax.jit(jax.vmap(jax.jacfwd(jax.grad(loss)), (None, 0)))(p, y0s)
    hess_each = jnp.stack([jax.jit(jax.jacfwd(jax.grad(loss)))(p, y0) for y0 in y0s])
    np.testing.assert_allclose(hess, hess_each, rtol=1e-9, atol=1e-12)


def test_batched_parameters_and_a_shared_initial_state(x64):
    """vmap over the parameters with one initial state: each element's parameter gets
    its own cotangent, the shared initial state the sum."""
    ws = jnp.array([0.7, 1.3, 2.2])
    y0 = jnp.array([0.9, -0.2])

    def loss(y0, ws):
        return jnp.sum(jax.vmap(lambda w: solve(y0, w, 0.5))(ws) ** 2)

    g_y0, g_ws = jax.jit(jax.grad(loss, argnums=(0, 1)))(y0, ws)
    one = lambda y0, w: jnp.sum(solve(y0, w, 0.5) ** 2)  # noqa: E731
    grad_one = jax.jit(jax.grad(one, argnums=(0, 1)))
    per = [grad_one(y0, w) for w in ws]
    np.testing.assert_allclose(g_y0, sum(p[0] for p in per), rtol=1e-10)
    np.testing.assert_allclose(g_ws, [p[1] for p in per], rtol=1e-10)
    np.testing.assert_allclose(g_ws, jax.jit(jax.jacfwd(loss, 1))(y0, ws), rtol=1e-8)


@pytest.mark.slow
def test_shared_output_times_get_the_summed_cotangent(x64):
    def loss(ts):
        ys = jax.vmap(lambda y0: solve(y0, 1.3, 0.5, ts=ts))(jnp.asarray(Y0S))
        return jnp.sum(ys[:, :, 0] * jnp.arange(len(TS)))

    ts = jnp.asarray(TS)
    np.testing.assert_allclose(jax.grad(loss)(ts), jax.jacfwd(loss)(ts), rtol=1e-7, atol=1e-10)


@pytest.mark.slow
def test_jacrev_under_vmap_and_vmap_of_jacrev(x64):
    """jacrev maps the sweep over cotangents (its own batching rule): one cotangent of
    the parameter per row, not their sum."""
    y0s = jnp.asarray(Y0S)

    def rows(w, y0):
        return solve(y0, w, 0.5)[:, 0]

    jac = jax.vmap(jax.jacrev(rows), (None, 0))(1.3, y0s)
    np.testing.assert_allclose(jac, jax.vmap(jax.jacfwd(rows), (None, 0))(1.3, y0s), rtol=1e-8)
    jac_y0 = jax.jacrev(lambda y0s: jax.vmap(lambda y0: rows(1.3, y0))(y0s))(y0s)
    np.testing.assert_allclose(
        jac_y0, jax.jacfwd(lambda y0s: jax.vmap(lambda y0: rows(1.3, y0))(y0s))(y0s), rtol=1e-8,
        atol=1e-12,
    )  # fmt: skip


@pytest.mark.slow
def test_hessian_of_a_batch_loss(x64):
    """Forward over reverse through the batched sweep (its jvp rule)."""

    def loss(p):
        ys = jax.vmap(lambda y0: solve(y0, p[0], p[1]))(jnp.asarray(Y0S))
        return jnp.sum(ys**2)

    p = jnp.array([1.3, 0.5])
    hess = jax.hessian(loss)(p)
    np.testing.assert_allclose(hess, jax.jacfwd(jax.jacfwd(loss))(p), rtol=1e-7)
    np.testing.assert_allclose(hess, hess.T, rtol=1e-7)


@pytest.mark.slow
def test_nested_vmap(x64):
    """Two vmaps: the inner sweep is batched, the outer maps it."""
    y0s = jnp.asarray(Y0S)
    ws = jnp.array([1.1, 1.6])

    def loss(ws, c):
        ys = jax.vmap(lambda w: jax.vmap(lambda y0: solve(y0, w, c))(y0s))(ws)
        return jnp.sum(ys[..., -1, :] ** 2)

    def one(w, c):  # one outer element, the inner vmap kept
        return loss(jnp.reshape(w, (1,)), c)

    g = jax.grad(loss, argnums=(0, 1))(ws, 0.5)
    per = [jax.grad(one, argnums=(0, 1))(w, 0.5) for w in ws]
    np.testing.assert_allclose(g[0], [p[0] for p in per], rtol=1e-10)
    np.testing.assert_allclose(g[1], sum(p[1] for p in per), rtol=1e-10)


def test_many_outputs_a_few_at_a_time_under_vmap(x64):
    """More output times than one window holds: the sweep gathers them window by
    window, each element its own."""
    ts = np.linspace(0.0, 2.0, 2200)

    def loss(w):
        ys = jax.vmap(lambda y0: solve(y0, w, 0.5, ts=ts))(jnp.asarray(Y0S))
        return jnp.mean(ys**2)

    np.testing.assert_allclose(
        jax.jit(jax.grad(loss))(1.3), jax.jit(jax.jacfwd(loss))(1.3), rtol=1e-8
    )


@pytest.mark.slow
def test_outputs_summed_per_step_first_or_window_by_window(x64, monkeypatch):
    """The two ways the sweep collects the outputs' cotangents: summed per step before
    it starts (few numbers: the default here) or a few rows at a time at each step
    (forced by `_GROUPED_MAX = 0`). Both against forward mode, with output times
    bunched at the start (several per step) and spread at the end (steps with none)."""
    import solvers.ode.adjoints.sweep as sweep

    ts = np.concatenate([np.linspace(0.0, 0.3, 12), [0.9, 1.7, 2.0]])

    def loss(w, c):
        ys = jax.vmap(lambda y0: solve(y0, w, c, ts=ts))(jnp.asarray(Y0S))
        return jnp.sum(jnp.sin(ys) * jnp.arange(1, 1 + ys.shape[1])[None, :, None])

    fwd = jax.jacfwd(loss, argnums=(0, 1))(1.3, 0.5)
    grads = []
    for cap in (sweep._GROUPED_MAX, 0):
        monkeypatch.setattr(sweep, "_GROUPED_MAX", cap)
        grads.append(jax.jit(jax.grad(loss, argnums=(0, 1)))(1.3, 0.5))
        np.testing.assert_allclose(grads[-1], fwd, rtol=1e-9)
    np.testing.assert_allclose(grads[0], grads[1], rtol=1e-12)


@pytest.mark.slow
def test_float32_pytree_parameters_under_jit():
    """The NeuralODE case in miniature: float32, parameters in a pytree shared by the
    batch, under jit; against the per-element sum."""
    params = {"a": jnp.array([[0.0, 1.0], [-1.0, -0.1]]), "b": jnp.array([0.1, -0.2])}

    def field(y, t, p):
        return jnp.tanh(p["a"] @ y + p["b"])

    y0s = jnp.asarray(Y0S, jnp.float32)
    ts = jnp.asarray(TS, jnp.float32)

    def one(p, y0):
        return jnp.sum(odeint(field, y0, ts, p, interpolate=True, adjoint="checkpoint") ** 2)

    grads = jax.jit(jax.grad(lambda p: jax.vmap(lambda y0: one(p, y0))(y0s).sum()))(params)
    per = [jax.grad(one)(params, y0) for y0 in y0s]
    for k in params:
        np.testing.assert_allclose(grads[k], sum(p[k] for p in per), rtol=2e-5, atol=1e-6)
