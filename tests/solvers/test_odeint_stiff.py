"""`odeint` on stiff problems: derivatives against SciPy references, the checkpointed
adjoint's replays, backward instability refused, the implicit step's own consistency."""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.integrate

from solvers import odeint
from solvers.ode import CheckpointAdjoint
from solvers.ode import methods as ode_methods
from solvers.ode.adjoints import sweep

from .stiff_problems import POLLU_AT_60, PROBLEMS, load_references

pytestmark = pytest.mark.usefixtures("fast_compiles")

REFS = load_references()


def _converged(ok):
    """Whether a step's stage equations were solved (its `ok`, a bool or a report)."""
    return ode_methods.stage_report(ok).converged


def _rel(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def _loss(name, rtol, method="kvaerno5", **kw):
    """`loss(p, y0) = sum_i w . y(t_i)` over the outputs after `t[0]`."""
    prob = PROBLEMS[name]
    ts, w = jnp.asarray(prob["ts"]), jnp.asarray(prob["w"])
    atol = rtol * prob["atol_factor"]

    def f(y, t, p):
        return prob["f"](y, t, p, jnp)

    def loss(p, y0):
        ys = odeint(f, y0, ts, p, method=method, rtol=rtol, atol=atol, mxstep=1e6, **kw)
        return jnp.sum(ys[1:] * w)

    def steps(p, y0):
        info = odeint(
            f, y0, ts, p, method=method, rtol=rtol, atol=atol, mxstep=1e6,
            return_info=True, **kw,
        )[1]  # fmt: skip
        return info.steps

    return loss, steps


def _point(name):
    prob = PROBLEMS[name]
    return jnp.asarray(prob["p"]), jnp.asarray(prob["y0"])


def test_pollu_is_the_test_sets_problem():
    """The transcription of POLLU (its 25 reactions and 20 species) reproduces the test
    set's solution at t = 60, solved by SciPy's Radau."""
    prob = PROBLEMS["pollu"]
    p = np.asarray(prob["p"])
    sol = scipy.integrate.solve_ivp(
        lambda t, y: prob["f"](y, t, p, np), (0.0, 60.0), np.asarray(prob["y0"], float),
        method="Radau", rtol=1e-10, atol=1e-14,
    )  # fmt: skip
    ref = np.asarray(POLLU_AT_60)
    assert sol.success
    assert np.max(np.abs(sol.y[:, -1] - ref) / np.maximum(np.abs(ref), 1e-12)) < 1e-9


# ---------------------------------------------------------------------------
# Derivatives against central differences of SciPy's Radau at rtol 1e-12.
#
# Error control bounds each step's local error by the tolerance, so the global error of
# `n` steps is at most about `n` times it (more where the problem amplifies errors).
# The derivatives of the computed solution carry the same kind of error; they are
# checked against `10 n rtol`, relative to the largest entry.


def _reference_cases():
    fast = {"rober", "bruss16"}
    for method in ("kvaerno5", "rodas5p", "rodas4", "radau5", "bdf"):
        for name in ("rober", "hires", "bruss16", "orego", "pollu"):
            slow = name not in fast or (method != "kvaerno5" and name != "rober")
            yield pytest.param(name, method, id=f"{name}-{method}",
                               marks=[pytest.mark.slow] if slow else [])  # fmt: skip


@pytest.mark.parametrize(("name", "method"), list(_reference_cases()))
def test_derivatives_match_scipy_references(x64, name, method):
    rtol = 1e-8
    # A 4th-order method takes many steps at this tolerance (OREGO: over 4096), a
    # multistep method more.
    kw = dict(max_steps=16384) if method in ("rodas4", "bdf") else {}
    loss, steps = _loss(name, rtol, method, **kw)
    p, y0 = _point(name)
    ref = REFS[name]
    n = int(jax.jit(steps)(p, y0))
    bound = 10 * n * rtol
    value, (gp, gy) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(p, y0)
    assert _rel(value, ref["loss"]) < bound
    assert _rel(gp, ref["grad_p"]) < bound, (_rel(gp, ref["grad_p"]), bound)
    assert _rel(gy, ref["grad_y0"]) < bound, (_rel(gy, ref["grad_y0"]), bound)
    # Forward sensitivities differentiate the same computed solution as the
    # checkpointed adjoint (a stiff method's default): the two agree to rounding. The
    # rounding grows with the span and the steps (ROBER to 1e8: 2e-9 for radau5, 1e-8
    # for bdf, whose history couples several times more steps). POLLU's fastest rate
    # (4.4e11 on species 16) gives the stage matrix a condition number near 1e9, and
    # the solves and transposed solves round to that times eps on the entries that
    # reach it: with rodas5p 2e-8 on d/dy16(0) and 1e-14 on the others; the other
    # methods stay within 1e-9.
    modes = 1e-7 if name == "pollu" else 1e-8 if method == "bdf" else 1e-9
    fp, fy = jax.jit(jax.jacfwd(loss, argnums=(0, 1)))(p, y0)
    np.testing.assert_allclose(fp, gp, rtol=modes, atol=1e-12 * np.max(np.abs(gp)))
    np.testing.assert_allclose(fy, gy, rtol=modes, atol=1e-12 * np.max(np.abs(gy)))


def test_forward_mode_through_steps_whose_newton_iteration_fails(x64):
    """At a loose tolerance the controller tries steps on ROBER whose stage iteration
    diverges (those steps are rejected); the tangent of such a step is discarded, so
    its non-finite stage Jacobian must neither raise nor leak into the result."""
    prob = PROBLEMS["rober"]

    def f(y, t, p):
        return prob["f"](y, t, p, jnp)

    def y3(p):
        ys = odeint(f, jnp.asarray(prob["y0"]), jnp.array([0.0, 100.0]), p,
                    method="kvaerno5", rtol=1e-6, atol=1e-10)  # fmt: skip
        return ys[-1, 2]

    p = jnp.asarray(prob["p"])
    g = jax.jit(jax.grad(y3))(p)
    fwd = jax.jit(jax.jacfwd(y3))(p)
    assert np.all(np.isfinite(fwd))
    np.testing.assert_allclose(fwd, g, rtol=1e-8, atol=1e-12 * np.max(np.abs(g)))


@pytest.mark.parametrize("method", ["kvaerno5", "rodas5p", "dopri5"])
def test_info_counts_jacobians_factorisations_and_stage_failures(x64, method):
    """ROBER at a loose tolerance: kvaerno5 rejects some attempts because Newton's
    iteration fails; a Rosenbrock method has no iteration to fail; an explicit method
    evaluates no Jacobian."""
    prob = PROBLEMS["rober"]

    def f(y, t, p):
        return prob["f"](y, t, p, jnp)

    span = jnp.array([0.0, 100.0]) if method != "dopri5" else jnp.array([0.0, 1e-3])
    _, info = jax.jit(
        lambda p: odeint(f, jnp.asarray(prob["y0"]), span, p, method=method, rtol=1e-6,
                         atol=1e-10, mxstep=10**5, return_info=True)
    )(jnp.asarray(prob["p"]))  # fmt: skip
    attempts = int(info.steps) + int(info.rejected)
    implicit = method != "dopri5"
    assert int(info.num_jacobians) == implicit * attempts
    assert int(info.num_factorisations) == implicit * attempts  # one diagonal value
    failures = int(info.num_stage_failures)
    if method == "kvaerno5":
        assert 0 < failures <= int(info.rejected)
        # Six implicit stages an attempt, each taking at least one iteration.
        assert int(info.num_newton_iterations) >= 6 * attempts
    else:
        assert failures == 0
        assert int(info.num_newton_iterations) == 0  # nothing to iterate on


#: A linear field with a stiff and a slow component.
_LINEAR = np.array([[-1000.0, 1.0], [0.0, -0.5]])
#: The implicit stage equations of one step: ESDIRK's stages after the explicit first,
#: Radau IIA's three solved together, BDF's corrector.
_IMPLICIT_SOLVES = {"kvaerno5": 6, "radau5": 1, "bdf": 1}


def _linear(y, t, scale):
    return scale * (jnp.asarray(_LINEAR) @ y)


@pytest.mark.parametrize("method", sorted(_IMPLICIT_SOLVES))
def test_a_linear_stage_equation_takes_two_newton_iterations(x64, method):
    """Simplified Newton on a linear field, whose iteration matrix at the step's start
    is exact: the first correction solves each stage equation to rounding, and the
    second, a rounding-sized correction, confirms it. A first step starts far from the
    solution (the correction is thousands of tolerances), so a solve that starts with
    no contraction rate (Radau IIA, BDF, an ESDIRK method's first implicit stage) stops
    after exactly two. ESDIRK's later stages start from the rate of the stage before,
    whose tiny rate lets some of them stop after their one exact correction."""
    m = ode_methods.METHODS[method]
    y0, p = jnp.array([1.0, 2.0]), (jnp.asarray(1.0),)

    def f(y, t, p):  # as a method calls the field: the parameters as a tuple
        return _linear(y, t, *p)

    carry = m.initial_carry(y0, f(y0, 0.0, p))
    tol = ode_methods.StageTolerance(rtol=1e-6, atol=1e-9)
    ok = m.step_with_stages(f, y0, carry, 0.0, 0.01, p, tol=tol)[3]
    report = ode_methods.stage_report(ok)
    assert bool(report.converged)
    solves = _IMPLICIT_SOLVES[method]
    if method == "kvaerno5":
        assert 2 + (solves - 1) <= int(report.iterations) < 2 * solves
    else:
        assert int(report.iterations) == 2


@pytest.mark.parametrize("method", ["kvaerno5", "radau5"])
def test_info_counts_newton_iterations_per_element(x64, method):
    """Over a solve of the linear field, every stage equation takes one or two
    iterations (one where the start is already within the stopping test: the
    extrapolated start of a step like the last); under `vmap`, each element counts its
    own attempts only, the same as solved alone; forward mode counts the primal's."""

    def solve(scale):
        return odeint(_linear, jnp.array([1.0, 2.0]), jnp.array([0.0, 5.0]), scale,
                      method=method, rtol=1e-6, atol=1e-9, return_info=True)[1]  # fmt: skip

    scales = jnp.array([1.0, 40.0])
    batched = jax.jit(jax.vmap(solve))(scales)
    for i, scale in enumerate(scales):
        alone = jax.jit(solve)(scale)
        attempts = int(alone.steps) + int(alone.rejected)
        solves = _IMPLICIT_SOLVES[method] * attempts
        iterations = int(alone.num_newton_iterations)
        assert solves <= iterations <= 2 * solves, (iterations, solves)
        assert int(batched.num_newton_iterations[i]) == iterations
        assert int(batched.steps[i]) == int(alone.steps)
        # Forward sensitivities step the primal solve's steps, with its iterations.
        primal, _ = jax.jit(lambda s: jax.jvp(solve, (s,), (jnp.ones_like(s),)))(scale)
        assert int(primal.num_newton_iterations) == iterations
    # The stiffer element takes more steps, so a count over the batch would show it.
    assert int(batched.steps[1]) > int(batched.steps[0])


@pytest.mark.slow
@pytest.mark.parametrize(
    ("method", "first", "last", "modes"),
    [("kvaerno5", 0.1, 2e-3, 1e-5), ("rodas5p", 0.1, 2e-3, 1e-5), ("bdf", 0.2, 5e-3, 5e-5)],
)
def test_van_der_pol_derivative_converges_with_the_tolerance(x64, method, first, last, modes):
    """VDPOL's jumps move with eps: d/d eps of the solution is far more sensitive to
    the discretisation than the solution itself, so its error shrinks with the
    tolerance from a larger start (see docs/odes.md); `bdf`, of lower order, from a
    larger one still (measured at rtol 1e-8, 1e-9, 1e-10: 0.11, 0.023, 2.1e-3)."""
    ref = REFS["vdpol"]["grad_p"][0]
    p, y0 = _point("vdpol")
    errors = []
    for rtol in (1e-8, 1e-9, 1e-10):
        loss, _ = _loss("vdpol", rtol, method, max_steps=65536)
        g = jax.jit(jax.grad(loss))(p, y0)
        f = jax.jit(jax.jacfwd(loss))(p, y0)
        # Forward and reverse accumulation round differently, and d/d eps of VDPOL
        # amplifies rounding (its terms scale as 1/eps^2 = 1e12): the two modes agree
        # to 1e-8 - 3e-6 here, by how the compiled program rounds (XLA's optimisations
        # on or off, the stage solves' arithmetic), against 1e-9 on the other problems
        # and 3e-4 for the error against the reference at the tightest tolerance
        # (`bdf`: 1e-6 to 1.2e-5).
        np.testing.assert_allclose(f, g, rtol=modes)
        errors.append(_rel(g, [ref]))
    assert errors[0] < first and errors[2] < last, errors
    assert errors[2] < errors[1] < errors[0], errors


@pytest.mark.slow
def test_hessian_of_a_stiff_solve_matches_differences_of_the_gradient(x64):
    """`jax.hessian` (forward over the checkpointed sweep) against central differences
    of forward-mode gradients, which the test above checks against SciPy."""
    loss, _ = _loss("rober", 1e-9)
    p, y0 = _point("rober")
    scale = jnp.asarray(PROBLEMS["rober"]["p"])
    # In relative units of p, so the entries are of comparable size.
    rel_loss = lambda u: loss(scale * u, y0)  # noqa: E731
    u = jnp.ones(3)
    hess = jax.jit(jax.hessian(rel_loss))(u)
    grad = jax.jit(jax.jacfwd(rel_loss))
    eps = 1e-4
    fd = np.stack(
        [(grad(u.at[i].add(eps)) - grad(u.at[i].add(-eps))) / (2 * eps) for i in range(3)]
    )
    np.testing.assert_allclose(hess, hess.T, rtol=1e-8, atol=1e-10 * np.max(np.abs(hess)))
    np.testing.assert_allclose(hess, fd, rtol=1e-4, atol=1e-5 * np.max(np.abs(hess)))


# ---------------------------------------------------------------------------
# The checkpointed adjoint's replays.


def _rober_grad(ts, max_steps, method="kvaerno5", adjoint="checkpoint"):
    prob = PROBLEMS["rober"]
    p, y0 = _point("rober")
    f = lambda y, t, p: prob["f"](y, t, p, jnp)  # noqa: E731
    w = jnp.array([1.0, 1e4, 0.0])
    kw = dict(method=method, rtol=1e-6, atol=1e-10, mxstep=1e6)
    kw.update({} if max_steps is None else dict(max_steps=max_steps))

    def loss(p):
        return odeint(f, y0, ts, p, adjoint=adjoint, **kw)[-1] @ w

    return jax.jit(jax.grad(loss))(p)


@pytest.mark.parametrize("method", [pytest.param("kvaerno5", marks=pytest.mark.slow), "bdf"])
def test_replayed_steps_are_the_steps_taken(x64, method):
    """With few steps between checkpoints the sweep replays nearly every step from a
    checkpoint; the gradient is the same as when every state is kept. (A replay that
    restarted from `f` at the checkpoint instead of the carried stage derivative took
    another step, which on ROBER overflowed to NaN.) For BDF the carry is the whole
    history of differences, order and step size: a replay from a checkpoint must
    restore all of it."""
    ts = jnp.concatenate([jnp.zeros(1), jnp.logspace(-5, 5, 11)])
    max_steps = 100 if method == "kvaerno5" else 1000
    # Checkpoints every 2 steps, against every step's start kept (the default for a
    # state this small).
    every_two = CheckpointAdjoint(max_steps, checkpoints=max_steps // 2)
    replayed = _rober_grad(ts, max_steps=None, method=method, adjoint=every_two)
    kept = _rober_grad(ts, max_steps=max_steps, method=method)
    assert np.all(np.isfinite(replayed))
    np.testing.assert_allclose(replayed, kept, rtol=1e-12, atol=1e-22)


def test_every_step_kept_when_the_record_is_small(x64):
    """`CheckpointAdjoint` keeps every step's start while the record fits in
    `KEEP_ALL_MAX` numbers over the batch (no replay), else segments as long as
    `RECORD_MAX` numbers allow, up to `SEGMENT_STEPS_MAX` steps and never shorter than
    about `sqrt(max_steps)`; `checkpoints=` sets their number. The record's shapes show
    which."""
    from solvers.ode.loop import (
        KEEP_ALL_MAX,
        RECORD_MAX,
        SEGMENT_STEPS_MAX,
        checkpoint_every,
    )

    def memory(record, every, numbers, per_checkpoint):  # as `initial_state` allocates
        return (record // every + 3) * per_checkpoint + (every + 1) * numbers

    assert checkpoint_every(4096, 48) == 4104  # above 4096: the overflowing step fits too
    assert checkpoint_every(4096, KEEP_ALL_MAX // 4096) == SEGMENT_STEPS_MAX == 512
    # The Brusselator line's bdf record at 2048 states: RECORD_MAX bounds the segment.
    every = checkpoint_every(4096, 20488, 0, 49612)
    assert every == 376 and memory(4096, every, 20488, 49612) <= RECORD_MAX
    assert memory(4096, every + 8, 20488, 49612) > RECORD_MAX
    # Rows far above the budget: the same memory as sqrt(1000) = 31 steps, down to a
    # multiple of 8, would take (24), in segments of 40 (one checkpoint fewer per 8).
    assert checkpoint_every(1000, 10**6) == 40
    assert memory(1000, 40, 10**6, 10**6) <= memory(1000, 24, 10**6, 10**6)
    # A short record within the budget: one segment.
    assert checkpoint_every(400, 10**4) == 408
    assert checkpoint_every(100, 48, checkpoints=13) == 8
    assert checkpoint_every(400, 48, checkpoints=25) == 16
    assert checkpoint_every(1000, 48, checkpoints=500) == 2
    assert checkpoint_every(1000, 48, checkpoints=30) == 40  # 34, up to a multiple of 8

    prob = PROBLEMS["rober"]
    p, y0 = _point("rober")
    f = lambda y, t, p: prob["f"](y, t, p, jnp)  # noqa: E731
    ts = jnp.array([0.0, 1.0])

    def shapes(fn, *args):
        text = str(jax.make_jaxpr(fn)(*args))
        marks = ("[4105,3]", "[513,3]", "[17,3]", "[8,4105,3]", "[8,513,3]")
        return {m for m in marks if m in text}

    def loss(p, adjoint=None):
        return jnp.sum(odeint(f, y0, ts, p, method="bdf", adjoint=adjoint))

    # The latest states' buffer holds a spare row past the segment.
    assert shapes(jax.grad(loss), p) == {"[4105,3]"}
    # A batch of 8 would keep 8 x 4105 starts of the state and BDF's carry: too many.
    batch = jnp.stack([p] * 8)
    assert "[8,513,3]" in shapes(jax.vmap(jax.grad(loss)), batch)
    assert not {"[4105,3]", "[8,4105,3]"} & shapes(jax.vmap(jax.grad(loss)), batch)
    ten = CheckpointAdjoint(max_steps=100, checkpoints=10)  # every 16 steps
    assert shapes(jax.grad(lambda p: loss(p, ten)), p) == {"[17,3]"}
    with pytest.raises(ValueError, match=r"`checkpoints` must be >= 1"):
        CheckpointAdjoint(checkpoints=0)
    with pytest.raises(TypeError, match=r"`checkpoints` must be a Python int"):
        CheckpointAdjoint(checkpoints=2.0)


def test_blocks_of_rows_keep_each_buffer_under_the_sequential_limit(x64):
    """`block_size`: `RECORD_BLOCK` steps per block for one solve whose record rows each
    fit in `SEQUENTIAL_BYTES`, else 0 (no blocks). `BlockRows` holds a block's copies
    of a buffer's rows, each row split into pieces whose buffers stay within the limit;
    what it writes back and reads out is the rows themselves."""
    from solvers.ode.blocks import RECORD_BLOCK, SEQUENTIAL_BYTES, BlockRows, block_size, flatten

    def rows(*shapes):
        return [jax.ShapeDtypeStruct((4097, *s), jnp.float64) for s in shapes]

    assert (SEQUENTIAL_BYTES, RECORD_BLOCK) == (512, 16)
    assert block_size(rows((), (3,), (8, 3), (3, 3)), 1) == 16  # ROBER, BDF's carry
    assert block_size(rows((), (64,)), 1) == 16  # 512 bytes a row
    assert block_size(rows((), (65,)), 1) == 0
    assert block_size(rows((), (3,)), 2) == 0  # a vmap batch

    rng = np.random.default_rng(0)
    for shape, dtype in [((8, 3), jnp.float64), ((), jnp.float64), ((5,), jnp.int32),
                         ((0,), jnp.float64), ((64,), jnp.float64)]:  # fmt: skip
        buffer = jnp.asarray(rng.integers(0, 100, (40, *shape)), dtype)
        idx = jnp.arange(16) + 7
        block = BlockRows.rows(buffer, idx)
        assert all(p.shape[0] == 16 and p.nbytes <= SEQUENTIAL_BYTES for p in block.pieces)
        assert sum(p.shape[1] for p in block.pieces) == math.prod(shape)
        for i in (0, 5, 15):
            np.testing.assert_array_equal(block.get(i), buffer[7 + i])
        new = jnp.asarray(rng.integers(0, 100, shape), dtype)
        changed = block.set(3, new)
        np.testing.assert_array_equal(changed.get(3), new)
        np.testing.assert_array_equal(changed.get(4), buffer[11])
        # Written back at row 20: rows 20..35 are the block's, the others unchanged.
        out = changed.write(flatten(buffer), jnp.asarray(20, jnp.int32)).reshape(buffer.shape)
        expected = buffer.at[20:36].set(buffer[7:23]).at[23].set(new)
        np.testing.assert_array_equal(out, expected)
        empty = BlockRows.empty(buffer, 16)
        np.testing.assert_array_equal(empty.get(9), jnp.zeros(shape, dtype))


@pytest.mark.parametrize(
    "method, every_case",
    [
        ("rodas5p", False),
        *(pytest.param(m, True, marks=pytest.mark.slow) for m in ("rodas5p", "kvaerno5", "bdf")),
    ],
)
def test_record_by_blocks_gives_the_gradient_of_the_whole_record(x64, method, every_case):
    """One small solve writes its record by blocks of a few steps and its sweep reads it
    back the same way (`solvers.ode.blocks`: a loop over steps then touches no buffer
    larger than `SEQUENTIAL_BYTES`, which XLA's CPU runtime runs without its task
    scheduler). A record with checkpoints (replayed segments) and a `vmap` batch are
    written and read whole. All give the same gradient, over tolerances that put the
    outputs and the last step at different places in a block, with rejected steps,
    when the last step overflows the record, and with more outputs than a block has
    steps (the sweep copies a block's outputs too). Without `every_case`, only the last
    step overflowing the record."""
    from solvers.ode.blocks import block_size

    prob = PROBLEMS["rober"]
    p, y0 = _point("rober")
    f = lambda y, t, p: prob["f"](y, t, p, jnp)  # noqa: E731
    w = jnp.array([1.0, 1e4, 0.0])

    def outputs(n):
        return jnp.concatenate([jnp.zeros(1), jnp.logspace(-5, 3, n)])

    def loss(p, ts, rtol, max_steps, checkpoints=None):
        adjoint = CheckpointAdjoint(max_steps, checkpoints=checkpoints)
        ys, _ = odeint(
            f, y0, ts, p, method=method, rtol=rtol, atol=rtol * 1e-4, mxstep=1e6,
            adjoint=adjoint, throw=False, return_info=True,
        )  # fmt: skip
        return jnp.sum(ys[1:] @ w)

    carry = {"bdf": [(8, 3), (3, 3)]}.get(method, [(3,)])
    block = block_size([jax.ShapeDtypeStruct((9, *s), jnp.float64) for s in [(3,), *carry]], 1)
    assert block == 16
    grad = jax.jit(jax.grad(loss), static_argnums=(2, 3, 4))
    # (`vmap` of the unjitted gradient: under `vmap` of a `jit`, the solve is traced
    # unbatched and its program batched afterwards.)
    batched = jax.jit(jax.vmap(jax.grad(loss), (0, None, None, None)), static_argnums=(2, 3))
    # The blocks' buffers appear in one solve's gradient only.
    staged, ts = f"tensor<{block}x3xf64>", outputs(9)
    assert staged in grad.lower(p, ts, 1e-6, 4096).as_text()
    assert staged not in grad.lower(p, ts, 1e-6, 4096, 512).as_text()
    batch = jnp.stack([p, p, p])
    assert staged not in batched.lower(batch, ts, 1e-6, 4096).as_text()

    def steps(ts, rtol):
        ys, info = odeint(
            f, y0, ts, p, method=method, rtol=rtol, atol=rtol * 1e-4, mxstep=1e6,
            return_info=True,
        )  # fmt: skip
        return int(info.steps), int(info.rejected)

    ends, rejected = set(), 0
    cases = ((9, 1e-4), (9, 3e-5), (9, 1e-5), (40, 1e-4)) if every_case else ((9, 1e-4),)
    for n_out, rtol in cases:
        ts = outputs(n_out)
        n, r = steps(ts, rtol)
        ends.add(n % block)
        rejected += r
        sizes = (n - 1,) if not every_case else (4096, n - 1) if rtol == 1e-4 else (4096,)
        for max_steps in sizes:
            one = grad(p, ts, rtol, max_steps)
            replayed = grad(p, ts, rtol, max_steps, 4)
            assert np.all(np.isfinite(one))
            np.testing.assert_allclose(one, replayed, rtol=1e-12, atol=1e-22)
            if (n_out, rtol) == (9, 3e-5) or not every_case:
                # (The batch's linear algebra rounds differently: BDF's gradient here
                # differs by 3e-10, as it did before the blocks.)
                three = batched(batch, ts, rtol, max_steps)
                np.testing.assert_allclose(three, np.stack([one] * 3), rtol=1e-8, atol=1e-22)
    assert rejected > 0
    if every_case:
        assert len(ends) >= 2  # the last step at different places in its block


@pytest.mark.parametrize(
    "method, every_case",
    [
        ("rodas5p", False),
        *(pytest.param(m, True, marks=pytest.mark.slow) for m in ("rodas5p", "kvaerno5", "bdf")),
    ],
)
def test_interpolated_record_by_blocks_gives_the_gradient_of_the_whole_record(
    x64, method, every_case
):
    """With `interpolate=True` one small solve's record is written by blocks too, and
    its sweep reads each block's outputs as the moments summed per step. Against the
    same solve with a replayed record (checkpoints: written whole, the outputs read by
    their step pointer) and a `vmap` batch, over few outputs and over many (several
    inside one step, more than a block's steps), and a last step past `max_steps`
    (without `every_case`, many outputs only)."""
    prob = PROBLEMS["rober"]
    p, y0 = _point("rober")
    f = lambda y, t, p: prob["f"](y, t, p, jnp)  # noqa: E731
    w = jnp.array([1.0, 1e4, 0.0])

    def loss(p, n_out, max_steps, checkpoints=None):
        ts = jnp.concatenate([jnp.zeros(1), jnp.logspace(-5, 5, n_out)])
        ys, _ = odeint(
            f, y0, ts, p, method=method, rtol=1e-6, atol=1e-10, interpolate=True,
            adjoint=CheckpointAdjoint(max_steps, checkpoints=checkpoints), throw=False,
            return_info=True,
        )  # fmt: skip
        return jnp.sum(jnp.nan_to_num(ys[1:]) @ w)

    grad = jax.jit(jax.grad(loss), static_argnums=(1, 2, 3))
    batched = jax.jit(jax.vmap(jax.grad(loss), (0, None, None)), static_argnums=(1, 2))
    # The blocks' buffers, and the moments summed per step (powers of the interpolant
    # by state), in one solve's gradient only.
    import re

    for staged in (r"tensor<16x3xf64>", r"tensor<4097x\d+x3xf64>"):
        assert re.search(staged, grad.lower(p, 50, 4096).as_text())
        assert not re.search(staged, grad.lower(p, 50, 4096, 4).as_text())
    cases = [(10, 4096), (50, 4096), (50, 40)] if every_case else [(50, 4096)]
    for n_out, max_steps in cases:
        one = grad(p, n_out, max_steps)
        assert np.all(np.isfinite(one))
        np.testing.assert_allclose(one, grad(p, n_out, max_steps, 4), rtol=1e-11, atol=1e-22)
        if n_out == 50 and max_steps == 4096:
            three = batched(jnp.stack([p, p]), n_out, max_steps)
            np.testing.assert_allclose(three, np.stack([one] * 2), rtol=1e-8, atol=1e-22)


@pytest.mark.slow
def test_record_by_blocks_under_vmap_of_derivatives_of_the_gradient(x64):
    """A solve written by blocks inside a `vmap` the sweep cannot see: `vmap(jacfwd(
    grad))` runs the sweep in forward mode through its own code, and `vmap(jit(grad))`
    traces one solve and batches its program afterwards. Elements that take different
    numbers of steps (3 and 20) get their own derivatives, finite: a step past an
    element's last is linearised at that last step and pulls back zeros (not at rows
    it never took, whose linearisation may not be finite)."""

    def loss(k):
        ys = odeint(
            lambda y, t, k: -k * jnp.sqrt(y), jnp.array([1.0]), jnp.array([0.0, 1.0]), k,
            method="rodas5p", rtol=1e-6, atol=1e-9, adjoint=CheckpointAdjoint(64),
        )  # fmt: skip
        return ys[-1, 0]

    ks = jnp.array([0.1, 1.9])
    second = jax.jacfwd(jax.grad(loss))
    first = jax.grad(loss)
    # y(1) = (1 - k / 2)^2: dy/dk = k / 2 - 1, d^2y/dk^2 = 1/2.
    for fn, batched, exact in [
        (second, jax.vmap(second), 0.5 + 0 * ks),
        (first, jax.vmap(jax.jit(first)), ks / 2 - 1),
    ]:
        fn = jax.jit(fn)
        each = np.stack([fn(k) for k in ks])
        assert np.all(np.isfinite(each))
        many = jax.jit(batched)(ks)
        # (A batch's linear algebra rounds differently: 7e-9 on the second element,
        # whose solution nears the square root's singularity.)
        np.testing.assert_allclose(many, each, rtol=1e-7)
        np.testing.assert_allclose(many, exact, rtol=1e-4)
    # A batch the sweep sees (the batched sweep).
    np.testing.assert_allclose(jax.jit(jax.vmap(first))(ks), ks / 2 - 1, rtol=1e-4)


@pytest.mark.slow
def test_jacrev_over_many_outputs_groups_its_cotangents(x64):
    """`jacrev` of a solve that kept every step's start: the batched sweep copies the
    record per cotangent, so the 33 cotangents go through in groups of at most
    `KEEP_ALL_MAX` numbers, one after the other (a `lax.map` whose body the shared
    record enters unbatched); against `jacfwd` (forward sensitivities, an independent
    rule)."""
    import re

    from solvers.ode.loop import KEEP_ALL_MAX

    prob = PROBLEMS["rober"]
    p, y0 = _point("rober")
    f = lambda y, t, p: prob["f"](y, t, p, jnp)  # noqa: E731
    ts = jnp.concatenate([jnp.zeros(1), jnp.logspace(-5, 3, 10)])
    solve = lambda p: odeint(f, y0, ts, p, method="bdf", rtol=1e-8, atol=1e-10)  # noqa: E731
    closed = jax.make_jaxpr(jax.jacrev(solve))(p)
    # The groups run as a `lax.map` that the record enters unbatched; its rows of every
    # step (the step's starting state and its carry as a replay reads it, `slots` rows
    # each) are most of it, the few checkpoints the rest.
    (scan,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "scan"]
    slots = max(v.aval.shape[0] for v in scan.invars if v.aval.ndim)
    rows = sum(v.aval.size for v in scan.invars if v.aval.ndim and v.aval.shape[0] == slots)
    # The record's batched copies: `group` cotangents at a time, then the remainder.
    sizes = {int(s) for s in re.findall(rf"\[(\d+),{slots}[,\]]", str(closed))} - {1}
    group = max(sizes)
    assert 1 < group < 33 and scan.params["length"] == 33 // group
    assert sizes == {group, 33 % group} - {0}
    assert group * rows <= KEEP_ALL_MAX
    forward = jax.jacfwd(solve)(p)
    scale = np.max(np.abs(forward), axis=(0, 1))
    np.testing.assert_allclose(jax.jacrev(solve)(p) / scale, forward / scale, atol=1e-7)


@pytest.mark.slow
def test_jacrev_groups_its_cotangents_over_a_record_with_checkpoints(x64):
    """The same grouping for a record that keeps checkpoints and segments (not every
    step's start): 8 segments of 8192 steps of ROBER's state and BDF's carry are far
    more than `KEEP_ALL_MAX` numbers for 33 copies, so the cotangents go through a few
    at a time; the Jacobian matches `jacfwd`."""
    from solvers.ode import CheckpointAdjoint
    from solvers.ode.loop import KEEP_ALL_MAX

    prob = PROBLEMS["rober"]
    p, y0 = _point("rober")
    f = lambda y, t, p: prob["f"](y, t, p, jnp)  # noqa: E731
    ts = jnp.concatenate([jnp.zeros(1), jnp.logspace(-5, 3, 32)])
    adjoint = CheckpointAdjoint(max_steps=65536, checkpoints=8)

    def solve(p):
        return odeint(f, y0, ts, p, method="bdf", rtol=1e-8, atol=1e-10, adjoint=adjoint)

    closed = jax.make_jaxpr(jax.jacrev(solve))(p)
    (scan,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "scan"]
    numbers = sum(v.aval.size for v in scan.invars if v.aval.ndim >= 2)
    group = -(-33 // scan.params["length"])
    assert scan.params["length"] > 1 and group * numbers <= 2 * KEEP_ALL_MAX
    forward = jax.jacfwd(solve)(p)
    scale = np.max(np.abs(forward), axis=(0, 1))
    np.testing.assert_allclose(jax.jacrev(solve)(p) / scale, forward / scale, atol=1e-7)


@pytest.mark.parametrize(("checkpoints", "t_end"), [(None, 3.0), (4, 3.0), (1, 0.1)])
def test_gradient_when_the_last_step_overflows_the_record(x64, checkpoints, t_end):
    """With `throw=False`, a solve whose last step is one more than `max_steps` ends
    with a status, its outputs all reached; their gradient is still exact: the start
    of the overflowing step is kept apart from the others (it once overwrote the first
    step's start when every start was kept). With one checkpoint on a short solve the
    segment is exactly `max_steps` long, and that start takes the first one's slot."""
    from solvers.ode import CheckpointAdjoint

    ts = jnp.array([0.0, t_end / 6, t_end])

    def loss(p, max_steps, checkpoints=None):
        adjoint = CheckpointAdjoint(max_steps=max_steps, checkpoints=checkpoints)
        ys, info = odeint(
            _oscillator, jnp.array([1.0, 0.0]), ts, p, method="dopri5", rtol=1e-8,
            atol=1e-8, adjoint=adjoint, throw=False, return_info=True,
        )  # fmt: skip
        return jnp.sum(ys[1:] @ jnp.array([1.0, 2.0])), info

    p = jnp.array([4.0, 0.3])
    (_, info), full = jax.value_and_grad(loss, has_aux=True)(p, 4096)
    steps = int(info.steps)
    (_, info), g = jax.value_and_grad(loss, has_aux=True)(p, steps - 1, checkpoints)
    assert int(info.status) != 0 and int(info.steps) == steps
    np.testing.assert_allclose(g, full, rtol=1e-12)


@pytest.mark.parametrize("shift_ulps", [0, 1, 3])
def test_output_times_a_few_ulps_apart_give_the_same_gradient(x64, shift_ulps):
    """NumPy's and JAX's logspace differ by an ulp at t = 1e3 and 1e4; any such
    perturbation of the output times must leave the gradient finite and unchanged
    within the tolerance."""
    ts = np.concatenate([[0.0], np.logspace(-5, 5, 11)])
    ts = ts + shift_ulps * np.spacing(ts) * np.where(np.arange(12) % 2, 1, -1)
    g = _rober_grad(jnp.asarray(ts), max_steps=100)
    ref = REFS["rober_last"]["grad_p"]
    assert np.all(np.isfinite(g))
    assert _rel(g, ref) < 1e-3, (g, ref)


def _oscillator(y, t, p):
    return jnp.stack([y[1], -p[0] * y[0] - p[1] * y[1] + jnp.cos(t)])


@pytest.mark.parametrize("adjoint", ["backsolve", "checkpoint"])
@pytest.mark.parametrize(
    "method",
    [
        "dopri5",
        "kvaerno5",
        *(pytest.param(m, marks=pytest.mark.slow) for m in ("tsit5", "bosh3", "dopri8", "rk4")),
    ],
)
def test_ulp_perturbed_output_times_every_method(x64, method, adjoint):
    ts = np.linspace(0.0, 3.0, 7)
    shifted = ts + 2 * np.spacing(ts) * np.where(np.arange(7) % 2, 1, -1)
    # (Few steps between checkpoints: the checkpointed sweep replays most steps.)
    if adjoint == "checkpoint":
        adjoint = CheckpointAdjoint(max_steps=1024, checkpoints=128)
    kw = dict(method=method, adjoint=adjoint)
    tol = 1e-6 if method == "bosh3" else 1e-8
    kw.update(dt=0.01) if method == "rk4" else kw.update(rtol=tol, atol=tol)

    @jax.jit
    def grad(ts):
        loss = lambda p: jnp.sum(odeint(_oscillator, jnp.array([1.0, 0.0]), ts, p, **kw))  # noqa: E731
        return jax.grad(loss)(jnp.array([4.0, 0.3]))

    a, b = grad(jnp.asarray(ts)), grad(jnp.asarray(shifted))
    assert np.all(np.isfinite(a)) and np.all(np.isfinite(b))
    np.testing.assert_allclose(a, b, rtol=1e-6)


# ---------------------------------------------------------------------------
# Which adjoint, and backward instability.


def _relaxation(y, t, k):
    """`y' = -k (y - cos t)`: for k = 1000 a stiff linear problem."""
    return -k * (y - jnp.cos(t))


def _relaxation_exact(k, t):
    a, b = k**2 / (k**2 + 1), k / (k**2 + 1)
    return a * np.cos(t) + b * np.sin(t) - a * np.exp(-k * t)


RELAX_TS = np.linspace(0.0, 1.0, 5)


def _relaxation_grad_exact(k):
    h = 1e-3 * k  # the closed form is smooth in k: central differences are exact enough
    return sum(
        (_relaxation_exact(k + h, t) - _relaxation_exact(k - h, t)) / (2 * h) for t in RELAX_TS[1:]
    )


def _relaxation_loss(k, **kw):
    return jnp.sum(odeint(_relaxation, 0.0, jnp.asarray(RELAX_TS), k, **kw)[1:])


@pytest.mark.parametrize(
    "method",
    [
        "bdf",
        "radau5",
        pytest.param("rodas5p", marks=pytest.mark.slow),
        pytest.param("kvaerno5", marks=pytest.mark.slow),
    ],
)
def test_linearisations_in_chunks_match_the_references(x64, monkeypatch, method):
    """The sweep's linearisations eight steps at a time (for 100 states or more; forced
    here on ROBER's 3), with checkpoints every 32 steps: several segments, chunks that
    run past a segment's steps, and BDF's corrector solutions taken from the record.
    Against central differences of SciPy's Radau, as above."""
    monkeypatch.setattr(sweep, "LINEARIZE_MIN_STATES", 1)
    rtol = 1e-8
    loss, steps = _loss("rober", rtol, method, adjoint=CheckpointAdjoint(1024, checkpoints=32))
    p, y0 = _point("rober")
    ref = REFS["rober"]
    n = int(jax.jit(steps)(p, y0))
    assert n > 2 * 32
    bound = 10 * n * rtol
    gp, gy = jax.jit(jax.grad(loss, argnums=(0, 1)))(p, y0)
    assert _rel(gp, ref["grad_p"]) < bound, (_rel(gp, ref["grad_p"]), bound)
    assert _rel(gy, ref["grad_y0"]) < bound, (_rel(gy, ref["grad_y0"]), bound)


def _forced_linear_system(n=10):
    """`y' = p A y + b cos t` with a stiff, non-symmetric `A` (eigenvalues from -1 to
    -1000), and its closed form: the augmented state `(y, cos t, sin t)` is linear and
    autonomous, so `y(t) = [expm(t B) (y0, 1, 0)][:n]`."""
    rng = np.random.default_rng(0)
    q, _ = np.linalg.qr(rng.normal(size=(n, n)))
    a = q @ np.diag(-np.logspace(0, 3, n)) @ q.T + 0.5 * np.triu(rng.normal(size=(n, n)), 1)
    a, b = jnp.asarray(a), jnp.asarray(rng.normal(size=n))

    def f(y, t, p):
        return p * (a @ y) + b * jnp.cos(t)

    def exact(y0, ts, p):
        big = jnp.zeros((n + 2, n + 2))
        big = big.at[:n, :n].set(p * a).at[:n, n].set(b)
        big = big.at[n, n + 1].set(-1.0).at[n + 1, n].set(1.0)
        z0 = jnp.concatenate([y0, jnp.array([1.0, 0.0])])
        return jnp.stack([jax.scipy.linalg.expm(t * big)[:n] @ z0 for t in ts])

    return f, exact, jnp.asarray(rng.normal(size=n))


@pytest.mark.parametrize(
    ("method", "rolled", "products"),
    [
        ("rodas5p", True, False),
        ("rodas5p", True, True),
        pytest.param("rodas5p", False, False, marks=pytest.mark.slow),
        pytest.param("rodas4", True, False, marks=pytest.mark.slow),
        ("kvaerno5", True, False),
        pytest.param("kvaerno5", True, True, marks=pytest.mark.slow),
        pytest.param("kvaerno5", False, False, marks=pytest.mark.slow),
    ],
)
def test_implicit_stages_as_a_loop_under_every_transformation(
    x64, monkeypatch, method, rolled, products
):
    """A Rosenbrock step can run its stages as one loop, and so can an ESDIRK step
    whose implicit stages share one diagonal value (each iteration a Newton solve
    through `custom_root`): `stage_loop`, by default from `ROLL_MIN_STATES` states on.
    Both forms (the unrolled one with the slow tests: every smaller system runs it), on
    a forced stiff linear system of 10 states (the field's time derivative enters the
    Rosenbrock stages whose `d` is nonzero), against the closed form: values, `grad`
    (the checkpointed adjoint, its steps linearised eight at a time as for a large
    system), `jacfwd`, `hessian` and `vmap` of `grad`. With `products`, the loop's
    stage sums take the matrix product that a large system's take (`PRODUCT_MIN`)."""
    from solvers.ode import _small
    from solvers.ode.methods import resolve_method

    monkeypatch.setattr(sweep, "LINEARIZE_MIN_STATES", 1)
    products_taken = []
    if products:
        monkeypatch.setattr(_small, "PRODUCT_MIN", 1)
        matmul = jnp.matmul
        spy = lambda *a, **k: products_taken.append(a[0].shape) or matmul(*a, **k)  # noqa: E731
        monkeypatch.setattr(_small.jnp, "matmul", spy)
    method = dataclasses.replace(resolve_method("odeint", method), stage_loop=rolled)
    f, exact, y0 = _forced_linear_system()
    ts = jnp.linspace(0.0, 2.0, 5)
    w = jnp.linspace(1.0, 2.0, y0.size)

    def loss(p, y0, **kw):
        ys = odeint(f, y0, ts, p, method=method, rtol=1e-10, atol=1e-10, **kw)
        return jnp.sum(ys[1:] ** 2 @ w)

    def loss_exact(p, y0):
        return jnp.sum(exact(y0, ts, p)[1:] ** 2 @ w)

    p = 1.3
    ys = jax.jit(lambda p, y0: odeint(f, y0, ts, p, method=method, rtol=1e-10, atol=1e-10))(p, y0)
    np.testing.assert_allclose(ys, exact(y0, ts, p), rtol=1e-9, atol=1e-10)
    # The stage loop's one-row sums took the product (traced, not served from a cache).
    assert ((1, method.stages) in products_taken) == products
    want = jax.grad(loss_exact, argnums=(0, 1))(p, y0)
    got = jax.jit(jax.grad(loss, argnums=(0, 1)))(p, y0)
    assert _rel(got[0], want[0]) < 1e-8, (got[0], want[0])
    assert _rel(got[1], want[1]) < 1e-8, _rel(got[1], want[1])
    jf = jax.jit(jax.jacfwd(loss, argnums=1))(p, y0)
    assert _rel(jf, want[1]) < 1e-8
    hess = jax.jit(jax.hessian(loss))(p, y0)
    assert _rel(hess, jax.jit(jax.hessian(loss_exact))(p, y0)) < 1e-8
    ps = jnp.array([0.7, 1.3, 2.0])
    batched = jax.jit(jax.vmap(jax.grad(loss), in_axes=(0, None)))(ps, y0)
    want_b = jax.vmap(jax.grad(loss_exact), in_axes=(0, None))(ps, y0)
    assert _rel(batched, want_b) < 1e-8, (batched, want_b)


def _assert_same_step(rolled, unrolled, dtype):
    """Two results of `step_with_stages` agree: both steps succeeded, and their solution,
    error estimate, the carries they hand on and stages match to rounding relative to the largest
    of them (1e-12 in float64; in float32 the check is mostly that every result keeps
    the state's precision)."""
    y1, err, carry1, ok, ks = rolled
    assert bool(_converged(ok)) and bool(_converged(unrolled[3]))
    ours, theirs = (jax.tree_util.tree_leaves(c) for c in (carry1, unrolled[2]))
    leaves = list(zip([y1, err, *ours, *ks], [*unrolled[:2], *theirs, *unrolled[4]], strict=True))
    scale = max(float(jnp.max(jnp.abs(b))) for _, b in leaves)
    tol = 1e-12 if dtype == np.float64 else 1e-4
    for a, b in leaves:
        assert a.dtype == b.dtype == dtype
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol * scale)


@pytest.mark.parametrize("method", ["rodas5p", "rodas4"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_rosenbrock_stages_in_a_loop_are_the_unrolled_stages(x64, method, dtype):
    """One step of each form from the same start, with a non-autonomous field and a
    (non-diagonal) mass matrix: the same stages, solution and error estimate to
    rounding (the loop sums a stage's terms in another order)."""
    from solvers.ode.mass import MassMatrix
    from solvers.ode.methods import resolve_method

    f_lin, _, y0 = _forced_linear_system()
    n = y0.size
    m = np.eye(n) + 0.1 * np.diag(np.ones(n - 1), 1)
    rng = np.random.default_rng(1)

    def f(y, t, p):  # (the linear part's matrices are float64)
        return (f_lin(y, t, p) + 0.3 * jnp.sin(y) * jnp.sin(3 * t)).astype(y.dtype)

    step = dataclasses.replace(
        resolve_method("odeint", method), mass_matrix=MassMatrix(m.astype(dtype), n)
    )
    y = jnp.asarray(y0 + 0.1 * rng.normal(size=n), dtype)
    t, h, p = jnp.asarray(0.3, dtype), jnp.asarray(2e-3, dtype), jnp.asarray(1.3, dtype)
    k1 = f(y, t, p)
    rolled = dataclasses.replace(step, stage_loop=True).step_with_stages(f, y, k1, t, h, p)
    unrolled = dataclasses.replace(step, stage_loop=False).step_with_stages(f, y, k1, t, h, p)
    # Rounding relative to the largest stage derivative (`|h J|` up to 2 here: the
    # stages' couplings sum terms of that size).
    _assert_same_step(rolled, unrolled, dtype)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_esdirk_stages_in_a_loop_are_the_unrolled_stages(x64, dtype):
    """One kvaerno5 step of each form from the same start, on a non-autonomous
    nonlinear field, its stage equations solved to rounding: the same stages, solution
    and error estimate (the loop sums a stage's terms in another order), and the same
    outcome when a stage's Newton iteration fails."""
    from solvers.ode.methods import StageTolerance, resolve_method

    f_lin, _, y0 = _forced_linear_system()
    rng = np.random.default_rng(2)

    def f(y, t, p):
        return (f_lin(y, t, p) + 0.3 * jnp.sin(y) * jnp.sin(3 * t)).astype(y.dtype)

    kvaerno5 = resolve_method("odeint", "kvaerno5")
    step = dataclasses.replace(kvaerno5, stage_loop=True)
    unrolled_step = dataclasses.replace(kvaerno5, stage_loop=False)
    y = jnp.asarray(y0 + 0.1 * rng.normal(size=y0.size), dtype)
    t, p = jnp.asarray(0.3, dtype), jnp.asarray(1.3, dtype)
    k1 = f(y, t, p)
    # Stage equations solved to rounding (a looser stopping test in float32, whose
    # iteration stalls at rounding before the float64 one's bound).
    eps = float(jnp.finfo(dtype).eps)
    tight = StageTolerance(rtol=10 * eps, atol=10 * eps) if dtype == np.float64 else None
    h = jnp.asarray(2e-3, dtype)
    carry = kvaerno5.initial_carry(y, k1)
    rolled = step.step_with_stages(f, y, carry, t, h, p, tol=tight)
    unrolled = unrolled_step.step_with_stages(f, y, carry, t, h, p, tol=tight)
    _assert_same_step(rolled, unrolled, dtype)

    # A field that turns strongly nonlinear in a short window around the third stage's
    # time (c = 1.23; the other stages' times are at least 0.1 h away) makes that
    # stage's iteration, with the Jacobian at the step's start, diverge while staying
    # finite; the later stages converge from there, and the step fails in both forms.
    def g(y, s, p):
        bump = jnp.where(jnp.abs(s - (t + 1.23 * h)) < 0.05 * h, 1e4, 0.0).astype(y.dtype)
        return f(y, s, p) + bump * jnp.sin(y) ** 2

    for form in (step, unrolled_step):
        assert not bool(_converged(form.step_with_stages(g, y, carry, t, h, p, tol=tight)[3]))
        assert bool(_converged(form.step_with_stages(f, y, carry, t, h, p, tol=tight)[3]))


def _esdirk_forms():
    """kvaerno5 with and without its stage loop; a stiffly accurate pair with two
    diagonal values (two iteration matrices); one that is not stiffly accurate (its
    solution a combination of the stages, `f` at the end evaluated)."""
    from solvers.ode.methods import ESDIRK, ButcherTableau, resolve_method

    kvaerno5 = resolve_method("odeint", "kvaerno5")
    two_diagonals = ButcherTableau(
        c=(0.0, 0.2, 1.0), a=((), (0.1,), (0.5, 0.0)), b=(0.5, 0.0, 0.5),
        e=(0.5, -1.0, 0.5), gamma=(0.0, 0.1, 0.5),
    )  # fmt: skip
    combined = ButcherTableau(
        c=(0.0, 0.6, 1.0), a=((), (0.3,), (0.4, 0.3)), b=(0.25, 0.35, 0.4),
        e=(0.05, -0.05, 0.0), gamma=(0.0, 0.3, 0.3),
    )  # fmt: skip
    return {
        "kvaerno5": dataclasses.replace(kvaerno5, stage_loop=False),
        "kvaerno5-loop": dataclasses.replace(kvaerno5, stage_loop=True),
        "two-diagonals": ESDIRK(tableau=two_diagonals, order=2, name="two-diagonals"),
        "combined": ESDIRK(tableau=combined, order=2, name="combined", stage_loop=False),
    }


@pytest.mark.parametrize("form", ["kvaerno5", "kvaerno5-loop", "two-diagonals", "combined"])
def test_esdirk_replay_takes_the_stages_its_step_handed_on(x64, form):
    """The checkpointed adjoint's replay of an ESDIRK step (`replay_step`, given the
    step's end as the solve recorded it) iterates no stage equation: it takes the
    stage values the step handed on in its carry. It gives the step's solution, carry
    and stages, and the same derivative with respect to the start and the parameter,
    which matches central differences of the iterated step."""
    from solvers.ode.methods import StageTolerance, StepEnd

    f_lin, _, y0 = _forced_linear_system()
    rng = np.random.default_rng(3)

    def f(y, t, p):
        return f_lin(y, t, p) + 0.3 * jnp.sin(y) * jnp.sin(3 * t)

    method = _esdirk_forms()[form]
    stage_loop = method.stage_loop
    assert method.stiffly_accurate == (form != "combined")
    y = jnp.asarray(y0 + 0.1 * rng.normal(size=y0.size))
    t, p, h = jnp.asarray(0.3), jnp.asarray(1.3), jnp.asarray(2e-3)
    tight = StageTolerance(rtol=1e-14, atol=1e-14)
    carry = method.initial_carry(y, f(y, t, p))

    def step(y, p):
        y1, _, carry1, ok, ks = method.step_with_stages(f, y, carry, t, h, p, tol=tight)
        return y1, carry1, ok, ks

    y1, carry1, ok, ks = step(y, p)
    assert bool(_converged(ok))
    end = StepEnd(y1, method.replay_end(carry1))

    def replay(y, p):
        y1, _, carry1, _, ks = method.replay_step(f, y, carry, t, h, p, end, tol=tight)
        return y1, carry1, ks

    # No Newton iteration and no iteration matrix: no factorisation, and without the
    # stage loop no loop at all. (The iterated step has both.)
    for fn, iterates in ((replay, False), (lambda y, p: step(y, p)[:2], True)):
        lowered = jax.jit(fn).lower(y, p).as_text()
        assert ("getrf" in lowered) == iterates
        if not stage_loop:
            assert ("stablehlo.while" in lowered) == iterates
    r_y1, r_carry1, r_ks = replay(y, p)
    scale = float(jnp.max(jnp.abs(jnp.stack(ks))))
    ours = [r_y1, r_carry1.k, r_carry1.stages.packed, *r_ks]
    for a, b in zip(ours, [y1, carry1.k, carry1.stages.packed, *ks], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-13 * scale)

    # The same derivative as the iterated step's, and central differences of it.
    d_replay = jax.jacfwd(lambda y, p: replay(y, p)[0], argnums=(0, 1))(y, p)
    d_step = jax.jacfwd(lambda y, p: step(y, p)[0], argnums=(0, 1))(y, p)
    for a, b in zip(d_replay, d_step, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
    eps = 1e-5
    fd = (step(y, p + eps)[0] - step(y, p - eps)[0]) / (2 * eps)
    np.testing.assert_allclose(d_replay[1], fd, rtol=1e-7, atol=1e-9)
    v = jnp.asarray(rng.normal(size=y.size))
    fd_y = (step(y + eps * v, p)[0] - step(y - eps * v, p)[0]) / (2 * eps)
    np.testing.assert_allclose(d_replay[0] @ v, fd_y, rtol=1e-7, atol=1e-9)


def test_esdirk_first_carry_holds_the_stages_of_a_zero_step(x64):
    """Before its first step, an ESDIRK carry holds the start's value for every stage:
    the stages of a step of size zero. Replayed from it, such a step is the identity
    with an identity derivative, and evaluates the field's derivative at the start
    only: for `y' = -p sqrt(y)` from `y = 1` (a Jacobian infinite at 0) it is finite,
    where stage values of 0 would make it `0 * inf`."""
    from solvers.ode.methods import StepEnd, resolve_method

    def f(y, t, p):
        return -p * jnp.sqrt(y)

    method = resolve_method("odeint", "kvaerno5")
    y0, p = jnp.ones(2), jnp.asarray(0.8)
    carry0 = method.initial_carry(y0, f(y0, 0.0, p))
    np.testing.assert_array_equal(carry0.stages.unpack(2), jnp.ones((6, 2)))
    end = StepEnd(y0, method.replay_end(carry0))

    def replay(y, p):
        return method.replay_step(f, y, carry0, 0.0, 0.0, p, end)[0]

    np.testing.assert_array_equal(replay(y0, p), y0)
    d_y, d_p = jax.jacfwd(replay, argnums=(0, 1))(y0, p)
    np.testing.assert_array_equal(d_y, jnp.eye(2))
    np.testing.assert_array_equal(d_p, jnp.zeros(2))


def test_stiff_method_defaults_to_the_checkpointed_adjoint(x64):
    k = 1000.0
    g = jax.grad(functools.partial(_relaxation_loss, method="kvaerno5"))(k)
    explicit = jax.grad(
        functools.partial(_relaxation_loss, method="kvaerno5", adjoint="checkpoint")
    )(k)
    assert float(g) == float(explicit)
    np.testing.assert_allclose(g, _relaxation_grad_exact(k), rtol=1e-4)


@pytest.mark.parametrize("method", ["dopri5", pytest.param("kvaerno5", marks=pytest.mark.slow)])
def test_backsolve_refuses_a_problem_unstable_backwards(x64, method):
    """Integrated backwards, y' = -k (y - cos t) grows like exp(k t): the state strays
    from the forward solution by 1e100 tolerances, and the gradient (0.5% off, for
    dopri5) must not come back silently."""
    k = 1000.0
    loss = functools.partial(_relaxation_loss, method=method, adjoint="backsolve")
    with pytest.raises(Exception, match="adjoint='checkpoint'"):
        jax.block_until_ready(jax.grad(loss)(k))
    # With throw=False the gradient is NaN instead.
    unchecked = lambda k: jnp.sum(  # noqa: E731
        odeint(_relaxation, 0.0, jnp.asarray(RELAX_TS), k, method=method, adjoint="backsolve",
               throw=False, return_info=True)[0][1:]
    )  # fmt: skip
    assert np.isnan(jax.grad(unchecked)(k))
    ok = jax.grad(functools.partial(_relaxation_loss, method=method, adjoint="checkpoint"))(k)
    np.testing.assert_allclose(ok, _relaxation_grad_exact(k), rtol=1e-4)


def test_backsolve_accepts_a_stable_backward_integration(x64):
    """A damped pendulum integrates backwards within a few tolerances: no error, and the
    same gradient as the checkpointed adjoint."""

    def pendulum(y, t, p):
        return jnp.stack([y[1], -p[0] * jnp.sin(y[0]) - p[1] * y[1]])

    def loss(p, adjoint):
        ts = jnp.linspace(0.0, 10.0, 6)
        return jnp.sum(odeint(pendulum, jnp.array([2.0, 0.0]), ts, p, adjoint=adjoint))

    p = jnp.array([9.81, 0.1])
    np.testing.assert_allclose(
        jax.grad(loss)(p, "backsolve"), jax.grad(loss)(p, "checkpoint"), rtol=1e-6
    )


# ---------------------------------------------------------------------------
# The implicit step.


def test_stiffly_accurate_step_ends_on_its_last_stage(x64):
    """Kvaerno5's last stage is its solution: the step returns that stage's value (the
    last of the stage values it hands on), and the carried derivative at the new point
    comes from the stage equation."""
    m = ode_methods.METHODS["kvaerno5"]
    assert m.stiffly_accurate and not m.fsal
    prob = PROBLEMS["rober"]
    p, y = _point("rober")
    f = lambda y, t, p: prob["f"](y, t, p, jnp)  # noqa: E731
    tol = ode_methods.StageTolerance(rtol=1e-6, atol=1e-10)
    h = 1e-4
    carry = m.initial_carry(y, f(y, 0.0, p))
    y1, _, carry1, ok, ks = m.step_with_stages(f, y, carry, 0.0, h, p, tol=tol)
    assert bool(_converged(ok))
    k_next = carry1.k
    np.testing.assert_array_equal(k_next, ks[-1])
    np.testing.assert_array_equal(carry1.stages.unpack(y.shape[0])[-1], y1)
    # The stage equation's derivative is f at the stage to the stage's accuracy (about
    # 1e-12 here) times the stiffness (|J| about 1e3 on this step).
    np.testing.assert_allclose(k_next, f(y1, h, p), rtol=1e-6, atol=1e-8)


@pytest.fixture
def registry(monkeypatch):
    """`register`, with the registry restored after the test."""
    monkeypatch.setattr(ode_methods, "METHODS", dict(ode_methods.METHODS))
    return ode_methods.register


def test_esdirk_with_a_different_diagonal_per_stage(x64, registry):
    """A stiffly accurate ESDIRK pair of order 2(1) whose implicit stages have diagonals
    0.1 and 0.5: each stage's Newton iteration needs its own `I - h gamma_i J`. (With
    the first stage's matrix for both, the last stage's iteration diverges once
    `h |lambda|` is large: the solve takes about 7 times as many steps, and rejects
    one attempt in eight.)"""
    method = ode_methods.ESDIRK(
        tableau=ode_methods.ButcherTableau(
            c=(0.0, 0.2, 1.0),
            a=((), (0.1,), (0.5, 0.0)),
            b=(0.5, 0.0, 0.5),
            e=(0.5, -1.0, 0.5),
            gamma=(0.0, 0.1, 0.5),
        ),
        order=2,
        name="esdirk-test",
    )
    assert method.stiffly_accurate
    k = 1000.0
    ys, info = odeint(
        _relaxation, 0.0, jnp.asarray(RELAX_TS), k, method=method, rtol=1e-4,
        atol=1e-4, return_info=True,
    )  # fmt: skip
    np.testing.assert_allclose(ys, _relaxation_exact(k, RELAX_TS), atol=1e-5)
    assert int(info.status) == 0 and int(info.steps) < 300 and int(info.rejected) <= 5
    registry(method)
    loss = functools.partial(
        _relaxation_loss, method="esdirk-test", rtol=1e-6, atol=1e-6, max_steps=1 << 14
    )
    np.testing.assert_allclose(jax.grad(loss)(k), _relaxation_grad_exact(k), rtol=1e-3)
    # Its stages cannot run as one loop (one iteration matrix per diagonal value).
    with pytest.raises(ValueError, match="stage_loop=True needs one diagonal value"):
        dataclasses.replace(method, stage_loop=True)
    # A predictor row per implicit stage, row i with i + 1 entries.
    tab = method.tableau
    with pytest.raises(ValueError, match="`predictor` needs 2 rows"):
        dataclasses.replace(tab, predictor=((1.0,), (0.5,)))
    assert dataclasses.replace(tab, predictor=((1.0,), (0.5, 0.5))).predictor is not None


def test_a_new_explicit_tableau_is_one_definition_and_one_registration(x64, registry):
    """Heun-Euler 2(1), defined here: a tableau, a method object, one `register` line.
    Its last stage is not at the step's end (not first-same-as-last), so `f` there is
    an extra evaluation."""
    heun_euler = ode_methods.ExplicitRungeKutta(
        tableau=ode_methods.ButcherTableau(
            c=(0.0, 1.0), a=((), (1.0,)), b=(0.5, 0.5), e=(-0.5, 0.5)
        ),
        order=2,
        name="heun-euler",
    )
    registry(heun_euler)
    assert not heun_euler.fsal and heun_euler.evals_per_step == 2
    ts = jnp.linspace(0.0, 1.0, 3)
    by_name, info = odeint(
        lambda y, t, k: -k * y, 1.0, ts, 2.0, method="heun-euler", rtol=1e-9, atol=1e-9,
        return_info=True,
    )  # fmt: skip
    np.testing.assert_allclose(by_name, np.exp(-2.0 * np.asarray(ts)), rtol=1e-6)
    by_object = odeint(lambda y, t: -2.0 * y, 1.0, ts, method=heun_euler, rtol=1e-9, atol=1e-9)
    np.testing.assert_array_equal(by_name, by_object)
    # Every derivative mode comes with the method.
    loss = lambda k: odeint(lambda y, t, k: -k * y, 1.0, ts, k, method="heun-euler")[-1]  # noqa: E731
    for rule in (jax.grad, jax.jacfwd):
        np.testing.assert_allclose(rule(loss)(2.0), -np.exp(-2.0), rtol=1e-6)


@pytest.mark.parametrize("method", ["dopri5", "tsit5", "bosh3", "dopri8", "rk4", "euler"])
def test_num_fevals_counts_the_calls(x64, method):
    calls = []

    def f(y, t):
        jax.debug.callback(lambda: calls.append(1))
        return -y

    kw = dict(dt=0.1) if method in ("rk4", "euler") else dict(rtol=1e-6, atol=1e-6)
    _, info = jax.jit(
        lambda y0: odeint(f, y0, jnp.array([0.0, 0.5, 1.0]), method=method, return_info=True, **kw)
    )(1.0)
    jax.effects_barrier()
    assert int(info.num_fevals) == len(calls), (int(info.num_fevals), len(calls))


def test_a_long_span_does_not_end_in_a_step_size_underflow(x64):
    """ROBER to t = 1e10 with a small `atol`: early steps of 1e-5 are far below the
    resolution of the final time, but not of the time reached; a rejected step there
    is no underflow (at rtol 1e-9 some steps there are rejected, which the test
    needs)."""
    prob = PROBLEMS["rober"]
    p, y0 = _point("rober")
    f = lambda y, t, p: prob["f"](y, t, p, jnp)  # noqa: E731
    ts = jnp.array([0.0, 1e10])
    kw = dict(rtol=1e-9, atol=1e-14, mxstep=1e6, max_steps=16384, return_info=True)
    ys, info = jax.jit(lambda p: odeint(f, y0, ts, p, method="bdf", throw=False, **kw))(p)
    assert int(info.status) == 0 and int(info.rejected) > 0
    ref = odeint(f, y0, ts, p, method="radau5", **kw)[0]
    np.testing.assert_allclose(ys[-1], ref[-1], rtol=1e-5, atol=1e-14)
