"""`odeint`: a drop-in for `jax.experimental.ode.odeint` with every derivative mode.

`odeint(func, y0, t, *args)` integrates `dy/dt = func(y, t, *args)` and returns the
solution at every `t[i]`. Internally the state is one flat vector and the solve is one
`implicitdiff.Primitive` (`solvers.ode.solve.ODESolve`): forward sensitivities in
forward mode, the adjoint object's rules in reverse mode.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from implicitdiff import error_if
from implicitdiff.internal import closure_convert
from implicitdiff.linear_solve import (
    Dense,
    LinearSolver,
    Sparse,
    SparsityPattern,
    sparsity_pattern,
)
from implicitdiff.linear_solve import resolve as resolve_linear_solver

from .._checks import not_in_checked_shard_map, static_bool, static_int, status_returned
from .adjoints import AbstractAdjoint, BacksolveAdjoint, resolve_adjoint
from .fields import FlatField
from .loop import LoopConfig
from .mass import MassMatrix, consistent_state
from .methods import METHODS, AbstractMethod, resolve_method
from .solution import ODESolution, step_polynomials
from .solve import Config, ODESolve

__all__ = ["odeint", "positive"]


def odeint(
    func: Callable[..., Any],
    y0: Any,
    t: Any,
    *args: Any,
    rtol: float = 1.4e-8,
    atol: float = 1.4e-8,
    mxstep: float = jnp.inf,
    hmax: float = jnp.inf,
    method: str | AbstractMethod = "dopri5",
    dt: float | None = None,
    adjoint: str | AbstractAdjoint | None = None,
    max_steps: int = 4096,
    throw: bool = True,
    return_info: bool = False,
    progress: bool = False,
    dense: bool = False,
    interpolate: bool = False,
    jac: Callable[..., Any] | None = None,
    linear_solver: str | LinearSolver | None = None,
    mass_matrix: Any = None,
    consistent_y0: bool = True,
) -> Any:
    """Integrate `dy/dt = func(y, t, *args)` from `y(t[0]) = y0`; output at every `t[i]`.

    Called like `jax.experimental.ode.odeint` (same positional arguments, defaults and
    output layout), with every derivative mode: `grad`, `jvp`/`jacfwd` (forward
    sensitivities), `hessian`, `vmap`, `jit`; `func` may close over traced values and
    `args` may hold integers.

    Arguments:
        func: the vector field `func(y, t, *args)`, returning a pytree like `y`.
        y0: the initial state, a pytree of floating-point or complex arrays. With
            complex arrays, the implicit methods integrate a real system: the real
            parts of every leaf and the imaginary parts of the complex ones
            (tolerances apply to each part):
            the Jacobian of a field that is not holomorphic in `y` (one with `|y|` or
            `conj(y)`) is only real-linear, and the stage solves and the implicit
            derivatives need the whole of it.
        t: 1-D array of strictly increasing times; `t[0]` is the initial time.
        *args: extra arguments of `func` (differentiated when floating point).
        rtol: relative tolerance of the adaptive methods.
        atol: absolute tolerance of the adaptive methods.
        mxstep: the most step attempts between two consecutive output times.
        hmax: the largest step size.
        method: a method object from `solvers.ode.methods` or its name:
            `"dopri5"` (default), `"tsit5"`, `"bosh3"`, `"dopri8"` (explicit
            adaptive), `"rodas5p"` (adaptive Rosenbrock for stiff problems: one
            Jacobian and one factorisation per step, no iteration), `"kvaerno5"`
            (adaptive ESDIRK for stiff problems; its stage equations are solved by
            Newton's method), `"radau5"` (Radau IIA of order 5, the three stages
            solved together), `"bdf"` (variable-order NDF/BDF reusing one
            factorisation over many steps: large stiff systems), or
            `"rk4"`/`"euler"` (fixed step `dt`); see `solvers.ode.methods.METHODS`
            for every registered name.
            Every method steps exactly onto each `t[i]` unless `interpolate=True`.
        dt: the step of `"rk4"` and `"euler"` (required for them); steps are
            shortened to land on each `t[i]`.
        adjoint: how reverse mode runs: an adjoint object from `solvers.ode` or its
            name. `BacksolveAdjoint()` (`"backsolve"`: the continuous adjoint
            integrated backwards together with the state, as JAX does; any order;
            memory does not grow with the number of steps) or
            `CheckpointAdjoint(max_steps=...)` (`"checkpoint"`: the exact gradient of
            the computed solution, replaying the recorded steps from checkpoints;
            usually faster; once in reverse mode, any order in forward mode). The
            default (`None`) is `"backsolve"` for the explicit methods, as
            `jax.experimental.ode.odeint` (`"checkpoint"` with complex parameters
            and a real state, which `"backsolve"` refuses: its adjoint ODE has no
            room for their imaginary parts), and `"checkpoint"` for the implicit ones:
            the state of a stiff problem cannot be integrated backwards (its decaying
            modes grow), and `"backsolve"` raises an error when the state it
            integrates backwards strays from the forward solution (by more than 1000
            tolerances over an output interval), which also catches strongly damped
            and chaotic problems.
        max_steps: with `dense=True`, the most steps kept; with the name
            `adjoint="checkpoint"`, also the most steps recorded (as
            `CheckpointAdjoint(max_steps=max_steps)`, which sets the memory: every
            step's start for a small system, else checkpoints of the state every
            `m` steps and the latest `m` steps' starts, `m` up to 512 within 2^23
            numbers and at least about `sqrt(max_steps)`).
        throw: raise at run time when the solve fails (`mxstep` exceeded, non-finite
            state, step size underflow) or its gradient cannot be trusted; with
            `throw=False` (which needs `return_info=True`) the status is in the info,
            the rows of the output not reached are NaN, and so is a gradient that
            cannot be trusted.
        return_info: also return an `ODEInfo`.
        progress: print the time reached while solving (for long solves).
        dense: return an `ODESolution` to evaluate anywhere in the span instead of
            the values at `t`; `t` is then the span `[t0, t1]`. Every accepted step
            is kept (at most `max_steps`); between steps the solution is the method's
            own interpolant (Dopri5, Tsit5, Dopri8) or a cubic Hermite one.
            Derivatives with respect to `y0` and `args` work in every mode; the span
            itself is not differentiated.
        interpolate: step freely to `t[-1]` and evaluate the other output times
            with the interpolant of the step holding each (the same interpolant as
            `dense=True`), as `jax.experimental.ode.odeint` and diffrax do, instead
            of stepping onto every `t[i]`. Many output times then cost no extra
            steps (a neural ODE fitted to a sampled trajectory); the outputs carry
            the interpolant's error, so they are a little less accurate than step
            ends. Forward mode and `adjoint="checkpoint"` give the exact derivative
            of these outputs; `"backsolve"` the continuous adjoint, as always.
        jac: the Jacobian of `func` with respect to `y`, `jac(y, t, *args)`, an
            `(n, n)` array on the flattened state (`jax.flatten_util.ravel_pytree`
            order; for an array `y` of shape `s`, shape `s + s` also works). It
            replaces automatic differentiation of `func` in `y` everywhere: the
            implicit methods' stage matrices, forward sensitivities and adjoints.
            Derivatives in `t` and `args` still differentiate `func`. Default:
            automatic differentiation.
        linear_solver: how an implicit method (`"rodas5p"`, `"rodas4"`, `"kvaerno5"`,
            `"radau5"`, `"bdf"`) solves with its stage matrix `I - h gamma J`: a solver from
            `implicitdiff.linear_solve` or its name: `Dense()` (LU on the matrix
            built from `n` Jacobian-vector products; the default), `Banded(lower,
            upper)` (a band built from `lower + upper + 1` products, for
            semi-discretised PDEs and other locally coupled systems of hundreds of
            states and more), `Sparse(pattern)` (any sparsity pattern, e.g. from
            `linear_solve.sparsity_pattern`: a few products by column colouring,
            band LU after reordering), or `"gmres"`/`"bicgstab"` (matrix-free, for
            very large systems). Build it with `throw=False`, as the default is: a
            singular stage matrix then rejects the step instead of raising. The
            default is `Dense` up to `SPARSE_STAGE_MIN_STATES` (100) states; above,
            `Sparse` on the pattern of the Jacobian traced from the operations of
            `func` (`linear_solve.sparsity_pattern(..., method="trace")` with `t`
            and `args` unknown, so that it holds at every time, and the mass
            matrix's entries) when that pattern has a narrow band after
            reordering, else `Dense`, which warns above `DENSE_STAGE_MAX_STATES`
            (1000) states (and with `jac` given).
        mass_matrix: the constant matrix `M` of a differential-algebraic system `M
            y' = func(y, t, *args)`, `(n, n)` or its diagonal `(n,)` on the flattened
            state (as `jac`), a concrete array (complex allowed for a complex
            state, whose real and imaginary parts it couples). A singular `M` makes algebraic
            equations: `0 = func_i` for a zero row `i`, `L func = 0` for the left null
            vectors `L` of a full `M`. The system must be of index 1 (the algebraic
            equations determine the unknowns along `M`'s null space). For `"radau5"`,
            `"rodas5p"`, `"rodas4"` and `"bdf"`; every derivative mode but
            `"backsolve"` and the derivative with respect to `t`; `dense=True` with the
            methods that have their own interpolant (not `"bdf"`). A structured
            `linear_solver` must hold `M`'s entries in its band or pattern (a diagonal
            `M` always fits). Default: `None`, an ODE.
        consistent_y0: with `mass_matrix`, first move the algebraic unknowns of `y0`
            (along `M`'s null space) so that the algebraic equations hold at `t[0]`,
            by Newton's method on them (`solvers.root`, with automatic derivatives of
            `func`; its own derivatives are implicit, so the solution's derivative
            with respect to `y0` keeps the constraints); the differential unknowns
            are kept. `False` takes `y0` as it is (the first step then moves the
            algebraic unknowns onto their equations).

    Returns:
        The solution, a pytree like `y0` with a leading axis of length `len(t)`, or
        an `ODESolution` when `dense`; `(solution, info)` when `return_info`.

    Example:
        ```python
        import jax, jax.numpy as jnp
        from solvers import odeint

        def decay(y, t, k):
            return -k * y

        ts = jnp.linspace(0.0, 1.0, 3)
        ys = odeint(decay, 1.0, ts, 2.0)          # exp(-2 t)
        dk = jax.grad(lambda k: odeint(decay, 1.0, ts, k)[-1])(2.0)  # -exp(-2)
        ```
    """
    name = "odeint"
    if not callable(func):
        raise TypeError(f"odeint: `func` must be callable as func(y, t, *args), got {func!r}")
    m = resolve_method(name, method)
    rtol = positive(name, "rtol", rtol)
    atol = positive(name, "atol", atol)
    mxstep = positive(name, "mxstep", mxstep)
    hmax = positive(name, "hmax", hmax)
    max_steps = static_int(name, "max_steps", max_steps, minimum=1)
    static_bool(name, "throw", throw)
    not_in_checked_shard_map(name)
    static_bool(name, "return_info", return_info)
    status_returned(name, throw, return_info)
    static_bool(name, "progress", progress)
    static_bool(name, "dense", dense)
    static_bool(name, "interpolate", interpolate)
    static_bool(name, "consistent_y0", consistent_y0)
    if dense and interpolate:
        raise ValueError(
            "odeint: `dense=True` already returns the interpolant over the whole span; "
            "pass either dense=True or interpolate=True, not both"
        )
    m = _with_linear_solver(m, linear_solver)
    if jac is not None and not callable(jac):
        raise TypeError(f"odeint: `jac` must be callable as jac(y, t, *args), got {jac!r}")
    adjoint_given = adjoint
    adjoint = resolve_adjoint(name, adjoint, m, max_steps)
    if isinstance(adjoint, BacksolveAdjoint) and getattr(
        getattr(m, "linear_solver", None), "layout_bound", False
    ):
        raise ValueError(
            "odeint: adjoint='backsolve' integrates the state, its adjoint and the "
            "parameters' adjoint together, a system that the "
            f"{type(m.linear_solver).__name__} stage solver built for the state alone "
            "does not fit. Use adjoint='checkpoint' (the default of the implicit "
            "methods), which solves with the same structured solver."
        )
    if m.adaptive:
        if dt is not None:
            raise ValueError(
                f"odeint: `dt` is for the fixed-step methods {_names(False)}; method={m.name!r} "
                "chooses its own steps (use `rtol`/`atol`, or `hmax` to cap them)"
            )
    else:
        if dt is None:
            raise ValueError(
                f"odeint: method={m.name!r} takes fixed steps: pass the step size `dt=` "
                f"(or use an adaptive method: {_names(True)})"
            )
        dt = positive(name, "dt", dt)

    leaves = jax.tree_util.tree_leaves(y0)
    if not leaves:
        raise TypeError("odeint: `y0` must contain at least one array")
    for leaf in leaves:
        if not jnp.issubdtype(jnp.result_type(leaf), jnp.inexact):
            raise TypeError(
                "odeint: `y0` must hold floating-point or complex arrays, got dtype "
                f"{jnp.result_type(leaf)}; pass e.g. `jnp.asarray(y0, float)`"
            )
    y_flat, unravel = ravel_pytree(y0)
    if m.implicit and jnp.iscomplexobj(y_flat):
        y_flat, unravel, func, mass_matrix = real_form(
            name, m, y0, y_flat, unravel, func, jac, mass_matrix
        )
    m = _with_mass_matrix(m, mass_matrix, y_flat.size, adjoint, dense)
    if linear_solver is None and not isinstance(adjoint, BacksolveAdjoint):
        m = _default_stage_solver(
            m, lambda v, s, *a: func(unravel(v), s, *a), y_flat, (t[0], *args), jac is not None
        )
    tdt = jnp.finfo(y_flat.dtype).dtype
    t = _check_times(t, tdt)
    if dense and t.shape[0] != 2:
        raise ValueError(
            f"odeint: with dense=True, `t` is the span [t0, t1] (2 times), got {t.shape[0]} "
            "times; evaluate the returned ODESolution at the times you need"
        )

    # Trace `func` once: to check what it returns, and to hoist the traced values it
    # closes over so that they become differentiated inputs of the primitive.
    if jac is None:
        f_conv, consts, _ = closure_convert(lambda y, s, *a: func(y, s, *a), y0, t[0], *args)
        jac_conv = None
    else:
        # One conversion for both, so that they share the hoisted values; each use
        # keeps only its own half of the traced pair.
        both, consts, _ = closure_convert(
            lambda y, s, *a: (func(y, s, *a), jac(y, s, *a)), y0, t[0], *args
        )
        f_conv = lambda c, y, s, *a: both(c, y, s, *a)[0]  # noqa: E731
        jac_conv = lambda c, y, s, *a: both(c, y, s, *a)[1]  # noqa: E731
        _check_jac(jax.eval_shape(jac_conv, consts, y0, t[0], *args), y_flat)
    out = jax.eval_shape(f_conv, consts, y0, t[0], *args)
    _check_field(out, y_flat)
    if getattr(m, "mass_matrix", None) is not None and consistent_y0:

        def field0(v):
            return ravel_pytree(func(unravel(v), t[0], *args))[0].astype(v.dtype)

        y_flat = consistent_state(field0, y_flat, m.mass_matrix, throw=throw)

    params, ptree = jax.tree_util.tree_flatten((list(consts), args))
    params = [jnp.asarray(p) for p in params]
    is_diff = tuple(jnp.issubdtype(p.dtype, jnp.inexact) for p in params)
    pd = tuple(p for p, d in zip(params, is_diff) if d)
    pn = tuple(p for p, d in zip(params, is_diff) if not d)
    complex_params = not jnp.iscomplexobj(y_flat) and any(jnp.iscomplexobj(p) for p in pd)
    if complex_params and isinstance(adjoint, BacksolveAdjoint):
        if adjoint_given is not None:
            raise ValueError(
                "odeint: adjoint='backsolve' with complex differentiated parameters (in "
                "`args` or closed over by `func`) and a real state (or a complex one that "
                "an implicit method integrates as its real and imaginary parts): the "
                "adjoint ODE carries the parameters' adjoint in the state's real dtype, "
                "which has no room for its imaginary part. Use adjoint='checkpoint', or "
                "pass the parameters as their real and imaginary parts."
            )
        # The method's default cannot take them; the checkpointed adjoint can.
        adjoint = resolve_adjoint(name, "checkpoint", m, max_steps)
    field = FlatField(f_conv, unravel, ptree, is_diff, y_flat.dtype, jac_conv)
    loop = LoopConfig(
        method=m,
        rtol=rtol,
        atol=atol,
        mxstep=mxstep,
        hmax=hmax,
        dt=dt,
        progress=progress,
        dense=max_steps if dense else 0,
        interpolate=interpolate,
    )
    cfg = Config(loop=loop, adjoint=adjoint, throw=throw, info=return_info)
    ys, info, t_nodes = ODESolve.apply(y_flat, t, pd, pn, f=field, cfg=cfg)
    out = jax.vmap(unravel)(ys)
    if dense:
        flat_f = lambda y, s, params: field(y, s, *params)  # noqa: E731
        num_steps = jnp.sum(t_nodes < t_nodes[-1]).astype(jnp.int32)
        coeffs = step_polynomials(m, flat_f, ys, t_nodes, (pd, pn), num_steps)
        out = ODESolution(
            ts=t_nodes,
            ys=out,
            coeffs=jax.vmap(jax.vmap(unravel))(coeffs),
            num_steps=num_steps,
        )
    if return_info:
        return out, info
    return out


def real_form(name, method, y0, y_flat, unravel, func, jac, mass_matrix):
    """A complex state for an implicit method, as the real system of its real and
    imaginary parts: `(y_flat, unravel, func, mass_matrix)` for the flat real state
    `[Re y, Im y]`, where `Im y` holds the entries of the complex leaves of `y0` only (a
    real leaf of a mixed pytree has no imaginary part to integrate). `unravel` gives
    back the complex pytree, and `func` takes it and returns `(Re f, Im f)` in the same
    layout. A field that is not holomorphic (`|y|**2 y`, `conj(y)`) has a Jacobian that
    is only real-linear: a complex matrix built from its products with the real unit
    vectors would be wrong, and with it the stage solves and the implicit derivatives."""
    if jac is not None:
        raise ValueError(
            f"{name}: `jac` with a complex state: method={method.name!r} integrates the "
            "real and imaginary parts as a real system, whose Jacobian a complex matrix "
            "gives only for a holomorphic field. Leave `jac` out (the Jacobian then comes "
            "from `func` by automatic differentiation), or pass the state as its real "
            "and imaginary parts."
        )
    if getattr(method, "mass_matrix", None) is not None:
        raise ValueError(
            f"{name}: a complex state with a `mass_matrix` set on the method object: pass "
            "the matrix as odeint(mass_matrix=...) instead, which takes it for the "
            "complex state and applies it to the real and imaginary parts"
        )
    n = y_flat.shape[0]
    # Which flat entries belong to complex leaves: those have an imaginary part.
    leaves = jax.tree_util.tree_leaves(y0)
    is_complex = np.concatenate(
        [np.full(np.size(x), jnp.iscomplexobj(x), dtype=bool) for x in leaves]
    )
    imag_rows = None if is_complex.all() else np.flatnonzero(is_complex)
    size = n + int(is_complex.sum())
    solver = getattr(method, "linear_solver", None)
    if getattr(solver, "layout_bound", False):
        raise ValueError(
            f"{name}: linear_solver={type(solver).__name__}(...) with a complex state: "
            f"method={method.name!r} integrates the real and imaginary parts as a real "
            f"system of {size} unknowns, which the band or pattern given for the {n} "
            "complex ones does not describe. Leave `linear_solver` out (above 100 states "
            "the default traces the real system's pattern), or pass the state as its real "
            "and imaginary parts with a band or pattern for them."
        )

    def imag_part(v):
        return v.imag if imag_rows is None else v.imag[imag_rows]

    def unravel_real(v):
        im = v[n:] if imag_rows is None else jnp.zeros(n, v.dtype).at[imag_rows].set(v[n:])
        return unravel(jax.lax.complex(v[:n], im))

    def func_real(y, t, *args):
        out = func(y, t, *args)
        return jax.tree_util.tree_map(jnp.real, out), imag_part(ravel_pytree(out)[0])

    if mass_matrix is not None and not isinstance(mass_matrix, jax.core.Tracer):
        mm = np.asarray(mass_matrix)
        if mm.shape not in ((n,), (n, n)):
            raise ValueError(
                f"{name}: `mass_matrix` must be ({n}, {n}) or its diagonal ({n},) for the "
                f"{n} unknowns of the complex state, got shape {mm.shape}"
            )
        rows = slice(None) if imag_rows is None else imag_rows
        if mm.ndim == 1 and not np.iscomplexobj(mm):
            mass_matrix = np.concatenate([mm, mm[rows]])
        else:
            mm = np.diag(mm) if mm.ndim == 1 else mm
            mass_matrix = np.block(
                [[mm.real, -mm.imag[:, rows]], [mm.imag[rows], mm.real[rows][:, rows]]]
            )
    return jnp.concatenate([y_flat.real, imag_part(y_flat)]), unravel_real, func_real, mass_matrix


def _check_field(out: Any, y_flat: Any) -> None:
    """Like JAX's odeint, `func` may return any pytree with as many numbers as `y0`
    (both are flattened); anything else is an error naming `func`."""
    leaves = jax.tree_util.tree_leaves(out)
    size = sum(int(np.prod(leaf.shape)) for leaf in leaves)
    if size != y_flat.shape[0] or not all(
        jnp.issubdtype(leaf.dtype, jnp.inexact) for leaf in leaves
    ):
        desc = [f"{leaf.dtype}{list(leaf.shape)}" for leaf in leaves]
        raise TypeError(
            f"odeint: `func(y0, t[0], *args)` must return floating-point arrays with "
            f"as many numbers as `y0` ({y_flat.shape[0]}, usually the same pytree), got "
            f"{desc}"
        )


def _check_jac(out: Any, y_flat: Any) -> None:
    n = y_flat.shape[0]
    leaves = jax.tree_util.tree_leaves(out)
    if (
        len(leaves) != 1
        or int(np.prod(leaves[0].shape)) != n * n
        or not jnp.issubdtype(leaves[0].dtype, jnp.inexact)
    ):
        desc = [f"{leaf.dtype}{list(leaf.shape)}" for leaf in leaves]
        raise TypeError(
            f"odeint: `jac(y0, t[0], *args)` must return one floating-point array of "
            f"shape ({n}, {n}), the Jacobian of `func` on the flattened state, got {desc}"
        )


#: Above this many states, an implicit method left to its default stage solver solves
#: with the sparsity pattern traced from `func` (`linear_solve.Sparse`) when it has a
#: narrow band: the matrix then costs a few coloured products instead of `n`.
SPARSE_STAGE_MIN_STATES = 100
#: Above this many states, a default stage solve that stays dense warns.
DENSE_STAGE_MAX_STATES = 1000
#: The default sparse stage solver is used when the reordered band holds at most this
#: fraction of the unknowns. Past it the row-by-row band LU is no faster than the
#: blocked dense one (measured on periodic 2-D grids of 128-512 states: a band of 0.24n
#: solves 2-3.6x faster than dense, 0.35n about as fast, 0.48n slower).
SPARSE_STAGE_MAX_BAND = 3 / 8


def _default_stage_solver(
    method: AbstractMethod, field: Callable, y: jax.Array, args: tuple, has_jac: bool
) -> AbstractMethod:
    """The stage solver of an implicit method left to its default: dense up to
    `SPARSE_STAGE_MIN_STATES` states. Above, building the matrix from `n` products and
    factoring it in `O(n^3)` dominate more and more, so the pattern of the Jacobian is
    traced from the operations of `field(y, t, *args)` (for every `t` and `args`:
    they are traced as unknowns) and joined with the mass matrix's entries; if its
    reordered band is narrow, the stages are solved by `Sparse` on it. Otherwise (or
    with a user `jac`, whose pattern is not traced) the dense solve stays, with a
    warning above `DENSE_STAGE_MAX_STATES` states."""
    n = y.size
    if n <= SPARSE_STAGE_MIN_STATES or not isinstance(
        getattr(method, "linear_solver", None), Dense
    ):
        return method
    why = "the Jacobian comes from `jac`, whose pattern is not traced" if has_jac else None
    if why is None:
        try:
            pattern = sparsity_pattern(field, y, method="trace", args=args)
        except ValueError as e:
            why = str(e)
        except Exception as e:  # noqa: BLE001 - a field the tracer cannot follow
            why = f"tracing the pattern of its Jacobian failed ({type(e).__name__}: {e})"
    if why is None:
        mass = getattr(method, "mass_matrix", None)
        if mass is not None:
            m_rows, m_cols = mass.nonzeros()
            rows = np.concatenate([pattern.rows, m_rows])
            pattern = SparsityPattern((rows, np.concatenate([pattern.cols, m_cols])), n)
        width = pattern.lower + pattern.upper + 1
        if width <= SPARSE_STAGE_MAX_BAND * n:
            return dataclasses.replace(method, linear_solver=Sparse(pattern, throw=False))
        why = f"the band of its Jacobian's pattern is {width} wide after reordering"
    if n <= DENSE_STAGE_MAX_STATES:
        return method
    warnings.warn(
        f"odeint: method={method.name!r} with {n} states builds and factors a dense "
        f"{n} x {n} stage matrix (O(n^3) work per factorisation); the default sparse "
        f"solve does not apply: {why}. "
        "For a large system pass a structured solver: "
        "linear_solver=linear_solve.Banded(lower, upper, throw=False) for a band, "
        "linear_solve.Sparse(pattern, throw=False) for a sparse Jacobian, or 'gmres' "
        "(matrix-free); or pass linear_solver=linear_solve.Dense(throw=False) to keep "
        "the dense solve silently.",
        stacklevel=3,
    )
    return method


def _with_linear_solver(method: AbstractMethod, linear_solver: Any) -> AbstractMethod:
    """`method` with its stage solves done by `linear_solver` (None: as it is)."""
    if linear_solver is None:
        return method
    if not any(f.name == "linear_solver" for f in dataclasses.fields(method)):
        implicit = tuple(k for k, m in METHODS.items() if hasattr(m, "linear_solver"))
        raise ValueError(
            f"odeint: `linear_solver` is for the implicit methods {implicit}; "
            f"method={method.name!r} solves no linear systems"
        )
    solver = resolve_linear_solver(
        linear_solver, "odeint: `linear_solver`", choices=("dense", "gmres", "bicgstab")
    )
    if not isinstance(solver, LinearSolver):
        raise TypeError(
            "odeint: `linear_solver` must be a linear_solve.LinearSolver (it prepares the "
            "stage matrix once per step and solves many times), e.g. "
            f"linear_solve.Banded(lower=2, upper=2, throw=False), got {linear_solver!r}"
        )
    if isinstance(linear_solver, str) and dataclasses.is_dataclass(solver):
        if any(f.name == "throw" for f in dataclasses.fields(solver)):
            solver = dataclasses.replace(solver, throw=False)
    return dataclasses.replace(method, linear_solver=solver)


def _with_mass_matrix(
    method: AbstractMethod, mass_matrix: Any, n: int, adjoint: AbstractAdjoint, dense: bool
) -> AbstractMethod:
    """`method` solving `M y' = f` with `M` from `mass_matrix` or already set on the
    method object (None for neither: an ODE), after checking that it can."""
    preset = getattr(method, "mass_matrix", None)
    if mass_matrix is None and preset is None:
        return method

    def takes_mass(m: AbstractMethod) -> bool:
        return any(f.name == "mass_matrix" for f in dataclasses.fields(m))

    if not takes_mass(method):
        able = tuple(k for k, m in METHODS.items() if takes_mass(m))
        raise ValueError(
            f"odeint: `mass_matrix` is for the methods {able}, whose stage equations "
            f"take `M` in place of the identity; method={method.name!r} does not. For a "
            "differential-algebraic system use method='radau5' (tight tolerances), "
            "'rodas5p' (moderate ones) or 'bdf' (large systems)."
        )
    if mass_matrix is not None:
        mass = MassMatrix(mass_matrix, n)
    elif isinstance(preset, MassMatrix) and preset.n == n:
        mass = preset
    else:
        raise TypeError(
            f"odeint: the method's `mass_matrix` must be a solvers.ode.MassMatrix of {n} "
            f"unknowns, got {preset!r}; or pass the matrix as odeint(mass_matrix=...)"
        )
    if isinstance(adjoint, BacksolveAdjoint):
        raise ValueError(
            "odeint: adjoint='backsolve' integrates the adjoint ODE backwards, which a "
            "differential-algebraic system (`mass_matrix`) does not have in that form; "
            "use adjoint='checkpoint' (the default of the implicit methods)."
        )
    if dense and method.continuous_weights() is None:
        raise ValueError(
            f"odeint: dense=True with a mass matrix needs a method with its own "
            f"interpolant ('radau5', 'rodas5p', 'rodas4'): method={method.name!r} would "
            "interpolate with slopes from `func`, which a differential-algebraic system "
            "does not give for its algebraic unknowns"
        )
    _check_mass_fits(method.linear_solver, mass)
    return dataclasses.replace(method, mass_matrix=mass)


def _check_mass_fits(solver: Any, mass: MassMatrix) -> None:
    """A structured stage solver builds its matrix from the entries of its band or
    pattern only, so `M`'s entries must be among them."""
    rows, cols = mass.nonzeros()
    pattern = getattr(solver, "pattern", None)
    if pattern is not None and hasattr(pattern, "rows"):
        known = set(zip(pattern.rows.tolist(), pattern.cols.tolist()))
        missing = [(int(r), int(c)) for r, c in zip(rows, cols) if (int(r), int(c)) not in known]
        if missing:
            raise ValueError(
                f"odeint: `mass_matrix` has entries outside the linear solver's sparsity "
                f"pattern, e.g. at {missing[0]}; build the pattern with them (the union of "
                "the Jacobian's pattern and the mass matrix's nonzeros)"
            )
    elif getattr(solver, "layout_bound", False) and hasattr(solver, "lower"):
        offsets = np.asarray(cols) - np.asarray(rows)
        below = int(max(0, -offsets.min(initial=0)))
        above = int(max(0, offsets.max(initial=0)))
        if below > solver.lower or above > solver.upper:
            raise ValueError(
                f"odeint: `mass_matrix` has {below} sub- and {above} super-diagonals, "
                f"outside the band of linear_solver (lower={solver.lower}, "
                f"upper={solver.upper}); widen the band to hold both"
            )


def positive(name: str, arg: str, value: Any) -> float:
    if isinstance(value, jax.core.Tracer):
        raise TypeError(
            f"{name}: `{arg}` must be a Python float (it configures the solver), got a "
            "traced value; pass it as a constant"
        )
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name}: `{arg}` must be a positive float, got {value!r}") from None
    if not value > 0:
        raise ValueError(f"{name}: `{arg}` must be positive, got {value}")
    return value


def _check_times(t: Any, tdt: Any) -> jax.Array:
    if not isinstance(t, jax.core.Tracer):
        t_np = np.asarray(t)
        if t_np.ndim != 1 or t_np.shape[0] < 1:
            raise ValueError(
                f"odeint: `t` must be a 1-D array of output times, got shape {t_np.shape}"
            )
        if not np.all(np.isfinite(t_np)):
            raise ValueError("odeint: `t` must be finite")
        bad = np.flatnonzero(np.diff(t_np) <= 0)
        if bad.size:
            i = int(bad[0])
            raise ValueError(
                "odeint: `t` must be strictly increasing; "
                f"t[{i}] = {t_np[i]!r} and t[{i + 1}] = {t_np[i + 1]!r}. "
                "Sort the times and drop repeats (to integrate backwards, substitute "
                "s = -t in `func`)."
            )
        return jnp.asarray(t, tdt)
    if jnp.ndim(t) != 1:
        raise ValueError(f"odeint: `t` must be a 1-D array of output times, got {jnp.shape(t)}")
    t = jnp.asarray(t, tdt)
    return error_if(
        t,
        jnp.any(jnp.diff(t) <= 0) | ~jnp.all(jnp.isfinite(t)),
        "odeint: `t` must be finite and strictly increasing (checked at run time). Sort "
        "the times and drop repeats.",
    )


def _names(adaptive: bool) -> tuple[str, ...]:
    return tuple(k for k, m in METHODS.items() if m.adaptive == adaptive)
