"""Smoke tests for the scripts in `examples/`: each runs with `--small` and writes its plot.

Every `examples/*.py` is picked up automatically. A script must accept `--small`
(a run of a few seconds) and `--out DIR`, exit with status 0, and save
`DIR/<script name>.png`. The scripts assert their own correctness claims
(gradient checks and the like), so a wrong answer fails the test too.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


def test_examples_found():
    assert EXAMPLES, f"no example scripts in {ROOT / 'examples'}"


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda path: path.stem)
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
