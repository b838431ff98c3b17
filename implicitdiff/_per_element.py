"""Whether the code being traced runs once or for each element of a `vmap` batch.

Code that picks an algorithm by this (a narrow band's LU: by partitions of its rows
for one matrix, row by row for a batch, whose elements are the lanes the partitions
would make) asks `in_batch`. A computation is traced inside `per_element(fn, flag)`;
the answer then holds in the bodies of its loops too, which `vmap` batches after
tracing them unbatched. Values made under one answer must not meet values made under
the other (a factorisation carried from one ODE step to the next, or recorded by the
forward solve and replayed by the adjoint, keeps its layout), so the flag is set
around whole computations:

- `custom_linear_solve`'s solves, true when the matrix differs across a batch (the
  factors they make stay inside them);
- `odeint`'s solve, true when its inputs are batched (a batch of one included) and
  false for one solve, whatever encloses it; its record keeps the answer
  (`Record.per_element`), and the checkpointed adjoint's sweeps take it as a static
  parameter, since a primitive may be expanded after the rule that bound it returned.
"""

from __future__ import annotations

import contextvars
import functools
from typing import Any

import jax

from . import _jax_compat as compat

__all__ = ["any_vmapped", "in_batch", "per_element", "per_element_if_batched"]

_PER_ELEMENT = contextvars.ContextVar("implicitdiff_per_element", default=False)


def in_batch() -> bool:
    """Whether the code being traced runs for each element of a `vmap` batch (inside
    `per_element(fn)`)."""
    return _PER_ELEMENT.get()


def any_vmapped(args: Any) -> bool:
    """Whether a leaf of `args` is a `vmap` tracer (a batch of one included)."""
    return any(compat.is_vmapped(x) for x in jax.tree_util.tree_leaves(args))


def per_element(fn, flag: bool = True):
    """`fn`, run with `in_batch()` equal to `flag`."""

    @functools.wraps(fn)
    def traced(*a, **kw):
        token = _PER_ELEMENT.set(bool(flag))
        try:
            return fn(*a, **kw)
        finally:
            _PER_ELEMENT.reset(token)

    return traced


def per_element_if_batched(fn, args: Any):
    """`fn`, run with `in_batch()` true when a leaf of `args` is a `vmap` tracer (else
    as it is, under the caller's answer)."""
    return per_element(fn) if any_vmapped(args) else fn
