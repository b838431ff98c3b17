"""The `fixed_point` primitive and its derivative rules (the Neumann-series adjoint).

`_FixedPoint` is one `implicitdiff.Primitive`: its value is the forward solve, and its
jvp and vjp rules solve the linear systems of the implicit function theorem,
`t = B da + A t` and `w = x_bar + A^T w`, as fixed points of linear maps by another
`_FixedPoint` (`_linear_solve`), so that derivatives of any order follow from the same
rules.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from implicitdiff import Primitive
from implicitdiff.internal import instantiate_cotangent

from .._info import SolveInfo
from .solve import _solve


class _FixedPoint(Primitive):
    """`(x*, info)` for `x* = f(consts, a, x*)`, iterated from `x0` (`info` is `None`
    unless `cfg.with_info`).

    Inputs `(consts, a, x0, tol)`: `consts` are the traced values `f` closes over,
    `tol` is `(rtol, atol)`; only `consts` and `a` are differentiated. Params:
    `f(consts, a, x)` and `cfg` (a `_Config`).
    """

    def __init__(self, consts_aval, a_aval, x_aval, tol_aval, *, f, cfg):
        self.in_avals = (consts_aval, a_aval, x_aval, tol_aval)
        info = None
        if cfg.with_info:
            leaves = jax.tree_util.tree_leaves(x_aval)
            info = SolveInfo(
                steps=jax.ShapeDtypeStruct((), jnp.int32),
                residual=jax.ShapeDtypeStruct((), jnp.result_type(*leaves)),
                status=jax.ShapeDtypeStruct((), jnp.int32),
            )
        self.out_aval = (x_aval, info)
        self.params = dict(f=f, cfg=cfg)
        super().__init__()

    def expand(self, consts, a, x0, tol):
        return _solve(functools.partial(self.f, consts), a, x0, tol, self.cfg)

    def vjp_fwd(self, nzs_in, consts, a, x0, tol):
        out = self(consts, a, x0, tol)
        return out, (consts, a, out[0], tol)

    def vjp_bwd_retval(self, res, g):
        consts, a, x, tol = res
        g_x = instantiate_cotangent(g[0])
        if g_x is None:
            return None, None, None, None
        # w = g + A^T w, then (consts, a)_bar = B^T w.
        w = _linear_solve(_adjoint_step, self.f, (consts, a, x, g_x), g_x, tol, self.cfg)
        _, pullback = jax.vjp(lambda c, a: self.f(c, a, x), consts, a)
        ct_consts, ct_a = pullback(w)
        return ct_consts, ct_a, None, None

    def jvp(self, primals, tangents):
        consts, a, x0, tol = primals
        d_consts, d_a, _, _ = tangents
        out = self(consts, a, x0, tol)
        x = out[0]
        # t = B (d_consts, d_a) + A t.
        _, rhs = jax.jvp(lambda c, a: self.f(c, a, x), (consts, a), (d_consts, d_a))
        dx = _linear_solve(_tangent_step, self.f, (consts, a, x, rhs), rhs, tol, self.cfg)
        return out, (dx, jax.tree_util.tree_map(jnp.zeros_like, out[1]))


def _adjoint_step(f, params, u):
    """`u -> g + A^T u`, with `A = d_x f` at the solution."""
    consts, a, x, g = params
    _, pullback = jax.vjp(lambda x: f(consts, a, x), x)
    return jax.tree_util.tree_map(jnp.add, g, pullback(u)[0])


def _tangent_step(f, params, t):
    """`t -> rhs + A t`, with `A = d_x f` at the solution."""
    consts, a, x, rhs = params
    _, a_t = jax.jvp(lambda x: f(consts, a, x), (x,), (t,))
    return jax.tree_util.tree_map(jnp.add, rhs, a_t)


def _linear_solve(step, f, params, guess, tol, cfg):
    """The fixed point of the linear map `step(f, params, .)`, as a `_FixedPoint` (so
    that it is differentiated, to any order, by the same rules)."""
    step = functools.partial(_bind_step, step, f)
    x, _ = _FixedPoint.apply((), params, guess, tol, f=step, cfg=cfg.for_derivative())
    return x


def _bind_step(step, f, consts, params, u):
    del consts  # the linear maps close over nothing traced: all of it is in `params`
    return step(f, params, u)
