"""Data-parallel training over a `Mesh` of 8 CPU devices (batch sharded, params replicated).

JAX fixes its device count when it starts, so each test runs `_sharded_checks.py` in a
fresh Python process with `XLA_FLAGS=--xla_force_host_platform_device_count=8` and
asserts that it exits 0; the script prints a table of the checks (see its docstring).
Each starts a process of its own that compiles for eight devices, so both run with the
slow tests (`pytest -m slow`).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SCRIPT = HERE / "_sharded_checks.py"


def run_checks(group: str, timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(
        filter(None, [env.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"])
    )
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--group", group],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _assert_ok(proc: subprocess.CompletedProcess) -> None:
    print(proc.stdout)  # the table, shown with `pytest -s` or on failure
    assert proc.returncode == 0, (
        f"sharded checks failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr[-4000:]}"
    )
    assert "| DEQ |" in proc.stdout or "| NeuralODE" in proc.stdout


@pytest.mark.slow
def test_sharded_layers_and_solvers():
    """DEQ, RootLayer, ArgminLayer, fixed_point, root, minimize, and a shard_map step."""
    _assert_ok(run_checks("fast", timeout=300))


@pytest.mark.slow
def test_sharded_odes():
    """NeuralODE and odeint, with the backsolve and checkpoint adjoints."""
    _assert_ok(run_checks("slow", timeout=600))
