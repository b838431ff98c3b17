"""solvers: differentiable numerical solvers built on `implicitdiff`.

- `fixed_point`: solve `x = f(a, x)` (plain, damped or Anderson iteration) with
  implicit derivatives.
- `root`: solve `f(x, *args) = 0` (Newton, chord, Broyden, bisection) with
  implicit derivatives through `implicitdiff.custom_root`.
- `minimize`: `argmin_x fun(x, *args)` (optax L-BFGS or any optax transformation,
  Newton) differentiated through `grad_x fun = 0`.
- `SolveInfo`: steps, residual and status of a solve (`return_info=True`), with
  the status codes `SUCCESS`, `MAX_STEPS`, `NONFINITE`, `BAD_BRACKET`.

- `odeint`: integrate an ODE (adaptive explicit, stiff and fixed-step Runge-Kutta
  methods, as objects in `solvers.ode.methods` or by name), call-compatible with
  `jax.experimental.ode.odeint`, with forward sensitivities and a continuous
  (`BacksolveAdjoint`) or checkpointed discrete (`CheckpointAdjoint`) adjoint;
  `ODEInfo`; with `dense=True` an `ODESolution` to evaluate anywhere in the span.
- `odeint_event`: integrate until an event function crosses zero; the event time
  and state are differentiated through the implicit function theorem.
- `steady_state`: integrate to equilibrium, differentiated implicitly.
- `solve_bvp`: two-point boundary-value problems (collocation with residual control
  and mesh refinement, called like `scipy.integrate.solve_bvp`); `BVPSolution`.
  Derivatives by the implicit function theorem on the collocation equations.

`solvers.nn` packages them as Equinox layers: `DEQ`, `NeuralODE`, `RootLayer`, `ArgminLayer`.
"""

from . import ode
from ._info import BAD_BRACKET, DT_UNDERFLOW, MAX_STEPS, NONFINITE, SUCCESS, SolveInfo
from .bvp import BVPSolution, solve_bvp
from .fixed_point import fixed_point
from .minimize import minimize
from .ode import (
    BacksolveAdjoint,
    CheckpointAdjoint,
    ODEInfo,
    ODESolution,
    odeint,
    odeint_event,
    steady_state,
)
from .root import root

__all__ = [
    "ode",
    "fixed_point",
    "root",
    "minimize",
    "odeint",
    "ODEInfo",
    "ODESolution",
    "odeint_event",
    "steady_state",
    "solve_bvp",
    "BVPSolution",
    "BacksolveAdjoint",
    "CheckpointAdjoint",
    "SolveInfo",
    "SUCCESS",
    "MAX_STEPS",
    "NONFINITE",
    "BAD_BRACKET",
    "DT_UNDERFLOW",
]
