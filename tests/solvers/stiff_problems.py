"""Stiff problems of the IVP test set with parameters, and their reference derivatives.

Each problem is `f(y, t, p, xp)` (`xp` is `jax.numpy` or `numpy`), an initial state,
parameters, output times and weights `w`; the quantity checked is the loss
`sum_i w . y(t_i)` over the outputs after `t[0]`. The references in
`data/stiff_references.json` are that loss and its derivatives with respect to `p`
and `y0`, by central differences of SciPy's Radau at `rtol = 1e-12` (an
implementation and a derivative method independent of ours). Regenerate them with

    python -m tests.solvers.stiff_problems            # all problems, a few minutes
    python -m tests.solvers.stiff_problems rober      # one
"""

from __future__ import annotations

import json
import pathlib
import sys
import time

import numpy as np

REFERENCES = pathlib.Path(__file__).parent / "data" / "stiff_references.json"


def rober(y, t, p, xp):
    """Robertson's chemical kinetics: rates spanning nine orders of magnitude."""
    return xp.stack(
        [
            -p[0] * y[0] + p[2] * y[1] * y[2],
            p[0] * y[0] - p[2] * y[1] * y[2] - p[1] * y[1] ** 2,
            p[1] * y[1] ** 2,
        ]
    )


def hires(y, t, p, xp):
    """HIRES: plant physiology (light-induced growth), eight species."""
    return xp.stack(
        [
            -p[0] * y[0] + p[1] * y[1] + p[2] * y[2] + p[3],
            p[0] * y[0] - p[4] * y[1],
            -p[5] * y[2] + p[1] * y[3] + p[6] * y[4],
            p[2] * y[1] + p[0] * y[2] - p[7] * y[3],
            -p[8] * y[4] + p[1] * y[5] + p[1] * y[6],
            -p[9] * y[5] * y[7] + p[10] * y[3] + p[0] * y[4] - p[1] * y[5] + p[10] * y[6],
            p[9] * y[5] * y[7] - p[11] * y[6],
            -p[9] * y[5] * y[7] + p[11] * y[6],
        ]
    )


def vdpol(y, t, p, xp):
    """Van der Pol in relaxation form, `eps = p[0]`: slow drifts and fast jumps."""
    return xp.stack([y[1], ((1 - y[0] ** 2) * y[1] - y[0]) / p[0]])


def orego(y, t, p, xp):
    """The Oregonator (Belousov-Zhabotinskii reaction): a stiff limit cycle."""
    s, w, q = p[0], p[1], p[2]
    return xp.stack(
        [
            s * (y[1] - y[0] * y[1] + y[0] - q * y[0] ** 2),
            (-y[1] - y[0] * y[1] + y[2]) / s,
            w * (y[0] - y[2]),
        ]
    )


#: POLLU's reactions: the species (0-based) whose product, times the rate constant,
#: gives each reaction's rate, in the test set's order.
_POLLU_REACTANTS = (
    (0,), (1, 3), (4, 1), (6,), (6,), (6, 5), (8,), (8, 5), (10, 1), (10, 0), (12,),
    (9, 1), (13,), (0, 5), (2,), (3,), (3,), (15,), (15,), (16, 5), (18,), (18,), (0, 3),
    (18, 0), (19,),
)  # fmt: skip


#: POLLU's rate constants k1..k25.
_POLLU_RATES = (
    0.35, 26.6, 1.23e4, 8.6e-4, 8.2e-4, 1.5e4, 1.3e-4, 2.4e4, 1.65e4, 9e3, 0.022, 1.2e4,
    1.88, 1.63e4, 4.8e6, 3.5e-4, 0.0175, 1e8, 4.44e11, 1.24e3, 2.1, 5.78, 0.0474, 1.78e3,
    3.12,
)  # fmt: skip


def pollu(y, t, p, xp):
    """POLLU: an air-pollution model (Verwer), 20 species and 25 reactions, `p` the
    25 rate constants (from 1.3e-4 to 4.4e11)."""
    r = [None]  # r[j]: reaction j's rate, numbered from 1 as in the test set
    for k, species in zip(p, _POLLU_REACTANTS):
        rate = k * y[species[0]]
        r.append(rate if len(species) == 1 else rate * y[species[1]])
    return xp.stack(
        [
            -r[1] - r[10] - r[14] - r[23] - r[24]
            + r[2] + r[3] + r[9] + r[11] + r[12] + r[22] + r[25],
            -r[2] - r[3] - r[9] - r[12] + r[1] + r[21],
            -r[15] + r[1] + r[17] + r[19] + r[22],
            -r[2] - r[16] - r[17] - r[23] + r[15],
            -r[3] + 2 * r[4] + r[6] + r[7] + r[13] + r[20],
            -r[6] - r[8] - r[14] - r[20] + r[3] + 2 * r[18],
            -r[4] - r[5] - r[6] + r[13],
            r[4] + r[5] + r[6] + r[7],
            -r[7] - r[8],
            -r[12] + r[7] + r[9],
            -r[9] - r[10] + r[8] + r[11],
            r[9],
            -r[11] + r[10],
            -r[13] + r[12],
            r[14],
            -r[18] - r[19] + r[16],
            -r[20],
            r[20],
            -r[21] - r[22] - r[24] + r[23] + r[25],
            -r[25] + r[24],
        ]
    )  # fmt: skip


#: POLLU's solution at t = 60 as the test set gives it (RADAU5 in extended precision).
POLLU_AT_60 = (
    0.5646255480022769e-01, 0.1342484130422339e00, 0.4139734331099427e-08,
    0.5523140207484359e-02, 0.2018977262302196e-06, 0.1464541863493966e-06,
    0.7784249118997964e-01, 0.3245075353396018e00, 0.7494013383880406e-02,
    0.1622293157301561e-07, 0.1135863833257075e-07, 0.2230505975721359e-02,
    0.2087162882798630e-03, 0.1396921016840158e-04, 0.8964884856898295e-02,
    0.4352846369330103e-17, 0.6899219696263405e-02, 0.1007803037365946e-03,
    0.1772146513969984e-05, 0.5682943292316392e-04,
)  # fmt: skip


def bruss(n):
    """The Brusselator on a line of `n` points (Hairer's BRUSS, 2n states)."""

    def f(y, t, p, xp):
        a, b, alpha = p[0], p[1], p[2]
        u, v = y[:n], y[n:]
        c = alpha * (n + 1) ** 2
        one = xp.ones(1, dtype=y.dtype)
        ul, ur = xp.concatenate([one, u[:-1]]), xp.concatenate([u[1:], one])
        vl, vr = xp.concatenate([3 * one, v[:-1]]), xp.concatenate([v[1:], 3 * one])
        du = a + u * u * v - (b + 1) * u + c * (ul - 2 * u + ur)
        dv = b * u - u * u * v + c * (vl - 2 * v + vr)
        return xp.concatenate([du, dv])

    return f


_X16 = np.arange(1, 17) / 17

PROBLEMS = {
    "rober": dict(
        f=rober,
        y0=[1.0, 0.0, 0.0],
        p=[0.04, 3e7, 1e4],
        ts=[0.0, *np.logspace(-5, 5, 11)],
        w=[1.0, 1e4, 0.0],
        atol_factor=1e-4,  # y2 is of order 1e-5: atol below it
        y0_floor=1e-2,
    ),
    # Only y(1e5), weighted as in `rober` (the solution does not depend on the output
    # times; the tests of the checkpointed adjoint vary them).
    "rober_last": dict(
        f=rober,
        y0=[1.0, 0.0, 0.0],
        p=[0.04, 3e7, 1e4],
        ts=[0.0, 1e5],
        w=[1.0, 1e4, 0.0],
        atol_factor=1e-4,
        y0_floor=1e-2,
    ),
    "hires": dict(
        f=hires,
        y0=[1.0, 0, 0, 0, 0, 0, 0, 0.0057],
        p=[1.71, 0.43, 8.32, 0.0007, 8.75, 10.03, 0.035, 1.12, 1.745, 280.0, 0.69, 1.81],
        ts=list(np.linspace(0.0, 321.8122, 5)),
        w=[1.0] * 8,
        atol_factor=1.0,
    ),
    "vdpol": dict(
        f=vdpol,
        y0=[2.0, -0.66],
        p=[1e-6],
        ts=list(np.linspace(0.0, 2.0, 11)),
        w=[1.0, 1.0],
        atol_factor=1.0,
    ),
    "orego": dict(
        f=orego,
        y0=[1.0, 2.0, 3.0],
        p=[77.27, 0.161, 8.375e-6],
        ts=list(np.linspace(0.0, 360.0, 7)),
        w=[1e-4, 1.0, 1e-4],
        atol_factor=1.0,
    ),
    "bruss16": dict(
        f=bruss(16),
        y0=list(np.concatenate([1 + np.sin(2 * np.pi * _X16), 3 * np.ones(16)])),
        p=[1.0, 3.0, 0.02],
        ts=list(np.linspace(0.0, 10.0, 6)),
        w=list(np.linspace(0.5, 1.5, 32)),
        atol_factor=1.0,
    ),
    "pollu": dict(
        f=pollu,
        y0=[0, 0.2, 0, 0.04, 0, 0, 0.1, 0.3, 0.01, 0, 0, 0, 0, 0, 0, 0, 0.007, 0, 0, 0.0],
        p=list(_POLLU_RATES),
        ts=[0.0, 15.0, 30.0, 45.0, 60.0],
        w=[1.0] * 20,
        atol_factor=1e-4,  # species from 1e-1 down to 1e-8 (and 1e-17)
        y0_floor=1e-2,
    ),
}


def scipy_loss(name, p, y0):
    """The loss by SciPy's Radau at rtol 1e-12."""
    import scipy.integrate

    prob = PROBLEMS[name]
    ts = np.asarray(prob["ts"])
    sol = scipy.integrate.solve_ivp(
        lambda t, y: prob["f"](y, t, p, np),
        (ts[0], ts[-1]),
        np.asarray(y0, float),
        method="Radau",
        rtol=1e-12,
        atol=1e-14,
        t_eval=ts,
    )
    if not sol.success:
        raise RuntimeError(f"{name}: scipy failed: {sol.message}")
    return float(np.sum(sol.y[:, 1:] * np.asarray(prob["w"])[:, None]))


def reference(name):
    """The loss and its central-difference derivatives with respect to `p` and `y0`.

    Steps: `1e-5 |p_i|` for the parameters and `1e-6 max(|y0_i|, y0_floor)` for the
    initial values. `y0_floor` is 1 (the state's scale) except for ROBER and POLLU,
    where species start at zero and stay far below 1 (ROBER's second at 1e-5, POLLU's
    down to 1e-8): a step of 1e-6 would not be small against them."""
    prob = PROBLEMS[name]
    p, y0 = np.asarray(prob["p"], float), np.asarray(prob["y0"], float)

    def central(vec, i, h, which):
        plus, minus = vec.copy(), vec.copy()
        plus[i] += h
        minus[i] -= h
        args = (plus, y0) if which == "p" else (p, plus)
        args_m = (minus, y0) if which == "p" else (p, minus)
        return (scipy_loss(name, *args) - scipy_loss(name, *args_m)) / (2 * h)

    grad_p = [central(p, i, 1e-5 * abs(p[i]), "p") for i in range(p.size)]
    floor = prob.get("y0_floor", 1.0)
    grad_y0 = [central(y0, i, 1e-6 * max(abs(y0[i]), floor), "y0") for i in range(y0.size)]
    return dict(loss=scipy_loss(name, p, y0), grad_p=grad_p, grad_y0=grad_y0)


def load_references():
    return json.loads(REFERENCES.read_text())


def main(names):
    refs = load_references() if REFERENCES.exists() else {}
    for name in names or list(PROBLEMS):
        start = time.time()
        refs[name] = reference(name)
        print(f"{name}: {refs[name]['loss']:.15g} ({time.time() - start:.0f} s)", flush=True)
    REFERENCES.write_text(json.dumps(refs, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])


def batch_script(method: str) -> str:
    """A script that solves a batch of 16 linear stiff systems with `method` under
    `vmap` and prints the largest difference from the elements' own solves (run in a
    subprocess, so that a hang of the batched LU factorisations fails a test)."""
    return f"""
import jax, jax.numpy as jnp
jax.config.update("jax_enable_x64", True)
from solvers import odeint

def solve(lam):
    a = jnp.diag(jnp.full(24, lam)) + 0.1 * jnp.eye(24, k=1) - 0.1 * jnp.eye(24, k=-1)
    f = lambda y, t: a @ y + jnp.cos(t)
    ts = jnp.array([0.0, 1.0])
    return odeint(f, jnp.ones(24), ts, method="{method}", rtol=1e-8, atol=1e-8)[-1]

lam = jnp.linspace(-1.0, -1e4, 16)
batched = jax.jit(jax.vmap(solve))(lam)
one = jax.jit(solve)
print(max(float(jnp.max(jnp.abs(batched[i] - one(lam[i])))) for i in (0, 7, 15)))
"""
