"""Every use of JAX internals in implicitdiff lives in this module.

JAX's public API has no way to declare a primitive that carries its own
derivative, transposition and batching rules and still lets `jax.jit` cache
the traced function. The private `jax._src` modules do, but they change
between releases. To keep upgrades a one-file job, the rest of the package
talks to two small "rule protocols" defined here and never imports `jax._src`:

* `prim_call_p` binds a *rule object* (an `implicitdiff.Primitive` instance)
  and dispatches each transformation to a method of it:
  `_rule_impl(*args)`, `_rule_abstract_eval()`, `_rule_jvp(primals, tangents)`,
  `_rule_linearize(is_vjp, nzs, *primals)`, `_rule_batch(axis_data, args, dims)`.
* `lin_call_p` is a linear map with a custom transpose ("a linear call"), also
  driven by a rule object: `_rule_forward(res, tangents)`,
  `_rule_transpose(res, cts)`, `_rule_batch(axis_data, args, dims)` and the
  attribute `out_avals`.

Both are ordinary ("low") JAX primitives: they lower through `mlir.lower_fun`,
so a jitted function that contains them is traced once and cached, exactly as
one containing `jax.custom_vjp`.

Tested against jax 0.10.2; `check_support()` raises a clear error when a future
release moves what this module relies on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

try:  # the internals this module relies on (jax 0.10.x layout)
    from jax._src import api_util as _api_util
    from jax._src import config as _config
    from jax._src import core as _core
    from jax._src import linear_util as _lu
    from jax._src.ad_util import Zero as _Zero
    from jax._src.interpreters import ad as _ad
    from jax._src.interpreters import batching as _batching
    from jax._src.interpreters import mlir as _mlir
    from jax._src.interpreters import partial_eval as _pe

    _IMPORT_ERROR: Exception | None = None
except ImportError as e:  # pragma: no cover - only on an unsupported jax
    _IMPORT_ERROR = e


def check_support() -> None:
    """Raise `RuntimeError` if this jax lacks the internals we rely on."""
    if _IMPORT_ERROR is not None:
        raise RuntimeError(
            f"implicitdiff supports jax>=0.10.2,<0.11; this jax ({jax.__version__}) "
            f"moved an internal module: {_IMPORT_ERROR}"
        )
    missing = [
        name
        for name, ok in [
            ("ad.primitive_linearizations", hasattr(_ad, "primitive_linearizations")),
            ("batching.fancy_primitive_batchers", hasattr(_batching, "fancy_primitive_batchers")),
            ("batching.infer", hasattr(_batching, "infer")),
        ]
        if not ok
    ]
    if missing:
        raise RuntimeError(
            f"implicitdiff supports jax>=0.10.2,<0.11; this jax ({jax.__version__}) "
            f"lacks {', '.join(missing)}"
        )


check_support()

# ---------------------------------------------------------------------------
# Types re-exported for users and for the rest of the package.

Zero = _Zero
Tracer = _core.Tracer


def instantiate_zeros(x: Any) -> Any:
    """Turn a symbolic `Zero` into an array of zeros; return anything else unchanged."""
    if isinstance(x, _Zero):
        return _ad.zeros_like_aval(x.aval)
    return x


def zeros_like_aval(aval: Any) -> jax.Array:
    return _ad.zeros_like_aval(aval)


def is_aval(x: Any) -> bool:
    return isinstance(x, _core.AbstractValue)


def typeof(x: Any) -> Any:
    return _core.typeof(x)


def aval_from_shape_dtype(x: Any) -> Any:
    """An abstract value from anything with `.shape` and `.dtype` (e.g. ShapeDtypeStruct)."""
    if isinstance(x, _core.AbstractValue):
        return x
    return _core.ShapedArray(
        tuple(x.shape), np.dtype(x.dtype), weak_type=bool(getattr(x, "weak_type", False))
    )


def tangent_aval(aval: Any) -> Any:
    return aval.to_tangent_aval()


def types_match(a: Any, b: Any) -> bool:
    """Same shape and dtype, ignoring weak typing."""
    return _core.typematch(a, b)


def mapped_aval(size: int, axis: int | None, aval: Any) -> Any:
    return aval if axis is None else _core.mapped_aval(size, axis, aval)


def unmapped_aval(axis_data: Any, axis: int | None, aval: Any) -> Any:
    if axis is None:
        return aval
    return _core.unmapped_aval(axis_data.size, axis, aval, axis_data.explicit_mesh_axis)


def vmap_kwargs(axis_data: Any) -> dict[str, Any]:
    """Keyword arguments for `jax.vmap` that reproduce an enclosing vmap's axis."""
    return dict(
        axis_size=axis_data.size,
        axis_name=axis_data.name,
        spmd_axis_name=axis_data.spmd_name or axis_data.explicit_mesh_axis,
    )


def vmap_infer_out_axes(
    fun: Callable, in_axes: Any, axis_data: Any, fixed_out_axes: Any
) -> Callable:
    """`jax.vmap(fun)` whose second output's batch axes are inferred, not forced.

    Returns a function giving `(out0, out1), out1_axes`: the first output is
    batched at `fixed_out_axes`; the second (residuals) keeps the axes it has, so
    an unbatched residual (a shared parameter) is not broadcast over the batch.
    """

    def run(*args):
        (out0, out1), (_, out1_axes) = jax.vmap(
            fun,
            in_axes=in_axes,
            out_axes=(fixed_out_axes, _batching.infer),
            **vmap_kwargs(axis_data),
        )(*args)
        return (out0, out1), out1_axes

    return run


# ---------------------------------------------------------------------------
# The primitive call: one equation per application of a user primitive.

prim_call_p = _core.Primitive("implicitdiff_call")
prim_call_p.multiple_results = True


def _prim_impl(*args, prim):
    return prim._rule_impl(*args)


def _prim_abstract_eval(*args, prim):
    return prim._rule_abstract_eval()


def _prim_jvp(primals, tangents, *, prim):
    return prim._rule_jvp(list(primals), list(tangents))


def _prim_linearize(is_vjp, nzs, *primals, prim):
    return prim._rule_linearize(is_vjp, list(nzs), *primals)


def _prim_batch(axis_data, args, dims, *, prim):
    return prim._rule_batch(axis_data, list(args), list(dims))


def _prim_transpose(cts, *args, prim):
    # Linear inputs arrive as cotangent accumulators (objects with `.accum`).
    prim._rule_transpose(list(cts), list(args))


prim_call_p.def_impl(_prim_impl)
_ad.fancy_transposes[prim_call_p] = _prim_transpose
prim_call_p.def_abstract_eval(_prim_abstract_eval)
_ad.primitive_jvps[prim_call_p] = _prim_jvp
_ad.primitive_linearizations[prim_call_p] = _prim_linearize
_batching.fancy_primitive_batchers[prim_call_p] = _prim_batch
_mlir.register_lowering(prim_call_p, _mlir.lower_fun(_prim_impl, multiple_results=True))


def bind_prim(prim: Any, args_flat: Sequence[Any]) -> list[Any]:
    return prim_call_p.bind(*args_flat, prim=prim)


def fallback_linearize(prim: Any, nzs: Sequence[bool], primals: Sequence[Any]):
    """Linearize `prim` by partially evaluating its JVP rule (JAX's generic path)."""
    return _ad.fallback_linearize_rule(prim_call_p, False, list(nzs), *primals, prim=prim)


# ---------------------------------------------------------------------------
# The linear call: a linear map whose transpose is given by a rule object.

lin_call_p = _core.Primitive("implicitdiff_lin_call")
lin_call_p.multiple_results = True


def _lin_impl(*args, rule, num_res):
    return rule._rule_forward(list(args[:num_res]), list(args[num_res:]))


def _lin_abstract_eval(*args, rule, num_res):
    return list(rule.out_avals)


def _lin_jvp(primals, tangents, *, rule, num_res):
    # Linear in the tangent inputs, but not in the residuals: differentiate the
    # forward map as ordinary JAX code (used only for forward-over-forward).
    out = lin_call_p.bind(*primals, rule=rule, num_res=num_res)
    tangents = [instantiate_zeros(t) for t in tangents]

    def fwd(*a):
        return rule._rule_forward(list(a[:num_res]), list(a[num_res:]))

    _, out_dot = jax.jvp(fwd, tuple(primals), tuple(tangents))
    return out, list(out_dot)


def _lin_transpose(cts, *args, rule, num_res):
    res = list(args[:num_res])
    if any(_ad.is_undefined_primal(r) for r in res):
        raise NotImplementedError(
            "implicitdiff: a custom derivative rule's residuals depend linearly on "
            "the value being transposed; this combination of transformations is not "
            "supported."
        )
    cts_in = rule._rule_transpose(res, list(cts))
    return [None] * num_res + list(cts_in)


def _lin_batch(axis_data, args, dims, *, rule, num_res):
    return rule._rule_batch(axis_data, list(args), list(dims), num_res)


lin_call_p.def_impl(_lin_impl)
lin_call_p.def_abstract_eval(_lin_abstract_eval)
_ad.primitive_jvps[lin_call_p] = _lin_jvp
_ad.primitive_transposes[lin_call_p] = _lin_transpose
_batching.fancy_primitive_batchers[lin_call_p] = _lin_batch
_mlir.register_lowering(lin_call_p, _mlir.lower_fun(_lin_impl, multiple_results=True))


def bind_lin(rule: Any, res_flat: Sequence[Any], tangents: Sequence[Any]) -> list[Any]:
    return lin_call_p.bind(*res_flat, *tangents, rule=rule, num_res=len(res_flat))


# ---------------------------------------------------------------------------
# Questions about the live trace stack (used by custom_jvp / custom_vjp to name a
# differentiated closed-over value in their error message).

_AD_TRACES = (_ad.JVPTrace, _ad.LinearizeTrace)
_AD_TRACERS = (_ad.JVPTracer, _ad.LinearizeTracer)


def under_differentiation() -> bool:
    """Whether a jvp / linearize (grad) trace is active anywhere in the trace stack."""
    trace = _core.find_top_trace(())
    while trace is not None:
        if isinstance(trace, _AD_TRACES):
            return True
        trace = getattr(trace, "parent_trace", None)
    return False


# Traces that hand a value they do not own on to their parent trace, so that at the bottom
# of a stack made only of these, using a tracer of a finished trace fails on the spot.
# (`JaxprTrace` is the known/unknown split of JAX's generic linearization: known values,
# foreign tracers included, are computed in its parent trace.)
_FORWARDING_TRACES = (_core.EvalTrace, _batching.BatchTrace, _pe.JaxprTrace, *_AD_TRACES)


def evaluates_eagerly() -> bool:
    """Whether every trace in the current stack runs operations (rather than recording them).

    There, an operation on a tracer of a trace that is not in the stack raises JAX's
    `UnexpectedTracerError` at once; a recording (jaxpr) trace would instead keep such a
    tracer as a constant of the jaxpr it builds.
    """
    trace = _core.find_top_trace(())
    while trace is not None:
        if not isinstance(trace, _FORWARDING_TRACES):
            return False
        trace = getattr(trace, "parent_trace", None)
    return True


def eval_closed_jaxpr(closed: Any, args: Sequence[Any]) -> list[Any]:
    """Run the equations of a `jax.make_jaxpr` result on `args` in the current trace."""
    return _core.eval_jaxpr(closed.jaxpr, closed.consts, *args)


def jaxpr_parts(jaxpr: Any) -> tuple[list[Any], list[Any], list[Any], list[Any], Callable]:
    """`(invars, constvars, eqns, outvars, is_literal)` of an (open) jaxpr, for code that
    reads a traced function's equations (`eqn.primitive.name`, `eqn.params`,
    `eqn.invars`, `eqn.outvars`); `is_literal(v)` tells an inline constant (with its
    value in `v.val`) from a variable."""
    return (
        list(jaxpr.invars),
        list(jaxpr.constvars),
        list(jaxpr.eqns),
        list(jaxpr.outvars),
        lambda v: isinstance(v, _core.Literal),
    )


def carries_tangent(x: Any) -> bool:
    """Whether `x` is, or wraps (e.g. a vmap tracer around), a differentiation tracer."""
    if not isinstance(x, _core.Tracer):
        return False
    if isinstance(x, _AD_TRACERS):
        return True
    contents = getattr(x, "_contents", None)
    return callable(contents) and any(carries_tangent(v) for _, v in contents())


def is_vmapped(x: Any) -> bool:
    """Whether `x` is a tracer of `vmap` mapped over one of its axes (of any size, one
    included)."""
    while isinstance(x, _batching.BatchTracer):
        if x.batch_dim is not None:
            return True
        x = x.val
    return False


def vmap_size(x: Any) -> int:
    """The product of the sizes of the `vmap` axes `x` is batched over (1 when `x` is
    not a tracer of `vmap`): inside `vmap` a function sees one element of the batch."""
    n = 1
    while isinstance(x, _batching.BatchTracer):
        if isinstance(x.batch_dim, int):  # None when this tracer is not mapped
            n *= int(np.shape(x.val)[x.batch_dim])
        x = x.val
    return n


# ---------------------------------------------------------------------------
# Closure conversion for higher-order primitives (custom_root, custom_linear_solve).


def closure_convert(fun: Callable, *example_args: Any) -> tuple[Callable, list[Any], Any]:
    """Trace `fun` at the types of `example_args` and hoist every traced constant.

    Returns `(converted, consts, out_tree)` where `converted(consts, *args)` is
    `fun(*args)` and `consts` lists every Tracer `fun` closed over (whatever its
    dtype), so a primitive can take them as explicit inputs: differentiating,
    batching or staging them then goes through the primitive's rules rather
    than leaking into a jaxpr. Concrete constants stay inside the jaxpr.
    (`jax.closure_convert` hoists only float tracers, which would leave e.g. a
    batched integer index behind.)
    """
    flat_args, in_tree = jax.tree_util.tree_flatten(example_args)
    avals = [_core.typeof(x) for x in flat_args]
    debug = _api_util.debug_info("implicitdiff", fun, example_args, {})
    wrapped, out_tree_thunk = _api_util.flatten_fun_nokwargs(
        _lu.wrap_init(fun, debug_info=debug), in_tree
    )
    jaxpr, _, consts = _pe.trace_to_jaxpr_dynamic(wrapped, avals)
    out_tree = out_tree_thunk()
    is_traced = [isinstance(c, _core.Tracer) for c in consts]
    hoisted = [c for c, t in zip(consts, is_traced) if t]
    kept = [c for c, t in zip(consts, is_traced) if not t]

    def converted(hoisted_vals: Sequence[Any], *args: Any) -> Any:
        it_h, it_k = iter(hoisted_vals), iter(kept)
        all_consts = [next(it_h) if t else next(it_k) for t in is_traced]
        leaves, tree = jax.tree_util.tree_flatten(args)
        if tree != in_tree:
            raise TypeError(f"expected arguments of structure {in_tree}, got {tree}")
        out = _core.eval_jaxpr(jaxpr, all_consts, *leaves)
        return jax.tree_util.tree_unflatten(out_tree, out)

    return converted, hoisted, out_tree


def in_checked_shard_map() -> bool:
    """Whether we are tracing inside `jax.shard_map(..., check_vma=True)`: manual mesh
    axes, with every value's type recording the axes it varies along."""
    get_mesh = getattr(jax.sharding, "get_abstract_mesh", None)
    manual = getattr(get_mesh(), "manual_axes", ()) if get_mesh is not None else ()
    check = getattr(_config, "_check_vma", None)
    return bool(manual) and check is not None and bool(check.value)
