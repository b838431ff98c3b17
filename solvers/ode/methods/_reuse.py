"""Factorisations kept from one step to the next by `"radau5"`, by the rule of Hairer
and Wanner's RADAU5 (Solving ODEs II, IV.8).

A step factors its iteration matrices (radau5's real and complex systems) at its start,
with the Jacobian there. The next step reuses those factors, Jacobian and all, when

- its size is the same. After an accepted step whose iteration contracted fast, the
  controller keeps the step size where it would have grown it by a factor of at most
  `HOLD_MAX`: a step up to 20% longer is not worth new factorisations (`hold`);
- the iteration that used them contracted by `REUSE_RATE` per iteration or faster,
  or took a single iteration (the factors are still a good Newton matrix).

A step whose iteration then fails is rejected like any other, and its successor, of
another size, factors afresh (as in RADAU5; repeating the step with fresh factors
instead changed nothing measurable). Unlike RADAU5, a step of another size also
evaluates a new Jacobian: here a Jacobian is a few products, and the factorisations
are the cost. The factors are kept in the method's carry (`FactorMemory`), recorded
with it by the checkpointed adjoint, whose replays start from the recorded factors;
under `vmap` each element decides for itself.

Only systems of `REUSE_MIN_STATES` states or more keep their factors: on a small
system, carrying and choosing them costs more than the factorisations they save.

The ESDIRK methods do not reuse their factors: measured with kvaerno5 by this same
rule, the 2-D Brusselator (512 states, sparse), the Brusselator lines of 256 and 1024
points (banded), the 64-point line (dense) and 64 copies of ROBER all ran 1-15%
slower, with 30-45% fewer factorisations. Each of its six stage iterations pays for
a stale Jacobian with more solves, where radau5 has one iteration for all its stages
and a complex factorisation that costs four real ones.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from ._base import Memory, keep_or_compute, placeholder

__all__ = [
    "HOLD_MAX",
    "REUSE_MIN_STATES",
    "REUSE_RATE",
    "FactorMemory",
    "contraction",
    "hold",
    "prepare_or_reuse",
]

#: A step reuses the last step's factors when that step's Newton iteration contracted
#: by this rate or faster (Hairer's `thet`, at the value his code advises where
#: Jacobians are costly: here a Jacobian comes with two factorisations). Measured with
#: radau5 on the 2-D Brusselator (512 states): 1e-3 saved 10% of the factorisations,
#: 1e-2 40% and 1e-1 45%.
REUSE_RATE = 0.1
#: After such a step, a step size the controller would grow by a factor of 1 to
#: `HOLD_MAX` is not taken: the step keeps its size, and so its factors (Hairer's
#: `quot2`).
HOLD_MAX = 1.2
#: Factors are kept from this many states on. Measured with radau5: VDPOL, OREGO (2,
#: 3 states) and the transistor amplifier (8) ran 13-15% slower with the reuse in the
#: program even where it never reused; from 32 states on it saved 40-75% of the
#: factorisations, and the 2-D Brusselator (512 states) ran 1.44x faster (the 64-point
#: Brusselator line, 128 states and dense, about as fast either way).
REUSE_MIN_STATES = 16


class FactorMemory(Memory):
    """A one-step implicit method's factors and what decides their reuse (never
    differentiated).

    Attributes:
        factors: the factors of the step that made this carry (a pytree of the linear
            solver's `factors`).
        h: the step size they were made for (0: none yet).
        theta: the contraction rate of that step's Newton iteration (0 after a single
            iteration).
        work: whether that attempt made new factors (1) or reused the last ones (0).
    """

    factors: Any
    h: Float[Array, ...]
    theta: Float[Array, ...]
    work: Int[Array, ...]

    @classmethod
    def empty(cls, factor_shapes, dtype) -> FactorMemory:
        """The first carry's memory: zeros shaped as the factors (`jax.eval_shape` of
        them), never reused (an infinite rate; a first step of size 0 would otherwise
        match `h = 0`)."""
        rdt = jnp.finfo(dtype).dtype
        return cls(
            factors=placeholder(factor_shapes),
            h=jnp.zeros((), dtype),
            theta=jnp.full((), jnp.inf, rdt),
            work=jnp.zeros((), jnp.int32),
        )


def prepare_or_reuse(memory: FactorMemory, h, fresh):
    """The factors for a step of size `h`: `memory`'s when they may serve it (see the
    module), else `fresh()` (under `vmap`, computed once for the batch when some
    element needs them). Returns `(factors, work)`, `work` 1 for fresh ones."""
    reuse = (memory.h == h) & (memory.theta <= REUSE_RATE)
    return keep_or_compute(reuse, memory.factors, fresh), (~reuse).astype(jnp.int32)


def contraction(eta, iterations):
    """The contraction rate `theta` of a simplified Newton iteration from its final
    `eta = theta / (1 - theta)` (see `simplified_newton`): 0 after a single iteration,
    which measured none (RADAU5 then counts the factors as good)."""
    return jnp.where(iterations >= 2, eta / (1 + eta), 0)


def hold(h_new, h_step, accept, memory: FactorMemory):
    """The next step size: `h_step` again where the controller chose `h_new` up to
    `HOLD_MAX` times longer after an accepted step whose factors may be reused."""
    grow = h_new / h_step
    keep = accept & (memory.theta <= REUSE_RATE) & (grow >= 1) & (grow <= HOLD_MAX)
    return jnp.where(keep, h_step, h_new)
