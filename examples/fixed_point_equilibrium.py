"""Learn a parameter of an equilibrium model through `solvers.fixed_point`.

The model is a recurrent layer that is run to its steady state (a "deep
equilibrium" layer). For each input column `a_j`, the hidden state `x_j`
settles where

    x_j = tanh(W x_j + U a_j),

or, for all m inputs at once with `X = [x_1 ... x_m]` and `A = [a_1 ... a_m]`,
`X = tanh(W X + U A)`. The couplings `W` are fixed and mostly inhibitory
(eigenvalues in [-0.95, 0.6]); since `|tanh'| <= 1` and `||W||_2 = 0.95`, the
map is a contraction for every `U`, so the equilibrium exists and is unique.

We observe noisy equilibria `X_obs` produced by unknown input weights `U_true`
and fit `U` by gradient descent (optax's Adam) on `mean((X*(U) - X_obs)^2)`.
The gradient comes from the implicit function theorem: `fixed_point` never
differentiates its iterations (no memory per iteration); the backward pass is
one linear solve with `I - d_X f` at the equilibrium.

The script

* checks the implicit gradient against central finite differences, in float64
  (training runs in float32, JAX's default), before training on it;
* fits `U`, printing the loss as it goes, warm-starting each solve from the
  previous equilibrium;
* compares the three forward methods (plain iteration, damping, Anderson
  acceleration) at the fitted `U`: iterations needed against the tolerance,
  from `return_info=True`;
* saves the loss curve and the method comparison to
  `examples/out/fixed_point_equilibrium.png` (`--out` to change the folder).

Run it with

    python examples/fixed_point_equilibrium.py           # full size, ~15 s on 2 CPU cores
    python examples/fixed_point_equilibrium.py --small   # tiny sizes, for a smoke test

Most of the time is compilation.
"""

from __future__ import annotations

import argparse
import functools
import time
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from solvers import fixed_point

METHODS = ("iterate", "damped", "anderson")


class Problem(NamedTuple):
    """The fixed data of the model (a pytree, so it can be passed through `jit`)."""

    W: jax.Array  # (n, n) recurrent couplings
    inputs: jax.Array  # (d, m) one input per column
    observed: jax.Array  # (n, m) noisy equilibria


def equilibrium_map(U, X, problem):
    """One step of the layer: `X -> tanh(W X + U A)`. Its fixed point is the equilibrium."""
    return jnp.tanh(problem.W @ X + U @ problem.inputs)


def equilibrium(U, problem, method="anderson", x_guess=None, **options):
    """The equilibrium `X*(U)` and the solver's `SolveInfo`.

    `fixed_point(f, a, x_guess)` solves `x = f(a, x)`; the parameter `a` is `U`,
    and `f` closes over the fixed data. `x_guess` (e.g. the previous equilibrium,
    to warm-start) gets no derivative.
    """
    if x_guess is None:
        x_guess = jnp.zeros_like(problem.observed)
    return fixed_point(
        lambda U, X: equilibrium_map(U, X, problem),
        U,
        x_guess,
        method=method,
        return_info=True,
        **options,
    )


def loss_fn(U, problem, method="anderson", x_guess=None, **options):
    """Mean squared misfit of the equilibrium; the equilibrium and info as auxiliaries."""
    X, info = equilibrium(U, problem, method, x_guess, **options)
    return jnp.mean((X - problem.observed) ** 2), (X, info)


def make_problem(key, n, d, m, noise):
    """A random contraction `W`, inputs, true weights and noisy observed equilibria."""
    k_w, k_u, k_a, k_noise = jax.random.split(key, 4)
    # W = Q diag(eigenvalues) Q^T: symmetric, spectral norm 0.95. The eigenvalue
    # -0.95 makes plain iteration oscillate and converge slowly.
    Q, _ = jnp.linalg.qr(jax.random.normal(k_w, (n, n)))
    W = (Q * jnp.linspace(-0.95, 0.6, n)) @ Q.T
    U_true = jax.random.normal(k_u, (n, d)) / jnp.sqrt(d)
    inputs = jax.random.normal(k_a, (d, m))
    clean = Problem(W, inputs, jnp.zeros((n, m)))
    X_true, _ = equilibrium(U_true, clean)
    observed = X_true + noise * jax.random.normal(k_noise, (n, m))
    return Problem(W, inputs, observed), U_true


def train(problem, U0, steps, learning_rate, method, print_every):
    """Fit U with Adam. Returns the fitted U and the per-step losses and solver steps."""
    optimizer = optax.adam(learning_rate)

    @jax.jit
    def step(U, opt_state, X_prev):
        # Warm start from the previous equilibrium: U moves little per step, so the
        # solve starts close to its answer. The gradient does not depend on it.
        (loss, (X, info)), grad = jax.value_and_grad(loss_fn, has_aux=True)(
            U, problem, method, X_prev
        )
        updates, opt_state = optimizer.update(grad, opt_state)
        return optax.apply_updates(U, updates), opt_state, X, loss, info.steps

    U, opt_state = U0, optimizer.init(U0)
    X = jnp.zeros_like(problem.observed)
    losses, solver_steps = [], []
    for i in range(steps):
        U, opt_state, X, loss, n_steps = step(U, opt_state, X)
        losses.append(float(loss))
        solver_steps.append(int(n_steps))
        if i % print_every == 0 or i == steps - 1:
            print(f"  step {i:4d}   loss {losses[-1]:.3e}   {method} iterations {n_steps}")
    return U, np.array(losses), np.array(solver_steps)


def compare_methods(U, problem, tolerances):
    """Iterations each method needs to reach each tolerance; timing at the last one."""
    # "last step" is the solver's residual: max |X_new - X| at the last iteration.
    print(f"\n  {'method':9s} {'iterations':>10s} {'last step':>10s} {'time/solve':>11s}")
    steps_vs_tol, solutions = {}, {}
    for method in METHODS:
        # `rtol`/`atol` may be traced values: one compiled solve serves every tolerance.
        solve = jax.jit(
            lambda U, tol, method=method: equilibrium(U, problem, method, rtol=tol, atol=tol)
        )
        steps_vs_tol[method] = np.array([int(solve(U, tol)[1].steps) for tol in tolerances])
        X, info = jax.block_until_ready(solve(U, tolerances[-1]))
        start = time.perf_counter()
        for _ in range(5):
            jax.block_until_ready(solve(U, tolerances[-1]))
        ms = (time.perf_counter() - start) / 5 * 1e3
        assert bool(info.converged), f"{method} did not converge"
        print(f"  {method:9s} {int(info.steps):10d} {float(info.residual):10.1e} {ms:8.2f} ms")
        solutions[method] = X

    # Every method solves the same equation, so they must agree (float32).
    for method in METHODS[1:]:
        diff = float(jnp.max(jnp.abs(solutions[method] - solutions["iterate"])))
        assert diff < 1e-4, f"{method} and iterate disagree by {diff:.1e}"
    return steps_vs_tol


def check_gradient(U, problem, key):
    """Implicit gradient vs central finite differences, in float64; and across methods.

    float64 is needed only here: a finite difference in float32 loses about half
    of its 7 digits to cancellation, too few to check anything.
    """
    with jax.enable_x64(True):
        to64 = lambda tree: jax.tree_util.tree_map(lambda v: jnp.asarray(v, jnp.float64), tree)
        U, problem = to64(U), to64(problem)
        direction = jax.random.normal(key, U.shape, jnp.float64)
        # Tight tolerances: the finite difference divides the solver's error by eps.
        tight = dict(rtol=1e-13, atol=1e-13)

        @functools.partial(jax.jit, static_argnums=1)
        def value_and_grad(U, method):
            return jax.value_and_grad(lambda U: loss_fn(U, problem, method, **tight)[0])(U)

        grads = {m: value_and_grad(U, m)[1] for m in METHODS}
        eps = 1e-5
        up = value_and_grad(U + eps * direction, "anderson")[0]
        down = value_and_grad(U - eps * direction, "anderson")[0]
        fd = (up - down) / (2 * eps)
        implicit = jnp.vdot(grads["anderson"], direction)
        rel = float(jnp.abs(implicit - fd) / jnp.abs(fd))
        print("\nGradient check at the initial U (float64), along a random direction:")
        print(f"  implicit            {float(implicit):.12e}")
        print(f"  finite differences  {float(fd):.12e}   relative error {rel:.1e}")
        assert rel < 1e-6, f"implicit gradient disagrees with finite differences: {rel:.1e}"
        # The implicit gradient depends only on the fixed point, not on how it was found.
        for method in ("iterate", "damped"):
            gap = float(jnp.max(jnp.abs(grads[method] - grads["anderson"])))
            gap /= float(jnp.max(jnp.abs(grads["anderson"])))
            print(f"  gradient via {method:8s} vs anderson: relative difference {gap:.1e}")
            assert gap < 1e-8, f"gradients from {method} and anderson differ by {gap:.1e}"


def plot(path, losses, solver_steps, method, noise, tolerances, steps_vs_tol):
    # `Figure` directly (not pyplot): no GUI backend is involved, so this works headless.
    from matplotlib.figure import Figure

    fig = Figure(figsize=(14, 4), layout="constrained")
    ax_loss, ax_warm, ax_steps = fig.subplots(1, 3)
    ax_loss.semilogy(losses, label="training loss")
    ax_loss.axhline(noise**2, color="gray", ls="--", label="noise variance")
    ax_loss.set(xlabel="Adam step", ylabel="mean squared misfit", title="Fitting U")
    ax_loss.legend()
    ax_warm.plot(solver_steps)
    ax_warm.set(
        xlabel="Adam step",
        ylabel="iterations",
        title=f"{method} iterations per step (warm-started)",
        ylim=(0, None),
    )
    for name, steps in steps_vs_tol.items():
        ax_steps.semilogx(tolerances, steps, "o-", label=name)
    ax_steps.invert_xaxis()
    ax_steps.set(
        xlabel="tolerance (rtol = atol)",
        ylabel="iterations",
        title="Forward solve at the fitted U",
    )
    ax_steps.legend()
    fig.savefig(path, dpi=120)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="tiny problem, few steps")
    parser.add_argument("--steps", type=int, help="Adam steps (default 300, 50 with --small)")
    parser.add_argument("--method", choices=METHODS, default="anderson", help="for training")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "out", help="where the plot goes"
    )
    args = parser.parse_args(argv)
    n, d, m = (8, 3, 32) if args.small else (64, 8, 512)
    steps = args.steps or (50 if args.small else 300)
    noise = 0.01

    key_problem, key_init, key_check = jax.random.split(jax.random.key(args.seed), 3)
    problem, U_true = make_problem(key_problem, n, d, m, noise)
    print(f"Equilibrium X = tanh(W X + U A): state {n}, inputs {d}, {m} samples")
    U0 = 0.1 * jax.random.normal(key_init, U_true.shape)

    # Check the gradient before training on it, at the starting point (near the
    # optimum the gradient is tiny and a relative comparison says little).
    check_gradient(U0, problem, key_check)

    print(f"\nFitting U ({steps} Adam steps, forward solves with {args.method!r}):")
    start = time.perf_counter()
    U, losses, solver_steps = train(problem, U0, steps, 0.05, args.method, max(1, steps // 10))
    err = float(jnp.linalg.norm(U - U_true) / jnp.linalg.norm(U_true))
    print(f"  {time.perf_counter() - start:.1f} s;  |U - U_true| / |U_true| = {err:.3f}")
    assert losses[-1] < 0.05 * losses[0], "training did not reduce the loss"
    if not args.small and steps >= 200:
        # With enough steps the fit reaches the noise floor and recovers U_true.
        assert losses[-1] < 2 * noise**2 and err < 0.05, (losses[-1], err)

    print("\nForward methods at the fitted U (tolerance 1e-6, float32's default):")
    tolerances = np.logspace(-1, -6, 11)
    steps_vs_tol = compare_methods(U, problem, tolerances)

    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "fixed_point_equilibrium.png"
    plot(path, losses, solver_steps, args.method, noise, tolerances, steps_vs_tol)
    print(f"\nSaved {path}")


if __name__ == "__main__":
    main()
