"""No input path decodes with pickle or evaluates code, and every input has a size limit.

Walks the source tree (the packages, the examples and the scripts) with ``ast``: no module
imports pickle, marshal, shelve, dill or cloudpickle, and nothing calls ``eval``, ``exec``,
``torch.load`` or ``numpy.load`` (both unpickle). The size limits are asserted as values.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("connector", "handshake", "layouts", "examples", "scripts")
UNSAFE_MODULES = {"pickle", "cPickle", "marshal", "shelve", "dill", "cloudpickle", "_pickle"}
UNSAFE_CALLS = {"eval", "exec", "torch.load", "np.load", "numpy.load", "pickle.loads"}


def _sources() -> list[Path]:
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]
    assert len(files) > 50, f"found only {len(files)} source files under {ROOT}"
    return files


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def _violations(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [(node.module or "").split(".")[0]]
        elif isinstance(node, ast.Call):
            names = []
            if _dotted(node.func) in UNSAFE_CALLS:
                out.append(f"{path.relative_to(ROOT)}:{node.lineno} calls {_dotted(node.func)}")
        else:
            continue
        out += [
            f"{path.relative_to(ROOT)}:{node.lineno} imports {n}"
            for n in names
            if n in UNSAFE_MODULES
        ]
    return out


def test_no_source_file_unpickles_or_evaluates():
    found = [v for p in _sources() for v in _violations(p)]
    assert found == []


def test_the_walker_finds_what_it_looks_for(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import pickle\nfrom marshal import loads\nx = eval('1')\ntorch.load(f)\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        assert len(_violations(bad)) == 4
    finally:
        ROOT = saved


@pytest.mark.parametrize(
    ("where", "name", "limit"),
    [
        ("kvbridge.connector.common.notifications", "MAX_NOTIFICATION_BYTES", 64 * 1024),
        ("kvbridge.examples.http_app", "MAX_BODY_BYTES", 1 << 20),
        ("kvbridge.connector.common.params", "MAX_TOKENS", 1 << 24),
    ],
)
def test_every_input_has_a_size_limit(where, name, limit):
    import importlib

    assert getattr(importlib.import_module(where), name) == limit


def test_the_side_channel_limits_its_messages():
    from kvbridge.handshake.framing import HandshakeSecurity

    security = HandshakeSecurity()
    assert 0 < security.max_message_bytes <= 16 << 20
