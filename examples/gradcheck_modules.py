"""Check the derivatives of the four `solvers.nn` layers against finite differences.

`implicitdiff.check_grads` compares a function's forward-mode derivatives
(`jax.jvp`) with central finite differences along random directions, and its
reverse-mode derivatives (`jax.vjp`) with the forward ones through the identity
`<u, J v> = <J^T u, v>`. Here the function is a layer of `solvers.nn` seen as a
function of two arguments: the floating-point parameters of the module it
wraps (split off with `eqx.partition`) and the layer's input. Each layer is
tiny and runs in float64 (`jax_enable_x64`) with tight solver tolerances, so
that the finite differences are accurate to many digits:

* `DEQ`: the equilibrium of `z = tanh(W z + U x)`; input `x`;
* `NeuralODE`: an MLP vector field integrated over [0, 1]; input the initial state;
* `RootLayer`: the root of `z + 0.5 tanh(W z) - x`; input `x`;
* `ArgminLayer`: the minimiser of a smooth strictly convex objective; input `x`.

None of these derivatives comes from differentiating a solver's iterations:
the first, third and fourth are implicit (the implicit function theorem at the
solution), the second is the ODE solver's adjoint.

The script prints a pass/fail table (the largest relative error of each
layer's checks), exits with a non-zero status if any check fails, and saves a
bar chart of the largest relative errors to
`examples/out/gradcheck_modules.png` (`--out` to change the folder). Run it with

    python examples/gradcheck_modules.py           # second-order checks too
    python examples/gradcheck_modules.py --small   # first order only, for a smoke test
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax

jax.config.update("jax_enable_x64", True)

import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from implicitdiff import check_grads  # noqa: E402
from implicitdiff.gradcheck import GradCheckError  # noqa: E402
from solvers.nn import DEQ, ArgminLayer, NeuralODE, RootLayer  # noqa: E402

TIGHT = dict(rtol=1e-12, atol=1e-12)


class TanhCell(eqx.Module):
    W: jax.Array
    U: jax.Array

    def __call__(self, z, x):
        return jnp.tanh(self.W @ z + self.U @ x)


class Field(eqx.Module):
    mlp: eqx.nn.MLP

    def __call__(self, y, t):
        return self.mlp(y)


class Residual(eqx.Module):
    W: jax.Array

    def __call__(self, z, x):
        return z + 0.5 * jnp.tanh(self.W @ z) - x


class Objective(eqx.Module):
    A: jax.Array
    log_lam: jax.Array

    def __call__(self, z, x):
        # Strictly convex in z: a softplus data term plus a positive quadratic.
        fit = jnp.sum(jax.nn.softplus(self.A @ z - x))
        return fit + 0.5 * jnp.exp(self.log_lam) * jnp.sum(z**2)


def build(n, key):
    """The four layers (tiny, float64), each with an input."""
    keys = jax.random.split(key, 8)
    normal = lambda k, shape, scale: scale * jax.random.normal(k, shape, jnp.float64)
    x = normal(keys[0], (n,), 1.0)
    deq = DEQ(
        TanhCell(normal(keys[1], (n, n), 0.3 / np.sqrt(n)), normal(keys[2], (n, n), 1.0)),
        z_shape=(n,),
        max_steps=500,
        **TIGHT,
    )
    mlp = eqx.nn.MLP(n, n, 8, 1, activation=jnp.tanh, key=keys[3])
    mlp = jax.tree_util.tree_map(
        lambda a: a.astype(jnp.float64) if eqx.is_inexact_array(a) else a, mlp
    )
    # Backsolve: the continuous adjoint is differentiable to every order, which the
    # second-order reverse-over-reverse checks need (the checkpointed adjoint is
    # reverse mode once, then forward mode).
    node = NeuralODE(Field(mlp), adjoint="backsolve", rtol=1e-10, atol=1e-10)
    root = RootLayer(Residual(normal(keys[4], (n, n), 1.0 / np.sqrt(n))), z_shape=(n,), **TIGHT)
    argmin = ArgminLayer(
        Objective(normal(keys[5], (n, n), 1.0), jnp.float64(0.0)),
        z_shape=(n,),
        method="newton",
        **TIGHT,
    )
    ts = jnp.linspace(0.0, 1.0, 4, dtype=jnp.float64)
    return {
        "DEQ": (deq, lambda layer, x: layer(x), x),
        "NeuralODE": (node, lambda layer, y0: layer(y0, ts), x),
        "RootLayer": (root, lambda layer, x: layer(x), x),
        "ArgminLayer": (argmin, lambda layer, x: layer(x), x),
    }


def check_layer(layer, call, x, order):
    params, static = eqx.partition(layer, eqx.is_inexact_array)

    def f(params, x):
        return call(eqx.combine(params, static), x)

    try:
        rows = check_grads(f, (params, x), order=order, modes=("fwd", "rev"))
        return rows, None
    except GradCheckError as err:
        return err.rows, err
    except Exception as err:  # a transformation the layer does not support: a failure too
        return [], err


def plot(path, names, worst, passed):
    # `Figure` directly (not pyplot): no GUI backend is involved, so this works headless.
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4), layout="constrained")
    ax = fig.subplots()
    colors = ["C2" if ok else "C3" for ok in passed]
    ax.bar(names, np.maximum(worst, 1e-17), color=colors)
    ax.set_yscale("log")
    ax.set(ylabel="largest relative error", title="check_grads on the solvers.nn layers (float64)")
    fig.savefig(path, dpi=120)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="first-order checks only")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "out", help="where the plot goes"
    )
    args = parser.parse_args(argv)
    order = 1 if args.small else 2
    n = 3

    names, worst, passed = [], [], []
    print(f"check_grads (order {order}, forward and reverse, float64) on the solvers.nn layers:")
    for name, (layer, call, x) in build(n, jax.random.key(args.seed)).items():
        rows, err = check_layer(layer, call, x, order)
        rel = max((r.max_rel_err for r in rows), default=float("nan"))
        ok = err is None and all(r.passed for r in rows)
        names.append(name)
        worst.append(rel)
        passed.append(ok)
        status = "PASS" if ok else "FAIL"
        print(f"  {name:12s} {len(rows):3d} checks   max rel error {rel:.2e}   {status}")
        if err is not None:
            print(f"    {type(err).__name__}: {str(err).splitlines()[0]}")

    print("\nSummary:")
    print(f"  {sum(passed)}/{len(passed)} layers pass; worst relative error {max(worst):.2e}")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "gradcheck_modules.png"
    plot(path, names, np.array(worst), passed)
    print(f"\nSaved {path}")
    if not all(passed):
        sys.exit(1)


if __name__ == "__main__":
    main()
