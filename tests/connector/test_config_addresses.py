"""kv_ip is advertised to peers: a wildcard is refused at load (connector.common.config)."""

from __future__ import annotations

import pytest

from kvbridge.connector.common.config import ConfigError, KVTransferConfig


@pytest.mark.parametrize("wildcard", ["0.0.0.0", "::", "[::]", "0:0:0:0:0:0:0:0", ""])
def test_a_wildcard_kv_ip_is_refused_naming_the_key_and_the_fix(wildcard: str) -> None:
    with pytest.raises(ConfigError) as info:
        KVTransferConfig.from_dict(
            {"kv_role": "kv_producer", "engine_id": "prefill-0", "kv_ip": wildcard}
        )
    text = str(info.value)
    assert f"kv_ip={wildcard!r}" in text
    assert "remote_host" in text and "address on the KV network" in text


@pytest.mark.parametrize("host", ["127.0.0.1", "10.1.2.3", "fe80::1", "prefill-0.svc.local"])
def test_a_reachable_kv_ip_is_kept(host: str) -> None:
    config = KVTransferConfig.from_dict(
        {"kv_role": "kv_consumer", "engine_id": "decode-0", "kv_ip": host}
    )
    assert config.kv_ip == host
