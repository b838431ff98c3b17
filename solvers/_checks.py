"""Argument checks shared by the nonlinear solvers; each message names the solver and argument."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from implicitdiff.internal import find_mismatch, in_checked_shard_map

__all__ = [
    "solve_flags",
    "static_int",
    "static_float",
    "static_bool",
    "status_returned",
    "float_dtype",
    "returns_like",
]


def static_int(name: str, arg: str, value: Any, *, minimum: int) -> int:
    """`value` as a Python int >= `minimum`; a Tracer or anything else is an error."""
    if isinstance(value, jax.core.Tracer):
        raise TypeError(
            f"{name}: `{arg}` must be a Python int (it shapes the computation), got a "
            "traced value; pass it as a constant, not through jit/vmap arguments"
        )
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < minimum:
        raise ValueError(f"{name}: `{arg}` must be an int >= {minimum}, got {value!r}")
    return int(value)


def static_float(name: str, arg: str, value: Any) -> float:
    """`value` as a Python float; a Tracer is an error that says how to differentiate it."""
    if isinstance(value, jax.core.Tracer):
        raise TypeError(
            f"{name}: `{arg}` must be a Python float (it configures the solver), got a "
            "traced value; to differentiate with respect to it, pass it among the "
            "differentiated arguments and use it inside the function"
        )
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name}: `{arg}` must be a float, got {value!r}") from None


def not_in_checked_shard_map(name: str) -> None:
    """Refuse, with the fix, to trace inside `shard_map(..., check_vma=True)`."""
    if in_checked_shard_map():
        raise NotImplementedError(
            f"{name} inside `jax.shard_map(..., check_vma=True)` is not supported: its "
            "loops and derivative rules do not record which mesh axes their values vary "
            "along. To fix it: pass `check_vma=False` to `jax.shard_map` (the results are "
            "the same), or shard the batch with `jax.jit` and `NamedSharding` instead; "
            "see docs/multi-device.md."
        )


def static_bool(name: str, arg: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name}: `{arg}` must be True or False, got {value!r}")
    return value


def status_returned(
    name: str, throw: bool, return_info: bool, *, layer_call: str | None = None
) -> None:
    """Refuse `throw=False` without `return_info=True`: nothing would show a failed solve.

    With `throw=False` a failed solve raises nothing, so the status in the returned info
    is the only sign of it; without the info the answer could be wrong unnoticed.
    `layer_call` is for a layer whose `throw` is set at construction and whose
    `return_info` is a call argument: how to call it so that the info comes back.
    """
    if throw or return_info:
        return
    if layer_call is None:
        raise ValueError(
            f"{name}: `throw=False` turns off the error raised when the solve fails, "
            "so the status must come back with the answer: pass `return_info=True` as "
            "well and check `info.status` (or `info.converged`), or keep `throw=True`"
        )
    raise ValueError(
        f"{name}: this layer has `throw=False`, so a solve that fails raises nothing "
        "and its status must come back with the answer: call it as "
        f"`{layer_call}` and check `info.status` (or `info.converged`), or build the "
        "layer with `throw=True`"
    )


def solve_flags(name: str, throw: Any, return_info: Any) -> None:
    """The checks every solver makes of `throw` and `return_info` (static bools, and
    `throw=False` only with `return_info=True`), and that it is not traced inside a
    checked `shard_map`."""
    static_bool(name, "throw", throw)
    not_in_checked_shard_map(name)
    static_bool(name, "return_info", return_info)
    status_returned(name, throw, return_info)


def float_dtype(name: str, arg: str, tree: Any) -> np.dtype:
    """The widest floating dtype among `tree`'s leaves; non-float leaves are an error."""
    leaves = jax.tree_util.tree_leaves(tree)
    if not leaves:
        raise TypeError(f"{name}: `{arg}` has no array leaves")
    dtypes = set()
    for i, leaf in enumerate(leaves):
        dt = jnp.result_type(leaf)
        if jnp.issubdtype(dt, jnp.complexfloating):
            raise TypeError(
                f"{name}: `{arg}` leaf {i} has dtype {dt}; the solver takes real unknowns: "
                "pass a complex one as its real and imaginary parts, e.g. `(x.real, "
                "x.imag)`, with the function returning its parts likewise"
            )
        if not jnp.issubdtype(dt, jnp.floating):
            raise TypeError(
                f"{name}: `{arg}` leaf {i} has dtype {dt}; it must be real floating point "
                "(e.g. pass 1.0 rather than 1, or x.astype(jnp.float32))"
            )
        dtypes.add(np.dtype(dt))
    return max(dtypes, key=lambda d: d.itemsize)


def returns_like(name: str, call: str, out: Any, arg: str, like: Any) -> None:
    """Raise unless `out` (abstract) has the structure, shapes and dtypes of `like`."""
    m = find_mismatch(out, jax.eval_shape(lambda x: x, like))
    if m is None:
        return
    if m.index is None:
        raise TypeError(
            f"{name}: {call} must return a pytree with the structure of `{arg}`; "
            f"got {m.got} for {call} and {m.want} for {arg}"
        )
    raise TypeError(
        f"{name}: {call} must keep the shape and dtype of `{arg}`, but leaf {m.index} is "
        f"{m.got.dtype}{list(m.got.shape)} where {arg} has {m.want.dtype}{list(m.want.shape)}"
    )
