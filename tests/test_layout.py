"""The package's shape: no import circle inside d3d_core, counting imports inside functions too."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "d3d_core"


def import_graph() -> dict:
    mods = {p.stem for p in PKG.glob("*.py")}
    g = {}
    for f in PKG.glob("*.py"):
        deps = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                deps |= {node.module.split(".")[0]} if node.module else {a.name for a in node.names}
        g[f.stem] = deps & mods
    return g


def find_cycle(g: dict):
    state = {}

    def visit(n, path):
        state[n] = 1
        for d in sorted(g.get(n, ())):
            if state.get(d) == 1:
                return path[path.index(d):] + [d]
            if d not in state:
                c = visit(d, path + [d])
                if c:
                    return c
        state[n] = 2
        return None

    for n in sorted(g):
        if n not in state:
            c = visit(n, [n])
            if c:
                return c
    return None


def test_no_import_circle_in_d3d_core():
    assert find_cycle(import_graph()) is None, " -> ".join(find_cycle(import_graph()))


def test_the_checker_finds_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
