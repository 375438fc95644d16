"""vLLM's host-buffer copy operation, run on its CPU build, and a recorder of its calls
(not a test).

vLLM's GPU model runner hands a connector ``copy_kv_blocks``
(``vllm.distributed.kv_transfer.kv_connector.utils``) through
``set_host_xfer_buffer_ops``; per layer it calls ``current_platform``'s
``insert_blocks_to_device`` (h2d) or ``swap_out_blocks_to_host`` (d2h). vLLM 0.32's CPU
platform defines neither (nor does the ``Platform`` interface: on this build
``copy_kv_blocks`` would call ``None``), and ``vllm.platforms.cuda`` cannot be imported
without vLLM's CUDA extension. :func:`cuda_platform_copies` therefore compiles the CUDA
platform's two functions from the installed vLLM's own ``platforms/cuda.py`` (plain torch
indexing on dim 0), and :func:`vllm_copy_kv_blocks` runs the real ``copy_kv_blocks``
with them, on CPU tensors.
"""

from __future__ import annotations

import ast
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import vllm.platforms
from vllm.distributed.kv_transfer.kv_connector import utils as kv_utils

COPY_FUNCTIONS = ("insert_blocks_to_device", "swap_out_blocks_to_host")


def cuda_platform_copies() -> SimpleNamespace:
    """The CUDA platform's block copies (``CudaPlatformBase``), compiled from vLLM's
    ``platforms/cuda.py``."""
    source = Path(inspect.getsourcefile(vllm.platforms) or "").with_name("cuda.py")
    tree = ast.parse(source.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "CudaPlatformBase")
    found = {}
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name in COPY_FUNCTIONS:
            node.decorator_list = []  # @classmethod: called below with cls=None
            module = ast.Module(body=[node], type_ignores=[])
            scope: dict[str, Any] = {"torch": torch}
            exec(compile(module, str(source), "exec"), scope)  # vLLM's own code
            found[node.name] = functools.partial(scope[node.name], None)
    missing = set(COPY_FUNCTIONS) - set(found)
    assert not missing, f"vLLM's CudaPlatformBase no longer defines {missing} ({source})"
    return SimpleNamespace(**found)


def vllm_copy_kv_blocks() -> Callable[..., None]:
    """vLLM's own ``copy_kv_blocks``, whose platform is the CUDA one while it runs (see
    the module)."""
    platform = cuda_platform_copies()

    def copy_kv_blocks(*args: Any) -> None:
        saved = kv_utils.current_platform
        kv_utils.current_platform = platform
        try:
            kv_utils.copy_kv_blocks(*args)
        finally:
            kv_utils.current_platform = saved

    return copy_kv_blocks


@dataclass(frozen=True)
class CopyCall:
    """One call of the copy operation: direction, layers, block ids (src, dst)."""

    direction: str
    layers: tuple[str, ...]
    src_block_ids: tuple[int, ...]
    dst_block_ids: tuple[int, ...]


class RecordingCopyOp:
    """Wraps the copy operation; records every call, then makes it."""

    def __init__(self, op: Callable[..., None]) -> None:
        self.op = op
        self.calls: list[CopyCall] = []

    def __call__(
        self,
        src: dict[str, torch.Tensor],
        dst: dict[str, torch.Tensor],
        src_block_ids: list[int],
        dst_block_ids: list[int],
        direction: str,
    ) -> None:
        self.calls.append(
            CopyCall(direction, tuple(src), tuple(src_block_ids), tuple(dst_block_ids))
        )
        self.op(src, dst, src_block_ids, dst_block_ids, direction)
