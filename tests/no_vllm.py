"""A pytest plugin that makes vLLM unimportable, as on a GPU host without it (not a test):
``pytest -p tests.no_vllm ...`` (``tests/test_no_vllm.py``). ``KVBRIDGE_TESTS_BLOCK``
names another module to make unimportable instead (default ``vllm``), e.g. one inside
vLLM, as when an installed vLLM moved an API."""

from __future__ import annotations

import importlib.abc
import os
import sys

BLOCKED = os.environ.get("KVBRIDGE_TESTS_BLOCK", "vllm")


class _Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name == BLOCKED or name.startswith(BLOCKED + "."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


for _name in [n for n in sys.modules if n == BLOCKED or n.startswith(BLOCKED + ".")]:
    del sys.modules[_name]
sys.meta_path.insert(0, _Blocked())
