"""Dispatch and compile cost of a custom derivative rule, written four ways.

Two jitted workloads, each built with one custom-rule function:

* trivial: `log1pexp(x) * 2` on an 8-element array (forward only), where the
  time per call is almost all dispatch;
* MLP: one gradient step, `jax.jit(jax.grad(loss))`, of a 200-layer tanh MLP
  whose every activation goes through the custom-rule `tanh`.

Each custom-rule function is written four ways with the same rules:

* `implicitdiff.Primitive` (a subclass applied with `Cls.apply(x)`);
* `jax.custom_vjp`;
* a raw `jax.experimental.hijax.VJPHiPrimitive`;
* plain `jax.numpy`, no custom rule (the floor).

From one run the script prints a markdown table (per-call medians, trace+lower
and XLA compile times, ratios against `jax.custom_vjp`) and whether the goals
hold: `implicitdiff.Primitive` within 1.1x of `jax.custom_vjp` per call on both
workloads and within 1.2x on compile time. The table also goes to
`results/dispatch.md` and a bar chart to `results/dispatch.png`.

Usage::

    python benchmarks/dispatch.py            # --quick (default): under 2 minutes
    python benchmarks/dispatch.py --full     # more repeats
    python -m benchmarks.dispatch --quick
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.hijax import VJPHiPrimitive

try:
    from ._timing import interleaved, rotated
except ImportError:  # run as a plain script: this folder is on sys.path
    from _timing import interleaved, rotated

ROOT = Path(__file__).resolve().parents[1]

try:
    import implicitdiff
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT))
    import implicitdiff

RESULTS = ROOT / "results"

# ---------------------------------------------------------------------------
# The custom-rule functions: one implementation and one VJP rule each, shared
# by all four ways of writing them.


@dataclass(frozen=True)
class Rule:
    """A function with a hand-written VJP: `fn(x)`, residuals `res(x, y)`, `bwd(res, g)`."""

    name: str
    fn: Callable[[Any], Any]
    res: Callable[[Any, Any], Any]
    bwd: Callable[[Any, Any], Any]


LOG1PEXP = Rule(
    "Log1pExp",
    fn=lambda x: jnp.log1p(jnp.exp(x)),
    res=lambda x, y: x,
    bwd=lambda x, g: (1 - 1 / (1 + jnp.exp(x))) * g,  # the stable formula
)

TANH = Rule(
    "Tanh",
    fn=jnp.tanh,
    res=lambda x, y: y,
    bwd=lambda y, g: (1 - y * y) * g,
)


def with_implicitdiff(rule: Rule) -> Callable[[Any], Any]:
    """`implicitdiff.Primitive`: types come from the argument via `Cls.apply`."""

    class Op(implicitdiff.Primitive):
        def expand(self, x):
            return rule.fn(x)

        def vjp_fwd(self, nzs_in, x):
            y = self(x)
            return y, rule.res(x, y)

        def vjp_bwd_retval(self, res, g):
            return (rule.bwd(res, g),)

    Op.__name__ = Op.__qualname__ = rule.name
    return Op.apply


def with_custom_vjp(rule: Rule) -> Callable[[Any], Any]:
    """`jax.custom_vjp` with the same forward and backward rules."""

    @jax.custom_vjp
    def op(x):
        return rule.fn(x)

    def fwd(x):
        y = rule.fn(x)
        return y, rule.res(x, y)

    def bwd(res, g):
        return (rule.bwd(res, g),)

    op.defvjp(fwd, bwd)
    return op


def with_hijax(rule: Rule) -> Callable[[Any], Any]:
    """A raw `jax.experimental.hijax.VJPHiPrimitive`, as in JAX's hijax guide."""

    class Op(VJPHiPrimitive):
        def __init__(self, x_aval):
            self.in_avals = (x_aval,)
            self.out_aval = x_aval
            self.params = {}
            super().__init__()

        def expand(self, x):
            return rule.fn(x)

        def vjp_fwd(self, nzs_in, x):
            y = self(x)
            return y, rule.res(x, y)

        def vjp_bwd_retval(self, res, g):
            return (rule.bwd(res, g),)

    Op.__name__ = Op.__qualname__ = rule.name

    def op(x):
        return Op(jax.typeof(x))(x)

    return op


def with_plain_jnp(rule: Rule) -> Callable[[Any], Any]:
    """No custom rule: JAX differentiates `fn` itself."""
    return rule.fn


IMPLS: dict[str, Callable[[Rule], Callable[[Any], Any]]] = {
    "implicitdiff.Primitive": with_implicitdiff,
    "jax.custom_vjp": with_custom_vjp,
    "hijax VJPHiPrimitive": with_hijax,
    "plain jnp (no rule)": with_plain_jnp,
}
OURS, REF, HIJAX, PLAIN = list(IMPLS)

# ---------------------------------------------------------------------------
# The two workloads. Each `build_*` makes a fresh function (fresh primitive
# classes, fresh closures) so that compile-time measurements hit no cache.

N_LAYERS = 200
WIDTH = 64
BATCH = 32


def build_trivial(impl: str) -> Callable[..., Any]:
    log1pexp = IMPLS[impl](LOG1PEXP)

    def trivial(x):
        return log1pexp(x) * 2

    return trivial


def build_mlp_step(impl: str) -> Callable[..., Any]:
    tanh = IMPLS[impl](TANH)

    def loss(params, x):
        h = x
        for w, b in params:
            h = tanh(h @ w + b)
        return jnp.mean(h * h)

    return jax.grad(loss)


def trivial_args() -> tuple[Any, ...]:
    return (jnp.linspace(-3.0, 3.0, 8, dtype=jnp.float32),)


def mlp_args() -> tuple[Any, ...]:
    key = jax.random.PRNGKey(0)
    params = []
    for _ in range(N_LAYERS):
        key, kw, kb = jax.random.split(key, 3)
        w = jax.random.normal(kw, (WIDTH, WIDTH), jnp.float32) / np.sqrt(WIDTH)
        b = 0.1 * jax.random.normal(kb, (WIDTH,), jnp.float32)
        params.append((w, b))
    x = jax.random.normal(key, (BATCH, WIDTH), jnp.float32)
    return (params, x)


@dataclass
class Workload:
    name: str
    build: Callable[[str], Callable[..., Any]]
    args: tuple[Any, ...]
    check_grad: bool = False
    per_call: dict[str, float] = field(default_factory=dict)  # seconds, median
    trace_lower: dict[str, float] = field(default_factory=dict)  # seconds, median
    xla_compile: dict[str, float] = field(default_factory=dict)  # seconds, median


# ---------------------------------------------------------------------------
# Measurement.


def log(msg: str) -> None:
    print(msg, flush=True)


def assert_tree_close(actual: Any, expected: Any, what: str) -> None:
    a_leaves, a_tree = jax.tree.flatten(actual)
    e_leaves, e_tree = jax.tree.flatten(expected)
    assert a_tree == e_tree, f"{what}: structure {a_tree} != {e_tree}"
    for a, e in zip(a_leaves, e_leaves):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-5, atol=1e-6, err_msg=what)


def check_equal(wl: Workload) -> None:
    """All four implementations give the same numbers (values and gradients)."""
    ref = jax.jit(wl.build(REF))(*wl.args)
    for impl in IMPLS:
        assert_tree_close(jax.jit(wl.build(impl))(*wl.args), ref, f"{wl.name}: {impl}")
    if wl.check_grad:  # the trivial workload is timed forward-only; check its rule too
        grad_of = lambda impl: jax.jit(jax.grad(lambda *a: wl.build(impl)(*a).sum()))
        g_ref = grad_of(REF)(*wl.args)
        for impl in IMPLS:
            assert_tree_close(grad_of(impl)(*wl.args), g_ref, f"{wl.name} gradient: {impl}")


def measure_compile(wl: Workload, reps: int) -> None:
    """Median trace+lower and XLA compile time per implementation, all caches cleared."""
    samples: dict[str, list[tuple[float, float]]] = {impl: [] for impl in IMPLS}
    for rep in range(reps):
        for impl in rotated(list(IMPLS), rep):
            jax.clear_caches()
            f = jax.jit(wl.build(impl))
            t0 = time.perf_counter()
            lowered = f.trace(*wl.args).lower()
            t1 = time.perf_counter()
            lowered.compile()
            t2 = time.perf_counter()
            samples[impl].append((t1 - t0, t2 - t1))
    for impl, s in samples.items():
        wl.trace_lower[impl] = statistics.median(x for x, _ in s)
        wl.xla_compile[impl] = statistics.median(y for _, y in s)


def measure_calls(wl: Workload, rounds: int, block: int, warmup: int = 5) -> None:
    """Median wall time of one call + `block_until_ready`.

    Implementations take turns in short blocks of calls (starting with a different
    one each round), so a background load slows all of them alike.
    """
    fns = {impl: jax.jit(wl.build(impl)) for impl in IMPLS}
    for f in fns.values():
        for _ in range(warmup):
            jax.block_until_ready(f(*wl.args))
    wl.per_call.update(interleaved(fns, rounds, block, args=wl.args, warmup=False))


# ---------------------------------------------------------------------------
# Report.


@dataclass
class Verdict:
    call_ratios: dict[str, float]
    compile_ratios: dict[str, float]
    call_ok: bool
    compile_ok: bool


CALL_GOAL = 1.1
COMPILE_GOAL = 1.2


def compile_total(wl: Workload, impl: str) -> float:
    return wl.trace_lower[impl] + wl.xla_compile[impl]


def verdict(trivial: Workload, mlp: Workload) -> Verdict:
    call = {wl.name: wl.per_call[OURS] / wl.per_call[REF] for wl in (trivial, mlp)}
    comp = {wl.name: compile_total(wl, OURS) / compile_total(wl, REF) for wl in (trivial, mlp)}
    return Verdict(
        call,
        comp,
        all(r <= CALL_GOAL for r in call.values()),
        all(r <= COMPILE_GOAL for r in comp.values()),
    )


def render(trivial: Workload, mlp: Workload, mode: str, wall: float) -> str:
    v = verdict(trivial, mlp)
    header = (
        "| implementation | trivial call (us) | × custom_vjp | MLP step (ms) | × custom_vjp "
        "| trivial trace+lower / XLA compile (ms) | MLP trace+lower (ms) | MLP XLA compile (ms) "
        "| compile × custom_vjp (trivial / MLP) |"
    )
    lines = [header, "|" + "---|" * header.count(" | ") + "---|"]
    for impl in IMPLS:
        lines.append(
            f"| {impl} "
            f"| {trivial.per_call[impl] * 1e6:.1f} "
            f"| {trivial.per_call[impl] / trivial.per_call[REF]:.2f} "
            f"| {mlp.per_call[impl] * 1e3:.2f} "
            f"| {mlp.per_call[impl] / mlp.per_call[REF]:.2f} "
            f"| {trivial.trace_lower[impl] * 1e3:.0f} / {trivial.xla_compile[impl] * 1e3:.0f} "
            f"| {mlp.trace_lower[impl] * 1e3:.0f} "
            f"| {mlp.xla_compile[impl] * 1e3:.0f} "
            f"| {compile_total(trivial, impl) / compile_total(trivial, REF):.2f} / "
            f"{compile_total(mlp, impl) / compile_total(mlp, REF):.2f} |"
        )
    ok = lambda b: "met" if b else "NOT met"
    tax_trivial = (trivial.per_call[HIJAX] - trivial.per_call[REF]) * 1e6
    tax_mlp = (mlp.per_call[HIJAX] - mlp.per_call[REF]) * 1e3
    goals = (
        f"Goals (implicitdiff.Primitive vs jax.custom_vjp): per call "
        f"{v.call_ratios['trivial']:.2f}x trivial, {v.call_ratios['MLP']:.2f}x MLP "
        f"(<= {CALL_GOAL}x: {ok(v.call_ok)}); compile "
        f"{v.compile_ratios['trivial']:.2f}x trivial, {v.compile_ratios['MLP']:.2f}x MLP "
        f"(<= {COMPILE_GOAL}x: {ok(v.compile_ok)}). "
        f"Overall: {'all goals hold' if v.call_ok and v.compile_ok else 'goals do NOT hold'}."
    )
    tax = (
        f"hijax dispatch tax vs jax.custom_vjp: {tax_trivial:+.0f} us per trivial call, "
        f"{tax_mlp:+.2f} ms per MLP step."
    )
    env = (
        f"jax {jax.__version__}, backend {jax.default_backend()} "
        f"({jax.devices()[0].device_kind}), {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}, mode --{mode}, run took {wall:.0f} s."
    )
    method = (
        f"Trivial: `jit(lambda x: log1pexp(x) * 2)` on f32[8], forward. MLP: "
        f"`jit(grad(loss))`, {N_LAYERS} layers `tanh(h @ W + b)`, width {WIDTH}, batch {BATCH}, "
        "every tanh through the custom rule. Per call: median of single calls with "
        "`block_until_ready`, implementations interleaved. Compile: median of fresh "
        "`jit(f).trace(...).lower()` and `.compile()` after `jax.clear_caches()`."
    )
    return "\n".join(
        ["## Dispatch benchmark", "", env, "", *lines, "", goals, "", tax, "", method, ""]
    )


def plot(trivial: Workload, mlp: Workload, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed (pip install -e '.[bench]'); no chart written")
        return False
    names = list(IMPLS)
    colors = ["tab:green", "tab:blue", "tab:red", "tab:gray"]
    y = np.arange(len(names))
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8), sharey=True)
    panels = [
        (axes[0], [trivial.per_call[n] * 1e6 for n in names], "trivial call, median (us)"),
        (axes[1], [mlp.per_call[n] * 1e3 for n in names], "200-layer MLP grad step, median (ms)"),
    ]
    for ax, vals, title in panels:
        ax.barh(y, vals, color=colors)
        for yi, val in zip(y, vals):
            ax.text(val, yi, f" {val:.3g}", va="center", fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.margins(x=0.2)
    ax = axes[2]
    tl = [mlp.trace_lower[n] for n in names]
    xc = [mlp.xla_compile[n] for n in names]
    ax.barh(y, tl, color=colors, alpha=0.55, label="trace + lower")
    ax.barh(y, xc, left=tl, color=colors, label="XLA compile")
    for yi, a, b in zip(y, tl, xc):
        ax.text(a + b, yi, f" {a + b:.2f}", va="center", fontsize=8)
    ax.set_title("MLP compile (s): trace+lower | XLA", fontsize=10)
    ax.margins(x=0.2)
    axes[0].set_yticks(y, names)
    axes[0].invert_yaxis()
    fig.suptitle(f"Custom-rule dispatch cost (jax {jax.__version__}, {jax.default_backend()})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# ---------------------------------------------------------------------------

SETTINGS = {
    # per-call: (rounds, calls per implementation per round); compile: repetitions
    "quick": dict(trivial=(100, 20), mlp=(50, 1), compile_trivial=5, compile_mlp=3),
    "full": dict(trivial=(500, 40), mlp=(500, 1), compile_trivial=9, compile_mlp=7),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--quick",
        dest="mode",
        action="store_const",
        const="quick",
        help="fewer repeats, under 2 minutes on 2 CPU cores (default)",
    )
    mode.add_argument(
        "--full",
        dest="mode",
        action="store_const",
        const="full",
        help="more repeats, steadier medians",
    )
    parser.add_argument(
        "--check", action="store_true", help="exit with status 1 when the goals do not hold"
    )
    parser.set_defaults(mode="quick")
    opts = parser.parse_args(argv)
    s = SETTINGS[opts.mode]
    start = time.perf_counter()

    trivial = Workload("trivial", build_trivial, trivial_args(), check_grad=True)
    mlp = Workload("MLP", build_mlp_step, mlp_args())

    log(f"dispatch benchmark (--{opts.mode}): jax {jax.__version__} on {jax.default_backend()}")
    steps = [
        (
            "checking all implementations agree (values and gradients)",
            lambda: [check_equal(wl) for wl in (trivial, mlp)],
        ),
        (
            f"trivial: compile times ({s['compile_trivial']} reps each)",
            lambda: measure_compile(trivial, s["compile_trivial"]),
        ),
        (
            f"MLP: compile times ({s['compile_mlp']} reps each)",
            lambda: measure_compile(mlp, s["compile_mlp"]),
        ),
        (
            "trivial: per-call times ({} rounds x {} calls each)".format(*s["trivial"]),
            lambda: measure_calls(trivial, *s["trivial"]),
        ),
        (
            "MLP: per-step times ({} rounds x {} calls each)".format(*s["mlp"]),
            lambda: measure_calls(mlp, *s["mlp"]),
        ),
    ]
    for i, (what, run) in enumerate(steps, 1):
        t0 = time.perf_counter()
        log(f"[{i}/{len(steps)}] {what} ...")
        run()
        log(f"      done in {time.perf_counter() - t0:.1f} s")

    report = render(trivial, mlp, opts.mode, time.perf_counter() - start)
    print()
    print(report)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "dispatch.md").write_text(report)
    written = [RESULTS / "dispatch.md"]
    if plot(trivial, mlp, RESULTS / "dispatch.png"):
        written.append(RESULTS / "dispatch.png")
    log("wrote " + ", ".join(str(p.relative_to(ROOT)) for p in written))
    v = verdict(trivial, mlp)
    return 1 if opts.check and not (v.call_ok and v.compile_ok) else 0


if __name__ == "__main__":
    sys.exit(main())
