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

from collections.abc import Callable, Hashable
from typing import Any, ClassVar

import jax

from . import _derive
from . import _jax_compat as compat
from ._jax_compat import Zero, instantiate_zeros
from ._rule_data import Accum, NullAccum, Static, describe_values, lookup_reuse
from ._rules import PrimitiveRules

__all__ = ["Primitive", "Zero", "instantiate_zeros", "NullAccum", "Static"]


# ---------------------------------------------------------------------------
# The public base class.


class Primitive(PrimitiveRules):
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
    #: Builds the primitive that maps an instance without a batching rule over one `vmap`
    #: axis: `VmapOf`, a subclass defined (and registered here) by `implicitdiff._vmap`.
    _default_batching: ClassVar[Callable[..., Primitive] | None] = None

    @classmethod
    def _defines(cls, name: str) -> bool:
        """Whether this class overrides the rule `name` of `Primitive`."""
        return getattr(cls, name) is not getattr(Primitive, name)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.jvp is _derive.jvp_from_lin and cls.lin is _derive.linearize_from_jvp:
            raise TypeError(
                f"{cls.__name__} derives `jvp` from `lin` (jvp_from_lin) and `lin` from "
                "`jvp` (linearize_from_jvp): that is a circle. Write one of them by hand."
            )
        if cls._defines("vjp_bwd") and cls._defines("vjp_bwd_retval"):
            raise TypeError(
                f"{cls.__name__} defines both `vjp_bwd` and `vjp_bwd_retval`; define one"
            )
        cls._caps_cache = (
            cls._defines("jvp"),
            cls._defines("vjp_fwd") and (cls._defines("vjp_bwd") or cls._defines("vjp_bwd_retval")),
            cls._defines("lin") and cls._defines("linearized"),
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
                    f"({describe_values(v)}). Parameters are baked into the primitive when it is "
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
        reused = lookup_reuse(self, leaves)
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
                acc_tree, is_leaf=lambda x: isinstance(x, Accum)
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
