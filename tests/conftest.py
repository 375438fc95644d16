"""Test-wide hooks, so that a machine without an optional part skips its tests by name:

- the ``gpu`` tier is skipped on a machine without CUDA;
- a test module that imports vLLM is skipped, with the reason, where vLLM is not installed
  (a GPU host running ``scripts/gpu_check.sh`` without vLLM is the usual case), instead of
  failing the collection of the whole run;
- the quick tier: a test is marked ``slow`` when it carries one of the ini option
  ``slow_markers`` or lives under one of ``slow_modules`` (both in pyproject.toml's
  ``[tool.pytest.ini_options]``); ``bash scripts/test.sh quick`` runs ``-m "not slow"``.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import pytest
import torch

VLLM_MISSING = "needs vLLM, which is not installed here (pip install -e '.[vllm]')"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini("slow_markers", "markers whose tests the quick tier leaves out", "args", [])
    parser.addini("slow_modules", "test files or folders the quick tier leaves out", "args", [])


def slow_paths(config: pytest.Config) -> list[Path]:
    """``slow_modules``, resolved against the rootdir; one that does not exist is refused
    by name (a file renamed would otherwise slip into the quick tier unnoticed)."""
    paths = [config.rootpath / p for p in config.getini("slow_modules")]
    missing = [str(p.relative_to(config.rootpath)) for p in paths if not p.exists()]
    if missing:
        raise pytest.UsageError(
            f"slow_modules in [tool.pytest.ini_options] names {missing}, which do not "
            "exist: rename or remove them there"
        )
    return paths


def _mark_slow(config: pytest.Config, items: list[pytest.Item]) -> None:
    markers = set(config.getini("slow_markers"))
    paths = slow_paths(config)
    for item in items:
        if any(item.get_closest_marker(m) is not None for m in markers) or any(
            item.path == p or p in item.path.parents for p in paths
        ):
            item.add_marker(pytest.mark.slow)


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _mark_slow(config, items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="gpu tier: no CUDA device here (scripts/gpu_check.sh)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


class _VLLMOptionalModule(pytest.Module):
    """A test module whose import fails only because vLLM is missing: skipped, by name."""

    def collect(self) -> Iterable[pytest.Item | pytest.Collector]:
        try:
            return super().collect()
        except self.CollectError as exc:
            cause = exc.__cause__
            # vLLM itself absent; a module missing *inside* an installed vLLM (its API
            # moved) is a failure, not a skip
            if isinstance(cause, ModuleNotFoundError) and cause.name == "vllm":
                pytest.skip(f"{self.nodeid} {VLLM_MISSING}: {cause}", allow_module_level=True)
            raise


def pytest_pycollect_makemodule(module_path, parent: pytest.Collector) -> pytest.Module | None:
    if module_path.name == "__init__.py":
        return None  # packages: pytest's own
    return _VLLMOptionalModule.from_parent(parent, path=module_path)
