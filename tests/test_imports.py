"""The import structure of llmsched: no cycles between files, layers import only downwards.

Every module under ``src/llmsched`` is parsed with ``ast``; each import becomes an edge from the
importing file to the file it names (``from pkg import name`` names ``pkg/name.py`` when that is a
module, else ``pkg/__init__.py``). Every import counts: one inside a function runs, just later, and
one under ``if TYPE_CHECKING:`` still ties the two files together (a type that both sides need
belongs in a module of its own, or the annotation names a Protocol). The implicit import of a
parent package's ``__init__`` is left out, so a package may re-export what its modules define.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
ROOT = "llmsched"
# Optional fast hash, imported behind a fallback (see core/kv/).
CORE_OPTIONAL = {"xxhash"}
# Layers the executor must not reach: it sits below them.
ABOVE_EXECUTOR = ("sim", "engine", "server", "bench", "cli")
# Cycles allowed for now, each with its reason; an allowance that no longer matches fails too.
# Cycles kept on purpose, each with its reason (none today).
ALLOWED_CYCLES: dict[tuple[str, ...], str] = {}


def module_files(src: Path = SRC) -> dict[str, Path]:
    """Each module name under ``llmsched`` mapped to its file (packages to their ``__init__.py``)."""
    mods: dict[str, Path] = {}
    for path in sorted((src / ROOT).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


def _imports(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement below ``node``, at any depth."""
    for child in ast.walk(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child


def imported_names(module: str, path: Path) -> Iterator[tuple[str, int]]:
    """Absolute names each import of ``module`` reaches, with line numbers.

    ``from a import b`` gives both ``a.b`` and ``a``; the caller keeps the first that is a module.
    """
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for stmt in _imports(tree):
        if isinstance(stmt, ast.Import):
            for alias in stmt.names:
                yield alias.name, stmt.lineno
            continue
        base = stmt.module or ""
        if stmt.level:
            anchor = module.split(".") if is_package else module.split(".")[:-1]
            anchor = anchor[: len(anchor) - (stmt.level - 1)]
            base = ".".join([*anchor, base]) if base else ".".join(anchor)
        for alias in stmt.names:
            yield f"{base}.{alias.name}|{base}", stmt.lineno


def import_graph(src: Path = SRC) -> dict[str, dict[str, int]]:
    """File-level graph: module -> {imported llmsched module: first line}; outside names kept as-is."""
    mods = module_files(src)
    graph: dict[str, dict[str, int]] = {}
    for module, path in mods.items():
        edges: dict[str, int] = {}
        for name, line in imported_names(module, path):
            target = _resolve(name, mods)
            if target != module:
                edges.setdefault(target, line)
        graph[module] = edges
    return graph


def _resolve(name: str, mods: dict[str, Path]) -> str:
    """The module an imported name lands on: ``a.b|a`` picks ``a.b`` if it is a module, else ``a``."""
    candidates = name.split("|")
    for cand in candidates:
        if cand in mods:
            return cand
    # A name inside llmsched that is not a module: the nearest enclosing module.
    first = candidates[-1]
    while first.startswith(ROOT + ".") and first not in mods:
        first = first.rsplit(".", 1)[0]
    return first


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components of more than one file (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph) + 100))
    try:
        for v in sorted(graph):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return sorted(found)


def _in_package(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def describe(component: list[str], graph: dict[str, dict[str, int]]) -> str:
    """The component's files and the edges inside it, with line numbers."""
    members = set(component)
    lines = [f"cycle of {len(component)} files:"]
    for mod in component:
        for target, line in sorted(graph[mod].items()):
            if target in members:
                lines.append(f"  {mod}:{line} -> {target}")
    return "\n".join(lines)


def test_the_graph_sees_relative_lazy_and_package_imports() -> None:
    graph = import_graph()
    # Catches a checker that sees nothing: these edges are known to exist.
    assert "llmsched.core.scheduler" in graph["llmsched.core"]
    assert "llmsched.core.kv.manager" in graph["llmsched.core.scheduler"] or any(
        _in_package(t, "llmsched.core.kv") for t in graph["llmsched.core.scheduler"]
    )
    assert any(_in_package(t, "llmsched.core") for t in graph["llmsched.engine.llm_engine"])


def test_checker_finds_function_level_and_type_checking_cycles(tmp_path: Path) -> None:
    pkg = tmp_path / ROOT / "pkg"
    pkg.mkdir(parents=True)
    (tmp_path / ROOT / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from .a import A\n")
    (pkg / "a.py").write_text("from . import b\nclass A: ...\n")
    (pkg / "b.py").write_text("def f():\n    from llmsched.pkg.a import A\n    return A\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .d import D\n")
    (pkg / "d.py").write_text("from .c import x\n")
    graph = import_graph(tmp_path)
    assert cycles(graph) == [["llmsched.pkg.a", "llmsched.pkg.b"], ["llmsched.pkg.c", "llmsched.pkg.d"]]


def test_no_import_cycles_between_files() -> None:
    graph = import_graph()
    found = [c for c in cycles(graph) if tuple(c) not in ALLOWED_CYCLES]
    assert not found, "\n".join(describe(c, graph) for c in found)


def test_every_allowed_cycle_still_exists() -> None:
    found = {tuple(c) for c in cycles(import_graph())}
    stale = sorted(set(ALLOWED_CYCLES) - found)
    assert not stale, (
        f"these cycles are gone (or changed): drop or update their ALLOWED_CYCLES entry: {stale}"
    )


def test_executor_imports_nothing_from_the_layers_above_it() -> None:
    graph = import_graph()
    bad = [
        f"{mod}:{line} imports {target}"
        for mod, edges in sorted(graph.items())
        if _in_package(mod, f"{ROOT}.executor")
        for target, line in sorted(edges.items())
        if any(_in_package(target, f"{ROOT}.{layer}") for layer in ABOVE_EXECUTOR)
    ]
    assert not bad, "\n".join(bad)


def test_core_imports_only_the_standard_library() -> None:
    graph = import_graph()
    allowed = set(sys.stdlib_module_names) | CORE_OPTIONAL | {"__future__"}
    bad = [
        f"{mod}:{line} imports {target}"
        for mod, edges in sorted(graph.items())
        if _in_package(mod, f"{ROOT}.core")
        for target, line in sorted(edges.items())
        if not _in_package(target, f"{ROOT}.core") and target.split(".")[0] not in allowed
    ]
    assert not bad, "\n".join(bad)


def test_only_the_simulator_imports_the_decode_shortcuts() -> None:
    # core.plain_decodes applies steps without building them: the scheduler never calls it.
    graph = import_graph()
    users = sorted(mod for mod, edges in graph.items() if "llmsched.core.plain_decodes" in edges)
    assert users and all(_in_package(mod, f"{ROOT}.sim") for mod in users), users
