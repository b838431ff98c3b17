"""The vector fields `odeint` integrates: the user's on the flat state, the pair of
state and tangent (forward sensitivities), and the adjoint system integrated backwards.

Each is called `field(y, t, pd, pn)` on one flat vector, with `pd` the differentiated
and `pn` the other leaves of `func`'s arguments and closed-over values.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero
from jax.flatten_util import ravel_pytree

from implicitdiff import custom_jvp

from ._small import small_product
from .methods import StepEnd, combine_carry, partition_carry

__all__ = ["FlatField", "TangentField", "AdjointField"]


class FlatField:
    """`func` on the flat state: `f(y, t, pd, pn)`, with `pd`/`pn` the differentiable
    and other leaves of `(consts, args)`.

    With `jac_conv` (the user's `jac`, closure-converted like `func`), the field's
    derivative with respect to `y` is the product with that matrix, in every mode:
    the stage matrices of the implicit methods, forward sensitivities and adjoints all
    use it. The derivatives with respect to `t` and the parameters still come from
    `func` by automatic differentiation."""

    def __init__(self, f_conv, unravel, ptree, is_diff, dtype, jac_conv=None):
        self.f_conv, self.unravel, self.ptree = f_conv, unravel, ptree
        self.is_diff, self.dtype = is_diff, dtype
        self.jac_conv = jac_conv
        if jac_conv is not None:
            self._with_jac = custom_jvp(self.evaluate)
            self._with_jac.defjvp(self._jvp_with_jac, symbolic_zeros=True)

    def _split(self, pd, pn):
        it_d, it_n = iter(pd), iter(pn)
        leaves = [next(it_d) if d else next(it_n) for d in self.is_diff]
        return jax.tree_util.tree_unflatten(self.ptree, leaves)

    def evaluate(self, y, t, pd, pn):
        """`func` on the flat state, differentiated by automatic differentiation."""
        consts, args = self._split(pd, pn)
        out = self.f_conv(consts, self.unravel(y), t, *args)
        return ravel_pytree(out)[0].astype(self.dtype)

    def jacobian(self, y, t, pd, pn):
        """The user's Jacobian `d func / d y` as an `(n, n)` matrix on the flat state."""
        consts, args = self._split(pd, pn)
        n = y.shape[0]
        return jnp.reshape(self.jac_conv(consts, self.unravel(y), t, *args), (n, n)).astype(
            self.dtype
        )

    def __call__(self, y, t, pd, pn):
        if self.jac_conv is None:
            return self.evaluate(y, t, pd, pn)
        return self._with_jac(y, t, pd, pn)

    def _jvp_with_jac(self, primals, tangents):
        y, t, pd, pn = primals
        dy, dt, dpd, _ = tangents
        zero = lambda x: isinstance(x, SymbolicZero)  # noqa: E731
        dense = lambda x: jnp.zeros(x.shape, x.dtype) if zero(x) else x  # noqa: E731
        if zero(dt) and all(zero(d) for d in dpd):
            out = self.evaluate(y, t, pd, pn)
            tangent = jnp.zeros_like(out)
        else:
            out, tangent = jax.jvp(
                lambda t, pd: self.evaluate(y, t, pd, pn),
                (t, tuple(pd)),
                (dense(dt), tuple(dense(d) for d in dpd)),
            )
        if not zero(dy):
            jac = self.jacobian(y, t, pd, pn)
            tangent = tangent + small_product(jac, dy.astype(self.dtype))
        return out, tangent


class TangentField:
    """`(y, v)' = (f(y), J v + (df/dpd) dpd)` for forward sensitivities; `pd` holds the
    parameters followed by their tangents.

    A step of the pair is the derivative of the primal step (`step`), not the method
    applied to this larger system: for an explicit method the two are the same, but
    an implicit method would solve the pair's stage equations by its Newton
    iteration, whose tangent half converges only as far as the iteration runs. The
    derivative of the step solves each stage's tangent equation exactly (the implicit
    function theorem on the stage equation), so forward mode gives the derivative of
    the computed solution, the same as the checkpointed adjoint."""

    def __init__(self, f, n, n_pd):
        self.f, self.n, self.n_pd = f, n, n_pd

    def __call__(self, z, t, pd, pn):
        n, k = self.n, self.n_pd
        y, v = z[:n], z[n:]
        p, dp = pd[:k], pd[k:]
        ydot, vdot = jax.jvp(lambda y, p: self.f(y, t, p, pn), (y, p), (v, dp))
        return jnp.concatenate([ydot, vdot])

    def step(self, method, z, kz, t, h, params, tol, end=None):
        """One step of the pair: the primal step and its derivative. With `end` (the
        pair's end, from the checkpointed adjoint's replay: `z1` and what `replay_end`
        keeps of the carry), the primal step takes their primal halves as its end
        (`AbstractMethod.replay_step`); its tangent is computed again."""
        n, k = self.n, self.n_pd
        pd, pn = params
        f = self.f
        base_tol = dataclasses.replace(tol, size=None)
        pair, memory = partition_carry(kz)
        k_primal = combine_carry(_halves(pair, n, 0), memory)

        def primal(y, values, p):
            field = lambda y, t, p: f(y, t, *p, pn)  # noqa: E731
            carry = combine_carry(values, memory)
            if end is None:
                out = method.step_with_stages(field, y, carry, t, h, (p,), tol=base_tol)
            else:
                end_values, end_memory = partition_carry(end.carry)
                primal_end = jax.lax.stop_gradient(
                    StepEnd(end.y[:n], combine_carry(_halves(end_values, n, 0), end_memory))
                )
                out = method.replay_step(field, y, carry, t, h, (p,), primal_end, tol=base_tol)
            y1, err, k_next, ok, ks = out
            values, memory1 = partition_carry(k_next)
            return (y1, err, values, ok, ks), memory1

        (y1, err, k_next, ok, ks), (v1, _, dk_next, _, dks), memory1 = jax.jvp(
            primal,
            (z[:n], partition_carry(k_primal)[0], tuple(pd[:k])),
            (z[n:], _halves(pair, n, 1), tuple(pd[k:])),
            has_aux=True,
        )
        join = lambda a, b: jnp.concatenate([a, b])  # noqa: E731
        err = join(err, jnp.zeros_like(err))
        ks = [join(a, b) for a, b in zip(ks, dks)]
        return join(y1, v1), err, combine_carry(_joined(k_next, dk_next), memory1), ok, ks

    def initial_carry(self, method, z0, kz0):
        """The method's first carry for the pair: its own for `y0` with the tangent of
        its values beside them."""
        n = self.n

        def values(y, k):
            return partition_carry(method.initial_carry(y, k))

        (primal, memory), (tangent, _) = jax.jvp(
            values, (z0[:n], kz0[:n]), (z0[n:], kz0[n:]), has_aux=False
        )
        return combine_carry(_joined(primal, tangent), memory)


def _halves(values, n, which):
    """The primal (`which=0`) or tangent half of each of the pair's carried values."""
    return jax.tree_util.tree_map(lambda x: x[..., n:] if which else x[..., :n], values)


def _joined(primal, tangent):
    """Each carried value and its tangent side by side on the last axis."""
    return jax.tree_util.tree_map(lambda a, b: jnp.concatenate([a, b], -1), primal, tangent)


class AdjointField:
    """The backward-in-time adjoint system in `s = -t`: `(y, a, p_bar)' = (-f,
    J^T a, (df/dpd)^T a)`, as one flat vector."""

    def __init__(self, f, n):
        self.f, self.n = f, n

    def __call__(self, z, s, pd, pn):
        n = self.n
        y, a = z[:n], z[n : 2 * n]
        ydot, pullback = jax.vjp(lambda y, p: self.f(y, -s, p, pn), y, pd)
        a_y, a_p = pullback(a)
        p_flat = ravel_pytree(a_p)[0] if pd else jnp.zeros((0,), z.dtype)
        return jnp.concatenate([-ydot, a_y, p_flat.astype(z.dtype)])
