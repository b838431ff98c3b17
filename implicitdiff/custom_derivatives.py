"""Drop-in versions of ``jax.custom_jvp`` and ``jax.custom_vjp`` with a few extras.

Both subclass the JAX classes, so rules, ``symbolic_zeros``, pytrees and every transformation
behave as in JAX. Added: ``nondiff_argnames``; keyword arguments at call time; arrays/Tracers in
the nondiff positions of ``custom_vjp`` (passed to JAX as ordinary inputs, saved as residuals,
handed back to ``bwd`` nondiff-first); and a ``TypeError`` naming the shape/dtype of a
closed-over value that is being differentiated.

The closure check runs only when a jvp/grad trace is active at call time (a walk up the trace
chain, well under a microsecond otherwise). It then happens inside the single call JAX makes to
the primal or to the ``jvp``/``fwd`` rule (with JAX's own arguments, e.g. the ``perturbed`` flags
of ``symbolic_zeros``), so user code runs exactly as often as under ``jax.custom_jvp`` /
``jax.custom_vjp``. Where the call is recorded into a jaxpr (under ``jit``, ``scan``, ...), the
code is traced with `jax.make_jaxpr`, passing every array explicitly, so the jaxpr constants are
the closed-over values; one carrying a tangent is reported, and otherwise the jaxpr's equations
are replayed in place of the call. Where operations run eagerly, the code is called directly and
JAX's own leaked-tracer error is reworded. A closure over the inputs of a ``jit``/``checkpoint``
placed between the ``grad`` and the call looks like an ordinary constant there, so JAX's own
error is raised for it later.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax

from ._custom_base import _CustomBase, _is_array, _nondiff_positions

__all__ = ["custom_jvp", "custom_vjp"]

R = TypeVar("R")


class _Spec:
    """Static half of a call: the tree and non-array leaves of each nondiff argument."""

    def __init__(self, args: tuple, nondiff: tuple) -> None:
        self.n = len(args)
        self.parts: dict[int, tuple] = {}
        self.dynamic: list[Any] = []
        for i in (i for i in nondiff if i < self.n):
            leaves, tree = jax.tree_util.tree_flatten(args[i])
            mask = [_is_array(leaf) for leaf in leaves]
            self.dynamic += [leaf for leaf, m in zip(leaves, mask) if m]
            self.parts[i] = (tree, [None if m else leaf for leaf, m in zip(leaves, mask)], mask)

    def nondiff(self, dynamic: Sequence[Any]) -> list:
        """Rebuild the nondiff arguments, in order, from their traced leaves."""
        out, it = [], iter(dynamic)
        for tree, leaves, mask in self.parts.values():
            out.append(tree.unflatten([next(it) if m else x for x, m in zip(leaves, mask)]))
        return out

    def merge(self, dynamic: Sequence[Any], diff: Sequence[Any]) -> tuple:
        """Rebuild the full positional argument tuple."""
        nondiff, diff_it = iter(self.nondiff(dynamic)), iter(diff)
        return tuple(next(nondiff if i in self.parts else diff_it) for i in range(self.n))


class custom_jvp(_CustomBase, jax.custom_jvp[R]):
    """``jax.custom_jvp`` with ``nondiff_argnames``, keywords and a closure-error message.

    Arguments:
      fun: the primal function.
      nondiff_argnums: positions of non-differentiable arguments; they are passed first to the
        rule, ``jvp(*nondiff, primals, tangents)``. Arrays and Tracers are allowed there (JAX
        applies ``stop_gradient`` to them).
      nondiff_argnames: the same, given by parameter name.

    The decorated object is callable like ``fun`` and has ``defjvp(jvp, symbolic_zeros=False)``
    and ``defjvps(*jvps)``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> @custom_jvp
      ... def f(x, scale=2.0):
      ...     return scale * jnp.sin(x)
      >>> @f.defjvp
      ... def f_jvp(primals, tangents):
      ...     (x, scale), (dx, dscale) = primals, tangents
      ...     return f(x, scale), scale * jnp.cos(x) * dx + jnp.sin(x) * dscale
      >>> print(jax.grad(lambda x: f(scale=3.0, x=x))(0.0))
      3.0
    """

    _kind = "custom_jvp"
    _rule = "jvp"
    _jax_attrs = ("fun", "jvp", "nondiff_argnums", "symbolic_zeros")
    _jax_call = staticmethod(jax.custom_jvp.__call__)

    def __init__(
        self,
        fun: Callable[..., R],
        nondiff_argnums: Sequence[int] = (),
        nondiff_argnames: Sequence[str] = (),
    ) -> None:
        super().__init__(
            fun, nondiff_argnums=_nondiff_positions(fun, nondiff_argnums, nondiff_argnames)
        )
        self._setup(fun, nondiff_argnames)

    def __call__(self, *args: Any, **kwargs: Any) -> R:
        if not self.jvp:
            raise AttributeError(
                f"No JVP defined for custom_jvp function {self._name()} using defjvp."
            )
        args = self._resolve(args, kwargs)
        return self._call(self, args)


class custom_vjp(_CustomBase, jax.custom_vjp[R]):
    """``jax.custom_vjp`` that also takes arrays/Tracers in non-differentiable positions.

    Arguments:
      fun: the primal function.
      nondiff_argnums: positions of non-differentiable arguments, passed first to ``bwd`` as
        ``bwd(*nondiff, residuals, g)``. Static values (callables, shapes, strings) are kept in
        Python as in JAX; array leaves (jax/NumPy arrays, Tracers, also inside mixed pytrees) are
        passed to JAX as ordinary inputs with a zero cotangent and saved as extra residuals.
      nondiff_argnames: the same, given by parameter name.

    The decorated object is callable like ``fun`` and has
    ``defvjp(fwd, bwd, symbolic_zeros=False, optimize_remat=False)``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from functools import partial
      >>> @partial(custom_vjp, nondiff_argnames=("lo", "hi"))
      ... def clip_gradient(lo, hi, x):
      ...     return x
      >>> def fwd(lo, hi, x):
      ...     return x, None
      >>> def bwd(lo, hi, _, g):
      ...     return (jnp.clip(g, lo, hi),)
      >>> clip_gradient.defvjp(fwd, bwd)
      >>> grad = jax.jit(jax.grad(lambda x, lo, hi: 3.0 * clip_gradient(lo, hi, x)))
      >>> print(grad(1.0, -0.5, 0.5))
      0.5
    """

    _kind = "custom_vjp"
    _rule = "fwd"
    _jax_attrs = ("fun", "fwd", "bwd", "nondiff_argnums", "symbolic_zeros", "optimize_remat")
    _jax_call = staticmethod(jax.custom_vjp.__call__)

    def __new__(cls, *args: Any, **kwargs: Any) -> custom_vjp:
        # jax.custom_vjp.__new__ may hand back a different class under a config flag.
        return object.__new__(cls)

    def __init__(
        self,
        fun: Callable[..., R],
        nondiff_argnums: Sequence[int] = (),
        nondiff_argnames: Sequence[str] = (),
    ) -> None:
        super().__init__(
            fun, nondiff_argnums=_nondiff_positions(fun, nondiff_argnums, nondiff_argnames)
        )
        self._setup(fun, nondiff_argnames)
        self._dynamic_impl: jax.custom_vjp | None = None

    def defvjp(
        self,
        fwd: Callable,
        bwd: Callable,
        symbolic_zeros: bool = False,
        optimize_remat: bool = False,
    ) -> None:
        """Define the rule, exactly as `jax.custom_vjp.defvjp`.

        Arguments:
          fwd: ``fwd(*args) -> (out, residuals)``.
          bwd: ``bwd(*nondiff_args, residuals, g) -> tuple`` of cotangents for the other args.
          symbolic_zeros: pass ``CustomVJPPrimal`` leaves to ``fwd`` and symbolic zeros to bwd.
          optimize_remat: JAX's experimental remat optimisation flag.

        Example:
          >>> f = custom_vjp(lambda x: x ** 2)
          >>> f.defvjp(lambda x: (x ** 2, x), lambda x, g: (2 * x * g,))
          >>> print(jax.grad(f)(3.0))
          6.0
        """
        super().defvjp(fwd, bwd, symbolic_zeros=symbolic_zeros, optimize_remat=optimize_remat)
        self._dynamic_impl = None

    def _dynamic(self) -> jax.custom_vjp:
        """A jax.custom_vjp taking ``(spec, arrays, *diff_args)``; arrays are traced inputs."""
        if self._dynamic_impl is not None:
            return self._dynamic_impl
        user_fun, user_fwd, user_bwd = self.fun, self.fwd, self.bwd
        symbolic = self.symbolic_zeros

        def primal(spec: _Spec, arrays: list, *diff: Any) -> Any:
            return user_fun(*spec.merge(arrays, diff))

        def fwd(spec: _Spec, arrays: list, *diff: Any) -> tuple:
            if symbolic:
                arrays = [a.value for a in arrays]
            pair = user_fwd(*spec.merge(arrays, diff))
            if not isinstance(pair, tuple | list) or len(pair) != 2:
                raise TypeError(
                    f"Custom VJP fwd rule for {self._name()} must return a pair "
                    f"(primal output, residuals), got {pair!r}."
                )
            return pair[0], (arrays, pair[1])

        def bwd(spec: _Spec, saved: tuple, g: Any) -> tuple:
            arrays, res = saved
            cts = user_bwd(*spec.nondiff(arrays), res, g)
            if not isinstance(cts, tuple | list):
                raise TypeError(
                    f"Custom VJP bwd rule for {self._name()} must return a tuple "
                    f"with one cotangent per differentiable argument, got {cts!r}."
                )
            return (None, *cts)  # the nondiff arrays get no cotangent

        for wrapper, user in ((primal, user_fun), (fwd, user_fwd), (bwd, user_bwd)):
            wrapper.__name__ = getattr(user, "__name__", wrapper.__name__)
            wrapper.__qualname__ = getattr(user, "__qualname__", wrapper.__qualname__)
        impl = jax.custom_vjp(primal, nondiff_argnums=(0,))
        impl.defvjp(fwd, bwd, symbolic_zeros=symbolic, optimize_remat=self.optimize_remat)
        self._dynamic_impl = impl
        return impl

    def __call__(self, *args: Any, **kwargs: Any) -> R:
        if not self.fwd or not self.bwd:
            raise AttributeError(
                f"No VJP defined for custom_vjp function {self._name()} using defvjp."
            )
        args = self._resolve(args, kwargs)
        nd = self.nondiff_argnums
        if nd and any(
            _is_array(x) for i in nd if i < len(args) for x in jax.tree_util.tree_leaves(args[i])
        ):
            spec = _Spec(args, nd)
            diff = [x for i, x in enumerate(args) if i not in nd]
            return self._call(self._dynamic(), (spec, spec.dynamic, *diff))
        return self._call(self, args)
