"""Every load the test suite runs proves its bytes (issue 38, item 5).

The harnesses that build a decode (the in-process pairs and clusters, the example servers'
launchers, the vLLM peers and servers) give it ``extra.verify: "all"`` unless the test
chose a setting: decode then asks prefill for digests of every row it moves and fails a
load whose landed bytes differ, so no test passes on bytes that merely happen to work.
The product's default stays ``"sample"`` (``connector/common/config.py``).

In vLLM the ``extra`` object is a key of ``kv_connector_extra_config``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

VERIFY = "all"


def verify_all(extra: Mapping[str, Any] | None) -> dict[str, Any]:
    """An ``extra`` object with ``verify: "all"`` unless it sets ``verify`` itself."""
    return {"verify": VERIFY, **(extra or {})}


def verifying(kv: Mapping[str, Any]) -> dict[str, Any]:
    """A decode's kv-transfer-config (or the overrides a harness merges into one) whose
    ``extra`` verifies every load, unless the test chose a ``verify`` setting."""
    return {**kv, "extra": verify_all(kv.get("extra"))}


def is_decode(kv_role: str) -> bool:
    """Whether a worker of ``kv_role`` loads KV (and so reads ``extra.verify``)."""
    return kv_role != "kv_producer"
