"""``kvbridge bench``: it lists exactly the benchmark modules of ``kvbridge.cli.bench``,
refuses an unknown name with exit 2 naming the known ones, runs every benchmark's ``--help``
(each takes ``--json``), and the old ``scripts/bench_NAME.py`` paths still run and read as
the moved modules for one release. ``scripts/`` needs no ``sys.path`` edit and imports
nothing from ``tests``. (A benchmark run from an installed wheel: tests/test_packaging.py.)
"""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvbridge.cli.bench import BENCHMARKS
from kvbridge.cli.main import main

REPO = Path(__file__).resolve().parents[2]
BENCH_DIR = REPO / "cli" / "bench"


def in_process(capsys, *args: str) -> tuple[int, str]:
    rc = main(list(args))
    out = capsys.readouterr()
    return rc, out.out + out.err


def _modules_with_main() -> set[str]:
    """The modules of cli/bench that define a top-level ``main``: the benchmarks."""
    return {
        py.stem
        for py in BENCH_DIR.glob("*.py")
        if any(
            isinstance(node, ast.FunctionDef) and node.name == "main"
            for node in ast.parse(py.read_text()).body
        )
    }


def _listed(text: str) -> set[str]:
    return {line.split()[0] for line in text.splitlines() if line.strip()}


def test_bench_lists_exactly_the_benchmarks(capsys):
    assert _modules_with_main() == set(BENCHMARKS)
    for args in (("bench",), ("bench", "--list")):
        rc, text = in_process(capsys, *args)
        assert rc == 0, text
        assert _listed(text) == set(BENCHMARKS), text
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert all(re.search(rf"^{name}\s", text, re.M) for name in BENCHMARKS), text


def test_an_unknown_benchmark_exits_2_naming_the_known_ones(capsys):
    for name in ("nope", "results", "json"):
        rc, text = in_process(capsys, "bench", name)
        assert rc == 2, text
        assert f"no benchmark {name!r}" in text, text
        assert all(known in text for known in BENCHMARKS), text


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_every_benchmark_help_runs_from_the_entry_point(capsys, name):
    rc, text = in_process(capsys, "bench", name, "--help")
    assert rc == 0, text
    assert "usage:" in text and "--json PATH" in text, text


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_the_old_script_reads_as_the_moved_module(name):
    """``scripts/bench_NAME.py`` stays for one release: its names are the module's."""
    sys.path.insert(0, str(REPO))
    try:
        old = importlib.import_module(f"scripts.bench_{name}")
    finally:
        sys.path.remove(str(REPO))
    new = importlib.import_module(f"kvbridge.cli.bench.{name}")
    assert old.main is new.main
    assert old.argparse is new.argparse  # any name, not only main


def test_the_old_script_paths_still_run():
    for script in ("scripts/bench_tp.py", "scripts/bench_scheduler.py"):
        out = subprocess.run(
            [sys.executable, script, "--help"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0 and "--json PATH" in out.stdout, out.stdout + out.stderr
    old = (REPO / "scripts" / "bench_json.py").read_text()
    assert "kvbridge.cli.bench import results" in old


SYS_PATH_EDIT = re.compile(r"sys\.path\.(insert|append|extend)")
TESTS_IMPORT = re.compile(r"^\s*(from tests[. ]|import tests\b)", re.M)


def test_scripts_edit_no_sys_path_and_import_nothing_from_tests():
    scripts = sorted((REPO / "scripts").rglob("*.py"))
    assert len(scripts) > 15
    edits = [str(p.relative_to(REPO)) for p in scripts if SYS_PATH_EDIT.search(p.read_text())]
    assert edits == [], f"sys.path edits where the package is installed: {edits}"
    imports = {str(p.relative_to(REPO)) for p in scripts if TESTS_IMPORT.search(p.read_text())}
    assert imports == set(), f"scripts that import tests: {imports}"
