"""KVTransferConfig's one typed decoder: every key, in ``extra`` too, is known, typed and in
range, and each error names the key path, the value and what was wanted."""

from __future__ import annotations

import re

import msgspec
import pytest

from kvbridge.connector.common.config import (
    EXTRA_KEYS,
    ConfigError,
    ExtraConfig,
    FailurePolicy,
    KVRole,
    KVTransferConfig,
    ReadProbeMode,
    VerifyMode,
)
from kvbridge.handshake.modes import TransferMode

BASE = {"kv_role": "kv_consumer", "engine_id": "decode-0"}

# Every field away from its default, so that a round trip proves each one is read back.
EVERY_FIELD = KVTransferConfig(
    kv_role=KVRole.BOTH,
    engine_id="both-7",
    kv_ip="10.0.0.9",
    kv_port=6200,
    kv_buffer_device="cpu",
    failure_policy=FailurePolicy.FAIL,
    lease_s=12.5,
    heartbeat_s=2.0,
    handshake_timeout_s=1.5,
    transfer_timeout_s=45.0,
    secret="s3cret",
    extra=ExtraConfig(
        transfer_mode=TransferMode.PUSH,
        rewrite_on_save=True,
        staging_mib=0.5,
        warm_peers=("10.0.0.1:5600", "prefill-1:5601"),
        nixl_progress_us=2000,
        idle_progress_ms=2.5,
        busy_progress_us=300,
        merge_runs=True,
        engine_thread_nice=19,
        engine_step_wait="sleep0",
        max_quarantined_mib=256.0,
        verify=VerifyMode.ALL,
        verify_rate=0.5,
        gather_mib=16,
        model_fingerprint="llama-3-8b@r1",
        read_probe=ReadProbeMode.OFF,
    ),
)


def decode(**changes: object) -> KVTransferConfig:
    return KVTransferConfig.from_dict({**BASE, **changes})


def refused(fragment: str, **changes: object) -> str:
    """The message of the ConfigError decoding ``BASE | changes`` raises; it holds
    ``fragment`` verbatim."""
    with pytest.raises(ConfigError, match=re.escape(fragment)) as err:
        decode(**changes)
    return str(err.value)


# ---------------------------------------------------------------- unknown keys


def test_an_unknown_top_level_key_is_named_with_every_known_key():
    message = refused("unknown kv-transfer-config key 'kv_prot'; known keys: [", kv_prot=1)
    for name in KVTransferConfig.__struct_fields__:
        assert repr(name) in message


def test_an_unknown_extra_key_is_named_by_its_path_with_every_known_extra_key():
    """A typo must not silently keep the default (here transfer_mode's "pull")."""
    message = refused(
        "unknown kv-transfer-config key 'extra.transfer_mod'; known extra keys: [",
        extra={"transfer_mod": "push"},
    )
    assert EXTRA_KEYS == set(ExtraConfig.__struct_fields__)
    for name in EXTRA_KEYS:
        assert repr(name) in message
    assert "kv_port" not in message  # the top-level keys are not what was mistyped


def test_the_retired_max_peer_block_size_says_why_it_went():
    refused(
        "extra.max_peer_block_size is no longer used: decode resumes at the prompt's last "
        "token whatever the two block sizes are",
        extra={"max_peer_block_size": 64},
    )


# ---------------------------------------------------------------- types


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"kv_port": "5600"}, "kv_port='5600' must be of type int (got str)"),
        # strict: a JSON true is not the integer 1, nor a number of seconds
        ({"kv_port": True}, "kv_port=True must be of type int (got bool)"),
        ({"kv_port": 5600.0}, "kv_port=5600.0 must be of type int (got float)"),
        ({"lease_s": True}, "lease_s=True must be of type float (got bool)"),
        ({"heartbeat_s": "5"}, "heartbeat_s='5' must be of type float (got str)"),
        ({"kv_ip": 10}, "kv_ip=10 must be of type str (got int)"),
        ({"secret": 123}, "secret=123 must be of type str | null (got int)"),
        ({"kv_role": "prefill"}, "kv_role='prefill' is not one of ['kv_producer', 'kv_consumer'"),
        ({"kv_role": 1}, "kv_role=1 is not one of ['kv_producer', 'kv_consumer', 'kv_both']"),
        ({"failure_policy": "retry"}, "failure_policy='retry' is not one of ['recompute', 'fail']"),
        ({"extra": "push"}, "extra='push' must be of type object (got str)"),
    ],
)
def test_a_top_level_value_of_the_wrong_type_names_the_key_and_the_type(changes, fragment):
    refused(fragment, **changes)


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        ({"transfer_mode": "sideways"}, "extra.transfer_mode='sideways' is not one of ['pull', "),
        ({"transfer_mode": 1}, "extra.transfer_mode=1 is not one of ['pull', 'push']"),
        ({"rewrite_on_save": "yes"}, "extra.rewrite_on_save='yes' must be of type bool (got str)"),
        ({"rewrite_on_save": 1}, "extra.rewrite_on_save=1 must be of type bool (got int)"),
        ({"staging_mib": "64"}, "extra.staging_mib='64' must be of type float (got str)"),
        ({"staging_mib": True}, "extra.staging_mib=True must be of type float (got bool)"),
        ({"warm_peers": "h:1"}, "extra.warm_peers='h:1' must be of type array (got str)"),
        ({"warm_peers": ["h:1", 5600]}, "extra.warm_peers[1]=5600 must be of type str (got int)"),
        ({"nixl_progress_us": 1.5}, "extra.nixl_progress_us=1.5 must be of type int (got float)"),
        ({"nixl_progress_us": True}, "extra.nixl_progress_us=True must be of type int (got bool)"),
        ({"idle_progress_ms": None}, "extra.idle_progress_ms=None must be of type float (got nu"),
        ({"merge_runs": None}, "extra.merge_runs=None must be of type bool (got null)"),
        ({"engine_thread_nice": "19"}, "extra.engine_thread_nice='19' must be of type int (got s"),
        ({"engine_thread_nice": 2.5}, "extra.engine_thread_nice=2.5 must be of type int (got f"),
    ],
)
def test_an_extra_value_of_the_wrong_type_names_the_key_path_and_the_type(extra, fragment):
    refused(fragment, extra=extra)


def test_json_gives_the_same_errors_as_a_dict(tmp_path):
    path = tmp_path / "kv.json"
    path.write_text('{"kv_role": "kv_consumer", "engine_id": "d", "extra": {"staging_mib": "8"}}')
    with pytest.raises(ConfigError, match=re.escape("extra.staging_mib='8' must be of type float")):
        KVTransferConfig.from_json(str(path))
    with pytest.raises(ConfigError, match="is not valid JSON"):
        KVTransferConfig.from_json('{"kv_role": ')
    with pytest.raises(ConfigError, match=r"kv-transfer-config must be of type object \(got array"):
        KVTransferConfig.from_dict([1, 2])


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        ({"engine_id": "e"}, "kv_role is required (one of ['kv_producer', 'kv_consumer', 'kv_"),
        ({"kv_role": "kv_both"}, "engine_id is required"),
    ],
)
def test_a_missing_key_is_named(raw, fragment):
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        KVTransferConfig.from_dict(raw)


def test_ints_are_numbers_of_seconds_and_mib():
    config = decode(lease_s=12, heartbeat_s=2, extra={"staging_mib": 2, "idle_progress_ms": 5})
    assert (config.lease_s, config.heartbeat_s) == (12.0, 2.0)
    assert config.extra.staging_bytes == 2 << 20
    assert config.extra.idle_progress_ms == 5.0


# ---------------------------------------------------------------- ranges


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"kv_port": 70000}, "kv_port=70000 must lie in [0, 65535]"),
        ({"kv_port": -1}, "kv_port=-1 must lie in [0, 65535]"),
        ({"lease_s": 0}, "lease_s=0 must be positive"),
        ({"heartbeat_s": -1}, "heartbeat_s=-1 must be positive"),
        ({"handshake_timeout_s": 0}, "handshake_timeout_s=0 must be positive"),
        ({"transfer_timeout_s": -0.5}, "transfer_timeout_s=-0.5 must be positive"),
        ({"lease_s": 4, "heartbeat_s": 5}, "heartbeat_s=5 must be shorter than lease_s=4"),
        ({"engine_id": ""}, "engine_id must be a non-empty string"),
        ({"kv_buffer_device": "xpu"}, "kv_buffer_device='xpu' is not one of 'auto', 'cpu'"),
        ({"extra": {"staging_mib": 0}}, "extra.staging_mib=0 must be a positive number of MiB"),
        ({"extra": {"nixl_progress_us": -1}}, "extra.nixl_progress_us=-1 must be 0 (no thread)"),
        ({"extra": {"nixl_progress_us": 250}}, "or a multiple of 1000 microseconds: NIXL's"),
        ({"extra": {"idle_progress_ms": -2}}, "extra.idle_progress_ms=-2 must be >= 0"),
        ({"extra": {"busy_progress_us": -1}}, "extra.busy_progress_us=-1 must be 0 (off) or"),
        ({"extra": {"busy_progress_us": 10}}, "or at least 50 microseconds"),
        ({"extra": {"verify_rate": 1.5}}, "extra.verify_rate=1.5 must be a share of loads"),
        ({"extra": {"verify": "some"}}, "verify"),
        ({"extra": {"read_probe": "always"}}, "extra.read_probe"),
        ({"extra": {"engine_thread_nice": -1}}, "extra.engine_thread_nice=-1 must be an integer "),
        ({"extra": {"max_quarantined_mib": 0}}, "extra.max_quarantined_mib=0 must be a positive"),
        ({"extra": {"engine_thread_nice": 20}}, "from 0 (leave the engine thread's priority alo"),
        ({"extra": {"engine_step_wait": "yield"}}, "extra.engine_step_wait='yield' must be one of"),
        ({"extra": {"warm_peers": ["h"]}}, "extra.warm_peers entry 'h' is not 'host:port'"),
        ({"extra": {"warm_peers": ["h:0"]}}, "extra.warm_peers entry 'h:0' is not 'host:port'"),
        ({"extra": {"warm_peers": [":5600"]}}, "extra.warm_peers entry ':5600' is not"),
        ({"extra": {"warm_peers": ["h:x"]}}, "extra.warm_peers entry 'h:x' is not"),
        (
            {"kv_role": "kv_producer", "extra": {"warm_peers": ["h:5600"]}},
            "extra.warm_peers on a prefill in pull mode",
        ),
    ],
)
def test_a_value_out_of_range_is_named(changes, fragment):
    refused(fragment, **changes)


def test_a_pushing_prefill_may_warm_its_decodes():
    extra = {"transfer_mode": "push", "warm_peers": ["h:5600", "[::1]:5601"]}
    config = decode(kv_role="kv_producer", extra=extra)
    assert config.extra.warm_peer_addresses == [("h", 5600), ("[::1]", 5601)]


def test_keyword_construction_and_replace_run_the_same_range_checks():
    config = KVTransferConfig(kv_role=KVRole.PRODUCER, engine_id="e")
    assert config.extra == ExtraConfig() and config.extra.transfer_mode is TransferMode.PULL
    with pytest.raises(ConfigError, match=re.escape("heartbeat_s=60 must be shorter than")):
        msgspec.structs.replace(config, heartbeat_s=60)
    with pytest.raises(ConfigError, match=re.escape("extra.engine_thread_nice=25 must be")):
        ExtraConfig(engine_thread_nice=25)
    assert msgspec.structs.replace(config, kv_port=0).kv_port == 0


def test_a_dict_for_extra_in_keyword_construction_points_at_from_dict():
    with pytest.raises(ConfigError, match=r"extra=\{'merge_runs': True\} must be an ExtraConfig"):
        KVTransferConfig(kv_role=KVRole.PRODUCER, engine_id="e", extra={"merge_runs": True})  # type: ignore[arg-type]


# ---------------------------------------------------------------- round trips


def test_every_field_is_away_from_its_default_in_the_sample():
    """Guards the round trips below: a new field must be given a value in EVERY_FIELD."""
    defaults = KVTransferConfig(kv_role=KVRole.PRODUCER, engine_id="x")
    for struct, default in ((EVERY_FIELD, defaults), (EVERY_FIELD.extra, defaults.extra)):
        for name in struct.__struct_fields__:
            assert getattr(struct, name) != getattr(default, name), name


def test_every_field_round_trips_through_a_dict_and_json():
    raw = EVERY_FIELD.to_dict()
    assert raw["kv_role"] == "kv_both" and raw["extra"]["transfer_mode"] == "push"
    assert KVTransferConfig.from_dict(raw) == EVERY_FIELD
    assert KVTransferConfig.from_json(msgspec.json.encode(EVERY_FIELD).decode()) == EVERY_FIELD


def test_defaults_live_in_the_structs():
    config = decode()
    assert config.extra == ExtraConfig()
    assert config.extra.staging_bytes == 64 << 20
    assert config.extra.warm_peer_addresses == []
    assert (config.extra.nixl_progress_us, config.extra.idle_progress_ms) == (0, 0.0)
    assert (config.extra.merge_runs, config.extra.rewrite_on_save) == (False, False)
    assert config.extra.engine_thread_nice == 0


def test_the_config_is_frozen_and_hashable():
    with pytest.raises(AttributeError):
        EVERY_FIELD.extra.merge_runs = False  # type: ignore[misc]
    assert hash(EVERY_FIELD) == hash(KVTransferConfig.from_dict(EVERY_FIELD.to_dict()))


def test_a_key_that_is_not_a_string_is_refused_where_it_sits():
    refused("extra: every key must be a string", extra={1: 2})
    with pytest.raises(ConfigError, match="kv-transfer-config: every key must be a string"):
        KVTransferConfig.from_dict({**BASE, 5: "x"})
