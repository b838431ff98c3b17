"""Tests for `implicitdiff.foreign`: host functions with JAX derivative and batching rules.

The NumpySort / NumpyTake pair and MyCube are the torch.func guide's
`torch.autograd.Function` examples, rewritten with `foreign`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.linalg
import scipy.special

from implicitdiff.foreign import Foreign, foreign, like


def fd_jacobian(f, x, eps=1e-6):
    """Central finite-difference Jacobian of f: R^n -> R^m (flattened), in float64."""
    x = np.asarray(x, np.float64)
    cols = []
    for i in range(x.size):
        e = np.zeros(x.size)
        e[i] = eps
        e = e.reshape(x.shape)
        cols.append((np.asarray(f(x + e)) - np.asarray(f(x - e))).ravel() / (2 * eps))
    return np.stack(cols, axis=-1)


# ---------------------------------------------------------------------------
# NumpySort / NumpyTake (torch guide, example 1 and the vmap section).

CALLS = {"sort_vmap": 0, "take_vmap": 0}


@foreign(out=lambda x, dim: (x, like(x, int), like(x, int)))
def numpy_sort(x, *, dim=-1):
    ind = np.argsort(x, axis=dim)
    ind_inv = np.argsort(ind, axis=dim)
    return np.take_along_axis(x, ind, axis=dim), ind, ind_inv


@foreign(out=lambda x, ind, ind_inv, dim: like(x, shape=ind.shape))
def numpy_take(x, ind, ind_inv, *, dim):
    return np.take_along_axis(x, ind, axis=dim)


def _sort_fwd(x, *, dim):
    out = numpy_sort(x, dim=dim)
    return out, (out[1], out[2])


def _sort_bwd(res, g, *, dim):
    ind, ind_inv = res
    return (numpy_take(g[0], ind_inv, ind, dim=dim),)


def _take_fwd(x, ind, ind_inv, *, dim):
    return numpy_take(x, ind, ind_inv, dim=dim), (ind, ind_inv)


def _take_bwd(res, g, *, dim):
    ind, ind_inv = res
    return numpy_take(g, ind_inv, ind, dim=dim), None, None


numpy_sort.defvjp(_sort_fwd, _sort_bwd)
numpy_take.defvjp(_take_fwd, _take_bwd)


@numpy_sort.defvmap
def _sort_vmap(axis_size, in_dims, x, *, dim):
    CALLS["sort_vmap"] += 1
    x = jnp.moveaxis(x, in_dims[0], 0)
    dim = dim if dim >= 0 else dim + x.ndim - 1
    return numpy_sort(x, dim=dim + 1), (0, 0, 0)


@numpy_take.defvmap
def _take_vmap(axis_size, in_dims, x, ind, ind_inv, *, dim):
    CALLS["take_vmap"] += 1
    logical_ndim = x.ndim if in_dims[0] is None else x.ndim - 1
    dim = dim if dim >= 0 else dim + logical_ndim

    def front(a, d):
        return jnp.broadcast_to(a, (axis_size, *a.shape)) if d is None else jnp.moveaxis(a, d, 0)

    x, ind, ind_inv = (front(a, d) for a, d in zip((x, ind, ind_inv), in_dims, strict=True))
    return numpy_take(x, ind, ind_inv, dim=dim + 1), 0


def sort(x, dim=-1):
    return numpy_sort(x, dim=dim)[0]


# No row (and only one column) is sorted by an involution, so mixing up a permutation
# and its inverse in a backward rule is caught.
X = jnp.array([[0.3, 0.2, -1.7, -0.2], [1.1, -1.3, 0.6, -1.0], [-1.1, 0.8, -1.8, -0.7]])
W = jnp.arange(12.0).reshape(3, 4) / 7.0 - 0.5


def test_sort_values_and_indices():
    s, ind, ind_inv = numpy_sort(X)
    np.testing.assert_allclose(s, jnp.sort(X, axis=-1))
    np.testing.assert_array_equal(ind, jnp.argsort(X, axis=-1))
    np.testing.assert_array_equal(jnp.take_along_axis(s, ind_inv, axis=-1), X)
    assert ind.dtype == jnp.int32 and s.dtype == X.dtype
    np.testing.assert_allclose(jax.jit(sort, static_argnums=1)(X, 0), jnp.sort(X, axis=0))
    np.testing.assert_allclose(numpy_take(X, ind, ind_inv, dim=-1), s)


@pytest.mark.parametrize("dim", [-1, 0, 1])
def test_sort_grad(dim):
    loss = lambda x: jnp.sum(sort(x, dim) * W)
    ref = jax.grad(lambda x: jnp.sum(jnp.sort(x, axis=dim) * W))(X)
    np.testing.assert_allclose(jax.grad(loss)(X), ref, rtol=1e-6)
    np.testing.assert_allclose(jax.jit(jax.grad(loss))(X), ref, rtol=1e-6)


def test_sort_grad_matches_finite_differences():
    loss = lambda x: jnp.sum(sort(x) ** 2 * W)
    g = jax.grad(loss)(X)
    fd = fd_jacobian(lambda x: np.sum(np.sort(x, axis=-1) ** 2 * np.asarray(W)), X, 1e-3)
    np.testing.assert_allclose(g.ravel(), fd.ravel(), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("in_axes", [0, 1])
def test_vmap_uses_batch_rule(in_axes):
    before = CALLS["sort_vmap"]
    out = jax.vmap(sort, in_axes=in_axes)(X)
    assert CALLS["sort_vmap"] == before + 1
    np.testing.assert_allclose(out, jnp.sort(jnp.moveaxis(X, in_axes, 0), axis=-1))
    # nested vmap: the rule calls numpy_sort, which is batched again by the same rule
    Y = jnp.stack([X, -X])
    np.testing.assert_allclose(jax.vmap(jax.vmap(sort))(Y), jnp.sort(Y, axis=-1))


def test_vmap_take_with_unbatched_operand():
    ind = jnp.argsort(X, axis=-1)
    before = CALLS["take_vmap"]
    # x is shared, the indices are batched: the rule broadcasts x
    inv = jnp.argsort(ind, axis=-1)
    out = jax.vmap(lambda i, j: numpy_take(X[0], i, j, dim=0))(ind, inv)
    assert CALLS["take_vmap"] == before + 1
    np.testing.assert_allclose(out, jnp.take_along_axis(jnp.broadcast_to(X[0], X.shape), ind, 1))


def test_grad_of_vmap_and_vmap_of_grad():
    loss = lambda x, w: jnp.sum(sort(x) ** 2 * w)
    ref = jax.vmap(jax.grad(lambda x, w: jnp.sum(jnp.sort(x) ** 2 * w)))(X, W)
    g_vmap = jax.grad(lambda x: jnp.sum(jax.vmap(loss)(x, W)))(X)
    v_grad = jax.vmap(jax.grad(loss))(X, W)
    np.testing.assert_allclose(g_vmap, ref, rtol=1e-5)
    np.testing.assert_allclose(v_grad, ref, rtol=1e-5)
    np.testing.assert_allclose(jax.jit(jax.vmap(jax.grad(loss)))(X, W), ref, rtol=1e-5)
    # gradient through the shared (unbatched) operand of take's batching rule
    ind = jnp.argsort(X, axis=-1)
    inv = jnp.argsort(ind, axis=-1)
    take = jax.vmap(lambda x, i, j: numpy_take(x, i, j, dim=0), (None, 0, 0))
    take_sum = lambda x: jnp.sum(take(x, ind, inv) * W)
    ref_t = jax.grad(
        lambda x: jnp.sum(jnp.take_along_axis(jnp.broadcast_to(x, X.shape), ind, 1) * W)
    )
    np.testing.assert_allclose(jax.grad(take_sum)(X[0]), ref_t(X[0]), rtol=1e-6)


def test_second_order_take_of_take():
    # d/dx sum(sort(x)**3) = 3 x**2 (a permutation); its gradient against v is 6 x v.
    f = lambda x: jnp.sum(sort(x) ** 3)
    v = W
    np.testing.assert_allclose(jax.grad(f)(X), 3 * X**2, rtol=1e-5)
    hvp = jax.grad(lambda x: jnp.sum(jax.grad(f)(x) * v))
    np.testing.assert_allclose(hvp(X), 6 * X * v, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(jax.jit(hvp)(X), 6 * X * v, rtol=1e-5, atol=1e-6)
    xs = jnp.stack([X, 2 * X])
    np.testing.assert_allclose(jax.vmap(hvp)(xs), 6 * xs * v, rtol=1e-5, atol=1e-6)
    # third order: every backward pass is another numpy_take
    g3 = jax.grad(lambda x: jnp.sum(jax.grad(lambda y: jnp.sum(jax.grad(f)(y) * v))(x)))(X)
    np.testing.assert_allclose(g3, 6 * v, rtol=1e-5)


def test_vmap_rule_negative_and_unbatched_out_dims():
    @foreign(out=lambda x: (x, like(x, shape=())))
    def twice_and_seven(x):
        return 2 * x, np.float32(7.0)

    @twice_and_seven.defvmap
    def _(n, dims, x):
        xt = jnp.moveaxis(x, dims[0], -1)  # batch axis last
        return (twice_and_seven(xt)[0], jnp.float32(7.0)), (-1, None)

    a, b = jax.vmap(twice_and_seven)(X)
    np.testing.assert_allclose(a, 2 * X)
    np.testing.assert_allclose(b, jnp.full(3, 7.0))


def test_pytrees_scan_and_checkpoint():
    @foreign(out=lambda d: {"s": d["a"], "p": d["a"]})
    def sum_prod(d):
        return {"s": d["a"] + d["b"], "p": d["a"] * d["b"]}

    sum_prod.defvjp(
        lambda d: (sum_prod(d), d),
        lambda d, g: ({"a": g["s"] + g["p"] * d["b"], "b": g["s"] + g["p"] * d["a"]},),
    )
    d = {"a": jnp.arange(3.0), "b": jnp.full(3, 2.0)}
    g = jax.grad(lambda d: jnp.sum(sum_prod(d)["p"] ** 2))(d)
    np.testing.assert_allclose(g["a"], 2 * d["a"] * d["b"] ** 2)
    np.testing.assert_allclose(g["b"], 2 * d["b"] * d["a"] ** 2)
    gv = jax.vmap(jax.grad(lambda d: sum_prod(d)["p"]))(d)
    np.testing.assert_allclose(gv["a"], d["b"])

    def body(c, x):
        return c + jnp.sum(sort(x) ** 2), None

    np.testing.assert_allclose(jax.grad(lambda x: jax.lax.scan(body, 0.0, x)[0])(X), 2 * X)
    ckpt = jax.checkpoint(lambda x: jnp.sum(sort(x) ** 2))
    np.testing.assert_allclose(jax.jit(jax.grad(ckpt))(X), 2 * X)


# ---------------------------------------------------------------------------
# The default batching rule: pure_callback's vmap_method, custom rules kept.


def _counting_sort(vmap_method):
    calls = []

    def host_sort(x, *, dim=-1):
        calls.append(x.shape)
        return np.sort(x, axis=dim), np.argsort(x, axis=dim)

    s = foreign(host_sort, out=lambda x, dim: (x, like(x, int)), vmap_method=vmap_method)
    s.defvjp(
        lambda x, *, dim: (s(x, dim=dim), s(x, dim=dim)[1]),
        lambda ind, g, *, dim: (
            jnp.put_along_axis(jnp.zeros_like(g[0]), ind, g[0], axis=dim, inplace=False),
        ),
    )
    return s, calls


@pytest.mark.parametrize("method", ["sequential", "expand_dims"])
def test_default_vmap(method):
    s, calls = _counting_sort(method)
    out = jax.vmap(lambda x: s(x)[0])(X)
    np.testing.assert_allclose(out, jnp.sort(X, axis=-1))
    assert calls == ([(4,)] * 3 if method == "sequential" else [(3, 4)])
    loss = lambda x, w: jnp.sum(s(x)[0] ** 2 * w)
    ref = jax.vmap(jax.grad(lambda x, w: jnp.sum(jnp.sort(x) ** 2 * w)))(X, W)
    np.testing.assert_allclose(jax.vmap(jax.grad(loss))(X, W), ref, rtol=1e-5)
    np.testing.assert_allclose(
        jax.jit(jax.grad(lambda x: jnp.sum(jax.vmap(loss)(x, W))))(X), ref, rtol=1e-5
    )


# ---------------------------------------------------------------------------
# MyCube (torch guide, example 2): an output that is a derivative.


@foreign(out=lambda x: (x, x))
def my_cube(x):
    return x**3, 3 * x**2


def _cube_fwd(x):
    out = my_cube(x)
    return out, (x, out[1])


def _cube_bwd(res, g):
    x, dx = res
    g_out, g_dx = g
    return (g_out * dx + g_dx * 6 * x,)


my_cube.defvjp(_cube_fwd, _cube_bwd)


def test_my_cube_second_order():
    cube = lambda x: my_cube(x)[0]
    for x in (-1.5, 0.4, 2.0):
        assert jax.grad(cube)(x) == pytest.approx(3 * x**2, rel=1e-6)
        assert jax.grad(jax.grad(cube))(x) == pytest.approx(6 * x, rel=1e-6)
        assert jax.jit(jax.grad(jax.grad(cube)))(x) == pytest.approx(6 * x, rel=1e-6)
    xs = jnp.linspace(-2.0, 2.0, 5)
    np.testing.assert_allclose(jax.vmap(jax.grad(jax.grad(cube)))(xs), 6 * xs, rtol=1e-6)


# ---------------------------------------------------------------------------
# SciPy functions with a jvp rule, checked in float64.

digamma = foreign(scipy.special.digamma)
polygamma1 = foreign(lambda x: scipy.special.polygamma(1, x))
gammaln = foreign(scipy.special.gammaln)
gammaln.defjvp(lambda p, t: (gammaln(*p), digamma(*p) * t[0]))
digamma.defjvp(lambda p, t: (digamma(*p), polygamma1(*p) * t[0]))


def test_gammaln_jvp_jacfwd(x64):
    x = jnp.array([0.7, 1.5, 3.2, 10.0])
    y, t = jax.jvp(gammaln, (x,), (jnp.ones_like(x),))
    assert y.dtype == jnp.float64
    np.testing.assert_allclose(y, scipy.special.gammaln(np.asarray(x)), rtol=1e-12)
    fd = fd_jacobian(scipy.special.gammaln, x)
    np.testing.assert_allclose(t, np.diag(fd), rtol=1e-7)
    np.testing.assert_allclose(jax.jacfwd(gammaln)(x), fd, rtol=1e-7, atol=1e-9)
    np.testing.assert_allclose(jax.jit(jax.jacfwd(gammaln))(x), fd, rtol=1e-7, atol=1e-9)
    # reverse mode is the transposed jvp rule; second order goes through digamma's jvp
    ref = jax.scipy.special.digamma(x)
    np.testing.assert_allclose(jax.grad(lambda x: jnp.sum(gammaln(x)))(x), ref, rtol=1e-12)
    np.testing.assert_allclose(jax.vmap(jax.grad(gammaln))(x), ref, rtol=1e-12)
    hess = jax.hessian(lambda x: jnp.sum(gammaln(x)))(x)
    np.testing.assert_allclose(hess, np.diag(scipy.special.polygamma(1, np.asarray(x))), rtol=1e-12)


@foreign(out=lambda a, b: b)
def solve(a, b):
    return scipy.linalg.solve(a, b)


@solve.defjvp
def _solve_jvp(primals, tangents):
    (a, b), (da, db) = primals, tangents
    x = solve(a, b)
    return x, solve(a, db - da @ x)


def _solve_fwd(a, b):
    x = solve(a, b)
    return x, (a, x)


def _solve_bwd(res, g):
    a, x = res
    lam = solve(a.T, g)
    return -jnp.outer(lam, x), lam


solve.defvjp(_solve_fwd, _solve_bwd)


def test_scipy_solve_forward_and_reverse(x64):
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.normal(size=(4, 4)) + 4 * np.eye(4))
    b = jnp.asarray(rng.normal(size=4))
    np.testing.assert_allclose(solve(a, b), jnp.linalg.solve(a, b), rtol=1e-12)
    fd_a = fd_jacobian(lambda a_: np.linalg.solve(a_, b), a)
    fd_b = fd_jacobian(lambda b_: np.linalg.solve(a, b_), b)
    for jac in (jax.jacfwd, jax.jacrev):
        ja, jb = jax.jit(jac(solve, argnums=(0, 1)))(a, b)
        np.testing.assert_allclose(ja.reshape(4, 16), fd_a, rtol=1e-6, atol=1e-8)
        np.testing.assert_allclose(jb, fd_b, rtol=1e-6, atol=1e-8)
    _, t = jax.jvp(solve, (a, b), (a * 0.1, b))
    _, t_ref = jax.jvp(jnp.linalg.solve, (a, b), (a * 0.1, b))
    np.testing.assert_allclose(t, t_ref, rtol=1e-10)
    # default (sequential) batching over a batch of right-hand sides, and its gradient
    bs = jnp.stack([b, 2 * b, -b])
    np.testing.assert_allclose(
        jax.vmap(solve, (None, 0))(a, bs), jnp.linalg.solve(a, bs.T).T, rtol=1e-12
    )
    g = jax.grad(lambda a: jnp.sum(jax.vmap(solve, (None, 0))(a, bs) ** 2))(a)
    g_ref = jax.grad(lambda a: jnp.sum(jnp.linalg.solve(a, bs.T) ** 2))(a)
    np.testing.assert_allclose(g, g_ref, rtol=1e-10)


# ---------------------------------------------------------------------------
# Errors.


def test_missing_rules_name_the_def_method():
    bare = foreign(np.sin)
    with pytest.raises(NotImplementedError, match=r"sin\.defvjp.*sin\.defjvp"):
        jax.grad(bare)(1.0)
    with pytest.raises(NotImplementedError, match=r"defjvp"):
        jax.jvp(bare, (1.0,), (1.0,))
    # numpy_sort has a reverse-mode rule only: forward mode names defjvp
    with pytest.raises(NotImplementedError, match=r"numpy_sort\.defjvp"):
        jax.jvp(sort, (X,), (X,))
    with pytest.raises(NotImplementedError, match=r"numpy_sort\.defjvp"):
        jax.jacfwd(sort)(X[0])
    no_vmap = foreign(np.cos, vmap_method=None)
    with pytest.raises(NotImplementedError, match=r"cos\.defvmap"):
        jax.vmap(no_vmap)(X)
    np.testing.assert_allclose(no_vmap(X), np.cos(X), rtol=1e-6)


def test_host_output_mismatch_names_the_function():
    @foreign(out=lambda x: like(x, shape=(3,)))
    def bad_shape(x):
        return x[:2]

    with pytest.raises(Exception, match=r"bad_shape.*shape \(2,\)"):
        jax.block_until_ready(bad_shape(jnp.ones(3)))
    with pytest.raises(Exception, match=r"bad_shape"):
        jax.block_until_ready(jax.jit(bad_shape)(jnp.ones(3)))

    @foreign(out=lambda x: like(x, int))
    def bad_dtype(x):
        return x * 0.5

    with pytest.raises(Exception, match=r"bad_dtype.*dtype float"):
        jax.block_until_ready(bad_dtype(jnp.ones(3)))

    @foreign(out=lambda x: (x, x))
    def bad_structure(x):
        return x

    with pytest.raises(Exception, match=r"bad_structure.*structure"):
        jax.block_until_ready(bad_structure(jnp.ones(3)))


def test_bad_parameters_and_rules():
    with pytest.raises(TypeError, match=r"numpy_sort.*'dim'.*not hashable"):
        numpy_sort(X, dim=[0])
    with pytest.raises(TypeError, match=r"numpy_sort.*'dim' is an array"):
        numpy_sort(X, dim=jnp.array(0))
    with pytest.raises(TypeError, match=r"numpy_sort.*axis"):
        numpy_sort(X, axis=0)
    with pytest.raises(ValueError, match="vmap_method"):
        foreign(np.sin, vmap_method="vectorized")
    with pytest.raises(TypeError, match=r"negative.*shape"):
        foreign(np.negative, out=lambda x: 3)(X)

    wrong_count = foreign(np.tanh)
    wrong_count.defvjp(lambda x: (wrong_count(x), x), lambda x, g: (g, g))
    with pytest.raises(TypeError, match=r"tanh\.defvjp.*one cotangent.*length 2"):
        jax.grad(lambda x: jnp.sum(wrong_count(x)))(X)

    wrong_vmap = foreign(np.exp)
    wrong_vmap.defvmap(lambda n, dims, x: (wrong_vmap(x[0]), 0))
    with pytest.raises(TypeError, match=r"exp\.defvmap.*shape"):
        jax.vmap(wrong_vmap)(X)


def test_foreign_object():
    assert isinstance(numpy_sort, Foreign)
    assert numpy_sort.__name__ == "numpy_sort" and "numpy_sort" in repr(numpy_sort)
    # the host function's default `dim=-1` reaches `out` and the rules (which require it)
    g = jax.grad(lambda x: jnp.sum(numpy_sort(x)[0] * W))(X)
    np.testing.assert_allclose(g, jax.grad(lambda x: jnp.sum(jnp.sort(x) * W))(X))
