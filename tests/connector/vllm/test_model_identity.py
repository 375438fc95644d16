"""What names a vLLM model to the handshake (kvbridge.connector.vllm.model_identity)."""

from __future__ import annotations

from types import SimpleNamespace

from kvbridge.connector.vllm.model_identity import architecture, served_fingerprint


def test_the_served_name_is_the_fingerprint_when_vllm_was_given_one() -> None:
    config = SimpleNamespace(model="/scratch/copy/Qwen3-0.6B", served_model_name="qwen3")
    assert served_fingerprint(config) == "qwen3"


def test_the_model_path_repeated_as_the_served_name_is_no_fingerprint() -> None:
    # vLLM's default: served_model_name is the --model argument, which differs between copies
    config = SimpleNamespace(model="/data/a/Qwen3-0.6B", served_model_name="/data/a/Qwen3-0.6B")
    assert served_fingerprint(config) == ""
    weights = SimpleNamespace(
        model="/tmp/x", model_weights="s3://b/q", served_model_name="s3://b/q"
    )
    assert served_fingerprint(weights) == ""


def test_a_list_of_served_names_gives_the_first() -> None:
    config = SimpleNamespace(model="/m", served_model_name=["qwen3", "alias"])
    assert served_fingerprint(config) == "qwen3"


def test_architecture_prefers_the_one_vllm_runs() -> None:
    both = SimpleNamespace(architecture="Qwen3ForCausalLM", architectures=["Other"])
    assert architecture(both) == "Qwen3ForCausalLM"
    assert architecture(SimpleNamespace(architectures=["LlamaForCausalLM"])) == "LlamaForCausalLM"
    assert architecture(SimpleNamespace()) == ""
