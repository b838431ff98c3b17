"""Assemble `docs/benchmarks.md` from the suite's results.

Usage::

    python -m benchmarks            # writes results/*.md and results/*.png
    python -m benchmarks.report     # docs/benchmarks.md and docs/img/*.png from them

Every table on the page comes from the files the suite wrote in `results/`: one run,
or, where `--only` reran some entries, each entry's last run (the page says which),
dated by the files' modification times, with the settings and versions each entry
recorded. The short notes between the tables say what each
benchmark measures and how to read it.
"""

from __future__ import annotations

import argparse
import datetime
import pathlib
import shutil
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"
DOCS = ROOT / "docs"

# Titles for the entries whose results file has none.
TITLES = {
    "transformations": "Every solver under every transformation",
    "gradcheck": "Gradient checks of the problem catalogue",
}

# (entry, note shown above its tables); the order is the page's order.
SECTIONS: list[tuple[str, str]] = [
    (
        "newton_sqrt",
        "`benchmarks/newton_sqrt.py`. Newton's square root written as a fixed point "
        "(`fixed_point(lambda a, x: 0.5 * (x + a / x), a, a)`), against the same algorithm "
        "as a hijax primitive, with `jax.custom_vjp`, jaxopt, optimistix, 20 unrolled "
        "steps and `jnp.sqrt`: per-call medians at `a = 2`, "
        "`jit(vmap(value_and_grad))` over a million values, and the compile time of "
        "`jit(grad)`.",
    ),
    (
        "pendulum",
        "`benchmarks/pendulum.py`. The damped pendulum `[omega, -m omega - g sin(theta)]` "
        "from `y0 = [pi - 0.1, 0]` over `linspace(0, 10, 101)`, against "
        "`jax.experimental.ode.odeint`, diffrax and SciPy. `grad` is of `sum(ys)` with "
        "respect to `(y0, m, g)`; `vmap` batches 256 initial angles; the error is at "
        "`t = 10` against a DOP853 reference at 1e-13. Peers built on `jax.custom_vjp` "
        "have no forward mode, hence their empty `jacfwd` and `hessian` cells.",
    ),
    (
        "stiff",
        "`benchmarks/stiff.py`. Stiff problems of the IVP test set, solved to their last "
        "time by our stiff methods (kvaerno5, radau5, bdf, rodas5p), diffrax's Kvaerno3/4/5 "
        "and SciPy (given the Jacobian). The error is against SciPy's Radau at "
        "`rtol = 1e-12`; `grad` is `jit(grad)` of the sum of the final state with "
        "respect to the parameters, and its compile time one fresh compile (trace, "
        "lower, XLA) after `jax.clear_caches()`. The step-adjoint floor is not a solver: rodas5p's "
        "step in a loop, and the same step linearised and pulled back by `jax.vjp`: "
        "what an adjoint that recomputes its steps pays per step.",
    ),
    (
        "bvp",
        "`benchmarks/bvp.py`. Boundary-value problems against SciPy's `solve_bvp` (the "
        "same algorithm: collocation with residual control and mesh refinement) at "
        "`tol = 1e-6`. The error is on a grid of 101 points against SciPy at 1e-10 or "
        "a closed form; ours' `grad` is the implicit derivative with respect to the "
        "problem's parameter, for which SciPy has none.",
    ),
    (
        "deq_memory",
        "`benchmarks/deq_memory.py`. Training steps of a deep-equilibrium layer "
        "(implicit backward pass against the same iterations unrolled) and of a neural "
        "ODE (against diffrax with the matching adjoint). Memory is the compiled step's "
        "temporary buffers. The `floor` rows are not solvers: they take the same number "
        "of equal Tsit5 steps with our stage code in a `lax.scan` and nothing else (no "
        "step-size control, no output times, no records), which is what any "
        "recomputing adjoint must pay for the field itself.",
    ),
    (
        "implicit_vs_unrolled",
        "`benchmarks/implicit_vs_unrolled.py`. The gradient of a fixed point "
        "`x* = c M tanh(x*) + theta` that takes exactly K iterations, by the implicit "
        "rule (Neumann series or GMRES) and by unrolling, against jaxopt and optimistix: "
        "time and XLA temporary memory. Implicit memory does not grow with K.",
    ),
    (
        "dispatch",
        "`benchmarks/dispatch.py`. What a custom rule costs per call and at compile time: "
        "`implicitdiff.Primitive` against `jax.custom_vjp`, a raw hijax primitive and no "
        "rule at all, on a trivial function and on an MLP training step.",
    ),
    (
        "transformations",
        "`benchmarks/transformations.py`. Every method of `fixed_point`, `root` and "
        "`minimize` under each transformation, compared with closed forms in float64.",
    ),
    (
        "gradcheck",
        "`implicitdiff-gradcheck --full`. Every derivative mode up to second order of "
        "each catalogue problem, against central finite differences and an independent "
        "reference.",
    ),
]

#: The page's opening paragraph, after the sentence that says where its tables come from.
INTRO = (
    "`python -m benchmarks.report` builds this page from the files the suite wrote under "
    "`results/`. Each entry runs in its own process; times are medians of repeated calls, "
    "compile time is measured apart from run time, and ours and the peers run side by side "
    "in one process. Each section's first line records the versions, the machine and its "
    "load during that entry."
)
ONE_RUN = (
    "Every table below comes from one run of `python -m benchmarks` (the README's main "
    "job) on {date}"
)
SEVERAL_RUNS = (
    "Each section below comes from the last run of its entry by `python -m benchmarks` "
    "(the README's main job; `--only` reruns some entries), {when}"
)


def _suite_entries(suite: pathlib.Path) -> set[str]:
    """The entries the last run's table (`results/suite.md`) lists as run to the end."""
    if not suite.exists():
        return set()
    rows = [line.split("|") for line in suite.read_text().splitlines() if line.startswith("| ")]
    return {row[1].strip() for row in rows[1:] if len(row) > 3 and row[2].strip() == "ok"}


def _strip_title(text: str) -> tuple[str, str]:
    """Split a results file into its `## title` line and the rest."""
    lines = text.strip().splitlines()
    if lines and lines[0].startswith("## "):
        return lines[0][3:].strip(), "\n".join(lines[1:]).strip()
    return "", "\n".join(lines)


def build(results: pathlib.Path = RESULTS, docs: pathlib.Path = DOCS) -> str:
    """Return the page's markdown and copy the plots into `docs/img/`."""
    present = [(name, note) for name, note in SECTIONS if (results / f"{name}.md").exists()]
    if not present:
        raise SystemExit(f"no results in {results}: run `python -m benchmarks` first")
    stamps = [(results / f"{name}.md").stat().st_mtime for name, _ in present]
    first, last = (
        datetime.datetime.fromtimestamp(t, datetime.UTC).strftime("%Y-%m-%d")
        for t in (min(stamps), max(stamps))
    )
    suite = results / "suite.md"
    one_run = {name for name, _ in present} <= _suite_entries(suite)
    if one_run:
        origin = ONE_RUN.format(date=last)
    else:
        when = f"on {last}" if first == last else f"between {first} and {last}"
        origin = SEVERAL_RUNS.format(when=when)
        if suite.exists():
            origin += ". The last run's table lists the entries it ran"
    parts = ["# Benchmarks\n\n" + textwrap.fill(f"{origin}. {INTRO}", width=88)]
    if suite.exists():
        title, body = _strip_title(suite.read_text())
        heading = "The run" if one_run else "The last run"
        parts.append(f"## {heading}: {title[0].lower() + title[1:]}\n\n{body}" if title else body)
    (docs / "img").mkdir(parents=True, exist_ok=True)
    for name, note in present:
        title, body = _strip_title((results / f"{name}.md").read_text())
        # The results files use `###` for their subsections already.
        title = title or TITLES.get(name, name)
        section = [f"## {title}", "", note, ""]
        png = results / f"{name}.png"
        if png.exists():
            shutil.copyfile(png, docs / "img" / png.name)
            section += [f"![{title}](img/{png.name})", ""]
        section.append(body)
        parts.append("\n".join(section))
    return "\n\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=pathlib.Path, default=RESULTS)
    parser.add_argument("--output", type=pathlib.Path, default=DOCS / "benchmarks.md")
    opts = parser.parse_args(argv)
    page = build(opts.results, opts.output.parent)
    opts.output.write_text(page)
    print(f"wrote {opts.output.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
