"""`Problem`: one named derivative check of the gradient-check catalogue.

A problem is a recipe, not a result: its `build` returns the function, the point and
optionally a reference, and is called only when the problem runs; its fields carry the
options of `check_grads` and say whether, and to which order, the quick run of the
command line includes it. `Problem.run` builds it and runs `check_grads`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ._check import check_grads
from ._report import GradCheckRow

__all__ = ["Problem"]

_BuildResult = (
    tuple[Callable[..., Any], tuple[Any, ...]]
    | tuple[Callable[..., Any], tuple[Any, ...], Callable[..., Any] | None]
)


@dataclasses.dataclass(frozen=True)
class Problem:
    """A named derivative check for the command line.

    Attributes:
        name: unique name, used by ``-k``.
        build: zero-argument callable returning ``(fn, args)`` or
            ``(fn, args, reference)``; called only when the problem runs, so that
            defining a catalogue is cheap (put imports of heavy modules inside it).
            The command line enables ``jax_enable_x64`` before calling it.
        order: highest derivative order to check in a full run (``--full``);
            ``--order`` overrides it.
        modes: the modes to check, as in `check_grads`.
        description: one line shown by ``--list``.
        atol, rtol, eps, jit: passed on to `check_grads`.
        quick: whether the default (quick) run of the command line includes the
            problem. Set it to False for a problem that takes more than a few seconds
            even there: it then runs with ``--full``, or when ``-k`` selects it.
        quick_order: the highest order checked in the quick run (default: `order`),
            for a problem whose higher derivatives are slow to compile. The quick run
            also perturbs all arguments at once (see `check_grads`'s `per_argument`).

    Example:
        ```python
        import jax.numpy as jnp
        from implicitdiff.gradcheck import Problem, register

        register(Problem("tanh", lambda: (jnp.tanh, (jnp.linspace(-1.0, 1.0, 5),)),
                         description="elementwise tanh"))
        ```
    """

    name: str
    build: Callable[[], _BuildResult]
    order: int = 2
    modes: tuple[str, ...] = ("fwd", "rev")
    description: str = ""
    atol: float | Mapping[str, float] | None = None
    rtol: float | Mapping[str, float] | None = None
    eps: float | None = None
    jit: bool = True
    quick: bool = True
    quick_order: int | None = None

    def __post_init__(self) -> None:
        orders = {"order": self.order}
        if self.quick_order is not None:
            orders["quick_order"] = self.quick_order
        for name, value in orders.items():
            if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
                raise ValueError(
                    f"Problem {self.name!r}: `{name}` must be an integer >= 1 (1 checks "
                    f"first derivatives, 2 also second ones), got {value!r}"
                )

    def run(self, *, order: int | None = None, full: bool = True) -> list[GradCheckRow]:
        """Build the problem and run `check_grads` on it (raises like `check_grads`).

        Arguments:
            order: the highest order to check, overriding the problem's own.
            full: True: one argument at a time, up to `order`. False (the quick run):
                every argument at once (`check_grads`'s ``per_argument=False``), up to
                `quick_order`.
        """
        if order is None:
            order = self.order if full or self.quick_order is None else self.quick_order
        built = self.build()
        if len(built) == 2:
            fn, args = built
            ref = None
        else:
            fn, args, ref = built
        return check_grads(
            fn,
            args,
            order=order,
            modes=self.modes,
            atol=self.atol,
            rtol=self.rtol,
            eps=self.eps,
            reference=ref,
            jit=self.jit,
            per_argument=full,
        )
