"""The constant mass matrix `M` of a differential-algebraic system `M y' = f(y, t)`.

With a singular `M` the rows where it vanishes are algebraic equations `0 = f_i(y,
t)`: an index-1 DAE when the Jacobian of those rows with respect to the algebraic
unknowns is invertible. The implicit methods that handle it (`"radau5"`, `"rodas5p"`,
`"rodas4"`, `"bdf"`) put `M` where an ODE has the identity: in their stage equations
and stage matrices (`M - h gamma J` instead of `I - h gamma J`). A `MassMatrix` is
part of the method, a static parameter of the solve, so it is a concrete array,
hashed by its values.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from implicitdiff import error_if

from ..root import root
from ._small import small_product

__all__ = ["MassMatrix", "apply_mass", "consistent_state"]


class MassMatrix:
    """A constant mass matrix on the flattened state: a diagonal (a 1-D array, or a
    2-D array with nothing off its diagonal) or a full `(n, n)` matrix.

    Arguments:
        matrix: the matrix, `(n, n)`, or its diagonal, `(n,)`. Concrete (NumPy or a
            JAX array outside `jax.jit`), real and finite.
        n: the number of unknowns (the size of the flattened state).

    Example:
        ```python
        import numpy as np
        from solvers.ode import MassMatrix

        m = MassMatrix(np.array([1.0, 1.0, 0.0]), 3)  # two ODEs and one constraint
        print(m.diagonal, m.algebraic)  # True [2]
        ```
    """

    def __init__(self, matrix: Any, n: int):
        if isinstance(matrix, jax.core.Tracer):
            raise TypeError(
                "odeint: `mass_matrix` must be a concrete array (NumPy, or a JAX array "
                "created outside jax.jit): it is a constant of the problem and part of "
                "the compiled solve. Build it with NumPy, or close over it instead of "
                "passing it through jax.jit."
            )
        m = np.asarray(matrix)
        if not (np.issubdtype(m.dtype, np.floating) or np.issubdtype(m.dtype, np.integer)):
            raise TypeError(f"odeint: `mass_matrix` must be a real array, got dtype {m.dtype}")
        m = m.astype(np.float64)
        if m.shape == (n, n) and not np.any(m - np.diag(np.diag(m))):
            m = np.diag(m).copy()
        if m.shape not in ((n,), (n, n)):
            raise ValueError(
                f"odeint: `mass_matrix` must be ({n}, {n}) or its diagonal ({n},), for the "
                f"{n} numbers of the flattened `y0` (jax.flatten_util.ravel_pytree order); "
                f"got shape {m.shape}"
            )
        if not np.all(np.isfinite(m)):
            raise ValueError("odeint: `mass_matrix` must be finite")
        m.setflags(write=False)
        self.matrix = m
        self.n = n
        self._digest = hashlib.sha1(str(m.shape).encode() + m.tobytes()).hexdigest()

    @property
    def diagonal(self) -> bool:
        """Whether `M` is diagonal (stored as its diagonal)."""
        return self.matrix.ndim == 1

    @property
    def algebraic(self) -> np.ndarray:
        """The indices of the algebraic unknowns of a diagonal `M` (its zero
        entries)."""
        if not self.diagonal:
            raise ValueError("MassMatrix.algebraic: only a diagonal mass matrix names them")
        return np.flatnonzero(self.matrix == 0)

    def __call__(self, v: jax.Array) -> jax.Array:
        """`M v` for `v` of shape `(n,)` or `(n, k)` (`k` vectors side by side)."""
        m = jnp.asarray(self.matrix, v.dtype)
        if self.diagonal:
            return m.reshape((-1,) + (1,) * (v.ndim - 1)) * v
        return small_product(m, v)

    def pseudo_solve(self, b: jax.Array) -> jax.Array:
        """`M^+ b` (the pseudo-inverse): `y'` from `M y' = b` on the differential
        unknowns, zero on the algebraic ones."""
        if self.diagonal:
            d = self.matrix
            inv = np.where(d != 0, 1 / np.where(d != 0, d, 1), 0.0)
            return jnp.asarray(inv, b.dtype) * b
        return jnp.asarray(np.linalg.pinv(self.matrix), b.dtype) @ b

    def null_spaces(self) -> tuple[np.ndarray, np.ndarray]:
        """`(L, V)`: rows `L` spanning the left null space of `M` (`L M = 0`: the
        algebraic equations are `L f = 0`) and columns `V` spanning its null space (the
        directions of the algebraic unknowns), orthonormal; `k` of each for a
        matrix of rank `n - k`."""
        if self.diagonal:
            eye = np.eye(self.n)[:, self.algebraic]
            return eye.T, eye
        u, s, vt = np.linalg.svd(self.matrix)
        rank = int(np.sum(s > s.max(initial=0.0) * self.n * np.finfo(np.float64).eps))
        return u[:, rank:].T, vt[rank:].T

    def nonzeros(self) -> tuple[np.ndarray, np.ndarray]:
        """The positions `(rows, cols)` of `M`'s nonzero entries."""
        if self.diagonal:
            idx = np.flatnonzero(self.matrix)
            return idx, idx
        return np.nonzero(self.matrix)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MassMatrix) and self._digest == other._digest

    def __hash__(self) -> int:
        return hash(self._digest)

    def __repr__(self) -> str:
        kind = "diagonal" if self.diagonal else "full"
        zeros = f", {self.algebraic.size} algebraic" if self.diagonal else ""
        return f"MassMatrix({kind}, n={self.n}{zeros})"


def apply_mass(mass: MassMatrix | None, v: jax.Array) -> jax.Array:
    """`M v`, or `v` itself without a mass matrix."""
    return v if mass is None else mass(v)


def consistent_state(
    f: Callable[[jax.Array], jax.Array], y: jax.Array, mass: MassMatrix, *, throw: bool = True
) -> jax.Array:
    """`y` with its algebraic part moved so that the algebraic equations hold: `y + V
    z` with `L f(y + V z) = 0` (`L`, `V` from `MassMatrix.null_spaces`; for a diagonal
    `M`, the algebraic unknowns and equations themselves), solved by Newton's method
    (`solvers.root`), so that its derivatives with respect to `y` and to what `f`
    closes over are implicit. A `y` that already satisfies them is kept (to the
    root's tolerance).

    Arguments:
        f: the vector field at the initial time, on the flat state.
        y: the flat initial state.
        mass: the mass matrix.
        throw: raise at run time when Newton's method fails (the system is not of
            index 1 near `y`, or `y` is too far from consistent); if False, return
            NaN then, which the solve reports as a non-finite state.

    Returns:
        The corrected flat state.
    """
    if mass.diagonal:
        alg = mass.algebraic
        k = alg.size
        if k == 0:
            return y

        def moved(z, y):
            return y.at[alg].add(z)

        def algebraic(z, y):
            return f(moved(z, y))[alg]

    else:
        left, right = (jnp.asarray(a, y.dtype) for a in mass.null_spaces())
        k = right.shape[1]
        if k == 0:
            return y

        def moved(z, y):
            return y + right @ z

        def algebraic(z, y):
            return left @ f(moved(z, y))

    z, info = root(algebraic, jnp.zeros(k, y.dtype), y, throw=False, return_info=True)
    out = moved(z, y)
    ok = info.converged
    if throw:
        return error_if(
            out,
            ~ok,
            "odeint: the consistent initialisation (Newton's method on the algebraic "
            "equations for the algebraic unknowns of `y0`) did not converge. Check that "
            "the system is of index 1 (the algebraic equations determine the algebraic "
            "unknowns) and start `y0` nearer a consistent point, or pass "
            "consistent_y0=False to take `y0` as it is.",
        )
    return jnp.where(ok, out, jnp.nan)
