"""The package's layout rules (DESIGN.md, "Layout"): floors, no cycles, no module over 600 lines,
no import of another module's private name.

Floors: a package imports only the packages listed for it (and the base modules); base modules
import each other only. Every ``import`` counts, those inside functions too.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "outrider"
TOP = {"cli", "cliargs", "demo", "__main__"}
# package -> the packages it may import besides the base modules
FLOORS = {
    "base": set(),
    "ops": set(),
    "heads": {"ops"},
    "interop": {"heads", "ops"},
    "decode": {"heads", "ops"},
    "train": {"interop", "heads", "ops"},
    "bench": {"decode", "interop", "heads", "ops"},
    "plan": set(),
    "report": set(),
}
MAX_LINES = 600


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = path.relative_to(PKG.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _floor(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "outrider"
    if (PKG / parts[1]).is_dir():
        return parts[1]
    return "top" if parts[1] in TOP else "base"


def _imports(module: str, path: Path, known: dict[str, Path]) -> list[tuple[str, list[str], int]]:
    """(imported module, names taken from it, line) for every outrider import in the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("outrider"):
                    out.append((alias.name, [], node.lineno))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if not base.startswith("outrider"):
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in known:  # `from outrider.train import cache`: the module itself
                    out.append((sub, [], node.lineno))
                else:
                    out.append((base, [alias.name], node.lineno))
    return out


def _edges():
    known = _modules()
    return known, {m: _imports(m, p, known) for m, p in known.items()}


def test_floors():
    _, edges = _edges()
    wrong = []
    for module, imports in edges.items():
        floor = _floor(module)
        if floor in ("top", "outrider"):
            continue
        for target, _names, line in imports:
            to = _floor(target)
            if to == floor or to == "base" or to == "outrider" and target == "outrider":
                continue
            if floor not in FLOORS:
                wrong.append(f"{module}: package {floor} has no floor in DESIGN.md's layout")
                break
            if to not in FLOORS[floor]:
                wrong.append(f"{module}:{line} ({floor}) imports {target} ({to})")
    assert not wrong, "\n".join(wrong)


def test_no_cycles_between_files_or_packages():
    known, edges = _edges()
    graph = {m: {t for t, _n, _l in imports if t in known and t != m} for m, imports in edges.items()}
    # a package imports its own __init__ implicitly; count only explicit edges
    cycles = _cycles(graph)
    assert not cycles, "file cycles: " + "; ".join(" -> ".join(c) for c in cycles)
    pgraph: dict[str, set[str]] = {}
    for m, targets in graph.items():
        a = _floor(m)
        pgraph.setdefault(a, set()).update(_floor(t) for t in targets if _floor(t) != a)
    # the top imports everything and nothing imports the top: it cannot close a cycle
    pcycles = _cycles(pgraph)
    assert not pcycles, "package cycles: " + "; ".join(" -> ".join(c) for c in pcycles)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_over_600_lines():
    long = [f"{p.relative_to(PKG.parent)}: {n}" for p in PKG.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES]
    assert not long, "\n".join(long)


def test_no_private_names_across_modules():
    known, edges = _edges()
    wrong = []
    for module, imports in edges.items():
        for target, names, line in imports:
            for name in names:
                if name.startswith("_") and not name.startswith("__") and target != module:
                    wrong.append(f"{module}:{line} imports {target}.{name}")
    for module, path in known.items():
        tree = ast.parse(path.read_text())
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("outrider"):
                for alias in node.names:
                    if f"{node.module}.{alias.name}" in known:
                        aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("outrider") and alias.asname:
                        aliases[alias.asname] = alias.name
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                wrong.append(f"{module}:{node.lineno} uses {aliases[node.value.id]}.{node.attr}")
    assert not wrong, "\n".join(wrong)


def test_the_layout_checker_sees_a_wrong_import(tmp_path):
    """The checks can fail: a graph with a cycle is found, a private import is seen."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    path = tmp_path / "m.py"
    path.write_text("from outrider.decode.engine import _Marks\nfrom outrider.train import cache\n")
    got = _imports("outrider.heads.m", path, {"outrider.train.cache": path})
    assert got == [("outrider.decode.engine", ["_Marks"], 1), ("outrider.train.cache", [], 2)]
    assert _floor("outrider.decode.engine") == "decode" and _floor("outrider.fsutil") == "base"
    assert "decode" not in FLOORS["heads"]
