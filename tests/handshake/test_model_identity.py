"""The handshake identifies a model by what decides its KV cache and its fingerprint,
never by the path it was loaded from (kvbridge.handshake.compat)."""

from __future__ import annotations

import pytest

from kvbridge.handshake.compat import check_compatible, compat_hash
from kvbridge.handshake.description import WorkerIdentity, describe, parse_description
from kvbridge.handshake.errors import IncompatiblePeerError
from kvbridge.handshake.messages import WorkerDescription, decode_reply, encode
from kvbridge.layouts.allocation import KVCacheBuffers
from kvbridge.layouts.groups import KVCacheConfig
from tests.handshake.plan_harness import cache_format, make_groups


def _description(
    engine: str,
    *,
    model_name: str = "/models/llama",
    architecture: str = "LlamaForCausalLM",
    fingerprint: str = "",
    head_size: int = 4,
) -> WorkerDescription:
    config = KVCacheConfig.uniform(make_groups(16, "F"), 8)
    buffers = KVCacheBuffers(config, cache_format("NHD", False))
    identity = WorkerIdentity(
        engine_id=engine,
        agent_name=engine,
        model_name=model_name,
        dtype="float16",
        num_layers=config.num_layers,
        num_kv_heads=2,
        head_size=head_size,
        architecture=architecture,
        model_fingerprint=fingerprint,
    )
    return describe(identity, buffers, nixl_metadata=b"", compat_hash=compat_hash(identity, config))


def test_a_copy_of_the_model_in_another_directory_pairs() -> None:
    prefill = _description("prefill", model_name="/data/a/Qwen3-0.6B")
    decode = _description("decode", model_name="/scratch/copy/Qwen3-0.6B")
    assert prefill.compat_hash == decode.compat_hash
    check_compatible(decode, prefill)  # no error


def test_a_hub_id_and_a_local_path_pair() -> None:
    check_compatible(
        _description("decode", model_name="Qwen/Qwen3-0.6B", fingerprint="qwen3"),
        _description("prefill", model_name="/models/Qwen3-0.6B", fingerprint="qwen3"),
    )


def test_different_fingerprints_name_the_field_both_values_and_the_key_to_set() -> None:
    with pytest.raises(IncompatiblePeerError) as info:
        check_compatible(
            _description("decode", fingerprint="llama-3-8b@r1"),
            _description("prefill", fingerprint="llama-3-8b@r2"),
            peer="10.0.0.5:5600",
        )
    assert info.value.differences == [("model_fingerprint", "llama-3-8b@r1", "llama-3-8b@r2")]
    text = str(info.value)
    assert "model_fingerprint: local='llama-3-8b@r1' remote='llama-3-8b@r2'" in text
    assert "extra.model_fingerprint" in text and "10.0.0.5:5600" in text
    assert "same KV-cache groups" not in text  # the shapes agree: no advice about them


def test_a_fingerprint_known_on_one_side_only_is_not_compared() -> None:
    check_compatible(_description("decode", fingerprint="served"), _description("prefill"))


def test_different_architectures_are_refused_by_name() -> None:
    with pytest.raises(IncompatiblePeerError) as info:
        check_compatible(
            _description("decode", architecture="LlamaForCausalLM"),
            _description("prefill", architecture="MistralForCausalLM"),
        )
    assert info.value.differences == [("architecture", "LlamaForCausalLM", "MistralForCausalLM")]
    assert "different model architectures" in str(info.value)


def test_a_shape_difference_keeps_the_shape_advice() -> None:
    with pytest.raises(IncompatiblePeerError) as info:
        check_compatible(_description("decode"), _description("prefill", head_size=8))
    names = [name for name, _, _ in info.value.differences]
    assert "head_size" in names and "model_name" not in names
    assert "same KV-cache groups" in str(info.value)


def test_architecture_and_fingerprint_travel_and_parse() -> None:
    sent = _description("prefill", architecture="Qwen3ForCausalLM", fingerprint="qwen3@main")
    received = decode_reply(encode(sent))
    assert isinstance(received, WorkerDescription)
    identity = parse_description(received).identity
    assert (identity.architecture, identity.model_fingerprint) == ("Qwen3ForCausalLM", "qwen3@main")
