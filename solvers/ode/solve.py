"""The solve as one `implicitdiff.Primitive`, `ODESolve`, with its derivative rules.

- forward mode (`jvp`, `jacfwd`): forward sensitivities. The pair `(y, v)` is
  integrated by the same primitive with `fields.TangentField`, whose steps are the
  derivatives of the primal steps, measuring the error on `y` only: the steps are
  those of the primal solve and the tangent is the exact derivative of the computed
  solution with those steps held fixed.
- reverse mode: the rules of the adjoint object (`solvers.ode.adjoints`): it decides
  what the forward pass keeps and how the cotangent is pulled back.
- derivatives with respect to the times: `dy(t_i)/dt_i = f(y(t_i), t_i)` and
  `dy(t_i)/dt_0 = -Phi(t_i, t_0) f(y_0, t_0)`, from the flow, for every mode.

`vmap` maps the whole solve: each element keeps its own step sizes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from implicitdiff import Primitive, Zero, error_if
from implicitdiff.internal import any_vmapped, instantiate_zeros, per_element

from .fields import TangentField
from .info import SUCCESS, ODEInfo
from .loop import LoopConfig, carrier, stepper
from .outputs import integrate

__all__ = ["Config", "ODESolve", "times_cotangent", "dense_cotangents"]


@dataclasses.dataclass(frozen=True)
class Config:
    """The static configuration of a solve (hashable).

    Attributes:
        loop: the stepping loop's `LoopConfig`.
        adjoint: the adjoint object (`solvers.ode.adjoints`) of reverse mode.
        throw: raise at run time on failure.
        info: return the `ODEInfo` (else `None`).
        backward: the backward solve of the backsolve adjoint, in `s = -t` (for the
            wording of its failure message).
    """

    loop: LoopConfig
    adjoint: Any
    throw: bool
    info: bool
    backward: bool = False


class ODESolve(Primitive):
    """`(ys, info, t_nodes)` for `y' = f(y, t, pd, pn)` from `y0` at the times `ts`
    (flat state).

    `pd` are the floating-point parameters (differentiated), `pn` the others. Params:
    `f` (a `fields.FlatField` or a derived field) and `cfg` (a `Config`).
    """

    symbolic_zeros = True

    def __init__(self, y0_aval, ts_aval, pd_aval, pn_aval, *, f, cfg):
        self.in_avals = (y0_aval, ts_aval, pd_aval, pn_aval)
        n = y0_aval.shape[0]
        rows = cfg.loop.dense + 1 if cfg.loop.dense else ts_aval.shape[0]
        ys = jax.ShapeDtypeStruct((rows, n), y0_aval.dtype)
        tn = jax.ShapeDtypeStruct((rows,), ts_aval.dtype) if cfg.loop.dense else None
        self.out_aval = (ys, _info_avals(ts_aval.dtype) if cfg.info else None, tn)
        self.params = dict(f=f, cfg=cfg)
        super().__init__()

    def field(self):
        """The field as `f(y, t, params)` with `params = (pd, pn)`."""
        f = self.f
        return lambda y, t, params: f(y, t, *params)

    def run(self, y0, ts, pd, pn, record=0, checkpoints=0):
        """The forward solve: `((ys, info, t_nodes), record)`, recording up to `record`
        steps (for the checkpointed adjoint) with `checkpoints` checkpoints (0: as
        `loop.checkpoint_every` chooses)."""
        loop = dataclasses.replace(self.cfg.loop, record=record, checkpoints=checkpoints)
        step = stepper(self.f, loop.method)
        carry0 = carrier(self.f, loop.method)
        # A batched solve runs for each element (`in_batch`), one solve not (whatever
        # encloses it); its record says which (`Record.per_element`), and the adjoint
        # replays its steps the same way.
        run = per_element(integrate, any_vmapped((y0, ts, pd, pn)))
        out = run(self.field(), y0, ts, (pd, pn), loop, step=step, carry0=carry0)
        ys, rec = out.ys, out.record
        if self.cfg.throw:
            # Checked on the record too: under `grad` only the record may be used (the
            # solution itself can be dead code), and a solve that failed, or recorded
            # fewer steps than it took, must not give a gradient silently. The check is
            # tied to the record's step count, which the sweep always reads, and not to
            # its buffers: each leaf tied is a pass over it, and a large system's
            # buffers of `max_steps` rows take tens of megabytes.
            cfg = dataclasses.replace(self.cfg, loop=loop)
            if rec is None:
                ys = failure_check(ys, out.info, cfg)
            else:
                ys, steps = failure_check((ys, rec.steps), out.info, cfg)
                rec = eqx.tree_at(lambda r: r.steps, rec, steps)
        return (ys, (out.info if self.cfg.info else None), out.t_nodes), rec

    def expand(self, y0, ts, pd, pn):
        return self.run(y0, ts, pd, pn)[0]

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
            span_not_differentiable(self.cfg)
            v0 = v0 - _times_dt(f(y0, ts[0], pd, pn), dts[0])
        field = TangentField(f, n, len(pd))
        loop = self.cfg.loop
        loop = dataclasses.replace(loop, err_size=loop.err_size or n)
        cfg = dataclasses.replace(self.cfg, loop=loop)
        zs, info, tn = ODESolve.apply(
            jnp.concatenate([y0, v0.astype(y0.dtype)]), ts, pd + dpd, pn, f=field, cfg=cfg
        )
        ys, vs = zs[:, :n], zs[:, n:]
        if not isinstance(dts, Zero):
            fs = jax.vmap(f, (0, 0, None, None))(ys, ts, pd, pn)
            vs = vs + jax.vmap(_times_dt)(fs, dts)
        zeros = lambda x: None if x is None else jax.tree_util.tree_map(jnp.zeros_like, x)  # noqa: E731
        return (ys, info, tn), (vs, zeros(info), zeros(tn))

    # ---- reverse mode: the adjoint's rules ---------------------------------------

    def vjp_fwd(self, nzs_in, y0, ts, pd, pn):
        if nzs_in[1]:
            span_not_differentiable(self.cfg)
        out, kept = self.cfg.adjoint.forward(self, y0, ts, pd, pn)
        # (`ts_ct`: whether the times get a cotangent, told by the residuals' structure.)
        res = dict(
            ys=out[0],
            ts=ts,
            pd=pd,
            pn=pn,
            tn=out[2],
            kept=kept,
            ts_ct=[jnp.zeros((0,))] if nzs_in[1] else [],
        )
        return out, res

    def vjp_bwd_retval(self, res, g):
        g_ys = g[0]
        if isinstance(g_ys, Zero):
            return None, None, None, None
        ys, pd, pn = res["ys"], res["pd"], res["pn"]
        g_ys, ts = dense_cotangents(res["tn"], res["ts"], g_ys)
        a0, ct_pd = self.cfg.adjoint.backward(self, res["kept"], ys, ts, pd, pn, g_ys)
        if res["tn"] is not None or not res["ts_ct"]:
            return a0, None, ct_pd, None
        return a0, times_cotangent(self.f, ys, ts, pd, pn, g_ys, a0), ct_pd, None

    def vjp_bwd_batched(self, axis_size, in_dims, res, res_dims, g, g_dims):
        batched = getattr(self.cfg.adjoint, "backward_batched", None)
        if batched is None or isinstance(g[0], Zero):
            return None
        return batched(self, axis_size, in_dims, res, res_dims, g, g_dims)


def _info_avals(tdt):
    i32 = jax.ShapeDtypeStruct((), jnp.int32)
    return ODEInfo(
        steps=i32,
        rejected=i32,
        num_fevals=i32,
        num_jacobians=i32,
        num_factorisations=i32,
        num_stage_failures=i32,
        num_newton_iterations=i32,
        t_final=jax.ShapeDtypeStruct((), tdt),
        status=i32,
    )


def dense_cotangents(tn, ts, g_ys):
    """The output cotangents and times for the adjoint. With dense output (`tn`, the
    step times) the rows past the last step repeat its state, so their cotangents all
    belong to that step."""
    if tn is None:
        return g_ys, ts
    last = jnp.sum(tn < tn[-1])
    rows = jnp.arange(tn.shape[0])[:, None]
    tail = jnp.sum(jnp.where(rows > last, g_ys, 0), axis=0)
    g_ys = jnp.where(rows > last, 0, g_ys) + jnp.where(rows == last, tail, 0)
    return g_ys, tn


def times_cotangent(f, ys, ts, pd, pn, g_ys, a0):
    """The cotangent of the output times: `y(t_i)` moves with `t_i` along the flow, and
    `t_0` moves the whole trajectory."""
    fs = jax.vmap(f, (0, 0, None, None))(ys, ts, pd, pn)
    ct_ts = jax.vmap(_dt_cotangent)(fs, g_ys, ts)
    # ys[0] = y0 does not move with t_0; the later outputs do, by -Phi f(y0, t0).
    ct_t0 = _dt_cotangent(fs[0], -(a0 - g_ys[0]), ts[0])
    return ct_ts.at[0].set(ct_t0)


def span_not_differentiable(cfg):
    if getattr(cfg.loop.method, "mass_matrix", None) is not None:
        raise NotImplementedError(
            "odeint(mass_matrix=...) is not differentiable with respect to the times "
            "`t`: the algebraic unknowns' derivatives are not given by `func`. "
            "Differentiate with respect to `y0` and the arguments, at fixed times."
        )
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


def failure_check(x, info: ODEInfo, cfg: Config):
    """`x`, with the run-time error of a failed solve attached (its cause and the time
    reached)."""
    loop = cfg.loop
    where = (
        "odeint's adjoint solve (adjoint='backsolve', integrating backwards in time) "
        "failed at t = {t:.10g} after {steps} steps: status {status} "
        if cfg.backward
        else "odeint failed at t = {t:.10g} after {steps} steps: status {status} "
    )
    record = getattr(cfg.adjoint, "max_steps", None)
    msg = (
        where
        + f"(1: more than mxstep={loop.mxstep:g} step attempts between two output times"
        + (
            f", or more than max_steps={loop.dense} steps kept for dense=True"
            if loop.dense
            else f", or more than max_steps={record} steps recorded for adjoint='checkpoint'"
            if loop.record
            else ""
        )
        + "; 2: non-finite values in the state or in func; "
        "4: step size underflow, the step size fell below the resolution of t: a "
        "singularity, or a stiff problem for an explicit method). To fix it: raise "
        "`mxstep`/`max_steps`, loosen `rtol`/`atol`, use method='rodas5p' or 'kvaerno5' for stiff "
        "problems, or check func and its inputs for NaN. Pass throw=False with "
        "return_info=True to get the status instead (the rows not reached are NaN)."
        + (
            " A stiff problem is unstable backwards: use adjoint='checkpoint' for it."
            if cfg.backward
            else ""
        )
    )
    return error_if(
        x,
        info.status != SUCCESS,
        msg,
        values={
            "t": -info.t_final if cfg.backward else info.t_final,
            "steps": info.steps,
            "status": info.status,
        },
    )
