"""Argument checks shared by the implicit rules (`custom_root`, `custom_linear_solve`)."""

from __future__ import annotations

from typing import Any

import jax


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
    leaves, tree = jax.tree_util.tree_flatten(out)
    ref_leaves, ref_tree = jax.tree_util.tree_flatten(ref)
    if tree != ref_tree:
        raise TypeError(
            f"{caller}: {what} must return a pytree with the structure of `{ref_name}`, "
            f"but it has structure {tree} while `{ref_name}` has {ref_tree}"
        )
    for i, (o, r) in enumerate(zip(leaves, ref_leaves)):
        r = jax.typeof(r) if not hasattr(r, "shape") or not hasattr(r, "dtype") else r
        if tuple(o.shape) != tuple(r.shape) or o.dtype != r.dtype:
            raise TypeError(
                f"{caller}: {what} must preserve the shapes and dtypes of `{ref_name}`, but "
                f"leaf {i} is {o.dtype}{list(o.shape)} where `{ref_name}` has "
                f"{r.dtype}{list(r.shape)}"
            )
