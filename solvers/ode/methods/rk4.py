"""The classic fourth-order Runge-Kutta method (`"rk4"`), at a fixed step."""

from __future__ import annotations

import dataclasses

from ._base import ButcherTableau
from ._runge_kutta import ExplicitRungeKutta

__all__ = ["RK4"]

# (diffrax has no tableau for it.)
_TABLEAU = ButcherTableau(
    c=(0.0, 0.5, 0.5, 1.0),
    a=((), (0.5,), (0.0, 0.5), (0.0, 0.0, 1.0)),
    b=(1 / 6, 1 / 3, 1 / 3, 1 / 6),
)


@dataclasses.dataclass(frozen=True)
class RK4(ExplicitRungeKutta):
    """RK4: explicit, fourth order, fixed step `dt` (no error estimate)."""

    tableau: ButcherTableau = _TABLEAU
    order: int = 4
    name: str = "rk4"
