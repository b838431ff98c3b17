"""Learn a logistic-regression penalty by implicit gradients (`solvers.nn.ArgminLayer`).

The data are scikit-learn's bundled breast-cancer set (569 tumours, 30
features, benign or malignant; no download), standardised, with a small
training set so that the penalty matters. The inner problem is L2-regularised
logistic regression,

    w*(lam) = argmin_w  mean_i log(1 + exp(-s_i (x_i . w + b))) + lam/2 |w|^2

(labels `s_i = +-1`; the intercept `b` is not penalised). It is an
`ArgminLayer`: the objective is an Equinox module whose only parameter is
`log_lam`, the training data are the layer's input, and the layer's output is
the minimiser, found by L-BFGS. The outer problem chooses `lam` to minimise the
validation log-loss of `w*(lam)`, by Adam on `log_lam`. The hypergradient
comes from the optimality condition `grad_w = 0` (one linear solve with the
Hessian at `w*`), never from the L-BFGS iterations, which are warm-started
from the previous solution at each step.

For comparison, a grid search evaluates the validation loss on a grid of
penalties (the layer `jax.vmap`ped over the grid). The script prints one line
per epoch (a fixed number of Adam steps) and a summary with the learned and the
grid's best penalties and their validation losses, and asserts that the
learned penalty lies within one grid cell of the grid's best point, with a
validation loss within 2% of it (with `--small`) or at least as good (at full
size, up to float32 noise). The plot
(validation loss against `lam`, with the learned value and the descent path
marked) goes to `examples/out/hyperparameter_argmin.png` (`--out` to change
the folder). Run it with

    python examples/hyperparameter_argmin.py           # full size, ~30 s on 2 CPU cores
    python examples/hyperparameter_argmin.py --small   # tiny sizes, for a smoke test

`examples/ridge_hyperparameter.py` tunes a ridge penalty with the functional
`solvers.minimize` instead, and checks its hypergradient in float64.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_breast_cancer

from solvers.nn import ArgminLayer

INNER = dict(rtol=1e-5, atol=1e-5, max_steps=2000)


class PenalisedLogLoss(eqx.Module):
    """The inner objective `objective(w, data)`; `log_lam` is the trained parameter."""

    log_lam: jax.Array

    def __call__(self, w, data):
        X, s = data
        margins = s * (X @ w[:-1] + w[-1])
        fit = jnp.mean(jax.nn.softplus(-margins))  # log(1 + exp(-margin)), stably
        return fit + 0.5 * jnp.exp(self.log_lam) * jnp.sum(w[:-1] ** 2)


def make_layer(log_lam, n_features, throw=True):
    return ArgminLayer(
        PenalisedLogLoss(jnp.asarray(log_lam, jnp.float32)),
        z_shape=(n_features + 1,),
        throw=throw,
        **INNER,
    )


def log_loss(w, X, s):
    return jnp.mean(jax.nn.softplus(-s * (X @ w[:-1] + w[-1])))


def validation_loss(layer, train, val, w0=None):
    """The outer objective; the inner solution and its info as auxiliaries."""
    w, info = layer(train, w0, return_info=True)
    return log_loss(w, *val), (w, info)


def load_data(n_train, n_val, seed):
    X, y = load_breast_cancer(return_X_y=True)
    order = np.random.default_rng(seed).permutation(len(X))
    train, val = order[:n_train], order[n_train : n_train + n_val]
    mean, std = X[train].mean(0), X[train].std(0)
    X = (X - mean) / std
    s = 2.0 * y - 1.0
    as_jax = lambda a: jnp.asarray(a, jnp.float32)
    return (as_jax(X[train]), as_jax(s[train])), (as_jax(X[val]), as_jax(s[val]))


def tune(layer, train, val, epochs, steps_per_epoch):
    total = epochs * steps_per_epoch
    # A decaying step: Adam's steps have a fixed size, so without decay it ends
    # oscillating around the optimum of this one-dimensional problem.
    optimizer = optax.adam(optax.cosine_decay_schedule(0.5, total, alpha=0.01), b1=0.5)
    opt_state = optimizer.init(eqx.filter(layer, eqx.is_inexact_array))

    @eqx.filter_jit
    def step(layer, opt_state, w_prev):
        (loss, (w, info)), grads = eqx.filter_value_and_grad(validation_loss, has_aux=True)(
            layer, train, val, w_prev
        )
        updates, opt_state = optimizer.update(grads, opt_state, layer)
        return eqx.apply_updates(layer, updates), opt_state, w, loss, grads, info.steps

    w = jnp.zeros(layer.z_shape)
    path, losses = [], []
    for epoch in range(epochs):
        start = time.perf_counter()
        inner = []
        for _ in range(steps_per_epoch):
            path.append(float(layer.objective.log_lam))
            layer, opt_state, w, loss, grads, n_inner = step(layer, opt_state, w)
            losses.append(float(loss))
            inner.append(int(n_inner))
        print(
            f"  epoch {epoch + 1:3d}/{epochs}   lam {np.exp(path[-1]):9.5f}"
            f"   validation log-loss {losses[-1]:.5f}"
            f"   dV/dlog(lam) {float(grads.objective.log_lam):+.2e}"
            f"   L-BFGS iterations {np.mean(inner):5.1f}   ({time.perf_counter() - start:.1f} s)"
        )
    # The loss at the final lam (the last update's result).
    final_loss, _ = eqx.filter_jit(validation_loss)(layer, train, val, w)
    path.append(float(layer.objective.log_lam))
    losses.append(float(final_loss))
    return layer, np.array(path), np.array(losses)


def grid_search(train, val, log_lams, n_features):
    """Validation loss on a grid of penalties: the layer vmapped over the grid."""

    @jax.jit
    @jax.vmap
    def losses(log_lam):
        # throw=False: an unconverged corner of the grid reports instead of raising.
        loss, (_, info) = validation_loss(make_layer(log_lam, n_features, throw=False), train, val)
        return loss, info.converged

    loss, converged = losses(log_lams)
    return np.asarray(loss), np.asarray(converged)


def plot(path, grid_lams, grid_losses, log_lam_path, losses):
    # `Figure` directly (not pyplot): no GUI backend is involved, so this works headless.
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4), layout="constrained")
    ax_curve, ax_loss = fig.subplots(1, 2)
    ax_curve.semilogx(grid_lams, grid_losses, "k.-", label="grid search")
    best = np.argmin(grid_losses)
    ax_curve.plot(grid_lams[best], grid_losses[best], "ks", mfc="none", ms=10, label="grid best")
    lams = np.exp(log_lam_path)
    ax_curve.semilogx(lams, losses, "C1.-", ms=3, lw=0.8, label="Adam on log(lam)")
    ax_curve.plot(lams[0], losses[0], "C1o", ms=8, label="start")
    ax_curve.plot(lams[-1], losses[-1], "C3*", ms=14, label="learned lam")
    ax_curve.set(xlabel="penalty lam", ylabel="validation log-loss", title="Validation loss")
    ax_curve.legend()
    ax_loss.plot(losses)
    ax_loss.axhline(grid_losses.min(), color="gray", ls="--", label="grid-search minimum")
    ax_loss.set(xlabel="Adam step", ylabel="validation log-loss", title="Hyper-parameter descent")
    ax_loss.legend()
    fig.savefig(path, dpi=120)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="fewer steps, coarser grid")
    parser.add_argument(
        "--epochs", type=int, help="epochs of 10 steps (default 10, 5 with --small)"
    )
    parser.add_argument("--lam0", type=float, default=1.0, help="starting penalty")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "out", help="where the plot goes"
    )
    args = parser.parse_args(argv)
    n_train, n_val, n_grid = (40, 250, 13) if args.small else (40, 529, 41)
    epochs, steps_per_epoch = args.epochs or (5 if args.small else 10), 10

    train, val = load_data(n_train, n_val, args.seed)
    n_features = train[0].shape[1]
    print(
        f"Breast cancer: {n_train} training and {n_val} validation tumours,"
        f" {n_features} features; L2-regularised logistic regression"
    )

    layer = make_layer(np.log(args.lam0), n_features)
    print(f"\nLearning lam ({epochs} epochs x {steps_per_epoch} Adam steps on log(lam)):")
    start = time.perf_counter()
    layer, log_lam_path, losses = tune(layer, train, val, epochs, steps_per_epoch)
    tune_time = time.perf_counter() - start
    lam, learned_loss = float(np.exp(log_lam_path[-1])), float(losses[-1])

    log_lams = np.linspace(np.log(1e-4), np.log(1e2), n_grid)
    grid_losses, converged = grid_search(train, val, jnp.asarray(log_lams, jnp.float32), n_features)
    assert converged.all(), f"inner solves did not converge at lam = {np.exp(log_lams[~converged])}"
    best = int(np.argmin(grid_losses))
    lam_grid, spacing = float(np.exp(log_lams[best])), float(log_lams[1] - log_lams[0])

    print("\nSummary:")
    print(f"  start lam    {args.lam0:10.5f}   validation log-loss {losses[0]:.5f}")
    print(f"  learned lam  {lam:10.5f}   validation log-loss {learned_loss:.5f}")
    print(
        f"  grid best    {lam_grid:10.5f}   validation log-loss {grid_losses[best]:.5f}"
        f"   ({n_grid} penalties in [1e-4, 1e2])"
    )
    print(f"  tuning time  {tune_time:.1f} s (including compilation)")
    assert learned_loss < losses[0], "the validation loss did not decrease"
    if epochs * steps_per_epoch >= 50:  # enough steps to get close from the default start
        assert abs(np.log(lam) - np.log(lam_grid)) <= spacing, (lam, lam_grid)
        assert learned_loss <= grid_losses[best] * 1.02, (learned_loss, grid_losses[best])
    if not args.small and epochs * steps_per_epoch >= 100:  # converged: beats the grid
        assert learned_loss <= grid_losses[best] * (1 + 1e-4), (learned_loss, grid_losses[best])

    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "hyperparameter_argmin.png"
    plot(path, np.exp(log_lams), grid_losses, log_lam_path, losses)
    print(f"\nSaved {path}")


if __name__ == "__main__":
    main()
