"""The transformation matrix: a catalogue of primitives x every transformation the contract lists.

Each catalogue entry pairs a primitive with a plain-JAX reference of the same
mathematics; every transformation of the primitive must agree with the same
transformation of the reference (standard JAX autodiff), or, where the primitive
lacks the rule that transformation needs, raise `NotImplementedError` naming it.
"""

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from implicitdiff import (
    Primitive,
    Zero,
    apply_derived_linearization,
    instantiate_zeros,
    jvp_from_lin,
    linearize_from_jvp,
    transpose_jvp,
    transpose_linearized,
    vjp_fwd_from_jvp,
    vjp_fwd_from_lin,
)

# --- the catalogue -----------------------------------------------------------------


class RevOnly(Primitive):
    """log(1 + e^x) with a stable reverse rule only."""

    def expand(self, x):
        return jnp.log1p(jnp.exp(x))

    def vjp_fwd(self, nzs_in, x):
        return self(x), x

    def vjp_bwd_retval(self, x, g):
        return (jax.nn.sigmoid(x) * g,)


class FwdOnly(Primitive):
    """sin, forward rule only."""

    def expand(self, x):
        return jnp.sin(x)

    def jvp(self, primals, tangents):
        (x,), (t,) = primals, tangents
        return self(x), jnp.cos(x) * t


class Both(Primitive):
    """sin(x) * y with forward and reverse rules."""

    def expand(self, x, y):
        return jnp.sin(x) * y

    def vjp_fwd(self, nzs_in, x, y):
        return self(x, y), (jnp.cos(x), jnp.sin(x), y)

    def vjp_bwd_retval(self, res, g):
        cos_x, sin_x, y = res
        return (cos_x * g * y, sin_x * g)

    def jvp(self, primals, tangents):
        (x, y), (dx, dy) = primals, tangents
        return self(x, y), jnp.cos(x) * dx * y + jnp.sin(x) * dy


class Derived(Primitive):
    """tanh with a jvp rule and everything else derived from it."""

    def expand(self, x):
        return jnp.tanh(x)

    def jvp(self, primals, tangents):
        (x,), (t,) = primals, tangents
        y = self(x)
        return y, (1 - y**2) * t

    lin = linearize_from_jvp
    linearized = apply_derived_linearization
    vjp_fwd = vjp_fwd_from_jvp
    vjp_bwd_retval = transpose_jvp


class FromLin(Primitive):
    """exp with hand-written lin/linearized; jvp and reverse mode derived from them."""

    def expand(self, x):
        return jnp.exp(x)

    def lin(self, nzs_in, x):
        y = self(x)
        return y, y

    def linearized(self, y, t):
        return y * t

    jvp = jvp_from_lin
    vjp_fwd = vjp_fwd_from_lin
    vjp_bwd_retval = transpose_linearized


class PytreeRule(Primitive):
    """{'a': x*y, 'b': (sin x, y**2)} on a dict input, both rules, symbolic zeros."""

    symbolic_zeros = True

    def expand(self, p):
        return {"a": p["x"] * p["y"], "b": (jnp.sin(p["x"]), p["y"] ** 2)}

    def vjp_fwd(self, nzs_in, p):
        return self(p), p

    def vjp_bwd_retval(self, p, g):
        g = jax.tree.map(instantiate_zeros, g, is_leaf=lambda z: isinstance(z, Zero))
        gx = g["a"] * p["y"] + jnp.cos(p["x"]) * g["b"][0]
        gy = g["a"] * p["x"] + 2 * p["y"] * g["b"][1]
        return ({"x": gx, "y": gy},)

    def jvp(self, primals, tangents):
        (p,), (t,) = primals, tangents
        t = jax.tree.map(instantiate_zeros, t, is_leaf=lambda z: isinstance(z, Zero))
        out = self(p)
        ta = t["x"] * p["y"] + p["x"] * t["y"]
        return out, {"a": ta, "b": (jnp.cos(p["x"]) * t["x"], 2 * p["y"] * t["y"])}


def _pytree_fn(x):
    out = PytreeRule.apply({"x": x, "y": 2.0 * x + 1.0})
    return out["a"] + out["b"][0] * out["b"][1]


def _pytree_ref(x):
    y = 2.0 * x + 1.0
    return x * y + jnp.sin(x) * y**2


@dataclass(frozen=True)
class Entry:
    name: str
    fn: Any
    ref: Any
    fwd: bool  # has forward-mode rules
    rev: bool  # has reverse-mode rules


CATALOGUE = [
    Entry("rev_only", RevOnly.apply, lambda x: jnp.log1p(jnp.exp(x)), fwd=False, rev=True),
    Entry("fwd_only", FwdOnly.apply, jnp.sin, fwd=True, rev=False),
    Entry(
        "both",
        lambda x: Both.apply(x, x**2 + 1.0),
        lambda x: jnp.sin(x) * (x**2 + 1.0),
        fwd=True,
        rev=True,
    ),
    Entry("derived", Derived.apply, jnp.tanh, fwd=True, rev=True),
    Entry("from_lin", FromLin.apply, jnp.exp, fwd=True, rev=True),
    Entry("pytree", _pytree_fn, _pytree_ref, fwd=True, rev=True),
]

# --- the transformations -------------------------------------------------------------


def _scan_apply(f):
    def g(x):
        def body(c, _):
            c = 0.5 * f(c) + 0.1 * c
            return c, c.sum()

        c, ys = jax.lax.scan(body, x, None, length=3)
        return c.sum() + ys.sum()

    return g


def _total(f):
    return lambda x: jnp.sum(f(x))


# name -> (needs forward rules, needs reverse rules, transformation)
TRANSFORMS = {
    "eval": (False, False, lambda f: f),
    "jit": (False, False, jax.jit),
    "vmap": (False, False, lambda f: lambda x: jax.vmap(f)(jnp.stack([x, 2 * x, -x]))),
    "jit_vmap": (False, False, lambda f: jax.jit(jax.vmap(f))),
    "grad": (False, True, lambda f: jax.grad(_total(f))),
    "jit_grad": (False, True, lambda f: jax.jit(jax.grad(_total(f)))),
    "jvp": (True, False, lambda f: lambda x: jax.jvp(f, (x,), (jnp.cos(x),))),
    "jacfwd": (True, False, jax.jacfwd),
    "jacrev": (False, True, jax.jacrev),
    "hessian": (True, True, lambda f: jax.hessian(_total(f))),
    "grad_grad": (False, True, lambda f: jax.grad(lambda x: jnp.sum(jax.grad(_total(f))(x) ** 2))),
    "vmap_grad": (
        False,
        True,
        lambda f: lambda x: jax.vmap(jax.grad(_total(f)))(jnp.stack([x, 0.5 * x])),
    ),
    "grad_vmap": (
        False,
        True,
        lambda f: jax.grad(lambda x: jnp.sum(jax.vmap(f)(jnp.stack([x, 0.5 * x])))),
    ),
    "linearize": (True, False, lambda f: lambda x: jax.linearize(f, x)[1](jnp.sin(x))),
    "checkpoint_grad": (False, True, lambda f: jax.grad(_total(jax.checkpoint(f)))),
    "scan": (False, False, lambda f: jax.jit(_scan_apply(f))),
    "scan_grad": (False, True, lambda f: jax.grad(_scan_apply(f))),
    "scan_jvp": (True, False, lambda f: lambda x: jax.jvp(_scan_apply(f), (x,), (x,))),
}


@pytest.fixture(params=["float32", "float64"])
def dtype(request):
    if request.param == "float64":
        old = jax.config.jax_enable_x64
        jax.config.update("jax_enable_x64", True)
        yield jnp.float64
        jax.config.update("jax_enable_x64", old)
    else:
        yield jnp.float32


@pytest.mark.parametrize("entry", CATALOGUE, ids=lambda e: e.name)
@pytest.mark.parametrize("tname", list(TRANSFORMS))
def test_matrix(entry, tname, dtype):
    needs_fwd, needs_rev, transform = TRANSFORMS[tname]
    x = jnp.array([0.3, -1.2, 2.0], dtype)
    supported = (entry.fwd or not needs_fwd) and (entry.rev or not needs_rev)
    if not supported:
        missing = "jvp" if needs_fwd and not entry.fwd else "vjp_fwd"
        with pytest.raises(NotImplementedError, match=missing):
            jax.block_until_ready(transform(entry.fn)(x))
        return
    got = transform(entry.fn)(x)
    want = transform(entry.ref)(x)
    tol = 1e-5 if dtype == jnp.float32 else 1e-12
    jax.tree.map(
        lambda g, w: np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=tol, atol=tol),
        got,
        want,
    )
    for leaf in jax.tree.leaves(got):
        assert leaf.dtype == dtype


def test_vmap_keeps_custom_rule():
    """The design note's example: vmap must not remove a custom derivative rule."""

    class TwoX(Primitive):  # value 2x, but a (deliberately different) derivative 3
        def expand(self, x):
            return 2.0 * x

        def vjp_fwd(self, nzs_in, x):
            return self(x), None

        def vjp_bwd_retval(self, res, g):
            return (3.0 * g,)

        def jvp(self, primals, tangents):
            return self(*primals), 3.0 * tangents[0]

    f = TwoX.apply
    np.testing.assert_allclose(jax.grad(f)(1.0), 3.0)
    np.testing.assert_allclose(jax.vmap(jax.grad(f))(jnp.ones(4)), [3.0] * 4)
    np.testing.assert_allclose(jax.grad(lambda x: jax.vmap(f)(x).sum())(jnp.ones(4)), [3.0] * 4)
    np.testing.assert_allclose(jax.jvp(jax.vmap(f), (jnp.ones(4),), (jnp.ones(4),))[1], [3.0] * 4)
    np.testing.assert_allclose(jax.jacfwd(jax.vmap(f))(jnp.ones(2)), 3.0 * jnp.eye(2))
    np.testing.assert_allclose(jax.jacrev(jax.vmap(f))(jnp.ones(2)), 3.0 * jnp.eye(2))


def test_nested_vmap_and_in_axes():
    x = jnp.arange(12.0).reshape(3, 4) / 10
    y = jnp.arange(4.0)
    f = lambda a, b: Both.apply(a, b)
    got = jax.vmap(jax.vmap(f, (0, None)), (1, None), out_axes=1)(x, 2.0)
    np.testing.assert_allclose(got, jnp.sin(x) * 2.0, rtol=1e-6)
    got = jax.vmap(jax.vmap(f), (0, None))(x, y)
    np.testing.assert_allclose(got, jnp.sin(x) * y, rtol=1e-6)
    g = jax.vmap(jax.vmap(jax.grad(f, argnums=(0, 1))))(x, jnp.ones_like(x))
    np.testing.assert_allclose(g[0], jnp.cos(x), rtol=1e-6)
    np.testing.assert_allclose(g[1], jnp.sin(x), rtol=1e-6)
    # grad through vmap with an unbatched (shared) argument sums its cotangent
    gy = jax.grad(lambda b: jax.vmap(f, (0, None))(x[0], b).sum())(2.0)
    np.testing.assert_allclose(gy, jnp.sin(x[0]).sum(), rtol=1e-6)


def test_user_batch_rule_is_used():
    calls = []

    class Double(Primitive):
        def expand(self, x):
            return 2 * x

        def batch(self, axis_data, args, dims):
            calls.append((axis_data.size, dims))
            (x,), (d,) = args, dims
            return 2 * x, d

    out = jax.vmap(Double.apply)(jnp.ones((5, 2)))
    np.testing.assert_allclose(out, 2 * jnp.ones((5, 2)))
    assert calls == [(5, (0,))]


class WeightedSquares(Primitive):
    """`sum(w * x**2)`: under `vmap` over `x` with `w` shared, the cotangent of `w` is
    the sum over the batch."""

    def expand(self, x, w):
        return jnp.sum(w * x**2)

    def vjp_fwd(self, nzs_in, x, w):
        return self(x, w), (x, w)

    def vjp_bwd_retval(self, res, g):
        x, w = res
        return 2 * w * x * g, jnp.sum(x**2) * g


def _first(x, d, size):
    return jnp.broadcast_to(x, (size, *jnp.shape(x))) if d is None else jnp.moveaxis(x, d, 0)


class WeightedSquaresWholeBatch(WeightedSquares):
    calls = []

    def vjp_bwd_batched(self, axis_size, in_dims, res, res_dims, g, g_dims):
        type(self).calls.append((axis_size, in_dims))
        x, w = (_first(v, d, axis_size) for v, d in zip(res, res_dims))
        g = _first(g, g_dims, axis_size)
        ct_x = 2 * (w * g)[:, None] * x
        ct_w = jnp.sum(x**2, axis=1) * g
        return ct_x, (ct_w if in_dims[1] is not None else jnp.sum(ct_w))


class WeightedSquaresDeclines(WeightedSquares):
    def vjp_bwd_batched(self, axis_size, in_dims, res, res_dims, g, g_dims):
        return None


def test_vjp_bwd_batched_takes_the_whole_batch():
    """A primitive's own backward pass for a whole vmap batch: used for grad of vmap,
    batch axes not first included; the shared input's cotangent is the summed one."""
    xs = jnp.arange(12.0).reshape(3, 4) / 10
    ws = jnp.array([0.5, 2.0, -1.0])

    def loss(cls, xs, w, x_axis=0, w_axis=None):
        return jax.vmap(cls.apply, (x_axis, w_axis))(xs, w).sum()

    grad = jax.grad(loss, argnums=(1, 2))
    WeightedSquaresWholeBatch.calls.clear()
    for args in [(xs, 1.5), (xs, ws, 0, 0), (xs.T, 1.5, 1), (xs.T, ws, 1, 0)]:
        want = grad(WeightedSquares, *args)
        for cls in (WeightedSquaresWholeBatch, WeightedSquaresDeclines):
            got = grad(cls, *args)
            for a, b in zip(got, want):
                np.testing.assert_allclose(a, b, rtol=1e-6)
    np.testing.assert_allclose(
        grad(WeightedSquaresWholeBatch, xs, 1.5)[1], jnp.sum(xs**2), rtol=1e-6
    )
    assert [c[1] for c in WeightedSquaresWholeBatch.calls[:4]] == [
        (0, None),
        (0, 0),
        (1, None),
        (1, 0),
    ]
    # vmap of grad maps the one-element rule instead (no batch to take whole).
    per = jax.vmap(jax.grad(WeightedSquaresWholeBatch.apply, argnums=1), (0, None))(xs, 1.5)
    np.testing.assert_allclose(per, jnp.sum(xs**2, axis=1), rtol=1e-6)


def test_vjp_bwd_batched_must_return_one_cotangent_per_input():
    class Bad(WeightedSquares):
        def vjp_bwd_batched(self, axis_size, in_dims, res, res_dims, g, g_dims):
            return (g,)

    with pytest.raises(TypeError, match="vjp_bwd_batched must return None or a tuple"):
        jax.grad(lambda x: jax.vmap(Bad.apply, (0, None))(x, 1.0).sum())(jnp.ones((2, 3)))


def test_jit_traces_once():
    traces = []

    def f(x):
        traces.append(1)
        return Both.apply(x, x)

    g = jax.jit(jax.grad(lambda x: f(x).sum()))
    for _ in range(3):
        g(jnp.ones(3))
    assert len(traces) == 1


@pytest.mark.parametrize("entry", CATALOGUE, ids=lambda e: e.name)
def test_linearize_of_vmap(entry):
    xs = jnp.array([[0.3, -1.2, 2.0], [1.0, 0.5, -0.7]])
    if not entry.fwd:
        with pytest.raises(NotImplementedError):
            jax.linearize(jax.vmap(entry.fn), xs)[1](xs)
        return
    y, f_lin = jax.linearize(jax.vmap(entry.fn), xs)
    y_ref, f_ref = jax.linearize(jax.vmap(entry.ref), xs)
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(f_lin(jnp.cos(xs)), f_ref(jnp.cos(xs)), rtol=1e-5, atol=1e-6)
