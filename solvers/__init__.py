"""solvers: differentiable numerical solvers and Equinox modules built on `implicitdiff`.

Empty for now: `fixed_point`, `root`, `minimize`, `odeint` and `solvers.nn` arrive
with the issues that build on the primitive layer.
"""

__all__: list[str] = []
