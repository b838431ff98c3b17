"""Training-step memory and time of `solvers.nn`: DEQ (implicit vs unrolled) and NeuralODE
(ours vs diffrax).

(a) DEQ. The cell `z <- tanh(W z + U x + b)` (hidden 64, input 64, `W` scaled to
norm 0.9, a contraction), batch 64, loss `mean((z* - y)^2)`, one
`value_and_grad` step with respect to the cell's parameters, float32:

* implicit: `solvers.nn.DEQ(cell, method="iterate", max_steps=N, rtol=0, atol=0,
  throw=False)`, called with `return_info=True` (which `throw=False` requires; the
  info, status MAX_STEPS by design, is discarded): the forward iteration cannot meet a
  zero tolerance, so it runs exactly N steps; the backward pass is one GMRES solve with
  `I - d cell/dz` (DEQ's default);
* unrolled: `lax.fori_loop` over the same N steps of the same cell, differentiated by
  JAX (a scan that keeps the N states).

(b) NeuralODE. The field of diffrax's neural-ODE example: `eqx.nn.MLP(2, 2, width 64,
depth 2, softplus)`, batch 32 initial states, 40 output times on [0, T], Tsit5 with
`rtol=1e-3, atol=1e-6` (diffrax's example), loss `mean((ys - ys_true)^2)` against a
rotation. Ours: `solvers.nn.NeuralODE(method="tsit5", adjoint="backsolve" |
"checkpoint")`; diffrax: `diffeqsolve(Tsit5(), PIDController(rtol, atol), dt0=None,
SaveAt(ts=ts), adjoint=BacksolveAdjoint() | RecursiveCheckpointAdjoint())`. Two
reference rows, `floor` (`fixed_steps`), time the same field through as many equal
Tsit5 steps in a differentiated `lax.scan`, with nothing else.

Measured per method: the compile time (trace+lower plus XLA compile), the median time
of one compiled step (methods interleaved, `benchmarks._timing.interleaved`), and the
peak temporary memory XLA assigns to the compiled step
(`memory_analysis().temp_size_in_bytes`). Goals: the implicit DEQ step's memory flat
in N; our NeuralODE step at most 0.5x the time of diffrax's with the matching adjoint.
Table in `results/deq_memory.md`, plot in `results/deq_memory.png`.

Usage::

    python -m benchmarks.deq_memory            # --quick (the default): a minute or two
    python -m benchmarks.deq_memory --full     # N up to 300, T = 10, more repeats
"""

from __future__ import annotations

import argparse
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ._env import cpus, loadavg
from ._timing import interleaved
from ._workers import ROOT, log, write_report
from .implicit_vs_unrolled import FLAT_MEMORY, _mib, _ms
from .pendulum import _describe

try:
    from solvers.nn import DEQ, NeuralODE
except ImportError:  # run from a checkout without `pip install -e .`
    import sys

    sys.path.insert(0, str(ROOT))
    from solvers.nn import DEQ, NeuralODE

try:
    import diffrax
except ImportError:  # pip install -e '.[bench]'
    diffrax = None

NAME = "deq_memory"
TIME_GOAL = 0.5  # our NeuralODE step / diffrax's with the same adjoint, at most
ODE_RTOL, ODE_ATOL = 1e-3, 1e-6

SETTINGS = {
    "quick": dict(
        iters=(10, 30, 100),
        hidden=64,
        batch=64,
        ode_batch=32,
        ode_times=40,
        t1=5.0,
        rounds=30,
        block=1,
        budget=1.5,
    ),
    "full": dict(
        iters=(10, 30, 100, 300),
        hidden=64,
        batch=64,
        ode_batch=32,
        ode_times=40,
        t1=10.0,
        rounds=200,
        block=3,
        budget=15.0,
    ),
}


@dataclass
class Row:
    part: str  # "DEQ" or "NeuralODE"
    method: str
    n: int | None = None  # DEQ iterations
    compile_s: float | None = None
    run_s: float | None = None
    temp_bytes: int | None = None
    loss: float | None = None
    rel_diff: float | None = None  # gradient vs the reference of its part
    steps: float | None = None  # NeuralODE: accepted steps per solve, batch mean
    error: str | None = None


def compile_step(
    row: Row, step: Callable[..., Any], *args: Any
) -> tuple[Callable[[], Any] | None, Any]:
    """Compile `step(*args)`, fill in compile time, memory and loss; a zero-argument
    call of the compiled step and its gradient (None, None on failure)."""
    try:
        t0 = time.perf_counter()
        compiled = jax.jit(step).trace(*args).lower().compile()
        row.compile_s = time.perf_counter() - t0
        mem = compiled.memory_analysis()
        if mem is not None:
            row.temp_bytes = int(mem.temp_size_in_bytes)
        loss, grad = jax.block_until_ready(compiled(*args))
        if not np.isfinite(float(loss)):
            raise FloatingPointError("the loss is not finite")
        row.loss = float(loss)
        return (lambda: compiled(*args)), grad
    except Exception as e:  # record it in the table, keep going
        row.error = _describe(e)
        log(f"      {row.method} FAILED: {row.error}")
        return None, None


def _rel_diff(g: Any, ref: Any) -> float:
    a = np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(g)])
    b = np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(ref)])
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


# ---------------------------------------------------------------------------
# (a) DEQ.


class Cell(eqx.Module):
    w: jax.Array
    u: jax.Array
    b: jax.Array

    def __call__(self, z, x):
        return jnp.tanh(self.w @ z + self.u @ x + self.b)


def make_cell(hidden: int, key: jax.Array) -> Cell:
    kw, ku, kb = jax.random.split(key, 3)
    w = jax.random.normal(kw, (hidden, hidden))
    w = 0.9 * w / jnp.linalg.norm(w, 2)  # spectral norm 0.9: a contraction
    u = jax.random.normal(ku, (hidden, hidden)) / np.sqrt(hidden)
    return Cell(w, u, 0.1 * jax.random.normal(kb, (hidden,)))


def deq_rows(s: dict[str, Any]) -> list[Row]:
    h, batch = s["hidden"], s["batch"]
    kc, kx, ky = jax.random.split(jax.random.key(0), 3)
    cell = make_cell(h, kc)
    xs = jax.random.normal(kx, (batch, h))
    ys = 0.5 * jax.random.normal(ky, (batch, h))

    def implicit(n):
        # A zero tolerance is never met: exactly n steps, then status MAX_STEPS (no raise).
        # `throw=False` needs `return_info=True`; that known status is dropped.
        def solve(c, x):
            kw = dict(method="iterate", max_steps=n, rtol=0.0, atol=0.0, throw=False)
            z, _ = DEQ(c, z_shape=(h,), **kw)(x, return_info=True)
            return z

        return solve

    def unrolled(n):
        return lambda c, x: lax.fori_loop(0, n, lambda _, z: c(z, x), jnp.zeros(h, x.dtype))

    rows = []
    for n in s["iters"]:
        log(f"  DEQ, N = {n}")
        fns, grads, cells = {}, {}, {}
        for name, build in (("unrolled", unrolled), ("implicit", implicit)):
            solve = build(n)

            def step(c, xs, ys, solve=solve):
                return jax.value_and_grad(
                    lambda c: jnp.mean((jax.vmap(solve, (None, 0))(c, xs) - ys) ** 2)
                )(c)

            row = Row("DEQ", name, n)
            fn, grad = compile_step(row, step, cell, xs, ys)
            cells[name] = row
            if fn is not None:
                fns[name], grads[name] = fn, grad
                log(
                    f"      {name:<9} compiled in {row.compile_s:.1f} s, "
                    f"temp {_mib(row.temp_bytes)} MiB"
                )
        for name, t in interleaved(fns, s["rounds"], s["block"], s["budget"]).items():
            cells[name].run_s = t
        if "unrolled" in grads and "implicit" in grads:
            cells["implicit"].rel_diff = _rel_diff(grads["implicit"], grads["unrolled"])
        rows += cells.values()
    return rows


# ---------------------------------------------------------------------------
# (b) NeuralODE.


class Field(eqx.Module):
    mlp: eqx.nn.MLP

    def __call__(self, y, t):
        return self.mlp(y)


def node_rows(s: dict[str, Any]) -> list[Row]:
    k1, k2 = jax.random.split(jax.random.key(1))
    field = Field(eqx.nn.MLP(2, 2, 64, 2, activation=jax.nn.softplus, key=k1))
    y0s = jax.random.uniform(k2, (s["ode_batch"], 2), minval=-0.6, maxval=1.0)
    ts = jnp.linspace(0.0, s["t1"], s["ode_times"])

    def rotation(times):
        # The target: the rotation y' = (y1, -y0), y(t) = (a cos t + b sin t, b cos t - a sin t).
        c, sn = jnp.cos(times)[:, None], jnp.sin(times)[:, None]
        return jax.vmap(lambda y: jnp.concatenate([y[0] * c + y[1] * sn, y[1] * c - y[0] * sn], 1))(
            y0s
        )

    target = rotation(ts)
    # Accepted steps per solve (the same forward pass for both adjoints of a library).
    node = NeuralODE(field, method="tsit5", rtol=ODE_RTOL, atol=ODE_ATOL)
    ours_steps = jax.vmap(lambda y0: node(y0, ts, return_info=True)[1].steps)(y0s)
    n_fixed = int(jnp.max(ours_steps))

    def ours(adjoint):
        node = NeuralODE(field, method="tsit5", adjoint=adjoint, rtol=ODE_RTOL, atol=ODE_ATOL)
        return lambda f, y0: eqx.tree_at(lambda m: m.field, node, f)(y0, ts)

    def peer(adjoint):
        def solve(f, y0):
            sol = diffrax.diffeqsolve(
                diffrax.ODETerm(lambda t, y, f: f(y, t)),
                diffrax.Tsit5(),
                t0=ts[0],
                t1=ts[-1],
                dt0=None,
                y0=y0,
                args=f,  # BacksolveAdjoint differentiates `args`, not closed-over values
                saveat=diffrax.SaveAt(ts=ts),
                stepsize_controller=diffrax.PIDController(rtol=ODE_RTOL, atol=ODE_ATOL),
                adjoint=adjoint,
            )
            return sol.ys

        return solve

    methods: dict[str, Callable[[], Any] | None] = {
        "ours (checkpoint)": lambda: ours("checkpoint"),
        "ours (backsolve)": lambda: ours("backsolve"),
        "diffrax (RecursiveCheckpoint)": (
            (lambda: peer(diffrax.RecursiveCheckpointAdjoint())) if diffrax else None
        ),
        "diffrax (Backsolve)": (lambda: peer(diffrax.BacksolveAdjoint())) if diffrax else None,
        # What the same arithmetic costs with nothing else: see `fixed_steps`.
        FLOOR_REMAT: lambda: fixed_steps(n_fixed, s["t1"], remat=True),
        FLOOR_KEPT: lambda: fixed_steps(n_fixed, s["t1"], remat=False),
    }
    fixed_target = rotation(jnp.linspace(0.0, s["t1"], n_fixed + 1)[1:])
    params, static = eqx.partition(field, eqx.is_inexact_array)
    fns, grads, rows = {}, {}, {}
    for name, build in methods.items():
        row = rows[name] = Row("NeuralODE", name)
        if build is None:
            row.error = "diffrax not installed (pip install -e '.[bench]')"
            continue
        solve = build()

        def step(p, y0s, target, solve=solve):
            def loss(p):
                f = eqx.combine(p, static)
                return jnp.mean((jax.vmap(solve, (None, 0))(f, y0s) - target) ** 2)

            return jax.value_and_grad(loss)(p)

        log(f"  NeuralODE, {name}")
        floor = name in (FLOOR_REMAT, FLOOR_KEPT)
        fn, grad = compile_step(row, step, params, y0s, fixed_target if floor else target)
        if fn is not None:
            fns[name], grads[name] = fn, grad
            log(f"      compiled in {row.compile_s:.1f} s, temp {_mib(row.temp_bytes)} MiB")
    for name, t in interleaved(fns, s["rounds"], s["block"], s["budget"]).items():
        rows[name].run_s = t
    counts = {"ours": float(jnp.mean(ours_steps))}
    if diffrax:
        sol = jax.vmap(
            lambda y0: diffrax.diffeqsolve(
                diffrax.ODETerm(lambda t, y, f: f(y, t)), diffrax.Tsit5(), t0=ts[0],
                t1=ts[-1], dt0=None, y0=y0, args=field, saveat=diffrax.SaveAt(ts=ts),
                stepsize_controller=diffrax.PIDController(rtol=ODE_RTOL, atol=ODE_ATOL),
            )
        )(y0s)  # fmt: skip
        counts["diffrax"] = float(jnp.mean(sol.stats["num_accepted_steps"]))
    for name, row in rows.items():
        row.steps = n_fixed if name in (FLOOR_REMAT, FLOOR_KEPT) else counts.get(name.split()[0])
    ref = grads.get("diffrax (RecursiveCheckpoint)", grads.get("ours (checkpoint)"))
    for name, g in grads.items():
        if ref is not None and name not in (FLOOR_REMAT, FLOOR_KEPT):  # another problem
            rows[name].rel_diff = _rel_diff(g, ref)
    return list(rows.values())


FLOOR_REMAT = "floor: fixed steps, recomputed"
FLOOR_KEPT = "floor: fixed steps, residuals kept"


def fixed_steps(n_steps: int, t1: float, *, remat: bool) -> Callable[[Any, Any], Any]:
    """A reference for the NeuralODE rows: `n_steps` equal Tsit5 steps over `[0, t1]`
    (the batch's largest accepted-step count in our adaptive solve), with the same
    stage code as ours (`solvers.ode.methods.Tsit5`) in a `lax.scan` that JAX
    differentiates itself, returning the step ends. No step-size control, no
    interpolated outputs, no recording: what is left is the field's own work.

    `remat=True` recomputes each step's stages in the backward pass
    (`jax.checkpoint`), as a checkpointed adjoint does; `remat=False` lets the scan
    keep every step's residuals (the field's activations) from the forward pass."""
    from solvers.ode.methods import Tsit5

    method = Tsit5()
    h = t1 / n_steps

    def solve(f, y0):
        field = lambda y, t, f: f(y, t)  # noqa: E731

        def one(y, k, t):
            y1, _, k1, _, _ = method.step_with_stages(field, y, k, t, h, f)
            return y1, k1

        one = jax.checkpoint(one) if remat else one

        def body(c, _):
            y, k, t = c
            y1, k1 = one(y, k, t)
            return (y1, k1, t + h), y1

        return lax.scan(body, (y0, f(y0, 0.0), 0.0), None, length=n_steps)[1]

    return solve


# ---------------------------------------------------------------------------
# Report.

PAIRS = (
    ("ours (checkpoint)", "diffrax (RecursiveCheckpoint)"),
    ("ours (backsolve)", "diffrax (Backsolve)"),
)


def _find(rows: list[Row], method: str, n: int | None = None) -> Row | None:
    return next((r for r in rows if r.method == method and r.n == n), None)


def goals(rows: list[Row]) -> list[tuple[str, bool]]:
    out = []
    imp = sorted((r for r in rows if r.method == "implicit" and r.temp_bytes), key=lambda r: r.n)
    if len(imp) >= 2:
        ratio = imp[-1].temp_bytes / imp[0].temp_bytes
        unr = [r for r in rows if r.method == "unrolled" and r.temp_bytes]
        unr_txt = ""
        if len(unr) >= 2:
            unr_txt = f" (unrolled: {unr[-1].temp_bytes / unr[0].temp_bytes:.1f}x)"
        out.append(
            (
                f"Implicit DEQ memory flat in N (temp at N={imp[-1].n} / N={imp[0].n} <= "
                f"{FLAT_MEMORY}): {ratio:.2f}x{unr_txt}",
                ratio <= FLAT_MEMORY,
            )
        )
    for ours, peer in PAIRS:
        a, b = _find(rows, ours), _find(rows, peer)
        if a and b and a.run_s and b.run_s:
            r = a.run_s / b.run_s
            out.append((f"{ours} step time <= {TIME_GOAL} x {peer}: {r:.2f}x", r <= TIME_GOAL))
    return out


def render(rows: list[Row], mode: str, wall: float, load: tuple[float, float], s: dict) -> str:
    deq = [
        "| N | method | step (ms) | temp memory (MiB) | compile (s) | loss "
        "| grad rel. diff vs unrolled |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in (r for r in rows if r.part == "DEQ"):
        comp = f"{r.compile_s:.2f}" if r.compile_s is not None else "error"
        loss = f"{r.loss:.4g}" if r.loss is not None else "n/a"
        diff = f"{r.rel_diff:.1e}" if r.rel_diff is not None else "-"
        deq.append(
            f"| {r.n} | {r.method} | {_ms(r.run_s)} | {_mib(r.temp_bytes)} | {comp} | "
            f"{loss} | {diff} |"
        )
    node = [
        "| method | step (ms) | temp memory (MiB) | compile (s) | loss "
        "| grad rel. diff vs diffrax (RecursiveCheckpoint) | steps per solve "
        "| × diffrax, same adjoint |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    peer_of = dict(PAIRS)
    peer_of.update({FLOOR_REMAT: PAIRS[0][1], FLOOR_KEPT: PAIRS[0][1]})
    for r in (r for r in rows if r.part == "NeuralODE"):
        if r.error is not None:
            node.append(f"| {r.method} | error: {r.error} | | | | | | |")
            continue
        p = _find(rows, peer_of.get(r.method, ""))
        ratio = f"{r.run_s / p.run_s:.2f}" if p and p.run_s and r.run_s else "-"
        node.append(
            f"| {r.method} | {_ms(r.run_s)} | {_mib(r.temp_bytes)} | {r.compile_s:.2f} | "
            f"{r.loss:.4g} | "
            + (f"{r.rel_diff:.1e}" if r.rel_diff is not None else "-")
            + " | "
            + (f"{r.steps:.1f}" if r.steps is not None else "-")
            + f" | {ratio} |"
        )
    errors = [
        f"- {r.part} {r.method} N={r.n}: {r.error}" for r in rows if r.error and r.part == "DEQ"
    ]
    goal_lines = [f"- {text}: {'met' if ok else 'NOT met'}" for text, ok in goals(rows)]
    ver = f"diffrax {diffrax.__version__}" if diffrax else "diffrax not installed"
    env = (
        f"jax {jax.__version__}, equinox {eqx.__version__}, {ver}, backend "
        f"{jax.default_backend()}, {cpus()}, Python {platform.python_version()}; mode "
        f"--{mode}, run took {wall:.0f} s; load average {load[0]:.1f} at the start, "
        f"{load[1]:.1f} at the end."
    )
    notes = (
        f"DEQ: hidden {s['hidden']}, batch {s['batch']}, float32; `implicit` is "
        "`solvers.nn.DEQ(method='iterate', max_steps=N, rtol=0, atol=0, throw=False)` "
        "called with `return_info=True`, the info discarded "
        "(exactly N forward steps, GMRES backward), `unrolled` is `lax.fori_loop` over the "
        "same N steps differentiated by JAX. The two gradients differ by the unrolled "
        "truncation error at small N. NeuralODE: MLP field width 64, depth 2, batch "
        f"{s['ode_batch']}, {s['ode_times']} output times on [0, {s['t1']:g}], Tsit5, "
        f"rtol {ODE_RTOL:g}, atol {ODE_ATOL:g}; `steps per solve` is the batch mean of "
        "accepted steps (both libraries interpolate the output times inside the steps). "
        "The two `floor` rows are a reference, not a solver: as many equal Tsit5 steps as "
        "our slowest batch element takes, with our stage code in a `lax.scan` that JAX "
        "differentiates, and no step-size control, interpolation or recording "
        "(`fixed_steps`); `recomputed` re-runs each step's stages in the backward pass as "
        "a checkpointed adjoint does, `residuals kept` stores the field's activations "
        "from the forward pass; their × column is against diffrax (RecursiveCheckpoint). "
        "Step: `value_and_grad` of the loss, "
        "jitted; time is the median of single calls with `block_until_ready`, methods "
        "interleaved; memory is `compiled.memory_analysis().temp_size_in_bytes` (XLA's "
        "temporaries; parameters, inputs and outputs are left out); compile is "
        "trace+lower+XLA compile."
    )
    return "\n".join(
        [
            "## Training-step memory and time: DEQ (implicit vs unrolled), NeuralODE (vs diffrax)",
            "",
            env,
            "",
            "DEQ training step:",
            "",
            *deq,
            "",
            "NeuralODE training step:",
            "",
            *node,
            "",
            "Goals:",
            "",
            *goal_lines,
            *(["", "Errors:", "", *errors] if errors else []),
            "",
            notes,
            "",
        ]
    )


def plot(rows: list[Row], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed (pip install -e '.[bench]'); no chart written")
        return False
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    style = {"implicit": ("tab:green", "s", "-"), "unrolled": ("tab:gray", "o", "--")}
    for method, (color, marker, ls) in style.items():
        pts = sorted((r.n, r) for r in rows if r.method == method and r.part == "DEQ")
        for ax, get, scale in ((axes[0], "temp_bytes", 2**-20), (axes[1], "run_s", 1e3)):
            xy = [(n, getattr(r, get) * scale) for n, r in pts if getattr(r, get)]
            if xy:
                ax.plot(*zip(*xy), ls, color=color, marker=marker, label=method)
    for ax, what in zip(axes[:2], ("peak temp memory (MiB)", "step time, median (ms)")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("N (forward iterations)")
        ax.set_ylabel(what)
        ax.set_title("DEQ training step", fontsize=10)
        ax.grid(True, which="major", alpha=0.3)
    if axes[0].get_legend_handles_labels()[0]:  # (no DEQ rows with --only node)
        axes[0].legend(fontsize=8)
    node = [r for r in rows if r.part == "NeuralODE" and r.run_s]
    hue = {"ours": "tab:green", "diffrax": "tab:blue"}
    colors = [hue.get(r.method.split()[0], "tab:gray") for r in node]
    times = [r.run_s * 1e3 for r in node]
    axes[2].barh([r.method for r in node], times, color=colors)
    for i, t in enumerate(times):
        axes[2].annotate(f" {t:.3g}", (t, i), va="center", fontsize=8)
    axes[2].set_xscale("log")  # (backsolve is about 30x checkpoint)
    axes[2].set_xlim(right=max(times, default=1) * 4)
    axes[2].set_xlabel("step time, median (ms, log scale)")
    axes[2].set_title("NeuralODE training step (Tsit5)", fontsize=10)
    axes[2].invert_yaxis()
    fig.suptitle(f"solvers.nn training steps (jax {jax.__version__}, {jax.default_backend()})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--quick",
        dest="mode",
        action="store_const",
        const="quick",
        help="N in {10, 30, 100}, T = 5, few repeats (the default; a minute or two)",
    )
    mode.add_argument(
        "--full",
        dest="mode",
        action="store_const",
        const="full",
        help="N up to 300, T = 10, more repeats",
    )
    parser.add_argument(
        "--only", choices=("deq", "node"), help="run only the DEQ or the NeuralODE part"
    )
    parser.set_defaults(mode="quick")
    opts = parser.parse_args(argv)
    s = SETTINGS[opts.mode]
    start, load0 = time.perf_counter(), loadavg()
    log(f"DEQ / NeuralODE training-step benchmark (--{opts.mode}), jax {jax.__version__}")
    rows: list[Row] = []
    if opts.only in (None, "deq"):
        rows += deq_rows(s)
    if opts.only in (None, "node"):
        rows += node_rows(s)
    report = render(rows, opts.mode, time.perf_counter() - start, (load0, loadavg()), s)
    write_report(NAME, report, lambda png: plot(rows, png))
    return 1 if any(r.error for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
