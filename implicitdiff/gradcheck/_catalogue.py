"""The gradient-check catalogue and its command line (`implicitdiff-gradcheck`).

The catalogue is the built-in problems (see `_builtin`), then those added with
`register`, then those that installed packages publish under the entry-point group
``implicitdiff.gradcheck``, names unique (`problems`). `main`, the command line, picks
problems from it, runs them and prints one summary table; the two live together because
the command line is the one consumer of the catalogue, and is mostly its option
handling.
"""

from __future__ import annotations

import fnmatch
import os
import sys
import time
import traceback
from collections.abc import Sequence

import jax

from ._builtin import _builtin_problems
from ._compare import FD, REFERENCE
from ._problem import Problem
from ._report import GradCheckError, GradCheckRow, format_table

__all__ = ["Problem", "register", "problems", "main", "ENTRY_POINT_GROUP"]

ENTRY_POINT_GROUP = "implicitdiff.gradcheck"


_REGISTERED: dict[str, Problem] = {}


def register(problem: Problem) -> Problem:
    """Add `problem` to the catalogue of this process (returns it).

    Raises:
        ValueError: if a built-in or registered problem already has its name.
    """
    if not isinstance(problem, Problem):
        raise TypeError(f"register expects a Problem, got {type(problem).__name__}")
    if problem.name in _REGISTERED or any(p.name == problem.name for p in _builtin_problems()):
        raise ValueError(f"a gradcheck problem named {problem.name!r} already exists")
    _REGISTERED[problem.name] = problem
    return problem


def _entry_point_problems(warnings: list[str]) -> list[Problem]:
    from importlib.metadata import entry_points

    found: list[Problem] = []
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            provider = ep.load()
            items = list(provider())
            bad = [x for x in items if not isinstance(x, Problem)]
            if bad:
                raise TypeError(f"returned {type(bad[0]).__name__}, not Problem")
        except Exception as e:
            warnings.append(f"entry point {ep.name!r} ({ep.value}): {type(e).__name__}: {e}")
            continue
        found.extend(items)
    return found


def problems(*, entry_points: bool = True, warnings: list[str] | None = None) -> list[Problem]:
    """The catalogue: built-in problems, then registered ones, then entry-point ones.

    Arguments:
        entry_points: also load the problems that installed packages publish under the
            entry-point group ``implicitdiff.gradcheck`` (each entry point loads to a
            callable returning a list of `Problem`s).
        warnings: if given, a list that receives one message per entry point that
            failed to load and per duplicate name skipped (otherwise they are ignored).

    Returns:
        The problems, names unique (on a clash the first one wins).
    """
    sink: list[str] = [] if warnings is None else warnings
    out: list[Problem] = []
    seen: set[str] = set()
    candidates = [*_builtin_problems(), *_REGISTERED.values()]
    if entry_points:
        candidates += _entry_point_problems(sink)
    for p in candidates:
        if p.name in seen:
            sink.append(f"duplicate gradcheck problem name {p.name!r}: skipped")
            continue
        seen.add(p.name)
        out.append(p)
    return out


# ---------------------------------------------------------------------------
# Command line.


def _matches(name: str, patterns: Sequence[str]) -> bool:
    lowered = name.lower()
    for pat in patterns:
        p = pat.lower()
        if p in lowered or fnmatch.fnmatchcase(lowered, p):
            return True
    return False


def _overview(
    per_problem: Sequence[tuple[str, str, float]],
    rows: Sequence[GradCheckRow],
    names: Sequence[str],
    *,
    markdown: bool,
) -> str:
    """One line per problem: checks, failures, and the worst errors by kind of check."""

    def worst(pname: str, against: str) -> str:
        errs = [r.max_abs_err for r, n in zip(rows, names) if n == pname and r.against == against]
        return f"{max(errs):.1e}" if errs else "-"

    headers = (
        "problem",
        "checks",
        "failed",
        "worst vs finite differences",
        "worst vs reference",
        "time (s)",
        "status",
    )
    body = []
    for pname, status, elapsed in per_problem:
        mine = [r for r, n in zip(rows, names) if n == pname]
        body.append(
            (
                pname,
                str(len(mine)),
                str(sum(not r.passed for r in mine)),
                worst(pname, FD),
                worst(pname, REFERENCE),
                f"{elapsed:.1f}",
                status,
            )
        )
    if markdown:
        lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
        lines += ["| " + " | ".join(r) + " |" for r in body]
        return "\n".join(lines)
    widths = [max(len(h), *(len(r[i]) for r in body)) for i, h in enumerate(headers)]
    fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()
    return "\n".join([fmt(headers), fmt(["-" * w for w in widths]), *(fmt(r) for r in body)])


def main(argv: Sequence[str] | None = None) -> int:
    """Run the derivative checks of the catalogue and print one summary table.

    Arguments:
        argv: command-line arguments without the program name (default:
            ``sys.argv[1:]``). Options: ``--list``; ``--full`` (every problem, one
            argument at a time, to its full `Problem.order`; without it and without
            ``-k`` the run is quick: the problems marked `Problem.quick`, all arguments
            perturbed at once, each to its `Problem.quick_order`); ``-k PATTERN``
            (repeatable: check in full the problems, quick or not, whose name contains
            PATTERN or matches it as a glob, case-insensitively); ``--order N``;
            ``--markdown``; ``--output FILE``.

    Prints one progress line per problem to stderr (with the traceback of a problem
    that raised), then the table of all checks and a line
    ``N problems, M checks, K failed`` to stdout (and to ``--output``). Runs in
    float64: ``jax_enable_x64`` is switched on for the run and restored afterwards,
    as is ``jax_disable_most_optimizations`` (each check compiles a few programs and
    runs them once, so XLA's optimisation passes would cost more than they save).

    Returns:
        0 if every check passed; 1 if any failed, a problem raised, or the
        catalogue was incomplete (an entry point that failed to load, a duplicate
        name; ``--list`` still returns 0 then, with warnings on stderr); 2 for a
        usage error (a bad option, a ``-k`` that selects nothing, an ``--output``
        in a missing directory).

    Example:
        ```python
        from implicitdiff.gradcheck import main

        main(["--list"])
        ```
    """
    import argparse

    parser = argparse.ArgumentParser(
        prog="implicitdiff-gradcheck",
        description="Check derivatives of implicit-differentiation problems against "
        "finite differences and reference implementations (float64).",
    )
    parser.add_argument("--list", action="store_true", help="list the problems and exit")
    parser.add_argument(
        "--full",
        action="store_true",
        help="check every problem, one argument at a time, to its full order (minutes); "
        "the default quick run checks a representative subset, all arguments at once "
        "(seconds)",
    )
    parser.add_argument(
        "-k",
        dest="patterns",
        action="append",
        default=[],
        metavar="PATTERN",
        help="check in full the problems whose name contains PATTERN or matches it as a glob "
        "(repeatable)",
    )
    parser.add_argument("--order", type=int, default=None, help="highest derivative order")
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    parser.add_argument("--output", metavar="FILE", help="also write the table to FILE")
    try:
        opts = parser.parse_args(argv)
    except SystemExit as e:  # argparse exits 2 on usage errors, 0 for --help
        return e.code if isinstance(e.code, int) else 2
    if opts.order is not None and opts.order < 1:
        print("implicitdiff-gradcheck: error: --order must be >= 1", file=sys.stderr)
        return 2
    if opts.output and not os.path.isdir(os.path.dirname(os.path.abspath(opts.output))):
        print(f"implicitdiff-gradcheck: error: no directory for {opts.output}", file=sys.stderr)
        return 2

    warnings: list[str] = []
    catalogue = problems(warnings=warnings)
    for w in warnings:
        print(f"warning: {w}", file=sys.stderr)

    if opts.list:
        width = max((len(p.name) for p in catalogue), default=0)
        for p in catalogue:
            tag = "" if p.quick else "[--full] "
            print(f"{p.name.ljust(width)}  {tag}{p.description}".rstrip())
        return 0

    # Problems picked by name are checked in full; the default run is the quick overview.
    full = opts.full or bool(opts.patterns)
    if opts.patterns:
        selected = [p for p in catalogue if _matches(p.name, opts.patterns)]
    else:
        selected = [p for p in catalogue if full or p.quick]
    if not selected:
        print(
            f"implicitdiff-gradcheck: error: no problem matches {' or '.join(opts.patterns)!r}"
            " (see --list)",
            file=sys.stderr,
        )
        return 2

    old_flags = {
        name: jax.config.values[name]
        for name in ("jax_enable_x64", "jax_disable_most_optimizations")
    }
    for name in old_flags:
        jax.config.update(name, True)
    rows: list[GradCheckRow] = []
    names: list[str] = []
    errors: list[str] = []
    per_problem: list[tuple[str, str, float]] = []
    try:
        for i, p in enumerate(selected, 1):
            print(f"[{i}/{len(selected)}] {p.name} ...", end=" ", file=sys.stderr, flush=True)
            start = time.perf_counter()
            try:
                result = p.run(order=opts.order, full=full)
                status = "ok"
            except GradCheckError as e:
                result = e.rows
                status = "FAILED"
            except Exception as e:  # a broken problem is reported, the others still run
                result = []
                status = "ERROR"
                first_line = (str(e).strip().splitlines() or [""])[0]
                errors.append(f"{p.name}: {type(e).__name__}: {first_line}")
                trace = "".join(traceback.format_exception(e))
            elapsed = time.perf_counter() - start
            per_problem.append((p.name, status, elapsed))
            rows += result
            names += [p.name] * len(result)
            print(f"{status} ({len(result)} checks, {elapsed:.1f} s)", file=sys.stderr)
            if status == "ERROR":
                print(trace, file=sys.stderr)
    finally:
        for name, value in old_flags.items():
            jax.config.update(name, value)

    failed = sum(not r.passed for r in rows)
    summary = f"{len(selected)} problems, {len(rows)} checks, {failed} failed"
    if errors:
        summary += f", {len(errors)} problems raised an error"
    if not full:
        lowered = sum(opts.order is None and (p.quick_order or p.order) < p.order for p in selected)
        summary += (
            f" (quick run: arguments perturbed together, {lowered} problems to a lower"
            f" order, {len(catalogue) - len(selected)} left out; --full checks them all)"
        )
    table = format_table(rows, markdown=opts.markdown, problems=names) if rows else ""
    overview = _overview(per_problem, rows, names, markdown=opts.markdown)
    table = f"{overview}\n\n{table}" if table else overview
    tail = "\n".join([*(f"ERROR {err}" for err in errors), summary])
    report = (
        f"{table}\n\n{tail}" if opts.markdown and table else "\n".join(filter(None, [table, tail]))
    )
    print(report)
    if opts.output:
        try:
            with open(opts.output, "w", encoding="utf-8") as fh:
                fh.write(report + "\n")
        except OSError as e:
            print(
                f"implicitdiff-gradcheck: error: cannot write {opts.output}: {e}", file=sys.stderr
            )
            return 2
    return 1 if failed or errors or warnings else 0
