"""The Python snippets in README.md and docs/*.md run (blocks in order, one namespace)."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_snippets_run(path, capsys):
    blocks = BLOCK.findall(path.read_text())
    namespace: dict = {"__name__": f"snippets_{path.stem}"}
    for i, code in enumerate(blocks):
        try:
            exec(compile(code, f"{path.name}[block {i}]", "exec"), namespace)
        except Exception as e:  # pragma: no cover - the failure message is the point
            raise AssertionError(f"{path.name}, python block {i} failed: {e!r}\n{code}") from e
