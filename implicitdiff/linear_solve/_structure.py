"""The sparsity pattern of a Jacobian read from the operations of a function.

`traced_pattern(fn, x, args)` traces the Jacobian-vector product of `fn` to a jaxpr
(shapes only: it works on tracers, under `jax.jit` and `jax.vmap`; `args` are unknowns)
and follows, equation by equation, which entries of the tangent each element of each
intermediate value can depend on. The result is a superset of the nonzero entries of
the Jacobian at every point, never a sample of one point: an entry is left out only
when no chain of operations links the output to the input.

Each floating-point value holds its dependencies as a list of pairs `(element, input)`
(`_Deps`). The rules, by kind of operation:

- elementwise arithmetic: the union of the operands' dependencies (a scalar operand
  reaches every element);
- operations with a zero derivative (comparisons, integer and boolean results,
  `floor`, `sign`, `stop_gradient`, ...): no dependency;
- data movement (`reshape`, `slice`, `concatenate`, `pad`, `transpose`, ...): each
  element takes the dependencies of the element it is copied from, found by applying
  the operation to the elements' positions; `gather`, `dynamic_slice` and the like do
  the same when their indices are constants of the trace;
- reductions and `dot_general`: the union over the elements combined (with a constant
  operand of `dot_general`, only its nonzero entries couple);
- convolutions (`conv_general_dilated`, feature groups included, batch groups not)
  and window operations (`reduce_window_sum`/`max`/`min`, the window maximum's
  derivative and its transpose, max pooling's gradient): each output takes the inputs
  its window reaches (or, for the transpose, the windows that reach it), found from
  the strides, padding and dilations, and for a convolution only where the other
  operand may be nonzero;
- `cumsum`, `sort` and the like: the union along the axis;
- nested jaxprs (`jit`, `checkpoint`, `cond`): followed inside;
- anything else (loops, linear algebra, unknown operations): every output element
  depends on everything any operand depends on.

Values computed from constants alone are evaluated (so an index array built from a
NumPy constant is known), and of values computed from unknowns (`t * A`) it is kept
where they may be nonzero (`_Mask`). A function with no forward mode of its own (a
`custom_vjp`) is traced itself instead of its Jacobian-vector product. A pattern that
would hold more than `_MAX_ENTRIES` pairs in one value stops the trace as dense
(`DensePattern`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from .._jax_compat import Tracer, jaxpr_parts

__all__ = ["DensePattern", "distinct", "traced_pattern"]

#: The most `(element, input)` pairs one value may hold before the trace gives up as
#: dense.
_MAX_ENTRIES = 20_000_000
#: The largest constant (in elements) the trace evaluates.
_MAX_KNOWN = 1 << 22


def distinct(keys: np.ndarray) -> np.ndarray:
    """The distinct values of an integer array, sorted (`np.unique` by a sort: NumPy's
    own is many times slower on millions of keys)."""
    keys = np.sort(np.ravel(keys))
    if keys.size:
        keys = keys[np.concatenate([[True], keys[1:] != keys[:-1]])]
    return keys


class DensePattern(Exception):
    """The traced pattern is (about) dense: no structure worth a sparse solver."""


class _Deps:
    """For a value of `size` elements: `rows[k]` depends on input `cols[k]`, sorted by
    row then column, no pair twice."""

    __slots__ = ("size", "rows", "cols", "_indptr")

    def __init__(self, size: int, rows: np.ndarray, cols: np.ndarray, *, clean: bool = False):
        if rows.size > _MAX_ENTRIES:
            raise DensePattern
        if not clean and rows.size:
            radix = int(cols.max()) + 1
            key = distinct(rows.astype(np.int64) * radix + cols)
            rows, cols = key // radix, key % radix
        self.size = size
        self.rows = rows.astype(np.int64, copy=False)
        self.cols = cols.astype(np.int64, copy=False)
        self._indptr = None

    @classmethod
    def empty(cls, size: int) -> _Deps:
        z = np.zeros(0, np.int64)
        return cls(size, z, z, clean=True)

    @property
    def indptr(self) -> np.ndarray:
        if self._indptr is None:
            counts = np.bincount(self.rows, minlength=self.size)
            self._indptr = np.concatenate([[0], np.cumsum(counts)])
        return self._indptr

    def take(self, src: np.ndarray) -> _Deps:
        """Element `o` takes the dependencies of element `src[o]` (none where
        `src[o] < 0`)."""
        src = np.asarray(src, np.int64).ravel()
        out = np.nonzero(src >= 0)[0]
        s = src[out]
        starts, ends = self.indptr[s], self.indptr[s + 1]
        lens = ends - starts
        total = int(lens.sum())
        if total > _MAX_ENTRIES:
            raise DensePattern
        rows = np.repeat(out, lens)
        offsets = np.arange(total) - np.repeat(np.cumsum(lens) - lens, lens)
        cols = self.cols[np.repeat(starts, lens) + offsets]
        return _Deps(src.size, rows, cols, clean=True)

    def to(self, target: np.ndarray, size: int) -> _Deps:
        """Element `e` of this value feeds element `target[e]` of one of `size`."""
        target = np.asarray(target, np.int64).ravel()
        return _Deps(size, target[self.rows], self.cols)

    def spread(self, size: int) -> _Deps:
        """Every one of `size` elements depends on everything this value does."""
        cols = distinct(self.cols)
        if size * cols.size > _MAX_ENTRIES:
            raise DensePattern
        return _Deps(size, np.repeat(np.arange(size), cols.size), np.tile(cols, size), clean=True)


def _union(size: int, deps: Sequence[_Deps]) -> _Deps:
    deps = [d for d in deps if d.rows.size]
    if not deps:
        return _Deps.empty(size)
    if len(deps) == 1:
        return deps[0]
    return _Deps(
        size, np.concatenate([d.rows for d in deps]), np.concatenate([d.cols for d in deps])
    )


def _positions(shape: Sequence[int]) -> np.ndarray:
    return np.arange(math.prod(shape), dtype=np.int64).reshape(tuple(shape))


def _is_float(aval: Any) -> bool:
    return hasattr(aval, "dtype") and jnp.issubdtype(aval.dtype, jnp.inexact)


def _is_numeric(aval: Any) -> bool:
    """A plain array type (not a PRNG key or another extended dtype)."""
    dtype = getattr(aval, "dtype", None)
    return (
        dtype is not None
        and hasattr(aval, "shape")
        and (jnp.issubdtype(dtype, jnp.number) or jnp.issubdtype(dtype, jnp.bool_))
    )


# Elementwise: the union of the operands.
_ELEMENTWISE = frozenset(
    """
    add sub mul div rem pow max min neg exp exp2 log log1p expm1 tanh logistic sin cos
    tan asin acos atan sinh cosh asinh acosh atanh atan2 sqrt rsqrt cbrt abs
    integer_pow square erf erfc erf_inv lgamma digamma igamma igammac igamma_grad_a
    random_gamma_grad bessel_i0e bessel_i1e polygamma zeta regularized_incomplete_beta
    select_n clamp copy copy_p real imag conj complex convert_element_type
    reduce_precision add_any mul_add
    """.split()
)
# Zero derivative whatever the output type.
_ZERO = frozenset("sign floor ceil round is_finite stop_gradient nextafter".split())
# Reductions over `axes`.
_REDUCE = frozenset("reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or".split())
# The union along `axis` (each output element may depend on the whole line).
_ALONG_AXIS = frozenset("cumsum cumprod cummax cummin cumlogsumexp".split())
# Calls of one nested jaxpr with the same operands.
_CALLS = frozenset(
    """
    jit pjit closed_call core_call checkpoint remat remat2 custom_jvp_call custom_vjp_call
    custom_vjp_call_jaxpr
    """.split()
)


def _move(name: str, params: dict, arrays: list[np.ndarray]) -> np.ndarray | None:
    """The NumPy form of a data movement on position arrays (`-1`: no source), or
    None when `name` is not one of these."""
    x = arrays[0] if arrays else None
    if name == "reshape":
        if params.get("dimensions") is not None:
            x = np.transpose(x, params["dimensions"])
        return np.reshape(x, params["new_sizes"])
    if name == "tile":
        return np.tile(x, params["reps"])
    if name == "transpose":
        return np.transpose(x, params["permutation"])
    if name == "broadcast_in_dim":
        shape, dims = params["shape"], params["broadcast_dimensions"]
        expanded = np.reshape(
            x, [x.shape[dims.index(d)] if d in dims else 1 for d in range(len(shape))]
        )
        return np.broadcast_to(expanded, shape)
    if name == "squeeze":
        return np.reshape(x, [s for d, s in enumerate(x.shape) if d not in params["dimensions"]])
    if name == "expand_dims":
        return np.expand_dims(x, params["dimensions"])
    if name == "slice":
        strides = params["strides"] or (1,) * x.ndim
        return x[
            tuple(
                slice(a, b, s)
                for a, b, s in zip(params["start_indices"], params["limit_indices"], strides)
            )
        ]
    if name == "rev":
        return np.flip(x, params["dimensions"])
    if name == "concatenate":
        return np.concatenate(arrays, axis=params["dimension"])
    if name == "stack":
        return np.stack(arrays, axis=params["axis"])
    if name == "pad":
        for axis, (lo, hi, interior) in enumerate(params["padding_config"]):
            lo, hi, interior = int(lo), int(hi), int(interior)
            if interior:
                size = x.shape[axis]
                shape = list(x.shape)
                shape[axis] = size + (size - 1) * interior if size else 0
                spaced = np.full(shape, -1, np.int64)
                index = [slice(None)] * x.ndim
                index[axis] = slice(None, None, interior + 1)
                spaced[tuple(index)] = x
                x = spaced
            widths = [(0, 0)] * x.ndim
            widths[axis] = (max(lo, 0), max(hi, 0))
            x = np.pad(x, widths, constant_values=-1)
            index = [slice(None)] * x.ndim
            index[axis] = slice(max(-lo, 0), x.shape[axis] - max(-hi, 0))
            x = x[tuple(index)]
        return x
    return None


# Data movements: the number of leading operands moved (None: all of them); the other
# operands (pad's value, indices, start positions) must be known constants, except pad's.
_MOVES = {
    **dict.fromkeys(
        "reshape transpose broadcast_in_dim squeeze expand_dims slice rev pad tile "
        "dynamic_slice gather".split(),
        1,
    ),
    "dynamic_update_slice": 2,
    "concatenate": None,
    "stack": None,
}


class _Tracer:
    """Walks one jaxpr: `deps` of the floating-point values, `known` values of those
    computed from constants."""

    def run(self, jaxpr, consts: Sequence[Any], in_deps: Sequence[_Deps | None],
            in_known: Sequence[Any]) -> tuple[list[_Deps | None], list[Any]]:  # fmt: skip
        invars, constvars, eqns, outvars, is_literal = jaxpr_parts(jaxpr)
        deps: dict[Any, _Deps | None] = {}
        known: dict[Any, Any] = {}
        for v, c in zip(constvars, consts, strict=True):
            deps[v] = None
            # Not a value closed over from an outer trace, nor a PRNG key.
            if not isinstance(c, Tracer) and _is_numeric(v.aval):
                known[v] = np.asarray(c)
        for v, d, k in zip(invars, in_deps, in_known, strict=True):
            deps[v] = d
            if k is not None:
                known[v] = k

        def read(v):
            if is_literal(v):
                return None, np.asarray(v.val)
            return deps.get(v), known.get(v)

        for eqn in eqns:
            ins = [read(v) for v in eqn.invars]
            in_deps_ = [d for d, _ in ins]
            in_vals = [k for _, k in ins]
            out_avals = [v.aval for v in eqn.outvars]
            outs_known = self._evaluate(eqn, in_deps_, in_vals, out_avals)
            if outs_known is not None:
                for v, val in zip(eqn.outvars, outs_known, strict=True):
                    deps[v], known[v] = None, val
                continue
            sub = _single_subjaxpr(eqn.params) if eqn.primitive.name in _CALLS else None
            if sub is not None:
                # A nested call: followed inside, keeping the values it computes from
                # constants.
                outs, vals = self.run(*sub, in_deps_, in_vals)
                for v, d, val, aval in zip(eqn.outvars, outs, vals, out_avals, strict=True):
                    deps[v] = d if _is_float(aval) else None
                    if val is not None:
                        known[v] = val
                continue
            in_avals = [v.aval for v in eqn.invars]
            if len(out_avals) == 1 and all(d is None or not d.rows.size for d in in_deps_):
                # A value of unknown entries that does not depend on the input: where
                # it may be nonzero, when that can be told (`t * A` for a constant A).
                mask = _nonzero_mask(eqn, in_vals, in_avals, out_avals[0])
                if mask is not None:
                    known[eqn.outvars[0]] = _Mask(mask)
            outs = self._rule(eqn, in_deps_, in_vals, in_avals, out_avals)
            for v, d, aval in zip(eqn.outvars, outs, out_avals, strict=True):
                deps[v] = d if _is_float(aval) else None
        return [read(v)[0] for v in outvars], [read(v)[1] for v in outvars]

    def _evaluate(self, eqn, in_deps, in_vals, out_avals):
        """The outputs' values when every input is a known constant (and small)."""
        if any(d is not None for d in in_deps) or not all(map(_is_value, in_vals)):
            return None
        if sum(math.prod(a.shape) for a in out_avals) > _MAX_KNOWN:
            return None
        if eqn.effects or any(not _is_numeric(a) for a in out_avals):
            return None
        try:
            with jax.ensure_compile_time_eval():
                out = eqn.primitive.bind(*in_vals, **eqn.params)
            out = out if eqn.primitive.multiple_results else [out]
            return [np.asarray(o) for o in out]
        except Exception:  # noqa: BLE001 - an operation that cannot run eagerly
            return None

    def _rule(self, eqn, in_deps, in_vals, in_avals, out_avals) -> list[_Deps | None]:
        name = eqn.primitive.name
        sizes = [math.prod(a.shape) for a in out_avals]
        present = [d for d in in_deps if d is not None and d.rows.size]
        if not present:
            return [None if not _is_float(a) else _Deps.empty(s) for a, s in zip(out_avals, sizes)]
        if len(out_avals) == 1 and not _is_float(out_avals[0]):
            return [None]
        if name in _ZERO:
            return [_Deps.empty(s) for s in sizes]
        try:
            out = self._structured(eqn, name, in_deps, in_vals, in_avals, out_avals, sizes)
        except DensePattern:
            raise
        except Exception:  # noqa: BLE001 - a rule that does not fit these params
            out = None
        if out is not None:
            return out
        # Anything else: every output element depends on everything the inputs do.
        every = _union(1, [d.spread(1) for d in present])
        return [every.take(np.zeros(s, np.int64)) if _is_float(a) else None
                for a, s in zip(out_avals, sizes)]  # fmt: skip

    def _structured(self, eqn, name, in_deps, in_vals, in_avals, out_avals, sizes):
        out_aval, size = out_avals[0], sizes[0]
        params = eqn.params
        if name in _ELEMENTWISE and len(out_avals) == 1:
            first = 1 if name == "select_n" else 0
            parts = []
            for d, a in zip(in_deps[first:], in_avals[first:]):
                if d is None:
                    continue
                if tuple(a.shape) == tuple(out_aval.shape):
                    parts.append(d)
                else:  # a scalar, or size-1 axes broadcast
                    parts.append(
                        d.take(np.broadcast_to(_positions(a.shape), out_aval.shape).ravel())
                    )
            return [_union(size, parts)]
        if name == "cond":
            branches = params["branches"]
            results = [self.run(*_closed_parts(b), in_deps[1:], in_vals[1:])[0] for b in branches]
            return [
                None if not _is_float(a) else _union(s, [r[i] for r in results if r[i] is not None])
                for i, (a, s) in enumerate(zip(out_avals, sizes))
            ]
        if name in _REDUCE:
            shape = in_avals[0].shape
            kept = [d for d in range(len(shape)) if d not in params["axes"]]
            target = _positions([shape[d] for d in kept])
            target = np.broadcast_to(np.expand_dims(target, tuple(params["axes"])), shape)
            return [in_deps[0].to(target, size)]
        if name in _ALONG_AXIS or name == "sort":
            axis = params["axis"] if name != "sort" else params["dimension"]
            shape = in_avals[0].shape
            ids = _positions([s for d, s in enumerate(shape) if d != axis])
            line = np.broadcast_to(np.expand_dims(ids, axis), shape)
            lines = _union(ids.size, [d.to(line, ids.size) for d in in_deps if d is not None])
            back = lines.take(line.ravel())
            return [back if _is_float(a) else None for a in out_avals]
        if name == "split":
            pos = _positions(in_avals[0].shape)
            cuts = np.cumsum(params["sizes"])[:-1]
            pieces = np.split(pos, cuts, axis=params["axis"])
            return [in_deps[0].take(piece.ravel()) for piece in pieces]
        if name == "dot_general":
            return [self._dot(params, in_deps, in_vals, in_avals, size)]
        if name == "conv_general_dilated":
            conv = self._conv(params, in_deps, in_vals, in_avals, out_aval, size)
            return None if conv is None else [conv]
        if name in _WINDOWED:
            return [self._windowed(params, in_deps[0], in_avals[0], out_aval, size)]
        if name == "select_and_scatter_add":
            return [self._scattered(params, in_deps[0], in_avals[1], in_avals[0], size)]
        if name.startswith("scatter"):
            return [self._scatter(eqn, in_deps, in_vals, in_avals, size)]
        if name in _MOVES:
            data = _MOVES[name] or len(in_deps)
            return self._movement(eqn, name, in_deps, in_vals, in_avals, data, size)
        return None

    def _movement(self, eqn, name, in_deps, in_vals, in_avals, data, size):
        counts, starts, arrays = _numbered(in_avals[:data])
        moved = _move(name, eqn.params, arrays)
        if moved is None:  # dynamic_slice, gather, dynamic_update_slice: run it
            rest = in_vals[data:]
            if not all(map(_is_value, rest)):
                return None
            # Positions from 1 here, so that 0 and below mean "no source", whatever
            # fill value the operation uses.
            int_dtype = jnp.int64 if jax.config.jax_enable_x64 else jnp.int32
            with jax.ensure_compile_time_eval():
                ins = [jnp.asarray(x + 1, int_dtype) for x in arrays]
                moved = np.asarray(eqn.primitive.bind(*ins, *rest, **eqn.params)) - 1
        moved = np.asarray(moved).ravel()
        if moved.size != size:
            return None
        together = _union(int(starts[-1]), [
            (d if d is not None else _Deps.empty(c)).to(np.arange(c) + start, int(starts[-1]))
            for d, c, start in zip(in_deps[:data], counts, starts)
        ])  # fmt: skip
        out = together.take(moved)
        if name == "pad" and in_deps[1] is not None and in_deps[1].rows.size:
            # The padding takes the value's dependencies.
            padding = np.nonzero(moved < 0)[0]
            out = _union(size, [out, _pairs(in_deps[1], padding, np.zeros_like(padding), size)])
        return [out]

    def _dot(self, params, in_deps, in_vals, in_avals, size):
        (lc, rc), (lb, rb) = params["dimension_numbers"]
        ls, rs = in_avals[0].shape, in_avals[1].shape
        lf = [d for d in range(len(ls)) if d not in lc and d not in lb]
        rf = [d for d in range(len(rs)) if d not in rc and d not in rb]
        nb = math.prod(ls[d] for d in lb)
        nk = math.prod(ls[d] for d in lc)
        n1, n2 = math.prod(ls[d] for d in lf), math.prod(rs[d] for d in rf)
        # Each operand as (batch, free, contracted) positions, and its structural
        # nonzeros (its value where known, else everywhere) in that layout.
        layouts = (([*lb, *lf, *lc], (nb, n1, nk)), ([*rb, *rf, *rc], (nb, n2, nk)))
        lpos, rpos = (
            np.transpose(_positions(a.shape), order).reshape(shape)
            for a, (order, shape) in zip(in_avals, layouts)
        )
        masks = [
            np.transpose(_mask_of(v, a.shape), order).reshape(shape)
            for v, a, (order, shape) in zip(in_vals, in_avals, layouts)
        ]
        parts = []
        for own, other, pos, d in ((0, 1, lpos, in_deps[0]), (1, 0, rpos, in_deps[1])):
            if d is None or not d.rows.size:
                continue
            # Output (b, i, j) combines own element (b, i, k) wherever the other
            # operand's (b, j, k) may be nonzero.
            b, j, k = np.nonzero(masks[other])
            free = n1 if own == 0 else n2
            if free * b.size > _MAX_ENTRIES:
                raise DensePattern
            i = np.arange(free)[:, None]
            if own == 0:
                out = (b * n1 + i) * n2 + j
            else:
                out = (b * n1 + j) * n2 + i
            elems = pos[b, i, k]
            parts.append(_pairs(d, out.ravel(), elems.ravel(), size))
        return _union(size, parts)

    def _conv(self, params, in_deps, in_vals, in_avals, out_aval, size):
        # Output (n, o, t) sums input (n, g cg + c, s) times kernel (o, c, k) over the
        # kernel offsets k and the kernel's cg input channels c, with s the input
        # position that offset reaches from t (`_window`) and g = o // og the feature
        # group of output channel o (`og` output channels per group).
        if params["batch_group_count"] != 1:
            return None
        groups = params["feature_group_count"]
        dn = params["dimension_numbers"]
        lhs_spec, rhs_spec, out_spec = dn.lhs_spec, dn.rhs_spec, dn.out_spec
        lhs = np.transpose(_positions(in_avals[0].shape), lhs_spec)
        rhs = np.transpose(_positions(in_avals[1].shape), rhs_spec)
        out = np.transpose(_positions(out_aval.shape), out_spec)
        masks = [
            np.transpose(_mask_of(v, a.shape), spec)
            for v, a, spec in zip(in_vals, in_avals, (lhs_spec, rhs_spec))
        ]
        n, c = lhs.shape[:2]
        o, cg = rhs.shape[:2]
        og = o // groups
        kernel = rhs.shape[2:]
        src = _window(
            lhs.shape[2:], kernel, out.shape[2:], params["window_strides"], params["padding"],
            params["lhs_dilation"], params["rhs_dilation"],
        )  # fmt: skip
        # (output position, kernel offset) pairs that reach an input position, grouped
        # by offset.
        t, k = np.nonzero(src >= 0)
        s = src[t, k]
        order = np.argsort(k, kind="stable")
        t, k, s = t[order], k[order], s[order]
        bounds = np.searchsorted(k, np.arange(src.shape[1] + 1))
        lhs, out = lhs.reshape(n, c, -1), out.reshape(n, o, -1)
        rhs = rhs.reshape(o, cg, -1)
        lmask, rmask = masks[0].reshape(n, c, -1), masks[1].reshape(o, cg, -1)
        through_lhs = in_deps[0] is not None and in_deps[0].rows.size
        through_rhs = in_deps[1] is not None and in_deps[1].rows.size
        # The pairs to build, counted before building them.
        count = 0
        if through_lhs:
            count += n * int(np.diff(bounds) @ rmask.sum(axis=(0, 1)))
        if through_rhs:
            count += og * int(lmask.sum(axis=(0, 1))[s].sum())
        if count > _MAX_ENTRIES:
            raise DensePattern
        parts = []
        for offset in np.nonzero(np.diff(bounds))[0]:
            lo, hi = bounds[offset], bounds[offset + 1]
            t_at, s_at = t[lo:hi], s[lo:hi]
            oo, cc = np.nonzero(rmask[:, :, offset])
            if through_lhs and oo.size:
                # Through the input, wherever the kernel may be nonzero.
                rows = out[:, oo[None, :], t_at[:, None]]
                elems = lhs[:, ((oo // og) * cg + cc)[None, :], s_at[:, None]]
                parts.append(_pairs(in_deps[0], rows.ravel(), elems.ravel(), size))
            if through_rhs:
                # Through the kernel, wherever the input may be nonzero: input channel
                # cl meets the output channels of its group.
                nn, cl, pp = np.nonzero(lmask[:, :, s_at])
                oo = (cl // cg)[:, None] * og + np.arange(og)[None, :]
                rows = out[nn[:, None], oo, t_at[pp][:, None]]
                elems = rhs[oo, (cl % cg)[:, None], offset]
                parts.append(_pairs(in_deps[1], rows.ravel(), elems.ravel(), size))
        return _union(size, parts)

    def _windowed(self, params, deps, in_aval, out_aval, size):
        # A window reduction: output t of each dimension takes the inputs its window
        # reaches.
        if deps is None or not deps.rows.size:  # (a selection's own derivative is zero)
            return _Deps.empty(size)
        src = _window(
            in_aval.shape, params["window_dimensions"], out_aval.shape,
            params["window_strides"], params["padding"], params["base_dilation"],
            params["window_dilation"],
        )  # fmt: skip
        t, k = np.nonzero(src >= 0)
        return _pairs(deps, t, src[t, k], size)

    def _scattered(self, params, deps, out_aval, source_aval, size):
        # The transpose of a window maximum's derivative (max pooling's gradient):
        # each window adds its source element to the input it selects, so an output
        # takes the source elements of every window that reaches it.
        if deps is None or not deps.rows.size:  # (the selection's derivative is zero)
            return _Deps.empty(size)
        ones = (1,) * len(out_aval.shape)
        src = _window(
            out_aval.shape, params["window_dimensions"], source_aval.shape,
            params["window_strides"], params["padding"], ones, ones,
        )  # fmt: skip
        t, k = np.nonzero(src >= 0)
        return _pairs(deps, src[t, k], t, size)

    def _scatter(self, eqn, in_deps, in_vals, in_avals, size):
        operand, indices, updates = in_deps[0], in_vals[1], in_deps[2]
        base = operand if operand is not None else _Deps.empty(size)
        if updates is None or not updates.rows.size:
            return base
        if not _is_value(indices):
            return _union(size, [base, updates.spread(size)])
        # Each update element's target, in one call: the transpose of scattering the
        # updates (a gather) applied to the operand's positions, counted from 1 (a
        # dropped update gets 0).
        if size >= 1 << 24:  # past float32's exact integers
            return _union(size, [base, updates.spread(size)])
        dnums, mode = eqn.params["dimension_numbers"], eqn.params.get("mode")
        positions = np.arange(1, size + 1, dtype=np.float64).reshape(in_avals[0].shape)
        with jax.ensure_compile_time_eval():
            zeros = jnp.zeros(in_avals[0].shape, jnp.float32)
            idx = jnp.asarray(indices)

            def scatter(u):
                return jax.lax.scatter_add(zeros, idx, u, dnums, mode=mode)

            update = jax.ShapeDtypeStruct(in_avals[2].shape, jnp.float32)
            (target,) = jax.linear_transpose(scatter, update)(jnp.asarray(positions, jnp.float32))
        target = np.rint(np.asarray(target, np.float64)).astype(np.int64).ravel() - 1
        elems = np.nonzero(target >= 0)[0]
        return _union(size, [base, _pairs(updates, target[elems], elems, size)])


# Window operations whose output takes everything its window of the first operand
# reaches: sums, and the derivative of a window maximum or minimum (the tangent of
# the input each window selects; the selection's own derivative is zero).
_WINDOWED = frozenset(
    "reduce_window_sum reduce_window_max reduce_window_min select_and_gather_add".split()
)


def _window(in_shape, window, out_shape, strides, padding, base_dilation, window_dilation):
    """`src[t, k]`: the flat input position that window offset `k` reaches from flat
    output position `t` (`-1`: padding, or a hole of the base dilation), for a window
    operation over all of `in_shape`'s dimensions (a convolution's spatial ones)."""
    if math.prod(out_shape) * math.prod(window) > _MAX_ENTRIES:
        raise DensePattern
    tables = []
    for size, w, out, stride, (lo, _), base, dil in zip(
        in_shape, window, out_shape, strides, padding, base_dilation, window_dilation
    ):
        # The position on the dilated, padded input, and back on the input.
        q = np.arange(out)[:, None] * stride + np.arange(w)[None, :] * dil - lo
        inside = (q >= 0) & (q <= (size - 1) * base) & (q % base == 0)
        tables.append(np.where(inside, q // base, -1))
    src = np.zeros((1, 1), np.int64)
    for size, table in zip(in_shape, tables):
        # Flat positions, one dimension at a time (row-major): (t..., k...) pairs.
        src = np.where(
            (src[:, None, :, None] >= 0) & (table[None, :, None, :] >= 0),
            src[:, None, :, None] * size + table[None, :, None, :],
            -1,
        ).reshape(src.shape[0] * table.shape[0], src.shape[1] * table.shape[1])
    return src


class _Mask:
    """What is known of a value computed without the input but from unknown values:
    where it may be nonzero (a product with a zero, or a zero divided, counts as zero
    even where the other operand is infinite or not a number)."""

    __slots__ = ("mask",)

    def __init__(self, mask: np.ndarray):
        self.mask = mask


def _numbered(avals) -> tuple[list[int], np.ndarray, list[np.ndarray]]:
    """`(counts, starts, positions)` of operands numbered one after another from 0:
    operand `i`'s elements are `starts[i] .. starts[i] + counts[i] - 1`."""
    counts = [math.prod(a.shape) for a in avals]
    starts = np.cumsum([0, *counts])
    return counts, starts, [_positions(a.shape) + s for a, s in zip(avals, starts)]


def _is_value(v: Any) -> bool:
    return v is not None and not isinstance(v, _Mask)


def _mask_of(v: Any, shape: Sequence[int]) -> np.ndarray:
    """Where a value may be nonzero: its entries if known, else its mask, else all."""
    if v is None:
        return np.ones(tuple(shape), bool)
    if isinstance(v, _Mask):
        return v.mask
    return np.asarray(v) != 0


_MASK_SAME = frozenset("neg convert_element_type copy copy_p reduce_precision".split())
_MASK_ANY = frozenset("add sub max min select_n add_any".split())


def _nonzero_mask(eqn, in_vals, in_avals, out_aval) -> np.ndarray | None:
    """Where an operation on values that do not depend on the input may be nonzero:
    a product is nonzero only where all its factors may be, a sum where any term may
    be, a data movement where its source may be. None when that is not followed."""
    name = eqn.primitive.name
    if not _is_float(out_aval) or all(v is None for v in in_vals):
        return None
    shape = tuple(out_aval.shape)

    def spread(i):
        return np.broadcast_to(_mask_of(in_vals[i], in_avals[i].shape), shape)

    try:
        if name == "mul":
            return spread(0) & spread(1)
        if name == "div" or name in _MASK_SAME:
            return spread(0).copy()
        if name in _MASK_ANY:
            first = 1 if name == "select_n" else 0
            return np.logical_or.reduce([spread(i) for i in range(first, len(in_vals))])
        if name in _MOVES:
            data = _MOVES[name] or len(in_vals)
            moved = _move(name, eqn.params, _numbered(in_avals[:data])[2])
            if moved is None:  # moved by indices: not followed
                return None
            moved = np.asarray(moved).ravel()
            flat = np.concatenate([_mask_of(v, a.shape).ravel() for v, a in
                                   zip(in_vals[:data], in_avals[:data])])  # fmt: skip
            fill = True if name != "pad" else bool(_mask_of(in_vals[1], ()).any())
            return np.where(moved >= 0, flat[np.maximum(moved, 0)], fill).reshape(shape)
    except Exception:  # noqa: BLE001 - params this does not follow: unknown
        return None
    return None


# Operations whose forward mode is not their own (a `custom_vjp`'s linearisation):
# a jaxpr holding one is traced through the function itself instead.
_NO_FORWARD = frozenset({"custom_lin", "custom_vjp_call", "custom_vjp_call_jaxpr"})


def _holds(jaxpr, names: frozenset) -> bool:
    """Whether `jaxpr` or a jaxpr nested in its equations' params has an operation
    named in `names`."""
    for eqn in jaxpr_parts(jaxpr)[2]:
        if eqn.primitive.name in names:
            return True
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns") and _holds(inner, names):
                    return True
    return False


def _pairs(d: _Deps, out_rows: np.ndarray, elems: np.ndarray, size: int) -> _Deps:
    """Output `out_rows[k]` depends on whatever element `elems[k]` of `d` does."""
    taken = d.take(elems)  # row k: element elems[k]'s dependencies
    return _Deps(size, out_rows[taken.rows], taken.cols)


def _closed_parts(closed) -> tuple[Any, list[Any]]:
    return closed.jaxpr, list(closed.consts)


def _single_subjaxpr(params: dict):
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        sub = params.get(key)
        if sub is None:
            continue
        if hasattr(sub, "consts"):
            return _closed_parts(sub)
        return sub, []
    return None


def traced_pattern(fn: Callable, x: Any, args: tuple = ()) -> tuple[np.ndarray, np.ndarray, int]:
    """The `(rows, cols, n)` of a superset of the nonzero entries of the Jacobian of
    `fn(x, *args)` with respect to `x` (flattened as `ravel_pytree` does), read from
    its traced operations, for every value of `args` (traced as unknowns).

    What is traced is `fn`'s Jacobian-vector product (`jax.jvp`), so that a
    `custom_jvp` rule counts as JAX differentiates it; a function with no forward
    mode (`custom_vjp`, host callbacks) is traced itself. Raises `DensePattern` when
    the pattern is too large to hold, and `ValueError` when `fn` does not map `n`
    values to `n`."""
    flat, unravel = ravel_pytree(x)
    n = flat.size
    spec = jax.ShapeDtypeStruct(flat.shape, flat.dtype)
    arg_specs = jax.tree_util.tree_map(
        lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)), args
    )
    num_args = len(jax.tree_util.tree_leaves(arg_specs))

    def flat_fn(v, a):
        return ravel_pytree(fn(unravel(v), *a))[0]

    out = jax.eval_shape(flat_fn, spec, arg_specs)
    if out.shape != (n,):
        raise ValueError(
            f"`fn` must return {n} values in all (as many as `x` holds), got {out.shape}"
        )
    identity = _Deps(n, np.arange(n), np.arange(n), clean=True)
    try:
        closed = jax.make_jaxpr(lambda v, t, a: jax.jvp(lambda v: flat_fn(v, a), (v,), (t,))[1])(
            spec, spec, arg_specs
        )
        in_deps = [_Deps.empty(n), identity]
        if _holds(closed.jaxpr, _NO_FORWARD):
            raise ValueError("no forward mode")
    except Exception:  # noqa: BLE001 - no forward mode: the function itself
        closed = jax.make_jaxpr(flat_fn)(spec, arg_specs)
        in_deps = [identity]
    in_deps += [None] * num_args
    (out,), _ = _Tracer().run(closed.jaxpr, list(closed.consts), in_deps, [None] * len(in_deps))
    if out is None:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), n
    return out.rows, out.cols, n
