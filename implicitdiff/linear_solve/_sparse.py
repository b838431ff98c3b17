"""`Sparse`: a matrix with a known sparsity pattern, built from a few matvecs (column
colouring) and factored by band LU after a bandwidth-reducing reordering.

`sparsity_pattern` finds the pattern of a function's Jacobian by evaluating it."""

from __future__ import annotations

import dataclasses
import hashlib
import warnings
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from ._banded import BandLU
from ._base import PyTree
from ._blocks import (
    BLOCK_MAX,
    block_lu,
    block_lu_solve,
    block_mismatch,
    block_slots,
    small_components,
)
from ._checks import as_arrays, check_throw
from ._structure import DensePattern, distinct, traced_pattern

__all__ = ["Sparse", "SparsityPattern", "sparsity_pattern"]


class SparsityPattern:
    """The positions of the entries of an `n x n` matrix that may be nonzero, with
    what a solve needs from them, computed once in NumPy when it is built:

    - `order`: a reverse Cuthill-McKee ordering of the unknowns (of the symmetrised
      pattern), which brings the entries close to the diagonal; `lower` and `upper`
      are the bandwidths of the reordered matrix;
    - `colours`: a column colouring: columns of one colour never share a row, so one
      matvec on the sum of their unit vectors gives all their entries. `num_colours`
      matvecs build the matrix (a handful for a stencil, whatever `n`);
    - `blocks`: when the unknowns split into independent groups (connected parts of
      the symmetrised pattern) of at most `BLOCK_MAX` (8) unknowns each, and there are
      several, their indices as an array `(groups, size)` padded with `-1`: the
      matrix is block diagonal in that order (copies of a small system, a reaction at
      each point of a grid without transport). Otherwise None.

    The diagonal is always part of the pattern. Two patterns are equal when they
    have the same entries, so solvers built from equal patterns compare (and hash)
    equal and share compiled code.

    Arguments:
        pattern: a boolean `(n, n)` array (True where an entry may be nonzero), or a
            pair `(rows, cols)` of integer arrays of the entries' positions, with `n`
            then given as `size` (default: one more than the largest index).
        size: the number of unknowns, for the `(rows, cols)` form.
    """

    def __init__(self, pattern: Any, size: int | None = None):
        if isinstance(pattern, SparsityPattern):
            if size is not None and size != pattern.n:
                raise ValueError(
                    f"linear_solve.SparsityPattern: `size={size}` differs from the "
                    f"pattern's {pattern.n} unknowns"
                )
            rows, cols, n = pattern.rows, pattern.cols, pattern.n
        elif _is_index_pair(pattern):
            rows, cols = (np.asarray(a) for a in pattern)
            if rows.shape != cols.shape:
                raise ValueError(
                    "linear_solve.Sparse: `pattern` given as (rows, cols) needs two "
                    f"index arrays of one length, got shapes {rows.shape} and {cols.shape}"
                )
            rows, cols = rows.astype(np.int64, copy=False), cols.astype(np.int64, copy=False)
            largest = max(rows.max(initial=-1), cols.max(initial=-1))
            n = int(size) if size is not None else int(largest + 1)
            if rows.size and (min(rows.min(), cols.min()) < 0 or max(rows.max(), cols.max()) >= n):
                raise ValueError(
                    f"linear_solve.Sparse: `pattern` has indices outside 0..{n - 1} (size={n})"
                )
        else:
            mask = np.asarray(pattern)
            if mask.ndim != 2 or mask.shape[0] != mask.shape[1]:
                raise ValueError(
                    "linear_solve.Sparse: `pattern` must be a square boolean array (True "
                    "where the matrix may have a nonzero entry), a tuple (rows, cols) of "
                    f"1-D integer arrays, or a SparsityPattern; got an array of shape "
                    f"{mask.shape}. To find it from a function, use "
                    "linear_solve.sparsity_pattern(fn, x)."
                )
            rows, cols = (a.astype(np.int64) for a in np.nonzero(mask))
            n = mask.shape[0]
        diag = np.arange(n)
        flat = distinct(np.concatenate([rows * n + cols, diag * n + diag]))
        self.n = n
        self.rows, self.cols = np.divmod(flat, n)
        self.rows.setflags(write=False)
        self.cols.setflags(write=False)
        self._digest = hashlib.sha1(np.int64(n).tobytes() + flat.tobytes()).hexdigest()
        adjacency = _neighbours(n, self.rows, self.cols)
        self.blocks = small_components(adjacency, BLOCK_MAX, self.rows.size)
        self.order = _reverse_cuthill_mckee(n, adjacency)
        self.position = np.empty(n, np.int64)
        self.position[self.order] = np.arange(n)
        offsets = self.position[self.cols] - self.position[self.rows]
        self.lower = int(max(0, -offsets.min(initial=0)))
        self.upper = int(max(0, offsets.max(initial=0)))
        self._colours: np.ndarray | None = None
        self._derived: dict[Any, SparsityPattern] = {}  # transposed, coupled(m)

    @property
    def colours(self) -> np.ndarray:
        # Coloured on first use: one pass over the entries, a second or two at ten
        # million, which a caller that only looks at the band (`odeint`'s default)
        # need not pay.
        if self._colours is None:
            self._colours = _colour_columns(self.n, self.rows, self.cols)
            self._colours.setflags(write=False)
        return self._colours

    @property
    def num_colours(self) -> int:
        return int(self.colours.max(initial=-1) + 1)

    @property
    def nnz(self) -> int:
        """The number of entries in the pattern (the diagonal included)."""
        return int(self.rows.size)

    def transposed(self) -> SparsityPattern:
        """The pattern of the transposed matrix."""
        if "T" not in self._derived:
            self._derived["T"] = SparsityPattern((self.cols, self.rows), self.n)
        return self._derived["T"]

    def coupled(self, m: int) -> SparsityPattern:
        """The pattern of `m` coupled copies of the unknowns, copy `s` of unknown `i`
        numbered `m i + s`: an `m x m` block wherever the matrix has an entry."""
        if m in self._derived:
            return self._derived[m]
        s = np.arange(m)
        block = (self.nnz, m, m)  # entry e, copies (s, s'): (m r_e + s, m c_e + s')
        rows = np.broadcast_to(self.rows[:, None, None] * m + s[None, :, None], block)
        cols = np.broadcast_to(self.cols[:, None, None] * m + s[None, None, :], block)
        self._derived[m] = SparsityPattern((rows.ravel(), cols.ravel()), self.n * m)
        return self._derived[m]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SparsityPattern) and self._digest == other._digest

    def __hash__(self) -> int:
        return hash(self._digest)

    def __repr__(self) -> str:
        blocks = "" if self.blocks is None else f", blocks={self.blocks.shape}"
        return (
            f"SparsityPattern(n={self.n}, nnz={self.nnz}, colours={self.num_colours}, "
            f"lower={self.lower}, upper={self.upper}{blocks})"
        )


def _is_index_pair(pattern: Any) -> bool:
    """Whether `pattern` is `(rows, cols)`: a tuple of two 1-D integer arrays (not a
    square mask written as a tuple of tuples)."""
    if not (isinstance(pattern, tuple) and len(pattern) == 2):
        return False
    return all(
        isinstance(a, np.ndarray | jax.Array)
        and np.ndim(a) == 1
        and np.issubdtype(np.asarray(a).dtype, np.integer)
        for a in pattern
    )


def _neighbours(n: int, rows: np.ndarray, cols: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The symmetrised pattern without its diagonal as compressed rows `(starts,
    neighbours)`: unknown `i`'s neighbours, increasing, are
    `neighbours[starts[i] : starts[i + 1]]`."""
    off = rows != cols
    a = np.concatenate([rows[off], cols[off]])
    b = np.concatenate([cols[off], rows[off]])
    first, second = np.divmod(distinct(a * n + b), n)
    return np.searchsorted(first, np.arange(n + 1)), second


#: A breadth-first level whose nodes have at most this many neighbours in all is
#: walked node by node in Python; larger ones by array operations (which cost tens of
#: microseconds however small the level: a long line of unknowns has a level per
#: unknown).
_SMALL_LEVEL = 256
#: The most neighbours `_Search` keeps as a Python list as well.
_LIST_MAX = 1 << 20


class _Search:
    """Breadth-first searches over compressed adjacency rows (see `_neighbours`), one
    level at a time; `seen` marks the nodes already placed (a byte per node, shared
    by Python's indexing and NumPy's)."""

    def __init__(self, adjacency: tuple[np.ndarray, np.ndarray], key: np.ndarray):
        self.starts, self.neighbours = adjacency
        self.bounds = self.starts.tolist()
        # Small levels read the neighbours from a list (a NumPy slice per node costs
        # more than the node's work), unless the list would be large.
        small = self.neighbours.size <= _LIST_MAX
        self.listed = self.neighbours.tolist() if small else None
        self.key, self.key_list = key, key.tolist()
        self.flags = bytearray(self.starts.size - 1)
        self.seen = np.frombuffer(self.flags, dtype=bool)

    def levels(self, start: int, by_key: bool) -> list[list[int] | np.ndarray]:
        """The levels of the search from `start` over unseen nodes, each in the order
        a queue finds them: by the position of the first node of the previous level
        they neighbour, then by `key` (when `by_key`), then by number. They are
        marked seen."""
        self.flags[start] = 1
        out: list[list[int] | np.ndarray] = [[start]]
        while len(out[-1]):
            level, b = out[-1], self.bounds
            if len(level) <= _SMALL_LEVEL and sum(b[v + 1] - b[v] for v in level) <= _SMALL_LEVEL:
                out.append(self._next_small(level, by_key))
            else:
                out.append(self._next_large(np.asarray(level, np.int64), by_key))
        return out[:-1]

    def unmark(self, levels: list[list[int] | np.ndarray]) -> None:
        for level in levels:
            if isinstance(level, list):
                for v in level:
                    self.flags[v] = 0
            else:
                self.seen[level] = False

    def _next_small(self, level: list[int], by_key: bool) -> list[int]:
        found, flags, b = [], self.flags, self.bounds
        listed, nb = self.listed, self.neighbours
        for v in level:
            near = listed[b[v] : b[v + 1]] if listed is not None else nb[b[v] : b[v + 1]].tolist()
            fresh = [w for w in near if not flags[w]]
            if by_key and len(fresh) > 1:
                fresh.sort(key=self.key_list.__getitem__)  # stable: ties stay by number
            for w in fresh:
                flags[w] = 1
            found.extend(fresh)
        return found

    def _next_large(self, level: np.ndarray, by_key: bool) -> np.ndarray:
        starts = self.starts
        first, counts = starts[level], starts[level + 1] - starts[level]
        offsets = np.repeat(first - (np.cumsum(counts) - counts), counts)
        found = self.neighbours[offsets + np.arange(int(counts.sum()))]
        parent = np.repeat(np.arange(level.size), counts)
        fresh = ~self.seen[found]
        found, parent = found[fresh], parent[fresh]
        if found.size == 0:
            return found
        if by_key:  # already by (parent, number) otherwise
            found = found[np.lexsort((found, self.key[found], parent))]
        # The first time each node is found.
        by_node = np.argsort(found, kind="stable")
        node = found[by_node]
        found = found[np.sort(by_node[np.concatenate([[True], node[1:] != node[:-1]])])]
        self.seen[found] = True
        return found


def _reverse_cuthill_mckee(n: int, adjacency: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """A reverse Cuthill-McKee ordering of the graph with these compressed adjacency
    rows (see `_neighbours`): breadth-first from a peripheral unknown of each connected
    part, neighbours by increasing degree, then reversed. The searches go one level at
    a time (`_Search`)."""
    degree = np.diff(adjacency[0])
    search = _Search(adjacency, degree)

    def peripheral(start: int) -> int:
        # George and Liu: restart from a least-degree node of the last level while the
        # eccentricity grows. Each trial search unmarks what it visited.
        best_depth = -1
        for _ in range(8):
            found = search.levels(start, by_key=False)
            search.unmark(found)
            if len(found) - 1 <= best_depth:
                break
            best_depth = len(found) - 1
            last = found[-1]
            if isinstance(last, list):
                start = min(last, key=search.key_list.__getitem__)
            else:
                start = int(last[np.argmin(degree[last])])
        return start

    order: list[list[int] | np.ndarray] = []
    flags = search.flags
    for start in np.argsort(degree, kind="stable").tolist():
        if flags[start]:
            continue
        if search.key_list[start] == 0:  # alone: its own part
            flags[start] = 1
            order.append([start])
            continue
        order.extend(search.levels(peripheral(start), by_key=True))
    flat = [np.asarray(level, np.int64) for level in order]
    return np.concatenate(flat)[::-1] if flat else np.zeros(0, np.int64)


def _colour_columns(n: int, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """A greedy column colouring: columns that share a row get different colours.

    Columns are coloured in order, each with the smallest colour no column sharing one
    of its rows has. Each row keeps the colours its columns took as the bits of one
    integer, so a column's forbidden colours are the union of its rows' sets: the work
    is one pass over the entries, not over the pairs of columns that share a row.
    """
    by_col = np.argsort(cols, kind="stable")
    col_starts = np.searchsorted(cols[by_col], np.arange(n + 1)).tolist()
    rows_by_col = rows[by_col].tolist()
    used = [0] * n  # used[i]: bit c set when a column of row i has colour c
    colours = [0] * n
    for j in range(n):
        rows_j = rows_by_col[col_starts[j] : col_starts[j + 1]]
        taken = 0
        for i in rows_j:
            taken |= used[i]
        bit = ~taken & (taken + 1)  # the lowest colour not taken
        colours[j] = bit.bit_length() - 1
        for i in rows_j:
            used[i] |= bit
    return np.asarray(colours, np.int64)


@dataclasses.dataclass(frozen=True)
class Sparse(BandLU):
    """Solve with a sparse matrix whose pattern of nonzero entries is known.

    The pattern is analysed once, in NumPy, when the solver is built (see
    `SparsityPattern`): a column colouring, and a reverse Cuthill-McKee reordering
    that gathers the entries into a narrow band. `init` then builds the matrix from
    one matvec per colour (a handful for a stencil or a reaction network, whatever the
    size) and factors the reordered matrix by band LU with partial pivoting (as
    `Banded`), or its blocks one by one (below); `solve` and `transpose_solve` reuse
    the factors.

    Cost for `n` unknowns and reordered bandwidths `l`, `u` (`solver.pattern.lower`,
    `.upper`): `O(n (l + u)^2)` time to factor, `O(n (l + u))` per solve and memory.
    That suits patterns that reorder into a narrow band: PDEs on a line, and 2-D grids
    of moderate size (a `k x k` grid has `l ~ u ~ 2k`). A pattern of independent
    groups of at most 8 unknowns (`SparsityPattern.blocks`: copies of a small system,
    in any storage order) is stored as those blocks instead and factored all at once,
    with no sequential scan: `O(n b^2)` time for blocks of `b` unknowns. Build the
    solver once, outside `jax.jit`: the analysis is NumPy.

    The unknowns are numbered as `jax.flatten_util.ravel_pytree` numbers them. A
    pattern that misses an entry would drop it (or add it to another entry of its
    row), so `init` checks the matrix against one more matvec, on a fixed vector, row
    by row, and raises if they differ by more than rounding (`check=False` skips
    this).

    Arguments:
        pattern: where the matrix may be nonzero: a boolean `(n, n)` array, a pair
            `(rows, cols)` of index arrays, or a `SparsityPattern`. The diagonal is
            always included. `sparsity_pattern(fn, x)` finds it for a Jacobian.
        throw: if True (default), raise at run time when the solution is not finite (a
            singular matrix). If False, return it as is.
        check: if True (default), check the pattern at `init`.

    Example:
        ```python
        import jax.numpy as jnp
        import numpy as np
        from implicitdiff import linear_solve

        def operator(v):  # unknown i coupled to unknown i + 3 only (period 3)
            return 2 * v - jnp.roll(v, -3) * (jnp.arange(6) < 3)

        pattern = linear_solve.sparsity_pattern(operator, jnp.zeros(6))
        solver = linear_solve.Sparse(pattern)
        x = solver(operator, jnp.ones(6))  # [0.75, 0.75, 0.75, 0.5, 0.5, 0.5]
        print(solver.pattern)  # three independent pairs: blocks=(3, 2)
        ```
    """

    name: ClassVar[str] = "sparse"
    pattern: Any = None
    throw: bool = True
    check: bool = True
    singular_message: ClassVar[str] = (
        "implicitdiff.linear_solve.Sparse: the solution is not finite (NaN or inf), so "
        "the matrix is singular (or b is not finite). To fix it: make the system "
        "non-singular, check the inputs for NaN, or pass `throw=False` to skip this check."
    )

    def __post_init__(self):
        if self.pattern is None:
            raise ValueError(
                "linear_solve.Sparse: `pattern` is required: a boolean (n, n) array of "
                "the entries that may be nonzero, or (rows, cols). To find it from a "
                "function, use linear_solve.sparsity_pattern(fn, x)."
            )
        if not isinstance(self.pattern, SparsityPattern):
            object.__setattr__(self, "pattern", SparsityPattern(self.pattern))
        p = self.pattern
        if p.blocks is None and p.n >= 200 and p.lower + p.upper + 1 > p.n // 2:
            warnings.warn(
                f"linear_solve.Sparse: the pattern ({p}) reorders into a band as wide as "
                "half the matrix (dense rows or columns, or long-range coupling), so it "
                "costs as much as a dense solve: use linear_solve.Dense for a few "
                "thousand unknowns or fewer, or a Krylov solver (GMRES) beyond.",
                stacklevel=3,
            )
        check_throw(self.throw, self.name)

    def coupled(self, m: int) -> Sparse:
        """The pattern of `m` coupled copies (see `LinearSolver.coupled`): an `m x m`
        block wherever the matrix has an entry."""
        if m == 1:
            return self
        return dataclasses.replace(self, pattern=self.pattern.coupled(m))

    def _widths(self) -> tuple[int, int]:
        return self.pattern.lower, self.pattern.upper

    def factors_in_batches_at(self, n: int) -> bool:
        if self.pattern.blocks is not None:  # dense LU of the blocks, never a band's
            return True
        return super().factors_in_batches_at(n)

    def _reorder(self) -> tuple[np.ndarray, np.ndarray] | None:
        if self.pattern.blocks is not None:  # the blocks index the unknowns themselves
            return None
        return self.pattern.order, self.pattern.position

    def _check_size(self, n: int) -> None:
        if n != self.pattern.n:
            raise ValueError(
                f"linear_solve.Sparse: `pattern` is for {self.pattern.n} unknowns but the "
                f"system has {n} (counted as jax.flatten_util.ravel_pytree flattens "
                "it). To fix it: build the pattern for the flattened unknowns."
            )

    def _storage(self, flat_matvec, n: int, dtype) -> jax.Array:
        """The reordered matrix in band storage, from one matvec per colour."""
        p = self.pattern
        seeds = jnp.asarray(p.colours[None, :] == np.arange(p.num_colours)[:, None], dtype)
        compressed = jax.vmap(flat_matvec)(seeds)  # row c: the sum of the columns of colour c
        values = compressed[p.colours[p.cols], p.rows]
        if p.blocks is not None:
            # One dense block per group, the identity on the padding.
            size = p.blocks.shape[1]
            part, slot = block_slots(p.blocks, n)
            pad = (p.blocks < 0)[:, :, None] * np.eye(size, dtype=bool)[None]
            blocks = jnp.asarray(pad, dtype)
            return blocks.at[part[p.rows], slot[p.rows], slot[p.cols]].set(values)
        i, j = p.position[p.rows], p.position[p.cols]
        return jnp.zeros((n, p.lower + p.upper + 1), dtype).at[i, j - i + p.lower].set(values)

    def _factor(self, storage: jax.Array):
        if self.pattern.blocks is not None:
            return block_lu(storage)
        return super()._factor(storage)

    def _mismatch(self, storage: jax.Array, exact: jax.Array, probe: jax.Array) -> jax.Array:
        if self.pattern.blocks is not None:
            return block_mismatch(storage, exact, probe, self.pattern.blocks)
        return super()._mismatch(storage, exact, probe)

    def _solve_factors(self, factors, b: jax.Array, trans: int) -> jax.Array:
        if self.pattern.blocks is not None:
            return block_lu_solve(factors, b, self.pattern.blocks, trans)
        return super()._solve_factors(factors, b, trans)

    def _mirrored(self) -> Sparse:
        return dataclasses.replace(self, pattern=self.pattern.transposed())

    def _outside_message(self) -> str:
        return _OUTSIDE_PATTERN


def sparsity_pattern(
    fn: Any,
    x: PyTree,
    *,
    method: str = "probe",
    args: tuple = (),
    probes: int = 2,
    seed: int = 0,
    chunk: int = 256,
) -> SparsityPattern:
    """The pattern of the nonzero entries of the Jacobian of `fn` near `x`.

    With `method="trace"`, the pattern is read from the operations of `fn` (its
    Jacobian-vector product, traced at the shapes of `x` and never evaluated, so that
    `custom_jvp` rules count): an entry is in it when some chain of operations carries
    input `j` to output `i`, so it holds every entry that can be nonzero at any point
    `x` and any value of `args`. Values `fn` closes over are constants: a zero entry
    of a closed-over matrix is no coupling (pass such values in `args` for a pattern
    that holds whatever they are). It is exact for stencils (slices, rolls, padding, stacking,
    reshapes, products with constant sparse matrices, convolutions, window sums) and a
    superset where `fn`
    combines values it cannot follow apart: loops (`while_loop`, `scan`), sorts,
    cumulative sums, linear algebra and indexing by traced indices make each of their
    outputs depend on everything their inputs do. It works on traced values (inside
    `jax.jit` or `jax.vmap`), and raises `ValueError` when the pattern is dense (more
    than a quarter of the entries of a matrix of over 256 unknowns: no sparse
    structure to use).

    With `method="probe"` (the default), it evaluates the Jacobian, `chunk` columns at
    a time by forward mode, at `probes` random points near `x` and returns the union
    of their nonzero entries (with the diagonal, as `SparsityPattern` always has it).
    Each component of a probe is
    `x_i + 0.1 z |x_i| + 1e-3 z' max|x|` (`z`, `z'` standard normal): a relative change
    of a few percent, which keeps small positive states positive, and a small
    absolute one, which moves components that are exactly zero (at a zero state a
    product such as `y_2 y_3` has a zero derivative). Entries that are not finite at a
    probe (`fn` left its domain there) are left out, with a warning. Call it once,
    outside `jax.jit`, and build `Sparse` from the result. An entry that vanishes at
    every probe (a branch of `jnp.where` never taken there) is missed; `Sparse` then
    raises when it builds its matrix, if the entry is larger than rounding.

    Arguments:
        fn: a function from pytrees shaped like `x` to pytrees of the same total size
            `n` (for an ODE, `lambda y: func(y, t0, *args)`).
        x: a point (a pytree of arrays; with `method="trace"` only its shapes and
            dtypes are used).
        method: `"probe"` (evaluate the Jacobian at points near `x`) or `"trace"`
            (read the pattern from the operations of `fn`).
        args: more arguments of `fn`, called as `fn(x, *args)`; with `"trace"` their
            values are not used.
        probes: the number of random points.
        seed: the seed of the perturbations.
        chunk: the number of columns evaluated together.

    Returns:
        A `SparsityPattern` of `n` unknowns in the flattened
        (`jax.flatten_util.ravel_pytree`) numbering; its `rows` and `cols` are the
        entries' positions.

    Example:
        ```python
        import jax.numpy as jnp
        from implicitdiff import linear_solve

        pattern = linear_solve.sparsity_pattern(lambda v: v * jnp.roll(v, 1), jnp.ones(4))
        print(pattern.nnz)  # 8: (i, i) and (i, i - 1 mod 4)
        ```
    """
    if method == "trace":
        return _traced(fn, x, tuple(args))
    if method != "probe":
        raise ValueError(
            f"linear_solve.sparsity_pattern: `method` must be 'probe' or 'trace', got {method!r}"
        )
    if args:
        fn = lambda v, fn=fn: fn(v, *args)  # noqa: E731
    flat, unravel = ravel_pytree(as_arrays(x))
    n = flat.size

    @jax.jit
    def columns(point, seeds):
        f = lambda v: ravel_pytree(fn(unravel(v)))[0]  # noqa: E731
        return jax.vmap(lambda s: jax.jvp(f, (point,), (s,))[1])(seeds)

    out = jax.eval_shape(lambda v: ravel_pytree(fn(unravel(v)))[0], flat)
    if out.shape != (n,):
        raise ValueError(
            f"linear_solve.sparsity_pattern: `fn` must return {n} values in all (as many "
            f"as `x` holds), got {out.shape[0]}: the pattern of a linear solver's "
            "matrix is square"
        )
    rng = np.random.default_rng(seed)
    base = np.asarray(flat, np.float64)
    spread = 1e-3 * max(float(np.abs(base).max(initial=0.0)), 1e-3)
    found, nonfinite = [], 0
    for _ in range(probes):
        z = rng.normal(size=(2, n))
        point = jnp.asarray(base + 0.1 * z[0] * np.abs(base) + spread * z[1], flat.dtype)
        for start in range(0, n, chunk):
            stop = min(start + chunk, n)
            seeds = jnp.zeros((chunk, n), flat.dtype)
            seeds = seeds.at[np.arange(stop - start), np.arange(start, stop)].set(1)
            block = np.asarray(columns(point, seeds))[: stop - start]  # (cols, rows)
            finite = np.isfinite(block)
            nonfinite += int(block.size - finite.sum())
            c, r = np.nonzero((block != 0) & finite)
            found.append(r.astype(np.int64) * n + (c + start))
    if nonfinite:
        warnings.warn(
            f"linear_solve.sparsity_pattern: {nonfinite} Jacobian entries were not finite "
            "at the probe points (`fn` outside its domain there) and were left out of "
            "the pattern. If an entry is missing, Sparse raises when it builds its "
            "matrix; evaluate at another point `x` or seed.",
            stacklevel=2,
        )
    key = distinct(np.concatenate(found)) if found else np.zeros(0, np.int64)
    return SparsityPattern((key // n, key % n), n)


#: The largest fraction of the entries a traced pattern of more than `_DENSE_MIN`
#: unknowns may hold: beyond it, the matrix is taken as dense (no structure worth a
#: sparse solver).
_DENSE_FILL = 0.25
_DENSE_MIN = 256


def _traced(fn: Any, x: PyTree, args: tuple) -> SparsityPattern:
    n = ravel_pytree(x)[0].size
    try:
        rows, cols, n = traced_pattern(fn, x, args)
    except ValueError as e:
        raise ValueError(f"linear_solve.sparsity_pattern: {e}: the pattern of a linear "
                         "solver's matrix is square") from None  # fmt: skip
    except DensePattern:
        rows = None
    if rows is None or (n > _DENSE_MIN and rows.size > _DENSE_FILL * n * n):
        raise ValueError(
            f"linear_solve.sparsity_pattern: the Jacobian of `fn` is dense as traced "
            f"({n} unknowns, most outputs reached from most inputs): no sparse structure "
            "to use. Use Dense or GMRES, or method='probe' if most of those couplings "
            "vanish at every point."
        )
    return SparsityPattern((rows, cols), n)


_OUTSIDE_PATTERN = (
    "implicitdiff.linear_solve.Sparse: the operator has entries outside the given "
    "sparsity pattern (its matvec on a test vector differs from the sparse matrix's). "
    "To fix it: give the full pattern (linear_solve.sparsity_pattern(fn, x) finds a "
    "Jacobian's; evaluate it at more points with probes= if an entry vanishes at some), "
    "or use Dense or GMRES. Pass check=False to skip this check."
)
