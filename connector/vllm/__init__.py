"""kvbridge inside vLLM: ``KVBridgeConnector`` (import path ``connector.vllm``).

Only vLLM imports this package; the rest of kvbridge never imports vllm.
"""

from connector.vllm.connector import KVBridgeConnector

__all__ = ["KVBridgeConnector"]
