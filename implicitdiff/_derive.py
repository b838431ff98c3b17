"""Rules derived from other rules, assignable as `Primitive` class attributes.

They come in pairs::

    lin = linearize_from_jvp                 # linearize by partially evaluating jvp
    linearized = apply_derived_linearization

    vjp_fwd = vjp_fwd_from_jvp               # reverse mode: save the primal inputs,
    vjp_bwd_retval = transpose_jvp           # transpose jvp on the backward pass

    vjp_fwd = vjp_fwd_from_lin               # reverse mode: save lin's residuals,
    vjp_bwd_retval = transpose_linearized    # transpose `linearized`

    jvp = jvp_from_lin                       # forward mode from lin + linearized

Deriving `jvp` from `lin` and `lin` from `jvp` on the same class is a circle and
is rejected when the class is defined.
"""

from __future__ import annotations

from typing import Any

import jax

from . import _jax_compat as compat
from ._jax_compat import Zero, instantiate_zeros
from ._rule_data import Static, reuse_primal

#: The `Primitive` instance the rules receive as `self`. They use only its rule methods and
#: pytree plumbing, so this module (which `_primitive` imports) does not import it back.
PrimitiveLike = Any

__all__ = [
    "linearize_from_jvp",
    "apply_derived_linearization",
    "vjp_fwd_from_jvp",
    "transpose_jvp",
    "vjp_fwd_from_lin",
    "transpose_linearized",
    "jvp_from_lin",
]


def _nz_flat(self: PrimitiveLike, nzs_in: Any) -> list[bool]:
    flat = self.in_tree.flatten_up_to(nzs_in)
    return [
        bool(n) and compat.tangent_aval(a).dtype != jax.dtypes.float0
        for n, a in zip(flat, self.in_avals_flat)
    ]


def _linear_structs(self: PrimitiveLike, nz: list[bool]) -> list[jax.ShapeDtypeStruct]:
    return [
        jax.ShapeDtypeStruct(a.shape, compat.tangent_aval(a).dtype)
        for a, n in zip(self.in_avals_flat, nz)
        if n
    ]


def _transpose(self: PrimitiveLike, nz: list[bool], lin_fn, g: Any) -> tuple[Any, ...]:
    """Transpose `lin_fn(*nonzero input tangents) -> flat output tangents` at `g`."""
    g_flat = self._flatten_out_tangents(g, "output cotangent")  # Zero / None -> zeros
    cts = jax.linear_transpose(lin_fn, *_linear_structs(self, nz))(g_flat)
    it = iter(cts)
    return tuple(self._unflatten_in([next(it) if n else None for n in nz]))


def linearize_from_jvp(self: PrimitiveLike, nzs_in: Any, *primals: Any) -> tuple[Any, Any]:
    """`lin` derived from `jvp`: partially evaluate the jvp rule at the primals.

    The residuals are the jvp rule's values that depend on the primals only; the
    primal output is computed once.
    """
    nz = _nz_flat(self, nzs_in)

    def f(*nz_t):
        out, t = self.jvp(primals, self._fill_tangents(nz, nz_t))
        return out, self._flatten_out_tangents(t, "jvp")

    zeros = [jax.numpy.zeros(s.shape, s.dtype) for s in _linear_structs(self, nz)]
    (out, _), f_lin = jax.linearize(f, *zeros)
    return out, (f_lin, Static(tuple(nz)))


def apply_derived_linearization(self: PrimitiveLike, residuals: Any, *tangents: Any) -> Any:
    """`linearized` for `lin = linearize_from_jvp`: apply the partially evaluated jvp."""
    f_lin, nz = residuals[0], residuals[1].val
    t_flat = self.in_tree.flatten_up_to(tangents)
    nz_t = [instantiate_zeros(t) for t, n in zip(t_flat, nz) if n]
    _, t_out = f_lin(*nz_t)
    return jax.tree_util.tree_unflatten(self.out_tree, t_out)


def vjp_fwd_from_jvp(self: PrimitiveLike, nzs_in: Any, *args: Any) -> tuple[Any, Any]:
    """`vjp_fwd` derived from `jvp`: save the primal inputs (and output)."""
    if not self._caps()[0]:
        raise NotImplementedError(
            f"{type(self).__name__}: vjp_fwd_from_jvp needs a `jvp` rule; define `jvp`"
        )
    out = self(*args)
    return out, (args, out, Static(tuple(_nz_flat(self, nzs_in))))


def transpose_jvp(self: PrimitiveLike, res: Any, g: Any) -> tuple[Any, ...]:
    """`vjp_bwd_retval` for `vjp_fwd = vjp_fwd_from_jvp`: transpose the jvp rule."""
    args, out, nz = res[0], res[1], list(res[2].val)
    args_flat = jax.tree_util.tree_leaves(args)
    out_flat = jax.tree_util.tree_leaves(out)

    def lin_fn(*nz_t):
        with reuse_primal(self, args_flat, out_flat):
            _, t = self.jvp(args, self._fill_tangents(nz, nz_t))
        return self._flatten_out_tangents(t, "jvp")

    return _transpose(self, nz, lin_fn, g)


def vjp_fwd_from_lin(self: PrimitiveLike, nzs_in: Any, *args: Any) -> tuple[Any, Any]:
    """`vjp_fwd` derived from `lin`: save the linearization's residuals."""
    out, lin_res = self.lin(nzs_in, *args)
    return out, (lin_res, Static(tuple(_nz_flat(self, nzs_in))))


def transpose_linearized(self: PrimitiveLike, res: Any, g: Any) -> tuple[Any, ...]:
    """`vjp_bwd_retval` for `vjp_fwd = vjp_fwd_from_lin`: transpose `linearized`."""
    lin_res, nz = res[0], list(res[1].val)

    def lin_fn(*nz_t):
        t = self.linearized(lin_res, *self._fill_tangents(nz, nz_t))
        return self._flatten_out_tangents(t, "linearized")

    return _transpose(self, nz, lin_fn, g)


def jvp_from_lin(self: PrimitiveLike, primals: tuple[Any, ...], tangents: tuple[Any, ...]):
    """`jvp` derived from `lin` and `linearized`."""
    t_flat = self.in_tree.flatten_up_to(tangents)
    nzs = self._unflatten_in([not (t is None or isinstance(t, Zero)) for t in t_flat])
    out, res = self.lin(nzs, *primals)
    return out, self.linearized(res, *tangents)
