"""Ordinary differential equations: `odeint` and what it is made of.

- `odeint`, `ODEInfo`, `ODESolution`: the solve (`odeint.py`, `info.py`,
  `solution.py`), one `implicitdiff.Primitive` with its derivative rules (`solve.py`).
- `methods`: the integration methods as objects (`Tsit5()`, `Kvaerno5()`, ...), the
  families they belong to and the registry of their names.
- `adjoints`: `BacksolveAdjoint`, `CheckpointAdjoint` (the checkpointed sweep in
  `adjoints/sweep.py`).
- the stepping loop (`loop.py`: one attempt, `controller.py`: step sizes,
  `outputs.py`: the loops and their outputs, `state.py`: the typed loop state),
  the interpolant inside a step (`interpolation.py`), the vector fields
  (`fields.py`), progress output (`progress.py`).
- `MassMatrix` (`mass.py`): the constant `M` of a differential-algebraic system
  `M y' = f` and the consistent initialisation of its algebraic unknowns.
- `odeint_event` (`events.py`) and `steady_state` (`steady_state.py`).
"""

from .adjoints import AbstractAdjoint, BacksolveAdjoint, CheckpointAdjoint
from .events import odeint_event
from .info import ODEInfo
from .mass import MassMatrix
from .methods import (
    ESDIRK,
    METHODS,
    RK4,
    AbstractMethod,
    Bosh3,
    ButcherTableau,
    Dopri5,
    Dopri8,
    Euler,
    ExplicitRungeKutta,
    Kvaerno5,
    Rodas4,
    Rodas5P,
    Rosenbrock,
    RosenbrockTableau,
    Tsit5,
    register,
)
from .odeint import odeint
from .solution import ODESolution
from .steady_state import steady_state

__all__ = [
    "odeint",
    "ODEInfo",
    "ODESolution",
    "MassMatrix",
    "odeint_event",
    "steady_state",
    "AbstractMethod",
    "ButcherTableau",
    "ExplicitRungeKutta",
    "ESDIRK",
    "Dopri5",
    "Tsit5",
    "Bosh3",
    "Dopri8",
    "Kvaerno5",
    "Rosenbrock",
    "RosenbrockTableau",
    "Rodas5P",
    "Rodas4",
    "RK4",
    "Euler",
    "METHODS",
    "register",
    "AbstractAdjoint",
    "BacksolveAdjoint",
    "CheckpointAdjoint",
]
