"""`fixed_point`: solve `x = f(a, x)`, differentiating by the implicit function theorem.

The forward solve is an iteration (plain, damped, or Anderson-accelerated) in a
`lax.while_loop`. Its derivatives never look at the iterations: with `A = d_x f`
and `B = d_a f` at the solution `x*`,

    dx* = (I - A)^{-1} B da        (forward mode)
    a_bar = B^T w,  (I - A)^T w = x_bar        (reverse mode)

With the default adjoint (`adjoint=None`) and with `adjoint="neumann"` both linear
systems are solved as fixed points themselves, `t = B da + A t` and `w = x_bar + A^T w`,
by the same iteration (the backward pass of JAX's hijax guide): `fixed_point` is one
`implicitdiff.Primitive` whose derivative rules apply it again to those linear maps, so
derivatives of any order follow. That iteration (the Neumann series) converges only when
`A` contracts, which the convergence of plain iteration implies, but not that of damped or
Anderson iteration. After those two the default watches the series, stops it where it
grows or stalls, and solves the linear fixed point directly (dense LU, or GMRES for large
states) for the elements where it has not converged, inside the same primitive: its
output is always the solution of the linear system, so its rules stay valid. With
another `adjoint` the linear systems go to that solver of `implicitdiff.linear_solve`
through `implicitdiff.implicit_diff`.

Under `vmap` each loop runs over the whole batch until every element has converged
(the converged ones keep iterating, which keeps a contraction converged), and the
convergence test is one reduction over the batch; the failure check reduces the
batch to one verdict and computes its message on the host only when something failed.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import jax.scipy.sparse.linalg as jsp_linalg
import numpy as np
from jax.flatten_util import ravel_pytree

from implicitdiff import Primitive, error_if, implicit_diff, linear_solve
from implicitdiff.internal import (
    all_finite,
    any_over_batch,
    check_lazily,
    closure_convert,
    instantiate_cotangent,
    reduce_any,
    vmap_size,
)

from ._checks import float_dtype, returns_like, solve_flags, static_float, static_int
from ._info import (
    MAX_STEPS,
    NONFINITE,
    SUCCESS,
    SolveInfo,
    default_tolerance,
    describe_status,
    failure_message,
    max_norm,
)

__all__ = ["fixed_point"]

Method = Literal["iterate", "damped", "anderson"]
_METHODS = ("iterate", "damped", "anderson")
# The names `adjoint` accepts: "neumann" is this module's own series (the primitive below),
# the others the solvers of `implicitdiff.linear_solve` of those names.
_ADJOINT_NAMES = ("neumann", "gmres", "dense", "auto")
_MIN_DERIVATIVE_STEPS = 100  # the derivative solves may take at least this many steps
# The default adjoint after "damped" or "anderson" stops the Neumann series of an
# element once its step has grown `_GROWTH` times larger than its first step (the series
# diverges), or has not shrunk below its first step after `_STALL_STEPS` steps (an
# eigenvalue of modulus 1), and solves that element directly.
_GROWTH = 1e3
_STALL_STEPS = 64
# The direct solve of the default adjoint: dense LU up to this many unknowns per element
# (as `implicitdiff.linear_solve.auto`), restarted GMRES above.
_DENSE_MAX_SIZE = linear_solve.AUTO_DENSE_MAX_SIZE
_GMRES_RESTART = linear_solve.GMRES.restart
# How far GMRES's residual may exceed its tolerance before it fails.
_RESIDUAL_SLACK = linear_solve.RESIDUAL_SLACK
# The default `check_every` when a step updates at least `_LARGE` numbers: the tests then
# cost passes over memory, and an inner loop of steps between them pays for itself.
_LARGE = 2**14
_CHECK_EVERY_LARGE = 4


def fixed_point(
    f: Callable[[Any, Any], Any],
    a: Any,
    x_guess: Any,
    *,
    method: Method = "iterate",
    rtol: float | None = None,
    atol: float | None = None,
    max_steps: int = 1000,
    damping: float = 0.5,
    history: int = 5,
    regularisation: float = 1e-5,
    check_every: int | None = None,
    adjoint: str | linear_solve.LinearSolver | Callable[..., Any] | None = None,
    throw: bool = True,
    return_info: bool = False,
) -> Any:
    """Find `x` with `x = f(a, x)`, starting from `x_guess`; derivatives are implicit.

    Derivatives with respect to `a` and to any value `f` closes over come from the
    implicit function theorem (forward and reverse mode, any order, under `vmap`,
    `jit` and `lax.scan`); `x_guess` gets zero derivative.

    Arguments:
        f: the map, `f(a, x) -> x`, returning a pytree with the structure, shapes
            and dtypes of `x`.
        a: parameters, a pytree of arrays (may be empty, e.g. `()`).
        x_guess: the starting point, a pytree of floating-point arrays.
        method: `"iterate"` (`x <- f(a, x)`), `"damped"`
            (`x <- (1 - damping) x + damping f(a, x)`), or `"anderson"` (Anderson
            acceleration over the last `history` iterates, with `damping` as the
            mixing parameter and Tikhonov `regularisation` of its least squares).
        rtol: relative tolerance: converged when `|x_new - x| <= atol + rtol |x_new|`
            elementwise (default 1e-6 in float32, 1e-10 in float64).
        atol: absolute tolerance (same defaults).
        max_steps: the most iterations before giving up (a Python int).
        damping: in (0, 1]; see `method`.
        history: Anderson's memory (a Python int >= 1).
        regularisation: Anderson's least-squares regularisation, relative to the
            scale of the residuals.
        check_every: for `"iterate"` and `"damped"`: test convergence every this many
            steps (a Python int; at most `max_steps` steps are taken). Each test is a
            pass over the iterate; steps past convergence keep a contraction
            converged, so testing less often changes the answer only within the
            tolerance, and makes cheap maps on many numbers faster. The default,
            `None`, tests every step, or every `4` steps when a step updates at least
            16384 numbers (a large state, or a batch of solves under `vmap`). The
            derivative solves by the Neumann series test after their first step,
            then as often.
        adjoint: the linear solver for the derivative systems with `I - A`, where
            `A = df/dx` at the solution. `None` (default) follows `method`. After
            `"iterate"`: the Neumann series `sum A^k` (the same iteration run on the
            linear map, to the same tolerance, for at least 100 steps), as
            `"neumann"`; plain iteration converges only where `f` contracts, and then
            so does the series, at the same rate. After `"damped"` and `"anderson"`,
            which also solve maps that do not contract (an eigenvalue of `A` of
            modulus >= 1): the series, stopped for an element once it grows (a step
            1000 times its first one) or stalls (no step below its first one after
            64 steps), then, for the elements (of a `vmap` batch) where it has not
            converged, a direct solve: dense LU up to 256 unknowns, GMRES above. So
            the default gives the derivative whenever the solve converged and
            `I - A` is invertible, at the cost of the series where `f` contracts.
            `"neumann"`: the series alone, raising when it does not converge.
            `"gmres"`, `"dense"`, `"auto"` (aliases of the classes of
            `implicitdiff.linear_solve` with default options), a
            `linear_solve.LinearSolver` such as `linear_solve.GMRES(maxiter=1000)`
            (prepared once at the solution: `Dense()` factors `I - A` once), or any
            transposable function `solve(matvec, b)`: that solver, always.
        throw: raise at run time when the solve fails (max steps, non-finite
            values). `throw=False` needs `return_info=True`: the status in the
            returned info is then the only sign of a failed solve (a `ValueError`
            otherwise).
        return_info: also return a `SolveInfo` (steps, residual, status).

    Returns:
        The fixed point, with the structure of `x_guess`; `(x, info)` when
        `return_info`.

    Example:
        ```python
        import jax
        from solvers import fixed_point

        def newton_sqrt(a):
            return fixed_point(lambda a, x: 0.5 * (x + a / x), a, a)

        print(newton_sqrt(2.0))                 # 1.4142135
        print(jax.grad(newton_sqrt)(2.0))       # 0.35355338
        ```
    """
    if not callable(f):
        raise TypeError(f"fixed_point: `f` must be callable as f(a, x), got {f!r}")
    if method not in _METHODS:
        raise ValueError(f"fixed_point: `method` must be one of {_METHODS}, got {method!r}")
    name = "fixed_point"
    max_steps = static_int(name, "max_steps", max_steps, minimum=1)
    history = static_int(name, "history", history, minimum=1)
    if check_every is not None:
        check_every = static_int(name, "check_every", check_every, minimum=1)
    damping = static_float(name, "damping", damping)
    regularisation = static_float(name, "regularisation", regularisation)
    if not 0.0 < damping <= 1.0:
        raise ValueError(f"fixed_point: `damping` must be in (0, 1], got {damping}")
    solve_flags(name, throw, return_info)
    # "neumann" is the series run by this module's primitive, not `linear_solve.Neumann`.
    series = adjoint is None or (isinstance(adjoint, str) and adjoint == "neumann")
    solve = linear_solve.resolve(
        adjoint, "fixed_point: `adjoint`", choices=_ADJOINT_NAMES, none_means="the default"
    )

    dtype = float_dtype(name, "x_guess", x_guess)
    # Trace `f` once: for the check below, and to hoist the traced values it closes over
    # so that they are differentiated through the primitive's rules.
    f_conv, consts, _ = closure_convert(f, a, x_guess)
    returns_like(
        name, "f(a, x_guess)", jax.eval_shape(f_conv, consts, a, x_guess), "x_guess", x_guess
    )
    default_tol = default_tolerance(dtype)
    # The tolerances are values (they may be traced), the rest static options.
    tol = tuple(
        jnp.asarray(default_tol if t is None else t, dtype) for t in (rtol, atol)
    )  # fmt: skip
    cfg = _Config(
        method=method,
        # A damped step is `damping` times the undamped one: measure the undamped size.
        scale=damping if method == "damped" else 1.0,
        max_steps=max_steps,
        check_every=check_every,
        damping=damping,
        history=history,
        regularisation=regularisation,
        throw=throw,
        with_info=return_info,
        # Plain iteration converges only where `f` contracts, and then so does the
        # series: after "iterate" the default is the series alone, as "neumann".
        fallback=adjoint is None and method != "iterate",
    )

    if series:
        x, info = _FixedPoint.apply(consts, a, x_guess, tol, f=f_conv, cfg=cfg)
    else:

        def solver(x0, a):
            return _solve(f, a, x0, tol, cfg)

        def residual(x, a):
            return jax.tree_util.tree_map(jnp.subtract, x, f(a, x))

        x, info = implicit_diff(residual, solve=solve, has_aux=True)(solver)(x_guess, a)
    return (x, info) if return_info else x


@dataclasses.dataclass(frozen=True)
class _Config:
    """The static options of one solve (hashable: a primitive parameter)."""

    method: str
    scale: float
    max_steps: int
    check_every: int | None  # None: chosen from the number of values per step
    damping: float
    history: int
    regularisation: float
    throw: bool
    with_info: bool  # compute the `SolveInfo` (else `None`)
    # For the derivative solves: stop the series where it grows or stalls, and solve
    # directly where it has not converged.
    fallback: bool = False
    derivative: bool = False  # a linear solve for a derivative, not the user's problem

    def for_derivative(self) -> _Config:
        return dataclasses.replace(
            self,
            method="iterate",
            scale=1.0,
            max_steps=max(self.max_steps, _MIN_DERIVATIVE_STEPS),
            with_info=False,
            derivative=True,
        )


# ---------------------------------------------------------------------------
# The primitive (adjoint="neumann"): the solve, and derivative rules that solve the
# linear systems by the same iteration, as fixed points of linear maps.


class _FixedPoint(Primitive):
    """`(x*, info)` for `x* = f(consts, a, x*)`, iterated from `x0` (`info` is `None`
    unless `cfg.with_info`).

    Inputs `(consts, a, x0, tol)`: `consts` are the traced values `f` closes over,
    `tol` is `(rtol, atol)`; only `consts` and `a` are differentiated. Params:
    `f(consts, a, x)` and `cfg` (a `_Config`).
    """

    def __init__(self, consts_aval, a_aval, x_aval, tol_aval, *, f, cfg):
        self.in_avals = (consts_aval, a_aval, x_aval, tol_aval)
        info = None
        if cfg.with_info:
            leaves = jax.tree_util.tree_leaves(x_aval)
            info = SolveInfo(
                steps=jax.ShapeDtypeStruct((), jnp.int32),
                residual=jax.ShapeDtypeStruct((), jnp.result_type(*leaves)),
                status=jax.ShapeDtypeStruct((), jnp.int32),
            )
        self.out_aval = (x_aval, info)
        self.params = dict(f=f, cfg=cfg)
        super().__init__()

    def expand(self, consts, a, x0, tol):
        return _solve(functools.partial(self.f, consts), a, x0, tol, self.cfg)

    def vjp_fwd(self, nzs_in, consts, a, x0, tol):
        out = self(consts, a, x0, tol)
        return out, (consts, a, out[0], tol)

    def vjp_bwd_retval(self, res, g):
        consts, a, x, tol = res
        g_x = instantiate_cotangent(g[0])
        if g_x is None:
            return None, None, None, None
        # w = g + A^T w, then (consts, a)_bar = B^T w.
        w = _linear_solve(_adjoint_step, self.f, (consts, a, x, g_x), g_x, tol, self.cfg)
        _, pullback = jax.vjp(lambda c, a: self.f(c, a, x), consts, a)
        ct_consts, ct_a = pullback(w)
        return ct_consts, ct_a, None, None

    def jvp(self, primals, tangents):
        consts, a, x0, tol = primals
        d_consts, d_a, _, _ = tangents
        out = self(consts, a, x0, tol)
        x = out[0]
        # t = B (d_consts, d_a) + A t.
        _, rhs = jax.jvp(lambda c, a: self.f(c, a, x), (consts, a), (d_consts, d_a))
        dx = _linear_solve(_tangent_step, self.f, (consts, a, x, rhs), rhs, tol, self.cfg)
        return out, (dx, jax.tree_util.tree_map(jnp.zeros_like, out[1]))


def _adjoint_step(f, params, u):
    """`u -> g + A^T u`, with `A = d_x f` at the solution."""
    consts, a, x, g = params
    _, pullback = jax.vjp(lambda x: f(consts, a, x), x)
    return jax.tree_util.tree_map(jnp.add, g, pullback(u)[0])


def _tangent_step(f, params, t):
    """`t -> rhs + A t`, with `A = d_x f` at the solution."""
    consts, a, x, rhs = params
    _, a_t = jax.jvp(lambda x: f(consts, a, x), (x,), (t,))
    return jax.tree_util.tree_map(jnp.add, rhs, a_t)


def _linear_solve(step, f, params, guess, tol, cfg):
    """The fixed point of the linear map `step(f, params, .)`, as a `_FixedPoint` (so
    that it is differentiated, to any order, by the same rules)."""
    step = functools.partial(_bind_step, step, f)
    x, _ = _FixedPoint.apply((), params, guess, tol, f=step, cfg=cfg.for_derivative())
    return x


def _bind_step(step, f, consts, params, u):
    del consts  # the linear maps close over nothing traced: all of it is in `params`
    return step(f, params, u)


# ---------------------------------------------------------------------------
# The forward solve.


def _solve(f, a, x0, tol, cfg):
    """Iterate to the fixed point of `f(a, .)` from `x0`: `(x, SolveInfo)`, checked.
    `tol` is `(rtol, atol)` for an undamped step."""
    tol = (tol[0] * cfg.scale, tol[1] * cfg.scale)  # for the step actually taken
    if cfg.method == "anderson":
        x_prev, x, steps = _anderson(
            f, a, x0, tol, cfg.max_steps, cfg.damping, cfg.history, cfg.regularisation
        )
    else:
        step = _damped_step if cfg.method == "damped" else _iterate_step
        step = functools.partial(step, f, a, damping=cfg.damping)
        every = cfg.check_every
        if every is None:  # from the numbers a step updates, the whole batch under vmap
            leaves = jax.tree_util.tree_leaves(x0)
            batch = max(vmap_size(v) for v in leaves + jax.tree_util.tree_leaves(a))
            size = batch * sum(int(np.size(v)) for v in leaves)
            every = _CHECK_EVERY_LARGE if size >= _LARGE else 1
        first = 1 if cfg.derivative else every
        fallback = cfg.derivative and cfg.fallback
        # With `throw`, a NaN does not stop the loop: it runs on to max_steps and fails,
        # so that running out of steps is the whole verdict (no pass over the iterate).
        # A derivative solve that falls back also stops where the series grows, stalls or
        # is NaN (`watch`); its verdict is then a pass over the iterate.
        x_prev, x, steps = _iterate(
            step, x0, tol, cfg.max_steps, every, first, nan_stops=not cfg.throw, watch=fallback
        )
        if fallback:
            failed = any_over_batch(reduce_any(_failed(x, x_prev, tol)))
            return _fall_back(f, a, x, x_prev, tol, failed, cfg), None
    if cfg.throw:
        if cfg.method == "anderson":
            failed = any_over_batch(reduce_any(_failed(x, x_prev, tol)))
        else:
            failed = steps >= cfg.max_steps
        x = _check(x, x_prev, steps, tol, failed, cfg)
    return x, (_info(x, x_prev, steps, tol, cfg.scale) if cfg.with_info else None)


def _iterate_step(f, a, x, *, damping):
    del damping
    return f(a, x)


def _damped_step(f, a, x, *, damping):
    fx = f(a, x)
    return jax.tree_util.tree_map(lambda u, v: (1 - damping) * u + damping * v, x, fx)


def _iterate(step, x0, tol, max_steps, check_every, first_check, *, nan_stops, watch=False):
    """Step from `x0` until a step moves no element by more than the tolerance;
    returns the last two iterates and the number of steps.

    The first test comes after `first_check` steps, the next ones every `check_every`
    steps, never beyond `max_steps`. An element that is NaN stops the loop when
    `nan_stops`, else it keeps it going. Under `vmap` the loop is one loop over the
    batch: it runs until every element has converged (`any_over_batch`), not once per
    element with masking. With `watch`, an element also stops counting once it
    diverges or stalls (`_gives_up`, measured against its step at the first test).
    """
    unsettled = _moving if nan_stops else _not_settled

    def advance(x, steps, every):
        if every == 1:
            return x, step(x), steps + 1
        n = jnp.minimum(every, max_steps - steps)
        # An inner loop rather than unrolled steps: XLA's CPU backend would cut an
        # unrolled chain of steps into several passes over memory per step.
        x = jax.lax.fori_loop(0, n - 1, lambda _, x: step(x), x)
        return x, step(x), steps + n

    init = advance(x0, jnp.asarray(0, jnp.int32), first_check)
    if watch:

        def watched_cond(carry):
            x_prev, x, steps, first = carry
            active = unsettled(x, x_prev, tol) & ~_gives_up(x, x_prev, steps, first)
            return (steps < max_steps) & any_over_batch(active)

        def watched_body(carry):
            return (*advance(carry[1], carry[2], check_every), carry[3])

        init = (*init, _step_size(init[1], init[0]))
        return jax.lax.while_loop(watched_cond, watched_body, init)[:3]

    def cond(carry):
        x_prev, x, steps = carry
        return (steps < max_steps) & any_over_batch(unsettled(x, x_prev, tol))

    return jax.lax.while_loop(cond, lambda c: advance(c[1], c[2], check_every), init)


def _step_size(x, x_prev):
    """The largest `|x - x_prev|` (per element under `vmap`)."""
    return max_norm([jnp.abs(u - v) for u, v in _pairs(x, x_prev)])


def _gives_up(x, x_prev, steps, first):
    """Whether a linear iteration whose first step had size `first` diverges (its step
    grew `_GROWTH` times larger, or is not finite) or stalls (no step below the first
    one after `_STALL_STEPS` steps). A contraction's steps shrink geometrically, but for
    a non-normal `A` they may grow for a while: a false alarm only costs a direct solve.
    """
    size = _step_size(x, x_prev)
    return ~(size <= _GROWTH * first) | ((steps >= _STALL_STEPS) & ~(size < first))


def _anderson(f, a, x0, tol, max_steps, beta, m, lam):
    """Anderson acceleration (type II) on the flattened iterate, memory `m`.

    Returns the last iterate, its image (the point returned, whose step was measured)
    and the number of evaluations of `f`.
    """
    flat0, unravel = ravel_pytree(x0)
    n = flat0.shape[0]
    dt = flat0.dtype

    def g(v):
        return ravel_pytree(f(a, unravel(v)))[0]

    g0 = g(flat0)
    # Ring buffers of the last m iterates and their images; slot 0 holds (x0, f(x0)).
    xs = jnp.zeros((m, n), dt).at[0].set(flat0)
    gs = jnp.zeros((m, n), dt).at[0].set(g0)
    eye = jnp.eye(m, dtype=dt)

    def cond(carry):
        x, g_x, _, _, steps = carry
        return (steps < max_steps) & _moving(g_x, x, tol) & jnp.all(jnp.isfinite(g_x))

    def body(carry):
        _, _, xs, gs, steps = carry
        # Weights alpha (summing to one) minimising |sum_i alpha_i (g_i - x_i)| over the
        # filled slots; empty slots get weight zero through an identity block.
        filled = jnp.arange(m) < jnp.minimum(steps + 1, m)
        both = filled[:, None] & filled[None, :]
        resid = gs - xs
        h = jnp.where(both, resid @ resid.T, 0.0)
        scale = jnp.trace(h) / jnp.sum(filled) + jnp.finfo(dt).tiny
        h = h + lam * scale * eye + jnp.where(both, 0.0, eye)
        alpha = _solve_spd(h, filled.astype(dt))
        alpha = alpha / jnp.sum(alpha)
        x_new = beta * (alpha @ gs) + (1 - beta) * (alpha @ xs)
        g_new = g(x_new)
        slot = (steps + 1) % m
        return x_new, g_new, xs.at[slot].set(x_new), gs.at[slot].set(g_new), steps + 1

    init = (flat0, g0, xs, gs, jnp.asarray(0, jnp.int32))
    x, g_x, _, _, steps = jax.lax.while_loop(cond, body, init)
    return unravel(x), unravel(g_x), steps + 1


def _fall_back(f, a, x, x_prev, tol, failed, cfg):
    """The fixed point of the affine map `f(a, .)` (a derivative's linear system): `x`,
    the series' last iterate (the image of `x_prev`), where it has converged, and a
    direct solve (`_direct_solve`) for the elements where it has not.

    `failed` is the verdict reduced over any batch: only when it holds is the direct
    solve run (for the whole batch under `vmap`, then selected per element). Where the
    direct solve fails too (`I - A` singular), it raises with `cfg.throw`, else gives NaN.
    """

    def solve(operands):
        a, x, x_prev, tol = operands
        moving = _failed(x, x_prev, tol)
        u, bad, residual, how = _direct_solve(f, a, x, tol)
        bad = moving & bad
        if cfg.throw:
            values = {} if residual is None else {"residual": residual}
            u = error_if(u, bad, _direct_failure_message(how, residual), values=values)
        else:
            u = jax.tree_util.tree_map(lambda v: jnp.where(bad, jnp.nan, v), u)
        return jax.tree_util.tree_map(lambda new, old: jnp.where(moving, new, old), u, x)

    return jax.lax.cond(failed, solve, lambda operands: operands[1], (a, x, x_prev, tol))


def _direct_solve(f, a, x, tol):
    """Solve `u = f(a, u)` for an affine `f(a, .)` shaped like `x`, not by iterating:
    `(I - A) u = c` with `c = f(a, 0)` and `A v = f(a, v) - c`.

    Up to `_DENSE_MAX_SIZE` unknowns (per element) `A` is built from the images of the
    unit vectors and the system solved by LU; above, by restarted GMRES to the relative
    residual `rtol`. Returns `(u, bad, residual, how)`: `bad` where `u` is not finite or
    GMRES missed its tolerance, `residual` GMRES's 2-norm of `f(a, u) - u` (else None),
    `how` the method.
    """
    flat, unravel = ravel_pytree(x)
    n, dtype = flat.shape[0], flat.dtype

    def g(v):
        return ravel_pytree(f(a, unravel(v)))[0].astype(dtype)

    c = g(jnp.zeros_like(flat))
    if n == 1:  # a division: elementwise under `vmap`, no batch of LU factorisations
        u = c / (1 - (g(jnp.ones_like(flat)) - c))
        bad, residual, how = ~jnp.all(jnp.isfinite(u)), None, "division"
    elif n <= _DENSE_MAX_SIZE:
        eye = jnp.eye(n, dtype=dtype)
        rows = jax.vmap(g)(eye) - c  # row i is A e_i
        u = jnp.linalg.solve(eye - rows.T, c)
        bad, residual, how = ~jnp.all(jnp.isfinite(u)), None, "dense LU"
    else:
        rtol = jnp.maximum(tol[0], 10 * jnp.finfo(dtype).eps).astype(dtype)
        restart = min(_GMRES_RESTART, n)
        u, _ = jsp_linalg.gmres(
            lambda v: v - (g(v) - c), c, tol=rtol, restart=restart, maxiter=-(-10 * n // restart)
        )
        residual = jnp.linalg.norm(g(u) - u)
        bad = ~(residual <= _RESIDUAL_SLACK * rtol * jnp.linalg.norm(c))
        bad = bad | ~jnp.all(jnp.isfinite(u))
        how = "GMRES"
    return unravel(u), bad, residual, how


def _direct_failure_message(how, residual):
    outcome = "a non-finite solution" if residual is None else "residual {residual:.3e}"
    return (
        "fixed_point: the derivative needs the solution of (I - df/dx) u = b at the fixed "
        "point (df/dx: the Jacobian of f with respect to x); the Neumann series for it "
        f"did not converge, and the direct solve ({how}) failed too: {outcome}. So "
        "I - df/dx is singular or nearly so (df/dx has an eigenvalue 1), and the fixed "
        "point does not depend smoothly on the parameters there. To fix it: check that "
        "the fixed point is isolated, or, for a large state, pass a solver with more "
        "iterations, e.g. adjoint=implicitdiff.linear_solve.GMRES(maxiter=1000)."
    )


_UNROLLED_SOLVE_MAX = 8  # the largest Anderson memory solved by the unrolled Cholesky


def _solve_spd(h, b):
    """Solve `h x = b` for a small symmetric positive definite `h` (Anderson's regularised
    normal equations). Up to `_UNROLLED_SOLVE_MAX` unknowns: an unrolled Cholesky
    factorisation, elementwise operations that vectorise under `vmap`, where a batched
    `jnp.linalg.solve` is a loop of LAPACK calls on XLA's CPU backend."""
    m = h.shape[0]
    if m > _UNROLLED_SOLVE_MAX:
        return jnp.linalg.solve(h, b)
    low = [[None] * m for _ in range(m)]  # the Cholesky factor, entry by entry
    for j in range(m):
        low[j][j] = jnp.sqrt(h[j, j] - sum(low[j][k] ** 2 for k in range(j)))
        for i in range(j + 1, m):
            dot = sum(low[i][k] * low[j][k] for k in range(j))
            low[i][j] = (h[i, j] - dot) / low[j][j]
    y = []
    for i in range(m):
        y.append((b[i] - sum(low[i][k] * y[k] for k in range(i))) / low[i][i])
    x = [None] * m
    for i in reversed(range(m)):
        x[i] = (y[i] - sum(low[k][i] * x[k] for k in range(i + 1, m))) / low[i][i]
    return jnp.stack(x)


# ---------------------------------------------------------------------------
# Convergence, diagnostics and the failure check.


def _pairs(x, x_prev):
    return zip(jax.tree_util.tree_leaves(x), jax.tree_util.tree_leaves(x_prev))


def _moving(x, x_prev, tol):
    """Whether any element moved by more than `atol + rtol |x|` (False where NaN)."""
    rtol, atol = tol
    flags = [reduce_any(jnp.abs(u - v) > atol + rtol * jnp.abs(u)) for u, v in _pairs(x, x_prev)]
    return functools.reduce(jnp.logical_or, flags)


def _not_settled(x, x_prev, tol):
    """Like `_moving`, but True where not finite."""
    rtol, atol = tol
    flags = [
        reduce_any(~(jnp.abs(u - v) <= atol + rtol * jnp.abs(u)) | ~jnp.isfinite(u))
        for u, v in _pairs(x, x_prev)
    ]
    return functools.reduce(jnp.logical_or, flags)


def _info(x, x_prev, steps, tol, scale):
    """The `SolveInfo` of a solve that stopped at `x`, the image of `x_prev`."""
    status = jnp.where(
        all_finite(x), jnp.where(_moving(x, x_prev, tol), MAX_STEPS, SUCCESS), NONFINITE
    )
    sizes = [jnp.abs(u - v) for u, v in _pairs(x, x_prev)]
    return SolveInfo(
        steps=jnp.asarray(steps, jnp.int32),
        residual=max_norm(sizes) / scale,
        status=status.astype(jnp.int32),
    )


def _failed(x, x_prev, tol):
    return _moving(x, x_prev, tol) | ~all_finite(x)


def _check(x, x_prev, steps, tol, failed, cfg):
    """`x`, raising at run time if `failed` (a verdict reduced over any batch; a false
    alarm will do: which elements failed, and why, is worked out only then). Neither `x`
    nor anything of its size reaches the host, so a sharded `x` stays sharded."""
    if cfg.derivative:
        msg = (
            "fixed_point: the linear solve for the derivative (adjoint='neumann': the "
            "fixed-point iteration run on the linearised map) did not converge: status "
            f"{{status}} ({describe_status(MAX_STEPS, NONFINITE)}) after {{steps}} steps, "
            "last step {residual:.3e}. It converges only when `f` contracts at the "
            "solution (every eigenvalue of df/dx below 1 in modulus). To fix it: pass "
            "adjoint='dense' (small states) or adjoint='gmres', raise `max_steps` (now "
            f"{cfg.max_steps}), or, for a map that does not contract, solve with "
            "method='damped' or 'anderson', after which the default adjoint falls back "
            "to a direct solve where the series fails."
        )
    else:
        msg = failure_message("fixed_point", cfg.max_steps)
    details = functools.partial(_failure_details, cfg.scale)
    return check_lazily(
        x, failed, details, (x, x_prev, steps, tol), msg, ("status", "steps", "residual")
    )


def _failure_details(scale, x, x_prev, steps, tol):
    info = _info(x, x_prev, steps, tol, scale)
    return info.status != SUCCESS, (info.status, info.steps, info.residual)
