"""Two-point boundary-value problems: `solve_bvp`, called like
`scipy.integrate.solve_bvp`, with implicit derivatives.

The solution is a cubic C1 spline on a mesh, whose collocation equations (Lobatto
IIIA, fourth order: Simpson's rule on each interval, with the spline's midpoint) and
the boundary conditions form one nonlinear system in the nodes' values and the unknown
parameters. It is solved by Newton's method with a backtracking line search on
`|J^-1 r|` (affine invariant). The residual of the spline's derivative against the
field is then estimated on each interval by Lobatto quadrature, relative to `1 +
|f|`; intervals above `tol` get one new node (two where it exceeds `100 tol`) and the
system is solved again, until every interval meets `tol`. This is the scheme of
Kierzenka and Shampine that SciPy's `solve_bvp` implements.

So that it compiles once and runs under `vmap`, the mesh lives in a buffer of
`max_nodes` nodes: the nodes past the active ones repeat the last node (intervals of
length zero, whose collocation equations tie their values to the last node's) and
new nodes are scattered into place.

Derivatives: the adaptive solve runs with its inputs' derivatives stopped; its result
then goes through `implicitdiff.custom_root` on the collocation equations of the final
mesh, so every derivative of the solution and of the unknown parameters (with respect
to what `fun` and `bc` close over, the boundary data included) is the implicit
function theorem's: one linear solve with the system's Jacobian, never a
differentiation of the iterations. The mesh itself is not differentiated.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from implicitdiff import custom_root, error_if, linear_solve
from implicitdiff.internal import closure_convert

from ._checks import static_int
from .ode import odeint
from .root import root

__all__ = ["solve_bvp", "BVPSolution"]

#: Status codes, as SciPy's.
SUCCESS, MAX_NODES, SINGULAR, BC_TOLERANCE = 0, 1, 2, 3
_MESSAGES = {
    SUCCESS: "the algorithm converged to the desired accuracy",
    MAX_NODES: "the maximum number of mesh nodes is exceeded",
    SINGULAR: "a singular Jacobian was encountered, or Newton's method did not converge",
    BC_TOLERANCE: "the boundary conditions are not met to `bc_tol`",
}
#: Newton iterations on one mesh, trials of its line search, and mesh refinements.
NEWTON_ITERS, LINE_TRIALS, MAX_REFINEMENTS = 20, 6, 64


class BVPSolution(eqx.Module):
    """What `solve_bvp` returns (SciPy's fields, in a buffer of `max_nodes` nodes).

    Attributes:
        x: the mesh, `(max_nodes,)`: the first `num_nodes` are the nodes, the rest
            repeat the last one.
        y: the solution at the nodes, `(n, max_nodes)`.
        yp: its derivative `fun(x, y, p)` there, `(n, max_nodes)`.
        p: the unknown parameters found, `(k,)`, or `None`.
        num_nodes: the number of mesh nodes used.
        rms_residuals: the estimated RMS relative residual on each interval,
            `(max_nodes - 1,)` (zero past the last one).
        niter: the number of meshes solved.
        status: `0` converged, `1` too many nodes needed, `2` singular Jacobian or no
            convergence, `3` boundary conditions not met to `bc_tol`.
    """

    x: Float[Array, ...]
    y: Float[Array, ...]
    yp: Float[Array, ...]
    p: Float[Array, ...] | None
    num_nodes: Int[Array, ...]
    rms_residuals: Float[Array, ...]
    niter: Int[Array, ...]
    status: Int[Array, ...]

    @property
    def success(self) -> jax.Array:
        """True where the solve converged (`status == 0`)."""
        return self.status == SUCCESS

    def sol(self, x: Any, nu: int = 0) -> jax.Array:
        """The cubic spline (or its derivative, `nu=1`) at the points `x`: `(n,) +
        shape(x)`, as SciPy's `sol`; differentiable like the solution."""
        xq = jnp.asarray(x, self.x.dtype)
        m = self.num_nodes
        i = jnp.clip(jnp.searchsorted(self.x, xq, side="right") - 1, 0, m - 2)
        x0, x1 = self.x[i], self.x[i + 1]
        h = x1 - x0
        t = (xq - x0) / h
        y0, y1, f0, f1 = self.y[:, i], self.y[:, i + 1], self.yp[:, i], self.yp[:, i + 1]
        if nu == 0:
            h00, h10 = 2 * t**3 - 3 * t**2 + 1, t**3 - 2 * t**2 + t
            h01, h11 = -2 * t**3 + 3 * t**2, t**3 - t**2
            return h00 * y0 + h10 * h * f0 + h01 * y1 + h11 * h * f1
        if nu == 1:
            d00, d10 = (6 * t**2 - 6 * t) / h, 3 * t**2 - 4 * t + 1
            d01, d11 = (-6 * t**2 + 6 * t) / h, 3 * t**2 - 2 * t
            return d00 * y0 + d10 * f0 + d01 * y1 + d11 * f1
        raise ValueError(f"BVPSolution.sol: `nu` must be 0 or 1, got {nu}")


def solve_bvp(
    fun: Callable[..., Any],
    bc: Callable[..., Any],
    x: Any,
    y: Any,
    p: Any = None,
    *,
    tol: float = 1e-3,
    max_nodes: int = 1000,
    bc_tol: float | None = None,
    method: str = "collocation",
    throw: bool = True,
) -> BVPSolution:
    """Solve `y' = fun(x, y, p)` on `[x[0], x[-1]]` with `bc(y(a), y(b), p) = 0`;
    derivatives are implicit.

    Called like `scipy.integrate.solve_bvp` (without `S`, `fun_jac`, `bc_jac` and
    `verbose`: Jacobians come from automatic differentiation). Works under `jit` and
    `vmap`; `grad`, `jvp`, `jacfwd`, `hessian` of the solution and of `p` with respect
    to anything `fun` and `bc` close over (parameters of the equations, boundary
    values) use the implicit function theorem on the collocation equations.

    Arguments:
        fun: the right-hand side, vectorised: `fun(x, y)` or, with unknown
            parameters, `fun(x, y, p)`, for `x` of shape `(m,)` and `y` of shape
            `(n, m)`, returning `(n, m)`.
        bc: the boundary conditions: `bc(ya, yb)` or `bc(ya, yb, p)`, returning
            `n + k` residuals for `k` unknown parameters.
        x: the initial mesh, `(m,)`, strictly increasing; `x[0]` and `x[-1]` are the
            ends. A concrete array (its size sets where nodes start).
        y: the initial guess at the mesh nodes, `(n, m)`.
        p: the initial guess of the unknown parameters, `(k,)`, or `None` for none.
        tol: the tolerance on the relative residual of the spline's derivative
            (RMS over each interval, relative to `1 + |f|`).
        max_nodes: the size of the mesh buffer: the most nodes (a Python int). A
            Newton step factors a dense matrix of `n max_nodes + k` unknowns, so
            keep it to what the problem needs.
        bc_tol: the tolerance on the boundary residuals (default `tol`).
        method: `"collocation"` (the default, above), or `"shooting"` for small smooth
            problems: the unknown initial values `y(a)` and `p` are found by Newton's
            method (`solvers.root`) on `bc(y(a), y(b), p) = 0`, with `y(b)` from
            `odeint` (Dopri5 at `1e-3 tol`), starting from `y[:, 0]` and `p` (the rest
            of `y` is not used); the solution is reported at the nodes of `x`, which
            are not refined (`max_nodes` is not used). Unstable problems
            (growing modes across the interval) need collocation.
        throw: raise at run time when the solve fails (`status != 0`); with
            `throw=False` the status is in the result.

    Returns:
        A `BVPSolution`.

    Example:
        ```python
        import jax, jax.numpy as jnp
        from solvers import solve_bvp

        jax.config.update("jax_enable_x64", True)

        # y'' = -lam y, y(0) = 0, y(1) = 0, y'(0) = 1: the eigenvalue lam = pi^2.
        def fun(x, y, p):
            return jnp.stack([y[1], -p[0] * y[0]])

        def bc(ya, yb, p):
            return jnp.stack([ya[0], yb[0], ya[1] - 1.0])

        x = jnp.linspace(0.0, 1.0, 5)
        y = jnp.stack([jnp.sin(3 * x), 3 * jnp.cos(3 * x)])
        res = solve_bvp(fun, bc, x, y, p=jnp.array([9.0]), tol=1e-6, max_nodes=200)
        print(res.p)  # [9.8696...]
        ```
    """
    name = "solve_bvp"
    max_nodes = static_int(name, "max_nodes", max_nodes, minimum=2)
    if method not in ("collocation", "shooting"):
        raise ValueError(f"solve_bvp: `method` must be 'collocation' or 'shooting', got {method!r}")
    if isinstance(x, jax.core.Tracer):
        if jnp.ndim(x) != 1 or jnp.shape(x)[0] < 2:
            raise ValueError(
                f"solve_bvp: `x` must be a 1-D mesh of at least 2 nodes, got {jnp.shape(x)}"
            )
        x_np = x
    else:
        x_np = np.asarray(x)
        if x_np.ndim != 1 or x_np.size < 2 or not np.all(np.diff(x_np) > 0):
            raise ValueError(
                "solve_bvp: `x` must be a strictly increasing 1-D mesh of at least 2 nodes, "
                f"got shape {x_np.shape}"
            )
    m0 = x_np.shape[0]
    if method == "shooting":
        max_nodes = m0  # the solution is reported on the initial mesh
    if m0 > max_nodes:
        raise ValueError(
            f"solve_bvp: the initial mesh has {m0} nodes, more than max_nodes={max_nodes}"
        )
    y = jnp.asarray(y)
    if y.ndim != 2 or y.shape[1] != m0:
        raise ValueError(
            f"solve_bvp: `y` must be (n, {m0}), one column per node of `x`, got {y.shape}"
        )
    for arg, value in (("y", y), ("p", p)):
        if value is not None and jnp.iscomplexobj(value):
            raise TypeError(
                f"solve_bvp: `{arg}` is complex; the collocation equations are solved "
                "for real unknowns. Write the problem for the real and imaginary parts "
                "stacked as real components (twice the rows of `y`)."
            )
    if not jnp.issubdtype(y.dtype, jnp.floating):
        y = y.astype(jnp.result_type(float))
    dtype = y.dtype
    n = y.shape[0]
    has_p = p is not None
    p = jnp.zeros((0,), dtype) if p is None else jnp.asarray(p, dtype)
    if p.ndim != 1:
        raise ValueError(f"solve_bvp: `p` must be 1-D, got shape {p.shape}")
    k = p.shape[0]
    tol = float(tol)
    bc_tol = tol if bc_tol is None else float(bc_tol)
    if not tol > 0 or not bc_tol > 0:
        raise ValueError("solve_bvp: `tol` and `bc_tol` must be positive")
    eps = float(jnp.finfo(dtype).eps)
    if tol < 100 * eps:
        raise ValueError(f"solve_bvp: `tol` must be at least 100 eps ({100 * eps:.1e}) in {dtype}")

    def call_fun(c, xs, ys, ps):
        # `fun` is traced once, on the buffer's `max_nodes` points; the interval
        # points (one fewer) are padded to that many.
        short = xs.shape[0] == max_nodes - 1
        if short:
            xs = jnp.concatenate([xs, xs[-1:]])
            ys = jnp.concatenate([ys, ys[:, -1:]], axis=1)
        out = jnp.asarray(fun_conv(c, xs, ys, ps) if has_p else fun_conv(c, xs, ys), dtype)
        return out[:, :-1] if short else out

    def call_bc(c, ya, yb, ps):
        out = bc_conv(c, ya, yb, ps) if has_p else bc_conv(c, ya, yb)
        return jnp.asarray(out, dtype)

    # The buffer: the initial mesh, then copies of its last node.
    xs0 = jnp.asarray(x_np, dtype)
    if isinstance(x, jax.core.Tracer):
        xs0 = error_if(
            xs0,
            jnp.any(jnp.diff(xs0) <= 0),
            "solve_bvp: `x` must be strictly increasing (checked at run time)",
        )
    pad = max_nodes - m0
    x_buf = jnp.concatenate([xs0, jnp.full((pad,), xs0[-1], dtype)])
    y_buf = jnp.concatenate([y, jnp.repeat(y[:, -1:], pad, axis=1)], axis=1)
    if has_p:
        fun_conv, fun_consts, _ = closure_convert(lambda a, b, q: fun(a, b, q), x_buf, y_buf, p)
        bc_conv, bc_consts, _ = closure_convert(lambda a, b, q: bc(a, b, q), y[:, 0], y[:, 0], p)
    else:
        fun_conv, fun_consts, _ = closure_convert(lambda a, b: fun(a, b), x_buf, y_buf)
        bc_conv, bc_consts, _ = closure_convert(lambda a, b: bc(a, b), y[:, 0], y[:, 0])
    consts = (list(fun_consts), list(bc_consts))
    out = jax.eval_shape(lambda c: call_fun(c[0], x_buf, y_buf, p), consts)
    if out.shape != (n, max_nodes):
        raise ValueError(
            f"solve_bvp: `fun` must return ({n}, m) for y of shape ({n}, m), got "
            f"{out.shape} for m = {max_nodes}"
        )
    out = jax.eval_shape(lambda c: call_bc(c[1], y[:, 0], y[:, 0], p), consts)
    if out.shape != (n + k,):
        raise ValueError(
            f"solve_bvp: `bc` must return n + k = {n + k} residuals ({n} equations, {k} "
            f"unknown parameters), got shape {out.shape}"
        )

    problem = _Problem(call_fun, call_bc, n, k)
    if method == "shooting":
        return _shooting(fun, bc, problem, consts, xs0, y, p, has_p, tol, bc_tol, throw)
    # The adaptive solve, with every input's derivative stopped (the mesh it chooses
    # is not differentiated; the solution's derivative is the implicit one below).
    stop = jax.lax.stop_gradient
    state = _adapt(problem, stop(consts), stop(x_buf), stop(y_buf), stop(p), m0, tol, bc_tol, eps)
    x_f, z_f = state["x"], state["z"]
    # The mesh is a discrete choice and is not differentiated, but its ends are data:
    # the final mesh moves with them affinely, so that derivatives with respect to the
    # interval (`x = linspace(0, L, m)`) are those of the solution on the stretched
    # mesh.
    a, b = xs0[0], xs0[-1]
    s_rel = (x_f - stop(a)) / stop(b - a)
    x_f = x_f + (a - stop(a)) * (1 - s_rel) + (b - stop(b)) * s_rel

    # The implicit derivative: the collocation equations on the final mesh.
    z = custom_root(
        lambda z: problem.residual(consts, x_f, z),
        z_f,
        lambda f, z0: z0,
        problem.linear_solver(),
    )
    y_out, p_out = problem.split(z)
    status = state["status"]
    if throw:
        y_out, p_out = error_if(
            (y_out, p_out),
            status != SUCCESS,
            "solve_bvp: the solve failed (status 1: more than max_nodes nodes needed; 2: "
            "singular Jacobian or no Newton convergence; 3: boundary conditions not met). "
            "Raise max_nodes or tol, or start from a better guess; pass throw=False to get "
            "the status instead.",
        )
    return BVPSolution(
        x=x_f,
        y=y_out,
        yp=call_fun(consts[0], x_f, y_out, p_out),
        p=p_out if has_p else None,
        num_nodes=state["m"],
        rms_residuals=state["rms"],
        niter=state["iteration"],
        status=status,
    )


class _Problem:
    """The collocation system on a buffer mesh: unknowns `z = [y.ravel(), p]`."""

    def __init__(self, fun, bc, n, k):
        self.fun, self.bc, self.n, self.k = fun, bc, n, k

    def linear_solver(self):
        """How systems with the Jacobian are solved: LU of the dense matrix (the
        Jacobian is block bidiagonal with a boundary-condition corner, and dense in
        the unknown parameters' columns)."""
        return linear_solve.Dense(throw=False)

    def prepare(self, res, z):
        """`b -> J^-1 b` for the Jacobian of `res` at `z`."""
        solver = self.linear_solver()
        state = solver.init(lambda v: jax.jvp(res, (z,), (v,))[1], z)
        return lambda b: solver.solve(state, b)

    def split(self, z):
        n = self.n
        size = z.shape[0] - self.k
        return z[:size].reshape(n, size // n), z[size:]

    def join(self, y, p):
        return jnp.concatenate([y.ravel(), p])

    def collocation(self, consts, x, y, p):
        """`(residuals (n, N-1), f (n, N), f at the midpoints (n, N-1))`."""
        f = self.fun(consts[0], x, y, p)
        h = jnp.diff(x)
        y_mid = 0.5 * (y[:, 1:] + y[:, :-1]) - 0.125 * h * (f[:, 1:] - f[:, :-1])
        f_mid = self.fun(consts[0], x[:-1] + 0.5 * h, y_mid, p)
        col = y[:, 1:] - y[:, :-1] - h / 6 * (f[:, :-1] + f[:, 1:] + 4 * f_mid)
        return col, f, f_mid

    def evaluate(self, consts, x, z):
        """`(residual, collocation residuals, f at the midpoints)` at `z`."""
        y, p = self.split(z)
        col, _, f_mid = self.collocation(consts, x, y, p)
        # The last buffer node equals the last active one (the padding ties them).
        r = jnp.concatenate([col.T.ravel(), self.bc(consts[1], y[:, 0], y[:, -1], p)])
        return r, col, f_mid

    def residual(self, consts, x, z):
        return self.evaluate(consts, x, z)[0]

    def rms_residuals(self, consts, x, y, p, m):
        """Lobatto estimates of the RMS relative residual on each interval (zero on the
        padding), and the boundary residuals."""
        col, f, f_mid = self.collocation(consts, x, y, p)
        h = jnp.diff(x)
        live = jnp.arange(h.shape[0]) < m - 1
        safe_h = jnp.where(live, h, 1)
        r_mid = 1.5 * col / safe_h / (1 + jnp.abs(f_mid))
        s = 0.5 * np.sqrt(3 / 7)
        total = 32 / 45 * jnp.sum(r_mid**2, axis=0)
        for theta in (0.5 - s, 0.5 + s):
            xs = x[:-1] + theta * h
            ys, dys = _hermite(y, f, safe_h, theta)
            fs = self.fun(consts[0], xs, ys, p)
            r = (dys - fs) / (1 + jnp.abs(fs))
            total = total + 49 / 90 * jnp.sum(r**2, axis=0)
        rms = jnp.where(live, jnp.sqrt(0.5 * total), 0)
        return rms, self.bc(consts[1], y[:, 0], y[:, -1], p)


def _shooting(fun, bc, problem, consts, x, y, p, has_p, tol, bc_tol, throw):
    """Single shooting (see `solve_bvp`): Newton on the initial values and `p`."""
    n, dtype = problem.n, y.dtype
    eps = float(jnp.finfo(dtype).eps)
    ode_tol = max(1e-3 * tol, 100 * eps)

    def field(v, t, *pv):
        return jnp.asarray(fun(t[None], v[:, None], *pv), dtype)[:, 0]

    def shoot(u):
        pv = (u[n:],) if has_p else ()
        return odeint(field, u[:n], x, *pv, rtol=ode_tol, atol=ode_tol, mxstep=1e6)

    def residual(u):
        ys = shoot(u)
        pv = (u[n:],) if has_p else ()
        return jnp.asarray(bc(ys[0], ys[-1], *pv), dtype)

    u0 = jax.lax.stop_gradient(jnp.concatenate([y[:, 0], p]))
    u, info = root(residual, u0, throw=False, return_info=True)
    ys, p_out = shoot(u), u[n:]
    y_out = ys.T
    bc_res = bc(ys[0], ys[-1], *((p_out,) if has_p else ()))
    bc_ok = jnp.max(jnp.abs(jnp.asarray(bc_res, dtype)), initial=0.0) <= bc_tol
    status = jnp.where(info.converged, jnp.where(bc_ok, SUCCESS, BC_TOLERANCE), SINGULAR)
    status = status.astype(jnp.int32)
    if throw:
        y_out, p_out = error_if(
            (y_out, p_out),
            status != SUCCESS,
            "solve_bvp(method='shooting'): Newton's method on the initial values did not "
            "converge or the boundary conditions are not met to `bc_tol` (status 2 or 3). "
            "Start from a better guess, or use method='collocation' (unstable problems "
            "need it); pass throw=False to get the status instead.",
        )
    m = x.shape[0]
    rms, _ = problem.rms_residuals(consts, x, y_out, p_out, m)
    return BVPSolution(
        x=x,
        y=y_out,
        yp=problem.fun(consts[0], x, y_out, p_out),
        p=p_out if has_p else None,
        num_nodes=jnp.asarray(m, jnp.int32),
        rms_residuals=rms,
        niter=info.steps.astype(jnp.int32),
        status=status,
    )


def _hermite(y, f, h, theta):
    """The cubic spline and its derivative at `x_i + theta h_i` on every interval."""
    t = theta
    y0, y1, f0, f1 = y[:, :-1], y[:, 1:], f[:, :-1], f[:, 1:]
    val = (2 * t**3 - 3 * t**2 + 1) * y0 + (t**3 - 2 * t**2 + t) * h * f0
    val = val + (-2 * t**3 + 3 * t**2) * y1 + (t**3 - t**2) * h * f1
    der = (6 * t**2 - 6 * t) / h * (y0 - y1) + (3 * t**2 - 4 * t + 1) * f0
    der = der + (3 * t**2 - 2 * t) * f1
    return val, der


def _newton(problem, consts, x, z, m, eps, tol):
    """Newton's method with a backtracking line search on `|J^-1 r|^2`: `(z,
    converged, finite)`.

    It stops once the collocation residuals of the `m - 1` live intervals meet
    SciPy's criterion (below `tol_r (1 + |f_mid|)`, `tol_r = h tol / 30`) and the next
    step is below `sqrt(eps)` relative to the unknowns (the boundary conditions are
    then met to that accuracy too), so that the implicit derivative is taken at an
    accurate root. It has converged only when both hold."""
    res = lambda z: problem.residual(consts, x, z)  # noqa: E731
    small = eps
    h = jnp.diff(x)
    live = jnp.arange(h.shape[0]) < m - 1

    def accurate(col, f_mid):
        return jnp.all((jnp.abs(col) <= h / 30 * tol * (1 + jnp.abs(f_mid))) | ~live)

    def cond(c):
        return (c["it"] < NEWTON_ITERS) & ~c["done"]

    def body(c):
        # `r` is the residual at `z`, carried from the line search that found `z`.
        z, r = c["z"], c["r"]
        solve = problem.prepare(res, z)
        step = solve(r)
        cost = jnp.sum(step**2)
        scale = jnp.sum(1 + z**2)

        def trial(alpha):
            z_new = z - alpha * step
            r_new, col, f_mid = problem.evaluate(consts, x, z_new)
            return alpha, z_new, jnp.sum(solve(r_new) ** 2), r_new, col, f_mid

        def more(t):
            alpha, _, cost_new = t[:3]
            bad = ~(cost_new < (1 - 0.4 * alpha) * cost) & (cost > small**2 * scale)
            return bad & (alpha > 0.5**LINE_TRIALS)

        alpha, z_new, cost_new, r_new, col, f_mid = jax.lax.while_loop(
            more, lambda t: trial(0.5 * t[0]), trial(jnp.ones((), z.dtype))
        )
        finite = jnp.all(jnp.isfinite(z_new)) & jnp.isfinite(cost_new)
        ok = finite & accurate(col, f_mid) & (cost_new <= small * scale)
        return {"z": jnp.where(finite, z_new, z), "r": jnp.where(finite, r_new, r),
                "it": c["it"] + 1, "done": ~finite | ok, "ok": ok, "finite": finite}  # fmt: skip

    c0 = {
        "z": z,
        "r": res(z),
        "it": jnp.zeros((), jnp.int32),
        "done": jnp.zeros((), bool),
        "ok": jnp.zeros((), bool),
        "finite": jnp.ones((), bool),
    }
    c = jax.lax.while_loop(cond, body, c0)
    return c["z"], c["ok"], c["finite"]


def _refine(problem, consts, x, y, p, m, insert):
    """Insert `insert[i]` (0, 1 or 2) nodes into interval `i`, spaced evenly, their
    values from the spline: `(x, y, m)` in the same buffer."""
    N = x.shape[0]
    f = problem.fun(consts[0], x, y, p)
    h = jnp.diff(x)
    safe_h = jnp.where(h > 0, h, 1)
    before = jnp.concatenate([jnp.zeros(1, insert.dtype), jnp.cumsum(insert)])
    pos = jnp.arange(N) + before  # each old node's new place
    live = jnp.arange(N) < m
    x_new = jnp.full((N,), x[m - 1], x.dtype)
    y_new = jnp.broadcast_to(y[:, m - 1][:, None], y.shape)
    drop = jnp.where(live, pos, N)
    x_new = x_new.at[drop].set(x, mode="drop")
    y_new = y_new.at[:, drop].set(y, mode="drop")
    for j in (1, 2):
        # The j-th new node of each interval: at 1/2 with one new node, at j/3 with two.
        theta = jnp.where(insert == 1, 0.5, j / 3)
        want = live[:-1] & (insert >= j)
        where = jnp.where(want, pos[:-1] + j, N)
        vals = _hermite(y, f, safe_h, theta)[0]
        x_new = x_new.at[where].set(x[:-1] + theta * h, mode="drop")
        y_new = y_new.at[:, where].set(vals, mode="drop")
    return x_new, y_new, (m + jnp.sum(insert)).astype(m.dtype)


def _adapt(problem, consts, x, y, p, m0, tol, bc_tol, eps):
    """The adaptive loop: solve, estimate the residuals, refine; until every interval
    meets `tol` (see the module)."""
    N = x.shape[0]
    dt = x.dtype

    def cond(s):
        return ~s["done"]

    def body(s):
        x, m = s["x"], s["m"]
        z, ok, finite = _newton(problem, consts, x, s["z"], m, eps, tol)
        y, p = problem.split(z)
        rms, bc_res = problem.rms_residuals(consts, x, y, p, m)
        finite = finite & jnp.all(jnp.isfinite(rms))
        insert = jnp.where(rms > tol, jnp.where(rms >= 100 * tol, 2, 1), 0).astype(jnp.int32)
        added = jnp.sum(insert).astype(jnp.int32)
        too_many = m + added > N
        bc_ok = jnp.max(jnp.abs(bc_res), initial=0.0) <= bc_tol
        iteration = s["iteration"] + 1
        # As SciPy: a mesh whose Newton iteration did not converge is refined all the
        # same (the next one may do better); a singular system stops the solve.
        status = jnp.where(
            ~finite,
            SINGULAR,
            jnp.where(
                added > 0,
                # (The cap on refinements, far above what max_nodes allows for a
                # sensible problem, is reported as too many nodes.)
                jnp.where(too_many | (iteration >= MAX_REFINEMENTS), MAX_NODES, -1),
                jnp.where(~ok, SINGULAR, jnp.where(bc_ok, SUCCESS, BC_TOLERANCE)),
            ),
        ).astype(jnp.int32)
        refine = status == -1
        x2, y2, m2 = _refine(problem, consts, x, y, p, m, jnp.where(refine, insert, 0))
        return {
            "x": jnp.where(refine, x2, x),
            "z": jnp.where(refine, problem.join(y2, p), z),
            "m": jnp.where(refine, m2, m),
            "rms": rms,
            "iteration": iteration,
            "status": status,
            "done": ~refine,
        }

    s0 = {
        "x": x,
        "z": problem.join(y, p),
        "m": jnp.asarray(m0, jnp.int32),
        "rms": jnp.zeros((N - 1,), dt),
        "iteration": jnp.zeros((), jnp.int32),
        "status": jnp.asarray(-1, jnp.int32),
        "done": jnp.zeros((), bool),
    }
    return jax.lax.while_loop(cond, body, s0)
