"""Equinox layers built on the solvers: deep equilibria, neural ODEs, root and argmin layers.

Each layer is an `eqx.Module` that wraps a user-supplied Equinox module (the "cell",
the vector field, the residual or the objective) and calls one solver on it. The
trainable parameters are the wrapped module's floating-point arrays; the layer splits
them off (`eqx.partition`) and passes them to the solver as explicit arguments, so the
solver's implicit or adjoint rule differentiates them, and no activation of the solver's
iterations is kept for the backward pass.

All layers act on one example; batch them with `jax.vmap` (the solvers keep per-example
iteration counts and step sizes). They train with `eqx.filter_jit` and
`eqx.filter_value_and_grad` and optax, work inside `jax.checkpoint`, and serialise with
`eqx.tree_serialise_leaves` (the configuration is static, the parameters are leaves).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from ._checks import status_returned
from .fixed_point import fixed_point
from .minimize import minimize
from .ode import odeint
from .root import root

__all__ = ["DEQ", "NeuralODE", "RootLayer", "ArgminLayer"]


def _split(module: Any) -> tuple[Any, Any]:
    """`(params, static)`: the module's floating-point arrays and everything else."""
    return eqx.partition(module, eqx.is_inexact_array)


def _initial(shape: tuple[int, ...], z0: Any, x: Any, params: Any) -> Any:
    """`z0`, or zeros in the dtype that the input and the parameters promote to."""
    if z0 is not None:
        return z0
    leaves = jax.tree_util.tree_leaves((x, params))
    dtype = jnp.result_type(*leaves) if leaves else jnp.result_type(float)
    if not jnp.issubdtype(dtype, jnp.inexact):
        dtype = jnp.result_type(float)
    return jnp.zeros(shape, dtype)


def _solve_for_z(solver, layer, module, x, z0, return_info):
    """`solver(fn, z0, params, x, ...)` with `fn(z, params, x) = module(z, x)` and the
    layer's options: the shared call of `RootLayer` (`root`) and `ArgminLayer`
    (`minimize`), whose keyword arguments are the same."""
    status_returned(
        type(layer).__name__,
        layer.throw,
        return_info,
        layer_call="z, info = layer(x, return_info=True)",
    )
    params, static = _split(module)

    def fn(z, p, x):
        return eqx.combine(p, static)(z, x)

    return solver(
        fn,
        _initial(layer.z_shape, z0, x, params),
        params,
        x,
        method=layer.method,
        rtol=layer.rtol,
        atol=layer.atol,
        max_steps=layer.max_steps,
        linear_solver=layer.linear_solver,
        throw=layer.throw,
        return_info=return_info,
    )


class DEQ(eqx.Module):
    """A deep-equilibrium layer: the output is the fixed point `z* = cell(z*, x)`.

    The forward pass solves for `z*` with `solvers.fixed_point` (Anderson acceleration
    by default); the backward pass solves one linear system with `I - d cell/dz` at
    `z*` (the implicit function theorem), so memory does not grow with the number of
    forward iterations.

    Three defaults differ from `fixed_point`'s, because a DEQ's cell is a trained
    network: whether it contracts changes during training, its state holds tens to
    thousands of numbers, and each evaluation costs a forward pass of the network.

    - `method="anderson"` (`fixed_point`: `"iterate"`): plain iteration converges
      slowly, or not at all, on a cell that contracts weakly or not at all.
    - `max_steps=100` (`fixed_point`: 1000): Anderson converges in tens of steps on
      a usable cell; the cap bounds the cost of a training step, and a solve that
      needs more raises (or reports, with `throw=False`).
    - `adjoint="gmres"` (`fixed_point`: `None`, which after Anderson is the Neumann
      series with a direct solve where it fails): GMRES needs no contraction and, on
      a cell that contracts weakly, far fewer cell evaluations than the series, which
      converges at the cell's contraction rate; and it never builds the dense
      Jacobian that the fallback would build for states of up to 256 numbers. Its
      tolerance is `implicitdiff.linear_solve.GMRES`'s default (1e-5 in float32,
      1e-10 in float64), not `rtol`. Pass `adjoint=None` for `fixed_point`'s rule.

    Attributes:
        cell: an Equinox module (or any callable pytree) `cell(z, x) -> z`; its
            floating-point arrays are the trained parameters.
        z_shape: the shape of the state `z` (the default initial guess is zeros).
        method: the forward solver: `"anderson"` (default), `"iterate"`, `"damped"`.
        rtol: the forward tolerance (see `fixed_point`).
        atol: the forward absolute tolerance.
        max_steps: the most forward iterations (default 100).
        damping: the mixing parameter of `"anderson"` and `"damped"`.
        history: Anderson's memory.
        adjoint: the backward linear solver: `"gmres"` (default), `None`
            (`fixed_point`'s default), `"neumann"` (the same fixed-point iteration on
            the linear system; needs a contraction), `"dense"`, `"auto"`, a
            `implicitdiff.linear_solve.LinearSolver` with its own options (e.g.
            `linear_solve.GMRES(rtol=1e-4)`), or any function `solve(matvec, b)`.
        throw: raise when the solve does not converge. `throw=False` needs
            `return_info=True` at every call (`z, info = deq(x, return_info=True)`),
            so that the status comes back; a call without it raises a `ValueError`.

    Example:
        ```python
        import equinox as eqx, jax, jax.numpy as jnp
        from solvers.nn import DEQ

        class Cell(eqx.Module):
            lin: eqx.nn.Linear
            def __call__(self, z, x):
                return jnp.tanh(0.5 * self.lin(z) + x)

        deq = DEQ(Cell(eqx.nn.Linear(8, 8, key=jax.random.key(0))), z_shape=(8,))
        z = deq(jnp.ones(8))                      # the equilibrium, shape (8,)
        grads = eqx.filter_grad(lambda m: jnp.sum(m(jnp.ones(8))))(deq)
        ```
    """

    cell: Any
    z_shape: tuple[int, ...] = eqx.field(static=True)
    method: str = eqx.field(static=True, default="anderson")
    rtol: float | None = eqx.field(static=True, default=None)
    atol: float | None = eqx.field(static=True, default=None)
    max_steps: int = eqx.field(static=True, default=100)
    damping: float = eqx.field(static=True, default=0.5)
    history: int = eqx.field(static=True, default=5)
    adjoint: str | Callable[..., Any] | None = eqx.field(static=True, default="gmres")
    throw: bool = eqx.field(static=True, default=True)

    def __call__(self, x: Any, z0: Any = None, *, return_info: bool = False) -> Any:
        """The equilibrium `z*` for the input `x`, from `z0` (default zeros).

        Returns `z*`, or `(z*, info)` with `return_info=True` (a `SolveInfo`: the
        iterations, residual and status), which `throw=False` requires.
        """
        status_returned(
            "DEQ", self.throw, return_info, layer_call="z, info = deq(x, return_info=True)"
        )
        params, static = _split(self.cell)

        def f(a, z):
            p, x = a
            return eqx.combine(p, static)(z, x)

        return fixed_point(
            f,
            (params, x),
            _initial(self.z_shape, z0, x, params),
            method=self.method,
            rtol=self.rtol,
            atol=self.atol,
            max_steps=self.max_steps,
            damping=self.damping,
            history=self.history,
            adjoint=self.adjoint,
            throw=self.throw,
            return_info=return_info,
        )


class NeuralODE(eqx.Module):
    """A neural ODE: `dy/dt = field(y, t)`, integrated by `solvers.odeint`.

    Its defaults differ from `odeint`'s, which follow `jax.experimental.ode.odeint`,
    where training wants something else: `method="tsit5"` (as diffrax's examples; a
    little cheaper than dopri5), `adjoint="checkpoint"` (the exact gradient of what the
    loss saw, faster than backsolve for a network field and stable for any field the
    training produces), `rtol = atol = 1e-6` (a network is trained to the data's
    accuracy, not to 1.4e-8) and `interpolate=True` (a densely sampled trajectory
    costs no extra steps).

    Attributes:
        field: an Equinox module (or callable pytree) `field(y, t) -> dy/dt` (the
            argument order of `odeint`); its floating-point arrays are trained.
        method: an `odeint` method (default `"tsit5"`; `"rk4"`/`"euler"` need `dt`).
        adjoint: `"backsolve"` (the continuous adjoint, constant memory) or
            `"checkpoint"` (the exact discrete gradient; default, where `odeint`'s
            own default for the explicit methods is `"backsolve"`).
        rtol: relative tolerance of the adaptive methods (default 1e-6; `odeint`'s
            is 1.4e-8).
        atol: absolute tolerance of the adaptive methods (default 1e-6).
        dt: the step of the fixed-step methods.
        max_steps: the most recorded steps for `adjoint="checkpoint"`.
        throw: raise when the solve fails. `throw=False` needs `return_info=True` at
            every call (`ys, info = node(y0, ts, return_info=True)`), so that the
            status comes back; a call without it raises a `ValueError`.
        interpolate: evaluate the output times with the interpolant of the steps
            (`odeint(interpolate=True)`; default here, as diffrax's `SaveAt(ts=...)`,
            where `odeint` steps onto every output time by default), so densely
            sampled trajectories cost no extra steps; `False` steps onto every
            output time.

    Example:
        ```python
        import equinox as eqx, jax, jax.numpy as jnp
        from solvers.nn import NeuralODE

        class Field(eqx.Module):
            mlp: eqx.nn.MLP
            def __call__(self, y, t):
                return self.mlp(y)

        field = Field(eqx.nn.MLP(2, 2, 16, 2, key=jax.random.key(0)))
        node = NeuralODE(field, rtol=1e-5, atol=1e-5)
        ys = node(jnp.array([1.0, 0.0]), jnp.linspace(0.0, 1.0, 5))  # (5, 2)
        ```
    """

    field: Any
    method: str = eqx.field(static=True, default="tsit5")
    adjoint: str = eqx.field(static=True, default="checkpoint")
    rtol: float = eqx.field(static=True, default=1e-6)
    atol: float = eqx.field(static=True, default=1e-6)
    dt: float | None = eqx.field(static=True, default=None)
    max_steps: int = eqx.field(static=True, default=4096)
    throw: bool = eqx.field(static=True, default=True)
    interpolate: bool = eqx.field(static=True, default=True)

    def __call__(self, y0: Any, ts: Any, *, return_info: bool = False) -> Any:
        """The trajectory at the times `ts` (`ys[0] = y0`); `(ys, ODEInfo)` with
        `return_info=True`, which `throw=False` requires."""
        status_returned(
            "NeuralODE",
            self.throw,
            return_info,
            layer_call="ys, info = node(y0, ts, return_info=True)",
        )
        params, static = _split(self.field)

        def func(y, t, p):
            return eqx.combine(p, static)(y, t)

        return odeint(
            func,
            y0,
            ts,
            params,
            method=self.method,
            adjoint=self.adjoint,
            rtol=self.rtol,
            atol=self.atol,
            dt=self.dt,
            max_steps=self.max_steps,
            throw=self.throw,
            return_info=return_info,
            interpolate=self.interpolate,
        )


class RootLayer(eqx.Module):
    """An implicit layer: the output `z*` solves `residual(z*, x) = 0`.

    Solved by `solvers.root` (Newton by default) and differentiated by the implicit
    function theorem through `implicitdiff.custom_root`.

    Attributes:
        residual: an Equinox module (or callable pytree) `residual(z, x) -> r` with
            `r` shaped like `z`; its floating-point arrays are trained.
        z_shape: the shape of `z` (the default initial guess is zeros).
        method: a `root` method: `"newton"` (default), `"chord"`, `"broyden"`.
        rtol: relative tolerance.
        atol: absolute tolerance.
        max_steps: the most iterations.
        linear_solver: the linear solver of the Newton steps and the derivatives (see
            `solvers.root`: a name, a `linear_solve.LinearSolver` or a function).
        throw: raise when the solve does not converge. `throw=False` needs
            `return_info=True` at every call (`z, info = layer(x, return_info=True)`),
            so that the status comes back; a call without it raises a `ValueError`.

    Example:
        ```python
        import equinox as eqx, jax, jax.numpy as jnp
        from solvers.nn import RootLayer

        class Residual(eqx.Module):
            lin: eqx.nn.Linear
            def __call__(self, z, x):
                return z + 0.1 * jnp.tanh(self.lin(z)) - x

        layer = RootLayer(Residual(eqx.nn.Linear(4, 4, key=jax.random.key(0))), z_shape=(4,))
        z = layer(jnp.ones(4))
        ```
    """

    residual: Any
    z_shape: tuple[int, ...] = eqx.field(static=True)
    method: str = eqx.field(static=True, default="newton")
    rtol: float | None = eqx.field(static=True, default=None)
    atol: float | None = eqx.field(static=True, default=None)
    max_steps: int = eqx.field(static=True, default=256)
    linear_solver: str | Callable[..., Any] = eqx.field(static=True, default="auto")
    throw: bool = eqx.field(static=True, default=True)

    def __call__(self, x: Any, z0: Any = None, *, return_info: bool = False) -> Any:
        """The root `z*` for the input `x`, from `z0` (default zeros); `(z*, info)` with
        `return_info=True` (a `SolveInfo`), which `throw=False` requires."""
        return _solve_for_z(root, self, self.residual, x, z0, return_info)


class ArgminLayer(eqx.Module):
    """An argmin layer: the output is `z* = argmin_z objective(z, x)`.

    Solved by `solvers.minimize` (L-BFGS by default) and differentiated through the
    optimality condition `grad_z objective(z*, x) = 0`: the gradient with respect to
    the objective's parameters and `x` needs one linear solve with the Hessian, not
    the optimiser's iterations.

    Attributes:
        objective: an Equinox module (or callable pytree) `objective(z, x) ->
            scalar`; its floating-point arrays are trained.
        z_shape: the shape of `z` (the default initial guess is zeros).
        method: a `minimize` method: `"lbfgs"` (default), `"newton"`, or an optax
            transformation.
        rtol: relative tolerance on the gradient.
        atol: absolute tolerance on the gradient.
        max_steps: the most iterations.
        linear_solver: the linear solver of the derivative (Hessian) systems (see
            `solvers.minimize`: a name, a `linear_solve.LinearSolver` or a function).
        throw: raise when the solve does not converge. `throw=False` needs
            `return_info=True` at every call (`z, info = layer(x, return_info=True)`),
            so that the status comes back; a call without it raises a `ValueError`.

    Example:
        ```python
        import equinox as eqx, jax, jax.numpy as jnp
        from solvers.nn import ArgminLayer

        class Objective(eqx.Module):
            log_lam: jax.Array
            def __call__(self, z, x):
                return jnp.sum((z - x) ** 2) + jnp.exp(self.log_lam) * jnp.sum(z**2)

        layer = ArgminLayer(Objective(jnp.array(0.0)), z_shape=(3,))
        z = layer(jnp.ones(3))  # x / (1 + lam) = 0.5
        ```
    """

    objective: Any
    z_shape: tuple[int, ...] = eqx.field(static=True)
    method: Any = eqx.field(static=True, default="lbfgs")
    rtol: float | None = eqx.field(static=True, default=None)
    atol: float | None = eqx.field(static=True, default=None)
    max_steps: int = eqx.field(static=True, default=1000)
    linear_solver: str | Callable[..., Any] = eqx.field(static=True, default="auto")
    throw: bool = eqx.field(static=True, default=True)

    def __call__(self, x: Any, z0: Any = None, *, return_info: bool = False) -> Any:
        """The minimiser `z*` for the input `x`, from `z0` (default zeros); `(z*, info)`
        with `return_info=True` (a `SolveInfo`), which `throw=False` requires."""
        return _solve_for_z(minimize, self, self.objective, x, z0, return_info)
