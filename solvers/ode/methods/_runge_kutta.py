"""Runge-Kutta methods given by a tableau: the explicit family, and what the
diagonally implicit family shares with it."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

from ._base import AbstractMethod, ButcherTableau

__all__ = [
    "ExplicitRungeKutta",
    "TableauMethod",
    "combine",
    "diffrax_interpolation",
    "from_diffrax",
    "tableau_from_diffrax",
]


def tableau_from_diffrax(solver: Any) -> ButcherTableau:
    """The tableau of one of diffrax's Runge-Kutta solver classes (so coefficients
    are never typed by hand)."""
    tab = solver.tableau
    tup = lambda v: tuple(float(x) for x in np.asarray(v))  # noqa: E731
    gamma = predictor = None
    if tab.implicit:
        gamma = tup(tab.a_diagonal)
        predictor = tuple(tup(row) for row in tab.a_predictor)
    return ButcherTableau(
        c=(float(tab.c1),) + tup(tab.c),
        a=((),) + tuple(tup(row) for row in tab.a_lower),
        b=tup(tab.b_sol),
        e=tup(tab.b_error),
        gamma=gamma,
        predictor=predictor,
    )


def diffrax_interpolation(solver: Any) -> Any:
    """diffrax's continuous extension of `solver` when it is built from the stages, or
    `None` (then the cubic Hermite interpolant is used)."""
    interp = solver.interpolation_cls
    return interp if isinstance(interp, type) else None


def combine(y, h, coeffs, ks):
    """`y + h * sum(c_j k_j)`, skipping zero coefficients (a static choice)."""
    acc = None
    for cj, kj in zip(coeffs, ks):
        if cj != 0.0:
            term = cj * kj
            acc = term if acc is None else acc + term
    if acc is None:
        return y
    return y + h * acc


@dataclasses.dataclass(frozen=True)
class TableauMethod(AbstractMethod):
    """What every tableau-based method shares: its traits, read off the tableau.

    Attributes:
        tableau: the `ButcherTableau`.
        order: the exponent of the step-size controller (see `AbstractMethod`).
        name: the name it is registered under.
        continuous_extension: diffrax's interpolation class for the method's own
            interpolant, or `None` for cubic Hermite.
    """

    tableau: ButcherTableau
    order: int
    name: str
    continuous_extension: Any = None

    # The tableau's entries, as the interpolants and the sweep read them.
    @property
    def a(self):
        return self.tableau.a

    @property
    def b(self):
        return self.tableau.b

    @property
    def c(self):
        return self.tableau.c

    @property
    def e(self):
        return self.tableau.e

    @property
    def stages(self) -> int:
        return self.tableau.stages

    @property
    def adaptive(self) -> bool:
        return self.tableau.e is not None

    @property
    def interpolation(self) -> Any:
        return self.continuous_extension

    @property
    def fsal(self) -> bool:
        """First same as last: the last stage is evaluated at the step's end (its row
        of `a` is `b` and `c = 1`), so it is `f` at the new point."""
        tab = self.tableau
        return (
            tab.stages > 1
            and tab.c[-1] == 1.0
            and tab.b[-1] == 0.0
            and tuple(tab.a[-1]) == tuple(tab.b[:-1])
        )

    def error(self, h, ks):
        """The embedded error estimate `h * sum(e_j k_j)`."""
        return h * sum(ej * kj for ej, kj in zip(self.tableau.e, ks) if ej != 0.0)


@dataclasses.dataclass(frozen=True)
class ExplicitRungeKutta(TableauMethod):
    """An explicit Runge-Kutta method: a tableau with a strictly lower triangular `a`
    (with `e` for an adaptive pair, without it for fixed steps).

    Example:
        ```python
        from solvers.ode.methods import ButcherTableau, ExplicitRungeKutta

        heun_euler = ExplicitRungeKutta(
            tableau=ButcherTableau(c=(0.0, 1.0), a=((), (1.0,)), b=(0.5, 0.5), e=(-0.5, 0.5)),
            order=2,
            name="heun-euler",
        )
        ```
    """

    def __post_init__(self):
        if self.tableau.gamma is not None:
            raise ValueError(
                f"ExplicitRungeKutta {self.name!r}: the tableau has a diagonal (`gamma`); "
                "use solvers.ode.methods.ESDIRK for a diagonally implicit method"
            )

    @property
    def implicit(self) -> bool:
        return False

    @property
    def evals_per_step(self) -> int:
        return self.stages - 1 + (0 if self.fsal else 1)

    def stages_of(self, f, y, k1, t, h, params):
        """The stage derivatives `[k_1, ..., k_s]` of a step."""
        tab = self.tableau
        ks = [k1]
        for i in range(1, tab.stages):
            yi = combine(y, h, tab.a[i], ks)
            ks.append(f(yi, t + tab.c[i] * h, params))
        return ks

    def step_with_stages(self, f, y, k1, t, h, params, *, tol=None):
        ks = self.stages_of(f, y, k1, t, h, params)
        y1 = combine(y, h, self.tableau.b, ks)
        err = self.error(h, ks) if self.adaptive else jnp.zeros_like(y)
        # First same as last: the last stage is already f at the new point.
        k_next = ks[-1] if self.fsal else f(y1, t + h, params)
        return y1, err, k_next, jnp.asarray(True), ks


def from_diffrax(cls, solver: Any, **fields):
    """An instance of the method class `cls` with `solver`'s tableau and interpolant."""
    return cls(
        tableau=tableau_from_diffrax(solver),
        continuous_extension=diffrax_interpolation(solver),
        **fields,
    )
