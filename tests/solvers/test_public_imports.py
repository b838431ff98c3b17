"""`solvers` uses implicitdiff through its public names only (`implicitdiff`, its public
modules, and `implicitdiff.internal`), never through a private module `implicitdiff._x`."""

from __future__ import annotations

import ast
import pathlib

import solvers

SOLVERS_DIR = pathlib.Path(solvers.__file__).parent


def private_imports(source: str, filename: str = "<source>") -> list[str]:
    """The private implicitdiff names a module's source imports (as written)."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "implicitdiff" and any(p.startswith("_") for p in parts[1:]):
                found.append(name)
    return found


def test_solvers_import_no_private_implicitdiff_module():
    bad = {
        str(path.relative_to(SOLVERS_DIR.parent)): names
        for path in sorted(SOLVERS_DIR.rglob("*.py"))
        if (names := private_imports(path.read_text(), str(path)))
    }
    assert not bad, f"private implicitdiff imports (use implicitdiff.internal): {bad}"


def test_the_check_catches_each_spelling():
    assert private_imports("from implicitdiff._errors import error_if") == [
        "implicitdiff._errors",
        "implicitdiff._errors.error_if",
    ]
    assert private_imports("import implicitdiff._jax_compat as c") == ["implicitdiff._jax_compat"]
    assert private_imports("from implicitdiff import _errors") == ["implicitdiff._errors"]
    assert private_imports("def f():\n    from implicitdiff.gradcheck import _check\n") == [
        "implicitdiff.gradcheck._check"
    ]
    assert private_imports("from implicitdiff.internal import closure_convert") == []
    assert private_imports("from implicitdiff import Primitive, linear_solve") == []
