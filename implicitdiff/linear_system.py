"""`custom_linear_solve`: a linear solve whose derivatives never look inside the solver.

For `x = A^{-1} b`, where `A` is given as a function `matvec` that may close
over differentiated values `theta`:

- forward mode: `dx = A^{-1} (db - dA x)`, another solve with the same solver;
- reverse mode: `w = A^{-T} g` with the transpose solver, then
  `db_bar = w` and `theta_bar = -(d/dtheta <w, A(theta) x>)`;
- transposition (when the solve sits in a linear position of a bigger
  computation, e.g. a tangent solve inside `custom_root`): `b_bar = A^{-T} g`.

The transpose solve is this same primitive with `A` replaced by `A^T` (and the
two solvers swapped), so every derivative is again a `custom_linear_solve` and
derivatives of any order never differentiate through the iterations of the
user's solver.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from . import _jax_compat as compat
from ._checks import check_returns_like
from ._per_element import per_element_if_batched
from ._primitive import Primitive
from ._rule_data import is_accum
from ._trees import instantiate_cotangent, leaves_with_zeros

__all__ = ["custom_linear_solve"]


def custom_linear_solve(
    matvec: Callable[[Any], Any],
    b: Any,
    solve: Callable[[Callable[[Any], Any], Any], Any],
    transpose_solve: Callable[[Callable[[Any], Any], Any], Any] | None = None,
    symmetric: bool = False,
    has_aux: bool = False,
) -> Any:
    """Solve `matvec(x) = b` with `solve`, differentiating implicitly.

    Same signature and semantics as `jax.lax.custom_linear_solve`: code written
    for it runs unchanged. The derivatives of `x` are computed from the linear
    system itself (more solves), never by differentiating the iterations of
    `solve`, so any solver may be used (an iterative method, a factorisation,
    a call to another library), and `matvec` may close over values that are
    being differentiated.

    Arguments:
        matvec: the linear function `A`, mapping a pytree shaped like `b` to one
            of the same structure, shapes and dtypes. For complex arrays it must be
            linear over the complex numbers (no `conj`, `real` or `abs` of `x`), as
            `jax.lax.custom_linear_solve` assumes; a map that is only real-linear is
            written on the real and imaginary parts instead.
        b: the right-hand side, a pytree of floating-point arrays.
        solve: `solve(matvec, b) -> x` (or `(x, aux)` when `has_aux`), any
            procedure that returns `A^{-1} b`.
        transpose_solve: `transpose_solve(vecmat, b) -> x` solving with `A^T`
            (given as `vecmat`). Needed for reverse mode unless `symmetric`.
        symmetric: `A` is symmetric, so `solve` also serves as `transpose_solve`.
        has_aux: `solve` (and `transpose_solve`) return `(x, aux)`; `aux` is
            returned alongside `x` and gets no derivative.

    Returns:
        `x`, with the structure of `b`; `(x, aux)` when `has_aux`.

    Example:
        ```python
        import jax, jax.numpy as jnp
        from implicitdiff import custom_linear_solve

        def solve_spd(a):
            c = jnp.linalg.cholesky(a)
            return lambda mv, b: jax.scipy.linalg.cho_solve((c, True), b)

        def f(a, b):
            return custom_linear_solve(lambda x: a @ x, b, solve_spd(a), symmetric=True)

        a = jnp.array([[2.0, 1.0], [1.0, 3.0]])
        b = jnp.array([1.0, 2.0])
        print(f(a, b))                                # [0.2 0.6]
        print(jax.grad(lambda b: f(a, b).sum())(b))   # [0.4 0.2]
        ```
    """
    b_leaves = jax.tree_util.tree_leaves(b)
    if not b_leaves:
        raise TypeError("custom_linear_solve: `b` has no array leaves")
    b_avals = [compat.typeof(x) for x in b_leaves]
    for i, a in enumerate(b_avals):
        if not jnp.issubdtype(a.dtype, jnp.inexact):
            raise TypeError(
                f"custom_linear_solve: `b` leaf {i} has dtype {a.dtype}; the right-hand side "
                "must be floating point (cast it, e.g. b.astype(jnp.float32))"
            )
    if not callable(solve):
        raise TypeError(f"custom_linear_solve: `solve` must be callable, got {solve!r}")
    if transpose_solve is not None and not callable(transpose_solve):
        raise TypeError(
            f"custom_linear_solve: `transpose_solve` must be callable or None, got "
            f"{transpose_solve!r}"
        )

    mv, mv_consts, _ = compat.closure_convert(matvec, b)
    _check_like_b("`matvec`", mv, mv_consts, b, False)

    def vecmat(y):
        # A^T y, by transposing the user's matvec (linear in its argument).
        (out,) = jax.linear_transpose(matvec, b)(y)
        return out

    # A matrix that differs across a `vmap` batch is factored for each element (the
    # solves are traced now, and batched later as they are).
    def traced(fn):
        return per_element_if_batched(fn, mv_consts)

    sv, sv_consts, _ = compat.closure_convert(traced(lambda r: solve(matvec, r)), b)
    _check_like_b("`solve`", sv, sv_consts, b, has_aux)
    if symmetric:
        ts, ts_consts = None, []
    elif transpose_solve is not None:
        ts, ts_consts, _ = compat.closure_convert(traced(lambda r: transpose_solve(vecmat, r)), b)
        _check_like_b("`transpose_solve`", ts, ts_consts, b, has_aux)
    else:
        ts, ts_consts = None, []

    return _LinearSolve.apply(
        mv_consts,
        sv_consts,
        ts_consts,
        b,
        matvec=mv,
        solve=sv,
        transpose_solve=ts,
        symmetric=bool(symmetric),
        has_aux=bool(has_aux),
        transposed=False,
    )


def _check_like_b(what, fn, consts, b, has_aux):
    out = jax.eval_shape(fn, consts, b)
    check_returns_like("custom_linear_solve", what, out, b, "b", has_aux=has_aux)


class _LinearSolve(Primitive):
    """`x = A^{-1} b` (or `A^{-T} b` when `transposed`) with implicit derivative rules.

    Inputs: `(matvec_consts, solve_consts, transpose_solve_consts, b)`. The
    output is `x` or `(x, aux)`. Only `b` and `matvec_consts` are differentiated;
    the solvers' own constants do not change the solution.
    """

    # ---- the operator and solver this instance applies ---------------------------

    def _apply_a(self, mvc, x):
        """`A x`, or `A^T x` for a transposed instance.

        With `symmetric`, the transposed operator is `matvec` itself (as in JAX): the
        transposed solve runs `solve(matvec, .)`, so its derivative with respect to the
        values `matvec` closes over must come from the same `matvec`. Transposing it here
        instead would differentiate `A^T` while the solve inverts `A`, which disagrees as
        soon as a perturbation of those values is not symmetric (second derivatives).
        """
        if not self.transposed or self.symmetric:
            return self.matvec(mvc, x)
        (out,) = jax.linear_transpose(lambda v: self.matvec(mvc, v), x)(x)
        return out

    def _solve(self, sc, tc, r):
        if not self.transposed:
            return self.solve(sc, r)
        if self.symmetric:
            return self.solve(sc, r)
        if self.transpose_solve is None:
            self._solve_missing_transpose()
        return self.transpose_solve(tc, r)

    def _flipped(self):
        """The same system transposed: its solves are this one's transpose solves."""
        if not self.transposed and not self.symmetric and self.transpose_solve is None:
            self._solve_missing_transpose()
        return _LinearSolve(
            *self.in_avals,
            matvec=self.matvec,
            solve=self.solve,
            transpose_solve=self.transpose_solve,
            symmetric=self.symmetric,
            has_aux=self.has_aux,
            transposed=not self.transposed,
        )

    @staticmethod
    def _solve_missing_transpose():
        # A TypeError, as from jax.lax.custom_linear_solve (and with its wording first).
        raise TypeError(
            "custom_linear_solve: transpose_solve required for reverse-mode differentiation "
            "(grad, vjp, jacrev) and transposition: pass `transpose_solve`, a solver for the "
            "transposed system `transpose_solve(vecmat, b)`, or pass symmetric=True if "
            "`matvec` is symmetric. Forward mode (jvp, jacfwd) works without it."
        )

    def _x(self, out):
        return out[0] if self.has_aux else out

    # ---- rules --------------------------------------------------------------------

    def expand(self, mvc, sc, tc, b):
        return self._solve(sc, tc, b)

    def jvp(self, primals, tangents):
        mvc, sc, tc, b = primals
        dmvc, _, _, db = tangents
        out = self(*primals)
        x = self._x(out)
        # d(A x) with x held fixed: the part of the tangent coming from A itself.
        _, da_x = jax.jvp(lambda c: self._apply_a(c, x), (mvc,), (dmvc,))
        rhs = jax.tree_util.tree_map(lambda u, v: u - v, db, da_x)
        dx = self._x(self(mvc, sc, tc, rhs))
        if self.has_aux:
            return out, (dx, jax.tree_util.tree_map(jnp.zeros_like, out[1]))
        return out, dx

    def vjp_fwd(self, nzs_in, mvc, sc, tc, b):
        out = self(mvc, sc, tc, b)
        return out, (mvc, sc, tc, self._x(out))

    def vjp_bwd_retval(self, res, g):
        mvc, sc, tc, x = res
        gx = instantiate_cotangent(g[0] if self.has_aux else g)
        if gx is None:
            return None, None, None, None
        w = self._x(self._flipped()(mvc, sc, tc, gx))
        _, pullback = jax.vjp(lambda c: self._apply_a(c, x), mvc)
        (ct_mvc,) = pullback(jax.tree_util.tree_map(jnp.negative, w))
        return ct_mvc, None, None, w

    def transpose(self, ct, mvc, sc, tc, b):
        # Linear inputs arrive as accumulators (objects with `.accum`); anything else is
        # a known value. Only `b` may be linear; leaves of `b` that are known values
        # (a constant block of the right-hand side) just get no cotangent.
        for name, part in (("matvec", mvc), ("solve", sc), ("transpose_solve", tc)):
            if any(is_accum(v) for v in leaves_with_zeros(part)):
                raise ValueError(
                    f"custom_linear_solve is linear in `b` only, but it was transposed with "
                    f"respect to a value `{name}` closes over (for example a solver that "
                    "closes over the right-hand side itself); pass such values through `b`"
                )
        gx = instantiate_cotangent(ct[0] if self.has_aux else ct)
        if gx is None:
            return
        w = self._x(self._flipped()(mvc, sc, tc, gx))
        for acc, v in zip(jax.tree_util.tree_leaves(b, is_leaf=is_accum), leaves_with_zeros(w)):
            if is_accum(acc):
                acc.accum(v)
