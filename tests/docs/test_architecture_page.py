"""docs/architecture.md draws the worker side's rooms: the tree names every module under
``connector/worker/`` and nothing that is not there."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "architecture.md"


def _drawn() -> set[str]:
    text = PAGE.read_text()
    block = text.split("```text\nconnector/worker/\n", 1)[1].split("```", 1)[0]
    drawn, folder = set(), ""
    for line in block.splitlines():
        m = re.match(r"( *)(\S+)", line)
        if not m:
            continue
        indent, name = len(m.group(1)), m.group(2)
        if name.endswith("/"):
            folder = name
        elif name.endswith(".py"):
            drawn.add(name if indent == 2 else folder + name)
    return drawn


def _modules() -> set[str]:
    base = ROOT / "connector" / "worker"
    return {
        str(p.relative_to(base))
        for p in base.rglob("*.py")
        if p.name != "__init__.py" and "__pycache__" not in p.parts
    }


def test_the_worker_tree_names_every_module_and_nothing_else():
    drawn, modules = _drawn(), _modules()
    assert drawn - modules == set(), "drawn but not in connector/worker/"
    assert modules - drawn == set(), "in connector/worker/ but not drawn"
