"""solvers: differentiable numerical solvers built on `implicitdiff`.

- `fixed_point`: solve `x = f(a, x)` (plain, damped or Anderson iteration) with
  implicit derivatives.
- `SolveInfo`: steps, residual and status of a solve (`return_info=True`).

`root`, `minimize`, `odeint` and `solvers.nn` arrive with later issues.
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
