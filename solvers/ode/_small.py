"""Products with small matrices inside a step, written so that XLA's CPU runtime runs
them as ordinary loops.

On CPU, XLA may hand a matrix product (`dot`), and a sum over an axis of a large
enough array, to a multithreaded library. For the few-by-few products inside a step of
a few microseconds, handing the work to its threads and waiting for them can cost more
than the product itself, by an amount that varies from one process to the next: a
gradient of ROBER with BDF took 8.4 ms in most processes and 3.4 ms in others with two
`6 x 6` products, and 2.7-2.9 ms in every process with them written as sums. So a
small product is a sum of elementwise products (a loop fusion), and a large one a
matrix product of real size (see `small_product`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["SMALL", "PRODUCT_MIN", "small_product", "weighted_stages"]

#: Up to this many columns of `a`, `small_product` sums products (or, for a large `b`,
#: see `PRODUCT_MIN`); above, it is the matrix product.
SMALL = 32
#: From this many elements of the broadcast product `a[:, :, None] * b[None]` on (for
#: a matrix `b`), `small_product` stops reducing it and takes the matrix product.
#: Measured on CPU for a `6 x 6` product: the reduction took 0.8 us at `n = 96` and
#: 3.3 us from `n = 114` (the first `n` past this bound) on, the matrix product 1.0
#: and 1.5 us.
PRODUCT_MIN = 4096


def small_product(a: jax.Array, b: jax.Array) -> jax.Array:
    """`a @ b` for a matrix `a` and a vector or matrix `b`: a sum of products while
    `a` has at most `SMALL` columns (for a large `b`, see `PRODUCT_MIN`), else the
    matrix product."""
    if a.ndim != 2 or b.ndim not in (1, 2):
        raise ValueError(
            f"small_product: `a` must be a matrix and `b` a vector or a matrix, got shapes "
            f"{a.shape} and {b.shape}"
        )
    if a.shape[-1] <= SMALL:
        if b.ndim == 1:
            return jnp.sum(a * b[None, :], axis=1)
        if a.size * b.shape[1] < PRODUCT_MIN:
            return jnp.sum(a[:, :, None] * b[None, :, :], axis=1)
        # Larger, the broadcast product reduced over its middle axis is a reduction
        # XLA hands to its multithreaded library: measured on CPU at `n = 2048`, a
        # `6 x 6` product took 55 us that way. Below `PRODUCT_MIN` the reduction is
        # the quicker (see `PRODUCT_MIN`).
    # Many columns of `a`, or a large `b`: a matrix product of real size, whose
    # derivatives are matrix products too. The other large forms measured:
    # - one row (the stage sums, `weighted_stages`) as scalars times rows of `b`:
    #   fused into each of its consumers, the sum was recomputed in every one, and its
    #   derivative padded one copy of the cotangent per row to the whole of `b`
    #   (rodas5p on 1000 copies of ROBER: forward 45 against 34 ms, gradient 321
    #   against 246 ms; kvaerno5 the same forward, its gradient 3-7% faster);
    # - several rows (`bdf._History`) as sums of broadcast rows: as fast forward, but
    #   the derivative summed each column of the cotangent by a threaded reduction
    #   (1000 copies of ROBER: gradient 12% slower).
    return jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST)


def weighted_stages(coeffs: jax.Array, ks: jax.Array) -> jax.Array:
    """`sum_j coeffs[j] ks[j]` for `s` weights and stages stacked along the first axis of
    `ks`, as a step's stage loop forms its rows: `small_product`, a sum of products or,
    for a large system, the matrix product."""
    s = ks.shape[0]
    return small_product(coeffs[None, :], ks.reshape(s, -1)).reshape(ks.shape[1:])
