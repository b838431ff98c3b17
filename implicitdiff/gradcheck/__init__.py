"""Derivative checks made for implicit differentiation, and a command line to run them.

`check_grads` is a cousin of `jax.test_util.check_grads`: it compares the
derivatives JAX computes for a function (forward mode with `jax.jvp`, reverse mode
with `jax.vjp`, up to a given order) against central finite differences, and,
optionally, against an independent *reference* implementation of the same function
(an unrolled solver, a closed form). Differences from JAX's version:

- each argument is perturbed on its own, so a wrong derivative is attributed to the
  argument it belongs to; non-float leaves (ints, bools) are never perturbed;
- it does not stop at the first mismatch: it returns one `GradCheckRow` per check
  and raises `GradCheckError` (an `AssertionError`) whose message is the whole table,
  with the failing rows marked;
- errors are measured normwise, `max|actual - expected| <= atol + rtol * max|expected|`,
  which suits finite differences better than an elementwise relative test;
- comparisons with exact derivatives (the reference, and the jvp that a vjp is
  checked against) use tighter default tolerances than finite differences.

The command line `python -m implicitdiff.gradcheck` (console script
`implicitdiff-gradcheck`) runs `check_grads` on a catalogue of small problems:
the built-in ones below, those added with `register`, and those published by other
installed packages under the entry-point group ``implicitdiff.gradcheck``. By default
it makes a quick pass (seconds) over the problems marked `Problem.quick`, perturbing
all arguments at once; ``--full`` checks every problem one argument at a time, to
its full order (minutes).

Example:
    ```python
    import jax, jax.numpy as jnp
    from implicitdiff.gradcheck import check_grads, format_table

    jax.config.update("jax_enable_x64", True)
    rows = check_grads(lambda x, y: jnp.sin(x) * y, (jnp.arange(3.0), 2.0), order=2)
    print(format_table(rows))
    ```
"""

from ._catalogue import ENTRY_POINT_GROUP, Problem, main, problems, register
from ._check import GradCheckError, GradCheckRow, check_grads, format_table

__all__ = [
    "check_grads",
    "GradCheckRow",
    "GradCheckError",
    "format_table",
    "Problem",
    "register",
    "problems",
    "main",
    "ENTRY_POINT_GROUP",
]
