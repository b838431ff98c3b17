"""Helpers for code built on implicitdiff (such as the `solvers` package): public, but
unstable.

Nothing here is covered by the compatibility promise of the rest of the API: names and
signatures may change in any release. They exist so that solvers written on top of
implicitdiff need not reach into its private modules (the way `equinox.internal` serves
libraries built on Equinox).

Tracing and transformations:

- `closure_convert(fun, *example_args) -> (converted, consts, out_tree)`: trace `fun` and
  hoist every traced value it closes over into `consts`, so that a primitive can take
  them as inputs (`converted(consts, *args)` is `fun(*args)`).
- `instantiate_zeros(t)`: a symbolic `Zero` (co)tangent as an array of zeros.
- `vmap_size(x)`: the product of the `vmap` batch sizes `x` is traced under (1 outside).
- `in_batch()`, `per_element(fn, flag)`, `per_element_if_batched(fn, args)`,
  `any_vmapped(args)`: whether the code being traced runs for each element of a
  `vmap` batch (to pick an algorithm, such as a band's LU), and `fn` traced so.
- `in_checked_shard_map()`: whether tracing happens inside
  `jax.shard_map(..., check_vma=True)`.

Run-time checks and batch-wide reductions:

- `any_over_batch(pred)`, `max_over_batch(x)`: identity on one element; under `vmap` the
  value over the whole batch, unbatched (for loop predicates and bounds).
- `reduce_any(pred, axis=None)`: `jnp.any` as one fused pass.
- `check_lazily(x, maybe_failed, details, operands, msg, names)`: `error_if` whose
  verdict and message values are computed only when a cheap flag fires.

Pytrees:

- `is_zero`, `leaves_with_zeros`, `instantiate_cotangent`: symbolic zeros in (co)tangents.
- `all_finite`, `tree_norm`, `max_norm`, `tree_sub`: finiteness, 2-norm, max-norm and
  difference over all leaves.
- `find_mismatch(tree, ref)`, `describe(tree)`: where two pytrees differ in structure,
  shape or dtype, and `dtype[shape]` descriptions for error messages.
- `materialise(matvec, b_like)`: the matrix of a linear function on pytrees.

Example:
    ```python
    import jax, jax.numpy as jnp
    from implicitdiff import internal

    def solve(x):
        # a loop that runs once for a whole vmap batch, until every element is done
        return jax.lax.while_loop(lambda v: internal.any_over_batch(v < 10.0),
                                  lambda v: v * 2, x)

    print(jax.vmap(solve)(jnp.array([1.0, 3.0])))  # [16. 24.]
    ```
"""

from ._checks import Mismatch, find_mismatch
from ._errors import any_over_batch, check_lazily, max_over_batch, reduce_any
from ._jax_compat import closure_convert, in_checked_shard_map, instantiate_zeros, vmap_size
from ._per_element import any_vmapped, in_batch, per_element, per_element_if_batched
from ._trees import (
    all_finite,
    describe,
    instantiate_cotangent,
    is_zero,
    leaves_with_zeros,
    max_norm,
    tree_norm,
    tree_sub,
)
from .linear_solve._dense import materialise

__all__ = [
    "closure_convert",
    "instantiate_zeros",
    "vmap_size",
    "in_batch",
    "any_vmapped",
    "per_element",
    "per_element_if_batched",
    "in_checked_shard_map",
    "any_over_batch",
    "max_over_batch",
    "reduce_any",
    "check_lazily",
    "is_zero",
    "leaves_with_zeros",
    "instantiate_cotangent",
    "all_finite",
    "tree_norm",
    "max_norm",
    "tree_sub",
    "find_mismatch",
    "Mismatch",
    "describe",
    "materialise",
]
