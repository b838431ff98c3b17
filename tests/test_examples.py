"""Smoke tests for the scripts in `examples/`: each runs with `--small` and writes its plot.

Every `examples/*.py` is picked up automatically. A script must accept `--small`
(a run of a few seconds) and `--out DIR`, exit with status 0, and save
`DIR/<script name>.png`. The scripts assert their own correctness claims
(gradient checks and the like), so a wrong answer fails the test too.

Each script is a fresh process that imports JAX and compiles its solves (15 to 60
seconds on two cores), so only `MAIN` run with the main suite, one optimisation-layer
fit and one training loop; the others are `slow` (`pytest -m slow`, a CI step of its
own).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
#: The examples the main suite runs (the quickest two: an `ArgminLayer` fit and a
#: neural ODE trained with optax).
MAIN = {"hyperparameter_argmin", "neural_ode_pendulum"}


def test_examples_found():
    assert EXAMPLES, f"no example scripts in {ROOT / 'examples'}"
    assert MAIN <= {path.stem for path in EXAMPLES}, MAIN


@pytest.mark.parametrize(
    "script",
    [
        pytest.param(path, id=path.stem, marks=[] if path.stem in MAIN else [pytest.mark.slow])
        for path in EXAMPLES
    ],
)
def test_example_runs(script, tmp_path):
    env = {**os.environ, "MPLBACKEND": "Agg"}
    # The scripts import the packages of this checkout, installed or not.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, str(script), "--small", "--out", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, (
        f"{script.name} --small exited with {result.returncode}\n"
        f"--- stdout ---\n{result.stdout}\n--- stderr ---\n{result.stderr}"
    )
    plot = tmp_path / f"{script.stem}.png"
    assert plot.is_file() and plot.stat().st_size > 0, f"{script.name} did not save {plot}"
