"""Products with small matrices, written as sums of products.

On CPU, XLA hands a matrix product (`dot`) to a multithreaded matrix library. For the
few-by-few products inside a step of a few microseconds, handing the work to its threads
and waiting for them costs more than the product itself, and how much more varies
from one process to the next (a gradient of ROBER with BDF took 2.5 times as long in
most processes). A sum of elementwise products is an ordinary loop fusion instead.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["SMALL", "small_product"]

#: Up to this many columns of `a`, `small_product` sums products; above, it is `a @ b`.
SMALL = 32


def small_product(a: jax.Array, b: jax.Array) -> jax.Array:
    """`a @ b` for a matrix `a` and a vector or matrix `b`: a sum of products while
    `a` has at most `SMALL` columns, else the matrix product."""
    if a.shape[-1] > SMALL:
        return a @ b
    if b.ndim == 1:
        return jnp.sum(a * b[None, :], axis=1)
    return jnp.sum(a[:, :, None] * b[None, :, :], axis=1)
