"""kvbridge inside vLLM: ``KVBridgeConnector`` (import path ``kvbridge.connector.vllm``).

Only vLLM imports this package; the rest of kvbridge never imports vllm.
"""

from kvbridge.connector.vllm.connector import KVBridgeConnector

__all__ = ["KVBridgeConnector"]
