"""`odeint`: a drop-in for `jax.experimental.ode.odeint` with every derivative mode.

`odeint(func, y0, t, *args)` integrates `dy/dt = func(y, t, *args)` and returns the
solution at every `t[i]`. Internally the state is one flat vector and the solve is one
`implicitdiff.Primitive`, `_ODESolve`, whose rules are:

- forward mode (`jvp`, `jacfwd`): forward sensitivities. The tangent `v = dy` obeys
  `v' = J v + (df/dparams) dparams`; the rule integrates the pair `(y, v)` with the
  same primitive, measuring the step error on `y` only, so the steps are those of the
  primal solve and the tangent is the exact derivative of the computed solution with
  those steps held fixed.
- reverse mode, `adjoint="backsolve"`: the continuous adjoint `a' = -J^T a`,
  `params_bar' = -(df/dparams)^T a`, integrated backwards from each output time to
  the previous one together with `y` (as JAX does), again by the same primitive, so
  reverse-over-reverse (`grad(grad)`) works.
- reverse mode, `adjoint="checkpoint"`: the discrete adjoint. The forward pass records
  each accepted step's start and size, the state every `sqrt(max_steps)` steps and
  the states of the latest `sqrt(max_steps)` steps; the backward pass recomputes one
  earlier segment of states at a time and pulls the cotangent back through each step
  (`jax.vjp` of the step). Outputs inside a step (`interpolate=True`) are linear in
  the step's stages, so their cotangents join that one pull-back. Memory is
  `O(sqrt(max_steps))` states; the gradient is exact for the computed solution. The
  sweep is `_ode_checkpoint`; under `vmap` it runs once for the whole batch.
- derivatives with respect to the times: `dy(t_i)/dt_i = f(y(t_i), t_i)` and
  `dy(t_i)/dt_0 = -Phi(t_i, t_0) f(y_0, t_0)`, from the flow, for every mode.

`vmap` maps the whole solve: each element keeps its own step sizes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree
from jaxtyping import Array, Bool, Float, Int

from implicitdiff import Primitive, Zero, error_if
from implicitdiff._jax_compat import closure_convert, instantiate_zeros

from ._checks import not_in_checked_shard_map, static_bool, static_int, status_returned
from ._info import SUCCESS
from ._ode_checkpoint import CheckpointSweep, batch_first, batched_sweep, shared_or_first
from ._ode_loop import LoopConfig, checkpoint_every, integrate, stepper
from ._ode_methods import ADAPTIVE, FIXED, METHODS
from ._ode_solution import ODESolution, step_polynomials

__all__ = ["odeint", "ODEInfo"]

Method = Literal["dopri5", "tsit5", "bosh3", "dopri8", "kvaerno5", "rk4", "euler"]
Adjoint = Literal["backsolve", "checkpoint"]
_ADJOINTS = ("backsolve", "checkpoint")


class ODEInfo(eqx.Module):
    """What an `odeint` solve did (a pytree; one entry per element under `vmap`).

    Attributes:
        steps: accepted steps.
        rejected: rejected step attempts.
        num_fevals: evaluations of `func`: at `t[0]`, for the first step size, and by
            every step attempt (an implicit method also spends evaluations in its
            Newton iterations and Jacobians, not counted here).
        t_final: the time reached (`t[-1]` on success).
        status: `SUCCESS` (0), `MAX_STEPS` (1: `mxstep` attempts in one output
            interval, or more than `max_steps` steps recorded for
            `adjoint="checkpoint"`), `NONFINITE` (2) or `DT_UNDERFLOW` (4: the step
            size fell below the resolution of `t`).
    """

    steps: Int[Array, ...]
    rejected: Int[Array, ...]
    num_fevals: Int[Array, ...]
    t_final: Float[Array, ...]
    status: Int[Array, ...]

    @property
    def converged(self) -> Bool[Array, ...]:
        """True where the solve reached the last output time."""
        return self.status == SUCCESS


def odeint(
    func: Callable[..., Any],
    y0: Any,
    t: Any,
    *args: Any,
    rtol: float = 1.4e-8,
    atol: float = 1.4e-8,
    mxstep: float = jnp.inf,
    hmax: float = jnp.inf,
    method: Method = "dopri5",
    dt: float | None = None,
    adjoint: Adjoint | None = None,
    max_steps: int = 4096,
    throw: bool = True,
    return_info: bool = False,
    progress: bool = False,
    dense: bool = False,
    interpolate: bool = False,
) -> Any:
    """Integrate `dy/dt = func(y, t, *args)` from `y(t[0]) = y0`; output at every `t[i]`.

    Called like `jax.experimental.ode.odeint` (same positional arguments, defaults and
    output layout), with every derivative mode: `grad`, `jvp`/`jacfwd` (forward
    sensitivities), `hessian`, `vmap`, `jit`; `func` may close over traced values and
    `args` may hold integers.

    Arguments:
        func: the vector field `func(y, t, *args)`, returning a pytree like `y`.
        y0: the initial state, a pytree of floating-point or complex arrays.
        t: 1-D array of strictly increasing times; `t[0]` is the initial time.
        *args: extra arguments of `func` (differentiated when floating point).
        rtol: relative tolerance of the adaptive methods.
        atol: absolute tolerance of the adaptive methods.
        mxstep: the most step attempts between two consecutive output times.
        hmax: the largest step size.
        method: `"dopri5"` (default), `"tsit5"`, `"bosh3"`, `"dopri8"` (explicit
            adaptive), `"kvaerno5"` (adaptive ESDIRK for stiff problems; its stage
            equations are solved by Newton's method), or `"rk4"`/`"euler"` (fixed
            step `dt`). Every method steps exactly onto each `t[i]` unless
            `interpolate=True`.
        dt: the step of `"rk4"` and `"euler"` (required for them); steps are
            shortened to land on each `t[i]`.
        adjoint: reverse mode by `"backsolve"` (the continuous adjoint integrated
            backwards together with the state, as JAX does; any order; memory does not
            grow with the number of steps) or `"checkpoint"` (the exact gradient of
            the computed solution, replaying the recorded steps from checkpoints;
            usually faster; once in reverse mode, any order in forward mode). The
            default (`None`) is `"backsolve"` for the explicit methods, as
            `jax.experimental.ode.odeint`, and `"checkpoint"` for `"kvaerno5"`: the
            state of a stiff problem cannot be integrated backwards (its decaying
            modes grow), and `"backsolve"` raises an error when the state it
            integrates backwards strays from the forward solution (by more than 1000
            tolerances over an output interval), which also catches strongly damped
            and chaotic problems.
        max_steps: for `adjoint="checkpoint"`, the most accepted steps recorded (it
            sets the memory: `sqrt(max_steps)` checkpoints of the state); with
            `dense=True`, the most steps kept.
        throw: raise at run time when the solve fails (`mxstep` exceeded, non-finite
            state, step size underflow) or its gradient cannot be trusted; with
            `throw=False` (which needs `return_info=True`) the status is in the info,
            the rows of the output not reached are NaN, and so is a gradient that
            cannot be trusted.
        return_info: also return an `ODEInfo`.
        progress: print the time reached while solving (for long solves).
        dense: return an `ODESolution` to evaluate anywhere in the span instead of
            the values at `t`; `t` is then the span `[t0, t1]`. Every accepted step
            is kept (at most `max_steps`); between steps the solution is the method's
            own interpolant (Dopri5, Tsit5, Dopri8) or a cubic Hermite one.
            Derivatives with respect to `y0` and `args` work in every mode; the span
            itself is not differentiated.
        interpolate: step freely to `t[-1]` and evaluate the other output times
            with the interpolant of the step holding each (the same interpolant as
            `dense=True`), as `jax.experimental.ode.odeint` and diffrax do, instead
            of stepping onto every `t[i]`. Many output times then cost no extra
            steps (a neural ODE fitted to a sampled trajectory); the outputs carry
            the interpolant's error, so they are a little less accurate than step
            ends. Forward mode and `adjoint="checkpoint"` give the exact derivative
            of these outputs; `"backsolve"` the continuous adjoint, as always.

    Returns:
        The solution, a pytree like `y0` with a leading axis of length `len(t)`, or
        an `ODESolution` when `dense`; `(solution, info)` when `return_info`.

    Example:
        ```python
        import jax, jax.numpy as jnp
        from solvers import odeint

        def decay(y, t, k):
            return -k * y

        ts = jnp.linspace(0.0, 1.0, 3)
        ys = odeint(decay, 1.0, ts, 2.0)          # exp(-2 t)
        dk = jax.grad(lambda k: odeint(decay, 1.0, ts, k)[-1])(2.0)  # -exp(-2)
        ```
    """
    name = "odeint"
    if not callable(func):
        raise TypeError(f"odeint: `func` must be callable as func(y, t, *args), got {func!r}")
    if method not in METHODS:
        raise ValueError(f"odeint: `method` must be one of {tuple(METHODS)}, got {method!r}")
    if adjoint is not None and adjoint not in _ADJOINTS:
        raise ValueError(
            f"odeint: `adjoint` must be one of {_ADJOINTS} or None (the method's default), "
            f"got {adjoint!r}"
        )
    rtol = _positive(name, "rtol", rtol)
    atol = _positive(name, "atol", atol)
    mxstep = _positive(name, "mxstep", mxstep)
    hmax = _positive(name, "hmax", hmax)
    max_steps = static_int(name, "max_steps", max_steps, minimum=1)
    static_bool(name, "throw", throw)
    not_in_checked_shard_map(name)
    static_bool(name, "return_info", return_info)
    status_returned(name, throw, return_info)
    static_bool(name, "progress", progress)
    static_bool(name, "dense", dense)
    static_bool(name, "interpolate", interpolate)
    if dense and interpolate:
        raise ValueError(
            "odeint: `dense=True` already returns the interpolant over the whole span; "
            "pass either dense=True or interpolate=True, not both"
        )
    m = METHODS[method]
    if adjoint is None:
        adjoint = "checkpoint" if m.implicit else "backsolve"
    if m.adaptive:
        if dt is not None:
            raise ValueError(
                f"odeint: `dt` is for the fixed-step methods {FIXED}; method={method!r} "
                "chooses its own steps (use `rtol`/`atol`, or `hmax` to cap them)"
            )
    else:
        if dt is None:
            raise ValueError(
                f"odeint: method={method!r} takes fixed steps: pass the step size `dt=` "
                f"(or use an adaptive method: {ADAPTIVE})"
            )
        dt = _positive(name, "dt", dt)

    leaves = jax.tree_util.tree_leaves(y0)
    if not leaves:
        raise TypeError("odeint: `y0` must contain at least one array")
    for leaf in leaves:
        if not jnp.issubdtype(jnp.result_type(leaf), jnp.inexact):
            raise TypeError(
                "odeint: `y0` must hold floating-point or complex arrays, got dtype "
                f"{jnp.result_type(leaf)}; pass e.g. `jnp.asarray(y0, float)`"
            )
    y_flat, unravel = ravel_pytree(y0)
    tdt = jnp.finfo(y_flat.dtype).dtype
    t = _check_times(t, tdt)
    if dense and t.shape[0] != 2:
        raise ValueError(
            f"odeint: with dense=True, `t` is the span [t0, t1] (2 times), got {t.shape[0]} "
            "times; evaluate the returned ODESolution at the times you need"
        )

    # Trace `func` once: to check what it returns, and to hoist the traced values it
    # closes over so that they become differentiated inputs of the primitive.
    f_conv, consts, _ = closure_convert(lambda y, s, *a: func(y, s, *a), y0, t[0], *args)
    out = jax.eval_shape(f_conv, consts, y0, t[0], *args)
    _check_field(out, y_flat)

    params, ptree = jax.tree_util.tree_flatten((list(consts), args))
    params = [jnp.asarray(p) for p in params]
    is_diff = tuple(jnp.issubdtype(p.dtype, jnp.inexact) for p in params)
    pd = tuple(p for p, d in zip(params, is_diff) if d)
    pn = tuple(p for p, d in zip(params, is_diff) if not d)
    field = _FlatField(f_conv, unravel, ptree, is_diff, y_flat.dtype)
    loop = LoopConfig(
        method=m,
        rtol=rtol,
        atol=atol,
        mxstep=mxstep,
        hmax=hmax,
        dt=dt,
        progress=progress,
        dense=max_steps if dense else 0,
        interpolate=interpolate,
    )
    cfg = _Config(loop=loop, adjoint=adjoint, max_steps=max_steps, throw=throw, info=return_info)
    ys, stats, t_nodes = _ODESolve.apply(y_flat, t, pd, pn, f=field, cfg=cfg)
    out = jax.vmap(unravel)(ys)
    if dense:
        flat_f = lambda y, s, params: field(y, s, *params)  # noqa: E731
        coeffs = step_polynomials(m, flat_f, ys, t_nodes, (pd, pn))
        out = ODESolution(
            ts=t_nodes,
            ys=out,
            coeffs=jax.vmap(jax.vmap(unravel))(coeffs),
            num_steps=jnp.sum(t_nodes < t_nodes[-1]).astype(jnp.int32),
        )
    if return_info:
        return out, ODEInfo(**stats)
    return out


def _check_field(out: Any, y_flat: Any) -> None:
    """Like JAX's odeint, `func` may return any pytree with as many numbers as `y0`
    (both are flattened); anything else is an error naming `func`."""
    leaves = jax.tree_util.tree_leaves(out)
    size = sum(int(np.prod(leaf.shape)) for leaf in leaves)
    if size != y_flat.shape[0] or not all(
        jnp.issubdtype(leaf.dtype, jnp.inexact) for leaf in leaves
    ):
        desc = [f"{leaf.dtype}{list(leaf.shape)}" for leaf in leaves]
        raise TypeError(
            f"odeint: `func(y0, t[0], *args)` must return floating-point arrays with "
            f"as many numbers as `y0` ({y_flat.shape[0]}, usually the same pytree), got "
            f"{desc}"
        )


def _positive(name: str, arg: str, value: Any) -> float:
    if isinstance(value, jax.core.Tracer):
        raise TypeError(
            f"{name}: `{arg}` must be a Python float (it configures the solver), got a "
            "traced value; pass it as a constant"
        )
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name}: `{arg}` must be a positive float, got {value!r}") from None
    if not value > 0:
        raise ValueError(f"{name}: `{arg}` must be positive, got {value}")
    return value


def _check_times(t: Any, tdt: Any) -> jax.Array:
    if not isinstance(t, jax.core.Tracer):
        t_np = np.asarray(t)
        if t_np.ndim != 1 or t_np.shape[0] < 1:
            raise ValueError(
                f"odeint: `t` must be a 1-D array of output times, got shape {t_np.shape}"
            )
        if not np.all(np.isfinite(t_np)):
            raise ValueError("odeint: `t` must be finite")
        bad = np.flatnonzero(np.diff(t_np) <= 0)
        if bad.size:
            i = int(bad[0])
            raise ValueError(
                "odeint: `t` must be strictly increasing; "
                f"t[{i}] = {t_np[i]!r} and t[{i + 1}] = {t_np[i + 1]!r}. "
                "Sort the times and drop repeats (to integrate backwards, substitute "
                "s = -t in `func`)."
            )
        return jnp.asarray(t, tdt)
    if jnp.ndim(t) != 1:
        raise ValueError(f"odeint: `t` must be a 1-D array of output times, got {jnp.shape(t)}")
    t = jnp.asarray(t, tdt)
    return error_if(
        t,
        jnp.any(jnp.diff(t) <= 0) | ~jnp.all(jnp.isfinite(t)),
        "odeint: `t` must be finite and strictly increasing (checked at run time). Sort "
        "the times and drop repeats.",
    )


class _FlatField:
    """`func` on the flat state: `f(y, t, pd, pn)`, with `pd`/`pn` the differentiable
    and other leaves of `(consts, args)`."""

    def __init__(self, f_conv, unravel, ptree, is_diff, dtype):
        self.f_conv, self.unravel, self.ptree = f_conv, unravel, ptree
        self.is_diff, self.dtype = is_diff, dtype

    def __call__(self, y, t, pd, pn):
        it_d, it_n = iter(pd), iter(pn)
        leaves = [next(it_d) if d else next(it_n) for d in self.is_diff]
        consts, args = jax.tree_util.tree_unflatten(self.ptree, leaves)
        out = self.f_conv(consts, self.unravel(y), t, *args)
        return ravel_pytree(out)[0].astype(self.dtype)


@dataclasses.dataclass(frozen=True)
class _Config:
    loop: LoopConfig
    adjoint: str
    max_steps: int
    throw: bool
    info: bool  # return the statistics (else `None`)
    backward: bool = False  # the adjoint solve of adjoint="backsolve", in s = -t


_STATS = ("steps", "rejected", "num_fevals", "t_final", "status")


def _stats_avals(tdt):
    i32 = jax.ShapeDtypeStruct((), jnp.int32)
    return dict(
        steps=i32, rejected=i32, num_fevals=i32, t_final=jax.ShapeDtypeStruct((), tdt), status=i32
    )


# ---------------------------------------------------------------------------
# The primitive.


class _ODESolve(Primitive):
    """`(ys, stats)` for `y' = f(y, t, pd, pn)` from `y0` at the times `ts` (flat state).

    `pd` are the floating-point parameters (differentiated), `pn` the others. Params:
    `f` (a `_FlatField` or a derived field) and `cfg` (a `_Config`).
    """

    symbolic_zeros = True

    def __init__(self, y0_aval, ts_aval, pd_aval, pn_aval, *, f, cfg):
        self.in_avals = (y0_aval, ts_aval, pd_aval, pn_aval)
        n = y0_aval.shape[0]
        rows = cfg.loop.dense + 1 if cfg.loop.dense else ts_aval.shape[0]
        ys = jax.ShapeDtypeStruct((rows, n), y0_aval.dtype)
        tn = jax.ShapeDtypeStruct((rows,), ts_aval.dtype) if cfg.loop.dense else None
        self.out_aval = (ys, _stats_avals(ts_aval.dtype) if cfg.info else None, tn)
        self.params = dict(f=f, cfg=cfg)
        super().__init__()

    def _field(self):
        f = self.f
        return lambda y, t, params: f(y, t, *params)

    def _run(self, y0, ts, pd, pn, record=0):
        loop = dataclasses.replace(self.cfg.loop, record=record)
        step = stepper(self.f, loop.method)
        ys, stats, rec = integrate(self._field(), y0, ts, (pd, pn), loop, step=step)
        tn = stats.pop("t_nodes", None)
        rec = None if rec is None else dict(rec)
        if self.cfg.throw:
            # Checked on the record too: under `grad` only the record may be used (the
            # solution itself can be dead code), and a solve that failed, or recorded
            # fewer steps than it took, must not give a gradient silently.
            ys, rec = _check((ys, rec), stats, self.cfg)
        return (ys, (stats if self.cfg.info else None), tn), rec

    def expand(self, y0, ts, pd, pn):
        return self._run(y0, ts, pd, pn)[0]

    # ---- forward mode: forward sensitivities ----------------------------------

    def jvp(self, primals, tangents):
        y0, ts, pd, pn = primals
        dy0, dts, dpd, _ = tangents
        n = y0.shape[0]
        f = self.f
        dy0 = instantiate_zeros(dy0) if isinstance(dy0, Zero) else dy0
        dpd = tuple(instantiate_zeros(d) if isinstance(d, Zero) else d for d in dpd)
        v0 = dy0
        if not isinstance(dts, Zero):
            _span_not_differentiable(self.cfg)
            v0 = v0 - _times_dt(f(y0, ts[0], pd, pn), dts[0])
        field = _TangentField(f, n, len(pd))
        loop = self.cfg.loop
        loop = dataclasses.replace(loop, err_size=loop.err_size or n)
        cfg = dataclasses.replace(self.cfg, loop=loop)
        zs, stats, tn = _ODESolve.apply(
            jnp.concatenate([y0, v0.astype(y0.dtype)]), ts, pd + dpd, pn, f=field, cfg=cfg
        )
        ys, vs = zs[:, :n], zs[:, n:]
        if not isinstance(dts, Zero):
            fs = jax.vmap(f, (0, 0, None, None))(ys, ts, pd, pn)
            vs = vs + jax.vmap(_times_dt)(fs, dts)
        zeros = lambda x: None if x is None else jax.tree_util.tree_map(jnp.zeros_like, x)  # noqa: E731
        return (ys, stats, tn), (vs, zeros(stats), zeros(tn))

    # ---- reverse mode ----------------------------------------------------------

    def vjp_fwd(self, nzs_in, y0, ts, pd, pn):
        if nzs_in[1]:
            _span_not_differentiable(self.cfg)
        rec = None
        if self.cfg.adjoint == "backsolve":
            out = self(y0, ts, pd, pn)
        else:
            out, rec = self._run(y0, ts, pd, pn, record=self.cfg.max_steps)
        # (`ts_ct`: whether the times get a cotangent, told by the residuals' structure.)
        res = dict(
            ys=out[0],
            ts=ts,
            pd=pd,
            pn=pn,
            tn=out[2],
            rec=rec,
            ts_ct=[jnp.zeros((0,))] if nzs_in[1] else [],
        )
        return out, res

    def vjp_bwd_retval(self, res, g):
        g_ys = g[0]
        if isinstance(g_ys, Zero):
            return None, None, None, None
        ys, pd, pn = res["ys"], res["pd"], res["pn"]
        g_ys, ts = _dense_cotangents(res["tn"], res["ts"], g_ys)
        if self.cfg.adjoint == "backsolve":
            a0, ct_pd = _backsolve(self.f, self.cfg, ys, ts, pd, pn, g_ys)
        else:
            states, steps = _record_parts(res["rec"])
            a0, ct_pd = CheckpointSweep.apply(states, g_ys, pd, pn, steps, **self._sweep_params())
            a0, ct_pd = _finite_sweep(a0, ct_pd, g_ys, self.cfg)
        if res["tn"] is not None or not res["ts_ct"]:
            return a0, None, ct_pd, None
        return a0, _times_cotangent(self.f, ys, ts, pd, pn, g_ys, a0), ct_pd, None

    def vjp_bwd_batched(self, axis_size, in_dims, res, res_dims, g, g_dims):
        # A vmapped solve with the checkpointed adjoint: one sweep for the whole batch,
        # in which the cotangents of the parameters the batch shares are summed over it
        # at each step (not held per element). The rest maps element by element.
        g_ys = g[0]
        if self.cfg.adjoint != "checkpoint" or isinstance(g_ys, Zero):
            return None

        first = lambda x, d: batch_first(x, d, axis_size)  # noqa: E731

        def batched(key):
            return jax.tree_util.tree_map(first, res[key], res_dims[key])

        pd, pd_axes = shared_or_first(res["pd"], res_dims["pd"])
        pn, pn_axes = shared_or_first(res["pn"], res_dims["pn"])
        rec, ys, tn, ts = batched("rec"), batched("ys"), batched("tn"), batched("ts")
        g_ys, ts = jax.vmap(_dense_cotangents)(tn, ts, first(g_ys, g_dims[0]))
        states, steps = _record_parts(rec)
        a0, ct_pd = batched_sweep(
            states, g_ys, (pd, pd_axes), (pn, pn_axes), steps, **self._sweep_params()
        )
        a0, ct_pd = _finite_sweep(a0, ct_pd, g_ys, self.cfg)
        y0_dims, ts_dims = in_dims[0], in_dims[1]
        ct_ts = None
        if tn is None and res["ts_ct"]:
            times = jax.vmap(
                lambda *a: _times_cotangent(self.f, *a), (0, 0, pd_axes, pn_axes, 0, 0)
            )
            ct_ts = times(ys, ts, pd, pn, g_ys, a0)
            ct_ts = ct_ts if ts_dims is not None else jnp.sum(ct_ts, axis=0)
        a0 = a0 if y0_dims is not None else jnp.sum(a0, axis=0)
        return a0, ct_ts, ct_pd, None

    def _sweep_params(self):
        return dict(f=self.f, loop=self.cfg.loop, every=checkpoint_every(self.cfg.max_steps))


def _finite_sweep(a0, ct_pd, g_ys, cfg):
    """The sweep's cotangents, with an error (when `cfg.throw`) where they are not
    finite although the outputs' cotangents are: a NaN gradient never comes back
    silently."""
    if not cfg.throw:
        return a0, ct_pd
    leaves = [a0, *jax.tree_util.tree_leaves(ct_pd)]
    finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))
    bad = jnp.all(jnp.isfinite(g_ys)) & ~finite
    return error_if((a0, ct_pd), bad, _NONFINITE_SWEEP)


_NONFINITE_SWEEP = (
    "odeint(adjoint='checkpoint'): the gradient is not finite although the solution "
    "and the cotangents of its outputs are. A step replayed from a checkpoint, or the "
    "derivative of a step (for an implicit method, the stage equations' Jacobian), "
    "overflowed: check `func` and its derivatives for values that overflow or divide by "
    "zero along the solution. Pass throw=False (with return_info=True) to get the "
    "non-finite gradient instead."
)


def _record_parts(rec):
    """A `Record` as the sweep takes it: the kept states, and the steps and outputs."""
    states = (rec["y_cp"], rec["k_cp"], rec["y_last"], rec["k_last"])
    return states, (rec["t"], rec["h"], rec["out_step"], rec["out_theta"], rec["steps"])


def _dense_cotangents(tn, ts, g_ys):
    """The output cotangents and times for the sweep. With dense output (`tn`, the
    step times) the rows past the last step repeat its state, so their cotangents all
    belong to that step."""
    if tn is None:
        return g_ys, ts
    last = jnp.sum(tn < tn[-1])
    rows = jnp.arange(tn.shape[0])[:, None]
    tail = jnp.sum(jnp.where(rows > last, g_ys, 0), axis=0)
    g_ys = jnp.where(rows > last, 0, g_ys) + jnp.where(rows == last, tail, 0)
    return g_ys, tn


def _times_cotangent(f, ys, ts, pd, pn, g_ys, a0):
    """The cotangent of the output times: `y(t_i)` moves with `t_i` along the flow, and
    `t_0` moves the whole trajectory."""
    fs = jax.vmap(f, (0, 0, None, None))(ys, ts, pd, pn)
    ct_ts = jax.vmap(_dt_cotangent)(fs, g_ys, ts)
    # ys[0] = y0 does not move with t_0; the later outputs do, by -Phi f(y0, t0).
    ct_t0 = _dt_cotangent(fs[0], -(a0 - g_ys[0]), ts[0])
    return ct_ts.at[0].set(ct_t0)


def _span_not_differentiable(cfg):
    if cfg.loop.dense:
        raise NotImplementedError(
            "odeint(dense=True) is not differentiable with respect to the span `t`; "
            "differentiate the solution at fixed times with odeint(func, y0, t) instead"
        )


def _times_dt(fy, dt):
    return fy * dt.astype(fy.dtype)


def _dt_cotangent(fy, cot, t):
    """The cotangent of `t` through `y = f_y * t` (a linear map; handles complex `y`)."""
    return jax.vjp(lambda s: fy * s.astype(fy.dtype), t)[1](cot.astype(fy.dtype))[0]


class _TangentField:
    """`(y, v)' = (f(y), J v + (df/dpd) dpd)` for forward sensitivities; `pd` holds the
    parameters followed by their tangents.

    A step of the pair is the derivative of the primal step (`step`), not the method
    applied to this larger system: for an explicit method the two are the same, but
    an implicit method would solve the pair's stage equations by its Newton
    iteration, whose tangent half converges only as far as the iteration runs. The
    derivative of the step solves each stage's tangent equation exactly (the implicit
    function theorem on the stage equation), so forward mode gives the derivative of
    the computed solution, the same as the checkpointed adjoint."""

    def __init__(self, f, n, n_pd):
        self.f, self.n, self.n_pd = f, n, n_pd

    def __call__(self, z, t, pd, pn):
        n, k = self.n, self.n_pd
        y, v = z[:n], z[n:]
        p, dp = pd[:k], pd[k:]
        ydot, vdot = jax.jvp(lambda y, p: self.f(y, t, p, pn), (y, p), (v, dp))
        return jnp.concatenate([ydot, vdot])

    def step(self, method, z, kz, t, h, params, tol):
        n, k = self.n, self.n_pd
        pd, pn = params
        f = self.f
        base_tol = dataclasses.replace(tol, size=None)

        def primal(y, k1, p):
            field = lambda y, t, p: f(y, t, *p, pn)  # noqa: E731
            return method.step_with_stages(field, y, k1, t, h, (p,), tol=base_tol)

        (y1, err, k_next, ok, ks), (v1, _, dk_next, _, dks) = jax.jvp(
            primal, (z[:n], kz[:n], tuple(pd[:k])), (z[n:], kz[n:], tuple(pd[k:]))
        )
        join = lambda a, b: jnp.concatenate([a, b])  # noqa: E731
        err = join(err, jnp.zeros_like(err))
        return join(y1, v1), err, join(k_next, dk_next), ok, [join(a, b) for a, b in zip(ks, dks)]


class _AdjointField:
    """The backward-in-time adjoint system in `s = -t`: `(y, a, p_bar)' = (-f,
    J^T a, (df/dpd)^T a)`, as one flat vector."""

    def __init__(self, f, n):
        self.f, self.n = f, n

    def __call__(self, z, s, pd, pn):
        n = self.n
        y, a = z[:n], z[n : 2 * n]
        ydot, pullback = jax.vjp(lambda y, p: self.f(y, -s, p, pn), y, pd)
        a_y, a_p = pullback(a)
        p_flat = ravel_pytree(a_p)[0] if pd else jnp.zeros((0,), z.dtype)
        return jnp.concatenate([-ydot, a_y, p_flat.astype(z.dtype)])


def _backsolve(f, cfg, ys, ts, pd, pn, g):
    n = ys.shape[1]
    dtype = ys.dtype
    p_flat, unravel_p = ravel_pytree(pd) if pd else (jnp.zeros((0,), dtype), None)
    field = _AdjointField(f, n)
    loop = dataclasses.replace(
        cfg.loop, err_size=None, record=0, dense=0, interpolate=False, progress=False
    )
    adj_cfg = _Config(loop=loop, adjoint="backsolve", max_steps=cfg.max_steps, throw=cfg.throw,
                      info=False, backward=True)  # fmt: skip

    rtol, atol = cfg.loop.rtol, cfg.loop.atol

    def interval(carry, i):
        a, p_bar, drift = carry
        a = a + g[i]
        z = jnp.concatenate([ys[i], a, p_bar])
        span = jnp.stack([-ts[i], -ts[i - 1]])
        zs = _ODESolve.apply(z, span, pd, pn, f=field, cfg=adj_cfg)[0]
        # How far the state integrated backwards strayed from the forward solution at
        # the interval's start, in units of the tolerance (see `_BACKSOLVE_DRIFT`).
        y_back = jax.lax.stop_gradient(zs[-1, :n])
        scale = atol + rtol * jnp.maximum(jnp.abs(ys[i - 1]), jnp.abs(ys[i]))
        gap = jnp.sqrt(jnp.mean(jnp.square(jnp.abs(y_back - ys[i - 1]) / scale)))
        worst = jnp.where(gap > drift[0], jnp.stack([gap, ts[i - 1].real]), drift)
        return (zs[-1, n : 2 * n], zs[-1, 2 * n :], worst), None

    init_drift = jnp.zeros((2,), jnp.finfo(dtype).dtype)
    init = (jnp.zeros((n,), dtype), jnp.zeros(p_flat.shape, dtype), init_drift)
    steps = jnp.arange(ys.shape[0] - 1, 0, -1)
    (a, p_bar, drift), _ = jax.lax.scan(interval, init, steps)
    a = a + g[0]
    # A state that strays that far makes the Jacobians along the way wrong: the
    # gradient cannot be trusted. An error (or, with throw=False, NaN) says so.
    # (The fixed-step methods have no tolerance: their backward error is that of the
    # step size, as the forward one; only a non-finite state is caught there.)
    bad = ~(drift[0] <= _BACKSOLVE_DRIFT) if cfg.loop.method.adaptive else jnp.asarray(False)
    if cfg.throw:
        a, p_bar = error_if(
            (a, p_bar), bad, _BACKSOLVE_UNSTABLE, values={"drift": drift[0], "t": drift[1]}
        )
    else:
        a, p_bar = jnp.where(bad, jnp.nan, a), jnp.where(bad, jnp.nan, p_bar)
    ct_pd = None
    if pd:
        if not jnp.iscomplexobj(p_flat):
            p_bar = p_bar.real
        ct_pd = unravel_p(p_bar.astype(p_flat.dtype))
    return a, ct_pd


#: The most the backsolve adjoint's state (adaptive methods), integrated backwards over
#: one output interval, may differ from the forward solution at the interval's start,
#: in units of the error tolerance (`atol + rtol |y|`, RMS over the state). A stable
#: backward integration stays within a few tens of units (an error of a few tolerances
#: per interval); a problem that is stiff, strongly damped or chaotic over the interval
#: amplifies it by `exp(|lambda| dt)`, and with it the error of the gradient.
_BACKSOLVE_DRIFT = 1e3

_BACKSOLVE_UNSTABLE = (
    "odeint(adjoint='backsolve'): integrating the state backwards in time is unstable "
    "for this problem: at t = {t:.6g} it strayed from the forward solution by "
    "{drift:.3g} times the tolerance (the limit is " + f"{_BACKSOLVE_DRIFT:g}"
    "), so the gradient would be wrong. This happens for stiff, strongly damped or "
    "chaotic systems. Use adjoint='checkpoint' (the exact gradient of the computed "
    "solution, replayed forwards from checkpoints), or shorten the intervals between "
    "output times."
)


# ---------------------------------------------------------------------------
# Failure.


def _check(ys, stats, cfg):
    loop = cfg.loop
    where = (
        "odeint's adjoint solve (adjoint='backsolve', integrating backwards in time) "
        "failed at t = {t:.10g} after {steps} steps: status {status} "
        if cfg.backward
        else "odeint failed at t = {t:.10g} after {steps} steps: status {status} "
    )
    msg = (
        where
        + f"(1: more than mxstep={loop.mxstep:g} step attempts between two output times"
        + (
            f", or more than max_steps={cfg.max_steps} steps kept for dense=True"
            if loop.dense
            else f", or more than max_steps={cfg.max_steps} steps recorded for adjoint='checkpoint'"
            if cfg.adjoint == "checkpoint"
            else ""
        )
        + "; 2: non-finite values in the state or in func; "
        "4: step size underflow, the step size fell below the resolution of t: a "
        "singularity, or a stiff problem for an explicit method). To fix it: raise "
        "`mxstep`/`max_steps`, loosen `rtol`/`atol`, use method='kvaerno5' for stiff "
        "problems, or check func and its inputs for NaN. Pass throw=False with "
        "return_info=True to get the status instead (the rows not reached are NaN)."
        + (
            " A stiff problem is unstable backwards: use adjoint='checkpoint' for it."
            if cfg.backward
            else ""
        )
    )
    return error_if(
        ys,
        stats["status"] != SUCCESS,
        msg,
        values={
            "t": -stats["t_final"] if cfg.backward else stats["t_final"],
            "steps": stats["steps"],
            "status": stats["status"],
        },
    )
