"""README.md is the front door: short, the two fresh-machine commands exactly, and every
link in it leads to a file that exists (mkdocs checks the pages under docs/, not this one)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")


def test_the_readme_is_short_and_has_the_two_commands() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    assert re.search(r"^bash scripts/run_demo\.sh(\s|$)", text, re.MULTILINE)
    assert re.search(r"^bash scripts/test\.sh(\s|$)", text, re.MULTILINE)


def test_every_relative_link_in_the_readme_exists() -> None:
    links = [m[1] for m in LINK.finditer(README.read_text()) if "://" not in m[1]]
    assert links, "the README links no page: the regex is broken"
    missing = [link for link in links if not (ROOT / link).exists()]
    assert not missing, f"README.md links files that do not exist: {missing}"


def test_every_page_under_docs_is_in_the_site_navigation() -> None:
    # mkdocs build --strict checks this too; this keeps the check in pytest's reach
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())

    def pages(nav: object) -> list[str]:
        if isinstance(nav, str):
            return [nav]
        if isinstance(nav, list):
            return [p for item in nav for p in pages(item)]
        if isinstance(nav, dict):
            return [p for value in nav.values() for p in pages(value)]
        return []

    in_nav = set(pages(config["nav"]))
    on_disk = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    assert on_disk - in_nav == set(), "pages missing from mkdocs.yml's nav"
    assert in_nav - on_disk == set(), "nav entries without a page"
