"""Foreign calls: host (NumPy/SciPy/C) functions with JAX derivative and batching rules.

This is the JAX answer to a `torch.autograd.Function` that calls into another
system. One `Foreign` object bundles

- the host function, run with `jax.pure_callback` (so it works under `jit`); its
  positional arguments are arrays (pytrees of arrays), its keyword arguments are
  static, hashable parameters such as `dim`;
- the output types (`out`), needed because JAX cannot look inside the host code;
- derivative rules `defvjp(fwd, bwd)` and/or `defjvp(jvp)`, written in JAX (they
  may call other foreign functions, so higher-order derivatives work);
- a batching rule `defvmap(rule)`; without one, `vmap` maps the host call with
  `jax.pure_callback`'s `vmap_method` and keeps the derivative rules.

Every rule receives the static parameters as keyword arguments, like the host
function. With only a `jvp` rule, reverse mode transposes its tangent part, which
must then be linear JAX code (no foreign call); otherwise define `defvjp` too.

It is built on `implicitdiff.Primitive`: each call binds one primitive whose
`expand` is the `pure_callback`, whose `vjp_fwd`/`vjp_bwd_retval`/`jvp` are the
rules above and whose `batch` is the user's batching rule.

Example:
    ```python
    import jax, jax.numpy as jnp, numpy as np
    from implicitdiff.foreign import foreign, like

    @foreign(out=lambda x, dim: (x, like(x, int)))
    def np_sort(x, *, dim=-1):
        ind = np.argsort(x, axis=dim)
        return np.take_along_axis(x, ind, axis=dim), ind

    def fwd(x, *, dim):
        out = np_sort(x, dim=dim)
        return out, out[1]

    def bwd(ind, g, *, dim):  # scatter the cotangent back through the permutation
        return (jnp.put_along_axis(jnp.zeros_like(g[0]), ind, g[0], axis=dim, inplace=False),)

    np_sort.defvjp(fwd, bwd)
    x = jnp.array([3.0, 1.0, 2.0])
    print(jax.jit(jax.grad(lambda x: np_sort(x)[0] @ jnp.arange(3.0)))(x))  # [2. 0. 1.]
    ```
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from . import _jax_compat as compat
from ._derive import transpose_jvp, vjp_fwd_from_jvp
from ._primitive import Primitive, Zero, instantiate_zeros

__all__ = ["foreign", "Foreign", "like"]

_VMAP_METHODS = ("sequential", "sequential_unrolled", "expand_dims", "broadcast_all", None)


def like(x: Any, dtype: Any = None, shape: Any = None) -> jax.ShapeDtypeStruct:
    """The type of an array like `x` with another `dtype` and/or `shape`, for `out` functions.

    Arguments:
        x: anything with `.shape` and `.dtype` (an argument's type inside `out`).
        dtype: the dtype (default `x.dtype`); `int`/`float` mean JAX's default widths.
        shape: the shape (default `x.shape`).

    Returns:
        A `jax.ShapeDtypeStruct` whose dtype respects the `jax_enable_x64` setting.
    """
    dt = x.dtype if dtype is None else dtype
    return jax.ShapeDtypeStruct(
        tuple(x.shape if shape is None else shape), jax.dtypes.canonicalize_dtype(dt)
    )


class Foreign:
    """A host function with JAX derivative and batching rules; build it with `foreign`.

    Call it like the host function: positional arguments are arrays (pytrees of
    arrays), keyword arguments are static parameters. Attach rules with `defvjp`,
    `defjvp` and `defvmap`.
    """

    def __init__(self, fun: Callable, out: Any = None, *, vmap_method: str | None = "sequential"):
        if vmap_method not in _VMAP_METHODS:
            raise ValueError(f"vmap_method must be one of {_VMAP_METHODS}, got {vmap_method!r}")
        functools.update_wrapper(self, fun)
        self.fun, self.out, self.vmap_method = fun, out, vmap_method
        self.name = getattr(fun, "__name__", "foreign")
        self.fwd = self.bwd = self.jvp_rule = self.vmap_rule = None
        try:
            self._sig = inspect.signature(fun)
        except (TypeError, ValueError):  # builtins without a signature
            self._sig = None
        # Defaults are filled in for Python functions only (a ufunc's are not real keywords).
        self._defaults = self._sig is not None and inspect.isfunction(inspect.unwrap(fun))
        self._classes = {b: type(self.name, (_Batched if b else _Call,), {}) for b in (0, 1)}
        self._cache: dict[Any, Primitive] = {}

    def __repr__(self):
        return f"<foreign {self.name}>"

    # ---- rules ------------------------------------------------------------------

    def defvjp(self, fwd: Callable, bwd: Callable) -> None:
        """Set the reverse-mode rule (`grad`, `vjp`, `jacrev`).

        Arguments:
            fwd: `fwd(*args, **params) -> (output, residuals)`; `output` as the host
                function's (typically by calling this foreign function).
            bwd: `bwd(residuals, g, **params) -> tuple`, one cotangent per positional
                argument (None for zero or integer arguments); `g` has the output's
                structure, zeros for outputs that are not differentiated.
        """
        self.fwd, self.bwd = fwd, bwd
        self._cache.clear()

    def defjvp(self, jvp: Callable) -> Callable:
        """Set the forward-mode rule (`jvp`, `jacfwd`, `linearize`); usable as a decorator.

        Arguments:
            jvp: `jvp(primals, tangents, **params) -> (output, output tangent)`, with
                `primals`/`tangents` tuples of the positional arguments and their
                tangents (zeros where not differentiated). Output tangent leaves may be
                None for zero (e.g. for integer outputs). For reverse mode without
                `defvjp`, the tangent part is transposed, so it must be linear JAX code.

        Returns:
            `jvp`, unchanged.
        """
        self.jvp_rule = jvp
        self._cache.clear()
        return jvp

    def defvmap(self, rule: Callable) -> Callable:
        """Set the batching rule (`vmap`); usable as a decorator.

        Arguments:
            rule: `rule(axis_size, in_dims, *args, **params) -> (output, out_dims)`;
                `in_dims` holds one batch axis (int or None) per argument leaf, in the
                arguments' structure; `out_dims` is one int/None for every output, or
                one per output leaf in the output's structure. Negative axes count from
                the end. It usually calls this foreign function on the batched arrays.

        Returns:
            `rule`, unchanged.
        """
        self.vmap_rule = rule
        self._cache.clear()
        return rule

    # ---- application ------------------------------------------------------------

    def __call__(self, *args: Any, **params: Any) -> Any:
        kw, given = self._static_params(args, params)
        avals = tuple(jax.tree_util.tree_map(compat.typeof, a) for a in args)
        leaves, tree = jax.tree_util.tree_flatten(avals)
        key = (
            self.vmap_rule is not None or self.vmap_method is None,
            tuple(leaves),
            tree,
            kw,
            given,
        )
        prim = self._cache.get(key)
        if prim is None:
            prim = self._classes[key[0]](self, kw, given, avals)
            self._cache[key] = prim
        return prim(*args)

    def _static_params(self, args, params) -> tuple[tuple[tuple[str, Any], ...], tuple[str, ...]]:
        """Validated keyword parameters, plus the host function's hashable defaults for the
        ones not given (those reach the rules and `out`, not the host function)."""
        for k, v in params.items():
            leaves = jax.tree_util.tree_leaves(v)
            if any(isinstance(x, jax.Array | compat.Tracer | np.ndarray) for x in leaves):
                raise TypeError(
                    f"foreign function {self.name!r}: keyword argument {k!r} is an array; "
                    "keyword arguments are static parameters, pass arrays positionally"
                )
            try:
                hash(v)
            except TypeError:
                raise TypeError(
                    f"foreign function {self.name!r}: keyword argument {k!r} = {v!r} is not "
                    "hashable; static parameters must be hashable (use a tuple)"
                ) from None
        given, params = tuple(sorted(params)), dict(params)
        if self._sig is not None:
            try:
                self._sig.bind(*args, **params)
            except TypeError as e:
                raise TypeError(f"foreign function {self.name!r}: {e}") from None
        if self._defaults:
            P = inspect.Parameter
            for i, p in enumerate(self._sig.parameters.values()):
                named = p.kind is P.KEYWORD_ONLY or (
                    p.kind is P.POSITIONAL_OR_KEYWORD and i >= len(args)
                )
                if named and p.default is not P.empty and p.name not in params:
                    try:
                        hash(p.default)
                        params[p.name] = p.default
                    except TypeError:
                        pass
        return tuple(sorted(params.items())), given

    def _out_type(self, avals: tuple[Any, ...], kw: dict[str, Any]) -> Any:
        structs = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), avals)
        if self.out is None:
            out = structs[0] if structs else None
        elif callable(self.out):
            out = self.out(*structs, **kw)
        else:
            out = self.out
        is_leaf = lambda x: hasattr(x, "shape") and hasattr(x, "dtype")
        for x in jax.tree_util.tree_leaves(out, is_leaf=is_leaf):
            if not is_leaf(x):
                raise TypeError(
                    f"foreign function {self.name!r}: `out` must give a pytree of types with "
                    f"`.shape` and `.dtype` (e.g. jax.ShapeDtypeStruct), got a leaf {x!r}"
                )
        return jax.tree_util.tree_map(lambda x: like(x), out, is_leaf=is_leaf)


def foreign(
    fun: Callable | None = None, *, out: Any = None, vmap_method: str | None = "sequential"
) -> Any:
    """Wrap a host function (NumPy, SciPy, C...) as a JAX operation with custom rules.

    Arguments:
        fun: the host function `fun(*arrays, **params)`, taking and returning NumPy
            arrays (a pytree of them). Give its static parameters keyword-only.
        out: the output types: a function `out(*arg_types, **params)` of the
            arguments' `jax.ShapeDtypeStruct`s, or a fixed pytree of types; default:
            the type of the first argument. Host results are checked against it
            (shape exactly; dtype within the same kind, then cast).
        vmap_method: how `vmap` calls the host function when no `defvmap` rule is
            set (`jax.pure_callback`'s option): "sequential" (default, one call per
            batch element), "expand_dims" (one call, batched arrays get a leading
            axis, unbatched ones a leading axis of size 1: for host functions that
            broadcast over leading axes), "broadcast_all", "sequential_unrolled",
            or None (vmap then needs a `defvmap` rule).

    Returns:
        A `Foreign` (or, with `fun` omitted, a decorator that makes one).

    Example:
        ```python
        import jax, jax.numpy as jnp, scipy.special
        from implicitdiff.foreign import foreign

        digamma = foreign(scipy.special.digamma)
        gammaln = foreign(scipy.special.gammaln)
        gammaln.defjvp(lambda p, t: (gammaln(*p), digamma(*p) * t[0]))
        print(jax.grad(gammaln)(3.0))  # 0.9227843 (= digamma(3))
        ```
    """
    if fun is None:
        return lambda f: Foreign(f, out, vmap_method=vmap_method)
    return Foreign(fun, out, vmap_method=vmap_method)


class _Call(Primitive):
    """One application of a `Foreign`; subclassed per foreign function (named after it)."""

    def __init__(self, fn: Foreign, kw: tuple, given: tuple, avals: tuple):
        self.in_avals = avals
        self.params = dict(fn=fn, kw=kw, given=given)
        self.out_aval = fn._out_type(avals, dict(kw))
        super().__init__()

    def expand(self, *args):
        flat = jax.tree_util.tree_leaves(args)
        structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in self.out_avals_flat]
        host_kw = {k: v for k, v in self.kw if k in self.given}
        host = functools.partial(_host_call, self, host_kw)
        out = jax.pure_callback(host, structs, *flat, vmap_method=self.fn.vmap_method)
        return jax.tree_util.tree_unflatten(self.out_tree, out)

    def vjp_fwd(self, nzs_in, *args):
        fn = self.fn
        if fn.fwd is None:
            if fn.jvp_rule is not None:  # reverse mode by transposing the jvp rule
                return vjp_fwd_from_jvp(self, nzs_in, *args)
            raise NotImplementedError(
                f"foreign function {fn.name!r} has no derivative rule: call "
                f"{fn.name}.defvjp(fwd, bwd) for reverse mode (grad, vjp, jacrev) and/or "
                f"{fn.name}.defjvp(jvp) for forward mode (jvp, jacfwd)"
            )
        return tuple(fn.fwd(*args, **dict(self.kw)))

    def vjp_bwd_retval(self, res, g):
        fn = self.fn
        if fn.fwd is None:
            return transpose_jvp(self, res, g)
        g = self.out_tree.unflatten(
            instantiate_zeros(Zero(compat.tangent_aval(a)) if x is None else x)
            for x, a in zip(self.out_tree.flatten_up_to(g), self.out_avals_flat, strict=True)
        )
        cts = fn.bwd(res, g, **dict(self.kw))
        if not isinstance(cts, tuple | list) and len(self.in_avals) == 1:
            cts = (cts,)
        if not isinstance(cts, tuple | list) or len(cts) != len(self.in_avals):
            raise TypeError(
                f"the backward rule given to {fn.name}.defvjp must return a tuple with one "
                f"cotangent per positional argument ({len(self.in_avals)}), got "
                f"{type(cts).__name__}"
                + (f" of length {len(cts)}" if isinstance(cts, tuple | list) else "")
            )
        # integer / boolean inputs have no cotangent
        return tuple(
            None if all(compat.tangent_aval(a).dtype == jax.dtypes.float0 for a in leaves) else ct
            for ct, leaves in zip(cts, map(jax.tree_util.tree_leaves, self.in_avals), strict=True)
        )

    def jvp(self, primals, tangents):
        fn = self.fn
        if fn.jvp_rule is None:
            raise NotImplementedError(
                f"foreign function {fn.name!r} has no forward-mode rule (jax.jvp, jacfwd, "
                f"linearize, hessian): call {fn.name}.defjvp(jvp)"
            )
        return tuple(fn.jvp_rule(tuple(primals), tuple(tangents), **dict(self.kw)))


class _Batched(_Call):
    """A `Foreign` application with a user batching rule (or none, with vmap_method=None)."""

    def batch(self, axis_data, args, dims):
        fn = self.fn
        if fn.vmap_rule is None:
            raise NotImplementedError(
                f"foreign function {fn.name!r} was made with vmap_method=None and has no "
                f"batching rule: call {fn.name}.defvmap(rule) or choose a vmap_method"
            )
        out, out_dims = fn.vmap_rule(axis_data.size, tuple(dims), *args, **dict(self.kw))
        leaves, tree = jax.tree_util.tree_flatten(out)
        if tree != self.out_tree:
            raise TypeError(
                f"the batching rule given to {fn.name}.defvmap returned an output of "
                f"structure {tree}, expected {self.out_tree}"
            )
        if out_dims is None or isinstance(out_dims, int):
            out_dims = self.out_tree.unflatten([out_dims] * len(leaves))
        d_flat = [
            d if d is None else d % (a.ndim + 1)  # negative axes count from the end
            for d, a in zip(self.out_tree.flatten_up_to(out_dims), self.out_avals_flat, strict=True)
        ]
        for x, d, a in zip(leaves, d_flat, self.out_avals_flat, strict=True):
            want = compat.unmapped_aval(axis_data, d, a).shape
            if tuple(np.shape(x)) != tuple(want):
                raise TypeError(
                    f"the batching rule given to {fn.name}.defvmap returned an output of shape "
                    f"{np.shape(x)} with batch axis {d}; expected shape {tuple(want)}"
                )
        return out, self.out_tree.unflatten(d_flat)


def _host_call(prim: _Call, kw: dict[str, Any], *flat: Any) -> list[np.ndarray]:
    """Run the host function on NumPy arrays and check its results against `out`."""
    name = prim.fn.name
    flat = [np.asarray(x) for x in flat]
    # Under vmap_method="expand_dims"/"broadcast_all" the arrays carry leading batch axes.
    batch = np.broadcast_shapes(
        *(x.shape[: x.ndim - a.ndim] for x, a in zip(flat, prim.in_avals_flat, strict=True))
    )
    out = prim.fn.fun(*prim._unflatten_in(flat), **kw)
    leaves, tree = jax.tree_util.tree_flatten(out)
    if tree != prim.out_tree:
        raise TypeError(
            f"foreign function {name!r} returned a value of structure {tree}, but its `out` "
            f"types have structure {prim.out_tree}"
        )
    result = []
    for i, (x, a) in enumerate(zip(leaves, prim.out_avals_flat, strict=True)):
        x = np.asarray(x)
        want = (*batch, *a.shape)
        if x.shape != want or not np.can_cast(x.dtype, a.dtype, "same_kind"):
            raise TypeError(
                f"foreign function {name!r} returned output {i} of shape {x.shape} and dtype "
                f"{x.dtype}, but its `out` types say shape {want} and dtype {a.dtype}"
            )
        result.append(x.astype(a.dtype, copy=False))
    return result
