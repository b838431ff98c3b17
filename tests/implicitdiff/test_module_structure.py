"""The layering of the package: implicitdiff's modules import one another one way only
(no cycles, each module imports on its own), and implicitdiff imports nothing of the
layers above it (`solvers`) or of their dependencies (equinox, optax, diffrax)."""

from __future__ import annotations

import ast
import json
import pathlib
import subprocess
import sys

import pytest

import implicitdiff

PACKAGE_DIR = pathlib.Path(implicitdiff.__file__).parent
FORBIDDEN = ("solvers", "equinox", "optax", "diffrax")


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


SOURCES = {_module_name(p): p for p in sorted(PACKAGE_DIR.rglob("*.py"))}
# `__main__` modules run a command line when imported: they are checked as source only.
MODULES = sorted(name for name in SOURCES if not name.endswith(".__main__"))


def _imports(name: str) -> list[str]:
    """The absolute names of every module `name` imports, at module level or inside
    functions (docstrings are not code and do not count)."""
    path = SOURCES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            # `from package import submodule` imports the submodule.
            subs = [f"{module}.{alias.name}" for alias in node.names]
            found += [s for s in subs if s in SOURCES] or [module]
    return found


def _graph() -> dict[str, set[str]]:
    return {name: {m for m in _imports(name) if m in SOURCES and m != name} for name in SOURCES}


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_imports_within_implicitdiff_point_one_way():
    cycle = _find_cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_cycle_finder_finds_a_cycle():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_graph_sees_the_layers():
    graph = _graph()
    assert "implicitdiff._primitive" in graph["implicitdiff._vmap"]
    assert "implicitdiff._derive" in graph["implicitdiff._primitive"]
    assert "implicitdiff.linear_solve" in graph["implicitdiff.root"]


def test_implicitdiff_source_never_imports_the_layers_above():
    bad = [(name, m) for name in SOURCES for m in _imports(name) if m.split(".")[0] in FORBIDDEN]
    assert not bad, f"implicitdiff modules import {bad}"


# A module imported on its own: its packages are stand-ins that run no `__init__`, so
# only the module and what it imports itself are loaded, in the order it needs them.
_IMPORT_ALONE = """
import importlib, json, pathlib, sys, traceback, types
root = pathlib.Path(sys.argv[1])
failures = {}
for name in json.loads(sys.argv[2]):
    for m in [m for m in sys.modules if m.split(".")[0] == "implicitdiff"]:
        del sys.modules[m]
    parts = name.split(".")
    for i in range(1, len(parts)):
        stub = types.ModuleType(".".join(parts[:i]))
        stub.__path__ = [str(root.joinpath(*parts[1:i]))]
        sys.modules[stub.__name__] = stub
    try:
        importlib.import_module(name)
    except Exception:
        failures[name] = traceback.format_exc(limit=-3)
print(json.dumps(failures))
"""


def _import_alone(names: list[str]) -> dict[str, str]:
    out = subprocess.run(
        [sys.executable, "-c", _IMPORT_ALONE, str(PACKAGE_DIR), json.dumps(names)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_every_module_imports_on_its_own():
    """One fresh interpreter, in which each module in turn is imported with nothing of
    implicitdiff loaded before it."""
    failures = _import_alone(MODULES)
    assert not failures, "\n".join(f"{k}:\n{v}" for k, v in failures.items())


@pytest.mark.slow
@pytest.mark.parametrize("name", MODULES)
def test_module_imports_alone_in_a_fresh_interpreter(name):
    failures = _import_alone([name])
    assert not failures, failures


def test_importing_implicitdiff_loads_nothing_of_the_layers_above():
    code = (
        "import sys, json, implicitdiff, implicitdiff.internal, implicitdiff.gradcheck; "
        f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
