"""kvbridge inside vLLM: ``KVBridgeConnector``.

vLLM finds it by name (``"kv_connector": "KVBridgeConnector"``: the ``vllm.general_plugins``
entry point of :mod:`kvbridge.connector.vllm.plugin`) or by module path
(``"kv_connector_module_path": "kvbridge.connector.vllm"``). The class is imported on first
access, so that the plugin, which vLLM imports in every process, loads nothing heavy.

Only vLLM imports this package; the rest of kvbridge never imports vllm.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvbridge.connector.vllm.connector import KVBridgeConnector

__all__ = ["KVBridgeConnector"]


def __getattr__(name: str) -> Any:
    if name == "KVBridgeConnector":
        from kvbridge.connector.vllm.connector import KVBridgeConnector

        return KVBridgeConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
