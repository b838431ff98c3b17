"""The integration methods of `odeint`, as objects, and the registry of their names.

`odeint(method=Tsit5())` and `odeint(method="tsit5")` are the same: a string is looked
up in `METHODS`. A method is one small module: a tableau and a class of its family
(`ExplicitRungeKutta`, `ESDIRK`), or a class of a new family derived from
`AbstractMethod`. `register` adds one under its name:

```python
from solvers.ode.methods import ButcherTableau, ExplicitRungeKutta, register

register(
    ExplicitRungeKutta(
        tableau=ButcherTableau(c=(0.0, 1.0), a=((), (1.0,)), b=(0.5, 0.5), e=(-0.5, 0.5)),
        order=2,
        name="heun-euler",
    )
)
```
"""

from __future__ import annotations

from typing import Any

from ._base import (
    AbstractMethod,
    ButcherTableau,
    Memory,
    StageReport,
    StageTolerance,
    StepEnd,
    combine_carry,
    partition_carry,
    select,
    stage_report,
)
from ._esdirk import ESDIRK, ESDIRKCarry, StageValues
from ._reuse import FactorMemory
from ._rosenbrock import Rosenbrock, RosenbrockTableau
from ._runge_kutta import ExplicitRungeKutta, TableauMethod
from .bdf import BDF, BDFCarry, BDFMemory
from .bosh3 import Bosh3
from .dopri5 import Dopri5
from .dopri8 import Dopri8
from .euler import Euler
from .kvaerno5 import Kvaerno5
from .radau5 import Radau5, Radau5Carry, StageStart
from .rk4 import RK4
from .rodas4 import Rodas4
from .rodas5p import Rodas5P
from .tsit5 import Tsit5

__all__ = [
    "AbstractMethod",
    "ButcherTableau",
    "StageReport",
    "StageTolerance",
    "StepEnd",
    "Memory",
    "partition_carry",
    "combine_carry",
    "select",
    "stage_report",
    "TableauMethod",
    "ExplicitRungeKutta",
    "ESDIRK",
    "ESDIRKCarry",
    "StageValues",
    "Rosenbrock",
    "RosenbrockTableau",
    "Dopri5",
    "Tsit5",
    "Bosh3",
    "Dopri8",
    "Kvaerno5",
    "Radau5",
    "Radau5Carry",
    "StageStart",
    "FactorMemory",
    "BDF",
    "BDFCarry",
    "BDFMemory",
    "Rodas5P",
    "Rodas4",
    "RK4",
    "Euler",
    "METHODS",
    "register",
    "resolve_method",
]

#: The methods `odeint(method=...)` knows by name.
METHODS: dict[str, AbstractMethod] = {}


def register(method: AbstractMethod) -> AbstractMethod:
    """Make `method` available as `odeint(method=method.name)`; returns it."""
    if not isinstance(method, AbstractMethod):
        raise TypeError(f"register: expected an AbstractMethod instance, got {method!r}")
    METHODS[method.name] = method
    return method


for _method in (
    Dopri5(),
    Tsit5(),
    Bosh3(),
    Dopri8(),
    Kvaerno5(),
    Radau5(),
    BDF(),
    Rodas5P(),
    Rodas4(),
    RK4(),
    Euler(),
):
    register(_method)


def resolve_method(name: str, method: Any) -> AbstractMethod:
    """The method object for `method=` (an instance, or a registered name); an error
    naming the argument of the function `name` otherwise."""
    if isinstance(method, AbstractMethod):
        return method
    if isinstance(method, str) and method in METHODS:
        return METHODS[method]
    raise ValueError(
        f"{name}: `method` must be one of {tuple(METHODS)} or a method object from "
        f"solvers.ode.methods (e.g. Tsit5()), got {method!r}"
    )
