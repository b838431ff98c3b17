"""Classify handwritten digits with a deep-equilibrium layer (`solvers.nn.DEQ`).

The data are scikit-learn's bundled digits (8x8 images, 64 pixel features, 10
classes, no download). The model is

    x  = P(image)                      (a linear input projection)
    z* = tanh(W z* + x)                (the equilibrium of a weight-tied tanh cell)
    logits = H(z*)                     (a linear head)

The middle line is a `DEQ`: its forward pass finds `z*` by Anderson
acceleration, a different number of iterations for each image (the batch is a
`jax.vmap` over images), and its backward pass solves one linear system with
`I - d cell/dz` at `z*` (the implicit function theorem; by the Neumann series,
since the cell is kept a contraction) instead of differentiating the
iterations. Training uses optax's Adam on the
cross-entropy, with `eqx.filter_jit` and `eqx.filter_value_and_grad`.

The script prints one line per epoch (training loss, test accuracy, mean
Anderson iterations per image), then compares the memory of one compiled
training step against the same model computed explicitly: the weight-tied cell
unrolled for a fixed number of iterations (as many as the DEQ needed at most,
and four times that) and differentiated by ordinary backpropagation, which stores every iteration's
activations. The numbers are XLA's own (`compiled.memory_analysis()`, the
temporary buffers of the step), so they depend on the backend; where the
backend gives none, the script says so.

It asserts test accuracy above 0.9 at full size, and above chance (0.3, for
10 classes) with `--small`. The plot (loss and accuracy against epoch) goes to
`examples/out/deq_digits.png` (`--out` to change the folder). Run it with

    python examples/deq_digits.py           # full size, about a minute on 2 CPU cores
    python examples/deq_digits.py --small   # tiny sizes, for a smoke test
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
from sklearn.datasets import load_digits

from solvers.nn import DEQ

LIPSCHITZ = 0.9  # bound on the cell's Lipschitz constant in z


class Cell(eqx.Module):
    """`z -> tanh(W z + x)`, with `W` rescaled so that the map stays a contraction.

    `|tanh'| <= 1` and the spectral norm is at most the Frobenius norm, so scaling
    `W` to `||W||_F <= 0.9` keeps the equilibrium unique and every solve convergent
    however training moves the weights.
    """

    weight: jax.Array

    def __init__(self, hidden, *, key):
        self.weight = 0.5 * jax.random.normal(key, (hidden, hidden)) / jnp.sqrt(hidden)

    def __call__(self, z, x):
        norm = jnp.sqrt(jnp.sum(self.weight**2))
        weight = self.weight * jnp.minimum(1.0, LIPSCHITZ / norm)
        return jnp.tanh(weight @ z + x)


class DEQClassifier(eqx.Module):
    project: eqx.nn.Linear
    deq: DEQ
    head: eqx.nn.Linear

    def __init__(self, n_in, hidden, n_out, *, key, **deq_options):
        k_in, k_cell, k_out = jax.random.split(key, 3)
        self.project = eqx.nn.Linear(n_in, hidden, key=k_in)
        self.deq = DEQ(Cell(hidden, key=k_cell), z_shape=(hidden,), **deq_options)
        self.head = eqx.nn.Linear(hidden, n_out, key=k_out)

    def __call__(self, image):
        """Logits and the number of forward iterations, for one image."""
        z, info = self.deq(self.project(image), return_info=True)
        return self.head(z), info.steps


def unrolled_logits(model, image, n_iterations):
    """The same network computed explicitly: the cell applied `n_iterations` times."""
    x = model.project(image)
    z = jnp.zeros(model.deq.z_shape, x.dtype)
    for _ in range(n_iterations):  # a Python loop: every iteration is kept for backprop
        z = model.deq.cell(z, x)
    return model.head(z)


def loss_fn(model, images, labels):
    logits, steps = jax.vmap(model)(images)
    loss = jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))
    return loss, steps


def unrolled_loss_fn(model, images, labels, n_iterations):
    logits = jax.vmap(lambda im: unrolled_logits(model, im, n_iterations))(images)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


@eqx.filter_jit
def accuracy(model, images, labels):
    logits, _ = jax.vmap(model)(images)
    return jnp.mean(jnp.argmax(logits, axis=-1) == labels)


def load_data(n_train, n_test, seed):
    images, labels = load_digits(return_X_y=True)
    order = np.random.default_rng(seed).permutation(len(images))
    train, test = order[:n_train], order[n_train : n_train + n_test]
    images = images.astype(np.float32) / 16.0  # pixels are 0..16
    mean = images[train].mean(0)
    images = images - mean
    return (
        jnp.asarray(images[train]),
        jnp.asarray(labels[train]),
        jnp.asarray(images[test]),
        jnp.asarray(labels[test]),
    )


def train(model, data, epochs, batch_size, learning_rate, seed):
    X_train, y_train, X_test, y_test = data
    optimizer = optax.adam(learning_rate)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))

    @eqx.filter_jit
    def step(model, opt_state, images, labels):
        (loss, steps), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(
            model, images, labels
        )
        updates, opt_state = optimizer.update(grads, opt_state, model)
        return eqx.apply_updates(model, updates), opt_state, loss, steps

    rng = np.random.default_rng(seed)
    n_batches = len(X_train) // batch_size
    history = {"loss": [], "test_acc": [], "train_acc": [], "steps": [], "max_steps": 0}
    for epoch in range(epochs):
        start = time.perf_counter()
        order = rng.permutation(len(X_train))
        losses, steps = [], []
        for b in range(n_batches):
            idx = order[b * batch_size : (b + 1) * batch_size]
            model, opt_state, loss, n_steps = step(model, opt_state, X_train[idx], y_train[idx])
            losses.append(float(loss))
            steps.append(np.asarray(n_steps))
        steps = np.concatenate(steps)
        history["loss"].append(float(np.mean(losses)))
        history["steps"].append(float(steps.mean()))
        history["max_steps"] = max(history["max_steps"], int(steps.max()))
        history["train_acc"].append(float(accuracy(model, X_train, y_train)))
        history["test_acc"].append(float(accuracy(model, X_test, y_test)))
        print(
            f"  epoch {epoch + 1:3d}/{epochs}   loss {history['loss'][-1]:.4f}"
            f"   train acc {history['train_acc'][-1]:.3f}   test acc {history['test_acc'][-1]:.3f}"
            f"   Anderson iterations {history['steps'][-1]:5.1f} (max {int(steps.max())})"
            f"   ({time.perf_counter() - start:.1f} s)"
        )
    return model, history


def step_memory(fun, *args):
    """Temporary bytes XLA allocates for `fun(*args)` compiled, or None if unreported."""
    try:
        stats = jax.jit(fun).lower(*args).compile().memory_analysis()
    except Exception:  # some backends do not implement it
        return None
    if stats is None:
        return None
    return getattr(stats, "temp_size_in_bytes", None)


def compare_memory(model, images, labels, depths):
    """Memory of one training step (loss and gradient): implicit DEQ vs unrolled cell."""
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def deq_step(params, images, labels):
        grad_fn = eqx.filter_value_and_grad(loss_fn, has_aux=True)
        return grad_fn(eqx.combine(params, static), images, labels)

    def unrolled_step(params, images, labels, n_iterations):
        grad_fn = eqx.filter_value_and_grad(unrolled_loss_fn)
        return grad_fn(eqx.combine(params, static), images, labels, n_iterations)

    unrolled = {
        n: step_memory(lambda *a, n=n: unrolled_step(*a, n), params, images, labels) for n in depths
    }
    return step_memory(deq_step, params, images, labels), unrolled


def plot(path, history):
    # `Figure` directly (not pyplot): no GUI backend is involved, so this works headless.
    from matplotlib.figure import Figure

    epochs = np.arange(1, len(history["loss"]) + 1)
    fig = Figure(figsize=(13, 4), layout="constrained")
    ax_loss, ax_acc, ax_steps = fig.subplots(1, 3)
    ax_loss.plot(epochs, history["loss"], "o-")
    ax_loss.set(xlabel="epoch", ylabel="cross-entropy", title="Training loss")
    ax_acc.plot(epochs, history["train_acc"], "o-", label="train")
    ax_acc.plot(epochs, history["test_acc"], "s-", label="test")
    ax_acc.set(xlabel="epoch", ylabel="accuracy", title="Accuracy", ylim=(0, 1.02))
    ax_acc.legend()
    ax_steps.plot(epochs, history["steps"], "o-")
    ax_steps.set(
        xlabel="epoch", ylabel="iterations", title="Mean Anderson iterations", ylim=(0, None)
    )
    fig.savefig(path, dpi=120)


def _mib(n):
    return "not reported by this backend" if n is None else f"{n / 2**20:8.2f} MiB"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="less data, fewer epochs")
    parser.add_argument("--epochs", type=int, help="epochs (default 15, 3 with --small)")
    parser.add_argument("--hidden", type=int, help="state size (default 64, 32 with --small)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "out", help="where the plot goes"
    )
    args = parser.parse_args(argv)
    n_train, n_test, batch_size = (400, 200, 50) if args.small else (1297, 500, 64)
    epochs = args.epochs or (3 if args.small else 15)
    hidden = args.hidden or (32 if args.small else 64)

    data = load_data(n_train, n_test, args.seed)
    print(
        f"Digits: {n_train} training and {n_test} test images, 64 pixels, 10 classes;"
        f" DEQ state {hidden}, batch {batch_size}"
    )
    model = DEQClassifier(
        64,
        hidden,
        10,
        key=jax.random.key(args.seed),
        rtol=1e-4,
        atol=1e-4,
        max_steps=50,
        adjoint="neumann",
    )

    print(f"\nTraining ({epochs} epochs of Adam):")
    start = time.perf_counter()
    model, history = train(model, data, epochs, batch_size, 1e-2, args.seed)
    train_time = time.perf_counter() - start

    n_unroll = history["max_steps"]
    images, labels = data[0][:batch_size], data[1][:batch_size]
    # The DEQ's cost does not grow with its iterations; the unrolled network's does.
    depths = (n_unroll, 4 * n_unroll)
    mem_deq, mem_unrolled = compare_memory(model, images, labels, depths)

    test_acc = history["test_acc"][-1]
    print("\nSummary:")
    print(f"  test accuracy              {test_acc:.3f}   (train {history['train_acc'][-1]:.3f})")
    print(f"  final training loss        {history['loss'][-1]:.4f}")
    print(f"  mean Anderson iterations   {np.mean(history['steps']):.1f} per image and step")
    print(f"  training time              {train_time:.1f} s (including compilation)")
    print(f"  temporary memory of one training step (batch {batch_size}):")
    print(f"    DEQ, implicit backward     {_mib(mem_deq)}")
    for n, mem in mem_unrolled.items():
        print(f"    unrolled x{n:<3d} backprop    {_mib(mem)}")

    assert np.isfinite(history["loss"][-1]), "training diverged"
    assert history["loss"][-1] < history["loss"][0], "the training loss did not decrease"
    if args.small:
        assert test_acc > 0.3, f"test accuracy {test_acc:.3f} not above chance"
    elif epochs >= 15:
        assert test_acc > 0.9, f"test accuracy {test_acc:.3f} below 0.9"

    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "deq_digits.png"
    plot(path, history)
    print(f"\nSaved {path}")


if __name__ == "__main__":
    main()
