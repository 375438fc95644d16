"""The GPU tier's set-up path, run on CPU so that it cannot rot between GPU runs:
``scripts/gpu_check.sh setup`` installs the wheels of ``$WHEELS`` that this Python lacks
into a private folder, puts them on the import path and their console scripts on PATH,
imports everything the tier imports and finds vllm-router; ``scripts/slim_nixl_wheel.py``
drops NIXL's expert-parallel extensions from a wheel and nothing else.

The wheels here are built by the test (a router stand-in and a would-be shadow of a host
package). The real ones come from ``scripts/gpu_wheels.sh`` on a networked machine (57 MB)
and were run through this path by hand (docs/gpu-memory.md)."""

from __future__ import annotations

import importlib.util
import os
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _slim_script():
    """``scripts/slim_nixl_wheel.py``, loaded from its file (scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(
        "slim_nixl_wheel", ROOT / "scripts" / "slim_nixl_wheel.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _wheel(folder: Path, dist: str, files: dict[str, str], *, purelib: bool = True) -> Path:
    """A minimal wheel of ``dist`` holding ``files`` (path in the wheel -> text);
    ``purelib=False``: a platform wheel, as vllm-router's is."""
    info = f"{dist}-0.1.dist-info"
    files = {
        **files,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\n"
        f"Root-Is-Purelib: {str(purelib).lower()}\nTag: py3-none-any\n",
    }
    record = "".join(f"{name},,\n" for name in files) + f"{info}/RECORD,,\n"
    path = folder / f"{dist}-0.1-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            entry = zipfile.ZipInfo(name)
            executable = ".data/scripts/" in name  # as a built wheel keeps its mode
            entry.external_attr = (stat.S_IFREG | (0o755 if executable else 0o644)) << 16
            z.writestr(entry, text)
        z.writestr(f"{info}/RECORD", record)
    return path


def _setup(env: dict[str, str]) -> tuple[subprocess.CompletedProcess[str], str]:
    """``bash scripts/gpu_check.sh setup`` under ``env``: the run and its whole output
    (bounded: a pip install into a temporary folder and one Python import check)."""
    done = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "setup"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return done, done.stdout + done.stderr


def test_setup_installs_the_wheels_privately_and_finds_every_import_and_the_router(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(
        wheels,
        "gpu_probe",
        {
            "gpu_probe.py": "WHERE = 'private folder'\n",
            "gpu_probe-0.1.data/scripts/vllm-router": "#!/bin/sh\necho router stand-in\n",
        },
        purelib=False,
    )
    # a distribution this Python has: its wheel is not installed over the host's own
    _wheel(wheels, "msgspec", {"msgspec/__init__.py": "raise ImportError('shadowed')\n"})
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "WHEELS": str(wheels),
        "OUT": str(tmp_path / "out"),
        "PATH": "/usr/bin:/bin",  # no router on PATH but the wheels'
    }
    done, out = _setup(env)
    assert done.returncode == 0, out
    lines = dict(line.split(": ", 1) for line in out.splitlines() if ": " in line)
    for module in ("nixl._api", "msgspec", "zmq", "fastapi", "uvicorn", "prometheus_client"):
        assert not lines[module].startswith("MISSING"), out
    assert "installing 1 wheels" in out, out  # the router's, not msgspec's
    # kvbridge from this checkout, through the script's namespace links
    assert lines["kvbridge.cli.bench"].endswith("kvbridge/cli/bench/__init__.py"), out
    on_path = lines["vllm-router"].split("(on PATH: ", 1)[1].rstrip(")")
    assert on_path.endswith("/site/bin/vllm-router") and not on_path.startswith(str(ROOT)), out
    assert "set-up ok" in out


def test_setup_names_what_is_missing(tmp_path):
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "WHEELS": str(tmp_path / "none"),
        "OUT": str(tmp_path / "out"),
        "PYTHONNOUSERSITE": "1",
        "PATH": "/usr/bin:/bin",
    }
    # a Python that has none of the tier's packages: the interpreter the venv was made from
    base = Path(sys.base_prefix) / "bin" / Path(sys.executable).name
    env["PYTHON"] = str(base if base.exists() else Path(sys.base_prefix) / "bin" / "python3")
    done, out = _setup(env)
    assert done.returncode == 2, out
    assert "nixl._api: MISSING" in out and "gpu_check: missing nixl._api" in out, out
    assert "scripts/gpu_wheels.sh" in out, out


def test_slim_drops_the_expert_parallel_extensions_and_keeps_the_rest(tmp_path):
    wheel = _wheel(
        tmp_path,
        "nixl_cu13",
        {
            "nixl_cu13/_api.py": "API = 1\n",
            "nixl_cu13.libs/libnixl.so": "x" * 1000,
            "nixl_ep_cu13/__init__.py": "EP = 1\n",
            "nixl_ep_cu13/ep.so": "y" * 100_000,
        },
    )
    wheel.chmod(0o644)
    slim = _slim_script().slim
    assert slim(wheel) > 0
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        record = z.read("nixl_cu13-0.1.dist-info/RECORD").decode()
        kept = z.read("nixl_cu13.libs/libnixl.so").decode()
    assert not any(n.startswith("nixl_ep_cu13/") for n in names), names
    assert {"nixl_cu13/_api.py", "nixl_cu13.libs/libnixl.so"} <= names
    assert "nixl_ep_cu13" not in record and "nixl_cu13/_api.py" in record
    assert kept == "x" * 1000
    assert stat.S_IMODE(wheel.stat().st_mode) == 0o644
    assert slim(wheel) == 0  # nothing left to drop: left as it was
