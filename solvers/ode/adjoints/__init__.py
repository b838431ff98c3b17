"""The adjoints of `odeint`'s reverse mode, as objects (strings are aliases).

- `BacksolveAdjoint()` (`"backsolve"`): the continuous adjoint integrated backwards with
  the state; constant memory, every order of reverse mode.
- `CheckpointAdjoint(max_steps=...)` (`"checkpoint"`): the exact gradient of the
  computed solution, replayed from checkpoints; the default of the implicit methods.

Forward mode (forward sensitivities) is the same for both.
"""

from __future__ import annotations

from typing import Any

from ._base import AbstractAdjoint
from .backsolve import BACKSOLVE_DRIFT, BacksolveAdjoint
from .checkpoint import CheckpointAdjoint

__all__ = [
    "AbstractAdjoint",
    "BacksolveAdjoint",
    "CheckpointAdjoint",
    "BACKSOLVE_DRIFT",
    "ADJOINTS",
    "resolve_adjoint",
]

#: The adjoints known by name, as functions of `max_steps` (the string
#: `"checkpoint"` records up to `odeint`'s `max_steps`).
ADJOINTS = {
    "backsolve": lambda max_steps: BacksolveAdjoint(),
    "checkpoint": lambda max_steps: CheckpointAdjoint(max_steps=max_steps),
}


def resolve_adjoint(name: str, adjoint: Any, method: Any, max_steps: int) -> AbstractAdjoint:
    """The adjoint object for `adjoint=`: an instance, a name, or `None` (the method's
    default: checkpointed for an implicit method, backsolve otherwise)."""
    if adjoint is None:
        adjoint = "checkpoint" if method.implicit else "backsolve"
    if isinstance(adjoint, AbstractAdjoint):
        return adjoint
    if isinstance(adjoint, str) and adjoint in ADJOINTS:
        return ADJOINTS[adjoint](max_steps)
    raise ValueError(
        f"{name}: `adjoint` must be one of {tuple(ADJOINTS)}, an adjoint object from "
        f"solvers.ode (e.g. CheckpointAdjoint(max_steps=1024)) or None (the method's "
        f"default), got {adjoint!r}"
    )
