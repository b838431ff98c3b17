"""The per-dtype runner shared by the float32/float64 benchmarks.

Such a benchmark measures each dtype in its own process (`jax_enable_x64` is global),
launched as `python -m benchmarks.<name> --worker <dtype> --json <file>`; the parent
collects the JSON results, renders one report and writes it with its plot under
`results/`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ._env import cpus, loadavg

__all__ = ["ROOT", "RESULTS", "log", "main", "parse_args", "run_workers", "write_report"]

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def parse_args(
    description: str,
    argv: list[str] | None,
    dtypes: Sequence[str],
    *,
    quick_help: str,
    check_help: str,
) -> argparse.Namespace:
    """`--quick`/`--default`/`--full`, `--dtypes`, `--check`, and the hidden worker
    options `--worker DTYPE --json FILE`."""
    parser = argparse.ArgumentParser(description=description)
    mode = parser.add_mutually_exclusive_group()
    for name, text in (
        ("quick", quick_help),
        ("default", "(the default)"),
        ("full", "more repeats"),
    ):
        mode.add_argument(f"--{name}", dest="mode", action="store_const", const=name, help=text)
    parser.add_argument(
        "--dtypes",
        default=",".join(dtypes),
        help=f"comma-separated dtypes to run (default: {','.join(dtypes)})",
    )
    parser.add_argument("--check", action="store_true", help=check_help)
    parser.add_argument("--worker", choices=dtypes, help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    parser.set_defaults(mode="default")
    opts = parser.parse_args(argv)
    if not opts.worker:
        opts.dtypes = [d.strip() for d in opts.dtypes.split(",") if d.strip()]
        bad = [d for d in opts.dtypes if d not in dtypes]
        if bad:
            parser.error(f"unknown dtype(s) {bad}; choose from {tuple(dtypes)}")
    return opts


def run_workers(module: str, dtypes: Sequence[str], mode: str) -> list[dict[str, Any]] | None:
    """Run one worker process per dtype; their JSON results, or None if one failed."""
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in dtypes:
            out = Path(tmp) / f"{dtype}.json"
            cmd = [sys.executable, "-m", module, "--worker", dtype, "--json", str(out)]
            rc = subprocess.call(cmd + [f"--{mode}"], cwd=ROOT)
            if rc != 0:
                log(f"the {dtype} worker failed (exit {rc})")
                return None
            results.append(json.loads(out.read_text()))
    return results


def write_report(name: str, report: str, plot: Callable[[Path], bool]) -> None:
    """Print `report`, write it to `results/<name>.md` and the plot to `<name>.png`."""
    print()
    print(report)
    RESULTS.mkdir(exist_ok=True)
    md = RESULTS / f"{name}.md"
    md.write_text(report)
    written = [md]
    png = RESULTS / f"{name}.png"
    if plot(png):
        written.append(png)
    log("wrote " + ", ".join(str(p.relative_to(ROOT)) for p in written))


def main(
    name: str,
    argv: list[str] | None,
    *,
    description: str,
    dtypes: Sequence[str],
    quick_help: str,
    check_help: str,
    run_worker: Callable[[str, str], Any],
    load: Callable[[dict[str, Any]], Any],
    render: Callable[..., str],
    plot: Callable[[list[Any], Path], bool],
    failed: Callable[[list[Any]], bool],
) -> int:
    """The whole command line of a per-dtype benchmark `benchmarks.<name>`.

    In a worker process, `run_worker(dtype, mode)` measures one dtype and its result
    (a dataclass) goes to the JSON file. In the parent, each dtype's JSON result is
    rebuilt by `load`, `render(results, mode, seconds, (load_before, load_after))`
    makes the report, and with `--check` the exit status is 1 when `failed(results)`.
    """
    opts = parse_args(description, argv, dtypes, quick_help=quick_help, check_help=check_help)
    if opts.worker:  # one dtype, in this process; results as JSON
        result = run_worker(opts.worker, opts.mode)
        Path(opts.json).write_text(json.dumps(asdict(result)))
        return 0

    start, load0 = time.perf_counter(), loadavg()
    log(f"{name} benchmark (--{opts.mode}), dtypes {opts.dtypes}, {cpus()}")
    raw = run_workers(f"benchmarks.{name}", opts.dtypes, opts.mode)
    if raw is None:
        return 1
    results = [load(d) for d in raw]
    report = render(results, opts.mode, time.perf_counter() - start, (load0, loadavg()))
    write_report(name, report, lambda png: plot(results, png))
    if opts.check:
        return 1 if failed(results) else 0
    return 0
