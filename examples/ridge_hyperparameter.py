"""Tune a ridge penalty by gradient descent on the validation loss (`solvers.minimize`).

The data are scikit-learn's bundled handwritten digits (8x8 images, 64 pixel
features, no download). We fit a linear one-vs-rest regression: 10 outputs,
one per digit, with targets 1 for the true digit and 0 otherwise, on a small
training set where the ridge penalty matters. For a penalty `lam` the
weights are

    w*(lam) = argmin_w  1/2 mean_i |x_i W + b - y_i|^2 + lam/2 |W|^2,

(the intercept `b` is not penalised), found by `minimize` (L-BFGS by
default). The penalty is then chosen to minimise the validation error
`V(lam) = mean((X_val W* + b* - Y_val)^2)`, by Adam on `log lam` (so `lam`
stays positive). The hypergradient `dV/dlog lam` comes from the implicit
function theorem applied to the optimality condition `grad_w = 0`: one linear
solve with the Hessian, never a derivative of the L-BFGS iterations.

The script checks the answer three ways:

* a grid search over `lam` (the inner problem vmapped over the grid) must find
  the same penalty as gradient descent;
* the hypergradient must match central finite differences, in float64;
* and it must match the gradient of the closed-form ridge solution
  `W = (Xc^T Xc / n + lam I)^{-1} Xc^T Yc / n`, also in float64.

The tuning runs in float32 (JAX's default); float64 is switched on only for
the gradient checks. The plot (validation loss against `lam`, with the
optimisation path) goes to `examples/out/ridge_hyperparameter.png` (`--out` to
change the folder). Run it with

    python examples/ridge_hyperparameter.py                 # full size, ~15 s on 2 CPU cores
    python examples/ridge_hyperparameter.py --small         # tiny sizes, for a smoke test
    python examples/ridge_hyperparameter.py --inner newton  # Newton for the inner problem

Most of the time is compilation.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits

from solvers import minimize


class Data(NamedTuple):
    X_train: jax.Array
    Y_train: jax.Array
    X_val: jax.Array
    Y_val: jax.Array


def load_data(n_train, n_val, seed, dtype=jnp.float32):
    """Digits, split at random, pixels standardised with the training statistics."""
    X, labels = load_digits(return_X_y=True)
    order = np.random.default_rng(seed).permutation(len(X))
    train, val = order[:n_train], order[n_train : n_train + n_val]
    mean, std = X[train].mean(0), X[train].std(0)
    std[std == 0] = 1.0  # some border pixels are blank in every training image
    X = (X - mean) / std
    Y = np.eye(10)[labels]  # one-vs-rest targets
    return Data(*(jnp.asarray(a, dtype) for a in (X[train], Y[train], X[val], Y[val])))


def predict(w, X):
    return X @ w["W"] + w["b"]


def train_loss(w, X, Y, log_lam):
    """The inner objective: squared error plus the ridge penalty on W (not on b)."""
    fit = 0.5 * jnp.mean(jnp.sum((predict(w, X) - Y) ** 2, axis=1))
    return fit + 0.5 * jnp.exp(log_lam) * jnp.sum(w["W"] ** 2)


def fit(log_lam, data, w0, method="lbfgs", **options):
    """The ridge weights for `exp(log_lam)`, and the solver's info.

    `minimize(fun, x0, *args)` minimises `fun(x, *args)` over `x` and is
    differentiable in `args`; here `x` is the pytree `{"W": ..., "b": ...}` and
    the hyper-parameter `log_lam` is one of the args. `w0` (e.g. the previous
    solution, to warm-start) gets no derivative.
    """
    return minimize(
        train_loss,
        w0,
        data.X_train,
        data.Y_train,
        log_lam,
        method=method,
        return_info=True,
        **options,
    )


def validation_loss(log_lam, data, w0, method="lbfgs", **options):
    """The outer objective; the fitted weights and info as auxiliaries."""
    w, info = fit(log_lam, data, w0, method, **options)
    return jnp.mean((predict(w, data.X_val) - data.Y_val) ** 2), (w, info)


def closed_form_validation_loss(log_lam, data):
    """The same outer objective with the inner problem solved exactly (the reference)."""
    X, Y = data.X_train, data.Y_train
    x_mean, y_mean = X.mean(0), Y.mean(0)
    Xc, Yc = X - x_mean, Y - y_mean  # the unpenalised intercept absorbs the means
    n, d = X.shape
    W = jnp.linalg.solve(
        Xc.T @ Xc / n + jnp.exp(log_lam) * jnp.eye(d, dtype=X.dtype), Xc.T @ Yc / n
    )
    w = {"W": W, "b": y_mean - x_mean @ W}
    return jnp.mean((predict(w, data.X_val) - data.Y_val) ** 2)


def zeros_like_weights(data):
    n_features, n_outputs = data.X_train.shape[1], data.Y_train.shape[1]
    dtype = data.X_train.dtype
    return {"W": jnp.zeros((n_features, n_outputs), dtype), "b": jnp.zeros(n_outputs, dtype)}


def tune(data, log_lam0, steps, method, print_every):
    """Adam on log(lam). Returns the path of log(lam) and the validation loss along it."""
    # A decaying step: Adam's steps have a fixed size, so without decay it ends
    # oscillating around the optimum instead of settling on it. Less momentum than
    # the default (b1 = 0.9) overshoots less on this one-dimensional problem.
    optimizer = optax.adam(optax.cosine_decay_schedule(0.3, steps, alpha=0.01), b1=0.5)

    # L-BFGS starts from the previous weights: lam changes little per step, so a warm
    # start saves most of the inner iterations. (Newton solves this quadratic problem
    # in one step from anywhere and gains nothing from it.)
    warm_start = method != "newton"

    @jax.jit
    def step(log_lam, opt_state, w_init):
        (loss, (w, info)), grad = jax.value_and_grad(validation_loss, has_aux=True)(
            log_lam, data, w_init, method
        )
        updates, opt_state = optimizer.update(grad, opt_state)
        return optax.apply_updates(log_lam, updates), opt_state, w, loss, grad, info.steps

    log_lam = jnp.asarray(log_lam0, data.X_train.dtype)
    opt_state, w_init = optimizer.init(log_lam), zeros_like_weights(data)
    path, losses = [], []
    # One more pass than updates, so the last entry is the loss at the final lam.
    for i in range(steps + 1):
        path.append(float(log_lam))
        new_log_lam, opt_state, w, loss, grad, n_inner = step(log_lam, opt_state, w_init)
        losses.append(float(loss))
        if i % print_every == 0 or i == steps:
            # 0 inner iterations: the warm start already meets the tolerance.
            print(
                f"  step {i:4d}   lam {np.exp(path[-1]):9.4f}   validation MSE {losses[-1]:.6f}"
                f"   dV/dlog(lam) {float(grad):+.2e}   {method} iterations {int(n_inner)}"
            )
        log_lam = new_log_lam
        if warm_start:
            w_init = w
    return np.array(path), np.array(losses)


def grid_search(data, log_lams, method):
    """Validation loss on a grid of penalties: the inner problem vmapped over the grid."""
    w0 = zeros_like_weights(data)
    losses = jax.jit(jax.vmap(lambda log_lam: validation_loss(log_lam, data, w0, method)[0]))
    return np.asarray(losses(log_lams))


def check_hypergradient(data, log_lam, method):
    """The implicit hypergradient vs finite differences and the closed form, in float64.

    float64 is needed only here: a finite difference in float32 loses about half
    of its 7 digits to cancellation.
    """
    with jax.enable_x64(True):
        data = Data(*(jnp.asarray(a, jnp.float64) for a in data))
        log_lam = jnp.float64(log_lam)
        w0 = zeros_like_weights(data)

        # One compiled function for the implicit gradient and the finite differences.
        value_and_grad = jax.jit(
            jax.value_and_grad(lambda log_lam: validation_loss(log_lam, data, w0, method)[0])
        )
        implicit = float(value_and_grad(log_lam)[1])
        eps = 1e-4
        up, down = value_and_grad(log_lam + eps)[0], value_and_grad(log_lam - eps)[0]
        fd = float((up - down) / (2 * eps))
        closed = float(jax.jit(jax.grad(closed_form_validation_loss))(log_lam, data))
        rel_fd = abs(implicit - fd) / abs(closed)
        rel_closed = abs(implicit - closed) / abs(closed)
        print(f"\nHypergradient check at lam = {np.exp(log_lam):.4g} (float64):")
        print(f"  implicit ({method})          {implicit:+.12e}")
        print(f"  finite differences         {fd:+.12e}   relative difference {rel_fd:.1e}")
        print(f"  closed-form ridge gradient {closed:+.12e}   relative difference {rel_closed:.1e}")
        assert rel_fd < 1e-6, f"hypergradient disagrees with finite differences ({rel_fd:.1e})"
        assert rel_closed < 1e-6, f"hypergradient disagrees with the closed form ({rel_closed:.1e})"


def plot(path, grid_lams, grid_losses, log_lam_path, losses):
    # `Figure` directly (not pyplot): no GUI backend is involved, so this works headless.
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4), layout="constrained")
    ax_curve, ax_loss = fig.subplots(1, 2)
    ax_curve.semilogx(grid_lams, grid_losses, "k-", label="grid search")
    best = np.argmin(grid_losses)
    ax_curve.plot(grid_lams[best], grid_losses[best], "ks", mfc="none", ms=10, label="grid best")
    lams = np.exp(log_lam_path)
    ax_curve.semilogx(lams, losses, "C1.-", ms=4, lw=0.8, label="Adam on log(lam)")
    ax_curve.plot(lams[0], losses[0], "C1o", ms=8, label="start")
    ax_curve.plot(lams[-1], losses[-1], "C3*", ms=14, label="end")
    ax_curve.set(xlabel="ridge penalty lam", ylabel="validation MSE", title="Validation loss")
    ax_curve.legend()
    ax_loss.plot(losses)
    ax_loss.axhline(grid_losses.min(), color="gray", ls="--", label="grid-search minimum")
    ax_loss.set(xlabel="Adam step", ylabel="validation MSE", title="Hyper-parameter descent")
    ax_loss.legend()
    fig.savefig(path, dpi=120)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="less data, fewer steps")
    parser.add_argument("--steps", type=int, help="Adam steps (default 100, 40 with --small)")
    parser.add_argument(
        "--inner", choices=("lbfgs", "newton"), default="lbfgs", help="inner solver"
    )
    parser.add_argument("--lam0", type=float, default=10.0, help="starting penalty")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "out", help="where the plot goes"
    )
    args = parser.parse_args(argv)
    n_train, n_val, n_grid = (100, 300, 21) if args.small else (200, 1597, 41)
    steps = args.steps or (40 if args.small else 100)

    data = load_data(n_train, n_val, args.seed)
    print(
        f"Digits: {n_train} training and {len(data.X_val)} validation images,"
        f" {data.X_train.shape[1]} features, {data.Y_train.shape[1]} one-vs-rest outputs"
    )
    log_lam0 = np.log(args.lam0)
    check_hypergradient(data, log_lam0, args.inner)

    print(f"\nTuning lam ({steps} Adam steps on log(lam), inner solver {args.inner!r}):")
    start = time.perf_counter()
    log_lam_path, losses = tune(data, log_lam0, steps, args.inner, max(1, steps // 10))
    lam, final_loss = float(np.exp(log_lam_path[-1])), float(losses[-1])
    print(f"  {time.perf_counter() - start:.1f} s; lam = {lam:.4f}")

    log_lams = jnp.linspace(np.log(1e-3), np.log(1e2), n_grid)
    grid_losses = grid_search(data, log_lams, args.inner)
    best = int(np.argmin(grid_losses))
    lam_grid = float(np.exp(log_lams[best]))
    spacing = float(log_lams[1] - log_lams[0])
    print(f"\nGrid search over {n_grid} penalties in [1e-3, 1e2]:")
    print(f"  best grid lam   {lam_grid:.4f}   validation MSE {grid_losses[best]:.6f}")
    print(f"  gradient lam    {lam:.4f}   validation MSE {final_loss:.6f}")
    if steps >= 40:  # enough steps to converge from the default start
        # Gradient descent must land within one grid cell of the grid's best penalty,
        # and do at least as well as the grid (up to float32 noise).
        assert abs(np.log(lam) - np.log(lam_grid)) <= spacing, (lam, lam_grid)
        assert final_loss <= grid_losses[best] * (1 + 1e-5), (final_loss, grid_losses[best])

    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "ridge_hyperparameter.png"
    plot(path, np.exp(np.asarray(log_lams)), grid_losses, log_lam_path, losses)
    print(f"\nSaved {path}")


if __name__ == "__main__":
    main()
