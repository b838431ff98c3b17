"""Raising errors from inside compiled JAX code.

`error_if(x, pred, msg)` returns `x` unchanged and raises when `pred` holds at run time,
even under `jax.jit`, `jax.vmap`, differentiation and inside loop bodies.

How it works:

- When `pred` is an ordinary (non-traced) value the check happens immediately, in Python.
- Otherwise `pred` is reduced to one boolean. A `jax.custom_batching.custom_vmap` rule
  folds any `vmap` batch dimensions into that boolean as well ("does *any* batch element
  fail?"), so the next step stays a real branch rather than becoming a `select`.
- A `lax.cond` on that boolean does nothing when nothing failed (no copy to the host).
  On failure, a second `custom_vmap` rule picks the first failing batch element on
  device, and a `jax.pure_callback` receives only its message values, its index and the
  batch shape (a few scalars, never `x` or anything batch-sized) and raises on the
  host. The branch's boolean result (False whenever the program goes on) selects
  between each leaf of `x` and NaN, so the check is part of the data flow of every
  part of the returned value and cannot be removed as dead code, as long as the caller
  uses any of it; and since `x` itself never enters the branch, a sharded `x` keeps its
  sharding (a callback's operands are gathered to one device).
- `check_lazily` is the same check for solvers whose per-element verdict costs a pass
  over the iterate: a cheap batch-wide flag opens the branch, and the verdict and the
  message values are computed only inside it.
- The whole thing is a `jax.custom_jvp` whose tangent rule is the identity, so tangents of
  `x` flow through untouched and the check lives on the primal path only (forward mode,
  reverse mode, `linearize` and higher orders alike).

What the user sees:

- Eagerly (concrete `pred`): `ImplicitDiffRuntimeError`, a `RuntimeError` subclass, with
  exactly the message.
- From compiled code, JAX re-raises the host exception as its own error whose text holds
  the host traceback and ends in `ImplicitDiffRuntimeError: <msg>`. The class is
  `jax.errors.JaxRuntimeError` (a `RuntimeError` subclass) on the first call of a jitted
  function, but a call served from jit's C++ fast path (typically any call after a
  successful one) raises a plain `ValueError` with the same text (seen with jax 0.10.2;
  jax-ml/jax#34083, a regression since jax 0.7.2). So
  catch `(RuntimeError, ValueError)` and look for the message.
- JAX logs every exception raised in a `pure_callback` with a traceback; this module
  installs a logging filter that drops those records for its own errors only.
- On GPU the callback runs on the host just the same and the error surfaces when the
  results are fetched (not tested on a GPU here). TPU runtimes do not propagate callback
  exceptions, so there the check is not reliable.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["error_if", "ImplicitDiffRuntimeError"]


class ImplicitDiffRuntimeError(RuntimeError):
    """Raised by a failed `error_if` check (on the host, or eagerly)."""


class _DropOurCallbackLogs(logging.Filter):
    """JAX logs every exception raised inside a `pure_callback` with a full traceback
    before re-raising it. For our checks the raised error already carries the message,
    so drop that duplicate log record; other callbacks' records are kept."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, ImplicitDiffRuntimeError)


logging.getLogger("jax._src.callback").addFilter(_DropOurCallbackLogs())


def reduce_any(pred: Any, axis: int | None = None) -> jax.Array:
    """`jnp.any(pred, axis)`, computed as a maximum over int8.

    XLA's CPU backend fuses that reduction with the comparison producing `pred`, one
    pass over the data; a reduction over booleans becomes a tree of several passes.
    """
    pred = jnp.asarray(pred)
    if pred.ndim == 0:
        return pred
    return jnp.max(pred.astype(jnp.int8), axis=axis, initial=0) > 0


@jax.custom_batching.custom_vmap
def any_over_batch(pred: jax.Array) -> jax.Array:
    """Identity on a scalar bool; under `vmap`, whether any batch element is True.

    The result is not batched, so a `lax.while_loop` or `lax.cond` whose predicate it is
    stays one loop or branch for the whole batch, not a masked one per element.
    """
    return pred


@any_over_batch.def_vmap
def _any_over_batch_rule(axis_size, in_batched, pred):
    del axis_size
    (batched,) = in_batched
    if batched:
        pred = reduce_any(pred, axis=0)
    # Calling ourselves again lets an enclosing vmap (if any) collapse its own axis too.
    return any_over_batch(pred), False


@jax.custom_batching.custom_vmap
def max_over_batch(x: jax.Array) -> jax.Array:
    """Identity on a scalar; under `vmap`, the largest value over the batch (unbatched).

    A loop bound computed this way is the same for every batch element, so the loop
    counter stays unbatched and indexing with it stays a plain slice, not a gather.
    """
    return x


@max_over_batch.def_vmap
def _max_over_batch_rule(axis_size, in_batched, x):
    del axis_size
    (batched,) = in_batched
    if batched:
        x = jnp.max(x, axis=0)
    return max_over_batch(x), False


@jax.custom_batching.custom_vmap
def _first_failure(pred, values, index, sizes):
    """Identity on one element's verdict `pred` (a scalar bool) and message `values`.

    Under `vmap` it keeps the first failing batch element only: its verdict and values,
    its position prepended to `index` and the batch size to `sizes`. So what reaches the
    host is a few scalars, never anything the size of the batch (which, sharded, would
    have to be gathered to one device).
    """
    return pred, values, index, sizes


@_first_failure.def_vmap
def _first_failure_rule(axis_size, in_batched, pred, values, index, sizes):
    def batched(v, b):
        return v if b else jnp.broadcast_to(v, (axis_size, *jnp.shape(v)))

    pred_b, values_b, index_b, sizes_b = in_batched
    pred = batched(pred, pred_b)
    i = jnp.argmax(pred)  # the first True (0 when none is)
    values = tuple(batched(v, b)[i] for v, b in zip(values, values_b))
    index = jnp.concatenate([i[None].astype(jnp.int32), batched(index, index_b)[i]])
    sizes = jnp.concatenate([jnp.array([axis_size], jnp.int32), batched(sizes, sizes_b)[i]])
    # Calling ourselves again lets an enclosing vmap (if any) pick along its own axis.
    out = _first_failure(pred[i], values, index, sizes)
    return out, jax.tree_util.tree_map(lambda _: False, out)


def _format_message(msg: str, names: tuple[str, ...], values, index=(), sizes=()) -> str:
    """Build the error text on the host from the failing element's `values` (and, under
    `vmap`, its `index` in a batch of shape `sizes`)."""
    if names:
        picked = {}
        for name, value in zip(names, values):
            value = np.asarray(value)
            picked[name] = value.item() if value.size == 1 else value
        try:
            text = msg.format(**picked)
        except (KeyError, IndexError, ValueError, TypeError):
            text = f"{msg} (values: {picked})"
    else:
        text = msg
    if len(sizes):
        shape = tuple(int(n) for n in sizes)
        where = tuple(int(i) for i in index)
        text += f"\n(first failing element of a vmap batch of shape {shape}: {where})"
    return text


def _host_check(static, pred, values, index, sizes):
    msg, names = static
    if np.any(pred):
        raise ImplicitDiffRuntimeError(_format_message(msg, names, values, index, sizes))
    return np.zeros((), np.bool_)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _checked(static, gate, operands, leaves):
    msg, names, details = static

    def fail(operands):
        # Only here, on failure, is the (possibly costly) verdict per element computed.
        pred, values = details(*operands)
        no_index = jnp.zeros((0,), jnp.int32)
        picked = _first_failure(jnp.any(pred), tuple(values), no_index, no_index)
        return jax.pure_callback(
            functools.partial(_host_check, (msg, names)),
            jax.ShapeDtypeStruct((), jnp.bool_),
            *picked,
            vmap_method="sequential",  # never batched: `_first_failure` took one element
        )

    def ok(operands):
        del operands
        return jnp.zeros((), jnp.bool_)

    failed = lax.cond(gate, fail, ok, operands)
    # The leaves never enter the branch (a sharded `x` would be gathered to the device
    # that runs the callback). The check's result (always False: the callback raises
    # instead) selects every leaf instead, so the check stays alive as long as any part
    # of the returned value is used (a caller may keep one leaf and drop the rest); each
    # select fuses with its leaf's producer.

    def tied(leaf):
        fill = jnp.nan if jnp.issubdtype(leaf.dtype, jnp.inexact) else 0
        return jnp.where(failed, jnp.asarray(fill, leaf.dtype), leaf)

    return tuple(tied(leaf) for leaf in leaves)


@_checked.defjvp
def _checked_jvp(static, primals, tangents):
    gate, operands, leaves = primals
    _, _, leaf_dots = tangents
    return _checked(static, gate, operands, leaves), tuple(leaf_dots)


def _given(pred, values):
    return pred, values


def check_lazily(
    x: Any,
    maybe_failed: jax.Array,
    details: Callable[..., tuple[Any, tuple[Any, ...]]],
    operands: tuple[Any, ...],
    msg: str,
    names: tuple[str, ...] = (),
) -> Any:
    """`error_if` for a verdict that is costly to compute.

    Returns `x` unchanged. When the cheap scalar `maybe_failed` holds at run time (a
    false alarm is allowed; it must not be batched, so reduce it with `any_over_batch`),
    computes `pred, values = details(*operands)` and raises as
    `error_if(x, pred, msg, values=dict(zip(names, values)))` would. Nothing of `details`
    runs while `maybe_failed` is False.
    """
    leaves, treedef = jax.tree_util.tree_flatten(x)
    if not leaves:
        raise TypeError("check_lazily: `x` must contain at least one array.")
    leaves = tuple(jnp.asarray(leaf) for leaf in leaves)
    static = (msg, tuple(names), details)
    out = _checked(static, jnp.asarray(maybe_failed), tuple(operands), leaves)
    return jax.tree_util.tree_unflatten(treedef, list(out))


def _is_traced(value: Any) -> bool:
    return isinstance(value, jax.core.Tracer)


def error_if(x: Any, pred: Any, msg: str, *, values: Mapping[str, Any] | None = None) -> Any:
    """Return `x` unchanged, raising an error at run time if any element of `pred` is True.

    Works eagerly and under `jax.jit`, `jax.vmap` (a batched `pred` raises if any batch
    element is True), `jax.grad`/`jax.jvp`/`jax.linearize` and higher-order derivatives
    (tangents of `x` pass straight through), and inside `lax.scan`/`lax.while_loop` bodies.

    The check is attached to the returned value: use the result in place of `x`, otherwise
    a compiler may drop the check along with the unused output.

    Arguments:
        x: a pytree of arrays (Python scalars are converted to arrays). Must contain at
            least one array leaf.
        pred: a boolean array (any shape) or Python/NumPy bool. If it is not traced, the
            check runs immediately in Python.
        msg: the error message. If `values` is given, it is a `str.format` template whose
            fields are filled with the run-time values, e.g. `"residual {res:.2e}"`.
        values: optional mapping from names to scalar arrays (one number per batch element
            under `vmap`) shown in the message. Under `vmap` the values of the first
            failing batch element are used, and the batch index is appended.

    Returns:
        `x`, with the same structure and values: `x` itself when `pred` is concrete and
        False, otherwise with its leaves as JAX arrays.

    Raises:
        ImplicitDiffRuntimeError: eagerly, when `pred` is concrete and True (a
            `RuntimeError`). From compiled code the error arrives as
            `jax.errors.JaxRuntimeError` (a `RuntimeError`) or, on jit's cached fast path,
            as `ValueError`; in both cases the text contains `msg` (see the module notes).
        TypeError: if `pred` is not boolean, `msg` is not a string, or `x` has no arrays.

    Example:
        ```python
        import jax, jax.numpy as jnp
        from implicitdiff import error_if

        @jax.jit
        def safe_sqrt(x):
            x = error_if(x, x < 0, "safe_sqrt: negative input")
            return jnp.sqrt(x)

        safe_sqrt(jnp.array([1.0, 4.0]))  # [1. 2.]
        # safe_sqrt(jnp.array([-1.0]))    # raises: ... safe_sqrt: negative input
        ```
    """
    if not isinstance(msg, str):
        raise TypeError(f"error_if: `msg` must be a str, got {type(msg).__name__}.")
    values = dict(values or {})
    names = tuple(values)
    value_list = tuple(jnp.asarray(v) if _is_traced(v) else np.asarray(v) for v in values.values())

    if not _is_traced(pred):
        pred_np = np.asarray(pred)
        if pred_np.dtype != np.bool_:
            raise TypeError(
                f"error_if: `pred` must be boolean, got dtype {pred_np.dtype}; "
                "pass a comparison such as `x < 0`."
            )
        if not pred_np.any():
            return x
        if not any(_is_traced(v) for v in value_list):
            raise ImplicitDiffRuntimeError(_format_message(msg, names, value_list))
    elif jnp.result_type(pred) != jnp.bool_:
        raise TypeError(
            f"error_if: `pred` must be boolean, got dtype {jnp.result_type(pred)}; "
            "pass a comparison such as `x < 0`."
        )

    leaves, treedef = jax.tree_util.tree_flatten(x)
    if not leaves:
        raise TypeError(
            "error_if: `x` must contain at least one array, since the check is attached to "
            "the returned value."
        )
    leaves = tuple(jnp.asarray(leaf) for leaf in leaves)
    value_list = tuple(jnp.asarray(v) for v in value_list)
    pred = jnp.asarray(pred)
    gate = any_over_batch(reduce_any(pred))
    out = _checked((msg, names, _given), gate, (pred, value_list), leaves)
    return jax.tree_util.tree_unflatten(treedef, list(out))
