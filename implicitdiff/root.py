"""`custom_root`: differentiate the root of `f` through the implicit function theorem.

Let `x*(theta)` solve `f_theta(x) = 0`, where `theta` stands for every
differentiated value `f` closes over. Differentiating the identity
`f_theta(x*(theta)) = 0` gives

    J dx + (d f / d theta) dtheta = 0,     J = d f / d x at x*,

so the tangent is `dx = -J^{-1} (df/dtheta dtheta)` (one `tangent_solve`), and
the cotangent is `theta_bar = -(df/dtheta)^T w` with `w = J^{-T} g` (one
transposed `tangent_solve`). Neither looks inside `solve`: the iterations that
found the root are never differentiated, and the initial guess and the
values only `solve` uses get zero derivative.

When `tangent_solve` is a `linear_solve.LinearSolver`, the rules prepare it once
at the root (`init` on the Jacobian `J`, e.g. one LU factorisation): forward mode
solves with that state, and reverse mode makes it a residual of the forward pass
and solves `J^T w = g` with `transpose_solve` on it, so the backward pass factors
nothing. Any other `tangent_solve` is a plain function, and reverse mode
transposes it with `jax.linear_transpose`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from . import _jax_compat as compat
from ._checks import check_returns_like
from ._primitive import Primitive
from ._trees import instantiate_cotangent, leaves_with_zeros
from .linear_solve import LinearSolver

__all__ = ["custom_root"]


def custom_root(
    f: Callable[[Any], Any],
    initial_guess: Any,
    solve: Callable[[Callable[[Any], Any], Any], Any],
    tangent_solve: Callable[[Callable[[Any], Any], Any], Any],
    has_aux: bool = False,
) -> Any:
    """Find a root of `f` with `solve`, differentiating by the implicit function theorem.

    Same signature and semantics as `jax.lax.custom_root`: code written for it
    runs unchanged. `f` may close over values that are being differentiated;
    their derivatives are the implicit ones.

    Arguments:
        f: the function whose root is sought; maps a pytree shaped like
            `initial_guess` to one of the same structure, shapes and dtypes.
        initial_guess: the starting point handed to `solve` (it gets zero derivative).
        solve: `solve(f, initial_guess) -> root` (or `(root, aux)` when
            `has_aux`), any procedure: Newton, bisection, a call to another library.
        tangent_solve: `tangent_solve(g, y) -> x` solving the linear system
            `g(x) = y`, where `g` is the Jacobian of `f` at the root as a linear
            function. For a scalar root `lambda g, y: y / g(1.0)` does; for vectors
            use a solver from `implicitdiff.linear_solve` (an instance such as
            `linear_solve.Dense()` is prepared once at the root, e.g. factored,
            and that state serves every derivative solve, transposed ones
            included) or a `custom_linear_solve`. Reverse mode transposes a plain
            function, so it must be linear in `y` and transposable (the
            `linear_solve` solvers are). The `linear_solve` solvers take real
            unknowns only: pass complex ones as their real and imaginary parts.
        has_aux: `solve` returns `(root, aux)`; `aux` is returned as well and
            gets no derivative.

    Returns:
        The root, with the structure of `initial_guess`; `(root, aux)` when `has_aux`.

    Example:
        ```python
        import jax, jax.numpy as jnp
        from implicitdiff import custom_root

        def sqrt(a):
            f = lambda x: x**2 - a

            def newton(f, x):
                for _ in range(20):
                    x = x - f(x) / (2 * x)
                return x

            return custom_root(f, 1.0, newton, lambda g, y: y / g(1.0))

        print(sqrt(2.0))            # 1.4142135
        print(jax.grad(sqrt)(2.0))  # 0.35355338 = 1 / (2 sqrt(2))
        ```
    """
    for name in ("solve", "tangent_solve"):
        fn = solve if name == "solve" else tangent_solve
        if not callable(fn):
            raise TypeError(f"custom_root: `{name}` must be callable, got {fn!r}")

    if isinstance(tangent_solve, LinearSolver):
        _check_real_unknowns(initial_guess)
    f_conv, f_consts, _ = compat.closure_convert(f, initial_guess)
    _check_like_guess("f(initial_guess)", f_conv, f_consts, initial_guess, False)
    s_conv, s_consts, _ = compat.closure_convert(lambda x: solve(f, x), initial_guess)
    _check_like_guess("solve(f, initial_guess)", s_conv, s_consts, initial_guess, has_aux)

    if _is_static_solver(tangent_solve):
        # The rules prepare it once at the root; here it is only traced, for the check.
        ls_conv, ls_consts, solver = None, [], tangent_solve
        _check_like_guess(
            "tangent_solve.solve(tangent_solve.init(g, x), y)",
            lambda c, x: solver.solve(_prepare(solver, f_conv, c, x), x),
            f_consts,
            initial_guess,
            False,
        )
    else:

        def linearize_and_solve(x, y):
            _, f_jvp = jax.linearize(f, x)
            return tangent_solve(f_jvp, y)

        ls_conv, ls_consts, _ = compat.closure_convert(
            linearize_and_solve, initial_guess, initial_guess
        )
        solver = None
        _check_like_guess(
            "tangent_solve(g, y)", lambda c, x: ls_conv(c, x, x), ls_consts, initial_guess, False
        )
    return _Root.apply(
        f_consts,
        s_consts,
        ls_consts,
        initial_guess,
        f=f_conv,
        solve=s_conv,
        linearize_and_solve=ls_conv,
        linear_solver=solver,
        has_aux=bool(has_aux),
    )


def _check_real_unknowns(
    initial_guess: Any,
    name: str = "custom_root",
    args: tuple[str, str, str] = ("initial_guess", "tangent_solve", "f"),
) -> None:
    """The `linear_solve` solvers take the Jacobian of `f` for real unknowns only: for
    complex ones, the matrix they build from its products with real unit vectors is
    the Jacobian only when `f` is holomorphic (not with `abs` or `conj`), and the
    derivatives would be silently wrong otherwise. `name` and `args` (the guess, the
    solver and the residual as the caller's arguments) word the message."""
    guess, solver, f = args
    for i, leaf in enumerate(jax.tree_util.tree_leaves(initial_guess)):
        if jnp.issubdtype(jnp.result_type(leaf), jnp.complexfloating):
            raise TypeError(
                f"{name}: `{guess}` leaf {i} has dtype {jnp.result_type(leaf)}, and "
                f"`{solver}` is a linear_solve solver, which takes real unknowns only (for "
                f"complex ones its matrix is the Jacobian of `{f}` only where `{f}` is "
                "holomorphic). Pass the unknowns as their real and imaginary parts, e.g. "
                f"`(x.real, x.imag)`, with `{f}` returning its residual's parts likewise."
            )


def _is_static_solver(tangent_solve: Any) -> bool:
    """Whether `tangent_solve` is a `LinearSolver` that can be a static parameter (one
    whose options are traced values is not hashable: it is then used as a function)."""
    if not isinstance(tangent_solve, LinearSolver):
        return False
    try:
        hash(tangent_solve)
    except TypeError:
        return False
    return True


def _prepare(solver: LinearSolver, f: Callable[..., Any], fc: Any, x: Any) -> Any:
    """`solver.init` on the Jacobian of `f(fc, .)` at `x`."""
    _, f_jvp = jax.linearize(lambda x: f(fc, x), x)
    return solver.init(f_jvp, x)


def _check_like_guess(what, fn, consts, guess, has_aux):
    out = jax.eval_shape(fn, consts, guess)
    check_returns_like("custom_root", what, out, guess, "initial_guess", has_aux=has_aux)


class _Root(Primitive):
    """`x* = solve(f, x0)` with implicit derivative rules.

    Inputs: `(f_consts, solve_consts, tangent_solve_consts, initial_guess)`;
    only `f_consts` have nonzero derivatives. Output: `x*` or `(x*, aux)`.
    Params: `f`, `solve`, and either `linearize_and_solve` (a plain tangent
    solve, closure-converted) or `linear_solver` (a `LinearSolver`).
    """

    def _root(self, out):
        return out[0] if self.has_aux else out

    def _with_aux_tangent(self, out, dx):
        if self.has_aux:
            return out, (dx, jax.tree_util.tree_map(jnp.zeros_like, out[1]))
        return out, dx

    def expand(self, fc, sc, lc, x0):
        return self.solve(sc, x0)

    def jvp(self, primals, tangents):
        fc, sc, lc, x0 = primals
        dfc = tangents[0]
        out = self(*primals)
        x = self._root(out)
        _, rhs = jax.jvp(lambda c: self.f(c, x), (fc,), (dfc,))
        if self.linear_solver is None:
            dx = self.linearize_and_solve(lc, x, rhs)
        else:
            dx = self.linear_solver.solve(_prepare(self.linear_solver, self.f, fc, x), rhs)
        return self._with_aux_tangent(out, jax.tree_util.tree_map(jnp.negative, dx))

    def vjp_fwd(self, nzs_in, fc, sc, lc, x0):
        out = self(fc, sc, lc, x0)
        x = self._root(out)
        state = None
        if self.linear_solver is not None and any(leaves_with_zeros(nzs_in[0])):
            state = _prepare(self.linear_solver, self.f, fc, x)
        return out, (fc, lc, x, state)

    def vjp_bwd_retval(self, res, g):
        fc, lc, x, state = res
        gx = instantiate_cotangent(self._root(g) if self.has_aux else g)
        if gx is None or (self.linear_solver is not None and state is None):
            return None, None, None, None
        # w = J^{-T} g.
        if self.linear_solver is not None:
            w = self.linear_solver.transpose_solve(state, gx)
        else:
            w = self._transpose_tangent_solve(lc, x, gx)
        _, pullback = jax.vjp(lambda c: self.f(c, x), fc)
        (ct_fc,) = pullback(jax.tree_util.tree_map(jnp.negative, w))
        return ct_fc, None, None, None

    def _transpose_tangent_solve(self, lc, x, gx):
        """Transpose the plain tangent solve (linear in its right-hand side) at `gx`."""
        try:
            (w,) = jax.linear_transpose(lambda y: self.linearize_and_solve(lc, x, y), x)(gx)
        except NotImplementedError as e:
            raise NotImplementedError(
                "custom_root: reverse mode transposes `tangent_solve` (it must be linear in "
                "its right-hand side and made of transposable operations), and that failed: "
                f"{e}. Use a solver from implicitdiff.linear_solve or wrap yours in "
                "implicitdiff.custom_linear_solve with a transpose_solve. (In jax 0.10.2, the "
                "solvers of jax.scipy.sparse.linalg cannot be transposed: they use "
                "jax.lax.custom_linear_solve with auxiliary outputs.)"
            ) from e
        return w
