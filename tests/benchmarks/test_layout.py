"""benchmarks/ in folders: the README indexes every script, and no script reaches into another group."""

from __future__ import annotations

import ast
import re
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SHARED = "_common"


def scripts() -> dict[str, Path]:
    """Every benchmark module by its module name (file stem)."""
    found: dict[str, list[Path]] = {}
    for path in sorted(BENCHMARKS.glob("*/*.py")):
        found.setdefault(path.stem, []).append(path)
    twice = {name: paths for name, paths in found.items() if len(paths) > 1}
    # Module names are flat (each script's folder is its import root), so one name, one file.
    assert not twice, twice
    return {name: paths[0] for name, paths in found.items()}


def test_scripts_live_in_a_group_folder_not_at_the_top() -> None:
    assert sorted(p.name for p in BENCHMARKS.glob("*.py")) == []
    groups = {p.parent.name for p in scripts().values()}
    assert groups == {"cpu", "serving", "simulator", "features", SHARED}


def test_the_readme_indexes_every_script_by_its_folder() -> None:
    readme = (BENCHMARKS / "README.md").read_text()
    linked = set(re.findall(r"\]\(([\w/]+\.py)\)", readme))
    on_disk = {p.relative_to(BENCHMARKS).as_posix() for p in scripts().values()}
    assert len(on_disk) > 20
    assert on_disk - linked == set(), "not in benchmarks/README.md"
    assert linked - on_disk == set(), "benchmarks/README.md links a script that is not there"


def _imported_top_names(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def test_a_script_imports_only_its_own_folder_and_the_shared_one() -> None:
    mods = scripts()
    bad = [
        f"{path.relative_to(BENCHMARKS)} imports {name} ({mods[name].relative_to(BENCHMARKS)})"
        for path in mods.values()
        for name in sorted(_imported_top_names(path) & set(mods))
        if mods[name].parent.name not in (path.parent.name, SHARED)
    ]
    assert bad == []


def test_shared_modules_import_no_group() -> None:
    mods = scripts()
    bad = [
        f"{path.name} imports {name}"
        for path in mods.values()
        if path.parent.name == SHARED
        for name in sorted(_imported_top_names(path) & set(mods))
        if mods[name].parent.name != SHARED
    ]
    assert bad == []
