"""The parts of `solvers.fixed_point`, one concept to a module.

`solve` holds the static options of a solve (`_Config`) and the forward solve, which
runs one of the iteration methods of `iteration` (plain, damped, Anderson) and checks
the result with the convergence tests of `convergence`; `direct` is the direct solve
that the default adjoint falls back to where the Neumann series fails; `primitive` is
the `implicitdiff.Primitive` whose derivative rules solve the linear systems of the
implicit function theorem by the same iteration. The public function, its argument
checks and its choice of adjoint are in `solvers.fixed_point`.
"""
