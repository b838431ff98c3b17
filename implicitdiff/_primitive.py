"""`Primitive`: one class that carries an implementation and its derivative rules.

A subclass declares its input and output types and an `expand` method (the
implementation, in ordinary JAX), then attaches whichever rules it needs:

=====================================  ==========================================
rule(s)                                used by
=====================================  ==========================================
`expand`                               evaluation, `jit` (lowering)
`vjp_fwd` + `vjp_bwd_retval`/`vjp_bwd`  `grad`, `vjp`, `jacrev`
`jvp`                                  `jvp`, `jacfwd`, forward-over-reverse
`lin` + `linearized`                   `linearize`
`batch` or `batch_dim_rule`            `vmap` (optional: by default `vmap` maps
                                       `expand` and every rule, so custom
                                       derivatives survive batching)
=====================================  ==========================================

Each application binds a single equation of an ordinary JAX primitive
(`implicitdiff._jax_compat.prim_call_p`) whose transformation rules call back
into the instance; see that module for why this costs nothing at dispatch.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from . import _jax_compat as compat
from ._jax_compat import Zero, instantiate_zeros

__all__ = ["Primitive", "Zero", "instantiate_zeros", "NullAccum", "Static"]


# ---------------------------------------------------------------------------
# Small helpers.


@jax.tree_util.register_pytree_node_class
class Static:
    """A pytree leaf-less wrapper for static (hashable, non-array) data inside residuals."""

    __slots__ = ("val",)

    def __init__(self, val: Any):
        self.val = val

    def tree_flatten(self):
        return (), self.val

    @classmethod
    def tree_unflatten(cls, aux, _):
        return cls(aux)

    def __repr__(self):
        return f"Static({self.val!r})"


class _Accum:
    """Cotangent accumulator handed to `vjp_bwd`: call `.accum(value)` any number of times."""

    __slots__ = ("aval", "value")

    def __init__(self, aval: Any):
        self.aval = aval
        self.value: Any = None

    def accum(self, x: Any) -> None:
        if x is None or isinstance(x, Zero):
            return
        if isinstance(x, _Accum):
            raise TypeError("accum() takes a cotangent value, not an accumulator")
        shape = tuple(np.shape(x))
        if shape != tuple(self.aval.shape):
            raise ValueError(
                f"cotangent of shape {shape} accumulated into an input of type "
                f"{self.aval.str_short()}; the backward rule must return one cotangent "
                "per input with that input's shape"
            )
        if jnp.result_type(x) != self.aval.dtype:
            x = jnp.asarray(x, self.aval.dtype)
        self.value = x if self.value is None else self.value + x

    def __repr__(self):
        return f"Accum({self.aval.str_short()})"


class NullAccum(_Accum):
    """Accumulator for an input that is not being differentiated: `accum` does nothing."""

    def accum(self, x: Any) -> None:
        return None

    def __repr__(self):
        return f"NullAccum({self.aval.str_short()})"


# Residual leaves of these types travel as data; anything else (Python scalars such
# as an axis number, strings, callables) is kept as a static constant.
_ARRAY_TYPES = (jax.Array, compat.Tracer, np.ndarray, np.generic)


def _split_residuals(res: Any) -> tuple[list[Any], Any, tuple[Any, ...]]:
    """Residual pytree -> (dynamic leaves, treedef, static leaves with dynamic slots as None)."""
    leaves, tree = jax.tree_util.tree_flatten(res)
    dyn = [x for x in leaves if isinstance(x, _ARRAY_TYPES)]
    static = tuple(None if isinstance(x, _ARRAY_TYPES) else x for x in leaves)
    return dyn, tree, static


def _join_residuals(dyn: list[Any], tree: Any, static: tuple[Any, ...]) -> Any:
    it = iter(dyn)
    leaves = [next(it) if s is None else s for s in static]
    return jax.tree_util.tree_unflatten(tree, leaves)


def _is_float0(aval: Any) -> bool:
    return getattr(aval, "dtype", None) == jax.dtypes.float0


def _overrides(cls: type, name: str) -> bool:
    return getattr(cls, name) is not getattr(Primitive, name)


_reuse = threading.local()


class _reuse_primal:
    """Within this context, `prim(*args)` with these exact args returns `out` unevaluated.

    Forward-mode rules recompute the primal output by calling `self(...)`; when the
    output is already known (it was computed by `vjp_fwd`) this avoids doing the
    work twice.
    """

    def __init__(self, prim, args_flat, out_flat):
        self.entry = (prim, list(args_flat), list(out_flat))

    def __enter__(self):
        stack = getattr(_reuse, "stack", None)
        if stack is None:
            stack = _reuse.stack = []
        stack.append(self.entry)

    def __exit__(self, *exc):
        _reuse.stack.pop()


def _lookup_reuse(prim, args_flat):
    stack = getattr(_reuse, "stack", None)
    if not stack:
        return None
    p, a, out = stack[-1]
    if p is prim and len(a) == len(args_flat) and all(x is y for x, y in zip(a, args_flat)):
        return out
    return None


# ---------------------------------------------------------------------------
# The linear map of one primitive application: forward = the jvp rule's tangent,
# transpose = the vjp rule.


class _PrimLin:
    """Rule object for `compat.lin_call_p` built from a `Primitive` application."""

    def __init__(self, prim, nz_in, out_nz, res_tree, res_static, n_fwd_res):
        self.prim = prim
        self.nz_in = tuple(nz_in)
        self.out_nz = tuple(out_nz)
        self.res_tree = res_tree
        self.res_static = res_static
        # The first n_fwd_res residuals are the primal inputs and outputs, kept
        # only when the forward (jvp) direction may be evaluated.
        self.n_fwd_res = n_fwd_res
        self.in_tangent_avals = [
            compat.tangent_aval(a) for a, nz in zip(prim.in_avals_flat, nz_in) if nz
        ]
        self.out_avals = [
            compat.tangent_aval(a) for a, nz in zip(prim.out_avals_flat, out_nz) if nz
        ]

    def _rule_forward(self, res, nz_tangents):
        prim = self.prim
        if not prim._caps()[0]:
            raise NotImplementedError(
                f"for jvp support, subclass {type(prim).__name__} must implement `jvp` "
                "(or `lin` and `linearized` with `jvp = jvp_from_lin`)"
            )
        if not self.n_fwd_res:
            raise NotImplementedError(
                f"{type(prim).__name__}: forward evaluation of a reverse-mode "
                "linearization is not supported; use jax.jvp or jax.linearize instead"
            )
        n_in = len(prim.in_avals_flat)
        primals_flat = res[:n_in]
        out_flat = res[n_in : self.n_fwd_res]
        tangents = prim._fill_tangents(self.nz_in, nz_tangents)
        with _reuse_primal(prim, primals_flat, out_flat):
            _, t_out = prim.jvp(prim._unflatten_in(primals_flat), tangents)
        t_flat = prim._flatten_out_tangents(t_out, "jvp")
        return [t for t, nz in zip(t_flat, self.out_nz) if nz]

    def _rule_transpose(self, res, cts):
        prim = self.prim
        if not prim._caps()[1]:
            if prim.no_vjp_message:
                raise NotImplementedError(prim.no_vjp_message)
            raise NotImplementedError(
                f"for grad support, subclass {type(prim).__name__} must implement "
                "`vjp_fwd` and `vjp_bwd_retval` (or `vjp_bwd`), or derive them from `jvp` "
                "with `vjp_fwd = vjp_fwd_from_jvp` and `vjp_bwd_retval = transpose_jvp`"
            )
        user_res = _join_residuals(list(res[self.n_fwd_res :]), self.res_tree, self.res_static)
        it = iter(cts)
        g_flat = [
            next(it) if nz else Zero(compat.tangent_aval(a))
            for a, nz in zip(prim.out_avals_flat, self.out_nz)
        ]
        g = jax.tree_util.tree_unflatten(prim.out_tree, g_flat)
        accums = [
            (_Accum if nz else NullAccum)(compat.tangent_aval(a))
            for a, nz in zip(prim.in_avals_flat, self.nz_in)
        ]
        none = prim.vjp_bwd(user_res, g, *prim._unflatten_in(accums))
        if none is not None:
            raise TypeError(
                f"{type(prim).__name__}.vjp_bwd must accumulate into its accumulator "
                "arguments and return None; to return cotangents, define vjp_bwd_retval"
            )
        return [acc.value for acc, nz in zip(accums, self.nz_in) if nz]

    def _rule_batch(self, axis_data, args, dims, num_res):
        if all(d is None for d in dims):
            return compat.bind_lin(self, args[:num_res], args[num_res:]), [None] * len(
                self.out_avals
            )
        rule = _BatchedLin(self, axis_data, dims[:num_res], dims[num_res:])
        return compat.bind_lin(rule, args[:num_res], args[num_res:]), [0] * len(rule.out_avals)


class _BatchedLin:
    """A `_PrimLin` (or another `_BatchedLin`) mapped over one vmap axis."""

    def __init__(self, base, axis_data, res_dims, tan_dims):
        self.base = base
        self.axis_data = axis_data
        self.res_dims = list(res_dims)
        self.tan_dims = list(tan_dims)
        self.in_tangent_avals = [
            compat.unmapped_aval(axis_data, d, a) for a, d in zip(base.in_tangent_avals, tan_dims)
        ]
        self.out_avals = [compat.unmapped_aval(axis_data, 0, a) for a in base.out_avals]

    def _rule_forward(self, res, tangents):
        f = lambda r, t: self.base._rule_forward(r, t)
        return jax.vmap(
            f,
            in_axes=(self.res_dims, self.tan_dims),
            out_axes=0,
            **compat.vmap_kwargs(self.axis_data),
        )(list(res), list(tangents))

    def _rule_transpose(self, res, cts):
        cts = [instantiate_zeros(c) for c in cts]

        def f(r, c):
            out = self.base._rule_transpose(r, c)
            return [
                compat.zeros_like_aval(a) if o is None else o
                for o, a in zip(out, self.base.in_tangent_avals)
            ]

        return jax.vmap(
            f,
            in_axes=(self.res_dims, [0] * len(cts)),
            out_axes=self.tan_dims,
            sum_match=True,
            **compat.vmap_kwargs(self.axis_data),
        )(list(res), cts)

    def _rule_batch(self, axis_data, args, dims, num_res):
        if all(d is None for d in dims):
            return compat.bind_lin(self, args[:num_res], args[num_res:]), [None] * len(
                self.out_avals
            )
        rule = _BatchedLin(self, axis_data, dims[:num_res], dims[num_res:])
        return compat.bind_lin(rule, args[:num_res], args[num_res:]), [0] * len(rule.out_avals)


# ---------------------------------------------------------------------------
# The public base class.


class Primitive:
    """Base class for a JAX operation with its own implementation and derivative rules.

    Subclasses set three attributes, either in their own `__init__` before calling
    `super().__init__()` or by letting this `__init__` take them as arguments:

    - `in_avals`: one type per positional argument (each may be a pytree of types,
      e.g. from `jax.typeof`);
    - `out_aval`: the output type (a pytree of types; inferred from `expand` with
      `jax.eval_shape` when not given);
    - `params`: static, hashable parameters, also exposed as attributes.

    Only `expand` is required. The derivative rules (`vjp_fwd`, `vjp_bwd_retval`
    or `vjp_bwd`, `jvp`, `lin`/`linearized`) are needed only by the transformations
    that use them; a missing one raises `NotImplementedError` naming it. `vmap` needs
    no rule: by default it maps `expand` and every rule, so custom derivatives are
    kept under batching; `batch_dim_rule` or `batch` refine that.

    Arguments:
        *in_avals: the argument types, when the subclass does not set `in_avals`.
        **params: static parameters, when the subclass does not set `params`.

    Example:
        ```python
        import jax, jax.numpy as jnp
        from implicitdiff import Primitive

        class Log1pExp(Primitive):
            def expand(self, x):
                return jnp.log1p(jnp.exp(x))

            def vjp_fwd(self, nzs_in, x):
                return self(x), x

            def vjp_bwd_retval(self, x, g):
                return ((1 - 1 / (1 + jnp.exp(x))) * g,)

        print(jax.grad(Log1pExp.apply)(100.0))  # 1.0
        ```
    """

    in_avals: tuple[Any, ...]
    out_aval: Any
    params: dict[str, Hashable]
    #: When True, `jvp`, `linearized` and the derived rules receive symbolic `Zero`
    #: tangents for inputs that are not differentiated; when False (default) they
    #: receive arrays of zeros. Cotangents given to `vjp_bwd*` may always be `Zero`.
    symbolic_zeros: ClassVar[bool] = False
    #: A subclass without reverse-mode rules on purpose can set the error message that
    #: reverse mode (`grad`, `vjp`) raises, e.g. to point to an alternative.
    no_vjp_message: ClassVar[str | None] = None
    _caps_cache: ClassVar[tuple[bool, bool, bool]] = (False, False, False)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        from . import _derive

        if cls.jvp is _derive.jvp_from_lin and cls.lin is _derive.linearize_from_jvp:
            raise TypeError(
                f"{cls.__name__} derives `jvp` from `lin` (jvp_from_lin) and `lin` from "
                "`jvp` (linearize_from_jvp): that is a circle. Write one of them by hand."
            )
        if _overrides(cls, "vjp_bwd") and _overrides(cls, "vjp_bwd_retval"):
            raise TypeError(
                f"{cls.__name__} defines both `vjp_bwd` and `vjp_bwd_retval`; define one"
            )
        cls._caps_cache = (
            _overrides(cls, "jvp"),
            _overrides(cls, "vjp_fwd")
            and (_overrides(cls, "vjp_bwd") or _overrides(cls, "vjp_bwd_retval")),
            _overrides(cls, "lin") and _overrides(cls, "linearized"),
        )

    def __init__(self, *in_avals: Any, **params: Any):
        name = type(self).__name__
        if "in_avals" not in self.__dict__:
            self.in_avals = tuple(in_avals)
        elif in_avals:
            raise TypeError(f"{name}: in_avals given both as attribute and as arguments")
        if "params" not in self.__dict__:
            self.params = dict(params)
        elif params:
            raise TypeError(f"{name}: params given both as attribute and as keywords")
        if not isinstance(self.in_avals, tuple):
            self.in_avals = tuple(self.in_avals)
        is_leaf = lambda x: compat.is_aval(x) or hasattr(x, "dtype")
        self.in_avals = jax.tree_util.tree_map(
            compat.aval_from_shape_dtype, self.in_avals, is_leaf=is_leaf
        )
        for k, v in self.params.items():
            if any(isinstance(x, jax.Array | compat.Tracer) for x in jax.tree_util.tree_leaves(v)):
                raise TypeError(
                    f"{name}: static parameter {k!r} holds an array or traced value "
                    f"({_describe(v)}). Parameters are baked into the primitive when it is "
                    "built, so they cannot be data: pass it as an input (an entry of "
                    "in_avals / a positional argument) instead."
                )
            try:
                hash(v)
            except TypeError:
                raise TypeError(
                    f"{name}: static parameter {k!r} = {v!r} is not hashable; use a tuple "
                    "or a frozen dataclass, or pass array data as an input"
                ) from None
        self.in_avals_flat, self.in_tree = jax.tree_util.tree_flatten(self.in_avals)
        for k, v in self.params.items():  # params are readable as attributes, e.g. self.f
            if not callable(getattr(type(self), k, None)):
                self.__dict__.setdefault(k, v)
        if "out_aval" not in self.__dict__:
            self.out_aval = self._infer_out_aval()
        self.out_aval = jax.tree_util.tree_map(
            compat.aval_from_shape_dtype, self.out_aval, is_leaf=is_leaf
        )
        self.out_avals_flat, self.out_tree = jax.tree_util.tree_flatten(self.out_aval)
        self._hash = hash(
            (
                type(self),
                tuple(sorted(self.params.items(), key=lambda kv: kv[0])),
                tuple(self.in_avals_flat),
                self.in_tree,
                tuple(self.out_avals_flat),
                self.out_tree,
            )
        )
        self.check(*self.in_avals)

    def _infer_out_aval(self):
        structs = [
            jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type)
            for a in self.in_avals_flat
        ]
        try:
            out = jax.eval_shape(lambda *a: self.expand(*self._unflatten_in(a)), *structs)
        except Exception as e:
            raise TypeError(
                f"{type(self).__name__}: could not infer `out_aval` by tracing `expand` ({e}); "
                "set self.out_aval in __init__"
            ) from e
        return out

    # ---- construction helpers --------------------------------------------------

    @classmethod
    def apply(cls, *args: Any, **params: Any) -> Any:
        """Build the primitive from the arguments' types and apply it.

        `Cls.apply(x, y, f=f)` is `Cls(jax.typeof(x), jax.typeof(y), f=f)(x, y)`, with
        `jax.typeof` mapped over pytree arguments: no wrapper function is needed.

        Arguments:
            *args: the positional (traced) arguments, pytrees of arrays.
            **params: static parameters.

        Returns:
            The primitive's output.
        """
        avals = tuple(jax.tree_util.tree_map(compat.typeof, a) for a in args)
        return cls(*avals, **params)(*args)

    def __call__(self, *args: Any) -> Any:
        leaves, tree = jax.tree_util.tree_flatten(args)
        if tree != self.in_tree:
            raise TypeError(
                f"{type(self).__name__} was built for arguments of structure {self.in_tree} "
                f"but was called with {tree}"
            )
        for i, (x, a) in enumerate(zip(leaves, self.in_avals_flat)):
            t = compat.typeof(x)
            if not compat.types_match(t, a):
                raise TypeError(
                    f"{type(self).__name__}: argument leaf {i} has type {t.str_short()} but the "
                    f"primitive was built for {a.str_short()}; build a new instance (e.g. with "
                    f"{type(self).__name__}.apply) for these argument types"
                )
        reused = _lookup_reuse(self, leaves)
        if reused is not None:
            out = reused
        else:
            out = compat.bind_prim(self, leaves)
        return jax.tree_util.tree_unflatten(self.out_tree, out)

    # ---- the rule vocabulary (override in subclasses) -------------------------

    def expand(self, *args: Any) -> Any:
        """The implementation, in ordinary JAX operations; used for evaluation and `jit`."""
        raise NotImplementedError(f"subclass {type(self).__name__} must implement `expand`")

    def vjp_fwd(self, nzs_in: Any, *args: Any) -> tuple[Any, Any]:
        """Reverse mode, forward pass: return `(self(*args), residuals)`.

        `nzs_in` holds one boolean per input leaf (same pytree as the inputs): False
        when that input is not differentiated, so its residuals can be skipped.
        """
        raise NotImplementedError(
            f"for grad support, subclass {type(self).__name__} must implement `vjp_fwd`"
        )

    def vjp_bwd(self, res: Any, g: Any, *accums: Any) -> None:
        """Reverse mode, backward pass with accumulators: call `acc.accum(ct)` per input."""
        cts = self.vjp_bwd_retval(res, g)
        if not isinstance(cts, tuple | list) or len(cts) != len(self.in_avals):
            raise TypeError(
                f"{type(self).__name__}.vjp_bwd_retval must return a tuple with one cotangent "
                f"per input ({len(self.in_avals)}), got {type(cts).__name__}"
                + (f" of length {len(cts)}" if isinstance(cts, tuple | list) else "")
            )
        for acc_tree, ct_tree in zip(accums, cts):
            accs, tree = jax.tree_util.tree_flatten(
                acc_tree, is_leaf=lambda x: isinstance(x, _Accum)
            )
            if ct_tree is None or isinstance(ct_tree, Zero):
                continue
            for acc, ct in zip(accs, tree.flatten_up_to(ct_tree)):
                acc.accum(ct)

    def vjp_bwd_retval(self, res: Any, g: Any) -> tuple[Any, ...]:
        """Reverse mode, backward pass: return one cotangent per input (None for zero)."""
        raise NotImplementedError(
            f"for grad support, subclass {type(self).__name__} must implement "
            "`vjp_bwd` or `vjp_bwd_retval`"
        )

    def vjp_bwd_batched(
        self,
        axis_size: int,
        in_dims: tuple[Any, ...],
        res: Any,
        res_dims: Any,
        g: Any,
        g_dims: Any,
    ) -> tuple[Any, ...] | None:
        """Optional: the backward pass for a whole `vmap` batch at once.

        Under the automatic batching rule, reverse mode maps `vjp_bwd_retval` over the
        batch and then sums the cotangents of the inputs the batch shares. A primitive
        that can do better (sum inside its own computation, say, instead of holding a
        cotangent per element) overrides this. It receives the batch size, the inputs'
        batch axes `in_dims` (None: shared by the batch), the residuals and the output
        cotangent `g` (which may hold `Zero`s) with their batch axes (None: the same for
        every element). It returns one cotangent per input (None for zero), with the
        batch axis first for a batched input and summed over the batch for a shared
        one, or None to fall back to the mapped `vjp_bwd_retval`.
        """
        return None

    def jvp(self, primals: tuple[Any, ...], tangents: tuple[Any, ...]) -> tuple[Any, Any]:
        """Forward mode: return `(self(*primals), output tangent)`; tangents may be `Zero`."""
        raise NotImplementedError(
            f"for jvp support, subclass {type(self).__name__} must implement `jvp`"
        )

    def lin(self, nzs_in: Any, *primals: Any) -> tuple[Any, Any]:
        """Linearization, primal part: return `(self(*primals), residuals)`."""
        raise NotImplementedError(
            f"for linearize support, subclass {type(self).__name__} must implement "
            "`lin` and `linearized`"
        )

    def linearized(self, residuals: Any, *tangents: Any) -> Any:
        """Linearization, linear part: map input tangents to the output tangent."""
        raise NotImplementedError(
            f"for linearize support, subclass {type(self).__name__} must implement "
            "`lin` and `linearized`"
        )

    def batch(self, axis_data: Any, args: tuple[Any, ...], dims: tuple[Any, ...]):
        """`vmap` rule with full control: return `(output, output batch dims)`."""
        raise NotImplementedError  # never called unless overridden

    def batch_dim_rule(self, axis_data: Any, dims: tuple[Any, ...]) -> Any:
        """`vmap` helper: return the output's batch dimension (default: 0)."""
        raise NotImplementedError  # never called unless overridden

    def transpose(self, out_ct: Any, *maybe_accums: Any) -> None:
        """Transposition for primitives linear in some inputs (not needed for derivatives)."""
        raise NotImplementedError(
            f"for transpose support, subclass {type(self).__name__} must implement `transpose`"
        )

    def check(self, *arg_tys: Any) -> None:
        """Optional hook to validate the argument types at construction."""
        return None

    # ---- identity ----------------------------------------------------------------

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        return (
            type(self) is type(other)
            and self._hash == other._hash
            and self.params == other.params
            and self.in_avals_flat == other.in_avals_flat
            and self.in_tree == other.in_tree
            and self.out_avals_flat == other.out_avals_flat
        )

    def __repr__(self):
        return f"{type(self).__name__}[{self.params}]"

    # ---- internals: pytree plumbing -----------------------------------------------

    def _caps(self) -> tuple[bool, bool, bool]:
        """(has jvp, has vjp, has lin) for this instance."""
        return type(self)._caps_cache

    def _unflatten_in(self, flat):
        return jax.tree_util.tree_unflatten(self.in_tree, list(flat))

    def _flatten_out(self, out, where):
        leaves, tree = jax.tree_util.tree_flatten(out)
        if tree != self.out_tree:
            raise TypeError(
                f"{type(self).__name__}.{where} returned a value of structure {tree}, "
                f"but out_aval has structure {self.out_tree}"
            )
        result = []
        for i, (x, a) in enumerate(zip(leaves, self.out_avals_flat)):
            if tuple(np.shape(x)) != tuple(a.shape):
                raise TypeError(
                    f"{type(self).__name__}.{where}: output leaf {i} has shape {np.shape(x)} "
                    f"but out_aval says {a.str_short()}"
                )
            if jnp.result_type(x) != a.dtype:
                x = jnp.asarray(x, a.dtype)
            result.append(x)
        return result

    def _flatten_out_tangents(self, t, where):
        """Output tangents (may hold None / Zero) -> flat list with zeros instantiated."""
        flat = self.out_tree.flatten_up_to(t)
        out = []
        for x, a in zip(flat, self.out_avals_flat):
            ta = compat.tangent_aval(a)
            if x is None or isinstance(x, Zero):
                out.append(compat.zeros_like_aval(ta))
            else:
                if tuple(np.shape(x)) != tuple(a.shape):
                    raise TypeError(
                        f"{type(self).__name__}.{where}: output tangent of shape "
                        f"{np.shape(x)} for an output of type {a.str_short()}"
                    )
                if not _is_float0(ta) and jnp.result_type(x) != ta.dtype:
                    x = jnp.asarray(x, ta.dtype)
                out.append(x)
        return out

    def _fill_tangents(self, nz_in, nz_tangents):
        """Full input tangents for a user rule: `Zero`s, or zero arrays unless
        the class sets `symbolic_zeros = True`."""
        it = iter(nz_tangents)
        make = Zero if self.symbolic_zeros else compat.zeros_like_aval
        flat = [
            next(it) if nz else make(compat.tangent_aval(a))
            for a, nz in zip(self.in_avals_flat, nz_in)
        ]
        return self._unflatten_in(flat)

    def _out_nz_default(self):
        return [not _is_float0(compat.tangent_aval(a)) for a in self.out_avals_flat]

    def _call_vjp_fwd(self, nz_in, primals_flat):
        nzs = self._unflatten_in(list(nz_in))
        ret = self.vjp_fwd(nzs, *self._unflatten_in(primals_flat))
        if not isinstance(ret, tuple) or len(ret) not in (2, 3):
            raise TypeError(
                f"{type(self).__name__}.vjp_fwd must return (output, residuals), "
                f"got {type(ret).__name__}"
            )
        out, res, *maybe_nzs = ret
        out_flat = self._flatten_out(out, "vjp_fwd")
        out_nz = self._out_nz_default()
        if maybe_nzs:
            given = jax.tree_util.tree_flatten(
                jax.tree_util.tree_map(lambda _, n: n, self.out_aval, maybe_nzs[0])
            )[0]
            out_nz = [a and bool(b) for a, b in zip(out_nz, given)]
        return out_flat, res, out_nz

    def _make_lin(self, nz_in, out_nz, res, primals_flat=None, out_flat=None):
        dyn, tree, static = _split_residuals(res)
        fwd = [] if primals_flat is None else [*primals_flat, *out_flat]
        rule = _PrimLin(self, nz_in, out_nz, tree, static, len(fwd))
        return rule, fwd + dyn

    def _tangents_from_lin(self, rule, res_flat, out_nz, tangents):
        nz_t = [t for t, nz in zip(tangents, rule.nz_in) if nz]
        outs = compat.bind_lin(rule, res_flat, nz_t) if rule.out_avals else []
        it = iter(outs)
        return [
            next(it) if nz else Zero(compat.tangent_aval(a))
            for a, nz in zip(self.out_avals_flat, out_nz)
        ]

    # ---- internals: rules called by _jax_compat -------------------------------------

    def _rule_impl(self, *args):
        return self._flatten_out(self.expand(*self._unflatten_in(args)), "expand")

    def _rule_abstract_eval(self):
        return list(self.out_avals_flat)

    def _rule_jvp(self, primals, tangents):
        has_jvp, has_vjp, _ = self._caps()
        if not has_jvp and not has_vjp:
            raise NotImplementedError(
                f"for jvp support, subclass {type(self).__name__} must implement `jvp`"
            )
        nz_in = [not isinstance(t, Zero) for t in tangents]
        if has_vjp:
            out_flat, res, out_nz = self._call_vjp_fwd(nz_in, primals)
        else:
            out_flat = jax.tree_util.tree_leaves(self(*self._unflatten_in(primals)))
            res, out_nz = None, self._out_nz_default()
        fwd = (primals, out_flat) if has_jvp else (None, None)
        rule, res_flat = self._make_lin(nz_in, out_nz, res, *fwd)
        return out_flat, self._tangents_from_lin(rule, res_flat, out_nz, tangents)

    def _rule_linearize(self, is_vjp, nz_in, *primals):
        has_jvp, has_vjp, has_lin = self._caps()
        name = type(self).__name__
        if is_vjp:
            if not has_vjp:
                if self.no_vjp_message:
                    raise NotImplementedError(self.no_vjp_message)
                raise NotImplementedError(
                    f"for grad support, subclass {name} must implement `vjp_fwd` and "
                    "`vjp_bwd_retval` (or `vjp_bwd`); a primitive with a `jvp` rule can "
                    "derive them with `vjp_fwd = vjp_fwd_from_jvp` and "
                    "`vjp_bwd_retval = transpose_jvp`"
                )
            out_flat, res, out_nz = self._call_vjp_fwd(nz_in, list(primals))
            rule, res_flat = self._make_lin(nz_in, out_nz, res)

            def linearized(residuals, *tangents):
                return self._tangents_from_lin(rule, residuals, out_nz, tangents)

            return out_flat, out_nz, res_flat, linearized
        if has_lin:
            nzs = self._unflatten_in(list(nz_in))
            ret = self.lin(nzs, *self._unflatten_in(primals))
            out, res = ret[0], ret[1]
            out_flat = self._flatten_out(out, "lin")
            out_nz = self._out_nz_default()

            def linearized(residuals, *tangents):
                t = self.linearized(residuals, *self._unflatten_in(tangents))
                flat = self.out_tree.flatten_up_to(t)
                return [
                    Zero(compat.tangent_aval(a))
                    if (not nz or x is None or isinstance(x, Zero))
                    else x
                    for x, a, nz in zip(flat, self.out_avals_flat, out_nz)
                ]

            out_nz = list(out_nz)
            return out_flat, out_nz, res, linearized
        if has_jvp:
            return compat.fallback_linearize(self, nz_in, primals)
        raise NotImplementedError(
            f"for linearize support, subclass {name} must implement `lin` and `linearized` "
            "(or `jvp`)"
        )

    def _rule_transpose(self, cts, args):
        if not _overrides(type(self), "transpose"):
            raise NotImplementedError(
                f"for transpose support, subclass {type(self).__name__} must implement `transpose`"
            )
        none = self.transpose(
            jax.tree_util.tree_unflatten(self.out_tree, cts), *self._unflatten_in(args)
        )
        if none is not None:
            raise TypeError(
                f"{type(self).__name__}.transpose must accumulate into the accumulators it is "
                "given for its linear inputs and return None"
            )

    def _rule_batch(self, axis_data, args, dims):
        cls = type(self)
        if all(d is None for d in dims):
            return compat.bind_prim(self, args), [None] * len(self.out_avals_flat)
        if _overrides(cls, "batch"):
            out, out_dims = self.batch(
                axis_data, tuple(self._unflatten_in(args)), self._unflatten_in(dims)
            )
            out_flat = self._flatten_out_batched(out)
            dims_flat = _broadcast_prefix(out_dims, self.out_tree)
            return out_flat, dims_flat
        dims_tree = self._unflatten_in(dims)
        out_dim = (
            self.batch_dim_rule(axis_data, dims_tree) if _overrides(cls, "batch_dim_rule") else 0
        )
        from ._vmap import VmapOf

        prim = VmapOf(self, axis_data, list(dims), out_dim)
        out = prim(*self._unflatten_in(args))
        return jax.tree_util.tree_leaves(out), list(prim.out_dims)

    def _flatten_out_batched(self, out):
        leaves, tree = jax.tree_util.tree_flatten(out)
        if tree != self.out_tree:
            raise TypeError(
                f"{type(self).__name__}.batch returned structure {tree}, expected {self.out_tree}"
            )
        return leaves


def _broadcast_prefix(prefix: Any, tree: Any) -> list[Any]:
    if prefix is None or isinstance(prefix, int):
        return [prefix] * tree.num_leaves
    return tree.flatten_up_to(prefix)


def _describe(v: Any) -> str:
    leaves = jax.tree_util.tree_leaves(v)
    return ", ".join(compat.typeof(x).str_short() for x in leaves if hasattr(x, "shape")) or repr(v)
