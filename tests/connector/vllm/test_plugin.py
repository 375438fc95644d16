"""The ``vllm.general_plugins`` entry point: the name alone finds the connector in vLLM,
registering twice is harmless, and importing the plugin loads nothing heavy."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import tomllib

from kvbridge.connector.vllm import plugin

ROOT = Path(__file__).resolve().parents[3]
ENTRY_POINT = "kvbridge.connector.vllm.plugin:register_connector"


def _vllm_factory(monkeypatch: pytest.MonkeyPatch) -> type:
    """vLLM's ``KVConnectorFactory`` with a registry of its own for this test (the class
    attribute is process-global): vLLM's built-in names, not kvbridge's."""
    factory_module = pytest.importorskip(
        "vllm.distributed.kv_transfer.kv_connector.factory", reason="vLLM is not installed"
    )
    factory = factory_module.KVConnectorFactory
    registry = {k: v for k, v in factory._registry.items() if k != plugin.CONNECTOR_NAME}
    monkeypatch.setattr(factory, "_registry", registry)
    return factory


def _transfer_config(**kwargs: str) -> object:
    from vllm.config.kv_transfer import KVTransferConfig

    return KVTransferConfig(kv_connector="KVBridgeConnector", kv_role="kv_both", **kwargs)


def test_pyproject_declares_the_plugin_and_the_install_carries_it():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    assert declared["vllm.general_plugins"] == {"kvbridge": ENTRY_POINT}
    installed = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert installed.get("kvbridge") == ENTRY_POINT, (
        "the installed metadata predates the entry point: pip install -e . again"
    )


def test_the_name_alone_resolves_to_the_connector(monkeypatch):
    factory = _vllm_factory(monkeypatch)
    with pytest.raises(ValueError, match="Unsupported connector type"):
        factory.get_connector_class(_transfer_config())
    assert plugin.register_connector() is True
    from kvbridge.connector.vllm.connector import KVBridgeConnector

    assert factory.get_connector_class(_transfer_config()) is KVBridgeConnector
    # vLLM asks whether the class supports its hybrid allocator before it builds one
    assert factory.supports_hma_config(_transfer_config()) is True


def test_registering_twice_keeps_the_first_and_does_not_raise(monkeypatch):
    factory = _vllm_factory(monkeypatch)
    assert plugin.register_connector() is True
    loader = factory._registry[plugin.CONNECTOR_NAME]
    assert plugin.register_connector() is False
    assert factory._registry[plugin.CONNECTOR_NAME] is loader


def test_vllm_calls_the_plugin_through_its_entry_point(monkeypatch):
    factory = _vllm_factory(monkeypatch)
    import vllm.plugins

    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)  # as in a fresh process
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    vllm.plugins.load_general_plugins()
    assert plugin.CONNECTOR_NAME in factory._registry


def test_the_module_path_form_keeps_working(monkeypatch):
    factory = _vllm_factory(monkeypatch)  # kvbridge not registered: the path alone
    from kvbridge.connector.vllm.connector import KVBridgeConnector

    config = _transfer_config(kv_connector_module_path="kvbridge.connector.vllm")
    assert factory.get_connector_class(config) is KVBridgeConnector


def test_without_vllm_the_plugin_registers_nothing_and_does_not_raise(monkeypatch):
    # None in sys.modules makes the import raise ImportError, as on a host without vLLM
    monkeypatch.setitem(sys.modules, "vllm.distributed.kv_transfer.kv_connector.factory", None)
    assert plugin.register_connector() is False


def test_importing_the_plugin_loads_nothing_heavy():
    """vLLM imports the plugin in every process, whichever connector it serves."""
    heavy = ["torch", "vllm", "nixl", "numpy", "zmq", "kvbridge.connector.vllm.connector"]
    code = (
        "import json, sys; import kvbridge.connector.vllm.plugin; "
        f"print(json.dumps([m for m in {heavy!r} if m in sys.modules]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert json.loads(done.stdout) == []
