"""Timing and number formatting shared by the benchmarks."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

__all__ = ["div", "fmt", "interleaved", "ratio", "rotated", "sci"]


def rotated(xs: list[str], k: int) -> list[str]:
    """`xs` rotated left by `k` (so that each round starts with a different entry)."""
    if not xs:
        return xs
    k %= len(xs)
    return xs[k:] + xs[:k]


def interleaved(
    fns: dict[str, Callable[..., Any]],
    rounds: int,
    block: int,
    budget: float = float("inf"),
    *,
    args: tuple[Any, ...] = (),
    warmup: bool = True,
    min_time: float = 0.0,
    max_rounds: int = 200,
) -> dict[str, float]:
    """Median seconds per call `f(*args)`; implementations take turns in blocks of
    `block` calls, starting with a different one each round, so that background load
    hits all alike. An implementation that has taken `budget` seconds is not called
    again. With `warmup`, one untimed round in turn comes first (the first slot ran
    slow). After `rounds` rounds, an implementation whose samples add up to less than
    `min_time` seconds goes on (up to `max_rounds` rounds), so a call of a millisecond
    gets a median of many samples rather than of a handful."""
    import jax

    samples: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    perf_counter, block_until_ready = time.perf_counter, jax.block_until_ready
    if warmup:
        for f in fns.values():
            block_until_ready(f(*args))
    gc.collect()
    gc.disable()
    try:
        r = 0
        while True:
            short = {name for name in names if sum(samples[name]) < min_time}
            if r >= rounds and (not short or r >= max_rounds):
                break
            for name in rotated(names, r):
                f, out = fns[name], samples[name]
                if (out and sum(out) > budget) or (r >= rounds and name not in short):
                    continue
                for _ in range(block):
                    t0 = perf_counter()
                    block_until_ready(f(*args))
                    out.append(perf_counter() - t0)
            if r % 10 == 9:
                gc.collect()
            r += 1
    finally:
        gc.enable()
    return {name: statistics.median(xs) for name, xs in samples.items() if xs}


def div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def fmt(v: float | None, digits: int = 3) -> str:
    if v is None:
        return "n/a"
    return f"{v:.{digits}g}" if abs(v) < 10**digits else f"{v:.0f}"


def sci(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.1e}"


def ratio(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}x"
