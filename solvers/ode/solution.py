"""Dense output of `odeint`: the solution between the steps as one polynomial per step.

`odeint(..., dense=True)` keeps the state at every accepted step and, for each step,
the polynomial in `theta = (t - t_i) / h_i` that the method itself offers between
its ends:

- Dopri5, Tsit5 and Dopri8 have continuous extensions built from the step's own
  stages, `y(t_i + theta h) = y_i + h sum_j w_j(theta) k_j`, accurate to about the
  order of the method (4, 4 and 7); so do Rodas5P, Rodas4 and Radau5 (their stages
  solved again with the step's own matrix). The stages are recomputed from the kept
  states once, after the solve, for the steps taken (not for the rest of the buffer).
- The others (BDF, Kvaerno5, Bosh3, RK4, Euler) use the cubic Hermite interpolant
  that matches the values and derivatives at both ends, `O(h^4)` per step.

Both are defined once, in `solvers.ode.interpolation`; `odeint(interpolate=True)`
evaluates the same polynomials inside its loop.

The coefficients are ordinary differentiable functions of the kept states and the
arguments of `func`, so derivatives of `evaluate(t)` reach the inputs of the solve
through `odeint`'s own rules, and reach `t` through the polynomial.
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from implicitdiff import error_if
from implicitdiff.internal import any_over_batch

from .interpolation import step_coefficients
from .methods import AbstractMethod

__all__ = ["ODESolution", "step_polynomials"]


class ODESolution(eqx.Module):
    """The solution of `odeint(..., dense=True)`, to evaluate at any time in the span.

    A pytree (it can be returned from `jit`, batched by `vmap`, differentiated).

    Attributes:
        ts: the step times, `ts[0] = t0`, ..., `ts[num_steps] = t1`; the rows after
            `num_steps` repeat `t1` (the buffer has `max_steps + 1` rows).
        ys: the state at each step time (a pytree like `y0` with a leading axis).
        coeffs: per step, the coefficients of its polynomial in `theta`, lowest
            power first (a pytree like `y0`; each leaf has the axes `(step, power)`
            in front).
        num_steps: the number of accepted steps.

    Example:
        ```python
        import jax.numpy as jnp
        from solvers import odeint

        sol = odeint(lambda y, t: -y, 1.0, jnp.array([0.0, 2.0]), dense=True)
        sol.evaluate(jnp.linspace(0.0, 2.0, 5))  # close to exp(-t)
        sol.derivative(1.0)  # close to -exp(-1)
        ```
    """

    ts: Float[Array, ...]
    ys: Any
    coeffs: Any
    num_steps: Int[Array, ...]

    @property
    def t0(self) -> Float[Array, ...]:
        """The start of the span."""
        return self.ts[0]

    @property
    def t1(self) -> Float[Array, ...]:
        """The end of the span."""
        return self.ts[-1]

    def evaluate(self, t: Any) -> Any:
        """The solution at `t` (a scalar or an array of times inside the span).

        Returns a pytree like `y0` whose leaves have the shape of `t` in front.
        """
        return self._interpolate(t, derivative=False)

    def derivative(self, t: Any) -> Any:
        """`dy/dt` of the interpolant at `t` (same layout as `evaluate`)."""
        return self._interpolate(t, derivative=True)

    def _interpolate(self, t: Any, *, derivative: bool) -> Any:
        t = jnp.asarray(t, self.ts.dtype)
        t = error_if(
            t,
            jnp.any((t < self.ts[0]) | (t > self.ts[-1]) | ~jnp.isfinite(t)),
            "ODESolution.evaluate: `t` must lie inside the span of the solve [t0, t1]; "
            "solve over a longer span to evaluate further",
        )
        shape = t.shape
        flat = t.reshape(-1)
        # The step holding `t`: the last node at or before it, never the final node.
        i = jnp.searchsorted(self.ts, flat, side="right") - 1
        i = jnp.clip(i, 0, jnp.maximum(self.num_steps - 1, 0))
        h = self.ts[i + 1] - self.ts[i]
        theta = (flat - self.ts[i]) / h

        def leaf(c):
            c = c[i]  # (queries, powers, ...)
            powers = c.shape[1]
            if derivative:
                c = c[:, 1:] * jnp.arange(1, powers, dtype=theta.dtype).reshape(
                    (1, -1) + (1,) * (c.ndim - 2)
                ).astype(c.dtype)
            th = theta.reshape((-1,) + (1,) * (c.ndim - 2)).astype(c.dtype)
            out = c[:, -1]
            for p in range(c.shape[1] - 2, -1, -1):  # Horner
                out = out * th + c[:, p]
            if derivative:
                out = out / h.reshape(th.shape).astype(c.dtype)
            return out.reshape(shape + out.shape[1:])

        return jax.tree_util.tree_map(leaf, self.coeffs)


#: Steps whose polynomials are computed together. The kept buffer has a row for every
#: step `max_steps` allows; only the chunks that hold a step taken are computed.
POLYNOMIAL_CHUNK = 64


def step_polynomials(method: AbstractMethod, f, ys, ts, params, steps=None):
    """The coefficients of each step's polynomial in `theta` (lowest power first).

    `f(y, t, params)` is the flat vector field, `ys` the states at the step times `ts`
    (flat, one row per node), `steps` the number of steps taken (the nodes after the
    last repeat the end). Returns an array `(len(ts) - 1, powers, n)` for the steps
    between consecutive nodes: the same interpolant as `odeint(interpolate=True)`
    (`interpolation.step_coefficients`), with the stages recomputed from the nodes
    (radau5's by its Newton iteration from fresh factors, so to its tolerance).

    The rows are computed `POLYNOMIAL_CHUNK` at a time, in a `lax.scan` (differentiable
    in reverse mode, unlike a loop of unknown length) whose chunks past `steps` give
    the constant polynomial of the end without computing any stage: a solve of a
    hundred steps with `max_steps=4096` recomputes two chunks, not 4096 rows of stages
    (for a Rosenbrock method a Jacobian and a factorisation each).
    """

    span = ts[-1] - ts[0]

    def one(y, y1, t, t1):
        h = t1 - t
        # The nodes after the last step repeat the end: a step of size 0 there has a
        # singular stage matrix when a mass matrix is singular, so a tiny step stands
        # in for it, and its polynomial is the constant `y` (derivatives included).
        empty = h == 0
        h = jnp.where(empty, 1e-9 * span, h)
        k1 = f(y, t, params)
        if method.continuous_weights() is not None:
            # A fresh carry: the step keeps nothing of the solve (radau5's factors and
            # the start of its iteration).
            carry = method.initial_carry(y, k1)
            *_, ks = method.step_with_stages(f, y, carry, t, h, params)
            k_next = f(y1, t1, params)
        elif method.interpolation is None:
            # Cubic Hermite: only the derivatives at both ends are used.
            ks = [k1] + [jnp.zeros_like(k1)] * (method.stages - 1)
            k_next = f(y1, t1, params)
        else:
            ks = method.stages_of(f, y, k1, t, h, params)
            k_next = ks[-1]
        coeffs = step_coefficients(method, h, y, y1, k_next, ks)
        return jnp.where(empty, jnp.zeros_like(coeffs).at[0].set(y), coeffs)

    rows = ys.shape[0] - 1
    nodes = (ys[:-1], ys[1:], ts[:-1], ts[1:])
    hermite = method.continuous_weights() is None and method.interpolation is None
    if steps is None or hermite or rows <= POLYNOMIAL_CHUNK:
        # (The cubic Hermite polynomial needs no stage: every row at once is cheaper.)
        return jax.vmap(one)(*nodes)
    chunks = -(-rows // POLYNOMIAL_CHUNK)

    def split(x):
        # Padded with copies of the last row (computed, then dropped).
        pad = jnp.repeat(x[-1:], chunks * POLYNOMIAL_CHUNK - rows, axis=0)
        x = jnp.concatenate([x, pad])
        return x.reshape((chunks, POLYNOMIAL_CHUNK) + x.shape[1:])

    computed = jax.vmap(one)
    split_nodes = tuple(map(split, nodes))
    shape = jax.eval_shape(computed, *(x[0] for x in split_nodes))

    def chunk(_, x):
        start, nodes = x

        def constant():
            return jnp.zeros(shape.shape, shape.dtype).at[:, 0].set(nodes[0])

        # Under `vmap`, computed for the whole batch when any element's steps reach it.
        taken = any_over_batch(start < steps)
        return None, jax.lax.cond(taken, lambda: computed(*nodes), constant)

    starts = jnp.arange(chunks) * POLYNOMIAL_CHUNK
    _, coeffs = jax.lax.scan(chunk, None, (starts, split_nodes))
    return coeffs.reshape((-1,) + coeffs.shape[2:])[:rows]
