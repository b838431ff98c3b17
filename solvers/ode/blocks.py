"""A small solve's record, written and read a block of steps at a time.

XLA's CPU runtime (the thunk executor of the jaxlib this library pins) runs the
operations of a loop body one after another in the calling thread only while every
buffer the body touches holds at most `SEQUENTIAL_BYTES` (or while the body has at most
eight operations). A body that touches a larger buffer has its operations scheduled as
tasks, which costs a small system's step about 1 us and more, and varies widely from
run to run. The checkpointed adjoint's record of a small system keeps every step's
start in buffers of `max_steps` rows, so a loop that wrote or read them at each step
would pay that price at every step, forward and backward.

So one solve writes its record by blocks of `RECORD_BLOCK` steps: an inner loop over a
block's steps writes copies of the block's rows (`BlockRows`, each row split into
pieces of at most `SEQUENTIAL_BYTES / RECORD_BLOCK` bytes, so that each piece's buffer
stays under the limit), and an outer loop writes each block into the record. The sweep
reads it back the same way (`adjoints.sweep`). A record's rows past the solve's last
step hold no particular values.
"""

from __future__ import annotations

import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

__all__ = ["RECORD_BLOCK", "SEQUENTIAL_BYTES", "BlockRows", "block_size", "flatten", "is_rows"]

#: The largest buffer (in bytes) a loop body may touch for XLA's CPU runtime to run the
#: body's operations one after another in the calling thread.
SEQUENTIAL_BYTES = 512
#: Steps in one block of a record written by blocks.
RECORD_BLOCK = 16


def block_size(rows: Any, batch: int) -> int:
    """Steps per block of a record whose buffers (the leaves of `rows`, each with the
    steps as its leading axis) are written or read by blocks, else 0: `RECORD_BLOCK`
    for one solve (`batch` 1) whose rows each fit in `SEQUENTIAL_BYTES` (a larger row
    puts the step's own loop through the task scheduler anyway)."""
    if batch != 1:
        return 0
    leaves = jax.tree_util.tree_leaves(rows)
    if any(x.dtype.itemsize * math.prod(x.shape[1:]) > SEQUENTIAL_BYTES for x in leaves):
        return 0
    return RECORD_BLOCK


class BlockRows(eqx.Module):
    """Copies of `block` rows of one record buffer, each row flattened and split into
    pieces of at most `SEQUENTIAL_BYTES / block` bytes: one `(block, length)` array
    per piece.

    Attributes:
        pieces: the pieces' arrays, in the row's order.
        shape: the shape of one row.
        dtype: the buffer's dtype.
    """

    pieces: tuple
    shape: tuple = eqx.field(static=True)
    dtype: Any = eqx.field(static=True)

    @staticmethod
    def _splits(size: int, itemsize: int, block: int) -> list[tuple[int, int]]:
        width = max(1, SEQUENTIAL_BYTES // (block * itemsize))
        return [(i, min(width, size - i)) for i in range(0, size, width)]

    @classmethod
    def rows(cls, buffer, index) -> BlockRows:
        """Rows `index` (a vector of `block` row numbers, in range) of `buffer`."""
        shape = buffer.shape[1:]
        flat = flatten(buffer)[index]
        size, block = flat.shape[1], index.shape[0]
        splits = cls._splits(size, buffer.dtype.itemsize, block)
        pieces = tuple(flat[:, i : i + n] for i, n in splits)
        return cls(pieces=pieces, shape=shape, dtype=buffer.dtype)

    @classmethod
    def empty(cls, buffer, block: int) -> BlockRows:
        """`block` rows of zeros shaped like those of `buffer`."""
        return cls.rows(jnp.zeros((1, *buffer.shape[1:]), buffer.dtype), jnp.zeros(block, int))

    def get(self, i):
        """Row `i`."""
        if not self.pieces:
            return jnp.zeros(self.shape, self.dtype)
        return jnp.concatenate([p[i] for p in self.pieces]).reshape(self.shape)

    def set(self, i, x) -> BlockRows:
        """The rows with row `i` replaced by `x`."""
        flat = jnp.reshape(x, -1)
        pieces, start = [], 0
        for p in self.pieces:
            pieces.append(p.at[i].set(flat[start : start + p.shape[1]]))
            start += p.shape[1]
        return BlockRows(pieces=tuple(pieces), shape=self.shape, dtype=self.dtype)

    def write(self, flat, base):
        """`flat`, a buffer with its rows flattened (`(rows, size)`; see `flatten`),
        with its rows `base, base + 1, ...` replaced by these rows. (A buffer of
        another shape, reshaped here and back, would be copied whole.)"""
        start = 0
        for p in self.pieces:
            flat = jax.lax.dynamic_update_slice(flat, p, (base, jnp.asarray(start, base.dtype)))
            start += p.shape[1]
        return flat


def flatten(buffer):
    """`buffer` with each row flattened: `(rows, size)`."""
    return buffer.reshape(buffer.shape[0], -1)


def is_rows(x) -> bool:
    """Whether `x` is a `BlockRows` (a leaf for `tree_map` over a block's buffers)."""
    return isinstance(x, BlockRows)
