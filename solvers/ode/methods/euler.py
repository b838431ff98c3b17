"""Euler's method (`"euler"`), at a fixed step."""

from __future__ import annotations

import dataclasses

from ._base import ButcherTableau
from ._runge_kutta import ExplicitRungeKutta

__all__ = ["Euler"]


@dataclasses.dataclass(frozen=True)
class Euler(ExplicitRungeKutta):
    """Euler: explicit, first order, fixed step `dt` (no error estimate)."""

    tableau: ButcherTableau = ButcherTableau(c=(0.0,), a=((),), b=(1.0,))
    order: int = 1
    name: str = "euler"
