"""Structure, shape and dtype comparisons of pytrees, and the argument checks of the
implicit rules (`custom_root`, `custom_linear_solve`) built on them."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax

__all__ = ["Mismatch", "find_mismatch", "check_returns_like"]


class Mismatch(NamedTuple):
    """Where two pytrees first differ: `index` is None when their structures differ (then
    `got` and `want` are the treedefs), else the first leaf that differs in shape (or
    dtype), `got` and `want` being that leaf of each (with `.shape` and `.dtype`)."""

    index: int | None
    got: Any
    want: Any


def _shaped(x: Any) -> Any:
    return x if hasattr(x, "shape") and hasattr(x, "dtype") else jax.typeof(x)


def find_mismatch(tree: Any, ref: Any, *, dtypes: bool = True) -> Mismatch | None:
    """The first difference in structure, shapes or (when `dtypes`) dtypes between `tree`
    and `ref`, or None. Leaves may be arrays, `jax.ShapeDtypeStruct`s, avals or scalars.

    Example:
        ```python
        import jax.numpy as jnp
        from implicitdiff import internal

        m = internal.find_mismatch((jnp.ones(2), jnp.ones(3)), (jnp.ones(2), jnp.ones(4)))
        print(m.index, m.got.shape, m.want.shape)  # 1 (3,) (4,)
        ```
    """
    leaves, tree_def = jax.tree_util.tree_flatten(tree)
    ref_leaves, ref_def = jax.tree_util.tree_flatten(ref)
    if tree_def != ref_def:
        return Mismatch(None, tree_def, ref_def)
    for i, (a, b) in enumerate(zip(leaves, ref_leaves)):
        a, b = _shaped(a), _shaped(b)
        if tuple(a.shape) != tuple(b.shape) or (dtypes and a.dtype != b.dtype):
            return Mismatch(i, a, b)
    return None


def check_returns_like(
    caller: str, what: str, out: Any, ref: Any, ref_name: str, *, has_aux: bool
) -> None:
    """`out` (from `jax.eval_shape`) must match `ref` in structure, shapes and dtypes.

    With `has_aux`, `out` must be a pair whose first element is compared. Errors are
    `TypeError`s of the form "{caller}: `{what}` ... `{ref_name}` ...".
    """
    if has_aux:
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError(
                f"{caller}: with has_aux=True, {what} must return a pair (solution, aux); "
                f"got a value of structure {jax.tree_util.tree_structure(out)}"
            )
        out = out[0]
    m = find_mismatch(out, ref)
    if m is None:
        return
    if m.index is None:
        raise TypeError(
            f"{caller}: {what} must return a pytree with the structure of `{ref_name}`, "
            f"but it has structure {m.got} while `{ref_name}` has {m.want}"
        )
    raise TypeError(
        f"{caller}: {what} must preserve the shapes and dtypes of `{ref_name}`, but "
        f"leaf {m.index} is {m.got.dtype}{list(m.got.shape)} where `{ref_name}` has "
        f"{m.want.dtype}{list(m.want.shape)}"
    )
