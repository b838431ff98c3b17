"""`check_grads`: derivative checks against finite differences and a reference, as a table.

This module owns the check itself: it turns the arguments into functions of their
floating-point leaves, draws directions, evaluates each node's finite differences,
jvps and vjps in one call, recurses to the derivative functions of higher orders, and
collects one row per comparison. The comparisons and default tolerances are in
`_compare`, the rows, the error and the table in `_report`.
"""

from __future__ import annotations

import inspect
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._compare import (
    FD,
    JVP,
    REFERENCE,
    _compare,
    _defaults_for,
    _inner,
    _least_precise,
    _random_like,
    _resolve_tol,
    _summarise,
    _to_np,
)
from ._report import GradCheckError, GradCheckRow, format_table

__all__ = ["check_grads", "GradCheckRow", "GradCheckError", "format_table"]


def _is_inexact(x: Any) -> bool:
    try:
        dtype = jnp.result_type(x)
    except TypeError:
        return False
    return bool(jnp.issubdtype(dtype, jnp.inexact))


def _inexact_leaves(tree: Any) -> list[jax.Array]:
    return [leaf for leaf in jax.tree_util.tree_leaves(tree) if _is_inexact(leaf)]


def _argument_names(f: Callable, nargs: int) -> list[str]:
    names = [f"args[{i}]" for i in range(nargs)]
    try:
        params = list(inspect.signature(f).parameters.values())
    except (TypeError, ValueError):
        return names
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    for i, p in enumerate(params[:nargs]):
        if p.kind not in positional:
            break
        names[i] = p.name
    return names


_Leaves = list[jax.Array]
_LeafFn = Callable[[_Leaves], _Leaves]


def _annotate(exc: BaseException, what: str) -> None:
    exc.add_note(f"implicitdiff.gradcheck.check_grads: while {what}")


def _jvp_fn(g: _LeafFn, n: int) -> _LeafFn:
    """(xs ++ ts) -> (g(xs) ++ J(xs) ts): the function the forward mode differentiates."""

    def gf(zs: _Leaves) -> _Leaves:
        y, t = jax.jvp(g, (list(zs[:n]),), (list(zs[n:]),))
        return [*y, *t]

    return gf


def _vjp_fn(g: _LeafFn, n: int) -> _LeafFn:
    """(xs ++ us) -> J(xs)^T us: the function the reverse mode differentiates."""

    def gr(zs: _Leaves) -> _Leaves:
        _, pull = jax.vjp(g, list(zs[:n]))
        (xbar,) = pull(list(zs[n:]))
        return list(xbar)

    return gr


def check_grads(
    f: Callable[..., Any],
    args: Sequence[Any],
    *,
    order: int = 2,
    modes: Sequence[str] = ("fwd", "rev"),
    atol: float | Mapping[str, float] | None = None,
    rtol: float | Mapping[str, float] | None = None,
    eps: float | None = None,
    reference: Callable[..., Any] | None = None,
    jit: bool = True,
    per_argument: bool = True,
) -> list[GradCheckRow]:
    """Check the derivatives of `f` at `args`, one argument at a time.

    For each argument with floating-point leaves (the others are held fixed; with
    ``per_argument=False``, for all of them at once) there is a random direction `v`
    for that argument and a random cotangent `u` for the output, standard normal and
    drawn from a seed that depends only on the argument's name and the check, so runs
    are reproducible and `f` and the reference see the same directions:

    - ``"fwd"``: the tangent of ``jax.jvp`` along `v` against the central finite
      difference ``(f(x + eps v) - f(x - eps v)) / (2 eps)``;
    - ``"rev"``: ``w = vjp(u)`` against the dot-product identity
      ``<u, J v> == <w, v>``, with ``J v`` taken from the jvp when ``"fwd"`` is also
      requested (row against ``"jvp"``), else from finite differences. A vjp obtained
      by transposing a wrong jvp (as for `jax.custom_jvp`) agrees with that jvp:
      the ``"fwd"`` rows are the ones that catch it;
    - with a `reference`: the same jvp and vjp of the reference, compared directly,
      plus one ``"value"`` row comparing ``f(*args)`` with ``reference(*args)``.

    Higher orders recurse on the derivative functions, as JAX's `check_grads` does:
    order 2 runs the same checks on ``(x, t) -> (f(x), J(x) t)`` (after ``"fwd"``)
    and on ``(x, u) -> J(x)^T u`` (after ``"rev"``), and so on; the mode column
    then reads e.g. ``"fwd-over-rev"``. (JAX feeds the primal output back in as
    the cotangent; here the cotangent is an input of its own, so the transposition
    of the backward pass is checked too.) Only the floating-point leaves of `f`'s
    output are compared: integer outputs such as iteration counts are ignored.
    Rows come in order: the value row, then for each argument its checks depth first.

    Arguments:
        f: the function; ``f(*args)`` returns a pytree of arrays.
        args: a tuple of pytrees, the point at which derivatives are checked.
        order: highest derivative order checked (>= 1).
        modes: any of ``"fwd"`` and ``"rev"``. For a `jax.custom_vjp` function, which
            has no forward mode, use ``("rev",)``.
        atol: absolute tolerance, either one number for every comparison or a mapping
            from ``"finite differences"``, ``"reference"``, ``"jvp"`` to a number (keys
            left out keep their default). A check passes when
            ``max|actual - expected| <= atol + rtol * max|expected|`` (for the
            dot-product identity, ``|<w, v> - <u, J v>| <= atol + rtol * sum|u| |J v|``).
            Defaults depend on the least precise floating dtype among the inputs and
            outputs of the function being differentiated, for atol and rtol alike:
            float64: 1e-5 against finite differences, 1e-8 against the reference or
            the jvp (these should agree to rounding and solver tolerance); float32:
            1e-2 and 1e-4; 16-bit floats: looser still.
        rtol: relative tolerance, given like `atol`.
        eps: finite-difference step along the standard-normal direction (default:
            1e-5 for float64, 1e-3 for float32, where truncation and rounding errors
            are both well below the default tolerances). For an iterative solver the
            finite-difference noise can reach solver tolerance / eps: solve tightly
            (as the built-in problems do), or raise `eps`.
        reference: an independent implementation of the same function (an unrolled
            solver, a closed form), called with the same arguments; its floating-point
            outputs must have the shapes of `f`'s.
        jit: evaluate each step's finite differences, jvps and vjps in one `jax.jit`
            call, and the value row in another (much faster for solvers, whose loops are
            compiled once per step instead of once per call). Pass False for a function
            that cannot be traced.
        per_argument: perturb one argument at a time, so that each row names the
            argument it checks (the default). False perturbs every argument at once,
            along one random direction (rows read ``"all"``): one evaluation, hence one
            compilation, per derivative function instead of one per argument, for a
            quicker but less specific check.

    Returns:
        The list of `GradCheckRow`s, when every check passes.

    Raises:
        GradCheckError: (an `AssertionError`) if any check fails; its message is the
            `format_table` of all rows, and its `rows` attribute holds them.
        TypeError: if no argument has a floating-point leaf.
        ValueError: for a bad `order` or `modes`, or a reference whose output does not
            match `f`'s.

    Example:
        ```python
        import jax, jax.numpy as jnp
        from implicitdiff.gradcheck import check_grads

        jax.config.update("jax_enable_x64", True)
        A = jnp.array([[3.0, 1.0], [1.0, 2.0]])
        b = jnp.array([1.0, -1.0])
        rows = check_grads(jnp.linalg.solve, (A, b), order=2,
                           reference=lambda A, b: jnp.linalg.inv(A) @ b)
        assert all(r.passed for r in rows)
        ```
    """
    if isinstance(modes, str):
        modes = (modes,)
    modes = tuple(modes)
    if not modes or any(m not in ("fwd", "rev") for m in modes):
        raise ValueError(f"modes must be a non-empty subset of ('fwd', 'rev'), got {modes!r}")
    if isinstance(order, bool) or not isinstance(order, int) or order < 1:
        raise ValueError(f"order must be an integer >= 1, got {order!r}")
    args = tuple(args)
    names = _argument_names(f, len(args))

    # Float leaves become JAX arrays (Python floats included); other leaves stay as given.
    flat_args = []
    for a in args:
        leaves, treedef = jax.tree_util.tree_flatten(a)
        leaves = [jnp.asarray(x) if _is_inexact(x) else x for x in leaves]
        flat_args.append((leaves, treedef))
    args = tuple(jax.tree_util.tree_unflatten(td, lv) for lv, td in flat_args)
    diff_args = [i for i, (lv, _) in enumerate(flat_args) if any(_is_inexact(x) for x in lv)]
    if not diff_args:
        raise TypeError(
            "check_grads: no argument has a floating-point leaf to perturb "
            f"(arguments {', '.join(names) or '()'} are all integer, boolean or empty)"
        )

    rows: list[GradCheckRow] = []
    maybe_jit = jax.jit if jit else (lambda fun: fun)

    def restrict(fun: Callable[..., Any], group: Sequence[int]) -> _LeafFn:
        """`fun` as a function of the float leaves of the arguments in `group`, in order."""
        pos = {i: [j for j, x in enumerate(flat_args[i][0]) if _is_inexact(x)] for i in group}

        def g(xs: _Leaves) -> _Leaves:
            it = iter(xs)
            call_args = list(args)
            for i in group:
                leaves, treedef = flat_args[i]
                new = list(leaves)
                for j in pos[i]:
                    new[j] = next(it)
                call_args[i] = jax.tree_util.tree_unflatten(treedef, new)
            return _inexact_leaves(fun(*call_args))

        return g

    def tolerances(dtype: np.dtype, against: str) -> tuple[float, float]:
        d = _defaults_for(dtype)
        default = d.fd_tol if against == FD else d.exact_tol
        return _resolve_tol(atol, against, default), _resolve_tol(rtol, against, default)

    if reference is not None:  # the value row

        def values() -> tuple[_Leaves, _Leaves]:
            return _inexact_leaves(f(*args)), _inexact_leaves(reference(*args))

        y, y_ref = (_to_np(v) for v in maybe_jit(values)())
        if [a.shape for a in y] != [a.shape for a in y_ref]:
            raise ValueError(
                "check_grads: the reference's floating-point outputs have shapes "
                f"{[a.shape for a in y_ref]}, f's have {[a.shape for a in y]}"
            )
        dtype = _least_precise([x.dtype for x in _inexact_leaves(args)] + [a.dtype for a in y])
        result = _compare(y, y_ref, *tolerances(dtype, REFERENCE))
        rows.append(GradCheckRow("all", "value", 0, REFERENCE, *result))

    def check_node(
        g: _LeafFn, g_ref: _LeafFn | None, xs: _Leaves, path: tuple[str, ...], label: str
    ) -> None:
        k = len(path) + 1
        # Jitted, `g` is traced once here: the finite differences, the jvp and the vjp below
        # (and the derivative functions of the next order) reuse its jaxpr instead of
        # running the Python of a solver again for each of them.
        g = maybe_jit(g)
        g_ref = None if g_ref is None else maybe_jit(g_ref)
        what = f"checking the order-{k} derivatives with respect to {label}"
        if path:
            what += f" (of the {'-over-'.join(reversed(path))} derivative function)"
        rng = np.random.default_rng(zlib.crc32(f"{label}|{'/'.join(path)}".encode()))
        vs = [_random_like(rng, x.shape, x.dtype) for x in xs]
        try:
            out_types = jax.eval_shape(g, xs)
        except Exception as e:
            _annotate(e, what)
            raise
        us = [_random_like(rng, y.shape, y.dtype) for y in out_types]
        dtype = _least_precise([x.dtype for x in xs] + [y.dtype for y in out_types])
        step = eps if eps is not None else _defaults_for(dtype).eps
        n = len(xs)

        def evaluate(xs: _Leaves, vs: _Leaves, us: _Leaves) -> dict[str, _Leaves]:
            """Everything this node compares, computed in one (jitted) call."""
            res = {
                "plus": g([x + step * v for x, v in zip(xs, vs, strict=True)]),
                "minus": g([x - step * v for x, v in zip(xs, vs, strict=True)]),
            }
            funs = {"": g} if g_ref is None else {"": g, "ref_": g_ref}
            for prefix, fun in funs.items():
                if "fwd" in modes:
                    res[prefix + "jvp"] = jax.jvp(fun, (xs,), (vs,))[1]
                if "rev" in modes:
                    _, pull = jax.vjp(fun, xs)
                    # conj(vjp(conj(u))) is the adjoint of the jvp for complex values too
                    res[prefix + "vjp"] = [jnp.conj(w) for w in pull([jnp.conj(u) for u in us])[0]]
            return res

        try:
            res = {key: _to_np(val) for key, val in maybe_jit(evaluate)(xs, vs, us).items()}
        except Exception as e:
            _annotate(e, what)
            raise
        fd = [(p - m) / (2 * step) for p, m in zip(res["plus"], res["minus"], strict=True)]

        def name(mode: str) -> str:
            return "-over-".join([mode, *reversed(path)])

        def add(mode: str, against: str, result: tuple[float, float, float, bool]) -> None:
            rows.append(GradCheckRow(label, name(mode), k, against, *result))

        if "fwd" in modes:
            add("fwd", FD, _compare(res["jvp"], fd, *tolerances(dtype, FD)))
            if g_ref is not None:
                add(
                    "fwd",
                    REFERENCE,
                    _compare(res["jvp"], res["ref_jvp"], *tolerances(dtype, REFERENCE)),
                )
        if "rev" in modes:
            # <u, J v> (from the jvp, or finite differences) against <J^T u, v>
            against, jv = (JVP, res["jvp"]) if "fwd" in modes else (FD, fd)
            ip, _ = _inner(_to_np(vs), res["vjp"])
            ip_expected, scale = _inner(jv, _to_np(us))
            add(
                "rev",
                against,
                _summarise(abs(ip - ip_expected), scale, *tolerances(dtype, against)),
            )
            if g_ref is not None:
                add(
                    "rev",
                    REFERENCE,
                    _compare(res["vjp"], res["ref_vjp"], *tolerances(dtype, REFERENCE)),
                )

        if k < order:
            if "fwd" in modes:
                check_node(
                    _jvp_fn(g, n),
                    None if g_ref is None else _jvp_fn(g_ref, n),
                    [*xs, *vs],
                    (*path, "fwd"),
                    label,
                )
            if "rev" in modes:
                check_node(
                    _vjp_fn(g, n),
                    None if g_ref is None else _vjp_fn(g_ref, n),
                    [*xs, *us],
                    (*path, "rev"),
                    label,
                )

    groups = [[i] for i in diff_args] if per_argument else [diff_args]
    for group in groups:
        g = restrict(f, group)
        g_ref = None if reference is None else restrict(reference, group)
        xs = [x for i in group for x in flat_args[i][0] if _is_inexact(x)]
        check_node(g, g_ref, xs, (), names[group[0]] if len(group) == 1 else "all")

    failed = [r for r in rows if not r.passed]
    if failed:
        raise GradCheckError(
            f"check_grads: {len(failed)} of {len(rows)} checks failed\n{format_table(rows)}", rows
        )
    return rows
