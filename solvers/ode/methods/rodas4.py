"""Rodas4 (`"rodas4"`): Hairer and Wanner's Rosenbrock 4(3) method, for stiff problems
at loose to moderate tolerances.

The coefficients are those of Hairer and Wanner's RODAS code (Solving ODEs II, VI.4),
in the increments form of `solvers.ode.methods._rosenbrock`, with its 3rd-order
continuous extension.
"""

from __future__ import annotations

import dataclasses

from ._rosenbrock import Rosenbrock, RosenbrockTableau

__all__ = ["Rodas4"]

_A5 = (1.221224509226641, 6.019134481288629, 12.53708332932087, -0.6878860361058950)

_TABLEAU = RosenbrockTableau(
    gamma=0.25,
    a=(
        (),
        (1.544,),
        (0.9466785280815826, 0.2557011698983284),
        (3.314825187068521, 2.896124015972201, 0.9986419139977817),
        _A5,
        # The last stage starts where the fifth stage's argument plus its increment
        # ends (the method is stiffly accurate).
        (*_A5, 1.0),
    ),
    C=(
        (),
        (-5.6688,),
        (-2.430093356833875, -0.2063599157091915),
        (-0.1073529058151375, -9.594562251023355, -20.47028614809616),
        (7.496443313967647, -10.24680431464352, -33.99990352819905, 11.70890893206160),
        (
            8.083246795921522,
            -7.981132988064893,
            -31.52159432874371,
            16.31930543123136,
            -6.058818238834054,
        ),
    ),  # fmt: skip
    c=(0.0, 0.386, 0.21, 0.63, 1.0, 1.0),
    d=(0.25, -0.1043, 0.1035, -0.0362, 0.0, 0.0),
    b=(*_A5, 1.0, 1.0),
    e=(0.0,) * 5 + (1.0,),
    dense=(
        (
            10.12623508344586,
            -7.487995877610167,
            -34.80091861555747,
            -7.992771707568823,
            1.025137723295662,
            0.0,
        ),
        (
            -0.6762803392801253,
            6.087714651680015,
            16.43084320892478,
            24.76722511418386,
            -6.594389125716872,
            0.0,
        ),
    ),  # fmt: skip
)


@dataclasses.dataclass(frozen=True)
class Rodas4(Rosenbrock):
    """Rodas4: six stages, one Jacobian and one LU factorisation per step, stiffly
    accurate and L-stable, with a 3rd-order interpolant. Cheaper steps than `Rodas5P`,
    for loose tolerances (1e-3 to 1e-6)."""

    tableau: RosenbrockTableau = _TABLEAU
    order: int = 4
    name: str = "rodas4"
