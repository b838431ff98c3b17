"""implicitdiff: custom derivative rules written once, valid under every JAX transformation.

The public names:

- `Primitive`: a JAX operation with its own implementation and derivative rules
  (the vocabulary of `jax.experimental.hijax.VJPHiPrimitive`), dispatched as fast
  as `jax.custom_vjp`.
- `Zero`, `instantiate_zeros`, `NullAccum`, `Static`: symbolic zeros, accumulators
  and static residual data used inside rules.
- The derivation helpers `linearize_from_jvp`, `apply_derived_linearization`,
  `vjp_fwd_from_jvp`, `transpose_jvp`, `vjp_fwd_from_lin`, `transpose_linearized`,
  `jvp_from_lin`.
- `custom_jvp`, `custom_vjp`: drop-ins for JAX's decorators with keyword arguments,
  `nondiff_argnames`, and array-valued non-differentiable arguments.
- `foreign`: wrap a host (NumPy/SciPy/C) function with derivative and batching rules.
- `custom_root`, `custom_linear_solve`: drop-ins for `jax.lax`'s, whose derivatives
  come from the implicit function theorem.
- `implicit_diff`: a decorator giving any solver implicit derivatives from its
  optimality condition.
- `linear_solve`: linear solvers for the tangent and adjoint systems, as objects
  that factor or prepare once and solve forwards and transposed (`Dense`, `CG`,
  `NormalCG`, `GMRES`, `BiCGStab`, `Neumann`, `Auto`), and their one-shot functions
  (`dense`, `cg`, `normal_cg`, `gmres`, `bicgstab`, `neumann`, `auto`).
- `error_if`, `ImplicitDiffRuntimeError`: raise from compiled code when a run-time
  condition holds (non-convergence), with run-time values in the message.
- `check_grads` (and the `gradcheck` module behind `implicitdiff-gradcheck`):
  derivative checks against finite differences and an independent reference.
- `internal`: helpers for libraries built on implicitdiff (closure conversion,
  batch-wide reductions, pytree checks); public but unstable.
"""

from . import gradcheck, internal, linear_solve
from ._derive import (
    apply_derived_linearization,
    jvp_from_lin,
    linearize_from_jvp,
    transpose_jvp,
    transpose_linearized,
    vjp_fwd_from_jvp,
    vjp_fwd_from_lin,
)
from ._errors import ImplicitDiffRuntimeError, error_if
from ._primitive import NullAccum, Primitive, Static, Zero, instantiate_zeros
from ._vmap import VmapOf
from .custom_derivatives import custom_jvp, custom_vjp
from .foreign import Foreign, foreign, like
from .gradcheck import check_grads
from .implicit import implicit_diff
from .linear_system import custom_linear_solve
from .root import custom_root

__version__ = "0.1.0"

__all__ = [
    "Primitive",
    "VmapOf",
    "Zero",
    "instantiate_zeros",
    "NullAccum",
    "Static",
    "linearize_from_jvp",
    "apply_derived_linearization",
    "vjp_fwd_from_jvp",
    "transpose_jvp",
    "vjp_fwd_from_lin",
    "transpose_linearized",
    "jvp_from_lin",
    "custom_jvp",
    "custom_vjp",
    "foreign",
    "Foreign",
    "like",
    "custom_root",
    "custom_linear_solve",
    "implicit_diff",
    "linear_solve",
    "internal",
    "check_grads",
    "gradcheck",
    "error_if",
    "ImplicitDiffRuntimeError",
]
