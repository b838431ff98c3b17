"""What `custom_jvp` and `custom_vjp` share: argument handling and the closure check.

`_CustomBase`, mixed into both public classes of `implicitdiff.custom_derivatives`,
resolves keyword arguments and defaults to positions (`_resolve`, with
`_nondiff_positions` for ``nondiff_argnames``) and, when a jvp/grad trace is active,
wraps the primal and the rule JAX calls so that their one call is traced to a jaxpr
whose constants are checked for a closed-over value carrying a tangent
(`_traced_call`); eagerly it rewords JAX's leaked-tracer error instead (`_call`). Both
raise the same `TypeError`, naming the value's shape and dtype.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.custom_derivatives import CustomVJPPrimal
from jax.errors import UnexpectedTracerError

from . import _jax_compat as compat

# Set while we trace user code for the closure check, so nested calls skip their own check.
_CHECKING: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "implicitdiff_check", default=False
)
# Leaves of these types are traced values; everything else in a nondiff argument stays static.
_ARRAY_TYPES = (jax.Array, jax.core.Tracer, np.ndarray)


def _is_array(x: Any) -> bool:
    """Whether a pytree leaf must be traced (an array or Tracer) rather than kept static."""
    return isinstance(x, _ARRAY_TYPES)


_carries_tangent = compat.carries_tangent
_under_differentiation = compat.under_differentiation
# JAX's leak error names the type as e.g. "float32[3]"; our message uses the short form "f32[3]".
_LEAK_TYPE = re.compile(r"type (\S+) wrapped in a (?:JVPTracer|LinearizeTracer)")
_LONG_TYPE = re.compile(r"([a-z]+[0-9a-z_]*)\[([0-9,]*)\]")


def _short_type(text: str) -> str:
    """``float32[3,2]`` -> ``f32[3,2]``; anything else is returned unchanged."""
    found = _LONG_TYPE.fullmatch(text)
    if found is None:
        return text
    try:
        dtype = jax.numpy.dtype(found.group(1))
    except TypeError:
        return text
    shape = tuple(int(d) for d in found.group(2).split(",") if d)
    aval = compat.aval_from_shape_dtype(jax.ShapeDtypeStruct(shape, dtype))
    return aval.str_short(short_dtypes=True)


class _View:
    """The attributes JAX's ``__call__`` reads, with some of the functions swapped."""

    def __init__(self, attrs: dict[str, Any]) -> None:
        self.__dict__.update(attrs)


def _nondiff_positions(fun: Callable, argnums: Sequence[int], argnames: Sequence[str]) -> tuple:
    """Merge ``nondiff_argnums`` with the positions of ``nondiff_argnames``."""
    positions = {int(i) for i in argnums}
    if argnames:
        try:
            params = list(inspect.signature(fun).parameters.values())
        except (TypeError, ValueError) as e:
            raise TypeError(f"nondiff_argnames needs the signature of {fun!r}: {e}") from e
        kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        index = {p.name: i for i, p in enumerate(params) if p.kind in kinds}
        for name in argnames:
            if name not in index:
                raise ValueError(
                    f"nondiff_argnames: {name!r} is not a positional parameter of {fun!r}"
                )
            positions.add(index[name])
    if any(i < 0 for i in positions):
        raise ValueError(f"nondiff_argnums must be non-negative, got {sorted(positions)}")
    return tuple(sorted(positions))


class _CustomBase:
    """Shared argument handling and closure check (mixed into the two public classes)."""

    fun: Callable
    nondiff_argnums: tuple
    _kind = ""
    _rule = ""  # the name of the rule attribute JAX calls: "jvp" or "fwd"
    _jax_attrs: tuple[str, ...] = ()  # what JAX's __call__ reads from the object
    _jax_call: Callable[..., Any]

    def _setup(self, fun: Callable, nondiff_argnames: Sequence[str]) -> None:
        self.nondiff_argnames = tuple(nondiff_argnames)
        try:
            self._sig: inspect.Signature | None = inspect.signature(fun)
        except (TypeError, ValueError):
            self._sig = None
        simple = self._sig is not None and all(
            p.kind == p.POSITIONAL_OR_KEYWORD and p.default is p.empty
            for p in self._sig.parameters.values()
        )
        self._n_simple = len(self._sig.parameters) if simple else -1

    def __getattr__(self, name: str) -> Any:
        # As in JAX: forward def* lookups so decorators can be stacked.
        if name.startswith("def") and "fun" in self.__dict__:
            return getattr(self.fun, name)
        raise AttributeError(name)

    def _resolve(self, args: tuple, kwargs: dict) -> tuple:
        """Turn a call into positional arguments, with defaults filled in (as JAX does)."""
        if not kwargs and len(args) == self._n_simple:
            return args
        if self._sig is None:  # no signature: positional calls only
            if kwargs:
                raise TypeError(f"{self._name()} has no signature; pass arguments by position")
            return args
        try:
            bound = self._sig.bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(
                f"The arguments to the {self._kind} function {self._name()} could "
                f"not be bound to its signature: {e}"
            ) from e
        bound.apply_defaults()
        if set(bound.kwargs) & set(kwargs):
            raise TypeError(
                f"Keyword-only arguments {sorted(set(bound.kwargs) & set(kwargs))} "
                f"of {self._kind} function {self._name()} can't be resolved to positions"
            )
        return bound.args

    def _name(self) -> str:
        return getattr(self.fun, "__qualname__", repr(self.fun))

    def _checking(self, fn: Callable) -> Callable:
        """Wrap a function JAX will call (primal or rule) so that its one call is also checked
        for a closed-over value that carries a tangent."""

        @functools.wraps(fn)
        def run(*args: Any) -> Any:
            if _CHECKING.get() or compat.evaluates_eagerly():
                # Eagerly, using such a value raises JAX's leak error, reworded by `_call`.
                return fn(*args)
            return self._traced_call(fn, args)

        return run

    def _traced_call(self, fn: Callable, args: tuple) -> Any:
        """``fn(*args)`` traced to a jaxpr whose constants are checked, then replayed."""
        leaves, tree = jax.tree_util.tree_flatten(args)
        slots: list[tuple[int, Any]] = []  # (leaf index, perturbed flag or None)
        arrays: list[Any] = []
        for i, leaf in enumerate(leaves):
            if _is_array(leaf):
                slots.append((i, None))
                arrays.append(leaf)
            elif isinstance(leaf, CustomVJPPrimal) and _is_array(leaf.value):
                slots.append((i, leaf.perturbed))
                arrays.append(leaf.value)

        # The outputs that are not JAX values (None, Python numbers, anything JAX would
        # reject) are handed back as they are, so that JAX sees what a direct call returns.
        out_parts: list[Any] = []

        def traced(*values: Any) -> list[Any]:
            full = list(leaves)
            for (i, perturbed), x in zip(slots, values):
                full[i] = x if perturbed is None else CustomVJPPrimal(x, perturbed)
            out_leaves, out_tree = jax.tree_util.tree_flatten(fn(*tree.unflatten(full)))
            staged = [isinstance(x, jax.Array | compat.Tracer) for x in out_leaves]
            out_parts[:] = [out_tree, out_leaves, staged]
            return [x for x, s in zip(out_leaves, staged) if s]

        token = _CHECKING.set(True)
        try:
            closed = jax.make_jaxpr(traced)(*arrays)
        finally:
            _CHECKING.reset(token)
        bad = [c for c in closed.consts if _carries_tangent(c)]
        if bad:
            raise self._closure_error(
                ", ".join(jax.typeof(c).str_short(short_dtypes=True) for c in bad)
            )
        out_tree, out_leaves, staged = out_parts
        it = iter(compat.eval_closed_jaxpr(closed, arrays))
        return out_tree.unflatten([next(it) if s else x for x, s in zip(out_leaves, staged)])

    def _checked(self, obj: Any) -> _View:
        """``obj`` (a JAX custom function) with its primal and rule wrapped by `_checking`."""
        view = _View({name: getattr(obj, name) for name in self._jax_attrs})
        view.fun = self._checking(obj.fun)
        setattr(view, self._rule, self._checking(getattr(obj, self._rule)))
        return view

    def _closure_error(self, types: str) -> TypeError:
        rule = "jvp rule" if self._kind == "custom_jvp" else "fwd/bwd rules"
        return TypeError(
            f"The {self._kind} function {self._name()} is being differentiated with respect to "
            f"a value it closes over (type {types}). Its custom rule only covers its explicit "
            f"arguments, so that derivative can't be formed. Pass the closed-over value to "
            f"{self._name()} as an explicit argument and extend the {rule} to handle it "
            f"(or wrap it in jax.lax.stop_gradient if no derivative is wanted)."
        )

    def _call(self, obj: Any, args: tuple) -> Any:
        """Call JAX's ``__call__`` on ``obj``, checked for closures when differentiated."""
        if not _CHECKING.get() and _under_differentiation():
            obj = self._checked(obj)
        try:
            return self._jax_call(obj, *args)
        except UnexpectedTracerError as err:
            # Eagerly, a differentiated closed-over value reaches JAX's leak check: reword it.
            found = _LEAK_TYPE.search(str(err))
            if found is None:
                raise
            raise self._closure_error(_short_type(found.group(1))) from err
