"""A pytest plugin that makes vLLM unimportable, as on a GPU host without it (not a test):
``pytest -p tests.no_vllm ...`` (``tests/test_no_vllm.py``)."""

from __future__ import annotations

import importlib.abc
import sys


class _NoVLLM(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name.split(".")[0] == "vllm":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


for _name in [n for n in sys.modules if n.split(".")[0] == "vllm"]:
    del sys.modules[_name]
sys.meta_path.insert(0, _NoVLLM())
