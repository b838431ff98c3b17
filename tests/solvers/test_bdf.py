"""Variable-order BDF/NDF (`"bdf"`): the rescaling of its differences, its order
selection, its accuracy against SciPy's BDF, and a history carried through replays
and forward sensitivities (its derivatives against SciPy references are in
test_odeint_stiff.py and test_odeint_structured.py; every transformation in
test_odeint.py)."""

import dataclasses
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.integrate import solve_ivp

from implicitdiff import linear_solve
from solvers import odeint
from solvers.ode.fields import TangentField
from solvers.ode.loop import stepper
from solvers.ode.methods import BDF, StageTolerance, StepEnd, bdf, stage_report

from .stiff_problems import PROBLEMS, batch_script, bruss
from .test_odeint_stiff import _converged

pytestmark = pytest.mark.usefixtures("fast_compiles")


def _backward_differences(p, t, h, q):
    """`nabla^j p(t)` for `j <= q` on the grid `t, t - h, ...` (from the samples)."""
    rows = [np.array([p(t - i * h) for i in range(q + 1)])]
    out = [rows[0][0]]
    for _ in range(q):
        rows.append(rows[-1][:-1] - rows[-1][1:])
        out.append(rows[-1][0])
    return np.array(out)


@pytest.mark.parametrize("factor", [0.3, 1.0, 2.5])
@pytest.mark.parametrize("q", [1, 2, 3, 4, 5])
def test_rescaled_differences_are_those_of_the_new_spacing(x64, q, factor):
    """For a polynomial of degree `q` the differences of order `<= q` at one spacing
    determine those at any other: rescaling by `factor` gives exactly the differences
    on the grid `factor` times as fine (closed form from the samples)."""
    coeffs = np.array([0.7, -1.3, 0.4, 2.1, -0.6, 0.25])[: q + 1]
    p = lambda s: np.polyval(coeffs, s)  # noqa: E731
    t, h = 1.7, 0.35
    d = _backward_differences(p, t, h, q)
    ru = np.asarray(bdf._rescale_matrix(jnp.asarray(factor)))
    got = ru[: q + 1, : q + 1].T @ d
    np.testing.assert_allclose(got, _backward_differences(p, t, factor * h, q), atol=1e-12)


def test_small_system_step_has_no_matrix_product(x64):
    """A small system's step forms its history as sums of products: no matrix
    product in a small system's solve or gradient for XLA to hand to a threaded
    library (see `solvers.ode._small`)."""
    prob = PROBLEMS["rober"]

    def loss(p):
        f = lambda y, t, p: prob["f"](y, t, p, jnp)  # noqa: E731
        ys = odeint(f, jnp.asarray(prob["y0"]), jnp.array([0.0, 1.0]), p, method="bdf")
        return jnp.sum(ys[-1])

    p = jnp.asarray(prob["p"])
    for fn in (loss, jax.grad(loss)):
        hlo = jax.jit(fn).lower(p).as_text()
        assert "dot_general" not in hlo, "a small product: use solvers.ode._small"


def test_order_rises_on_a_smooth_problem(x64):
    """`y' = -y + cos t`: at order 5 a hundred times tighter tolerance costs about
    `100 ** (1/6)` times the steps (at order 1 it would be ten times); the error
    follows the tolerance (closed form)."""

    def exact(t):
        return 0.5 * (np.cos(t) + np.sin(t)) + 0.5 * np.exp(-t)

    ts = jnp.linspace(0.0, 10.0, 11)
    steps = {}
    for rtol in (1e-8, 1e-10):
        ys, info = odeint(
            lambda y, t: -y + jnp.cos(t), 1.0, ts, method="bdf", rtol=rtol, atol=rtol,
            return_info=True,
        )  # fmt: skip
        steps[rtol] = int(info.steps)
        assert np.max(np.abs(ys - exact(np.asarray(ts)))) < 50 * rtol
    assert steps[1e-10] < 2.5 * steps[1e-8], steps


def test_robertson_as_accurate_as_scipy_bdf(x64):
    """ROBER at rtol 1e-6: the error against SciPy's Radau at 1e-12 is no larger than
    SciPy's own BDF makes at the same tolerance (within a factor of 2)."""
    prob = PROBLEMS["rober"]
    p, y0 = np.asarray(prob["p"]), np.asarray(prob["y0"])
    ts = np.array([0.0, 40.0, 1e3, 1e5])

    def f(y, t, p):
        return prob["f"](y, t, p, jnp)

    def f_np(t, y):
        return np.asarray(prob["f"](y, t, p, np))

    kw = dict(rtol=1e-6, atol=1e-10)
    span = ts[[0, -1]]
    ref = solve_ivp(f_np, span, y0, method="Radau", t_eval=ts, rtol=1e-12, atol=1e-16)
    theirs = solve_ivp(f_np, span, y0, method="BDF", t_eval=ts, **kw)
    ours = odeint(f, jnp.asarray(y0), jnp.asarray(ts), jnp.asarray(p), method="bdf", **kw)

    def err(ys):
        return np.max(np.abs(ys - ref.y.T) / (1e-10 + 1e-6 * np.abs(ref.y.T)))

    assert err(np.asarray(ours)) < 2 * err(theirs.y.T), (err(np.asarray(ours)), err(theirs.y.T))


def test_plain_bdf_formulas(x64):
    """`BDF(ndf=False)`: the classical formulas, as accurate on a smooth problem."""

    def exact(t):
        return np.exp(-2 * t) * np.cos(3 * t)

    def f(y, t):
        return jnp.stack([-2 * y[0] - 3 * y[1], 3 * y[0] - 2 * y[1]])

    ts = jnp.linspace(0.0, 3.0, 7)
    for ndf in (True, False):
        ys = odeint(f, jnp.array([1.0, 0.0]), ts, method=BDF(ndf=ndf), rtol=1e-9, atol=1e-9)
        np.testing.assert_allclose(ys[:, 0], exact(np.asarray(ts)), atol=5e-8)


def test_history_survives_forward_sensitivities_and_vmap(x64):
    """The carry (differences, order, step size) of the pair `(y, v)` splits into the
    primal's and its tangent: forward mode matches reverse mode, and a vmapped solve
    matches each element's own."""

    def f(y, t, k):
        return jnp.stack([y[1], -k[0] * y[0] - k[1] * (y[0] ** 2 - 1) * y[1]])

    ts = jnp.linspace(0.0, 4.0, 5)

    def loss(k):
        return jnp.sum(odeint(f, jnp.array([2.0, 0.0]), ts, k, method="bdf", rtol=1e-8, atol=1e-8))

    k = jnp.array([1.0, 5.0])
    np.testing.assert_allclose(jax.jit(jax.jacfwd(loss))(k), jax.jit(jax.grad(loss))(k), rtol=1e-9)
    ks = jnp.array([[1.0, 5.0], [2.0, 1.0], [0.5, 20.0]])
    batched = jax.jit(jax.vmap(loss))(ks)
    one = jax.jit(loss)
    np.testing.assert_allclose(batched, [one(x) for x in ks], rtol=1e-12)


def test_factorisations_are_reused_and_counted(x64):
    """ROBER: the factorisation of `I - c J` serves several steps (far fewer than one
    per attempt, as in CVODE), every one of them counted with its Jacobian, and the
    solution is as accurate as with one per attempt (a Krylov solver, which keeps no
    factors, prepares every attempt)."""
    prob = PROBLEMS["rober"]

    def f(y, t, p):
        return prob["f"](y, t, p, jnp)

    p, y0 = jnp.asarray(prob["p"]), jnp.asarray(prob["y0"])
    ts = jnp.array([0.0, 40.0, 1e3])
    kw = dict(rtol=1e-6, atol=1e-10, return_info=True)
    ys, info = odeint(f, y0, ts, p, method="bdf", **kw)
    attempts = int(info.steps) + int(info.rejected)
    lus = int(info.num_factorisations)
    assert 1 <= lus < attempts / 3, (lus, attempts)
    assert int(info.num_jacobians) == lus
    krylov = BDF(linear_solver=linear_solve.GMRES(rtol=1e-12, throw=False))
    ys_k, info_k = odeint(f, y0, ts, p, method=krylov, **kw)
    assert int(info_k.num_factorisations) == int(info_k.steps) + int(info_k.rejected)
    ref = solve_ivp(
        lambda t, y: np.asarray(prob["f"](y, t, np.asarray(p), np)), (0.0, 1e3),
        np.asarray(y0), method="Radau", t_eval=np.asarray(ts), rtol=1e-12, atol=1e-16,
    ).y.T  # fmt: skip
    for out in (ys, ys_k):
        np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-9)


def test_brusselator_line_as_accurate_as_scipy_bdf(x64):
    """The Brusselator line (64 points, 128 states) at rtol 1e-6: at most SciPy's
    `BDF` error at the same tolerance (1.6e-5 against 2.3e-5), against SciPy's Radau
    at 1e-12, with few steps failing the error test."""
    points = 64
    f_np = bruss(points)
    x = np.arange(1, points + 1) / (points + 1)
    y0 = np.concatenate([1 + np.sin(2 * np.pi * x), 3 * np.ones(points)])
    p = np.array([1.0, 3.0, 0.02])
    ys, info = odeint(
        lambda y, t, p: f_np(y, t, p, jnp), jnp.asarray(y0), jnp.array([0.0, 10.0]),
        jnp.asarray(p), method="bdf", rtol=1e-6, atol=1e-6, return_info=True,
    )  # fmt: skip
    assert int(info.rejected) < 0.1 * int(info.steps)
    ref = solve_ivp(
        lambda t, y: f_np(y, t, p, np), (0.0, 10.0), y0, method="Radau", rtol=1e-12,
        atol=1e-12,
    ).y[:, -1]  # fmt: skip
    scipy_bdf = solve_ivp(
        lambda t, y: f_np(y, t, p, np), (0.0, 10.0), y0, method="BDF", rtol=1e-6, atol=1e-6
    ).y[:, -1]
    err = np.max(np.abs(np.asarray(ys[-1]) - ref))
    assert err < np.max(np.abs(scipy_bdf - ref)), err


def test_solution_is_smooth_in_the_parameters(x64):
    """VDPOL (eps = 1e-6) at rtol 1e-8, whose loss moves with its jumps: perturbing the
    parameters by up to thirty roundings leaves the computed loss within 1e-6 (no
    decision that rounding tips moves the solution by more than a small share of the
    tolerance), so forward and reverse mode, whose programs round differently, give
    the same derivative up to the rounding that d/d eps amplifies (1e-6 to 1.2e-5 by
    how the program is compiled). (Stopped at a tenth of the error test, CVODE's rule,
    the corrector moves the loss by 1e-3 and the two modes apart by 5e-3.)"""
    prob = PROBLEMS["vdpol"]
    ts, w = jnp.asarray(prob["ts"]), jnp.asarray(prob["w"])
    p, y0 = jnp.asarray(prob["p"]), jnp.asarray(prob["y0"])

    def loss(p):
        ys = odeint(
            lambda y, t, p: prob["f"](y, t, p, jnp), y0, ts, p, method="bdf", rtol=1e-8,
            atol=1e-8 * prob["atol_factor"], max_steps=16384,
        )  # fmt: skip
        return jnp.sum(ys[1:] * w)

    nearby = jax.jit(jax.vmap(lambda k: loss(p * (1 + k * 1e-15))))(jnp.arange(8.0))
    spread = (jnp.max(nearby) - jnp.min(nearby)) / jnp.abs(nearby[0])
    assert spread < 1e-6, spread
    g = jax.jit(jax.grad(loss))(p)
    fwd = jax.jit(jax.jacfwd(loss))(p)
    np.testing.assert_allclose(fwd, g, rtol=5e-5)


@pytest.mark.slow
def test_vmap_batch_of_sixteen():
    """Under `vmap` both branches of the reuse decision run: the fresh factorisation
    of a retried iteration must wait for the first (two at once on a two-core CPU
    wait for each other forever). In a subprocess, so that a hang fails the test.
    Each element matches its own solve."""
    out = subprocess.run(
        [sys.executable, "-c", batch_script("bdf")], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert float(out.stdout.strip().splitlines()[-1]) < 1e-9


def test_a_failed_reuse_counts_the_iterations_of_both_tries(x64):
    """A step whose kept factorisation fails (here the factors of `-I`, which send
    Newton's iteration the wrong way) factors afresh and iterates again from the same
    start: it ends where a step with no kept factors ends, having spent the same
    iterations plus the failed ones (at least one, at most `NEWTON_ITERS`)."""
    prob = PROBLEMS["rober"]
    f = lambda y, t, params: prob["f"](y, t, params[0], jnp)  # noqa: E731
    p, y = jnp.asarray(prob["p"]), jnp.asarray(prob["y0"])
    method, h = BDF(), 1e-4
    carry = method.initial_carry(y, f(y, 0.0, (p,)))
    for _ in range(3):
        y, _, carry, ok = method.step(f, y, carry, 0.0, h, (p,))
        assert bool(_converged(ok))
    mem = carry.memory
    assert float(mem.c) != 0  # a factorisation the next step of this size reuses
    solver = method.linear_solver
    wrong = solver.factors(solver.init(lambda v: -v, y))
    scalars = {name: getattr(mem, name) for name in bdf._SCALARS}

    def with_memory(factors, c):
        memory = bdf.BDFMemory.of(factors, y.dtype, **(scalars | {"c": c}))
        return dataclasses.replace(carry, memory=memory)

    y_fresh, _, carry_fresh, ok_fresh = method.step(
        f, y, with_memory(mem.factors, 0.0), 0.0, h, (p,)
    )
    y_retry, _, carry_retry, ok_retry = method.step(f, y, with_memory(wrong, mem.c), 0.0, h, (p,))
    fresh, retry = stage_report(ok_fresh), stage_report(ok_retry)
    assert bool(fresh.converged) and bool(retry.converged)
    assert int(carry_fresh.memory.work) == int(carry_retry.memory.work) == 1
    np.testing.assert_allclose(y_retry, y_fresh, rtol=1e-13, atol=0)
    failed = int(retry.iterations) - int(fresh.iterations)
    assert 1 <= failed <= bdf.NEWTON_ITERS, (int(retry.iterations), int(fresh.iterations))


def test_replay_with_a_known_end_gives_the_step_and_its_derivative(x64):
    """`replay_step` with the step's end known takes it as the corrector's solution:
    the same step, and the same pull-back (the implicit derivative at that end) as the
    step that iterates, to the corrector's tolerance."""
    prob = PROBLEMS["rober"]
    f = lambda y, t, params: prob["f"](y, t, params[0], jnp)  # noqa: E731
    p, y0 = jnp.asarray(prob["p"]), jnp.asarray(prob["y0"])
    method = BDF()
    carry = method.initial_carry(y0, f(y0, 0.0, (p,)))
    for _ in range(3):  # a few steps, so the history has differences of its own
        y0, _, carry, ok = method.step(f, y0, carry, 0.0, 1e-4, (p,))
        assert bool(_converged(ok))
    h = 2e-4
    y1 = method.step(f, y0, carry, 0.0, h, (p,))[0]
    assert method.replay_end(carry) is None  # BDF reads its end state only

    def run(y, p, end):
        if end is None:
            out = method.step_with_stages(f, y, carry, 0.0, h, (p,))
        else:
            out = method.replay_step(f, y, carry, 0.0, h, (p,), end)
        return out[0], out[2].k, out[2].D

    plain, pullback = jax.vjp(lambda y, p: run(y, p, None), y0, p)
    cts = jax.tree_util.tree_map(
        lambda x: jnp.cos(jnp.arange(x.size) + 0.3).reshape(x.shape), plain
    )
    got, pullback_known = jax.vjp(lambda y, p: run(y, p, StepEnd(y1, None)), y0, p)
    for a, b in zip(got, plain):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-14)
    for a, b in zip(pullback_known(cts), pullback(cts)):
        np.testing.assert_allclose(a, b, rtol=1e-7)
    # The end is taken as given, not recomputed.
    other = y1 + 1e-3
    np.testing.assert_array_equal(run(y0, p, StepEnd(other, None))[0], other)


@pytest.mark.parametrize("n", [3, 100])
def test_difference_update_is_the_recurrence(x64, n):
    """The differences after a step of each order, as one product (`_update_differences`),
    against the recurrence written out row by row: `D[q+2] = d - D[q+1]`, `D[q+1] = d`,
    then `D[j] += D[j+1]` for `j = q, ..., 0`."""
    rng = np.random.default_rng(n)
    D, d = rng.normal(size=(bdf.MAX_ORDER + 3, n)), rng.normal(size=n)
    for q in range(1, bdf.MAX_ORDER + 1):
        want = D.copy()
        want[q + 2] = d - D[q + 1]
        want[q + 1] = d
        for j in range(q, -1, -1):
            want[j] += want[j + 1]
        got = bdf._update_differences(jnp.asarray(D), jnp.asarray(d), jnp.asarray(q))
        np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-14)


@pytest.mark.slow
def test_history_as_products_is_the_history_by_rows(x64, monkeypatch):
    """A system of `HISTORY_PRODUCTS_MIN` states or more forms its prediction and
    updated differences as products with the differences (`_History`), a smaller one
    row by row: over twenty steps of a Brusselator line (32 states) whose size changes
    (rescaled differences) and whose order rises to 3, both forms give the same
    solution, differences and orders, and the same pull-back of all of it to the
    start and the parameters, to rounding. The products' update adds `b d^T` as a
    broadcast product, or as a matrix product for a large system (`PRODUCT_MIN`,
    forced here), whose derivative with respect to `d` is a product too."""
    prob = PROBLEMS["bruss16"]
    f = lambda y, t, params: prob["f"](y, t, params[0], jnp)  # noqa: E731
    p, y0 = jnp.asarray(prob["p"]), jnp.asarray(prob["y0"])
    method = BDF()
    sizes = [1e-3] * 4 + [1.5e-3] * 5 + [1.2e-3] * 6 + [2e-3] * 5

    def run(y, p):
        carry = method.initial_carry(y, f(y, 0.0, (p,)))
        t, orders, good = 0.0, [], True
        for h in sizes:
            y, _, carry, ok = method.step(f, y, carry, t, h, (p,))
            t, orders, good = (
                t + h,
                [*orders, carry.memory.order],
                good & _converged(ok),
            )
        return (y, carry.D), (good, jnp.stack(orders))

    from solvers.ode import _small

    results = []
    # Products as matrix products (the update's outer product too), products as sums,
    # rows.
    for least, product_min in ((y0.size, 1), (y0.size, _small.PRODUCT_MIN), (y0.size + 1, 1)):
        monkeypatch.setattr(bdf, "HISTORY_PRODUCTS_MIN", least)
        monkeypatch.setattr(_small, "PRODUCT_MIN", product_min)
        zero = jnp.zeros((bdf.MAX_ORDER + 3, y0.size))
        form = bdf._History.of(zero, jnp.asarray(1), jnp.asarray(1.0), jnp.zeros((2, 8)))
        assert form.products == (least == y0.size)
        # A new function each time: `jit` caches its trace by the function.
        out, pullback, aux = jax.vjp(jax.jit(lambda y, p: run(y, p)), y0, p, has_aux=True)
        cts = jax.tree_util.tree_map(
            lambda x: jnp.cos(jnp.arange(x.size) + 0.3).reshape(x.shape), out
        )
        results.append((out, pullback(cts), aux))
    out_b, bar_b, (ok_b, q_b) = results[-1]
    assert bool(ok_b) and int(q_b.max()) >= 3
    for out_a, bar_a, (ok_a, q_a) in results[:-1]:
        assert bool(ok_a)
        np.testing.assert_array_equal(q_a, q_b)
        for a, b in zip((*out_a, *bar_a), (*out_b, *bar_b)):
            np.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-11 * float(jnp.max(jnp.abs(b))))


def test_replay_with_a_known_end_reads_only_the_recorded_carry(x64):
    """The checkpointed adjoint records each step's carry without the factorisation
    (`replay_carry`): a replay with the end known gives the same step and pull-back
    from it as from the whole carry, and so does the forward sensitivities' pair,
    whose step is the derivative of the primal step."""
    prob = PROBLEMS["rober"]
    f = lambda y, t, params: prob["f"](y, t, params[0], jnp)  # noqa: E731
    p, y0 = jnp.asarray(prob["p"]), jnp.asarray(prob["y0"])
    method = BDF()
    carry = method.initial_carry(y0, f(y0, 0.0, (p,)))
    for _ in range(3):
        y0, _, carry, ok = method.step(f, y0, carry, 0.0, 1e-4, (p,))
        assert bool(_converged(ok))
    kept = method.replay_carry(carry)
    assert kept.memory.factors is None and carry.memory.factors is not None
    np.testing.assert_array_equal(kept.D, carry.D)
    h = 2e-4
    end = StepEnd(method.step(f, y0, carry, 0.0, h, (p,))[0], None)

    def run(y, p, c):
        out = method.replay_step(f, y, c, 0.0, h, (p,), end)
        return out[0], out[2].k, out[2].D

    whole, pull_whole = jax.vjp(lambda y, p: run(y, p, carry), y0, p)
    part, pull_part = jax.vjp(lambda y, p: run(y, p, kept), y0, p)
    cts = jax.tree_util.tree_map(
        lambda x: jnp.sin(jnp.arange(x.size) + 0.7).reshape(x.shape), whole
    )
    for a, b in zip(part + pull_part(cts), whole + pull_whole(cts)):
        np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-300)

    # The pair (y, v): the field `(f, J v + df/dp dp)` with one parameter tangent.
    field = TangentField(lambda y, t, pd, pn: prob["f"](y, t, pd[0], jnp), 3, 1)
    v0 = jnp.array([1e-3, -2e-3, 1e-3])
    z0, params = jnp.concatenate([y0, v0]), ((p, p * 1e-2), None)
    kz = field.initial_carry(method, z0, field(z0, 0.0, *params))
    # A loose corrector test, and a step size whose corrector reuses the last
    # factorisation: iterating again from the recorded carry would end elsewhere.
    tol = StageTolerance(rtol=1e-4, atol=1e-8)
    for _ in range(3):
        z0, _, kz, ok, _ = field.step(method, z0, kz, 0.0, 1e-4, params, tol)
        assert bool(_converged(ok))
    step = stepper(field, method)
    z1, _, kz1, _, _ = step(z0, kz, 0.0, 1.1e-4, params, tol)
    assert kz1.memory.work == 0  # (the factorisation was reused)
    kept = method.replay_carry(kz)
    z1_kept = step(z0, kept, 0.0, 1.1e-4, params, tol, StepEnd(z1, None))[0]
    np.testing.assert_allclose(z1_kept, z1, rtol=1e-12, atol=1e-300)
    # The tangent half is computed again, not taken from the end.
    off = StepEnd(z1.at[3:].add(1.0), None)
    np.testing.assert_allclose(
        step(z0, kept, 0.0, 1.1e-4, params, tol, off)[0], z1,
        rtol=1e-12, atol=1e-300,
    )  # fmt: skip
