"""The package layout is the architecture: each layer imports only from layers below it, and no
module imports itself back through others (no cycles, counting imports made only for type checking).

Layers, lowest first (a module may import its own layer's package and anything lower):

0. ``apsd.core`` — a request's life (admission, scheduler, ledger) and the interfaces the rest
   implements (engine, policy, store, hooks); values (config, models, streams, clock).
1. ``apsd.engines``, ``apsd.policies``, ``apsd.store``, ``apsd.state`` — implementations; none imports
   another.
2. ``apsd.plugins`` — discovers plugins and builds the policies and profiles they register.
3. ``apsd.pipeline`` — the one place that wires the stages together.
4. ``apsd.serve`` (the daemon and its HTTP API), ``apsd.sim`` (the simulator) — neither imports the other.
5. ``apsd`` (the public names), ``apsd.cli``, ``apsd.__main__``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "apsd"

LAYERS: tuple[tuple[str, ...], ...] = (
    ("apsd.core",),
    ("apsd.engines", "apsd.policies", "apsd.store", "apsd.state"),
    ("apsd.plugins",),
    ("apsd.pipeline",),
    ("apsd.serve", "apsd.sim"),
    ("apsd", "apsd.cli", "apsd.__main__", "apsd.reference"),
)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports_of(module: str) -> set[str]:
    """The apsd modules ``module`` imports (``from x import name`` counts as ``x.name`` when that is a
    module), type-checking imports included; in a module that imports by name (``import_module``), every
    string that names an apsd module below the package itself (a logger's name aside, "apsd")."""
    path = MODULES[module]
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found: set[str] = set()
    tree = ast.parse(path.read_text(), str(path))
    dynamic = any(isinstance(node, ast.Attribute) and node.attr == "import_module" for node in ast.walk(tree))
    for node in ast.walk(tree):
        if dynamic and isinstance(node, ast.Constant) and node.value in MODULES and node.value not in ("apsd", module):
            found.add(node.value)
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        else:
            continue
        found.update(t for t in targets if t in MODULES and t != module)
    return found


GRAPH = {module: imports_of(module) for module in MODULES}


def group_of(module: str) -> tuple[int, str]:
    """(layer, the layer's package that holds ``module``)."""
    best: tuple[int, str] | None = None
    for level, packages in enumerate(LAYERS):
        for package in packages:
            if module == package or module.startswith(package + "."):
                if best is None or len(package) > len(best[1]):
                    best = (level, package)
    assert best is not None, f"{module} is in no layer: add its package to LAYERS"
    return best


def test_the_graph_is_read():
    assert len(GRAPH) > 40
    assert "apsd.core.models" in GRAPH["apsd.core.ledger"]
    assert "apsd.policies.fair" in GRAPH["apsd.plugins"]   # (registered by name: importlib)
    assert "apsd.core.store" in GRAPH["apsd.core.admission"]  # a type-checking import counts


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_only_from_below(module):
    level, package = group_of(module)
    for target in sorted(GRAPH[module]):
        target_level, target_package = group_of(target)
        assert target_level <= level, f"{module} (layer {level}) imports {target} (layer {target_level})"
        if target_level == level and level in (1, 4):
            assert target_package == package, f"{module} imports its sibling package's {target}"


def test_no_import_cycles():
    """Tarjan's strongly connected components: every component is a single module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in GRAPH[module]:
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(GRAPH):
        if module not in index:
            visit(module)
    assert cycles == []
