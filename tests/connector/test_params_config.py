"""KVTransferParams and KVTransferConfig at the edge: round trips, unknown keys, bad values."""

from __future__ import annotations

import json
import re

import msgspec
import pytest

from kvbridge.connector.common.config import ConfigError, FailurePolicy, KVRole, KVTransferConfig
from kvbridge.connector.common.params import KVTransferParams, ParamsError
from kvbridge.handshake.modes import TransferMode

FULL_PARAMS = KVTransferParams(
    do_remote_prefill=True,
    remote_engine_id="prefill-0",
    remote_host="10.0.0.7",
    remote_port=5600,
    remote_rank=1,
    remote_tp_size=2,
    remote_block_ids=[[4, 5, 6], [9], []],
    remote_first_block=[0, 2, 1],
    remote_block_size=16,
    num_tokens=45,
    remote_request_id="req-7",
)


# ---------------------------------------------------------------- params


def test_params_json_round_trip_keeps_every_field() -> None:
    data = FULL_PARAMS.to_json()
    assert KVTransferParams.from_json(data) == FULL_PARAMS
    assert KVTransferParams.from_json(data.decode()) == FULL_PARAMS
    assert json.loads(data)["remote_block_ids"] == [[4, 5, 6], [9], []]


def test_params_dict_round_trip_through_plain_json() -> None:
    raw = json.loads(json.dumps(FULL_PARAMS.to_dict()))
    assert raw["remote_first_block"] == [0, 2, 1]
    assert KVTransferParams.from_dict(raw) == FULL_PARAMS


def _older_params() -> type:
    """KVTransferParams as the release before pipeline stages declared it: every field but
    ``remote_pp_layers``, unknown keys refused."""
    fields = []
    for f in msgspec.structs.fields(KVTransferParams):
        if f.name == "remote_pp_layers":
            continue
        if f.default is not msgspec.NODEFAULT:
            fields.append((f.name, f.type, f.default))
        else:
            fields.append((f.name, f.type, msgspec.field(default_factory=f.default_factory)))
    return msgspec.defstruct(
        "OlderParams", fields, kw_only=True, frozen=True, forbid_unknown_fields=True
    )


def test_params_without_pipeline_stages_read_in_a_decode_that_predates_them() -> None:
    """A decode of the release before pipeline stages refuses unknown keys: params that
    name no stages leave the key out, params that do carry it and round-trip."""
    older = _older_params()
    assert "remote_pp_layers" not in FULL_PARAMS.to_dict()
    assert msgspec.json.decode(FULL_PARAMS.to_json(), type=older).remote_port == 5600
    staged = msgspec.structs.replace(FULL_PARAMS, remote_pp_layers=[[0, 2], [2, 4]])
    assert staged.to_dict()["remote_pp_layers"] == [[0, 2], [2, 4]]
    assert KVTransferParams.from_json(staged.to_json()) == staged
    with pytest.raises(msgspec.ValidationError, match="remote_pp_layers"):
        msgspec.json.decode(staged.to_json(), type=older)  # refused by name


def test_signatures_agree_with_a_decode_that_predates_pipeline_stages() -> None:
    """Signed params are checked by re-encoding them: a decode of the previous release
    encodes its own struct, without ``remote_pp_layers``. A prefill's signature over
    params that name no stages is the one that decode computes, and a decode reads params
    signed by the previous release's prefill."""
    import hashlib
    import hmac

    from kvbridge.connector.common.signing import _LABEL, ParamsSigner

    secret = b"s3cret"
    signer = ParamsSigner(secret, wall_clock=lambda: 1000.0)
    signed = signer.sign(FULL_PARAMS, ttl_s=60)
    older = msgspec.convert(msgspec.to_builtins(signed.to_dict()), type=_older_params())
    key = hmac.new(secret, _LABEL, hashlib.sha256).digest()
    theirs = msgspec.msgpack.encode(msgspec.structs.replace(older, signature=""))
    assert hmac.new(key, theirs, hashlib.sha256).hexdigest() == signed.signature
    # and the other way: the previous release's prefill signed its own struct's bytes
    old_signed = msgspec.structs.replace(
        msgspec.structs.replace(older, signature=""),
        signature=hmac.new(key, theirs, hashlib.sha256).hexdigest(),
    )
    signer.verify(KVTransferParams.from_dict(msgspec.to_builtins(old_signed)))


def test_params_defaults_ask_for_nothing() -> None:
    params = KVTransferParams.from_json(b"{}")
    assert not params.do_remote_prefill and not params.do_remote_decode
    assert params.remote_block_ids == []


def test_params_reject_unknown_keys() -> None:
    with pytest.raises(ParamsError, match="remote_blok_size"):
        KVTransferParams.from_dict({"do_remote_prefill": True, "remote_blok_size": 16})
    with pytest.raises(ParamsError, match="unknown field"):
        KVTransferParams.from_json(b'{"extra": 1}')


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"remote_port": "5600"}, "remote_port"),
        ({"remote_block_ids": [[1, "a"]]}, "remote_block_ids"),
        ({"num_tokens": 1.5}, "num_tokens"),
        ({"do_remote_prefill": "yes"}, "do_remote_prefill"),
    ],
)
def test_params_bad_types_name_the_field(raw: dict, field: str) -> None:
    with pytest.raises(ParamsError, match=field):
        KVTransferParams.from_dict(raw)


def test_params_malformed_json_is_a_params_error() -> None:
    with pytest.raises(ParamsError, match="invalid kv_transfer_params"):
        KVTransferParams.from_json(b'{"num_tokens": ')


def test_validate_for_load_accepts_complete_params() -> None:
    FULL_PARAMS.validate_for_load(3)


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"do_remote_prefill": False}, "do_remote_prefill"),
        ({"remote_host": ""}, "remote_host"),
        ({"remote_engine_id": "", "remote_request_id": ""}, "remote_request_id"),
        ({"remote_port": 0}, "remote_port=0"),
        ({"remote_port": 70000}, "remote_port=70000"),
        ({"remote_block_ids": [[1], [2]]}, "remote_block_ids has 2 lists"),
        ({"remote_first_block": [0]}, "remote_first_block has 1 entries"),
        ({"remote_block_size": 0}, "remote_block_size=0"),
        ({"num_tokens": -1}, "num_tokens=-1"),
        ({"remote_rank": 2}, r"remote_rank=2 must lie in \[0, remote_tp_size=2 x 1 pipeline"),
        (  # rank 4 of TP 2 x 2 stages: past the last stage
            {"remote_rank": 4, "remote_pp_layers": [[0, 2], [2, 4]]},
            r"remote_rank=4 must lie in \[0, remote_tp_size=2 x 2 pipeline",
        ),
        (
            {"remote_pp_layers": [[0, 2], [3, 4]]},
            r"stage 1 must hold layers \[first, end\) with first=2",
        ),
        ({"remote_pp_layers": [[0, 2], [2, 2]]}, r"stage 1 must hold .* end > first"),
        ({"remote_pp_layers": [[1, 2]]}, r"stage 0 must hold .* first=0"),
        (
            {"remote_pp_layers": [[0, 2], [2, 4]], "remote_rank": 0, "remote_port": 65533},
            "ports of 4 prefill ranks do not fit",
        ),
        ({"remote_tp_size": 0}, "remote_tp_size=0"),
        ({"remote_rank": 0, "remote_port": 65535}, "ports of 2 prefill ranks do not fit"),
    ],
)
def test_validate_for_load_names_the_bad_field(changes: dict, fragment: str) -> None:
    params = KVTransferParams.from_dict({**FULL_PARAMS.to_dict(), **changes})
    with pytest.raises(ParamsError, match=fragment):
        params.validate_for_load(3)


# ---------------------------------------------------------------- config


def test_config_from_json_parses_enums_and_extra() -> None:
    config = KVTransferConfig.from_json(
        '{"kv_role": "kv_consumer", "engine_id": "decode-0", "kv_port": 6100, '
        '"failure_policy": "fail", "lease_s": 12, "heartbeat_s": 2.5, '
        '"extra": {"staging_mib": 32}}'
    )
    assert config.kv_role is KVRole.CONSUMER
    assert config.failure_policy is FailurePolicy.FAIL
    assert (config.kv_port, config.lease_s, config.heartbeat_s) == (6100, 12, 2.5)
    assert config.extra.staging_mib == 32
    assert config.is_consumer and not config.is_producer


def test_config_from_json_file(tmp_path) -> None:
    path = tmp_path / "kv.json"
    path.write_text(json.dumps({"kv_role": "kv_both", "engine_id": "e"}))
    config = KVTransferConfig.from_json(str(path))
    assert config.kv_role is KVRole.BOTH
    assert config.is_consumer and config.is_producer
    assert config.failure_policy is FailurePolicy.RECOMPUTE  # the default


def test_config_rejects_unknown_keys_and_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"unknown kv-transfer-config key 'kv_prot'") as err:
        KVTransferConfig.from_dict({"kv_role": "kv_producer", "engine_id": "e", "kv_prot": 1})
    assert "kv_port" in str(err.value)


def test_config_rejects_unknown_extra_keys_and_lists_the_known_ones() -> None:
    """A typo in ``extra`` (here ``transfer_mod``) must not silently keep the default."""
    raw = {"kv_role": "kv_consumer", "engine_id": "e", "extra": {"transfer_mod": "push"}}
    unknown = r"unknown kv-transfer-config key 'extra\.transfer_mod'"
    with pytest.raises(ConfigError, match=unknown) as err:
        KVTransferConfig.from_dict(raw)
    assert "transfer_mode" in str(err.value)
    ok = KVTransferConfig.from_dict({**raw, "extra": {"transfer_mode": "push"}})
    assert ok.extra.transfer_mode is TransferMode.PUSH


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"kv_role": "prefill"}, "kv_role='prefill' is not one of"),
        ({"failure_policy": "retry"}, "failure_policy='retry' is not one of"),
        ({"kv_port": 70000}, "kv_port=70000"),
        ({"kv_port": "5600"}, "kv_port='5600' must be of type int"),
        ({"lease_s": "30"}, "lease_s='30' must be of type float"),
        ({"lease_s": -1}, "lease_s=-1 must be positive"),
        ({"heartbeat_s": 0}, "heartbeat_s=0"),
        ({"lease_s": 4, "heartbeat_s": 5}, "heartbeat_s=5 must be shorter than lease_s=4"),
        ({"engine_id": ""}, "engine_id must be a non-empty"),
        ({"engine_id": 5}, "engine_id=5 must be of type str"),
        ({"secret": 123}, "secret=123 must be of type str | null"),
        ({"extra": [1]}, "extra=[1] must be of type object (got array)"),
        ({"transfer_timeout_s": True}, "transfer_timeout_s=True must be of type float (got bool)"),
    ],
)
def test_config_bad_values_are_named(changes: dict, fragment: str) -> None:
    raw = {"kv_role": "kv_producer", "engine_id": "prefill-0", **changes}
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        KVTransferConfig.from_dict(raw)


def test_config_requires_a_role() -> None:
    with pytest.raises(ConfigError, match="kv_role is required"):
        KVTransferConfig.from_dict({"engine_id": "e"})


@pytest.mark.parametrize("text", ["[1, 2]", "{not json", "/no/such/file.json"])
def test_config_bad_json_is_a_config_error(text: str) -> None:
    with pytest.raises(ConfigError):
        KVTransferConfig.from_json(text)


def test_config_is_frozen() -> None:
    config = KVTransferConfig(kv_role=KVRole.PRODUCER, engine_id="e")
    with pytest.raises(AttributeError):
        config.lease_s = 1.0  # type: ignore[misc]
