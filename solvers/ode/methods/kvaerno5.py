"""Kvaerno's stiffly accurate ESDIRK 5(4) method (`"kvaerno5"`), for stiff problems."""

from __future__ import annotations

import dataclasses
from typing import Any

import diffrax

from ._base import ButcherTableau
from ._esdirk import ESDIRK
from ._runge_kutta import diffrax_interpolation, tableau_from_diffrax

__all__ = ["Kvaerno5"]


@dataclasses.dataclass(frozen=True)
class Kvaerno5(ESDIRK):
    """Kvaerno 5(4): seven stages, six of them implicit with one diagonal value,
    stiffly accurate and L-stable (interpolated by cubic Hermite). Stiff problems:
    chemical kinetics, circuits, strong damping, discretised diffusion."""

    tableau: ButcherTableau = tableau_from_diffrax(diffrax.Kvaerno5)
    order: int = 5
    name: str = "kvaerno5"
    continuous_extension: Any = diffrax_interpolation(diffrax.Kvaerno5)
