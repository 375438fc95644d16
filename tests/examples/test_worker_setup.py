"""A worker's command line: the connector's ``kv_buffer_device`` follows ``--device``
unless the kv-transfer-config sets it, and ``/health`` reports the device."""

from __future__ import annotations

import json

import pytest
import torch

from kvbridge.connector.common.config import ConfigError
from kvbridge.examples.launch import Cluster, worker_args
from kvbridge.examples.worker_setup import build, make_parser, transfer_config

CUDA0 = torch.device("cuda", 0)  # only compared, never allocated on


def _args(*argv: str):
    return make_parser().parse_args(list(argv))


@pytest.mark.parametrize(("device", "want"), [(torch.device("cpu"), "cpu"), (CUDA0, "cuda")])
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_kv_buffer_device_follows_the_device_when_not_given(role, device, want):
    config = transfer_config(_args("--role", role), device)
    assert config is not None and config.kv_buffer_device == want
    given = json.dumps({"kv_role": config.kv_role.value, "engine_id": "x", "lease_s": 9})
    config = transfer_config(_args("--role", role, "--kv-transfer-config", given), device)
    assert config is not None and config.kv_buffer_device == want and config.lease_s == 9


@pytest.mark.parametrize("given", ["cpu", "cuda"])
def test_a_kv_buffer_device_the_user_gives_is_left_alone(given, tmp_path):
    raw = json.dumps({"kv_role": "kv_consumer", "engine_id": "d", "kv_buffer_device": given})
    config = transfer_config(_args("--role", "decode", "--kv-transfer-config", raw), CUDA0)
    assert config is not None and config.kv_buffer_device == given
    path = tmp_path / "kv.json"  # the same from a file
    path.write_text(raw)
    config = transfer_config(_args("--role", "decode", "--kv-transfer-config", str(path)), CUDA0)
    assert config is not None and config.kv_buffer_device == given


def test_a_config_file_without_the_key_follows_the_device(tmp_path):
    path = tmp_path / "kv.json"
    path.write_text(json.dumps({"kv_role": "kv_producer", "engine_id": "p"}))
    config = transfer_config(_args("--role", "prefill", "--kv-transfer-config", str(path)), CUDA0)
    assert config is not None and config.kv_buffer_device == "cuda"


def test_role_both_without_a_config_has_no_connector_and_a_wrong_role_fails():
    assert transfer_config(_args(), CUDA0) is None
    raw = json.dumps({"kv_role": "kv_producer", "engine_id": "p"})
    with pytest.raises(ConfigError, match="--role decode needs kv_role 'kv_consumer'"):
        transfer_config(_args("--role", "decode", "--kv-transfer-config", raw), CUDA0)


def test_health_info_reports_the_device():
    loop, info = build(_args("--device", "cpu"))  # not started: no thread, no engine yet
    assert info == {"model": "tiny-hybrid", "role": "both", "device": "cpu"}
    assert loop is not None


def test_launch_passes_the_device_to_both_workers(tmp_path):
    argv = worker_args("decode", {"kv_role": "kv_consumer"}, 16, "--max-num-seqs", "4")
    assert argv[argv.index("--device") + 1] == "cpu" and argv[-2:] == ["--max-num-seqs", "4"]
    cluster = Cluster(
        tmp_path,
        model="tiny-hybrid",
        device="cuda:0",
        prefill_block_size=64,
        decode_block_size=48,
        prefill_args=["--cross-layers"],
    )
    for name, block_size in (("prefill", "64"), ("decode", "48")):
        # argv[3:]: after python -m kvbridge.examples.server
        args = make_parser().parse_args(cluster[name].argv[3:])
        assert (args.device, args.model, args.block_size) == (
            "cuda:0",
            "tiny-hybrid",
            int(block_size),
        )
        assert args.cross_layers is (name == "prefill")


@pytest.mark.parametrize(
    ("role", "kv_role"), [("prefill", "kv_producer"), ("decode", "kv_consumer")]
)
def test_a_config_keeps_the_defaults_the_role_fills_in(role, kv_role, tmp_path):
    """``--role decode --kv-transfer-config '{"kv_port": 5701}'``: the role's kv_role and
    engine id stay, the config's keys are added; a key the config gives wins."""
    raw = json.dumps({"kv_port": 5701, "secret": "s" * 16})
    config = transfer_config(
        _args("--role", role, "--port", "8300", "--kv-transfer-config", raw), CUDA0
    )
    assert config is not None
    assert (config.kv_role.value, config.engine_id) == (kv_role, f"{role}-8300")
    assert (config.kv_port, config.secret) == (5701, "s" * 16)
    path = tmp_path / "kv.json"
    path.write_text(json.dumps({"engine_id": "mine"}))
    config = transfer_config(_args("--role", role, "--kv-transfer-config", str(path)), CUDA0)
    assert config is not None and (config.kv_role.value, config.engine_id) == (kv_role, "mine")


def test_a_config_that_is_not_an_object_names_the_problem(tmp_path):
    path = tmp_path / "kv.json"
    path.write_text("[1]")
    with pytest.raises(ConfigError, match="must be a JSON object, not list"):
        transfer_config(_args("--role", "decode", "--kv-transfer-config", str(path)), CUDA0)
    with pytest.raises(ConfigError, match="not valid JSON"):
        transfer_config(_args("--role", "decode", "--kv-transfer-config", "{nope"), CUDA0)
    with pytest.raises(ConfigError, match="neither JSON nor a file"):
        transfer_config(_args("--role", "decode", "--kv-transfer-config", "/no/such.json"), CUDA0)
