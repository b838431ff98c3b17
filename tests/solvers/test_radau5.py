"""Radau IIA of order 5 (`"radau5"`): its coefficients, order, stiff decay, interpolant,
and batches (its derivatives against SciPy references are in test_odeint_stiff.py and
test_odeint_structured.py; every transformation in test_odeint.py)."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from implicitdiff import linear_solve
from solvers import odeint
from solvers.ode import CheckpointAdjoint
from solvers.ode.adjoints import sweep
from solvers.ode.methods import Radau5, StageTolerance, StepEnd, _reuse, radau5

from .stiff_problems import PROBLEMS, batch_script
from .test_odeint_stiff import REFS, _converged, _loss, _point, _rel

pytestmark = pytest.mark.usefixtures("fast_compiles")


def test_coefficients():
    """Collocation at the Radau points (row sums of A are c), stiffly accurate (the
    last row is the weights 16-sqrt6/36, 16+sqrt6/36, 1/9), and T^-1 A^-1 T has the
    real eigenvalue and the complex pair in the layout the iteration assumes."""
    a, c = radau5.A, np.asarray(radau5.C)
    np.testing.assert_allclose(a.sum(axis=1), c, rtol=1e-15, atol=1e-16)
    s6 = np.sqrt(6.0)
    np.testing.assert_allclose(a[-1], [(16 - s6) / 36, (16 + s6) / 36, 1 / 9], rtol=1e-15)
    # B(5): the quadrature sum_i b_i c_i^(k-1) = 1/k is exact up to degree 4.
    for k in range(1, 6):
        assert abs(a[-1] @ c ** (k - 1) - 1 / k) < 1e-15
    block = radau5.T_INV @ np.linalg.inv(a) @ radau5.T
    gamma, alpha, beta = 3 + 3 ** (2 / 3) - 3 ** (1 / 3), radau5._ALPHA, radau5._BETA
    expected = [[gamma, 0, 0], [0, alpha, beta], [0, -beta, alpha]]
    np.testing.assert_allclose(block, expected, atol=1e-12)


def _exact(t):  # y' = y cos t, y(0) = 1
    return jnp.exp(jnp.sin(t))


def test_local_error_is_of_order_six(x64):
    """One step of size h on y' = y cos t: the local error of an order-5 method falls
    by 2^6 when h halves."""

    def f(y, t, p):
        return y * jnp.cos(t)

    m = Radau5()
    tol = StageTolerance(rtol=1e-14, atol=1e-14)
    t0 = 0.3
    y0 = _exact(t0)[None]
    errors = []
    for h in (0.2, 0.1, 0.05):
        y1 = m.step(f, y0, m.initial_carry(y0, f(y0, t0, ())), t0, h, (), tol=tol)[0]
        errors.append(abs(float(y1[0] - _exact(t0 + h))))
    ratios = [errors[0] / errors[1], errors[1] / errors[2]]
    assert all(50 < r < 80 for r in ratios), (errors, ratios)


def test_extrapolated_start_is_exact_on_a_cubic(x64):
    """The start extrapolates the collocation polynomial, a cubic through `y` and the
    three stages: for increments taken from a cubic, it is that cubic's increments at
    the new points, `u(1 + c_i r) - u(1)`, for any step ratio `r` (zero for r = 0)."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((3, 4))  # u(theta) = y + a1 theta + a2 theta^2 + a3 theta^3

    def u(theta):
        return sum(a[p] * theta ** (p + 1) for p in range(3))  # minus y

    z = np.stack([u(c) for c in radau5.C], axis=1)  # (n, 3)
    for r in (0.0, 0.5, 1.0, 1.7):
        got = np.asarray(radau5.extrapolated_start(jnp.asarray(z), r))
        want = np.stack([u(1 + c * r) - u(1.0) for c in radau5.C], axis=1)
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_a_step_starts_from_the_last_steps_polynomial(x64, monkeypatch):
    """A step's carry holds its stage increments and size; the next step's iteration
    starts from their extrapolation and takes fewer iterations than from zero (a
    fresh carry), for the same stages within the iteration's tolerance. A step far
    longer than the last starts from zero."""
    iterations, starts = [], []
    newton = radau5.simplified_newton

    def counted(*args, **kwargs):
        out = newton(*args, **kwargs)
        jax.debug.callback(lambda i: iterations.append(int(i)), out[3])
        # The start, back from the iteration's transformed increments.
        jax.debug.callback(lambda x: starts.append(np.asarray(x)), radau5._mix(radau5.T, args[1]))
        return out

    monkeypatch.setattr(radau5, "simplified_newton", counted)

    def f(y, t, p):
        return jnp.stack([y[0] * jnp.cos(t), -2.0 * y[1] + jnp.sin(t) * y[0]])

    m = Radau5()
    tol = StageTolerance(rtol=1e-10, atol=1e-10)
    t0, h = 0.3, 0.1
    y0 = jnp.array([1.0, 0.5])
    y1, _, carry1, ok, _ = m.step_with_stages(
        f, y0, m.initial_carry(y0, f(y0, t0, ())), t0, h, (), tol=tol
    )
    z, h_kept = carry1.start.unpack(2)
    np.testing.assert_allclose(z[:, 2], y1 - y0, rtol=1e-14)
    assert float(h_kept) == h and bool(_converged(ok))
    iterations.clear()
    starts.clear()
    t1 = t0 + h
    y2, *_ = m.step_with_stages(f, y1, carry1, t1, 1.3 * h, (), tol=tol)
    fresh = m.initial_carry(y1, f(y1, t1, ()))
    y2_fresh, *_ = m.step_with_stages(f, y1, fresh, t1, 1.3 * h, (), tol=tol)
    extrapolated, from_zero = iterations
    assert extrapolated < from_zero, iterations
    want = radau5.extrapolated_start(z, 1.3)
    np.testing.assert_allclose(starts[0], want, rtol=1e-12, atol=1e-15)
    assert np.all(starts[1] == 0) and np.any(starts[0] != 0)
    np.testing.assert_allclose(y2, y2_fresh, rtol=1e-9)
    # A step more than START_RATIO_MAX times as long starts from zero, as a fresh one.
    long = 2 * radau5.START_RATIO_MAX * h
    iterations.clear()
    starts.clear()
    y3 = m.step_with_stages(f, y1, carry1, t1, long, (), tol=tol)[0]
    y3_fresh = m.step_with_stages(f, y1, fresh, t1, long, (), tol=tol)[0]
    assert iterations[0] == iterations[1], iterations
    assert np.all(starts[0] == 0)
    np.testing.assert_array_equal(y3, y3_fresh)


def test_replay_takes_the_stages_from_the_steps_end(x64, monkeypatch):
    """`replay_step` reads the step's stages from the carry it handed on: no
    iteration and no factorisation, and the same step, carry values and pull-back
    (the implicit derivative at the same stages) as the step that iterated, to the
    last bit. The stages are taken as given, not recomputed."""
    prob = PROBLEMS["rober"]
    f = lambda y, t, params: prob["f"](y, t, params[0], jnp)  # noqa: E731
    p, y0 = jnp.asarray(prob["p"]), jnp.asarray(prob["y0"])
    m = Radau5()
    carry = m.initial_carry(y0, f(y0, 0.0, (p,)))
    for _ in range(3):  # a few steps, so the iteration starts from a polynomial
        y0, _, carry, ok = m.step(f, y0, carry, 0.0, 1e-3, (p,))
        assert bool(_converged(ok))
    h = 3e-3
    y1, _, carry1, _ = m.step(f, y0, carry, 0.0, h, (p,))
    end = StepEnd(y1, m.replay_end(m.replay_carry(carry1)))

    def run(y, p, end):
        if end is None:
            out = m.step_with_stages(f, y, carry, 0.0, h, (p,))
        else:
            out = m.replay_step(f, y, m.replay_carry(carry), 0.0, h, (p,), end)
        return out[0], out[2].k, out[4]

    plain, pullback = jax.vjp(lambda y, p: run(y, p, None), y0, p)
    cts = jax.tree_util.tree_map(
        lambda x: jnp.cos(jnp.arange(x.size) + 0.3).reshape(x.shape), plain
    )
    calls = []
    monkeypatch.setattr(radau5, "simplified_newton", lambda *a, **k: calls.append(1))
    got, pullback_known = jax.vjp(lambda y, p: run(y, p, end), y0, p)
    assert not calls
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(plain)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(pullback_known(cts), pullback(cts)):
        np.testing.assert_array_equal(a, b)
    z, _ = carry1.start.unpack(3)
    other = StepEnd(y1, radau5.StageStart.pack(2 * z, h))
    np.testing.assert_array_equal(run(y0, p, other)[0], y0 + 2 * z[:, 2])


def test_stiff_component_decays_in_one_step(x64):
    """L-stability and stiff accuracy: on y' = -1e8 (y - cos t), from 4 off the slow
    solution, one step of size 1 lands on it, where an A-stable method that is not
    L-stable (the trapezoidal rule) would keep an offset of 4."""

    def f(y, t, p):
        return -1e8 * (y - jnp.cos(t))

    y0 = jnp.array([5.0])
    tol = StageTolerance(rtol=1e-10, atol=1e-10)
    m = Radau5()
    y1, _, _, ok = m.step(f, y0, m.initial_carry(y0, f(y0, 0.0, ())), 0.0, 1.0, (), tol=tol)
    assert bool(_converged(ok))
    # The slow solution is cos t + O(1e-8); the step's own error on it is about 1e-7.
    assert abs(float(y1[0]) - np.cos(1.0)) < 1e-6


def test_interpolant_is_the_collocation_polynomial(x64):
    """`interpolate=True` outputs inside the steps match the exact solution to the
    tolerance (the collocation polynomial through the stages)."""

    def f(y, t):
        return y * jnp.cos(t)

    ts = jnp.linspace(0.0, 6.0, 61)
    ys, info = odeint(
        f, jnp.array([1.0]), ts, method="radau5", rtol=1e-6, atol=1e-6,
        interpolate=True, return_info=True,
    )  # fmt: skip
    assert int(info.steps) < 60  # so outputs lie inside steps
    np.testing.assert_allclose(ys[:, 0], _exact(ts), rtol=3e-6)


def test_vmap_batch_of_sixteen():
    """A batch large enough for the LU factorisations to split over the CPU thread
    pool: the two factorisations of a step must run one after the other (with both
    at once on a two-core machine, each waits for the other forever). Run in a
    subprocess, so that a hang fails the test instead of stalling the suite. Each
    element matches its own solve."""
    out = subprocess.run(
        [sys.executable, "-c", batch_script("radau5")], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert float(out.stdout.strip().splitlines()[-1]) < 1e-9


def test_coupled_bandwidths():
    """`coupled(m)` widens a band for m interleaved copies, and leaves a dense or
    matrix-free solver as it is."""
    band = linear_solve.Banded(lower=2, upper=1, throw=False)
    assert band.coupled(3) == linear_solve.Banded(lower=8, upper=5, throw=False)
    assert band.coupled(1) == band
    dense = linear_solve.Dense()
    assert dense.coupled(2) is dense


class _RealOnly(linear_solve.Banded):
    """`Banded` as a solver of real systems only: Radau5 then solves its complex pair as
    the real system of twice the size."""

    solves_complex = False


@pytest.mark.slow
def test_complex_pair_solved_either_way_gives_the_same_solution(x64):
    """The complex system of the iteration factored in complex arithmetic (a direct
    solver) and as the real system of twice the size (a solver of real systems only):
    the same steps, states and gradient to rounding, on a Brusselator line with a
    banded solver. (Dense's complex path is checked by every radau5 reference test.)"""
    n = 8

    def line(y, t, p):  # the Brusselator, each point's (u, v) stored together
        z = y.reshape(n, 2)
        padded = jnp.concatenate([jnp.array([[1.0, 3.0]]), z, jnp.array([[1.0, 3.0]])])
        lap = (padded[:-2] - 2 * z + padded[2:]) * p[2] * (n + 1) ** 2
        u, v = z[:, 0], z[:, 1]
        du = p[0] + u * u * v - (p[1] + 1) * u
        dv = p[1] * u - u * u * v
        return (jnp.stack([du, dv], axis=1) + lap).reshape(-1)

    x = np.arange(1, n + 1) / (n + 1)
    y0 = jnp.asarray(np.stack([1 + np.sin(2 * np.pi * x), 3 * np.ones(n)], axis=1).ravel())
    p = jnp.array([1.0, 3.0, 0.02])
    ts = jnp.linspace(0.0, 5.0, 4)
    results = []
    for solver in (linear_solve.Banded(3, 3, throw=False), _RealOnly(3, 3, throw=False)):
        kw = dict(method="radau5", rtol=1e-8, atol=1e-8, linear_solver=solver)
        ys, info = odeint(line, y0, ts, p, return_info=True, **kw)
        grad = jax.grad(lambda p, kw=kw: jnp.sum(odeint(line, y0, ts, p, **kw)[-1]))(p)
        results.append((ys, int(info.steps), grad))
    assert linear_solve.Banded(3, 3).solves_complex and not _RealOnly(3, 3).solves_complex
    (ys, steps, grad), (ys_real, steps_real, grad_real) = results
    assert steps_real == steps > 10
    np.testing.assert_allclose(ys_real, ys, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(grad_real, grad, rtol=1e-8)


def _counts(info):
    return int(info.steps) + int(info.rejected), int(info.num_factorisations)


def test_factors_reused_while_the_step_size_holds(x64, monkeypatch):
    """On the Brusselator of 16 points (32 states) at rtol 1e-8, a step whose size the
    controller kept reuses the last step's two factorisations: fewer than half as many
    as one pair per attempt (a third here), each pair with its Jacobian, for the same
    solution within the tolerance (and SciPy's Radau reference)."""
    prob = PROBLEMS["bruss16"]
    rtol = 1e-8

    def f(y, t, p):
        return prob["f"](y, t, p, jnp)

    def solve():
        ys, info = odeint(
            f, jnp.asarray(prob["y0"]), jnp.asarray(prob["ts"]), jnp.asarray(prob["p"]),
            method="radau5", rtol=rtol, atol=rtol * prob["atol_factor"], return_info=True,
        )  # fmt: skip
        return float(jnp.sum(ys[1:] * jnp.asarray(prob["w"]))), info

    loss, info = solve()
    attempts, factorisations = _counts(info)
    assert int(info.num_jacobians) * 2 == factorisations
    assert factorisations < 0.5 * 2 * attempts, (factorisations, attempts)
    monkeypatch.setattr(_reuse, "REUSE_MIN_STATES", 10**9)  # one pair per attempt
    loss_fresh, info_fresh = solve()
    assert _counts(info_fresh)[1] == 2 * _counts(info_fresh)[0]
    ref = REFS["bruss16"]["loss"]
    steps = int(info.steps)
    assert abs(loss - ref) < 10 * steps * rtol * abs(ref)
    assert abs(loss - loss_fresh) < 10 * steps * rtol * abs(ref)


def _forced_reuse_on_rober(monkeypatch):
    """ROBER's loss at rtol 1e-8 with reuse forced (3 states, below
    `REUSE_MIN_STATES`), its gradient at the reference point and its step count."""
    monkeypatch.setattr(_reuse, "REUSE_MIN_STATES", 1)
    rtol = 1e-8
    loss, steps = _loss("rober", rtol, "radau5")
    p, y0 = _point("rober")
    gp, gy = jax.jit(jax.grad(loss, argnums=(0, 1)))(p, y0)
    return loss, (p, y0), (gp, gy), int(jax.jit(steps)(p, y0)), rtol


def test_reused_factors_give_the_gradient_in_both_modes(x64, monkeypatch):
    """Reuse forced on ROBER: it reuses (fewer than half the factorisations of one pair
    per attempt), the gradient matches central differences of SciPy's Radau at 1e-12,
    and forward mode repeats it to rounding."""
    loss, (p, y0), (gp, gy), n, rtol = _forced_reuse_on_rober(monkeypatch)
    prob = PROBLEMS["rober"]
    info = odeint(
        lambda y, t, p: prob["f"](y, t, p, jnp), y0, jnp.asarray(prob["ts"]), p,
        method="radau5", rtol=rtol, atol=rtol * prob["atol_factor"], return_info=True,
    )[1]  # fmt: skip
    attempts, factorisations = _counts(info)
    assert factorisations < 0.5 * 2 * attempts, (factorisations, attempts)
    ref = REFS["rober"]
    bound = 10 * n * rtol
    assert _rel(gp, ref["grad_p"]) < bound, (_rel(gp, ref["grad_p"]), bound)
    assert _rel(gy, ref["grad_y0"]) < bound, (_rel(gy, ref["grad_y0"]), bound)
    fp, fy = jax.jit(jax.jacfwd(loss, argnums=(0, 1)))(p, y0)
    np.testing.assert_allclose(fp, gp, rtol=1e-9, atol=1e-12 * np.max(np.abs(gp)))
    np.testing.assert_allclose(fy, gy, rtol=1e-9, atol=1e-12 * np.max(np.abs(gy)))


@pytest.mark.slow
def test_reused_factors_under_vmap_and_a_segmented_replay(x64, monkeypatch):
    """Reuse forced on ROBER: `vmap` of the gradient (each element deciding its own
    reuse) and a checkpointed replay in segments of 32 steps, linearised eight at a
    time (the replays start from the recorded factors), repeat the gradient."""
    loss, (p, y0), (gp, _), n, rtol = _forced_reuse_on_rober(monkeypatch)
    ps = jnp.stack([p, p * jnp.array([1.01, 1.0, 0.99])])
    batched = jax.jit(jax.vmap(jax.grad(loss), in_axes=(0, None)))(ps, y0)
    one = jax.jit(jax.grad(loss))(ps[1], y0)
    np.testing.assert_allclose(batched[0], gp, rtol=1e-10, atol=1e-14 * np.max(np.abs(gp)))
    np.testing.assert_allclose(batched[1], one, rtol=1e-10, atol=1e-14 * np.max(np.abs(one)))
    monkeypatch.setattr(sweep, "LINEARIZE_MIN_STATES", 1)
    seg_loss, _ = _loss("rober", rtol, "radau5", adjoint=CheckpointAdjoint(1024, checkpoints=32))
    assert n > 2 * 32
    gs = jax.jit(jax.grad(seg_loss))(p, y0)
    np.testing.assert_allclose(gs, gp, rtol=1e-10, atol=1e-14 * np.max(np.abs(gp)))


@pytest.mark.slow
def test_a_krylov_solver_prepares_every_step(x64):
    """A solver that keeps no factors (GMRES, the complex system as a real one of twice
    the size) prepares both systems at every attempt, and solves as the dense LU does
    (the Brusselator of 16 points, 32 states)."""
    prob = PROBLEMS["bruss16"]
    rtol = 1e-6

    def solve(method):
        return odeint(
            lambda y, t, p: prob["f"](y, t, p, jnp), jnp.asarray(prob["y0"]),
            jnp.asarray(prob["ts"]), jnp.asarray(prob["p"]), method=method, rtol=rtol,
            atol=rtol * prob["atol_factor"], return_info=True,
        )  # fmt: skip

    krylov = Radau5(linear_solver=linear_solve.GMRES(rtol=1e-12, throw=False))
    ys, info = solve(krylov)
    attempts, factorisations = _counts(info)
    assert factorisations == 2 * attempts and int(info.num_jacobians) == attempts
    ys_dense, _ = solve("radau5")
    np.testing.assert_allclose(ys, ys_dense, rtol=1e-4)
