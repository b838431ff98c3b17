"""The solvers by name (`SOLVERS`), and `resolve`, which turns what a user passes as a
linear solver (a name, an instance, a function) into what a solver calls."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

from ._auto import Auto
from ._base import LinearSolver
from ._dense import Dense
from ._krylov import CG, GMRES, BiCGStab, NormalCG
from ._neumann import Neumann

__all__ = ["SOLVERS", "resolve"]

#: The linear solvers by name: the strings accepted wherever a linear solver is chosen
#: (`solvers.root(linear_solver=...)`, `fixed_point(adjoint=...)`, ...) are aliases of
#: these classes, built with their default options.
SOLVERS: dict[str, type[LinearSolver]] = {
    "auto": Auto,
    "dense": Dense,
    "cg": CG,
    "normal_cg": NormalCG,
    "gmres": GMRES,
    "bicgstab": BiCGStab,
    "neumann": Neumann,
}


def _has_option(cls: type, name: str) -> bool:
    return dataclasses.is_dataclass(cls) and name in {f.name for f in dataclasses.fields(cls)}


def resolve(
    spec: str | LinearSolver | Callable[..., Any] | None,
    name_for_errors: str,
    *,
    choices: Iterable[str] | None = None,
    symmetric: bool = False,
    none_means: str | None = None,
) -> LinearSolver | Callable[..., Any] | None:
    """The linear solver `spec` stands for.

    Arguments:
        spec: a name from `SOLVERS` (an alias of that class with its default options), a
            `LinearSolver` instance, or any function `solve(matvec, b) -> x` (linear in
            `b` and transposable for reverse mode), returned as they are.
        name_for_errors: how the caller's argument is named in the error message, e.g.
            ``"root: `linear_solver`"``.
        choices: the names the caller accepts (default: every name of `SOLVERS`).
        symmetric: the operator is symmetric: a solver built from a name gets
            `symmetric=True` where it has that option (`Dense`, `Auto`).
        none_means: when given, `spec=None` is accepted (and returned) and the error
            message describes it so, e.g. `"the default"`.

    Returns:
        A `LinearSolver`, the function `spec`, or None.

    Raises:
        ValueError: `spec` is none of these; the message names the argument and the
            choices.

    Example:
        ```python
        from implicitdiff import linear_solve

        print(linear_solve.resolve("gmres", "linear_solver"))  # GMRES(rtol=None, ...)
        solver = linear_solve.GMRES(rtol=1e-12)
        assert linear_solve.resolve(solver, "linear_solver") is solver
        ```
    """
    names = tuple(SOLVERS) if choices is None else tuple(choices)
    if spec is None and none_means is not None:
        return None
    if isinstance(spec, str):
        if spec in names and spec in SOLVERS:
            cls = SOLVERS[spec]
            return cls(symmetric=True) if symmetric and _has_option(cls, "symmetric") else cls()
    elif callable(spec):
        return spec
    allowed = f"None ({none_means}), one of {names}" if none_means else f"one of {names}"
    raise ValueError(
        f"{name_for_errors} must be {allowed}, a linear_solve.LinearSolver (e.g. "
        "linear_solve.GMRES(rtol=1e-12)) or a linear solver `solve(matvec, b)`, "
        f"got {spec!r}"
    )
