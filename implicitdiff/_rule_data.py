"""The data a `Primitive`'s rules pass around: static residuals, cotangent accumulators,
and the primal outputs a rule may reuse instead of recomputing.

This module sits below `_primitive`, `_lin`, `_derive` and `_vmap`: it imports nothing
of implicitdiff but `_jax_compat`.
"""

from __future__ import annotations

import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _jax_compat as compat
from ._jax_compat import Zero

__all__ = [
    "Static",
    "Accum",
    "NullAccum",
    "split_residuals",
    "join_residuals",
    "reuse_primal",
    "lookup_reuse",
    "is_float0",
    "is_accum",
    "broadcast_prefix",
    "describe_values",
]


@jax.tree_util.register_pytree_node_class
class Static:
    """A pytree leaf-less wrapper for static (hashable, non-array) data inside residuals."""

    __slots__ = ("val",)

    def __init__(self, val: Any):
        self.val = val

    def tree_flatten(self):
        return (), self.val

    @classmethod
    def tree_unflatten(cls, aux, _):
        return cls(aux)

    def __repr__(self):
        return f"Static({self.val!r})"


class Accum:
    """Cotangent accumulator handed to `vjp_bwd`: call `.accum(value)` any number of times."""

    __slots__ = ("aval", "value")

    def __init__(self, aval: Any):
        self.aval = aval
        self.value: Any = None

    def accum(self, x: Any) -> None:
        if x is None or isinstance(x, Zero):
            return
        if isinstance(x, Accum):
            raise TypeError("accum() takes a cotangent value, not an accumulator")
        shape = tuple(np.shape(x))
        if shape != tuple(self.aval.shape):
            raise ValueError(
                f"cotangent of shape {shape} accumulated into an input of type "
                f"{self.aval.str_short()}; the backward rule must return one cotangent "
                "per input with that input's shape"
            )
        if jnp.result_type(x) != self.aval.dtype:
            x = jnp.asarray(x, self.aval.dtype)
        self.value = x if self.value is None else self.value + x

    def __repr__(self):
        return f"Accum({self.aval.str_short()})"


class NullAccum(Accum):
    """Accumulator for an input that is not being differentiated: `accum` does nothing."""

    def accum(self, x: Any) -> None:
        return None

    def __repr__(self):
        return f"NullAccum({self.aval.str_short()})"


def is_accum(x: Any) -> bool:
    """Linear inputs reach a `transpose` rule as cotangent accumulators (objects with
    `.accum`); anything else is a known value."""
    return hasattr(x, "accum")


# Residual leaves of these types travel as data; anything else (Python scalars such
# as an axis number, strings, callables) is kept as a static constant.
_ARRAY_TYPES = (jax.Array, compat.Tracer, np.ndarray, np.generic)


def split_residuals(res: Any) -> tuple[list[Any], Any, tuple[Any, ...]]:
    """Residual pytree -> (dynamic leaves, treedef, static leaves with dynamic slots as None)."""
    leaves, tree = jax.tree_util.tree_flatten(res)
    dyn = [x for x in leaves if isinstance(x, _ARRAY_TYPES)]
    static = tuple(None if isinstance(x, _ARRAY_TYPES) else x for x in leaves)
    return dyn, tree, static


def join_residuals(dyn: list[Any], tree: Any, static: tuple[Any, ...]) -> Any:
    """Inverse of `split_residuals`."""
    it = iter(dyn)
    leaves = [next(it) if s is None else s for s in static]
    return jax.tree_util.tree_unflatten(tree, leaves)


def is_float0(aval: Any) -> bool:
    return getattr(aval, "dtype", None) == jax.dtypes.float0


_reuse = threading.local()


class reuse_primal:
    """Within this context, `prim(*args)` with these exact args returns `out` unevaluated.

    Forward-mode rules recompute the primal output by calling `self(...)`; when the
    output is already known (it was computed by `vjp_fwd`) this avoids doing the
    work twice.
    """

    def __init__(self, prim, args_flat, out_flat):
        self.entry = (prim, list(args_flat), list(out_flat))

    def __enter__(self):
        stack = getattr(_reuse, "stack", None)
        if stack is None:
            stack = _reuse.stack = []
        stack.append(self.entry)

    def __exit__(self, *exc):
        _reuse.stack.pop()


def lookup_reuse(prim: Any, args_flat: list[Any]) -> list[Any] | None:
    """The output `reuse_primal` recorded for `prim` applied to exactly `args_flat`."""
    stack = getattr(_reuse, "stack", None)
    if not stack:
        return None
    p, a, out = stack[-1]
    if p is prim and len(a) == len(args_flat) and all(x is y for x, y in zip(a, args_flat)):
        return out
    return None


def broadcast_prefix(prefix: Any, tree: Any) -> list[Any]:
    """One entry per leaf of `tree` from an axis spec that is None, an int or a prefix."""
    if prefix is None or isinstance(prefix, int):
        return [prefix] * tree.num_leaves
    return tree.flatten_up_to(prefix)


def describe_values(v: Any) -> str:
    """The types of the arrays in `v` (for error messages), or its repr."""
    leaves = jax.tree_util.tree_leaves(v)
    return ", ".join(compat.typeof(x).str_short() for x in leaves if hasattr(x, "shape")) or repr(v)
