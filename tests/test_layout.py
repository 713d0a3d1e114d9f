"""The package's shape: subpackages by purpose, no import circle inside d3d_core (counting imports
inside functions too), and no d3d_core import tucked inside a function (that only hides a circle)."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "d3d_core"
LAYERS = ["limits", "models", "decoding", "schemas", "measure", "training", "service"]  # each may import only those before it
# the rooms of models/, in the order they may import each other (each only those before it): the target's kernels and
# wrapper, the parts the drafters share, the drafter base, one file per drafter kind, where weights come from (the
# target's sources, hub ids), the one drafter loader, and the bundles that put a target and its drafters together
MODEL_ROOMS = ["hardware", "tokenizer", "fastops", "lowbit", "int4", "layers", "target", "drafter", "d3d", "dflash", "adapter", "standalone",
               "sources", "loader", "bundles"]
MAX_MODEL_FILE_LINES = 500
MAX_LOOP_LINES = 60


def module_name(f: Path) -> str:
    parts = f.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def internal_imports(f: Path):
    """(node, absolute module) for every import of a d3d_core module in file f."""
    here = module_name(f).split(".")
    if f.name != "__init__.py":
        here = here[:-1]  # the package the file lives in
    for node in ast.walk(ast.parse(f.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = here[: len(here) - node.level + 1]
            if node.module:
                yield node, ".".join(base + node.module.split("."))
            else:
                for a in node.names:
                    yield node, ".".join(base + [a.name])


def import_graph() -> dict:
    mods = {module_name(f) for f in PKG.rglob("*.py")}
    return {module_name(f): {m for _, m in internal_imports(f) if m in mods} for f in PKG.rglob("*.py")}


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


def test_layers_import_only_downwards():
    """models < decoding < schemas < measure < training < service (the app's facade): a part never reaches up."""
    rank = {name: i for i, name in enumerate(LAYERS)}
    up = []
    for mod, deps in import_graph().items():
        a = mod.split(".")[1] if "." in mod else None
        for d in deps:
            b = d.split(".")[1]
            if a in rank and rank[b] > rank[a]:
                up.append(f"{mod} -> {d}")
    assert not up, up


def test_no_internal_import_inside_a_function():
    hidden = []
    for f in PKG.rglob("*.py"):
        tree = ast.parse(f.read_text())
        top_lines = {n.lineno for n in tree.body if isinstance(n, ast.ImportFrom)}
        for node, mod in internal_imports(f):
            if node.lineno not in top_lines:
                hidden.append(f"{module_name(f)}:{node.lineno} imports {mod}")
    assert not hidden, hidden


def test_every_part_has_its_package():
    assert {p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists()} == {"models", "decoding", "measure", "training"}


def test_models_rooms_import_only_downwards():
    """Within models/: every file is a known room, and a room imports only the rooms before it (MODEL_ROOMS)."""
    rooms = {f.stem for f in (PKG / "models").glob("*.py") if f.name != "__init__.py"}
    assert rooms == set(MODEL_ROOMS), sorted(rooms ^ set(MODEL_ROOMS))
    rank = {name: i for i, name in enumerate(MODEL_ROOMS)}
    up = []
    for mod, deps in import_graph().items():
        parts = mod.split(".")
        if parts[1:2] != ["models"] or len(parts) < 3:
            continue
        for d in deps:
            dp = d.split(".")
            if dp[1:2] == ["models"] and len(dp) > 2 and rank[dp[2]] >= rank[parts[2]]:
                up.append(f"{mod} -> {d}")
    assert not up, up


def test_no_models_file_over_the_limit():
    long = {f.name: n for f in (PKG / "models").glob("*.py") if (n := len(f.read_text().splitlines())) > MAX_MODEL_FILE_LINES}
    assert not long, long


def test_the_decode_loop_stays_short():
    """``_loop`` reads as the method: prefill, then draft -> verify -> commit per round; the rest lives in named steps."""
    tree = ast.parse((PKG / "decoding" / "engine.py").read_text())
    loop = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "_loop")
    assert loop.end_lineno - loop.lineno + 1 <= MAX_LOOP_LINES
