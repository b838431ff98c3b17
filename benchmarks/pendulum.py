"""The damped pendulum: `solvers.odeint` against JAX's odeint, diffrax and SciPy.

The problem, from JAX's own odeint benchmark: the damped pendulum

    d/dt [theta, omega] = [omega, -m omega - g sin(theta)],
    y0 = [pi - 0.1, 0],  ts = linspace(0, 10, 101),  m = 0.25,  g = 9.8,

a plain array state `y` of shape (2,), solved at `rtol = atol = 1.4e-8` in float64
and at `rtol = atol = 1e-6` in float32 (1.4e-8 is below float32's resolution, about
6e-8 relative, so an adaptive solver cannot meet it there). Every implementation
returns `ys` of shape (101, 2), the solution at every `ts`:

* ours: `solvers.odeint(func, y0, ts, m, g, rtol=, atol=, method=, adjoint=)` with
  `method` in (dopri5, tsit5) x `adjoint` in (backsolve, checkpoint), and kvaerno5
  (stiff ESDIRK) with checkpoint. The default is dopri5/backsolve;
* jax odeint: `jax.experimental.ode.odeint` (Dormand-Prince 5(4), continuous adjoint
  integrated backwards);
* diffrax: `diffeqsolve` with `Dopri5` and `Tsit5`, each with
  `RecursiveCheckpointAdjoint` and `BacksolveAdjoint`; `PIDController(rtol, atol)`,
  `SaveAt(ts=ts)`, `dt0=None`, `max_steps=16**4`;
* scipy: `scipy.integrate.solve_ivp(method="RK45")` and `scipy.integrate.odeint`
  (LSODA), forward only, in float64 on the host (they are in the float64 table only).

For each dtype (each in its own Python process, so that `jax_enable_x64` is set before
anything is traced) the script measures, per implementation, from one run:

* forward: the median time of one call of the jitted `ys = solve(y0, m, g)` with
  `block_until_ready`, after warm-up, implementations taking turns;
* grad: `jit(grad(lambda y0, m, g: sum(solve(y0, m, g)), argnums=(0, 1, 2)))`;
* vmap: `jit(vmap(value_and_grad(...)))` over 256 initial angles
  `theta0 = linspace(pi - 0.5, pi - 0.05, 256)` (omega0 = 0), m and g shared;
* jacfwd: `jit(jacfwd(ys w.r.t. (m, g)))`, and hessian: `jit(hessian(sum(ys) w.r.t.
  (m, g)))`, where the implementation supports them; otherwise the cell says
  `n/a` and why (the error JAX raised, shortened);
* the compile time of the jit(grad): trace+lower and XLA compile separately
  (`jax.jit(f).trace(...).lower()`, then `.compile()`), the median of fresh compiles
  after `jax.clear_caches()`;
* RHS evaluations: counted with a `jax.debug.callback` in the vector field (in a
  separate, untimed copy of the forward and the grad), so every implementation is
  counted the same way; the grad count includes the evaluations of the backward pass
  (each VJP of the vector field evaluates it once). Accepted/rejected steps come from
  the solver where it reports them (ours: `return_info=True`; diffrax:
  `sol.stats`; scipy: `nfev`/`nfe`);
* the error at t = 10: max |ys[-1] - ref| over (theta, omega), the reference from
  `solve_ivp(method="DOP853", rtol=atol=1e-13)` in float64.

Below each table it prints the goals with the measured ratios (PASS/MISS): ours
(dopri5/backsolve, and the best of ours) (a) forward no slower than JAX's odeint,
(b) grad at most 0.7x JAX's odeint, (c) vmap value_and_grad at most 0.3x the best
JAX peer, (d) jit(grad) compile (trace+lower+XLA) no more than JAX's odeint, (e) the
error at t = 10 at most 10x JAX's odeint's (or below the tolerance), (f) jacfwd and
hessian filled for every row of ours. The report goes to stdout and
`results/pendulum.md`, the plots to `results/pendulum.png`, progress to stderr.

Usage::

    python -m benchmarks.pendulum --quick    # under ~2 minutes on 2 CPU cores
    python -m benchmarks.pendulum            # more repeats
    python -m benchmarks.pendulum --full     # more still
    taskset -c 1 python -m benchmarks.pendulum --dtypes float64 --check
"""

from __future__ import annotations

import math
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
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
TOL = {"float32": 1e-6, "float64": 1.4e-8}
M, G = 0.25, 9.8
Y0 = (math.pi - 0.1, 0.0)
T_END, N_T = 10.0, 101
BATCH = 256
THETA_LO, THETA_HI = math.pi - 0.5, math.pi - 0.05
MAX_STEPS = 16**4  # diffrax's max_steps (ours keeps its default, 4096)
REF_TOL = 1e-13

FORWARD_GOAL = 1.0  # ours / jax odeint, at most
GRAD_GOAL = 0.7  # ours / jax odeint, at most
VMAP_GOAL = 0.3  # ours / best JAX peer, at most
COMPILE_GOAL = 1.0  # ours / jax odeint, at most
ERROR_GOAL = 10.0  # ours / jax odeint error at t = 10, at most (or below tol)

OURS = "ours (dopri5, backsolve)"
JAX_ODEINT = "jax odeint"
# --quick runs fewer rows (every row of ours in float64, for goal (f)).
QUICK_ROWS = {
    "float32": (OURS, JAX_ODEINT, "diffrax (dopri5, backsolve)"),
    "float64": (
        OURS,
        "ours (dopri5, checkpoint)",
        "ours (tsit5, backsolve)",
        "ours (tsit5, checkpoint)",
        "ours (kvaerno5, checkpoint)",
        JAX_ODEINT,
        "diffrax (dopri5, backsolve)",
        "scipy solve_ivp (RK45)",
    ),
}
QUICK_SKIP = {("ours (kvaerno5, checkpoint)", "vmap")}  # seconds per call: not in --quick
MEASURES = ("forward", "grad", "vmap", "jacfwd", "hessian")
UNITS = {"forward": "ms", "grad": "ms", "vmap": "ms", "jacfwd": "ms", "hessian": "ms"}

SETTINGS: dict[str, dict[str, Any]] = {
    # rounds x block calls per implementation and measure, implementations taking
    # turns; an implementation whose calls of one measure have taken `budget` seconds
    # is called no more; compile_reps fresh compiles of jit(grad).
    # --quick also skips the RHS counting copies and runs the rows in QUICK_ROWS only.
    "quick": dict(rounds=5, block=2, budget=0.5, compile_reps=1, count=False),
    "default": dict(rounds=15, block=5, budget=5.0, compile_reps=3, count=True),
    "full": dict(rounds=40, block=10, budget=20.0, compile_reps=5, count=True),
}


# ---------------------------------------------------------------------------
# Results, shared by the worker (which fills them) and the parent (which renders them).


@dataclass
class Row:
    name: str
    kind: str  # "ours", "peer" (JAX) or "host" (SciPy)
    settings: str
    times_ms: dict[str, float] = field(default_factory=dict)  # measure -> median ms
    notes: dict[str, str] = field(default_factory=dict)  # measure -> why there is no time
    trace_lower_ms: float | None = None
    xla_compile_ms: float | None = None
    steps: str | None = None  # "accepted/rejected" as the solver reports them
    fevals_forward: int | None = None
    fevals_grad: int | None = None
    err_t10: float | None = None
    errors: list[str] = field(default_factory=list)  # failures, in full

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
    trajectories: dict[str, list[list[float]]] = field(default_factory=dict)


def reference() -> np.ndarray:
    """The reference solution at `ts`, float64: DOP853 at rtol = atol = 1e-13."""
    from scipy.integrate import solve_ivp

    ts = np.linspace(0.0, T_END, N_T)
    sol = solve_ivp(
        lambda t, y: [y[1], -M * y[1] - G * np.sin(y[0])],
        (0.0, T_END),
        np.array(Y0),
        method="DOP853",
        t_eval=ts,
        rtol=REF_TOL,
        atol=REF_TOL,
    )
    assert sol.success, sol.message
    return sol.y.T


# ---------------------------------------------------------------------------
# The implementations. Everything JAX is imported inside the worker, after the dtype
# flag is set. `make(func)` returns a fresh `solve(y0, m, g) -> ys` with the vector
# field `func(y, t, m, g)` (fresh closures, so compile timings hit no cache; the
# counting copy passes a vector field with a callback in it). `info(y0, m, g)`, where
# given, returns the solver's own step counts as a string.


@dataclass(frozen=True)
class Impl:
    name: str
    kind: str
    settings: str
    make: Callable[[Callable[..., Any]], Callable[..., Any]]
    info: Callable[[], Callable[..., Any]] | None = None
    host: bool = False  # NumPy in, NumPy out: forward only


def rhs(y: Any, t: Any, m: Any, g: Any) -> Any:
    import jax.numpy as jnp

    return jnp.stack([y[1], -m * y[1] - g * jnp.sin(y[0])])


def build_impls(dtype: str) -> tuple[list[Impl], list[str]]:
    """The implementations, and a line per one that could not be set up."""
    import jax.numpy as jnp

    tol = TOL[dtype]
    ts = jnp.linspace(0.0, T_END, N_T, dtype=dtype)
    impls: list[Impl] = []
    missing: list[str] = []

    # Ours, robust to `solvers.odeint` being absent or broken: the rows stay, their
    # cells show the error.
    try:
        from solvers import odeint as ours_odeint
    except Exception as e:  # ImportError, or anything its import raises
        ours_odeint = None
        ours_import_error = _describe(e)
    ours_cases = [
        ("dopri5", "backsolve"),
        ("dopri5", "checkpoint"),
        ("tsit5", "backsolve"),
        ("tsit5", "checkpoint"),
        ("kvaerno5", "checkpoint"),
    ]
    for method, adjoint in ours_cases:

        def make(func, method=method, adjoint=adjoint):
            if ours_odeint is None:
                raise ImportError(ours_import_error)

            def solve(y0, m, g):
                return ours_odeint(
                    func, y0, ts, m, g, rtol=tol, atol=tol, method=method, adjoint=adjoint
                )

            return solve

        def info(method=method, adjoint=adjoint):
            if ours_odeint is None:
                raise ImportError(ours_import_error)

            def steps(y0, m, g):
                _, i = ours_odeint(
                    rhs,
                    y0,
                    ts,
                    m,
                    g,
                    rtol=tol,
                    atol=tol,
                    method=method,
                    adjoint=adjoint,
                    return_info=True,
                )
                return i.steps, i.rejected

            return steps

        impls.append(
            Impl(
                f"ours ({method}, {adjoint})",
                "ours",
                f"solvers.odeint(method={method!r}, adjoint={adjoint!r}, rtol=atol={tol:g}), "
                "max_steps=4096 (its default; 16**4 makes the checkpoint vmap ~16x slower)"
                + (", the defaults" if (method, adjoint) == ("dopri5", "backsolve") else ""),
                make,
                info,
            )
        )

    from jax.experimental.ode import odeint as jax_odeint

    def make_jax(func):
        return lambda y0, m, g: jax_odeint(func, y0, ts, m, g, rtol=tol, atol=tol)

    impls.append(
        Impl(
            JAX_ODEINT,
            "peer",
            f"jax.experimental.ode.odeint(rtol=atol={tol:g}), mxstep=inf (its default)",
            make_jax,
        )
    )

    try:
        import diffrax as dfx

        for solver_name in ("Dopri5", "Tsit5"):
            for adj_name in ("RecursiveCheckpointAdjoint", "BacksolveAdjoint"):

                def options(solver_name=solver_name, adj_name=adj_name):
                    return dict(
                        solver=getattr(dfx, solver_name)(),
                        t0=ts[0],
                        t1=ts[-1],
                        dt0=None,
                        saveat=dfx.SaveAt(ts=ts),
                        stepsize_controller=dfx.PIDController(rtol=tol, atol=tol),
                        max_steps=MAX_STEPS,
                        adjoint=getattr(dfx, adj_name)(),
                    )

                def make_dfx(func, options=options):
                    term = dfx.ODETerm(lambda t, y, args: func(y, t, *args))
                    return lambda y0, m, g: (
                        dfx.diffeqsolve(term, y0=y0, args=(m, g), **options()).ys
                    )

                def info_dfx(options=options):
                    term = dfx.ODETerm(lambda t, y, args: rhs(y, t, *args))

                    def steps(y0, m, g):
                        sol = dfx.diffeqsolve(term, y0=y0, args=(m, g), **options())
                        return sol.stats["num_accepted_steps"], sol.stats["num_rejected_steps"]

                    return steps

                short = "checkpoint" if adj_name.startswith("Recursive") else "backsolve"
                impls.append(
                    Impl(
                        f"diffrax ({solver_name.lower()}, {short})",
                        "peer",
                        f"diffeqsolve({solver_name}(), PIDController(rtol=atol={tol:g}), "
                        f"SaveAt(ts=ts), dt0=None, max_steps={MAX_STEPS}, {adj_name}())",
                        make_dfx,
                        info_dfx,
                    )
                )
    except ImportError:
        missing.append("diffrax is not installed (pip install diffrax): its rows are skipped")

    if dtype == "float64":
        try:
            import scipy.integrate as si

            def make_ivp(func):
                def solve(y0, m, g):
                    sol = si.solve_ivp(
                        lambda t, y: [y[1], -m * y[1] - g * np.sin(y[0])],
                        (0.0, T_END),
                        y0,
                        method="RK45",
                        t_eval=np.linspace(0.0, T_END, N_T),
                        rtol=tol,
                        atol=tol,
                    )
                    solve.nfev = sol.nfev  # type: ignore[attr-defined]
                    return sol.y.T

                return solve

            def make_lsoda(func):
                def solve(y0, m, g):
                    ys, out = si.odeint(
                        lambda y, t: [y[1], -m * y[1] - g * np.sin(y[0])],
                        y0,
                        np.linspace(0.0, T_END, N_T),
                        rtol=tol,
                        atol=tol,
                        full_output=True,
                    )
                    solve.nfev = int(out["nfe"][-1])  # type: ignore[attr-defined]
                    solve.steps = int(out["nst"][-1])  # type: ignore[attr-defined]
                    return ys

                return solve

            impls += [
                Impl(
                    "scipy solve_ivp (RK45)",
                    "host",
                    f"scipy.integrate.solve_ivp(method='RK45', rtol=atol={tol:g}, t_eval=ts), "
                    "NumPy on the host, forward only",
                    make_ivp,
                    host=True,
                ),
                Impl(
                    "scipy odeint (LSODA)",
                    "host",
                    f"scipy.integrate.odeint(rtol=atol={tol:g}), NumPy on the host, forward only",
                    make_lsoda,
                    host=True,
                ),
            ]
        except ImportError:
            missing.append("scipy is not installed: its rows are skipped")
    return impls, missing


# ---------------------------------------------------------------------------
# The worker: one dtype, in its own process.


def _describe(e: BaseException, limit: int = 200) -> str:
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    text = next((ln for ln in lines if "Error" in ln or "error" in ln), lines[0] if lines else "")
    return f"{type(e).__name__}: {text[:limit]}"


def run_worker(dtype: str, mode: str) -> DtypeResult:
    import jax

    jax.config.update("jax_enable_x64", dtype == "float64")
    import jax.numpy as jnp

    start = time.perf_counter()
    s = SETTINGS[mode]
    np_dtype = np.dtype(dtype)
    impls, missing = build_impls(dtype)
    if mode == "quick":
        impls = [impl for impl in impls if impl.name in QUICK_ROWS[dtype]]
        log(f"--quick: {dtype} runs {', '.join(impl.name for impl in impls)} only")
    rows = {impl.name: Row(impl.name, impl.kind, impl.settings) for impl in impls}
    if mode == "quick":
        for name, measure in QUICK_SKIP:
            if name in rows:
                rows[name].notes[measure] = "n/a (skipped in --quick: slow)"
    for line in missing:
        log(line)
    by_name = {impl.name: impl for impl in impls}
    jax_names = [impl.name for impl in impls if not impl.host]
    host_names = [impl.name for impl in impls if impl.host]

    y0 = jnp.asarray(Y0, np_dtype)
    m, g = jnp.asarray(M, np_dtype), jnp.asarray(G, np_dtype)
    mg = jnp.stack([m, g])
    y0s = jnp.stack(
        [jnp.linspace(THETA_LO, THETA_HI, BATCH, dtype=np_dtype), jnp.zeros(BATCH, np_dtype)],
        axis=1,
    )
    assert y0.dtype == np_dtype and y0s.dtype == np_dtype, "the inputs are not in the dtype"
    ref = reference()

    def stamp() -> str:
        return f"[{dtype} {time.perf_counter() - start:5.0f} s]"

    def fail(name: str, measure: str, e: BaseException) -> None:
        text = _describe(e)
        rows[name].notes[measure] = text
        rows[name].errors.append(f"{measure}: {text}")
        log(f"      {name} / {measure}: FAILED: {text}")

    def loss(solve):
        return lambda y0, m, g: jnp.sum(solve(y0, m, g))

    def transforms(solve) -> dict[str, tuple[Callable[..., Any], tuple[Any, ...]]]:
        return {
            "forward": (jax.jit(solve), (y0, m, g)),
            "grad": (jax.jit(jax.grad(loss(solve), argnums=(0, 1, 2))), (y0, m, g)),
            "vmap": (
                jax.jit(
                    jax.vmap(
                        jax.value_and_grad(loss(solve), argnums=(0, 1, 2)), in_axes=(0, None, None)
                    )
                ),
                (y0s, m, g),
            ),
            "jacfwd": (jax.jit(jax.jacfwd(lambda p: solve(y0, p[0], p[1]))), (mg,)),
            "hessian": (jax.jit(jax.hessian(lambda p: loss(solve)(y0, p[0], p[1]))), (mg,)),
        }

    trajectories: dict[str, list[list[float]]] = {}  # for the plot

    # Per-call functions, built once (a failure here, e.g. `solvers.odeint` missing,
    # fills every cell of the row).
    fresh = {}
    for name in jax_names:
        try:
            fresh[name] = transforms(by_name[name].make(rhs))
        except Exception as e:  # e.g. `solvers.odeint` missing: every cell says so
            text = _describe(e)
            rows[name].errors.append(f"setup: {text}")
            for measure in (*MEASURES, "counts"):
                rows[name].notes.setdefault(measure, text)

    # Compile times of jit(grad), every implementation built afresh after clearing
    # caches; the last compiled executable is kept for the grad timings.
    log(f"{stamp()} compile times of jit(grad) ({s['compile_reps']} fresh compiles each) ...")
    samples: dict[str, list[tuple[float, float]]] = {n: [] for n in jax_names}
    compiled: dict[str, Any] = {}
    for rep in range(s["compile_reps"]):
        for name in rotated(list(samples), rep):
            if "grad" in rows[name].notes:
                continue
            try:
                jax.clear_caches()
                fn = jax.jit(jax.grad(loss(by_name[name].make(rhs)), argnums=(0, 1, 2)))
                t0 = time.perf_counter()
                lowered = fn.trace(y0, m, g).lower()
                t1 = time.perf_counter()
                compiled[name] = lowered.compile()
                t2 = time.perf_counter()
                samples[name].append((t1 - t0, t2 - t1))
            except Exception as e:  # record the failure in the table, keep going
                fail(name, "grad", e)
    for name, xs in samples.items():
        if xs:
            rows[name].trace_lower_ms = 1e3 * statistics.median(x for x, _ in xs)
            rows[name].xla_compile_ms = 1e3 * statistics.median(y for _, y in xs)

    # Per-call times, one measure at a time, implementations interleaved.
    for measure in MEASURES:
        log(
            f"{stamp()} {measure}: compile and warm up, then {s['rounds']} rounds x "
            f"{s['block']} calls each ..."
        )
        fns: dict[str, Callable[[], Any]] = {}
        for name in jax_names:
            if measure in rows[name].notes:
                continue
            try:
                if measure == "grad" and name in compiled:
                    f, args = compiled[name], (y0, m, g)
                else:
                    f, args = fresh[name][measure]
                out = jax.block_until_ready(f(*args))
                bad = [x.dtype for x in jax.tree.leaves(out) if x.dtype != np_dtype]
                if bad:
                    raise TypeError(f"{measure} returned {bad[0]}, not {dtype}")
                if not all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(out)):
                    raise FloatingPointError(f"{measure} returned non-finite values")
                if measure == "forward":
                    rows[name].err_t10 = _err_t10(out, ref)
                    if name in (OURS, JAX_ODEINT):
                        trajectories[name] = np.asarray(out, np.float64).tolist()
                t0 = time.perf_counter()
                jax.block_until_ready(f(*args))
                warm = time.perf_counter() - t0
                if warm > s["budget"]:  # too slow to repeat: the warm-up call is the sample
                    rows[name].times_ms[measure] = 1e3 * warm
                    log(f"      {name} / {measure}: {warm:.1f} s per call, timed once")
                    continue
                fns[name] = lambda f=f, args=args: f(*args)
            except Exception as e:
                fail(name, measure, e)
        if measure == "forward":
            for name in host_names:
                try:
                    f = by_name[name].make(None)
                    args = (np.asarray(Y0, np.float64), M, G)
                    out = f(*args)
                    rows[name].err_t10 = _err_t10(out, ref)
                    rows[name].fevals_forward = int(f.nfev)
                    if hasattr(f, "steps"):
                        rows[name].steps = f"{f.steps}/n/a"
                    fns[name] = lambda f=f, args=args: f(*args)
                except Exception as e:
                    fail(name, measure, e)
        times = interleaved(fns, s["rounds"], s["block"], budget=s["budget"])
        for name, t in times.items():
            rows[name].times_ms[measure] = 1e3 * t
    for name in host_names:
        for measure in MEASURES[1:]:
            rows[name].notes[measure] = "n/a (host NumPy)"

    # Step counts from the solvers, and RHS evaluations counted with a callback.
    log(f"{stamp()} step counts, and RHS evaluations counted by a callback ...")
    count = [0]

    def bump() -> None:
        count[0] += 1

    def counted(y, t, m, g):
        jax.debug.callback(bump)
        return rhs(y, t, m, g)

    for name in jax_names:
        impl, row = by_name[name], rows[name]
        if "forward" in row.notes:
            continue
        try:
            if impl.info is not None:
                acc, rej = jax.jit(impl.info())(y0, m, g)
                row.steps = f"{int(acc)}/{int(rej)}"
            if not s["count"]:
                continue
            solve = impl.make(counted)
            count[0] = 0
            jax.block_until_ready(jax.jit(solve)(y0, m, g))
            jax.effects_barrier()
            row.fevals_forward = count[0]
            if "grad" not in row.notes:
                count[0] = 0
                jax.block_until_ready(jax.jit(jax.grad(loss(solve), argnums=(0, 1, 2)))(y0, m, g))
                jax.effects_barrier()
                row.fevals_grad = count[0]
        except Exception as e:
            fail(name, "counts", e)
    return DtypeResult(
        dtype, TOL[dtype], list(rows.values()), time.perf_counter() - start, trajectories
    )


def _err_t10(ys: Any, ref: np.ndarray) -> float:
    ys = np.asarray(ys, np.float64)
    if ys.shape != ref.shape:
        raise ValueError(f"ys has shape {ys.shape}, expected {ref.shape}")
    return float(np.max(np.abs(ys[-1] - ref[-1])))


# ---------------------------------------------------------------------------
# Report.


@dataclass
class Goal:
    text: str
    ok: bool


def goals(result: DtypeResult) -> list[Goal]:
    rows = {r.name: r for r in result.rows}
    ours_rows = [r for r in result.rows if r.kind == "ours"]
    jax_row = rows.get(JAX_ODEINT)
    peers = [r for r in result.rows if r.kind == "peer"]
    out: list[Goal] = []

    def best_of_ours(get: Callable[[Row], float | None]) -> tuple[float | None, str | None]:
        vals = [(get(r), r.name) for r in ours_rows if get(r) is not None]
        return min(vals) if vals else (None, None)

    def compare(label, get, ref_value, ref_name, limit, unit="ms"):
        mine = get(rows[OURS]) if OURS in rows else None
        best, best_name = best_of_ours(get)
        r_def, r_best = div(mine, ref_value), div(best, ref_value)
        ok = r_def is not None and r_def <= limit
        ok_best = r_best is not None and r_best <= limit
        out.append(
            Goal(
                f"{label}: {OURS} {fmt(mine)} {unit} vs {ref_name} {fmt(ref_value)} {unit}: "
                f"{ratio(r_def)} (<= {limit}x): **{_verdict(ok)}**; best of ours "
                f"({best_name or 'n/a'}) {ratio(r_best)}: **{_verdict(ok_best)}**",
                ok,
            )
        )

    jt = jax_row.times_ms if jax_row else {}
    compare(
        "(a) forward",
        lambda r: r.times_ms.get("forward"),
        jt.get("forward"),
        JAX_ODEINT,
        FORWARD_GOAL,
    )
    compare("(b) grad", lambda r: r.times_ms.get("grad"), jt.get("grad"), JAX_ODEINT, GRAD_GOAL)
    vmap_peers = [(r.times_ms["vmap"], r.name) for r in peers if "vmap" in r.times_ms]
    best_vmap, best_vmap_name = min(vmap_peers) if vmap_peers else (None, "no peer")
    compare(
        "(c) vmap value_and_grad over 256",
        lambda r: r.times_ms.get("vmap"),
        best_vmap,
        f"the best peer ({best_vmap_name})",
        VMAP_GOAL,
    )
    compare(
        "(d) jit(grad) compile (trace+lower+XLA)",
        lambda r: r.compile_ms,
        jax_row.compile_ms if jax_row else None,
        JAX_ODEINT,
        COMPILE_GOAL,
    )

    # (e) the error at t = 10: within ERROR_GOAL x JAX's, or below the tolerance.
    mine = rows[OURS].err_t10 if OURS in rows else None
    theirs = jax_row.err_t10 if jax_row else None
    ok = mine is not None and (
        mine <= result.tol or (theirs is not None and mine <= ERROR_GOAL * theirs)
    )
    out.append(
        Goal(
            f"(e) error at t = 10: {OURS} {sci(mine)} vs {JAX_ODEINT} {sci(theirs)} "
            f"({ratio(div(mine, theirs))}; <= {ERROR_GOAL:g}x, or <= tol {result.tol:g}): "
            f"**{_verdict(ok)}**; ours by row: "
            + ", ".join(f"{r.name.removeprefix('ours ')} {sci(r.err_t10)}" for r in ours_rows),
            ok,
        )
    )
    missing = [
        f"{r.name} {t}" for r in ours_rows for t in ("jacfwd", "hessian") if t not in r.times_ms
    ]
    ok = bool(ours_rows) and not missing
    out.append(
        Goal(
            "(f) jacfwd and hessian filled for every row of ours: "
            + (f"missing {', '.join(missing)}" if missing else "all filled")
            + f": **{_verdict(ok)}**",
            ok,
        )
    )
    return out


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def _cell(row: Row, measure: str) -> str:
    if measure in row.times_ms:
        return fmt(row.times_ms[measure])
    note = row.notes.get(measure)
    if note is None:
        return "n/a"
    if note.startswith("n/a"):
        return note
    if "forward-mode autodiff (jvp) to a custom_vjp" in note:
        return "n/a (custom_vjp: no forward mode)"
    note = note.replace("|", "/")
    return "error (" + note[:60] + ("..." if len(note) > 60 else "") + ")"


def render_dtype(result: DtypeResult) -> str:
    head = (
        "| implementation | forward (ms) | grad (ms) | vmap value_and_grad 256 (ms) "
        "| jacfwd (m, g) (ms) | hessian (m, g) (ms) | jit(grad) trace+lower (ms) "
        "| jit(grad) XLA compile (ms) | steps acc/rej | RHS evals forward | RHS evals grad "
        "| error at t=10 |"
    )
    lines = [head, "|---|" + "---:|" * (head.count(" | ") - 1) + "---:|"]
    for r in result.rows:
        lines.append(
            f"| {r.name} "
            + "".join(f"| {_cell(r, t)} " for t in MEASURES)
            + f"| {fmt(r.trace_lower_ms)} | {fmt(r.xla_compile_ms)} | {r.steps or 'n/a'} "
            f"| {r.fevals_forward if r.fevals_forward is not None else 'n/a'} "
            f"| {r.fevals_grad if r.fevals_grad is not None else 'n/a'} | {sci(r.err_t10)} |"
        )
    failed = [f"{r.name}: {e}" for r in result.rows for e in r.errors]
    settings = [f"- {r.name}: {r.settings}" for r in result.rows]
    return "\n".join(
        [
            f"### {result.dtype} (rtol = atol = {result.tol:g}; worker took {result.wall_s:.0f} s)",
            "",
            *lines,
            "",
            "Goals:",
            "",
            *[f"- {goal.text}" for goal in goals(result)],
            *(
                ["", "Failures (n/a cells, in full):", ""] + [f"- {x}" for x in failed]
                if failed
                else []
            ),
            "",
            "Settings:",
            "",
            *settings,
            "",
        ]
    )


def render(results: list[DtypeResult], mode: str, wall: float, load: tuple[float, float]) -> str:
    import jax

    try:
        import importlib.metadata as md

        dfx = f"diffrax {md.version('diffrax')}, scipy {md.version('scipy')}"
    except Exception:
        dfx = "diffrax/scipy: version unknown"
    env = (
        f"jax {jax.__version__}, backend {jax.default_backend()}, {cpus()}, "
        f"Python {platform.python_version()}; {dfx}; {peer_versions()}; mode --{mode}; run "
        f"took {wall:.0f} s; load average {load[0]:.1f} at the start, {load[1]:.1f} at the end."
    )
    method = (
        f"Problem: d/dt [theta, omega] = [omega, -m omega - g sin(theta)], y0 = [pi - 0.1, 0], "
        f"ts = linspace(0, {T_END:g}, {N_T}), m = {M}, g = {G}; float64 at rtol = atol = "
        f"{TOL['float64']:g}, float32 at rtol = atol = {TOL['float32']:g} (1.4e-8 is below "
        "float32 resolution). Times: median of single calls of the jitted function with "
        "`block_until_ready`, after warm-up, implementations interleaved (SciPy: host time "
        "of one call). grad: of sum(ys) w.r.t. (y0, m, g). vmap: "
        f"`jit(vmap(value_and_grad(sum(ys))))` over {BATCH} initial angles theta0 = "
        "linspace(pi - 0.5, pi - 0.05) with omega0 = 0. jacfwd: of ys w.r.t. (m, g); hessian: "
        "of sum(ys) w.r.t. (m, g) (`jax.hessian`, forward over reverse). Compile: "
        "`jax.jit(jax.grad(...))`, `.trace(...).lower()` and `.compile()` timed separately, "
        "median of fresh compiles after `jax.clear_caches()`. RHS evals: calls of the vector "
        "field counted by a `jax.debug.callback` in an untimed copy (grad: forward and "
        "backward passes together); SciPy: its nfev/nfe. Steps: accepted/rejected as the "
        "solver reports them. Error: max |ys(10) - ref(10)| over (theta, omega), the "
        f"reference from SciPy's DOP853 at rtol = atol = {REF_TOL:g}. Each dtype runs in its "
        "own process; SciPy runs in float64 only (float64 table). --quick: one compile, few "
        "calls, no RHS counting (n/a), and fewer rows (QUICK_ROWS)."
    )
    parts = ["## Damped pendulum: odeint forward, gradients, batch and compile", "", env, ""]
    parts += [render_dtype(res) for res in results]
    parts += [method, ""]
    return "\n".join(parts)


def plot(results: list[DtypeResult], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed (pip install -e '.[bench]'); no plot written")
        return False
    ref = reference()
    ts = np.linspace(0.0, T_END, N_T)
    colors = {"ours": "tab:green", "peer": "tab:blue", "host": "tab:gray"}
    panels = [
        ("forward (ms)", lambda r: r.times_ms.get("forward")),
        ("grad (ms)", lambda r: r.times_ms.get("grad")),
        (f"vmap value_and_grad, {BATCH} (ms)", lambda r: r.times_ms.get("vmap")),
        ("jit(grad) compile (ms)", lambda r: r.compile_ms),
    ]
    n = len(results)
    fig = plt.figure(figsize=(18, 3.6 * (n + 1)))
    grid = fig.add_gridspec(n + 1, len(panels))

    # The trajectory: the reference, with ours (and JAX's odeint where ours is missing).
    ax = fig.add_subplot(grid[0, :2])
    ax.plot(ts, ref[:, 0], "k-", lw=2.5, alpha=0.35, label="theta, reference (DOP853 1e-13)")
    ax.plot(ts, ref[:, 1], "k--", lw=2.5, alpha=0.35, label="omega, reference")
    for res, marker in zip(results, ("x", "+")):
        name = OURS if OURS in res.trajectories else next(iter(res.trajectories), None)
        if name is None:
            continue
        ys = np.asarray(res.trajectories[name])
        ax.plot(ts, ys[:, 0], marker, ms=4, ls="none", label=f"theta, {name} {res.dtype}")
        ax.plot(ts, ys[:, 1], marker, ms=4, ls="none", label=f"omega, {name} {res.dtype}")
    ax.set_xlabel("t")
    ax.set_title("pendulum trajectory", fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    ax = fig.add_subplot(grid[0, 2:])
    for res, marker in zip(results, ("x", "+")):
        for name, ys in res.trajectories.items():
            err = np.max(np.abs(np.asarray(ys) - ref), axis=1)
            ax.semilogy(
                ts[1:],
                np.maximum(err[1:], 1e-17),
                marker=marker,
                ms=3,
                lw=0.8,
                label=f"{name} {res.dtype}",
            )
        ax.axhline(res.tol, color="gray", lw=0.6, ls=":")
    ax.set_xlabel("t")
    ax.set_title("max |y - reference| (dotted: the tolerances)", fontsize=9)
    ax.legend(fontsize=7)

    for i, res in enumerate(results):
        names = [r.name for r in res.rows]
        y = np.arange(len(names))
        for j, (title, get) in enumerate(panels):
            ax = fig.add_subplot(grid[i + 1, j])
            vals = [get(r) or float("nan") for r in res.rows]
            finite = [v for v in vals if v == v]
            base = 0.5 * min(finite, default=1.0)
            ax.barh(
                y, [v - base for v in vals], left=base, color=[colors[r.kind] for r in res.rows]
            )
            ax.set_xscale("log")
            for yi, v in zip(y, vals):
                if v == v:
                    ax.text(v, yi, f" {v:.3g}", va="center", fontsize=7)
            ax.set_yticks(y, names if j == 0 else [""] * len(names), fontsize=8)
            ax.invert_yaxis()
            ax.set_xlim(base, 4 * max(finite, default=1.0))
            ax.set_title(f"{res.dtype}: {title}", fontsize=9)
    fig.suptitle(
        "Damped pendulum: ours (green), JAX peers (blue), SciPy on the host (grey); log scales"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


# ---------------------------------------------------------------------------


def _failed(results: list[DtypeResult]) -> bool:
    missed = not all(goal.ok for r in results for goal in goals(r))
    broken = any(row.errors for r in results for row in r.rows if row.kind == "ours")
    return missed or broken


def _load(d: dict[str, Any]) -> DtypeResult:
    return DtypeResult(**dict(d, rows=[Row(**r) for r in d["rows"]]))


def main(argv: list[str] | None = None) -> int:
    return run_main(
        "pendulum",
        argv,
        description=__doc__.splitlines()[0],
        dtypes=DTYPES,
        quick_help="few repeats: under ~2 minutes on 2 CPU cores",
        check_help="exit with status 1 when a goal is missed or a row of ours failed",
        run_worker=run_worker,
        load=_load,
        render=render,
        plot=plot,
        failed=_failed,
    )


if __name__ == "__main__":
    raise SystemExit(main())
