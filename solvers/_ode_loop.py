"""The stepping loop of `odeint`: step-size control, output times, failure, recording.

One `lax.while_loop` walks through all output times. Each iteration tries one step
from `(t, y)` towards the next output time `ts[i]`; a step that would pass `ts[i]` is
shortened to land on it exactly (no interpolation: every output is a step end). An
adaptive method accepts the step when the embedded error estimate, in the weighted
RMS norm `sqrt(mean((err / (atol + rtol * max(|y|, |y_new|)))**2))`, is at most 1, and
the next step size comes from the usual controller `h * clip(0.9 * ratio**(-1/order),
0.2, 10)` (never shrinking after an accepted step), capped at `hmax`.

Derivatives never go through the controller: the step sizes, the acceptance decisions
and the output times enter as constants (`stop_gradient`), so differentiating the loop
itself gives the derivative of the discrete solution with the accepted steps held
fixed. `odeint`'s own rules use exactly that (the checkpointed adjoint replays the
recorded steps) or the continuous adjoint.

The loop stops early with a status when a step fails for good: `mxstep` attempts
within one output interval (`MAX_STEPS`), a non-finite state (`NONFINITE`), or a step
size below the resolution of `t` (`DT_UNDERFLOW`, typically a stiff problem given to
an explicit method). The rows of `ys` not reached stay NaN.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._info import DT_UNDERFLOW, MAX_STEPS, NONFINITE, SUCCESS
from ._ode_methods import Method

__all__ = ["LoopConfig", "Record", "checkpoint_every", "integrate", "replay_step"]

_SAFETY, _IFACTOR, _DFACTOR = 0.9, 10.0, 0.2
EVENT = -1  # internal status: the loop stopped before a step across an event


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    """Static options of one integration (hashable)."""

    method: Method
    rtol: float
    atol: float
    mxstep: float  # attempts per output interval (may be inf)
    hmax: float
    dt: float | None  # fixed step (fixed-step methods)
    err_size: int | None = None  # measure the error on the first `err_size` entries only
    event: Any = None  # g(y, t, params): stop before the first step across a zero of g
    record: int = 0  # >0: record up to this many accepted steps (checkpointed adjoint)
    dense: int = 0  # >0: output every accepted step, up to this many (dense output)
    progress: bool = False

    @property
    def every(self) -> int:
        return checkpoint_every(self.record)


def checkpoint_every(record: int) -> int:
    """Accepted steps between two checkpoints of the state when recording `record`
    steps: `sqrt(record)`, so both the checkpoints and one segment hold that many."""
    return max(1, math.isqrt(max(record, 1)))


class Record(dict):
    """What a recording run keeps: `t`, `h` (each accepted step's start and size),
    `y_cp` (the state every `every` accepted steps, from step 0), `out_step` (the
    accepted-step count at which each output was reached) and `steps`."""


def _real_dtype(dtype):
    return jnp.finfo(dtype).dtype


def _rms_ratio(err, y, y1, rtol, atol, size):
    if size is not None:
        err, y, y1 = err[:size], y[:size], y1[:size]
    scale = atol + rtol * jnp.maximum(jnp.abs(y), jnp.abs(y1))
    return jnp.sqrt(jnp.mean(jnp.square(jnp.abs(err) / scale)))


def _initial_step(method, f, y0, k0, t0, params, cfg):
    """A first step size from the norms of `y0`, `f(y0)` and a trial Euler step
    (Hairer, Norsett and Wanner, Solving ODEs I, II.4)."""
    size = cfg.err_size
    yv, kv = (y0, k0) if size is None else (y0[:size], k0[:size])
    scale = cfg.atol + jnp.abs(yv) * cfg.rtol
    d0 = jnp.sqrt(jnp.mean(jnp.square(jnp.abs(yv) / scale)))
    d1 = jnp.sqrt(jnp.mean(jnp.square(jnp.abs(kv) / scale)))
    h0 = jnp.where((d0 < 1e-5) | (d1 < 1e-5), 1e-6, 0.01 * d0 / d1)
    y1 = y0 + h0.astype(y0.dtype) * k0
    k1 = f(y1, t0 + h0, params)
    k1v = k1 if size is None else k1[:size]
    d2 = jnp.sqrt(jnp.mean(jnp.square(jnp.abs(k1v - kv) / scale))) / h0
    big = jnp.maximum(d1, d2)
    h1 = jnp.where(
        big <= 1e-15,
        jnp.maximum(1e-6, h0 * 1e-3),
        (0.01 / big) ** (1.0 / (method.order + 1.0)),
    )
    return jnp.minimum(100 * h0, h1)


def integrate(f, y0, ts, params, cfg: LoopConfig):
    """Integrate `y' = f(y, t, params)` from `(ts[0], y0)` through every `ts[i]`.

    Returns `(ys, stats, record)`: `ys` has one row per output time (`ys[0] = y0`),
    `stats` is a dict of counters, the final time and the status, and `record` is a
    `Record` when `cfg.record`, else `None`.

    With `cfg.dense`, `ts` is the span `[t0, t1]` and the output has a row for every
    accepted step: `ys` has `cfg.dense + 1` rows, `stats["t_nodes"]` their times, and
    the rows past the last step repeat the final state and time (NaN on failure).
    """
    method = cfg.method
    dt = y0.dtype
    tdt = _real_dtype(dt)
    ts = jax.lax.stop_gradient(jnp.asarray(ts, tdt))
    n_out = ts.shape[0]
    n = y0.shape[0]
    t0 = ts[0]
    k0 = f(y0, t0, params)
    if method.adaptive:
        h0 = jax.lax.stop_gradient(_initial_step(method, f, y0, k0, t0, params, cfg))
    else:
        h0 = jnp.asarray(cfg.dt, tdt)
    h0 = jnp.minimum(jnp.asarray(h0, tdt), jnp.asarray(cfg.hmax, tdt))
    zero = jnp.asarray(0, jnp.int32)
    status0 = jnp.where(jnp.all(jnp.isfinite(k0)), SUCCESS, NONFINITE).astype(jnp.int32)
    carry = dict(t=t0, y=y0, k=k0, h=h0, acc=zero, rej=zero, tries=zero, status=status0)
    if cfg.event is not None:
        carry["g"] = jnp.sign(cfg.event(y0, t0, params))
    if cfg.record:
        every = cfg.every
        n_cp = cfg.record // every + 3  # the last one is a spare
        carry["rec_t"] = jnp.zeros((cfg.record,), tdt)
        carry["rec_h"] = jnp.zeros((cfg.record,), tdt)
        carry["y_cp"] = jnp.zeros((n_cp, n), dt).at[0].set(y0)
    eps = float(jnp.finfo(tdt).eps)
    mxstep = cfg.mxstep

    def body(target, c):
        t, y, k, h = c["t"], c["y"], c["k"], c["h"]
        to_end = target - t
        # Stretch a step by up to 1% (adaptive) rather than leave a sliver before an output.
        last = to_end <= h * (1.01 if method.adaptive else 1 + 64 * eps)
        h_step = jnp.where(last, to_end, h)
        y1, err, k1, ok = method.step(f, y, k, t, h_step.astype(tdt), params, rtol=cfg.rtol)
        t1 = jnp.where(last, target, t + h_step)
        finite = jnp.all(jnp.isfinite(y1)) & jnp.all(jnp.isfinite(k1))
        if method.adaptive:
            ratio = jax.lax.stop_gradient(_rms_ratio(err, y, y1, cfg.rtol, cfg.atol, cfg.err_size))
            good = ok & finite & jnp.isfinite(ratio)
            accept = good & (ratio <= 1.0)
            safe_ratio = jnp.where(good, ratio, jnp.inf)
            grow = jnp.where(
                safe_ratio == 0,
                _IFACTOR,
                jnp.clip(_SAFETY * safe_ratio ** (-1.0 / method.order), _DFACTOR, _IFACTOR),
            )
            grow = jnp.where(accept, jnp.maximum(grow, 1.0), jnp.minimum(grow, 1.0))
            h_new = h_step * grow
            # A step shortened to hit an output says little about the step size.
            h_new = jnp.where(accept & last, jnp.maximum(h_new, h), h_new)
            h_new = jnp.minimum(h_new, cfg.hmax)
        else:
            accept = finite
            h_new = h
        h_new = jax.lax.stop_gradient(h_new.astype(tdt))
        tries = c["tries"] + 1
        status = c["status"]
        if not method.adaptive:
            status = jnp.where(finite, status, NONFINITE)
        tiny = h_new <= 4 * eps * jnp.maximum(jnp.abs(t), jnp.abs(target))
        underflow = ~accept & tiny
        status = jnp.where(underflow, jnp.where(finite, DT_UNDERFLOW, NONFINITE), status)
        status = jnp.where(~(accept & last) & (tries >= mxstep), MAX_STEPS, status)

        if cfg.event is not None:
            # A step across a zero of the event function is not taken: the loop stops
            # before it (status EVENT), with `h` the size of the step that crossed.
            g1 = jnp.sign(cfg.event(y1, t1, params))
            crossed = accept & (g1 != c["g"]) & (status == SUCCESS)
            status = jnp.where(crossed, EVENT, status)
            h_new = jnp.where(crossed, h_step, h_new)
            accept = accept & ~crossed
        out = dict(c)
        out["t"] = jnp.where(accept, t1, t)
        out["y"] = jnp.where(accept, y1, y)
        out["k"] = jnp.where(accept, k1, k)
        out["h"] = h_new
        out["acc"] = c["acc"] + accept.astype(jnp.int32)
        out["rej"] = c["rej"] + (~accept).astype(jnp.int32)
        out["tries"] = tries
        out["status"] = status.astype(jnp.int32)
        if cfg.record:
            # Writes never read the buffer (a read-modify-write of a batched buffer
            # makes XLA copy it every step): an accepted step goes to the next free
            # slot (a rejected attempt's write there is overwritten later), and
            # a checkpoint not due goes to a spare last slot.
            slot = jnp.minimum(c["acc"], cfg.record - 1)
            out["rec_t"] = c["rec_t"].at[slot].set(t)
            out["rec_h"] = c["rec_h"].at[slot].set(h_step)
            acc = out["acc"]
            spare = c["y_cp"].shape[0] - 1
            store = accept & (acc % cfg.every == 0) & (acc // cfg.every < spare)
            cp = jnp.where(store, acc // cfg.every, spare)
            out["y_cp"] = c["y_cp"].at[cp].set(y1)
            full = accept & (acc > cfg.record)
            out["status"] = jnp.where(full, MAX_STEPS, out["status"]).astype(jnp.int32)
        if cfg.progress:
            _progress(out, t0, ts[-1])
        return out

    def interval(c, target):
        # One output interval: step until `t` lands on `target` (or the solve fails).
        c = dict(c, tries=jnp.zeros_like(c["tries"]))
        c = jax.lax.while_loop(
            lambda c: (c["t"] < target) & (c["status"] == SUCCESS),
            lambda c: body(target, c),
            c,
        )
        y_out = jnp.where(c["status"] == SUCCESS, c["y"], jnp.full_like(c["y"], jnp.nan))
        return c, (y_out, c["acc"])

    t_nodes = None
    if cfg.dense:
        # Every accepted step is an output row: one flat loop to the end of the span.
        n_rows = cfg.dense + 1

        def dense_body(c):
            inner = {k: v for k, v in c.items() if k not in ("ys", "tn")}
            new = body(ts[-1], inner)
            row = jnp.where(new["acc"] > c["acc"], jnp.minimum(new["acc"], n_rows), n_rows)
            new["ys"] = c["ys"].at[row].set(new["y"])  # row n_rows is a spare
            new["tn"] = c["tn"].at[row].set(new["t"])
            full = new["acc"] > cfg.dense
            new["status"] = jnp.where(full, MAX_STEPS, new["status"]).astype(jnp.int32)
            return new

        carry.update(
            ys=jnp.zeros((n_rows + 1, n), dt).at[0].set(y0),
            tn=jnp.zeros((n_rows + 1,), tdt).at[0].set(t0),
        )
        c = jax.lax.while_loop(
            lambda c: (c["t"] < ts[-1]) & (c["status"] == SUCCESS), dense_body, carry
        )
        rows = jnp.arange(n_rows)
        done = rows <= c["acc"]
        y_pad = jnp.where(c["status"] == SUCCESS, c["y"], jnp.full_like(c["y"], jnp.nan))
        ys = jnp.where(done[:, None], c["ys"][:n_rows], y_pad)
        t_nodes = jnp.where(done, c["tn"][:n_rows], c["t"])
        out_step = rows.astype(jnp.int32)
    elif cfg.record:
        # One flat loop over all steps: the record buffers then stay in place (a loop
        # nested in a scan would copy them at every output time).
        def flat_body(c):
            i = c["i"]
            row = jnp.minimum(i, n_out - 1)
            target = ts[row]
            inner = {k: v for k, v in c.items() if k not in ("i", "ys", "out_step")}
            new = body(target, inner)
            hit = new["t"] >= target
            new["tries"] = jnp.where(hit, 0, new["tries"])
            new["i"] = i + hit.astype(jnp.int32)
            row = jnp.where(hit, row, n_out)  # the spare last row
            new["ys"] = c["ys"].at[row].set(new["y"])
            new["out_step"] = c["out_step"].at[row].set(new["acc"])
            return new

        carry.update(
            i=jnp.asarray(1, jnp.int32),
            ys=jnp.full((n_out + 1, n), jnp.nan, dt).at[0].set(y0),
            out_step=jnp.zeros((n_out + 1,), jnp.int32),
        )
        c = jax.lax.while_loop(
            lambda c: (c["i"] < n_out) & (c["status"] == SUCCESS), flat_body, carry
        )
        ys, out_step = c["ys"][:n_out], c["out_step"][:n_out]
    else:
        c, (ys, out_step) = jax.lax.scan(interval, carry, ts[1:])
        ys = jnp.concatenate([y0[None], ys])
        out_step = jnp.concatenate([jnp.zeros((1,), jnp.int32), out_step])
    attempts = c["acc"] + c["rej"]
    per_step = method.stages - (1 if method.adaptive else 0)
    stats = dict(
        steps=c["acc"],
        rejected=c["rej"],
        num_fevals=(1 + 2 * int(method.adaptive) + per_step * attempts).astype(jnp.int32),
        t_final=c["t"],
        status=c["status"],
    )
    if t_nodes is not None:
        stats["t_nodes"] = t_nodes
    if cfg.event is not None:  # where the loop stopped, for locating the event
        stats.update(y=c["y"], k=c["k"], h=c["h"])
    record = None
    if cfg.record:
        record = Record(
            t=c["rec_t"], h=c["rec_h"], y_cp=c["y_cp"], out_step=out_step, steps=c["acc"]
        )
    if cfg.progress:
        _progress_done(c["t"], c["acc"], c["status"])
    return ys, stats, record


def replay_step(method: Method, f, y, t, h, params, rtol):
    """The step the loop took from `(t, y)` with size `h` (recomputing `f(y, t)`)."""
    k = f(y, t, params)
    return method.step(f, y, k, t, h, params, rtol=rtol)[0]


# ---------------------------------------------------------------------------
# Progress output (opt-in): a line every `_PROGRESS_EVERY` loop iterations.

_PROGRESS_EVERY = 200


def _print_progress(t, t0, t_end, steps):
    t, t0, t_end, steps = (np.asarray(v) for v in (t, t0, t_end, steps))
    frac = np.clip(np.min((t - t0) / (t_end - t0)), 0, 1)
    print(
        f"\rodeint: t = {np.min(t):.6g} / {np.max(t_end):.6g}  "
        f"({100 * frac:5.1f}%, {int(np.max(steps))} steps)",
        end="",
        flush=True,
    )


def _progress(c, t0, t_end):
    n = c["acc"] + c["rej"]
    jax.lax.cond(
        n % _PROGRESS_EVERY == 0,
        lambda: jax.debug.callback(_print_progress, c["t"], t0, t_end, c["acc"]),
        lambda: None,
    )


def _print_done(t, steps, status):
    print(
        f"\rodeint: done at t = {np.max(np.asarray(t)):.6g} after "
        f"{int(np.max(np.asarray(steps)))} steps (status {int(np.max(np.asarray(status)))})"
    )


def _progress_done(t, steps, status):
    jax.debug.callback(_print_done, t, steps, status)
