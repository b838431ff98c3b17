"""The simplified Newton iteration's stopping test: Hairer and Wanner's rate test, and
the rounding floor under which a stalled iteration has converged."""

import jax.numpy as jnp
import numpy as np
import pytest

from solvers.ode.methods._newton import (
    ROUNDING_GAIN,
    STALL_RATE,
    hairer_kappa,
    rounding_floor,
    simplified_newton,
)


def _rms(dx, x):
    return jnp.sqrt(jnp.mean(jnp.square(dx)))


def _iterate(rate, start, *, kappa=1e-6, floor=0.0, max_iters=30):
    """Iterate towards 0 with error `e_(k+1) = -rate e_k` (rate 1: the iterate
    oscillates about the solution, every correction the same size, `2 |x0|`)."""
    target = jnp.zeros(4)
    x0 = jnp.full(4, start)
    return simplified_newton(
        lambda x: -(1 + rate) * (x - target),
        x0,
        _rms,
        kappa=kappa,
        max_iters=max_iters,
        eta0=1.0,
        floor=floor,
    )


def test_contracting_iteration_stops_at_kappa(x64):
    """Rate 1/2 from 1: corrections 1.5, 0.75, 0.375, ...; `eta = 1`, so the test
    `eta |dx_k| <= kappa` first holds at the k with `1.5 / 2^(k - 1) <= kappa`."""
    x, conv, eta, iters = _iterate(0.5, 1.0, kappa=1e-3)
    k = int(np.ceil(np.log2(1.5 / 1e-3))) + 1
    assert bool(conv) and int(iters) == k and float(eta) == pytest.approx(1.0)
    assert float(jnp.max(jnp.abs(x))) == pytest.approx(0.5**k)


@pytest.mark.parametrize("floor", [0.0, 1e-3])
def test_stall_above_the_floor_fails(x64, floor):
    """Every correction 2e-2 (rate exactly 1): divergence, with no floor or one below
    the corrections."""
    _, conv, _, iters = _iterate(1.0, 1e-2, floor=floor)
    assert not bool(conv) and int(iters) == 2


@pytest.mark.parametrize("rate", [1.0, 2.0])
def test_stall_below_the_floor_converges(x64, rate):
    """The same stall (or corrections that grow, as rounding noise's may) with
    corrections under a floor of 1e-3: converged at the first measured rate."""
    _, conv, eta, iters = _iterate(rate, 1e-4, floor=1e-3)
    assert bool(conv) and int(iters) == 2
    # The stalled rate is noise: `eta` is the first iteration's (`eta0 ** 0.8`), not
    # `rate / (1 - rate)` (about 1 / eps at rate 1), which a next solve would start from.
    assert float(eta) == 1.0


def test_stall_after_a_contraction_keeps_the_measured_eta(x64):
    """Corrections 1, 1/4, then a stall at 1/4 under the floor: converged at the stall,
    with `eta` from the rate 1/4 measured before it."""
    sizes = jnp.asarray([1.0, 0.25, 0.25, 0.25])

    def correction(x):  # x[0] counts the iterations, x[1] moves by the listed sizes
        return jnp.stack([1.0, sizes[x[0].astype(int)]])

    def norm(dx, x):
        return dx[1]

    _, conv, eta, iters = simplified_newton(
        correction, jnp.zeros(2), norm, kappa=1e-9, max_iters=10, eta0=1.0, floor=0.3
    )
    assert bool(conv) and int(iters) == 3
    assert float(eta) == pytest.approx(0.25 / 0.75)


def test_slow_contraction_below_the_floor_converges(x64):
    """At rate `STALL_RATE` and above, reaching `kappa` would take far more iterations
    than allowed (the step would fail): below the floor it stops at once."""
    rate = (STALL_RATE + 1) / 2
    _, conv, _, iters = _iterate(rate, 1e-4, floor=1e-3)
    assert bool(conv) and int(iters) == 2
    _, conv, _, iters = _iterate(rate, 1e-4, floor=0.0, max_iters=10)
    assert not bool(conv) and int(iters) == 10
    # Just under `STALL_RATE`, the floor does not apply: the same failure.
    _, conv, _, iters = _iterate(STALL_RATE - 0.05, 1e-4, floor=1e-3, max_iters=10)
    assert not bool(conv) and int(iters) == 10


def test_fast_contraction_below_the_floor_keeps_to_kappa(x64):
    """A rate under `STALL_RATE` is real convergence: the floor does not cut it short,
    the iteration runs to `kappa` as with no floor."""
    with_floor = _iterate(0.5, 1e-4, kappa=1e-9, floor=1e-3)
    without = _iterate(0.5, 1e-4, kappa=1e-9)
    assert bool(with_floor[1]) and int(with_floor[3]) == int(without[3]) > 2
    np.testing.assert_array_equal(with_floor[0], without[0])


def test_rounding_floor_scales_with_the_tolerance(x64):
    """`ROUNDING_GAIN` roundings in units of the tolerance, never above Hairer's
    loosest `kappa`; in double precision below `kappa` from about rtol 1.7e-8 up,
    above it from there down (the default rtol, 1.4e-8, is just below)."""
    eps = float(np.finfo(np.float64).eps)
    assert rounding_floor(1e-10, jnp.float64) == pytest.approx(ROUNDING_GAIN * eps / 1e-10)
    assert rounding_floor(1e-13, jnp.float64) == 0.03
    for rtol in (1e-3, 1e-6, 2e-8):
        assert rounding_floor(rtol, jnp.float64) < hairer_kappa(rtol, jnp.float64)
    for rtol in (1.4e-8, 1e-10):
        assert rounding_floor(rtol, jnp.float64) > hairer_kappa(rtol, jnp.float64)
    assert rounding_floor(1e-3, jnp.float32) > rounding_floor(1e-3, jnp.float64)
