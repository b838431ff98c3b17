"""The Python snippets in README.md and docs/*.md run (blocks in order, one namespace).

The pages in `SLOW` solve ODEs, boundary-value problems or training loops in their
snippets (15 to 45 seconds each on two cores, mostly compiling): they are `slow`
(`pytest -m slow`, a CI step of its own). README.md and the other pages run with the
main suite."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SLOW = {
    "bvp.md",
    "dae.md",
    "implicit-differentiation.md",
    "odes.md",
    "solvers.md",
    "stiff.md",
    "training.md",
}
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def test_slow_pages_exist():
    assert SLOW <= {p.name for p in FILES}, SLOW


@pytest.mark.parametrize(
    "path",
    [pytest.param(p, id=p.name, marks=[pytest.mark.slow] if p.name in SLOW else []) for p in FILES],
)
def test_snippets_run(path, capsys):
    blocks = BLOCK.findall(path.read_text())
    namespace: dict = {"__name__": f"snippets_{path.stem}"}
    for i, code in enumerate(blocks):
        try:
            exec(compile(code, f"{path.name}[block {i}]", "exec"), namespace)
        except Exception as e:  # pragma: no cover - the failure message is the point
            raise AssertionError(f"{path.name}, python block {i} failed: {e!r}\n{code}") from e
