"""What a benchmark report says about the machine it ran on."""

from __future__ import annotations

import importlib.metadata
import os

__all__ = ["cpus", "loadavg", "peer_versions"]


def cpus() -> str:
    """The CPU count, and the cores this process is pinned to (e.g. by `taskset`)."""
    total = os.cpu_count()
    try:
        usable = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return f"{total} CPUs"
    if len(usable) == total:
        return f"{total} CPUs"
    return f"{total} CPUs, pinned to {','.join(map(str, usable))}"


def loadavg() -> float:
    """The 1-minute load average (nan where the platform has none)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def peer_versions() -> str:
    """The versions of the peer libraries the benchmarks compare with."""
    out = []
    for pkg in ("jaxopt", "optimistix", "lineax"):
        try:
            out.append(f"{pkg} {importlib.metadata.version(pkg)}")
        except importlib.metadata.PackageNotFoundError:
            out.append(f"{pkg} not installed")
    return ", ".join(out)
