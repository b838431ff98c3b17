"""Newton's square root as a fixed point: `solvers.fixed_point` against its peers.

The problem is the running example of JAX's hijax guide: `sqrt(a)` as the fixed point
of Newton's update `f(a, x) = 0.5 * (x + a / x)`, started from `x = a`. Every
implementation below computes that fixed point and its derivative with respect to `a`:

* ours: `solvers.fixed_point(f, a, a, method=...)` with `method` in `iterate` (the
  default), `damped` and `anderson`; derivatives by the implicit function theorem
  with the default adjoint (`adjoint=None`: after `iterate` the Neumann series, as
  `adjoint='neumann'`; after `damped` and `anderson` the series with a direct solve
  where it does not converge). Two more rows vary the default `iterate`:
  `check_every=1` (a convergence test after every step, where the default tests every
  4 steps on a batch this large) and `throw=False` (no run-time convergence checks;
  the status comes back in the info, `return_info=True`, which the row discards);
* hijax guide: the guide's `FixedPoint` `VJPHiPrimitive` (its example code, with the
  tolerance made a parameter and a one-line `batch_dim_rule` so that it can be vmapped);
* custom_vjp: the same algorithm with `jax.custom_vjp`: a forward `while_loop`, and a
  backward pass that finds the adjoint as the fixed point of `u -> g + u A`, as the
  guide's backward pass does;
* jaxopt: `jaxopt.FixedPointIteration(..., implicit_diff=True)`;
* optimistix: `optx.fixed_point(fn, optx.FixedPointIteration(rtol, atol), ...)` with its
  default `ImplicitAdjoint`;
* unrolled: 20 Newton steps in a `lax.fori_loop`, differentiated by JAX;
* `jnp.sqrt`, the floor.

All iterative solvers stop at a step of 1e-10 in float64 and 1e-6 in float32 (relative
plus absolute where the library has both, absolute otherwise); the settings are
printed with the results.

For each dtype (float32 and float64, each in its own Python process so that the flag
`jax_enable_x64` is set before anything is traced) the script measures, per
implementation:

* forward, `grad` and `grad(grad)` at `a = 2.0`: the median time of one call of the
  jitted function, with `block_until_ready`, after warm-up, implementations taking
  turns in short blocks of calls;
* `jit(vmap(value_and_grad(newton_sqrt)))` over `a = linspace(1, 100, 1_000_000)`:
  the median time of one call, implementations taking turns (one whose calls have
  taken a few seconds, Anderson's, is called no more);
* the compile time of `jit(grad(newton_sqrt))`: trace+lower and XLA compile
  separately (`jax.jit(f).trace(a).lower()`, then `.compile()`), the median of fresh
  compiles after `jax.clear_caches()`;
* correctness over the batch of 1e6: the largest absolute error of the value against
  `sqrt(a)` and of the gradient against `0.5 / sqrt(a)` (computed in float64 with
  NumPy), accepted when it is at most 100 x tol x the largest exact value.

Below each table it prints the goals with the measured ratios: ours (`iterate`, the
default options) (a) within 1.1x of `custom_vjp` per call (forward, `grad`,
`grad(grad)`), (b) at most half the best peer's time on the batched
`value_and_grad` (peers: every row but ours and `jnp.sqrt`), and (c) compiling
`jit(grad)` no slower than the best peer. The report goes to stdout and
`results/newton_sqrt.md`, a bar chart to `results/newton_sqrt.png`, progress to stderr.

CPU timings depend on other processes; pin the run to one core for steadier numbers
(the worker processes inherit the affinity).

Usage::

    python -m benchmarks.newton_sqrt --quick    # about a minute on 2 CPU cores
    python -m benchmarks.newton_sqrt            # more repeats
    python -m benchmarks.newton_sqrt --full     # more still
    taskset -c 1 python -m benchmarks.newton_sqrt --dtypes float64 --check
"""

from __future__ import annotations

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

import numpy as np

from ._env import cpus, peer_versions
from ._timing import div, fmt, interleaved, ratio, rotated, sci
from ._workers import ROOT, log
from ._workers import main as run_main

if str(ROOT) not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT))

DTYPES = ("float32", "float64")
TOL = {"float32": 1e-6, "float64": 1e-10}
MAX_STEPS = 100  # every solver's iteration cap (sqrt on [1, 100] from x = a needs ~10)
UNROLL_STEPS = 20
BATCH = 1_000_000
A_POINT = 2.0
ERROR_FACTOR = 100.0  # an error is accepted up to ERROR_FACTOR * tol * max |exact|

CALL_GOAL = 1.1  # ours / custom_vjp per call, at most
VMAP_GOAL = 0.5  # ours / best peer on the batched value_and_grad, at most
COMPILE_GOAL = 1.0  # ours / best peer, jit(grad) trace+lower+compile, at most

OURS = "ours (iterate)"
OURS_UNCHECKED = "ours (iterate, throw=False)"
CUSTOM_VJP = "custom_vjp"
TRANSFORMS = ("forward", "grad", "grad(grad)")

SETTINGS: dict[str, dict[str, Any]] = {
    # per call: rounds x block calls per implementation and transform; vmap: rounds of
    # one call each, but no more calls of one implementation once it has taken
    # vmap_budget seconds (Anderson's batch takes seconds); compile: fresh compiles.
    "quick": dict(call_rounds=60, call_block=10, vmap_rounds=9, vmap_budget=3.0, compile_reps=3),
    "default": dict(
        call_rounds=150, call_block=20, vmap_rounds=25, vmap_budget=15.0, compile_reps=5
    ),
    "full": dict(call_rounds=400, call_block=20, vmap_rounds=75, vmap_budget=60.0, compile_reps=9),
}


# ---------------------------------------------------------------------------
# Results, shared by the worker (which fills them) and the parent (which renders them).


@dataclass
class Row:
    name: str
    kind: str  # "ours", "peer" or "floor"
    settings: str
    per_call_us: dict[str, float] = field(default_factory=dict)  # transform -> median
    vmap_ms: float | None = None
    trace_lower_ms: float | None = None
    xla_compile_ms: float | None = None
    err_value: float | None = None
    err_grad: float | None = None
    ok: bool | None = None
    error: str | None = None

    @property
    def compile_ms(self) -> float | None:
        if self.trace_lower_ms is None or self.xla_compile_ms is None:
            return None
        return self.trace_lower_ms + self.xla_compile_ms


@dataclass
class DtypeResult:
    dtype: str
    tol: float
    rows: list[Row]
    wall_s: float


# ---------------------------------------------------------------------------
# The implementations. Everything JAX is imported inside the worker, after the dtype
# flag is set; `build_impls` returns, per name, a builder of a fresh `newton_sqrt`
# (fresh closures, so that compile-time measurements hit no cache).


@dataclass(frozen=True)
class Impl:
    name: str
    kind: str
    settings: str
    build: Callable[[], Callable[[Any], Any]]


def build_impls(dtype: str) -> list[Impl]:
    import jax.numpy as jnp
    from jax import lax

    from solvers import fixed_point

    tol = TOL[dtype]

    def update(a: Any, x: Any) -> Any:
        return 0.5 * (x + a / x)

    def ours(method: str, **options: Any) -> Callable[[], Callable[[Any], Any]]:
        # `throw=False` needs `return_info=True`; the info is dropped here, so such a
        # row measures the solve without its run-time convergence check.
        with_info = options.get("return_info", False)

        def build() -> Callable[[Any], Any]:
            def newton_sqrt(a):
                out = fixed_point(
                    update, a, a, method=method, rtol=tol, atol=tol, max_steps=MAX_STEPS, **options
                )
                return out[0] if with_info else out

            return newton_sqrt

        return build

    impls = [
        Impl(
            OURS,
            "ours",
            f"fixed_point(method='iterate', rtol=atol={tol:g}, max_steps={MAX_STEPS}), the "
            "defaults: check_every=None (a test every step here at a = 2.0, every 4 steps "
            "on the batch of 1e6) and adjoint=None (after 'iterate': the Neumann series, "
            "as adjoint='neumann')",
            ours("iterate"),
        ),
        Impl(
            "ours (iterate, check_every=1)",
            "ours",
            f"as ours (iterate), with a convergence test after every step, rtol=atol={tol:g}",
            ours("iterate", check_every=1),
        ),
        Impl(
            OURS_UNCHECKED,
            "ours",
            "as ours (iterate), without the run-time convergence checks (throw=False, "
            "return_info=True, the info discarded)",
            ours("iterate", throw=False, return_info=True),
        ),
        Impl(
            "ours (damped)",
            "ours",
            f"method='damped' (damping 0.5), rtol=atol={tol:g}",
            ours("damped"),
        ),
        Impl(
            "ours (anderson)",
            "ours",
            f"method='anderson' (history 5), rtol=atol={tol:g}",
            ours("anderson"),
        ),
        Impl(
            "hijax guide",
            "peer",
            f"the guide's FixedPoint VJPHiPrimitive, stop at |x_prev - x| <= {tol:g}",
            lambda: partial(_hijax_fixed_point, update, tol=tol),
        ),
        Impl(
            CUSTOM_VJP,
            "peer",
            f"jax.custom_vjp, forward and adjoint loops stop at |step| <= {tol:g}",
            lambda: _custom_vjp_newton_sqrt(update, tol),
        ),
    ]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import jaxopt

        def build_jaxopt() -> Callable[[Any], Any]:
            solver = jaxopt.FixedPointIteration(
                fixed_point_fun=lambda x, a: update(a, x),
                tol=tol,
                maxiter=MAX_STEPS,
                implicit_diff=True,
            )
            return lambda a: solver.run(a, a).params

        impls.append(
            Impl(
                "jaxopt",
                "peer",
                f"FixedPointIteration(tol={tol:g} on the 2-norm of the step, "
                f"maxiter={MAX_STEPS}, implicit_diff=True), its default linear solver",
                build_jaxopt,
            )
        )
    except ImportError:
        log("jaxopt is not installed (pip install -e '.[bench]'): its row is skipped")
    try:
        import optimistix as optx

        def build_optimistix() -> Callable[[Any], Any]:
            solver = optx.FixedPointIteration(rtol=tol, atol=tol)

            def newton_sqrt(a):
                fn = lambda y, args: update(args, y)
                return optx.fixed_point(fn, solver, a, args=a, max_steps=MAX_STEPS).value

            return newton_sqrt

        impls.append(
            Impl(
                "optimistix",
                "peer",
                f"fixed_point(FixedPointIteration(rtol=atol={tol:g}), max_steps={MAX_STEPS}), "
                "default ImplicitAdjoint and throw=True",
                build_optimistix,
            )
        )
    except ImportError:
        log("optimistix is not installed (pip install -e '.[bench]'): its row is skipped")

    def build_unrolled() -> Callable[[Any], Any]:
        return lambda a: lax.fori_loop(0, UNROLL_STEPS, lambda _, x: update(a, x), a)

    impls += [
        Impl(
            "unrolled",
            "peer",
            f"{UNROLL_STEPS} steps of lax.fori_loop, differentiated through",
            build_unrolled,
        ),
        Impl("jnp.sqrt", "floor", "jnp.sqrt", lambda: jnp.sqrt),
    ]
    return impls


def _hijax_fixed_point(f: Callable[[Any, Any], Any], a: Any, *, tol: float) -> Any:
    """`newton_sqrt` through the hijax guide's `FixedPoint` primitive."""
    return _hijax_guide()(f, a, a, tol)


_HIJAX: dict[str, Any] = {}


def _hijax_guide() -> Callable[..., Any]:
    """The hijax guide's example (its `FixedPoint` primitive, `fixed_point` and
    `rev_iter`), copied with two changes: the stopping tolerance is a parameter (the
    guide fixes 1e-6), and `batch_dim_rule` is added so that `vmap` works (as the
    guide's other examples do)."""
    if "fixed_point" in _HIJAX:
        return _HIJAX["fixed_point"]
    import jax
    import jax.numpy as jnp
    from jax import vjp
    from jax.experimental.hijax import VJPHiPrimitive
    from jax.lax import while_loop

    class FixedPoint(VJPHiPrimitive):
        def __init__(self, a_aval, x_aval, *, f, tol):
            self.in_avals = (a_aval, x_aval)
            self.out_aval = x_aval
            self.params = dict(f=f, tol=tol)
            super().__init__()

        def expand(self, a, x_guess):
            def cond_fun(carry):
                x_prev, x = carry
                return jnp.abs(x_prev - x) > self.tol

            def body_fun(carry):
                _, x = carry
                return x, self.f(a, x)

            _, x_star = while_loop(cond_fun, body_fun, (x_guess, self.f(a, x_guess)))
            return x_star

        def vjp_fwd(self, nzs_in, a, x_guess):
            x_star = self(a, x_guess)
            return x_star, (a, x_star)

        def vjp_bwd_retval(self, res, x_star_bar):
            a, x_star = res
            _, vjp_a = vjp(lambda a: self.f(a, x_star), a)
            (a_bar,) = vjp_a(
                fixed_point(
                    partial(rev_iter, self.f), (a, x_star, x_star_bar), x_star_bar, self.tol
                )
            )
            return a_bar, jnp.zeros_like(x_star)

        def batch_dim_rule(self, axis_data, in_dims):
            return 0

    def rev_iter(f, packed, u):
        a, x_star, x_star_bar = packed
        _, vjp_x = vjp(lambda x: f(a, x), x_star)
        return x_star_bar + vjp_x(u)[0]

    def fixed_point(f, a, x_guess, tol):
        a_aval = jax.tree.map(jax.typeof, a)
        x_aval = jax.tree.map(jax.typeof, x_guess)
        return FixedPoint(a_aval, x_aval, f=f, tol=tol)(a, x_guess)

    _HIJAX["fixed_point"] = fixed_point
    return fixed_point


def _custom_vjp_newton_sqrt(f: Callable[[Any, Any], Any], tol: float) -> Callable[[Any], Any]:
    """The guide's algorithm with `jax.custom_vjp`: a forward loop, and the adjoint
    `w = g + w A` (A = df/dx at the solution) found by the same loop."""
    import jax
    import jax.numpy as jnp
    from jax.lax import while_loop

    @partial(jax.custom_vjp, nondiff_argnums=(0,))
    def fixed_point(f, a, x_guess):
        def cond_fun(carry):
            x_prev, x = carry
            return jnp.abs(x_prev - x) > tol

        def body_fun(carry):
            _, x = carry
            return x, f(a, x)

        return while_loop(cond_fun, body_fun, (x_guess, f(a, x_guess)))[1]

    def fixed_point_fwd(f, a, x_guess):
        x_star = fixed_point(f, a, x_guess)
        return x_star, (a, x_star)

    def fixed_point_bwd(f, res, x_star_bar):
        a, x_star = res
        _, vjp_a = jax.vjp(lambda a: f(a, x_star), a)
        w = fixed_point(partial(_adjoint_step, f), (a, x_star, x_star_bar), x_star_bar)
        (a_bar,) = vjp_a(w)
        return a_bar, jnp.zeros_like(x_star)

    fixed_point.defvjp(fixed_point_fwd, fixed_point_bwd)
    return lambda a: fixed_point(f, a, a)


def _adjoint_step(f: Callable[[Any, Any], Any], packed: Any, u: Any) -> Any:
    """One step of the adjoint iteration `u -> g + u A`."""
    import jax

    a, x_star, g = packed
    _, vjp_x = jax.vjp(lambda x: f(a, x), x_star)
    return g + vjp_x(u)[0]


# ---------------------------------------------------------------------------
# The worker: one dtype, in its own process.


def _describe(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    text = next((ln for ln in reversed(lines) if "Error" in ln), lines[-1] if lines else "")
    return f"{type(e).__name__}: {text[:200]}"


def run_worker(dtype: str, mode: str) -> DtypeResult:
    import jax

    jax.config.update("jax_enable_x64", dtype == "float64")
    import jax.numpy as jnp

    start = time.perf_counter()
    s = SETTINGS[mode]
    np_dtype = np.dtype(dtype)
    impls = build_impls(dtype)
    rows = {impl.name: Row(impl.name, impl.kind, impl.settings) for impl in impls}
    alive = [impl.name for impl in impls]
    by_name = {impl.name: impl for impl in impls}
    a0 = jnp.asarray(A_POINT, np_dtype)
    batch = jnp.linspace(1.0, 100.0, BATCH, dtype=np_dtype)
    assert a0.dtype == np_dtype and batch.dtype == np_dtype, "the inputs are not in the dtype"

    def fail(name: str, e: BaseException) -> None:
        rows[name].error = _describe(e)
        alive.remove(name)
        log(f"      {name}: FAILED: {rows[name].error}")

    # Compile times of jit(grad), every implementation built afresh after clearing caches.
    log(f"[{dtype}] compile times of jit(grad) ({s['compile_reps']} fresh compiles each) ...")
    samples: dict[str, list[tuple[float, float]]] = {n: [] for n in alive}
    for rep in range(s["compile_reps"]):
        for name in rotated(list(alive), rep):
            try:
                jax.clear_caches()
                fn = jax.jit(jax.grad(by_name[name].build()))
                t0 = time.perf_counter()
                lowered = fn.trace(a0).lower()
                t1 = time.perf_counter()
                lowered.compile()
                t2 = time.perf_counter()
                samples[name].append((t1 - t0, t2 - t1))
            except Exception as e:  # record the failure in the table, keep going
                fail(name, e)
    for name in alive:
        rows[name].trace_lower_ms = 1e3 * statistics.median(x for x, _ in samples[name])
        rows[name].xla_compile_ms = 1e3 * statistics.median(y for _, y in samples[name])

    # Per-call times at a = 2.0.
    for tname in TRANSFORMS:
        transform = {
            "forward": lambda f: f,
            "grad": jax.grad,
            "grad(grad)": lambda f: jax.grad(jax.grad(f)),
        }[tname]
        log(
            f"[{dtype}] {tname} at a = {A_POINT}: {s['call_rounds']} rounds x "
            f"{s['call_block']} calls each ..."
        )
        fns = {}
        for name in list(alive):
            try:
                f = jax.jit(transform(by_name[name].build()))
                out = jax.block_until_ready(f(a0))
                if out.dtype != np_dtype:
                    raise TypeError(f"{tname} returned {out.dtype}, not {dtype}")
                for _ in range(20):
                    jax.block_until_ready(f(a0))
                fns[name] = f
            except Exception as e:
                fail(name, e)
        times = interleaved(fns, s["call_rounds"], s["call_block"], args=(a0,), warmup=False)
        for name, t in times.items():
            rows[name].per_call_us[tname] = 1e6 * t

    # The batch: jit(vmap(value_and_grad)) over 1e6 points, and its errors.
    log(f"[{dtype}] jit(vmap(value_and_grad)) over {BATCH:.0e} points: correctness ...")
    exact = np.sqrt(np.asarray(batch, np.float64))
    fns = {}
    for name in list(alive):
        try:
            f = jax.jit(jax.vmap(jax.value_and_grad(by_name[name].build())))
            value, grad = jax.block_until_ready(f(batch))
            if value.dtype != np_dtype or grad.dtype != np_dtype:
                raise TypeError(f"value_and_grad returned {value.dtype}/{grad.dtype}")
            row = rows[name]
            row.err_value = float(np.max(np.abs(np.asarray(value, np.float64) - exact)))
            row.err_grad = float(np.max(np.abs(np.asarray(grad, np.float64) - 0.5 / exact)))
            row.ok = bool(
                row.err_value <= ERROR_FACTOR * TOL[dtype] * exact.max()
                and row.err_grad <= ERROR_FACTOR * TOL[dtype] * (0.5 / exact).max()
            )
            del value, grad
            fns[name] = f
        except Exception as e:
            fail(name, e)
    log(f"[{dtype}] jit(vmap(value_and_grad)): {s['vmap_rounds']} rounds of one call each ...")
    times = interleaved(
        fns, s["vmap_rounds"], 1, budget=s["vmap_budget"], args=(batch,), warmup=False
    )
    for name, t in times.items():
        rows[name].vmap_ms = 1e3 * t
    return DtypeResult(dtype, TOL[dtype], list(rows.values()), time.perf_counter() - start)


# ---------------------------------------------------------------------------
# Report.


@dataclass
class Goals:
    call: dict[str, float | None]  # transform -> ours / custom_vjp
    vmap: float | None  # ours / best peer
    vmap_peer: str | None
    compile: float | None  # ours / best peer
    compile_peer: str | None

    @property
    def call_ok(self) -> bool:
        return all(r is not None and r <= CALL_GOAL for r in self.call.values())

    @property
    def vmap_ok(self) -> bool:
        return self.vmap is not None and self.vmap <= VMAP_GOAL

    @property
    def compile_ok(self) -> bool:
        return self.compile is not None and self.compile <= COMPILE_GOAL


def goals(result: DtypeResult) -> Goals:
    rows = {r.name: r for r in result.rows}
    ours, ref = rows.get(OURS), rows.get(CUSTOM_VJP)
    peers = [r for r in result.rows if r.kind == "peer"]
    call: dict[str, float | None] = {}
    for t in TRANSFORMS:
        mine = ours.per_call_us.get(t) if ours else None
        theirs = ref.per_call_us.get(t) if ref else None
        call[t] = mine / theirs if mine and theirs else None

    def versus(get: Callable[[Row], float | None]) -> tuple[float | None, str | None]:
        times = [(get(r), r.name) for r in peers if get(r) is not None]
        mine = get(ours) if ours else None
        if not times or mine is None:
            return None, None
        best, name = min(times)
        return mine / best, name

    vmap, vmap_peer = versus(lambda r: r.vmap_ms)
    comp, comp_peer = versus(lambda r: r.compile_ms)
    return Goals(call, vmap, vmap_peer, comp, comp_peer)


def render_dtype(result: DtypeResult) -> str:
    head = (
        "| implementation | forward (us) | grad (us) | grad(grad) (us) "
        "| vmap value_and_grad 1e6 (ms) | jit(grad) trace+lower (ms) | jit(grad) XLA compile (ms) "
        "| max err value | max err grad | correct |"
    )
    lines = [head, "|---|" + "---:|" * (head.count(" | ") - 1) + "---|"]
    for r in result.rows:
        if r.error and not r.per_call_us and r.vmap_ms is None:
            lines.append(f"| {r.name} | " + " | ".join(["error"] * 8) + " | no |")
            continue
        ok = "n/a" if r.ok is None else ("yes" if r.ok else "NO")
        lines.append(
            f"| {r.name} "
            + "".join(f"| {fmt(r.per_call_us.get(t))} " for t in TRANSFORMS)
            + f"| {fmt(r.vmap_ms)} | {fmt(r.trace_lower_ms)} | {fmt(r.xla_compile_ms)} "
            f"| {sci(r.err_value)} | {sci(r.err_grad)} | {ok} |"
        )
    g = goals(result)
    verdict = lambda ok: "PASS" if ok else "MISS"
    call = ", ".join(f"{t} {ratio(g.call[t])}" for t in TRANSFORMS)
    rows = {r.name: r for r in result.rows}
    ours = rows.get(OURS)
    goal_lines = [
        f"- (a) {OURS} per call vs {CUSTOM_VJP} (<= {CALL_GOAL}x): {call}: "
        f"**{verdict(g.call_ok)}**",
        f"- (b) {OURS} on the batched value_and_grad vs the best peer ({g.vmap_peer}, "
        f"{fmt(rows[g.vmap_peer].vmap_ms) if g.vmap_peer else 'n/a'} ms): "
        f"{fmt(ours.vmap_ms) if ours else 'n/a'} ms, {ratio(g.vmap)} "
        f"(<= {VMAP_GOAL}x): **{verdict(g.vmap_ok)}**",
        f"- (c) {OURS} jit(grad) compile (trace+lower+XLA) vs the best peer "
        f"({g.compile_peer}, {fmt(rows[g.compile_peer].compile_ms) if g.compile_peer else 'n/a'}"
        f" ms): {fmt(ours.compile_ms) if ours else 'n/a'} ms, {ratio(g.compile)} "
        f"(<= {COMPILE_GOAL}x): **{verdict(g.compile_ok)}**",
    ]
    unchecked, ref = rows.get(OURS_UNCHECKED), rows.get(CUSTOM_VJP)
    if unchecked and ref:
        ratios = ", ".join(
            f"{t} {ratio(div(unchecked.per_call_us.get(t), ref.per_call_us.get(t)))}"
            for t in TRANSFORMS
        )
        goal_lines.append(
            f"- For reference, per call without the run-time convergence checks "
            f"({OURS_UNCHECKED}) vs {CUSTOM_VJP}: {ratios}"
        )
    wrong = [r.name for r in result.rows if r.ok is False]
    if wrong:
        goal_lines.append(f"- Results outside the tolerance: {', '.join(wrong)}")
    failed = [f"{r.name}: {r.error}" for r in result.rows if r.error]
    settings = [f"- {r.name}: {r.settings}" for r in result.rows]
    return "\n".join(
        [
            f"### {result.dtype} (tol {result.tol:g}; worker took {result.wall_s:.0f} s)",
            "",
            *lines,
            "",
            "Goals:",
            "",
            *goal_lines,
            *(["", "Failures:", ""] + [f"- {x}" for x in failed] if failed else []),
            "",
            "Settings:",
            "",
            *settings,
            "",
        ]
    )


def render(results: list[DtypeResult], mode: str, wall: float, load: tuple[float, float]) -> str:
    import jax

    env = (
        f"jax {jax.__version__}, backend {jax.default_backend()}, {cpus()}, "
        f"Python {platform.python_version()}; {peer_versions()}; mode --{mode}; run took "
        f"{wall:.0f} s; load average {load[0]:.1f} at the start, {load[1]:.1f} at the end."
    )
    method = (
        f"`newton_sqrt(a)` is the fixed point of `f(a, x) = 0.5 (x + a / x)` from `x = a`. "
        f"Per call: median of single calls of the jitted function at a = {A_POINT} with "
        "`block_until_ready`, implementations interleaved. vmap: "
        f"`jit(vmap(value_and_grad(newton_sqrt)))` over `linspace(1, 100, {BATCH:.0e})`, "
        "median of calls, interleaved. Compile: `jax.jit(jax.grad(newton_sqrt))`, "
        "`.trace(a).lower()` and `.compile()` timed separately, median of fresh compiles "
        "after `jax.clear_caches()`. Errors: max |value - sqrt(a)| and "
        "max |grad - 0.5/sqrt(a)| over the batch (exact values in float64), correct when "
        f"<= {ERROR_FACTOR:g} x tol x max |exact|. Each dtype runs in its own process."
    )
    parts = ["## Newton's square root: fixed point and implicit derivatives", "", env, ""]
    for res in results:
        parts += [render_dtype(res)]
    parts += [method, ""]
    return "\n".join(parts)


def plot(results: list[DtypeResult], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed (pip install -e '.[bench]'); no chart written")
        return False
    colors = {"ours": "tab:green", "peer": "tab:blue", "floor": "tab:gray"}
    panels = [
        ("grad per call (us)", lambda r: r.per_call_us.get("grad")),
        ("vmap value_and_grad, 1e6 points (ms)", lambda r: r.vmap_ms),
        ("jit(grad) compile (ms)", lambda r: r.compile_ms),
    ]
    fig, axes = plt.subplots(
        len(results), len(panels), figsize=(15, 3.2 * len(results) + 0.6), squeeze=False
    )
    for i, res in enumerate(results):
        names = [r.name for r in res.rows]
        y = np.arange(len(names))
        for j, (title, get) in enumerate(panels):
            ax = axes[i][j]
            vals = [get(r) or float("nan") for r in res.rows]
            # A log scale: the rows span three orders of magnitude (Anderson's batch).
            base = 0.5 * min((v for v in vals if v == v), default=1.0)
            ax.barh(
                y, [v - base for v in vals], left=base, color=[colors[r.kind] for r in res.rows]
            )
            ax.set_xscale("log")
            for yi, v in zip(y, vals):
                if v == v:
                    ax.text(v, yi, f" {v:.3g}", va="center", fontsize=7)
            ax.set_yticks(y, names if j == 0 else [""] * len(names), fontsize=8)
            ax.invert_yaxis()
            ax.set_xlim(base, 4 * max((v for v in vals if v == v), default=1.0))
            ax.set_title(f"{res.dtype}: {title}", fontsize=9)
    fig.suptitle(
        "Newton's square root as a fixed point: ours (green), peers (blue), jnp.sqrt (grey); "
        "log scales"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ---------------------------------------------------------------------------


def _failed(results: list[DtypeResult]) -> bool:
    verdicts = [goals(r) for r in results]
    missed = not all(v.call_ok and v.vmap_ok and v.compile_ok for v in verdicts)
    wrong = any(row.ok is False or row.error for r in results for row in r.rows)
    return missed or wrong


def _load(d: dict[str, Any]) -> DtypeResult:
    return DtypeResult(**dict(d, rows=[Row(**r) for r in d["rows"]]))


def main(argv: list[str] | None = None) -> int:
    return run_main(
        "newton_sqrt",
        argv,
        description=__doc__.splitlines()[0],
        dtypes=DTYPES,
        quick_help="fewer repeats: about a minute on 2 CPU cores",
        check_help="exit with status 1 when a goal is missed or a result is outside the tolerance",
        run_worker=run_worker,
        load=_load,
        render=render,
        plot=plot,
        failed=_failed,
    )


if __name__ == "__main__":
    raise SystemExit(main())
