"""The stepping loop of `odeint`: step-size control, output times, failure, recording.

A `lax.while_loop` tries one step at a time from `(t, y)`. By default each output
time `ts[i]` is a step end: a step that would pass it is shortened to land on it
exactly. With `interpolate=True` the steps go straight to `ts[-1]` and every output
inside an accepted step is the step's interpolant (`_ode_methods.step_coefficients`),
so many output times cost no extra steps. An adaptive method accepts the step when
the embedded error estimate, in the weighted RMS norm `sqrt(mean((err / (atol + rtol
* max(|y|, |y_new|)))**2))`, is at most 1, and the next step size comes from the usual
controller `h * clip(0.9 * ratio**(-1/order), 0.2, 10)` (never shrinking after an
accepted step), capped at `hmax`.

Under `vmap` every loop runs while any element is still going (`_while`) and the
finished elements write only to spare slots, so no buffer is copied per iteration.

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

from implicitdiff._errors import any_over_batch

from ._info import DT_UNDERFLOW, MAX_STEPS, NONFINITE, SUCCESS
from ._ode_methods import Method, StageTolerance, evaluate_step, step_coefficients

__all__ = [
    "LoopConfig",
    "Record",
    "checkpoint_every",
    "integrate",
    "output_window",
    "stepper",
]

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
    interpolate: bool = False  # outputs from the step interpolant, not steps onto them
    dense: int = 0  # >0: output every accepted step, up to this many (dense output)
    progress: bool = False

    @property
    def every(self) -> int:
        return checkpoint_every(self.record)

    @property
    def stage_tol(self) -> StageTolerance:
        """The accuracy of an implicit method's stage solves: the error control's."""
        return StageTolerance(rtol=self.rtol, atol=self.atol, size=self.err_size)


def checkpoint_every(record: int) -> int:
    """Accepted steps between two checkpoints of the state when recording `record`
    steps: `sqrt(record)`, so both the checkpoints and one segment hold that many."""
    return max(1, math.isqrt(max(record, 1)))


class Record(dict):
    """What a recording run keeps: `t`, `h` (each accepted step's start and size),
    `y_cp` and `k_cp` (the state every `every` accepted steps, from step 0, and the
    `f` there that the next step starts from: the carried value, which an implicit
    method takes from its stage equation, so a replay matches the solve), `y_last` and
    `k_last` (the starts of the latest `every` steps and `f` there, step `k` in row
    `k % every`), `out_step` (the accepted-step count at which each output was
    reached: the output lies in step `out_step - 1`), `out_theta` (where in that
    step, as a fraction of it: 1 at its end) and `steps`."""


def _while(cond, body, carry):
    """`lax.while_loop` whose predicate is not batched under `vmap`: the loop runs while
    any element's `cond` holds, and `body` leaves the finished elements unchanged.

    The usual batching of a loop with a batched predicate selects between the old and
    the new carry for every element at every iteration, a full pass over each buffer
    (the recorded steps of the checkpointed adjoint are `max_steps` long); here a
    finished element's writes go to spare slots instead.
    """
    return jax.lax.while_loop(lambda c: any_over_batch(cond(c)), body, carry)


def output_window(n_out: int, n: int) -> int:
    """How many output times an interpolating loop handles at once: a few rows (about
    32 numbers per solve), or all of them when there are that few (one pass per step,
    no inner loop).

    A pass over every row at every step costs a read and write of the whole output
    buffer however few rows the step holds, and on CPU XLA splits such a pass over
    threads once a batch makes it large, whose start-up costs more than the pass
    (for 32 solves of 40 outputs on 2 cores, the NeuralODE training step of
    `benchmarks/deq_memory.py` is about 10% faster with 16-row windows)."""
    return max(1, min(n_out - 1, max(8, 32 // max(n, 1))))


def _real_dtype(dtype):
    return jnp.finfo(dtype).dtype


def _rms_ratio(err, y, y1, rtol, atol, size):
    if size is not None:
        err, y, y1 = err[:size], y[:size], y1[:size]
    scale = atol + rtol * jnp.maximum(jnp.abs(y), jnp.abs(y1))
    return jnp.sqrt(jnp.mean(jnp.square(jnp.abs(err) / scale)))


def _initial_step(method, f, y0, k0, t0, params, cfg):
    """A first step size from the norms of `y0`, `f(y0)` and a trial Euler step
    (Hairer, Norsett and Wanner, Solving ODEs I, II.4).

    The exponent is `1 / method.order`, the order of the local error estimate (the
    error of a 5(4) pair with local extrapolation is `O(h^5)`), as in Hairer's own
    `dopri5`/`dop853` codes, diffrax, SciPy and `jax.experimental.ode`."""
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
        (0.01 / big) ** (1.0 / method.order),
    )
    return jnp.minimum(100 * h0, h1)


def stepper(field, method: Method):
    """One step of `method` on `field` (called `field(y, t, *params)`):
    `step(y, k1, t, h, params, tol) -> (y1, y_error, k1_next, ok, stages)`.

    A field may define its own `step(method, y, k1, t, h, params, tol)`: the forward
    sensitivities' field steps as the derivative of the step it differentiates
    (`odeint._TangentField`)."""
    own = getattr(field, "step", None)
    if own is not None:
        return lambda y, k1, t, h, params, tol: own(method, y, k1, t, h, params, tol)

    def f(y, t, params):
        return field(y, t, *params)

    def step(y, k1, t, h, params, tol):
        return method.step_with_stages(f, y, k1, t, h, params, tol=tol)

    return step


def integrate(f, y0, ts, params, cfg: LoopConfig, step=None):
    """Integrate `y' = f(y, t, params)` from `(ts[0], y0)` through every `ts[i]`,
    taking each step with `step` (see `stepper`; by default `cfg.method`'s own).

    Returns `(ys, stats, record)`: `ys` has one row per output time (`ys[0] = y0`),
    `stats` is a dict of counters, the final time and the status, and `record` is a
    `Record` when `cfg.record`, else `None`.

    With `cfg.dense`, `ts` is the span `[t0, t1]` and the output has a row for every
    accepted step: `ys` has `cfg.dense + 1` rows, `stats["t_nodes"]` their times, and
    the rows past the last step repeat the final state and time (NaN on failure).
    """
    method = cfg.method
    if step is None:

        def step(y, k1, t, h, params, tol):
            return method.step_with_stages(f, y, k1, t, h, params, tol=tol)

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
        carry["rec_t"] = jnp.zeros((cfg.record + 1,), tdt)  # the last one is a spare
        carry["rec_h"] = jnp.zeros((cfg.record + 1,), tdt)
        carry["y_cp"] = jnp.zeros((n_cp, n), dt).at[0].set(y0)
        carry["k_cp"] = jnp.zeros((n_cp, n), dt).at[0].set(k0)
        carry["y_last"] = jnp.zeros((every + 1, n), dt)  # the last one is a spare
        carry["k_last"] = jnp.zeros((every + 1, n), dt)
    eps = float(jnp.finfo(tdt).eps)
    mxstep = cfg.mxstep

    def attempt(target, c):
        # One step attempt towards `target`: the new carry, and the step itself (its
        # start, size, end, stages) for the interpolated outputs.
        t, y, k, h = c["t"], c["y"], c["k"], c["h"]
        # The loops run while any element of a vmap batch is live (an unbatched
        # predicate, `_while`), so an element that is done must not change here.
        live = (t < target) & (c["status"] == SUCCESS)
        to_end = target - t
        # Stretch a step by up to 1% (adaptive) rather than leave a sliver before an output.
        last = to_end <= h * (1.01 if method.adaptive else 1 + 64 * eps)
        h_step = jnp.where(last, to_end, h)
        y1, err, k1, ok, ks = step(y, k, t, h_step.astype(tdt), params, cfg.stage_tol)
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
        accept = accept & live
        h_new = jax.lax.stop_gradient(jnp.where(live, h_new, h).astype(tdt))
        tries = c["tries"] + live.astype(c["tries"].dtype)
        status = c["status"]
        if not method.adaptive:
            status = jnp.where(live & ~finite, NONFINITE, status)
        tiny = h_new <= 4 * eps * jnp.maximum(jnp.abs(t), jnp.abs(target))
        underflow = live & ~accept & tiny
        status = jnp.where(underflow, jnp.where(finite, DT_UNDERFLOW, NONFINITE), status)
        status = jnp.where(live & ~(accept & last) & (tries >= mxstep), MAX_STEPS, status)

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
        out["rej"] = c["rej"] + (live & ~accept).astype(jnp.int32)
        out["tries"] = tries
        out["status"] = status.astype(jnp.int32)
        if cfg.record:
            # Writes never read the buffer (a read-modify-write of a batched buffer
            # makes XLA copy it every step): an accepted step goes to the next free
            # slot (a rejected attempt's write there is overwritten later), and
            # what is not due goes to a spare last slot.
            slot = jnp.minimum(c["acc"], cfg.record)
            out["rec_t"] = c["rec_t"].at[slot].set(t)
            out["rec_h"] = c["rec_h"].at[slot].set(h_step)
            acc = out["acc"]
            spare = c["y_cp"].shape[0] - 1
            store = accept & (acc % cfg.every == 0) & (acc // cfg.every < spare)
            cp = jnp.where(store, acc // cfg.every, spare)
            out["y_cp"] = c["y_cp"].at[cp].set(y1)
            out["k_cp"] = c["k_cp"].at[cp].set(k1)
            # The start of the latest `every` steps, step k in slot k % every: the
            # sweep then needs no replay for the last segment (for a short solve, at
            # all). A rejected attempt writes the same state to the same slot.
            row = jnp.where(live, c["acc"] % cfg.every, cfg.every)
            out["y_last"] = c["y_last"].at[row].set(y)
            out["k_last"] = c["k_last"].at[row].set(k)
            full = accept & (acc > cfg.record)
            out["status"] = jnp.where(full, MAX_STEPS, out["status"]).astype(jnp.int32)
        if cfg.progress:
            _progress(out, t0, ts[-1])
        taken = dict(t=t, h=h_step, y=y, y1=y1, k_next=k1, ks=ks, accept=accept, live=live)
        return out, taken

    def body(target, c):
        return attempt(target, c)[0]

    def interval(c, target):
        # One output interval: step until `t` lands on `target` (or the solve fails).
        c = dict(c, tries=jnp.zeros_like(c["tries"]))
        c = _while(
            lambda c: (c["t"] < target) & (c["status"] == SUCCESS),
            lambda c: body(target, c),
            c,
        )
        y_out = jnp.where(c["status"] == SUCCESS, c["y"], jnp.full_like(c["y"], jnp.nan))
        return c, (y_out, c["acc"])

    t_nodes = out_theta = None
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
        c = _while(lambda c: (c["t"] < ts[-1]) & (c["status"] == SUCCESS), dense_body, carry)
        rows = jnp.arange(n_rows)
        done = rows <= c["acc"]
        y_pad = jnp.where(c["status"] == SUCCESS, c["y"], jnp.full_like(c["y"], jnp.nan))
        ys = jnp.where(done[:, None], c["ys"][:n_rows], y_pad)
        t_nodes = jnp.where(done, c["tn"][:n_rows], c["t"])
        out_step = rows.astype(jnp.int32)
    elif cfg.interpolate:
        # One flat loop to the last output time: the steps ignore the other output
        # times, and every output inside an accepted step is the step's interpolant.
        extra = ("i", "ys", "out_step", "out_theta")
        last_row = n_out - 1
        window = output_window(n_out, n)

        def interp_body(c):
            inner = {k: v for k, v in c.items() if k not in extra}
            new, taken = attempt(ts[-1], inner)
            t_a, h_a, t_b = taken["t"], taken["h"], new["t"]
            coeffs = step_coefficients(
                method, h_a, taken["y"], taken["y1"], taken["k_next"], taken["ks"]
            )
            # Computed once per step, not once per output row inside a fused evaluation.
            coeffs = jax.lax.optimization_barrier(coeffs)

            def outputs_at(rows, i):
                # The interpolant at the output rows `rows`; which of them lie in this
                # step (rows before `i` were written by earlier steps).
                t_rows = ts[jnp.minimum(rows, last_row)]
                inside = taken["accept"] & (rows >= i) & (rows < n_out) & (t_rows <= t_b)
                theta = jnp.where(t_rows >= t_b, 1, (t_rows - t_a) / h_a).astype(tdt)
                return inside, theta, evaluate_step(coeffs, theta, taken["y1"])

            i, ys, out_step, out_theta = c["i"], c["ys"], c["out_step"], c["out_theta"]
            if window >= n_out - 1:
                # One pass over every row (the last one is a spare): a select, no scatter.
                inside, theta, y_rows = outputs_at(jnp.arange(n_out + 1), i)
                ys = jnp.where(inside[:, None], y_rows, ys)
                out_step = jnp.where(inside, new["acc"], out_step)
                out_theta = jnp.where(inside, theta, out_theta)
                i = i + jnp.sum(inside, dtype=i.dtype)
            else:
                # The next `window` outputs at a time, while the step holds more; those
                # inside it are written (the others go to the spare last row).
                def due(s):
                    i = s[0]
                    return taken["accept"] & (i < n_out) & (ts[jnp.minimum(i, last_row)] <= t_b)

                def emit(s):
                    i, ys, out_step, out_theta = s
                    rows = i + jnp.arange(window)
                    inside, theta, y_rows = outputs_at(rows, i)
                    rows = jnp.where(inside, rows, n_out)
                    return (
                        i + jnp.sum(inside, dtype=i.dtype),
                        ys.at[rows].set(y_rows),
                        out_step.at[rows].set(new["acc"]),
                        out_theta.at[rows].set(theta),
                    )

                i, ys, out_step, out_theta = _while(due, emit, (i, ys, out_step, out_theta))
            # `mxstep` counts the attempts since the last output.
            new["tries"] = jnp.where(i > c["i"], 0, new["tries"])
            new.update(i=i, ys=ys, out_step=out_step, out_theta=out_theta)
            return new

        carry.update(
            i=jnp.asarray(1, jnp.int32),
            ys=jnp.full((n_out + 1, n), jnp.nan, dt).at[0].set(y0),  # the last: a spare
            out_step=jnp.zeros((n_out + 1,), jnp.int32),
            out_theta=jnp.ones((n_out + 1,), tdt),
        )
        c = _while(lambda c: (c["i"] < n_out) & (c["status"] == SUCCESS), interp_body, carry)
        ys, out_step, out_theta = c["ys"][:n_out], c["out_step"][:n_out], c["out_theta"][:n_out]
    elif cfg.record:
        # One flat loop over all steps: the record buffers then stay in place (a loop
        # nested in a scan would copy them at every output time).
        def flat_body(c):
            i = c["i"]
            row = jnp.minimum(i, n_out - 1)
            target = ts[row]
            inner = {k: v for k, v in c.items() if k not in ("i", "ys", "out_step")}
            new, taken = attempt(target, inner)
            hit = taken["live"] & (new["t"] >= target)
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
        c = _while(lambda c: (c["i"] < n_out) & (c["status"] == SUCCESS), flat_body, carry)
        ys, out_step = c["ys"][:n_out], c["out_step"][:n_out]
    else:
        c, (ys, out_step) = jax.lax.scan(interval, carry, ts[1:])
        ys = jnp.concatenate([y0[None], ys])
        out_step = jnp.concatenate([jnp.zeros((1,), jnp.int32), out_step])
    attempts = c["acc"] + c["rej"]
    # f(y0, t0), the trial point of the first step size (adaptive methods), and each
    # attempt's own evaluations.
    first = 1 + int(method.adaptive)
    stats = dict(
        steps=c["acc"],
        rejected=c["rej"],
        num_fevals=(first + method.evals_per_step * attempts).astype(jnp.int32),
        t_final=c["t"],
        status=c["status"],
    )
    if t_nodes is not None:
        stats["t_nodes"] = t_nodes
    if cfg.event is not None:  # where the loop stopped, for locating the event
        stats.update(y=c["y"], k=c["k"], h=c["h"])
    record = None
    if cfg.record:
        if out_theta is None:  # every output is a step end
            out_theta = jnp.ones(out_step.shape, tdt)
        record = Record(
            t=c["rec_t"],
            h=c["rec_h"],
            y_cp=c["y_cp"],
            k_cp=c["k_cp"],
            y_last=c["y_last"][: cfg.every],
            k_last=c["k_last"][: cfg.every],
            out_step=out_step,
            out_theta=out_theta,
            steps=c["acc"],
        )
    if cfg.progress:
        _progress_done(c["t"], c["acc"], c["status"])
    return ys, stats, record


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
