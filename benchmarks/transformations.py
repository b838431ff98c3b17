"""The transformation matrix of the nonlinear solvers: every method under every transformation.

Each cell runs one JAX transformation of one solver method on a problem with a
closed-form solution, in float64, and compares the result with the closed form:

- `fixed_point`: the hijax guide's Newton iteration for `sqrt(a)`;
- `root`: `x**3 = a`, so `x = a**(1/3)` (chord from x0 = 1 needs a near 2);
- `minimize`: `argmin_x exp(x) - a x = log(a)`.

A cell shows the largest relative error over the batch `a = [1.5, 2.0, 2.5]`
(`ok` when below 1e-8) or the exception raised. Usage::

    python -m benchmarks.transformations            # prints the table
    python -m benchmarks.transformations --output results/transformations.md
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time
from collections.abc import Callable

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from solvers import fixed_point, minimize, root  # noqa: E402

TOLERANCE = 1e-8
A = np.array([1.5, 2.0, 2.5])

# name -> (scalar solution function a -> x*(a), x*, x*', x*'')
Problem = tuple[Callable, Callable, Callable, Callable]


def _fixed_point(method: str) -> Callable:
    def sqrt(a):
        return fixed_point(lambda a, x: 0.5 * (x + a / x), a, a, method=method)

    return sqrt


def _root(method: str) -> Callable:
    kw = {"bracket": (0.0, 10.0)} if method == "bisection" else {}

    def cbrt(a):
        return root(lambda x, a: x**3 - a, jnp.ones_like(a), a, method=method, **kw)

    return cbrt


def _minimize(method: str) -> Callable:
    def log(a):
        fun = lambda x, a: jnp.exp(x) - a * x
        # minimize's tolerance is on the gradient; tighten it so the table measures the
        # derivatives rather than how close the default tolerance leaves x to log(a)
        return minimize(fun, jnp.zeros_like(a), a, method=method, rtol=1e-12, atol=1e-12)

    return log


SQRT = (np.sqrt, lambda a: 0.5 * a**-0.5, lambda a: -0.25 * a**-1.5)
CBRT = (np.cbrt, lambda a: a ** (-2 / 3) / 3, lambda a: -2 / 9 * a ** (-5 / 3))
LOG = (np.log, lambda a: 1 / a, lambda a: -1 / a**2)

PROBLEMS: dict[str, Problem] = {
    **{f"fixed_point {m}": (_fixed_point(m), *SQRT) for m in ("iterate", "damped", "anderson")},
    **{f"root {m}": (_root(m), *CBRT) for m in ("newton", "chord", "broyden", "bisection")},
    **{f"minimize {m}": (_minimize(m), *LOG) for m in ("lbfgs", "newton")},
}


def _scan_grad(f):
    def total(a):
        def body(carry, ai):
            return carry + f(ai), None

        return jax.lax.scan(body, jnp.zeros((), a.dtype), a)[0]

    return jax.grad(total)


# transformation -> (build batched function a[3] -> result[3], which derivative it is)
TRANSFORMS: dict[str, tuple[Callable[[Callable], Callable], int]] = {
    "jit": (lambda f: jax.jit(jax.vmap(f)), 0),
    "vmap": (lambda f: jax.vmap(f), 0),
    "grad": (lambda f: jax.vmap(jax.grad(f)), 1),
    "jvp": (lambda f: jax.vmap(lambda a: jax.jvp(f, (a,), (jnp.ones_like(a),))[1]), 1),
    "jacfwd": (lambda f: jax.vmap(jax.jacfwd(f)), 1),
    "jacrev": (lambda f: jax.vmap(jax.jacrev(f)), 1),
    "linearize": (lambda f: jax.vmap(lambda a: jax.linearize(f, a)[1](jnp.ones_like(a))), 1),
    "checkpoint": (lambda f: jax.vmap(jax.grad(jax.checkpoint(f))), 1),
    "vmap(grad)": (lambda f: jax.jit(jax.vmap(jax.grad(f))), 1),
    "grad(vmap)": (lambda f: jax.grad(lambda a: jnp.sum(jax.vmap(f)(a))), 1),
    "lax.scan": (_scan_grad, 1),
    "hessian": (lambda f: jax.vmap(jax.hessian(f)), 2),
    "grad(grad)": (lambda f: jax.vmap(jax.grad(jax.grad(f))), 2),
    "jacfwd(jacrev)": (lambda f: jax.vmap(jax.jacfwd(jax.jacrev(f))), 2),
}


def cell(problem: Problem, transform: str) -> str:
    f, *exact = problem
    build, order = TRANSFORMS[transform]
    try:
        got = np.asarray(build(f)(jnp.asarray(A)))
    except Exception as e:  # the table reports it
        return f"error: {type(e).__name__}"
    want = exact[order](A)
    err = float(np.max(np.abs(got - want) / np.abs(want)))
    return "ok" if err < TOLERANCE else f"FAIL {err:.1e}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=pathlib.Path, help="also write the table here")
    parser.add_argument("--quick", "--full", action="store_true", help="(same table)")
    args = parser.parse_args(argv)
    names = list(TRANSFORMS)
    lines = [
        "| solver / method | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    failures = 0
    for label, problem in PROBLEMS.items():
        t0 = time.perf_counter()
        cells = [cell(problem, name) for name in names]
        failures += sum(c != "ok" for c in cells)
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
        print(f"{label}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    table = "\n".join(lines)
    header = (
        f"Transformations of the solvers, float64, relative error vs closed form at "
        f"a = {A.tolist()} (`ok`: below {TOLERANCE:g}); {failures} failing cells.\n\n"
    )
    print(header + table)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(header + table + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
