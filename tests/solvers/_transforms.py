"""The transformation table shared by the solver tests: each entry maps a scalar
function `f(a)` to a transformed one, with the closed form it must match and the point
(a scalar, or a batch for the `vmap` entries)."""

import jax
import jax.numpy as jnp


def _scan_grad(f):
    def total(a):
        return jax.lax.scan(lambda c, a: (c + f(a), None), 0.0, a)[0]

    return jax.grad(total)


def transform_table(x, d1, d2, point, batch):
    """`{name: (transform, expected, point)}` for a solution `x(a)` with derivatives
    `d1`, `d2` (NumPy closed forms), at the scalar `point` and the array `batch`."""
    return {
        "grad": (lambda f: jax.grad(f), d1, point),
        "jvp": (lambda f: lambda a: jax.jvp(f, (a,), (jnp.ones_like(a),))[1], d1, point),
        "jacfwd": (lambda f: jax.jacfwd(f), d1, point),
        "jacrev": (lambda f: jax.jacrev(f), d1, point),
        "hessian": (lambda f: jax.hessian(f), d2, point),
        "grad(grad)": (lambda f: jax.grad(jax.grad(f)), d2, point),
        "jacfwd(grad)": (lambda f: jax.jacfwd(jax.grad(f)), d2, point),
        "jit(grad)": (lambda f: jax.jit(jax.grad(f)), d1, point),
        "linearize": (lambda f: lambda a: jax.linearize(f, a)[1](jnp.ones_like(a)), d1, point),
        "checkpoint": (lambda f: jax.grad(jax.checkpoint(f)), d1, point),
        "vmap": (lambda f: jax.vmap(f), x, batch),
        "vmap(grad)": (lambda f: jax.vmap(jax.grad(f)), d1, batch),
        "grad(vmap)": (lambda f: jax.grad(lambda a: jax.vmap(f)(a).sum()), d1, batch),
        "jit(vmap(grad))": (lambda f: jax.jit(jax.vmap(jax.grad(f))), d1, batch),
        "scan(grad)": (_scan_grad, d1, batch),
    }
