"""How `check_grads` compares a derivative with what it should equal.

The labels of the three kinds of comparison (`FD`, `REFERENCE`, `JVP`); the default
finite-difference steps and tolerances per floating dtype, and the tolerances a user
passes; the random directions and cotangents; and the normwise comparisons themselves
(`_compare` for arrays, `_summarise` for the dot-product identity), each giving the
absolute and relative error, the threshold, and the verdict of one result row.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

FD = "finite differences"
REFERENCE = "reference"
JVP = "jvp"

# ---------------------------------------------------------------------------
# Default step sizes and tolerances, per (real) floating dtype.
#
# Central differences of step h have a truncation error ~ h**2 * |f'''| / 6 and a
# rounding error ~ macheps * |f| / h. The steps below balance the two for functions
# of moderate scale; the finite-difference tolerances leave room for both. "exact"
# is the tolerance for comparing two derivatives that should agree up to rounding
# (and solver tolerance): the reference's, and the jvp that a vjp is checked against.


@dataclasses.dataclass(frozen=True)
class _Defaults:
    eps: float
    fd_tol: float
    exact_tol: float


_DEFAULTS: dict[np.dtype, _Defaults] = {
    np.dtype(np.float64): _Defaults(eps=1e-5, fd_tol=1e-5, exact_tol=1e-8),
    np.dtype(np.float32): _Defaults(eps=1e-3, fd_tol=1e-2, exact_tol=1e-4),
    np.dtype(np.float16): _Defaults(eps=3e-2, fd_tol=1e-1, exact_tol=1e-2),
    np.dtype(jnp.bfloat16): _Defaults(eps=1e-1, fd_tol=2e-1, exact_tol=5e-2),
}


def _real_dtype(dtype: Any) -> np.dtype:
    dtype = np.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return np.dtype(jnp.finfo(dtype).dtype)
    return dtype


def _least_precise(dtypes: Iterable[Any]) -> np.dtype:
    """The inexact dtype with the largest machine epsilon among `dtypes` (float64 if none)."""
    best = np.dtype(np.float64)
    for dt in dtypes:
        dt = _real_dtype(dt)
        if jnp.issubdtype(dt, jnp.floating) and jnp.finfo(dt).eps > jnp.finfo(best).eps:
            best = dt
    return best


def _defaults_for(dtype: np.dtype) -> _Defaults:
    if dtype in _DEFAULTS:
        return _DEFAULTS[dtype]
    # Other floating types (float8 and friends): no sensible finite differences; be lax.
    return _Defaults(eps=1e-1, fd_tol=5e-1, exact_tol=1e-1)


# ---------------------------------------------------------------------------
# Random directions, and the normwise comparisons.


def _random_like(rng: np.random.Generator, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    dtype = np.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.complexfloating):
        val = rng.standard_normal(shape) + 1j * rng.standard_normal(shape)
    else:
        val = rng.standard_normal(shape)
    return jnp.asarray(val, dtype=dtype)


def _to_np(xs: Sequence[jax.Array]) -> list[np.ndarray]:
    out = []
    for x in xs:
        a = np.asarray(x)
        a = a.astype(np.complex128 if np.iscomplexobj(a) else np.float64)
        out.append(a)
    return out


def _compare(
    actual: Sequence[np.ndarray], expected: Sequence[np.ndarray], atol: float, rtol: float
) -> tuple[float, float, float, bool]:
    """Normwise comparison: (max abs err, max rel err, tol, passed); NaN fails."""
    abs_err = 0.0
    scale = 0.0
    for a, e in zip(actual, expected, strict=True):
        if a.shape != e.shape:
            raise ValueError(f"check_grads: shape mismatch, {a.shape} against {e.shape}")
        if a.size:
            with np.errstate(invalid="ignore"):
                diff = np.where(a == e, 0.0, np.abs(a - e))  # inf == inf agrees
            abs_err = float(np.max([abs_err, np.max(diff)]))  # propagates NaN
            finite = np.abs(e[np.isfinite(e)])
            if finite.size:
                scale = max(scale, float(np.max(finite)))
    return _summarise(abs_err, scale, atol, rtol)


def _summarise(
    abs_err: float, scale: float, atol: float, rtol: float
) -> tuple[float, float, float, bool]:
    if scale > 0:
        rel_err = abs_err / scale
    else:
        rel_err = 0.0 if abs_err == 0 else (math.nan if math.isnan(abs_err) else math.inf)
    tol = atol + rtol * scale
    return abs_err, rel_err, tol, bool(abs_err <= tol)


def _inner(xs: Sequence[np.ndarray], ys: Sequence[np.ndarray]) -> tuple[float, float]:
    """(Re <x, y>, sum |x| |y|) over lists of arrays."""
    val = 0.0
    mag = 0.0
    for x, y in zip(xs, ys, strict=True):
        val += float(np.real(np.vdot(x, y)))
        mag += float(np.sum(np.abs(x) * np.abs(y)))
    return val, mag


def _resolve_tol(tol: float | Mapping[str, float] | None, against: str, default: float) -> float:
    if tol is None:
        return default
    if isinstance(tol, Mapping):
        unknown = set(tol) - {FD, REFERENCE, JVP}
        if unknown:
            raise ValueError(
                f"unknown tolerance keys {sorted(unknown)}; use {FD!r}, {REFERENCE!r}, {JVP!r}"
            )
        return float(tol.get(against, default))
    return float(tol)
