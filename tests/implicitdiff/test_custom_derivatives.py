"""Tests for implicitdiff.custom_derivatives: JAX parity plus the added features."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero

from implicitdiff.custom_derivatives import custom_jvp, custom_vjp


def make_sin_jvp(factor=1.0):
    """sin with a custom JVP; ``factor`` != 1 makes the rule observably non-autodiff."""

    @custom_jvp
    def f(x):
        return jnp.sin(x)

    @f.defjvp
    def f_jvp(primals, tangents):
        (x,), (t,) = primals, tangents
        return f(x), factor * jnp.cos(x) * t

    return f


def make_sin_vjp():
    @custom_vjp
    def f(x, y):
        return jnp.sin(x) * y

    def fwd(x, y):
        return f(x, y), (jnp.cos(x), jnp.sin(x), y)

    def bwd(res, g):
        cos_x, sin_x, y = res
        return (cos_x * g * y, sin_x * g)

    f.defvjp(fwd, bwd)
    return f


# ---------------------------------------------------------------- JAX parity


def test_custom_jvp_sin_under_transformations():
    f = make_sin_jvp(factor=2.0)  # rule says 2 cos(x): proves the rule is what runs
    x = jnp.linspace(-1.0, 1.0, 5)
    np.testing.assert_allclose(f(x), np.sin(x), rtol=1e-6)
    np.testing.assert_allclose(jax.jit(f)(x), np.sin(x), rtol=1e-6)
    np.testing.assert_allclose(jax.grad(f)(0.3), 2 * np.cos(0.3), rtol=1e-6)
    np.testing.assert_allclose(jax.jit(jax.grad(f))(0.3), 2 * np.cos(0.3), rtol=1e-6)
    y, t = jax.jvp(f, (x,), (jnp.ones_like(x),))
    np.testing.assert_allclose(y, np.sin(x), rtol=1e-6)
    np.testing.assert_allclose(t, 2 * np.cos(x), rtol=1e-6)
    np.testing.assert_allclose(jax.vmap(jax.grad(f))(x), 2 * np.cos(x), rtol=1e-6)
    np.testing.assert_allclose(
        jax.grad(lambda v: jax.vmap(f)(v).sum())(x), 2 * np.cos(x), rtol=1e-6
    )
    np.testing.assert_allclose(jnp.diag(jax.jacfwd(f)(x)), 2 * np.cos(x), rtol=1e-6)
    np.testing.assert_allclose(jnp.diag(jax.jacrev(f)(x)), 2 * np.cos(x), rtol=1e-6)
    lin_y, f_lin = jax.linearize(f, 0.3)
    np.testing.assert_allclose(f_lin(1.0), 2 * np.cos(0.3), rtol=1e-6)


def test_defjvps_matches_jax():
    mine = custom_jvp(lambda x, y: jnp.sin(x) * y)
    theirs = jax.custom_jvp(lambda x, y: jnp.sin(x) * y)
    for f in (mine, theirs):
        f.defjvps(
            lambda xd, out, x, y: 3.0 * jnp.cos(x) * xd * y, lambda yd, out, x, y: jnp.sin(x) * yd
        )
    args = (jnp.float32(0.7), jnp.float32(2.0))
    got = jax.grad(mine, argnums=(0, 1))(*args)
    want = jax.grad(theirs, argnums=(0, 1))(*args)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_allclose(got[0], 3 * np.cos(0.7) * 2.0, rtol=1e-6)

    nd = custom_jvp(lambda n, x: x * n, nondiff_argnums=(0,))
    with pytest.raises(TypeError, match="defjvps"):
        nd.defjvps(None, lambda xd, out, n, x: xd)


def test_custom_vjp_fwd_bwd():
    f = make_sin_vjp()
    x, y = jnp.float32(0.5), jnp.float32(3.0)
    np.testing.assert_allclose(f(x, y), np.sin(0.5) * 3.0, rtol=1e-6)
    gx, gy = jax.jit(jax.grad(f, argnums=(0, 1)))(x, y)
    np.testing.assert_allclose([gx, gy], [np.cos(0.5) * 3.0, np.sin(0.5)], rtol=1e-6)
    xs = jnp.linspace(0.0, 1.0, 4)
    np.testing.assert_allclose(jax.vmap(jax.grad(f), (0, None))(xs, y), np.cos(xs) * 3.0, rtol=1e-6)
    with pytest.raises(TypeError, match="forward-mode"):
        jax.jvp(lambda v: f(v, y), (x,), (1.0,))


def test_pytrees_in_and_out():
    @custom_vjp
    def f(params, x):
        return {"lin": params["w"] * x + params["b"], "sq": (x * x,)}

    def fwd(params, x):
        return f(params, x), (params, x)

    def bwd(res, g):
        params, x = res
        # Deliberately scaled gradient for b so the test sees this rule.
        d_params = {"w": g["lin"] * x, "b": 10.0 * g["lin"]}
        return d_params, g["lin"] * params["w"] + 2 * x * g["sq"][0]

    f.defvjp(fwd, bwd)
    params = {"w": jnp.float32(2.0), "b": jnp.float32(1.0)}

    def loss(p, x):
        out = f(p, x)
        return out["lin"] + out["sq"][0]

    gp, gx = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, jnp.float32(3.0))
    np.testing.assert_allclose([gp["w"], gp["b"], gx], [3.0, 10.0, 2.0 + 6.0], rtol=1e-6)


def test_symbolic_zeros_custom_jvp():
    seen = []

    @custom_jvp
    def f(x, y):
        return x * y

    def f_jvp(primals, tangents):
        x, y = primals
        xd, yd = tangents
        seen.append((type(xd) is SymbolicZero, type(yd) is SymbolicZero))
        tx = 0.0 if type(xd) is SymbolicZero else xd * y
        ty = 0.0 if type(yd) is SymbolicZero else x * yd
        return f(x, y), tx + ty

    f.defjvp(f_jvp, symbolic_zeros=True)
    assert f.symbolic_zeros
    np.testing.assert_allclose(jax.grad(f)(2.0, 5.0), 5.0)
    assert seen[-1] == (False, True)
    np.testing.assert_allclose(jax.grad(f, argnums=1)(2.0, 5.0), 2.0)
    assert seen[-1] == (True, False)


def test_symbolic_zeros_custom_vjp():
    flags = []

    @custom_vjp
    def f(x, y):
        return x * y

    def fwd(x, y):
        assert isinstance(x, CustomVJPPrimal)
        flags.append((x.perturbed, y.perturbed))
        return x.value * y.value, (x.value, y.value)

    def bwd(res, g):
        x, y = res
        return (g * y, g * x)

    f.defvjp(fwd, bwd, symbolic_zeros=True)
    np.testing.assert_allclose(jax.grad(f, argnums=1)(2.0, 5.0), 2.0)
    assert flags[-1] == (False, True)


def test_missing_rule_and_metadata():
    def documented(x):
        """Docstring kept."""
        return x

    f = custom_jvp(documented)
    with pytest.raises(AttributeError, match="No JVP defined"):
        f(1.0)
    g = custom_vjp(documented)
    with pytest.raises(AttributeError, match="No VJP defined"):
        g(1.0)
    for h in (f, g):
        assert h.__wrapped__ is documented
        assert h.__name__ == "documented"
        assert h.__doc__ == "Docstring kept."
    assert isinstance(f, jax.custom_jvp) and isinstance(g, jax.custom_vjp)
    assert "custom_jvp" in repr(f) and "custom_vjp" in repr(g)


def test_vmap_keeps_custom_rule_design_note():
    # The design note's example: f(x) = 2x whose rule claims a derivative of 3.
    @custom_vjp
    def f(x):
        return 2.0 * x

    f.defvjp(lambda x: (f(x), None), lambda _, g: (3.0 * g,))

    @custom_jvp
    def h(x):
        return 2.0 * x

    h.defjvp(lambda p, t: (h(*p), 3.0 * t[0]))
    for fn in (f, h):
        vmapped_sum = lambda x, fn=fn: jax.vmap(fn)(x).sum()
        np.testing.assert_allclose(jax.grad(fn)(1.0), 3.0)
        np.testing.assert_allclose(jax.vmap(jax.grad(fn))(jnp.ones(4)), [3.0] * 4)
        np.testing.assert_allclose(jax.grad(vmapped_sum)(jnp.ones(4)), [3.0] * 4)


def test_python_control_flow_eager():
    @custom_jvp
    def relu_ish(x):
        if x > 0:  # needs a concrete value: fine eagerly
            return x
        return 0.0 * x

    @relu_ish.defjvp
    def relu_jvp(primals, tangents):
        (x,), (t,) = primals, tangents
        slope = 5.0 if x > 0 else 0.5
        return relu_ish(x), slope * t

    assert jax.grad(relu_ish)(2.0) == 5.0
    assert jax.grad(relu_ish)(-2.0) == 0.5

    @custom_vjp
    def g(x):
        return x if x > 0 else -x

    g.defvjp(lambda x: (g(x), x), lambda x, ct: (7.0 * ct if x > 0 else -ct,))
    assert jax.grad(g)(1.0) == 7.0
    assert jax.grad(g)(-1.0) == -1.0


def test_higher_order_cube():
    @custom_jvp
    def cube(x):
        return x**3

    @cube.defjvp
    def cube_jvp(primals, tangents):
        (x,), (t,) = primals, tangents
        return cube(x), 3 * x**2 * t

    x = 1.5
    np.testing.assert_allclose(jax.grad(jax.grad(cube))(x), 6 * x, rtol=1e-6)
    np.testing.assert_allclose(jax.hessian(cube)(x), 6 * x, rtol=1e-6)
    np.testing.assert_allclose(jax.jacfwd(jax.jacrev(cube))(x), 6 * x, rtol=1e-6)
    xs = jnp.array([0.5, 1.0, 2.0])
    np.testing.assert_allclose(jax.vmap(jax.grad(jax.grad(cube)))(xs), 6 * xs, rtol=1e-6)


def test_scan_body_and_checkpoint():
    f = make_sin_jvp(factor=2.0)
    g = make_sin_vjp()

    def loop(x):
        def body(carry, _):
            return f(carry) + g(carry, 1.0), None

        return jax.lax.scan(body, x, None, length=2)[0]

    def reference(x):
        # Same chain of derivatives, written out: each step has slope 2cos(c) + cos(c).
        d, c = 1.0, x
        for _ in range(2):
            d = d * 3 * np.cos(c)
            c = 2 * np.sin(c)
        return d

    np.testing.assert_allclose(jax.grad(loop)(0.3), reference(0.3), rtol=1e-5)
    np.testing.assert_allclose(
        jax.jit(jax.grad(jax.checkpoint(loop)))(0.3), reference(0.3), rtol=1e-5
    )


def test_float64(x64):
    @custom_vjp
    def log1pexp(x):
        return jnp.log1p(jnp.exp(x))

    log1pexp.defvjp(lambda x: (log1pexp(x), x), lambda x, g: (g * jax.nn.sigmoid(x),))
    x = jnp.array([-30.0, 0.0, 30.0])
    assert x.dtype == jnp.float64
    out = jax.vmap(jax.grad(log1pexp))(x)
    assert out.dtype == jnp.float64
    np.testing.assert_allclose(out, 1 / (1 + np.exp(-np.array([-30.0, 0.0, 30.0]))), rtol=1e-14)

    f = make_sin_jvp()
    np.testing.assert_allclose(jax.grad(f)(jnp.float64(0.1)), np.cos(0.1), rtol=1e-15)


# ------------------------------------------------------ nondiff conventions


def test_callable_nondiff_custom_jvp():
    @partial(custom_jvp, nondiff_argnums=(0,))
    def app(fn, x):
        return fn(x)

    @app.defjvp
    def app_jvp(fn, primals, tangents):
        (x,), (t,) = primals, tangents
        return app(fn, x), 4.0 * t  # fake slope 4 to see the rule

    assert jax.grad(lambda x: app(jnp.sin, x))(0.2) == 4.0
    np.testing.assert_allclose(
        jax.jit(jax.vmap(jax.grad(partial(app, jnp.cos))))(jnp.ones(3)), [4.0] * 3
    )


def test_skip_app_custom_vjp():
    @partial(custom_vjp, nondiff_argnums=(0,))
    def skip_app(fn, x):
        return fn(x)

    def skip_app_fwd(fn, x):
        return skip_app(fn, x), None

    def skip_app_bwd(fn, _, g):
        return (g,)

    skip_app.defvjp(skip_app_fwd, skip_app_bwd)
    np.testing.assert_allclose(skip_app(jnp.sin, 0.5), np.sin(0.5), rtol=1e-6)
    assert jax.grad(lambda x: skip_app(jnp.sin, x))(0.5) == 1.0
    np.testing.assert_allclose(
        jax.jit(jax.vmap(jax.grad(lambda x: 2 * skip_app(jnp.exp, x))))(jnp.zeros(3)), [2.0] * 3
    )


def test_custom_jvp_accepts_traced_nondiff():
    # jax.custom_jvp already takes Tracers in nondiff positions; check that it still holds.
    @partial(custom_jvp, nondiff_argnums=(0,))
    def scaled_sin(s, x):
        return s * jnp.sin(x)

    @scaled_sin.defjvp
    def scaled_sin_jvp(s, primals, tangents):
        (x,), (t,) = primals, tangents
        return scaled_sin(s, x), 10.0 * s * jnp.cos(x) * t

    grad_x = jax.jit(jax.grad(lambda x, s: scaled_sin(s, x)))
    np.testing.assert_allclose(grad_x(0.3, 2.0), 20.0 * np.cos(0.3), rtol=1e-6)
    ss = jnp.array([1.0, 2.0, 3.0])
    np.testing.assert_allclose(
        jax.vmap(grad_x, (None, 0))(0.3, ss), 10 * ss * np.cos(0.3), rtol=1e-6
    )
    assert jax.grad(lambda s: scaled_sin(s, 0.3))(2.0) == 0.0  # nondiff: no derivative


def test_dynamic_nondiff_rule_errors():
    @partial(custom_vjp, nondiff_argnums=(0,))
    def f(s, x):
        return s * x

    f.defvjp(lambda s, x: s * x, lambda s, res, g: (s * g,))  # fwd forgets the residuals
    with pytest.raises(TypeError, match="must return a pair"):
        jax.grad(f, argnums=1)(jnp.float32(2.0), 1.0)
    f.defvjp(lambda s, x: (s * x, None), lambda s, res, g: s * g)  # bwd forgets the tuple
    with pytest.raises(TypeError, match="must return a tuple"):
        jax.grad(f, argnums=1)(jnp.float32(2.0), 1.0)


def clip_old_style():
    @partial(custom_vjp, nondiff_argnums=(0, 1))
    def clip_gradient(lo, hi, x):
        return x

    def fwd(lo, hi, x):
        return x, None

    def bwd(lo, hi, _, g):
        return (jnp.clip(g, lo, hi),)

    clip_gradient.defvjp(fwd, bwd)
    return clip_gradient


def clip_new_style():
    @jax.custom_vjp
    def clip_gradient(lo, hi, x):
        return x

    def fwd(lo, hi, x):
        return x, (lo, hi)

    def bwd(res, g):
        lo, hi = res
        return (None, None, jnp.clip(g, lo, hi))

    clip_gradient.defvjp(fwd, bwd)
    return clip_gradient


def test_clip_gradient_traced_bounds():
    old, new = clip_old_style(), clip_new_style()
    loss_old = lambda x, lo, hi: jnp.sin(old(lo, hi, x))
    loss_new = lambda x, lo, hi: jnp.sin(new(lo, hi, x))
    xs = jnp.array([0.0, 0.5, 1.0, 2.0])
    los = jnp.array([-0.1, 0.2, 0.0, -0.3])
    his = jnp.array([0.5, 0.6, 0.9, 0.2])
    expected = np.clip(np.cos(xs), los, his)  # the gradient of sin, clipped to [lo, hi]

    got = jnp.stack([jax.jit(jax.grad(loss_old))(x, lo, hi) for x, lo, hi in zip(xs, los, his)])
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    got_vmap = jax.jit(jax.vmap(jax.grad(loss_old)))(xs, los, his)
    np.testing.assert_allclose(got_vmap, expected, rtol=1e-6)
    np.testing.assert_allclose(got_vmap, jax.vmap(jax.grad(loss_new))(xs, los, his), rtol=1e-6)
    # vmap over the bounds only, x shared.
    np.testing.assert_allclose(
        jax.vmap(jax.grad(loss_old), (None, 0, 0))(0.5, los, his),
        np.clip(np.cos(0.5), los, his),
        rtol=1e-6,
    )
    # The bounds get a zero cotangent, like the None of the new style.
    assert jax.jit(jax.grad(loss_old, argnums=1))(0.5, -0.1, 0.2) == 0.0

    # Plain jax.custom_vjp rejects the same old-style code.
    @partial(jax.custom_vjp, nondiff_argnums=(0, 1))
    def jax_old(lo, hi, x):
        return x

    jax_old.defvjp(lambda lo, hi, x: (x, None), lambda lo, hi, _, g: (jnp.clip(g, lo, hi),))
    with pytest.raises(jax.errors.UnexpectedTracerError):
        jax.jit(jax.grad(lambda x, lo, hi: jax_old(lo, hi, x)))(0.5, -0.1, 0.2)


def test_dynamic_nondiff_mixed_pytree_middle_position_and_ints():
    @partial(custom_vjp, nondiff_argnums=(1,))
    def gather(x, spec, y):
        fn, idx = spec
        return fn(x[idx]) * y

    def fwd(x, spec, y):
        return gather(x, spec, y), (x, y)

    def bwd(spec, res, g):
        fn, idx = spec
        x, y = res
        dx = jnp.zeros_like(x).at[idx].add(100.0 * g * y)  # scaled: shows the rule ran
        return dx, jnp.sum(fn(x[idx]) * g)

    gather.defvjp(fwd, bwd)
    x = jnp.arange(4.0)
    idx = jnp.array([3, 1])
    loss = lambda x, idx, y: gather(x, (jnp.sin, idx), y).sum()
    gx, gy = jax.jit(jax.grad(loss, argnums=(0, 2)))(x, idx, 2.0)
    np.testing.assert_allclose(gx, [0.0, 200.0, 0.0, 200.0])
    np.testing.assert_allclose(gy, np.sin(3.0) + np.sin(1.0), rtol=1e-6)
    idxs = jnp.array([[0, 1], [2, 3]])
    gxs = jax.vmap(jax.grad(loss), (None, 0, None))(x, idxs, 1.0)
    np.testing.assert_allclose(gxs, [[100, 100, 0, 0], [0, 0, 100, 100]])


def test_dynamic_nondiff_with_symbolic_zeros():
    @partial(custom_vjp, nondiff_argnums=(0,))
    def scale(s, x, y):
        return s * x * y

    def fwd(s, x, y):
        assert not isinstance(s, CustomVJPPrimal)  # nondiff args arrive unwrapped
        return s * x.value * y.value, (x.value, y.value, x.perturbed)

    def bwd(s, res, g):
        x, y, x_perturbed = res
        return (s * y * g if x_perturbed else None, s * x * g)

    scale.defvjp(fwd, bwd, symbolic_zeros=True)
    np.testing.assert_allclose(
        jax.jit(jax.grad(scale, argnums=1))(jnp.float32(3.0), 2.0, 5.0), 15.0
    )
    np.testing.assert_allclose(jax.grad(scale, argnums=2)(jnp.float32(3.0), 2.0, 5.0), 6.0)


def test_nondiff_argnames():
    @partial(custom_vjp, nondiff_argnames=("lo", "hi"))
    def clip_gradient(lo, hi, x):
        return x

    clip_gradient.defvjp(lambda lo, hi, x: (x, None), lambda lo, hi, _, g: (jnp.clip(g, lo, hi),))
    assert clip_gradient.nondiff_argnums == (0, 1)
    assert jax.jit(jax.grad(lambda x, h: 3.0 * clip_gradient(-h, h, x)))(1.0, 0.5) == 0.5

    @partial(custom_jvp, nondiff_argnames=("n",), nondiff_argnums=(2,))
    def power(x, n, label):
        return x**n

    @power.defjvp
    def power_jvp(n, label, primals, tangents):
        assert label == "tag"
        (x,), (t,) = primals, tangents
        return power(x, n, label), n * x ** (n - 1) * t

    assert power.nondiff_argnums == (1, 2)
    np.testing.assert_allclose(jax.grad(power)(2.0, 3, "tag"), 12.0)
    np.testing.assert_allclose(
        jax.vmap(jax.grad(power), (0, 0, None))(
            jnp.array([1.0, 2.0]), jnp.array([2.0, 3.0]), "tag"
        ),
        [2.0, 12.0],
    )
    with pytest.raises(ValueError, match="nope"):
        custom_jvp(lambda x: x, nondiff_argnames=("nope",))


def test_keyword_arguments_and_defaults():
    seen = []

    @partial(custom_jvp, nondiff_argnames=("mode",))
    def f(x, y, scale=2.0, mode="sin"):
        return scale * (jnp.sin(x) if mode == "sin" else jnp.cos(x)) * y

    @f.defjvp
    def f_jvp(mode, primals, tangents):
        seen.append(len(primals))
        x, y, scale = primals
        xd, yd, sd = tangents
        base = jnp.sin(x) if mode == "sin" else jnp.cos(x)
        dbase = jnp.cos(x) if mode == "sin" else -jnp.sin(x)
        return f(x, y, scale, mode), scale * (dbase * xd * y + base * yd) + sd * base * y

    x, y = 0.4, 3.0
    np.testing.assert_allclose(f(y=y, x=x), 2 * np.sin(x) * y, rtol=1e-6)
    np.testing.assert_allclose(f(x, mode="cos", y=y, scale=1.0), np.cos(x) * y, rtol=1e-6)
    np.testing.assert_allclose(jax.grad(lambda v: f(y=y, x=v))(x), 2 * np.cos(x) * y, rtol=1e-6)
    np.testing.assert_allclose(
        jax.jit(jax.grad(lambda s: f(x, y, mode="cos", scale=s)))(1.0), np.cos(x) * y, rtol=1e-6
    )
    assert seen and set(seen) == {3}  # defaults are filled in, as in JAX

    @partial(custom_vjp, nondiff_argnums=(2,))
    def g(x, y=1.0, lo=-1.0):
        return x * y

    g.defvjp(
        lambda x, y, lo: (g(x, y, lo), (x, y)),
        lambda lo, res, ct: (jnp.maximum(res[1] * ct, lo), res[0] * ct),
    )
    np.testing.assert_allclose(jax.grad(lambda v: g(lo=0.5, x=v))(2.0), 1.0)
    np.testing.assert_allclose(jax.jit(jax.grad(lambda v, lo: g(v, lo=lo, y=0.1)))(2.0, 0.5), 0.5)
    np.testing.assert_allclose(jax.grad(g)(2.0), 1.0)

    def kwonly(x, *, k=1.0):
        return x * k

    h = custom_jvp(kwonly)
    h.defjvp(lambda p, t: (h(*p), t[0]))
    with pytest.raises(TypeError, match="resolved to positions"):
        h(1.0, k=2.0)


# ---------------------------------------------------------- closure errors


def closed_over_vjp(c):
    @custom_vjp
    def f(x):
        return x * c

    f.defvjp(lambda x: (f(x), x), lambda x, g: (g * c,))
    return f


def closed_over_jvp(c):
    @custom_jvp
    def f(x):
        return x * c

    f.defjvp(lambda p, t: (f(*p), t[0] * c))
    return f


def _loss(make):
    return lambda c: make(c)(jnp.ones(3)).sum()


CLOSURE_CASES = {
    "grad": lambda make: jax.grad(_loss(make))(jnp.ones(3)),
    "jit_grad": lambda make: jax.jit(jax.grad(_loss(make)))(jnp.ones(3)),
    "vmap_grad": lambda make: jax.vmap(jax.grad(_loss(make)))(jnp.ones((2, 3))),
    "grad_vmap": lambda make: jax.grad(
        lambda c: jax.vmap(lambda x: make(c)(x))(jnp.ones((2, 3))).sum()
    )(jnp.ones(3)),
}


@pytest.mark.parametrize("make", [closed_over_vjp, closed_over_jvp])
@pytest.mark.parametrize("case", sorted(CLOSURE_CASES))
def test_closure_error_names_value(make, case):
    with pytest.raises(TypeError) as info:
        CLOSURE_CASES[case](make)
    msg = str(info.value)
    assert "f32[3]" in msg and "argument" in msg and "closes over" in msg


def test_closure_error_in_jvp_and_scan():
    with pytest.raises(TypeError, match=r"f32\[\].*argument"):
        jax.jvp(lambda c: closed_over_jvp(c)(c), (1.0,), (1.0,))

    def scanned(c):
        body = lambda s, x: (s + closed_over_vjp(c)(x), None)
        return jax.lax.scan(body, jnp.zeros(2), jnp.ones((3, 2)))[0].sum()

    with pytest.raises(TypeError, match=r"f32\[2\].*argument"):
        jax.grad(scanned)(jnp.ones(2))

    def checkpointed(c):
        return jax.checkpoint(lambda x: closed_over_jvp(c)(x))(jnp.ones(2)).sum()

    with pytest.raises(TypeError, match=r"f32\[2\].*argument"):
        jax.jit(jax.grad(checkpointed))(jnp.ones(2))


def test_closure_error_through_nondiff_callable():
    @partial(custom_vjp, nondiff_argnums=(0,))
    def skip_app(fn, x):
        return fn(x)

    skip_app.defvjp(lambda fn, x: (skip_app(fn, x), None), lambda fn, _, g: (g,))
    assert jax.jit(jax.grad(lambda x: skip_app(lambda v: 3.0 * v, x)))(2.0) == 1.0
    with pytest.raises(TypeError, match=r"f32\[\].*argument"):
        jax.jit(jax.grad(lambda c: skip_app(lambda v: v * c, 1.0)))(2.0)


def test_closure_error_fallback_with_python_control_flow():
    # The pre-check can't trace this primal abstractly; JAX's leak error is reworded instead.
    def make(c):
        @custom_jvp
        def f(x):
            return x * c if x > 0 else x

        f.defjvp(lambda p, t: (f(*p), t[0]))
        return f

    with pytest.raises(TypeError, match=r"f32\[\].*argument"):
        jax.grad(lambda c: make(c)(jnp.float32(2.0)))(3.0)


@pytest.mark.parametrize("make", [closed_over_vjp, closed_over_jvp])
def test_closures_that_are_fine(make):
    # Closing over values that are not being differentiated is allowed, as in JAX.
    np.testing.assert_allclose(jax.jit(lambda c: make(c)(2.0))(3.0), 6.0)
    np.testing.assert_allclose(jax.vmap(lambda c: make(c)(2.0))(jnp.arange(3.0)), [0.0, 2.0, 4.0])
    np.testing.assert_allclose(jax.jit(lambda c: jax.grad(make(c))(2.0))(3.0), 3.0)
    np.testing.assert_allclose(jax.grad(lambda x, c: make(c)(x))(2.0, jnp.float32(3.0)), 3.0)
    np.testing.assert_allclose(
        jax.grad(lambda x, c: make(jax.lax.stop_gradient(c))(x) * c, argnums=1)(2.0, 3.0), 6.0
    )


def test_no_extra_tracing_without_differentiation():
    counts = {"mine": 0, "jax": 0}

    def build(cls, key):
        @cls
        def f(x):
            counts[key] += 1
            return jnp.sin(x)

        f.defjvp(lambda p, t: (f(*p), jnp.cos(p[0]) * t[0]))
        return f

    mine, theirs = build(custom_jvp, "mine"), build(jax.custom_jvp, "jax")
    jax.jit(lambda x: mine(x) * 2)(1.0)
    jax.jit(lambda x: theirs(x) * 2)(1.0)
    jax.vmap(mine)(jnp.ones(2))
    jax.vmap(theirs)(jnp.ones(2))
    mine(1.0)
    theirs(1.0)
    assert counts["mine"] == counts["jax"]


def test_nested_custom_functions():
    inner = make_sin_jvp(factor=2.0)

    @custom_vjp
    def outer(x):
        return inner(x) * 3.0

    def fwd(x):
        y, dy = jax.jvp(inner, (x,), (jnp.ones_like(x),))
        return 3.0 * y, dy

    outer.defvjp(fwd, lambda dy, g: (3.0 * dy * g,))
    np.testing.assert_allclose(jax.jit(jax.grad(outer))(0.2), 6 * np.cos(0.2), rtol=1e-6)
    np.testing.assert_allclose(
        jax.grad(lambda x: jax.vmap(outer)(x).sum())(jnp.zeros(2)), [6.0, 6.0], rtol=1e-6
    )


# ------------------------------------------------- how often user code runs, as in JAX


def _recording_vjp(cls, log, symbolic_zeros):
    """x * y + sin(z) with a custom VJP whose fwd appends its perturbed flags to ``log``."""

    @cls
    def f(x, y, z):
        return x * y + jnp.sin(z)

    def fwd(x, y, z):
        if symbolic_zeros:
            log.append(tuple(a.perturbed for a in (x, y, z)))
            x, y, z = x.value, y.value, z.value
        else:
            log.append("fwd")
        return x * y + jnp.sin(z), (x, y, z)

    def bwd(res, g):
        x, y, z = res
        return g * y, g * x, g * jnp.cos(z)

    f.defvjp(fwd, bwd, symbolic_zeros=symbolic_zeros)
    return f


FWD_CALL_CASES = {
    "grad_all": lambda f: jax.grad(f, argnums=(0, 1, 2))(2.0, 3.0, 0.5),
    "grad_x": lambda f: jax.grad(f)(2.0, 3.0, 0.5),
    "grad_y": lambda f: jax.grad(f, argnums=1)(2.0, 3.0, 0.5),
    "grad_xz": lambda f: jax.grad(f, argnums=(0, 2))(2.0, 3.0, 0.5),
    "grad_closure": lambda f: jax.grad(lambda y: f(2.0, y, 0.5))(3.0),
    "jit_grad_y": lambda f: jax.jit(jax.grad(f, argnums=1))(2.0, 3.0, 0.5),
    "grad_jit_y": lambda f: jax.grad(jax.jit(f), argnums=1)(2.0, 3.0, 0.5),
    "vjp_z": lambda f: jax.vjp(lambda z: f(2.0, 3.0, z), 0.5)[1](1.0),
    "jit_vjp_xy": lambda f: jax.jit(lambda x, y: jax.vjp(lambda a, b: f(a, b, 0.5), x, y)[1](1.0))(
        2.0, 3.0
    ),
    "value_and_grad_y": lambda f: jax.value_and_grad(f, argnums=1)(2.0, 3.0, 0.5),
    "jit_value_and_grad_x": lambda f: jax.jit(jax.value_and_grad(f))(2.0, 3.0, 0.5),
    "vmap_grad_y": lambda f: jax.vmap(jax.grad(f, argnums=1), (None, 0, None))(
        2.0, jnp.arange(3.0), 0.5
    ),
    "jit_vmap_grad_x": lambda f: jax.jit(jax.vmap(jax.grad(f), (0, None, None)))(
        jnp.arange(3.0), 3.0, 0.5
    ),
    "grad_vmap_x": lambda f: jax.grad(
        lambda x: jax.vmap(f, (None, 0, None))(x, jnp.arange(3.0), 0.5).sum()
    )(2.0),
    "grad_scan_y": lambda f: jax.grad(
        lambda y: jax.lax.scan(lambda c, _: (f(2.0, c, 0.5), None), y, None, length=2)[0]
    )(3.0),
}


@pytest.mark.parametrize("symbolic_zeros", [True, False])
@pytest.mark.parametrize("case", sorted(FWD_CALL_CASES))
def test_fwd_called_once_with_jax_perturbed_flags(case, symbolic_zeros):
    # Record every call of fwd (a Python side effect, so one entry per trace or eager call)
    # and compare with jax.custom_vjp on the same function: same count, same flags.
    mine, theirs = [], []
    got = FWD_CALL_CASES[case](_recording_vjp(custom_vjp, mine, symbolic_zeros))
    want = FWD_CALL_CASES[case](_recording_vjp(jax.custom_vjp, theirs, symbolic_zeros))
    assert theirs, "the case must run fwd"
    assert mine == theirs
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), got, want)


def test_fwd_called_once_with_traced_nondiff_array():
    # Arrays in nondiff positions take our own path through JAX; fwd still runs once, and the
    # differentiable arguments carry JAX's flags (JAX itself needs a static scale here).
    def build(cls, log, scale):
        @partial(cls, nondiff_argnums=(0,))
        def f(s, x, y):
            return s * x * y

        def fwd(s, x, y):
            log.append((x.perturbed, y.perturbed))
            return s * x.value * y.value, (x.value, y.value)

        f.defvjp(fwd, lambda s, res, g: (s * res[1] * g, s * res[0] * g), symbolic_zeros=True)
        return lambda x, y: f(scale, x, y)

    for transform in (lambda g: g, jax.jit):
        mine, theirs = [], []
        got = transform(jax.grad(build(custom_vjp, mine, jnp.float32(3.0)), argnums=1))(2.0, 5.0)
        want = transform(jax.grad(build(jax.custom_vjp, theirs, 3.0), argnums=1))(2.0, 5.0)
        assert mine == theirs == [(False, True)]
        np.testing.assert_allclose(got, want)


@pytest.mark.parametrize(
    "transform",
    [
        lambda f: jax.grad(f)(0.3),
        lambda f: jax.jit(jax.grad(f))(0.3),
        lambda f: jax.grad(jax.jit(f))(0.3),
        lambda f: jax.jvp(f, (0.3,), (1.0,)),
        lambda f: jax.hessian(f)(0.3),
    ],
    ids=["grad", "jit_grad", "grad_jit", "jvp", "hessian"],
)
def test_custom_jvp_rule_and_primal_run_as_often_as_in_jax(transform):
    def build(cls, log):
        @cls
        def f(x):
            log.append("fun")
            return jnp.sin(x)

        @f.defjvp
        def f_jvp(primals, tangents):
            log.append("jvp")
            (x,), (t,) = primals, tangents
            return jnp.sin(x), jnp.cos(x) * t

        return f

    mine, theirs = [], []
    got = transform(build(custom_jvp, mine))
    want = transform(build(jax.custom_jvp, theirs))
    assert mine == theirs
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), got, want)


@pytest.mark.parametrize("transform", [lambda g: g, jax.jit], ids=["eager", "jit"])
def test_fwd_outputs_that_are_not_arrays_as_in_jax(transform):
    # Python numbers and None among the residuals, and a string JAX rejects, reach JAX as a
    # direct call of fwd would hand them over.
    def build(cls, residuals):
        f = cls(lambda x: x**3)
        f.defvjp(lambda x: (x**3, residuals(x)), lambda res, g: (res[1] * res[2] ** 2 * g,))
        return f

    good = lambda x: (None, 3, x)
    np.testing.assert_allclose(
        transform(jax.grad(build(custom_vjp, good)))(2.0),
        transform(jax.grad(build(jax.custom_vjp, good)))(2.0),
    )
    bad = lambda x: ("tag", 3, x)
    with pytest.raises(TypeError) as theirs:
        transform(jax.grad(build(jax.custom_vjp, bad)))(2.0)
    with pytest.raises(TypeError) as mine:
        transform(jax.grad(build(custom_vjp, bad)))(2.0)
    assert str(mine.value).splitlines()[0] == str(theirs.value).splitlines()[0]
