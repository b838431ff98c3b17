"""Every example of JAX's hijax custom-derivative guide, written against `implicitdiff`.

The expected numbers are the values the guide prints (float32).
"""

from collections import namedtuple
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import grad, jit, jvp, vjp, vmap
from jax.lax import while_loop

from implicitdiff import (
    Primitive,
    Zero,
    apply_derived_linearization,
    instantiate_zeros,
    linearize_from_jvp,
    transpose_jvp,
    vjp_fwd_from_jvp,
)


def close(a, b, tol=1e-6):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


# --- TL;DR ------------------------------------------------------------------------


class SinTimesY(Primitive):
    def __init__(self, x_aval, y_aval):
        self.in_avals = (x_aval, y_aval)
        self.out_aval = x_aval
        self.params = {}
        super().__init__()

    def expand(self, x, y):
        return jnp.sin(x) * y

    def vjp_fwd(self, nzs_in, x, y):
        return self(x, y), (jnp.cos(x), jnp.sin(x), y)

    def vjp_bwd_retval(self, res, g):
        cos_x, sin_x, y = res
        return (cos_x * g * y, sin_x * g)

    def jvp(self, primals, tangents):
        (x, y), (x_dot, y_dot) = primals, tangents
        return self(x, y), jnp.cos(x) * x_dot * y + jnp.sin(x) * y_dot


def sin_times_y(x, y):
    return SinTimesY(jax.typeof(x), jax.typeof(y))(x, y)


def test_tldr():
    close(sin_times_y(2.0, 3.0), 2.7278922)
    y, y_dot = jvp(sin_times_y, (2.0, 3.0), (1.0, 0.0))
    close(y, 2.7278922)
    close(y_dot, -1.2484405)
    close(grad(sin_times_y)(2.0, 3.0), -1.2484405)


def test_tldr_apply_needs_no_wrapper():
    close(SinTimesY.apply(2.0, 3.0), 2.7278922)
    close(grad(SinTimesY.apply)(2.0, 3.0), -1.2484405)


# --- Numerical stability ----------------------------------------------------------


class Log1pExp(Primitive):
    def __init__(self, x_aval):
        self.in_avals = (x_aval,)
        self.out_aval = x_aval
        self.params = {}
        super().__init__()

    def expand(self, x):
        return jnp.log(1.0 + jnp.exp(x))

    def vjp_fwd(self, nzs_in, x):
        return self(x), x

    def vjp_bwd_retval(self, x, g):
        return ((1 - 1 / (1 + jnp.exp(x))) * g,)

    def jvp(self, primals, tangents):
        (x,), (x_dot,) = primals, tangents
        return self(x), (1 - 1 / (1 + jnp.exp(x))) * x_dot

    def batch_dim_rule(self, axis_data, in_dims):
        return in_dims[0]


def log1pexp(x):
    return Log1pExp(jax.typeof(x))(x)


def test_log1pexp():
    naive = lambda x: jnp.log(1.0 + jnp.exp(x))
    assert np.isnan(grad(naive)(100.0))
    close(grad(log1pexp)(100.0), 1.0)
    close(jit(log1pexp)(3.0), 3.0485873)
    close(jit(grad(log1pexp))(3.0), 0.95257413)
    close(vmap(jit(grad(log1pexp)))(jnp.arange(3.0)), [0.5, 0.7310586, 0.8807971])


def test_log1pexp_jaxpr_uses_stable_rule():
    text = str(jax.make_jaxpr(grad(log1pexp))(100.0))
    assert "implicitdiff_call" not in text or "log" not in text.split("implicitdiff_call")[-1]
    assert "sub" in text  # 1 - 1/(1+e^x): the stable formula is what runs


# --- Differentiation convention ---------------------------------------------------


class FOnRPlus(Primitive):
    def __init__(self, x_aval):
        self.in_avals = (x_aval,)
        self.out_aval = x_aval
        self.params = {}
        super().__init__()

    def expand(self, x):
        return x / (1 + jnp.sqrt(x))

    def vjp_fwd(self, nzs_in, x):
        return self(x), x

    def vjp_bwd_retval(self, x, g):
        return (((jnp.sqrt(x) + 2) / (2 * (jnp.sqrt(x) + 1) ** 2)) * g,)


def test_f_on_r_plus():
    assert np.isnan(grad(lambda x: x / (1 + jnp.sqrt(x)))(0.0))
    close(grad(lambda x: FOnRPlus(jax.typeof(x))(x))(0.0), 1.0)


# --- Gradient clipping ------------------------------------------------------------


class ClipGradient(Primitive):
    def __init__(self, lo_aval, hi_aval, x_aval):
        self.in_avals = (lo_aval, hi_aval, x_aval)
        self.out_aval = x_aval
        self.params = {}
        super().__init__()

    def expand(self, lo, hi, x):
        return x

    def vjp_fwd(self, nzs_in, lo, hi, x):
        return self(lo, hi, x), (lo, hi)

    def vjp_bwd_retval(self, res, g):
        lo, hi = res
        return (None, None, jnp.clip(g, lo, hi))

    def batch_dim_rule(self, axis_data, in_dims):
        return in_dims[2]


def clip_gradient(lo, hi, x):
    return ClipGradient(jax.typeof(lo), jax.typeof(hi), jax.typeof(x))(lo, hi, x)


def test_clip_gradient():
    t = jnp.linspace(0, 10, 1000)

    def clip_sin(x):
        return jnp.sin(clip_gradient(-0.75, 0.75, x))

    close(clip_sin(t), jnp.sin(t))
    close(vmap(grad(clip_sin))(t), jnp.clip(jnp.cos(t), -0.75, 0.75))
    # traced bounds under jit, and batched bounds under vmap
    f = jit(grad(lambda x, lo, hi: jnp.sin(clip_gradient(lo, hi, x))))
    close(f(0.0, -0.5, 0.5), 0.5)
    lo = jnp.array([-0.1, -0.2, -0.3])
    close(vmap(f, (None, 0, None))(0.0, lo, 0.2), [0.2, 0.2, 0.2])
    close(vmap(f, (None, 0, 0))(0.0, lo, -lo), [0.1, 0.2, 0.3])


# --- Python debugging: a recorded callback in place of pdb --------------------------


def test_debug_backward_pass_sees_values():
    seen = []

    class Debug(Primitive):
        def __init__(self, x_aval):
            self.in_avals = (x_aval,)
            self.out_aval = x_aval
            self.params = {}
            super().__init__()

        def expand(self, x):
            return x

        def vjp_fwd(self, nzs_in, x):
            return self(x), x

        def vjp_bwd_retval(self, x, g):
            seen.append((float(x), float(g)))  # concrete values: pdb would work here
            return (g,)

    def foo(x):
        y = x**2
        y = Debug(jax.typeof(y))(y)
        return jnp.sin(y)

    close(jax.grad(foo)(3.0), 6 * jnp.cos(9.0))
    assert len(seen) == 1
    close(seen[0][0], 9.0)
    close(seen[0][1], -0.91113025)


# --- Implicit differentiation: FixedPoint / newton_sqrt --------------------------------


class FixedPoint(Primitive):
    def __init__(self, a_aval, x_aval, *, f):
        self.in_avals = (a_aval, x_aval)
        self.out_aval = x_aval
        self.params = dict(f=f)
        super().__init__()

    def expand(self, a, x_guess):
        def cond_fun(carry):
            x_prev, x = carry
            return jnp.abs(x_prev - x) > 1e-6

        def body_fun(carry):
            _, x = carry
            return x, self.f(a, x)

        _, x_star = while_loop(cond_fun, body_fun, (x_guess, self.f(a, x_guess)))
        return x_star

    def vjp_fwd(self, nzs_in, a, x_guess):
        x_star = self(a, x_guess)
        return x_star, (a, x_star)

    def vjp_bwd_retval(self, res, x_star_bar):
        a, x_star = res
        _, vjp_a = vjp(lambda a: self.f(a, x_star), a)
        (a_bar,) = vjp_a(
            fixed_point(partial(rev_iter, self.f), (a, x_star, x_star_bar), x_star_bar)
        )
        return a_bar, jnp.zeros_like(x_star)


def rev_iter(f, packed, u):
    a, x_star, x_star_bar = packed
    _, vjp_x = vjp(lambda x: f(a, x), x_star)
    return x_star_bar + vjp_x(u)[0]


def fixed_point(f, a, x_guess):
    a_aval = jax.tree.map(jax.typeof, a)
    x_aval = jax.tree.map(jax.typeof, x_guess)
    return FixedPoint(a_aval, x_aval, f=f)(a, x_guess)


def newton_sqrt(a):
    update = lambda a, x: 0.5 * (x + a / x)
    return fixed_point(update, a, a)


def test_newton_sqrt():
    close(newton_sqrt(2.0), 1.4142135)
    close(jit(vmap(newton_sqrt))(jnp.array([1.0, 2.0, 3.0, 4.0])), [1.0, 1.4142135, 1.7320509, 2.0])
    close(grad(newton_sqrt)(2.0), 0.35355338)
    close(grad(grad(newton_sqrt))(2.0), -0.088388346, tol=1e-5)
    close(grad(jnp.sqrt)(2.0), 0.35355338)


def test_newton_sqrt_vmap_grad_and_grad_vmap():
    # The guide's FixedPoint has no batching rule; ours batches it automatically,
    # including vmap(grad), which needs the pytree residuals (a, x_star) batched.
    a = jnp.array([1.0, 2.0, 3.0, 4.0])
    expected = 0.5 / jnp.sqrt(a)
    close(vmap(grad(newton_sqrt))(a), expected, tol=1e-5)
    close(grad(lambda a: vmap(newton_sqrt)(a).sum())(a), expected, tol=1e-5)
    close(jit(vmap(grad(newton_sqrt)))(a), expected, tol=1e-5)


# --- Anatomy: Square, Mul, Sin, SinAD -------------------------------------------------


class Square(Primitive):
    def __init__(self, x_aval):
        self.in_avals = (x_aval,)
        self.out_aval = x_aval
        self.params = {}
        super().__init__()

    def expand(self, x):
        return x * x


def test_square():
    close(Square(jax.typeof(3.0))(3.0), 9.0)


def test_argument_types_are_checked():
    sq = Square(jax.typeof(3.0))
    with pytest.raises(TypeError, match="argument leaf 0"):
        sq(jnp.ones(3))


class Mul(Primitive):
    def __init__(self, x_aval, y_aval):
        self.in_avals = (x_aval, y_aval)
        self.out_aval = x_aval
        self.params = {}
        super().__init__()

    def expand(self, x, y):
        return x * y

    def vjp_fwd(self, nzs_in, x, y):
        return self(x, y), (x, y)

    def vjp_bwd_retval(self, res, g):
        x, y = res
        return (g * y, x * g)


def mul(x, y):
    return Mul(jax.typeof(x), jax.typeof(y))(x, y)


def test_mul():
    close(grad(mul)(2.0, 3.0), 3.0)
    close(grad(mul, 1)(2.0, 3.0), 2.0)


def test_mul_jaxpr_is_one_equation():
    jaxpr = jax.make_jaxpr(mul)(2.0, 3.0)
    assert len(jaxpr.jaxpr.eqns) == 1
    assert "Mul" in str(jaxpr)


class Sin(Primitive):
    def __init__(self, x_aval):
        self.in_avals = (x_aval,)
        self.out_aval = x_aval
        self.params = {}
        super().__init__()

    def expand(self, x):
        return jnp.sin(x)

    def jvp(self, primals, tangents):
        (x,), (x_dot,) = primals, tangents
        return self(x), jnp.cos(x) * x_dot


def test_sin_jvp_and_missing_vjp():
    s = lambda x: Sin(jax.typeof(x))(x)
    y, y_dot = jvp(s, (3.0,), (1.0,))
    close(y, 0.14112)
    close(y_dot, -0.9899925)
    with pytest.raises(NotImplementedError, match="vjp_fwd"):
        grad(s)(3.0)


class SinAD(Sin):
    lin = linearize_from_jvp
    linearized = apply_derived_linearization
    vjp_fwd = vjp_fwd_from_jvp
    vjp_bwd_retval = transpose_jvp


def test_sin_ad_derived_rules():
    s = lambda x: SinAD(jax.typeof(x))(x)
    close(grad(s)(3.0), -0.9899925)
    y, sin_lin = jax.linearize(s, 3.0)
    close(sin_lin(1.0), -0.9899925)
    close(grad(grad(s))(3.0), -0.14112)


# --- jaxprs and evaluation ------------------------------------------------------------


def test_noisy_expand_runs_eagerly_and_is_cached_under_jit(capsys):
    class Noisy(Primitive):
        def __init__(self, x_aval):
            self.in_avals = (x_aval,)
            self.out_aval = x_aval
            self.params = {}
            super().__init__()

        def expand(self, x):
            print("called expand!")
            return jnp.sin(x)

    noisy = lambda x: Noisy(jax.typeof(x))(x)
    close(noisy(3.0), 0.14112)
    assert capsys.readouterr().out.count("called expand!") == 1
    f = jit(noisy)
    close(f(3.0), 0.14112)
    close(f(3.0), 0.14112)
    assert capsys.readouterr().out.count("called expand!") == 1


class G(Primitive):
    def __init__(self, x_aval):
        self.in_avals = (x_aval,)
        self.out_aval = x_aval
        self.params = {}
        super().__init__()

    def expand(self, x):
        if x > 0:
            return jnp.sin(x)
        else:
            return jnp.cos(x)

    def vjp_fwd(self, nzs_in, x):
        return self(x), x

    def vjp_bwd_retval(self, x, g):
        if x > 0:
            return (2 * g,)
        else:
            return (3 * g,)


def test_python_control_flow_eagerly():
    g = lambda x: G(jax.typeof(x))(x)
    close(g(1.0), jnp.sin(1.0))
    close(g(-1.0), jnp.cos(-1.0))
    close(grad(g)(1.0), 2.0)
    close(grad(g)(-1.0), 3.0)


# --- vmap with batch_dim_rule ----------------------------------------------------------


class MulV(Mul):
    def batch_dim_rule(self, axis_data, in_dims):
        x_dim, y_dim = in_dims
        return y_dim if x_dim is None else x_dim


def test_mulv():
    m = lambda x, y: MulV(jax.typeof(x), jax.typeof(y))(x, y)
    x = jnp.arange(3.0)
    y = jnp.arange(3.0) + 1.0
    close(vmap(m)(x, y), [0.0, 2.0, 6.0])
    close(vmap(m, in_axes=(0, None))(x, 2.0), [0.0, 2.0, 4.0])
    close(vmap(grad(m))(x, y), [1.0, 2.0, 3.0])


# --- pytrees and symbolic zeros ----------------------------------------------------------

Point = namedtuple("Point", ["x", "y"])


class FPt(Primitive):
    def __init__(self, pt_aval):
        self.in_avals = (pt_aval,)
        self.out_aval = {"a": pt_aval.x, "b": (pt_aval.x, pt_aval.y)}
        self.params = {}
        super().__init__()

    def expand(self, pt):
        return {"a": pt.x**2, "b": (jnp.sin(pt.x), jnp.cos(pt.y))}

    def vjp_fwd(self, nzs_in, pt):
        return self(pt), pt

    def vjp_bwd_retval(self, pt, g):
        g = jax.tree.map(instantiate_zeros, g, is_leaf=lambda x: isinstance(x, Zero))
        a_bar, (b0_bar, b1_bar) = g["a"], g["b"]
        x_bar = 2 * pt.x * a_bar + jnp.cos(pt.x) * b0_bar
        y_bar = -jnp.sin(pt.y) * b1_bar
        return (Point(x_bar, y_bar),)


def test_fpt_pytrees_and_symbolic_zeros():
    seen = []

    class FPtSpy(FPt):
        def vjp_bwd_retval(self, pt, g):
            seen.append(g["b"][1])
            return super().vjp_bwd_retval(pt, g)

    f = lambda pt: FPtSpy(jax.tree.map(jax.typeof, pt))(pt)

    def fun(pt):
        dct = f(pt)
        return dct["a"] + dct["b"][0]

    pt = Point(1.0, 2.0)
    out = f(pt)
    close(out["a"], 1.0)
    close(out["b"][0], 0.84147096)
    close(out["b"][1], -0.41614684)
    g = grad(fun)(pt)
    assert isinstance(g, Point)
    close(g.x, 2.5403023)
    close(g.y, 0.0)
    assert isinstance(seen[0], Zero)  # the unused output's cotangent is symbolic


class Mul2(Primitive):
    def __init__(self, x_aval, y_aval):
        self.in_avals = (x_aval, y_aval)
        self.out_aval = x_aval
        self.params = {}
        super().__init__()

    def expand(self, x, y):
        return x * y

    def vjp_fwd(self, nzs_in, x, y):
        x_nz, y_nz = nzs_in
        self.seen_nzs.append((x_nz, y_nz))
        return self(x, y), (x if y_nz else None, y if x_nz else None)

    def vjp_bwd_retval(self, res, g):
        x, y = res
        return (g * y if y is not None else None, x * g if x is not None else None)


def test_mul2_nzs_in():
    Mul2.seen_nzs = []
    m = lambda x, y: Mul2(jax.typeof(x), jax.typeof(y))(x, y)
    close(grad(m, 0)(2.0, 3.0), 3.0)
    close(grad(m, 1)(2.0, 3.0), 2.0)
    assert Mul2.seen_nzs == [(True, False), (False, True)]


class Mul3(Primitive):
    def __init__(self, x_aval, y_aval):
        self.in_avals = (x_aval, y_aval)
        self.out_aval = x_aval
        self.params = {}
        super().__init__()

    def expand(self, x, y):
        return x * y

    def vjp_fwd(self, nzs_in, x, y):
        return self(x, y), (x, y)

    def vjp_bwd(self, res, g, x_acc, y_acc):
        x, y = res
        x_acc.accum(g * y)
        y_acc.accum(x * g)


def test_mul3_accumulators():
    m = lambda x, y: Mul3(jax.typeof(x), jax.typeof(y))(x, y)
    close(grad(m)(2.0, 3.0), 3.0)
    close(grad(m, 1)(2.0, 3.0), 2.0)
    close(jit(grad(lambda x: m(x, x)))(4.0), 8.0)  # two contributions accumulate
    close(vmap(grad(m))(jnp.arange(3.0), jnp.ones(3)), [1.0, 1.0, 1.0])


def test_defining_both_backward_forms_is_an_error():
    with pytest.raises(TypeError, match="both"):

        class Both(Mul3):
            def vjp_bwd_retval(self, res, g):
                return (g, g)


class Sin2(Sin):
    def lin(self, nzs_in, x):
        return self(x), jnp.cos(x)

    def linearized(self, cos_x, x_dot):
        return cos_x * x_dot


def test_sin2_linearize():
    s = lambda x: Sin2(jax.typeof(x))(x)
    y, f_lin = jax.linearize(s, 3.0)
    close(y, 0.14112)
    close(f_lin(1.0), -0.9899925)
    close(f_lin(2.0), -1.979985)
