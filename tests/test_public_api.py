"""What users write stays working: the import paths the manual gives, the base error every
kvbridge error derives from, and the configuration keys.

A public path or key that moves keeps its old name for one release (a re-export, or an
alias key), listed here; everything else under ``kvbridge.*`` is internal and may move
(CONTRIBUTING.md, "What is public").
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import msgspec
import pytest

from kvbridge.connector.common.config import ExtraConfig, KVTransferConfig
from kvbridge.layouts.errors import KVBridgeError

# (module, name): what docs/architecture.md, docs/vllm.md and the README tell users to import
PUBLIC = [
    ("kvbridge.layouts.errors", "KVBridgeError"),
    ("kvbridge.layouts.allocation", "KVCacheBuffers"),
    ("kvbridge.connector.common.config", "KVTransferConfig"),
    ("kvbridge.connector.common.api", "WorkerConnector"),
    ("kvbridge.connector.common.api", "SchedulerConnector"),
    ("kvbridge.connector.scheduler.scheduler", "KVBridgeScheduler"),
    ("kvbridge.connector.worker.worker", "KVBridgeWorker"),
    ("kvbridge.connector.worker.worker", "ModelInfo"),
]
# the keys of this release (kv_connector_extra_config and its "extra"): a key may be added;
# one renamed keeps its old name as an alias for a release, one removed is refused by name
CONFIG_KEYS = {
    "kv_role",
    "engine_id",
    "kv_ip",
    "kv_port",
    "kv_buffer_device",
    "failure_policy",
    "lease_s",
    "heartbeat_s",
    "handshake_timeout_s",
    "transfer_timeout_s",
    "secret",
    "extra",
}
EXTRA_KEYS = {
    "transfer_mode",
    "rewrite_on_save",
    "staging_mib",
    "warm_peers",
    "nixl_progress_us",
    "idle_progress_ms",
    "busy_progress_us",
    "merge_runs",
    "engine_thread_nice",
    "engine_step_wait",
    "max_quarantined_mib",
    "verify",
    "verify_rate",
}
# packages whose errors users may catch: every one derives from KVBridgeError
ERROR_PACKAGES = [
    "kvbridge.layouts",
    "kvbridge.handshake",
    "kvbridge.connector.common",
    "kvbridge.connector.transfer",
    "kvbridge.connector.scheduler",
    "kvbridge.connector.worker",
]


@pytest.mark.parametrize(("module", "name"), PUBLIC, ids=[f"{m}.{n}" for m, n in PUBLIC])
def test_a_documented_import_path_works(module, name):
    obj = getattr(importlib.import_module(module), name)
    assert inspect.isclass(obj) and obj.__name__ == name


def test_the_vllm_connector_is_where_users_point_vllm():
    pytest.importorskip("vllm", reason="vLLM is not installed here")
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    # kv_connector_module_path = "kvbridge.connector.vllm", kv_connector = "KVBridgeConnector"
    connector = importlib.import_module("kvbridge.connector.vllm").KVBridgeConnector
    assert issubclass(connector, KVConnectorBase_V1)


def _fields(struct: type) -> set[str]:
    return {f.encode_name for f in msgspec.structs.fields(struct)}


def test_every_configuration_key_of_this_release_is_still_read():
    assert CONFIG_KEYS - _fields(KVTransferConfig) == set(), "a top-level key went away"
    assert EXTRA_KEYS - _fields(ExtraConfig) == set(), "an extra key went away"


def test_every_kvbridge_error_is_a_kvbridge_error():
    foreign = []
    for root in ERROR_PACKAGES:
        pkg = importlib.import_module(root)
        names = [root] + [m.name for m in pkgutil.walk_packages(pkg.__path__, f"{root}.")]
        for name in names:
            for attr, obj in vars(importlib.import_module(name)).items():
                defined_here = inspect.isclass(obj) and obj.__module__ == name
                if defined_here and issubclass(obj, Exception):
                    if not issubclass(obj, KVBridgeError):
                        foreign.append(f"{name}.{attr}")
    assert foreign == [], "errors users cannot catch as KVBridgeError"
