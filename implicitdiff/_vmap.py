"""The default batching rule: a primitive mapped over one `vmap` axis.

`vmap(f)` must mean "stack `f` over the batch", custom rules included (the
custom_jvp/custom_vjp design note's semantics). So when a `Primitive` has no
`batch` rule, batching it builds a `VmapOf` primitive whose implementation and
every derivative rule are the original ones under `jax.vmap`. Differentiating
`vmap(f)` then runs the user's rules, and nested `vmap`s nest `VmapOf`s.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from . import _jax_compat as compat
from ._jax_compat import Zero
from ._primitive import Primitive
from ._rule_data import Accum, Static, broadcast_prefix, is_accum


class VmapOf(Primitive):
    """`prim` mapped over the axis `axis_data`, inputs batched at `in_dims` (flat)."""

    def __init__(self, prim: Primitive, axis_data: Any, in_dims: list, out_dim: Any):
        out_dims = broadcast_prefix(out_dim, prim.out_tree)
        self.in_avals = tuple(
            prim._unflatten_in(
                [compat.unmapped_aval(axis_data, d, a) for a, d in zip(prim.in_avals_flat, in_dims)]
            )
        )
        self.out_aval = jax.tree_util.tree_unflatten(
            prim.out_tree,
            [compat.unmapped_aval(axis_data, d, a) for a, d in zip(prim.out_avals_flat, out_dims)],
        )
        self.params = dict(
            prim=prim, axis_data=axis_data, in_dims=tuple(in_dims), out_dims=tuple(out_dims)
        )
        super().__init__()

    def _caps(self):
        return self.prim._caps()

    # axis specifications as pytrees matching the arguments / output
    @property
    def _in_axes(self):
        return tuple(self.prim._unflatten_in(list(self.in_dims)))

    @property
    def _out_axes(self):
        return jax.tree_util.tree_unflatten(self.prim.out_tree, list(self.out_dims))

    def _vmap(self, f, in_axes, out_axes, **kw):
        return jax.vmap(
            f, in_axes=in_axes, out_axes=out_axes, **compat.vmap_kwargs(self.axis_data), **kw
        )

    def expand(self, *args):
        return self._vmap(self.prim.expand, self._in_axes, self._out_axes)(*args)

    def jvp(self, primals, tangents):
        prim = self.prim
        nz, nz_t, nz_dims = _nonzero(prim.in_tree.flatten_up_to(tangents), self.in_dims)

        def f(primals, nz_t):
            out, t = prim.jvp(primals, prim._fill_tangents(nz, nz_t))
            return out, prim._flatten_out_tangents(t, "jvp")

        out, t = self._vmap(f, (self._in_axes, nz_dims), (self._out_axes, list(self.out_dims)))(
            primals, nz_t
        )
        return out, jax.tree_util.tree_unflatten(prim.out_tree, t)

    def vjp_fwd(self, nzs_in, *args):
        store = {}

        def fwd(*args):
            out, res, *maybe = self.prim.vjp_fwd(nzs_in, *args)
            store["maybe"] = maybe
            return out, res

        out, res = self._map_with_residuals(fwd, args)
        return (out, res, *store["maybe"])

    def lin(self, nzs_in, *args):
        return self._map_with_residuals(lambda *a: self.prim.lin(nzs_in, *a)[:2], args)

    def _map_with_residuals(self, fn, args):
        """Map `fn(*args) -> (out, residuals)`; residuals keep their own batch axes,
        recorded statically next to them as `(res, Static(axes))`."""
        run = compat.vmap_infer_out_axes(fn, self._in_axes, self.axis_data, self._out_axes)
        (out, res), res_axes = run(*args)
        res_tree = jax.tree_util.tree_structure(res)
        axes_flat = tuple(res_tree.flatten_up_to(res_axes)) if res_tree.num_leaves else ()
        return out, (res, Static(axes_flat))

    def linearized(self, res_, *tangents):
        prim = self.prim
        res, res_axes = _unpack_residuals(res_)
        nz, nz_t, nz_dims = _nonzero(prim.in_tree.flatten_up_to(tangents), self.in_dims)

        def f(res, nz_t):
            t = prim.linearized(res, *prim._fill_tangents(nz, nz_t))
            return prim._flatten_out_tangents(t, "linearized")

        t = self._vmap(f, (res_axes, nz_dims), list(self.out_dims))(res, nz_t)
        return jax.tree_util.tree_unflatten(prim.out_tree, t)

    def vjp_bwd_retval(self, res_, g):
        prim = self.prim
        res, res_axes = _unpack_residuals(res_)
        if type(prim)._defines("vjp_bwd_batched"):
            cts = prim.vjp_bwd_batched(
                self.axis_data.size, self._in_axes, res, res_axes, g, self._out_axes
            )
            if cts is not None:
                return self._batch_axis_to_input(cts)
        nz, g_nz, g_dims = _nonzero(prim.out_tree.flatten_up_to(g), self.out_dims)
        produced: dict[str, list[bool]] = {}

        def bwd(res, g_nz):
            it = iter(g_nz)
            g_full = [
                next(it) if n else Zero(compat.tangent_aval(a))
                for a, n in zip(prim.out_avals_flat, nz)
            ]
            accs = [Accum(compat.tangent_aval(a)) for a in prim.in_avals_flat]
            prim.vjp_bwd(
                res,
                jax.tree_util.tree_unflatten(prim.out_tree, g_full),
                *prim._unflatten_in(accs),
            )
            produced["mask"] = [a.value is not None for a in accs]
            return [a.value for a in accs if a.value is not None]

        # Which inputs receive a cotangent is decided by the rule's Python code, so
        # learn it from a shape-only trace on one batch element, then map.
        jax.eval_shape(lambda r, gg: bwd(*_one_element(r, res_axes, gg, g_dims)), res, g_nz)
        mask = produced["mask"]
        out_axes = [d for d, m in zip(self.in_dims, mask) if m]
        vals = self._vmap(bwd, (res_axes, g_dims), out_axes, sum_match=True)(res, g_nz)
        it = iter(vals)
        flat = [next(it) if m else None for m in mask]
        return tuple(prim._unflatten_in(flat))

    def _batch_axis_to_input(self, cts):
        # `vjp_bwd_batched` puts the batch axis first; each input may have it elsewhere.
        if not isinstance(cts, tuple | list) or len(cts) != len(self.in_avals):
            raise TypeError(
                f"{type(self.prim).__name__}.vjp_bwd_batched must return None or a tuple "
                f"with one cotangent per input ({len(self.in_avals)})"
            )
        out = []
        for ct, dims in zip(cts, self._in_axes):
            if ct is None or isinstance(ct, Zero):
                out.append(None)
                continue
            out.append(
                jax.tree_util.tree_map(
                    lambda x, d: x if d is None else jnp.moveaxis(x, 0, d), ct, dims
                )
            )
        return tuple(out)

    def transpose(self, out_ct, *maybe_accums):
        # The base primitive's transpose, mapped: collect its cotangents for the linear
        # inputs of one batch element into fresh accumulators, vmap that, and hand the
        # batched results to the real accumulators.
        prim = self.prim
        flat = prim.in_tree.flatten_up_to(maybe_accums)
        is_lin = [is_accum(a) for a in flat]
        vals = [a for a, lin in zip(flat, is_lin) if not lin]
        val_dims = [d for d, lin in zip(self.in_dims, is_lin) if not lin]
        lin_dims = [d for d, lin in zip(self.in_dims, is_lin) if lin]
        lin_avals = [compat.tangent_aval(a) for a, lin in zip(prim.in_avals_flat, is_lin) if lin]
        cts = [compat.instantiate_zeros(c) for c in prim.out_tree.flatten_up_to(out_ct)]

        def f(vals, cts):
            accs = [Accum(a) for a in lin_avals]
            it_v, it_a = iter(vals), iter(accs)
            args = [next(it_a) if lin else next(it_v) for lin in is_lin]
            prim.transpose(
                jax.tree_util.tree_unflatten(prim.out_tree, cts), *prim._unflatten_in(args)
            )
            return [
                compat.zeros_like_aval(a) if acc.value is None else acc.value
                for acc, a in zip(accs, lin_avals)
            ]

        outs = self._vmap(f, (val_dims, list(self.out_dims)), lin_dims, sum_match=True)(vals, cts)
        for acc, o in zip([a for a in flat if is_accum(a)], outs):
            acc.accum(o)


def _one_element(res, res_axes, g_nz, g_dims):
    """Slice one batch element out of (res, g_nz) abstractly, for a shape-only trace."""
    take = lambda x, d: x if d is None else jax.lax.index_in_dim(x, 0, d, keepdims=False)
    r = jax.tree_util.tree_map(take, res, res_axes, is_leaf=lambda x: x is None)
    g = [take(x, d) for x, d in zip(g_nz, g_dims)]
    return r, g


def _unpack_residuals(res_):
    """Inverse of `VmapOf._map_with_residuals`: `(res, residual batch axes as a pytree)`."""
    res, axes_flat = res_[0], res_[1].val
    return res, jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(res), list(axes_flat))


def _nonzero(flat, dims):
    """Split flat (co)tangents into (mask, the non-zero ones, their batch dims)."""
    nz = [not (x is None or isinstance(x, Zero)) for x in flat]
    return (
        nz,
        [x for x, n in zip(flat, nz) if n],
        [d for d, n in zip(dims, nz) if n],
    )


Primitive._default_batching = VmapOf
