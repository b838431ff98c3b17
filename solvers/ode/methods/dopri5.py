"""Dormand and Prince's 5(4) pair (`"dopri5"`): JAX's odeint's method."""

from __future__ import annotations

import dataclasses
from typing import Any

import diffrax

from ._base import ButcherTableau
from ._runge_kutta import ExplicitRungeKutta, diffrax_interpolation, tableau_from_diffrax

__all__ = ["Dopri5"]


@dataclasses.dataclass(frozen=True)
class Dopri5(ExplicitRungeKutta):
    """Dormand-Prince 5(4): explicit, adaptive, first same as last, with its own
    fourth-order continuous extension. Non-stiff problems; `odeint`'s default."""

    tableau: ButcherTableau = tableau_from_diffrax(diffrax.Dopri5)
    order: int = 5
    name: str = "dopri5"
    continuous_extension: Any = diffrax_interpolation(diffrax.Dopri5)
