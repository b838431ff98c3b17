"""The linear map of one `Primitive` application, as a rule object of `compat.lin_call_p`.

Forward, it is the jvp rule's tangent map; transposed, the vjp rule. `BatchedLin` maps
one over a `vmap` axis. The rule objects call back into the primitive only through its
rule methods (`jvp`, `vjp_bwd`, `_fill_tangents`, ...), so this module does not import
`_primitive`.
"""

from __future__ import annotations

import jax

from . import _jax_compat as compat
from ._jax_compat import Zero, instantiate_zeros
from ._rule_data import Accum, NullAccum, join_residuals, reuse_primal

__all__ = ["PrimLin", "BatchedLin"]


class PrimLin:
    """Rule object for `compat.lin_call_p` built from a `Primitive` application."""

    def __init__(self, prim, nz_in, out_nz, res_tree, res_static, n_fwd_res):
        self.prim = prim
        self.nz_in = tuple(nz_in)
        self.out_nz = tuple(out_nz)
        self.res_tree = res_tree
        self.res_static = res_static
        # The first n_fwd_res residuals are the primal inputs and outputs, kept
        # only when the forward (jvp) direction may be evaluated.
        self.n_fwd_res = n_fwd_res
        self.in_tangent_avals = [
            compat.tangent_aval(a) for a, nz in zip(prim.in_avals_flat, nz_in) if nz
        ]
        self.out_avals = [
            compat.tangent_aval(a) for a, nz in zip(prim.out_avals_flat, out_nz) if nz
        ]

    def _rule_forward(self, res, nz_tangents):
        prim = self.prim
        if not prim._caps()[0]:
            raise NotImplementedError(
                f"for jvp support, subclass {type(prim).__name__} must implement `jvp` "
                "(or `lin` and `linearized` with `jvp = jvp_from_lin`)"
            )
        if not self.n_fwd_res:
            raise NotImplementedError(
                f"{type(prim).__name__}: forward evaluation of a reverse-mode "
                "linearization is not supported; use jax.jvp or jax.linearize instead"
            )
        n_in = len(prim.in_avals_flat)
        primals_flat = res[:n_in]
        out_flat = res[n_in : self.n_fwd_res]
        tangents = prim._fill_tangents(self.nz_in, nz_tangents)
        with reuse_primal(prim, primals_flat, out_flat):
            _, t_out = prim.jvp(prim._unflatten_in(primals_flat), tangents)
        t_flat = prim._flatten_out_tangents(t_out, "jvp")
        return [t for t, nz in zip(t_flat, self.out_nz) if nz]

    def _rule_transpose(self, res, cts):
        prim = self.prim
        if not prim._caps()[1]:
            if prim.no_vjp_message:
                raise NotImplementedError(prim.no_vjp_message)
            raise NotImplementedError(
                f"for grad support, subclass {type(prim).__name__} must implement "
                "`vjp_fwd` and `vjp_bwd_retval` (or `vjp_bwd`), or derive them from `jvp` "
                "with `vjp_fwd = vjp_fwd_from_jvp` and `vjp_bwd_retval = transpose_jvp`"
            )
        user_res = join_residuals(list(res[self.n_fwd_res :]), self.res_tree, self.res_static)
        it = iter(cts)
        g_flat = [
            next(it) if nz else Zero(compat.tangent_aval(a))
            for a, nz in zip(prim.out_avals_flat, self.out_nz)
        ]
        g = jax.tree_util.tree_unflatten(prim.out_tree, g_flat)
        accums = [
            (Accum if nz else NullAccum)(compat.tangent_aval(a))
            for a, nz in zip(prim.in_avals_flat, self.nz_in)
        ]
        none = prim.vjp_bwd(user_res, g, *prim._unflatten_in(accums))
        if none is not None:
            raise TypeError(
                f"{type(prim).__name__}.vjp_bwd must accumulate into its accumulator "
                "arguments and return None; to return cotangents, define vjp_bwd_retval"
            )
        return [acc.value for acc, nz in zip(accums, self.nz_in) if nz]

    def _rule_batch(self, axis_data, args, dims, num_res):
        return _batch(self, axis_data, args, dims, num_res)


class BatchedLin:
    """A `PrimLin` (or another `BatchedLin`) mapped over one vmap axis."""

    def __init__(self, base, axis_data, res_dims, tan_dims):
        self.base = base
        self.axis_data = axis_data
        self.res_dims = list(res_dims)
        self.tan_dims = list(tan_dims)
        self.in_tangent_avals = [
            compat.unmapped_aval(axis_data, d, a) for a, d in zip(base.in_tangent_avals, tan_dims)
        ]
        self.out_avals = [compat.unmapped_aval(axis_data, 0, a) for a in base.out_avals]

    def _rule_forward(self, res, tangents):
        f = lambda r, t: self.base._rule_forward(r, t)
        return jax.vmap(
            f,
            in_axes=(self.res_dims, self.tan_dims),
            out_axes=0,
            **compat.vmap_kwargs(self.axis_data),
        )(list(res), list(tangents))

    def _rule_transpose(self, res, cts):
        cts = [instantiate_zeros(c) for c in cts]

        def f(r, c):
            out = self.base._rule_transpose(r, c)
            return [
                compat.zeros_like_aval(a) if o is None else o
                for o, a in zip(out, self.base.in_tangent_avals)
            ]

        return jax.vmap(
            f,
            in_axes=(self.res_dims, [0] * len(cts)),
            out_axes=self.tan_dims,
            sum_match=True,
            **compat.vmap_kwargs(self.axis_data),
        )(list(res), cts)

    def _rule_batch(self, axis_data, args, dims, num_res):
        return _batch(self, axis_data, args, dims, num_res)


def _batch(rule, axis_data, args, dims, num_res):
    """The `vmap` rule of a linear-call rule object: itself when nothing is batched, else
    a `BatchedLin` around it, whose outputs are batched along axis 0."""
    if all(d is None for d in dims):
        return compat.bind_lin(rule, args[:num_res], args[num_res:]), [None] * len(rule.out_avals)
    batched = BatchedLin(rule, axis_data, dims[:num_res], dims[num_res:])
    out = compat.bind_lin(batched, args[:num_res], args[num_res:])
    return out, [0] * len(batched.out_avals)
