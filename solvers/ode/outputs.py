"""`integrate`: the stepping loop with its outputs, in one of four layouts.

- stepping onto every output time, one output interval at a time (`lax.scan` over the
  intervals, a `while_loop` of attempts in each): the plain solve;
- the same in one flat loop over all steps, when the steps are recorded for the
  checkpointed adjoint (a loop nested in a scan would copy the record buffers at
  every output time); for one small solve, a loop over blocks of steps around a loop
  over a block's steps, onto the next output time (`solvers.ode.blocks`);
- one flat loop straight to `ts[-1]`, each output inside an accepted step evaluated
  from the step's interpolant (`interpolate=True`); when its steps are recorded for one
  small solve, a loop over blocks of steps around it, as above;
- one flat loop with every accepted step an output row (dense output); for one
  small solve, a loop over blocks of steps around it, as above.

Under `vmap` every loop runs while any element is still going (`loop.while_any`) and
the finished elements write only to spare slots, so no buffer is copied per iteration.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from implicitdiff.internal import in_batch

from . import progress
from .blocks import BlockRows, block_size, flatten, is_rows
from .info import MAX_STEPS, SUCCESS, ODEInfo
from .interpolation import evaluate_step, step_coefficients
from .loop import (
    LoopConfig,
    attempt,
    initial_state,
    record_block,
    solve_batch,
    while_any,
    write_end,
)
from .state import Record, StepState

__all__ = ["Integration", "integrate", "output_window"]


class Integration(eqx.Module):
    """The result of `integrate`.

    Attributes:
        ys: one row per output time (`ys[0] = y0`), NaN past a failure; with dense
            output one row per accepted step (`dense + 1` rows; the rows past the last
            step repeat the final state).
        info: the `ODEInfo` of the solve.
        t_nodes: with dense output, the time of each row; else `None`.
        final: the `StepState` where the loop stopped (the event search reads it).
        record: the `Record` of a recording solve, else `None`.
    """

    ys: Any
    info: ODEInfo
    t_nodes: Any
    final: StepState
    record: Record | None


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


def integrate(f, y0, ts, params, cfg: LoopConfig, step=None, carry0=None) -> Integration:
    """Integrate `y' = f(y, t, params)` from `(ts[0], y0)` through every `ts[i]`,
    taking each step with `step` (see `loop.stepper`; by default `cfg.method`'s own)
    from the carry `carry0(y0, f(y0, t0))` (see `loop.carrier`; by default the
    method's `initial_carry`).

    With `cfg.dense`, `ts` is the span `[t0, t1]` and the output has a row for every
    accepted step.
    """
    method = cfg.method
    if step is None:

        def step(y, k1, t, h, params, tol):
            return method.step_with_stages(f, y, k1, t, h, params, tol=tol)

    tdt = jnp.finfo(y0.dtype).dtype
    ts = jax.lax.stop_gradient(jnp.asarray(ts, tdt))
    state, rec = initial_state(cfg, f, y0, ts, params, carry0)
    span = (ts[0], ts[-1])

    def attempt_to(target, s, rec):
        return attempt(cfg, step, f, params, span, target, s, rec)

    t_nodes = out_theta = None
    if cfg.dense:
        block = _block(rec, y0, ts, params, _dense_rows(cfg, y0, ts))
        state, rec, ys, t_nodes, out_step = _dense(cfg, attempt_to, state, rec, y0, ts, block)
    elif cfg.interpolate:
        block = _block(rec, y0, ts, params) if cfg.record else 0
        state, rec, ys, out_step, out_theta = _interpolated(
            cfg, attempt_to, state, rec, y0, ts, block
        )
    elif cfg.record:
        block = _block(rec, y0, ts, params)
        if block:
            state, rec, ys, out_step = _recorded_by_blocks(attempt_to, state, rec, y0, ts, block)
        else:
            state, rec, ys, out_step = _recorded(attempt_to, state, rec, y0, ts)
    else:
        state, ys, out_step = _by_interval(attempt_to, state, y0, ts)
    # f(y0, t0), the trial point of the first step size (adaptive methods), and each
    # attempt's own evaluations.
    first = 1 + int(method.adaptive)
    attempts = state.acc + state.rej
    info = ODEInfo(
        steps=state.acc,
        rejected=state.rej,
        num_fevals=(first + method.evals_per_step * attempts).astype(jnp.int32),
        num_jacobians=state.jacobians,
        num_factorisations=state.factorisations,
        num_stage_failures=state.failed,
        num_newton_iterations=state.iterations,
        t_final=state.t,
        status=state.status,
    )
    record = None
    if cfg.record:
        if out_theta is None:  # every output is a step end
            out_theta = jnp.ones(out_step.shape, tdt)
        # `y_last` and `k_last` keep their spare row: trimmed, each would be copied
        # whole, a pass over a large system's buffers of up to `max_steps` rows.
        buffers = write_end(rec, state, cfg.method)
        record = Record(
            buffers=buffers, out_step=out_step, out_theta=out_theta, steps=state.acc,
            per_element=in_batch(),
        )  # fmt: skip
    if cfg.progress:
        progress.report_done(state)
    return Integration(ys=ys, info=info, t_nodes=t_nodes, final=state, record=record)


def _block(rec, y0, ts, params, rows=()) -> int:
    """Steps per block of a loop whose per-step buffers, the record's (`rec`, or
    `None`) and `rows`, are written by blocks (`loop.record_block`, `block_size`), else
    0 (a batch, a record that does not keep every step's start, or a row too large)."""
    batch = solve_batch(y0, ts, params)
    if rec is None:
        return block_size(rows, batch)
    every = rec.y_last.shape[0] - 1  # (its last row is a spare)
    return record_block(every, rec.t.shape[0], (_parts(rec), rows), batch)


def _parts(rec):
    """The record's buffers with a row per step (none without a record)."""
    return None if rec is None else (rec.t, rec.h, rec.y_last, rec.k_last)


def _with_parts(rec, parts, base=None):
    """The record with its per-step buffers `parts` (`_parts`'s order); with `base`,
    one block's (see `RecordBuffers.base`)."""
    if rec is None:
        return None
    t, h, y_last, k_last = parts
    return dataclasses.replace(rec, t=t, h=h, y_last=y_last, k_last=k_last, base=base)


def _by_blocks(buffers, block, going, run_block, carry):
    """A loop of one small solve whose per-step buffers (`buffers`, a pytree of arrays
    with a row per step) are written by blocks of `block` steps (see
    `solvers.ode.blocks`), while `going(carry)` (`carry[0]` is the `StepState`).
    `run_block(carry, staged, base, full) -> (carry, staged)` runs one block's own
    loop: its steps write step `k`'s row to row `k - base` of the block's small copies
    `staged` (`BlockRows`), until `full(state)`; this loop then copies the block into
    the buffers. Returns `(carry, buffers)`."""
    # Room for a whole block from any step up to the overflowing one (`max_steps + 1`),
    # trimmed back afterwards; each row flattened while the loop writes the blocks.
    pad = lambda b: jnp.concatenate([b, jnp.zeros((block,) + b.shape[1:], b.dtype)])  # noqa: E731
    big = jax.tree_util.tree_map(lambda b: flatten(pad(b)), buffers)
    empty = jax.tree_util.tree_map(lambda b: BlockRows.empty(b, block), buffers)

    def blocks(c):
        carry, big, staged, base = c
        carry, staged = run_block(carry, staged, base, lambda s: s.acc - base >= block)
        # The block so far: the rows past its last step are stale, and overwritten as
        # the block fills (the next outer iteration writes the block again).
        big = jax.tree_util.tree_map(lambda r, b: r.write(b, base), staged, big, is_leaf=is_rows)
        base = jnp.where(carry[0].acc - base >= block, base + block, base)
        return carry, big, staged, base

    init = (carry, big, empty, jnp.asarray(0, jnp.int32))
    carry, big, _, _ = jax.lax.while_loop(lambda c: going(c[0]), blocks, init)
    trim = lambda b, x: b[: x.shape[0]].reshape(x.shape)  # noqa: E731
    return carry, jax.tree_util.tree_map(trim, big, buffers)


def _nan_unless_ok(s: StepState):
    return jnp.where(s.status == SUCCESS, s.y, jnp.full_like(s.y, jnp.nan))


def _going(target):
    return lambda c: (c[0].t < target) & (c[0].status == SUCCESS)


def _by_interval(attempt_to, state, y0, ts):
    """Step onto every output time, one interval at a time."""

    def interval(s, target):
        s = dataclasses.replace(s, tries=jnp.zeros_like(s.tries))
        (s,) = while_any(_going(target), lambda c: (attempt_to(target, c[0], None)[0],), (s,))
        return s, (_nan_unless_ok(s), s.acc)

    state, (ys, out_step) = jax.lax.scan(interval, state, ts[1:])
    ys = jnp.concatenate([y0[None], ys])
    out_step = jnp.concatenate([jnp.zeros((1,), jnp.int32), out_step])
    return state, ys, out_step


def _recorded(attempt_to, state, rec, y0, ts):
    """Step onto every output time in one flat loop over all steps, recording them."""
    n_out = ts.shape[0]

    def body(c):
        s, rec, i, ys, out_step = c
        row = jnp.minimum(i, n_out - 1)
        target = ts[row]
        new, rec, taken = attempt_to(target, s, rec)
        hit = taken.live & (new.t >= target)
        new = dataclasses.replace(new, tries=jnp.where(hit, 0, new.tries))
        ys, out_step = _write_output(new, hit, row, ys, out_step)
        return new, rec, i + hit.astype(jnp.int32), ys, out_step

    init = (state, rec, jnp.asarray(1, jnp.int32), *_output_rows(y0, n_out))
    state, rec, _, ys, out_step = while_any(
        lambda c: (c[2] < n_out) & (c[0].status == SUCCESS), body, init
    )
    return state, rec, ys[:n_out], out_step[:n_out]


def _recorded_by_blocks(attempt_to, state, rec, y0, ts, block):
    """`_recorded` for one small solve, its record written by blocks of `block` steps
    (`_by_blocks`): a block's loop steps until the block is full or it reaches the next
    output time, touching only the state and the block's small buffers; then the
    output is written."""
    n_out = ts.shape[0]

    def run_block(c, staged, base, full):
        s, i, ys, out_step = c
        row = jnp.minimum(i, n_out - 1)
        target = ts[row]

        def more(c):
            s, _ = c
            return (s.t < target) & (s.status == SUCCESS) & ~full(s)

        def one(c):
            s, staged = c
            new, part, _ = attempt_to(target, s, _with_parts(rec, staged, base))
            return new, _parts(part)

        s, staged = jax.lax.while_loop(more, one, (s, staged))
        hit = s.t >= target
        s = dataclasses.replace(s, tries=jnp.where(hit, 0, s.tries))
        ys, out_step = _write_output(s, hit, row, ys, out_step)
        return (s, i + hit.astype(jnp.int32), ys, out_step), staged

    def going(c):
        return (c[1] < n_out) & (c[0].status == SUCCESS)

    init = (state, jnp.asarray(1, jnp.int32), *_output_rows(y0, n_out))
    (state, _, ys, out_step), parts = _by_blocks(_parts(rec), block, going, run_block, init)
    return state, _with_parts(rec, parts), ys[:n_out], out_step[:n_out]


def _output_rows(y0, n_out):
    """The buffers of a loop that steps onto the output times: the outputs (`y0`, then
    NaN until reached) and the step count at each, with a spare last row."""
    ys = jnp.full((n_out + 1, y0.shape[0]), jnp.nan, y0.dtype).at[0].set(y0)
    return ys, jnp.zeros((n_out + 1,), jnp.int32)


def _write_output(s: StepState, hit, row, ys, out_step):
    """The outputs with row `row` set to where `s` stands where `hit` (else the spare
    last row is written)."""
    row = jnp.where(hit, row, ys.shape[0] - 1)
    return ys.at[row].set(s.y), out_step.at[row].set(s.acc)


def _dense_rows(cfg, y0, ts):
    """The per-step buffers of a dense loop written by blocks: the state and the time
    at the start of each step, steps `0 .. cfg.dense` (the last one overflows)."""
    rows = cfg.dense + 1
    return (jnp.zeros((rows, y0.shape[0]), y0.dtype), jnp.zeros((rows,), ts.dtype))


def _dense(cfg, attempt_to, state, rec, y0, ts, block=0):
    """Every accepted step is an output row: one flat loop to the end of the span. With
    `block`, one small solve writes its rows (and its record) by blocks of that many
    steps (`_by_blocks`), each step the state at its start."""
    n_rows = cfg.dense + 1
    n = y0.shape[0]
    tdt = ts.dtype
    rows = jnp.arange(n_rows)

    def attempt_dense(s, rec):
        new, rec, _ = attempt_to(ts[-1], s, rec)
        full = new.acc > cfg.dense
        new = dataclasses.replace(
            new, status=jnp.where(full, MAX_STEPS, new.status).astype(jnp.int32)
        )
        return new, rec

    if block:

        def run_block(c, staged, base, full):
            def one(c):
                (s,), (part, (ys, tn)) = c
                # Step k's start in row k - base: a rejected attempt writes the same.
                ys, tn = ys.set(s.acc - base, s.y), tn.set(s.acc - base, s.t)
                new, part = attempt_dense(s, _with_parts(rec, part, base))
                return (new,), (_parts(part), (ys, tn))

            more = lambda c: _going(ts[-1])(c[0]) & ~full(c[0][0])  # noqa: E731
            return jax.lax.while_loop(more, one, (c, staged))

        buffers = (_parts(rec), _dense_rows(cfg, y0, ts))
        (state,), (parts, (ys_buf, tn)) = _by_blocks(
            buffers, block, _going(ts[-1]), run_block, (state,)
        )
        rec = _with_parts(rec, parts)
        # Rows past the last step's start: where the solve stands.
        start = rows < state.acc
        last = rows == state.acc
        ys = jnp.where(
            start[:, None], ys_buf, jnp.where(last[:, None], state.y, _nan_unless_ok(state))
        )
        t_nodes = jnp.where(start, tn, state.t)
        return state, rec, ys, t_nodes, rows.astype(jnp.int32)

    def body(c):
        s, rec, ys, tn = c
        new, rec = attempt_dense(s, rec)
        row = jnp.where(new.acc > s.acc, jnp.minimum(new.acc, n_rows), n_rows)
        return new, rec, ys.at[row].set(new.y), tn.at[row].set(new.t)  # row n_rows: a spare

    init = (
        state,
        rec,
        jnp.zeros((n_rows + 1, n), y0.dtype).at[0].set(y0),
        jnp.zeros((n_rows + 1,), tdt).at[0].set(ts[0]),
    )
    state, rec, ys_buf, tn = while_any(_going(ts[-1]), body, init)
    done = rows <= state.acc
    ys = jnp.where(done[:, None], ys_buf[:n_rows], _nan_unless_ok(state))
    t_nodes = jnp.where(done, tn[:n_rows], state.t)
    return state, rec, ys, t_nodes, rows.astype(jnp.int32)


def _interpolated(cfg, attempt_to, state, rec, y0, ts, block=0):
    """One flat loop to the last output time: the steps ignore the other output times,
    and every output inside an accepted step is the step's interpolant. With `block`,
    one small solve's record is written by blocks of that many steps (`_by_blocks`)."""
    method = cfg.method
    n_out, n = ts.shape[0], y0.shape[0]
    tdt = ts.dtype
    last_row = n_out - 1
    window = output_window(n_out, n)

    def body(c):
        s, rec, i, ys, out_step, out_theta = c
        new, rec, taken = attempt_to(ts[-1], s, rec)
        t_a, h_a, t_b = taken.t, taken.h, new.t
        coeffs = step_coefficients(method, h_a, taken.y, taken.y1, taken.k_next, taken.ks)
        # Computed once per step, not once per output row inside a fused evaluation.
        coeffs = jax.lax.optimization_barrier(coeffs)

        def outputs_at(rows, i):
            # The interpolant at the output rows `rows`; which of them lie in this step
            # (rows before `i` were written by earlier steps).
            t_rows = ts[jnp.minimum(rows, last_row)]
            inside = taken.accept & (rows >= i) & (rows < n_out) & (t_rows <= t_b)
            theta = jnp.where(t_rows >= t_b, 1, (t_rows - t_a) / h_a).astype(tdt)
            return inside, theta, evaluate_step(coeffs, theta, taken.y1)

        i0 = i
        if window >= n_out - 1:
            # One pass over every row (the last one is a spare): a select, no scatter.
            inside, theta, y_rows = outputs_at(jnp.arange(n_out + 1), i)
            ys = jnp.where(inside[:, None], y_rows, ys)
            out_step = jnp.where(inside, new.acc, out_step)
            out_theta = jnp.where(inside, theta, out_theta)
            i = i + jnp.sum(inside, dtype=i.dtype)
        else:
            # The next `window` outputs at a time, while the step holds more; those
            # inside it are written (the others go to the spare last row).
            def due(w):
                i = w[0]
                return taken.accept & (i < n_out) & (ts[jnp.minimum(i, last_row)] <= t_b)

            def emit(w):
                i, ys, out_step, out_theta = w
                rows = i + jnp.arange(window)
                inside, theta, y_rows = outputs_at(rows, i)
                rows = jnp.where(inside, rows, n_out)
                return (
                    i + jnp.sum(inside, dtype=i.dtype),
                    ys.at[rows].set(y_rows),
                    out_step.at[rows].set(new.acc),
                    out_theta.at[rows].set(theta),
                )

            i, ys, out_step, out_theta = while_any(due, emit, (i, ys, out_step, out_theta))
        # `mxstep` counts the attempts since the last output.
        new = dataclasses.replace(new, tries=jnp.where(i > i0, 0, new.tries))
        return new, rec, i, ys, out_step, out_theta

    outputs = (
        jnp.asarray(1, jnp.int32),
        jnp.full((n_out + 1, n), jnp.nan, y0.dtype).at[0].set(y0),  # the last: a spare
        jnp.zeros((n_out + 1,), jnp.int32),
        jnp.ones((n_out + 1,), tdt),
    )
    if block:
        # (A block's loop carries the outputs too: with few of them, under the limit.)
        def going(c):
            return (c[1] < n_out) & (c[0].status == SUCCESS)

        def run_block(c, staged, base, full):
            def one(c):
                (s, *outputs), staged = c
                s, part, *outputs = body((s, _with_parts(rec, staged, base), *outputs))
                return (s, *outputs), _parts(part)

            more = lambda c: going(c[0]) & ~full(c[0][0])  # noqa: E731
            return jax.lax.while_loop(more, one, (c, staged))

        (state, _, ys, out_step, out_theta), parts = _by_blocks(
            _parts(rec), block, going, run_block, (state, *outputs)
        )
        rec = _with_parts(rec, parts)
    else:
        state, rec, _, ys, out_step, out_theta = while_any(
            lambda c: (c[2] < n_out) & (c[0].status == SUCCESS), body, (state, rec, *outputs)
        )
    return state, rec, ys[:n_out], out_step[:n_out], out_theta[:n_out]
