"""The machinery behind `Primitive`: what `_jax_compat` calls to evaluate, differentiate,
transpose and batch an application, and the pytree plumbing those calls share.

`PrimitiveRules` is the base class of `Primitive`. Its methods call the rule vocabulary
(`expand`, `jvp`, `vjp_fwd`, ...) that `Primitive` defines and subclasses override; they
find out which rules a class overrides through `Primitive._defines`, and which class
batches an instance without a batching rule through `Primitive._default_batching`. So this
module needs nothing from `_primitive`, which imports it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from . import _jax_compat as compat
from ._jax_compat import Zero
from ._lin import PrimLin
from ._rule_data import broadcast_prefix, is_float0, split_residuals

__all__ = ["PrimitiveRules"]


class PrimitiveRules:
    """Transformation rules and pytree plumbing of a `Primitive` (see the module notes)."""

    # ---- internals: pytree plumbing -----------------------------------------------

    def _caps(self) -> tuple[bool, bool, bool]:
        """(has jvp, has vjp, has lin) for this instance."""
        return type(self)._caps_cache

    def _unflatten_in(self, flat):
        return jax.tree_util.tree_unflatten(self.in_tree, list(flat))

    def _flatten_out(self, out, where):
        leaves, tree = jax.tree_util.tree_flatten(out)
        if tree != self.out_tree:
            raise TypeError(
                f"{type(self).__name__}.{where} returned a value of structure {tree}, "
                f"but out_aval has structure {self.out_tree}"
            )
        result = []
        for i, (x, a) in enumerate(zip(leaves, self.out_avals_flat)):
            if tuple(np.shape(x)) != tuple(a.shape):
                raise TypeError(
                    f"{type(self).__name__}.{where}: output leaf {i} has shape {np.shape(x)} "
                    f"but out_aval says {a.str_short()}"
                )
            if jnp.result_type(x) != a.dtype:
                x = jnp.asarray(x, a.dtype)
            result.append(x)
        return result

    def _flatten_out_tangents(self, t, where):
        """Output tangents (may hold None / Zero) -> flat list with zeros instantiated."""
        flat = self.out_tree.flatten_up_to(t)
        out = []
        for x, a in zip(flat, self.out_avals_flat):
            ta = compat.tangent_aval(a)
            if x is None or isinstance(x, Zero):
                out.append(compat.zeros_like_aval(ta))
            else:
                if tuple(np.shape(x)) != tuple(a.shape):
                    raise TypeError(
                        f"{type(self).__name__}.{where}: output tangent of shape "
                        f"{np.shape(x)} for an output of type {a.str_short()}"
                    )
                if not is_float0(ta) and jnp.result_type(x) != ta.dtype:
                    x = jnp.asarray(x, ta.dtype)
                out.append(x)
        return out

    def _fill_tangents(self, nz_in, nz_tangents):
        """Full input tangents for a user rule: `Zero`s, or zero arrays unless
        the class sets `symbolic_zeros = True`."""
        it = iter(nz_tangents)
        make = Zero if self.symbolic_zeros else compat.zeros_like_aval
        flat = [
            next(it) if nz else make(compat.tangent_aval(a))
            for a, nz in zip(self.in_avals_flat, nz_in)
        ]
        return self._unflatten_in(flat)

    def _out_nz_default(self):
        return [not is_float0(compat.tangent_aval(a)) for a in self.out_avals_flat]

    def _call_vjp_fwd(self, nz_in, primals_flat):
        nzs = self._unflatten_in(list(nz_in))
        ret = self.vjp_fwd(nzs, *self._unflatten_in(primals_flat))
        if not isinstance(ret, tuple) or len(ret) not in (2, 3):
            raise TypeError(
                f"{type(self).__name__}.vjp_fwd must return (output, residuals), "
                f"got {type(ret).__name__}"
            )
        out, res, *maybe_nzs = ret
        out_flat = self._flatten_out(out, "vjp_fwd")
        out_nz = self._out_nz_default()
        if maybe_nzs:
            given = jax.tree_util.tree_flatten(
                jax.tree_util.tree_map(lambda _, n: n, self.out_aval, maybe_nzs[0])
            )[0]
            out_nz = [a and bool(b) for a, b in zip(out_nz, given)]
        return out_flat, res, out_nz

    def _make_lin(self, nz_in, out_nz, res, primals_flat=None, out_flat=None):
        dyn, tree, static = split_residuals(res)
        fwd = [] if primals_flat is None else [*primals_flat, *out_flat]
        rule = PrimLin(self, nz_in, out_nz, tree, static, len(fwd))
        return rule, fwd + dyn

    def _tangents_from_lin(self, rule, res_flat, out_nz, tangents):
        nz_t = [t for t, nz in zip(tangents, rule.nz_in) if nz]
        outs = compat.bind_lin(rule, res_flat, nz_t) if rule.out_avals else []
        it = iter(outs)
        return [
            next(it) if nz else Zero(compat.tangent_aval(a))
            for a, nz in zip(self.out_avals_flat, out_nz)
        ]

    # ---- internals: rules called by _jax_compat -------------------------------------

    def _rule_impl(self, *args):
        return self._flatten_out(self.expand(*self._unflatten_in(args)), "expand")

    def _rule_abstract_eval(self):
        return list(self.out_avals_flat)

    def _rule_jvp(self, primals, tangents):
        has_jvp, has_vjp, _ = self._caps()
        if not has_jvp and not has_vjp:
            raise NotImplementedError(
                f"for jvp support, subclass {type(self).__name__} must implement `jvp`"
            )
        nz_in = [not isinstance(t, Zero) for t in tangents]
        if has_vjp:
            out_flat, res, out_nz = self._call_vjp_fwd(nz_in, primals)
        else:
            out_flat = jax.tree_util.tree_leaves(self(*self._unflatten_in(primals)))
            res, out_nz = None, self._out_nz_default()
        fwd = (primals, out_flat) if has_jvp else (None, None)
        rule, res_flat = self._make_lin(nz_in, out_nz, res, *fwd)
        return out_flat, self._tangents_from_lin(rule, res_flat, out_nz, tangents)

    def _rule_linearize(self, is_vjp, nz_in, *primals):
        has_jvp, has_vjp, has_lin = self._caps()
        name = type(self).__name__
        if is_vjp:
            if not has_vjp:
                if self.no_vjp_message:
                    raise NotImplementedError(self.no_vjp_message)
                raise NotImplementedError(
                    f"for grad support, subclass {name} must implement `vjp_fwd` and "
                    "`vjp_bwd_retval` (or `vjp_bwd`); a primitive with a `jvp` rule can "
                    "derive them with `vjp_fwd = vjp_fwd_from_jvp` and "
                    "`vjp_bwd_retval = transpose_jvp`"
                )
            out_flat, res, out_nz = self._call_vjp_fwd(nz_in, list(primals))
            rule, res_flat = self._make_lin(nz_in, out_nz, res)

            def linearized(residuals, *tangents):
                return self._tangents_from_lin(rule, residuals, out_nz, tangents)

            return out_flat, out_nz, res_flat, linearized
        if has_lin:
            nzs = self._unflatten_in(list(nz_in))
            ret = self.lin(nzs, *self._unflatten_in(primals))
            out, res = ret[0], ret[1]
            out_flat = self._flatten_out(out, "lin")
            out_nz = self._out_nz_default()

            def linearized(residuals, *tangents):
                t = self.linearized(residuals, *self._unflatten_in(tangents))
                flat = self.out_tree.flatten_up_to(t)
                return [
                    Zero(compat.tangent_aval(a))
                    if (not nz or x is None or isinstance(x, Zero))
                    else x
                    for x, a, nz in zip(flat, self.out_avals_flat, out_nz)
                ]

            out_nz = list(out_nz)
            return out_flat, out_nz, res, linearized
        if has_jvp:
            return compat.fallback_linearize(self, nz_in, primals)
        raise NotImplementedError(
            f"for linearize support, subclass {name} must implement `lin` and `linearized` "
            "(or `jvp`)"
        )

    def _rule_transpose(self, cts, args):
        if not type(self)._defines("transpose"):
            raise NotImplementedError(
                f"for transpose support, subclass {type(self).__name__} must implement `transpose`"
            )
        none = self.transpose(
            jax.tree_util.tree_unflatten(self.out_tree, cts), *self._unflatten_in(args)
        )
        if none is not None:
            raise TypeError(
                f"{type(self).__name__}.transpose must accumulate into the accumulators it is "
                "given for its linear inputs and return None"
            )

    def _rule_batch(self, axis_data, args, dims):
        cls = type(self)
        if all(d is None for d in dims):
            return compat.bind_prim(self, args), [None] * len(self.out_avals_flat)
        if cls._defines("batch"):
            out, out_dims = self.batch(
                axis_data, tuple(self._unflatten_in(args)), self._unflatten_in(dims)
            )
            out_flat = self._flatten_out_batched(out)
            dims_flat = broadcast_prefix(out_dims, self.out_tree)
            return out_flat, dims_flat
        dims_tree = self._unflatten_in(dims)
        out_dim = self.batch_dim_rule(axis_data, dims_tree) if cls._defines("batch_dim_rule") else 0
        mapped = cls._default_batching
        if mapped is None:  # pragma: no cover - the package imports `_vmap` on import
            raise NotImplementedError(
                f"{cls.__name__} has no batching rule and implicitdiff._vmap, which "
                "provides the default one, is not imported"
            )
        prim = mapped(self, axis_data, list(dims), out_dim)
        out = prim(*self._unflatten_in(args))
        return jax.tree_util.tree_leaves(out), list(prim.out_dims)

    def _flatten_out_batched(self, out):
        leaves, tree = jax.tree_util.tree_flatten(out)
        if tree != self.out_tree:
            raise TypeError(
                f"{type(self).__name__}.batch returned structure {tree}, expected {self.out_tree}"
            )
        return leaves
