"""Wire messages: round trips, typed decode errors, schema evolution."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.handshake.errors import (
    IncompatiblePeerError,
    ProtocolError,
    UnknownRequestError,
    UnsupportedVersionError,
)
from kvbridge.handshake.messages import (
    PROTOCOL_VERSION,
    ErrorCode,
    ErrorReply,
    MetadataRequest,
    WireGroup,
    WireRegion,
    WireSpec,
    WorkerDescription,
    decode_reply,
    decode_request,
    encode,
)


def make_description(engine_id: str = "prefill-0", rank: int = 0) -> WorkerDescription:
    attention = WireSpec(
        kind="full_attention", block_size=16, num_kv_heads=2, head_size=64, dtype="float16"
    )
    state = WireSpec(
        kind="state",
        block_size=16,
        state_shapes=[[4, 128], [2, 8, 16]],
        state_dtypes=["float32", "bfloat16"],
        page_size_bytes=4096,
    )
    return WorkerDescription(
        protocol_version=PROTOCOL_VERSION,
        engine_id=engine_id,
        agent_name=f"{engine_id}-agent-{rank}",
        rank=rank,
        tp_size=2,
        model_name="tiny-hybrid",
        dtype="float16",
        num_layers=3,
        num_kv_heads=2,
        head_size=64,
        compat_hash="abc123",
        block_size=16,
        kernel_block_size=16,
        kv_layout="NHD",
        kv_packing="kv_split",
        cross_layer=False,
        groups=[
            WireGroup(group_id=0, layer_names=["layers.0", "layers.2"], spec=attention),
            WireGroup(group_id=1, layer_names=["layers.1"], spec=state),
        ],
        regions=[
            WireRegion(
                name="layers.0.k",
                base_addr=0x7F00_0000_0000,
                block_bytes=4096,
                block_stride_bytes=4096,
                num_blocks=128,
                memory_kind="DRAM",
                group_id=0,
                layer_index=0,
                kv_part=0,
            ),
            WireRegion(
                name="layers.1.state",
                base_addr=2**63 - 4096,
                block_bytes=4096,
                block_stride_bytes=8192,
                num_blocks=8,
                memory_kind="VRAM",
                device_id=1,
                group_id=1,
                layer_index=1,
            ),
        ],
        nixl_metadata=bytes(range(256)) * 4,
        side_channel_host="10.0.0.7",
        side_channel_port=5601,
    )


def test_request_round_trip() -> None:
    request = MetadataRequest(PROTOCOL_VERSION, requester_engine_id="decode-1", requester_rank=3)
    assert decode_request(encode(request)) == request
    assert msgspec.msgpack.decode(encode(request))["type"] == "MetadataRequest"


def test_description_round_trip_keeps_every_nested_field() -> None:
    description = make_description()
    decoded = decode_reply(encode(description))
    assert decoded == description
    assert isinstance(decoded, WorkerDescription)
    assert decoded.groups[1].spec.state_shapes == [[4, 128], [2, 8, 16]]
    assert decoded.regions[1].base_addr == 2**63 - 4096
    assert decoded.nixl_metadata == description.nixl_metadata


@pytest.mark.parametrize("code", list(ErrorCode))
def test_error_reply_round_trip_keeps_the_enum(code: ErrorCode) -> None:
    decoded = decode_reply(encode(ErrorReply(code=code, reason="because")))
    assert decoded == ErrorReply(code=code, reason="because")
    assert isinstance(decoded, ErrorReply) and decoded.code is code


@settings(max_examples=50, deadline=None)
@given(
    engine_id=st.text(max_size=40),
    rank=st.integers(0, 1 << 20),
    metadata=st.binary(max_size=2048),
    cross_layer=st.booleans(),
    port=st.integers(0, 65535),
)
def test_description_round_trip_property(
    engine_id: str, rank: int, metadata: bytes, cross_layer: bool, port: int
) -> None:
    description = msgspec.structs.replace(
        make_description(engine_id, rank),
        nixl_metadata=metadata,
        cross_layer=cross_layer,
        side_channel_port=port,
    )
    assert decode_reply(encode(description)) == description


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        (b"", "truncated"),
        (b"\xc1", "malformed request"),
        (msgspec.msgpack.encode([1, 2]), "Expected `object`"),
        (msgspec.msgpack.encode({"protocol_version": 1}), "no 'type' tag"),
        (
            msgspec.msgpack.encode({"type": "MetadataRequest", "protocol_version": "one"}),
            "$.protocol_version",
        ),
        (encode(MetadataRequest(PROTOCOL_VERSION))[:-3], "truncated"),
        (encode(MetadataRequest(PROTOCOL_VERSION)) + b"\x00", "trailing"),
    ],
)
def test_malformed_request_is_a_protocol_error_naming_the_problem(
    data: bytes, fragment: str
) -> None:
    with pytest.raises(ProtocolError, match="malformed request") as info:
        decode_request(data)
    assert fragment in str(info.value)
    assert type(info.value) is ProtocolError


def test_unknown_request_type_names_the_type_and_the_choices() -> None:
    with pytest.raises(UnknownRequestError, match=r"'WorkerDescription'.*MetadataRequest"):
        decode_request(encode(make_description()))


def test_reply_decoder_refuses_a_request() -> None:
    with pytest.raises(UnknownRequestError, match="unknown reply type 'MetadataRequest'"):
        decode_reply(encode(MetadataRequest(PROTOCOL_VERSION)))


def test_wrong_version_names_both_versions() -> None:
    future = PROTOCOL_VERSION + 1
    with pytest.raises(
        UnsupportedVersionError, match=f"version {future}.* speaks {PROTOCOL_VERSION}"
    ):
        decode_request(encode(MetadataRequest(future)))
    reply = msgspec.structs.replace(make_description(), protocol_version=future)
    with pytest.raises(UnsupportedVersionError, match=f"version {future}"):
        decode_reply(encode(reply))


def test_wrong_version_wins_over_an_unknown_layout_of_the_rest() -> None:
    # A later request may look nothing like this one beyond its envelope: still "wrong
    # version".
    future = PROTOCOL_VERSION + 1
    data = msgspec.msgpack.encode({"type": "MetadataRequest", "protocol_version": future, "x": [1]})
    with pytest.raises(UnsupportedVersionError):
        decode_request(data)


def test_error_reply_with_an_unknown_code_is_malformed() -> None:
    data = msgspec.msgpack.encode({"type": "ErrorReply", "code": "bogus", "reason": "?"})
    with pytest.raises(ProtocolError, match=r"malformed reply.*\$\.code"):
        decode_reply(data)


class _FutureDescription(WorkerDescription, frozen=True, tag="WorkerDescription"):
    """What a later protocol revision might send: one more field, last, with a default."""

    preferred_transport: str = "UCX"


def test_reply_with_an_extra_trailing_field_still_decodes() -> None:
    current = make_description()
    future = _FutureDescription(**msgspec.structs.asdict(current), preferred_transport="LIBFABRIC")
    data = encode(future)
    assert msgspec.msgpack.decode(data)["preferred_transport"] == "LIBFABRIC"
    assert decode_reply(data) == current


def test_reply_from_an_older_peer_without_defaulted_fields_still_decodes() -> None:
    current = make_description()
    fields = msgspec.to_builtins(current)
    del fields["side_channel_host"], fields["side_channel_port"]
    fields["nixl_metadata"] = current.nixl_metadata
    decoded = decode_reply(msgspec.msgpack.encode(fields))
    assert decoded == msgspec.structs.replace(current, side_channel_host="", side_channel_port=0)


def test_a_staging_arena_travels_and_an_older_peer_advertises_none() -> None:
    arena = WireRegion(
        name="staging",
        base_addr=1 << 40,
        block_bytes=1 << 20,
        block_stride_bytes=1 << 20,
        num_blocks=1,
        memory_kind="DRAM",
    )
    current = msgspec.structs.replace(make_description(), staging=arena)
    assert decode_reply(encode(current)) == current
    fields = msgspec.to_builtins(current)
    del fields["staging"]  # a peer from before push through staging slots
    fields["nixl_metadata"] = current.nixl_metadata
    decoded = decode_reply(msgspec.msgpack.encode(fields))
    assert isinstance(decoded, WorkerDescription) and decoded.staging is None


def test_messages_are_frozen() -> None:
    request = MetadataRequest(PROTOCOL_VERSION)
    with pytest.raises(AttributeError):
        request.protocol_version = 2  # type: ignore[misc]


def test_incompatible_peer_error_lists_one_difference_per_line() -> None:
    error = IncompatiblePeerError(
        [("block_size", 16, 64), ("kv_layout", "NHD", "XYZ")],
        peer="10.0.0.7:5601",
        hint="run both sides with the same model",
    )
    assert str(error).splitlines() == [
        "peer 10.0.0.7:5601 is incompatible (2 difference(s)):",
        "  block_size: local=16 remote=64",
        "  kv_layout: local='NHD' remote='XYZ'",
        "run both sides with the same model",
    ]
    assert error.differences == [("block_size", 16, 64), ("kv_layout", "NHD", "XYZ")]


def test_the_role_travels_and_an_older_peer_says_none() -> None:
    current = msgspec.structs.replace(make_description(), kv_role="kv_consumer")
    assert decode_reply(encode(current)) == current
    fields = msgspec.to_builtins(current)
    del fields["kv_role"]  # a peer from before descriptions carried the role
    fields["nixl_metadata"] = current.nixl_metadata
    decoded = decode_reply(msgspec.msgpack.encode(fields))
    assert isinstance(decoded, WorkerDescription) and decoded.kv_role == ""
    # appended: what the schema-evolution rule asks of a new one (later ones after it)
    assert WorkerDescription.__struct_fields__[-3:] == ("kv_role", "digest_version", "push_status")


def test_push_status_is_said_and_an_older_peer_says_nothing() -> None:
    current = make_description()
    fields = msgspec.to_builtins(current)
    del fields["push_status"]  # a peer from before PushStatus
    fields["nixl_metadata"] = current.nixl_metadata
    decoded = decode_reply(msgspec.msgpack.encode(fields))
    assert isinstance(decoded, WorkerDescription) and decoded.push_status is False
