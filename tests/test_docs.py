"""The documentation builds strictly, and the README's links into it resolve."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from markdown.extensions.toc import slugify

ROOT = Path(__file__).resolve().parents[1]
# [text](target) outside code; images too. Targets with a scheme are not ours.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _unfenced(text: str) -> str:
    """The Markdown without its fenced code blocks."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def _anchors(page: Path) -> set[str]:
    """The heading ids MkDocs gives a page (Python-Markdown's toc slugs)."""
    headings = re.findall(r"^#{1,6} (.+?)\s*$", _unfenced(page.read_text()), flags=re.M)
    return {slugify(h.replace("`", ""), "-") for h in headings}


def _relative_links(page: Path) -> list[tuple[Path, str]]:
    """A Markdown file's relative link targets: (the file linked, its #anchor or "")."""
    prose = re.sub(r"`[^`\n]*`", "", _unfenced(page.read_text()))
    out = []
    for target in LINK.findall(prose):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue
        path, _, anchor = target.partition("#")
        out.append((Path(os.path.normpath(page.parent / path)), anchor))
    return out


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    """`mkdocs build --strict` fails on a broken link, heading, nav entry or docstring reference."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    out = f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{out}"
    assert (tmp_path / "site" / "index.html").is_file()
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    for name in ("llmsched.LLM", "llmsched.SamplingParams", "llmsched.core.Scheduler"):
        assert name in api, f"the API reference does not render {name}"


def test_readme_links_resolve() -> None:
    """Every relative link of the README and the benchmarks index names a file and heading that exist."""
    readme = _relative_links(ROOT / "README.md")
    assert any(ROOT / "docs" in f.parents for f, _ in readme), "the README links to no documentation page"
    broken = []
    for page in (ROOT / "README.md", ROOT / "benchmarks" / "README.md"):
        for file, anchor in _relative_links(page):
            where = f"{page.relative_to(ROOT)} -> {file.relative_to(ROOT)}"
            if not file.exists():
                broken.append(f"{where}: no such file")
            elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
                broken.append(f"{where}: no heading #{anchor}")
    assert not broken, "\n".join(broken)
