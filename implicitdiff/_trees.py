"""Small pytree helpers shared by the rules, the linear solvers and (through
`implicitdiff.internal`) the solvers: symbolic zeros in cotangents, finiteness, norms.
"""

from __future__ import annotations

import functools
import operator
from typing import Any

import jax
import jax.numpy as jnp

from ._jax_compat import Zero, instantiate_zeros

__all__ = [
    "is_zero",
    "leaves_with_zeros",
    "instantiate_cotangent",
    "all_finite",
    "tree_sub",
    "tree_norm",
    "max_norm",
    "describe",
]


def is_zero(x: Any) -> bool:
    """Whether `x` is a symbolic zero (co)tangent."""
    return isinstance(x, Zero)


def leaves_with_zeros(tree: Any) -> list[Any]:
    """Leaves of a (co)tangent pytree, symbolic `Zero`s included (they have no children)."""
    return jax.tree_util.tree_leaves(tree, is_leaf=is_zero)


def instantiate_cotangent(g: Any) -> Any | None:
    """`g` with its symbolic `Zero` leaves made arrays of zeros, or None when every leaf
    is a symbolic zero (then a backward rule has nothing to propagate).

    Example:
        ```python
        import jax.numpy as jnp
        from implicitdiff import Zero, internal

        g = (jnp.ones(2), Zero(jnp.zeros(3).aval))
        print(internal.instantiate_cotangent(g)[1])  # [0. 0. 0.]
        assert internal.instantiate_cotangent(g[1]) is None
        ```
    """
    if all(is_zero(t) for t in leaves_with_zeros(g)):
        return None
    return jax.tree_util.tree_map(instantiate_zeros, g, is_leaf=is_zero)


def all_finite(tree: Any) -> jax.Array:
    """A scalar bool: every element of every leaf is finite (True for no leaves)."""
    flags = [jnp.all(jnp.isfinite(leaf)) for leaf in jax.tree_util.tree_leaves(tree)]
    if not flags:
        return jnp.asarray(True)
    return functools.reduce(jnp.logical_and, flags)


def tree_sub(a: Any, b: Any) -> Any:
    """`a - b` leaf by leaf."""
    return jax.tree_util.tree_map(operator.sub, a, b)


def tree_norm(tree: Any) -> jax.Array:
    """The 2-norm of all the leaves together, as one flat vector."""
    leaves = jax.tree_util.tree_leaves(tree)
    return jnp.sqrt(sum(jnp.sum(jnp.square(leaf)) for leaf in leaves))


def max_norm(tree: Any) -> jax.Array:
    """The largest absolute value over every leaf (0 for no leaves)."""
    leaves = jax.tree_util.tree_leaves(tree)
    if not leaves:
        return jnp.zeros(())
    return jnp.max(jnp.stack([jnp.max(jnp.abs(leaf)) for leaf in leaves]))


def describe(tree: Any) -> Any:
    """`tree` with each array-like leaf (arrays, `jax.ShapeDtypeStruct`s, avals) written as
    `dtype[shape]`, e.g. `float32[3]`, for error messages."""
    return jax.tree_util.tree_map(lambda s: f"{s.dtype}{list(s.shape)}", tree)
