"""Data-parallel checks on 8 (forced) CPU devices; run by `test_sharding.py`.

Run as a script, in a process whose environment sets
`XLA_FLAGS=--xla_force_host_platform_device_count=8` before JAX starts::

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \
        python tests/multidevice/_sharded_checks.py --group fast

For each case (a `solvers.nn` module or a plain solver) it builds a per-example
function `f(params, x)`, then, on a `Mesh` of 8 devices with axis `"batch"`, with the
batch placed by `NamedSharding(mesh, P("batch"))` and the parameters replicated:

* forward: `jit(vmap(f))` on the sharded batch equals the same on an unsharded batch,
  and the output keeps the batch sharding (no gather);
* forward with `throw=False` (and `return_info=True`, which it requires): the same
  output, still batch-sharded, and every element's status `SUCCESS`;
* train step: `filter_jit(filter_value_and_grad(loss))` with a mean-squared loss over
  the batch equals the unsharded one, and the gradient is replicated.

The `shard_map` case computes per-shard gradients and averages them with `pmean`.
With `check_vma=True` the solvers refuse with a NotImplementedError that names the
fix (`check_vma=False`); that error is checked too. The script prints one table row per
case and exits 1 if a check fails.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import solvers  # noqa: E402
from solvers.nn import DEQ, ArgminLayer, NeuralODE, RootLayer  # noqa: E402

NDEV = 8
BATCH = 16  # two examples per device
DIM = 4
RTOL, ATOL = 1e-4, 1e-5

# ---------------------------------------------------------------------------
# The cases: (params, per-example f(params, x), batch of x).


class Cell(eqx.Module):
    lin: eqx.nn.Linear

    def __call__(self, z, x):
        return jnp.tanh(0.5 * self.lin(z) + x)


class Field(eqx.Module):
    mlp: eqx.nn.MLP

    def __call__(self, y, t):
        return self.mlp(y)


class Residual(eqx.Module):
    lin: eqx.nn.Linear

    def __call__(self, z, x):
        return z + 0.1 * jnp.tanh(self.lin(z)) - x


class Objective(eqx.Module):
    log_lam: jax.Array
    w: jax.Array

    def __call__(self, z, x):
        return jnp.sum((z - x) ** 2) + jnp.exp(self.log_lam) * jnp.sum(self.w * z**2)


def _key(i: int) -> jax.Array:
    return jax.random.key(i)


def _xs(dim: int = DIM) -> jax.Array:
    return jax.random.normal(_key(99), (BATCH, dim)) * 0.5


TS = jnp.linspace(0.0, 1.0, 4)

# Each case takes `throw`. With `throw=False` its `f` also returns the solver's info
# (`return_info=True`, which `throw=False` requires): `f(params, x) -> (out, info)`.


def _call(throw: bool, *trailing: Any) -> Callable[[Any, Any], Any]:
    """`m(x, *trailing)`, with the info when `throw=False`."""
    return lambda m, x: m(x, *trailing, return_info=not throw)


def case_deq(throw: bool = True):
    model = DEQ(Cell(eqx.nn.Linear(DIM, DIM, key=_key(0))), z_shape=(DIM,), throw=throw)
    return model, _call(throw), _xs()


def _node(adjoint: str, throw: bool = True):
    field = Field(eqx.nn.MLP(2, 2, 8, 2, activation=jnp.tanh, key=_key(1)))
    model = NeuralODE(field, adjoint=adjoint, rtol=1e-5, atol=1e-5, throw=throw)
    return model, _call(throw, TS), _xs(2)


def case_root_layer(throw: bool = True):
    model = RootLayer(Residual(eqx.nn.Linear(DIM, DIM, key=_key(2))), z_shape=(DIM,), throw=throw)
    return model, _call(throw), _xs()


def case_argmin_layer(throw: bool = True):
    objective = Objective(jnp.array(0.0), jnp.linspace(0.5, 1.5, DIM))
    model = ArgminLayer(objective, z_shape=(DIM,), throw=throw)
    return model, _call(throw), _xs()


def case_fixed_point(throw: bool = True):
    a = jnp.array(0.6)

    def f(a, x):
        return solvers.fixed_point(
            lambda a, z: a * jnp.cos(z) + 0.1 * x,
            a,
            jnp.zeros_like(x),
            throw=throw,
            return_info=not throw,
        )

    return a, f, _xs()


def case_root(throw: bool = True):
    c = jnp.array(2.0)

    def f(c, x):
        return solvers.root(
            lambda z, c, x: z**3 + c * z - x,
            jnp.zeros_like(x),
            c,
            x,
            throw=throw,
            return_info=not throw,
        )

    return c, f, _xs()


def case_minimize(throw: bool = True):
    w = jnp.array([1.0, 2.0, 3.0, 4.0])

    def f(w, x):
        return solvers.minimize(
            lambda z, w, x: jnp.sum(w * (z - x) ** 2 + 0.1 * z**4),
            jnp.zeros_like(x),
            w,
            x,
            throw=throw,
            return_info=not throw,
        )

    return w, f, _xs()


def _odeint(adjoint: str, throw: bool = True):
    k = jnp.array([0.5, 1.5])

    def f(k, y0):
        return solvers.odeint(
            lambda y, t, k: jnp.stack([y[1], -k[0] * y[1] - k[1] * jnp.sin(y[0])]),
            y0,
            TS,
            k,
            method="tsit5",
            adjoint=adjoint,
            rtol=1e-6,
            atol=1e-6,
            throw=throw,
            return_info=not throw,
        )

    return k, f, _xs(2)


CASES: dict[str, tuple[str, Callable[[], Any]]] = {
    "DEQ": ("fast", case_deq),
    "RootLayer": ("fast", case_root_layer),
    "ArgminLayer": ("fast", case_argmin_layer),
    "fixed_point": ("fast", case_fixed_point),
    "root": ("fast", case_root),
    "minimize": ("fast", case_minimize),
    "NeuralODE (backsolve)": ("slow", lambda throw=True: _node("backsolve", throw)),
    "NeuralODE (checkpoint)": ("slow", lambda throw=True: _node("checkpoint", throw)),
    "odeint (backsolve)": ("slow", lambda throw=True: _odeint("backsolve", throw)),
    "odeint (checkpoint)": ("slow", lambda throw=True: _odeint("checkpoint", throw)),
}


# ---------------------------------------------------------------------------
# The checks.


def _replicate(tree: Any, sharding: NamedSharding) -> Any:
    """Put the arrays of `tree` on every device (other leaves, e.g. activations, stay)."""
    arrays, rest = eqx.partition(tree, eqx.is_array)
    return eqx.combine(jax.device_put(arrays, sharding), rest)


def _close(a: Any, b: Any) -> bool:
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    return len(la) == len(lb) and all(
        np.allclose(np.asarray(x), np.asarray(y), rtol=RTOL, atol=ATOL) for x, y in zip(la, lb)
    )


def _has(arr: jax.Array, sharding: NamedSharding) -> bool:
    return arr.sharding.is_equivalent_to(sharding, arr.ndim)


def check(name: str, build: Callable[..., Any], mesh: Mesh) -> dict[str, Any]:
    batch_sh = NamedSharding(mesh, P("batch"))
    repl = NamedSharding(mesh, P())
    params, f, xs = build()
    # Modules hold `throw` as a static field: the throw=False copy has its own params.
    params_nothrow, f_nothrow, _ = build(throw=False)

    def forward_of(f):
        return eqx.filter_jit(lambda p, xs: jax.vmap(f, in_axes=(None, 0))(p, xs))

    def loss(p, xs):
        return jnp.mean(jax.vmap(f, in_axes=(None, 0))(p, xs) ** 2)

    forward = forward_of(f)
    step = eqx.filter_jit(eqx.filter_value_and_grad(loss))

    xs_sh = jax.device_put(xs, batch_sh)
    p_sh = _replicate(params, repl)
    assert _has(xs_sh, batch_sh) and len(xs_sh.sharding.device_set) == NDEV

    row: dict[str, Any] = {}
    out_ref = forward(params, xs)
    out = forward(p_sh, xs_sh)
    row["forward agrees"] = _close(out, out_ref)
    row["output batch-sharded"] = all(_has(o, batch_sh) for o in jax.tree_util.tree_leaves(out))
    out, info = forward_of(f_nothrow)(_replicate(params_nothrow, repl), xs_sh)
    row["output batch-sharded (throw=False)"] = (
        _close(out, out_ref)
        and all(_has(o, batch_sh) for o in jax.tree_util.tree_leaves(out))
        and info.status.shape == (BATCH,)
        and bool(np.all(np.asarray(info.status) == solvers.SUCCESS))
    )
    (v_ref, g_ref) = step(params, xs)
    (v, g) = step(p_sh, xs_sh)
    row["loss/grad agree"] = _close(v, v_ref) and _close(g, g_ref)
    g_leaves = jax.tree_util.tree_leaves(eqx.filter(g, eqx.is_array))
    row["grad replicated"] = bool(g_leaves) and all(
        x.sharding.is_fully_replicated and _has(x, repl) for x in g_leaves
    )
    return row


def _shard_map():
    return (
        getattr(jax, "shard_map", None)
        or __import__("jax.experimental.shard_map", fromlist=["shard_map"]).shard_map
    )


def check_shard_map(mesh: Mesh) -> dict[str, Any]:
    """A DEQ training step written per device: local gradient, then `pmean` over the mesh
    (with `check_vma=False`: with `check_vma=True` the solvers refuse, see below)."""
    shard_map = _shard_map()
    model, _, xs = case_deq()
    params, static = eqx.partition(model, eqx.is_array)

    def loss(p, xs):
        m = eqx.combine(p, static)
        return jnp.mean(jax.vmap(m)(xs) ** 2)

    def local(p, xs):
        v, g = jax.value_and_grad(loss)(p, xs)
        return jax.lax.pmean(v, "batch"), jax.lax.pmean(g, "batch")

    fn = jax.jit(
        shard_map(
            local,
            mesh=mesh,
            in_specs=(P(), P("batch")),
            out_specs=(P(), P()),
            check_vma=False,
        )
    )
    repl = NamedSharding(mesh, P())
    v, g = fn(jax.device_put(params, repl), jax.device_put(xs, NamedSharding(mesh, P("batch"))))
    v_ref, g_ref = jax.jit(jax.value_and_grad(loss))(params, xs)
    g_leaves = jax.tree_util.tree_leaves(g)
    return {
        "loss/grad agree": _close(v, v_ref) and _close(g, g_ref),
        "grad replicated": all(x.sharding.is_fully_replicated for x in g_leaves),
    }


def check_shard_map_vma_refused(mesh: Mesh) -> dict[str, Any]:
    """With `check_vma=True` a solver raises NotImplementedError naming the fix."""
    model, _, xs = case_deq()
    fn = jax.jit(
        _shard_map()(
            jax.vmap(model), mesh=mesh, in_specs=P("batch"), out_specs=P("batch"), check_vma=True
        )
    )
    try:
        fn(xs)
    except NotImplementedError as e:
        return {"clear error": "check_vma=False" in str(e)}
    return {"clear error": False}


COLUMNS = (
    "forward agrees",
    "output batch-sharded",
    "output batch-sharded (throw=False)",
    "loss/grad agree",
    "grad replicated",
    "clear error",
)


def _mark(v: Any) -> str:
    return "-" if v is None else ("ok" if v else "FAIL")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--group", choices=("fast", "slow", "all"), default="fast")
    parser.add_argument("--only", nargs="+", help="run only these case names")
    opts = parser.parse_args(argv)

    devices = jax.devices()
    if len(devices) < NDEV:
        print(
            f"need {NDEV} devices, found {len(devices)}; set XLA_FLAGS="
            f"--xla_force_host_platform_device_count={NDEV} before JAX starts "
            f"(XLA_FLAGS={os.environ.get('XLA_FLAGS')!r})",
            file=sys.stderr,
        )
        return 2
    mesh = Mesh(np.array(devices[:NDEV]), ("batch",))

    todo: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        (name, lambda b=build, n=name: check(n, b, mesh))
        for name, (group, build) in CASES.items()
        if opts.group in (group, "all") and (not opts.only or name in opts.only)
    ]
    if opts.group in ("fast", "all"):
        for name, run in [
            ("shard_map (DEQ, check_vma=False)", lambda: check_shard_map(mesh)),
            ("shard_map (DEQ, check_vma=True)", lambda: check_shard_map_vma_refused(mesh)),
        ]:
            if not opts.only or name in opts.only:
                todo.append((name, run))

    print(f"jax {jax.__version__}, {len(devices)} {devices[0].platform} devices, mesh {mesh.shape}")
    print("| case | " + " | ".join(COLUMNS) + " | time (s) | status |")
    print("|---|" + "---|" * (len(COLUMNS) + 2))
    failed = []
    for name, run in todo:
        t0 = time.perf_counter()
        try:
            row, error = run(), None
        except Exception as e:  # a crash fails the case; keep going
            row, error = {"loss/grad agree": False}, e
        bad = [c for c, v in row.items() if v is False]
        if bad:
            status = "FAILED: " + ", ".join(bad)
            if error is not None:
                status += f" ({type(error).__name__}: {str(error).splitlines()[0][:160]})"
                traceback.print_exception(error, file=sys.stderr)
            failed.append(name)
        else:
            status = "ok"
        cells = " | ".join(_mark(row.get(c)) for c in COLUMNS)
        print(f"| {name} | {cells} | {time.perf_counter() - t0:.1f} | {status} |", flush=True)
    if failed:
        print("failed: " + ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
