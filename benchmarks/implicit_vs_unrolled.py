"""Gradient through a fixed-point solve: implicit differentiation vs unrolling the loop.

The problem: the fixed point `x* = f(x*, theta)` of the contraction

    f(x, theta) = c * M tanh(x) + theta,   M u = u/2 + (roll(u, 1) + roll(u, -1))/4,

with `x, theta` in R^n (float32) and the loss `L(theta) = sum(x*(theta)^2)`; the
benchmark times `jax.grad(L)`. `M` couples neighbours (a circulant, `||M|| = 1`),
so the Jacobian `c M diag(sech^2 x)` is neither diagonal nor symmetric, and it
costs O(n) to apply at any size (no n x n matrix). `theta = (1 - c) theta0`,
`theta0 ~ N(0, 1)`, keeps `x*` of order one whatever `c`.

For each state size n and iteration count K, `c` is calibrated (bisection) so that
the iteration `x_{k+1} = f(x_k)` from `x_0 = 0` first satisfies
`||x_{k+1} - x_k|| <= 1e-6 ||x_{k+1}||` at exactly k + 1 = K. Every method then runs
the same forward solve, exactly K steps, and differentiates it its own way:

* unrolled: `lax.fori_loop` differentiated by JAX (a scan that stores the K states);
* ours (neumann): `implicitdiff.implicit_diff(lambda x, t: x - f(x, t),
  solve=linear_solve.neumann)` around that loop (the Neumann series needs only
  matvecs with the Jacobian, the natural solver for a contraction);
* ours (gmres): the same with `linear_solve.gmres` (restart 20), the same Krylov
  method as the peers below;
* jaxopt (gmres): `jaxopt.implicit_diff.custom_fixed_point(f,
  solve=jaxopt.linear_solve.solve_gmres)` around the same loop;
* optimistix (gmres): `optx.fixed_point(f, optx.FixedPointIteration(rtol=0, atol=0),
  max_steps=K, adjoint=optx.ImplicitAdjoint(lineax.GMRES(...)))`, its own loop of
  K steps (it also computes a convergence norm per step, which the shared loop does not).

The backward linear solves all stop at a residual of 1e-5 relative to the
right-hand side (lineax's componentwise criterion made as close as it allows). The
peers' default linear solvers are not used: jaxopt's (`solve_normal_cg`) squares the
condition number and optimistix's (`AutoLinearSolver`, an LU of the materialised
Jacobian) needs an n x n matrix, 40 GB at n = 100000.

For each (n, K, method) the script reports the compile time (trace+lower and XLA
compile, after `jax.clear_caches()`), the median time of one gradient call with
`block_until_ready` (methods interleaved), the peak temporary memory XLA assigns to
the compiled gradient (`memory_analysis().temp_size_in_bytes`), and the agreement of
the gradient with the unrolled one (the reference). Goals: our gradient's memory
flat in K, and its time below the best peer. The tables go to stdout and
`results/implicit_vs_unrolled.md`, the plot to `results/implicit_vs_unrolled.png`;
progress goes to stderr.

CPU timings are sensitive to other processes: XLA splits the larger loops over all
cores, and a step then waits for its slowest thread. On a busy machine, pin the run to
one core (`taskset -c 0 python benchmarks/implicit_vs_unrolled.py`); the table records
the CPUs used and the load average.

Usage::

    python benchmarks/implicit_vs_unrolled.py --quick   # n in {10, 1000}, K in {10, 100}
    python benchmarks/implicit_vs_unrolled.py           # n in {10, 1e3, 1e5}, K in {10, 100, 1000}
    python benchmarks/implicit_vs_unrolled.py --full    # same grid, more repeats
    python benchmarks/implicit_vs_unrolled.py --quick --check   # exit 1 if gradients disagree
    python -m benchmarks.implicit_vs_unrolled --sizes 1000 --iters 10,1000
"""

from __future__ import annotations

import argparse
import gc
import math
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ._env import cpus, loadavg, peer_versions
from ._timing import rotated

ROOT = Path(__file__).resolve().parents[1]

try:
    import implicitdiff
    from implicitdiff import linear_solve
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT))
    import implicitdiff
    from implicitdiff import linear_solve

warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"jaxopt\b.*")
try:
    import jaxopt
except ImportError:  # pip install -e '.[bench]'
    jaxopt = None
try:
    import lineax as lx
    import optimistix as optx
except ImportError:
    lx = optx = None

RESULTS = ROOT / "results"

FORWARD_TOL = 1e-6  # relative step size at which the fixed-point iteration has converged
LINEAR_RTOL = 1e-5  # residual of every backward linear solve, relative to its right-hand side
GMRES_RESTART = 20
AGREE_RTOL = 1e-2  # max |g - g_unrolled| / max |g_unrolled| accepted by --check
FLAT_MEMORY = 1.05  # "flat in K": memory at the largest K within this factor of the smallest

# ---------------------------------------------------------------------------
# The problem.


def mix(u: jax.Array) -> jax.Array:
    """`M u`: a symmetric circulant with eigenvalues in [0, 1] coupling neighbours."""
    return 0.5 * u + 0.25 * (jnp.roll(u, 1) + jnp.roll(u, -1))


def fixed_point_map(x: jax.Array, theta: jax.Array, c: Any) -> jax.Array:
    """`f(x, theta) = c M tanh(x) + theta`, a contraction with factor at most `c`."""
    return c * mix(jnp.tanh(x)) + theta


@jax.jit
def _steps_to_converge(c: jax.Array, theta0: jax.Array, cap: jax.Array) -> jax.Array:
    """Number of steps `x <- f(x)` from 0 until the relative step is <= FORWARD_TOL (<= cap)."""
    theta = (1 - c) * theta0

    def keep_going(state):
        _, k, done = state
        return jnp.logical_not(done) & (k < cap)

    def step(state):
        x, k, _ = state
        new = fixed_point_map(x, theta, c)
        done = jnp.linalg.norm(new - x) <= FORWARD_TOL * jnp.linalg.norm(new)
        return new, k + 1, done

    return lax.while_loop(keep_going, step, (jnp.zeros_like(theta0), 0, False))[1]


@dataclass
class Problem:
    n: int
    iters: int  # K: the forward loop runs exactly this many steps
    c: float  # contraction factor, calibrated so the iteration converges in K steps
    steps: int  # steps to converge measured with the calibrated c (== K unless noted)
    theta: jax.Array

    def f(self, x: jax.Array, theta: jax.Array) -> jax.Array:
        return fixed_point_map(x, theta, self.c)

    def loop(self, x0: jax.Array, theta: jax.Array) -> jax.Array:
        """The shared forward solve: exactly K steps of the fixed-point iteration."""
        return lax.fori_loop(0, self.iters, lambda _, x: self.f(x, theta), x0)


def make_problem(n: int, iters: int) -> Problem:
    """Calibrate `c` by bisection on log(1 - c) so that convergence takes exactly `iters` steps."""
    theta0 = jnp.asarray(np.random.default_rng(0).standard_normal(n).astype(np.float32))
    lo, hi = math.log(1e-7), 0.0  # log(1 - c): lo is slow (c near 1), hi is c = 0
    c, steps = 0.0, 0
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        c = float(np.float32(1 - math.exp(mid)))
        steps = int(_steps_to_converge(np.float32(c), theta0, iters + 1))
        if steps == iters:
            break
        if steps > iters:
            lo = mid
        else:
            hi = mid
    return Problem(n, iters, c, steps, (1 - np.float32(c)) * theta0)


# ---------------------------------------------------------------------------
# The methods. Each builds `solution(theta) -> x*` for a problem.


def solution_unrolled(p: Problem) -> Callable[[jax.Array], jax.Array]:
    return lambda theta: p.loop(jnp.zeros_like(theta), theta)


def _ours(p: Problem, solve: Callable[..., Any]) -> Callable[[jax.Array], jax.Array]:
    solver = implicitdiff.implicit_diff(lambda x, theta: x - p.f(x, theta), solve=solve)(p.loop)
    return lambda theta: solver(jnp.zeros_like(theta), theta)


def solution_ours_neumann(p: Problem) -> Callable[[jax.Array], jax.Array]:
    # A = I - J with J of spectral radius < 1: the Neumann series converges at the rate
    # of the forward iteration. maxiter is generous; the solve stops at the tolerance.
    return _ours(p, partial(linear_solve.neumann, rtol=LINEAR_RTOL, maxiter=20 * p.iters + 100))


def solution_ours_gmres(p: Problem) -> Callable[[jax.Array], jax.Array]:
    return _ours(p, partial(linear_solve.gmres, rtol=LINEAR_RTOL, restart=GMRES_RESTART))


def solution_jaxopt(p: Problem) -> Callable[[jax.Array], jax.Array]:
    solve = partial(jaxopt.linear_solve.solve_gmres, tol=LINEAR_RTOL, restart=GMRES_RESTART)
    solver = jaxopt.implicit_diff.custom_fixed_point(p.f, solve=solve)(p.loop)
    return lambda theta: solver(jnp.zeros_like(theta), theta)


def solution_optimistix(p: Problem) -> Callable[[jax.Array], jax.Array]:
    # rtol = atol = 0: the loop never stops early, so it runs exactly max_steps = K steps.
    # lineax scales the residual componentwise by atol + rtol |b|; with the rms norm and
    # atol = rtol this is close to ||r|| <= rtol ||b|| for a right-hand side of order one.
    adjoint = optx.ImplicitAdjoint(
        linear_solver=lx.GMRES(
            rtol=LINEAR_RTOL, atol=LINEAR_RTOL, norm=optx.rms_norm, restart=GMRES_RESTART
        )
    )
    solver = optx.FixedPointIteration(rtol=0.0, atol=0.0)

    def solution(theta):
        sol = optx.fixed_point(
            lambda y, args: p.f(y, args),
            solver,
            jnp.zeros_like(theta),
            args=theta,
            adjoint=adjoint,
            max_steps=p.iters,
            throw=False,
        )
        return sol.value

    return solution


@dataclass(frozen=True)
class Method:
    name: str
    build: Callable[[Problem], Callable[[jax.Array], jax.Array]]
    available: bool = True
    ours: bool = False
    peer: bool = False


METHODS = [
    Method("unrolled", solution_unrolled),
    Method("ours (neumann)", solution_ours_neumann, ours=True),
    Method("ours (gmres)", solution_ours_gmres, ours=True),
    Method("jaxopt (gmres)", solution_jaxopt, available=jaxopt is not None, peer=True),
    Method("optimistix (gmres)", solution_optimistix, available=optx is not None, peer=True),
]
REF = "unrolled"


def gradient_fn(solution: Callable[[jax.Array], jax.Array]) -> Callable[[jax.Array], jax.Array]:
    return jax.grad(lambda theta: jnp.sum(solution(theta) ** 2))


# ---------------------------------------------------------------------------
# Measurement.


@dataclass
class Result:
    trace_lower: float | None = None  # s
    xla_compile: float | None = None  # s
    run: float | None = None  # s, median of calls
    temp_bytes: int | None = None
    rel_diff: float | None = None  # vs the unrolled gradient
    error: str | None = None


@dataclass
class Cell:
    problem: Problem
    forward: float | None = None  # s, median of the shared forward solve alone
    results: dict[str, Result] = field(default_factory=dict)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _describe(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    # The text of an error raised on the host through a callback ends with the real message.
    text = next((ln for ln in reversed(lines) if "Error" in ln), lines[-1] if lines else "")
    return f"{type(e).__name__}: {text[:240]}"


def compile_method(method: Method, p: Problem, reps: int) -> tuple[Result, Any, np.ndarray | None]:
    """Compile the gradient (median of `reps` fresh compiles) and call it once."""
    res = Result()
    compiled = None
    try:
        samples = []
        for _ in range(reps):
            jax.clear_caches()
            fn = jax.jit(gradient_fn(method.build(p)))
            t0 = time.perf_counter()
            lowered = fn.trace(p.theta).lower()
            t1 = time.perf_counter()
            compiled = lowered.compile()
            t2 = time.perf_counter()
            samples.append((t1 - t0, t2 - t1))
        res.trace_lower = statistics.median(s[0] for s in samples)
        res.xla_compile = statistics.median(s[1] for s in samples)
        mem = compiled.memory_analysis()
        if mem is not None:  # None where the backend does not report it
            res.temp_bytes = int(mem.temp_size_in_bytes)
        grad = np.asarray(jax.block_until_ready(compiled(p.theta)))
        if not np.all(np.isfinite(grad)):
            raise FloatingPointError("the gradient is not finite")
        return res, compiled, grad
    except Exception as e:  # record the failure in the table, keep going
        res.error = _describe(e)
        return res, None, None


def measure_cell(cell: Cell, methods: list[Method], s: dict[str, Any]) -> None:
    p = cell.problem
    runnable: dict[str, Any] = {}
    grads: dict[str, np.ndarray] = {}
    for m in methods:
        if not m.available:
            cell.results[m.name] = Result(error="not installed (pip install -e '.[bench]')")
            continue
        t0 = time.perf_counter()
        res, compiled, grad = compile_method(m, p, s["compile_reps"])
        cell.results[m.name] = res
        if res.error is None:
            runnable[m.name], grads[m.name] = compiled, grad
            log(
                f"      {m.name:<20} compiled in {time.perf_counter() - t0:5.1f} s, "
                f"temp {_mib(res.temp_bytes)} MiB"
            )
        else:
            log(f"      {m.name:<20} FAILED: {res.error}")

    # Agreement with the unrolled gradient (the reference).
    if REF in grads:
        ref = grads[REF]
        scale = float(np.max(np.abs(ref)))
        for name, g in grads.items():
            cell.results[name].rel_diff = float(np.max(np.abs(g - ref))) / scale
        log(
            "      rel. diff vs unrolled: "
            + ", ".join(f"{k} {cell.results[k].rel_diff:.1e}" for k in grads if k != REF)
        )
    ours = next((m.name for m in methods if m.ours and m.name in grads), None)
    if ours is not None:
        base = grads[ours]
        scale = float(np.max(np.abs(base)))
        log(
            f"      rel. diff vs {ours}: "
            + ", ".join(
                f"{k} {float(np.max(np.abs(g - base))) / scale:.1e}"
                for k, g in grads.items()
                if k != ours
            )
        )

    # The shared forward solve alone, for reference.
    forward = jax.jit(solution_unrolled(p)).trace(p.theta).lower().compile()
    runnable["forward"] = forward

    # Timing: methods take turns, one call each per round, starting with a different
    # one each round, so that background load slows all of them alike.
    names = list(runnable)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for name in names:
        for _ in range(s["warmup"]):
            jax.block_until_ready(runnable[name](p.theta))
    theta, perf_counter, block = p.theta, time.perf_counter, jax.block_until_ready
    start = perf_counter()
    gc.collect()
    gc.disable()
    try:
        for r in range(s["rounds"]):
            for name in rotated(names, r):
                t0 = perf_counter()
                block(runnable[name](theta))
                samples[name].append(perf_counter() - t0)
            if r + 1 >= s["min_rounds"] and perf_counter() - start > s["budget"]:
                break
    finally:
        gc.enable()
    for name, xs in samples.items():
        if name == "forward":
            cell.forward = statistics.median(xs)
        else:
            cell.results[name].run = statistics.median(xs)


# ---------------------------------------------------------------------------
# Report.


def _mib(b: int | None) -> str:
    if b is None:
        return "n/a"
    v = b / 2**20
    return f"{v:.3g}" if v >= 0.01 else f"{v:.2g}"


def _ms(t: float | None) -> str:
    if t is None:
        return "n/a"
    v = t * 1e3
    return f"{v:.3g}" if v >= 0.1 else f"{v:.2g}"


def _fmt_n(n: int) -> str:
    return f"{n:.0e}".replace("e+0", "e") if n >= 10_000 else str(n)


def best_peer(cell: Cell, methods: list[Method]) -> tuple[str, float] | None:
    times = [
        (m.name, cell.results[m.name].run)
        for m in methods
        if m.peer and cell.results[m.name].run is not None
    ]
    return min(times, key=lambda t: t[1]) if times else None


@dataclass
class Verdict:
    flat: dict[str, dict[int, float]]  # ours method -> n -> temp(K max) / temp(K min)
    wins: dict[str, list[tuple[int, int, float]]]  # ours method -> (n, K, time / best peer)
    disagree: list[str]
    errors: list[str]

    @property
    def memory_ok(self) -> bool:
        return all(r <= FLAT_MEMORY for per_n in self.flat.values() for r in per_n.values())

    def time_ok(self, name: str) -> bool:
        return bool(self.wins[name]) and all(r < 1 for _, _, r in self.wins[name])


def verdict(cells: list[Cell], methods: list[Method]) -> Verdict:
    ours = [m.name for m in methods if m.ours]
    flat: dict[str, dict[int, float]] = {name: {} for name in ours}
    for n in sorted({c.problem.n for c in cells}):
        row = sorted((c for c in cells if c.problem.n == n), key=lambda c: c.problem.iters)
        if len(row) < 2:
            continue
        for name in ours:
            lo, hi = row[0].results[name].temp_bytes, row[-1].results[name].temp_bytes
            if lo and hi:
                flat[name][n] = hi / lo
    wins: dict[str, list[tuple[int, int, float]]] = {name: [] for name in ours}
    for cell in cells:
        bp = best_peer(cell, methods)
        for name in ours:
            t = cell.results[name].run
            if bp is not None and t is not None:
                wins[name].append((cell.problem.n, cell.problem.iters, t / bp[1]))
    disagree, errors = [], []
    for cell in cells:
        where = f"n={cell.problem.n}, K={cell.problem.iters}"
        for m in methods:
            r = cell.results[m.name]
            if r.error is not None and m.available:
                errors.append(f"{m.name} at {where}: {r.error}")
            if r.rel_diff is not None and not r.rel_diff <= AGREE_RTOL:
                disagree.append(f"{m.name} at {where}: {r.rel_diff:.2e}")
    return Verdict(flat, wins, disagree, errors)


def render(
    cells: list[Cell], methods: list[Method], mode: str, wall: float, load: tuple[float, float]
) -> str:
    names = [m.name for m in methods]
    v = verdict(cells, methods)

    head = "| n | K | c | forward (ms) | " + " | ".join(f"{n} ms / MiB" for n in names)
    main = [head + " | best peer | ours (neumann) × best peer | ours (gmres) × best peer |"]
    main.append("|" + "---:|" * (main[0].count("|") - 1))
    for cell in cells:
        p = cell.problem
        parts = [_fmt_n(p.n), str(p.iters) + ("" if p.steps == p.iters else f" ({p.steps})")]
        parts += [f"{p.c:.4f}", _ms(cell.forward)]
        for name in names:
            r = cell.results[name]
            if r.error is not None:
                parts.append("error" if r.run is None else f"{_ms(r.run)} / error")
            else:
                parts.append(f"{_ms(r.run)} / {_mib(r.temp_bytes)}")
        bp = best_peer(cell, methods)
        parts.append(bp[0] if bp else "n/a")
        for name in ("ours (neumann)", "ours (gmres)"):
            t = cell.results.get(name, Result()).run
            parts.append(f"{t / bp[1]:.2f}" if bp and t is not None else "n/a")
        main.append("| " + " | ".join(parts) + " |")

    head2 = (
        "| n | K | "
        + " | ".join(f"{n} compile (s)" for n in names)
        + " | "
        + " | ".join(f"{n} rel. diff" for n in names if n != REF)
        + " |"
    )
    second = [head2, "|" + "---:|" * (head2.count("|") - 1)]
    for cell in cells:
        parts = [_fmt_n(cell.problem.n), str(cell.problem.iters)]
        for name in names:
            r = cell.results[name]
            if r.trace_lower is None:
                parts.append("error" if r.error else "n/a")
            else:
                parts.append(f"{r.trace_lower + r.xla_compile:.2f}")
        for name in names:
            if name == REF:
                continue
            r = cell.results[name]
            parts.append(f"{r.rel_diff:.1e}" if r.rel_diff is not None else "n/a")
        second.append("| " + " | ".join(parts) + " |")

    def fmt_flat(name: str) -> str:
        per_n = v.flat.get(name, {})
        if not per_n:
            return f"{name}: n/a"
        return f"{name}: " + ", ".join(f"n={_fmt_n(n)} {r:.2f}x" for n, r in per_n.items())

    def fmt_wins(name: str) -> str:
        w = v.wins.get(name, [])
        if not w:
            return f"{name}: n/a"
        won = sum(r < 1 for _, _, r in w)
        lost = [f"n={_fmt_n(n)}/K={k} ({r:.2f}x)" for n, k, r in w if r >= 1]
        return f"{name}: faster in {won}/{len(w)} cells" + (
            "; slower at " + ", ".join(lost) if lost else ""
        )

    ok = lambda b: "met" if b else "NOT met"
    ours = [m.name for m in methods if m.ours]
    ref_mem = {
        _fmt_n(c.problem.n): c.results[REF].temp_bytes
        for c in cells
        if c.problem.iters == max(x.problem.iters for x in cells)
    }
    goals = [
        "Goals:",
        "",
        f"- Memory flat in K (temp memory at the largest K / at the smallest K <= "
        f"{FLAT_MEMORY}x): {ok(v.memory_ok)}. " + "; ".join(fmt_flat(n) for n in ours) + ".",
        "- Time below the best peer: "
        + "; ".join(f"{fmt_wins(n)} ({ok(v.time_ok(n))})" for n in ours)
        + ".",
        f"- Gradients agree with the unrolled one (max |g - g_unrolled| / max |g_unrolled| "
        f"<= {AGREE_RTOL:g}): "
        + ("yes" if not v.disagree else "NO: " + "; ".join(v.disagree))
        + ".",
        "- Unrolled temp memory at the largest K: "
        + ", ".join(f"n={n}: {_mib(b)} MiB" for n, b in ref_mem.items())
        + ".",
    ]
    if v.errors:
        goals += ["", "Errors:", ""] + [f"- {e}" for e in v.errors]
    env = (
        f"jax {jax.__version__}, backend {jax.default_backend()} "
        f"({jax.devices()[0].device_kind}), {cpus()}, "
        f"Python {platform.python_version()}; {peer_versions()}; mode --{mode}, run took "
        f"{wall:.0f} s; load average {load[0]:.1f} at the start, {load[1]:.1f} at the end."
    )
    method = (
        "Problem: fixed point of `f(x, θ) = c·M·tanh(x) + θ` (`M` averages neighbours "
        "with weights 1/4, 1/2, 1/4, periodic), float32, loss `sum(x*(θ)²)`, gradient "
        "w.r.t. θ ∈ R^n. `c` is calibrated per (n, K) so the iteration from 0 converges "
        f"(relative step <= {FORWARD_TOL:g}) in exactly K steps (a number in parentheses "
        "after K is the count actually reached, when the calibration missed). Every method "
        "runs K forward steps. Backward linear solves: relative residual "
        f"{LINEAR_RTOL:g}; GMRES restart {GMRES_RESTART}. Time: median of single calls "
        "of the compiled gradient with `block_until_ready`, methods interleaved; `forward` "
        "is the shared K-step loop alone (no gradient). MiB: "
        "`compiled.memory_analysis().temp_size_in_bytes` (XLA's buffer assignment for "
        "temporaries; arguments and outputs, n floats each, are left out). Compile: "
        "trace+lower plus XLA compile after `jax.clear_caches()`. Rel. diff: "
        "max |g - g_unrolled| / max |g_unrolled|; at large K it is dominated by the "
        "unrolled gradient's own truncation error, which decays more slowly than the "
        "forward iterate does."
    )
    return "\n".join(
        [
            "## Implicit vs unrolled gradient of a fixed point",
            "",
            env,
            "",
            "Gradient time (ms) and peak temporary memory (MiB):",
            "",
            *main,
            "",
            "Compile time and agreement with the unrolled gradient:",
            "",
            *second,
            "",
            *goals,
            "",
            method,
            "",
        ]
    )


def plot(cells: list[Cell], methods: list[Method], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed (pip install -e '.[bench]'); no chart written")
        return False
    ns = sorted({c.problem.n for c in cells})
    style = {
        "unrolled": ("tab:gray", "o", "--"),
        "ours (neumann)": ("tab:green", "s", "-"),
        "ours (gmres)": ("tab:olive", "D", "-"),
        "jaxopt (gmres)": ("tab:blue", "^", ":"),
        "optimistix (gmres)": ("tab:red", "v", ":"),
    }
    fig, axes = plt.subplots(2, len(ns), figsize=(4.6 * len(ns), 7.5), squeeze=False)
    for j, n in enumerate(ns):
        row = sorted((c for c in cells if c.problem.n == n), key=lambda c: c.problem.iters)
        ks = [c.problem.iters for c in row]
        for m in methods:
            color, marker, ls = style.get(m.name, (None, "o", "-"))
            for i, (get, scale) in enumerate(
                [(lambda r: r.temp_bytes, 1 / 2**20), (lambda r: r.run, 1e3)]
            ):
                pts = [
                    (k, get(c.results[m.name]) * scale)
                    for k, c in zip(ks, row)
                    if get(c.results[m.name])
                ]
                if pts:
                    x, y = zip(*pts)
                    axes[i][j].plot(x, y, ls, color=color, marker=marker, label=m.name)
        fwd = [(c.problem.iters, c.forward * 1e3) for c in row if c.forward]
        if fwd:
            x, y = zip(*fwd)
            axes[1][j].plot(x, y, "-", color="black", alpha=0.3, lw=3, label="forward only")
        for i, what in enumerate(["peak temp memory (MiB)", "gradient time, median (ms)"]):
            ax = axes[i][j]
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xticks(ks, [str(k) for k in ks])
            ax.set_xlabel("K (forward iterations)")
            ax.set_ylabel(what)
            ax.set_title(f"n = {_fmt_n(n)}", fontsize=10)
            ax.grid(True, which="major", alpha=0.3)
    axes[1][0].legend(fontsize=8)
    fig.suptitle(
        f"Gradient of a fixed point: implicit vs unrolled (jax {jax.__version__}, "
        f"{jax.default_backend()})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ---------------------------------------------------------------------------

SETTINGS = {
    # grid; timing: up to `rounds` rounds of one call per method, at least `min_rounds`,
    # stopping once a cell has taken `budget` seconds; warm-up calls; fresh compiles.
    "quick": dict(
        sizes=(10, 1000),
        iters=(10, 100),
        rounds=201,
        min_rounds=3,
        budget=1.0,
        warmup=2,
        compile_reps=1,
    ),
    "default": dict(
        sizes=(10, 1000, 100_000),
        iters=(10, 100, 1000),
        rounds=501,
        min_rounds=5,
        budget=10.0,
        warmup=2,
        compile_reps=1,
    ),
    "full": dict(
        sizes=(10, 1000, 100_000),
        iters=(10, 100, 1000),
        rounds=2001,
        min_rounds=15,
        budget=60.0,
        warmup=3,
        compile_reps=3,
    ),
}


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(float(v)) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--quick",
        dest="mode",
        action="store_const",
        const="quick",
        help="n in {10, 1000}, K in {10, 100}, few repeats: under a minute on 2 CPU cores",
    )
    mode.add_argument(
        "--full",
        dest="mode",
        action="store_const",
        const="full",
        help="the full grid with more repeats (default: the full grid, fewer repeats)",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="exit with status 1 when a gradient disagrees with the unrolled one or a "
        "method fails (timings are not checked)",
    )
    parser.add_argument("--sizes", type=_int_list, help="state sizes n, e.g. 10,1000")
    parser.add_argument("--iters", type=_int_list, help="iteration counts K, e.g. 10,100")
    parser.set_defaults(mode="default")
    opts = parser.parse_args(argv)
    s = dict(SETTINGS[opts.mode])
    sizes = opts.sizes or s["sizes"]
    iters = opts.iters or s["iters"]
    start, load0 = time.perf_counter(), loadavg()

    log(
        f"implicit vs unrolled benchmark (--{opts.mode}): jax {jax.__version__} on "
        f"{jax.default_backend()}, n in {list(sizes)}, K in {list(iters)}"
    )
    cells = []
    total = len(sizes) * len(iters)
    for i, (n, k) in enumerate(((n, k) for n in sizes for k in iters), 1):
        t0 = time.perf_counter()
        log(f"[{i}/{total}] n={n}, K={k}: calibrating c ...")
        cell = Cell(make_problem(n, k))
        log(f"      c = {cell.problem.c:.6f}, converges in {cell.problem.steps} steps")
        measure_cell(cell, METHODS, s)
        cells.append(cell)
        summary = ", ".join(
            f"{name} {_ms(r.run)}" for name, r in cell.results.items() if r.run is not None
        )
        log(f"      times (ms): {summary}")
        log(f"      done in {time.perf_counter() - t0:.1f} s")

    report = render(cells, METHODS, opts.mode, time.perf_counter() - start, (load0, loadavg()))
    print()
    print(report)
    RESULTS.mkdir(exist_ok=True)
    md = RESULTS / "implicit_vs_unrolled.md"
    md.write_text(report)
    written = [md]
    png = RESULTS / "implicit_vs_unrolled.png"
    if plot(cells, METHODS, png):
        written.append(png)
    log("wrote " + ", ".join(str(p.relative_to(ROOT)) for p in written))
    v = verdict(cells, METHODS)
    if opts.check and (v.disagree or v.errors):
        log("check FAILED: " + "; ".join(v.disagree + v.errors))
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
