"""Block-diagonal matrices of small blocks: LU with partial pivoting of every block at
once, and substitutions unrolled over the rows of a block (each step a vector
operation across the blocks), so that nothing runs one block after another."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ._banded import rows_differ
from ._unrolled import UNROLLED_LU_MAX, unrolled_lu

__all__ = [
    "BLOCK_MAX",
    "block_lu",
    "block_lu_solve",
    "block_mismatch",
    "block_slots",
    "small_components",
]

#: The largest block (unknowns) stored as its own dense matrix: the substitutions are
#: unrolled, `block ** 2` operations each.
BLOCK_MAX = 8


def small_components(
    adjacency: tuple[np.ndarray, np.ndarray], largest: int, nnz: int
) -> np.ndarray | None:
    """The connected parts of the graph with these compressed adjacency rows
    `(starts, neighbours)` (unknown `i`'s neighbours are
    `neighbours[starts[i] : starts[i + 1]]`) as the rows of an
    array `(parts, size)` (each part's unknowns in increasing order, padded with
    `-1`), or None when one part has more than `largest` unknowns, when there is only
    one part, or when padding every part to the largest would store more than four
    times the `nnz` entries (one large part among many single unknowns)."""
    starts, neighbours = adjacency
    n = starts.size - 1
    label = np.full(n, -1, np.int64)
    parts: list[list[int]] = []
    for start in range(n):
        if label[start] >= 0:
            continue
        part, stack = [start], [start]
        label[start] = len(parts)
        while stack:
            v = stack.pop()
            for w in neighbours[starts[v] : starts[v + 1]]:
                if label[w] < 0:
                    label[w] = len(parts)
                    part.append(int(w))
                    stack.append(int(w))
                    if len(part) > largest:
                        return None
        parts.append(sorted(part))
    if len(parts) < 2:
        return None
    size = max(len(p) for p in parts)
    if len(parts) * size * size > 4 * nnz:
        return None
    blocks = np.full((len(parts), size), -1, np.int64)
    for k, p in enumerate(parts):
        blocks[k, : len(p)] = p
    blocks.setflags(write=False)
    return blocks


def _gather(x: jax.Array, blocks: np.ndarray) -> jax.Array:
    """`x` (flat, `n`) as `(parts, size)`, zero in the padding."""
    return jnp.concatenate([x, jnp.zeros(1, x.dtype)])[blocks]


def block_slots(blocks: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """`(part, slot)`: unknown `r` sits at `blocks[part[r], slot[r]]`."""
    part, slot = np.empty(n, np.int64), np.empty(n, np.int64)
    rows, cols = np.nonzero(blocks >= 0)
    part[blocks[rows, cols]], slot[blocks[rows, cols]] = rows, cols
    return part, slot


def _scatter(xb: jax.Array, blocks: np.ndarray, n: int) -> jax.Array:
    """The inverse of `_gather`, by a gather."""
    return xb[block_slots(blocks, n)]


def block_lu(blocks: jax.Array):
    """LU factors of each block with partial pivoting: `(lu, P, perm)`, `P` the
    permutation as a one-hot matrix (`P x = x[perm]`, `P A = L U`). Blocks of up to
    `UNROLLED_LU_MAX` unknowns are factored all at once, entry by entry (LAPACK would
    factor them one after another)."""
    size = blocks.shape[-1]
    if size <= UNROLLED_LU_MAX:
        lu, _, perm = unrolled_lu(blocks)
    else:
        lu, _, perm = jax.vmap(jax.lax.linalg.lu)(blocks)
    onehot = (perm[:, :, None] == np.arange(size)[None, None, :]).astype(blocks.dtype)
    return lu, onehot, perm.astype(jnp.int32)


def block_lu_solve(factors, b: jax.Array, blocks: np.ndarray, trans: int) -> jax.Array:
    """`A^{-1} b` (`trans=0`) or `A^{-T} b` (`trans=1`) for the factors of `block_lu`
    of the blocks on the unknowns `blocks` (see `small_components`)."""
    lu, onehot, _ = factors
    size = lu.shape[-1]
    x = _gather(b, blocks)
    col = lambda v, i: v[:, i]  # noqa: E731
    # The permutations as sums of elementwise products with one-hot matrices, written
    # out term by term (`_rows_times`): exact on every backend, and neither a matrix
    # product nor a reduction for XLA to hand to a threaded library on CPU.
    if trans == 0:
        # L U x = P b: forward with the unit lower triangle, back with the upper.
        v = _rows_times(onehot, x)
        ys: list[jax.Array] = []
        for i in range(size):
            ys.append(col(v, i) - sum((lu[:, i, j] * ys[j] for j in range(i)), 0.0))
        xs: list[jax.Array] = [jnp.zeros(0)] * size
        for i in reversed(range(size)):
            rest = sum((lu[:, i, j] * xs[j] for j in range(i + 1, size)), 0.0)
            xs[i] = (ys[i] - rest) / lu[:, i, i]
        out = jnp.stack(xs, axis=1)
    else:
        # A^T = U^T L^T P: forward with U^T, back with the unit L^T, then P^T.
        zs: list[jax.Array] = []
        for i in range(size):
            rest = sum((lu[:, j, i] * zs[j] for j in range(i)), 0.0)
            zs.append((col(x, i) - rest) / lu[:, i, i])
        ws: list[jax.Array] = [jnp.zeros(0)] * size
        for i in reversed(range(size)):
            ws[i] = zs[i] - sum((lu[:, j, i] * ws[j] for j in range(i + 1, size)), 0.0)
        out = _rows_times(jnp.swapaxes(onehot, 1, 2), jnp.stack(ws, axis=1))
    return _scatter(out, blocks, b.size)


def _rows_times(m: jax.Array, x: jax.Array) -> jax.Array:
    """`m[k] @ x[k]` for each block `k` (`m` of shape `(parts, size, size)`, `x` of
    `(parts, size)`), as `size` sums of `size` elementwise products. Measured on CPU
    for 1000 blocks of 3: a sum over the last axis of `m * x[:, None]` is a reduction
    XLA hands to its multithreaded library, several times slower."""
    size = m.shape[-1]
    cols = []
    for i in range(size):
        acc = m[:, i, 0] * x[:, 0]
        for j in range(1, size):
            acc = acc + m[:, i, j] * x[:, j]
        cols.append(acc)
    return jnp.stack(cols, axis=1)


def block_mismatch(storage: jax.Array, exact: jax.Array, probe: jax.Array,
                   blocks: np.ndarray) -> jax.Array:  # fmt: skip
    """Whether the stored blocks miss entries of the operator (see `rows_differ`)."""
    p = _gather(probe, blocks)
    stored = _scatter(_rows_times(storage, p), blocks, probe.size)
    magnitude = _rows_times(jnp.abs(storage), jnp.abs(p))
    return rows_differ(exact, stored, _scatter(magnitude, blocks, probe.size), storage.shape[-1])
