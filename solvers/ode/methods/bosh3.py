"""Bogacki and Shampine's 3(2) pair (`"bosh3"`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import diffrax

from ._base import ButcherTableau
from ._runge_kutta import ExplicitRungeKutta, diffrax_interpolation, tableau_from_diffrax

__all__ = ["Bosh3"]


@dataclasses.dataclass(frozen=True)
class Bosh3(ExplicitRungeKutta):
    """Bogacki-Shampine 3(2): explicit, adaptive, first same as last (interpolated by
    cubic Hermite); loose tolerances."""

    tableau: ButcherTableau = tableau_from_diffrax(diffrax.Bosh3)
    order: int = 3
    name: str = "bosh3"
    continuous_extension: Any = diffrax_interpolation(diffrax.Bosh3)
