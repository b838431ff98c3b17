"""`odeint(..., dense=True)`: the `ODESolution` against closed forms, in every
derivative mode, under vmap and jit, and its failure modes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from solvers import ODESolution, odeint

pytestmark = pytest.mark.usefixtures("fast_compiles")

SPAN = (0.0, 2.0)
TQ = np.linspace(0.0, 2.0, 41)  # query times, including both ends


def decay(y, t, k):
    return -k * y


def oscillator(y, t, w):
    return {"x": y["v"], "v": -(w**2) * y["x"]}


def _dense(func, y0, *args, **kw):
    kw.setdefault("max_steps", 256)
    return odeint(func, y0, jnp.asarray(SPAN), *args, dense=True, **kw)


@pytest.mark.parametrize(
    ("method", "kw", "tol"),
    [
        ("dopri5", {}, 2e-6),
        ("tsit5", {}, 2e-6),
        ("dopri8", {}, 2e-6),
        ("bosh3", dict(rtol=1e-9, atol=1e-9, max_steps=2048), 2e-6),
        ("kvaerno5", {}, 2e-6),
        ("rodas5p", {}, 2e-6),
        ("rodas4", {}, 2e-6),
        ("rk4", dict(dt=1 / 32), 2e-6),
    ],
)
def test_oscillator_values_and_derivative_against_closed_form(x64, method, kw, tol):
    w = 1.7
    sol = _dense(oscillator, {"x": 1.0, "v": 0.0}, w, method=method, **kw)
    assert isinstance(sol, ODESolution)
    ys = sol.evaluate(TQ)
    np.testing.assert_allclose(ys["x"], np.cos(w * TQ), atol=tol)
    np.testing.assert_allclose(ys["v"], -w * np.sin(w * TQ), atol=tol * w)
    dys = sol.derivative(TQ)
    np.testing.assert_allclose(dys["x"], -w * np.sin(w * TQ), atol=50 * tol)
    np.testing.assert_allclose(dys["v"], -(w**2) * np.cos(w * TQ), atol=50 * tol * w)


def test_nodes_are_the_steps_and_padding_repeats_the_end(x64):
    sol, info = _dense(decay, 1.0, 1.5, return_info=True)
    n = int(sol.num_steps)
    assert n == int(info.steps) > 5
    ts = np.asarray(sol.ts)
    assert ts[0] == SPAN[0] and ts[n] == SPAN[1]
    assert np.all(np.diff(ts[: n + 1]) > 0)
    np.testing.assert_array_equal(ts[n:], SPAN[1])
    np.testing.assert_array_equal(np.asarray(sol.ys)[n:], np.asarray(sol.ys)[n])
    # At the nodes the interpolant is the computed solution, and the same solve
    # with the nodes as output times gives it too.
    np.testing.assert_allclose(sol.evaluate(ts[: n + 1]), sol.ys[: n + 1], rtol=1e-14)
    np.testing.assert_allclose(sol.ys[: n + 1], np.exp(-1.5 * ts[: n + 1]), rtol=5e-7)
    # Dopri5's interpolant has the step's own derivative at both ends.
    np.testing.assert_allclose(sol.derivative(ts[: n + 1]), -1.5 * sol.ys[: n + 1], rtol=1e-12)
    # A scalar time gives a scalar; a 2-D array of times keeps its shape.
    assert sol.evaluate(0.3).shape == ()
    assert sol.evaluate(np.full((2, 3), 0.3)).shape == (2, 3)


@pytest.mark.parametrize("adjoint", ["backsolve", "checkpoint"])
def test_reverse_mode_against_closed_form(x64, adjoint):
    def loss(y0, k):
        ys = _dense(decay, y0, k, adjoint=adjoint).evaluate(TQ)
        return jnp.sum(jnp.sin(ys))

    y0, k = 1.2, 1.5
    g_y0, g_k = jax.jit(jax.grad(loss, (0, 1)))(y0, k)
    ys = y0 * np.exp(-k * TQ)
    np.testing.assert_allclose(g_y0, np.sum(np.cos(ys) * np.exp(-k * TQ)), rtol=1e-5)
    np.testing.assert_allclose(g_k, np.sum(np.cos(ys) * -TQ * ys), rtol=1e-5)


def _dense_at(k, adjoint="backsolve"):
    return _dense(decay, 1.0, k, adjoint=adjoint).evaluate(TQ)


def test_forward_mode(x64):
    k = 1.5
    np.testing.assert_allclose(jax.jacfwd(_dense_at)(k), -TQ * np.exp(-k * TQ), atol=2e-6)


@pytest.mark.slow
def test_hessian_and_grad_grad(x64):
    k = 1.5
    second = TQ[17] ** 2 * np.exp(-k * TQ[17])
    for adjoint in ("backsolve", "checkpoint"):
        h = jax.hessian(lambda k, a=adjoint: _dense_at(k, a)[17])(k)
        np.testing.assert_allclose(h, second, rtol=1e-5)
    gg = jax.grad(jax.grad(lambda k: _dense_at(k)[17]))(k)
    np.testing.assert_allclose(gg, second, rtol=1e-5)


def test_derivative_with_respect_to_the_query_time(x64):
    sol = _dense(decay, 1.0, 1.5)
    for t in (0.0, 0.37, 1.0, 2.0):
        np.testing.assert_allclose(jax.grad(sol.evaluate)(t), sol.derivative(t), rtol=1e-12)
        np.testing.assert_allclose(sol.derivative(t), -1.5 * np.exp(-1.5 * t), rtol=2e-5)


@pytest.mark.parametrize(
    "adjoint", ["checkpoint", pytest.param("backsolve", marks=pytest.mark.slow)]
)
def test_vmap_jit_and_per_element_steps(x64, adjoint):
    ks = jnp.array([0.5, 1.5, 6.0])
    sols = jax.jit(jax.vmap(lambda k: _dense(decay, 1.0, k)))(ks)
    assert sols.ts.shape == (3, 257)
    steps = np.asarray(sols.num_steps)
    assert steps[0] < steps[1] < steps[2]
    ys = jax.vmap(lambda s: s.evaluate(TQ))(sols)
    np.testing.assert_allclose(ys, np.exp(-np.outer(ks, TQ)), atol=2e-6)

    g = jax.vmap(jax.grad(lambda k: _dense(decay, 1.0, k, adjoint=adjoint).evaluate(0.9)))(ks)
    np.testing.assert_allclose(g, -0.9 * np.exp(-0.9 * ks), rtol=1e-5)
    gv = jax.jit(
        jax.grad(
            lambda ks: jnp.sum(
                jax.vmap(lambda k: _dense(decay, 1.0, k, adjoint=adjoint).evaluate(0.9))(ks)
            )
        )
    )(ks)
    np.testing.assert_allclose(gv, g, rtol=1e-10)


@pytest.mark.parametrize("method", [pytest.param("rodas5p", marks=pytest.mark.slow), "dopri5"])
def test_polynomials_by_chunks_match_every_row_at_once(x64, monkeypatch, method):
    """The polynomials are computed a chunk of steps at a time, the chunks past the
    last step skipped (`solution.POLYNOMIAL_CHUNK`): with chunks of 4 (the 62 rows
    padded to 64), solves whose steps end in different chunks give the coefficients of
    every row at once, one by one and under `vmap` (where a chunk is computed for the
    batch when any element reaches it), and the same gradients, which match the closed
    form."""
    from solvers.ode import solution

    ks = jnp.array([0.5, 1.5, 6.0])
    tq = 0.9

    def run(chunk):
        monkeypatch.setattr(solution, "POLYNOMIAL_CHUNK", chunk)
        dense = lambda k: _dense(decay, 1.0, k, method=method, max_steps=62)  # noqa: E731
        sols = jax.jit(jax.vmap(dense))(ks)
        grads = jax.jit(jax.vmap(jax.grad(lambda k: dense(k).evaluate(tq))))(ks)
        ones = [jax.jit(dense)(k).coeffs for k in ks]
        return sols, grads, ones

    sols, grads, ones = run(4)
    every, grads_every, ones_every = run(10**6)
    for c, c_every in zip(ones, ones_every):
        np.testing.assert_allclose(c, c_every, rtol=1e-13, atol=1e-15)
    steps = np.asarray(sols.num_steps)
    assert len(set(steps // 4)) == 3 and steps.max() > 8, steps
    np.testing.assert_allclose(sols.coeffs, every.coeffs, rtol=1e-13, atol=1e-15)
    # Past the last step: the constant polynomial of the end.
    for c, y, n in zip(np.asarray(sols.coeffs), np.asarray(sols.ys), steps):
        np.testing.assert_array_equal(c[n:, 0], np.broadcast_to(y[n], c[n:, 0].shape))
        np.testing.assert_array_equal(c[n:, 1:], 0)
    np.testing.assert_allclose(grads, grads_every, rtol=1e-12)
    np.testing.assert_allclose(grads, -tq * np.exp(-tq * ks), rtol=1e-5)


@pytest.mark.parametrize("method", [pytest.param("rodas5p", marks=pytest.mark.slow), "tsit5"])
def test_rows_by_blocks_match_rows_written_whole(x64, monkeypatch, method):
    """One small solve writes its dense rows (and its record) by blocks of steps
    (`outputs._by_blocks`); forced to write them whole, the same solve gives the same
    nodes, values, counts and gradient, also when its steps overflow `max_steps`."""
    from solvers.ode import outputs

    blocks = []
    block = outputs._block

    def spy(*args, **kw):
        blocks.append(block(*args, **kw))
        return blocks[-1]

    def run(whole, max_steps):
        monkeypatch.setattr(outputs, "_block", (lambda *args, **kw: 0) if whole else spy)
        kw = dict(method=method, max_steps=max_steps, throw=False, return_info=True)
        dense = lambda w: _dense(oscillator, {"x": 1.0, "v": 0.0}, w, **kw)  # noqa: E731
        sol, info = jax.jit(dense)(1.7)
        grad = jax.jit(jax.grad(lambda w: dense(w)[0].evaluate(1.3)["x"]))(1.7)
        return sol, info, grad

    for max_steps in (256, 20):
        sol, info, grad = run(False, max_steps)
        sol_w, info_w, grad_w = run(True, max_steps)
        assert int(info.status) == (0 if max_steps == 256 else 1)
        assert int(info.steps) == int(info_w.steps) and int(sol.num_steps) > 16
        np.testing.assert_array_equal(sol.ts, sol_w.ts)
        for a, b in zip(jax.tree_util.tree_leaves(sol.ys), jax.tree_util.tree_leaves(sol_w.ys)):
            np.testing.assert_array_equal(a, b)
        # (The polynomials, recomputed in two different programs, to rounding.)
        for a, b in zip(
            jax.tree_util.tree_leaves(sol.coeffs), jax.tree_util.tree_leaves(sol_w.coeffs)
        ):
            np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-13)
        if max_steps == 256:
            np.testing.assert_allclose(grad, grad_w, rtol=1e-12)
            np.testing.assert_allclose(grad, -1.3 * np.sin(1.7 * 1.3), rtol=1e-5)
    assert blocks and set(blocks) == {16}, blocks

    # A solve that fails on its way (y' = y^2 from 1 blows up at t = 1): the rows
    # past the last step are NaN either way.
    def blowup(y, t):
        return y**2

    def failing(whole):
        monkeypatch.setattr(outputs, "_block", (lambda *args, **kw: 0) if whole else spy)
        kw = dict(method=method, throw=False, return_info=True)
        return jax.jit(lambda: _dense(blowup, 1.0, **kw))()

    (sol, info), (sol_w, info_w) = failing(False), failing(True)
    assert int(info.status) != 0 and int(info.status) == int(info_w.status)
    n = int(info.steps)
    assert n == int(info_w.steps) > 16
    np.testing.assert_array_equal(sol.ts, sol_w.ts)
    np.testing.assert_array_equal(sol.ys, sol_w.ys)
    assert np.all(np.isnan(np.asarray(sol.ys)[n + 1 :])) and np.all(np.isfinite(sol.ys[: n + 1]))


def test_float32():
    sol = odeint(decay, jnp.float32(1.0), jnp.array(SPAN, jnp.float32), 1.5, dense=True,
                 rtol=1e-5, atol=1e-5, max_steps=128)  # fmt: skip
    assert sol.evaluate(0.5).dtype == jnp.float32
    np.testing.assert_allclose(sol.evaluate(TQ.astype(np.float32)), np.exp(-1.5 * TQ), atol=1e-4)


def test_first_use_inside_jit():
    """The interpolant's coefficients are worked out on first use; that first use may
    be inside a `jit` trace (a regression: the probe was staged out as tracers)."""
    from solvers.ode.interpolation import stage_polynomials

    stage_polynomials.cache_clear()
    f = jax.jit(lambda y0: odeint(lambda y, t: -y, y0, jnp.array([0.0, 1.0]), dense=True))
    sol = f(jnp.ones(2))
    np.testing.assert_allclose(sol.evaluate(0.5), np.exp(-0.5) * np.ones(2), rtol=1e-5)


def test_span_must_be_two_times():
    with pytest.raises(ValueError, match=r"dense=True, `t` is the span \[t0, t1\]"):
        odeint(decay, 1.0, jnp.linspace(0.0, 1.0, 5), 1.0, dense=True)


def test_span_is_not_differentiated():
    def f(t1):
        return odeint(decay, 1.0, jnp.stack([0.0, t1]), 1.0, dense=True).evaluate(0.5)

    for transform in (jax.grad, jax.jacfwd):
        with pytest.raises(
            NotImplementedError, match="not differentiable with respect to the span"
        ):
            transform(f)(1.0)


def test_evaluate_outside_the_span_raises():
    sol = _dense(decay, 1.0, 1.0)
    with pytest.raises(Exception, match="must lie inside the span"):
        jax.block_until_ready(sol.evaluate(2.5))


def test_too_many_steps_raises_or_reports(x64):
    with pytest.raises(Exception, match="status 1.*max_steps=4 steps kept for dense=True"):
        jax.block_until_ready(_dense(decay, 1.0, 1.0, max_steps=4).ys)
    sol, info = _dense(decay, 1.0, 1.0, max_steps=4, throw=False, return_info=True)
    assert int(info.status) == 1
    # What was kept is the trajectory up to where the solve stopped.
    assert float(sol.t1) <= float(info.t_final) < SPAN[1]
    np.testing.assert_allclose(sol.ys, np.exp(-np.asarray(sol.ts)), rtol=1e-6)
