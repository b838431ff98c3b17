"""Root finding with `solvers.root`: implied volatilities, and a nonlinear steady state.

Part 1, implied volatility. A Black-Scholes price is an increasing function of
the volatility sigma; the implied volatility of a quoted price p is the root of

    bs_price(sigma, K) - p = 0.

We price a strip of out-of-the-money options (puts below the forward, calls
above) with a known volatility smile, then recover the smile from the prices
with `root`, `vmap`ped over the whole strip, twice: by bisection on a bracket
(robust, ~20 iterations) and by Newton's method (a handful). The derivative of
the implied volatility with respect to the price comes from the implicit
function theorem and must equal 1 / vega, the closed form; it does for both
methods, bisection included, although bisection's iterations have no useful
derivative at all: `root` never differentiates them.

Part 2, a steady state. The Bratu problem `-u'' = lam exp(u)` on (0, 1) with
`u(0) = u(1) = 0` (a model of combustion), discretised by finite differences,
is a system of n nonlinear equations. We solve it with Newton, chord and
Broyden and compare their iterations, follow the solution as `lam` grows
towards the fold (beyond it no solution exists) with the implicit derivative
`du/dlam`, and check that derivative (forward mode, `jax.jvp`) against finite
differences in float64.

Everything but that check runs in float32, JAX's default. The plot goes to
`examples/out/root_finding.png` (`--out` to change the folder). Run it with

    python examples/root_finding.py           # full size, ~15 s on 2 CPU cores
    python examples/root_finding.py --small   # tiny sizes, for a smoke test

Most of the time is compilation.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.stats import norm

from solvers import root

# Market data for part 1: spot, interest rate, maturity in years.
SPOT, RATE, MATURITY = 100.0, 0.02, 0.5
FORWARD = SPOT * np.exp(RATE * MATURITY)


# ---------------------------------------------------------------------------
# Part 1: implied volatility.


def bs_price(sigma, strike, is_call):
    """Black-Scholes price of a European call (or put) on a non-dividend stock."""
    sd = sigma * jnp.sqrt(MATURITY)
    d1 = jnp.log(FORWARD / strike) / sd + sd / 2
    d2 = d1 - sd
    discount = jnp.exp(-RATE * MATURITY)
    call = discount * (FORWARD * norm.cdf(d1) - strike * norm.cdf(d2))
    put = discount * (strike * norm.cdf(-d2) - FORWARD * norm.cdf(-d1))
    return jnp.where(is_call, call, put)


def bs_vega(sigma, strike):
    """d price / d sigma, the same for calls and puts."""
    sd = sigma * jnp.sqrt(MATURITY)
    d1 = jnp.log(FORWARD / strike) / sd + sd / 2
    return SPOT * norm.pdf(d1) * jnp.sqrt(MATURITY)


def smile(strike):
    """The 'true' volatility smile used to generate the prices: a parabola in log-moneyness."""
    k = jnp.log(strike / FORWARD)
    return 0.2 - 0.1 * k + 0.3 * k**2


def price_gap(sigma, price, strike, is_call):
    """The equation `root` solves for sigma: model price minus quoted price."""
    return bs_price(sigma, strike, is_call) - price


def implied_vol_bisection(price, strike, is_call):
    # For bisection `x0` only fixes the dtype; the bracket must contain the root:
    # every option price here corresponds to a volatility between 0.1% and 500%.
    return root(
        price_gap,
        jnp.zeros_like(price),
        price,
        strike,
        is_call,
        method="bisection",
        bracket=(1e-3, 5.0),
        return_info=True,
    )


def implied_vol_newton(price, strike, is_call):
    # Start at the inflection point of the price as a function of sigma (Manaster and
    # Koehler): from there Newton's iterates converge monotonically. At the money that
    # point is sigma = 0, where the price formula is 0 / 0, so floor it at 10%.
    sigma0 = jnp.maximum(jnp.sqrt(2 * jnp.abs(jnp.log(FORWARD / strike)) / MATURITY), 0.1)
    sigma0 = sigma0.astype(price.dtype)
    return root(price_gap, sigma0, price, strike, is_call, method="newton", return_info=True)


def implied_volatility_demo(n_strikes):
    strikes = jnp.linspace(60.0, 160.0, n_strikes)
    is_call = strikes >= FORWARD  # out-of-the-money options only
    true_vol = smile(strikes)
    prices = bs_price(true_vol, strikes, is_call)
    print(f"Implied volatility of {n_strikes} options, strikes 60..160, forward {FORWARD:.2f}")

    vols, infos, sensitivities = {}, {}, {}
    for name, solve in [("bisection", implied_vol_bisection), ("newton", implied_vol_newton)]:
        # The implied vol of every option and its derivative with respect to the
        # price: `value_and_grad` of the scalar function (the info rides along as an
        # auxiliary output), vmapped over the strip, compiled once.
        batched = jax.jit(jax.vmap(jax.value_and_grad(solve, has_aux=True)))
        (vol, info), dvol_dprice = batched(prices, strikes, is_call)
        assert bool(jnp.all(info.converged)), f"{name}: some solves failed"
        err = float(jnp.max(jnp.abs(vol - true_vol)))
        print(
            f"  {name:9s} iterations {int(info.steps.min())}-{int(info.steps.max())}"
            f" (mean {float(info.steps.mean()):.1f}), max |vol - true vol| {err:.1e}"
        )
        assert err < 1e-4, f"{name} did not recover the smile: {err:.1e}"
        vols[name], infos[name], sensitivities[name] = vol, info, dvol_dprice

    # The implicit function theorem says d sigma / d p = 1 / (d p / d sigma) = 1 / vega.
    closed_form = 1 / bs_vega(true_vol, strikes)
    for name, sens in sensitivities.items():
        rel = float(jnp.max(jnp.abs(sens * bs_vega(true_vol, strikes) - 1)))
        print(f"  {name:9s} d vol / d price vs 1 / vega: max relative error {rel:.1e}")
        assert rel < 1e-3, f"{name}: implicit derivative is not 1 / vega ({rel:.1e})"
    return dict(
        strikes=strikes,
        true_vol=true_vol,
        vols=vols,
        steps={k: v.steps for k, v in infos.items()},
        sensitivities=sensitivities,
        closed_form=closed_form,
    )


# ---------------------------------------------------------------------------
# Part 2: the Bratu steady state.


def bratu_residual(u, lam):
    """Finite differences for -u'' - lam exp(u) at n interior points, u = 0 at both ends."""
    h = 1.0 / (u.shape[0] + 1)
    padded = jnp.pad(u, 1)  # the boundary values
    return (2 * u - padded[:-2] - padded[2:]) / h**2 - lam * jnp.exp(u)


def bratu(lam, n, method="newton", **options):
    """The lower-branch solution, from u = 0, and the solver's info."""
    return root(bratu_residual, jnp.zeros(n, jnp.result_type(lam)), lam, method=method, **options)


def steady_state_demo(n, n_lams):
    print(f"\nBratu problem -u'' = lam exp(u), {n} interior points, lam = 3")
    lam = jnp.float32(3.0)
    solutions = {}
    for method in ("newton", "broyden", "chord"):
        solve = jax.jit(lambda lam, m=method: bratu(lam, n, m, return_info=True))
        u, info = solve(lam)
        assert bool(info.converged), f"{method} did not converge"
        print(
            f"  {method:8s} iterations {int(info.steps):3d}   max |F(u)| {float(info.residual):.1e}"
            f"   max u {float(u.max()):.6f}"
        )
        solutions[method] = u
    for method in ("broyden", "chord"):
        gap = float(jnp.max(jnp.abs(solutions[method] - solutions["newton"])))
        assert gap < 1e-4, f"{method} and newton disagree by {gap:.1e}"

    # Follow the solution's midpoint value as lam grows, with its derivative: one
    # vmapped solve and one vmapped implicit gradient. The derivative blows up at the
    # fold (lam* ~ 3.51), where the Jacobian becomes singular.
    mid = n // 2

    def u_mid(lam):
        return bratu(lam, n)[mid]

    lams = jnp.linspace(0.2, 3.5, n_lams)
    u_mids, slopes = jax.jit(jax.vmap(jax.value_and_grad(u_mid)))(lams)
    print(f"  u(1/2) from {float(u_mids[0]):.4f} at lam = 0.2 to {float(u_mids[-1]):.4f}")
    print(f"  du(1/2)/dlam from {float(slopes[0]):.4f} to {float(slopes[-1]):.4f}")
    assert bool(jnp.all(jnp.diff(u_mids) > 0) & jnp.all(jnp.diff(slopes) > 0))

    # Forward mode gives du/dlam for the whole profile in one linear solve. Checked
    # against central differences in float64: float32's 7 digits are too few for a
    # finite difference to check anything.
    with jax.enable_x64(True):
        lam64, eps = jnp.float64(3.0), 1e-6
        tight = dict(rtol=1e-13, atol=1e-13)
        # (u, du/dlam) at lam; its first output also serves the finite differences.
        profile_and_slope = jax.jit(
            lambda lam: jax.jvp(lambda lam: bratu(lam, n, **tight), (lam,), (jnp.ones_like(lam),))
        )
        _, du = profile_and_slope(lam64)
        fd = (profile_and_slope(lam64 + eps)[0] - profile_and_slope(lam64 - eps)[0]) / (2 * eps)
        rel = float(jnp.max(jnp.abs(du - fd)) / jnp.max(jnp.abs(fd)))
        print(f"  float64 check, du/dlam at lam = 3: jvp vs finite differences {rel:.1e}")
        assert rel < 1e-6, f"implicit du/dlam disagrees with finite differences: {rel:.1e}"
    return dict(lams=lams, u_mids=u_mids, slopes=slopes)


# ---------------------------------------------------------------------------


def plot(path, vol, bratu_curve):
    # `Figure` directly (not pyplot): no GUI backend is involved, so this works headless.
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 8), layout="constrained")
    (ax_smile, ax_steps), (ax_sens, ax_bratu) = fig.subplots(2, 2)
    strikes = np.asarray(vol["strikes"])

    ax_smile.plot(strikes, vol["true_vol"], "k-", label="true smile")
    ax_smile.plot(strikes, vol["vols"]["bisection"], "C0o", mfc="none", label="bisection")
    ax_smile.plot(strikes, vol["vols"]["newton"], "C1x", label="newton")
    ax_smile.axvline(FORWARD, color="gray", lw=0.5)
    ax_smile.set(xlabel="strike", ylabel="implied volatility", title="Recovered smile")
    ax_smile.legend()

    for color, (name, steps) in zip(("C0", "C1"), vol["steps"].items()):
        ax_steps.plot(strikes, steps, "o-", color=color, label=name)
    ax_steps.set(
        xlabel="strike", ylabel="iterations", title="Iterations per option", ylim=(0, None)
    )
    ax_steps.legend()

    ax_sens.semilogy(strikes, vol["closed_form"], "k-", label="1 / vega (closed form)")
    ax_sens.semilogy(
        strikes, vol["sensitivities"]["bisection"], "C0o", mfc="none", label="implicit (bisection)"
    )
    ax_sens.semilogy(strikes, vol["sensitivities"]["newton"], "C1x", label="implicit (newton)")
    ax_sens.set(xlabel="strike", ylabel="d vol / d price", title="Sensitivity to the price")
    ax_sens.legend()

    lams, u_mids, slopes = (np.asarray(bratu_curve[k]) for k in ("lams", "u_mids", "slopes"))
    ax_bratu.plot(lams, u_mids, "k-", label="u(1/2)")
    # Tangent lines from the implicit derivative at a few points.
    for i in np.linspace(0, len(lams) - 1, 5).astype(int):
        dl = np.array([-0.1, 0.1])
        ax_bratu.plot(lams[i] + dl, u_mids[i] + slopes[i] * dl, "r-", lw=2)
    ax_bratu.plot([], [], "r-", lw=2, label="tangent from du/dlam")
    ax_bratu.axvline(3.5138, color="gray", ls="--", label="fold of the continuous problem")
    ax_bratu.set(xlabel="lam", ylabel="u(1/2)", title="Bratu steady state towards the fold")
    ax_bratu.legend()
    fig.savefig(path, dpi=120)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="few options, coarse grid")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "out", help="where the plot goes"
    )
    args = parser.parse_args(argv)
    n_strikes, n_grid, n_lams = (9, 15, 8) if args.small else (41, 63, 30)

    vol = implied_volatility_demo(n_strikes)
    bratu_curve = steady_state_demo(n_grid, n_lams)

    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "root_finding.png"
    plot(path, vol, bratu_curve)
    print(f"\nSaved {path}")


if __name__ == "__main__":
    main()
