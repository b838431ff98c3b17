"""The direct solve that the default adjoint of `fixed_point` falls back to.

After damped or Anderson iteration the default adjoint runs the Neumann series for the
derivative's linear system and, for the elements where it has not converged, solves
`(I - A) u = c` directly instead (`_fall_back`): a division for one unknown, dense LU up
to `_DENSE_MAX_SIZE` unknowns, restarted GMRES above (`_direct_solve`), raising with a
message that explains a singular `I - A` where that fails too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jax.scipy.sparse.linalg as jsp_linalg
from jax.flatten_util import ravel_pytree

from implicitdiff import error_if, linear_solve

from .convergence import _failed

# The direct solve of the default adjoint: dense LU up to this many unknowns per element
# (as `implicitdiff.linear_solve.auto`), restarted GMRES above.
_DENSE_MAX_SIZE = linear_solve.AUTO_DENSE_MAX_SIZE
_GMRES_RESTART = linear_solve.GMRES.restart
# How far GMRES's residual may exceed its tolerance before it fails.
_RESIDUAL_SLACK = linear_solve.RESIDUAL_SLACK


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
