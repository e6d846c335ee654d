"""The CPU engine is a separate program: its package imports nothing from the training side,
its modules import each other without a circle, and `import artsg_nb.cpu_engine` stays light.

Read from the source with `ast` (nothing is imported), counting every import: top level,
inside functions and under `if TYPE_CHECKING:` alike, since a circle hidden in any of them is
still a circle for the reader.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "artsg_nb.cpu_engine"
PACKAGE_DIR = Path(__file__).resolve().parents[2] / "artsg_nb" / "cpu_engine"


def module_name(path: Path) -> str:
    return PACKAGE if path.stem == "__init__" else f"{PACKAGE}.{path.stem}"


def imported_modules(path: Path) -> set[str]:
    """Absolute names of the modules `path` imports (`from .x import y` → artsg_nb.cpu_engine.x)."""
    package = PACKAGE  # every module of the package sits at its top level
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                names.add(f"{base}.{node.module}" if node.module else base)
            elif node.module:
                names.add(node.module)
    return names


def import_graph() -> dict[str, set[str]]:
    """Each package module → the package modules it imports."""
    modules = {module_name(p): p for p in sorted(PACKAGE_DIR.glob("*.py"))}
    return {name: {m for m in imported_modules(path) if m in modules and m != PACKAGE}
            for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as [a, b, ..., a], or None (depth-first search, three colours)."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_package_imports_nothing_from_the_training_side():
    offenders = {module_name(p): sorted(m for m in imported_modules(p)
                                        if (m == "artsg_nb" or m.startswith("artsg_nb."))
                                        and not (m == PACKAGE or m.startswith(PACKAGE + ".")))
                 for p in sorted(PACKAGE_DIR.glob("*.py"))}
    offenders = {k: v for k, v in offenders.items() if v}
    assert not offenders, f"the CPU engine must not import the rest of artsg_nb: {offenders}"


def test_the_package_has_no_import_circle():
    graph = import_graph()
    assert len(graph) >= 10, f"expected the package's modules in {PACKAGE_DIR}, found {sorted(graph)}"
    cycle = find_cycle(graph)
    assert cycle is None, "import circle inside the CPU engine: " + " -> ".join(cycle or [])


def test_find_cycle_sees_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_the_package_init_imports_nothing():
    """`import artsg_nb.cpu_engine` (envs.py checks it imports) must not pull torch or fastapi."""
    init = PACKAGE_DIR / "__init__.py"
    assert imported_modules(init) <= {"__future__"}, imported_modules(init)
