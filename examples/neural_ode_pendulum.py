"""Fit a neural ODE to damped-pendulum trajectories (`solvers.nn.NeuralODE`).

The data come from the damped pendulum, with state `y = [theta, omega]`:

    d theta / dt = omega,
    d omega / dt = -0.25 omega - 9.8 sin(theta),

integrated by `solvers.odeint` from several initial angles (released at rest).
A `NeuralODE` whose vector field is a small `eqx.nn.MLP` is fitted to these
trajectories: its prediction is the same ODE solve (`tsit5`, adaptive steps),
started from the true initial state, and the loss is the mean squared error
against the recorded states. The gradient with respect to the MLP's weights
comes from the ODE solver's adjoint (`adjoint="checkpoint"`: the exact gradient
of the discrete solve), never from JAX tracing through the adaptive stepping
loop.

Training uses optax's Adam, with the batch of trajectories handled by
`jax.vmap` (each trajectory keeps its own step sizes). Two tricks make the fit
quick: the field sees the state divided by its typical size and its output is
multiplied back (the pendulum's angular velocity is ~3x its angle, its
acceleration ~10x), and the time window grows over the first half of training
(at full size), so early steps fit the start of each trajectory before the
whole swing.

The script prints one line per epoch (a fixed number of Adam steps), then the
final loss, the training time and the error on trajectories from initial
angles that were not trained on. It asserts that the loss fell (by 10x with
`--small`, and below 3e-2 at full size). The plot (loss curve, and predicted
against true trajectories) goes to `examples/out/neural_ode_pendulum.png`
(`--out` to change the folder). Run it with

    python examples/neural_ode_pendulum.py           # full size, about a minute on 2 CPU cores
    python examples/neural_ode_pendulum.py --small   # tiny sizes, for a smoke test
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

from solvers import odeint
from solvers.nn import NeuralODE

DAMPING = 0.25
GRAVITY = 9.8  # g / length
Y_SCALE = jnp.array([1.0, 3.0])  # typical |theta|, |omega|
DY_SCALE = jnp.array([3.0, 10.0])  # typical |d theta/dt|, |d omega/dt|


def pendulum(y, t):
    """The true vector field (the argument order of `odeint`: state, then time)."""
    theta, omega = y
    return jnp.stack([omega, -DAMPING * omega - GRAVITY * jnp.sin(theta)])


def make_data(theta0s, ts):
    """True trajectories, one per initial angle, shape (n, len(ts), 2)."""
    y0s = jnp.stack([theta0s, jnp.zeros_like(theta0s)], axis=-1)
    solve = jax.vmap(lambda y0: odeint(pendulum, y0, ts, rtol=1e-8, atol=1e-8))
    return y0s, solve(y0s)


class Field(eqx.Module):
    """The learned vector field: an MLP on the rescaled state (autonomous: `t` unused)."""

    mlp: eqx.nn.MLP

    def __init__(self, width, depth, *, key):
        self.mlp = eqx.nn.MLP(2, 2, width, depth, activation=jax.nn.softplus, key=key)

    def __call__(self, y, t):
        return DY_SCALE * self.mlp(y / Y_SCALE)


def loss_fn(model, y0s, ys, ts, n_times):
    """Mean squared error over the first `n_times` recorded times of every trajectory."""
    # `n_times` is static: a new window length compiles once, then is reused.
    pred = jax.vmap(model, in_axes=(0, None))(y0s, ts[:n_times])
    return jnp.mean((pred - ys[:, :n_times]) ** 2)


def train(model, y0s, ys, ts, epochs, steps_per_epoch, learning_rate, n_stages):
    schedule = optax.cosine_decay_schedule(learning_rate, epochs * steps_per_epoch, alpha=0.1)
    optimizer = optax.adam(schedule)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))

    @eqx.filter_jit
    def step(model, opt_state, n_times):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, y0s, ys, ts, n_times)
        updates, opt_state = optimizer.update(grads, opt_state, model)
        return eqx.apply_updates(model, updates), opt_state, loss

    full_loss = eqx.filter_jit(loss_fn)
    n_total = len(ts)
    # The window grows in a few stages (each compiles once) over the first half.
    stages = np.linspace(n_total // n_stages, n_total, n_stages).astype(int)
    losses, window = [], []
    for epoch in range(epochs):
        stage = min(len(stages) - 1, (2 * len(stages) * epoch) // max(1, epochs))
        n_times = int(stages[stage])
        start = time.perf_counter()
        for _ in range(steps_per_epoch):
            model, opt_state, loss = step(model, opt_state, n_times)
            losses.append(float(loss))
            window.append(n_times)
        epoch_loss = float(full_loss(model, y0s, ys, ts, n_total))
        print(
            f"  epoch {epoch + 1:3d}/{epochs}   window t <= {float(ts[n_times - 1]):.2f}"
            f"   last step loss {losses[-1]:.3e}   full-window loss {epoch_loss:.3e}"
            f"   ({time.perf_counter() - start:.1f} s)"
        )
    return model, np.array(losses), np.array(window)


def plot(path, losses, ts, true_ys, pred_ys, theta0s):
    # `Figure` directly (not pyplot): no GUI backend is involved, so this works headless.
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 4.2), layout="constrained")
    ax_loss, ax_traj = fig.subplots(1, 2)
    ax_loss.semilogy(losses)
    ax_loss.set(xlabel="Adam step", ylabel="mean squared error", title="Training loss")
    ts = np.asarray(ts)
    for i in range(len(theta0s)):
        color = f"C{i % 10}"
        ax_traj.plot(ts, true_ys[i, :, 0], color=color, lw=2, alpha=0.4)
        ax_traj.plot(ts, pred_ys[i, :, 0], "--", color=color, lw=1.2)
    ax_traj.plot([], [], "k-", lw=2, alpha=0.4, label="true")
    ax_traj.plot([], [], "k--", lw=1.2, label="neural ODE")
    ax_traj.set(xlabel="t", ylabel="theta", title="Held-out initial angles: theta(t)")
    ax_traj.legend()
    fig.savefig(path, dpi=120)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="short trajectories, few steps")
    parser.add_argument("--epochs", type=int, help="epochs (default 30, 4 with --small)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "out", help="where the plot goes"
    )
    args = parser.parse_args(argv)
    if args.small:
        n_traj, n_times, t_end, width, steps_per_epoch = 4, 16, 1.0, 32, 10
    else:
        n_traj, n_times, t_end, width, steps_per_epoch = 8, 40, 3.0, 64, 50
    epochs = args.epochs or (4 if args.small else 30)

    ts = jnp.linspace(0.0, t_end, n_times)
    theta0s = jnp.linspace(-2.0, 2.0, n_traj)
    y0s, ys = make_data(theta0s, ts)
    # Held-out initial angles, between the training ones.
    test_theta0s = 0.5 * (theta0s[1:] + theta0s[:-1])[:: max(1, (n_traj - 1) // 3)]
    test_y0s, test_ys = make_data(test_theta0s, ts)
    print(
        f"Damped pendulum: {n_traj} training trajectories, theta0 in [-2, 2],"
        f" {n_times} times in [0, {t_end:g}]"
    )

    field = Field(width, 2, key=jax.random.key(args.seed))
    model = NeuralODE(field, method="tsit5", rtol=1e-4, atol=1e-4, adjoint="checkpoint")
    loss0 = float(eqx.filter_jit(loss_fn)(model, y0s, ys, ts, n_times))
    print(f"  initial loss {loss0:.3e}")

    print(f"\nTraining ({epochs} epochs x {steps_per_epoch} Adam steps):")
    start = time.perf_counter()
    # --small: one window (the whole span), so the step compiles once.
    model, losses, _ = train(
        model,
        y0s,
        ys,
        ts,
        epochs,
        steps_per_epoch,
        1e-2 if args.small else 5e-3,
        n_stages=1 if args.small else 4,
    )
    train_time = time.perf_counter() - start

    final = float(eqx.filter_jit(loss_fn)(model, y0s, ys, ts, n_times))
    pred_test = jax.vmap(model, in_axes=(0, None))(test_y0s, ts)
    test_mse = float(jnp.mean((pred_test - test_ys) ** 2))
    print("\nSummary:")
    print(f"  final training loss {final:.3e}  (initial {loss0:.3e})")
    print(f"  held-out MSE        {test_mse:.3e}  ({len(test_theta0s)} unseen initial angles)")
    print(f"  training time       {train_time:.1f} s (including compilation)")
    assert np.isfinite(final), "training diverged"
    assert final < 0.1 * loss0, f"the loss did not fall enough: {loss0:.3e} -> {final:.3e}"
    if not args.small and epochs >= 30:
        assert final < 3e-2, f"full-size fit worse than expected: {final:.3e}"

    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "neural_ode_pendulum.png"
    plot(path, losses, ts, np.asarray(test_ys), np.asarray(pred_test), np.asarray(test_theta0s))
    print(f"\nSaved {path}")


if __name__ == "__main__":
    main()
