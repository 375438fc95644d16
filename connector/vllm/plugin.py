"""The ``vllm.general_plugins`` entry point: ``"kv_connector": "KVBridgeConnector"`` alone.

kvbridge's ``pyproject.toml`` declares::

    [project.entry-points."vllm.general_plugins"]
    kvbridge = "kvbridge.connector.vllm.plugin:register_connector"

vLLM 0.32 calls every general plugin once per process (``vllm.plugins.
load_general_plugins``: from ``EngineArgs`` in the API server, from ``EngineCore`` in the
engine-core process, from ``WorkerWrapperBase`` in each worker), so the name resolves
wherever vLLM builds a connector, without ``kv_connector_module_path``. The module path
form keeps working: vLLM gives it priority over its registry.

The registration is lazy (vLLM imports :mod:`kvbridge.connector.vllm.connector` only when
a server asks for the name), so a vLLM process that serves another connector pays for
this module and vLLM's factory, nothing of kvbridge's. ``VLLM_PLUGINS``, when set, must
name ``kvbridge`` for vLLM to call it.
"""

from __future__ import annotations

import logging

CONNECTOR_NAME = "KVBridgeConnector"
CONNECTOR_MODULE = "kvbridge.connector.vllm.connector"

logger = logging.getLogger(__name__)


def register_connector() -> bool:
    """Register ``KVBridgeConnector`` with vLLM's ``KVConnectorFactory``.

    Returns True if this call registered it; False if the name was registered already
    (vLLM may call a plugin more than once, and its factory raises ``ValueError`` on a
    duplicate name) or vLLM is not installed (nothing to register with).
    """
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except ImportError:
        logger.debug("vLLM is not importable: %s not registered", CONNECTOR_NAME)
        return False
    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
    except ValueError:  # vLLM's factory refuses a name it holds: registered before
        return False
    return True
