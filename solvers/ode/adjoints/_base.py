"""The family of adjoints: how reverse mode of `odeint` runs."""

from __future__ import annotations

import abc

__all__ = ["AbstractAdjoint"]


class AbstractAdjoint(abc.ABC):
    """How `odeint`'s reverse mode runs: what the forward pass keeps, and how the
    cotangent of the outputs is pulled back to `y0` and the parameters.

    Subclasses are frozen dataclasses (hashable: a static parameter of the solve).
    Forward mode is the same for every adjoint (forward sensitivities).
    """

    @abc.abstractmethod
    def forward(self, solve, y0, ts, pd, pn):
        """The forward pass of reverse mode: `(outputs, kept)`, where `outputs` are the
        solve's `(ys, info, t_nodes)` and `kept` what `backward` needs besides them
        (a pytree). `solve` is the `ODESolve` primitive being differentiated."""

    @abc.abstractmethod
    def backward(self, solve, kept, ys, ts, pd, pn, g_ys):
        """`(y0_bar, pd_bar)` from the cotangents `g_ys` of the output rows."""

    # An adjoint may also define `backward_batched(solve, axis_size, in_dims, res,
    # res_dims, g, g_dims)`: the pull-back of a whole `vmap` batch at once (see
    # `implicitdiff.Primitive.vjp_bwd_batched`); without it the batch is mapped.
