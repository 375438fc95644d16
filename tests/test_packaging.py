"""kvbridge installs as one import root, ``kvbridge``, from a wheel.

The folders the product's card names (``layouts/``, ``handshake/``, ``connector/``,
``examples/``) sit at the repository root; ``pyproject.toml`` maps them under
``kvbridge.``. These tests build the wheel, install it into a fresh virtual environment and
import every module from there, not from the checkout.
"""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest
import tomllib

REPO = Path(__file__).resolve().parents[1]
ROOTS = ("layouts", "handshake", "connector", "examples", "cli")


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def test_every_folder_with_modules_is_a_listed_package() -> None:
    listed = set(_pyproject()["tool"]["setuptools"]["packages"])
    folders = {
        "kvbridge." + ".".join(py.parent.relative_to(REPO).parts)
        for root in ROOTS
        for py in (REPO / root).rglob("*.py")
    }
    assert folders - listed == set(), "folders with modules missing from pyproject packages"
    assert listed - folders == set(), "pyproject packages that name no folder"
    for package in folders:
        init = REPO / Path(*package.split(".")[1:]) / "__init__.py"
        assert init.is_file(), f"{package} has no __init__.py"
        assert init.read_text().lstrip().startswith('"""'), f"{init} has no docstring"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # No build isolation: the test venv's setuptools (the test extra pins >= 70.1) builds
    # it, with no download.
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--quiet",
            "-w",
            str(out),
            str(REPO),
        ],
        check=True,
        timeout=300,
    )
    (path,) = out.glob("kvbridge-*.whl")
    return path


def test_wheel_installs_nothing_but_kvbridge(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert tops == {"kvbridge"}
    assert "kvbridge/__init__.py" not in names  # a namespace package: no file of its own
    assert "kvbridge/connector/vllm/__init__.py" in names
    assert "kvbridge/connector/worker/decode/receiver.py" in names


def test_every_module_imports_from_a_fresh_venv(wheel: Path, tmp_path: Path) -> None:
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    fresh_site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    # The dependencies (torch, nixl, vllm, ...) come from the test venv through a plain
    # path entry: a path in a .pth file is not a site dir, so the test venv's own editable
    # kvbridge (its finder .pth) is not loaded there.
    (fresh_site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--quiet",
            "--no-deps",
            "--no-index",
            "--disable-pip-version-check",
            str(wheel),
        ],
        check=True,
        timeout=300,
    )
    with zipfile.ZipFile(wheel) as archive:
        modules = sorted(
            name[: -len(".py")].replace("/", ".").removesuffix(".__init__")
            for name in archive.namelist()
            if name.endswith(".py")
        )
    script = (
        "import importlib, sys\n"
        f"site = {str(fresh_site)!r}\n"
        "bad = []\n"
        f"for name in {modules!r}:\n"
        "    module = importlib.import_module(name)\n"
        "    if not module.__file__.startswith(site):\n"
        "        bad.append((name, module.__file__))\n"
        "print(len(sys.modules), bad)\n"
        "sys.exit(1 if bad else 0)\n"
    )
    run = subprocess.run(
        [str(python), "-c", script],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert len(modules) > 100
    # a benchmark runs from the wheel (no checkout: cwd is elsewhere) and its --json parses
    out = tmp_path / "tp.json"
    bench = [str(python), "-m", "kvbridge.cli", "bench", "tp", "--tokens", "64", "--layers", "2"]
    run = subprocess.run(
        [*bench, "--json", str(out)], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stdout + run.stderr
    doc = json.loads(out.read_text())
    assert doc["bench"] == "bench_tp" and doc["config"]["tokens"] == 64 and doc["rows"], doc
