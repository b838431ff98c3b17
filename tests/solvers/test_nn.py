"""`solvers.nn`: the Equinox layers' values and gradients against closed forms and
independent computations, under Equinox/JAX transformations, serialisation and training."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from solvers import MAX_STEPS, SUCCESS
from solvers.nn import DEQ, ArgminLayer, NeuralODE, RootLayer

pytestmark = pytest.mark.usefixtures("fast_compiles")


# ---------------------------------------------------------------------------
# Wrapped modules.


class LinearCell(eqx.Module):
    W: jax.Array

    def __call__(self, z, x):
        return self.W @ z + x


class TanhCell(eqx.Module):
    W: jax.Array
    b: jax.Array

    def __call__(self, z, x):
        return jnp.tanh(self.W @ z + x + self.b)


class LinearField(eqx.Module):
    A: jax.Array

    def __call__(self, y, t):
        return self.A @ y


class LinearResidual(eqx.Module):
    A: jax.Array

    def __call__(self, z, x):
        return self.A @ z - x


class QuadraticField(eqx.Module):
    """`dy/dt = c y^2`: from `y(0) = 1` the solution `1 / (1 - c t)` blows up at `1 / c`."""

    c: jax.Array

    def __call__(self, y, t):
        return self.c * y**2


class Ridge(eqx.Module):
    log_lam: jax.Array

    def __call__(self, z, x):
        return jnp.sum((z - x) ** 2) + jnp.exp(self.log_lam) * jnp.sum(z**2)


def _rng(seed):
    return np.random.default_rng(seed)


def _contraction(n, norm, seed):
    """A random n x n matrix with spectral norm `norm`."""
    M = _rng(seed).standard_normal((n, n))
    return jnp.asarray(norm * M / np.linalg.norm(M, 2))


def _well_conditioned(n, seed):
    return jnp.asarray(_rng(seed).standard_normal((n, n)) + 3.0 * np.eye(n))


C = np.array([1.0, -2.0, 0.5])  # loss weights: L = C . z


def _loss(call):
    return lambda layer, x: jnp.dot(jnp.asarray(C, x.dtype), call(layer, x))


def _fd_grad(fun, X, eps=1e-6):
    """Central finite differences of a scalar function of one array, in float64."""
    X = np.asarray(X, np.float64)
    g = np.zeros_like(X)
    for i in np.ndindex(X.shape):
        E = np.zeros_like(X)
        E[i] = eps
        g[i] = (float(fun(jnp.asarray(X + E))) - float(fun(jnp.asarray(X - E)))) / (2 * eps)
    return g


# ---------------------------------------------------------------------------
# DEQ.


@pytest.mark.parametrize(
    "method,adjoint",
    [
        ("anderson", "gmres"),
        ("iterate", "neumann"),
        pytest.param("damped", "dense", marks=pytest.mark.slow),
        pytest.param("anderson", "auto", marks=pytest.mark.slow),
    ],
)
def test_deq_linear_closed_form(x64, method, adjoint):
    W = _contraction(3, 0.6, seed=0)
    x = jnp.asarray(_rng(1).standard_normal(3))
    deq = DEQ(LinearCell(W), z_shape=(3,), method=method, adjoint=adjoint, max_steps=500)
    IW = np.eye(3) - np.asarray(W)
    z_star = np.linalg.solve(IW, x)
    np.testing.assert_allclose(deq(x), z_star, rtol=1e-8, atol=1e-9)

    # L = c . z*, z* = (I - W)^-1 x: dL/dx = u, dL/dW = u z*^T with u = (I - W)^-T c
    u = np.linalg.solve(IW.T, C)
    g_deq = eqx.filter_grad(lambda m: jnp.dot(C, m(x)))(deq)
    g_x = jax.grad(lambda x: jnp.dot(C, deq(x)))(x)
    np.testing.assert_allclose(g_x, u, rtol=1e-7, atol=1e-8)
    np.testing.assert_allclose(g_deq.cell.W, np.outer(u, z_star), rtol=1e-7, atol=1e-8)


def _unrolled(cell, x, n):
    """Plain iteration from zeros, differentiated by ordinary autodiff (a scan)."""
    return jax.lax.fori_loop(0, n, lambda _, z: cell(z, x), jnp.zeros_like(x))


def test_deq_tanh_against_unrolled_iteration(x64):
    cell = TanhCell(_contraction(3, 0.5, seed=2), jnp.asarray(_rng(3).standard_normal(3)))
    x = jnp.asarray(_rng(4).standard_normal(3))
    deq = DEQ(cell, z_shape=(3,))
    unrolled = jax.jit(lambda c, x: _unrolled(c, x, n=80))
    z_ref = unrolled(cell, x)
    z = deq(x)
    np.testing.assert_allclose(z, z_ref, rtol=1e-8, atol=1e-9)
    np.testing.assert_allclose(z, cell(z, x), atol=1e-9)  # a fixed point

    def loss_deq(cell, x):
        z = DEQ(cell, z_shape=(3,))(x)
        return jnp.dot(C, z) + jnp.sum(z**2)

    def loss_ref(cell, x):
        z = unrolled(cell, x)
        return jnp.dot(C, z) + jnp.sum(z**2)

    g = jax.grad(loss_deq, argnums=(0, 1))(cell, x)
    g_ref = jax.grad(loss_ref, argnums=(0, 1))(cell, x)
    for a, b in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(g_ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-7, atol=1e-8)


def test_deq_gradient_independent_of_forward_steps(x64):
    # The backward pass uses only z* (implicit function theorem), not the forward
    # iterations: once converged, more forward steps change nothing.
    cell = TanhCell(_contraction(3, 0.1, seed=5), jnp.zeros(3))
    x = jnp.asarray(_rng(6).standard_normal(3))

    @eqx.filter_jit
    def grads(deq):
        z, info = deq(x, return_info=True)
        g = eqx.filter_grad(lambda m: jnp.dot(C, m(x, return_info=True)[0]))(deq)
        return z, info, g.cell.W

    def solve(max_steps):
        return grads(DEQ(cell, z_shape=(3,), max_steps=max_steps, throw=False))

    z10, info10, g10 = solve(10)
    z50, info50, g50 = solve(50)
    assert int(info50.status) == SUCCESS
    assert int(info10.steps) <= 11 and float(info10.residual) < 1e-7
    np.testing.assert_allclose(z10, z50, rtol=1e-7, atol=1e-8)
    np.testing.assert_allclose(g10, g50, rtol=1e-6, atol=1e-7)
    assert np.abs(np.asarray(g50)).max() > 1e-2
    # and a too-small budget is reported, not hidden
    _, info1 = DEQ(cell, z_shape=(3,), max_steps=1, throw=False)(x, return_info=True)
    assert int(info1.status) != SUCCESS


def test_deq_throw_false_needs_return_info(x64):
    deq = DEQ(LinearCell(_contraction(3, 0.5, seed=7)), z_shape=(3,), throw=False)
    x = jnp.ones(3)
    with pytest.raises(ValueError, match=r"DEQ: .*`throw=False`.*return_info=True"):
        deq(x)
    z, info = deq(x, return_info=True)
    assert int(info.status) == SUCCESS
    np.testing.assert_allclose(z, np.linalg.solve(np.eye(3) - np.asarray(deq.cell.W), x))


def test_deq_fixed_point_default_adjoint_on_a_cell_that_does_not_contract(x64):
    """`adjoint=None` (fixed_point's default) after Anderson, on z = W z + x with an
    eigenvalue of W near -1.5: the gradients match the closed form."""
    W = jnp.array([[-1.5, 0.2, 0.0], [0.1, 0.4, 0.3], [0.0, -0.2, 0.1]])
    assert np.max(np.abs(np.linalg.eigvals(np.asarray(W)))) > 1.4
    x = jnp.asarray(_rng(8).standard_normal(3))
    deq = DEQ(LinearCell(W), z_shape=(3,), adjoint=None, rtol=1e-12, atol=1e-12)
    IW = np.eye(3) - np.asarray(W)
    z_star = np.linalg.solve(IW, x)
    np.testing.assert_allclose(deq(x), z_star, rtol=1e-9, atol=1e-10)
    u = np.linalg.solve(IW.T, C)
    g_deq = eqx.filter_grad(lambda m: jnp.dot(C, m(x)))(deq)
    np.testing.assert_allclose(g_deq.cell.W, np.outer(u, z_star), rtol=1e-8, atol=1e-9)
    g_x = jax.grad(lambda x: jnp.dot(C, deq(x)))(x)
    np.testing.assert_allclose(g_x, u, rtol=1e-8, atol=1e-9)


def test_deq_return_info(x64):
    deq = DEQ(LinearCell(_contraction(3, 0.5, seed=7)), z_shape=(3,))
    x = jnp.ones(3)
    z, info = deq(x, return_info=True)
    assert int(info.status) == SUCCESS
    assert bool(info.converged)
    assert 1 <= int(info.steps) <= deq.max_steps
    np.testing.assert_allclose(z, deq(x), rtol=0, atol=0)
    np.testing.assert_allclose(z, deq.cell(z, x), atol=1e-9)


def test_deq_cell_wrong_shape_raises():
    class BadCell(eqx.Module):
        W: jax.Array

        def __call__(self, z, x):
            return jnp.concatenate([self.W @ z + x, z[:1]])  # shape (4,), not (3,)

    deq = DEQ(BadCell(0.1 * jnp.eye(3)), z_shape=(3,))
    with pytest.raises(TypeError, match=r"x_guess.*\[4\].*\[3\]"):
        deq(jnp.ones(3))


def test_deq_float32_input_float64_params(x64):
    W = _contraction(3, 0.5, seed=0)
    x = jnp.ones(3, jnp.float32)
    # The default z0 takes the dtype that the input and the parameters promote to.
    z = DEQ(LinearCell(W), z_shape=(3,))(x)
    assert z.dtype == jnp.float64
    np.testing.assert_allclose(z, np.linalg.solve(np.eye(3) - np.asarray(W), x), rtol=1e-6)


# ---------------------------------------------------------------------------
# NeuralODE.

TS = jnp.array([0.0, 0.5, 1.0])


def _expm_solution(A, y0, ts):
    return jnp.stack([jax.scipy.linalg.expm(A * t) @ y0 for t in ts])


@pytest.mark.parametrize(
    "adjoint", [pytest.param("backsolve", marks=pytest.mark.slow), "checkpoint"]
)
def test_neural_ode_linear_against_expm(x64, adjoint):
    A = jnp.array([[-0.5, 1.0], [-1.0, -0.3]])
    y0 = jnp.array([1.0, 0.5])
    ts = jnp.asarray(TS, jnp.float64)
    node = NeuralODE(LinearField(A), adjoint=adjoint, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(node(y0, ts), _expm_solution(A, y0, ts), rtol=1e-8, atol=1e-9)

    c = jnp.array([1.0, -2.0])

    def loss(A, y0):
        return jnp.dot(
            c, NeuralODE(LinearField(A), adjoint=adjoint, rtol=1e-10, atol=1e-10)(y0, ts)[-1]
        )

    g_A, g_y0 = jax.jit(jax.grad(loss, argnums=(0, 1)))(A, y0)
    # float64 finite differences of the layer itself, and of the expm closed form
    loss_jit = jax.jit(loss)
    np.testing.assert_allclose(g_A, _fd_grad(lambda A: loss_jit(A, y0), A), rtol=1e-6, atol=1e-7)
    g_fd = _fd_grad(lambda A: jnp.dot(c, jax.scipy.linalg.expm(A) @ y0), A)
    np.testing.assert_allclose(g_A, g_fd, rtol=1e-7, atol=1e-8)
    # and the gradient wrt the initial state: expm(A T)^T c
    np.testing.assert_allclose(g_y0, jax.scipy.linalg.expm(A).T @ c, rtol=1e-7, atol=1e-8)


def test_neural_ode_rk4_return_info(x64):
    A = jnp.array([[-1.0, 0.0], [0.0, -2.0]])
    y0 = jnp.array([1.0, 1.0])
    node = NeuralODE(LinearField(A), method="rk4", dt=0.01)
    ys, info = node(y0, jnp.asarray(TS, jnp.float64), return_info=True)
    np.testing.assert_allclose(ys[-1], jnp.exp(jnp.array([-1.0, -2.0])), rtol=1e-8)
    assert int(info.status) == SUCCESS
    assert int(info.steps) == 100


# ---------------------------------------------------------------------------
# RootLayer.


@pytest.mark.parametrize(
    "method", ["newton", *(pytest.param(m, marks=pytest.mark.slow) for m in ("chord", "broyden"))]
)
def test_root_layer_linear_closed_form(x64, method):
    A = _well_conditioned(3, seed=8)
    x = jnp.asarray(_rng(9).standard_normal(3))
    layer = RootLayer(LinearResidual(A), z_shape=(3,), method=method)
    z_star = np.linalg.solve(A, x)
    np.testing.assert_allclose(layer(x), z_star, rtol=1e-8, atol=1e-9)

    # L = c . A^-1 x: dL/dx = u, dL/dA = -u z*^T with u = A^-T c
    u = np.linalg.solve(np.asarray(A).T, C)
    g_layer = eqx.filter_grad(lambda m: jnp.dot(C, m(x)))(layer)
    g_x = jax.grad(lambda x: jnp.dot(C, layer(x)))(x)
    np.testing.assert_allclose(g_x, u, rtol=1e-8, atol=1e-9)
    np.testing.assert_allclose(g_layer.residual.A, -np.outer(u, z_star), rtol=1e-8, atol=1e-9)


def test_root_layer_nonlinear_fixed_point_identity(x64):
    # z + 0.1 tanh(W z) = x: the layer's gradient wrt x is (I + 0.1 diag(sech^2) W)^-T c
    class Res(eqx.Module):
        W: jax.Array

        def __call__(self, z, x):
            return z + 0.1 * jnp.tanh(self.W @ z) - x

    W = jnp.asarray(_rng(10).standard_normal((3, 3)))
    x = jnp.asarray(_rng(11).standard_normal(3))
    layer = RootLayer(Res(W), z_shape=(3,))
    z, info = layer(x, return_info=True)
    assert int(info.status) == SUCCESS
    np.testing.assert_allclose(layer.residual(z, x), 0.0, atol=1e-10)
    J = np.eye(3) + 0.1 * np.diag(1 - np.tanh(np.asarray(W @ z)) ** 2) @ np.asarray(W)
    g_x = jax.grad(lambda x: jnp.dot(C, layer(x)))(x)
    np.testing.assert_allclose(g_x, np.linalg.solve(J.T, C), rtol=1e-8, atol=1e-9)


# ---------------------------------------------------------------------------
# ArgminLayer.


@pytest.mark.parametrize("method", ["lbfgs", pytest.param("newton", marks=pytest.mark.slow)])
def test_argmin_layer_ridge_closed_form(x64, method):
    x = jnp.array([1.0, -2.0, 3.0])
    log_lam = 0.3
    lam = np.exp(log_lam)
    layer = ArgminLayer(Ridge(jnp.asarray(log_lam)), z_shape=(3,), method=method)
    np.testing.assert_allclose(layer(x), x / (1 + lam), rtol=1e-8, atol=1e-9)

    # L = c . x / (1 + lam): dL/dlog_lam = -lam (c . x) / (1 + lam)^2, dL/dx = c / (1 + lam)
    g_layer = eqx.filter_grad(lambda m: jnp.dot(C, m(x)))(layer)
    g_x = jax.grad(lambda x: jnp.dot(C, layer(x)))(x)
    np.testing.assert_allclose(
        g_layer.objective.log_lam, -lam * np.dot(C, x) / (1 + lam) ** 2, rtol=1e-7
    )
    np.testing.assert_allclose(g_x, C / (1 + lam), rtol=1e-7)


def test_argmin_layer_optax_method(x64):
    layer = ArgminLayer(
        Ridge(jnp.asarray(0.0)), z_shape=(3,), method=optax.sgd(0.2), max_steps=2000
    )
    x = jnp.array([1.0, -2.0, 3.0])
    np.testing.assert_allclose(layer(x), x / 2, rtol=1e-7, atol=1e-8)
    g = eqx.filter_grad(lambda m: jnp.dot(C, m(x)))(layer)
    np.testing.assert_allclose(g.objective.log_lam, -np.dot(C, x) / 4, rtol=1e-6)


# ---------------------------------------------------------------------------
# `throw=False` needs `return_info=True` (DEQ: `test_deq_throw_false_needs_return_info`).


def test_neural_ode_throw_false_needs_return_info(x64):
    ts = jnp.array([0.0, 0.5, 2.0])
    node = NeuralODE(QuadraticField(jnp.asarray(1.0)), throw=False)
    with pytest.raises(ValueError, match=r"NeuralODE: .*`throw=False`.*return_info=True"):
        node(jnp.asarray(1.0), ts)
    with pytest.raises(ValueError, match=r"NeuralODE: .*`throw=False`.*return_info=True"):
        eqx.filter_grad(lambda m: m(jnp.asarray(1.0), ts)[1])(node)
    # With the info, the blow-up at t = 1 comes back as a status and NaN past it.
    ys, info = node(jnp.asarray(1.0), ts, return_info=True)
    assert int(info.status) != SUCCESS and not bool(info.converged)
    assert abs(float(info.t_final) - 1.0) < 1e-3
    np.testing.assert_allclose(ys[1], 2.0, rtol=1e-5)  # 1 / (1 - 0.5)
    assert np.isnan(float(ys[2]))
    # and a solve that succeeds answers as with throw=True
    tight = NeuralODE(QuadraticField(jnp.asarray(-1.0)), rtol=1e-10, atol=1e-10, throw=False)
    ys, info = tight(jnp.asarray(1.0), ts, return_info=True)
    assert int(info.status) == SUCCESS
    np.testing.assert_allclose(ys, 1.0 / (1.0 + ts), rtol=1e-7)


def test_root_layer_throw_false_needs_return_info(x64):
    A = _well_conditioned(3, seed=8)
    x = jnp.asarray(_rng(9).standard_normal(3))
    layer = RootLayer(LinearResidual(A), z_shape=(3,), throw=False)
    with pytest.raises(ValueError, match=r"RootLayer: .*`throw=False`.*return_info=True"):
        layer(x)
    with pytest.raises(ValueError, match=r"RootLayer: .*`throw=False`.*return_info=True"):
        eqx.filter_grad(lambda m: jnp.dot(C, m(x)))(layer)
    z, info = layer(x, return_info=True)
    assert int(info.status) == SUCCESS
    np.testing.assert_allclose(z, np.linalg.solve(A, x), rtol=1e-8, atol=1e-9)
    # One Newton step reaches the root of a linear residual, but the step test needs a
    # second: with max_steps=1 the solve fails, and says so.
    short = RootLayer(LinearResidual(A), z_shape=(3,), max_steps=1, throw=False)
    _, info = short(x, return_info=True)
    assert int(info.status) == MAX_STEPS and int(info.steps) == 1


def test_argmin_layer_throw_false_needs_return_info(x64):
    x = jnp.array([1.0, -2.0, 3.0])
    layer = ArgminLayer(Ridge(jnp.asarray(0.0)), z_shape=(3,), method="newton", throw=False)
    with pytest.raises(ValueError, match=r"ArgminLayer: .*`throw=False`.*return_info=True"):
        layer(x)
    with pytest.raises(ValueError, match=r"ArgminLayer: .*`throw=False`.*return_info=True"):
        eqx.filter_grad(lambda m: jnp.dot(C, m(x)))(layer)
    z, info = layer(x, return_info=True)
    assert int(info.status) == SUCCESS
    np.testing.assert_allclose(z, x / 2, rtol=1e-8, atol=1e-9)
    # Two small gradient steps leave the minimiser far away: reported, not raised.
    slow = ArgminLayer(
        Ridge(jnp.asarray(0.0)), z_shape=(3,), method=optax.sgd(0.01), max_steps=2, throw=False
    )
    z, info = slow(x, return_info=True)
    assert int(info.status) == MAX_STEPS and int(info.steps) == 2
    assert float(jnp.max(jnp.abs(z - x / 2))) > 0.5


# ---------------------------------------------------------------------------
# All four layers: jit + value_and_grad, vmap, checkpoint, serialisation, training.


# Each factory returns `(layer, call)` with `call(layer, x) -> (3,)`. The fast set uses
# configurations that compile quickly; `default=True` (the slow set) the layers' defaults.


def _deq(default):
    cell = TanhCell(_contraction(3, 0.5, seed=12), jnp.asarray(_rng(13).standard_normal(3)))
    kw = {} if default else dict(method="iterate", adjoint="neumann")
    return DEQ(cell, z_shape=(3,), **kw), lambda m, x: m(x)


def _node(default):
    A = jnp.array([[-0.5, 1.0, 0.0], [-1.0, -0.3, 0.2], [0.0, 0.1, -0.4]])
    kw = dict(rtol=1e-9, atol=1e-9) if default else dict(method="rk4", dt=0.25)
    return NeuralODE(LinearField(A), **kw), lambda m, x: m(x, jnp.asarray(TS, x.dtype))[-1]


def _root(default):
    layer = RootLayer(LinearResidual(_well_conditioned(3, seed=14)), z_shape=(3,))
    return layer, lambda m, x: m(x)


def _argmin(default):
    kw = {} if default else dict(method="newton")
    return ArgminLayer(Ridge(jnp.asarray(0.3)), z_shape=(3,), **kw), lambda m, x: m(x)


LAYERS = {"deq": _deq, "neural_ode": _node, "root": _root, "argmin": _argmin}
CONFIGS = [
    *(pytest.param(name, False, id=name) for name in LAYERS),
    *(
        pytest.param(name, True, id=f"{name}-default", marks=pytest.mark.slow)
        for name in ("deq", "neural_ode", "argmin")
    ),
]
XS = _rng(15).standard_normal((4, 3))  # float64 NumPy: jnp arrays in float64 under `x64`


def _tree_allclose(a, b, **kw):
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert len(la) == len(lb) > 0
    for u, v in zip(la, lb, strict=True):
        np.testing.assert_allclose(u, v, **kw)


@pytest.mark.parametrize("name,default", CONFIGS)
def test_filter_jit_value_and_grad(x64, name, default):
    layer, call = LAYERS[name](default)
    loss = _loss(call)
    x = jnp.asarray(XS[0])
    v_eager, g_eager = eqx.filter_value_and_grad(loss)(layer, x)
    v_jit, g_jit = eqx.filter_jit(eqx.filter_value_and_grad(loss))(layer, x)
    np.testing.assert_allclose(v_jit, v_eager, rtol=1e-10)
    _tree_allclose(g_jit, g_eager, rtol=1e-8, atol=1e-10)
    # the gradient is not trivially zero and matches float64 finite differences in x
    loss_x = jax.jit(lambda x: loss(layer, x))
    g_x = jax.grad(loss_x)(x)
    np.testing.assert_allclose(g_x, _fd_grad(loss_x, x), rtol=1e-5, atol=1e-7)
    assert np.abs(np.asarray(jax.tree_util.tree_leaves(g_jit)[0])).max() > 1e-3


@pytest.mark.parametrize("name,default", CONFIGS)
def test_vmap_matches_loop(x64, name, default):
    layer, call = LAYERS[name](default)
    xs = jnp.asarray(XS)
    batched = jax.vmap(lambda x: call(layer, x))(xs)
    one = eqx.filter_jit(call)
    looped = jnp.stack([one(layer, x) for x in xs])
    np.testing.assert_allclose(batched, looped, rtol=1e-8, atol=1e-9)
    # and the gradient of a batched loss against the sum of per-example gradients
    loss = lambda m: jnp.sum(jax.vmap(lambda x: _loss(call)(m, x))(xs))
    g = eqx.filter_grad(loss)(layer)
    grad_one = eqx.filter_jit(eqx.filter_grad(_loss(call)))
    per_example = [grad_one(layer, x) for x in xs]
    g_loop = jax.tree_util.tree_map(lambda *gs: sum(gs), *per_example)
    _tree_allclose(g, g_loop, rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("name,default", CONFIGS)
def test_checkpoint_same_gradient(x64, name, default):
    layer, call = LAYERS[name](default)
    params, static = eqx.partition(layer, eqx.is_inexact_array)
    x = jnp.asarray(XS[1])

    def loss(params, x, remat):
        f = lambda p, x: call(eqx.combine(p, static), x)
        if remat:
            f = jax.checkpoint(f)
        return jnp.dot(C, f(params, x)) + jnp.sum(f(params, x) ** 2)

    g = jax.grad(loss, argnums=(0, 1))(params, x, False)
    g_remat = jax.grad(loss, argnums=(0, 1))(params, x, True)
    _tree_allclose(g_remat, g, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("name,default", CONFIGS)
def test_serialise_round_trip(x64, tmp_path, name, default):
    layer, call = LAYERS[name](default)
    path = tmp_path / f"{name}.eqx"
    eqx.tree_serialise_leaves(path, layer)
    # a skeleton with the same structure and other values: loading must overwrite them
    skeleton = jax.tree_util.tree_map(
        lambda a: jnp.zeros_like(a) if eqx.is_inexact_array(a) else a, layer
    )
    loaded = eqx.tree_deserialise_leaves(path, skeleton)
    _tree_allclose(loaded, layer, rtol=0, atol=0)
    for x in jnp.asarray(XS[:2]):
        np.testing.assert_array_equal(call(loaded, x), call(layer, x))
    # the static configuration survives
    assert jax.tree_util.tree_structure(loaded) == jax.tree_util.tree_structure(layer)


@pytest.mark.parametrize("name,default", CONFIGS)
def test_optax_training_decreases_loss(x64, name, default):
    layer, call = LAYERS[name](default)
    target = jnp.asarray(_rng(16).standard_normal((4, 3)))

    def loss(m):
        return jnp.mean((jax.vmap(lambda x: call(m, x))(jnp.asarray(XS)) - target) ** 2)

    opt = optax.adam(1e-2)
    state = opt.init(eqx.filter(layer, eqx.is_inexact_array))

    @eqx.filter_jit
    def step(m, state):
        value, g = eqx.filter_value_and_grad(loss)(m)
        updates, state = opt.update(g, state, m)
        return eqx.apply_updates(m, updates), state, value

    values = []
    for _ in range(4):
        layer, state, value = step(layer, state)
        values.append(float(value))
    values.append(float(loss(layer)))
    assert all(b < a for a, b in zip(values, values[1:])), values
    assert values[-1] < values[0] - 1e-4, values
