"""Tsitouras' 5(4) pair (`"tsit5"`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import diffrax

from ._base import ButcherTableau
from ._runge_kutta import ExplicitRungeKutta, diffrax_interpolation, tableau_from_diffrax

__all__ = ["Tsit5"]


@dataclasses.dataclass(frozen=True)
class Tsit5(ExplicitRungeKutta):
    """Tsitouras 5(4): explicit, adaptive, first same as last, with its own continuous
    extension; often a little cheaper than Dopri5 at the same accuracy."""

    tableau: ButcherTableau = tableau_from_diffrax(diffrax.Tsit5)
    order: int = 5
    name: str = "tsit5"
    continuous_extension: Any = diffrax_interpolation(diffrax.Tsit5)
