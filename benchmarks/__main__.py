"""The benchmark suite: every benchmark and the gradient-check catalogue, one command.

Usage::

    python -m benchmarks             # --quick (default): a few minutes on 2 CPU cores
    python -m benchmarks --full      # the full grids and more repeats
    python -m benchmarks --only dispatch gradcheck

Each entry runs in its own Python process (so one benchmark's memory, JAX flags
such as float64, and compile caches cannot affect the next), prints its table,
and writes it under `results/`. The suite ends with a summary of what ran and
exits non-zero if an entry failed, in particular if a gradient check failed.
"""

from __future__ import annotations

import argparse
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"

# name -> (what it measures, command-line arguments after `python`, by mode)
ENTRIES: dict[str, tuple[str, dict[str, list[str]]]] = {
    "gradcheck": (
        "gradient checks of the implicit-problem catalogue in float64 (pass/fail table)",
        {
            mode: [
                "-m",
                "implicitdiff.gradcheck",
                "--full",
                "--markdown",
                "--output",
                str(RESULTS / "gradcheck.md"),
            ]
            for mode in ("quick", "full")
        },
    ),
    "dispatch": (
        "dispatch and compile cost of a custom rule vs jax.custom_vjp and hijax",
        {mode: ["-m", "benchmarks.dispatch", f"--{mode}"] for mode in ("quick", "full")},
    ),
    "implicit_vs_unrolled": (
        "time and memory of implicit vs unrolled gradients of a fixed point (vs jaxopt, "
        "optimistix)",
        {m: ["-m", "benchmarks.implicit_vs_unrolled", f"--{m}"] for m in ("quick", "full")},
    ),
    "newton_sqrt": (
        "Newton's sqrt as a fixed point: solvers.fixed_point vs the hijax guide, custom_vjp, "
        "jaxopt, optimistix, unrolled (per call, vmap over 1e6, compile; float32 and float64)",
        {m: ["-m", "benchmarks.newton_sqrt", f"--{m}"] for m in ("quick", "full")},
    ),
    "pendulum": (
        "damped pendulum ODE: solvers.odeint vs jax odeint, diffrax, scipy (forward, grad, "
        "vmap, jacfwd, hessian, compile, RHS evals, error; float32 and float64)",
        {m: ["-m", "benchmarks.pendulum", f"--{m}"] for m in ("quick", "full")},
    ),
    "stiff": (
        "stiff problems of the IVP test set: odeint's kvaerno5, radau5, bdf and rodas5p vs diffrax "
        "Kvaerno3/4/5 and SciPy Radau/BDF/LSODA (forward, steps, error, grad, compile; "
        "work-precision plot)",
        {m: ["-m", "benchmarks.stiff", f"--{m}"] for m in ("quick", "full")},
    ),
    "bvp": (
        "boundary-value problems: solvers.solve_bvp vs SciPy's solve_bvp (solve, nodes, "
        "error, implicit gradient, compile)",
        {m: ["-m", "benchmarks.bvp", f"--{m}"] for m in ("quick", "full")},
    ),
    "deq_memory": (
        "training-step memory and time: DEQ implicit vs unrolled (N iterations), "
        "NeuralODE vs diffrax (both adjoints)",
        {m: ["-m", "benchmarks.deq_memory", f"--{m}"] for m in ("quick", "full")},
    ),
    "transformations": (
        "every solver method under every transformation, float64, vs closed forms (ok/FAIL)",
        {
            m: ["-m", "benchmarks.transformations", "--output", str(RESULTS / "transformations.md")]
            for m in ("quick", "full")
        },
    ),
}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", dest="mode", action="store_const", const="quick")
    mode.add_argument("--full", dest="mode", action="store_const", const="full")
    parser.add_argument("--only", nargs="+", choices=sorted(ENTRIES), help="run only these entries")
    parser.add_argument("--list", action="store_true", help="list the entries and exit")
    parser.set_defaults(mode="quick")
    opts = parser.parse_args(argv)
    if opts.list:
        for name, (what, _) in ENTRIES.items():
            print(f"{name:22s} {what}")
        return 0

    names = opts.only or list(ENTRIES)
    RESULTS.mkdir(exist_ok=True)
    outcomes = []
    for i, name in enumerate(names, 1):
        what, commands = ENTRIES[name]
        cmd = [sys.executable, *commands[opts.mode]]
        log(f"\n==== [{i}/{len(names)}] {name}: {what}")
        log("$ " + " ".join(cmd))
        t0 = time.perf_counter()
        rc = subprocess.call(cmd, cwd=ROOT)
        outcomes.append((name, rc, time.perf_counter() - t0))

    lines = [
        f"## Benchmark suite (--{opts.mode})",
        "",
        "| entry | status | wall time (s) |",
        "|---|---|---|",
    ]
    lines += [
        f"| {name} | {'ok' if rc == 0 else f'FAILED (exit {rc})'} | {dt:.0f} |"
        for name, rc, dt in outcomes
    ]
    summary = "\n".join(lines)
    print("\n" + summary)
    print(f"\nTables and plots are in {RESULTS.relative_to(ROOT)}/.")
    (RESULTS / "suite.md").write_text(summary + "\n")
    return 0 if all(rc == 0 for _, rc, _ in outcomes) else 1


if __name__ == "__main__":
    raise SystemExit(main())
