"""solvers: differentiable numerical solvers built on `implicitdiff`.

- `fixed_point`: solve `x = f(a, x)` (plain, damped or Anderson iteration) with
  implicit derivatives.
- `root`: solve `f(x, *args) = 0` (Newton, chord, Broyden, bisection) with
  implicit derivatives through `implicitdiff.custom_root`.
- `minimize`: `argmin_x fun(x, *args)` (optax L-BFGS or any optax transformation,
  Newton) differentiated through `grad_x fun = 0`.
- `SolveInfo`: steps, residual and status of a solve (`return_info=True`), with
  the status codes `SUCCESS`, `MAX_STEPS`, `NONFINITE`, `BAD_BRACKET`.

`odeint` and `solvers.nn` arrive with later issues.
"""

from ._info import BAD_BRACKET, MAX_STEPS, NONFINITE, SUCCESS, SolveInfo
from .fixed_point import fixed_point
from .minimize import minimize
from .root import root

__all__ = [
    "fixed_point",
    "root",
    "minimize",
    "SolveInfo",
    "SUCCESS",
    "MAX_STEPS",
    "NONFINITE",
    "BAD_BRACKET",
]
