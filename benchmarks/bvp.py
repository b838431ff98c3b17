"""Boundary-value problems: `solvers.solve_bvp` against SciPy's `solve_bvp`.

Problems (float64), each from a coarse initial mesh at `tol = 1e-6`:

- Bratu: `y'' + exp(y) = 0`, `y(0) = y(1) = 0` (SciPy's first example);
- the eigenvalue problem `y'' + k^2 y = 0`, `y(0) = y(1) = 0`, `y'(0) = k` with the
  unknown parameter `k` (SciPy's second example; the second eigenvalue, `2 pi`);
- a boundary layer: `eps y'' + y' = 0` on [0, 1] with `eps = 0.02`, `y(0) = 0`,
  `y(1) = 1`, closed form `(1 - exp(-x / eps)) / (1 - exp(-1 / eps))`.

Reported: the solve's median time (ours jitted, compile apart; SciPy on the host),
the nodes used, the error on a fixed grid of 101 points against SciPy at `tol = 1e-10`
(against the closed form for the boundary layer), and the time of a derivative with
respect to the problem's parameter (`lam` of Bratu's `lam exp(y)`, the eigenproblem's
stiffness `s` in `y'' + s k^2 y = 0`, `eps`): ours the implicit `jit(grad)`, SciPy none
(its row gives two solves, the cost of a central difference).

Usage::

    python -m benchmarks.bvp            # --quick (default): under a minute on 2 cores
    python -m benchmarks.bvp --full     # more repeats
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import platform
import sys
import time

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from scipy.integrate import solve_bvp as scipy_bvp  # noqa: E402

from benchmarks._env import cpus, loadavg  # noqa: E402
from benchmarks._timing import fmt, interleaved, sci  # noqa: E402
from benchmarks._workers import write_report  # noqa: E402
from solvers import solve_bvp  # noqa: E402

NAME = "bvp"
TOL = 1e-6
GRID = np.linspace(0.0, 1.0, 101)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclasses.dataclass(frozen=True)
class Problem:
    name: str
    fun: object  # fun(x, y, theta, xp) [, p]
    bc: object  # bc(ya, yb, theta, xp) [, p]
    x0: np.ndarray
    y0: np.ndarray
    theta: float
    p0: np.ndarray | None = None
    exact: object = None  # exact(x) -> y[0], or None
    max_nodes: int = 200


def _bratu() -> Problem:
    x = np.linspace(0, 1, 5)
    return Problem(
        "Bratu (n = 2)",
        lambda x, y, lam, xp: xp.stack([y[1], -lam * xp.exp(y[0])]),
        lambda ya, yb, lam, xp: xp.stack([ya[0], yb[0]]),
        x, np.zeros((2, 5)), 1.0,
    )  # fmt: skip


def _eigen() -> Problem:
    x = np.linspace(0, 1, 5)
    y = np.zeros((2, 5))
    y[0, 1], y[0, 3] = 1.0, -1.0
    return Problem(
        "eigenvalue (n = 2, k = 1)",
        lambda x, y, s, xp, p: xp.stack([y[1], -s * p[0] ** 2 * y[0]]),
        lambda ya, yb, s, xp, p: xp.stack([ya[0], yb[0], ya[1] - p[0]]),
        x, y, 1.0, p0=np.array([6.0]), max_nodes=300,
    )  # fmt: skip


def _layer() -> Problem:
    x = np.linspace(0, 1, 11)
    y = np.stack([x, np.ones_like(x)])

    def exact(x, eps=0.02):
        return (1 - np.exp(-x / eps)) / (1 - np.exp(-1 / eps))

    return Problem(
        "boundary layer (eps = 0.02)",
        lambda x, y, eps, xp: xp.stack([y[1], -y[1] / eps]),
        lambda ya, yb, eps, xp: xp.stack([ya[0], yb[0] - 1.0]),
        x, y, 0.02, exact=exact, max_nodes=300,
    )  # fmt: skip


def problems() -> list[Problem]:
    return [_bratu(), _eigen(), _layer()]


def _bind(prob: Problem, theta, xp):
    """`(fun, bc)` at the parameter `theta` in SciPy's calling convention."""
    fun = lambda x, y, *p: prob.fun(x, y, theta, xp, *p)  # noqa: E731
    bc = lambda a, b, *p: prob.bc(a, b, theta, xp, *p)  # noqa: E731
    return fun, bc


def ours(prob: Problem):
    """`(solve(theta) -> (y on GRID, nodes), loss(theta))` for our solver."""
    has_p = prob.p0 is not None

    def run(theta):
        fun, bc = _bind(prob, theta, jnp)
        p0 = None if not has_p else jnp.asarray(prob.p0)
        return solve_bvp(fun, bc, prob.x0, prob.y0, p=p0, tol=TOL, max_nodes=prob.max_nodes)

    def solve(theta):
        res = run(theta)
        return res.sol(jnp.asarray(GRID))[0], res.num_nodes

    def loss(theta):
        res = run(theta)
        return res.p[0] if has_p else jnp.sum(res.sol(jnp.asarray(GRID))[0])

    return jax.jit(solve), loss


def scipy_solve(prob: Problem, theta: float, tol: float = TOL):
    fun, bc = _bind(prob, theta, np)
    res = scipy_bvp(fun, bc, prob.x0, prob.y0, p=prob.p0, tol=tol, max_nodes=10**5)
    if not res.success:
        raise RuntimeError(res.message)
    return res


def _time_host(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def measure(prob: Problem, mode: str) -> list[dict]:
    rounds = 7 if mode == "quick" else 21
    theta = jnp.asarray(prob.theta)
    ref = prob.exact(GRID) if prob.exact else scipy_solve(prob, prob.theta, 1e-10).sol(GRID)[0]
    scale = np.maximum(np.abs(ref), 1e-3)
    rows = []
    solve, loss = ours(prob)
    t0 = time.perf_counter()
    compiled = solve.lower(theta).compile()
    compile_s = time.perf_counter() - t0
    y, nodes = jax.block_until_ready(compiled(theta))
    fwd = interleaved({"ours": compiled}, rounds=rounds, block=1, args=(theta,))["ours"]
    g = jax.jit(jax.grad(loss))
    gc = g.lower(theta).compile()
    jax.block_until_ready(gc(theta))
    grad = interleaved({"ours": gc}, rounds=rounds, block=1, args=(theta,))["ours"]
    rows.append(dict(impl="ours (solve_bvp)", forward=fwd, nodes=int(nodes),
                     err=float(np.max(np.abs(np.asarray(y) - ref) / scale)), grad=grad,
                     compile=compile_s, note=""))  # fmt: skip
    res = scipy_solve(prob, prob.theta)
    t = _time_host(lambda: scipy_solve(prob, prob.theta), 5 if mode == "quick" else 15)
    rows.append(dict(impl="scipy solve_bvp", forward=t, nodes=int(res.x.size),
                     err=float(np.max(np.abs(res.sol(GRID)[0] - ref) / scale)), grad=2 * t,
                     compile=None, note="no derivative: grad column is two solves "
                     "(a central difference)"))  # fmt: skip
    return rows


def render(results, mode: str, seconds: float, loads) -> str:
    versions = (
        f"jax {jax.__version__}, scipy {importlib.metadata.version('scipy')}, backend "
        f"{jax.default_backend()}, {cpus()}, Python {platform.python_version()}; mode "
        f"--{mode}; run took {seconds:.0f} s; load average {loads[0]:.1f} at the start, "
        f"{loads[1]:.1f} at the end."
    )
    lines = ["## Boundary-value problems: solve_bvp against SciPy", "", versions, ""]
    for prob, rows in results:
        lines += [
            f"### {prob.name}, tol {TOL:g}",
            "",
            "| implementation | solve (ms) | nodes | error on the grid | grad (ms) | "
            "compile (s) | note |",
            "|---|---:|---:|---:|---:|---:|---|",
        ]
        for r in rows:
            lines.append(
                f"| {r['impl']} | {fmt(1e3 * r['forward'])} | {r['nodes']} | {sci(r['err'])} | "
                f"{fmt(1e3 * r['grad'])} | {fmt(r['compile'])} | {r['note']} |"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", dest="mode", action="store_const", const="quick")
    mode.add_argument("--full", dest="mode", action="store_const", const="full")
    parser.set_defaults(mode="quick")
    opts = parser.parse_args(argv)
    start, load0 = time.perf_counter(), loadavg()
    log(f"bvp benchmark (--{opts.mode}), {cpus()}")
    results = []
    for prob in problems():
        log(f"{prob.name}")
        results.append((prob, measure(prob, opts.mode)))
    report = render(results, opts.mode, time.perf_counter() - start, (load0, loadavg()))
    write_report(NAME, report, lambda png: False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
