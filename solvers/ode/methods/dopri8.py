"""Dormand and Prince's 8(7) pair (`"dopri8"`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import diffrax

from ._base import ButcherTableau
from ._runge_kutta import ExplicitRungeKutta, diffrax_interpolation, tableau_from_diffrax

__all__ = ["Dopri8"]


@dataclasses.dataclass(frozen=True)
class Dopri8(ExplicitRungeKutta):
    """Dormand-Prince 8(7): explicit, adaptive, with its own seventh-order continuous
    extension; tight tolerances on smooth problems."""

    tableau: ButcherTableau = tableau_from_diffrax(diffrax.Dopri8)
    order: int = 8
    name: str = "dopri8"
    continuous_extension: Any = diffrax_interpolation(diffrax.Dopri8)
