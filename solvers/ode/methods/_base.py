"""The family of integration methods: what the stepping loop, the adjoints and the
interpolants ask of a method, and the tableau most methods are built from.

A method advances a flat state vector by one step:

    step_with_stages(f, y, carry, t, h, params, tol) -> (y1, y_error, carry1, ok, stages)

where `f(y, t, params)` is the flattened vector field, `y_error` the embedded error
estimate (zeros for a fixed-step method), `ok` whether the stage equations were
solved (a bool, or a `StageReport` with the Newton iterations spent, from a method
that iterates; a step whose stages failed is retried smaller) and `stages` the stage
derivatives, from which the interpolant inside the step is built
(`solvers.ode.interpolation`).

`carry` is what a method hands from one accepted step to the next. For most methods
it is `f` at `(t, y)` as the previous step computed it (first same as last, or the
derivative an implicit method takes from its last stage equation); a multistep method
carries its history. A carry is a pytree (`initial_carry` builds the first one) of
two kinds of parts:

- values that depend on the solution: every such leaf has the state's length as its
  last axis. They are differentiated, and for forward sensitivities the carry of the
  pair `(y, v)` holds each of them and its tangent side by side on that axis;
- `Memory` subtrees: the method's bookkeeping (its order, the step size of its
  history, a factorisation it reuses, counters). Never differentiated, never split.

The stepping loop records carries for the checkpointed adjoint, so a replayed step
repeats the solve's step exactly (the same factorisation, the same iteration), and
the adjoint differentiates through the values: a method whose result depends on its
history gets the derivative of that dependence too.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int

from implicitdiff.internal import any_over_batch

from .. import controller

__all__ = [
    "AbstractMethod",
    "ButcherTableau",
    "Memory",
    "StageReport",
    "StageTolerance",
    "StepEnd",
    "after",
    "combine_carry",
    "factor_shapes",
    "placeholder",
    "jacobian_product",
    "keep_or_compute",
    "lower_triangle",
    "partition_carry",
    "select",
    "stage_report",
]


class StepEnd(NamedTuple):
    """A recorded step's end, as the checkpointed adjoint's replay knows it (see
    `AbstractMethod.replay_step`).

    Attributes:
        y: the `y1` the solve computed.
        carry: what `replay_step` reads of the carry the step handed on
            (`AbstractMethod.replay_end`; `None` by default).
    """

    y: Any
    carry: Any


def lower_triangle(rows, size: int, dtype) -> jax.Array:
    """The rows of a strictly lower triangular tableau matrix (row `i` with at most `i`
    entries) as a `size x size` array padded with zeros, for a loop over the stages
    that indexes its rows."""
    out = np.zeros((size, size))
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return jnp.asarray(out, dtype)


class Memory(eqx.Module):
    """The base of a method's bookkeeping inside its carry (see the module): recorded
    and replayed with the carry, never differentiated, never split for forward
    sensitivities."""


def _is_memory(x) -> bool:
    return isinstance(x, Memory)


def partition_carry(carry):
    """`(values, memory)`: the carry's differentiable values and its `Memory`
    subtrees, each with `None` where the other's parts are (`combine_carry` joins
    them)."""
    spec = jax.tree_util.tree_map(lambda x: not _is_memory(x), carry, is_leaf=_is_memory)
    return eqx.partition(carry, spec, is_leaf=_is_memory)


def combine_carry(values, memory):
    """The carry from `partition_carry`'s two parts."""
    return eqx.combine(values, memory, is_leaf=_is_memory)


def select(which, a, b):
    """`a` where `which` (a scalar, or a leading part of the shapes), else `b`: leaf
    by leaf for two pytrees of the same structure (a method's carries)."""

    def one(x, y):
        w = jnp.reshape(which, jnp.shape(which) + (1,) * (jnp.ndim(x) - jnp.ndim(which)))
        return jnp.where(w, x, y)

    return jax.tree_util.tree_map(one, a, b)


def keep_or_compute(keep, kept, compute):
    """`kept` where `keep` (a scalar bool, batched under `vmap`), else `compute()`, a
    pytree like `kept`: a factorisation kept from an earlier step, or a fresh one.

    Under `vmap` a `cond` on a batched predicate runs both branches, so the predicate
    of this one is whether any element of the batch needs `compute`: it runs once for
    the batch, and only then."""
    return jax.lax.cond(any_over_batch(~keep), lambda: select(keep, kept, compute()), lambda: kept)


def factor_shapes(solver, shape, dtype):
    """The shapes (`jax.ShapeDtypeStruct`s) of `solver.factors` for a system on arrays
    of `shape` and `dtype`, found without factoring anything, or `None` for a solver
    that keeps no factors: what a method's first carry holds in their place."""
    state = jax.eval_shape(lambda: solver.init(lambda v: v, jnp.zeros(shape, dtype)))
    return solver.factors(state)


def placeholder(shapes):
    """Zeros of the shapes `shapes` (such as `factor_shapes`): the factors a first carry
    holds before any were made."""
    return jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def jacobian_product(f, y, t, params):
    """`v -> J v` with `J` the Jacobian of `f(., t, params)` at `y`: the stage
    matrices of the implicit methods are built from it, so that a linear solver
    evaluates only the products it needs (`n` for a dense matrix, a few for a band,
    one per iteration for a Krylov method). The field's own derivative rule is used
    when it has one (`odeint(jac=...)`)."""
    return lambda v: jax.jvp(lambda u: f(u, t, params), (y,), (v,))[1]


def after(values, state):
    """`values` (a pytree of floating-point arrays), made to depend on `state` (any
    pytree of arrays), so that whatever is computed from them starts after `state` is
    ready.

    A method that prepares two linear solvers in one step orders them with this. On
    CPU, XLA may run two independent LAPACK factorisations at once; under `vmap` each
    splits its batch over the same thread pool and waits for it, and with as many
    factorisations as threads (two on a two-core machine) they wait for each other
    forever. The dependency is a product with zero of one entry of `state`, converted
    to an integer first so that a NaN there cannot spread; XLA does not fold a
    floating-point product with zero away.
    """
    leaves = [x for x in jax.tree_util.tree_leaves(state) if getattr(x, "size", 0)]
    if not leaves:
        return values
    anchor = jax.numpy.ravel(leaves[-1])[0].astype(jax.numpy.int32)
    return jax.tree_util.tree_map(lambda v: v + 0 * anchor.astype(v.dtype), values)


@dataclasses.dataclass(frozen=True)
class ButcherTableau:
    """A Runge-Kutta tableau as nested tuples (hashable: a static parameter).

    Attributes:
        c: the stage times, `c[0] = 0`.
        a: the strictly lower triangle, `a[i]` has `i` entries.
        b: the weights of the solution.
        e: the weights of the embedded error estimate, or `None` (no error control:
            the method takes fixed steps).
        gamma: the diagonal of a diagonally implicit tableau (0 for an explicit first
            stage), or `None` for an explicit one.
        predictor: for a diagonally implicit tableau, the weights of each implicit
            stage's starting guess in the earlier stages, or `None` (start from the
            stage's explicit part).
    """

    c: tuple[float, ...]
    a: tuple[tuple[float, ...], ...]
    b: tuple[float, ...]
    e: tuple[float, ...] | None = None
    gamma: tuple[float, ...] | None = None
    predictor: tuple[tuple[float, ...], ...] | None = None

    def __post_init__(self):
        s = len(self.b)
        if len(self.c) != s or len(self.a) != s or any(len(r) != i for i, r in enumerate(self.a)):
            raise ValueError(
                f"ButcherTableau: with {s} stages `c` needs {s} entries and `a` {s} rows, "
                f"row i with i entries; got c of {len(self.c)} and rows of "
                f"{[len(r) for r in self.a]}"
            )
        for name in ("e", "gamma"):
            v = getattr(self, name)
            if v is not None and len(v) != s:
                raise ValueError(f"ButcherTableau: `{name}` needs {s} entries, got {len(v)}")
        pred = self.predictor
        if pred is not None and [len(r) for r in pred] != list(range(1, s)):
            raise ValueError(
                f"ButcherTableau: `predictor` needs {s - 1} rows (one per implicit stage), "
                f"row i with i + 1 entries; got rows of {[len(r) for r in pred]}"
            )

    @property
    def stages(self) -> int:
        return len(self.b)


@dataclasses.dataclass(frozen=True)
class StageTolerance:
    """How accurately an implicit method solves its stage equations: to a fraction of
    the step's own error tolerance, in the same weighted RMS norm, measured on the
    first `size` entries of the state (all of them when `None`)."""

    rtol: float = 1e-6
    atol: float = 1e-6
    size: int | None = None


class StageReport(eqx.Module):
    """How a step attempt solved its stage equations (the `ok` a step of an iterating
    method returns).

    Attributes:
        converged: whether every stage equation was solved (made a bool array).
        iterations: the Newton iterations spent on them (summed over the stages, and
            over a retry with a fresh iteration matrix; made `int32`, whatever integer
            type the iteration counted in).
    """

    converged: Bool[Array, ...] = eqx.field(converter=lambda x: jnp.asarray(x, bool))
    iterations: Int[Array, ...] = eqx.field(converter=lambda x: jnp.asarray(x, jnp.int32))

    @classmethod
    def given(cls) -> StageReport:
        """The report of stages taken as given (a replay): solved, no iterations."""
        return cls(True, 0)

    def __and__(self, other: StageReport) -> StageReport:
        """Both solves: converged if both did, the iterations of both."""
        return StageReport(self.converged & other.converged, self.iterations + other.iterations)


def stage_report(ok) -> StageReport:
    """A step's `ok` as a `StageReport`: a bare bool (from a method that iterates on
    nothing: an explicit or a Rosenbrock step) spent no iterations."""
    return ok if isinstance(ok, StageReport) else StageReport(ok, 0)


class AbstractMethod(abc.ABC):
    """An integration method of `odeint`: one step on a flat state (see the module).

    Subclasses are frozen dataclasses, so that a method is hashable and compares by
    value (`Tsit5() == Tsit5()`): it is a static parameter of the solve.

    Attributes a method provides:
        name: the `method=` string it is registered under.
        order: the exponent of the step-size controller: the order of the local error
            estimate (5 for a 5(4) pair); for a fixed-step method, its order.
    """

    name: str
    order: int

    @property
    @abc.abstractmethod
    def adaptive(self) -> bool:
        """Whether the method estimates its error (and so chooses its steps)."""

    @property
    @abc.abstractmethod
    def implicit(self) -> bool:
        """Whether a step solves equations (a stiff method)."""

    @property
    @abc.abstractmethod
    def stages(self) -> int:
        """The number of stage derivatives a step returns."""

    @property
    @abc.abstractmethod
    def evals_per_step(self) -> int:
        """Evaluations of `f` a step makes outside any Newton iteration and Jacobian."""

    @property
    def jacobians_per_step(self) -> int:
        """Jacobians of `f` a step attempt evaluates."""
        return int(self.implicit)

    @property
    def factorisations_per_step(self) -> int:
        """Factorisations of a stage matrix a step attempt makes."""
        return int(self.implicit)

    def linearisation_solvers(self, n: int) -> tuple[tuple[Any, int], ...]:
        """The `LinearSolver`s whose factorisations a step's linearisation makes (the
        replayed step and its derivative), for a state of `n` entries, each with the
        number of unknowns it factors: an implicit method's stage solver (and any
        other form of it the step solves with); none for a method that factors
        nothing. The checkpointed adjoint asks them (`LinearSolver.factors_in_batches_at`)
        whether to linearise several steps in one batch."""
        del n
        return ()

    @property
    def interpolation(self) -> Any:
        """diffrax's class for the method's own continuous extension (a polynomial in
        the stages), or `None` for the cubic Hermite interpolant through the values
        and derivatives at the step's ends."""
        return None

    def continuous_weights(self) -> Any:
        """The method's own interpolant as polynomial weights on the basis `[y, y1,
        k1_next, k_1, ..., k_s]` (a `(3 + stages, degree + 1)` NumPy array, lowest
        power first; see `solvers.ode.interpolation`), or `None`: then `interpolation`
        decides."""
        return None

    @abc.abstractmethod
    def step_with_stages(self, f, y, k1, t, h, params, *, tol=None):
        """One step from `(t, y)` of size `h`: `(y1, y_error, k1_next, ok, stages)`."""

    def replay_step(self, f, y, carry, t, h, params, end: StepEnd, *, tol=None):
        """`step_with_stages` again for the checkpointed adjoint, which knows the step's
        end (`end`: the `y1` the solve computed, and what `replay_end` keeps of the
        carry it handed on). By default the step is recomputed. A method whose stage
        equation has a solution the end holds takes it instead of iterating again, and
        the derivative is the same implicit one, taken at the same point: BDF's
        corrector has `y1` itself, Radau IIA's and an ESDIRK method's stages are in the
        carry (`radau5.StageStart`, `StageValues`). Only the step's `y1`, carry values
        and stages are read from a replay: its error estimate and `ok` need not be
        computed."""
        del end
        return self.step_with_stages(f, y, carry, t, h, params, tol=tol)

    def replay_carry(self, carry):
        """The part of `carry` that `replay_step` reads, as the start of a step and as
        its end: the checkpointed adjoint records every step's carry in this form (the
        carries it replays steps from, at its checkpoints, whole). By default all of
        it; BDF and Radau5 leave out the factorisation they may reuse, which a replay
        never iterates with."""
        return carry

    def replay_end(self, carry):
        """The part of a step's end carry (in `replay_carry` form, or a buffer of such
        carries) that `replay_step` reads (`StepEnd.carry`): by default none (`None`),
        so the adjoint reads no carry at the steps' ends; Radau5 and ESDIRK their
        stages."""
        del carry
        return None

    def step(self, f, y, carry, t, h, params, *, tol=None):
        """`step_with_stages` without the stages: `(y1, y_error, carry1, ok)`."""
        return self.step_with_stages(f, y, carry, t, h, params, tol=tol)[:4]

    def initial_carry(self, y0, k0):
        """The carry at the start from `y0` and `k0 = f(y0, t0)` (see the module): by
        default `k0` itself. Differentiable in both."""
        return k0

    def slope(self, carry):
        """`f` at the carry's point, for the interpolant and the finiteness checks:
        by default the carry itself."""
        return carry

    def attempt_work(self, carry1):
        """`(jacobians, factorisations)` of the attempt that made `carry1`: by default
        `jacobians_per_step` and `factorisations_per_step`. A method that reuses a
        factorisation across steps counts what it did."""
        del carry1
        return self.jacobians_per_step, self.factorisations_per_step

    def next_size(self, h_step, ratio, good, accept, carry1, last=None):
        """The next step size after an attempt of size `h_step` with error `ratio`
        (in units of the tolerance; `good`: the step computed finite values and its
        stage solves converged), `carry1` the attempt's carry, `last = (h_acc,
        err_acc, any)` the accepted step before it (see `solvers.ode.controller`;
        the loop always passes it). By default the controller of
        `solvers.ode.controller` with the method's `order`, predictive for an implicit
        method."""
        return controller.next_size(
            h_step, ratio, good, accept, self.order, last if self.implicit else None
        )
