"""The house reads in one direction (docs/architecture.md): every import, at module level or inside a
function, points down the floors eqsat -> extract -> emit -> driver -> measure -> sd15 ->
benchmarks, and no modules import each other in a circle. Read from the source with `ast`, so an
import hidden inside a function counts as much as one at the top."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLOORS = {"eqsat": 1, "extract": 2, "emit": 3, "driver": 4, "measure": 5, "sd15": 6, "benchmarks": 7}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for package in FLOORS for path in sorted((ROOT / package).rglob("*.py"))}


def _imports(path: Path, name: str, known: dict[str, Path]) -> set[str]:
    """The project modules `path` imports (`from a.b import c` names `a.b.c` when that is a module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    known = _modules()
    return {name: _imports(path, name, known) for name, path in known.items()}


def test_every_import_points_down_the_floors():
    upward = sorted(f"{name} -> {target}" for name, targets in _graph().items() for target in targets
                    if FLOORS[target.split(".")[0]] > FLOORS[name.split(".")[0]])
    assert not upward, "imports that run back up:\n" + "\n".join(upward)


def test_no_modules_import_each_other_in_a_circle():
    graph = _graph()
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(node):  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    packages = {name for name in graph if (ROOT / name.replace(".", "/") / "__init__.py").exists()}
    # A package's __init__ that hands on its submodules' names is no circle of code.
    circles = [c for c in circles if not (len(c) == 2 and any(m in packages and any(o.startswith(m + ".") for o in c)
                                                            for m in c))]
    assert not circles, "modules that import each other:\n" + "\n".join(" <-> ".join(c) for c in circles)
