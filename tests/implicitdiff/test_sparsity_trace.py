"""`linear_solve.sparsity_pattern(fn, x, method="trace")`: the Jacobian's pattern read
from the operations of `fn`.

Each case compares the traced pattern with the nonzero entries of the Jacobian
evaluated by forward mode at random points: the traced one must hold every one of them
(a missed entry would make `Sparse` build a wrong matrix), and for operations the tracer
follows exactly (stencils, slices, constant matrices, gathers at constant indices) it
must be equal to them.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

from implicitdiff import linear_solve

RNG = np.random.default_rng(0)
MASK = RNG.random((5, 5)) < 0.4
BATCHED = np.asarray(RNG.random((2, 3, 3)) < 0.5, float)
INDEX = np.array([2, 0, 1, 4, 3])


def _evaluated(fn, x, points=3):
    """The union of the Jacobian's nonzero entries at random points near `x`."""
    flat, unravel = ravel_pytree(x)

    def g(v):
        return ravel_pytree(fn(unravel(v)))[0]

    found = set()
    for _ in range(points):
        point = flat + jnp.asarray(RNG.normal(size=flat.size))
        jac = np.asarray(jax.jacfwd(g)(point))
        found |= set(zip(*np.nonzero(jac)))
    return found


def _traced(fn, x):
    p = linear_solve.sparsity_pattern(fn, x, method="trace")
    n = ravel_pytree(x)[0].size
    # The pattern always holds the diagonal; compare off it separately.
    return {(int(r), int(c)) for r, c in zip(p.rows, p.cols)}, {(i, i) for i in range(n)}


def _brusselator_line(y):
    # Two fields per point, stored point by point: bandwidths 2.
    u, v = y[0::2], y[1::2]
    lap = lambda w: jnp.concatenate([w[1:2], w[2:] + w[:-2], w[-2:-1]]) - 2 * w  # noqa: E731
    du = 1 + u * u * v - 4 * u + 0.02 * lap(u)
    dv = 3 * u - u * u * v + 0.02 * lap(v)
    return jnp.stack([du, dv], axis=1).reshape(-1)


def _grid(y):
    # A periodic 5-point stencil on a 4 x 5 grid, two fields per point.
    z = y.reshape(4, 5, 2)
    lap = sum(jnp.roll(z, s, a) for s in (1, -1) for a in (0, 1)) - 4 * z
    return (lap + z[..., ::-1] * z).reshape(-1)


EXACT = {
    "stencil on a line": (_brusselator_line, jnp.ones(16)),
    "periodic grid (roll)": (_grid, jnp.ones(40)),
    "constant sparse matrix": (lambda y: jnp.asarray(MASK, float) @ y, jnp.ones(5)),
    "batched constant matrices": (lambda y: jnp.einsum("bij,bj->bi", BATCHED, y), jnp.ones((2, 3))),
    "matrix on the right": (lambda y: jnp.einsum("bj,bji->bi", y, BATCHED), jnp.ones((2, 3))),
    "product of two unknowns": (lambda y: jnp.outer(y[:2], y[2:]).ravel()[:5], jnp.ones(5)),
    "matrix input": (lambda m: m @ m.T, jnp.ones((2, 2))),
    "pytrees": (
        lambda d: {"a": d["a"] * d["b"][0], "b": jnp.sin(d["b"])},
        {"a": jnp.ones(3), "b": jnp.ones(2)},
    ),  # fmt: skip
    "gather at constant indices": (lambda y: y[INDEX] * y, jnp.ones(5)),
    "scatter-add at constant indices": (
        lambda y: jnp.zeros(5).at[np.array([0, 0, 3])].add(y[:3] ** 2) + y,
        jnp.ones(5),
    ),
    "dynamic slice at a constant start": (
        lambda y: jnp.concatenate([jax.lax.dynamic_slice(y, (1,), (3,)), y[:2]]),
        jnp.ones(5),
    ),
    "padding and reversal": (lambda y: jnp.pad(y, (1, 1))[:-2] ** 2 + y[::-1], jnp.ones(5)),
    "reductions": (lambda y: y.reshape(2, 3).sum(0).repeat(2) * y, jnp.ones(6)),
    "where and custom_jvp": (lambda y: jnp.where(y > 0, jax.nn.relu(y), y**2), jnp.ones(5)),
    "zero derivatives": (
        lambda y: jnp.floor(y) * jax.lax.stop_gradient(y[::-1]) + y,
        jnp.ones(4),
    ),
    "split and transpose": (
        lambda y: jnp.concatenate([a.T.ravel() for a in jnp.split(y.reshape(2, 4), 2, 1)]),
        jnp.ones(8),
    ),
}


@pytest.mark.parametrize("name", list(EXACT))
def test_traced_pattern_is_exact_where_it_can_be(x64, name):
    fn, x = EXACT[name]
    traced, diagonal = _traced(fn, x)
    assert traced - diagonal == _evaluated(fn, x) - diagonal


SUPERSET = {
    "branches of cond": (
        lambda y: jax.lax.cond(y[0] > 0, lambda y: y * y[0], lambda y: jnp.roll(y, 1), y),
        jnp.ones(5),
    ),
    "while loop": (
        lambda y: jax.lax.fori_loop(0, 2, lambda i, y: y * 2 + jnp.roll(y, 1), y),
        jnp.ones(5),
    ),
    "cumsum and sort": (lambda y: jnp.cumsum(y) + jnp.sort(y), jnp.ones(5)),
    "traced index": (lambda y: y * y[jnp.argmax(y)], jnp.ones(5)),
    "linear solve": (lambda y: jnp.linalg.solve(jnp.eye(4) + jnp.outer(y, y), y), jnp.ones(4)),
}


@pytest.mark.parametrize("name", list(SUPERSET))
def test_traced_pattern_holds_every_entry(x64, name):
    fn, x = SUPERSET[name]
    traced, _ = _traced(fn, x)
    assert _evaluated(fn, x) <= traced


def test_traced_pattern_counts_known_couplings(x64):
    # Values a branch does not take still count; a coupling through a comparison
    # does not (its derivative is zero).
    traced, _ = _traced(lambda y: jnp.where(y[0] > 0, y, 2 * y), jnp.ones(4))
    assert traced == {(i, i) for i in range(4)}
    traced, _ = _traced(lambda y: jnp.sum(y) * jnp.ones(3), jnp.ones(3))
    assert len(traced) == 9


def test_traced_pattern_under_jit_and_vmap(x64):
    """Only shapes are used: it works on tracers, and a value closed over from the
    enclosing trace counts as unknown (so a traced matrix couples everything)."""

    @jax.jit
    def nnz(p):
        pattern = linear_solve.sparsity_pattern(
            lambda y: y * p[0] + jnp.roll(y, 1), p, method="trace"
        )
        return pattern.nnz

    assert int(nnz(jnp.ones(6))) == 12

    def coupled(a):
        pattern = linear_solve.sparsity_pattern(lambda y: a @ y, a[0], method="trace")
        assert pattern.nnz == 9
        return a

    jax.vmap(coupled)(jnp.ones((2, 3, 3)))


def test_traced_pattern_errors(x64):
    with pytest.raises(ValueError, match=r"dense as traced"):
        linear_solve.sparsity_pattern(lambda y: y * jnp.sum(y), jnp.ones(300), method="trace")
    with pytest.raises(ValueError, match=r"must return 4 values"):
        linear_solve.sparsity_pattern(lambda y: y[:3], jnp.ones(4), method="trace")
    with pytest.raises(ValueError, match=r"`method` must be 'probe' or 'trace'"):
        linear_solve.sparsity_pattern(lambda y: y, jnp.ones(4), method="exact")


def test_sparse_solve_on_a_traced_pattern(x64):
    """`Sparse` on the traced pattern solves as `Dense` does, in both directions."""
    n = 40
    weights = jnp.linspace(1.0, 2.0, n)

    def operator(v):
        return 4 * v + weights * jnp.roll(v, 3) - jnp.roll(v, -7)

    pattern = linear_solve.sparsity_pattern(operator, jnp.zeros(n), method="trace")
    assert pattern.nnz == 3 * n
    b = jnp.sin(jnp.arange(n, dtype=float))
    sparse = linear_solve.Sparse(pattern)
    np.testing.assert_allclose(sparse(operator, b), linear_solve.Dense()(operator, b), rtol=1e-12)
    grad = lambda solver: jax.grad(lambda b: jnp.sum(solver(operator, b) ** 2))(b)  # noqa: E731
    np.testing.assert_allclose(grad(sparse), grad(linear_solve.Dense()), rtol=1e-12)


@jax.custom_jvp
def _straight_through(v):
    return jnp.round(v)


_straight_through.defjvp(lambda p, t: (_straight_through(p[0]), t[0]))
SHIFT = np.eye(6, k=1)

EXACT_MORE = {
    "padding with a traced value": (
        lambda y: jnp.pad(y[:4], (0, 1), constant_values=y[0]) * y,
        jnp.ones(5),
    ),
    "reshape with dimensions": (
        lambda y: jax.lax.reshape(y.reshape(3, 4), (12,), dimensions=(1, 0)) ** 2,
        jnp.ones(12),
    ),
    "tile": (lambda y: jnp.tile(y[:2], 2) * y, jnp.ones(4)),
    "jax.checkpoint": (jax.checkpoint(_brusselator_line), jnp.ones(16)),
    "custom_jvp rule (straight-through)": (lambda y: _straight_through(y[::-1]), jnp.ones(5)),
}


@pytest.mark.parametrize("name", list(EXACT_MORE))
def test_traced_pattern_follows_what_jax_differentiates(x64, name):
    """Padding values, transposing reshapes, tiling, and the rule of a `custom_jvp`
    (the Jacobian JAX computes comes from it, not from the primal)."""
    fn, x = EXACT_MORE[name]
    traced, diagonal = _traced(fn, x)
    assert traced - diagonal == _evaluated(fn, x) - diagonal


def test_traced_pattern_holds_for_every_value_of_args(x64):
    """`args` are traced as unknowns: a coefficient that is zero now still couples;
    a value closed over is a constant."""
    fn = lambda y, t: -y + (t * SHIFT) @ y  # noqa: E731
    pattern = linear_solve.sparsity_pattern(fn, jnp.ones(6), method="trace", args=(0.0,))
    assert pattern.nnz == 11
    closed = linear_solve.sparsity_pattern(lambda y: fn(y, 0.0), jnp.ones(6), method="trace")
    assert closed.nnz == 6
    probed = linear_solve.sparsity_pattern(fn, jnp.ones(6), args=(1.0,))
    assert probed.nnz == 11


def test_traced_pattern_with_random_keys(x64):
    key = jax.random.key(0)
    fn = lambda y: y * jax.random.normal(key, y.shape) + jnp.roll(y, 1)  # noqa: E731
    assert linear_solve.sparsity_pattern(fn, jnp.ones(5), method="trace").nnz == 10


@jax.custom_vjp
def _rolled_twice(y):
    return jnp.roll(y, 1) * 2


_rolled_twice.defvjp(lambda y: (_rolled_twice(y), None), lambda r, g: (jnp.roll(g, -1) * 2,))


def test_traced_pattern_through_a_custom_vjp(x64):
    """A `custom_vjp` has no forward mode of its own: the function itself is traced."""
    fn = lambda y: _rolled_twice(y) + y  # noqa: E731
    assert linear_solve.sparsity_pattern(fn, jnp.ones(12), method="trace").nnz == 24


# Random compositions of the operations the tracer follows, each checked to hold every
# entry of the evaluated Jacobian.
_UNARY = [
    lambda v: jnp.sin(v),
    lambda v: v**2,
    lambda v: jnp.roll(v, 3),
    lambda v: v[::-1],
    lambda v: jnp.cumsum(v),
    lambda v: jnp.pad(v[2:], (1, 1), constant_values=v[0]),
    lambda v: v.reshape(3, 4).T.reshape(-1),
    lambda v: v[INDEX_12] * 2.0,
    lambda v: jnp.tile(v[:6], 2),
    lambda v: jnp.where(v > 0.5, v, jnp.exp(v)),
    lambda v: jnp.asarray(MASK_12, float) @ v,
    lambda v: v.reshape(2, 6).sum(0).repeat(2),
    lambda v: jnp.zeros(12).at[INDEX_12[:5]].add(v[:5]) + v,
    lambda v: jax.lax.dynamic_slice(jnp.concatenate([v, v]), (5,), (12,)),
    lambda v: jax.nn.softplus(v),
]
_BINARY = [
    lambda a, b: a * b,
    lambda a, b: a + jnp.roll(b, -1),
    lambda a, b: jnp.maximum(a, b[::-1]),
    lambda a, b: jnp.concatenate([a[:6], b[6:]]),
    lambda a, b: a / (1.5 + jnp.cos(b)),
]
INDEX_12 = np.random.default_rng(2).integers(0, 12, 12)
MASK_12 = np.random.default_rng(3).random((12, 12)) < 0.2


def _random_function(rng, depth):
    if depth == 0:
        return lambda v: v
    if rng.random() < 0.6:
        inner, op = _random_function(rng, depth - 1), _UNARY[rng.integers(len(_UNARY))]
        return lambda v: op(inner(v))
    left, right = _random_function(rng, depth - 1), _random_function(rng, depth - 1)
    op = _BINARY[rng.integers(len(_BINARY))]
    return lambda v: op(left(v), right(v))


@pytest.mark.parametrize("seed", range(30))
def test_random_compositions_hold_every_entry(x64, seed):
    fn = _random_function(np.random.default_rng(seed), 3)
    traced, _ = _traced(fn, jnp.ones(12))
    assert _evaluated(fn, jnp.ones(12)) <= traced


_LAPLACE = np.array([[0.0, 1.0, 0.0], [1.0, -4.0, 1.0], [0.0, 1.0, 0.0]])
_KERNEL = RNG.normal(size=(3, 2, 3, 2)) * (RNG.random((3, 2, 3, 2)) < 0.6)
# Two feature groups: output channels 0, 1 read input channel 0; 2, 3 read channel 1.
_GROUPED = RNG.normal(size=(4, 2, 3, 1)) * (RNG.random((4, 2, 3, 1)) < 0.6)


def _grouped(y, kernel, strides):
    # `_conv` in two feature groups, "SAME" padding.
    return _conv(y, kernel, window_strides=strides, padding="SAME", feature_group_count=2)


def _conv(y, kernel=_KERNEL, **kw):
    # Two input channels on a 5 x 4 grid (NHWC); the kernel (OHWI) has the output
    # channels (three for `_KERNEL`).
    z = y.reshape(1, 5, 4, 2)
    kernel = jnp.asarray(kernel, z.dtype)
    dn = jax.lax.conv_dimension_numbers(z.shape, kernel.shape, ("NHWC", "OHWI", "NHWC"))
    return jax.lax.conv_general_dilated(z, kernel, dimension_numbers=dn, **kw)


def _square(fn, n):
    # `fn`'s outputs repeated or cut to `n` values (a stage matrix is square).
    def square(y):
        out = jnp.ravel(fn(y))
        return jnp.tile(out, -(-n // out.size))[:n]

    return square


WINDOWS = {
    "convolve2d stencil": (
        lambda y: jax.scipy.signal.convolve2d(y.reshape(5, 6), _LAPLACE, mode="same") * y[0],
        jnp.ones(30),
    ),
    "conv NHWC, SAME, sparse kernel": (
        lambda y: _conv(y, window_strides=(1, 1), padding="SAME"),
        jnp.ones(40),
    ),
    "conv strided, explicit padding": (
        lambda y: _conv(y, window_strides=(2, 1), padding=((1, 0), (2, 1))),
        jnp.ones(40),
    ),
    "conv dilated input and kernel": (
        lambda y: _conv(
            y,
            window_strides=(1, 2),
            padding=((0, 1), (1, 0)),
            lhs_dilation=(2, 1),
            rhs_dilation=(1, 2),
        ),
        jnp.ones(40),
    ),
    "conv in the kernel": (
        lambda k: _conv(
            jnp.arange(40.0) % 3, k.reshape(3, 2, 3, 2), window_strides=(1, 1), padding="SAME"
        ),
        jnp.ones(36),
    ),
    "conv in both operands": (
        lambda v: _conv(v[:40], v[40:].reshape(3, 2, 3, 2), window_strides=(2, 2), padding="SAME"),
        jnp.ones(76),
    ),  # fmt: skip
    "conv with feature groups": (lambda y: _grouped(y, _GROUPED, (1, 1)), jnp.ones(40)),
    "depthwise conv, strided": (lambda y: _grouped(y, _GROUPED[::2], (2, 1)), jnp.ones(40)),
    "conv with feature groups, in the kernel": (
        lambda k: _grouped(jnp.arange(40.0) % 3, k.reshape(4, 2, 3, 1), (1, 1)),
        jnp.ones(24),
    ),
    "conv with feature groups, in both operands": (
        lambda v: _grouped(v[:40], v[40:].reshape(4, 2, 3, 1), (1, 2)),
        jnp.ones(64),
    ),
    "window sum, strided, padded, dilated": (
        lambda y: jax.lax.reduce_window(
            y.reshape(6, 5),
            0.0,
            jax.lax.add,
            (2, 3),
            (2, 1),
            ((1, 0), (1, 1)),
            base_dilation=(1, 2),
            window_dilation=(2, 1),
        ),
        jnp.ones(30),
    ),  # fmt: skip
    "average pooling": (
        lambda y: (
            jax.lax.reduce_window(y.reshape(4, 6), 0.0, jax.lax.add, (2, 2), (2, 2), "VALID") / 4
        ),
        jnp.ones(24),
    ),
}


@pytest.mark.parametrize("name", list(WINDOWS))
def test_traced_pattern_of_convolutions_and_windows(x64, name):
    """Convolutions (any layout, strides, padding, dilations; the kernel's zeros count
    where it is a constant) and window sums: exact."""
    fn, x = WINDOWS[name]
    fn = _square(fn, x.size)
    traced, diagonal = _traced(fn, x)
    assert traced - diagonal == _evaluated(fn, x) - diagonal


def test_traced_pattern_of_a_batch_grouped_convolution(x64):
    """Batch groups (a grouped convolution's kernel derivative) are not followed:
    every output depends on every input."""

    def fn(y):
        z = y.reshape(2, 5, 4, 1)  # two batch groups of one image each
        kernel = jnp.asarray(_GROUPED[:, :, :, :1], z.dtype)
        dn = jax.lax.conv_dimension_numbers(z.shape, kernel.shape, ("NHWC", "OHWI", "NHWC"))
        return jax.lax.conv_general_dilated(
            z, kernel, (1, 1), "SAME", dimension_numbers=dn, batch_group_count=2
        )

    fn = _square(fn, 40)
    traced, _ = _traced(fn, jnp.ones(40))
    assert _evaluated(fn, jnp.ones(40)) <= traced and len(traced) == 40 * 40


def test_traced_pattern_of_a_window_maximum(x64):
    """A window maximum's derivative picks one input of each window, which one depends
    on the point: the traced pattern holds the whole window, and nothing else."""

    def window_max(y):
        z = y.reshape(5, 4)
        return jax.lax.reduce_window(z, -jnp.inf, jax.lax.max, (2, 2), (1, 2), "SAME")

    fn = _square(window_max, 20)
    traced, _ = _traced(fn, jnp.ones(20))
    assert _evaluated(fn, jnp.ones(20), points=8) <= traced
    windows = _square(
        lambda y: jax.lax.reduce_window(y.reshape(5, 4), 0.0, jax.lax.add, (2, 2), (1, 2), "SAME"),
        20,
    )  # fmt: skip
    assert traced == _traced(windows, jnp.ones(20))[0]


def test_traced_pattern_of_max_pooling_gradient(x64):
    """The transpose of a window maximum's derivative (the gradient of max pooling)
    adds each window's source element to the input it selects: the traced pattern
    holds, for each input, the windows that reach it (the window sum's transposed
    pattern), and every entry of the evaluated Jacobian."""

    def pool(z, reduce, init):
        return jax.lax.reduce_window(z, init, reduce, (2, 3), (1, 1), "SAME")

    x0 = jnp.asarray(RNG.normal(size=(5, 4)))
    _, pull_back = jax.vjp(lambda z: pool(z, jax.lax.max, -jnp.inf), x0)

    def fn(y):  # the source depends on y, the selection does not
        return pull_back(y.reshape(5, 4) * y[::-1].reshape(5, 4))[0]

    traced, _ = _traced(fn, jnp.ones(20))
    assert _evaluated(fn, jnp.ones(20), points=8) <= traced
    summed, _ = _traced(lambda y: pool(y.reshape(5, 4), jax.lax.add, 0.0), jnp.ones(20))
    reversed_ = {(j, 19 - i) for i, j in summed}  # the source's y[::-1] part
    assert traced == {(j, i) for i, j in summed} | reversed_
