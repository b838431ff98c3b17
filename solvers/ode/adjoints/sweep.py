"""The backward sweep of `odeint(adjoint="checkpoint")`: the discrete adjoint.

The forward pass (`integrate` with `record`) keeps each accepted step's start
time and size, the state every `every` steps (see `loop.checkpoint_every`) with the
method's carry, the starts of the latest `every` steps with the carry as a replay with
a known end reads it (`AbstractMethod.replay_carry`), and the solve's end. Every step's
end is therefore known to the sweep. The sweep walks the segments of `every`
steps last first: it recomputes a segment's states from its checkpoint (the last
segment's were kept), then pulls the cotangent back through each step with one
`jax.vjp` of the step. A small system keeps every step's start (`every` above
`max_steps`, see `loop.checkpoint_every`): one segment, and no replay is compiled.
Outputs inside a step (`interpolate=True`) are linear in the step's stages, so their
cotangents join that same pull-back.

Only the pull-backs are sequential: the linearisations (`jax.vjp`'s forward half,
where an implicit step evaluates its Jacobian and factors its stage matrix at the
solution) depend only on the recomputed states. So for one solve of at least
`LINEARIZE_MIN_STATES` states, `LINEARIZE_CHUNK` steps are linearised at once under
`vmap`, their pull-backs kept as pytrees with a leading chunk axis, and then applied
one at a time, last first. The batch runs the chunk's factorisations and field
evaluations together (a narrow band's LU of 512 unknowns costs about a seventh as much
per matrix in a batch of 64 as alone); the price is a chunk's linearisations held at
once and a last chunk that may run past its segment's steps. Where a solver the step's
linearisation factors with (`AbstractMethod.linearisation_solvers`: the stage solver,
for radau5 the solver of its coupled stages) is no faster in a batch on CPU
(`LinearSolver.factors_in_batches_at`: a wide band's blocked LU, a long narrow band's
partitions), the steps are linearised one at a time there (`chunk_size`).
The replay knows each step's end, its state and carry (the next step's start, the
next checkpoint, or for the last step the solve's end, `loop.write_end`), and hands it
to the method (`AbstractMethod.replay_step`): BDF takes the state as its corrector's
solution, Radau5 and the ESDIRK methods the stages its carry holds, instead of
iterating again.

A small solve that kept every step's start reads its record a block of steps at a
time (`solvers.ode.blocks`): the loop over a block's steps then touches small copies
only, which XLA's CPU runtime runs without its task scheduler. With `interpolate=True`
its outputs' moments are summed per step before the sweep, and a block copies its
steps' rows of those sums too.

The sweep is written for a batch: every array has a leading batch axis, and the loops
run to the batch's largest step count with the steps past an element's own count
masked. One solve is a batch of one (`CheckpointSweep`); `vmap` of it is one batched
sweep (`_BatchedSweep`), not a sweep mapped per element. The gradient of a `vmap`ped
solve (a training batch) calls the batched sweep directly
(`CheckpointAdjoint.backward_batched`) with the parameters the batch shares left shared: each
step's `vjp` is then taken over the whole batch at once, so their cotangent is summed
over the batch inside each matrix product and never held per element (for a
`(64, 64)` weight and a batch of 32, that would be a `(32, 64, 64)` array per step).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from implicitdiff import Primitive
from implicitdiff.internal import any_over_batch, max_over_batch, per_element

from ..blocks import BlockRows, is_rows
from ..interpolation import (
    BASIS_K_NEXT,
    BASIS_STAGES,
    BASIS_Y,
    BASIS_Y1,
    basis_from_moments,
    output_moments,
    pull_back_outputs,
)
from ..loop import (
    KEEP_ALL_MAX,
    LINEARIZE_CHUNK,
    LoopConfig,
    end_slot,
    keeps_every_start,
    record_block,
    stepper,
)
from ..methods import StepEnd, combine_carry, partition_carry, select
from ..outputs import output_window

__all__ = ["CheckpointSweep", "batch_first", "batched_sweep", "shared_or_first"]

_NO_VJP = (
    "odeint(adjoint='checkpoint') is differentiable once in reverse mode (and then to "
    "any order in forward mode, e.g. jax.hessian = jacfwd(jacrev)). For "
    "reverse-over-reverse (grad of grad), use adjoint='backsolve'."
)


class _Sweep(Primitive):
    """What both sweeps share: forward mode through the sweep's own code (`hessian` =
    `jacfwd(jacrev)`), and a clear refusal of reverse-over-reverse."""

    no_vjp_message = _NO_VJP

    def jvp(self, primals, tangents):
        y_cp, g, pd, pn, rec = primals
        d_cp, d_g, d_pd, _, _ = tangents
        run = lambda y_cp, g, pd: self.expand(y_cp, g, pd, pn, rec)  # noqa: E731
        return jax.jvp(run, (y_cp, g, pd), (d_cp, d_g, d_pd))


def batch_first(x, d, size):
    """`x` with its batch axis `d` first, or broadcast to a leading axis of `size` when
    it has none (`d` None)."""
    if d is None:
        return jnp.broadcast_to(x[None], (size, *jnp.shape(x)))
    return jnp.moveaxis(x, d, 0)


def shared_or_first(p, dims):
    """A parameter pytree for the batched sweep: `(values, axes)` with each batched
    leaf's batch axis moved first (axis 0) and each shared leaf (None) left alone."""
    values = jax.tree_util.tree_map(lambda x, d: x if d is None else jnp.moveaxis(x, d, 0), p, dims)
    return values, jax.tree_util.tree_map(lambda x, d: None if d is None else 0, p, dims)


class CheckpointSweep(_Sweep):
    """`(y0_bar, pd_bar)` of one solve: the cotangent `g` of its outputs pulled back
    through the recorded steps.

    Inputs `(y_cp, g, pd, pn, record)` with `y_cp = (checkpoints, f at them, latest
    states, f at them)` and `record = (t, h, out_step, out_theta, steps)` (see
    `solvers.ode.state.Record`).
    Params: `f` (the flat field `f(y, t, pd, pn)`), `loop` (the forward solve's
    `LoopConfig`), `every` (steps between checkpoints), `per_element` (the record's
    `Record.per_element`: the steps replay with `in_batch()` as the solve ran them, so
    a band's factors carried from step to step keep the layout they were recorded in;
    the expansion may run after the rule that bound it returned, so this is a param).
    """

    def __init__(
        self, y_cp_aval, g_aval, pd_aval, pn_aval, rec_aval, *, f, loop, every, per_element
    ):
        self.in_avals = (y_cp_aval, g_aval, pd_aval, pn_aval, rec_aval)
        self.out_aval = (jax.ShapeDtypeStruct(g_aval.shape[1:], g_aval.dtype), pd_aval)
        self.params = dict(f=f, loop=loop, every=every, per_element=per_element)
        super().__init__()

    def expand(self, y_cp, g, pd, pn, rec):
        one = lambda x: x[None]  # noqa: E731
        unbatched = (_axes_like(pd, None), _axes_like(pn, None))
        a, pd_bar = per_element(_sweep, self.per_element)(
            self.f, self.loop, self.every, jax.tree_util.tree_map(one, y_cp), g[None], pd,
            pn, jax.tree_util.tree_map(one, rec), unbatched,
        )  # fmt: skip
        return a[0], pd_bar

    def batch(self, axis_data, args, dims):
        # `vmap` of the sweep (over cotangents, for `jacrev`, say): the batched sweep
        # with a cotangent of `pd` per element, the shared parameters broadcast so that
        # the batched sweep gives each element its own.
        y_cp, g, pd, pn, rec = args
        d_cp, d_g, d_pd, d_pn, d_rec = dims
        size = axis_data.size
        first = lambda x, d: batch_first(x, d, size)  # noqa: E731
        pd = jax.tree_util.tree_map(first, pd, d_pd)
        # The batched sweep takes a copy of the record per element. A record shared by
        # the whole batch (one solve, many cotangents) is copied a group of elements
        # at a time, of at most `KEEP_ALL_MAX` numbers (one element if its record alone
        # is larger): the cotangents go through in groups, one after the other.
        numbers = sum(x.size for x in jax.tree_util.tree_leaves(y_cp))
        group = max(1, KEEP_ALL_MAX // max(numbers, 1))
        if not jax.tree_util.tree_leaves((d_cp, d_rec)) and size > group:
            params = dict(f=self.f, loop=self.loop, every=self.every, per_element=self.per_element)

            def one(xs):
                g, pd, pn = xs
                return CheckpointSweep.apply(y_cp, g, pd, pn, rec, **params)

            pn = jax.tree_util.tree_map(first, pn, d_pn)
            return jax.lax.map(one, (first(g, d_g), pd, pn), batch_size=group), 0
        out = batched_sweep(
            jax.tree_util.tree_map(first, y_cp, d_cp),
            first(g, d_g),
            (pd, _axes_like(pd, 0)),
            shared_or_first(pn, d_pn),
            jax.tree_util.tree_map(first, rec, d_rec),
            f=self.f,
            loop=self.loop,
            every=self.every,
            per_element=self.per_element,
        )
        return out, 0


def batched_sweep(y_cp, g, pd, pn, rec, *, f, loop, every, per_element):
    """The sweep of a batch of solves: `(y0_bar (batch, n), pd_bar)`. `y_cp`, `g` and
    `rec` have the batch axis first; `pd = (values, axes)` and `pn = (values, axes)`
    give each parameter leaf's batch axis (0) or None for a leaf the batch shares,
    whose cotangent is then summed over the batch. `per_element`: the record's
    `Record.per_element` (see `CheckpointSweep`)."""
    (pd, pd_axes), (pn, pn_axes) = pd, pn
    flat = lambda v, axes: tuple(jax.tree_util.tree_structure(v).flatten_up_to(axes))  # noqa: E731
    return _BatchedSweep.apply(
        y_cp, g, pd, pn, rec, f=f, loop=loop, every=every,
        p_axes=(flat(pd, pd_axes), flat(pn, pn_axes)), per_element=per_element,
    )  # fmt: skip


class _BatchedSweep(_Sweep):
    """`CheckpointSweep` over a batch of solves: a leading batch axis on `y_cp`, `g`
    and `record`; each leaf of `pd` and `pn` batched (axis 0) or shared, as the param
    `p_axes = (pd axes, pn axes)` (flat tuples of 0 or None) says. The cotangent of a
    shared leaf of `pd` is summed over the batch. Param `per_element` as for
    `CheckpointSweep`."""

    def __init__(
        self, y_cp_aval, g_aval, pd_aval, pn_aval, rec_aval, *, f, loop, every, p_axes,
        per_element,
    ):  # fmt: skip
        self.in_avals = (y_cp_aval, g_aval, pd_aval, pn_aval, rec_aval)
        self.out_aval = (jax.ShapeDtypeStruct(g_aval.shape[::2], g_aval.dtype), pd_aval)
        self.params = dict(f=f, loop=loop, every=every, p_axes=p_axes, per_element=per_element)
        super().__init__()

    def expand(self, y_cp, g, pd, pn, rec):
        pd_axes, pn_axes = self.p_axes
        axes = (_unflatten_like(pd, pd_axes), _unflatten_like(pn, pn_axes))
        sweep = per_element(_sweep, self.per_element)
        return sweep(self.f, self.loop, self.every, y_cp, g, pd, pn, rec, axes)


# The most numbers (`n_out * n`) for which the sweep sums the outputs' cotangents per
# step before it starts (`_sweep`), instead of a few rows at a time at each step.
_GROUPED_MAX = 4096
# The fewest states for which one solve's sweep linearises `LINEARIZE_CHUNK` steps at
# once. Measured on CPU (jit(grad), compile and run): a 128-state band system's
# gradient runs 27% faster in chunks of eight and compiles 40% slower; at 32 states
# (dense) and at 8 (HIRES, rodas5p: 25% faster, a third more compile time) the batch
# gains little against the loop's own overheads.
LINEARIZE_MIN_STATES = 100


def chunk_size(method: Any, size: int, n: int, every: int) -> int:
    """How many steps the sweep linearises at once: `gcd(every, LINEARIZE_CHUNK)` for
    one solve (`size` 1; a batch of solves already linearises its elements together)
    of at least `LINEARIZE_MIN_STATES` states, unless JAX's default backend is the CPU
    and a solver the method's linearisation factors with
    (`AbstractMethod.linearisation_solvers`) factors a batch no faster than one
    matrix after another (`LinearSolver.factors_in_batches_at`); else 1.

    Measured on CPU: the blocked LU of the 16 x 16 grid's band (512 unknowns,
    `lower = upper = 62` after reordering) takes 10.6 ms for eight matrices at once
    and 1.0-1.2 ms for one, and that grid's gradients run 12-45% faster step by step
    (kvaerno5, rodas5p, bdf). `radau5`'s replayed steps factor only their coupled
    band, three times as wide, which is not partitioned on the Brusselator lines: its
    gradient there takes about the same in chunks as step by step (256 points 98 ms
    against 102, 1024 points 422 against 408)."""
    if size != 1 or n < LINEARIZE_MIN_STATES:
        return 1
    solvers = method.linearisation_solvers(n)
    if jax.default_backend() != "cpu" or all(s.factors_in_batches_at(m) for s, m in solvers):
        return math.gcd(every, LINEARIZE_CHUNK)
    return 1


def _axes_like(tree: Any, axis: int | None) -> Any:
    return jax.tree_util.tree_map(lambda _: axis, tree)


def _unflatten_like(tree: Any, flat_axes: tuple) -> Any:
    return jax.tree_util.tree_structure(tree).unflatten(list(flat_axes))


def _map_batch(fn, size: int, in_axes: tuple):
    """`jax.vmap(fn, in_axes)` over a leading batch axis of `size` (each entry of
    `in_axes` 0, None, or a pytree of them); for a batch of one, `fn` on its only
    element: a step under `vmap` runs both branches of each `cond` whose predicate is
    batched (radau5's refined error estimate, say), and the batched forms of scans and
    gathers are slower."""
    if size != 1:
        return jax.vmap(fn, in_axes)

    def only(tree, axes):
        if axes is None or isinstance(axes, int):
            axes = _axes_like(tree, axes)
        return jax.tree_util.tree_map(
            lambda ax, x: x if ax is None else x[0], axes, tree, is_leaf=lambda ax: ax is None
        )

    def single(*args):
        out = fn(*(only(a, ax) for a, ax in zip(args, in_axes, strict=True)))
        return jax.tree_util.tree_map(lambda x: x[None], out)

    return single


def _sweep(f, loop: LoopConfig, every: int, y_cp, g, pd, pn, rec, p_axes):
    """The batched sweep: `(y0_bar (batch, n), pd_bar)`. Arrays carry a leading batch
    axis; `p_axes = (pd axes, pn axes)` are pytrees of 0 (batched) or None (shared).

    Each step is pulled back with the method's carry at its start (`k1`, by default
    `f(y, t)`) as an input, not recomputed: that value is also the end carry of the
    step before, so its cotangent is handed to that step, which computed it anyway.
    One field evaluation per step fewer, and one pull-back through the first carry,
    `initial_carry(y0, f(y0, t0))`, at the end. Carries are pytrees (each leaf with
    the batch axis first).
    """
    y_cp, k_cp, y_last, k_last = y_cp
    rec_t, rec_h, out_step, out_theta, steps = rec
    size, n_out, n = g.shape
    method = loop.method
    cap = rec_t.shape[1]
    window = output_window(n_out, n)
    pd_axes, pn_axes = p_axes
    step = stepper(f, method)
    chunk = chunk_size(method, size, n, every)
    block = 0
    if chunk == 1:
        rows0 = jax.tree_util.tree_map(lambda b: b[0], (rec_t, rec_h, y_last, k_last))
        block = record_block(every, cap, rows0, size)

    def one_step(y, k1, t, h, pd, pn, end=None):
        # One element's step from `y` with carry `k1`, with what its interpolant is
        # built from: (y1, k_next, f at y1, ks). With `end`, the step's end the solve
        # computed (`replay_step`).
        y1, _, k_next, _, ks = step(y, k1, t, h, (pd, pn), loop.stage_tol, end)
        return y1, k_next, method.slope(k_next), ks

    batch_step = _map_batch(one_step, size, (0, 0, 0, 0, pd_axes, pn_axes))
    batch_replay = _map_batch(one_step, size, (0, 0, 0, 0, pd_axes, pn_axes, 0))
    batch_field = _map_batch(f, size, (0, 0, pd_axes, pn_axes))

    def pick_row(x, i):
        # Row `i[e]` of each element `e`'s `x[e]`.
        return jnp.take_along_axis(x, i.reshape((size, 1) + (1,) * (x.ndim - 2)), axis=1)[:, 0]

    # The carries at the checkpoints as the record keeps every step's (`replay_carry`),
    # and the checkpoint slot holding each element's end (`loop.write_end`).
    k_cp_kept = method.replay_carry(k_cp)
    last_end = end_slot(steps, every, y_cp.shape[1])
    # What a replay reads of a step's end carry (`replay_end`; none for most methods).
    solve_end = (
        pick_row(y_cp, last_end),
        jax.tree_util.tree_map(lambda b: pick_row(b, last_end), method.replay_end(k_cp_kept)),
    )

    def step_at(k):
        # Step `k`'s start time and size, per element (the same `k` for all of them).
        k = jnp.minimum(k, cap - 1)
        return rec_t[:, k], rec_h[:, k]

    def masked(keep, x):
        # `x` where `keep` (a leading part of its shape), else 0; leaf by leaf.
        return select(keep, x, jax.tree_util.tree_map(jnp.zeros_like, x))

    def basis_of(sums, h):
        # Summed moments of each element's outputs inside a step, on the basis.
        return jax.vmap(lambda m, h: basis_from_moments(method, m, h))(sums, h)

    grouped = first = by_step = None
    if loop.interpolate and n_out * n <= _GROUPED_MAX:
        # Few numbers in all: the outputs' moments (`output_moments`) are summed per
        # step once, before the sweep.
        rows = jnp.arange(n_out)
        reached = (rows >= 1) & (out_step >= 1)
        g_reached = masked(reached, g)
        moments = jax.vmap(lambda th, g: output_moments(method, th, g))(out_theta, g_reached)
        if block and cap * moments[0].size // n_out <= KEEP_ALL_MAX:
            # One solve read by blocks: row `k` holds the sum of the outputs inside
            # step `k`, so that a block copies its steps' rows like the record's.
            inside = jnp.where(reached, out_step - 1, cap)  # (rows not reached are dropped)
            by_step = jax.vmap(
                lambda m, k: jnp.zeros((cap, *m.shape[1:]), m.dtype).at[k].add(m, mode="drop")
            )(moments, inside)
        else:
            # Each step's sum kept in its last row; a step then gathers one row, and
            # `ptr` jumps to the row before its first. Row 0 first, then the reached
            # rows by step (in order), then those not reached.
            big = jnp.iinfo(jnp.int32).max
            key = jnp.where(rows == 0, 0, jnp.where(reached, out_step, big))
            first = jax.vmap(lambda k: jnp.searchsorted(k, k, side="left"))(key).astype(jnp.int32)
            last_of = jax.vmap(lambda k: jnp.searchsorted(k, k, side="right") - 1)(key)
            grouped = jax.vmap(lambda m, i: jnp.zeros_like(m).at[i].add(m))(moments, last_of)

    def output_cotangents(k, h, active, ptr):
        """The cotangents of the outputs inside step `k` (of size `h`), on the
        interpolant's basis (`(batch, 3 + stages, n)`), and `ptr` moved past them."""
        if grouped is not None:
            rows = jnp.maximum(ptr, 0)[:, None]
            here = jnp.take_along_axis(out_step, rows, 1)[:, 0]
            hit = active & (ptr >= 1) & (here == k + 1)
            sums = masked(hit, jnp.take_along_axis(grouped, rows[:, :, None, None], 1)[:, 0])
            basis_ct = basis_of(sums, h)
            below = jnp.take_along_axis(first, rows, 1)[:, 0] - 1
            return basis_ct, jnp.where(hit, below, ptr)

        # `window` outputs at a time, the last first, while the step holds more.
        def one_window(ptr, basis_ct, active, out_step, out_theta, g, h):
            back = ptr - jnp.arange(window)
            rows = jnp.maximum(back, 0)
            inside = active & (back >= 1) & (out_step[rows] == k + 1)
            g_in = jnp.where(inside[:, None], g[rows], 0)
            ct = pull_back_outputs(method, out_theta[rows], g_in, h)
            return ptr - jnp.sum(inside, dtype=ptr.dtype), basis_ct + ct

        def due(s):
            ptr = s[0]
            here = jnp.take_along_axis(out_step, jnp.maximum(ptr, 0)[:, None], 1)[:, 0]
            return any_over_batch(jnp.any(active & (ptr >= 1) & (here == k + 1)))

        def gather(s):
            return jax.vmap(one_window)(*s, active, out_step, out_theta, g, h)

        basis = jnp.zeros((size, BASIS_STAGES + method.stages, n), g.dtype)
        ptr, basis_ct = jax.lax.while_loop(due, gather, (ptr, basis))
        return basis_ct, ptr

    def linearize_step(t, h, y, k1, end, stand_in):
        """The step from `(t, y)` of size `h` (per element) with carry `k1`, its end
        `end` (see `replay_step`), linearised: its pull-back, a pytree of
        the linearisation's values (see `jax.vjp`). Where `stand_in` (a masked element,
        see `linearize_chunk`), a recorded size of 0 (a solve that took no step) is
        replaced by a tiny one, whose stage matrix is about the identity over it."""
        tiny = jnp.sqrt(jnp.finfo(h.dtype).eps) * jnp.maximum(jnp.abs(t), 1)
        h = jnp.where(stand_in & (h == 0), tiny, h)
        # Only the carry's values are differentiated; its memory is replayed as it was.
        values, memory = partition_carry(k1)

        def step_values(y, values, pd):
            carry = combine_carry(values, memory)
            y1_, k_next, slope, ks = batch_replay(y, carry, t, h, pd, pn, end)
            return y1_, partition_carry(k_next)[0], slope, ks

        return jax.vjp(step_values, y, values, pd)[1]

    def pull_back_step(k, h, pullback, active, a, k1_bar, ptr, outputs_at=None, moments=None):
        """Step `k` (of size `h`) pulled back through its linearisation `pullback`: the
        cotangents of its start `y` and of `k1` from `a` and `k1_bar` (those of its end
        and of `f` there) and the outputs inside the step; the step's cotangent of `pd`;
        `ptr` moved past those outputs. `outputs_at(ptr)`, if given, returns the step
        count and cotangent of output `ptr` (from a block's copies, see `back_block`)
        in place of reading `out_step` and `g`; `moments`, if given, the step's summed
        output moments (`by_step`'s row, with `interpolate`)."""
        zeros = jnp.zeros_like(a)
        # A masked element pulls back zeros (see `linearize_chunk`), so it adds nothing
        # to `pd_bar`; its own cotangents are restored by the caller.
        a = masked(active, a)
        if loop.interpolate:
            if moments is None:
                basis_ct, ptr = output_cotangents(k, h, active, ptr)
            else:
                basis_ct = basis_of(masked(active, moments), h)
            # (The outputs' cotangents are zero for a masked element.)
            ct_y1 = a + basis_ct[:, BASIS_Y1]
            ct_slope = basis_ct[:, BASIS_K_NEXT]
            ct_ks = [basis_ct[:, BASIS_STAGES + r] for r in range(method.stages)]
            y_direct = basis_ct[:, BASIS_Y]
        else:
            # Every output is a step end: at most one lands on this step.
            if outputs_at is None:
                rows = jnp.maximum(ptr, 0)[:, None]
                here = jnp.take_along_axis(out_step, rows, 1)[:, 0]
                g_hit = jnp.take_along_axis(g, rows[:, :, None], 1)[:, 0]
            else:
                here, g_hit = outputs_at(ptr)
            hit = active & (ptr >= 1) & (here == k + 1)
            ct_y1, ct_slope = a + masked(hit, g_hit), zeros
            ct_ks, y_direct = [zeros] * method.stages, zeros
            ptr = ptr - hit.astype(ptr.dtype)
        da, dk1, dp = pullback((ct_y1, masked(active, k1_bar), ct_slope, ct_ks))
        return da + y_direct, dk1, dp, ptr

    # Segments of `every` steps, last first. The loop counters are the same for every
    # element (the bounds are the batch's largest counts; `max_over_batch` extends that
    # to an enclosing vmap), so indexing with them stays a slice.
    def segment(i, carry):
        a, k1_bar, pd_bar, ptr = carry
        seg = n_seg - 1 - i
        k0 = seg * every
        m = jnp.clip(steps - k0, 0, every)  # each element's steps in this segment
        # Only as many steps as the longest element has here, not a whole segment: a
        # short solve (a few dozen steps against an `every` of hundreds) replays just
        # its own steps.
        m_max = max_over_batch(jnp.max(m))
        # The last segment's states were kept by the forward pass; the others are
        # replayed from their checkpoint.
        kept = seg == (steps - 1) // every

        def forward(j, c):
            # The step from `ys[:, j]` with the whole carry `k1`; the buffers keep each
            # start's carry as the record does (`replay_carry`).
            ys, k1s, k1 = c
            t, h = step_at(k0 + j)
            y1, k_next, _, _ = batch_step(ys[:, j], k1, t, h, pd, pn)
            more = j + 1 < m
            k1 = select(more, k_next, k1)
            ys = ys.at[:, j + 1].set(jnp.where(more[:, None], y1, ys[:, j]))
            k1s = jax.tree_util.tree_map(
                lambda b, x: b.at[:, j + 1].set(x), k1s, method.replay_carry(k1)
            )
            return ys, k1s, k1

        replay = max_over_batch(jnp.max(jnp.where(kept, 0, m)))

        def replayed():
            y_start = y_cp[:, seg]
            k_start = jax.tree_util.tree_map(lambda cp: cp[:, seg], k_cp)
            ys = jnp.zeros((size, every + 1, n), y_cp.dtype).at[:, 0].set(y_start)
            k1s = jax.tree_util.tree_map(
                lambda last, x: jnp.zeros_like(last).at[:, 0].set(x),
                k_last,
                method.replay_carry(k_start),
            )
            return jax.lax.fori_loop(0, replay - 1, forward, (ys, k1s, k_start))[:2]

        if keeps_every_start(every, cap):
            # Nothing to replay, and no replaying step to compile.
            ys, k1s = y_last, k_last
        else:
            # No replay at all (and no field evaluation) when every element kept its
            # states. An element that kept this segment's states (its last) reads
            # them from the record row by row (`segment_row`): a select of whole
            # buffers would be a pass over them.
            ys, k1s = jax.lax.cond(replay > 0, replayed, lambda: (y_last, k_last))

        def segment_row(b, b_last, row):
            return select(kept, pick_row(b_last, row), pick_row(b, row))

        # Each step's end: the next step's start (a row of `ys`, whose last row is a
        # spare), and for the segment's last step the next checkpoint slot (for the
        # solve's last step, its end: `loop.write_end`).
        after_slot = jnp.minimum(seg + 1, y_cp.shape[1] - 1)
        after_last = (
            y_cp[:, after_slot],
            jax.tree_util.tree_map(lambda b: b[:, after_slot], method.replay_end(k_cp_kept)),
        )

        def linearize_chunk(j0):
            # The pull-backs of steps `j0 .. j0 + chunk - 1`, linearised together: each
            # array leaf of the pull-back with the chunk's axis first. A masked element
            # (a step past its count) is linearised at a step it did take (the last in
            # this segment, else its very last, kept by the forward pass, else its
            # start) and pulls back zeros: a step of size 0 may not have a finite
            # linearisation (a singular stage matrix), and zero times a non-finite
            # value is not zero.
            tree = []
            last = jnp.maximum(steps - 1, 0)
            took = steps >= 1

            def one(j):
                active = j < m
                here = m >= 1  # the element took a step in this segment
                row = jnp.where(active, j, jnp.maximum(m - 1, 0))
                slot = last % every

                def at(b, b_last, b_cp):
                    return select(
                        here,
                        segment_row(b, b_last, row),
                        select(took, pick_row(b_last, slot), b_cp[:, 0]),
                    )

                y = at(ys, y_last, y_cp)
                k1 = jax.tree_util.tree_map(at, k1s, k_last, k_cp_kept)
                # The end of the step taken (its state and carry): of an element's last
                # step in this segment, the segment's end; of its very last step, the
                # solve's end.
                next_row = (
                    segment_row(ys, y_last, row + 1),
                    jax.tree_util.tree_map(
                        lambda b, b_last: segment_row(b, b_last, row + 1),
                        method.replay_end(k1s),
                        method.replay_end(k_last),
                    ),
                )
                end = select(row + 1 < m, next_row, after_last)
                end = StepEnd(*select(here, end, solve_end))
                k = jnp.minimum(jnp.where(here, k0 + row, last), cap - 1)[:, None]
                t = jnp.take_along_axis(rec_t, k, 1)[:, 0]
                h = jnp.take_along_axis(rec_h, k, 1)[:, 0]
                pullback = linearize_step(t, h, y, k1, end, ~active)
                leaves, treedef = jax.tree_util.tree_flatten(pullback)
                # Only JAX arrays cross the `vmap`; anything else in the pull-back (a
                # marker object, a NumPy constant) is the same for every step and is
                # kept aside.
                arrays = [isinstance(x, jax.Array) for x in leaves]
                tree.append((treedef, arrays, [None if a else x for a, x in zip(arrays, leaves)]))
                return [x for a, x in zip(arrays, leaves) if a]

            found = _map_batch(one, chunk, (0,))(j0 + jnp.arange(chunk))
            treedef, arrays, others = tree[0]

            def pullback_at(r):
                it = iter(found)
                return treedef.unflatten([next(it)[r] if a else x for a, x in zip(arrays, others)])

            return pullback_at

        def back_chunk(i, c):
            # Chunks last first, and inside a chunk its steps last first. The chunks
            # start at multiples of `chunk` (which divides `every`), so the last one
            # may reach past `m_max`: those steps are masked for every element.
            j0 = (n_chunks - 1 - i) * chunk
            pullback_at = linearize_chunk(j0)

            def back(jj, c):
                r = chunk - 1 - jj
                return back_step(j0 + r, step_at(k0 + j0 + r)[1], lambda: pullback_at(r), c)

            return jax.lax.fori_loop(0, chunk, back, c)

        def back_block(i, c):
            # Blocks of `block` steps last first (see `solvers.ode.blocks`): the block's
            # rows are copied out of the record here, so that the loop over its steps
            # touches small buffers only. One solve (`size` 1, with `chunk` 1) that kept
            # every step's start; under a `vmap` the sweep cannot see (forward mode over
            # the sweep, `_Sweep.jvp`), its elements may have taken fewer steps than
            # `m_max`: a row past an element's last step is linearised at that last step
            # (as in `linearize_chunk`) and pulls back zeros.
            j0 = (n_blocks - 1 - i) * block
            count = jnp.minimum(m_max - j0, block)  # the last block may hold fewer
            last = jnp.maximum(m[0] - 1, 0)
            idx = jnp.minimum(j0 + jnp.arange(block), last)  # rows a step was taken from
            starts = BlockRows.rows(ys[0], idx)
            next_rows = jnp.minimum(idx + 1, every - 1)
            ends = BlockRows.rows(ys[0], next_rows)
            k_end_rows = jax.tree_util.tree_map(
                lambda b: BlockRows.rows(b[0], next_rows), method.replay_end(k1s)
            )
            k1_rows = jax.tree_util.tree_map(lambda b: BlockRows.rows(b[0], idx), k1s)
            cols = jnp.minimum(k0 + idx, cap - 1)
            t_rows, h_rows = rec_t[:, cols], rec_h[:, cols]
            took = steps >= 1  # else the start: the initial state and carry
            outputs_at = moment_rows = None
            if by_step is not None:
                moment_rows = BlockRows.rows(by_step[0], cols)
            if not loop.interpolate:
                # The outputs the block's steps may reach: the next `block` below `ptr`.
                ptr0 = c[3][0]
                out_rows = jnp.clip(ptr0 - jnp.arange(block), 0, n_out - 1)
                out_steps, out_g = out_step[:, out_rows], BlockRows.rows(g[0], out_rows)

                def outputs_at(ptr):
                    row = jnp.clip(ptr0 - ptr[0], 0, block - 1)
                    return out_steps[:, row], out_g.get(row)[None]

            def back(jj, c):
                r = count - 1 - jj
                active = j0 + r < m
                get = lambda rows: rows.get(r)[None]  # noqa: E731
                y = select(took, get(starts), y_cp[:, 0])
                k1 = jax.tree_util.tree_map(get, k1_rows, is_leaf=is_rows)
                k1 = select(took, k1, jax.tree_util.tree_map(lambda b: b[:, 0], k_cp_kept))
                # (The last step's end is the solve's: see `linearize_chunk`.)
                next_end = (get(ends), jax.tree_util.tree_map(get, k_end_rows, is_leaf=is_rows))
                end = StepEnd(*select(idx[r] + 1 < m, next_end, solve_end))
                t, h = t_rows[:, r], h_rows[:, r]
                moments = None if moment_rows is None else get(moment_rows)
                return back_step(
                    j0 + r, h, lambda: linearize_step(t, h, y, k1, end, ~active), c,
                    outputs_at, moments,
                )  # fmt: skip

            return jax.lax.fori_loop(0, count, back, c)

        def back_step(j, h, linearised, c, outputs_at=None, moments=None):
            # `linearised()`: the step's pull-back (see `linearize_step`).
            active = j < m
            if size == 1 and n >= LINEARIZE_MIN_STATES:
                # One large solve: a step past its count is skipped, not pulled back
                # masked, so a step taken does not select over its carry's cotangent
                # (a history of eight rows with `bdf`) to keep or restore it. Measured
                # on CPU, gradients 10-28% faster: bdf on 1000 copies of ROBER and the
                # 1024-point Brusselator line, rodas5p on the 256- and 1024-point
                # lines. The pull-back is formed (linearised, or read from the chunk)
                # inside the branch: handed to the `cond` as operands, its arrays cost
                # as much as the selects saved (64 copies of ROBER).
                def taken(c):
                    yes = jnp.ones_like(active)
                    return pulled_back(j, h, linearised, c, yes, outputs_at, moments)

                return jax.lax.cond(active[0], taken, lambda c: c, c)
            return pulled_back(j, h, linearised, c, active, outputs_at, moments)

        def pulled_back(j, h, linearised, c, active, outputs_at, moments):
            a, k1_bar, pd_bar, ptr = c
            da, dk1, dp, ptr = pull_back_step(
                k0 + j, h, linearised(), active, a, k1_bar, ptr, outputs_at, moments
            )
            a = jnp.where(active[:, None], da, a)
            k1_bar = select(active, dk1, k1_bar)
            # A shared leaf's cotangent is already summed over the batch (the masked
            # elements added zeros); a batched leaf keeps its own per element.
            pd_bar = jax.tree_util.tree_map(
                lambda pb, d, ax: pb + d if ax is None else jnp.where(
                    active.reshape((size,) + (1,) * (d.ndim - 1)), pb + d, pb
                ),
                pd_bar, dp, pd_axes,
            )  # fmt: skip
            return a, k1_bar, pd_bar, ptr

        if block:
            n_blocks = (m_max + block - 1) // block
            return jax.lax.fori_loop(0, n_blocks, back_block, (a, k1_bar, pd_bar, ptr))
        n_chunks = (m_max + chunk - 1) // chunk
        return jax.lax.fori_loop(0, n_chunks, back_chunk, (a, k1_bar, pd_bar, ptr))

    n_seg = (max_over_batch(jnp.max(steps)) + every - 1) // every
    if loop.interpolate:
        # The last output reached (rows reached have a step count of at least 1).
        last = jnp.sum(out_step[:, 1:] > 0, axis=1)
    else:
        # The last output reached (with dense output, the last step's row).
        last = jnp.minimum(n_out - 1, steps)
    zeros = jnp.zeros((size, n), g.dtype)
    carry_zeros = jax.tree_util.tree_map(
        lambda b: jnp.zeros_like(b[:, 0]), partition_carry(k_cp)[0]
    )
    init = (zeros, carry_zeros, jax.tree_util.tree_map(jnp.zeros_like, pd), last.astype(jnp.int32))
    a, k1_bar, pd_bar, _ = jax.lax.fori_loop(0, n_seg, segment, init)
    # The first step's carry, `initial_carry(y0, f(y0, t0))`.
    initial_carry = jax.vmap(method.initial_carry)

    def first_carry(y, pd):
        return partition_carry(initial_carry(y, batch_field(y, rec_t[:, 0], pd, pn)))[0]

    _, pullback = jax.vjp(first_carry, y_cp[:, 0], pd)
    da, dp = pullback(k1_bar)
    pd_bar = jax.tree_util.tree_map(jnp.add, pd_bar, dp)
    return a + da + g[:, 0], pd_bar
