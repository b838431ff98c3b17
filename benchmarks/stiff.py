"""Stiff problems of the IVP test set: `odeint`'s stiff methods against diffrax and SciPy.

Problems (float64): ROBER to `t = 1e5`, HIRES, VDPOL with `eps = 1e-6`, OREGO, POLLU
(an air-pollution model of 20 species, its 25 rate constants the parameters), the
Brusselator on a line of 64 points (128 states; `--full` adds 256 points) and ROBER as
a differential-algebraic system (the conservation law `y1 + y2 + y3 = 1` as its third
equation: ours with `mass_matrix`, the peers on the equivalent ODE), and the transistor
amplifier (TRANSAMP, a DAE with a full singular mass matrix that only ours solve, against
the test set's reference solution); then large
systems with banded Jacobians: the Brusselator line at 256 and 1024 points and 64 and
1000 copies of ROBER (`--full` adds 4096 points, one copy and 10,000 copies), and the
Brusselator on a 16 x 16 grid with a sparse one (`--full` adds 32 x 32). For each,
the solution at the last time by

- ours: `odeint(method=...)` with `"kvaerno5"`, `"radau5"`, `"bdf"` and
  `"rodas5p"`;
- diffrax: `Kvaerno5` (and on the small problems `Kvaerno3` and `Kvaerno4`, its other
  implicit Runge-Kutta methods) with a PID controller at the same tolerances;
- SciPy: `solve_ivp` with `Radau`, `BDF` and `LSODA`, given the Jacobian (compiled
  by JAX, so that SciPy is not slowed by finite differences); for the large systems,
  the sparsity pattern (`jac_sparsity`) or the band (LSODA) instead.

On a large system where ours are more accurate than SciPy's best but not clearly
faster, ours' quickest method is also run at the loosest of a few multiples of the
tolerances (`MATCH_FACTORS`) whose error is still at most SciPy's best's: the time at
equal accuracy, measured rather than interpolated.

Reported: forward time (median of repeats, compile time apart), accepted steps (for
ours also the Jacobians, factorisations and Newton iterations of `ODEInfo`), the
error at the last time against SciPy's Radau at `rtol = 1e-12` (largest component
error relative to `max(|y_ref|, atol)`), the time of `jit(grad)` of `sum(y(T))` with
respect to the parameters (ours: the checkpointed adjoint, the stiff methods'
default; diffrax: its default `RecursiveCheckpointAdjoint`) and its compile time
(trace, lower and XLA compile, one fresh compile after `jax.clear_caches()`).
A work-precision diagram (error against time over tolerances) goes to
`results/stiff.png`.

The step-adjoint floor of each of our methods on the small problems is not a solver:
the method's step linearised and pulled back with `jax.vjp` at stored states (up to 16
in turn, each buffer at most 512 bytes, so that the loop runs without XLA's task
scheduler, as the sweep's blocks do), through `replay_step` as the checkpointed
adjoint's sweep pulls each accepted step back: given the step's end, an implicit
method's pull-back is the implicit derivative of its stage equations, with no
iteration. The adjoint runs the forward solve (recording it) and pulls back each
accepted step, so `1 + steps x pull-back / forward` bounds the gradient's ratio to the
forward time from below; what a gradient costs above it is the sweep's own work
(reading the record, the output cotangents, replays of segments not kept).

Usage::

    python -m benchmarks.stiff            # --quick (default): about 15 minutes on 2 cores
    python -m benchmarks.stiff --full     # larger Brusselator, more tolerances, repeats
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.metadata
import math
import platform
import sys
import time
from pathlib import Path

import jax

jax.config.update("jax_enable_x64", True)

import diffrax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from scipy.integrate import solve_ivp  # noqa: E402

from benchmarks._env import cpus, loadavg  # noqa: E402
from benchmarks._timing import fmt, interleaved, ratio, sci  # noqa: E402
from benchmarks._workers import write_report  # noqa: E402
from solvers import odeint  # noqa: E402
from solvers.ode.odeint import SPARSE_STAGE_MIN_STATES  # noqa: E402
from tests.solvers.stiff_problems import (  # noqa: E402
    PROBLEMS,
    bruss,
    hires,
    orego,
    pollu,
    rober,
    vdpol,
)

NAME = "stiff"
OURS = ("kvaerno5", "radau5", "bdf", "rodas5p")
#: Ours whose gradient is timed on the large systems too.
GRAD_LARGE = ("bdf", "rodas5p")
SCIPY = ("Radau", "BDF", "LSODA")
#: diffrax's implicit Runge-Kutta methods timed on the small problems (Kvaerno5 alone on
#: the large ones, where a dense LU per step takes minutes).
DIFFRAX = ("Kvaerno3", "Kvaerno4", "Kvaerno5")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclasses.dataclass(frozen=True)
class Problem:
    name: str
    f: object  # f(y, t, p, xp)
    y0: tuple
    p: tuple
    t1: float
    rtol: float
    atol: float
    #: A differential-algebraic problem's mass matrix (its diagonal), and the
    #: equivalent ODE that the peers and the reference solve.
    mass: tuple | None = None
    ode_f: object = None
    #: y(T) given with the problem (else SciPy's Radau at rtol 1e-12 computes it).
    ref: tuple | None = None

    @property
    def has_peers(self) -> bool:
        """Whether diffrax and SciPy solve it (a DAE only through an equivalent ODE)."""
        return self.mass is None or self.ode_f is not None

    @property
    def methods(self) -> tuple[str, ...]:
        """Ours that solve it (the ESDIRK method takes no mass matrix)."""
        return tuple(m for m in OURS if self.mass is None or m != "kvaerno5")

    def for_peers(self) -> Problem:
        """The problem as the peers solve it: the equivalent ODE of a DAE."""
        return self if self.ode_f is None else dataclasses.replace(self, f=self.ode_f)


def rober_dae(y, t, p, xp):
    """ROBER with the conservation law `y1 + y2 + y3 = 1` as its third equation."""
    return xp.stack(
        [
            -p[0] * y[0] + p[2] * y[1] * y[2],
            p[0] * y[0] - p[2] * y[1] * y[2] - p[1] * y[1] ** 2,
            y[0] + y[1] + y[2] - 1.0,
        ]
    )


_AMP = dict(ub=6.0, uf=0.026, alpha=0.99, beta=1e-6, r0=1000.0, r=9000.0)


def transistor_amplifier(y, t, p, xp):
    """The transistor amplifier of the IVP test set (`transamp.F`): `M y' = f` with
    a full, singular `M` of capacitances; `p = (ub,)`, the supply voltage."""
    a = _AMP
    ub, r = p[0], a["r"]
    ue = 0.1 * xp.sin(200 * np.pi * t)
    g1 = a["beta"] * (xp.exp((y[1] - y[2]) / a["uf"]) - 1)
    g2 = a["beta"] * (xp.exp((y[4] - y[5]) / a["uf"]) - 1)
    return xp.stack(
        [
            (y[0] - ue) / a["r0"],
            y[1] / r + (y[1] - ub) / r + (1 - a["alpha"]) * g1,
            y[2] / r - g1,
            (y[3] - ub) / r + a["alpha"] * g1,
            y[4] / r + (y[4] - ub) / r + (1 - a["alpha"]) * g2,
            y[5] / r - g2,
            (y[6] - ub) / r + a["alpha"] * g2,
            y[7] / r,
        ]
    )


def _amplifier_problem() -> Problem:
    m = np.zeros((8, 8))
    for (i, j), ck in zip(((0, 1), (3, 4), (6, 7)), (1e-6, 3e-6, 5e-6)):
        m[i, i] = m[j, j] = -ck
        m[i, j] = m[j, i] = ck
    m[2, 2], m[5, 5] = -2e-6, -4e-6
    # y(0.2) by PSIDE at rtol = atol = 1e-14, the test set's reference solution.
    ref = (
        -0.5562145012262709e-2, 0.3006522471903042e1, 0.2849958788608128e1,
        0.2926422536206241e1, 0.2704617865010554e1, 0.2761837778393145e1,
        0.4770927631616772e1, 0.1236995868091548e1,
    )  # fmt: skip
    y0 = (0.0, 3.0, 3.0, 6.0, 3.0, 3.0, 6.0, 0.0)
    mass = tuple(map(tuple, m))
    return Problem("TRANSAMP DAE (8)", transistor_amplifier, y0, (6.0,), 0.2, 1e-6, 1e-6,
                   mass, None, ref)  # fmt: skip


def _bruss_problem(n: int) -> Problem:
    x = np.arange(1, n + 1) / (n + 1)
    y0 = np.concatenate([1 + np.sin(2 * np.pi * x), 3 * np.ones(n)])
    return Problem(f"BRUSS {n} ({2 * n})", bruss(n), tuple(y0), (1.0, 3.0, 0.02), 10.0, 1e-6, 1e-6)


def problems(mode: str) -> list[Problem]:
    def of(name):
        return tuple(PROBLEMS[name]["y0"]), tuple(PROBLEMS[name]["p"])

    out = [
        Problem("ROBER (3)", rober, *of("rober"), 1e5, 1e-6, 1e-10),
        Problem("HIRES (8)", hires, *of("hires"), 321.8122, 1e-6, 1e-6),
        Problem("VDPOL (2)", vdpol, *of("vdpol"), 2.0, 1e-6, 1e-6),
        Problem("OREGO (3)", orego, *of("orego"), 360.0, 1e-6, 1e-6),
        Problem("POLLU (20)", pollu, *of("pollu"), 60.0, 1e-6, 1e-10),
        _bruss_problem(64),
        Problem("ROBER DAE (3)", rober_dae, *of("rober"), 1e5, 1e-6, 1e-10, (1.0, 1.0, 0.0), rober),
        _amplifier_problem(),
    ]
    if mode == "full":
        out.append(_bruss_problem(256))
    return out


# ---------------------------------------------------------------------------
# The implementations: each returns `solve(p) -> (y(T), steps)` (ours: `_counts` as the
# steps, see `first_row`), and `loss(p)`.


def ours(prob: Problem, method: str, rtol: float, atol: float):
    y0 = jnp.asarray(prob.y0)
    ts = jnp.array([0.0, prob.t1])

    def field(y, t, p):
        return prob.f(y, t, p, jnp)

    mass = None if prob.mass is None else np.asarray(prob.mass)
    kw = dict(method=method, rtol=rtol, atol=atol, mxstep=10**6, mass_matrix=mass)

    def solve(p):
        ys, info = odeint(field, y0, ts, p, return_info=True, **kw)
        return ys[-1], _counts(info)

    def loss(p):
        ys = odeint(field, y0, ts, p, **kw)
        return jnp.sum(ys[-1])

    return jax.jit(solve), loss


def diffrax_solver(prob: Problem, rtol: float, atol: float, solver: str = "Kvaerno5"):
    """diffrax's `solver` (a name in `DIFFRAX`) with a PID controller: `(solve, loss)` as
    `ours` returns them."""
    y0 = jnp.asarray(prob.y0)
    term = diffrax.ODETerm(lambda t, y, p: prob.f(y, t, p, jnp))
    ctrl = diffrax.PIDController(rtol=rtol, atol=atol)

    def run(p):
        return diffrax.diffeqsolve(
            term,
            getattr(diffrax, solver)(),
            0.0,
            prob.t1,
            None,
            y0,
            args=p,
            stepsize_controller=ctrl,
            saveat=diffrax.SaveAt(t1=True),
            max_steps=10**6,
        )

    def solve(p):
        sol = run(p)
        return sol.ys[-1], sol.stats["num_accepted_steps"]

    def loss(p):
        return jnp.sum(run(p).ys[-1])

    return jax.jit(solve), loss


def scipy_solver(prob: Problem, method: str, rtol: float, atol: float):
    p = np.asarray(prob.p)
    jac = jax.jit(jax.jacfwd(lambda y: prob.f(y, 0.0, jnp.asarray(p), jnp)))
    y0 = np.asarray(prob.y0)

    def rhs(t, y):
        return prob.f(y, t, p, np)

    def jacobian(t, y):
        return np.asarray(jac(jnp.asarray(y)))

    def solve(_p=None):
        # Without `t_eval` SciPy keeps every step: the last one is y(T).
        sol = solve_ivp(rhs, (0.0, prob.t1), y0, method=method, rtol=rtol, atol=atol, jac=jacobian)
        if not sol.success:
            raise RuntimeError(sol.message)
        return sol.y[:, -1], sol.t.size - 1

    return solve


def reference(prob: Problem) -> np.ndarray:
    """y(T) by SciPy's Radau at `rtol = 1e-12`, or the problem's own."""
    if prob.ref is not None:
        return np.asarray(prob.ref)
    atol = 1e-14 * max(prob.atol / prob.rtol, 1e-2)
    return scipy_solver(prob.for_peers(), "Radau", 1e-12, atol)()[0]


def error(y, ref, atol) -> float:
    y, ref = np.asarray(y), np.asarray(ref)
    return float(np.max(np.abs(y - ref) / np.maximum(np.abs(ref), atol)))


# ---------------------------------------------------------------------------
# Measurements.


@dataclasses.dataclass
class Row:
    impl: str
    forward: float | None = None  # seconds
    steps: int | None = None
    err: float | None = None
    grad: float | None = None
    grad_compile: float | None = None
    note: str = ""
    work: tuple[int, int, int] | None = None  # ours: Jacobians, factorisations, Newton its


def _counts(info):
    """What `ours` reports of a solve: its steps, Jacobians, factorisations and Newton
    iterations, as one array."""
    return jnp.stack(
        [info.steps, info.num_jacobians, info.num_factorisations, info.num_newton_iterations]
    )


def first_row(name: str, out, ref: np.ndarray, atol: float) -> Row:
    """The row of a first call `out = (y(T), steps)` (ours: `_counts` as the steps)."""
    y, counts = jax.block_until_ready(out)
    counts = np.atleast_1d(np.asarray(counts))
    work = tuple(int(c) for c in counts[1:]) if counts.size > 1 else None
    return Row(name, steps=int(counts[0]), err=error(y, ref, atol), work=work)


#: Each timed implementation gets at least this many seconds of samples (more rounds
#: for calls of a millisecond or two, whose median of a few calls would be noisy).
MIN_TIME = 0.25


def _time_host(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _fresh_compile(fn, *args):
    """`(compiled, seconds)`: `fn.lower(*args).compile()` (trace, lower and XLA compile)
    after `jax.clear_caches()`, so that no implementation compiles faster for the
    programs compiled before it (its own forward solve, or another solver of the same
    library sharing internal functions), as in the other entries' compile times."""
    gc.collect()
    jax.clear_caches()
    t0 = time.perf_counter()
    compiled = fn.lower(*args).compile()
    return compiled, time.perf_counter() - t0


def measure(prob: Problem, mode: str, ref: np.ndarray) -> list[Row]:
    rounds = 5 if mode == "quick" else 15
    p = jnp.asarray(prob.p)
    rows: dict[str, Row] = {}
    solves, losses = {}, {}
    for m in prob.methods:
        solves[f"ours ({m})"], losses[f"ours ({m})"] = ours(prob, m, prob.rtol, prob.atol)
    for solver in DIFFRAX if prob.has_peers else ():
        name = f"diffrax {solver}"
        solves[name], losses[name] = diffrax_solver(prob.for_peers(), prob.rtol, prob.atol, solver)
    for name, solve in solves.items():
        log(f"  {prob.name}: {name} forward")
        rows[name] = first_row(name, solve(p), ref, prob.atol)
    # Per-call medians, the implementations taking turns.
    med = interleaved(solves, rounds=rounds, block=1, budget=20.0, args=(p,), min_time=MIN_TIME)
    for name, t in med.items():
        rows[name].forward = t
    for name, loss in losses.items():
        log(f"  {prob.name}: {name} grad")
        compiled, rows[name].grad_compile = _fresh_compile(jax.jit(jax.grad(loss)), p)
        gv = jax.block_until_ready(compiled(p))
        if not np.all(np.isfinite(np.asarray(gv))):
            rows[name].note = "non-finite gradient"
        rows[name].grad = interleaved(
            {name: compiled}, rounds=rounds, block=1, budget=20.0, args=(p,), min_time=MIN_TIME
        )[name]
    for method in SCIPY if prob.has_peers else ():
        name = f"scipy {method}"
        log(f"  {prob.name}: {name}")
        solve = scipy_solver(prob.for_peers(), method, prob.rtol, prob.atol)
        try:
            y, steps = solve()
            row = Row(name, steps=int(steps), err=error(y, ref, prob.atol))
            row.forward = _time_host(solve, 3 if mode == "quick" else 7)
        except RuntimeError as e:
            row = Row(name, note=f"failed: {e}")
        rows[name] = row
    return list(rows.values())


#: Pull-backs per timed call and stored states of the step-adjoint floor (see the
#: module).
FLOOR_STEPS, FLOOR_ROWS = 256, 16
#: The problems with floor rows: no mass matrix, at most this many states.
FLOOR_MAX_STATES = 32


def step_floor(prob: Problem, method: str) -> float:
    """Seconds per step of `method`'s step pulled back with `jax.vjp` at stored states,
    as the checkpointed adjoint pulls back each accepted step: through `replay_step`,
    given the step's end, so that an implicit method's pull-back is its implicit
    derivative, without iterating (see the module)."""
    from solvers.ode.blocks import SEQUENTIAL_BYTES
    from solvers.ode.methods import (
        METHODS,
        StageTolerance,
        StepEnd,
        combine_carry,
        partition_carry,
    )

    m, n = METHODS[method], FLOOR_STEPS
    tol = StageTolerance(rtol=prob.rtol, atol=prob.atol)
    p = (jnp.asarray(prob.p),)
    y0 = jnp.asarray(prob.y0)
    rows = max(1, min(FLOOR_ROWS, SEQUENTIAL_BYTES // y0.nbytes))
    h = 1e-6 * prob.t1
    tree = jax.tree_util.tree_map

    def f(y, t, p):
        return prob.f(y, t, p[0], jnp)

    def states(p):
        # `rows + 1` step starts, each carry as the record keeps it (`replay_carry`).
        def body(c, i):
            y, carry = c
            y1, _, carry1, _, _ = m.step_with_stages(f, y, carry, i * h, h, p, tol=tol)
            return (y1, carry1), (y, m.replay_carry(carry))

        carry0 = m.initial_carry(y0, f(y0, 0.0, p))
        return jax.lax.scan(body, (y0, carry0), jnp.arange(rows + 1))[1]

    def backward(p, ys, carries):
        def body(j, c):
            i = (n - 1 - j) % rows
            a, v_bar, p_bar = c
            values, memory = partition_carry(tree(lambda b: b[i], carries))
            end = StepEnd(ys[i + 1], m.replay_end(tree(lambda b: b[i + 1], carries)))

            def step(y, values, p):
                carry = combine_carry(values, memory)
                y1, _, carry1, _, _ = m.replay_step(f, y, carry, i * h, h, p, end, tol=tol)
                return y1, partition_carry(m.replay_carry(carry1))[0]

            _, pullback = jax.vjp(step, ys[i], values, p)
            da, dv, dp = pullback((a, v_bar))
            return da, dv, tree(jnp.add, p_bar, dp)

        values0 = partition_carry(tree(lambda b: b[0], carries))[0]
        init = (jnp.ones_like(y0), tree(jnp.zeros_like, values0), tree(jnp.zeros_like, p))
        return jax.lax.fori_loop(0, n, body, init)

    ys, carries = jax.jit(states)(p)
    bwd = jax.jit(backward)
    med = interleaved(
        {"pull-back": lambda: bwd(p, ys, carries)},
        rounds=5, block=1, budget=10.0, args=(), min_time=MIN_TIME,
    )  # fmt: skip
    return med["pull-back"] / n


def work_precision(prob: Problem, tols: list[float], ref: np.ndarray) -> dict[str, list]:
    """(tolerance, time, error) per implementation over `tols` (atol as the problem's
    ratio to rtol)."""
    out: dict[str, list] = {}
    p = jnp.asarray(prob.p)
    for tol in tols:
        atol = tol * prob.atol / prob.rtol
        solves = {f"ours ({m})": ours(prob, m, tol, atol)[0] for m in prob.methods}
        for solver in DIFFRAX if prob.has_peers else ():
            solves[f"diffrax {solver}"] = diffrax_solver(prob.for_peers(), tol, atol, solver)[0]
        med = interleaved(solves, rounds=3, block=1, budget=10.0, args=(p,))
        for name, solve in solves.items():
            y, _ = solve(p)
            out.setdefault(name, []).append((tol, med[name], error(y, ref, atol)))
        for method in SCIPY if prob.has_peers else ():
            solve = scipy_solver(prob.for_peers(), method, tol, atol)
            try:
                y, _ = solve()
                t = _time_host(solve, 1)
                out.setdefault(f"scipy {method}", []).append((tol, t, error(y, ref, atol)))
            except RuntimeError:
                pass
        log(f"  work-precision {prob.name} tol {tol:.0e} done")
    return out


# ---------------------------------------------------------------------------
# Large systems: banded stage solves against SciPy's sparse Jacobians.


@dataclasses.dataclass(frozen=True)
class Large:
    """A large stiff system with a banded or sparse Jacobian."""

    name: str
    f: object  # f(y, t, p, xp) on the flat state
    y0: np.ndarray
    p: tuple
    t1: float
    rtol: float
    atol: float
    band: tuple[int, int] | None
    copies: int = 0  # N copies of ROBER: the reference is one copy's, tiled
    pattern: tuple | None = None  # (rows, cols) of the Jacobian: ours use it when given

    @property
    def structure(self) -> str:
        return "banded" if self.pattern is None else "sparse"


def _bruss_line(points: int) -> Large:
    """The Brusselator on a line, each point's (u, v) stored together: bandwidths 2."""
    f_split = bruss(points)

    def f(y, t, p, xp):
        split = xp.concatenate([y[0::2], y[1::2]])
        out = f_split(split, t, p, xp)
        return xp.reshape(xp.stack([out[:points], out[points:]], axis=1), (-1,))

    x = np.arange(1, points + 1) / (points + 1)
    y0 = np.stack([1 + np.sin(2 * np.pi * x), 3 * np.ones(points)], axis=1).ravel()
    return Large(
        f"BRUSS line {points} ({2 * points})", f, y0, (1.0, 3.0, 0.02), 10.0, 1e-6, 1e-6, (2, 2)
    )


def _rober_copies(copies: int) -> Large:
    """N independent copies of ROBER (block diagonal, bandwidths 2), rtol = atol = 1e-8
    as in the published comparisons."""

    def f(y, t, p, xp):
        z = xp.reshape(y, (-1, 3))
        a, b, c = z[:, 0], z[:, 1], z[:, 2]
        out = xp.stack(
            [
                -p[0] * a + p[2] * b * c,
                p[0] * a - p[2] * b * c - p[1] * b**2,
                p[1] * b**2,
            ],
            axis=1,
        )
        return xp.reshape(out, (-1,))

    y0 = np.tile([1.0, 0.0, 0.0], copies)
    # Block diagonal: ours and SciPy's BDF and Radau get the pattern, LSODA the band.
    block = np.arange(3 * copies).reshape(copies, 3)
    rows = np.repeat(block, 3, axis=1).ravel()
    cols = np.tile(block, (1, 3)).ravel()
    return Large(
        f"{copies} x ROBER ({3 * copies})", f, y0, tuple(PROBLEMS["rober"]["p"]), 1e5,
        1e-8, 1e-8, (2, 2), copies, pattern=(rows, cols),
    )  # fmt: skip


def _bruss_2d(k: int) -> Large:
    """The Brusselator on a periodic `k x k` grid (Hairer and Wanner's BRUSS-2D without
    its forcing), each point's (u, v) stored together: a 5-point stencil, sparse with
    no narrow band as stored."""

    def f(y, t, p, xp):
        z = xp.reshape(y, (k, k, 2))
        u, v = z[..., 0], z[..., 1]

        def lap(w):
            rolls = xp.roll(w, 1, 0) + xp.roll(w, -1, 0) + xp.roll(w, 1, 1) + xp.roll(w, -1, 1)
            return (rolls - 4 * w) * k**2

        du = 1 + u * u * v - 4.4 * u + p[0] * lap(u)
        dv = 3.4 * u - u * u * v + p[0] * lap(v)
        return xp.reshape(xp.stack([du, dv], axis=-1), (-1,))

    x = np.arange(k) / k
    gx, gy = np.meshgrid(x, x, indexing="ij")
    y0 = np.stack([22 * gy * (1 - gy) ** 1.5, 27 * gx * (1 - gx) ** 1.5], axis=-1).ravel()
    idx = np.arange(k * k).reshape(k, k)
    rows, cols = [], []
    for di, dj in ((0, 0), (1, 0), (-1, 0), (0, 1), (0, -1)):
        near = np.roll(np.roll(idx, di, 0), dj, 1).ravel()
        for a in range(2):
            for b in range(2) if (di, dj) == (0, 0) else (a,):
                rows.append(2 * idx.ravel() + a)
                cols.append(2 * near + b)
    pattern = (np.concatenate(rows), np.concatenate(cols))
    return Large(
        f"BRUSS 2-D {k}x{k} ({2 * k * k})", f, y0, (0.1,), 11.5, 1e-6, 1e-6, None,
        pattern=pattern,
    )  # fmt: skip


def large_problems(mode: str) -> list[Large]:
    if mode == "quick":
        return [
            _bruss_line(256),
            _bruss_line(1024),
            _bruss_2d(16),
            _rober_copies(64),
            _rober_copies(1000),
        ]
    return [
        _bruss_line(256),
        _bruss_line(1024),
        _bruss_line(4096),
        _bruss_2d(16),
        _bruss_2d(32),
        _rober_copies(1),
        _rober_copies(64),
        _rober_copies(1000),
        _rober_copies(10000),
    ]


def _band_pattern(n: int, band: tuple[int, int]):
    import scipy.sparse

    lower, upper = band
    return scipy.sparse.diags(
        [np.ones(n - abs(d)) for d in range(-lower, upper + 1)], list(range(-lower, upper + 1))
    )


def scipy_large(prob: Large, method: str, rtol: float, atol: float):
    p = np.asarray(prob.p)
    n = prob.y0.size
    if method == "LSODA":  # no sparse option: its band, else a dense Jacobian
        opts = {} if prob.band is None else dict(lband=prob.band[0], uband=prob.band[1])
    elif prob.pattern is not None:
        import scipy.sparse

        rows, cols = prob.pattern
        sparsity = scipy.sparse.coo_matrix((np.ones(rows.size), (rows, cols)), shape=(n, n))
        opts = dict(jac_sparsity=sparsity.tocsr())
    else:
        opts = dict(jac_sparsity=_band_pattern(n, prob.band))

    def solve(_p=None):
        sol = solve_ivp(
            lambda t, y: prob.f(y, t, p, np), (0.0, prob.t1), prob.y0, method=method,
            rtol=rtol, atol=atol, **opts,
        )  # fmt: skip
        if not sol.success:
            raise RuntimeError(sol.message)
        return sol.y[:, -1], sol.t.size - 1

    return solve


def large_reference(prob: Large) -> np.ndarray:
    if prob.copies:
        one = Problem("ROBER", rober, *(tuple(PROBLEMS["rober"][k]) for k in ("y0", "p")),
                      prob.t1, prob.rtol, prob.atol)  # fmt: skip
        return np.tile(reference(one), prob.copies)
    return scipy_large(prob, "Radau", 1e-10, 1e-12)()[0]


def ours_large(prob: Large, method: str, default: bool = False):
    """Ours with the problem's band or pattern given, or with `default`, the stage
    solver `odeint` picks itself (above 1000 states: the pattern traced from `f`)."""
    from implicitdiff import linear_solve

    y0 = jnp.asarray(prob.y0)
    ts = jnp.array([0.0, prob.t1])
    if default:
        solver = None
    elif prob.pattern is None:
        solver = linear_solve.Banded(*prob.band, throw=False)
    else:
        solver = linear_solve.Sparse(prob.pattern, throw=False)
    kw = dict(method=method, rtol=prob.rtol, atol=prob.atol, mxstep=10**6, linear_solver=solver)

    def field(y, t, p):
        return prob.f(y, t, p, jnp)

    def solve(p):
        ys, info = odeint(field, y0, ts, p, return_info=True, **kw)
        return ys[-1], _counts(info)

    def loss(p):
        return jnp.sum(odeint(field, y0, ts, p, **kw)[-1])

    return jax.jit(solve), loss


def measure_large(prob: Large, mode: str, ref: np.ndarray) -> list[Row]:
    rounds = 3 if mode == "quick" else 7
    p = jnp.asarray(prob.p)
    rows: dict[str, Row] = {}
    solves, losses = {}, {}
    for m in OURS:
        name = f"ours ({m}, {prob.structure})"
        solves[name], losses[name] = ours_large(prob, m)
    if prob.y0.size > SPARSE_STAGE_MIN_STATES:
        # No solver given: odeint traces the pattern from `f` and picks Sparse.
        solves["ours (bdf, default)"], _ = ours_large(prob, "bdf", default=True)
    if prob.y0.size <= 256:  # a dense LU per step: beyond this diffrax takes minutes
        flat = Problem(prob.name, prob.f, tuple(prob.y0), prob.p, prob.t1, prob.rtol, prob.atol)
        solves["diffrax Kvaerno5"], losses["diffrax Kvaerno5"] = diffrax_solver(
            flat, prob.rtol, prob.atol
        )
    for name, solve in solves.items():
        log(f"  {prob.name}: {name} forward")
        rows[name] = first_row(name, solve(p), ref, prob.atol)
    med = interleaved(solves, rounds=rounds, block=1, budget=30.0, args=(p,), min_time=MIN_TIME)
    for name, t in med.items():
        rows[name].forward = t
    for name, loss in losses.items():
        graded = {f"ours ({m}, {prob.structure})" for m in GRAD_LARGE}
        if name not in graded and not name.startswith("diffrax"):
            continue
        log(f"  {prob.name}: {name} grad")
        compiled, rows[name].grad_compile = _fresh_compile(jax.jit(jax.grad(loss)), p)
        jax.block_until_ready(compiled(p))
        rows[name].grad = interleaved(
            {name: compiled}, rounds=rounds, block=1, budget=30.0, args=(p,), min_time=MIN_TIME
        )[name]
    lsoda = "dense" if prob.band is None else "banded"
    for method in SCIPY:
        name = f"scipy {method} ({lsoda if method == 'LSODA' else 'jac_sparsity'})"
        log(f"  {prob.name}: {name}")
        solve = scipy_large(prob, method, prob.rtol, prob.atol)
        try:
            y, steps = solve()
            row = Row(name, steps=int(steps), err=error(y, ref, prob.atol))
            row.forward = _time_host(solve, 1 if prob.y0.size > 4000 else 3)
        except RuntimeError as e:
            row = Row(name, note=f"failed: {e}")
        rows[name] = row
    matched = at_scipy_accuracy(prob, list(rows.values()), ref, rounds)
    if matched is not None:
        rows[matched.impl] = matched
    return list(rows.values())


#: The multiples of a large system's tolerances tried for ours at SciPy's accuracy,
#: loosest first (see `at_scipy_accuracy`).
MATCH_FACTORS = (4.0, 3.0, 2.5, 2.0, 1.5)

#: Ours are matched to SciPy's accuracy when their forward time at the problem's
#: tolerances is above this fraction of SciPy's best.
MATCH_ABOVE = 0.8

MATCHED = "at SciPy's accuracy"


def _is_matched(row: Row) -> bool:
    return MATCHED in row.impl


def at_scipy_accuracy(prob: Large, rows: list[Row], ref: np.ndarray, rounds: int) -> Row | None:
    """Ours' quickest forward solve rerun at the loosest multiple of the tolerances
    (`MATCH_FACTORS`, rtol and atol alike) whose error is at most SciPy's best's, when
    ours are the more accurate and not clearly faster (`MATCH_ABOVE`); `None` when not
    needed or when no multiple is accurate enough."""
    ours_rows = [r for r in rows if r.impl.startswith("ours") and r.forward]
    sp = [r for r in rows if r.impl.startswith("scipy") and r.forward]
    if not ours_rows or not sp:
        return None
    best = min(ours_rows, key=lambda r: r.forward)
    best_sp = min(sp, key=lambda r: r.forward)
    if best.forward <= MATCH_ABOVE * best_sp.forward or best.err >= best_sp.err:
        return None
    method = best.impl.split("(")[1].split(",")[0]
    p = jnp.asarray(prob.p)
    for factor in MATCH_FACTORS:
        looser = dataclasses.replace(prob, rtol=prob.rtol * factor, atol=prob.atol * factor)
        solve, _ = ours_large(looser, method, default="default" in best.impl)
        name = f"{best.impl} {MATCHED}"
        first = first_row(name, solve(p), ref, prob.atol)
        err = first.err
        log(f"  {prob.name}: {best.impl} at rtol x{factor:g}: error {err:.2e}")
        if err <= best_sp.err:
            t = interleaved({name: solve}, rounds=rounds, block=1, budget=30.0, args=(p,),
                            min_time=MIN_TIME)[name]  # fmt: skip
            note = f"rtol, atol x{factor:g}: {looser.rtol:.2g}, {looser.atol:.2g}"
            return dataclasses.replace(first, forward=t, note=note)
    return None


# ---------------------------------------------------------------------------
# Report.


def _table(prob, rows) -> list[str]:
    lines = [
        f"### {prob.name}, to t = {prob.t1:g}, rtol {prob.rtol:g}, atol {prob.atol:g}",
        "",
        "| implementation | forward (ms) | steps | Jacobians / LUs / Newton its | "
        "error at T | grad (ms) | grad / forward | jit(grad) compile (s) | note |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        ms = None if r.forward is None else 1e3 * r.forward
        gms = None if r.grad is None else 1e3 * r.grad
        gf = None if r.grad is None or not r.forward else r.grad / r.forward
        lines.append(
            f"| {r.impl} | {fmt(ms)} | {r.steps if r.steps is not None else 'n/a'} | "
            f"{' / '.join(map(str, r.work)) if r.work else 'n/a'} | {sci(r.err)} | "
            f"{fmt(gms)} | {ratio(gf) if gf else 'n/a'} | "
            f"{fmt(r.grad_compile)} | {r.note} |"
        )
    lines.append("")
    return lines


def _floor_table(results, floors) -> list[str]:
    lines = [
        "### Step-adjoint floor",
        "",
        "Not a solver: each method's step pulled back with `jax.vjp` at stored states, "
        f"{FLOOR_STEPS} times in a loop, as the checkpointed adjoint pulls back each "
        "accepted step (through `replay_step`: an implicit method's implicit derivative, "
        "no iteration; see the module). A gradient costs at least the forward solve "
        "and one such pull-back per accepted step: `1 + steps x pull-back / forward`.",
        "",
        "| problem | method | pull-back of a step (us) | steps | forward (ms) | "
        "floor: grad / forward | ours: grad / forward |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for prob, rows in results:
        by_impl = {row.impl: row for row in rows}
        for method in prob.methods:
            back = floors.get((prob.name, method))
            r = by_impl.get(f"ours ({method})")
            if back is None or r is None or not r.forward or not r.steps:
                continue
            floor = 1 + r.steps * back / r.forward
            ours_ratio = ratio(r.grad / r.forward) if r.grad else "n/a"
            lines.append(
                f"| {prob.name} | {method} | {fmt(1e6 * back)} | {r.steps} | "
                f"{fmt(1e3 * r.forward)} | {ratio(floor)} | {ours_ratio} |"
            )
    lines.append("")
    return lines


def render(results, tols, mode: str, seconds: float, loads, large=(), floors=None) -> str:
    versions = (
        f"jax {jax.__version__}, diffrax {importlib.metadata.version('diffrax')}, "
        f"scipy {importlib.metadata.version('scipy')}, backend {jax.default_backend()}, "
        f"{cpus()}, Python {platform.python_version()}; mode --{mode}; run took "
        f"{seconds:.0f} s; load average {loads[0]:.1f} at the start, {loads[1]:.1f} at the end."
    )
    lines = [
        "## Stiff problems: odeint's stiff methods against diffrax and SciPy",
        "",
        versions,
        "",
    ]
    goals = []
    for prob, rows in results:
        if prob.mass is not None and prob.has_peers:
            lines += [
                f"{prob.name}: ours solve the DAE (`mass_matrix`, the third equation the "
                "conservation law); diffrax and SciPy, which have no DAE solver, the "
                "equivalent ODE.",
                "",
            ]
        elif prob.mass is not None:
            lines += [
                f"{prob.name}: a DAE with a full singular mass matrix; neither diffrax nor "
                "SciPy solves it. Error against the test set's reference (PSIDE at 1e-14).",
                "",
            ]
        lines += _table(prob, rows)
        by = {r.impl: r for r in rows}
        if not prob.has_peers:
            continue
        dfx_rows = [by[f"diffrax {solver}"] for solver in DIFFRAX]
        # Against diffrax's fastest forward solve, and its fastest compile of jit(grad).
        dfx = min(dfx_rows, key=lambda r: r.forward or math.inf)
        dfx_compile = min(dfx_rows, key=lambda r: r.grad_compile or math.inf)
        best_ours = min(
            (by[f"ours ({m})"] for m in prob.methods), key=lambda r: r.forward or math.inf
        )
        sp = [by[f"scipy {m}"] for m in SCIPY if by[f"scipy {m}"].forward]
        best_sp = min(sp, key=lambda r: r.forward) if sp else None
        goals.append(
            f"- {prob.name}: best of ours ({best_ours.impl}) "
            f"{ratio(best_ours.forward / dfx.forward)} diffrax's best forward time "
            f"({dfx.impl}; goal <= 0.2x)"
            + (
                f", {ratio(best_ours.forward / best_sp.forward)} SciPy's best "
                f"({best_sp.impl}, error {sci(best_sp.err)} vs ours {sci(best_ours.err)})"
                if best_sp
                else ""
            )
            + f"; grad {ratio(best_ours.grad / best_ours.forward)} its forward (goal <= 3x); "
            f"jit(grad) compile {ratio(best_ours.grad_compile / dfx_compile.grad_compile)} "
            f"diffrax's quickest ({dfx_compile.impl}; goal < 1x)"
        )
    if floors:
        lines += _floor_table(results, floors)
    if large:
        lines += [
            "### Large systems: banded and sparse stage solves",
            "",
            "Ours with `linear_solver=linear_solve.Banded(2, 2)` (the band built from five "
            "Jacobian-vector products) on the lines, and `linear_solve.Sparse(pattern)` on "
            "the 2-D grid (8 products by column colouring, band LU after a reverse "
            "Cuthill-McKee reordering) and the ROBER copies (3 products; independent "
            "3 x 3 blocks, all factored at once); SciPy's BDF and Radau with "
            "`jac_sparsity` (sparse finite-difference Jacobians, sparse LU), LSODA with "
            "its band options (a dense Jacobian on the 2-D grid, for which it has no "
            "sparse option); diffrax (dense LU) only where it finishes in seconds. "
            "N x ROBER: identical copies. `ours (bdf, default)` is given no "
            "`linear_solver`: above "
            f"{SPARSE_STAGE_MIN_STATES} states `odeint` traces the Jacobian's pattern from "
            "the operations of `f` and solves with `Sparse` on it (so do the rows of ours "
            "on BRUSS 64 above, which give no solver). A row marked "
            f"`{MATCHED}` is ours' quickest rerun at the loosest multiple of the "
            "tolerances whose error is at most SciPy's best's (where ours are the more "
            "accurate and not clearly faster): the comparison at equal accuracy.",
            "",
        ]
    for prob, rows in large:
        lines += _table(prob, rows)
        ours_rows = [r for r in rows if r.impl.startswith("ours")]
        best = min((r for r in ours_rows if not _is_matched(r)), key=lambda r: r.forward)
        sp = [r for r in rows if r.impl.startswith("scipy") and r.forward]
        best_sp = min(sp, key=lambda r: r.forward) if sp else None
        line = f"- {prob.name}: best of ours ({best.impl}) {fmt(1e3 * best.forward)} ms"
        if best_sp:
            line += (
                f", {ratio(best.forward / best_sp.forward)} SciPy's best ({best_sp.impl}, "
                f"error {sci(best_sp.err)} vs ours {sci(best.err)})"
            )
            for m in filter(_is_matched, ours_rows):
                line += (
                    f"; {MATCHED} ({m.note}, error {sci(m.err)}) {fmt(1e3 * m.forward)} "
                    f"ms, {ratio(m.forward / best_sp.forward)}"
                )
        if prob.copies == 64:
            line += (
                f"; {ratio(best.forward / 9.1e-3)} the published CVODE time at 192 states "
                "(9.1 ms, other hardware; goal <= 2x)"
            )
        if prob.y0.size >= 8192:
            line += " (goal: well under a second)"
        goals.append(line)
    lines += ["Goals (ratios of this run):", "", *goals, ""]
    lines += [
        "Work-precision: error at T against forward time over the tolerances "
        f"{', '.join(f'{t:.0e}' for t in tols)} (atol in each problem's ratio to rtol), "
        "in `stiff.png`.",
        "",
    ]
    return "\n".join(lines)


def plot(wp, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, len(wp), figsize=(5.5 * len(wp), 4.2), squeeze=False)
    for ax, (name, curves) in zip(axes[0], wp.items()):
        for impl, pts in curves.items():
            pts = sorted(pts)
            ax.loglog(
                [1e3 * t for _, t, _ in pts],
                [max(e, 1e-16) for *_, e in pts],
                "o-",
                label=impl,
                lw=2.2 if impl.startswith("ours") else 1.2,
            )
        ax.set_title(name)
        ax.set_xlabel("forward time (ms)")
        ax.set_ylabel("error at T")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", dest="mode", action="store_const", const="quick")
    mode.add_argument("--full", dest="mode", action="store_const", const="full")
    parser.set_defaults(mode="quick")
    opts = parser.parse_args(argv)
    start, load0 = time.perf_counter(), loadavg()
    log(f"stiff benchmark (--{opts.mode}), {cpus()}")
    results = []
    refs = {}
    for prob in problems(opts.mode):
        log(f"{prob.name}: reference (SciPy Radau, rtol 1e-12)")
        refs[prob.name] = reference(prob)
        results.append((prob, measure(prob, opts.mode, refs[prob.name])))
    floors = {}
    for prob, _ in results:
        if prob.mass is None and len(prob.y0) <= FLOOR_MAX_STATES:
            for method in prob.methods:
                log(f"{prob.name}: step-adjoint floor ({method})")
                floors[(prob.name, method)] = step_floor(prob, method)
    tols = (
        [1e-4, 1e-6, 1e-8] if opts.mode == "quick" else [1e-4, 1e-5, 1e-6, 1e-7, 1e-8, 1e-9, 1e-10]
    )
    wp = {}
    for prob, _ in results[:2] if opts.mode == "quick" else results:
        wp[prob.name] = work_precision(prob, tols, refs[prob.name])
    large = []
    for prob in large_problems(opts.mode):
        log(f"{prob.name}: reference")
        ref = large_reference(prob)
        large.append((prob, measure_large(prob, opts.mode, ref)))
    report = render(
        results, tols, opts.mode, time.perf_counter() - start, (load0, loadavg()), large,
        floors,
    )  # fmt: skip
    write_report(NAME, report, lambda png: plot(wp, png))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
