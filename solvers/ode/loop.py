"""The stepping loop of `odeint`: one step attempt at a time, failure, recording.

A `lax.while_loop` tries one step at a time from `(t, y)` (`attempt`). By default each
output time `ts[i]` is a step end: a step that would pass it is shortened to land on it
exactly. With `interpolate=True` the steps go straight to `ts[-1]` and every output
inside an accepted step is the step's interpolant; with `dense`, every accepted step is
an output row. The four ways of producing the outputs are in `solvers.ode.outputs`; the
step-size control in `solvers.ode.controller`.

Derivatives never go through the controller: the step sizes, the acceptance decisions
and the output times enter as constants (`stop_gradient`), so differentiating the loop
itself gives the derivative of the discrete solution with the accepted steps held
fixed.

The loop stops early with a status when a step fails for good: `mxstep` attempts
within one output interval (`MAX_STEPS`), a non-finite state (`NONFINITE`), or a step
size below the resolution of `t` (`DT_UNDERFLOW`, typically a stiff problem given to
an explicit method). The rows of `ys` not reached stay NaN.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from implicitdiff.internal import any_over_batch, vmap_size

from . import controller, progress
from .blocks import block_size, is_rows
from .controller import ERR_ACC_MIN
from .info import DT_UNDERFLOW, EVENT, MAX_STEPS, NONFINITE, SUCCESS
from .methods import AbstractMethod, StageTolerance, select, stage_report
from .state import RecordBuffers, StepState

__all__ = [
    "KEEP_ALL_MAX",
    "LINEARIZE_CHUNK",
    "RECORD_MAX",
    "SEGMENT_STEPS_MAX",
    "LoopConfig",
    "Taken",
    "attempt",
    "carrier",
    "checkpoint_every",
    "checkpoint_slots",
    "end_slot",
    "keeps_every_start",
    "record_block",
    "solve_batch",
    "stepper",
    "while_any",
    "write_end",
]


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    """Static options of one integration (hashable)."""

    method: AbstractMethod
    rtol: float
    atol: float
    mxstep: float  # attempts per output interval (may be inf)
    hmax: float
    dt: float | None  # fixed step (fixed-step methods)
    err_size: int | None = None  # measure the error on the first `err_size` entries only
    event: Any = None  # g(y, t, params): stop before the first step across a zero of g
    record: int = 0  # >0: record up to this many accepted steps (checkpointed adjoint)
    checkpoints: int = 0  # >0: that many checkpoints when recording (0: `checkpoint_every`)
    interpolate: bool = False  # outputs from the step interpolant, not steps onto them
    dense: int = 0  # >0: output every accepted step, up to this many (dense output)
    progress: bool = False

    @property
    def stage_tol(self) -> StageTolerance:
        """The accuracy of an implicit method's stage solves: the error control's."""
        return StageTolerance(rtol=self.rtol, atol=self.atol, size=self.err_size)


#: Steps the checkpointed adjoint's sweep linearises at once (see
#: `solvers.ode.adjoints.sweep`); a segment between checkpoints holds a multiple of it.
LINEARIZE_CHUNK = 8


#: The most numbers (over a `vmap` batch) the checkpointed adjoint's record may take to
#: keep the start of every step (the state and the method's carry). Below it the sweep
#: replays no step, which saves about one forward step per step: measured on CPU, the
#: gradient of ROBER, HIRES, VDPOL and OREGO runs 10-33% faster (bdf, radau5, rodas5p).
KEEP_ALL_MAX = 2**20


#: The most numbers (over a `vmap` batch) the checkpointed adjoint's record may take
#: when it cannot keep every step's start (2^23: 64 MB in double precision): its
#: segments are then made as long as that allows, up to `SEGMENT_STEPS_MAX` steps, so
#: that a solve of fewer steps replays none.
RECORD_MAX = 2**23

#: The longest segment of a record that cannot keep every step's start. Each of its
#: rows is filled and read whether the solve reaches it or not, so segments far longer
#: than a solve's steps only cost. Measured on CPU with `max_steps=4096`: segments of
#: 512 steps against the 64 of `sqrt(max_steps)` make the gradient 15 to 33% faster on
#: the Brusselator (line of 64, 256 and 1024 points; 16 x 16 grid) and 64 and 1000
#: copies of ROBER (bdf and rodas5p), and `radau5` on the 64-point line, whose rows
#: then held its factors too, as fast; segments of 3000 steps made that one 2x slower.
SEGMENT_STEPS_MAX = 512


def checkpoint_slots(record: int, every: int) -> int:
    """The checkpoint slots of a record of `record` steps with a checkpoint every
    `every` steps: one per segment, the solve's end (`write_end`) and a spare."""
    return record // every + 3


def checkpoint_every(
    record: int, numbers: int = 0, checkpoints: int = 0, checkpoint_numbers: int = 0
) -> int:
    """Accepted steps between two checkpoints of the state when recording `record`
    steps whose starts hold `numbers` numbers each (the state and the carry as a replay
    reads it, over the batch) and whose checkpoints hold `checkpoint_numbers` each (the
    state and the whole carry; `numbers` if not given). With `checkpoints` given,
    `record / checkpoints` (rounded up, and up to a multiple of `LINEARIZE_CHUNK` once
    it is that large). Otherwise more than `record` (a multiple of `LINEARIZE_CHUNK`,
    so that even the step that overflows the record keeps its start: one segment) when
    that fits in `KEEP_ALL_MAX`; else the longest segments (a multiple of
    `LINEARIZE_CHUNK`, at most `SEGMENT_STEPS_MAX`) whose record, the checkpoints and
    one segment, fits in `RECORD_MAX` numbers, or in the record of the shortest
    segments allowed if that is larger: about `sqrt(record)` steps (rounded down to a
    multiple of `LINEARIZE_CHUNK` once it is that large), the number of checkpoints
    too."""
    record = max(record, 1)

    def up(every):
        return every if every <= LINEARIZE_CHUNK else -(-every // LINEARIZE_CHUNK) * LINEARIZE_CHUNK

    if checkpoints:
        return up(-(-record // checkpoints))
    whole = -(-(record + 1) // LINEARIZE_CHUNK) * LINEARIZE_CHUNK
    if 0 < numbers and (whole + 1) * numbers <= KEEP_ALL_MAX:
        return whole
    every = math.isqrt(record)
    every = every - every % LINEARIZE_CHUNK if every >= LINEARIZE_CHUNK else every
    if numbers <= 0:
        return every
    per_checkpoint = checkpoint_numbers or numbers

    def memory(e):  # as `initial_state` allocates the record
        return checkpoint_slots(record, e) * per_checkpoint + (e + 1) * numbers

    budget = max(RECORD_MAX, memory(every))
    if whole <= SEGMENT_STEPS_MAX and memory(whole) <= budget:
        return whole
    # The longest multiple of the chunk, up to `SEGMENT_STEPS_MAX`, within the budget
    # (at most 64 lengths to try; `memory` is not monotone in the length).
    longest = every
    for e in range(LINEARIZE_CHUNK, min(whole, SEGMENT_STEPS_MAX) + 1, LINEARIZE_CHUNK):
        if e > longest and memory(e) <= budget:
            longest = e
    return longest


def keeps_every_start(every: int, slots: int) -> bool:
    """Whether a record of `slots` step times (`max_steps + 1`) with a checkpoint every
    `every` steps kept every step's start, that of a step past `max_steps` too: one
    segment, nothing to replay. (With `every == max_steps`, such a step's start takes
    the first one's slot, and the first segment is replayed from its checkpoint.)"""
    return every > slots - 1


def solve_batch(*trees) -> int:
    """The largest `vmap` batch any leaf of `trees` is traced under (1 outside)."""
    return max((vmap_size(x) for x in jax.tree_util.tree_leaves(trees)), default=1)


def record_block(every: int, slots: int, rows: Any, batch: int) -> int:
    """Steps per block when a record is written and read by blocks (see
    `solvers.ode.blocks`), else 0: a record of `slots` step times with a checkpoint
    every `every` steps that keeps every step's start (`keeps_every_start`), whose
    buffers (the leaves of `rows`, steps first) have rows small enough (`block_size`),
    of one solve (`batch` 1)."""
    if not keeps_every_start(every, slots):
        return 0
    return block_size(rows, batch)


def stepper(field, method: AbstractMethod):
    """One step of `method` on `field` (called `field(y, t, *params)`):
    `step(y, carry, t, h, params, tol, end=None) -> (y1, y_error, carry1, ok,
    stages)`, with `carry` the method's (see `solvers.ode.methods`). The adjoint's
    replay of a recorded step passes its end `end`, the solve's `y1` and carry (a
    `StepEnd`, see `AbstractMethod.replay_step`).

    A field may define its own `step(method, y, carry, t, h, params, tol, end=None)`:
    the forward sensitivities' field steps as the derivative of the step it
    differentiates."""
    own = getattr(field, "step", None)
    if own is not None:
        return lambda y, k1, t, h, params, tol, end=None: own(method, y, k1, t, h, params, tol, end)

    def f(y, t, params):
        return field(y, t, *params)

    def step(y, k1, t, h, params, tol, end=None):
        if end is None:
            return method.step_with_stages(f, y, k1, t, h, params, tol=tol)
        return method.replay_step(f, y, k1, t, h, params, end, tol=tol)

    return step


def carrier(field, method: AbstractMethod):
    """The first carry of `method` on `field`: `carry0(y0, k0)`. A field may define its
    own `initial_carry(method, y0, k0)` (the forward sensitivities' pair)."""
    own = getattr(field, "initial_carry", None)
    if own is not None:
        return lambda y0, k0: own(method, y0, k0)
    return method.initial_carry


def while_any(cond, body, carry):
    """`lax.while_loop` whose predicate is not batched under `vmap`: the loop runs while
    any element's `cond` holds, and `body` leaves the finished elements unchanged.

    The usual batching of a loop with a batched predicate selects between the old and
    the new carry for every element at every iteration, a full pass over each buffer
    (the recorded steps of the checkpointed adjoint are `max_steps` long); here a
    finished element's writes go to spare slots instead.
    """
    return jax.lax.while_loop(lambda c: any_over_batch(cond(c)), body, carry)


class Taken(eqx.Module):
    """A step attempt, for the outputs inside it: its start, size, end, carried
    derivatives and stages, whether it was accepted and whether the element was live."""

    t: Any
    h: Any
    y: Any
    y1: Any
    k_next: Any
    ks: list
    accept: Any
    live: Any


def attempt(cfg: LoopConfig, step, f, params, span, target, s: StepState, rec):
    """One step attempt towards `target` (`span`: the solve's first and last times,
    for the progress output): the new `StepState` and `RecordBuffers` (or `None`), and
    the attempt itself (`Taken`)."""
    method = cfg.method
    tdt = s.t.dtype
    eps = float(jnp.finfo(tdt).eps)
    t, y, k, h = s.t, s.y, s.k, s.h
    # The loops run while any element of a vmap batch is live (an unbatched predicate,
    # `while_any`), so an element that is done must not change here.
    live = (t < target) & (s.status == SUCCESS)
    to_end = target - t
    # Stretch a step by up to 1% (adaptive) rather than leave a sliver before an output.
    last = to_end <= h * (1.01 if method.adaptive else 1 + 64 * eps)
    h_step = jnp.where(last, to_end, h)
    y1, err, k1, ok, ks = step(y, k, t, h_step.astype(tdt), params, cfg.stage_tol)
    report = stage_report(ok)
    ok = report.converged
    t1 = jnp.where(last, target, t + h_step)
    slope1 = method.slope(k1)
    jac_work, lu_work = method.attempt_work(k1)
    finite = jnp.all(jnp.isfinite(y1)) & jnp.all(jnp.isfinite(slope1))
    if method.adaptive:
        ratio = jax.lax.stop_gradient(
            controller.rms_ratio(err, y, y1, cfg.rtol, cfg.atol, cfg.err_size)
        )
        good = ok & finite & jnp.isfinite(ratio)
        accept = good & (ratio <= 1.0)
        before = (s.h_acc, s.err_acc, s.acc >= 1)
        h_new = method.next_size(h_step, ratio, good, accept, jax.lax.stop_gradient(k1), before)
        # A step shortened to hit an output says little about the step size.
        h_new = jnp.where(accept & last, jnp.maximum(h_new, h), h_new)
        h_new = jnp.minimum(h_new, cfg.hmax)
    else:
        accept = finite
        h_new = h
        ratio = jnp.zeros((), tdt)
    accept = accept & live
    h_new = jax.lax.stop_gradient(jnp.where(live, h_new, h).astype(tdt))
    tries = s.tries + live.astype(s.tries.dtype)
    status = s.status
    if not method.adaptive:
        status = jnp.where(live & ~finite, NONFINITE, status)
    # Below the resolution of `t` where the solve stands (not where it is going: on a
    # long span the first steps are legitimately far smaller than the final time's ulp).
    tiny = h_new <= 4 * eps * jnp.maximum(jnp.abs(t), jnp.finfo(tdt).tiny)
    underflow = live & ~accept & tiny
    status = jnp.where(underflow, jnp.where(finite, DT_UNDERFLOW, NONFINITE), status)
    status = jnp.where(live & ~(accept & last) & (tries >= cfg.mxstep), MAX_STEPS, status)

    g = s.g
    if cfg.event is not None:
        # A step across a zero of the event function is not taken: the loop stops
        # before it (status EVENT), with `h` the size of the step that crossed.
        g1 = jnp.sign(cfg.event(y1, t1, params))
        crossed = accept & (g1 != s.g) & (status == SUCCESS)
        status = jnp.where(crossed, EVENT, status)
        h_new = jnp.where(crossed, h_step, h_new)
        accept = accept & ~crossed
    acc = s.acc + accept.astype(jnp.int32)
    new = StepState(
        t=jnp.where(accept, t1, t),
        y=jnp.where(accept, y1, y),
        k=select(accept, k1, k),
        h=h_new,
        acc=acc,
        rej=s.rej + (live & ~accept).astype(jnp.int32),
        failed=s.failed + (live & ~ok).astype(jnp.int32),
        iterations=s.iterations + live.astype(jnp.int32) * report.iterations,
        jacobians=s.jacobians + live.astype(jnp.int32) * jnp.asarray(jac_work, jnp.int32),
        factorisations=s.factorisations + live.astype(jnp.int32) * jnp.asarray(lu_work, jnp.int32),
        h_acc=jax.lax.stop_gradient(jnp.where(accept, h_step, s.h_acc).astype(tdt)),
        err_acc=jnp.where(accept, jnp.maximum(ratio, ERR_ACC_MIN), s.err_acc).astype(tdt),
        tries=tries,
        status=status.astype(jnp.int32),
        g=g,
    )
    if rec is not None:
        rec, full = _record(cfg, rec, s, new, h_step, y1, k1, accept, live)
        new = dataclasses.replace(
            new, status=jnp.where(full, MAX_STEPS, new.status).astype(jnp.int32)
        )
    if cfg.progress:
        progress.report(new, *span)
    taken = Taken(t=t, h=h_step, y=y, y1=y1, k_next=slope1, ks=ks, accept=accept, live=live)
    return new, rec, taken


def _record(cfg, rec, s, new, h_step, y1, k1, accept, live):
    """The record after an attempt. Writes never read the buffer (a read-modify-write
    of a batched buffer makes XLA copy it every step): an accepted step goes to the
    next free slot (a rejected attempt's write there is overwritten later), and what
    is not due goes to a spare last slot. Also whether the record is now full."""
    acc = new.acc
    full = accept & (acc > cfg.record)
    if rec.base is not None:
        # One block of a record written by blocks (`BlockRows`, see `solvers.ode.blocks`):
        # step k in row k - base (a rejected attempt's row is taken by the next accepted
        # step). No spare row: the block's loop (`outputs._by_blocks`) runs
        # only while the solve is live and the block is not full.
        i = s.acc - rec.base
        put = lambda rows, x: rows.set(i, x)  # noqa: E731
        k_rows = cfg.method.replay_carry(s.k)
        rec = dataclasses.replace(
            rec,
            t=put(rec.t, s.t),
            h=put(rec.h, h_step),
            y_last=put(rec.y_last, s.y),
            k_last=jax.tree_util.tree_map(put, rec.k_last, k_rows, is_leaf=is_rows),
        )
        return rec, full
    slot = jnp.minimum(s.acc, cfg.record)
    every = rec.y_last.shape[0] - 1  # (see `initial_state`)
    # The start of the latest `every` steps, step k in slot k % every, its carry as a
    # replay with a known end reads it (`replay_carry`): the sweep then needs no
    # replay for the last segment (for a short solve, at all). A rejected attempt
    # writes the same state to the same slot.
    row = jnp.where(live, s.acc % every, every)
    y_cp, k_cp = rec.y_cp, rec.k_cp
    if not keeps_every_start(every, rec.t.shape[0]):
        # The checkpoints, with the whole carry: a replay steps on from them. With
        # every step's start kept, the sweep uses the first one alone (written by
        # `initial_state`) and the solve's end (`write_end`), so an attempt writes
        # none. Written only when one is due (for one element of a batch, the others
        # write to the spare last slot): a carry may hold a factorisation.
        spare = y_cp.shape[0] - 1
        store = accept & (acc % every == 0) & (acc // every < spare)
        cp = jnp.where(store, acc // every, spare)

        def write():
            return y_cp.at[cp].set(y1), jax.tree_util.tree_map(
                lambda b, x: b.at[cp].set(x), k_cp, k1
            )

        y_cp, k_cp = jax.lax.cond(any_over_batch(store), write, lambda: (y_cp, k_cp))
    rec = RecordBuffers(
        t=rec.t.at[slot].set(s.t),
        h=rec.h.at[slot].set(h_step),
        y_cp=y_cp,
        k_cp=k_cp,
        y_last=rec.y_last.at[row].set(s.y),
        k_last=jax.tree_util.tree_map(
            lambda b, x: b.at[row].set(x), rec.k_last, cfg.method.replay_carry(s.k)
        ),
    )
    return rec, full


def end_slot(steps, every: int, slots: int):
    """The checkpoint slot (of `slots`, the last a spare) holding the end of a solve of
    `steps` accepted steps with a checkpoint every `every` steps (`write_end`): the
    slot after its last step's segment, `(steps - 1) // every + 1`, or 0 (no step)."""
    slot = jnp.where(steps >= 1, (steps - 1) // every + 1, 0)
    return jnp.minimum(slot, slots - 1).astype(jnp.int32)


def write_end(rec: RecordBuffers, state: StepState, method: AbstractMethod) -> RecordBuffers:
    """The record with the solve's end, where its last step ended, in `end_slot`: its
    state, and its carry too for a `method` whose replay reads the end's carry
    (`AbstractMethod.replay_end`). With every step's start kept or not, the sweep reads
    each step's end there or from the next step's start, and replays no corrector
    (see `AbstractMethod.replay_step`)."""
    every = rec.y_last.shape[0] - 1  # (see `initial_state`)
    slot = end_slot(state.acc, every, rec.y_cp.shape[0])
    rec = dataclasses.replace(rec, y_cp=rec.y_cp.at[slot].set(state.y))
    if method.replay_end(state.k) is None:
        return rec
    k_cp = jax.tree_util.tree_map(lambda b, x: b.at[slot].set(x), rec.k_cp, state.k)
    return dataclasses.replace(rec, k_cp=k_cp)


def initial_state(
    cfg: LoopConfig, f, y0, ts, params, carry0=None
) -> tuple[StepState, RecordBuffers | None]:
    """The state at `ts[0]` (with the first step size) and the empty record."""
    method = cfg.method
    tdt = ts.dtype
    t0 = ts[0]
    k0 = f(y0, t0, params)
    carry0 = (carry0 or method.initial_carry)(y0, k0)
    if method.adaptive:
        h0 = controller.initial_step(
            method, f, y0, k0, t0, params, cfg.rtol, cfg.atol, cfg.err_size
        )
        h0 = jax.lax.stop_gradient(h0)
    else:
        h0 = jnp.asarray(cfg.dt, tdt)
    h0 = jnp.minimum(jnp.asarray(h0, tdt), jnp.asarray(cfg.hmax, tdt))
    zero = jnp.asarray(0, jnp.int32)
    status0 = jnp.where(jnp.all(jnp.isfinite(k0)), SUCCESS, NONFINITE).astype(jnp.int32)
    g0 = None if cfg.event is None else jnp.sign(cfg.event(y0, t0, params))
    state = StepState(
        t=t0,
        y=y0,
        k=carry0,
        h=h0,
        acc=zero,
        rej=zero,
        failed=zero,
        iterations=zero,
        tries=zero,
        status=status0,
        jacobians=zero,
        factorisations=zero,
        h_acc=h0,
        err_acc=jnp.ones((), tdt),
        g=g0,
    )
    rec = None
    if cfg.record:
        n, dt = y0.shape[0], y0.dtype
        # Every step's start is kept when the record stays small, over the batch of an
        # enclosing `vmap` too (the buffers are per element).
        kept = method.replay_carry(carry0)
        size = lambda tree: sum(math.prod(jnp.shape(x)) for x in jax.tree_util.tree_leaves(tree))  # noqa: E731
        per_step, per_checkpoint = n + size(kept), n + size(carry0)
        batch = solve_batch(y0, ts, params)
        every = checkpoint_every(
            cfg.record, per_step * batch, cfg.checkpoints, per_checkpoint * batch
        )
        n_cp = checkpoint_slots(cfg.record, every)
        slots = lambda m: lambda x: jnp.zeros((m,) + jnp.shape(x), jnp.result_type(x))  # noqa: E731
        rec = RecordBuffers(
            t=jnp.zeros((cfg.record + 1,), tdt),  # the last one is a spare
            h=jnp.zeros((cfg.record + 1,), tdt),
            y_cp=jnp.zeros((n_cp, n), dt).at[0].set(y0),
            k_cp=jax.tree_util.tree_map(
                lambda b, x: b.at[0].set(x), jax.tree_util.tree_map(slots(n_cp), carry0), carry0
            ),
            y_last=jnp.zeros((every + 1, n), dt),  # the last one is a spare
            k_last=jax.tree_util.tree_map(slots(every + 1), kept),
        )
    return state, rec
